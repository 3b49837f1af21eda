"""Settings, built from the environment and the command line when the service starts (never at import)."""

from __future__ import annotations

import base64
import binascii
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_STORE = "sqlite:///caller-memory.db"
DEFAULT_PORT = 8080
#: The archive's default: a directory beside the default SQLite file.
DEFAULT_ARCHIVE = "file:caller-memory-archive"
MIN_PSEUDONYM_KEY_CHARS = 32
#: Most processes ``serve --workers`` starts. Each worker holds its own store connections and caches, and
#: more workers than cores only adds memory; the bound catches typos (``--workers 800``).
MAX_WORKERS = 64
#: Connections the kernel queues for ``accept()`` (capped by net.core.somaxconn, 4096 by default since Linux
#: 5.4). aiohttp's 128 overflows under a burst of connections, and a client whose SYN was dropped waits a
#: second or more to send it again: 20,000 connections took 22 s to open with 1024, 6 s with 4096, and
#: probes waited for the retries too. Queued connections cost the kernel's memory, not file descriptors.
LISTEN_BACKLOG = 4096

#: Environment variables holding a number of seconds (not negative), and the setting each one sets.
_SECONDS = (
    ("CALLER_MEMORY_STORE_TIMEOUT", "store_timeout"),
    ("CALLER_MEMORY_SWEEP_INTERVAL", "sweep_interval"),
    ("CALLER_MEMORY_INACTIVITY_INTERVAL", "inactivity_interval"),
    ("CALLER_MEMORY_CONFIG_CACHE_SECONDS", "config_cache_seconds"),
    ("CALLER_MEMORY_TOKEN_CACHE_SECONDS", "token_cache_seconds"),
    ("CALLER_MEMORY_HEADER_TIMEOUT", "header_timeout"),
    ("CALLER_MEMORY_BODY_TIMEOUT", "body_timeout"),
    ("CALLER_MEMORY_WEBHOOK_TIMEOUT", "webhook_timeout"),
    ("CALLER_MEMORY_WEBHOOK_INTERVAL", "webhook_interval"),
    ("CALLER_MEMORY_READ_CACHE_SECONDS", "read_cache_seconds"),
)
#: Of those, the ones that must be more than 0 (0 would fail every call, or every request, at once).
_POSITIVE = {
    "store_timeout": "CALLER_MEMORY_STORE_TIMEOUT",
    "header_timeout": "CALLER_MEMORY_HEADER_TIMEOUT",
    "body_timeout": "CALLER_MEMORY_BODY_TIMEOUT",
    "webhook_timeout": "CALLER_MEMORY_WEBHOOK_TIMEOUT",
}
#: Environment variables holding a whole number, the setting each one sets, and its least allowed value.
_WHOLE = (
    ("CALLER_MEMORY_MAX_IN_FLIGHT", "max_in_flight", 1),
    ("CALLER_MEMORY_MAX_IN_FLIGHT_PER_PROJECT", "max_in_flight_per_project", 1),
    ("CALLER_MEMORY_MAX_CONNECTIONS", "max_connections", 1),
    ("CALLER_MEMORY_WEBHOOK_CONCURRENCY", "webhook_concurrency", 1),
    ("CALLER_MEMORY_READ_CACHE_ENTRIES", "read_cache_entries", 1),
    ("CALLER_MEMORY_MAX_STREAMS_PER_PROJECT", "max_streams_per_project", 1),
    # Never below the other endpoints' 64 KiB: a platform's bodies are never smaller than an agent's.
    ("CALLER_MEMORY_PLATFORM_MAX_BODY", "platform_max_body", 64 * 1024),
)
#: The read cache's staleness bound may not exceed this many seconds.
MAX_READ_CACHE_SECONDS = 5.0


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


def _flag(env: Mapping[str, str], name: str) -> bool:
    text = env.get(name, "0").strip().lower()
    if text not in ("0", "1", "true", "false", "yes", "no", "on", "off", ""):
        raise SettingsError(f"{name} must be 1 or 0")
    return text in ("1", "true", "yes", "on")


def parse_secret_key(text: str, name: str = "CALLER_MEMORY_SECRET_KEY") -> bytes:
    """``CALLER_MEMORY_SECRET_KEY`` (or one previous key): 32 bytes in base64 (standard or URL-safe,
    padding optional)."""
    cleaned = text.strip()
    try:
        key = base64.urlsafe_b64decode(
            cleaned.replace("+", "-").replace("/", "_") + "=" * (-len(cleaned) % 4)
        )
    except (binascii.Error, ValueError):
        key = b""
    if len(key) != 32:
        raise SettingsError(
            f"{name} must be 32 random bytes in base64 (e.g. `python -c 'import secrets, "
            "base64; print(base64.b64encode(secrets.token_bytes(32)).decode())'`). It encrypts webhook "
            "and platform secrets: keep it safe, and keep it when you upgrade or move the service."
        )
    return key


def _secret_keys(env: Mapping[str, str]) -> dict[str, Any]:
    """``secret_key`` and ``previous_secret_keys`` from ``CALLER_MEMORY_SECRET_KEY`` and
    ``CALLER_MEMORY_SECRET_KEY_PREVIOUS`` (comma separated), when set."""
    keys: dict[str, Any] = {}
    if env.get("CALLER_MEMORY_SECRET_KEY", "").strip():
        keys["secret_key"] = parse_secret_key(env["CALLER_MEMORY_SECRET_KEY"])
    previous = [k for k in env.get("CALLER_MEMORY_SECRET_KEY_PREVIOUS", "").split(",") if k.strip()]
    if previous:
        if "secret_key" not in keys:
            raise SettingsError(
                "CALLER_MEMORY_SECRET_KEY_PREVIOUS is set but CALLER_MEMORY_SECRET_KEY is not: a rotation "
                "needs the new key in CALLER_MEMORY_SECRET_KEY and the old one in "
                "CALLER_MEMORY_SECRET_KEY_PREVIOUS"
            )
        keys["previous_secret_keys"] = tuple(
            parse_secret_key(k, "CALLER_MEMORY_SECRET_KEY_PREVIOUS") for k in previous
        )
    return keys


def _seconds(env: Mapping[str, str], name: str) -> float:
    try:
        value = float(env[name])
    except ValueError:
        raise SettingsError(f"{name} must be a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise SettingsError(f"{name} must be a finite, non-negative number of seconds")
    return value


def _whole(env: Mapping[str, str], name: str, least: int) -> int:
    digits = env[name].strip()
    # Digits only: int() would also take "+2", "1_0" and non-ASCII digits.
    if not (digits.isascii() and digits.isdigit()):
        raise SettingsError(f"{name} must be a whole number")
    if int(digits) < least:
        raise SettingsError(f"{name} must be at least {least}")
    return int(digits)


@dataclass(frozen=True, slots=True)
class Settings:
    pseudonym_key: bytes
    store_url: str = DEFAULT_STORE
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    operator_token: str | None = None
    #: Seconds a store call may take before the request fails with 503.
    store_timeout: float = 0.5
    #: Memory reads served from a per-process cache that Redis keeps current (client-side caching): a write
    #: through another process is seen within these many seconds at most (0: no cache; one Redis server
    #: only, see docs/storage.md, "The read cache"). The cache holds at most ``read_cache_entries`` keys.
    read_cache_seconds: float = 0.0
    read_cache_entries: int = 10_000
    #: ``CALLER_MEMORY_REDIS_DECIMAL_TIMES``: write memory fields to Redis with decimal times, the form
    #: releases before the base-36 one read (for the first rollout of a rolling upgrade from such a release;
    #: docs/operations.md, "Upgrades"). Both forms are always read.
    redis_decimal_times: bool = False
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
    #: Seconds between runs of the inactivity ends that are due (0: none scheduled; an operator's
    #: ``POST /v1/admin/sweeps`` still runs them).
    inactivity_interval: float = 10.0
    #: Requests under /v1 handled at once by one process; beyond it a request gets 503 at once rather than
    #: waiting (``CALLER_MEMORY_MAX_IN_FLIGHT``).
    max_in_flight: int = 256
    #: Of those, most held at once by the requests naming one project in their path
    #: (``CALLER_MEMORY_MAX_IN_FLIGHT_PER_PROJECT``; None: a quarter of ``max_in_flight``, at least 16).
    #: Beyond it that project's requests get 429 with ``Retry-After: 1`` while other projects are served,
    #: so that one tenant (slow bodies, a burst) cannot take every slot. See :attr:`project_in_flight`.
    max_in_flight_per_project: int | None = None
    #: Memory proxy streams of one project that read memory (``CALLER_MEMORY_MAX_STREAMS_PER_PROJECT``), apart
    #: from the in-flight bounds: beyond it a completion still goes upstream, without memory (flagged).
    max_streams_per_project: int = 512
    #: Bytes a body may hold on the endpoints that platforms call, the memory proxy's completions among them
    #: (``CALLER_MEMORY_PLATFORM_MAX_BODY``): a platform sends the whole call at every turn. Every other
    #: endpoint keeps 64 KiB.
    platform_max_body: int = 4 * 1024 * 1024
    #: Seconds a client has to send a request's head (request line and headers) once its connection is
    #: open, or once it sent the first byte of the next request on a kept-alive connection
    #: (``CALLER_MEMORY_HEADER_TIMEOUT``); then the connection is closed (with a 408). aiohttp has no such
    #: deadline of its own (see service/http/server.py).
    header_timeout: float = 10.0
    #: Seconds a request's body may take to arrive, counted from the end of its head
    #: (``CALLER_MEMORY_BODY_TIMEOUT``); then the request gets 408 and its connection is closed.
    body_timeout: float = 10.0
    #: Connections one process keeps open (``CALLER_MEMORY_MAX_CONNECTIONS``). Beyond it, the oldest
    #: connection with an incomplete request head is closed first (then the oldest idle kept-alive one);
    #: a connection whose request is being handled is never closed for it. The process raises its soft limit
    #: of open files (``RLIMIT_NOFILE``) toward the hard limit when it starts, if it is lower than this needs,
    #: and bounds connections below what it got (logged) rather than fail on ``accept()``.
    max_connections: int = 4096
    #: Log one line per request (route template, status, time). Off by default: /metrics counts requests,
    #: and a log line per request costs a sixth of the service's throughput.
    access_log: bool = False
    #: ``CALLER_MEMORY_SECRET_KEY`` (32 bytes): encrypts webhook signing secrets at rest. None: webhooks
    #: cannot be registered, and registered ones are not sent (logged).
    secret_key: bytes | None = None
    #: ``CALLER_MEMORY_SECRET_KEY_PREVIOUS``: keys used before the current one (comma separated), during a
    #: rotation: what they sealed still opens; new seals use ``secret_key``.
    previous_secret_keys: tuple[bytes, ...] = ()
    #: ``CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS``: hosts (exact names or IP literals) webhooks may reach whatever
    #: they resolve to, over http:// too (development and tests); everything else must be public https.
    webhook_allow_hosts: tuple[str, ...] = ()
    #: ``CALLER_MEMORY_WEBHOOK_HISTORY``: ``conversation.ended`` payloads may carry summary and history
    #: (for endpoints that ask for it).
    webhook_history: bool = False
    #: Seconds one webhook attempt may take (``CALLER_MEMORY_WEBHOOK_TIMEOUT``).
    webhook_timeout: float = 10.0
    #: Attempts in flight at once per endpoint, per process (``CALLER_MEMORY_WEBHOOK_CONCURRENCY``).
    webhook_concurrency: int = 4
    #: Seconds between looks at the queue when nothing woke the worker (``CALLER_MEMORY_WEBHOOK_INTERVAL``;
    #: 0: no delivery worker in this process). An event queued by this process wakes it at once.
    webhook_interval: float = 1.0
    #: ``CALLER_MEMORY_ARCHIVE_URL``: where projects with ``conversation.archive`` write ended conversations:
    #: a directory (``file://`` URL or path) or an ``s3://bucket/prefix`` (its settings from ``AWS_*``).
    archive_url: str = DEFAULT_ARCHIVE

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
        for attribute, name in _POSITIVE.items():
            if seconds.get(attribute) == 0:
                # Every store call (or request) would fail at once.
                raise SettingsError(f"{name} must be more than 0 seconds")
        if seconds.get("read_cache_seconds", 0.0) > MAX_READ_CACHE_SECONDS:
            raise SettingsError(
                f"CALLER_MEMORY_READ_CACHE_SECONDS must be at most {MAX_READ_CACHE_SECONDS:g} (the longest a"
                " write through another replica may go unseen)"
            )
        if env.get("CALLER_MEMORY_WORKERS") and overrides.get("workers") is None:  # --workers wins
            seconds["workers"] = parse_workers(env["CALLER_MEMORY_WORKERS"])
        for name, attribute, least in _WHOLE:
            if name in env:
                seconds[attribute] = _whole(env, name, least)
        seconds["access_log"] = _flag(env, "CALLER_MEMORY_ACCESS_LOG")
        seconds["webhook_history"] = _flag(env, "CALLER_MEMORY_WEBHOOK_HISTORY")
        seconds["redis_decimal_times"] = _flag(env, "CALLER_MEMORY_REDIS_DECIMAL_TIMES")
        seconds.update(_secret_keys(env))
        archive = env.get("CALLER_MEMORY_ARCHIVE_URL", "").strip()
        if archive:
            if not archive.startswith(("file:", "s3://", "/", ".")):
                raise SettingsError(
                    "CALLER_MEMORY_ARCHIVE_URL must be a directory (a file:// URL or a path) or an "
                    "s3://bucket/prefix URL"
                )
            seconds["archive_url"] = archive
        hosts = env.get("CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS", "")
        seconds["webhook_allow_hosts"] = tuple(h.strip() for h in hosts.split(",") if h.strip())
        settings = replace(settings, **seconds)
        return replace(settings, **{k: v for k, v in overrides.items() if v is not None})

    @property
    def project_in_flight(self) -> int:
        """The in-flight bound of one project: ``max_in_flight_per_project`` if set, else a quarter of
        ``max_in_flight`` and at least 16 (never more than ``max_in_flight``, which bounds it anyway)."""
        share = self.max_in_flight_per_project or max(16, self.max_in_flight // 4)
        return min(share, self.max_in_flight)
