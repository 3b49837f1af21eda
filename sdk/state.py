"""``conv.state``: what the agent wants remembered about the caller, checked at assignment and again before
it is sent (as the end's state, or as a checkpoint with message batches)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

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
