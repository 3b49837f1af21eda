"""SQLite point reads (service/storage/sqlite/point_reads.py): a caller's memory, a conversation's header and
a call's trust are read on the event loop's thread, and each such read still sees the latest write committed
to the file, by this store or by another process; what that connection cannot read at once goes to the
reader thread as before. The contract suite (tests/storage/test_contract.py and the others) runs every read
of the SQLite store through these paths too."""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from subprocess import PIPE

import pytest
from caller_memory.service.domain.errors import StoreUnavailable
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import CallerRef
from caller_memory.service.domain.store.transcripts import ConversationKey
from caller_memory.service.storage.sqlite.store import SQLiteStore

from tests.storage.test_transcripts import append, new_caller, new_key, now_ms, platform_call

FOREVER = 2**42

#: Another process writing to the same file: for each line "n" read from stdin, it sets the caller's field
#: ``n`` to n through its own SQLiteStore, and prints "n" once the write is committed.
WRITER = """
import asyncio, sys
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import CallerRef
from caller_memory.service.storage.sqlite.store import SQLiteStore

async def main() -> None:
    store = SQLiteStore(sys.argv[1])
    await store.open()
    print("ready", flush=True)
    for line in sys.stdin:
        n = int(line)
        field = StoredField(value=str(n).encode(), expires_at=2**42, written_at=n)
        await store.patch_fields(CallerRef("p", "other"), {"n": field}, [], 0)
        print(n, flush=True)
    await store.close()

asyncio.run(main())
"""


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    backend = SQLiteStore(tmp_path / "memory.db")
    await backend.open()
    try:
        yield backend
    finally:
        await backend.close()


def field(value: int) -> StoredField:
    return StoredField(value=str(value).encode(), expires_at=FOREVER, written_at=value)


async def test_memory_header_and_trust_are_read_on_the_loops_thread(store: SQLiteStore) -> None:
    caller, key, t = new_caller(), new_key(), now_ms()
    await store.patch_fields(caller, {"name": field(1)}, [], t)
    await append(store, key, caller, platform_call(t)[:1], t)
    await store.keep_call_trust(
        key.project, key.conversation_id, "verified", step_up=False, expires_at_ms=FOREVER, now_ms=t
    )
    points = store._points
    before = (points.done, points.handed_over)
    assert await store.read_fields(caller, t) == {"name": field(1)}
    header, messages = await store.read_conversation(key, t)
    assert header is not None and header.subject == caller.subject and messages == []
    assert await store.call_trust(key.project, key.conversation_id, t) == ("verified", False)
    assert (points.done, points.handed_over) == (before[0] + 3, before[1])


async def test_each_read_sees_the_stores_latest_write(store: SQLiteStore) -> None:
    caller, t = CallerRef("p", "a"), now_ms()
    for n in range(50):
        await store.patch_fields(caller, {"n": field(n)}, [] if n % 5 else ["gone"], t)
        assert await store.read_fields(caller, t) == {"n": field(n)}
    await store.patch_fields(caller, {}, ["n"], t)
    assert await store.read_fields(caller, t) == {}
    assert store._points.handed_over == 0


async def test_each_read_sees_another_processs_latest_write(store: SQLiteStore) -> None:
    """A write committed by another process on the file is seen by the next read, every time (the loop's
    connection keeps no snapshot and no cache between reads)."""
    caller, t = CallerRef("p", "other"), now_ms()
    writer = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WRITER, str(store.path), stdin=PIPE, stdout=PIPE
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        assert await asyncio.wait_for(writer.stdout.readline(), 30) == b"ready\n"
        assert await store.read_fields(caller, t) == {}  # the connection has read the file before each write
        for n in range(1, 21):
            writer.stdin.write(b"%d\n" % n)
            assert await asyncio.wait_for(writer.stdout.readline(), 30) == b"%d\n" % n
            assert await store.read_fields(caller, t) == {"n": field(n)}
        writer.stdin.close()
        assert await asyncio.wait_for(writer.wait(), 30) == 0
    finally:
        if writer.returncode is None:
            writer.kill()
            await writer.wait()
    assert store._points.done >= 21 and store._points.handed_over == 0


async def test_a_read_during_another_connections_write_does_not_wait(store: SQLiteStore) -> None:
    """WAL: while another connection holds a write transaction, a read answers at once with what is
    committed, on the loop's thread, and sees the write once it commits."""
    caller, t = CallerRef("p", "held"), now_ms()
    await store.patch_fields(caller, {"n": field(1)}, [], t)
    other = sqlite3.connect(store.path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        other.execute(
            "UPDATE fields SET value = ?, written_at = 2 WHERE project = 'p' AND subject = 'held'", (b"2",)
        )
        started = time.perf_counter()
        assert await store.read_fields(caller, t) == {"n": field(1)}
        assert time.perf_counter() - started < 0.5  # the busy timeout is 5 s: it did not wait for the lock
        other.execute("COMMIT")
    finally:
        other.close()
    assert await store.read_fields(caller, t) == {"n": field(2)}
    assert store._points.handed_over == 0


async def test_a_read_from_another_thread_goes_to_the_reader_thread(store: SQLiteStore) -> None:
    caller, t = CallerRef("p", "a"), now_ms()
    await store.patch_fields(caller, {"n": field(1)}, [], t)
    assert await store.read_fields(caller, t) == {"n": field(1)}  # the loop's thread owns the connection
    found: list[object] = []
    elsewhere = threading.Thread(target=lambda: found.append(asyncio.run(store.read_fields(caller, t))))
    elsewhere.start()
    await asyncio.to_thread(elsewhere.join, 10)
    assert found == [{"n": field(1)}]
    assert store._points.handed_over == 1


async def test_a_failed_point_read_is_done_by_the_reader_thread(store: SQLiteStore) -> None:
    """Any SQLite error on the loop's connection hands the read over (whose errors the store translates as
    always) and drops that connection; the next point read opens a fresh one."""
    caller, t = CallerRef("p", "a"), now_ms()
    await store.patch_fields(caller, {"n": field(1)}, [], t)
    points = store._points

    def missing(conn: sqlite3.Connection) -> object:
        return conn.execute("SELECT * FROM no_such_table").fetchall()

    with pytest.raises(StoreUnavailable, match="no such table"):
        await points.read(missing, store._read)
    assert points.handed_over == 1 and points._conn is None
    assert await store.read_fields(caller, t) == {"n": field(1)}
    assert points.handed_over == 1 and points._conn is not None


async def test_the_loops_connection_never_writes(store: SQLiteStore) -> None:
    def write(conn: sqlite3.Connection) -> str:
        conn.execute("INSERT INTO meta (key, value) VALUES ('point', '1')")
        return "written"

    async def reader_thread(fn: object) -> str:
        return "handed over"

    assert await store._points.read(write, reader_thread) == "handed over"  # refused there (query_only)
    assert (
        await store._read(lambda conn: conn.execute("SELECT 1 FROM meta WHERE key = 'point'").fetchall())
        == []
    )


async def test_a_closed_store_reads_nothing_and_keeps_no_connection(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "memory.db")
    caller, key, t = CallerRef("p", "a"), ConversationKey("p", "c"), now_ms()
    with pytest.raises(StoreUnavailable):
        await store.read_fields(caller, t)
    assert not (tmp_path / "memory.db").exists()  # a point read never creates the file
    await store.open()
    await store.patch_fields(caller, {"n": field(1)}, [], t)
    assert await store.read_fields(caller, t) == {"n": field(1)}
    await store.close()
    assert store._points._conn is None
    for read in (
        store.read_fields(caller, t),
        store.read_conversation(key, t),
        store.call_trust("p", "c", t),
    ):
        with pytest.raises(StoreUnavailable):
            await read
    await store.open()  # reopened: point reads again
    try:
        assert await store.read_fields(caller, t) == {"n": field(1)}
        assert store._points._conn is not None
    finally:
        await store.close()
