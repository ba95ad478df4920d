"""What a request's output must match (a JSON schema, any JSON object, a regex, one of a list of
strings, or an EBNF grammar), as plain data: the scheduler only carries it; the engine compiles it
and masks the logits (engine/structured_output/)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # spec: unused (any JSON object)
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # spec: EBNF (GBNF-style, as vLLM's guided_grammar)


@dataclass(frozen=True)
class StructuredOutputParams:
    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise ValueError(f"kind must be a GrammarKind, got {self.kind!r}")
        if self.kind is not GrammarKind.JSON_OBJECT and not self.spec:
            raise ValueError(f"a {self.kind.value} constraint needs a non-empty spec")
