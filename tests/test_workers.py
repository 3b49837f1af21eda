"""``caller-memory serve --workers N``: real worker processes on one real port, over a real redis-server.

Which worker served a request is read from the kernel rather than asked of the service: the client keeps
its connection open after the answer, finds the server's end of it in /proc/net/tcp and the worker process
that holds that socket in /proc/<pid>/fd.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import OPERATOR_TOKEN, PSEUDONYM_KEY
from tests.support.redis_server import RedisServer
from tests.support.service_process import SERVE, ServiceProcess, free_port

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux /proc")

WORKERS = 2
#: The propagation bounds the service is started with (CALLER_MEMORY_CONFIG/TOKEN_CACHE_SECONDS).
CACHE_SECONDS = 1.0
#: Slack on top of the bound: one store round trip and the scheduling of a loaded machine.
MARGIN_S = 0.5
START_TIMEOUT_S = 20.0


# Processes -------------------------------------------------------------------------------------------------


def child_pids(parent: int) -> list[int]:
    """Live (not zombie) children of ``parent``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(ppid) == parent and state != "Z":
            found.append(int(entry.name))
    return sorted(found)


def holder_of_connection(port: int, client_port: int, pids: list[int]) -> int:
    """The process among ``pids`` that holds the server end of the TCP connection from ``client_port``."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote = fields[1], fields[2]
        if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == client_port:
            inode = fields[9]
    assert inode is not None, "the server end of the connection is not in /proc/net/tcp"
    for pid in pids:
        with contextlib.suppress(OSError):  # a worker that just exited
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                        return pid
    raise AssertionError(f"no worker among {pids} holds the connection")


class Supervised(ServiceProcess):
    """``caller-memory serve --workers N`` as a real process group over ``store_url``, its log in ``workdir``."""

    def __init__(self, store_url: str, workdir: Path, workers: int = WORKERS) -> None:
        settings = {
            "CALLER_MEMORY_CONFIG_CACHE_SECONDS": str(CACHE_SECONDS),
            "CALLER_MEMORY_TOKEN_CACHE_SECONDS": str(CACHE_SECONDS),
            "CALLER_MEMORY_SWEEP_INTERVAL": "3600",  # none during the test
        }
        super().__init__(store_url, workdir, "--workers", str(workers), env=settings, access_log=False)
        # Returns once every worker serves (the supervisor says so in its "listening on" line).
        self.start(START_TIMEOUT_S)

    def workers(self) -> list[int]:
        return child_pids(self.proc.pid)

    def call(self, method: str, path: str, token: str | None = None, body: Any = None) -> Answer:
        """One request over a fresh connection; the answer says which worker process served it."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.connect()
            assert conn.sock is not None
            client_port = conn.sock.getsockname()[1]
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            data = None
            if body is not None:
                data = json.dumps(body).encode()
                headers["Content-Type"] = "application/json"
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            # The connection is still open (keep-alive): its server end tells the worker.
            pid = holder_of_connection(self.port, client_port, self.workers())
        finally:
            conn.close()
        is_json = response.getheader("Content-Type", "").split(";")[0].endswith("json")
        return Answer(response.status, json.loads(raw) if raw and is_json else raw.decode(), pid)

    def stop(self, sig: int = signal.SIGTERM) -> int | None:
        return super().stop(sig)  # as a process manager stops it


@dataclass
class Answer:
    status: int
    body: Any
    pid: int


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of the metric family ``name``: labels -> value."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
    }


def healthz_count(text: str) -> float:
    samples = metric_samples(text, "caller_memory_http_requests")
    return samples.get((("method", "GET"), ("route", "/healthz"), ("status", "200")), 0.0)


def worker_requests(text: str) -> dict[int, float]:
    return {int(dict(k)["pid"]): v for k, v in metric_samples(text, "caller_memory_worker_requests").items()}


def until_every_worker(
    service: Supervised, send: Callable[[], Answer], timeout: float = 10.0
) -> list[Answer]:
    """Call ``send()`` until each worker has served at least one of the answers."""
    answers: list[Answer] = []
    deadline = time.monotonic() + timeout
    while True:
        answers.append(send())
        served = [a.pid for a in answers]
        if set(service.workers()) <= set(served):
            return answers
        assert time.monotonic() < deadline, f"not every worker served within {timeout} s: {served}"


@pytest.fixture(scope="module")
def service(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervised]:
    supervised = Supervised(redis_server.url, tmp_path_factory.mktemp("workers"))
    try:
        yield supervised
    finally:
        supervised.stop()


def new_project(service: Supervised, state_keys: list[str]) -> str:
    project = f"w-{uuid.uuid4().hex[:10]}"
    config = {"memory": {"repeat_caller": {"state_keys": state_keys}}}
    assert service.call("PUT", f"/v1/projects/{project}", OPERATOR_TOKEN, config).status == 201
    return project


# Tests -----------------------------------------------------------------------------------------------------


def environ(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def test_fresh_connections_reach_both_workers_and_metrics_add_up(service: Supervised) -> None:
    pids = service.workers()
    assert len(pids) == WORKERS
    # One worker schedules sweeps; the lease would stop overlaps, not N sweeps per interval.
    intervals = sorted(environ(pid)["CALLER_MEMORY_SWEEP_INTERVAL"] for pid in pids)
    assert intervals == ["0", "3600"]
    before = healthz_count(service.call("GET", "/metrics").body)
    answers = [service.call("GET", "/healthz") for _ in range(40)]
    assert all(a.status == 200 for a in answers)
    served = [a.pid for a in answers]
    assert set(served) == set(pids), f"one worker served everything: {served}"

    # Every scrape counts every worker's requests, whichever worker answers it.
    scrapes = until_every_worker(service, lambda: service.call("GET", "/metrics"))
    assert {healthz_count(s.body) - before for s in scrapes} == {40}
    per_worker = worker_requests(scrapes[-1].body)
    assert set(per_worker) == set(pids)
    for pid in pids:
        assert per_worker[pid] >= served.count(pid)


def test_the_kernel_balances_connections_between_the_workers(service: Supervised) -> None:
    """Each worker listens on a socket of its own (SO_REUSEPORT): the kernel spreads connections evenly, so
    a client that opens them one after the other (the worst case for one shared socket, where whichever
    worker wakes first accepts) still reaches both about equally. Per connection the choice is a hash: 200
    connections fall outside 30-70% about once in 10^8 runs."""
    served = [service.call("GET", "/healthz").pid for _ in range(200)]
    shares = {pid: served.count(pid) / len(served) for pid in service.workers()}
    assert all(0.3 <= share <= 0.7 for share in shares.values()), shares
    # Long-lived connections opened together are spread too (each is one hash).
    held = []
    try:
        for _ in range(16):
            conn = socket.create_connection(("127.0.0.1", service.port), 10)
            held.append(conn)
        deadline = time.monotonic() + 5
        while True:  # a connection not accepted yet has no holder: ask again
            try:
                owners = [
                    holder_of_connection(service.port, c.getsockname()[1], service.workers()) for c in held
                ]
                break
            except AssertionError:
                assert time.monotonic() < deadline, "the workers did not accept the connections"
                time.sleep(0.02)
    finally:
        for conn in held:
            conn.close()
    assert len(set(owners)) == WORKERS, owners


def test_a_configuration_change_reaches_every_worker_within_the_bound(service: Supervised) -> None:
    project = new_project(service, ["a"])
    path = f"/v1/projects/{project}/callers/+14155550100/memory"
    # Every worker now holds the configuration that refuses "b".
    warm = until_every_worker(service, lambda: service.call("PATCH", path, OPERATOR_TOKEN, {"b": 1}))
    assert {a.status for a in warm} == {422}

    config = {"memory": {"repeat_caller": {"state_keys": ["a", "b"]}}}
    assert service.call("PUT", f"/v1/projects/{project}", OPERATOR_TOKEN, config).status == 200
    deadline = time.monotonic() + CACHE_SECONDS + MARGIN_S

    # Before the deadline a worker may still refuse "b" (that is not asserted either way); after it, none.
    late: list[Answer] = []
    while time.monotonic() < deadline + 5:
        sent_at = time.monotonic()
        answer = service.call("PATCH", path, OPERATOR_TOKEN, {"b": 1})
        assert answer.status in (200, 422), answer.body
        if sent_at >= deadline:
            late.append(answer)
            assert answer.status == 200, f"worker {answer.pid} still refuses 'b' after the bound"
            if all([a.pid for a in late].count(pid) >= 3 for pid in service.workers()):
                break
        time.sleep(0.01)
    assert {a.pid for a in late} == set(service.workers())


def test_a_token_revocation_reaches_every_worker_within_the_bound(service: Supervised) -> None:
    project = new_project(service, ["a"])
    minted = service.call("POST", f"/v1/projects/{project}/tokens", OPERATOR_TOKEN, {"role": "agent"})
    assert minted.status == 201
    token = minted.body["token"]
    path = f"/v1/projects/{project}/callers/+14155550100/memory"
    warm = until_every_worker(service, lambda: service.call("GET", path, token))
    assert {a.status for a in warm} == {200}

    revoked = service.call(
        "DELETE", f"/v1/projects/{project}/tokens/{minted.body['token_id']}", OPERATOR_TOKEN
    )
    assert revoked.status == 204
    deadline = time.monotonic() + CACHE_SECONDS + MARGIN_S

    late: list[Answer] = []
    while time.monotonic() < deadline + 5:
        sent_at = time.monotonic()
        answer = service.call("GET", path, token)
        # 429: the address failed too often lately; it is given only to requests that fail to authenticate.
        assert answer.status in (200, 401, 429), answer.body
        if sent_at >= deadline:
            late.append(answer)
            assert answer.status in (401, 429), f"worker {answer.pid} still accepts the token after the bound"
            if all([a.pid for a in late].count(pid) >= 3 for pid in service.workers()):
                break
        time.sleep(0.01)
    assert {a.pid for a in late} == set(service.workers())


def test_a_killed_worker_is_replaced_and_sigterm_stops_everything(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    service = Supervised(redis_server.url, tmp_path)
    try:
        pids = service.workers()
        metrics_dir = Path(environ(pids[0])["PROMETHEUS_MULTIPROC_DIR"])
        assert metrics_dir.is_dir()
        first = until_every_worker(service, lambda: service.call("GET", "/healthz"))
        sent = len(first)
        victim = first[0].pid

        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while True:  # the port keeps serving while the supervisor replaces the worker
            assert service.call("GET", "/healthz").status == 200
            sent += 1
            current = service.workers()
            if len(current) == WORKERS and victim not in current:
                break
            assert time.monotonic() < deadline, f"no replacement for {victim}:\n{service.log[-2000:]}"
            time.sleep(0.02)
        (replacement,) = set(current) - set(pids)
        answers = until_every_worker(service, lambda: service.call("GET", "/healthz"))
        sent += len(answers)
        assert replacement in {a.pid for a in answers}
        assert "exited unexpectedly (killed by SIGKILL)" in service.log

        # The dead worker's live gauge is gone; its counts are not (the sum never goes back).
        text = service.call("GET", "/metrics").body
        assert set(worker_requests(text)) == set(current)
        assert healthz_count(text) == sent
    finally:
        service.send_signal(signal.SIGTERM)
        started = time.monotonic()
        try:
            returncode = service.wait(10)
        finally:
            service.stop()
    assert returncode == 0, service.log[-3000:]
    assert time.monotonic() - started < 5
    for pid in current:
        assert not Path(f"/proc/{pid}").exists(), f"worker {pid} outlived the supervisor"
    assert not metrics_dir.exists()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", service.port), 2):
        pass


def test_workers_that_cannot_start_give_one_clear_error(tmp_path: Path) -> None:
    nothing_there = f"redis://127.0.0.1:{free_port()}/0"
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    result = run_serve(
        tmp_path, "--workers", "3", env={"CALLER_MEMORY_STORE": nothing_there, "TMPDIR": str(private_tmp)}
    )
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert "could not start: Redis" in errors[0] and "connecting to 127.0.0.1" in errors[0]
    assert "Traceback" not in result.stderr
    assert list(private_tmp.iterdir()) == []  # the metrics directory was removed


def run_serve(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SERVE, "--port", str(free_port()), *args],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM_KEY.decode(),
            "CALLER_MEMORY_STORE": f"sqlite:///{tmp_path}/memory.db",
            **(env or {}),
        },
        cwd=tmp_path,
        timeout=30,
    )


@pytest.mark.parametrize("value", ["0", "65", "two", "1.5", "-1"])
def test_bad_worker_counts_are_refused(tmp_path: Path, value: str) -> None:
    by_option = run_serve(tmp_path, f"--workers={value}")
    assert by_option.returncode == 2
    assert f"argument --workers: must be a whole number from 1 to 64, not '{value}'" in by_option.stderr
    by_env = run_serve(tmp_path, env={"CALLER_MEMORY_WORKERS": value})
    assert by_env.returncode == 2
    assert f"CALLER_MEMORY_WORKERS must be a whole number from 1 to 64, not '{value}'" in by_env.stderr
    assert not (tmp_path / "memory.db").exists()


def test_several_workers_on_sqlite_are_refused_with_the_reason(tmp_path: Path) -> None:
    result = run_serve(tmp_path, "--workers", "2")
    assert result.returncode == 2
    assert "2 workers (--workers, CALLER_MEMORY_WORKERS) need a Redis store" in result.stderr
    assert "SQLite" in result.stderr and "file lock" in result.stderr
    assert not (tmp_path / "memory.db").exists()  # refused before anything was opened
