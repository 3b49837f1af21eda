"""Helpers of the tests that run the examples and the docs' commands as a user would: processes whose output
goes to a file, a wait for a line of that output, and a plain POST with the standard library."""

from __future__ import annotations

import contextlib
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def wait_for_line(path: Path, pattern: str, timeout: float = 20.0) -> str:
    """The first line of the file at ``path`` that matches ``pattern``, once a process has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            if re.search(pattern, line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} in {path.name}: {path.read_text()!r}")


@contextlib.contextmanager
def running(
    command: list[str], out: Path, env: dict[str, str], cwd: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose standard output and error go to ``out`` (and ``out`` with ``.err``), stopped after."""
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def post(url: str, body: bytes, headers: dict[str, str], token: str | None = None) -> tuple[int, bytes]:
    """The status and body of a POST, whatever the status."""
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, refused.read()
