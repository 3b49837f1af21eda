"""Redis backend, the webhook enqueue (``webhook_enqueue.lua``) and its batching: how the deliveries of an end
(or any deliveries) go into their endpoints' queues, with their index entries and their callers' listings.

:class:`RedisWebhookEnqueue` is a base of :class:`~caller_memory.service.storage.redis.webhooks.RedisWebhooks`,
whose module docstring describes the layout and the order of an enqueue's parts on one server and on a cluster.
On one server the ends made in one turn of the event loop go together in one script call
(:meth:`RedisWebhookEnqueue._join_ends`), bounded by :data:`MAX_ENDS_TOGETHER` and :data:`MAX_BYTES_TOGETHER`.
"""

from __future__ import annotations

import asyncio
import functools
from abc import abstractmethod
from collections.abc import Awaitable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ...domain.errors import StoreCorrupt, StoreUnavailable
from ...domain.store.webhooks import Delivery, DeliveryStatus, WebhookStore, check_one_project
from . import keys
from .transcripts import _all
from .transport import Call, RedisTransport, ScriptCall

if TYPE_CHECKING:
    from ...domain.store import CallerRef


def _delivery_args(delivery: Delivery) -> list[str | bytes | int]:
    """A delivery as the queue script's ``enqueue`` takes it."""
    d = delivery
    return [
        d.delivery_id, d.event, d.payload, d.subject, d.created_at, d.expires_at, d.status.value,
        d.attempts, d.next_attempt_at, d.last_attempt_at, d.last_error,
    ]  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _queue_of(project: str, endpoint_id: str) -> tuple[tuple[str, ...], str, str]:
    """An endpoint's queue keys, its deliveries' prefix and its member in the work index: named once, not at
    every end (each queue part of an enqueue names them)."""
    return (
        tuple(keys.webhook_queue_keys(project, endpoint_id)),
        keys.webhook_delivery_prefix(project, endpoint_id),
        keys.webhook_work_member(project, endpoint_id),
    )


@functools.lru_cache(maxsize=1024)
def _index_keys(project: str) -> tuple[str, ...]:
    """A project's delivery index keys (an enqueue's index part), named once."""
    return tuple(keys.webhook_index_keys(project))


def all_fresh(deliveries: Sequence[Delivery], subject: str) -> bool:
    """Whether ``deliveries`` are all about ``subject`` and just made at one time (an end's): queued, no
    attempt yet, due when made."""
    made = deliveries[0].created_at if deliveries else None
    for d in deliveries:
        if not (
            d.subject == subject
            and d.created_at == made
            and d.status is DeliveryStatus.QUEUED
            and not d.attempts
            and d.next_attempt_at == made
            and not d.last_attempt_at
            and not d.last_error
        ):
            return False
    return bool(deliveries)


#: An end's deliveries (:func:`all_fresh` about its caller), its caller, and when the end was made.
EndDeliveries = tuple[Sequence[Delivery], "CallerRef", int]
#: Ends sent together in one enqueue at most, and their payloads' bytes (an end's may hold its history): the
#: call's arguments, the script's run time and what one failure fails stay bounded.
MAX_ENDS_TOGETHER = 64
MAX_BYTES_TOGETHER = 1 << 20


def _ends_call(project: str, ends: Sequence[EndDeliveries], now_ms: int) -> ScriptCall:
    """``webhook_enqueue.lua`` with its ``ends`` part alone, for the deliveries of ``ends`` (of ``project``)."""
    numbers: dict[str, int] = {}
    queue_keys: list[str] = [*_index_keys(project), keys.WEBHOOK_WORK]
    endpoint_args: list[str | bytes | int] = []
    caller_keys: list[str] = []
    caller_args: list[str | bytes | int] = []
    for live, caller, made_at in ends:
        caller_keys += (
            keys.caller_webhooks_key(project, caller.subject),
            keys.tombstone_key(project, caller.subject),
        )
        caller_args += (made_at, caller.subject, live[0].created_at, len(live))
        for d in live:
            number = numbers.get(d.endpoint_id)
            if number is None:
                number = numbers[d.endpoint_id] = len(numbers) + 1
                endpoint_keys, _, member = _queue_of(project, d.endpoint_id)
                queue_keys += endpoint_keys
                endpoint_args += (d.endpoint_id, member)
            caller_args += (number, d.delivery_id, d.event, d.payload, d.expires_at)
    args: list[str | bytes | int] = [now_ms, "ends", len(numbers), len(ends), *endpoint_args, *caller_args]
    return [*queue_keys, *caller_keys], args


class _EndsTogether:
    """The enqueues of the ends made in one turn of the event loop, for one project: sent as one script call
    once the turn is done (:meth:`RedisWebhookEnqueue._join_ends`)."""

    __slots__ = ("bytes", "ends", "now_ms", "sent", "waiting")

    def __init__(self) -> None:
        self.ends: list[EndDeliveries] = []
        self.now_ms = 0
        self.bytes = 0
        self.sent = False
        #: Each end's answer: True when queued, False when its caller was erased; or the call's error.
        self.waiting: list[asyncio.Future[bool]] = []


def enqueued(reply: Any) -> bool:
    """What ``webhook_enqueue.lua`` with every part answered: False when the caller was erased (0), else
    True (the index's flags)."""
    return not isinstance(reply, int)


def _by_endpoint(deliveries: Iterable[Delivery]) -> dict[str, list[Delivery]]:
    grouped: dict[str, list[Delivery]] = {}
    for delivery in deliveries:
        grouped.setdefault(delivery.endpoint_id, []).append(delivery)
    return grouped


class RedisWebhookEnqueue(WebhookStore):
    """The enqueue of webhook deliveries on Redis (standalone or Redis Cluster), with the batching of ends."""

    # Set by RedisStore.__init__ (service/storage/redis/store.py).
    _transport: RedisTransport
    _timeout: float
    _cluster: bool
    #: The ends of this turn of the event loop waiting for their enqueue, by project; the calls sending them.
    _ends_together: dict[str, _EndsTogether]
    _sending: set[asyncio.Task[None]]

    @abstractmethod
    async def _take_back(self, project: str, queues: dict[str, list[Delivery]]) -> None:
        """Delete what an enqueue wrote for a caller erased meanwhile (whoever else the deliveries name)."""

    async def _erased_since(self, caller: CallerRef, made_at: int, now_ms: int) -> bool:
        """Whether the caller was erased at or after ``made_at`` (a live tombstone)."""
        ((erased, expires),) = await self._transport.run(
            ("HMGET", keys.tombstone_key(caller.project, caller.subject), "erased_at", "expires_at"),
            replicate=False,
        )
        return erased is not None and expires is not None and int(expires) > now_ms and int(erased) >= made_at

    async def enqueue_deliveries(
        self, deliveries: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> bool:
        check_one_project(deliveries, caller)
        live = [d for d in deliveries if d.expires_at > now_ms]
        async with Call("enqueue_deliveries", self._timeout):
            if not live:
                return caller is None or not await self._erased_since(caller, made_at, now_ms)
            project = live[0].project
            if not self._cluster:
                return await self._enqueue_at_once(project, live, caller, made_at, now_ms)
            # A cluster, one call per slot: 1. listed in their callers' slots and indexed in the project's, at
            # once (the listing is acknowledged before any delivery is written).
            flags = await self._list(project, live, caller, made_at, now_ms)
            if flags is None:
                return False
            queues = _by_endpoint(d for d, flag in zip(live, flags, strict=True) if int(flag))
            if not queues:
                return True  # every id lives already, for another endpoint
            # 2. Written in their endpoints' queues (one slot each), and the endpoints marked as having work.
            await _all(
                *(self._enqueue_part(now_ms, self._queueing(project, e, ds)) for e, ds in queues.items()),
                self._mark_work(project, queues),
            )
            # 3. The tombstone again (see the module docstring).
            if caller is not None and await self._erased_since(caller, made_at, now_ms):
                await self._take_back(project, queues)
                return False
        return True

    async def _enqueue_at_once(
        self, project: str, live: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> bool:
        """On one server: every part in one script, one atomic step in one round trip (the tombstone is read
        with the writes); False, nothing written, when ``caller`` was erased at or after ``made_at``."""
        if caller is not None and all_fresh(live, caller.subject):  # an end's: its compact form
            (flag,) = await self._transport.script(
                "webhook_enqueue", *_ends_call(project, [(live, caller, made_at)], now_ms)
            )
            return bool(int(flag))
        reply = await self._transport.script(
            "webhook_enqueue", *self._parts_call(project, live, caller, made_at, now_ms)
        )
        return enqueued(reply)

    def _join_ends(
        self, project: str, live: Sequence[Delivery], caller: CallerRef, made_at: int, now_ms: int
    ) -> asyncio.Future[bool]:
        """On one server, queue an end's deliveries (:func:`all_fresh`) with those of the other ends of this
        turn of the event loop: one script call for them all, sent once the turn is done (in the write after
        the one of their records: the same round trip). At peak, with tens of ends in flight, an end's share
        of the call's arguments, of its parsing and of the script's purges and expiries is a fraction of what
        a call of its own costs. The future says whether it was queued (False: its caller was erased at or
        after ``made_at``, and nothing of it was written), or raises what the call raised, for every end in
        it; each end has its own, so that one that gives up (cancels it) leaves the call to the others."""
        together = self._ends_together.get(project)
        loop = asyncio.get_running_loop()
        size = sum(len(d.payload) for d in live)
        if (
            together is None
            or len(together.ends) >= MAX_ENDS_TOGETHER
            or (together.bytes + size > MAX_BYTES_TOGETHER and together.ends)
        ):
            together = self._ends_together[project] = _EndsTogether()
            loop.call_soon(self._send_together, project, together)
        together.ends.append((live, caller, made_at))
        together.bytes += size
        together.now_ms = max(together.now_ms, now_ms)
        answer: asyncio.Future[bool] = loop.create_future()
        together.waiting.append(answer)
        return answer

    def _send_together(self, project: str, together: _EndsTogether) -> None:
        if self._ends_together.get(project) is together:
            del self._ends_together[project]
        if together.sent:  # (sent already by close())
            return
        together.sent = True
        task = asyncio.ensure_future(self._run_together(project, together))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _run_together(self, project: str, together: _EndsTogether) -> None:
        # Only the ends still waiting: one whose record failed, or that gave up, cancelled its answer, and
        # its deliveries are not queued (it is redone whole by its client).
        waiting = [
            (end, answer)
            for end, answer in zip(together.ends, together.waiting, strict=True)
            if not answer.done()
        ]
        if not waiting:
            return
        answers: list[bool | BaseException] = [StoreUnavailable("the Redis store was closed")] * len(waiting)
        try:
            async with Call("enqueue_deliveries", self._timeout):
                flags = await self._transport.script(
                    "webhook_enqueue", *_ends_call(project, [end for end, _ in waiting], together.now_ms)
                )
            if len(flags) != len(waiting):
                raise StoreCorrupt(f"webhook_enqueue.lua answered {len(flags)} flags for {len(waiting)} ends")
            answers = [bool(int(flag)) for flag in flags]
        except Exception as exc:  # every end in it fails (each is redone whole by its client)
            answers = [exc] * len(waiting)
        finally:  # (cancelled: the store is closing)
            for (_, answer), outcome in zip(waiting, answers, strict=True):
                if answer.done():  # an end that gave up meanwhile cancelled its own
                    continue
                if isinstance(outcome, BaseException):
                    answer.set_exception(outcome)
                else:
                    answer.set_result(outcome)

    def _parts_call(
        self, project: str, live: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> ScriptCall:
        """``webhook_enqueue.lua`` with its parts one by one (any deliveries)."""
        parts = [
            *self._listings(project, live, caller, made_at),
            self._indexing(project, live),
            ([keys.WEBHOOK_WORK], ["work"]),
            *(self._queueing(project, e, ds) for e, ds in _by_endpoint(live).items()),
        ]
        script_keys: list[str] = []
        args: list[str | bytes | int] = [now_ms]
        for part_keys, part_args in parts:
            script_keys += part_keys
            args += part_args
        return script_keys, args

    @staticmethod
    def _listings(
        project: str, live: Sequence[Delivery], caller: CallerRef | None, made_at: int
    ) -> list[ScriptCall]:
        """``webhook_enqueue.lua``'s list parts: one per caller the deliveries are about, the caller's with
        ``made_at`` (their tombstone is read even if no delivery names them)."""
        by_subject: dict[str, list[Delivery]] = {}
        if caller is not None:
            by_subject[caller.subject] = []
        for d in live:
            if d.subject:
                by_subject.setdefault(d.subject, []).append(d)
        parts: list[ScriptCall] = []
        for subject, ds in by_subject.items():
            args: list[str | bytes | int] = [
                "list",
                made_at if caller is not None and subject == caller.subject else "",
                len(ds),
            ]
            for d in ds:
                args += (d.delivery_id, d.expires_at)
            parts.append(
                ([keys.caller_webhooks_key(project, subject), keys.tombstone_key(project, subject)], args)
            )
        return parts

    @staticmethod
    def _indexing(project: str, live: Sequence[Delivery]) -> ScriptCall:
        """``webhook_enqueue.lua``'s index part."""
        args: list[str | bytes | int] = ["index", len(live)]
        for d in live:
            args += (d.delivery_id, d.endpoint_id, d.expires_at)
        return _index_keys(project), args

    @staticmethod
    def _queueing(project: str, endpoint_id: str, deliveries: Sequence[Delivery]) -> ScriptCall:
        """``webhook_enqueue.lua``'s queue part for one endpoint."""
        queue_keys, prefix, member = _queue_of(project, endpoint_id)
        args: list[str | bytes | int] = ["queue", prefix, endpoint_id, member, len(deliveries)]
        for delivery in deliveries:
            args += _delivery_args(delivery)
        return queue_keys, args

    def _enqueue_part(self, now_ms: int, part: ScriptCall) -> Awaitable[Any]:
        """One part of ``webhook_enqueue.lua`` as a call of its own (a cluster: one slot per call)."""
        part_keys, args = part
        return self._transport.script("webhook_enqueue", part_keys, [now_ms, *args])

    async def _list(
        self, project: str, live: Sequence[Delivery], caller: CallerRef | None, made_at: int, now_ms: int
    ) -> list[Any] | None:
        """On a cluster, list ``live`` among their callers' deliveries and index them in the project; the
        index's flags (1: the id is its endpoint's to write), or None when ``caller`` was erased at or after
        ``made_at``."""
        listings = self._listings(project, live, caller, made_at)
        # Whatever the caller's listing answers, the index entries it made are harmless: an entry without a
        # delivery is found by no claim, and goes at its expiry.
        *listed, flags = await _all(
            *(self._enqueue_part(now_ms, part) for part in listings),
            self._enqueue_part(now_ms, self._indexing(project, live)),
        )
        if any(isinstance(answer, int) for answer in listed):  # 0: erased (else the empty list of flags)
            return None
        return list(flags)

    async def _mark_work(self, project: str, queues: dict[str, list[Delivery]]) -> None:
        """Mark the endpoints as having deliveries until their latest expiry (:data:`~caller_memory.service.storage.redis.keys.WEBHOOK_WORK`; on
        one server ``webhook_enqueue.lua`` does it)."""
        scores: list[str | bytes | int] = []
        for endpoint_id, deliveries in queues.items():
            scores += [max(d.expires_at for d in deliveries), keys.webhook_work_member(project, endpoint_id)]
        latest = max(d.expires_at for ds in queues.values() for d in ds)
        # NX gives a new key its expiry, GT only ever moves it later.
        await self._transport.run(
            ("ZADD", keys.WEBHOOK_WORK, "GT", *scores),
            ("PEXPIREAT", keys.WEBHOOK_WORK, latest, "NX"),
            ("PEXPIREAT", keys.WEBHOOK_WORK, latest, "GT"),
        )
