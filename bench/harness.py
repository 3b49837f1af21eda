"""Processes and data for the benchmarks: servers (each its own OS process), CPU accounting, fast prefill.

Every process started here is registered and ended (by its own pid) when the run ends, normally or not.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from caller_memory.service.domain.fields import StoredField  # noqa: E402
from caller_memory.service.storage.redis import keys  # noqa: E402
from common import FIELDS, PROJECT, VALUE, caller_phone, cpu_seconds, pseudonym  # noqa: E402, F401

from tests.support.redis_server import SHIPPED_CONFIG, RedisServer  # noqa: E402

OPERATOR_TOKEN = "bench-operator-token-0123456789abcdef"


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Wait until ``url`` answers 200 (the service, the baseline or the static server: not only ours, so not
    the tests' harness); fail with the end of the process's log if it exits or is too slow."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)


HOUR_MS = 3_600_000
RETENTION_MS = 30 * 24 * HOUR_MS

_started: list[subprocess.Popen[bytes]] = []
_redis: list[RedisServer] = []


# Processes -----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pin(pid: int, cpus: set[int] | None) -> None:
    """Pin every thread of ``pid`` to ``cpus`` (None: leave it to the scheduler)."""
    if cpus is None:
        return
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(tid), cpus)


def spawn(
    cmd: Sequence[str], *, log: Path, env: dict[str, str] | None = None, cpus: set[int] | None = None
) -> subprocess.Popen[bytes]:
    """Start a long-lived process (pinned from its first instruction when ``cpus`` is given)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(log.parent),
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None,
        )
    _started.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc in _started:
        _started.remove(proc)


def start_redis(*, shipped_config: bool = False, cpus: set[int] | None = None) -> RedisServer:
    """A private redis-server: no persistence (``--save "" --appendonly no``), or deploy/redis.conf as
    shipped (AOF, ``appendfsync always``)."""
    server = RedisServer(config_file=SHIPPED_CONFIG) if shipped_config else RedisServer()
    server.start()
    _redis.append(server)
    pin(server.pid, cpus)
    return server


def stop_redis(server: RedisServer) -> None:
    server.close()
    if server in _redis:
        _redis.remove(server)


def stop_all() -> None:
    # Copies: stop() and stop_redis() remove what they stop from these lists.
    for proc in _started.copy():
        with contextlib.suppress(Exception):
            stop(proc)
    for server in _redis.copy():
        with contextlib.suppress(Exception):
            stop_redis(server)


class Server:
    """One HTTP server process under test."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.name = name
        self.proc = proc
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"

    @property
    def pid(self) -> int:
        return self.proc.pid


def start_service(
    name: str, store_url: str, workdir: Path, pseudonym_key: bytes, cpus: set[int] | None, **env: str
) -> Server:
    """``python -m caller_memory.service serve`` with the default settings (log level INFO, access log off:
    nothing here sets CALLER_MEMORY_ACCESS_LOG, so it is off unless the calling environment sets it), except
    that scheduled sweeps are off (CALLER_MEMORY_SWEEP_INTERVAL=0) so that none runs in the middle of a
    measurement. ``env`` adds or overrides variables (``service-redis-quiet`` sets log level WARNING)."""
    port = free_port()
    log = workdir / f"{name}.log"
    environ = {
        **os.environ,
        "CALLER_MEMORY_PSEUDONYM_KEY": pseudonym_key.decode(),
        "CALLER_MEMORY_OPERATOR_TOKEN": OPERATOR_TOKEN,
        "CALLER_MEMORY_STORE": store_url,
        "CALLER_MEMORY_SWEEP_INTERVAL": "0",
        **env,
    }
    cmd = [sys.executable, "-m", "caller_memory.service", "serve", "--port", str(port)]
    proc = spawn(cmd, log=log, env=environ, cpus=cpus)
    wait_http(f"http://127.0.0.1:{port}/readyz", proc, log, 30.0)
    return Server(name, proc, port, log)


def start_baseline(redis_url: str, workdir: Path, cpus: set[int] | None) -> Server:
    port = free_port()
    log = workdir / "baseline.log"
    cmd = [sys.executable, str(BENCH / "baseline_app.py"), "--port", str(port), "--redis", redis_url]
    proc = spawn(cmd, log=log, cpus=cpus)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, log, 30.0)
    return Server("baseline", proc, port, log)


def start_transcript_baseline(redis_url: str, workdir: Path, cpus: set[int] | None) -> Server:
    """bench/transcript_baseline.py (lists of messages: RPUSH, LRANGE, HGETALL) on ``redis_url``."""
    port = free_port()
    log = workdir / "transcript-baseline.log"
    cmd = [sys.executable, str(BENCH / "transcript_baseline.py"), "--port", str(port), "--redis", redis_url]
    proc = spawn(cmd, log=log, cpus=cpus)
    wait_http(f"http://127.0.0.1:{port}/healthz", proc, log, 30.0)
    return Server("baseline", proc, port, log)


def start_static(workdir: Path, cpus: set[int] | None) -> Server:
    port = free_port()
    log = workdir / "static.log"
    proc = spawn([sys.executable, str(BENCH / "static_server.py"), "--port", str(port)], log=log, cpus=cpus)
    wait_http(f"http://127.0.0.1:{port}/", proc, log, 30.0)
    return Server("static", proc, port, log)


# HTTP set-up ---------------------------------------------------------------------------------------------


def http(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def create_project(server: Server, *, analytics: bool = True, project: str = PROJECT) -> str:
    """A project (state_keys field_0..field_9, 30-day retention) and an agent token for it."""
    config = {
        "memory": {
            "repeat_caller": {
                "analytics_enabled": analytics,
                "state_keys": FIELDS,
                "retention": "P30D",
            }
        }
    }
    status, body = http("PUT", f"{server.url}/v1/projects/{project}", OPERATOR_TOKEN, config)
    if status not in (200, 201):
        raise RuntimeError(f"creating the project failed: {status} {body}")
    status, body = http(
        "POST", f"{server.url}/v1/projects/{project}/tokens", OPERATOR_TOKEN, {"role": "agent"}
    )
    if status != 201:
        raise RuntimeError(f"minting a token failed: {status} {body}")
    token: str = body["token"]
    return token


# Prefill -------------------------------------------------------------------------------------------------


def subjects(key: bytes, count: int) -> list[str]:
    return [pseudonym(key, PROJECT, caller_phone(i)) for i in range(count)]


def _resp(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def fill_redis(server: RedisServer, subs: Iterable[str], now_ms: int, chunk: int = 20_000) -> int:
    """Write callers in the service's own layout (what ``patch_fields`` leaves for 10 fields written at
    ``now_ms``): the hash of packed fields, its PEXPIREAT, its member in its bucket's expiry index. Sent as
    raw pipelined RESP over one socket: a million callers take seconds."""
    expires = now_ms + RETENTION_MS
    packed = StoredField(VALUE, expires, now_ms).packed()
    hash_args: list[bytes] = []
    for name in FIELDS:
        hash_args += [name.encode(), packed]
    exp = b"%d" % expires
    sock = socket.create_connection(("127.0.0.1", server.port))
    sent = 0
    try:
        batch: list[bytes] = []

        def flush() -> None:
            nonlocal batch
            if not batch:
                return
            sock.sendall(b"".join(batch))
            expected = len(batch)
            got = 0
            buf = b""
            while got < expected:
                data = sock.recv(1 << 20)
                if not data:
                    raise RuntimeError("redis closed the connection during the prefill")
                buf += data
                lines = buf.split(b"\r\n")
                buf = lines.pop()
                for line in lines:
                    if line.startswith(b"-"):
                        raise RuntimeError(f"redis refused a prefill command: {line.decode()}")
                got += len(lines)
            batch = []

        for subject in subs:
            memory_key = keys.memory_key(PROJECT, subject).encode()
            index_key = keys.caller_index_key(subject).encode()
            member = keys.index_member(PROJECT, subject).encode()
            batch.append(_resp(b"HSET", memory_key, *hash_args))
            batch.append(_resp(b"PEXPIREAT", memory_key, exp))
            batch.append(_resp(b"ZADD", index_key, exp, member))
            sent += 1
            if len(batch) >= chunk * 3:
                flush()
        flush()
    finally:
        sock.close()
    return sent


def fill_sqlite(path: Path, subs: Sequence[str], now_ms: int) -> None:
    """Rows of ``fields`` as the SQLite store writes them (JSON value, expires_at, written_at), inserted in
    primary-key order in one transaction. The service must have created the schema first."""
    expires = now_ms + RETENTION_MS
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT INTO fields (project, subject, name, value, expires_at, written_at) VALUES (?, ?, ?, ?, ?, ?)",
            _rows(sorted(subs), expires, now_ms),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def _rows(subs: Iterable[str], expires: int, now_ms: int) -> Iterator[tuple[str, str, str, bytes, int, int]]:
    for subject in subs:
        for name in FIELDS:
            yield (PROJECT, subject, name, VALUE, expires, now_ms)


def redis_info(server: RedisServer, section: str = "memory") -> dict[str, Any]:
    client = server.client()
    try:
        info: dict[str, Any] = client.info(section)
        return info
    finally:
        client.close()


def run_loadgen(
    command: list[str], spec: dict[str, Any], cpus: set[int] | None, server: str, kind: str
) -> dict[str, Any]:
    """One load-generator process (``command``, fed ``spec`` on stdin, pinned to ``cpus``): its result,
    labelled with the server and scenario, and the server's requests per CPU-second when it was watched."""
    proc = subprocess.run(
        command,
        input=json.dumps(spec).encode(),
        capture_output=True,
        timeout=spec["warmup"] + spec["duration"] + 120,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus is not None else None,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"load generator failed against {server}: {proc.stderr.decode()[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    result["server"] = server
    result["scenario"] = kind
    cpu = result.get("watched_cpu_share", {})
    if cpu.get("server"):
        result["requests_per_server_cpu_s"] = result["achieved_rate"] / cpu["server"]
    return result
