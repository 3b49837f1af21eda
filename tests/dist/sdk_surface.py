"""Run by tests/dist with the Python of a virtualenv that holds only the SDK's wheel: the SDK's public surface
against the service's wheel, which ``testing.service(python=...)`` runs from its own virtualenv (argv[1]).

Two calls from one caller: the first remembers the caller's name and keeps a transcript, the second reads it
back, sees it rendered for a prompt, and is offered nothing to resume (the first ended normally). Prints
``surface ok`` last when all of it held."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
from caller_memory.sdk import EndResult, MemoryClient, __version__, render_memory
from caller_memory.sdk.testing import ScriptedModel, service

CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name"], "default_region": "US", "retention": "P1D"},
        "conversation": {"enabled": True},
    }
}


async def main(service_python: str) -> None:
    async with service(python=service_python) as cm, ScriptedModel(["Hello Ada"]) as model:
        tokens = await cm.create_project("dist-check", CONFIG)
        async with MemoryClient(cm.url, token=tokens.agent, project="dist-check") as client:
            first = client.conversation("dist-1", caller="+1 415 555 0100", transcript=True)
            memory = await first.begin_turn()
            assert memory.get("caller_name") is None, memory
            first.add_message("user", "my name is Ada")
            first.add_message("assistant", "Nice to meet you, Ada")
            first.state["caller_name"] = "Ada"
            ended = await first.end(qa="resolved", end_reason="completed")
            assert isinstance(ended, EndResult) and ended.persisted == ("caller_name",), ended

            second = client.conversation("dist-2", caller="(415) 555-0100", transcript=True)
            memory = await second.begin_turn()
            assert memory.get("caller_name") == "Ada", memory
            assert second.resume is None, second.resume
            rendered = render_memory(memory)
            assert rendered is not None and "Ada" in rendered, rendered
            await second.end(end_reason="completed")

            # Reads never raise because of the service: the same read with a caller it never saw is empty.
            assert (await client.read_memory("+1 415 555 0199")).get("caller_name") is None

        # The scripted model answers as OpenAI does and keeps what it was sent.
        async with aiohttp.ClientSession() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            async with http.post(f"{model.base_url}/chat/completions", json=body) as answer:
                reply = await answer.json()
        assert reply["choices"][0]["message"]["content"] == "Hello Ada", reply
        assert len(model.requests) == 1
    print(f"caller-memory-sdk {__version__}")
    print("surface ok")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
