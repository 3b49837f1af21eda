"""What a call start's answer becomes for a platform (SPEC section 15, "At call start"): string variables,
the same for every platform, which each adapter puts in its platform's own shape.

- ``caller_memory``: the memory as data, framed as the SDK's ``render_memory`` frames it (its preamble
  saying that what follows is data, never instructions, then one JSON document), empty when there is none;
- ``memory_<key>`` for every state key: the field's value as text (JSON for what is not a string), empty
  when absent or withheld;
- ``returning_caller``: ``true`` or ``false``;
- ``resume``: the dropped call a callback may pick up (its summary, state and last turns, as data), empty
  when none.

A field whose value holds a phone number is withheld from every variable (a platform copies variables into
its own logs and prompts); so is a resume's state field that does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from caller_memory.sdk.render import PREAMBLE

from ..redaction import enough_digits, redact_text
from .ingestion import StartAnswer


def as_text(value: Any) -> str:
    """A field's value as a variable holds it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()


def holds_number(value: Any, regions: Sequence[str | None]) -> bool:
    """Whether ``value`` (any JSON) holds a phone number, read in ``regions``."""
    text = as_text(value)
    return enough_digits(text) and redact_text(text, regions) != text


def _data(document: Mapping[str, Any]) -> str:
    return "\n".join((PREAMBLE, orjson.dumps(document, option=orjson.OPT_SORT_KEYS).decode()))


def start_variables(
    answer: StartAnswer, state_keys: Sequence[str], regions: Sequence[str | None]
) -> dict[str, str]:
    """The string variables of a call start's answer (the fail-open one included: every variable is
    there, empty)."""
    fields = {
        name: value for name, value in (answer.memory or {}).items() if not holds_number(value, regions)
    }
    variables = {
        "caller_memory": _data({"caller_memory": fields}) if fields else "",
        "returning_caller": "true" if answer.returning_caller else "false",
        "resume": "",
    }
    for key in state_keys:
        variables[f"memory_{key}"] = as_text(fields[key]) if key in fields else ""
    resume = answer.resume
    if resume:
        dropped: dict[str, Any] = {"last_activity_at": resume.get("last_activity_at")}
        summary = resume.get("summary")
        if summary:
            dropped["summary"] = summary.get("text") if isinstance(summary, Mapping) else summary
        state = {k: v for k, v in (resume.get("state") or {}).items() if not holds_number(v, regions)}
        if state:
            dropped["state"] = state
        turns = [
            {"role": m["role"], "content": m["content"]}
            for m in resume.get("last_turns") or []
            if m.get("role") in ("user", "assistant")
        ]
        if turns:
            dropped["last_turns"] = turns
        variables["resume"] = _data({"dropped_call": dropped})
    return variables
