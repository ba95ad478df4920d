"""Decides whether a request is done after a token was appended to it.

Stop strings are not checked here: they need detokenized text, which the engine owns; it ends
such a request through `Scheduler.finish_requests`.
"""

from __future__ import annotations

from kvserve.scheduler.request import FinishReason, Request


def check_stop(request: Request, max_model_len: int) -> bool:
    """Sets `finish_reason` (and `stop_reason`) and returns True when the request's last token
    ends it. Order matters when several apply to the same token: a stop token wins over a length
    limit, so a request whose last allowed token is EOS reports "stop", as OpenAI's API does."""
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    last_token = output_token_ids[-1]
    num_output = len(output_token_ids)
    # min_tokens holds back stop tokens and EOS only; the length limits always apply.
    if num_output >= params.min_tokens:
        if last_token in params.stop_token_ids:
            return _finish(request, FinishReason.STOP, last_token)
        if not params.ignore_eos and last_token in request.eos_token_ids:
            return _finish(request, FinishReason.STOP, None)
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return _finish(request, FinishReason.LENGTH, None)
    num_tokens = len(request.all_token_ids)
    if num_tokens >= max_model_len:
        return _finish(request, FinishReason.LENGTH, None)
    return False


def _finish(request: Request, reason: FinishReason, stop_reason: int | None) -> bool:
    request.finish_reason = reason
    request.stop_reason = stop_reason
    return True
