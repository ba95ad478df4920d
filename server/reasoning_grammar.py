"""Output constraints for reasoning models: the grammar must let the model think freely and
apply to the answer only, after `</think>`. The request's constraint (a JSON schema, a regex, a
forced tool call, ...) is rewritten as one EBNF grammar,

    root ::= reasoning answer          reasoning ::= "<think>"? text-without-</think> "</think>" blanks

(optional when the output may start with the answer: qwen3 unless the prompt opened `<think>`), which the engine compiles like any `guided_grammar`. xgrammar itself turns the
constraint into EBNF, with the same options the engine compiles the constraint with (compact
JSON, strict schemas), so the answer is held to exactly what it would be without reasoning.
"""

from __future__ import annotations

import json

from kvserve.engine import GrammarKind, StructuredOutputParams
from kvserve.server.errors import bad_request
from kvserve.server.reasoning import END_TAG, START_TAG
from kvserve.server.structured_outputs import OutputConstraint


def _text_without(tag: str) -> str:
    """EBNF for any text that does not contain `tag`, whose first character occurs in it only
    once (true of `</think>`): state i has matched the tag's first i characters; a new first
    character restarts the match at 1, any other mismatch at 0."""
    first = tag[0]
    rules = [f'think_0 ::= "" | [^{_escape(first)}] think_0 | "{first}" think_1']
    for i in range(1, len(tag)):
        follow = f' | "{_escape_str(tag[i])}" think_{i + 1}' if i + 1 < len(tag) else ""
        rules.append(f'think_{i} ::= "" | "{first}" think_1{follow} | [^{_escape(first)}{_escape(tag[i])}] think_0')
    return "\n".join(rules)


def _escape(char: str) -> str:
    return "\\" + char if char in "\\]^-" else char


def _escape_str(char: str) -> str:
    return "\\" + char if char in '\\"' else char


def _reasoning_grammar(starts_open: bool) -> str:
    if starts_open:  # inside the reasoning from the start; tolerate the model repeating the tag
        return f'root ::= "{START_TAG}"? think_0 "{END_TAG}" blanks\n' + _BLANKS + _text_without(END_TAG)
    return f'root ::= ("{START_TAG}" think_0 "{END_TAG}" blanks)?\n' + _BLANKS + _text_without(END_TAG)


_BLANKS = 'blanks ::= [ \\t\\r\\n]{0,8}\n'


def after_reasoning(constraint: OutputConstraint, starts_open: bool) -> OutputConstraint:
    """`constraint` applied after the reasoning, which is required when the output starts inside
    it (deepseek_r1, or a prompt that opened it) and optional otherwise (qwen3)."""
    import xgrammar as xgr  # imported on use: it loads in seconds, and only reasoning servers need it

    try:
        reasoning = xgr.Grammar.from_ebnf(_reasoning_grammar(starts_open))
        answer = _as_grammar(xgr, constraint.params)
    except (RuntimeError, ValueError, TypeError) as error:
        raise bad_request(f"{constraint.param}: the {constraint.params.kind.value} constraint cannot be compiled: "
                          f"{error}", constraint.param) from None
    grammar = StructuredOutputParams(GrammarKind.GRAMMAR, str(xgr.Grammar.concat(reasoning, answer)))
    return OutputConstraint(grammar, constraint.param)


def _as_grammar(xgr, constraint: StructuredOutputParams):  # noqa: ANN001, ANN202 (xgrammar is imported lazily)
    match constraint.kind:
        case GrammarKind.JSON_SCHEMA:
            return xgr.Grammar.from_json_schema(constraint.spec, any_whitespace=False, strict_mode=True)
        case GrammarKind.JSON_OBJECT:
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        case GrammarKind.REGEX:
            return xgr.Grammar.from_regex(constraint.spec)
        case GrammarKind.CHOICE:
            choices = json.loads(constraint.spec)
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        case GrammarKind.GRAMMAR:
            return xgr.Grammar.from_ebnf(constraint.spec)
    raise ValueError(f"unknown grammar kind {constraint.kind!r}")
