"""The dashboard's help for the attestation breakdown says what the table shows: each value the service
records, and the one label for an attestation that was not recorded, written once in the script that also
fills it into the help. Against the real service: the page and script it serves, and the report whose
values the help explains."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from caller_memory.service.domain.attestation import ATTESTATIONS
from caller_memory.service.domain.clock import FakeClock

from tests.conftest import OPERATOR_TOKEN, running_api

PROJECT = "shop"
BASE = f"/v1/projects/{PROJECT}"
CALLER = "+14155550100"


def attestation_help(page: str) -> str:
    """The help paragraph of the attestation breakdown, its markup removed but its label elements kept."""
    section = page[page.index("By caller-ID attestation") : page.index('id="breakdown-attestation"')]
    match = re.search(r'<p class="help">(.*?)</p>', section, re.DOTALL)
    assert match is not None, section
    return " ".join(match.group(1).split())


async def test_the_attestation_help_names_what_the_table_shows(tmp_path: Path) -> None:
    async with running_api(f"sqlite:///{tmp_path}/memory.db", FakeClock()) as api:
        page = await api.session.get(f"{api.base_url}/dashboard")
        script = await api.session.get(f"{api.base_url}/dashboard/dashboard.js")
        assert page.status == script.status == 200
        html, js = await page.text(), await script.text()
        # Ends of each kind: by the agent with no attestation, by an admin, by the service (inactivity).
        config: dict[str, Any] = {"state_keys": ["cheese"], "analytics_enabled": True}
        put = await api.call(
            "PUT",
            BASE,
            token=OPERATOR_TOKEN,
            json={"memory": {"repeat_caller": config, "conversation": {"enabled": True}}},
        )
        assert put.status in (200, 201), put.body
        agent, admin = await api.mint(PROJECT, "agent"), await api.mint(PROJECT, "admin")
        for conversation_id, token in (("first", agent), ("by-agent", agent), ("by-admin", admin)):
            end = await api.call(
                "POST", f"{BASE}/conversations/{conversation_id}/end", token=token, json={"caller": CALLER}
            )
            assert end.status == 200, end.body
        messages = {
            "caller": CALLER,
            "channel": "phone",
            "messages": [{"role": "user", "content": "Hi", "turn_id": 1}],
        }
        appended = await api.call(
            "POST", f"{BASE}/conversations/dropped/messages", token=agent, json=messages
        )
        assert appended.status == 200, appended.body
        api.clock.advance(31 * 60)  # past end_after_inactivity (PT30M)
        assert (await api.call("POST", "/v1/admin/sweeps", token=OPERATOR_TOKEN)).status == 200
        report = await api.call("GET", f"{BASE}/analytics/repeat-callers", token=admin)
        assert report.status == 200, report.body
    rows = {row["value"]: row["repeat_conversations"] for row in report.body["breakdowns"]["attestation"]}
    assert rows == {"unknown": 1, None: 2}  # the agent's end that sent none; the admin's and the service's
    help_text = attestation_help(html)
    # Every value the service records is named, "unknown" as what a call that sent none counts as.
    for value in ATTESTATIONS:
        assert re.search(rf"\b{value}\b", help_text), value
    assert "unknown when the call sent none" in help_text
    # The label of a value not recorded: not written in the page, filled in from the script's one constant,
    # the same one the table's cells use; the help says when a value is not recorded.
    assert '<span data-label="none"></span>: none was recorded' in help_text
    assert "service ended the call" in help_text and "admin" in help_text
    [label] = re.findall(r'^const NONE_LABEL = "([^"]+)";$', js, re.MULTILINE)
    assert label not in html
    assert js.count("NONE_LABEL") == 4  # defined; named in a comment; the cells; the help
    assert "cell(row.value, { none: NONE_LABEL })" in js
    assert "label.textContent = NONE_LABEL" in js
    assert js.count(f'"{label}"') == 1
