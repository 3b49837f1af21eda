"""SQLite backend, point reads: a short read by key (a caller's memory, a conversation's header, a call's
trust) runs on the thread that asks for it, the event loop's, on a read-only connection of its own, instead of
being handed to the store's reader thread.

Why: such a read takes a few microseconds (about 8 us for a caller's memory, 5 us for a header, measured
on the 2-core VM), but on the reader thread it is the hand-over that costs: reads queue behind each other on
the one thread (32 at once: 2 ms at the median), and beside a busy event loop the thread's result waits for
the loop's thread to give up the GIL, up to the interpreter's switch interval at each hand-over (p99 26.6 ms,
``bench/proxy.py --read-probe``). On the loop's thread the read holds the loop for those microseconds and
waits for nothing.

What does not change: every read sees the latest write committed to the file, by this process's writer or by
another process. The connection is in autocommit mode and keeps nothing between reads: each statement is a
read transaction of its own (WAL) on the file as it is then, as on the reader thread. (A per-process cache
checked against ``PRAGMA data_version`` would save about 6 us of the 8 and add invalidation and memory to
get right; not worth it.) A read never waits on the loop: the busy timeout is 0, and a read this connection
cannot do at once (the file busy or damaged, any SQLite error, a call from another thread, the store not
open) is done by the reader thread as before, with its busy timeout and its translation of errors. The
connection never writes (``query_only``) and never creates the file (``mode=rw``).

A point read must not keep a cursor after it returns (a live cursor holds its read transaction, and the next
read would see that moment): ``conn.execute(...).fetchone()`` and ``fetchall()`` are fine.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import quote

T = TypeVar("T")


class PointReads:
    """One read-only connection for point reads, made on first use by the thread that uses it (the event
    loop's) and used by that thread only; ``is_open`` says whether the store is open."""

    def __init__(self, path: Path, is_open: Callable[[], bool]) -> None:
        self._path = path.absolute()  # the file the store opens, whatever the working directory later
        self._is_open = is_open
        self._conn: sqlite3.Connection | None = None
        self._thread = 0
        #: Reads done here, and reads handed to the reader thread instead (for tests and benchmarks).
        self.done = 0
        self.handed_over = 0

    async def read(
        self,
        fn: Callable[[sqlite3.Connection], T],
        otherwise: Callable[[Callable[[sqlite3.Connection], T]], Awaitable[T]],
    ) -> T:
        """``fn`` run on this thread's connection, or, when it cannot be, by ``otherwise`` (the store's
        reader thread)."""
        conn = self._connection()
        if conn is not None:
            try:
                found = fn(conn)
            except sqlite3.Error:
                self.close()  # whatever it was, the reader thread reads (and reports) it; a fresh one next
            else:
                self.done += 1
                return found
        self.handed_over += 1
        return await otherwise(fn)

    def _connection(self) -> sqlite3.Connection | None:
        if not self._is_open():
            return None
        if self._conn is not None:
            return self._conn if self._thread == threading.get_ident() else None
        try:
            conn = sqlite3.connect(
                f"file:{quote(str(self._path))}?mode=rw",
                uri=True,
                isolation_level=None,
                check_same_thread=False,  # checked here, so that close() may run on any thread
            )
        except sqlite3.Error:
            return None
        try:
            conn.execute("PRAGMA busy_timeout = 0")
            conn.execute("PRAGMA query_only = ON")
        except sqlite3.Error:
            conn.close()
            return None
        self._conn, self._thread = conn, threading.get_ident()
        return conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
