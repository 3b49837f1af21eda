"""The service as a real OS process (``python -m caller_memory.service serve``), for fault tests.

with ServiceProcess(store_url) as service:
    service.pause(); service.resume()     # SIGSTOP / SIGCONT
    service.kill(); service.start()       # SIGKILL, then a new process on the same port and store
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from tests.conftest import OPERATOR_TOKEN, PSEUDONYM_KEY

START_TIMEOUT_S = 15.0


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


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Wait until ``url`` answers 200; fail with the end of the process's log if it exits or is too slow."""
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ServiceProcess:
    def __init__(self, store_url: str, workdir: Path, port: int | None = None) -> None:
        self.store_url = store_url
        self.workdir = workdir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"service-{self.port}.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def start(self) -> None:
        env = {
            **os.environ,
            "CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM_KEY.decode(),
            "CALLER_MEMORY_OPERATOR_TOKEN": OPERATOR_TOKEN,
            "CALLER_MEMORY_STORE": self.store_url,
            "CALLER_MEMORY_ACCESS_LOG": "1",
        }
        log = self.log_path.open("ab")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "caller_memory.service", "serve", "--port", str(self.port)],
            cwd=self.workdir,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        wait_http(self.url + "/readyz", self._proc, self.log_path, START_TIMEOUT_S)

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(10)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            self._proc.send_signal(signal.SIGINT)
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)

    def __enter__(self) -> ServiceProcess:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
