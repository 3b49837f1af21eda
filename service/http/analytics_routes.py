"""Analytics endpoints: conversations with repeat-caller metrics (JSON or CSV), and the repeat-caller report."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from ..domain.clock import DAY_MS, HOUR_MS, ceil_hour_ms, floor_hour_ms, iso_utc
from ..domain.errors import InvalidInput
from ..domain.store import ConversationEntry
from ..domain.tokens import Role
from . import bodies
from .openapi_parts import JSON, THIS_PROJECT, link, problem, ref, response
from .operations import documented
from .queries import EARLIEST, ConversationsQuery, RangeQuery, RepeatCallersQuery, parse_query
from .responses import json_response
from .routes import project_for

routes = web.RouteTableDef()

DEFAULT_RANGE_MS = 30 * DAY_MS
#: The CSV form's columns: the members of a row of the JSON form, in order.
CSV_COLUMNS: tuple[str, ...] = tuple(bodies.ConversationRow.__annotations__)


def time_range(query: RangeQuery, now: int) -> tuple[int, int]:
    """``[from, to)`` from the query, hour-aligned; by default the last 30 days up to the current hour."""
    stop = query.to if query.to is not None else floor_hour_ms(now) + HOUR_MS
    start = query.from_ if query.from_ is not None else max(EARLIEST, stop - DEFAULT_RANGE_MS)
    start, stop = floor_hour_ms(start), ceil_hour_ms(stop)
    if start >= stop:
        raise InvalidInput("from: must be before to", field="from")
    return start, stop


def entry_body(entry: ConversationEntry) -> bodies.ConversationRow:
    body: bodies.ConversationRow = {
        "conversation_id": entry.conversation_id,
        "ended_at": iso_utc(entry.hour),
        "channel": entry.channel,
        "qa": entry.qa,
        "handoff_reason": entry.handoff_reason,
        "handoff_to": entry.handoff_to,
        "repeat": False,
        "REPEAT_CALLER_CONV_ID": None,
        "REPEAT_CALLER_DATETIME": None,
        "REPEAT_CALLER_QA": None,
        "REPEAT_CALLER_HANDOFF_REASON": None,
        "REPEAT_CALLER_HANDOFF_TO": None,
        "time_to_callback_hours": None,
        "ended_by": entry.ended_by,
        "end_reason": entry.end_reason,
        "attestation": entry.attestation,
    }
    first = entry.first
    if first is not None:  # a repeat call: the metrics of the caller's first interaction
        body["repeat"] = True
        body["REPEAT_CALLER_CONV_ID"] = first.conversation_id
        body["REPEAT_CALLER_DATETIME"] = iso_utc(first.hour)
        body["REPEAT_CALLER_QA"] = first.qa
        body["REPEAT_CALLER_HANDOFF_REASON"] = first.handoff_reason
        body["REPEAT_CALLER_HANDOFF_TO"] = first.handoff_to
        body["time_to_callback_hours"] = (entry.hour - first.hour) // HOUR_MS
    return body


#: What a spreadsheet may read as the start of a formula (or of a DDE command): '=', '+', '-', '@', '|', and
#: their full-width forms, and whitespace or a line break before them (some strip it first).
_FORMULA_START = frozenset("=+-@|\uff1d\uff0b\uff0d\uff20\uff5c")


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    # A cell a spreadsheet would run as a formula is quoted (CSV injection): one that starts with a formula
    # character, or with any whitespace or control character (which could hide one).
    if text and (text[0] in _FORMULA_START or text[0].isspace() or not text[0].isprintable()):
        return "'" + text
    return text


def wants_csv(accept: str) -> bool:
    """Content negotiation (RFC 9110 12.5.1) between JSON, the default, and CSV: CSV only if the client
    prefers it (a higher q-value than JSON's; media types are case-insensitive)."""
    csv_q = json_q = -1.0
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value.strip())
                except ValueError:
                    q = 0.0
                q = q if 0.0 <= q <= 1.0 else 0.0
        media = media.lower()
        if media == "text/csv":
            csv_q = max(csv_q, q)
        elif media in ("application/json", "application/*", "*/*"):
            json_q = max(json_q, q)
    return csv_q > 0 and csv_q > json_q


def csv_body(rows: list[bodies.ConversationRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        cells: Mapping[str, object] = row
        writer.writerow([_csv_cell(cells[column]) for column in CSV_COLUMNS])
    return out.getvalue()


@routes.get("/v1/projects/{project}/analytics/conversations")
@documented(
    "analytics",
    "Conversations with their repeat-caller metrics",
    {
        "200": {
            "description": "A page of conversations. With `Accept: text/csv`, the same columns as CSV "
            "(cells that a spreadsheet would run as formulas are prefixed with `'`); the next page is "
            "in `X-Next-Cursor` and `Link`.",
            "headers": {name: ref(name, "headers") for name in ("Cache-Control", "X-Next-Cursor", "Link")},
            "content": {
                JSON: {"schema": ref("ConversationList")},
                "text/csv": {"schema": {"type": "string"}},
            },
        },
        "422": problem("A malformed query parameter; `errors` names it."),
    },
    query=ConversationsQuery,
    links={
        "200": {
            "NextPage": link(
                "list_conversations", THIS_PROJECT | {"query.cursor": "$response.body#/next_cursor"}
            )
        }
    },
)
async def list_conversations(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ANALYTICS)
    query = parse_query(request, ConversationsQuery)
    now = services.clock.now_ms()
    start, stop = time_range(query, now)
    entries, cursor = await services.analytics.conversations(
        project,
        start=start,
        stop=stop,
        repeat=query.repeat,
        cursor=query.cursor,
        limit=query.limit,
        descending=query.order == "desc",
        now=now,
    )
    rows = [entry_body(e) for e in entries]
    # The same URL answers JSON or CSV by Accept: caches must key on it.
    headers = {"Cache-Control": "no-store", "Vary": "Accept"}
    if cursor is not None:
        headers["X-Next-Cursor"] = cursor
        headers["Link"] = f'<{request.rel_url.update_query(cursor=cursor)}>; rel="next"'
    if wants_csv(request.headers.get("Accept", "")):
        return web.Response(text=csv_body(rows), content_type="text/csv", charset="utf-8", headers=headers)
    body: bodies.ConversationList = {"conversations": rows, "next_cursor": cursor}
    return json_response(body, headers=headers)


@routes.get("/v1/projects/{project}/analytics/repeat-callers")
@documented(
    "analytics",
    "Repeat-caller rate over time, time to callback, and breakdowns by the first interaction",
    {
        "200": response(
            "The report, computed from per-bucket counters.", "RepeatCallerReport", "Cache-Control"
        ),
        "422": problem("A malformed query parameter, or too many buckets; `errors` names it."),
    },
    query=RepeatCallersQuery,
)
async def repeat_callers(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ANALYTICS)
    query = parse_query(request, RepeatCallersQuery)
    now = services.clock.now_ms()
    start, stop = time_range(query, now)
    report = await services.analytics.repeat_callers(
        project, start=start, stop=stop, interval=query.interval, now=now
    )
    return json_response(report, headers={"Cache-Control": "no-store"})
