"""The Store interface (the port): the domain owns it and its records; every backend (service/storage)
implements it with identical semantics (see tests/storage).

Conventions for all backends:
- Times are integer milliseconds since the Unix epoch, always passed in by the caller (the service's clock),
  so that expiry is decided the same way everywhere and tests can use a fake clock.
- A caller is named by a :class:`CallerRef`: a validated project id and the caller's pseudonym (never a
  phone number).
- Field values are opaque JSON bytes; the store never parses them.
- A field whose stored ``expires_at`` is at or before ``now_ms`` is dead: it is never returned and may be
  removed by any write that touches the same caller.
- Driver errors are raised as :class:`~caller_memory.service.domain.errors.StoreUnavailable` (chained).
- Each memory operation is atomic with respect to every other operation on the same caller.

The rule a newcomer can hold: the port is ``domain/store/<capability>.py`` (:mod:`.core`, :mod:`.transcripts`,
:mod:`.webhooks`, :mod:`.links`, :mod:`.archive`; :mod:`.refs` holds :class:`CallerRef`, which they all name);
each backend implements it in ``storage/<backend>/<capability>.py``.
"""

from __future__ import annotations

from abc import ABC

from .archive import ArchiveStore
from .call_trust import CallTrustStore
from .core import (
    BUCKET_KINDS,
    AnalyticsInput,
    AuditEntry,
    ConversationEntry,
    CoreStore,
    Counters,
    EndAnalytics,
    EndResult,
    EndStatus,
    EndWrite,
    ErasureResult,
    FirstInteraction,
    ListingPage,
    Outcome,
    PatchResult,
    Recording,
    RecordStatus,
    TokenRecord,
)
from .late_transcripts import LateTranscriptStore
from .links import LinkStore
from .llm import LlmStore
from .pending_answers import PendingAnswerStore
from .platform_events import PlatformEventStore
from .platforms import PlatformStore
from .refs import CallerRef
from .remembered import RememberedStore
from .transcripts import TranscriptStore
from .webhooks import WebhookStore

__all__ = [
    "BUCKET_KINDS",
    "AnalyticsInput",
    "AuditEntry",
    "CallerRef",
    "ConversationEntry",
    "CoreStore",
    "Counters",
    "EndAnalytics",
    "EndResult",
    "EndStatus",
    "EndWrite",
    "ErasureResult",
    "FirstInteraction",
    "ListingPage",
    "Outcome",
    "PatchResult",
    "RecordStatus",
    "Recording",
    "Store",
    "TokenRecord",
]


class Store(
    CoreStore,
    TranscriptStore,
    WebhookStore,
    ArchiveStore,
    LinkStore,
    LlmStore,
    PlatformStore,
    PlatformEventStore,
    CallTrustStore,
    LateTranscriptStore,
    PendingAnswerStore,
    RememberedStore,
    ABC,
):
    """Persistent storage for projects, tokens, caller memory (:class:`CoreStore`), conversation memory
    (:class:`TranscriptStore`), webhooks (:class:`WebhookStore`), the archive's index (:class:`ArchiveStore`),
    linked identifiers (:class:`LinkStore`), the memory proxy's upstreams (:class:`LlmStore`), platform
    connections (:class:`PlatformStore`), the platform events already seen (:class:`PlatformEventStore`) each
    conversation's call trust (:class:`CallTrustStore`) a platform's late transcript
    (:class:`LateTranscriptStore`), the memory proxy's last answer of a call (:class:`PendingAnswerStore`) and
    the state keys a call remembered through MCP (:class:`RememberedStore`): what every backend implements."""
