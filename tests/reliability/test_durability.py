"""Durability with real processes and real SIGKILLs: no acknowledged write is ever lost.

- Redis, run with the shipped ``deploy/redis.conf`` (AOF, ``appendfsync always``), is killed in the middle of a
  load of end-of-call writes and restarted on the same directory: every write the service acknowledged is
  there, every other one was answered with an error (503, or a cut connection).
- The service over SQLite is killed the same way (SQLite lives in the service's process).
- The SDK carries on through a killed service: each ``end()`` is delivered or queued in its outbox, the
  outbox delivers the queued ones afterwards, and each conversation is applied exactly once.
- Damaged store files: the service refuses a damaged SQLite file, naming it. Redis refuses an AOF damaged
  anywhere (``aof-load-truncated no``, see deploy/redis.conf for why), and so does the service; a torn last
  command, which with ``appendfsync always`` was never acknowledged, is removed by ``redis-check-aof --fix``
  and every acknowledged write is back. Never an empty or partial store served in place of the real one.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
from caller_memory.sdk import MemoryClient, RetryPolicy

from tests.conftest import OPERATOR_TOKEN, PSEUDONYM_KEY
from tests.reliability.crash_load import (
    PROJECT,
    STATE_KEY,
    Load,
    Outcome,
    caller,
    conversation_id,
    conversations_counted,
    create_project,
    end_body,
    end_call,
    retry_all,
    stored_values,
    value,
)
from tests.support.redis_server import SHIPPED_CONFIG, RedisServer
from tests.support.service_process import ServiceProcess, free_port, http

#: Writes acknowledged before the kill, and again after the restart, before the load stops.
ACKED_BEFORE_KILL = 150
ACKED_AFTER_RESTART = 150
#: Failed writes seen while the process is down before it is restarted (the outage is real).
FAILED_WHILE_DOWN = 20
CONNECTION_ERRORS = {"ClientConnectorError", "ServerDisconnectedError", "ClientOSError", "TimeoutError"}


def acknowledged(outcome: Outcome) -> bool:
    return outcome == 200


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
def shipped_redis() -> Iterator[RedisServer]:
    with RedisServer(config_file=SHIPPED_CONFIG) as server:
        with server.client() as client:
            # The server runs with the promises the README makes, not with the helper's defaults.
            assert client.config_get("appendonly") == {"appendonly": "yes"}
            assert client.config_get("appendfsync") == {"appendfsync": "always"}
            assert client.config_get("aof-load-truncated") == {"aof-load-truncated": "no"}
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        yield server


async def check_no_write_lost(load: Load, session: aiohttp.ClientSession, base_url: str, token: str) -> None:
    """Acknowledged writes are readable; failed ones were errors, and a retry of each applies it once."""
    print(f"\nload: {load.summary()}")
    unexpected = {o: n for o, n in load.outcomes().items() if o not in {200, 503, *CONNECTION_ERRORS}}
    assert not unexpected, f"answers that are neither an acknowledgement nor a clear failure: {unexpected}"
    assert load.count(succeeded=True, phase="before") >= ACKED_BEFORE_KILL
    assert load.count(succeeded=False) >= FAILED_WHILE_DOWN
    assert load.count(succeeded=True, phase="after") >= ACKED_AFTER_RESTART

    acked = load.ids(succeeded=True)
    read = await stored_values(session, base_url, acked)
    lost = [i for i in acked if read[i] != value(i)]
    assert not lost, f"{len(lost)} acknowledged writes are missing, e.g. {lost[:10]}"

    # A failed write may or may not have been applied (the answer can be lost after the commit); the client's
    # retry settles it either way, and never applies it twice.
    failed = load.ids(succeeded=False)
    retried = await retry_all(session, base_url, token, failed)
    retry_outcomes = {o: retried.count(o) for o in set(retried)}
    print(f"retries of the {len(failed)} failed writes: {retry_outcomes}")
    assert set(retried) <= {200, "replayed"}, retry_outcomes
    read = await stored_values(session, base_url, failed)
    assert all(read[i] == value(i) for i in failed)
    assert await conversations_counted(session, base_url) == len(load.results)


async def test_redis_killed_during_a_load_loses_no_acknowledged_write(
    shipped_redis: RedisServer, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    with ServiceProcess(shipped_redis.url, tmp_path) as service:
        token = create_project(service.url)
        load = Load(lambda i: end_call(session, service.url, token, i), acknowledged)
        load.start()
        await load.wait_for(succeeded=True, count=ACKED_BEFORE_KILL)
        shipped_redis.kill()
        load.killed()
        await load.wait_for(succeeded=False, count=FAILED_WHILE_DOWN, phase="down")
        await asyncio.to_thread(shipped_redis.start)  # same port, same directory: it replays its AOF
        load.phase = "after"
        await load.wait_for(succeeded=True, count=ACKED_AFTER_RESTART, phase="after")
        await load.stop()
        await check_no_write_lost(load, session, service.url, token)


async def test_service_over_sqlite_killed_during_a_load_loses_no_acknowledged_write(
    session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    with ServiceProcess(f"sqlite:///{tmp_path}/memory.db", tmp_path) as service:
        token = create_project(service.url)
        load = Load(lambda i: end_call(session, service.url, token, i), acknowledged)
        load.start()
        await load.wait_for(succeeded=True, count=ACKED_BEFORE_KILL)
        service.kill()
        load.killed()
        await load.wait_for(succeeded=False, count=FAILED_WHILE_DOWN, phase="down")
        await asyncio.to_thread(service.start)  # same port, same file
        load.phase = "after"
        await load.wait_for(succeeded=True, count=ACKED_AFTER_RESTART, phase="after")
        await load.stop()
        await check_no_write_lost(load, session, service.url, token)


# The SDK and its outbox ------------------------------------------------------------------------------------

SDK_RETRY = RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05, attempt_timeout=1.0)


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/memory.db"
    server: RedisServer = request.getfixturevalue("shipped_redis")
    return server.url


async def test_the_sdk_outbox_delivers_every_write_through_a_killed_service_once(
    store_url: str, session: aiohttp.ClientSession, tmp_path: Path
) -> None:
    with ServiceProcess(store_url, tmp_path) as service:
        token = create_project(service.url)
        async with MemoryClient(
            service.url, token=token, project=PROJECT, retry=SDK_RETRY, outbox_path=tmp_path / "outbox.db"
        ) as client:

            async def end(i: int) -> Outcome:
                conv = client.conversation(conversation_id(i), caller=caller(i))
                conv.state[STATE_KEY] = value(i)
                try:
                    result = await conv.end(qa="resolved")
                except Exception as exc:  # end() must neither raise on an outage nor lose the write
                    return f"raised {exc!r}"
                if result.queued:
                    return "queued"
                return "delivered" if result.persisted == (STATE_KEY,) else f"odd result {result!r}"

            load = Load(end, lambda outcome: outcome == "delivered")
            load.start()
            await load.wait_for(succeeded=True, count=ACKED_BEFORE_KILL)
            service.kill()
            load.killed()
            await load.wait_for(succeeded=False, count=FAILED_WHILE_DOWN, phase="down")
            await load.stop()  # the calls in progress give up and queue: nothing is sent until the restart
            print(f"\nwhile the service was down: {load.summary()}")
            assert set(load.outcomes()) <= {"delivered", "queued"}, load.outcomes()
            queued = load.ids(succeeded=False)
            assert sorted(e.conversation_id for e in await client.outbox.pending()) == sorted(
                conversation_id(i) for i in queued
            )

            await asyncio.to_thread(service.start)
            delivered = load.ids(succeeded=True)
            read = await stored_values(session, service.url, delivered)
            assert all(read[i] == value(i) for i in delivered)
            report = await client.flush_outbox()
            print(f"after the restart: {report}")
            assert (report.delivered, report.remaining, report.rejected) == (len(queued), 0, 0)

            # Back to normal: ends are delivered at once (and would start a delivery of anything queued).
            load.phase = "after"
            load.start()
            await load.wait_for(succeeded=True, count=ACKED_AFTER_RESTART, phase="after")
            await load.stop()
            print(f"in the end: {load.summary()}")
            assert set(load.outcomes()) <= {"delivered", "queued"}, load.outcomes()
            assert (await client.flush_outbox()).remaining == 0
            assert await client.outbox.pending() == [] and await client.outbox.rejected() == []

        everything = sorted(load.results)
        read = await stored_values(session, service.url, everything)
        missing = [i for i in everything if read[i] != value(i)]
        assert not missing, f"{len(missing)} writes never arrived, e.g. {missing[:10]}"
        # Applied once each: a second end of every conversation is a replay, and analytics counted each once.
        async with MemoryClient(
            service.url, token=token, project=PROJECT, outbox_path=tmp_path / "outbox-2.db"
        ) as client:
            again = []
            for i in everything:
                conv = client.conversation(conversation_id(i), caller=caller(i))
                conv.state[STATE_KEY] = value(i)
                again.append(conv.end(qa="resolved"))
            results = await asyncio.gather(*again)
        assert all(r.replayed and not r.queued for r in results)
        assert await conversations_counted(session, service.url) == len(everything)


# Damaged store files ---------------------------------------------------------------------------------------


def serve_once(store_url: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``caller-memory serve`` against ``store_url``, expected to exit on its own."""
    env = {
        **os.environ,
        "CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM_KEY.decode(),
        "CALLER_MEMORY_OPERATOR_TOKEN": OPERATOR_TOKEN,
        "CALLER_MEMORY_STORE": store_url,
    }
    command = [sys.executable, "-m", "caller_memory.service", "serve", "--port", str(free_port())]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=30)


def write_through(service: ServiceProcess, ids: range, *, token: str = OPERATOR_TOKEN) -> None:
    for i in ids:
        reply = http(
            "POST",
            f"{service.url}/v1/projects/{PROJECT}/conversations/{conversation_id(i)}/end",
            token,
            end_body(i),
        )
        assert reply["persisted"] == [STATE_KEY]


def read_back(service: ServiceProcess, i: int) -> object:
    fields = http("GET", f"{service.url}/v1/projects/{PROJECT}/callers/{caller(i)}/memory", OPERATOR_TOKEN)[
        "fields"
    ]
    return fields.get(STATE_KEY)


@pytest.fixture(scope="module")
def sqlite_with_data(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A SQLite store file with 200 callers, written by the service and closed cleanly (WAL checkpointed)."""
    workdir = tmp_path_factory.mktemp("sqlite-data")
    path = workdir / "memory.db"
    with ServiceProcess(f"sqlite:///{path}", workdir) as service:
        create_project(service.url)
        write_through(service, range(200))
    assert not Path(f"{path}-wal").exists() or Path(f"{path}-wal").stat().st_size == 0
    return path.read_bytes()


def garbage_in_the_middle(data: bytes) -> bytes:
    page = 4096
    assert len(data) >= 20 * page, len(data)
    start = (len(data) // page // 2) * page
    noise = random.Random(6).randbytes(3 * page)
    return data[:start] + noise + data[start + len(noise) :]


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize("damage", [garbage_in_the_middle, truncated], ids=["garbage", "truncated"])
def test_a_damaged_sqlite_file_stops_the_service_with_a_message_naming_it(
    sqlite_with_data: bytes, damage: Callable[[bytes], bytes], tmp_path: Path
) -> None:
    path = tmp_path / "memory.db"
    damaged = damage(sqlite_with_data)
    path.write_bytes(damaged)
    finished = serve_once(f"sqlite:///{path}", tmp_path)
    assert finished.returncode != 0, finished.stderr
    assert f"the SQLite file {path} cannot be read" in finished.stderr, finished.stderr
    assert "listening on" not in finished.stderr
    assert path.read_bytes() == damaged  # left as it was, for the operator to inspect or restore


# Redis AOF ---------------------------------------------------------------------------------------------------


def last_incr_file(redis_dir: Path) -> Path:
    """The AOF file Redis appends to: the last ``type i`` file of the manifest (multi-part AOF, Redis 7)."""
    manifest = next((redis_dir / "appendonlydir").glob("*.manifest")).read_text()
    names = re.findall(r"^file (\S+) seq \d+ type i$", manifest, flags=re.MULTILINE)
    assert names, manifest
    last: str = names[-1]
    return redis_dir / "appendonlydir" / last


def command_offsets(data: bytes) -> list[int]:
    """Where each command of an AOF file (RESP arrays of bulk strings) starts, plus the end of the file."""
    offsets, pos = [], 0
    while pos < len(data):
        offsets.append(pos)
        assert data[pos : pos + 1] == b"*", (pos, data[pos : pos + 20])
        end = data.index(b"\r\n", pos)
        count, pos = int(data[pos + 1 : end]), end + 2
        for _ in range(count):
            end = data.index(b"\r\n", pos)
            pos = end + 2 + int(data[pos + 1 : end]) + 2
    return [*offsets, len(data)]


def fill(redis: RedisServer, workdir: Path, ids: range) -> None:
    """End the calls ``ids`` through a service process over ``redis`` (all acknowledged)."""
    with ServiceProcess(redis.url, workdir) as service:
        create_project(service.url)
        write_through(service, ids)


def all_readable(redis: RedisServer, workdir: Path, ids: range) -> bool:
    with ServiceProcess(redis.url, workdir) as service:
        return all(read_back(service, i) == value(i) for i in ids)


def refused_to_start(redis: RedisServer) -> str:
    """Start ``redis``, which must exit at once; its log."""
    with pytest.raises(RuntimeError, match="redis-server exited"):
        redis.start()
    return redis.log_path.read_text()


def check_the_service_refuses(redis: RedisServer, workdir: Path) -> None:
    finished = serve_once(redis.url, workdir)
    assert finished.returncode != 0, finished.stderr
    assert (
        f"error: Redis did not answer open: Error 111 connecting to 127.0.0.1:{redis.port}" in finished.stderr
    )
    assert "listening on" not in finished.stderr


def test_a_torn_aof_tail_stops_redis_until_redis_check_aof_removes_it(
    shipped_redis: RedisServer, tmp_path: Path
) -> None:
    fill(shipped_redis, tmp_path, range(40))
    with ServiceProcess(shipped_redis.url, tmp_path) as service:
        # The write in progress when the machine died: only the first half of its last command reached the disk.
        http(
            "PATCH",
            f"{service.url}/v1/projects/{PROJECT}/callers/{caller(0)}/memory",
            OPERATOR_TOKEN,
            {STATE_KEY: "torn"},
        )
    shipped_redis.kill()
    aof = last_incr_file(shipped_redis.dir)
    data = aof.read_bytes()
    last = command_offsets(data)[-2]
    aof.write_bytes(data[: last + (len(data) - last) // 2])

    log = refused_to_start(shipped_redis)
    assert "Unexpected end of file reading the append only file" in log, log[-2000:]
    assert "redis-check-aof --fix" in log
    check_the_service_refuses(shipped_redis, tmp_path)

    manifest = next((shipped_redis.dir / "appendonlydir").glob("*.manifest"))
    check_aof = shutil.which("redis-check-aof")
    assert check_aof is not None, "redis-check-aof is installed with redis-server"
    fixed = subprocess.run(
        [check_aof, "--fix", str(manifest)], input="y\n", capture_output=True, text=True, timeout=30
    )
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "Successfully truncated AOF" in fixed.stdout, fixed.stdout
    shipped_redis.start()
    # Every acknowledged write is there; the torn one is gone whole (its MULTI/EXEC block was cut off entirely).
    assert all_readable(shipped_redis, tmp_path, range(40))
    # New writes go on the repaired log and survive the next crash: nothing of the torn write comes back.
    fill(shipped_redis, tmp_path, range(40, 50))
    shipped_redis.kill()
    shipped_redis.start()
    assert all_readable(shipped_redis, tmp_path, range(50))


def damage_a_command_start(data: bytes, offset: int) -> bytes:
    return data[:offset] + b"!damaged!" + data[offset + len(b"!damaged!") :]


def damage_a_length(data: bytes, offset: int) -> bytes:
    """A command whose first argument claims to be longer than the rest of the file: looks like a short read."""
    line_end = data.index(b"\r\n", offset) + 2
    length_end = data.index(b"\r\n", line_end)
    return data[:line_end] + b"$99999999" + data[length_end:]


@pytest.mark.parametrize("damage", [damage_a_command_start, damage_a_length], ids=["framing", "length"])
def test_an_aof_damaged_in_the_middle_stops_redis_and_the_service(
    shipped_redis: RedisServer, damage: Callable[[bytes, int], bytes], tmp_path: Path
) -> None:
    fill(shipped_redis, tmp_path, range(40))
    shipped_redis.stop()
    aof = last_incr_file(shipped_redis.dir)
    data = aof.read_bytes()
    middle = min(command_offsets(data)[:-1], key=lambda offset: abs(offset - len(data) // 2))
    damaged = damage(data, middle)
    aof.write_bytes(damaged)

    log = refused_to_start(shipped_redis)
    assert re.search(r"(Bad file format|Unexpected end of file) reading the append only file", log), log[
        -2000:
    ]
    assert aof.read_bytes() == damaged  # not cut short to what could be read: nothing is silently dropped
    check_the_service_refuses(shipped_redis, tmp_path)
