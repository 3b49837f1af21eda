"""Rotating CALLER_MEMORY_SECRET_KEY: what the previous key sealed still opens, new seals use the current key."""

from __future__ import annotations

import base64
import secrets

import pytest
from caller_memory.service.config import Settings, SettingsError
from caller_memory.service.domain.sealing import (
    SealedFormError,
    Sealer,
    SealingKeyMissing,
    SealOpenError,
)
from caller_memory.service.domain.webhooks.secrets import SecretBox, SecretKeyError, new_secret

PSEUDONYM = "p" * 32


def _b64(key: bytes) -> str:
    return base64.b64encode(key).decode()


def test_a_previous_key_opens_what_it_sealed_and_new_seals_use_the_current_key() -> None:
    old, new = secrets.token_bytes(32), secrets.token_bytes(32)
    sealed_old = Sealer(old).seal("s3cret", "purpose", "shop", "x")
    rotated = Sealer(new, [old])
    assert rotated.open(sealed_old, "purpose", "shop", "x") == "s3cret"
    sealed_new = rotated.seal("fresh", "purpose", "shop", "x")
    assert Sealer(new).open(sealed_new, "purpose", "shop", "x") == "fresh"
    with pytest.raises(SealOpenError):
        Sealer(old).open(sealed_new, "purpose", "shop", "x")  # not sealed under the previous key
    with pytest.raises(SealOpenError):
        Sealer(new).open(sealed_old, "purpose", "shop", "x")  # the previous key was dropped
    with pytest.raises(SealOpenError):
        rotated.open(sealed_old, "purpose", "shop", "y")  # copied onto another owner
    with pytest.raises(SealedFormError):
        rotated.open(b"\x02" + sealed_old[1:], "purpose", "shop", "x")
    with pytest.raises(SealingKeyMissing):
        Sealer(None).seal("s3cret", "purpose")


def test_webhook_secrets_sealed_by_earlier_versions_open_under_the_previous_key() -> None:
    old, new = secrets.token_bytes(32), secrets.token_bytes(32)
    secret = new_secret()
    sealed = SecretBox(old).seal(secret, "shop", "wh_1")
    assert SecretBox(new, [old]).open(sealed, "shop", "wh_1") == secret
    with pytest.raises(SecretKeyError, match="CALLER_MEMORY_SECRET_KEY_PREVIOUS"):
        SecretBox(new).open(sealed, "shop", "wh_1")


def test_the_previous_keys_setting() -> None:
    old, older, new = (secrets.token_bytes(32) for _ in range(3))
    env = {"CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM, "CALLER_MEMORY_SECRET_KEY": _b64(new)}
    assert Settings.from_env(env).previous_secret_keys == ()
    both = f"{_b64(old)}, {_b64(older)}"
    settings = Settings.from_env({**env, "CALLER_MEMORY_SECRET_KEY_PREVIOUS": both})
    assert settings.previous_secret_keys == (old, older)
    with pytest.raises(SettingsError, match="CALLER_MEMORY_SECRET_KEY_PREVIOUS must be 32 random bytes"):
        Settings.from_env({**env, "CALLER_MEMORY_SECRET_KEY_PREVIOUS": "c2hvcnQ="})
    with pytest.raises(SettingsError, match="CALLER_MEMORY_SECRET_KEY is not"):
        Settings.from_env(
            {"CALLER_MEMORY_PSEUDONYM_KEY": PSEUDONYM, "CALLER_MEMORY_SECRET_KEY_PREVIOUS": _b64(old)}
        )
