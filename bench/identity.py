"""Benchmarks of linked identifiers and caller-ID trust (issue 17): memory reads, side by side in one run.

    .venv/bin/python bench/identity.py            # full run: 5 rounds of 5 s, 3 open-loop runs of 10 s (about 6 minutes)
    .venv/bin/python bench/identity.py --quick    # about 2 minutes: 3 rounds of 2 s, 2 open-loop runs of 3 s
    .venv/bin/python bench/identity.py --smoke    # seconds: checks that everything runs (figures meaningless)

What runs, each in its own OS process (bench/README.md, "Linked identifiers and trust", has the details), with
bench/run.py's machinery (pinning, the load generator, interleaved rounds whose order alternates, paired
ratios): ONE ``python -m caller_memory.service serve`` (defaults, sweeps off) on a private redis-server
without persistence, holding three projects whose callers were written through the HTTP API (PATCH as admin,
and in the linking project one ``POST .../links`` per caller, as admin: real links made by the service). The
sides are reads of that one process:

- ``today``: ``GET .../callers/{phone}/memory`` in a project with neither identity linking nor trust classes;
- ``first``: the same by the phone (the profile id) in a project with ``identity_linking`` on, where every
  caller also has an email linked;
- ``linked``: the same profiles read through their linked email;
- ``trust``: by phone in a project with ``field_classes`` (2 of the 10 state keys ``sensitive``, needing
  ``step_up``), read with ``?attestation=TN-Validation-Passed-C``: the two sensitive fields are withheld;
- ``trust-passed`` (an ablation, no target): the same project read with ``&step_up=true`` too, so nothing is
  withheld: separates the trust check from the smaller answer.

Measured: each side's peak (closed loop), in interleaved rounds, with each side's ratio to ``today`` per round
and its median (targets: first >= 0.9x, linked >= 0.6x, trust >= 0.9x); each side's latency in open loop at
50% of today's peak; and the Redis round trips and commands of one read of each side, counted on the
redis-server (INFO stats ``total_reads_processed`` and ``commandstats``) over a counted number of reads sent
one at a time, less what the idle service does in as long. Results: bench/results/identity.json (or
``--output``) and a table with the targets' PASS/FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness as h
import profiling
import run as bench_run
import transcripts
from common import FIELDS, caller_phone, quote_phone

from tests.support.redis_server import RedisServer

RESULTS = h.BENCH / "results"
SIDES = ("today", "first", "linked", "trust", "trust-passed")
#: The project each side reads, by what it is configured with.
PROJECTS = {"plain": "bench", "linking": "bench-linked", "trust": "bench-trust"}
SIDE_PROJECT = {
    "today": "plain",
    "first": "linking",
    "linked": "linking",
    "trust": "trust",
    "trust-passed": "trust",
}
LABELS = {
    "today": "by phone, neither linking nor trust (today's read)",
    "first": "by the profile's first identifier (phone), linking on",
    "linked": "through the profile's linked email",
    "trust": "by phone, trust classes on, attestation C (2 fields withheld)",
    "trust-passed": "by phone, trust classes on, attestation C + step_up (nothing withheld)",
}
#: Fields each caller holds (of the 10 state keys), 32 bytes of JSON each as in bench/run.py.
STORED = FIELDS[:5]
VALUE = "x" * 30
#: The two state keys of the trust project's ``sensitive`` class (both among the stored ones).
SENSITIVE = ["field_3", "field_4"]
ATTESTATION = "TN-Validation-Passed-C"
#: Throughput targets, side / today (median of paired rounds); None: reported only.
TARGETS: dict[str, float | None] = {"first": 0.9, "linked": 0.6, "trust": 0.9, "trust-passed": None}

say = bench_run.say


def email(index: int) -> str:
    """The email linked to caller ``index`` of the linking project (as an identifier: ``email:`` prefix)."""
    return f"email:caller.{index}@example.com"


def project_config(kind: str) -> dict[str, Any]:
    """The three projects: state keys field_0..field_9, 30 days, analytics on; linking or trust on top."""
    rc: dict[str, Any] = {"analytics_enabled": True, "state_keys": FIELDS, "retention": "P30D"}
    if kind == "linking":
        rc["identity_linking"] = True
    if kind == "trust":
        rc["field_classes"] = {name: "sensitive" for name in SENSITIVE}
        rc["trust"] = {"sensitive": "step_up"}
    return {"memory": {"repeat_caller": rc}}


# The benchmark --------------------------------------------------------------------------------------------


@dataclass
class Plan:
    rounds: int
    warmup: float
    closed_s: float
    open_runs: int
    open_s: float
    #: Callers per project (each read scenario cycles through all of them).
    callers: int
    #: Reads of each side sent one at a time while Redis's counters are watched, and the idle window before.
    counted_reads: int
    idle_s: float
    profile_s: float = 10.0
    connections: int = 32
    open_connections: int = 64


FULL = Plan(5, 1.0, 5.0, 3, 10.0, 5000, 2000, 5.0)
QUICK = Plan(3, 0.5, 2.0, 2, 3.0, 2000, 1000, 3.0)
SMOKE = Plan(1, 0.2, 0.5, 1, 0.5, 20, 20, 0.3)


@dataclass
class Bench:
    plan: Plan
    work: Path
    key: bytes
    server_cpus: set[int] | None
    aux_cpus: set[int] | None
    servers: dict[str, h.Server] = field(default_factory=dict)
    redis: RedisServer | None = None
    agents: dict[str, str] = field(default_factory=dict)
    admins: dict[str, str] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)

    def paths(self, side: str) -> list[str]:
        """The read paths of ``side``, one per caller (the SDK's quoting: ``quote(..., safe="")``)."""
        base = f"/v1/projects/{PROJECTS[SIDE_PROJECT[side]]}/callers/"
        if side == "linked":
            return [f"{base}{quote(email(i), safe='')}/memory" for i in range(self.plan.callers)]
        query = {
            "trust": f"?attestation={ATTESTATION}",
            "trust-passed": f"?attestation={ATTESTATION}&step_up=true",
        }
        tail = query.get(side, "")
        return [f"{base}{quote_phone(caller_phone(i))}/memory{tail}" for i in range(self.plan.callers)]

    def load(
        self,
        side: str,
        kind: str = "read",
        *,
        mode: str = "closed",
        seconds: float | None = None,
        rate: float | None = None,
        warmup: float | None = None,
    ) -> dict[str, Any]:
        """One load-generator run (its own process, on the auxiliary CPUs): ``side``'s reads of the service,
        or ``static`` (the load generator's own capacity)."""
        static = side == "static"
        target = self.servers["static" if static else "service"]
        watch = {"server": target.pid}
        if self.redis is not None and not static:
            watch["redis"] = self.redis.pid
        scenario: dict[str, Any] = (
            {"type": "static"}
            if static
            else {
                "type": "get",
                "kind": kind,
                "paths": self.paths(side),
                "token": self.agents[SIDE_PROJECT[side]],
            }
        )
        spec = {
            "host": "127.0.0.1",
            "port": target.port,
            "mode": mode,
            "rate": rate,
            "connections": self.plan.open_connections if mode == "open" else self.plan.connections,
            "warmup": self.plan.warmup if warmup is None else warmup,
            "duration": self.plan.closed_s if seconds is None else seconds,
            "scenario": scenario,
            "watch": watch,
        }
        command = [sys.executable, str(Path(__file__).resolve()), "--loadgen"]
        return h.run_loadgen(command, spec, self.aux_cpus, side, kind)


# Set-up ---------------------------------------------------------------------------------------------------


def setup(bench: Bench) -> None:
    store = bench.redis = h.start_redis(cpus=bench.aux_cpus)
    svc = bench.servers["service"] = h.start_service(
        "service", store.url, bench.work, bench.key, bench.server_cpus
    )
    for kind, project in PROJECTS.items():
        status, body = h.http(
            "PUT", f"{svc.url}/v1/projects/{project}", h.OPERATOR_TOKEN, project_config(kind)
        )
        if status not in (200, 201):
            raise RuntimeError(f"creating project {project} failed: {status} {body}")
        for role, into in (("agent", bench.agents), ("admin", bench.admins)):
            url = f"{svc.url}/v1/projects/{project}/tokens"
            status, body = h.http("POST", url, h.OPERATOR_TOKEN, {"role": role})
            if status != 201:
                raise RuntimeError(f"minting a token for {project} failed: {status} {body}")
            into[kind] = body["token"]
    bench.servers["static"] = h.start_static(bench.work, bench.server_cpus)
    prefill(bench)
    check_answers(bench)


def prefill(bench: Bench) -> None:
    """Every caller of every project gets STORED fields by PATCH (admin); in the linking project each is then
    linked to an email by ``POST .../links`` (admin): the service makes every link."""
    svc, n = bench.servers["service"], bench.plan.callers
    say(
        f"prefill through the API: {n:,} callers x {len(STORED)} fields in each of {len(PROJECTS)} projects, {n:,} links"
    )
    document = {name: VALUE for name in STORED}

    def patch(job: tuple[str, int]) -> None:
        kind, i = job
        path = f"{svc.url}/v1/projects/{PROJECTS[kind]}/callers/{quote_phone(caller_phone(i))}/memory"
        status, body = h.http("PATCH", path, bench.admins[kind], document)
        if status != 200:
            raise RuntimeError(f"writing caller {i} of {kind} failed: {status} {body}")

    def link(i: int) -> None:
        path = f"{svc.url}/v1/projects/{PROJECTS['linking']}/callers/{quote_phone(caller_phone(i))}/links"
        status, body = h.http("POST", path, bench.admins["linking"], {"identifier": email(i), "merge": False})
        if status != 201 or not body.get("created"):
            raise RuntimeError(f"linking caller {i}'s email failed: {status} {body}")

    began = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(patch, [(kind, i) for kind in PROJECTS for i in range(n)]))
        patched = time.monotonic()
        list(pool.map(link, range(n)))
    done = time.monotonic()
    assert bench.redis is not None
    client = bench.redis.client()
    try:
        stored_keys = int(client.dbsize())
    finally:
        client.close()
    bench.results["prefill"] = {
        "callers_per_project": n,
        "fields_per_caller": len(STORED),
        "patches": n * len(PROJECTS),
        "patch_s": round(patched - began, 2),
        "links": n,
        "link_s": round(done - patched, 2),
        "redis_keys": stored_keys,
    }
    say(f"  {n * len(PROJECTS):,} patches in {patched - began:.1f} s, {n:,} links in {done - patched:.1f} s")


def check_answers(bench: Bench) -> None:
    """Before anything is measured: every side answers 200 with the fields it should (the linked email the
    same fields as the phone, the trust read without the sensitive ones and saying so), and the links are
    the service's own (listed by it). The answers' sizes are recorded."""
    svc = bench.servers["service"]
    sizes: dict[str, int] = {}
    answers: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        for i in {0, bench.plan.callers - 1}:
            status, raw = transcripts.raw_get(
                svc.url + bench.paths(side)[i], bench.agents[SIDE_PROJECT[side]]
            )
            if status != 200:
                raise RuntimeError(f"{side}: the read of caller {i} answered {status}: {raw[:500]!r}")
            body = json.loads(raw)
            expected = [n for n in STORED if n not in SENSITIVE] if side == "trust" else STORED
            withheld = SENSITIVE if side == "trust" else []
            if sorted(body["fields"]) != expected or sorted(body["withheld"]) != withheld:
                raise RuntimeError(
                    f"{side}: caller {i} read {sorted(body['fields'])}, withheld {body['withheld']}"
                )
            if side.startswith("trust") and body["attestation"] != "C":
                raise RuntimeError(f"{side}: the attestation was read as {body['attestation']!r}")
            answers[side], sizes[side] = body, len(raw)
    if answers["linked"]["fields"] != answers["first"]["fields"]:
        raise RuntimeError("the linked email does not read the profile's fields")
    url = f"{svc.url}/v1/projects/{PROJECTS['linking']}/callers/{quote_phone(caller_phone(0))}/links"
    status, body = h.http("GET", url, bench.admins["linking"])
    links = body.get("links", []) if status == 200 else []
    if len(links) != 1 or links[0]["kind"] != "email" or links[0]["merging"]:
        raise RuntimeError(f"caller 0's links are not one email link: {status} {body}")
    bench.results["answer_bytes"] = sizes


# Round trips ----------------------------------------------------------------------------------------------


def counters(client: Any) -> dict[str, Any]:
    """The redis-server's counters: read events (``total_reads_processed``: one per batch of commands a
    client's socket delivered, i.e. per round trip of a client that waits for its answers), commands, and
    calls of each command."""
    stats, calls = client.info("stats"), client.info("commandstats")
    return {
        "reads": int(stats["total_reads_processed"]),
        "commands": int(stats["total_commands_processed"]),
        "by_command": {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in calls.items()},
        "t": time.monotonic(),
    }


def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    names = sorted(set(a["by_command"]) | set(b["by_command"]))
    by = {n: b["by_command"].get(n, 0) - a["by_command"].get(n, 0) for n in names}
    return {
        "reads": b["reads"] - a["reads"],
        "commands": b["commands"] - a["commands"],
        "by_command": {n: c for n, c in by.items() if c},
        "seconds": b["t"] - a["t"],
    }


def less(busy: dict[str, Any], overhead: dict[str, Any], rate: dict[str, Any], what: str) -> float:
    """A counter of a busy window less the counter reads' own share and the idle service's in as long."""

    def pick(d: dict[str, Any]) -> float:
        return float(d[what] if what in ("reads", "commands") else d["by_command"].get(what, 0))

    return pick(busy) - pick(overhead) - pick(rate) * float(busy["seconds"])


def round_trips(bench: Bench) -> None:
    """Each side's reads sent one at a time (one keep-alive connection, each request once the previous answer
    is in, so that no two reads share a round trip to Redis), with the redis-server's counters read around
    them. Taken off: what reading the counters costs (two readings back to back) and what the idle service
    does in as long (its webhook and inactivity workers poll), measured over ``idle_s`` first. Only the
    service and this function talk to that redis-server."""
    assert bench.redis is not None
    svc, n = bench.servers["service"], bench.plan.counted_reads
    say(f"round trips to Redis: {n:,} reads of each side, one at a time")
    out: dict[str, Any] = {}
    client = bench.redis.client()
    conn = http.client.HTTPConnection("127.0.0.1", svc.port, timeout=10)
    try:
        overhead = delta(counters(client), counters(client))
        began = counters(client)
        time.sleep(bench.plan.idle_s)
        idle = delta(began, counters(client))
        span = idle["seconds"]
        rate = {
            "reads": (idle["reads"] - overhead["reads"]) / span,
            "commands": (idle["commands"] - overhead["commands"]) / span,
            "by_command": {
                c: (k - overhead["by_command"].get(c, 0)) / span for c, k in idle["by_command"].items()
            },
        }
        out["_idle"] = {"seconds": round(span, 2), "per_second": rate, "counter_reads_cost": overhead}
        for side in SIDES:
            paths = bench.paths(side)
            headers = {"Authorization": f"Bearer {bench.agents[SIDE_PROJECT[side]]}"}
            before = counters(client)
            statuses: dict[str, int] = {}
            for k in range(n):
                conn.request("GET", paths[k % len(paths)], headers=headers)
                resp = conn.getresponse()
                resp.read()
                statuses[str(resp.status)] = statuses.get(str(resp.status), 0) + 1
            busy = delta(before, counters(client))
            per_command = {c: round(less(busy, overhead, rate, c) / n, 2) for c in busy["by_command"]}
            out[side] = {
                "reads_sent": n,
                "statuses": statuses,
                "round_trips_per_read": round(less(busy, overhead, rate, "reads") / n, 2),
                "commands_per_read": round(less(busy, overhead, rate, "commands") / n, 2),
                "per_command": {c: k for c, k in per_command.items() if k},
                "window": busy,
            }
            say(
                f"  {side:12} {out[side]['round_trips_per_read']:.2f} round trips, "
                f"{out[side]['commands_per_read']:.2f} commands per read {out[side]['per_command']}"
            )
    finally:
        conn.close()
        client.close()
    bench.results["round_trips"] = out


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
    say("warm-up: every side (not recorded)")
    for side in SIDES:
        bench.load(side, seconds=bench.plan.closed_s / 2, warmup=0.3)


def peaks(bench: Bench) -> None:
    say(f"peak reads, closed loop, {bench.plan.rounds} interleaved rounds (order alternating)")
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    for round_ in range(bench.plan.rounds):
        for side in SIDES if round_ % 2 == 0 else tuple(reversed(SIDES)):
            result = bench.load(side)
            runs[side].append(result)
            say(
                f"  round {round_ + 1}/{bench.plan.rounds} {side:12} {result['achieved_rate']:7.0f} req/s"
                f"  p50 {result['latency_ms']['p50']:6.2f} ms  server CPU {result['watched_cpu_share'].get('server', 0):.2f}"
                f"  others {result.get('other_processes_cpu') or 0:.2f}  errors {result['errors']} {result['statuses']}"
            )
    out: dict[str, Any] = {side: bench_run.summarise(r) | {"all": r} for side, r in runs.items()}
    for side in SIDES[1:]:
        out[f"ratio_{side}"] = bench_run.paired_ratio(runs[side], runs["today"])
        out[f"ratio_{side}_per_cpu"] = bench_run.paired_ratio(
            runs[side], runs["today"], key="requests_per_server_cpu_s"
        )
    bench.results["peak"] = out


def open_loop(bench: Bench) -> None:
    rate = max(1, round(bench.results["peak"]["today"]["rate"] * 0.5))
    say(f"open-loop reads at 50% of today's peak: {rate} req/s, every side, alternating")
    runs = bench_run.open_runs(bench, list(SIDES), "read", rate)
    out = {side: bench_run.summarise(r) | {"all": r} for side, r in runs.items()}
    for side, side_runs in runs.items():
        quiet = [r for r in side_runs if (r.get("other_processes_cpu") or 0.0) < bench_run.QUIET_OTHER_CPU]
        out[side]["quiet_runs"] = bench_run.summarise(quiet) if quiet else None
    bench.results["open_50"] = out


# Profile --------------------------------------------------------------------------------------------------


def profile(bench: Bench, sides: list[str]) -> None:
    """py-spy (200 Hz) of the service under each of ``sides``' closed-loop reads, one after the other:
    bench/results/identity-profile-<side>.txt (bench/profiling.py's layers and functions)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        bench.results["profile"] = {"skipped": "py-spy is not installed (bench/requirements.txt)"}
        return
    bench.results["profile"] = {}
    seconds = bench.plan.profile_s
    for side in sides:
        output = RESULTS / f"identity-profile-{side}.collapsed.txt"
        say(f"py-spy record of the service under closed-loop reads of {side}, {seconds:.0f} s")
        cmd = [spy, "record", "--pid", str(bench.servers["service"].pid), "--rate", "200", "--format", "raw"]
        proc = subprocess.Popen(
            [*cmd, "--duration", str(int(seconds)), "--output", str(output)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        try:
            result = bench.load(side, seconds=seconds + 1, warmup=0.5)
            _, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(10)
        if proc.returncode != 0:
            raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
        analysis = profiling.analyse(output.read_text())
        cpu = result["watched_cpu_share"].get("server", 0.0)
        header = (
            f"Profile of the service: memory reads {LABELS[side]} ({side}), closed loop "
            f"({bench.plan.connections} connections), py-spy record --rate 200, {seconds:.0f} s; "
            f"{result['achieved_rate']:.0f} req/s while profiled, server CPU {cpu:.2f}.\n"
            f"Produced by bench/identity.py --profile {side}; collapsed stacks: {output.name}."
        )
        (RESULTS / f"identity-profile-{side}.txt").write_text(profiling.render(analysis, header) + "\n")
        bench.results["profile"][side] = {"rate_while_profiled": result["achieved_rate"], "server_cpu": cpu}


# Targets and report ---------------------------------------------------------------------------------------


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    p, trips = r["peak"], r["round_trips"]
    for side, floor in TARGETS.items():
        ratio = p[f"ratio_{side}"]
        median = ratio["median_of_paired"]
        detail = (
            f"{p[side]['rate']:.0f} vs {p['today']['rate']:.0f} req/s: {median:.2f}x (median of paired rounds "
            f"{ratio['per_round']}; per server CPU-second {p[f'ratio_{side}_per_cpu']['median_of_paired']:.2f}x); "
            f"{trips[side]['round_trips_per_read']:.2f} round trips and {trips[side]['commands_per_read']:.2f} Redis "
            f"commands per read (today's: {trips['today']['round_trips_per_read']:.2f} and "
            f"{trips['today']['commands_per_read']:.2f}; counted over {trips[side]['reads_sent']:,} reads)"
        )
        errors = p[side]["errors"] + p["today"]["errors"]
        if errors:
            detail += f"; {errors} errors"
        name = f"read {LABELS[side]}"
        if floor is None:
            out.append({"target": f"{name}: / today (an ablation)", "pass": None, "detail": detail})
        else:
            out.append(
                {
                    "target": f"{name}: >= {floor}x today",
                    "pass": median >= floor and not errors,
                    "detail": detail,
                }
            )
    o = r["open_50"]
    out.append(
        {
            "target": "open loop at 50% of today's peak: p50 / p99 per side (no target)",
            "pass": None if all(s["errors"] == 0 for s in o.values()) else False,
            "detail": "; ".join(
                f"{side} {s['latency_ms']['p50']:.2f} / {s['latency_ms']['p99']:.2f} ms ({s['errors']} errors)"
                for side, s in o.items()
            )
            + f" at {o['today']['target_rate']:.0f} req/s, median of {o['today']['runs']} runs",
        }
    )
    return out


def report(r: dict[str, Any]) -> str:
    lines: list[str] = []
    add = lines.append
    m, src = r["machine"], r["source"]
    add("")
    add(
        f"Linked identifiers and trust ({r['mode']} run), {m['cpus']} CPUs ({m['cpu']}), pinning: {r['pinning']}, "
        f"load average at start {m['loadavg_start']}, at end {m.get('loadavg_end')}"
    )
    add(
        f"Code measured: commit {src['commit'][:12]}"
        + (
            f" with uncommitted changes to {len(src['uncommitted'])} files"
            if src["uncommitted"]
            else " (clean)"
        )
        + f", service/+sdk/ sha256 {src['source_sha256'][:12]}"
        + (" (changed during the run)" if src.get("changed_during_run") else "")
    )
    cap, pre = r["loadgen_capacity"], r["prefill"]
    add(
        f"Load generator: {cap['rate']:.0f} req/s against a static server ({cap['loop']}, CPU {cap['loadgen_cpu'] or 0:.2f})"
    )
    add(
        f"Data: {pre['callers_per_project']:,} callers x {pre['fields_per_caller']} fields per project, written by "
        f"{pre['patches']:,} PATCHes ({pre['patch_s']} s); {pre['links']:,} email links made by POST .../links ({pre['link_s']} s)"
    )
    add("")
    plan = r["plan"]
    add(
        f"Memory reads, peak (closed loop, {plan['connections']} connections; medians of {plan['rounds']} interleaved rounds)"
    )
    add(
        f"  {'side':12} {'req/s':>7} {'min-max':>13} {'srv CPU':>7} {'us/read':>7} {'redis':>5} {'LG':>5} {'others':>6} "
        f"{'p50 ms':>7} {'p99 ms':>7} {'errors':>6} {'RT/read':>7} {'cmd/read':>8} {'bytes':>5}  / today"
    )
    p, trips = r["peak"], r["round_trips"]
    for side in SIDES:
        s = p[side]
        per_cpu = s.get("requests_per_server_cpu_s")
        ratio = p.get(f"ratio_{side}")
        add(
            f"  {side:12} {s['rate']:7.0f} {min(s['rates']):6.0f}-{max(s['rates']):<6.0f} {s.get('server_cpu', 0):7.2f} "
            f"{1e6 / per_cpu if per_cpu else 0:7.0f} {s.get('redis_cpu', 0):5.2f} {s.get('loadgen_cpu', 0):5.2f} "
            f"{s.get('other_cpu', 0):6.2f} {s['latency_ms']['p50']:7.2f} {s['latency_ms']['p99']:7.2f} {s['errors']:6d} "
            f"{trips[side]['round_trips_per_read']:7.2f} {trips[side]['commands_per_read']:8.2f} {r['answer_bytes'][side]:5d}"
            + (f"  {ratio['median_of_paired']:.2f}x {ratio['per_round']}" if ratio else "")
        )
    add("")
    o = r["open_50"]
    add("Memory reads, open loop at 50% of today's peak (latency from the scheduled send; medians of runs)")
    add(
        f"  {'side':12} {'target':>7} {'achieved':>8} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'errors':>6} "
        f"{'srv CPU':>7} {'LG stall':>8} {'others':>6}"
    )
    for side, s in o.items():
        add(
            f"  {side:12} {s['target_rate']:7.0f} {s['rate']:8.0f} {bench_run._lat(s)} {s['errors']:6d} "
            f"{s.get('server_cpu', 0):7.2f} {s['loadgen_stall_ms_max']:8.1f} {s.get('other_cpu_max', 0):6.2f}"
        )
    add("")
    add(
        f"Redis per read (counted over {plan['counted_reads']:,} reads of each side sent one at a time, idle window taken off)"
    )
    for side in SIDES:
        t = trips[side]
        add(
            f"  {side:12} {t['round_trips_per_read']:.2f} round trips, {t['commands_per_read']:.2f} commands: {t['per_command']}"
        )
    add("")
    add("Targets")
    for t in r["targets"]:
        verdict = "note" if t["pass"] is None else "PASS" if t["pass"] else "FAIL"
        add(f"  {verdict:4}  {t['target']}: {t['detail']}")
    return "\n".join(lines)


# Main -----------------------------------------------------------------------------------------------------


def main() -> int:
    global RESULTS
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer and shorter runs (about 2 minutes)")
    size.add_argument(
        "--smoke", action="store_true", help="a tiny run that checks the script (figures meaningless)"
    )
    parser.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the service on CPU 0, Redis and the load generator on the others (default: on with 2+ CPUs)",
    )
    parser.add_argument("--output", type=Path, default=RESULTS / "identity.json", help="results file")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the peaks (default: the plan's)")
    parser.add_argument(
        "--profile",
        choices=SIDES,
        action="append",
        default=[],
        help="also profile the service (py-spy) under this side's reads (repeatable; default: none)",
    )
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loadgen:
        transcripts.loadgen_main()  # bench/loadgen.py's run with a scenario of paths read in turn
        return 0
    plan = QUICK if args.quick else SMOKE if args.smoke else FULL
    if args.rounds:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    cpus = sorted(os.sched_getaffinity(0))
    pin = args.pin if args.pin is not None else len(cpus) >= 2
    RESULTS = args.output.parent
    RESULTS.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="cm-identity-"))
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
        f"the service on CPU {cpus[0]}; Redis and the load generator on CPU {','.join(map(str, cpus[1:]))}"
        if pin
        else "none"
    )
    r["plan"] = plan.__dict__ | {
        "sides": {side: LABELS[side] for side in SIDES},
        "projects": {kind: {"id": PROJECTS[kind], "config": project_config(kind)} for kind in PROJECTS},
        "stored_fields": STORED,
        "attestation": ATTESTATION,
    }
    r["persistence"] = 'redis-server --save "" --appendonly no'
    r["service_settings"] = "defaults, CALLER_MEMORY_SWEEP_INTERVAL=0; one process serving every side"
    began = time.monotonic()
    try:
        with bench_run.cleanup():
            setup(bench)
            round_trips(bench)
            calibrate(bench)
            warm(bench)
            peaks(bench)
            open_loop(bench)
            if args.profile:
                profile(bench, args.profile)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    bench_run.finish(r, args.output, began, targets, report)
    say(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
