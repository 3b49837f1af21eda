"""Signing secrets of webhook endpoints: made, kept encrypted at rest, and used to sign each attempt.

- A secret is ``whsec_`` and the base64 of 24 random bytes, the form the Standard Webhooks libraries read.
- At rest it is sealed with AES-256-GCM under ``CALLER_MEMORY_SECRET_KEY`` (32 bytes, base64), with the
  project and endpoint id as associated data, so that a sealed secret copied to another endpoint does not
  open. The store never sees a secret in the clear.
- Signatures are made by the ``standardwebhooks`` package (the specification's own implementation), so that
  any receiver library verifies them: ``webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>``,
  one per live secret (the new and, during a rotation's grace period, the old), space separated.
"""

from __future__ import annotations

import base64
import os
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from standardwebhooks.webhooks import Webhook

from ..errors import CallerMemoryError

SECRET_PREFIX = "whsec_"
#: The sealed form's version byte (a later key scheme can be told apart).
_SEALED_V1 = b"\x01"
_NONCE_BYTES = 12


class SecretKeyMissing(CallerMemoryError):
    """Webhooks need ``CALLER_MEMORY_SECRET_KEY`` and the operator has not set it (503: the service's
    configuration, not the request, is what is missing)."""

    status = 503
    title = "Webhooks are not configured"
    type_slug = "webhooks-not-configured"


class SecretKeyError(ValueError):
    """A sealed secret does not open with ``CALLER_MEMORY_SECRET_KEY`` (or is in an unknown form)."""


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


class SecretBox:
    """Seals and opens endpoint secrets with the operator's key (None: webhooks cannot be used)."""

    def __init__(self, key: bytes | None) -> None:
        self._aead = AESGCM(key) if key is not None else None

    @property
    def configured(self) -> bool:
        return self._aead is not None

    def _cipher(self) -> AESGCM:
        if self._aead is None:
            raise SecretKeyMissing(
                "webhooks need CALLER_MEMORY_SECRET_KEY (32 random bytes in base64), which encrypts their "
                "signing secrets at rest; the operator has not set it"
            )
        return self._aead

    def seal(self, secret: str, project: str, endpoint_id: str) -> bytes:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._cipher().encrypt(nonce, secret.encode(), _associated(project, endpoint_id))
        return _SEALED_V1 + nonce + sealed

    def open(self, sealed: bytes, project: str, endpoint_id: str) -> str:
        if not sealed.startswith(_SEALED_V1) or len(sealed) < 1 + _NONCE_BYTES + 16:
            raise SecretKeyError(
                f"the signing secret of webhook {endpoint_id} is not in a form this version reads"
            )
        nonce, body = sealed[1 : 1 + _NONCE_BYTES], sealed[1 + _NONCE_BYTES :]
        try:
            return self._cipher().decrypt(nonce, body, _associated(project, endpoint_id)).decode()
        except InvalidTag:
            raise SecretKeyError(
                f"the signing secret of webhook {endpoint_id} does not open with CALLER_MEMORY_SECRET_KEY "
                "(was the key changed?)"
            ) from None


def _associated(project: str, endpoint_id: str) -> bytes:
    return f"caller-memory webhook secret\x00{project}\x00{endpoint_id}".encode()


def signature_headers(
    delivery_id: str, body: bytes, secrets_in_force: Sequence[str], at: datetime
) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt made at ``at`` (whole seconds), signed with each secret."""
    at = at.astimezone(UTC).replace(microsecond=0)
    text = body.decode()
    signatures = [Webhook(secret).sign(delivery_id, at, text) for secret in secrets_in_force]
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(int(at.timestamp())),
        "webhook-signature": " ".join(signatures),
    }
