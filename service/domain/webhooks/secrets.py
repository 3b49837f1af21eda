"""Signing secrets of webhook endpoints: made, kept encrypted at rest, and used to sign each attempt.

- A secret is ``whsec_`` and the base64 of 24 random bytes, the form the Standard Webhooks libraries read.
- At rest it is sealed (``domain/sealing.py``: AES-256-GCM under ``CALLER_MEMORY_SECRET_KEY``, the previous
  keys still opening), with the project and endpoint id as associated data, so that a sealed secret copied
  to another endpoint does not open. The store never sees a secret in the clear.
- Signatures are made by the ``standardwebhooks`` package (the specification's own implementation), so that
  any receiver library verifies them: ``webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>``,
  one per live secret (the new and, during a rotation's grace period, the old), space separated.
"""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

from ..errors import CallerMemoryError
from ..sealing import SealedFormError, Sealer, SealOpenError

SECRET_PREFIX = "whsec_"


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
    """Seals and opens endpoint secrets with the operator's key (None: webhooks cannot be used); the
    sealing itself is :mod:`..sealing`'s, shared with the other secrets kept at rest."""

    def __init__(self, key: bytes | None, previous: Sequence[bytes] = ()) -> None:
        self._sealer = Sealer(key, previous)

    @property
    def configured(self) -> bool:
        return self._sealer.configured

    def _check(self) -> None:
        if not self._sealer.configured:
            raise SecretKeyMissing(
                "webhooks need CALLER_MEMORY_SECRET_KEY (32 random bytes in base64), which encrypts their "
                "signing secrets at rest; the operator has not set it"
            )

    def seal(self, secret: str, project: str, endpoint_id: str) -> bytes:
        self._check()
        return self._sealer.seal(secret, _PURPOSE, project, endpoint_id)

    def open(self, sealed: bytes, project: str, endpoint_id: str) -> str:
        self._check()
        try:
            return self._sealer.open(sealed, _PURPOSE, project, endpoint_id)
        except SealedFormError:
            raise SecretKeyError(
                f"the signing secret of webhook {endpoint_id} is not in a form this version reads"
            ) from None
        except SealOpenError:
            raise SecretKeyError(
                f"the signing secret of webhook {endpoint_id} does not open with CALLER_MEMORY_SECRET_KEY "
                "(nor CALLER_MEMORY_SECRET_KEY_PREVIOUS: was the key changed?)"
            ) from None


#: The associated data's purpose (the bytes sealed secrets of earlier versions were bound to).
_PURPOSE = "caller-memory webhook secret"


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
