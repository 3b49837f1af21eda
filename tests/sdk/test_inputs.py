"""What agent code hands the SDK is checked where it enters: tokens, conversation ids, and conv.state values
that JSON cannot carry exactly (refused with a clear ValueError, never sent as something else)."""

from __future__ import annotations

import datetime
import math
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web
from caller_memory.sdk import MemoryClient, RetryPolicy

from tests.sdk.conftest import Serve

CALLER = "+14155550100"


@pytest.mark.parametrize(
    "token",
    [
        "",
        "\r\n",
        "cm_abc\x00def",
        "cm_abc\x7f",
        "cm_abc\x1b[31m",
        "\x1ccm_abc",  # str.strip() would remove it: it must not be trimmed into a valid-looking token
        "cm_abc\x85",
        "cm_abc\u2028",
        "cm_abc def",
        "cm_abc\tdef",
        "cm_ab\u00e7",
        "cm_abc=def",
    ],
)
def test_a_token_with_control_characters_is_refused(token: str) -> None:
    with pytest.raises(ValueError, match="token must be"):
        MemoryClient("http://127.0.0.1:1", token=token, project="p")


@pytest.mark.parametrize("token", ["cm_abc_def\n", " cm_abc_def\r\n", "a-b.c~d+e/f==", "t"])
def test_a_bearer_token_with_a_line_end_from_a_env_file_is_fine(token: str) -> None:
    assert MemoryClient("http://127.0.0.1:1", token=token, project="p")


@pytest.mark.parametrize(
    "conversation_id",
    [
        "conv-1\n",
        "conv-1\r\n",
        "conv\x00",
        "conv-1\t",
        " conv-1",
        "conv 1",
        "-conv",
        "c" * 129,
        "conv-\u0661",
    ],
)
def test_a_conversation_id_with_a_trailing_newline_or_control_characters_is_refused(
    conversation_id: str,
) -> None:
    c = MemoryClient("http://127.0.0.1:1", token="t", project="p")
    with pytest.raises(ValueError, match="conversation_id"):
        c.conversation(conversation_id, caller=CALLER)
    assert c.conversation("CA1234:leg-2.a_b", caller=CALLER).conversation_id == "CA1234:leg-2.a_b"


@pytest.mark.parametrize(
    "base_url",
    [
        "",
        "127.0.0.1:8080",
        "ftp://host",
        "http://",
        "http://host/?q=1",
        "http://host/#x",
        "http://ho st",
        "http://host\n",
    ],
)
def test_a_base_url_that_is_not_a_service_url_is_refused(base_url: str) -> None:
    with pytest.raises(ValueError, match="base_url"):
        MemoryClient(base_url, token="t", project="p")
    assert MemoryClient("https://memory.example/prefix/", token="t", project="p").base_url == (
        "https://memory.example/prefix"
    )


async def test_outcome_values_must_be_strings() -> None:
    conv = MemoryClient("http://127.0.0.1:1", token="t", project="p").conversation("c1", caller=CALLER)
    for outcome in ({"qa": math.nan}, {"handoff_reason": 1}, {"handoff_to": ["a"]}, {"channel": b"voice"}):
        with pytest.raises(ValueError, match="must be a string or None"):
            await conv.end(**outcome)


@pytest.mark.parametrize("project", ["", "Shop", "shop\n", "shop/../x", "-shop"])
def test_a_project_id_the_service_cannot_have_is_refused(project: str) -> None:
    with pytest.raises(ValueError, match="project"):
        MemoryClient("http://127.0.0.1:1", token="t", project=project)


CANNOT_CARRY: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    2**53,
    -(2**53),
    10**400,
    [1, math.nan],
    {"nested": {"deeper": math.inf}},
    {1: "a"},
    {("a", "b"): 1},
    {"a", "b"},
    b"bytes",
    datetime.date(2030, 1, 1),
    object(),
    "lone \ud800 surrogate",
]


@pytest.mark.parametrize("value", CANNOT_CARRY)
def test_state_values_json_cannot_carry_are_refused_at_assignment(value: Any) -> None:
    conv = MemoryClient("http://127.0.0.1:1", token="t", project="p").conversation("c1", caller=CALLER)
    with pytest.raises(ValueError, match=r"conv\.state\['x'\]"):
        conv.state["x"] = value
    with pytest.raises(ValueError, match=r"conv\.state"):
        conv.state.update(x=value)
    with pytest.raises(ValueError, match=r"conv\.state"):
        conv.state.setdefault("x", value)
    with pytest.raises(ValueError, match=r"conv\.state"):
        conv.state |= {"x": value}
    assert conv.state == {}
    with pytest.raises(ValueError, match="keys must be strings"):
        conv.state[1] = "a"  # type: ignore[index]
    conv.state["fine"] = [2**53 - 1, -(2**53 - 1), 1e308, -0.0, None, True, "\u00e9", {"k": []}]


@pytest.mark.parametrize("value", [math.nan, math.inf, 2**60, {3: "three"}])
async def test_state_changed_in_place_is_checked_at_the_end_before_anything_is_sent_or_kept(
    serve: Serve, tmp_path: Path, value: Any
) -> None:
    received: list[bytes] = []

    async def service(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(status=503)

    url = await serve(service)
    fast = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.02, attempt_timeout=0.5)
    async with MemoryClient(url, token="t", project="p", outbox_path=tmp_path / "o.db", retry=fast) as c:
        conv = c.conversation("conv-1", caller=CALLER)
        conv.state["booking_day"] = "Friday"
        conv.state["profile"] = {"likes": []}
        conv.state["profile"]["likes"].append(value)  # not seen by the assignment check
        with pytest.raises(ValueError, match=r"conv\.state\['profile'\]\['likes'\]\[0\]"):
            await conv.end()
        conv.state = {"plain": {"dict": value}}  # a plain dict put in its place is checked as well
        with pytest.raises(ValueError, match=r"conv\.state"):
            await conv.end()
        assert not conv.ended and await c.outbox.pending() == [] and await c.outbox.rejected() == []
        assert received == []  # nothing was sent as null (which would have deleted the field)
        conv.state = {"booking_day": "Friday"}
        assert (await conv.end()).queued  # once fixed, the end goes through (here: to the outbox)
    assert [orjson.loads(body)["state"] for body in received] == [{"booking_day": "Friday"}] * 2
