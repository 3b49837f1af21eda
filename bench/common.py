"""What every benchmark process agrees on: the project, the callers' numbers and their field values.

Kept free of the service's imports: the load generator imports it too.
"""

from __future__ import annotations

import hashlib
import hmac
import os

PROJECT = "bench"
#: Fields per stored caller, and the JSON value of each: 32 bytes ("" + 30 characters).
FIELDS = [f"field_{i}" for i in range(10)]
VALUE = b'"' + b"x" * 30 + b'"'
#: First national number of the callers: caller i is +1 212 2xx xxxx (US numbers, 10 digits, "possible").
_FIRST = 2_000_000


def caller_phone(index: int) -> str:
    """E.164 number of caller ``index`` (0 <= index < 8,000,000)."""
    return f"+1212{_FIRST + index:07d}"


def quote_phone(e164: str) -> str:
    """The number as the SDK puts it in a URL path (``quote(..., safe="")``)."""
    return "%2B" + e164[1:]


def pseudonym(key: bytes, project: str, e164: str) -> str:
    """The service's pseudonym of a caller (service/domain/identifiers.py ``Pseudonymizer``)."""
    return hmac.new(key, f"{project}\x00{e164}".encode(), hashlib.sha256).hexdigest()[:32]


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def all_cpu_seconds() -> dict[int, float]:
    """CPU time so far of every process on the machine (kernel threads included), by pid."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                out[int(entry)] = cpu_seconds(int(entry))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return out


# Conversation memory (bench/transcripts.py) -------------------------------------------------------------

#: Where a benchmark call's messages are said: one channel for every conversation.
CHANNEL = "voice"
#: Characters of one benchmark message's content.
MESSAGE_CHARS = 100
_WORDS = (
    "could you move my delivery to the office address instead of home please "
    "sure I can help with that let me check the order and the slots that are still open this week "
    "the parcel is waiting at the depot and the driver will call you before he arrives at the door"
).split()


def _text(seed: int) -> str:
    """About MESSAGE_CHARS characters of words (no digits: like most of what callers say, the service's
    phone-number matcher is not run on it), cut to exactly MESSAGE_CHARS."""
    words, size, i = [], 0, seed
    while size <= MESSAGE_CHARS:
        word = _WORDS[(i * 7 + seed * 13) % len(_WORDS)]
        words.append(word)
        size += len(word) + 1
        i += 1
    return " ".join(words)[:MESSAGE_CHARS]


#: 64 different contents, reused in turn (building one per request would load the load generator).
TEXTS = [_text(seed) for seed in range(64)]


def transcript_message(n: int, timestamp: int, message_id: str | None = None) -> dict[str, object]:
    """Message ``n`` (0, 1, 2, ...) of a benchmark conversation, in the platform layout (SPEC section 10):
    even ones the caller's (speech recognition), odd ones the agent's answers, two per turn."""
    message: dict[str, object] = {
        "role": "user" if n % 2 == 0 else "assistant",
        "content": TEXTS[n % len(TEXTS)],
        "turn_id": n // 2,
        "timestamp": timestamp,
        "metadata": {"source": "asr" if n % 2 == 0 else "llm"},
    }
    return message if message_id is None else {"message_id": message_id, **message}


def append_document(
    caller: int, first: int, count: int, timestamp: int, *, message_ids: bool = True
) -> dict[str, object]:
    """The body of ``POST .../conversations/{id}/messages`` for messages ``first`` to ``first + count - 1``
    of caller ``caller``'s conversation, as the SDK sends it: the caller and the channel on every batch (the
    service redacts the caller's own number written in their national format only when it knows the caller),
    message ids ``m<12 letters>.<n>`` (random per conversation in the SDK; here derived from the caller),
    ``sent_at``."""
    prefix = "m" + "".join(chr(97 + (caller // 26**k) % 26) for k in range(12))
    document: dict[str, object] = {"caller": caller_phone(caller), "channel": CHANNEL}
    document["messages"] = [
        transcript_message(n, timestamp + n, f"{prefix}.{n + 1}" if message_ids else None)
        for n in range(first, first + count)
    ]
    document["sent_at"] = timestamp
    return document
