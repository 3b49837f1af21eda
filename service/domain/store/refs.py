"""How the store names a caller: the one record every capability of the port shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CallerRef:
    """One caller of one project, as every caller-scoped method of the store names them."""

    project: str
    #: The caller's pseudonym (never a phone number).
    subject: str
