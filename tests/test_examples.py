"""The examples run as documented."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import orjson
import pytest
from caller_memory.service.domain.webhooks.secrets import signature_headers

from tests.support.processes import post, running, wait_for_line

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


#: Put first on PYTHONPATH, it makes one module (and its submodules) impossible to import, as if its package
#: were not installed.
HIDE = """import os, sys

HIDDEN = os.environ["HIDDEN_MODULE"]


class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name == HIDDEN or name.startswith(HIDDEN + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, Hidden())
"""


@pytest.mark.parametrize(
    ("example", "hidden", "install"),
    [
        ("livekit_agent.py", "livekit.plugins.openai", '"caller-memory-sdk[livekit]"'),
        ("livekit_agent.py", "livekit.agents", '"caller-memory-sdk[livekit]"'),
        ("pipecat_bot.py", "pipecat", '"caller-memory-sdk[pipecat]"'),
    ],
)
def test_a_framework_example_says_what_to_install_when_its_framework_or_plugin_is_missing(
    example: str, hidden: str, install: str, tmp_path: Path
) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE)
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / example), "--demo"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path), "HIDDEN_MODULE": hidden},
    )
    assert result.returncode == 1 and result.stdout == "", result.stderr
    assert "Traceback" not in result.stderr
    assert f"pip install {install}" in result.stderr and hidden.split(".")[0] in result.stderr
    if hidden == "livekit.plugins.openai":
        assert "--demo needs LiveKit's OpenAI plugin (livekit-plugins-openai)" in result.stderr


# The webhook receiver (examples/webhook_receiver.py) -----------------------------------------------------

RECEIVER = ROOT / "examples" / "webhook_receiver.py"
#: A signing secret in the form the service makes (whsec_ and the base64 of 24 bytes).
SECRET = "whsec_" + base64.b64encode(b"example-receiver-secret!").decode()


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
