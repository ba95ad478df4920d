"""One grammar matcher per constrained completion, advanced by the tokens it samples.

A preempted request keeps its output tokens and recomputes only its KV, so its matcher stays
valid: it samples again exactly where it stopped.

With speculative decoding a request samples one row per draft position. Its drafts were cut to
the prefix its grammar accepts (valid_drafts), so the mask of row j is the matcher's state after
drafts[:j]: the matcher walks the drafts while filling the rows and rolls back, and then accepts
only the tokens the request kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

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

    def __len__(self) -> int:
        return len(self._matchers)

    def valid_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar accepts, stopping before a token
        that would end the grammar (no row may follow a terminated matcher)."""
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return drafts
        accepted = 0
        for token in drafts:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                matcher.rollback(1)
                accepted -= 1
                break
        if accepted:
            matcher.rollback(accepted)
        return drafts[:accepted]

    def forced_tokens(self, request_id: str, encode: Callable[[str], list[int]],
                      token_bytes: Callable[[int], bytes]) -> list[int]:
        """Jump-forward decoding: the tokens of the text the grammar admits as the only way on,
        split as the tokenizer splits text (`encode`), so the model sees the tokens it was
        trained on rather than the odd fragments a mask lets it spell them with. [] when the
        grammar leaves a choice. The matcher is left as it was (the engine accepts the tokens
        with the rest of the request's output).

        The text's last token may merge with what follows ("name" before the model's ":" can
        be one token), so it is kept only where xgrammar's own split of the forced text reaches
        its end (find_jump_forward_tokens stops before a token a longer one extends)."""
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_terminated():
            return []
        text = matcher.find_jump_forward_string()
        if not text:
            return []
        safe = matcher.find_jump_forward_tokens()
        canonical = encode(text)
        if b"".join(token_bytes(t) for t in safe) != text.encode("utf-8"):
            canonical = canonical[:-1]
        # A split the grammar refuses (a tokenizer that adds a prefix space, an unknown word):
        # xgrammar's own.
        return canonical if canonical and _accepts(matcher, canonical) else safe

    def token_mask(self, output: SchedulerOutput) -> TokenMask | None:
        """The mask for this step's sampling rows that are constrained, or None when none is."""
        if not self._matchers:
            return None
        rows: list[int] = []  # logits rows: one per sampling request, and one more per draft
        constrained: list[tuple[int, str, tuple[int, ...]]] = []
        row = 0
        for scheduled in output.scheduled:
            if not scheduled.samples:
                continue
            drafts = tuple(scheduled.spec_token_ids)
            if scheduled.request_id in self._matchers:
                constrained.append((len(rows), scheduled.request_id, drafts))
                rows.extend(range(row, row + len(drafts) + 1))
            row += len(drafts) + 1
        if not rows:
            return None
        import xgrammar as xgr  # loaded by the compile already; see xgrammar_grammars.py

        bitmask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for first, request_id, drafts in constrained:
            matcher = self._matchers[request_id]
            for j, token in enumerate(drafts):
                matcher.fill_next_token_bitmask(bitmask, first + j)
                if not matcher.accept_token(token):  # valid_drafts let it through: cannot happen
                    raise RuntimeError(f"request {request_id}: draft token {token} does not fit its grammar")
            matcher.fill_next_token_bitmask(bitmask, first + len(drafts))
            if drafts:
                matcher.rollback(len(drafts))
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


def _accepts(matcher: xgr.GrammarMatcher, token_ids: list[int]) -> bool:
    """Whether the grammar takes `token_ids` from the matcher's state (which is left unchanged)."""
    accepted = 0
    for token in token_ids:
        if not matcher.accept_token(token):
            break
        accepted += 1
    if accepted:
        matcher.rollback(accepted)
    return accepted == len(token_ids)
