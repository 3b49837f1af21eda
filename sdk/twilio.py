"""Twilio: carry the caller and the call's STIR/SHAKEN attestation from your voice webhook to your bot, signed.

Twilio gives the caller's number (``From``) and the attestation (``StirVerstat``) only to the voice webhook
("A call comes in"), never inside a Media Stream or a ConversationRelay session. Your webhook therefore passes
them on in the TwiML, as ``<Parameter>`` elements of the ``<Stream>`` (or ``<ConversationRelay>``), and the
bot reads them from the stream's ``start`` message (``start.customParameters``; ConversationRelay: the
``setup`` message's ``customParameters``). Anyone who finds the bot's websocket URL can send a ``start`` of
their own, though, with any number and ``TN-Validation-Passed-A`` in it. So the parameters this module writes
are signed, and the bot refuses a set whose signature is missing, wrong or stale.

The webhook's side::

    from caller_memory.sdk.twilio import stream_parameters, twiml, validate_webhook

    if not validate_webhook(url, form, headers.get("X-Twilio-Signature"), TWILIO_AUTH_TOKEN):
        return 403
    return twiml("wss://bot.example.com/ws", stream_parameters(form))

The bot's side: :func:`read_stream_parameters` (the Pipecat drop-in's ``twilio_caller(call_data)`` calls it).

**The secret.** ``cm_sig`` is an HMAC-SHA256 made with a secret of the project's own that the webhook server
and the bot both read, by default from the environment variable ``CALLER_MEMORY_TWILIO_SECRET`` (at least 32
characters: ``python -c "import secrets; print(secrets.token_urlsafe(32))"``). It is neither Twilio's Auth
Token nor a Caller Memory token: it only proves that your webhook wrote the parameters. Setting it on the bot
turns the check on: from then on a stream without valid signed parameters has no caller and no attestation.

The parameters (nothing else in them is a phone number):

=================== ===========================================================================================
``from_number``     the caller's number as the webhook's ``From`` gave it (left out when there is none); the
                    name Pipecat reads into ``call_data.from_number``
``cm_attestation``  the attestation, normalised from ``StirVerstat``: ``A``, ``B``, ``C``, ``failed`` or
                    ``unknown`` (:func:`attestation_of`)
``cm_time``         when the webhook signed them, UTC (``2026-12-07T10:00:00Z``)
``cm_sig``          base64url (no padding) of HMAC-SHA256(secret, the signed text): the format version, the
                    call's ``CallSid``, the caller, the attestation and the time, as a JSON array
=================== ===========================================================================================

The signature binds the ``CallSid``: a set copied into another call's stream is refused. A set is fresh for 5
minutes (:data:`MAX_AGE`) after ``cm_time`` and never more than a minute (:data:`MAX_AHEAD`) before it (the
two servers' clocks may differ a little). Within those 5 minutes a copy of the whole ``start`` message (the
same ``CallSid``) would pass: keep the stream on ``wss://``, and out of logs.

This module needs no ``twilio`` package: the standard library's ``hmac``, ``hashlib`` and ``xml``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit
from xml.etree import ElementTree

from ._telephony import attestation_from, caller_from

__all__ = [
    "ATTESTATION_PARAMETER",
    "CALLER_PARAMETER",
    "MAX_AGE",
    "MAX_AHEAD",
    "SECRET_ENV",
    "SIGNATURE_HEADER",
    "SIGNATURE_PARAMETER",
    "SIGNATURE_SETTINGS_HEADER",
    "TIME_PARAMETER",
    "StreamCaller",
    "attestation_of",
    "read_stream_parameters",
    "stream_parameters",
    "twiml",
    "validate_webhook",
    "webhook_signature",
]

#: The environment variable the webhook server and the bot read the project's signing secret from.
SECRET_ENV = "CALLER_MEMORY_TWILIO_SECRET"
#: The shortest secret taken (``secrets.token_urlsafe(32)`` writes 43 characters).
MIN_SECRET_CHARS = 32
#: How long after ``cm_time`` a set of parameters is taken, in seconds.
MAX_AGE = 300.0
#: How far ahead of the bot's clock ``cm_time`` may be, in seconds.
MAX_AHEAD = 60.0

CALLER_PARAMETER = "from_number"
ATTESTATION_PARAMETER = "cm_attestation"
TIME_PARAMETER = "cm_time"
SIGNATURE_PARAMETER = "cm_sig"

#: The header Twilio signs its webhooks in.
SIGNATURE_HEADER = "X-Twilio-Signature"
#: The header of a webhook signed with a Webhooks SharedKey: ``key=<id>,algorithm=HMAC_SHA256``.
SIGNATURE_SETTINGS_HEADER = "X-Twilio-Webhooks-Signature-Settings"

_VERSION = "caller-memory/twilio/1"
_ATTESTATIONS = frozenset({"A", "B", "C", "failed", "unknown"})
_ALGORITHMS = {"HMAC_SHA1": hashlib.sha1, "HMAC_SHA256": hashlib.sha256}
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")
_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
#: Twilio's verification results (``StirVerstat``; Elastic SIP Trunking's ``X-Twilio-VerStat`` alike).
_PASSED = re.compile(r"TN-Validation-Passed-([ABC])(?:-Diverted)?", re.I)
_NOT_VALIDATED = re.compile(r"No-TN-Validation(?:-Diverted)?", re.I)

log = logging.getLogger("caller_memory.sdk.twilio")


# The voice webhook ------------------------------------------------------------------------------------------


def webhook_signature(
    url: str, params: Mapping[str, Any] | None, key: str, *, algorithm: str = "HMAC_SHA1"
) -> str:
    """The ``X-Twilio-Signature`` Twilio computes for a form-encoded webhook: base64 of the HMAC (SHA-1 with
    the account's Auth Token; SHA-256 with a Webhooks SharedKey) of the URL Twilio requested, followed by
    every POST parameter's name and value, names in sorted order (a name sent several times: each of its
    distinct values, sorted). ValueError for an algorithm other than ``HMAC_SHA1`` and ``HMAC_SHA256``."""
    digest = _ALGORITHMS.get(algorithm.upper())
    if digest is None:
        raise ValueError("algorithm must be HMAC_SHA1 or HMAC_SHA256")
    text = [url]
    for name in sorted(set(params or ())):
        text.extend(name + value for value in sorted(set(_values(params, name))))
    mac = hmac.new(key.encode(), "".join(text).encode(), digest)
    return base64.b64encode(mac.digest()).decode()


def validate_webhook(
    url: str,
    params: Mapping[str, Any] | None,
    signature: str | None,
    auth_token: str,
    *,
    settings_header: str | None = None,
) -> bool:
    """Whether ``signature`` (the request's ``X-Twilio-Signature``) is Twilio's for this request: ``url`` is
    the full URL Twilio requested, as it was configured in Twilio (scheme, host, path and query; behind a
    proxy, the public one, not the one your server sees), ``params`` every POST parameter of the body
    (a dict, or a multi-dict as frameworks parse forms: aiohttp, Starlette, Flask, Django).
    ``auth_token`` is the account's Auth Token, or the SharedKey's secret when the request has
    ``X-Twilio-Webhooks-Signature-Settings`` (pass that header as ``settings_header``: it names the
    algorithm). Twilio computes the signature on the URL both with and without its default port, so both
    are tried. Compared in constant time.

    Pass every parameter as received, ``StirVerstat`` and ``CallToken`` included when the request has them.
    They are ordinary POST parameters of the voice webhook and Twilio signs them like ``From`` or
    ``CallSid`` (Twilio's documentation: validate with all received parameters, since new ones may be added
    without notice). A request whose signature holds only with some parameters left out is refused: those
    parameters would then be unsigned, and ``StirVerstat`` is the one a forger would add."""
    if not isinstance(signature, str) or not signature.isascii() or not isinstance(auth_token, str):
        return False
    algorithm = _algorithm(settings_header)
    if algorithm is None:
        return False
    valid = False
    for candidate in _with_and_without_port(url):
        expected = webhook_signature(candidate, params, auth_token, algorithm=algorithm)
        valid |= hmac.compare_digest(expected, signature)
    return valid


def attestation_of(stir_verstat: object) -> str:
    """Twilio's ``StirVerstat`` normalised: ``TN-Validation-Passed-A`` (also ``-Diverted``, a forwarded call
    whose diversion was verified) gives ``A``, likewise ``B`` and ``C``; ``TN-Validation-Failed`` with or
    without a level gives ``failed``; ``No-TN-Validation`` (the call's PASSporT was not validated) and no
    value at all (Twilio sends none for a call without a PASSporT) give ``unknown``. Anything else gives
    ``failed``, Telnyx's bare ``TN-Validation-Passed`` included: it is not a value Twilio writes, and a
    result that cannot be read grants nothing."""
    if stir_verstat is None:
        return "unknown"
    if not isinstance(stir_verstat, str) or not stir_verstat.isascii():
        return "failed"
    text = stir_verstat.strip()
    if not text or _NOT_VALIDATED.fullmatch(text):
        return "unknown"
    passed = _PASSED.fullmatch(text)
    if passed:
        return passed.group(1).upper()
    return "failed"  # TN-Validation-Failed[-A|B|C][-Diverted], and whatever cannot be read


def stream_parameters(
    params: Mapping[str, Any],
    *,
    secret: str | None = None,
    caller: str | None = None,
    now: float | None = None,
) -> list[tuple[str, str]]:
    """The ``<Parameter>`` names and values, in order, that carry the call's caller and attestation to the
    bot, signed: from the voice webhook's ``params`` (validate them first: :func:`validate_webhook`),
    which give ``CallSid``, ``From`` (the caller, unless ``caller`` names another: the callee of an outbound
    call) and ``StirVerstat``. ``secret``: the project's signing secret, by default the environment
    variable ``CALLER_MEMORY_TWILIO_SECRET``; ValueError when there is none, or a shorter one than 32
    characters, or no ``CallSid``. ``now``: the signing time (seconds since the epoch), by default now."""
    key = _secret(secret, required=True)
    assert key is not None
    call_sid = _single(params, "CallSid")
    if not call_sid:
        raise ValueError("the webhook's parameters have no CallSid")
    number = caller_from(caller if caller is not None else _single(params, "From")) or ""
    attestation = attestation_of(_single(params, "StirVerstat"))
    signed_at = datetime.fromtimestamp(int(time.time() if now is None else now), UTC).strftime(_TIME_FORMAT)
    signature = _signature(key, call_sid, number, attestation, signed_at)
    pairs = [(CALLER_PARAMETER, number)] if number else []
    pairs += [
        (ATTESTATION_PARAMETER, attestation),
        (TIME_PARAMETER, signed_at),
        (SIGNATURE_PARAMETER, signature),
    ]
    return pairs


def twiml(url: str, parameters: Iterable[tuple[str, str]], *, relay: bool = False, **attributes: str) -> str:
    """A TwiML document that connects the call to your bot: ``<Response><Connect><Stream url=...>`` (or
    ``<ConversationRelay url=...>`` with ``relay=True``; give its other attributes, such as
    ``welcomeGreeting``, as keywords) with one ``<Parameter name= value=/>`` per pair, escaped as XML.
    Building it with the ``twilio`` package's ``VoiceResponse`` gives the same document."""
    response = ElementTree.Element("Response")
    connect = ElementTree.SubElement(response, "Connect")
    tag = "ConversationRelay" if relay else "Stream"
    target = ElementTree.SubElement(connect, tag, {"url": url, **attributes})
    for name, value in parameters:
        ElementTree.SubElement(target, "Parameter", {"name": name, "value": value})
    body = ElementTree.tostring(response, encoding="unicode", short_empty_elements=True)
    return '<?xml version="1.0" encoding="UTF-8"?>' + body


# The bot ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamCaller:
    """What a stream's parameters say about its caller, once read (:func:`read_stream_parameters`)."""

    #: The caller's number, or None: none passed, or the parameters were refused (no memory for the call).
    number: str | None
    #: The call's attestation for ``attestation=`` (signed: ``A``, ``B``, ``C``, ``failed`` or ``unknown``;
    #: unsigned: the ``StirVerstat`` value passed, if any), or None.
    attestation: str | None
    #: Whether the parameters were signed and the signature held (False for unsigned ones, and refused ones).
    signed: bool
    #: Why the parameters were refused (a sentence without any of their values), or None.
    refused: str | None = None


def read_stream_parameters(
    parameters: Mapping[str, Any] | None,
    call_sid: str | None,
    *,
    secret: str | None = None,
    now: float | None = None,
    max_age: float = MAX_AGE,
) -> StreamCaller:
    """The caller and attestation of a stream: ``parameters`` are the ``start`` message's
    ``customParameters`` (Pipecat: ``call_data.body``; ConversationRelay: the ``setup`` message's), and
    ``call_sid`` the stream's ``callSid``.

    With a secret (``secret``, else ``CALLER_MEMORY_TWILIO_SECRET``), only a set signed with it for this
    ``CallSid`` within ``max_age`` seconds is read. Any other (no ``cm_sig``, a wrong or stale one, another
    call's) is refused: no number and no attestation, so the call has no caller memory at all. Likewise a
    signed set when the bot has no secret to check it with. A refusal is logged at WARNING on
    ``caller_memory.sdk.twilio`` with its reason, never a value.

    Without a secret and without ``cm_sig``, as before signing existed: the number is ``from_number`` and
    the attestation a ``StirVerstat`` parameter, both as the stream gave them, trusted though anyone who
    reaches the stream URL could have written them."""
    given = parameters if isinstance(parameters, Mapping) else {}
    key = _secret(secret, required=False)
    if key is None and SIGNATURE_PARAMETER not in given:
        return StreamCaller(caller_from(given.get(CALLER_PARAMETER)), attestation_from(given), signed=False)
    why = _refusal(given, call_sid, key, now, max_age)
    if why is not None:
        log.warning("call %s: the stream's caller parameters were refused (%s)", _sid(call_sid), why)
        return StreamCaller(None, None, signed=False, refused=why)
    attestation = given[ATTESTATION_PARAMETER]
    return StreamCaller(caller_from(given.get(CALLER_PARAMETER)), attestation, signed=True)


def _refusal(
    given: Mapping[str, Any], call_sid: str | None, key: str | None, now: float | None, max_age: float
) -> str | None:
    if key is None:
        return f"signed, but the bot has no secret to check them ({SECRET_ENV})"
    signature, signed_at = given.get(SIGNATURE_PARAMETER), given.get(TIME_PARAMETER)
    caller, attestation = given.get(CALLER_PARAMETER, ""), given.get(ATTESTATION_PARAMETER)
    if not isinstance(signature, str) or not signature:
        return f"no {SIGNATURE_PARAMETER}"
    if not isinstance(call_sid, str) or not call_sid:
        return "the stream has no callSid"
    if not isinstance(caller, str) or not isinstance(attestation, str) or attestation not in _ATTESTATIONS:
        return "malformed parameters"
    if not isinstance(signed_at, str) or not _TIME.fullmatch(signed_at):
        return f"no readable {TIME_PARAMETER}"
    try:
        at = datetime.strptime(signed_at, _TIME_FORMAT).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return f"no readable {TIME_PARAMETER}"
    expected = _signature(key, call_sid, caller, attestation, signed_at)
    if not signature.isascii() or not hmac.compare_digest(expected, signature):
        return f"a {SIGNATURE_PARAMETER} that does not match"
    age = (time.time() if now is None else now) - at
    if age > max_age:
        return "a stale signature"
    if age < -MAX_AHEAD:
        return "a signature from the future"
    return None


# Helpers ------------------------------------------------------------------------------------------------------


def _signature(key: str, call_sid: str, caller: str, attestation: str, signed_at: str) -> str:
    text = json.dumps([_VERSION, call_sid, caller, attestation, signed_at], separators=(",", ":"))
    mac = hmac.new(key.encode(), text.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode()


def _secret(secret: str | None, *, required: bool) -> str | None:
    key = secret if secret is not None else os.environ.get(SECRET_ENV) or None
    if key is None:
        if required:
            raise ValueError(f"no signing secret: pass secret= or set {SECRET_ENV}")
        return None
    if not isinstance(key, str) or len(key) < MIN_SECRET_CHARS:
        raise ValueError(f"the signing secret ({SECRET_ENV}) must be at least {MIN_SECRET_CHARS} characters")
    return key


def _values(params: Any, name: str) -> list[str]:
    """Every value of ``name`` in a dict or a framework's multi-dict, as strings."""
    for method in ("getall", "getlist"):  # aiohttp, Starlette and Werkzeug; Django
        getter = getattr(params, method, None)
        if callable(getter):
            found = getter(name)
            break
    else:
        found = params[name]
    if isinstance(found, str) or not isinstance(found, Sequence):
        found = [found]
    return [value if isinstance(value, str) else str(value) for value in found]


def _single(params: Mapping[str, Any], name: str) -> str | None:
    if name not in params:
        return None
    values = _values(params, name)
    return values[0] if values else None


def _algorithm(settings_header: str | None) -> str | None:
    """The algorithm a ``X-Twilio-Webhooks-Signature-Settings`` header names (HMAC_SHA1 without one), or
    None for one this module does not know."""
    algorithm = "HMAC_SHA1"
    for part in (settings_header or "").split(","):
        name, equals, value = part.partition("=")
        if equals and name.strip().lower() == "algorithm" and value.strip():
            algorithm = value.strip().upper()
    return algorithm if algorithm in _ALGORITHMS else None


def _with_and_without_port(url: str) -> list[str]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return [url]
    host = parts.netloc.rpartition(":")[0] if port is not None else parts.netloc
    default = 443 if parts.scheme == "https" else 80
    without = urlunsplit(parts._replace(netloc=host))
    with_port = urlunsplit(parts._replace(netloc=f"{host}:{port if port is not None else default}"))
    return [without, with_port]


def _sid(call_sid: object) -> str:
    return call_sid if isinstance(call_sid, str) and call_sid.isascii() and call_sid.isalnum() else "(no id)"
