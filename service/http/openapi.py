"""The OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``, assembled here.

Each operation is described beside its handler (``@documented`` under its route, operations.py); ``paths`` is
assembled from the route tables the app registers, so a path is written once, in its route. Nothing about a
body's shape is written here: ``components.schemas`` is generated from the typed bodies (components.py), and
the query parameters from the query models (queries.py). The shared parameters, headers, responses and
request bodies are in openapi_parts.py; the ``webhooks`` section in openapi_webhooks.py. This module adds the
tags and the document's frame.
"""

from __future__ import annotations

import re
from typing import Any

from aiohttp import web

from . import (
    admin_routes,
    agora_routes,
    analytics_routes,
    conversation_routes,
    dashboard,
    elevenlabs_routes,
    link_routes,
    mcp_routes,
    platform_routes,
    proxy_routes,
    retell_routes,
    routes,
    telnyx_routes,
    vapi_routes,
    webhook_routes,
)
from .components import component_schemas
from .openapi_parts import AUTH_TEXT, JSON, Json, ref, shared_headers, shared_parameters, version
from .openapi_webhooks import events_text, webhook_events
from .operations import documented, documented_operations
from .responses import json_response

#: This module's own route: the document itself.
openapi_routes = web.RouteTableDef()

#: The route tables, in the order the app registers them (app.py).
ROUTE_TABLES = (
    routes.routes,
    openapi_routes,
    admin_routes.routes,
    analytics_routes.routes,
    conversation_routes.routes,
    dashboard.routes,
    webhook_routes.routes,
    link_routes.routes,
    platform_routes.routes,
    proxy_routes.routes,
    mcp_routes.routes,
    # The hosted platforms' hooks, by platform.
    agora_routes.routes,
    elevenlabs_routes.routes,
    retell_routes.routes,
    telnyx_routes.routes,
    vapi_routes.routes,
)


def _tag(path: str) -> str:
    if path.startswith("/dashboard") or path == "/favicon.ico":
        return "dashboard"
    if not path.startswith("/v1/"):
        return "service"
    if path.startswith("/v1/admin/"):
        return "operator"
    if path.endswith("/audit"):
        return "audit"
    if "/analytics/" in path:
        return "analytics"
    if "/conversations" in path:
        return "conversation"
    if "/webhooks" in path:
        return "webhook"
    if path.endswith("/llm") or "/llm/" in path:
        return "proxy"
    return "memory" if "/callers/" in path else "token" if "/tokens" in path else "project"


def _paths() -> dict[str, Json]:
    paths: dict[str, Json] = {}
    for method, path, op in documented_operations(ROUTE_TABLES):
        op["tags"] = [_tag(path)]
        item = paths.setdefault(path, {})
        if "{" in path and "parameters" not in item:
            item["parameters"] = [ref(name, "parameters") for name in re.findall(r"\{(\w+)\}", path)]
        item[method] = op
    return paths


def build_openapi() -> dict[str, Any]:
    """The OpenAPI 3.1.0 document of every route of ``ROUTE_TABLES`` (a new dict on each call)."""
    description = (
        "Key-value memory attached to a caller's phone number, kept for a bounded retention period. Errors "
        "are RFC 9457 problem details (`application/problem+json`); unknown paths answer 404, and methods a "
        "path does not support 405 with `Allow`.\n\n" + AUTH_TEXT
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "Caller Memory", "version": version(), "description": description},
        "tags": [
            {"name": "service", "description": "Probes and this description; no authentication."},
            {"name": "project", "description": "Project configuration."},
            {"name": "token", "description": "Project tokens."},
            {"name": "memory", "description": "Caller memory, addressed by phone number."},
            {
                "name": "conversation",
                "description": "Conversation memory (a call's transcript, its summary, the context for the "
                "next inference, resume after a dropped call) and the end of a conversation, as the agent's "
                "SDK sends them.",
            },
            {"name": "analytics", "description": "Repeat-caller analytics: conversations and the report."},
            {
                "name": "webhook",
                "description": f"Webhook endpoints (signed deliveries of {events_text()}; see `webhooks`) and "
                "their failed deliveries.",
            },
            {
                "name": "proxy",
                "description": "The memory proxy: the project's upstream model, and OpenAI Chat Completions "
                "with the caller's memory (docs/proxy.md).",
            },
            {"name": "operator", "description": "Expiry sweeps; the operator token only."},
            {"name": "audit", "description": "The project's audit log."},
            {
                "name": "dashboard",
                "description": "The dashboard page and its files; the data calls need a token.",
            },
        ],
        "security": [{"bearerAuth": []}],
        "paths": _paths(),
        "webhooks": webhook_events(),
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer", "description": AUTH_TEXT}},
            "schemas": component_schemas(),
            "parameters": shared_parameters() | {"asset": dashboard.asset_parameter()},
            "headers": shared_headers(),
        },
    }


@openapi_routes.get("/openapi.json")
@documented(
    None,
    "This API description",
    {"200": {"description": "This document.", "content": {JSON: {"schema": {"type": "object"}}}}},
)
async def openapi(request: web.Request) -> web.Response:
    return json_response(build_openapi())
