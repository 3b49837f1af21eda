"""Caller Memory Python SDK: ``conv.memory`` (read-only, cached per turn) and ``conv.state`` (written at the
end of the call) for voice agent code.

::

    from caller_memory.sdk import MemoryClient

    async with MemoryClient(url, token=AGENT_TOKEN, project="cheese-shop") as client:
        conv = client.conversation("conv-123", caller="+14155550100")
        await conv.begin_turn()
        name = conv.memory.get("caller_name")
        conv.state["booking_day"] = "Friday"
        await conv.end(qa="resolved")

Exceptions are described in :mod:`caller_memory.sdk.errors`.
"""

import logging

from . import _wire
from ._version import __version__ as __version__  # the distribution's version (not in __all__)
from .client import MemoryClient
from .conversation import Conversation, EndResult
from .errors import (
    AuthenticationError,
    CallerMemoryError,
    ClientClosedError,
    ConflictError,
    GoneError,
    InvalidRequestError,
    NotFoundError,
    OutboxUnavailableError,
    PermissionDeniedError,
    PreconditionFailedError,
    ServiceError,
    ServiceUnavailableError,
    TranscriptsFullError,
)
from .memory import Memory
from .outbox import FlushReport, Outbox, OutboxEntry, default_outbox_path
from .policies import CircuitBreaker, RetryPolicy
from .render import render_memory
from .transcript import (
    ChatMessage,
    Context,
    ContextProfile,
    ContextSummary,
    History,
    RecentTurns,
    Resume,
    TranscriptError,
    TranscriptInfo,
    TranscriptMessage,
)

__all__ = [
    "AuthenticationError",
    "CallerMemoryError",
    "ChatMessage",
    "CircuitBreaker",
    "ClientClosedError",
    "ConflictError",
    "Context",
    "ContextProfile",
    "ContextSummary",
    "Conversation",
    "EndResult",
    "FlushReport",
    "GoneError",
    "History",
    "InvalidRequestError",
    "Memory",
    "MemoryClient",
    "NotFoundError",
    "Outbox",
    "OutboxEntry",
    "OutboxUnavailableError",
    "PermissionDeniedError",
    "PreconditionFailedError",
    "RecentTurns",
    "Resume",
    "RetryPolicy",
    "ServiceError",
    "ServiceUnavailableError",
    "TranscriptError",
    "TranscriptInfo",
    "TranscriptMessage",
    "TranscriptsFullError",
    "default_outbox_path",
    "render_memory",
]

# Library convention: the application decides where log records go (logging.basicConfig or its own setup).
# Every record of the SDK's logger is masked (numbers and e-mail addresses, also percent-encoded) first.
_log = logging.getLogger("caller_memory.sdk")
_log.addHandler(logging.NullHandler())
if not any(isinstance(f, _wire.MaskingFilter) for f in _log.filters):
    _log.addFilter(_wire.MaskingFilter())
