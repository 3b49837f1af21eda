"""Platform connections of a project (SPEC section 15), admin only: put (the secret sealed), read (never the
secret), delete. Thin: parse, call the domain (domain/platforms/service.py), answer its view. Every change is
audited there."""

from __future__ import annotations

import asyncio

from aiohttp import web

from ..domain.errors import Overloaded, StoreUnavailable
from ..domain.platforms.connections import PLATFORM_LIST, Connection, ConnectionBody
from ..domain.platforms.ingestion import PlatformIngestion
from ..domain.platforms.service import PlatformConnections, connection_view
from ..domain.projects import Project
from ..domain.tokens import Role
from .app_keys import SERVICES
from .middleware import admitted
from .openapi_parts import NO_STORE_HEADERS, body_errors, problem, request_body, response
from .operations import documented
from .responses import json_response
from .routes import actor, project_for, read_model

routes = web.RouteTableDef()

#: The connections' use case, set by create_app.
PLATFORMS = web.AppKey("platforms", PlatformConnections)
#: The ingestion rules every platform adapter calls (service/domain/platforms/ingestion.py), set by create_app.
INGESTION = web.AppKey("platform_ingestion", PlatformIngestion)

CONNECTION_PATH = "/v1/projects/{project}/platforms/{platform}"
#: The answers hold a connection's settings: no cache keeps them.
NO_STORE = {"Cache-Control": "no-store"}
CONNECTION_404 = "No such project, or it has no connection to this platform."
UNKNOWN_PLATFORM = f"A platform other than {PLATFORM_LIST}."


@routes.put(CONNECTION_PATH)
@documented(
    "admin",
    "Connect the project to a platform, or change its connection (the secret is never answered)",
    {
        "200": response("The connection, changed.", "PlatformConnection", *NO_STORE_HEADERS),
        "201": response("The connection, made.", "PlatformConnection", *NO_STORE_HEADERS),
        "404": problem("No such project."),
        "422": problem(
            f"{UNKNOWN_PLATFORM} Or a member that is missing or malformed: no `secret` when the connection "
            "is made (Agora, Retell, ElevenLabs, Vapi with `auth: hmac`), a `state_map` value that is not "
            "one of the project's `state_keys`, an `end_grace` out of bounds, an option the platform does "
            "not have or a malformed one (Vapi `auth`/`assistant_id`, ElevenLabs `agent_variables`, "
            "Telnyx `public_key`); `errors` names it."
        ),
        "503": problem(
            "The operator has not set `CALLER_MEMORY_SECRET_KEY` (it encrypts the secret), or the store "
            "did not answer."
        ),
        **body_errors(),
    },
    body=request_body("ConnectionBody", "The connection's settings, and its secret."),
    description="A body without `secret` keeps the stored one. The secret is sealed with the operator's key "
    "and never answered: `secret_set` and `secret_updated_at` say whether and when it was set. Audited "
    "(`platform.connected`, `platform.updated`).",
)
async def put_connection(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    body = await read_model(request, ConnectionBody, "connection")
    connection, created = await request.app[PLATFORMS].put(
        project, request.match_info["platform"], body, actor=actor(request)
    )
    return json_response(connection_view(connection), status=201 if created else 200, headers=NO_STORE)


@routes.get(CONNECTION_PATH)
@documented(
    "admin",
    "The project's connection to a platform (without its secret)",
    {
        "200": response("The connection.", "PlatformConnection", *NO_STORE_HEADERS),
        "404": problem(CONNECTION_404),
        "422": problem(UNKNOWN_PLATFORM),
    },
)
async def get_connection(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    connection = await request.app[PLATFORMS].get(project, request.match_info["platform"])
    return json_response(connection_view(connection), headers=NO_STORE)


@routes.delete(CONNECTION_PATH)
@documented(
    "admin",
    "Remove the project's connection to a platform, and its secret",
    {"204": {"description": "Removed."}, "404": problem(CONNECTION_404), "422": problem(UNKNOWN_PLATFORM)},
    description="Audited (`platform.disconnected`).",
)
async def delete_connection(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    await request.app[PLATFORMS].delete(project, request.match_info["platform"], actor=actor(request))
    return web.Response(status=204)


async def call_start_lookups(
    request: web.Request, platform: str, budget_s: float
) -> tuple[Project | None, Connection | None]:
    """The path's project and its ``platform`` connection for a call start (404 when either does not exist):
    each read within ``budget_s``; when the store does not answer in time (or the project is past its share
    of the requests in flight, for the connection), the project this process has cached and the connection it
    last read (None for what it has not), so that the start is still answered, without memory."""
    services = request.app[SERVICES]
    try:
        async with asyncio.timeout(budget_s):
            project = await services.projects.get(request.match_info["project"])
    except (TimeoutError, StoreUnavailable, Overloaded):
        return None, None
    connection = await request.app[PLATFORMS].for_call(project, platform, budget_s, fresh=admitted(request))
    return project, connection
