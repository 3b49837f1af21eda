"""caller_memory.sdk.testing: the scripted model answers as OpenAI's API does (read here by a plain HTTP client,
the way OpenAI's clients read it; the frameworks' own clients read it in tests/frameworks/test_*_doc.py), and
service() runs the real service, or says what to install when it is missing."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from caller_memory.sdk import MemoryClient
from caller_memory.sdk.testing import (
    Answer,
    ModelRequest,
    Reply,
    ScriptedModel,
    ScriptError,
    ServiceNotInstalledError,
    ServiceStartError,
    ToolCall,
    service,
)

TOOLS = [{"type": "function", "function": {"name": "save_name", "parameters": {"type": "object"}}}]
MESSAGES = [
    {"role": "system", "content": "You answer the phone."},
    {
        "role": "system",
        "content": [{"type": "text", "text": "Caller memory: "}, {"type": "text", "text": "{}"}],
    },
    {"role": "user", "content": "My name is Ada."},
]


async def complete(model: ScriptedModel, **body: Any) -> tuple[int, Any]:
    """One request to the model: the status, and the parsed answer (a list of chunks when streamed)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{model.base_url}/chat/completions", json={"model": "m", **body}) as answer,
    ):
        if answer.headers["Content-Type"].startswith("text/event-stream"):
            lines = (await answer.text()).split("\n\n")
            assert lines[-2:] == ["data: [DONE]", ""]
            return answer.status, [orjson.loads(line.removeprefix("data: ")) for line in lines[:-2]]
        return answer.status, await answer.json()


def assembled(chunks: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str, Any]], str]:
    """The streamed reply put together as OpenAI's clients do: the text, the tool calls (id, name, arguments)
    accumulated by index, and the finish reason."""
    text, finish = "", ""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        assert chunk["object"] == "chat.completion.chunk"
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                assert len(delta["tool_calls"]) == 1  # one call per chunk, which Pipecat assumes
                known = calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
                known["id"] += call.get("id", "")
                known["name"] += call.get("function", {}).get("name", "")
                known["arguments"] += call["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    tools = [(c["id"], c["name"], orjson.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return text, tools, finish


async def test_a_list_script_streams_text_then_tool_calls_and_keeps_every_request() -> None:
    script: list[Answer] = [
        "Hello! What's your name?",
        ToolCall("save_name", {"name": "Ada"}),
        Reply("One moment.", [ToolCall("look_up", {}), ToolCall("save_name", {"name": "Bo Li"})]),
    ]
    async with ScriptedModel(script) as model:
        status, chunks = await complete(model, messages=MESSAGES[:1], stream=True)
        assert status == 200 and assembled(chunks) == ("Hello! What's your name?", [], "stop")
        assert len(chunks) > 4  # the text went word by word
        asked = {"stream_options": {"include_usage": True}, "tools": TOOLS}
        status, chunks = await complete(model, messages=MESSAGES, stream=True, **asked)
        text, tools, finish = assembled(chunks)
        assert (text, finish) == ("", "tool_calls")
        assert [(name, arguments) for _, name, arguments in tools] == [("save_name", {"name": "Ada"})]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] > 0  # asked for
        status, chunks = await complete(model, messages=MESSAGES, stream=True)
        text, tools, finish = assembled(chunks)
        assert text == "One moment." and finish == "tool_calls"
        assert [(name, arguments) for _, name, arguments in tools] == [
            ("look_up", {}),
            ("save_name", {"name": "Bo Li"}),
        ]
        assert len({call_id for call_id, _, _ in tools}) == 2
        assert "usage" not in chunks[-1]  # not asked for
    assert [len(r.messages) for r in model.requests] == [1, 3, 3]
    second = model.requests[1]
    assert second.stream and second.tool_names == ["save_name"] and second.tools == TOOLS
    assert second.system_prompt == "You answer the phone.\n\nCaller memory: {}"
    assert second.last_user_text == "My name is Ada." and second.texts("user") == ["My name is Ada."]
    assert model.last_request is model.requests[-1]


async def test_a_whole_answer_when_not_streamed_and_the_models_list() -> None:
    async with ScriptedModel([Reply("Sure.", [ToolCall("save_name", {"name": "Ada"})]), "Bye."]) as model:
        status, answer = await complete(model, messages=MESSAGES)
        assert status == 200 and answer["object"] == "chat.completion" and answer["model"] == "m"
        [choice] = answer["choices"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Sure."
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["function"]["name"] == "save_name"
        assert orjson.loads(call["function"]["arguments"]) == {"name": "Ada"}
        status, answer = await complete(model, messages=MESSAGES, stream=False)
        assert answer["choices"][0]["message"] == {"role": "assistant", "content": "Bye."}
        assert answer["choices"][0]["finish_reason"] == "stop"
        async with aiohttp.ClientSession() as http, http.get(f"{model.base_url}/models") as listed:
            assert listed.status == 200 and [m["id"] for m in (await listed.json())["data"]] == ["scripted"]
    assert not model.requests[0].stream


async def test_a_function_script_sees_each_request_and_may_be_async() -> None:
    seen: list[str] = []

    async def answer(request: ModelRequest) -> str:
        seen.append(request.last_user_text)
        await asyncio.sleep(0)
        return f"You said: {request.last_user_text}"

    async with ScriptedModel(answer) as model:
        for line in ("one", "two"):
            _, chunks = await complete(model, messages=[{"role": "user", "content": line}], stream=True)
            assert assembled(chunks)[0] == f"You said: {line}"
    assert seen == ["one", "two"]


async def test_a_pause_spaces_the_streamed_words() -> None:
    async with ScriptedModel([Reply("a b c d e", pause=0.1)]) as model:
        started = asyncio.get_running_loop().time()
        await complete(model, messages=MESSAGES, stream=True)
        assert asyncio.get_running_loop().time() - started >= 0.4


async def test_a_reply_the_agent_stops_reading_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    async with ScriptedModel([Reply("a b c d e f g h", pause=0.05), "next"]) as model:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{model.base_url}/chat/completions", json={"messages": MESSAGES, "stream": True}
            ) as answer,
        ):
            assert (await answer.content.readline()).startswith(b"data: ")
            answer.close()  # an interruption: the client goes mid-stream
        await asyncio.sleep(0.3)  # the model writes on into the closed connection
        status, chunks = await complete(model, messages=MESSAGES, stream=True)
        assert status == 200 and assembled(chunks)[0] == "next"
    assert model.errors == []
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_an_exhausted_script_answers_500_naming_why_and_fails_the_test_at_the_end() -> None:
    model = ScriptedModel(["Only this."])
    with pytest.raises(ScriptError, match="the script has 1 answers and request 2 asked for one more"):
        async with model:
            assert (await complete(model, messages=MESSAGES))[0] == 200
            status, answer = await complete(model, messages=MESSAGES, stream=True)
            assert status == 500 and "the script has 1 answers" in answer["error"]["message"]
    assert len(model.requests) == 2 and len(model.errors) == 1


async def test_a_script_that_raises_or_answers_nonsense_is_an_error_too() -> None:
    def broken(request: ModelRequest) -> str:
        raise KeyError("nothing scripted for this")

    with pytest.raises(ScriptError, match="the script raised KeyError"):
        async with ScriptedModel(broken) as model:
            assert (await complete(model, messages=MESSAGES))[0] == 500
    with pytest.raises(ScriptError, match="not int"):
        async with ScriptedModel([42]) as model:  # type: ignore[list-item]
            assert (await complete(model, messages=MESSAGES))[0] == 500


async def test_a_body_without_messages_is_refused_with_400_and_not_kept() -> None:
    async with ScriptedModel(["unused"]) as model, aiohttp.ClientSession() as http:
        for body in (b"not json", b"[]", b'{"model": "m"}'):
            async with http.post(f"{model.base_url}/chat/completions", data=body) as answer:
                assert answer.status == 400 and "`messages` list" in (await answer.json())["error"]["message"]
    assert model.requests == [] and model.errors == []
    with pytest.raises(RuntimeError, match="inside `async with`"):
        _ = ScriptedModel([]).base_url


CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name"], "default_region": "US"},
        "conversation": {"enabled": True},
    }
}


async def test_service_runs_the_real_service_and_removes_its_files(monkeypatch: pytest.MonkeyPatch) -> None:
    # This process's own settings are not the service's: a token too short to start with is ignored.
    monkeypatch.setenv("CALLER_MEMORY_OPERATOR_TOKEN", "short")
    async with service() as cm:
        assert cm.database.exists() and cm.operator_token != "short"
        tokens = await cm.create_project("cheese-shop", CONFIG)
        assert tokens.project == "cheese-shop" and tokens.admin != tokens.agent
        async with MemoryClient(cm.url, token=tokens.agent, project="cheese-shop") as client:
            first = client.conversation("call-1", caller="+14155550100", channel="phone")
            await first.begin_turn()
            first.state["caller_name"] = "Ada"
            assert (await first.end()).persisted == ("caller_name",)
            second = client.conversation("call-2", caller="+14155550100", channel="phone")
            await second.begin_turn()
            assert second.memory.get("caller_name") == "Ada"
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {tokens.admin}"}) as http,
            http.get(f"{cm.url}/v1/projects/cheese-shop/tokens") as listed,
        ):
            assert listed.status == 200 and len((await listed.json())["tokens"]) == 2
        with pytest.raises(ValueError, match="refused the project"):
            await cm.create_project("cheese-shop", {"memory": {"unknown": True}})
    assert not cm.database.parent.exists()
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await http.get(f"{cm.url}/readyz")


async def test_service_that_cannot_start_says_why_with_its_standard_error() -> None:
    with pytest.raises(ServiceStartError, match="exited with status") as failed:
        async with service(environment={"CALLER_MEMORY_SECRET_KEY": "too-short"}):
            pass
    assert "CALLER_MEMORY_SECRET_KEY must be 32 random bytes" in str(failed.value)


@pytest.fixture(scope="module")
def without_service(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv with every package of this one except the service's distribution (``caller-memory``):
    the SDK alone, as a bot's environment has it. Returns its interpreter."""
    venv = tmp_path_factory.mktemp("sdk-only") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout.strip()
    )
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(("caller_memory-", "caller-memory-")):
            (site / entry.name).symlink_to(entry)
    return python


async def test_service_names_what_to_install_when_the_given_interpreter_lacks_the_service(
    without_service: Path,
) -> None:
    with pytest.raises(ServiceNotInstalledError) as missing:
        async with service(python=str(without_service)):
            pass
    message = str(missing.value)
    assert isinstance(missing.value, RuntimeError) and str(without_service) in message
    assert "pip install ./sdk ./" in message and "caller-memory @ git+https://" in message


def test_service_names_what_to_install_in_an_environment_with_the_sdk_alone(
    without_service: Path, tmp_path: Path
) -> None:
    # A test run there asks its own interpreter: the SDK imports, the service is not installed.
    script = textwrap.dedent(
        """
        import asyncio
        from caller_memory.sdk.testing import ServiceNotInstalledError, service

        async def main():
            try:
                async with service():
                    print("started")
            except ServiceNotInstalledError as exc:
                print("missing:", exc)

        asyncio.run(main())
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    ran = subprocess.run(
        [without_service, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=tmp_path,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("missing: service() runs the Caller Memory service, but the 'caller-memory'")
    assert "pip install ./sdk ./" in ran.stdout
