"""What the webhook endpoints answer, and the event payloads receivers get (typed: the OpenAPI document's
schemas, components and ``webhooks`` section, are generated from these)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, with_config
from typing_extensions import TypedDict

from ..clock import iso_utc
from ..store.webhooks import Delivery, DeliveryStatus, WebhookEndpoint

_CLOSED: Any = {"extra": "forbid"}
#: The event types, written once: the registration's model, the payloads, the queue and the OpenAPI document
#: (its ``webhooks`` section, tags and examples) all take them from here.
EventName = Literal["conversation.ended", "conversation.updated", "caller.erased"]
EVENTS: tuple[EventName, ...] = get_args(EventName)
ENDED, UPDATED, ERASED = EVENTS
DateTime = Annotated[str, Field(json_schema_extra={"format": "date-time"})]


@with_config(_CLOSED)
class Webhook(TypedDict):
    """A registered webhook endpoint (its secret is shown only when created or rotated)."""

    webhook_id: Annotated[str, Field(pattern="^wh_[0-9a-f]{16}$")]
    url: str
    events: list[EventName]
    include_history: bool
    description: str
    created_at: DateTime
    #: Until when the secret before the last rotation still signs (null: no such secret).
    previous_secret_valid_until: DateTime | None


@with_config(_CLOSED)
class WebhookWithSecret(Webhook):
    """A webhook endpoint just created or rotated, with its signing secret: shown this once."""

    secret: Annotated[str, Field(pattern="^whsec_[A-Za-z0-9+/=]+$")]


@with_config(_CLOSED)
class WebhookList(TypedDict):
    webhooks: list[Webhook]


#: The states the deliveries listing filters by (``state``): ``pending`` lists the deliveries whose status
#: is ``queued`` (waiting for an attempt, or in one).
DeliveryState = Literal["pending", "failed", "delivered"]
DELIVERY_STATES: tuple[DeliveryState, ...] = get_args(DeliveryState)
STATE_STATUS: dict[DeliveryState, DeliveryStatus] = {
    "pending": DeliveryStatus.QUEUED,
    "failed": DeliveryStatus.FAILED,
    "delivered": DeliveryStatus.DELIVERED,
}


@with_config(_CLOSED)
class WebhookAttempt(TypedDict):
    """One attempt of a delivery."""

    number: Annotated[int, Field(description="1 for the first attempt (counted again after a redelivery)")]
    at: DateTime
    http_status: Annotated[int | None, Field(description="The receiver's HTTP status (null: no answer)")]
    error: Annotated[
        str,
        Field(
            description="Why it failed: HTTP 503, timeout after 10 s, cannot connect (...); empty if it succeeded"
        ),
    ]


@with_config(_CLOSED)
class WebhookDelivery(TypedDict):
    """A delivery (never its payload: it may hold a transcript), with its latest attempts."""

    delivery_id: Annotated[str, Field(description="The webhook-id of every attempt")]
    webhook_id: str
    event: EventName
    status: Literal["queued", "failed", "delivered"]
    attempts: int
    created_at: DateTime
    last_attempt_at: DateTime | None
    next_attempt_at: DateTime | None
    last_error: Annotated[str, Field(description="What the last attempt got (never the response body)")]
    recent_attempts: Annotated[
        list[WebhookAttempt], Field(description="The latest attempts (10 at most), oldest first")
    ]


@with_config(_CLOSED)
class WebhookDeliveryList(TypedDict):
    deliveries: list[WebhookDelivery]


# The payloads receivers get ---------------------------------------------------------------------------------


@with_config(_CLOSED)
class EndOutcome(TypedDict):
    qa: str | None
    handoff_reason: str | None
    handoff_to: str | None


@with_config(_CLOSED)
class ConversationEndedData(TypedDict, total=False):
    """``data`` of ``conversation.ended`` and ``conversation.updated`` (a late end: the client's end of a
    conversation the service had ended; its ``persisted`` keys were applied then). ``summary`` and
    ``history`` only where the operator allows them and the endpoint asked; history times are milliseconds
    from the conversation's start, which is given rounded to the hour."""

    conversation_id: str
    channel: str | None
    ended_by: Literal["explicit", "inactivity", "superseded"]
    end_reason: Literal["completed", "dropped", "transferred"] | None
    outcome: EndOutcome
    persisted: list[str]
    repeat_caller: dict[str, Any]
    started_at: DateTime | None
    source: Annotated[
        str,
        Field(description="The platform whose end event ended it (`vapi`, `retell`...); absent otherwise."),
    ]
    summary: dict[str, Any] | None
    history: list[dict[str, Any]]


@with_config(_CLOSED)
class CallerErasedData(TypedDict):
    """``data`` of ``caller.erased``: erase your copies of these conversations."""

    receipt_id: Annotated[str, Field(pattern="^[0-9a-f]{32}$")]
    conversation_ids: list[str]


@with_config(_CLOSED)
class ConversationEndedEvent(TypedDict):
    type: Literal["conversation.ended", "conversation.updated"]
    id: Annotated[str, Field(description="The delivery id (also the webhook-id header)")]
    timestamp: DateTime
    data: ConversationEndedData


@with_config(_CLOSED)
class CallerErasedEvent(TypedDict):
    type: Literal["caller.erased"]
    id: str
    timestamp: DateTime
    data: CallerErasedData


def webhook_view(endpoint: WebhookEndpoint, now: int) -> Webhook:
    live_previous = bool(endpoint.previous_secret) and endpoint.previous_until > now
    return {
        "webhook_id": endpoint.endpoint_id,
        "url": endpoint.url,
        "events": list(endpoint.events),  # type: ignore[arg-type]
        "include_history": endpoint.include_history,
        "description": endpoint.description,
        "created_at": iso_utc(endpoint.created_at),
        "previous_secret_valid_until": iso_utc(endpoint.previous_until) if live_previous else None,
    }


def with_secret(endpoint: WebhookEndpoint, secret: str, now: int) -> WebhookWithSecret:
    return {**webhook_view(endpoint, now), "secret": secret}


def delivery_view(delivery: Delivery) -> WebhookDelivery:
    queued = delivery.status.value == "queued"
    return {
        "delivery_id": delivery.delivery_id,
        "webhook_id": delivery.endpoint_id,
        "event": delivery.event,  # type: ignore[typeddict-item]
        "status": delivery.status.value,
        "attempts": delivery.attempts,
        "created_at": iso_utc(delivery.created_at),
        "last_attempt_at": iso_utc(delivery.last_attempt_at) if delivery.last_attempt_at else None,
        "next_attempt_at": iso_utc(delivery.next_attempt_at) if queued else None,
        "last_error": delivery.last_error,
        "recent_attempts": [
            {
                "number": a.number,
                "at": iso_utc(a.at),
                "http_status": a.http_status or None,
                "error": a.error,
            }
            for a in delivery.recent_attempts
        ],
    }
