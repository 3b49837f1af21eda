"""Signing secrets: sealed at rest, and signatures that the Standard Webhooks library (what receivers use)
accepts, and rejects when the body, the timestamp or the secret is not the one signed."""

from __future__ import annotations

import base64
import secrets
from datetime import UTC, datetime, timedelta

import pytest
from caller_memory.service.domain.webhooks.secrets import (
    SecretBox,
    SecretKeyError,
    SecretKeyMissing,
    new_secret,
    signature_headers,
)
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

BODY = b'{"type":"conversation.ended","id":"msg_x","timestamp":"2026-12-01T10:00:00Z","data":{}}'


def test_a_sealed_secret_opens_only_with_its_key_and_for_its_endpoint() -> None:
    key = secrets.token_bytes(32)
    secret = new_secret()
    sealed = SecretBox(key).seal(secret, "shop", "wh_1")
    assert secret.encode() not in sealed and secret.removeprefix("whsec_").encode() not in sealed
    assert SecretBox(key).open(sealed, "shop", "wh_1") == secret
    with pytest.raises(SecretKeyError, match="does not open"):
        SecretBox(key).open(sealed, "shop", "wh_2")  # copied to another endpoint
    with pytest.raises(SecretKeyError, match="does not open"):
        SecretBox(secrets.token_bytes(32)).open(sealed, "shop", "wh_1")  # the key was changed
    with pytest.raises(SecretKeyError, match="form"):
        SecretBox(key).open(b"\x02" + sealed[1:], "shop", "wh_1")
    assert SecretBox(key).seal(secret, "shop", "wh_1") != sealed  # a fresh nonce each time


def test_without_a_key_nothing_is_sealed() -> None:
    box = SecretBox(None)
    assert not box.configured
    with pytest.raises(SecretKeyMissing, match="CALLER_MEMORY_SECRET_KEY") as missing:
        box.seal(new_secret(), "shop", "wh_1")
    assert missing.value.status == 503


def test_the_standard_library_verifies_a_signature_and_rejects_tampering() -> None:
    secret = new_secret()
    assert secret.startswith("whsec_") and len(base64.b64decode(secret.removeprefix("whsec_"))) == 24
    now = datetime.now(UTC)
    headers = signature_headers("msg_1", BODY, [secret], now)
    assert headers["webhook-id"] == "msg_1"
    assert headers["webhook-timestamp"] == str(int(now.timestamp()))
    assert Webhook(secret).verify(BODY, headers)["type"] == "conversation.ended"
    with pytest.raises(WebhookVerificationError, match="signature"):
        Webhook(secret).verify(BODY.replace(b"ended", b"ENDED"), headers)
    with pytest.raises(WebhookVerificationError, match="signature"):
        Webhook(new_secret()).verify(BODY, headers)
    with pytest.raises(WebhookVerificationError, match="signature"):
        Webhook(secret).verify(BODY, {**headers, "webhook-id": "msg_2"})
    old = signature_headers("msg_1", BODY, [secret], now - timedelta(minutes=10))
    with pytest.raises(WebhookVerificationError, match="too old"):
        Webhook(secret).verify(BODY, old)


def test_during_a_rotation_both_secrets_verify() -> None:
    new, old = new_secret(), new_secret()
    headers = signature_headers("msg_1", BODY, [new, old], datetime.now(UTC))
    assert len(headers["webhook-signature"].split(" ")) == 2
    assert Webhook(new).verify(BODY, headers) and Webhook(old).verify(BODY, headers)
