"""The webhook part of the Store interface (SPEC sections 11 and 14): a project's webhook endpoints and the
durable queue of their deliveries. :class:`~caller_memory.service.domain.store.core.Store` inherits it; every backend implements it with
identical semantics (tests/storage/test_webhooks.py).

The store keeps what the domain built: an endpoint's signing secrets arrive encrypted (opaque bytes), a
delivery's payload is the envelope's JSON (opaque bytes, signed afresh by the domain at each attempt). Times
are epoch milliseconds passed in by the caller, as everywhere in the store.

A delivery's life: ``queued`` (due at ``next_attempt_at``) until an attempt succeeds (then it is
``delivered``: its payload is dropped and the rest kept for :data:`DELIVERED_KEPT_MS` at most, to be listed)
or the attempts are exhausted (then ``failed``, kept and listed until redelivered, deleted or expired). It is
deleted, whatever its state, once ``expires_at`` passed (the conversation's transcript expiry), when its
endpoint is deleted, and when its caller is erased. Each delivery keeps its latest attempts
(:data:`KEPT_ATTEMPTS` of them: what each got, never a response body), deleted with it; a delivery stored
before attempts were kept reads as having none. While an attempt runs, the delivery is *leased* by one
worker (``lease_owner`` until ``lease_until``): no other worker claims it until the lease ends, so replicas
never send one delivery at the same time; a worker that dies leaves a lease that simply runs out.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .refs import CallerRef


@dataclass(frozen=True, slots=True)
class WebhookEndpoint:
    """One registered receiver of a project's events."""

    project: str
    #: ``wh_`` and random characters (never derived from anything about a caller).
    endpoint_id: str
    url: str
    #: Event types it receives (``conversation.ended``, ``conversation.updated``, ``caller.erased``).
    events: tuple[str, ...]
    #: Whether ``conversation.ended`` payloads carry the summary and history (when the operator allows it).
    include_history: bool
    created_at: int
    #: The signing secret, encrypted by the domain (opaque to the store).
    secret: bytes
    #: The secret before the last rotation (encrypted), still signing until ``previous_until``; b"" if none.
    previous_secret: bytes = b""
    previous_until: int = 0
    #: A label for people (may be empty).
    description: str = ""


class DeliveryStatus(enum.Enum):
    QUEUED = "queued"
    FAILED = "failed"
    #: An attempt succeeded: kept without its payload for the listing, never claimed or redelivered.
    DELIVERED = "delivered"


#: Attempts a delivery keeps, its latest ones (the storage of a delivery is bounded).
KEPT_ATTEMPTS = 10
#: How long a delivered delivery is kept (without its payload) for the listing, at most: a day, or less when
#: its ``expires_at`` comes first.
DELIVERED_KEPT_MS = 24 * 3600 * 1000
#: How many delivered deliveries an endpoint keeps at most: the oldest go first, so that what is kept for the
#: listing stays bounded whatever the rate of deliveries (the listing shows 500 at most).
DELIVERED_KEPT_PER_ENDPOINT = 1000
#: Longest error text an attempt keeps.
MAX_ERROR_CHARS = 200


@dataclass(frozen=True, slots=True)
class Attempt:
    """One attempt of a delivery: its number (1 for the first of its schedule, counted again from 1 after a
    redelivery), when it ended, the HTTP status it got (0: no answer) and, unless it succeeded, why it
    failed (``HTTP 503``, ``timeout after 10 s``, ``cannot connect (...)``; never a response body)."""

    number: int
    at: int
    http_status: int
    error: str = ""


def kept_error(error: str) -> str:
    """An attempt's error as it is kept: without tabs or line breaks, cut to :data:`MAX_ERROR_CHARS`."""
    return " ".join(error.split())[:MAX_ERROR_CHARS]


def attempt_line(number: int, at: int, http_status: int, error: str) -> str:
    """One attempt as the backends keep it: a line of four fields split by tabs (the error as
    :func:`kept_error` makes it)."""
    return f"{number}\t{at}\t{http_status}\t{kept_error(error)}"


def attempts_of(log: str) -> tuple[Attempt, ...]:
    """The attempts of a kept log (lines of :func:`attempt_line`), oldest first; "" (a delivery stored
    before attempts were kept) has none. A line that cannot be read is left out: the log only informs."""
    found = []
    for line in log.split("\n"):
        parts = line.split("\t", 3)
        if len(parts) == 4 and parts[0].isdigit() and parts[1].isdigit() and parts[2].isdigit():
            found.append(Attempt(int(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
    return tuple(found)


def with_attempt(log: str, line: str) -> str:
    """``log`` with ``line`` added, its oldest lines dropped beyond :data:`KEPT_ATTEMPTS`."""
    lines = [*(log.split("\n") if log else ()), line]
    return "\n".join(lines[-KEPT_ATTEMPTS:])


@dataclass(slots=True)
class Delivery:
    """One event for one endpoint. ``delivery_id`` is the ``webhook-id`` of every attempt (the receiver's
    idempotency key) and is unique within its project.

    A value: never changed once made (:func:`dataclasses.replace` makes a changed copy). Not declared frozen
    only because one is made per endpoint at every end, on the request path, and a frozen dataclass sets each
    of its 14 fields through ``object.__setattr__``: four times the cost."""

    project: str
    delivery_id: str
    endpoint_id: str
    #: The event type (``conversation.ended`` ...).
    event: str
    #: The envelope's JSON, as the receiver gets it.
    payload: bytes
    #: The pseudonym of the caller the event is about ("" for none, e.g. ``caller.erased``): an erasure of
    #: that caller deletes the delivery (:meth:`WebhookStore.delete_caller_deliveries`).
    subject: str
    created_at: int
    #: Deleted once this passed, whatever its state (never claimed, listed or redelivered after it).
    expires_at: int
    status: DeliveryStatus = DeliveryStatus.QUEUED
    #: Attempts made so far.
    attempts: int = 0
    #: When the next attempt is due (queued deliveries).
    next_attempt_at: int = 0
    last_attempt_at: int = 0
    #: What the last attempt got: ``HTTP 503``, ``timeout``, ``refused: ...``; never a response body.
    last_error: str = ""
    #: The latest attempts (at most :data:`KEPT_ATTEMPTS`), oldest first.
    recent_attempts: tuple[Attempt, ...] = ()


class Settlement(enum.Enum):
    """How an attempt ended (:meth:`WebhookStore.settle_delivery`)."""

    #: The receiver took it: the delivery is ``delivered`` (its payload dropped).
    DELIVERED = "delivered"
    #: Another attempt at ``next_attempt_at``: queued again, ``attempts`` incremented.
    RETRY = "retry"
    #: No more attempts: ``failed``, ``attempts`` incremented.
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class QueueStats:
    """The queue for metrics: queued and failed deliveries (live ones), and the creation time of the oldest
    queued one (0 when none is queued)."""

    queued: int
    failed: int
    oldest_queued_at: int


def check_one_project(deliveries: Sequence[Delivery], caller: CallerRef | None) -> None:
    """The deliveries of one enqueue are all of one project, the caller's (a programming error otherwise)."""
    projects = {d.project for d in deliveries} | ({caller.project} if caller is not None else set())
    if len(projects) > 1:
        raise ValueError(f"deliveries of one project are queued at a time, not of {sorted(projects)}")


class WebhookStore(ABC):
    """Endpoints and the delivery queue."""

    # Endpoints ----------------------------------------------------------------------------------------------

    @abstractmethod
    async def put_endpoint(self, endpoint: WebhookEndpoint) -> None:
        """Create the endpoint, or replace the one with the same project and ``endpoint_id`` (a rotation)."""

    @abstractmethod
    async def get_endpoint(self, project: str, endpoint_id: str) -> WebhookEndpoint | None:
        """The endpoint, or None."""

    @abstractmethod
    async def list_endpoints(self, project: str | None = None) -> list[WebhookEndpoint]:
        """The project's endpoints (every project's when ``project`` is None: the delivery worker's list),
        in ``created_at`` then ``endpoint_id`` order."""

    @abstractmethod
    async def delete_endpoint(self, project: str, endpoint_id: str) -> bool:
        """Delete the endpoint and every delivery (whatever its state) for it; False if there was none."""

    # The queue ----------------------------------------------------------------------------------------------

    @abstractmethod
    async def enqueue_deliveries(
        self, deliveries: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> bool:
        """Queue ``deliveries`` (all of one project, durable once this returns). Idempotent: a delivery
        whose ``delivery_id`` is already queued or failed in the project is left as it is (a retried end
        queues nothing twice); one that was delivered may be queued again (at least once): its
        ``delivered`` record is replaced, attempts and all.

        With ``caller`` (the caller every delivery is about), nothing is queued and the answer is False when
        the caller was erased at or after ``made_at`` (their tombstone, as for ends): what was made before an
        erasure never goes out after it. Otherwise True. Expired deliveries (``expires_at <= now_ms``) are not
        queued. An empty ``deliveries`` queues nothing (True, or False for an erased caller)."""

    @abstractmethod
    async def claim_deliveries(
        self, project: str, endpoint_id: str, now_ms: int, limit: int, *, owner: str, lease_until: int
    ) -> list[Delivery]:
        """Lease up to ``limit`` queued deliveries of the endpoint that are due (``next_attempt_at <=
        now_ms``) and not leased (no lease, or one that ended: ``lease_until <= now_ms``), earliest due first
        (then ``delivery_id``), to ``owner`` until ``lease_until``; return them. Expired ones are deleted,
        not returned. Failed deliveries are never claimed."""

    @abstractmethod
    async def settle_delivery(
        self,
        project: str,
        delivery_id: str,
        owner: str,
        outcome: Settlement,
        now_ms: int,
        *,
        next_attempt_at: int = 0,
        error: str = "",
        http_status: int = 0,
    ) -> bool:
        """Record an attempt made under ``owner``'s lease (``attempts + 1``, ``last_attempt_at`` =
        ``now_ms``, ``last_error`` = ``error``, and the attempt, with ``http_status``, among the kept ones)
        and end the lease: DELIVERED makes the delivery ``delivered``, drops its payload and keeps the rest
        until ``now_ms`` + :data:`DELIVERED_KEPT_MS` at most; RETRY queues it again due at
        ``next_attempt_at``; FAILED marks it failed. False, and nothing changed, when the delivery is gone
        (deleted, erased, expired) or no longer leased by ``owner`` (its lease ran out and another worker
        claimed it)."""

    @abstractmethod
    async def list_deliveries(
        self,
        project: str,
        status: DeliveryStatus,
        now_ms: int,
        *,
        endpoint_id: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        """The project's live deliveries in ``status`` (of one endpoint, or all), at most ``limit``: queued
        ones oldest first (``created_at``, then ``delivery_id``); failed and delivered ones most recent
        attempt first (then ``delivery_id``). A queued one under a lease (its attempt running) is listed."""

    async def failed_deliveries(
        self, project: str, now_ms: int, endpoint_id: str | None = None, limit: int = 100
    ) -> list[Delivery]:
        """:meth:`list_deliveries` of the failed ones."""
        return await self.list_deliveries(
            project, DeliveryStatus.FAILED, now_ms, endpoint_id=endpoint_id, limit=limit
        )

    @abstractmethod
    async def get_delivery(self, project: str, delivery_id: str, now_ms: int) -> Delivery | None:
        """The live delivery if it is queued or failed, else None (a delivered one too)."""

    @abstractmethod
    async def redeliver(self, project: str, delivery_id: str, now_ms: int) -> Delivery | None:
        """Queue a failed delivery again, due now, with ``attempts`` 0 and its last error and kept attempts
        kept; return it. A queued delivery is returned as it is (nothing changes); None if there is no live
        queued or failed one."""

    @abstractmethod
    async def delete_delivery(self, project: str, delivery_id: str) -> bool:
        """Delete one delivery (whatever its state); False if there was none."""

    @abstractmethod
    async def delete_caller_deliveries(self, caller: CallerRef) -> int:
        """Delete every delivery (queued, failed or delivered, of any endpoint) whose ``subject`` is the
        caller's, with its attempts; how many of them were queued or failed (never sent now: a delivered
        one's record goes uncounted). A delivery leased at that moment is deleted too (its settlement then
        answers False)."""

    @abstractmethod
    async def queue_stats(self, now_ms: int) -> QueueStats:
        """Live queued and failed deliveries over every project, and the oldest queued one's creation time."""
