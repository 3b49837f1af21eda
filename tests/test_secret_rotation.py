"""Rotating CALLER_MEMORY_SECRET_KEY: what the previous key sealed still opens, new seals use the current key."""

from __future__ import annotations

import asyncio
import base64
import secrets

import pytest
from caller_memory.service.config import Settings, SettingsError
from caller_memory.service.domain.clock import FakeClock
from caller_memory.service.domain.sealing import (
    SealedFormError,
    Sealer,
    SealingKeyMissing,
    SealOpenError,
)
from caller_memory.service.domain.webhooks.secrets import SecretBox, SecretKeyError, new_secret
from caller_memory.service.http.app_keys import SERVICES
from caller_memory.service.http.platform_routes import PLATFORMS
from standardwebhooks.webhooks import Webhook

from tests.conftest import Api, running_api
from tests.http.test_webhooks import eventually, receiver

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


# The rotation on a running service -------------------------------------------------------------------------

CALLER = "+14155550100"
PLATFORM_SECRET = "agora-secret-" + secrets.token_hex(8)


async def test_a_service_restarted_with_a_new_key_and_the_previous_one_delivers_and_reads_connections(
    store_url: str, clock: FakeClock
) -> None:
    old, new = secrets.token_bytes(32), secrets.token_bytes(32)
    hooks = {"webhook_allow_hosts": ("127.0.0.1",), "webhook_interval": 0.05, "webhook_timeout": 1.0}
    async with receiver() as hook:
        async with running_api(store_url, clock, secret_key=old, **hooks) as api:
            repeat_caller = {"state_keys": ["caller_name"], "retention": "P30D"}
            assert (await api.put_project("shop", repeat_caller)).status == 201
            admin = await api.mint("shop", "admin")
            agent = await api.mint("shop", "agent")
            registration = {"url": hook.url, "events": ["conversation.ended"]}
            created = await api.call("POST", "/v1/projects/shop/webhooks", token=admin, json=registration)
            assert created.status == 201, created.body
            connection = {"secret": PLATFORM_SECRET, "state_map": {"name": "caller_name"}}
            put = await api.call("PUT", "/v1/projects/shop/platforms/agora", token=admin, json=connection)
            assert put.status == 201, put.body

        # Restarted with the new key, the old one as the previous: the old seals still open.
        rotated = {"secret_key": new, "previous_secret_keys": (old,)}
        async with running_api(store_url, clock, **rotated, **hooks) as api:
            end = {"caller": CALLER, "state": {"caller_name": "Ada"}, "end_reason": "completed"}
            path = "/v1/projects/shop/conversations/call-1/end"
            assert (await api.call("POST", path, token=agent, json=end)).status == 200
            await eventually(lambda: len(hook.got) == 1)
            headers, body = hook.got[0]
            assert Webhook(created.body["secret"]).verify(body, headers)["type"] == "conversation.ended"
            read = await api.call("GET", "/v1/projects/shop/platforms/agora", token=admin)
            assert read.status == 200 and read.body["secret_set"] is True
            assert await opened(api) == PLATFORM_SECRET
            # A new secret is sealed under the new key alone.
            again = {"secret": PLATFORM_SECRET + "-2"}
            put = await api.call("PUT", "/v1/projects/shop/platforms/agora", token=admin, json=again)
            assert put.status == 200, put.body

        # Without the previous key, what it sealed no longer opens; what the new key sealed does.
        async with running_api(store_url, clock, secret_key=new, **hooks) as api:
            assert await opened(api) == PLATFORM_SECRET + "-2"
            assert (
                await api.call("POST", path.replace("call-1", "call-2"), token=agent, json=end)
            ).status == 200
            # The attempt fails before anything is sent (nothing unsigned or wrongly signed), and says why.
            pending = "/v1/projects/shop/webhooks/deliveries?state=pending"
            for _ in range(250):
                listed = (await api.call("GET", pending, token=admin)).body["deliveries"]
                if listed and listed[0]["attempts"]:
                    break
                await asyncio.sleep(0.02)
            assert "CALLER_MEMORY_SECRET_KEY" in listed[0]["last_error"]
        assert len(hook.got) == 1


async def opened(api: Api) -> str | None:
    project = await api.app[SERVICES].projects.get("shop")
    platforms = api.app[PLATFORMS]
    return platforms.secret(await platforms.get(project, "agora"))
