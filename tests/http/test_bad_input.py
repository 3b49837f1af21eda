"""Bad input never gets a 5xx and changes nothing, on every backend: headers that are not UTF-8, JSON the
service could not keep exactly (I-JSON), nesting, query parameters that pass a pattern but not a store,
times at the ends of the calendar, charsets; and CSV is negotiated and neutralised."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from caller_memory.service.domain.clock import iso_utc
from caller_memory.service.http.analytics_routes import _csv_cell, wants_csv
from caller_memory.service.http.app_keys import METRICS
from caller_memory.service.http.queries import LATEST

from tests.conftest import OPERATOR_TOKEN, Api
from tests.http.test_api import CALLER, CONFIG, assert_problem, memory_path

PROJECT = "cheese-shop"


@pytest.fixture
async def shop(api: Api) -> dict[str, str]:
    tokens = await api.project_with_tokens(PROJECT, CONFIG)
    written = await api.call(
        "PATCH", memory_path(PROJECT), token=tokens["admin"], json={"caller_name": "Ada", "profile": {"a": 1}}
    )
    assert written.status == 200
    tokens["etag"] = written.headers["ETag"]
    return tokens


async def raw_request(api: Api, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send bytes that no HTTP client library would send; the status and body of the answer."""
    host, port = api.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    if body:
        head += b"Content-Length: %d\r\n" % len(body)
    writer.write(head + b"Connection: close\r\n\r\n" + body)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def store_errors(api: Api) -> float:
    return sum(
        sample.value
        for metric in api.app[METRICS].store_errors.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


async def unchanged(api: Api, shop: dict[str, str]) -> None:
    read = await api.call("GET", memory_path(PROJECT), token=shop["agent"])
    assert read.body["fields"] == {"caller_name": "Ada", "profile": {"a": 1}}
    assert read.headers["ETag"] == shop["etag"]


@pytest.mark.parametrize(
    "header",
    [
        b"If-Match: \xff\xfe",
        b'If-Match: "\xc3"',
        b"If-None-Match: \xff",
        b"Accept: text/\xff",
        b"X-Other: \x80",
    ],
)
async def test_a_header_that_is_not_utf8_is_a_400_naming_it(
    api: Api, shop: dict[str, str], header: bytes
) -> None:
    head = (
        b"PATCH /v1/projects/cheese-shop/callers/+14155550100/memory HTTP/1.1\r\nHost: x\r\n"
        b"Authorization: Bearer " + shop["admin"].encode() + b"\r\nContent-Type: application/json\r\n"
        + header + b"\r\n"
    )  # fmt: skip
    status, body = await raw_request(api, head, b'{"caller_name": "Eve"}')
    assert status == 400 and header.split(b":")[0] in body and b"not valid UTF-8" in body
    await unchanged(api, shop)
    assert store_errors(api) == 0


async def test_a_garbled_authorization_header_is_a_failed_authentication(
    api: Api, shop: dict[str, str]
) -> None:
    for attempt in range(25):
        status, body = await raw_request(
            api,
            b"GET /v1/projects/cheese-shop/callers/+14155550100/memory HTTP/1.1\r\nHost: x\r\n"
            b"Authorization: Bearer cm_\xff\xfe" + bytes([0x80 + attempt]) + b"\r\n",
        )
        if status == 429:
            break
        assert status == 401 and b"no token has" in body
    # Counted by the failed-authentication throttle like any other bad credential (20 per minute).
    assert status == 429 and attempt == 20
    assert (await api.call("GET", memory_path(PROJECT), token=shop["agent"])).status == 200


@pytest.mark.parametrize(
    ("value", "mentions"),
    [
        ("9007199254740992", "2^53"),
        ("-9007199254740992", "2^53"),
        ("123456789012345678901234567890", "2^53"),
        ("1e-400", "exactly"),
        ("1e400", "exactly"),
        ("-1e400", "exactly"),
        ("0.10000000000000000001", "exactly"),
    ],
)
async def test_numbers_json_cannot_carry_exactly_are_refused(
    api: Api, shop: dict[str, str], value: str, mentions: str
) -> None:
    for path, token, body in [
        (memory_path(PROJECT), shop["admin"], '{"profile": %s}'),
        (f"/v1/projects/{PROJECT}/conversations/c-1/end", shop["agent"], f'{{"caller": "{CALLER}", "state": {{"profile": %s}}}}'),
    ]:  # fmt: skip
        method = "PATCH" if path.endswith("memory") else "POST"
        reply = await api.call(
            method, path, token=token, data=body % value, headers={"Content-Type": "application/json"}
        )
        assert_problem(reply, 422, mentions=mentions)
    await unchanged(api, shop)


async def test_numbers_a_double_holds_are_kept_exactly(api: Api, shop: dict[str, str]) -> None:
    body = '{"profile": [9007199254740991, -9007199254740991, 0.1, 1.5e300, 5e-324, 1E2, -0.0]}'
    reply = await api.call(
        "PATCH",
        memory_path(PROJECT),
        token=shop["admin"],
        data=body,
        headers={"Content-Type": "application/json"},
    )
    assert reply.status == 200
    assert reply.body["fields"]["profile"] == [
        9007199254740991,
        -9007199254740991,
        0.1,
        1.5e300,
        5e-324,
        100.0,
        -0.0,
    ]


@pytest.mark.parametrize(
    ("body", "member"),
    [
        ('{"caller": "+14155550100", "caller": "+14155550199"}', "caller"),
        ('{"caller": "+14155550100", "state": {"caller_name": "Bo", "caller_name": "Eve"}}', "caller_name"),
        ('{"caller": "+14155550100", "outcome": {"qa": "a", "qa": "b"}}', "qa"),
    ],
)
async def test_duplicate_member_names_are_refused_naming_the_member(
    api: Api, shop: dict[str, str], body: str, member: str
) -> None:
    reply = await api.call(
        "POST",
        f"/v1/projects/{PROJECT}/conversations/c-2/end",
        token=shop["agent"],
        data=body,
        headers={"Content-Type": "application/json"},
    )
    assert_problem(reply, 422, mentions=f"'{member}' appears twice")
    assert reply.body["errors"][0]["field"] == member
    patch = await api.call(
        "PATCH",
        memory_path(PROJECT),
        token=shop["admin"],
        data='{"caller_name": "Bo", "caller_name": "Eve"}',
        headers={"Content-Type": "application/json"},
    )
    assert_problem(patch, 422, mentions="'caller_name' appears twice")
    await unchanged(api, shop)
    # The conversation id was not used up by the refused end: a good end of it now lands.
    good = await api.call(
        "POST", f"/v1/projects/{PROJECT}/conversations/c-2/end", token=shop["agent"], json={"caller": CALLER}
    )
    assert good.status == 200 and good.headers["Idempotent-Replayed"] == "false"


@pytest.mark.parametrize("key", ["booking_day", "not_a_state_key"])
async def test_deep_nesting_is_a_422_whether_or_not_the_key_is_kept(
    api: Api, shop: dict[str, str], key: str
) -> None:
    for depth in (40, 300, 2000, 20_000):
        value = "[" * depth + "]" * depth
        body = f'{{"caller": "{CALLER}", "state": {{"{key}": {value}}}}}'
        reply = await api.call(
            "POST",
            f"/v1/projects/{PROJECT}/conversations/c-3/end",
            token=shop["agent"],
            data=body,
            headers={"Content-Type": "application/json"},
        )
        assert_problem(reply, 422, mentions="nested more than 32 levels")
    await unchanged(api, shop)


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=latin-1", "application/json; charset=utf-16"]
)
async def test_a_charset_other_than_utf8_is_a_415(api: Api, shop: dict[str, str], content_type: str) -> None:
    reply = await api.call(
        "PATCH", memory_path(PROJECT), token=shop["admin"], data=b'{"caller_name": "Eve"}',
        headers={"Content-Type": content_type},
    )  # fmt: skip
    assert_problem(reply, 415, mentions="UTF-8")
    await unchanged(api, shop)
    ok = await api.call(
        "PATCH", memory_path(PROJECT), token=shop["admin"], data=b'{"caller_name": "Eve"}',
        headers={"Content-Type": "application/json; charset=UTF-8"},
    )  # fmt: skip
    assert ok.status == 200


ANALYTICS = "/v1/projects/cheese-shop/analytics/"


@pytest.mark.parametrize(
    "query",
    [
        "from=0001-01-01",
        "to=0001-01-02",
        "from=1969-12-31T23:00:00Z",
        "to=9999-12-31T23:59:59",
        "to=9999-12-31",
        "from=9999-06-01",
        "from=0001-01-01T00:00:00%2B05:00",
        "to=9999-12-31T23:00:00-05:00",
        "from=%D9%A2%D9%A0%D9%A2%D9%A6-11-30",  # Arabic-Indic digits
        "from=2026-11-30%0A",
        "from=2026-13-01",
        "limit=%2B5",
        "limit=1_0",
        "limit=%205",
        "limit=%D9%A5",
        "limit=0",
        "limit=1001",
        "limit=99999999999999999999999",
        "limit=1&limit=2",
        "order=up",
        "repeat=yes",
        "cursor=%FF%FE",
        "cursor=" + "A" * 500,
    ],
)
async def test_analytics_queries_out_of_range_are_422(api: Api, shop: dict[str, str], query: str) -> None:
    for endpoint in ("conversations", "repeat-callers"):
        reply = await api.call("GET", f"{ANALYTICS}{endpoint}?{query}", token=shop["analytics"])
        name = query.split("=")[0]
        if endpoint == "repeat-callers" and name in ("limit", "order", "repeat", "cursor"):
            assert reply.status == 200  # not a parameter of the report: left alone
            continue
        assert_problem(reply, 422)
        assert reply.body["errors"][0]["field"] == name, reply.body
    assert store_errors(api) == 0


async def test_the_calendar_edges_that_are_accepted_are_answered_with_four_digit_years(
    api: Api, shop: dict[str, str]
) -> None:
    reply = await api.call(
        "GET",
        f"{ANALYTICS}repeat-callers?interval=week&from=1970-01-01&to=1970-02-01",
        token=shop["analytics"],
    )
    assert reply.status == 200 and reply.body["from"].startswith("1969-12-29T")
    late = await api.call(
        "GET", f"{ANALYTICS}conversations?from=9998-12-01&to=9999-01-01T00:00:00Z", token=shop["analytics"]
    )
    assert late.status == 200 and late.body["conversations"] == []
    assert iso_utc(-62135596800000) == "0001-01-01T00:00:00Z"
    assert iso_utc(LATEST) == "9999-01-01T00:00:00Z" and iso_utc(0) == "1970-01-01T00:00:00Z"


@pytest.mark.parametrize(
    "before",
    [
        "99999999999999999999",
        "9223372036854775808",
        "0-99999999999999999999",
        "1%0A",
        "%D9%A1%D9%A2",
        "-1",
        "1-",
        "x",
    ],
)
async def test_audit_cursors_a_store_cannot_take_are_422_not_a_store_error(
    api: Api, shop: dict[str, str], before: str
) -> None:
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/audit?before={before}", token=shop["admin"])
    assert_problem(reply, 422)
    assert reply.body["errors"][0]["field"] == "before"
    assert store_errors(api) == 0


@pytest.mark.parametrize(
    "before", ["0", "0-0", "00000000000000000000", "9223372036854775807", "9223372036854775807-1", "5-3"]
)
async def test_audit_cursors_of_either_form_page_on_every_backend(
    api: Api, shop: dict[str, str], before: str
) -> None:
    reply = await api.call("GET", f"/v1/projects/{PROJECT}/audit?before={before}", token=shop["admin"])
    assert reply.status == 200, reply.body
    assert store_errors(api) == 0


@pytest.mark.parametrize("query", ["limit=0", "limit=101", "limit=%2B5", "limit=5&limit=6"])
async def test_sweep_listing_limits(api: Api, query: str) -> None:
    assert_problem(await api.call("GET", f"/v1/admin/sweeps?{query}", token=OPERATOR_TOKEN), 422)
    assert (await api.call("GET", "/v1/admin/sweeps?limit=100", token=OPERATOR_TOKEN)).status == 200


async def test_if_match_star_on_a_caller_without_memory_says_so(api: Api, shop: dict[str, str]) -> None:
    reply = await api.call(
        "PATCH", memory_path(PROJECT, "+14155550199"), token=shop["admin"], json={"caller_name": "Bo"},
        headers={"If-Match": "*"},
    )  # fmt: skip
    assert_problem(reply, 412, mentions="has none")


@pytest.mark.parametrize("header", ["If-Match", "If-None-Match"])
@pytest.mark.parametrize("value", ["5d41402abc4b2a76b971", '"a" "b"', '"a",', "W/", '"' + "a" * 70 + '"'])
async def test_a_malformed_entity_tag_list_is_a_400(
    api: Api, shop: dict[str, str], header: str, value: str
) -> None:
    method, body = ("PATCH", {"caller_name": "Eve"}) if header == "If-Match" else ("GET", None)
    reply = await api.call(
        method, memory_path(PROJECT), token=shop["admin"], json=body, headers={header: value}
    )
    assert_problem(reply, 400, mentions=header)
    await unchanged(api, shop)


async def test_csv_is_negotiated_by_q_value_and_case_insensitively(api: Api, shop: dict[str, str]) -> None:
    cases = {
        "text/csv": "text/csv",
        "TEXT/CSV": "text/csv",
        "text/csv;q=0.5, application/json": "application/json",
        "application/json;q=0.1, text/csv": "text/csv",
        "text/csv;q=0": "application/json",
        "*/*": "application/json",
        "": "application/json",
    }
    for accept, expected in cases.items():
        reply = await api.call(
            "GET", f"{ANALYTICS}conversations", token=shop["analytics"], headers={"Accept": accept}
        )
        assert reply.status == 200 and reply.content_type == expected, accept
    assert wants_csv("text/csv; q=0.9, application/json; q=0.8") and not wants_csv("text/csv;q=x")


@pytest.mark.parametrize(
    "cell",
    [
        "=1+1",
        "+1",
        "-1",
        "@SUM(A1)",
        "|cmd",
        " =1",
        "\t=1",
        "\n=1",
        "\r=1",
        "\u3000=1",
        "\uff1d1",
        "\uff20x",
        "\x00x",
    ],
)
def test_csv_cells_that_could_start_a_formula_are_neutralised(cell: str) -> None:
    assert _csv_cell(cell) == "'" + cell
    assert _csv_cell("resolved") == "resolved"


async def test_a_csv_export_neutralises_what_callers_control(api: Api, shop: dict[str, str]) -> None:
    await api.put_project(PROJECT, {**CONFIG, "analytics_enabled": True})
    end: dict[str, Any] = {"caller": CALLER, "outcome": {"qa": "\uff1dHYPERLINK(1)", "handoff_to": " |cmd"}}
    assert (
        await api.call("POST", f"/v1/projects/{PROJECT}/conversations/c-9/end", token=shop["agent"], json=end)
    ).status == 200
    reply = await api.call(
        "GET", f"{ANALYTICS}conversations", token=shop["analytics"], headers={"Accept": "text/csv"}
    )
    assert "'\uff1dHYPERLINK(1)" in reply.body and "' |cmd" in reply.body


async def test_every_answer_says_nosniff(api: Api, shop: dict[str, str]) -> None:
    for method, path, token in [
        ("GET", "/healthz", None),
        ("GET", "/metrics", None),
        ("GET", "/openapi.json", None),
        ("GET", memory_path(PROJECT), shop["agent"]),
        ("GET", memory_path(PROJECT), "cm_000000000000_nope"),
        ("GET", "/no/such/path", None),
        ("GET", f"{ANALYTICS}conversations", shop["analytics"]),
        ("POST", "/v1/admin/sweeps", OPERATOR_TOKEN),
    ]:
        reply = await api.call(method, path, token=token)
        assert reply.headers["X-Content-Type-Options"] == "nosniff", (method, path, reply.status)
    csv = await api.call(
        "GET", f"{ANALYTICS}conversations", token=shop["analytics"], headers={"Accept": "text/csv"}
    )
    assert csv.content_type == "text/csv" and csv.headers["X-Content-Type-Options"] == "nosniff"


@pytest.mark.parametrize("suffix", ["%0A", "%0D%0A", "%00", "%D9%A1"])
async def test_ids_in_paths_are_matched_whole_and_in_ascii(
    api: Api, shop: dict[str, str], suffix: str
) -> None:
    end = await api.call(
        "POST",
        f"/v1/projects/{PROJECT}/conversations/c-1{suffix}/end",
        token=shop["agent"],
        json={"caller": CALLER},
    )
    assert_problem(end, 422)
    assert_problem(
        await api.call("DELETE", memory_path(PROJECT) + f"/caller_name{suffix}", token=shop["admin"]), 422
    )
    assert_problem(await api.call("GET", f"/v1/projects/{PROJECT}{suffix}", token=OPERATOR_TOKEN), 422)
    revoke = await api.call(
        "DELETE", f"/v1/projects/{PROJECT}/tokens/0123456789ab{suffix}", token=shop["admin"]
    )
    assert_problem(revoke, 404, mentions="12 hex digits")
    await unchanged(api, shop)
    # The well-formed id was not used up by the refused end.
    good = await api.call(
        "POST", f"/v1/projects/{PROJECT}/conversations/c-1/end", token=shop["agent"], json={"caller": CALLER}
    )
    assert good.status == 200 and good.headers["Idempotent-Replayed"] == "false"


async def test_a_token_id_no_token_can_have_is_not_echoed(api: Api, shop: dict[str, str]) -> None:
    revoke = await api.call("DELETE", f"/v1/projects/{PROJECT}/tokens/{'a' * 3000}", token=shop["admin"])
    assert_problem(revoke, 404)
    assert "a" * 20 not in revoke.body["detail"]


async def test_a_weak_if_match_says_it_never_matches(api: Api, shop: dict[str, str]) -> None:
    weak = "W/" + shop["etag"]
    reply = await api.call(
        "PATCH",
        memory_path(PROJECT),
        token=shop["admin"],
        json={"caller_name": "Eve"},
        headers={"If-Match": weak},
    )
    assert_problem(reply, 412, mentions="weak entity tag")
    await unchanged(api, shop)


async def test_the_negotiated_listing_varies_on_accept(api: Api, shop: dict[str, str]) -> None:
    for accept in ("application/json", "text/csv"):
        reply = await api.call(
            "GET", f"{ANALYTICS}conversations", token=shop["analytics"], headers={"Accept": accept}
        )
        assert reply.headers["Vary"] == "Accept"
