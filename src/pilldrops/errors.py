"""One error hierarchy for the SDK, the CLI, the control plane and the node agent.

Every error has a stable machine ``code`` and maps to one HTTP status. On the wire every non-2xx body is::

    {"error": {"code": "...", "message": "...", "details": ..., "request_id": "..."}}

The tree (callers branch on *what they can do*, not on HTTP numbers)::

    PillDropsError                       code, message, details, request_id, retryable
    ├─ InvalidRequest        400 invalid_request
    ├─ AuthenticationError   401 unauthenticated
    │   ├─ URLTokenRequired  401 url_token_required  (a sandbox port's URL without its token)
    │   ├─ URLTokenInvalid   401 url_token_invalid   (forged, or another sandbox's or port's)
    │   └─ URLTokenExpired   401 url_token_expired
    ├─ PermissionDenied      403 permission_denied
    │   └─ EgressForbidden   403 egress_forbidden    (details: reason "disabled" | "outside_cap")
    ├─ NotFound              404 not_found
    │   ├─ SandboxNotFound   404 sandbox_not_found
    │   ├─ FileNotFound      404 file_not_found
    │   └─ TemplateNotFound  404 template_not_found
    ├─ Conflict              409 conflict
    │   └─ InvalidState      409 invalid_state       (details: from, to)
    ├─ InsufficientCredits   402 insufficient_credits
    ├─ PayloadTooLarge       413 payload_too_large
    │   └─ DiskQuotaExceeded 413 disk_quota_exceeded (an upload or write past the sandbox's disk_mb)
    ├─ RateLimited           429 rate_limited        (retryable)
    ├─ ServerError           500 internal            (retryable for idempotent calls)
    ├─ NodeUnavailable       502 node_unavailable    (retryable)
    │   └─ PortNotOpen       502 port_not_open       (nothing listens on that port in the sandbox)
    ├─ GatewayTimeout        504 gateway_timeout     (a server in a sandbox did not answer in time)
    ├─ CapacityUnavailable   503 capacity_unavailable (retryable)
    ├─ TransportError        —   no response at all  (retryable)
    │   └─ RequestTimeout    —   client-side deadline (also a builtin TimeoutError)
    └─ CommandFailed         —   only from run(..., check=True) when exit_code != 0

The SDK maps a body's ``code`` to the class first and falls back to the HTTP status (``from_wire``).
"""

from __future__ import annotations

from typing import Any, ClassVar


class PillDropsError(Exception):
    """Root of every error PillDrops raises."""

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 500
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "", *, details: Any = None, request_id: str | None = None) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.details = details
        self.request_id = request_id

    def __str__(self) -> str:
        suffix = f" (request_id={self.request_id})" if self.request_id else ""
        return f"{self.message}{suffix}"

    def to_body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "details": self.details,
                "request_id": self.request_id,
            }
        }


class InvalidRequest(PillDropsError):
    code = "invalid_request"
    status = 400


class AuthenticationError(PillDropsError):
    code = "unauthenticated"
    status = 401


class URLTokenRequired(AuthenticationError):
    code = "url_token_required"


class URLTokenInvalid(AuthenticationError):
    code = "url_token_invalid"


class URLTokenExpired(AuthenticationError):
    code = "url_token_expired"


class PermissionDenied(PillDropsError):
    code = "permission_denied"
    status = 403


class EgressForbidden(PermissionDenied):
    """The create asks for egress this deployment does not give (``--no-egress``, or outside its
    ``--egress-allow`` cap)."""

    code = "egress_forbidden"


class NotFound(PillDropsError):
    code = "not_found"
    status = 404


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class FileNotFound(NotFound):
    code = "file_not_found"


class TemplateNotFound(NotFound):
    code = "template_not_found"


class Conflict(PillDropsError):
    code = "conflict"
    status = 409


class InvalidState(Conflict):
    """An operation is illegal in the sandbox's current state; ``details`` names both states."""

    code = "invalid_state"

    def __init__(self, message: str = "", *, current: str | None = None, target: str | None = None,
                 details: Any = None, request_id: str | None = None) -> None:
        if details is None and (current or target):
            details = {"from": current, "to": target}
        if not message and (current or target):
            message = f"cannot go from state {current!r} to {target!r}"
        super().__init__(message, details=details, request_id=request_id)


class InsufficientCredits(PillDropsError):
    """The team's credits are used up; add credits (``pilldrops credits add``) to create sandboxes again."""

    code = "insufficient_credits"
    status = 402


class PayloadTooLarge(PillDropsError):
    code = "payload_too_large"
    status = 413


class DiskQuotaExceeded(PayloadTooLarge):
    """An upload or file write does not fit in the sandbox's disk (``disk_mb``); details: free bytes."""

    code = "disk_quota_exceeded"


class RateLimited(PillDropsError):
    code = "rate_limited"
    status = 429
    retryable = True


class ServerError(PillDropsError):
    code = "internal"
    status = 500
    retryable = True


class NodeUnavailable(PillDropsError):
    code = "node_unavailable"
    status = 502
    retryable = True


class PortNotOpen(NodeUnavailable):
    code = "port_not_open"


class GatewayTimeout(PillDropsError):
    code = "gateway_timeout"
    status = 504


class NotSupported(PillDropsError):
    """The operation exists but this deployment cannot do it (e.g. pause on a node without CRIU)."""

    code = "not_supported"
    status = 501


class CapacityUnavailable(PillDropsError):
    code = "capacity_unavailable"
    status = 503
    retryable = True


class TemplateBuildFailed(PillDropsError):
    """A template build ran and failed (a step's exit status, a bad spec, a layer that did not verify); the
    message names the step and its last output line."""

    code = "template_build_failed"
    status = 422


class TransportError(PillDropsError):
    """No HTTP response was received (connection refused, reset, DNS, ...)."""

    code = "transport_error"
    status = 0
    retryable = True


class RequestTimeout(TransportError, TimeoutError):
    code = "request_timeout"


class CommandFailed(PillDropsError):
    """Raised by ``run(..., check=True)`` when the command exits non-zero. ``result`` holds the output."""

    code = "command_failed"
    status = 0

    def __init__(self, message: str = "", *, result: Any = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.result = result


_ALL: tuple[type[PillDropsError], ...] = (
    InvalidRequest, AuthenticationError, URLTokenRequired, URLTokenInvalid, URLTokenExpired, PermissionDenied,
    EgressForbidden, NotFound, SandboxNotFound, FileNotFound,
    TemplateNotFound, Conflict, InvalidState, InsufficientCredits, PayloadTooLarge, RateLimited, ServerError, NodeUnavailable,
    CapacityUnavailable, NotSupported, TemplateBuildFailed, GatewayTimeout, PortNotOpen, DiskQuotaExceeded,
)
BY_CODE: dict[str, type[PillDropsError]] = {cls.code: cls for cls in _ALL}
BY_STATUS: dict[int, type[PillDropsError]] = {
    400: InvalidRequest, 401: AuthenticationError, 402: InsufficientCredits, 403: PermissionDenied, 404: NotFound, 409: Conflict,
    413: PayloadTooLarge, 422: InvalidRequest, 429: RateLimited, 500: ServerError, 501: NotSupported, 502: NodeUnavailable,
    503: CapacityUnavailable,
}


def from_wire(status: int, body: Any) -> PillDropsError:
    """Build the most specific error from an HTTP status and a decoded JSON body (any shape)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        err = {}
    code = err.get("code") if isinstance(err.get("code"), str) else None
    cls = BY_CODE.get(code or "") or BY_STATUS.get(status) or (ServerError if status >= 500 else PillDropsError)
    message = err.get("message") if isinstance(err.get("message"), str) else f"HTTP {status}"
    exc = cls.__new__(cls)
    PillDropsError.__init__(exc, message, details=err.get("details"), request_id=err.get("request_id"))
    return exc
