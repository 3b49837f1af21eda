"""Secrets kept at rest: sealed with the operator's key, opened only where they are used.

Webhook signing secrets, platform connection secrets and upstream API keys are all sealed here, the same way:

- AES-256-GCM under ``CALLER_MEMORY_SECRET_KEY`` (32 bytes), a fresh 12-byte nonce per seal, and the
  sealed form ``0x01 || nonce || ciphertext+tag``.
- Associated data names what the secret belongs to (``context``: a purpose and its owner, e.g.
  ``("caller-memory webhook secret", project, endpoint_id)``, joined by NUL bytes), so that a sealed secret
  copied onto another owner does not open.
- Rotation: ``CALLER_MEMORY_SECRET_KEY_PREVIOUS`` holds the keys sealed under before. :meth:`Sealer.open`
  tries the current key, then each previous one; :meth:`Sealer.seal` always uses the current key.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

#: The sealed form's version byte (a later key scheme can be told apart).
SEALED_V1 = b"\x01"
_NONCE_BYTES = 12
_TAG_BYTES = 16


class SealingKeyMissing(ValueError):
    """No ``CALLER_MEMORY_SECRET_KEY``: nothing can be sealed or opened (callers turn this into their own
    503, naming the feature that needs the key)."""


class SealedFormError(ValueError):
    """A sealed value is not in a form this version reads."""


class SealOpenError(ValueError):
    """A sealed value opens with none of the keys (the key was changed, or it was sealed for another
    owner)."""


class Sealer:
    """Seals with the current key; opens with the current key or any previous one."""

    def __init__(self, key: bytes | None, previous: Sequence[bytes] = ()) -> None:
        self._current = AESGCM(key) if key is not None else None
        self._previous = tuple(AESGCM(k) for k in previous if k != key)

    @property
    def configured(self) -> bool:
        return self._current is not None

    def seal(self, secret: str, *context: str) -> bytes:
        """The sealed form of ``secret``, bound to ``context`` (raises :class:`SealingKeyMissing`)."""
        if self._current is None:
            raise SealingKeyMissing("CALLER_MEMORY_SECRET_KEY is not set")
        nonce = os.urandom(_NONCE_BYTES)
        return SEALED_V1 + nonce + self._current.encrypt(nonce, secret.encode(), associated(context))

    def open(self, sealed: bytes, *context: str) -> str:
        """The secret sealed in ``sealed`` for ``context``, under the current key or a previous one."""
        if self._current is None:
            raise SealingKeyMissing("CALLER_MEMORY_SECRET_KEY is not set")
        if not sealed.startswith(SEALED_V1) or len(sealed) < 1 + _NONCE_BYTES + _TAG_BYTES:
            raise SealedFormError("not in a sealed form this version reads")
        nonce, body = sealed[1 : 1 + _NONCE_BYTES], sealed[1 + _NONCE_BYTES :]
        data = associated(context)
        for aead in (self._current, *self._previous):
            try:
                return aead.decrypt(nonce, body, data).decode()
            except InvalidTag:
                continue
        raise SealOpenError("does not open with CALLER_MEMORY_SECRET_KEY (nor a previous key)")


def associated(context: Sequence[str]) -> bytes:
    """The associated data of a seal: the context's parts joined by NUL bytes."""
    return "\x00".join(context).encode()
