"""A webhook receiver for bench/webhooks.py, run as its own process: ``python bench/webhook_receiver.py --port N``.

It stands for the customer's server. Each registered webhook gets a URL of its own, ``/hook/<label>``, and
``?delay_ms=N`` makes the receiver answer N milliseconds after the request came in (50: a receiver that does
some work; 0: at once). Every delivery is checked with the Standard Webhooks library (``standardwebhooks``,
the one the service's tests use) once the label's signing secret is known, so that the benchmark counts
deliveries a real receiver would accept, not just requests; its time of arrival (wall clock, the same
clock the load generator reports its window in) and ``webhook-id`` are kept, to count what arrived during
a measurement and to find duplicates.

Control routes (used by the benchmark, not by the service): ``PUT /secret/<label>`` (body: ``{"secret": "whsec_..."}``),
``GET /stats/<label>?since=&until=`` (JSON; the window is optional), ``GET /healthz``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from standardwebhooks.webhooks import Webhook, WebhookVerificationError


@dataclass
class Label:
    """What one webhook URL received."""

    verifier: Webhook | None = None
    arrivals: list[float] = field(default_factory=list)
    ids: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    verified: int = 0
    invalid: int = 0
    unchecked: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    body_bytes: int = 0
    #: The connections the deliveries came on (the sender's (address, port)): how many attempts the service
    #: had in flight at once at most, where ``max_in_flight`` cannot tell (a receiver answering at once
    #: handles one request at a time).
    peers: set[Any] = field(default_factory=set)


LABELS: dict[str, Label] = {}


def label_of(request: web.Request) -> Label:
    return LABELS.setdefault(request.match_info["label"], Label())


async def hook(request: web.Request) -> web.Response:
    arrived = time.time()
    found = label_of(request)
    found.in_flight += 1
    found.max_in_flight = max(found.max_in_flight, found.in_flight)
    try:
        body = await request.read()
        found.arrivals.append(arrived)
        found.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        found.body_bytes += len(body)
        found.ids[request.headers.get("webhook-id", "")] += 1
        if found.verifier is None:
            found.unchecked += 1
        else:
            try:
                event = found.verifier.verify(body, dict(request.headers))
            except WebhookVerificationError:
                found.invalid += 1
            else:
                found.verified += 1
                found.events[str(event.get("type"))] += 1
        delay_ms = float(request.query.get("delay_ms", "0"))
        if delay_ms > 0:
            # Counted from arrival: the answer leaves delay_ms after the request came in.
            await asyncio.sleep(max(0.0, arrived + delay_ms / 1000 - time.time()))
        return web.Response(status=204)
    finally:
        found.in_flight -= 1


async def set_secret(request: web.Request) -> web.Response:
    body = await request.json()
    label_of(request).verifier = Webhook(str(body["secret"]))
    return web.Response(status=204)


async def stats(request: web.Request) -> web.Response:
    found = label_of(request)
    since = float(request.query.get("since", "-inf"))
    until = float(request.query.get("until", "inf"))
    window = [t for t in found.arrivals if since <= t < until]
    body: dict[str, Any] = {
        "received": len(found.arrivals),
        "distinct_ids": len(found.ids),
        "duplicates": sum(n - 1 for n in found.ids.values() if n > 1),
        "verified": found.verified,
        "invalid": found.invalid,
        "unchecked": found.unchecked,
        "events": dict(found.events),
        "in_flight": found.in_flight,
        "max_in_flight": found.max_in_flight,
        "connections": len(found.peers),
        "body_bytes": found.body_bytes,
        "first": found.arrivals[0] if found.arrivals else None,
        "last": found.arrivals[-1] if found.arrivals else None,
        "in_window": len(window),
        "first_in_window": window[0] if window else None,
        "last_in_window": window[-1] if window else None,
    }
    return web.json_response(body)


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/hook/{label}", hook)
    app.router.add_put("/secret/{label}", set_secret)
    app.router.add_get("/stats/{label}", stats)
    app.router.add_get("/healthz", healthz)
    web.run_app(app, host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
