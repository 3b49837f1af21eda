"""The session-wide span check (tests/conftest.py): every span our instrumentation scopes (and the mcp SDK's)
end in a test process is inspected as it ends, for anything that identifies a caller or opens a door.

What a span may hold is a short, fixed list (SPEC section 18), so the check is an allow-list first: each
attribute key must be one we set, and its value of the shape that key takes; span names must be of the
shapes we make; no event (we record none, exceptions included). Then every string of the span (name,
attribute values, status description, link attributes) is searched for what must never be there: a phone
number in every form the log masking knows (service/logs.py's mask_text changes the text; the SDK's
digit runs; the test suite's own numbers after canonical_digits), an e-mail or ``email:``/``account:``
identifier, a token or bearer credential, a 32-hex pseudonym. Field values (``Friday``, ``gouda``) cannot
pass the allow-list: no attribute takes free text.

Spans are inspected as they end and only the faults kept (a run makes hundreds of thousands of spans: none is
held), and each distinct string is searched once.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

from caller_memory.service.logs import mask_text
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor


#: The scopes checked: ours, and the mcp SDK's (its spans go to the application's provider).
def checked_scope(name: str) -> bool:
    return name.startswith(("caller_memory.", "mcp"))


_ROUTE = re.compile(r"/[A-Za-z0-9_./{}-]*")
_METHOD = r"(?:GET|HEAD|POST|PUT|PATCH|DELETE|OPTIONS|CONNECT|TRACE|_OTHER)"
_NAMES = re.compile(
    rf"{_METHOD}(?: /[A-Za-z0-9_./{{}}-]*)?|store [a-z_]+|deliver [a-z.]+|execute_tool [a-z_]+|chat|sweep"
    r"|inactivity ends"
)
#: The mcp SDK's span names: the JSON-RPC method, and the tool's or prompt's name, received or sent.
_MCP_NAMES = re.compile(r"(?:MCP send )?[a-z_]+(?:/[a-z_]+)*(?: [A-Za-z0-9_.-]+)?")
_PROJECT = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
#: error.type: an exception's type, an HTTP status, or a JSON-RPC error code (the mcp SDK's).
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,63}|[1-5][0-9][0-9]|-32[0-9]{3}")
#: Each attribute key we set, and what its value may be.
ALLOWED: dict[str, Any] = {
    "http.request.method": re.compile(_METHOD),
    "http.route": _ROUTE,
    "http.response.status_code": int,
    "db.system": re.compile(r"redis|sqlite"),
    "db.system.name": re.compile(r"redis|sqlite"),
    "db.operation.name": re.compile(r"[a-z_]+"),
    "gen_ai.operation.name": re.compile(r"[a-z_]+"),
    "gen_ai.memory.store.id": _PROJECT,
    "gen_ai.tool.name": re.compile(r"[a-z_]+"),
    "error.type": _WORD,
    "caller_memory.webhook.event": re.compile(r"[a-z]+\.[a-z]+"),
    "caller_memory.webhook.outcome": re.compile(r"[a-z_]+"),
    # The mcp SDK's (mcp/server/_otel.py, mcp/shared/jsonrpc_dispatcher.py).
    "mcp.method.name": re.compile(r"[a-z_]+(?:/[a-z_]+)*"),
    "mcp.protocol.version": re.compile(r"\d{4}-\d\d-\d\d"),
    "jsonrpc.request.id": re.compile(r"[A-Za-z0-9_-]{1,64}"),
    "rpc.response.status_code": re.compile(r"-?\d{1,6}"),
    "gen_ai.prompt.name": re.compile(r"[A-Za-z0-9_.-]{1,64}"),
}
#: Never on a span: the path holds the caller's number.
FORBIDDEN_KEYS = re.compile(r"url\..*|http\.target|http\.url")
_ISO_DATE = re.compile(r"(?<!\d)\d{4}-\d\d-\d\d(?!\d)")
_PSEUDONYM = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")
_SDK_DIGITS = re.compile(r"\d(?:(?:[\s\-./()]|%20){0,3}\d){6,}")


class SpanInspector(SpanProcessor):
    """A span processor that inspects every span as it ends and keeps what it found wrong."""

    def __init__(self, test_numbers: re.Pattern[str], canonical: Any) -> None:
        self._numbers = test_numbers
        self._canonical = canonical
        self._lock = threading.Lock()
        self._seen: dict[str, str | None] = {}
        self.faults: list[str] = []
        self.counts: Counter[str] = Counter()
        self._recorded: list[ReadableSpan] | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[ReadableSpan]]:
        """Every span (of any scope) that ends while the block runs, for a test of tracing to look at."""
        found: list[ReadableSpan] = []
        self._recorded = found
        try:
            yield found
        finally:
            self._recorded = None

    def on_end(self, span: ReadableSpan) -> None:
        if self._recorded is not None:
            self._recorded.append(span)
        scope = span.instrumentation_scope.name if span.instrumentation_scope else ""
        if not checked_scope(scope):
            return
        with self._lock:
            self.counts[scope] += 1
            self.faults.extend(f"{scope} span {span.name[:80]!r}: {fault}" for fault in self._faults(span))

    def _faults(self, span: ReadableSpan) -> Iterable[str]:
        mcp = span.instrumentation_scope is not None and span.instrumentation_scope.name.startswith("mcp")
        if not (_MCP_NAMES if mcp else _NAMES).fullmatch(span.name):
            yield "a name of no shape we make"
        yield from self._strings("name", [span.name])
        for key, value in (span.attributes or {}).items():
            if FORBIDDEN_KEYS.fullmatch(key):
                yield f"attribute {key}"
            shape = ALLOWED.get(key)
            if shape is None:
                yield f"attribute {key}, which we never set"
            elif shape is int:
                if not isinstance(value, int):
                    yield f"attribute {key} is not a number"
            elif not (isinstance(value, str) and shape.fullmatch(value)):
                yield f"attribute {key} of an unexpected shape"
            yield from self._strings(key, value if isinstance(value, tuple | list) else [value])
        for event in span.events:
            # Ours record none; the mcp SDK records an exception it did not expect (its message and
            # stack are searched like the rest).
            if not mcp:
                yield f"event {event.name[:40]!r}"
            yield from self._strings("event", [event.name, *(event.attributes or {}).values()])
        if span.status.description:
            yield from self._strings("status", [span.status.description])
        for link in span.links:
            for key, value in (link.attributes or {}).items():
                yield from self._strings(f"link attribute {key}", [value])

    def _strings(self, where: str, values: Iterable[Any]) -> Iterable[str]:
        for value in values:
            if not isinstance(value, str):
                continue
            if value not in self._seen:
                self._seen[value] = self._leak(value)
            leak = self._seen[value]
            if leak is not None:
                yield f"{where}: {leak}"

    def _leak(self, text: str) -> str | None:
        if mask_text(text) != text:
            return "a number, an e-mail, an identifier or a credential (the log masking changes it)"
        text = _ISO_DATE.sub("", text)  # a date (the mcp protocol's version), as the log masking keeps it
        if _SDK_DIGITS.search(text) or self._numbers.search(self._canonical(text)):
            return "a run of digits a number may be"
        if _PSEUDONYM.search(text):
            return "32 hex digits: a pseudonym"
        if "cm_" in text or "whsec_" in text:
            return "a token or secret prefix"
        return None

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
