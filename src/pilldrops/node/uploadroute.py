"""``PUT /v1/sandboxes/{id}/files`` (``sb.files.write``) and ``PUT /v1/sandboxes/{id}/archive``
(``sb.upload``: one tar stream) as a small raw ASGI handler in front of the node's FastAPI app (issue 15), as
``runroute`` does for ``run``.

Every rollout uploads its environment and writes files. Through FastAPI each paid for the middleware stack,
the route table, dependency injection and the response model's validation (~1 ms of CPU per write in a
py-spy profile of 250 sandboxes' writes, ~20 % of the node's CPU in that phase). Here the same request is
answered the same way with less: the same gate first (the app's own dependency, ``admit``: the agent has
re-adopted its sandboxes; a pre-issued member's holder waits for its claim, ``path_params`` set as the router
would), then the ``path`` query parameter checked as the FastAPI routes' ``Path_`` (present, 1 to 4,096
characters; else ``invalid_request`` with FastAPI's ``details``), the sandbox found by its access token
(``X-Access-Token``) exactly as they do (``target``), and the body streamed as it arrives to the same
``DataPlane.write_file`` / ``DataPlane.put_archive``, which bound it as before (an archive: its declared
length, then what arrives, ``MAX_UPLOAD_BYTES``; a file: the sandbox's disk). The answer is the same bytes:
``FileInfo`` as the response model serialises it, ``{"entries":n}``, with an ``x-request-id``; every
failure the same typed error body. A client that goes away mid-body gets nothing and leaves no command
behind (the write's is killed, ``dataplane._Feed``). The FastAPI routes stay (they document both calls in
the node's OpenAPI, and answer for an app without this handler in front).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from urllib.parse import parse_qsl

from pydantic import BaseModel, Field, ValidationError
from starlette.requests import HTTPConnection
from starlette.types import ASGIApp, Receive, Scope

from pilldrops._internal.asgibody import JsonRoute, declared_length, details_of, invalid, stream_body
from pilldrops.node.dataplane import DataPlane, Target
from pilldrops.node.runroute import Admit

log = logging.getLogger("pilldrops.node.upload")

# the router's ``/v1/sandboxes/{sandbox_id}/files`` and ``.../archive``
PATTERN = re.compile(r"/v1/sandboxes/(?P<sandbox_id>[^/]+)/(?:files|archive)")
PATH_MAX = 4096           # the FastAPI routes' ``Path_``: ``Query(min_length=1, max_length=4096)``


class _Query(BaseModel):
    """The FastAPI routes' ``Path_`` query parameter."""

    path: str = Field(min_length=1, max_length=PATH_MAX)


def query_path(scope: Scope) -> str:
    """The request's ``path`` query parameter, read as Starlette's ``QueryParams`` reads it (the last one
    counts) and validated as FastAPI does (the model makes the error's ``details``)."""
    given = None
    for key, value in parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True):
        if key == "path":
            given = value
    if given is not None and 0 < len(given) <= PATH_MAX:
        return given
    try:
        return _Query.model_validate({} if given is None else {"path": given}).path
    except ValidationError as e:
        raise invalid(details_of(e, "query")) from None


class UploadRoute(JsonRoute):
    """ASGI middleware: ``PUT /v1/sandboxes/{id}/files`` and ``.../archive`` answered here, everything else
    by ``app``."""

    method = "PUT"
    pattern = PATTERN
    log = log

    def __init__(self, app: ASGIApp, plane: DataPlane, target: Callable[[str, str | None], Target],
                 admit: Admit) -> None:
        super().__init__(app)
        self.plane, self.target, self.admit = plane, target, admit

    async def answer(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        conn = HTTPConnection(scope)
        await self.admit(conn)                                   # the app's dependency first, as FastAPI
        path = query_path(scope)                                 # then the parameters, then the route
        where = self.target(scope["path_params"]["sandbox_id"], conn.headers.get("x-access-token"))
        body = stream_body(receive)                              # nothing of it read before the token
        if scope["path"].endswith("/files"):
            info = await self.plane.write_file(where, path, body)
            return 200, info.model_dump_json().encode()          # as the response model serialises it
        n = await self.plane.put_archive(where, path, body, declared=declared_length(conn.headers))
        return 200, b'{"entries":%d}' % n
