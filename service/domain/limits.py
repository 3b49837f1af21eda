"""Documented limits on what the service accepts (see docs/api.md, "Limits and input rules")."""

from __future__ import annotations

import re


def _whole(pattern: str) -> re.Pattern[str]:
    r"""``pattern`` (written ``^...$`` for JSON Schema and OpenAPI) compiled to match a whole string of ASCII
    only: Python's ``$`` also matches before a trailing line break, and its ``\d`` any Unicode digit."""
    return re.compile(r"\A(?:" + pattern.removeprefix("^").removesuffix("$") + r")\Z", re.ASCII)


#: Field names: a letter or underscore, then letters, digits or underscores; 64 characters at most.
FIELD_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
FIELD_NAME_RE = _whole(FIELD_NAME_PATTERN)

#: Project ids: lowercase letters, digits, '-' and '_', starting with a letter or digit; 63 characters at most.
PROJECT_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
PROJECT_ID_RE = _whole(PROJECT_ID_PATTERN)

#: At most this many keys in ``state_keys``, so a caller's memory has at most this many fields.
MAX_STATE_KEYS = 64
#: Largest JSON encoding of one field value, in bytes.
MAX_VALUE_BYTES = 2048
#: Largest number of entries in ``identifier_blacklist``.
MAX_BLACKLIST = 1000
#: Largest request body, in bytes (HTTP 413 beyond).
MAX_BODY_BYTES = 64 * 1024
#: Shortest and longest retention or field TTL, in seconds.
MIN_TTL_SECONDS = 1
MAX_TTL_SECONDS = 10 * 366 * 86400
#: Largest raw identifier accepted before parsing (a phone number written with spaces and punctuation).
MAX_IDENTIFIER_CHARS = 64
#: An email address (RFC 5321's path limit), and any identifier as a client may send it (``email:`` and one).
MAX_EMAIL_CHARS = 254
MAX_ANY_IDENTIFIER_CHARS = 8 + MAX_EMAIL_CHARS

#: Token ids: 12 hex digits (the part of a token between ``cm_`` and the secret).
TOKEN_ID_PATTERN = r"^[0-9a-f]{12}$"
TOKEN_ID_RE = _whole(TOKEN_ID_PATTERN)

#: Conversation ids, as voice platforms make them (UUIDs, "conv-123", "CA1234:leg-2").
CONVERSATION_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
CONVERSATION_ID_RE = _whole(CONVERSATION_ID_PATTERN)

#: Channels, agent names and a message's agent (what tokens, projects and conversations name).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$"
#: Most keys in the ``state`` of one ended conversation (persisted and ignored together).
MAX_STATE_ENTRIES = 256
#: Longest outcome value (qa, handoff_reason, handoff_to) and channel name.
MAX_OUTCOME_CHARS = 128
#: How long a conversation id is remembered (a retry within it applies nothing twice), and how long an erased
#: caller's tombstone is kept (a write made before the erasure and delivered within it is dropped). Never
#: longer than the project's retention.
RECALL_WINDOW_MS = 7 * 86_400_000
