"""The tokenizer: ids identical to transformers' on hard text, the model's real pre-tokenizer,
special tokens, bytes-safe token text, Hugging Face directories, and clear load errors."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvserve.engine.text.tokenizer import Tokenizer, TokenizerLoadError

# Emoji (including ZWJ sequences and flags), CJK, code, odd whitespace, digits, mixed scripts.
CORPUS = [
    "Hello, world!",
    "The year 2024 had 366 days; π ≈ 3.14159.",
    "😀 😃 👩‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 done",
    "日本語のテキストと中文文本，还有한국어.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "tabs\tand\tnewlines\n\n\nand   many    spaces   ",
    "   leading spaces and trailing\n",
    "\u00a0non-breaking\u2009thin\u200bzero-width\u3000ideographic",
    "Ünïcödé àçcénts, ß, Ω, Ж, ع, א",
    "12345678901234567890 and 0.5e-10 and 1,000,000",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "",
    " ",
    "\r\n windows \r\n line \r\n endings",
]

# Whitespace runs in front of a digit: SmolLM2's pre-tokenizer splits digits off first, so "a  1"
# is "a", "  ", "1". transformers' GGUF loader has no entry for the "smollm" pre-tokenizer and
# falls back to GPT-2 splitting ("a", " ", " 1"), which gives different ids here.
WHITESPACE_BEFORE_DIGITS = ["a  1", "x   2024", "hello\n\n 3", "  12", "\t\t5", "rows:\n    1\n    2"]


@pytest.fixture(scope="module")
def tokenizer(smollm2_source) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_source.path)


def test_smollm2_metadata(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1
    assert tokenizer.special_token_ids == frozenset(range(17))
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_ids_identical_to_transformers(tokenizer: Tokenizer, hf_smollm2_tokenizer, text: str) -> None:
    assert tokenizer.encode(text) == hf_smollm2_tokenizer(text).input_ids
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids, skip_special_tokens=False) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=False)
    assert tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("text", WHITESPACE_BEFORE_DIGITS)
def test_digit_split_matches_the_models_own_pre_tokenizer(tokenizer: Tokenizer, hf_smollm2_tokenizer, text: str) -> None:
    """Against transformers' tokenizer with SmolLM2's tokenizer.json pre-tokenizer (Digits, then
    ByteLevel) put back, the ids agree; this is the one place where transformers' GGUF loader
    differs from the model's original tokenizer."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    reference = HFTokenizer.from_str(hf_smollm2_tokenizer.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    assert tokenizer.encode(text) == reference.encode(text).ids
    assert tokenizer.encode(text) != hf_smollm2_tokenizer(text).input_ids  # the known loader difference
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_single_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a  1")
    assert [tokenizer.token_to_text(i) for i in ids] == ["a", "  ", "1"]
    assert len(tokenizer.encode("1234567890")) == 10


@pytest.mark.parametrize("text", CORPUS + WHITESPACE_BEFORE_DIGITS)
def test_decode_round_trips(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_no_bos_is_added_and_special_tokens_are_single_ids(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2  # the text's own tokens, no BOS in front
    assert tokenizer.encode("hi")[0] != tokenizer.bos_token_id
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_token_bytes_reassemble_the_text_and_text_is_bytes_safe(tokenizer: Tokenizer) -> None:
    text = "Zoë 😀 世界 <|im_end|>"
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_to_bytes(i) for i in ids) == text.encode("utf-8")
    pieces = [tokenizer.token_to_text(i) for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert any("\\x" in p for p in pieces)  # the emoji is split across tokens and shown as escapes
    assert tokenizer.token_to_text(2) == "<|im_end|>"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tokenizer.token_to_text(tokenizer.vocab_size)


@pytest.mark.slow
def test_hf_directory_loads_the_same_tokenizer(tmp_path: Path, hf_smollm2_tokenizer) -> None:
    hf_smollm2_tokenizer.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    assert loaded.eos_token_id == hf_smollm2_tokenizer.eos_token_id
    assert loaded.vocab_size == len(hf_smollm2_tokenizer)
    for text in CORPUS:
        assert loaded.encode(text) == hf_smollm2_tokenizer(text).input_ids
    messages = [{"role": "user", "content": "Hi there"}]
    assert loaded.apply_chat_template(messages) == hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_hf_directory_without_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="no tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_not_a_gguf_file_is_a_clear_error(tmp_path: Path) -> None:
    bogus = tmp_path / "model.gguf"
    bogus.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(TokenizerLoadError, match="not a GGUF file"):
        Tokenizer.from_gguf(bogus)


def test_truncated_gguf_is_a_clear_error(tmp_path: Path, smollm2_source) -> None:
    truncated = tmp_path / "truncated.gguf"
    with open(smollm2_source.path, "rb") as f:
        truncated.write_bytes(f.read(200_000))  # ends inside the vocabulary
    with pytest.raises(TokenizerLoadError, match="truncated"):
        Tokenizer.from_gguf(truncated)


# --- tiny synthetic GGUF vocabularies ------------------------------------------------------------

_TINY_TOKENS = ["<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz", "Ġ", "ab", "Ġa", "1", "2"]


def _write_tiny_gguf(path: Path, *, model: str = "gpt2", pre: str = "llama-bpe", add_bos: bool = False) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(_TINY_TOKENS)
    writer.add_token_types([3, 3] + [1] * (len(_TINY_TOKENS) - 2))
    writer.add_token_merges(["a b", "Ġ a"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bos_is_added_when_the_gguf_says_so(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "t.gguf", add_bos=True))
    assert tokenizer.encode("ab a") == [0, _TINY_TOKENS.index("ab"), _TINY_TOKENS.index("Ġa")]
    assert tokenizer.encode("ab a", add_special_tokens=False) == [_TINY_TOKENS.index("ab"), _TINY_TOKENS.index("Ġa")]
    assert tokenizer.decode(tokenizer.encode("ab a")) == "ab a"
    assert tokenizer.chat_template is None


def test_unsupported_pre_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="'chatglm-bpe' is not supported"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "t.gguf", pre="chatglm-bpe"))


def test_sentencepiece_gguf_points_to_the_hf_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="Hugging Face directory"):
        Tokenizer.from_gguf(_write_tiny_gguf(tmp_path / "t.gguf", model="llama"))
