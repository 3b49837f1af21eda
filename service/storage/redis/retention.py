"""Redis backend, retention: the expiry sweep, its lease and its reports, and the audit log of erasures.

:class:`RedisRetention` is a mixin of :class:`~caller_memory.service.storage.redis.store.RedisStore`: it sends its commands through the store's
transport (:class:`~caller_memory.service.storage.redis.transport.RedisTransport`), as every other operation does. A sweep walks the
per-bucket expiry indexes (``sweep_bucket.lua``, one slot per bucket) and each project's analytics listing;
sweeps and their reports do not wait for replicas, a lease does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from ...domain.store import AuditEntry
from ..codec import decode_audit, encode_audit
from . import keys
from .transport import Call, RedisTransport, hash_reply


def split_listed(member: bytes, value: bytes) -> tuple[int, int, bytes]:
    """``(expires_at, recorded_at, json)`` of a listed entry's value, "<expires_at>|<recorded_at>|<json>";
    one of an earlier release, "<expires_at>|<json>", counts as recorded at its hour (its index member's
    first 13 digits)."""
    expires, _, rest = value.partition(b"|")
    if rest[:1] == b"{":
        return int(expires), int(member[:13]), rest
    recorded, _, data = rest.partition(b"|")
    return int(expires), int(recorded), data


class RedisRetention:
    """The retention methods of the Store interface on Redis (standalone or Redis Cluster)."""

    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float
    _bulk_timeout: float
    _sweep_from: int  # the bucket where the next sweep round starts

    async def list_projects(self) -> list[str]:
        async with Call("list_projects", self._timeout):
            (projects,) = await self._transport.run(("SMEMBERS", keys.PROJECTS))
        return sorted(p.decode() for p in projects)

    async def sweep(
        self, now_ms: int, batch: int, listed_after: Mapping[str, int] | None = None
    ) -> tuple[dict[str, int], bool]:
        # Buckets are visited in chunks, from where the previous round stopped, until about ``batch``
        # callers were visited: a round's work follows what expired (plus a constant walk of the buckets).
        # Each bucket's script touches one slot (the bucket's hash tag); on a cluster, the buckets of a chunk
        # go to their primaries, one write per primary, so a sweep covers every primary.
        counts = {"fields": 0, "callers": 0, "analytics_entries": 0}
        more = False
        visited = 0
        chunk = 256
        async with Call("sweep", self._bulk_timeout):
            for offset in range(0, keys.N_BUCKETS, chunk):
                first = (self._sweep_from + offset) % keys.N_BUCKETS
                buckets = [bucket % keys.N_BUCKETS for bucket in range(first, first + chunk)]
                for fields, callers, bucket_more, due in await self._sweep_buckets(buckets, now_ms, batch):
                    counts["fields"] += int(fields)
                    counts["callers"] += int(callers)
                    visited += int(due)
                    more = more or bool(bucket_more)
                if visited >= batch and offset + chunk < keys.N_BUCKETS:
                    self._sweep_from = (first + chunk) % keys.N_BUCKETS
                    more = True
                    break
            (projects,) = await self._transport.run(("SMEMBERS", keys.PROJECTS))
            for project in sorted({p.decode() for p in projects} | set(listed_after or ())):
                cutoff = (listed_after or {}).get(project)
                removed, project_more = await self._sweep_listing(project, now_ms, batch, cutoff)
                counts["analytics_entries"] += removed
                more = more or project_more
        return counts, more

    async def _sweep_buckets(self, buckets: Sequence[int], now_ms: int, batch: int) -> list[list[int]]:
        """Run the sweep script in each bucket: ``[fields, callers, more, due]`` per bucket.

        Sweeps do not wait for replicas: what they remove had expired (reads skip it anyway), and a removal
        lost in a failover is made again by the next sweep."""
        return await self._transport.run_scripts(
            "sweep_bucket",
            [([keys.expiry_index_key(b)], [now_ms, batch, keys.memory_key_prefix(b)]) for b in buckets],
        )

    async def _sweep_listing(
        self, project: str, now_ms: int, batch: int, cutoff: int | None = None
    ) -> tuple[int, bool]:
        """Drop index members whose entry has expired (or was recorded at or before ``cutoff``, the current
        retention's), oldest first, stopping at the first live one (entries expire in about the order they
        were recorded). Every key is in the project's slot."""
        index = keys.analytics_index_key(project, None)
        (members,) = await self._transport.run(("ZRANGE", index, "-", "+", "BYLEX", "LIMIT", 0, batch))
        if not members:
            return 0, False
        ids = [m.decode().split(":", 1)[1] for m in members]
        (values,) = await self._transport.run(("MGET", *(keys.analytics_entry_key(project, i) for i in ids)))
        dead = []
        for member, value in zip(members, values, strict=True):
            if value is not None:
                expires, recorded, _ = split_listed(member, value)
                if expires > now_ms and (cutoff is None or recorded > cutoff):
                    break
            dead.append(member)
        if dead:
            await self._transport.run(
                ("MULTI",),
                *(
                    ("ZREM", keys.analytics_index_key(project, repeat), *dead)
                    for repeat in (None, True, False)
                ),
                ("DEL", *(keys.analytics_entry_key(project, m.decode().split(":", 1)[1]) for m in dead)),
                ("EXEC",),
                replicate=False,  # as the buckets' sweep
            )
        return len(dead), len(dead) == batch

    async def acquire_lease(self, name: str, holder: str, now_ms: int, ttl_ms: int) -> bool:
        # A lease lost in a failover would let two sweepers run at once: acquiring waits for a replica.
        async with Call("acquire_lease", self._timeout):
            acquired = await self._transport.script("lease", [keys.lease_key(name)], [holder, now_ms, ttl_ms])
        return bool(acquired)

    async def release_lease(self, name: str, holder: str) -> None:
        async with Call("release_lease", self._timeout):
            await self._transport.script("lease", [keys.lease_key(name)], [holder, 0, 0])

    async def record_sweep(self, record: bytes) -> None:
        async with Call("record_sweep", self._timeout):
            await self._transport.run(
                ("MULTI",),
                ("LPUSH", keys.SWEEPS, record),
                ("LTRIM", keys.SWEEPS, 0, 99),
                ("EXEC",),
                replicate=False,  # a report lost in a failover costs nothing: the data was swept
            )

    async def list_sweeps(self, limit: int) -> list[bytes]:
        async with Call("list_sweeps", self._timeout):
            (records,) = await self._transport.run(("LRANGE", keys.SWEEPS, 0, limit - 1))
        return cast("list[bytes]", records)

    async def append_audit(self, project: str, entry: AuditEntry) -> str:
        async with Call("append_audit", self._timeout):
            (entry_id,) = await self._transport.run(
                ("XADD", keys.audit_key(project), "*", "e", encode_audit(entry))
            )
        return cast("bytes", entry_id).decode()

    async def list_audit(self, project: str, limit: int, before: str | None) -> list[AuditEntry]:
        high = "+" if before is None else "(" + before
        async with Call("list_audit", self._timeout):
            (rows,) = await self._transport.run(
                ("XREVRANGE", keys.audit_key(project), high, "-", "COUNT", limit)
            )
        # Each row is [id, [field, value, ...]] (a map of the fields in some RESP3 clients: both are read).
        return [decode_audit(i.decode(), hash_reply(fields)[b"e"]) for i, fields in rows]
