"""Access log that records route templates, never concrete paths (paths hold caller identifiers).

``caller-memory serve`` uses it. An application that runs ``create_app`` under its own ``web.AppRunner``
must pass ``access_log_class=RouteAccessLogger`` (or ``access_log=None``): aiohttp's default access log
writes the full path, phone number included.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from ..logs import mask_text


class RouteAccessLogger(AbstractAccessLogger):
    @property
    def enabled(self) -> bool:
        """Skip the work entirely when the log level drops access records."""
        return self.logger.isEnabledFor(logging.INFO)

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        route = "<unmatched>"
        try:
            match_info = getattr(request, "match_info", None)
        except AssertionError:  # a request aiohttp refused before routing it (a malformed header)
            match_info = None
        if match_info is not None and match_info.route.resource is not None:
            route = match_info.route.resource.canonical
        # "200 in 1502.3ms", not "200 1502.3ms": status and time side by side would be masked as a number.
        self.logger.info(
            "%s %s %d in %.1fms project=%s",
            request.method,
            route,
            response.status,
            time * 1000,
            mask_text(match_info.get("project", "-")) if match_info is not None else "-",
        )
