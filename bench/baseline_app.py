"""The baseline: what a team would write by hand instead of the service.

One route, ``GET /callers/{id}``: one redis-py (hiredis) async ``HGETALL`` of the caller's hash, returned as
JSON with orjson. ``id`` is the caller's pseudonym (the load generator computes it); the hash is the one the
service reads (same key layout and packed values ``~<expires_at>|<written_at>|<json>``, or the decimal form of
earlier releases: the JSON is what follows the second ``|`` in both, so both answer the same fields from the
same Redis). No authentication, no validation, no metrics, no logging.

    python bench/baseline_app.py --port 8090 --redis redis://127.0.0.1:6379/0
"""

from __future__ import annotations

import argparse

import orjson
import redis.asyncio as redis
from aiohttp import web

REDIS = web.AppKey("redis", redis.Redis)


async def get_caller(request: web.Request) -> web.Response:
    caller = request.match_info["id"]
    key = f"cm:{{{int(caller[:8], 16) % 4096}}}:m:bench:{caller}"
    data = await request.app[REDIS].hgetall(key)
    fields = {name.decode(): orjson.Fragment(value.split(b"|", 2)[2]) for name, value in data.items()}
    return web.Response(body=orjson.dumps({"id": caller, "fields": fields}), content_type="application/json")


def make_app(url: str) -> web.Application:
    app = web.Application()

    async def client(app: web.Application):  # type: ignore[no-untyped-def]
        app[REDIS] = redis.Redis.from_url(url)
        yield
        await app[REDIS].aclose()

    app.cleanup_ctx.append(client)
    app.router.add_get("/callers/{id}", get_caller)
    app.router.add_get("/healthz", healthz)
    return app


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis", required=True)
    args = parser.parse_args()
    web.run_app(make_app(args.redis), host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
