"""Reward functions (completion text, Example) -> float.

    reward_fn = build_reward(cfg.train_dataset, data)   # picklable: it is scored in a child process
                                                        # with a timeout (data/scoring.py)

`train_dataset.reward` chooses the function:
- task: the reasoning-gym task's own `score_answer`, applied to the final answer extracted
  from the completion (the last number; for countdown the last arithmetic expression).
  On raw text it gives partial credit to any completion that merely contains the right
  number. Files have no task scorer and use math_verify.
- math_verify: `math_verify.verify` of the parsed reference against the parsed completion, 1 or 0.
- exact: the extracted final number equals the reference numerically ('72.0' == '72',
  '1,234' == '1234'); a non-numeric reference is compared as text (case and spacing aside).
- module:function: your own `function(completion, example) -> float`, imported from
  sys.path or the current directory.

Kept as reasoning-gym defines them: chain_sum's scorer still gives partial credit when the
reference is a substring of the extracted number (reference 7, answer 17 -> 0.5), and
gsm_symbolic and countdown give 0.01-0.05 for a wrong but well-formed answer.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from pathlib import Path
from typing import Any

from a3po.config.load import suggest
from a3po.config.schema import DatasetConfig
from a3po.data.tasks import PROCEDURAL_TASKS, DataError, Example, TaskData

RewardFn = Callable[[str, Example], float]

# ---------------------------------------------------------------- answer extraction

# an optional sign, an integer with or without thousands commas, an optional fraction
_NUMBER = re.compile(r"(?P<sign>[-\u2212]?)(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?P<frac>\.\d+)?")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")


def extract_final_answer(text: str) -> str | None:
    """The final numeric answer of a completion, as written but without thousands commas; None if there is none.

    The number after the last '####' (GSM8K) if there is one, else the last number inside the
    last \\boxed{...}, else the last number in the text. A '-' is a sign unless it follows a
    number or a closing bracket, or touches a letter ('12 - 7' and 'x-7' end in 7, 'is -3' in -3).
    """
    if not text:
        return None
    if "####" in text:
        found = _numbers(text.rsplit("####", 1)[1])
        if found:
            return found[0]
    boxed = _last_boxed(text)
    if boxed:
        found = _numbers(boxed)
        if found:
            return found[-1]
    found = _numbers(text)
    return found[-1] if found else None


def _numbers(text: str) -> list[str]:
    out = []
    for m in _NUMBER.finditer(text):
        sign = "-" if m["sign"] and _is_sign(text, m.start()) else ""
        out.append(sign + m["int"].replace(",", "") + (m["frac"] or ""))
    return out


def _is_sign(text: str, i: int) -> bool:
    """Whether the '-' at text[i] negates the number after it rather than subtracting."""
    before = text[:i]
    if before and not before[-1].isspace():
        return not (before[-1].isalnum() or before[-1] in ")]}")
    before = before.rstrip()
    return not before or not (before[-1].isdigit() or before[-1] in ")]}")


def _last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...}, braces balanced; None if there is none or it is unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


_EXPRESSION_RUN = re.compile(r"[\d \t+\-*/()\u00d7\u00f7]+")
_HAS_OPERATOR = re.compile(r"[\d)]\s*[-+*/\u00d7\u00f7]\s*[\d(]")


def extract_final_expression(text: str) -> str | None:
    """The last arithmetic expression (digits, + - * / and brackets) of a completion, for countdown.

    Taken from the last \\boxed{...} if there is one; an expression with an operator wins over
    a lone number after it ('94*4 - 61 - 6 = 309' gives '94*4 - 61 - 6'). × and ÷ become * and /.
    """
    if not text:
        return None
    text = _last_boxed(text) or text
    runs = [r.strip() for r in _EXPRESSION_RUN.findall(text) if any(c.isdigit() for c in r)]
    if not runs:
        return None
    with_op = [r for r in runs if _HAS_OPERATOR.search(r)]
    expr = (with_op or runs)[-1].replace("\u00d7", "*").replace("\u00f7", "/")
    while expr.startswith("(") and expr.count("(") > expr.count(")"):
        expr = expr[1:].lstrip()
    while expr.endswith(")") and expr.count(")") > expr.count("("):
        expr = expr[:-1].rstrip()
    return expr


def as_number(text: str | None) -> Decimal | None:
    """A finite Decimal if the text is a plain number ('1,234', ' -3.50 '), else None."""
    if text is None:
        return None
    text = text.strip().replace("\u2212", "-")
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def canonical_number(text: str | None) -> str | None:
    """'72.0' -> '72', '-0.50' -> '-0.5': the form reasoning-gym's string-comparing scorers expect."""
    value = as_number(text)
    if value is None:
        return text
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _number_answer(completion: str) -> str | None:
    return canonical_number(extract_final_answer(completion))


ANSWER_EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "chain_sum": _number_answer,
    "basic_arithmetic": _number_answer,
    "gsm_symbolic": _number_answer,
    "countdown": extract_final_expression,
}
assert set(ANSWER_EXTRACTORS) == set(PROCEDURAL_TASKS), "every procedural task needs an answer extractor"

# ---------------------------------------------------------------- reward functions (picklable classes)


class TaskScorer:
    """The reasoning-gym task's `score_answer` on the extracted final answer; the scorer is rebuilt per process."""

    def __init__(self, task: str, task_params: dict):
        self.task, self.task_params = task, dict(task_params)
        self._dataset = None

    def __call__(self, completion: str, example: Example) -> float:
        if self._dataset is None:
            import reasoning_gym
            self._dataset = reasoning_gym.create_dataset(self.task, seed=0, size=1, **self.task_params)
        answer = ANSWER_EXTRACTORS[self.task](completion)
        return float(self._dataset.score_answer(answer, example.meta["entry"]))

    def __getstate__(self) -> dict:
        return {"task": self.task, "task_params": self.task_params}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["task"], state["task_params"])


@lru_cache(maxsize=8192)
def _parse_gold(answer: str) -> list:
    import math_verify
    gold = math_verify.parse(answer, parsing_timeout=None)
    if not gold:  # plain expressions such as '1/2' sometimes parse only inside math delimiters
        gold = math_verify.parse(f"${answer}$", parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify cannot parse the reference answer {answer!r}")
    return gold


class MathVerifyReward:
    """1.0 if math_verify finds the completion's answer equal to the reference, else 0.0.

    The timeouts are off (they use signals, which raise outside the main thread);
    the scoring process (data/scoring.py) bounds the time instead.
    """

    @staticmethod
    def warm_up() -> None:
        import math_verify  # noqa: F401 - sympy and its parsers: seconds, which are not a call's

    def __call__(self, completion: str, example: Example) -> float:
        import math_verify
        gold = _parse_gold(example.answer)
        pred = math_verify.parse(completion, parsing_timeout=None)
        return 1.0 if pred and math_verify.verify(gold, pred, timeout_seconds=None) else 0.0


def _final_text(text: str) -> str:
    """A non-numeric final answer: \\boxed{...}, else after '####', else the last non-empty line; normalised."""
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    text = _last_boxed(text) or text
    lines = [line for line in text.splitlines() if line.strip()]
    return _normal_text(lines[-1] if lines else "")


def _normal_text(text: str) -> str:
    return " ".join(text.strip().strip("$").strip().rstrip(".").split()).casefold()


class ExactReward:
    """1.0 if the final answer equals the reference: numerically when the reference is a number, else as text."""

    def __call__(self, completion: str, example: Example) -> float:
        reference = as_number(example.answer)
        if reference is None:
            return float(_final_text(completion) == _normal_text(example.answer))
        return float(as_number(extract_final_answer(completion)) == reference)


class Imported:
    """A user's `module:attribute` (a reward function, an environment class); pickled as its spec and
    re-imported in the receiving process."""

    def __init__(self, spec: str):
        self.spec = spec
        self.search_dir: str | None = None  # where the module was found, so a spawned worker finds it too
        self._obj = None

    def resolve(self) -> Any:
        if self._obj is None:
            module_name, _, attr = self.spec.partition(":")
            _ensure_on_path(os.getcwd())
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:
                if not self.search_dir:
                    raise
                _ensure_on_path(self.search_dir)
                module = importlib.import_module(module_name)
            obj: Any = module
            for part in attr.split("."):
                obj = getattr(obj, part)
            self.search_dir = self.search_dir or _root_dir(module_name)
            self._obj = obj
        return self._obj

    def __call__(self, *args):
        return self.resolve()(*args)

    def warm_up(self) -> None:
        self.resolve()

    def __getstate__(self) -> dict:
        return {"spec": self.spec, "search_dir": self.search_dir}

    def __setstate__(self, state: dict) -> None:
        self.spec, self.search_dir, self._obj = state["spec"], state["search_dir"], None


def _ensure_on_path(directory: str) -> None:
    if directory not in sys.path:
        sys.path.append(directory)


def _root_dir(module_name: str) -> str | None:
    """The sys.path entry the module's top-level package was imported from, if it came from a file."""
    top = sys.modules.get(module_name.split(".")[0])
    if top is None:
        return None
    if getattr(top, "__path__", None):
        return os.path.dirname(list(top.__path__)[0])
    return os.path.dirname(top.__file__) if getattr(top, "__file__", None) else None


def import_spec(spec: str, setting: str, what: str) -> tuple[Imported, Any]:
    """`module:attribute` imported for the config key `setting`, and what it names; a DataError says why not."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise DataError(f"{setting}={spec!r}: write a custom {what}")
    ref = Imported(spec)
    try:
        obj = ref.resolve()
    except ImportError as e:
        missing = e.name if isinstance(e, ModuleNotFoundError) and e.name else None
        if missing and not (module_name == missing or module_name.startswith(missing + ".")):
            raise DataError(f"{setting}={spec!r}: {module_name!r} imports {missing!r}, which is not installed here; "
                            f"pip install the package that provides it") from None
        raise DataError(f"{setting}={spec!r}: cannot import {module_name!r} ({e}){_module_hint(module_name, attr, e)}; "
                        f"put it on PYTHONPATH or in the current directory ({os.getcwd()})") from None
    except AttributeError:
        raise DataError(f"{setting}={spec!r}: {module_name!r} has no attribute {attr!r}"
                        f"{_attribute_hint(module_name, attr)}") from None
    except Exception as e:
        raise DataError(f"{setting}={spec!r}: importing {module_name!r} raised "
                        f"{type(e).__name__}: {e}") from None
    return ref, obj


def _attribute_hint(module_name: str, attr: str) -> str:
    """A "did you mean" for the first missing part of a dotted attribute, among the public names where it is
    missing, written as the whole module:attribute to set."""
    obj, parts = sys.modules.get(module_name), attr.split(".")
    if obj is None:  # the import itself raised AttributeError
        return ""
    found = 0
    while found < len(parts) and hasattr(obj, parts[found]):
        obj, found = getattr(obj, parts[found]), found + 1
    if found == len(parts):
        return ""
    before = "".join(f"{p}." for p in parts[:found])
    names = [n for n in dir(obj) if not n.startswith("_")]
    return suggest(parts[found], names, lambda name: f"{module_name}:{before}{name}")


def _module_hint(module_name: str, attr: str, error: ImportError) -> str:
    """A "did you mean" for a misspelt top-level module, among the modules and packages in the current directory."""
    top, rest = module_name.split(".")[0], module_name[len(module_name.split(".")[0]):]
    if not isinstance(error, ModuleNotFoundError) or error.name != top:
        return ""
    here = Path.cwd()
    found = [p.stem for p in here.glob("*.py")] + [p.parent.name for p in here.glob("*/__init__.py")]
    return suggest(top, found, lambda name: f"{name}{rest}:{attr}")


def _user_reward(spec: str) -> Imported:
    reward, fn = import_spec(spec, "train_dataset.reward", "reward as module:function")
    attr = spec.partition(":")[2]
    if not callable(fn):
        raise DataError(f"train_dataset.reward={spec!r}: {attr!r} is of type {type(fn).__name__}, not a function; "
                        "point it at a function (completion, example) -> float")
    try:
        inspect.signature(fn).bind("completion", "example")
    except TypeError:
        raise DataError(f"train_dataset.reward={spec!r}: {attr} must accept (completion, example); "
                        f"define it as def {attr.rsplit('.', 1)[-1]}(completion, example) -> float") from None
    except ValueError:
        pass  # no signature to inspect (some builtins): trust it
    return reward


def _task_reward(cfg: DatasetConfig, task: TaskData) -> RewardFn:
    return TaskScorer(task.name, cfg.task_params) if task.name in ANSWER_EXTRACTORS else MathVerifyReward()


BUILTIN_REWARDS: dict[str, Callable[[DatasetConfig, TaskData], RewardFn]] = {
    "task": _task_reward,
    "math_verify": lambda cfg, task: MathVerifyReward(),
    "exact": lambda cfg, task: ExactReward(),
}


def build_reward(cfg: DatasetConfig, task: TaskData) -> RewardFn:
    """The reward function `cfg.reward` names, as a picklable callable (it travels to rollout workers)."""
    if cfg.reward in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[cfg.reward](cfg, task)
    if ":" in cfg.reward:
        return _user_reward(cfg.reward)
    raise DataError(f"train_dataset.reward={cfg.reward!r} is unknown{suggest(cfg.reward, BUILTIN_REWARDS)}; "
                    f"use {', '.join(BUILTIN_REWARDS)} or module:function")


# ---------------------------------------------------------------- safe calls
