"""Project configuration: validation, the stored form, and the compiled form used on the hot path."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated, Any, Literal

import orjson
import phonenumbers
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from .errors import InvalidConfiguration, InvalidIdentifier, InvalidInput
from .identifiers import PSEUDONYM_RE, Pseudonymizer, parse_identifier
from .limits import (
    CONVERSATION_ID_PATTERN,
    FIELD_NAME_PATTERN,
    MAX_BLACKLIST,
    MAX_STATE_KEYS,
    MAX_TTL_SECONDS,
    MIN_TTL_SECONDS,
    NAME_PATTERN,
)
from .trust import DEFAULT_CLASS, LEVELS, TrustPolicy

FieldName = Annotated[str, Field(pattern=FIELD_NAME_PATTERN)]
PSEUDONYM_PREFIX = "pseudonym:"
DEFAULT_RETENTION = timedelta(days=90)


def _check_duration(value: timedelta) -> timedelta:
    seconds = value.total_seconds()
    if seconds != int(seconds):
        raise ValueError("must be a whole number of seconds")
    if not MIN_TTL_SECONDS <= seconds <= MAX_TTL_SECONDS:
        raise ValueError(
            f"must be between {MIN_TTL_SECONDS} second and {MAX_TTL_SECONDS // 86400} days "
            "(an ISO 8601 duration such as 'P90D' or 'PT12H', or a number of seconds)"
        )
    return value


DURATION_HELP = "must be an ISO 8601 duration such as 'P90D' or 'PT12H', or a whole number of seconds"
_ISO_DURATION = re.compile(
    r"^P(?=\d|T\d)(?:\d+Y)?(?:\d+M)?(?:\d+W)?(?:\d+D)?(?:T(?=\d)(?:\d+H)?(?:\d+M)?(?:\d+(?:\.\d+)?S)?)?$",
    re.ASCII,
)


def _duration_input(value: Any) -> Any:
    """Only the two documented forms; pydantic alone would also take '90 days', '12:00:00' or even true."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(DURATION_HELP)
    if isinstance(value, str) and not _ISO_DURATION.fullmatch(value):
        raise ValueError(DURATION_HELP)
    return value


Duration = Annotated[timedelta, BeforeValidator(_duration_input), AfterValidator(_check_duration)]


class RepeatCallerConfig(BaseModel):
    """``memory.repeat_caller``: what is kept about callers, and for how long."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    analytics_enabled: bool = False
    state_keys: list[FieldName] = Field(default_factory=list, max_length=MAX_STATE_KEYS)
    identifier_blacklist: list[str] = Field(default_factory=list, max_length=MAX_BLACKLIST)
    retention: Duration = DEFAULT_RETENTION
    field_ttls: dict[FieldName, Duration] = Field(default_factory=dict)
    default_region: str | None = None
    #: Linked identifiers (SPEC section 13): off unless the project's purpose needs them.
    identity_linking: bool = False
    #: State key -> class (a key without one is ``personal``); class -> the trust level it needs.
    field_classes: dict[FieldName, FieldName] = Field(default_factory=dict)
    trust: dict[FieldName, Literal["any", "A_or_B", "A", "step_up"]] = Field(default_factory=dict)
    #: How a call without attestation counts.
    unknown_attestation: Literal["A", "B", "C", "failed"] = "C"

    @field_validator("state_keys")
    @classmethod
    def _unique_keys(cls, value: list[str]) -> list[str]:
        seen: set[str] = set()
        for name in value:
            if name in seen:
                raise ValueError(f"'{name}' is listed twice")
            seen.add(name)
        return value

    @field_validator("default_region")
    @classmethod
    def _region(cls, value: str | None) -> str | None:
        if value is None:
            return None
        # ASCII before any case mapping: the fi ligature upper-cases to 'FI', a long s and e to 'SE'.
        region = value.upper() if value.isascii() else ""
        if region not in phonenumbers.SUPPORTED_REGIONS:
            raise ValueError("is not a region code known to libphonenumber (ISO 3166-1 alpha-2, e.g. 'GB')")
        return region


#: Defaults of ``memory.conversation`` (SPEC section 14's table).
DEFAULT_TRANSCRIPT_RETENTION = timedelta(days=1)
DEFAULT_MAX_TRANSCRIPT_BYTES = 1 << 30


class ConversationConfig(BaseModel):
    """``memory.conversation``: conversation memory (transcripts) of this project's calls."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = False
    # Durations left out get their defaults (P1D, PT2M, PT30M, PT10M), shrunk to fit a shorter retention
    # (see _with_defaults): the stored configuration always shows the values in force.
    transcript_retention: Duration | None = None
    idle_after: Duration | None = None
    end_after_inactivity: Duration | None = None
    resume_window: Duration | None = None
    redact_phone_numbers: bool = True
    transcript_scope: Literal["shared", "agent"] = "shared"
    cross_channel: bool = False
    max_transcript_bytes: int = Field(default=DEFAULT_MAX_TRANSCRIPT_BYTES, ge=1024, le=1 << 50)
    #: Write each ended conversation once to the archive (cold storage: CALLER_MEMORY_ARCHIVE_URL).
    archive: bool = False
    #: How long archived conversations are kept (default: transcript_retention; at most retention).
    archive_retention: Duration | None = None


class MemoryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    repeat_caller: RepeatCallerConfig = Field(default_factory=RepeatCallerConfig)
    conversation: ConversationConfig = Field(default_factory=ConversationConfig)


class ProjectConfig(BaseModel):
    """The whole configuration document of a project (``PUT /v1/projects/{project}``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)


def _location(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(("." if parts else "") + item)
    return "".join(parts)


#: Patterns named in words rather than quoted (a regular expression is no message for a newcomer).
_PATTERN_WORDS = {
    FIELD_NAME_PATTERN: "field names are a letter or '_' then letters, digits or '_', 64 characters at most",
    NAME_PATTERN: "must be 1-64 letters, digits, '.', '_', ':' or '-', starting with a letter or digit",
    CONVERSATION_ID_PATTERN: (
        "must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
    ),
}


def _message(err: Any, where: str) -> str:
    """pydantic's message in the service's words. Bounds are written with separators: a bare long number
    would be masked in the answer as if it were a phone number."""
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind == "string_pattern_mismatch" and ctx.get("pattern") in _PATTERN_WORDS:
        return _PATTERN_WORDS[ctx["pattern"]]
    bounds = {
        "less_than_equal": ("must be at most", "le"),
        "greater_than_equal": ("must be at least", "ge"),
        "less_than": ("must be less than", "lt"),
        "greater_than": ("must be more than", "gt"),
    }
    if kind in bounds and isinstance(ctx.get(bounds[kind][1]), int):
        words, key = bounds[kind]
        return f"{words} {ctx[key]:,}"
    if kind == "too_long" and isinstance(ctx.get("max_length"), int):
        return f"at most {ctx['max_length']:,} items in one request"
    if kind == "string_too_long" and isinstance(ctx.get("max_length"), int):
        return f"at most {ctx['max_length']:,} characters"
    if kind == "literal_error" and where.endswith("role"):
        return f"must be {ctx.get('expected', 'one of the roles')} (system prompts are never stored)"
    return str(err["msg"]).removeprefix("Value error, ")


def validation_problem(
    exc: ValidationError, *, what: str = "configuration", error: type[InvalidInput] = InvalidConfiguration
) -> InvalidInput:
    """Turn a pydantic error into a domain error naming each offending field, without echoing input values."""
    errors = []
    for err in exc.errors(include_input=False, include_url=False):
        where = _location(tuple(err["loc"]))
        message = _message(err, where)
        field = where or "body"
        errors.append({"field": field, "message": message})
    detail = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
    return error(f"invalid {what}: {detail}", field=errors[0]["field"], errors=errors)


def parse_config(document: Any) -> ProjectConfig:
    """Validate a configuration document (already decoded JSON)."""
    if not isinstance(document, dict):
        raise InvalidConfiguration("the configuration must be a JSON object", field="body")
    try:
        config = ProjectConfig.model_validate(document)
    except ValidationError as exc:
        raise validation_problem(exc) from None
    _cross_check(config.memory.repeat_caller)
    conversation = _with_defaults(config.memory.conversation, config.memory.repeat_caller.retention)
    return config.model_copy(
        update={"memory": config.memory.model_copy(update={"conversation": conversation})}
    )


def _with_defaults(cc: ConversationConfig, retention: timedelta) -> ConversationConfig:
    """The block with every duration filled in, checked against SPEC section 14's constraints (each error
    names the offending field). A default never breaks a constraint: it shrinks to fit."""
    base = "memory.conversation."
    transcript_retention = cc.transcript_retention or min(DEFAULT_TRANSCRIPT_RETENTION, retention)
    # An inactivity end needs the transcript (its checkpoint): it must come before the transcript expires.
    end_after = cc.end_after_inactivity or min(timedelta(minutes=30), transcript_retention)
    idle_after = cc.idle_after or min(timedelta(minutes=2), end_after / 2)
    if cc.idle_after is None and idle_after.total_seconds() != int(idle_after.total_seconds()):
        idle_after = timedelta(seconds=int(idle_after.total_seconds()))
    resume_window = cc.resume_window or min(timedelta(minutes=10), transcript_retention)
    archive_retention = cc.archive_retention or transcript_retention
    rules = (
        (
            "transcript_retention",
            transcript_retention <= retention,
            "cannot be longer than repeat_caller.retention",
        ),
        (
            "end_after_inactivity",
            end_after <= transcript_retention,
            "cannot be longer than transcript_retention (the inactivity end persists the transcript's "
            "last checkpoint, so it must come before the transcript expires)",
        ),
        ("idle_after", idle_after < end_after, "must be shorter than end_after_inactivity"),
        (
            "resume_window",
            resume_window <= transcript_retention,
            "cannot be longer than transcript_retention",
        ),
        (
            "archive_retention",
            archive_retention <= retention,
            "cannot be longer than repeat_caller.retention",
        ),
        (
            "archive",
            cc.enabled or not cc.archive,
            "needs conversation memory (memory.conversation.enabled): the archive keeps transcripts",
        ),
    )
    for name, holds, message in rules:
        if not holds:
            raise InvalidConfiguration(f"{base}{name}: {message}", field=base + name)
    return cc.model_copy(
        update={
            "transcript_retention": transcript_retention,
            "end_after_inactivity": end_after,
            "idle_after": idle_after,
            "resume_window": resume_window,
            "archive_retention": archive_retention,
        }
    )


def archive_retention_ms(config: ProjectConfig) -> int:
    """How long the project keeps archived conversations, its defaults applied (milliseconds)."""
    rc = config.memory.repeat_caller
    cc = _with_defaults(config.memory.conversation, rc.retention)
    return _ms(cc.archive_retention or rc.retention)


def _cross_check(rc: RepeatCallerConfig) -> None:
    """Rules that involve several fields; each error names the exact offending field."""
    base = "memory.repeat_caller."
    for name, ttl in rc.field_ttls.items():
        if name not in rc.state_keys:
            raise InvalidConfiguration(
                f"{base}field_ttls.{name}: '{name}' is not in state_keys", field=f"{base}field_ttls.{name}"
            )
        if ttl > rc.retention:
            raise InvalidConfiguration(
                f"{base}field_ttls.{name}: a field TTL cannot be longer than retention",
                field=f"{base}field_ttls.{name}",
            )
    _check_trust(rc)
    for index, entry in enumerate(rc.identifier_blacklist):
        where = f"{base}identifier_blacklist[{index}]"
        if entry.startswith(PSEUDONYM_PREFIX):
            if not PSEUDONYM_RE.match(entry[len(PSEUDONYM_PREFIX) :]):
                raise InvalidConfiguration(
                    f"{where}: a pseudonym entry is 'pseudonym:' and 32 lowercase hex digits", field=where
                )
            continue
        try:
            parse_identifier(entry, rc.default_region)
        except InvalidIdentifier as exc:
            raise InvalidConfiguration(f"{where}: {exc.detail}", field=where) from None


def _check_trust(rc: RepeatCallerConfig) -> None:
    """``field_classes`` names state keys; every class in use has a level; ``trust`` names classes in use."""
    base = "memory.repeat_caller."
    for name in rc.field_classes:
        if name not in rc.state_keys:
            where = f"{base}field_classes.{name}"
            raise InvalidConfiguration(f"{where}: '{name}' is not in state_keys", field=where)
    classes = {DEFAULT_CLASS, *rc.field_classes.values()}
    for name in sorted(classes - {DEFAULT_CLASS}):
        if name not in rc.trust:
            where = f"{base}trust.{name}"
            raise InvalidConfiguration(
                f"{where}: class '{name}' (in field_classes) needs a trust level: one of {', '.join(LEVELS)}",
                field=where,
            )
    for name in rc.trust:
        if name not in classes:
            where = f"{base}trust.{name}"
            raise InvalidConfiguration(
                f"{where}: no state key is of class '{name}' (field_classes names the classes in use; "
                f"unclassified keys are '{DEFAULT_CLASS}')",
                field=where,
            )


def _ms(value: timedelta) -> int:
    return int(value.total_seconds()) * 1000


@dataclass(frozen=True, slots=True)
class ConversationSettings:
    """``memory.conversation`` compiled: durations in milliseconds, defaults applied."""

    enabled: bool
    transcript_retention_ms: int
    idle_after_ms: int
    end_after_inactivity_ms: int
    resume_window_ms: int
    redact_phone_numbers: bool
    #: ``transcript_scope: "agent"``: an agent token sees the user's messages and its own agent's only.
    agent_scope: bool
    cross_channel: bool
    max_transcript_bytes: int
    archive: bool = False
    archive_retention_ms: int = 0


@dataclass(frozen=True, slots=True)
class Project:
    """A project's configuration compiled for the hot path. ``stored`` is what the store keeps."""

    project_id: str
    config: ProjectConfig
    ttl_ms: dict[str, int]  # state key -> TTL in milliseconds
    retention_ms: int
    blacklist: frozenset[str]  # pseudonyms
    default_region: str | None
    analytics_enabled: bool
    conversation: ConversationSettings
    trust: TrustPolicy = field(default_factory=TrustPolicy)
    identity_linking: bool = False

    @property
    def state_keys(self) -> list[str]:
        return self.config.memory.repeat_caller.state_keys

    def stored_document(self) -> dict[str, Any]:
        """The configuration as stored and as returned by the API: blacklist entries as pseudonyms."""
        document: dict[str, Any] = self.config.model_dump(mode="json")
        document["memory"]["repeat_caller"]["identifier_blacklist"] = sorted(
            PSEUDONYM_PREFIX + p for p in self.blacklist
        )
        return document

    def stored_bytes(self) -> bytes:
        return orjson.dumps(self.stored_document())


def compile_project(project_id: str, config: ProjectConfig, pseudonymizer: Pseudonymizer) -> Project:
    rc = config.memory.repeat_caller
    retention_ms = int(rc.retention.total_seconds()) * 1000
    ttl_ms = {
        name: int(rc.field_ttls.get(name, rc.retention).total_seconds()) * 1000 for name in rc.state_keys
    }
    blacklist = set()
    for entry in rc.identifier_blacklist:
        if entry.startswith(PSEUDONYM_PREFIX):
            blacklist.add(entry[len(PSEUDONYM_PREFIX) :])
        else:
            blacklist.add(pseudonymizer.pseudonym(project_id, parse_identifier(entry, rc.default_region)))
    # The compiled form keeps no raw number: the config is rebuilt with pseudonym entries only.
    clean = config.model_copy(
        update={
            "memory": config.memory.model_copy(
                update={
                    "repeat_caller": rc.model_copy(
                        update={"identifier_blacklist": sorted(PSEUDONYM_PREFIX + p for p in blacklist)}
                    )
                }
            )
        }
    )
    cc = _with_defaults(config.memory.conversation, rc.retention)
    conversation = ConversationSettings(
        enabled=cc.enabled,
        transcript_retention_ms=_ms(cc.transcript_retention or rc.retention),
        idle_after_ms=_ms(cc.idle_after or rc.retention),
        end_after_inactivity_ms=_ms(cc.end_after_inactivity or rc.retention),
        resume_window_ms=_ms(cc.resume_window or rc.retention),
        redact_phone_numbers=cc.redact_phone_numbers,
        agent_scope=cc.transcript_scope == "agent",
        cross_channel=cc.cross_channel,
        max_transcript_bytes=cc.max_transcript_bytes,
        archive=cc.archive,
        archive_retention_ms=_ms(cc.archive_retention or rc.retention),
    )
    return Project(
        conversation=conversation,
        project_id=project_id,
        config=clean,
        ttl_ms=ttl_ms,
        retention_ms=retention_ms,
        blacklist=frozenset(blacklist),
        default_region=rc.default_region,
        analytics_enabled=rc.analytics_enabled,
        trust=TrustPolicy.build(rc.state_keys, rc.field_classes, rc.trust, rc.unknown_attestation),
        identity_linking=rc.identity_linking,
    )
