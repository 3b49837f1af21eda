"""Storage backends behind one interface (:mod:`.base`)."""

from __future__ import annotations

from typing import Any

from .base import Store


def open_store(url: str, **options: Any) -> Store:
    """Build (not yet open) the store for ``url``.

    ``sqlite:///relative.db`` or ``sqlite:////absolute/path.db``; ``redis://host:port/db``, ``rediss://``,
    ``unix:///path/redis.sock``. ``options`` are passed to the backend (timeouts).
    """
    scheme = url.split(":", 1)[0].lower()
    if scheme == "sqlite":
        from .sqlite import SQLiteStore

        return SQLiteStore.from_url(url, **options)
    if scheme in ("redis", "rediss", "unix"):
        from .redis import RedisStore

        return RedisStore.from_url(url, **options)
    raise ValueError(
        f"unsupported store URL scheme '{scheme}': use sqlite:///path/to/file.db or redis://host:port/db"
    )
