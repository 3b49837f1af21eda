"""The call's last answer (SPEC section 16, "The transcript"): an answer is recorded from the next request,
which holds what was spoken of it; the last one, which no request follows, is kept and recorded at the
call's end (explicit or the service's), once, and never beside what a later request recorded of it. On every
backend, through a real server, with the official ``openai`` client."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from caller_memory.service.domain.conversations.pending import PendingAnswer
from caller_memory.service.domain.store.transcripts import ConversationKey
from caller_memory.service.http.app_keys import SERVICES
from caller_memory.service.http.proxy_routes import PROXY

from tests.proxy.conftest import BASE, CALLER, CONVERSATION, PROJECT, Shop
from tests.proxy.test_proxy import SYSTEM, history
from tests.proxy.upstream import COMPLETION

#: What the scripted upstream's stream says (tests/proxy/upstream.py EVENTS).
STREAMED = "Hello été"


async def settled(shop: Shop) -> None:
    """Wait for the proxy's writes off the answers' path (made once the answer's last byte is written: the
    client may have read it a moment before)."""
    proxy = shop.api.app[PROXY]
    await asyncio.sleep(0.05)
    for _ in range(100):
        if not proxy.writes:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the proxy's writes did not finish")


async def end(shop: Shop) -> dict[str, Any]:
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/{CONVERSATION}/end",
        token=shop.agent,
        json={"caller": CALLER, "state": {}},
    )
    assert reply.status == 200, reply.body
    body: dict[str, Any] = reply.body
    return body


async def test_the_last_streamed_answer_is_recorded_at_the_end_once(shop: Shop) -> None:
    client = shop.client()
    asked: Any = [*SYSTEM, {"role": "user", "content": "Do you have Brie?"}]
    stream = await client.chat.completions.create(model="m", messages=asked, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream]) == STREAMED
    await settled(shop)
    # Until the end, only what the request held: the answer waits for what the next request says of it.
    assert await history(shop, 1) == [{"role": "user", "content": "Do you have Brie?"}]
    await end(shop)
    expected = [{"role": "user", "content": "Do you have Brie?"}, {"role": "assistant", "content": STREAMED}]
    assert await history(shop, 2) == expected
    await end(shop)  # a retried end records nothing twice
    assert await history(shop, 3) == expected


async def test_an_answer_the_next_request_holds_is_not_recorded_again(shop: Shop) -> None:
    """Spoken whole (the same text back) or cut short (less of it), the answer is recorded from the next
    request; at the end only the newest answer is added."""
    client = shop.client()
    first: Any = [*SYSTEM, {"role": "user", "content": "Do you have Brie?"}]
    await client.chat.completions.create(model="m", messages=first, stream=True)
    await settled(shop)
    second: Any = [
        *first,
        {"role": "assistant", "content": STREAMED},
        {"role": "user", "content": "And Comté?"},
    ]
    await client.chat.completions.create(model="m", messages=second, stream=True)
    await settled(shop)
    # Cut short by the caller: the platform sends what was spoken.
    third: Any = [*second, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Stop."}]
    await client.chat.completions.create(model="m", messages=third, stream=True)
    await settled(shop)
    await end(shop)
    said = [(m["role"], m["content"]) for m in await history(shop, 6)]
    assert said == [
        ("user", "Do you have Brie?"),
        ("assistant", STREAMED),
        ("user", "And Comté?"),
        ("assistant", "Hello"),
        ("user", "Stop."),
        ("assistant", STREAMED),
    ]


async def test_a_whole_completion_is_kept_too_and_a_cut_one_is_not(shop: Shop) -> None:
    async def whole(request: web.Request) -> web.StreamResponse:
        return web.json_response(COMPLETION)

    async def cut(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"Half"}}]}\n\n')
        assert request.transport is not None
        request.transport.close()  # the upstream fails mid-answer: no [DONE]
        return response

    shop.up.answers += [whole, cut]
    client = shop.client()
    asked: Any = [*SYSTEM, {"role": "user", "content": "Which cheese?"}]
    answer = await client.chat.completions.create(model="m", messages=asked)
    assert answer.choices[0].message.content == "Cheddar."
    await settled(shop)
    again: Any = [*asked, {"role": "assistant", "content": "Cheddar."}, {"role": "user", "content": "Why?"}]
    try:
        stream = await client.chat.completions.create(model="m", messages=again, stream=True)
        async for _ in stream:
            pass
    except Exception:  # the client sees the cut answer as an error, or as an answer without its end
        pass
    await settled(shop)
    await end(shop)
    said = [(m["role"], m["content"]) for m in await history(shop, 3)]
    # The cut answer was never kept: "Cheddar." (recorded from the second request) is the last.
    assert said == [("user", "Which cheese?"), ("assistant", "Cheddar."), ("user", "Why?")]


async def test_the_services_end_records_it_and_an_erasure_drops_it(shop: Shop) -> None:
    services = shop.api.app[SERVICES]
    client = shop.client()
    await client.chat.completions.create(
        model="m", messages=[*SYSTEM, {"role": "user", "content": "My number is 415 555 0100."}], stream=True
    )
    await settled(shop)
    # Nobody ends the call: the inactivity end records the last answer.
    shop.api.clock.advance(6 * 3600)
    assert await services.lifecycle.run_inactivity_ends(services.projects) == 1
    said = [(m["role"], m["content"]) for m in await history(shop, 2)]
    assert said[-1] == ("assistant", STREAMED) and len(said) == 2
    assert "555" not in said[0][1]  # the caller's number never reached the transcript
    # Another call of the caller, then their erasure: the answer kept for it goes with everything else.
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/call-2/start",
        token=shop.agent,
        json={"caller": CALLER, "channel": "phone"},
    )
    assert reply.status == 200, reply.body
    await shop.client("call-2").chat.completions.create(
        model="m", messages=[*SYSTEM, {"role": "user", "content": "Hi."}], stream=True
    )
    await settled(shop)
    key = ConversationKey(PROJECT, "call-2")
    now = shop.api.clock.now_ms()
    kept = await services.store.take_pending_answer(key, now)
    assert kept is not None and STREAMED in orjson.loads(kept)["body"]
    await services.pending.keep(key, await subject_of(shop, "call-2"), PendingAnswer.decode(kept))
    reply = await shop.api.call("DELETE", f"{BASE}/callers/{CALLER}", token=shop.admin)
    assert reply.status == 200, reply.body
    assert await services.store.take_pending_answer(key, now) is None


async def subject_of(shop: Shop, conversation_id: str) -> str:
    services = shop.api.app[SERVICES]
    header, _ = await services.store.read_conversation(
        ConversationKey(PROJECT, conversation_id), shop.api.clock.now_ms()
    )
    assert header is not None
    return header.subject
