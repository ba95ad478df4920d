"""Shared by the APIs that are translated into a chat request (Responses, Messages): errors
raised by the chat path name the chat request's fields; the client must see its own names."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from kvserve.server.errors import APIError


@contextmanager
def fields_named(names: Mapping[str, str]) -> Iterator[None]:
    """Renames the chat fields in an APIError raised inside (its `param`, and the names in its
    message) to the translated API's, e.g. {"max_completion_tokens": "max_output_tokens"}."""
    try:
        yield
    except APIError as error:
        if error.param is not None:
            head = re.match(r"[A-Za-z_]+", error.param)
            if head is not None and head.group(0) in names:
                error.param = names[head.group(0)] + error.param[head.end():]
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
        error.message = pattern.sub(lambda m: names[m.group(1)], error.message)
        error.args = (error.message,)
        raise
