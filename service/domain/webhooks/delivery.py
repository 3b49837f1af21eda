"""Sending what the webhook queue holds (SPEC sections 11 and 14): at least once, signed afresh at every
attempt under the same ``webhook-id``, with exponential backoff and jitter for about a day, then ``failed``.

Isolation: each endpoint has its own bound of attempts in flight (``concurrency``), claimed from its own
part of the queue, and every attempt has a timeout; so a receiver that hangs holds only its own slots, and
other endpoints, other projects and every request are served as before (requests never wait for a
delivery: events are queued, and this runs beside them). Replicas share the queue: a claim leases each
delivery to one worker for the attempt's timeout and a margin, so no two send one delivery at once, and a
worker that dies leaves leases that simply run out.

The HTTP side (resolving with the SSRF policy, connecting to the checked address, no redirects, bodies
read and dropped, never logged) is a :class:`Sender`, implemented at the edge (service/http/webhook_sender.py).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from ..clock import Clock, iso_utc
from ..errors import CallerMemoryError
from ..store.webhooks import Delivery, Settlement, WebhookEndpoint
from .secrets import SecretKeyError, signature_headers
from .service import WebhookService

log = logging.getLogger("caller_memory.webhooks")

#: Seconds before each attempt after the first (which is at once): about 5 s, 30 s, 2 min, 10 min, 30 min,
#: 1 h, 3 h, 6 h, 12 h (SPEC section 14); after the last one fails, the delivery is ``failed``.
RETRY_DELAYS_S = (5, 30, 120, 600, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600)
MAX_ATTEMPTS = len(RETRY_DELAYS_S) + 1
#: Each delay is drawn from [1 - JITTER, 1 + JITTER] times its nominal value, so that deliveries that
#: failed together do not come back together.
JITTER = 0.2
#: How long a worker keeps its list of endpoints (a new endpoint gets deliveries within this).
ENDPOINTS_CACHE_S = 5.0
USER_AGENT = "caller-memory-webhooks/1"


@dataclass(frozen=True, slots=True)
class SendResult:
    """What one attempt got: the HTTP status (None when there was no answer) and, when it was not a 2xx,
    a short reason without anything from the response body."""

    status: int | None
    error: str = ""

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


class Sender(Protocol):
    async def send(self, url: str, headers: dict[str, str], body: bytes, limit_s: float) -> SendResult:
        """POST ``body`` to ``url`` once (no redirects), within ``limit_s`` seconds; never raises for what
        the receiver or the network did."""


#: ``observe(event, outcome, seconds)`` after each attempt (outcome: delivered, retry, failed, dropped).
Observe = Callable[[str, str, float], None]


class DeliveryTrace(Protocol):
    """Tracing of the attempts (the service's telemetry, when it is on): a span around each, told its
    outcome."""

    def delivery_span(self, delivery: Delivery) -> AbstractContextManager[None]: ...

    def delivered(self, delivery: Delivery, outcome: str) -> None: ...


class Slots:
    """The attempts in flight in this process, per endpoint (at most ``concurrency`` each), and the event that
    wakes its delivery worker: set when something queued here could start now (:meth:`queued`, the use
    cases' :class:`~caller_memory.service.domain.webhooks.service.QueueListener`) and when an attempt ends
    (:meth:`wake`: a slot is free again). Made before both the use cases that queue and the
    :class:`Deliverer` whose attempts take the slots, so that neither is set up after construction."""

    def __init__(self, concurrency: int = 4) -> None:
        self.concurrency = concurrency
        self.event = asyncio.Event()
        #: (project, endpoint id) -> attempts in flight; no entry when none is.
        self.in_flight: dict[tuple[str, str], int] = {}

    def wake(self) -> None:
        self.event.set()

    def could_start(self, deliveries: Sequence[Delivery]) -> bool:
        """Whether a round now could start an attempt of one of ``deliveries`` (just queued): one of their
        endpoints has a free slot here (an endpoint this process has not seen yet has every slot free)."""
        in_flight, concurrency = self.in_flight, self.concurrency
        for d in deliveries:  # noqa: SIM110 - a loop, not any() over a generator: this runs at every end
            if in_flight.get((d.project, d.endpoint_id), 0) < concurrency:
                return True
        return False

    def queued(self, deliveries: Sequence[Delivery]) -> None:
        """``deliveries`` were queued by this process: wake the worker if it could start one of them now. At
        peak every slot of an endpoint is taken and an end would wake it for nothing; the attempt that ends
        and frees a slot wakes it, and every worker also looks every interval."""
        if self.could_start(deliveries):
            self.event.set()


def retry_delay_ms(attempts: int, rng: random.Random) -> int:
    """The delay before the attempt after ``attempts`` ones (1-based count of those made)."""
    nominal = RETRY_DELAYS_S[min(attempts, len(RETRY_DELAYS_S)) - 1]
    return int(nominal * 1000 * rng.uniform(1 - JITTER, 1 + JITTER))


class Deliverer:
    def __init__(
        self,
        webhooks: WebhookService,
        sender: Sender,
        clock: Clock,
        *,
        owner: str,
        slots: Slots | None = None,
        timeout: float = 10.0,
        observe: Observe | None = None,
        rng: random.Random | None = None,
        trace: DeliveryTrace | None = None,
    ) -> None:
        self._webhooks = webhooks
        self._store = webhooks.store
        self._sender = sender
        self._clock = clock
        self.owner = owner
        #: Shared with the use cases that queue (:meth:`Slots.queued`); its ``concurrency`` bounds each endpoint.
        self.slots = slots or Slots()
        self.timeout = timeout
        self._observe = observe
        self._trace = trace
        self._rng = rng or random.Random()
        self._in_flight = self.slots.in_flight
        self._tasks: set[asyncio.Task[None]] = set()
        self._endpoints: list[WebhookEndpoint] = []
        self._endpoints_at = float("-inf")

    @property
    def lease_ms(self) -> int:
        """A claim's lease: the attempt's timeout and a margin for signing, settling and a slow store."""
        return int((self.timeout + 30.0) * 1000)

    async def _endpoints_now(self) -> list[WebhookEndpoint]:
        if time.monotonic() - self._endpoints_at >= ENDPOINTS_CACHE_S:
            self._endpoints = await self._store.list_endpoints()
            self._endpoints_at = time.monotonic()
        return self._endpoints

    def forget_endpoints(self) -> None:
        """Read the endpoints again at the next round (one was created, rotated or deleted here)."""
        self._endpoints_at = float("-inf")

    @property
    def concurrency(self) -> int:
        """Attempts in flight at most per endpoint, in this process."""
        return self.slots.concurrency

    def could_start(self, deliveries: Sequence[Delivery]) -> bool:
        """:meth:`Slots.could_start`."""
        return self.slots.could_start(deliveries)

    async def run_once(self) -> int:
        """Claim what is due for every endpoint with a free slot and start those attempts; how many."""
        started = 0
        for endpoint in await self._endpoints_now():
            slot = (endpoint.project, endpoint.endpoint_id)
            free = self.concurrency - self._in_flight.get(slot, 0)
            if free <= 0:
                continue
            now = self._clock.now_ms()
            claimed = await self._store.claim_deliveries(
                endpoint.project,
                endpoint.endpoint_id,
                now,
                free,
                owner=self.owner,
                lease_until=now + self.lease_ms,
            )
            for delivery in claimed:
                self._in_flight[slot] = self._in_flight.get(slot, 0) + 1
                task = asyncio.create_task(self._attempt(endpoint, delivery))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
                started += 1
        return started

    async def stop(self) -> None:
        """Cancel the attempts in flight (shutdown): their leases run out and another worker, or this one
        after a restart, makes them again (at least once)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def drain(self) -> None:
        """Wait for the attempts in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _attempt(self, endpoint: WebhookEndpoint, delivery: Delivery) -> None:
        slot = (endpoint.project, endpoint.endpoint_id)
        began = time.monotonic()
        outcome = "dropped"
        try:
            if self._trace is None:
                outcome = await self._send(endpoint, delivery)
            else:
                with self._trace.delivery_span(delivery):
                    outcome = await self._send(endpoint, delivery)
                    self._trace.delivered(delivery, outcome)
        except asyncio.CancelledError:  # the process stops (stop()): the lease runs out, it is made again
            outcome = "cancelled"
            raise
        except CallerMemoryError as exc:  # the store: the lease runs out and another attempt comes
            log.warning(
                "webhook delivery %s of %s: %s", delivery.delivery_id, endpoint.endpoint_id, exc.detail
            )
            outcome = "store_error"
        except Exception:  # pragma: no cover - a bug must not stop the other deliveries
            log.exception("webhook delivery %s failed unexpectedly", delivery.delivery_id)
            outcome = "error"
        finally:
            self._in_flight[slot] -= 1
            if self._in_flight[slot] <= 0:
                del self._in_flight[slot]
            if self._observe is not None:
                self._observe(delivery.event, outcome, time.monotonic() - began)

    async def _send(self, endpoint: WebhookEndpoint, delivery: Delivery) -> str:
        now = self._clock.now_ms()
        # Still queued? An erasure (or a deletion) since the claim means it must not go out.
        if await self._store.get_delivery(delivery.project, delivery.delivery_id, now) is None:
            return "dropped"
        try:
            secrets_in_force = self._webhooks.secrets_in_force(endpoint, now)
        except (SecretKeyError, CallerMemoryError) as exc:
            detail = getattr(exc, "detail", None) or str(exc)
            log.error("webhook %s cannot be signed: %s", endpoint.endpoint_id, detail)
            result = SendResult(None, "signing secret unavailable (CALLER_MEMORY_SECRET_KEY)")
        else:
            headers = signature_headers(
                delivery.delivery_id, delivery.payload, secrets_in_force, datetime.now(UTC)
            )
            headers["content-type"] = "application/json"
            headers["user-agent"] = USER_AGENT
            result = await self._sender.send(endpoint.url, headers, delivery.payload, self.timeout)
        after = self._clock.now_ms()
        status = result.status or 0
        if result.delivered:
            await self._store.settle_delivery(
                delivery.project,
                delivery.delivery_id,
                self.owner,
                Settlement.DELIVERED,
                after,
                http_status=status,
            )
            return "delivered"
        error = result.error or f"HTTP {result.status}"
        attempts = delivery.attempts + 1
        if attempts >= MAX_ATTEMPTS:
            settled = await self._store.settle_delivery(
                delivery.project,
                delivery.delivery_id,
                self.owner,
                Settlement.FAILED,
                after,
                error=error,
                http_status=status,
            )
            if settled:
                log.warning(
                    "webhook %s delivery %s: attempt %d failed: %s; no attempt left, the delivery is failed "
                    "(it can be redelivered)",
                    endpoint.endpoint_id,
                    delivery.delivery_id,
                    attempts,
                    error,
                )
            return "failed"
        due = after + retry_delay_ms(attempts, self._rng)
        settled = await self._store.settle_delivery(
            delivery.project,
            delivery.delivery_id,
            self.owner,
            Settlement.RETRY,
            after,
            next_attempt_at=due,
            error=error,
            http_status=status,
        )
        if settled:
            log.info(
                "webhook %s delivery %s: attempt %d failed: %s; next attempt at %s (in %d s)",
                endpoint.endpoint_id,
                delivery.delivery_id,
                attempts,
                error,
                iso_utc(due),
                round((due - after) / 1000),
            )
        return "retry"
