"""Caller-ID trust through the HTTP API: every trust level, every path that reads or writes fields (memory,
end, checkpoint, context, start and resume, history), the ETag, analytics, and bad input."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import OPERATOR_TOKEN, Api
from tests.http.test_api import assert_problem

CALLER = "+14155550100"
BASE = "/v1/projects/bank"
STATE_KEYS = ["caller_name", "booking_day", "verified", "balance"]
TRUST_CONFIG: dict[str, Any] = {
    "state_keys": STATE_KEYS,
    "analytics_enabled": True,
    # caller_name: unclassified (personal, any); booking_day: A_or_B; balance: A; verified: step_up.
    "field_classes": {"booking_day": "booking", "balance": "account", "verified": "sensitive"},
    "trust": {"booking": "A_or_B", "account": "A", "sensitive": "step_up"},
}
EVERYTHING = {"caller_name": "Ada", "booking_day": "Friday", "verified": True, "balance": 12}

#: (attestation as a provider sends it, step_up) -> the fields the call reads. Twilio's StirVerstat, Telnyx's
#: verstat (its A-level value has no -A suffix), plain letters, and none at all (unknown: counts as C).
LEVELS = [
    ("TN-Validation-Passed-A", False, {"caller_name", "booking_day", "balance"}),
    ("TN-Validation-Passed", False, {"caller_name", "booking_day", "balance"}),
    ("TN-Validation-Passed-B", False, {"caller_name", "booking_day"}),
    ("B", False, {"caller_name", "booking_day"}),
    ("TN-Validation-Passed-C", False, {"caller_name"}),
    ("TN-Validation-Failed-A", False, {"caller_name"}),
    ("No-TN-Validation", False, {"caller_name"}),
    (None, False, {"caller_name"}),
    (None, True, set(EVERYTHING)),  # a step-up check passed satisfies every level
    ("TN-Validation-Failed-B", True, set(EVERYTHING)),
]


@pytest.fixture
async def bank(api: Api) -> dict[str, str]:
    tokens = await api.project_with_tokens("bank", TRUST_CONFIG)
    reply = await api.call("PATCH", f"{BASE}/callers/{CALLER}/memory", token=tokens["admin"], json=EVERYTHING)
    assert reply.status == 200, reply.body
    return tokens


def read_path(attestation: str | None, step_up: bool, caller: str = CALLER) -> str:
    query = [f"attestation={attestation}"] if attestation is not None else []
    query += ["step_up=true"] if step_up else []
    return f"{BASE}/callers/{caller}/memory" + ("?" + "&".join(query) if query else "")


async def test_each_trust_level_withholds_what_the_call_does_not_qualify_for(
    api: Api, bank: dict[str, str]
) -> None:
    etags = set()
    for attestation, step_up, visible in LEVELS:
        reply = await api.call("GET", read_path(attestation, step_up), token=bank["agent"])
        assert reply.status == 200, reply.body
        assert set(reply.body["fields"]) == visible, (attestation, step_up)
        assert reply.body["withheld"] == sorted(set(EVERYTHING) - visible), (attestation, step_up)
        etags.add((frozenset(visible), reply.headers["ETag"]))
    # The ETag depends on what was withheld: one per distinct view, a different one for each view.
    assert len({etag for _, etag in etags}) == len({view for view, _ in etags}) == 4
    admin = await api.call("GET", read_path(None, False), token=bank["admin"])
    assert admin.body["fields"] == EVERYTHING and admin.body["withheld"] == []  # an admin read is no call
    assert admin.body["attestation"] is None


async def test_unknown_attestation_is_what_the_project_configures(api: Api, bank: dict[str, str]) -> None:
    reply = await api.call("GET", read_path(None, False), token=bank["agent"])
    assert reply.body["attestation"] == "unknown" and set(reply.body["fields"]) == {"caller_name"}
    # A project outside North America may count a call without attestation as B (or A): configured.
    await api.put_project("bank", {**TRUST_CONFIG, "unknown_attestation": "B"})
    reply = await api.call("GET", read_path("No-TN-Validation", False), token=bank["agent"])
    assert set(reply.body["fields"]) == {"caller_name", "booking_day"}
    assert reply.body["withheld"] == ["balance", "verified"]
    # A failed attestation is never the unknown one.
    reply = await api.call("GET", read_path("TN-Validation-Failed-B", False), token=bank["agent"])
    assert set(reply.body["fields"]) == {"caller_name"}


async def test_a_withheld_view_is_not_a_304_for_the_whole_memorys_etag(
    api: Api, bank: dict[str, str]
) -> None:
    whole = await api.call("GET", read_path("A", True), token=bank["agent"])
    spoofed = await api.call(
        "GET", read_path("C", False), token=bank["agent"], headers={"If-None-Match": whole.headers["ETag"]}
    )
    assert spoofed.status == 200 and spoofed.body["fields"] == {"caller_name": "Ada"}
    again = await api.call(
        "GET", read_path("C", False), token=bank["agent"], headers={"If-None-Match": spoofed.headers["ETag"]}
    )
    assert again.status == 304


async def test_an_end_cannot_overwrite_or_delete_a_withheld_field(api: Api, bank: dict[str, str]) -> None:
    body: dict[str, Any] = {
        "caller": CALLER,
        "attestation": "TN-Validation-Passed-C",
        "state": {"caller_name": "Eve", "verified": False, "balance": None, "booking_day": "Monday"},
    }
    reply = await api.call("POST", f"{BASE}/conversations/spoof-1/end", token=bank["agent"], json=body)
    assert reply.status == 200, reply.body
    assert reply.body["persisted"] == ["caller_name"]
    assert reply.body["withheld"] == ["balance", "booking_day", "verified"]
    assert reply.body["ignored"] == []
    memory = await api.call("GET", read_path(None, False), token=bank["admin"])
    assert memory.body["fields"] == {**EVERYTHING, "caller_name": "Eve"}  # nothing withheld was touched
    # With a step-up check passed, the same end (another call) writes them all.
    body = {**body, "step_up": True}
    reply = await api.call("POST", f"{BASE}/conversations/verified-1/end", token=bank["agent"], json=body)
    assert reply.body["withheld"] == [] and reply.body["persisted"] == sorted(body["state"])
    memory = await api.call("GET", read_path(None, False), token=bank["admin"])
    assert memory.body["fields"] == {"caller_name": "Eve", "verified": False, "booking_day": "Monday"}


async def test_an_unrecognised_attestation_is_refused_without_echoing_it(
    api: Api, bank: dict[str, str]
) -> None:
    reply = await api.call("GET", read_path("Totally-Verified-Trust-Me", False), token=bank["agent"])
    assert_problem(reply, 422, mentions="attestation")
    assert "Totally" not in reply.body["detail"]
    body = {"caller": CALLER, "attestation": "maybe", "state": {"caller_name": "Eve"}}
    reply = await api.call("POST", f"{BASE}/conversations/bad-1/end", token=bank["agent"], json=body)
    assert_problem(reply, 422, mentions="attestation")
    memory = await api.call("GET", read_path(None, False), token=bank["admin"])
    assert memory.body["fields"]["caller_name"] == "Ada"  # nothing changed
    for bad in ({"attestation": 7}, {"step_up": "yes"}):
        reply = await api.call(
            "POST", f"{BASE}/conversations/bad-2/end", token=bank["agent"], json={"caller": CALLER, **bad}
        )
        assert_problem(reply, 422, mentions=next(iter(bad)))
    reply = await api.call("GET", f"{BASE}/callers/{CALLER}/memory?step_up=perhaps", token=bank["agent"])
    assert_problem(reply, 422, mentions="step_up")


@pytest.mark.parametrize(
    ("change", "mentions"),
    [
        ({"field_classes": {"nope": "sensitive"}}, "field_classes.nope"),
        ({"trust": {"booking": "A_or_B", "account": "A"}}, "trust.sensitive"),
        ({"trust": {**TRUST_CONFIG["trust"], "ghost": "A"}}, "trust.ghost"),
        ({"trust": {**TRUST_CONFIG["trust"], "sensitive": "very"}}, "trust.sensitive"),
        ({"unknown_attestation": "unknown"}, "unknown_attestation"),
    ],
)
async def test_bad_trust_configuration_is_refused_naming_the_field(
    api: Api, change: dict[str, Any], mentions: str
) -> None:
    reply = await api.put_project("bank", {**TRUST_CONFIG, **change})
    assert_problem(reply, 422, mentions=mentions)
    assert (await api.call("GET", f"{BASE}", token=OPERATOR_TOKEN)).status == 404  # nothing was created


CONVERSATION_CONFIG = {
    "memory": {"repeat_caller": TRUST_CONFIG, "conversation": {"enabled": True, "resume_window": "PT1H"}},
}


async def test_checkpoints_context_resume_and_history_follow_the_calls_trust(api: Api) -> None:
    await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONVERSATION_CONFIG)
    agent, admin = await api.mint("bank", "agent"), await api.mint("bank", "admin")
    await api.call("PATCH", f"{BASE}/callers/{CALLER}/memory", token=admin, json=EVERYTHING)
    conv = f"{BASE}/conversations"
    start = {"caller": CALLER, "channel": "phone", "attestation": "TN-Validation-Passed-C"}
    assert (await api.call("POST", f"{conv}/c1/start", token=agent, json=start)).status == 200
    said = [{"role": "user", "content": "my PIN is wrong, never mind", "turn_id": 0}]
    # A checkpoint from a call that only qualifies for personal fields keeps only those.
    append = {"messages": said, "state": {"caller_name": "Eve", "verified": False}, "attestation": "C"}
    assert (await api.call("POST", f"{conv}/c1/messages", token=agent, json=append)).status == 200
    context = await api.call("GET", f"{conv}/c1/context?attestation=C", token=agent)
    assert context.body["sections"]["profile"]["fields"] == {"caller_name": "Ada"}
    assert context.body["sections"]["profile"]["withheld"] == ["balance", "booking_day", "verified"]
    # The line drops: the service ends it by inactivity and applies the checkpoint, without `verified`.
    api.clock.advance(31 * 60)
    assert (await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)).status == 200
    memory = await api.call("GET", f"{BASE}/callers/{CALLER}/memory", token=admin)
    assert memory.body["fields"]["caller_name"] == "Eve" and memory.body["fields"]["verified"] is True
    # History of an ended conversation (an earlier call) needs the sensitive level.
    history = await api.call("GET", f"{conv}/c1/history?attestation=C", token=agent)
    assert_problem(history, 403, mentions="sensitive")
    history = await api.call("GET", f"{conv}/c1/history?attestation=C&step_up=true", token=agent)
    assert history.status == 200 and history.body["contents"]
    # The callback is offered the dropped call; its transcript only with the sensitive level.
    started = await api.call("POST", f"{conv}/c2/start", token=agent, json={**start, "step_up": True})
    resume = started.body["resume"]
    assert resume["conversation_id"] == "c1" and resume["withheld"] == []
    assert [m["content"] for m in resume["last_turns"]] == ["my PIN is wrong, never mind"]
    ended = {"caller": CALLER, "step_up": True, "end_reason": "completed"}
    assert (await api.call("POST", f"{conv}/c2/end", token=agent, json=ended)).status == 200
    started = await api.call("POST", f"{conv}/c3/start", token=agent, json={**start, "attestation": "A"})
    resume = started.body["resume"]
    assert resume["conversation_id"] == "c1"
    assert resume["last_turns"] == [] and resume["summary"] is None
    assert resume["state"] == {"caller_name": "Eve"} and resume["withheld"] == ["verified"]


async def test_repeat_calls_are_broken_down_by_attestation(api: Api, bank: dict[str, str]) -> None:
    ends = [("first", None), ("r1", "TN-Validation-Passed-A"), ("r2", "TN-Validation-Passed"), ("r3", "C")]
    for conversation_id, attestation in ends:
        body = {"caller": CALLER, "attestation": attestation, "outcome": {"qa": "resolved"}}
        reply = await api.call(
            "POST", f"{BASE}/conversations/{conversation_id}/end", token=bank["agent"], json=body
        )
        assert reply.status == 200, reply.body
    report = await api.call("GET", f"{BASE}/analytics/repeat-callers", token=bank["analytics"])
    rows = {row["value"]: row["repeat_conversations"] for row in report.body["breakdowns"]["attestation"]}
    assert rows == {"A": 2, "C": 1}
    listed = await api.call("GET", f"{BASE}/analytics/conversations", token=bank["analytics"])
    by_id = {row["conversation_id"]: row["attestation"] for row in listed.body["conversations"]}
    assert by_id == {"first": "unknown", "r1": "A", "r2": "A", "r3": "C"}
