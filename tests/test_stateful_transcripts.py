"""Stateful property test of conversation memory over the HTTP API (SQLite and Redis): random sequences of
appends (and their retries), checkpoints, explicit ends (and late ones), callbacks that supersede and resume,
inactivity ends run by the operator's sweep, erasures, clock moves and restarts, after each of which the
service agrees with a plain model: every transcript holds exactly what was appended (once), every
conversation is ended at most once in analytics, and the caller's memory holds the latest write of each
field (an older checkpoint never overwrites a later write).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from tests.support.redis_server import SHIPPED_CONFIG, RedisServer
from tests.test_stateful import ApiMachine

CALLERS = ["+14155550100", "+447700900123"]
DAYS = ["Monday", "Friday", "Sunday"]
END_AFTER_S = 1800
RESUME_S = 600
STEPS = settings(
    max_examples=12,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["booking_day"], "analytics_enabled": True, "retention": "P30D"},
        "conversation": {
            "enabled": True,
            "end_after_inactivity": END_AFTER_S,
            "idle_after": 120,
            "resume_window": RESUME_S,
        },
    }
}


@dataclass
class Call:
    conversation_id: str
    caller: str
    messages: list[tuple[str, str, int]] = field(default_factory=list)  # (message id, content, turn)
    last_batch: list[dict[str, Any]] = field(default_factory=list)
    last_activity: float = 0.0
    checkpoint: tuple[str, float] | None = None  # (booking day, when)
    ended_by: str | None = None
    explicit_end: dict[str, Any] | None = None

    @property
    def turn(self) -> int:
        return self.messages[-1][2] if self.messages else -1


@dataclass
class Model:
    calls: dict[str, Call] = field(default_factory=dict)
    current: dict[str, str] = field(default_factory=dict)  # caller -> their open conversation id
    memory: dict[str, tuple[str, float]] = field(default_factory=dict)  # caller -> (booking day, written at)
    erased: set[str] = field(default_factory=set)  # conversation ids

    def write(self, caller: str, day: str, at: float) -> None:
        if caller not in self.memory or self.memory[caller][1] <= at:
            self.memory[caller] = (day, at)

    def end(self, call: Call, by: str) -> None:
        call.ended_by = by
        if call.checkpoint is not None:
            self.write(call.caller, *call.checkpoint)
        self.current.pop(call.caller, None)


class TranscriptMachine(ApiMachine):
    settings = {**ApiMachine.settings, "inactivity_interval": 0}  # noqa: RUF012 - the sweep rule runs them

    def __init__(self) -> None:
        super().__init__()
        self.model = Model()
        self.ids = itertools.count(1)

    def now(self) -> float:
        return self.clock.now_ms() / 1000

    @initialize()
    def start(self) -> None:
        self.runner.run(self._start())
        assert self.call("PUT", "/v1/projects/shop", CONFIG).status in (200, 201)

    def _open_call(self, caller: str) -> Call:
        conversation_id = self.model.current.get(caller)
        if conversation_id is None:
            self.clock.advance(0.001)  # no two calls start in the same millisecond
            conversation_id = f"c-{next(self.ids)}"
            self.model.calls[conversation_id] = Call(conversation_id, caller, last_activity=self.now())
            self.model.current[caller] = conversation_id
        return self.model.calls[conversation_id]

    @rule(caller=st.sampled_from(CALLERS), n=st.integers(0, 3), next_turn=st.booleans())
    def say(self, caller: str, n: int, next_turn: bool) -> None:
        call = self._open_call(caller)
        turn = max(call.turn + (1 if next_turn else 0), 0)
        batch: list[dict[str, Any]] = [
            {
                "message_id": f"{call.conversation_id}-{len(call.messages) + i}",
                "role": "user" if i % 2 == 0 else "assistant",
                "content": f"words {len(call.messages) + i} of {call.conversation_id}",
                "turn_id": turn,
                "timestamp": self.clock.now_ms(),
            }
            for i in range(n)
        ]
        body = {"caller": caller, "channel": "phone", "messages": batch}
        reply = self.call("POST", f"/v1/projects/shop/conversations/{call.conversation_id}/messages", body)
        assert reply.status == 200, reply.body
        assert reply.body["stored"] and reply.body["added"] == n
        call.messages += [(m["message_id"], m["content"], turn) for m in batch]
        if batch:  # an append that adds nothing is no activity
            call.last_batch = batch
            call.last_activity = self.now()

    @precondition(lambda self: any(self.model.calls[c].last_batch for c in self.model.current.values()))
    @rule(data=st.data())
    def retry_the_last_batch(self, data: st.DataObject) -> None:
        call = self.model.calls[data.draw(st.sampled_from(sorted(self.model.current.values())))]
        if not call.last_batch:
            return
        body = {"messages": call.last_batch}
        reply = self.call("POST", f"/v1/projects/shop/conversations/{call.conversation_id}/messages", body)
        assert (reply.status, reply.body["added"]) == (200, 0), reply.body

    @rule(caller=st.sampled_from(CALLERS), day=st.sampled_from(DAYS))
    def checkpoint(self, caller: str, day: str) -> None:
        call = self._open_call(caller)
        body = {"caller": caller, "channel": "phone", "messages": [], "state": {"booking_day": day}}
        reply = self.call("POST", f"/v1/projects/shop/conversations/{call.conversation_id}/messages", body)
        assert reply.status == 200, reply.body
        call.checkpoint = (day, self.now())
        call.last_activity = self.now()

    @precondition(lambda self: any(c.explicit_end is None and c.conversation_id not in self.model.erased
                                   for c in self.model.calls.values()))  # fmt: skip
    @rule(data=st.data(), day=st.sampled_from(DAYS))
    def end(self, data: st.DataObject, day: str) -> None:
        candidates = sorted(
            c
            for c, call in self.model.calls.items()
            if call.explicit_end is None and c not in self.model.erased
        )
        call = self.model.calls[data.draw(st.sampled_from(candidates))]
        body = {"caller": call.caller, "state": {"booking_day": day}, "outcome": {"qa": "resolved"}}
        reply = self.call("POST", f"/v1/projects/shop/conversations/{call.conversation_id}/end", body)
        assert reply.status == 200, reply.body
        assert reply.body["late"] == (call.ended_by is not None), (call, reply.body)
        call.explicit_end = body
        if call.ended_by is None:
            call.ended_by = "explicit"
            self.model.current.pop(call.caller, None)
        self.model.write(call.caller, day, self.now())
        # Its retry is a replay, whatever ended it first.
        again = self.call("POST", f"/v1/projects/shop/conversations/{call.conversation_id}/end", body)
        assert again.status == 200 and again.headers["Idempotent-Replayed"] == "true"

    @rule(caller=st.sampled_from(CALLERS))
    def call_back(self, caller: str) -> None:
        self.clock.advance(0.001)  # no two calls start in the same millisecond
        now = self.now()
        previous = self.model.current.get(caller)
        if previous is not None:
            self.model.end(self.model.calls[previous], "superseded")
        resumable = [
            c
            for c in self.model.calls.values()
            if c.caller == caller
            and c.conversation_id not in self.model.erased
            and c.ended_by in ("inactivity", "superseded")
            and c.last_activity >= now - RESUME_S
        ]
        # The latest activity; of two at once, the later conversation.
        newest = (
            max(resumable, key=lambda c: (c.last_activity, int(c.conversation_id[2:]))) if resumable else None
        )
        expected = newest.conversation_id if newest else None
        conversation_id = f"c-{next(self.ids)}"
        reply = self.call(
            "POST",
            f"/v1/projects/shop/conversations/{conversation_id}/start",
            {"caller": caller, "channel": "phone"},
        )
        assert reply.status == 200, reply.body
        assert reply.body["superseded"] == ([previous] if previous else [])
        resume = reply.body["resume"]
        assert (resume["conversation_id"] if resume else None) == expected, (reply.body, resumable)
        self.model.calls[conversation_id] = Call(conversation_id, caller, last_activity=now)
        self.model.current[caller] = conversation_id

    @rule(seconds=st.sampled_from([1, 119, 121, 599, 601, 1799, 1801]))
    def advance(self, seconds: int) -> None:
        self.clock.advance(seconds)

    @rule()
    def sweep(self) -> None:
        assert self.call("POST", "/v1/admin/sweeps").status == 200
        now = self.now()
        for conversation_id in list(self.model.current.values()):
            call = self.model.calls[conversation_id]
            if call.last_activity <= now - END_AFTER_S:
                self.model.end(call, "inactivity")

    @rule(caller=st.sampled_from(CALLERS))
    def erase(self, caller: str) -> None:
        assert self.call("DELETE", f"/v1/projects/shop/callers/{caller}").status == 200
        self.model.erased |= {c for c, call in self.model.calls.items() if call.caller == caller}
        self.model.current.pop(caller, None)
        self.model.memory.pop(caller, None)
        self.clock.advance(1)  # what is made at the erasure's millisecond counts as made before it

    @invariant()
    def agrees_with_the_model(self) -> None:
        if self.api is None:
            return
        for conversation_id, call in self.model.calls.items():
            reply = self.call("GET", f"/v1/projects/shop/conversations/{conversation_id}/history?limit=1000")
            if conversation_id in self.model.erased:
                assert reply.status == 410, reply.body
                continue
            assert reply.status == 200, reply.body
            got = [(m.get("message_id"), m["content"], m["turn_id"]) for m in reply.body["contents"]]
            assert got == call.messages
            assert (reply.body["status"] == "ended") == (call.ended_by is not None), (call, reply.body)
        listing = self.call("GET", "/v1/projects/shop/analytics/conversations?limit=1000").body
        listed = sorted(entry["conversation_id"] for entry in listing["conversations"])
        ended = sorted(
            c for c, call in self.model.calls.items() if call.ended_by and c not in self.model.erased
        )
        assert listed == ended  # each ended conversation counted once, the erased ones unlisted
        for caller in CALLERS:
            fields = self.call("GET", f"/v1/projects/shop/callers/{caller}/memory").body["fields"]
            expected = self.model.memory.get(caller)
            assert fields.get("booking_day") == (expected[0] if expected else None), (caller, self.model)


@pytest.fixture(scope="module")
def persistent_redis() -> Any:
    with RedisServer(config_file=SHIPPED_CONFIG) as server:
        yield server


def test_conversation_memory_on_sqlite_agrees_with_a_model(tmp_path: Path) -> None:
    counter = itertools.count()

    @STEPS
    class Machine(TranscriptMachine):
        def __init__(self) -> None:
            self.store_url = f"sqlite:///{tmp_path}/transcripts-{next(counter)}.db"
            super().__init__()

    Machine.TestCase.settings = STEPS
    Machine.TestCase().runTest()


def test_conversation_memory_on_redis_agrees_with_a_model(persistent_redis: RedisServer) -> None:
    @STEPS
    class Machine(TranscriptMachine):
        def __init__(self) -> None:
            self.store_url = persistent_redis.url
            self.restart_store = self._restart_redis
            super().__init__()
            with persistent_redis.client() as client:
                client.flushall()

        @staticmethod
        def _restart_redis() -> None:
            persistent_redis.stop()
            persistent_redis.start()

    Machine.TestCase.settings = STEPS
    Machine.TestCase().runTest()
