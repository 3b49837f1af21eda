"""A start's cost against its caller's number of conversations (issue 27, item 7), on a private redis-server.

    .venv/bin/python bench/caller_starts.py            # about 2 minutes
    .venv/bin/python bench/caller_starts.py --smoke    # seconds: checks that everything runs

One process holds the service's domain (``build_services``, the code of this work tree, defaults) on a private
redis-server without persistence (started here, ended by its pid). Caller ``few`` has 10 ended conversations
on the phone channel, caller ``many`` 3,000 (written through the store). Measured:

- ``start``: a start of each caller, interleaved one by one (few, many, few, ...): each supersedes the
  caller's live call and offers it as resume, the whole path a callback takes. Latency p50/p99 of each and the
  ratio of the medians (target: many within 1.5x of few). Beside it, ``read-all``: what the start did before,
  reading every header of ``many`` (``Store.caller_conversations``), for scale.
- ``tenant``: another project's memory reads at a fixed rate (200/s, open loop: each read is due at its
  time, and its latency counts from then, so a stall is counted) for a few seconds, alone and then while
  ``many``'s starts run at 20/s in the same process (what one service process serving both tenants sees); p99 of
  each, paired by run, 5 runs; the median of the ratios (target <= 1.25x).

Results: bench/results/caller_starts.json (or ``--output``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

from caller_memory.service.app import build_services  # noqa: E402
from caller_memory.service.config import Settings  # noqa: E402
from caller_memory.service.domain.projects import Project  # noqa: E402
from caller_memory.service.domain.store import CallerRef  # noqa: E402
from caller_memory.service.http.app_keys import Services  # noqa: E402
from in_process import commit, percentile, tenant_reads  # noqa: E402

from tests.support.conversations import ended_conversations  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402

PSEUDONYM_KEY = b"bench-caller-starts-pseudonym-key-0123456789"
FEW, MANY, READER = "+14155550100", "+14155550123", "+14155550177"
CONFIG: dict[str, Any] = {
    "memory": {
        "repeat_caller": {"state_keys": ["cheese"], "retention": "P30D"},
        "conversation": {"enabled": True},
    }
}
TARGET_START_RATIO = 1.5
#: The starts per second of ``many`` while the other tenant reads.
START_RATE = 20.0
TARGET_TENANT_RATIO = 1.25


class Starts:
    """Callbacks of one caller: a live call, then a start that supersedes it (and offers it as resume)."""

    def __init__(self, services: Services, shop: Project, raw: str, tag: str) -> None:
        self.services, self.shop, self.raw, self.tag = services, shop, raw, tag
        self.n = 0

    async def one(self) -> float:
        self.n += 1
        live = f"{self.tag}-{self.n}"
        if self.n == 1:
            message = {"role": "user", "content": "Hi", "turn_id": 0}
            await self.services.transcripts.append(
                self.shop, live, {"caller": self.raw, "channel": "phone", "messages": [message]}
            )
        began = time.perf_counter()
        started = await self.services.lifecycle.start(
            self.shop, f"{self.tag}-{self.n + 1}", {"caller": self.raw, "channel": "phone"}
        )
        elapsed = time.perf_counter() - began
        assert started["superseded"] == [live], started["superseded"]
        self.n += 0
        return elapsed


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    began = time.perf_counter()
    await call()
    return time.perf_counter() - began


async def measure(url: str, smoke: bool) -> dict[str, Any]:
    services = build_services(Settings(pseudonym_key=PSEUDONYM_KEY, store_url=url, store_timeout=10.0))
    await services.store.open()
    try:
        shop, _ = await services.projects.apply("shop", CONFIG, actor="bench")
        other, _ = await services.projects.apply("other", CONFIG, actor="bench")
        await services.memory.patch(other, READER, {"cheese": "gouda"})
        many_count = 300 if smoke else 3000
        await ended_conversations(services, shop, FEW, 10, "few")
        await ended_conversations(services, shop, MANY, many_count, "many")
        few, many = Starts(services, shop, FEW, "f"), Starts(services, shop, MANY, "m")
        rounds = 20 if smoke else 300
        for _ in range(5):  # warm up both
            await few.one()
            await many.one()
        few_ms, many_ms = [], []
        for _ in range(rounds):
            few_ms.append(await few.one() * 1000)
            many_ms.append(await many.one() * 1000)
        subject = services.transcripts.caller(shop, MANY).subject
        ref = CallerRef("shop", subject)
        read_all = [
            await timed(lambda: services.store.caller_conversations(ref, services.clock.now_ms())) * 1000
            for _ in range(5 if smoke else 30)
        ]
        # Another tenant's reads, alone and beside many's starts: paired runs.
        runs = 2 if smoke else 5
        seconds = 0.5 if smoke else 4.0
        rate = 200.0
        pairs = []
        await tenant_reads(services, other, READER, rate, seconds / 4)  # warm up
        for _ in range(runs):
            alone = await tenant_reads(services, other, READER, rate, seconds)
            stop = asyncio.Event()

            async def load(stop: asyncio.Event = stop) -> int:
                count = 0
                began = time.perf_counter()
                while not stop.is_set():  # a fixed rate: one caller calling back again and again
                    await many.one()
                    count += 1
                    await asyncio.sleep(max(0.0, began + count / START_RATE - time.perf_counter()))
                return count

            loader = asyncio.create_task(load())
            await asyncio.sleep(0.05)
            beside = await tenant_reads(services, other, READER, rate, seconds)
            stop.set()
            starts = await loader
            a, b = percentile(alone, 0.99) * 1000, percentile(beside, 0.99) * 1000
            pairs.append({"alone_p99_ms": a, "beside_p99_ms": b, "ratio": b / a, "starts_beside": starts})
        start_ratio = statistics.median(many_ms) / statistics.median(few_ms)
        tenant_ratio = statistics.median(p["ratio"] for p in pairs)
        return {
            "conversations": {"few": 10, "many": many_count},
            "start_ms": {
                side: {"p50": statistics.median(v), "p99": percentile(v, 0.99), "n": len(v)}
                for side, v in (("few", few_ms), ("many", many_ms))
            },
            "start_ratio_many_to_few": start_ratio,
            "read_all_headers_of_many_ms": {"p50": statistics.median(read_all), "n": len(read_all)},
            "tenant": {
                "rate_per_s": rate,
                "starts_per_s": START_RATE,
                "seconds": seconds,
                "runs": pairs,
                "median_ratio": tenant_ratio,
            },
            "targets": {
                "start_ratio": {"target": TARGET_START_RATIO, "pass": start_ratio <= TARGET_START_RATIO},
                "tenant_ratio": {"target": TARGET_TENANT_RATIO, "pass": tenant_ratio <= TARGET_TENANT_RATIO},
            },
        }
    finally:
        await services.store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="a few seconds; figures meaningless")
    parser.add_argument(
        "--output", type=Path, default=Path(__file__).parent / "results" / "caller_starts.json"
    )
    args = parser.parse_args()
    load_start = os.getloadavg()
    with RedisServer() as server:
        result = asyncio.run(measure(server.url, args.smoke))
    result["machine"] = {
        "cpus": os.cpu_count(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "commit": commit(),
        "redis_server": subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True, check=False
        ).stdout.strip(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    s = result["start_ms"]
    print(f"start, 10 conversations:    p50 {s['few']['p50']:.2f} ms  p99 {s['few']['p99']:.2f} ms")
    print(f"start, {result['conversations']['many']} conversations: p50 {s['many']['p50']:.2f} ms  "
          f"p99 {s['many']['p99']:.2f} ms")  # fmt: skip
    print(f"ratio of medians: {result['start_ratio_many_to_few']:.2f}x (target <= {TARGET_START_RATIO}x): "
          f"{'PASS' if result['targets']['start_ratio']['pass'] else 'FAIL'}")  # fmt: skip
    print(f"reading every header of the {result['conversations']['many']} (the old start's read): p50 "
          f"{result['read_all_headers_of_many_ms']['p50']:.1f} ms")  # fmt: skip
    for run in result["tenant"]["runs"]:
        print(f"  tenant p99 alone {run['alone_p99_ms']:.2f} ms, beside starts {run['beside_p99_ms']:.2f} ms: "
              f"{run['ratio']:.2f}x ({run['starts_beside']} starts)")  # fmt: skip
    print(f"tenant p99 ratio, median of {len(result['tenant']['runs'])}: {result['tenant']['median_ratio']:.2f}x "
          f"(target <= {TARGET_TENANT_RATIO}x): {'PASS' if result['targets']['tenant_ratio']['pass'] else 'FAIL'}")  # fmt: skip


if __name__ == "__main__":
    main()
