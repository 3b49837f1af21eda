"""The two rollouts of an upgrade from a release that wrote memory fields with decimal times
(docs/operations.md, "Upgrades"): a process with CALLER_MEMORY_REDIS_DECIMAL_TIMES=1 writes the decimal form an
earlier release reads, one without it the base-36 form; beside each other on one Redis, each reads what the
other wrote, and an ETag given by one holds for a conditional write through the other."""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from caller_memory.service.domain.identifiers import Pseudonymizer, parse_identifier
from caller_memory.service.storage.redis import keys

from tests.conftest import OPERATOR_TOKEN, PSEUDONYM_KEY
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess

PROJECT = "upgrade-shop"
PHONE = "+14155550123"
PATH = f"/v1/projects/{PROJECT}/callers/{PHONE.replace('+', '%2B')}/memory"
DECIMAL = re.compile(rb"-?\d+\|-?\d+\|")
BASE36 = re.compile(rb"~-?[0-9a-z]+\|-?[0-9a-z]+\|")


def call(service: ServiceProcess, method: str, body: Any = None, **headers: str) -> tuple[int, Any, str]:
    connection = http.client.HTTPConnection("127.0.0.1", service.port, timeout=10)
    try:
        sent = {"Authorization": f"Bearer {OPERATOR_TOKEN}", "Content-Type": "application/json", **headers}
        path = f"/v1/projects/{PROJECT}" if method == "PUT" else PATH
        connection.request(method, path, None if body is None else json.dumps(body), sent)
        reply = connection.getresponse()
        return reply.status, json.loads(reply.read() or b"null"), reply.headers.get("ETag", "")
    finally:
        connection.close()


@pytest.fixture
def replicas(redis_server: RedisServer, tmp_path: Path) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    with redis_server.client() as client:
        client.flushall()
    with (
        ServiceProcess(redis_server.url, tmp_path, env={"CALLER_MEMORY_REDIS_DECIMAL_TIMES": "1"}) as rollout,
        ServiceProcess(redis_server.url, tmp_path) as upgraded,
    ):
        yield rollout, upgraded


def stored(redis_server: RedisServer) -> dict[bytes, bytes]:
    subject = Pseudonymizer(PSEUDONYM_KEY).pseudonym(PROJECT, parse_identifier(PHONE))
    with redis_server.client() as client:
        return client.hgetall(keys.memory_key(PROJECT, subject))


def test_each_form_is_written_by_its_setting_and_read_by_both(
    replicas: tuple[ServiceProcess, ServiceProcess], redis_server: RedisServer
) -> None:
    rollout, upgraded = replicas
    assert call(rollout, "PUT", {"memory": {"repeat_caller": {"state_keys": ["name", "cheese"]}}})[0] in (
        200,
        201,
    )
    assert call(rollout, "PATCH", {"name": "Ada"})[0] == 200
    assert call(upgraded, "PATCH", {"cheese": "gouda"})[0] == 200
    fields = stored(redis_server)
    assert DECIMAL.match(fields[b"name"]) and BASE36.match(fields[b"cheese"])

    answers = [call(service, "GET") for service in (rollout, upgraded)]
    assert [a[1]["fields"] for a in answers] == [{"name": "Ada", "cheese": "gouda"}] * 2
    assert answers[0][2] == answers[1][2]  # one ETag, whichever replica answers

    # The ETag one replica gave holds for a conditional write through the other.
    status, body, _ = call(rollout, "PATCH", {"cheese": "brie"}, **{"If-Match": answers[1][2]})
    assert status == 200 and body["fields"] == {"name": "Ada", "cheese": "brie"}
    assert DECIMAL.match(stored(redis_server)[b"cheese"])
    assert call(upgraded, "PATCH", {"name": "Bo"}, **{"If-Match": answers[1][2]})[0] == 412  # stale now
