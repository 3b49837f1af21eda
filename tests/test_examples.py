"""The examples run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
