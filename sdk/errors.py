"""Exceptions raised by the SDK, and the one function that turns a service answer into one of them.

::

    CallerMemoryError
    ├── ServiceError                 the service answered with an error (problem details)
    │   ├── AuthenticationError      401: missing, unknown or revoked token
    │   ├── PermissionDeniedError    403: the token's role does not allow it
    │   ├── NotFoundError            404: no such project (or another project's token)
    │   ├── ConflictError            409: a conversation id reused with a different request
    │   ├── PreconditionFailedError  412: If-Match did not match
    │   └── InvalidRequestError      400, 413, 415, 422: the request itself is wrong; fix it, do not retry
    ├── ServiceUnavailableError      the service could not be reached, timed out, or answered 5xx/429;
    │                                retrying may help
    └── OutboxUnavailableError       an end of conversation could be neither delivered nor kept
"""

from __future__ import annotations

from typing import Any


class CallerMemoryError(Exception):
    """Base of every SDK error."""


class ServiceError(CallerMemoryError):
    """The service refused the request. ``problem`` is its RFC 9457 problem document."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.detail: str = str(problem.get("detail") or problem.get("title") or f"HTTP {status}")
        super().__init__(f"{status}: {self.detail}")


class AuthenticationError(ServiceError):
    pass


class PermissionDeniedError(ServiceError):
    pass


class NotFoundError(ServiceError, LookupError):
    pass


class ConflictError(ServiceError):
    pass


class PreconditionFailedError(ServiceError):
    pass


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
    """``conv.end()`` could not reach the service and could not write the outbox either."""


_BY_STATUS: dict[int, type[ServiceError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    412: PreconditionFailedError,
    413: InvalidRequestError,
    415: InvalidRequestError,
    422: InvalidRequestError,
}


def error_for(status: int, body: Any, retry_after: str | None = None) -> CallerMemoryError:
    """The exception for an answer that is not a success. Transient failures (5xx, 408, 429, and answers
    that are not the service's problem documents, e.g. from a proxy) are ServiceUnavailableError."""
    if status >= 500 or status in (408, 429) or status < 400 or not isinstance(body, dict):
        try:
            seconds = float(retry_after) if retry_after else None
        except ValueError:
            seconds = None
        detail = body.get("detail", "") if isinstance(body, dict) else "(no problem document)"
        return ServiceUnavailableError(f"the service answered {status}: {detail}", status, seconds)
    return _BY_STATUS.get(status, ServiceError)(status, body)
