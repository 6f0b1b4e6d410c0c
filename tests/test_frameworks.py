"""Agents built with agent frameworks, trained as they are: examples/openai_agents_agent.py (the openai-agents
extra) and examples/pydantic_ai_agent.py (the pydantic-ai extra) run unchanged in a real agent process against a
rollout worker's endpoint, the tiny model in the local engine (tests/test_agents.py's harness).

A random tiny model never writes a tool call, so the fixture teaches it one conversation by supervised steps
on its generated parts: the example's instructions and "What is 3 + 4?", then the Hermes call
`calculate("3 + 4")`, the tool's "7", then "7". Greedy decoding then writes the call, the framework's own loop
reads it from `tool_calls`, runs its tool and sends the result back, and the model answers.

Proves, per framework: the episode's two calls continue one row; the tokens with loss mask 1 are exactly the
generated ones (the call text, the answer, each end token) with their log-probs and version; what the
framework sent after the call (the tool's result in the template) has mask 0, log-prob 0 and version -1; the
reward is the example's own. A test skips only where its framework's extra is not installed (`make` installs it).
"""

import ast
import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch

from a3po.data.rewards import Imported
from a3po.rollout.prompts import encode_messages

ROOT = Path(__file__).parent.parent
DOC = (ROOT / "docs" / "training.md").read_text()
# (the framework's module, the example's module, the docs' heading of its worked example)
FRAMEWORKS = {"openai-agents": ("agents", "examples.openai_agents_agent", "### OpenAI Agents SDK"),
              "pydantic-ai": ("pydantic_ai", "examples.pydantic_ai_agent", "### Pydantic AI")}
QUESTION = "What is 3 + 4?"
CALL = '<tool_call>{"name": "calculate", "arguments": {"expression": "3 + 4"}}</tool_call>'
TEACH_STEPS = 400  # a ceiling: teaching stops once greedy decoding writes every taught token


def conversation(instructions: str) -> list[dict]:
    return [{"role": "system", "content": instructions}, {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": CALL}, {"role": "tool", "content": "7"},
            {"role": "assistant", "content": "7"}]


def taught_tokens(tok, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The conversation as the engine sees it, and 1 on each assistant reply's tokens (its end token included)."""
    eos = tok.eos_token
    ids, mask, text = [], [], ""
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:k], tokenize=False, add_generation_prompt=True)
        assert before.startswith(text)
        for piece, taught in ((before[len(text):], 0), (m["content"] + eos, 1)):
            piece_ids = tok(piece, add_special_tokens=False)["input_ids"]
            ids, mask, text = ids + piece_ids, mask + [taught] * len(piece_ids), text + piece
    return ids, mask


def teach(model, tok, messages: list[dict]) -> None:
    """Supervised steps on the assistant replies until each is the greedy choice at every one of its tokens."""
    ids, mask = taught_tokens(tok, messages)
    x, y = torch.tensor([ids]), torch.tensor(ids[1:])  # (1, T), (T-1,)
    w = torch.tensor(mask[1:], dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread, and the suite's processes share cores
    try:
        for _ in range(TEACH_STEPS):
            logits = model(x).logits[0, :-1].float()  # (T-1, V)
            nll = torch.nn.functional.cross_entropy(logits, y, reduction="none")
            taught = w > 0
            if (logits.argmax(-1)[taught] == y[taught]).all() and nll[taught].max() < 0.1:
                return
            opt.zero_grad()
            ((nll * w).sum() / w.sum()).backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    raise AssertionError(f"the tiny model did not learn the tool conversation in {TEACH_STEPS} steps")


def example_of(name: str) -> tuple[Path, str]:
    """The example's file and its INSTRUCTIONS, read from its source: importing it here would import its framework
    into the test process too (seconds), and the agent process imports it anyway. Skips without the extra."""
    module, example, _ = FRAMEWORKS[name]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"the {name} extra is not installed (pip install 'a3po[{name}]'; make does)")
    path = ROOT / (example.replace(".", "/") + ".py")
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["INSTRUCTIONS"]:
            return path, ast.literal_eval(node.value)
    raise AssertionError(f"{path} defines no INSTRUCTIONS")


@pytest.fixture(scope="module")
def taught_tiny(_tiny):
    """The tiny model taught each installed example's conversation (one, when their instructions are the same)."""
    from test_agents import HERMES

    model, tok = copy.deepcopy(_tiny[0]), copy.deepcopy(_tiny[1])
    tok.chat_template = HERMES  # a template that writes Hermes calls, so the endpoint reads them (tools not shown)
    seen = set()
    for name in FRAMEWORKS:
        try:
            _, instructions = example_of(name)
        except pytest.skip.Exception:
            continue
        if instructions not in seen:
            seen.add(instructions)
            teach(model, tok, conversation(instructions))
    model.eval()
    return model, tok


@pytest.mark.slow
@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_frameworks_tool_loop_runs_unchanged_and_trains_what_was_generated(name, taught_tiny):
    from test_agents import Harness

    _, instructions = example_of(name)
    ref = Imported(f"{FRAMEWORKS[name][1]}:run")
    ref.search_dir = str(ROOT)  # where the agent process finds the examples folder, wherever pytest runs
    h = Harness(taught_tiny, agent=ref, max_new_tokens=96, max_context=1024)
    try:
        h.start("", question=QUESTION, greedy=True)
        ep = h.run()[1]
    finally:
        h.close()
    tok = h.tok
    assert ep.failure is None and ep.calls == 2 and ep.reward == 1.0, (ep.failure, ep.calls, ep.reward)
    [row] = h.rows(ep)  # the call, the tool's result and the answer: one conversation, one row
    messages = conversation(instructions)
    assert row.prompt_ids == encode_messages(tok, messages[:2])
    ids, taught = taught_tokens(tok, messages)
    assert row.prompt_ids + row.output_ids == ids  # the template's "\n" after the last end token is not generated
    assert row.output_mask == [bool(t) for t in taught[len(row.prompt_ids):]]
    generated = [i for i, m in enumerate(row.output_mask) if m]
    assert tok.decode([row.output_ids[i] for i in generated]) == CALL + tok.eos_token + "7" + tok.eos_token
    assert all(row.output_versions[i] == 0 and -50 < row.output_logprobs[i] <= 0 for i in generated)
    sent = [i for i, m in enumerate(row.output_mask) if not m]
    assert "<|im_start|>tool\n7" in tok.decode([row.output_ids[i] for i in sent])  # the tool ran; its result sent
    assert all(row.output_versions[i] == -1 and row.output_logprobs[i] == 0.0 for i in sent)
    assert math.isclose(sum(math.exp(row.output_logprobs[i]) for i in generated) / len(generated), 1.0, abs_tol=0.1)


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_the_docs_worked_example_is_the_example_file(name):
    _, example, heading = FRAMEWORKS[name]
    section = DOC.split(heading + "\n", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert snippet in (ROOT / (example.replace(".", "/") + ".py")).read_text()
    assert f"a3po train train_dataset.agent={example}:run" in section.split("\n## ", 1)[0]


def test_a_tool_call_sent_back_re_serialised_is_the_reply_it_was_served():
    """Pydantic AI sends a call's arguments back without spaces: the same call, so the same conversation key
    (the row continues); other arguments, or text that is not JSON, are another message."""
    from a3po.rollout.agents import _key

    def said(arguments: str) -> list[dict]:
        return [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "calculate", "arguments": arguments}}]}]

    served = _key(said('{"expression": "3 + 4", "n": [1, 2]}'), None)
    assert _key(said('{"n":[1,2],"expression":"3 + 4"}'), None) == served
    assert _key(said('{"expression": "3 + 5", "n": [1, 2]}'), None) != served
    assert _key(said('{"expression": "3 + 4", "n": [1, 2]'), None) != served  # not JSON: compared as text
    assert _key(said("[" * 5000), None) != served  # nested past the parser's bound: text, no error
