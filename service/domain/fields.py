"""Stored fields and the rules every backend applies to them (liveness and ETags).

Kept free of any I/O so that the SQLite backend calls these functions and the Redis Lua scripts reproduce
them; the contract suite checks that both agree.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from .errors import MalformedRequest

#: Marks the packed form with base-36 times. Releases before it wrote the times in decimal, which never start
#: with ``~``: both are read, only this one is written.
PACKED_MARK = b"~"
_DIGITS = b"0123456789abcdefghijklmnopqrstuvwxyz"


@lru_cache(maxsize=1024)
def base36(n: int) -> bytes:
    """``n`` in base 36 (lowercase digits, ``-`` before a negative one). Cached: one write packs the same
    written_at, and mostly the same expires_at, into every field it sets."""
    if n < 0:
        return b"-" + base36(-n)
    out = bytearray()
    while True:
        n, digit = divmod(n, 36)
        out.append(_DIGITS[digit])
        if not n:
            break
    out.reverse()
    return bytes(out)


def packed_times(expires: bytes, written: bytes) -> tuple[int, int]:
    """``(expires_at, written_at)`` from the first two parts of a packed field, in either form."""
    if expires[:1] == PACKED_MARK:
        return int(expires[1:], 36), int(written, 36)
    return int(expires), int(written)


@dataclass(slots=True)
class StoredField:
    """One field as kept in the store: its JSON encoding and when it was written and expires (epoch ms).

    Treated as immutable; not declared frozen because a frozen dataclass is built 3.5x slower, and every
    memory read builds one per field."""

    value: bytes
    expires_at: int
    written_at: int
    #: The packed form, when the field was read in it (saves formatting it again for the ETag; a field
    #: stored by an earlier release keeps its decimal form, and so its ETag, until it is written again).
    raw: bytes = field(default=b"", compare=False, repr=False)

    def packed(self) -> bytes:
        """The Redis representation: ``~<expires_at>|<written_at>|<json>``, both times in base 36 (a field of
        ten bytes of JSON takes 29 bytes, where the decimal ``<expires_at>|<written_at>|<json>`` of earlier
        releases took 38). Mirrored in ``lua/field.lua``."""
        return self.raw or b"~%s|%s|%s" % (base36(self.expires_at), base36(self.written_at), self.value)

    def packed_decimal(self) -> bytes:
        """The form releases before the base-36 one wrote and read, ``<expires_at>|<written_at>|<json>``
        in decimal (what a store writes while such a release still runs beside this one)."""
        return self.raw or b"%d|%d|%s" % (self.expires_at, self.written_at, self.value)

    @classmethod
    def unpack(cls, data: bytes) -> StoredField:
        expires, written, value = data.split(b"|", 2)
        expires_at, written_at = packed_times(expires, written)
        return cls(value, expires_at, written_at, data)


def effective_expiry(name: str, field: StoredField, ttl_ms: Mapping[str, int]) -> int:
    """When a field stops being readable under the project's *current* configuration.

    The stored expiry was fixed at write time; if the configuration since shortened the field's TTL or
    dropped the key from ``state_keys``, the shorter bound applies at once (no field outlives retention).
    """
    return min(field.expires_at, field.written_at + ttl_ms.get(name, 0))


def live_fields(
    fields: Mapping[str, StoredField], ttl_ms: Mapping[str, int], now_ms: int
) -> dict[str, StoredField]:
    return {name: f for name, f in fields.items() if now_ms < effective_expiry(name, f, ttl_ms)}


_EMPTY_ETAG = '"' + hashlib.sha1(b"", usedforsecurity=False).hexdigest()[:20] + '"'


def compute_etag(live: Mapping[str, StoredField]) -> str:
    """Strong ETag over the live fields (names, values and expiries). Mirrored in ``lua/patch.lua``."""
    if not live:
        return _EMPTY_ETAG
    parts: list[bytes] = []
    for name in sorted(live):
        parts += (name.encode(), b"\n", live[name].packed(), b"\n")
    return '"' + hashlib.sha1(b"".join(parts), usedforsecurity=False).hexdigest()[:20] + '"'


@dataclass(frozen=True, slots=True)
class WriteCondition:
    """An ``If-Match`` precondition, with what the store needs to evaluate it atomically.

    ``etags`` are the entity tags listed in the header (compared strongly); ``any_existing`` is ``If-Match: *``,
    which holds when the caller has at least one live field.
    """

    etags: tuple[str, ...]
    any_existing: bool
    ttl_ms: Mapping[str, int]

    @classmethod
    def from_header(cls, header: str, ttl_ms: Mapping[str, int]) -> WriteCondition:
        tags = entity_tags(header, "If-Match")
        if tags == ("*",):
            return cls(etags=(), any_existing=True, ttl_ms=ttl_ms)
        return cls(etags=tags, any_existing=False, ttl_ms=ttl_ms)

    def holds(self, live: Mapping[str, StoredField]) -> bool:
        if self.any_existing:
            return bool(live)
        return compute_etag(live) in self.etags


#: An entity tag (RFC 9110 8.8.3): optionally weak, then printable ASCII other than '"' between quotes.
_ENTITY_TAG = re.compile(r'(?:W/)?"[\x21\x23-\x7e]{0,64}"', re.ASCII)
_MAX_TAGS = 16


def entity_tags(header: str, name: str) -> tuple[str, ...]:
    """The entity tags listed in an ``If-Match`` or ``If-None-Match`` header, or ``("*",)``; anything else
    is a malformed header (400), never a precondition that silently fails."""
    header = header.strip()
    if header == "*":
        return ("*",)
    tags = tuple(tag.strip() for tag in header.split(","))
    if not 1 <= len(tags) <= _MAX_TAGS or not all(_ENTITY_TAG.fullmatch(tag) for tag in tags):
        raise MalformedRequest(
            f'{name}: not a list of at most {_MAX_TAGS} entity tags (such as "5d41402abc4b2a76b971") or *'
        )
    return tags
