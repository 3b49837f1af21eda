"""Issue 27, item 11: an archive that fails is a 503 and a redo, never a 500; its detail names no server
path; and the end's order holds while it fails (memory, archive, webhooks): no ``conversation.ended`` is sent
before the archive holds the conversation. Through a real server on every backend, with a real receiver."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, running_api
from tests.http.test_api import CALLER, assert_problem
from tests.http.test_archive import BASE, CONFIG, PROJECT, archived
from tests.http.test_webhooks import eventually, receiver, webhook_settings


async def test_an_archive_that_cannot_be_created_is_503_then_the_redone_end_archives_and_notifies(
    store_url: str, clock: FakeClock, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the archive's parent directory should be")
    root = blocker / "archive"
    async with (
        running_api(store_url, clock, **webhook_settings(archive_url=f"file://{root}")) as api,
        receiver() as hook,
    ):
        assert (
            await api.call("PUT", f"/v1/projects/{PROJECT}", token=OPERATOR_TOKEN, json=CONFIG)
        ).status in (
            200,
            201,
        )
        document = {"url": hook.url, "events": ["conversation.ended"]}
        assert (await api.call("POST", f"{BASE}/webhooks", token=OPERATOR_TOKEN, json=document)).status == 201
        turns = [{"role": "user", "content": "a table for two", "turn_id": 1}]
        start = {"caller": CALLER, "channel": "voice", "messages": turns}
        path = f"{BASE}/conversations/call-1"
        assert (await api.call("POST", path + "/messages", token=OPERATOR_TOKEN, json=start)).status == 200
        end = {"caller": CALLER, "state": {"caller_name": "Ada"}, "end_reason": "completed"}
        for _ in range(3):  # the SDK retries: each attempt fails the same way, and tells nobody
            failed = await api.call("POST", path + "/end", token=OPERATOR_TOKEN, json=end)
            assert_problem(failed, 503, mentions="archive")
            assert str(tmp_path) not in orjson.dumps(failed.body).decode()
            assert "not-a-directory" not in orjson.dumps(failed.body).decode()
        await asyncio.sleep(0.3)  # the delivery worker runs every 50 ms here
        assert hook.events("conversation.ended") == []
        # The operator fixes the location; the next retry archives the conversation, then tells receivers.
        blocker.unlink()
        done = await api.call("POST", path + "/end", token=OPERATOR_TOKEN, json=end)
        assert done.status == 200, done.body
        assert len(archived(root)) == 1
        await eventually(lambda: len(hook.events("conversation.ended")) == 1)
        await asyncio.sleep(0.3)
        assert [e["data"]["conversation_id"] for e in hook.events("conversation.ended")] == ["call-1"]
