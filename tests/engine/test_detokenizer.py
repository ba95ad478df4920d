"""Streaming detokenization: the deltas add up to exactly the full decode, no delta ever holds
half a character, and stop strings cut the text at the right place however tokens fall."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.engine.text.detokenizer import DetokenizerFinishedError, IncrementalDetokenizer
from kvserve.engine.text.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "😀😃😄 family: 👩‍👩‍👧‍👦, flag: 🇯🇵, rainbow: 🏳️‍🌈",
    "日本語のテキスト。中文文本，한국어 텍스트",
    "mixed: café → naïve ≠ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🤖 end",
    "code 🐍:\n\tdef f():\n\t\treturn '世界'\n",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_source) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_source.path)


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    """Feeds tokens in chunks (one at a time by default); returns every delta, flush last."""
    deltas, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(token_ids) and detok.stop_string is None:
        size = max(1, next(sizes, 1))
        deltas.append(detok.append(token_ids[i:i + size]).new_text)
        i += size
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_streams_whole_characters(tokenizer: Tokenizer, prompt: list[int], text: str) -> None:
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.encode("utf-8")) / 4  # characters really are split across tokens
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert deltas[-1] == ""  # nothing was left to flush


def test_prompt_context_keeps_the_leading_space(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("The capital of France is"))
    assert "".join(stream(detok, tokenizer.encode(" Paris."))) == " Paris."


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_token_sequences_concatenate_to_the_full_decode(tokenizer: Tokenizer, prompt: list[int], data) -> None:
    # Byte tokens (ids < 300 are mostly single bytes, incl. UTF-8 lead/continuation bytes) make
    # broken and completed characters common; specials and the rest of the vocabulary mix in.
    token = st.one_of(st.integers(0, 300), st.integers(0, tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas = stream(detok, ids, chunks)
    full = tokenizer.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full == detok.text
    # Nothing streamed is ever revised: every prefix of the stream is a prefix of the full text,
    # so no delta can have carried a half character that later turned into something else.
    assert all(full.startswith("".join(deltas[:n])) for n in range(len(deltas)))


def test_incomplete_character_is_held_until_complete_or_flushed(tokenizer: Tokenizer, prompt: list[int]) -> None:
    ids = tokenizer.encode("ok 😀")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    before_last = [detok.append([t]).new_text for t in ids[:-1]]
    assert "".join(before_last) == "ok "  # the emoji's first bytes are held back
    assert detok.append(ids[-1:]).new_text == "😀"
    # A generation that ends mid-character shows exactly what a full decode shows: U+FFFD.
    cut = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(cut.append([t]).new_text for t in ids[:-1]) == "ok "
    assert cut.flush() == tokenizer.decode(ids[:-1])[len("ok "):] == "\ufffd"


# --- stop strings -------------------------------------------------------------------------------

def test_stop_string_across_token_boundaries(tokenizer: Tokenizer, prompt: list[int]) -> None:
    text = "The answer is 42. END of story, nothing after."
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["D of st"])
    deltas = stream(detok, ids)
    assert detok.stop_string == "D of st"
    assert "".join(deltas) == detok.text == "The answer is 42. EN"
    with pytest.raises(DetokenizerFinishedError):
        detok.append(ids[-1:])
    assert detok.flush() == ""


def test_include_stop_str_in_output(tokenizer: Tokenizer, prompt: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["42."], include_stop_str_in_output=True)
    assert "".join(stream(detok, tokenizer.encode("The answer is 42. More."))) == "The answer is 42."


def test_text_that_may_become_a_stop_string_is_held_back(tokenizer: Tokenizer, prompt: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["<<END>>"])
    first = detok.append(tokenizer.encode("value <<EN")).new_text
    assert first == "value "  # "<<EN" might be the start of "<<END>>"
    second = detok.append(tokenizer.encode("X>> more")).new_text
    assert first + second == "value <<ENX>> more"  # it was not: released
    third = detok.append(tokenizer.encode(" <")).new_text
    assert third == " "
    assert detok.flush() == "<"  # at the end, held text is released
    assert detok.stop_string is None


def test_stop_string_inside_a_multibyte_sequence(tokenizer: Tokenizer, prompt: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["🤖!"])
    deltas = stream(detok, tokenizer.encode("beep 🤖 boop 🤖! gone"))
    assert "".join(deltas) == "beep 🤖 boop "
    assert all("\ufffd" not in d for d in deltas)


def test_first_completed_stop_string_wins(tokenizer: Tokenizer, prompt: list[int]) -> None:
    # "bcd" completes before "abcde" does, even though "abcde" starts first.
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["abcde", "bcd"])
    assert "".join(stream(detok, tokenizer.encode("xx abcdef"))) == "xx a"
    assert detok.stop_string == "bcd"


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Generation ends at the first position where a stop string is complete."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return (text[:end] if include else text[:end - len(stop)]), stop
    return text, None


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet="ab😀 世\n", max_size=30),
    stops=st.lists(st.text(alphabet="ab😀 世\n", min_size=1, max_size=4), max_size=3),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), max_size=30),
)
def test_stop_strings_match_the_character_by_character_reference(tokenizer: Tokenizer, prompt: list[int], text: str,
                                                                 stops: list[str], include: bool, chunks: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stops, include_stop_str_in_output=include)
    deltas = stream(detok, tokenizer.encode(text), chunks)
    expected_text, expected_stop = _reference_stop(text, stops, include)
    assert "".join(deltas) == detok.text == expected_text
    assert detok.stop_string == expected_stop
    assert all("\ufffd" not in d for d in deltas)


def test_empty_stop_string_is_rejected(tokenizer: Tokenizer, prompt: list[int]) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tokenizer, prompt, stop=[""])


def test_flush_is_idempotent_and_ends_the_stream(tokenizer: Tokenizer, prompt: list[int]) -> None:
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["zzz"])
    detok.append(tokenizer.encode("abc zz"))
    assert detok.flush() == "zz"
    assert detok.flush() == ""
    with pytest.raises(DetokenizerFinishedError):
        detok.append([5])
