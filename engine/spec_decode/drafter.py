"""Which requests get drafts after a step, and what they are (the n-gram index per request).

    updates of a step ──► NgramDrafter.propose ──► request.spec_token_ids (the scheduler reads them)

A request drafts when its next step is a decode and drafting cannot change what it samples:
not under presence/frequency/repetition penalties (their counts would have to follow every
draft position). min_tokens does not stop drafts: the sampler bans a row's stop tokens by that
row's own output count (its draft offset), so a stop token drafted before min_tokens is never
sampled there and the draft is rejected, as decoding without it would have it. (Benchmark clients
send min_tokens = max_tokens with ignore_eos, vLLM's and kvserve-bench alike: drafts held back
under min_tokens were no drafts at all for them.) Constrained requests keep only the drafts their
grammar allows (`validate`). A step with more running requests than disable_by_batch_size drafts nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.ngram_proposer import NgramIndex
from kvserve.scheduler.request import Request


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, requests: Iterable[Request], num_running: int,
                validate: Callable[[str, list[int]], list[int]] | None = None) -> None:
        """Sets each request's spec_token_ids for its next step (empty: no drafts)."""
        config = self.config
        disabled = config.disable_by_batch_size is not None and num_running > config.disable_by_batch_size
        for request in requests:
            if disabled or not _may_draft(request):
                request.spec_token_ids = []
                continue
            index = self._indexes.get(request.request_id)
            if index is None:
                index = self._indexes[request.request_id] = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            drafts = index.propose(request.all_token_ids, config.num_speculative_tokens)
            if drafts and validate is not None:
                drafts = validate(request.request_id, drafts)
            request.spec_token_ids = drafts

    def forget(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._indexes)


def _may_draft(request: Request) -> bool:
    params = request.sampling_params
    return params.presence_penalty == 0 and params.frequency_penalty == 0 and params.repetition_penalty == 1
