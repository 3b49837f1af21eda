"""Two service processes on one Redis, both with the read cache on: a write through one is seen through the
other within CALLER_MEMORY_READ_CACHE_SECONDS (measured from the write's answer to the send of the last read
that still got the old value), and the reader serves from its cache (fewer memory reads reach Redis than it
answers)."""

from __future__ import annotations

import http.client
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import OPERATOR_TOKEN
from tests.storage.test_read_cache import memory_reads
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess

BOUND_S = 0.1
PROJECT = "cache-shop"
PATH = f"/v1/projects/{PROJECT}/callers/+14155550100/memory"


class Client:
    """One kept-alive HTTP connection to a service process."""

    def __init__(self, service: ServiceProcess) -> None:
        self.connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {OPERATOR_TOKEN}", "Content-Type": "application/json"}
        self.connection.request(method, path, None if body is None else json.dumps(body), headers)
        reply = self.connection.getresponse()
        data = reply.read()
        assert reply.status in (200, 201), data
        return json.loads(data)


@pytest.fixture
def services(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[Client, Client]]:
    with redis_server.client() as client:
        client.flushall()
    env = {"CALLER_MEMORY_READ_CACHE_SECONDS": str(BOUND_S)}
    with (
        ServiceProcess(redis_server.url, tmp_path, env=env) as writer,
        ServiceProcess(redis_server.url, tmp_path, env=env) as reader,
    ):
        clients = Client(writer), Client(reader)
        try:
            yield clients
        finally:
            for client in clients:
                client.connection.close()


def test_a_write_through_one_process_is_seen_through_another_within_the_bound(
    services: tuple[Client, Client], redis_server: RedisServer
) -> None:
    writer, reader = services
    config = {"memory": {"repeat_caller": {"state_keys": ["n"]}}}
    writer.call("PUT", f"/v1/projects/{PROJECT}", config)
    writer.call("PATCH", PATH, {"n": 0})
    assert reader.call("GET", PATH)["fields"] == {"n": 0}
    reads_before, answered = memory_reads(redis_server), 0
    windows = []
    for i in range(1, 151):
        for _ in range(3):  # the reader holds the caller: these come from its cache
            assert reader.call("GET", PATH)["fields"] == {"n": i - 1}
            answered += 1
        writer.call("PATCH", PATH, {"n": i})
        acknowledged = time.monotonic()
        last_stale = acknowledged
        while True:
            sent = time.monotonic()
            seen = reader.call("GET", PATH)["fields"]["n"]
            answered += 1
            if seen == i:
                break
            assert seen == i - 1
            last_stale = sent
        windows.append(last_stale - acknowledged)
    assert max(windows) < BOUND_S
    assert statistics.median(windows) < BOUND_S / 10
    # Most reads were hits: without the cache every answer is a read at Redis. Not "one in two": each round
    # costs a miss after the write's invalidation, and on a loaded machine the three reads of a round may
    # outlast the 0.1 s bound and cost one more (seen: 301 of 600 in one `make test`).
    assert memory_reads(redis_server) - reads_before <= answered * 2 / 3
