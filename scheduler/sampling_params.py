"""How one request wants its tokens chosen and when it should stop.

Field names follow vLLM's `SamplingParams` so users can move code between the two. The object is
frozen and validates itself: an invalid value raises `SamplingParamsError` naming the field at
fault, as this class spells it; the HTTP layer maps it to the request field of the API called.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from kvserve.scheduler.structured_output_params import StructuredOutputParams


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; `field` names it (a field of SamplingParams)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's plus the top k
    # Same for each prompt token after the first (vLLM's name). Such a request skips the prefix
    # cache: a cached block's positions would never pass through the model to be scored.
    prompt_logprobs: int | None = None
    # The output must match this grammar; the engine masks the logits of every step to it.
    structured_output: StructuredOutputParams | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # Accept the list / str spellings users pass and store hashable, immutable forms.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        object.__setattr__(self, "logit_bias", dict(self.logit_bias or {}))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _require(isinstance(self.n, int) and self.n >= 1, "n", f"n must be >= 1, got {self.n}")
        _require(_finite(self.temperature) and self.temperature >= 0, "temperature",
                 f"temperature must be >= 0, got {self.temperature}")
        _require(_finite(self.top_p) and 0 < self.top_p <= 1, "top_p",
                 f"top_p must be in (0, 1], got {self.top_p}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k",
                 f"top_k must be -1, 0 or a positive integer, got {self.top_k}")
        _require(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p",
                 f"min_p must be in [0, 1], got {self.min_p}")
        _require(self.seed is None or isinstance(self.seed, int), "seed", "seed must be an integer")
        _require(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                 "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        _require(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens",
                 f"min_tokens must be >= 0, got {self.min_tokens}")
        _require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
                 f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        _require(all(isinstance(s, str) and s for s in self.stop), "stop",
                 "stop strings must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
                 "stop_token_ids must be non-negative integers")
        _require(self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
                 "logprobs", f"logprobs must be a non-negative integer, got {self.logprobs}")
        _require(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int) and self.prompt_logprobs >= 0),
                 "prompt_logprobs", f"prompt_logprobs must be a non-negative integer, got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_finite(value) and -2 <= value <= 2, name, f"{name} must be in [-2, 2], got {value}")
        _require(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for token, bias in self.logit_bias.items():
            _require(isinstance(token, int) and token >= 0, "logit_bias",
                     f"logit_bias keys must be token ids, got {token!r}")
            _require(_finite(bias) and -100 <= bias <= 100, "logit_bias",
                     f"logit_bias values must be in [-100, 100], got {bias}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require(condition: bool, field_name: str, message: str) -> None:
    if not condition:
        raise SamplingParamsError(field_name, message)

