"""Storage backends: each implements the domain's Store interface (:mod:`caller_memory.service.domain.store`)."""

from __future__ import annotations

from ..domain.errors import InvalidInput
from ..domain.store import Store


def open_store(
    url: str,
    *,
    timeout: float = 0.5,
    cache_seconds: float = 0.0,
    cache_entries: int = 10_000,
    decimal_times: bool = False,
) -> Store:
    """Build (not yet open) the store for ``url``.

    ``sqlite:///relative.db`` or ``sqlite:////absolute/path.db``; ``redis://host:port/db``, ``rediss://``,
    ``unix:///path/redis.sock``; Redis Cluster: ``redis+cluster://host:port[,host:port...]/`` (or
    ``rediss+cluster://``; any reachable node is enough, the others are discovered). ``timeout`` bounds each
    network call to Redis, in seconds (SQLite is a local file: its writers wait for one another instead, up
    to a few seconds). A URL that names no store (an unknown scheme, a malformed cluster URL, a database
    other than 0 on a cluster) raises :class:`InvalidInput` (a ``ValueError``), which the command line
    prints as an error rather than a traceback. ``cache_seconds`` (with ``cache_entries``) turns on the read
    cache of one Redis server (:class:`~caller_memory.service.storage.redis.read_cache.ReadCache`); SQLite reads a local file and needs
    none, and a Redis Cluster has none (refused). ``decimal_times``: Redis writes memory fields in the form
    earlier releases read (:class:`~caller_memory.service.storage.redis.store.RedisStore`; SQLite has no such form).
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        from .sqlite.store import SQLiteStore

        return SQLiteStore.from_url(url)
    if scheme in ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster"):
        from .redis.store import RedisStore

        if cache_seconds and "+cluster" in scheme:
            raise InvalidInput(
                "the read cache (CALLER_MEMORY_READ_CACHE_SECONDS) works on one Redis server, not on a Redis"
                " Cluster: set it to 0",
                field="store",
            )
        try:
            return RedisStore(
                url,
                socket_timeout=timeout,
                socket_connect_timeout=timeout,
                cache_seconds=cache_seconds,
                cache_entries=cache_entries,
                decimal_times=decimal_times,
            )
        except ValueError as exc:
            raise InvalidInput(f"store URL: {exc}", field="store") from exc
    raise InvalidInput(
        f"unsupported store URL scheme '{scheme}': use sqlite:///path/to/file.db, redis://host:port/db or "
        "redis+cluster://host:port,host:port/",
        field="store",
    )
