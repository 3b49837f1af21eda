"""The standalone Redis transport's shared connection (:class:`~caller_memory.service.storage.redis.lane.Lane`):
the calls in flight share one connection and each gets its own replies, whatever else happens on it (error
replies, calls that give up, a hung or restarted server). A real redis-server each."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
from caller_memory.service.domain.errors import StoreUnavailable
from caller_memory.service.storage.redis.lane import LaneLost
from caller_memory.service.storage.redis.transport import Call, ConnectionLimits, StandaloneTransport
from redis.exceptions import NoScriptError, ResponseError

from tests.support.redis_server import RedisServer


def transport_on(server: RedisServer, timeout: float = 2.0) -> StandaloneTransport:
    return StandaloneTransport(server.url, ConnectionLimits(timeout, 1.0, 64, 30))


async def clients(server: RedisServer) -> int:
    """Connections to the server other than the one asking."""
    client = server.client()
    try:
        return len(client.client_list()) - 1
    finally:
        client.close()


async def test_concurrent_calls_share_one_connection_and_each_gets_its_own_replies() -> None:
    with RedisServer() as server:
        transport = transport_on(server)
        await transport.open()
        try:
            await transport.run(*(("SET", f"k{i}", f"v{i}") for i in range(200)))

            async def one(i: int) -> list[object]:
                async with Call("test", 2.0):
                    return await transport.run(("GET", f"k{i}"), ("STRLEN", f"k{i}"), ("GET", "missing"))

            replies = await asyncio.gather(*(one(i) for i in range(200)))
            assert replies == [[f"v{i}".encode(), len(f"v{i}"), None] for i in range(200)]
            # redis-py's client (open() uses it) and the one lane the 200 calls shared
            assert await clients(server) == 2
        finally:
            await transport.aclose()


async def test_an_error_reply_fails_its_own_call_only_after_reading_all_its_replies() -> None:
    with RedisServer() as server:
        transport = transport_on(server)
        await transport.open()
        try:
            await transport.run(("SET", "text", "x"))

            async def failing() -> list[object]:
                return await transport.run(("INCR", "text"), ("SET", "after", "1"))

            async def fine(i: int) -> list[object]:
                return await transport.run(("INCR", f"n{i}"))

            results = await asyncio.gather(failing(), *(fine(i) for i in range(20)), return_exceptions=True)
            assert isinstance(results[0], ResponseError) and "not an integer" in str(results[0])
            assert results[1:] == [[1]] * 20
            assert await transport.run(("GET", "after")) == [b"1"]  # the failing call's second command ran
            with pytest.raises(NoScriptError):  # told apart: script() reloads the script on it
                await transport.run(("EVALSHA", "0" * 40, 0))
        finally:
            await transport.aclose()


async def test_a_call_that_gives_up_leaves_no_reply_to_the_next_calls() -> None:
    """A store call that timed out on a hung server does not get its reply handed to a later call: later
    calls go out on a new connection once the server answers, and each gets its own."""
    with RedisServer() as server:
        transport = transport_on(server, timeout=0.3)
        await transport.open()
        try:
            await transport.run(("SET", "a", "first"), ("SET", "b", "second"))
            os.kill(server.pid, signal.SIGSTOP)
            try:
                with pytest.raises(StoreUnavailable):
                    async with Call("hung", 0.3):
                        await transport.run(("GET", "a"))
            finally:
                os.kill(server.pid, signal.SIGCONT)
            async with Call("after", 2.0):
                assert await transport.run(("GET", "b")) == [b"second"]
                replies = await asyncio.gather(*(transport.run(("GET", k)) for k in "ab" * 10))
            assert replies == [[b"first"], [b"second"]] * 10
        finally:
            await transport.aclose()


async def test_a_restarted_server_is_reached_again_and_nothing_written_is_sent_twice() -> None:
    """A call written to a connection that turns out to be gone fails (its commands may have run before the
    server went away: it is not sent again); the next call opens a new lane."""
    with RedisServer() as server:
        transport = transport_on(server)
        await transport.open()
        try:
            assert await transport.run(("PING",)) == [b"PONG"]
            server.stop()
            server.start()  # same port; the lane's connection is gone, and the lane does not know it yet
            with contextlib.suppress(LaneLost):
                await transport.run(("INCR", "n"))
            assert await transport.run(("SET", "k", "v"), ("GET", "k")) == [b"OK", b"v"]
            assert (await transport.run(("GET", "n")))[0] in (None, b"1")  # never 2
            assert await clients(server) == 1  # the new lane (redis-py's client has not reconnected)
        finally:
            await transport.aclose()


async def test_out_of_band_pushes_are_no_calls_replies() -> None:
    """RESP3 pushes (client tracking's invalidations here; maintenance notices on managed Redis) come on the
    same connection between replies: they are skipped, never handed to a waiting call."""
    with RedisServer() as server:
        transport = transport_on(server)
        await transport.open()
        try:
            await transport.run(("SET", "tracked", "old"))
            # This connection asks to be told when the keys it reads change: each change pushes a message.
            assert await transport.run(("CLIENT", "TRACKING", "ON"), ("GET", "tracked")) == [b"OK", b"old"]
            for round_ in range(20):
                writer = server.client()
                writer.set("tracked", f"v{round_}")  # an invalidation push to the lane
                writer.close()
                replies = await asyncio.gather(
                    transport.run(("GET", "tracked")), *(transport.run(("ECHO", f"e{i}")) for i in range(5))
                )
                assert replies == [[f"v{round_}".encode()], *([f"e{i}".encode()] for i in range(5))]
        finally:
            await transport.aclose()


async def test_a_long_call_outlives_the_retirement_of_its_lane_and_runs_once() -> None:
    """A call with a long bound (a sweep) on a lane that another call's timeout retires is answered, once:
    the lane closes only when nothing waits on it."""
    with RedisServer() as server:
        transport = transport_on(server, timeout=0.3)
        await transport.open()
        try:
            script = "redis.call('INCR', KEYS[1]); local t = redis.call('TIME'); " + (
                "while true do local n = redis.call('TIME'); "
                "if (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > 600000 then break end end; return 1"
            )

            async def long() -> list[object]:
                async with Call("sweep", 5.0):
                    return await transport.run(("EVAL", script, 1, "runs"))

            slow = asyncio.ensure_future(long())
            await asyncio.sleep(0.05)
            with pytest.raises(StoreUnavailable):  # stuck behind the script: times out, retires the lane
                async with Call("read", 0.2):
                    await transport.run(("GET", "x"))
            assert await slow == [1]
            assert await transport.run(("GET", "runs")) == [b"1"]
        finally:
            await transport.aclose()


async def test_closing_while_a_lane_connects_fails_its_waiters_as_unavailable() -> None:
    with RedisServer() as server:
        transport = transport_on(server, timeout=5.0)
        await transport.open()
        os.kill(server.pid, signal.SIGSTOP)  # the lane's handshake will hang
        try:
            waiting = asyncio.ensure_future(transport.run(("PING",)))
            await asyncio.sleep(0.1)
            await transport.aclose()
            with pytest.raises(StoreUnavailable, match="closed"):
                await waiting
        finally:
            os.kill(server.pid, signal.SIGCONT)


async def test_a_call_of_no_command_answers_at_once_and_jams_nothing() -> None:
    with RedisServer() as server:
        transport = transport_on(server)
        await transport.open()
        try:
            assert await transport.run() == []
            assert await transport.run(("PING",)) == [b"PONG"]
        finally:
            await transport.aclose()


async def test_closing_fails_the_calls_waiting_and_a_closed_transport_refuses() -> None:
    with RedisServer() as server:
        transport = transport_on(server)
        await transport.open()
        await transport.run(("PING",))
        os.kill(server.pid, signal.SIGSTOP)
        try:

            async def get() -> list[object]:
                async with Call("get", 2.0):
                    return await transport.run(("GET", "k"))

            waiting = asyncio.ensure_future(get())
            await asyncio.sleep(0.05)
            await transport.aclose()
            with pytest.raises(StoreUnavailable, match="closed") as failed:  # written: not sent again
                await waiting
            assert isinstance(failed.value.__cause__, LaneLost)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        with pytest.raises(StoreUnavailable, match="not open"):
            await transport.run(("PING",))
        await transport.open()  # and it opens again
        try:
            assert await transport.run(("PING",)) == [b"PONG"]
        finally:
            await transport.aclose()
