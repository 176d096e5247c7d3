"""PillDrops: self-hostable disposable sandboxes for RL rollouts and evals.

Example::

    from pilldrops import Sandbox

    with Sandbox.create(template="code-interpreter", vcpu=1, memory_mb=512, timeout=600) as sb:
        sb.upload("./env", "/env")
        r = sb.run("python /env/episode.py")
        reward = float(r.stdout)
    cost = sb.info.cost_usd     # the episode's final cost, from the kill on leaving the block

``AsyncSandbox`` is the asyncio twin (``async with await AsyncSandbox.create(...) as sb:``).
Every error is a :class:`PillDropsError`; see :mod:`pilldrops.errors` for the tree.
"""

from pilldrops.errors import (
    AuthenticationError,
    CapacityUnavailable,
    CommandFailed,
    Conflict,
    DiskQuotaExceeded,
    EgressForbidden,
    FileNotFound,
    GatewayTimeout,
    InsufficientCredits,
    InvalidRequest,
    InvalidState,
    NodeUnavailable,
    NotFound,
    NotSupported,
    PayloadTooLarge,
    PermissionDenied,
    PillDropsError,
    PortNotOpen,
    RateLimited,
    RequestTimeout,
    SandboxNotFound,
    ServerError,
    TemplateBuildFailed,
    TemplateNotFound,
    TransportError,
    URLTokenExpired,
    URLTokenInvalid,
    URLTokenRequired,
)
from pilldrops.schema.api import FileInfo, HistoryRecord, PortURL, SandboxInfo, SandboxState, UsageSummary
from pilldrops.sdk._async.sandbox import AsyncSandbox
from pilldrops.sdk._async.template import AsyncTemplate
from pilldrops.sdk._base import RunResult
from pilldrops.sdk._build import BuiltTemplate
from pilldrops.sdk._sync.sandbox import Sandbox
from pilldrops.sdk._sync.template import Template
from pilldrops.sdk.fanout import MapItem, MapResult, amap, map

__version__ = "0.1.0"

__all__ = [
    "AsyncSandbox",
    "AsyncTemplate",
    "AuthenticationError",
    "BuiltTemplate",
    "CapacityUnavailable",
    "CommandFailed",
    "Conflict",
    "DiskQuotaExceeded",
    "EgressForbidden",
    "FileInfo",
    "FileNotFound",
    "GatewayTimeout",
    "HistoryRecord",
    "InsufficientCredits",
    "InvalidRequest",
    "InvalidState",
    "MapItem",
    "MapResult",
    "NodeUnavailable",
    "NotFound",
    "NotSupported",
    "PayloadTooLarge",
    "PermissionDenied",
    "PillDropsError",
    "PortNotOpen",
    "PortURL",
    "RateLimited",
    "RequestTimeout",
    "RunResult",
    "Sandbox",
    "SandboxInfo",
    "SandboxNotFound",
    "SandboxState",
    "ServerError",
    "Template",
    "TemplateBuildFailed",
    "TemplateNotFound",
    "TransportError",
    "URLTokenExpired",
    "URLTokenInvalid",
    "URLTokenRequired",
    "UsageSummary",
    "__version__",
    "amap",
    "map",
]
