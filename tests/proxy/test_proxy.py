"""The memory proxy (SPEC section 16) through a real server, with the official ``openai`` client, to models on
loopback: the bytes pass unchanged and at once, a gone client closes the upstream, upstream errors pass, the
memory message is one, placed after the system messages and fresh, the transcript is recorded once, and
nothing fails for memory (a store that does not answer, a project at its stream bound)."""

from __future__ import annotations

import asyncio
import io
import time
from typing import Any

import openai
import orjson
import pytest
from caller_memory.sdk.testing import ScriptedModel
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.http.app_keys import SERVICES

from tests.conftest import OPERATOR_TOKEN, TEST_NUMBERS, canonical_digits, running_api
from tests.proxy.conftest import (
    BASE,
    CALLER,
    CONVERSATION,
    PROJECT,
    UPSTREAM_KEY,
    Shop,
    open_shop,
    proxy_settings,
)
from tests.proxy.upstream import EVENTS, events, flood, gzipped, silent, status, upstream

SYSTEM: Any = [{"role": "system", "content": "You sell cheese."}, {"role": "system", "content": "Be brief."}]
#: What Vapi, Agora and ElevenLabs add to a request, with the caller's number in it.
PLATFORM_METADATA: dict[str, Any] = {
    "call": {"id": "vapi-call", "customer": {"number": CALLER}},
    "customer": {"number": CALLER},
    "phoneNumber": {"number": "+14155550199"},
    "metadata": {"caller": CALLER},
    "context": {"appId": "a", "userId": "42", "channel": "room-1"},
    "turn_id": 3,
    "timestamp": 1_800_000_000_000,
    "interruptable": True,
    "elevenlabs_extra_body": {"number": CALLER},
    "user_id": CALLER,
    "user": CALLER,
}


def question(text: str = "Which cheese did I like?") -> Any:
    return [*SYSTEM, {"role": "user", "content": text}]


async def history(shop: Shop, expected: int) -> list[dict[str, Any]]:
    """The conversation's messages once it holds ``expected`` (the proxy records off the answer's path)."""
    deadline = time.monotonic() + 5
    while True:
        reply = await shop.api.call(
            "GET", f"{BASE}/conversations/{CONVERSATION}/history?format=openai", token=shop.agent
        )
        assert reply.status == 200, reply.body
        messages: list[dict[str, Any]] = reply.body["messages"]
        if len(messages) >= expected or time.monotonic() > deadline:
            return messages
        await asyncio.sleep(0.02)


def memory_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in body["messages"] if m.get("name") == "caller_memory"]


async def test_the_stream_passes_byte_for_byte_with_one_memory_message_and_no_metadata(shop: Shop) -> None:
    await shop.remember(caller_name="Ada", cheese="Stilton")
    earlier = {"role": "system", "name": "caller_memory", "content": "stale memory of an earlier turn"}
    messages = [
        *SYSTEM,
        earlier,
        {"role": "user", "content": "Hello", "turn_id": 1, "metadata": {"user": "42"}},
    ]
    client = shop.client()
    async with client.chat.completions.with_streaming_response.create(
        model="gpt-4o-mini",
        messages=messages,
        stream=True,
        extra_body=PLATFORM_METADATA,
    ) as response:
        assert response.headers["x-caller-memory"] == "bound"
        received = b"".join([chunk async for chunk in response.iter_bytes()])
    assert received == b"".join(EVENTS)

    (got,) = shop.up.got
    sent = got.document
    # One memory message, after the leading system messages, holding the caller's fields as data.
    (memory,) = memory_messages(sent)
    assert sent["messages"][:2] == SYSTEM
    assert sent["messages"][2] == memory and memory["role"] == "system"
    assert '"caller_name":"Ada"' in memory["content"] and '"cheese":"Stilton"' in memory["content"]
    assert "stale memory" not in got.body.decode()
    assert sent["messages"][3] == {"role": "user", "content": "Hello"}  # its extensions went
    # No platform metadata, no user, no number: in the body or the headers.
    assert not set(PLATFORM_METADATA) & set(sent)
    assert sent["model"] == "gpt-4o-mini" and sent["stream"] is True
    everything = got.body.decode() + repr(got.headers)
    assert not TEST_NUMBERS.search(canonical_digits(everything))
    assert got.headers["Authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert got.headers["Accept-Encoding"] == "identity"
    assert shop.agent not in everything
    assert "X-Caller-Memory-Conversation" not in got.headers


async def test_the_openai_client_streams_from_a_scripted_model_with_the_configured_model(
    store_url: str, clock: FakeClock
) -> None:
    async with (
        ScriptedModel(["Stilton, as last time.", "Anything else?"]) as model,
        running_api(store_url, clock, **proxy_settings()) as api,
    ):
        up = type("U", (), {"url": model.base_url})()
        shop = await open_shop(api, up, model="cheese-model")
        try:
            await shop.remember(cheese="Stilton")
            stream = await shop.client().chat.completions.create(
                model="platform-model",
                messages=question(),
                stream=True,
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text == "Stilton, as last time."
            assert model.last_request.body["model"] == "cheese-model"
            assert len(memory_messages(model.last_request.body)) == 1
            # Not streamed: one chat.completion.
            done = await shop.client().chat.completions.create(model="m", messages=question("Thanks"))
            assert done.choices[0].message.content == "Anything else?"
        finally:
            await shop.close()


async def test_an_event_reaches_the_client_while_the_upstream_pauses(shop: Shop) -> None:
    shop.up.answers.append(events(pause=1.0, up=shop.up))
    async with shop.client().chat.completions.with_streaming_response.create(
        model="m",
        messages=question(),
        stream=True,
    ) as response:
        chunks = response.iter_bytes()
        first = await chunks.__anext__()
        got_at = time.monotonic()
        assert first.startswith(EVENTS[0][:20])
        assert got_at - shop.up.sent_at[0] < 0.05
        rest = b"".join([c async for c in chunks])
    assert first + rest == b"".join(EVENTS)


async def test_a_client_that_goes_closes_the_upstream_within_100_ms(shop: Shop) -> None:
    hold = asyncio.Event()
    shop.up.answers.append(events(hold=hold, up=shop.up))
    async with shop.client().chat.completions.with_streaming_response.create(
        model="m",
        messages=question(),
        stream=True,
    ) as response:
        chunks = response.iter_bytes()
        await chunks.__anext__()
        gone_at = time.monotonic()
    async with asyncio.timeout(2):
        await shop.up.closed.wait()
    assert shop.up.cancelled_at, "the upstream connection stayed open"
    assert shop.up.cancelled_at[0] - gone_at < 0.1
    hold.set()


async def test_a_client_that_goes_before_the_upstream_answers_closes_it_within_100_ms(shop: Shop) -> None:
    hold = asyncio.Event()
    shop.up.answers.append(silent(hold))
    with pytest.raises(openai.APITimeoutError):
        await shop.client(timeout=0.3).chat.completions.create(model="m", messages=question())
    gone_at = time.monotonic()
    async with asyncio.timeout(2):
        await shop.up.closed.wait()
    assert shop.up.cancelled_at[0] - gone_at < 0.1
    hold.set()


async def test_upstream_errors_pass_and_an_unreachable_upstream_is_an_openai_shaped_502(shop: Shop) -> None:
    shop.up.answers += [status(429, {"Retry-After": "7"}), status(500), gzipped()]
    client = shop.client()
    with pytest.raises(openai.RateLimitError) as limited:
        await client.chat.completions.create(model="m", messages=question())
    assert limited.value.status_code == 429
    assert limited.value.response.headers["retry-after"] == "7"
    assert limited.value.body == {"message": "upstream says 429", "type": "x", "code": None}
    with pytest.raises(openai.InternalServerError) as failed:
        await client.chat.completions.create(model="m", messages=question())
    assert failed.value.status_code == 500
    # A gzip-encoded answer (though identity was asked for) reaches the client as sent, and decodes.
    done = await client.chat.completions.create(model="m", messages=question())
    assert done.choices[0].message.content == "Cheddar."
    # An upstream nobody listens on.
    reply = await shop.api.call(
        "PUT", BASE + "/llm", token=shop.admin, json={"base_url": "http://127.0.0.1:9/v1", "api_key": "k"}
    )
    assert reply.status == 200, reply.body
    with pytest.raises(openai.APIStatusError) as refused:
        await client.chat.completions.create(model="m", messages=question())
    assert refused.value.status_code == 502
    assert refused.value.body == {
        "message": "the upstream model could not be reached",
        "type": "upstream_error",
        "code": "upstream_unreachable",
    }


async def test_a_turn_sent_twice_is_recorded_once(shop: Shop) -> None:
    client = shop.client()
    first: Any = [*SYSTEM, {"role": "user", "content": "Do you have Brie?"}]
    await client.chat.completions.create(model="m", messages=first)
    await client.chat.completions.create(model="m", messages=first)
    assert await history(shop, 1) == [{"role": "user", "content": "Do you have Brie?"}]
    second: Any = [*first, {"role": "assistant", "content": "We do."}, {"role": "user", "content": "Great."}]
    await client.chat.completions.create(model="m", messages=second)
    expected = [m for m in second if m["role"] != "system"]
    assert await history(shop, 3) == expected
    # Another process (no memory of what was recorded) sends the same turn: the store keeps it once.
    async with running_api(shop.api.settings.store_url, shop.api.clock, **proxy_settings()) as other:
        reply = await other.call(
            "POST",
            BASE + "/llm/chat/completions",
            token=shop.agent,
            json={"model": "m", "messages": second},
            headers={"X-Caller-Memory-Conversation": CONVERSATION},
        )
        assert reply.status == 200
        await asyncio.sleep(0.2)
    assert await history(shop, 4) == expected


async def test_a_write_through_another_process_reaches_the_next_completion(
    store_url: str, clock: FakeClock
) -> None:
    async with (
        upstream() as up,
        running_api(store_url, clock, **proxy_settings(read_cache_seconds=1.0)) as api,
        running_api(store_url, clock, **proxy_settings(read_cache_seconds=1.0)) as other,
    ):
        shop = await open_shop(api, up)
        try:
            await shop.remember(cheese="Stilton")
            client = shop.client()
            await client.chat.completions.create(model="m", messages=question())
            assert "Stilton" in memory_messages(up.got[-1].document)[0]["content"]
            reply = await other.call(
                "PATCH", f"{BASE}/callers/{CALLER}/memory", token=shop.admin, json={"cheese": "Comté"}
            )
            assert reply.status == 200
            await client.chat.completions.create(model="m", messages=question())
            (memory,) = memory_messages(up.got[-1].document)
            assert "Comté" in memory["content"] and "Stilton" not in memory["content"]
        finally:
            await shop.close()


@pytest.mark.parametrize("store_url", ["redis"], indirect=True)
async def test_a_store_that_does_not_answer_gives_a_completion_without_memory(
    shop: Shop, redis_server: Any
) -> None:
    await shop.remember(cheese="Stilton")
    client = shop.client()
    await client.chat.completions.create(model="m", messages=question())
    assert memory_messages(shop.up.got[-1].document)
    with redis_server.client() as direct:
        direct.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    started = time.monotonic()
    response = await client.chat.completions.with_raw_response.create(model="m", messages=question())
    assert time.monotonic() - started < 1.0
    assert response.headers["x-caller-memory"] == "unavailable"
    assert memory_messages(shop.up.got[-1].document) == []
    await asyncio.sleep(1.6)  # the pause ends before the next test


async def test_a_project_at_its_stream_bound_still_gets_completions_without_memory(
    store_url: str, clock: FakeClock
) -> None:
    async with (
        upstream() as up,
        running_api(store_url, clock, **proxy_settings(max_streams_per_project=1)) as api,
    ):
        shop = await open_shop(api, up)
        try:
            await shop.remember(cheese="Stilton")
            hold = asyncio.Event()
            up.answers.append(events(hold=hold))
            async with shop.client().chat.completions.with_streaming_response.create(
                model="m",
                messages=question(),
                stream=True,
            ) as held:
                assert held.headers["x-caller-memory"] == "bound"
                response = await shop.client().chat.completions.with_raw_response.create(
                    model="m",
                    messages=question(),
                )
                assert response.status_code == 200
                assert response.headers["x-caller-memory"] == "unavailable"
                assert memory_messages(up.got[-1].document) == []
                hold.set()
            metrics = (await api.call("GET", "/metrics")).body
            assert 'caller_memory_proxy_completions_total{memory="unavailable"} 1.0' in metrics
        finally:
            await shop.close()


async def test_unbound_requests_go_without_memory_and_a_malformed_binding_is_refused(shop: Shop) -> None:
    await shop.remember(cheese="Stilton")
    for conversation in (None, "never-started"):
        response = await shop.client(conversation).chat.completions.with_raw_response.create(
            model="m",
            messages=question(),
        )
        assert response.headers["x-caller-memory"] == "unbound"
        assert memory_messages(shop.up.got[-1].document) == []
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        await shop.client("no spaces allowed").chat.completions.create(model="m", messages=question())
    assert "X-Caller-Memory-Conversation" in str(refused.value.body)
    reply = await shop.api.call(
        "POST", BASE + "/llm/chat/completions", token=shop.agent, json={"model": "m", "messages": "hi"}
    )
    assert reply.status == 422 and "messages" in reply.body["detail"]
    assert len(shop.up.got) == 2  # nothing refused went upstream (the platform token's comes below)
    # An admin-only configuration is refused to the agent; a platform token completes too, an analytics
    # token does not.
    assert (await shop.api.call("GET", BASE + "/llm", token=shop.agent)).status == 403
    completion = {"model": "m", "messages": question()}
    platform, analytics = await shop.api.mint(PROJECT, "platform"), await shop.api.mint(PROJECT, "analytics")
    reply = await shop.api.call("POST", BASE + "/llm/chat/completions", token=platform, json=completion)
    assert reply.status == 200 and reply.headers["X-Caller-Memory"] == "unbound"
    reply = await shop.api.call("POST", BASE + "/llm/chat/completions", token=analytics, json=completion)
    assert reply.status == 403 and "agent" in reply.body["detail"]


async def test_one_projects_hung_upstream_does_not_hold_another_project(shop: Shop) -> None:
    hold = asyncio.Event()
    shop.up.answers += [events(hold=hold), events(hold=hold), events(hold=hold)]
    client = shop.client()
    hung: list[Any] = [
        asyncio.create_task(client.chat.completions.create(model="m", messages=question(), stream=True))
        for _ in range(3)
    ]
    async with upstream() as other_up:
        assert (await shop.api.call("PUT", "/v1/projects/deli", token=OPERATOR_TOKEN, json={})).status in (
            200,
            201,
        )
        admin, agent = await shop.api.mint("deli", "admin"), await shop.api.mint("deli", "agent")
        reply = await shop.api.call(
            "PUT", "/v1/projects/deli/llm", token=admin, json={"base_url": other_up.url, "api_key": "k"}
        )
        assert reply.status == 201
        started = time.monotonic()
        reply = await shop.api.call(
            "POST",
            "/v1/projects/deli/llm/chat/completions",
            token=agent,
            json={"model": "m", "messages": question()},
        )
        assert reply.status == 200
        assert time.monotonic() - started < 0.5
    hold.set()
    for task in hung:
        await (await task).close()


async def test_the_upstream_is_configured_by_an_admin_and_its_key_never_shown(shop: Shop) -> None:
    reply = await shop.api.call("GET", BASE + "/llm", token=shop.admin)
    assert reply.status == 200
    assert reply.body["api_key_set"] is True and reply.body["base_url"] == shop.up.url
    assert UPSTREAM_KEY not in orjson.dumps(reply.body).decode()
    stored = await shop.api.app[SERVICES].store.get_llm(PROJECT)
    assert stored is not None and UPSTREAM_KEY.encode() not in stored
    for bad, mentions in (
        ({"base_url": "http://models.example/v1", "api_key": "k"}, "https"),
        ({"base_url": "https://10.0.0.7/v1", "api_key": "k"}, "base_url"),
        ({"base_url": "https://models.example/v1", "api_key": ""}, "api_key"),
        ({"base_url": "https://models.example/v1", "api_key": "k", "timeout": 0}, "timeout"),
        ({"base_url": "https://models.example/v1", "api_key": "k", "extra": 1}, "extra"),
    ):
        reply = await shop.api.call("PUT", BASE + "/llm", token=shop.admin, json=bad)
        assert reply.status == 422, (bad, reply.body)
        assert mentions in orjson.dumps(reply.body).decode()
    assert (await shop.api.call("GET", BASE + "/llm", token=shop.admin)).body["base_url"] == shop.up.url
    audit = (await shop.api.call("GET", BASE + "/audit", token=shop.admin)).body
    assert "llm.set" in orjson.dumps(audit).decode() and UPSTREAM_KEY not in orjson.dumps(audit).decode()
    assert (await shop.api.call("DELETE", BASE + "/llm", token=shop.admin)).status == 204
    assert (await shop.api.call("GET", BASE + "/llm", token=shop.admin)).status == 404
    assert (await shop.api.call("DELETE", BASE + "/llm", token=shop.admin)).status == 404
    reply = await shop.api.call(
        "POST", BASE + "/llm/chat/completions", token=shop.agent, json={"model": "m", "messages": question()}
    )
    assert reply.status == 404


async def test_a_slow_client_pauses_the_upstream(shop: Shop) -> None:
    """A client that stops reading: the upstream's writes stop soon after (what is in flight is the sockets'
    and the proxy's bounded buffers), not the whole answer read into the proxy; then it all arrives."""
    total = 128 * 1024 * 1024
    shop.up.answers.append(flood(total, shop.up))
    path = BASE + "/llm/chat/completions"
    headers = {"Authorization": f"Bearer {shop.agent}", "X-Caller-Memory-Conversation": CONVERSATION}
    body = {"model": "m", "messages": question(), "stream": True}
    async with shop.api.session.post(shop.api.base_url + path, json=body, headers=headers) as response:
        assert response.status == 200
        received = len(await response.content.readany())
        await asyncio.sleep(1.0)  # not reading
        held = shop.up.written
        await asyncio.sleep(0.5)
        assert shop.up.written == held, "the upstream kept writing to a client that does not read"
        assert held < 48 * 1024 * 1024, held  # about 12 MiB on loopback: the kernel's socket buffers
        async for chunk in response.content.iter_any():
            received += len(chunk)
    assert received == total


async def test_a_long_history_is_taken_up_to_4_mib(shop: Shop) -> None:
    """Platforms send the whole call at every turn: far more than the API's other bodies may hold."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": "x" * 1000} for i in range(300)]
    path = BASE + "/llm/chat/completions"
    reply = await shop.api.call("POST", path, token=shop.agent, json={"model": "m", "messages": turns})
    assert reply.status == 200
    assert len(shop.up.got[-1].body) > 300_000
    huge = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]})
    headers = {"Authorization": f"Bearer {shop.agent}", "Content-Type": "application/json"}
    async with shop.api.session.post(
        shop.api.base_url + path, data=io.BytesIO(huge), headers=headers
    ) as refused:
        assert refused.status == 413
    assert len(shop.up.got) == 1


async def test_agoras_turn_metadata_is_kept_in_the_transcript(shop: Shop) -> None:
    """With Agora's turn metadata, a message keeps its turn and source, and an assistant message interrupted
    in one turn is recorded from the next turn's request with what was meant to be said; nothing of it goes
    upstream."""
    joke = "Why did the scarecrow win an award? Because he was outstanding in his field!"
    messages: Any = [
        *SYSTEM,
        {"role": "assistant", "content": "How can I help?", "turn_id": 1, "metadata": {"source": "greeting"}},
        {
            "role": "user",
            "content": "Tell me a joke.",
            "turn_id": 2,
            "metadata": {"source": "asr", "user": "7"},
        },
        {
            "role": "assistant",
            "content": "Why did the scarecrow ",
            "turn_id": 2,
            "metadata": {"source": "llm", "interrupted": True, "original": joke, "interrupt_timestamp": 5},
        },
        {"role": "user", "content": "A story instead.", "turn_id": 3, "metadata": {"source": "asr"}},
    ]
    client = shop.client()
    await client.chat.completions.create(model="m", messages=messages, extra_body={"turn_id": 3})
    await client.chat.completions.create(model="m", messages=messages, extra_body={"turn_id": 3})
    sent = shop.up.got[-1].document
    assert all(set(m) <= {"role", "content", "name"} for m in sent["messages"]), sent["messages"]
    assert "turn_id" not in sent
    await history(shop, 4)
    reply = await shop.api.call("GET", f"{BASE}/conversations/{CONVERSATION}/history", token=shop.agent)
    stored = reply.body["contents"]
    assert [(m["role"], m["turn_id"], m["metadata"].get("source")) for m in stored] == [
        ("assistant", 1, "greeting"),
        ("user", 2, "asr"),
        ("assistant", 2, "llm"),
        ("user", 3, "asr"),
    ]
    assert stored[2]["metadata"]["interrupted"] is True and stored[2]["metadata"]["original"] == joke
    assert stored[2]["content"] == "Why did the scarecrow "


async def test_the_operator_sets_how_large_a_platforms_body_may_be(store_url: str, clock: FakeClock) -> None:
    """CALLER_MEMORY_PLATFORM_MAX_BODY: a completion within it goes upstream, one beyond it is a 413 that
    reaches nothing."""
    async with (
        upstream() as up,
        running_api(store_url, clock, **proxy_settings(platform_max_body=100_000)) as api,
    ):
        shop = await open_shop(api, up)
        try:
            path = BASE + "/llm/chat/completions"
            fits = {"model": "m", "messages": [{"role": "user", "content": "x" * 90_000}]}
            assert (await api.call("POST", path, token=shop.agent, json=fits)).status == 200
            too_big = {"model": "m", "messages": [{"role": "user", "content": "x" * 110_000}]}
            reply = await api.call("POST", path, token=shop.agent, json=too_big)
            assert reply.status == 413, reply.body
            assert len(up.got) == 1
        finally:
            await shop.close()
