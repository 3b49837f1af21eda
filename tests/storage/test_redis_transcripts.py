"""What only the Redis backend's conversation memory has (service/storage/redis/transcripts.py), on a standalone
server and on a Redis Cluster: the key layout and its slots, the bytes a message costs, expiry by PEXPIREAT,
the caller's listing written before a creating append (so that an erasure in between wins), and a due index
that corrects its stale entries as it is read. The behaviour itself is the contract suite's
(test_transcripts.py, test_transcripts_lifecycle.py)."""

from __future__ import annotations

import random
import string
import uuid
from typing import Literal

import orjson
import redis.asyncio
from caller_memory.service.domain.clock import DAY_MS, HOUR_MS
from caller_memory.service.domain.conversations.messages import MAX_MESSAGES, MAX_TRANSCRIPT_BYTES
from caller_memory.service.domain.store import CallerRef, TokenRecord
from caller_memory.service.domain.store.transcripts import (
    AppendStatus,
    AppendWrite,
    ClaimResult,
    ClaimStatus,
    ConversationKey,
    EndClaim,
    NewMessage,
    TranscriptQuery,
    TranscriptStatus,
)
from caller_memory.service.storage.codec import decode_entry
from caller_memory.service.storage.redis import keys
from caller_memory.service.storage.redis.store import RedisStore
from caller_memory.service.storage.redis.transcripts import EXPIRED_DUE_GRACE_MS
from redis.crc import key_slot

from tests.storage.test_transcripts import (
    INACTIVITY,
    PROJECT,
    REMEMBER,
    RETENTION,
    append,
    appending,
    message,
    new_caller,
    new_key,
    now_ms,
    platform_call,
    state,
)
from tests.support.replies import raw, raws

Client = redis.asyncio.Redis | redis.asyncio.RedisCluster


def slot(key: str | bytes) -> int:
    return key_slot(key if isinstance(key, bytes) else key.encode())


async def test_a_conversations_keys_share_one_slot_and_nothing_else_is_written(
    redis_store: RedisStore, redis_client: Client
) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    await append(redis_store, key, caller, platform_call(t), t, checkpoint=state(a=1))
    assert await redis_store.put_summary(key, b'{"text": "s"}', t) is not None
    conversation = keys.transcript_keys(PROJECT, key.conversation_id)
    listing = keys.caller_transcripts_key(PROJECT, caller.subject)
    assert {slot(k) for k in conversation} == {slot(keys.transcript_header_key(PROJECT, key.conversation_id))}
    # The caller's listing is in the caller's slot (with their memory and tombstone), not the conversation's.
    assert slot(listing) == slot(keys.memory_key(PROJECT, caller.subject))
    assert slot(listing) == slot(keys.tombstone_key(PROJECT, caller.subject))
    # So are its indexes by start and by channel (redis_caller_index.py).
    index = keys.caller_index_keys(PROJECT, caller.subject)
    assert {slot(k) for k in index} == {slot(listing)}
    expected = {*conversation, *index, keys.TRANSCRIPTS_DUE, keys.transcript_volume_key(PROJECT)}
    assert {k.decode() for k in raws(await redis_client.keys("*"))} == expected
    # The pseudonym is in the header (whose conversation it is) and in its listing's (and indexes') names;
    # nowhere else.
    assert caller.subject.encode() in (await redis_client.hgetall(conversation[0]))[b"subject"]
    for name in expected - {*index, conversation[0]}:
        assert caller.subject.encode() not in name.encode()
        assert caller.subject.encode() not in await contents(redis_client, name)


async def contents(client: Client, name: str) -> bytes:
    """Everything a key holds, whatever its type."""
    kind = await client.type(name)
    if kind == b"string":
        return raw(await client.get(name))
    if kind == b"list":
        return b"".join(raws(await client.lrange(name, 0, -1)))
    if kind == b"hash":
        return b"".join(raw(k) + raw(v) for k, v in (await client.hgetall(name)).items())
    assert kind == b"zset", kind
    return b"".join(raws(await client.zrange(name, 0, -1)))


def spoken(turn: int, at: int) -> NewMessage:
    """A 100-character message with a UUID message id, as a platform sends them."""
    content = "".join(random.choices(string.ascii_letters + " ", k=100))
    role: Literal["user", "assistant"] = "user" if turn % 2 == 0 else "assistant"
    return message(turn // 2, content, at + turn, role=role, message_id=str(uuid.uuid4()))


async def test_a_stored_message_costs_at_most_300_bytes(
    redis_store: RedisStore, redis_client: Client
) -> None:
    """1000 messages of 100 characters (bodies of about 180 bytes, message ids of 36): Redis's own count of
    the memory of the list and its index, per message."""
    caller, key, t = new_caller(), new_key(), now_ms()
    messages = [spoken(i, t) for i in range(1000)]
    for start in range(0, len(messages), 10):
        result = await append(redis_store, key, caller, messages[start : start + 10], t)
        assert result.status is AppendStatus.APPENDED
    body = sum(len(m.body) for m in messages) / len(messages)
    assert 170 <= body <= 190
    _, listed, index, _ = keys.transcript_keys(PROJECT, key.conversation_id)
    list_bytes = await redis_client.memory_usage(listed, samples=0)
    index_bytes = await redis_client.memory_usage(index, samples=0)
    assert list_bytes is not None and index_bytes is not None
    used = list_bytes + index_bytes
    assert used / len(messages) <= 300, f"{used / len(messages):.0f} bytes per message"
    assert used / len(messages) <= body + 80
    # And every one of them reads back, at its position.
    header, stored = await redis_store.read_conversation(key, t, TranscriptQuery())
    assert header is not None and header.messages == 1000
    assert [(m.seq, m.body, m.message_id) for m in stored] == [
        (i, m.body, m.message_id) for i, m in enumerate(messages)
    ]


async def test_transcripts_expire_by_pexpireat_and_headers_at_forget_at(
    redis_store: RedisStore, redis_client: Client
) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    await append(redis_store, key, caller, platform_call(t), t, checkpoint=state(a=1))
    header, listed, index, data = keys.transcript_keys(PROJECT, key.conversation_id)
    listing = keys.caller_transcripts_key(PROJECT, caller.subject)
    for at in (t, t + 5 * 60_000):
        await append(redis_store, key, caller, [message(7, "More?", at)], at, create=False)
        for name in (listed, index, data):
            assert await redis_client.pexpiretime(name) == at + RETENTION
        assert await redis_client.pexpiretime(header) == at + REMEMBER
        assert await redis_client.pexpiretime(keys.transcript_volume_key(PROJECT)) == at + RETENTION
    # The listing covers the header: its horizon is twice the time left, so it is rarely written again.
    assert await redis_client.zscore(listing, key.conversation_id) == t + 2 * REMEMBER
    assert await redis_client.pexpiretime(listing) == t + 2 * REMEMBER
    # A deleted one keeps a marker until then, and nothing else.
    later = t + 10 * 60_000
    assert await redis_store.delete_conversation(key, later) is not None
    assert await redis_client.hgetall(header) == {
        b"status": b"deleted",
        b"expires_at": b"%d" % (t + 5 * 60_000 + RETENTION),
        b"forget_at": b"%d" % (t + 5 * 60_000 + REMEMBER),
    }
    assert await redis_client.pexpiretime(header) == t + 5 * 60_000 + REMEMBER
    assert await redis_client.exists(listed, index, data) == 0
    assert await redis_client.zscore(listing, key.conversation_id) is None


def long_lived(key: ConversationKey, caller: CallerRef, at: int, messages: list[NewMessage]) -> AppendWrite:
    """An append whose transcript lives 10 days and whose header 12 (horizon: twice the 12 days left)."""
    return AppendWrite(
        key, caller, "voice", "", True, messages, None, at, at + 10 * DAY_MS, at + 12 * DAY_MS,
        at + INACTIVITY, MAX_MESSAGES, MAX_TRANSCRIPT_BYTES,
    )  # fmt: skip


async def test_the_callers_listing_is_extended_before_the_header_outlives_it(
    redis_store: RedisStore, redis_client: Client
) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    listing = keys.caller_transcripts_key(PROJECT, caller.subject)
    for at, horizon in (
        (t, t + 24 * DAY_MS),
        (t + 9 * DAY_MS, t + 24 * DAY_MS),
        (t + 13 * DAY_MS, t + 37 * DAY_MS),
    ):
        result = await redis_store.append_messages(long_lived(key, caller, at, [message(1, "Hi", at)]), at)
        assert result.status is AppendStatus.APPENDED
        assert result.header is not None and result.header.forget_at <= horizon
        assert await redis_client.zscore(listing, key.conversation_id) == horizon
    # A listing's entries whose horizon passed are dropped when the caller's next conversation is listed.
    await redis_client.zadd(listing, {"call-forgotten": t + 1})
    await append(redis_store, new_key(), caller, [], t + 2)
    assert await redis_client.zscore(listing, "call-forgotten") is None


async def test_an_erasure_between_listing_and_writing_leaves_the_marker_the_append_finds(
    redis_store: RedisStore, redis_client: Client
) -> None:
    """A creating append lists the conversation among its caller's, then writes it: an erasure that runs in
    between (here: forced in between) finds it, and the append that follows writes nothing."""
    caller, key, t = new_caller(), new_key(), now_ms()
    write = appending(key, caller, platform_call(t), t, checkpoint=state(a=1))
    horizon = t + 2 * REMEMBER
    assert await redis_store._register(write, caller.subject, horizon, True, t) == b""
    erased = await redis_store.erase_caller(caller, t + 1, t + DAY_MS)
    assert erased.transcripts == 0  # nothing was written yet
    header, messages = await redis_store.read_conversation(key, t + 2, TranscriptQuery())
    assert header is not None and (header.status, header.subject, header.forget_at) == (
        TranscriptStatus.ERASED,
        "",
        horizon,
    )
    assert messages == []
    result = await redis_store.append_messages(write, t + 2)
    assert (result.status, result.added) == (AppendStatus.ERASED, 0)
    assert await redis_client.exists(*keys.transcript_keys(PROJECT, key.conversation_id)[1:]) == 0
    # The due entry the creation wrote first is found stale and removed.
    assert await redis_store.due_conversations(t + INACTIVITY, 10) == []
    assert (
        await redis_client.zscore(keys.TRANSCRIPTS_DUE, keys.due_member(PROJECT, key.conversation_id)) is None
    )


async def test_an_erasure_leaves_alone_a_reused_id_of_another_caller(
    redis_store: RedisStore, redis_client: Client
) -> None:
    first, second, key, t = new_caller(), new_caller(), new_key(), now_ms()
    await append(redis_store, key, first, platform_call(t), t)
    forgotten = t + REMEMBER  # the id is free again: another caller starts a conversation under it
    reused = await append(redis_store, key, second, platform_call(forgotten), forgotten)
    assert reused.status is AppendStatus.APPENDED
    erased = await redis_store.erase_caller(first, forgotten + 1, forgotten + DAY_MS)
    assert erased.transcripts == 0
    assert (await redis_store.read_conversation(key, forgotten + 1))[0] == reused.header
    member = keys.due_member(PROJECT, key.conversation_id)
    assert await redis_client.zscore(keys.TRANSCRIPTS_DUE, member) == forgotten + INACTIVITY


async def test_stale_due_entries_are_corrected_as_they_are_read(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    due = keys.TRANSCRIPTS_DUE
    # An entry of a conversation that was never written (a creation that failed after listing it).
    ghost = keys.due_member(PROJECT, "call-ghost")
    await redis_client.zadd(due, {ghost: t})
    # An entry earlier than its header says (a crash between a reschedule's two writes).
    moved = (await append(redis_store, new_key(), new_caller(), platform_call(t), t)).header
    assert moved is not None
    moved_member = keys.due_member(PROJECT, moved.key.conversation_id)
    await redis_client.zadd(due, {moved_member: t + 1})
    assert await redis_store.due_conversations(t + 10, 10) == []
    assert await redis_client.zscore(due, ghost) is None
    assert await redis_client.zscore(due, moved_member) == t + INACTIVITY
    assert await redis_store.due_conversations(t + INACTIVITY, 10) == [moved.key]

    # An open conversation whose transcript expired can no longer be claimed: due for a grace period after
    # its expiry, then not before its header is forgotten.
    expires = t + RETENTION
    assert await redis_store.due_conversations(expires, 10) == [moved.key]
    assert await redis_store.due_conversations(expires + EXPIRED_DUE_GRACE_MS - 1, 10) == [moved.key]
    assert await redis_store.due_conversations(expires + EXPIRED_DUE_GRACE_MS, 10) == []
    assert await redis_client.zscore(due, moved_member) == t + REMEMBER
    assert await redis_store.due_conversations(t + REMEMBER, 10) == [moved.key]


async def test_a_due_index_write_in_between_wins_over_a_correction(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    member = keys.due_member(PROJECT, "call-x")
    await redis_client.zadd(keys.TRANSCRIPTS_DUE, {member: t + 5})
    changed = await redis_store._script("transcript_due_index", [keys.TRANSCRIPTS_DUE], [member, t, ""])
    assert changed == 0 and await redis_client.zscore(keys.TRANSCRIPTS_DUE, member) == t + 5
    changed = await redis_store._script(
        "transcript_due_index", [keys.TRANSCRIPTS_DUE], [member, t + 5, t + 9]
    )
    assert changed == 1 and await redis_client.zscore(keys.TRANSCRIPTS_DUE, member) == t + 9


async def test_a_projects_bytes_keep_only_the_hours_still_counted(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    hour = t - t % HOUR_MS
    volume = keys.transcript_volume_key(PROJECT)
    first = await append(redis_store, new_key(), new_caller(), platform_call(t), t)
    assert first.header is not None
    assert await redis_client.hgetall(volume) == {b"%d" % hour: b"%d" % first.header.bytes}
    # Two days later (a retention of one day), a new hour starts: the first is no longer counted, and goes.
    later = t + 2 * DAY_MS
    second = await append(redis_store, new_key(), new_caller(), platform_call(later), later)
    assert second.header is not None
    assert await redis_client.hgetall(volume) == {
        b"%d" % (later - later % HOUR_MS): b"%d" % second.header.bytes
    }
    assert await redis_store.transcript_bytes(PROJECT, later, later - RETENTION) == second.header.bytes


async def test_records_of_earlier_releases_read_with_their_defaults(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    await redis_store.put_token(
        TokenRecord("tok-old", PROJECT, "agent", bytes(32), t, "old", agent="billing")
    )
    await redis_client.hdel(keys.token_key("tok-old"), "agent")  # as an earlier release stored it
    old = await redis_store.get_token("tok-old")
    assert old is not None and old.agent == ""
    # An analytics entry stored before ended_by and end_reason existed.
    entry = {"conversation_id": "c1", "hour": 0, "channel": None, "qa": None, "handoff_reason": None,
             "handoff_to": None, "first": None}  # fmt: skip
    decoded = decode_entry(orjson.dumps(entry))
    assert (decoded.ended_by, decoded.end_reason) == ("explicit", None)


async def test_an_erasure_cut_short_is_finished_by_its_retry(
    redis_store: RedisStore, redis_client: Client
) -> None:
    """The caller's listing is read with the tombstone written, and emptied only once every conversation is a
    marker: an erasure that stops in between (here: its first step alone) leaves what its retry needs."""
    caller, t = new_caller(), now_ms()
    live = await append(redis_store, new_key(), caller, platform_call(t), t)
    assert live.header is not None
    project, subject = caller.project, caller.subject
    listing = keys.caller_transcripts_key(project, subject)
    await redis_store._transport.script(
        "erase",
        [
            keys.memory_key(project, subject),
            keys.caller_index_key(subject),
            keys.first_interaction_key(project, subject),
            keys.caller_conversations_key(project, subject),
            keys.tombstone_key(project, subject),
            listing,
        ],
        [keys.index_member(project, subject), keys.conversation_record_prefix(project, subject), t + 1,
         t + DAY_MS, subject],
    )  # fmt: skip
    assert await redis_client.zrange(listing, 0, -1) == [live.header.key.conversation_id.encode()]
    retry = await redis_store.erase_caller(caller, t + 2, t + DAY_MS)
    assert retry.transcripts == 1
    header, _ = await redis_store.read_conversation(live.header.key, t + 2)
    assert header is not None and header.status is TranscriptStatus.ERASED
    assert await redis_client.exists(listing) == 0


async def test_a_claim_that_finds_the_transcript_expired_drops_its_due_entry(
    redis_store: RedisStore, redis_client: Client
) -> None:
    t = now_ms()
    key = new_key()
    await append(redis_store, key, new_caller(), platform_call(t), t)
    member = keys.due_member(PROJECT, key.conversation_id)
    claim = EndClaim(key, "inactivity", "", t + RETENTION - INACTIVITY, t + RETENTION + 60_000)
    assert (await redis_store.claim_end(claim, t + RETENTION)) == ClaimResult(ClaimStatus.MISSING, None)
    assert await redis_client.zscore(keys.TRANSCRIPTS_DUE, member) is None
    # What is not there at all leaves the index alone (a creation may be on its way: it indexed itself first).
    await redis_client.zadd(keys.TRANSCRIPTS_DUE, {keys.due_member(PROJECT, "call-coming"): t + INACTIVITY})
    coming = EndClaim(ConversationKey(PROJECT, "call-coming"), "explicit", "", None, t + 60_000)
    assert (await redis_store.claim_end(coming, t)).status is ClaimStatus.MISSING
    assert (
        await redis_client.zscore(keys.TRANSCRIPTS_DUE, keys.due_member(PROJECT, "call-coming"))
        == t + INACTIVITY
    )


async def test_a_creating_append_says_when_its_caller_has_no_other_conversation(
    redis_store: RedisStore,
) -> None:
    """``alone`` lets the domain skip the read of the caller's conversations (nothing to supersede); it is
    never True when there is another one (a backend may always say False: a cluster lists in two steps)."""
    caller, t = new_caller(), now_ms()
    first = await append(redis_store, new_key(), caller, [message(1, "a", t)], t)
    second = await append(redis_store, new_key(), caller, [message(1, "b", t)], t)
    again = await append(redis_store, new_key(), new_caller(), [message(1, "c", t)], t)
    assert first.status is second.status is AppendStatus.APPENDED
    assert second.alone is False
    assert first.alone is again.alone  # the same answer for each caller's first conversation
    if not redis_store._cluster:
        assert first.alone is True  # one server lists the conversation in the append's own step


async def test_a_creating_append_for_a_caller_erased_since_writes_nothing(redis_store: RedisStore) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    await redis_store.erase_caller(caller, t, t + DAY_MS)
    refused = await append(redis_store, key, caller, [message(1, "late", t - 1)], t, made_at=t - 1)
    assert refused.status is AppendStatus.ERASED and refused.header is None
    header, messages = await redis_store.read_conversation(key, t)
    assert header is None and messages == []
    listed = await redis_store.caller_conversations(caller, t)
    assert listed == []
