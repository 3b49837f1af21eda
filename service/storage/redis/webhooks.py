"""Redis backend, webhooks (SPEC section 11): a project's endpoints and the durable queue of their deliveries.

:class:`RedisWebhooks` is a mixin of :class:`~caller_memory.service.storage.redis.store.RedisStore`; it sends its commands through the store's
transport, as every other operation does. Key names are in :mod:`caller_memory.service.storage.redis.keys`, scripts in ``lua/webhook_*.lua``.

Layout. Three kinds of slot (hash tags), so that each step is one script in one slot:

- the endpoint's queue (``{wq:<project>:<endpoint_id>}``): a hash per delivery (with its latest attempts) and
  six sorted sets of its ids: due (queued and not leased, by ``next_attempt_at``), leased (by the lease's
  end), failed (by minus ``last_attempt_at``), every delivery by ``expires_at``, queued ones by
  ``created_at``, and delivered ones (kept without their payload for the listing) by minus
  ``last_attempt_at``. A claim is one
  script (``webhook_queue.lua``): leases that ran out go back to due at their own due time, then one
  ``ZRANGE ... BYSCORE LIMIT`` of due takes the earliest, and each is moved to leased with its owner. Two
  claims cannot take one delivery: the script is atomic in its slot, and a claim is acknowledged (on a
  cluster, once a replica has it) before its deliveries are sent;
- the project (``{wp:<project>}``): its endpoints (a hash of JSON documents), and the delivery index, which
  says for which endpoint each delivery id is queued (``webhook_index.lua``): what finds a delivery by its id
  alone, and what keeps an id queued once in its project (an id that lives for another endpoint is left as
  it is). With it, the endpoints that have deliveries, by their latest expiry (a project's listing
  reads those endpoints' queues only);
- the caller (their bucket, ``{<bucket>}``, with their memory and tombstone): the ids of the deliveries about
  them, so that an erasure finds them (written with a check of the tombstone: nothing is queued when the
  caller was erased at or after what is queued was made, as ends are refused).

An enqueue is ``webhook_enqueue.lua``, made of parts of one slot each: the listing in each caller's slot, the
index in the project's, one queue per endpoint, and the work index (below). Whatever the order, an id is
never in a queue without its index entry and its caller's listing, and an erasure (its tombstone first, then
:meth:`RedisWebhooks.delete_caller_deliveries`) must not miss what is written after it read the listing.

- One server (any key is reachable from a script): one call with every part, one atomic step in one round
  trip. The tombstone is read before anything is written; once it is there, nothing is. An end's deliveries
  (one caller's, just made) go as the compact ``ends`` part, and the ends of one turn of the event loop go
  together in one call
  (:meth:`~caller_memory.service.storage.redis.webhook_enqueue.RedisWebhookEnqueue._join_ends`), each caller's tombstone read on its own: an
  erased caller's deliveries are left out, the others' written.
- A cluster (one slot per call): the listings and the index first, at once, then the queues and the work
  index, at once. The tombstone is in another slot than the queues, so the enqueue reads it again after
  writing and takes back what it wrote if the caller was erased meanwhile (the erasure wrote its tombstone
  before reading the listing, so one of the two always sees the other): three round trips one after the
  other, the fewest that order allows.

Expiry. Each delivery's hash expires (``PEXPIREAT``) at its ``expires_at``, each set at the latest
``expires_at`` it holds, so nothing outlives its deliveries even if nothing reads it again. Reads filter by the
service's clock, and every queue script first deletes a bounded batch of expired deliveries of its endpoint.

Statistics do not scan: :data:`~caller_memory.service.storage.redis.keys.WEBHOOK_WORK` is one sorted set of every endpoint that has deliveries
(by their latest expiry), updated with one ``ZADD GT`` per enqueue (inside the enqueue's script on one server;
one slot on a cluster: one command per enqueue, on every enqueue, which is the price of not scanning), and
:meth:`RedisWebhooks.queue_stats` asks each of those endpoints' queues for its counts (one write per primary).
Endpoints are configuration, not deliveries: they do not expire. :data:`~caller_memory.service.storage.redis.keys.WEBHOOK_PROJECTS` lists every
project that ever registered one (the delivery worker's list); a project is not taken off it when its last
endpoint goes, since an endpoint registered at that moment would be hidden.
"""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import orjson
from redis.exceptions import NoScriptError

from ...domain.errors import StoreCorrupt
from ...domain.store.webhooks import (
    DELIVERED_KEPT_MS,
    DELIVERED_KEPT_PER_ENDPOINT,
    Delivery,
    DeliveryStatus,
    QueueStats,
    Settlement,
    WebhookEndpoint,
    attempts_of,
    kept_error,
)
from . import keys
from .transcripts import _all
from .transport import Call, Command, hash_reply
from .webhook_enqueue import RedisWebhookEnqueue

if TYPE_CHECKING:
    from ...domain.store import CallerRef

#: Deliveries an erasure or an endpoint's deletion deletes per round (each round a few bounded calls).
BATCH = 500
#: Endpoints queue_stats asks at once, and endpoints of one project a listing reads at most.
ENDPOINTS_AT_ONCE = 500


def _encode_endpoint(endpoint: WebhookEndpoint) -> bytes:
    return orjson.dumps(
        {
            "url": endpoint.url,
            "events": list(endpoint.events),
            "include_history": endpoint.include_history,
            "created_at": endpoint.created_at,
            "secret": base64.b64encode(endpoint.secret).decode(),
            "previous_secret": base64.b64encode(endpoint.previous_secret).decode(),
            "previous_until": endpoint.previous_until,
            "description": endpoint.description,
        }
    )


def _decode_endpoint(project: str, endpoint_id: str, data: bytes) -> WebhookEndpoint:
    try:
        doc = orjson.loads(data)
        return WebhookEndpoint(
            project=project,
            endpoint_id=endpoint_id,
            url=doc["url"],
            events=tuple(doc["events"]),
            include_history=bool(doc["include_history"]),
            created_at=int(doc["created_at"]),
            secret=base64.b64decode(doc["secret"]),
            previous_secret=base64.b64decode(doc["previous_secret"]),
            previous_until=int(doc["previous_until"]),
            description=doc["description"],
        )
    except (KeyError, TypeError, ValueError) as exc:  # orjson's and binascii's errors are ValueErrors
        raise StoreCorrupt(f"webhook endpoint {endpoint_id} cannot be read") from exc


def _sorted_endpoints(endpoints: Iterable[WebhookEndpoint]) -> list[WebhookEndpoint]:
    return sorted(endpoints, key=lambda e: (e.created_at, e.endpoint_id, e.project))


def _delivery(project: str, endpoint_id: str, delivery_id: bytes | str, flat: Any) -> Delivery:
    """A delivery from its hash (a flat list from a script, or HGETALL's reply)."""
    raw = hash_reply(flat)
    try:
        return Delivery(
            project=project,
            delivery_id=delivery_id.decode() if isinstance(delivery_id, bytes) else delivery_id,
            endpoint_id=endpoint_id,
            event=raw[b"event"].decode(),
            payload=raw[b"payload"],
            subject=raw[b"subject"].decode(),
            created_at=int(raw[b"created_at"]),
            expires_at=int(raw[b"expires_at"]),
            status=DeliveryStatus(raw[b"status"].decode()),
            attempts=int(raw[b"attempts"]),
            next_attempt_at=int(raw[b"next_attempt_at"]),
            last_attempt_at=int(raw[b"last_attempt_at"]),
            last_error=raw[b"last_error"].decode(),
            recent_attempts=attempts_of(raw.get(b"attempt_log", b"").decode()),
        )
    except (KeyError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise StoreCorrupt("a stored webhook delivery cannot be read") from exc


class RedisWebhooks(RedisWebhookEnqueue):
    """The webhook methods of the Store interface on Redis (standalone or Redis Cluster); the enqueue is
    :class:`~caller_memory.service.storage.redis.webhook_enqueue.RedisWebhookEnqueue`'s."""

    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _bulk_timeout: float

    def _queue(
        self, project: str, endpoint_id: str, op: str, now_ms: int, *args: str | bytes | int
    ) -> Awaitable[Any]:
        """``webhook_queue.lua``'s operation ``op`` on the endpoint's queue."""
        return self._transport.script(
            "webhook_queue",
            keys.webhook_queue_keys(project, endpoint_id),
            [now_ms, keys.webhook_delivery_prefix(project, endpoint_id), op, *args],
        )

    async def _endpoint_of(self, project: str, delivery_id: str) -> str | None:
        """The endpoint the delivery is queued for, by the project's index (None: no such delivery)."""
        (endpoint,) = await self._transport.run(
            ("HGET", keys.webhook_index_keys(project)[0], delivery_id), replicate=False
        )
        return None if endpoint is None else str(endpoint.decode())

    async def _forget(self, project: str, gone: Sequence[tuple[str, str, str]]) -> None:
        """Take ``(delivery id, endpoint id, subject)`` of deleted deliveries off the project's index and their
        callers' listings (after the deliveries themselves, so that nothing live is ever unindexed)."""
        if not gone:
            return
        index_keys = keys.webhook_index_keys(project)
        index_args: list[str | bytes | int] = [
            0,
            "remove",
            *(part for delivery_id, endpoint, _ in gone for part in (delivery_id, endpoint)),
        ]
        by_subject: dict[str, list[str]] = {}
        for delivery_id, _, subject in gone:
            if subject:
                by_subject.setdefault(subject, []).append(delivery_id)
        listings: list[Command] = [
            ("ZREM", keys.caller_webhooks_key(project, subject), *ids) for subject, ids in by_subject.items()
        ]
        if not self._cluster:
            # One server: one write (each command idempotent: on NOSCRIPT all go again, the script as text).
            transport = self._transport
            try:
                await transport.run(
                    transport.script_command("webhook_index", index_keys, index_args), *listings
                )
            except NoScriptError:
                text = cast("str", transport.scripts["webhook_index"].script)
                await transport.run(("EVAL", text, len(index_keys), *index_keys, *index_args), *listings)
            return
        await _all(
            self._transport.script("webhook_index", index_keys, index_args),
            *(self._transport.run(command) for command in listings),
        )

    # Endpoints ----------------------------------------------------------------------------------------------

    async def put_endpoint(self, endpoint: WebhookEndpoint) -> None:
        async with Call("put_endpoint", self._timeout):
            # The project is listed first: an endpoint is never there without the delivery worker seeing it.
            await self._transport.in_order(
                ("SADD", keys.WEBHOOK_PROJECTS, endpoint.project),
                (
                    "HSET",
                    keys.webhook_endpoints_key(endpoint.project),
                    endpoint.endpoint_id,
                    _encode_endpoint(endpoint),
                ),
            )

    async def get_endpoint(self, project: str, endpoint_id: str) -> WebhookEndpoint | None:
        async with Call("get_endpoint", self._timeout):
            (data,) = await self._transport.run(("HGET", keys.webhook_endpoints_key(project), endpoint_id))
        return None if data is None else _decode_endpoint(project, endpoint_id, data)

    async def list_endpoints(self, project: str | None = None) -> list[WebhookEndpoint]:
        # Unbounded by design (the port has no page): endpoints are few, registered by people.
        async with Call("list_endpoints", self._timeout):
            if project is not None:
                projects = [project]
            else:
                (members,) = await self._transport.run(("SMEMBERS", keys.WEBHOOK_PROJECTS))
                projects = sorted(m.decode() for m in members)
            # Each project's endpoints are in a slot of its own.
            replies = await self._transport.each(
                [("HGETALL", keys.webhook_endpoints_key(p)) for p in projects], replicate=False
            )
        return _sorted_endpoints(
            _decode_endpoint(p, endpoint_id.decode(), data)
            for p, reply in zip(projects, replies, strict=True)
            for endpoint_id, data in hash_reply(reply).items()
        )

    async def delete_endpoint(self, project: str, endpoint_id: str) -> bool:
        index = keys.webhook_index_keys(project)
        async with Call("delete_endpoint", self._bulk_timeout):
            # Its deliveries first, batch after batch, then the endpoint: a deletion cut short leaves the
            # endpoint, and its retry finishes the work. Their callers' listings (each in its caller's slot)
            # keep the ids until they expire: an erasure finds no index entry for them and drops them.
            while True:
                ids = await self._queue(project, endpoint_id, "drop", 0, BATCH)
                if ids:
                    pairs = (part for delivery_id in ids for part in (delivery_id, endpoint_id))
                    await self._transport.script("webhook_index", index, [0, "remove", *pairs])
                if len(ids) < BATCH:
                    break
            (deleted,) = await self._transport.run(("HDEL", keys.webhook_endpoints_key(project), endpoint_id))
            await self._transport.each(
                [
                    ("ZREM", index[2], endpoint_id),
                    ("ZREM", keys.WEBHOOK_WORK, keys.webhook_work_member(project, endpoint_id)),
                ]
            )
        return int(deleted) > 0

    # The queue (the enqueue is RedisWebhookEnqueue's) ------------------------------------------------------

    async def _take_back(self, project: str, queues: dict[str, list[Delivery]]) -> None:
        """Delete what an enqueue wrote for a caller erased meanwhile (whoever else the deliveries name)."""
        replies = await _all(
            *(
                self._queue(project, endpoint_id, "remove", 0, "", *(d.delivery_id for d in ds))
                for endpoint_id, ds in queues.items()
            )
        )
        await self._forget(project, self._removed(queues, replies))

    @staticmethod
    def _removed(endpoints: Iterable[str], replies: Sequence[Any]) -> list[tuple[str, str, str]]:
        """``(delivery id, endpoint id, subject)`` from the queue script's ``remove`` replies, in order."""
        return [
            (reply[i].decode(), endpoint_id, reply[i + 1].decode())
            for endpoint_id, reply in zip(endpoints, replies, strict=True)
            for i in range(0, len(reply), 3)
        ]

    @staticmethod
    def _unsent(replies: Sequence[Any]) -> int:
        """How many of the deliveries of ``remove`` replies were queued or failed (not delivered)."""
        return sum(reply[i + 2] != b"delivered" for reply in replies for i in range(0, len(reply), 3))

    async def claim_deliveries(
        self, project: str, endpoint_id: str, now_ms: int, limit: int, *, owner: str, lease_until: int
    ) -> list[Delivery]:
        if limit <= 0:
            return []
        async with Call("claim_deliveries", self._timeout):
            reply = await self._queue(project, endpoint_id, "claim", now_ms, limit, owner, lease_until)
        return [_delivery(project, endpoint_id, delivery_id, flat) for delivery_id, flat in reply]

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
        async with Call("settle_delivery", self._timeout):
            endpoint_id = await self._endpoint_of(project, delivery_id)
            if endpoint_id is None:
                return False
            settled, _ = await self._queue(
                project,
                endpoint_id,
                "settle",
                now_ms,
                delivery_id,
                owner,
                outcome.value,
                next_attempt_at,
                error,
                http_status,
                now_ms + DELIVERED_KEPT_MS,
                kept_error(error),
                DELIVERED_KEPT_PER_ENDPOINT,
            )
        # A delivered one stays indexed and listed for its caller (an erasure finds it there) until it goes.
        return bool(int(settled))

    async def list_deliveries(
        self,
        project: str,
        status: DeliveryStatus,
        now_ms: int,
        *,
        endpoint_id: str | None = None,
        limit: int = 100,
    ) -> list[Delivery]:
        if limit <= 0:
            return []
        async with Call("list_deliveries", self._timeout):
            if endpoint_id is not None:
                endpoints = [endpoint_id]
            else:
                work = keys.webhook_index_keys(project)[2]
                (members,) = await self._transport.run(
                    ("ZRANGE", work, f"({now_ms}", "+inf", "BYSCORE", "LIMIT", 0, ENDPOINTS_AT_ONCE)
                )
                endpoints = [m.decode() for m in members]
            # Each endpoint's queue is in a slot of its own: one write per primary (no replica waited for:
            # a listing writes only the deletion of expired deliveries).
            replies = await self._transport.run_scripts(
                "webhook_queue",
                [
                    (
                        keys.webhook_queue_keys(project, e),
                        [now_ms, keys.webhook_delivery_prefix(project, e), "list", status.value, limit],
                    )
                    for e in endpoints
                ],
            )
        found = [
            _delivery(project, e, delivery_id, flat)
            for e, reply in zip(endpoints, replies, strict=True)
            for delivery_id, flat in reply
        ]
        if status is DeliveryStatus.QUEUED:
            found.sort(key=lambda d: (d.created_at, d.delivery_id))
        else:
            found.sort(key=lambda d: (-d.last_attempt_at, d.delivery_id))
        return found[:limit]

    async def get_delivery(self, project: str, delivery_id: str, now_ms: int) -> Delivery | None:
        async with Call("get_delivery", self._timeout):
            endpoint_id = await self._endpoint_of(project, delivery_id)
            if endpoint_id is None:
                return None
            (flat,) = await self._transport.run(
                ("HGETALL", keys.webhook_delivery_key(project, endpoint_id, delivery_id))
            )
        if not flat:
            return None
        delivery = _delivery(project, endpoint_id, delivery_id, flat)
        live = delivery.expires_at > now_ms and delivery.status is not DeliveryStatus.DELIVERED
        return delivery if live else None

    async def redeliver(self, project: str, delivery_id: str, now_ms: int) -> Delivery | None:
        async with Call("redeliver", self._timeout):
            endpoint_id = await self._endpoint_of(project, delivery_id)
            if endpoint_id is None:
                return None
            reply = await self._queue(project, endpoint_id, "redeliver", now_ms, delivery_id)
        return _delivery(project, endpoint_id, reply[0], reply[1]) if reply else None

    async def delete_delivery(self, project: str, delivery_id: str) -> bool:
        async with Call("delete_delivery", self._timeout):
            endpoint_id = await self._endpoint_of(project, delivery_id)
            if endpoint_id is None:
                return False
            reply = await self._queue(project, endpoint_id, "remove", 0, "", delivery_id)
            gone = self._removed([endpoint_id], [reply])
            await self._forget(project, gone)
        return bool(gone)

    async def delete_caller_deliveries(self, caller: CallerRef) -> int:
        project, subject = caller.project, caller.subject
        listing = keys.caller_webhooks_key(project, subject)
        ids_key = keys.webhook_index_keys(project)[0]
        removed = 0
        async with Call("delete_caller_deliveries", self._timeout):
            while True:
                (listed,) = await self._transport.run(("ZRANGE", listing, 0, BATCH - 1))
                if not listed:
                    break
                ids = [i.decode() for i in listed]
                (where,) = await self._transport.run(("HMGET", ids_key, *ids))
                queues: dict[str, list[str]] = {}
                for delivery_id, endpoint in zip(ids, where, strict=True):
                    if endpoint is not None:  # else never written, or deleted already
                        queues.setdefault(endpoint.decode(), []).append(delivery_id)
                replies = await _all(
                    *(self._queue(project, e, "remove", 0, subject, *ds) for e, ds in queues.items())
                )
                gone = self._removed(queues, replies)
                removed += self._unsent(replies)
                await self._forget(project, gone)
                # Taken off the listing last: an erasure cut short is finished by its retry.
                await self._transport.run(("ZREM", listing, *ids))
                if len(listed) < BATCH:
                    break
        return removed

    async def queue_stats(self, now_ms: int) -> QueueStats:
        queued = failed = 0
        oldest: int | None = None
        async with Call("queue_stats", self._timeout):
            # Endpoints whose deliveries all expired leave the index (a write that need not be replicated).
            await self._transport.run(
                ("ZREMRANGEBYSCORE", keys.WEBHOOK_WORK, "-inf", now_ms), replicate=False
            )
            offset = 0
            while True:
                (members,) = await self._transport.run(
                    (
                        "ZRANGE",
                        keys.WEBHOOK_WORK,
                        f"({now_ms}",
                        "+inf",
                        "BYSCORE",
                        "LIMIT",
                        offset,
                        ENDPOINTS_AT_ONCE,
                    )
                )
                endpoints = [keys.parse_index_member(m) for m in members]
                replies = await self._transport.run_scripts(
                    "webhook_queue",
                    [
                        (keys.webhook_queue_keys(p, e), [now_ms, keys.webhook_delivery_prefix(p, e), "stats"])
                        for p, e in endpoints
                    ],
                )
                for count, failures, first in replies:
                    queued += int(count)
                    failed += int(failures)
                    at = int(float(first))
                    if at >= 0 and (oldest is None or at < oldest):
                        oldest = at
                if len(members) < ENDPOINTS_AT_ONCE:
                    break
                offset += ENDPOINTS_AT_ONCE
        return QueueStats(queued=queued, failed=failed, oldest_queued_at=oldest or 0)
