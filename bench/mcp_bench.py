"""Benchmark of the MCP tools (issue 34): a ``get_caller_memory`` round trip over MCP beside a plain memory read,
in the same run against the real service, and our part of the tool's cost (the round trip less that of a tool
answering a constant through the same stack). Target: that part at most 1x the plain read's p50.

    .venv/bin/python bench/mcp_bench.py              # SQLite and Redis: 5 rounds of 10 s per side (~6 minutes)
    .venv/bin/python bench/mcp_bench.py --quick      # under a minute: 5 rounds of 1 s per side
    .venv/bin/python bench/mcp_bench.py --smoke      # seconds: checks the script only (figures meaningless)
    .venv/bin/python bench/mcp_bench.py --store sqlite --profile   # and py-spy profiles of the two tools

What runs, each in its own OS process (bench/README.md, "MCP tools", has the details):

- the service: bench/mcp_launcher.py, which serves exactly as ``python -m caller_memory.service serve`` (the
  harness's environment: sweeps off, everything else the default) with one more agent tool, bench-only,
  ``bench_constant``; on a SQLite file or a private redis-server (no persistence, read cache off);
- the load generator: bench/loadgen.py's client, open loop and recorder, run as ``bench/mcp_bench.py
  --loadgen`` with this script's requests.

The three sides, the same caller (10 fields of 32 bytes, as bench/run.py's) and the same agent token:

- ``read``: ``GET /v1/projects/bench/callers/{phone}/memory``, the plain memory read;
- ``tool``: one ``tools/call`` of ``get_caller_memory`` per request, ``POST /v1/projects/bench/mcp`` with
  ``X-Caller-Memory-Conversation`` naming the started call: the headers and body the official ``mcp`` client
  sends, captured from it at the start of the run through a loopback proxy (only the JSON-RPC id varies);
- ``constant``: the same request calling ``bench_constant``, which answers what ``get_caller_memory`` answers
  for this caller, as a constant.

Open loop at one fixed rate for the three sides (a fraction, 0.25 by default, of the ``tool`` side's closed-loop
peak measured first), latency from the scheduled send time; each side warmed up first, then rounds in which the
sides alternate (reversed every other round). Reported per side: p50/p99/p99.9 over all rounds, achieved vs
target rate, errors (a tool result with ``isError: true`` counts as one), the service's CPU per request; and our
part of the tool's cost, p50(tool) - p50(constant), over p50(read) (target <= 1.0): per round, then the median
(also over the quiet rounds, and pooled). Results in
bench/results/mcp.json (or ``--output``) and a table with the target's PASS/FAIL on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import itertools
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import loadgen
import profiling
import run as bench_run
from common import FIELDS, PROJECT, VALUE, caller_phone, quote_phone

if "--loadgen" not in sys.argv[1:]:  # the load generator's processes need none of the service's modules
    import harness as h

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
CONVERSATION = "bench-call"
CALLER = 0  # caller_phone(0): +12122000000
TOOL = "get_caller_memory"
CONSTANT_TOOL = "bench_constant"  # bench/mcp_launcher.py's
SIDES = ("read", "tool", "constant")
#: JSON-RPC ids cycled through (the official client numbers its requests 1, 2, 3, ...).
IDS = 256
#: What an MCP tool result that failed holds (the SDK's compact JSON): counted as an error.
TOOL_ERROR = b'"isError":true'
#: A run in which the machine's other processes used at least this much CPU (CPU-seconds per second) is busy.
BUSY_OTHER_CPU = 0.1

T0 = time.monotonic()


def say(text: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {text}", flush=True)


@dataclass(frozen=True)
class Plan:
    rounds: int
    seconds: float  # measured per side and round
    warmup: float  # each load-generator run's own unrecorded start
    side_warmup: float  # one unrecorded run per side before the rounds
    peak_s: float  # the tool side's closed-loop peak, which sets the rate
    profile_s: float
    connections: int = 32  # closed loop
    open_connections: int = 16


FULL = Plan(rounds=5, seconds=10.0, warmup=0.5, side_warmup=2.0, peak_s=3.0, profile_s=10.0)
QUICK = Plan(rounds=5, seconds=1.0, warmup=0.3, side_warmup=0.7, peak_s=1.5, profile_s=5.0)
SMOKE = Plan(rounds=1, seconds=0.5, warmup=0.2, side_warmup=0.3, peak_s=0.5, profile_s=1.0)


# The load generator (``--loadgen``: a process of its own) --------------------------------------------------


class ToolConnection(loadgen.Connection):
    """bench/loadgen.py's connection, noting an answer that is a tool error (HTTP 200, ``isError: true``)."""

    tool_error = False

    def data_received(self, data: bytes) -> None:
        if TOOL_ERROR in data:  # answers are small: one chunk (no pipelining: the chunk is this answer's)
            self.tool_error = True
        super().data_received(data)


class RawRun(loadgen.Run):
    """bench/loadgen.py's run (connections, open or closed loop, recorder) with this script's prebuilt requests
    (``scenario.requests``, latin-1 text, sent in turn); a tool error counts as an error; the answer also holds
    every latency (ms, sorted) so that runs can be pooled."""

    connection_class = ToolConnection

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__({**spec, "scenario": {"type": "static"}})
        kind = spec["scenario"]["kind"]
        raws = [(kind, raw.encode("latin-1")) for raw in spec["scenario"]["requests"]]
        self.stream = itertools.cycle(raws)
        self.tool_errors = 0

    def on_done(self, conn: loadgen.Connection, status: int) -> None:
        if isinstance(conn, ToolConnection) and conn.tool_error:
            conn.tool_error = False
            if status and self.recorder.start <= conn.intended < self.recorder.stop:
                self.tool_errors += 1
                status = 599  # an answer, but a failed tool: not a success
        super().on_done(conn, status)

    def result(self, cpu_s: float, wall: float) -> dict[str, Any]:
        result = super().result(cpu_s, wall)
        result["tool_errors"] = self.tool_errors
        result["latencies_ms"] = sorted(
            round(x * 1000, 4) for values in self.recorder.latency.values() for x in values
        )
        return result


def loadgen_main() -> None:
    """Spec on stdin as for bench/loadgen.py, with a scenario ``{"kind": side, "requests": [raw, ...]}``."""
    spec = json.loads(sys.stdin.read())
    try:
        import uvloop

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    sys.setswitchinterval(0.0002)  # the open loop's ticker thread must get the GIL back quickly
    result = asyncio.run(RawRun(spec).go())
    result["loop"] = loop_name
    sys.stdout.write(json.dumps(result) + "\n")


# Requests ---------------------------------------------------------------------------------------------------


@dataclass
class Captured:
    """One ``tools/call`` request as the official client sent it: its header lines in order (Host and
    Content-Length left out: set per request) and its JSON body."""

    headers: list[tuple[str, str]]
    body: bytes

    def request(self, host: str, tool: str, rpc_id: int) -> bytes:
        document = json.loads(self.body)
        document = {**document, "id": rpc_id, "params": {**document["params"], "name": tool}}
        body = json.dumps(document, separators=(",", ":")).encode()
        lines = [f"POST /v1/projects/{PROJECT}/mcp HTTP/1.1", f"Host: {host}"]
        for name, value in self.headers:
            lines.append(f"{name}: {tool if name.lower() == 'mcp-name' else value}")
        lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def shown(self, token: str) -> dict[str, Any]:
        """What the results record of it (the token left out)."""
        return {
            "headers": [[n, v.replace(token, "<agent token>")] for n, v in self.headers],
            "body": self.body.decode(),
        }


def split_requests(raw: bytes) -> Iterator[tuple[str, list[tuple[str, str]], bytes]]:
    """The HTTP/1.1 requests of one connection's bytes (bodies by Content-Length): request line, headers,
    body."""
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        first, *lines = head.decode("latin-1").split("\r\n")
        headers = [(n.strip(), v.strip()) for n, _, v in (line.partition(":") for line in lines)]
        length = next((int(v) for n, v in headers if n.lower() == "content-length"), 0)
        yield first, headers, rest[:length]
        raw = rest[length:]


async def capture(port: int, agent: str) -> tuple[Captured, dict[str, Any]]:
    """Call ``get_caller_memory`` twice with the official ``mcp`` client (Streamable HTTP, its default mode)
    through a loopback proxy that records what it sends; the last ``tools/call`` request, and what the client
    made of the answer."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    sent: list[bytearray] = []

    async def pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, into: bytearray | None
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                if into is not None:
                    into += data
                writer.write(data)
                await writer.drain()
        writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        sent.append(bytearray())
        await asyncio.gather(pipe(reader, up_writer, sent[-1]), pipe(up_reader, writer, None))

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}/v1/projects/{PROJECT}/mcp"
    headers = {"Authorization": f"Bearer {agent}", "X-Caller-Memory-Conversation": CONVERSATION}
    try:
        async with (
            httpx2.AsyncClient(headers=headers, timeout=10) as http,
            Client(streamable_http_client(url, http_client=http)) as client,
        ):
            await client.call_tool(TOOL, {})
            result = await client.call_tool(TOOL, {})
        await asyncio.sleep(0.1)  # the relays' last bytes
    finally:
        proxy.close()
        await proxy.wait_closed()
    calls = [
        (hs, body)
        for conn in sent
        for _, hs, body in split_requests(bytes(conn))
        if any(n.lower() == "mcp-method" and v == "tools/call" for n, v in hs)
    ]
    if not calls:
        raise RuntimeError("the official client sent no tools/call request through the proxy")
    headers_sent, body = calls[-1]
    kept = [(n, v) for n, v in headers_sent if n.lower() not in ("host", "content-length")]
    captured = Captured(kept, body)
    if not captured.request("h", TOOL, json.loads(body)["id"]).endswith(b"\r\n\r\n" + body):
        # Rebuilt with another id, the request would not be byte for byte the client's.
        raise RuntimeError(f"the captured body does not survive its re-encoding: {body!r}")
    return captured, {"is_error": result.is_error, "structured": result.structured_content}


def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw request on a connection of its own: status, headers (lower-case names), body."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {n.strip().lower(): v.strip() for n, _, v in (line.partition(":") for line in lines)}
        if "content-length" not in headers:
            raise RuntimeError(f"an answer without Content-Length (the load generator needs it): {head!r}")
        while len(body) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(status_line.split()[1]), headers, body


# Set-up -------------------------------------------------------------------------------------------------------


def expected_answer() -> dict[str, Any]:
    """What ``get_caller_memory`` answers for the bench caller (and so what ``bench_constant`` answers)."""
    value = json.loads(VALUE)
    return {"fields": dict.fromkeys(FIELDS, value), "withheld": [], "known": True}


def start_launcher(
    name: str, store_url: str, workdir: Path, pseudonym_key: bytes, cpus: set[int] | None
) -> h.Server:
    """bench/mcp_launcher.py with the environment ``harness.start_service`` gives the service."""
    port = h.free_port()
    log = workdir / f"{name}.log"
    environ = {
        **os.environ,
        "CALLER_MEMORY_PSEUDONYM_KEY": pseudonym_key.decode(),
        "CALLER_MEMORY_OPERATOR_TOKEN": h.OPERATOR_TOKEN,
        "CALLER_MEMORY_STORE": store_url,
        "CALLER_MEMORY_SWEEP_INTERVAL": "0",
    }
    cmd = [sys.executable, str(BENCH / "mcp_launcher.py"), "--port", str(port)]
    cmd += ["--constant", json.dumps(expected_answer())]
    proc = h.spawn(cmd, log=log, env=environ, cpus=cpus)
    h.wait_http(f"http://127.0.0.1:{port}/readyz", proc, log, 30.0)
    return h.Server(name, proc, port, log)


def setup(service: h.Server) -> str:
    """The project (bench/run.py's: state keys field_0..field_9, 30 days; conversation memory on), the caller's
    10 fields, a started conversation; the agent token."""
    base = f"{service.url}/v1/projects/{PROJECT}"
    config = {
        "memory": {
            "repeat_caller": {"state_keys": FIELDS, "retention": "P30D"},
            "conversation": {"enabled": True},
        }
    }
    status, found = h.http("PUT", base, h.OPERATOR_TOKEN, config)
    assert status in (200, 201), found
    status, found = h.http("POST", base + "/tokens", h.OPERATOR_TOKEN, {"role": "agent"})
    assert status == 201, found
    agent: str = found["token"]
    phone = caller_phone(CALLER)
    fields = expected_answer()["fields"]
    status, found = h.http("PATCH", f"{base}/callers/{quote_phone(phone)}/memory", h.OPERATOR_TOKEN, fields)
    assert status == 200, found
    status, found = h.http(
        "POST", f"{base}/conversations/{CONVERSATION}/start", agent, {"caller": phone, "channel": "phone"}
    )
    assert status == 200, found
    return agent


def requests_of(service: h.Server, agent: str, captured: Captured) -> dict[str, list[bytes]]:
    host = f"127.0.0.1:{service.port}"
    path = f"/v1/projects/{PROJECT}/callers/{quote_phone(caller_phone(CALLER))}/memory"
    return {
        "read": [loadgen._get(host, path, f"Authorization: Bearer {agent}\r\n")],
        "tool": [captured.request(host, TOOL, n) for n in range(1, IDS + 1)],
        "constant": [captured.request(host, CONSTANT_TOOL, n) for n in range(1, IDS + 1)],
    }


def verify(service: h.Server, requests: dict[str, list[bytes]]) -> dict[str, Any]:
    """Each side's first request answered as it must be, before anything is measured; the answers' sizes."""
    found: dict[str, Any] = {}
    results = {}
    for side, raws in requests.items():
        status, headers, body = exchange(service.port, raws[0])
        if status != 200:
            raise RuntimeError(f"{side}: {status} {body[:500]!r}")
        document = json.loads(body)
        if side == "read":
            if document["fields"] != expected_answer()["fields"]:
                raise RuntimeError(f"read: unexpected fields {document['fields']}")
        else:
            result = document.get("result")
            if not result or result.get("isError") or TOOL_ERROR in body:
                raise RuntimeError(f"{side}: not a successful tool result: {body[:500]!r}")
            results[side] = result
        found[side] = {
            "status": status,
            "answer_bytes": len(body),
            "content_type": headers.get("content-type"),
        }
    if results["tool"] != results["constant"]:
        raise RuntimeError(f"the constant tool answers otherwise: {results['tool']} vs {results['constant']}")
    if results["tool"].get("structuredContent") != expected_answer():
        raise RuntimeError(f"get_caller_memory answered {results['tool'].get('structuredContent')}")
    found["tool_and_constant_results_equal"] = True
    return found


# Measurements ---------------------------------------------------------------------------------------------


@dataclass
class StoreRun:
    store: str
    plan: Plan
    service: h.Server
    requests: dict[str, list[bytes]]
    aux_cpus: set[int] | None
    redis_pid: int | None = None

    def load(self, side: str, mode: str, seconds: float, warmup: float, rate: float | None = None) -> Any:
        watch = {"server": self.service.pid}
        if self.redis_pid is not None:
            watch["redis"] = self.redis_pid
        spec = {
            "host": "127.0.0.1",
            "port": self.service.port,
            "mode": mode,
            "rate": rate,
            "connections": self.plan.open_connections if mode == "open" else self.plan.connections,
            "warmup": warmup,
            "duration": seconds,
            "scenario": {"kind": side, "requests": [r.decode("latin-1") for r in self.requests[side]]},
            "watch": watch,
        }
        command = [sys.executable, str(Path(__file__).resolve()), "--loadgen"]
        return h.run_loadgen(command, spec, self.aux_cpus, self.service.name, side)


def pooled(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    out = {name: loadgen.percentile(values, q) for name, q in loadgen.PERCENTILES.items()}
    out["max"] = values[-1] if values else float("nan")
    return out


def side_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [x for r in runs for x in r["latencies_ms"]]
    duration = sum(r["duration_s"] for r in runs)
    cpu = [
        r["watched_cpu_share"]["server"] / r["achieved_rate"] * 1000
        for r in runs
        if r["achieved_rate"] and r["watched_cpu_share"].get("server") is not None
    ]
    others = [r["other_processes_cpu"] for r in runs if r.get("other_processes_cpu") is not None]
    return {
        "requests": len(latencies),
        "latency_ms": pooled(latencies),
        "p50_ms_per_run": [r["latency_ms"]["p50"] for r in runs],
        "service_ms_p50": statistics.median(r["service_ms"]["p50"] for r in runs),
        "target_rate": runs[0]["target_rate"],
        "achieved_rate": len(latencies) / duration if duration else 0.0,
        "errors": sum(r["errors"] for r in runs),
        "tool_errors": sum(r.get("tool_errors", 0) for r in runs),
        "unanswered": sum(r["unanswered"] for r in runs),
        "statuses": dict(sum((Counter(r["statuses"]) for r in runs), Counter())),
        "server_cpu_ms_per_request": statistics.median(cpu) if cpu else None,
        "server_cpu_share": statistics.median(r["watched_cpu_share"].get("server") or 0.0 for r in runs),
        "loadgen_stall_ms_max": max((r["loadgen_stall_ms_max"] or 0.0) for r in runs),
        "other_processes_cpu_max": max(others) if others else None,
        "busy_runs": sum(1 for o in others if o >= BUSY_OTHER_CPU),
    }


def measure(run: StoreRun, fraction: float, rate: float | None) -> dict[str, Any]:
    plan = run.plan
    peak = run.load("tool", "closed", plan.peak_s, plan.warmup)
    say(
        f"{run.store}: tool side's closed-loop peak {peak['achieved_rate']:.0f} req/s ({plan.connections} conns)"
    )
    if peak["errors"]:
        raise RuntimeError(f"{run.store}: errors in the tool side's peak: {peak['statuses']}")
    target = rate or max(20.0, round(peak["achieved_rate"] * fraction / 10) * 10)
    warm = {}
    for side in SIDES:
        got = run.load(side, "open", plan.side_warmup, plan.warmup, target)
        warm[side] = {"p50_ms": got["latency_ms"]["p50"], "errors": got["errors"]}
    by_side: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    rounds = []
    for number in range(plan.rounds):
        order = SIDES if number % 2 == 0 else tuple(reversed(SIDES))
        p50 = {}
        for side in order:
            got = run.load(side, "open", plan.seconds, plan.warmup, target)
            by_side[side].append(got)
            p50[side] = got["latency_ms"]["p50"]
        ours = p50["tool"] - p50["constant"]
        rounds.append(
            {
                "round": number + 1,
                "order": list(order),
                "p50_ms": p50,
                "ours_ms": ours,
                "ratio": ours / p50["read"],
                "other_processes_cpu": {s: by_side[s][-1]["other_processes_cpu"] for s in SIDES},
                "busy": any((by_side[s][-1]["other_processes_cpu"] or 0.0) >= BUSY_OTHER_CPU for s in SIDES),
            }
        )
        say(
            f"{run.store} round {number + 1}: p50 read {p50['read']:.3f} tool {p50['tool']:.3f} "
            f"constant {p50['constant']:.3f} ms; ours {ours:+.3f} ms = {ours / p50['read']:.2f}x the read"
        )
    sides = {side: side_summary(by_side[side]) for side in SIDES}
    p50s = {side: sides[side]["latency_ms"]["p50"] for side in SIDES}
    cpu = {side: sides[side]["server_cpu_ms_per_request"] for side in SIDES}
    quiet = [r["ratio"] for r in rounds if not r["busy"]]
    out: dict[str, Any] = {
        "tool_peak": {"rate": peak["achieved_rate"], "connections": plan.connections},
        "rate": target,
        "rate_fraction_of_tool_peak": target / peak["achieved_rate"] if peak["achieved_rate"] else None,
        "warmup": warm,
        "sides": sides,
        "rounds": rounds,
        # The target's figures: per round (the sides side by side), then the median, as bench/run.py's ratios.
        "ours_p50_ms": statistics.median(r["ours_ms"] for r in rounds),
        "ratio": statistics.median(r["ratio"] for r in rounds),
        "ratio_per_round": [r["ratio"] for r in rounds],
        "ratio_quiet_rounds": statistics.median(quiet) if quiet else None,
        "quiet_rounds": len(quiet),
        # The same from every round's latencies pooled per side.
        "ours_p50_ms_pooled": p50s["tool"] - p50s["constant"],
        "ratio_pooled": (p50s["tool"] - p50s["constant"]) / p50s["read"],
        "tool_over_read_p50": p50s["tool"] / p50s["read"],
    }
    if cpu["read"] and cpu["tool"] is not None and cpu["constant"] is not None:
        out["ours_cpu_ms"] = cpu["tool"] - cpu["constant"]
        out["cpu_ratio"] = out["ours_cpu_ms"] / cpu["read"]
    out["target"] = {"ratio <= 1.0": out["ratio"] <= 1.0}
    return out


# Profile (py-spy) ----------------------------------------------------------------------------------------

#: Layers of an MCP request, most specific first, then bench/profiling.py's (each sample to its deepest frame
#: of a known layer).
MCP_LAYERS = [
    (
        "the store (service/storage/: the caller's fields, and the conversation the route binds)",
        profiling._is("service/storage/"),
    ),
    (
        "the memory read's domain (memory.py's view, fields, the call's trust)",
        profiling._is(
            "service/domain/memory.py",
            "service/domain/fields.py",
            "service/domain/conversations/call_trust.py",
        ),
    ),
    ("the tools' bodies (service/mcp/)", profiling._is("service/mcp/")),
    ("the route: binding the call (service/http/mcp_routes.py)", profiling._is("service/http/mcp_routes.py")),
    ("the ASGI bridge (service/http/mcp_bridge.py)", profiling._is("service/http/mcp_bridge.py")),
    ("mcp SDK (mcp, mcp_types)", profiling._is("mcp/", "mcp_types/")),
    ("starlette, anyio, sse_starlette", profiling._is("starlette/", "anyio/", "sse_starlette/")),
    ("json (stdlib)", profiling._is("json/")),
    ("typing, inspect, dataclasses (stdlib)", profiling._is("typing.py", "inspect.py", "dataclasses.py")),
    *profiling.LAYERS,
]


def idle(frames: list[profiling.Frame]) -> bool:
    """A sample of a thread pool's worker waiting for work (the SQLite store's reader thread): py-spy counts
    some of those waits as running; they are no CPU of a request."""
    return (
        bool(frames) and frames[-1][0] == "_worker" and frames[-1][1].endswith("concurrent/futures/thread.py")
    )


def layer_of(frames: list[profiling.Frame]) -> str:
    for func, file in reversed(frames):
        if func in profiling.ENTRY:
            continue
        for name, test in MCP_LAYERS[:-1]:
            if test(func, file):
                return name
    for func, file in reversed(frames):
        if MCP_LAYERS[-1][1](func, file):
            return MCP_LAYERS[-1][0]
    return profiling.FALLBACK


def spy(run: StoreRun, side: str, output: Path, profile_seconds: float | None) -> dict[str, Any]:
    """py-spy (raw, 200 Hz) of the service under closed-loop ``side`` requests: its CPU per request by layer."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    seconds = profile_seconds or run.plan.profile_s
    cmd = [py_spy, "record", "--pid", str(run.service.pid), "--duration", str(max(1, int(seconds)))]
    cmd += ["--rate", "200", "--format", "raw", "--output", str(output)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        got = run.load(side, "closed", seconds + 1, 0.5)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(10)
    if proc.returncode != 0:
        raise RuntimeError(f"py-spy failed: {err.decode()[-2000:]}")
    lines = output.read_text().splitlines()
    raw = "\n".join(line for line in lines if line.strip() and not idle(profiling.parse(line)[0][0]))
    stacks = profiling.parse(raw)
    total = sum(n for _, n in stacks) or 1
    layers: dict[str, int] = {}
    for frames, count in stacks:
        name = layer_of(frames)
        layers[name] = layers.get(name, 0) + count
    cpu_ms = got["watched_cpu_share"]["server"] / got["achieved_rate"] * 1000
    return {
        "rate": got["achieved_rate"],
        "server_cpu_ms_per_request": cpu_ms,
        "samples": total,  # idle pool workers left out
        "layers_ms_per_request": {
            name: round(cpu_ms * n / total, 4) for name, n in sorted(layers.items(), key=lambda kv: -kv[1])
        },
        "analysis": profiling.analyse(raw, top=25),
    }


def profile(run: StoreRun, into: Path, seconds: float | None) -> dict[str, Any]:
    found = {
        side: spy(run, side, into / f"mcp-profile-{run.store}-{side}.collapsed.txt", seconds)
        for side in SIDES
    }
    names = {n for side in SIDES for n in found[side]["layers_ms_per_request"]}
    diff = {
        n: round(
            found["tool"]["layers_ms_per_request"].get(n, 0.0)
            - found["constant"]["layers_ms_per_request"].get(n, 0.0),
            4,
        )
        for n in names
    }
    found["tool_minus_constant_ms_per_request"] = dict(sorted(diff.items(), key=lambda kv: -abs(kv[1])))
    return found


# Run ------------------------------------------------------------------------------------------------------


def wait_for_quiet(limit: float, tries: int, pause: float) -> list[float]:
    """The 1-minute load average, waited on (``pause`` s at a time, up to ``tries`` times) while above
    ``limit``: the machine is shared. The loads seen."""
    seen = [os.getloadavg()[0]]
    for _ in range(tries):
        if seen[-1] <= limit:
            break
        say(f"load average {seen[-1]:.2f} > {limit}: waiting {pause:.0f} s")
        time.sleep(pause)
        seen.append(os.getloadavg()[0])
    return seen


def versions() -> dict[str, Any]:
    """The machine and the code measured, as bench/run.py records them, with the mcp SDK's version."""
    info = bench_run.machine_info()
    info["packages"]["mcp"] = importlib.metadata.version("mcp")
    return info | {"source": bench_run.source_state()}


def run_store(store: str, plan: Plan, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    pin = args.pin and (os.cpu_count() or 1) >= 2
    server_cpus, aux_cpus = ({0}, {1}) if pin else (None, None)
    loads = [] if args.smoke or args.no_wait else wait_for_quiet(args.max_load, 5, 60.0)
    started = os.getloadavg()
    redis = None
    if store == "redis":
        redis = h.start_redis(cpus=aux_cpus)
        store_url = redis.url
    else:
        store_url = f"sqlite:///{work}/mcp.db"
    key = os.urandom(24).hex().encode()
    service = start_launcher(f"service-{store}", store_url, work, key, server_cpus)
    try:
        agent = setup(service)
        captured, client_saw = asyncio.run(capture(service.port, agent))
        if client_saw["is_error"] or client_saw["structured"] != expected_answer():
            raise RuntimeError(f"the official client got {client_saw}")
        requests = requests_of(service, agent, captured)
        checked = verify(service, requests)
        run = StoreRun(store, plan, service, requests, aux_cpus, redis.pid if redis else None)
        result = measure(run, args.fraction, args.rate)
        if args.profile:
            result["profile"] = profile(run, args.output.parent, args.profile_seconds)
    finally:
        h.stop(service.proc)
        if redis is not None:
            h.stop_redis(redis)
    return {
        "load_average_waited": loads,
        "load_average_start": started,
        "load_average_end": os.getloadavg(),
        "pinned": pin,
        "captured_request": captured.shown(agent),
        "checked": checked,
        **result,
    }


def table(results: dict[str, Any]) -> str:
    lines = []
    for store, r in results["stores"].items():
        lines.append(
            f"\n{store}: open loop at {r['rate']:.0f} req/s ({r['rate_fraction_of_tool_peak']:.2f} of the tool's "
            f"peak {r['tool_peak']['rate']:.0f}), load {r['load_average_start'][0]:.2f} -> "
            f"{r['load_average_end'][0]:.2f}"
        )
        lines.append(
            f"{'side':9} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7} {'rate':>8} {'target':>7} "
            f"{'errors':>6} {'cpu ms':>7} {'others':>6}"
        )
        for side in SIDES:
            s = r["sides"][side]
            lat = s["latency_ms"]
            lines.append(
                f"{side:9} {lat['p50']:7.3f} {lat['p99']:7.3f} {lat['p99_9']:7.3f} {lat['max']:7.2f} "
                f"{s['achieved_rate']:8.1f} {s['target_rate']:7.0f} {s['errors']:6d} "
                f"{s['server_cpu_ms_per_request'] or 0:7.3f} {s['other_processes_cpu_max'] or 0:6.2f}"
            )
        per_round = ", ".join(
            f"{x:.2f}{' (busy)' if busy else ''}"
            for x, busy in zip(r["ratio_per_round"], (x["busy"] for x in r["rounds"]), strict=True)
        )
        lines.append(
            f"our part of the tool's cost, p50(tool) - p50(constant), median of rounds: {r['ours_p50_ms']:+.3f} ms"
            f" = {r['ratio']:.2f}x p50(read) (rounds: {per_round}; pooled: {r['ours_p50_ms_pooled']:+.3f} ms ="
            f" {r['ratio_pooled']:.2f}x)"
        )
        if "ours_cpu_ms" in r:
            lines.append(
                f"in service CPU per request: {r['ours_cpu_ms']:+.3f} ms = {r['cpu_ratio']:.2f}x the read's "
                f"{r['sides']['read']['server_cpu_ms_per_request']:.3f} ms"
            )
    lines.append("\nTargets")
    for store, r in results["stores"].items():
        verdict = "PASS" if r["ratio"] <= 1.0 else "FAIL"
        lines.append(f"  {verdict}  {store}: (p50 tool - p50 constant) / p50 read = {r['ratio']:.2f} <= 1.0")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loadgen", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="5 rounds of 1 s per side: under a minute")
    parser.add_argument(
        "--smoke", action="store_true", help="seconds: checks the script (figures meaningless)"
    )
    parser.add_argument("--store", choices=("sqlite", "redis", "both"), default="both")
    parser.add_argument(
        "--fraction", type=float, default=0.25, help="the open loop's rate, of the tool side's peak (0.25)"
    )
    parser.add_argument("--rate", type=float, help="the open loop's rate in req/s (instead of --fraction)")
    parser.add_argument(
        "--no-pin", dest="pin", action="store_false", help="let the scheduler place processes"
    )
    parser.add_argument(
        "--profile", action="store_true", help="py-spy profiles of the three sides, per store"
    )
    parser.add_argument("--profile-seconds", type=float, help="seconds of py-spy per side (plan's: 10, 5)")
    parser.add_argument("--max-load", type=float, default=1.5, help="wait while the load average is above it")
    parser.add_argument("--no-wait", action="store_true", help="do not wait for the load average")
    parser.add_argument("--output", type=Path, default=RESULTS / "mcp.json")
    args = parser.parse_args()
    if args.loadgen:
        loadgen_main()
        return
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    stores = ("sqlite", "redis") if args.store == "both" else (args.store,)
    work = Path(tempfile.mkdtemp(prefix="bench-mcp-"))
    results: dict[str, Any] = {
        "machine": versions(),
        "plan": {**plan.__dict__, "mode": "smoke" if args.smoke else "quick" if args.quick else "full"},
        "fraction": args.fraction,
        "stores": {},
    }
    try:
        for store in stores:
            say(f"{store}: starting")
            results["stores"][store] = run_store(store, plan, args, work)
    finally:
        h.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    results["targets"] = [
        {"store": store, "target": "(p50 tool - p50 constant) / p50 read <= 1.0", "pass": r["ratio"] <= 1.0}
        for store, r in results["stores"].items()
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    say(f"results in {args.output}")


if __name__ == "__main__":
    main()
