"""Storage backends behind one interface (:mod:`.base`)."""

from __future__ import annotations

from .base import Store


def open_store(url: str, *, timeout: float = 0.5) -> Store:
    """Build (not yet open) the store for ``url``.

    ``sqlite:///relative.db`` or ``sqlite:////absolute/path.db``; ``redis://host:port/db``, ``rediss://``,
    ``unix:///path/redis.sock``. ``timeout`` bounds each network call to Redis, in seconds (SQLite is a
    local file: its writers wait for one another instead, up to a few seconds).
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        from .sqlite import SQLiteStore

        return SQLiteStore.from_url(url)
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisStore

        return RedisStore(url, socket_timeout=timeout, socket_connect_timeout=timeout)
    raise ValueError(
        f"unsupported store URL scheme '{scheme}': use sqlite:///path/to/file.db or redis://host:port/db"
    )
