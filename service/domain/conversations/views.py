"""The JSON documents conversation memory answers with (SPEC section 10): TypedDicts, so that mypy checks
every key where they are built; the HTTP layer serialises them as they are and generates their OpenAPI
schemas from them (see reports.py for the pattern)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict

from ..reports import Count, DateTime

_CLOSED = ConfigDict(extra="forbid")
Status = Literal["active", "idle", "ending", "ended"]
EndedBy = Literal["explicit", "inactivity", "superseded"]
TokenSource = Literal["client", "estimate", "mixed"]


@with_config(_CLOSED)
class SummaryCoverage(TypedDict):
    through_turn: Annotated[int, Field(description="The last turn the summary covers.")]
    tokens: Count


@with_config(_CLOSED)
class ConversationStatus(TypedDict):
    conversation_id: str
    status: Annotated[Status, Field(description="active, idle (no activity for idle_after), ending, ended")]
    channel: str
    agent: str | None
    started_at: Annotated[DateTime, Field(description="Rounded down to the hour.")]
    last_activity_at: Annotated[
        DateTime, Field(description="Exact while the conversation is open; rounded down to the hour after.")
    ]
    turn_id: Annotated[int, Field(description="The latest turn id; -1 before the first message.")]
    messages: Count
    tokens: Count
    bytes: Count
    summary: SummaryCoverage | None
    ended_by: EndedBy | None
    end_reason: str | None
    end_processed: Annotated[bool, Field(description="The end's memory write and analytics are done.")]
    expires_at: Annotated[DateTime, Field(description="When the transcript goes (rounded up to the hour).")]


@with_config(_CLOSED)
class MessageMetadataOut(TypedDict):
    source: str
    interrupted: NotRequired[bool]
    interrupt_timestamp: NotRequired[int]
    original: NotRequired[str]
    agent: NotRequired[str]


@with_config(_CLOSED)
class PlatformMessage(TypedDict):
    message_id: NotRequired[str]
    role: Literal["user", "assistant", "tool"]
    content: str
    turn_id: int
    timestamp: Annotated[
        int,
        Field(description="Milliseconds since the epoch; once the conversation ended, since its start."),
    ]
    tokens: NotRequired[int]
    metadata: MessageMetadataOut


@with_config(_CLOSED)
class ChatMessage(TypedDict):
    role: Literal["user", "assistant"]
    content: str


@with_config(_CLOSED)
class History(TypedDict):
    conversation_id: str
    status: Status
    turn_id: int
    started_at: DateTime
    times: Annotated[
        Literal["epoch_ms", "offset_ms"],
        Field(description="epoch_ms while the conversation is open; offset_ms (from its start) once ended."),
    ]
    contents: list[PlatformMessage]
    next_after_turn: Annotated[int | None, Field(description="Pass as after_turn for the next page.")]


@with_config(_CLOSED)
class OpenAIHistory(TypedDict):
    messages: list[ChatMessage]


@with_config(_CLOSED)
class ProfileSection(TypedDict):
    provenance: Literal["caller_memory"]
    tokens: Count
    token_source: Literal["estimate"]
    fields: dict[str, Any]
    omitted: Annotated[list[str], Field(description="Fields left out to keep the profile within its cap.")]
    withheld: Annotated[
        list[str], Field(description="State keys this call does not qualify for (caller-ID trust): left out.")
    ]


@with_config(_CLOSED)
class SummarySection(TypedDict):
    provenance: Literal["agent_summary"]
    tokens: Count
    token_source: TokenSource
    through_turn: int
    text: str


@with_config(_CLOSED)
class RecentTurnsSection(TypedDict):
    provenance: Literal["transcript"]
    tokens: Count
    token_source: TokenSource
    from_turn: int | None
    to_turn: int | None
    dropped_turns: Annotated[Count, Field(description="Unsummarised turns that did not fit, oldest first.")]
    messages: list[ChatMessage]


@with_config(_CLOSED)
class ContextSections(TypedDict):
    profile: ProfileSection
    summary: SummarySection | None
    recent_turns: RecentTurnsSection


@with_config(_CLOSED)
class Context(TypedDict):
    conversation_id: str
    status: Status
    max_tokens: int
    tokens: Annotated[Count, Field(description="The sum of the sections' tokens (at most max_tokens).")]
    unsummarized_tokens: Annotated[Count, Field(description="Tokens of every turn after the summary.")]
    needs_summary: Annotated[
        bool, Field(description="True once the unsummarised turns pass 75% of max_tokens: summarise now.")
    ]
    sections: ContextSections


@with_config(_CLOSED)
class Resume(TypedDict):
    conversation_id: str
    channel: str
    ended_by: EndedBy | None
    end_reason: str | None
    last_activity_at: Annotated[DateTime, Field(description="Rounded down to the hour.")]
    summary: SummarySection | None
    last_turns: Annotated[list[PlatformMessage], Field(description="Times since that conversation's start.")]
    state: Annotated[dict[str, Any] | None, Field(description="Its last state checkpoint.")]
    withheld: Annotated[
        list[str],
        Field(
            description="State keys this call does not qualify for (caller-ID trust): left out of `state`; "
            "`summary` and `last_turns` are left out too when the call does not qualify for the `sensitive` class"
        ),
    ]


@with_config(_CLOSED)
class Started(TypedDict):
    conversation: ConversationStatus | None
    stored: Annotated[bool, Field(description="False: nothing is kept (see reason).")]
    reason: NotRequired[Literal["disabled", "blacklisted", "erased"]]
    resume: Resume | None
    superseded: Annotated[list[str], Field(description="Open conversations this start ended.")]


@with_config(_CLOSED)
class Appended(TypedDict):
    conversation_id: str
    stored: bool
    reason: NotRequired[Literal["disabled", "blacklisted", "erased"]]
    status: Status | None
    turn_id: int
    added: Count
    messages: Count
    bytes: Count
    tokens: Count


@with_config(_CLOSED)
class CallerConversations(TypedDict):
    conversations: Annotated[list[ConversationStatus], Field(description="Newest start first.")]
    next_cursor: Annotated[
        str | None, Field(description="Pass as `cursor` for the next page; null on the last page.")
    ]
