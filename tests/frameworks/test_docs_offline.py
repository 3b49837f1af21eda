"""The test that docs/pipecat.md's and docs/livekit.md's "Test your bot offline" sections give users, each run
exactly as shown: copied into a folder of its own and run by pytest there, as in a user's project (no
configuration of ours). Each runs in a pytest process of its own, so neither framework is imported here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def the_documented_test(doc: Path) -> str:
    section = doc.read_text().split("## Test your bot offline\n", 1)[1].split("\n## ", 1)[0]
    [code] = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    return code


@pytest.mark.parametrize("doc", ["pipecat.md", "livekit.md"])
def test_the_documented_offline_test_passes_as_written(doc: str, tmp_path: Path) -> None:
    (tmp_path / "test_my_bot.py").write_text(the_documented_test(ROOT / "docs" / doc))
    env = {name: value for name, value in os.environ.items() if not name.startswith("CALLER_MEMORY_")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_bot.py"],
        capture_output=True,
        text=True,
        timeout=55,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout, result.stdout
