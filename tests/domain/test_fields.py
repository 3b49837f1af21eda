"""Stored fields without a store: liveness under the current configuration, strong ETags, and the entity-tag
lists of If-Match / If-None-Match (a malformed header is an error, never a precondition that silently fails)."""

from __future__ import annotations

import re

import pytest
from caller_memory.service.domain.errors import MalformedRequest
from caller_memory.service.domain.fields import (
    StoredField,
    WriteCondition,
    base36,
    compute_etag,
    effective_expiry,
    entity_tags,
    live_fields,
)
from hypothesis import given
from hypothesis import strategies as st

NOW = 1_800_000_000_000


def stored(value: bytes = b'"Ada"', *, expires_in: int = 60_000, written_ago: int = 0) -> StoredField:
    return StoredField(value=value, expires_at=NOW + expires_in, written_at=NOW - written_ago)


@pytest.mark.parametrize(
    ("header", "tags"),
    [
        ("*", ("*",)),
        ("  *  ", ("*",)),
        ('"abc"', ('"abc"',)),
        ('W/"abc"', ('W/"abc"',)),
        ('"a", W/"b" ,"c"', ('"a"', 'W/"b"', '"c"')),
        ('""', ('""',)),
        ('"' + "x" * 64 + '"', ('"' + "x" * 64 + '"',)),
        (", ".join(['"t"'] * 16), ('"t"',) * 16),
    ],
)
def test_entity_tag_lists(header: str, tags: tuple[str, ...]) -> None:
    assert entity_tags(header, "If-Match") == tags


@pytest.mark.parametrize(
    "header",
    [
        "",
        "abc",
        '"a" "b"',
        '"a",',
        '"a", *',
        'w/"a"',
        '"a"b"',
        '"' + "x" * 65 + '"',
        '"é"',
        ", ".join(['"t"'] * 17),
    ],
)
def test_malformed_entity_tag_lists_are_400_naming_the_header(header: str) -> None:
    with pytest.raises(MalformedRequest) as refused:
        entity_tags(header, "If-None-Match")
    assert refused.value.status == 400 and refused.value.detail.startswith("If-None-Match: ")


def test_the_etag_covers_names_values_and_expiries_in_any_order() -> None:
    a, b = stored(b'"Ada"'), stored(b"1", expires_in=30_000)
    etag = compute_etag({"a": a, "b": b})
    assert re.fullmatch(r'"[0-9a-f]{20}"', etag)
    assert compute_etag({"b": b, "a": a}) == etag
    assert compute_etag({"a": stored(b'"Bo"'), "b": b}) != etag  # a value
    assert compute_etag({"a": stored(expires_in=60_001), "b": b}) != etag  # an expiry
    assert compute_etag({"c": a, "b": b}) != etag  # a name
    assert compute_etag({}) != etag and compute_etag({}) == compute_etag({})
    # A field read in its packed form has the ETag it had when written.
    assert compute_etag({"a": StoredField.unpack(a.packed()), "b": b}) == etag


def test_the_packed_form_round_trips() -> None:
    field = stored(b'{"a": "x|y"}')
    packed = field.packed()
    assert packed == b'~%s|%s|{"a": "x|y"}' % (
        base36(field.expires_at),
        base36(field.written_at),
    )
    assert int(packed[1:].split(b"|")[0], 36) == field.expires_at
    assert StoredField.unpack(packed) == field
    # Nine bytes shorter than the decimal form of earlier releases for times of this century.
    assert len(packed) == len(b'%d|%d|{"a": "x|y"}' % (field.expires_at, field.written_at)) - 9


def test_a_field_packed_by_an_earlier_release_is_read_and_keeps_its_etag() -> None:
    old = b'1800000060000|1799999400000|"Ada"'
    field = StoredField.unpack(old)
    assert (field.value, field.expires_at, field.written_at) == (b'"Ada"', NOW + 60_000, NOW - 600_000)
    assert field.packed() == old  # read in its form: the ETag a client was given before the upgrade holds
    assert compute_etag({"a": field}) != compute_etag(
        {"a": StoredField(b'"Ada"', NOW + 60_000, NOW - 600_000)}
    )


@given(
    st.integers(min_value=-(2**53), max_value=2**53),
    st.integers(min_value=-(2**53), max_value=2**53),
    st.binary(max_size=40),
)
def test_any_time_and_value_round_trip_in_the_packed_form(expires: int, written: int, value: bytes) -> None:
    field = StoredField(value, expires, written)
    assert StoredField.unpack(field.packed()) == field
    assert int(base36(expires), 36) == expires


def test_a_shortened_ttl_or_a_dropped_key_applies_at_once() -> None:
    field = stored(expires_in=3_600_000, written_ago=600_000)  # written 10 min ago for 1 h from now
    assert effective_expiry("a", field, {"a": 86_400_000}) == field.expires_at
    assert effective_expiry("a", field, {"a": 300_000}) == NOW - 300_000  # now 5 min: already gone
    assert effective_expiry("a", field, {}) == field.written_at  # dropped from state_keys
    fields = {"kept": stored(), "short": field, "dropped": stored()}
    ttl = {"kept": 3_600_000, "short": 300_000}
    assert set(live_fields(fields, ttl, NOW)) == {"kept"}
    assert live_fields({"a": stored(expires_in=0)}, {"a": 3_600_000}, NOW) == {}  # expiry is exclusive


def test_write_conditions() -> None:
    live = {"a": stored()}
    etag = compute_etag(live)
    assert WriteCondition.from_header(etag, {"a": 1}).holds(live)
    assert WriteCondition.from_header(f'"0000", {etag}', {"a": 1}).holds(live)
    assert not WriteCondition.from_header('"0000"', {"a": 1}).holds(live)
    assert not WriteCondition.from_header(f"W/{etag}", {"a": 1}).holds(live)  # compared strongly
    anything = WriteCondition.from_header("*", {"a": 1})
    assert anything.any_existing and anything.holds(live) and not anything.holds({})
    with pytest.raises(MalformedRequest, match="If-Match"):
        WriteCondition.from_header("nope", {})
