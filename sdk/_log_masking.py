"""The frameworks' log masking: what keeps the caller's number out of Pipecat's logs (loguru) and LiveKit's
(the standard ``logging`` module). The drop-ins install it when they are used (a ``CallerMemory``,
``remember_caller()``), or the application does at its start (``install_log_redaction()``,
``mask_livekit_logs()``); importing a module of the SDK changes no logger.

No framework is imported here: loguru only inside :func:`mask_loguru` (it comes with Pipecat, not with
LiveKit), and what is Pipecat's own (its ``PIPECAT_LOG_LLM_CONTEXT``) stays in the Pipecat drop-in.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _wire
from ._wire import mask

if TYPE_CHECKING:
    from loguru import Record

# Pipecat's loguru records ----------------------------------------------------------------------------------

#: loguru records of these modules carry telephony data (the handshake, the AudioHook open message): every
#: digit run shaped like a phone number is masked in them.
_TELEPHONY_MODULES = ("pipecat.runner", "pipecat.serializers", "pipecat.transports")
#: A number in international form, anywhere (also percent-encoded: %2B).
_E164 = re.compile(r"(?:\+|%2[Bb])[\s\-.()]?\d(?:[\s\-.()]{0,2}\d){6,14}")
#: Candidate digit runs, to compare with the numbers of the calls in progress.
_DIGIT_RUN = re.compile(r"\d(?:(?:[\s\-./()]|%20){0,3}\d){6,}")
#: The last digits of the callers of the calls in progress in this process (see CallerMemory).
_active_tails: dict[str, int] = {}
_TAIL = 7


def _digits(text: str) -> str:
    return "".join(c for c in text if c.isdigit())


def _tail(caller: str) -> str | None:
    digits = _digits(caller)
    return digits[-_TAIL:] if len(digits) >= _TAIL else None


def call_started(caller: str) -> str | None:
    """Mask any written form of ``caller``'s number in every loguru record while its call is in progress.
    Returns what :func:`call_ended` takes (None for a number too short to be told apart)."""
    tail = _tail(caller)
    if tail is not None:
        _active_tails[tail] = _active_tails.get(tail, 0) + 1
    return tail


def call_ended(tail: str) -> None:
    """The call :func:`call_started` returned ``tail`` for has ended."""
    left = _active_tails.get(tail, 1) - 1
    if left > 0:
        _active_tails[tail] = left
    else:
        _active_tails.pop(tail, None)


def _mask_known(text: str) -> str:
    def replace(match: re.Match[str]) -> str:
        digits = _digits(match.group(0))
        return "[number]" if any(tail in digits for tail in _active_tails) else match.group(0)

    return _DIGIT_RUN.sub(replace, text)


def redact_log_record(record: Record) -> None:
    """A loguru patcher: masks phone numbers in a record's message before any sink sees it.

    Every record: numbers in international form (``+44...``, ``%2B44...``) and any form of the number of a
    call in progress here (its digits, with separators, national or international). Records of Pipecat's
    telephony modules (the runner's handshake parsing, the serializers, the transports): every run of digits
    shaped like a phone number (they log the provider's first messages, before any caller is known).

    Call it from your own patcher if you configure one (``logger.configure(patcher=...)`` replaces the one
    installed by :func:`install_log_redaction`)."""
    message = record["message"]
    if not any(c.isdigit() for c in message):
        return
    if record["name"] and record["name"].startswith(_TELEPHONY_MODULES):
        message = mask(message)
    else:
        message = _E164.sub("[number]", message)
        if _active_tails:
            message = _mask_known(message)
    record["message"] = message


def _chained(previous: Callable[[Record], None] | None) -> Callable[[Record], None]:
    def patcher(record: Record) -> None:
        redact_log_record(record)
        if previous is not None:
            previous(record)

    patcher.caller_memory_redaction = True  # type: ignore[attr-defined]
    return patcher


def mask_loguru() -> None:
    """Put :func:`redact_log_record` first in loguru's patcher, chained before the app's own (found, best
    effort, as ``logger._core.patcher``: loguru has no public way to read it). Idempotent."""
    from loguru import logger

    core = getattr(logger, "_core", None)
    previous = getattr(core, "patcher", None)
    if not getattr(previous, "caller_memory_redaction", False):
        logger.configure(patcher=_chained(previous))


def mask_std_logger(name: str) -> None:
    """Put the SDK's masking filter on the std-logging logger ``name`` (once)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _wire.MaskingFilter) for f in logger.filters):
        logger.addFilter(_wire.MaskingFilter())


# LiveKit's std-logging records -----------------------------------------------------------------------------

#: The attributes every LogRecord has: the others are a call's ``extra`` (LiveKit puts room names,
#: participant identities and ``lk.pii.*`` text there, and its formatters print them all).
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
_LIVEKIT_LOGGER = re.compile(r"livekit(\.|$)")


class _MaskNumbers(logging.Filter):
    """Masks phone numbers (any written form, also percent-encoded) in a record's message and extras."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask(message)
        if masked != message or record.args:
            record.msg, record.args = masked, None
        for key, value in list(vars(record).items()):
            if key not in _RECORD_ATTRIBUTES:
                setattr(record, key, _masked(value))
        return True


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {k: _masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_masked(v) for v in value]
    return value


_FILTER = _MaskNumbers()


def mask_livekit_logs() -> None:
    """Put the masking filter on LiveKit's loggers: ``livekit``, ``livekit.agents``, the plugins', and every
    ``livekit.*`` logger that exists now (a filter on a logger does not see its children's records, so
    each one needs it; every :class:`CallMemory`, so :func:`remember_caller`, calls this again for loggers
    made since). Records of the worker process (job requests name the room) are masked too when the
    agent's module calls this at its import. Idempotent. Numbers the OpenAI client or your own code log
    are not covered."""
    names = {"livekit", "livekit.agents", "livekit.plugins", "livekit.plugins.openai", "livekit.rtc"}
    names.update(n for n in logging.root.manager.loggerDict if _LIVEKIT_LOGGER.match(n))
    for name in names:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
