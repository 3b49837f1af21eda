"""The examples run as documented."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from caller_memory.service.domain.webhooks.secrets import signature_headers

ROOT = Path(__file__).resolve().parent.parent


def test_the_cheese_shop_agent_recognises_a_returning_caller_and_resumes_a_dropped_call() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "cheese_shop_agent.py"), "--demo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    first, rest = result.stdout.split("--- call-2")
    second, rest = rest.split("--- call-3")
    dropped, callback = rest.split("--- call-4")
    assert "May I have your name?" in first and "Booked: gouda on Friday" in first
    assert "Welcome back, Ada! Shall I book gouda for Friday again?" in second
    # The call that drops mid-booking is ended by the service; the callback is offered to finish it.
    assert "nobody ends call-3" in dropped and "the service ended call-3" in dropped
    assert "We were booking brie for Saturday when the line dropped. Shall I finish that?" in callback
    assert "Booked: brie on Saturday" in callback
    assert "07700" not in result.stdout + result.stderr


def run_against_nothing(stdin: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """The interactive agent against a URL where nothing listens, its outbox in ``tmp_path``."""
    with socket.socket() as probe:  # a port nothing listens on (bound, never listened to)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        return subprocess.run(
            [
                sys.executable,
                str(ROOT / "examples" / "cheese_shop_agent.py"),
                "--url",
                f"http://127.0.0.1:{port}",
                "--token",
                "cm_example_token",
            ],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "CALLER_MEMORY_OUTBOX": str(tmp_path / "outbox.db")},
        )


@pytest.mark.parametrize("stdin", ["", "My name is Ada.\nGouda on Friday\n"])
def test_the_interactive_agent_ends_the_call_on_end_of_input_and_explains_a_queued_end(
    stdin: str, tmp_path: Path
) -> None:
    result = run_against_nothing(stdin, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "EOFError" not in result.stderr
    out = result.stdout
    assert "memory unavailable" in out and "treating the caller as new" in out
    assert "could not be reached" in out and str(tmp_path / "outbox.db") in out and "delivered" in out
    assert "07700" not in out + result.stderr
    with contextlib.closing(sqlite3.connect(tmp_path / "outbox.db")) as db:  # the call was ended: kept
        kept = db.execute("SELECT kind, count(*) FROM outbox WHERE rejected IS NULL GROUP BY kind").fetchall()
    # The end, behind the transcript's messages (the greeting, and each line of the call).
    counts = dict(kept)
    assert counts["end"] == 1 and counts["messages"] >= 1, counts


# The webhook receiver (examples/webhook_receiver.py) and the README's webhook step ---------------------------

RECEIVER = ROOT / "examples" / "webhook_receiver.py"
#: A signing secret in the form the service makes (whsec_ and the base64 of 24 bytes).
SECRET = "whsec_" + base64.b64encode(b"example-receiver-secret!").decode()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_line(path: Path, pattern: str, timeout: float = 20.0) -> str:
    """The first line of the file at ``path`` that matches ``pattern``, once a process has written it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in path.read_text().splitlines() if path.exists() else []:
            if re.search(pattern, line):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r} in {path.name}: {path.read_text()!r}")


@contextlib.contextmanager
def running(
    command: list[str], out: Path, env: dict[str, str], cwd: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A process whose standard output and error go to ``out`` (and ``out`` with ``.err``), stopped after."""
    with out.open("wb") as stdout, out.with_suffix(".err").open("wb") as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=cwd)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def post(url: str, body: bytes, headers: dict[str, str], token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as refused:
        with refused:
            return refused.code, refused.read()


def signed(body: bytes, secret: str, at: datetime, delivery_id: str = "msg_example") -> dict[str, str]:
    """The headers the service sends (signed by its own signing function)."""
    return {"content-type": "application/json", **signature_headers(delivery_id, body, [secret], at)}


def test_the_webhook_receiver_prints_what_verifies_and_refuses_the_rest_with_401(tmp_path: Path) -> None:
    out = tmp_path / "receiver.out"
    env = {**os.environ, "WEBHOOK_SECRET": SECRET}
    with running([sys.executable, str(RECEIVER), "--port", "0"], out, env, tmp_path) as receiver:
        url = wait_for_line(out, r"listening on http://").rsplit(" ", 1)[1] + "webhooks"
        now = datetime.now(UTC)
        ended = orjson.dumps(
            {
                "type": "conversation.ended",
                "id": "msg_example",
                "timestamp": "2026-01-01T10:00:00Z",
                "data": {"conversation_id": "call-1", "ended_by": "explicit"},
            }
        )
        assert post(url, ended, signed(ended, SECRET, now))[0] == 204
        assert post(url, ended, signed(ended, SECRET, now))[0] == 204  # the same webhook-id again
        erased = orjson.dumps(
            {
                "type": "caller.erased",
                "id": "msg_erased",
                "timestamp": "2026-01-01T11:00:00Z",
                "data": {"receipt_id": "0" * 32, "conversation_ids": ["call-1", "call-2"]},
            }
        )
        assert post(url, erased, signed(erased, SECRET, now, "msg_erased"))[0] == 204
        other = "whsec_" + base64.b64encode(b"another-secret-entirely!").decode()
        refused = [
            (ended.replace(b"call-1", b"call-9"), signed(ended, SECRET, now)),  # a changed body
            (ended, signed(ended, other, now)),  # another secret
            (ended, signed(ended, SECRET, now - timedelta(minutes=6))),  # an old timestamp (a replay)
            (ended, {"content-type": "application/json"}),  # no signature at all
            (ended, {**signed(ended, SECRET, now), "webhook-signature": "garbage"}),  # not even well-formed
            (b"\xff\xfe", signed(ended, SECRET, now)),  # a body that is not UTF-8
        ]
        for body, headers in refused:
            assert post(url, body, headers)[0] == 401
        assert receiver.poll() is None
    lines = out.read_text().splitlines()
    assert lines[1:] == [
        "conversation.ended msg_example conversation=call-1",
        "conversation.ended msg_example conversation=call-1 (a repeat: already handled)",
        "caller.erased msg_erased conversations=call-1,call-2",
    ]
    reasons = out.with_suffix(".err").read_text()
    assert reasons.count("refused a delivery") == len(refused), reasons
    assert "Traceback" not in reasons


def test_the_webhook_receiver_asks_for_a_secret_it_can_use(tmp_path: Path) -> None:
    for secret in ("", "not-a-whsec"):
        result = subprocess.run(
            [sys.executable, str(RECEIVER), "--port", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "WEBHOOK_SECRET": secret},
        )
        assert result.returncode == 2 and "whsec_" in result.stderr, result.stderr


DEV_SECRETS = re.compile(r"^export (CALLER_MEMORY_[A-Z_]+)=(\S+)$", re.MULTILINE)


@contextlib.contextmanager
def dev_service(folder: Path, **env: str) -> Iterator[tuple[str, dict[str, str]]]:
    """The service started the README's way (scripts/run-dev, which `make run` runs) in ``folder``, with
    nothing of this process's own Caller Memory settings: its URL and the secrets of ``.dev-secrets``."""
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CALLER_MEMORY_")}
    clean |= {"VENV": str(Path(sys.executable).parent.parent), "PORT": str(port), **env}
    with running([str(ROOT / "scripts" / "run-dev")], folder / "service.out", clean, folder):
        wait_for_line(folder / "service.err", r"listening on http://")
        yield f"http://127.0.0.1:{port}", dict(DEV_SECRETS.findall((folder / ".dev-secrets").read_text()))


def readme_step(number: int) -> str:
    """The text of one step of the README's walkthrough."""
    text = (ROOT / "README.md").read_text()
    start = text.index(f"**{number}. ")
    end = text.find(f"**{number + 1}. ", start)
    return text[start : end if end > 0 else text.index("The same management is available without HTTP")]


def put_project(cm: str, document: bytes, operator: str) -> None:
    put = urllib.request.Request(f"{cm}/v1/projects/cheese-shop", data=document, method="PUT")
    put.add_header("Authorization", f"Bearer {operator}")
    put.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(put, timeout=10) as answer:
        assert answer.status in (200, 201)


def erase(cm: str, admin: str) -> dict[str, object]:
    request = urllib.request.Request(f"{cm}/v1/projects/cheese-shop/callers/+14155550100", method="DELETE")
    request.add_header("Authorization", f"Bearer {admin}")
    with urllib.request.urlopen(request, timeout=10) as erasure:
        receipt: dict[str, object] = orjson.loads(erasure.read())["removed"]
    return receipt


def test_the_readme_webhook_step_ends_a_call_and_the_receiver_prints_the_verified_delivery(
    tmp_path: Path,
) -> None:
    """Step 12 of the README's walkthrough, as written: `make run`'s script started again with 127.0.0.1
    allowed (its .dev-secrets made before webhooks existed: the script adds the secret key, keeping the rest),
    a webhook registered (its secret shown once), the example receiver started with it, a call ended."""
    operator = "op_" + secrets.token_urlsafe(24)
    older = f"export CALLER_MEMORY_PSEUDONYM_KEY={secrets.token_urlsafe(32)}\n"
    older += f"export CALLER_MEMORY_OPERATOR_TOKEN={operator}\n"
    (tmp_path / ".dev-secrets").write_text(older)
    assert "CALLER_MEMORY_SECRET_KEY" not in readme_step(12).split("```sh", 1)[1].split("```")[0]
    hook_port = free_port()
    json_header = {"Content-Type": "application/json"}
    with dev_service(tmp_path, CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS="127.0.0.1") as (cm, dev):
        assert (tmp_path / ".dev-secrets").read_text().startswith(older)
        assert len(base64.b64decode(dev["CALLER_MEMORY_SECRET_KEY"])) == 32
        project = orjson.dumps(
            {"memory": {"repeat_caller": {"state_keys": ["cheese"], "default_region": "US"}}}
        )
        put_project(cm, project, operator)
        tokens = f"{cm}/v1/projects/cheese-shop/tokens"
        admin = orjson.loads(post(tokens, b'{"role": "admin"}', json_header, operator)[1])["token"]
        agent = orjson.loads(post(tokens, b'{"role": "agent"}', json_header, admin)[1])["token"]
        registration = orjson.dumps(
            {
                "url": f"http://127.0.0.1:{hook_port}/webhooks",
                "events": ["conversation.ended", "caller.erased"],
            }
        )
        status, hook = post(f"{cm}/v1/projects/cheese-shop/webhooks", registration, json_header, admin)
        assert status == 201, hook
        secret = orjson.loads(hook)["secret"]
        out = tmp_path / "receiver.out"
        receive = [sys.executable, str(RECEIVER), "--port", str(hook_port)]
        with running(receive, out, {**os.environ, "WEBHOOK_SECRET": secret}, tmp_path):
            wait_for_line(out, r"listening on http://")
            end = orjson.dumps(
                {
                    "caller": "+14155550100",
                    "channel": "phone",
                    "end_reason": "completed",
                    "state": {"cheese": "brie"},
                    "outcome": {"qa": "resolved"},
                }
            )
            status, answer = post(
                f"{cm}/v1/projects/cheese-shop/conversations/call-5/end", end, json_header, agent
            )
            assert status == 200 and orjson.loads(answer)["persisted"] == ["cheese"], answer
            wait_for_line(out, r"^conversation\.ended msg_[a-z2-7]{32} conversation=call-5$")
            assert erase(cm, admin)["webhook_deliveries"] == 0
            wait_for_line(out, r"^caller\.erased msg_[a-z2-7]{32} conversations=")
    printed = out.read_text() + out.with_suffix(".err").read_text()
    assert "refused" not in printed and "4155550100" not in printed


def test_the_readme_archive_step_writes_the_call_that_duckdb_reads_and_erasure_deletes(
    tmp_path: Path,
) -> None:
    """Step 13 of the README, as written: its requests (their bodies taken from the README), the file found
    where it says, its DuckDB command run by the shell, and the erasure that deletes the file. The service is
    started by `make run`'s script in a fresh folder, so the archive is in that folder's default directory."""
    step = readme_step(13)
    blocks = re.findall(r"```sh\n(.*?)```", step, re.DOTALL)
    project, messages, end = (
        orjson.loads(body) for body in re.findall(r"-d '(\{.*?\})'", blocks[0], re.DOTALL)
    )
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    json_header = {"Content-Type": "application/json"}
    with dev_service(tmp_path) as (cm, dev):
        assert len(base64.b64decode(dev["CALLER_MEMORY_SECRET_KEY"])) == 32  # made with the other secrets
        operator = dev["CALLER_MEMORY_OPERATOR_TOKEN"]
        put_project(cm, orjson.dumps(project), operator)
        tokens = f"{cm}/v1/projects/cheese-shop/tokens"
        admin = orjson.loads(post(tokens, b'{"role": "admin"}', json_header, operator)[1])["token"]
        agent = orjson.loads(post(tokens, b'{"role": "agent"}', json_header, admin)[1])["token"]
        conversation = f"{cm}/v1/projects/cheese-shop/conversations/call-6"
        status, answer = post(f"{conversation}/messages", orjson.dumps(messages), json_header, agent)
        assert status == 200 and orjson.loads(answer)["added"] == 3, answer
        status, answer = post(f"{conversation}/end", orjson.dumps(end), json_header, agent)
        assert status == 200 and orjson.loads(answer)["persisted"] == ["cheese"], answer
        [archived] = (tmp_path / "caller-memory-archive").rglob("*.jsonl")
        relative = archived.relative_to(tmp_path).as_posix()
        assert re.fullmatch(
            r"caller-memory-archive/project=cheese-shop/date=\d{4}-\d\d-\d\d/[0-9a-f]{32}\.jsonl", relative
        )
        assert "4155550" not in archived.read_text()
        query = subprocess.run(
            ["bash", "-c", blocks[1]], cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert query.returncode == 0, query.stderr
        [row] = [line for line in query.stdout.splitlines() if "call-6" in line]
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        assert cells[1:] == ["call-6", "explicit", "resolved", "3", "Brie please, 200 grams. Call [phone]."]
        assert erase(cm, admin)["archived_conversations"] == 1
        assert list((tmp_path / "caller-memory-archive").rglob("*.jsonl")) == []
