"""Redis backend, conversation analytics: the record of an ended conversation (``record.lua``: its entry in the
project's listing and its counters, with the end's webhook deliveries), the listing's pages, the counters,
and the unlisting an erasure does.

:class:`RedisAnalytics` is a mixin of :class:`~caller_memory.service.storage.redis.store.RedisStore`; its
records' deliveries are queued by :class:`~caller_memory.service.storage.redis.webhook_enqueue.RedisWebhookEnqueue`
(on one server in the same turn of the event loop as the record: one more write on the same round trip).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...domain.clock import bucket_starts
from ...domain.store import (
    CallerRef,
    ConversationEntry,
    Counters,
    ListingPage,
    Recording,
    RecordStatus,
)
from ...domain.store.webhooks import Delivery, check_one_project
from ..codec import decode_entry, encode_entry
from . import keys
from .retention import split_listed
from .transport import Call, Command, hash_reply
from .webhook_enqueue import RedisWebhookEnqueue, all_fresh

#: The fields of a counter hash that are not counters.
_COUNTER_META = (b"_expires_at", b"_recorded_at")


#: record.lua's replies.
_RECORDED = {0: RecordStatus.DUPLICATE, 1: RecordStatus.RECORDED, 2: RecordStatus.ERASED}


class RedisAnalytics(RedisWebhookEnqueue):
    """The analytics methods of the Store interface on Redis (standalone or Redis Cluster)."""

    async def record_conversation(
        self, recording: Recording, now_ms: int, deliveries: Sequence[Delivery] = ()
    ) -> RecordStatus:
        caller, entry = recording.caller, recording.entry
        project = caller.project
        script_keys = [
            keys.analytics_entry_key(project, entry.conversation_id),
            keys.analytics_index_key(project, None),
            keys.analytics_index_key(project, entry.first is not None),
        ]
        if not self._cluster:
            # One server: the script reads the caller's tombstone itself, atomically with the listing.
            script_keys.append(keys.tombstone_key(project, caller.subject))
        args: list[str | bytes | int] = [
            b"%d|%d|" % (recording.expires_at, now_ms) + encode_entry(entry),
            entry.sort_key,
            recording.expires_at,
            now_ms,
            "" if self._cluster else recording.made_at,
            now_ms,
        ]
        for counters in recording.increments:
            script_keys.append(keys.analytics_counter_key(project, counters.kind, counters.bucket))
            pairs = [(name, amount) for name, amount in counters.values.items() if amount]
            args.append(len(pairs))
            for name, amount in pairs:
                args += [name, amount]
        check_one_project(deliveries, caller)
        live = [d for d in deliveries if d.expires_at > now_ms]
        if live and not self._cluster:
            # One server: the events go with those of the other ends of this turn of the event loop, in the
            # write after the record's (each script reads the tombstone itself).
            joined = (
                self._join_ends(project, live, caller, recording.made_at, now_ms)
                if all_fresh(live, caller.subject)
                else None
            )
            async with Call("record_conversation", self._timeout):
                try:
                    recorded = await self._transport.script("record", script_keys, args)
                except BaseException:
                    if joined is not None:
                        joined.cancel()  # (its call goes on, for the other ends)
                    raise
                if joined is not None:
                    await joined
                else:  # (not an end's deliveries: after the record)
                    await self._enqueue_at_once(project, live, caller, recording.made_at, now_ms)
            return _RECORDED[int(recorded)]
        async with Call("record_conversation", self._timeout):
            status = _RECORDED[int(await self._transport.script("record", script_keys, args))]
        if not self._cluster:
            return status
        # The tombstone is in the caller's slot: read after the listing, so that an erasure either ran
        # before this read (seen here: the listing is taken back) or will unlist it itself (erase_caller
        # unlists after its tombstone is written). An erasure cannot fall in between unseen.
        erased = await self._erased_at(caller, now_ms)
        if erased is not None and erased >= recording.made_at:
            await self.unlist_conversations(project, [entry.conversation_id])
            return RecordStatus.ERASED
        if live:
            await self.enqueue_deliveries(live, caller, recording.made_at, now_ms)
        return status

    async def list_conversations(
        self, project: str, page: ListingPage, now_ms: int
    ) -> list[ConversationEntry]:
        start, stop, repeat, after = page.start, page.stop, page.repeat, page.after
        limit, descending, recorded_after = page.limit, page.descending, page.recorded_after
        index = keys.analytics_index_key(project, repeat)
        low, high = "[" + start, "(" + stop
        if after is not None and descending and after < stop:
            high = "(" + after
        if after is not None and not descending and after >= start:
            low = "(" + after
        entries: list[ConversationEntry] = []
        async with Call("list_conversations", self._timeout):
            while len(entries) < limit:
                want = limit - len(entries)
                if descending:
                    command: Command = ("ZRANGE", index, high, low, "BYLEX", "REV", "LIMIT", 0, want)
                else:
                    command = ("ZRANGE", index, low, high, "BYLEX", "LIMIT", 0, want)
                (members,) = await self._transport.run(command)
                if not members:
                    break
                ids = [m.decode().split(":", 1)[1] for m in members]
                # The entries share the index's slot (the project's hash tag): one MGET.
                (values,) = await self._transport.run(
                    ("MGET", *(keys.analytics_entry_key(project, i) for i in ids))
                )
                for member, value in zip(members, values, strict=True):
                    if value is None:
                        continue  # expired, not swept from the index yet
                    expires, recorded, data = split_listed(member, value)
                    if expires > now_ms and (recorded_after is None or recorded > recorded_after):
                        entries.append(decode_entry(data))
                last = members[-1].decode()
                if descending:
                    high = "(" + last
                else:
                    low = "(" + last
                if len(members) < want:
                    break
        return entries[:limit]

    async def counters(
        self,
        project: str,
        kind: str,
        first: int,
        last: int,
        now_ms: int,
        *,
        recorded_after: int | None = None,
    ) -> list[Counters]:
        starts = bucket_starts(kind, first, last)
        async with Call("counters", self._timeout):
            # One slot (the project's hash tag): one call.
            replies = await self._transport.run(
                *(("HGETALL", keys.analytics_counter_key(project, kind, s)) for s in starts)
            )
        out = []
        for start, reply in zip(starts, replies, strict=True):
            data = hash_reply(reply)
            if not data or int(data.get(b"_expires_at", b"0")) <= now_ms:
                continue
            # Its latest conversation past the current retention (a bucket of an earlier release, without
            # that time, is judged by its expiry alone).
            if (
                recorded_after is not None
                and int(data.get(b"_recorded_at", recorded_after + 1)) <= recorded_after
            ):
                continue
            values = {k.decode(): int(v) for k, v in data.items() if k not in _COUNTER_META}
            out.append(Counters(kind, start, values))
        return out

    async def unlist_conversations(self, project: str, conversation_ids: Sequence[str]) -> int:
        """Remove these conversations from the analytics listing (counters stay); how many were listed."""
        if not conversation_ids:
            return 0
        script_keys = [
            keys.analytics_index_key(project, None),
            keys.analytics_index_key(project, True),
            keys.analytics_index_key(project, False),
            *(keys.analytics_entry_key(project, i) for i in conversation_ids),
        ]
        async with Call("unlist_conversations", self._timeout):
            removed = await self._transport.script("unlist", script_keys, [])
        return int(removed)

    async def _erased_at(self, caller: CallerRef, now_ms: int) -> int | None:
        """When the caller was last erased, if their tombstone is still live."""
        async with Call("erased_at", self._timeout):
            ((erased, expires),) = await self._transport.run(
                ("HMGET", keys.tombstone_key(caller.project, caller.subject), "erased_at", "expires_at")
            )
        if erased is None or expires is None or int(expires) <= now_ms:
            return None
        return int(erased)
