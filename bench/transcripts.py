"""Benchmarks of conversation memory (issue 14) against a hand-written baseline, side by side in one run.

    .venv/bin/python bench/transcripts.py            # full run (about 8 minutes on the 2-core machine)
    .venv/bin/python bench/transcripts.py --quick    # about 2 minutes: fewer and shorter runs
    .venv/bin/python bench/transcripts.py --smoke    # seconds: checks that everything runs (figures meaningless)

What runs, each server in its own OS process (bench/README.md, "Conversation memory", has the details):

- ``service``: ``python -m caller_memory.service serve`` with its default settings (sweeps off, as in
  bench/run.py) on a private redis-server without persistence, in a project with ``memory.conversation``
  enabled;
- ``baseline``: bench/transcript_baseline.py, one aiohttp route per operation doing one redis-py RPUSH, LRANGE
  or LRANGE + HGETALL (pipelined), on the same Redis;
- the load generator: bench/loadgen.py's client and recorder, run as ``bench/transcripts.py --loadgen`` (its
  own process per measurement) with the requests of these scenarios.

Measured: the peak (closed loop) of appending one message and a batch of 10, reading the history of a
50-message conversation and assembling its context (``max_tokens=2000``, a caller memory of 3 fields), in
interleaved rounds (ratios per round, then the median); the context read's latency in open loop at half its
peak; Redis bytes per stored message (``used_memory`` delta and ``MEMORY USAGE``) for the service and the
baseline. Results: bench/results/transcripts.json (or ``--output``) and a table with the targets' PASS/FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import loadgen
import profiling
import run as bench_run
from common import PROJECT, append_document, caller_phone, pseudonym, quote_phone

RESULTS = h.BENCH / "results"
KINDS = ("append1", "append10", "history", "context")
LABELS = {
    "append1": "append 1 message",
    "append10": "append 10 messages",
    "history": "history, 50 messages",
    "context": "context, max_tokens=2000",
}
BATCH = {"append1": 1, "append10": 10}
#: Messages of each conversation that history and context read, and the context's budget.
READ_MESSAGES = 50
MAX_TOKENS = 2000
#: The caller memory of each read conversation's caller (written with PATCH by an admin).
PROFILE = {
    "field_0": "Ada Lovelace",
    "field_1": "prefers a callback in the morning",
    "field_2": "gold tier",
}
#: First caller index of the conversations appended to during the measurements (fresh callers per run).
APPEND_CALLERS = 100_000
FOOTPRINT_CALLERS = 6_000_000
SERVICE_BASE = f"/v1/projects/{PROJECT}/conversations/"
BASELINE_BASE = "/conversations/"

say = bench_run.say


# The load generator (``--loadgen``: a process of its own) --------------------------------------------------


def requests_of(spec: dict[str, Any]) -> Iterator[loadgen.Request]:
    """The endless request stream of one scenario: ``append`` (batches of ``batch`` messages to
    ``conversations`` conversations in turn, each of a fresh caller from ``caller_base``) or ``get``
    (``paths`` in turn)."""
    sc = spec["scenario"]
    host = f"{spec['host']}:{spec['port']}"
    headers = loadgen._auth(sc)
    if sc["type"] == "get":
        raws = [loadgen._get(host, path, headers) for path in sc["paths"]]
        for raw in itertools.cycle(raws):
            yield sc["kind"], raw
    count, batch = sc["conversations"], sc["batch"]
    paths = [f"{sc['base']}{sc['id_prefix']}-{i}/messages" for i in range(count)]
    began = int(time.time() * 1000)
    for k in itertools.count():
        conversation = k % count
        document = append_document(
            sc["caller_base"] + conversation,
            (k // count) * batch,
            batch,
            began + k,
            message_ids=sc["message_ids"],
        )
        yield sc["kind"], loadgen._post(host, paths[conversation], headers, orjson.dumps(document))


class TranscriptRun(loadgen.Run):
    """bench/loadgen.py's run (connections, open or closed loop, recorder) with this script's requests."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__({**spec, "scenario": {"type": "static"}})
        stream = requests_of(spec)
        first = next(stream)  # builds the request tables before the clock starts
        self.stream = itertools.chain([first], stream)


def loadgen_main() -> None:
    """Spec on stdin as for bench/loadgen.py, with a scenario of :func:`requests_of` (or ``static``)."""
    spec = json.loads(sys.stdin.read())
    try:
        import uvloop

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    sys.setswitchinterval(0.0002)  # the open loop's ticker thread must get the GIL back quickly
    runner = loadgen.Run(spec) if spec["scenario"]["type"] == "static" else TranscriptRun(spec)
    result = asyncio.run(runner.go())
    result["loop"] = loop_name
    sys.stdout.write(json.dumps(result) + "\n")


# The benchmark --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    rounds: int
    warmup: float
    closed_s: float
    open_runs: int
    open_s: float
    #: Conversations of READ_MESSAGES messages that history and context cycle through.
    read_conversations: int
    #: Conversations an append run writes to in turn.
    append_conversations: int
    footprint_conversations: int
    footprint_messages: int
    profile_s: float
    connections: int = 32
    open_connections: int = 64


FULL = Plan(5, 1.0, 5.0, 5, 10.0, 1000, 1000, 100, 100, 10.0)
QUICK = Plan(3, 0.5, 2.0, 3, 3.0, 200, 1000, 100, 100, 5.0)
SMOKE = Plan(1, 0.2, 0.5, 1, 0.5, 4, 100, 4, 20, 1.0)


@dataclass
class Bench:
    plan: Plan
    work: Path
    key: bytes
    server_cpus: set[int] | None
    aux_cpus: set[int] | None
    message_ids: bool = True
    servers: dict[str, h.Server] = field(default_factory=dict)
    redis: h.RedisServer | None = None
    token: str = ""
    admin: str = ""
    results: dict[str, Any] = field(default_factory=dict)
    counter: int = 0

    def read_ids(self) -> list[str]:
        return [f"r-{i}" for i in range(self.plan.read_conversations)]

    def scenario(self, server: str, kind: str) -> dict[str, Any]:
        self.counter += 1
        service = server == "service"
        base = SERVICE_BASE if service else BASELINE_BASE
        token = self.token if service else None
        if kind in BATCH:
            caller_base = APPEND_CALLERS + self.counter * self.plan.append_conversations
            assert caller_base + self.plan.append_conversations < FOOTPRINT_CALLERS
            return {
                "type": "append",
                "kind": kind,
                "batch": BATCH[kind],
                "conversations": self.plan.append_conversations,
                "caller_base": caller_base,
                "id_prefix": f"a{self.counter}",
                "base": base,
                "token": token,
                "message_ids": self.message_ids,
            }
        if kind == "history":
            paths = [f"{base}{cid}/history" for cid in self.read_ids()]
        elif service:
            paths = [f"{base}{cid}/context?max_tokens={MAX_TOKENS}" for cid in self.read_ids()]
        else:
            subjects = [pseudonym(self.key, PROJECT, caller_phone(i)) for i in range(len(self.read_ids()))]
            paths = [
                f"{base}{cid}/context?caller={s}" for cid, s in zip(self.read_ids(), subjects, strict=True)
            ]
        return {"type": "get", "kind": kind, "paths": paths, "token": token}

    def load(
        self,
        server: str,
        kind: str,
        *,
        mode: str = "closed",
        seconds: float | None = None,
        rate: float | None = None,
        warmup: float | None = None,
    ) -> dict[str, Any]:
        """One load-generator run (its own process, on the auxiliary CPUs) against ``server``."""
        target = self.servers[server]
        watch = {"server": target.pid}
        if self.redis is not None and server != "static":
            watch["redis"] = self.redis.pid
        spec = {
            "host": "127.0.0.1",
            "port": target.port,
            "mode": mode,
            "rate": rate,
            "connections": self.plan.open_connections if mode == "open" else self.plan.connections,
            "warmup": self.plan.warmup if warmup is None else warmup,
            "duration": self.plan.closed_s if seconds is None else seconds,
            "scenario": {"type": "static"} if server == "static" else self.scenario(server, kind),
            "watch": watch,
        }
        return h.run_loadgen(
            [sys.executable, str(Path(__file__).resolve()), "--loadgen"], spec, self.aux_cpus, server, kind
        )


# Set-up ---------------------------------------------------------------------------------------------------


def raw_get(url: str, token: str | None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def conversation_project(server: h.Server) -> tuple[str, str]:
    """The bench project with conversation memory on (state keys field_0..field_9, 30 days, analytics off),
    and an agent and an admin token for it."""
    config = {
        "memory": {
            "repeat_caller": {"state_keys": h.FIELDS, "retention": "P30D"},
            "conversation": {"enabled": True},
        }
    }
    status, body = h.http("PUT", f"{server.url}/v1/projects/{PROJECT}", h.OPERATOR_TOKEN, config)
    if status not in (200, 201):
        raise RuntimeError(f"creating the project failed: {status} {body}")
    tokens = []
    for role in ("agent", "admin"):
        url = f"{server.url}/v1/projects/{PROJECT}/tokens"
        status, body = h.http("POST", url, h.OPERATOR_TOKEN, {"role": role})
        if status != 201:
            raise RuntimeError(f"minting a token failed: {status} {body}")
        tokens.append(body["token"])
    return tokens[0], tokens[1]


def append(server: h.Server, token: str, conversation: str, caller: int, first: int, count: int) -> None:
    document = append_document(caller, first, count, int(time.time() * 1000))
    status, body = h.http("POST", f"{server.url}{SERVICE_BASE}{conversation}/messages", token, document)
    if status != 200 or not body.get("stored"):
        raise RuntimeError(f"an append to {conversation} failed: {status} {body}")


def stored_as_baseline(caller: int, first: int, count: int, now: int) -> list[bytes]:
    """What the baseline's RPUSH stores for these messages (each message of the append body, as JSON)."""
    return [orjson.dumps(m) for m in append_document(caller, first, count, now)["messages"]]  # type: ignore[attr-defined]


def setup(bench: Bench) -> None:
    plain = bench.redis = h.start_redis(cpus=bench.aux_cpus)
    svc = bench.servers["service"] = h.start_service(
        "service", plain.url, bench.work, bench.key, bench.server_cpus
    )
    bench.token, bench.admin = conversation_project(svc)
    bench.servers["baseline"] = h.start_transcript_baseline(plain.url, bench.work, bench.server_cpus)
    bench.servers["static"] = h.start_static(bench.work, bench.server_cpus)
    prefill(bench)
    check_answers(bench)


def prefill(bench: Bench) -> None:
    """The read conversations: READ_MESSAGES messages each, appended through the service (one batch) and
    pushed as they are into the baseline's lists; each caller with the PROFILE fields."""
    svc, ids = bench.servers["service"], bench.read_ids()
    say(f"prefill: {len(ids)} conversations of {READ_MESSAGES} messages, callers with {len(PROFILE)} fields")

    def one(i: int) -> None:
        path = f"{svc.url}/v1/projects/{PROJECT}/callers/{quote_phone(caller_phone(i))}/memory"
        status, body = h.http("PATCH", path, bench.admin, PROFILE)
        if status != 200:
            raise RuntimeError(f"writing caller {i}'s memory failed: {status} {body}")
        append(svc, bench.token, ids[i], i, 0, READ_MESSAGES)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(len(ids))))
    assert bench.redis is not None
    client = bench.redis.client()
    try:
        now = int(time.time() * 1000)
        pipe = client.pipeline(transaction=False)
        for i, cid in enumerate(ids):
            pipe.rpush(f"bl:t:{cid}", *stored_as_baseline(i, 0, READ_MESSAGES, now))
        pipe.execute()
    finally:
        client.close()


def check_answers(bench: Bench) -> None:
    """Every operation answers what it should on both servers before anything is measured; the sizes of
    the answers are recorded."""
    svc, base = bench.servers["service"], bench.servers["baseline"]
    sizes: dict[str, int] = {}
    for server, kind in itertools.product(("service", "baseline"), ("history", "context")):
        path = bench.scenario(server, kind)["paths"][0]
        status, raw = raw_get(bench.servers[server].url + path, bench.token if server == "service" else None)
        body = json.loads(raw) if raw else None
        if status != 200:
            raise RuntimeError(f"{server} {kind} answered {status}: {raw[:500]!r}")
        if server == "service" and kind == "context":
            messages, fields = (
                body["sections"]["recent_turns"]["messages"],
                body["sections"]["profile"]["fields"],
            )
        elif kind == "context":
            messages, fields = body["messages"], body["profile"]
        else:
            messages, fields = body["contents"], PROFILE
        if len(messages) != READ_MESSAGES or len(fields) != len(PROFILE):
            raise RuntimeError(f"{server} {kind}: {len(messages)} messages, {len(fields)} fields: {body}")
        sizes[f"{server} {kind}"] = len(raw)
    append(svc, bench.token, "check-0", APPEND_CALLERS, 0, 10)
    document = append_document(APPEND_CALLERS, 0, 10, int(time.time() * 1000))
    status, body = h.http("POST", f"{base.url}{BASELINE_BASE}check-0/messages", "-", document)
    if status != 200 or body["added"] != 10:
        raise RuntimeError(f"the baseline's append answered {status} {body}")
    bench.results["answer_bytes"] = sizes


# Footprint ------------------------------------------------------------------------------------------------


def footprint(bench: Bench) -> None:
    """Redis bytes per stored message, on a redis-server of its own: the service's (appends in batches of
    10 through HTTP) and the baseline's (RPUSH of the same messages as the baseline stores them)."""
    plan = bench.plan
    n_conv, n_msg = plan.footprint_conversations, plan.footprint_messages
    say(f"footprint: {n_conv} conversations x {n_msg} messages of 100 characters, service then baseline")
    server = h.start_redis(cpus=bench.aux_cpus)
    svc = h.start_service("service-footprint", server.url, bench.work, bench.key, bench.server_cpus)
    client = server.client()
    try:
        token, _ = conversation_project(svc)
        # One conversation first, not counted: it loads the scripts and creates the project's own keys.
        append(svc, token, "fp-warm", FOOTPRINT_CALLERS + n_conv, 0, 10)
        before_keys = set(client.scan_iter(count=1000))
        before = int(client.info("memory")["used_memory"])
        one_keys: set[bytes] = set()
        for c in range(n_conv):
            for first in range(0, n_msg, 10):
                append(svc, token, f"fp-{c}", FOOTPRINT_CALLERS + c, first, min(10, n_msg - first))
            if c == 0:
                one_keys = set(client.scan_iter(count=1000)) - before_keys
        grown = int(client.info("memory")["used_memory"]) - before
        subject = pseudonym(bench.key, PROJECT, caller_phone(FOOTPRINT_CALLERS))
        keys = []
        for key in sorted(one_keys):
            name = key.decode().replace(subject, "<subject>").replace("fp-0", "<id>")
            encoding = client.object("encoding", key)
            keys.append(
                {
                    "key": name,
                    "type": client.type(key).decode(),
                    "encoding": encoding.decode() if isinstance(encoding, bytes) else str(encoding),
                    "memory_usage": int(client.memory_usage(key, samples=0) or 0),
                }
            )
        one = sum(k["memory_usage"] for k in keys)
        total = n_conv * n_msg
        service = {
            "messages": total,
            "conversations": n_conv,
            "used_memory_delta": grown,
            "bytes_per_message": grown / total,
            "one_conversation_keys": keys,
            "one_conversation_memory_usage_per_message": one / n_msg,
        }
        before = int(client.info("memory")["used_memory"])
        now = int(time.time() * 1000)
        for c in range(n_conv):
            for first in range(0, n_msg, 10):
                count = min(10, n_msg - first)
                client.rpush(f"bl:t:fp-{c}", *stored_as_baseline(FOOTPRINT_CALLERS + c, first, count, now))
        grown = int(client.info("memory")["used_memory"]) - before
        encoding = client.object("encoding", "bl:t:fp-0")
        baseline = {
            "messages": total,
            "used_memory_delta": grown,
            "bytes_per_message": grown / total,
            "message_json_bytes": len(stored_as_baseline(FOOTPRINT_CALLERS, 1, 1, now)[0]),
            "one_list_memory_usage_per_message": int(client.memory_usage("bl:t:fp-0", samples=0) or 0)
            / n_msg,
            "encoding": encoding.decode() if isinstance(encoding, bytes) else str(encoding),
        }
    finally:
        client.close()
        h.stop(svc.proc)
        h.stop_redis(server)
    bench.results["footprint"] = {"service": service, "baseline": baseline}


# Measurements ---------------------------------------------------------------------------------------------


def calibrate(bench: Bench) -> None:
    say("load generator against bench/static_server.py")
    result = bench.load("static", "static")
    bench.results["loadgen_capacity"] = {
        "rate": result["achieved_rate"],
        "loadgen_cpu": result["watched_cpu_share"].get("loadgen"),
        "loop": result.get("loop"),
    }


def warm(bench: Bench) -> None:
    say("warm-up: every operation on both servers (not recorded)")
    for kind, server in itertools.product(KINDS, ("service", "baseline")):
        bench.load(server, kind, seconds=bench.plan.closed_s / 2, warmup=0.3)


def peaks(bench: Bench) -> None:
    say("peak throughput, closed loop, interleaved rounds")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {"service": [], "baseline": []} for k in KINDS}
    for round_ in range(bench.plan.rounds):
        for kind, server in itertools.product(KINDS, ("service", "baseline")):
            result = bench.load(server, kind)
            runs[kind][server].append(result)
            say(
                f"  round {round_ + 1}/{bench.plan.rounds} {kind:8} {server:8} {result['achieved_rate']:7.0f} req/s"
                f"  p50 {result['latency_ms']['p50']:6.2f} ms  server CPU {result['watched_cpu_share'].get('server', 0):.2f}"
                f"  errors {result['errors']} {result['statuses']}"
            )
    bench.results["peak"] = {
        kind: {
            **{server: bench_run.summarise(r) | {"all": r} for server, r in by.items()},
            "ratio": bench_run.paired_ratio(by["service"], by["baseline"]),
            "ratio_per_cpu": bench_run.paired_ratio(
                by["service"], by["baseline"], key="requests_per_server_cpu_s"
            ),
        }
        for kind, by in runs.items()
    }


def open_context(bench: Bench) -> None:
    rate = max(1, round(bench.results["peak"]["context"]["service"]["rate"] * 0.5))
    say(f"open-loop context reads at 50% of the service's peak: {rate} req/s (service and baseline)")
    runs = bench_run.open_runs(bench, ["service", "baseline"], "context", rate)
    out = {server: bench_run.summarise(r) | {"all": r} for server, r in runs.items()}
    for server, server_runs in runs.items():
        quiet = [r for r in server_runs if (r.get("other_processes_cpu") or 0.0) < bench_run.QUIET_OTHER_CPU]
        out[server]["quiet_runs"] = bench_run.summarise(quiet) if quiet else None
    bench.results["context_open_50"] = out


# Profile --------------------------------------------------------------------------------------------------

#: bench/profiling.py's layers, with the conversation-memory modules of the service as layers of their own.
LAYERS = [
    ("transcript domain (validate, redact, encode, views)", profiling._is("service/domain/transcript")),
    ("transcript store (Redis adapter, entry decoding)", profiling._is("service/storage/redis_transcripts")),
    ("transcript routes", profiling._is("service/http/conversation_routes.py", "service/http/queries.py")),
    *profiling.LAYERS,
]


def layer_of(frames: list[profiling.Frame]) -> str:
    """As bench/profiling.py's ``layer_of`` (the deepest frame of a known layer), over LAYERS."""
    for func, file in reversed(frames):
        hit = next((name for name, test in LAYERS[:-1] if test(func, file)), None)
        if hit is not None and func not in profiling.ENTRY:
            return hit
    return LAYERS[-1][0] if any(LAYERS[-1][1](*frame) for frame in frames) else profiling.FALLBACK


def layers_of(raw: str) -> list[dict[str, Any]]:
    counts: Counter[str] = Counter()
    for frames, count in profiling.parse(raw):
        counts[layer_of(frames)] += count
    total = sum(counts.values()) or 1
    return [
        {"frame": n, "samples": c, "percent": round(100.0 * c / total, 1)} for n, c in counts.most_common()
    ]


def profile(bench: Bench, kinds: list[str]) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        bench.results["profile"] = {"skipped": "py-spy is not installed (bench/requirements.txt)"}
        say("py-spy not found: profile skipped")
        return
    bench.results["profile"] = {}
    for kind in kinds:
        output = RESULTS / f"transcripts-profile-{kind}.collapsed.txt"
        say(f"py-spy record of the service under closed-loop {kind}, {bench.plan.profile_s:.0f} s")
        cmd = [spy, "record", "--pid", str(bench.servers["service"].pid), "--rate", "200", "--format", "raw"]
        cmd += ["--duration", str(int(bench.plan.profile_s)), "--output", str(output)]
        spy_proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            result = bench.load("service", kind, seconds=bench.plan.profile_s + 1, warmup=0.5)
            _, err = spy_proc.communicate(timeout=60)
        finally:
            if spy_proc.poll() is None:
                spy_proc.send_signal(signal.SIGINT)
                spy_proc.wait(10)
        if spy_proc.returncode != 0:
            raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
        raw = output.read_text()
        analysis = profiling.analyse(raw) | {"layers": layers_of(raw)}
        header = (
            f"Profile of the service: {LABELS[kind]} on Redis, closed loop ({bench.plan.connections} connections), "
            f"py-spy record --rate 200, {bench.plan.profile_s:.0f} s; throughput while profiled: "
            f"{result['achieved_rate']:.0f} req/s.\nProduced by bench/transcripts.py; collapsed stacks: {output.name}."
        )
        (RESULTS / f"transcripts-profile-{kind}.txt").write_text(profiling.render(analysis, header) + "\n")
        bench.results["profile"][kind] = {"rate_while_profiled": result["achieved_rate"], "summary": analysis}


# Targets and report ---------------------------------------------------------------------------------------

#: Throughput targets: the service's peak over the baseline's (median of paired rounds); None: reported only.
RATIO_TARGETS = {"append1": 0.6, "append10": 0.6, "history": None, "context": 0.5}
P99_TARGET_MS = 5.0
BYTES_TARGET = 300


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        out.append({"target": name, "pass": ok, "detail": detail})

    for kind, floor in RATIO_TARGETS.items():
        p = r["peak"][kind]
        ratio = p["ratio"]["median_of_paired"]
        detail = (
            f"{p['service']['rate']:.0f} vs {p['baseline']['rate']:.0f} req/s: {ratio:.2f}x (median of paired "
            f"rounds {p['ratio']['per_round']}; per server CPU-second {p['ratio_per_cpu']['median_of_paired']:.2f}x)"
        )
        errors = p["service"]["errors"] + p["baseline"]["errors"]
        if errors:
            detail += f"; {errors} errors"
        if floor is None:
            add(f"{LABELS[kind]}: service / baseline throughput", None, detail)
        else:
            add(
                f"{LABELS[kind]}: service >= {floor}x baseline throughput",
                ratio >= floor and not errors,
                detail,
            )
    o = r["context_open_50"]["service"]
    lat, quiet = o["latency_ms"], o.get("quiet_runs")
    quiet_note = (
        f"; over the {quiet['runs']} of {o['runs']} runs with other processes under "
        f"{bench_run.QUIET_OTHER_CPU:.0%} CPU: p99 {quiet['latency_ms']['p99']:.2f} ms"
        if quiet
        else f"; no run had other processes under {bench_run.QUIET_OTHER_CPU:.0%} CPU"
    )
    add(
        f"context read in open loop at 50% of its peak: p99 <= {P99_TARGET_MS:g} ms",
        lat["p99"] <= P99_TARGET_MS and o["errors"] == 0,
        f"p50 {lat['p50']:.2f}, p99 {lat['p99']:.2f}, p99.9 {lat['p99_9']:.2f} ms (max {lat['max_of_runs']:.1f}) at "
        f"{o['rate']:.0f}/{o['target_rate']:.0f} req/s, {o['errors']} errors, median of {o['runs']} runs{quiet_note}",
    )
    fs, fb = r["footprint"]["service"], r["footprint"]["baseline"]
    add(
        f"Redis bytes per stored message of 100 characters <= {BYTES_TARGET} B",
        fs["bytes_per_message"] <= BYTES_TARGET,
        f"{fs['bytes_per_message']:.0f} B (used_memory delta over {fs['messages']:,} messages in "
        f"{fs['conversations']} conversations); MEMORY USAGE of one conversation's keys "
        f"{fs['one_conversation_memory_usage_per_message']:.0f} B/message",
    )
    add(
        "baseline's Redis bytes per message (RPUSH of the message's JSON)",
        None,
        f"{fb['bytes_per_message']:.0f} B (used_memory delta; MEMORY USAGE of one list "
        f"{fb['one_list_memory_usage_per_message']:.0f} B/message, {fb['encoding']}; the JSON is "
        f"{fb['message_json_bytes']} B)",
    )
    return out


def report(r: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    m, src = r["machine"], r["source"]
    add("")
    add(
        f"Conversation memory benchmarks ({r['mode']} run), {m['cpus']} CPUs ({m['cpu']}), pinning: {r['pinning']}, "
        f"load average at start {m['loadavg_start']}"
    )
    add(bench_run.code_measured(src))
    cap = r["loadgen_capacity"]
    add(
        f"Load generator: {cap['rate']:.0f} req/s against a static server ({cap['loop']}, CPU {cap['loadgen_cpu'] or 0:.2f})"
    )
    add("")
    plan = r["plan"]
    add(
        f"Peak throughput (closed loop, {plan['connections']} connections; medians of {plan['rounds']} interleaved rounds)"
    )
    add(
        f"  {'operation':26} {'server':8} {'req/s':>7} {'min-max':>13} {'msg/s':>7} {'srv CPU':>7} {'redis':>5} "
        f"{'LG':>5} {'others':>6} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6}  service/baseline"
    )
    for kind in KINDS:
        p = r["peak"][kind]
        for server in ("service", "baseline"):
            s = p[server]
            ratio = (
                f"{p['ratio']['median_of_paired']:.2f}x {p['ratio']['per_round']}"
                if server == "service"
                else ""
            )
            msgs = f"{s['rate'] * BATCH[kind]:.0f}" if kind in BATCH else ""
            add(
                f"  {LABELS[kind] if server == 'service' else '':26} {server:8} {s['rate']:7.0f} "
                f"{min(s['rates']):6.0f}-{max(s['rates']):<6.0f} {msgs:>7} "
                f"{s.get('server_cpu', 0):7.2f} {s.get('redis_cpu', 0):5.2f} {s.get('loadgen_cpu', 0):5.2f} "
                f"{s.get('other_cpu', 0):6.2f} {s['latency_ms']['p50']:7.2f} {s['latency_ms']['p99']:7.2f} "
                f"{s['errors']:6d}  {ratio}"
            )
    add("")
    o = r["context_open_50"]
    add(
        "Context read, open loop at 50% of the service's peak (latency from the scheduled send; medians of runs)"
    )
    add(
        f"  {'server':8} {'target':>7} {'achieved':>8} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'errors':>6} "
        f"{'srv CPU':>7} {'LG stall':>8} {'others':>6}"
    )
    for server, s in o.items():
        add(
            f"  {server:8} {s['target_rate']:7.0f} {s['rate']:8.0f} {bench_run._lat(s)} {s['errors']:6d} "
            f"{s.get('server_cpu', 0):7.2f} {s['loadgen_stall_ms_max']:8.1f} {s.get('other_cpu_max', 0):6.2f}"
        )
    add("")
    fs, fb = r["footprint"]["service"], r["footprint"]["baseline"]
    add(
        f"Footprint: service {fs['bytes_per_message']:.0f} B/message, baseline {fb['bytes_per_message']:.0f} B/message "
        f"(used_memory delta over {fs['messages']:,} messages of 100 characters in {fs['conversations']} conversations)"
    )
    add("  one conversation's keys (MEMORY USAGE):")
    for k in fs["one_conversation_keys"]:
        add(f"    {k['memory_usage']:8,} B  {k['type']:6} {k['encoding']:10} {k['key']}")
    add("")
    add("Answer sizes: " + ", ".join(f"{name} {size:,} B" for name, size in r["answer_bytes"].items()))
    add("")
    add("Targets")
    for t in r["targets"]:
        verdict = "note" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        add(f"  {verdict:4}  {t['target']}: {t['detail']}")
    return "\n".join(lines)


# Main -----------------------------------------------------------------------------------------------------


def failing_kinds(r: dict[str, Any]) -> list[str]:
    """The operations whose targets failed (the context also for its latency), for the profile."""
    out = [
        kind
        for kind, floor in RATIO_TARGETS.items()
        if floor is not None and r["peak"][kind]["ratio"]["median_of_paired"] < floor
    ]
    if "context" not in out and r["context_open_50"]["service"]["latency_ms"]["p99"] > P99_TARGET_MS:
        out.append("context")
    return out


def main() -> int:
    global RESULTS
    parser = bench_run.sized_parser(
        __doc__, quick="about 2 minutes", pin="servers on CPU 0, Redis and the load generator on the others"
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "transcripts.json", help="results file")
    parser.add_argument(
        "--profile",
        choices=[*KINDS, "failing", "none"],
        action="append",
        help="profile the service (py-spy) under these operations (default: those whose target failed)",
    )
    parser.add_argument(
        "--no-message-ids", action="store_true", help="append messages without message_id (default: with)"
    )
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loadgen:
        loadgen_main()
        return 0
    plan = QUICK if args.quick else SMOKE if args.smoke else FULL
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cpus) >= 2
    RESULTS = args.output.parent
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cm-transcripts-"))
    bench = Bench(
        plan=plan,
        work=work,
        key=secrets.token_urlsafe(32).encode(),
        server_cpus={cpus[0]} if pin else None,
        aux_cpus=set(cpus[1:]) if pin else None,
        message_ids=not args.no_message_ids,
    )
    r = bench.results
    r["mode"] = "quick" if args.quick else "smoke" if args.smoke else "full"
    r["machine"] = bench_run.machine_info()
    r["source"] = bench_run.source_state()
    r["pinning"] = (
        f"servers on CPU {cpus[0]}; Redis and the load generator on CPU {','.join(map(str, cpus[1:]))}"
        if pin
        else "none"
    )
    r["plan"] = plan.__dict__ | {
        "read_messages": READ_MESSAGES,
        "max_tokens": MAX_TOKENS,
        "message_ids": bench.message_ids,
    }
    r["persistence"] = 'redis-server --save "" --appendonly no'
    r["service_settings"] = "defaults, CALLER_MEMORY_SWEEP_INTERVAL=0; project: memory.conversation.enabled"
    began = time.monotonic()
    try:
        with bench_run.cleanup():
            footprint(bench)
            setup(bench)
            calibrate(bench)
            warm(bench)
            peaks(bench)
            open_context(bench)
            chosen = set(args.profile or ["failing"])
            kinds = [k for k in KINDS if k in chosen or ("failing" in chosen and k in failing_kinds(r))]
            if kinds and "none" not in chosen:
                profile(bench, kinds)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    bench_run.finish(r, args.output, began, targets, report)
    say(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
