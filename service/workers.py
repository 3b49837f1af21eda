"""Several service processes on one port: ``caller-memory serve --workers N``.

The supervisor (the ``serve`` process itself) binds the listening sockets and starts N workers, each a fresh
``python -m caller_memory.service serve`` that inherits the file descriptors of its own listening socket (one
per address) and accepts from it. The N sockets of an address are bound with ``SO_REUSEPORT``, so the kernel
spreads new connections over them evenly (by a hash of each connection's addresses and ports), whatever the
client's connection pattern. Before, the workers shared one socket, and whichever woke first accepted: with a
few long-lived connections (a load balancer's, a benchmark's) every connection could land on one worker.

What sharing one socket gave, and how this keeps it:

- the port is bound by the supervisor alone, all N sockets before any worker starts: a bind error (port
  taken, no permission) is reported once, and the port stays bound for as long as the supervisor runs;
- a worker that dies loses no connection: the supervisor keeps every worker's socket open, so connections
  the kernel queued on a dead worker's socket wait there for its replacement (the restart back-off: 0.5 s,
  longer for a worker that keeps crashing) instead of being reset;
- ``SO_REUSEPORT`` lets another process of the same user (Linux checks the user) bind the port too and take a
  share of the connections: run the service under a user of its own, as the deployment files do.

``caller_memory_worker_requests`` on /metrics shows the split.

Workers are exec'd rather than forked: each starts from a clean interpreter (no inherited event loop,
threads or store connections), and prometheus_client must see ``PROMETHEUS_MULTIPROC_DIR`` when it is
imported, which the supervisor puts in the workers' environment. The store URL is passed the same way, so
a Redis password never appears on a command line.

Supervisor and worker talk over a socket pair, one per worker. The worker writes ``ready`` once its store
is open, or ``failed <JSON string>`` if it cannot start (the supervisor prints that once, instead of N
workers printing N tracebacks), and watches its end: end of file means the supervisor is gone, and the
worker shuts down rather than linger as an orphan. Workers run in their own process group, so a Ctrl-C in
a terminal reaches the supervisor only, which stops them once, in order.

Scheduled sweeps run in worker 1 only (the others get ``CALLER_MEMORY_SWEEP_INTERVAL=0``): the store's lease
already keeps sweeps from overlapping, but N schedulers would still sweep N times per interval. A sweep
asked for over HTTP runs in whichever worker gets the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .config import LISTEN_BACKLOG
from .logs import mask_text

log = logging.getLogger("caller_memory.workers")

#: Wait before restarting a worker that exited: doubles with each quick exit of that worker, up to the cap.
RESTART_BACKOFF_S = 0.5
MAX_RESTART_BACKOFF_S = 30.0
#: A worker that ran this long before it exited was not crash-looping: its back-off starts over.
STABLE_AFTER_S = 30.0
#: A worker that has not opened its store by then is killed, and counts as a failed start.
START_TIMEOUT_S = 60.0
#: Give up (exit 1) after this many failed starts in a row, with no worker becoming ready in between.
MAX_START_FAILURES = 5
#: After SIGTERM, the workers get this long to finish the requests in flight; then they are killed.
STOP_TIMEOUT_S = 30.0
#: The listen backlog (the same as `serve` with one process).
BACKLOG = LISTEN_BACKLOG

_READY = b"ready\n"
_FAILED = b"failed "
_MAX_MESSAGE_CHARS = 8000


def bind_listeners(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """Bind and listen on every address ``host`` resolves to, as asyncio's ``create_server`` would
    (``SO_REUSEADDR``; IPv6 sockets are IPv6-only so that they can sit next to IPv4 ones); with
    ``reuse_port``, ``SO_REUSEPORT`` too, so that more sockets may be bound to the same addresses."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind_worker_listeners(host: str, port: int, workers: int) -> list[list[socket.socket]]:
    """The listening sockets of ``workers`` workers: one list per worker, one socket per address, all
    ``SO_REUSEPORT`` on the same port (the first list's, when ``port`` is 0), so the kernel balances new
    connections between them."""
    groups = [bind_listeners(host, port, reuse_port=True)]
    try:
        port = groups[0][0].getsockname()[1]
        while len(groups) < workers:
            groups.append(bind_listeners(host, port, reuse_port=True))
    except OSError:
        for group in groups:
            for sock in group:
                sock.close()
        raise
    return groups


class WorkersFailed(RuntimeError):
    """The workers could not be started (the message says why)."""


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"


# The worker's side ----------------------------------------------------------------------------------------


class SupervisorLink:
    """A worker's end of its socket pair with the supervisor."""

    def __init__(self, fd: int) -> None:
        self._sock = socket.socket(fileno=fd)
        self.is_ready = False

    async def ready(self) -> None:
        """Tell the supervisor that this worker serves; from now on, shut down if the supervisor goes."""
        loop = asyncio.get_running_loop()
        self._sock.sendall(_READY)  # a few bytes into an empty buffer: does not block
        self.is_ready = True
        self._sock.setblocking(False)
        loop.add_reader(self._sock.fileno(), self._on_readable, loop)

    def _on_readable(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            data = self._sock.recv(256)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            return  # the supervisor sends nothing today
        loop.remove_reader(self._sock.fileno())
        log.warning("the supervisor has gone away: shutting down")
        # The same graceful shutdown as an operator's SIGTERM (aiohttp's handler).
        signal.raise_signal(signal.SIGTERM)

    def failed(self, message: str) -> None:
        """Report why this worker could not start; the supervisor prints it (once), masked as log lines are
        (a traceback may quote anything)."""
        text = json.dumps(mask_text(message)[-_MAX_MESSAGE_CHARS:]).encode()
        with contextlib.suppress(OSError):
            self._sock.setblocking(True)
            self._sock.sendall(_FAILED + text + b"\n")


# The supervisor -------------------------------------------------------------------------------------------


@dataclass
class _Worker:
    number: int
    process: asyncio.subprocess.Process | None = None
    #: Exits in a row soon after starting: sets the back-off before the next start.
    quick_exits: int = 0
    started_at: float = 0.0
    #: The process reported ready (its event loop runs and handles SIGTERM); False while it starts.
    ready: bool = False


class Supervisor:
    """Keeps ``workers`` worker processes running until SIGTERM or SIGINT.

    ``command`` starts one worker, without the ``--worker-listen FDS --worker-control FD`` arguments the
    supervisor appends; ``groups`` are the listening sockets of each worker (see
    :func:`bind_worker_listeners`), which worker *n* inherits whenever it (re)starts; ``metrics_dir`` is
    prometheus_client's multi-process directory (the workers' environment must name it).
    """

    def __init__(
        self,
        workers: int,
        *,
        command: Sequence[str],
        env: Mapping[str, str],
        groups: Sequence[Sequence[socket.socket]],
        metrics_dir: str,
        url: str,
    ) -> None:
        if len(groups) != workers:
            raise ValueError("one group of listening sockets per worker")
        self._workers = [_Worker(n) for n in range(1, workers + 1)]
        self._command = list(command)
        self._env = dict(env)
        self._fds = [[sock.fileno() for sock in group] for group in groups]
        self._metrics_dir = metrics_dir
        self._url = url
        self._stop = asyncio.Event()
        #: Workers that got ready since the supervisor started; all of them: the service is up.
        self._first_ready: set[int] = set()
        self._serving = False
        self._start_failures = 0
        self._last_failure = ""
        #: Why the supervisor gave up, if it did.
        self.failure: str | None = None

    async def run(self) -> int:
        """Run until stopped; 0 after a requested stop, 1 if workers kept failing to start."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal)
        try:
            keepers = [asyncio.create_task(self._keep(worker)) for worker in self._workers]
            await self._stop.wait()
            # Workers still starting are not signalled: one that is failing on its own (when a start-up
            # failure stops the supervisor, the others usually fail the same way) may be closing its event
            # loop, and a signal in that window makes Python print a traceback about the loop's closed
            # wakeup fd. They exit by themselves, or get SIGTERM once ready (_wait_ready).
            self._signal_all(signal.SIGTERM, ready_only=True)
            _, pending = await asyncio.wait(keepers, timeout=STOP_TIMEOUT_S)
            clean = not pending
            if pending:
                log.error("workers still running %.0f s after SIGTERM: killing them", STOP_TIMEOUT_S)
                self._signal_all(signal.SIGKILL)
                await asyncio.wait(pending)
            for keeper in keepers:
                keeper.result()  # a bug in the supervisor must not pass silently
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(signum)
        if self.failure is not None:
            return 1
        log.info("all workers stopped")
        return 0 if clean else 1

    def _on_signal(self) -> None:
        if self._stop.is_set():
            log.warning("second signal: killing the workers now")
            self._signal_all(signal.SIGKILL)
            return
        log.info("stopping %d workers", len(self._workers))
        self._stop.set()

    def _signal_all(self, signum: signal.Signals, *, ready_only: bool = False) -> None:
        for worker in self._workers:
            if ready_only and not worker.ready:
                continue
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signum)

    def _give_up(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
        self._stop.set()

    async def _keep(self, worker: _Worker) -> None:
        try:
            await self._keep_running(worker)
        except Exception:
            # A bug here must not leave the supervisor waiting for a stop with one slot empty.
            self._give_up(f"the supervisor failed while running worker {worker.number} (see the traceback)")
            raise

    async def _keep_running(self, worker: _Worker) -> None:
        """Run one worker slot: start, wait for the exit, back off, start again."""
        while not self._stop.is_set():
            ready, message, returncode = await self._run_once(worker)
            if self._stop.is_set():
                return
            lived = time.monotonic() - worker.started_at
            if lived >= STABLE_AFTER_S:
                worker.quick_exits = 0
            delay = min(MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S * 2**worker.quick_exits)
            worker.quick_exits += 1
            if ready:
                log.warning(
                    "worker %d exited unexpectedly (%s); restarting it in %.1f s",
                    worker.number,
                    describe_exit(returncode),
                    delay,
                )
            elif not self._failed_start(worker, message or describe_exit(returncode), delay):
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stop.wait()

    def _failed_start(self, worker: _Worker, message: str, delay: float) -> bool:
        """Count a failed start; False when the supervisor gives up."""
        self._start_failures += 1
        if not self._serving:
            # At start-up, fail fast, as `serve` with one process does: the cause (an unreachable store,
            # a bad setting) is the same for every worker, and the operator is watching.
            self._give_up(f"worker {worker.number} could not start: {message}")
            return False
        if self._start_failures >= MAX_START_FAILURES:
            self._give_up(
                f"workers failed to start {self._start_failures} times in a row; the last: {message}"
            )
            return False
        if message != self._last_failure:
            log.error("worker %d could not start: %s; retrying in %.1f s", worker.number, message, delay)
        else:
            log.warning(
                "worker %d could not start (the same error); retrying in %.1f s", worker.number, delay
            )
        self._last_failure = message
        return True

    async def _run_once(self, worker: _Worker) -> tuple[bool, str, int]:
        """Start the worker and wait until it exits: (whether it got ready, why it failed, exit status)."""
        ours, theirs = socket.socketpair()
        worker.started_at = time.monotonic()
        fds = self._fds[worker.number - 1]
        try:
            process = await asyncio.create_subprocess_exec(
                *self._command,
                "--worker-listen",
                ",".join(str(fd) for fd in fds),
                "--worker-control",
                str(theirs.fileno()),
                pass_fds=[*fds, theirs.fileno()],
                env=self._env if worker.number == 1 else self._env | {"CALLER_MEMORY_SWEEP_INTERVAL": "0"},
                stdin=subprocess.DEVNULL,
                process_group=0,
            )
        except OSError as exc:
            ours.close()
            return False, f"cannot start a process: {exc}", -1
        finally:
            theirs.close()
        worker.process = process
        writer: asyncio.StreamWriter | None = None
        try:
            reader, writer = await asyncio.open_unix_connection(sock=ours, limit=4 * _MAX_MESSAGE_CHARS)
            ready, message = await self._wait_ready(worker, process, reader)
            returncode = await process.wait()
        finally:
            if writer is not None:
                writer.close()
            else:
                ours.close()
            worker.process = None
            worker.ready = False
            self._forget(process.pid)
        return ready, message, returncode

    async def _wait_ready(
        self, worker: _Worker, process: asyncio.subprocess.Process, reader: asyncio.StreamReader
    ) -> tuple[bool, str]:
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                line = await reader.readline()
        except TimeoutError:
            process.kill()
            return False, f"it did not get ready within {START_TIMEOUT_S:.0f} s"
        except ValueError:  # a message longer than the limit: not from our worker
            return False, "it sent an unreadable message"
        if line == _READY:
            worker.ready = True
            self._ready(worker, process.pid)
            if self._stop.is_set():  # the stop came while it was starting
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
            return True, ""
        if line.startswith(_FAILED):
            try:
                return False, str(json.loads(line[len(_FAILED) :]))
            except ValueError:
                return False, "it sent an unreadable message"
        return False, ""  # it exited before a word: its own output says why

    def _ready(self, worker: _Worker, pid: int) -> None:
        self._start_failures = 0
        self._last_failure = ""
        if self._serving:
            log.info("worker %d (pid %d) serves again", worker.number, pid)
        else:
            self._first_ready.add(worker.number)
            if len(self._first_ready) == len(self._workers):
                self._serving = True
                log.info(
                    "listening on %s with %d worker processes (API description at /openapi.json)",
                    self._url,
                    len(self._workers),
                )

    def _forget(self, pid: int) -> None:
        """Drop a dead worker's live gauges (its counters stay, so the sums never go back)."""
        from prometheus_client.multiprocess import mark_process_dead

        mark_process_dead(pid, self._metrics_dir)  # type: ignore[no-untyped-call]


def serve_workers(
    workers: int,
    *,
    groups: Sequence[Sequence[socket.socket]],
    command: Sequence[str],
    env: Mapping[str, str],
) -> int:
    """Run ``workers`` worker processes, each on its group of listening sockets (see
    :func:`bind_worker_listeners`; closed here), with a fresh metrics directory, and return the exit status;
    raise :class:`WorkersFailed` if they cannot start. ``command`` starts one worker."""
    metrics_dir = tempfile.mkdtemp(prefix="caller-memory-metrics-")
    try:
        first = groups[0][0]
        bound = first.getsockname()
        shown = f"[{bound[0]}]" if first.family == socket.AF_INET6 else bound[0]
        worker_env = {key: value for key, value in env.items() if key.lower() != "prometheus_multiproc_dir"}
        worker_env |= {"PROMETHEUS_MULTIPROC_DIR": metrics_dir, "CALLER_MEMORY_WORKERS": "1"}
        supervisor = Supervisor(
            workers,
            command=command,
            env=worker_env,
            groups=groups,
            metrics_dir=metrics_dir,
            url=f"http://{shown}:{bound[1]}",
        )
        status = asyncio.run(supervisor.run())
        if supervisor.failure is not None:
            raise WorkersFailed(supervisor.failure)
        return status
    finally:
        for group in groups:
            for sock in group:
                sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
