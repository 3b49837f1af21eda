"""The conversation-memory part of the Store contract (service/domain/store/transcripts.py): appends, reads,
checkpoints, limits, expiry and summaries, identical on SQLite, Redis and Redis Cluster. The lifecycle (ends,
the due index, a caller's list, deletion, erasure, a project's bytes) is in test_transcripts_lifecycle.py,
which shares the helpers defined here.

Times are a base from the real clock (Redis expires keys in its own time: a base in the past would let it drop
what a test still expects) plus explicit offsets passed as ``now_ms``; nothing sleeps. The store keeps message
bodies as opaque bytes, but the ones here are realistic: platform messages encoded by the domain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import orjson
from caller_memory.service.domain.clock import DAY_MS, HOUR_MS
from caller_memory.service.domain.conversations.messages import (
    MAX_MESSAGES,
    MAX_TRANSCRIPT_BYTES,
    MessageIn,
    MessageMetadata,
    encode_message,
    estimate_tokens,
    incoming,
)
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import CallerRef, Store
from caller_memory.service.domain.store.transcripts import (
    AppendResult,
    AppendStatus,
    AppendWrite,
    ClaimStatus,
    ConversationKey,
    EndClaim,
    Header,
    NewMessage,
    StoredMessage,
    TranscriptQuery,
    TranscriptStatus,
)

PROJECT = "shop"
MINUTE_MS = 60_000
#: How long a transcript lives after its last activity, and its header after that activity.
RETENTION = DAY_MS
REMEMBER = 7 * DAY_MS
#: When a conversation becomes due for an inactivity end, after its last activity.
INACTIVITY = 30 * MINUTE_MS

OPEN = TranscriptStatus.OPEN
Role = Literal["user", "assistant", "tool"]
APPENDED = AppendStatus.APPENDED


def now_ms() -> int:
    """Now, or the start of the next hour if that is less than 10 minutes away: a test that adds a few minutes
    to it stays in one hour bucket (transcript_bytes counts by the hour) and writes no time already past."""
    now = time.time_ns() // 1_000_000
    return now - now % HOUR_MS + HOUR_MS if now % HOUR_MS > HOUR_MS - 10 * MINUTE_MS else now


def new_caller(project: str = PROJECT) -> CallerRef:
    return CallerRef(project, uuid.uuid4().hex)


def new_key(project: str = PROJECT) -> ConversationKey:
    return ConversationKey(project, f"call-{uuid.uuid4().hex[:16]}")


def message(
    turn: int, content: str, at: int, *, role: Role = "user", original: str | None = None, **parts: Any
) -> NewMessage:
    """A platform message as the domain hands it to the store: validated, encoded, its tokens counted
    (``parts``: ``source``, ``message_id``, ``tokens``)."""
    metadata = MessageMetadata(
        source=parts.pop("source", None), interrupted=original is not None, original=original
    )
    given = MessageIn(role=role, content=content, turn_id=turn, timestamp=at, metadata=metadata, **parts)
    tokens = given.tokens if given.tokens is not None else estimate_tokens(content)
    return NewMessage(turn, encode_message(incoming(given), content, original, at), given.message_id, tokens)


def platform_call(at: int) -> list[NewMessage]:
    """SPEC section 14's example transcript, a second apart, with message ids m-1 ... m-6 (turns 1 to 4)."""
    joke = "Why did the scarecrow win an award? Because he was outstanding in his field!"
    return [
        message(1, "How can I help you today?", at, role="assistant", source="greeting", message_id="m-1"),
        message(2, "Can you tell me a joke?", at + 1000, source="asr", message_id="m-2", tokens=7),
        message(2, "Why did the scarecrow ", at + 2000, role="assistant", message_id="m-3", tokens=6, original=joke),
        message(3, "You know what? Tell me a story instead.", at + 3000, source="asr", message_id="m-4"),
        message(3, "Once upon a time in a land far away, ... 🌾", at + 4000, role="assistant", message_id="m-5"),
        message(4, "Are you still there?", at + 5000, role="assistant", source="command", message_id="m-6"),
    ]  # fmt: skip


def appending(key: ConversationKey, caller: CallerRef, messages: Sequence[NewMessage], at: int, **changes: Any
              ) -> AppendWrite:  # fmt: skip
    """An append made at ``at`` that may create the conversation, with the expiries and due time the domain
    computes from it and the largest limits; ``changes`` replace any of that."""
    write = AppendWrite(key, caller, "voice", "", True, list(messages), None, at, at + RETENTION, at + REMEMBER,
                        at + INACTIVITY, MAX_MESSAGES, MAX_TRANSCRIPT_BYTES)  # fmt: skip
    return dataclasses.replace(write, **changes)


async def append(store: Store, key: ConversationKey, caller: CallerRef, messages: Sequence[NewMessage], at: int,
                 **changes: Any) -> AppendResult:  # fmt: skip
    return await store.append_messages(appending(key, caller, messages, at, **changes), at)


def state(**values: object) -> bytes:
    """A state checkpoint as the domain encodes it."""
    return orjson.dumps(values)


async def everything(
    store: Store, key: ConversationKey, now: int
) -> tuple[Header | None, list[StoredMessage]]:
    return await store.read_conversation(key, now, TranscriptQuery())


def stored(messages: Sequence[NewMessage], first_seq: int = 0) -> list[StoredMessage]:
    """What a read returns for ``messages``, appended in order from position ``first_seq``."""
    return [StoredMessage(first_seq + i, m.turn_id, m.body, m.message_id) for i, m in enumerate(messages)]


def opened(key: ConversationKey, caller: CallerRef, at: int, messages: Sequence[NewMessage],
           checkpoint: bytes | None = None, *, channel: str = "voice", agent: str = "") -> Header:  # fmt: skip
    """The header of a conversation created at ``at`` by an append of ``messages`` (and ``checkpoint``)."""
    turn = max((m.turn_id for m in messages), default=-1)
    size, tokens = sum(len(m.body) for m in messages), sum(m.tokens for m in messages)
    return Header(key, OPEN, caller.subject, channel, agent, at, at, turn, len(messages), size, tokens, checkpoint,
                  0 if checkpoint is None else at, None, "", "", 0, at + RETENTION, at + REMEMBER)  # fmt: skip


def advanced(header: Header, at: int, messages: Sequence[NewMessage]) -> Header:
    """``header`` after an append at ``at`` that added ``messages`` (and kept no checkpoint)."""
    return dataclasses.replace(
        header,
        last_activity=at,
        turn_id=max([header.turn_id, *(m.turn_id for m in messages)]),
        messages=header.messages + len(messages),
        bytes=header.bytes + sum(len(m.body) for m in messages),
        tokens=header.tokens + sum(m.tokens for m in messages),
        expires_at=at + RETENTION,
        forget_at=at + REMEMBER,
    )


async def assert_refused(
    store: Store, write: AppendWrite, at: int, status: AppendStatus, detail: str | None = None
) -> None:
    """``write`` is refused with ``status`` and changes nothing: header and messages read as before."""
    before = await everything(store, write.key, at)
    result = await store.append_messages(write, at)
    assert result.status is status, result
    assert result.added == 0
    if detail is not None:
        assert result.detail == detail
    if status not in (AppendStatus.EXPIRED, AppendStatus.ERASED, AppendStatus.NOT_FOUND):
        assert result.header == before[0]  # the header before (nothing was written)
    assert await everything(store, write.key, at) == before


# Creating ---------------------------------------------------------------------------------------------------


async def test_an_append_creates_the_conversation(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call, checkpoint = platform_call(t), state(cheese_type="gouda", party_size=4)
    result = await append(store, key, caller, call, t, checkpoint=checkpoint, agent="booking")
    expected = opened(key, caller, t, call, checkpoint, agent="booking")
    assert (result.status, result.header, result.added) == (APPENDED, expected, 6)
    assert (expected.turn_id, expected.messages) == (4, 6)

    # Exactly what was appended comes back, in order, bodies byte for byte.
    assert await everything(store, key, t + 1) == (expected, stored(call))
    assert await store.read_conversation(key, t + 1) == (expected, [])  # no query: the header alone
    # Conversation ids are per project.
    assert await everything(store, ConversationKey("bakery", key.conversation_id), t) == (None, [])


async def test_an_empty_append_with_create_is_a_start(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    result = await append(store, key, caller, [], t, agent="booking")
    expected = opened(key, caller, t, [], agent="booking")
    assert (result.status, result.header, result.added) == (APPENDED, expected, 0)
    assert expected.turn_id == -1 and expected.messages == expected.bytes == expected.tokens == 0
    assert await everything(store, key, t) == (expected, [])

    # Starting it again changes nothing, not even its last activity, channel or agent.
    again = await append(store, key, caller, [], t + MINUTE_MS, channel="sip", agent="billing")
    assert (again.status, again.header) == (APPENDED, expected)
    assert await everything(store, key, t + MINUTE_MS) == (expected, [])

    # Its first messages continue it: started when it was started, active now.
    call = platform_call(t + 2 * MINUTE_MS)
    continued = await append(store, key, caller, call, t + 2 * MINUTE_MS, create=False)
    assert continued.header == advanced(expected, t + 2 * MINUTE_MS, call)
    assert continued.header.started_at == t


async def test_without_create_an_unknown_conversation_is_not_found(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    for messages, checkpoint in ((platform_call(t), state(a=1)), ([], None), ([], state(a=1))):
        result = await append(store, key, caller, messages, t, create=False, checkpoint=checkpoint)
        assert (result.status, result.header, result.added) == (AppendStatus.NOT_FOUND, None, 0)
    assert await everything(store, key, t) == (None, [])
    assert await store.caller_conversations(caller, t) == []


async def test_later_appends_continue_the_transcript(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    first = await append(store, key, caller, call[:3], t)
    later = t + MINUTE_MS
    second = await append(store, key, caller, call[3:], later, create=False)
    assert first.header is not None
    expected = advanced(first.header, later, call[3:])
    assert (second.status, second.header, second.added) == (APPENDED, expected, 3)
    assert (expected.started_at, expected.messages, expected.turn_id) == (t, 6, 4)
    assert await everything(store, key, later) == (expected, stored(call))


async def test_create_on_an_existing_conversation_of_the_same_caller_appends(store: Store) -> None:
    """Channel and agent are used only when the append creates the conversation."""
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    first = await append(store, key, caller, call[:2], t, agent="booking")
    second = await append(store, key, caller, call[2:], t + 10, channel="sip", agent="billing")
    assert first.header is not None
    assert (second.status, second.header) == (APPENDED, advanced(first.header, t + 10, call[2:]))
    assert second.header is not None
    assert (second.header.channel, second.header.agent) == ("voice", "booking")


async def test_an_append_without_create_does_not_check_the_caller(store: Store) -> None:
    """The caller of an append is used only when it creates the conversation: an append that does not name
    one (``create`` false, the client sent no caller) continues the conversation whoever it names."""
    caller, t = new_caller(), now_ms()
    call = platform_call(t)
    for unnamed in (CallerRef(PROJECT, ""), new_caller()):
        key = new_key()
        await append(store, key, caller, call[:3], t)
        result = await append(store, key, unnamed, call[3:], t + 10, create=False)
        assert (result.status, result.added) == (APPENDED, 3)
        header, messages = await everything(store, key, t + 10)
        assert header is not None and header.subject == caller.subject
        assert messages == stored(call)


async def test_another_callers_conversation_is_refused(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    await append(store, key, caller, call[:3], t, checkpoint=state(a=1))
    intruder = new_caller()
    write = appending(key, intruder, call[3:], t + 10, checkpoint=state(a=2))
    await assert_refused(store, write, t + 10, AppendStatus.OTHER_CALLER)
    await assert_refused(store, appending(key, intruder, [], t + 20), t + 20, AppendStatus.OTHER_CALLER)
    assert await store.caller_conversations(intruder, t + 20) == []
    # The same pseudonym in another project is another caller too.
    elsewhere = CallerRef("bakery", caller.subject)
    write = appending(key, elsewhere, call[3:], t + 30)
    await assert_refused(store, write, t + 30, AppendStatus.OTHER_CALLER)


# Message ids ------------------------------------------------------------------------------------------------


async def test_message_ids_make_appends_idempotent(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    first = await append(store, key, caller, call[:3], t)
    assert first.header is not None

    # A retry of the whole batch adds nothing, and is not activity.
    retry = await append(store, key, caller, call[:3], t + MINUTE_MS, create=False)
    assert (retry.status, retry.header, retry.added) == (APPENDED, first.header, 0)

    # A retry that carries new messages adds only those.
    later = t + 2 * MINUTE_MS
    grown = await append(store, key, caller, call, later, create=False)
    expected = advanced(first.header, later, call[3:])
    assert (grown.status, grown.header, grown.added) == (APPENDED, expected, 3)
    assert await everything(store, key, later) == (expected, stored(call))

    # A retry of earlier turns after later ones were stored is still a no-op, not a turn going backwards.
    for batch in (call[:3], call, call[1:2]):
        replay = await append(store, key, caller, batch, later + MINUTE_MS, create=False)
        assert (replay.status, replay.header, replay.added) == (APPENDED, expected, 0)
    assert await everything(store, key, later + MINUTE_MS) == (expected, stored(call))

    # Ids are per conversation: the same ids elsewhere are new messages.
    other = await append(store, new_key(), caller, call, later)
    assert (other.status, other.added) == (APPENDED, 6)


async def test_only_the_same_id_is_the_same_message(store: Store) -> None:
    """Ids are compared whole: m-25508 and m-70939 share the first 4 bytes of their SHA-1 (what a backend may
    index ids by) and are two messages; messages without an id are never deduplicated."""
    caller, key, t = new_caller(), new_key(), now_ms()
    first, second = (
        message(1, text, t, message_id=i) for text, i in (("One.", "m-25508"), ("Two.", "m-70939"))
    )
    hello = message(1, "Hello?", t)
    await append(store, key, caller, [first, hello], t)
    result = await append(store, key, caller, [second, hello], t + 10, create=False)
    assert (result.status, result.added) == (APPENDED, 2)
    retry = await append(store, key, caller, [first, second], t + 20, create=False)
    assert (retry.status, retry.added) == (APPENDED, 0)
    other = message(1, "Three.", t, message_id="m-70939")
    write = appending(key, caller, [other], t + 30, create=False)
    await assert_refused(store, write, t + 30, AppendStatus.ID_CONFLICT, detail="m-70939")
    assert (await everything(store, key, t + 30))[1] == stored([first, hello, second, hello])


async def test_an_id_with_another_body_is_a_conflict_that_writes_nothing(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    await append(store, key, caller, call[:3], t, checkpoint=state(a=1))
    changed = message(2, "Can you tell me a pun?", t + 1000, source="asr", message_id="m-2", tokens=7)
    later = t + MINUTE_MS
    for batch in ([*call[3:], changed], [changed, *call[3:]], [call[0], changed]):
        write = appending(key, caller, batch, later, create=False, checkpoint=state(a=2))
        await assert_refused(store, write, later, AppendStatus.ID_CONFLICT, detail="m-2")
    # The same id with the same body but another token count is the same message: only the body decides.
    same = dataclasses.replace(call[1], tokens=99)
    result = await append(store, key, caller, [same], later, create=False)
    assert (result.status, result.added) == (APPENDED, 0)


# Turn order -------------------------------------------------------------------------------------------------


async def test_turn_ids_never_decrease(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    await append(store, key, caller, call[:4], t, checkpoint=state(a=1))  # up to turn 3
    at = t + 10

    def turn(n: int, text: str) -> NewMessage:
        return message(n, text, at, message_id=f"t-{n}-{text}")

    cases = [
        ([turn(2, "late")], "2"),  # below the stored turn
        ([turn(3, "same"), turn(1, "back")], "1"),  # below the previous message of the batch
        ([turn(5, "ahead"), turn(4, "back")], "4"),  # within the batch, above the stored turn
    ]
    for batch, detail in cases:
        write = appending(key, caller, batch, at, create=False, checkpoint=state(a=2))
        await assert_refused(store, write, at, AppendStatus.TURN_ORDER, detail=detail)
    # The same turn again is fine (a turn has several messages), and so is a gap.
    result = await append(store, key, caller, [turn(3, "more"), turn(7, "gap")], at, create=False)
    assert (result.status, result.added) == (APPENDED, 2)
    assert result.header is not None and result.header.turn_id == 7


async def test_a_new_conversation_checks_the_turn_order_of_its_first_batch(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    backwards = [message(2, "two", t), message(1, "one", t)]
    result = await append(store, key, caller, backwards, t)
    assert (result.status, result.header, result.detail) == (AppendStatus.TURN_ORDER, None, "1")
    assert await everything(store, key, t) == (None, [])
    assert await store.caller_conversations(caller, t) == []


# Limits -----------------------------------------------------------------------------------------------------


async def test_the_message_limit_is_checked_atomically(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    await append(store, key, caller, call[:3], t, max_messages=5)
    write = appending(key, caller, call[3:], t + 10, create=False, checkpoint=state(a=1), max_messages=5)
    await assert_refused(store, write, t + 10, AppendStatus.TOO_MANY_MESSAGES)
    # Up to the limit exactly is fine.
    result = await append(store, key, caller, call[3:5], t + 20, create=False, max_messages=5)
    assert (result.status, result.added) == (APPENDED, 2)
    # Messages already there are not counted again: a retry at the limit is still a no-op.
    retry = await append(store, key, caller, call[:5], t + 30, create=False, max_messages=5)
    assert (retry.status, retry.added) == (APPENDED, 0)
    write = appending(key, caller, call, t + 40, create=False, max_messages=5)
    await assert_refused(store, write, t + 40, AppendStatus.TOO_MANY_MESSAGES)


async def test_the_byte_limit_is_checked_atomically(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    first = await append(store, key, caller, call[:3], t)
    assert first.header is not None
    size = first.header.bytes + sum(len(m.body) for m in call[3:])
    write = appending(key, caller, call[3:], t + 10, create=False, checkpoint=state(a=1), max_bytes=size - 1)
    await assert_refused(store, write, t + 10, AppendStatus.TOO_MANY_BYTES)
    # Up to the limit exactly is fine; the limit is on messages, so a checkpoint does not count.
    result = await append(
        store, key, caller, call[3:], t + 20, create=False, checkpoint=state(a=1), max_bytes=size
    )
    assert (result.status, result.added) == (APPENDED, 3)
    assert result.header is not None and result.header.bytes == size
    retry = await append(store, key, caller, call, t + 30, create=False, max_bytes=size)
    assert (retry.status, retry.added) == (APPENDED, 0)


async def test_a_first_batch_over_a_limit_creates_nothing(store: Store) -> None:
    caller, t = new_caller(), now_ms()
    call = platform_call(t)
    for options, status in (
        ({"max_messages": 5}, AppendStatus.TOO_MANY_MESSAGES),
        ({"max_bytes": sum(len(m.body) for m in call) - 1}, AppendStatus.TOO_MANY_BYTES),
    ):
        key = new_key()
        result = await append(store, key, caller, call, t, checkpoint=state(a=1), **options)
        assert (result.status, result.header, result.added) == (status, None, 0)
        assert await everything(store, key, t) == (None, [])
    assert await store.caller_conversations(caller, t) == []


# The order of refusals ----------------------------------------------------------------------------------------


async def test_refusals_come_in_the_documented_order(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    await append(store, key, caller, call[:4], t)  # m-1 ... m-4, up to turn 3
    at = t + 10
    conflict = message(2, "Another joke?", at, source="asr", message_id="m-2")
    backwards = message(1, "Hello again", at, message_id="n-1")
    big, bigger = (message(5, "x" * 2000, at, message_id=f"n-{i}") for i in (2, 3))

    async def refused(batch: list[NewMessage], status: AppendStatus, **options: Any) -> None:
        write = appending(key, caller, batch, at, create=False, **options)
        await assert_refused(store, write, at, status)

    await refused([backwards, conflict], AppendStatus.ID_CONFLICT)
    await refused([big, backwards], AppendStatus.TURN_ORDER, max_messages=5, max_bytes=100)
    await refused([big, bigger], AppendStatus.TOO_MANY_MESSAGES, max_messages=5, max_bytes=100)
    # Another caller's conversation is refused before anything about its messages...
    other = appending(key, new_caller(), [backwards, conflict], at)
    await assert_refused(store, other, at, AppendStatus.OTHER_CALLER)
    # ...and before its status; an ended one refuses before its messages are looked at.
    claim = EndClaim(key, "explicit", "completed", None, at + MINUTE_MS)
    assert (await store.claim_end(claim, at)).status is ClaimStatus.CLAIMED
    await assert_refused(store, appending(key, new_caller(), [conflict], at), at, AppendStatus.OTHER_CALLER)
    await refused([backwards, conflict], AppendStatus.ENDED, max_messages=1)
    # An expired transcript is refused as expired, whatever its status.
    expired = t + RETENTION
    write = appending(key, caller, [conflict], expired, create=False)
    await assert_refused(store, write, expired, AppendStatus.EXPIRED)
    # A deleted one is refused as erased, before the caller is looked at.
    deleted = new_key()
    await append(store, deleted, caller, call[:4], t)
    assert await store.delete_conversation(deleted, at) is not None
    await assert_refused(store, appending(deleted, new_caller(), [conflict], at), at, AppendStatus.ERASED)


# Checkpoints and activity -------------------------------------------------------------------------------------


async def test_a_checkpoint_replaces_the_kept_one_unless_that_one_is_newer(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)

    def kept(result: AppendResult) -> tuple[bytes | None, int]:
        assert result.status is APPENDED and result.header is not None
        return result.header.checkpoint, result.header.checkpoint_at

    first = await append(store, key, caller, call[:2], t, checkpoint=state(step=1))
    assert kept(first) == (state(step=1), t) and first.header is not None
    # A checkpoint alone is activity.
    at = t + MINUTE_MS
    alone = await append(store, key, caller, [], at, create=False, checkpoint=state(step=2))
    expected = dataclasses.replace(advanced(first.header, at, []), checkpoint=state(step=2), checkpoint_at=at)
    assert (alone.status, alone.header, alone.added) == (APPENDED, expected, 0)

    # An older checkpoint arriving late (an outbox) does not replace it; its messages are appended.
    late = {"create": False, "checkpoint": state(step=0), "made_at": t + 30}
    later = t + 2 * MINUTE_MS
    result = await append(store, key, caller, call[2:4], later, **late)
    expected = advanced(expected, later, call[2:4])
    assert (result.status, result.header, result.added) == (APPENDED, expected, 2)
    assert kept(result) == (state(step=2), at)
    assert kept(await append(store, key, caller, [], later + 10, **late)) == (state(step=2), at)
    # Made at the same time as the kept one: not made after it, so it replaces it.
    same = await append(
        store, key, caller, [], later + 20, create=False, checkpoint=state(step=3), made_at=at
    )
    assert kept(same) == (state(step=3), at)
    # Messages without a checkpoint keep the kept one.
    more = await append(store, key, caller, call[4:], later + 30, create=False)
    assert kept(more) == (state(step=3), at)
    assert (await everything(store, key, later + 30))[0] == more.header


async def test_a_batch_that_adds_nothing_changes_nothing(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    first = await append(store, key, caller, call, t, checkpoint=state(a=1))
    at = t + 10 * MINUTE_MS
    for batch, create in (([], False), ([], True), (call, False), (call[2:3], True)):
        result = await append(store, key, caller, batch, at, create=create)
        assert (result.status, result.header, result.added) == (APPENDED, first.header, 0)
    assert await everything(store, key, at) == (first.header, stored(call))
    # Nor its inactivity due time, nor its expiry.
    assert await store.due_conversations(t + INACTIVITY, 10) == [key]
    header, messages = await everything(store, key, t + RETENTION)
    assert header is not None and header.expired(t + RETENTION) and messages == []


# Reads ------------------------------------------------------------------------------------------------------


async def test_reads_select_by_turn_last_and_limit(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)  # turns 1, 2, 2, 3, 3, 4
    await append(store, key, caller, call, t)
    everything_ = stored(call)

    async def read(**query: int) -> list[int]:
        header, messages = await store.read_conversation(key, t, TranscriptQuery(**query))
        assert header is not None and header.messages == 6
        assert all(m == everything_[m.seq] for m in messages)  # each as stored, at its position
        return [m.seq for m in messages]

    assert await read() == [0, 1, 2, 3, 4, 5]
    assert await read(after_turn=0) == [0, 1, 2, 3, 4, 5]
    assert await read(after_turn=1) == [1, 2, 3, 4, 5]
    assert await read(after_turn=2) == [3, 4, 5]
    assert await read(after_turn=4) == []
    assert await read(after_turn=99) == []
    assert await read(last=2) == [4, 5]
    assert await read(last=6) == [0, 1, 2, 3, 4, 5]
    assert await read(last=60) == [0, 1, 2, 3, 4, 5]
    assert await read(after_turn=1, last=3) == [3, 4, 5]
    assert await read(after_turn=3, last=3) == [5]  # the last 3 of those after turn 3: only one
    assert await read(limit=2) == [0, 1]
    assert await read(after_turn=1, limit=3) == [1, 2, 3]  # a page
    assert await read(after_turn=2, limit=10) == [3, 4, 5]
    assert await read(last=3, limit=3) == [3, 4, 5]
    assert await store.read_conversation(new_key(), t, TranscriptQuery(last=2)) == (None, [])


# Expiry -------------------------------------------------------------------------------------------------------


async def test_an_expired_transcript_is_remembered_until_its_header_is_forgotten(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    call = platform_call(t)
    await append(store, key, caller, call[:3], t, checkpoint=state(a=1))
    at = t + MINUTE_MS
    last = await append(store, key, caller, call[3:], at, create=False)
    expires, forget = at + RETENTION, at + REMEMBER
    assert last.header is not None and (last.header.expires_at, last.header.forget_at) == (expires, forget)

    header, messages = await everything(store, key, expires - 1)
    assert header == last.header and not header.expired(expires - 1) and messages == stored(call)
    # Expired at its expiry instant: the header says so, no message is returned.
    for now in (expires, forget - 1):
        header, messages = await everything(store, key, now)
        assert header is not None and header.expired(now)
        assert (header.key, header.status) == (key, OPEN)  # an expired transcript keeps its status
        assert (header.expires_at, header.forget_at) == (expires, forget)
        assert messages == []
        assert await store.read_conversation(key, now, TranscriptQuery(last=1)) == (header, [])
    # Appends to it are refused, created or not; nothing is written.
    extra = message(5, "Hello?", expires)
    for create in (False, True):
        write = appending(key, caller, [extra], expires, create=create, checkpoint=state(a=2))
        await assert_refused(store, write, expires, AppendStatus.EXPIRED)
        refused = await store.append_messages(write, expires)
        assert refused.header is not None and refused.header.expired(expires)
    # Forgotten at forget_at: as if it never existed.
    assert await everything(store, key, forget) == (None, [])
    assert await store.read_conversation(key, forget) == (None, [])
    result = await append(store, key, caller, [extra], forget, create=False)
    assert (result.status, result.header) == (AppendStatus.NOT_FOUND, None)
    # The id may then start a new conversation, which has nothing of the old one.
    again = await append(store, key, caller, [extra], forget)
    assert (again.status, again.header) == (APPENDED, opened(key, caller, forget, [extra]))
    assert await everything(store, key, forget) == (again.header, stored([extra]))


# Summaries --------------------------------------------------------------------------------------------------


async def test_a_summary_is_kept_but_is_not_activity(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    first = await append(store, key, caller, platform_call(t), t)
    assert first.header is not None
    summary = orjson.dumps({"text": "Caller asked for a joke, then a story.", "through_turn": 3, "tokens": 9})
    put = await store.put_summary(key, summary, t + MINUTE_MS)
    assert put == dataclasses.replace(first.header, summary=summary)  # last activity and expiries stay
    assert (await everything(store, key, t + MINUTE_MS))[0] == put
    replaced = await store.put_summary(key, b'{"text": "A story."}', t + 2 * MINUTE_MS)
    assert replaced == dataclasses.replace(first.header, summary=b'{"text": "A story."}')
    assert await store.due_conversations(t + INACTIVITY, 10) == [key]  # not rescheduled either

    # Not stored for what is not there, nor for another project's conversation of the same id.
    assert await store.put_summary(new_key(), summary, t) is None
    assert await store.put_summary(ConversationKey("bakery", key.conversation_id), summary, t) is None
    assert await everything(store, new_key(), t) == (None, [])
    # Nor once the transcript expired.
    assert await store.put_summary(key, summary, t + RETENTION) is None


# Contexts ---------------------------------------------------------------------------------------------------


async def test_a_context_read_brings_the_memory_of_the_conversations_caller_only(store: Store) -> None:
    caller, other, key, t = new_caller(), new_caller(), new_key(), now_ms()
    await append(store, key, caller, platform_call(t), t)
    later = t + 2 * MINUTE_MS
    gouda = StoredField(b'"gouda"', t + DAY_MS, t)
    await store.patch_fields(caller, {"cheese_type": gouda, "mood": StoredField(b'"ok"', later, t)}, [], t)
    await store.patch_fields(other, {"cheese_type": StoredField(b'"brie"', t + DAY_MS, t)}, [], t)
    query = TranscriptQuery(last=2)
    header, messages = await store.read_conversation(key, t, query)
    assert header is not None and len(messages) == 2

    # The hint is right: the transcript and that caller's live fields (the expired one left out).
    assert await store.read_context(key, caller.subject, t, query) == (
        header,
        messages,
        await store.read_fields(caller, t),
    )
    assert await store.read_context(key, caller.subject, later, query) == (
        header,
        messages,
        {"cheese_type": gouda},
    )
    assert await store.read_context(key, caller.subject, t) == (
        header,
        [],
        await store.read_fields(caller, t),
    )
    # The hint is another caller's, or there is none: the transcript alone, never the other caller's memory.
    assert await store.read_context(key, other.subject, t, query) == (header, messages, None)
    assert await store.read_context(key, None, t, query) == (header, messages, None)
    assert await store.read_context(key, "", t, query) == (header, messages, None)
    # A caller without memory has none (not None: nothing is to be read again).
    quiet, key2 = new_caller(), new_key()
    await append(store, key2, quiet, platform_call(t), t)
    assert (await store.read_context(key2, quiet.subject, t, query))[2] == {}

    # No such conversation (here, or in another project under the same id): nothing.
    assert await store.read_context(new_key(), caller.subject, t, query) == (None, [], None)
    elsewhere = ConversationKey("bakery", key.conversation_id)
    assert await store.read_context(elsewhere, caller.subject, t, query) == (None, [], None)
    # An expired transcript, or a deleted one (a marker): its header, no messages, no memory.
    expires = t + RETENTION
    header, messages, fields = await store.read_context(key, caller.subject, expires, query)
    assert header is not None and header.expired(expires) and (messages, fields) == ([], None)
    assert await store.delete_conversation(key, t) is not None
    header, messages, fields = await store.read_context(key, caller.subject, t, query)
    assert (
        header is not None and header.status is TranscriptStatus.DELETED and (messages, fields) == ([], None)
    )


# Concurrency --------------------------------------------------------------------------------------------------


async def test_concurrent_appends_all_land_in_distinct_positions(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    await append(store, key, caller, [], t)
    lines = [message(1, f"line {i}", t, message_id=f"m-{i}") for i in range(20)]
    results = await asyncio.gather(*(append(store, key, caller, [m], t + 1, create=False) for m in lines))
    assert [r.status for r in results] == [APPENDED] * 20 and sum(r.added for r in results) == 20
    header, messages = await everything(store, key, t + 1)
    assert [m.seq for m in messages] == list(range(20))
    assert sorted(m.body for m in messages) == sorted(m.body for m in lines)
    assert header is not None and (header.messages, header.bytes) == (20, sum(len(m.body) for m in lines))


async def test_concurrent_creating_appends_make_one_conversation(store: Store) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    hello = message(
        0, "Hello, this is the cheese shop.", t, role="assistant", source="greeting", message_id="m-0"
    )
    results = await asyncio.gather(*(append(store, key, caller, [hello], t) for _ in range(10)))
    assert [r.status for r in results] == [APPENDED] * 10
    assert sum(r.added for r in results) == 1  # one of them added it; the others found it there
    assert await everything(store, key, t) == (opened(key, caller, t, [hello]), stored([hello]))
    assert [h.key for h in await store.caller_conversations(caller, t)] == [key]
