"""Verifying a platform's webhook before anything of it is parsed (SPEC section 15): an adapter calls these on
the raw body and the raw headers' values, and parses only what passed.

- :func:`check_hmac_sha256`: an HMAC-SHA256 of the signed bytes with the connection's secret, compared in
  constant time (:func:`hmac.compare_digest`) with the signature sent (hex or base64, as the platform sends it).
- :func:`check_ed25519`: an Ed25519 signature (Telnyx) checked with ``cryptography`` against a public key.
- :func:`check_window`: the time the platform signed, within the platform's window (past and future bounds).
- :func:`check_first_sighting`: the event's id not seen before (kept in the store for as long as the
  platform's window, see :class:`~caller_memory.service.domain.store.platform_events.PlatformEventStore`).

Every refusal is a :class:`SignatureRefused` (401) that says what failed and never echoes what was sent; a
refusal changes nothing (a refused event's id is not remembered: verification runs before the sighting).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from ..errors import Unauthenticated
from ..store.platform_events import PlatformEventStore

Encoding = Literal["hex", "base64"]


class SignatureRefused(Unauthenticated):
    """A platform's webhook that is unsigned, forged, outside its window or replayed (401; nothing changed)."""

    title = "Webhook signature refused"
    type_slug = "webhook-signature-refused"


class EventReplayed(SignatureRefused):
    """A signed event whose id was seen before. A 401 like any refusal; an adapter whose platform redelivers
    the same event when an answer was lost may answer it 2xx as a duplicate instead (nothing is done twice
    either way)."""


@dataclass(frozen=True, slots=True)
class Window:
    """How far from now a platform's signed time may be: ``past_ms`` before, ``future_ms`` after."""

    past_ms: int
    future_ms: int

    @property
    def keep_ms(self) -> int:
        """How long an event id must be kept so that a replay inside the window is seen."""
        return self.past_ms + self.future_ms


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else value


def _decode(signature: str | bytes, encoding: Encoding) -> bytes | None:
    try:
        text = _as_bytes(signature).strip()
        if encoding == "hex":
            return bytes.fromhex(text.decode("ascii"))
        return base64.b64decode(text, validate=True)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        return None


def hmac_sha256(secret: str | bytes, signed: bytes) -> bytes:
    """The HMAC-SHA256 of ``signed`` with ``secret`` (for tests and adapters that sign their answers)."""
    return hmac.new(_as_bytes(secret), signed, hashlib.sha256).digest()


def check_hmac_sha256(
    secret: str | bytes | None,
    signed: bytes,
    signature: str | bytes | None,
    *,
    encoding: Encoding = "hex",
    platform: str,
) -> None:
    """Refuse unless ``signature`` is the HMAC-SHA256 of ``signed`` with ``secret`` (constant time)."""
    if not signature:
        raise SignatureRefused(f"the {platform} webhook is not signed")
    if not secret:
        raise SignatureRefused(f"the {platform} connection has no secret to verify its webhooks with")
    sent = _decode(signature, encoding)
    expected = hmac_sha256(secret, signed)
    # compare_digest on equal lengths either way, so that a malformed signature takes the same path.
    if not hmac.compare_digest(expected, sent if sent is not None else b"") or sent is None:
        raise SignatureRefused(f"the {platform} webhook's signature does not match its body")


def check_ed25519(
    public_key: str | bytes | None,
    signed: bytes,
    signature: str | bytes | None,
    *,
    platform: str,
) -> None:
    """Refuse unless ``signature`` (base64) is an Ed25519 signature of ``signed`` by ``public_key`` (raw 32
    bytes, or their base64)."""
    if not signature:
        raise SignatureRefused(f"the {platform} webhook is not signed")
    if not public_key:
        raise SignatureRefused(f"the {platform} connection has no public key to verify its webhooks with")
    raw = (
        public_key
        if isinstance(public_key, bytes) and len(public_key) == 32
        else _decode(public_key, "base64")
    )
    sent = _decode(signature, "base64")
    if raw is None or len(raw) != 32:
        raise SignatureRefused(f"the {platform} connection's public key is not an Ed25519 key")
    if sent is None or len(sent) != 64:
        raise SignatureRefused(f"the {platform} webhook's signature is not an Ed25519 signature")
    try:
        Ed25519PublicKey.from_public_bytes(raw).verify(sent, signed)
    except (InvalidSignature, ValueError):
        raise SignatureRefused(f"the {platform} webhook's signature does not match its body") from None


def check_window(signed_at_ms: int | None, now_ms: int, window: Window, *, platform: str) -> None:
    """Refuse a signed time missing, more than ``window.past_ms`` before now or ``window.future_ms`` after."""
    if signed_at_ms is None:
        raise SignatureRefused(f"the {platform} webhook carries no signed time")
    if signed_at_ms < now_ms - window.past_ms:
        raise SignatureRefused(
            f"the {platform} webhook's signed time is too old (a replay, or a clock far off)"
        )
    if signed_at_ms > now_ms + window.future_ms:
        raise SignatureRefused(f"the {platform} webhook's signed time is in the future (a clock far off)")


async def check_first_sighting(
    store: PlatformEventStore,
    *,
    project: str,
    platform: str,
    event_id: str | None,
    now_ms: int,
    keep_ms: int,
) -> None:
    """Refuse an event whose id was seen in the last ``keep_ms`` (remembering it otherwise, in one step).
    Call it last, after the signature and the window: a forged event's id is never remembered."""
    if not event_id:
        raise SignatureRefused(f"the {platform} webhook carries no event id")
    if not await store.first_sighting(project, platform, event_id, now_ms, now_ms + keep_ms):
        raise EventReplayed(f"the {platform} webhook was delivered before (a replay)")
