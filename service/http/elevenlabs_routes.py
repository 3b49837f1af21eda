"""ElevenLabs Agents' webhooks to a project (SPEC section 15; the adapter: service/platforms/elevenlabs.py).

- ``POST .../platforms/elevenlabs/initiation``: the conversation-initiation webhook. ElevenLabs sends only the
  static headers configured with it, so a platform token of the project goes in ``Authorization: Bearer``. The
  answer (200) comes within a second whatever memory does: with the store slow or down it has every agent
  variable, empty, and the conversation id (fail-open), never an error for a call that should go ahead.
- ``POST .../platforms/elevenlabs/events``: the post-call webhooks, signed with the connection's secret
  (``ElevenLabs-Signature``), checked on the raw body before anything is parsed; unsigned, forged, outside the
  window or replayed: 401, nothing changed. Every event it did right is answered 200 with what became of it.
"""

from __future__ import annotations

import logging

from aiohttp import web

from ..domain.platforms.connections import Connection
from ..domain.platforms.records import CallStart
from ..domain.platforms.variables import start_variables
from ..domain.platforms.verification import check_first_sighting
from ..domain.projects import Project
from ..domain.tokens import Role
from ..platforms import elevenlabs
from .app_keys import SERVICES
from .middleware import admitted, refuse_unless_admitted
from .openapi_parts import JSON, platform_body_errors, problem, signed_hook_errors
from .operations import documented
from .platform_routes import INGESTION, PLATFORMS
from .responses import json_response
from .routes import project_for, read_body

log = logging.getLogger("caller_memory.platforms")
routes = web.RouteTableDef()

INITIATION_PATH = "/v1/projects/{project}/platforms/elevenlabs/initiation"
EVENTS_PATH = "/v1/projects/{project}/platforms/elevenlabs/events"


INITIATION_ANSWER = {
    "type": "object",
    "required": ["type", "dynamic_variables", "custom_llm_extra_body"],
    "properties": {
        "type": {"const": "conversation_initiation_client_data"},
        "dynamic_variables": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "Every name of the connection's `agent_variables` (empty when Caller Memory has no "
            "value), `caller_memory`, `memory_<key>` for every state key, `returning_caller`, `resume`, and "
            "`caller_memory_conversation`.",
        },
        "custom_llm_extra_body": {
            "type": "object",
            "properties": {"caller_memory_conversation": {"type": "string"}},
            "description": "Sent back by ElevenLabs to a custom LLM as `elevenlabs_extra_body`: the memory "
            "proxy binds the request to the conversation with it.",
        },
    },
}
OUTCOME = {
    "type": "object",
    "required": ["outcome"],
    "properties": {
        "outcome": {
            "enum": ["ended", "started_and_ended", "late", "duplicate", "conflict", "ignored"],
            "description": "What became of the event.",
        },
        "conversation_id": {"type": "string"},
    },
}


async def _connection(request: web.Request, project: Project) -> Connection | None:
    """The project's ElevenLabs connection (404 when there is none), or, when the store does not answer in
    time, the last one this process read (None if it read none)."""
    return await request.app[PLATFORMS].for_call(
        project, elevenlabs.PLATFORM, elevenlabs.CONNECTION_BUDGET_S, fresh=admitted(request)
    )


@routes.post(INITIATION_PATH)
@documented(
    "platform",
    "ElevenLabs conversation initiation (the call's memory as dynamic variables)",
    {
        "200": {
            "description": "The conversation-initiation client data ElevenLabs reads: every agent variable, "
            "the caller's memory as variables and the conversation id. Also when memory could not be read in "
            "time or the project holds its share of the requests in flight (the variables then empty): a "
            "call never fails because memory did.",
            "content": {JSON: {"schema": INITIATION_ANSWER}},
        },
        "404": problem(
            "No such project, the token belongs to another project, or the project has no ElevenLabs "
            "connection."
        ),
        "422": problem(
            "The project id is malformed, or the body is not ElevenLabs' initiation request (`errors` names "
            "what is wrong)."
        ),
        **platform_body_errors(),
        # Past the project's share of the requests in flight, the answer is made without memory (200).
        "429": problem(
            "Too many failed authentications from this address lately (this one failed too); retry after "
            "`Retry-After` seconds.",
            "Retry-After",
        ),
    },
    body={
        "required": True,
        "description": "ElevenLabs' initiation request: `caller_id`, `agent_id`, `called_number`, `call_sid`.",
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL as the workspace's conversation-initiation webhook in ElevenLabs, with the "
    "header `Authorization: Bearer <a platform token of the project>`, and let the agent fetch it (its "
    "Security tab). Answered within a second. See docs/elevenlabs.md.",
)
async def elevenlabs_initiation(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.PLATFORM)
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    initiation = elevenlabs.read_initiation(body)
    connection = await _connection(request, project)
    conversation_id = elevenlabs.new_conversation_id()
    if connection is None:
        # The store did not answer and this process has not seen the connection yet: an answer all the same.
        log.warning("elevenlabs: initiation answered without memory or the connection (store unavailable)")
        variables = start_variables(
            request.app[INGESTION].failed_open_answer(conversation_id),  # counted
            project.state_keys,
            [project.default_region],
        )
        return json_response(elevenlabs.initiation_answer(conversation_id, variables, []))
    start = CallStart(
        elevenlabs.PLATFORM, conversation_id, initiation.caller_id or "", budget_s=elevenlabs.START_BUDGET_S
    )
    answer = await request.app[INGESTION].start(project, connection, start, admitted=admitted(request))
    variables = start_variables(answer, project.state_keys, [project.default_region])
    agent_variables = list(connection.options.get("agent_variables") or [])
    log.info(
        "elevenlabs: initiation %s",
        "failed open" if answer.fail_open else ("retried" if answer.retried else "answered"),
    )
    return json_response(elevenlabs.initiation_answer(answer.conversation_id, variables, agent_variables))


@routes.post(EVENTS_PATH)
@documented(
    None,
    "ElevenLabs post-call webhooks",
    {
        "200": {
            "description": "Taken: `ended` or `started_and_ended` (the call ended, starting its conversation "
            "when its initiation never reached Caller Memory), `late` (the service had ended it: its state "
            "applied), `duplicate` (a call ended already), `conflict`, `ignored` (audio, other events, a "
            "failure naming no started conversation).",
            "content": {JSON: {"schema": OUTCOME}},
        },
        "401": problem(
            "Not signed with the connection's secret as ElevenLabs signs (`ElevenLabs-Signature: "
            "t=<time>,v0=<hex HMAC-SHA256 of '<time>.<body>'>`), signed more than 30 minutes ago or 5 "
            "minutes ahead, or delivered before. Nothing changed."
        ),
        "404": problem("No such project, or it has no ElevenLabs connection."),
        "422": problem("A signed body that is not an ElevenLabs webhook (`errors` names what is wrong)."),
        "503": problem(
            "The service has as many requests in flight as it allows, the store did not answer, or the "
            "connection's secret does not open with the operator's keys."
        ),
        **signed_hook_errors(),
    },
    body={
        "required": True,
        "description": "A post-call webhook, as ElevenLabs sends it.",
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL as the workspace's post-call webhook in ElevenLabs (HMAC authentication) and put "
    "its secret on the connection. `post_call_transcription` ends the call with its transcript, summary and "
    "data collection; `call_initiation_failure` ends a started call as dropped. See docs/elevenlabs.md.",
)
async def elevenlabs_events(request: web.Request) -> web.Response:
    refuse_unless_admitted(request)  # past the project's share: 429, which ElevenLabs retries
    services = request.app[SERVICES]
    project: Project = await services.projects.get(request.match_info["project"])
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    platforms = request.app[PLATFORMS]
    connection = await platforms.get(project, elevenlabs.PLATFORM)
    secret = platforms.opened_secret(connection)
    now = services.clock.now_ms()
    signature = elevenlabs.verify(secret, body, request.headers.get(elevenlabs.SIGNATURE_HEADER), now)
    event = elevenlabs.read_event(body)
    if event.type not in (elevenlabs.TRANSCRIPTION, elevenlabs.INITIATION_FAILURE):
        return json_response({"outcome": "ignored"})  # post_call_audio (chunked) and the rest
    await check_first_sighting(
        services.store,
        project=project.project_id,
        platform=elevenlabs.PLATFORM,
        event_id=elevenlabs.event_key(event, signature),
        now_ms=now,
        keep_ms=elevenlabs.WINDOW.keep_ms,
    )
    end = elevenlabs.end_of(event)
    if end is None:
        return json_response({"outcome": "ignored"})
    answer = await request.app[INGESTION].end(project, connection, end)
    log.info("elevenlabs: %s %s", event.type, answer.outcome)
    return json_response({"outcome": answer.outcome, "conversation_id": answer.conversation_id})
