"""JSON documents as the service accepts them: I-JSON (RFC 7493), so that what it acknowledges is exactly
what it was sent.

orjson checks the syntax and the encoding (UTF-8, no lone surrogates) and gives precise messages; a second
pass with the standard library's C scanner, whose hooks see each object's members and each number's text,
refuses what orjson would silently change: a member name given twice (the last would win), an integer
beyond what a double holds exactly (I-JSON's +-(2^53 - 1)), a number a double cannot hold as written
(``1e-400`` would become 0, ``1e400`` infinity, ``0.10000000000000000001`` 0.1), ``NaN`` and ``Infinity``.
Nesting is bounded too, so that no value deeper than the service can store, hash or answer ever reaches it.

The second pass runs only when orjson's reading cannot be proven to be the document as written: a walk of
that reading (a few microseconds; the second pass costs 3 to 5 times as much) finds no float, no integer
beyond the bound and no nesting past it, and the colons of the raw bytes prove that no object lost a member
(see :func:`_exact`). Most bodies (messages, memory patches) take only orjson and the walk.
"""

from __future__ import annotations

import json
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

from .errors import InvalidInput, MalformedRequest

#: Deepest nesting of arrays and objects in a request document (the document itself is level 1).
MAX_DEPTH = 32
#: Largest integer magnitude accepted: beyond it a double (what most JSON readers use) changes the value.
MAX_EXACT_INT = 2**53 - 1


class _Refused(ValueError):
    def __init__(self, detail: str, member: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.member = member


def _members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) != len(pairs):
        seen: set[str] = set()
        for name, _ in pairs:
            if name in seen:
                raise _Refused(f"the member {name!r} appears twice in one object; send each name once", name)
            seen.add(name)
    return members


def _integer(text: str) -> int:
    # Counted before converting: int() refuses more than 4,300 digits (and each digit costs time).
    value = int(text) if len(text.lstrip("-")) <= 16 else MAX_EXACT_INT + 1
    if abs(value) > MAX_EXACT_INT:
        # Not repeated: a long number may well be a phone number (and would be masked anyway).
        raise _Refused(
            f"an integer of {len(text.lstrip('-'))} digits is beyond +-(2^53 - 1), what JSON numbers carry "
            "exactly (I-JSON); send it as a string"
        )
    return value


def _number(text: str) -> float:
    value = float(text)
    try:
        exact = Decimal(text) == Decimal(repr(value))
    except InvalidOperation:  # pragma: no cover - the scanner passes only JSON number syntax
        exact = False
    if not exact:
        raise _Refused(
            f"a number written with {len(text)} characters cannot be kept exactly as written (out of range or "
            "more precise than a double); send it as a string"
        )
    return value


def _constant(text: str) -> Any:
    raise _Refused(f"{text} is not a JSON value")


_DECODER = json.JSONDecoder(
    object_pairs_hook=_members, parse_int=_integer, parse_float=_number, parse_constant=_constant
)


def _depth_exceeds(document: Any, limit: int) -> bool:
    """Whether any value is nested deeper than ``limit`` (no paths built: this runs on every request)."""
    level = [document]
    depth = 1
    while level:
        nested: list[Any] = []
        for value in level:
            if isinstance(value, dict):
                nested.extend(v for v in value.values() if isinstance(v, dict | list))
            elif isinstance(value, list):
                nested.extend(v for v in value if isinstance(v, dict | list))
        if nested and depth >= limit:
            return True
        level = nested
        depth += 1
    return False


def _strings_colons(document: Any) -> int:
    """How many ``:`` the strings (member names and values) of ``document`` hold, decoded."""
    count = 0
    stack = [document]
    while stack:
        value = stack.pop()
        if type(value) is dict:
            for name, member in value.items():
                count += name.count(":")
                stack.append(member)
        elif type(value) is list:
            stack.extend(value)
        elif type(value) is str:
            count += value.count(":")
    return count


#: What orjson reads exactly as written, always (bool before int: type() is exact).
_PLAIN = frozenset({str, bool, type(None)})


def plain_members(value: Any, depth: int = 1) -> int | None:
    """How many object members ``value`` (at nesting level ``depth``) holds, when orjson's reading of it is
    provably as written: no float (its text is needed to tell whether it is exact), no integer beyond
    :data:`MAX_EXACT_INT` (orjson reads those past 64 bits as floats, which this finds too), nothing nested
    deeper than :data:`MAX_DEPTH`. None when that is not proven."""
    kind = type(value)
    if kind is not dict and kind is not list:
        plain = kind is not float and (kind is not int or -MAX_EXACT_INT <= value <= MAX_EXACT_INT)
        return 0 if plain else None
    members = 0
    level = [value]
    while level:
        nested = []
        for container in level:
            if type(container) is dict:
                members += len(container)
                values = container.values()
            else:
                values = container
            for item in values:
                kind = type(item)
                if kind in _PLAIN:
                    continue
                if kind is int:
                    if not -MAX_EXACT_INT <= item <= MAX_EXACT_INT:
                        return None
                elif kind is dict or kind is list:
                    nested.append(item)
                else:  # a float
                    return None
        if nested and depth >= MAX_DEPTH:
            return None
        level = nested
        depth += 1
    return members


def no_member_lost(document: Any, body: bytes, members: int) -> bool:
    """Whether ``body`` had no member name twice in one object, given that orjson's reading ``document``
    holds ``members`` members.

    Each member of an object as written has one ``:`` after its name, so the ``:`` bytes of ``body`` are the
    members as written plus those inside strings. orjson keeps one member per name, so ``body`` had a
    duplicate exactly when the members orjson kept are fewer than the ``:`` bytes outside strings. With no
    ``\\u`` escape in ``body`` every ``:`` of a decoded string is one of its bytes, so those inside strings
    are counted exactly; with escapes, only "as many ``:`` bytes as members" proves it (an escaped colon
    would be counted as a literal one)."""
    colons = body.count(b":")
    if colons == members:
        return True
    return b"\\u" not in body and colons - _strings_colons(document) == members


def _exact(document: Any, body: bytes) -> bool:
    """Whether ``document`` (orjson's reading of ``body``) is provably what the second pass would return,
    refusing nothing (:func:`plain_members` and :func:`no_member_lost`)."""
    members = plain_members(document)
    return members is not None and no_member_lost(document, body, members)


def load(body: bytes, what: str = "the request body") -> Any:
    """orjson's reading of ``body`` (not yet proven exact: :func:`parse_document` is the whole check), or
    :class:`MalformedRequest` when it is not JSON. ``_NOT_READ`` when orjson refused what the second pass
    may still read (a number out of a double's range, nesting past orjson's bound)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "UTF-8" in exc.msg:
            raise MalformedRequest(f"{what} is not valid UTF-8 (JSON is UTF-8 text)") from None
        if not ("infinity" in exc.msg or "depth" in exc.msg):
            raise MalformedRequest(
                f"{what} is not valid JSON ({exc.msg}, line {exc.lineno} column {exc.colno})"
            ) from None
        return NOT_READ


#: What :func:`load` answers for JSON that orjson cannot read (the second pass names what is wrong).
NOT_READ = object()


def _too_deep(document: Any) -> str | None:
    """The path (``state.a[0]``) of the first value nested deeper than :data:`MAX_DEPTH`, if any."""
    if not _depth_exceeds(document, MAX_DEPTH):
        return None
    stack: list[tuple[Any, int, str]] = [(document, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict):
            children = [(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()]
        elif isinstance(value, list):
            # Array positions are not named ("a[]", not "a[0][0][0]..."): a chain of them reads as a number.
            children = [(v, path if path.endswith("[]") else f"{path}[]") for v in value]
        else:
            continue
        if depth > MAX_DEPTH:
            return path or "the document"
        stack.extend((v, depth + 1, p) for v, p in children if isinstance(v, dict | list))
    return None


def parse_document(body: bytes, what: str = "the request body", loaded: Any = None) -> Any:
    """The JSON document in ``body``, or :class:`MalformedRequest` (not JSON at all) or
    :class:`InvalidInput` (JSON, but not what the service can keep exactly), each naming what is wrong.
    ``loaded``: what :func:`load` already answered for ``body`` (it is not read twice)."""
    fast = load(body, what) if loaded is None else loaded
    if fast is not NOT_READ and _exact(fast, body):
        return fast
    path: str | None = None
    try:
        document = _DECODER.decode(body.decode())
    except _Refused as exc:
        raise InvalidInput(f"{what}: {exc.detail}", field=exc.member or "body") from None
    except (RecursionError, ValueError):
        # The standard scanner gives up past about 1,000 levels (RecursionError); orjson past 1,024.
        path = "the document"
    else:
        # No value can be nested deeper than there are brackets: most bodies need no walk at all.
        if body.count(b"{") + body.count(b"[") > MAX_DEPTH:
            path = _too_deep(document)
    if path is not None:
        path = path if len(path) <= 60 else path[:57] + "..."
        raise InvalidInput(
            f"{what}: {path} is nested more than {MAX_DEPTH} levels deep; flatten it",
            field="body" if path == "the document" else path,
        )
    return document
