"""Query parameters: one typed model per operation, validated once at the edge, before anything reaches a
store. A value that passes its model is one every backend can take; a store error is then always the
store's fault (and counted as one), never the client's.

Numbers are ASCII digits only (``int()`` would also take ``+5``, ``1_0``, `` 5`` and non-ASCII digits), times
are ISO 8601 within :data:`EARLIEST` and :data:`LATEST`, and a parameter given twice is refused rather than
one of its values picked.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema

from ..domain.analytics import MAX_PAGE
from ..domain.attestation import MAX_ATTESTATION_CHARS
from ..domain.audit import AUDIT_ID_HELP, is_audit_id
from ..domain.conversations.messages import MAX_INT
from ..domain.conversations.service import DEFAULT_PAGE as HISTORY_PAGE
from ..domain.conversations.service import MAX_PAGE as MAX_HISTORY_PAGE
from ..domain.errors import InvalidInput
from ..domain.projects import validation_problem
from ..domain.trust import ATTESTATION_HELP, STEP_UP_HELP
from ..domain.webhooks.views import DeliveryState

M = TypeVar("M", bound="QueryModel")

#: The range of times the analytics queries accept: from the Unix epoch to 9999-01-01T00:00:00Z (the year
#: left over is room for rounding a range out to whole hours, days and weeks, all written with four-digit
#: years).
EARLIEST = 0
LATEST = int(datetime(9999, 1, 1, tzinfo=UTC).timestamp() * 1000)
_TIME_EXAMPLE = "2026-11-30 or 2026-11-30T14:00:00Z"
#: The shape of the times the API documents (it also reads the other forms of ISO 8601 that Python's
#: ``datetime.fromisoformat`` reads, e.g. week dates): a date from 1970, optionally a time and an offset.
_TIME_SHAPE = (
    r"^(19[7-9][0-9]|[2-9][0-9]{3})-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    r"(T([01][0-9]|2[0-3])(:[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?)?$"
)
_DIGITS = re.compile(r"[0-9]{1,9}", re.ASCII)
#: A turn id: up to JSON's largest exact integer (16 digits).
_TURN_DIGITS = re.compile(r"[0-9]{1,16}", re.ASCII)
#: Budgets a context may be assembled for, in tokens.
MAX_CONTEXT_TOKENS = 1_000_000
DEFAULT_CONTEXT_TOKENS = 2000
_CURSOR = re.compile(r"[A-Za-z0-9_-]{1,400}", re.ASCII)


def _whole_number(value: Any) -> Any:
    if isinstance(value, str) and not _DIGITS.fullmatch(value):
        raise ValueError("must be a whole number written in digits")
    return value


def _turn_number(value: Any) -> Any:
    if isinstance(value, str):
        if not _TURN_DIGITS.fullmatch(value):
            raise ValueError("must be a whole number written in digits (a turn id)")
        if int(value) > MAX_INT:
            # Said here, with separators: pydantic's own message would name the bound as a bare run of
            # digits, which problem documents mask as a phone number.
            raise ValueError(f"must be at most {MAX_INT:,} (2^53 - 1, the largest turn id)")
    return value


def _time(value: Any) -> Any:
    """An ISO 8601 date or date-time (UTC unless it carries an offset) as epoch milliseconds."""
    if not isinstance(value, str):
        return value
    try:
        if not value.isascii() or len(value) > 40:
            raise ValueError
        parsed = datetime.fromisoformat(value)
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        ms = int(parsed.timestamp() * 1000)
    except (ValueError, OverflowError):
        raise ValueError(f"not an ISO 8601 date or date-time (e.g. {_TIME_EXAMPLE})") from None
    if not EARLIEST <= ms <= LATEST:
        raise ValueError("must be between 1970-01-01T00:00:00Z and 9999-01-01T00:00:00Z")
    return ms


def _audit_id(value: Any) -> Any:
    if not isinstance(value, str) or not is_audit_id(value):
        raise ValueError(AUDIT_ID_HELP)
    return value


def _flag(value: Any) -> Any:
    if isinstance(value, str):
        if value.lower() not in ("true", "false"):
            raise ValueError("must be true or false")
        return value.lower() == "true"
    return value


def _limit(default: int, most: int) -> Any:
    return Field(default=default, ge=1, le=most, description=f"page size, 1 to {most}")


Limit = Annotated[int, BeforeValidator(_whole_number)]
TurnNumber = Annotated[int, Field(ge=0, le=MAX_INT), BeforeValidator(_turn_number)]
Time = Annotated[
    int,
    BeforeValidator(_time),
    WithJsonSchema(
        {
            "type": "string",
            "pattern": _TIME_SHAPE,
            "description": f"ISO 8601 date or date-time, UTC unless an offset is given (e.g. {_TIME_EXAMPLE}), "
            "from 1970-01-01 to 9999-01-01",
        }
    ),
]
Flag = Annotated[bool, BeforeValidator(_flag), WithJsonSchema({"type": "string", "enum": ["true", "false"]})]
AuditId = Annotated[
    str,
    BeforeValidator(_audit_id),
    WithJsonSchema({"type": "string", "pattern": r"^[0-9]{1,20}(-[0-9]{1,20})?$"}),
]


class QueryModel(BaseModel):
    # Parameters no operation knows are left alone (cache busters, tracking parameters); known ones are
    # validated strictly.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class TrustQuery(QueryModel):
    """The reading call's caller-ID trust (an agent's read; admin reads are not calls and ignore it)."""

    attestation: str | None = Field(
        default=None, max_length=MAX_ATTESTATION_CHARS, description=ATTESTATION_HELP
    )
    step_up: Flag | None = Field(default=None, description=f"{STEP_UP_HELP} (true or false; absent: false)")


class MemoryQuery(TrustQuery):
    """``GET /v1/projects/{project}/callers/{identifier}/memory``."""


class CallerConversationsQuery(QueryModel):
    """``GET /v1/projects/{project}/callers/{identifier}/conversations``."""

    limit: Limit = _limit(50, 200)
    cursor: str | None = Field(
        default=None, pattern=f"^{_CURSOR.pattern}$", description="next_cursor of the previous page"
    )


class AuditQuery(QueryModel):
    """``GET /v1/projects/{project}/audit``."""

    limit: Limit = _limit(100, 500)
    before: AuditId | None = Field(default=None, description="next_cursor of the previous page")


class DeliveriesQuery(QueryModel):
    """``GET /v1/projects/{project}/webhooks/deliveries``: the deliveries in one state."""

    webhook_id: str | None = Field(
        default=None, max_length=64, description="only this webhook's (default: every webhook's)"
    )
    state: DeliveryState = Field(
        default="failed",
        description="pending (queued: waiting for an attempt, or in one), failed (every attempt failed) or "
        "delivered (in the last day)",
    )
    limit: Limit = _limit(100, 500)


class SweepsQuery(QueryModel):
    """``GET /v1/admin/sweeps``."""

    limit: Limit = _limit(20, 100)


class RangeQuery(QueryModel):
    from_: Time | None = Field(
        default=None, alias="from", description="start of the range (default: 30 days before to)"
    )
    to: Time | None = Field(default=None, description="end of the range (default: the end of this hour)")


class ConversationsQuery(RangeQuery):
    """``GET /v1/projects/{project}/analytics/conversations``."""

    repeat: Flag | None = Field(default=None, description="only repeat (true) or first (false) calls")
    cursor: str | None = Field(
        default=None, pattern=f"^{_CURSOR.pattern}$", description="next_cursor of the previous page"
    )
    limit: Limit = _limit(100, MAX_PAGE)
    order: Literal["asc", "desc"] = Field(default="desc", description="desc (newest first) or asc")


class RepeatCallersQuery(RangeQuery):
    """``GET /v1/projects/{project}/analytics/repeat-callers``."""

    interval: Literal["hour", "day", "week"] = Field(
        default="day",
        description="bucket size: hour, day or week (ISO weeks, from Monday 00:00 UTC); at most 1000 buckets",
    )


class HistoryQuery(TrustQuery):
    """``GET /v1/projects/{project}/conversations/{conversation_id}/history``."""

    format: Literal["platform", "openai"] = Field(
        default="platform",
        description="platform (the messages with turn ids, times and metadata) or openai ({role, content} "
        "of the user's and the assistant's messages only: what was actually spoken)",
    )
    after_turn: TurnNumber | None = Field(
        default=None,
        description="only the messages of later turns (next_after_turn of the previous page)",
    )
    limit: Limit = Field(
        default=HISTORY_PAGE,
        ge=1,
        le=MAX_HISTORY_PAGE,
        description=f"messages per page, 1 to {MAX_HISTORY_PAGE}; a page ends on a whole turn",
    )


class ContextQuery(TrustQuery):
    """``GET /v1/projects/{project}/conversations/{conversation_id}/context``."""

    max_tokens: Limit = Field(
        default=DEFAULT_CONTEXT_TOKENS,
        ge=1,
        le=MAX_CONTEXT_TOKENS,
        description=f"the token budget of the context, 1 to {MAX_CONTEXT_TOKENS:,}",
    )


def parse_query(request: web.Request, model: type[M]) -> M:
    """The request's query validated as ``model``; errors name each offending parameter."""
    query = request.query
    values: dict[str, str] = {}
    for field_name, info in model.model_fields.items():
        name = info.alias or field_name
        given = query.getall(name, [])
        if len(given) > 1:
            raise InvalidInput(f"{name}: given {len(given)} times; give it once", field=name)
        if given:
            values[name] = given[0]
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise validation_problem(exc, what="query", error=InvalidInput) from None


def query_parameters(model: type[QueryModel]) -> list[dict[str, Any]]:
    """The OpenAPI parameter objects of ``model``, generated from it (so the description cannot drift from
    what the API accepts)."""
    schema = model.model_json_schema(by_alias=True)
    parameters = []
    for name, prop in schema["properties"].items():
        prop = dict(prop)
        description = prop.pop("description", "")
        prop.pop("title", None)
        if "anyOf" in prop:  # Optional[...]: the parameter is optional; its schema is the non-null one
            prop = {**next(p for p in prop.pop("anyOf") if p.get("type") != "null"), **prop}
            prop.pop("default", None)
        if "description" in prop:  # the type's own description (e.g. of a time) completes the parameter's
            description = f"{description}; {prop.pop('description')}"
        parameters.append(
            {"name": name, "in": "query", "required": False, "description": description, "schema": prop}
        )
    return parameters
