"""The Agora ConvoAI join helper (``caller_memory.sdk.agora``, SPEC sections 15 and 16): it starts the call's
conversation and builds the parts of Agora's join request that Caller Memory owns. The join body, merged into
a realistic one, is what ``agora-agents``' own request types take, with no key they do not know; no phone
number is anywhere in it; a completion sent the way Agora sends it, with the parts built, goes through the
memory proxy with the caller's memory and is recorded; without the proxy the memory is one system message of
data; a hanging service does not hold the join. Against the real service (SQLite and Redis) and a scripted
model on loopback, and a server that never answers.

The three tests that validate with Agora's types are deselected where ``agora-agents`` is not installed (the
floors' virtualenv, Makefile FLOORS_TESTS: it needs pydantic>=2.7.1, above the project's floor); the others
run there too."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import re
import secrets
import time
import warnings
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from caller_memory.sdk import MemoryClient, render_memory
from caller_memory.sdk.agora import CONVERSATION_HEADER, CONVERSATION_LABEL, prepare_join
from caller_memory.sdk.render import PREAMBLE
from caller_memory.sdk.testing import ScriptedModel
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, TEST_NUMBERS, Api, canonical_digits, running_api
from tests.sdk.conftest import Forwarder, Serve

try:
    # agora-agents 2.12 declares its pydantic models with v1-style configuration as well, which pydantic 2
    # warns about as the models are made, once, at import: these two warnings only, only for this import.
    from pydantic.warnings import PydanticDeprecatedSince20

    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore",
            message="Support for class-based `config` is deprecated",
            category=PydanticDeprecatedSince20,
            module=r"agora_agent\.core\.pydantic_utilities",
        )
        warnings.filterwarnings(
            "ignore",
            message="Valid config keys have changed in V2",
            category=UserWarning,
            module=r"pydantic\._internal\._config",
        )
        from agora_agent.agentkit.vendors.llm import CustomLLM
        from agora_agent.agents.types.start_agents_request_properties import StartAgentsRequestProperties
        from agora_agent.types.llm import Llm
    AGORA = True
except ModuleNotFoundError:  # the floors' virtualenv
    AGORA = False


PROJECT = "cheese-shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"
NEW_CALLER = "+14155550123"
PROMPT = {"role": "system", "content": "You are the cheese shop's phone agent."}
CONFIG = {
    "memory": {
        "repeat_caller": {"state_keys": ["caller_name", "cheese"], "default_region": "US"},
        "conversation": {"enabled": True},
    }
}
MODEL_KEY = "sk-business-model-" + "k" * 20


@dataclass
class Shop:
    api: Api
    model: ScriptedModel
    agent: str
    admin: str
    platform: str


@pytest.fixture
async def shop(store_url: str, clock: FakeClock) -> AsyncIterator[Shop]:
    """The service with the memory proxy (its upstream the scripted model), a project whose caller
    :data:`CALLER` has memory, and an agent, an admin and a platform token."""
    settings = {
        "store_timeout": 5.0,
        "secret_key": secrets.token_bytes(32),
        "webhook_allow_hosts": ("127.0.0.1",),
    }
    async with (
        ScriptedModel(["We have Brie, Ada."] * 4) as model,
        running_api(store_url, clock, **settings) as api,
    ):
        reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
        assert reply.status in (200, 201), reply.body
        agent, admin, platform = [await api.mint(PROJECT, role) for role in ("agent", "admin", "platform")]
        reply = await api.call(
            "PUT", BASE + "/llm", token=admin, json={"base_url": model.base_url, "api_key": "sk-upstream-1"}
        )
        assert reply.status == 201, reply.body
        reply = await api.call(
            "PATCH",
            f"{BASE}/callers/{CALLER}/memory",
            token=admin,
            json={"caller_name": "Ada", "cheese": "Brie"},
        )
        assert reply.status == 200, reply.body
        yield Shop(api, model, agent, admin, platform)


def client_for(url: str, token: str, tmp_path: Path, **options: Any) -> MemoryClient:
    options.setdefault("read_budget", 2.0)  # a loaded machine: the budget is tested with a hanging service
    return MemoryClient(url, token=token, project=PROJECT, outbox_path=tmp_path / "outbox.db", **options)


def base_llm() -> dict[str, Any]:
    """The business's own LLM settings, as ``agora-agents`` builds them where it is installed."""
    if AGORA:
        config: dict[str, Any] = CustomLLM(
            api_key=MODEL_KEY,
            model="gpt-4o-mini",
            base_url="https://api.openai.com/v1/chat/completions",
            system_messages=[PROMPT],
            max_history=32,
            greeting_message="Hello, the cheese shop!",
            headers={"X-Shop-Tenant": "north"},
        ).to_config()
        return config
    return {
        "url": "https://api.openai.com/v1/chat/completions",
        "params": {"model": "gpt-4o-mini"},
        "style": "openai",
        "input_modalities": ["text"],
        "api_key": MODEL_KEY,
        "headers": {"X-Shop-Tenant": "north"},
        "system_messages": [PROMPT],
        "greeting_message": "Hello, the cheese shop!",
        "max_history": 32,
        "vendor": "custom",
    }


def base_properties() -> dict[str, Any]:
    """A realistic join ``properties`` of the business: RTC, ASR, TTS, its own label and its LLM."""
    return {
        "channel": "support-room-7",
        "token": "007eJxTYBBZ-rtc-token",
        "agent_rtc_uid": "1001",
        "remote_rtc_uids": ["1002"],
        "idle_timeout": 120,
        "asr": {"vendor": "ares", "language": "en-US"},
        "tts": {
            "vendor": "microsoft",
            "params": {"key": "tts-key", "region": "eastus", "voice_name": "en-US-AndrewNeural"},
        },
        "labels": {"campaign": "spring-2026"},
        "llm": base_llm(),
    }


def validated(properties: dict[str, Any]) -> Any:
    """The properties as Agora's own request type reads them: no key it does not know (its types take extra
    keys, so a misspelt one would pass unseen otherwise), and nothing lost or changed."""
    parsed = StartAgentsRequestProperties.model_validate(properties)
    assert parsed.model_extra in ({}, None)
    assert isinstance(parsed.llm, Llm) and parsed.llm.model_extra in ({}, None)
    assert parsed.model_dump(mode="json", exclude_unset=True, by_alias=True) == properties
    return parsed


def no_number_in(document: Any) -> None:
    text = json.dumps(document)
    assert not TEST_NUMBERS.search(canonical_digits(text)), text


async def completion(url: str, llm: dict[str, Any], messages: list[dict[str, Any]], turn: int) -> str:
    """One request of Agora's custom LLM as the join configures it: to ``llm.url``, with ``llm.api_key`` as
    the bearer token and ``llm.headers``, its system messages first and its turn metadata; the answer's
    ``X-Caller-Memory`` header."""
    body = {
        "model": llm["params"]["model"],
        "messages": [*llm.get("system_messages", []), *messages],
        "stream": True,
        "turn_id": turn,
        "timestamp": 1_767_000_000_000 + turn,
        "interruptable": True,
    }
    headers = {"Authorization": f"Bearer {llm['api_key']}", **llm.get("headers", {})}
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as answer:
        assert answer.status == 200, await answer.text()
        assert b"data: [DONE]" in await answer.read()
        return answer.headers["X-Caller-Memory"]


async def history(shop: Shop, conversation_id: str, count: int) -> list[dict[str, Any]]:
    """The conversation's messages once it has ``count`` (the proxy records off the answer's path)."""
    for _ in range(200):
        reply = await shop.api.call(
            "GET", f"{BASE}/conversations/{conversation_id}/history", token=shop.agent
        )
        assert reply.status == 200, reply.body
        contents: list[dict[str, Any]] = reply.body["contents"]
        if len(contents) >= count:
            return contents
        await asyncio.sleep(0.02)
    raise AssertionError(f"the conversation has not {count} messages")


# The join body ---------------------------------------------------------------------------------------------


async def test_with_the_proxy_the_join_is_agoras_shape_and_holds_no_memory_and_no_number(
    shop: Shop, tmp_path: Path
) -> None:
    base = base_properties()
    before = copy.deepcopy(base)
    async with client_for(shop.api.base_url, shop.agent, tmp_path) as client:
        join = await prepare_join(client, caller=CALLER, platform_token=shop.platform)
        properties = join.properties(base)
    assert base == before  # the business's dict is left as it was
    assert join.started and join.start_error is None and join.proxy
    assert join.memory.available and join.memory.fields() == {"caller_name": "Ada", "cheese": "Brie"}
    conversation_id = join.conversation_id
    assert re.fullmatch(r"agora:[0-9a-f]{32}", conversation_id) and conversation_id != base["channel"]
    assert properties["labels"] == {"campaign": "spring-2026", CONVERSATION_LABEL: conversation_id}
    llm = properties["llm"]
    assert llm["vendor"] == "custom" and llm["style"] == "openai"
    assert llm["url"] == f"{shop.api.base_url}/v1/projects/{PROJECT}/llm/chat/completions" == join.llm_url
    assert llm["api_key"] == shop.platform and MODEL_KEY not in json.dumps(properties)
    assert llm["headers"] == {"X-Shop-Tenant": "north", CONVERSATION_HEADER: conversation_id}
    assert llm["system_messages"] == [PROMPT]  # the proxy adds the memory to every request, not the join
    assert join.memory_message is None
    untouched = ("params", "max_history", "greeting_message", "input_modalities")
    assert {k: llm[k] for k in untouched} == {k: base["llm"][k] for k in untouched}
    assert {k: v for k, v in properties.items() if k not in ("labels", "llm")} == {
        k: v for k, v in base.items() if k not in ("labels", "llm")
    }
    parsed = validated(properties)
    assert parsed.labels[CONVERSATION_LABEL] == conversation_id
    assert parsed.llm.headers[CONVERSATION_HEADER] == conversation_id and parsed.llm.api_key == shop.platform
    no_number_in(properties)
    assert join.labels == {CONVERSATION_LABEL: conversation_id}
    assert join.llm() == {k: llm[k] for k in ("vendor", "style", "url", "api_key")} | {
        "headers": {CONVERSATION_HEADER: conversation_id}
    }
    assert shop.platform not in repr(join) and CALLER not in repr(join)


async def test_without_the_proxy_the_memory_is_one_system_message_of_data(shop: Shop, tmp_path: Path) -> None:
    base = base_properties()
    before = copy.deepcopy(base)
    async with client_for(shop.api.base_url, shop.agent, tmp_path) as client:
        join = await prepare_join(client, caller=CALLER)
        properties = join.properties(base)
    assert base == before and not join.proxy and join.llm_url is None
    llm = properties["llm"]
    assert {k: v for k, v in llm.items() if k != "system_messages"} == {
        k: v for k, v in base["llm"].items() if k != "system_messages"
    }  # the business's model, key and headers, as they were
    assert llm["system_messages"][:-1] == [PROMPT]
    memory = llm["system_messages"][-1]
    assert memory == {"role": "system", "content": render_memory(join.memory)} and join.memory_message
    preamble, data = memory["content"].split("\n")
    assert preamble == PREAMBLE  # framed as the proxy and the drop-ins frame it: data, never instructions
    assert orjson.loads(data) == {"caller_memory": {"caller_name": "Ada", "cheese": "Brie"}}
    assert properties["labels"][CONVERSATION_LABEL] == join.conversation_id
    assert CONVERSATION_HEADER not in llm["headers"]
    validated(properties)
    no_number_in(properties)


async def test_a_caller_without_memory_adds_no_message(shop: Shop, tmp_path: Path) -> None:
    async with client_for(shop.api.base_url, shop.agent, tmp_path) as client:
        join = await prepare_join(client, caller=NEW_CALLER)
    assert join.started and join.memory.available and len(join.memory) == 0 and join.memory_message is None
    assert join.llm(base_llm())["system_messages"] == [PROMPT]
    assert join.llm() == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        join.started = False  # type: ignore[misc]


async def test_a_dropped_call_is_offered_as_data_in_both_modes(shop: Shop, tmp_path: Path) -> None:
    async with client_for(shop.api.base_url, shop.agent, tmp_path) as client:
        first = client.conversation("call-dropped", caller=CALLER, transcript=True)
        await first.begin_turn()
        first.add_message("user", "Put aside a Brie for Friday, please", source="asr")
        await first.history()  # sent; then the line drops and nobody ends the call
        with_proxy = await prepare_join(client, caller=CALLER, platform_token=shop.platform)
        assert with_proxy.resume is not None and with_proxy.resume.conversation_id == "call-dropped"
        messages = with_proxy.llm(base_llm())["system_messages"]
        assert messages[0] == PROMPT and len(messages) == 2
        dropped = orjson.loads(messages[1]["content"].split("\n")[-1])
        assert set(dropped) == {"dropped_call"}  # the call that dropped; the caller's fields are the proxy's
        assert dropped["dropped_call"]["last_turns"] == [
            {"role": "user", "content": "Put aside a Brie for Friday, please"}
        ]
        without = await prepare_join(client, caller=CALLER)
        assert without.resume is not None  # the call the join before superseded, or the one before it
        content = without.llm()["system_messages"][0]["content"]
        assert content == render_memory(without.memory, without.resume)
        assert set(orjson.loads(content.split("\n")[-1])) == {"caller_memory", "dropped_call"}
        validated(with_proxy.properties(base_properties()))


# Through the memory proxy ----------------------------------------------------------------------------------


async def test_a_completion_with_the_built_llm_carries_the_memory_and_is_recorded(
    shop: Shop, tmp_path: Path
) -> None:
    async with client_for(shop.api.base_url, shop.agent, tmp_path) as client:
        join = await prepare_join(client, caller=CALLER, platform_token=shop.platform)
        llm = join.properties(base_properties())["llm"]
        url = llm["url"]
        first = {
            "role": "user",
            "content": "Hi, do you have Brie?",
            "turn_id": 1,
            "metadata": {"source": "asr"},
        }
        assert await completion(url, llm, [first], 1) == "bound"
        sent = shop.model.last_request
        assert "You are the cheese shop's phone agent." in sent.system_prompt
        assert '"caller_name":"Ada"' in sent.system_prompt and PREAMBLE in sent.system_prompt
        assert sent.messages[0]["content"] == PROMPT["content"]  # the memory after the business's prompt
        assert MODEL_KEY not in json.dumps(sent.body)
        answer = {
            "role": "assistant",
            "content": "We have Brie, Ada.",
            "turn_id": 1,
            "metadata": {"source": "llm"},
        }
        second = {
            "role": "user",
            "content": "Great, one please.",
            "turn_id": 2,
            "metadata": {"source": "asr"},
        }
        assert await completion(url, llm, [first, answer, second], 2) == "bound"
        recorded = await history(shop, join.conversation_id, 3)
        assert [(m["role"], m["content"], m["turn_id"]) for m in recorded] == [
            ("user", "Hi, do you have Brie?", 1),
            ("assistant", "We have Brie, Ada.", 1),
            ("user", "Great, one please.", 2),
        ]
        # The end of the call, through the SDK: what it learned is written to the caller's memory.
        join.conversation.state["cheese"] = "Gouda"
        ended = await join.conversation.end(end_reason="completed")
        assert ended.persisted == ("cheese",) and not ended.queued
    reply = await shop.api.call("GET", f"{BASE}/callers/{CALLER}/memory", token=shop.admin)
    assert reply.body["fields"] == {"caller_name": "Ada", "cheese": "Gouda"}


# What the business passes ----------------------------------------------------------------------------------


async def test_the_business_own_id_is_used_and_nothing_it_passes_may_carry_the_number(
    shop: Shop, tmp_path: Path
) -> None:
    async with client_for(shop.api.base_url, shop.agent, tmp_path) as client:
        join = await prepare_join(
            client, caller=CALLER, conversation_id="shop-call-7f3a", platform_token=shop.platform
        )
        assert join.started and join.conversation_id == join.conversation.conversation_id == "shop-call-7f3a"
        assert join.labels == {CONVERSATION_LABEL: "shop-call-7f3a"}
        assert join.llm()["headers"] == {CONVERSATION_HEADER: "shop-call-7f3a"}
        for wrong in ("call-4155550100", "call\n", "", "-call", "x" * 129, 17):
            with pytest.raises(ValueError, match="conversation_id"):
                await prepare_join(client, caller=CALLER, conversation_id=wrong)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="the client's own token"):
            await prepare_join(client, caller=CALLER, platform_token=shop.agent)
        with pytest.raises(ValueError, match="bearer token"):
            await prepare_join(client, caller=CALLER, platform_token="two words")
        with pytest.raises(ValueError, match="base_url"):
            await prepare_join(client, caller=CALLER, platform_token=shop.platform, public_url="ftp://x")
        for labels in (
            {"caller": CALLER},
            {"caller": "(415) 555-0100"},
            {"callback": "+44 20 7946 0018"},
            {"n": 1},
            {CONVERSATION_LABEL: "another"},
        ):
            with pytest.raises(ValueError, match="label"):
                join.properties({"labels": labels})
        with pytest.raises(ValueError, match="RTC channel"):
            join.properties({"channel": "shop-call-7f3a"})
        for headers in (
            {"Authorization": "Bearer sk-model"},
            {"x-caller-memory-conversation": "another"},
            {"X-Caller": "415.555.0100"},
            {"X-N": 1},
        ):
            with pytest.raises(ValueError, match="header"):
                join.llm({"headers": headers})
        assert join.llm({"headers": {"x-caller-memory-conversation": "shop-call-7f3a"}})["headers"] == {
            CONVERSATION_HEADER: "shop-call-7f3a"
        }
        public = await prepare_join(
            client, caller=CALLER, platform_token=shop.platform, public_url="https://memory.example.com/"
        )
        assert public.llm_url == f"https://memory.example.com/v1/projects/{PROJECT}/llm/chat/completions"
        labelled = join.properties({"labels": {"campaign": "2026-12-01", "tier": "gold"}})["labels"]
        assert labelled == {"campaign": "2026-12-01", "tier": "gold", CONVERSATION_LABEL: "shop-call-7f3a"}
        email = await prepare_join(client, caller="email:ada@example.com")
        with pytest.raises(ValueError, match="label"):
            email.properties({"labels": {"who": "ADA@example.com"}})


# A service that hangs --------------------------------------------------------------------------------------


async def test_a_hanging_service_does_not_hold_the_join(serve: Serve, tmp_path: Path) -> None:
    async def never(request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    url = await serve(never)
    budget = 0.3
    async with client_for(
        url, "agent-token-0123456789", tmp_path, read_budget=budget, deliver_outbox_on_start=False
    ) as client:
        for platform_token in ("platform-token-0123456789", None):
            started = time.perf_counter()
            join = await prepare_join(client, caller=CALLER, platform_token=platform_token)
            elapsed = time.perf_counter() - started
            assert elapsed < budget + 0.2, elapsed
            assert not join.memory.available and join.memory.reason
            assert not join.started and join.start_error
            assert join.memory_message is None
            properties = join.properties(base_properties())
            assert properties["labels"][CONVERSATION_LABEL] == join.conversation_id
            assert properties["llm"]["system_messages"] == [PROMPT]  # no memory, and nothing else added
            if platform_token is not None:
                assert properties["llm"]["url"] == f"{url}/v1/projects/{PROJECT}/llm/chat/completions"
                assert properties["llm"]["api_key"] == platform_token
                assert properties["llm"]["headers"][CONVERSATION_HEADER] == join.conversation_id
            else:
                assert properties["llm"] == base_llm()
            no_number_in(properties)


async def test_a_join_made_while_the_service_was_down_is_started_by_preparing_it_again(
    api: Api, forwarder: tuple[Forwarder, str], tmp_path: Path
) -> None:
    proxy, url = forwarder
    reply = await api.call("PUT", BASE, token=OPERATOR_TOKEN, json=CONFIG)
    assert reply.status in (200, 201), reply.body
    agent, admin = await api.mint(PROJECT, "agent"), await api.mint(PROJECT, "admin")
    reply = await api.call(
        "PATCH", f"{BASE}/callers/{CALLER}/memory", token=admin, json={"caller_name": "Ada"}
    )
    assert reply.status == 200, reply.body
    async with client_for(url, agent, tmp_path, read_budget=0.3, deliver_outbox_on_start=False) as client:
        proxy.switch("down")  # 503 at once: the service never sees the start
        join = await prepare_join(client, caller=CALLER)
        assert (
            not join.started
            and join.start_error
            and not join.memory.available
            and join.memory_message is None
        )
        proxy.switch("open")
        again = await prepare_join(client, caller=CALLER, conversation_id=join.conversation_id)
    assert again.started and again.conversation_id == join.conversation_id
    assert again.memory.fields() == {"caller_name": "Ada"} and again.memory_message is not None
    reply = await api.call("GET", f"{BASE}/conversations/{join.conversation_id}", token=agent)
    assert reply.status == 200 and reply.body["status"] == "active", reply.body
