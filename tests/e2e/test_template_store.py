"""Templates as artifacts (issue 19), end to end with real processes: `pilldrops serve` on PostgreSQL and node
agents started WITHOUT `--templates`. One `pilldrops template build tiny` builds it on one node; creates then
succeed on all three nodes (two of them fetch the layers from the template store), a node that joins
afterwards runs it without building, a rebuild is the next version while a running sandbox keeps its own,
and a corrupted layer in the store is refused by digest."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pilldrops import Sandbox
from tests.e2e.conftest import MATCH, _why_not_runnable
from tests.e2e.fleet import Fleet, running_fleet

pytestmark = pytest.mark.integration


@pytest.fixture
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    why = _why_not_runnable()
    if why:
        pytest.skip(why)
    db = request.getfixturevalue("postgres").new_database()
    with running_fleet(tmp_path / f"{MATCH}-tstore", f"{MATCH.split('-', 1)[1]}ts", MATCH, db) as f:
        yield f


def _cli(f: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pilldrops", "--api-url", f.url, "--api-key", f.key, *args],
                          check=False, capture_output=True, text=True, env=f.env, timeout=300)


def _layers(f: Fleet, i: int) -> set[str]:
    d = f.root / f"node{i}" / "node" / "layers"
    return {p.name for p in d.iterdir() if (p / ".complete").exists()} if d.is_dir() else set()


def _create(f: Fleet) -> tuple[Sandbox, float]:
    t0 = time.monotonic()
    sb = Sandbox.create(template="tiny", vcpu=1, memory_mb=128, api_url=f.url, api_key=f.key)
    return sb, time.monotonic() - t0


def test_one_build_ships_to_every_node(fleet: Fleet) -> None:
    fleet.start_cp()
    for _ in range(3):
        fleet.add_node(capacity_vcpu=1, templates="")      # one sandbox of 1 vCPU per node
    fleet.wait_nodes_ready(3, template=None)
    with pytest.raises(Exception, match="not built on any node"):
        Sandbox.create(template="tiny", api_url=fleet.url, api_key=fleet.key)

    # one build, through the control plane, its log streamed
    res = _cli(fleet, "template", "build", "tiny")
    assert res.returncode == 0, res.stderr + res.stdout
    assert "building template tiny on node" in res.stderr and "from busybox" in res.stderr   # the build log
    assert res.stdout.startswith("tiny v1 sha256:")
    digest = res.stdout.split()[2]
    again = _cli(fleet, "template", "build", "tiny")               # unchanged spec: not built again
    assert again.returncode == 0 and "up to date" in again.stderr and " v1 " in again.stdout
    built_on = [i for i in range(3) if digest[7:] in _layers(fleet, i)]
    assert len(built_on) == 1                                      # exactly one node built it
    deadline = time.monotonic() + 10                               # and reports that it holds it
    while time.monotonic() < deadline:
        (tiny,) = [t for t in json.loads(_cli(fleet, "template", "list", "--json").stdout) if t["name"] == "tiny"]
        if tiny["nodes"]:
            break
        time.sleep(0.3)
    assert tiny["nodes"] == [fleet.node_names[built_on[0]]]

    # creates succeed on all three nodes; two of them fetch the layer first
    boxes, times = [], []
    for _ in range(3):
        sb, dt = _create(fleet)
        boxes.append(sb)
        times.append(dt)
        assert sb.run("echo hi from $(hostname)").stdout.startswith("hi from")
    with fleet.api() as c:
        placed = {c.get(f"/v1/sandboxes/{sb.id}").json()["node_id"] for sb in boxes}
    assert len(placed) == 3
    assert all(digest[7:] in _layers(fleet, i) for i in range(3))
    listed = _cli(fleet, "template", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (tiny,) = [t for t in json.loads(listed.stdout) if t["name"] == "tiny"]
    assert tiny["version"] == 1 and tiny["digest"] == digest and tiny["size_bytes"] > 0
    assert tiny["build_seconds"] is not None and tiny["built_at"]
    deadline = time.monotonic() + 10                               # heartbeats report the holders
    while len(tiny["nodes"]) < 3 and time.monotonic() < deadline:
        time.sleep(0.3)
        (tiny,) = [t for t in json.loads(_cli(fleet, "template", "list", "--json").stdout) if t["name"] == "tiny"]
    assert sorted(tiny["nodes"]) == sorted(fleet.node_names)

    # a second create on a node that holds it (after the first sandbox on it ended): no fetch
    boxes[0].kill()
    third, warm = _create(fleet)
    print(f"\ncreate of tiny, fetching the layer first: {max(times[1:]) * 1000:.0f} ms; "
          f"on the builder node: {times[0] * 1000:.0f} ms; again on a node holding it: {warm * 1000:.0f} ms")

    # a rebuild is v2; the running sandbox keeps v1 and still runs
    rebuilt = _cli(fleet, "template", "build", "tiny", "--force")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert rebuilt.stdout.startswith("tiny v2 ") and rebuilt.stdout.split()[2] != digest
    assert boxes[1].run("echo still").stdout == "still\n"
    for sb in (boxes[1], boxes[2], third):
        sb.kill()

    # a node that joins afterwards runs it without a local build
    with fleet.api() as c:
        for n in c.get("/v1/nodes").json()["items"]:
            c.post(f"/v1/nodes/{n['id']}/drain").raise_for_status()
    fleet.add_node(capacity_vcpu=1, templates="")
    fleet.wait_nodes_ready(4, template=None)
    late = Sandbox.create(template="tiny", memory_mb=128, api_url=fleet.url, api_key=fleet.key)
    with fleet.api() as c:
        assert c.get(f"/v1/sandboxes/{late.id}").json()["node_id"] not in placed
    assert late.run("echo late").stdout == "late\n"
    assert not (fleet.root / "node3" / "templates").exists()        # nothing was built there
    late.kill()

    # a user's spec with a copy step: its build context is uploaded by digest and built remotely
    specs = fleet.root / "specs"
    (specs / "files").mkdir(parents=True)
    (specs / "files" / "episode.sh").write_text("echo from-context $GREETING\n")
    (specs / "mine.toml").write_text('name = "mine"\nfrom = "tiny"\nworkdir = "/env"\n[env]\nGREETING = "hi"\n'
                                     '[[steps]]\ncopy = { src = "files/episode.sh", dest = "/env/episode.sh" }\n')
    res = _cli(fleet, "template", "build", "mine", "--templates-dir", str(specs))
    assert res.returncode == 0, res.stderr + res.stdout
    assert "fetching build context sha256:" in res.stderr and "tiny" in res.stderr and " v1 " in res.stdout
    with Sandbox.create(template="mine", memory_mb=128, api_url=fleet.url, api_key=fleet.key) as sb:
        assert sb.run("sh episode.sh").stdout == "from-context hi\n"

    # a corrupted layer in the store is refused by digest on the next node that fetches it
    with fleet.api() as c:
        tiny = next(t for t in c.get("/v1/templates").json()["items"] if t["name"] == "tiny")
        for n in c.get("/v1/nodes").json()["items"]:
            c.post(f"/v1/nodes/{n['id']}/drain").raise_for_status()
    blob = fleet.root / "cp" / "template-store" / "layers" / tiny["digest"][7:]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    fleet.add_node(capacity_vcpu=1, templates="")
    fleet.wait_nodes_ready(5, template=None)
    with pytest.raises(Exception, match="failed verification"):
        Sandbox.create(template="tiny", memory_mb=128, api_url=fleet.url, api_key=fleet.key)
    assert tiny["digest"][7:] not in _layers(fleet, 4)              # nothing of it was kept
