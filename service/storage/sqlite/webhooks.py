"""SQLite backend, webhooks (SPEC section 11): a project's endpoints and the durable queue of their deliveries.

:class:`SQLiteWebhooks` is a mixin of :class:`~caller_memory.service.storage.sqlite.store.SQLiteStore`; each write is one ``IMMEDIATE``
transaction on the store's single writer (fsynced before it returns: ``synchronous=FULL``), so a claim's
choice and its lease are atomic and two claims, from this process or from another one on the same file,
never lease one delivery twice. Tables (``schema.sql``, schema version 3): ``webhook_endpoints`` and
``webhook_deliveries``; each query runs on an index made for it and is bounded.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ...domain.store.webhooks import (
    DELIVERED_KEPT_MS,
    DELIVERED_KEPT_PER_ENDPOINT,
    Delivery,
    DeliveryStatus,
    QueueStats,
    Settlement,
    WebhookEndpoint,
    WebhookStore,
    attempt_line,
    attempts_of,
    check_one_project,
    with_attempt,
)

if TYPE_CHECKING:
    from ...domain.store import CallerRef

T = TypeVar("T")

# Written into the SQL as literals (not parameters): SQLite uses a partial index only when the query's WHERE
# visibly implies the index's, and the listing indexes are partial on status.
_QUEUED, _FAILED = DeliveryStatus.QUEUED.value, DeliveryStatus.FAILED.value
_DELIVERED = DeliveryStatus.DELIVERED.value

#: Each state's listing: its order, on the index made for it (schema.sql).
_LISTING_ORDER = {
    _QUEUED: "created_at, delivery_id",
    _FAILED: "last_attempt_at DESC, delivery_id",
    _DELIVERED: "last_attempt_at DESC, delivery_id",
}

#: Expired deliveries a claim deletes by the way, across every endpoint (see claim_deliveries).
PURGE_BATCH = 100

_ENDPOINT_COLUMNS = (
    "project, endpoint_id, url, events, include_history, created_at, secret, previous_secret, previous_until, "
    "description"
)

#: The columns of a delivery row, in the order of :class:`_Row`.
_COLUMNS = (
    "id, project, delivery_id, endpoint_id, event, payload, subject, created_at, expires_at, status, "
    "attempts, next_attempt_at, last_attempt_at, last_error, lease_owner, attempt_log"
)

#: Queue ``deliveries`` unless one with the same id lives; an expired row with that id is logically gone
#: (it is deleted whatever its state), and a delivered one is a record of what was sent: a new one replaces
#: either, attempts and all.
_INSERT = (
    "INSERT INTO webhook_deliveries (project, delivery_id, endpoint_id, event, payload, subject, created_at, "
    "expires_at, status, attempts, next_attempt_at, last_attempt_at, last_error, lease_owner, lease_until) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, 0) "
    "ON CONFLICT (project, delivery_id) DO UPDATE SET endpoint_id = excluded.endpoint_id, "
    "event = excluded.event, payload = excluded.payload, subject = excluded.subject, "
    "created_at = excluded.created_at, expires_at = excluded.expires_at, status = excluded.status, "
    "attempts = excluded.attempts, next_attempt_at = excluded.next_attempt_at, "
    "last_attempt_at = excluded.last_attempt_at, last_error = excluded.last_error, lease_owner = NULL, "
    "lease_until = 0, attempt_log = '' "
    f"WHERE webhook_deliveries.expires_at <= ? OR webhook_deliveries.status = '{_DELIVERED}'"
)


class _Row(NamedTuple):
    id: int
    project: str
    delivery_id: str
    endpoint_id: str
    event: str
    payload: bytes
    subject: str
    created_at: int
    expires_at: int
    status: str
    attempts: int
    next_attempt_at: int
    last_attempt_at: int
    last_error: str
    lease_owner: str | None
    attempt_log: str

    def delivery(self) -> Delivery:
        return Delivery(
            project=self.project,
            delivery_id=self.delivery_id,
            endpoint_id=self.endpoint_id,
            event=self.event,
            payload=bytes(self.payload),
            subject=self.subject,
            created_at=self.created_at,
            expires_at=self.expires_at,
            status=DeliveryStatus(self.status),
            attempts=self.attempts,
            next_attempt_at=self.next_attempt_at,
            last_attempt_at=self.last_attempt_at,
            last_error=self.last_error,
            recent_attempts=attempts_of(self.attempt_log),
        )


def _endpoint(row: tuple[Any, ...]) -> WebhookEndpoint:
    return WebhookEndpoint(
        project=row[0],
        endpoint_id=row[1],
        url=row[2],
        events=tuple(json.loads(row[3])),
        include_history=bool(row[4]),
        created_at=row[5],
        secret=bytes(row[6]),
        previous_secret=bytes(row[7]),
        previous_until=row[8],
        description=row[9],
    )


def _load(conn: sqlite3.Connection, project: str, delivery_id: str) -> _Row | None:
    row = conn.execute(
        f"SELECT {_COLUMNS} FROM webhook_deliveries WHERE project = ? AND delivery_id = ?",
        (project, delivery_id),
    ).fetchone()
    return None if row is None else _Row._make(row)


def _live(conn: sqlite3.Connection, project: str, delivery_id: str, now_ms: int) -> _Row | None:
    """The delivery if it lives; an expired one is deleted on the way (writes only)."""
    row = _load(conn, project, delivery_id)
    if row is not None and row.expires_at <= now_ms:
        conn.execute("DELETE FROM webhook_deliveries WHERE id = ?", (row.id,))
        return None
    return row


class SQLiteWebhooks(WebhookStore):
    """The webhook methods of the Store interface on SQLite."""

    if TYPE_CHECKING:
        # Provided by SQLiteStore (service/storage/sqlite/store.py).
        async def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T: ...

        @staticmethod
        def _erased_since(conn: sqlite3.Connection, caller: CallerRef, made_at: int, now_ms: int) -> bool: ...

    # Endpoints ----------------------------------------------------------------------------------------------

    async def put_endpoint(self, endpoint: WebhookEndpoint) -> None:
        e = endpoint
        row = (
            e.project, e.endpoint_id, e.url, json.dumps(list(e.events)), int(e.include_history), e.created_at,
            e.secret, e.previous_secret, e.previous_until, e.description,
        )  # fmt: skip

        def run(conn: sqlite3.Connection) -> None:
            conn.execute(
                f"INSERT OR REPLACE INTO webhook_endpoints ({_ENDPOINT_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                row,
            )

        await self._write(run)

    async def get_endpoint(self, project: str, endpoint_id: str) -> WebhookEndpoint | None:
        def run(conn: sqlite3.Connection) -> WebhookEndpoint | None:
            row = conn.execute(
                f"SELECT {_ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE project = ? AND endpoint_id = ?",
                (project, endpoint_id),
            ).fetchone()
            return None if row is None else _endpoint(row)

        return await self._read(run)

    async def list_endpoints(self, project: str | None = None) -> list[WebhookEndpoint]:
        # Unbounded by design (the port has no page): endpoints are few, registered by people.
        def run(conn: sqlite3.Connection) -> list[WebhookEndpoint]:
            if project is None:
                rows = conn.execute(
                    f"SELECT {_ENDPOINT_COLUMNS} FROM webhook_endpoints "
                    "ORDER BY created_at, endpoint_id, project"
                ).fetchall()
            else:
                rows = conn.execute(
                    f"SELECT {_ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE project = ? "
                    "ORDER BY created_at, endpoint_id",
                    (project,),
                ).fetchall()
            return [_endpoint(row) for row in rows]

        return await self._read(run)

    async def delete_endpoint(self, project: str, endpoint_id: str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            # In one transaction with the endpoint: no delivery of it is claimed after it is gone.
            conn.execute(
                "DELETE FROM webhook_deliveries WHERE project = ? AND endpoint_id = ?", (project, endpoint_id)
            )
            cur = conn.execute(
                "DELETE FROM webhook_endpoints WHERE project = ? AND endpoint_id = ?", (project, endpoint_id)
            )
            return cur.rowcount > 0

        return await self._write(run)

    # The queue ----------------------------------------------------------------------------------------------

    async def enqueue_deliveries(
        self, deliveries: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> bool:
        return await self._write(self._enqueuing(deliveries, caller, made_at, now_ms))

    def _enqueuing(
        self, deliveries: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> Callable[[sqlite3.Connection], bool]:
        """The enqueue, as a step of a write transaction (:meth:`enqueue_deliveries`, and an end's
        recording with its events)."""
        check_one_project(deliveries, caller)
        rows = [
            (
                d.project, d.delivery_id, d.endpoint_id, d.event, d.payload, d.subject, d.created_at,
                d.expires_at, d.status.value, d.attempts, d.next_attempt_at, d.last_attempt_at, d.last_error,
                now_ms,
            )
            for d in deliveries
            if d.expires_at > now_ms
        ]  # fmt: skip

        def run(conn: sqlite3.Connection) -> bool:
            # The tombstone is read in the transaction that inserts: an erasure commits wholly before (and
            # is seen here) or after (and its delete_caller_deliveries finds these rows).
            if caller is not None and self._erased_since(conn, caller, made_at, now_ms):
                return False
            if rows:
                conn.executemany(_INSERT, rows)
            return True

        return run

    async def claim_deliveries(
        self, project: str, endpoint_id: str, now_ms: int, limit: int, *, owner: str, lease_until: int
    ) -> list[Delivery]:
        def run(conn: sqlite3.Connection) -> list[Delivery]:
            # Workers claim all the time, so deleting a batch of expired deliveries here (of any endpoint,
            # failed ones too, oldest expiry first) keeps expired payloads from outliving their expiry long,
            # and keeps the range below free of dead rows to step over.
            conn.execute(
                "DELETE FROM webhook_deliveries WHERE id IN "
                "(SELECT id FROM webhook_deliveries WHERE expires_at <= ? ORDER BY expires_at LIMIT ?)",
                (now_ms, PURGE_BATCH),
            )
            # Leased ones are stepped over: at most the endpoint's concurrency of them are due and leased.
            found = [
                _Row._make(row)
                for row in conn.execute(
                    f"SELECT {_COLUMNS} FROM webhook_deliveries WHERE project = ? AND endpoint_id = ? "
                    f"AND status = '{_QUEUED}' AND next_attempt_at <= ? AND lease_until <= ? "
                    "ORDER BY next_attempt_at, delivery_id LIMIT ?",
                    (project, endpoint_id, now_ms, now_ms, limit),
                ).fetchall()
            ]
            expired = [(row.id,) for row in found if row.expires_at <= now_ms]
            conn.executemany("DELETE FROM webhook_deliveries WHERE id = ?", expired)
            claimed = [row for row in found if row.expires_at > now_ms]
            conn.executemany(
                "UPDATE webhook_deliveries SET lease_owner = ?, lease_until = ? WHERE id = ?",
                [(owner, lease_until, row.id) for row in claimed],
            )
            return [row.delivery() for row in claimed]

        if limit <= 0:
            return []
        return await self._write(run)

    async def settle_delivery(
        self,
        project: str,
        delivery_id: str,
        owner: str,
        outcome: Settlement,
        now_ms: int,
        *,
        next_attempt_at: int = 0,
        error: str = "",
        http_status: int = 0,
    ) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            row = _live(conn, project, delivery_id, now_ms)
            # A lease that ran out still counts while nobody else claimed the delivery: the attempt was made
            # and its outcome is the latest there is (refusing it would only send the delivery once more).
            if row is None or row.status != _QUEUED or row.lease_owner != owner:
                return False
            log = with_attempt(row.attempt_log, attempt_line(row.attempts + 1, now_ms, http_status, error))
            if outcome is Settlement.DELIVERED:
                # Kept without its payload (it may hold a transcript), for the listing, a day at most.
                conn.execute(
                    f"UPDATE webhook_deliveries SET status = '{_DELIVERED}', payload = x'', "
                    "attempts = attempts + 1, last_attempt_at = ?, last_error = '', attempt_log = ?, "
                    "expires_at = min(expires_at, ?), lease_owner = NULL, lease_until = 0 WHERE id = ?",
                    (now_ms, log, now_ms + DELIVERED_KEPT_MS, row.id),
                )
                # Bounded whatever the rate: beyond the bound, the endpoint's oldest delivered ones go.
                conn.execute(
                    "DELETE FROM webhook_deliveries WHERE id IN (SELECT id FROM webhook_deliveries "
                    f"WHERE project = ? AND endpoint_id = ? AND status = '{_DELIVERED}' "
                    "ORDER BY last_attempt_at DESC, delivery_id DESC LIMIT 100 OFFSET ?)",
                    (project, row.endpoint_id, DELIVERED_KEPT_PER_ENDPOINT),
                )
                return True
            status = _QUEUED if outcome is Settlement.RETRY else _FAILED
            due = next_attempt_at if outcome is Settlement.RETRY else row.next_attempt_at
            conn.execute(
                "UPDATE webhook_deliveries SET status = ?, attempts = attempts + 1, next_attempt_at = ?, "
                "last_attempt_at = ?, last_error = ?, attempt_log = ?, lease_owner = NULL, lease_until = 0 "
                "WHERE id = ?",
                (status, due, now_ms, error, log, row.id),
            )
            return True

        return await self._write(run)

    async def list_deliveries(
        self,
        project: str,
        status: DeliveryStatus,
        now_ms: int,
        *,
        endpoint_id: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        state = status.value
        order = _LISTING_ORDER[state]

        def run(conn: sqlite3.Connection) -> list[Delivery]:
            where, params = "project = ?", [project]
            if endpoint_id is not None:
                where, params = "project = ? AND endpoint_id = ?", [project, endpoint_id]
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM webhook_deliveries WHERE {where} AND status = '{state}' "
                f"AND expires_at > ? ORDER BY {order} LIMIT ?",
                (*params, now_ms, limit),
            ).fetchall()
            return [_Row._make(row).delivery() for row in rows]

        if limit <= 0:
            return []
        return await self._read(run)

    async def get_delivery(self, project: str, delivery_id: str, now_ms: int) -> Delivery | None:
        def run(conn: sqlite3.Connection) -> Delivery | None:
            row = _load(conn, project, delivery_id)
            if row is None or row.expires_at <= now_ms or row.status == _DELIVERED:
                return None
            return row.delivery()

        return await self._read(run)

    async def redeliver(self, project: str, delivery_id: str, now_ms: int) -> Delivery | None:
        def run(conn: sqlite3.Connection) -> Delivery | None:
            row = _live(conn, project, delivery_id, now_ms)
            if row is None or row.status != _FAILED:
                return None if row is None or row.status == _DELIVERED else row.delivery()
            again = conn.execute(
                f"UPDATE webhook_deliveries SET status = '{_QUEUED}', attempts = 0, next_attempt_at = ?, "
                f"lease_owner = NULL, lease_until = 0 WHERE id = ? RETURNING {_COLUMNS}",
                (now_ms, row.id),
            ).fetchone()
            return _Row._make(again).delivery()

        return await self._write(run)

    async def delete_delivery(self, project: str, delivery_id: str) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "DELETE FROM webhook_deliveries WHERE project = ? AND delivery_id = ?", (project, delivery_id)
            )
            return cur.rowcount > 0

        return await self._write(run)

    async def delete_caller_deliveries(self, caller: CallerRef) -> int:
        def run(conn: sqlite3.Connection) -> int:
            gone = conn.execute(
                "DELETE FROM webhook_deliveries WHERE project = ? AND subject = ? RETURNING status",
                (caller.project, caller.subject),
            ).fetchall()
            return sum(status != _DELIVERED for (status,) in gone)

        return await self._write(run)

    async def queue_stats(self, now_ms: int) -> QueueStats:
        def run(conn: sqlite3.Connection) -> QueueStats:
            # One pass over the live part of the expiry index, which covers status and created_at: the cost
            # is the number of live deliveries, in index entries of a few bytes, never a payload.
            counts = {_QUEUED: (0, 0), _FAILED: (0, 0)}
            for status, count, oldest in conn.execute(
                "SELECT status, count(*), min(created_at) FROM webhook_deliveries WHERE expires_at > ? "
                "GROUP BY status",
                (now_ms,),
            ):
                counts[status] = (count, oldest)
            return QueueStats(
                queued=counts[_QUEUED][0], failed=counts[_FAILED][0], oldest_queued_at=counts[_QUEUED][1]
            )

        return await self._read(run)
