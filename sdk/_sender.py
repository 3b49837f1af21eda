"""The background sending of one conversation's messages (``conv.add_message()``).

``add_message`` only appends to this buffer (no await, no I/O); one task per conversation, started when
there is something to send and ended when there is nothing left, sends batches in order, one at a time: the
messages that arrive while a batch is in flight make up the next one, so batches grow with the load and a
quiet call sends each message at once. Each batch is built once (its ``message_id``\\ s and ``sent_at`` fixed)
and sent byte for byte the same on every attempt, so a retry after a lost answer adds nothing twice.

Transient failures are retried with the client's :class:`~caller_memory.sdk.policies.RetryPolicy`; when they
are exhausted (or the conversation ends, or the client closes, and time is up) the batches are kept in the
durable outbox and the conversation goes on *through* the outbox (later batches are queued behind the kept
ones) until they are delivered. A refusal caused by the caller's input is dropped and recorded, never
retried; a conversation that is over (ended, expired, deleted, not stored) drops what is left.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from ._wire import AppendedAnswer, StatusAnswer
from .errors import (
    CallerMemoryError,
    GoneError,
    NotFoundError,
    OutboxUnavailableError,
    ServiceError,
    ServiceUnavailableError,
)
from .policies import RetryPolicy
from .transcript import TranscriptError

log = logging.getLogger("caller_memory.sdk")

#: Most messages in one batch (the service's limit), and the bytes a batch's body may take: the service
#: takes request bodies of 64 KiB; the rest is room for caller, channel and the other members.
MAX_BATCH = 100
MAX_BODY = 60 * 1024
#: The largest state checkpoint sent with a batch (a larger ``conv.state`` is sent at the end only).
MAX_CHECKPOINT_BYTES = 32 * 1024
#: Longest pause between two attempts to deliver a conversation's kept batches.
MAX_OUTBOX_PAUSE = 30.0
#: Most refusals kept in ``conv.transcript_errors`` (the oldest go first).
MAX_ERRORS = 100
#: How long a close waits beyond its budget for an attempt already in flight before it cancels it.
CLOSE_SLACK = 0.05
#: What the random part of generated message ids is made of (26**12: about 2**56 prefixes).
_ID_LETTERS = "abcdefghijklmnopqrstuvwxyz"


class Host(Protocol):
    """What a conversation's sender needs of its client (:class:`~caller_memory.sdk.MemoryClient`)."""

    retry: RetryPolicy

    async def _append_batch(self, conversation_id: str, body: bytes, seconds: float) -> AppendedAnswer: ...

    async def _transcript_status(self, conversation_id: str, seconds: float) -> StatusAnswer: ...

    async def _keep_batches(self, conversation_id: str, bodies: list[bytes]) -> list[int]: ...

    async def _set_aside_batch(self, conversation_id: str, body: bytes, reason: str) -> None: ...

    async def _deliver_queued(self, conversation_id: str) -> bool: ...

    def _start_sender(
        self, sender: TranscriptBuffer, work: Coroutine[Any, Any, None]
    ) -> asyncio.Task[None]: ...


def refuses_state_only(exc: ServiceError) -> bool:
    """Whether a 413/422 names the state checkpoint only (the messages can go without it)."""
    errors = exc.problem.get("errors")
    if exc.status not in (413, 422) or not isinstance(errors, list) or not errors:
        return False
    fields = [e.get("field") for e in errors if isinstance(e, dict)]
    return len(fields) == len(errors) and all(
        isinstance(f, str) and (f == "state" or f.startswith("state.")) for f in fields
    )


def without_state(body: bytes) -> bytes:
    """A batch's body without its state checkpoint (the same messages, ``sent_at`` and the rest)."""
    document = orjson.loads(body)
    document.pop("state", None)
    return orjson.dumps(document)


def is_over(exc: ServiceError) -> bool:
    """A refusal that says the conversation takes no more messages: 404 (deleted, or the project is
    unknown), 410 (expired, erased)."""
    return isinstance(exc, NotFoundError | GoneError)


@dataclass(slots=True)
class _Item:
    seq: int
    message_id: str
    encoded: bytes


@dataclass(slots=True)
class _Batch:
    items: list[_Item]
    state: bytes | None
    body: bytes
    #: Whether it names the caller and channel (it may start the conversation).
    starts: bool

    @property
    def last_seq(self) -> int:
        return self.items[-1].seq if self.items else 0


class TranscriptBuffer:
    """The messages of one conversation on their way to the service (see the module's docstring)."""

    def __init__(
        self,
        host: Host,
        conversation_id: str,
        *,
        caller: str,
        channel: str,
        agent: str | None,
        state: Callable[[], Mapping[str, Any]],
        trust: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        """``state`` returns ``conv.state`` checked for JSON (ValueError otherwise); ``trust`` the members
        that carry the call's caller-ID trust as it is now (a step-up check may pass mid-call)."""
        self._host = host
        self.conversation_id = conversation_id
        self._caller = caller
        self._channel = channel
        self._agent = agent
        self._state = state
        self._trust = trust
        # Message ids: random per conversation object (a new process continuing the call gets new ones),
        # then a sequence number. Letters only: the service refuses an id that holds a phone number, and
        # random digits sometimes make one.
        self._prefix = "m" + "".join(secrets.choice(_ID_LETTERS) for _ in range(12))
        self._seq = 0
        self._settled_seq = 0
        self._pending: deque[_Item] = deque()
        self._queue: deque[_Batch] = deque()
        #: Entries this buffer kept in the outbox: entry id -> the last message seq in it.
        self._kept: dict[int, int] = {}
        self._via_outbox = False
        self._task: asyncio.Task[None] | None = None
        self._interrupt = asyncio.Event()
        self._progress = asyncio.Event()
        self._started = False
        self._closed = False
        self._deadline: float | None = None
        # An empty state is nothing to checkpoint: the first one sent is the first non-empty one.
        self._sent_state: bytes | None = b"{}"
        self._bad_state: bytes | None = None
        #: Why the service keeps no transcript of this conversation (then messages are dropped), or None.
        self.off: str | None = None
        self.errors: deque[TranscriptError] = deque(maxlen=MAX_ERRORS)

    def __repr__(self) -> str:
        return f"<TranscriptBuffer {self.conversation_id} unsent={self.unsent}>"

    # What the conversation calls ------------------------------------------------------------------------

    def new_id(self) -> str:
        return f"{self._prefix}.{self._seq + 1}"

    def add(self, message_id: str, encoded: bytes) -> None:
        """Buffer one message (already checked and encoded) and make sure it is on its way."""
        self._seq += 1
        if self.off is not None:
            self._settle(self._seq)
            return
        self._pending.append(_Item(self._seq, message_id, encoded))
        self.kick()

    def kick(self) -> None:
        """Start the sender if it is not running (it also sends a changed ``conv.state``)."""
        if self._task is None and self.off is None and not self._closed:
            self._task = self._host._start_sender(self, self._run())

    def started(self) -> None:
        """The service knows the conversation (its start answered): batches need not name the caller."""
        self._started = True

    def turn_off(self, reason: str) -> None:
        """The service keeps nothing more of this conversation: drop what is waiting, take nothing more."""
        if self.off is None:
            self.off = reason
            log.warning("conversation %s: its transcript is not kept (%s)", self.conversation_id, reason)
        self._pending.clear()
        self._queue.clear()
        self._settle(self._seq)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def unsent(self) -> int:
        """Messages added that the service is not known to have (still buffered, or in the outbox)."""
        return self._seq - self._settled_seq

    async def flushed(self, seconds: float) -> int:
        """Wait up to ``seconds`` for the messages added so far to reach the service (a sender pausing
        between attempts tries again at once); returns how many did not (0: the service has them all)."""
        target = self._seq
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        self._interrupt.set()  # a sender pausing between attempts tries again now: a reader waits
        while self._settled_seq < target and self.off is None:
            left = deadline - loop.time()
            if left <= 0:
                break
            progress = self._progress
            try:
                async with asyncio.timeout(left):
                    await progress.wait()
            except TimeoutError:
                break
        return max(0, target - self._settled_seq)

    async def close(self, budget: float) -> bool:
        """Take no more messages; send what is waiting within ``budget`` seconds and keep the rest in the
        outbox. True when everything reached the service (or was dropped), False when some is kept."""
        self._closed = True
        self._deadline = asyncio.get_running_loop().time() + budget
        self._interrupt.set()
        if self._task is None and (self._pending or self._queue or self._via_outbox) and self.off is None:
            self._task = self._host._start_sender(self, self._run())
        task = self._task
        if task is not None:
            await asyncio.wait([task], timeout=budget + CLOSE_SLACK)
            if not task.done():  # an attempt begun before the close outlasts it: keep what it carries
                task.cancel()
                await asyncio.wait([task])
        return not (self._pending or self._queue or self._via_outbox or self._kept)

    async def idle(self) -> None:
        """Wait until the sender stopped (once closed, it stops within the close's budget)."""
        task = self._task
        if task is not None:
            await asyncio.wait([task])

    def outbox_settled(self, entry_id: int, error: ServiceError | None = None) -> None:
        """A kept batch of this conversation was delivered (or refused) by an outbox delivery."""
        last = self._kept.pop(entry_id, None)
        if error is not None:
            self._record(error.status, str(error), (), state=False)
            if is_over(error):
                self.turn_off(f"the service refused a kept batch: {error}")
        if last is not None:
            self._settle(last)
        if not self._kept:
            self._interrupt.set()  # the sender may go back to sending directly

    # The sender -------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            await self._work()
        except asyncio.CancelledError:
            if await self._keep():  # whatever was in flight is kept (a later delivery of it is harmless)
                self._via_outbox = bool(self._kept)
            raise
        except Exception:  # a sender must never take the agent down
            log.exception("conversation %s: sending its messages failed", self.conversation_id)
        finally:
            self._task = None

    async def _work(self) -> None:
        pause = self._host.retry.max_delay
        while self.off is None:
            if self._via_outbox:  # kept batches go first: try them again after a pause
                await self._keep()
                if self._closed or not await self._pause(pause):
                    return
                pause = min(MAX_OUTBOX_PAUSE, max(pause, 0.05) * 2)
                if await self._host._deliver_queued(self.conversation_id):
                    self._via_outbox, pause = False, self._host.retry.max_delay
                continue
            if not self._queue:
                batch = self._take()
                if batch is None:
                    return
                self._queue.append(batch)
            if await self._attempts(self._queue[0]):
                if self._queue:  # (a turn_off() meanwhile emptied it)
                    self._queue.popleft()
                continue
            if await self._keep():
                self._via_outbox = True
            elif self._closed:  # out of time and the outbox cannot be written: these are lost
                self._lost("the service could not be reached and the outbox cannot be written")
                return
            elif not await self._pause(pause):
                return

    def _take(self) -> _Batch | None:
        """The next batch of what is waiting, with the state checkpoint when it changed."""
        state = None if self._closed else self._checkpoint()  # the end itself carries the state
        if not self._pending and state is None:
            return None
        room = MAX_BODY - 1024 - (len(state) if state else 0)
        items: list[_Item] = []
        size = 0
        while self._pending and len(items) < MAX_BATCH:
            item = self._pending[0]
            if items and size + len(item.encoded) + 1 > room:
                break
            items.append(self._pending.popleft())
            size += len(item.encoded) + 1
        if state is not None:
            self._sent_state = state
        return self._batch(items, state)

    def _batch(self, items: list[_Item], state: bytes | None, sent_at: int | None = None) -> _Batch:
        starts = not self._started
        # The caller goes with every batch, not only the first: the service redacts the caller's own number
        # written in their country's national format only when it knows the caller.
        document: dict[str, Any] = {"caller": self._caller, "channel": self._channel}
        if self._agent is not None:
            document["agent"] = self._agent
        document["messages"] = [orjson.Fragment(item.encoded) for item in items]
        if state is not None:
            document["state"] = orjson.Fragment(state)
        if self._trust is not None:
            # With every batch, like the caller: the service keeps of a checkpoint only what the call may write,
            # and a batch may start the conversation (the attestation is recorded with it).
            document.update(self._trust())
        # When it was first tried (the outbox keeps it): an erasure of the caller after it wins.
        document["sent_at"] = sent_at if sent_at is not None else int(time.time() * 1000)
        return _Batch(items, state, orjson.dumps(document), starts)

    def _checkpoint(self) -> bytes | None:
        """``conv.state`` encoded, if it changed since it was last sent and may be sent."""
        try:
            encoded = orjson.dumps(self._state(), option=orjson.OPT_SORT_KEYS)
        except (ValueError, TypeError) as exc:
            self._refuse_state(repr(exc).encode(), f"conv.state cannot be sent: {exc}")
            return None
        if encoded in (self._sent_state, self._bad_state):
            return None
        if len(encoded) > MAX_CHECKPOINT_BYTES:
            self._refuse_state(
                encoded, f"conv.state is over {MAX_CHECKPOINT_BYTES:,} bytes: sent at the end only"
            )
            return None
        return encoded

    def _refuse_state(self, marker: bytes, reason: str, status: int | None = None) -> None:
        if marker != self._bad_state:
            self._bad_state = marker
            self._record(status, reason, (), state=True)

    async def _attempts(self, batch: _Batch) -> bool:
        """Send one batch: True once it is settled (delivered, dropped, set aside), False when every attempt
        failed transiently (or time ran out)."""
        policy = self._host.retry
        last: ServiceUnavailableError | None = None
        for attempt in range(policy.attempts):
            if last is not None and not await self._pause(policy.delay(attempt - 1, last.retry_after)):
                break
            seconds = self._time_left(policy.attempt_timeout)
            if seconds <= 0:
                break
            try:
                answer = await self._host._append_batch(self.conversation_id, batch.body, seconds)
            except ServiceUnavailableError as exc:
                last = exc
                continue
            except ServiceError as exc:
                return await self._refused(batch, exc)
            self._acknowledged(batch, answer)
            return True
        if last is not None:
            log.warning(
                "conversation %s: %d messages not sent yet (%s)", self.conversation_id, len(batch.items), last
            )
        return False

    def _acknowledged(self, batch: _Batch, answer: AppendedAnswer) -> None:
        if not answer.stored:
            self.turn_off(f"the service does not store it ({answer.reason or 'no reason given'})")
            return
        self._started = True
        self._settle(batch.last_seq)

    async def _refused(self, batch: _Batch, exc: ServiceError) -> bool:
        ids = tuple(item.message_id for item in batch.items)
        if exc.status in (401, 403):  # the token: kept aside like an end, for outbox.retry_rejected()
            log.error(
                "conversation %s: messages refused (%s); set aside in the outbox", self.conversation_id, exc
            )
            try:
                await self._host._set_aside_batch(self.conversation_id, batch.body, str(exc))
            except OutboxUnavailableError as failure:
                self._record(exc.status, f"{exc}; and {failure}", ids, state=batch.state is not None)
        elif batch.state is not None and refuses_state_only(exc):
            self._refuse_state(batch.state, f"the state checkpoint was refused: {exc}", exc.status)
            stripped = self._batch(batch.items, None, orjson.loads(batch.body)["sent_at"])
            if not stripped.items or not self._queue or self._queue[0] is not batch:
                self._settle(batch.last_seq)
                return True
            self._queue[0] = stripped
            return await self._attempts(stripped)
        else:
            self._record(exc.status, str(exc), ids, state=batch.state is not None)
            if batch.state is not None:
                self._sent_state = None  # the next batch carries it again
            if is_over(exc) or (exc.status == 409 and await self._ended()):
                self.turn_off(f"the conversation takes no more messages: {exc}")
            elif exc.status == 422 and batch.starts and _names(exc, "caller"):
                self.turn_off(f"the caller cannot have a transcript: {exc}")
        self._settle(batch.last_seq)
        return True

    async def _ended(self) -> bool:
        """After a 409: whether the conversation has ended (rather than a message id reused, say)."""
        try:
            status = await self._host._transcript_status(
                self.conversation_id, self._host.retry.attempt_timeout
            )
        except (NotFoundError, GoneError):
            return True
        except CallerMemoryError:
            return False
        return status.status in ("ending", "ended")

    def _record(self, status: int | None, reason: str, ids: tuple[str, ...], *, state: bool) -> None:
        self.errors.append(TranscriptError(self.conversation_id, status, reason, ids, state))
        what = f"{len(ids)} messages" if ids else "the state checkpoint"
        log.warning("conversation %s: %s dropped: %s", self.conversation_id, what, reason)

    def _lost(self, reason: str) -> None:
        ids = tuple(i.message_id for b in self._queue for i in b.items) + tuple(
            i.message_id for i in self._pending
        )
        log.error("conversation %s: %d messages lost: %s", self.conversation_id, len(ids), reason)
        self._record(None, reason, ids, state=False)
        self._pending.clear()
        self._queue.clear()
        self._settle(self._seq)

    async def _keep(self) -> bool:
        """Move everything waiting into the outbox, in order; False if the outbox cannot be written."""
        while self._pending:
            batch = self._take()
            if batch is None:
                break
            self._queue.append(batch)
        if not self._queue:
            return True
        batches = list(self._queue)
        try:
            ids = await asyncio.shield(
                self._host._keep_batches(self.conversation_id, [b.body for b in batches])
            )
        except OutboxUnavailableError as exc:
            log.error("conversation %s: %s", self.conversation_id, exc)
            return False
        for entry_id, batch in zip(ids, batches, strict=True):
            self._kept[entry_id] = batch.last_seq
        for _ in batches:
            self._queue.popleft()
        return True

    def _time_left(self, seconds: float) -> float:
        if self._deadline is None:
            return seconds
        return min(seconds, self._deadline - asyncio.get_running_loop().time())

    async def _pause(self, seconds: float) -> bool:
        """Wait ``seconds`` (less when closing, or when told); False when there is no time left."""
        seconds = self._time_left(seconds)
        if seconds <= 0:
            return False
        if self._closed:
            await asyncio.sleep(seconds)
            return self._time_left(1) > 0
        self._interrupt.clear()
        try:
            async with asyncio.timeout(seconds):
                await self._interrupt.wait()
        except TimeoutError:
            pass
        return True

    def _settle(self, seq: int) -> None:
        if seq > self._settled_seq:
            self._settled_seq = seq
        self._progress.set()
        self._progress = asyncio.Event()


def _names(exc: ServiceError, name: str) -> bool:
    errors = exc.problem.get("errors")
    return isinstance(errors, list) and any(isinstance(e, dict) and e.get("field") == name for e in errors)
