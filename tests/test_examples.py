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


def test_the_cheese_shop_agent_recognises_a_returning_caller_and_resumes_a_dropped_call() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cheese_shop_agent.py"), "--demo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    first, rest = result.stdout.split("--- call-2")
    second, rest = rest.split("--- call-3")
    dropped, callback = rest.split("--- call-4")
    assert "May I have your name?" in first and "Booked: gouda on Friday" in first
    assert "Welcome back, Ada! Shall I book gouda for Friday again?" in second
    # The call that drops mid-booking is ended by the service; the callback is offered to finish it.
    assert "nobody ends call-3" in dropped and "the service ended call-3" in dropped
    assert "We were booking brie for Saturday when the line dropped. Shall I finish that?" in callback
    assert "Booked: brie on Saturday" in callback
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
        kept = db.execute("SELECT kind, count(*) FROM outbox WHERE rejected IS NULL GROUP BY kind").fetchall()
    # The end, behind the transcript's messages (the greeting, and each line of the call).
    counts = dict(kept)
    assert counts["end"] == 1 and counts["messages"] >= 1, counts
