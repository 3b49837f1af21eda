"""A scripted OpenAI-compatible model served from a thread of its own, for tests whose service runs in another
process and whose code is not async (the fuzz run): every completion answers ``ok``."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from caller_memory.sdk.testing import ScriptedModel


@contextlib.contextmanager
def threaded_model() -> Iterator[str]:
    """The model's base URL (``http://127.0.0.1:<port>/v1``) while it runs."""
    ready = threading.Event()
    held: dict[str, Any] = {}

    async def serve() -> None:
        stop = asyncio.Event()
        async with ScriptedModel(lambda request: "ok") as model:
            held.update(url=model.base_url, loop=asyncio.get_running_loop(), stop=stop)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the scripted model did not start")
    try:
        yield str(held["url"])
    finally:
        held["loop"].call_soon_threadsafe(held["stop"].set)
        thread.join(10)
