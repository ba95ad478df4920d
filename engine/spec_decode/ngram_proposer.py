"""Prompt-lookup drafts: where did the request's current suffix occur before, and what followed?

    tokens:  ... a b c d e ... x a b c      suffix "a b c" (n = 3) occurred ending at e'
                       ^e'                  draft = the k tokens after e': "d e ..."

Each request keeps an index from every n-gram (prompt_lookup_min <= n <= prompt_lookup_max) to
the last position where one ended, extended by the tokens a step added; so a step costs each
request a few dict operations, not a scan of its context. The suffix is looked up before its own
n-grams go in, so a match is always an earlier occurrence; the latest earlier one wins (nearby
text is the likeliest to repeat next). Longer n-grams are tried first.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._num_indexed = 0  # n-grams ending before this position are in the index

    def propose(self, token_ids: list[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts to follow `token_ids` (the request's prompt and outputs so far;
        it only ever grows between calls)."""
        last = len(token_ids) - 1
        self._index_until(token_ids, last)
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            end = self._ends[n].get(tuple(token_ids[last - n + 1:last + 1]))
            if end is not None:
                return token_ids[end + 1:end + 1 + num_tokens]
        return []

    def _index_until(self, token_ids: list[int], stop: int) -> None:
        """Adds the n-grams ending at positions _num_indexed .. stop - 1."""
        for end in range(self._num_indexed, stop):
            for n, ends in self._ends.items():
                if end + 1 >= n:
                    ends[tuple(token_ids[end - n + 1:end + 1])] = end
        self._num_indexed = max(self._num_indexed, stop)
