"""`--speculative-config` / `LLM(speculative_config=...)`, as vLLM spells it:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
     "disable_by_batch_size": 8}

Only the n-gram method (prompt lookup) exists here: it needs no second model. A draft of the
longest suffix that occurred before (prompt_lookup_max tokens down to prompt_lookup_min) is the
num_speculative_tokens tokens that followed it. disable_by_batch_size: a step with more running
requests than this drafts nothing (a large batch is compute-bound: verifying drafts there costs
more than it saves; benchmarks/spec_decode.py measures where).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)
OPTION = "--speculative-config"


class SpeculativeConfigError(ValueError):
    """An invalid speculative configuration; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpeculativeConfigError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SpeculativeConfigError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                                         f"prompt_lookup_max ({self.prompt_lookup_max})")
        size = self.disable_by_batch_size
        if size is not None and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
            raise SpeculativeConfigError(f"disable_by_batch_size must be a whole number >= 1, got {size!r}")

    @classmethod
    def parse(cls, value: str | Mapping[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the CLI's JSON text, a dict (LLM's argument) or a config; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise SpeculativeConfigError(f"not valid JSON: {error}") from None
        if not isinstance(value, Mapping):
            raise SpeculativeConfigError(f"expected a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise SpeculativeConfigError("num_speculative_tokens is required")
        options = dict(value)
        # One bound given: the other follows it, as vLLM does.
        if "prompt_lookup_min" in options and "prompt_lookup_max" not in options:
            options["prompt_lookup_max"] = max(options["prompt_lookup_min"], cls.prompt_lookup_max)
        if "prompt_lookup_max" in options and "prompt_lookup_min" not in options:
            options["prompt_lookup_min"] = min(options["prompt_lookup_max"], cls.prompt_lookup_min)
        return cls(**options)
