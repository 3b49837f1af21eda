"""Command line: ``caller-memory serve | project ... | token ... | platform ... | mcp``.

The management commands work directly against the configured store (the same one the service uses), so an
operator can bootstrap a project and its first admin token without the HTTP API. ``mcp`` is a client of a
running service instead (service/mcp/stdio.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import socket
import sys
import traceback
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from .config import DEFAULT_PORT, MAX_WORKERS, Settings, SettingsError, parse_workers
from .domain.documents import parse_document
from .domain.errors import CallerMemoryError
from .http.app_keys import Services

if TYPE_CHECKING:
    from .domain.projects import Project
    from .workers import SupervisorLink

log = logging.getLogger("caller_memory")
#: How audit records name changes made through the command line (directly against the store).
CLI_ACTOR = "cli"


def redact_url(url: str) -> str:
    """Hide a password in a store URL before printing it."""
    return re.sub(r"//([^:/@]*):[^@/]*@", r"//\1:***@", url)


#: Why ``serve --workers N`` (N > 1) refuses a SQLite store.
SQLITE_IS_ONE_PROCESS = (
    "the SQLite store is built for one process, with one writer thread per file. Several processes would "
    "take turns on SQLite's file lock instead, waiting by polling with sleeps of up to 100 ms: no more writes "
    "per second, much slower ones. And processes that open a new file at the same moment can fail, or report "
    "the file damaged. Use one process with SQLite, or a Redis store (CALLER_MEMORY_STORE=redis://host:port/0)"
)


def _workers_argument(text: str) -> int:
    try:
        return parse_workers(text, "--workers")
    except SettingsError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--workers ")) from None


def _fds_argument(text: str) -> list[int]:
    try:
        return [int(fd) for fd in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError("file descriptors, separated by commas") from None


def _installed_version() -> str:
    """The installed distribution's version (the one the SDK's _version.py gave both distributions)."""
    try:
        return metadata.version("caller-memory")
    except metadata.PackageNotFoundError:
        return "(not installed as a distribution)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="caller-memory", description="Repeat-caller memory for voice agents."
    )
    parser.add_argument(
        "--store", help="store URL (default: $CALLER_MEMORY_STORE or sqlite:///caller-memory.db)"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument("--store", dest="serve_store", help="store URL (same as the global --store)")
    serve.add_argument(
        "--workers",
        type=_workers_argument,
        metavar="N",
        help=f"service processes sharing the port, 1 to {MAX_WORKERS} (default: $CALLER_MEMORY_WORKERS or 1); "
        "more than 1 needs a Redis store",
    )
    # Set by the supervisor of `serve --workers N` on the processes it starts (see service/workers.py).
    serve.add_argument("--worker-listen", type=_fds_argument, help=argparse.SUPPRESS)
    serve.add_argument("--worker-control", type=int, help=argparse.SUPPRESS)

    project = sub.add_parser("project", help="manage project configurations").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    apply = project.add_parser("apply", help="create or replace a project from a JSON file")
    apply.add_argument(
        "file",
        type=Path,
        help='configuration JSON: {"memory": {"repeat_caller": {...}}}, as in step 1 of docs/walkthrough.md',
    )
    apply.add_argument("--project", help="project id (default: the file name without .json)")
    show = project.add_parser("show", help="print a project's configuration")
    show.add_argument("project")

    sub.add_parser(
        "sweep",
        help="run one expiry sweep against the store now, and the inactivity ends that are due, and print "
        "what they did",
    )

    token = sub.add_parser("token", help="manage project tokens").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    create = token.add_parser("create", help="mint a token; the secret is printed once")
    create.add_argument("project")
    create.add_argument("--role", required=True, choices=["agent", "analytics", "admin", "platform", "staff"])
    create.add_argument("--label", default="")
    create.add_argument(
        "--agent",
        default=None,
        help="for an agent token: the agent it acts as (transcript_scope 'agent' shows it only its messages)",
    )
    listing = token.add_parser("list", help="list a project's tokens (no secrets)")
    listing.add_argument("project")
    revoke = token.add_parser("revoke", help="revoke a token")
    revoke.add_argument("project")
    revoke.add_argument("token_id")

    platform = sub.add_parser("platform", help="manage a project's platform connections").add_subparsers(
        dest="action", required=True, metavar="ACTION"
    )
    put = platform.add_parser(
        "put", help="connect or change a connection from a JSON file (as PUT .../platforms/{platform} takes)"
    )
    for each in (put, platform.add_parser("get", help="print a connection (never its secret)")):
        each.add_argument("project")
        each.add_argument("platform")
    put.add_argument("file", type=Path, help="the connection's JSON body ('-': read it from stdin)")
    remove = platform.add_parser("delete", help="remove a connection and its secret")
    remove.add_argument("project")
    remove.add_argument("platform")

    mcp = sub.add_parser(
        "mcp",
        help="serve the MCP tools on stdin/stdout, relayed to a running service (token: $CALLER_MEMORY_TOKEN)",
    )
    mcp.add_argument("--url", required=True, help="the service's address, e.g. http://127.0.0.1:8080")
    mcp.add_argument("--project", required=True, help="the project id")
    mcp.add_argument(
        "--conversation",
        help="an agent connection to this started conversation (an agent or platform token); "
        "without it, a staff connection (a staff token)",
    )
    mcp.add_argument(
        "--allow-erasure",
        action="store_true",
        help="a staff connection with the erase_caller tool (confirmed)",
    )
    return parser


def _print(data: Any) -> None:
    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode() + "\n")


def _check_store_exists(settings: Settings, args: argparse.Namespace) -> None:
    """Only ``project apply`` may create a SQLite store: any other command run in the wrong folder would
    create an empty database there and report that nothing exists."""
    prefix = "sqlite:///"
    if not settings.store_url.startswith(prefix) or (args.command, getattr(args, "action", None)) == (
        "project",
        "apply",
    ):
        return
    path = Path(settings.store_url[len(prefix) :])
    if not path.exists():
        raise SystemExit(
            f"error: there is no SQLite store at {path.resolve()}; run this in the folder the service uses "
            "(where `make run` keeps caller-memory.db) or pass --store sqlite:///path/to/file.db"
        )


async def _with_services(settings: Settings, action: Callable[[Services], Awaitable[Any]]) -> Any:
    from .app import build_services

    services = build_services(settings)
    await services.store.open()
    try:
        return await action(services)
    finally:
        await services.store.close()


async def _manage(args: argparse.Namespace, services: Services) -> Any:
    from .http.routes import token_body

    if args.command == "sweep":
        report = await services.sweeper.run()
        if report is None:
            raise SystemExit(
                "error: another sweep holds the lease (a service replica is sweeping); try again later"
            )
        # The conversations nobody ended that are due (what POST /v1/admin/sweeps runs too).
        ended = await services.lifecycle.run_inactivity_ends(services.projects)
        return asdict(report) | {"inactivity_ends": ended}
    if args.command == "project" and args.action == "apply":
        try:
            document = parse_document(args.file.read_bytes(), what=str(args.file))
        except OSError as exc:
            raise SystemExit(f"error: cannot read {args.file}: {exc.strerror}") from None
        project_id = args.project or args.file.stem
        project, created = await services.projects.apply(project_id, document, actor=CLI_ACTOR)
        log.info("project %s %s", project_id, "created" if created else "replaced")
        return project.stored_document()
    if args.command == "project" and args.action == "show":
        return (await services.projects.get(args.project)).stored_document()
    project = await services.projects.get(args.project)
    if args.command == "platform":
        return await _platform(args, services, project)
    if args.action == "create":
        minted = await services.tokens.mint(
            project.project_id,
            args.role,
            args.label,
            actor=CLI_ACTOR,
            agent=args.agent,
            regions=(project.default_region,),
        )
        return token_body(minted.record) | {"token": minted.secret}
    if args.action == "list":
        return {"tokens": [token_body(r) for r in await services.tokens.list(project.project_id)]}
    await services.tokens.revoke(project.project_id, args.token_id, actor=CLI_ACTOR)
    return {"revoked": args.token_id}


async def _platform(args: argparse.Namespace, services: Services, project: Project) -> Any:
    """``platform put|get|delete``: the same use case as the HTTP API, audited as the command line."""
    from .app import build_platforms
    from .domain.platforms.connections import ConnectionBody
    from .domain.platforms.service import connection_view

    platforms = build_platforms(services.settings, services)
    if args.action == "get":
        return connection_view(await platforms.get(project, args.platform))
    if args.action == "delete":
        await platforms.delete(project, args.platform, actor=CLI_ACTOR)
        return {"deleted": args.platform}
    try:
        raw = sys.stdin.buffer.read() if str(args.file) == "-" else args.file.read_bytes()
    except OSError as exc:
        raise SystemExit(f"error: cannot read {args.file}: {exc.strerror}") from None
    try:
        body = ConnectionBody.model_validate(parse_document(raw, what=str(args.file)))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors(include_input=False)
        )
        raise SystemExit(f"error: {args.file}: {problems}") from None
    connection, created = await platforms.put(project, args.platform, body, actor=CLI_ACTOR)
    log.info("platform %s %s", args.platform, "connected" if created else "changed")
    return connection_view(connection)


def _serve(
    settings: Settings, *, sockets: list[socket.socket] | None = None, link: SupervisorLink | None = None
) -> None:
    """Run the service in this process: on ``host:port``, or as a worker of ``serve --workers N`` on the
    supervisor's ``sockets``, reporting to it through ``link``. Raises ``CannotListen`` if the address
    cannot be bound."""
    from .app import create_app
    from .http.access_log import RouteAccessLogger
    from .http.app_keys import METRICS
    from .http.server import fit_open_files, quiet_repeats, serve

    quiet_repeats()
    max_connections = fit_open_files(settings.max_connections)
    app = create_app(settings)
    on_listening: Callable[[], Awaitable[None]]
    if link is None:
        _log_start(settings)

        async def announce() -> None:
            # Once the port is bound (and the store opened): a port in use fails before this line.
            log.info(
                "listening on http://%s:%d (API description at /openapi.json)", settings.host, settings.port
            )

        on_listening = announce
    else:
        on_listening = link.ready
    serve(
        app,
        header_timeout=settings.header_timeout,
        max_connections=max_connections,
        metrics=app[METRICS],
        host=settings.host,
        port=settings.port,
        sockets=sockets or (),
        on_listening=on_listening,
        access_log_class=RouteAccessLogger,
        access_log=logging.getLogger("aiohttp.access") if settings.access_log else None,
    )


def _log_start(settings: Settings) -> None:
    if settings.operator_token is None:
        log.warning("CALLER_MEMORY_OPERATOR_TOKEN is not set: operator endpoints will refuse every request")
    log.info("store: %s", redact_url(settings.store_url))


def _serve_as_worker(settings: Settings, control_fd: int, listen_fds: list[int]) -> int:
    """One worker of ``serve --workers N``: reports why it cannot start to the supervisor, which prints it
    once for all workers."""
    from .logs import MaskingFormatter
    from .workers import SupervisorLink

    for handler in logging.getLogger().handlers:  # N processes write to one stream: say which one
        handler.setFormatter(
            MaskingFormatter("%(asctime)s %(levelname)s %(name)s [worker %(process)d]: %(message)s")
        )
    link = SupervisorLink(control_fd)
    try:
        _serve(settings, sockets=[socket.socket(fileno=fd) for fd in listen_fds], link=link)
    except CallerMemoryError as exc:
        if link.is_ready:
            sys.stderr.write(f"error: {exc.detail}\n")
        else:
            link.failed(exc.detail)
        return 1
    except Exception:
        if link.is_ready:
            raise
        link.failed(traceback.format_exc())
        return 1
    return 0


def _bind(settings: Settings) -> list[list[socket.socket]] | None:
    """The listening sockets (one list per worker; one list for one process), bound before the store is
    opened or anything is logged; None (and the reason on stderr, one line) if the address cannot be
    bound."""
    from .workers import bind_listeners, bind_worker_listeners

    try:
        if settings.workers > 1:
            return bind_worker_listeners(settings.host, settings.port, settings.workers)
        return [bind_listeners(settings.host, settings.port)]
    except OSError as exc:
        sys.stderr.write(f"error: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}\n")
        return None


def _serve_workers(settings: Settings) -> int:
    """``serve --workers N`` with N > 1: this process supervises N service processes on one port."""
    from .workers import WorkersFailed, serve_workers

    groups = _bind(settings)
    if groups is None:
        return 1
    _log_start(settings)
    command = [sys.executable, "-m", __package__ or "caller_memory.service", "serve"]
    command += ["--host", settings.host, "--port", str(settings.port)]
    try:
        return serve_workers(
            settings.workers,
            groups=groups,
            command=command,
            # The store URL goes through the environment: a command line is visible to every user.
            env={**os.environ, "CALLER_MEMORY_STORE": settings.store_url},
        )
    except WorkersFailed as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1


def _settings(args: argparse.Namespace) -> Settings:
    settings = Settings.from_env(
        store_url=getattr(args, "serve_store", None) or args.store,
        host=getattr(args, "host", None),
        port=getattr(args, "port", None),
        workers=getattr(args, "workers", None),
    )
    if (
        args.command == "serve"
        and args.worker_control is None
        and settings.workers > 1
        and settings.store_url.split(":", 1)[0].lower() == "sqlite"
    ):
        raise SettingsError(
            f"{settings.workers} workers (--workers, CALLER_MEMORY_WORKERS) need a Redis store: "
            + SQLITE_IS_ONE_PROCESS
        )
    return settings


def _run_serve(args: argparse.Namespace, settings: Settings) -> int:
    if args.worker_control is not None:
        return _serve_as_worker(settings, args.worker_control, args.worker_listen or [])
    if settings.workers > 1:
        return _serve_workers(settings)
    from .http.server import CannotListen

    bound = _bind(settings)  # before anything else: a port in use is one line, and no store is opened
    if bound is None:
        return 1
    try:
        _serve(settings, sockets=bound[0])
    except CallerMemoryError as exc:
        sys.stderr.write(f"error: {exc.detail}\n")
        return 1
    except CannotListen as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from .logs import configure_logging

    args = _parser().parse_args(argv)
    if args.command == "mcp":  # a client of a running service: no store, no service settings
        from .mcp.stdio import run

        return run(args.url, args.project, conversation=args.conversation, allow_erasure=args.allow_erasure)
    try:
        settings = _settings(args)
    except SettingsError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    configure_logging(settings.log_level)
    if args.command == "serve":
        return _run_serve(args, settings)
    _check_store_exists(settings, args)
    try:
        _print(asyncio.run(_with_services(settings, lambda services: _manage(args, services))))
    except CallerMemoryError as exc:
        sys.stderr.write(f"error: {exc.detail}\n")
        return 1
    return 0
