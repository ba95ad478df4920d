"""Caps on what one request may ask for, so that no single client can exhaust the server.

Every cap is a positive number with a default that is safe for a shared deployment; operators
raise them with `kvserve serve --max-...` flags. Requests above a cap get a 400 naming the field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvserve.engine import ConfigError


@dataclass(frozen=True)
class ServerLimits:
    max_n: int = 8  # completions per prompt
    max_logprobs: int = 20  # OpenAI's own ceiling for logprobs / top_logprobs
    max_stop_strings: int = 16
    max_stop_string_length: int = 256  # characters
    max_tokens: int = 4096  # tokens one completion may ask for
    max_prompts_per_request: int = 64  # a batched /v1/completions prompt list
    max_body_bytes: int = 4 * 1024 * 1024
    max_logit_bias: int = 300  # entries in logit_bias (OpenAI's ceiling)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            minimum = 0 if name == "max_logprobs" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                option = "--" + name.replace("_", "-")
                raise ConfigError(option, f"{option} must be an integer >= {minimum}, got {value!r}")
