"""Logging set-up. Every record is masked as it is written (anything shaped like a phone number or a token),
as a last line of defence: the code itself never logs identifiers or secrets."""

from __future__ import annotations

import logging
import re
import traceback

#: Runs of 7+ digits, optionally with a leading '+' and the separators people write numbers with, that are
#: not part of a longer word (hex ids and pseudonyms hold digit runs too, and are not numbers).
_PHONE_LIKE = re.compile(r"(?<![0-9A-Za-z])\+?\d(?:[\s().-]{0,2}\d){6,}(?![0-9A-Za-z])")


#: Credentials: a project token's secret part, or whatever follows "Bearer".
_TOKEN_LIKE = re.compile(r"\b(cm_[0-9a-f]{12}_)[A-Za-z0-9_-]+")
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")


def mask_text(text: str) -> str:
    """Mask phone-number-shaped digit runs and credentials."""
    text = _TOKEN_LIKE.sub(r"\1***", text)
    text = _BEARER.sub(r"\1***", text)
    return _PHONE_LIKE.sub("[number]", text)


class MaskingFormatter(logging.Formatter):
    """Masks what a record may quote from a client: its message, traceback and stack (an exception's text
    may quote a request line or header; aiohttp's own errors do). The rest of the line (time, level,
    logger, process id) is the service's own and is left as it is: masked, a timestamp's date and hour
    look like a phone number."""

    def format(self, record: logging.LogRecord) -> str:
        record.message = mask_text(record.getMessage())
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        text = self.formatMessage(record)
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + mask_text(record.exc_text)
        if record.stack_info:
            text += "\n" + mask_text(self.formatStack(record.stack_info))
        return text


class MaskRecords(logging.Filter):
    """Masks a record at its source, so that every handler (not only ours) sees it masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = mask_text("".join(traceback.format_exception(*record.exc_info)).rstrip())
            record.exc_info = None
        return True


#: Loggers whose records may quote what a client sent (aiohttp's parser errors quote header lines).
_CLIENT_QUOTING_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.access", "aiohttp.internal")


def install_log_masking() -> None:
    """Mask records of the loggers that may quote client input, at the source (idempotent)."""
    for name in _CLIENT_QUOTING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, MaskRecords) for f in logger.filters):
            logger.addFilter(MaskRecords())


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(MaskingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # APScheduler logs every job it adds and runs at INFO; the service logs its sweeps itself.
    logging.getLogger("apscheduler").setLevel(max(logging.WARNING, root.level))
