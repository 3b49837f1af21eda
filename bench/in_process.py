"""What the benchmarks that run the service's use cases in their own process share (bench/caller_starts.py,
bench/redaction.py): another tenant's memory reads at a fixed rate, percentiles, the commit measured.

Kept out of bench/common.py, which the load generator imports and which stays free of the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
from pathlib import Path

from caller_memory.service.domain.projects import Project
from caller_memory.service.http.app_keys import Services


async def tenant_reads(
    services: Services, tenant: Project, reader: str, rate: float, seconds: float
) -> list[float]:
    """``tenant``'s reads of ``reader``'s memory in an open loop: read ``i`` is due at ``i / rate``, and its
    latency counts from then (a stall is counted, not skipped). Latencies in seconds."""
    latencies: list[float] = []
    tasks = []
    began = time.perf_counter()

    async def read(due: float) -> None:
        await services.memory.read(tenant, reader)
        latencies.append(time.perf_counter() - due)

    for i in range(int(rate * seconds)):
        due = began + i / rate
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(read(due)))
    await asyncio.gather(*tasks)
    return latencies


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def commit() -> str:
    """The short commit of the checkout measured ("unknown" outside one)."""
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return "unknown"
