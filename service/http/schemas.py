"""Request bodies, validated with pydantic (the configuration document lives in domain/projects.py); the
response bodies are in bodies.py. Both generate ``components.schemas`` of the OpenAPI document."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from ..domain.attestation import MAX_ATTESTATION_CHARS
from ..domain.limits import (
    FIELD_NAME_PATTERN,
    MAX_ANY_IDENTIFIER_CHARS,
    MAX_OUTCOME_CHARS,
    MAX_STATE_ENTRIES,
    MAX_VALUE_BYTES,
    NAME_PATTERN,
)
from ..domain.trust import ATTESTATION_HELP, STEP_UP_HELP


class TokenCreate(BaseModel):
    """``POST /v1/projects/{project}/tokens``."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["agent", "analytics", "admin", "platform", "staff"]
    label: str = Field(
        default="", max_length=100, description="A note for people, e.g. 'cheese-shop agent prod'"
    )
    agent: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Role `agent` only: the agent of a multi-agent system this token acts as. Under "
        "`transcript_scope: \"agent\"` it reads the user's messages and this agent's only.",
    )


class OutcomeIn(BaseModel):
    """How the conversation ended; recorded for repeat-caller analytics."""

    model_config = ConfigDict(extra="forbid")

    qa: str | None = Field(
        default=None, max_length=MAX_OUTCOME_CHARS, description="QA outcome, e.g. 'resolved'"
    )
    handoff_reason: str | None = Field(default=None, max_length=MAX_OUTCOME_CHARS)
    handoff_to: str | None = Field(default=None, max_length=MAX_OUTCOME_CHARS)


class EndRequest(BaseModel):
    """``POST /v1/projects/{project}/conversations/{conversation_id}/end``."""

    model_config = ConfigDict(extra="forbid")

    caller: str = Field(
        max_length=MAX_ANY_IDENTIFIER_CHARS,
        description="the caller's identifier: a phone number, `email:...` or `account:...`",
    )
    attestation: str | None = Field(
        default=None,
        max_length=MAX_ATTESTATION_CHARS,
        description=ATTESTATION_HELP,
    )
    step_up: bool = Field(default=False, strict=True, description=STEP_UP_HELP)
    state: dict[str, Any] = Field(
        default_factory=dict,
        max_length=MAX_STATE_ENTRIES,
        description="conv.state: keys in state_keys are persisted (null deletes), others are reported as ignored",
    )
    outcome: OutcomeIn = Field(default_factory=OutcomeIn)
    channel: str | None = Field(default=None, max_length=MAX_OUTCOME_CHARS, description="e.g. 'voice'")
    ended_at: AwareDatetime | None = Field(
        default=None,
        description="When the conversation ended (the client's first attempt to send this): an erasure of the "
        "caller after that moment wins over this write, however late it is delivered",
    )
    end_reason: Literal["completed", "dropped", "transferred"] | None = Field(
        default=None,
        description="How the call ended; a conversation that ended `dropped` is offered as `resume` when the "
        "caller calls back on the same channel within resume_window",
    )


#: ``PATCH /v1/projects/{project}/callers/{identifier}/memory``. Read as a document, not through pydantic:
#: the domain checks each member against the project's ``state_keys`` (memory.py); this is its schema.
MemoryPatch = Annotated[
    dict[str, Any],
    Field(
        description="JSON Merge Patch (RFC 7396) of the top level: each member sets a field, `null` deletes "
        "it, other fields are untouched. Every name must be in the project's `state_keys`; values are any "
        f"JSON of at most {MAX_VALUE_BYTES} bytes.",
        json_schema_extra={"propertyNames": {"pattern": FIELD_NAME_PATTERN}},
    ),
]
