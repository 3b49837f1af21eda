"""How records are stored as bytes, the same on every backend: a listed conversation, an audit record, what
the end of a conversation found for analytics.

Storage details, kept out of the domain's Store interface (:mod:`caller_memory.service.domain.store`).
"""

from __future__ import annotations

from typing import Any

import orjson

from ..domain.errors import StoreCorrupt
from ..domain.fields import PACKED_MARK, StoredField
from ..domain.store import BUCKET_KINDS, AuditEntry, ConversationEntry, EndAnalytics, FirstInteraction

#: The stored analytics of a conversation ended with analytics off.
NO_ANALYTICS = b"{}"


def encode_entry(entry: ConversationEntry) -> bytes:
    """The stored form of a listed conversation (the same bytes on every backend): a JSON object of its
    fields, ``first`` nested, ``ended_by`` and ``end_reason`` included."""
    return orjson.dumps(entry)  # orjson writes a dataclass as asdict() would, field by field, 5x faster


def decode_entry(data: bytes) -> ConversationEntry:
    """Read :func:`encode_entry`'s bytes. Entries stored before conversations could end other than by the
    end call have neither ``ended_by`` nor ``end_reason``: they read as ended by it (``explicit``), with no
    reason, which is what they were."""
    raw = orjson.loads(data)
    first = raw["first"]
    return ConversationEntry(
        conversation_id=raw["conversation_id"],
        hour=raw["hour"],
        channel=raw["channel"],
        qa=raw["qa"],
        handoff_reason=raw["handoff_reason"],
        handoff_to=raw["handoff_to"],
        first=FirstInteraction(**first) if first is not None else None,
        ended_by=raw.get("ended_by", "explicit"),
        end_reason=raw.get("end_reason"),
        attestation=raw.get("attestation"),
    )


def audit_id(number: int) -> str:
    """Audit ids are zero-padded decimal, so that they sort as they increase on every backend."""
    return f"{number:020d}"


def encode_audit(entry: AuditEntry) -> bytes:
    return orjson.dumps(
        {"at": entry.at, "actor": entry.actor, "action": entry.action, "details": dict(entry.details),
         "receipt_id": entry.receipt_id}
    )  # fmt: skip


def decode_audit(entry_id: str, data: bytes) -> AuditEntry:
    raw = orjson.loads(data)
    return AuditEntry(id=entry_id, **raw)


def encode_end_analytics(found: EndAnalytics | None) -> bytes:
    """What a conversation record keeps of :class:`EndAnalytics`, for its replays: ``{"hour", "first": null |
    {"conversation_id", "hour", "qa", "handoff_reason", "handoff_to"}, "new": "hour,day,week"}`` (the buckets
    new to the caller), or ``{}`` without analytics. The Redis script ``patch.lua`` writes the same JSON."""
    if found is None:
        return NO_ANALYTICS
    return orjson.dumps({"hour": found.hour, "first": found.first, "new": ",".join(found.new_buckets)})


def decode_end_analytics(data: bytes) -> EndAnalytics | None:
    raw = orjson.loads(data or NO_ANALYTICS)
    if "hour" not in raw:  # analytics were off when the conversation was first applied
        return None
    first = raw.get("first")
    new = set(str(raw.get("new") or "").split(","))
    return EndAnalytics(
        # int(): whichever form of JSON number the Redis script wrote.
        hour=int(raw["hour"]),
        first=(
            FirstInteraction(
                conversation_id=first["conversation_id"],
                hour=int(first["hour"]),
                qa=first["qa"],
                handoff_reason=first["handoff_reason"],
                handoff_to=first["handoff_to"],
            )
            if first
            else None
        ),
        new_buckets=tuple(kind for kind in BUCKET_KINDS if kind in new),
    )


def memory_fields(data: Any, now_ms: int) -> dict[str, StoredField]:
    """A Redis memory hash's fields whose stored expiry is after ``now_ms`` (expired ones are skipped before
    anything is built for them: this runs for every field of every read). RESP3 gives a dict, RESP2 a flat
    list."""
    fields: dict[str, StoredField] = {}
    try:
        pairs = data.items() if isinstance(data, dict) else zip(data[::2], data[1::2], strict=True)
        for name, packed in pairs:
            expires, written, value = packed.split(b"|", 2)
            # (fields.packed_times inline: this runs for every field of every read)
            base = 36 if expires[:1] == PACKED_MARK else 10
            expires_at = int(expires[1:] if base == 36 else expires, base)
            if expires_at > now_ms:
                fields[name.decode()] = StoredField(value, expires_at, int(written, base), packed)
    except ValueError as exc:
        raise StoreCorrupt("a stored memory field cannot be read") from exc
    return fields


#: Before every time a field can hold: :func:`memory_fields` with it keeps every field.
_EVER = -(1 << 63)


def every_memory_field(data: Any) -> dict[str, StoredField]:
    """A memory hash's fields, expired ones too: what the read cache keeps of a cached hash (a read then
    takes the live ones with :func:`unexpired`, at every read)."""
    return memory_fields(data, _EVER)


def unexpired(fields: dict[str, StoredField], now_ms: int) -> dict[str, StoredField]:
    """The fields whose stored expiry is after ``now_ms`` (what :func:`memory_fields` keeps)."""
    return {name: f for name, f in fields.items() if f.expires_at > now_ms}
