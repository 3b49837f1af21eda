"""The archive of ended conversations (SPEC sections 11 and 14): cold storage that analysts read with the
tools they have, written once per conversation after its end processing, kept for ``archive_retention``,
erased with its caller.

- **When.** In each end's processing (explicit, inactivity, supersession), after the caller's memory was
  written from the end's state ("promote before archiving") and before the conversation is marked ended, so
  that a crash half-way is redone with it. A late end does not rewrite it. The object's key is derived from
  the conversation (project, id, start), so a redone end writes the same object again: written once.
- **Layout.** ``project=<project>/date=<YYYY-MM-DD>/<object id>.jsonl`` (hive-style; the date is the
  conversation's start, UTC), one JSON Lines object per conversation. JSON Lines rather than Parquet: a
  conversation is written alone, at its end, with nested messages; Parquet wants many rows per file (small
  Parquet files are slow to read and costly to list) and a columnar writer (pyarrow) in the service. DuckDB
  reads a day, or everything, in one line: ``SELECT * FROM read_json('archive/project=shop/date=*/*.jsonl',
  hive_partitioning = true)``; pandas with ``pd.read_json(path, lines=True)``.
- **What.** The conversation's id, channel, how it ended and its outcome, the persisted state keys, the
  repeat-caller metrics, its summary and its messages (already redacted), times as milliseconds from its
  start, the start rounded to the hour. No phone number, no pseudonym.
- **Erasure.** The store lists each object among its caller's before it is written (an object holds no
  pseudonym, so this is how erasure finds it); erasing the caller deletes them and counts them in the receipt.
- **Retention.** The sweep deletes the days of a project older than its ``archive_retention`` (a day goes once
  its last possible object is that old).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from .clock import DAY_MS, Clock, floor_hour_ms, iso_utc
from .conversations.events import EndedEvent
from .conversations.messages import MAX_MESSAGES, Message
from .memory import ErasureCounts
from .projects import Project, ProjectConfig, archive_retention_ms
from .store import CallerRef, Store
from .store.transcripts import Header, TranscriptQuery

log = logging.getLogger("caller_memory.archive")


class ArchiveObjects(Protocol):
    """Where archived objects go (service/storage/archive_objects.py)."""

    where: str

    async def put(self, key: str, data: bytes) -> None: ...

    async def delete(self, keys: Sequence[str]) -> None: ...

    async def directories(self, prefix: str) -> list[str]: ...

    async def objects(self, prefix: str) -> list[str]: ...


def object_key(project: str, conversation_id: str, started_at: int) -> str:
    """The key of a conversation's archived object: the same for every end of it (written once)."""
    day = dt.datetime.fromtimestamp(started_at / 1000, dt.UTC).date().isoformat()
    digest = hashlib.sha256(f"{project}\x00{conversation_id}\x00{started_at}".encode()).hexdigest()[:32]
    return f"project={project}/date={day}/{digest}.jsonl"


class Archive:
    def __init__(self, store: Store, objects: ArchiveObjects | None, clock: Clock) -> None:
        self._store = store
        self.objects = objects
        self._clock = clock

    async def conversation_ended(self, project: Project, event: EndedEvent) -> None:
        """Archive the conversation an end just processed (nothing when the project does not archive, for a
        late end, or when there is no transcript, or its caller was erased since the end was made)."""
        if not project.conversation.archive or event.late or self.objects is None:
            return
        now = self._clock.now_ms()
        header, stored = await self._store.read_conversation(
            event.key, now, TranscriptQuery(limit=MAX_MESSAGES)
        )
        if header is None or header.subject != event.subject or not event.subject:
            return
        key = object_key(project.project_id, event.key.conversation_id, header.started_at)
        # Listed until the sweep has surely deleted it: its day plus the retention, and a day.
        expires_at = header.started_at + project.conversation.archive_retention_ms + 2 * DAY_MS
        caller = CallerRef(project.project_id, event.subject)
        if not await self._store.list_archived(caller, key, expires_at, event.made_at, now):
            return
        messages = Message.decode_all([m.body for m in stored])
        record: dict[str, Any] = {
            "conversation_id": event.key.conversation_id,
            "channel": header.channel or event.channel,
            "started_at": iso_utc(floor_hour_ms(header.started_at)),
            "duration_ms": max(0, header.last_activity - header.started_at),
            "ended_by": event.ended_by,
            "end_reason": event.end_reason,
            "outcome": event.outcome,
            "persisted": sorted(event.persisted),
            "repeat_caller": event.repeat_caller,
            "summary": orjson.loads(header.summary) if header.summary else None,
            "turns": header.turn_id,
            "messages": [m.platform(header.started_at) for m in messages],
        }
        await self.objects.put(key, orjson.dumps(record) + b"\n")

    async def conversation_deleted(self, project: Project, header: Header) -> None:
        """An admin deleted the conversation's transcript: its archived copy goes too."""
        if self.objects is None or not header.subject:
            return
        key = object_key(project.project_id, header.key.conversation_id, header.started_at)
        caller = CallerRef(project.project_id, header.subject)
        if key in await self._store.archived_objects(caller, self._clock.now_ms()):
            await self.objects.delete([key])
            await self._store.unlist_archived(caller, [key])

    async def erase_caller(self, caller: CallerRef) -> ErasureCounts:
        """Delete the caller's archived conversations; how many (``archives_removed``)."""
        if self.objects is None:
            return ErasureCounts()
        keys = await self._store.archived_objects(caller, self._clock.now_ms())
        await self.objects.delete(keys)
        await self._store.unlist_archived(caller, keys)
        return ErasureCounts(archives_removed=len(keys))

    async def sweep(self) -> int:
        """Delete every archived day older than its project's ``archive_retention``; how many objects."""
        if self.objects is None:
            return 0
        now = self._clock.now_ms()
        removed = 0
        for project_id in await self._store.list_projects():
            raw = await self._store.get_project(project_id)
            if raw is None:
                continue
            try:
                retention = archive_retention_ms(ProjectConfig.model_validate(orjson.loads(raw)))
            except ValueError:
                log.warning(
                    "archive sweep: the configuration of project %r is unreadable; skipped", project_id
                )
                continue
            removed += await self._sweep_project(project_id, now - retention)
        return removed

    async def _sweep_project(self, project_id: str, cutoff: int) -> int:
        removed = 0
        prefix = f"project={project_id}/"
        for directory in await self.objects.directories(prefix) if self.objects else []:
            day = directory.removeprefix(prefix).removeprefix("date=").rstrip("/")
            try:
                start = dt.datetime.fromisoformat(day).replace(tzinfo=dt.UTC)
            except ValueError:
                continue  # not one of ours
            if int(start.timestamp() * 1000) + DAY_MS > cutoff:
                continue  # some of that day is younger than the retention
            assert self.objects is not None
            keys = await self.objects.objects(directory.rstrip("/") + "/")
            await self.objects.delete(keys)
            removed += len(keys)
        return removed
