"""Webhook endpoints of a project (SPEC sections 11 and 14), admin only: register (the signing secret is
answered once), list, read, rotate the secret, delete; the failed deliveries, and redelivery of one. Thin:
parse, call the domain (domain/webhooks.py), answer its views (domain/webhook_views.py). Every change is
audited."""

from __future__ import annotations

from aiohttp import web

from ..domain.tokens import Role
from ..domain.webhooks.service import WebhookCreate, WebhookRotate
from ..domain.webhooks.views import delivery_view, webhook_view, with_secret
from .app_keys import WEBHOOKS
from .queries import DeliveriesQuery, parse_query
from .responses import json_response
from .routes import actor, project_for, read_model

routes = web.RouteTableDef()

WEBHOOKS_PATH = "/v1/projects/{project}/webhooks"
#: Secrets are in some answers and endpoints' URLs in all: no cache keeps them.
NO_STORE = {"Cache-Control": "no-store"}


@routes.post(WEBHOOKS_PATH)
async def create_webhook(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    body = await read_model(request, WebhookCreate, "webhook")
    webhooks = request.app[WEBHOOKS]
    endpoint, secret = await webhooks.service.create(project, body)
    webhooks.changed()
    await services.audit.record(
        project.project_id, actor(request), "webhook.created", {"webhook_id": endpoint.endpoint_id}
    )
    now = services.clock.now_ms()
    return json_response(with_secret(endpoint, secret, now), status=201, headers=NO_STORE)


@routes.get(WEBHOOKS_PATH)
async def list_webhooks(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    endpoints = await services.store.list_endpoints(project.project_id)
    now = services.clock.now_ms()
    return json_response({"webhooks": [webhook_view(e, now) for e in endpoints]}, headers=NO_STORE)


@routes.get(WEBHOOKS_PATH + "/deliveries")
async def list_failed_deliveries(request: web.Request) -> web.Response:
    _, project = await project_for(request, Role.ADMIN)
    query = parse_query(request, DeliveriesQuery)
    found = await request.app[WEBHOOKS].service.failed(project, query.webhook_id, query.limit)
    return json_response({"deliveries": [delivery_view(d) for d in found]}, headers=NO_STORE)


@routes.post(WEBHOOKS_PATH + "/deliveries/{delivery_id}/redeliver")
async def redeliver(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    delivery_id = request.match_info["delivery_id"]
    delivery, queued_again = await request.app[WEBHOOKS].service.redeliver(project, delivery_id)
    if queued_again:  # a delivery queued already is left as it is: nothing happened, nothing to audit
        await services.audit.record(
            project.project_id, actor(request), "webhook.redelivered", {"delivery_id": delivery.delivery_id}
        )
    return json_response(delivery_view(delivery), status=202, headers=NO_STORE)


@routes.get(WEBHOOKS_PATH + "/{webhook_id}")
async def get_webhook(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    endpoint = await request.app[WEBHOOKS].service.get(project, request.match_info["webhook_id"])
    return json_response(webhook_view(endpoint, services.clock.now_ms()), headers=NO_STORE)


@routes.post(WEBHOOKS_PATH + "/{webhook_id}/rotate")
async def rotate_webhook(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    body = await read_model(request, WebhookRotate, "rotation") if request.can_read_body else WebhookRotate()
    webhooks = request.app[WEBHOOKS]
    endpoint, secret = await webhooks.service.rotate(project, request.match_info["webhook_id"], body)
    webhooks.changed()
    await services.audit.record(
        project.project_id,
        actor(request),
        "webhook.rotated",
        {"webhook_id": endpoint.endpoint_id, "grace_seconds": body.grace_seconds},
    )
    return json_response(with_secret(endpoint, secret, services.clock.now_ms()), headers=NO_STORE)


@routes.delete(WEBHOOKS_PATH + "/{webhook_id}")
async def delete_webhook(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    webhook_id = request.match_info["webhook_id"]
    webhooks = request.app[WEBHOOKS]
    await webhooks.service.delete(project, webhook_id)
    webhooks.changed()
    await services.audit.record(
        project.project_id, actor(request), "webhook.deleted", {"webhook_id": webhook_id}
    )
    return web.Response(status=204)
