"""The verification helpers every platform adapter calls on the raw body (service/domain/platforms/
verification.py): HMAC-SHA256 (hex and base64) and Ed25519 accepted when right and refused (401) when unsigned,
forged, malformed or keyless, without echoing what was sent; the window's past and future bounds; an event id
refused the second time and a refused event's id never remembered (on a real SQLite file)."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from caller_memory.service.domain.platforms.verification import (
    EventReplayed,
    SignatureRefused,
    Window,
    check_ed25519,
    check_first_sighting,
    check_hmac_sha256,
    check_window,
    hmac_sha256,
)
from caller_memory.service.storage.sqlite.store import SQLiteStore
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

BODY = b'{"event":"call_ended","call":{"call_id":"c-1"}}'
SECRET = "whsec-test-0123456789"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    store = SQLiteStore.from_url(f"sqlite:///{tmp_path}/memory.db")
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def test_an_hmac_of_the_body_is_accepted_in_hex_and_base64() -> None:
    digest = hmac_sha256(SECRET, BODY)
    check_hmac_sha256(SECRET, BODY, digest.hex(), platform="retell")
    check_hmac_sha256(SECRET.encode(), BODY, digest.hex().upper(), platform="retell")
    check_hmac_sha256(SECRET, BODY, base64.b64encode(digest).decode(), encoding="base64", platform="vapi")


@pytest.mark.parametrize(
    ("secret", "body", "signature", "says"),
    [
        (SECRET, BODY, None, "is not signed"),
        (SECRET, BODY, "", "is not signed"),
        (None, BODY, hmac_sha256(SECRET, BODY).hex(), "has no secret"),
        ("another-secret", BODY, hmac_sha256(SECRET, BODY).hex(), "does not match"),
        (SECRET, BODY + b" ", hmac_sha256(SECRET, BODY).hex(), "does not match"),
        (SECRET, BODY, hmac_sha256(SECRET, BODY).hex()[:-2], "does not match"),
        (SECRET, BODY, "zz+14155550100", "does not match"),
    ],
)
def test_an_unsigned_forged_or_malformed_hmac_is_refused(
    secret: str | None, body: bytes, signature: str | None, says: str
) -> None:
    with pytest.raises(SignatureRefused) as refused:
        check_hmac_sha256(secret, body, signature, platform="retell")
    assert refused.value.status == 401
    assert says in str(refused.value)
    assert "4155550100" not in str(refused.value)


def test_ed25519_is_accepted_when_signed_by_the_key_and_refused_otherwise() -> None:
    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    signature = base64.b64encode(key.sign(b"1700000000|" + BODY)).decode()
    check_ed25519(public, b"1700000000|" + BODY, signature, platform="telnyx")
    check_ed25519(base64.b64encode(public).decode(), b"1700000000|" + BODY, signature, platform="telnyx")
    other = Ed25519PrivateKey.generate().public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    for public_key, signed, sent, says in [
        (other, b"1700000000|" + BODY, signature, "does not match"),
        (public, b"1700000001|" + BODY, signature, "does not match"),
        (public, b"1700000000|" + BODY, None, "is not signed"),
        (public, b"1700000000|" + BODY, "bm90IGEgc2lnbmF0dXJl", "not an Ed25519 signature"),
        (None, b"1700000000|" + BODY, signature, "no public key"),
        ("c2hvcnQ=", b"1700000000|" + BODY, signature, "not an Ed25519 key"),
    ]:
        with pytest.raises(SignatureRefused) as refused:
            check_ed25519(public_key, signed, sent, platform="telnyx")
        assert says in str(refused.value)


def test_the_window_has_a_past_and_a_future_bound() -> None:
    now = 1_800_000_000_000
    window = Window(past_ms=30 * 60_000, future_ms=5 * 60_000)  # ElevenLabs' window
    for at in (now, now - 30 * 60_000, now + 5 * 60_000):
        check_window(at, now, window, platform="elevenlabs")
    late: list[tuple[int | None, str]] = [
        (now - 30 * 60_000 - 1, "too old"),
        (now + 5 * 60_000 + 1, "in the future"),
        (None, "no signed time"),
    ]
    for signed_at, says in late:
        with pytest.raises(SignatureRefused, match=says):
            check_window(signed_at, now, window, platform="elevenlabs")
    assert window.keep_ms == 35 * 60_000


async def test_an_event_is_refused_the_second_time(store: SQLiteStore) -> None:
    now = 1_800_000_000_000
    await check_first_sighting(
        store, project="shop", platform="agora", event_id="n-1", now_ms=now, keep_ms=1000
    )
    with pytest.raises(EventReplayed, match="delivered before") as refused:
        await check_first_sighting(
            store, project="shop", platform="agora", event_id="n-1", now_ms=now + 999, keep_ms=1000
        )
    assert refused.value.status == 401
    with pytest.raises(SignatureRefused, match="no event id"):
        await check_first_sighting(
            store, project="shop", platform="agora", event_id="", now_ms=now, keep_ms=1
        )
    # Kept for keep_ms only: a window's worth.
    await check_first_sighting(
        store, project="shop", platform="agora", event_id="n-1", now_ms=now + 1000, keep_ms=1000
    )
