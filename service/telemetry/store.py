"""A span around every call of the Store port (SPEC section 18: store operations named at the port).

The wrapper is made once per app, when tracing is on, around whichever backend the app opened: one place
for every backend, and a backend's calls to its own methods stay inside the one span of the port call that
made them. Calls outside a sampled span (a request left out, background polling) make none. Each span is named ``store <operation>`` (the port's method), with ``db.system.name`` (and the
older ``db.system``) and ``db.operation.name``: never a key, an argument or a result, which hold pseudonyms
and values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Any

from opentelemetry.trace import SpanKind, StatusCode, Tracer, get_current_span

from ..domain.store import Store


def _port_methods() -> tuple[list[str], list[str]]:
    """The port's coroutine methods (each gets a span) and its other public methods (passed through)."""
    spanned: list[str] = []
    plain: list[str] = []
    for name, member in inspect.getmembers(Store, inspect.isfunction):
        if name.startswith("_"):
            continue
        (spanned if inspect.iscoroutinefunction(member) else plain).append(name)
    return spanned, plain


def _spanned(name: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    span_name = f"store {name}"

    async def call(self: _TracedStore, *args: Any, **kwargs: Any) -> Any:
        if not get_current_span().is_recording():
            # Outside any sampled span: a request the sampler left out (its store calls follow it, at no
            # cost), or the delivery worker's and the cache's polling (a trace per poll would be noise).
            return await getattr(self._inner, name)(*args, **kwargs)
        with self._tracer.start_as_current_span(
            span_name,
            kind=SpanKind.CLIENT,
            attributes={**self._attributes, "db.operation.name": name},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                return await getattr(self._inner, name)(*args, **kwargs)
            except BaseException as exc:
                # The type only: a store error's message may name what it was doing with which key.
                span.set_attribute("error.type", type(exc).__qualname__)
                span.set_status(StatusCode.ERROR)
                raise

    call.__name__ = call.__qualname__ = name
    return call


def _passed(name: str) -> Callable[..., Any]:
    def call(self: _TracedStore, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._inner, name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class _TracedStore:
    """Base of the generated class: the backend, the tracer and the attributes every span carries; anything
    that is not part of the port (a backend's own attribute, which a test may read) is the backend's."""

    def __init__(self, inner: Store, tracer: Tracer, system: str) -> None:
        self._inner = inner
        self._tracer = tracer
        self._attributes = {"db.system.name": system, "db.system": system}

    @property
    def traced(self) -> Store:
        """The backend under the spans."""
        return self._inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _traced_class() -> type[_TracedStore]:
    spanned, plain = _port_methods()
    members: dict[str, Any] = {name: _spanned(name) for name in spanned}
    members.update({name: _passed(name) for name in plain})
    members["__doc__"] = (
        "The Store port with a span around every call (see caller_memory.service.telemetry.store)."
    )
    # A subclass of Store (ABC) with every port method defined: isinstance(store, Store) holds, and a method
    # added to the port later is spanned without a change here.
    return type("TracedStore", (_TracedStore, Store), members)


#: The class, made like any class when this module is imported (only once tracing is on).
TracedStore = _traced_class()


def traced(store: Store, tracer: Tracer, system: str) -> Store:
    """``store`` with a span around every port call, on ``tracer``; ``system``: ``redis`` or ``sqlite``."""
    made: Store = TracedStore(store, tracer, system)  # type: ignore[assignment]
    return made
