"""The benchmarks are not run by the suite, but they must not rot: every script of bench/ starts (its --help)
and every module imports, so a helper they use that moves elsewhere breaks the suite, not the next bench."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
#: Modules other scripts import (loadgen reads its job from stdin when run): imported, not run.
MODULES = {"common", "harness", "in_process", "loadgen", "profiling"}
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


@pytest.mark.timeout(240)  # about 25 s; a busy shared machine may take several times that
def test_transcripts_bench_runs_and_writes_its_results(tmp_path: Path) -> None:
    """bench/transcripts.py --smoke: the real service, the baseline and a redis-server, every measurement of
    the conversation-memory benchmark for a fraction of a second; its JSON holds every figure the targets
    are judged on (whatever they are: a smoke run's figures mean nothing)."""
    output = tmp_path / "transcripts.json"
    cmd = [sys.executable, str(BENCH / "transcripts.py"), "--smoke", "--no-pin", "--profile", "none"]
    run = subprocess.run(
        [*cmd, "--output", str(output)], capture_output=True, text=True, timeout=230, cwd=tmp_path
    )
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "Targets" in run.stdout
    results = json.loads(output.read_text())
    for kind in ("append1", "append10", "history", "context"):
        peak = results["peak"][kind]
        assert peak["service"]["ok"] > 0 and peak["baseline"]["ok"] > 0, kind
        assert peak["service"]["errors"] == 0 and peak["baseline"]["errors"] == 0, kind
    assert results["context_open_50"]["service"]["ok"] > 0
    assert results["footprint"]["service"]["bytes_per_message"] > 0
    assert results["footprint"]["service"]["one_conversation_keys"]
    assert len(results["targets"]) == 7


@pytest.mark.timeout(240)  # about 15 s; a busy shared machine may take several times that
def test_webhooks_bench_runs_and_writes_its_results(tmp_path: Path) -> None:
    """bench/webhooks.py --smoke: three real services with their redis-servers, the receiver, the ends and the
    deliveries for a fraction of a second; deliveries arrive verified during the measured window of ``on``,
    none for ``queue-only`` (no worker), and the JSON holds every figure the targets are judged on."""
    output = tmp_path / "webhooks.json"
    cmd = [sys.executable, str(BENCH / "webhooks.py"), "--smoke", "--no-pin", "--profile", "none"]
    run = subprocess.run(
        [*cmd, "--output", str(output)], capture_output=True, text=True, timeout=230, cwd=tmp_path
    )
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "Targets" in run.stdout
    results = json.loads(output.read_text())
    peak = results["end_peak"]
    for side in ("off", "on", "queue-only"):
        assert peak[side]["ok"] > 0 and peak[side]["errors"] == 0, side
    assert min(peak["on"]["deliveries"]["in_window"]) > 0
    assert peak["on"]["deliveries"]["invalid"] == 0
    assert peak["queue-only"]["deliveries"]["in_window"] == [0]
    assert peak["ratio_on_over_off"]["per_round"]
    for rate in results["deliveries"].values():
        assert rate["deliveries_per_s"] > 0 and rate["invalid"] == 0 and rate["duplicates"] == 0
    assert len(results["targets"]) == 2 + len(results["deliveries"])


@pytest.mark.timeout(240)  # about 25 s; a busy shared machine may take several times that
def test_identity_bench_runs_and_writes_its_results(tmp_path: Path) -> None:
    """bench/identity.py --smoke: the real service and its redis-server, callers written and emails linked
    through the API, every side's reads for a fraction of a second, and the service of the commit before issue
    17 from a git worktree (skipped, saying so, only if no worktree of it can be made); every side answers
    without errors, the reads cost the round trips and commands they are counted at, the worktree is gone
    afterwards, and the JSON holds every figure the targets are judged on (a smoke run's figures mean
    nothing)."""
    output = tmp_path / "identity.json"
    cmd = [sys.executable, str(BENCH / "identity.py"), "--smoke", "--no-pin", "--output", str(output)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "Targets" in run.stdout
    results = json.loads(output.read_text())
    before = "skipped" not in results["before"]
    if not before:
        assert "before: SKIPPED" in run.stdout + run.stderr
    sides = ("today", "before", "first", "linked", "trust", "trust-passed")
    for side in sides if before else tuple(s for s in sides if s != "before"):
        assert results["peak"][side]["ok"] > 0 and results["peak"][side]["errors"] == 0, side
        assert results["open_50"][side]["ok"] > 0, side
        assert results["round_trips"][side]["statuses"] == {"200": results["plan"]["counted_reads"]}, side
    trips = results["round_trips"]
    assert trips["linked"]["round_trips_per_read"] > trips["first"]["round_trips_per_read"]
    assert results["peak"]["ratio_linked"]["per_round"]
    assert all("busy" in r for r in results["peak"]["rounds"])
    if before:
        assert results["before"]["openapi_links_paths"] == []
        # The code before issue 17 reads the memory without the alias record: fewer commands, in 1 round trip.
        assert trips["before"]["commands_per_read"] < trips["today"]["commands_per_read"]
        assert results["peak"]["ratio_first_vs_before"]["per_round"]
        assert results["peak"]["ratio_today_vs_before"]["per_round"]
        assert "before" in results["targets"][0]["target"]
        worktrees = subprocess.run(
            ["git", "-C", str(BENCH.parent), "worktree", "list", "--porcelain"],
            capture_output=True,
            text=True,
        ).stdout
        assert "cm-identity-" not in worktrees
    assert len(results["targets"]) == (6 if before else 5)


@pytest.mark.timeout(240)  # about 25 s; a busy shared machine may take several times that
def test_mcp_bench_runs_and_writes_its_results(tmp_path: Path) -> None:
    """bench/mcp_bench.py --smoke: the service from bench/mcp_launcher.py (with its bench-only constant tool)
    on SQLite and on a redis-server, the official client's tools/call captured, the three sides for a fraction
    of a second each; every side answers without errors (a tool error would count), the request sent is the
    client's (MCP 2026-07-28's headers and _meta envelope), and the JSON holds every figure the target is
    judged on (a smoke run's figures mean nothing)."""
    output = tmp_path / "mcp.json"
    cmd = [sys.executable, str(BENCH / "mcp_bench.py"), "--smoke", "--no-pin", "--output", str(output)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=230, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-3000:])
    assert "Targets" in run.stdout
    results = json.loads(output.read_text())
    assert set(results["stores"]) == {"sqlite", "redis"}
    for store, found in results["stores"].items():
        for side in ("read", "tool", "constant"):
            summary = found["sides"][side]
            assert summary["requests"] > 0 and summary["errors"] == 0, (store, side, summary["statuses"])
            assert summary["latency_ms"]["p50"] > 0 and summary["target_rate"] == found["rate"]
        assert found["checked"]["tool_and_constant_results_equal"]
        headers = {name.lower(): value for name, value in found["captured_request"]["headers"]}
        assert headers["mcp-protocol-version"] == "2026-07-28"
        assert (headers["mcp-method"], headers["mcp-name"]) == ("tools/call", "get_caller_memory")
        assert "<agent token>" in headers["authorization"]
        body = json.loads(found["captured_request"]["body"])
        assert body["method"] == "tools/call" and "_meta" in body["params"]
        assert found["ours_p50_ms_pooled"] == pytest.approx(
            found["sides"]["tool"]["latency_ms"]["p50"] - found["sides"]["constant"]["latency_ms"]["p50"]
        )
        assert found["ratio"] == pytest.approx(statistics.median(found["ratio_per_round"]))
    assert len(results["targets"]) == 2
