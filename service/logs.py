"""Logging set-up. Every record is masked as it is written (anything shaped like a phone number, an e-mail
address, an ``email:`` or ``account:`` identifier or a token), as a last line of defence: the code itself
never logs identifiers or secrets."""

from __future__ import annotations

import logging
import re
import traceback

#: What may stand between two digits of a phone number that the service would accept as one: the
#: punctuation libphonenumber skips when it parses (dashes of every width, dots, slashes, brackets, tildes,
#: '*', spaces of every kind, soft hyphen and zero-width characters), plus '_' and '+' (a '+' is a space in a
#: URL query). Digits are any Unicode decimal digits (libphonenumber reads full-width and Arabic-Indic ones).
SEPARATOR = (
    r"[\s\-\u2010-\u2015\u2212\u30fc\uff0d-\uff0f./()\uff08\uff09\[\]\uff3b\uff3d~\u2053\u223c\uff5e*_+"
    r"\u00ad\u200b\u2060\ufeff]"
)
#: The longest run of separators between two digits that is still one number: libphonenumber skips runs of
#: any length, and an identifier is at most 64 characters (MAX_IDENTIFIER_CHARS), so no accepted number has a
#: longer one (bounded, so the pattern stays linear).
MAX_RUN = 64
#: An ISO 8601 calendar date (2026-11-30) is left as it is: eight digits with dashes are a date.
_ISO_DATE = r"(?:1[89]|2\d)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])(?!\d|[-./_~]\d)"
#: The ids the service issues and logs, left whole: a token's id (``cm_`` + 12 hex), a webhook's (``wh_``
#: + 16), and 32 lower-case hex standing alone (pseudonyms, receipts, sweeps; also after a vendor's two
#: capitals, as Twilio's ``CA`` + 32). Not glued to another letter or digit, nor after a '+'. Their digit
#: runs are not numbers; no other word is a shelter (see _PHONE_LIKE), and shorter hex words are none: an
#: attacker's ``abc4155550100def`` is a word of 16 hex digits.
_ISSUED_ID = (
    r"(?<![^\W_])(?<![+\uff0b])(?:cm_[0-9a-f]{12}|wh_[0-9a-f]{16}|(?:[A-Z]{2})?[0-9a-f]{32})(?![^\W_])"
)
#: Runs of 7+ digits, optionally with a leading plus and separators, wherever they stand: glued to letters
#: too (``tel:+14155550100``, ``id4155550100x``, ``x+44 20 7946 0958y``), since a reader takes the number
#: out of a word as easily as out of a sentence. Only a date, and an id of the shape the service issues,
#: keep their digits; they are matched first, so a number is never looked for inside them.
_PHONE_LIKE = re.compile(
    rf"(?P<kept>(?<![^\W_])(?:{_ISO_DATE})|{_ISSUED_ID})|[+\uff0b]?\d(?:{SEPARATOR}{{0,{MAX_RUN}}}\d){{6,}}"
)
#: What a client may have written in an escaped form that a log line or error message quotes as it came:
#: percent-encoding (a URL) and ``\xNN`` escapes (the repr of the bytes aiohttp could not parse).
_ESCAPES = re.compile(r"(?:%[0-9A-Fa-f]{2})+|(?:\\x[0-9a-f]{2})+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

#: Credentials: a project token's secret part, or whatever follows "Bearer".
_TOKEN_LIKE = re.compile(r"\b(cm_[0-9a-f]{12}_)[A-Za-z0-9_-]+")
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+")

#: What ends an identifier written after its ``email:`` or ``account:`` prefix in a log line: whitespace, and
#: what delimits it in a URL, a JSON string, a quoted repr or Markdown. Everything else up to there is masked, also
#: characters the service would refuse in it (a refused identifier is still someone's).
_ID_RUN = r"[^\s/?#&=\"'`|<>,;()\[\]{}]+"
#: Identifiers of the other kinds (SPEC section 13), prefix in any case, not inside a longer word. No space
#: is taken between prefix and identifier, so that the service's own prose ("account: ids are ...") stays
#: readable; an address written after "email: " is caught by _EMAIL.
_EMAIL_ID = re.compile(rf"(?i)(?<![^\W_])email:{_ID_RUN}")
_ACCOUNT_ID = re.compile(rf"(?i)(?<![^\W_])account:{_ID_RUN}")
#: A bare e-mail address: a local part of the characters addresses use (Unicode letters and digits too;
#: not '/', which separates path segments, nor quotes) and a domain with at least one dot. It starts only
#: where such a run starts, so that a long run without an '@' is scanned once, not once per character.
_EMAIL = re.compile(r"(?<![\w.!#$*+^`{|}~-])[\w.!#$*+^`{|}~-]+@(?:[\w-]+\.)+[\w-]+")


def _unescape(match: re.Match[str]) -> str:
    text = match.group()
    decoded = bytes.fromhex(text.replace("%", "").replace("\\x", "")).decode("utf-8", "replace")
    # What decodes to a control character (a line break, say) stays escaped: a log line stays one line.
    return _CONTROL.sub(lambda c: f"\\x{ord(c.group()):02x}", decoded)


def unescaped(text: str) -> str:
    """``text`` with percent-encoding and ``\\xNN`` escapes decoded (up to three levels, as a URL may be
    encoded twice over), so that a number written escaped is masked like one written plainly."""
    for _ in range(3):
        decoded = _ESCAPES.sub(_unescape, text)
        if decoded == text:
            break
        text = decoded
    return text


def _phone(match: re.Match[str]) -> str:
    return match.group() if match.group("kept") else "[number]"


def mask_text(text: str) -> str:
    """Mask credentials, ``email:`` and ``account:`` identifiers, e-mail addresses and phone-number-shaped
    digit runs, in every form the service accepts an identifier in; escaped forms are decoded first (a
    masked line shows them decoded)."""
    if "%" in text or "\\x" in text:
        text = unescaped(text)
    text = _TOKEN_LIKE.sub(r"\1***", text)
    text = _BEARER.sub(r"\1***", text)
    if ":" in text or "@" in text:
        # Before the numbers: an address or an account id may hold a digit run, and a number masked first
        # would leave the rest of the identifier readable around "[number]".
        text = _EMAIL_ID.sub("[email]", text)
        text = _ACCOUNT_ID.sub("account:[id]", text)
        text = _EMAIL.sub("[email]", text)
    return _PHONE_LIKE.sub(_phone, text)


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
