"""Retention: expiry sweeps (one replica at a time, by a lease in the store)."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from .clock import Clock, iso_utc

if TYPE_CHECKING:
    from .archive import Archive
from .projects import ProjectConfig
from .store import Store

log = logging.getLogger("caller_memory.retention")

SWEEP_LEASE = "sweep"


@dataclass(frozen=True, slots=True)
class SweepReport:
    """What one sweep did. ``complete`` is False when it stopped at its time budget with work left."""

    sweep_id: str
    holder: str
    started_at: str
    duration_ms: float
    rounds: int
    complete: bool
    removed: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))


class Sweeper:
    """Removes what expired, in bounded batches, holding the store's sweep lease while it works.

    ``holder`` names this process (replicas sharing a store each have their own). A sweep that finds the
    lease taken does nothing and returns None. A sweep interrupted anywhere (the process dies) leaves the
    store consistent; the next one carries on, because what is left to remove is found from the data.
    """

    def __init__(
        self,
        store: Store,
        clock: Clock,
        *,
        holder: str | None = None,
        batch: int = 1000,
        budget_seconds: float = 30.0,
        lease_seconds: float = 60.0,
        archive: Archive | None = None,
    ) -> None:
        self._store = store
        #: The archive's days past their project's ``archive_retention`` go with each sweep.
        self._archive = archive
        self._clock = clock
        self.holder = holder or uuid.uuid4().hex[:12]
        self.batch = batch
        self.budget_seconds = budget_seconds
        self.lease_ms = int(lease_seconds * 1000)

    async def retention_cutoffs(self, now: int) -> dict[str, int]:
        """Each project's current retention cutoff (``now`` - retention): analytics listed before it go, even
        if they were recorded under a longer retention. A project whose configuration cannot be read is left
        to the expiry its data was written with."""
        cutoffs: dict[str, int] = {}
        for project in await self._store.list_projects():
            raw = await self._store.get_project(project)
            if raw is None:
                continue
            try:
                retention = ProjectConfig.model_validate(orjson.loads(raw)).memory.repeat_caller.retention
            except ValueError:
                log.warning(
                    "sweep: the configuration of project %r is unreadable; its retention is skipped", project
                )
                continue
            cutoffs[project] = now - int(retention.total_seconds()) * 1000
        return cutoffs

    async def run(self) -> SweepReport | None:
        now = self._clock.now_ms()
        if not await self._store.acquire_lease(SWEEP_LEASE, self.holder, now, self.lease_ms):
            log.info("sweep skipped: another replica holds the sweep lease")
            return None
        started = time.perf_counter()
        removed: dict[str, int] = {}
        rounds = 0
        more = True
        try:
            cutoffs = await self.retention_cutoffs(now)
            while more and time.perf_counter() - started < self.budget_seconds:
                counts, more = await self._store.sweep(self._clock.now_ms(), self.batch, cutoffs)
                rounds += 1
                for kind, count in counts.items():
                    removed[kind] = removed.get(kind, 0) + count
                # Renew the lease between rounds so that a long sweep keeps it.
                await self._store.acquire_lease(SWEEP_LEASE, self.holder, self._clock.now_ms(), self.lease_ms)
            if self._archive is not None and self._archive.objects is not None:
                removed["archived_conversations"] = await self._archive.sweep()
            report = SweepReport(
                sweep_id=uuid.uuid4().hex,
                holder=self.holder,
                started_at=iso_utc(now),
                duration_ms=round((time.perf_counter() - started) * 1000, 1),
                rounds=rounds,
                complete=not more,
                removed=removed,
            )
            await self._store.record_sweep(report.to_json())
        finally:
            await self._store.release_lease(SWEEP_LEASE, self.holder)
        log.info("sweep %s: removed %s in %.1f ms", report.sweep_id, removed, report.duration_ms)
        return report

    async def recent(self, limit: int = 20) -> list[dict[str, Any]]:
        return [orjson.loads(raw) for raw in await self._store.list_sweeps(limit)]
