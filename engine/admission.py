"""Admission: the one check a request passes before the engine takes it.

Everything that depends on the served model is checked here, once, against the engine's own
facts: the prompt fits in max_model_len (with max_tokens, when given), every token id (prompt,
logit_bias, stop_token_ids) is a row of the model's vocabulary, `priority` is used only under
priority scheduling and `cache_salt` is a real salt. Ranges that need no model (temperature, n,
...) are SamplingParams' own checks.

`LLMEngine.add_request` runs it for every request. The server runs the same check before it
answers (so a refusal is a 400 rather than an error event inside a stream): an `AdmissionError`
names the engine's field at fault (add_request's arguments, SamplingParams' fields); the server
maps it to the field of the API that was called and picks that API's error code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvserve.scheduler.config import SchedulerConfig, SchedulingPolicy
from kvserve.scheduler.sampling_params import SamplingParams


class AdmissionError(ValueError):
    """A request the engine will not take. `field` names the engine's input to change: "prompt",
    "priority", "cache_salt", or a SamplingParams field ("max_tokens", "logit_bias",
    "stop_token_ids", "structured_output")."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(AdmissionError):
    """The prompt (plus the tokens asked for) does not fit in max_model_len. `field` is "prompt",
    or "max_tokens" when the prompt alone fits."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        super().__init__(self.describe(), "prompt" if self._prompt_at_fault else "max_tokens")

    @property
    def _prompt_at_fault(self) -> bool:
        return self.max_tokens is None or self.num_prompt_tokens >= self.max_model_len

    def describe(self, max_tokens_name: str = "max_tokens") -> str:
        """The message, with the completion budget named as the caller's API names it."""
        if self._prompt_at_fault:
            return (f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                    f"{self.num_prompt_tokens} tokens. Please shorten the prompt.")
        return (f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{self.num_prompt_tokens + self.max_tokens} tokens ({self.num_prompt_tokens} in the prompt, "
                f"{self.max_tokens} for the completion). Please reduce the prompt or {max_tokens_name}.")


@dataclass(frozen=True)
class AdmissionCheck:
    """The engine's facts a request is checked against: its scheduler's settings (max_model_len,
    the policy) and the model's vocabulary. Immutable, so any thread may call it."""

    scheduler_config: SchedulerConfig
    vocab_size: int  # the model's: the rows of its embedding and logits

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams, *, priority: int = 0,
              cache_salt: str | None = None) -> None:
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise AdmissionError("The prompt is empty: give at least one token.", "prompt")
        if num_prompt >= self.max_model_len or (
            params.max_tokens is not None and num_prompt + params.max_tokens > self.max_model_len
        ):
            raise PromptTooLongError(num_prompt, params.max_tokens, self.max_model_len)
        self._check_in_vocab(prompt_token_ids, "prompt", "Token id {} in the prompt")
        self._check_in_vocab(params.logit_bias, "logit_bias", "logit_bias token id {}")
        self._check_in_vocab(params.stop_token_ids, "stop_token_ids", "stop token id {}")
        policy = self.scheduler_config.policy
        if priority != 0 and policy is not SchedulingPolicy.PRIORITY:
            # As vLLM: a priority that would be silently ignored is an error.
            raise AdmissionError(f"priority {priority} needs priority scheduling; this engine schedules "
                                 f"{policy.value} (start it with --scheduling-policy priority).", "priority")
        if cache_salt is not None and not cache_salt:
            raise AdmissionError("cache_salt must be a non-empty string when given.", "cache_salt")
        if cache_salt is not None and not _is_utf8(cache_salt):
            # The prefix cache hashes the salt's UTF-8 bytes, in the engine's step: refuse here,
            # or a lone surrogate would fail that step and with it the engine.
            raise AdmissionError("cache_salt must be valid Unicode text (it holds an unpaired surrogate).",
                                 "cache_salt")

    def _check_in_vocab(self, token_ids: Iterable[int], field: str, what: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise AdmissionError(f"{what.format(bad)} is outside the vocabulary [0, {self.vocab_size}).", field)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
