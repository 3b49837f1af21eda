"""Issue 27, item 13: a phone number glued to letters (``id4155550100x``, ``tel:+14155550100``) is masked
like a free-standing one, in every problem document and every log line that quotes what a client sent, on
every backend, through the real server."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from urllib.parse import quote

import orjson
import pytest
from caller_memory.service.logs import MaskingFormatter, mask_text

from tests.conftest import OPERATOR_TOKEN, Api, canonical_digits
from tests.http.test_api import CONFIG, memory_path

PROJECT = "cheese-shop"

#: (how it is written, the digits a reader must not find). ``tel:`` and ``_`` were masked before (they are
#: not letters): kept as controls. The last two are words of hex digits: no shelter.
GLUED = [
    ("abc+14155550100xyz", "4155550100"),
    ("tel:+14155550100", "4155550100"),
    ("id4155550100x", "4155550100"),
    ("x+44 20 7946 0958y", "2079460958"),
    ("call_4155550100_now", "4155550100"),
    ("abc4155550100def", "4155550100"),
    ("ab4155550100", "4155550100"),
]


class _Lines(logging.Handler):
    """The log lines as the service writes them (configure_logging's formatter), and the records of the
    loggers that are masked at their source, as emitted."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(MaskingFormatter("%(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))
        if record.name.startswith("aiohttp."):
            self.lines.append(record.getMessage())


@pytest.fixture
def log_lines() -> Iterator[list[str]]:
    handler = _Lines()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield handler.lines
    finally:
        root.removeHandler(handler)


def _shows(text: str, digits: str) -> bool:
    return digits in canonical_digits(text)


@pytest.mark.parametrize(("glued", "digits"), GLUED)
async def test_a_number_glued_to_letters_is_in_no_problem_document_and_no_log_line(
    api: Api, log_lines: list[str], glued: str, digits: str
) -> None:
    tokens = await api.project_with_tokens(PROJECT, CONFIG)
    segment = quote(glued, safe="")
    duplicate = orjson.dumps(glued).decode()
    replies = [
        # A project id in the path: the 404 names it, and the access log line names the project.
        await api.call("GET", f"/v1/projects/{segment}/callers/+14155550100/memory", token=OPERATOR_TOKEN),
        # An id in the path that the 404 quotes.
        await api.call("GET", f"/v1/projects/{PROJECT}/webhooks/{segment}", token=tokens["admin"]),
        # A field name the project does not declare.
        await api.call("PATCH", memory_path(PROJECT), token=tokens["admin"], json={glued: 1}),
        # A member named twice (the JSON reader's own error).
        await api.call(
            "PATCH",
            memory_path(PROJECT),
            token=tokens["admin"],
            data=f"{{{duplicate}: 1, {duplicate}: 2}}",
            headers={"Content-Type": "application/json"},
        ),
        # A configuration key pydantic does not know (its validation error names the member).
        await api.call(
            "PUT",
            f"/v1/projects/{PROJECT}",
            token=OPERATOR_TOKEN,
            json={"memory": {"repeat_caller": {"retention": "P30D", glued: 1}}},
        ),
    ]
    echoed = 0
    for reply in replies:
        assert 400 <= reply.status < 500, reply.body
        assert reply.content_type == "application/problem+json"
        text = orjson.dumps(reply.body).decode()
        assert not _shows(text, digits), text
        assert digits[-4:] not in text, text  # nor its tail (a number cut in two by a partial mask)
        echoed += "[number]" in text  # the detail still says what was wrong, around the number
    assert echoed >= 3, "the undeclared field, the repeated member and the unknown key are named"
    assert log_lines, "the requests were logged"
    for line in log_lines:
        assert not _shows(line, digits), line
    assert any("project=" in line and "[number]" in line for line in log_lines), log_lines


def test_only_the_ids_the_service_issues_keep_their_digits() -> None:
    kept = (
        "sweep 0c8d9856278e4cd1a55e03bb96f97844, webhook wh_01234567890abcde, token cm_0123456789ab_***, "
        "call CA0123456789abcdef0123456789abcdef, on 2026-11-30T14:00:00Z"
    )
    assert mask_text(kept) == kept
    for glued, _ in GLUED:
        assert "[number]" in mask_text(f"refused {glued}!"), glued
    # An id's shape glued to a letter, or after a '+', is no id.
    assert mask_text("x0c8d9856278e4cd1a55e03bb96f97844") == "x0c8d[number]e4cd1a55e03bb96f97844"
    assert mask_text("wh_0123456789abcdef0") == "wh_[number]abcdef0"
