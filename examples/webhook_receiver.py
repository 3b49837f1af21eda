"""A tiny receiver of Caller Memory webhooks: it verifies each delivery and prints one line per event.

Every delivery is a POST signed per the Standard Webhooks specification (headers ``webhook-id``,
``webhook-timestamp``, ``webhook-signature``). This receiver checks the signature with the ``standardwebhooks``
package and the endpoint's signing secret (``whsec_...``, answered once when the webhook was registered), then:

- answers 204 to a delivery that verifies, and prints ``<type> <id> conversation=<id>`` (for ``caller.erased``,
  the ids of the erased conversations) on standard output;
- answers 401 to anything else (a wrong secret, a changed body, a timestamp more than five minutes away, missing
  headers), and says why on standard error. The service counts a 401 as a failed attempt and retries.

The same event may arrive more than once (delivery is at least once, and each attempt carries the same
``webhook-id``): the receiver remembers the ids it has seen and prints a repeat as such, still answering 204, so
that the service stops retrying. Run it with the secret in the environment (an argument would show in the
process list)::

    WEBHOOK_SECRET=whsec_... .venv/bin/python examples/webhook_receiver.py --port 8090

It accepts deliveries on any path. ``--port 0`` picks a free port; the first line printed names the address.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections import OrderedDict
from typing import Any

from aiohttp import web
from standardwebhooks import Webhook, WebhookVerificationError
from standardwebhooks.webhooks import EmptyWebhookSecretError

#: The largest body read: a ``conversation.ended`` event carrying a whole transcript stays well under it.
MAX_BODY_BYTES = 32 * 1024 * 1024
#: How many delivery ids are remembered to recognise a repeat (the oldest are forgotten first).
REMEMBERED_IDS = 10_000

VERIFIER = web.AppKey("verifier", Webhook)
SEEN: web.AppKey[OrderedDict[str, None]] = web.AppKey("seen")


def describe(event: dict[str, Any]) -> str:
    """One line about a verified event: its type, its id, and the conversation (or conversations) it is about."""
    data = event.get("data") or {}
    if "conversation_id" in data:
        about = f"conversation={data['conversation_id']}"
    else:
        about = "conversations=" + (",".join(data.get("conversation_ids") or []) or "(none)")
    return f"{event.get('type')} {event.get('id')} {about}"


async def receive(request: web.Request) -> web.Response:
    """Verify one delivery; 204 if it verifies, 401 if it does not."""
    body = await request.read()
    try:
        # Verifies the signature over the exact bytes received, and that the timestamp is within five minutes
        # (an old, replayed delivery is refused); only then is the body parsed.
        event = request.app[VERIFIER].verify(body, dict(request.headers))
    # ValueError: headers or a body that are not even well-formed (the library does not wrap those).
    except (WebhookVerificationError, ValueError) as exc:
        print(f"refused a delivery: {exc or type(exc).__name__}", file=sys.stderr, flush=True)
        return web.Response(status=401, text="signature does not verify\n")
    seen: OrderedDict[str, None] = request.app[SEEN]
    delivery_id = request.headers["webhook-id"]
    if delivery_id in seen:
        print(f"{describe(event)} (a repeat: already handled)", flush=True)
    else:
        seen[delivery_id] = None
        if len(seen) > REMEMBERED_IDS:
            seen.popitem(last=False)
        print(describe(event), flush=True)
    return web.Response(status=204)


def make_app(secret: str) -> web.Application:
    """The receiver's application, verifying with ``secret``."""
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app[VERIFIER] = Webhook(secret)
    app[SEEN] = OrderedDict()
    app.router.add_post("/{path:.*}", receive)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8090, help="port (default 8090; 0: any free port)")
    parser.add_argument(
        "--secret",
        default=os.environ.get("WEBHOOK_SECRET", ""),
        help="the endpoint's signing secret, whsec_... (default: the WEBHOOK_SECRET environment variable)",
    )
    args = parser.parse_args()
    if not args.secret.startswith("whsec_"):
        parser.error("give the webhook's signing secret (whsec_...) in WEBHOOK_SECRET or with --secret")
    try:
        app = make_app(args.secret)
    except (ValueError, EmptyWebhookSecretError) as exc:  # not base64 after its prefix, or nothing at all
        parser.error(f"that signing secret cannot be read: {exc}")
    listening = socket.create_server((args.host, args.port))  # bound here, so that --port 0 can say its port
    host, port = listening.getsockname()[:2]
    print(f"webhook receiver listening on http://{host}:{port}/", flush=True)
    web.run_app(app, sock=listening, print=None, access_log=None)


if __name__ == "__main__":
    main()
