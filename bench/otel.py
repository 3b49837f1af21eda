"""Benchmarks of tracing (issue 35): memory reads with the otel extra on and a 1% sampler against reads with it
off, side by side in one run, and with every span sampled, the CPU each span costs.

    .venv/bin/python bench/otel.py            # full run: 5 rounds of 5 s (about 3 minutes)
    .venv/bin/python bench/otel.py --quick    # about a minute: 3 rounds of 2 s
    .venv/bin/python bench/otel.py --smoke    # seconds: checks that everything runs (figures meaningless)

What runs, each in its own OS process (bench/README.md, "Tracing", has the details), with bench/run.py's
machinery (pinning, the load generator, interleaved rounds whose order alternates, paired ratios): three
``python -m caller_memory.service serve`` processes of this work tree (defaults, sweeps off), each on a private
redis-server of its own without persistence, prefilled with 1,000 callers of 10 fields (bench/run.py's layout):

- ``off``: no ``OTEL_*`` variable (the default: our code imports no OpenTelemetry module);
- ``sampled``: ``OTEL_TRACES_EXPORTER=otlp`` to a collector on loopback, ``OTEL_TRACES_SAMPLER=parentbased_
  traceidratio`` with ``OTEL_TRACES_SAMPLER_ARG=0.01`` (the load generator sends no ``traceparent``: each read
  is a root, 1% sampled);
- ``always``: the same with ``OTEL_TRACES_SAMPLER=always_on``: every span made and exported;
- ``control``: a second service without tracing, exactly as ``off``: its ratio to ``off`` (an A/A
  comparison) shows how far two identical processes differ on the machine as it is during the run;
- the collector: this script run as ``--collector``, an aiohttp server that parses each OTLP/HTTP export
  (protobuf) and counts its spans, on the auxiliary CPUs.

Measured: the peak (closed loop, 32 connections) of ``GET .../callers/{phone}/memory`` on each side, with the
ratios to ``off`` per round and their medians: of reads per second, and of reads per second of the service's
CPU (its CPU time over the run, /proc). The target (>= 0.95 for the 1% sampler) is judged on the second: on a
shared machine the first moves with whatever else runs (the A/A control shows by how much), while the CPU a
read costs is the service's own. From ``always`` - ``off``, the CPU per span in microseconds: the CPU per read
difference divided by the spans a read makes (counted by the collector over sequential reads: the request's
span and the store's); reported, no target. Results: bench/results/otel.json (or ``--output``) and a table with PASS/FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import run as bench_run
from common import PROJECT, caller_phone

from tests.support.redis_server import RedisServer

say = bench_run.say
RESULTS = h.BENCH / "results"
SIDES: tuple[str, ...] = ("off", "sampled", "always", "control")
#: ``--ablation``: tracing on with nothing sampled, which separates making the spans from exporting them.
ABLATION = "unsampled"
#: The 1% side's ratio to ``off`` (median of the paired rounds).
TARGET = 0.95
READ_CALLERS = 1000


@dataclass
class Plan:
    rounds: int
    warmup: float
    closed_s: float
    span_reads: int
    connections: int = 32


FULL = Plan(5, 1.0, 5.0, 200)
QUICK = Plan(3, 0.5, 2.0, 100)
SMOKE = Plan(1, 0.2, 0.5, 10)


@dataclass
class Bench:
    plan: Plan
    work: Path
    key: bytes
    server_cpus: set[int] | None
    aux_cpus: set[int] | None
    servers: dict[str, h.Server] = field(default_factory=dict)
    tokens: dict[str, str] = field(default_factory=dict)
    redis: dict[str, RedisServer] = field(default_factory=dict)
    collector: h.Server | None = None
    results: dict[str, Any] = field(default_factory=dict)

    def load(
        self, server: str, *, seconds: float | None = None, warmup: float | None = None
    ) -> dict[str, Any]:
        """One closed-loop run of reads (bench/loadgen.py, its own process, on the auxiliary CPUs)."""
        target = self.servers[server]
        watch = {"server": target.pid, "redis": self.redis[server].pid}
        spec = {
            "host": "127.0.0.1",
            "port": target.port,
            "mode": "closed",
            "rate": None,
            "connections": self.plan.connections,
            "warmup": self.plan.warmup if warmup is None else warmup,
            "duration": self.plan.closed_s if seconds is None else seconds,
            "scenario": {
                "type": "read",
                "callers": READ_CALLERS,
                "token": self.tokens[server],
                "project": PROJECT,
            },
            "watch": watch,
        }
        return h.run_loadgen(
            [sys.executable, str(h.BENCH / "loadgen.py")], spec, self.aux_cpus, server, "read"
        )


# The collector ------------------------------------------------------------------------------------------------


def collector_main(port: int) -> None:
    """An OTLP/HTTP collector: ``POST /v1/traces`` counted, ``GET /count`` the spans so far."""
    from aiohttp import web
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    counts = {"spans": 0, "exports": 0}

    async def traces(request: web.Request) -> web.Response:
        parsed = ExportTraceServiceRequest()
        parsed.ParseFromString(await request.read())
        counts["exports"] += 1
        counts["spans"] += sum(len(s.spans) for r in parsed.resource_spans for s in r.scope_spans)
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def count(request: web.Request) -> web.Response:
        return web.json_response(counts)

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", traces)
    app.router.add_get("/count", count)
    app.router.add_get("/healthz", count)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def start_collector(bench: Bench) -> None:
    port = h.free_port()
    log = bench.work / "collector.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--collector", str(port)]
    proc = h.spawn(cmd, log=log, cpus=bench.aux_cpus)
    h.wait_http(f"http://127.0.0.1:{port}/healthz", proc, log, 30.0)
    bench.collector = h.Server("collector", proc, port, log)


def collected(bench: Bench) -> int:
    assert bench.collector is not None
    with urllib.request.urlopen(f"{bench.collector.url}/count", timeout=5) as reply:
        spans: int = json.loads(reply.read())["spans"]
        return spans


# Set-up -------------------------------------------------------------------------------------------------------


def side_env(bench: Bench, side: str) -> dict[str, str]:
    if side in ("off", "control"):
        return {}
    assert bench.collector is not None
    sampler = {"OTEL_TRACES_SAMPLER": "always_on"}
    if side == "unsampled":
        sampler = {"OTEL_TRACES_SAMPLER": "always_off"}
    if side == "sampled":
        sampler = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
    # A short batch delay, so that the span count of the sequential reads is read soon after them.
    return {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": bench.collector.url,
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        **sampler,
    }


def setup(bench: Bench) -> None:
    start_collector(bench)
    clean = {k: v for k, v in os.environ.items() if k.startswith("OTEL_")}
    for name in clean:  # the runner's own OTEL_* settings would reach every side
        os.environ.pop(name)
    subjects = h.subjects(bench.key, READ_CALLERS)
    for side in SIDES:
        # A redis-server of its own for each side: services that share one were seen to differ by 30% in
        # an A/A run (two sides without tracing), by the order they were started in.
        redis = bench.redis[side] = h.start_redis(cpus=bench.aux_cpus)
        h.fill_redis(redis, subjects, int(time.time() * 1000))
        server = bench.servers[side] = h.start_service(
            side, redis.url, bench.work, bench.key, bench.server_cpus, **side_env(bench, side)
        )
        bench.tokens[side] = h.create_project(server)


def read(bench: Bench, side: str, index: int) -> None:
    server = bench.servers[side]
    path = f"/v1/projects/{PROJECT}/callers/{quote(caller_phone(index), safe='')}/memory"
    status, body = h.http("GET", server.url + path, bench.tokens[side])
    if status != 200 or len(body["fields"]) != 10:
        raise RuntimeError(f"{side}: a read answered {status}")


def spans_per_read(bench: Bench) -> None:
    """The spans one read makes on ``always``, counted by the collector over sequential reads."""
    say(f"spans per read: {bench.plan.span_reads} reads one at a time on 'always'")
    before = collected(bench)
    for i in range(bench.plan.span_reads):
        read(bench, "always", i)
    deadline = time.monotonic() + 10
    seen = collected(bench) - before
    while seen < 2 * bench.plan.span_reads and time.monotonic() < deadline:
        time.sleep(0.1)
        seen = collected(bench) - before
    time.sleep(0.5)  # anything later of the same reads
    seen = collected(bench) - before
    bench.results["spans_per_read"] = seen / bench.plan.span_reads
    say(f"  {seen} spans for {bench.plan.span_reads} reads")


def peaks(bench: Bench) -> None:
    say("warm-up: every side (not recorded)")
    for side in SIDES:
        bench.load(side, seconds=bench.plan.closed_s / 2, warmup=0.3)
    say(f"memory reads, closed loop, {bench.plan.rounds} interleaved rounds (order alternating)")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_ in range(bench.plan.rounds):
        for side in SIDES if round_ % 2 == 0 else tuple(reversed(SIDES)):
            result = bench.load(side)
            runs[side].append(result)
            say(
                f"  round {round_ + 1}/{bench.plan.rounds} {side:8} {result['achieved_rate']:7.0f} req/s"
                f"  p50 {result['latency_ms']['p50']:6.2f} ms  server CPU {result['watched_cpu_share'].get('server', 0):.2f}"
                f"  errors {result['errors']}"
            )
    out: dict[str, Any] = {side: bench_run.summarise(r) | {"all": r} for side, r in runs.items()}
    for side in SIDES[1:]:
        out[f"ratio_{side}_over_off"] = bench_run.paired_ratio(runs[side], runs["off"])
        out[f"ratio_{side}_over_off_per_cpu"] = bench_run.paired_ratio(
            runs[side], runs["off"], key="requests_per_server_cpu_s"
        )
    # CPU per read on each side (us), and per span from always - off.
    per_read = {
        side: 1e6 / out[side]["requests_per_server_cpu_s"]
        for side in SIDES
        if out[side].get("requests_per_server_cpu_s")
    }
    out["cpu_us_per_read"] = per_read
    spans = bench.results.get("spans_per_read") or float("nan")
    if "always" in per_read and "off" in per_read:
        out["cpu_us_per_span"] = (per_read["always"] - per_read["off"]) / spans
    bench.results["read_peak"] = out


# Report -------------------------------------------------------------------------------------------------------


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    peak = r["read_peak"]
    per_cpu = peak["ratio_sampled_over_off_per_cpu"]["median_of_paired"]
    rate = peak["ratio_sampled_over_off"]["median_of_paired"]
    control = peak["ratio_control_over_off"]["median_of_paired"]
    return [
        {
            "name": "reads per server CPU-second, 1% sampler / off (median of paired rounds)",
            "value": round(per_cpu, 3),
            "target": f">= {TARGET}",
            "pass": per_cpu >= TARGET,
        },
        {
            "name": "reads per second, 1% sampler / off (median of paired rounds; A/A control/off "
            f"{control:.3f} shows the machine's noise)",
            "value": round(rate, 3),
            "target": f">= {TARGET}",
            "pass": rate >= TARGET,
        },
        {
            "name": "CPU per span, always-on sampler (us; reported, no target)",
            "value": round(r["read_peak"].get("cpu_us_per_span", float("nan")), 1),
            "target": "-",
            "pass": None,
        },
    ]


def report(r: dict[str, Any]) -> str:
    peak = r["read_peak"]
    lines = ["", "Memory reads, closed loop (medians of the rounds)", ""]
    lines.append(f"{'side':10} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'CPU us/read':>12} {'errors':>7}")
    for side in SIDES:
        s = peak[side]
        cpu = peak["cpu_us_per_read"].get(side, float("nan"))
        lines.append(
            f"{side:10} {s['rate']:8.0f} {s['latency_ms']['p50']:7.2f} {s['latency_ms']['p99']:7.2f} {cpu:12.1f} {s['errors']:7d}"
        )
    for side in SIDES[1:]:
        for suffix, what in (("", "reads/s"), ("_per_cpu", "reads per CPU-s")):
            ratio = peak[f"ratio_{side}_over_off{suffix}"]
            lines.append(
                f"{side}/off, {what}: median {ratio['median_of_paired']:.3f}, per round {ratio['per_round']}"
            )
    lines.append(f"spans per read (always): {r.get('spans_per_read', float('nan')):.2f}")
    lines += ["", "Targets"]
    for t in r["targets"]:
        verdict = "-" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        lines.append(f"  {verdict:4}  {t['name']}: {t['value']} (target {t['target']})")
    return "\n".join(lines)


def main() -> int:
    global RESULTS, SIDES
    parser = bench_run.sized_parser(
        __doc__,
        quick="about a minute",
        pin="services on CPU 0; Redis, the collector and the load generator on the others",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "otel.json", help="results file")
    parser.add_argument("--collector", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--ablation", action="store_true", help="add a side with tracing on and nothing sampled (always_off)"
    )
    args = parser.parse_args()
    if args.collector:
        collector_main(args.collector)
        return 0
    plan = QUICK if args.quick else SMOKE if args.smoke else FULL
    if args.ablation:
        SIDES = (*SIDES, ABLATION)
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cpus) >= 2
    RESULTS = args.output.parent
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cm-otel-"))
    bench = Bench(
        plan=plan,
        work=work,
        key=secrets.token_urlsafe(32).encode(),
        server_cpus={cpus[0]} if pin else None,
        aux_cpus=set(cpus[1:]) if pin else None,
    )
    r = bench.results
    r["mode"] = "quick" if args.quick else "smoke" if args.smoke else "full"
    r["machine"] = bench_run.machine_info()
    r["source"] = bench_run.source_state()
    r["pinning"] = (
        f"services on CPU {cpus[0]}; Redis, the collector and the load generator on CPU {','.join(map(str, cpus[1:]))}"
        if pin
        else "none"
    )
    r["plan"] = plan.__dict__ | {"read_callers": READ_CALLERS}
    r["sides"] = {side: side_env(bench, side) if side == "off" else "see bench/README.md" for side in SIDES}
    began = time.monotonic()
    try:
        with bench_run.cleanup():
            setup(bench)
            r["sides"] = {side: side_env(bench, side) for side in SIDES}
            spans_per_read(bench)
            peaks(bench)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    bench_run.finish(r, args.output, began, targets, report)
    say(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
