"""Where the time goes, from py-spy's raw (collapsed stack) output: self time and inclusive time per
function, and a breakdown by layer (each sample goes to the deepest frame that belongs to a known layer;
the event loop gets only samples with nothing else on the stack)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

Frame = tuple[str, str]  # (function, file)


def _short(path: str) -> str:
    if not path.startswith("/"):
        return path  # py-spy's own short form
    for marker in ("site-packages/", "/service/", "/sdk/", "/bench/", "lib/python3"):
        at = path.find(marker)
        if at >= 0:
            rest = path[at + len(marker) :]
            if marker == "/service/":
                return "service/" + rest
            if marker == "lib/python3":
                return "stdlib/" + rest.split("/", 1)[-1]
            return rest
    return path


def _is(*prefixes: str) -> Callable[[str, str], bool]:
    """Files under these package-relative prefixes (py-spy prints ``aiohttp/web.py``, ``service/app.py``)."""
    return lambda func, file: any(file.startswith(p) or f"/{p}" in file for p in prefixes)


#: (layer, test on (function, file)), most specific first; "asyncio event loop" is the fallback.
LAYERS: list[tuple[str, Callable[[str, str], bool]]] = [
    (
        "logging (access log, log records, handler I/O)",
        _is("logging/", "service/http/access_log.py", "service/logs.py"),
    ),
    ("metrics middleware (prometheus_client)", _is("prometheus_client/", "service/http/metrics.py")),
    ("redis-py client (pool, retry, timeouts, packing, parsing)", _is("redis/")),
    ("phonenumbers (normalize the identifier)", _is("phonenumbers/")),
    ("pseudonym (HMAC-SHA256)", lambda f, p: p.endswith("hmac.py") or f.endswith("_pseudonym")),
    ("pydantic", _is("pydantic/", "pydantic_core/")),
    ("auth (token check, sha256, cache)", _is("service/domain/tokens.py")),
    ("project registry (config cache)", _is("service/domain/registry.py")),
    (
        "memory domain + store adapter (view, ETag, unpack)",
        _is(
            "service/domain/memory.py",
            "service/domain/fields.py",
            "service/domain/identifiers.py",
            "service/storage/",
            "service/domain/clock.py",
        ),
    ),
    ("routes + JSON responses (orjson)", _is("service/http/routes.py", "service/http/responses.py")),
    ("middlewares (problem, in-flight limit)", _is("service/http/middleware.py")),
    ("aiohttp server (parse, dispatch, Response, write)", _is("aiohttp/", "multidict/", "yarl/")),
    ("asyncio event loop, tasks, transports", _is("asyncio/", "selectors.py", "uvloop/")),
]
FALLBACK = "other"


def parse(raw: str) -> list[tuple[list[Frame], int]]:
    stacks = []
    for line in raw.splitlines():
        line = line.strip()
        if not line:
            continue
        stack_text, _, count = line.rpartition(" ")
        frames: list[Frame] = []
        for item in stack_text.split(";"):
            match = _FRAME.match(item)
            if match is None:
                frames.append((item, ""))
            else:
                frames.append((match["func"], match["file"]))
        stacks.append((frames, int(count)))
    return stacks


#: Frames at the root of every stack of the main thread (the process's entry point down to the event loop):
#: they say nothing about where a request's time goes.
ENTRY = frozenset({"run_app", "main", "_serve", "<module>", "_run_code", "_run_module_as_main"})


def layer_of(frames: list[Frame]) -> str:
    for func, file in reversed(frames):  # deepest first
        if func in ENTRY:
            continue
        for name, test in LAYERS[:-1]:
            if test(func, file):
                return name
    for func, file in reversed(frames):
        if LAYERS[-1][1](func, file):
            return LAYERS[-1][0]
    return FALLBACK


def analyse(raw: str, top: int = 30) -> dict[str, Any]:
    stacks = parse(raw)
    total = sum(count for _, count in stacks) or 1
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    layers: Counter[str] = Counter()
    service: Counter[str] = Counter()  # the service's own functions, and what they call directly
    for frames, count in stacks:
        names = set()
        for depth, (func, file) in enumerate(frames):
            if file.startswith("service/") and not file.startswith(("service/cli.py", "service/__main__.py")):
                names.add(f"{func} ({file})")
                if depth + 1 < len(frames) and not frames[depth + 1][1].startswith("service/"):
                    callee, where = frames[depth + 1]
                    names.add(f"    {func} -> {callee} ({_short(where)})")
        for name in names:
            service[name] += count
        if frames:
            func, file = frames[-1]
            self_time[f"{func} ({_short(file)})"] += count
        for name in {f"{func} ({_short(file)})" for func, file in frames}:
            inclusive[name] += count
        layers[layer_of(frames)] += count

    def table(counter: Counter[str]) -> list[dict[str, Any]]:
        return [
            {"frame": name, "samples": n, "percent": round(100.0 * n / total, 1)}
            for name, n in counter.most_common(top)
        ]

    return {
        "samples": total,
        "layers": table(layers),
        "self": table(self_time),
        "inclusive": table(inclusive),
        "service": [
            {"frame": name, "samples": n, "percent": round(100.0 * n / total, 1)}
            for name, n in service.most_common(2 * top)
        ],
    }


def render(analysis: dict[str, Any], header: str) -> str:
    lines = [
        header.rstrip(),
        "",
        f"{analysis['samples']} samples (on-CPU, the service's threads). A coroutine that runs as a task of its"
        " own (redis-py's send under asyncio.wait_for when a socket timeout is set) is sampled without the"
        " request's frames above it: inclusive figures of the request path are then lower bounds; the layers"
        " count every sample.",
        "",
    ]
    for title, key in (
        ("Time by layer (each sample to the deepest frame of a known layer)", "layers"),
        (
            "The service's own functions by inclusive time (indented: the library call a service function makes)",
            "service",
        ),
        ("Top frames by inclusive time (the frame is anywhere on the stack)", "inclusive"),
        ("Top frames by self time (the frame is the one running)", "self"),
    ):
        lines.append(title)
        lines.append("-" * len(title))
        for row in analysis[key]:
            lines.append(f"{row['percent']:6.1f}%  {row['frame']}")
        lines.append("")
    return "\n".join(lines)


def analyse_file(path: Path, top: int = 30) -> dict[str, Any]:
    return analyse(path.read_text(), top)
