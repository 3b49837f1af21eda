"""The SDK against a running service (its own process): cached reads cost no request, and what
``begin_turn`` adds over a bare aiohttp GET of the same endpoint on the same session.

    python bench/sdk_bench.py URL TOKEN OUTBOX_DIR [--samples 1000]   (JSON result on stdout)

Requests are counted at the server, from its ``/metrics`` (caller_memory_http_requests for the memory-read
route). Latencies are sequential (one request at a time, nothing else running), in pairs: the SDK call and
the bare GET alternate, so that drift in the machine's load hits both alike; medians and the median of the
paired differences are reported. Two pairs are measured: a first turn (``200`` with the body) against a
bare GET, and a later turn (the SDK sends ``If-None-Match``: ``304``, no body) against a bare GET with the
same ``If-None-Match``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from caller_memory.sdk import MemoryClient
from common import PROJECT, caller_phone, quote_phone

ROUTE = "/v1/projects/{project}/callers/{identifier}/memory"


async def read_requests(session: aiohttp.ClientSession, url: str) -> float:
    """Memory reads the server has counted so far (every status)."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    total = 0.0
    for line in text.splitlines():
        counted = line.startswith("caller_memory_http_requests_total{") and f'route="{ROUTE}"' in line
        if counted and 'method="GET"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _stats(sdk: list[float], bare: list[float]) -> dict[str, Any]:
    diffs = [a - b for a, b in zip(sdk, bare, strict=True)]
    return {
        "samples": len(sdk),
        "sdk_median_ms": statistics.median(sdk) * 1000,
        "bare_median_ms": statistics.median(bare) * 1000,
        "difference_of_medians_ms": (statistics.median(sdk) - statistics.median(bare)) * 1000,
        "median_paired_difference_ms": statistics.median(diffs) * 1000,
        "sdk_p90_ms": sorted(sdk)[int(len(sdk) * 0.9)] * 1000,
        "bare_p90_ms": sorted(bare)[int(len(bare) * 0.9)] * 1000,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("token")
    parser.add_argument("outbox_dir", type=Path)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--caller", type=int, default=0)
    args = parser.parse_args()
    phone = caller_phone(args.caller)
    endpoint = f"{args.url}/v1/projects/{PROJECT}/callers/{quote_phone(phone)}/memory"
    headers = {"Authorization": f"Bearer {args.token}"}
    result: dict[str, Any] = {}
    async with (
        aiohttp.ClientSession() as session,
        MemoryClient(
            args.url,
            token=args.token,
            project=PROJECT,
            session=session,
            outbox_path=args.outbox_dir / "outbox.db",
            deliver_outbox_on_start=False,
            read_budget=1.0,
        ) as client,
    ):
        # 1. Reads of conv.memory within a turn make no request; the next turn makes exactly one.
        conv = client.conversation("sdk-bench-cached", caller=phone)
        before = await read_requests(session, args.url)
        await conv.begin_turn()
        after_begin = await read_requests(session, args.url)
        reads = 0
        for _ in range(1000):
            conv.memory.get("field_0")
            _ = conv.memory["field_1"]
            _ = "field_2" in conv.memory
            _ = len(conv.memory)
            conv.memory.fields()
            reads += 5
        after_reads = await read_requests(session, args.url)
        await conv.begin_turn()
        after_second = await read_requests(session, args.url)
        result["cached"] = {
            "fields_seen": len(conv.memory),
            "requests_for_begin_turn": after_begin - before,
            "memory_accesses": reads,
            "requests_for_memory_accesses": after_reads - after_begin,
            "requests_for_second_begin_turn": after_second - after_reads,
            "second_turn_available": conv.memory.available,
        }

        # 2. begin_turn against a bare GET, in alternating pairs (after a warm-up).
        async def bare(extra: dict[str, str] | None = None) -> tuple[float, int]:
            began = time.perf_counter()
            async with session.get(endpoint, headers={**headers, **(extra or {})}) as resp:
                await resp.read()
                return time.perf_counter() - began, resp.status

        async def first_turn(n: int) -> float:
            c = client.conversation(f"sdk-bench-{n}", caller=phone)
            began = time.perf_counter()
            await c.begin_turn()
            elapsed = time.perf_counter() - began
            assert c.memory.available and len(c.memory) > 0, c.memory.reason
            return elapsed

        for n in range(100):
            await first_turn(-n - 1)
            await bare()
        sdk_first: list[float] = []
        bare_first: list[float] = []
        for n in range(args.samples):
            if n % 2:
                sdk_first.append(await first_turn(n))
                bare_first.append((await bare())[0])
            else:
                bare_first.append((await bare())[0])
                sdk_first.append(await first_turn(n))
        result["first_turn"] = _stats(sdk_first, bare_first)

        etag = conv.memory.etag or ""
        sdk_next: list[float] = []
        bare_next: list[float] = []
        statuses: set[int] = set()
        for n in range(args.samples):
            if n % 2:
                began = time.perf_counter()
                await conv.begin_turn()
                sdk_next.append(time.perf_counter() - began)
                elapsed, status = await bare({"If-None-Match": etag})
            else:
                elapsed, status = await bare({"If-None-Match": etag})
                began = time.perf_counter()
                await conv.begin_turn()
                sdk_next.append(time.perf_counter() - began)
            bare_next.append(elapsed)
            statuses.add(status)
        result["later_turn"] = _stats(sdk_next, bare_next) | {"bare_statuses": sorted(statuses)}
        result["later_turn"]["sdk_memory_available"] = conv.memory.available
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
