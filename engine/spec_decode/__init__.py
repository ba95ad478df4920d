"""Speculative decoding: drafts proposed for a request from its own tokens (n-gram / prompt
lookup), scheduled with its next decode token and verified in the same forward pass."""

from kvserve.engine.spec_decode.config import SpeculativeConfig
from kvserve.engine.spec_decode.drafter import NgramDrafter
from kvserve.engine.spec_decode.ngram_proposer import NgramIndex

__all__ = ["NgramDrafter", "NgramIndex", "SpeculativeConfig"]
