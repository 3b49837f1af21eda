"""Issue 27 (hardening from an outside attack): erasure against every end, trust and agent scope on every read
of a transcript, idempotent retries, and the order of an append's refusals. Through a real server on SQLite,
Redis and Redis Cluster, with a fake clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.identifiers import Pseudonymizer
from caller_memory.service.domain.store import CallerRef
from caller_memory.service.http.app_keys import SERVICES

from tests.conftest import OPERATOR_TOKEN, PSEUDONYM_KEY, Api, running_api
from tests.http.test_api import CALLER, assert_problem, memory_path
from tests.http.test_transcripts import PROJECT, As, configure, message, mint_agent
from tests.http.test_webhooks import eventually, receiver, webhook_settings
from tests.storage.test_contract import field

OTHER = "+447700900123"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    return await configure(api)


@pytest.fixture
def agent(api: Api, shop: dict[str, str]) -> As:
    return As(api, shop["agent"])


@pytest.fixture
def admin(api: Api, shop: dict[str, str]) -> As:
    return As(api, shop["admin"])


async def fields(api: Api, token: str, caller: str = CALLER) -> dict[str, Any]:
    reply = await api.call("GET", memory_path(PROJECT, caller), token=token)
    assert reply.status == 200, reply.body
    found: dict[str, Any] = reply.body["fields"]
    return found


async def listed(api: Api, token: str) -> list[str]:
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/analytics/conversations", token=token)
    assert reply.status == 200, reply.body
    return [row["conversation_id"] for row in reply.body["conversations"]]


# 1. An end after an erasure ---------------------------------------------------------------------------------


async def test_the_end_of_a_call_whose_caller_was_erased_during_it_brings_nothing_back(api: Api) -> None:
    tokens = await configure(api)
    agent, admin = As(api, tokens["agent"]), As(api, tokens["admin"])
    await agent.begin("call-1", [message(1, "hi, it is Ada")], state={"caller_name": "Ada"})
    api.clock.advance(5)
    erased = await admin.ok("DELETE", "", f"callers/{CALLER}")
    assert erased["removed"]["transcripts"] == 1
    api.clock.advance(5)
    # The agent ends the call after the erasure: made after it, yet of a conversation it removed.
    body = {
        "caller": CALLER,
        "state": {"caller_name": "Ada", "booking_day": "Friday"},
        "outcome": {"qa": "ok"},
    }
    ended = await agent.ok("POST", "call-1", "end", body)
    assert ended["erased"] is True and ended["persisted"] == [] and ended["repeat_caller"] == {}
    assert await fields(api, tokens["agent"]) == {}
    assert await listed(api, tokens["analytics"]) == []
    # Its retry, and an end of it written as a late one would be, stay refused.
    api.clock.advance(3600)
    assert (await agent.ok("POST", "call-1", "end", body))["erased"] is True
    assert await fields(api, tokens["agent"]) == {}
    # The caller's next call is theirs again, as a first interaction.
    await agent.begin("call-2", [message(1, "hello again")])
    again = await agent.ok("POST", "call-2", "end", {"caller": CALLER, "state": {"caller_name": "Ada"}})
    assert again["erased"] is False and again["persisted"] == ["caller_name"]
    assert await listed(api, tokens["analytics"]) == ["call-2"]


async def test_an_end_after_an_erasure_sends_no_conversation_ended(store_url: str, clock: FakeClock) -> None:
    async with running_api(store_url, clock, **webhook_settings()) as api, receiver() as hook:
        tokens = await configure(api)
        agent, admin = As(api, tokens["agent"]), As(api, tokens["admin"])
        document = {"url": hook.url, "events": ["conversation.ended", "caller.erased"]}
        assert (
            await api.call("POST", f"/v1/projects/{PROJECT}/webhooks", token=tokens["admin"], json=document)
        ).status == 201
        await agent.begin("call-1", [message(1, "hi")], state={"caller_name": "Ada"})
        await admin.ok("DELETE", "", f"callers/{CALLER}")
        await eventually(lambda: len(hook.events("caller.erased")) == 1)
        ended = await agent.ok("POST", "call-1", "end", {"caller": CALLER, "state": {"caller_name": "Ada"}})
        assert ended["erased"] is True
        # A control end of another caller is delivered: once it arrives, call-1's would have too.
        await agent.begin("call-9", [message(1, "hi")], caller=OTHER)
        await agent.ok("POST", "call-9", "end", {"caller": OTHER})
        await eventually(lambda: len(hook.events("conversation.ended")) == 1)
        await asyncio.sleep(0.3)
        assert [e["data"]["conversation_id"] for e in hook.events("conversation.ended")] == ["call-9"]


# 2. A late end racing an erasure ------------------------------------------------------------------------------


async def test_a_late_end_after_an_erasure_writes_nothing(api: Api) -> None:
    tokens = await configure(api, idle_after=1, end_after_inactivity=2)
    agent, admin = As(api, tokens["agent"]), As(api, tokens["admin"])
    await agent.begin("call-1", [message(1, "hi")], state={"caller_name": "Ada"})
    api.clock.advance(3)
    swept = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert swept.body["inactivity_ends"] == 1
    await admin.ok("DELETE", "", f"callers/{CALLER}")
    api.clock.advance(1)
    late = await agent.ok("POST", "call-1", "end", {"caller": CALLER, "state": {"booking_day": "Friday"}})
    assert late["erased"] is True and late["persisted"] == []
    assert await fields(api, tokens["agent"]) == {}


async def test_late_ends_racing_erasures_never_leave_memory_behind(api: Api) -> None:
    tokens = await configure(api, idle_after=1, end_after_inactivity=2)
    agent, admin = As(api, tokens["agent"]), As(api, tokens["admin"])
    for round_ in range(25):
        conversation_id = f"call-{round_}"
        api.clock.advance(1)  # after the last round's erasure (one at the same moment would win over it)
        await agent.begin(conversation_id, [message(1, "hi")], state={"caller_name": "Ada"})
        api.clock.advance(3)
        swept = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
        assert swept.body["inactivity_ends"] == 1
        # The inactivity end persisted the checkpoint; now a late end and an erasure race.
        body = {"caller": CALLER, "state": {"booking_day": "Friday"}}
        late, _ = await asyncio.gather(
            agent("POST", conversation_id, "end", body), admin.ok("DELETE", "", f"callers/{CALLER}")
        )
        assert late.status == 200, late.body
        # Whichever came first, nothing of the caller is left once both answered, and nothing comes back.
        assert await fields(api, tokens["agent"]) == {}, round_
        again = await agent("POST", conversation_id, "end", body)
        assert again.status in (200, 409) and await fields(api, tokens["agent"]) == {}, round_


# 9. An end naming another caller ----------------------------------------------------------------------------


async def test_an_end_naming_another_caller_is_refused_and_the_rightful_end_lands(api: Api) -> None:
    tokens = await configure(api)
    agent = As(api, tokens["agent"])
    await agent.begin("call-1", [message(1, "hi")])
    wrong = await agent("POST", "call-1", "end", {"caller": OTHER, "state": {"caller_name": "Mallory"}})
    assert_problem(wrong, 409, mentions="another caller")
    assert await fields(api, tokens["agent"], OTHER) == {}
    assert (await agent.status("call-1"))["status"] == "active"
    right = await agent.ok("POST", "call-1", "end", {"caller": CALLER, "state": {"caller_name": "Ada"}})
    assert right["persisted"] == ["caller_name"] and right["erased"] is False
    assert await fields(api, tokens["agent"]) == {"caller_name": "Ada"}
    assert (await agent.status("call-1"))["status"] == "ended"


# 3. Trust on every read of a transcript ---------------------------------------------------------------------


async def test_context_of_an_ended_conversation_needs_the_transcripts_trust(api: Api) -> None:
    document = {
        "memory": {
            "repeat_caller": {
                "state_keys": ["caller_name", "verified"],
                "field_classes": {"verified": "sensitive"},
                "trust": {"sensitive": "step_up"},
            },
            "conversation": {"enabled": True},
        }
    }
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=document)
    assert reply.status in (200, 201), reply.body
    agent = As(api, await api.mint(PROJECT, "agent"))
    await agent.begin("call-1", [message(1, "my PIN hint is the dog's name")])
    await agent.ok("PUT", "call-1", "summary", {"text": "asked about the PIN hint", "through_turn": 1})
    live = await agent("GET", "call-1", "context?attestation=C")
    assert live.status == 200  # the call itself reads its own live transcript
    await agent.ok("POST", "call-1", "end", {"caller": CALLER})
    for query in ("", "?attestation=C", "?attestation=TN-Validation-Passed-A"):
        for what in ("context", "history"):
            refused = await agent("GET", "call-1", what + query)
            assert_problem(refused, 403, mentions="sensitive")
            assert "PIN" not in str(refused.body)
    stepped = await agent("GET", "call-1", "context?attestation=C&step_up=true")
    assert stepped.status == 200 and stepped.body["sections"]["summary"]["text"] == "asked about the PIN hint"


# 10. Agent scope holds for summaries ------------------------------------------------------------------------


async def test_under_agent_scope_a_summary_is_its_agents_own(api: Api) -> None:
    tokens = await configure(api, transcript_scope="agent")
    billing, booking = As(api, await mint_agent(api, "billing")), As(api, await mint_agent(api, "booking"))
    admin = As(api, tokens["admin"])
    await billing.start("call-1")
    await billing.append("call-1", [message(1, "a refund"), message(1, "Billing here", "assistant")])
    await billing.ok("PUT", "call-1", "summary", {"text": "refund of 12 pounds", "through_turn": 1})
    mine = await billing.ok("GET", "call-1", "context")
    assert mine["sections"]["summary"]["text"] == "refund of 12 pounds"
    theirs = await booking.ok("GET", "call-1", "context")
    assert theirs["sections"]["summary"] is None and "refund of 12" not in str(theirs)
    overwrite = await booking("PUT", "call-1", "summary", {"text": "nothing happened", "through_turn": 1})
    assert_problem(overwrite, 403, mentions="another agent")
    assert (await billing.ok("GET", "call-1", "context"))["sections"]["summary"][
        "text"
    ] == "refund of 12 pounds"
    # The callback's resume offers the summary to its own agent only.
    await billing.ok("POST", "call-1", "end", {"caller": CALLER, "end_reason": "dropped"})
    offered = await booking.start("call-2")
    assert offered["resume"]["conversation_id"] == "call-1" and offered["resume"]["summary"] is None
    # An admin sees and may replace any summary.
    seen = await admin.ok("GET", "call-1", "context")
    assert seen["sections"]["summary"]["text"] == "refund of 12 pounds"


# 8. A retry without times is a no-op ------------------------------------------------------------------------


async def test_a_retry_without_timestamp_or_sent_at_is_a_no_op(agent: As) -> None:
    batch = [
        {"message_id": "m-1", "role": "user", "content": "hi", "turn_id": 0},
        {"message_id": "m-2", "role": "assistant", "content": "hello", "turn_id": 0},
    ]
    first = await agent.begin("call-1", batch)
    agent.api.clock.advance(5)
    again = await agent.begin("call-1", batch)
    assert (first["added"], again["added"], again["messages"]) == (2, 0, 2)
    # Retried with one more message: the two are no-ops, the third is added.
    agent.api.clock.advance(5)
    more = await agent.begin(
        "call-1", [*batch, {"message_id": "m-3", "role": "user", "content": "ok", "turn_id": 1}]
    )
    assert (more["added"], more["messages"]) == (1, 3)
    # The same id with another body is still a conflict.
    changed = await agent("POST", "call-1", "messages", {"messages": [{**batch[0], "content": "bye"}]})
    assert_problem(changed, 409, mentions="m-1")


# 13. Smaller ------------------------------------------------------------------------------------------------


async def test_a_deleted_transcript_reads_410_and_a_never_started_one_404(agent: As, admin: As) -> None:
    await agent.begin("call-1", [message(1, "hi")])
    await admin.ok("DELETE", "call-1")
    for what in ("", "history", "context"):
        assert_problem(await agent("GET", "call-1", what), 410, mentions="deleted")
    assert_problem(await agent("GET", "call-never", "history"), 404)


async def test_at_the_byte_bound_an_append_to_a_never_started_conversation_is_404(api: Api) -> None:
    agent = As(api, (await configure(api, max_transcript_bytes=1024))["agent"])
    await agent.begin("call-1", [message(1, "x" * 1100)])
    never = await agent("POST", "call-never", "messages", {"messages": [message(1, "hello")]})
    assert_problem(never, 404, mentions="has not started")
    await agent.ok("POST", "call-1", "end", {"caller": CALLER})
    ended = await agent("POST", "call-1", "messages", {"messages": [message(2, "more")]})
    assert_problem(ended, 409, mentions="ended")
    full = await agent(
        "POST", "call-2", "messages", {"caller": CALLER, "channel": "voice", "messages": [message(1, "hi")]}
    )
    assert_problem(full, 507, mentions="max_transcript_bytes")


# 13. An email's earlier spelling ----------------------------------------------------------------------------


async def test_an_erasure_takes_what_an_earlier_release_stored_under_the_emails_old_spelling(
    api: Api,
) -> None:
    """An earlier release kept ``email:ada@example.com.`` (a domain's root dot) as written; this one writes it
    as ``email:ada@example.com``. What was stored under the old spelling is the same caller's: an erasure
    through that spelling removes it too."""
    tokens = await configure(api)
    old = Pseudonymizer(PSEUDONYM_KEY).pseudonym(PROJECT, "email:ada@example.com.")
    store = api.app[SERVICES].store
    now = api.clock.now_ms()
    written = await store.patch_fields(CallerRef(PROJECT, old), {"caller_name": field("Ada", now)}, [], now)
    assert written.applied
    erased = await As(api, tokens["admin"]).ok("DELETE", "", "callers/email:Ada@Example.com.")
    assert erased["removed"]["fields"] == 1 and erased["removed"]["links"] == 0, erased
    assert await store.read_fields(CallerRef(PROJECT, old), api.clock.now_ms()) == {}
