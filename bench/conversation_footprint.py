"""Redis memory per ended conversation (docs/operations.md, "Sizing"): what the end of a conversation
stores besides the caller's memory, with analytics off and on.

Starts a private redis-server and the service in this process, ends ``--callers`` x ``--calls``
conversations (a day apart, no state fields, so no caller memory is written) over HTTP, and reports Redis's
``used_memory`` growth per conversation and MEMORY USAGE by kind of key (the letter after the hash tag: c
conversation record, cc the id's claim, cs the caller's conversation ids, f first interaction; the project's
analytics keys, hash tag ``{a:<project>}``, together).

    .venv/bin/python bench/conversation_footprint.py [--callers 4000] [--calls 2]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections import Counter
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from caller_memory.service.domain.clock import FakeClock  # noqa: E402

from tests.conftest import running_api  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

OUTCOME = {"qa": "resolved", "handoff_reason": "billing", "handoff_to": "tier2"}


def kind_of(key: bytes) -> str:
    """``cm:{<bucket>}:c:...`` -> ``c``; every analytics key (``cm:{a:<project>}:...``) -> ``analytics``."""
    if key.startswith(b"cm:{a:"):
        return "analytics"
    parts = key.split(b":")
    return parts[2].decode() if key.startswith(b"cm:{") else parts[1].decode()


async def measure(analytics: bool, callers: int, calls: int) -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        clock = FakeClock()
        async with running_api(server.url, clock, sweep_interval=0) as api:
            config = {"state_keys": ["caller_name"], "retention": "P30D", "default_region": "US"}
            tokens = await api.project_with_tokens("shop", config | {"analytics_enabled": analytics})
            before = int(client.info("memory")["used_memory"])
            limit = asyncio.Semaphore(32)

            async def end(caller: int, call: int) -> None:
                body = {"caller": f"+1212{2000000 + caller:07d}", "state": {}, "outcome": OUTCOME}
                async with limit:
                    reply = await api.call(
                        "POST",
                        f"/v1/projects/shop/conversations/call-{call}-{caller:06d}/end",
                        token=tokens["agent"],
                        json=body,
                    )
                if reply.status != 200:
                    raise RuntimeError(f"end of a conversation failed: {reply.status} {reply.body}")

            for call in range(calls):
                clock.advance(86_400)
                await asyncio.gather(*(end(caller, call) for caller in range(callers)))
            grown = int(client.info("memory")["used_memory"]) - before
        total = callers * calls
        print(f"analytics {'on' if analytics else 'off'}: {total:,} conversations of {callers:,} callers")
        print(f"  used_memory grew {grown / total:,.0f} B per conversation")
        count: Counter[str] = Counter()
        size: Counter[str] = Counter()
        for key in client.scan_iter(match="cm:*", count=1000):
            kind = kind_of(key)
            count[kind] += 1
            size[kind] += int(client.memory_usage(key, samples=0) or 0)
        for kind in sorted(count):
            print(
                f"  {kind:10} {count[kind]:7,} keys {size[kind] / total:8.0f} B per conversation (MEMORY USAGE)"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callers", type=int, default=4000)
    parser.add_argument("--calls", type=int, default=2, help="conversations per caller, a day apart")
    args = parser.parse_args()
    for analytics in (False, True):
        asyncio.run(measure(analytics, args.callers, args.calls))


if __name__ == "__main__":
    main()
