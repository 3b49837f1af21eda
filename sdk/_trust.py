"""A call's caller-ID trust on its way to the service (SPEC section 13): the attestation a telephony provider
gave the call and whether the caller passed a step-up check in it.

The service normalises the provider's own string (Twilio's ``StirVerstat``, Telnyx's ``verstat``, Plivo's STIR
verification...) and refuses one it does not know. The SDK checks only what a request can carry, and sends
the members only when they say something, so that a service from before caller-ID trust (which refuses
unknown members) is not sent them by code that does not use them.
"""

from __future__ import annotations

import re
from typing import Any

#: The longest attestation the service takes.
MAX_ATTESTATION_CHARS = 64
_PRINTABLE = re.compile(r"[ -~]+")


def checked_attestation(value: object) -> str | None:
    """``value`` as sent (surrounding whitespace removed), or None for none (None, ``""``); ValueError for
    what no provider sends: not a string, longer than 64 characters, or not printable ASCII."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"attestation must be a string or None, not {type(value).__name__}")
    text = value.strip()
    if not text:
        return None
    if len(text) > MAX_ATTESTATION_CHARS or not _PRINTABLE.fullmatch(text):
        raise ValueError(
            "attestation must be the provider's value as sent (e.g. Twilio's StirVerstat "
            "'TN-Validation-Passed-A') or A, B, C, failed or unknown: at most 64 printable ASCII characters"
        )
    return text


def checked_step_up(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"step_up must be True or False, not {type(value).__name__}")
    return value


def body_members(attestation: str | None, step_up: bool) -> dict[str, Any]:
    """The members of a start, end or message batch body that carry the call's trust (none: ``{}``)."""
    members: dict[str, Any] = {}
    if attestation is not None:
        members["attestation"] = attestation
    if step_up:
        members["step_up"] = True
    return members


def query(attestation: str | None, step_up: bool) -> dict[str, str]:
    """The query parameters of a read that carry the call's trust (none: ``{}``)."""
    params: dict[str, str] = {}
    if attestation is not None:
        params["attestation"] = attestation
    if step_up:
        params["step_up"] = "true"
    return params


# What the framework integrations take from a provider by themselves -----------------------------------------

#: The verification results SIP carriers (``verstat``) and Twilio (``StirVerstat``, ``X-Twilio-VerStat``)
#: write, and the bare levels: what the service reads of them. A value the integrations find but do not
#: recognise is sent as ``failed`` (a verification result that cannot be read grants nothing), rather than
#: as it is (the service would refuse it, and the call would have no memory at all).
_VERSTAT = re.compile(
    r"TN-Validation-(?:Passed|Failed)(?:-[ABC](?:-Diverted)?)?|No-TN-Validation|[ABC]", re.I
)
#: The ``verstat`` parameter of a SIP header's URI (``P-Asserted-Identity``, ``From``), as 3GPP TS 24.229 puts
#: it: ``<sip:+14155550100;verstat=TN-Validation-Passed@host;user=phone>`` or after the URI's host.
_VERSTAT_PARAMETER = re.compile(r"(?:^|;)\s*verstat\s*=\s*([^;>@,\s]*)", re.I)


def from_provider(value: object, *, header: bool = False) -> str | None:
    """The attestation of a value a provider gave (a ``StirVerstat``, an ``X-Twilio-VerStat`` header), or of
    the ``verstat`` parameter in a SIP header's value with ``header=True``. None when there is none (no value,
    or a header without ``verstat``); ``"failed"`` for one that is there but not recognised."""
    if not isinstance(value, str):
        return None
    text = value.strip()
    if header:
        found = _VERSTAT_PARAMETER.search(text)
        if found is None:
            return None
        text = found.group(1)
    if not text:
        return None
    return text if _VERSTAT.fullmatch(text) else "failed"
