"""The async client: one per process (or per project), shared by every conversation."""

from __future__ import annotations

import asyncio
import logging
import re
import weakref
from collections.abc import Callable, Coroutine, Mapping
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from yarl import URL

from ._calls import TranscriptCalls
from ._ending import Ending
from ._sender import TranscriptBuffer
from ._telemetry import Tracing, answered, request_span
from ._trust import checked_attestation, checked_step_up, query
from ._wire import (
    MAX_BODY_BYTES,
    AnswerTooLarge,
    AppendedAnswer,
    ContextAnswer,
    HistoryAnswer,
    MemoryAnswer,
    OpenAIHistoryAnswer,
    StartedAnswer,
    StatusAnswer,
    decode,
    parse,
    problem,
)
from .conversation import DEFAULT_CHANNEL, Conversation
from .errors import (
    ServiceUnavailableError,
    error_for,
    is_client_error,
)
from .memory import Memory
from .outbox import DEFAULT_TIMEOUT, MESSAGES, Outbox, default_outbox_path
from .policies import CircuitBreaker, RetryPolicy
from .transcript import check_name

log = logging.getLogger("caller_memory.sdk")

#: The service's rule for conversation ids, checked here so that a bad id fails at once, not at the end.
#: Always used with ``fullmatch`` (``$`` would let a trailing line break through).
CONVERSATION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
#: The service's rule for project ids.
PROJECT_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
#: A bearer token (RFC 6750 ``b64token``): no spaces, line breaks or control characters.
TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


class MemoryClient(Ending):
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
    - ``context_budget``: seconds ``conv.context()`` may take by default (0.3); ``call_timeout``: the
      same for ``conv.history()`` and ``conv.set_summary()`` (2).
    - ``background_requests``: most message batches in flight at once (16), so that memory reads always
      find a free connection in the session's pool (aiohttp's default is 100).
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
        context_budget: float = 0.3,
        call_timeout: float = 2.0,
        background_requests: int = 16,
    ) -> None:
        for name, seconds in (
            ("read_budget", read_budget),
            ("context_budget", context_budget),
            ("call_timeout", call_timeout),
        ):
            if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
                raise ValueError(f"{name} must be a positive number of seconds")
        if (
            isinstance(background_requests, bool)
            or not isinstance(background_requests, int)
            or background_requests < 1
        ):
            raise ValueError("background_requests must be a positive integer")
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
        self.context_budget = context_budget
        self.call_timeout = call_timeout
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
        self._calls = TranscriptCalls(self._call)
        # Senders of conversations' messages: tracked apart from the outbox deliveries, which aclose()
        # cancels after its grace; a sender is closed instead (what it holds goes to the outbox).
        self._senders: set[asyncio.Task[None]] = set()
        self._buffers: weakref.WeakValueDictionary[str, TranscriptBuffer] = weakref.WeakValueDictionary()
        self._send_slots = asyncio.Semaphore(background_requests)
        self._tracing = Tracing()
        #: Ends in flight (conv.end(), end_conversation()): aclose() lets them finish first.
        self._ends = 0
        self._no_ends = asyncio.Event()
        self._no_ends.set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<MemoryClient {self.base_url} project={self.project!r}>"

    # Lifecycle ----------------------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryClient:
        return await self.open()

    async def open(self) -> MemoryClient:
        """What entering ``async with`` does, for code whose life is not one block (a framework's worker
        that opens the client at start and closes it in a shutdown hook): open the outbox, the HTTP session,
        and start delivering what the outbox kept. Close with :meth:`aclose`."""
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
        """Let the ends in flight finish (each is bounded by the retry policy's ``worst_case``, then kept in
        the outbox), give unsent messages and background outbox deliveries ``grace`` seconds, then close
        (what is left is kept in, or stays in, the outbox). An end started after this raises
        :class:`~caller_memory.sdk.errors.ClientClosedError`."""
        self._closed = True
        if self._ends:
            bound = self.retry.worst_case * 2 + 1 + grace  # an end's own lease (messages first), and grace
            try:
                async with asyncio.timeout(bound):
                    await self._no_ends.wait()
            except TimeoutError:
                log.warning(
                    "%d end(s) still running after %.1f s; closing (they stay in the outbox)",
                    self._ends,
                    bound,
                )
        buffers = [buffer for buffer in list(self._buffers.values()) if not buffer.closed or buffer.unsent]
        await asyncio.gather(*(buffer.close(grace) for buffer in buffers), return_exceptions=True)
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

    def conversation(
        self,
        conversation_id: str,
        *,
        caller: str,
        channel: str = DEFAULT_CHANNEL,
        agent: str | None = None,
        transcript: bool = False,
        attestation: str | None = None,
        step_up: bool = False,
    ) -> Conversation:
        """A conversation with ``caller``: a phone number in any form the project can read,
        ``email:ada@example.com`` or ``account:A-1234``.

        ``conversation_id`` is the id your voice platform gives the call: 1-128 letters, digits, '.', '_',
        ':' or '-', starting with a letter or digit (ValueError otherwise, e.g. for a trailing line break).
        ``channel`` names the channel of the call (sent with the end; transcripts, ``resume`` and supersession
        are kept per channel): ``"phone"`` unless named, as in the Pipecat and LiveKit drop-ins;
        ``agent`` the agent handling it. ``transcript=True`` keeps what is said in the service's conversation
        memory: the first ``begin_turn()`` starts the conversation (and learns ``conv.resume``), and
        ``conv.add_message()`` sends messages in the background. With it, ``channel`` and ``agent`` are
        1-64 letters, digits, '.', '_', ':' or '-' (ValueError otherwise).

        ``attestation`` is the call's caller-ID attestation as the telephony provider gave it (Twilio's
        ``StirVerstat``, Telnyx's ``verstat``, ...; the service normalises it) or ``A``, ``B``, ``C``,
        ``failed``, ``unknown``; None when the call has none. ``step_up``: the caller already passed a
        step-up check (a PIN, a one-time code) before this conversation; later, ``conv.step_up_passed()``.
        Both go with every read, the start and the end: what the call does not qualify for is withheld
        (``conv.memory.withheld``) and cannot be written. ValueError for an attestation no provider sends
        (not a string, over 64 characters, not printable ASCII).
        """
        if not isinstance(caller, str):
            raise ValueError(f"caller must be a string, not {type(caller).__name__}")
        if not isinstance(conversation_id, str) or not CONVERSATION_ID.fullmatch(conversation_id):
            raise ValueError(
                "conversation_id must be 1-128 letters, digits, '.', '_', ':' or '-', starting with a letter or digit"
            )
        if not isinstance(transcript, bool):
            raise ValueError("transcript must be True or False")
        if transcript or agent is not None:
            check_name(channel, "channel")
        elif not isinstance(channel, str):
            raise ValueError(f"channel must be a string, not {type(channel).__name__}")
        if agent is not None:
            check_name(agent, "agent")
        return Conversation(
            self,
            conversation_id,
            caller,
            channel=channel,
            agent=agent,
            transcript=transcript,
            attestation=checked_attestation(attestation),
            step_up=checked_step_up(step_up),
        )

    # Requests -----------------------------------------------------------------------------------------

    def _url(self, *parts: str) -> URL:
        path = "/".join(quote(part, safe="") for part in parts)
        return URL(f"{self.base_url}/v1/projects/{quote(self.project, safe='')}/{path}", encoded=True)

    async def _request(
        self,
        method: str,
        parts: tuple[str, ...],
        url: URL,
        *,
        seconds: float,
        headers: dict[str, str],
        **kwargs: Any,
    ) -> tuple[int, Any, Any]:
        """:meth:`_exchange`, in a client span when the application traces (``parts``: the path under the
        project, of which the span names the route template, never the path)."""
        tracer = self._tracing.tracer()
        if tracer is None:
            return await self._exchange(method, url, seconds=seconds, headers=headers, **kwargs)
        with request_span(tracer, method, parts, self.project, headers) as span:
            reply = await self._exchange(method, url, seconds=seconds, headers=headers, **kwargs)
            answered(span, reply[0])
            return reply

    async def _exchange(
        self,
        method: str,
        url: URL,
        *,
        seconds: float,
        headers: dict[str, str],
        limit: int = MAX_BODY_BYTES,
        **kwargs: Any,
    ) -> tuple[int, Any, Any]:
        """One request within ``seconds``, reading and decoding included: (status, headers, JSON body or
        None).

        No redirect is followed (a 3xx is returned as it is, and is never a success). The body is read up to
        ``limit`` bytes (MAX_BODY_BYTES), decoded here within the same bound, and parsed only if it is JSON;
        anything else is dropped unread (it may echo the URL, which holds the caller's number). Raises
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
                    raw = await _read_bounded(resp, limit) if is_json else b""
                body = (
                    orjson.loads(decode(raw, resp_headers.get("Content-Encoding", ""), limit))
                    if raw
                    else None
                )
            if loop.time() > deadline:  # decoding counts in the budget too
                raise TimeoutError
            return status, resp_headers, body
        except TimeoutError:
            raise ServiceUnavailableError(f"no answer within {seconds * 1000:.0f} ms") from None
        except AnswerTooLarge:
            raise ServiceUnavailableError(f"the answer is larger than {limit >> 20} MiB") from None
        except Exception as exc:  # aiohttp's and decoding errors, and anything else: never into agent code
            raise ServiceUnavailableError(
                f"{type(exc).__name__}: no usable answer from the service"
            ) from None

    async def _call(
        self,
        method: str,
        parts: tuple[str, ...],
        *,
        seconds: float,
        params: Mapping[str, str] | None = None,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        limit: int | None = None,
    ) -> tuple[int, Mapping[str, str], Any]:
        """One JSON request to a path of the project (see :meth:`_request`)."""
        url = self._url(*parts)
        if params:
            url = url.with_query(params)
        sent = {**self._headers, **(headers or {})}
        if body is not None:
            sent["Content-Type"] = "application/json"
        return await self._request(
            method, parts, url, seconds=seconds, headers=sent, limit=limit or MAX_BODY_BYTES, data=body
        )

    async def read_memory(
        self,
        caller: str,
        *,
        previous: Memory | None = None,
        budget: float | None = None,
        attestation: str | None = None,
        step_up: bool = False,
    ) -> Memory:
        """The caller's memory within ``budget`` seconds (the client's ``read_budget``), or an empty
        unavailable one; never raises because of the service.

        ``attestation`` and ``step_up`` are the reading call's caller-ID trust (see :meth:`conversation`):
        the fields it does not qualify for are left out and named in ``Memory.withheld``. ValueError, before
        anything is sent, for an attestation no provider sends or a ``step_up`` that is not a bool.

        If the read fails (a timeout, the service down or failing, an open circuit) and ``previous`` (the
        last memory read of this caller) is still within its ``valid_until``, that is served again with
        ``stale`` True: no field of it has expired yet. A refused request (a 4xx) is never answered so."""
        trust = query(checked_attestation(attestation), checked_step_up(step_up))
        if budget is not None and budget <= 0:
            return _stale_or(previous, "no time left in the read budget")
        probe = self.circuit.is_open
        if not self.circuit.allow():
            return _stale_or(previous, "circuit open: recent reads failed")
        verdict: bool | None = None  # True: the service works; False: it failed; None: no verdict
        try:
            memory, verdict = await self._read(caller, previous, budget or self.read_budget, trust)
            if verdict is False:
                memory = _stale_or(previous, memory.reason or "the read failed")
        finally:
            if verdict is True:
                self.circuit.success()
            elif verdict is False:
                self.circuit.failure()
            elif probe:  # cancelled, or a client error: let the next read probe
                self.circuit.release()
        return memory

    async def _read(
        self, caller: str, previous: Memory | None, budget: float, trust: Mapping[str, str]
    ) -> tuple[Memory, bool | None]:
        headers = dict(self._headers)
        if previous is not None and previous.available and previous.etag:
            # The service's ETag covers what the call's trust withheld: a read with more trust gets a 200.
            headers["If-None-Match"] = previous.etag
        parts = ("callers", caller, "memory")
        url = self._url(*parts)
        try:
            status, resp_headers, body = await self._request(
                "GET", parts, url.with_query(trust) if trust else url, seconds=budget, headers=headers
            )
        except ServiceUnavailableError as exc:
            log.warning("memory read failed: %s", exc)
            return Memory.unavailable(str(exc)), False
        if status == 304 and previous is not None and previous.available:
            return previous._as_fresh(), True
        answer = parse(MemoryAnswer, body) if status == 200 else None
        if answer is not None:
            etag = resp_headers.get("ETag")
            return Memory(
                answer.fields,
                etag=etag,
                expires_at=answer.expires_at,
                blacklisted=answer.blacklisted,
                valid_until=answer.valid_until,
                withheld=tuple(answer.withheld),
                attestation=answer.attestation,
            ), True
        if status == 200:
            error: Exception = ServiceUnavailableError("the answer was not the service's (is the URL right?)")
        else:
            error = error_for(status, body)
        log.warning("memory read refused: %s", error)
        if is_client_error(status):
            # The request was wrong (a caller that is no phone number, a bad token): the caller's error,
            # not an outage. The service's own problem document also says it is up.
            return Memory.unavailable(str(error)), True if problem(status, body) is not None else None
        return Memory.unavailable(str(error)), False

    # Conversation memory (what conversations and their senders call) ----------------------------------

    def _transcript_buffer(
        self,
        conversation_id: str,
        *,
        caller: str,
        channel: str,
        agent: str | None,
        state: Callable[[], Mapping[str, Any]],
        trust: Callable[[], Mapping[str, Any]] | None = None,
    ) -> TranscriptBuffer:
        buffer = TranscriptBuffer(
            self, conversation_id, caller=caller, channel=channel, agent=agent, state=state, trust=trust
        )
        self._buffers[conversation_id] = buffer
        return buffer

    def _start_sender(self, sender: TranscriptBuffer, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        self._buffers[sender.conversation_id] = sender
        task = asyncio.get_running_loop().create_task(work)
        self._senders.add(task)
        task.add_done_callback(self._senders.discard)
        return task

    async def _append_batch(self, conversation_id: str, body: bytes, seconds: float) -> AppendedAnswer:
        """One attempt of one batch; waiting for a free slot (``background_requests``) counts in it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        try:
            async with asyncio.timeout(seconds):
                await self._send_slots.acquire()
        except TimeoutError:
            raise ServiceUnavailableError(f"no free connection within {seconds * 1000:.0f} ms") from None
        try:
            return await self._calls.append(conversation_id, body, max(0.001, deadline - loop.time()))
        finally:
            self._send_slots.release()

    async def _transcript_status(self, conversation_id: str, seconds: float) -> StatusAnswer:
        return await self._calls.status(conversation_id, seconds)

    async def _keep_batches(self, conversation_id: str, bodies: list[bytes]) -> list[int]:
        return await self.outbox.add_many(conversation_id, bodies, kind=MESSAGES)

    async def _set_aside_batch(self, conversation_id: str, body: bytes, reason: str) -> None:
        entry_id = await self.outbox.add(conversation_id, body, lease=0, kind=MESSAGES)
        await self.outbox.reject(entry_id, reason)

    async def _start_conversation(
        self, conversation_id: str, body: dict[str, Any], seconds: float
    ) -> StartedAnswer:
        if self.circuit.is_open:  # reads keep failing: do not wait on the start either
            raise ServiceUnavailableError("circuit open: recent reads failed")
        return await self._calls.start(conversation_id, body, seconds)

    async def _history(
        self, conversation_id: str, params: dict[str, str], seconds: float, etag: str | None
    ) -> tuple[HistoryAnswer | OpenAIHistoryAnswer | None, str | None]:
        return await self._calls.history(conversation_id, params, seconds, etag)

    async def _context(
        self,
        conversation_id: str,
        max_tokens: int,
        seconds: float,
        trust: Mapping[str, str] | None = None,
    ) -> ContextAnswer:
        return await self._calls.context(conversation_id, max_tokens, seconds, trust)

    async def _put_summary(self, conversation_id: str, body: bytes, seconds: float) -> StatusAnswer:
        return await self._calls.put_summary(conversation_id, body, seconds)


def _stale_or(previous: Memory | None, reason: str) -> Memory:
    """After a failed read: ``previous`` again, marked stale, while none of its fields can have expired;
    else an empty unavailable memory."""
    if previous is not None and previous.usable_at(datetime.now(UTC)):
        log.warning("memory read failed, serving the last memory read (stale): %s", reason)
        return previous._as_stale(reason)
    return Memory.unavailable(reason)


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


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The raw body, or AnswerTooLarge as soon as it is larger than ``limit``."""
    if resp.content_length is not None and resp.content_length > limit:
        raise AnswerTooLarge("the answer is too large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(64 * 1024):
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge("the answer is too large")
        chunks.append(chunk)
    return b"".join(chunks)
