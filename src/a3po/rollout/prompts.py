"""Dataset examples and environment observations -> token ids, through the model's own chat template.

An episode's context is token ids that only ever grow: the model's tokens are appended as
it generated them, and an observation is appended as the ids of the chat template's text
between the model's message and the next one (`ChatTurns.observation`), never by
rendering the whole conversation again, which would re-tokenise the model's turns and, with
templates that rewrite earlier messages, change them. A template that does rewrite them (one
that drops a past reply's reasoning block, as Qwen3's does) cannot grow a context this way:
its episodes re-render the conversation for each turn instead (`render`, rollout/episodes.py).
"""

from __future__ import annotations

from functools import cache

from a3po.data import Example, build_messages

_MODEL, _OBSERVATION = "\x00a3po-model-turn\x00", "\x00a3po-observation\x00"
_REASONING = "<think>\nr\n</think>\n\n"


class TemplateError(ValueError):
    """The chat template cannot extend a conversation by appending (one line, for the user)."""


def encode_prompt(tokenizer, example: Example, system_prompt: str | None) -> list[int]:
    return encode_messages(tokenizer, build_messages(example, system_prompt))


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def chars_per_token(tokenizer) -> int | None:
    """The most characters of text one token can stand for, or None when the tokenizer can make text shorter
    than its tokens' strings (a normaliser, a pre-tokenizer that drops whitespace, unknown characters fused into
    one token), so that no such bound holds. A byte-level or byte-fallback BPE writes every byte it covers in its
    token's string, so the longest string in the vocabulary bounds it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or type(backend.model).__name__ != "BPE":
        return None
    if backend.model.unk_token is not None and not backend.model.byte_fallback:
        return None
    if any(word in str(backend.pre_tokenizer) for word in ("Whitespace", "Bert", "Removed")):
        return None
    return max(map(len, tokenizer.get_vocab()))


def encode_within(tokenizer, text: str, limit: int, per_token: int | None) -> list[int] | None:
    """text's ids, or None when they are `limit` or more. A text longer than limit x per_token characters
    (chars_per_token) is None without being tokenised: a request of megabytes costs nothing to refuse, where
    tokenising it would hold the interpreter for a noticeable time."""
    if per_token is not None and len(text) > limit * per_token:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if len(ids) < limit else None


class ChatTurns:
    """The ids to append after a model turn for an observation, from the template's own text."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos]) if eos is not None else None

    def observation(self, text: str, role: str, inline: bool, ended_by_eos: bool) -> list[int]:
        """`text` after a model turn: appended as it is (`inline`), or as a new `role` message after the
        closing of the model's message, the part of the closing the model did not generate itself."""
        if inline:
            return self.tok.encode(text, add_special_tokens=False)
        closing, before, after = self._delta(role)
        if ended_by_eos and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]
        return self.tok.encode(closing + before + text + after, add_special_tokens=False)

    @cache  # noqa: B019 - one per tokenizer and role; the object lives as long as its worker
    def _delta(self, role: str) -> tuple[str, str, str]:
        """(what closes the model's message, the template before an observation, after it: up to the next
        model message)."""
        # a reply with a reasoning block too: templates such as Qwen3's drop it once a later message follows
        for reply in (_MODEL, _REASONING + _MODEL):
            convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]
            base = self.tok.apply_chat_template(convo, tokenize=False)
            full = self.tok.apply_chat_template([*convo, {"role": role, "content": _OBSERVATION}],
                                                add_generation_prompt=True, tokenize=False)
            if not full.startswith(base) or _MODEL not in base or _OBSERVATION not in full:
                raise TemplateError(f"the chat template renders earlier messages differently once a {role!r} "
                                    f"message follows, so an episode's context cannot grow by appending: set "
                                    f"train_dataset.turn_context=rerender (or auto), or return inline observations")
            if reply == _MODEL:
                closing = base[base.index(_MODEL) + len(_MODEL):]
                before, _, after = full[len(base):].partition(_OBSERVATION)
        return closing, before, after


def appends(tokenizer) -> bool:
    """Whether the chat template extends a conversation by appending: what it rendered for the earlier messages
    stays the same once a user message follows (episodes then grow one row by the template's delta)."""
    try:
        ChatTurns(tokenizer).observation("ok", "user", inline=False, ended_by_eos=True)
    except TemplateError:
        return False
    return True


def render(tokenizer, messages: list[dict], continuing: bool) -> list[int]:
    """The conversation rendered whole: for the model's next message, or (`continuing`) for more of its last one
    (an inline observation was appended to it)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=not continuing,
                                         continue_final_message=continuing, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
