"""Retell AI's webhooks to a project (SPEC section 15; the adapter: service/platforms/retell.py; the guide:
docs/retell.md).

No token: Retell signs every webhook with the account's API key, the connection's secret
(``x-retell-signature``), which is checked on the raw body before anything is parsed.

- ``POST .../platforms/retell/inbound``: the inbound call webhook. Answered 200 within a second in Retell's
  shape (``call_inbound.dynamic_variables`` and ``metadata``), whatever memory does: with the store slow or
  down, the variables are there, empty (fail-open). A call never fails because memory did. Unsigned, forged or
  outside the window: 401, nothing changed. A delivery seen before (the same signature) is answered without
  memory and starts nothing.
- ``POST .../platforms/retell/events``: the call events. Unsigned, forged or outside the window: 401, nothing
  changed; an event delivered again is answered 200 as a duplicate. Every event it did right is answered 200
  with what became of it (``outcome``), never a 409 or a 5xx for a duplicate or a conflict.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ..domain.errors import InvalidInput, Overloaded, StoreUnavailable
from ..domain.platforms.ingestion import StartAnswer
from ..domain.platforms.records import CallStart
from ..domain.platforms.variables import start_variables
from ..domain.platforms.verification import EventReplayed, check_first_sighting
from ..domain.projects import Project
from ..platforms import retell
from .app_keys import SERVICES
from .middleware import admitted, refuse_unless_admitted
from .openapi_parts import JSON, platform_body_errors, problem, signed_hook_errors
from .operations import documented
from .platform_routes import INGESTION, PLATFORMS, call_start_lookups
from .responses import json_response
from .routes import read_body

log = logging.getLogger("caller_memory.platforms")
routes = web.RouteTableDef()

INBOUND_PATH = "/v1/projects/{project}/platforms/retell/inbound"
EVENTS_PATH = "/v1/projects/{project}/platforms/retell/events"

#: How long the inbound webhook waits for the project, the connection or the replay check before it answers
#: without memory (the memory read itself has what is left of :data:`retell.START_BUDGET_S`).
LOOKUP_BUDGET_S = 0.3
#: The least time the memory read is given (the lookups took the rest of the budget).
MIN_READ_S = 0.05

INBOUND_ANSWER = {
    "type": "object",
    "required": ["call_inbound"],
    "properties": {
        "call_inbound": {
            "type": "object",
            "required": ["dynamic_variables"],
            "properties": {
                "dynamic_variables": {
                    "type": "object",
                    "additionalProperties": {"type": "string"},
                    "description": "`caller_memory`, `memory_<key>` for every state key, `returning_caller`, "
                    "`resume`: strings, empty when Caller Memory has nothing (or could not read it in time).",
                },
                "metadata": {
                    "type": "object",
                    "properties": {"caller_memory_conversation": {"type": "string"}},
                    "description": "The call's conversation, which Retell copies into the call's events.",
                },
            },
        }
    },
}
OUTCOME = {
    "type": "object",
    "required": ["outcome"],
    "properties": {
        "outcome": {
            "enum": ["ended", "started_and_ended", "late", "held", "duplicate", "conflict", "ignored"],
            "description": "What became of the event.",
        },
        "conversation_id": {"type": "string"},
    },
}
SIGNATURE_401 = (
    "Not signed with the connection's secret (the Retell API key) as Retell signs (`x-retell-signature: "
    "v=<unix ms>,d=<hex HMAC-SHA256 of the body followed by v>`), or signed more than 5 minutes from now. "
    "Nothing changed."
)


def _without_memory(project: Project | None, conversation_id: str | None) -> web.Response:
    """The inbound answer without memory (every variable there, empty), naming ``conversation_id`` if any."""
    failed = StartAnswer(conversation_id or "", None, fail_open=True, started=False)
    keys = project.state_keys if project is not None else []
    regions = [project.default_region] if project is not None else [None]
    variables = start_variables(failed, keys, regions)
    return json_response(retell.InboundAnswer(variables, conversation_id).body())


@routes.post(INBOUND_PATH)
@documented(
    None,
    "Retell inbound call webhook (the call's memory as dynamic variables)",
    {
        "200": {
            "description": "Retell's inbound answer: the caller's memory as dynamic variables and the "
            "conversation's id in the call's metadata. Also when memory could not be read in time, the "
            "project holds its share of the requests in flight, or the delivery was seen before (the "
            "variables then empty): a call never fails because memory did.",
            "content": {JSON: {"schema": INBOUND_ANSWER}},
        },
        "401": problem(SIGNATURE_401),
        "404": problem("No such project, or it has no Retell connection."),
        "422": problem("A signed body that is not Retell's inbound webhook (`errors` names what is wrong)."),
        "503": problem(
            "The service has as many requests in flight as it allows, or the connection's secret does not "
            "open with the operator's keys."
        ),
        # Past the project's share of the requests in flight, the answer is made without memory (200).
        **platform_body_errors(),
    },
    body={
        "required": True,
        "description": 'Retell\'s inbound call webhook: `{"event": "call_inbound", "call_inbound": '
        '{"from_number", "to_number", ...}}`.',
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL as the phone number's inbound webhook URL in Retell, and the Retell API key (the "
    "one with the webhook badge) as the connection's secret. Answered within a second. See docs/retell.md.",
)
async def retell_inbound(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + retell.START_BUDGET_S
    services = request.app[SERVICES]
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    project, connection = await call_start_lookups(request, retell.PLATFORM, LOOKUP_BUDGET_S)
    if project is None or connection is None:
        # The store did not answer and this process has not read the connection yet: nothing can be verified
        # or read, and the answer holds nothing but empty variables.
        log.warning("retell: inbound answered without memory (store unavailable, connection unknown)")
        return _without_memory(project, None)
    now = services.clock.now_ms()
    signature = request.headers.get(retell.SIGNATURE_HEADER, "").strip()
    retell.verify(request.app[PLATFORMS].opened_secret(connection), body, signature, now)
    inbound = retell.read_inbound(body)
    conversation_id = retell.new_conversation_id()
    if not admitted(request):  # the project holds its share of the requests in flight: answered all the same
        log.warning(
            "retell: inbound answered without memory (the project's requests in flight at their bound)"
        )
        request.app[INGESTION].failed_open_answer(conversation_id)  # counted
        return _without_memory(project, conversation_id)
    try:
        async with asyncio.timeout(LOOKUP_BUDGET_S):
            await check_first_sighting(
                services.store,
                project=project.project_id,
                platform=retell.PLATFORM,
                event_id=f"{retell.INBOUND}:{signature}",
                now_ms=now,
                keep_ms=retell.WINDOW.keep_ms,
            )
    except EventReplayed:
        log.info("retell: inbound delivered before: answered without memory")
        return _without_memory(project, None)
    except (TimeoutError, StoreUnavailable, Overloaded):
        log.warning("retell: inbound answered without memory (store unavailable)")
        return _without_memory(project, conversation_id)
    caller = (inbound.from_number or "").strip()
    if not caller:
        return _without_memory(project, conversation_id)
    budget = max(MIN_READ_S, deadline - loop.time())
    start = CallStart(retell.PLATFORM, conversation_id, caller, budget_s=budget)
    answer = await request.app[INGESTION].start(project, connection, start)
    variables = start_variables(answer, project.state_keys, [project.default_region])
    log.info(
        "retell: inbound %s",
        "failed open" if answer.fail_open else ("retried" if answer.retried else "answered"),
    )
    return json_response(retell.InboundAnswer(variables, answer.conversation_id).body())


@routes.post(EVENTS_PATH)
@documented(
    None,
    "Retell call events (the agent's or the account's webhook)",
    {
        "200": {
            "description": "Taken: `held` (`call_ended`, waiting for `call_analyzed`), `ended` or "
            "`started_and_ended` (the call ended, starting its conversation when its inbound webhook never "
            "reached Caller Memory), `late` (the service had ended it: its state applied), `duplicate` (an "
            "event delivered before, or a call ended already), `conflict`, `ignored` (`call_started` and "
            "the other events, a web call naming no started conversation).",
            "content": {JSON: {"schema": OUTCOME}},
        },
        "401": problem(SIGNATURE_401),
        "404": problem("No such project, or it has no Retell connection."),
        "422": problem("A signed body that is not a Retell call event (`errors` names what is wrong)."),
        "503": problem(
            "The service has as many requests in flight as it allows, the store did not answer, or the "
            "connection's secret does not open with the operator's keys (Retell retries)."
        ),
        **signed_hook_errors(),
    },
    body={
        "required": True,
        "description": 'A call event, as Retell sends it: `{"event": ..., "call": {...}}`.',
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL as the agent's (or the account's) webhook URL in Retell, with the events "
    "`call_ended` and `call_analyzed`. `call_analyzed` ends the call with its transcript, summary and "
    "analysis; `call_ended` alone ends it 10 minutes later. See docs/retell.md.",
)
async def retell_events(request: web.Request) -> web.Response:
    refuse_unless_admitted(request)  # past the project's share: 429, which Retell retries
    services = request.app[SERVICES]
    project: Project = await services.projects.get(request.match_info["project"])
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    platforms = request.app[PLATFORMS]
    connection = await platforms.get(project, retell.PLATFORM)
    now = services.clock.now_ms()
    retell.verify(
        platforms.opened_secret(connection), body, request.headers.get(retell.SIGNATURE_HEADER), now
    )
    event, call = retell.read_event(body)
    if call is None or event == retell.STARTED:
        return json_response({"outcome": "ignored"})
    try:
        await check_first_sighting(
            services.store,
            project=project.project_id,
            platform=retell.PLATFORM,
            event_id=retell.event_id(event, call),
            now_ms=now,
            keep_ms=retell.EVENT_KEEP_MS,
        )
    except EventReplayed:
        return json_response({"outcome": "duplicate"})
    end = retell.end_of(event, call)
    try:
        answer = await request.app[INGESTION].end(project, connection, end)
    except InvalidInput:
        # A caller the service cannot read as a number (withheld, anonymous): nothing to keep, never refused.
        log.info("retell: %s ignored (no caller number to keep it under)", event)
        return json_response({"outcome": "ignored", "conversation_id": end.conversation_id})
    log.info("retell: %s %s", event, answer.outcome)
    return json_response({"outcome": answer.outcome, "conversation_id": answer.conversation_id})
