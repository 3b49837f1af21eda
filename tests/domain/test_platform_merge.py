"""A platform's end transcript over what the memory proxy recorded of the same call (SPEC 15 and 16): the
proxy records each turn from the platform's requests (its own ids), the platform's end brings the whole
call; stored together, nothing is there twice, and what the proxy could not see (the last answer) is added.
And the proxy's kept last answer is not added beside the platform's. On SQLite, Redis and Redis Cluster,
with the test adapter of tests/domain/test_platform_ingestion.py."""

from __future__ import annotations

from caller_memory.service.domain.conversations.messages import Message
from caller_memory.service.domain.conversations.pending import PendingAnswer
from caller_memory.service.domain.platforms.records import MAX_SPOKEN_BYTES
from caller_memory.service.domain.store.transcripts import ConversationKey

from tests.domain.test_platform_ingestion import TRANSCRIPT, FakeVoice, header_of
from tests.domain.test_platform_ingestion import store_url as store_url  # a fixture
from tests.domain.test_platform_ingestion import voice as voice  # a fixture


async def test_the_end_adds_only_what_the_proxy_did_not_record(voice: FakeVoice) -> None:
    started = await voice.start("m1")
    conversation = started.conversation_id
    voice.clock.advance(30)
    # The proxy's turns: the greeting and the caller's question (the answer is spoken after the request).
    proxy_turns = [
        {"message_id": "px-1", "role": "assistant", "content": "Cheese shop, how can I help?", "turn_id": 0},
        {"message_id": "px-2", "role": "user", "content": "Gouda for Friday please", "turn_id": 1},
    ]
    await voice.services.transcripts.append(voice.shop, conversation, {"messages": proxy_turns})
    # And the answer it streamed, kept for the call's end.
    key = ConversationKey("shop", conversation)
    message = await voice.services.transcripts.appends.encode_answer(
        voice.shop,
        key,
        {"message_id": "px-3", "role": "assistant", "content": "Gouda for Friday it is.", "turn_id": 1},
    )
    assert message is not None
    header, _ = await header_of(voice, conversation)
    await voice.services.pending.keep(key, header.subject, PendingAnswer(message, 1, voice.clock.now_ms()))
    voice.clock.advance(60)
    answer = await voice.end(conversation, transcript=TRANSCRIPT, summary="Booked gouda.")
    assert answer.outcome == "ended"
    header, messages = await header_of(voice, conversation)
    said = [Message(m.body).platform(header.started_at)["content"] for m in messages]
    assert said == ["Cheese shop, how can I help?", "Gouda for Friday please", "Gouda for Friday it is."]
    # The platform's message, not the proxy's kept one (which the platform's took the place of), and the kept
    # one is gone.
    assert messages[-1].message_id == "testvoice-end-3"
    assert await voice.services.store.take_pending_answer(key, voice.clock.now_ms()) is None


async def test_one_long_utterance_is_cut_and_never_refuses_the_end(voice: FakeVoice) -> None:
    started = await voice.start("m2")
    long = "Gouda, " * 4_000  # 28,000 bytes: more than a stored message may hold
    answer = await voice.end(started.conversation_id, transcript=[{"role": "user", "text": long}])
    assert answer.outcome == "ended"
    header, messages = await header_of(voice, started.conversation_id)
    (said,) = [Message(m.body).platform(header.started_at)["content"] for m in messages]
    assert long.startswith(said) and len(said.encode()) == MAX_SPOKEN_BYTES


async def test_an_end_whose_caller_is_no_number_is_ignored(voice: FakeVoice) -> None:
    answer = await voice.end("testvoice:anonymous", transcript=TRANSCRIPT, **{"from": "anonymous"})
    assert answer.outcome == "ignored"
    assert (await header_of(voice, "testvoice:anonymous"))[0] is None
