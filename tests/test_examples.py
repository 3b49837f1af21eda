"""The examples run as documented."""

from __future__ import annotations

import contextlib
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_cheese_shop_agent_recognises_a_returning_caller() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cheese_shop_agent.py"), "--demo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("--- call-2")
    assert "May I have your name?" in first and "Booked: gouda on Friday" in first
    assert "Welcome back, Ada! Shall I book gouda for Friday again?" in second
    assert "07700" not in result.stdout + result.stderr


def run_against_nothing(stdin: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The interactive agent against a URL where nothing listens, its outbox in ``tmp_path``."""
    with socket.socket() as probe:  # a port nothing listens on (bound, never listened to)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        return subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "cheese_shop_agent.py"),
                "--url",
                f"http://127.0.0.1:{port}",
                "--token",
                "cm_example_token",
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "CALLER_MEMORY_OUTBOX": str(tmp_path / "outbox.db")},
        )


@pytest.mark.parametrize("stdin", ["", "My name is Ada.\nGouda on Friday\n"])
def test_the_interactive_agent_ends_the_call_on_end_of_input_and_explains_a_queued_end(
    stdin: str, tmp_path: Path
) -> None:
    result = run_against_nothing(stdin, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "EOFError" not in result.stderr
    out = result.stdout
    assert "memory unavailable" in out and "treating the caller as new" in out
    assert "could not be reached" in out and str(tmp_path / "outbox.db") in out and "delivered" in out
    assert "07700" not in out + result.stderr
    with contextlib.closing(sqlite3.connect(tmp_path / "outbox.db")) as db:  # the call was ended: kept
        assert db.execute("SELECT count(*) FROM outbox WHERE rejected IS NULL").fetchone() == (1,)
