"""A real ``redis-server`` process for tests: private directory, free port, known pid.

    with RedisServer() as server:              # --save "" --appendonly no unless overridden
        store = RedisStore(server.url)
        os.kill(server.pid, signal.SIGSTOP)    # fault tests may pause or kill it...
        server.stop(); server.start()          # ...and restart it on the same port and directory

    with RedisServer(config_file=SHIPPED_CONFIG) as server:   # deploy/redis.conf, as shipped
        ...

The helper checks that the server answering on the port is the process it started (``INFO server``
process_id), so a stray server left on that port can never be mistaken for ours.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

import redis

DEFAULT_CONFIG: dict[str, str] = {"save": "", "appendonly": "no"}
#: The Redis configuration the project ships (AOF, ``appendfsync always``).
SHIPPED_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "redis.conf"
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


class _PortTaken(Exception):
    pass


def _free_port() -> int:
    """A port the kernel just handed out; redis-server binds it right after (a rare race is retried)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1 (or a unix socket) in a private temporary directory.

    ``config`` entries override :data:`DEFAULT_CONFIG` (e.g. ``{"appendonly": "yes", "appendfsync":
    "always"}``) and are passed as ``--name value``. With ``config_file`` (e.g. :data:`SHIPPED_CONFIG`)
    the server reads that file first and :data:`DEFAULT_CONFIG` does not apply: only the port, address,
    directory, log file and ``config`` are given on the command line, where they override the file. With
    ``unix_socket=True`` the server also listens on ``<dir>/redis.sock`` and :attr:`url` is a ``unix://``
    URL.
    """

    def __init__(
        self,
        config: Mapping[str, str] | None = None,
        *,
        unix_socket: bool = False,
        executable: str = "redis-server",
        config_file: Path | None = None,
    ) -> None:
        found = shutil.which(executable)
        if found is None:
            raise RuntimeError(f"{executable} is not installed (apt-get install redis-server)")
        self.executable = found
        self.config_file = config_file
        self.config = {**(DEFAULT_CONFIG if config_file is None else {}), **(config or {})}
        self.unix_socket = unix_socket
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.dir = Path()
        self.port = 0
        self.run_id = ""
        self._proc: subprocess.Popen[bytes] | None = None

    # Properties ---------------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("the server is not running")
        return self._proc.pid

    @property
    def socket_path(self) -> Path:
        return self.dir / "redis.sock"

    @property
    def url(self) -> str:
        if self.unix_socket:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self) -> redis.Redis:
        """A synchronous client for setup and inspection (the caller closes it)."""
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=5)

    # Lifecycle ----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the server; after :meth:`stop` it comes back on the same port and directory."""
        if self.running:
            raise RuntimeError("the server is already running")
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="cm-redis-")
            self.dir = Path(self._tmp.name)
        if self.port:
            try:
                self._launch(self.port)
            except _PortTaken as exc:
                raise RuntimeError(f"port {self.port} was taken while the server was down") from exc
            return
        for _ in range(5):  # a fresh port can be taken by someone else between bind() and redis' bind()
            try:
                self._launch(_free_port())
                return
            except _PortTaken:
                continue
        raise RuntimeError("could not find a free port for redis-server")

    def _command(self, port: int) -> list[str]:
        cmd = [self.executable]
        if self.config_file is not None:
            cmd.append(str(self.config_file))  # must come first; the options below override it
        cmd += ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
        cmd += ["--daemonize", "no", "--logfile", str(self.log_path)]
        if self.unix_socket:
            cmd += ["--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        for name, value in self.config.items():
            cmd += [f"--{name}", value]
        return cmd

    def _launch(self, port: int) -> None:
        self.port = port
        proc = subprocess.Popen(self._command(port), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        self._proc = proc
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                self._proc = None
                log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
                if "Address already in use" in log:
                    raise _PortTaken
                raise RuntimeError(f"redis-server exited with {proc.returncode}:\n{log[-2000:]}")
            info = self._probe()
            if info is not None:
                if int(str(info["process_id"])) != proc.pid:
                    self._kill()  # someone else's server answers on this port
                    raise _PortTaken
                self.run_id = str(info["run_id"])
                return
            time.sleep(0.01)  # polling a starting process: there is no event to wait on
        self._kill()
        raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT_S} s")

    def _probe(self) -> dict[str, object] | None:
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            client.ping()
            info: dict[str, object] = client.info("server")
            return info
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return None
        finally:
            client.close()

    def stop(self) -> None:
        """SIGTERM (resuming a SIGSTOPped server first), wait, SIGKILL if it does not exit. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._kill()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as in a crash: Redis gets no chance to flush or shut down. Idempotent."""
        self._kill()

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
        self._proc = None

    def close(self) -> None:
        """Stop the server and remove its directory."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
