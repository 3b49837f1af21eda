"""The log formatter masks numbers and credentials everywhere in a record, traceback included."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest
from caller_memory.service.logs import MaskingFormatter, mask_text
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import TEST_NUMBERS, Api, canonical_digits


def test_tracebacks_and_credentials_are_masked() -> None:
    try:
        raise ValueError(
            "bad header line: X-Caller: +14155550123, Authorization: Bearer cm_0123456789ab_s3cr3t"
        )
    except ValueError:
        record = logging.LogRecord(
            "aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", None, None
        )
        import sys

        record.exc_info = sys.exc_info()
    text = MaskingFormatter("%(message)s").format(record)
    assert "Traceback" in text and "ValueError" in text
    assert "4155550123" not in text and "s3cr3t" not in text


def test_the_time_and_process_of_a_line_are_kept_and_its_message_masked() -> None:
    record = logging.LogRecord(
        "caller_memory", logging.WARNING, __file__, 1, "caller %s", ("+14155550123",), None
    )
    record.created, record.msecs, record.process = 1796040000.0, 0.0, 4194301  # 2026-11-30, a 7-digit pid
    formatter = MaskingFormatter("%(asctime)s %(levelname)s [worker %(process)d]: %(message)s")
    formatter.converter = time.gmtime
    text = formatter.format(record)
    assert text == "2026-11-30 12:00:00,000 WARNING [worker 4194301]: caller [number]"


def test_ids_and_ordinary_numbers_are_left_alone() -> None:
    kept = "sweep c8d9856278ed4cd1a55e03bb96f97844 took 12.5 ms, 2048 bytes, project shop"
    assert mask_text(kept) == kept
    assert mask_text("call (415) 555-0100 or cm_0123456789ab_xyz") == "call ([number] or cm_0123456789ab_***"


async def test_a_request_aiohttp_refuses_is_logged_without_a_crash_or_a_number(
    api: Api, caplog: object
) -> None:
    host, port = api.base_url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Caller: +14155550123 \x00\r\n\r\n")
    await writer.drain()
    answer = await reader.read(200)
    writer.close()
    assert b" 400 Bad Request" in answer.split(b"\r\n", 1)[0]
    records = caplog.records  # type: ignore[attr-defined]
    text = "\n".join(r.getMessage() + (r.exc_text or "") for r in records)
    assert "Unhandled exception" not in text  # the access logger copes with a request that was never routed
    assert "UNKNOWN <unmatched> 400" in text
    assert "4155550123" not in text  # aiohttp's own error quotes the header line: masked at the source


def test_the_scheduler_logs_only_its_problems() -> None:
    from caller_memory.service.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO")
        assert not logging.getLogger("apscheduler.scheduler").isEnabledFor(logging.INFO)
        assert logging.getLogger("apscheduler.scheduler").isEnabledFor(logging.WARNING)
        assert logging.getLogger("caller_memory").isEnabledFor(logging.INFO)
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logging.getLogger("apscheduler").setLevel(logging.NOTSET)


# Every form the service accepts an identifier in is masked, escaped or not --------------------------------

_FULL_WIDTH = str.maketrans("0123456789+", "".join(map(chr, range(0xFF10, 0xFF1A))) + "\uff0b")
_ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
#: Separators libphonenumber skips inside a number (a sample of each kind), and '_' and '+'.
_SEPARATORS = [
    " ",
    "-",
    ".",
    "/",
    "(",
    ")",
    "[",
    "]",
    "~",
    "*",
    "_",
    "\u00a0",
    "\u2010",
    "\u2212",
    "\u3000",
    "\uff0d",
    "\uff0f",
    "\u200b",
    "\u00ad",
]


def _written(digits: list[str], separators: list[str]) -> str:
    return (
        "+"
        + "".join(d + s for d, s in zip(digits, separators, strict=False))
        + "".join(digits[len(separators) :])
    )


def _encodings(form: str) -> list[str]:
    from urllib.parse import quote

    once = quote(form, safe="")
    return [
        form,
        once,
        quote(once, safe=""),  # encoded twice over
        once.replace("%20", "+"),  # a query string's space
        repr(form.encode())[2:-1],  # how aiohttp quotes the bytes of a request line it refuses
    ]


@given(
    # Between two digits: nothing, one separator, or a run of them (libphonenumber skips runs of any length).
    separators=st.lists(st.lists(st.sampled_from(_SEPARATORS), max_size=6).map("".join), max_size=11),
    script=st.sampled_from([None, _FULL_WIDTH, _ARABIC_INDIC]),
)
@settings(max_examples=300, deadline=None)
def test_every_accepted_form_is_masked_in_every_escape(separators: list[str], script: Any) -> None:
    from caller_memory.service.domain.errors import InvalidIdentifier
    from caller_memory.service.domain.identifiers import normalize

    form = _written(list("14155550100"), separators)
    if script is not None:
        form = form.translate(script)
    try:
        assert normalize(form, "US") == "+14155550100"
    except InvalidIdentifier:
        return  # not a form the service accepts (e.g. two brackets in a row): nothing to promise
    for written in _encodings(form):
        line = f"Invalid char in url path: b'GET /v1/projects/shop/callers/{written}/memory HTTP/1.1'"
        masked = mask_text(line)
        assert "[number]" in masked, (form, written, masked)
        assert not TEST_NUMBERS.search(canonical_digits(masked)), (form, written, masked)


@pytest.mark.parametrize(
    "form", ["+1    415    555    0100", "+1....415....555....0100", "+1 - - 415 - - 555 - - 0100"]
)
def test_runs_of_separators_the_service_accepts_are_masked(form: str) -> None:
    from caller_memory.service.domain.identifiers import normalize

    assert normalize(form, "US") == "+14155550100"  # the service takes it as the number
    for written in _encodings(form):
        masked = mask_text(f"b'GET /v1/projects/shop/callers/{written}/memory\\x01 HTTP/1.1'")
        assert not TEST_NUMBERS.search(canonical_digits(masked)), masked
        assert "415" not in masked.replace("%", ""), masked


def test_dates_in_messages_are_not_numbers() -> None:
    text = "from: not an ISO 8601 date or date-time (e.g. 2026-11-30 or 2026-11-30T14:00:00Z)"
    assert mask_text(text) == text
    assert mask_text("on 2026-11-30 call +1 415 555 0100") == "on 2026-11-30 call [number]"
    assert mask_text("2026-11-30-0100 and 2026-1130") == "[number] and [number]"
    kept = "listening on http://127.0.0.1:18080 (API description at /openapi.json), 12.5 ms"
    assert mask_text(kept) == kept


def test_a_control_character_decoded_from_an_escape_stays_escaped() -> None:
    assert mask_text("path /a%0Ab %2B14155550100") == "path /a\\x0ab [number]"
    assert "\n" not in mask_text("GET /%0D%0AX-Injected:%20yes")


async def test_malformed_requests_holding_a_number_are_logged_masked(api: Api, caplog: Any) -> None:
    host, port = api.base_url.removeprefix("http://").split(":")
    forms = [
        "%2B14155550100",
        "%2B1%20415%20555%200100",
        "%252B1%2520415%2520555%25200100",
        "+1/415/555/0100",
        "+1_415_555_0100",
        "+1.415.555.0100",
        "(415)%20555-0100",
        "+14155550100".translate(_FULL_WIDTH),
        "+١٤١٥٥٥٥٠١٠٠",
    ]
    caplog.set_level(logging.DEBUG)
    for form in forms:
        for malformed in (b"\x01 HTTP/1.1", b" HTTP/9.9", b" HTTP/1.1 extra"):
            reader, writer = await asyncio.open_connection(host, int(port))
            path = f"/v1/projects/shop/callers/{form}/memory".encode()
            writer.write(b"GET " + path + malformed + b"\r\nHost: x\r\n\r\n")
            await writer.drain()
            answer = await reader.read()
            writer.close()
            head, _, body = answer.partition(b"\r\n\r\n")
            assert b" 400 " in head.split(b"\r\n", 1)[0]
            # The answer is a problem document that quotes nothing of the request, marked nosniff.
            assert (
                b"Content-Type: application/problem+json" in head
                and b"X-Content-Type-Options: nosniff" in head
            )
            assert b"not valid HTTP" in body and not TEST_NUMBERS.search(canonical_digits(body.decode())), (
                body
            )
    quoted = [r for r in caplog.records if r.name.startswith(("aiohttp", "caller_memory.http"))]
    assert any("not valid HTTP" in r.getMessage() for r in quoted), "no refused request was logged"
    assert not [r for r in quoted if r.levelno >= logging.ERROR], "a client's malformed request is no ERROR"
    for record in quoted:
        text = record.getMessage() + (record.exc_text or "")
        assert not TEST_NUMBERS.search(canonical_digits(text)), text


# E-mail and account identifiers (SPEC sections 13 and 14), in every form the service takes them -------------

#: (as written, what the masked line shows in its place).
_IDENTIFIERS = [
    ("email:ada@example.com", "[email]"),
    ("EMAIL:Ada.Lovelace+calls@Example.CO.UK", "[email]"),
    ("Email:ada_l@mail.example.com", "[email]"),
    ("email:ädä@exämple.de", "[email]"),
    ("email:4155550100@example.com", "[email]"),  # digits in an address: no number left around "[number]"
    ("ada@example.com", "[email]"),
    ("account:A-1234", "account:[id]"),
    ("ACCOUNT:a.b_c-9", "account:[id]"),
    ("Account:4155550100", "account:[id]"),  # an account id that is all digits
    ("account:" + "x" * 80, "account:[id]"),  # longer than the service takes: still someone's
]


def _identifier_encodings(form: str) -> list[str]:
    from urllib.parse import quote

    once = quote(form, safe="")  # ':' as %3A, '@' as %40
    return [
        form,
        once,
        once.lower(),  # %3a, %40: hex digits in either case
        quote(once, safe=""),  # encoded twice over
        quote(form, safe=":"),  # only '@' encoded
        quote(form, safe="@"),  # only ':' encoded
        repr(form.encode())[2:-1],  # how aiohttp quotes the bytes of a request line it refuses
    ]


@pytest.mark.parametrize(("form", "masked_as"), _IDENTIFIERS)
def test_email_and_account_identifiers_are_masked_in_every_escape(form: str, masked_as: str) -> None:
    secret = form.split(":", 1)[-1] if form.lower().startswith(("email:", "account:")) else form
    local = secret.split("@")[0]
    for written in _identifier_encodings(form):
        for line in (
            f"Invalid char in url path: b'GET /v1/projects/shop/callers/{written}/memory\\x01 HTTP/1.1'",
            f'{{"identifier": "{written}", "merge": true}}',
            f"link refused for {written}; retry later",
            f"GET /v1/projects/shop/callers/%2B14155550100/links/{written}?x=1",
        ):
            masked = mask_text(line)
            assert masked_as in masked, (written, masked)
            assert local.lower() not in masked.lower(), (written, masked)
            assert "@" not in masked and "%40" not in masked.lower(), (written, masked)
            assert not TEST_NUMBERS.search(canonical_digits(masked)), (written, masked)


def test_the_rest_of_a_line_around_an_identifier_is_kept() -> None:
    assert (
        mask_text("GET /v1/projects/shop/callers/email:ada@example.com/memory HTTP/1.1")
        == "GET /v1/projects/shop/callers/[email]/memory HTTP/1.1"
    )
    assert mask_text('{"identifier": "Account:A-1234", "merge": true}') == (
        '{"identifier": "account:[id]", "merge": true}'
    )
    assert (
        mask_text("mail sent to ada@example.com, cc bob@example.org.") == "mail sent to [email], cc [email]."
    )
    assert mask_text("email: ada@example.com") == "email: [email]"
    assert mask_text("callers/email%3Aada%40example.com?a=b") == "callers/[email]?a=b"
    # The phone and token masking are unchanged beside them.
    assert mask_text("account:A-1 and +1 415 555 0100 and cm_0123456789ab_s3cr3t") == (
        "account:[id] and [number] and cm_0123456789ab_***"
    )


def test_prose_about_identifiers_is_not_masked() -> None:
    for kept in (
        "identifier: account: ids are 1-64 letters, digits, '.', '_' or '-'",
        "identifier: not an e-mail address (email: needs one)",
        "identifiers are written `email:` or `account:` before the id",
        "linked 2 identifiers: kinds phone, email, account",
        "the account was erased",
        "listening on http://127.0.0.1:18080",
    ):
        assert mask_text(kept) == kept


def test_an_identifier_inside_a_longer_word_is_not_one() -> None:
    assert mask_text("subaccount:x") == "subaccount:x"
    assert mask_text("myemail:x") == "myemail:x"


def test_masking_a_long_line_stays_linear() -> None:
    line = "a" * 200_000 + " x@y.example " + "b" * 200_000 + ":" + "c" * 200_000
    started = time.perf_counter()
    masked = mask_text(line)
    assert time.perf_counter() - started < 1.0
    assert "[email]" in masked and "x@y" not in masked
