"""The webhook part of the OpenAPI document: the admin operations on a project's webhooks and failed
deliveries, and the ``webhooks`` section (OpenAPI 3.1) describing what receivers get. openapi.py merges
them in."""

from __future__ import annotations

from typing import Any

from .openapi_parts import body_errors, operation, problem, ref, request_body, response
from .queries import DeliveriesQuery

Json = dict[str, Any]
WEBHOOKS = "/v1/projects/{project}/webhooks"
NO_STORE = ("Cache-Control",)
SIGNING = (
    "Each attempt is a POST of the event (JSON) signed per the Standard Webhooks specification: "
    "`webhook-id` (the delivery id: the same on every attempt, the receiver's idempotency key), "
    "`webhook-timestamp` (seconds; refuse old ones) and `webhook-signature` (`v1,<base64 HMAC-SHA256 of "
    "id.timestamp.body>` per live secret, space separated; two during a rotation's grace period). Verify "
    "with any Standard Webhooks library and the endpoint's `whsec_` secret. A 2xx answer is a delivery; "
    "anything else (redirects are not followed) is retried at about 5 s, 30 s, 2 min, 10 min, 30 min, 1 h, "
    "3 h, 6 h and 12 h, then the delivery is failed."
)
WEBHOOK_404 = "No such project, or no such webhook in it."


def webhook_operations() -> dict[tuple[str, str], Json]:
    one = WEBHOOKS + "/{webhook_id}"
    return {
        ("post", WEBHOOKS): operation(
            "create_webhook",
            "admin",
            "Register a webhook endpoint; its signing secret is answered this once",
            {
                "201": response(
                    "The endpoint, with its `secret` (`whsec_...`).", "WebhookWithSecret", *NO_STORE
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
            description="Events: `conversation.ended` (every end: explicit, inactivity, supersession), "
            "`conversation.updated` (a late end), `caller.erased` (erase your copies). No payload holds a "
            "phone number. Summary and history go into `conversation.ended` only with `include_history` and "
            "where the operator allows it (`CALLER_MEMORY_WEBHOOK_HISTORY=1`). " + SIGNING,
        ),
        ("get", WEBHOOKS): operation(
            "list_webhooks",
            "admin",
            "The project's webhook endpoints (without secrets)",
            {"200": response("The endpoints, oldest first.", "WebhookList", *NO_STORE)},
        ),
        ("get", one): operation(
            "get_webhook",
            "admin",
            "One webhook endpoint (without its secret)",
            {"200": response("The endpoint.", "Webhook", *NO_STORE), "404": problem(WEBHOOK_404)},
        ),
        ("post", one + "/rotate"): operation(
            "rotate_webhook",
            "admin",
            "A new signing secret; the old one keeps signing for a grace period",
            {
                "200": response(
                    "The endpoint with its new `secret`, shown this once.", "WebhookWithSecret", *NO_STORE
                ),
                "404": problem(WEBHOOK_404),
                "422": problem("A `grace_seconds` that is not 0 to 604800, or an unknown member."),
                **body_errors(),
            },
            body=request_body("WebhookRotate", "How long the old secret keeps signing (default one day).")
            | {"required": False},
            description="Every attempt during the grace period carries both signatures, so receivers can "
            "switch to the new secret at their own pace.",
        ),
        ("delete", one): operation(
            "delete_webhook",
            "admin",
            "Delete a webhook endpoint and every delivery queued or failed for it",
            {"204": {"description": "Deleted."}, "404": problem(WEBHOOK_404)},
        ),
        ("get", WEBHOOKS + "/deliveries"): operation(
            "list_failed_deliveries",
            "admin",
            "Deliveries whose every attempt failed",
            {
                "200": response(
                    "Failed deliveries, most recent attempt first, with what their last attempt got (never "
                    "a response body); they are deleted when their conversation's transcript expires or its "
                    "caller is erased.",
                    "WebhookDeliveryList",
                    *NO_STORE,
                ),
                "404": problem("No such project, or no such webhook (`webhook_id`)."),
                "422": problem("A malformed `limit`."),
            },
            query=DeliveriesQuery,
        ),
        ("post", WEBHOOKS + "/deliveries/{delivery_id}/redeliver"): operation(
            "redeliver",
            "admin",
            "Queue a failed delivery again, at once, with a fresh attempt schedule",
            {
                "202": response(
                    "The delivery, queued (same id: receivers see a retry).", "WebhookDelivery", *NO_STORE
                ),
                "404": problem("No such delivery (delivered, expired, erased, or never made)."),
            },
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

    return {
        "conversation.ended": event(
            "A conversation ended",
            "ConversationEndedEvent",
            "After the end's processing (its state persisted, analytics recorded).",
        ),
        "conversation.updated": event(
            "A late end was applied",
            "ConversationEndedEvent",
            "The client's end of a conversation the service had already ended (inactivity, supersession).",
        ),
        "caller.erased": event(
            "A caller was erased",
            "CallerErasedEvent",
            "Erase your copies of these conversations; the receipt id is the erasure's.",
        ),
    }
