"""``caller-memory platform put|get|delete``: the same use case as the HTTP API, the secret never printed,
every change audited as made by the command line."""

from __future__ import annotations

import base64
import json
import secrets
from pathlib import Path

from caller_memory.service.storage.sqlite.store import SQLiteStore

from tests.test_cli import CONFIG, run_cli

SECRET = "retell-key-" + secrets.token_hex(8)
KEY_ENV = {"CALLER_MEMORY_SECRET_KEY": base64.b64encode(secrets.token_bytes(32)).decode()}


async def test_connections_are_managed_from_the_command_line_and_audited(tmp_path: Path) -> None:
    config = tmp_path / "cheese-shop.json"
    config.write_text(json.dumps(CONFIG))
    assert run_cli(tmp_path, "project", "apply", str(config)).returncode == 0
    body = tmp_path / "retell.json"
    body.write_text(json.dumps({"secret": SECRET, "state_map": {"customer_name": "caller_name"}}))
    put = run_cli(tmp_path, "platform", "put", "cheese-shop", "retell", str(body), env=KEY_ENV)
    assert put.returncode == 0, put.stderr
    shown = json.loads(put.stdout)
    assert shown["secret_set"] is True and shown["state_map"] == {"customer_name": "caller_name"}
    got = run_cli(tmp_path, "platform", "get", "cheese-shop", "retell", env=KEY_ENV)
    assert got.returncode == 0 and json.loads(got.stdout) == shown
    body.write_text(json.dumps({"channel": "sip"}))  # keeps the secret
    again = run_cli(tmp_path, "platform", "put", "cheese-shop", "retell", str(body), env=KEY_ENV)
    assert again.returncode == 0 and json.loads(again.stdout)["secret_set"] is True
    for output in (put, got, again):
        assert SECRET not in output.stdout + output.stderr

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"secret": SECRET, "state_map": {"x": "mood"}}))
    refused = run_cli(tmp_path, "platform", "put", "cheese-shop", "retell", str(bad), env=KEY_ENV)
    assert refused.returncode != 0 and "state_map.x" in refused.stderr and SECRET not in refused.stderr
    bad.write_text(json.dumps({"secret": SECRET, "colour": "blue"}))
    refused = run_cli(tmp_path, "platform", "put", "cheese-shop", "retell", str(bad), env=KEY_ENV)
    assert refused.returncode != 0 and "colour" in refused.stderr and SECRET not in refused.stderr
    unknown = run_cli(tmp_path, "platform", "get", "cheese-shop", "twilio", env=KEY_ENV)
    assert unknown.returncode != 0 and "telnyx" in unknown.stderr

    minted = run_cli(tmp_path, "token", "create", "cheese-shop", "--role", "platform", "--label", "retell")
    assert minted.returncode == 0, minted.stderr
    assert json.loads(minted.stdout)["role"] == "platform"

    deleted = run_cli(tmp_path, "platform", "delete", "cheese-shop", "retell", env=KEY_ENV)
    assert deleted.returncode == 0, deleted.stderr
    gone = run_cli(tmp_path, "platform", "get", "cheese-shop", "retell", env=KEY_ENV)
    assert gone.returncode != 0 and "no retell connection" in gone.stderr

    store = SQLiteStore.from_url(f"sqlite:///{tmp_path}/cli.db")
    await store.open()
    try:
        records = await store.list_audit("cheese-shop", 10, None)
    finally:
        await store.close()
    assert [(r.action, r.actor) for r in reversed(records) if r.action.startswith("platform.")] == [
        ("platform.connected", "cli"),
        ("platform.updated", "cli"),
        ("platform.disconnected", "cli"),
    ]
    assert ("token.created", "cli") in [(r.action, r.actor) for r in records]
    assert SECRET not in json.dumps([r.details for r in records])
