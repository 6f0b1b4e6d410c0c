"""Training and held-out examples: reasoning-gym generators or a local file, split without overlap.

    data = load_task(cfg.train_dataset, eval_size=cfg.evaluator.size, seed=cfg.seed)
    messages = build_messages(data.train[0], cfg.train_dataset.system_prompt)

`task` is a reasoning-gym procedural task (PROCEDURAL_TASKS) or `file`, which reads
`path`: a JSONL file, a Parquet file (needs pyarrow) or a directory written by
Hugging Face `datasets.save_to_disk` (needs datasets). The held-out split never shares a
question (compared after normalising case and whitespace) with the training split.
Anything wrong with the data raises `DataError`, one line saying what, where and how to fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from a3po.config.load import suggest
from a3po.config.schema import DatasetConfig
from a3po.data import generated

PROCEDURAL_TASKS = ("chain_sum", "basic_arithmetic", "gsm_symbolic", "countdown")
FILE_TASK = "file"


class DataError(ValueError):
    """A one-line, user-facing description of bad data or a bad data setting: what, where, how to fix."""


@dataclass
class Example:
    question: str
    answer: str  # the reference final answer as text ('... #### 72' is stored as '72')
    index: int  # position in its split: stable across runs, so data order can resume
    meta: dict = field(default_factory=dict)  # {'entry': reasoning-gym entry} or {'row': row, 'source': 'file:line'}


@dataclass
class TaskData:
    name: str
    train: list[Example]
    eval: list[Example]  # held out: no question in here appears in train


def load_task(cfg: DatasetConfig, eval_size: int, seed: int) -> TaskData:
    """The task named by `cfg.task`, split into `eval_size` held-out examples and the training rest."""
    if cfg.task in PROCEDURAL_TASKS:
        return _load_procedural(cfg.task, dict(cfg.task_params), cfg.size, eval_size, seed)
    if cfg.task == FILE_TASK:
        if not cfg.path:
            raise DataError("train_dataset.task=file needs train_dataset.path: "
                            "a .jsonl/.parquet file or a saved dataset directory")
        return _load_file(cfg.path, cfg.question_key, cfg.answer_key, eval_size, seed)
    allowed = (*PROCEDURAL_TASKS, FILE_TASK)
    raise DataError(f"train_dataset.task={cfg.task!r} is not a known task{suggest(cfg.task, allowed)}; "
                    f"allowed: {', '.join(allowed)}")


def build_messages(example: Example, system_prompt: str | None) -> list[dict]:
    """Chat messages for `tokenizer.apply_chat_template`; no system message lets the template use its default."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": example.question}]


def normalise_question(text: str) -> str:
    """The key under which two questions count as the same: case and whitespace do not matter."""
    return " ".join(text.split()).casefold()


# ---------------------------------------------------------------- procedural tasks


def derived_seed(seed: int, split: str) -> int:
    """A 48-bit seed per split.

    reasoning-gym draws item i from `Random(seed + i)`, so the seeds s and s+1 give the same
    items shifted by one. Hashing puts the two splits' seed ranges far apart.
    """
    return int.from_bytes(hashlib.sha256(f"a3po:{seed}:{split}".encode()).digest()[:6], "big")


def _load_procedural(task: str, params: dict, size: int, eval_size: int, seed: int) -> TaskData:
    """Held-out split first (`eval_size` distinct questions), then `size` training draws minus held-out questions.

    The dedupe matters: a small problem space (two-term one-digit sums are ~200 problems)
    makes two independent draws overlap almost completely, and a "held-out"
    accuracy that includes training questions measures memorisation.
    """
    for reserved in ("seed", "size"):
        if reserved in params:
            raise DataError(f"train_dataset.task_params.{reserved} is set by a3po "
                            f"(seed, train_dataset.size); remove it")
    name = generated.key(task, params, seed, size, eval_size)
    kept = generated.load(name)
    if kept is not None:
        return TaskData(task, _examples(kept[0]), _examples(kept[1]))
    max_draws = 20 * eval_size + 1000
    eval_draws = _generator(task, params, derived_seed(seed, "eval"), max_draws)
    eval_entries, seen = [], set()
    for entry in _entries(task, params, eval_draws, max_draws):
        key = normalise_question(entry["question"])
        if key not in seen:
            seen.add(key)
            eval_entries.append(entry)
            if len(eval_entries) == eval_size:
                break
    else:
        raise DataError(f"{task} with task_params {params} gave only {len(eval_entries)} distinct questions in "
                        f"{max_draws} draws, fewer than evaluator.size={eval_size}: lower evaluator.size "
                        f"or widen train_dataset.task_params")
    train_draws = _generator(task, params, derived_seed(seed, "train"), size)
    train_entries = [e for e in _entries(task, params, train_draws, size)
                     if normalise_question(e["question"]) not in seen]
    if not train_entries:
        raise DataError(f"all {size} training draws of {task} are held-out questions: the problem space is too small; "
                        f"widen train_dataset.task_params or lower evaluator.size")
    generated.keep(name, train_entries, eval_entries)
    return TaskData(task, _examples(train_entries), _examples(eval_entries))


def _examples(entries: list[dict]) -> list[Example]:
    return [Example(e["question"], str(e["answer"]), i, {"entry": e}) for i, e in enumerate(entries)]


def _generator(task: str, params: dict, seed: int, size: int):
    """The reasoning-gym dataset, with a bad parameter reported by name."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    config_cls = DATASETS[task][1]
    allowed = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
    for name in params:
        if name not in allowed:
            hint = ("; the default task_params are chain_sum's: set train_dataset.task_params={} or this task's own"
                    if params == DatasetConfig().task_params else "")
            raise DataError(f"train_dataset.task_params.{name} is not a parameter of {task}{suggest(name, allowed)}; "
                            f"allowed: {', '.join(allowed)}{hint}")
    try:
        return reasoning_gym.create_dataset(task, seed=seed, size=size, **params)
    except Exception as e:  # the config's validate() asserts, naming the parameter
        raise DataError(f"train_dataset.task_params {params} rejected by {task}: {_reason(e)}; "
                        f"fix that parameter") from None


def _entries(task: str, params: dict, dataset, n: int) -> Iterator[dict]:
    """The first n draws, skipping the rare one the generator fails on.

    reasoning-gym 0.1.25's basic_arithmetic raises ZeroDivisionError on about 1 draw in
    20000 with its default parameters; more than 1% failing means the parameters are bad.
    """
    failed = 0
    for i in range(n):
        try:
            entry = dataset[i]
        except Exception as e:
            failed += 1
            if failed > max(20, n // 100):
                raise DataError(f"{task} failed to generate {failed} of {i + 1} examples with "
                                f"train_dataset.task_params {params} (last: {_reason(e)}); "
                                f"change those parameters") from None
            continue
        yield entry


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


# ---------------------------------------------------------------- files


def _load_file(path: str, question_key: str, answer_key: str, eval_size: int, seed: int) -> TaskData:
    """Eval = `eval_size` rows with distinct questions chosen by a seeded shuffle; train = the rest in file order."""
    rows = [_example_from_row(row, where, question_key, answer_key) for row, where in _read_rows(Path(path))]
    if not rows:
        raise DataError(f"{path} holds no rows: it must have at least evaluator.size + 1 examples")
    if eval_size >= len(rows):
        raise DataError(f"{path} has {len(rows)} rows but evaluator.size={eval_size} would leave none for training: "
                        f"lower evaluator.size below {len(rows)}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    held, seen = set(), set()
    for i in order:
        key = normalise_question(rows[i].question)
        if key not in seen:
            seen.add(key)
            held.add(i)
            if len(held) == eval_size:
                break
    train = [ex for i, ex in enumerate(rows) if i not in held and normalise_question(ex.question) not in seen]
    evals = [rows[i] for i in sorted(held)]
    if len(held) < eval_size or not train:
        raise DataError(f"{path} has only {len(seen)} distinct questions, too few for evaluator.size={eval_size} "
                        f"plus a training split: lower evaluator.size")
    for split in (train, evals):
        for i, ex in enumerate(split):
            ex.index = i
    return TaskData(FILE_TASK, train, evals)


def _read_rows(path: Path) -> Iterator[tuple[Any, str]]:
    """(row, 'where') pairs; 'where' is file:line for JSONL and 'path row N' otherwise (N from 1)."""
    if not path.exists():
        raise DataError(f"train_dataset.path {str(path)!r} does not exist "
                        f"(relative paths are from {Path.cwd()}): fix the path")
    if path.is_dir():
        yield from _read_saved_dataset(path)
    elif path.suffix in (".jsonl", ".ndjson"):
        yield from _read_jsonl(path)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path)
    else:
        raise DataError(f"train_dataset.path {str(path)!r}: unsupported file type {path.suffix or '(none)'}; "
                        f"use .jsonl, .parquet or a directory saved by datasets.save_to_disk")


def _read_jsonl(path: Path) -> Iterator[tuple[Any, str]]:
    """Read as bytes and decoded line by line, so a non-UTF-8 byte is reported with its line and column."""
    try:
        f = path.open("rb")
    except OSError as e:
        raise DataError(f"train_dataset.path {str(path)!r} cannot be read ({e.strerror}): "
                        f"check its permissions") from None
    with f:
        for n, raw in enumerate(f, 1):
            line = _decode(raw, path, n)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: invalid JSON ({e.msg} at column {e.colno}): "
                                f"make each line one JSON object") from None
            yield row, f"{path}:{n}"


def _decode(raw: bytes, path: Path, n: int) -> str:
    """One line as text; a UTF-8 byte-order mark at the start of the file is allowed (some editors write one)."""
    try:
        return raw.decode("utf-8-sig" if n == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{n}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): "
                        "save the file as UTF-8 (e.g. iconv -f <its encoding> -t utf-8)") from None


def _read_parquet(path: Path) -> Iterator[tuple[Any, str]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow "
                        f"(or convert the file to .jsonl)") from None
    for n, row in enumerate(pq.read_table(path).to_pylist(), 1):
        yield row, f"{path} row {n}"


def _read_saved_dataset(path: Path) -> Iterator[tuple[Any, str]]:
    """A `datasets.save_to_disk` directory: a Dataset, or a DatasetDict whose 'train' (or only) split is used."""
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any((path / m).exists() for m in markers):
        raise DataError(f"train_dataset.path {str(path)!r} is a directory but not one saved by datasets.save_to_disk "
                        f"(no {' / '.join(markers)}): point it at a .jsonl/.parquet file or such a directory")
    try:
        import datasets
    except ImportError:
        raise DataError(f"reading the saved dataset {path} needs the datasets package: pip install datasets "
                        f"(or export it to .jsonl)") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if "train" in ds:
            ds = ds["train"]
        elif len(splits) == 1:
            ds = ds[splits[0]]
        else:
            raise DataError(f"{path} holds the splits {splits} and none is 'train': save the split to use on its own")
    for n, row in enumerate(ds, 1):
        yield row, f"{path} row {n}"


_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")


def _example_from_row(row: Any, where: str, question_key: str, answer_key: str) -> Example:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object with keys {question_key!r} and {answer_key!r}, "
                        f"got {type(row).__name__}")
    question = _text_field(row, where, question_key, "train_dataset.question_key")
    answer = _text_field(row, where, answer_key, "train_dataset.answer_key")
    if "####" in answer:  # GSM8K: worked solution, then '#### 72'
        answer = answer.rsplit("####", 1)[1].strip()
        if _THOUSANDS.fullmatch(answer):
            answer = answer.replace(",", "")
        if not answer:
            raise DataError(f"{where}: key {answer_key!r} has nothing after '####': put the final answer there")
    return Example(question, answer, index=-1, meta={"row": row, "source": where})


def _text_field(row: dict, where: str, key: str, setting: str) -> str:
    if key not in row:
        raise DataError(f"{where}: missing key {key!r} (keys present: {', '.join(map(repr, row)) or 'none'}); "
                        f"add it or set {setting}")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: key {key!r} must be a string or number, got {type(value).__name__}: fix that row")
    text = str(value).strip()
    if not text:
        raise DataError(f"{where}: key {key!r} is empty: fill it in or remove the row")
    return text
