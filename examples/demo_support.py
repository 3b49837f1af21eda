"""What the framework examples' ``--demo`` modes share: the answers of their scripted model.

The model server and the service come from :mod:`caller_memory.sdk.testing`; this file only decides what a
cheese shop's agent would answer, knowing only what its context says. A real agent talks to a real model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from caller_memory.sdk.testing import Answer, ModelRequest, ToolCall, message_text

#: A field of the caller memory message (``render_memory``) as the model reads it.
CALLER_NAME = re.compile(r'"caller_name":"([^"]*)"')
SAYS_NAME = re.compile(r"my name is (\w+)", re.IGNORECASE)


def shop_model(greeting: str = "Hello! What's your name?") -> Callable[[ModelRequest], Answer]:
    """The script of a cheese shop's agent: it greets a caller the memory message names by name, saves the
    name a caller says (a ``save_name`` call), thanks them once the tool answered, and notes anything else."""

    def answer(request: ModelRequest) -> Answer:
        last = request.messages[-1]
        if last.get("role") == "tool":
            try:
                said = json.loads(message_text(last))
            except ValueError:
                said = {}
            return f"Nice to meet you, {said.get('name', '') if isinstance(said, dict) else ''}."
        if last.get("role") == "user" and (name := SAYS_NAME.search(message_text(last))):
            return ToolCall("save_name", {"name": name.group(1)})
        spoke = bool(request.texts("assistant"))
        if not spoke and (known := CALLER_NAME.search(request.system_prompt)):
            return f"Welcome back, {known.group(1)}!"
        return "Noted." if spoke else greeting

    return answer
