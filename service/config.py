"""Settings, built from the environment and the command line when the service starts (never at import)."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_STORE = "sqlite:///caller-memory.db"
DEFAULT_PORT = 8080
MIN_PSEUDONYM_KEY_CHARS = 32
#: Most processes ``serve --workers`` starts. Each worker holds its own store connections and caches, and
#: more workers than cores only adds memory; the bound catches typos (``--workers 800``).
MAX_WORKERS = 64

#: Environment variables holding a number of seconds (not negative), and the setting each one sets.
_SECONDS = (
    ("CALLER_MEMORY_STORE_TIMEOUT", "store_timeout"),
    ("CALLER_MEMORY_SWEEP_INTERVAL", "sweep_interval"),
    ("CALLER_MEMORY_CONFIG_CACHE_SECONDS", "config_cache_seconds"),
    ("CALLER_MEMORY_TOKEN_CACHE_SECONDS", "token_cache_seconds"),
)


class SettingsError(ValueError):
    """The environment or command line does not describe a runnable service."""


def parse_workers(text: str, source: str = "CALLER_MEMORY_WORKERS") -> int:
    """The number of service processes, from ``text``; ``source`` names where it came from in the error."""
    digits = text.strip()
    # Digits only: int() would also take "+2", "1_0" and non-ASCII digits.
    workers = int(digits) if digits.isascii() and digits.isdigit() else 0
    if not 1 <= workers <= MAX_WORKERS:
        raise SettingsError(f"{source} must be a whole number from 1 to {MAX_WORKERS}, not {text!r}")
    return workers


def _seconds(env: Mapping[str, str], name: str) -> float:
    try:
        value = float(env[name])
    except ValueError:
        raise SettingsError(f"{name} must be a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise SettingsError(f"{name} must be a finite, non-negative number of seconds")
    return value


@dataclass(frozen=True, slots=True)
class Settings:
    pseudonym_key: bytes
    store_url: str = DEFAULT_STORE
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    operator_token: str | None = None
    #: Seconds a store call may take before the request fails with 503.
    store_timeout: float = 0.5
    #: Seconds a process caches project configurations and token lookups. A change made through one process
    #: (or replica) is seen by that one at once and by every other within these many seconds (plus one store
    #: round trip): they are the propagation bounds for configuration changes and token revocations.
    config_cache_seconds: float = 2.0
    token_cache_seconds: float = 5.0
    #: Service processes sharing the port (``serve --workers``); 1 serves in the command's own process.
    workers: int = 1
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
        seconds: dict[str, Any] = {
            attribute: _seconds(env, name) for name, attribute in _SECONDS if name in env
        }
        if seconds.get("store_timeout") == 0:
            # Every store call would fail at once (and connecting could not even start).
            raise SettingsError("CALLER_MEMORY_STORE_TIMEOUT must be more than 0 seconds")
        if env.get("CALLER_MEMORY_WORKERS") and overrides.get("workers") is None:  # --workers wins
            seconds["workers"] = parse_workers(env["CALLER_MEMORY_WORKERS"])
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
