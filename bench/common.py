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
