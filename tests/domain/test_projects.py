"""Project configuration, parsed and compiled without any I/O: every refusal names the offending field and
repeats no number. (The HTTP tests keep one refused configuration per backend, for the mapping to 422.)"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

import pytest
from caller_memory.service.domain.errors import InvalidConfiguration
from caller_memory.service.domain.identifiers import Pseudonymizer
from caller_memory.service.domain.projects import DEFAULT_RETENTION, compile_project, parse_config

from tests.conftest import PSEUDONYM_KEY

#: Refused ``memory.repeat_caller`` documents, and the field each refusal names.
INVALID_CONFIGURATIONS: list[tuple[dict[str, Any], str]] = [
    ({"state_keys": ["a"], "colour": "blue"}, "memory.repeat_caller.colour"),
    (
        {"state_keys": ["a"], "field_ttls": {"a": "P100D"}, "retention": "P90D"},
        "memory.repeat_caller.field_ttls.a",
    ),
    ({"state_keys": ["a"], "field_ttls": {"b": "PT1H"}}, "memory.repeat_caller.field_ttls.b"),
    (
        {"identifier_blacklist": ["+14155550100", "not a number"]},
        "memory.repeat_caller.identifier_blacklist[1]",
    ),
    ({"identifier_blacklist": ["07700 900123"]}, "memory.repeat_caller.identifier_blacklist[0]"),
    ({"identifier_blacklist": ["pseudonym:xyz"]}, "memory.repeat_caller.identifier_blacklist[0]"),
    ({"retention": "forever"}, "memory.repeat_caller.retention"),
    ({"retention": "90 days"}, "memory.repeat_caller.retention"),
    ({"retention": True}, "memory.repeat_caller.retention"),
    ({"retention": "12:00:00"}, "memory.repeat_caller.retention"),
    ({"retention": 1.5}, "memory.repeat_caller.retention"),
    ({"retention": "PT0.5S"}, "memory.repeat_caller.retention"),
    ({"retention": "-P1D"}, "memory.repeat_caller.retention"),
    ({"state_keys": ["ok", "not-ok"]}, "memory.repeat_caller.state_keys[1]"),
    ({"state_keys": ["a", "a"]}, "memory.repeat_caller.state_keys"),
    ({"default_region": "XX"}, "memory.repeat_caller.default_region"),
    (
        {"default_region": "\ufb01"},
        "memory.repeat_caller.default_region",
    ),  # the fi ligature: 'FI' once upper-cased
    ({"default_region": "\u017fe"}, "memory.repeat_caller.default_region"),  # long s: 'SE' once upper-cased
    ({"analytics_enabled": "maybe"}, "memory.repeat_caller.analytics_enabled"),
]


@pytest.mark.parametrize(("repeat_caller", "field"), INVALID_CONFIGURATIONS)
def test_an_invalid_configuration_is_refused_naming_the_field(
    repeat_caller: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidConfiguration) as refused:
        parse_config({"memory": {"repeat_caller": repeat_caller}})
    error = refused.value
    assert error.status == 422 and error.field == field
    assert field in error.detail, error.detail
    assert error.errors[0]["field"] == field and error.errors[0]["message"]
    assert "+1415" not in error.detail and "07700" not in error.detail


@pytest.mark.parametrize("document", [[1, 2], "memory", None, 3])
def test_a_configuration_is_a_json_object(document: Any) -> None:
    with pytest.raises(InvalidConfiguration, match="JSON object") as refused:
        parse_config(document)
    assert refused.value.field == "body"


def test_every_offending_field_is_listed_once() -> None:
    with pytest.raises(InvalidConfiguration) as refused:
        parse_config({"memory": {"repeat_caller": {"retention": "soon", "state_keys": ["-"], "x": 1}}})
    fields = [e["field"] for e in refused.value.errors]
    assert sorted(fields) == [
        "memory.repeat_caller.retention",
        "memory.repeat_caller.state_keys[0]",
        "memory.repeat_caller.x",
    ]
    assert all(f in refused.value.detail for f in fields)


def test_defaults_of_an_empty_configuration() -> None:
    rc = parse_config({}).memory.repeat_caller
    assert (rc.analytics_enabled, rc.state_keys, rc.identifier_blacklist) == (False, [], [])
    assert rc.retention == DEFAULT_RETENTION == timedelta(days=90)
    assert (rc.field_ttls, rc.default_region) == ({}, None)


@pytest.mark.parametrize(
    ("written", "seconds"),
    [("P90D", 90 * 86400), ("PT12H", 43200), ("P1W", 7 * 86400), ("PT1S", 1), (3600, 3600), ("PT1.0S", 1)],
)
def test_durations_in_both_documented_forms(written: str | int, seconds: int) -> None:
    rc = parse_config({"memory": {"repeat_caller": {"retention": written}}}).memory.repeat_caller
    assert rc.retention.total_seconds() == seconds


def test_a_region_is_read_in_any_case() -> None:
    rc = parse_config({"memory": {"repeat_caller": {"default_region": "gb"}}}).memory.repeat_caller
    assert rc.default_region == "GB"


def test_the_compiled_project_keeps_no_number_and_its_ttls_in_milliseconds() -> None:
    config = parse_config(
        {
            "memory": {
                "repeat_caller": {
                    "state_keys": ["name", "verified"],
                    "field_ttls": {"verified": "PT1H"},
                    "retention": "P30D",
                    "identifier_blacklist": ["020 7946 0000", "+442079460000"],
                    "default_region": "GB",
                }
            }
        }
    )
    pseudonymizer = Pseudonymizer(PSEUDONYM_KEY)
    project = compile_project("shop", config, pseudonymizer)
    assert project.ttl_ms == {"name": 30 * 86_400_000, "verified": 3_600_000}
    assert project.retention_ms == 30 * 86_400_000
    # Two forms of one number are one pseudonym; the document keeps only pseudonym entries.
    assert project.blacklist == {pseudonymizer.pseudonym("shop", "+442079460000")}
    stored = project.stored_document()["memory"]["repeat_caller"]["identifier_blacklist"]
    assert len(stored) == 1 and re.fullmatch(r"pseudonym:[0-9a-f]{32}", stored[0])
    assert b"7946" not in project.stored_bytes()
    # The stored document is accepted again as it is, and compiles to the same project.
    again = compile_project("shop", parse_config(project.stored_document()), pseudonymizer)
    assert again == project
    # Another project's pseudonym of the same number differs (pseudonyms cannot be linked across projects).
    assert compile_project("bakery", config, pseudonymizer).blacklist != project.blacklist
