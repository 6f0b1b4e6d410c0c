"""Dataset example -> prompt token ids, through the model's own chat template."""

from __future__ import annotations

from a3po.data import Example, build_messages


def encode_prompt(tokenizer, example: Example, system_prompt: str | None) -> list[int]:
    text = tokenizer.apply_chat_template(build_messages(example, system_prompt), add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
