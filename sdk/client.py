"""The async client: one per process (or per project), shared by every conversation."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import sqlite3
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

from .conversation import Conversation, EndResult
from .errors import OutboxUnavailableError, ServiceError, ServiceUnavailableError, error_for
from .memory import Memory
from .outbox import Outbox, default_outbox_path

log = logging.getLogger("caller_memory.sdk")

#: The service's rule for conversation ids, checked here so that a bad id fails at once, not at the end.
CONVERSATION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How ``conv.end()`` retries transient failures: capped exponential backoff with full jitter."""

    attempts: int = 4
    base_delay: float = 0.1
    max_delay: float = 2.0
    #: Seconds each attempt may take.
    attempt_timeout: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("RetryPolicy.attempts must be at least 1")
        if min(self.base_delay, self.max_delay) < 0 or self.attempt_timeout <= 0:
            raise ValueError("RetryPolicy delays must be >= 0 and attempt_timeout > 0")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before attempt ``attempt + 1``; a server's ``Retry-After`` is honoured up to
        ``max_delay``."""
        jittered = random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))
        return max(jittered, min(retry_after or 0.0, self.max_delay))

    @property
    def worst_case(self) -> float:
        """The longest ``conv.end()`` can take before it returns a queued result."""
        return self.attempts * self.attempt_timeout + (self.attempts - 1) * self.max_delay


class CircuitBreaker:
    """Stops reads from waiting on a service that keeps failing.

    After ``failures`` transient failures in a row the circuit opens: reads answer "unavailable" at once.
    After ``reset_after`` seconds one read (the probe) is let through; its success closes the circuit, its
    failure opens it again for another ``reset_after``. A successful end of a conversation closes it too.
    """

    def __init__(self, failures: int = 5, reset_after: float = 5.0) -> None:
        if failures < 1 or reset_after < 0:
            raise ValueError("CircuitBreaker needs failures >= 1 and reset_after >= 0")
        self.failures = failures
        self.reset_after = reset_after
        self._count = 0
        self._open_until = 0.0
        self._probing = False

    def __repr__(self) -> str:
        return (
            f"<CircuitBreaker {'open' if self.is_open else 'closed'} failures={self._count}/{self.failures}>"
        )

    @property
    def is_open(self) -> bool:
        return self._count >= self.failures

    def allow(self) -> bool:
        if not self.is_open:
            return True
        if self._probing or time.monotonic() < self._open_until:
            return False
        self._probing = True  # half-open: this one read is the probe
        return True

    def success(self) -> None:
        self._count = 0
        self._probing = False

    def failure(self) -> None:
        self._count += 1
        self._probing = False
        if self._count >= self.failures:
            self._open_until = time.monotonic() + self.reset_after


@dataclass(frozen=True, slots=True)
class FlushReport:
    """What :meth:`MemoryClient.flush_outbox` did."""

    delivered: int
    remaining: int
    rejected: int


class MemoryClient:
    """Client of a Caller Memory service for one project.

    ``async with MemoryClient(url, token=..., project=...) as client:`` opens an aiohttp session (or uses the
    one passed as ``session``, which it then does not close), opens the outbox file (failing at once if it
    cannot be written) and delivers what the outbox kept from earlier runs, in the background.

    - ``read_budget``: seconds a memory read may take before the turn goes on with empty memory (0.15).
    - ``retry``: how the end-of-call write retries before it is left to the outbox.
    - ``outbox_path``: the outbox file (default :func:`~caller_memory.sdk.outbox.default_outbox_path`).
    - ``circuit``: the read circuit breaker.
    - ``deliver_outbox_on_start``: deliver earlier runs' queued writes in the background on entering (True).
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str,
        project: str,
        session: aiohttp.ClientSession | None = None,
        read_budget: float = 0.15,
        retry: RetryPolicy | None = None,
        outbox_path: str | Path | None = None,
        circuit: CircuitBreaker | None = None,
        deliver_outbox_on_start: bool = True,
    ) -> None:
        if read_budget <= 0:
            raise ValueError("read_budget must be a positive number of seconds")
        token = token.strip()
        if not token or any(ch.isspace() or ord(ch) < 32 for ch in token):
            raise ValueError("token must be a non-empty string without spaces or line breaks")
        self.base_url = base_url.rstrip("/")
        self.project = project
        self.read_budget = read_budget
        self.retry = retry or RetryPolicy()
        self.circuit = circuit or CircuitBreaker()
        self.outbox = Outbox(outbox_path or default_outbox_path(), self.base_url, project)
        self._headers = {"Authorization": f"Bearer {token}", "User-Agent": "caller-memory-sdk"}
        self._session = session
        self._owns_session = session is None
        self._background: set[asyncio.Task[Any]] = set()
        self._flush_lock = asyncio.Lock()
        self._deliver_on_start = deliver_outbox_on_start

    def __repr__(self) -> str:
        return f"<MemoryClient {self.base_url} project={self.project!r}>"

    # Lifecycle ----------------------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryClient:
        await self.outbox.open()
        if self._session is None:
            self._session = aiohttp.ClientSession()
        if self._deliver_on_start:
            self._spawn_flush()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self, *, grace: float = 1.0) -> None:
        """Give background outbox deliveries ``grace`` seconds, then close (entries left stay queued)."""
        if self._background:
            _, pending = await asyncio.wait(self._background, timeout=grace)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
        await self.outbox.close()

    def _spawn_flush(self) -> None:
        if not self._flush_lock.locked():  # else a delivery is running: it will see the new entries too
            self._track(self._flush_quietly())

    def _track(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError(
                "use the client as `async with MemoryClient(...) as client:` (or pass a session)"
            )
        return self._session

    def conversation(self, conversation_id: str, *, caller: str) -> Conversation:
        """A conversation with ``caller`` (a phone number, in any form the project can read).

        ``conversation_id`` is the id your voice platform gives the call: 1-128 letters, digits, '.', '_',
        ':' or '-', starting with a letter or digit (ValueError otherwise).
        """
        if not CONVERSATION_ID.match(conversation_id):
            raise ValueError(
                "conversation_id must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
            )
        return Conversation(self, conversation_id, caller)

    # Requests -----------------------------------------------------------------------------------------

    def _url(self, *parts: str) -> URL:
        path = "/".join(quote(part, safe="") for part in parts)
        return URL(f"{self.base_url}/v1/projects/{quote(self.project, safe='')}/{path}", encoded=True)

    async def _request(
        self, method: str, url: URL, *, seconds: float, headers: dict[str, str], **kwargs: Any
    ) -> tuple[int, Any, Any]:
        """One request within ``seconds``: (status, headers, decoded JSON body or None).

        Raises ServiceUnavailableError on a network failure or timeout. A body that is not JSON is dropped
        unread: it may echo the URL, which holds the caller's number.
        """
        try:
            async with asyncio.timeout(seconds):
                async with self.session.request(method, url, headers=headers, **kwargs) as resp:
                    raw = await resp.read()
                    body = orjson.loads(raw) if raw and resp.content_type.endswith("json") else None
                    return resp.status, resp.headers, body
        except TimeoutError:
            raise ServiceUnavailableError(f"no answer within {seconds * 1000:.0f} ms") from None
        except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            raise ServiceUnavailableError(f"{type(exc).__name__}: the service could not be reached") from None

    async def read_memory(self, caller: str, *, previous: Memory | None = None) -> Memory:
        """The caller's memory, or an empty unavailable one; never raises because of the service."""
        if not self.circuit.allow():
            return Memory.unavailable("circuit open: recent reads failed")
        headers = dict(self._headers)
        if previous is not None and previous.available and previous.etag:
            headers["If-None-Match"] = previous.etag
        try:
            status, resp_headers, body = await self._request(
                "GET", self._url("callers", caller, "memory"), seconds=self.read_budget, headers=headers
            )
        except ServiceUnavailableError as exc:
            self.circuit.failure()
            log.warning("memory read failed, going on with empty memory: %s", exc)
            return Memory.unavailable(str(exc))
        if status == 304 and previous is not None:
            self.circuit.success()
            return previous
        if status == 200 and isinstance(body, dict):
            self.circuit.success()
            return Memory(
                body.get("fields") or {},
                etag=resp_headers.get("ETag"),
                expires_at=body.get("expires_at"),
                blacklisted=bool(body.get("blacklisted")),
            )
        error = error_for(status, body)
        if isinstance(error, ServiceUnavailableError):
            self.circuit.failure()
        else:
            self.circuit.success()  # the service answered: it is up, the request was wrong
        log.warning("memory read refused, going on with empty memory: %s", error)
        return Memory.unavailable(str(error))

    async def _post_end(self, conversation_id: str, body: bytes) -> EndResult:
        status, headers, answer = await self._request(
            "POST",
            self._url("conversations", conversation_id, "end"),
            seconds=self.retry.attempt_timeout,
            data=body,
            headers={**self._headers, "Content-Type": "application/json"},
        )
        if status != 200:
            raise error_for(status, answer, headers.get("Retry-After"))
        if not isinstance(answer, dict):
            raise ServiceUnavailableError("the answer was not the service's (is the URL right?)", status)
        return EndResult(
            conversation_id=conversation_id,
            persisted=tuple(answer.get("persisted", ())),
            ignored=tuple(answer.get("ignored", ())),
            blacklisted=bool(answer.get("blacklisted")),
            repeat_caller=dict(answer.get("repeat_caller") or {}),
            replayed=headers.get("Idempotent-Replayed") == "true",
            erased=bool(answer.get("erased")),
        )

    async def end_conversation(self, conversation_id: str, body: dict[str, Any]) -> EndResult:
        """POST the end of a conversation, kept in the outbox from the start until it is acknowledged."""
        encoded = orjson.dumps(body)
        entry_id: int | None = None
        try:
            entry_id = await self.outbox.add(conversation_id, encoded, lease=self.retry.worst_case + 1)
        except (OSError, sqlite3.Error) as exc:
            log.error(
                "conversation %s: the outbox cannot be written (%s); sending anyway", conversation_id, exc
            )
        last: ServiceUnavailableError | None = None
        for attempt in range(self.retry.attempts):
            if last is not None:
                await asyncio.sleep(self.retry.delay(attempt - 1, last.retry_after))
            try:
                result = await self._post_end(conversation_id, encoded)
            except ServiceUnavailableError as exc:
                last = exc
                continue
            except asyncio.CancelledError:
                if entry_id is not None:  # hand the entry to the next delivery rather than wait for its lease
                    self._track(self.outbox.release(entry_id))
                raise
            except ServiceError:
                if entry_id is not None:
                    await self.outbox.delivered(entry_id)  # refused for good: the exception says why
                raise
            if entry_id is not None:
                await self.outbox.delivered(entry_id)
            self.circuit.success()
            self._spawn_flush()  # the service is back: deliver what was queued earlier, if anything
            return result
        if entry_id is None:
            raise OutboxUnavailableError(
                f"conversation {conversation_id}: the service could not be reached ({last}) and the outbox "
                f"{self.outbox.path} cannot be written: this write is lost"
            )
        await self.outbox.release(entry_id)
        log.warning(
            "conversation %s: not delivered after %d attempts (%s); kept in the outbox %s",
            conversation_id,
            self.retry.attempts,
            last,
            self.outbox.path,
        )
        return EndResult(conversation_id=conversation_id, queued=True)

    # Outbox -------------------------------------------------------------------------------------------

    async def flush_outbox(self) -> FlushReport:
        """Deliver every queued end of conversation, oldest first; stops at the first transient failure.

        One delivery runs at a time per client; entries another process is sending are left alone.
        """
        delivered = rejected = 0
        async with self._flush_lock:
            stopped = False
            while not stopped:
                batch = await self.outbox.claim(limit=50, lease=self.retry.attempt_timeout * 50 + 5)
                if not batch:
                    break
                for entry in batch:
                    if stopped:
                        await self.outbox.release(entry.id)
                        continue
                    try:
                        await self._post_end(entry.conversation_id, entry.body)
                    except ServiceUnavailableError:
                        await self.outbox.release(entry.id)
                        stopped = True
                        continue
                    except ServiceError as exc:
                        await self.outbox.reject(entry.id, str(exc))
                        log.error("queued end of conversation %s refused: %s", entry.conversation_id, exc)
                        rejected += 1
                        continue
                    await self.outbox.delivered(entry.id)
                    delivered += 1
            remaining = len(await self.outbox.pending())
        return FlushReport(delivered=delivered, remaining=remaining, rejected=rejected)

    async def _flush_quietly(self) -> None:
        try:
            report = await self.flush_outbox()
        except Exception:  # a background delivery must never take the agent down
            log.exception("delivering the outbox failed; entries stay queued")
            return
        if report.delivered or report.rejected:
            log.info(
                "outbox: %d delivered, %d rejected, %d remaining",
                report.delivered,
                report.rejected,
                report.remaining,
            )
