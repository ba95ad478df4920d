"""Constraints compiled into xgrammar grammars over the model's vocabulary.

The vocabulary is given to xgrammar as each token's raw bytes, so the same code serves byte-level
BPE, sentencepiece and GGUF tokenizers. Special tokens get no bytes (no grammar can produce
them); the end-of-generation ids are the grammar's stop tokens, allowed once it is complete.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvserve.engine.admission import AdmissionError
from kvserve.engine.text.tokenizer import Tokenizer
from kvserve.scheduler.structured_output_params import GrammarKind, StructuredOutputParams

if TYPE_CHECKING:
    import xgrammar as xgr


class StructuredOutputError(AdmissionError):
    """A constraint the grammar engine cannot compile (its field: "structured_output")."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "structured_output")


class XGrammarCompile:
    """`compile(params)`: one constraint as an xgrammar CompiledGrammar, or StructuredOutputError.
    Safe from several threads at once (xgrammar releases the GIL while it compiles). The xgrammar
    compiler is built on first use: the vocabulary pass costs a fraction of a second on a 50k
    vocabulary, which engines that never see a constrained request should not pay."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()  # between compile threads only: one vocabulary pass

    def __call__(self, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        try:
            return self._compile(self._grammar_compiler(), params)
        except (RuntimeError, ValueError, TypeError) as error:  # xgrammar reports bad specs so
            raise StructuredOutputError(f"the {params.kind.value} constraint cannot be compiled: {error}") from None

    def _grammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                # Imported on first use: xgrammar pulls in transformers, seconds of start-up that
                # engines never asked for a grammar should not pay.
                import xgrammar as xgr

                tokenizer = self.tokenizer
                encoded = [b"" if i in tokenizer.special_token_ids else tokenizer.token_to_bytes(i)
                           for i in range(min(tokenizer.vocab_size, self.vocab_size))]
                info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=self.stop_token_ids or None)
                # xgrammar's own cache keeps every grammar ever compiled (unbounded by default);
                # GrammarCompiler's bounded one is the cache.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, params: StructuredOutputParams) -> xgr.CompiledGrammar:
        # Compact JSON (no free whitespace): a small model given free whitespace can loop on it.
        match params.kind:
            case GrammarKind.JSON_SCHEMA:
                return compiler.compile_json_schema(params.spec, any_whitespace=False, strict_mode=True)
            case GrammarKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            case GrammarKind.REGEX:
                return compiler.compile_regex(params.spec)
            case GrammarKind.CHOICE:
                return compiler.compile_grammar(choice_grammar(json.loads(params.spec)))
            case GrammarKind.GRAMMAR:
                return compiler.compile_grammar(params.spec)
        raise ValueError(f"unknown grammar kind {params.kind!r}")


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF accepting exactly one of `choices`. JSON string syntax is valid EBNF string syntax
    for xgrammar, so json.dumps escapes quotes, backslashes and control characters."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choices must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
