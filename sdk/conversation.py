"""One phone call: ``conv.memory`` (read once per turn), ``conv.state`` (written at the end)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

from .memory import Memory

#: The largest integer magnitude JSON carries exactly everywhere (I-JSON, RFC 7493): 2**53 - 1.
MAX_EXACT_INTEGER = 2**53 - 1
#: How deeply values may nest (the service refuses values over 2048 bytes anyway).
MAX_DEPTH = 64


def check_json(value: Any, where: str, depth: int = 0) -> None:
    """Raise ValueError unless ``value`` is JSON that arrives as it was meant: str (valid Unicode), bool,
    None, an int within +-(2**53 - 1), a finite float, a list or tuple of such, a dict with str keys."""
    if value is None or isinstance(value, bool):
        return
    if depth > MAX_DEPTH:
        raise ValueError(f"{where}: nested more than {MAX_DEPTH} levels deep (or it contains itself)")
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_json(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: object keys must be strings, not {type(key).__name__}")
            check_json(item, f"{where}[{key!r}]", depth + 1)
    else:
        problem = _scalar_problem(value)
        if problem:
            raise ValueError(f"{where}: {problem}")


def _scalar_problem(value: Any) -> str | None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return "the string holds a lone surrogate, which JSON cannot carry"
        return None
    if isinstance(value, int):
        if abs(value) > MAX_EXACT_INTEGER:
            return "integers beyond +-(2**53 - 1) do not survive JSON exactly; send a string"
        return None
    if isinstance(value, float):
        if not math.isfinite(value):
            return f"{value!r} cannot be sent as JSON (it would arrive as null, which deletes the field)"
        return None
    return f"a {type(value).__name__} cannot be sent as JSON; convert it first"


class State(dict[str, Any]):
    """``conv.state``: a dict that refuses, at assignment, keys and values JSON cannot carry exactly
    (``conv.end()`` checks everything again, including values changed in place)."""

    def __setitem__(self, key: str, value: Any) -> None:
        if not isinstance(key, str):
            raise ValueError(f"conv.state keys must be strings, not {type(key).__name__}")
        check_json(value, f"conv.state[{key!r}]")
        super().__setitem__(key, value)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Iterable[tuple[str, Any]] | Mapping[str, Any]) -> State:  # type: ignore[override,misc]
        self.update(other)
        return self


def checked_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` to send, after checking every key and value (ValueError otherwise)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"conv.state must be a dict, not {type(state).__name__}")
    copy = dict(state)
    check_json(copy, "conv.state")
    return copy


@dataclass(frozen=True, slots=True)
class EndResult:
    """What ``conv.end()`` achieved.

    ``queued`` is True when the service could not be reached: the write is kept in the durable outbox and
    will be delivered later (``persisted`` and ``ignored`` are then unknown and empty).
    """

    conversation_id: str
    persisted: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()
    blacklisted: bool = False
    repeat_caller: dict[str, Any] = field(default_factory=dict, hash=False)
    replayed: bool = False
    queued: bool = False
    #: The caller was erased after this conversation ended: nothing was stored.
    erased: bool = False


class _Transport(Protocol):
    """What a conversation needs of its client (:class:`~caller_memory.sdk.MemoryClient` is one). A protocol,
    so that this module does not import client.py, which imports this one: the two have no import cycle, not
    even one for type checking."""

    async def read_memory(self, caller: str, *, previous: Memory | None = None) -> Memory: ...

    async def end_conversation(self, conversation_id: str, body: dict[str, Any]) -> EndResult: ...


class Conversation:
    """Created by :meth:`MemoryClient.conversation`; one per call."""

    def __init__(self, client: _Transport, conversation_id: str, caller: str) -> None:
        self._client = client
        self.conversation_id = conversation_id
        self.caller = caller
        #: What to remember about the caller; written at the end of the conversation, keys in state_keys only.
        self.state: dict[str, Any] = State()
        self._memory: Memory | None = None
        self._result: EndResult | None = None
        #: When end() was first called; every later call (after a cancellation) sends the same moment.
        self._ended_at: str | None = None
        self._ending = asyncio.Lock()

    def __repr__(self) -> str:
        return f"<Conversation {self.conversation_id} {'ended' if self.ended else 'open'}>"

    @property
    def memory(self) -> Memory:
        """The caller's memory as fetched by the last :meth:`begin_turn`. Read-only."""
        if self._memory is None:
            raise RuntimeError(
                "call `await conv.begin_turn()` at the start of each turn before reading conv.memory"
            )
        return self._memory

    async def begin_turn(self) -> Memory:
        """Fetch the caller's memory once for this turn (within the client's read budget).

        Never raises because of the service: on a timeout, an error or an open circuit, ``conv.memory`` is
        empty with ``available`` False. An unchanged memory costs a ``304 Not Modified``.
        """
        self._memory = await self._client.read_memory(self.caller, previous=self._memory)
        return self._memory

    async def end(
        self,
        *,
        qa: str | None = None,
        handoff_reason: str | None = None,
        handoff_to: str | None = None,
        channel: str | None = "voice",
    ) -> EndResult:
        """Send ``conv.state`` and the outcome. Retries transient failures, then queues in the outbox.

        The request is kept in the durable outbox from the start, so a crash or a cancellation of this call
        does not lose it; calling it again after a cancellation sends the first call's ``ended_at``. Raises
        ValueError, before sending anything, if ``conv.state`` holds what JSON cannot carry exactly (NaN,
        Infinity, integers beyond 2**53, non-str keys, other types). Raises
        :class:`~caller_memory.sdk.errors.ServiceError` subclasses for requests the service refuses (invalid
        state values, a revoked token): the entry is then set aside in the outbox (see
        ``client.outbox.rejected()``), not deleted. Raises
        :class:`~caller_memory.sdk.errors.OutboxUnavailableError` if the service is unreachable *and* the
        outbox cannot be written. Once it returned a result (delivered or queued), calling it again returns
        that result without sending anything, whatever the arguments.
        """
        async with self._ending:  # two concurrent end() calls send one request
            if self._result is None:
                if self._ended_at is None:
                    self._ended_at = datetime.now(UTC).isoformat(timespec="milliseconds")
                state = checked_state(self.state)
                for name, given in (
                    ("qa", qa),
                    ("handoff_reason", handoff_reason),
                    ("handoff_to", handoff_to),
                    ("channel", channel),
                ):
                    if given is not None and not isinstance(given, str):
                        raise ValueError(f"{name} must be a string or None, not {type(given).__name__}")
                body = {
                    "caller": self.caller,
                    "state": state,
                    "outcome": {"qa": qa, "handoff_reason": handoff_reason, "handoff_to": handoff_to},
                    "channel": channel,
                    # When end() was first called, sent with every attempt and every later call (kept here
                    # and in the outbox, which keeps the first one across processes): an erasure of the
                    # caller after this moment wins over this write, however late it is delivered.
                    "ended_at": self._ended_at,
                }
                self._result = await self._client.end_conversation(self.conversation_id, body)
            return self._result

    @property
    def ended(self) -> bool:
        return self._result is not None
