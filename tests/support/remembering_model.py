"""The FakeLLM script of the frameworks' MCP tests (tests/frameworks/test_{livekit,pipecat}_mcp.py): a model
that calls Caller Memory's ``remember`` tool. Each framework hands the tool's answer to the model in its own
shape, so each test passes the function that reads it back (``tool_answer``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tests.support.fake_llm import Reply, default_reply, text_of

CALL_ME = re.compile(r"call me (\w+)", re.IGNORECASE)
CHEESE = re.compile(r"favourite cheese is (\w+)", re.IGNORECASE)
#: What the scripted model says once the tool answered: the answer it got decides which.
NOTED_NAME = "I'll remember your name."
NOT_KEPT = "Sorry, I cannot keep that."


def remembering_model(
    tool_answer: Callable[[str], dict[str, Any]],
) -> Callable[[list[dict[str, Any]]], Reply]:
    """The script: "call me X" calls ``remember(caller_name, X)``, "my favourite cheese is X" calls
    ``remember(favourite_cheese, X)`` (not a state key of the project); the tool's answer (read with
    ``tool_answer``, {} for a tool error's text) gets :data:`NOTED_NAME` when it says the name was remembered,
    else :data:`NOT_KEPT`. The rest is the default script (a greeting by name when the memory message holds
    one)."""

    def reply(messages: list[dict[str, Any]]) -> Reply:
        last = messages[-1]
        if last.get("role") == "tool":
            answer = tool_answer(text_of(last))
            return Reply([NOTED_NAME if answer.get("remembered") == "caller_name" else NOT_KEPT])
        user = text_of(last) if last.get("role") == "user" else ""
        if match := CALL_ME.search(user):
            return Reply(tool=("remember", {"key": "caller_name", "value": match.group(1)}))
        if match := CHEESE.search(user):
            return Reply(tool=("remember", {"key": "favourite_cheese", "value": match.group(1)}))
        return default_reply(messages)

    return reply
