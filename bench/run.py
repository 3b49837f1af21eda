"""Benchmarks of Caller Memory against a hand-written baseline, side by side in one run (issue 7).

    .venv/bin/python bench/run.py            # full run (about 16 minutes on a 2-core machine)
    .venv/bin/python bench/run.py --quick    # about 3 minutes: smaller store, shorter and fewer runs
    make bench                               # the full run

What runs, each server in its own OS process (bench/README.md has the details):

- ``service-redis``: ``python -m caller_memory.service serve`` with its default settings (log level INFO,
  access log off) on a private redis-server with no persistence (``--save "" --appendonly no``), holding the
  prefilled callers (1M, or 100k with --quick); ``service-redis-quiet``, the same with log level WARNING (the
  access log is off in both), and ``service-redis-noanalytics``, service-redis ending conversations in a
  project without analytics: two ablations;
- ``service-redis-aof``: the service on a second redis-server started with deploy/redis.conf as shipped
  (AOF, ``appendfsync always``), for end-of-conversation writes;
- ``service-sqlite``: the service on a SQLite file holding the same callers (WAL, synchronous=FULL);
- ``baseline``: bench/baseline_app.py, one aiohttp route doing one redis-py HGETALL, on service-redis's Redis;
- ``redis-benchmark`` HGETALL of one caller's hash on that Redis: the store's own limit;
- the load generator (bench/loadgen.py), a separate process per measurement: closed loop for peak
  throughput, open loop (fixed rate, latency from the scheduled send time) for latency.

By default (``--pin``, with 2+ CPUs) the server under test runs on CPU 0 and Redis and the load generator on
CPU 1, so a "one service process" figure means one core; ``--no-pin`` leaves placement to the scheduler.
Servers are measured in interleaved rounds (service, baseline, SQLite, service, ...), so that a change in the
machine's load hits all of them alike; the figures are medians over the rounds, and ratios are taken per
round (paired) and then the median.

Results (beside ``--output``, by default in bench/results/): perf.json (every run, machine, versions, the code
measured), profile-read.{txt,svg,collapsed.txt} (py-spy, memory reads on Redis under closed-loop load, with
the baseline's layers for comparison), profile-end.{txt,collapsed.txt} (ends of conversations), and a table
with the targets' PASS/FAIL on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import profiling
from common import PROJECT
from loadgen import ZipfCallers

RESULTS = h.BENCH / "results"
READ_CALLERS = 1000  # callers cycled through by the memory-read scenario (all have 10 fields)
#: The read cache's staleness bound of service-redis-cached (CALLER_MEMORY_READ_CACHE_SECONDS).
READ_CACHE_SECONDS = 1
END_STATE_FIELDS = 3  # state fields written by each end of conversation (32 bytes of JSON each)
ZIPF_S = 0.99  # YCSB's zipfian constant
#: A run during which the machine's other processes used less CPU than this (CPU-seconds per second) is
#: "quiet": the open-loop tails are also reported over quiet runs only (the machine is shared).
QUIET_OTHER_CPU = 0.1
#: A second project on service-redis, with analytics off (the bench project has them on).
NO_ANALYTICS = "bench-noanalytics"

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {text}", flush=True)


@dataclass
class Plan:
    """How much of everything a run does."""

    callers: int
    rounds: int  # interleaved closed-loop rounds (reads, ends)
    warmup: float
    closed_s: float
    open_runs: int
    open_s: float
    mixed_runs: int
    mixed_s: float
    connections: int = 32
    open_connections: int = 64
    extra_open_fractions: tuple[float, ...] = ()
    sdk_samples: int = 1000
    profile_s: float = 10.0
    sqlite_footprint_callers: int = 100_000
    redis_benchmark_requests: int = 200_000


FULL = Plan(
    callers=1_000_000,
    rounds=5,
    warmup=1.0,
    closed_s=5.0,
    open_runs=5,
    open_s=10.0,
    mixed_runs=3,
    mixed_s=10.0,
    extra_open_fractions=(0.75,),
)
QUICK = Plan(
    callers=100_000,
    rounds=3,
    warmup=0.5,
    closed_s=2.0,
    open_runs=3,
    open_s=3.0,
    mixed_runs=1,
    mixed_s=4.0,
    sdk_samples=300,
    profile_s=5.0,
    redis_benchmark_requests=100_000,
)


@dataclass
class Bench:
    plan: Plan
    work: Path
    key: bytes
    pin: bool
    server_cpus: set[int] | None = None
    aux_cpus: set[int] | None = None
    servers: dict[str, h.Server] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    projects: dict[str, str] = field(default_factory=dict)  # a server's project when not PROJECT
    redis: dict[str, h.RedisServer] = field(default_factory=dict)
    subjects: list[str] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    counter: int = 0

    def redis_of(self, server: str) -> h.RedisServer | None:
        """The redis-server behind ``server``, if any (its CPU is reported with each run)."""
        store = {
            "service-redis": "plain",
            "service-redis-quiet": "plain",
            "service-redis-cached": "plain",
            "service-redis-noanalytics": "plain",
            "service-redis-1-process": "plain",
            "service-redis-2-workers": "plain",
            "baseline": "plain",
            "service-redis-aof": "aof",
        }.get(server)
        return self.redis.get(store) if store else None

    def scenario(self, server: str, kind: str) -> dict[str, Any]:
        self.counter += 1
        token = self.tokens.get(server)
        project = self.projects.get(server, PROJECT)
        if kind == "read" and server == "baseline":
            return {"type": "baseline", "subjects": self.subjects[:READ_CALLERS]}
        if kind == "read":
            return {"type": "read", "callers": READ_CALLERS, "token": token, "project": PROJECT}
        if kind == "end":
            return {
                "type": "end",
                "callers": READ_CALLERS,
                "token": token,
                "project": project,
                "state_fields": END_STATE_FIELDS,
                "id_prefix": f"e{self.counter}",
            }
        if kind == "mixed":
            return {
                "type": "mixed",
                "callers": self.plan.callers,
                "zipf_s": ZIPF_S,
                "turns": [3, 6],
                "concurrent_calls": 200,
                "state_fields": END_STATE_FIELDS,
                "token": token,
                "project": PROJECT,
                "seed": self.counter,
                "id_prefix": f"m{self.counter}",
            }
        if kind == "static":
            return {"type": "static"}
        raise ValueError(kind)

    def load(
        self,
        server: str,
        kind: str,
        *,
        mode: str,
        seconds: float,
        rate: float | None = None,
        warmup: float | None = None,
        connections: int | None = None,
    ) -> dict[str, Any]:
        """One load-generator run (its own process, on the auxiliary CPU) against ``server``."""
        target = self.servers[server]
        watch = {"server": target.pid}
        store = self.redis_of(server)
        if store is not None:
            watch["redis"] = store.pid
        spec = {
            "host": "127.0.0.1",
            "port": target.port,
            "mode": mode,
            "rate": rate,
            "connections": connections
            or (self.plan.open_connections if mode == "open" else self.plan.connections),
            "warmup": self.plan.warmup if warmup is None else warmup,
            "duration": seconds,
            "scenario": self.scenario(server, kind),
            "watch": watch,
        }
        return h.run_loadgen([sys.executable, str(h.BENCH / "loadgen.py")], spec, self.aux_cpus, server, kind)


# Statistics ----------------------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    values = [v for v in values if v == v]  # drop NaN
    return statistics.median(values) if values else float("nan")


def summarise(runs: list[dict[str, Any]], kind: str | None = None) -> dict[str, Any]:
    """Medians over runs of the rate, latency percentiles (all requests, or one kind), errors and CPU."""

    def pick(run: dict[str, Any]) -> dict[str, Any]:
        return run if kind is None else run["kinds"].get(kind, {"latency_ms": {}, "service_ms": {}})

    out: dict[str, Any] = {
        "runs": len(runs),
        "rate": med([pick(r).get("achieved_rate", pick(r).get("rate", float("nan"))) for r in runs]),
        "rates": [round(pick(r).get("achieved_rate", pick(r).get("rate", 0.0)), 1) for r in runs],
        "errors": sum(int(pick(r).get("errors", 0)) for r in runs),
        "ok": sum(int(pick(r).get("ok", 0)) for r in runs),
        "latency_ms": {
            p: med([pick(r)["latency_ms"].get(p, float("nan")) for r in runs])
            for p in ("p50", "p90", "p99", "p99_9", "max")
        },
        "service_ms": {
            p: med([pick(r)["service_ms"].get(p, float("nan")) for r in runs])
            for p in ("p50", "p99", "p99_9")
        },
    }
    out["latency_ms"]["max_of_runs"] = max(
        (pick(r)["latency_ms"].get("max", 0.0) for r in runs), default=float("nan")
    )
    for name in ("server", "redis", "loadgen"):
        shares = [r.get("watched_cpu_share", {}).get(name) for r in runs]
        if any(s is not None for s in shares):
            out[f"{name}_cpu"] = med([s for s in shares if s is not None])
    others = [r["other_processes_cpu"] for r in runs if r.get("other_processes_cpu") is not None]
    if others:
        out["other_cpu"] = med(others)
        out["other_cpu_max"] = max(others)
    per_cpu = [r["requests_per_server_cpu_s"] for r in runs if "requests_per_server_cpu_s" in r]
    if per_cpu and kind is None:
        out["requests_per_server_cpu_s"] = med(per_cpu)
    if runs and runs[0].get("target_rate"):
        out["target_rate"] = runs[0]["target_rate"]
        out["unanswered"] = sum(int(r.get("unanswered", 0)) for r in runs)
        out["dispatch_lag_ms_p50"] = med([r["dispatch_lag_ms"]["p50"] for r in runs])
        out["loadgen_stall_ms_max"] = max(r.get("loadgen_stall_ms_max") or 0.0 for r in runs)
        out["loadgen_stalls_over_5ms"] = sum(r.get("loadgen_stalls_over_5ms") or 0 for r in runs)
    return out


def paired_ratio(
    a: list[dict[str, Any]], b: list[dict[str, Any]], key: str = "achieved_rate"
) -> dict[str, Any]:
    ratios = [x[key] / y[key] for x, y in zip(a, b, strict=True) if y.get(key)]
    return {
        "median_of_paired": med(ratios),
        "per_round": [round(r, 3) for r in ratios],
        "of_medians": med([x[key] for x in a]) / med([y[key] for y in b]),
    }


# Steps ---------------------------------------------------------------------------------------------------


def setup(bench: Bench) -> None:
    plan = bench.plan
    now_ms = int(time.time() * 1000)
    say(f"computing {plan.callers:,} pseudonyms")
    bench.subjects = h.subjects(bench.key, plan.callers)

    plain = bench.redis["plain"] = h.start_redis(cpus=bench.aux_cpus)
    used_delta, fill_s = fill_measured(plain, bench.subjects, now_ms)
    say(f"Redis prefilled with {plan.callers:,} callers x 10 fields in {fill_s:.1f} s")
    bench.results["footprint_redis"] = redis_footprint(bench, used_delta)
    bench.results["footprint_redis"]["fill_s"] = fill_s
    bench.results["footprint_redis_small"] = small_redis_footprint(bench, now_ms)

    svc = bench.servers["service-redis"] = h.start_service(
        "service-redis", plain.url, bench.work, bench.key, bench.server_cpus
    )
    bench.tokens["service-redis"] = h.create_project(svc)
    bench.servers["baseline"] = h.start_baseline(plain.url, bench.work, bench.server_cpus)
    # The same service with log level WARNING instead of INFO: what INFO-level logging costs. The access log
    # is off in both (the default), so this does not measure the access log.
    bench.servers["service-redis-quiet"] = h.start_service(
        "service-redis-quiet",
        plain.url,
        bench.work,
        bench.key,
        bench.server_cpus,
        CALLER_MEMORY_LOG_LEVEL="WARNING",
    )
    bench.tokens["service-redis-quiet"] = bench.tokens["service-redis"]
    # The same service with the read cache on (issue 18; docs/storage.md): its reads of the 1,000 callers are
    # hits once each was read, as no one writes them during the reads (a caller read every turn of a call).
    bench.servers["service-redis-cached"] = h.start_service(
        "service-redis-cached",
        plain.url,
        bench.work,
        bench.key,
        bench.server_cpus,
        CALLER_MEMORY_READ_CACHE_SECONDS=str(READ_CACHE_SECONDS),
    )
    bench.tokens["service-redis-cached"] = bench.tokens["service-redis"]
    # The same service process, ending conversations in a project without analytics: what analytics cost.
    bench.servers["service-redis-noanalytics"] = svc
    bench.tokens["service-redis-noanalytics"] = h.create_project(svc, analytics=False, project=NO_ANALYTICS)
    bench.projects["service-redis-noanalytics"] = NO_ANALYTICS

    aof = bench.redis["aof"] = h.start_redis(shipped_config=True, cpus=bench.aux_cpus)
    svc_aof = bench.servers["service-redis-aof"] = h.start_service(
        "service-redis-aof", aof.url, bench.work, bench.key, bench.server_cpus
    )
    bench.tokens["service-redis-aof"] = h.create_project(svc_aof)

    db = bench.work / "store.db"
    svc_sqlite = bench.servers["service-sqlite"] = h.start_service(
        "service-sqlite", f"sqlite:///{db}", bench.work, bench.key, bench.server_cpus
    )
    bench.tokens["service-sqlite"] = h.create_project(svc_sqlite)
    began = time.monotonic()
    h.fill_sqlite(db, bench.subjects, now_ms)
    sqlite_fill_s = time.monotonic() - began
    say(f"SQLite prefilled with {plan.callers:,} callers x 10 fields in {sqlite_fill_s:.1f} s")
    bench.results["footprint_sqlite"] = sqlite_footprint(bench, db, sqlite_fill_s)

    bench.servers["static"] = h.start_static(bench.work, bench.server_cpus)
    check_answers(bench)


def check_answers(bench: Bench) -> None:
    """Each server answers caller 0 with its 10 fields before anything is measured."""
    from common import caller_phone, quote_phone

    path = f"/v1/projects/{PROJECT}/callers/{quote_phone(caller_phone(0))}/memory"
    for name in ("service-redis", "service-sqlite"):
        status, body = h.http("GET", bench.servers[name].url + path, bench.tokens[name])
        if status != 200 or len(body["fields"]) != 10:
            raise RuntimeError(f"{name} does not answer caller 0's 10 fields: {status} {body}")
    status, body = h.http("GET", f"{bench.servers['baseline'].url}/callers/{bench.subjects[0]}", "-")
    if status != 200 or len(body["fields"]) != 10:
        raise RuntimeError(f"the baseline does not answer caller 0's 10 fields: {status} {body}")


def redis_footprint(bench: Bench, used_delta: int) -> dict[str, Any]:
    from caller_memory.service.storage.redis import keys

    client = bench.redis["plain"].client()
    try:
        hashes = [
            int(client.memory_usage(keys.memory_key(PROJECT, s), samples=0) or 0)
            for s in bench.subjects[:100]
        ]
        index = sum(
            int(client.memory_usage(keys.expiry_index_key(b), samples=0) or 0) for b in range(keys.N_BUCKETS)
        )
        encoding = client.object("encoding", keys.memory_key(PROJECT, bench.subjects[0]))
        index_encoding = client.object("encoding", keys.caller_index_key(bench.subjects[0]))
    finally:
        client.close()
    callers = bench.plan.callers
    hash_bytes = med([float(x) for x in hashes])
    return {
        "callers": callers,
        "hash_memory_usage_bytes": hash_bytes,
        "hash_encoding": encoding.decode() if isinstance(encoding, bytes) else encoding,
        "expiry_index_bytes_per_caller": index / callers,
        "expiry_index_encoding": index_encoding.decode()
        if isinstance(index_encoding, bytes)
        else index_encoding,
        "bytes_per_caller": hash_bytes + index / callers,
        "used_memory_delta_per_caller": used_delta / callers,
    }


#: Callers of the second, small footprint measurement (issue 18 asks for used_memory at 2,000 and at 1M).
SMALL_FOOTPRINT_CALLERS = 2_000


def fill_measured(server: h.RedisServer, subjects: list[str], now_ms: int) -> tuple[int, float]:
    """Prefill ``server`` with ``subjects``' callers (h.fill_redis): what it added to Redis's used_memory,
    and the seconds it took."""
    before = h.redis_info(server)["used_memory"]
    began = time.monotonic()
    h.fill_redis(server, subjects, now_ms)
    seconds = time.monotonic() - began
    return h.redis_info(server)["used_memory"] - before, seconds


def small_redis_footprint(bench: Bench, now_ms: int) -> dict[str, Any]:
    """used_memory per caller of SMALL_FOOTPRINT_CALLERS callers written the same way into a redis-server of
    their own (started and stopped here)."""
    server = h.start_redis(cpus=bench.aux_cpus)
    try:
        used_delta, _ = fill_measured(server, bench.subjects[:SMALL_FOOTPRINT_CALLERS], now_ms)
    finally:
        h.stop_redis(server)
    return {
        "callers": SMALL_FOOTPRINT_CALLERS,
        "used_memory_delta_per_caller": used_delta / SMALL_FOOTPRINT_CALLERS,
    }


def sqlite_footprint(bench: Bench, db: Path, fill_s: float) -> dict[str, Any]:
    """Bytes on disk per caller: the service's store at full size, and a fresh file of 100k callers."""
    from caller_memory.service.storage import open_store

    n = bench.plan.sqlite_footprint_callers
    small = bench.work / "footprint.db"

    async def create() -> None:
        store = open_store(f"sqlite:///{small}")
        await store.open()
        await store.close()

    asyncio.run(create())
    empty = _db_bytes(small)
    h.fill_sqlite(
        small,
        bench.subjects[:n] if n <= len(bench.subjects) else h.subjects(bench.key, n),
        int(time.time() * 1000),
    )
    size = _db_bytes(small)
    small.unlink()
    return {
        "callers": n,
        "file_bytes": size,
        "bytes_per_caller": (size - empty) / n,
        "store_callers": bench.plan.callers,
        "store_file_bytes": _db_bytes(db),
        "store_bytes_per_caller": _db_bytes(db) / bench.plan.callers,
        "store_fill_s": fill_s,
    }


def _db_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, Path(f"{path}-wal")) if p.exists())


def calibrate(bench: Bench) -> None:
    """How much one load-generator process can push (closed loop against the static server)."""
    say("load generator calibration against bench/static_server.py")
    runs = [bench.load("static", "static", mode="closed", seconds=bench.plan.closed_s) for _ in range(2)]
    bench.results["loadgen_capacity"] = summarise(runs) | {"all": runs}


def warm(bench: Bench) -> None:
    say("warm-up: every server, reads and ends (not recorded)")
    for server in ("service-redis", "baseline", "service-sqlite", "service-redis-quiet"):
        bench.load(server, "read", mode="closed", seconds=bench.plan.closed_s, warmup=0.5)
    for server in ("service-redis", "service-redis-aof", "service-sqlite"):
        bench.load(server, "end", mode="closed", seconds=bench.plan.closed_s / 2, warmup=0.5)


def interleaved(bench: Bench, kind: str, servers: list[str]) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in servers}
    for round_ in range(bench.plan.rounds):
        for server in servers:
            result = bench.load(server, kind, mode="closed", seconds=bench.plan.closed_s)
            runs[server].append(result)
            say(
                f"  {kind:5} round {round_ + 1}/{bench.plan.rounds} {server:18} {result['achieved_rate']:8.0f} req/s"
                f"  p50 {result['latency_ms']['p50']:6.2f} ms  server CPU {result['watched_cpu_share'].get('server', 0):.2f}"
                f"  errors {result['errors']}"
            )
    return runs


def peak_reads(bench: Bench) -> None:
    say("peak memory-read throughput, closed loop, interleaved rounds")
    runs = interleaved(
        bench,
        "read",
        ["service-redis", "baseline", "service-sqlite", "service-redis-quiet", "service-redis-cached"],
    )
    bench.results["read_peak"] = {s: summarise(r) | {"all": r} for s, r in runs.items()}
    bench.results["read_peak_ratios"] = {
        "service_redis_over_baseline": paired_ratio(runs["service-redis"], runs["baseline"]),
        "service_sqlite_over_service_redis": paired_ratio(runs["service-sqlite"], runs["service-redis"]),
        "service_redis_log_warning_over_info": paired_ratio(
            runs["service-redis-quiet"], runs["service-redis"]
        ),
        "service_redis_over_baseline_per_cpu": paired_ratio(
            runs["service-redis"], runs["baseline"], key="requests_per_server_cpu_s"
        ),
        "service_redis_cached_over_baseline": paired_ratio(runs["service-redis-cached"], runs["baseline"]),
    }


#: ``serve --workers 2`` against the one process that ``serve`` runs by default (issue 18), on service-redis's
#: Redis: both unpinned (the scheduler places the workers and the single process alike; the load generator
#: keeps its CPU, so it shares a core with a worker), with more connections than the other peaks so that the
#: kernel's SO_REUSEPORT hash has connections to spread over the workers' listening sockets.
WORKER_SERVERS = {"service-redis-1-process": 1, "service-redis-2-workers": 2}
WORKERS_CONNECTIONS = 64
#: Targets: the median of the paired ratios, the lowest round, each worker's share of every round's requests.
WORKERS_MEDIAN, WORKERS_LOWEST, WORKER_SHARE = 1.3, 1.15, (0.35, 0.65)


def worker_requests(server: h.Server) -> dict[str, float]:
    """``caller_memory_worker_requests`` by worker pid, from the server's ``/metrics`` (any worker answers it
    with the values of all of them)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        sample.labels["pid"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "caller_memory_worker_requests"
        for sample in family.samples
    }


def workers(bench: Bench) -> None:
    """Closed-loop reads of ``serve --workers 2`` and of one process, interleaved rounds in alternating
    order; each round's share of every worker from the workers' request counters (read before and after the
    run: the load generator's warm-up is in them, on the same connections)."""
    for name, count in WORKER_SERVERS.items():
        bench.servers[name] = h.start_service(
            name, bench.redis["plain"].url, bench.work, bench.key, None, CALLER_MEMORY_WORKERS=str(count)
        )
        bench.tokens[name] = bench.tokens["service-redis"]
    say(f"serve --workers 2 vs one process: closed-loop reads, {WORKERS_CONNECTIONS} connections, unpinned")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in WORKER_SERVERS}
    names = list(WORKER_SERVERS)
    try:
        for round_ in range(bench.plan.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                server = bench.servers[name]
                before = worker_requests(server) if WORKER_SERVERS[name] > 1 else {}
                result = bench.load(
                    name, "read", mode="closed", seconds=bench.plan.closed_s, connections=WORKERS_CONNECTIONS
                )
                if WORKER_SERVERS[name] > 1:
                    after = worker_requests(server)
                    served = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
                    total = sum(served.values()) or 1.0
                    result["worker_shares"] = sorted(round(n / total, 3) for n in served.values())
                runs[name].append(result)
                say(
                    f"  round {round_ + 1}/{bench.plan.rounds} {name:24} {result['achieved_rate']:8.0f} req/s"
                    f"  p50 {result['latency_ms']['p50']:6.2f} ms  errors {result['errors']}"
                    + (f"  worker shares {result['worker_shares']}" if "worker_shares" in result else "")
                )
    finally:
        for name in WORKER_SERVERS:
            h.stop(bench.servers.pop(name).proc)
    two, one = runs["service-redis-2-workers"], runs["service-redis-1-process"]
    bench.results["workers"] = {
        "connections": WORKERS_CONNECTIONS,
        "pinning": "none for both servers; the load generator on its usual CPU",
        **{name: summarise(r) | {"all": r} for name, r in runs.items()},
        "ratio": paired_ratio(two, one),
        "worker_shares_per_round": [r["worker_shares"] for r in two],
    }


#: wrk (an HTTP load generator in C, not the project's): threads and connections of each run, like the peaks'.
WRK_THREADS = 1
WRK_SERVERS = ("service-redis", "service-redis-cached", "baseline")
WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk_script(paths: list[str], token: str | None) -> str:
    """A wrk Lua script that cycles through ``paths`` (the callers the project's generator reads), with the
    bearer token when the server wants one."""
    listed = ",\n".join(f'  "{p}"' for p in paths)
    auth = f'wrk.headers["Authorization"] = "Bearer {token}"\n' if token else ""
    return (
        f"local paths = {{\n{listed}\n}}\nlocal i = 0\n{auth}"
        'request = function()\n  i = i % #paths + 1\n  return wrk.format("GET", paths[i])\nend\n'
    )


def parse_wrk(output: str) -> dict[str, Any]:
    """Requests/sec, errors and the latency percentiles of ``wrk --latency``'s report."""
    rate = float(re.search(r"^Requests/sec:\s+([\d.]+)", output, re.M).group(1))  # type: ignore[union-attr]
    latency = {
        f"p{m.group(1)}": float(m.group(2)) * WRK_UNITS[m.group(3)]
        for m in re.finditer(r"^\s+(50|90|99)(?:\.000)?%\s+([\d.]+)(us|ms|s)\s*$", output, re.M)
    }
    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
    socket_errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
    return {
        "achieved_rate": rate,
        "latency_ms": latency,
        "errors": (int(errors.group(1)) if errors else 0)
        + (sum(int(n) for n in socket_errors.groups()) if socket_errors else 0),
    }


def wrk_reads(bench: Bench) -> None:
    """The same closed-loop reads as the peaks (same callers, same connections, the same CPU as the project's
    generator), driven by wrk instead: an independent client beside the project's own."""
    exe = shutil.which("wrk")
    if exe is None:
        bench.results["wrk"] = {
            "skipped": "wrk is not installed (make bench installs it: scripts/install-wrk)"
        }
        say("wrk not found: its runs skipped")
        return
    from loadgen import _read_path

    scripts: dict[str, Path] = {}
    for server in WRK_SERVERS:
        if server == "baseline":
            paths = [f"/callers/{subject}" for subject in bench.subjects[:READ_CALLERS]]
        else:
            paths = [_read_path(PROJECT, i) for i in range(READ_CALLERS)]
        scripts[server] = bench.work / f"wrk-{server}.lua"
        scripts[server].write_text(wrk_script(paths, bench.tokens.get(server)))
    say(
        f"wrk: closed-loop reads, {bench.plan.connections} connections, {WRK_THREADS} thread, interleaved rounds"
    )
    cpus = bench.aux_cpus
    runs: dict[str, list[dict[str, Any]]] = {server: [] for server in scripts}
    version = subprocess.run([exe, "-v"], capture_output=True, text=True, check=False).stdout.splitlines()[:1]
    for round_ in range(bench.plan.rounds):
        for server in scripts if round_ % 2 == 0 else list(scripts)[::-1]:
            cmd = [exe, f"-t{WRK_THREADS}", f"-c{bench.plan.connections}", f"-d{bench.plan.closed_s:g}s"]
            cmd += ["--latency", "-s", str(scripts[server]), bench.servers[server].url]
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=bench.plan.closed_s + 60,
                check=True,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None,
            )
            result = parse_wrk(done.stdout)
            runs[server].append(result)
            say(
                f"  wrk round {round_ + 1}/{bench.plan.rounds} {server:14} {result['achieved_rate']:8.0f} req/s"
                f"  p50 {result['latency_ms'].get('p50', float('nan')):.2f} ms  errors {result['errors']}"
            )
    bench.results["wrk"] = {
        "version": version[0].split(" Copyright")[0] if version else "",
        "threads": WRK_THREADS,
        "connections": bench.plan.connections,
        **{
            server: {
                "rate": med([r["achieved_rate"] for r in rs]),
                "rates": [r["achieved_rate"] for r in rs],
                "p50_ms": med([r["latency_ms"].get("p50", float("nan")) for r in rs]),
                "p99_ms": med([r["latency_ms"].get("p99", float("nan")) for r in rs]),
                "errors": sum(r["errors"] for r in rs),
            }
            for server, rs in runs.items()
        },
        "ratio": paired_ratio(runs["service-redis"], runs["baseline"]),
        "cached_ratio": paired_ratio(runs["service-redis-cached"], runs["baseline"]),
    }


def redis_benchmark(bench: Bench) -> None:
    from caller_memory.service.storage.redis import keys

    exe = shutil.which("redis-benchmark")
    if exe is None:
        bench.results["redis_benchmark"] = {
            "skipped": "redis-benchmark is not installed (apt-get install redis-tools)"
        }
        return
    server = bench.redis["plain"]
    key = keys.memory_key(PROJECT, bench.subjects[0])
    say("redis-benchmark HGETALL (50 connections, no pipelining)")
    cmd = [exe, "-h", "127.0.0.1", "-p", str(server.port), "-n", str(bench.plan.redis_benchmark_requests)]
    cmd += ["-c", "50", "--csv", "HGETALL", key]
    cpus = bench.server_cpus
    rates, lines = [], []
    for _ in range(3):
        proc = subprocess.run(
            cmd,
            capture_output=True,
            timeout=120,
            check=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None,
        )
        rows = [line for line in proc.stdout.decode().splitlines() if line.startswith('"HGETALL')]
        values = rows[-1].replace('"', "").split(",")
        rates.append(float(values[1]))
        lines.append(rows[-1])
    bench.results["redis_benchmark"] = {
        "rate": med(rates),
        "rates": rates,
        "csv": lines,
        "columns": "test,rps,avg_latency_ms,min_latency_ms,p50_latency_ms,p95_latency_ms,p99_latency_ms,max_latency_ms",
        "command": " ".join([*cmd[:-1], "<caller 0's memory key>"]),
    }


def open_runs(bench: Any, servers: list[str], kind: str, rate: int) -> dict[str, list[dict[str, Any]]]:
    """``bench.plan.open_runs`` open-loop runs of ``kind`` at ``rate`` per server, alternating between the
    servers (so that a change in the machine's load hits them alike), each reported as it ends."""
    runs: dict[str, list[dict[str, Any]]] = {server: [] for server in servers}
    width = max(len(server) for server in servers)
    for i in range(bench.plan.open_runs):
        for server in servers:
            result = bench.load(server, kind, mode="open", rate=rate, seconds=bench.plan.open_s)
            runs[server].append(result)
            lat = result["latency_ms"]
            say(
                f"  run {i + 1}/{bench.plan.open_runs} {server:{width}} achieved {result['achieved_rate']:7.0f}/{rate}"
                f"  p50 {lat['p50']:.2f}  p99 {lat['p99']:.2f}  p99.9 {lat['p99_9']:.2f}  max {lat['max']:.2f} ms"
                f"  errors {result['errors']}  load-generator stall {result['loadgen_stall_ms_max']:.1f} ms"
            )
    return runs


def open_reads(bench: Bench) -> None:
    peak = bench.results["read_peak"]["service-redis"]["rate"]
    rate = round(peak * 0.5)
    say(f"open-loop memory reads at 50% of service-redis peak: {rate} req/s (service-redis and baseline)")
    runs = open_runs(bench, ["service-redis", "baseline"], "read", rate)
    bench.results["read_open_50"] = {s: summarise(r) | {"all": r} for s, r in runs.items()}
    for server, server_runs in runs.items():
        quiet = [r for r in server_runs if (r.get("other_processes_cpu") or 0.0) < QUIET_OTHER_CPU]
        bench.results["read_open_50"][server]["quiet_runs"] = summarise(quiet) if quiet else None
    sqlite_rate = round(bench.results["read_peak"]["service-sqlite"]["rate"] * 0.5)
    say(f"open-loop memory reads on SQLite at 50% of its own peak: {sqlite_rate} req/s")
    sqlite_runs = [
        bench.load("service-sqlite", "read", mode="open", rate=sqlite_rate, seconds=bench.plan.open_s)
        for _ in range(max(1, bench.plan.open_runs // 2))
    ]
    bench.results["read_open_50"]["service-sqlite"] = summarise(sqlite_runs) | {"all": sqlite_runs}
    for fraction in bench.plan.extra_open_fractions:
        extra_rate = round(peak * fraction)
        say(f"open-loop memory reads at {fraction:.0%} of service-redis peak: {extra_rate} req/s")
        extra = [
            bench.load("service-redis", "read", mode="open", rate=extra_rate, seconds=bench.plan.open_s)
            for _ in range(3)
        ]
        bench.results[f"read_open_{round(fraction * 100)}"] = {
            "service-redis": summarise(extra) | {"all": extra}
        }


def peak_ends(bench: Bench) -> None:
    say("peak end-of-conversation throughput, closed loop, interleaved rounds")
    runs = interleaved(
        bench, "end", ["service-redis", "service-redis-aof", "service-sqlite", "service-redis-noanalytics"]
    )
    bench.results["end_peak"] = {s: summarise(r) | {"all": r} for s, r in runs.items()}


def mixed(bench: Bench) -> None:
    plan = bench.plan
    bench.results["mixed"] = {}
    for server in ("service-redis", "service-sqlite"):
        say(f"mixed traffic on {server}: closed-loop peak")
        closed = [
            bench.load(server, "mixed", mode="closed", seconds=plan.mixed_s) for _ in range(plan.mixed_runs)
        ]
        peak = med([r["achieved_rate"] for r in closed])
        rate = round(peak * 0.5)
        say(f"  peak {peak:.0f} req/s; open loop at 50%: {rate} req/s")
        opened = [
            bench.load(server, "mixed", mode="open", rate=rate, seconds=plan.mixed_s)
            for _ in range(plan.mixed_runs)
        ]
        for r in opened:
            lat = r["latency_ms"]
            say(
                f"  achieved {r['achieved_rate']:.0f}/{rate}  p50 {lat['p50']:.2f}  p99 {lat['p99']:.2f}  p99.9 {lat['p99_9']:.2f} ms  errors {r['errors']}  load-generator stall {r['loadgen_stall_ms_max']:.1f} ms"
            )
        bench.results["mixed"][server] = {
            "peak": summarise(closed)
            | {"read": summarise(closed, "read"), "end": summarise(closed, "end"), "all": closed},
            "open_50": summarise(opened)
            | {"read": summarise(opened, "read"), "end": summarise(opened, "end"), "all": opened},
        }
    law = ZipfCallers(plan.callers, ZIPF_S, random.Random(1))
    bench.results["mixed_traffic"] = {
        "callers": plan.callers,
        "zipf_s": ZIPF_S,
        "turns_per_call": [3, 6],
        "reads_per_end": 4.5,
        "concurrent_calls": 200,
        "share_of_calls_to_top_65536_callers": law.share_of_top(65536),
        "share_of_calls_to_top_1000_callers": law.share_of_top(1000),
    }


def sdk(bench: Bench) -> None:
    say("SDK: cached reads and begin_turn vs a bare GET")
    server = bench.servers["service-redis"]
    outbox = bench.work / "sdk"
    outbox.mkdir(exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            str(h.BENCH / "sdk_bench.py"),
            server.url,
            bench.tokens["service-redis"],
            str(outbox),
            "--samples",
            str(bench.plan.sdk_samples),
        ],
        capture_output=True,
        timeout=600,
        check=False,
        preexec_fn=(lambda: os.sched_setaffinity(0, bench.aux_cpus)) if bench.aux_cpus is not None else None,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"sdk_bench failed: {proc.stderr.decode()[-3000:]}")
    bench.results["sdk"] = json.loads(proc.stdout)


def _spy(bench: Bench, server: str, fmt: str, output: Path, seconds: float, kind: str = "read") -> float:
    """py-spy record of ``server`` while the load generator drives closed-loop ``kind`` requests at it."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    say(f"py-spy record ({fmt}) of {server} under closed-loop {kind} requests, {seconds:.0f} s")
    cmd = [spy, "record", "--pid", str(bench.servers[server].pid), "--duration", str(int(seconds))]
    cmd += ["--rate", "200", "--format", fmt, "--output", str(output)]
    spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        result = bench.load(server, kind, mode="closed", seconds=seconds + 1, warmup=0.5)
        _, err = spy_proc.communicate(timeout=60)
    finally:
        if spy_proc.poll() is None:
            spy_proc.send_signal(signal.SIGINT)
            spy_proc.wait(10)
    if spy_proc.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
    rate: float = result["achieved_rate"]
    return rate


def profile(bench: Bench) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        bench.results["profile"] = {"skipped": "py-spy is not installed (pip install py-spy)"}
        say("py-spy not found: profile skipped")
        return
    seconds = bench.plan.profile_s
    collapsed = RESULTS / "profile-read.collapsed.txt"
    rates = [
        _spy(bench, "service-redis", "flamegraph", RESULTS / "profile-read.svg", seconds),
        _spy(bench, "service-redis", "raw", collapsed, seconds),
    ]
    baseline_raw = bench.work / "profile-baseline.raw"
    baseline_rate = _spy(bench, "baseline", "raw", baseline_raw, seconds)
    analysis = profiling.analyse_file(collapsed)
    baseline = profiling.analyse_file(baseline_raw)
    header = (
        "Profile of the memory read on Redis (GET /v1/projects/{project}/callers/{identifier}/memory)\n"
        f"service-redis under closed-loop load ({bench.plan.connections} connections, {READ_CALLERS} callers "
        f"of 10 fields), py-spy record --rate 200 (it pauses the process for each sample: whole, exact "
        f"stacks), {seconds:.0f} s; throughput while profiled: "
        f"{med(rates):.0f} req/s (baseline while profiled: {baseline_rate:.0f} req/s).\n"
        f"Produced by bench/run.py{' --quick' if bench.plan is QUICK else ''}; flame graph: "
        "bench/results/profile-read.svg; collapsed stacks: bench/results/profile-read.collapsed.txt."
    )
    text = profiling.render(analysis, header)
    text += "\n\nFor comparison, the baseline (bench/baseline_app.py) under the same load, by layer\n"
    text += "-" * 78 + "\n"
    text += "\n".join(f"{row['percent']:6.1f}%  {row['frame']}" for row in baseline["layers"]) + "\n"
    (RESULTS / "profile-read.txt").write_text(text + "\n")
    end_collapsed = RESULTS / "profile-end.collapsed.txt"
    end_rate = _spy(bench, "service-redis", "raw", end_collapsed, seconds, kind="end")
    end_analysis = profiling.analyse_file(end_collapsed)
    end_header = (
        "Profile of the end of a conversation on Redis (POST /v1/projects/{project}/conversations/{id}/end, "
        "analytics on, 3 state fields)\n"
        f"service-redis under closed-loop load ({bench.plan.connections} connections), py-spy record --rate 200, "
        f"{seconds:.0f} s; throughput while profiled: {end_rate:.0f} req/s.\n"
        f"Produced by bench/run.py{' --quick' if bench.plan is QUICK else ''}; collapsed stacks: "
        "bench/results/profile-end.collapsed.txt."
    )
    (RESULTS / "profile-end.txt").write_text(profiling.render(end_analysis, end_header) + "\n")
    bench.results["profile"] = {
        "rate_while_profiled": med(rates),
        "baseline_rate_while_profiled": baseline_rate,
        "summary": analysis,
        "baseline_layers": baseline["layers"],
        "end_rate_while_profiled": end_rate,
        "end_summary": end_analysis,
    }


# Targets -------------------------------------------------------------------------------------------------


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append({"target": name, "pass": bool(ok), "detail": detail})

    def note(name: str, detail: str) -> None:
        """A figure reported beside the targets, not one of them."""
        out.append({"target": name, "pass": None, "detail": detail})

    ratio = r["read_peak_ratios"]["service_redis_over_baseline"]["median_of_paired"]
    svc, base = r["read_peak"]["service-redis"]["rate"], r["read_peak"]["baseline"]["rate"]
    check(
        "peak memory reads, service on Redis >= 0.8x baseline",
        ratio >= 0.8,
        f"{svc:.0f} vs {base:.0f} req/s: {ratio:.2f}x (median of paired rounds)",
    )
    check(
        "peak memory reads, service on Redis >= 0.9x baseline (issue 18, read cache off)",
        ratio >= 0.9,
        f"{svc:.0f} vs {base:.0f} req/s: {ratio:.2f}x (median of paired rounds "
        f"{r['read_peak_ratios']['service_redis_over_baseline']['per_round']})",
    )
    cached = r["read_peak_ratios"]["service_redis_cached_over_baseline"]
    check(
        f"peak memory reads, service on Redis with the read cache on ({READ_CACHE_SECONDS} s) >= 1.0x baseline",
        cached["median_of_paired"] >= 1.0,
        f"{r['read_peak']['service-redis-cached']['rate']:.0f} vs {base:.0f} req/s: "
        f"{cached['median_of_paired']:.2f}x (median of paired rounds {cached['per_round']})",
    )
    wrk = r["wrk"]
    if "skipped" in wrk:
        check("peak memory reads measured with wrk (issue 18)", False, wrk["skipped"])
    else:
        for name, key, target in (
            ("service-redis", "ratio", 0.9),
            ("service-redis-cached", "cached_ratio", 1.0),
        ):
            check(
                f"peak memory reads measured with wrk (an independent client): {name} >= {target}x baseline",
                wrk[key]["median_of_paired"] >= target,
                f"{wrk[name]['rate']:.0f} vs {wrk['baseline']['rate']:.0f} req/s: "
                f"{wrk[key]['median_of_paired']:.2f}x (median of paired rounds {wrk[key]['per_round']})",
            )
    w = r["workers"]
    per_round = w["ratio"]["per_round"]
    check(
        f"serve --workers 2 vs one process: reads >= {WORKERS_MEDIAN}x median, no round below {WORKERS_LOWEST}x",
        w["ratio"]["median_of_paired"] >= WORKERS_MEDIAN and min(per_round) >= WORKERS_LOWEST,
        f"{w['service-redis-2-workers']['rate']:.0f} vs {w['service-redis-1-process']['rate']:.0f} req/s: "
        f"{w['ratio']['median_of_paired']:.2f}x (median of paired rounds {per_round}), {w['connections']} connections",
    )
    low, high = WORKER_SHARE
    shares = w["worker_shares_per_round"]
    check(
        f"serve --workers 2: each worker serves {low:.0%}-{high:.0%} of the requests in every round",
        all(len(s) == 2 and low <= min(s) and max(s) <= high for s in shares),
        f"shares per round (from caller_memory_worker_requests): {shares}",
    )
    lat = r["read_open_50"]["service-redis"]["latency_ms"]
    rate = r["read_open_50"]["service-redis"]
    quiet = rate.get("quiet_runs")
    quiet_note = (
        f"; over the {quiet['runs']} of {rate['runs']} runs with other processes under "
        f"{QUIET_OTHER_CPU:.0%} CPU: p99 {quiet['latency_ms']['p99']:.2f}, p99.9 {quiet['latency_ms']['p99_9']:.2f} ms"
        if quiet
        else f"; no run had other processes under {QUIET_OTHER_CPU:.0%} CPU"
    )
    check(
        "open loop at 50% of peak: memory-read p99 <= 5 ms",
        lat["p99"] <= 5.0 and rate["errors"] == 0,
        f"p99 {lat['p99']:.2f} ms at {rate['rate']:.0f}/{rate['target_rate']:.0f} req/s, {rate['errors']} errors, "
        f"median of {rate['runs']} runs{quiet_note}",
    )
    base_p99 = r["read_open_50"]["baseline"]["latency_ms"]["p99"]
    check(
        "open loop at 50% of peak: memory-read p99 <= 2x the baseline's p99 at the same rate (issue 18)",
        lat["p99"] <= 2 * base_p99 and rate["errors"] == 0,
        f"p99 {lat['p99']:.2f} vs {base_p99:.2f} ms: {lat['p99'] / base_p99:.2f}x",
    )
    check(
        "open loop at 50% of peak: memory-read p99.9 <= 20 ms",
        lat["p99_9"] <= 20.0 and rate["errors"] == 0,
        f"p99.9 {lat['p99_9']:.2f} ms (max {lat['max_of_runs']:.1f} ms), median of {rate['runs']} runs",
    )
    # Reads are measured on Redis without persistence; the end of a conversation is compared on the same.
    end = r["end_peak"]["service-redis"]["rate"]
    check(
        "end-of-conversation >= 0.5x memory-read throughput (same Redis, no persistence)",
        end >= 0.5 * svc,
        f"{end:.0f} vs {svc:.0f} req/s: {end / svc:.2f}x",
    )
    aof = r["end_peak"]["service-redis-aof"]
    note(
        "end-of-conversation on Redis with the shipped redis.conf (appendfsync always: each write waits for "
        "an fsync of this machine's disk)",
        f"{aof['rate']:.0f} req/s: {aof['rate'] / svc:.2f}x the reads, service CPU "
        f"{aof.get('server_cpu', float('nan')):.2f}",
    )
    sq = r["read_peak_ratios"]["service_sqlite_over_service_redis"]["median_of_paired"]
    check(
        "SQLite memory reads >= 0.5x Redis'",
        sq >= 0.5,
        f"{r['read_peak']['service-sqlite']['rate']:.0f} vs {svc:.0f} req/s: {sq:.2f}x",
    )
    fp = r["footprint_redis"]
    check(
        "Redis footprint <= 1 KiB per caller (10 fields of 32 bytes)",
        fp["bytes_per_caller"] <= 1024,
        f"{fp['bytes_per_caller']:.0f} B = hash {fp['hash_memory_usage_bytes']:.0f} + expiry index "
        f"{fp['expiry_index_bytes_per_caller']:.0f} ({fp['callers']:,} callers; used_memory delta "
        f"{fp['used_memory_delta_per_caller']:.0f} B/caller)",
    )
    small = r["footprint_redis_small"]
    check(
        "Redis used_memory <= 1 KiB per caller (issue 18), at "
        f"{small['callers']:,} and at {fp['callers']:,} callers",
        max(small["used_memory_delta_per_caller"], fp["used_memory_delta_per_caller"]) <= 1024,
        f"{small['used_memory_delta_per_caller']:.0f} B and {fp['used_memory_delta_per_caller']:.0f} B per caller "
        "(used_memory delta over the prefill)",
    )
    cached = r["sdk"]["cached"]
    check(
        "SDK: reads of conv.memory within a turn cost no request",
        cached["requests_for_memory_accesses"] == 0 and cached["requests_for_begin_turn"] == 1,
        f"{cached['memory_accesses']} accesses: {cached['requests_for_memory_accesses']:.0f} requests; "
        f"begin_turn: {cached['requests_for_begin_turn']:.0f}; next turn: {cached['requests_for_second_begin_turn']:.0f}",
    )
    for key, label in (("first_turn", "first turn, 200"), ("later_turn", "later turn, 304")):
        s = r["sdk"][key]
        check(
            f"SDK: begin_turn adds <= 1 ms over a bare GET ({label}, median)",
            s["difference_of_medians_ms"] <= 1.0,
            f"{s['sdk_median_ms']:.3f} vs {s['bare_median_ms']:.3f} ms: +{s['difference_of_medians_ms']:.3f} ms "
            f"(median paired difference {s['median_paired_difference_ms']:.3f} ms)",
        )
    return out


# Report --------------------------------------------------------------------------------------------------


def _lat(s: dict[str, Any]) -> str:
    lat = s["latency_ms"]
    return f"{lat['p50']:7.2f} {lat['p99']:7.2f} {lat['p99_9']:7.2f} {lat['max_of_runs']:7.1f}"


def report_wrk_and_workers(r: dict[str, Any]) -> list[str]:
    """The report's lines for the reads measured with wrk and for ``--workers 2`` against one process."""
    lines: list[str] = []
    add = lines.append
    wrk = r["wrk"]
    add("")
    if "skipped" in wrk:
        add(f"wrk: {wrk['skipped']}")
    else:
        add(
            f"Memory reads, peak, measured with wrk ({wrk['version']}; {wrk['threads']} thread, "
            f"{wrk['connections']} connections, on the load generator's CPU; medians of {r['plan']['rounds']} rounds)"
        )
        for name in WRK_SERVERS:
            x = wrk[name]
            add(
                f"  {name:26} {x['rate']:8.0f} {min(x['rates']):7.0f}-{max(x['rates']):<7.0f} p50 {x['p50_ms']:.2f} ms"
                f"  p99 {x['p99_ms']:.2f} ms  errors {x['errors']}"
            )
        add(
            f"  service-redis / baseline: {wrk['ratio']['median_of_paired']:.2f}x (rounds {wrk['ratio']['per_round']});"
            f" service-redis-cached / baseline: {wrk['cached_ratio']['median_of_paired']:.2f}x "
            f"(rounds {wrk['cached_ratio']['per_round']})"
        )
    w = r["workers"]
    add("")
    add(
        f"serve --workers 2 vs one process (closed-loop reads, {w['connections']} connections, unpinned; medians "
        f"of {r['plan']['rounds']} interleaved rounds)"
    )
    for name in WORKER_SERVERS:
        s = w[name]
        add(
            f"  {name:26} {s['rate']:8.0f} {min(s['rates']):7.0f}-{max(s['rates']):<7.0f} p50 "
            f"{s['latency_ms']['p50']:.2f} ms  p99 {s['latency_ms']['p99']:.2f} ms  errors {s['errors']}"
        )
    add(
        f"  2 workers / 1 process: {w['ratio']['median_of_paired']:.2f}x (rounds {w['ratio']['per_round']}); "
        f"each round's worker shares {w['worker_shares_per_round']}"
    )
    return lines


def report(r: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    m = r["machine"]
    add("")
    add(
        f"Caller Memory benchmarks ({'quick' if r['quick'] else 'full'} run), {m['cpus']} CPUs ({m['cpu']}), "
        f"pinning: {r['pinning']}, load average at start {m['loadavg_start']}"
    )
    src = r["source"]
    add(code_measured(src, " (changed during the run: see perf.json)"))
    cap = r["loadgen_capacity"]
    add("")
    add(
        f"Load generator: {cap['rate']:.0f} req/s against a static server (one process, CPU {cap.get('loadgen_cpu', 0):.2f}); "
        f"{cap['rate'] / r['read_peak']['baseline']['rate']:.1f}x the fastest server under test (baseline)."
    )
    add("")
    add(
        f"Memory reads, peak (closed loop, {r['plan']['connections']} connections; medians of "
        f"{r['plan']['rounds']} interleaved rounds)"
    )
    add(
        f"  {'server':26} {'req/s':>8} {'min-max':>15} {'srv CPU':>7} {'req/CPU-s':>9} {'redis CPU':>9} {'LG CPU':>6} {'others':>6} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}"
    )
    for name, s in r["read_peak"].items():
        add(
            f"  {name:26} {s['rate']:8.0f} {min(s['rates']):7.0f}-{max(s['rates']):<7.0f} {s.get('server_cpu', 0):7.2f} "
            f"{s.get('requests_per_server_cpu_s', 0):9.0f} {s.get('redis_cpu', 0):9.2f} {s.get('loadgen_cpu', 0):6.2f} {s.get('other_cpu', 0):6.2f} {s['latency_ms']['p50']:7.2f} "
            f"{s['latency_ms']['p99']:7.2f} {s['errors']:6d}"
        )
    rb = r.get("redis_benchmark", {})
    if "rate" in rb:
        add(
            f"  {'redis-benchmark':26} {rb['rate']:8.0f} {min(rb['rates']):7.0f}-{max(rb['rates']):<7.0f}  (HGETALL, 50 connections: the store's floor)"
        )
    ratios = r["read_peak_ratios"]
    add(
        f"  service-redis / baseline: {ratios['service_redis_over_baseline']['median_of_paired']:.2f}x "
        f"(rounds {ratios['service_redis_over_baseline']['per_round']}); per server CPU-second: "
        f"{ratios['service_redis_over_baseline_per_cpu']['median_of_paired']:.2f}x"
    )
    add(
        f"  service-redis-cached (read cache on, {READ_CACHE_SECONDS} s) / baseline: "
        f"{ratios['service_redis_cached_over_baseline']['median_of_paired']:.2f}x "
        f"(rounds {ratios['service_redis_cached_over_baseline']['per_round']})"
    )
    add(
        f"  service-sqlite / service-redis: {ratios['service_sqlite_over_service_redis']['median_of_paired']:.2f}x;"
        f" service-redis-quiet (log level WARNING; access log off in both) / service-redis: "
        f"{ratios['service_redis_log_warning_over_info']['median_of_paired']:.2f}x"
    )
    add(
        "  (srv/redis/LG CPU: CPU-seconds per second of the server, its Redis and the load generator during the"
        " measured window; others: every other process on the machine, this one being shared)"
    )
    lines.extend(report_wrk_and_workers(r))
    add("")
    add(
        "Memory reads, open loop (fixed rate; latency from the scheduled send time; medians of runs; max of runs)"
    )
    add(
        f"  {'server':26} {'target':>7} {'achieved':>8} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'errors':>6} {'srv CPU':>7} {'LG CPU':>6} {'LG stall':>8} {'others':>6}"
    )
    for key in sorted(k for k in r if k.startswith("read_open_")):
        for name, s in r[key].items():
            add(
                f"  {name + ' @' + key.rsplit('_', 1)[1] + '%':26} {s['target_rate']:7.0f} {s['rate']:8.0f} {_lat(s)} {s['errors']:6d} {s.get('server_cpu', 0):7.2f} {s.get('loadgen_cpu', 0):6.2f} {s['loadgen_stall_ms_max']:8.1f} {s.get('other_cpu_max', 0):6.2f}"
            )
    add("")
    add(
        "End of conversation, peak (closed loop, POST .../conversations/{id}/end, distinct ids, 3 state fields)"
    )
    add(
        f"  {'server':26} {'req/s':>8} {'min-max':>15} {'srv CPU':>7} {'redis CPU':>9} {'others':>6} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}"
    )
    for name, s in r["end_peak"].items():
        add(
            f"  {name:26} {s['rate']:8.0f} {min(s['rates']):7.0f}-{max(s['rates']):<7.0f} {s.get('server_cpu', 0):7.2f} "
            f"{s.get('redis_cpu', 0):9.2f} {s.get('other_cpu', 0):6.2f} {s['latency_ms']['p50']:7.2f} "
            f"{s['latency_ms']['p99']:7.2f} {s['errors']:6d}"
        )
    add(
        "  (service-redis: Redis without persistence; service-redis-aof: deploy/redis.conf, appendfsync always;"
    )
    add(
        "   service-sqlite: WAL, synchronous=FULL; service-redis-noanalytics: service-redis, in a project with"
        " analytics off; all others: analytics on)"
    )
    add("")
    mt = r["mixed_traffic"]
    add(
        f"Mixed traffic: calls of 3-6 memory reads then one end; {mt['callers']:,} stored callers, Zipf s={mt['zipf_s']} "
        f"(top 65,536 callers get {mt['share_of_calls_to_top_65536_callers']:.0%} of calls)"
    )
    add(
        f"  {'server':26} {'peak/s':>7} {'open @50%':>9} {'kind':>5} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'errors':>6} {'LG stall':>8}"
    )
    for name, s in r["mixed"].items():
        o = s["open_50"]
        for kind in ("read", "end"):
            add(
                f"  {name:26} {s['peak']['rate']:7.0f} {o['rate']:9.0f} {kind:>5} {_lat(o[kind])} {o[kind]['errors']:6d}"
                f" {o['loadgen_stall_ms_max']:8.1f}"
            )
    add(
        "  (latency of each kind from its scheduled send time; peak/s and open @50% count reads and ends together)"
    )
    add("")
    fr, fs = r["footprint_redis"], r["footprint_sqlite"]
    add(
        f"Footprint: Redis {fr['bytes_per_caller']:.0f} B/caller (MEMORY USAGE of the hash {fr['hash_memory_usage_bytes']:.0f} B, "
        f"{fr['hash_encoding']}; expiry-index share {fr['expiry_index_bytes_per_caller']:.0f} B, {fr['expiry_index_encoding']}; "
        f"{fr['callers']:,} callers; used_memory delta {fr['used_memory_delta_per_caller']:.0f} B/caller)"
    )
    add(
        f"           SQLite {fs['bytes_per_caller']:.0f} B/caller on disk ({fs['callers']:,} callers; "
        f"the {fs['store_callers']:,}-caller store: {fs['store_bytes_per_caller']:.0f} B/caller)"
    )
    add("")
    sd = r["sdk"]
    add(
        f"SDK: begin_turn {sd['first_turn']['sdk_median_ms']:.3f} ms vs bare GET {sd['first_turn']['bare_median_ms']:.3f} ms "
        f"(first turn, 200); {sd['later_turn']['sdk_median_ms']:.3f} vs {sd['later_turn']['bare_median_ms']:.3f} ms (later turn, 304)"
    )
    if "summary" in r.get("profile", {}):
        add("")
        add("Profile of memory reads on Redis (py-spy; bench/results/profile-read.txt), time by layer:")
        for row in r["profile"]["summary"]["layers"][:12]:
            add(f"  {row['percent']:5.1f}%  {row['frame']}")
    add("")
    add("Targets")
    for t in r["targets"]:
        verdict = "note" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        add(f"  {verdict:4}  {t['target']}: {t['detail']}")
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    cpu = "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    redis_version = (
        subprocess.run(["redis-server", "--version"], capture_output=True, check=False)
        .stdout.decode()
        .strip()
    )
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "memory_gib": round(mem_kb / 1024 / 1024, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "redis_server": redis_version,
        "packages": {
            name: version(name)
            for name in (
                "aiohttp",
                "redis",
                "hiredis",
                "orjson",
                "pydantic",
                "phonenumbers",
                "prometheus-client",
                "uvloop",
                "py-spy",
            )
        },
    }


def code_measured(src: dict[str, Any], changed: str = " (changed during the run)") -> str:
    """The report's line on the code a run measured (its ``source`` record, from :func:`source_state`)."""
    return (
        f"Code measured: commit {src['commit'][:12]}"
        + (
            f" with uncommitted changes to {len(src['uncommitted'])} files"
            if src["uncommitted"]
            else " (clean)"
        )
        + (
            ""
            if src.get("service_dir", str(h.ROOT / "service")) == str(h.ROOT / "service")
            else f" from {src['service_dir']}"
        )
        + (f", service/+sdk/ sha256 {src['source_sha256'][:12]}" if "source_sha256" in src else "")
        + (changed if src.get("changed_during_run") else "")
    )


def source_state() -> dict[str, Any]:
    """What code the servers run (they import ``caller_memory`` as this process does: the editable install,
    or what PYTHONPATH puts first, e.g. a ``git archive`` of another commit): where it is, a digest of its
    service/ and sdk/, and, when it is this repository's work tree, the commit and the files that differ
    from it. The work tree may change while a run goes on; the servers run what was there when they started."""
    service_dir = Path(importlib.util.find_spec("caller_memory.service").origin or "").parent  # type: ignore[union-attr]
    sdk_dir = Path(importlib.util.find_spec("caller_memory.sdk").origin or "").parent  # type: ignore[union-attr]
    digest = hashlib.sha256()
    for folder in (service_dir, sdk_dir):
        for path in sorted(folder.rglob("*")):
            if path.is_file() and path.suffix in {".py", ".lua"}:
                digest.update(str(path.relative_to(folder.parent)).encode() + b"\0" + path.read_bytes())
    state: dict[str, Any] = {"service_dir": str(service_dir), "source_sha256": digest.hexdigest()}
    if service_dir.resolve() == (h.ROOT / "service").resolve():

        def git(*args: str) -> str:
            done = subprocess.run(["git", "-C", str(h.ROOT), *args], capture_output=True, check=False)
            return done.stdout.decode()

        state["commit"] = git("rev-parse", "HEAD").strip()
        state["uncommitted"] = [
            line for line in git("status", "--porcelain", "--", "service", "sdk").splitlines() if line
        ]
    else:
        state["commit"] = os.environ.get("BENCH_SOURCE_COMMIT", "unknown (not this work tree)")
        state["uncommitted"] = []
    return state


# Main ----------------------------------------------------------------------------------------------------


def finish(r: dict[str, Any], output: Path, began: float, targets: Any, report: Any) -> None:
    """The end of a benchmark script's run: the machine's load and whether the source changed during it,
    its length, the targets' verdicts (``targets(r)``), the results file, and the report printed."""
    r["machine"]["loadavg_end"] = os.getloadavg()
    r["source"]["changed_during_run"] = source_state()["source_sha256"] != r["source"]["source_sha256"]
    r["elapsed_s"] = time.monotonic() - began
    r["targets"] = targets(r)
    output.write_text(json.dumps(r, indent=1, default=str) + "\n")
    print(report(r))


@contextlib.contextmanager
def cleanup() -> Iterator[None]:
    def on_signal(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        yield
    finally:
        h.stop_all()
        signal.signal(signal.SIGTERM, previous)


def sized_parser(doc: str | None, *, quick: str, pin: str) -> argparse.ArgumentParser:
    """The options every side-by-side benchmark script shares: ``--quick`` or ``--smoke``, and ``--pin``
    (``pin`` says what goes where)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=f"fewer and shorter runs ({quick})")
    size.add_argument(
        "--smoke", action="store_true", help="a tiny run that checks the script (figures meaningless)"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{pin} (default: on with 2+ CPUs)",
    )
    return parser


def main() -> int:
    global RESULTS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smaller store, shorter and fewer runs (~2-3 min)"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="server on CPU 0, Redis and load generator on CPU 1 (default: on with 2+ CPUs)",
    )
    parser.add_argument(
        "--callers", type=int, help="stored callers (default 1,000,000; 100,000 with --quick)"
    )
    parser.add_argument(
        "--output", type=Path, default=RESULTS / "perf.json", help="results file; the profile goes beside it"
    )
    parser.add_argument("--skip-profile", action="store_true")
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    if args.callers:
        plan.callers = args.callers
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cpus) >= 2
    RESULTS = args.output.parent
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cm-bench-"))
    bench = Bench(plan=plan, work=work, key=secrets.token_urlsafe(32).encode(), pin=pin)
    if pin:
        bench.server_cpus, bench.aux_cpus = {cpus[0]}, set(cpus[1:])
    results = bench.results
    results["quick"] = args.quick
    results["machine"] = machine_info()
    results["source"] = source_state()
    results["pinning"] = (
        f"server under test on CPU {cpus[0]}; Redis, load generator, redis-benchmark's server on CPU {','.join(map(str, cpus[1:]))}"
        " (redis-benchmark itself on CPU 0)"
        if pin
        else "none (the scheduler places every process)"
    )
    results["plan"] = plan.__dict__ | {"read_callers": READ_CALLERS, "end_state_fields": END_STATE_FIELDS}
    results["persistence"] = {
        "service-redis, baseline, redis-benchmark": 'redis-server --save "" --appendonly no',
        "service-redis-aof": "deploy/redis.conf as shipped (appendonly yes, appendfsync always)",
        "service-sqlite": "SQLite WAL, synchronous=FULL (the service's settings)",
    }
    results["service_settings"] = (
        "defaults (log level INFO, access log off, max in flight 256), CALLER_MEMORY_SWEEP_INTERVAL=0"
    )
    steps: list[tuple[str, Callable[[Bench], None]]] = [
        ("setup", setup),
        ("calibrate", calibrate),
        ("warm", warm),
        ("peak_reads", peak_reads),
        ("wrk", wrk_reads),
        ("workers", workers),
        ("redis_benchmark", redis_benchmark),
        ("open_reads", open_reads),
        ("peak_ends", peak_ends),
        ("mixed", mixed),
        ("sdk", sdk),
    ]
    if not args.skip_profile:
        steps.append(("profile", profile))
    began = time.monotonic()
    try:
        with cleanup():
            for _, step in steps:
                step(bench)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    results["machine"]["loadavg_end"] = os.getloadavg()
    after = source_state()
    results["source"]["changed_during_run"] = after["source_sha256"] != results["source"]["source_sha256"]
    if results["source"]["changed_during_run"]:
        say(
            "WARNING: service/ or sdk/ changed during the run; the servers ran the code of the start "
            f"(commit {results['source']['commit'][:10]}, uncommitted: {results['source']['uncommitted'] or 'none'})"
        )
    results["elapsed_s"] = time.monotonic() - began
    results["targets"] = targets(results)
    args.output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(report(results))
    say(
        f"results written to {args.output.relative_to(h.ROOT) if args.output.is_relative_to(h.ROOT) else args.output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
