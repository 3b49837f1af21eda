"""Fixtures of the tracing tests: the spans that end during a test (the session's provider records them)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan

from tests.support.spans import SpanInspector


@pytest.fixture
def spans(no_identifier_in_any_span: SpanInspector) -> Iterator[list[ReadableSpan]]:
    with no_identifier_in_any_span.recording() as found:
        yield found


def scope(span: ReadableSpan) -> str:
    return span.instrumentation_scope.name if span.instrumentation_scope is not None else ""


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def one(spans: list[ReadableSpan], name: str) -> ReadableSpan:
    found = named(spans, name)
    assert len(found) == 1, f"{name}: {[s.name for s in spans]}"
    return found[0]
