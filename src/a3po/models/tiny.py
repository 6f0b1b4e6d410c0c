"""Tiny random Llama models with an offline byte-level ChatML tokenizer.

For tests, smoke runs and benchmarks: no download, no file, built in milliseconds,
deterministic from a seed. Use through `a3po.models.load_policy("tiny")` or
`load_policy("tiny-128x4")` (hidden size 128, 4 layers); directly:

    model, tokenizer = tiny_policy(hidden=64, layers=2, seed=0)

Names (`actor.path`, `--model`): "tiny" is tiny-64x2; "tiny-<hidden>x<layers>" takes any hidden size
that is a multiple of 64 (heads of 32 dimensions, half as many key/value heads) and any number of
layers, with an MLP twice the hidden size. So a GPU machine needs no download for a model of real
size: "tiny-2048x16" has about 605M parameters (`tiny_params`), all but 0.5M of them in the body,
since the vocabulary is the 259 byte tokens.

The tokenizer has one token per byte (ids 0..255 are the bytes 0..255), so every
UTF-8 text round-trips through encode/decode, plus three special tokens:
`<|im_start|>`, `<|im_end|>` (the EOS) and `<pad>`. Its chat template is ChatML,
the format SmolLM2-Instruct uses, so code written against the tiny model runs
unchanged on the real one.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from a3po.models.paths import TINY_DEFAULT_SHAPE, TINY_HEAD_DIM, check_tiny_shape

SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<pad>")  # ids 256, 257, 258
EOS, PAD = "<|im_end|>", "<pad>"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: byte b is token b, whatever the text."""
    vocab = {c: b for b, c in enumerate(_byte_chars())}
    assert set(vocab) == set(pre_tokenizers.ByteLevel.alphabet()), "ByteLevel alphabet changed"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no pre-splitting, which would only cost time with no merges.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[SPECIAL_TOKENS[0]],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must give back the text exactly
        model_max_length=4096,
    )
    assert tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS)) == [256, 257, 258]
    return tokenizer


def _byte_chars() -> list[str]:
    """GPT-2's table, which ByteLevel uses: printable bytes stand for themselves, the rest shift past 255."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def tiny_config(hidden: int, layers: int, tokenizer: PreTrainedTokenizerFast | None = None) -> LlamaConfig:
    """The Llama configuration of tiny-<hidden>x<layers>: the one place its shape is decided."""
    check_tiny_shape(hidden, layers)
    tokenizer = tokenizer or byte_tokenizer()
    heads = hidden // TINY_HEAD_DIM
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        head_dim=TINY_HEAD_DIM,
        max_position_embeddings=tokenizer.model_max_length,
        tie_word_embeddings=True,
        bos_token_id=None,  # the tokenizer adds no BOS, as with SmolLM2's ChatML prompts
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_params(hidden: int, layers: int) -> int:
    """Parameters of tiny-<hidden>x<layers> (the tied head counted once), counted on the meta device: no memory."""
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(tiny_config(hidden, layers)).parameters())


def tiny_policy(hidden: int = TINY_DEFAULT_SHAPE[0], layers: int = TINY_DEFAULT_SHAPE[1], *, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Same (hidden, layers, seed) → bitwise-identical weights; the global RNG is left untouched."""
    tokenizer = byte_tokenizer()
    config = tiny_config(hidden, layers, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return model.to(dtype).eval(), tokenizer
