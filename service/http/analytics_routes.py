"""Analytics endpoints: conversations with repeat-caller metrics (JSON or CSV), and the repeat-caller report."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from ..domain.analytics import metrics
from ..domain.clock import DAY_MS, HOUR_MS, floor_hour_ms, iso_utc
from ..domain.errors import InvalidInput
from ..domain.tokens import Role
from ..storage.base import ConversationEntry
from .responses import json_response
from .routes import project_for

routes = web.RouteTableDef()

DEFAULT_RANGE_MS = 30 * DAY_MS
CSV_COLUMNS = (
    "conversation_id",
    "ended_at",
    "channel",
    "qa",
    "handoff_reason",
    "handoff_to",
    "repeat",
    "REPEAT_CALLER_CONV_ID",
    "REPEAT_CALLER_DATETIME",
    "REPEAT_CALLER_QA",
    "REPEAT_CALLER_HANDOFF_REASON",
    "REPEAT_CALLER_HANDOFF_TO",
    "time_to_callback_hours",
)


def parse_time(value: str, name: str) -> int:
    """An ISO 8601 date or date-time (UTC unless it carries an offset) as epoch milliseconds."""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidInput(
            f"{name}: not an ISO 8601 date or date-time (e.g. 2026-11-30 or 2026-11-30T14:00:00Z)", field=name
        ) from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return int(parsed.timestamp() * 1000)


def time_range(query: Mapping[str, str], now: int) -> tuple[int, int]:
    """``[from, to)`` from the query, hour-aligned; by default the last 30 days up to the current hour."""
    stop = parse_time(query["to"], "to") if "to" in query else floor_hour_ms(now) + HOUR_MS
    start = parse_time(query["from"], "from") if "from" in query else stop - DEFAULT_RANGE_MS
    start, stop = floor_hour_ms(start), -(-stop // HOUR_MS) * HOUR_MS
    if start >= stop:
        raise InvalidInput("from: must be before to", field="from")
    return start, stop


def entry_body(entry: ConversationEntry) -> dict[str, Any]:
    first = entry.first
    body: dict[str, Any] = {
        "conversation_id": entry.conversation_id,
        "ended_at": iso_utc(entry.hour),
        "channel": entry.channel,
        "qa": entry.qa,
        "handoff_reason": entry.handoff_reason,
        "handoff_to": entry.handoff_to,
        "repeat": first is not None,
    }
    blank = dict.fromkeys(CSV_COLUMNS[7:12])
    body |= metrics(first) or blank
    body["time_to_callback_hours"] = (entry.hour - first.hour) // HOUR_MS if first is not None else None
    return body


def _csv_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    # A cell a spreadsheet would run as a formula is quoted (CSV injection).
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def csv_body(rows: list[dict[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        writer.writerow([_csv_cell(row[column]) for column in CSV_COLUMNS])
    return out.getvalue()


def _flag(query: Mapping[str, str], name: str) -> bool | None:
    if name not in query:
        return None
    value = query[name].lower()
    if value not in ("true", "false"):
        raise InvalidInput(f"{name}: must be true or false", field=name)
    return value == "true"


def _int(query: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(query.get(name, str(default)))
    except ValueError:
        raise InvalidInput(f"{name}: must be a whole number", field=name) from None


@routes.get("/v1/projects/{project}/analytics/conversations")
async def list_conversations(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ANALYTICS)
    query = request.query
    now = services.clock.now_ms()
    start, stop = time_range(query, now)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidInput("order: must be asc or desc", field="order")
    entries, cursor = await services.analytics.conversations(
        project,
        start=start,
        stop=stop,
        repeat=_flag(query, "repeat"),
        cursor=query.get("cursor"),
        limit=_int(query, "limit", 100),
        descending=order == "desc",
        now=now,
    )
    rows = [entry_body(e) for e in entries]
    headers = {"Cache-Control": "no-store"}
    if cursor is not None:
        headers["X-Next-Cursor"] = cursor
        headers["Link"] = f'<{request.rel_url.update_query(cursor=cursor)}>; rel="next"'
    if "text/csv" in request.headers.get("Accept", ""):
        return web.Response(text=csv_body(rows), content_type="text/csv", charset="utf-8", headers=headers)
    return json_response({"conversations": rows, "next_cursor": cursor}, headers=headers)


@routes.get("/v1/projects/{project}/analytics/repeat-callers")
async def repeat_callers(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ANALYTICS)
    now = services.clock.now_ms()
    start, stop = time_range(request.query, now)
    report = await services.analytics.repeat_callers(
        project, start=start, stop=stop, interval=request.query.get("interval", "day"), now=now
    )
    return json_response(report, headers={"Cache-Control": "no-store"})
