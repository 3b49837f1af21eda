"""Telnyx's webhooks to a project (SPEC section 15; the adapter: service/platforms/telnyx.py; the guide:
docs/telnyx.md).

No token: Telnyx signs every webhook with the account's Ed25519 key, whose public half is the connection's
``options.public_key`` (``telnyx-signature-ed25519`` over ``<telnyx-timestamp>|<body>``), checked on the raw
body before anything is parsed.

- ``POST .../platforms/telnyx/variables``: an AI Assistant's dynamic-variables webhook. Answered 200 within
  1.2 s (Telnyx waits 1.5 s by default) with ``{"dynamic_variables": {...}}`` whatever memory does: with the
  store slow or down, the variables are there, empty (fail-open). The call's attestation is Telnyx's: A when
  the webhook says the number was verified, else what the call's ``call.initiated`` said, waited for up to
  200 ms (it comes to the events URL at about the same time). Unsigned, forged or outside the window: 401,
  nothing changed; a delivery seen before is answered without memory and starts nothing.
- ``POST .../platforms/telnyx/events``: the call events. ``call.initiated`` keeps the call's attestation;
  ``call.hangup`` and ``call.conversation.ended`` are held (each adds to what the other left), and
  ``call.conversation_insights.generated`` ends the call with them: one end whatever the order. Every event
  it did right is answered 200 with what became of it, never a 409 or a 5xx for a duplicate or a conflict.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from ..domain.clock import Clock
from ..domain.errors import InvalidInput, Overloaded, StoreUnavailable
from ..domain.platforms.connections import Connection
from ..domain.platforms.ingestion import (
    ANALYSIS_GRACE_MS,
    StartAnswer,
)
from ..domain.platforms.records import CallStart
from ..domain.platforms.variables import start_variables
from ..domain.platforms.verification import EventReplayed, check_first_sighting
from ..domain.projects import Project
from ..domain.store import Store
from ..domain.store.transcripts import ConversationKey
from ..platforms import telnyx
from .app_keys import SERVICES
from .middleware import admitted, refuse_unless_admitted
from .openapi_parts import JSON, platform_body_errors, problem, signed_hook_errors
from .operations import documented
from .platform_routes import INGESTION, PLATFORMS, call_start_lookups
from .responses import json_response
from .routes import read_body

log = logging.getLogger("caller_memory.platforms")
routes = web.RouteTableDef()

VARIABLES_PATH = "/v1/projects/{project}/platforms/telnyx/variables"
EVENTS_PATH = "/v1/projects/{project}/platforms/telnyx/events"

#: How long the variables webhook waits for the project, the connection or the replay check before it
#: answers without memory (the memory read itself has what is left of :data:`telnyx.START_BUDGET_S`).
LOOKUP_BUDGET_S = 0.3
#: The least time the memory read is given (the lookups and the attestation's wait took the rest).
MIN_READ_S = 0.05
#: How often the variables webhook looks for the attestation ``call.initiated`` keeps.
ATTESTATION_POLL_S = 0.025

VARIABLES_ANSWER = {
    "type": "object",
    "required": ["dynamic_variables"],
    "properties": {
        "dynamic_variables": {
            "type": "object",
            "additionalProperties": {"type": "string"},
            "description": "`caller_memory`, `memory_<key>` for every state key, `returning_caller`, `resume`: "
            "strings, empty when Caller Memory has nothing (or could not read it in time).",
        }
    },
}
OUTCOME = {
    "type": "object",
    "required": ["outcome"],
    "properties": {
        "outcome": {
            "enum": [
                "attested",
                "ended",
                "started_and_ended",
                "late",
                "held",
                "duplicate",
                "conflict",
                "ignored",
            ],
            "description": "What became of the event.",
        },
        "conversation_id": {"type": "string"},
    },
}
SIGNATURE_401 = (
    "Not signed with the key whose public half is the connection's `public_key` as Telnyx signs "
    "(`telnyx-signature-ed25519`: the base64 Ed25519 signature of `<telnyx-timestamp>|<body>`), or signed more "
    "than 5 minutes from now. Nothing changed."
)


def _public_key(connection: Connection) -> str | None:
    key = connection.options.get("public_key")
    return key if isinstance(key, str) else None


def _verify(request: web.Request, connection: Connection, body: bytes, now_ms: int) -> None:
    telnyx.verify(
        _public_key(connection),
        body,
        request.headers.get(telnyx.SIGNATURE_HEADER),
        request.headers.get(telnyx.TIMESTAMP_HEADER),
        now_ms,
    )


def _event_id(kind: str, data: telnyx.Data, request: web.Request) -> str:
    """What a delivery is remembered by: the event's ``data.id`` (a retry of the event has the same), else
    its signature (unique to the delivery)."""
    return f"{kind}:{data.id or request.headers.get(telnyx.SIGNATURE_HEADER, '')}"


def _without_memory(project: Project | None) -> web.Response:
    """The answer without memory (every variable there, empty)."""
    failed = StartAnswer("", None, fail_open=True, started=False)
    keys = project.state_keys if project is not None else []
    regions = [project.default_region] if project is not None else [None]
    return json_response(telnyx.variables_answer(start_variables(failed, keys, regions)))


async def _initiated_attestation(
    store: Store, clock: Clock, project: Project, conversation_id: str, wait_s: float
) -> str | None:
    """The attestation the call's ``call.initiated`` kept, looked for until ``wait_s`` passes (None when it
    did not come, or the store did not answer)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + wait_s
    try:
        async with asyncio.timeout(wait_s):
            while True:
                kept = await store.call_trust(project.project_id, conversation_id, clock.now_ms())
                if kept is not None and kept[0] != "unknown":
                    return kept[0]
                if loop.time() + ATTESTATION_POLL_S >= until:
                    return None
                await asyncio.sleep(ATTESTATION_POLL_S)
    except (TimeoutError, StoreUnavailable, Overloaded):
        return None


@routes.post(VARIABLES_PATH)
@documented(
    None,
    "Telnyx AI Assistant dynamic-variables webhook (the call's memory as dynamic variables)",
    {
        "200": {
            "description": "Telnyx's answer: the caller's memory as dynamic variables. Also when memory could "
            "not be read in time, the project holds its share of the requests in flight, or the delivery was "
            "seen before (the variables then empty): a call never fails because memory did.",
            "content": {JSON: {"schema": VARIABLES_ANSWER}},
        },
        "401": problem(SIGNATURE_401),
        "404": problem("No such project, or it has no Telnyx connection."),
        "422": problem(
            "A signed body that is not Telnyx's dynamic-variables webhook (`errors` names what is wrong)."
        ),
        "503": problem("The service has as many requests in flight as it allows."),
        # Past the project's share of the requests in flight, the answer is made without memory (200).
        **platform_body_errors(),
    },
    body={
        "required": True,
        "description": 'Telnyx\'s dynamic-variables webhook: `{"data": {"event_type": '
        '"assistant.initialization", "id", "payload": {"telnyx_end_user_target", '
        '"telnyx_end_user_target_verified", "call_control_id", ...}}}`.',
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL as the AI Assistant's dynamic variables webhook URL in Telnyx, and the account's "
    "public key (Mission Control, Keys & Credentials) as the connection's `options.public_key`. Answered "
    "within 1.2 seconds. See docs/telnyx.md.",
)
async def telnyx_variables(request: web.Request) -> web.Response:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + telnyx.START_BUDGET_S
    services = request.app[SERVICES]
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    project, connection = await call_start_lookups(request, telnyx.PLATFORM, LOOKUP_BUDGET_S)
    if project is None or connection is None:
        log.warning("telnyx: variables answered without memory (store unavailable, connection unknown)")
        return _without_memory(project)
    now = services.clock.now_ms()
    _verify(request, connection, body, now)
    data = telnyx.read(body)
    conversation_id = telnyx.start_conversation(data.payload)
    if not admitted(request):  # the project holds its share of the requests in flight: answered all the same
        log.warning(
            "telnyx: variables answered without memory (the project's requests in flight at their bound)"
        )
        request.app[INGESTION].failed_open_answer(conversation_id)  # counted
        return _without_memory(project)
    try:
        async with asyncio.timeout(LOOKUP_BUDGET_S):
            await check_first_sighting(
                services.store,
                project=project.project_id,
                platform=telnyx.PLATFORM,
                event_id=_event_id(telnyx.INITIALIZATION, data, request),
                now_ms=now,
                keep_ms=telnyx.WINDOW.keep_ms,
            )
    except EventReplayed:
        log.info("telnyx: variables delivered before: answered without memory")
        return _without_memory(project)
    except (TimeoutError, StoreUnavailable, Overloaded):
        log.warning("telnyx: variables answered without memory (store unavailable)")
        return _without_memory(project)
    caller = (data.payload.telnyx_end_user_target or "").strip()
    if not caller:
        return _without_memory(project)
    attestation = telnyx.initialization_attestation(data.payload)
    if attestation is None:
        wait = min(telnyx.ATTESTATION_WAIT_S, max(0.0, deadline - loop.time() - MIN_READ_S))
        attestation = await _initiated_attestation(
            services.store, services.clock, project, conversation_id, wait
        )
    budget = max(MIN_READ_S, deadline - loop.time())
    start = CallStart(telnyx.PLATFORM, conversation_id, caller, attestation=attestation, budget_s=budget)
    answer = await request.app[INGESTION].start(project, connection, start)
    variables = start_variables(answer, project.state_keys, [project.default_region])
    log.info(
        "telnyx: variables %s (attestation %s)",
        "failed open" if answer.fail_open else ("retried" if answer.retried else "answered"),
        attestation or "unknown",
    )
    return json_response(telnyx.variables_answer(variables))


async def _existing(
    store: Store, project: Project, candidates: tuple[str | None, str | None], now: int
) -> str | None:
    """Of the call's two possible conversations, the one that started (by session first), else None."""
    for conversation_id in candidates:
        if conversation_id is None:
            continue
        header, _ = await store.read_conversation(ConversationKey(project.project_id, conversation_id), now)
        if header is not None:
            return conversation_id
    return None


async def _attested(
    store: Store, project: Project, connection: Connection, data: telnyx.Data, now: int
) -> web.Response:
    """``call.initiated`` of an incoming call: its attestation kept for both of the call's possible
    conversations, for the variables webhook (and the end) to find."""
    attestation = telnyx.attestation_of(data.payload)
    if data.payload.direction != "incoming" or attestation is None:
        return json_response({"outcome": "ignored"})
    expires = now + int(connection.end_grace_delta.total_seconds() * 1000) + ANALYSIS_GRACE_MS
    for conversation_id in telnyx.conversations_of(data.payload):
        if conversation_id is not None:
            await store.keep_call_trust(
                project.project_id,
                conversation_id,
                attestation,
                step_up=False,
                expires_at_ms=expires,
                now_ms=now,
            )
    log.info("telnyx: call.initiated: attestation %s kept", attestation)
    return json_response({"outcome": "attested"})


@routes.post(EVENTS_PATH)
@documented(
    None,
    "Telnyx call events (the Call Control or TeXML application's webhook)",
    {
        "200": {
            "description": "Taken: `attested` (`call.initiated`: its attestation kept), `held` "
            "(`call.hangup` or `call.conversation.ended`, waiting for the insights), `ended` or "
            "`started_and_ended` (the call ended, starting its conversation when its variables webhook never "
            "reached Caller Memory), `late` (the service had ended it: its state applied), `duplicate` (an "
            "event delivered before, or a call ended already), `conflict`, `ignored` (the other events, an "
            "outgoing call's `call.initiated`, an end naming no number).",
            "content": {JSON: {"schema": OUTCOME}},
        },
        "401": problem(SIGNATURE_401),
        "404": problem("No such project, or it has no Telnyx connection."),
        "422": problem("A signed body that is not a Telnyx webhook (`errors` names what is wrong)."),
        "503": problem(
            "The service has as many requests in flight as it allows, or the store did not answer (Telnyx "
            "retries)."
        ),
        **signed_hook_errors(),
    },
    body={
        "required": True,
        "description": 'A call event, as Telnyx sends it: `{"data": {"id", "event_type", "occurred_at", '
        '"payload": {...}}}`.',
        "content": {JSON: {"schema": {"type": "object"}}},
    },
    description="Set this URL as the webhook URL of the Call Control or TeXML application the AI Assistant "
    "answers on (for `call.initiated` and `call.hangup`) and of the assistant's insight group (for "
    "`call.conversation.ended` and `call.conversation_insights.generated`). The insights end the call with "
    "the transcript the conversation's end brought; without them, the call ends 10 minutes after its "
    "hang-up. See docs/telnyx.md.",
)
async def telnyx_events(request: web.Request) -> web.Response:
    refuse_unless_admitted(request)  # past the project's share: 429, which Telnyx retries
    services = request.app[SERVICES]
    project: Project = await services.projects.get(request.match_info["project"])
    body = await read_body(request.clone(client_max_size=services.settings.platform_max_body))
    connection = await request.app[PLATFORMS].get(project, telnyx.PLATFORM)
    now = services.clock.now_ms()
    _verify(request, connection, body, now)
    data = telnyx.read(body)
    kind = data.event_type
    if kind not in (telnyx.INITIATED, telnyx.HANGUP, telnyx.CONVERSATION_ENDED, telnyx.INSIGHTS):
        return json_response({"outcome": "ignored"})
    try:
        await check_first_sighting(
            services.store,
            project=project.project_id,
            platform=telnyx.PLATFORM,
            event_id=_event_id(kind, data, request),
            now_ms=now,
            keep_ms=telnyx.EVENT_KEEP_MS,
        )
    except EventReplayed:
        return json_response({"outcome": "duplicate"})
    if kind == telnyx.INITIATED:
        return await _attested(services.store, project, connection, data, now)
    candidates = telnyx.conversations_of(data.payload)
    found = await _existing(services.store, project, candidates, now)
    conversation_id = found or candidates[0] or candidates[1]
    if conversation_id is None:
        raise InvalidInput(
            "the webhook's data.payload names neither call_session_id nor call_control_id",
            field="data.payload.call_session_id",
        )
    # A conversation the variables webhook started has its caller (the end user): an event's ``from`` is only
    # for one it never started.
    end = telnyx.end_of(data, conversation_id, "" if found else telnyx.caller_of(data.payload))
    ingestion = request.app[INGESTION]
    try:
        if end.carries_analysis:
            answer = await ingestion.end(project, connection, end)
        else:
            answer = await ingestion.end_more(project, connection, end)
    except InvalidInput:
        # A caller the service cannot read as a number (withheld, anonymous): nothing to keep, never refused.
        log.info("telnyx: %s ignored (no caller number to keep it under)", kind)
        return json_response({"outcome": "ignored", "conversation_id": conversation_id})
    log.info("telnyx: %s %s", kind, answer.outcome)
    return json_response({"outcome": answer.outcome, "conversation_id": answer.conversation_id})
