"""Benchmark: an expiry sweep costs what expired, not what is stored.

Two stores per backend, each with 10,000 expired fields (1,000 callers whose 10 fields have all expired):
one holds nothing else, the other holds them among 1,000,000 fields (100,000 callers of 10 fields). A sweep
runs on each (the service's Sweeper, batches of 1,000); the ratio of the two times, measured in the same
run, should be near 1.

    .venv/bin/python bench/sweep.py [--callers 100000] [--expired-callers 1000] [--repeats 3]

Results go to stdout and bench/results/sweep.json. Filling is done with the backends' own key layout and
row format directly (what patch_fields would write), which is much faster than a million API calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from caller_memory.service.domain.clock import FakeClock  # noqa: E402
from caller_memory.service.domain.fields import StoredField  # noqa: E402
from caller_memory.service.domain.retention import Sweeper  # noqa: E402
from caller_memory.service.storage import open_store  # noqa: E402
from caller_memory.service.storage.redis import keys  # noqa: E402

from tests.support.redis_server import RedisServer  # noqa: E402

PROJECT = "bench"
FIELDS = [f"field_{i}" for i in range(10)]
HOUR = 3_600_000
VALUE = b'"' + b"x" * 30 + b'"'  # 32 bytes of JSON


def subject(i: int) -> str:
    return f"{i:032x}"[::-1]  # spread over the buckets


def callers(total: int, expired: int, t: int) -> list[tuple[str, int]]:
    """(subject, expires_at of all its fields): ``expired`` callers expire at t + 1 h, the rest in 10 days."""
    step = max(1, total // expired)
    dying = {i * step for i in range(expired)}
    return [(subject(i), t + HOUR if i in dying else t + 240 * HOUR) for i in range(total)]


def fill_sqlite(path: Path, rows: list[tuple[str, int]], t: int) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO fields (project, subject, name, value, expires_at, written_at) VALUES (?, ?, ?, ?, ?, ?)",
        ((PROJECT, s, name, VALUE, e, t) for s, e in rows for name in FIELDS),
    )
    conn.execute("COMMIT")
    conn.close()


async def fill_redis(store: Any, rows: list[tuple[str, int]], t: int) -> None:
    client = store._transport.client
    for offset in range(0, len(rows), 5000):
        async with client.pipeline(transaction=False) as pipe:
            for s, e in rows[offset : offset + 5000]:
                packed = StoredField(VALUE, e, t).packed()
                pipe.hset(keys.memory_key(PROJECT, s), mapping=dict.fromkeys(FIELDS, packed))
                pipe.pexpireat(keys.memory_key(PROJECT, s), e)
                pipe.zadd(keys.caller_index_key(s), {keys.index_member(PROJECT, s): e})
            await pipe.execute()


async def measure(backend: str, total: int, expired: int, workdir: Path, repeats: int) -> dict[str, Any]:
    t = time.time_ns() // 1_000_000
    rows = callers(total, expired, t)
    samples, removed = [], {}
    for run in range(repeats):
        server = None
        if backend == "sqlite":
            url = f"sqlite:///{workdir}/sweep-{total}-{run}.db"
            store = open_store(url)
            await store.open()
            fill_sqlite(workdir / f"sweep-{total}-{run}.db", rows, t)
        else:
            server = RedisServer()
            server.start()
            store = open_store(server.url, timeout=5.0)
            await store.open()
            await fill_redis(store, rows, t)
        sweeper = Sweeper(store, FakeClock(t + 2 * HOUR), batch=1000, budget_seconds=600)
        began = time.perf_counter()
        report = await sweeper.run()
        samples.append(time.perf_counter() - began)
        assert report is not None and report.complete
        removed = report.removed
        await store.close()
        if server is not None:
            server.close()
    assert removed["fields"] == expired * len(FIELDS), removed
    return {
        "stored_fields": total * len(FIELDS),
        "expired_fields": removed["fields"],
        "median_s": statistics.median(samples),
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--callers", type=int, default=100_000, help="callers in the large store (x10 fields)"
    )
    parser.add_argument("--expired-callers", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", default="sqlite,redis")
    args = parser.parse_args()
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as workdir:
        for backend in args.backends.split(","):
            small = await measure(
                backend, args.expired_callers, args.expired_callers, Path(workdir), args.repeats
            )
            large = await measure(backend, args.callers, args.expired_callers, Path(workdir), args.repeats)
            report[backend] = {
                "small": small,
                "large": large,
                "ratio": round(large["median_s"] / small["median_s"], 2),
            }
            print(
                f"{backend:7} {small['expired_fields']:,} expired of {small['stored_fields']:>9,}: "
                f"{small['median_s'] * 1000:8.1f} ms | of {large['stored_fields']:>9,}: "
                f"{large['median_s'] * 1000:8.1f} ms | ratio {report[backend]['ratio']:.2f}",
                flush=True,
            )
    out = ROOT / "bench" / "results" / "sweep.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    asyncio.run(main())
