"""The command line, run as a real process against a real store."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from caller_memory.service.config import Settings, SettingsError
from caller_memory.service.domain.fields import StoredField
from caller_memory.service.domain.store import CallerRef
from caller_memory.service.storage.sqlite.store import SQLiteStore

from tests.conftest import PSEUDONYM_KEY
from tests.support.service_process import ServiceProcess, free_port

CONFIG = {
    "memory": {"repeat_caller": {"state_keys": ["caller_name"], "identifier_blacklist": ["+440000000000"]}}
}


def run_cli(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full_env = {
        **os.environ,
        "CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM_KEY.decode(),
        "CALLER_MEMORY_STORE": f"sqlite:///{tmp_path}/cli.db",
        **(env or {}),
    }
    return subprocess.run(
        [sys.executable, "-m", "caller_memory.service", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=tmp_path,
        timeout=30,
    )


def test_project_and_token_commands(tmp_path: Path) -> None:
    config = tmp_path / "cheese-shop.json"
    config.write_text(json.dumps(CONFIG))
    applied = run_cli(tmp_path, "project", "apply", str(config))
    assert applied.returncode == 0, applied.stderr
    document = json.loads(applied.stdout)
    assert document["memory"]["repeat_caller"]["state_keys"] == ["caller_name"]
    assert "+440000000000" not in applied.stdout + applied.stderr
    shown = run_cli(tmp_path, "project", "show", "cheese-shop")
    assert json.loads(shown.stdout) == document

    created = run_cli(tmp_path, "token", "create", "cheese-shop", "--role", "admin", "--label", "first admin")
    assert created.returncode == 0, created.stderr
    token = json.loads(created.stdout)
    assert token["role"] == "admin" and token["token"].startswith(f"cm_{token['token_id']}_")
    listed = json.loads(run_cli(tmp_path, "token", "list", "cheese-shop").stdout)
    assert [t["token_id"] for t in listed["tokens"]] == [token["token_id"]]
    assert token["token"] not in json.dumps(listed)
    revoked = run_cli(tmp_path, "token", "revoke", "cheese-shop", token["token_id"])
    assert revoked.returncode == 0
    assert json.loads(run_cli(tmp_path, "token", "list", "cheese-shop").stdout) == {"tokens": []}


def test_an_agent_token_may_name_its_agent(tmp_path: Path) -> None:
    config = tmp_path / "cheese-shop.json"
    config.write_text(json.dumps(CONFIG))
    assert run_cli(tmp_path, "project", "apply", str(config)).returncode == 0
    created = run_cli(tmp_path, "token", "create", "cheese-shop", "--role", "agent", "--agent", "billing")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["agent"] == "billing"
    refused = run_cli(tmp_path, "token", "create", "cheese-shop", "--role", "admin", "--agent", "billing")
    assert refused.returncode != 0 and "agent" in refused.stderr
    assert [
        t["agent"] for t in json.loads(run_cli(tmp_path, "token", "list", "cheese-shop").stdout)["tokens"]
    ] == ["billing"]


async def test_every_change_made_through_the_command_line_is_audited(tmp_path: Path) -> None:
    config = tmp_path / "cheese-shop.json"
    config.write_text(json.dumps(CONFIG))
    assert run_cli(tmp_path, "project", "apply", str(config)).returncode == 0
    assert run_cli(tmp_path, "project", "apply", str(config)).returncode == 0
    token = json.loads(run_cli(tmp_path, "token", "create", "cheese-shop", "--role", "agent").stdout)
    assert run_cli(tmp_path, "token", "revoke", "cheese-shop", token["token_id"]).returncode == 0
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path}/cli.db")
    await store.open()
    try:
        records = await store.list_audit("cheese-shop", 10, None)
    finally:
        await store.close()
    assert [(r.action, r.actor) for r in reversed(records)] == [
        ("project.created", "cli"),
        ("project.configured", "cli"),
        ("token.created", "cli"),
        ("token.revoked", "cli"),
    ]
    assert records[1].details["token_id"] == token["token_id"] and records[1].details["role"] == "agent"
    assert token["token"] not in json.dumps([r.details for r in records])


def test_a_command_run_in_the_wrong_folder_creates_no_database(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"CALLER_MEMORY_STORE": ""}  # the default: ./caller-memory.db in the working directory
    for command in (["project", "show", "shop"], ["token", "list", "shop"], ["sweep"]):
        result = run_cli(elsewhere, *command, env=env)
        assert result.returncode != 0 and "there is no SQLite store at" in result.stderr, result.stderr
        assert str(elsewhere / "caller-memory.db") in result.stderr and "--store" in result.stderr
    assert list(elsewhere.iterdir()) == []
    config = elsewhere / "shop.json"
    config.write_text(json.dumps(CONFIG))
    assert run_cli(elsewhere, "project", "apply", str(config), env=env).returncode == 0  # apply creates it
    assert run_cli(elsewhere, "project", "show", "shop", env=env).returncode == 0


def test_a_configuration_file_with_a_duplicate_member_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "shop.json"
    config.write_text('{"memory": {"repeat_caller": {"state_keys": ["a"], "state_keys": ["b"]}}}')
    result = run_cli(tmp_path, "project", "apply", str(config))
    assert result.returncode == 1 and "'state_keys' appears twice" in result.stderr
    assert "SPEC" not in run_cli(tmp_path, "project", "apply", "--help").stdout


def test_cli_errors_are_clear(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(
        json.dumps(
            {
                "memory": {
                    "repeat_caller": {"retention": "P1D", "state_keys": ["a"], "field_ttls": {"a": "P2D"}}
                }
            }
        )
    )
    result = run_cli(tmp_path, "project", "apply", str(bad))
    assert result.returncode == 1 and "memory.repeat_caller.field_ttls.a" in result.stderr
    broken = tmp_path / "broken.json"
    broken.write_text("{nope")
    assert "not valid JSON" in run_cli(tmp_path, "project", "apply", str(broken)).stderr
    assert "cannot read" in run_cli(tmp_path, "project", "apply", str(tmp_path / "missing.json")).stderr
    missing = run_cli(tmp_path, "token", "create", "ghost", "--role", "agent")
    assert missing.returncode == 1 and "project 'ghost' not found" in missing.stderr
    no_key = run_cli(tmp_path, "project", "show", "x", env={"CALLER_MEMORY_PSEUDONYM_KEY": ""})
    assert no_key.returncode == 2 and "CALLER_MEMORY_PSEUDONYM_KEY" in no_key.stderr
    wrong_role = run_cli(tmp_path, "token", "create", "x", "--role", "root")
    assert wrong_role.returncode == 2 and "invalid choice" in wrong_role.stderr
    bad_store = run_cli(tmp_path, "project", "show", "x", env={"CALLER_MEMORY_STORE": "mongodb://x"})
    assert bad_store.returncode != 0 and "unsupported store URL" in bad_store.stderr


def http(method: str, url: str, token: str, body: Any = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Authorization": f"Bearer {token}"})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_serve_runs_the_service_and_logs_no_numbers(tmp_path: Path) -> None:
    op = "op-token-for-the-serve-test"
    # No store given: the default, a SQLite file in the working directory.
    service = ServiceProcess(None, tmp_path, env={"CALLER_MEMORY_OPERATOR_TOKEN": op})
    with service:
        base = service.url
        assert http("PUT", f"{base}/v1/projects/shop", op, CONFIG)[0] == 201
        status, body = http(
            "PATCH", f"{base}/v1/projects/shop/callers/+14155550100/memory", op, {"caller_name": "Ada"}
        )
        assert status == 200 and body["fields"] == {"caller_name": "Ada"}
        assert http("GET", f"{base}/v1/projects/shop/callers/+1415555010099999/memory", op)[0] == 422
        assert (tmp_path / "caller-memory.db").exists()
    output = service.log  # all of it: the process was stopped with SIGINT on leaving the block
    assert service.proc.returncode == 0, output
    assert "listening on http://127.0.0.1" in output
    assert "PATCH /v1/projects/{project}/callers/{identifier}/memory 200" in output
    assert "4155550100" not in output


@pytest.mark.parametrize("key", ["", "short"])
def test_serve_refuses_to_start_without_a_pseudonym_key(tmp_path: Path, key: str) -> None:
    result = run_cli(tmp_path, "serve", "--port", str(free_port()), env={"CALLER_MEMORY_PSEUDONYM_KEY": key})
    assert result.returncode == 2 and "CALLER_MEMORY_PSEUDONYM_KEY" in result.stderr


def test_sweep_command(tmp_path: Path) -> None:
    config = tmp_path / "shop.json"
    config.write_text(
        json.dumps({"memory": {"repeat_caller": {"state_keys": ["a"], "field_ttls": {"a": "PT1S"}}}})
    )
    assert run_cli(tmp_path, "project", "apply", str(config)).returncode == 0

    async def write_expired_field() -> None:
        store = SQLiteStore(tmp_path / "cli.db")
        await store.open()
        long_ago = time.time_ns() // 1_000_000 - 60_000
        stale = StoredField(value=b"1", expires_at=long_ago + 1000, written_at=long_ago)
        await store.patch_fields(CallerRef("shop", "a" * 32), {"a": stale}, [], long_ago)
        await store.close()

    asyncio.run(write_expired_field())
    first = run_cli(tmp_path, "sweep")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    assert (
        report["complete"] is True and report["removed"]["fields"] == 1 and report["removed"]["callers"] == 1
    )
    assert json.loads(run_cli(tmp_path, "sweep").stdout)["removed"]["fields"] == 0


def test_cache_times_and_workers_come_from_the_environment() -> None:
    key = {"CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM_KEY.decode()}
    defaults = Settings.from_env(key)
    assert (defaults.config_cache_seconds, defaults.token_cache_seconds, defaults.workers) == (2.0, 5.0, 1)
    settings = Settings.from_env(
        key
        | {
            "CALLER_MEMORY_CONFIG_CACHE_SECONDS": "0.5",
            "CALLER_MEMORY_TOKEN_CACHE_SECONDS": "0",
            "CALLER_MEMORY_WORKERS": " 4 ",
        }
    )
    assert (settings.config_cache_seconds, settings.token_cache_seconds, settings.workers) == (0.5, 0.0, 4)
    assert Settings.from_env(key | {"CALLER_MEMORY_WORKERS": "4"}, workers=2).workers == 2  # --workers wins
    # ... even over a value that would be refused on its own.
    assert Settings.from_env(key | {"CALLER_MEMORY_WORKERS": "abc"}, workers=1).workers == 1
    with pytest.raises(SettingsError, match="CALLER_MEMORY_STORE_TIMEOUT must be more than 0 seconds"):
        Settings.from_env(key | {"CALLER_MEMORY_STORE_TIMEOUT": "0"})
    for name in ("CALLER_MEMORY_CONFIG_CACHE_SECONDS", "CALLER_MEMORY_TOKEN_CACHE_SECONDS"):
        for bad in ("-1", "inf", "nan", "soon"):
            with pytest.raises(SettingsError, match=name):
                Settings.from_env(key | {name: bad})
    for bad in ("0", "65", "+2", "1_0", "٣"):
        with pytest.raises(SettingsError, match="CALLER_MEMORY_WORKERS must be a whole number from 1 to 64"):
            Settings.from_env(key | {"CALLER_MEMORY_WORKERS": bad})


def test_decimal_times_for_a_rolling_upgrade_come_from_the_environment() -> None:
    key = {"CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM_KEY.decode()}
    assert Settings.from_env(key).redis_decimal_times is False
    assert Settings.from_env(key | {"CALLER_MEMORY_REDIS_DECIMAL_TIMES": "1"}).redis_decimal_times is True
    with pytest.raises(SettingsError, match="CALLER_MEMORY_REDIS_DECIMAL_TIMES must be 1 or 0"):
        Settings.from_env(key | {"CALLER_MEMORY_REDIS_DECIMAL_TIMES": "decimal"})


def test_workers_setting_does_not_concern_management_commands(tmp_path: Path) -> None:
    # CALLER_MEMORY_WORKERS=2 with the SQLite store refuses `serve`, not the commands that manage the store.
    config = tmp_path / "shop.json"
    config.write_text(json.dumps(CONFIG))
    assert (
        run_cli(tmp_path, "project", "apply", str(config), env={"CALLER_MEMORY_WORKERS": "2"}).returncode == 0
    )
    shown = run_cli(tmp_path, "project", "show", "ghost", env={"CALLER_MEMORY_WORKERS": "2"})
    assert shown.returncode == 1 and "project 'ghost' not found" in shown.stderr


def test_the_command_says_its_version_the_sdk_gave_it(tmp_path: Path) -> None:
    namespace: dict[str, str] = {}
    exec((Path(__file__).resolve().parents[1] / "sdk" / "_version.py").read_text(), namespace)
    result = run_cli(tmp_path, "--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"caller-memory {namespace['__version__']}"
