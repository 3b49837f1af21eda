"""Logging set-up. A filter masks anything that looks like a phone number in every record, as a last line
of defence: the code already never logs identifiers."""

from __future__ import annotations

import logging
import re

#: Runs of 7+ digits, optionally with a leading '+' and the separators people write numbers with, that are
#: not part of a longer word (hex ids and pseudonyms hold digit runs too, and are not numbers).
_PHONE_LIKE = re.compile(r"(?<![0-9A-Za-z])\+?\d(?:[\s().-]{0,2}\d){6,}(?![0-9A-Za-z])")


def mask_text(text: str) -> str:
    return _PHONE_LIKE.sub("[number]", text)


class MaskPhoneNumbers(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_text(message)
        if masked != message:
            record.msg, record.args = masked, None
        return True


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(MaskPhoneNumbers())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
