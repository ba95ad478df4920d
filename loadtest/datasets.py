"""Benchmark workloads, generated locally from a seed so every run (and every peer) sees the same one.

There is no tokenizer here on purpose: the load generator must work against any server. Text
prompts are built from common English words that byte-level BPE vocabularies (GPT-2, Llama,
SmolLM2, ...) hold as single tokens when preceded by a space, so `prompt_len` is a close estimate;
the server's `usage.prompt_tokens` is the truth and the metrics prefer it when the server sends it.
Token-id prompts (`/v1/completions` accepts a list of ints) give exact input lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

ChatMessage = dict[str, str]
# A prompt is text, token ids (completions only) or a list of chat messages (chat only).
Prompt = Union[str, tuple[int, ...], tuple[ChatMessage, ...]]

# Common lowercase words that are one token each (with a leading space) in the usual BPE vocabularies.
_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        """the of and to in is was for on that with as by at from his her it an be are were this
    which or had not but have they you one all their has been there who more when will would can
    time two first new after some other into than only also over most such about people years
    then made year may could many these three part city world out work during school state
    between under life before well where because through long both group same later water made
    house team name family game music film book back war home high small end day way used number
    world early great good power point main line season place days north south west east half
    river side room body light night road love word door dark hand head eyes face voice mind
    heart field fire sound stone tree wind rain snow green blue black white red gold old young""".split()
    )
)


class DatasetError(ValueError):
    """A dataset cannot be built from the given options; the message says which option to change."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: what to send and how many tokens to ask for."""

    prompt: Prompt
    prompt_len: int  # exact for token ids, an estimate for text (see the module docstring)
    output_len: int

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise DatasetError(f"output_len must be >= 1, got {self.output_len}")
        if self.prompt_len < 0:
            raise DatasetError(f"prompt_len must be >= 0, got {self.prompt_len}")

    @property
    def is_token_ids(self) -> bool:
        return isinstance(self.prompt, tuple) and bool(self.prompt) and isinstance(self.prompt[0], int)

    @property
    def is_messages(self) -> bool:
        return isinstance(self.prompt, tuple) and bool(self.prompt) and isinstance(self.prompt[0], dict)


def random_words(rng: np.random.Generator, count: int) -> str:
    """`count` words drawn uniformly from the single-token word list, joined by spaces."""
    picks = rng.integers(0, len(_WORDS), size=count)
    return " ".join(_WORDS[i] for i in picks)


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, count: int) -> np.ndarray:
    """Uniform integer lengths in [mean*(1-r), mean*(1+r)], at least 1 (vLLM's --random-range-ratio)."""
    low = max(1, int(round(mean * (1.0 - range_ratio))))
    high = max(low, int(round(mean * (1.0 + range_ratio))))
    return rng.integers(low, high + 1, size=count)


@dataclass(frozen=True)
class RandomDataset:
    """Prompt and output lengths drawn uniformly from ranges around the given means."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # a shared prefix in front of every prompt, like vLLM's --random-prefix-len
    token_ids: bool = False  # send prompts as token ids instead of text
    vocab_size: int = 32000  # token ids are drawn from [first_token_id, vocab_size)
    first_token_id: int = 100  # skips the control tokens most vocabularies keep at the start

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise DatasetError("--random-input-len and --random-output-len must be >= 1")
        if not 0.0 <= self.range_ratio < 1.0:
            raise DatasetError(f"--random-range-ratio must be in [0, 1), got {self.range_ratio}")
        if self.prefix_len < 0:
            raise DatasetError(f"--random-prefix-len must be >= 0, got {self.prefix_len}")
        if self.token_ids and not 0 <= self.first_token_id < self.vocab_size:
            raise DatasetError("--random-vocab-size must be larger than the first token id")

    def sample(self, num_requests: int, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        input_lens = _lengths(rng, self.input_len, self.range_ratio, num_requests)
        output_lens = _lengths(rng, self.output_len, self.range_ratio, num_requests)
        if self.token_ids:
            prefix_ids = tuple(int(t) for t in rng.integers(self.first_token_id, self.vocab_size, self.prefix_len))
        else:
            prefix_text = random_words(rng, self.prefix_len)
        requests = []
        for in_len, out_len in zip(input_lens, output_lens):
            total = self.prefix_len + int(in_len)
            if self.token_ids:
                body = rng.integers(self.first_token_id, self.vocab_size, int(in_len))
                prompt: Prompt = prefix_ids + tuple(int(t) for t in body)
            else:
                prompt = " ".join(filter(None, (prefix_text, random_words(rng, int(in_len)))))
            requests.append(BenchRequest(prompt=prompt, prompt_len=total, output_len=int(out_len)))
        return requests


@dataclass(frozen=True)
class SyntheticChatDataset:
    """Chat-like traffic: log-normal lengths, so most requests are short and a few are very long.

    Real chat logs (e.g. ShareGPT, LMSYS) have long-tailed prompt and answer lengths; a log-normal
    with the given medians and sigma reproduces that shape without shipping any data.
    """

    input_median: int = 256
    output_median: int = 128
    sigma: float = 1.0
    max_input_len: int = 4096
    max_output_len: int = 1024

    def __post_init__(self) -> None:
        if min(self.input_median, self.output_median, self.max_input_len, self.max_output_len) < 1:
            raise DatasetError("synthetic-chat lengths must be >= 1")
        if self.sigma <= 0:
            raise DatasetError(f"--chat-sigma must be > 0, got {self.sigma}")

    def sample(self, num_requests: int, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)

        def draw(median: int, cap: int) -> np.ndarray:
            raw = rng.lognormal(mean=np.log(median), sigma=self.sigma, size=num_requests)
            return np.clip(np.rint(raw), 1, cap).astype(int)

        input_lens = draw(self.input_median, self.max_input_len)
        output_lens = draw(self.output_median, self.max_output_len)
        return [
            BenchRequest(prompt=random_words(rng, int(i)), prompt_len=int(i), output_len=int(o))
            for i, o in zip(input_lens, output_lens)
        ]


@dataclass(frozen=True)
class PrefixDataset:
    """Many requests behind a few long shared prefixes: exercises a server's prefix cache."""

    prefix_len: int = 512
    suffix_len: int = 32
    output_len: int = 64
    num_prefixes: int = 1

    def __post_init__(self) -> None:
        if self.prefix_len < 1 or self.suffix_len < 1 or self.output_len < 1:
            raise DatasetError("--prefix-len, --prefix-suffix-len and --prefix-output-len must be >= 1")
        if self.num_prefixes < 1:
            raise DatasetError(f"--prefix-num-prefixes must be >= 1, got {self.num_prefixes}")

    def sample(self, num_requests: int, seed: int) -> list[BenchRequest]:
        rng = np.random.default_rng(seed)
        prefixes = [random_words(rng, self.prefix_len) for _ in range(self.num_prefixes)]
        return [
            BenchRequest(
                prompt=f"{prefixes[i % self.num_prefixes]} {random_words(rng, self.suffix_len)}",
                prompt_len=self.prefix_len + self.suffix_len,
                output_len=self.output_len,
            )
            for i in range(num_requests)
        ]
