"""Routes: parse the request, call the domain, serialise the answer. No business rules here."""

from __future__ import annotations

from typing import Any, TypeVar, cast

import orjson
from aiohttp import web
from pydantic import BaseModel, ValidationError

from ..domain.attestation import MAX_ATTESTATION_CHARS
from ..domain.clock import iso_utc
from ..domain.conversations.ending import Outcome
from ..domain.documents import parse_document
from ..domain.errors import Forbidden, InvalidInput, MalformedRequest, StoreUnavailable, UnsupportedCharset
from ..domain.fields import entity_tags
from ..domain.limits import MAX_VALUE_BYTES
from ..domain.memory import ErasureReceipt, MemoryView
from ..domain.projects import Project, validation_problem
from ..domain.registry import check_project_id
from ..domain.store import TokenRecord
from ..domain.tokens import Principal, Role, platform_may_call
from ..domain.trust import CallTrust
from . import bodies
from .app_keys import METRICS, SERVICES, Services
from .openapi_parts import (
    BAD_CALLER,
    JSON,
    MEMORY_HEADERS,
    MERGE_PATCH,
    THIS_CALLER,
    THIS_CONVERSATION,
    THIS_PROJECT,
    body_errors,
    link,
    problem,
    request_body,
    response,
)
from .operations import documented
from .queries import MemoryQuery, parse_query
from .responses import json_response
from .schemas import EndRequest, TokenCreate

JSON_TYPES = frozenset({"application/json", "application/merge-patch+json"})

routes = web.RouteTableDef()
PRINCIPAL = web.RequestKey("principal", Principal)
PROJECT_LINKS = {
    "GetProject": link("get_project", THIS_PROJECT),
    "CreateToken": link("create_token", THIS_PROJECT),
    "ListTokens": link("list_tokens", THIS_PROJECT),
}
MEMORY_LINKS = {
    "ReadMemory": link("read_memory", THIS_CALLER),
    "ReadMemoryIfChanged": link(
        "read_memory", THIS_CALLER | {"header.If-None-Match": "$response.header.ETag"}
    ),
    "PatchMemoryIfUnchanged": link(
        "patch_memory", THIS_CALLER | {"header.If-Match": "$response.header.ETag"}
    ),
    "EraseCaller": link("erase_caller", THIS_CALLER),
}
PRECONDITION = problem("If-Match did not match; `ETag` holds the current one.", "ETag")
M = TypeVar("M", bound=BaseModel)


def iso(ms: int | None) -> str | None:
    return None if ms is None else iso_utc(ms)


async def read_json(request: web.Request) -> Any:
    return parse_document(await read_body(request))


async def read_body(request: web.Request) -> bytes:
    """The request's body, checked to be a non-empty JSON body in UTF-8 (not yet parsed)."""
    body = await request.read()  # aiohttp enforces client_max_size: 413 beyond it
    if request.content_type not in JSON_TYPES:
        raise web.HTTPUnsupportedMediaType(reason="Unsupported Media Type")
    charset = request.charset
    if charset is not None and charset.lower() not in ("utf-8", "utf8"):
        raise UnsupportedCharset(
            f"the body must be UTF-8 (JSON is, RFC 8259); Content-Type names charset {charset[:40]!r}"
        )
    if not body.strip():
        raise MalformedRequest("the request body is empty; send a JSON object")
    return body


async def read_model(request: web.Request, model: type[M], what: str) -> M:
    """The JSON body validated as ``model``; errors name each offending field."""
    document = await read_json(request)
    try:
        return model.model_validate(document)
    except ValidationError as exc:
        raise validation_problem(exc, what=what, error=InvalidInput) from None


def check_headers(request: web.Request) -> None:
    """Refuse a request whose header values are not text. aiohttp keeps bytes that are not UTF-8 as
    surrogate escapes, which nothing downstream can encode; ``Authorization`` is left to authentication
    (a garbled credential is a failed authentication, and counted as one)."""
    for name, value in request.headers.items():
        if not value.isascii() and name.lower() != "authorization":
            try:
                value.encode()
            except UnicodeEncodeError:
                raise MalformedRequest(f"the {name[:64]} header is not valid UTF-8") from None


async def authorize(request: web.Request, role: Role | None) -> tuple[Services, Principal]:
    """Authenticate the caller and check it may act on the path's project with ``role`` (None: operator)."""
    check_headers(request)
    services = request.app[SERVICES]
    if "project" in request.match_info:
        check_project_id(request.match_info["project"])
    principal = await services.tokens.authenticate(request.headers.get("Authorization"), request.remote or "")
    if role is None:
        principal.require_operator()
    else:
        principal.require(request.match_info["project"], role)
        if principal.role is Role.PLATFORM and not platform_may_call(
            request.rel_url.raw_path, principal.project or ""
        ):
            raise Forbidden("a token with role 'platform' may call only the endpoints platforms call")
    request[PRINCIPAL] = principal
    return services, principal


def actor(request: web.Request) -> str:
    """How audit records name whoever made this (authorized) request."""
    return request[PRINCIPAL].name


async def project_for(request: web.Request, role: Role) -> tuple[Services, Project]:
    """Authorize ``role`` on the path's project and load it (404 if it does not exist)."""
    services, _ = await authorize(request, role)
    return services, await services.projects.get(request.match_info["project"])


_FLAGS = {"true": True, "false": False}


def plain_trust_query(request: web.Request) -> tuple[str | None, bool | None] | None:
    """The read's ``attestation`` and ``step_up`` without a model, for the hot path: no query, or just those
    two, each once and well formed (the attestation's value is checked by the domain); None for anything
    else, which :class:`~.queries.MemoryQuery` then reads (and refuses, naming the parameter)."""
    if not request.query_string:
        return None, None
    query = request.query
    if len(query) > 2 or not {"attestation", "step_up"}.issuperset(query):
        return None
    attestation = query.getall("attestation", [])
    step_up = query.getall("step_up", [])
    if (
        len(attestation) > 1
        or len(step_up) > 1
        or (attestation and len(attestation[0]) > MAX_ATTESTATION_CHARS)
    ):
        return None
    flag = _FLAGS.get(step_up[0]) if step_up else None
    if step_up and flag is None:
        return None
    return (attestation[0] if attestation else None), flag


def call_for(request: web.Request, attestation: str | None, step_up: bool | None) -> CallTrust | None:
    """The caller-ID trust of the call an agent's request is made in. An admin's or the operator's request is
    no call: no trust applies, unless it says what the call's is."""
    principal: Principal = request[PRINCIPAL]
    if (principal.role is Role.AGENT and not principal.operator) or attestation is not None or step_up:
        return CallTrust.of(attestation, step_up)
    return None


def memory_body(view: MemoryView) -> bodies.Memory:
    # The hot path: values go out as the bytes the store holds (orjson.Fragment), in one orjson call.
    return {
        "identifier": view.identifier,
        "fields": {name: orjson.Fragment(value) for name, value in view.fields.items()},
        "expires_at": iso(view.expires_at),
        "valid_until": iso(view.valid_until),
        "blacklisted": view.blacklisted,
        "withheld": list(view.withheld),
        "attestation": cast(Any, view.attestation),
    }


def memory_response(view: MemoryView) -> web.Response:
    return json_response(memory_body(view), headers={"ETag": view.etag, "Cache-Control": "no-store"})


def token_body(record: TokenRecord) -> bodies.Token:
    return {
        "token_id": record.token_id,
        "role": record.role,
        "label": record.label,
        "agent": record.agent or None,
        "created_at": iso_utc(record.created_at),
    }


def minted_body(record: TokenRecord, secret: str) -> bodies.MintedToken:
    return {**token_body(record), "token": secret}


def receipt_body(receipt: ErasureReceipt) -> bodies.ErasureReceipt:
    return {
        "receipt_id": receipt.receipt_id,
        "project": receipt.project,
        "erased_at": iso_utc(receipt.erased_at),
        "removed": {
            "fields": receipt.fields_removed,
            "first_interaction": receipt.first_interaction_removed,
            "conversation_links": receipt.conversations_unlinked,
            "analytics_conversations": receipt.analytics_entries_removed,
            "transcripts": receipt.transcripts_removed,
            "webhook_deliveries": receipt.deliveries_removed,
            "archived_conversations": receipt.archives_removed,
            "links": receipt.links_removed,
        },
        "blacklisted": receipt.blacklisted,
    }


# Health ---------------------------------------------------------------------------------------------------


@routes.get("/healthz")
@documented(None, "Liveness", {"200": response("Alive: `ok`.", "Health")})
async def healthz(request: web.Request) -> web.Response:
    body: bodies.Health = {"status": "ok"}
    return json_response(body)


@routes.get("/readyz")
@documented(
    None,
    "Readiness: the store answers",
    {
        "200": response("Ready.", "Health"),
        "503": response("Not ready: `unready`, with a `detail` (not a problem document).", "Health"),
    },
)
async def readyz(request: web.Request) -> web.Response:
    try:
        await request.app[SERVICES].ping()
    except StoreUnavailable as exc:
        unready: bodies.Health = {"status": "unready", "detail": exc.detail}
        return json_response(unready, status=503)
    ready: bodies.Health = {"status": "ready"}
    return json_response(ready)


# Projects and tokens --------------------------------------------------------------------------------------


@routes.put("/v1/projects/{project}")
@documented(
    "operator",
    "Create or replace a project's configuration",
    {
        "200": response("Replaced; the configuration as stored.", "StoredProjectConfig"),
        "201": response("Created; the configuration as stored.", "StoredProjectConfig"),
        "404": None,  # the operator sees every project; a project token gets 403 first
        "422": problem("Invalid project id or configuration; `errors` names each offending field."),
        **body_errors(),
    },
    body=request_body("ProjectConfig", "The whole configuration document; missing members take defaults."),
    links={"200": PROJECT_LINKS, "201": PROJECT_LINKS},
)
async def put_project(request: web.Request) -> web.Response:
    services, principal = await authorize(request, None)
    document = await read_json(request)
    project, created = await services.projects.apply(
        request.match_info["project"], document, actor=principal.name
    )
    return json_response(project.stored_document(), status=201 if created else 200)


@routes.get("/v1/projects/{project}")
@documented(
    "admin",
    "Read a project's configuration",
    {"200": response("The configuration.", "StoredProjectConfig")},
)
async def get_project(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    return json_response(project.stored_document())


@routes.post("/v1/projects/{project}/tokens")
@documented(
    "admin",
    "Mint a project token",
    {
        "201": response("The new token with its secret, shown once.", "MintedToken", "Cache-Control"),
        "422": problem("Unknown role or member, or a label too long; `errors` names the field."),
        **body_errors(),
    },
    body=request_body("TokenCreate", "The role of the new token, and a label for people."),
    links={
        "201": {"RevokeToken": link("revoke_token", THIS_PROJECT | {"token_id": "$response.body#/token_id"})}
    },
)
async def create_token(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    spec = await read_model(request, TokenCreate, "token request")
    minted = await services.tokens.mint(
        project.project_id,
        spec.role,
        spec.label,
        actor=actor(request),
        agent=spec.agent,
        regions=(project.default_region,),
    )
    return json_response(
        minted_body(minted.record, minted.secret), status=201, headers={"Cache-Control": "no-store"}
    )


@routes.get("/v1/projects/{project}/tokens")
@documented(
    "admin",
    "List the project's tokens",
    {"200": response("No secrets.", "TokenList")},
)
async def list_tokens(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    records = await services.tokens.list(project.project_id)
    body: bodies.TokenList = {"tokens": [token_body(r) for r in records]}
    return json_response(body)


@routes.delete("/v1/projects/{project}/tokens/{token_id}")
@documented(
    "admin",
    "Revoke a token",
    {
        "204": response("Revoked; other replicas refuse it within their token cache time."),
        "404": problem("No such project, or no such token in it."),
    },
)
async def revoke_token(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    await services.tokens.revoke(project.project_id, request.match_info["token_id"], actor=actor(request))
    return web.Response(status=204)


# Caller memory --------------------------------------------------------------------------------------------


@routes.get("/v1/projects/{project}/callers/{identifier}/memory")
@documented(
    "agent",
    "Read a caller's memory",
    {
        "200": response("Live memory; empty for unknown or blacklisted callers.", "Memory", *MEMORY_HEADERS),
        "304": response("Unchanged since an ETag given in If-None-Match.", None, *MEMORY_HEADERS),
        "422": problem(f"{BAD_CALLER}, or an attestation no provider sends."),
    },
    parameters=("If-None-Match",),
    query=MemoryQuery,
    description="An agent's read is a call's: the fields the call's caller-ID trust does not qualify "
    "for are left out and listed in `withheld` (the ETag depends on them). Through a linked "
    "identifier, the profile's memory.",
    links={"200": MEMORY_LINKS},
)
async def read_memory(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.AGENT)
    trust = plain_trust_query(request)
    if trust is None:  # anything unusual: the model says what is wrong
        query = parse_query(request, MemoryQuery)
        trust = query.attestation, query.step_up
    call = call_for(request, *trust)
    view = await services.memory.read(project, request.match_info["identifier"], call)
    if_none_match = request.headers.get("If-None-Match")
    if if_none_match is not None and none_match(if_none_match, view.etag):
        return web.Response(status=304, headers={"ETag": view.etag, "Cache-Control": "no-store"})
    return memory_response(view)


def none_match(header: str, etag: str) -> bool:
    """``If-None-Match`` uses weak comparison (RFC 9110 13.1.2): ``W/"x"`` matches ``"x"`` (whichever of the
    two is weak); ``*`` matches."""
    tags = [tag.removeprefix("W/") for tag in entity_tags(header, "If-None-Match")]
    return "*" in tags or etag.removeprefix("W/") in tags


@routes.patch("/v1/projects/{project}/callers/{identifier}/memory")
@documented(
    "admin",
    "Merge-patch a caller's fields",
    {
        "200": response(
            "The memory after the write; dropped for blacklisted callers.", "Memory", *MEMORY_HEADERS
        ),
        "412": PRECONDITION,
        "422": problem(
            f"{BAD_CALLER}, the body is not an object, a name is not a valid field name or not in "
            f"`state_keys`, or a value is over {MAX_VALUE_BYTES} bytes. Nothing is changed."
        ),
        **body_errors(),
    },
    parameters=("If-Match",),
    body=request_body("MemoryPatch", "Fields to set; `null` deletes.", JSON, MERGE_PATCH),
    links={"200": MEMORY_LINKS},
)
async def patch_memory(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    identifier = request.match_info["identifier"]
    services.memory.caller(project, identifier)  # a bad identifier is reported before the body
    patch = await read_json(request)
    view = await services.memory.patch(project, identifier, patch, request.headers.get("If-Match"))
    return memory_response(view)


@routes.delete("/v1/projects/{project}/callers/{identifier}/memory/{field}")
@documented(
    "admin",
    "Delete one field of a caller's memory",
    {
        "200": response(
            "The memory after the delete (an absent field is no error).", "Memory", *MEMORY_HEADERS
        ),
        "412": PRECONDITION,
        "422": problem(f"{BAD_CALLER}, or the field name is not valid."),
    },
    parameters=("If-Match",),
    links={"200": MEMORY_LINKS},
)
async def delete_field(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    view = await services.memory.delete_field(
        project,
        request.match_info["identifier"],
        request.match_info["field"],
        request.headers.get("If-Match"),
    )
    return memory_response(view)


@routes.delete("/v1/projects/{project}/callers/{identifier}")
@documented(
    "admin",
    "Erase everything about a caller",
    {
        "200": response("The erasure receipt; it holds no phone number.", "ErasureReceipt"),
        "422": problem(f"{BAD_CALLER}."),
    },
    links={"200": {"ReadMemory": MEMORY_LINKS["ReadMemory"], "ListAudit": link("list_audit", THIS_PROJECT)}},
)
async def erase_caller(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    receipt = await services.memory.erase(project, request.match_info["identifier"], actor=actor(request))
    body = receipt_body(receipt)
    request.app[METRICS].erasures.inc()
    return json_response(body)


# Conversations --------------------------------------------------------------------------------------------


@routes.post("/v1/projects/{project}/conversations/{conversation_id}/end")
@documented(
    "agent",
    "End a conversation: persist its state and record its outcome",
    {
        "200": response(
            "What was persisted and ignored; a retry gets the same answer.",
            "ConversationEnded",
            "Idempotent-Replayed",
        ),
        "409": problem(
            "This conversation id was already ended with a different request (or, after the "
            "service ended it, ended late with a different request)."
        ),
        "422": problem(
            "Malformed conversation id, caller that is not a possible phone number, invalid state key "
            "or value, unknown `end_reason` or member; `errors` names the field."
        ),
        **body_errors(),
    },
    body=request_body(
        "EndRequest",
        "The caller, the conversation's state (`conv.state`), its outcome and channel.",
    ),
    description="Idempotent on the conversation id: a retry with the same body applies nothing twice. "
    "With conversation memory on, it also ends the transcript; if the service had already ended it "
    "(by inactivity or supersession), the end is *late*: `late: true`, its state applied as a merge "
    "patch written at its time, analytics as recorded.",
    links={
        "200": {
            "ReadCallerMemory": link("read_memory", THIS_PROJECT | {"identifier": "$request.body#/caller"}),
            "ConversationStatus": link("conversation_status", THIS_CONVERSATION),
            "Retry": link(
                "end_conversation",
                THIS_PROJECT | {"conversation_id": "$response.body#/conversation_id"},
                requestBody="$request.body",
            ),
            "ListConversations": link("list_conversations", THIS_PROJECT),
            "RepeatCallers": link("repeat_callers", THIS_PROJECT),
        }
    },
)
async def end_conversation(request: web.Request) -> web.Response:
    received_at = request.app[SERVICES].clock.now_ms()  # before anything else: an erasure after this wins
    services, project = await project_for(request, Role.AGENT)
    spec = await read_model(request, EndRequest, "end of conversation")
    outcome = Outcome(spec.outcome.qa, spec.outcome.handoff_reason, spec.outcome.handoff_to)
    ended = await services.conversations.end(
        project,
        request.match_info["conversation_id"],
        spec.caller,
        spec.state,
        outcome,
        channel=spec.channel,
        received_at=received_at,
        ended_at=int(spec.ended_at.timestamp() * 1000) if spec.ended_at is not None else None,
        end_reason=spec.end_reason,
        call=call_for(request, spec.attestation, spec.step_up),
    )
    body: bodies.ConversationEnded = {
        "conversation_id": ended.conversation_id,
        "persisted": ended.persisted,
        "ignored": ended.ignored,
        "blacklisted": ended.blacklisted,
        "erased": ended.erased,
        "repeat_caller": ended.repeat_caller,
        "late": ended.late,
        "withheld": ended.withheld,
    }
    return json_response(body, headers={"Idempotent-Replayed": "true" if ended.replayed else "false"})
