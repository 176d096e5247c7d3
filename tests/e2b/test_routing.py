"""The one-port rule and id mapping (unit: no server), and the node's port tunnel on a real network namespace
made by the test (root): the connection is made inside that namespace, where the host cannot reach."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import anyio
import pytest

from pilldrops import errors
from pilldrops.e2b.context import from_e2b_id, to_e2b_id
from pilldrops.e2b.rest import e2b_template, is_rest_path
from pilldrops.e2b.routing import sandbox_target


def test_sandbox_target_rules() -> None:
    assert sandbox_target({"e2b-sandbox-id": "sbabc", "e2b-sandbox-port": "49983"}) == ("sbabc", 49983)
    assert sandbox_target({"e2b-sandbox-id": "sbabc"}) == ("sbabc", 49983)            # envd by default
    assert sandbox_target({"e2b-sandbox-id": "sbabc", "e2b-sandbox-port": "x"}) == ("sbabc", -1)
    assert sandbox_target({"host": "49999-sbabc.e2b.local"}) == ("sbabc", 49999)
    assert sandbox_target({"host": "8080-sbabc.sandbox.example.com:443"}) == ("sbabc", 8080)
    # headers win over the host; control-plane traffic has neither
    assert sandbox_target({"e2b-sandbox-id": "sbx", "e2b-sandbox-port": "1", "host": "2-sby.d"}) == ("sbx", 1)
    assert sandbox_target({"host": "127.0.0.1:3000", "x-api-key": "k"}) is None
    assert sandbox_target({"host": "api.example.com"}) is None
    assert sandbox_target({"host": "localhost"}) is None


def test_ids_templates_and_paths() -> None:
    assert to_e2b_id("sb_abc123") == "sbabc123" and from_e2b_id("sbabc123") == "sb_abc123"
    assert from_e2b_id("sb_abc123") == "sb_abc123" and from_e2b_id(to_e2b_id("sb_0")) == "sb_0"
    assert to_e2b_id("sb_abc123").isalnum()
    assert e2b_template("code-interpreter-v1") == "code-interpreter" and e2b_template("base") == "base"
    assert is_rest_path("/sandboxes") and is_rest_path("/v2/sandboxes/x/connect")
    assert not is_rest_path("/v1/sandboxes") and not is_rest_path("/sandboxesx") and not is_rest_path("/files")


def _why_no_netns() -> str | None:
    if os.geteuid() != 0:
        return "entering a network namespace needs root"
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed"
    return None


@pytest.mark.integration
@pytest.mark.anyio
async def test_portforward_connects_inside_a_network_namespace() -> None:
    """A server bound to 127.0.0.1 in a fresh network namespace is reachable only through
    ``portforward.connect(pid_in_that_netns, port)``; nothing of the agent stays in that namespace."""
    why = _why_no_netns()
    if why:
        pytest.skip(why)
    from pilldrops.node import portforward
    server = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 18765)); s.listen(); print('up', flush=True)\n"
              "while True:\n    c, _ = s.accept(); c.sendall(c.recv(100).upper()); c.close()")
    proc = subprocess.Popen(["unshare", "--net", "sh", "-c", f"ip link set lo up 2>/dev/null; exec {sys.executable} -c \"{server}\""],  # noqa: ASYNC220 - a short setup command
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up", proc.stderr.read()
        own = os.readlink("/proc/thread-self/ns/net")
        stream = await portforward.connect(proc.pid, 18765)
        async with stream:
            await stream.send(b"hello")
            assert await stream.receive() == b"HELLO"
        assert os.readlink("/proc/thread-self/ns/net") == own
        with pytest.raises(ConnectionRefusedError):
            await portforward.connect(proc.pid, 18766)          # nothing listens there
        with pytest.raises(OSError):                            # and the host's own loopback never had it
            await anyio.connect_tcp("127.0.0.1", 18765)
    finally:
        proc.kill()
        proc.wait()
    await anyio.sleep(0.05)
    with pytest.raises(errors.SandboxNotFound):
        await portforward.connect(proc.pid, 18765)            # the process (and its namespace) is gone


@pytest.mark.anyio
async def test_portforward_rejects_bad_ports() -> None:
    from pilldrops.node import portforward
    with pytest.raises(errors.InvalidRequest):
        await portforward.connect(1, 0)
    with pytest.raises(errors.InvalidRequest):
        await portforward.connect(1, 70000)
