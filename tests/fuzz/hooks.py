"""Schemathesis hooks (loaded by the fuzz run through ``SCHEMATHESIS_HOOKS``): what a JSON Schema cannot make
schemathesis send. Among the cases schemathesis generates to be refused (negative mode: the
service must answer them with a documented 4xx, never a 5xx), one in seven gets a header whose bytes are not UTF-8 (an extra header, or a garbled
``If-Match`` / ``If-None-Match`` where the operation takes one), and one analytics case in five a time at or
beyond the ends of the accepted calendar. The choice is a checksum of the case and of how many cases of its
operation came before (the run sends one request at a time), so a derandomized run sends the same cases every
time. Each perturbation is noted in ``perturbed.log`` in the working directory, so the
test can check that they were sent.

One change is made to cases meant to be accepted: a configuration the operator's run writes to the fuzz
project keeps conversation memory and identity linking on (anything else in it is as generated), so that the
conversations the test started there stay readable and identifiers linkable; otherwise the first such write
(the document's example, which has neither) would turn every later transcript operation into a 404 and every
link into a 403."""

from __future__ import annotations

import zlib
from collections import Counter
from typing import Any

import schemathesis

#: Latin-1 text, which the HTTP client sends as single bytes: none of these is valid UTF-8 on its own.
NOT_UTF8 = ["\xff\xfe", "caf\xe9", '"\xe9tag"', "\x80\x81", "W/\xa0"]
CALENDAR_EDGES = [
    "0001-01-01",
    "0001-01-01T00:00:00+05:00",
    "1969-12-31T23:59:59Z",
    "1970-01-01",
    "9998-12-31T23:00:00Z",
    "9999-01-01T00:00:00Z",
    "9999-01-01T00:00:01Z",
    "9999-12-31T23:59:59",
    "9999-12-31T23:00:00-05:00",
]


_SENT: Counter[str] = Counter()
#: The project the fuzz run's fixture configures (tests/fuzz/test_schemathesis.py, PROJECT).
FUZZ_PROJECT = "fuzz"
PUT_PROJECT = "PUT /v1/projects/{project}"


def _note(line: str) -> None:
    with open("perturbed.log", "a", encoding="utf-8") as log:
        log.write(line + "\n")


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: Any) -> None:
    label = case.operation.label
    _SENT[label] += 1
    negative = case.meta is not None and case.meta.generation.mode.is_negative
    if label == PUT_PROJECT and not negative:
        _keep_conversation_memory(case)
    # Only cases meant to be refused: a valid case made invalid would count against the schema ("mostly
    # rejected generated data") and could keep an operation from ever succeeding in a short run.
    if not negative:
        return
    digest = zlib.crc32(repr((label, _SENT[label], case.path_parameters, case.query, case.body)).encode())
    if digest % 7 == 0:
        value = NOT_UTF8[digest // 7 % len(NOT_UTF8)]
        headers = dict(case.headers or {})
        taken = [name for name in ("If-Match", "If-None-Match") if name in headers]
        headers[taken[0] if taken else "X-Fuzz"] = value
        case.headers = headers
        _note(f"header {label}")
    names = [name for name in ("from", "to") if "/analytics/" in case.operation.path]
    if names and digest % 5 == 1:
        query = dict(case.query or {})
        query[names[digest // 5 % 2]] = CALENDAR_EDGES[digest // 11 % len(CALENDAR_EDGES)]
        case.query = query
        _note(f"calendar {label}")


def _keep_conversation_memory(case: Any) -> None:
    body = case.body
    if (case.path_parameters or {}).get("project") != FUZZ_PROJECT or not isinstance(body, dict):
        return
    memory = body.get("memory", {})
    if not isinstance(memory, dict):
        return
    conversation = memory.get("conversation", {})
    if isinstance(conversation, dict):
        memory = {**memory, "conversation": {**conversation, "enabled": True}}
    repeat_caller = memory.get("repeat_caller", {})
    if isinstance(repeat_caller, dict):  # and linked identifiers, so that the link operations stay reachable
        memory = {**memory, "repeat_caller": {**repeat_caller, "identity_linking": True}}
    case.body = {**body, "memory": memory}
