"""The shapes of the JSON documents the domain itself builds: the repeat-caller report and the metrics of a
caller's first interaction.

TypedDicts, so that mypy checks every key where they are built and the running code keeps plain dicts (the
HTTP layer serialises them as they are); the ``Annotated`` metadata is read only when the OpenAPI document is
generated from them (service/http/components.py).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, with_config
from typing_extensions import TypedDict  # pydantic reads TypedDicts from typing only on Python 3.12+

#: A time as the API writes it: ISO 8601 in UTC, ``Z``-suffixed.
DateTime = Annotated[
    str, WithJsonSchema({"type": "string", "format": "date-time", "examples": ["2025-01-31T14:00:00Z"]})
]
Count = Annotated[int, Field(ge=0)]
Rate = Annotated[float | None, Field(ge=0, le=1, description="null when there is nothing to divide")]
Interval = Literal["hour", "day", "week"]
CallbackBucketName = Literal["same_hour", "under_1_day", "1_to_7_days", "7_to_30_days", "30_days_or_more"]
_CLOSED = ConfigDict(extra="forbid")


@with_config(_CLOSED)
class RepeatCallerMetrics(TypedDict, total=False):
    """Repeat-caller metrics: the caller's first interaction inside the retention window. Empty for a first
    interaction, and until analytics are enabled."""

    REPEAT_CALLER_CONV_ID: Annotated[
        str, Field(description="Conversation id of the caller's first interaction.")
    ]
    REPEAT_CALLER_DATETIME: Annotated[
        DateTime, Field(description="When it happened, rounded down to the hour.")
    ]
    REPEAT_CALLER_QA: str | None
    REPEAT_CALLER_HANDOFF_REASON: str | None
    REPEAT_CALLER_HANDOFF_TO: str | None


@with_config(_CLOSED)
class ReportTotals(TypedDict):
    """The whole range."""

    conversations: Count
    repeat_conversations: Count
    first_conversations: Count
    repeat_rate: Rate


@with_config(_CLOSED)
class SeriesPoint(TypedDict):
    """One bucket of the range (empty buckets too)."""

    start: DateTime
    conversations: Count
    repeat_conversations: Count
    first_conversations: Count
    repeat_rate: Rate
    distinct_callers: Annotated[Count, Field(description="Distinct callers in this bucket (not additive).")]


@with_config(_CLOSED)
class CallbackBucket(TypedDict):
    """Repeat conversations by the time from the first interaction's hour to the repeat call's hour."""

    bucket: CallbackBucketName
    repeat_conversations: Count
    share: Rate


@with_config(_CLOSED)
class BreakdownRow(TypedDict):
    """Repeat conversations whose first interaction had this value (null: none was recorded)."""

    value: str | None
    repeat_conversations: Count
    share: Rate


@with_config(_CLOSED)
class Breakdowns(TypedDict):
    """Repeat conversations by the outcome of the caller's first interaction, and by their own caller-ID
    attestation (an agent's end that sent none: "unknown"; null: none was recorded, for an end the service or
    an admin made), most frequent first."""

    qa: list[BreakdownRow]
    handoff_reason: list[BreakdownRow]
    handoff_to: list[BreakdownRow]
    attestation: list[BreakdownRow]


RepeatCallerReport = TypedDict(
    "RepeatCallerReport",
    {
        "interval": Interval,
        "from": DateTime,
        "to": DateTime,
        "totals": ReportTotals,
        "series": list[SeriesPoint],
        "time_to_callback": list[CallbackBucket],
        "breakdowns": Breakdowns,
    },
)
# The functional form, because ``from`` is a keyword.
RepeatCallerReport.__doc__ = (
    "The repeat-caller report over ``[from, to)``, computed from per-bucket counters."
)
with_config(_CLOSED)(RepeatCallerReport)
