"""Where archived conversations are written (SPEC section 11, "Archive"): a local directory or an S3-compatible
bucket, through one library for both (obstore: the Rust object_store crate, as used by Arrow and DataFusion).

``CALLER_MEMORY_ARCHIVE_URL``: ``file:///var/lib/caller-memory/archive`` (also a plain path), or
``s3://bucket/prefix`` with the bucket's settings from the usual environment variables (``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ALLOW_HTTP`` for a local S3 API...).
Every call is bounded by a timeout, and the library's errors become the domain's ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import BaseError
from obstore.store import LocalStore, from_url

from ..domain.errors import StoreUnavailable

log = logging.getLogger("caller_memory.archive")

#: Objects deleted by one call when a day of the archive is removed.
DELETE_BATCH = 1000


class ArchiveObjects:
    """The archive's objects under one URL."""

    def __init__(self, url: str, *, timeout: float = 10.0) -> None:
        self.url = url
        self.timeout = timeout
        parts = urlsplit(url)
        self._directory: Path | None = None
        self._store: Any = None  # made at the first use: nothing is created until a project archives
        if parts.scheme in ("", "file"):
            self._directory = Path(parts.path if parts.scheme == "file" else url).expanduser().resolve()
            self.where = str(self._directory)
        elif parts.scheme == "s3":
            self.where = f"s3://{parts.netloc}{parts.path}"
        else:
            raise ValueError("CALLER_MEMORY_ARCHIVE_URL must be a file:// URL, a directory or an s3:// URL")

    def _objects(self) -> Any:
        if self._store is None:
            self._store = LocalStore(self._directory, mkdir=True) if self._directory else from_url(self.url)
        return self._store

    async def _bounded(self, what: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """``call`` on the store, within the timeout. Every failure, making the store included (a directory
        that cannot be created, an s3:// URL without a region), is the domain's ``StoreUnavailable``: 503,
        and the end is redone. Its detail goes to clients, so it names no location (the log does)."""
        try:
            async with asyncio.timeout(self.timeout):
                return await call(self._objects())
        except TimeoutError:
            log.warning("the archive at %s did not answer %s within %g s", self.where, what, self.timeout)
            raise StoreUnavailable(f"the archive did not answer {what} within {self.timeout:g} s") from None
        except (BaseError, OSError, ValueError, RuntimeError) as exc:
            log.warning("the archive at %s refused %s: %s", self.where, what, type(exc).__name__)
            raise StoreUnavailable(f"the archive refused {what}: {type(exc).__name__}") from exc

    async def put(self, key: str, data: bytes) -> None:
        await self._bounded("a write", lambda objects: obstore.put_async(objects, key, data))

    async def delete(self, keys: Sequence[str]) -> None:
        """Delete these objects; one that is not there is not an error."""
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                await self._bounded("a deletion", lambda objects: obstore.delete_async(objects, key))  # noqa: B023

    async def directories(self, prefix: str) -> list[str]:
        """The "directories" right under ``prefix`` (``project=shop/`` -> ``project=shop/date=...``)."""
        listed = await self._bounded(
            "a listing", lambda objects: obstore.list_with_delimiter_async(objects, prefix)
        )
        return sorted(str(p) for p in listed["common_prefixes"])

    async def objects(self, prefix: str) -> list[str]:
        """The keys of the objects right under ``prefix``."""
        listed = await self._bounded(
            "a listing", lambda objects: obstore.list_with_delimiter_async(objects, prefix)
        )
        return sorted(str(o["path"]) for o in listed["objects"])

    async def read(self, key: str) -> bytes:
        result = await self._bounded("a read", lambda objects: obstore.get_async(objects, key))
        return bytes(await self._bounded("a read", lambda _: result.bytes_async()))
