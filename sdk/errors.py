"""Exceptions raised by the SDK, and the one function that turns a service answer into one of them.

::

    CallerMemoryError
    ├── ServiceError                 the service answered with an error (problem details)
    │   ├── AuthenticationError      401: missing, unknown or revoked token
    │   ├── PermissionDeniedError    403: the token's role does not allow it
    │   ├── NotFoundError            404: no such project (or another project's token), no such transcript
    │   │   └── GoneError            410: the transcript expired or its caller was erased
    │   ├── ConflictError            409: a conversation id reused with a different request, a conversation
    │   │                            that has ended, a message id reused with another message
    │   ├── PreconditionFailedError  412: If-Match did not match
    │   ├── TranscriptsFullError     507: the project's transcripts are at max_transcript_bytes; messages
    │   │                            are dropped (ends are still taken), retrying does not help soon
    │   └── InvalidRequestError      400, 413, 415, 422: the request itself is wrong; fix it, do not retry
    ├── ServiceUnavailableError      the service could not be reached, timed out, answered 5xx/429/408,
    │                                redirected, or sent something that is not its documented answer;
    │                                retrying may help
    └── OutboxUnavailableError       the outbox file cannot be used (cannot be written, corrupt, locked)
"""

from __future__ import annotations

import math
from typing import Any

from ._wire import mask, problem


class CallerMemoryError(Exception):
    """Base of every SDK error."""


class ServiceError(CallerMemoryError):
    """The service refused the request. ``problem`` is its RFC 9457 problem document."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        #: The problem document, every string in it masked (it may echo the request, hence the number).
        self.problem: dict[str, Any] = _masked(problem)
        #: The problem's detail (or title), with anything shaped like a phone number masked.
        self.detail: str = str(self.problem.get("detail") or self.problem.get("title") or f"HTTP {status}")
        super().__init__(f"{status}: {self.detail}")


def _masked(value: Any) -> Any:
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, dict):
        return {mask(str(k)): _masked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_masked(v) for v in value]
    return value


class AuthenticationError(ServiceError):
    pass


class PermissionDeniedError(ServiceError):
    pass


class NotFoundError(ServiceError, LookupError):
    pass


class GoneError(NotFoundError):
    """410: the conversation's transcript existed and is gone (it expired, or its caller was erased)."""


class ConflictError(ServiceError):
    pass


class PreconditionFailedError(ServiceError):
    pass


class TranscriptsFullError(ServiceError):
    """507: the project's transcripts are at their bound (``max_transcript_bytes``). Messages are dropped
    and reported, never kept for later: holding them would hold back the ends queued behind them, and the
    bound lifts only as transcripts expire."""


class InvalidRequestError(ServiceError, ValueError):
    """The request was refused as invalid; ``errors`` names the offending fields."""

    @property
    def errors(self) -> list[dict[str, str]]:
        errors = self.problem.get("errors")
        return errors if isinstance(errors, list) else []


class ServiceUnavailableError(CallerMemoryError, ConnectionError):
    """The service could not be reached, did not answer in time, or had a transient failure.

    ``retry_after`` is the service's ``Retry-After`` in seconds, when it sent one."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class OutboxUnavailableError(CallerMemoryError, OSError):
    """The outbox file cannot be used: it cannot be created or written, it is corrupt, or another process
    kept it locked for longer than the client's ``outbox_timeout``. ``conv.end()`` raises it only when the
    service could not be reached either (the write would be lost)."""


class ClientClosedError(CallerMemoryError, RuntimeError):
    """The :class:`~caller_memory.sdk.MemoryClient` was closed (``aclose()``): an end started after that is
    refused, as nothing would deliver it (start the end before closing: ``aclose()`` waits for it)."""


_BY_STATUS: dict[int, type[ServiceError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    410: GoneError,
    412: PreconditionFailedError,
    413: InvalidRequestError,
    415: InvalidRequestError,
    422: InvalidRequestError,
    507: TranscriptsFullError,
}


def is_client_error(status: int) -> bool:
    """A 4xx that says the request was wrong (not 408 or 429, which say "later"): the caller's error, not
    an outage of the service."""
    return 400 <= status < 500 and status not in (408, 429)


def _seconds(retry_after: str | None) -> float | None:
    try:
        seconds = float(retry_after) if retry_after else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


def error_for(status: int, body: Any, retry_after: str | None = None) -> CallerMemoryError:
    """The exception for an answer that is not a success.

    A client error (4xx but 408/429) with the service's problem document is a ServiceError subclass;
    everything else (5xx, 408, 429, redirects, and answers that are not the service's problem documents,
    e.g. from a proxy) is ServiceUnavailableError. What the server wrote is masked before it is quoted."""
    document = problem(status, body)
    if document is not None and (is_client_error(status) or status == 507):
        return _BY_STATUS.get(status, ServiceError)(status, document)
    detail = mask(str(document.get("detail", ""))) if document else "(not the service's answer)"
    return ServiceUnavailableError(f"the service answered {status}: {detail}", status, _seconds(retry_after))
