"""Streaming token ids -> text, one detokenizer per completion.

Two things make this harder than `decode(new_token)`:

1. Byte-level BPE splits multi-byte characters across tokens (an emoji is often 2-4 tokens), and a
   lone piece decodes to U+FFFD. Decoding each token alone would stream garbage, and
   sentencepiece decoders drop the leading space of the first token they see.
2. A stop string may arrive split over several tokens, so text that could still turn out to be
   the start of a stop string must not be shown yet.

For (1) we keep a small window of token ids, as vLLM and TGI do:

        ids:   ... prompt tail | already streamed        | new tokens
                               ^prefix_offset            ^read_offset
        window text W = decode(ids[prefix_offset:])

The part of W before read_offset was already streamed; the rest is new, except a trailing run of
U+FFFD, which may be a character still missing its last bytes and is held back. When W ends on
a whole character the window slides forward (prefix_offset <- read_offset <- len(ids)), so every
step decodes only a few tokens. The window starts on the last few prompt tokens so the first
output token decodes with its real context (leading spaces survive).

For (2) released text passes through a small buffer that keeps the longest suffix which is a
proper prefix of some stop string; a full match truncates the output there (or after the stop
string with include_stop_str_in_output) and nothing after it is ever emitted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvserve.engine.text.tokenizer import Tokenizer

# How many prompt tokens give the first output tokens their decoding context (as in vLLM).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizerUpdate:
    new_text: str  # safe to show now: whole characters only, never part of a possible stop string
    stop_string: str | None = None  # the stop string that just matched; the completion is over


class DetokenizerFinishedError(RuntimeError):
    """Tokens were appended after the completion ended (a stop string matched, or flush ran)."""


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # Characters of the window text already released. A prompt that ends inside a character
        # leaves trailing U+FFFD here; the output token that completes it streams the whole character.
        self._window_released = len(self._decode_window(self._read_offset).rstrip(_REPLACEMENT_CHAR))
        self._stop_buffer = ""
        self._finished = False
        # Everything emitted so far, as pieces: `text += piece` on an attribute copies the whole
        # text at every token (CPython only extends a string in place for a local variable).
        self._pieces: list[str] = []
        self.stop_string: str | None = None

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    def append(self, token_ids: Sequence[int]) -> DetokenizerUpdate:
        if self._finished:
            raise DetokenizerFinishedError(
                "this completion already ended (stop string matched or flush() called); start a new detokenizer")
        self._ids.extend(token_ids)
        window = self._decode_window(len(self._ids))
        whole = len(window.rstrip(_REPLACEMENT_CHAR))
        released = window[self._window_released:whole] if whole > self._window_released else ""
        self._window_released = max(self._window_released, whole)
        if whole == len(window):
            self._slide_window()
        return self._release(released, final=False)

    def flush(self) -> str:
        """The held-back text, at the end of the completion: a trailing incomplete character (as
        U+FFFD, exactly as a full decode shows it) and text that was waiting to see whether it
        grows into a stop string. Empty after a stop string matched; calling it again returns ""."""
        if self._finished:
            return ""
        window = self._decode_window(len(self._ids))
        rest = window[self._window_released:]
        self._window_released = len(window)
        update = self._release(rest, final=True)
        self._finished = True
        return update.new_text

    # --- internals ----------------------------------------------------------------------------

    def _decode_window(self, end: int) -> str:
        return self._tokenizer.decode(self._ids[self._prefix_offset:end], skip_special_tokens=self._skip_special_tokens)

    def _slide_window(self) -> None:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._window_released = len(self._decode_window(self._read_offset))

    def _release(self, chunk: str, *, final: bool) -> DetokenizerUpdate:
        if not self._stop:  # most requests: nothing to look for, nothing to hold back
            if chunk:
                self._pieces.append(chunk)
            return DetokenizerUpdate(chunk)
        buffer = self._stop_buffer + chunk
        match = _earliest_stop(buffer, self._stop)
        if match is not None:
            start, stop = match
            emitted = buffer[: start + len(stop)] if self._include_stop else buffer[:start]
            self.stop_string = stop
            self._stop_buffer = ""
            self._finished = True
            self._pieces.append(emitted)
            return DetokenizerUpdate(emitted, stop)
        hold = 0 if final else _longest_stop_prefix_suffix(buffer, self._stop)
        emitted = buffer[: len(buffer) - hold]
        self._stop_buffer = buffer[len(buffer) - hold:]
        self._pieces.append(emitted)
        return DetokenizerUpdate(emitted)


def _earliest_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """(start, stop string) of the match that is complete first, i.e. ends earliest; of two
    ending at the same place, the longer. Generation ends the moment a stop string is complete,
    so the answer must not depend on how the text was cut into tokens."""
    best: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop)
        if at < 0:
            continue
        end, best_end = at + len(stop), (best[0] + len(best[1]) if best else None)
        if best is None or end < best_end or (end == best_end and at < best[0]):
            best = (at, stop)
    return best


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that some stop string starts with (and is not whole)."""
    longest = min(len(text), max((len(s) - 1 for s in stops), default=0))
    for length in range(longest, 0, -1):
        tail = text[-length:]
        if any(s.startswith(tail) for s in stops):
            return length
    return 0
