"""`a3po serve`: a model as an OpenAI-compatible chat server on loopback, e.g. as a run's judge.

    a3po serve --model smollm2-135m-instruct --port 8011
    # a3po serve: serving smollm2-135m-instruct at http://127.0.0.1:8011/v1 (local engine)

It is the rollout engine (local or vLLM) behind the same server a rollout worker gives its
agents (serving/http.py): POST /v1/chat/completions, POST /v1/completions (a prompt the client
rendered: text, tokenised as it is with no special tokens added, or token ids), GET /v1/models,
no other path. `n` choices are sampled side by side; `stream` sends the finished reply as a
short sequence of server-sent chunks (serving/protocol.py). Requests
are batched continuously; temperature 0 decodes greedily; a request's `seed` fixes its sample;
a `max_tokens` above --max-tokens is a 400 naming the limit. When the request offers tools and
the model's chat template writes a known tool-call format (serving/toolcalls.py), calls in a
reply come back as `tool_calls` (--tool-call-format names the format where the template
does not show it, or `none` to return replies as text). A request's prompt is rendered and tokenised on its own
request thread, so a long one never holds up the engine loop and the replies of the others.
The first line on stdout names the URL once the model is loaded (port 0 picks a free port),
so a script can wait for it. Ctrl-C or SIGTERM stops it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from a3po.config.choices import AUTO
from a3po.serving.http import LOOPBACK, ChatServer
from a3po.serving.protocol import BadRequest, ChatReply, ChatRequest, check_max_tokens

# The command line reads ServeArgs' defaults before torch loads: the engine's modules are imported where used.

IDLE_WAIT_S = 0.05  # how long the loop waits for a request with nothing to generate


@dataclass(frozen=True)
class ServeArgs:
    model: str
    host: str = LOOPBACK
    port: int = 0
    backend: str = "local"
    dtype: str = "auto"
    device: str = "auto"
    max_tokens: int = 512
    name: str | None = None
    seed: int = 0
    reply_timeout_s: float = 600.0
    tool_call_format: str = AUTO  # ToolCallFormat: auto reads the format the chat template writes


class EngineLoop:
    """Takes requests off the queue, generates them in one continuous batch, replies as they finish."""

    def __init__(self, engine, tokenizer, chat, max_tokens: int, max_context: int, tool_call_format: str = AUTO):
        from a3po.rollout.prompts import chars_per_token
        from a3po.serving.toolcalls import resolve

        self.engine, self.tok, self.chat = engine, tokenizer, chat
        self.max_tokens, self.max_context = max_tokens, max_context
        self.per_token = chars_per_token(tokenizer)
        self.tool_format = resolve(tool_call_format, getattr(tokenizer, "chat_template", None))
        self._waiting: dict = {}
        self._n = 0

    def answer(self, route: str | None, request: ChatRequest) -> list[ChatReply]:
        """Called on the server's request thread: the prompt's ids are made here, then the loop generates."""
        from a3po.rollout.prompts import encode_within

        check_max_tokens(request, self.max_tokens, "a3po serve --max-tokens")
        if request.is_text:
            return self.chat.ask(route, request, self._prompt_ids(request.prompt))
        try:
            text = self.tok.apply_chat_template(request.messages, tools=request.tools, add_generation_prompt=True,
                                                tokenize=False)
        except Exception as e:  # the template's own error (a role order it refuses, a bad tool)
            raise BadRequest(f"the model's chat template cannot render these messages: {e}") from None
        ids = encode_within(self.tok, text, self.max_context, self.per_token)
        if ids is None:
            raise BadRequest(f"the messages do not fit this model's context of {self.max_context} tokens "
                             "with room for a reply; send a shorter conversation")
        return self.chat.ask(route, request, ids)

    def _prompt_ids(self, prompt: str | tuple[int, ...]) -> list[int]:
        """A completions prompt's ids: the text tokenised as it is, or the ids checked against the vocabulary."""
        from a3po.rollout.prompts import encode_within

        if isinstance(prompt, str):
            ids = encode_within(self.tok, prompt, self.max_context, self.per_token)
        else:
            vocab = len(self.tok)
            if max(prompt) >= vocab:
                raise BadRequest(f"prompt: token id {max(prompt)} is not in this model's vocabulary of {vocab}")
            ids = list(prompt) if len(prompt) < self.max_context else None
        if ids is None:
            raise BadRequest(f"the prompt does not fit this model's context of {self.max_context} tokens "
                             "with room for a reply; send a shorter prompt")
        return ids

    def step(self) -> None:
        from a3po.rollout.chat import reply_of

        for p in self.chat.take(0.0 if self.engine.num_pending else IDLE_WAIT_S):
            self._submit(p)
        for c in self.engine.step():
            p = self._waiting.pop(c.rid)
            p.reply(reply_of(c, self.tok, p.request, p.request.stop, self.tool_format))

    def _submit(self, p) -> None:
        from a3po.rollout.engine import GenerationRequest

        if p.abandoned:  # its client stopped waiting: nobody would read the reply
            return
        r, ids = p.request, p.prompt_ids
        self._n += 1
        self._waiting[self._n] = p
        self.engine.submit(GenerationRequest(
            ids, min(r.max_tokens or self.max_tokens, self.max_context - len(ids)), rid=self._n,
            temperature=r.temperature or 1.0, top_p=r.top_p, greedy=r.temperature == 0, stop=r.stop, seed=r.seed))


def build_engine(args: ServeArgs):
    """(engine, tokenizer, context length) for the model."""
    from a3po.devices import resolve_device, resolve_dtype, torch_dtype
    from a3po.models import end_ids, load_policy

    device = resolve_device(args.device, "--device")
    dtype = resolve_dtype(args.dtype, device)
    model, tok = load_policy(args.model, dtype=torch_dtype(dtype), seed=args.seed)
    context = getattr(model.config, "max_position_embeddings", None) or 2048
    if args.backend == "vllm":
        from a3po.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine.from_model(model, tok, dtype=dtype, version=0, max_batch=64, seed=args.seed)
        return engine, tok, min(context, 2048)
    from a3po.rollout.local import LocalEngine

    model = model.to(device)
    engine = LocalEngine(model, eos_token_ids=end_ids(model, tok), decode=tok.decode, max_batch=64, seed=args.seed)
    return engine, tok, context


def main(args: ServeArgs) -> int:
    from a3po.rollout.chat import ChatQueue

    engine, tok, context = build_engine(args)
    chat = ChatQueue(args.reply_timeout_s)
    name = args.name or args.model
    loop = EngineLoop(engine, tok, chat, args.max_tokens, context, args.tool_call_format)
    server = ChatServer(loop.answer, name, args.host, args.port, routes=False)
    try:
        server.start()
        print(f"a3po serve: serving {name} at {server.url} ({args.backend} engine)", flush=True)
        while True:
            loop.step()
    finally:
        chat.close()
        server.close()
        engine.close()
        sys.stdout.flush()
