"""A project's connection to one hosted voice platform: the body an admin PUTs, its rules, and the stored
document (its secret sealed: the store never sees it in the clear, and no answer ever holds it).

- ``platform``: one of :data:`PLATFORMS`; ``options`` are checked by that platform's model (Vapi: ``auth``
  and ``assistant_id``; ElevenLabs: ``agent_variables``; Telnyx: ``public_key``, an Ed25519 key; Agora and
  Retell: none). Unknown options are refused.
- ``state_map``: platform field names or dotted paths to the project's ``state_keys`` (checked against the
  project's configuration when the connection is PUT).
- ``end_grace``: an ISO 8601 duration from :data:`MIN_END_GRACE` to :data:`MAX_END_GRACE` (default PT2H).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any, Literal

import orjson
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import InvalidInput
from ..limits import FIELD_NAME_PATTERN, NAME_PATTERN

PLATFORMS: tuple[str, ...] = ("agora", "vapi", "retell", "elevenlabs", "telnyx")
PLATFORM_LIST = ", ".join(PLATFORMS)

DEFAULT_CHANNEL = "phone"
DEFAULT_END_GRACE = timedelta(hours=2)
#: ``end_grace`` bounds: a call's end event is awaited at least this long after its start...
MIN_END_GRACE = timedelta(minutes=5)
#: ...and at most this long (a platform conversation is then ended for inactivity).
MAX_END_GRACE = timedelta(days=2)
#: ``state_map`` entries at most.
MAX_STATE_MAP = 64
#: Longest platform secret (the vendors' are well below it).
MAX_SECRET_CHARS = 512

#: A platform field name or a dotted path into the platform's data (``analysis.customer_name``).
STATE_PATH = re.compile(r"^[A-Za-z0-9_$-]{1,64}(\.[A-Za-z0-9_$-]{1,64}){0,7}$", re.ASCII)
_ISO_HOURS = re.compile(r"^P(?=\d|T\d)(?:(\d+)D)?(?:T(?=\d)(?:(\d+)H)?(?:(\d+)M)?(?:(\d+)S)?)?$", re.ASCII)
END_GRACE_HELP = (
    f"must be an ISO 8601 duration in days, hours, minutes and seconds (such as 'PT2H'), from "
    f"{int(MIN_END_GRACE.total_seconds() // 60)} minutes to {MAX_END_GRACE.days} days"
)


def parse_end_grace(text: str) -> timedelta:
    """``end_grace`` (``PT2H``, ``P1DT6H``, ``PT90M``): days to seconds, within the bounds."""
    match = _ISO_HOURS.fullmatch(text)
    if match is None:
        raise ValueError(END_GRACE_HELP)
    days, hours, minutes, seconds = (int(part or 0) for part in match.groups())
    if max(days, hours, minutes, seconds) > 10**6:
        raise ValueError(END_GRACE_HELP)
    grace = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    if not MIN_END_GRACE <= grace <= MAX_END_GRACE:
        raise ValueError(END_GRACE_HELP)
    return grace


def iso_duration(value: timedelta) -> str:
    """``value`` as ``PT…H…M…S`` (whole seconds), as GET answers ``end_grace``."""
    total = int(value.total_seconds())
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    parts = (
        (f"{hours}H" if hours else "")
        + (f"{minutes}M" if minutes else "")
        + (f"{seconds}S" if seconds else "")
    )
    return "PT" + (parts or "0S")


def _check_grace(text: str) -> str:
    return iso_duration(parse_end_grace(text))


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class NoOptions(_Options):
    """Agora and Retell: no options."""


class VapiOptions(_Options):
    #: How Vapi's server messages are authenticated: an HMAC of the body with the connection's secret, or a
    #: bearer credential (a platform token) in the header, which Vapi documents as replayable.
    auth: Literal["hmac", "bearer"]
    #: The assistant every call-start answer names (also when memory fails open).
    assistant_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")


AgentVariable = Annotated[str, Field(pattern=FIELD_NAME_PATTERN)]


class ElevenLabsOptions(_Options):
    #: The dynamic variables the agent defines: every initiation answer sets each of them.
    agent_variables: list[AgentVariable] = Field(default_factory=list, max_length=64)


def _ed25519_key(text: str) -> str:
    try:
        raw = base64.b64decode(text, validate=True)
        Ed25519PublicKey.from_public_bytes(raw)
    except (binascii.Error, ValueError):
        raise ValueError(
            "must be the base64 of an Ed25519 public key (32 bytes), as Telnyx's portal shows it"
        ) from None
    return text


class TelnyxOptions(_Options):
    #: The account's Ed25519 public key (base64, 32 bytes): Telnyx's webhooks are verified with it.
    public_key: Annotated[str, Field(max_length=100), AfterValidator(_ed25519_key)]


OPTIONS: dict[str, type[_Options]] = {
    "agora": NoOptions,
    "vapi": VapiOptions,
    "retell": NoOptions,
    "elevenlabs": ElevenLabsOptions,
    "telnyx": TelnyxOptions,
}


class ConnectionBody(BaseModel):
    """``PUT /v1/projects/{project}/platforms/{platform}``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    secret: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_SECRET_CHARS,
        description="The platform's signing secret (Agora, Retell, ElevenLabs, Vapi with `auth: hmac`): "
        "sealed, never answered. Required the first time for those; left out, the stored one is kept.",
    )
    state_map: dict[str, Annotated[str, Field(pattern=FIELD_NAME_PATTERN)]] = Field(
        default_factory=dict,
        max_length=MAX_STATE_MAP,
        description="Platform field names or dotted paths of its extracted data, each to a state key of "
        "the project.",
    )
    channel: str = Field(default=DEFAULT_CHANNEL, pattern=NAME_PATTERN, description="The calls' channel.")
    analysis_qa_key: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="The platform's analysis field that becomes the conversation's `outcome.qa`.",
    )
    end_grace: Annotated[str, AfterValidator(_check_grace)] = Field(
        default="PT2H",
        description="How long after its start a platform conversation waits for the platform's end event "
        f"before it is ended for inactivity: an ISO 8601 duration, {END_GRACE_HELP.removeprefix('must be ')}.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Per platform: Vapi `auth` (`hmac` or `bearer`) and `assistant_id`, both required; "
        "ElevenLabs `agent_variables`; Telnyx `public_key` (base64 Ed25519); Agora and Retell none.",
    )

    @field_validator("state_map")
    @classmethod
    def _paths(cls, value: dict[str, str]) -> dict[str, str]:
        for path in value:
            if not STATE_PATH.fullmatch(path):
                raise ValueError(
                    "keys must be platform field names or dotted paths (letters, digits, _, $ and -, at most "
                    "8 parts of 64 characters)"
                )
        return value


def check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise InvalidInput(f"platform: must be one of {PLATFORM_LIST}", field="platform")
    return platform


def check_options(platform: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` checked by the platform's model (errors name ``options.<field>``, never the input)."""
    try:
        model = OPTIONS[platform].model_validate(options)
    except ValidationError as exc:
        errors = [
            {
                "field": ".".join(("options", *(str(p) for p in e["loc"]))),
                "message": _message(e["type"], e["msg"]),
            }
            for e in exc.errors(include_input=False, include_url=False)
        ]
        first = errors[0]
        raise InvalidInput(
            f"{first['field']}: {first['message']} ({platform} options)", field=first["field"], errors=errors
        ) from None
    return model.model_dump()


def _message(kind: str, message: str) -> str:
    if kind == "extra_forbidden":
        return "not an option of this platform"
    return message.removeprefix("Value error, ")


def needs_secret(platform: str, options: dict[str, Any]) -> bool:
    """Whether the platform's webhooks are verified with the connection's secret (Telnyx: its public key;
    Vapi in bearer mode: a platform token)."""
    if platform == "telnyx":
        return False
    return not (platform == "vapi" and options.get("auth") == "bearer")


@dataclass(frozen=True, slots=True)
class Connection:
    """A stored connection: the body's settings, the sealed secret and when it was last set."""

    project: str
    platform: str
    state_map: dict[str, str]
    channel: str
    analysis_qa_key: str | None
    end_grace: str
    options: dict[str, Any]
    sealed_secret: bytes | None
    secret_updated_at: int | None
    updated_at: int

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "v": 1,
                "state_map": self.state_map,
                "channel": self.channel,
                "analysis_qa_key": self.analysis_qa_key,
                "end_grace": self.end_grace,
                "options": self.options,
                "secret": None
                if self.sealed_secret is None
                else base64.b64encode(self.sealed_secret).decode(),
                "secret_updated_at": self.secret_updated_at,
                "updated_at": self.updated_at,
            }
        )

    @classmethod
    def decode(cls, project: str, platform: str, document: bytes) -> Connection:
        data = orjson.loads(document)
        sealed = data["secret"]
        return cls(
            project=project,
            platform=platform,
            state_map=dict(data["state_map"]),
            channel=data["channel"],
            analysis_qa_key=data["analysis_qa_key"],
            end_grace=data["end_grace"],
            options=dict(data["options"]),
            sealed_secret=None if sealed is None else base64.b64decode(sealed),
            secret_updated_at=data["secret_updated_at"],
            updated_at=data["updated_at"],
        )

    @property
    def end_grace_delta(self) -> timedelta:
        return parse_end_grace(self.end_grace)
