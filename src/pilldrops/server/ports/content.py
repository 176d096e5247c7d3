"""What a sandbox's answer may not do to the origin it is served on.

Path-form URLs put every sandbox under one origin (the port-URL listener, ``/ports/{id}/{port}/``), and
host-based ones put each sandbox port on a host of one wildcard domain. Origin-wide powers given to one
sandbox would reach the others, so the headers that grant them are taken out of every relayed answer:

- ``Set-Cookie``: our own cookie's name (``pilldrops_port``) and ``__Host-`` cookies (which must be for
  ``Path=/``) are dropped in the path form; a ``Domain`` attribute is dropped (the cookie stays on the
  host that set it, never its parent domain and so every sandbox host); in the path form a ``Path``
  outside the sandbox's prefix is moved under it (``Path=/`` -> ``Path=/ports/{id}/{port}/``, the way a
  reverse proxy maps the path it strips).
- ``Service-Worker-Allowed``: without it a service worker's scope is at most its script's directory
  (inside the prefix); with it a sandbox could register one for ``/`` and control every sandbox's pages.
- ``Clear-Site-Data``: it would wipe the cookies and storage of the whole origin (every sandbox's).

What a page's script does (``document.cookie``, ``fetch`` to another sandbox's path on the same origin)
cannot be policed by headers: per-sandbox isolation needs host-based URLs (``--public-host``).

The gateway's own answers (errors, redirects) carry ``OWN_HEADERS``.
"""

from __future__ import annotations

STRIPPED = {b"service-worker-allowed", b"clear-site-data"}
OWN_HEADERS = [(b"x-content-type-options", b"nosniff"), (b"cache-control", b"no-store"),
               (b"referrer-policy", b"no-referrer")]


def scope_cookie(value: bytes, prefix: str, own_cookie: str) -> bytes | None:
    """One ``Set-Cookie`` value kept to the sandbox's part of the origin, or None to drop it."""
    text = value.decode("latin-1")
    pair, *attrs = text.split(";")
    name = pair.split("=", 1)[0].strip()
    if name == own_cookie or (prefix and name.startswith("__Host-")):
        return None
    out = [pair.strip()]
    for attr in attrs:
        key, _, val = attr.strip().partition("=")
        k = key.strip().lower()
        if k == "domain":
            continue
        if k == "path" and prefix:
            path = val.strip()
            if not path.startswith("/"):
                path = "/"
            if path != prefix and not path.startswith(prefix + "/"):
                path = prefix + path
            out.append(f"Path={path}")
            continue
        if attr.strip():
            out.append(attr.strip())
    return "; ".join(out).encode("latin-1")


def police(headers: list[tuple[bytes, bytes]], prefix: str, own_cookie: str) -> list[tuple[bytes, bytes]]:
    """A relayed answer's headers without the origin-wide ones; ``prefix`` is ``/ports/{id}/{port}`` in
    the path form, '' in the host forms."""
    out = []
    for k, v in headers:
        n = k.lower()
        if n in STRIPPED:
            continue
        if n == b"set-cookie":
            kept = scope_cookie(v, prefix, own_cookie)
            if kept is None:
                continue
            v = kept
        out.append((k, v))
    return out
