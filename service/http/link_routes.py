"""Linked identifiers (SPEC section 13): link, list, unlink. Thin: the rules are in domain/links.py."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..domain.clock import iso_utc
from ..domain.links import link_body
from ..domain.store.links import Link
from ..domain.tokens import Role
from .openapi_parts import (
    BAD_CALLER,
    NO_STORE_HEADERS,
    THIS_CALLER,
    body_errors,
    link,
    problem,
    request_body,
    response,
)
from .operations import documented
from .responses import json_response
from .routes import PRINCIPAL, actor, project_for, read_json

routes = web.RouteTableDef()
LINKS = "/v1/projects/{project}/callers/{identifier}/links"
NO_STORE = {"Cache-Control": "no-store"}


def link_view(link: Link) -> dict[str, Any]:
    body = link_body(link)
    return {**body, "linked_at": iso_utc(body["linked_at"]), "expires_at": iso_utc(body["expires_at"])}


@routes.post(LINKS)
@documented(
    "agent",
    "Link another identifier to a caller (merging its memory if asked)",
    {
        "200": response("It was linked already: renewed.", "LinkCreated", *NO_STORE_HEADERS),
        "201": response("Linked.", "LinkCreated", *NO_STORE_HEADERS),
        "403": problem("The project does not link identifiers, or an agent's request without `step_up`."),
        "409": problem(
            "The identifier is linked elsewhere, has links of its own, has memory and `merge` was not "
            "given, or the caller has five identifiers already. Nothing is changed."
        ),
        "422": problem(f"{BAD_CALLER}, a bad body identifier, the same identifier, or a blacklisted one."),
        **body_errors(),
    },
    body=request_body("LinkBody", "The identifier to link."),
    description="An admin, or an agent in a call whose caller passed a step-up check. Audited.",
    links={
        "201": {
            "ListLinks": link("list_links", THIS_CALLER),
            "Unlink": link("delete_link", THIS_CALLER | {"other": "$response.body#/link/link_id"}),
        }
    },
)
async def create_link(request: web.Request) -> web.Response:
    # An agent may link too, in a call whose caller passed a step-up check (the domain checks the body).
    services, project = await project_for(request, Role.AGENT)
    identifier = request.match_info["identifier"]
    services.memory.caller(project, identifier)  # a bad path identifier is reported before the body
    document = await read_json(request)
    principal = request[PRINCIPAL]
    linked = await services.links.link(
        project,
        identifier,
        document,
        actor=actor(request),
        agent=not principal.operator and principal.role is Role.AGENT,
    )
    body = {
        "link": link_view(linked.link),
        "created": linked.created,
        "merged": {"fields": linked.fields_merged, "first_interaction": linked.first_interaction_merged},
    }
    return json_response(body, status=201 if linked.created else 200, headers=NO_STORE)


@routes.get(LINKS)
@documented(
    "admin",
    "A caller's linked identifiers",
    {
        "200": response("Kind and link id each.", "LinkList", *NO_STORE_HEADERS),
        "422": problem(f"{BAD_CALLER}."),
    },
)
async def list_links(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    links = await services.links.links(project, request.match_info["identifier"])
    return json_response({"links": [link_view(link) for link in links]}, headers=NO_STORE)


@routes.delete(LINKS + "/{other}")
@documented(
    "admin",
    "Unlink an identifier (by the identifier, or by its link id)",
    {
        "200": response(
            "Unlinked; what a merge moved stays with the caller.", "LinkRemoved", *NO_STORE_HEADERS
        ),
        "404": problem("No such project, or the caller has no such link."),
        "422": problem(f"{BAD_CALLER}, or `other` is neither an identifier nor a link id."),
    },
    description="Audited.",
)
async def delete_link(request: web.Request) -> web.Response:
    services, project = await project_for(request, Role.ADMIN)
    removed = await services.links.unlink(
        project, request.match_info["identifier"], request.match_info["other"], actor=actor(request)
    )
    return json_response({"unlinked": link_view(removed)}, headers=NO_STORE)
