"""Redis backend (Redis 7.0+, standalone or Redis Cluster). Key layout in :mod:`caller_memory.service.storage.redis.keys`; scripts in ``lua/``.

Every memory operation is one round trip: reads are one ``HGETALL`` (expired fields are filtered here) sent
with a ``GET`` of the caller's alias record (a second round trip reads the profile of an alias:
:mod:`caller_memory.service.storage.redis.links`), writes and erasures are one Lua script (atomic on the server). Scripts are sent with EVALSHA and sent again with EVAL
on NOSCRIPT, so a restarted or failed-over server needs no special handling.

:class:`RedisStore` holds the operations only; it sends their commands through a
:class:`~caller_memory.service.storage.redis.transport.RedisTransport`: :class:`~caller_memory.service.storage.redis.transport.StandaloneTransport` on one server,
:class:`~caller_memory.service.storage.redis.cluster.ClusterTransport` on a Redis Cluster (``redis+cluster://``). Both send the commands
themselves, packed by hiredis, on connections they keep (the hot path's are in a plain free list).

On Redis Cluster every call touches one slot (the key layout's hash tags make that possible) and every write
waits for a replica before it is acknowledged. An operation that spans slots (a conversation's claim, the
caller's memory, the project's analytics) is several calls, one after the other where the order matters: on
one server they go in one transaction instead (:meth:`~caller_memory.service.storage.redis.transport.RedisTransport.in_order`). The few
operations whose algorithm differs on a cluster branch on ``RedisStore._cluster``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, cast

from ...domain.errors import StoreCorrupt
from ...domain.fields import StoredField, WriteCondition
from ...domain.store import (
    CallerRef,
    EndResult,
    EndStatus,
    EndWrite,
    ErasureResult,
    PatchResult,
    Store,
    TokenRecord,
)
from ...domain.store.links import ProfileMoved
from ..codec import (
    NO_ANALYTICS,
    decode_end_analytics,
    every_memory_field,
    memory_fields,
    unexpired,
)
from . import keys
from .analytics import RedisAnalytics
from .archive import RedisArchiveIndex
from .call_trust import CALL_TRUST_SCRIPTS, RedisCallTrust
from .cluster import ClusterTransport, is_cluster_url
from .late_transcripts import LATE_TRANSCRIPT_SCRIPTS, RedisLateTranscripts
from .links import LINK_SCRIPTS, RedisLinks, alias_profile
from .llm import RedisLlm
from .pending_answers import RedisPendingAnswers
from .platform_events import PLATFORM_EVENT_SCRIPTS, RedisPlatformEvents
from .platforms import RedisPlatforms
from .remembered import RedisRemembered
from .retention import RedisRetention
from .transcripts import TRANSCRIPT_SCRIPTS, RedisTranscripts
from .transport import (
    Call,
    ConnectionLimits,
    RedisTransport,
    StandaloneTransport,
    hash_reply,
    load_script,
)
from .webhooks import RedisWebhooks

#: The owner named by a conversation id's claim once its caller was erased (a pseudonym is 32 hex digits).
ERASED_CLAIM = b"!"


def _optional(value: str | None) -> str:
    """An optional string as the scripts take it: "" for none, else "=" and the value."""
    return "" if value is None else "=" + value


def _unpack_field(data: bytes) -> StoredField:
    try:
        return StoredField.unpack(data)
    except ValueError as exc:
        raise StoreCorrupt("a stored memory field cannot be read") from exc


def _fields_from_flat(flat: Sequence[bytes]) -> dict[str, StoredField]:
    """Fields from a script's flat ``name, packed, ...`` reply."""
    return {flat[i].decode(): _unpack_field(flat[i + 1]) for i in range(0, len(flat), 2)}


def _token_from_hash(token_id: str, data: Mapping[bytes, bytes]) -> TokenRecord:
    try:
        return TokenRecord(
            token_id=token_id,
            project=data[b"project"].decode(),
            role=data[b"role"].decode(),
            secret_hash=data[b"secret_hash"],
            created_at=int(data[b"created_at"]),
            label=data.get(b"label", b"").decode(),
            agent=data.get(b"agent", b"").decode(),  # tokens of earlier releases have none
        )
    except (KeyError, ValueError) as exc:
        raise StoreCorrupt(f"token {token_id} is stored in a form this version cannot read") from exc


class RedisStore(
    RedisRetention,
    RedisTranscripts,
    RedisAnalytics,
    RedisWebhooks,
    RedisArchiveIndex,
    RedisLinks,
    RedisLlm,
    RedisPlatforms,
    RedisPlatformEvents,
    RedisCallTrust,
    RedisLateTranscripts,
    RedisPendingAnswers,
    RedisRemembered,
    Store,
):
    """:class:`Store` on a standalone Redis server (``redis://``, ``rediss://`` or ``unix://`` URL) or on a
    Redis Cluster (``redis+cluster://``, ``rediss+cluster://``; see :func:`~caller_memory.service.storage.redis.cluster.parse_cluster_url`).
    Retention (sweeps, leases, sweep reports, the audit log): :class:`~caller_memory.service.storage.redis.retention.RedisRetention`;
    conversation memory: :class:`~caller_memory.service.storage.redis.transcripts.RedisTranscripts`; analytics (the records
    of ended conversations, their listing and counters): :class:`~caller_memory.service.storage.redis.analytics.RedisAnalytics`;
    webhooks: :class:`~caller_memory.service.storage.redis.webhooks.RedisWebhooks`; linked identifiers:
    :class:`~caller_memory.service.storage.redis.links.RedisLinks`.
    """

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float = 0.5,
        socket_connect_timeout: float = 0.5,
        max_connections: int = 512,
        health_check_interval: int = 30,
        bulk_timeout: float = 60.0,
        cache_seconds: float = 0.0,
        cache_entries: int = 10_000,
        decimal_times: bool = False,
    ) -> None:
        """``decimal_times`` writes memory fields in the decimal form of releases before the base-36 one
        (:meth:`StoredField.packed_decimal`), so that they can read what this one writes while both run
        during a rolling upgrade (``CALLER_MEMORY_REDIS_DECIMAL_TIMES``, docs/operations.md)."""
        transport = ClusterTransport if is_cluster_url(url) else StandaloneTransport
        limits = ConnectionLimits(
            socket_timeout,
            socket_connect_timeout,
            max_connections,
            health_check_interval,
            cache_seconds,
            cache_entries,
        )
        self._transport: RedisTransport = transport(url, limits)  # a bad URL fails here, early
        #: On Redis Cluster, commands of different slots must be separate calls (and are not ordered
        #: unless sent one after the other).
        self._cluster = self._transport.cluster
        self._ends_together = {}
        self._sending = set()
        self._timeout = socket_timeout
        self._bulk_timeout = bulk_timeout
        self._sweep_from = 0  # the bucket where the next sweep round starts
        self._pack = StoredField.packed_decimal if decimal_times else StoredField.packed

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """The store for ``url``; ``options`` are the keyword arguments of the constructor."""
        return cls(url, **options)

    async def open(self) -> None:
        await self._transport.open()
        # The transport registers the scripts it knows (redis_transport.SCRIPTS); conversation memory's and
        # the links' are registered the same way, with the client the transport registered its own with.
        client = self._transport.scripts["patch"].registered_client
        for name in (
            *TRANSCRIPT_SCRIPTS,
            *LINK_SCRIPTS,
            *PLATFORM_EVENT_SCRIPTS,
            *CALL_TRUST_SCRIPTS,
            *LATE_TRANSCRIPT_SCRIPTS,
        ):
            self._transport.scripts[name] = client.register_script(load_script(f"{name}.lua"))

    async def close(self) -> None:
        # The ends' enqueues are sent and answered first (their ends wait for them), those of this turn too.
        try:
            for project, together in list(self._ends_together.items()):
                self._send_together(project, together)
            if self._sending:
                await asyncio.wait(set(self._sending))
        finally:
            await self._transport.aclose()

    async def ping(self) -> None:
        async with Call("ping", self._timeout):
            await self._transport.ping()

    def read_cache_counts(self) -> tuple[int, int] | None:
        return self._transport.cache_counts()

    # Projects -----------------------------------------------------------------------------------------

    async def put_project(self, project: str, document: bytes, now_ms: int) -> bool:
        async with Call("put_project", self._timeout):
            # SET ... GET replaces and tells whether something was there, in one atomic command.
            previous, _ = await self._transport.in_order(
                ("SET", keys.project_key(project), document, "GET"), ("SADD", keys.PROJECTS, project)
            )
        return previous is None

    async def get_project(self, project: str) -> bytes | None:
        async with Call("get_project", self._timeout):
            (document,) = await self._transport.run(("GET", keys.project_key(project)))
        return cast("bytes | None", document)

    # Tokens -------------------------------------------------------------------------------------------

    async def put_token(self, token: TokenRecord) -> None:
        # A token's hash and its project's index live in different cluster slots, so no MULTI or script
        # spans them. The order makes every intermediate state safe: the index entry comes first (a dangling
        # entry is skipped by list_tokens) and the hash, which makes the token usable, last.
        async with Call("put_token", self._timeout):
            await self._transport.in_order(
                ("ZADD", keys.project_tokens_key(token.project), token.created_at, token.token_id),
                (
                    "HSET",
                    keys.token_key(token.token_id),
                    *("project", token.project, "role", token.role, "secret_hash", token.secret_hash),
                    *("created_at", token.created_at, "label", token.label, "agent", token.agent),
                ),
            )

    async def get_token(self, token_id: str) -> TokenRecord | None:
        async with Call("get_token", self._timeout):
            (data,) = await self._transport.run(("HGETALL", keys.token_key(token_id)))
        return _token_from_hash(token_id, hash_reply(data)) if data else None

    async def list_tokens(self, project: str) -> list[TokenRecord]:
        async with Call("list_tokens", self._timeout):
            (ids,) = await self._transport.run(("ZRANGE", keys.project_tokens_key(project), 0, -1))
            # Each token's hash is in a slot of its own.
            hashes = await self._transport.each([("HGETALL", keys.token_key(i.decode())) for i in ids])
        tokens = (_token_from_hash(i.decode(), hash_reply(h)) for i, h in zip(ids, hashes, strict=True) if h)
        return [t for t in tokens if t.project == project]

    async def delete_token(self, project: str, token_id: str) -> bool:
        # Revocation first (the hash is what authenticates), then the index entry; see put_token.
        token_key = keys.token_key(token_id)
        async with Call("delete_token", self._timeout):
            (owner,) = await self._transport.run(("HGET", token_key, "project"))
            if owner is None or owner.decode() != project:
                return False
            deleted, _ = await self._transport.in_order(
                ("DEL", token_key), ("ZREM", keys.project_tokens_key(project), token_id)
            )
        return int(deleted) > 0

    # Caller memory ------------------------------------------------------------------------------------

    async def read_fields(self, caller: CallerRef, now_ms: int) -> dict[str, StoredField]:
        project, subject = caller.project, caller.subject
        # The alias record is in the caller's slot: asked in the same write, one round trip for a caller that
        # is no alias; an alias's profile is read in a second one (one hop: a profile is no alias). Either may
        # come from the read cache (CALLER_MEMORY_READ_CACHE_SECONDS), with no round trip at all.
        # The hash that is returned, if it came from the cache, is decoded once per cached reply (derived);
        # then its expired fields are dropped, at every read.
        memory, alias = keys.memory_key(project, subject), keys.alias_key(project, subject)
        found = self._transport.cached(memory, alias)
        hit = found is not None
        if found is None:
            async with Call("read_fields", self._timeout):
                found = await self._transport.read(("HGETALL", memory), ("GET", alias))
        data, record = found
        if record is not None and (profile := alias_profile(record, now_ms)) is not None:
            memory = keys.memory_key(project, profile)
            found = self._transport.cached(memory)
            hit = found is not None
            if found is None:
                async with Call("read_fields", self._timeout):
                    found = await self._transport.read(("HGETALL", memory))
            (data,) = found
        if hit:
            return unexpired(self._transport.derived(memory, data, every_memory_field), now_ms)
        return memory_fields(data, now_ms)

    async def patch_fields(
        self,
        caller: CallerRef,
        sets: Mapping[str, StoredField],
        deletes: Sequence[str],
        now_ms: int,
        condition: WriteCondition | None = None,
    ) -> PatchResult:
        project, subject = caller.project, caller.subject
        args: list[str | bytes | int] = [now_ms, keys.index_member(project, subject), "", ""]
        if condition is None:
            args += ["", 0, 0]
        else:
            args += ["*" if condition.any_existing else "=", len(condition.etags), *condition.etags]
            args.append(len(condition.ttl_ms))
            for name, ttl in condition.ttl_ms.items():
                args += [name, ttl]
        args.append(len(sets))
        for name, stored in sets.items():
            args += [name, self._pack(stored)]
        args += deletes
        async with Call("patch_fields", self._timeout):
            reply: list[Any] = await self._transport.script(
                "patch",
                [
                    keys.memory_key(project, subject),
                    keys.caller_index_key(subject),
                    keys.alias_key(project, subject),
                ],
                args,
            )
        if reply[0] == 5:
            raise ProfileMoved(reply[1].decode())
        return PatchResult(applied=reply[0] == 1, fields=_fields_from_flat(reply[1:]))

    async def end_conversation(self, end: EndWrite, now_ms: int) -> EndResult:
        project, subject, conversation_id = end.caller.project, end.caller.subject, end.conversation_id
        claim = keys.conversation_claim_key(project, conversation_id)
        claimed = f"{subject}|{end.expires_at}"
        script_keys = [
            keys.memory_key(project, subject),
            keys.caller_index_key(subject),
            keys.alias_key(project, subject),
            keys.conversation_record_key(project, subject, conversation_id),
            keys.tombstone_key(project, subject),
            keys.caller_conversations_key(project, subject),
            keys.first_interaction_key(project, subject),
        ]
        if not self._cluster:
            # One server: the script claims the id itself (one round trip instead of two).
            script_keys.append(claim)
        args: list[str | bytes | int] = [
            now_ms,
            keys.index_member(project, subject),
            "R",
            subject,
            end.fingerprint,
            NO_ANALYTICS,  # the script writes what it finds instead, with analytics
            end.expires_at,
            conversation_id,
            end.made_at,
            "" if self._cluster else claimed,
            "" if end.written_at is None else end.written_at,
        ]
        analytics = end.analytics
        if analytics is None:
            args.append("")
        else:
            args += [
                "A",
                analytics.hour,
                analytics.day,
                analytics.week,
                _optional(analytics.outcome.qa),
                _optional(analytics.outcome.handoff_reason),
                _optional(analytics.outcome.handoff_to),
                analytics.first_expires_at,
                analytics.first_after,
            ]
        args += ["", 0, 0, len(end.sets)]
        for name, stored in end.sets.items():
            args += [name, self._pack(stored)]
        args += end.deletes
        async with Call("end_conversation", self._timeout):
            if self._cluster:
                # First claim the id for this caller (in the id's own slot), then apply in the caller's slot.
                (previous,) = await self._transport.run(
                    ("SET", claim, claimed, "NX", "PXAT", end.expires_at, "GET")
                )
                # Already claimed for this caller (an earlier attempt): nothing to do; the SET was followed
                # by a WAIT covering that attempt's writes in the slot (ClusterLink.run).
                owner, _, until = (previous or b"").decode().partition("|")
                if previous is not None and owner != subject:
                    if int(until or 0) > now_ms:
                        # Not this caller's: nothing is written. An alias is told so first, as the script does
                        # on one server: the domain's retry on the profile then finds the replay (an end the
                        # domain applied to the profile) or the conflict.
                        (record,) = await self._transport.run(("GET", keys.alias_key(project, subject)))
                        profile = alias_profile(record, now_ms)
                        if profile is not None:
                            raise ProfileMoved(profile)
                        # An erasure removed what this id wrote (erase_caller): it wins over any end of it.
                        erased = owner == ERASED_CLAIM.decode()
                        return EndResult(EndStatus.ERASED if erased else EndStatus.CONFLICT)
                    # Expired by the service's clock (Redis's may lag behind it): the id is free again.
                    await self._transport.run(("SET", claim, claimed, "PXAT", end.expires_at))
            # A replay is acknowledged only once the first attempt's write is on a replica: the script call
            # is followed by a marker and a WAIT in its slot (ClusterLink.run).
            reply: list[Any] = await self._transport.script("patch", script_keys, args)
            if self._cluster and (reply[0] == 4 or (reply[0] == 5 and reply[2] == 0)):
                # Refused for an erased caller, or for an alias: take back the claim naming them (the script
                # on one server claims after these checks). A claim holds "<subject>|<expires_at>", the lease
                # script's format: its release deletes the key only if it still names this subject. An alias
                # with a live record of the id (an end applied before it became one) keeps that record's.
                await self._transport.script("lease", [claim], [subject, 0, 0])
        if reply[0] == 5:
            raise ProfileMoved(reply[1].decode())
        if reply[0] == 2:  # {2, fingerprint, analytics found when first applied, expires_at}
            return EndResult(EndStatus.REPLAYED, decode_end_analytics(reply[2]))
        if reply[0] == 3:
            return EndResult(EndStatus.CONFLICT)
        if reply[0] == 4:
            return EndResult(EndStatus.ERASED)
        return EndResult(EndStatus.APPLIED, decode_end_analytics(reply[1]))

    async def erase_caller(self, caller: CallerRef, now_ms: int, tombstone_until: int) -> ErasureResult:
        project, subject = caller.project, caller.subject
        async with Call("erase_caller", self._timeout):
            reply: list[Any] = await self._transport.script(
                "erase",
                [
                    keys.memory_key(project, subject),
                    keys.caller_index_key(subject),
                    keys.first_interaction_key(project, subject),
                    keys.caller_conversations_key(project, subject),
                    keys.tombstone_key(project, subject),
                    keys.caller_transcripts_key(project, subject),
                    keys.alias_key(project, subject),
                    keys.links_key(project, subject),
                ],
                [
                    keys.index_member(project, subject),
                    keys.conversation_record_prefix(project, subject),
                    now_ms,
                    tombstone_until,
                    subject,
                ],
            )
            aliases = [a.decode() for a in reply[5 : 5 + int(reply[4])]]
            at = 5 + len(aliases)
            listed_transcripts = 2 * int(reply[at])
            transcripts = reply[at + 1 : at + 1 + listed_transcripts]
            pairs = reply[at + 1 + listed_transcripts :]
            # Each conversation of the caller is in a slot of its own: each becomes a marker there.
            removed = await self.erase_transcripts(
                caller,
                [
                    (t.decode(), int(float(h)))
                    for t, h in zip(transcripts[::2], transcripts[1::2], strict=True)
                ],
                now_ms,
            )
            ids = [i.decode() for i in pairs[::2]]
            listed = 0
            if ids:
                # The rest lives in other slots (each claim in its own, the listing in the project's): it
                # follows the atomic step above, which already cut every link from the caller to them and
                # left a marker in place of each live record. A live claim becomes an erasure marker too,
                # naming nobody, so that an end of the id is refused as erased whoever sends it.
                await self._transport.each(
                    [
                        (
                            ("SET", claim, ERASED_CLAIM + b"|" + until, "PXAT", int(until))
                            if int(until) > 0
                            else ("DEL", claim)
                        )
                        for claim, until in zip(
                            (keys.conversation_claim_key(project, i) for i in ids), pairs[1::2], strict=True
                        )
                    ]
                )
                listed = await self.unlist_conversations(project, ids)
        return ErasureResult(
            fields=int(reply[0]),
            first_interaction=int(reply[1]) > 0,
            conversations=len(ids),
            listed=listed,
            transcripts=removed,
            links=int(reply[2]),
            alias_of=reply[3].decode(),
            aliases=tuple(aliases),
        )
