"""``caller-memory mcp``: the MCP tools on stdin and stdout, relayed to a running service.

For an assistant that starts its MCP servers as processes (a desktop assistant, a framework's stdio client).
The process is a client of the service, never of the store: each JSON-RPC message read on stdin is sent, as
the official SDK's Streamable HTTP client sends it, to ``POST {url}/v1/projects/{project}/mcp`` with the
project token of ``CALLER_MEMORY_TOKEN`` (and the conversation, or the erasure opt-in, of the command line),
and each answer is written to stdout. A message is read only as far as the HTTP headers the official
client would put on it need (the negotiated protocol version; a 2026-era request's method, name and
``Mcp-Param-*`` values), so whatever the protocol carries passes as it came: elicitation, input-required
results, methods added later.

What the service cannot answer becomes a JSON-RPC error of the request that met it, and the relay goes on
serving: the service down or out of reach (:data:`SERVICE_UNREACHABLE`), a token it refused
(:data:`TOKEN_REFUSED`), an error status that is not an MCP answer (:data:`SERVICE_ERROR`). Neither those
errors nor the log lines quote the token, the conversation id or a caller's number.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any
from urllib.parse import quote, urlsplit

import anyio
import httpx2
from mcp.client._transport import ReadStream, WriteStream
from mcp.client.streamable_http import streamable_http_client
from mcp.server.stdio import stdio_server
from mcp.shared.inbound import (
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PROTOCOL_VERSION_HEADER,
    NAME_BEARING_METHODS,
    encode_header_value,
    find_invalid_x_mcp_header,
    mcp_param_headers,
    x_mcp_header_map,
)
from mcp.shared.message import ClientMessageMetadata, SessionMessage
from mcp_types import (
    PARSE_ERROR,
    PROTOCOL_VERSION_META_KEY,
    ErrorData,
    JSONRPCError,
    JSONRPCMessage,
    JSONRPCRequest,
    JSONRPCResponse,
    RequestId,
)

from ..logs import configure_logging, mask_text
from .connection import CONVERSATION_HEADER, ERASURE_HEADER

log = logging.getLogger("caller_memory.mcp")

#: The environment variable the token comes from (never an argument: a command line is visible to every user).
TOKEN_VARIABLE = "CALLER_MEMORY_TOKEN"

#: JSON-RPC error codes of the relay's own answers (implementation-defined server errors, clear of the
#: codes MCP uses in -32000..-32099): the service could not be reached or did not answer in time; the service
#: refused the token (HTTP 401, or 403 for a token without the role the connection needs); the service
#: answered an error status without an MCP answer (a project that does not exist, a proxy's error page).
SERVICE_UNREACHABLE = -32050
TOKEN_REFUSED = -32051
SERVICE_ERROR = -32052

#: A tool call answers within seconds, but a server may hold a Streamable HTTP response open (SSE) for
#: longer; connecting to a service that is down should not keep a request waiting long.
TIMEOUT = httpx2.Timeout(30.0, connect=10.0, read=300.0)
#: The largest JSON answer taken from the service (a transcript read is well under a megabyte).
MAX_ANSWER_BYTES = 16 * 1024 * 1024
#: How long the relay waits, once stdin has closed, for answers to requests already sent.
DRAIN_SECONDS = 30.0
#: How much of an error's text from the service an answer quotes.
MAX_DETAIL_CHARS = 300

#: Printable ASCII: what an HTTP header value may hold as it is.
_HEADER_SAFE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?")


class UsageError(ValueError):
    """A command-line argument or the token cannot be used; the message never quotes a secret."""


@dataclass(frozen=True)
class Connection:
    """Where the relay sends messages, and the headers of the connection (secrets kept out of ``repr``)."""

    endpoint: str
    origin: str
    project: str
    token: str = field(repr=False)
    conversation: str | None = field(default=None, repr=False)
    allow_erasure: bool = False

    @classmethod
    def from_arguments(
        cls, url: str, project: str, *, token: str | None, conversation: str | None, allow_erasure: bool
    ) -> Connection:
        """Check the command line and the token before anything starts (raises :class:`UsageError`)."""
        token = (token or "").strip()
        if not token:
            raise UsageError(
                f"set {TOKEN_VARIABLE} to a token of project {project!r} (an agent or platform token with "
                "--conversation, a staff token without it); a token is never taken from the command line"
            )
        if not _HEADER_SAFE.fullmatch(token) or " " in token:
            raise UsageError(
                f"{TOKEN_VARIABLE} is not a token: it holds a space or a character a token never has"
            )
        if conversation is not None and not _HEADER_SAFE.fullmatch(conversation):
            raise UsageError("--conversation must be a conversation id: printable ASCII without edge spaces")
        if conversation is not None and allow_erasure:
            raise UsageError(
                "--allow-erasure is for a staff connection (without --conversation): an agent connection "
                "has no erase_caller tool"
            )
        if not project or project.strip() != project:
            raise UsageError("--project must name a project")
        origin, base = _service_url(url)
        endpoint = f"{base}/v1/projects/{quote(project, safe='')}/mcp"
        return cls(endpoint, origin, project, token, conversation, allow_erasure)

    def headers(self) -> dict[str, str]:
        headers = {
            "Authorization": f"Bearer {self.token}",
            # Answers are read whole before they are relayed (ServiceAnswers): nothing to decompress.
            "Accept-Encoding": "identity",
            "User-Agent": f"caller-memory-mcp/{_version()}",
        }
        if self.conversation is not None:
            headers[CONVERSATION_HEADER] = self.conversation
        if self.allow_erasure:
            headers[ERASURE_HEADER] = "allow"
        return headers

    def scrub(self, text: str) -> str:
        """``text`` (an error message of the service) without the connection's secrets or caller numbers."""
        for secret in (self.token, self.conversation):
            if secret:  # where it stands whole: a conversation "1" is not every digit 1
                text = re.sub(rf"(?<![\w-]){re.escape(secret)}(?![\w-])", "[...]", text)
        text = mask_text(text)
        return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 3] + "..."


def _service_url(url: str) -> tuple[str, str]:
    """The origin (for messages) and the base URL (for requests) of ``--url``."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port  # raises for a port that is not a number, or out of range
    except ValueError:
        raise UsageError(
            "--url is not a URL; give the service's address, e.g. http://127.0.0.1:8080"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            "--url must be the service's http:// or https:// address, e.g. http://127.0.0.1:8080"
        )
    if parts.username is not None or parts.password is not None:
        raise UsageError(f"--url must not hold a user or password: the token goes in {TOKEN_VARIABLE}")
    if parts.query or parts.fragment or "/v1/" in f"{parts.path}/":
        raise UsageError(
            "--url must be the service's address (e.g. https://memory.example.com), without the API's path, "
            "a query or a fragment"
        )
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    origin = f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")
    return origin, origin + parts.path.rstrip("/")


def _version() -> str:
    try:
        return metadata.version("caller-memory")
    except metadata.PackageNotFoundError:
        return "dev"


def _is_rpc_error(body: bytes) -> bool:
    try:
        document = json.loads(body)
    except ValueError:
        return False
    return (
        isinstance(document, dict)
        and document.get("jsonrpc") == "2.0"
        and isinstance(document.get("error"), dict)
    )


def _rpc_error(code: int, message: str, data: Any = None) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return json.dumps({"jsonrpc": "2.0", "id": None, "error": error}).encode()


class ServiceAnswers(httpx2.AsyncBaseTransport):
    """The HTTP transport under the SDK's Streamable HTTP client: whatever happens to a request comes back
    as an HTTP answer the client can read, never as an exception (which would end the client's task group,
    and with it the relay). The SDK relays an error status that carries a JSON-RPC error as that error of
    the request; this transport makes one of each failure: the service unreachable or too slow, a refused
    token, an error status the MCP endpoint did not write. A JSON answer is read whole here, so that a
    connection lost in the middle of one is an answer too."""

    def __init__(self, connection: Connection, inner: httpx2.AsyncBaseTransport | None = None) -> None:
        self._connection = connection
        self._inner = inner or httpx2.AsyncHTTPTransport()
        #: What went wrong with the last request ("unreachable", "refused"), logged when it changes.
        self._trouble: str | None = None

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except (httpx2.HTTPError, OSError) as exc:
            return self._unreachable(request, exc)
        status = response.status_code
        kind = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        if status < 400 and kind != "application/json":
            self._note(None)
            return response  # an event stream (or a 202): the SDK reads it as it comes
        try:
            body = await self._read(response)
        except (httpx2.HTTPError, httpx2.StreamError, OSError) as exc:
            return self._unreachable(request, exc)
        except _TooLarge:
            return self._answer(
                request, 502, SERVICE_ERROR, f"an answer over {MAX_ANSWER_BYTES} bytes; not relayed"
            )
        if status in (401, 403):
            return self._refused(request, status, body)
        if status >= 400 and not _is_rpc_error(body):
            return self._service_error(request, status, body)
        self._note(None)
        headers = [
            (name, value)
            for name, value in response.headers.multi_items()
            if name.lower() not in ("content-length", "content-encoding", "transfer-encoding")
        ]
        return httpx2.Response(
            status, headers=headers, content=body, request=request, extensions=response.extensions
        )

    async def aclose(self) -> None:
        await self._inner.aclose()

    @staticmethod
    async def _read(response: httpx2.Response) -> bytes:
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > MAX_ANSWER_BYTES:
                    raise _TooLarge
                chunks.append(chunk)
        finally:
            await response.aclose()
        return b"".join(chunks)

    def _unreachable(self, request: httpx2.Request, exc: Exception) -> httpx2.Response:
        origin = self._connection.origin
        if isinstance(exc, httpx2.TimeoutException):
            why = "it did not answer in time"
        else:
            why = self._connection.scrub(str(exc)) or type(exc).__name__
        if self._note("unreachable"):
            log.warning(
                "the Caller Memory service at %s is unreachable (%s); requests answer an error", origin, why
            )
        return self._answer(
            request, 502, SERVICE_UNREACHABLE, f"Caller Memory service unreachable at {origin}: {why}"
        )

    def _refused(self, request: httpx2.Request, status: int, body: bytes) -> httpx2.Response:
        detail = self._detail(body)
        if status == 401:
            message = (
                f"Caller Memory refused the token (HTTP 401): set {TOKEN_VARIABLE} to a valid token of "
                f"project {self._connection.project!r}"
            )
        else:
            message = "Caller Memory refused the token for this connection (HTTP 403)"
        if detail:
            message += f"; the service says: {detail}"
        if self._note("refused"):
            log.warning("the service refused the token (HTTP %d)", status)
        return self._answer(request, status, TOKEN_REFUSED, message, {"status": status})

    def _service_error(self, request: httpx2.Request, status: int, body: bytes) -> httpx2.Response:
        detail = self._detail(body)
        self._note(None)
        if detail:
            message = f"Caller Memory answered HTTP {status}: {detail}"
        else:
            message = (
                f"{self._connection.origin} answered HTTP {status}, not as Caller Memory answers: "
                "is --url the service's address?"
            )
        return self._answer(request, status, SERVICE_ERROR, message, {"status": status})

    def _detail(self, body: bytes) -> str:
        """The service's own words in an error answer: a problem's detail, or a JSON-RPC error's message."""
        try:
            document = json.loads(body)
        except ValueError:
            return ""
        if not isinstance(document, dict):
            return ""
        text = document.get("detail") or document.get("title")
        error = document.get("error")
        if isinstance(error, dict):
            text = error.get("message")
        return self._connection.scrub(text) if isinstance(text, str) else ""

    @staticmethod
    def _answer(
        request: httpx2.Request, status: int, code: int, message: str, data: Any = None
    ) -> httpx2.Response:
        return httpx2.Response(
            status,
            headers={"content-type": "application/json"},
            content=_rpc_error(code, message, data),
            request=request,
        )

    def _note(self, trouble: str | None) -> bool:
        """Record how the last request went; whether that is a change."""
        changed, previous, self._trouble = trouble != self._trouble, self._trouble, trouble
        if changed and trouble is None and previous == "unreachable":
            log.info("the Caller Memory service at %s answers again", self._connection.origin)
        return changed


class _TooLarge(Exception):
    pass


class Stamps:
    """The HTTP headers the official client session puts on each message, worked out from the messages
    themselves (the relay has no session): after an ``initialize`` handshake, its negotiated protocol
    version on every later message; on a 2026-era request (its ``_meta`` names the protocol version), that
    version, the method, the ``Mcp-Name`` of a tool, prompt or resource, and the ``Mcp-Param-*`` headers
    of a tool whose input schema asks for them (learnt from the ``tools/list`` answers relayed)."""

    def __init__(self) -> None:
        self._version: str | None = None
        self._handshakes: set[RequestId] = set()
        self._listings: set[RequestId] = set()
        self._param_headers: dict[str, dict[tuple[str, ...], str]] = {}

    def outbound(self, message: JSONRPCMessage) -> dict[str, str] | None:
        if isinstance(message, JSONRPCRequest):
            params: Mapping[str, Any] = message.params or {}
            meta = params.get("_meta")
            version = meta.get(PROTOCOL_VERSION_META_KEY) if isinstance(meta, Mapping) else None
            if isinstance(version, str):
                return self._modern(message, params, version)
            if message.method == "initialize":
                self._handshakes.add(message.id)
                return None  # the transport sends the handshake without a version header
        return _safe({MCP_PROTOCOL_VERSION_HEADER: self._version}) if self._version else None

    def _modern(self, message: JSONRPCRequest, params: Mapping[str, Any], version: str) -> dict[str, str]:
        self._version = version
        headers = {MCP_PROTOCOL_VERSION_HEADER: version, MCP_METHOD_HEADER: message.method}
        name_key = NAME_BEARING_METHODS.get(message.method)
        name = params.get(name_key) if name_key is not None else None
        if isinstance(name, str):
            headers[MCP_NAME_HEADER] = encode_header_value(name)
            arguments = params.get("arguments")
            if (
                message.method == "tools/call"
                and name in self._param_headers
                and isinstance(arguments, Mapping)
            ):
                headers |= mcp_param_headers(self._param_headers[name], arguments)
        if message.method == "tools/list":
            self._listings.add(message.id)
        return _safe(headers)

    def inbound(self, message: JSONRPCMessage) -> None:
        if not isinstance(message, JSONRPCResponse | JSONRPCError) or message.id is None:
            return
        if message.id in self._handshakes:
            self._handshakes.discard(message.id)
            version = message.result.get("protocolVersion") if isinstance(message, JSONRPCResponse) else None
            if isinstance(version, str):
                self._version = version
        elif message.id in self._listings:
            self._listings.discard(message.id)
            if isinstance(message, JSONRPCResponse):
                self._learn_tools(message.result.get("tools"))

    def _learn_tools(self, tools: Any) -> None:
        for tool in tools if isinstance(tools, list) else ():
            if not isinstance(tool, dict) or not isinstance(name := tool.get("name"), str):
                continue
            schema = tool.get("inputSchema")
            header_map = x_mcp_header_map(schema) if find_invalid_x_mcp_header(schema) is None else {}
            if header_map:
                self._param_headers[name] = header_map
            else:
                self._param_headers.pop(name, None)


def _safe(headers: dict[str, str]) -> dict[str, str]:
    """The headers that HTTP can carry as they are: the server refuses a request whose header is missing
    (HEADER_MISMATCH), which is the client's answer; one that cannot be sent would end the HTTP client."""
    return {name: value for name, value in headers.items() if _HEADER_SAFE.fullmatch(value)}


class _Pending:
    """The requests sent to the service and not answered yet (waited for when stdin closes)."""

    def __init__(self) -> None:
        self._ids: set[RequestId] = set()
        self._empty = anyio.Event()
        self._empty.set()

    def sent(self, message: JSONRPCMessage) -> None:
        if isinstance(message, JSONRPCRequest):
            self._ids.add(message.id)
            if self._empty.is_set():
                self._empty = anyio.Event()

    def answered(self, message: JSONRPCMessage) -> None:
        if isinstance(message, JSONRPCResponse | JSONRPCError) and message.id is not None:
            self._ids.discard(message.id)
            if not self._ids:
                self._empty.set()

    async def drained(self) -> None:
        await self._empty.wait()


async def relay(
    connection: Connection,
    *,
    stdin: anyio.AsyncFile[str] | None = None,
    stdout: anyio.AsyncFile[str] | None = None,
    transport: httpx2.AsyncBaseTransport | None = None,
) -> None:
    """Relay MCP messages between stdin/stdout (or the given files) and the service, until stdin closes."""
    stamps, pending = Stamps(), _Pending()
    async with (
        httpx2.AsyncClient(
            headers=connection.headers(), timeout=TIMEOUT, transport=ServiceAnswers(connection, transport)
        ) as http,
        # Stateless: the service issues no session, so there is none to end (terminate_on_close).
        streamable_http_client(connection.endpoint, http_client=http, terminate_on_close=False) as service,
        stdio_server(stdin, stdout) as client,
    ):
        from_service: ReadStream[SessionMessage | Exception] = service[0]
        to_service: WriteStream[SessionMessage] = service[1]
        from_client: ReadStream[SessionMessage | Exception] = client[0]
        to_client: WriteStream[SessionMessage] = client[1]

        async def answers() -> None:
            async for item in from_service:
                if isinstance(item, Exception):  # an event stream the SDK could not read; it says so itself
                    log.warning("an answer of the service could not be read (%s)", type(item).__name__)
                    continue
                stamps.inbound(item.message)
                await to_client.send(item)
                pending.answered(item.message)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(answers)
            async for item in from_client:
                if isinstance(item, Exception):  # not JSON-RPC: answered here, never quoted
                    error = ErrorData(code=PARSE_ERROR, message="a line on stdin is not a JSON-RPC message")
                    await to_client.send(SessionMessage(JSONRPCError(jsonrpc="2.0", id=None, error=error)))
                    continue
                pending.sent(item.message)
                headers = stamps.outbound(item.message)
                await to_service.send(SessionMessage(item.message, ClientMessageMetadata(headers=headers)))
            with anyio.move_on_after(DRAIN_SECONDS):
                await pending.drained()
            tasks.cancel_scope.cancel()
        await to_client.aclose()  # ends the stdout writer of stdio_server


def run(
    url: str,
    project: str,
    *,
    conversation: str | None = None,
    allow_erasure: bool = False,
    environ: Mapping[str, str] = os.environ,
) -> int:
    """``caller-memory mcp``: 2 for a usage error (before anything starts), 0 once stdin has closed."""
    try:
        connection = Connection.from_arguments(
            url,
            project,
            token=environ.get(TOKEN_VARIABLE),
            conversation=conversation,
            allow_erasure=allow_erasure,
        )
    except UsageError as exc:
        os.write(2, f"error: {exc}\n".encode())
        return 2
    level = environ.get("CALLER_MEMORY_LOG_LEVEL", "INFO").upper()
    configure_logging(level if level in logging.getLevelNamesMapping() else "INFO")
    # The SDK's and httpx2's own records at DEBUG would quote whole messages: callers' memory.
    for name in ("mcp", "httpx2", "httpcore2"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger().level))
    kind = "an agent connection to a conversation" if conversation is not None else "a staff connection"
    log.info(
        "MCP on stdin/stdout, relayed to %s (%s%s)",
        connection.endpoint,
        kind,
        ", erasure allowed" if allow_erasure else "",
    )
    try:
        anyio.run(relay, connection)
    except KeyboardInterrupt:
        return 130
    return 0
