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
    └── ServiceUnavailableError      the service could not be reached, timed out, or answered 5xx/429;
                                     retrying may help
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
    """The service could not be reached, did not answer in time, or had a transient failure."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


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


def error_for(status: int, body: Any) -> CallerMemoryError:
    """The exception for an error answer (status >= 400). Transient failures are ServiceUnavailableError."""
    problem = body if isinstance(body, dict) else {"detail": str(body)[:200]}
    if status >= 500 or status in (408, 429):
        return ServiceUnavailableError(f"the service answered {status}: {problem.get('detail', '')}", status)
    return _BY_STATUS.get(status, ServiceError)(status, problem)
