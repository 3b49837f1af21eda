"""Benchmarks of linked identifiers and caller-ID trust (issue 17): memory reads, side by side in one run.

    .venv/bin/python bench/identity.py            # full run: 5 rounds of 5 s, 3 open-loop runs of 10 s (about 8 minutes)
    .venv/bin/python bench/identity.py --quick    # about 2 minutes: 3 rounds of 2 s, 2 open-loop runs of 3 s
    .venv/bin/python bench/identity.py --smoke    # seconds: checks that everything runs (figures meaningless)

What runs, each in its own OS process (bench/README.md, "Linked identifiers and trust", has the details), with
bench/run.py's machinery (pinning, the load generator, interleaved rounds whose order alternates, paired
ratios): ONE ``python -m caller_memory.service serve`` of this work tree (defaults, sweeps off) on a private
redis-server without persistence, holding three projects whose callers were written through the HTTP API
(PATCH as admin, and in the linking project one ``POST .../links`` per caller, as admin: real links made by
the service); and, beside it on the same core and the same redis-server, the same service as it was before
issue 17 (commit cd7676b, from a git worktree removed at the end). The sides:

- ``today``: ``GET .../callers/{phone}/memory`` in a project with neither identity linking nor trust classes;
- ``before``: the same reads of the same callers, served by the code before issue 17 (whose read asks Redis
  for the memory only, not for an alias record too);
- ``first``: the same by the phone (the profile id) in a project with ``identity_linking`` on, where every
  caller also has an email linked;
- ``linked``: the same profiles read through their linked email;
- ``trust``: by phone in a project with ``field_classes`` (2 of the 10 state keys ``sensitive``, needing
  ``step_up``), read with ``?attestation=TN-Validation-Passed-C``: the two sensitive fields are withheld;
- ``trust-passed`` (an ablation, no target): the same project read with ``&step_up=true`` too, so nothing is
  withheld: separates the trust check from the smaller answer.

Measured: each side's peak (closed loop), in interleaved rounds, with each side's ratio to ``today`` per round
and its median, and to ``before`` (targets: first >= 0.9x before, linked >= 0.6x today, trust >= 0.9x
today; first / today and today / before are reported too); each side's latency in open loop at
50% of today's peak; and the Redis round trips and commands of one read of each side, counted on the
redis-server (INFO stats ``total_reads_processed`` and ``commandstats``) over a counted number of reads sent
one at a time, less what the idle service does in as long. Results: bench/results/identity.json (or
``--output``) and a table with the targets' PASS/FAIL.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
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
SIDES = ("today", "before", "first", "linked", "trust", "trust-passed")
#: The code before issue 17 (linked identifiers and trust): the ``before`` side's service runs it.
BEFORE_COMMIT = "cd7676b"
#: Changes made since BEFORE_COMMIT that are not issue 17's but change what every request costs: applied to the
#: ``before`` side's worktree (``git apply`` of each commit's diff under service/), so that the two sides
#: differ by issue 17 alone. c72f255: the collector settled once the service listens (gc.freeze, thresholds).
BEFORE_RUNTIME_COMMITS = ("c72f255",)
#: The project each side reads, by what it is configured with.
PROJECTS = {"plain": "bench", "linking": "bench-linked", "trust": "bench-trust"}
SIDE_PROJECT = {
    "today": "plain",
    "before": "plain",
    "first": "linking",
    "linked": "linking",
    "trust": "trust",
    "trust-passed": "trust",
}
LABELS = {
    "today": "by phone, neither linking nor trust (today's read)",
    "before": f"by phone, neither linking nor trust, by the code before issue 17 (commit {BEFORE_COMMIT})",
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
#: Throughput targets: side -> (the side it is judged against, the floor of side / that side, median of paired
#: rounds; None: reported only). Issue 17's "reads by a profile's first identifier vs today's reads" is judged
#: against the service as it was before issue 17 (``before``); first / today is reported beside it.
TARGETS: dict[str, tuple[str, float | None]] = {
    "first": ("before", 0.9),
    "linked": ("today", 0.6),
    "trust": ("today", 0.9),
    "trust-passed": ("today", None),
}

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
        rc["field_classes"] = dict.fromkeys(SENSITIVE, "sensitive")
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
    #: The sides measured: SIDES, less ``before`` when a smoke run could not make the worktree.
    sides: list[str] = field(default_factory=lambda: list(SIDES))
    #: The git worktree of BEFORE_COMMIT (removed at the end) and the package folder that imports it.
    worktree: Path | None = None

    def server(self, side: str) -> h.Server:
        """The service that serves ``side``: the code before issue 17 for ``before``, else this work tree's."""
        return self.servers["before" if side == "before" else "service"]

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
        target = self.servers["static"] if static else self.server(side)
        watch = {"server": target.pid}
        if self.redis is not None and not static:
            watch["redis"] = self.redis.pid
        # The other service, idle meanwhile: its CPU is recorded apart, not as other processes' load.
        for name in ("service", "before"):
            if not static and name in self.servers and self.servers[name] is not target:
                watch["idle_service"] = self.servers[name].pid
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


class NoWorktree(RuntimeError):
    """The worktree of BEFORE_COMMIT could not be made (no git, or the commit is not in this clone)."""


def setup(bench: Bench, *, before_optional: bool) -> None:
    store = bench.redis = h.start_redis(cpus=bench.aux_cpus)
    # Both sides read the same callers, so today's writes them in the form the code before issue 17 reads:
    # decimal times, as in the first rollout of an upgrade (docs/operations.md, "Upgrades"). A read costs the
    # same in either form.
    svc = bench.servers["service"] = h.start_service(
        "service", store.url, bench.work, bench.key, bench.server_cpus, CALLER_MEMORY_REDIS_DECIMAL_TIMES="1"
    )
    try:
        start_before(bench)
    except NoWorktree as exc:
        if not before_optional:
            raise
        bench.sides.remove("before")
        bench.results["before"] = {"skipped": str(exc)}
        say(f"before: SKIPPED, {exc}")
    for kind, project in PROJECTS.items():
        # The plain project is configured through the code before issue 17, which cannot read a configuration
        # stored by today's (its new settings are unknown fields to it); today's reads that one with its
        # defaults (no linking, no trust classes), as it would after an upgrade.
        via = bench.servers["before"] if kind == "plain" and "before" in bench.servers else svc
        status, body = h.http(
            "PUT", f"{via.url}/v1/projects/{project}", h.OPERATOR_TOKEN, project_config(kind)
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


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(h.ROOT), *args], capture_output=True, text=True, check=False)


def start_before(bench: Bench) -> None:
    """The ``before`` side's service: ``python -m caller_memory.service serve`` of BEFORE_COMMIT, from a git
    worktree of it (``git worktree add --detach``, removed at the end by ``remove_worktree``) with
    BEFORE_RUNTIME_COMMITS applied, pinned like the
    other service, on the same redis-server. The installed package is an editable install of this work tree,
    so a folder holding a ``caller_memory`` package whose ``service`` and ``sdk`` are symlinks to the
    worktree's goes first on its PYTHONPATH (the editable finder comes after the path finder). Checked before
    anything else: a Python started the same way imports the worktree's modules, and the running service's
    /openapi.json has no ``/links`` path (today's has)."""
    resolved = git("rev-parse", "--verify", "--quiet", f"{BEFORE_COMMIT}^{{commit}}")
    if resolved.returncode != 0:
        raise NoWorktree(f"commit {BEFORE_COMMIT} is not in this clone {resolved.stderr.strip()}".strip())
    commit = resolved.stdout.strip()
    tree = bench.work / "before-src"
    made = git("worktree", "add", "--detach", str(tree), commit)
    if made.returncode != 0:
        raise NoWorktree(f"git worktree add {BEFORE_COMMIT} failed: {made.stderr.strip()[-500:]}")
    bench.worktree = tree
    for change in BEFORE_RUNTIME_COMMITS:
        diff = git("diff", f"{change}^", change, "--", "service/")
        applied = subprocess.run(
            ["git", "-C", str(tree), "apply"], input=diff.stdout, capture_output=True, text=True, check=False
        )
        if diff.returncode != 0 or not diff.stdout or applied.returncode != 0:
            raise RuntimeError(f"commit {change} does not apply to {BEFORE_COMMIT}: {applied.stderr.strip()}")
    package = bench.work / "before-pkg" / "caller_memory"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    for part in ("service", "sdk"):
        (package / part).symlink_to(tree / part, target_is_directory=True)
    path = os.pathsep.join(filter(None, [str(package.parent), os.environ.get("PYTHONPATH", "")]))
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import caller_memory.service as s, caller_memory.sdk as k; print(s.__file__, k.__file__)",
        ],
        env={**os.environ, "PYTHONPATH": path},
        cwd=str(bench.work),
        capture_output=True,
        text=True,
        check=False,
    )
    files = probe.stdout.split()
    if probe.returncode != 0 or len(files) != 2 or not all(f.startswith(str(package)) for f in files):
        raise RuntimeError(
            f"the before side would not import the worktree's code: {probe.stdout} {probe.stderr}"
        )
    assert bench.redis is not None
    server = bench.servers["before"] = h.start_service(
        "before", bench.redis.url, bench.work, bench.key, bench.server_cpus, PYTHONPATH=path
    )
    old = json.loads(transcripts.raw_get(f"{server.url}/openapi.json", None)[1])
    new = json.loads(transcripts.raw_get(f"{bench.servers['service'].url}/openapi.json", None)[1])
    links = sorted(p for p in old["paths"] if "/links" in p)
    if links or not any("/links" in p for p in new["paths"]):
        raise RuntimeError(f"the before side's service is not the code before issue 17: its paths {links}")
    digest = hashlib.sha256()
    for folder in (tree / "service", tree / "sdk"):
        for file in sorted(folder.rglob("*")):
            if file.is_file() and file.suffix in {".py", ".lua"}:
                digest.update(str(file.relative_to(folder.parent)).encode() + b"\0" + file.read_bytes())
    bench.results["before"] = {
        "commit": commit,
        "subject": git("log", "-1", "--format=%s", commit).stdout.strip(),
        "how": "git worktree add --detach (removed at the end); PYTHONPATH first: a caller_memory package whose "
        "service and sdk are symlinks to the worktree's",
        "with_runtime_commits": list(BEFORE_RUNTIME_COMMITS),
        "imports": files,
        "openapi_paths": len(old["paths"]),
        "openapi_links_paths": links,
        "source_sha256": digest.hexdigest(),
    }
    say(
        f"before: commit {commit[:12]} from a worktree, with {', '.join(BEFORE_RUNTIME_COMMITS)} applied, "
        f"{len(old['paths'])} API paths, none of /links"
    )


def remove_worktree(bench: Bench) -> None:
    if bench.worktree is None:
        return
    done = git("worktree", "remove", "--force", str(bench.worktree))
    if done.returncode != 0:
        shutil.rmtree(bench.worktree, ignore_errors=True)
        git("worktree", "prune")
    bench.worktree = None


def prefill(bench: Bench) -> None:
    """Every caller of every project gets STORED fields by PATCH (admin); in the linking project each is then
    linked to an email by ``POST .../links`` (admin): the service makes every link."""
    svc, n = bench.servers["service"], bench.plan.callers
    say(
        f"prefill through the API: {n:,} callers x {len(STORED)} fields in each of {len(PROJECTS)} projects, {n:,} links"
    )
    document = dict.fromkeys(STORED, VALUE)

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
    same fields as the phone, the trust read without the sensitive ones and saying so, the code before issue
    17 today's callers' fields, without issue 17's ``withheld`` and ``attestation``), and the links are the
    service's own (listed by it). The answers' sizes are recorded."""
    svc = bench.servers["service"]
    sizes: dict[str, int] = {}
    answers: dict[str, dict[int, dict[str, Any]]] = {}
    for side in bench.sides:
        answers[side] = {}
        for i in {0, bench.plan.callers - 1}:
            status, raw = transcripts.raw_get(
                bench.server(side).url + bench.paths(side)[i], bench.agents[SIDE_PROJECT[side]]
            )
            if status != 200:
                raise RuntimeError(f"{side}: the read of caller {i} answered {status}: {raw[:500]!r}")
            body = json.loads(raw)
            expected = [n for n in STORED if n not in SENSITIVE] if side == "trust" else STORED
            withheld = SENSITIVE if side == "trust" else []
            # The code before issue 17 answers no ``withheld`` (nor ``attestation``).
            if sorted(body["fields"]) != expected or sorted(body.get("withheld", [])) != withheld:
                raise RuntimeError(
                    f"{side}: caller {i} read {sorted(body['fields'])}, withheld {body.get('withheld')}"
                )
            if side == "before" and ("withheld" in body or "attestation" in body):
                raise RuntimeError(f"before: the answer has issue 17's members: {sorted(body)}")
            if side.startswith("trust") and body["attestation"] != "C":
                raise RuntimeError(f"{side}: the attestation was read as {body['attestation']!r}")
            answers[side][i], sizes[side] = body, len(raw)

    def same(a: str, b: str) -> bool:
        return all(answers[a][i]["fields"] == answers[b][i]["fields"] for i in answers[b])

    if not same("linked", "first"):
        raise RuntimeError("the linked email does not read the profile's fields")
    if "before" in answers and not same("before", "today"):
        raise RuntimeError("the code before issue 17 does not read today's callers' fields")
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
    them. Taken off: what reading the counters costs (two readings back to back) and what the idle services
    do in as long (their webhook and inactivity workers poll), measured over ``idle_s`` first. Only the two
    services and this function talk to that redis-server."""
    assert bench.redis is not None
    n = bench.plan.counted_reads
    say(f"round trips to Redis: {n:,} reads of each side, one at a time")
    out: dict[str, Any] = {}
    client = bench.redis.client()
    conns = {
        name: http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        for name, server in bench.servers.items()
        if name != "static"
    }
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
        for side in bench.sides:
            paths = bench.paths(side)
            headers = {"Authorization": f"Bearer {bench.agents[SIDE_PROJECT[side]]}"}
            conn = conns["before" if side == "before" else "service"]
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
        for conn in conns.values():
            conn.close()
        client.close()
    bench.results["round_trips"] = out


# Measurements ---------------------------------------------------------------------------------------------


def warm(bench: Bench) -> None:
    say("warm-up: every side (not recorded)")
    for side in bench.sides:
        bench.load(side, seconds=bench.plan.closed_s / 2, warmup=0.3)


def peaks(bench: Bench) -> None:
    say(f"peak reads, closed loop, {bench.plan.rounds} interleaved rounds (order alternating)")
    sides = bench.sides
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    rounds: list[dict[str, Any]] = []
    for round_ in range(bench.plan.rounds):
        others: list[float] = []
        for side in sides if round_ % 2 == 0 else list(reversed(sides)):
            result = bench.load(side)
            runs[side].append(result)
            others.append(result.get("other_processes_cpu") or 0.0)
            say(
                f"  round {round_ + 1}/{bench.plan.rounds} {side:12} {result['achieved_rate']:7.0f} req/s"
                f"  p50 {result['latency_ms']['p50']:6.2f} ms  server CPU {result['watched_cpu_share'].get('server', 0):.2f}"
                f"  others {others[-1]:.2f}  errors {result['errors']} {result['statuses']}"
            )
        # A round is busy when, during any of its runs, other processes used QUIET_OTHER_CPU or more.
        rounds.append(
            {
                "round": round_ + 1,
                "other_cpu_max": round(max(others), 3),
                "busy": max(others) >= bench_run.QUIET_OTHER_CPU,
                "loadavg": os.getloadavg(),
            }
        )
        if rounds[-1]["busy"]:
            say(f"  round {round_ + 1} was BUSY: other processes used up to {max(others):.2f} CPU")
    out: dict[str, Any] = {side: bench_run.summarise(r) | {"all": r} for side, r in runs.items()}
    out["rounds"] = rounds
    quiet = [i for i, r in enumerate(rounds) if not r["busy"]]
    for side, base in pairs(sides):
        name = ratio_name(side, base)
        out[name] = bench_run.paired_ratio(runs[side], runs[base])
        out[f"{name}_per_cpu"] = bench_run.paired_ratio(
            runs[side], runs[base], key="requests_per_server_cpu_s"
        )
        if quiet and len(quiet) < len(rounds):
            out[name]["quiet_rounds"] = bench_run.paired_ratio(
                [runs[side][i] for i in quiet], [runs[base][i] for i in quiet]
            ) | {"rounds": [i + 1 for i in quiet]}
    bench.results["peak"] = out


def pairs(sides: list[str]) -> list[tuple[str, str]]:
    """The ratios reported: every side to ``today``, and every other side to ``before`` when it ran."""
    out = [(side, "today") for side in sides if side != "today"]
    if "before" in sides:
        out += [(side, "before") for side in sides if side != "before"]
    return out


def ratio_name(side: str, base: str) -> str:
    """``ratio_<side>`` for side / today (as before ``before`` was added), ``ratio_<side>_vs_before`` else."""
    return f"ratio_{side}" if base == "today" else f"ratio_{side}_vs_{base}"


def open_loop(bench: Bench) -> None:
    rate = max(1, round(bench.results["peak"]["today"]["rate"] * 0.5))
    say(f"open-loop reads at 50% of today's peak: {rate} req/s, every side, alternating")
    runs = bench_run.open_runs(bench, list(bench.sides), "read", rate)
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
        cmd = [spy, "record", "--pid", str(bench.server(side).pid), "--rate", "200", "--format", "raw"]
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
    measured = "before" in trips
    skipped = "" if measured else f" (before not measured: {r.get('before', {}).get('skipped')})"

    def ratio_text(side: str, base: str) -> str:
        name = ratio_name(side, base)
        ratio, text = p[name], f"{p[name]['median_of_paired']:.2f}x {base}"
        text += f" (median of paired rounds {ratio['per_round']}; per server CPU-second "
        text += f"{p[f'{name}_per_cpu']['median_of_paired']:.2f}x"
        if "quiet_rounds" in ratio:
            text += f"; quiet rounds {ratio['quiet_rounds']['rounds']} only: {ratio['quiet_rounds']['median_of_paired']:.2f}x"
        return text + ")"

    def trips_text(side: str, base: str) -> str:
        return (
            f"{trips[side]['round_trips_per_read']:.2f} round trips and {trips[side]['commands_per_read']:.2f} Redis "
            f"commands per read ({base}'s: {trips[base]['round_trips_per_read']:.2f} and "
            f"{trips[base]['commands_per_read']:.2f}; counted over {trips[side]['reads_sent']:,} reads)"
        )

    for side, (base, floor) in TARGETS.items():
        if base == "before" and not measured:
            base = "today"
        median = p[ratio_name(side, base)]["median_of_paired"]
        detail = f"{p[side]['rate']:.0f} vs {p[base]['rate']:.0f} req/s: {ratio_text(side, base)}"
        others = [b for b in ("today", "before") if b != base and b in trips]
        detail += "".join(f"; {ratio_text(side, b)}" for b in others)
        detail += f"; {trips_text(side, base)}"
        errors = p[side]["errors"] + p[base]["errors"]
        if errors:
            detail += f"; {errors} errors"
        name = f"read {LABELS[side]}"
        if floor is None:
            out.append({"target": f"{name}: / {base} (an ablation)", "pass": None, "detail": detail})
        else:
            out.append(
                {
                    "target": f"{name}: >= {floor}x {base}" + (skipped if side == "first" else ""),
                    "pass": median >= floor and not errors,
                    "detail": detail,
                }
            )
    if measured:
        out.append(
            {
                "target": "today's read / the same read by the code before issue 17: what issue 17 costs a read "
                "that uses none of it (no target)",
                "pass": None if not p["today"]["errors"] + p["before"]["errors"] else False,
                "detail": f"{p['today']['rate']:.0f} vs {p['before']['rate']:.0f} req/s: "
                f"{ratio_text('today', 'before')}; {trips_text('today', 'before')}",
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
    add(bench_run.code_measured(src))
    b = r.get("before", {})
    add(
        f"before: SKIPPED, {b['skipped']}"
        if "skipped" in b
        else f"before: commit {b['commit'][:12]} ({b['subject']}) from a git worktree, service/+sdk/ sha256 "
        f"{b['source_sha256'][:12]}; its /openapi.json has {b['openapi_paths']} paths, none of /links"
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
        f"{'p50 ms':>7} {'p99 ms':>7} {'errors':>6} {'RT/read':>7} {'cmd/read':>8} {'bytes':>5} {'/ today':>7} {'/ before':>8}"
    )
    p, trips = r["peak"], r["round_trips"]
    sides = [side for side in SIDES if side in p]
    for side in sides:
        s = p[side]
        per_cpu = s.get("requests_per_server_cpu_s")
        ratios = [p.get(ratio_name(side, base)) for base in ("today", "before")]
        add(
            f"  {side:12} {s['rate']:7.0f} {min(s['rates']):6.0f}-{max(s['rates']):<6.0f} {s.get('server_cpu', 0):7.2f} "
            f"{1e6 / per_cpu if per_cpu else 0:7.0f} {s.get('redis_cpu', 0):5.2f} {s.get('loadgen_cpu', 0):5.2f} "
            f"{s.get('other_cpu', 0):6.2f} {s['latency_ms']['p50']:7.2f} {s['latency_ms']['p99']:7.2f} {s['errors']:6d} "
            f"{trips[side]['round_trips_per_read']:7.2f} {trips[side]['commands_per_read']:8.2f} {r['answer_bytes'][side]:5d}"
            + "".join(
                f" {ratio['median_of_paired']:{w}.2f}x" if ratio else " " * (w + 2)
                for ratio, w in zip(ratios, (6, 7), strict=True)
            )
        )
    for side, base in pairs(sides):
        add(f"  {side} / {base} per round: {p[ratio_name(side, base)]['per_round']}")
    busy = [x["round"] for x in p["rounds"] if x["busy"]]
    add(
        f"  busy rounds (other processes >= {bench_run.QUIET_OTHER_CPU} CPU in a run): {busy or 'none'}; "
        f"other processes' CPU, the most in a run of each round: {[x['other_cpu_max'] for x in p['rounds']]}"
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
    for side in sides:
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
    parser = bench_run.sized_parser(
        __doc__,
        quick="about 2 minutes",
        pin="the service on CPU 0, Redis and the load generator on the others",
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
        f"both services (today's and before's) on CPU {cpus[0]}; Redis and the load generator on CPU "
        f"{','.join(map(str, cpus[1:]))}"
        if pin
        else "none"
    )
    r["plan"] = plan.__dict__ | {
        "sides": {side: LABELS[side] for side in SIDES},
        "projects": {kind: {"id": PROJECTS[kind], "config": project_config(kind)} for kind in PROJECTS},
        "stored_fields": STORED,
        "attestation": ATTESTATION,
        "plain_project_configured_by": "the before side's service (the code before issue 17 cannot read a "
        "configuration stored by today's); today's reads it with its defaults",
    }
    r["persistence"] = 'redis-server --save "" --appendonly no'
    r["service_settings"] = (
        "defaults, CALLER_MEMORY_SWEEP_INTERVAL=0; one process of this work tree serving every side but before, "
        f"one of commit {BEFORE_COMMIT} serving before (same core, same redis-server)"
    )
    began = time.monotonic()
    try:
        with bench_run.cleanup():
            # A smoke run (the test suite's) goes on without ``before`` when no worktree of it can be made
            # (a clone without that commit, say) and says so; a measuring run needs it.
            setup(bench, before_optional=args.smoke)
            round_trips(bench)
            transcripts.calibrate(bench)
            warm(bench)
            peaks(bench)
            open_loop(bench)
            if args.profile:
                profile(bench, [side for side in args.profile if side in bench.sides])
    finally:
        remove_worktree(bench)
        with contextlib.suppress(OSError):
            shutil.rmtree(work)
    bench_run.finish(r, args.output, began, targets, report)
    say(f"results written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
