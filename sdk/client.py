"""The async client: one per process (or per project), shared by every conversation."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

from .conversation import Conversation, EndResult
from .errors import CallerMemoryError, ServiceError, ServiceUnavailableError, error_for
from .memory import Memory
from .outbox import Outbox, default_outbox_path

log = logging.getLogger("caller_memory.sdk")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How ``conv.end()`` retries transient failures: capped exponential backoff with full jitter."""

    attempts: int = 4
    base_delay: float = 0.1
    max_delay: float = 2.0
    #: Seconds each attempt may take.
    attempt_timeout: float = 2.0

    def delay(self, attempt: int) -> float:
        return random.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))


class CircuitBreaker:
    """Stops reads from waiting on a service that keeps failing: after ``failures`` transient failures in a
    row, reads answer "unavailable" at once for ``reset_after`` seconds, then one read is tried again."""

    def __init__(self, failures: int = 5, reset_after: float = 5.0) -> None:
        self.failures = failures
        self.reset_after = reset_after
        self._count = 0
        self._open_until = 0.0

    @property
    def is_open(self) -> bool:
        return self._count >= self.failures and time.monotonic() < self._open_until

    def allow(self) -> bool:
        return not self.is_open

    def success(self) -> None:
        self._count = 0

    def failure(self) -> None:
        self._count += 1
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
    one passed as ``session``, which it then does not close) and delivers what the outbox kept from earlier
    runs, in the background.

    - ``read_budget``: seconds a memory read may take before the turn goes on with empty memory (0.15).
    - ``retry``: how the end-of-call write retries before it is queued in the outbox.
    - ``outbox_path``: the outbox file (default :func:`~caller_memory.sdk.outbox.default_outbox_path`).
    - ``circuit``: the read circuit breaker.
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
    ) -> None:
        if read_budget <= 0:
            raise ValueError("read_budget must be a positive number of seconds")
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
        #: Whether the outbox may hold entries of ours (unknown at start); saves a file access per call.
        self._outbox_may_have_entries = True
        self._queued = 0  # entries this client added to the outbox, ever

    # Lifecycle ----------------------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryClient:
        if self._session is None:
            self._session = aiohttp.ClientSession(json_serialize=lambda v: orjson.dumps(v).decode())
        self._spawn(self._flush_quietly())
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

    def _spawn(self, coro: Any) -> None:
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
        """A conversation with ``caller`` (a phone number, in any form the project can read)."""
        return Conversation(self, conversation_id, caller)

    # Requests -----------------------------------------------------------------------------------------

    def _url(self, *parts: str) -> URL:
        path = "/".join(quote(part, safe="") for part in parts)
        return URL(f"{self.base_url}/v1/projects/{quote(self.project, safe='')}/{path}", encoded=True)

    async def _request(
        self, method: str, url: URL, *, seconds: float, headers: dict[str, str], **kwargs: Any
    ) -> tuple[int, Any, Any]:
        """One request within ``seconds``; returns (status, headers, decoded body) or raises
        ServiceUnavailableError."""
        try:
            async with asyncio.timeout(seconds):
                async with self.session.request(method, url, headers=headers, **kwargs) as resp:
                    raw = await resp.read()
                    body = orjson.loads(raw) if raw and resp.content_type.endswith("json") else raw
                    return resp.status, resp.headers, body
        except TimeoutError:
            raise ServiceUnavailableError(f"no answer within {seconds * 1000:.0f} ms") from None
        except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            raise ServiceUnavailableError(f"{type(exc).__name__}: the service could not be reached") from exc

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
        if status != 200 or not isinstance(answer, dict):
            raise error_for(status, answer)
        return EndResult(
            conversation_id=conversation_id,
            persisted=tuple(answer.get("persisted", ())),
            ignored=tuple(answer.get("ignored", ())),
            blacklisted=bool(answer.get("blacklisted")),
            repeat_caller=dict(answer.get("repeat_caller") or {}),
            replayed=headers.get("Idempotent-Replayed") == "true",
        )

    async def end_conversation(self, conversation_id: str, body: dict[str, Any]) -> EndResult:
        """POST the end of a conversation: retried with backoff, then queued in the outbox."""
        encoded = orjson.dumps(body)
        last: CallerMemoryError | None = None
        for attempt in range(self.retry.attempts):
            if attempt:
                await asyncio.sleep(self.retry.delay(attempt - 1))
            try:
                result = await self._post_end(conversation_id, encoded)
            except ServiceUnavailableError as exc:
                last = exc
                continue
            if self._outbox_may_have_entries:
                self._spawn(self._flush_quietly())  # the service is back: deliver what was queued earlier
            return result
        await self.outbox.add(conversation_id, encoded)
        self._queued += 1
        self._outbox_may_have_entries = True
        log.warning(
            "end of conversation could not be delivered after %d attempts (%s); kept in the outbox %s",
            self.retry.attempts,
            last,
            self.outbox.path,
        )
        return EndResult(conversation_id=conversation_id, queued=True)

    # Outbox -------------------------------------------------------------------------------------------

    async def flush_outbox(self) -> FlushReport:
        """Deliver queued ends of conversations, oldest first; stops at the first transient failure."""
        delivered = rejected = 0
        queued_before = self._queued
        for entry in await self.outbox.pending():
            try:
                await self._post_end(entry.conversation_id, entry.body)
            except ServiceUnavailableError:
                await self.outbox.failed(entry.id)
                break
            except ServiceError as exc:
                # Refused for good (e.g. the token was revoked): keep it aside for an operator to look at.
                await self.outbox.reject(entry.id, str(exc))
                log.error(
                    "queued end of conversation %s refused by the service: %s", entry.conversation_id, exc
                )
                rejected += 1
                continue
            await self.outbox.delivered(entry.id)
            delivered += 1
        remaining = len(await self.outbox.pending())
        # Unless something was queued meanwhile (it may have missed the count above).
        self._outbox_may_have_entries = remaining > 0 or self._queued != queued_before
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
