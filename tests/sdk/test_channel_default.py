"""One default channel for every entry point of the SDK: transcripts, ``resume`` and supersession are kept per
channel, so a call made with the bare client and one made through a framework's drop-in, neither naming a
channel, must land on the same one. Against the real service (SQLite and Redis); the drop-ins' own calls
across entry points are in tests/frameworks (the frameworks run in processes of their own)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

from caller_memory.sdk import MemoryClient
from caller_memory.sdk.conversation import DEFAULT_CHANNEL

from tests.conftest import Api
from tests.sdk.test_transcripts import CALLER, client_for, shop, status_of

__all__ = ["shop"]  # the fixture, used by name

#: Prints the ``channel`` default of each drop-in's entry point. Run in a process of its own: importing
#: Pipecat changes asyncio process-wide.
DROP_IN_DEFAULTS = """
import inspect, json
from caller_memory.sdk.livekit import CallMemory, remember_caller
from caller_memory.sdk.pipecat import CallerMemory

def default(function):
    return inspect.signature(function).parameters["channel"].default

print(json.dumps({
    "pipecat CallerMemory": default(CallerMemory),
    "livekit CallMemory": default(CallMemory),
    "livekit remember_caller": default(remember_caller),
}))
"""


def test_the_default_is_the_phone_line_and_the_client_uses_it() -> None:
    assert DEFAULT_CHANNEL == "phone"
    parameter = inspect.signature(MemoryClient.conversation).parameters["channel"]
    assert parameter.default == DEFAULT_CHANNEL


def test_both_drop_ins_default_to_the_sdk_channel() -> None:
    result = subprocess.run(
        [sys.executable, "-c", DROP_IN_DEFAULTS], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    defaults = json.loads(result.stdout.strip().splitlines()[-1])
    assert defaults == {
        "pipecat CallerMemory": DEFAULT_CHANNEL,
        "livekit CallMemory": DEFAULT_CHANNEL,
        "livekit remember_caller": DEFAULT_CHANNEL,
    }


async def test_a_call_without_a_channel_is_resumed_by_another_without_one_and_not_across_channels(
    api: Api, shop: dict[str, str], tmp_path: Path
) -> None:
    """The service records the default channel; a callback on another channel ("voice", the SDK's former
    default) is not offered the dropped call, a callback naming none is."""
    async with client_for(api.base_url, shop["agent"], tmp_path) as client:
        first = client.conversation("call-1", caller=CALLER, transcript=True)
        assert first.channel == "phone"
        await first.begin_turn()
        first.add_message("user", "I'd like to book for Friday", source="asr")
        await first.history()  # sent; then the line drops and nobody ends the call
        status = await status_of(api, shop["admin"], "call-1")
        assert status["channel"] == "phone" and status["status"] == "active"

        elsewhere = client.conversation("call-2", caller=CALLER, channel="voice", transcript=True)
        await elsewhere.begin_turn()
        assert elsewhere.resume is None  # transcripts and resume stay within a channel
        await elsewhere.end(end_reason="completed")

        callback = client.conversation("call-3", caller=CALLER, transcript=True)
        await callback.begin_turn()
        resume = callback.resume
        assert resume is not None and resume.conversation_id == "call-1" and resume.channel == "phone"
        assert resume.to_openai() == [{"role": "user", "content": "I'd like to book for Friday"}]
        await callback.end(end_reason="completed")
