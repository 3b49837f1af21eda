"""Operator and audit endpoints: sweeps, the audit log, Prometheus metrics."""

from __future__ import annotations

from typing import cast

from aiohttp import web

from ..domain.clock import iso_utc
from ..domain.errors import Conflict
from ..domain.retention import SweepReport
from ..domain.store import AuditEntry
from ..domain.tokens import Role
from . import bodies
from .app_keys import METRICS
from .openapi_parts import THIS_PROJECT, link, problem, response
from .operations import documented
from .queries import AuditQuery, SweepsQuery, parse_query
from .responses import json_response
from .routes import authorize, project_for

routes = web.RouteTableDef()


@routes.post("/v1/admin/sweeps")
@documented(
    "operator",
    "Run an expiry sweep now",
    {
        "200": response(
            "What the sweep removed and how long it took, and how many inactivity ends it ran.",
            "SweepRun",
        ),
        "404": None,
        "409": problem("Another sweep holds the lease (on this or another replica)."),
        "422": None,
    },
    description="Removes expired fields, callers left empty, expired first-interaction records, "
    "conversation records and analytics entries, in bounded batches, for at most 30 seconds; then "
    "runs the inactivity ends that are due (conversations nobody ended within "
    "`end_after_inactivity`), as the scheduler does every CALLER_MEMORY_INACTIVITY_INTERVAL.",
)
async def run_sweep(request: web.Request) -> web.Response:
    services, _ = await authorize(request, None)
    metrics = request.app[METRICS]
    report = await services.sweeper.run()
    if report is None:
        metrics.sweeps.labels("skipped").inc()
        raise Conflict("a sweep is already running (another replica holds the sweep lease); try again later")
    record_sweep_metrics(request.app, report.removed, report.duration_ms)
    # The inactivity ends that are due, too (SPEC section 14): an operator testing or draining a replica
    # gets them now rather than at the scheduler's next run. Each end is claimed in the store, so running
    # them beside the scheduler's run (on this or another replica) ends nothing twice.
    ended = await services.lifecycle.run_inactivity_ends(services.projects)
    if ended:
        metrics.inactivity_ends.labels("ended").inc(ended)
    body: bodies.SweepRun = {**sweep_body(report), "inactivity_ends": ended}
    return json_response(body)


def sweep_body(report: SweepReport) -> bodies.SweepReport:
    return {
        "sweep_id": report.sweep_id,
        "holder": report.holder,
        "started_at": report.started_at,
        "duration_ms": report.duration_ms,
        "rounds": report.rounds,
        "complete": report.complete,
        "removed": report.removed,
    }


def record_sweep_metrics(app: web.Application, removed: dict[str, int], duration_ms: float) -> None:
    metrics = app[METRICS]
    metrics.sweeps.labels("completed").inc()
    metrics.sweep_duration.observe(duration_ms / 1000)
    for kind, count in removed.items():
        metrics.swept.labels(kind).inc(count)


@routes.get("/v1/admin/sweeps")
@documented(
    "operator",
    "Recent sweeps",
    {
        "200": response("The latest sweeps, newest first (at most 100 are kept).", "SweepList"),
        "404": None,
        "422": problem("A malformed `limit`."),
    },
    query=SweepsQuery,
)
async def list_sweeps(request: web.Request) -> web.Response:
    services, _ = await authorize(request, None)
    query = parse_query(request, SweepsQuery)
    # The reports as each sweep stored them: SweepReport.to_json, the fields of sweep_body.
    sweeps = cast("list[bodies.SweepReport]", await services.sweeper.recent(query.limit))
    body: bodies.SweepList = {"sweeps": sweeps}
    return json_response(body)


def audit_body(entry: AuditEntry) -> bodies.AuditRecord:
    return {
        "id": entry.id,
        "at": iso_utc(entry.at),
        "actor": entry.actor,
        "action": entry.action,
        "details": dict(entry.details),
        "receipt_id": entry.receipt_id,
    }


@routes.get("/v1/projects/{project}/audit")
@documented(
    "admin",
    "Audit records: erasures, configuration and token changes",
    {
        "200": response("Audit records, newest first.", "AuditList"),
        "422": problem("A malformed `limit` or `before`."),
    },
    query=AuditQuery,
    links={
        "200": {
            "NextPage": link("list_audit", THIS_PROJECT | {"query.before": "$response.body#/next_cursor"})
        }
    },
)
async def list_audit(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    query = parse_query(request, AuditQuery)
    entries = await services.audit.list(project.project_id, query.limit, query.before)
    next_cursor = entries[-1].id if len(entries) == query.limit else None
    body: bodies.AuditList = {"records": [audit_body(e) for e in entries], "next_cursor": next_cursor}
    return json_response(body)


@routes.get("/metrics")
@documented(
    None,
    "Prometheus metrics",
    {
        "200": {
            "description": "Requests by route template, method and status; latency histograms; store "
            "errors; sweeps and what they removed; erasures. No label holds an identifier.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    },
)
async def metrics(request: web.Request) -> web.Response:
    return request.app[METRICS].response()
