"""The service as a real OS process (``python -m caller_memory.service serve``): the one harness of every
test that starts one (fault tests, the command line, worker processes, starvation).

with ServiceProcess(store_url, tmp_path) as service:
    service.url, service.port, service.pid, service.log
    service.pause(); service.resume()     # SIGSTOP / SIGCONT
    service.kill(); service.start()       # SIGKILL, then a new process on the same port and store

The process's output is copied to ``workdir/service-<port>.log`` by a thread that also watches it, so that
waiting for the service to listen (its "listening on" line, logged once the port is bound and the store
opened, with every worker ready under ``--workers``) or for any other line is waiting on an event, not polling.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from tests.conftest import OPERATOR_TOKEN, PSEUDONYM_KEY

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
SERVE = [sys.executable, "-m", "caller_memory.service", "serve"]
#: What the service logs once it serves (``serve`` and ``serve --workers N`` alike).
LISTENING = "listening on "


def http(method: str, url: str, token: str, body: Any = None) -> Any:
    """A blocking JSON request to a service, for set-up and checks (raises on an error status)."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Authorization": f"Bearer {token}"}
    )
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def service_environment(store_url: str | None, **extra: str) -> dict[str, str]:
    """The environment of a service process: the test keys, ``store_url`` (None: the default store, a SQLite
    file in the working directory) and ``extra`` settings."""
    env = {
        **os.environ,
        "CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM_KEY.decode(),
        "CALLER_MEMORY_OPERATOR_TOKEN": OPERATOR_TOKEN,
    }
    if store_url is not None:
        env["CALLER_MEMORY_STORE"] = store_url
    return env | extra


class _Output:
    """Copies a process's output to a file, line by line, and wakes whoever waits for a line in it."""

    def __init__(self, stream: IO[bytes], path: Path) -> None:
        self._stream = stream
        self._path = path
        self._seen = bytearray()
        self._changed = threading.Condition()
        self._ended = False
        self._thread = threading.Thread(target=self._copy, name=f"output of {path.name}", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        with self._path.open("ab") as log:
            for line in iter(self._stream.readline, b""):
                log.write(line)
                log.flush()
                with self._changed:
                    self._seen += line
                    self._changed.notify_all()
        self._stream.close()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, text: str, timeout: float) -> bool:
        """Whether ``text`` was output within ``timeout`` seconds (False at once if the output ended)."""
        needle = text.encode()
        with self._changed:
            return self._changed.wait_for(lambda: needle in self._seen or self._ended, timeout) and (
                needle in self._seen
            )

    @property
    def ended(self) -> bool:
        with self._changed:
            return self._ended

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class ServiceProcess:
    """``caller-memory serve [args]`` over ``store_url`` on a free port (or ``port``), run in ``workdir``."""

    def __init__(
        self,
        store_url: str | None,
        workdir: Path,
        *args: str,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        access_log: bool = True,
        preexec: Callable[[], None] | None = None,
    ) -> None:
        self.store_url = store_url
        self.workdir = workdir
        self.args = args
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"service-{self.port}.log"
        self.env = service_environment(
            store_url, **({"CALLER_MEMORY_ACCESS_LOG": "1"} if access_log else {}), **(env or {})
        )
        self.preexec = preexec
        self._proc: subprocess.Popen[bytes] | None = None
        self._output: _Output | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        assert self._proc is not None, "not started"
        return self._proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def log(self) -> str:
        """Everything the process (and any earlier one on this port) has output so far."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the process and return once it listens; fail with the end of its log if it does not."""
        self._proc = subprocess.Popen(
            [*SERVE, "--port", str(self.port), *self.args],
            cwd=self.workdir,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            preexec_fn=self.preexec,
        )
        assert self._proc.stdout is not None
        self._output = _Output(self._proc.stdout, self.log_path)
        try:
            self.wait_for_log(LISTENING, timeout)
        except BaseException:
            self.stop()
            raise

    def wait_for_log(self, text: str, timeout: float) -> None:
        """Return once the process has output ``text``; fail with the end of its log if it exits first or
        takes longer than ``timeout`` seconds."""
        assert self._output is not None, "not started"
        if not self._output.wait_for(text, timeout):
            # The output ends when the process exits (or closes it): then say how it exited.
            why = (
                f"exited with {self.wait(10)}"
                if self._output.ended
                else f"logged no {text!r} within {timeout} s"
            )
            raise RuntimeError(f"{self.proc.args!r} {why}:\n{self.log[-3000:]}")

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit status, once the process has exited and its output is all in the log."""
        returncode = self.proc.wait(timeout)
        if self._output is not None:
            self._output.join(timeout)
        return returncode

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self.wait(10)

    def stop(self, sig: int = signal.SIGINT) -> int | None:
        """Ask the process to stop with ``sig`` (SIGINT, as Ctrl-C; SIGTERM, as a supervisor), kill it if it
        does not within the stop timeout; its exit status (None if it was never started)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)  # a paused process cannot handle the signal
            self._proc.send_signal(sig)
            try:
                return self.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        return self.wait(10)

    def __enter__(self) -> ServiceProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
