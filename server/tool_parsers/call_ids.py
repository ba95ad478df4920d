"""Ids for the tool calls the server reports. OpenAI's are `call_` and random characters;
Mistral's chat templates refuse a history whose call ids are not exactly 9 letters and digits,
so a Mistral model gets such ids (as vLLM gives it), or the client's next turn would fail."""

from __future__ import annotations

import secrets
import string
import uuid
from collections.abc import Callable

_ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))


# Per --tool-call-parser name, where it differs from OpenAI's.
FAMILY_CALL_IDS: dict[str, Callable[[], str]] = {"mistral": mistral_call_id}
