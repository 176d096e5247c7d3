"""The web dashboard: a static single-page app (plain ES modules, hand-drawn SVG charts, no build step)
served by the control plane at ``/`` on the API port. The page holds no data and needs no auth; it signs
in with an API key the user types (kept in sessionStorage, sent as ``Authorization: Bearer``) and reads
the public REST API. Every answer carries a strict Content-Security-Policy (scripts, styles and fetches
from this origin only; no inline code, no framing)."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from pilldrops import errors

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
# no window of another origin (a sandbox's page, served on the port-URL listener's origin) keeps a handle
# on the dashboard's (COOP), nor embeds its files (CORP)
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache", "Cross-Origin-Opener-Policy": "same-origin",
           "Cross-Origin-Resource-Policy": "same-origin"}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png"}


def _assets() -> dict[str, tuple[bytes, str]]:
    """Every file of ``static/`` by name, read once (the only paths served: nothing is looked up on disk
    from a request's path)."""
    out = {}
    for f in resources.files(__package__).joinpath("static").iterdir():
        ext = "." + f.name.rsplit(".", 1)[-1]
        if f.is_file() and ext in TYPES:
            out[f.name] = (f.read_bytes(), TYPES[ext])
    return out


def router() -> APIRouter:
    assets = _assets()
    r = APIRouter(include_in_schema=False)

    def serve(name: str) -> Response:
        if name not in assets:
            raise errors.NotFound(f"no dashboard file {name!r}")
        body, ctype = assets[name]
        return Response(body, media_type=ctype, headers=HEADERS)

    @r.get("/")
    async def index() -> Response:
        return serve("index.html")

    @r.get("/dashboard/{name}")
    async def asset(name: str) -> Response:
        return serve(name)

    return r
