"""Rebuilding a Hugging Face `tokenizers` tokenizer from the vocabulary a GGUF file carries.

A GGUF has no tokenizer.json. It stores the tokens, merges, token types and special ids under
llama.cpp's key names, plus `tokenizer.ggml.pre`, the name of the pre-tokenizer (the regex that
cuts text into words before BPE). The merges were learned on text cut that way, so the
pre-tokenizer must match the model's original one or some texts get different ids: SmolLM2 splits
every digit off first ("a  1" -> "a", "  ", "1"), which plain GPT-2 splitting does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from kvserve.engine.model.gguf_kv_reader import GGUFMetadataError, read_gguf_metadata


class TokenizerLoadError(ValueError):
    """A tokenizer cannot be built from the given files; the message says what is missing."""


# llama.cpp's token types (`llama_token_type`): 3 = control (e.g. <|im_end|>), 4 = user-defined
# (an added token that is matched whole but is not special, e.g. <think>).
_CONTROL = 3
_USER_DEFINED = 4

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _digits_then_gpt2() -> pre_tokenizers.PreTokenizer:
    # StarCoder-family vocabularies (SmolLM2 among them): every digit is its own word.
    return pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


@dataclass(frozen=True)
class _PreTokenizerRecipe:
    pre_tokenizer: pre_tokenizers.PreTokenizer
    nfc: bool = False  # Qwen2's tokenizer.json normalizes to NFC before splitting
    ignore_merges: bool = False  # Llama 3: a word that is itself a token is not split by merges


def _recipe(pre: str) -> _PreTokenizerRecipe:
    """The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre` name (see llama-vocab.cpp)."""
    if pre in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"):
        return _PreTokenizerRecipe(_digits_then_gpt2())
    if pre in ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais"):
        return _PreTokenizerRecipe(_gpt2())
    if pre in ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx"):
        return _PreTokenizerRecipe(_split_then_byte_level(_LLAMA3_SPLIT), ignore_merges=True)
    if pre in ("qwen2", "deepseek-r1-qwen", "megrez"):
        return _PreTokenizerRecipe(_split_then_byte_level(_QWEN2_SPLIT), nfc=True)
    raise TokenizerLoadError(
        f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm/starcoder, gpt2, llama-bpe, "
        "qwen2 and their aliases); use the model's Hugging Face directory (with tokenizer.json) instead"
    )


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What `Tokenizer.from_gguf` needs from the file."""

    tokenizer: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    chat_template: str | None


def read_gguf_tokenizer(path: Path) -> GGUFTokenizerParts:
    try:
        metadata = read_gguf_metadata(path)
    except GGUFMetadataError as exc:
        raise TokenizerLoadError(str(exc)) from exc
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise TokenizerLoadError(f"{path} has no tokenizer in its metadata (tokenizer.ggml.model/tokens)")
    if model != "gpt2":
        raise TokenizerLoadError(
            f"{path}: GGUF tokenizer model {model!r} is not supported; kvserve rebuilds byte-level BPE "
            "('gpt2') vocabularies only. Use the model's Hugging Face directory (with tokenizer.json) instead"
        )
    merges = metadata.get("tokenizer.ggml.merges")
    if not merges:
        raise TokenizerLoadError(f"{path}: a byte-level BPE tokenizer needs tokenizer.ggml.merges")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    recipe = _recipe(str(metadata.get("tokenizer.ggml.pre") or "default"))

    bpe = models.BPE({token: i for i, token in enumerate(tokens)},
                     [tuple(merge.split(" ", 1)) for merge in merges],
                     ignore_merges=recipe.ignore_merges)
    tokenizer = HFTokenizer(bpe)
    if recipe.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = recipe.pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    # Control and user-defined tokens are matched whole in the text instead of being cut by BPE.
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, kind in enumerate(token_types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i, kind in enumerate(token_types) if kind == _USER_DEFINED])

    bos = _optional_id(metadata.get("tokenizer.ggml.bos_token_id"))
    eos = _optional_id(metadata.get("tokenizer.ggml.eos_token_id"))
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token") or False)
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token") or False)
    post = bos_eos_post_processor(tokens, bos if add_bos else None, eos if add_eos else None)
    if post is not None:
        tokenizer.post_processor = post
    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizerParts(tokenizer, bos, eos, str(template) if template else None)


def _optional_id(value: object | None) -> int | None:
    return None if value is None else int(value)  # type: ignore[arg-type]


def bos_eos_post_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.TemplateProcessing | None:
    """A post-processor that adds BOS before / EOS after the text, or None when neither is added."""
    if bos is None and eos is None:
        return None
    head = f"{tokens[bos]} " if bos is not None else ""
    tail = f" {tokens[eos]}" if eos is not None else ""
    specials = [(tokens[i], i) for i in dict.fromkeys(t for t in (bos, eos) if t is not None)]
    return processors.TemplateProcessing(single=f"{head}$A{tail}", pair=f"{head}$A{tail} $B{tail}",
                                         special_tokens=specials)
