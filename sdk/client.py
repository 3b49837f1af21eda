"""The async client: one per process (or per project), shared by every conversation."""

from __future__ import annotations

import asyncio
import logging
import random
import re
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

from ._wire import MAX_BODY_BYTES, AnswerTooLarge, EndAnswer, MemoryAnswer, decode, parse, problem
from .conversation import Conversation, EndResult
from .errors import (
    OutboxUnavailableError,
    ServiceError,
    ServiceUnavailableError,
    error_for,
    is_client_error,
)
from .memory import Memory
from .outbox import DEFAULT_TIMEOUT, Outbox, default_outbox_path

log = logging.getLogger("caller_memory.sdk")

#: The service's rule for conversation ids, checked here so that a bad id fails at once, not at the end.
#: Always used with ``fullmatch`` (``$`` would let a trailing line break through).
CONVERSATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
#: The service's rule for project ids.
PROJECT_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
#: A bearer token (RFC 6750 ``b64token``): no spaces, line breaks or control characters.
TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


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

    def release(self) -> None:
        """The probe ended without a verdict (it was cancelled, or the request itself was wrong): the next
        read may probe again; the circuit stays as it was."""
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
    - ``outbox_timeout``: seconds an outbox operation may wait for another process's lock on the file (2);
      beyond it (and for a file that is corrupt or cannot be written) the outbox raises
      :class:`~caller_memory.sdk.errors.OutboxUnavailableError`.
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
        outbox_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if not read_budget > 0:
            raise ValueError("read_budget must be a positive number of seconds")
        token = token.strip(" \t\r\n") if isinstance(token, str) else ""  # a line end from a .env file
        if not TOKEN.fullmatch(token):
            raise ValueError(
                "token must be a non-empty string of letters, digits and '-._~+/' (a bearer token), without "
                "spaces, line breaks or control characters"
            )
        if not isinstance(project, str) or not PROJECT_ID.fullmatch(project):
            raise ValueError(
                "project must be 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit"
            )
        self.base_url = _checked_base_url(base_url)
        self.project = project
        self.read_budget = read_budget
        self.retry = retry or RetryPolicy()
        self.circuit = circuit or CircuitBreaker()
        self.outbox = Outbox(
            outbox_path or default_outbox_path(), self.base_url, project, timeout=outbox_timeout
        )
        self._headers = {
            "Authorization": f"Bearer {token}",
            "User-Agent": "caller-memory-sdk",
            # Decoded here, within a size bound (aiohttp's own decompression is turned off per request).
            "Accept-Encoding": "gzip, deflate",
        }
        self._session = session
        self._owns_session = session is None
        self._background: set[asyncio.Task[Any]] = set()
        self._cleanup: set[asyncio.Task[Any]] = set()
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
        while self._cleanup:  # entries handed back by cancelled work: let them be released (bounded)
            await asyncio.gather(*self._cleanup, return_exceptions=True)
        if self._owns_session and self._session is not None:
            await self._session.close()
            self._session = None
        await self.outbox.close()

    def _spawn_flush(self) -> None:
        if not self._flush_lock.locked():  # else a delivery is running: it will see the new entries too
            self._track(self._flush_quietly())

    def _track(self, coro: Coroutine[Any, Any, Any], *, tasks: set[asyncio.Task[Any]] | None = None) -> None:
        group = self._background if tasks is None else tasks
        task = asyncio.get_running_loop().create_task(coro)
        group.add(task)
        task.add_done_callback(group.discard)

    def _release_later(self, *entry_ids: int) -> None:
        """Hand entries back from work being cancelled (it cannot await); aclose() waits for it, never
        cancels it (it is bounded by the outbox timeout)."""
        self._track(self._quietly(self.outbox.release(*entry_ids)), tasks=self._cleanup)

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
        ':' or '-', starting with a letter or digit (ValueError otherwise, e.g. for a trailing line break).
        """
        if not isinstance(caller, str):
            raise ValueError(f"caller must be a string, not {type(caller).__name__}")
        if not isinstance(conversation_id, str) or not CONVERSATION_ID.fullmatch(conversation_id):
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
        """One request within ``seconds``, reading and decoding included: (status, headers, JSON body or
        None).

        No redirect is followed (a 3xx is returned as it is, and is never a success). The body is read up to
        MAX_BODY_BYTES, decoded here within the same bound, and parsed only if it is JSON; anything else is
        dropped unread (it may echo the URL, which holds the caller's number). Raises
        ServiceUnavailableError for a network failure, a timeout, or a body that is too large or corrupt:
        never anything else for what a server sent.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        try:
            async with asyncio.timeout_at(deadline):
                async with self.session.request(
                    method, url, headers=headers, allow_redirects=False, auto_decompress=False, **kwargs
                ) as resp:
                    status, resp_headers = resp.status, resp.headers
                    is_json = resp.content_type.endswith("json")
                    raw = await _read_bounded(resp) if is_json else b""
                body = orjson.loads(decode(raw, resp_headers.get("Content-Encoding", ""))) if raw else None
            if loop.time() > deadline:  # decoding counts in the budget too
                raise TimeoutError
            return status, resp_headers, body
        except TimeoutError:
            raise ServiceUnavailableError(f"no answer within {seconds * 1000:.0f} ms") from None
        except AnswerTooLarge:
            raise ServiceUnavailableError(f"the answer is larger than {MAX_BODY_BYTES >> 20} MiB") from None
        except Exception as exc:  # aiohttp's and decoding errors, and anything else: never into agent code
            raise ServiceUnavailableError(
                f"{type(exc).__name__}: no usable answer from the service"
            ) from None

    async def read_memory(self, caller: str, *, previous: Memory | None = None) -> Memory:
        """The caller's memory, or an empty unavailable one; never raises because of the service."""
        probe = self.circuit.is_open
        if not self.circuit.allow():
            return Memory.unavailable("circuit open: recent reads failed")
        verdict: bool | None = None  # True: the service works; False: it failed; None: no verdict
        try:
            memory, verdict = await self._read(caller, previous)
        finally:
            if verdict is True:
                self.circuit.success()
            elif verdict is False:
                self.circuit.failure()
            elif probe:  # cancelled, or a client error: let the next read probe
                self.circuit.release()
        return memory

    async def _read(self, caller: str, previous: Memory | None) -> tuple[Memory, bool | None]:
        headers = dict(self._headers)
        if previous is not None and previous.available and previous.etag:
            headers["If-None-Match"] = previous.etag
        try:
            status, resp_headers, body = await self._request(
                "GET", self._url("callers", caller, "memory"), seconds=self.read_budget, headers=headers
            )
        except ServiceUnavailableError as exc:
            log.warning("memory read failed, going on with empty memory: %s", exc)
            return Memory.unavailable(str(exc)), False
        if status == 304 and previous is not None and previous.available:
            return previous, True
        answer = parse(MemoryAnswer, body) if status == 200 else None
        if answer is not None:
            etag = resp_headers.get("ETag")
            return Memory(
                answer.fields, etag=etag, expires_at=answer.expires_at, blacklisted=answer.blacklisted
            ), True
        if status == 200:
            error: Exception = ServiceUnavailableError("the answer was not the service's (is the URL right?)")
        else:
            error = error_for(status, body)
        log.warning("memory read refused, going on with empty memory: %s", error)
        if is_client_error(status):
            # The request was wrong (a caller that is no phone number, a bad token): the caller's error,
            # not an outage. The service's own problem document also says it is up.
            return Memory.unavailable(str(error)), True if problem(status, body) is not None else None
        return Memory.unavailable(str(error)), False

    async def _post_end(self, conversation_id: str, body: bytes) -> EndResult:
        """One attempt. Raises ServiceUnavailableError unless the answer is a 200 of the documented shape
        for this conversation, or ServiceError for the service's refusal."""
        status, headers, answer = await self._request(
            "POST",
            self._url("conversations", conversation_id, "end"),
            seconds=self.retry.attempt_timeout,
            data=body,
            headers={**self._headers, "Content-Type": "application/json"},
        )
        if status != 200:
            raise error_for(status, answer, headers.get("Retry-After"))
        ended = parse(EndAnswer, answer)
        if ended is None or ended.conversation_id != conversation_id:
            raise ServiceUnavailableError("the answer was not the service's (is the URL right?)", status)
        return EndResult(
            conversation_id=conversation_id,
            persisted=tuple(ended.persisted),
            ignored=tuple(ended.ignored),
            blacklisted=ended.blacklisted,
            repeat_caller=dict(ended.repeat_caller),
            replayed=headers.get("Idempotent-Replayed") == "true",
            erased=ended.erased,
        )

    async def end_conversation(self, conversation_id: str, body: dict[str, Any]) -> EndResult:
        """POST the end of a conversation, kept in the outbox from the start until it is acknowledged.

        If the conversation is still in the outbox (an earlier call was cancelled, or its process died),
        that entry is taken over and its ``ended_at`` is sent."""
        entry_id: int | None = None
        try:
            entry_id, encoded = await self.outbox.keep(conversation_id, body, lease=self.retry.worst_case + 1)
        except asyncio.CancelledError:  # the entry may have been written all the same: hand it back
            self._track(self._quietly(self.outbox.release_conversation(conversation_id)), tasks=self._cleanup)
            raise
        except OutboxUnavailableError as exc:
            encoded = orjson.dumps(body)
            log.error("conversation %s: %s; sending anyway", conversation_id, exc)
        try:
            result = await self._deliver(conversation_id, encoded, entry_id)
        except asyncio.CancelledError:
            if entry_id is not None:  # hand the entry to the next delivery rather than wait for its lease
                self._release_later(entry_id)
            raise
        if result is not None:
            return result
        if entry_id is None:
            raise OutboxUnavailableError(
                f"conversation {conversation_id}: the service could not be reached and the outbox "
                f"{self.outbox.path} cannot be written: this write is lost"
            )
        await self._quietly(self.outbox.release(entry_id))
        return EndResult(conversation_id=conversation_id, queued=True)

    async def _deliver(self, conversation_id: str, encoded: bytes, entry_id: int | None) -> EndResult | None:
        """Every attempt of one end; None when they all failed transiently (the entry stays queued)."""
        last: ServiceUnavailableError | None = None
        for attempt in range(self.retry.attempts):
            if last is not None:
                await asyncio.sleep(self.retry.delay(attempt - 1, last.retry_after))
            try:
                result = await self._post_end(conversation_id, encoded)
            except ServiceUnavailableError as exc:
                last = exc
                continue
            except ServiceError as exc:
                if (
                    entry_id is not None
                ):  # refused: set aside, kept for retry_rejected(); the exception says why
                    await self._quietly(self.outbox.reject(entry_id, str(exc)))
                log.error("conversation %s: refused (%s); set aside in the outbox", conversation_id, exc)
                raise
            if entry_id is not None:
                await self._quietly(self.outbox.delivered(entry_id))
            self.circuit.success()
            self._spawn_flush()  # the service is back: deliver what was queued earlier, if anything
            return result
        log.warning(
            "conversation %s: not delivered after %d attempts (%s); kept in the outbox %s",
            conversation_id,
            self.retry.attempts,
            last,
            self.outbox.path,
        )
        return None

    @staticmethod
    async def _quietly(step: Coroutine[Any, Any, None]) -> None:
        """An outbox step after the fact (the service already answered): a failure of the file is logged,
        not raised. The entry then stays, and a later delivery gets a harmless replay."""
        try:
            await step
        except OutboxUnavailableError as exc:
            log.error("%s", exc)

    # Outbox -------------------------------------------------------------------------------------------

    async def flush_outbox(self) -> FlushReport:
        """Deliver every queued end of conversation, oldest first; stops at the first transient failure.

        One delivery runs at a time per client; entries another process is sending are left alone (unless
        that process is dead). Raises OutboxUnavailableError if the outbox file cannot be used.
        """
        delivered = rejected = 0
        async with self._flush_lock:
            stopped = False
            while not stopped:
                batch = await self.outbox.claim(limit=50, lease=self.retry.attempt_timeout * 50 + 5)
                if not batch:
                    break
                unsettled = {entry.id for entry in batch}
                try:
                    for entry in batch:
                        outcome = await self._flush_one(entry.id, entry.conversation_id, entry.body)
                        unsettled.discard(entry.id)
                        delivered += outcome == "delivered"
                        rejected += outcome == "rejected"
                        if outcome == "stopped":
                            stopped = True
                            break
                finally:  # whatever happens (a cancellation too), nothing of the batch stays claimed
                    if unsettled:
                        self._release_later(*unsettled)
            remaining = len(await self.outbox.pending())
        return FlushReport(delivered=delivered, remaining=remaining, rejected=rejected)

    async def _flush_one(self, entry_id: int, conversation_id: str, body: bytes) -> str:
        try:
            await self._post_end(conversation_id, body)
        except ServiceUnavailableError:
            await self.outbox.release(entry_id)
            return "stopped"
        except ServiceError as exc:
            await self.outbox.reject(entry_id, str(exc))
            log.error("queued end of conversation %s refused: %s", conversation_id, exc)
            return "rejected"
        await self.outbox.delivered(entry_id)
        return "delivered"

    async def _flush_quietly(self) -> None:
        try:
            report = await self.flush_outbox()
        except Exception as exc:  # a background delivery must never take the agent down
            log.error("delivering the outbox failed (%s); entries stay queued", exc)
            return
        if report.delivered or report.rejected:
            log.info(
                "outbox: %d delivered, %d rejected, %d remaining",
                report.delivered,
                report.rejected,
                report.remaining,
            )


def _checked_base_url(base_url: str) -> str:
    """``base_url`` without a trailing slash, or ValueError unless it is an http(s) URL with a host and no
    query, fragment, whitespace or control characters."""
    text = base_url.rstrip("/") if isinstance(base_url, str) else ""
    try:
        url = URL(text)
    except ValueError:
        url = URL()
    if (
        url.scheme not in ("http", "https")
        or not url.host
        or url.query_string
        or url.fragment
        or any(ch.isspace() or not ch.isprintable() for ch in text)
    ):
        raise ValueError("base_url must be an http:// or https:// URL with a host (and no query or fragment)")
    return text


async def _read_bounded(resp: aiohttp.ClientResponse) -> bytes:
    """The raw body, or AnswerTooLarge as soon as it is larger than MAX_BODY_BYTES."""
    if resp.content_length is not None and resp.content_length > MAX_BODY_BYTES:
        raise AnswerTooLarge("the answer is too large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise AnswerTooLarge("the answer is too large")
        chunks.append(chunk)
    return b"".join(chunks)
