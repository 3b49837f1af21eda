"""The I-JSON document parser (RFC 7493): what the service acknowledges is exactly what it was sent. No I/O;
tests/http/test_bad_input.py sends the same kinds of body to a real server on every backend."""

from __future__ import annotations

import json
from typing import Any

import pytest
from caller_memory.service.domain import documents
from caller_memory.service.domain.documents import MAX_DEPTH, MAX_EXACT_INT, parse_document
from caller_memory.service.domain.errors import InvalidInput, MalformedRequest
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"a": 1, "b": [true, null, "x"]}', {"a": 1, "b": [True, None, "x"]}),
        (b"[]", []),
        (b'"text"', "text"),
        (b"1.5", 1.5),
        (b"0.1", 0.1),
        (b"-0", 0),
        (b"1e300", 1e300),
        (str(MAX_EXACT_INT).encode(), MAX_EXACT_INT),
        (str(-MAX_EXACT_INT).encode(), -MAX_EXACT_INT),
        ('{"é": "☎"}'.encode(), {"é": "☎"}),
        (b'{"a": {"a": 1}}', {"a": {"a": 1}}),  # one name in two objects is no duplicate
    ],
)
def test_documents_kept_exactly_are_accepted(body: bytes, expected: Any) -> None:
    assert parse_document(body) == expected


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{nope",
        b'{"a": ',
        b"\xff\xfe",
        b'"\xed\xa0\x80"',
        b"[1,]",
        b"{'a': 1}",
        b"01",
        b"NaN",
        b"[Infinity]",
    ],
)
def test_what_is_not_json_is_malformed(body: bytes) -> None:
    with pytest.raises(MalformedRequest) as refused:
        parse_document(body)
    detail = refused.value.detail
    assert refused.value.status == 400
    # Bytes that are not UTF-8 are said to be so; anything else names where the JSON broke.
    assert "not valid UTF-8" in detail or ("not valid JSON" in detail and "line 1 column" in detail), detail


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        (b'{"a": 1, "a": 2}', "a", "appears twice"),
        (b'{"x": {"b": 1, "b": 1}}', "b", "appears twice"),
        (str(MAX_EXACT_INT + 1).encode(), "body", "2^53 - 1"),
        (b'{"n": -9007199254740992}', "body", "2^53 - 1"),
        (b"1e400", "body", "exactly"),
        (b"1e-400", "body", "exactly"),
        (b"0.10000000000000000001", "body", "exactly"),
        # Longer than int() converts (4,300 digits): still named as a number, not blamed on nesting.
        (b'{"a": ' + b"1" * 5000 + b"}", "body", "2^53 - 1"),
        (b"-" + b"9" * 20, "body", "2^53 - 1"),
    ],
)
def test_json_that_would_change_is_refused_naming_why(body: bytes, field: str, says: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_document(body, "the state")
    assert refused.value.status == 422 and refused.value.field == field
    assert refused.value.detail.startswith("the state: ") and says in refused.value.detail


def test_a_long_number_is_not_repeated_in_full() -> None:
    with pytest.raises(InvalidInput) as refused:
        parse_document(b"1" * 500)
    assert "11111" not in refused.value.detail and "500 digits" in refused.value.detail


def test_nesting_is_bounded_and_the_path_named() -> None:
    deepest = b'{"a": ' * (MAX_DEPTH - 1) + b"[1]" + b"}" * (MAX_DEPTH - 1)
    assert parse_document(deepest) is not None  # exactly MAX_DEPTH levels
    deeper = b'{"state": {"a": [' + b"[" * (MAX_DEPTH - 2) + b"]" * (MAX_DEPTH - 2) + b"]}}"
    with pytest.raises(InvalidInput, match=f"nested more than {MAX_DEPTH} levels") as refused:
        parse_document(deeper)
    assert refused.value.field == "state.a[]"  # positions are not named: a chain of them reads as a number
    for depth in (1_000, 1_025, 100_000):  # past the standard scanner's and orjson's own bounds
        with pytest.raises(InvalidInput, match="the document is nested") as refused:
            parse_document(b"[" * depth + b"]" * depth)
        assert refused.value.field == "body"


def test_a_long_path_is_cut() -> None:
    name = "n" * 40
    body = ('{"' + name + '": ' * 1).encode() * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1)
    with pytest.raises(InvalidInput) as refused:
        parse_document(body)
    field = refused.value.field
    assert field is not None and len(field) <= 60 and field.endswith("...")


# The fast path ------------------------------------------------------------------------------------------
# parse_document takes orjson's reading as it is when it can prove the stdlib's second pass would return the
# same (no float, no integer past 2^53 - 1, no deep nesting, and no duplicate member by counting ':' bytes).
# This compares it with the second pass itself on generated bodies built to break that proof: duplicate
# names, ':' in names and strings, written plainly and as \u escapes, floats, big integers, nesting.

_TEXT = st.lists(st.sampled_from(["a", "b", ":", "é", " ", "\\u003a", "\\u0061", '\\"']), max_size=4).map(
    "".join
)
_SCALAR = st.one_of(
    st.sampled_from(["null", "true", "false"]),
    st.integers(-(2**65), 2**65).map(str),
    st.sampled_from(["1.5", "0.1", "1e-400", "1e400", "-0", "2.0", "0.10000000000000000001"]),
    _TEXT.map(lambda t: f'"{t}"'),
)


def _object(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    members = st.lists(st.tuples(_TEXT, children), max_size=4)
    duplicate = st.booleans()
    return st.builds(
        lambda pairs, dup: (
            "{" + ",".join(f'"{k}":{v}' for k, v in (pairs + pairs[:1] if dup else pairs)) + "}"
        ),
        members,
        duplicate,
    )


_JSON = st.recursive(
    _SCALAR, lambda children: st.one_of(st.lists(children, max_size=4).map(lambda v: "[" + ",".join(v) + "]"),
                                       _object(children)),
    max_leaves=12,
)  # fmt: skip


def _second_pass(text: str) -> tuple[bool, Any]:
    """What the stdlib decoder with the I-JSON hooks makes of ``text``: (accepted, document)."""
    try:
        document = documents._DECODER.decode(text)
    except ValueError:  # refused by a hook (duplicate, big integer, inexact number), or too deep to scan
        return False, None
    return documents._too_deep(document) is None, document


@settings(max_examples=400, deadline=None)
@given(_JSON)
def test_the_fast_path_returns_what_the_second_pass_returns(text: str) -> None:
    try:
        json.loads(text)
    except ValueError:
        return  # not JSON at all: both paths answer from orjson's error
    accepted, document = _second_pass(text)
    if accepted:
        assert parse_document(text.encode()) == document
    else:
        with pytest.raises(InvalidInput):
            parse_document(text.encode())
