"""Benchmark: the repeat-callers report costs the same with 10k or 1M recorded conversations.

For each backend (SQLite, Redis) and each size, the store is filled with conversations spread over a year
(one in four from a returning caller, outcomes varied), then the report is asked for the last 30 days by
day and the last 7 days by hour, many times; the median time is reported, with the ratio of each size to the
smallest in the same run. The report reads one counter record per bucket, so its cost depends on the
number of buckets and of distinct outcome values (which saturate once every hour of the range has seen
every outcome), not on the number of conversations.

    .venv/bin/python bench/analytics_query.py [--sizes 10000,100000,1000000] [--repeats 50]

Results go to stdout and to bench/results/analytics_query.json. Filling 1M conversations takes a few
minutes (Redis: one Lua script per conversation, pipelined; SQLite: the store's own tables, in one
transaction).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from caller_memory.service.domain.analytics import AnalyticsService, increments  # noqa: E402
from caller_memory.service.domain.clock import DAY_MS, HOUR_MS  # noqa: E402
from caller_memory.service.domain.identifiers import Pseudonymizer  # noqa: E402
from caller_memory.service.domain.projects import compile_project, parse_config  # noqa: E402
from caller_memory.service.domain.store import ConversationEntry, FirstInteraction, Store  # noqa: E402
from caller_memory.service.storage import open_store  # noqa: E402
from caller_memory.service.storage.codec import encode_entry  # noqa: E402
from caller_memory.service.storage.redis import keys  # noqa: E402

from tests.support.redis_server import RedisServer  # noqa: E402

PROJECT = "bench"
QA = ["resolved", "unresolved", "abandoned", None]
REASONS = ["billing", "booking", "complaint", None]
TARGETS = ["human", "voicemail", None]


def conversations(count: int, now: int, seed: int = 7) -> list[ConversationEntry]:
    rng = random.Random(seed)
    start = now - 365 * DAY_MS
    out = []
    for i in range(count):
        hour = start + rng.randrange(365 * 24) * HOUR_MS
        first = None
        if rng.random() < 0.25:
            first = FirstInteraction(
                f"first-{i}",
                hour - rng.randrange(1, 24 * 20) * HOUR_MS,
                rng.choice(QA),
                rng.choice(REASONS),
                rng.choice(TARGETS),
            )
        out.append(
            ConversationEntry(
                f"conv-{i:08d}",
                hour,
                "voice",
                rng.choice(QA),
                rng.choice(REASONS),
                rng.choice(TARGETS),
                first,
            )
        )
    return out


def fill_sqlite(path: Path, entries: list[ConversationEntry], expires: int) -> None:
    """Write what SQLiteStore.record_conversation writes, in one transaction (the schema exists)."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO analytics_conversations (project, sort_key, conversation_id, repeat, entry, expires_at) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (
            (PROJECT, e.sort_key, e.conversation_id, e.first is not None, encode_entry(e), expires)
            for e in entries
        ),
    )
    totals: dict[tuple[str, int, str], int] = {}
    for e in entries:
        for c in increments(e, ["hour", "day", "week"]):
            for name, amount in c.values.items():
                key = (c.kind, c.bucket, name)
                totals[key] = totals.get(key, 0) + amount
    conn.executemany(
        "INSERT INTO analytics_counters (project, kind, bucket, name, count, expires_at) VALUES (?, ?, ?, ?, ?, ?)",
        ((PROJECT, kind, bucket, name, amount, expires) for (kind, bucket, name), amount in totals.items()),
    )
    conn.execute("COMMIT")
    conn.close()


async def fill_redis(store: Any, entries: list[ConversationEntry], expires: int) -> None:
    """Record every conversation with the store's own script, pipelined in batches."""
    client = store._transport.client
    script = store._transport.scripts["record"]
    for offset in range(0, len(entries), 2000):
        async with client.pipeline(transaction=False) as pipe:
            for e in entries[offset : offset + 2000]:
                script_keys = [
                    keys.analytics_entry_key(PROJECT, e.conversation_id),
                    keys.analytics_index_key(PROJECT, None),
                    keys.analytics_index_key(PROJECT, e.first is not None),
                ]
                args: list[Any] = [b"%d|" % expires + encode_entry(e), e.sort_key, expires]
                for c in increments(e, ["hour", "day", "week"]):
                    script_keys.append(keys.analytics_counter_key(PROJECT, c.kind, c.bucket))
                    args.append(len(c.values))
                    for name, amount in c.values.items():
                        args += [name, amount]
                await script(keys=script_keys, args=args, client=pipe)
            await pipe.execute()


async def time_reports(store: Store, now: int, repeats: int) -> dict[str, float]:
    project = compile_project(
        PROJECT, parse_config({"memory": {"repeat_caller": {"retention": "P400D"}}}), Pseudonymizer(b"k" * 32)
    )
    service = AnalyticsService(store)
    queries = {
        "30 days by day": (now - 30 * DAY_MS, now, "day"),
        "7 days by hour": (now - 7 * DAY_MS, now, "hour"),
    }
    out = {}
    for name, (start, stop, interval) in queries.items():
        samples = []
        for _ in range(repeats):
            began = time.perf_counter()
            report = await service.repeat_callers(project, start=start, stop=stop, interval=interval, now=now)
            samples.append(time.perf_counter() - began)
        assert report["totals"]["conversations"] > 0
        out[name] = statistics.median(samples) * 1000
        # What the query read: one record per bucket, with one value per counter name present in it.
        buckets = await store.counters(PROJECT, interval, start, stop - 1, now)
        out[name + " values read"] = sum(len(b.values) for b in buckets)
    return out


async def run_backend(
    backend: str, sizes: list[int], repeats: int, workdir: Path
) -> dict[int, dict[str, float]]:
    now = time.time_ns() // 1_000_000
    expires = now + 400 * DAY_MS
    results = {}
    for size in sizes:
        entries = conversations(size, now)
        began = time.perf_counter()
        if backend == "sqlite":
            url = f"sqlite:///{workdir}/bench-{size}.db"
            store = open_store(url)
            await store.open()
            await store.close()
            fill_sqlite(workdir / f"bench-{size}.db", entries, expires)
            store = open_store(url)
            await store.open()
            server = None
        else:
            server = RedisServer()
            server.start()
            store = open_store(server.url, timeout=5.0)
            await store.open()
            await fill_redis(store, entries, expires)
        print(
            f"  {backend}: filled {size:,} conversations in {time.perf_counter() - began:.1f} s", flush=True
        )
        results[size] = await time_reports(store, now, repeats)
        await store.close()
        if server is not None:
            server.close()
    return results


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="comma-separated store sizes")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--backends", default="sqlite,redis")
    args = parser.parse_args()
    sizes = sorted(int(size) for size in args.sizes.split(","))
    report: dict[str, Any] = {
        "sizes": sizes,
        "repeats": args.repeats,
        "median_ms": {},
        "ratio_to_smallest": {},
    }
    with tempfile.TemporaryDirectory() as workdir:
        for backend in args.backends.split(","):
            results = await run_backend(backend, sizes, args.repeats, Path(workdir))
            report["median_ms"][backend] = {str(size): r for size, r in results.items()}
            report["ratio_to_smallest"][backend] = {
                str(size): {q: round(results[size][q] / results[sizes[0]][q], 2) for q in results[size]}
                for size in sizes
            }
    print(f"\nrepeat-callers report, median of {args.repeats} (ms), and ratio to {sizes[0]:,}")
    print(f"{'backend':8} {'query':16} " + " ".join(f"{size:>18,}" for size in sizes))
    for backend, per_size in report["median_ms"].items():
        for query in per_size[str(sizes[0])]:
            if query.endswith("values read"):
                cells = " ".join(f"{int(per_size[str(size)][query]):>18,}" for size in sizes)
                print(f"{backend:8} {query[:-12] + ' (values)':16} {cells}")
                continue
            base = per_size[str(sizes[0])][query]
            cells = " ".join(
                f"{per_size[str(size)][query]:9.2f} ({per_size[str(size)][query] / base:4.2f}x)"
                for size in sizes
            )
            print(f"{backend:8} {query:16} {cells}")
    out = ROOT / "bench" / "results" / "analytics_query.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    asyncio.run(main())
