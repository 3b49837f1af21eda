"""How a completion finds its conversation and its memory: the platforms' own fields (Vapi's ``call.id``,
ElevenLabs' initiation data) bind it where no header does, and the memory read takes an in-flight slot of its
project only while it runs (none free: a completion without memory, flagged, never refused)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

from caller_memory.service.domain.clock import FakeClock

from tests.conftest import TEST_NUMBERS, canonical_digits, running_api
from tests.proxy.conftest import BASE, CALLER, Shop, open_shop, proxy_settings
from tests.proxy.test_proxy import history, memory_messages, question
from tests.proxy.upstream import events, upstream


async def start(shop: Shop, conversation: str) -> None:
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/{conversation}/start",
        token=shop.agent,
        json={"caller": CALLER, "channel": "phone"},
    )
    assert reply.status == 200, reply.body


async def complete(shop: Shop, body: dict[str, Any], conversation: str | None = None) -> Any:
    """A completion as a platform sends it (the platform's fields in the body, no binding header unless
    ``conversation``)."""
    return await shop.client(conversation).chat.completions.with_raw_response.create(
        model="m", messages=body.pop("messages"), extra_body=body
    )


async def recorded(shop: Shop, conversation: str, expected: int) -> list[dict[str, Any]]:
    deadline = asyncio.get_running_loop().time() + 5
    while True:
        reply = await shop.api.call(
            "GET", f"{BASE}/conversations/{conversation}/history?format=openai", token=shop.agent
        )
        assert reply.status == 200, reply.body
        found: list[dict[str, Any]] = reply.body["messages"]
        if len(found) >= expected or asyncio.get_running_loop().time() > deadline:
            return found
        await asyncio.sleep(0.02)


async def test_vapis_call_id_binds_the_conversation_its_assistant_request_started(shop: Shop) -> None:
    await shop.remember(cheese="Stilton")
    call_id = str(uuid.uuid4())
    await start(shop, f"vapi:{call_id}")
    # As Vapi sends it with metadataSendMode "variable" (its default): the call, phoneNumber and customer
    # objects beside the messages, and the assistant's metadata.
    body = {
        "messages": question("Hello again"),
        "call": {"id": call_id, "orgId": "org-1", "type": "inboundPhoneCall", "customer": {"number": CALLER}},
        "phoneNumber": {"id": "pn-1", "number": "+14155550199"},
        "customer": {"number": CALLER},
        "metadata": {"shop": "cheese"},
    }
    response = await complete(shop, body)
    assert response.headers["x-caller-memory"] == "bound"
    sent = shop.up.got[-1]
    (memory,) = memory_messages(sent.document)
    assert '"cheese":"Stilton"' in memory["content"]
    assert not {"call", "phoneNumber", "customer", "metadata"} & set(sent.document)
    assert not TEST_NUMBERS.search(canonical_digits(sent.body.decode()))
    # The turn is recorded in Vapi's conversation (not in the fixture's).
    (said,) = await recorded(shop, f"vapi:{call_id}", 1)
    assert said == {"role": "user", "content": "Hello again"}
    assert await history(shop, 0) == []

    # A call the service did not start binds nothing (no memory, counted unbound); neither does an id
    # outside the conversation id's grammar, and the completion goes on all the same.
    for other in (str(uuid.uuid4()), "not an id/" + call_id):
        response = await complete(shop, {"messages": question(), "call": {"id": other}})
        assert response.status_code == 200
        assert response.headers["x-caller-memory"] == "unbound"
        assert memory_messages(shop.up.got[-1].document) == []
    # The header, when sent, names the conversation whatever the body says.
    response = await complete(shop, {"messages": question(), "call": {"id": str(uuid.uuid4())}}, "call-1")
    assert response.headers["x-caller-memory"] == "bound"


async def test_elevenlabs_initiation_data_binds_the_conversation_it_names(shop: Shop) -> None:
    await shop.remember(caller_name="Ada")
    conversation = "elevenlabs:" + uuid.uuid4().hex
    await start(shop, conversation)
    # The initiation answered custom_llm_extra_body {"caller_memory_conversation": ...}; ElevenLabs sends it
    # back in every custom-LLM request as elevenlabs_extra_body (with user_id when one was set).
    body = {
        "messages": question("Hi"),
        "stream": False,
        "elevenlabs_extra_body": {"caller_memory_conversation": conversation},
        "user_id": "customer-7",
    }
    response = await complete(shop, body)
    assert response.headers["x-caller-memory"] == "bound"
    sent = shop.up.got[-1].document
    assert '"caller_name":"Ada"' in memory_messages(sent)[0]["content"]
    assert "elevenlabs_extra_body" not in sent and "user_id" not in sent and "user" not in sent
    assert await recorded(shop, conversation, 1) == [{"role": "user", "content": "Hi"}]
    # Extra body without the member, or with something that is not an id: unbound, never refused.
    for extra in ({"other": "x"}, {"caller_memory_conversation": 42}, "text"):
        response = await complete(shop, {"messages": question(), "elevenlabs_extra_body": extra})
        assert response.status_code == 200 and response.headers["x-caller-memory"] == "unbound"


@contextlib.asynccontextmanager
async def slot_held(shop: Shop) -> AsyncIterator[None]:
    """One of the project's in-flight slots held: a request whose body never comes (until the block ends)."""
    address = urlsplit(shop.api.base_url)
    _, writer = await asyncio.open_connection(address.hostname, address.port)
    writer.write(
        (
            f"PATCH {BASE}/callers/{CALLER}/memory HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {shop.admin}\r\nContent-Type: application/json\r\n"
            "Content-Length: 64\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    try:
        # The slot is the project's only one: another request of the project is refused until it goes.
        deadline = asyncio.get_running_loop().time() + 5
        while (await shop.api.call("GET", BASE + "/llm", token=shop.admin)).status != 429:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        yield
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def test_the_memory_read_takes_an_in_flight_slot_only_while_it_runs(
    store_url: str, clock: FakeClock
) -> None:
    async with (
        upstream() as up,
        running_api(store_url, clock, **proxy_settings(max_in_flight_per_project=1)) as api,
    ):
        shop = await open_shop(api, up)
        try:
            await shop.remember(cheese="Stilton")
            async with slot_held(shop):
                # No slot for the read: the completion goes without memory, flagged, never a 429 or 503.
                response = await complete(shop, {"messages": question()}, "call-1")
                assert response.status_code == 200
                assert response.headers["x-caller-memory"] == "unavailable"
                assert memory_messages(up.got[-1].document) == []
            # The slot free again: the read takes it and gives it back, even while the stream stays open.
            hold = asyncio.Event()
            up.answers.append(events(hold=hold))
            async with shop.client().chat.completions.with_streaming_response.create(
                model="m", messages=question(), stream=True
            ) as streaming:
                assert streaming.headers["x-caller-memory"] == "bound"
                assert len(memory_messages(up.got[-1].document)) == 1
                # The stream holds no slot: the project's one slot serves another request meanwhile.
                assert (await api.call("GET", BASE + "/llm", token=shop.admin)).status == 200
                hold.set()
            metrics = (await api.call("GET", "/metrics")).body
            assert 'caller_memory_proxy_completions_total{memory="unavailable"} 1.0' in metrics
        finally:
            await shop.close()
