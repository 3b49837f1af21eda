"""Each operation documented beside its handler, and the OpenAPI ``paths`` assembled from the route tables.

A handler carries its description in a decorator under its route's::

    @routes.get("/v1/projects/{project}/tokens")
    @documented("admin", "List the project's tokens", {"200": response("No secrets.", "TokenList")})
    async def list_tokens(request: web.Request) -> web.Response: ...

The path and the method are written once, in the route decorator; the operationId is the handler's name.
openapi.py reads both from the route tables with :func:`documented_operations`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from aiohttp import web

from .openapi_parts import Json, operation
from .queries import QueryModel

RoleName = Literal["operator", "admin", "agent", "analytics", "platform", "staff"]
Handler = TypeVar("Handler", bound=Callable[..., Any])

_ATTRIBUTE = "__openapi_operation__"


@dataclass(frozen=True, slots=True)
class Operation:
    """One operation's description: its role (``None``: public), summary, responses by status (``None``
    drops a status every authenticated operation may answer), shared parameters by name, query model,
    request body, description, and links by status."""

    role: RoleName | None
    summary: str
    responses: Mapping[str, Json | None]
    parameters: tuple[str, ...] = ()
    query: type[QueryModel] | None = None
    body: Json | None = None
    description: str = ""
    links: Mapping[str, Mapping[str, Json]] = field(default_factory=dict)

    def render(self, operation_id: str) -> Json:
        """The OpenAPI operation object (a new one on each call)."""
        rendered = copy.deepcopy(
            operation(
                operation_id,
                self.role,
                self.summary,
                dict(self.responses),
                parameters=self.parameters,
                query=self.query,
                body=self.body,
                description=self.description,
            )
        )
        for status, named in self.links.items():
            rendered["responses"][status] |= {"links": copy.deepcopy(dict(named))}
        return rendered


def documented(
    role: RoleName | None,
    summary: str,
    responses: Mapping[str, Json | None],
    *,
    parameters: tuple[str, ...] = (),
    query: type[QueryModel] | None = None,
    body: Json | None = None,
    description: str = "",
    links: Mapping[str, Mapping[str, Json]] | None = None,
) -> Callable[[Handler], Handler]:
    """Attach the operation's description to its handler (put it under the route decorator). ``links`` are
    what a response lets a client do next, by status (OpenAPI links; schemathesis follows them)."""
    described = Operation(role, summary, responses, parameters, query, body, description, links or {})

    def attach(handler: Handler) -> Handler:
        setattr(handler, _ATTRIBUTE, described)
        return handler

    return attach


def documented_operations(tables: Iterable[web.RouteTableDef]) -> Iterator[tuple[str, str, Json]]:
    """``(method, path, operation)`` of every route of ``tables``; a route without a description is an error."""
    for table in tables:
        for route in table:
            if not isinstance(route, web.RouteDef):
                continue
            described = getattr(route.handler, _ATTRIBUTE, None)
            if not isinstance(described, Operation):
                raise LookupError(f"{route.method} {route.path} has no @documented description")
            yield route.method.lower(), route.path, described.render(route.handler.__name__)
