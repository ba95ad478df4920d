"""Structured outputs: grammars compiled with xgrammar, one matcher per constrained request, and
a token mask the runner applies to those requests' logits rows only.

    LLMEngine.add_request ─► manager.add (compile, cached; a matcher per completion)
    LLMEngine.step        ─► manager.token_mask(step) ─► runner masks the constrained rows
                          ─► manager.accept(sampled tokens) advances each matcher
"""

from kvserve.engine.structured_output.grammar_compiler import GrammarCompiler, StructuredOutputError
from kvserve.engine.structured_output.manager import StructuredOutputManager
from kvserve.engine.structured_output.token_mask import TokenMask, apply_token_mask

__all__ = ["GrammarCompiler", "StructuredOutputError", "StructuredOutputManager", "TokenMask", "apply_token_mask"]
