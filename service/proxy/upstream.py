"""A project's upstream model (``PUT/GET/DELETE /v1/projects/{p}/llm``): where the proxy sends completions.

- ``base_url`` follows the webhooks' destination rules (SPEC section 14): ``https://`` only, except to a host
  the operator allows (``CALLER_MEMORY_WEBHOOK_ALLOW_HOSTS``), no credentials or fragment, no IP literal in a
  special-purpose range; a host name is resolved and checked again at every connection by the HTTP client
  (service/http/proxy_client.py), which connects to the addresses it checked.
- ``api_key`` is sealed with ``CALLER_MEMORY_SECRET_KEY`` (AES-256-GCM, the project as associated data) before
  the store sees it, and never answered: a view says ``api_key_set``.
- ``timeout`` bounds the wait for the upstream's first byte and every idle gap of its stream.
Every change is audited (without the key).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass

import orjson
from pydantic import BaseModel, ConfigDict, Field, with_config
from typing_extensions import TypedDict  # pydantic reads typing's TypedDict only on Python 3.12+

from ..domain.audit import AuditLog
from ..domain.clock import Clock, iso_utc
from ..domain.errors import CallerMemoryError, InvalidInput, NotFound, StoreCorrupt
from ..domain.projects import Project
from ..domain.reports import DateTime
from ..domain.sealing import SealedFormError, Sealer, SealingKeyMissing, SealOpenError
from ..domain.store import Store
from ..domain.webhooks.policy import WebhookPolicy

#: The default bound on the wait for the upstream's first byte and on each idle gap of its stream (seconds).
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 600.0
#: The name the sealed key is bound to (the associated data of its sealing, beside the project).
_PURPOSE = "caller-memory upstream api key"


class UpstreamKeyMissing(CallerMemoryError):
    """The proxy's upstream needs ``CALLER_MEMORY_SECRET_KEY`` and the operator has not set it (503: the
    service's configuration, not the request, is what is missing)."""

    status = 503
    title = "The memory proxy is not configured"
    type_slug = "proxy-not-configured"

    def __init__(self) -> None:
        super().__init__(
            "the memory proxy needs CALLER_MEMORY_SECRET_KEY (32 random bytes in base64), which encrypts "
            "upstream API keys at rest; the operator has not set it"
        )


class LlmConfig(BaseModel):
    """``PUT /v1/projects/{p}/llm``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    base_url: str = Field(
        max_length=2048,
        description="The OpenAI-compatible API's base URL (`.../v1`); completions go to "
        "`{base_url}/chat/completions`. https:// only (plain http:// to a host the operator allows).",
    )
    api_key: str = Field(
        min_length=1, max_length=4096, description="Sent upstream as `Authorization: Bearer`; never answered."
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description="When set, every request goes upstream with this model (the platform's is replaced).",
    )
    timeout: float = Field(
        default=DEFAULT_TIMEOUT_S,
        gt=0,
        le=MAX_TIMEOUT_S,
        description="Seconds to wait for the upstream's first byte, and at most between two of its chunks.",
    )


@dataclass(frozen=True, slots=True)
class Upstream:
    """A project's upstream, its key opened (held in memory only, never logged)."""

    base_url: str
    api_key: str
    model: str | None
    timeout: float
    updated_at: int

    @property
    def completions_url(self) -> str:
        return self.base_url + "/chat/completions"


@with_config(ConfigDict(extra="forbid"))
class LlmUpstream(TypedDict):
    """A project's upstream model, without its key."""

    base_url: str
    #: Always true: a key is kept (it is never answered).
    api_key_set: bool
    model: str | None
    timeout: float
    updated_at: DateTime


def upstream_view(upstream: Upstream) -> LlmUpstream:
    """What ``GET`` answers: everything but the key."""
    return {
        "base_url": upstream.base_url,
        "api_key_set": True,
        "model": upstream.model,
        "timeout": upstream.timeout,
        "updated_at": iso_utc(upstream.updated_at),
    }


class UpstreamService:
    """The use cases of a project's upstream; answers are cached per project for ``cache_seconds`` (a change
    made by this process is seen at once, by the others within that time)."""

    def __init__(
        self,
        store: Store,
        sealer: Sealer,
        policy: WebhookPolicy,
        clock: Clock,
        *,
        audit: AuditLog,
        cache_seconds: float = 5.0,
    ) -> None:
        self._store = store
        self._sealer = sealer
        self.policy = policy
        self._clock = clock
        self._audit = audit
        self._cache_seconds = cache_seconds
        self._cache: dict[str, tuple[float, Upstream | None]] = {}

    def _checked_url(self, url: str) -> str:
        try:
            parts = self.policy.check_url(url)
        except InvalidInput as exc:
            raise InvalidInput(str(exc).replace("url ", "base_url ", 1), field="base_url") from None
        if parts.query:
            raise InvalidInput("base_url must not have a ?query", field="base_url")
        return url.rstrip("/")

    async def put(self, project: Project, body: LlmConfig, *, actor: str) -> tuple[Upstream, bool]:
        """Set the project's upstream; the upstream and whether it is new."""
        base_url = self._checked_url(body.base_url)
        project_id = project.project_id
        try:
            sealed = self._sealer.seal(body.api_key, _PURPOSE, project_id)
        except SealingKeyMissing:
            raise UpstreamKeyMissing from None
        now = self._clock.now_ms()
        upstream = Upstream(base_url, body.api_key, body.model, body.timeout, now)
        document = {
            "base_url": base_url,
            "sealed_key": base64.b64encode(sealed).decode(),
            "model": body.model,
            "timeout": body.timeout,
            "updated_at": now,
        }
        created = await self._store.put_llm(project_id, orjson.dumps(document))
        self._cache[project_id] = (time.monotonic(), upstream)
        details = {"base_url": base_url, "model": body.model, "timeout": body.timeout}
        await self._audit.record(project_id, actor, "llm.set", details)
        return upstream, created

    async def find(self, project_id: str) -> Upstream | None:
        """The project's upstream, or None when it has none."""
        cached = self._cache.get(project_id)
        if cached is not None and time.monotonic() - cached[0] < self._cache_seconds:
            return cached[1]
        document = await self._store.get_llm(project_id)
        upstream = None if document is None else self._decode(project_id, document)
        if len(self._cache) >= 10_000:
            self._cache.clear()  # project ids come from paths; a bound keeps the cache small
        self._cache[project_id] = (time.monotonic(), upstream)
        return upstream

    async def get(self, project: Project) -> Upstream:
        upstream = await self.find(project.project_id)
        if upstream is None:
            raise NotFound(f"project '{project.project_id}' has no upstream model (PUT .../llm sets one)")
        return upstream

    async def delete(self, project: Project, *, actor: str) -> None:
        project_id = project.project_id
        if not await self._store.delete_llm(project_id):
            raise NotFound(f"project '{project_id}' has no upstream model")
        self._cache.pop(project_id, None)
        await self._audit.record(project_id, actor, "llm.deleted", {})

    def _decode(self, project_id: str, document: bytes) -> Upstream:
        try:
            found = orjson.loads(document)
            sealed = base64.b64decode(found["sealed_key"])
            return Upstream(
                base_url=str(found["base_url"]),
                api_key=self._sealer.open(sealed, _PURPOSE, project_id),
                model=found.get("model"),
                timeout=float(found["timeout"]),
                updated_at=int(found["updated_at"]),
            )
        except SealingKeyMissing:
            raise UpstreamKeyMissing from None
        except (SealedFormError, SealOpenError) as exc:
            raise StoreCorrupt(f"the upstream API key of project '{project_id}': {exc}") from None
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise StoreCorrupt(
                f"the upstream document of project '{project_id}' is unreadable ({type(exc).__name__})"
            ) from None
