"""A slow store does not pile up unbounded work; repeated bad tokens are throttled, good ones never."""

from __future__ import annotations

import asyncio
import time

from caller_memory.service.domain.clock import FakeClock

from tests.conftest import running_api
from tests.http.test_api import assert_problem, memory_path
from tests.support.proxy import LossyProxy
from tests.support.redis_server import RedisServer

LIMIT = 8


async def test_a_slow_store_gets_a_bounded_number_of_requests(
    redis_server: RedisServer, clock: FakeClock
) -> None:
    with redis_server.client() as client:
        client.flushall()
    proxy = LossyProxy(redis_server.port)
    await proxy.start()
    try:
        url = f"redis://127.0.0.1:{proxy.port}/0"
        async with running_api(url, clock, max_in_flight=LIMIT, store_timeout=3.0) as api:
            tokens = await api.project_with_tokens("shop", {"state_keys": ["a"]})
            await api.call("GET", memory_path("shop"), token=tokens["agent"])  # warm the token cache
            proxy.delay = 0.3  # every answer of the store now takes 300 ms

            async def read() -> tuple[int, float]:
                started = time.perf_counter()
                reply = await api.call("GET", memory_path("shop"), token=tokens["agent"])
                return reply.status, time.perf_counter() - started

            results = await asyncio.gather(*(read() for _ in range(60)))
            served = [t for status, t in results if status == 200]
            refused = [t for status, t in results if status == 503]
            assert len(served) + len(refused) == 60
            assert 1 <= len(served) <= LIMIT
            # The excess failed fast, without waiting on the store: every refusal came before any answer
            # that waited on it (>= 300 ms). Relative, not a fixed bound: one stall of the shared event loop
            # (the client and the service are one process here) delays both alike.
            assert max(refused) < min(served) and min(served) >= 0.3, (max(refused), min(served))
            assert proxy.most_open_connections <= LIMIT + 2  # the store never saw more than the bound
            proxy.delay = 0
            reply = await api.call("GET", memory_path("shop"), token=tokens["agent"])
            assert reply.status == 200  # and the service is fine once the store is fast again
            overloaded = await api.call("GET", "/metrics")
            assert 'status="503"' in overloaded.body
    finally:
        await proxy.close()


async def test_a_refused_request_says_why(redis_server: RedisServer, clock: FakeClock) -> None:
    with redis_server.client() as client:
        client.flushall()
    proxy = LossyProxy(redis_server.port)
    await proxy.start()
    try:
        async with running_api(
            f"redis://127.0.0.1:{proxy.port}/0", clock, max_in_flight=1, store_timeout=3.0
        ) as api:
            tokens = await api.project_with_tokens("shop", {"state_keys": ["a"]})
            proxy.delay = 0.3
            slow = asyncio.create_task(api.call("GET", memory_path("shop"), token=tokens["agent"]))
            await asyncio.sleep(0.05)
            reply = await api.call("GET", memory_path("shop"), token=tokens["agent"])
            assert_problem(reply, 503, mentions="in flight")
            assert reply.headers["Retry-After"] == "1"
            assert (await slow).status == 200
    finally:
        await proxy.close()


async def test_repeated_bad_tokens_are_throttled_without_locking_out_good_ones(
    store_url: str, clock: FakeClock
) -> None:
    async with running_api(store_url, clock) as api:
        tokens = await api.project_with_tokens("shop", {"state_keys": ["a"]})
        statuses = [
            (await api.call("GET", memory_path("shop"), token=f"cm_{i:012x}_guess")).status for i in range(25)
        ]
        assert statuses[:20] == [401] * 20 and statuses[20:] == [429] * 5
        throttled = await api.call("GET", memory_path("shop"), token="cm_000000000000_again")
        assert_problem(throttled, 429, mentions="too many failed")
        assert 1 <= int(throttled.headers["Retry-After"]) <= 61
        # The same address with a good token is served, every time.
        for _ in range(3):
            assert (await api.call("GET", memory_path("shop"), token=tokens["agent"])).status == 200
