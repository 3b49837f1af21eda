"""Platform connections' use case: put (the secret sealed, kept when a PUT leaves it out), read (never the
secret: that it is set and when), delete; every change audited, whichever way in (HTTP or the command line).
Adapters open the secret with :meth:`PlatformConnections.opened_secret`, and read a connection on a call's way
with :meth:`PlatformConnections.for_call` (within a budget; the last one this process read when the store does
not answer, so that a call-start answer that must name the connection's settings is still valid)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Annotated, Any

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict

from ..audit import AuditLog
from ..clock import Clock, iso_utc
from ..errors import CallerMemoryError, InvalidInput, NotFound, Overloaded, StoreUnavailable
from ..projects import Project
from ..sealing import Sealer, SealingKeyMissing
from ..store import Store
from .connections import (
    PLATFORM_LIST,
    Connection,
    ConnectionBody,
    check_options,
    check_platform,
    needs_secret,
)

#: The associated data's purpose: a connection's secret opens only for its project and platform.
SECRET_PURPOSE = "caller-memory platform secret"
log = logging.getLogger("caller_memory.platforms")


class PlatformsNotConfigured(CallerMemoryError):
    """A connection's secret cannot be sealed: the operator has not set ``CALLER_MEMORY_SECRET_KEY`` (503:
    the service's configuration, not the request, is what is missing)."""

    status = 503
    title = "Platform secrets are not configured"
    type_slug = "platforms-not-configured"


@with_config(ConfigDict(extra="forbid"))
class PlatformConnection(TypedDict):
    """A platform connection as answered: everything but the secret."""

    platform: Annotated[str, Field(description=f"One of {PLATFORM_LIST}.")]
    state_map: dict[str, str]
    channel: str
    analysis_qa_key: str | None
    end_grace: Annotated[str, Field(description="ISO 8601 duration.")]
    options: dict[str, Any]
    secret_set: Annotated[bool, Field(description="Whether a secret is stored (it is never answered).")]
    secret_updated_at: Annotated[str | None, Field(description="When the secret was last set.")]
    updated_at: str


def connection_view(connection: Connection) -> PlatformConnection:
    return {
        "platform": connection.platform,
        "state_map": connection.state_map,
        "channel": connection.channel,
        "analysis_qa_key": connection.analysis_qa_key,
        "end_grace": connection.end_grace,
        "options": connection.options,
        "secret_set": connection.sealed_secret is not None,
        "secret_updated_at": None
        if connection.secret_updated_at is None
        else iso_utc(connection.secret_updated_at),
        "updated_at": iso_utc(connection.updated_at),
    }


@dataclass(slots=True)
class PlatformConnections:
    store: Store
    sealer: Sealer
    clock: Clock
    audit: AuditLog = field(kw_only=True)
    #: The last connection this process read, by project and platform (:meth:`for_call`).
    _seen: dict[tuple[str, str], Connection] = field(default_factory=dict, init=False, repr=False)

    async def put(
        self, project: Project, platform: str, body: ConnectionBody, *, actor: str
    ) -> tuple[Connection, bool]:
        """Keep the connection (replacing any); True when it is new. A body without ``secret`` keeps the
        stored one; the first PUT needs one where the platform's webhooks are verified with it."""
        check_platform(platform)
        options = check_options(platform, body.options)
        for path, key in body.state_map.items():
            if key not in project.state_keys:
                where = f"state_map.{path}"
                raise InvalidInput(f"{where}: '{key}' is not one of the project's state_keys", field=where)
        now = self.clock.now_ms()
        previous = await self._stored(project.project_id, platform)
        sealed, secret_at = (
            (None, None) if previous is None else (previous.sealed_secret, previous.secret_updated_at)
        )
        if body.secret is not None:
            try:
                sealed = self.sealer.seal(body.secret, SECRET_PURPOSE, project.project_id, platform)
            except SealingKeyMissing:
                raise PlatformsNotConfigured(
                    "platform connections need CALLER_MEMORY_SECRET_KEY (32 random bytes in base64), which "
                    "encrypts their secrets at rest; the operator has not set it"
                ) from None
            secret_at = now
        elif sealed is None and needs_secret(platform, options):
            raise InvalidInput(
                f"secret: required when a {platform} connection is made (its webhooks are verified with it); "
                "later PUTs may leave it out to keep it",
                field="secret",
            )
        connection = Connection(
            project=project.project_id,
            platform=platform,
            state_map=dict(body.state_map),
            channel=body.channel,
            analysis_qa_key=body.analysis_qa_key,
            end_grace=body.end_grace,
            options=options,
            sealed_secret=sealed,
            secret_updated_at=secret_at,
            updated_at=now,
        )
        created = await self.store.put_platform_connection(project.project_id, platform, connection.encode())
        self._seen[(project.project_id, platform)] = connection
        await self.audit.record(
            project.project_id,
            actor,
            "platform.connected" if created else "platform.updated",
            {"platform": platform, "secret_replaced": body.secret is not None},
        )
        return connection, created

    async def get(self, project: Project, platform: str) -> Connection:
        check_platform(platform)
        found = await self._stored(project.project_id, platform)
        key = (project.project_id, platform)
        if found is None:
            self._seen.pop(key, None)
            raise NotFound(f"project '{project.project_id}' has no {platform} connection")
        self._seen[key] = found
        return found

    async def for_call(
        self, project: Project, platform: str, budget_s: float, *, fresh: bool = True
    ) -> Connection | None:
        """The connection, read within ``budget_s`` (NotFound when there is none); when the store does not
        answer in time, or without ``fresh`` (a request that may not use the store: its project holds every
        request in flight it may), the last one this process read, or None if it read none: a call-start
        answer is then made without the connection's settings it could not read."""
        if not fresh:
            return self._seen.get((project.project_id, platform))
        try:
            async with asyncio.timeout(budget_s):
                return await self.get(project, platform)
        except (TimeoutError, StoreUnavailable, Overloaded):
            return self._seen.get((project.project_id, platform))

    def opened_secret(self, connection: Connection) -> str | None:
        """:meth:`secret`, or :class:`PlatformsNotConfigured` (503: the platform retries) when it does not
        open with the operator's keys (logged)."""
        try:
            return self.secret(connection)
        except ValueError:
            log.error(
                "%s: the connection's secret does not open with CALLER_MEMORY_SECRET_KEY or a previous key",
                connection.platform,
            )
            raise PlatformsNotConfigured(
                f"the {connection.platform} connection's secret does not open with the operator's keys "
                "(CALLER_MEMORY_SECRET_KEY, CALLER_MEMORY_SECRET_KEY_PREVIOUS)"
            ) from None

    async def delete(self, project: Project, platform: str, *, actor: str) -> None:
        check_platform(platform)
        self._seen.pop((project.project_id, platform), None)
        if not await self.store.delete_platform_connection(project.project_id, platform):
            raise NotFound(f"project '{project.project_id}' has no {platform} connection")
        await self.audit.record(project.project_id, actor, "platform.disconnected", {"platform": platform})

    def secret(self, connection: Connection) -> str | None:
        """The connection's secret in the clear, for its adapter's verification (raises a ValueError of
        :mod:`..sealing` when it does not open with the current key or a previous one)."""
        if connection.sealed_secret is None:
            return None
        return self.sealer.open(
            connection.sealed_secret, SECRET_PURPOSE, connection.project, connection.platform
        )

    async def _stored(self, project_id: str, platform: str) -> Connection | None:
        document = await self.store.get_platform_connection(project_id, platform)
        return None if document is None else Connection.decode(project_id, platform, document)
