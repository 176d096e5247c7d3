"""What the raw-route parity tests share (``node/runroute.py``, ``node/createroute.py``, ``node/killroute.py``,
``server/api/createroute.py``, ``server/api/killroute.py``, issue 15): an app with the raw handler taken out
(the FastAPI route answers), errors compared without their request ids, and the bound checked before a body
is buffered."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import ModuleType
from typing import Any

import httpx
import pytest


def without(app: Any, raw: type) -> Any:
    """``app`` without the raw handler ``raw`` in front: its FastAPI route answers."""
    app.user_middleware = [m for m in app.user_middleware if m.cls is not raw]
    return app


def same_fields(a: httpx.Response, b: httpx.Response, own: set[str]) -> dict[str, Any]:
    """Two JSON answers (the raw route's, the FastAPI route's) with the same fields in the same order and the
    same values, but for ``own``'s (each sandbox's own, or its clock's), which need only the same type;
    ``a``'s body."""
    ja, jb = a.json(), b.json()
    assert list(ja) == list(jb)
    for k in ja:
        if k in own:
            assert type(ja[k]) is type(jb[k]), (k, ja[k], jb[k])
        else:
            assert ja[k] == jb[k], (k, ja[k], jb[k])
    return ja  # type: ignore[no-any-return]


def strip(body: dict) -> dict:  # type: ignore[type-arg]
    body["error"].pop("request_id")
    return body


async def check_bounded(client: httpx.AsyncClient, url: str, route: ModuleType, monkeypatch: pytest.MonkeyPatch,
                        *, big: dict[str, Any], head: bytes, tail: bytes, headers: dict[str, str],
                        stranger: dict[str, str], stranger_code: tuple[int, str]) -> None:
    """``route``'s body is bounded before it is buffered (its ``MAX_BODY`` set to 1 KiB here): by the declared
    length (``big``, a JSON body over 2 KiB), by what arrives (``head`` + 2 KiB + ``tail``, no length), and a
    caller without the right credentials (``stranger``) gets ``stranger_code`` before any of it is read.
    ``MAX_BODY`` is its own again afterwards."""
    own = route.MAX_BODY
    monkeypatch.setattr(route, "MAX_BODY", 1024)
    r = await client.post(url, json=big, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text

    async def chunks() -> AsyncIterator[bytes]:
        yield head
        for _ in range(4):
            yield b"x" * 512
        yield tail

    r = await client.post(url, content=chunks(), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large", r.text
    r = await client.post(url, json=big, headers=stranger)
    assert (r.status_code, r.json()["error"]["code"]) == stranger_code, r.text
    monkeypatch.setattr(route, "MAX_BODY", own)
