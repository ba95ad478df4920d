"""Structured outputs: grammars compiled with xgrammar, one matcher per constrained request, and
a token mask the runner applies to those requests' logits rows only.

    AsyncEngine.check_request ─► GrammarCompiler.compile_async (compile threads, bounded cache)
    LLMEngine.add_request ─► manager.add (the compiled grammar; a matcher per completion)
    LLMEngine.step        ─► manager.token_mask(step) ─► runner masks the constrained rows
                          ─► manager.accept(sampled tokens) advances each matcher
"""

from kvserve.engine.structured_output.grammar_compiler import GrammarCompiler
from kvserve.engine.structured_output.manager import StructuredOutputManager
from kvserve.engine.structured_output.token_mask import TokenMask, apply_token_mask
from kvserve.engine.structured_output.xgrammar_grammars import StructuredOutputError, XGrammarCompile

__all__ = ["GrammarCompiler", "StructuredOutputError", "StructuredOutputManager", "TokenMask", "XGrammarCompile",
           "apply_token_mask"]
