"""The log formatter masks numbers and credentials everywhere in a record, traceback included."""

from __future__ import annotations

import asyncio
import logging
import time

from caller_memory.service.logs import MaskingFormatter, mask_text

from tests.conftest import Api


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
