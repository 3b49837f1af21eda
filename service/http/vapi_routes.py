"""Vapi's server messages to a project (SPEC section 15; the adapter: service/platforms/vapi.py).

One Server URL takes every message. With ``auth: "hmac"`` the signature is checked on the raw body before
anything is parsed, its ``x-timestamp`` within 5 minutes, and a signature seen before is a replay: each is a 401
that changes nothing. With ``auth: "bearer"`` the request carries a platform token of the project.

``assistant-request`` is answered within Vapi's deadline whatever the store does: the connection's assistant
with the variables, empty when memory could not be read (the store slow or down, the connection's secret not
opening with the operator's keys). The connection last read is kept in the process for that: with the store
down, its assistant and secret still answer and verify. End messages are answered 200 with what became of them
(``outcome``), never a 409 or a 5xx for a duplicate or a conflict.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from ..domain.errors import Forbidden, Overloaded, StoreUnavailable
from ..domain.platforms.connections import Connection
from ..domain.platforms.service import PlatformsNotConfigured
from ..domain.platforms.variables import start_variables
from ..domain.platforms.verification import check_first_sighting, check_window
from ..domain.projects import Project
from ..domain.tokens import Role
from ..platforms import vapi
from .app_keys import SERVICES
from .middleware import admitted, refuse_unless_admitted
from .openapi_parts import JSON, problem, signed_hook_errors
from .operations import documented
from .platform_routes import INGESTION, PLATFORMS
from .responses import json_response
from .routes import authorize, read_body

log = logging.getLogger("caller_memory.platforms")
routes = web.RouteTableDef()

EVENTS_PATH = "/v1/projects/{project}/platforms/vapi/events"
_STORE_DOWN = (StoreUnavailable, Overloaded, TimeoutError)

ANSWER = {
    "oneOf": [
        {
            "type": "object",
            "description": "The answer to `assistant-request`.",
            "required": ["assistantId", "assistantOverrides"],
            "properties": {
                "assistantId": {"type": "string"},
                "assistantOverrides": {
                    "type": "object",
                    "properties": {
                        "variableValues": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                },
            },
        },
        {
            "type": "object",
            "description": "The answer to any other message.",
            "required": ["outcome"],
            "properties": {
                "outcome": {
                    "enum": ["ended", "started_and_ended", "late", "held", "duplicate", "conflict", "ignored"]
                },
                "conversation_id": {"type": "string"},
            },
        },
    ]
}


async def _connection(request: web.Request, project: Project) -> Connection:
    """The project's Vapi connection, read within the start budget; the one this process read last when the
    store does not answer (404 when there is none; 503 when the store is down and none was read)."""
    found = await request.app[PLATFORMS].for_call(
        project, vapi.PLATFORM, vapi.START_BUDGET_S, fresh=admitted(request)
    )
    if found is None:
        refuse_unless_admitted(request)  # past the project's share, and none read yet: 429, Vapi retries
        raise StoreUnavailable(
            "the store did not answer in time, and this process has not read the project's vapi connection"
        )
    return found


async def _platform_token(request: web.Request) -> None:
    """Refuse a bearer credential that is not a platform token of the path's project (Vapi's bearer mode)."""
    _, principal = await authorize(request, Role.PLATFORM)
    if principal.role is not Role.PLATFORM:
        raise Forbidden("Vapi's bearer credential must hold a token with role 'platform'")


def _fail_open(request: web.Request, project: Project, connection: Connection) -> web.Response:
    """The call-start answer without memory: the assistant, every variable there, empty."""
    answer = request.app[INGESTION].failed_open_answer("")  # counted
    variables = start_variables(answer, project.state_keys, [project.default_region])
    return json_response(vapi.assistant_answer(connection.options["assistant_id"], variables))


@routes.post(EVENTS_PATH)
@documented(
    None,
    "Vapi server messages (the assistant's Server URL)",
    {
        "200": {
            "description": "`assistant-request`: the connection's `assistantId` with "
            "`assistantOverrides.variableValues` (`caller_memory`, `memory_<key>` for every state key, "
            "`returning_caller`, `resume`; empty when memory could not be read or the project holds its share of "
            "the requests in flight). Any other message: what "
            "became of it, `held` (the call's end, waiting for the end-of-call report), `ended`, `duplicate`, "
            "`ignored` (a message Caller Memory does not use).",
            "content": {JSON: {"schema": ANSWER}},
        },
        "401": problem(
            "With `auth: hmac`: not signed with the connection's secret as Vapi's HMAC credential signs "
            "(`x-signature`: the hex HMAC-SHA256 of `{x-timestamp}.{body}`), an `x-timestamp` more than 5 "
            "minutes from now, or a signature seen before. With `auth: bearer`: no valid platform token. "
            "Nothing changed."
        ),
        "403": problem("With `auth: bearer`: a token other than a platform token of the project."),
        "404": problem("No such project, or it has no Vapi connection."),
        "422": problem(
            "A signed body (with `auth: bearer`, an authenticated one) that is not a Vapi server message "
            "(`errors` names what is wrong)."
        ),
        "503": problem(
            "The service has as many requests in flight as it allows, or the store did not answer (never "
            "for `assistant-request` once the connection was read), or the connection's secret does not "
            "open with the operator's keys (an `assistant-request` is answered without memory instead)."
        ),
        **signed_hook_errors(),
        "429": problem(
            "This project already has its share of the requests in flight, for a message other than "
            "`assistant-request` (which is answered without memory then, unless this process has not read "
            "the connection yet); or, with `auth: bearer`, this address made too many failed "
            "authentications lately. Retry after `Retry-After` seconds.",
            "Retry-After",
        ),
    },
    body={
        "required": True,
        "description": 'A Vapi server message, `{"message": {"type": ...}}`.',
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL as the assistant's Server URL in Vapi, with an HMAC credential holding the "
    "connection's secret (or, with `auth: bearer`, a bearer credential holding a platform token). The "
    "connection's `auth` option decides how a message is authenticated: with `hmac` by its signature alone "
    "(no token), with `bearer` by `Authorization: Bearer <a platform token of the project>` alone (no "
    "signature; any other token, the operator's and an admin's included, is refused with 403). "
    "`assistant-request` starts the conversation `vapi:<call.id>`; `status-update` (ended) and "
    "`end-of-call-report` end it once, in either order. See docs/vapi.md.",
)
async def vapi_events(request: web.Request) -> web.Response:
    services = request.app[SERVICES]
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    # Whether it may be a call start, before anything of it is trusted: only a start is answered past the
    # project's share of the requests in flight (without memory), or without a secret that opens.
    may_start = b'"assistant-request"' in body
    if not may_start:
        refuse_unless_admitted(request)  # past the project's share: an end waits for Vapi's retry
    project: Project = await services.projects.get(request.match_info["project"])
    connection = await _connection(request, project)
    bearer = connection.options.get("auth") == "bearer"
    if bearer:
        await _platform_token(request)
    signature: str | None = None
    if not bearer:
        try:
            secret = request.app[PLATFORMS].opened_secret(connection)
        except PlatformsNotConfigured:
            if may_start:  # never parsed unverified: only the fail-open answer, no memory
                return _fail_open(request, project, connection)
            raise
        timestamp = request.headers.get(vapi.TIMESTAMP_HEADER)
        signature = request.headers.get(vapi.SIGNATURE_HEADER)
        vapi.verify(secret, body, signature, timestamp)
        check_window(
            vapi.signed_time_ms(timestamp), services.clock.now_ms(), vapi.WINDOW, platform=vapi.PLATFORM
        )
    message = vapi.read_message(body)
    starting = message.type == "assistant-request"
    if not admitted(request):  # the project holds its share of the requests in flight
        if starting:
            return _fail_open(request, project, connection)  # answered in time, without memory
        refuse_unless_admitted(request)  # an end: Vapi retries it
    if signature is not None:
        try:
            async with asyncio.timeout(vapi.START_BUDGET_S):
                await check_first_sighting(
                    services.store,
                    project=project.project_id,
                    platform=vapi.PLATFORM,
                    event_id=vapi.replay_key(signature),
                    now_ms=services.clock.now_ms(),
                    keep_ms=vapi.WINDOW.keep_ms,
                )
        except _STORE_DOWN:
            if not starting:
                raise
            return _fail_open(request, project, connection)
    if starting:
        return await _start(request, project, connection, message)
    event = vapi.call_end(message)
    if event is None:
        return json_response({"outcome": "ignored"})
    answer = await request.app[INGESTION].end(project, connection, event.end)
    log.info("vapi: %s %s", event.kind, answer.outcome)
    return json_response({"outcome": answer.outcome, "conversation_id": answer.conversation_id})


async def _start(
    request: web.Request, project: Project, connection: Connection, message: vapi.Message
) -> web.Response:
    start = vapi.call_start(message)
    answer = await request.app[INGESTION].start(project, connection, start)
    variables = start_variables(answer, project.state_keys, [project.default_region])
    body: dict[str, Any] = vapi.assistant_answer(connection.options["assistant_id"], variables)
    log.info(
        "vapi: start %s", "failed open" if answer.fail_open else ("retried" if answer.retried else "answered")
    )
    return json_response(body)
