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
from a3po.serving.protocol import ChatReply, ChatRequest
from a3po.serving.toolcalls import read_tool_calls


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


def reply_of(c: Completion, tokenizer, request: ChatRequest, stop: tuple[str, ...] = (),
             tool_format: str | None = None) -> ChatReply:
    """The reply for a finished completion: its text without special tokens, cut before the stop string that
    ended it (the protocol's replies never hold it; the tokens keep it), per-token log-probs if asked, and the
    tool calls the text holds in `tool_format` when the request offered tools and did not say tool_choice "none"
    (a reading of the text: the tokens stay as generated)."""
    text = tokenizer.decode(c.output_ids, skip_special_tokens=True)
    if c.finish_reason == "stop":
        text = text[:min([i for s in stop if (i := text.find(s)) >= 0], default=len(text))]
    view = read_tool_calls(tool_format if request.tools and request.tool_choice != "none" else None, text)
    texts = [tokenizer.decode([t]) for t in c.output_ids] if request.logprobs else []
    return ChatReply(view.content, c.finish_reason, len(c.prompt_ids), len(c.output_ids), texts,
                     list(c.output_logprobs) if request.logprobs else [], view.calls, view.malformed)
