"""Chat requests from a loopback server's threads to an engine loop, and their replies back.

The HTTP server (serving/http.py) answers on threads of its own; the engine is stepped by one
loop (a rollout worker's, or `a3po serve`'s) and never touched from another thread. So a
request thread puts its request in `ChatQueue`, the loop takes it between two engine steps
(`take`), submits it, and once the completion is done hands the reply back (`Pending.reply`);
the request thread waits for it with a deadline and answers 503 past it. A request for `n`
choices is n pendings, each its own sample (choice i of a seeded request samples with seed + i),
generated side by side and answered together, under the one deadline.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field

from a3po.rollout.engine import Completion
from a3po.serving.http import Unavailable
from a3po.serving.protocol import BadRequest, ChatReply, ChatRequest
from a3po.serving.toolcalls import call_opening, read_tool_calls


@dataclass
class Pending:
    route: str | None
    request: ChatRequest
    prompt_ids: list[int] | None = None  # made on the request thread where they do not depend on the loop's state
    choice: int = 0  # which of the request's n choices this is
    first: Pending | None = None  # choice 0, for the others: taken before them, refused for all of them

    @property
    def refused(self) -> Exception | None:
        """Why choice 0 of this request was refused, if it was: then so is this choice."""
        return self.first._error if self.first is not None else None
    _done: threading.Event = field(default_factory=threading.Event)
    _reply: ChatReply | None = None
    _error: Exception | None = None
    abandoned: bool = False  # the request thread stopped waiting (deadline): nobody reads the reply

    def reply(self, reply: ChatReply) -> None:
        self._reply = reply
        self._done.set()

    def fail(self, error: Exception) -> None:
        self._error = error
        self._done.set()


class ChatQueue:
    def __init__(self, reply_timeout_s: float):
        self.reply_timeout_s = reply_timeout_s
        self._inbox: queue.Queue[Pending] = queue.Queue()
        self._closed = False

    def ask(self, route: str | None, request: ChatRequest, prompt_ids: list[int] | None = None) -> list[ChatReply]:
        """Called on a request thread: the request's replies, one per choice; blocks until the engine loop has
        them all, or the deadline passes."""
        if self._closed:
            raise Unavailable("the server is stopping")
        seeded = [request if request.seed is None else dataclasses.replace(request, seed=request.seed + i)
                  for i in range(request.n)]
        pendings = [Pending(route, r, prompt_ids, choice=i) for i, r in enumerate(seeded)]
        for p in pendings[1:]:
            p.first = pendings[0]
        for p in pendings:
            self._inbox.put(p)
        deadline = time.monotonic() + self.reply_timeout_s
        for p in pendings:
            if not p._done.wait(max(0.0, deadline - time.monotonic())):
                for q in pendings:
                    q.abandoned = True
                raise Unavailable(f"no reply within {self.reply_timeout_s:g}s")
        for p in pendings:
            if p._error is not None:
                raise p._error
        return [p._reply for p in pendings]

    def take(self, block_s: float = 0.0) -> list[Pending]:
        """Called by the engine loop: the requests that arrived, waiting up to block_s for the first."""
        out = []
        try:
            out.append(self._inbox.get(timeout=block_s) if block_s > 0 else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def close(self) -> None:
        """Refuse new requests and fail the ones not yet taken."""
        self._closed = True
        for p in self.take():
            p.fail(Unavailable("the server is stopping"))


def forced_call(tool_format: str | None, request: ChatRequest) -> str:
    """The text put after a chat request's prompt so that its reply is a tool call: the opening of a call in
    `tool_format` for tool_choice "required" or a named function, "" for the other choices. These tokens are
    prompt (the model conditions on them; they are never sampled, so never trained), and the reply is read from
    them and the generated text together. BadRequest when the model's format is not known."""
    if request.is_text or request.tool_choice not in ("required", "function"):
        return ""
    if tool_format is None:
        shown = '"required"' if request.tool_choice == "required" else f"naming {request.tool_name!r}"
        raise BadRequest(f"tool_choice {shown} needs the model's tool-call format, and its chat template shows none "
                         "this server reads; name it (a3po serve --tool-call-format, "
                         "train_dataset.tool_call_format), or send tool_choice auto")
    return call_opening(tool_format, request.tool_name)


def forced_ids(tokenizer, tool_format: str | None, request: ChatRequest) -> list[int]:
    """`forced_call`'s text as token ids, to append to the request's prompt ids."""
    text = forced_call(tool_format, request)
    return tokenizer.encode(text, add_special_tokens=False) if text else []


def reply_of(c: Completion, tokenizer, request: ChatRequest, stop: tuple[str, ...] = (),
             tool_format: str | None = None) -> ChatReply:
    """The reply for a finished completion: its text without special tokens, cut before the stop string that
    ended it (the protocol's replies never hold it; the tokens keep it), per-token log-probs (and alternatives)
    if asked, and the tool calls the text holds in `tool_format` when the request offered tools and did not say
    tool_choice "none" (a reading of the text: the tokens stay as generated). A forced call's opening (in the
    prompt, `forced_call`) is read as the start of the reply's text: a continuation that makes no call is that
    text whole, counted malformed."""
    text = tokenizer.decode(c.output_ids, skip_special_tokens=True)
    if c.finish_reason == "stop":
        text = text[:min([i for s in stop if (i := text.find(s)) >= 0], default=len(text))]
    view = read_tool_calls(tool_format if request.tools and request.tool_choice != "none" else None,
                           forced_call(tool_format, request) + text)
    texts = [tokenizer.decode([t]) for t in c.output_ids] if request.logprobs else []
    top = [tuple((tokenizer.decode([t]), lp) for t, lp in alts) for alts in c.output_top_logprobs] \
        if request.logprobs and request.top_logprobs else []
    return ChatReply(view.content, c.finish_reason, len(c.prompt_ids), len(c.output_ids), texts,
                     list(c.output_logprobs) if request.logprobs else [], top, view.calls, view.malformed)
