"""One grammar matcher per constrained completion, advanced by the tokens it samples.

A preempted request keeps its output tokens and recomputes only its KV, so its matcher stays
valid: it samples again exactly where it stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from typing import TYPE_CHECKING

import torch

from kvserve.engine.structured_output.token_mask import TokenMask
from kvserve.scheduler.output import SchedulerOutput

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[str, xgr.GrammarMatcher] = {}

    def add(self, request_id: str, grammar: xgr.CompiledGrammar) -> None:
        """A matcher for one completion, over a grammar compiled already (GrammarCompiler)."""
        import xgrammar as xgr  # loaded by the compile already; see xgrammar_grammars.py

        self._matchers[request_id] = xgr.GrammarMatcher(grammar)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def token_mask(self, output: SchedulerOutput) -> TokenMask | None:
        """The mask for this step's sampling rows that are constrained, or None when none is."""
        if not self._matchers:
            return None
        sampling = [r for r in output.scheduled if r.samples]
        rows = [i for i, r in enumerate(sampling) if r.request_id in self._matchers]
        if not rows:
            return None
        import xgrammar as xgr  # loaded by the compile already; see xgrammar_grammars.py

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, i in enumerate(rows):
            self._matchers[sampling[i].request_id].fill_next_token_bitmask(bitmask, j)
        return TokenMask(torch.tensor(rows, dtype=torch.int64), bitmask)

    def accept(self, request_id: str, token_ids: Sequence[int]) -> None:
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return
        for token in token_ids:
            if not matcher.accept_token(token):
                # Only a forbidden token can get here (e.g. forced by logit_bias on an all -inf
                # row); stop constraining rather than fail the request.
                logger.warning("request %s: token %d does not fit its grammar; no longer constrained",
                               request_id, token)
                self.remove(request_id)
                return
            if matcher.is_terminated():
                # The grammar took its stop token: what follows (ignore_eos text) is free, and a
                # terminated matcher has no next-token mask to fill.
                self.remove(request_id)
                return
