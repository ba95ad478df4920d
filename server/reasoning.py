"""Reasoning output (`--reasoning-parser`, vLLM's names): a reasoning model writes its thinking
between `<think>` and `</think>`, then its answer. The thinking goes to its own field
(`message.reasoning` in chat, a `reasoning` item in Responses, a `thinking` block in Messages);
tool-call parsing and output grammars apply to the answer alone.

    deepseek_r1   DeepSeek-R1 and its distills: the chat template opens `<think>` in the prompt,
                  so the output starts inside the reasoning (a repeated `<think>` is dropped); all
                  of it is reasoning until `</think>`
    qwen3         Qwen3 (and QwQ): the output opens `<think>` itself, or the prompt ends with it
                  (the 2507 thinking models); output that does not start with it is the answer

Reasoning cut off before `</think>` (max_tokens) stays reasoning: the streamed pieces then equal
the non-streamed message. Blanks right after `<think>`, right before `</think>` and right after
it are the tags' layout, not text, and are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.tool_parsers.segments import held_marker_prefix

START_TAG = "<think>"
END_TAG = "</think>"


@dataclass(frozen=True)
class ReasoningStyle:
    name: str
    always_opens: bool  # the output starts inside the reasoning even without START_TAG

    def starts_open(self, prompt_text: str) -> bool:
        """Whether generation starts inside the reasoning: always for deepseek_r1; for qwen3 when
        the rendered prompt ends with the start tag."""
        return self.always_opens or prompt_text.rstrip().endswith(START_TAG)


REASONING_PARSERS: dict[str, ReasoningStyle] = {
    "deepseek_r1": ReasoningStyle("deepseek_r1", always_opens=True),
    "qwen3": ReasoningStyle("qwen3", always_opens=False),
}


@dataclass(frozen=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits a growing output into reasoning and answer. `feed` returns what can be shown now;
    a tail that may still become a tag, and blanks that may turn out to be layout, wait."""

    def __init__(self, starts_open: bool) -> None:
        self._text = ""
        self._pos = 0  # characters of _text consumed
        self._opening = True  # the output may still open with START_TAG (even when the prompt did)
        self._in_reasoning = starts_open
        self._after_end = False  # in the answer after END_TAG: its leading blanks are layout
        self._reasoning_started = False  # leading blanks of the reasoning are layout
        self._held_blanks = ""  # trailing blanks of the reasoning shown so far

    def feed(self, text: str, final: bool) -> ReasoningDelta:
        self._text += text
        reasoning = ""
        if self._opening:
            rest = self._text[self._pos:].lstrip()
            if not final and START_TAG.startswith(rest):
                return ReasoningDelta()  # blanks, or part of the tag: undecided
            self._opening = False
            if rest.startswith(START_TAG):
                self._in_reasoning = True
                self._pos = len(self._text) - len(rest) + len(START_TAG)
        if self._in_reasoning:
            rest = self._text[self._pos:]
            end = rest.find(END_TAG)
            if end >= 0:
                reasoning = self._show_reasoning(rest[:end])
                self._held_blanks = ""  # layout before END_TAG
                self._in_reasoning = False
                self._after_end = True
                self._pos += end + len(END_TAG)
            else:
                keep = 0 if final else held_marker_prefix(rest, [END_TAG])
                reasoning = self._show_reasoning(rest[:len(rest) - keep])
                self._pos += len(rest) - keep
                if final:
                    self._held_blanks = ""
                return ReasoningDelta(reasoning=reasoning)
        content = self._text[self._pos:]
        if self._after_end:
            stripped = content.lstrip()
            if not stripped and not final:
                return ReasoningDelta(reasoning=reasoning)  # the next token may bring more blanks
            content = stripped
            self._after_end = False
        self._pos = len(self._text)
        return ReasoningDelta(reasoning, content)

    def _show_reasoning(self, new: str) -> str:
        if not self._reasoning_started:
            new = new.lstrip()
            if not new:
                return ""
            self._reasoning_started = True
        pending = self._held_blanks + new
        shown = pending.rstrip()
        self._held_blanks = pending[len(shown):]
        return shown


def split_reasoning(text: str, starts_open: bool) -> ReasoningDelta:
    """A whole output's reasoning and answer, exactly as the streamed pieces add up."""
    return ReasoningSplitter(starts_open).feed(text, final=True)
