"""The archive of ended conversations through a real server (SPEC sections 11 and 14), on every backend: one
JSON Lines object per conversation in a hive-style layout that DuckDB reads in one line, written once (a
replayed or late end does not write it again), erased with its caller (counted in the receipt), deleted by
the sweep after archive_retention; and on an S3 API (a real moto server process on loopback)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import duckdb
import obstore
import orjson
import pytest
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.store.transcripts import ConversationKey
from caller_memory.service.http.app_keys import SERVICES
from obstore.store import S3Store

from tests.conftest import OPERATOR_TOKEN, Api, running_api
from tests.http.test_api import CALLER
from tests.support.service_process import free_port

PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
OTHER_CALLER = "+14155550177"
CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name"], "retention": "P30D", "default_region": "GB"},
        "conversation": {"enabled": True, "archive": True, "archive_retention": "P7D"},
    }
}


@pytest.fixture
async def api(store_url: str, clock: FakeClock, tmp_path: Path) -> AsyncIterator[Api]:
    async with running_api(
        store_url, clock, store_timeout=5.0, archive_url=f"file://{tmp_path}/archive"
    ) as api:
        reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=CONFIG)
        assert reply.status in (200, 201), reply.body
        yield api


async def call(
    api: Api, conversation_id: str, caller: str = CALLER, *, messages: bool = True, **end: Any
) -> dict[str, Any]:
    """A call of two turns, then its end (``messages=False``: the end alone, e.g. its retry)."""
    turns = [
        {"role": "user", "content": "I'd like to book a table", "turn_id": 1},
        {"role": "assistant", "content": "For when?", "turn_id": 1},
        {"role": "user", "content": f"Tomorrow, call me back on {caller}", "turn_id": 2},
    ]
    document = {"caller": caller, "channel": "voice", "messages": turns}
    path = f"{BASE}/conversations/{conversation_id}"
    if messages:
        assert (await api.call("POST", path + "/messages", token=OPERATOR_TOKEN, json=document)).status == 200
    body = {"caller": caller, "state": {"caller_name": "Ada"}, "end_reason": "completed", **end}
    reply = await api.call("POST", path + "/end", token=OPERATOR_TOKEN, json=body)
    assert reply.status == 200, reply.body
    result: dict[str, Any] = reply.body
    return result


def archived(root: Path) -> list[Path]:
    return sorted(root.glob("project=*/date=*/*.jsonl"))


async def test_an_ended_conversation_is_archived_once_and_duckdb_reads_it(api: Api, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    await call(api, "call-1")
    [path] = archived(root)
    day = time.strftime("%Y-%m-%d", time.gmtime(api.clock.now_ms() / 1000))
    assert path.parent.name == f"date={day}" and path.parent.parent.name == f"project={PROJECT}"
    record = orjson.loads(path.read_bytes())
    assert record["conversation_id"] == "call-1" and record["ended_by"] == "explicit"
    assert record["persisted"] == ["caller_name"] and record["started_at"].endswith(":00:00Z")
    assert [m["content"][:9] for m in record["messages"]] == ["I'd like ", "For when?", "Tomorrow,"]
    assert all(0 <= m["timestamp"] < 3_600_000 for m in record["messages"])  # offsets from the start
    text = path.read_text()
    assert CALLER.lstrip("+") not in text and CALLER[-9:] not in text  # the spoken number is masked
    services = api.app[SERVICES]
    header, _ = await services.store.read_conversation(ConversationKey(PROJECT, "call-1"), api.clock.now_ms())
    assert header is not None and header.subject and header.subject not in text  # no pseudonym either
    # The DuckDB one-liner of docs/conversations.md, over the whole archive.
    relation = duckdb.sql(
        f"SELECT project, conversation_id, len(messages) FROM read_json('{root}/project=*/date=*/*.jsonl', "
        "hive_partitioning = true)"
    )
    assert relation is not None  # a SELECT has a relation
    rows = relation.fetchall()
    assert rows == [(PROJECT, "call-1", 3)]
    written = path.stat().st_mtime_ns
    await call(api, "call-1", messages=False)  # a replay of the same end: nothing written again
    assert archived(root) == [path] and path.stat().st_mtime_ns == written


async def test_the_service_ends_archive_too_and_a_late_end_does_not_rewrite(api: Api, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    document = {
        "caller": CALLER,
        "channel": "voice",
        "messages": [{"role": "user", "content": "Hi", "turn_id": 1}],
    }
    reply = await api.call(
        "POST", f"{BASE}/conversations/drop-1/messages", token=OPERATOR_TOKEN, json=document
    )
    assert reply.status == 200
    api.clock.advance(31 * 60)  # past end_after_inactivity (PT30M)
    assert (await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)).status == 200
    [path] = archived(root)
    record = orjson.loads(path.read_bytes())
    assert record["conversation_id"] == "drop-1" and record["ended_by"] == "inactivity"
    before = path.read_bytes()
    late = await api.call(
        "POST", f"{BASE}/conversations/drop-1/end", token=OPERATOR_TOKEN, json={"caller": CALLER, "state": {}}
    )
    assert late.status == 200 and late.body["late"] is True
    assert archived(root) == [path] and path.read_bytes() == before


async def test_erasure_deletes_the_callers_archived_conversations_and_counts_them(
    api: Api, tmp_path: Path
) -> None:
    root = tmp_path / "archive"
    await call(api, "call-1")
    await call(api, "call-2")
    await call(api, "other-1", caller=OTHER_CALLER)
    assert len(archived(root)) == 3
    erased = await api.call("DELETE", f"{BASE}/callers/{CALLER}", token=OPERATOR_TOKEN)
    assert erased.status == 200 and erased.body["removed"]["archived_conversations"] == 2
    [left] = archived(root)
    assert orjson.loads(left.read_bytes())["conversation_id"] == "other-1"
    again = await api.call("DELETE", f"{BASE}/callers/{CALLER}", token=OPERATOR_TOKEN)
    assert again.body["removed"]["archived_conversations"] == 0


async def test_the_sweep_deletes_days_past_archive_retention(api: Api, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    await call(api, "old-1")
    api.clock.advance(3 * 86400)
    await call(api, "newer-1", caller=OTHER_CALLER)
    assert len(archived(root)) == 2
    api.clock.advance(5 * 86400)  # old-1's day is past P7D, newer-1's is not
    swept = await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)
    assert swept.status == 200 and swept.body["removed"]["archived_conversations"] == 1, swept.body
    assert [orjson.loads(p.read_bytes())["conversation_id"] for p in archived(root)] == ["newer-1"]


async def test_a_project_without_archive_writes_nothing(
    store_url: str, clock: FakeClock, tmp_path: Path
) -> None:
    async with running_api(store_url, clock, archive_url=f"file://{tmp_path}/archive") as api:
        config = {"memory": {**CONFIG["memory"], "conversation": {"enabled": True}}}
        assert (
            await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=config)
        ).status == 201
        await call(api, "call-1")
        assert not (tmp_path / "archive").exists()


async def test_archive_retention_cannot_outlive_the_retention(api: Api) -> None:
    config = {"memory": {**CONFIG["memory"]}}
    config["memory"]["conversation"] = {"enabled": True, "archive": True, "archive_retention": "P31D"}
    reply = await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=config)
    assert reply.status == 422 and "archive_retention" in reply.body["detail"]


# An S3 API ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """A moto S3 server process on loopback (moto's standalone server): its endpoint URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "moto did not start"
            time.sleep(0.1)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("store_url", ["sqlite"], indirect=True)
async def test_the_archive_on_an_s3_api(
    s3: str, store_url: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "AWS_ENDPOINT_URL": s3,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }.items():
        monkeypatch.setenv(name, value)
    # The bucket is made with a plain S3 CreateBucket (moto takes it unsigned); the objects are looked at
    # with obstore, the service's own library, but on its own (a boto3 client in the test process would
    # make its heap, and so every later test's garbage collections, heavier).
    await asyncio.to_thread(
        lambda: urllib.request.urlopen(
            urllib.request.Request(f"{s3}/calls", method="PUT"), timeout=10
        ).close()
    )
    bucket = S3Store(
        "calls", endpoint=s3, region="us-east-1", access_key_id="test", secret_access_key="test",
        client_options={"allow_http": True},
    )  # fmt: skip

    def keys_in_bucket() -> list[str]:
        return sorted(o["path"] for batch in obstore.list(bucket) for o in batch)

    async with running_api(store_url, clock, archive_url="s3://calls/archive") as api:
        assert (
            await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=CONFIG)
        ).status == 201
        await call(api, "call-1")
        keys = keys_in_bucket()
        assert len(keys) == 1 and keys[0].startswith(f"archive/project={PROJECT}/date=")
        record = orjson.loads(bytes(obstore.get(bucket, keys[0]).bytes()))
        assert record["conversation_id"] == "call-1"
        erased = await api.call("DELETE", f"{BASE}/callers/{CALLER}", token=OPERATOR_TOKEN)
        assert erased.body["removed"]["archived_conversations"] == 1
        assert keys_in_bucket() == []


async def test_an_admins_deletion_of_a_transcript_deletes_its_archived_copy(api: Api, tmp_path: Path) -> None:
    root = tmp_path / "archive"
    await call(api, "call-1")
    await call(api, "call-2")
    assert len(archived(root)) == 2
    deleted = await api.call("DELETE", f"{BASE}/conversations/call-1", token=OPERATOR_TOKEN)
    assert deleted.status == 204
    [left] = archived(root)
    assert orjson.loads(left.read_bytes())["conversation_id"] == "call-2"
    # The caller's erasure later counts only what is left.
    erased = await api.call("DELETE", f"{BASE}/callers/{CALLER}", token=OPERATOR_TOKEN)
    assert erased.body["removed"]["archived_conversations"] == 1
