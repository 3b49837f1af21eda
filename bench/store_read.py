"""Micro-benchmark of the store's hot path: ``RedisStore.read_fields`` against a real ``redis-server``.

    .venv/bin/python bench/store_read.py                                   # the installed package
    .venv/bin/python bench/store_read.py --tree before=/tmp/before --tree after=/tmp/after

Each ``--tree NAME=DIR`` names a directory holding ``caller_memory/{service,sdk}`` (e.g. a ``git archive``
of a commit): its package is imported under the name ``NAME`` (the service's imports are relative), so
several versions run in one process, on one server, their rounds interleaved. On a shared machine that is
the only comparison that means something: a neighbour's load hits every version alike.

Each round is ``--calls`` reads of one caller's 10 fields at ``--concurrency`` tasks; reported per version:
the median over ``--rounds`` rounds, in microseconds per call, of the wall time and of the process's CPU time
(the client is the bottleneck: one round trip per read).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

from common import FIELDS, PROJECT, VALUE  # noqa: E402

SUBJECT = "0" * 32


def load(trees: list[str]) -> dict[str, Any]:
    """The package of each ``NAME=DIR`` under its name (or the installed ``caller_memory``)."""
    if not trees:
        return {"installed": importlib.import_module("caller_memory")}
    links = Path(tempfile.mkdtemp(prefix="store-read-"))
    sys.path.insert(0, str(links))
    packages = {}
    for tree in trees:
        name, _, directory = tree.partition("=")
        (links / name).symlink_to(Path(directory).resolve() / "caller_memory")
        packages[name] = importlib.import_module(name)
    return packages


def caller_of(package: Any) -> tuple[Any, ...]:
    """How this version's store names a caller: a CallerRef (issue 13 on), or a project and a subject."""
    try:
        return (
            importlib.import_module(f"{package.__name__}.service.domain.store").CallerRef(PROJECT, SUBJECT),
        )
    except (ImportError, AttributeError):
        return (PROJECT, SUBJECT)


async def store_of(package: Any, url: str) -> Any:
    redis = importlib.import_module(f"{package.__name__}.service.storage.redis")
    fields_module = importlib.import_module(f"{package.__name__}.service.domain.fields")
    store = redis.RedisStore(url)
    await store.open()
    now = int(time.time() * 1000)
    fields = {name: fields_module.StoredField(VALUE, now + 3_600_000, now) for name in FIELDS}
    caller = caller_of(package)
    await store.patch_fields(*caller, fields, [], now)
    assert len(await store.read_fields(*caller, now)) == len(FIELDS)
    return store, caller


async def one_round(store_and_caller: Any, calls: int, concurrency: int) -> tuple[float, float]:
    store, caller = store_and_caller
    now = int(time.time() * 1000)
    share = calls // concurrency

    async def worker() -> None:
        for _ in range(share):
            await store.read_fields(*caller, now)

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    n = share * concurrency
    return (time.perf_counter() - start) / n * 1e6, (time.process_time() - cpu) / n * 1e6


async def measure(packages: dict[str, Any], url: str, args: argparse.Namespace) -> None:
    stores = {name: await store_of(package, url) for name, package in packages.items()}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in stores}
    try:
        for store in stores.values():  # warm up the connections
            await one_round(store, 2000, args.concurrency)
        for _ in range(args.rounds):
            for name, store in stores.items():
                results[name].append(await one_round(store, args.calls, args.concurrency))
    finally:
        for store, _ in stores.values():
            await store.close()
    for name, rounds in results.items():
        wall = [r[0] for r in rounds]
        cpu = [r[1] for r in rounds]
        print(
            f"read_fields {name}: median {statistics.median(wall):.1f} us/call wall,"
            f" {statistics.median(cpu):.1f} us/call CPU"
            f" (wall rounds: {', '.join(f'{w:.1f}' for w in wall)})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--url", default=None, help="a running Redis (default: start one)")
    parser.add_argument("--tree", action="append", default=[], help="NAME=DIR, DIR holding caller_memory/")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    packages = load(args.tree)
    if args.url is not None:
        asyncio.run(measure(packages, args.url, args))
        return
    from tests.support.redis_server import RedisServer

    with RedisServer() as server:
        asyncio.run(measure(packages, server.url, args))


if __name__ == "__main__":
    main()
