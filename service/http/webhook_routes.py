"""Webhook endpoints of a project (SPEC sections 11 and 14), admin only: register (the signing secret is
answered once), list, read, rotate the secret, delete; the deliveries by state with their latest attempts,
and redelivery of a failed one. Thin: parse, call the domain (domain/webhooks/service.py), answer its views
(domain/webhooks/views.py). Every change is audited."""

from __future__ import annotations

from aiohttp import web

from ..domain.tokens import Role
from ..domain.webhooks.service import WebhookCreate, WebhookRotate
from ..domain.webhooks.views import (
    DELIVERY_STATES,
    ENDED,
    STATE_STATUS,
    delivery_view,
    webhook_view,
    with_secret,
)
from .app_keys import WEBHOOKS
from .openapi_parts import NO_STORE_HEADERS, body_errors, problem, request_body, response
from .openapi_webhooks import SIGNING, events_by_case
from .operations import documented
from .queries import DeliveriesQuery, parse_query
from .responses import json_response
from .routes import actor, project_for, read_model

routes = web.RouteTableDef()

WEBHOOKS_PATH = "/v1/projects/{project}/webhooks"
#: Secrets are in some answers and endpoints' URLs in all: no cache keeps them.
NO_STORE = {"Cache-Control": "no-store"}
WEBHOOK_404 = "No such project, or no such webhook in it."


@routes.post(WEBHOOKS_PATH)
@documented(
    "admin",
    "Register a webhook endpoint; its signing secret is answered this once",
    {
        "201": response(
            "The endpoint, with its `secret` (`whsec_...`).", "WebhookWithSecret", *NO_STORE_HEADERS
        ),
        "409": problem("The project has the most webhooks it may have (10)."),
        "422": problem(
            "A URL that is not https:// (plain http:// only to a host the operator allows), that has "
            "credentials or a fragment, or whose host is or resolves to a loopback, private, "
            "link-local (cloud metadata), CGNAT, multicast or other special-purpose address; an "
            "unknown event or member; `errors` names it."
        ),
        "503": problem(
            "The operator has not set `CALLER_MEMORY_SECRET_KEY` (it encrypts signing secrets), or "
            "the store did not answer."
        ),
        **body_errors(),
    },
    body=request_body("WebhookCreate", "The receiver's URL, its events, whether it wants history."),
    description=f"Events: {events_by_case()}. No payload holds a phone number. Summary and history go into "
    f"`{ENDED}` only with `include_history` and where the operator allows it "
    "(`CALLER_MEMORY_WEBHOOK_HISTORY=1`). " + SIGNING,
)
async def create_webhook(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    body = await read_model(request, WebhookCreate, "webhook")
    webhooks = request.app[WEBHOOKS]
    endpoint, secret = await webhooks.service.create(project, body, actor=actor(request))
    webhooks.changed()
    now = services.clock.now_ms()
    return json_response(with_secret(endpoint, secret, now), status=201, headers=NO_STORE)


@routes.get(WEBHOOKS_PATH)
@documented(
    "admin",
    "The project's webhook endpoints (without secrets)",
    {"200": response("The endpoints, oldest first.", "WebhookList", *NO_STORE_HEADERS)},
)
async def list_webhooks(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    endpoints = await services.store.list_endpoints(project.project_id)
    now = services.clock.now_ms()
    return json_response({"webhooks": [webhook_view(e, now) for e in endpoints]}, headers=NO_STORE)


@routes.get(WEBHOOKS_PATH + "/deliveries")
@documented(
    "admin",
    "Deliveries in one state (failed by default), with their latest attempts",
    {
        "200": response(
            "The deliveries in the `state` asked for: pending ones oldest first, failed and delivered "
            "ones most recent attempt first; each with its latest attempts (10 at most: when, the HTTP "
            "status, the error; never a response body, never the payload).",
            "WebhookDeliveryList",
            *NO_STORE_HEADERS,
        ),
        "404": problem("No such project, or no such webhook (`webhook_id`)."),
        "422": problem(f"A `state` other than {', '.join(DELIVERY_STATES)}, or a malformed `limit`."),
    },
    query=DeliveriesQuery,
    description="A failed delivery is kept until it is redelivered or its conversation's transcript "
    "expires; a delivered one (without its payload) for a day at most; any of them goes when its caller "
    "is erased or its webhook deleted.",
)
async def list_deliveries(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    query = parse_query(request, DeliveriesQuery)
    found = await request.app[WEBHOOKS].service.deliveries(
        project, STATE_STATUS[query.state], query.webhook_id, query.limit
    )
    return json_response({"deliveries": [delivery_view(d) for d in found]}, headers=NO_STORE)


@routes.post(WEBHOOKS_PATH + "/deliveries/{delivery_id}/redeliver")
@documented(
    "admin",
    "Queue a failed delivery again, at once, with a fresh attempt schedule",
    {
        "202": response(
            "The delivery, queued (same id: receivers see a retry).", "WebhookDelivery", *NO_STORE_HEADERS
        ),
        "404": problem("No such delivery (delivered, expired, erased, or never made)."),
    },
)
async def redeliver(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    delivery_id = request.match_info["delivery_id"]
    delivery, _ = await request.app[WEBHOOKS].service.redeliver(project, delivery_id, actor=actor(request))
    return json_response(delivery_view(delivery), status=202, headers=NO_STORE)


@routes.get(WEBHOOKS_PATH + "/{webhook_id}")
@documented(
    "admin",
    "One webhook endpoint (without its secret)",
    {"200": response("The endpoint.", "Webhook", *NO_STORE_HEADERS), "404": problem(WEBHOOK_404)},
)
async def get_webhook(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    endpoint = await request.app[WEBHOOKS].service.get(project, request.match_info["webhook_id"])
    return json_response(webhook_view(endpoint, services.clock.now_ms()), headers=NO_STORE)


@routes.post(WEBHOOKS_PATH + "/{webhook_id}/rotate")
@documented(
    "admin",
    "A new signing secret; the old one keeps signing for a grace period",
    {
        "200": response(
            "The endpoint with its new `secret`, shown this once.", "WebhookWithSecret", *NO_STORE_HEADERS
        ),
        "404": problem(WEBHOOK_404),
        "422": problem("A `grace_seconds` that is not 0 to 604800, or an unknown member."),
        **body_errors(),
    },
    body=request_body("WebhookRotate", "How long the old secret keeps signing (default one day).")
    | {"required": False},
    description="Every attempt during the grace period carries both signatures, so receivers can "
    "switch to the new secret at their own pace.",
)
async def rotate_webhook(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    body = await read_model(request, WebhookRotate, "rotation") if request.can_read_body else WebhookRotate()
    webhooks = request.app[WEBHOOKS]
    endpoint, secret = await webhooks.service.rotate(
        project, request.match_info["webhook_id"], body, actor=actor(request)
    )
    webhooks.changed()
    return json_response(with_secret(endpoint, secret, services.clock.now_ms()), headers=NO_STORE)


@routes.delete(WEBHOOKS_PATH + "/{webhook_id}")
@documented(
    "admin",
    "Delete a webhook endpoint and every delivery for it",
    {"204": {"description": "Deleted."}, "404": problem(WEBHOOK_404)},
)
async def delete_webhook(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    webhook_id = request.match_info["webhook_id"]
    webhooks = request.app[WEBHOOKS]
    await webhooks.service.delete(project, webhook_id, actor=actor(request))
    webhooks.changed()
    return web.Response(status=204)
