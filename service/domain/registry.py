"""Project configurations: applied through here, and cached in-process for the hot path.

Each process keeps compiled projects for ``cache_seconds`` of the injected clock. A change made through this
process is visible to it at once; other processes (replicas) see it within ``cache_seconds``. A new project
is visible to all at once (missing projects are not cached).
"""

from __future__ import annotations

from typing import Any

import orjson

from .audit import AuditLog
from .clock import Clock
from .errors import InvalidInput, NotFound, StoreCorrupt
from .identifiers import Pseudonymizer
from .limits import PROJECT_ID_RE
from .projects import Project, ProjectConfig, compile_project, parse_config
from .store import Store


def check_project_id(project_id: str) -> str:
    if not PROJECT_ID_RE.match(project_id):
        raise InvalidInput(
            "project id must be 1-63 lowercase letters, digits, '-' or '_', starting with a letter or digit",
            field="project",
        )
    return project_id


class ProjectRegistry:
    def __init__(
        self, store: Store, pseudonymizer: Pseudonymizer, clock: Clock, cache_seconds: float, audit: AuditLog
    ) -> None:
        self._store = store
        self._audit = audit
        self._pseudonymizer = pseudonymizer
        self._clock = clock
        self._cache_ms = cache_seconds * 1000
        #: Entries are stamped with ``clock.now_ms()`` from before their configuration was read.
        self._cache: dict[str, tuple[int, Project]] = {}

    async def apply(self, project_id: str, document: Any, *, actor: str) -> tuple[Project, bool]:
        """Validate and store a configuration, and audit it as done by ``actor`` (whatever the path: HTTP or
        the command line). Returns the compiled project and whether it was created."""
        check_project_id(project_id)
        project = compile_project(project_id, parse_config(document), self._pseudonymizer)
        now = self._clock.now_ms()
        created = await self._store.put_project(project_id, project.stored_bytes(), now)
        self._cache[project_id] = (now, project)
        rc = project.config.memory.repeat_caller
        await self._audit.record(
            project_id,
            actor,
            "project.created" if created else "project.configured",
            {
                "state_keys": len(rc.state_keys),
                "retention": int(rc.retention.total_seconds()),
                "blacklist_entries": len(project.blacklist),
                "analytics_enabled": rc.analytics_enabled,
            },
        )
        return project, created

    async def find(self, project_id: str) -> Project | None:
        cached = self._cache.get(project_id)
        read_at = self._clock.now_ms()
        # A clock set back makes entries stale rather than fresh for longer (see TokenService._fresh).
        if cached is not None and 0 <= read_at - cached[0] < self._cache_ms:
            return cached[1]
        if not PROJECT_ID_RE.match(project_id):
            return None
        raw = await self._store.get_project(project_id)
        project = None
        if raw is not None:
            try:
                config = ProjectConfig.model_validate(orjson.loads(raw))
            except ValueError as exc:
                raise StoreCorrupt(
                    f"the stored configuration of project '{project_id}' is unreadable"
                ) from exc
            project = compile_project(project_id, config, self._pseudonymizer)
            self._cache[project_id] = (read_at, project)
        return project

    async def get(self, project_id: str) -> Project:
        project = await self.find(project_id)
        if project is None:
            raise NotFound(f"project '{project_id}' not found")
        return project
