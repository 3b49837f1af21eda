"""Helpers for testing your own agent offline, in your own pytest: a scripted model and a real service.

- :class:`ScriptedModel` is an OpenAI-compatible model on ``127.0.0.1``. It answers
  ``POST /v1/chat/completions`` (streamed or not) from a script: texts and tool calls, in order, or a function
  of each request. Point your framework's OpenAI client at ``model.base_url``. Every request it receives is
  kept in ``model.requests``, for assertions on what your agent sent (the memory message, the tools).
- :func:`service` starts the real Caller Memory service as a subprocess: a free loopback port, a temporary
  SQLite file and generated secrets, all removed when it stops. It needs the ``caller-memory`` distribution
  (the service) installed beside the SDK; without it, it raises :class:`ServiceNotInstalledError`, which
  says how to install it.

::

    from caller_memory.sdk import MemoryClient
    from caller_memory.sdk.testing import ScriptedModel, ToolCall, service

    async def test_the_second_call_is_greeted_by_name() -> None:
        config = {"memory": {"repeat_caller": {"state_keys": ["caller_name"], "default_region": "US"}}}
        async with service() as cm, ScriptedModel(["Hi!", ToolCall("save_name", {"name": "Ada"})]) as model:
            tokens = await cm.create_project("cheese-shop", config)
            async with MemoryClient(cm.url, token=tokens.agent, project="cheese-shop") as client:
                ...  # run your agent with client, its model at model.base_url
            assert "caller_name" in model.last_request.system_prompt

This module imports only the SDK, the standard library and the SDK's own dependencies: never the service,
which runs in its own process.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from ._scripted_model import (
    Answer,
    ModelRequest,
    Reply,
    Script,
    ScriptedModel,
    ScriptError,
    ToolCall,
    message_text,
)

__all__ = [
    "Answer",
    "LocalService",
    "ModelRequest",
    "ProjectTokens",
    "Reply",
    "Script",
    "ScriptError",
    "ScriptedModel",
    "ServiceNotInstalledError",
    "ServiceStartError",
    "ToolCall",
    "message_text",
    "service",
]

#: The distribution that holds the service (``caller_memory.service`` and the ``caller-memory`` command).
SERVICE_DISTRIBUTION = "caller-memory"
#: How to install it, from a clone of the repository or from git (no package index has it).
HOW_TO_INSTALL = (
    "install it into that environment from a clone of the Caller Memory repository (at its root: "
    "`pip install ./sdk ./`) or from git, with the SDK it depends on (`pip install "
    '"caller-memory-sdk @ git+https://github.com/OWNER/caller-memory#subdirectory=sdk" '
    '"caller-memory @ git+https://github.com/OWNER/caller-memory"`, OWNER being the account that hosts the '
    "repository); docs/install.md in the repository has the details"
)


class ServiceNotInstalledError(RuntimeError):
    """:func:`service` needs the ``caller-memory`` distribution (the service) in the interpreter that is to
    run it, and it is not installed there. The message says how to install it."""

    def __init__(self, python: str) -> None:
        super().__init__(
            f"service() runs the Caller Memory service, but the {SERVICE_DISTRIBUTION!r} distribution is not "
            f"installed for {python}: {HOW_TO_INSTALL}"
        )


class ServiceStartError(RuntimeError):
    """The service's process exited, or did not answer in time, before it was ready. The message ends with
    what the process wrote to its standard error."""


@dataclass(frozen=True)
class ProjectTokens:
    """What :meth:`LocalService.create_project` made: the project and a token of each role a test needs."""

    project: str
    #: An admin token: manages the project (its tokens, webhooks, callers).
    admin: str
    #: An agent token: what a ``MemoryClient`` in an agent takes.
    agent: str


@dataclass(frozen=True)
class LocalService:
    """A running service started by :func:`service`."""

    #: Its base URL, ``http://127.0.0.1:<port>``.
    url: str
    #: The operator token: creates projects and their first tokens.
    operator_token: str
    #: The SQLite file the service stores everything in (removed when it stops).
    database: Path

    async def create_project(self, project: str, config: Mapping[str, Any]) -> ProjectTokens:
        """Create (or replace) ``project`` with the configuration document ``config`` (what
        ``caller-memory project apply`` takes) and mint an admin and an agent token for it."""
        base = f"{self.url}/v1/projects/{quote(project, safe='')}"
        headers = {"Authorization": f"Bearer {self.operator_token}"}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as http:
            async with http.put(base, json=dict(config)) as answer:
                if answer.status >= 400:
                    raise ValueError(
                        f"the service refused the project ({answer.status}): {await answer.text()}"
                    )
            tokens = {}
            for role in ("admin", "agent"):
                async with http.post(f"{base}/tokens", json={"role": role, "label": "testing"}) as answer:
                    answer.raise_for_status()
                    tokens[role] = str((await answer.json())["token"])
        return ProjectTokens(project, admin=tokens["admin"], agent=tokens["agent"])


def _has_service(python: str | None) -> bool:
    """Whether ``caller-memory`` is installed for ``python`` (None: this interpreter), asked of
    importlib.metadata there (importing the service would be slow and is not the SDK's to do)."""
    if python is None:
        try:
            metadata.distribution(SERVICE_DISTRIBUTION)
        except metadata.PackageNotFoundError:
            return False
        return True
    # Not from the working folder (``-c`` puts it first on sys.path): a build's leftover metadata there is no
    # installed service, and the service runs in a folder of its own.
    check = f"import sys; del sys.path[0]; import importlib.metadata as m; m.distribution({SERVICE_DISTRIBUTION!r})"
    try:
        asked = subprocess.run([python, "-c", check], capture_output=True, timeout=60, check=False)
    except OSError as exc:
        raise ServiceStartError(f"cannot run the interpreter {python}: {exc}") from exc
    if asked.returncode != 0 and b"PackageNotFoundError" not in asked.stderr:
        raise ServiceStartError(
            f"the interpreter {python} could not check for the service: {asked.stderr.decode(errors='replace')}"
        )
    return asked.returncode == 0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _service_environment(database: Path, operator: str, extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment without its own Caller Memory settings, with the generated ones."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("CALLER_MEMORY_")}
    env |= {
        "CALLER_MEMORY_STORE": f"sqlite:///{database}",
        "CALLER_MEMORY_OPERATOR_TOKEN": operator,
        "CALLER_MEMORY_PSEUDONYM_KEY": secrets.token_urlsafe(32),
        "CALLER_MEMORY_SECRET_KEY": base64.b64encode(secrets.token_bytes(32)).decode(),
        "CALLER_MEMORY_ARCHIVE_URL": str(database.parent / "archive"),
    }
    return env | dict(extra)


async def _wait_ready(process: asyncio.subprocess.Process, url: str, stderr: Path, within: float) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while True:
            if process.returncode is not None:
                raise ServiceStartError(
                    f"the service exited with status {process.returncode} before it was ready; "
                    f"its standard error:\n{_tail(stderr)}"
                )
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(f"{url}/readyz") as answer:
                    if answer.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ServiceStartError(
                    f"the service did not answer {url}/readyz within {within:g} s; its standard error:\n"
                    f"{_tail(stderr)}"
                )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.05):
                    await process.wait()


def _tail(path: Path, size: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text[-size:] or "(nothing)"


async def _stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        process.terminate()
        try:
            async with asyncio.timeout(10):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


@contextlib.asynccontextmanager
async def service(
    *,
    python: str | None = None,
    environment: Mapping[str, str] | None = None,
    start_within: float = 30.0,
) -> AsyncIterator[LocalService]:
    """Start the real Caller Memory service for a test, and stop it (removing its files) afterwards.

    It runs ``<python> -m caller_memory.service serve`` on a free port of ``127.0.0.1``, on a SQLite file
    in a new temporary folder (its working folder, too), with a generated operator token, pseudonym key
    and webhook-secret key. It reads none of this process's ``CALLER_MEMORY_*`` variables;
    ``environment`` adds service settings (``{"CALLER_MEMORY_INACTIVITY_INTERVAL": "0.25"}``...).

    ``python`` is the interpreter whose environment holds the service (default: this one, ``sys.executable``).
    Raises :class:`ServiceNotInstalledError` if the ``caller-memory`` distribution is not installed there,
    and :class:`ServiceStartError` if the service exits or does not answer within ``start_within`` seconds.
    """
    interpreter = python or sys.executable
    if not await asyncio.to_thread(_has_service, python):
        raise ServiceNotInstalledError(interpreter)
    operator = "op_" + secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="caller-memory-") as folder:
        workdir = Path(folder)
        database, stderr = workdir / "service.db", workdir / "service.err"
        port = _free_port()
        with stderr.open("wb") as errors:
            process = await asyncio.create_subprocess_exec(
                interpreter,
                "-m",
                "caller_memory.service",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=errors,
                stderr=errors,
                cwd=workdir,
                env=_service_environment(database, operator, environment or {}),
            )
        try:
            url = f"http://127.0.0.1:{port}"
            await _wait_ready(process, url, stderr, start_within)
            yield LocalService(url=url, operator_token=operator, database=database)
        finally:
            await _stop(process)
