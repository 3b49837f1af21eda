"""The dashboard page: static HTML, JavaScript and CSS shipped in the package and served by the service.

Nothing is loaded from elsewhere (no CDN, no web fonts), so it works offline. The page itself is public: it
holds no data. Its script asks for a project id and an analytics (or admin) token, keeps the token in the
tab's ``sessionStorage`` only, and calls the analytics API with it.

The files are read from the package (``importlib.resources``, so a wheel install works) on first use and
kept: they are part of the code, not of the configuration.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from importlib import resources

from aiohttp import web

from ..domain.errors import NotFound
from .openapi_parts import Json, problem, response
from .operations import documented

routes = web.RouteTableDef()

_PACKAGE = __name__.rpartition(".")[0]
PAGE = "index.html"
#: The only files served, with their media types; any other name is a 404.
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "favicon.svg": "image/svg+xml"}

# The page runs only its own script and styles, talks only to this origin, and cannot post a form anywhere:
# even with the script blocked, the token field can never end up in a URL.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Small files: revalidate every time (the ETag makes that a 304), so an upgrade is seen at once.
    "Cache-Control": "no-cache",
}


def dashboard_file(description: str, *media: str) -> Json:
    """A file of the dashboard page, with the headers that keep the page to itself."""
    text = {"type": "string"}
    return {
        "description": description,
        "headers": {
            "Content-Security-Policy": {
                "description": "Only this origin's scripts, styles and API; no inline script; no form posts.",
                "schema": text | {"const": CONTENT_SECURITY_POLICY},
            },
            "X-Content-Type-Options": {"schema": text | {"const": "nosniff"}},
            "Cache-Control": {
                "description": "Revalidate with the ETag.",
                "schema": text | {"const": "no-cache"},
            },
            "ETag": {"description": "Of the file's content.", "schema": text},
        },
        "content": {m: {"schema": text | {"description": "UTF-8."}} for m in media},
    }


def asset_parameter() -> Json:
    """The ``asset`` path parameter: only the files that exist."""
    return {
        "name": "asset",
        "in": "path",
        "required": True,
        "description": "A file of the dashboard page; only these names exist.",
        "schema": {"type": "string", "enum": sorted(ASSETS)},
    }


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


@functools.cache
def load(name: str) -> Asset:
    """One of the dashboard's files, read from the installed package."""
    body = resources.files(_PACKAGE).joinpath("dashboard_files", name).read_bytes()
    content_type = "text/html" if name == PAGE else ASSETS[name]
    return Asset(body, content_type, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')


def _serve(request: web.Request, name: str) -> web.Response:
    asset = load(name)
    headers = HEADERS | {"ETag": asset.etag}
    held = request.headers.get("If-None-Match", "")
    if asset.etag in held or held.strip() == "*":
        return web.Response(status=304, headers=headers)
    return web.Response(body=asset.body, content_type=asset.content_type, charset="utf-8", headers=headers)


@routes.get("/favicon.ico")
@documented(
    None,
    "The service's icon (the dashboard's), which browsers ask for by themselves",
    {
        "200": dashboard_file("The icon, as SVG.", "image/svg+xml"),
        "304": response("Unchanged since the ETag given in If-None-Match."),
    },
    parameters=("If-None-Match",),
)
async def favicon(request: web.Request) -> web.Response:
    """Browsers ask for it by themselves on any page of this origin: the dashboard's icon."""
    return _serve(request, "favicon.svg")


@routes.get("/dashboard")
@documented(
    None,
    "The repeat-caller dashboard page",
    {
        "200": dashboard_file("The page.", "text/html"),
        "304": response("Unchanged since the ETag given in If-None-Match."),
    },
    parameters=("If-None-Match",),
    description="Static; it holds no data. The page asks for a project id and a token with the "
    "`analytics` or `admin` role, keeps the token in the browser tab's session storage, and calls the "
    "analytics endpoints with it. Nothing is loaded from outside the service.",
)
async def dashboard(request: web.Request) -> web.Response:
    return _serve(request, PAGE)


@routes.get("/dashboard/{asset}")
@documented(
    None,
    "A script or style sheet of the dashboard page",
    {
        "200": dashboard_file("The file.", *sorted(set(ASSETS.values()))),
        "304": response("Unchanged since the ETag given in If-None-Match."),
        "404": problem("No such file."),
    },
    parameters=("If-None-Match",),
)
async def dashboard_asset(request: web.Request) -> web.Response:
    name = request.match_info["asset"]
    if name not in ASSETS:
        raise NotFound("no such dashboard file; the dashboard is at /dashboard")
    return _serve(request, name)
