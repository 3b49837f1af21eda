"""Benchmarks of webhooks (issue 15): what delivery costs the end of a conversation, and deliveries per second.

    .venv/bin/python bench/webhooks.py            # full run: 5 rounds of 5 s, 3 runs of 5,000 deliveries
    .venv/bin/python bench/webhooks.py --quick    # about a minute: 3 rounds of 2 s, 2,000 deliveries
    .venv/bin/python bench/webhooks.py --smoke    # seconds: checks that everything runs (figures meaningless)

What runs, each in its own OS process (bench/README.md, "Webhooks", has the details), with bench/run.py's
machinery (pinning, the load generator, interleaved rounds, paired ratios):

- ``off``, ``on`` and ``queue-only``: three ``python -m caller_memory.service serve`` processes with the same
  settings (the defaults, sweeps off, CALLER_MEMORY_SECRET_KEY and CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS=127.0.0.1
  so that a receiver on loopback can be registered), each on a private redis-server of its own (replicas of
  one store would share the queue: each process must deliver only its own events). ``off`` has no webhook;
  ``on`` has one registered for ``conversation.ended`` during its measurements, and its delivery worker sends
  to a receiver that answers after 50 ms; ``queue-only`` has one too but runs no delivery worker
  (CALLER_MEMORY_WEBHOOK_INTERVAL=0): an ablation that separates queueing the event (the request path) from
  sending it (the worker, on the same core);
- bench/webhook_receiver.py: the receiver, verifying every delivery with the Standard Webhooks library;
- the load generator: bench/loadgen.py's client, run as ``bench/webhooks.py --loadgen``.

Measured: the peak (closed loop) of ``POST .../conversations/{id}/end`` (fresh ids, the body the SDK sends) on
the three, in interleaved rounds whose order alternates, with the ratio on/off per round and its median (target
>= 0.85); the deliveries the receiver got during each measured window. Then deliveries per second: N ends as
fast as they go, the receiver answering at once, from the first end sent to the last delivery received, at the
default per-endpoint concurrency and at the others of ``--concurrency``. Results: bench/results/webhooks.json
(or ``--output``) and a table with PASS/FAIL; when the target fails, py-spy profiles of the three.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import loadgen
import profiling
import run as bench_run
from caller_memory.service.config import Settings
from common import FIELDS, PROJECT, cpu_seconds

from tests.support.redis_server import RedisServer

RESULTS = h.BENCH / "results"
SIDES = ("off", "on", "queue-only")
#: The receiver's answer time while the end-of-conversation throughput is measured.
SLOW_MS = 50
DEFAULT_CONCURRENCY: int = next(
    f.default for f in dataclasses.fields(Settings) if f.name == "webhook_concurrency"
)  # type: ignore[assignment]
TARGET = 0.85
END_CALLERS = 1000  # callers the ends cycle through (as bench/run.py's end scenario)
END_STATE_FIELDS = 3

say = bench_run.say


# The load generator (``--loadgen``: a process of its own) --------------------------------------------------


class WindowRun(loadgen.Run):
    """bench/loadgen.py's run, which also says when (wall clock) its measured window began and ended: the
    receiver's arrivals are counted in that window."""

    window: tuple[float, float] = (0.0, 0.0)

    def sample_start(self) -> None:
        super().sample_start()
        self.window = (time.time(), 0.0)

    def sample_end(self) -> None:
        super().sample_end()
        self.window = (self.window[0], time.time())


async def burst(spec: dict[str, Any]) -> dict[str, Any]:
    """``count`` ends on ``connections`` keep-alive connections, each sending the next as soon as its answer
    is in; when (wall clock) the first was sent and the last answered."""
    stream = loadgen.requests_for(spec, 0)
    total = int(spec["count"])
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    statuses: Counter[int] = Counter()
    state = {"sent": 0, "answered": 0, "live": 0, "last": 0.0}

    def on_done(conn: loadgen.Connection, status: int) -> None:
        statuses[status] += 1
        state["answered"] += 1
        if status == 0:
            state["live"] -= 1
        elif state["sent"] < total:
            kind, raw = next(stream)
            state["sent"] += 1
            conn.send(kind, raw, time.perf_counter())
            return
        if state["answered"] == state["sent"] and (state["sent"] == total or not state["live"]):
            state["last"] = time.time()
            if not done.done():
                done.set_result(None)

    conns = []
    for _ in range(min(total, int(spec["connections"]))):
        _, proto = await loop.create_connection(
            lambda: loadgen.Connection(on_done), spec["host"], spec["port"]
        )
        conns.append(proto)
    state["live"] = len(conns)
    first = time.time()
    for conn in conns:
        kind, raw = next(stream)
        state["sent"] += 1
        conn.send(kind, raw, time.perf_counter())
    await asyncio.wait_for(done, float(spec.get("timeout", 120)))
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    return {"sent": state["sent"], "ok": ok, "statuses": {str(k): v for k, v in statuses.items()}} | {
        "first_sent": first,
        "last_answered": state["last"],
    }


def loadgen_main() -> None:
    spec = json.loads(sys.stdin.read())
    sys.setswitchinterval(0.0002)
    if spec.get("job") == "burst":
        result = asyncio.run(burst(spec))
    else:
        runner = WindowRun(spec)
        result = asyncio.run(runner.go())
        result["window"] = list(runner.window)
    sys.stdout.write(json.dumps(result) + "\n")


# The benchmark --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    rounds: int
    warmup: float
    closed_s: float
    #: Ends (hence deliveries) of one deliveries-per-second run, and runs per concurrency.
    burst_ends: int
    burst_runs: int
    profile_s: float
    connections: int = 32


FULL = Plan(5, 1.0, 5.0, 5000, 3, 10.0)
QUICK = Plan(3, 0.5, 2.0, 2000, 1, 5.0)
SMOKE = Plan(1, 0.2, 0.5, 50, 1, 1.0)


@dataclass
class Bench:
    plan: Plan
    work: Path
    key: bytes
    server_cpus: set[int] | None
    aux_cpus: set[int] | None
    conversation_memory: bool = False
    secret_key: str = field(default_factory=lambda: base64.b64encode(secrets.token_bytes(32)).decode())
    servers: dict[str, h.Server] = field(default_factory=dict)
    redis: dict[str, RedisServer] = field(default_factory=dict)
    agents: dict[str, str] = field(default_factory=dict)
    admins: dict[str, str] = field(default_factory=dict)
    receiver: h.Server | None = None
    results: dict[str, Any] = field(default_factory=dict)
    counter: int = 0

    def spec(self, server: str, **extra: Any) -> dict[str, Any]:
        self.counter += 1
        target = self.servers[server]
        watch = {"server": target.pid}
        if server in self.redis:
            watch["redis"] = self.redis[server].pid
        if self.receiver is not None:
            watch["receiver"] = self.receiver.pid
        scenario = {
            "type": "end",
            "callers": END_CALLERS,
            "token": self.agents.get(server),
            "project": PROJECT,
            "state_fields": END_STATE_FIELDS,
            "id_prefix": f"w{self.counter}",
        }
        return {"host": "127.0.0.1", "port": target.port, "scenario": scenario, "watch": watch, **extra}

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--loadgen"]

    def load(
        self, server: str, *, seconds: float | None = None, warmup: float | None = None
    ) -> dict[str, Any]:
        """One closed-loop run of ends (the load generator's own process, on the auxiliary CPUs)."""
        extra = {
            "mode": "closed",
            "rate": None,
            "connections": self.plan.connections,
            "warmup": self.plan.warmup if warmup is None else warmup,
            "duration": self.plan.closed_s if seconds is None else seconds,
        }
        if server == "static":
            spec = {"host": "127.0.0.1", "port": self.servers["static"].port, "scenario": {"type": "static"}}
            spec |= extra | {"watch": {"server": self.servers["static"].pid}}
        else:
            spec = self.spec(server, **extra)
        return h.run_loadgen(self.command(), spec, self.aux_cpus, server, "end")

    def burst(self, server: str, count: int) -> dict[str, Any]:
        spec = self.spec(server, job="burst", count=count, connections=self.plan.connections)
        cpus = self.aux_cpus
        proc = subprocess.run(
            self.command(),
            input=json.dumps(spec).encode(),
            capture_output=True,
            timeout=180,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"the burst of ends failed: {proc.stderr.decode()[-3000:]}")
        result: dict[str, Any] = json.loads(proc.stdout)
        return result


# Set-up and the receiver -----------------------------------------------------------------------------------


def service_env(bench: Bench, **extra: str) -> dict[str, str]:
    return {
        "CALLER_MEMORY_SECRET_KEY": bench.secret_key,
        "CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS": "127.0.0.1",
        **extra,
    }


def start_side(bench: Bench, name: str, **env: str) -> None:
    """A service process of its own on a redis-server of its own, with the bench project and its tokens."""
    store = bench.redis[name] = h.start_redis(cpus=bench.aux_cpus)
    svc = bench.servers[name] = h.start_service(
        name, store.url, bench.work, bench.key, bench.server_cpus, **service_env(bench, **env)
    )
    memory: dict[str, Any] = {
        "repeat_caller": {"analytics_enabled": True, "state_keys": FIELDS, "retention": "P30D"}
    }
    if bench.conversation_memory:
        memory["conversation"] = {"enabled": True}
    status, body = h.http("PUT", f"{svc.url}/v1/projects/{PROJECT}", h.OPERATOR_TOKEN, {"memory": memory})
    if status not in (200, 201):
        raise RuntimeError(f"creating the project on {name} failed: {status} {body}")
    for role, into in (("agent", bench.agents), ("admin", bench.admins)):
        status, body = h.http(
            "POST", f"{svc.url}/v1/projects/{PROJECT}/tokens", h.OPERATOR_TOKEN, {"role": role}
        )
        if status != 201:
            raise RuntimeError(f"minting a token on {name} failed: {status} {body}")
        into[name] = body["token"]


def stop_side(bench: Bench, name: str) -> None:
    h.stop(bench.servers.pop(name).proc)
    h.stop_redis(bench.redis.pop(name))


def start_receiver(bench: Bench) -> None:
    port = h.free_port()
    log = bench.work / "receiver.log"
    cmd = [sys.executable, str(h.BENCH / "webhook_receiver.py"), "--port", str(port)]
    proc = h.spawn(cmd, log=log, cpus=bench.aux_cpus)
    h.wait_http(f"http://127.0.0.1:{port}/healthz", proc, log, 30.0)
    bench.receiver = h.Server("receiver", proc, port, log)


def register(bench: Bench, server: str, label: str, delay_ms: int) -> str:
    """A webhook for ``conversation.ended`` on ``server`` to the receiver's ``label``; its secret is given to
    the receiver, which verifies every delivery with it. Answers the webhook's id."""
    assert bench.receiver is not None
    url = f"{bench.receiver.url}/hook/{label}?delay_ms={delay_ms}"
    status, body = h.http(
        "POST",
        f"{bench.servers[server].url}/v1/projects/{PROJECT}/webhooks",
        bench.admins[server],
        {"url": url, "events": ["conversation.ended"]},
    )
    if status != 201:
        raise RuntimeError(f"registering a webhook on {server} failed: {status} {body}")
    status, _ = h.http("PUT", f"{bench.receiver.url}/secret/{label}", "-", {"secret": body["secret"]})
    if status != 204:
        raise RuntimeError(f"the receiver refused the secret: {status}")
    webhook_id: str = body["webhook_id"]
    return webhook_id


def unregister(bench: Bench, server: str, webhook_id: str) -> float:
    """Delete the webhook (and so its queued deliveries); how long that took."""
    began = time.monotonic()
    url = f"{bench.servers[server].url}/v1/projects/{PROJECT}/webhooks/{webhook_id}"
    status, body = h.http("DELETE", url, bench.admins[server])
    if status != 204:
        raise RuntimeError(f"deleting webhook {webhook_id} failed: {status} {body}")
    return time.monotonic() - began


def received(bench: Bench, label: str, window: tuple[float, float] | None = None) -> dict[str, Any]:
    assert bench.receiver is not None
    query = f"?since={window[0]}&until={window[1]}" if window else ""
    status, body = h.http("GET", f"{bench.receiver.url}/stats/{label}{query}", "-")
    if status != 200:
        raise RuntimeError(f"the receiver's stats answered {status}")
    stats: dict[str, Any] = body
    return stats


def quiesce(bench: Bench, label: str, limit_s: float = 5.0) -> dict[str, Any]:
    """Wait until nothing is in flight to ``label`` and nothing more arrives (the webhook was deleted)."""
    deadline = time.monotonic() + limit_s
    last, still = -1, 0
    while True:
        stats = received(bench, label)
        still = still + 1 if stats["received"] == last and not stats["in_flight"] else 0
        last = stats["received"]
        if still >= 3 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def check_answers(bench: Bench) -> None:
    """Before anything is measured: an end answers 200 on every side, and on ``on`` its delivery arrives,
    verified, as ``conversation.ended``."""
    for name in SIDES:
        label = f"check-{name}"
        webhook_id = register(bench, name, label, 0) if name == "on" else ""
        body = json.loads(loadgen.end_body(0, END_STATE_FIELDS, "v" * 30))
        url = f"{bench.servers[name].url}/v1/projects/{PROJECT}/conversations/check-{name}/end"
        status, answer = h.http("POST", url, bench.agents[name], body)
        if status != 200:
            raise RuntimeError(f"an end on {name} answered {status}: {answer}")
        if webhook_id:
            deadline = time.monotonic() + 15
            while (stats := received(bench, label))["verified"] < 1:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no verified delivery reached the receiver: {stats}")
                time.sleep(0.05)
            if stats["invalid"] or stats["events"] != {"conversation.ended": 1}:
                raise RuntimeError(f"the check delivery is not what it should be: {stats}")
            unregister(bench, name, webhook_id)


# Measurements ---------------------------------------------------------------------------------------------


def calibrate(bench: Bench) -> None:
    say("load generator against bench/static_server.py")
    result = bench.load("static")
    bench.results["loadgen_capacity"] = {
        "rate": result["achieved_rate"],
        "loadgen_cpu": result["watched_cpu_share"].get("loadgen"),
    }


def measured_end_run(bench: Bench, side: str, label: str, **kwargs: Any) -> dict[str, Any]:
    """One closed-loop run of ends on ``side``; on ``on`` and ``queue-only`` a webhook is registered for the
    run (to the receiver, answering after SLOW_MS) and deleted after it, with its backlog, so that no
    delivery of this run goes on during the next."""
    webhook_id = register(bench, side, label, SLOW_MS) if side != "off" else ""
    try:
        result = bench.load(side, **kwargs)
    finally:
        if webhook_id:
            deleted_s = unregister(bench, side, webhook_id)
    if webhook_id:
        stats = received(bench, label, (result["window"][0], result["window"][1]))
        result["deliveries"] = {
            "in_window": stats["in_window"],
            "rate_in_window": stats["in_window"] / result["duration_s"],
            "received_by_deletion": stats["received"],
            "verified": stats["verified"],
            "invalid": stats["invalid"],
            "duplicates": stats["duplicates"],
            "max_in_flight": stats["max_in_flight"],
            "connections": stats["connections"],
            "deletion_s": deleted_s,
        }
        quiesce(bench, label)
    return result


def warm(bench: Bench) -> None:
    say("warm-up: ends on every side, webhooks registered where they will be (not recorded)")
    for side in SIDES:
        measured_end_run(bench, side, f"warm-{side}", seconds=bench.plan.closed_s / 2, warmup=0.3)


def peaks(bench: Bench) -> None:
    say(f"end of conversation, closed loop, {bench.plan.rounds} interleaved rounds (order alternating)")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_ in range(bench.plan.rounds):
        order = SIDES if round_ % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            result = measured_end_run(bench, side, f"{side}-{round_}")
            runs[side].append(result)
            got = result.get("deliveries")
            say(
                f"  round {round_ + 1}/{bench.plan.rounds} {side:10} {result['achieved_rate']:7.0f} req/s"
                f"  p50 {result['latency_ms']['p50']:6.2f} ms  server CPU {result['watched_cpu_share'].get('server', 0):.2f}"
                f"  errors {result['errors']}"
                + (
                    f"  deliveries in window {got['in_window']} ({got['rate_in_window']:.0f}/s)"
                    if got
                    else ""
                )
            )
    out: dict[str, Any] = {side: bench_run.summarise(r) | {"all": r} for side, r in runs.items()}
    for side in ("on", "queue-only"):
        got = [r["deliveries"] for r in runs[side]]
        out[side]["deliveries"] = {
            "in_window": [g["in_window"] for g in got],
            "rate_in_window": bench_run.med([g["rate_in_window"] for g in got]),
            "invalid": sum(g["invalid"] for g in got),
            "duplicates": sum(g["duplicates"] for g in got),
            "max_in_flight": max(g["max_in_flight"] for g in got),
            "ends_in_window": [r["ok"] for r in runs[side]],
        }
        out[f"ratio_{side}_over_off"] = bench_run.paired_ratio(runs[side], runs["off"])
        out[f"ratio_{side}_over_off_per_cpu"] = bench_run.paired_ratio(
            runs[side], runs["off"], key="requests_per_server_cpu_s"
        )
    bench.results["end_peak"] = out


def one_burst(bench: Bench, server: str, label: str) -> dict[str, Any]:
    """N ends at once with a receiver answering at once: from the first end sent to the last delivery."""
    count = bench.plan.burst_ends
    webhook_id = register(bench, server, label, 0)
    pids = {"server": bench.servers[server].pid, "redis": bench.redis[server].pid}
    assert bench.receiver is not None
    pids["receiver"] = bench.receiver.pid
    cpu0, t0 = {n: cpu_seconds(p) for n, p in pids.items()}, time.monotonic()
    ends = bench.burst(server, count)
    deadline = time.monotonic() + max(60.0, count / 20)
    while (stats := received(bench, label))["distinct_ids"] < ends["ok"]:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{ends['ok']} ends, {stats['distinct_ids']} deliveries after the wait: {stats}"
            )
        time.sleep(0.02)
    span = time.monotonic() - t0
    cpu = {n: (cpu_seconds(p) - cpu0[n]) / span for n, p in pids.items()}
    unregister(bench, server, webhook_id)
    total_s = stats["last"] - ends["first_sent"]
    after = stats["received"] - received(bench, label, (0.0, ends["last_answered"]))["in_window"]
    tail_s = stats["last"] - ends["last_answered"]
    return {
        "ends": ends,
        "ends_per_s": ends["ok"] / (ends["last_answered"] - ends["first_sent"]),
        "deliveries": stats["distinct_ids"],
        "seconds": total_s,
        "deliveries_per_s": stats["distinct_ids"] / total_s,
        "delivered_after_last_end": after,
        "rate_after_last_end": after / tail_s if tail_s > 0 else None,
        "receiver_max_in_flight": stats["max_in_flight"],
        "receiver_connections": stats["connections"],
        "invalid": stats["invalid"],
        "duplicates": stats["duplicates"],
        "cpu_share": cpu,
    }


def deliveries_per_second(bench: Bench, concurrencies: list[int]) -> None:
    plan = bench.plan
    say(
        f"deliveries per second: {plan.burst_ends:,} ends, receiver answering at once, concurrency {concurrencies}"
    )
    out: dict[str, Any] = {}
    for concurrency in concurrencies:
        server = "on" if concurrency == DEFAULT_CONCURRENCY else f"concurrency-{concurrency}"
        if server != "on":
            start_side(bench, server, CALLER_MEMORY_WEBHOOK_CONCURRENCY=str(concurrency))
        try:
            runs = []
            for i in range(plan.burst_runs):
                run = one_burst(bench, server, f"rate-{concurrency}-{i}")
                runs.append(run)
                say(
                    f"  concurrency {concurrency:3}: {run['deliveries']} deliveries in {run['seconds']:.2f} s = "
                    f"{run['deliveries_per_s']:.0f}/s (ends {run['ends_per_s']:.0f}/s; after the last end "
                    f"{run['rate_after_last_end'] or 0:.0f}/s; on {run['receiver_connections']} connections)"
                )
        finally:
            if server != "on":
                stop_side(bench, server)
        out[str(concurrency)] = {
            "deliveries_per_s": bench_run.med([r["deliveries_per_s"] for r in runs]),
            "rate_after_last_end": bench_run.med([r["rate_after_last_end"] or float("nan") for r in runs]),
            "ends_per_s": bench_run.med([r["ends_per_s"] for r in runs]),
            "receiver_max_in_flight": max(r["receiver_max_in_flight"] for r in runs),
            "receiver_connections": max(r["receiver_connections"] for r in runs),
            "invalid": sum(r["invalid"] for r in runs),
            "duplicates": sum(r["duplicates"] for r in runs),
            "server_cpu": bench_run.med([r["cpu_share"]["server"] for r in runs]),
            "receiver_cpu": bench_run.med([r["cpu_share"]["receiver"] for r in runs]),
            "redis_cpu": bench_run.med([r["cpu_share"]["redis"] for r in runs]),
            "all": runs,
        }
    bench.results["deliveries"] = out


# Profile --------------------------------------------------------------------------------------------------


WORKER = "delivery worker"
QUEUEING = "queueing the event (request path)"
REST = "the rest (the end, the server, the event loop)"


def part_of(frames: list[profiling.Frame]) -> str:
    """Which part of the webhook work a sample of the service is: the delivery worker (claims, signing, the
    HTTP client and its answers), queueing the event on the request path (listing the project's endpoints,
    building and queueing the deliveries), or the rest (the end itself, and what is shared: the event loop,
    the server, reading Redis's answers, which a stack does not tie to either).

    A store call awaited with others (``asyncio.gather``) runs as a task of its own, sampled without the
    frames that called it: a stack with a store frame and no frame of a request above it. The queueing gathers its
    Redis calls; the end does not (the ``off`` profile has no such stack), so they go to the queueing, with
    the few of the worker's settling (about 50 deliveries a second against 1,500 ends)."""
    files = [file for _, file in frames]
    if any(func == "run_deliveries" for func, _ in frames) or any(
        file.startswith(
            (
                "service/domain/webhooks/delivery.py",
                "service/http/webhook_sender.py",
                "aiohttp/client",
                "aiohttp/connector.py",
                "standardwebhooks/",
            )
        )
        for file in files
    ):
        return WORKER
    if any(
        file.startswith(("service/domain/webhooks/service.py", "service/storage/redis/webhooks.py"))
        for file in files
    ):
        return QUEUEING
    # service/http/server.py is at the root of every stack (it runs the event loop); a request's own frames
    # are the routes' and the middleware's.
    if any(f.startswith("service/storage/") for f in files) and not any(
        f.startswith("service/http/") and f != "service/http/server.py" for f in files
    ):
        return QUEUEING
    return REST


def parts(raw: str, rate: float, cpu: float) -> list[dict[str, Any]]:
    """The samples of each part, and its CPU per end (its share of the samples x the server's CPU share /
    ends per second)."""
    counts: Counter[str] = Counter({WORKER: 0, QUEUEING: 0, REST: 0})
    for frames, count in profiling.parse(raw):
        counts[part_of(frames)] += count
    total = sum(counts.values()) or 1
    return [
        {
            "part": name,
            "percent": round(100 * n / total, 1),
            "cpu_us_per_end": round(cpu * n / total / rate * 1e6, 1) if rate else None,
        }
        for name, n in counts.items()
    ]


def profile_header(
    side: str, seconds: float, connections: int, rate: float, cpu: float, split: list[dict[str, Any]]
) -> str:
    what = "no webhook" if side == "off" else f"one webhook, receiver answering after {SLOW_MS} ms"
    if side == "queue-only":
        what += ", no delivery worker"
    return (
        f"Profile of the service '{side}' ({what}): POST .../conversations/{{id}}/end on Redis, closed loop "
        f"({connections} connections), py-spy record --rate 200, {seconds:.0f} s; {rate:.0f} ends/s while "
        f"profiled, server CPU {cpu:.2f}.\nProduced by bench/webhooks.py; collapsed stacks: "
        f"webhooks-profile-{side}.collapsed.txt.\n\nBy part of the webhook work (bench/webhooks.py part_of; CPU "
        "per end = the part's share of the samples x the server's CPU share / ends per second)\n"
        + "\n".join(f"{p['percent']:6.1f}%  {p['cpu_us_per_end']:7.1f} us/end  {p['part']}" for p in split)
    )


def spy(bench: Bench, side: str) -> dict[str, Any]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    output = RESULTS / f"webhooks-profile-{side}.collapsed.txt"
    seconds = bench.plan.profile_s
    say(f"py-spy record of {side} under closed-loop ends, {seconds:.0f} s")
    webhook_id = register(bench, side, f"profile-{side}", SLOW_MS) if side != "off" else ""
    cmd = [exe, "record", "--pid", str(bench.servers[side].pid), "--rate", "200", "--format", "raw"]
    cmd += ["--duration", str(int(seconds)), "--output", str(output)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        result = bench.load(side, seconds=seconds + 1, warmup=0.5)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
        if webhook_id:
            unregister(bench, side, webhook_id)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
    raw = output.read_text()
    rate, cpu = result["achieved_rate"], result["watched_cpu_share"].get("server", 0.0)
    split = parts(raw, rate, cpu)
    analysis = profiling.analyse(raw)
    header = profile_header(side, seconds, bench.plan.connections, rate, cpu, split)
    (RESULTS / f"webhooks-profile-{side}.txt").write_text(profiling.render(analysis, header) + "\n")
    return {"rate_while_profiled": rate, "server_cpu": cpu, "parts": split, "summary": analysis}


def profile(bench: Bench) -> None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        bench.results["profile"] = {"skipped": "py-spy is not installed (bench/requirements.txt)"}
        say("py-spy not found: profile skipped")
        return
    bench.results["profile"] = {side: spy(bench, side) for side in SIDES}


# Targets and report ---------------------------------------------------------------------------------------


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    p = r["end_peak"]
    on, off, ratio = p["on"], p["off"], p["ratio_on_over_off"]
    got = on["deliveries"]
    flowing = min(got["in_window"]) > 0
    errors = on["errors"] + off["errors"]
    detail = (
        f"{on['rate']:.0f} vs {off['rate']:.0f} ends/s: {ratio['median_of_paired']:.2f}x (median of paired rounds "
        f"{ratio['per_round']}; per server CPU-second {p['ratio_on_over_off_per_cpu']['median_of_paired']:.2f}x); "
        f"deliveries received in each measured window {got['in_window']} ({got['rate_in_window']:.0f}/s), "
        f"{got['invalid']} failing verification, {got['duplicates']} duplicates"
    )
    if errors:
        detail += f"; {errors} errors"
    if not flowing:
        detail += "; NO deliveries arrived during a measured window"
    out.append(
        {
            "target": f"end of conversation with webhooks on (receiver answering in {SLOW_MS} ms) >= {TARGET}x off",
            "pass": ratio["median_of_paired"] >= TARGET and flowing and not errors and not got["invalid"],
            "detail": detail,
        }
    )
    q = p["ratio_queue-only_over_off"]
    out.append(
        {
            "target": "queueing alone (webhook registered, no delivery worker in the process) / off",
            "pass": None,
            "detail": f"{p['queue-only']['rate']:.0f} vs {off['rate']:.0f} ends/s: {q['median_of_paired']:.2f}x "
            f"(paired rounds {q['per_round']})",
        }
    )
    for concurrency, d in r["deliveries"].items():
        out.append(
            {
                "target": f"deliveries per second, concurrency {concurrency} per endpoint, receiver answering at once",
                "pass": None if not (d["invalid"] or d["duplicates"]) else False,
                "detail": f"{d['deliveries_per_s']:.0f}/s from the first end to the last delivery "
                f"({d['rate_after_last_end']:.0f}/s once the ends were done), on {d['receiver_connections']} "
                f"connections to the receiver; {d['invalid']} failing verification, {d['duplicates']} duplicates",
            }
        )
    return out


def report(r: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    m, src = r["machine"], r["source"]
    add("")
    add(
        f"Webhook benchmarks ({r['mode']} run), {m['cpus']} CPUs ({m['cpu']}), pinning: {r['pinning']}, "
        f"load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')}"
    )
    add(bench_run.code_measured(src))
    cap = r["loadgen_capacity"]
    add(
        f"Load generator: {cap['rate']:.0f} req/s against a static server (CPU {cap['loadgen_cpu'] or 0:.2f})"
    )
    add("")
    plan = r["plan"]
    add(
        f"End of conversation, closed loop ({plan['connections']} connections), conversation memory "
        f"{'on' if plan['conversation_memory'] else 'off'}, analytics on; medians of {plan['rounds']} interleaved rounds"
    )
    add(
        f"  {'side':10} {'ends/s':>7} {'min-max':>13} {'srv CPU':>7} {'us/end':>6} {'redis':>5} {'recv':>5} "
        f"{'LG':>5} {'others':>6} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}  deliveries in window  / off"
    )
    p = r["end_peak"]
    for side in SIDES:
        s = p[side]
        per_cpu = s.get("requests_per_server_cpu_s")
        got = s.get("deliveries")
        ratio = p.get(f"ratio_{side}_over_off")
        add(
            f"  {side:10} {s['rate']:7.0f} {min(s['rates']):6.0f}-{max(s['rates']):<6.0f} {s.get('server_cpu', 0):7.2f} "
            f"{1e6 / per_cpu if per_cpu else 0:6.0f} {s.get('redis_cpu', 0):5.2f} "
            f"{bench_run.med([x['watched_cpu_share'].get('receiver', 0.0) for x in s['all']]):5.2f} "
            f"{s.get('loadgen_cpu', 0):5.2f} "
            f"{s.get('other_cpu', 0):6.2f} {s['latency_ms']['p50']:7.2f} {s['latency_ms']['p99']:7.2f} {s['errors']:6d}  "
            + (f"{got['in_window']!s:20}" if got else " " * 20)
            + (f"  {ratio['median_of_paired']:.2f}x {ratio['per_round']}" if ratio else "")
        )
    add("")
    add(
        f"Deliveries per second ({plan['burst_ends']:,} ends on {plan['connections']} connections, receiver answering at once)"
    )
    add(
        f"  {'concurrency':>11} {'deliveries/s':>12} {'after ends/s':>12} {'ends/s':>7} {'connections':>11} "
        f"{'srv CPU':>7} {'redis':>5} {'recv':>5}"
    )
    for concurrency, d in r["deliveries"].items():
        add(
            f"  {concurrency:>11} {d['deliveries_per_s']:12.0f} {d['rate_after_last_end']:12.0f} {d['ends_per_s']:7.0f} "
            f"{d['receiver_connections']:11d} {d['server_cpu']:7.2f} {d['redis_cpu']:5.2f} {d['receiver_cpu']:5.2f}"
        )
    if isinstance(r.get("profile"), dict) and "on" in r["profile"]:
        add("")
        add("Profiles (py-spy), CPU per end by part of the webhook work")
        for side, prof in r["profile"].items():
            parts = ", ".join(
                f"{x['part']} {x['cpu_us_per_end']} us ({x['percent']}%)" for x in prof["parts"]
            )
            add(f"  {side:10} {prof['rate_while_profiled']:6.0f} ends/s: {parts}")
    add("")
    add("Targets")
    for t in r["targets"]:
        verdict = "note" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        add(f"  {verdict:4}  {t['target']}: {t['detail']}")
    return "\n".join(lines)


# Main -----------------------------------------------------------------------------------------------------


def main() -> int:
    global RESULTS
    parser = bench_run.sized_parser(
        __doc__,
        quick="about a minute",
        pin="services on CPU 0; Redis, the receiver and the load generator on the others",
    )
    parser.add_argument(
        "--concurrency",
        default=f"{DEFAULT_CONCURRENCY},16",
        help=f"per-endpoint concurrencies of the deliveries-per-second runs (default {DEFAULT_CONCURRENCY},16)",
    )
    parser.add_argument(
        "--conversation-memory", action="store_true", help="ends in a project with conversation memory on"
    )
    parser.add_argument(
        "--profile",
        choices=["failing", "always", "none"],
        default="failing",
        help="py-spy profiles of the three services (default: when the target fails)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "webhooks.json", help="results file")
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loadgen:
        loadgen_main()
        return 0
    plan = QUICK if args.quick else SMOKE if args.smoke else FULL
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cpus) >= 2
    RESULTS = args.output.parent
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cm-webhooks-"))
    bench = Bench(
        plan=plan,
        work=work,
        key=secrets.token_urlsafe(32).encode(),
        server_cpus={cpus[0]} if pin else None,
        aux_cpus=set(cpus[1:]) if pin else None,
        conversation_memory=args.conversation_memory,
    )
    r = bench.results
    r["mode"] = "quick" if args.quick else "smoke" if args.smoke else "full"
    r["machine"] = bench_run.machine_info()
    r["source"] = bench_run.source_state()
    r["pinning"] = (
        f"services on CPU {cpus[0]}; Redis, the receiver and the load generator on CPU {','.join(map(str, cpus[1:]))}"
        if pin
        else "none"
    )
    r["plan"] = plan.__dict__ | {
        "conversation_memory": bench.conversation_memory,
        "slow_receiver_ms": SLOW_MS,
        "default_concurrency": DEFAULT_CONCURRENCY,
        "concurrencies": concurrencies,
        "end_callers": END_CALLERS,
        "end_state_fields": END_STATE_FIELDS,
    }
    r["persistence"] = 'redis-server --save "" --appendonly no, one per service process'
    r["service_settings"] = (
        "defaults, CALLER_MEMORY_SWEEP_INTERVAL=0, CALLER_MEMORY_SECRET_KEY, CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS=127.0.0.1;"
        " queue-only: CALLER_MEMORY_WEBHOOK_INTERVAL=0; concurrency-N: CALLER_MEMORY_WEBHOOK_CONCURRENCY=N"
    )
    began = time.monotonic()
    try:
        with bench_run.cleanup():
            start_receiver(bench)
            start_side(bench, "off")
            start_side(bench, "on")
            start_side(bench, "queue-only", CALLER_MEMORY_WEBHOOK_INTERVAL="0")
            bench.servers["static"] = h.start_static(bench.work, bench.server_cpus)
            check_answers(bench)
            calibrate(bench)
            warm(bench)
            peaks(bench)
            deliveries_per_second(bench, concurrencies)
            failing = r["end_peak"]["ratio_on_over_off"]["median_of_paired"] < TARGET
            if args.profile == "always" or (args.profile == "failing" and failing):
                profile(bench)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    bench_run.finish(r, args.output, began, targets, report)
    say(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
