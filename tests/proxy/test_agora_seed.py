"""Agora ConvoAI's custom-LLM requests through the memory proxy, turn by turn, become the transcript in the
format of Agora's short-term memory: the example of Agora's own docs ("Memory for Multi-Turn Conversations",
custom scenario: tests/proxy/data/agora_short_term_memory.json, the request body as Agora documents it) is
reproduced in the history exactly (roles, contents, turns, sources, the interrupted turn with what was spoken
and ``original``), and the answer streamed to the last request is added at the call's end. On every backend,
with the official ``openai`` client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from tests.proxy.conftest import BASE, CALLER, CONVERSATION, Shop
from tests.proxy.test_last_answer import STREAMED, settled

EXAMPLE: dict[str, Any] = orjson.loads(
    (Path(__file__).parent / "data" / "agora_short_term_memory.json").read_bytes()
)


def request_of(turn: int) -> tuple[list[Any], dict[str, Any]]:
    """Agora's request at ``turn``: the short-term memory up to it (the messages of earlier turns, and of this
    one what came before the model was asked), and the top-level extensions."""
    messages = [
        m
        for m in EXAMPLE["messages"]
        if m["turn_id"] < turn or (m["turn_id"] == turn and m["role"] == "user")
    ]
    if turn == EXAMPLE["turn_id"]:
        messages = EXAMPLE["messages"]  # the documented request, as Agora documents it
    extra = {"turn_id": turn, "timestamp": EXAMPLE["timestamp"], "interruptable": True}
    return messages, extra


def as_recorded(message: dict[str, Any]) -> dict[str, Any]:
    """What the history shows of one of Agora's messages: its role, content and turn, and its metadata but
    the RTC user (``metadata.user`` is Agora's uid of the speaker, not kept)."""
    meta = {k: v for k, v in message["metadata"].items() if k != "user"}
    return {
        "role": message["role"],
        "content": message["content"],
        "turn_id": message["turn_id"],
        "metadata": meta,
    }


async def test_agoras_documented_short_term_memory_is_the_history(shop: Shop) -> None:
    client = shop.client()
    for turn in (2, 3, 4):
        messages, extra = request_of(turn)
        stream = await client.chat.completions.create(
            model="m", messages=messages, stream=True, extra_body=extra
        )
        async for _ in stream:
            pass
        await settled(shop)
        sent = shop.up.got[-1].document
        assert "turn_id" not in sent and all("metadata" not in m for m in sent["messages"])
    reply = await shop.api.call("GET", f"{BASE}/conversations/{CONVERSATION}/history", token=shop.agent)
    assert reply.status == 200, reply.body
    stored = [{k: m[k] for k in ("role", "content", "turn_id", "metadata")} for m in reply.body["contents"]]
    assert stored == [as_recorded(m) for m in EXAMPLE["messages"]]
    # The call ends: the answer streamed to turn 4's request, which no request followed, is added.
    reply = await shop.api.call(
        "POST",
        f"{BASE}/conversations/{CONVERSATION}/end",
        token=shop.agent,
        json={"caller": CALLER, "state": {}},
    )
    assert reply.status == 200, reply.body
    reply = await shop.api.call("GET", f"{BASE}/conversations/{CONVERSATION}/history", token=shop.agent)
    last = reply.body["contents"][-1]
    assert len(reply.body["contents"]) == 7
    assert (last["role"], last["content"], last["turn_id"]) == ("assistant", STREAMED, 4)
