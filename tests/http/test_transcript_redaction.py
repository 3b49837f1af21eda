"""Redaction through a real server (issue 27, item 5), on every backend: a number said across the messages
of one append, a caller's possible-but-not-valid number in their own national form, and one project's
appends of 64 KiB of digit groups that no longer hold the event loop against another project's reads."""

from __future__ import annotations

import asyncio

from tests.conftest import Api
from tests.http.test_transcripts import As, configure, message

#: About the most digit groups one append carries (the body is at most 64 KiB): five messages of 12,000
#: characters.
DIGIT_GROUPS = "415 555 0100 " * 923


async def test_a_number_said_across_the_messages_of_one_append_is_masked_in_each(api: Api) -> None:
    agent = As(api, (await configure(api))["agent"])
    said = [message(1, "you can reach me on 020 7946"), message(1, "0018, after six"), message(1, "noted")]
    await agent.begin("call-1", said)
    contents = [m["content"] for m in (await agent.history("call-1"))["contents"]]
    assert contents == ["you can reach me on [phone]", "[phone], after six", "noted"]


async def test_a_callers_test_range_number_in_their_national_form_is_masked(api: Api) -> None:
    # The project reads numbers as GB ones and keeps other numbers (redact_phone_numbers off); the caller's
    # number is American and in a test range (possible, valid in no region): it is still theirs.
    agent = As(api, (await configure(api, redact_phone_numbers=False))["agent"])
    caller = "+15555550123"
    said = [message(1, "it's (555) 555-0123, or the office on 020 7946 0018")]
    await agent.append("call-1", said, caller=caller, channel="voice")
    contents = (await agent.history("call-1"))["contents"]
    assert contents[0]["content"] == "it's [phone], or the office on 020 7946 0018"


async def test_appends_of_digit_groups_do_not_hold_another_projects_reads(api: Api) -> None:
    heavy = As(api, (await configure(api))["agent"])
    other_token = (await configure(api, project="other-shop"))["agent"]
    other_path = "/v1/projects/other-shop/conversations/call-9/history"
    started = {"caller": "+447700900123", "channel": "voice", "messages": [message(1, "hello")]}
    reply = await api.call(
        "POST", "/v1/projects/other-shop/conversations/call-9/messages", token=other_token, json=started
    )
    assert reply.status == 200, reply.body
    await heavy.begin("call-1", [message(1, "hi")])
    batch = [message(2, DIGIT_GROUPS) for _ in range(5)]

    appends = [asyncio.create_task(heavy.append("call-1", batch)) for _ in range(4)]
    answered_meanwhile = 0
    while not all(task.done() for task in appends):
        read = await api.call("GET", other_path, token=other_token)
        assert read.status == 200, read.body
        if not all(task.done() for task in appends):
            answered_meanwhile += 1
    for task in appends:
        assert task.result()["stored"] is True
    # Before: each append held the loop for about two seconds in one block, so reads queued behind them all.
    assert answered_meanwhile >= 30, answered_meanwhile
    stored = (await heavy.history("call-1", "?after_turn=1"))["contents"]
    assert len(stored) == 20 and all(set(m["content"]) <= set("[phone] ") for m in stored)
