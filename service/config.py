"""Settings, built from the environment and the command line when the service starts (never at import)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_STORE = "sqlite:///caller-memory.db"
DEFAULT_PORT = 8080
MIN_PSEUDONYM_KEY_CHARS = 32


class SettingsError(ValueError):
    """The environment or command line does not describe a runnable service."""


@dataclass(frozen=True, slots=True)
class Settings:
    pseudonym_key: bytes
    store_url: str = DEFAULT_STORE
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    operator_token: str | None = None
    #: Seconds a store call may take before the request fails with 503.
    store_timeout: float = 0.5
    #: Seconds a process caches project configurations and token lookups (replicas converge within this).
    config_cache_seconds: float = 2.0
    token_cache_seconds: float = 5.0
    log_level: str = "INFO"
    #: Seconds between scheduled expiry sweeps (0: no scheduled sweeps); each removes at most this many
    #: items of each kind per round.
    sweep_interval: float = 300.0
    sweep_batch: int = 1000
    #: Requests under /v1 handled at once; beyond it a request gets 503 at once rather than waiting.
    max_in_flight: int = 256
    #: Log one line per request (route template, status, time). Off by default: /metrics counts requests,
    #: and a log line per request costs a sixth of the service's throughput.
    access_log: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if environ is None else environ
        key = env.get("CALLER_MEMORY_PSEUDONYM_KEY", "")
        if len(key) < MIN_PSEUDONYM_KEY_CHARS:
            raise SettingsError(
                "CALLER_MEMORY_PSEUDONYM_KEY must be set to a secret of at least "
                f"{MIN_PSEUDONYM_KEY_CHARS} characters (e.g. `python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'`). Keep it safe: stored memory cannot be read without it."
            )
        operator = env.get("CALLER_MEMORY_OPERATOR_TOKEN") or None
        if operator is not None and len(operator) < 16:
            raise SettingsError("CALLER_MEMORY_OPERATOR_TOKEN must be at least 16 characters")
        settings = cls(
            pseudonym_key=key.encode(),
            store_url=env.get("CALLER_MEMORY_STORE") or DEFAULT_STORE,
            operator_token=operator,
            log_level=env.get("CALLER_MEMORY_LOG_LEVEL", "INFO").upper(),
        )
        seconds: dict[str, Any] = {}
        for name, attribute in (
            ("CALLER_MEMORY_STORE_TIMEOUT", "store_timeout"),
            ("CALLER_MEMORY_SWEEP_INTERVAL", "sweep_interval"),
        ):
            if name in env:
                try:
                    seconds[attribute] = float(env[name])
                except ValueError:
                    raise SettingsError(f"{name} must be a number of seconds") from None
                if seconds[attribute] < 0:
                    raise SettingsError(f"{name} must not be negative")
        if "CALLER_MEMORY_MAX_IN_FLIGHT" in env:
            try:
                seconds["max_in_flight"] = int(env["CALLER_MEMORY_MAX_IN_FLIGHT"])
            except ValueError:
                raise SettingsError("CALLER_MEMORY_MAX_IN_FLIGHT must be a whole number") from None
            if seconds["max_in_flight"] < 1:
                raise SettingsError("CALLER_MEMORY_MAX_IN_FLIGHT must be at least 1")
        access_log = env.get("CALLER_MEMORY_ACCESS_LOG", "0").strip().lower()
        if access_log not in ("0", "1", "true", "false", "yes", "no", "on", "off", ""):
            raise SettingsError("CALLER_MEMORY_ACCESS_LOG must be 1 or 0")
        seconds["access_log"] = access_log in ("1", "true", "yes", "on")
        settings = replace(settings, **seconds)
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})
