"""The benchmarks are not run by the suite, but they must not rot: every script of bench/ starts (its --help)
and every module imports, so a helper they use that moves elsewhere breaks the suite, not the next bench."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
#: Modules other scripts import (loadgen reads its job from stdin when run): imported, not run.
MODULES = {"common", "harness", "loadgen", "profiling"}
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.stem not in MODULES)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_bench_script_starts(script: str) -> None:
    run = subprocess.run(
        [sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage" in run.stdout.lower(), run.stdout[:500]


def test_every_bench_module_imports() -> None:
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); " + "; ".join(
        f"import {m}" for m in sorted(MODULES)
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, cwd=BENCH.parent
    )
    assert run.returncode == 0, run.stderr[-2000:]
