"""Turns an OpenAI request's sampling fields into `SamplingParams`, enforcing the server's caps.

Range checks live in `SamplingParams` itself (it raises `SamplingParamsError` naming its own
field); this module adds what only the server knows: the caps in `ServerLimits` and OpenAI's
spellings (string keys in `logit_bias`, `max_completion_tokens`, `top_logprobs`). The request's
output constraint is attached by the caller (structured_outputs.py, tool calls, reasoning).
"""

from __future__ import annotations

from dataclasses import replace

from kvserve.engine import SamplingParams, SamplingParamsError
from kvserve.server.errors import bad_request, refused
from kvserve.server.limits import ServerLimits
from kvserve.server.protocol import UNSUPPORTED_FIELDS, SamplingFields


def reject_unsupported_fields(request: SamplingFields) -> None:
    """OpenAI fields we know but do not implement get a 400 unless their value means "not used";
    unknown fields are ignored (see ignored_fields.py)."""
    for name, value in (request.model_extra or {}).items():
        if name in UNSUPPORTED_FIELDS:
            if value in UNSUPPORTED_FIELDS[name] or (name == "best_of" and value == request.n):
                continue
            raise bad_request(f"'{name}' is not supported by this server; remove it from the request.", name)
    if request.stream_options is not None and not request.stream:
        # OpenAI's behaviour: options for a stream make no sense without one.
        raise bad_request("stream_options is only allowed when stream is true.", "stream_options")


def build_sampling_params(request: SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                          logprobs_param: str, limits: ServerLimits) -> SamplingParams:
    """`max_tokens` None means "as many as fit"; the caller resolves it per prompt with
    `with_max_tokens` once the prompt length is known."""
    _check_caps(request, max_tokens, logprobs, logprobs_param, limits)
    try:
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else request.top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=_stop_strings(request.stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            include_stop_str_in_output=request.include_stop_str_in_output,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=_logit_bias(request.logit_bias, limits),
            skip_special_tokens=request.skip_special_tokens,
        )
    except SamplingParamsError as error:
        raise refused(error, {"logprobs": logprobs_param}) from None


def with_max_tokens(params: SamplingParams, max_tokens: int | None) -> SamplingParams:
    try:
        return replace(params, max_tokens=max_tokens)
    except SamplingParamsError as error:  # e.g. min_tokens above what the context leaves after the prompt
        raise bad_request(f"{error} (the most this prompt leaves room for)", error.field) from None


def _check_caps(request: SamplingFields, max_tokens: int | None, logprobs: int | None, logprobs_param: str,
                limits: ServerLimits) -> None:
    def cap(condition: bool, param: str, message: str) -> None:
        if not condition:
            raise bad_request(message, param)

    cap(request.n <= limits.max_n, "n", f"n must be at most {limits.max_n}, got {request.n}")
    cap(logprobs is None or logprobs <= limits.max_logprobs, logprobs_param,
        f"{logprobs_param} must be at most {limits.max_logprobs}, got {logprobs}")
    cap(max_tokens is None or max_tokens <= limits.max_tokens, "max_tokens",
        f"max_tokens must be at most {limits.max_tokens} on this server, got {max_tokens}")
    stops = _stop_strings(request.stop)
    cap(len(stops) <= limits.max_stop_strings, "stop",
        f"at most {limits.max_stop_strings} stop strings are allowed, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    cap(longest <= limits.max_stop_string_length, "stop",
        f"stop strings may be at most {limits.max_stop_string_length} characters, got one of {longest}")
    cap(len(request.stop_token_ids or ()) <= limits.max_stop_strings, "stop_token_ids",
        f"at most {limits.max_stop_strings} stop_token_ids are allowed")


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _logit_bias(bias: dict[str, float] | None, limits: ServerLimits) -> dict[int, float]:
    if not bias:
        return {}
    if len(bias) > limits.max_logit_bias:
        raise bad_request(f"logit_bias may hold at most {limits.max_logit_bias} entries, got {len(bias)}",
                          "logit_bias")
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        try:
            parsed[int(key)] = value
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return parsed


