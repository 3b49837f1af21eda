"""Benchmark of the platform adapters' two paths (issue 32), each against the same work through the HTTP API, in
the same run, with Retell's webhooks (the adapters share the ingestion rules; Retell's signing is the simplest
to reproduce here):

- **Call starts**: 200 concurrent closed loops. One side posts Retell's inbound webhook, signed, and reads the
  answer (the caller's memory as variables, the conversation started). The other side does what a business
  would do through the API for the same result: ``POST .../conversations/{id}/start``, then ``GET
  .../callers/{caller}/memory``. Reported: the p50 and p99 of each side and their ratio. Target: the webhook's
  p99 <= 1.5x the API's.
- **Call ends**: 16 concurrent closed loops, each ending a call it started with a transcript of 20 messages, a
  summary and two extracted fields. One side posts ``call_analyzed``, signed. The other appends the 20
  messages, puts the summary and ends with the state (three requests). Reported: ends per second of each side
  and their ratio. Target: the webhook's >= 0.8x the API's.

The service runs in its own process, on a SQLite file (the default; ``--store redis``: a private redis-server).
Results in bench/results/platforms.json (or ``--output``).

    .venv/bin/python bench/platforms.py            # 3 rounds of 10 s per side and path
    .venv/bin/python bench/platforms.py --quick    # 2 rounds of 4 s
    .venv/bin/python bench/platforms.py --smoke    # seconds: checks that everything runs (figures meaningless)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import hmac
import itertools
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h

PROJECT = "bench-platforms"
SECRET = "retell-api-key-for-the-bench"
START_CONCURRENCY = 200
END_CONCURRENCY = 16
MESSAGES = 20
CALLERS = 5_000


def caller(n: int) -> str:
    return f"+1415555{n % 10_000:04d}"


def signed(document: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    body = json.dumps(document).encode()
    at = str(int(time.time() * 1000))
    digest = hmac.new(SECRET.encode(), body + at.encode(), hashlib.sha256).hexdigest()
    return body, {"Content-Type": "application/json", "x-retell-signature": f"v={at},d={digest}"}


def transcript(n: int) -> list[dict[str, Any]]:
    return [
        {"role": "user" if i % 2 == 0 else "agent", "content": f"Line {i} of call {n}: some cheese talk."}
        for i in range(MESSAGES)
    ]


class Bench:
    def __init__(self, base: str, agent: str) -> None:
        self.base = base
        self.auth = {"Authorization": f"Bearer {agent}", "Content-Type": "application/json"}
        self.numbers = itertools.count()

    async def webhook_start(self, session: aiohttp.ClientSession) -> None:
        n = next(self.numbers)
        body, headers = signed(
            {"event": "call_inbound", "call_inbound": {"from_number": caller(n), "to_number": "+14155550000"}}
        )
        async with session.post(f"{self.base}/platforms/retell/inbound", data=body, headers=headers) as r:
            found = await r.json()
            assert r.status == 200 and "dynamic_variables" in found["call_inbound"], found

    async def api_start(self, session: aiohttp.ClientSession) -> None:
        n = next(self.numbers)
        start = {"caller": caller(n), "channel": "phone"}
        async with session.post(
            f"{self.base}/conversations/api-{n}/start", json=start, headers=self.auth
        ) as r:
            assert r.status == 200, await r.text()
            await r.read()
        async with session.get(f"{self.base}/callers/{caller(n)}/memory", headers=self.auth) as r:
            assert r.status == 200, await r.text()
            await r.read()

    async def webhook_end(self, session: aiohttp.ClientSession) -> None:
        n = next(self.numbers)
        now = time.time() * 1000
        call = {
            "call_id": f"bench-{n}",
            "direction": "inbound",
            "from_number": caller(n),
            "to_number": "+14155550000",
            "start_timestamp": now - 60_000,
            "end_timestamp": now,
            "disconnection_reason": "user_hangup",
            "transcript_object": transcript(n),
            "call_analysis": {
                "call_summary": f"Call {n}: asked about cheese.",
                "custom_analysis_data": {"cheese": "Stilton", "name": "Ada"},
            },
        }
        body, headers = signed({"event": "call_analyzed", "call": call})
        async with session.post(f"{self.base}/platforms/retell/events", data=body, headers=headers) as r:
            found = await r.json()
            assert r.status == 200 and found["outcome"] in ("ended", "started_and_ended"), found

    async def api_end(self, session: aiohttp.ClientSession) -> None:
        n = next(self.numbers)
        conversation = f"{self.base}/conversations/api-end-{n}"
        messages = [
            {
                "role": "user" if m["role"] == "user" else "assistant",
                "content": m["content"],
                "turn_id": i // 2,
            }
            for i, m in enumerate(transcript(n))
        ]
        first = {"caller": caller(n), "channel": "phone", "messages": messages}
        async with session.post(f"{conversation}/messages", json=first, headers=self.auth) as r:
            assert r.status == 200, await r.text()
            await r.read()
        summary = {"text": f"Call {n}: asked about cheese.", "through_turn": MESSAGES // 2 - 1}
        async with session.put(f"{conversation}/summary", json=summary, headers=self.auth) as r:
            assert r.status == 200, await r.text()
            await r.read()
        end = {"caller": caller(n), "state": {"cheese": "Stilton", "name": "Ada"}, "end_reason": "completed"}
        async with session.post(f"{conversation}/end", json=end, headers=self.auth) as r:
            assert r.status == 200, await r.text()
            await r.read()


async def loops(
    work: Callable[[aiohttp.ClientSession], Awaitable[None]], concurrency: int, seconds: float
) -> list[float]:
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def loop() -> None:
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                await work(session)
                times.append(time.perf_counter() - started)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return times


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def setup(service: h.Server) -> str:
    base = f"{service.url}/v1/projects/{PROJECT}"
    config = {
        "memory": {
            "repeat_caller": {
                "state_keys": ["name", "cheese"],
                "retention": "P30D",
                "default_region": "US",
                "analytics_enabled": True,
            },
            "conversation": {"enabled": True},
        }
    }
    status, found = h.http("PUT", base, h.OPERATOR_TOKEN, config)
    assert status in (200, 201), found
    status, found = h.http("POST", base + "/tokens", h.OPERATOR_TOKEN, {"role": "agent"})
    agent: str = found["token"]
    connection = {"secret": SECRET, "state_map": {"cheese": "cheese", "name": "name"}}
    status, found = h.http("PUT", base + "/platforms/retell", h.OPERATOR_TOKEN, connection)
    assert status == 201, found
    for n in range(200):  # some returning callers with memory
        status, found = h.http(
            "PATCH", f"{base}/callers/{caller(n)}/memory", h.OPERATOR_TOKEN, {"name": "Ada"}
        )
        assert status == 200, found
    return agent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--store", choices=("sqlite", "redis"), default="sqlite")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "platforms.json")
    args = parser.parse_args()
    rounds, seconds = (1, 1.0) if args.smoke else (2, 4.0) if args.quick else (3, 10.0)
    load_start = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="bench-platforms-"))
    try:
        store_url = h.start_redis().url if args.store == "redis" else f"sqlite:///{workdir}/platforms.db"
        service = h.start_service(
            f"service-{args.store}",
            store_url,
            workdir,
            base64.b64encode(secrets.token_bytes(32)),
            None,
            CALLER_MEMORY_SECRET_KEY=base64.b64encode(secrets.token_bytes(32)).decode(),
            # Both sides do the whole work at 200 concurrent calls (by default one project holds at most 64
            # requests in flight: past it, the API answers 429 and a call start answers without memory).
            CALLER_MEMORY_MAX_IN_FLIGHT="512",
            CALLER_MEMORY_MAX_IN_FLIGHT_PER_PROJECT="512",
        )
        bench = Bench(f"{service.url}/v1/projects/{PROJECT}", setup(service))
        paths = {
            "start": ({"webhook": bench.webhook_start, "api": bench.api_start}, START_CONCURRENCY),
            "end": ({"webhook": bench.webhook_end, "api": bench.api_end}, END_CONCURRENCY),
        }
        result: dict[str, Any] = {"store": args.store, "rounds": rounds, "seconds_per_round": seconds}
        for path, (sides, concurrency) in paths.items():
            times: dict[str, list[float]] = {side: [] for side in sides}
            elapsed: dict[str, float] = dict.fromkeys(sides, 0.0)
            for side in sides:  # warm-up, not counted
                asyncio.run(loops(sides[side], concurrency, min(seconds, 1.0)))
            for number in range(rounds):
                for side in list(sides) if number % 2 == 0 else list(reversed(sides)):
                    started = time.perf_counter()
                    got = asyncio.run(loops(sides[side], concurrency, seconds))
                    elapsed[side] += time.perf_counter() - started
                    times[side] += got
                    print(
                        f"{path} round {number + 1} {side}: {len(got)} calls, p99 {pct(got, 0.99) * 1000:.1f} ms"
                    )
            result[path] = {
                side: {
                    "calls": len(found),
                    "per_second": len(found) / elapsed[side],
                    "p50_ms": statistics.median(found) * 1000,
                    "p99_ms": pct(found, 0.99) * 1000,
                }
                for side, found in times.items()
            }
            result[path]["concurrency"] = concurrency
        result["start_p99_ratio"] = result["start"]["webhook"]["p99_ms"] / result["start"]["api"]["p99_ms"]
        result["end_throughput_ratio"] = (
            result["end"]["webhook"]["per_second"] / result["end"]["api"]["per_second"]
        )
        result["targets"] = {
            "start_p99_ratio <= 1.5": result["start_p99_ratio"] <= 1.5,
            "end_throughput_ratio >= 0.8": result["end_throughput_ratio"] >= 0.8,
        }
        result["load_average_start"], result["load_average_end"] = load_start, os.getloadavg()
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
    finally:
        h.stop_all()


if __name__ == "__main__":
    main()
