"""The walkthrough (docs/walkthrough.md) runs as written: its webhook and archive steps against the service
started the way `make run` starts it, and every sample answer it shows has the shape the service answers."""

from __future__ import annotations

import base64
import contextlib
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from caller_memory.service.http import bodies

from tests.support.processes import post, running, wait_for_line
from tests.support.service_process import free_port

ROOT = Path(__file__).resolve().parent.parent
WALKTHROUGH = ROOT / "docs" / "walkthrough.md"
RECEIVER = ROOT / "examples" / "webhook_receiver.py"
DEV_SECRETS = re.compile(r"^export (CALLER_MEMORY_[A-Z_]+)=(\S+)$", re.MULTILINE)
JSON_HEADER = {"Content-Type": "application/json"}


@contextlib.contextmanager
def dev_service(folder: Path, **env: str) -> Iterator[tuple[str, dict[str, str]]]:
    """The service started the way `make run` starts it (scripts/run-dev) in ``folder``, with nothing of this
    process's own Caller Memory settings: its URL and the secrets of ``.dev-secrets``."""
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CALLER_MEMORY_")}
    clean |= {"VENV": str(Path(sys.executable).parent.parent), "PORT": str(port), **env}
    with running([str(ROOT / "scripts" / "run-dev")], folder / "service.out", clean, folder):
        wait_for_line(folder / "service.err", r"listening on http://")
        yield f"http://127.0.0.1:{port}", dict(DEV_SECRETS.findall((folder / ".dev-secrets").read_text()))


def step(number: int) -> str:
    """The text of one numbered step of the walkthrough."""
    text = WALKTHROUGH.read_text()
    start = text.index(f"**{number}. ")
    end = text.find(f"**{number + 1}. ", start)
    return text[start : end if end > 0 else text.index("The same management is available without HTTP")]


def put_project(cm: str, document: bytes, operator: str) -> None:
    put = urllib.request.Request(f"{cm}/v1/projects/cheese-shop", data=document, method="PUT")
    put.add_header("Authorization", f"Bearer {operator}")
    put.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(put, timeout=10) as answer:
        assert answer.status in (200, 201)


def tokens(cm: str, operator: str) -> tuple[str, str]:
    """An admin and an agent token of the cheese-shop project."""
    url = f"{cm}/v1/projects/cheese-shop/tokens"
    admin = orjson.loads(post(url, b'{"role": "admin"}', JSON_HEADER, operator)[1])["token"]
    agent = orjson.loads(post(url, b'{"role": "agent"}', JSON_HEADER, admin)[1])["token"]
    return admin, agent


def erase(cm: str, admin: str) -> dict[str, object]:
    request = urllib.request.Request(f"{cm}/v1/projects/cheese-shop/callers/+14155550100", method="DELETE")
    request.add_header("Authorization", f"Bearer {admin}")
    with urllib.request.urlopen(request, timeout=10) as erasure:
        receipt: dict[str, object] = orjson.loads(erasure.read())["removed"]
    return receipt


def wait_until_listed(url: str, token: str, timeout: float = 20.0) -> list[dict[str, object]]:
    """The items of a listing, once it has any."""
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            items: list[dict[str, object]] = orjson.loads(answer.read())["deliveries"]
        if items or time.monotonic() > deadline:
            return items
        time.sleep(0.05)


def test_the_webhook_step_ends_a_call_and_the_receiver_prints_the_verified_delivery(tmp_path: Path) -> None:
    """Step 12, as written: `make run`'s script started again with 127.0.0.1 allowed (with a .dev-secrets that
    lacks the secret key: the script adds it, keeping the rest), a webhook registered (its secret shown once),
    the example receiver started with it, a call ended."""
    operator = "op_" + secrets.token_urlsafe(24)
    older = f"export CALLER_MEMORY_PSEUDONYM_KEY={secrets.token_urlsafe(32)}\n"
    older += f"export CALLER_MEMORY_OPERATOR_TOKEN={operator}\n"
    (tmp_path / ".dev-secrets").write_text(older)
    blocks = re.findall(r"```sh\n(.*?)```", step(12), re.DOTALL)
    assert blocks[0].strip().startswith("CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS=127.0.0.1 make run")
    assert "CALLER_MEMORY_SECRET_KEY" not in blocks[0]
    registration = orjson.loads(re.findall(r"-d '(\{.*?\})'", blocks[1], re.DOTALL)[0])
    assert registration["url"] == "http://127.0.0.1:8090/webhooks" and "--port 8090" in blocks[1]
    hook_port = free_port()  # port 8090 may be taken on this machine: the step's requests on a free one
    registration["url"] = f"http://127.0.0.1:{hook_port}/webhooks"
    with dev_service(tmp_path, CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS="127.0.0.1") as (cm, dev):
        assert (tmp_path / ".dev-secrets").read_text().startswith(older)
        assert len(base64.b64decode(dev["CALLER_MEMORY_SECRET_KEY"])) == 32
        project = orjson.dumps(
            {"memory": {"repeat_caller": {"state_keys": ["cheese"], "default_region": "US"}}}
        )
        put_project(cm, project, operator)
        admin, agent = tokens(cm, operator)
        hooks = f"{cm}/v1/projects/cheese-shop/webhooks"
        status, hook = post(hooks, orjson.dumps(registration), JSON_HEADER, admin)
        assert status == 201, hook
        secret = orjson.loads(hook)["secret"]
        out = tmp_path / "receiver.out"
        receive = [sys.executable, str(RECEIVER), "--port", str(hook_port)]
        with running(receive, out, {**os.environ, "WEBHOOK_SECRET": secret}, tmp_path):
            wait_for_line(out, r"listening on http://")
            end = orjson.loads(re.findall(r"-d '(\{.*?\})'", blocks[2], re.DOTALL)[0])
            status, answer = post(
                f"{cm}/v1/projects/cheese-shop/conversations/call-5/end",
                orjson.dumps(end),
                JSON_HEADER,
                agent,
            )
            assert status == 200 and orjson.loads(answer)["persisted"] == ["cheese"], answer
            wait_for_line(out, r"^conversation\.ended msg_[a-z2-7]{32} conversation=call-5$")
            # The receiver printed it before its answer reached the service: once the service has recorded
            # the delivery as delivered, the erasure removes it without counting it (nothing was left unsent).
            delivered = wait_until_listed(f"{hooks}/deliveries?state=delivered", admin)
            assert [d["event"] for d in delivered] == ["conversation.ended"], delivered
            assert erase(cm, admin)["webhook_deliveries"] == 0
            wait_for_line(out, r"^caller\.erased msg_[a-z2-7]{32} conversations=")
    printed = out.read_text() + out.with_suffix(".err").read_text()
    assert "refused" not in printed and "4155550100" not in printed


def test_the_archive_step_writes_the_call_that_duckdb_reads_and_erasure_deletes(tmp_path: Path) -> None:
    """Step 13, as written: its requests (their bodies taken from the page), the file found where it says, its
    DuckDB command run by the shell, and the erasure that deletes the file. The service is started by `make
    run`'s script in a fresh folder, so the archive is in that folder's default directory."""
    blocks = re.findall(r"```sh\n(.*?)```", step(13), re.DOTALL)
    project, messages, end = (
        orjson.loads(body) for body in re.findall(r"-d '(\{.*?\})'", blocks[0], re.DOTALL)
    )
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    with dev_service(tmp_path) as (cm, dev):
        assert len(base64.b64decode(dev["CALLER_MEMORY_SECRET_KEY"])) == 32  # made with the other secrets
        put_project(cm, orjson.dumps(project), dev["CALLER_MEMORY_OPERATOR_TOKEN"])
        admin, agent = tokens(cm, dev["CALLER_MEMORY_OPERATOR_TOKEN"])
        conversation = f"{cm}/v1/projects/cheese-shop/conversations/call-6"
        status, answer = post(f"{conversation}/messages", orjson.dumps(messages), JSON_HEADER, agent)
        assert status == 200 and orjson.loads(answer)["added"] == 3, answer
        status, answer = post(f"{conversation}/end", orjson.dumps(end), JSON_HEADER, agent)
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


# The sample answers: each shows the keys the service answers, in its order ---------------------------------

#: The answers whose samples are checked, each with every key it has. A sample is of one of these when its
#: first key is the answer's first and it names one of the keys that only that answer has.
SHAPES: dict[str, tuple[str, ...]] = {
    "memory": tuple(bodies.Memory.__annotations__),
    "end": tuple(bodies.ConversationEnded.__annotations__),
    "erasure": tuple(bodies.ErasureReceipt.__annotations__),
}
TELLING = {
    "memory": {"fields", "valid_until"},
    "end": {"persisted", "ignored", "repeat_caller", "late"},
    "erasure": {"removed", "erased_at"},
}


def shape_of(keys: list[str]) -> str | None:
    """Which of :data:`SHAPES` a sample with these top-level keys shows, if any."""
    for name, real in SHAPES.items():
        if keys and keys[0] == real[0] and TELLING[name] & set(keys):
            return name
    return None


#: A sample in a shell block: a comment line that opens a JSON object, and its continuation lines.
SAMPLE = re.compile(r"^# (\{.*(?:\n#  .*)*)", re.MULTILINE)


def top_keys(sample: str) -> list[str]:
    """The keys of the outermost object of a sample answer (which may elide parts with '…')."""
    keys, depth, i = [], 0, 0
    while i < len(sample):
        c = sample[i]
        if c == '"':
            close = sample.index('"', i + 1)
            if depth == 1 and sample[close + 1 : close + 2] == ":":
                keys.append(sample[i + 1 : close])
            i = close
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
        i += 1
    return keys


def shape_problems(text: str) -> list[str]:
    """What is wrong with the sample answers in ``text``: a key the service does not answer, keys out of the
    service's order, or the answer's last keys left out (a sample may elide keys in between with '…')."""
    problems = []
    for match in SAMPLE.finditer(text):
        sample = re.sub(r"\n#  ", "", match.group(1))
        keys = top_keys(sample)
        name = shape_of(keys)
        if name is not None:
            real = SHAPES[name]
            if not set(keys) <= set(real):
                problems.append(f"{sample[:60]}: keys the service does not answer: {set(keys) - set(real)}")
            elif keys != sorted(keys, key=real.index):
                problems.append(f"{sample[:60]}: keys out of the service's order")
            elif ("…" not in sample and keys != list(real)) or keys[-1] != real[-1]:
                problems.append(f"{sample[:60]}: leaves out {[k for k in real if k not in keys]}")
    return problems


@pytest.mark.parametrize("page", ["docs/walkthrough.md", "docs/api.md", "README.md"])
def test_each_sample_answer_has_the_shape_the_service_answers(page: str) -> None:
    text = (ROOT / page).read_text()
    assert shape_problems(text) == []


def test_the_sample_check_finds_a_sample_that_leaves_keys_out() -> None:
    memory = '# {"identifier":"+14155550100","fields":{"a":1},"expires_at":null,"valid_until":null,\n'
    memory += '#  "blacklisted":false}\n'
    elided = '# {"conversation_id":"c","persisted":[],…,"late":false}\n'
    whole = '# {"conversation_id":"c","persisted":[],…,"late":false,"withheld":[]}\n'
    found = shape_problems(memory + elided + whole)
    assert len(found) == 2 and "'withheld', 'attestation'" in found[0] and "'withheld'" in found[1], found


def test_the_walkthrough_samples_are_checked() -> None:
    """The check above is not vacuous: the walkthrough shows memory reads, ends and an erasure receipt."""
    found: dict[str | None, int] = {}
    for match in SAMPLE.finditer(WALKTHROUGH.read_text()):
        name = shape_of(top_keys(re.sub(r"\n#  ", "", match.group(1))))
        found[name] = found.get(name, 0) + 1
    assert found.get("memory", 0) >= 4 and found.get("end", 0) >= 6 and found.get("erasure") == 1, found
