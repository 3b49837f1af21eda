"""``components.schemas`` of the OpenAPI document, generated from the typed definitions of the bodies: the
request models (schemas.py, the configuration in domain/projects.py, conversation memory's in
domain/transcript_bodies.py) and the response TypedDicts (bodies.py, the report in domain/reports.py,
conversation memory's views in domain/transcript_views.py). A new body adds a model there, not a schema here.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode
from pydantic_core import CoreSchema

from ..domain.conversations import views
from ..domain.conversations.call_trust import TrustBody
from ..domain.conversations.messages import DEFAULT_SOURCE, SOURCES
from ..domain.conversations.requests import AppendBody, StartBody, SummaryBody
from ..domain.limits import MAX_TTL_SECONDS, MIN_TTL_SECONDS
from ..domain.links import LinkBody
from ..domain.platforms.connections import ConnectionBody
from ..domain.platforms.service import PlatformConnection
from ..domain.projects import _ISO_DURATION, PSEUDONYM_PREFIX, ProjectConfig
from ..domain.reports import RepeatCallerReport
from ..domain.webhooks import views as hooks
from ..domain.webhooks.service import WebhookCreate, WebhookRotate
from ..proxy.upstream import LlmConfig, LlmUpstream
from . import bodies
from .schemas import EndRequest, MemoryPatch, TokenCreate

Json = dict[str, Any]
REF_TEMPLATE = "#/components/schemas/{model}"

#: Every JSON document the API answers with (what these refer to is generated with them).
RESPONSES: tuple[Any, ...] = (
    bodies.AuditList,
    bodies.ConversationEnded,
    bodies.ConversationList,
    bodies.ErasureReceipt,
    bodies.Health,
    bodies.LinkCreated,
    bodies.LinkList,
    bodies.LinkRemoved,
    LlmUpstream,
    bodies.Memory,
    bodies.MintedToken,
    bodies.Problem,
    PlatformConnection,
    RepeatCallerReport,
    bodies.SweepList,
    bodies.SweepRun,
    bodies.TokenList,
    views.Appended,
    views.CallerConversations,
    views.Context,
    views.ConversationStatus,
    views.History,
    views.OpenAIHistory,
    views.Started,
    hooks.CallerErasedEvent,
    hooks.ConversationEndedEvent,
    hooks.Webhook,
    hooks.WebhookDelivery,
    hooks.WebhookDeliveryList,
    hooks.WebhookList,
    hooks.WebhookWithSecret,
)
#: Request bodies validated by pydantic. The configuration has its own pair (configuration_schemas).
REQUESTS: tuple[type[BaseModel], ...] = (
    AppendBody,
    ConnectionBody,
    EndRequest,
    LinkBody,
    LlmConfig,
    StartBody,
    SummaryBody,
    TokenCreate,
    TrustBody,
    WebhookCreate,
    WebhookRotate,
)
#: Request bodies that are typed aliases rather than classes, by the name the document gives them.
NAMED_REQUESTS: dict[str, Any] = {"MemoryPatch": MemoryPatch}


class _Generator(GenerateJsonSchema):
    """pydantic's generator, without a title on every property (the document names its schemas, not their
    members; a property's name is its title)."""

    def field_title_should_be_set(self, schema: CoreSchema) -> bool:
        return False


def _generated(types: tuple[Any, ...], mode: JsonSchemaMode) -> dict[str, Json]:
    """The schemas of ``types`` and of everything they refer to, by name."""
    _, top = TypeAdapter.json_schemas(
        [(t, mode, TypeAdapter(t)) for t in types], ref_template=REF_TEMPLATE, schema_generator=_Generator
    )
    defs: dict[str, Json] = top.get("$defs", {})
    return defs


def _model_schemas(
    model: type[BaseModel], prefix: str = "", mode: JsonSchemaMode = "validation"
) -> dict[str, Json]:
    """The model's JSON Schema and its ``$defs`` as ``components/schemas`` entries, named with ``prefix``."""
    schema = model.model_json_schema(
        ref_template=f"#/components/schemas/{prefix}{{model}}", mode=mode, schema_generator=_Generator
    )
    defs: dict[str, Json] = schema.pop("$defs", {})
    out = {prefix + name: body | {"title": prefix + name} for name, body in defs.items()}
    return out | {prefix + model.__name__: schema | {"title": prefix + model.__name__}}


YEARS_AND_MONTHS = "A year counts 365 days, a month 30."


def _accept_seconds(node: Any) -> None:
    """Input durations are an ISO 8601 string or a whole number of seconds (pydantic's schema says 'string')."""
    if isinstance(node, list):
        for item in node:
            _accept_seconds(item)
    elif isinstance(node, dict):
        if node.get("format") != "duration":
            for value in node.values():
                _accept_seconds(value)
            return
        del node["format"], node["type"]
        node["anyOf"] = [
            {"type": "string", "format": "duration", "examples": ["P90D", "PT12H"]},
            {"type": "integer", "minimum": MIN_TTL_SECONDS, "maximum": MAX_TTL_SECONDS},
        ]
        node["description"] = (
            f"An ISO 8601 duration or a whole number of seconds, from {MIN_TTL_SECONDS} s "
            f"to {MAX_TTL_SECONDS // 86400} days. {YEARS_AND_MONTHS}"
        )


def _emit_iso(node: Any) -> None:
    """Output durations are ISO 8601 as pydantic writes them: years, then days ('P1Y35D', 'P10Y9DT23H59M59S').
    JSON Schema's ``duration`` format is RFC 3339's grammar, which wants months between years and days and
    so rejects those; describe them with the pattern the service reads (a stored document can be PUT back)."""
    if isinstance(node, list):
        for item in node:
            _emit_iso(item)
    elif isinstance(node, dict):
        if node.get("format") == "duration":
            del node["format"]
            node["pattern"] = _ISO_DURATION.pattern
            node["description"] = f"An ISO 8601 duration. {YEARS_AND_MONTHS}"
        for value in node.values():
            _emit_iso(value)


def configuration_schemas() -> dict[str, Json]:
    """``ProjectConfig`` (what PUT accepts) and ``StoredProjectConfig`` (what PUT and GET return), from the
    one model: the stored form is its serialisation (``Project.stored_document``)."""
    accepted = _model_schemas(ProjectConfig)
    _accept_seconds(accepted)
    accepted["RepeatCallerConfig"]["properties"]["identifier_blacklist"]["description"] = (
        "Phone numbers (read with `default_region` when they have no country code), or "
        f"`{PSEUDONYM_PREFIX}<32 hex digits>` entries as GET returns them. Nothing is read, written or "
        "counted for these callers."
    )
    stored = _model_schemas(ProjectConfig, "Stored", "serialization")
    _emit_iso(stored)
    for schema in stored.values():  # model_dump writes every field
        schema["required"] = list(schema["properties"])
    rc = stored["StoredRepeatCallerConfig"]["properties"]
    rc["identifier_blacklist"]["items"] = {"type": "string", "pattern": f"^{PSEUDONYM_PREFIX}[0-9a-f]{{32}}$"}
    rc["identifier_blacklist"]["description"] = "Keyed pseudonyms: the service keeps no phone number."
    stored["StoredProjectConfig"]["description"] = (
        "The configuration as stored: durations as ISO 8601 strings, blacklist entries as pseudonyms."
    )
    return accepted | stored


def _describe_sources(schemas: dict[str, Json]) -> None:
    """``metadata.source`` is a string whose allowed values depend on the message's role (a rule pydantic
    checks in a validator, which its schema cannot show): list them, from the table the validator reads."""
    source = schemas["MessageMetadata"]["properties"]["source"]
    every = sorted(set().union(*SOURCES.values()))
    source["anyOf"] = [{"type": "string", "enum": every}, {"type": "null"}]
    by_role = "; ".join(
        f"{role}: {', '.join(sorted(allowed))} (default {DEFAULT_SOURCE[role]})"
        for role, allowed in SOURCES.items()
    )
    source["description"] = f"How the message was made; it must fit the role ({by_role})."


def _merge(into: dict[str, Json], more: dict[str, Json]) -> None:
    for name, schema in more.items():
        if into.setdefault(name, schema) != schema:
            raise ValueError(f"two different schemas are named {name}: rename one of the types")


def component_schemas() -> dict[str, Json]:
    """Every schema of the document, by name, sorted (a new dict on each call)."""
    schemas = configuration_schemas()
    _merge(schemas, _generated(RESPONSES, "serialization"))
    for model in REQUESTS:
        _merge(schemas, _model_schemas(model))
    _describe_sources(schemas)
    for name, alias in NAMED_REQUESTS.items():
        adapter = TypeAdapter[Any](alias)
        _merge(schemas, {name: adapter.json_schema(ref_template=REF_TEMPLATE, schema_generator=_Generator)})
    return dict(sorted(schemas.items()))
