"""Headless Chromium (Debian's ``chromium`` package) driven over the Chrome DevTools Protocol, with aiohttp.

    async with Chromium() as browser:
        page = await browser.new_page()
        await page.navigate(url)                             # returns once the load event fired
        await page.type("#project", "shop")                  # focus, then real key input
        await page.click("#load")                            # a real mouse click in the element's middle
        await page.wait_for("document.querySelector('#x')")  # polls until truthy; returns the value
        await page.evaluate("document.title")                # a JSON value, or JavaScriptError
        png = await page.screenshot()                        # the whole page
        page.requests, page.problems                         # URLs it asked for; console errors, CSP reports

One websocket to the browser; each page is a target attached in "flat" mode and addressed by its session id.
No Python dependency beyond aiohttp, which the service already needs. The browser runs in a private
profile directory with background networking off, so the only requests it makes are the page's.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

CHROMIUM = "/usr/bin/chromium"
FLAGS = (
    "--headless",
    "--no-sandbox",  # we run as root in a container; the sandbox needs user namespaces
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--no-proxy-server",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-features=Translate,MediaRouter,OptimizationHints",
    "--remote-debugging-port=0",
)
START_TIMEOUT_S = 20.0
COMMAND_TIMEOUT_S = 15.0
POLL_S = 0.05

Params = dict[str, Any]


class BrowserError(RuntimeError):
    """The browser could not be started, or a DevTools command failed."""


class JavaScriptError(BrowserError):
    """An expression evaluated in the page threw."""


class Chromium:
    """One headless Chromium process in a temporary profile, and the DevTools connection to it."""

    def __init__(self, executable: str = CHROMIUM, *, width: int = 1280, height: int = 900) -> None:
        if shutil.which(executable) is None:
            raise BrowserError(f"{executable} is not installed (apt-get install chromium, or make test)")
        self.executable = executable
        self.size = (width, height)
        self.stderr_tail: list[str] = []
        self._profile: tempfile.TemporaryDirectory[str] | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._stderr_task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Params]] = {}
        self._listeners: list[tuple[str | None, str, Callable[[Params], None]]] = []

    async def __aenter__(self) -> Chromium:
        try:
            await self._start()
        except BaseException:
            await self._stop()
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stop()

    # Process -----------------------------------------------------------------------------------------

    async def _start(self) -> None:
        self._profile = tempfile.TemporaryDirectory(prefix="chromium-profile-")
        width, height = self.size
        self._proc = await asyncio.create_subprocess_exec(
            self.executable,
            *FLAGS,
            f"--user-data-dir={self._profile.name}",
            f"--window-size={width},{height}",
            "about:blank",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: ours to end, helpers included
        )
        endpoint: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._stderr_task = asyncio.create_task(self._drain_stderr(endpoint))
        try:
            url = await asyncio.wait_for(endpoint, START_TIMEOUT_S)
        except (TimeoutError, EOFError):
            tail = "\n".join(self.stderr_tail[-20:])
            raise BrowserError(f"chromium did not open its DevTools endpoint:\n{tail}") from None
        self._session = aiohttp.ClientSession()
        self._ws = await self._session.ws_connect(url, max_msg_size=0)
        self._reader = asyncio.create_task(self._read())

    async def _drain_stderr(self, endpoint: asyncio.Future[str]) -> None:
        """Read stderr to the end (a full pipe would block the browser); spot the DevTools URL on the way."""
        assert self._proc is not None and self._proc.stderr is not None
        async for raw in self._proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.stderr_tail = [*self.stderr_tail[-49:], line]
            if line.startswith("DevTools listening on ") and not endpoint.done():
                endpoint.set_result(line.removeprefix("DevTools listening on ").strip())
        if not endpoint.done():
            endpoint.set_exception(EOFError("chromium exited"))

    async def _stop(self) -> None:
        if self._ws is not None and not self._ws.closed:
            with contextlib.suppress(BrowserError, TimeoutError, ConnectionError):
                await self.send("Browser.close", within=5)
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._session is not None:
            await self._session.close()
        if self._proc is not None:
            try:
                await asyncio.wait_for(self._proc.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._proc.pid, signal.SIGKILL)  # the group of the process we started
                await self._proc.wait()
        if self._stderr_task is not None:
            with contextlib.suppress(EOFError):
                await self._stderr_task
        if self._profile is not None:
            self._profile.cleanup()
        self._ws = self._reader = self._session = self._proc = self._stderr_task = self._profile = None

    # Protocol ----------------------------------------------------------------------------------------

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for message in self._ws:
                if message.type is not aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(message.data)
                if "id" in data:
                    future = self._pending.pop(data["id"], None)
                    if future is None or future.done():
                        continue
                    if "error" in data:
                        future.set_exception(BrowserError(f"{data['error'].get('message')}: {data['error']}"))
                    else:
                        future.set_result(data.get("result", {}))
                    continue
                for session, method, callback in list(self._listeners):
                    if method == data.get("method") and session == data.get("sessionId"):
                        callback(data.get("params", {}))
        finally:
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(BrowserError("the browser closed the DevTools connection"))
            self._pending.clear()

    async def send(
        self, method: str, params: Params | None = None, *, session: str | None = None, within: float = 0
    ) -> Params:
        """Send one command (to a page when ``session`` is given) and return its result."""
        if self._ws is None or self._ws.closed:
            raise BrowserError("not connected to the browser")
        message: Params = {"id": next(self._ids), "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        future: asyncio.Future[Params] = asyncio.get_running_loop().create_future()
        self._pending[message["id"]] = future
        await self._ws.send_str(json.dumps(message))
        try:
            return await asyncio.wait_for(future, within or COMMAND_TIMEOUT_S)
        finally:
            self._pending.pop(message["id"], None)

    def on(self, method: str, callback: Callable[[Params], None], *, session: str | None = None) -> None:
        """Call ``callback(params)`` for every event ``method`` (of a page's session, or of the browser)."""
        self._listeners.append((session, method, callback))

    def expect(
        self, method: str, predicate: Callable[[Params], bool] = lambda _: True, *, session: str | None = None
    ) -> asyncio.Future[Params]:
        """A future for the next event ``method`` that satisfies ``predicate``; ask before causing it."""
        future: asyncio.Future[Params] = asyncio.get_running_loop().create_future()

        def check(params: Params) -> None:
            if not future.done() and predicate(params):
                future.set_result(params)

        self.on(method, check, session=session)
        return future

    async def new_page(self) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})
        page = Page(self, attached["sessionId"])
        await page.enable()
        return page

    async def allow_downloads(self, folder: Path) -> None:
        """Save downloads into ``folder``, and report their progress as ``Browser.downloadProgress`` events."""
        params = {"behavior": "allow", "downloadPath": str(folder), "eventsEnabled": True}
        await self.send("Browser.setDownloadBehavior", params)


class Page:
    """One tab, attached in flat mode."""

    def __init__(self, browser: Chromium, session: str) -> None:
        self.browser = browser
        self.session = session
        #: Every URL the page asked for (documents, scripts, styles, fetches, downloads), in order.
        self.requests: list[str] = []
        #: Console errors, uncaught exceptions and browser log entries of level error (CSP violations, ...).
        self.problems: list[str] = []

    async def send(self, method: str, params: Params | None = None, *, within: float = 0) -> Params:
        return await self.browser.send(method, params, session=self.session, within=within)

    async def enable(self) -> None:
        on = self.browser.on
        on(
            "Network.requestWillBeSent",
            lambda p: self.requests.append(p["request"]["url"]),
            session=self.session,
        )
        on("Runtime.exceptionThrown", self._exception, session=self.session)
        on("Runtime.consoleAPICalled", self._console, session=self.session)
        on("Log.entryAdded", self._log, session=self.session)
        for domain in ("Page", "Network", "Runtime", "Log"):
            await self.send(f"{domain}.enable")
        width, height = self.browser.size
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        await self.send("Emulation.setDeviceMetricsOverride", metrics)

    def _exception(self, params: Params) -> None:
        details = params.get("exceptionDetails", {})
        self.problems.append(f"exception: {details.get('exception', {}).get('description') or details}")

    def _console(self, params: Params) -> None:
        if params.get("type") in ("error", "assert"):
            self.problems.append(
                "console: " + " ".join(str(a.get("value", a)) for a in params.get("args", []))
            )

    def _log(self, params: Params) -> None:
        entry = params.get("entry", {})
        if entry.get("level") == "error":
            self.problems.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")

    async def navigate(self, url: str) -> None:
        """Open ``url`` and return once its load event fired."""
        loaded = self.browser.expect("Page.loadEventFired", session=self.session)
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise BrowserError(f"could not open {url}: {result['errorText']}")
        await asyncio.wait_for(loaded, COMMAND_TIMEOUT_S)

    async def reload(self) -> None:
        loaded = self.browser.expect("Page.loadEventFired", session=self.session)
        await self.send("Page.reload", {"ignoreCache": True})
        await asyncio.wait_for(loaded, COMMAND_TIMEOUT_S)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises are awaited), as JSON."""
        params = {"expression": expression, "returnByValue": True, "awaitPromise": True, "userGesture": True}
        result = await self.send("Runtime.evaluate", params)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise JavaScriptError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    async def wait_for(self, expression: str, *, within: float = 10.0, what: str = "") -> Any:
        """Poll ``expression`` until it is truthy (for at most ``within`` seconds) and return its value."""
        deadline = asyncio.get_running_loop().time() + within
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what or expression}; page problems: {self.problems}"
                )
            await asyncio.sleep(POLL_S)

    async def type(self, selector: str, text: str) -> None:
        """Replace the content of an input with ``text``, typed as key input into the focused field."""
        await self.evaluate(
            f"""(() => {{
                const e = document.querySelector({json.dumps(selector)});
                e.focus();
                e.value = "";
                e.dispatchEvent(new Event("input", {{bubbles: true}}));
            }})()"""
        )
        if text:
            await self.send("Input.insertText", {"text": text})

    async def click(self, selector: str) -> None:
        """A left click in the middle of the element, which must be visible."""
        box = await self.evaluate(
            f"""(() => {{
                const e = document.querySelector({json.dumps(selector)});
                if (!e) return null;
                e.scrollIntoView({{block: "center"}});
                const r = e.getBoundingClientRect();
                return r.width && r.height ? [r.x + r.width / 2, r.y + r.height / 2] : null;
            }})()"""
        )
        if box is None:
            raise BrowserError(f"{selector} is not on the page or not visible")
        for kind in ("mousePressed", "mouseReleased"):
            event = {"type": kind, "x": box[0], "y": box[1], "button": "left", "clickCount": 1}
            await self.send("Input.dispatchMouseEvent", event)

    async def select(self, selector: str, value: str) -> None:
        """Choose an option of a <select> and fire its change event (as a person's choice would)."""
        await self.evaluate(
            f"""(() => {{
                const e = document.querySelector({json.dumps(selector)});
                e.value = {json.dumps(value)};
                e.dispatchEvent(new Event("change", {{bubbles: true}}));
            }})()"""
        )

    async def screenshot(self) -> bytes:
        """A PNG of the whole page, beyond the viewport."""
        metrics = await self.send("Page.getLayoutMetrics")
        size = metrics["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        params = {"format": "png", "captureBeyondViewport": True, "clip": clip}
        shot = await self.send("Page.captureScreenshot", params, within=30)
        return base64.b64decode(shot["data"])
