"""What a telephony layer gives a Pipecat bot about its caller, read without Pipecat: the caller's number
(Twilio, Telnyx, Exotel, Plivo, Genesys AudioHook) and the call's caller-ID attestation, and both of them
from a Twilio stream's signed parameters (:func:`twilio_caller`). The Pipecat drop-in
(:mod:`caller_memory.sdk.pipecat`) exports the three functions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from . import _trust

if TYPE_CHECKING:
    from .twilio import StreamCaller


def caller_from(value: object) -> str | None:
    """The caller's number as a telephony layer gave it, or None when there is none: Telnyx and Exotel send
    ``""`` when they have no number, Twilio sends nothing unless the TwiML passes it as a ``<Parameter>``,
    Genesys AudioHook gives ``tel:+1...`` URIs."""
    if not isinstance(value, str):
        return None
    number = value.strip()
    for scheme in ("tel:", "sip:"):
        if number.lower().startswith(scheme):
            number = number[len(scheme) :].split("@", 1)[0].split(";", 1)[0]
    return number if any(c.isdigit() for c in number) else None


#: The names under which the telephony data may carry the call's attestation (any case): Twilio's own
#: parameter name, which your TwiML gives the ``<Parameter>`` of its ``<Stream>``, and the generic ones.
_ATTESTATION_KEYS = frozenset({"stirverstat", "x-twilio-verstat", "verstat", "attestation"})


def attestation_from(call_data: object) -> str | None:
    """The call's caller-ID attestation in the telephony data Pipecat parsed (``parse_telephony_websocket``'s
    ``call_data``), or None when it has none.

    Twilio posts ``StirVerstat`` (``TN-Validation-Passed-A``...) to your voice webhook, not on the media
    stream: pass it in the TwiML as a ``<Parameter name="StirVerstat">`` of the ``<Stream>``, like the number;
    Pipecat puts the parameters in ``call_data.body``. Unsigned, it is whatever the stream says: anyone who
    reaches the stream URL could claim ``TN-Validation-Passed-A``. :func:`twilio_caller` reads the signed
    parameters of :mod:`caller_memory.sdk.twilio` instead. Telnyx, Exotel and Plivo send none on the stream:
    pass ``attestation=`` from your call webhook yourself (docs/pipecat.md). A value found that is not a
    STIR/SHAKEN verification result (``TN-Validation-...``, ``No-TN-Validation``, a bare level) counts as
    ``"failed"``: one that cannot be read grants nothing."""
    for place in (_member(call_data, "body"), call_data):
        if isinstance(place, Mapping):
            for key, value in place.items():
                # ASCII before lower-casing: a look-alike key (a long s, a Kelvin sign) is no such key.
                if isinstance(key, str) and key.isascii() and key.lower() in _ATTESTATION_KEYS:
                    return _trust.from_provider(value)
    return None


def _member(call_data: object, name: str) -> object:
    if isinstance(call_data, Mapping):
        return call_data.get(name)
    return getattr(call_data, name, None)


def twilio_caller(
    call_data: object, *, secret: str | None = None, now: float | None = None, max_age: float | None = None
) -> StreamCaller:
    """The caller and attestation of a Twilio media stream as Pipecat parsed it (``call_data.body``, the
    ``start`` message's custom parameters, and ``call_data.call_id``), checked as
    :func:`caller_memory.sdk.twilio.read_stream_parameters` checks them: with a secret (``secret``, else
    ``CALLER_MEMORY_TWILIO_SECRET``) only parameters your voice webhook signed for this call in the last
    5 minutes are read; without one and without ``cm_sig``, ``from_number`` and ``StirVerstat`` as given."""
    from . import twilio

    body = _member(call_data, "body")
    call_sid = _member(call_data, "call_id")
    return twilio.read_stream_parameters(
        body if isinstance(body, Mapping) else None,
        call_sid if isinstance(call_sid, str) else None,
        secret=secret,
        now=now,
        max_age=twilio.MAX_AGE if max_age is None else max_age,
    )
