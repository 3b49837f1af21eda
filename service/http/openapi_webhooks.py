"""The webhook part of the OpenAPI document: the ``webhooks`` section (OpenAPI 3.1) describing what receivers
get, per event type of the domain's list, and how deliveries are signed. The operations on a project's webhooks
are documented beside their handlers (webhook_routes.py)."""

from __future__ import annotations

from typing import Any

from ..domain.webhooks.views import ENDED, ERASED, EVENTS, UPDATED
from .openapi_parts import ref

Json = dict[str, Any]
SIGNING = (
    "Each attempt is a POST of the event (JSON) signed per the Standard Webhooks specification: "
    "`webhook-id` (the delivery id: the same on every attempt, the receiver's idempotency key), "
    "`webhook-timestamp` (seconds; refuse old ones) and `webhook-signature` (`v1,<base64 HMAC-SHA256 of "
    "id.timestamp.body>` per live secret, space separated; two during a rotation's grace period). Verify "
    "with any Standard Webhooks library and the endpoint's `whsec_` secret. A 2xx answer is a delivery; "
    "anything else (redirects are not followed) is retried at about 5 s, 30 s, 2 min, 10 min, 30 min, 1 h, "
    "3 h, 6 h and 12 h, then the delivery is failed."
)

#: Per event type (the domain's list, domain/webhooks/service.py): when it is sent, in a word; then the
#: summary, payload schema and description of its ``webhooks`` entry. A new event type without one fails here.
_EVENT_DOCS: dict[str, tuple[str, str, str, str]] = {
    ENDED: (
        "every end: explicit, inactivity, supersession",
        "A conversation ended",
        "ConversationEndedEvent",
        "After the end's processing (its state persisted, analytics recorded).",
    ),
    UPDATED: (
        "a late end",
        "A late end was applied",
        "ConversationEndedEvent",
        "The client's end of a conversation the service had already ended (inactivity, supersession).",
    ),
    ERASED: (
        "erase your copies",
        "A caller was erased",
        "CallerErasedEvent",
        "Erase your copies of these conversations; the receipt id is the erasure's.",
    ),
}


def webhook_events() -> Json:
    """The ``webhooks`` section: what a receiver gets, per event."""

    def event(summary: str, schema: str, description: str) -> Json:
        return {
            "post": {
                "summary": summary,
                "description": description + " " + SIGNING,
                "parameters": [
                    {"name": name, "in": "header", "required": True, "schema": {"type": "string"}}
                    for name in ("webhook-id", "webhook-timestamp", "webhook-signature")
                ],
                "requestBody": {"required": True, "content": {"application/json": {"schema": ref(schema)}}},
                "responses": {
                    "2XX": {"description": "Delivered."},
                    "default": {"description": "Not delivered: retried on the schedule, then failed."},
                },
            }
        }

    return {name: event(*_EVENT_DOCS[name][1:]) for name in EVENTS}


def events_text() -> str:
    """The event types in a sentence: ``a, b and c``."""
    return ", ".join(EVENTS[:-1]) + " and " + EVENTS[-1]


def events_by_case() -> str:
    """The event types, each with when it is sent, as the registration's description lists them."""
    return ", ".join(f"`{name}` ({_EVENT_DOCS[name][0]})" for name in EVENTS)
