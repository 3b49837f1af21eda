"""A load of end-of-call writes that goes on while processes are killed, and what each write got back.

Each write is one conversation (``crash-<i>``) of its own caller setting ``booking_day`` to ``day-<i>``, so
afterwards every write can be checked on its own: acknowledged means readable.
"""

from __future__ import annotations

import asyncio
import time
import urllib.error
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import aiohttp

from tests.conftest import OPERATOR_TOKEN
from tests.support.service_process import http

PROJECT = "shop"
STATE_KEY = "booking_day"
PROJECT_CONFIG = {"memory": {"repeat_caller": {"state_keys": [STATE_KEY], "analytics_enabled": True}}}
#: How long a worker waits after a failed write before it ends the next call (a client backing off).
FAILURE_PAUSE_S = 0.02
#: Bound on every wait for the load to make progress: a wedged service fails the test, it does not hang it.
PROGRESS_TIMEOUT_S = 20.0

#: What one write got: an HTTP status, or the name of the error that cut the connection.
Outcome = int | str


def caller(i: int) -> str:
    return f"+1415555{i:04d}"


def conversation_id(i: int) -> str:
    return f"crash-{i}"


def value(i: int) -> str:
    return f"day-{i}"


def end_body(i: int) -> dict[str, Any]:
    return {"caller": caller(i), "state": {STATE_KEY: value(i)}, "outcome": {"qa": "resolved"}}


def create_project(base_url: str) -> str:
    """Create the project and return an agent token for it. A 503 (a store just started, on a loaded
    machine) is retried for up to 10 s: this is set-up, not what the tests measure."""
    deadline = time.monotonic() + 10
    while True:
        try:
            http("PUT", f"{base_url}/v1/projects/{PROJECT}", OPERATOR_TOKEN, PROJECT_CONFIG)
            break
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    token: str = http("POST", f"{base_url}/v1/projects/{PROJECT}/tokens", OPERATOR_TOKEN, {"role": "agent"})[
        "token"
    ]
    return token


async def end_call(session: aiohttp.ClientSession, base_url: str, token: str, i: int) -> Outcome:
    """One end-of-call write, sent once: the status, or the name of the connection error."""
    url = f"{base_url}/v1/projects/{PROJECT}/conversations/{conversation_id(i)}/end"
    try:
        async with session.post(url, json=end_body(i), headers={"Authorization": f"Bearer {token}"}) as resp:
            await resp.read()
            if resp.status == 200 and resp.headers.get("Idempotent-Replayed") == "true":
                return "replayed"
            return resp.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        return type(exc).__name__


async def retry_all(
    session: aiohttp.ClientSession, base_url: str, token: str, ids: Iterable[int]
) -> list[Outcome]:
    """Send each failed write again, as a client's pool would: a few at a time (one project may hold only its
    share of the service's requests in flight; a burst of hundreds would be answered 429)."""
    limit = asyncio.Semaphore(16)

    async def one(i: int) -> Outcome:
        async with limit:
            return await end_call(session, base_url, token, i)

    return list(await asyncio.gather(*(one(i) for i in ids)))


async def stored_values(
    session: aiohttp.ClientSession, base_url: str, ids: Iterable[int]
) -> dict[int, object]:
    """What the service reads back for each write's caller (None when the field is missing)."""
    limit = asyncio.Semaphore(16)

    async def one(i: int) -> tuple[int, object]:
        url = f"{base_url}/v1/projects/{PROJECT}/callers/{quote(caller(i), safe='')}/memory"
        async with limit, session.get(url, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as resp:
            assert resp.status == 200, (resp.status, await resp.text())
            fields = (await resp.json())["fields"]
            return i, fields.get(STATE_KEY)

    return dict(await asyncio.gather(*(one(i) for i in ids)))


async def conversations_counted(session: aiohttp.ClientSession, base_url: str) -> int:
    """The project's analytics count of ended conversations (each is counted once, even if retried)."""
    url = f"{base_url}/v1/projects/{PROJECT}/analytics/repeat-callers?interval=day"
    async with session.get(url, headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}) as resp:
        assert resp.status == 200, await resp.text()
        count: int = (await resp.json())["totals"]["conversations"]
        return count


@dataclass(frozen=True, slots=True)
class Result:
    outcome: Outcome
    #: The phase of the test when the write was answered ("before", "down", "after").
    phase: str
    #: The write was in flight when the phase changed to "down" (the moment of the kill).
    in_flight_at_kill: bool


class Load:
    """Workers that end calls 0, 1, 2, ... with ``attempt`` until :meth:`stop`, recording every outcome."""

    def __init__(
        self,
        attempt: Callable[[int], Awaitable[Outcome]],
        succeeded: Callable[[Outcome], bool],
        *,
        workers: int = 16,
        limit: int = 9999,
    ) -> None:
        self._attempt = attempt
        self._succeeded = succeeded
        self._workers = workers
        self._limit = limit
        self._next = 0
        self._in_flight: set[int] = set()
        self._at_kill: set[int] = set()
        self._stopping = False
        self._changed = asyncio.Condition()
        self._tasks: list[asyncio.Task[None]] = []
        self.phase = "before"
        self.results: dict[int, Result] = {}

    def start(self) -> None:
        """Start the workers (again, after :meth:`stop`: they go on with the next ids)."""
        self._stopping = False
        self._tasks = [asyncio.create_task(self._work()) for _ in range(self._workers)]

    async def stop(self) -> None:
        """Let the writes in flight finish, start no new ones."""
        self._stopping = True
        await asyncio.gather(*self._tasks)

    def killed(self) -> None:
        """Call right after the kill: the writes in flight now are the ones the kill cut."""
        self.phase = "down"
        self._at_kill = set(self._in_flight)

    async def _work(self) -> None:
        while not self._stopping and self._next < self._limit:
            i = self._next
            self._next += 1
            self._in_flight.add(i)
            try:
                outcome = await self._attempt(i)
            finally:
                self._in_flight.discard(i)
            self.results[i] = Result(outcome, self.phase, i in self._at_kill)
            async with self._changed:
                self._changed.notify_all()
            if not self._succeeded(outcome):
                await asyncio.sleep(FAILURE_PAUSE_S)  # back off like a client would; not a synchronisation

    def count(self, *, succeeded: bool, phase: str | None = None) -> int:
        return sum(
            1
            for r in self.results.values()
            if self._succeeded(r.outcome) == succeeded and (phase is None or r.phase == phase)
        )

    async def wait_for(self, *, succeeded: bool, count: int, phase: str | None = None) -> None:
        """Until ``count`` writes (of ``phase``) succeeded, or failed."""
        try:
            async with asyncio.timeout(PROGRESS_TIMEOUT_S), self._changed:
                await self._changed.wait_for(lambda: self.count(succeeded=succeeded, phase=phase) >= count)
        except TimeoutError:
            raise AssertionError(f"the load is stuck: {self.summary()}") from None

    def ids(self, *, succeeded: bool) -> list[int]:
        return sorted(i for i, r in self.results.items() if self._succeeded(r.outcome) == succeeded)

    def outcomes(self) -> Counter[Outcome]:
        return Counter(r.outcome for r in self.results.values())

    def summary(self) -> str:
        phases = {
            phase: {
                "ok": self.count(succeeded=True, phase=phase),
                "failed": self.count(succeeded=False, phase=phase),
            }
            for phase in ("before", "down", "after")
        }
        cut = Counter(r.outcome for r in self.results.values() if r.in_flight_at_kill)
        return f"{len(self.results)} writes, {phases}, outcomes {dict(self.outcomes())}, in flight at the kill {dict(cut)}"
