# DO NOT EDIT — generated from _async by scripts/unasync.py
"""``Template.build``: build a template from a Dockerfile, on a control plane or on this machine.

    from pilldrops import Template
    built = Template.build("my-env", dockerfile="Dockerfile", context=".", build_args={"PY": "3"})
    sb = Sandbox.create(template=built.name)

Against a control plane (the default) the Dockerfile is translated here (``pilldrops.dockerfile``), the files
its COPY/ADD read go up by digest, and one node builds it for the whole fleet while the log streams back. ``local=True`` builds on this machine instead, with the
``pilldrops template build -f`` command (needs root), which is what a node agent on this host then runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pilldrops.errors import InvalidRequest, ServerError
from pilldrops.sdk._sync.client import APIClient
from pilldrops.sdk._base import Blocking
from pilldrops.sdk._build import BuiltTemplate, build_event, context_digest, local_build, remote_plan

LogCallback = Callable[[str], None]
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")


class Template:
    """Templates as a user builds them. Twin of :class:`Template`."""

    @classmethod
    def build(cls, name: str, *, dockerfile: str | Path = "Dockerfile", context: str | Path | None = None,
                    build_args: dict[str, str] | None = None, force: bool = False, local: bool = False,
                    on_log: LogCallback | None = None, api_url: str | None = None, api_key: str | None = None,
                    data_dir: str | Path | None = None, timeout: float = 3600,
                    transport: Any = None) -> BuiltTemplate:
        """Build template ``name`` from ``dockerfile`` (the supported subset: FROM one of our templates or
        debian:SUITE, RUN, COPY/ADD from ``context``, ENV, WORKDIR, ARG, USER). ``context`` defaults to the
        Dockerfile's folder. ``on_log`` gets each build-log line. Returns the template's name, hash and size.

        ``local=True``: build on this machine (root; ``data_dir`` is ``pilldrops up``'s, by default the
        usual one), else on the control plane at ``api_url``. Errors are typed: a Dockerfile outside the
        subset is :class:`InvalidRequest` naming the instruction and its line. ``transport``: an optional
        ``httpx`` transport (tests)."""
        if not _NAME.match(name):
            raise InvalidRequest(f"template name {name!r} must match {_NAME.pattern}")
        path = Path(dockerfile)
        ctx = Path(context) if context is not None else path.resolve().parent
        if not path.is_file():
            raise InvalidRequest(f"no Dockerfile at {path}")
        if not ctx.is_dir():
            raise InvalidRequest(f"build context {ctx} is not a folder")
        if local:
            return Blocking.run(local_build, name, path, ctx, dict(build_args or {}), force, on_log,
                                           data_dir, timeout)
        client = APIClient.from_options(api_url, api_key, transport=transport)
        plan = Blocking.run(remote_plan, path, ctx, name, dict(build_args or {}))
        built: BuiltTemplate | None = None
        for i, (document, tar) in enumerate(plan):
            digest = None
            if tar is not None:
                digest = context_digest(tar)
                client.request("PUT", f"/v1/templates/contexts/{digest}", idempotent=True, content=tar,
                                     headers={"content-type": "application/x-tar"}, timeout=timeout)
            log: list[str] = []
            built = None
            body = {"spec": document, "context": digest, "force": force and i == len(plan) - 1}
            with client.stream("POST", "/v1/templates/builds", idempotent=False, json=body,
                                     timeout=httpx.Timeout(30.0, read=timeout)) as response:
                for line in response.iter_lines():
                    built = build_event(line, log, on_log) or built
            if built is None:
                raise ServerError(f"the build of {document.get('name')} ended without a result (last log "
                                  f"line: {log[-1] if log else 'none'})")
        assert built is not None
        return built
