"""Raw Redis replies as the tests read them. redis-py 8 types every reply as ``bytes | str`` whatever the
client's ``decode_responses``; the tests' clients never decode, so each reply is bytes, and these say so (and
fail if it is not)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def raw(reply: Any) -> bytes:
    """One reply that must be bytes."""
    assert isinstance(reply, bytes), reply
    return reply


def raws(replies: Iterable[Any]) -> list[bytes]:
    """Replies (a list, a set, a hash's keys and values) that must each be bytes."""
    return [raw(reply) for reply in replies]
