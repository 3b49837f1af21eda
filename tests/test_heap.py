"""The collector once the service is up (service/http/server.py, ``settle_heap``): what the imports and the
start-up made is frozen out of every collection, and the thresholds are raised. Each test runs in a process of
its own: the collector's state is per process, and the test process's own stays as Python leaves it (the
subprocess's defaults are compared with it)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

from caller_memory.service.http.server import GC_THRESHOLDS

from tests.support.service_process import free_port, service_environment

# A real `serve` of the application on a SQLite file; once it listens, it reports the collector's state,
# times a full collection (as before serving), and stops itself with SIGINT as an operator would.
SERVE_AND_REPORT = """
import gc, json, os, signal, sys, time
from caller_memory.service.app import create_app
from caller_memory.service.config import Settings
from caller_memory.service.http.app_keys import METRICS
from caller_memory.service.http.server import serve

settings = Settings.from_env()
app = create_app(settings)

def full_collection_ms():
    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000

full_collection_ms()
before = {"frozen": gc.get_freeze_count(), "thresholds": gc.get_threshold()}
before_ms = full_collection_ms()

async def report():
    print(json.dumps({"before": before, "before_ms": before_ms, "frozen": gc.get_freeze_count(),
                      "thresholds": gc.get_threshold(), "tracked": len(gc.get_objects()),
                      "full_ms": full_collection_ms()}), flush=True)
    os.kill(os.getpid(), signal.SIGINT)

serve(app, header_timeout=5.0, max_connections=100, metrics=app[METRICS], host="127.0.0.1",
      port=int(sys.argv[1]), on_listening=report)
"""


def test_once_serving_the_start_up_objects_are_frozen_and_the_thresholds_raised(tmp_path: Path) -> None:
    env = service_environment(f"sqlite:///{tmp_path}/heap.db")
    done = subprocess.run(
        [sys.executable, "-c", SERVE_AND_REPORT, str(free_port())],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    # Before serving, Python's own settings; once serving, the start-up is frozen (tens of thousands of
    # objects: modules, classes, the application and its services) and what a collection walks is what came
    # after it.
    assert report["before"] == {"frozen": 0, "thresholds": list(gc.get_threshold())}
    assert report["thresholds"] == list(GC_THRESHOLDS)
    assert report["frozen"] > 20_000
    assert report["tracked"] < report["frozen"] / 10
    # A full collection (which took 13 ms at rest on the benchmark machine, 35-50 ms under load) is a small
    # fraction of what it was before serving.
    assert report["full_ms"] < report["before_ms"] / 4, report
