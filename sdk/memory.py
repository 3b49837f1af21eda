"""The read-only view of a caller's memory that agent code sees as ``conv.memory``."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from datetime import datetime
from typing import Any


class Memory(Mapping[str, Any]):
    """A caller's memory as fetched at the start of the turn. Read-only: it cannot be assigned to.

    ``available`` is False when the memory could not be fetched (the service was slow, down, or refused);
    the mapping is then empty and ``reason`` says why. Agent code can treat the caller as new.

    ``stale`` is True when this turn's read failed and this is the last memory read before, served again
    (``reason`` says why the read failed): only until its ``valid_until``, the service's bound on the
    earliest expiry of its fields, so that a field that expired since is never served.
    Values are the JSON values stored; a structured value is shared with this snapshot, so treat it as
    read-only too (``fields()`` returns a deep copy).

    ``withheld`` names the state keys this call does not qualify for (caller-ID trust: the project sets the
    attestation or step-up check each class of field needs): they are never in the mapping, whether or not
    the caller has them, and the end of the call cannot write or delete them. ``attestation`` is the call's
    attestation as the service counted it (``A``, ``B``, ``C``, ``failed``, ``unknown``). A service from before
    caller-ID trust sends neither: ``()`` and None.
    """

    __slots__ = (
        "_fields",
        "attestation",
        "available",
        "blacklisted",
        "etag",
        "expires_at",
        "reason",
        "stale",
        "valid_until",
        "withheld",
    )

    _fields: dict[str, Any]
    available: bool
    reason: str | None
    etag: str | None
    expires_at: str | None
    blacklisted: bool
    valid_until: str | None
    stale: bool
    withheld: tuple[str, ...]
    attestation: str | None

    def __init__(
        self,
        fields: Mapping[str, Any],
        *,
        available: bool = True,
        reason: str | None = None,
        etag: str | None = None,
        expires_at: str | None = None,
        blacklisted: bool = False,
        valid_until: str | None = None,
        stale: bool = False,
        withheld: tuple[str, ...] = (),
        attestation: str | None = None,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "_fields", dict(fields))
        set_(self, "available", available)
        set_(self, "reason", reason)
        set_(self, "etag", etag)
        set_(self, "expires_at", expires_at)
        set_(self, "blacklisted", blacklisted)
        set_(self, "valid_until", valid_until)
        set_(self, "stale", stale)
        set_(self, "withheld", tuple(withheld))
        set_(self, "attestation", attestation)

    @classmethod
    def unavailable(cls, reason: str) -> Memory:
        return cls({}, available=False, reason=reason)

    def __getitem__(self, key: str) -> Any:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def fields(self) -> dict[str, Any]:
        """A copy of every stored field (changing it changes nothing stored)."""
        return copy.deepcopy(self._fields)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("conv.memory is read-only; put values to remember in conv.state")

    def __copy__(self) -> Memory:
        return self  # immutable

    def __deepcopy__(self, memo: dict[int, Any]) -> Memory:
        return self._rebuilt(copy.deepcopy(self._fields, memo))

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore, (self._fields, self._attributes()))

    def _attributes(self) -> dict[str, Any]:
        """The keyword arguments that make this memory again (with its fields)."""
        return {
            "available": self.available,
            "reason": self.reason,
            "etag": self.etag,
            "expires_at": self.expires_at,
            "blacklisted": self.blacklisted,
            "valid_until": self.valid_until,
            "stale": self.stale,
            "withheld": self.withheld,
            "attestation": self.attestation,
        }

    def _rebuilt(self, fields: dict[str, Any]) -> Memory:
        return _restore(fields, self._attributes())

    def usable_at(self, now: datetime) -> bool:
        """Whether this memory may be served again at ``now`` after a failed read: it was read, and its
        ``valid_until`` (no field of it expires before) is still ahead."""
        if not self.available or self.valid_until is None:
            return False
        try:
            until = datetime.fromisoformat(self.valid_until.replace("Z", "+00:00"))
        except ValueError:
            return False
        return until.tzinfo is not None and now < until

    def _as_stale(self, reason: str) -> Memory:
        """This memory served again after a failed read (same fields and ETag)."""
        return self._served(stale=True, reason=reason)

    def _as_fresh(self) -> Memory:
        """This memory confirmed by the service (a 304 on its ETag)."""
        return self._served(stale=False, reason=None) if self.stale else self

    def _served(self, *, stale: bool, reason: str | None) -> Memory:
        return _restore(
            self._fields, {**self._attributes(), "available": True, "stale": stale, "reason": reason}
        )

    def __repr__(self) -> str:
        if not self.available:
            return f"<Memory unavailable: {self.reason}>"
        withheld = f" withheld {sorted(self.withheld)}" if self.withheld else ""
        return f"<Memory {sorted(self._fields)}{withheld}{' stale' if self.stale else ''}>"


def _restore(fields: dict[str, Any], attributes: Mapping[str, Any]) -> Memory:
    """A memory made again from its fields and its other attributes (pickle's, and the copies')."""
    return Memory(fields, **attributes)
