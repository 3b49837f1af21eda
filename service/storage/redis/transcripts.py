"""Redis backend, conversation memory (SPEC section 10): transcripts, their lifecycle, checkpoints, summaries.

:class:`RedisTranscripts` is a mixin of :class:`~caller_memory.service.storage.redis.store.RedisStore`; it sends its commands through the store's
transport, as every other operation does. Key names are in :mod:`caller_memory.service.storage.redis.keys`, scripts in ``lua/transcript_*.lua``.

Layout. Every key of one conversation carries one hash tag (a stable hash of project and conversation id), so
each operation on it is one Lua script in one slot (reads too: ``transcript_read.lua``, one round trip):

- the header hash ``vh`` lives until ``forget_at``: ``status`` (a :class:`TranscriptStatus` value),
  ``subject``, ``channel``, ``agent``, ``started_at``, ``last_activity``, ``turn_id``, ``messages``,
  ``bytes``, ``tokens``, ``checkpoint_at``, ``ended_by``, ``end_reason``, ``ended_at``, ``lease_until``,
  ``end_data``, ``expires_at``, ``forget_at``, ``due_at`` (the due time for inactivity, or the lease's end
  while ending), ``horizon`` (the score of its entry among its caller's conversations), ``region`` (absent
  from headers of earlier releases: read as "") and, when its caller
  had been erased before it started, ``prior_erased_at`` and ``prior_erased_until`` (that tombstone's);
  a marker keeps ``status``, ``expires_at`` and ``forget_at`` only;
- the messages ``vm``, a list of ``<message id>\n<body>`` ("" for no id; a message id holds no newline), in
  order, so a message's position (``seq``) is its list index; their index ``vi``, a string of 12 bytes per
  message: its turn id (a big-endian double, exact for every turn id) and the first 4 bytes of the SHA-1 of
  its message id. Turn ids never decrease, so a binary search of the index finds what came after a turn; an
  id is looked up by scanning the index for its digest and confirmed by the id stored with the message. The
  checkpoint and the summary are the hash ``vd``. These three expire (``PEXPIREAT``) at ``expires_at``.

  Measured with ``MEMORY USAGE`` on Redis 7.0, 1000 messages of 100 characters with UUID message ids (bodies
  of 178 bytes): about 240 bytes each (list 223, index 16); a stream keyed ``<turn_id>-<seq + 1>`` with the
  message id as its field and a hash of message ids took about 380 (stream 283, hash 95), which is why this
  is a list (tests/storage/test_redis_transcripts.py holds the bound).

Reads filter by the service's clock (Redis may not have expired a key yet): a header whose ``forget_at`` passed
is not there, and one whose ``expires_at`` passed shows as expired, with no messages.

The caller's conversations (``vc``, in the caller's slot) are what an erasure finds. An append that creates a
conversation lists it there first (``transcript_register.lua``, which refuses when the caller was erased at or
after the append was made), then writes it: an erasure in between finds the id, leaves an ERASED marker in the
conversation's slot (``transcript_remove.lua``, which writes one even when there is no header yet), and the
creating append finds the marker. Each entry's score is its *horizon*, never earlier than the header's
``forget_at``: the append script asks to extend it (the service lists it again, with the same erasure check)
before a later ``forget_at`` would pass it, so the horizon doubles the remaining time and is extended about once
per remembering period. Entries whose horizon passed are forgotten: ``ZREMRANGEBYSCORE`` at each listing. The
same script lists a created conversation in the caller's indexes by start and by channel, which a start and
the admin listing read instead of every header (:mod:`caller_memory.service.storage.redis.caller_index`).

The inactivity due index is one sorted set for the whole store (``cm:vdue``; another slot on a cluster), member
``<project>:<conversation_id>``, score the due time. It is written only where the due time may move earlier
or must exist: before a creating append writes anything (so no crash can lose it), by an append whose due time
is earlier than the header's (``ZADD LT``, after the script), by a claim (the lease's end), by
:meth:`RedisTranscripts.reschedule`; it is never later than the header's due time except after a crash
between a script and its index write, which only delays that end. Ordinary appends move the due time later
and do not touch it. :meth:`RedisTranscripts.due_conversations` reads the entries due by their score, checks
each against its header (``transcript_due.lua``, read only, all in one write per primary) and corrects what
is stale with a compare-and-set (``transcript_due_index.lua``: a write in between wins): an entry whose
header says later moves there, an entry whose conversation ended, was deleted or erased, or whose header is
gone, is removed; a stale entry is corrected the first time it is read and never returned, and a round costs
what it returns. An open
conversation whose transcript expired cannot be claimed (the port's ``MISSING``): the claim that finds so drops
its entry; unclaimed, it stays due for :data:`EXPIRED_DUE_GRACE_MS` and then only at its ``forget_at``, when
Redis has dropped its header.

A project's transcript bytes (``vb``, in the project's analytics slot) are counted by hour. On one server the
append script adds them itself; on a cluster the service adds them in a second call right after the append,
so the count may lag an append by that call (and lose it if the service dies in between). Deletions and
erasures take a transcript's bytes off the hour it started in: exact while that hour is counted, otherwise an
over-count, which is the safe side for a bound.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Awaitable, Sequence
from typing import Any, cast

from redis.exceptions import NoScriptError

from ...domain.clock import HOUR_MS
from ...domain.errors import StoreCorrupt
from ...domain.fields import StoredField
from ...domain.store import CallerRef
from ...domain.store.transcripts import (
    AppendResult,
    AppendStatus,
    AppendWrite,
    ClaimResult,
    ClaimStatus,
    ConversationKey,
    EndClaim,
    Header,
    StoredMessage,
    TranscriptQuery,
    TranscriptStatus,
)
from ..codec import memory_fields
from . import keys
from .caller_index import (
    RedisCallerIndex,
    _header,
    ended_ops,
    open_member,
    resumable_member,
)
from .caller_index import (
    _all as _all,  # webhooks.py imports it from here
)
from .transport import Call, Command, RedisTransport, hash_reply

#: One message's record in a conversation's index: its turn id (exact as a double up to 2**53) and the first 4
#: bytes of its message id's SHA-1.
_RECORD = struct.Struct(">dI")

#: The scripts of conversation memory, in ``lua/`` (registered by :meth:`~caller_memory.service.storage.redis.store.RedisStore.open`).
TRANSCRIPT_SCRIPTS = (
    "transcript_append",
    "transcript_read",
    "transcript_register",
    "transcript_claim",
    "transcript_update",
    "transcript_remove",
    "transcript_due",
    "transcript_due_index",
    "transcript_tally",
    "transcript_lane",
)

#: How long an open conversation whose transcript expired stays due (nothing can claim it any more).
EXPIRED_DUE_GRACE_MS = 60_000
#: Rounds of due_conversations that correct stale entries before answering with what they found.
_DUE_ROUNDS = 4
#: Conversations an erasure turns into markers at once.
_ERASE_CHUNK = 32


@functools.lru_cache(maxsize=8192)
def _keys_of(project: str, conversation_id: str) -> tuple[str, str, str, str]:
    """:func:`~caller_memory.service.storage.redis.keys.transcript_keys`, kept for the conversations in use: each costs four SHA-1s and four
    formats, on every request of a conversation."""
    header, messages, ids, data = keys.transcript_keys(project, conversation_id)
    return header, messages, ids, data


def _messages(first: int, records: bytes, elements: Sequence[bytes]) -> list[StoredMessage]:
    """Messages from position ``first``: their index records (turn id, digest) and list elements."""
    try:
        out = []
        seq = first
        for (turn, _), element in zip(_RECORD.iter_unpack(records), elements, strict=True):
            message_id, _, body = element.partition(b"\n")
            out.append(StoredMessage(seq, int(turn), body, message_id.decode() or None))
            seq += 1
        return out
    except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError; so is a count mismatch
        raise StoreCorrupt("a stored transcript message cannot be read") from exc


def _query_args(query: TranscriptQuery | None) -> list[str | bytes | int]:
    """What transcript_read.lua takes for ``query``: the header alone, or which messages."""
    if query is None or query.last == 0 or query.limit == 0:
        return [""]
    return [
        "M",
        *("" if value is None else value for value in (query.after_turn, query.last, query.limit)),
    ]


def _scored(reply: Any) -> list[tuple[bytes, int]]:
    """``(member, score)`` pairs of a ``ZRANGE ... WITHSCORES`` (pairs in RESP3, a flat list in RESP2)."""
    if reply and isinstance(reply[0], list):
        return [(member, int(score)) for member, score in reply]
    return [(reply[i], int(float(reply[i + 1]))) for i in range(0, len(reply), 2)]


def _conversation(member: bytes) -> ConversationKey:
    project, _, conversation_id = member.decode().partition(":")
    return ConversationKey(project, conversation_id)


def _hour(at: int) -> int:
    return at - at % HOUR_MS


class RedisTranscripts(RedisCallerIndex):
    """The conversation-memory methods of the Store interface on Redis (standalone or Redis Cluster)."""

    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float
    _cluster: bool

    async def _script(
        self,
        name: str,
        script_keys: Sequence[str],
        args: Sequence[str | bytes | int],
        *,
        replicate: bool | None = None,
    ) -> Any:
        """A script by its SHA (its text on NOSCRIPT); ``replicate=False`` for what need not wait for a
        replica on a cluster (reads, the approximate byte count)."""
        transport = self._transport
        try:
            command = transport.script_command(name, script_keys, args)
            return (await transport.run(command, replicate=replicate))[0]
        except NoScriptError:
            text = cast("str", transport.scripts[name].script)
            command = ("EVAL", text, len(script_keys), *script_keys, *args)
            return (await transport.run(command, replicate=replicate))[0]

    async def _tally(
        self, project: str, hour: int, amount: int, prune_before: int = 0, until: int = 0
    ) -> None:
        await self._script(
            "transcript_tally",
            [keys.transcript_volume_key(project)],
            [hour, amount, prune_before, until],
            replicate=False,  # approximate by design (see the module docstring)
        )

    # Appends ------------------------------------------------------------------------------------------------

    async def _append(self, write: AppendWrite, now_ms: int, horizon: str, prior: str | bytes) -> list[Any]:
        key = write.key
        script_keys = [*_keys_of(key.project, key.conversation_id)]
        tally = ""
        if not self._cluster:
            script_keys.append(keys.transcript_volume_key(key.project))
            retention = max(0, write.expires_at - now_ms)
            tally = f"{_hour(now_ms)}|{now_ms - retention - HOUR_MS}"
            if write.create and not horizon:
                # One server: the script lists the conversation among its caller's itself, in the same step
                # (a cluster runs transcript_register.lua first, in the caller's slot).
                subject = write.caller.subject
                horizon = "@" + keys.due_member(key.project, key.conversation_id)
                script_keys += [
                    keys.caller_transcripts_key(key.project, subject),
                    keys.tombstone_key(key.project, subject),
                    keys.TRANSCRIPTS_DUE,
                    *keys.caller_index_keys(key.project, subject)[1:],
                ]
        args: list[str | bytes | int] = [
            now_ms,
            ("1" if write.caller.project == key.project else "2") if write.create else "",
            horizon,
            prior,
            write.caller.subject,
            write.channel,
            write.agent,
            write.made_at,
            write.expires_at,
            write.forget_at,
            write.due_at,
            write.max_messages,
            write.max_bytes,
            b"" if write.checkpoint is None else b"=" + write.checkpoint,
            tally,
            len(write.messages),
            write.region,
            open_member(write.channel, key.conversation_id) if write.create else "",
        ]
        for message in write.messages:
            message_id = "" if message.message_id is None else "=" + message.message_id
            args += [message.turn_id, message_id, message.tokens, message.body]
        return cast("list[Any]", await self._script("transcript_append", script_keys, args))

    async def _register(
        self, write: AppendWrite, subject: str, horizon: int, creating: bool, now_ms: int
    ) -> bytes | None:
        """List the conversation among ``subject``'s (and, for a creation, in the due index) before it is
        written; None when the caller was erased at or after the append was made."""
        project, conversation_id = write.key.project, write.key.conversation_id
        listing, started, by_channel, across = keys.caller_index_keys(project, subject)
        calls: list[Awaitable[Any]] = [
            self._script(
                "transcript_register",
                [listing, keys.tombstone_key(project, subject), started, by_channel, across],
                [
                    now_ms,
                    write.made_at,
                    conversation_id,
                    horizon,
                    now_ms if creating else "",
                    open_member(write.channel, conversation_id) if creating else "",
                ],
            )
        ]
        if creating:
            member = keys.due_member(project, conversation_id)
            calls.append(self._transport.run(("ZADD", keys.TRANSCRIPTS_DUE, write.due_at, member)))
        listed, *_ = await _all(*calls)
        return cast("bytes", listed[1]) if int(listed[0]) else None

    async def append_messages(self, write: AppendWrite, now_ms: int) -> AppendResult:
        key = write.key
        async with Call("append_messages", self._timeout):
            reply = await self._append(write, now_ms, "", "")
            if reply[0] == b"register":
                horizon = write.forget_at + max(0, write.forget_at - now_ms)
                prior = await self._register(write, reply[1].decode(), horizon, not reply[5], now_ms)
                if prior is None:
                    return AppendResult(AppendStatus.ERASED, _header(key, reply[5], reply[6], now_ms))
                reply = await self._append(write, now_ms, str(horizon), prior)
            status = reply[0].decode()
            if status == "register":  # pragma: no cover - the horizon just written covers forget_at
                raise StoreCorrupt(f"conversation {key.conversation_id} cannot be listed for its caller")
            added_bytes, due = int(reply[3]), reply[4]
            follow: list[Awaitable[Any]] = []
            if due:  # moved earlier than its entry may say (a shorter end_after_inactivity)
                member = keys.due_member(key.project, key.conversation_id)
                follow.append(self._transport.run(("ZADD", keys.TRANSCRIPTS_DUE, "LT", due, member)))
            if self._cluster and added_bytes:
                prune = now_ms - max(0, write.expires_at - now_ms) - HOUR_MS
                follow.append(self._tally(key.project, _hour(now_ms), added_bytes, prune, write.expires_at))
            if follow:
                await _all(*follow)
        return AppendResult(
            AppendStatus(status),
            _header(key, reply[5], reply[6], now_ms),
            added=int(reply[2]),
            detail=reply[1].decode(),
            alone=bool(int(reply[7])),
        )

    # Reads --------------------------------------------------------------------------------------------------

    async def read_conversation(
        self, key: ConversationKey, now_ms: int, query: TranscriptQuery | None = None
    ) -> tuple[Header | None, list[StoredMessage]]:
        script_keys = _keys_of(key.project, key.conversation_id)
        async with Call("read_conversation", self._timeout):
            # One script in the conversation's slot: header and messages of the same moment.
            reply = await self._script(
                "transcript_read", script_keys, [now_ms, *_query_args(query)], replicate=False
            )
        header = _header(key, reply[0], reply[1], now_ms)
        if header is None:
            return None, []
        return header, _messages(int(reply[2]), reply[3], reply[4])

    async def read_context(
        self, key: ConversationKey, subject: str | None, now_ms: int, query: TranscriptQuery | None = None
    ) -> tuple[Header | None, list[StoredMessage], dict[str, StoredField] | None]:
        if not subject:
            header, messages = await self.read_conversation(key, now_ms, query)
            return header, messages, None
        script_keys = _keys_of(key.project, key.conversation_id)
        args = [now_ms, *_query_args(query)]
        memory = ("HGETALL", keys.memory_key(key.project, subject))
        transport = self._transport
        async with Call("read_context", self._timeout):
            if self._cluster:
                # The caller's memory is in another slot: both calls at once, one round trip of waiting.
                reply, data = await _all(
                    self._script("transcript_read", script_keys, args, replicate=False),
                    self._memory(memory),
                )
            else:
                # One write on one connection: the read script and the HGETALL, as a hand-made pipeline
                # would send them (each call costs more in the driver than in Redis).
                try:
                    command = transport.script_command("transcript_read", script_keys, args)
                    reply, data = await transport.run(command, memory, replicate=False)
                except NoScriptError:
                    text = cast("str", transport.scripts["transcript_read"].script)
                    command = ("EVAL", text, len(script_keys), *script_keys, *args)
                    reply, data = await transport.run(command, memory, replicate=False)
        header = _header(key, reply[0], reply[1], now_ms)
        if header is None:
            return None, [], None
        fields = memory_fields(data, now_ms) if header.subject == subject else None
        return header, _messages(int(reply[2]), reply[3], reply[4]), fields

    async def _memory(self, command: Command) -> Any:
        (data,) = await self._transport.run(command, replicate=False)
        return data

    async def transcript_bytes(self, project: str, now_ms: int, since: int) -> int:
        async with Call("transcript_bytes", self._timeout):
            (data,) = await self._transport.run(
                ("HGETALL", keys.transcript_volume_key(project)), replicate=False
            )
        # Every hour that ends after ``since`` (one that straddles it counts whole).
        total = sum(int(amount) for hour, amount in hash_reply(data).items() if int(hour) > since - HOUR_MS)
        return max(0, total)

    # Summaries and the lifecycle -------------------------------------------------------------------------------

    async def _update(self, key: ConversationKey, args: Sequence[str | bytes | int]) -> list[Any]:
        header_key, _, _, data_key = _keys_of(key.project, key.conversation_id)
        return cast("list[Any]", await self._script("transcript_update", [header_key, data_key], args))

    async def put_summary(self, key: ConversationKey, summary: bytes, now_ms: int) -> Header | None:
        async with Call("put_summary", self._timeout):
            reply = await self._update(key, ["summary", now_ms, summary])
        return _header(key, reply[1], reply[2], now_ms) if reply[0] else None

    async def claim_end(self, claim: EndClaim, now_ms: int) -> ClaimResult:
        key = claim.key
        header_key, _, _, data_key = keys.transcript_keys(key.project, key.conversation_id)
        idle_since = "" if claim.idle_since is None else claim.idle_since
        args: list[str | bytes | int] = [
            now_ms,
            claim.ended_by,
            claim.end_reason,
            idle_since,
            claim.lease_until,
            claim.end_data,
        ]
        async with Call("claim_end", self._timeout):
            reply = await self._script("transcript_claim", [header_key, data_key], args)
            status = ClaimStatus(reply[0].decode())
            member = keys.due_member(key.project, key.conversation_id)
            if status is ClaimStatus.CLAIMED:
                # Due again when the lease lapses (a crashed end is taken over then).
                await self._transport.run(("ZADD", keys.TRANSCRIPTS_DUE, claim.lease_until, member))
            elif status is ClaimStatus.MISSING:
                if reply[1]:  # its transcript expired: no end can claim it again, so it is never due again
                    await self._transport.run(("ZREM", keys.TRANSCRIPTS_DUE, member))
                return ClaimResult(status, None)
        return ClaimResult(status, _header(key, reply[1], reply[2], now_ms))

    async def finish_end(self, key: ConversationKey, now_ms: int) -> Header | None:
        async with Call("finish_end", self._timeout):
            reply = await self._update(key, ["finish", now_ms])
            header = _header(key, reply[1], reply[2], now_ms) if reply[0] else None
            if header is not None and header.status is TranscriptStatus.ENDED:
                member = keys.due_member(key.project, key.conversation_id)
                raw = hash_reply(reply[1])
                # Out of its caller's open ones (redis_caller_index.py), after the header says ended.
                caller = CallerRef(key.project, raw[b"subject"].decode())
                await _all(
                    self._transport.run(("ZREM", keys.TRANSCRIPTS_DUE, member)),
                    self._lane(caller, ended_ops(key.conversation_id, raw, now_ms)),
                )
        return header

    async def reschedule(self, key: ConversationKey, due_at: int) -> None:
        async with Call("reschedule", self._timeout):
            reply = await self._update(key, ["due", 0, due_at])
            if reply[0]:
                member = keys.due_member(key.project, key.conversation_id)
                await self._transport.run(("ZADD", keys.TRANSCRIPTS_DUE, due_at, member))

    async def due_conversations(self, now_ms: int, limit: int) -> list[ConversationKey]:
        if limit <= 0:
            return []
        found: list[tuple[int, ConversationKey]] = []
        async with Call("due_conversations", self._timeout):
            for _ in range(_DUE_ROUNDS):
                (reply,) = await self._transport.run(
                    (
                        "ZRANGE",
                        keys.TRANSCRIPTS_DUE,
                        "-inf",
                        now_ms,
                        "BYSCORE",
                        "LIMIT",
                        0,
                        limit,
                        "WITHSCORES",
                    ),
                    replicate=False,
                )
                entries = _scored(reply)
                conversations = [_conversation(member) for member, _ in entries]
                # Each header in its own slot: one write per primary, no replica to wait for (read only).
                dues = await self._transport.run_scripts(
                    "transcript_due",
                    [
                        (
                            [keys.transcript_header_key(c.project, c.conversation_id)],
                            [now_ms, EXPIRED_DUE_GRACE_MS],
                        )
                        for c in conversations
                    ],
                )
                fixes: list[str | bytes | int] = []
                found = []
                for (member, score), conversation, due in zip(entries, conversations, dues, strict=True):
                    due = int(due)
                    if due != score:  # stale: the header says later, or never
                        fixes += [member, score, "" if due < 0 else due]
                    if 0 <= due <= now_ms:
                        found.append((due, conversation))
                if not fixes:
                    return [conversation for _, conversation in found]
                await self._script("transcript_due_index", [keys.TRANSCRIPTS_DUE], fixes)
        # Still correcting after the last round (writes racing with it): what was found, in due order.
        found.sort(key=lambda item: item[0])
        return [conversation for _, conversation in found[:limit]]

    # Deletion and erasure ---------------------------------------------------------------------------------------

    async def delete_conversation(self, key: ConversationKey, now_ms: int) -> Header | None:
        script_keys = keys.transcript_keys(key.project, key.conversation_id)
        async with Call("delete_conversation", self._timeout):
            reply = await self._script("transcript_remove", script_keys, [now_ms, "deleted", "", ""])
            if not reply[0]:
                return None
            raw = hash_reply(reply[1])
            header = _header(key, raw, reply[2], now_ms)
            # The marker is written: now the links to it in other slots go.
            subject = raw[b"subject"].decode()
            member = keys.due_member(key.project, key.conversation_id)
            channel, last = raw[b"channel"].decode(), int(raw[b"last_activity"])
            cid = key.conversation_id
            follow: list[Awaitable[Any]] = [
                self._transport.run(("ZREM", keys.caller_transcripts_key(key.project, subject), cid)),
                self._transport.run(("ZREM", keys.TRANSCRIPTS_DUE, member)),
                self._lane(
                    CallerRef(key.project, subject),
                    [
                        ("drop", cid, open_member(channel, cid), resumable_member(channel, last, cid), 0),
                        ("unlist", cid, "", "", 0),
                    ],
                ),
            ]
            if int(raw[b"expires_at"]) > now_ms and int(raw[b"bytes"]):
                follow.append(self._tally(key.project, _hour(int(raw[b"started_at"])), -int(raw[b"bytes"])))
            await _all(*follow)
        return header

    async def erase_transcripts(
        self, caller: CallerRef, listed: Sequence[tuple[str, int]], now_ms: int
    ) -> int:
        """Replace each of the caller's conversations (``(conversation id, horizon)`` as their listing held
        them when :meth:`~caller_memory.service.storage.redis.store.RedisStore.erase_caller` wrote the tombstone) by an ERASED marker, then take
        them off the listing (an erasure cut short in between is found again by its retry: markers stay
        markers); returns how many live transcripts were removed. Runs inside the erasure's :class:`Call`."""
        project = caller.project
        removed: list[Any] = []
        for start in range(0, len(listed), _ERASE_CHUNK):
            removed += await _all(
                *(
                    self._script(
                        "transcript_remove",
                        keys.transcript_keys(project, conversation_id),
                        [now_ms, "erased", caller.subject, horizon],
                    )
                    for conversation_id, horizon in listed[start : start + _ERASE_CHUNK]
                )
            )
        live = 0
        members: list[str] = []
        taken: dict[int, int] = {}
        # Out of the caller's indexes (redis_caller_index.py): each id, and what its header says it had by
        # channel. Not the whole keys: a conversation made after the erasure may be listed there already.
        dropped: list[tuple[str, str, str, str, int]] = []
        for (conversation_id, _), reply in zip(listed, removed, strict=True):
            dropped.append(("unlist", conversation_id, "", "", 0))
            if not reply[0]:
                dropped.append(("drop", conversation_id, "", "", 0))
                continue  # not written (a marker is left), another caller's, or a marker already
            raw = hash_reply(reply[1])
            channel, last = raw[b"channel"].decode(), int(raw[b"last_activity"])
            dropped.append(
                (
                    "drop",
                    conversation_id,
                    open_member(channel, conversation_id),
                    resumable_member(channel, last, conversation_id),
                    0,
                )
            )
            members.append(keys.due_member(project, conversation_id))
            if int(raw[b"expires_at"]) > now_ms:
                live += 1
                hour = _hour(int(raw[b"started_at"]))
                taken[hour] = taken.get(hour, 0) + int(raw[b"bytes"])
        follow: list[Awaitable[Any]] = [
            self._tally(project, hour, -amount) for hour, amount in taken.items() if amount
        ]
        if members:
            follow.append(self._transport.run(("ZREM", keys.TRANSCRIPTS_DUE, *members)))
        if listed:
            # The caller's indexes first, then the listing: an erasure cut short between the two is found
            # again by its retry (it reads the listing), which drops what is left in the indexes.
            follow.append(self._lane(caller, dropped))
        await _all(*follow)
        if listed:
            listing = keys.caller_transcripts_key(project, caller.subject)
            await self._transport.run(("ZREM", listing, *(i for i, _ in listed)))
        return live
