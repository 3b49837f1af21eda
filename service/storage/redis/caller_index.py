"""Redis backend: a caller's conversations as a start and a listing need them (SPEC sections 10 and 14), and
the reading of a conversation's header, which the transcript methods (:mod:`caller_memory.service.storage.redis.transcripts`) share.

:class:`RedisCallerIndex` is the base of :class:`~caller_memory.service.storage.redis.transcripts.RedisTranscripts`. A start ends what is
still open on its caller's channel and offers the latest resumable conversation there; finding those by
reading every header of the caller made each start cost in proportion to the caller's conversations (3,000 of
them: about 110 ms, and other tenants' reads stalled). Three indexes in the caller's slot answer
instead, beside the listing ``vc`` that an erasure reads (keys.py):

- ``vs``: conversation id -> start time, the admin listing's pages (newest start first);
- ``vk``: by channel, all scores 0, ordered by member: ``<channel>\\no<id>`` while the conversation is open or
  ending, ``<channel>\\nr<9999999999999 - last activity, 13 digits><id>`` once it ended resumable (newest
  first), so that one channel's open ones and its newest resumable ones are each one ``ZRANGE BYLEX``;
- ``va``: the same across channels (``cross_channel``), conversation id -> 2^53 - 1 while open or ending, or
  its last activity.

A creating append writes its entries with its ``vc`` entry, in the same script (``transcript_register.lua``,
or ``transcript_append.lua`` on one server); :meth:`~caller_memory.service.storage.redis.transcripts.RedisTranscripts.finish_end` then
moves it from the open ones to the resumable ones (or drops it), keeping the newest :data:`RESUMABLE_KEPT`
per channel and across channels; a deletion drops it; an erasure drops what the erased headers name
(``transcript_lane.lua`` for each). Those follow a write in the conversation's slot, so a crash in between
leaves an entry that disagrees with its header: every read checks each entry against its header, leaves a
wrong one out and corrects it (an ended one is settled, a marker's, an expired or a reused id's is dropped;
one without a header is dropped only once it is off the listing, since a creation lists before it writes).
The indexes expire with the listing, and forgotten conversations leave ``vs`` and ``va`` with it.

A caller listed by an earlier release has ids in ``vc`` without a ``vs`` entry (every later listing writes
both at once): the reads compare the two counts and index those once, reading their headers
(:meth:`RedisCallerIndex._index_listed`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from ...domain.errors import StoreCorrupt
from ...domain.store import CallerRef
from ...domain.store.transcripts import (
    RESUMABLE_KEPT,
    CallerPage,
    ConversationKey,
    Header,
    PagePosition,
    TranscriptStatus,
)
from . import keys
from .transport import Call, Command, RedisTransport, hash_reply

_MARKERS = (TranscriptStatus.ERASED, TranscriptStatus.DELETED)
_LIVE = (TranscriptStatus.OPEN, TranscriptStatus.ENDING)
#: ``va``'s score of an open or ending conversation (above every time in ms).
LIVE_SCORE = 2**53 - 1
_INVERT = 9_999_999_999_999
#: Operations of ``transcript_lane.lua`` per call.
_OPS_PER_CALL = 200

Op = tuple[str, str, str, str, int]


def open_member(channel: str, conversation_id: str) -> str:
    return f"{channel}\no{conversation_id}"


def resumable_member(channel: str, last_activity: int, conversation_id: str) -> str:
    return f"{channel}\nr{_INVERT - last_activity:013d}{conversation_id}"


def _header(key: ConversationKey, flat: Any, data: Any, now_ms: int) -> Header | None:
    """A header from its hash (HGETALL, flat or a dict) and ``[checkpoint, summary]``; None when there is none
    or it is forgotten. A marker, or a header whose transcript expired, keeps only its status and expiries."""
    raw = hash_reply(flat) if flat else {}
    if not raw:
        return None
    try:
        forget_at = int(raw[b"forget_at"])
        if forget_at <= now_ms:
            return None
        status = TranscriptStatus(raw[b"status"].decode())
        expires_at = int(raw[b"expires_at"])
        if status in _MARKERS or expires_at <= now_ms:
            return Header(
                key, status, "", "", "", 0, 0, -1, 0, 0, 0, None, 0, None, "", "", 0, expires_at, forget_at
            )
        checkpoint, summary = [*(data or ()), None, None][:2]
        return Header(
            key=key,
            status=status,
            subject=raw[b"subject"].decode(),
            channel=raw[b"channel"].decode(),
            agent=raw[b"agent"].decode(),
            started_at=int(raw[b"started_at"]),
            last_activity=int(raw[b"last_activity"]),
            turn_id=int(raw[b"turn_id"]),
            messages=int(raw[b"messages"]),
            bytes=int(raw[b"bytes"]),
            tokens=int(raw[b"tokens"]),
            checkpoint=checkpoint,
            checkpoint_at=int(raw[b"checkpoint_at"]),
            summary=summary,
            ended_by=raw[b"ended_by"].decode(),
            end_reason=raw[b"end_reason"].decode(),
            ended_at=int(raw[b"ended_at"]),
            expires_at=expires_at,
            forget_at=forget_at,
            lease_until=int(raw[b"lease_until"]),
            end_data=raw[b"end_data"],
            region=raw.get(b"region", b"").decode(),  # absent from headers of earlier releases
        )
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
        raise StoreCorrupt("a stored conversation header cannot be read") from exc


async def _all(*calls: Awaitable[Any]) -> list[Any]:
    """Await ``calls`` concurrently, each to its end, then raise the first failure (a Redis error is then
    translated by the enclosing :class:`Call`, which an exception group would slip past)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    failure = next((r for r in results if isinstance(r, BaseException)), None)
    if failure is not None:
        raise failure
    return results


def ended_ops(conversation_id: str, raw: dict[bytes, bytes], now_ms: int) -> list[Op]:
    """What ``transcript_lane.lua`` does for a conversation whose header (as HGETALL read it) says it ended
    (``settle``), or that is no longer there to be found (``drop``)."""
    if b"channel" not in raw:
        return []  # a marker: whatever it had is dropped when read
    channel, last = raw[b"channel"].decode(), int(raw[b"last_activity"])
    live, resumable = open_member(channel, conversation_id), resumable_member(channel, last, conversation_id)
    header = _header(ConversationKey("", conversation_id), raw, None, now_ms)
    if header is None or header.expired(now_ms) or header.status in _MARKERS:
        return [("drop", conversation_id, live, resumable, 0)]
    if header.status is not TranscriptStatus.ENDED:
        return []
    return [("settle", conversation_id, live, resumable if header.resumable else "", last)]


class RedisCallerIndex:
    """The caller's conversations on Redis: all of them, a page of them, and those a start looks at."""

    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float

    async def _lane(self, caller: CallerRef, ops: Sequence[Op]) -> None:
        index = keys.caller_index_keys(caller.project, caller.subject)
        for start in range(0, len(ops), _OPS_PER_CALL):
            args: list[str | int] = [RESUMABLE_KEPT]
            for op in ops[start : start + _OPS_PER_CALL]:
                args += op
            await self._transport.script("transcript_lane", index, args)

    async def _headers(self, project: str, ids: Sequence[str]) -> list[tuple[dict[bytes, bytes], Any]]:
        """The header hashes and ``[checkpoint, summary]`` of conversations ``ids`` (one write per primary)."""
        commands: list[Command] = []
        for conversation_id in ids:
            header_key, _, _, data_key = keys.transcript_keys(project, conversation_id)
            commands += [("HGETALL", header_key), ("HMGET", data_key, "checkpoint", "summary")]
        replies = await self._transport.each(commands, replicate=False)
        return [(hash_reply(replies[2 * i]), replies[2 * i + 1]) for i in range(len(ids))]

    async def _index_listed(self, caller: CallerRef, now_ms: int) -> None:
        """Index the caller's conversations listed by an earlier release (in ``vc``, not in ``vs``): once."""
        listing, started, _, _ = keys.caller_index_keys(caller.project, caller.subject)
        (ids,) = await self._transport.run(("ZRANGE", listing, 0, -1), replicate=False)
        if not ids:
            return
        (scores,) = await self._transport.run(("ZMSCORE", started, *ids), replicate=False)
        missing = [i.decode() for i, score in zip(ids, scores, strict=True) if score is None]
        subject = caller.subject.encode()
        ops: list[Op] = []
        for conversation_id, (raw, data) in zip(
            missing, await self._headers(caller.project, missing), strict=True
        ):
            mine = raw.get(b"subject") == subject
            ops.append(("index", conversation_id, "", "", int(raw[b"started_at"]) if mine else 0))
            header = (
                _header(ConversationKey(caller.project, conversation_id), raw, data, now_ms) if mine else None
            )
            if header is None or header.expired(now_ms) or header.status in _MARKERS:
                continue
            if header.status in _LIVE:
                ops.append(("open", conversation_id, open_member(header.channel, conversation_id), "", 0))
            else:
                ops += ended_ops(conversation_id, raw, now_ms)
        await self._lane(caller, ops)

    async def _indexed(self, caller: CallerRef, commands: Sequence[Command], now_ms: int) -> list[Any]:
        """``commands`` (reads of the caller's indexes) once the indexes hold every listed conversation."""
        listing, started, _, _ = keys.caller_index_keys(caller.project, caller.subject)
        listed, indexed, *replies = await self._transport.run(
            ("ZCARD", listing), ("ZCARD", started), *commands, replicate=False
        )
        if int(listed) <= int(indexed):
            return replies
        await self._index_listed(caller, now_ms)
        return await self._transport.run(*commands, replicate=False)

    async def caller_conversations(self, caller: CallerRef, now_ms: int) -> list[Header]:
        index = keys.caller_transcripts_key(caller.project, caller.subject)
        async with Call("caller_conversations", self._timeout):
            (ids,) = await self._transport.run(("ZRANGE", index, 0, -1), replicate=False)
            listed = [i.decode() for i in ids]
            replies = await self._headers(caller.project, listed)
        found: list[tuple[int, str, Header]] = []
        subject = caller.subject.encode()
        for conversation_id, (raw, data) in zip(listed, replies, strict=True):
            # An id may be listed and not (or no longer, or another caller's once reused) written.
            if raw.get(b"subject") != subject:
                continue
            header = _header(ConversationKey(caller.project, conversation_id), raw, data, now_ms)
            if header is not None and header.status not in _MARKERS:
                found.append((int(raw[b"started_at"]), conversation_id, header))
        found.sort(key=lambda item: (item[0], item[1]), reverse=True)
        return [header for _, _, header in found]

    async def caller_conversations_page(
        self, caller: CallerRef, now_ms: int, limit: int, after: PagePosition | None = None
    ) -> CallerPage:
        started = keys.caller_started_key(caller.project, caller.subject)
        async with Call("caller_conversations_page", self._timeout):
            if after is None:
                (entries,) = await self._indexed(
                    caller,
                    [
                        (
                            "ZRANGE",
                            started,
                            "+inf",
                            "-inf",
                            "BYSCORE",
                            "REV",
                            "LIMIT",
                            0,
                            limit + 1,
                            "WITHSCORES",
                        )
                    ],
                    now_ms,
                )
                scored = _scored(entries)
            else:
                ties, later = await self._indexed(
                    caller,
                    [
                        ("ZRANGE", started, after.started_at, after.started_at, "BYSCORE", "REV", "WITHSCORES"),
                        ("ZRANGE", started, f"({after.started_at}", "-inf", "BYSCORE", "REV", "LIMIT", 0,
                         limit + 1, "WITHSCORES"),
                    ],
                    now_ms,
                )  # fmt: skip
                scored = [e for e in _scored(ties) if e[0] < after.conversation_id] + _scored(later)
            page = scored[:limit]
            replies = await self._headers(caller.project, [i for i, _ in page])
        subject = caller.subject.encode()
        headers = []
        for (conversation_id, _), (raw, data) in zip(page, replies, strict=True):
            if raw.get(b"subject") != subject:
                continue
            header = _header(ConversationKey(caller.project, conversation_id), raw, data, now_ms)
            if header is not None and header.status not in _MARKERS:
                headers.append(header)
        more = len(scored) > limit
        return CallerPage(headers, PagePosition(page[-1][1], page[-1][0]) if more else None)

    async def channel_conversations(
        self, caller: CallerRef, channel: str | None, now_ms: int, resumable_since: int | None = None
    ) -> list[Header]:
        _, _, by_channel, across = keys.caller_index_keys(caller.project, caller.subject)
        since = resumable_since
        commands: list[Command]
        if channel is not None:
            commands = [("ZRANGE", by_channel, f"[{channel}\no", f"({channel}\np", "BYLEX")]
            if since is not None:
                commands.append(
                    (
                        "ZRANGE",
                        by_channel,
                        f"[{channel}\nr",
                        f"({channel}\ns",
                        "BYLEX",
                        "LIMIT",
                        0,
                        RESUMABLE_KEPT,
                    )
                )
        else:
            commands = [("ZRANGE", across, LIVE_SCORE, LIVE_SCORE, "BYSCORE")]
            if since is not None:
                commands.append(
                    ("ZRANGE", across, f"({LIVE_SCORE}", since, "BYSCORE", "REV", "LIMIT", 0, RESUMABLE_KEPT)
                )
        async with Call("channel_conversations", self._timeout):
            replies = await self._indexed(caller, commands, now_ms)
            # (conversation id, its entry among the open ones, among the resumable ones: the member as read)
            entries: dict[str, tuple[str, str]] = {}
            for member in (m.decode() for m in replies[0]):
                conversation_id = member[len(channel) + 2 :] if channel is not None else member
                entries[conversation_id] = (member if channel is not None else "", "")
            for member in (m.decode() for m in (replies[1] if len(replies) > 1 else ())):
                if channel is None:
                    entries.setdefault(member, ("", ""))
                    continue
                rest = member[len(channel) + 2 :]
                if since is not None and _INVERT - int(rest[:13]) >= since:
                    entries.setdefault(rest[13:], ("", member))
            ids = list(entries)
            found = await self._headers(caller.project, ids)
            out, fixes = self._judge(caller, channel, since, ids, entries, found=found, now_ms=now_ms)
            if fixes:
                await self._lane(caller, fixes)
        return out

    @staticmethod
    def _judge(
        caller: CallerRef,
        channel: str | None,
        since: int | None,
        ids: list[str],
        entries: dict[str, tuple[str, str]],
        *,
        found: list[tuple[dict[bytes, bytes], Any]],
        now_ms: int,
    ) -> tuple[list[Header], list[Op]]:
        """The headers :meth:`channel_conversations` returns for the index entries read, and the corrections
        of the entries their headers disprove."""
        out: list[Header] = []
        fixes: list[Op] = []
        subject = caller.subject.encode()
        for conversation_id, (raw, data) in zip(ids, found, strict=True):
            live, resumable = entries[conversation_id]
            header = _header(ConversationKey(caller.project, conversation_id), raw, data, now_ms)
            if header is None:  # not written yet (a creation lists first), or forgotten: off the listing?
                fixes.append(("prune", conversation_id, live, resumable, 0))
                continue
            if (
                raw.get(b"subject") != subject
                or header.status in _MARKERS
                or header.expired(now_ms)
                or (channel is not None and header.channel != channel)
            ):
                fixes.append(("drop", conversation_id, live, resumable, 0))
                continue
            if header.status in _LIVE:
                out.append(header)
                continue
            if not resumable:  # ended since it was indexed open (its end's index write is still to come)
                fixes += ended_ops(conversation_id, raw, now_ms)
            if header.resumable and since is not None and header.last_activity >= since:
                out.append(header)
        return out, fixes


def _scored(reply: Any) -> list[tuple[str, int]]:
    """``(member, score)`` pairs of a ``ZRANGE ... WITHSCORES`` (pairs in RESP3, a flat list in RESP2)."""
    if reply and isinstance(reply[0], list):
        return [(member.decode(), int(score)) for member, score in reply]
    return [(reply[i].decode(), int(float(reply[i + 1]))) for i in range(0, len(reply), 2)]
