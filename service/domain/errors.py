"""Domain errors.

Every error the service can report is one of these. The HTTP middleware maps them to problem+json in one
place (``http/middleware.py``); backends translate driver exceptions into :class:`StoreUnavailable`.
Messages never contain a phone number.
"""

from __future__ import annotations


class CallerMemoryError(Exception):
    """Base class of every domain error."""

    status = 500
    title = "Internal error"
    type_slug = "internal"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class InvalidInput(CallerMemoryError, ValueError):
    """A request is well-formed but a value in it is not acceptable (HTTP 422)."""

    status = 422
    title = "Invalid input"
    type_slug = "invalid-input"

    def __init__(self, detail: str, *, field: str | None = None, errors: list[dict[str, str]] | None = None):
        super().__init__(detail)
        self.field = field
        if errors is None:
            errors = [{"field": field, "message": detail.removeprefix(f"{field}: ")}] if field else []
        self.errors = errors


class MalformedRequest(CallerMemoryError, ValueError):
    """The request body cannot be read at all, e.g. invalid JSON (HTTP 400)."""

    status = 400
    title = "Malformed request"
    type_slug = "malformed-request"


class NotAcceptable(CallerMemoryError, ValueError):
    """The request's ``Accept`` header takes none of the media types the answer comes in (HTTP 406)."""

    status = 406
    title = "Not acceptable"
    type_slug = "not-acceptable"


class UnsupportedMediaType(CallerMemoryError, ValueError):
    """The body is not of a media type the operation takes (HTTP 415)."""

    status = 415
    title = "Unsupported media type"
    type_slug = "unsupported-media-type"


class UnsupportedCharset(CallerMemoryError, ValueError):
    """The body is declared in a character set other than UTF-8 (HTTP 415)."""

    status = 415
    title = "Unsupported media type"
    type_slug = "unsupported-charset"


class InvalidIdentifier(InvalidInput):
    """The caller identifier is not a possible phone number (or not a valid identifier of another kind)."""

    type_slug = "invalid-identifier"

    def __init__(self, reason: str, *, kind: str = "phone") -> None:
        what = "a possible phone number" if kind == "phone" else f"a valid {kind} identifier"
        super().__init__(f"identifier is not {what}: {reason}", field="identifier")


class InvalidConfiguration(InvalidInput):
    """A project configuration was refused."""

    type_slug = "invalid-configuration"


class NotFound(CallerMemoryError, LookupError):
    """The addressed project, token or resource does not exist (or is not visible to the caller)."""

    status = 404
    title = "Not found"
    type_slug = "not-found"


class Unauthenticated(CallerMemoryError, PermissionError):
    """No usable credentials were presented (HTTP 401)."""

    status = 401
    title = "Unauthenticated"
    type_slug = "unauthenticated"


class Forbidden(CallerMemoryError, PermissionError):
    """The credentials are valid but their role does not allow the operation (HTTP 403)."""

    status = 403
    title = "Forbidden"
    type_slug = "forbidden"


class PreconditionFailed(CallerMemoryError):
    """``If-Match`` did not match the memory's current ETag (HTTP 412)."""

    status = 412
    title = "Precondition failed"
    type_slug = "precondition-failed"

    def __init__(self, current_etag: str, *, wildcard: bool = False, weak_only: bool = False) -> None:
        if wildcard:
            detail = "If-Match: * needs the caller to have memory, and it has none"
        elif weak_only:
            detail = "If-Match compares strongly, so a weak entity tag (W/...) never matches; send the ETag as given"
        else:
            detail = "the caller's memory changed since the ETag given in If-Match was issued"
        super().__init__(detail)
        self.current_etag = current_etag


class Conflict(CallerMemoryError):
    """The request conflicts with the current state (HTTP 409)."""

    status = 409
    title = "Conflict"
    type_slug = "conflict"


class TooManyRequests(CallerMemoryError):
    """The client must slow down (HTTP 429); ``retry_after`` is in seconds."""

    status = 429
    title = "Too many requests"
    type_slug = "too-many-requests"

    def __init__(self, detail: str, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class Overloaded(CallerMemoryError):
    """The service has as many requests in flight as it allows; this one is refused at once (HTTP 503)."""

    status = 503
    title = "Overloaded"
    type_slug = "overloaded"


class StoreUnavailable(CallerMemoryError, ConnectionError):
    """The store could not be reached or did not answer in time (HTTP 503)."""

    status = 503
    title = "Store unavailable"
    type_slug = "store-unavailable"


class StoreCorrupt(CallerMemoryError, RuntimeError):
    """The store holds data this version cannot read; refuse to run rather than serve an empty store."""

    status = 500
    title = "Store corrupt"
    type_slug = "store-corrupt"


class Gone(CallerMemoryError, LookupError):
    """The thing existed and is gone: a transcript that expired or was erased (HTTP 410)."""

    status = 410
    title = "Gone"
    type_slug = "expired"


class PayloadTooLarge(InvalidInput):
    """A value passes a size limit, named in the detail (HTTP 413); nothing was changed."""

    status = 413
    title = "Payload too large"
    type_slug = "too-large"


class TranscriptsFull(CallerMemoryError):
    """The project's transcripts are at ``max_transcript_bytes`` (HTTP 507); ends are still taken."""

    status = 507
    title = "Insufficient storage"
    type_slug = "transcripts-full"
