"""The baseline of the conversation-memory benchmarks: what a team would write by hand instead of the service.

A Redis list per conversation, one redis-py (hiredis) async command per request, orjson:

- ``POST /conversations/{id}/messages``: the body's ``messages``, each re-encoded as JSON, in one ``RPUSH``
  (a batch of 10 is one RPUSH of 10); answers the list's new length.
- ``GET /conversations/{id}/history``: ``LRANGE 0 -1``, the stored messages returned as they are.
- ``GET /conversations/{id}/context?caller=<pseudonym>``: ``LRANGE 0 -1`` and ``HGETALL`` of the caller's
  memory hash (the one the service writes: same key layout and packed values
  ``~<expires_at>|<written_at>|<json>``, the JSON after the second ``|``), pipelined in one round trip,
  returned together.

No authentication, no validation, no limits, no expiry, no redaction, no metrics, no logging.

    python bench/transcript_baseline.py --port 8091 --redis redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse

import orjson
import redis.asyncio as redis
from aiohttp import web
from common import PROJECT

REDIS = web.AppKey("redis", redis.Redis)


def list_key(conversation_id: str) -> str:
    return f"bl:t:{conversation_id}"


def memory_key(subject: str) -> str:
    """The service's key of a caller's memory (as bench/baseline_app.py computes it)."""
    return f"cm:{{{int(subject[:8], 16) % 4096}}}:m:{PROJECT}:{subject}"


async def append(request: web.Request) -> web.Response:
    conversation_id = request.match_info["id"]
    messages = orjson.loads(await request.read())["messages"]
    length = await request.app[REDIS].rpush(list_key(conversation_id), *map(orjson.dumps, messages))
    body = {"conversation_id": conversation_id, "added": len(messages), "messages": length}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def history(request: web.Request) -> web.Response:
    conversation_id = request.match_info["id"]
    stored = await request.app[REDIS].lrange(list_key(conversation_id), 0, -1)
    body = {"conversation_id": conversation_id, "contents": [orjson.Fragment(m) for m in stored]}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def context(request: web.Request) -> web.Response:
    conversation_id = request.match_info["id"]
    pipe = request.app[REDIS].pipeline(transaction=False)
    pipe.lrange(list_key(conversation_id), 0, -1)
    pipe.hgetall(memory_key(request.query["caller"]))
    stored, fields = await pipe.execute()
    body = {
        "conversation_id": conversation_id,
        "profile": {
            name.decode(): orjson.Fragment(value.split(b"|", 2)[2]) for name, value in fields.items()
        },
        "messages": [orjson.Fragment(m) for m in stored],
    }
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def make_app(url: str) -> web.Application:
    app = web.Application(client_max_size=64 * 1024)

    async def client(app: web.Application):  # type: ignore[no-untyped-def]
        app[REDIS] = redis.Redis.from_url(url)
        yield
        await app[REDIS].aclose()

    app.cleanup_ctx.append(client)
    app.router.add_post("/conversations/{id}/messages", append)
    app.router.add_get("/conversations/{id}/history", history)
    app.router.add_get("/conversations/{id}/context", context)
    app.router.add_get("/healthz", healthz)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis", required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.redis), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
