"""API tokens and who may do what.

A project token reads ``cm_<token_id>_<secret>``. The store keeps the token id, project, role and the
SHA-256 of the secret; the secret is shown once when minted. Lookups are cached briefly per process, so a
revocation made through another replica takes effect within ``cache_seconds`` of the injected clock (so tests
move it instead of waiting). Only real tokens (and revocations made here) are cached, so the cache is bounded
by the number of tokens minted.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from .audit import AuditLog
from .clock import Clock
from .errors import Forbidden, InvalidInput, NotFound, TooManyRequests, Unauthenticated
from .id_rules import check_chosen_id
from .limits import NAME_PATTERN, TOKEN_ID_RE
from .store import Store, TokenRecord

TOKEN_PREFIX = "cm"
#: Bound on remembered credentials (only ones that authenticated are kept; the table is reset when full).
MAX_CACHED_PRINCIPALS = 10_000
_AGENT_NAME = re.compile(NAME_PATTERN)


class FailureThrottle:
    """Counts failed authentications per source (the client's address) over a sliding window.

    A source over ``limit`` failures in ``window`` seconds gets 429 for its *failed* attempts until the window
    has room again; a valid token from the same source is never refused, so a client with a typo next to a
    good one (or many clients behind one proxy) cannot lock the good ones out. At most ``max_sources`` are
    tracked (the least recently failing are forgotten first), so the table cannot grow without bound.

    Each source keeps the times of its last ``limit + 1`` failures only: the source is over its limit
    exactly when the oldest of them is still in the window, so the window is exact, and a failure costs
    the same (an append, a move to the end of the table) whether the source has failed 20 times or a
    million: memory is at most ``max_sources * (limit + 1)`` times.
    """

    def __init__(self, limit: int = 20, window: float = 60.0, max_sources: int = 10_000) -> None:
        self.limit = limit
        self.window = window
        self.max_sources = max_sources
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def failure(self, source: str) -> int | None:
        """Record a failure; returns seconds to wait if the source is now over its limit, else None."""
        now = time.monotonic()
        times = self._failures.get(source)
        if times is None:
            times = self._failures[source] = deque(maxlen=self.limit + 1)
            if len(self._failures) > self.max_sources:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(source)  # most recently failing last
        times.append(now)
        if len(times) > self.limit and now - times[0] < self.window:
            return max(1, int(self.window - (now - times[0])) + 1)
        return None


class Role(enum.StrEnum):
    AGENT = "agent"
    ANALYTICS = "analytics"
    ADMIN = "admin"
    #: Pasted into a hosted voice platform's console: only the endpoints platforms call
    #: (:func:`platform_may_call`).
    PLATFORM = "platform"
    #: A business's staff through an MCP client (SPEC section 17): read-only tools over any caller of the
    #: project (each use audited), and an erasure only where the connection opts in.
    STAFF = "staff"


#: What each role may do. ``admin`` may do everything in its project.
_GRANTS: dict[Role, frozenset[Role]] = {
    Role.AGENT: frozenset({Role.AGENT}),
    Role.ANALYTICS: frozenset({Role.ANALYTICS}),
    Role.ADMIN: frozenset({Role.AGENT, Role.ANALYTICS, Role.ADMIN, Role.PLATFORM, Role.STAFF}),
    Role.PLATFORM: frozenset({Role.PLATFORM}),
    Role.STAFF: frozenset({Role.STAFF}),
}

#: What a ``platform`` token may call in its project, besides nothing: the hooks platforms call
#: (``/platforms/<platform>/<hook>``), the memory proxy's completions and the MCP endpoint (whose agent tools
#: are bound to one call). Never the connection's own management (``/platforms/<platform>``, admin), never
#: memory, transcripts or anything else.
_PLATFORM_PATHS = re.compile(
    r"/v1/projects/(?P<project>[^/]+)/(?:platforms/[a-z0-9]+/[a-z0-9_-]+|llm/chat/completions|mcp)", re.ASCII
)


def platform_may_call(path: str, project: str) -> bool:
    """Whether a ``platform`` token of ``project`` may call ``path`` (the request's path, as sent: percent-escapes undecoded)."""
    match = _PLATFORM_PATHS.fullmatch(path)
    return match is not None and match["project"] == project


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the operator, or a project token with one role (an agent token may name the agent of
    a multi-agent system it acts as: under ``transcript_scope: "agent"`` it reads that agent's messages)."""

    operator: bool
    project: str | None = None
    role: Role | None = None
    token_id: str | None = None
    agent: str | None = None

    @property
    def name(self) -> str:
        """How audit records and logs refer to this principal (never a secret)."""
        return "operator" if self.operator else f"token:{self.token_id}"

    def require(self, project: str, role: Role) -> None:
        """Allow the call or raise. Another project's token learns nothing: the project is "not found"."""
        if self.operator:
            return
        if self.project != project:
            raise NotFound(f"project '{project}' not found")
        assert self.role is not None
        if role not in _GRANTS[self.role]:
            raise Forbidden(f"a token with role '{self.role}' cannot do this; it needs role '{role}'")

    def require_operator(self) -> None:
        if not self.operator:
            raise Forbidden("this needs the operator token")


@dataclass(frozen=True, slots=True)
class MintedToken:
    record: TokenRecord
    secret: str  # the full bearer token, shown once


def _hash(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class TokenService:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        operator_token: str | None,
        cache_seconds: float,
        audit: AuditLog,
        *,
        throttle: FailureThrottle | None = None,
    ) -> None:
        self._store = store
        self._audit = audit
        self.throttle = throttle or FailureThrottle()
        self._clock = clock
        self._operator_hash = _hash(operator_token) if operator_token else None
        self._cache_ms = cache_seconds * 1000
        #: Entries are stamped with ``clock.now_ms()`` when their token record was read from the store.
        self._cache: dict[str, tuple[int, TokenRecord | None]] = {}
        self._principals: dict[str, tuple[int, Principal]] = {}
        #: Revocations made through this process: a lookup that overlapped one does not fill the cache.
        self._revocations = 0

    async def mint(
        self,
        project: str,
        role: str,
        label: str = "",
        *,
        actor: str,
        agent: str | None = None,
        regions: Sequence[str | None] = (),
    ) -> MintedToken:
        """Mint a token (audited as done by ``actor``, on every path that mints one). ``agent`` names the
        agent an ``agent`` token acts as (transcript scope); no other role may carry one, and it may hold no
        phone number (read in ``regions``, the project's: :mod:`.id_rules`)."""
        try:
            parsed_role = Role(role)
        except ValueError:
            raise InvalidInput(
                f"role must be one of {', '.join(r.value for r in Role)}", field="role"
            ) from None
        if agent is not None:
            if parsed_role is not Role.AGENT:
                raise InvalidInput(
                    f"agent: only a token with role 'agent' acts as an agent (this one has role "
                    f"'{parsed_role.value}')",
                    field="agent",
                )
            if not _AGENT_NAME.fullmatch(agent):
                raise InvalidInput(
                    "agent: an agent name is 1-64 letters, digits, '.', '_', ':' or '-', starting with a "
                    "letter or digit",
                    field="agent",
                )
            check_chosen_id(agent, "agent", "agent name", regions)
        token_id = secrets.token_hex(6)
        secret = secrets.token_urlsafe(32)
        record = TokenRecord(
            token_id=token_id,
            project=project,
            role=parsed_role.value,
            secret_hash=_hash(secret),
            created_at=self._clock.now_ms(),
            label=label,
            agent=agent or "",
        )
        await self._store.put_token(record)
        self._cache[token_id] = (self._clock.now_ms(), record)
        details = {"token_id": token_id, "role": record.role} | ({"agent": agent} if agent else {})
        await self._audit.record(project, actor, "token.created", details)
        return MintedToken(record=record, secret=f"{TOKEN_PREFIX}_{token_id}_{secret}")

    async def list(self, project: str) -> list[TokenRecord]:
        return await self._store.list_tokens(project)

    async def revoke(self, project: str, token_id: str, *, actor: str) -> None:
        """Revoke a token (audited as done by ``actor``)."""
        # An id that no token can have is not looked up (nor echoed: it may be anything a path can hold).
        if not TOKEN_ID_RE.fullmatch(token_id) or not await self._store.delete_token(project, token_id):
            raise NotFound(
                f"no token with id '{token_id}' in project '{project}'"
                if TOKEN_ID_RE.fullmatch(token_id)
                else f"no such token in project '{project}' (a token id is 12 hex digits)"
            )
        self._revocations += 1
        self._cache[token_id] = (self._clock.now_ms(), None)
        self._principals = {k: v for k, v in self._principals.items() if v[1].token_id != token_id}
        await self._audit.record(project, actor, "token.revoked", {"token_id": token_id})

    async def _lookup(self, token_id: str) -> TokenRecord | None:
        cached = self._cache.get(token_id)
        if cached is not None and self._fresh(cached[0]):
            return cached[1]
        revocations = self._revocations
        read_at = self._clock.now_ms()
        record = await self._store.get_token(token_id)
        # Only tokens that exist are cached: ids made up by a caller must not grow the cache. A record read
        # while a revocation ran here may be the revoked token's: it serves this request only.
        if record is not None and revocations == self._revocations:
            self._cache[token_id] = (read_at, record)
        return record

    def _fresh(self, stamp: int) -> bool:
        # On the injected clock (the wall clock in production): if it is set back, entries turn stale rather
        # than fresh for longer, so a revocation elsewhere is never hidden beyond ``cache_seconds``.
        return 0 <= self._clock.now_ms() - stamp < self._cache_ms

    async def authenticate(self, authorization: str | None, source: str = "") -> Principal:
        """Resolve an ``Authorization`` header into a principal, or raise :class:`Unauthenticated`
        (:class:`TooManyRequests` when ``source`` has failed too often lately)."""
        try:
            return await self._authenticate(authorization)
        except Unauthenticated as exc:
            wait = self.throttle.failure(source)
            if wait is not None:
                raise TooManyRequests(
                    "too many failed authentications from this address; wait before trying again", wait
                ) from exc
            raise

    async def _authenticate(self, authorization: str | None) -> Principal:
        # Credentials that authenticated lately are recognised without hashing them again (the token
        # lookup cache has the same lifetime; revocation through this process clears both).
        if authorization is not None:
            known = self._principals.get(authorization)
            if known is not None and self._fresh(known[0]):
                return known[1]
        principal = await self._authenticate_afresh(authorization)
        if authorization is not None and principal.token_id is not None:
            if len(self._principals) >= MAX_CACHED_PRINCIPALS:
                self._principals.clear()
            # Stamped with when the token record was read from the store, not now: a credential written
            # differently (``bearer``, extra spaces) must not stretch the bound on seeing a revocation.
            # Not at all if the record was not cached (its lookup overlapped a revocation here).
            fetched = self._cache.get(principal.token_id)
            if fetched is not None and fetched[1] is not None:
                self._principals[authorization] = (fetched[0], principal)
        return principal

    async def _authenticate_afresh(self, authorization: str | None) -> Principal:
        if not authorization:
            raise Unauthenticated("missing Authorization header; send 'Authorization: Bearer <token>'")
        if not (authorization.isascii() and authorization.isprintable()):
            # Tokens are printable ASCII: anything else (bytes that are not UTF-8 included) is no token.
            raise Unauthenticated("the Authorization header holds characters that no token has")
        scheme, _, credential = authorization.partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential:
            raise Unauthenticated("the Authorization header must be 'Bearer <token>'")
        presented = _hash(credential)
        if self._operator_hash is not None and hmac.compare_digest(presented, self._operator_hash):
            return Principal(operator=True)
        prefix, _, rest = credential.partition("_")
        token_id, _, secret = rest.partition("_")
        if prefix == TOKEN_PREFIX and len(token_id) == 12 and secret:
            record = await self._lookup(token_id)
            if record is not None and hmac.compare_digest(_hash(secret), record.secret_hash):
                return Principal(
                    operator=False,
                    project=record.project,
                    role=Role(record.role),
                    token_id=token_id,
                    agent=record.agent or None,
                )
        raise Unauthenticated("the token is not valid (unknown, revoked or mistyped)")
