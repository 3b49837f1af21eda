"""HTTP/1.1 load generator, run as its own process: ``python bench/loadgen.py < spec.json > result.json``.

Two modes:

- ``open``: requests are *scheduled* at fixed intervals (``rate`` per second) whatever the answers do. A
  request whose connection is still busy waits in a backlog, and its latency is counted from its scheduled
  send time, not from when it could be sent: a stall of the server shows as latency of every request that
  should have been sent during it (no coordinated omission, as in wrk2).
- ``closed``: ``connections`` connections each send the next request as soon as the previous answer is in;
  what they achieve is the peak throughput. Latencies from the actual send time are reported too, but
  closed-loop tails under-report stalls: use ``open`` for latency targets.

The client is a small asyncio protocol over keep-alive connections (no pipelining): requests are prebuilt
bytes, answers are parsed just enough to find the status and the end of the body (Content-Length). It is
much cheaper per request than a general client (aiohttp's), so that one process can push several times what
the servers under test can serve; ``bench/run.py`` checks this against ``bench/static_server.py`` and
reports the generator's own CPU use in every run. uvloop is used when installed.

Every request has a kind (``read``, ``end``, ...): latencies are reported per kind and for all together.
The spec (JSON on stdin) is documented in :func:`main`; the answer (JSON on stdout) holds, per kind, the
count, errors (non-2xx/3xx, broken connections), p50/p90/p99/p99.9/max in ms, and the achieved rate.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import json
import os
import random
import resource
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import all_cpu_seconds, caller_phone, cpu_seconds, quote_phone

Request = tuple[str, bytes]  # (kind, raw request bytes)

#: The open-loop ticker wakes up at most once per tick (and sends what is due then).
TICK_S = 0.0002
#: A ticker that wakes up this much later than it asked was not running: a stall of the load generator.
STALL_S = 0.005

PERCENTILES = {"p50": 50.0, "p90": 90.0, "p99": 99.0, "p99_9": 99.9}


# Requests ------------------------------------------------------------------------------------------------


def _get(host: str, path: str, headers: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\n{headers}\r\n".encode()


def _post(host: str, path: str, headers: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\n{headers}"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _auth(spec: dict[str, Any]) -> str:
    token = spec.get("token")
    return f"Authorization: Bearer {token}\r\n" if token else ""


def _read_path(project: str, index: int) -> str:
    return f"/v1/projects/{project}/callers/{quote_phone(caller_phone(index))}/memory"


def end_body(index: int, fields: int, value: str) -> bytes:
    """What the SDK's ``conv.end()`` sends: the caller, ``state``, the outcome, the channel, ``ended_at``."""
    body = {
        "caller": caller_phone(index),
        "state": {f"field_{i}": value for i in range(fields)},
        "outcome": {"qa": "resolved", "handoff_reason": None, "handoff_to": None},
        "channel": "voice",
        "ended_at": datetime.now(UTC).isoformat(timespec="milliseconds"),
    }
    return json.dumps(body, separators=(",", ":")).encode()


class ZipfCallers:
    """Caller indexes in [0, n) with P(rank r) proportional to 1/r**s; ranks are scattered over the
    indexes by a fixed permutation (hot callers are not the first ones, nor in the same buckets)."""

    def __init__(self, n: int, s: float, rng: random.Random) -> None:
        self.n = n
        self.cumulative = list(itertools.accumulate(1.0 / (r**s) for r in range(1, n + 1)))
        self.total = self.cumulative[-1]
        self.rng = rng
        self.step = 2_654_435_761 % n or 1  # coprime with n for the sizes used (powers of ten)
        while _gcd(self.step, n) != 1:
            self.step += 1

    def share_of_top(self, k: int) -> float:
        return self.cumulative[min(k, self.n) - 1] / self.total

    def __call__(self) -> int:
        rank = bisect.bisect_left(self.cumulative, self.rng.random() * self.total)
        return (rank * self.step + 12345) % self.n


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def requests_for(spec: dict[str, Any], stream: int) -> Iterator[Request]:
    """The endless request stream of one run (``stream`` makes conversation ids unique per stream)."""
    scenario = spec["scenario"]
    kind = scenario["type"]
    host = f"{spec['host']}:{spec['port']}"
    headers = _auth(scenario)
    project = scenario.get("project", "bench")
    prefix = f"{scenario.get('id_prefix', 'c')}-{stream}"
    value = "v" * 30  # 32 bytes once JSON-encoded
    if kind == "static":
        raw = _get(host, "/", headers)
        while True:
            yield "static", raw
    if kind == "read":
        paths = [_get(host, _read_path(project, i), headers) for i in range(scenario["callers"])]
        for raw in itertools.cycle(paths):
            yield "read", raw
    if kind == "baseline":
        subjects = scenario["subjects"]
        paths = [_get(host, f"/callers/{s}", headers) for s in subjects]
        for raw in itertools.cycle(paths):
            yield "read", raw
    if kind == "end":
        callers = scenario["callers"]
        for n in itertools.count():
            path = f"/v1/projects/{project}/conversations/{prefix}-{n}/end"
            yield "end", _post(host, path, headers, end_body(n % callers, scenario["state_fields"], value))
    if kind == "mixed":
        yield from _mixed(scenario, host, headers, project, prefix, value)
    raise ValueError(f"unknown scenario {kind!r}")


def _mixed(
    scenario: dict[str, Any], host: str, headers: str, project: str, prefix: str, value: str
) -> Iterator[Request]:
    """Calls in progress, interleaved: each call reads its caller's memory once per turn (``turns`` drawn
    uniformly from [lo, hi]) and then ends with one write; callers follow a Zipf law."""
    rng = random.Random(scenario.get("seed", 1))
    pick = ZipfCallers(scenario["callers"], scenario["zipf_s"], rng)
    lo, hi = scenario["turns"]
    live: list[list[Any]] = []  # [caller, turns left, conversation number]
    numbers = itertools.count()
    while True:
        while len(live) < scenario["concurrent_calls"]:
            live.append([pick(), rng.randint(lo, hi), next(numbers)])
        slot = rng.randrange(len(live))
        call = live[slot]
        if call[1] > 0:
            call[1] -= 1
            yield "read", _get(host, _read_path(project, call[0]), headers)
        else:
            live[slot] = live[-1]
            live.pop()
            path = f"/v1/projects/{project}/conversations/{prefix}-{call[2]}/end"
            yield "end", _post(host, path, headers, end_body(call[0], scenario["state_fields"], value))


# Connections ---------------------------------------------------------------------------------------------


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; ``on_done(conn, status)`` is called when an answer is complete
    (status 0: the connection broke)."""

    def __init__(self, on_done: Callable[[Connection, int], None]) -> None:
        self.on_done = on_done
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need = -1  # bytes of the current answer (headers + body), -1 until the headers are in
        self.status = 0
        self.busy = False
        self.kind = ""
        self.intended = 0.0  # when the request should have been sent (open loop) or was sent
        self.sent = 0.0
        self.lost = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def send(self, kind: str, raw: bytes, intended: float) -> None:
        assert self.transport is not None and not self.busy
        self.busy = True
        self.kind = kind
        self.intended = intended
        self.sent = time.perf_counter()
        self.transport.write(raw)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        while True:
            if self.need < 0:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(buf[:end]).lower()
                self.status = int(head[9:12])
                at = head.find(b"\r\ncontent-length:")
                length = 0
                if at >= 0:
                    stop = head.find(b"\r\n", at + 17)
                    length = int(head[at + 17 : stop if stop >= 0 else len(head)])
                elif b"transfer-encoding: chunked" in head:
                    raise RuntimeError("chunked answers are not supported by this load generator")
                self.need = end + 4 + length
            if len(buf) < self.need:
                return
            del buf[: self.need]
            self.need = -1
            self.busy = False
            self.on_done(self, self.status)
            if not buf:
                return

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.busy:
            self.busy = False
            self.on_done(self, 0)
        if not self.lost.done():
            self.lost.set_result(None)


# Runs ----------------------------------------------------------------------------------------------------


class Recorder:
    """Latencies (seconds) per kind, for requests scheduled inside the measured window."""

    def __init__(self, start: float, stop: float) -> None:
        self.start = start
        self.stop = stop
        self.latency: dict[str, list[float]] = {}
        self.service: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.statuses: dict[str, int] = {}
        self.lag: list[float] = []
        self.timeline: dict[int, float] = {}  # 100 ms slot of the scheduled time -> worst latency in it

    def record(self, conn: Connection, status: int, now: float) -> None:
        if not self.start <= conn.intended < self.stop:
            return
        kind = conn.kind
        self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
        if not 200 <= status < 400:
            self.errors[kind] = self.errors.get(kind, 0) + 1
            return
        self.latency.setdefault(kind, []).append(now - conn.intended)
        slot = int((conn.intended - self.start) * 10)
        if now - conn.intended > self.timeline.get(slot, 0.0):
            self.timeline[slot] = now - conn.intended
        self.service.setdefault(kind, []).append(now - conn.sent)
        self.lag.append(conn.sent - conn.intended)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


def summary(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    out = {name: percentile(values, q) * 1000 for name, q in PERCENTILES.items()}
    out["max"] = values[-1] * 1000 if values else float("nan")
    out["mean"] = sum(values) / len(values) * 1000 if values else float("nan")
    return out


class Run:
    """One measurement: connections, the schedule (open) or the loop (closed), the recorder."""

    #: The connections' protocol (a script of its own may look at more of the answers than the status).
    connection_class: type[Connection] = Connection

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.mode = spec["mode"]
        self.warmup, self.duration = float(spec["warmup"]), float(spec["duration"])
        stream = requests_for(spec, spec.get("stream", 0))
        first = next(
            stream
        )  # builds the scenario's tables (the Zipf law over 1M callers) before the clock starts
        self.stream = itertools.chain([first], stream)
        self.idle: deque[Connection] = deque()
        self.backlog: deque[tuple[float, str, bytes]] = deque()
        self.conns: list[Connection] = []
        self.recorder = Recorder(0.0, 0.0)
        self.broken = 0
        self.inflight = 0
        self.stopping = False
        self.began = 0.0
        self.sent_upto = 0  # open loop: requests handed to connections or the backlog so far
        self.watch: dict[str, int] = {**spec.get("watch", {}), "loadgen": os.getpid()}
        self.cpu_at_start: dict[str, float] = {}
        self.watched_cpu: dict[str, float] = {}
        self.all_sent = False
        self.drained = asyncio.Event()
        self.ticker_late_max = 0.0
        self.ticker_stalls = 0
        self.machine_at_start: dict[int, float] = {}
        self.other_cpu: float | None = None

    def check_drained(self) -> None:
        if self.all_sent and not self.inflight and not self.backlog:
            self.drained.set()

    def on_done(self, conn: Connection, status: int) -> None:
        now = time.perf_counter()
        self.inflight -= 1
        if self.stopping:
            return  # the run is over: connections being closed
        self.recorder.record(conn, status, now)
        if status == 0:
            self.broken += 1
            self.check_drained()
            return  # the connection is gone; it is not reused
        if self.mode == "closed":
            kind, raw = next(self.stream)
            self.inflight += 1
            conn.send(kind, raw, time.perf_counter())
        elif self.backlog:
            intended, kind, raw = self.backlog.popleft()
            self.inflight += 1
            conn.send(kind, raw, intended)
        else:
            self.idle.append(conn)
            self.check_drained()

    def dispatch(self, due: int, interval: float) -> None:
        """Open loop: hand requests up to number ``due`` to idle connections, the rest to the backlog."""
        while self.sent_upto < due:
            kind, raw = next(self.stream)
            intended = self.began + self.sent_upto * interval
            self.sent_upto += 1
            if self.idle:
                self.inflight += 1
                self.idle.popleft().send(kind, raw, intended)
            else:
                self.backlog.append((intended, kind, raw))

    def ticker(
        self, loop: asyncio.AbstractEventLoop, total: int, interval: float, done: asyncio.Future[None]
    ) -> None:
        """Open loop, in its own thread: sleep (precisely: the kernel's timers, not the event loop's
        millisecond ones) until the next request is due, then have the loop send what is due. At most one
        wake-up per TICK_S, so high rates are sent in small batches rather than by spinning."""
        handed = 0
        while handed < total:
            now = time.perf_counter()
            due = min(total, int((now - self.began) / interval) + 1)
            if due > handed:
                loop.call_soon_threadsafe(self.dispatch, due, interval)
                handed = due
            if handed >= total:
                break
            sleep_for = max(TICK_S, self.began + handed * interval - time.perf_counter())
            expected = time.perf_counter() + sleep_for
            time.sleep(sleep_for)
            # Oversleeping by milliseconds means this process was not running: a stall of the load
            # generator (the machine is shared), not of the server; reported with the run.
            late = time.perf_counter() - expected
            self.ticker_late_max = max(self.ticker_late_max, late)
            if late > STALL_S:
                self.ticker_stalls += 1
        loop.call_soon_threadsafe(done.set_result, None)

    def sample_start(self) -> None:
        for name, pid in self.watch.items():
            self.cpu_at_start[name] = cpu_seconds(pid)
        self.machine_at_start = all_cpu_seconds()
        self.cpu_at_start["_t"] = time.perf_counter()

    def sample_end(self) -> None:
        if "_t" in self.cpu_at_start:
            span = time.perf_counter() - self.cpu_at_start["_t"]
            self.watched_cpu = {
                name: (cpu_seconds(pid) - self.cpu_at_start[name]) / span for name, pid in self.watch.items()
            }
            # Every other process on the machine (this is a shared machine): CPU-seconds per second they used.
            ours = set(self.watch.values())
            now = all_cpu_seconds()
            other = sum(t - self.machine_at_start.get(pid, 0.0) for pid, t in now.items() if pid not in ours)
            self.other_cpu = other / span

    async def go(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        for _ in range(self.spec["connections"]):
            _, proto = await loop.create_connection(
                lambda: self.connection_class(self.on_done), self.spec["host"], self.spec["port"]
            )
            self.conns.append(proto)
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        self.began = began = time.perf_counter()
        self.recorder = Recorder(began + self.warmup, began + self.warmup + self.duration)
        loop.call_later(self.warmup, self.sample_start)
        if self.mode == "closed":
            for conn in self.conns:
                kind, raw = next(self.stream)
                self.inflight += 1
                conn.send(kind, raw, time.perf_counter())
            await asyncio.sleep(began + self.warmup + self.duration - time.perf_counter())
            self.sample_end()
        else:
            self.idle.extend(self.conns)
            rate = float(self.spec["rate"])
            done: asyncio.Future[None] = loop.create_future()
            thread = threading.Thread(
                target=self.ticker,
                args=(loop, int((self.warmup + self.duration) * rate), 1.0 / rate, done),
                daemon=True,
            )
            thread.start()
            await done
            self.sample_end()
            # Let the answers to what was scheduled come in (bounded: a dead server must not hang us).
            self.all_sent = True
            self.check_drained()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.drained.wait(), float(self.spec.get("drain", 5.0)))
        self.stopping = True
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
        wall = time.perf_counter() - began
        for conn in self.conns:
            if conn.transport is not None:
                conn.transport.close()
        return self.result((cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime), wall)

    def result(self, cpu_s: float, wall: float) -> dict[str, Any]:
        recorder, duration = self.recorder, self.duration
        unanswered = len(self.backlog) + self.inflight if self.mode == "open" else 0
        result: dict[str, Any] = {"mode": self.mode, "connections": self.spec["connections"], "kinds": {}}
        completed = errors = 0
        for kind in sorted(set(recorder.latency) | set(recorder.errors)):
            lat = recorder.latency.get(kind, [])
            completed += len(lat)
            errors += recorder.errors.get(kind, 0)
            result["kinds"][kind] = {
                "ok": len(lat),
                "errors": recorder.errors.get(kind, 0),
                "rate": len(lat) / duration,
                "latency_ms": summary(lat),
                "service_ms": summary(recorder.service.get(kind, [])),
            }
        result.update(
            {
                "ok": completed,
                "errors": errors + unanswered,
                "unanswered": unanswered,
                "broken_connections": self.broken,
                "statuses": recorder.statuses,
                "achieved_rate": completed / duration,
                "target_rate": float(self.spec["rate"]) if self.mode == "open" else None,
                "scheduled": self.sent_upto,
                "latency_ms": summary([x for v in recorder.latency.values() for x in v]),
                "service_ms": summary([x for v in recorder.service.values() for x in v]),
                "dispatch_lag_ms": summary(recorder.lag),
                "loadgen_stall_ms_max": self.ticker_late_max * 1000 if self.mode == "open" else None,
                "loadgen_stalls_over_5ms": self.ticker_stalls if self.mode == "open" else None,
                "duration_s": duration,
                "watched_cpu_share": self.watched_cpu,
                "other_processes_cpu": self.other_cpu,
                "cpu_s": cpu_s,
                "wall_s": wall,
                "cpu_share": cpu_s / wall,
            }
        )
        if self.spec.get("timeline"):
            result["timeline_ms"] = [
                round(recorder.timeline.get(i, 0.0) * 1000, 2) for i in range(int(duration * 10))
            ]
        return result


def main() -> None:
    """Spec keys: host, port, mode (open|closed), rate (open), connections, warmup, duration (seconds),
    scenario: {type: static|read|baseline|end|mixed, token, project, callers, subjects (baseline),
    state_fields, id_prefix, zipf_s, turns [lo, hi], concurrent_calls, seed}, stream (int), drain (s)."""
    spec = json.loads(sys.stdin.read())
    try:
        import uvloop

        uvloop.install()
        loop_name = "uvloop"
    except ImportError:
        loop_name = "asyncio"
    sys.setswitchinterval(0.0002)  # the ticker thread must get the GIL back quickly
    result = asyncio.run(Run(spec).go())
    result["loop"] = loop_name
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
