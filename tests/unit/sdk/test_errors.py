"""HTTP answers become the most specific PillDrops error, whatever the body looks like."""

from __future__ import annotations

import httpx
import pytest

from pilldrops import errors
from pilldrops.sdk._base import error_from_response


def _resp(status: int, **kw: object) -> httpx.Response:
    return httpx.Response(status, request=httpx.Request("GET", "http://x/v1/sandboxes"), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [c for c in errors._ALL])
def test_every_code_maps_to_its_class(cls: type[errors.PillDropsError]) -> None:
    body = {"error": {"code": cls.code, "message": "m", "details": {"a": 1}, "request_id": "req_1"}}
    exc = error_from_response(_resp(cls.status, json=body))
    assert type(exc) is cls and exc.message == "m" and exc.details == {"a": 1} and exc.request_id == "req_1"


@pytest.mark.parametrize("status,cls", [(400, errors.InvalidRequest), (401, errors.AuthenticationError),
                                        (402, errors.InsufficientCredits),
                                        (403, errors.PermissionDenied), (404, errors.NotFound),
                                        (409, errors.Conflict), (413, errors.PayloadTooLarge),
                                        (422, errors.InvalidRequest), (429, errors.RateLimited),
                                        (500, errors.ServerError), (502, errors.NodeUnavailable),
                                        (503, errors.CapacityUnavailable), (504, errors.ServerError),
                                        (418, errors.PillDropsError)])
def test_status_fallback_for_non_json_bodies(status: int, cls: type[errors.PillDropsError]) -> None:
    exc = error_from_response(_resp(status, content=b"<html>bad gateway</html>",
                                    headers={"x-request-id": "req_h"}))
    assert type(exc) is cls and str(status) in exc.message and "bad gateway" in exc.message
    assert exc.request_id == "req_h"


def test_unknown_code_falls_back_to_status() -> None:
    exc = error_from_response(_resp(404, json={"error": {"code": "brand_new", "message": "?"}}))
    assert type(exc) is errors.NotFound


def test_json_without_error_envelope() -> None:
    exc = error_from_response(_resp(500, json=["weird"]))
    assert isinstance(exc, errors.ServerError)


def test_sandbox_not_found_is_a_not_found() -> None:
    exc = error_from_response(_resp(404, json={"error": {"code": "sandbox_not_found", "message": "gone"}}))
    assert isinstance(exc, errors.SandboxNotFound) and isinstance(exc, errors.NotFound)


def test_insufficient_credits_is_402_and_not_retryable() -> None:
    body = {"error": {"code": "insufficient_credits", "message": "no credits left"}}
    exc = error_from_response(_resp(402, json=body))
    assert type(exc) is errors.InsufficientCredits and exc.status == 402 and not exc.retryable
    assert str(exc) == "no credits left"
