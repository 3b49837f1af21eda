"""Trust stored with the conversation (SPEC 15, "Trust"): ``POST .../conversations/{id}/trust`` raises step-up
for the rest of the call (204, audited; 404 for no such conversation, 409 once it ended, 422 for anything
but ``{"step_up": true}``, nothing changed), and the memory proxy uses the stored trust: a sensitive field is
withheld from its memory message for an unattested call and shown after the step-up; an attested start's
trust is kept for the proxy too. On every backend."""

from __future__ import annotations

from typing import Any

from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, running_api
from tests.proxy.conftest import UPSTREAM_KEY, proxy_settings
from tests.proxy.upstream import upstream

CALLER = "+14155550100"
BASE = "/v1/projects/bank"
CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name", "balance"],
            "field_classes": {"balance": "sensitive"},
            "trust": {"sensitive": "step_up"},
            "retention": "P30D",
        },
        "conversation": {"enabled": True},
    }
}


def memory_of(document: dict[str, Any]) -> str:
    (message,) = [m for m in document["messages"] if m.get("name") == "caller_memory"]
    content: str = message["content"]
    return content


async def test_a_step_up_shows_the_proxy_what_the_unattested_start_withheld(
    store_url: str, clock: FakeClock
) -> None:
    async with upstream() as up, running_api(store_url, clock, **proxy_settings()) as api:
        reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
        assert reply.status in (200, 201), reply.body
        agent, admin = await api.mint("bank", "agent"), await api.mint("bank", "admin")
        reply = await api.call(
            "PUT", BASE + "/llm", token=admin, json={"base_url": up.url, "api_key": UPSTREAM_KEY}
        )
        assert reply.status == 201, reply.body
        reply = await api.call(
            "PATCH",
            f"{BASE}/callers/{CALLER}/memory",
            token=admin,
            json={"caller_name": "Ada", "balance": 12},
        )
        assert reply.status == 200, reply.body
        for conversation, attestation in (("call-1", None), ("call-2", "TN-Validation-Passed-A")):
            body = {"caller": CALLER, "channel": "phone" if conversation == "call-1" else "web"}
            if attestation:
                body["attestation"] = attestation
            reply = await api.call(
                "POST", f"{BASE}/conversations/{conversation}/start", token=agent, json=body
            )
            assert reply.status == 200, reply.body

        async def completion(conversation: str) -> str:
            reply = await api.call(
                "POST",
                BASE + "/llm/chat/completions",
                token=agent,
                json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True},
                headers={"X-Caller-Memory-Conversation": conversation},
            )
            assert reply.status == 200
            return memory_of(up.got[-1].document)

        before = await completion("call-1")
        assert '"caller_name":"Ada"' in before and "balance" not in before
        # An attested start is no step-up: the sensitive field stays withheld there too.
        assert "balance" not in await completion("call-2")

        trust = f"{BASE}/conversations/call-1/trust"
        for bad in ({"step_up": False}, {}, {"step_up": True, "attestation": "A"}, {"step_up": "yes"}):
            reply = await api.call("POST", trust, token=agent, json=bad)
            assert reply.status == 422, (bad, reply.body)
        assert "balance" not in await completion("call-1")  # nothing changed
        reply = await api.call(
            "POST", f"{BASE}/conversations/call-9/trust", token=agent, json={"step_up": True}
        )
        assert reply.status == 404, reply.body
        platform = await api.mint("bank", "platform")  # pasted in a vendor's console: never this
        reply = await api.call("POST", trust, token=platform, json={"step_up": True})
        assert reply.status == 403, reply.body
        assert "balance" not in await completion("call-1")

        reply = await api.call("POST", trust, token=agent, json={"step_up": True})
        assert reply.status == 204, reply.body
        after = await completion("call-1")
        assert '"balance":12' in after and '"caller_name":"Ada"' in after
        # Only that call: the other conversation's trust is its own.
        assert "balance" not in await completion("call-2")

        reply = await api.call("GET", f"{BASE}/audit", token=admin)
        assert reply.status == 200, reply.body
        audited = [r for r in reply.body["records"] if r["action"] == "conversation.step_up"]
        assert [r["details"] for r in audited] == [{"conversation_id": "call-1"}]

        reply = await api.call(
            "POST", f"{BASE}/conversations/call-1/end", token=agent, json={"caller": CALLER, "state": {}}
        )
        assert reply.status == 200, reply.body
        reply = await api.call("POST", trust, token=agent, json={"step_up": True})
        assert reply.status == 409, reply.body
