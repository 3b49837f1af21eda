"""Agora ConvoAI's notifications to a project (SPEC section 15; the adapter: service/platforms/agora.py).

No token: Agora signs each notification with the connection's secret, which is checked on the raw body before
anything is parsed; a notification unsigned, forged or outside its time window is a 401 and changes nothing.
A notice delivered again (Agora retries an answer it did not get) is answered 200 as a duplicate. Every
notification it did right is answered 200 with what became of it (``outcome``), never a 409 or a 5xx for a
duplicate or a conflict.
"""

from __future__ import annotations

import logging

from aiohttp import web

from ..domain.platforms.verification import EventReplayed, check_first_sighting
from ..domain.projects import Project
from ..platforms import agora
from .app_keys import SERVICES
from .middleware import refuse_unless_admitted
from .openapi_parts import JSON, problem, signed_hook_errors
from .operations import documented
from .platform_routes import INGESTION, PLATFORMS
from .responses import json_response
from .routes import read_body

log = logging.getLogger("caller_memory.platforms")
routes = web.RouteTableDef()

NOTIFICATIONS_PATH = "/v1/projects/{project}/platforms/agora/notifications"
OUTCOME = {
    "type": "object",
    "required": ["outcome"],
    "properties": {
        "outcome": {
            "enum": ["ended", "late", "held", "duplicate", "conflict", "ignored"],
            "description": "What became of the notification.",
        },
        "conversation_id": {"type": "string"},
    },
}


@routes.post(NOTIFICATIONS_PATH)
@documented(
    None,
    "Agora ConvoAI notifications (the project's NCS webhook)",
    {
        "200": {
            "description": "Taken: `ended` (the call ended), `held` (the agent-left or the history, waiting "
            "for the other), `duplicate` (a notice delivered before, or a call ended already), `ignored` "
            "(a notice Caller Memory does not use, or one naming no conversation it started).",
            "content": {JSON: {"schema": OUTCOME}},
        },
        "401": problem(
            "Not signed with the connection's secret as Agora signs (`Agora-Signature-V2`: the hex "
            "HMAC-SHA256 of the body), or a `notifyMs` more than 10 minutes from now. Nothing changed."
        ),
        "404": problem("No such project, or it has no Agora connection."),
        "422": problem("A signed body that is not an Agora notification (`errors` names what is wrong)."),
        "503": problem(
            "The service has as many requests in flight as it allows, the store did not answer, or the "
            "connection's secret does not open with the operator's keys (Agora retries)."
        ),
        **signed_hook_errors(),
    },
    body={
        "required": True,
        "description": "An NCS notification, as Agora sends it.",
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL and the connection's secret as the project's ConvoAI webhook in Agora's console. "
    "102 (agent left) ends the conversation named by the `caller_memory_conversation` label 30 s later, or at "
    "once when 103 (agent history) came first; 103 adds the turns the memory proxy did not record. See "
    "docs/agora.md.",
)
async def agora_notifications(request: web.Request) -> web.Response:
    refuse_unless_admitted(request)  # past the project's share: 429, which Agora retries
    services = request.app[SERVICES]
    project: Project = await services.projects.get(request.match_info["project"])
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    platforms = request.app[PLATFORMS]
    connection = await platforms.get(project, agora.PLATFORM)
    secret = platforms.opened_secret(connection)
    agora.verify(secret, body, request.headers.get(agora.SIGNATURE_HEADER))
    now = services.clock.now_ms()
    notice = agora.read_notice(body, now)
    try:
        await check_first_sighting(
            services.store,
            project=project.project_id,
            platform=agora.PLATFORM,
            event_id=notice.noticeId,
            now_ms=now,
            keep_ms=agora.NOTICE_KEEP_MS,
        )
    except EventReplayed:
        return json_response({"outcome": "duplicate"})
    part = agora.part_of(notice)
    if part is None:
        return json_response({"outcome": "ignored"})
    answer = await request.app[INGESTION].end_part(project, connection, part.end, wait_ms=part.wait_ms)
    log.info("agora: %s %s", part.kind, answer.outcome)
    return json_response({"outcome": answer.outcome, "conversation_id": answer.conversation_id})
