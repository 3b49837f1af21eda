"""What the Redis transport's shared connection (the lane) costs per call, against redis-py's own client.

    .venv/bin/python bench/transport.py            # about 20 seconds
    .venv/bin/python bench/transport.py --calls 5000

One process, one private redis-server (``--save "" --appendonly no``). Each side makes the same calls, a GET
of a 100-byte value and a two-command HSET + EXPIRE, from 1, 8 and 32 coroutines at once; what is measured
is the process's CPU time per call (``time.process_time``) and the calls per second, in alternating rounds
(the median of 3). The lane is :class:`caller_memory.service.storage.redis.transport.StandaloneTransport`;
the client is ``redis.asyncio.Redis`` with hiredis, one command per call or a pipeline of two without a
transaction: what a hand-written handler would use. Results: a table on stdout (and ``--output`` as JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from caller_memory.service.storage.redis.transport import ConnectionLimits, StandaloneTransport

from tests.support.redis_server import RedisServer

VALUE = b"v" * 100
Call = Callable[[], Awaitable[Any]]


async def lane_side(url: str) -> tuple[Call, Call, Callable[[], Awaitable[None]]]:
    transport = StandaloneTransport(url, ConnectionLimits(2.0, 2.0, 512, 30))
    await transport.open()

    async def read() -> Any:
        return await transport.run(("GET", "bench:k"))

    async def write() -> Any:
        return await transport.run(("HSET", "bench:h", "f", "x"), ("EXPIRE", "bench:h", 100))

    return read, write, transport.aclose


async def client_side(url: str) -> tuple[Call, Call, Callable[[], Awaitable[None]]]:
    client = Redis.from_url(url, max_connections=512)

    async def read() -> Any:
        return await client.get("bench:k")

    async def write() -> Any:
        async with client.pipeline(transaction=False) as pipe:
            pipe.hset("bench:h", "f", "x")
            pipe.expire("bench:h", 100)
            return await pipe.execute()

    return read, write, client.aclose


async def measure(side: str, url: str, concurrency: int, calls: int) -> tuple[float, float]:
    read, write, close = await (lane_side if side == "lane" else client_side)(url)
    try:
        per_worker = max(1, calls // concurrency // 2)

        async def worker() -> None:
            for _ in range(per_worker):
                await read()
                await write()

        await asyncio.gather(*(worker() for _ in range(concurrency)))  # warm-up: connections, caches
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await close()
    made = per_worker * 2 * concurrency
    return cpu / made * 1e6, made / wall


async def main(calls: int, rounds: int) -> dict[str, Any]:
    server = RedisServer()
    server.start()
    try:
        setup = Redis.from_url(server.url)
        await setup.set("bench:k", VALUE)
        await setup.aclose()
        results: dict[str, Any] = {}
        for concurrency in (1, 8, 32):
            runs: dict[str, list[tuple[float, float]]] = {"lane": [], "client": []}
            for _ in range(rounds):
                for side in ("lane", "client"):
                    runs[side].append(await measure(side, server.url, concurrency, calls))
            results[str(concurrency)] = {
                side: {
                    "cpu_us_per_call": statistics.median(r[0] for r in runs[side]),
                    "calls_per_s": statistics.median(r[1] for r in runs[side]),
                    "runs": runs[side],
                }
                for side in runs
            }
        return results
    finally:
        server.close()


def report(results: dict[str, Any]) -> None:
    print(f"{'in flight':>9} {'side':7} {'CPU us/call':>11} {'calls/s':>9}")
    for concurrency, sides in results.items():
        for side, r in sides.items():
            print(f"{concurrency:>9} {side:7} {r['cpu_us_per_call']:11.1f} {r['calls_per_s']:9.0f}")
        ratio = sides["client"]["cpu_us_per_call"] / sides["lane"]["cpu_us_per_call"]
        print(f"{'':9} the lane takes {1 / ratio:.2f}x the client's CPU per call")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000, help="calls per measurement (default 20000)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    found = asyncio.run(main(args.calls, args.rounds))
    report(found)
    if args.output is not None:
        args.output.write_text(json.dumps(found, indent=2) + "\n")
