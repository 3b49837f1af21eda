"""The use cases over the cheapest real store (a SQLite file), once per case, where the HTTP tests keep one
case per backend: a refused configuration, patch or credential is refused with the field it names and never
reaches the store; the project cache follows the injected clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from caller_memory.service.domain.audit import AuditLog
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.errors import InvalidConfiguration, InvalidInput, Unauthenticated
from caller_memory.service.domain.identifiers import Pseudonymizer
from caller_memory.service.domain.memory import MemoryService
from caller_memory.service.domain.registry import ProjectRegistry
from caller_memory.service.domain.tokens import TokenService
from caller_memory.service.storage.sqlite.store import SQLiteStore

from tests.conftest import PSEUDONYM_KEY
from tests.domain.test_projects import INVALID_CONFIGURATIONS

CALLER = "+14155550100"
CONFIG = {
    "memory": {
        "repeat_caller": {
            "state_keys": ["caller_name", "booking_day", "verified"],
            "field_ttls": {"verified": "PT1H"},
            "identifier_blacklist": ["+440000000000"],
            "retention": "P30D",
            "default_region": "GB",
        }
    }
}


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path}/memory.db")
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def registry(store: SQLiteStore, clock: FakeClock, cache_seconds: float = 2.0) -> ProjectRegistry:
    return ProjectRegistry(store, Pseudonymizer(PSEUDONYM_KEY), clock, cache_seconds, AuditLog(store, clock))


@pytest.mark.parametrize(("repeat_caller", "field"), INVALID_CONFIGURATIONS)
async def test_a_refused_configuration_changes_nothing(
    store: SQLiteStore, clock: FakeClock, repeat_caller: dict[str, Any], field: str
) -> None:
    projects = registry(store, clock)
    await projects.apply("shop", CONFIG, actor="test")
    before = await store.get_project("shop")
    audited = len(await store.list_audit("shop", 10, None))
    with pytest.raises(InvalidConfiguration) as refused:
        await projects.apply("shop", {"memory": {"repeat_caller": repeat_caller}}, actor="test")
    assert refused.value.field == field
    assert await store.get_project("shop") == before
    assert len(await store.list_audit("shop", 10, None)) == audited  # nor audited
    assert (await projects.get("shop")).stored_bytes() == before  # nor cached


@pytest.mark.parametrize(
    ("patch", "field", "mentions"),
    [
        ({"favourite_colour": "blue"}, "favourite_colour", "state_keys"),
        ({"caller_name": "Ada", "not-a-name": 1}, "not-a-name", "field names"),
        ({"caller_name": "x" * 3000}, "caller_name", "limit is 2048"),
        ({"caller_name": "Ada", "secret": None}, "secret", "state_keys"),
        ({"caller_name": "Ada", "_" + "a" * 64: 1}, "_" + "a" * 64, "64 characters at most"),
        ({"caller_name": "Ada", "b\u00e9": 1}, "b\u00e9", "field names"),
        (["caller_name"], "body", "JSON object"),
        ("Ada", "body", "JSON object"),
    ],
)
@pytest.mark.parametrize("caller", [CALLER, "+440000000000"], ids=["caller", "blacklisted"])
async def test_a_refused_patch_changes_nothing(
    store: SQLiteStore, clock: FakeClock, caller: str, patch: Any, field: str, mentions: str
) -> None:
    project, _ = await registry(store, clock).apply("shop", CONFIG, actor="test")
    memory = MemoryService(store, Pseudonymizer(PSEUDONYM_KEY), clock, audit=AuditLog(store, clock))
    before = await memory.patch(project, CALLER, {"booking_day": "Monday"})
    with pytest.raises(InvalidInput) as refused:
        await memory.patch(project, caller, patch, if_match=before.etag)
    error = refused.value
    assert error.status == 422 and error.field == field and error.errors[0]["field"] == field
    assert mentions in error.detail, error.detail
    assert await memory.read(project, CALLER) == before


async def test_a_refused_field_deletion_changes_nothing(store: SQLiteStore, clock: FakeClock) -> None:
    project, _ = await registry(store, clock).apply("shop", CONFIG, actor="test")
    memory = MemoryService(store, Pseudonymizer(PSEUDONYM_KEY), clock, audit=AuditLog(store, clock))
    before = await memory.patch(project, CALLER, {"caller_name": "Ada"})
    with pytest.raises(InvalidInput, match="field names") as refused:
        await memory.delete_field(project, CALLER, "caller-name")
    assert refused.value.field == "field"
    assert await memory.read(project, CALLER) == before


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Bearer   ",
        "Basic dXNlcjpwYXNz",
        "Bearer nope",
        "Token abc",
        "Bearer cm_000000000000_wrongsecret",
        "Bearer cm_00000000000_short-id",
        "Bearer cm_000000000000_",
        "Bearer caf\u00e9",
        "Bearer a\tb",
    ],
)
async def test_missing_or_bad_credentials_are_refused(
    store: SQLiteStore, clock: FakeClock, authorization: str | None
) -> None:
    tokens = TokenService(store, clock, "operator-token-0123456789", 5.0, AuditLog(store, clock))
    await tokens.mint("shop", "agent", actor="test")  # a real token exists: none of these is it
    with pytest.raises(Unauthenticated) as refused:
        await tokens.authenticate(authorization, "203.0.113.9")
    assert refused.value.status == 401 and refused.value.detail


async def test_a_tampered_secret_is_refused_and_the_real_one_accepted(
    store: SQLiteStore, clock: FakeClock
) -> None:
    tokens = TokenService(store, clock, None, 5.0, AuditLog(store, clock))
    minted = await tokens.mint("shop", "agent", actor="test")
    tampered = minted.secret[:-1] + ("A" if minted.secret[-1] != "A" else "B")
    for cached in (True, False):  # from the cache, and as another process would read it
        if not cached:
            tokens = TokenService(store, clock, None, 5.0, AuditLog(store, clock))
        with pytest.raises(Unauthenticated):
            await tokens.authenticate(f"Bearer {tampered}")
        principal = await tokens.authenticate(f"Bearer {minted.secret}")
        assert (principal.project, principal.role, principal.token_id) == (
            "shop",
            "agent",
            minted.record.token_id,
        )


async def test_a_configuration_change_elsewhere_is_seen_within_the_cache_time(
    store: SQLiteStore, clock: FakeClock
) -> None:
    here, there = registry(store, clock), registry(store, clock)  # two processes
    await here.apply("shop", {"memory": {"repeat_caller": {"state_keys": ["a"]}}}, actor="test")
    assert (await there.get("shop")).state_keys == ["a"]
    clock.advance(1.0)
    await here.apply("shop", {"memory": {"repeat_caller": {"state_keys": ["a", "b"]}}}, actor="test")
    assert (await here.get("shop")).state_keys == ["a", "b"]  # at once where it was made
    clock.advance(0.9)  # 1.9 s after ``there`` read it
    assert (await there.get("shop")).state_keys == ["a"]
    clock.advance(0.1)
    assert (await there.get("shop")).state_keys == ["a", "b"]
    assert await there.find("ghost") is None
    await here.apply("ghost", {}, actor="test")
    assert await there.find("ghost") is not None  # a missing project is not cached: a new one is seen at once
