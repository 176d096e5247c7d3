"""A real `pilldrops up` for the tiers that drive the product from outside (tests/e2e, e2b, ports, browser,
hostile, network; sdk-js/tools/with_up.py): a subprocess on free ports with its own data dir, config dir and
node name (``--node-name NAME``: its cgroups and mounts carry ``pilldrops-NAME``, the leak-check scope), the
real crun runtime (gVisor when runsc works here), and the templates it is started with plus any built
templates seeded from the machine's template cache.

- ``Up``: one instance: ``start`` / ``stop`` / ``restart`` (same ports or new ones), ``client``,
  ``snapshot`` (this instance's containers, runsc sandboxes, microVM leftovers, mounts, cgroups, processes,
  and its egress links/netns/nft objects once it has an instance tag), ``seed`` (cached Debian templates,
  announced by the node within a second);
- ``running(up)``: the session lifecycle: baseline snapshot, start, warm-up sandboxes (the node's cgroup
  parents exist for the life of `up`, before the first per-test snapshot), then at the end SIGINT, exit 0
  and nothing of it left;
- ``no_leaks_of(up)``: the per-test check: nothing the test's sandboxes made is left.

The tiers share one instance where their tests need no `up` of their own (``shared_up`` in
tests/conftest.py); a test that needs a fresh or differently configured `up` makes its own ``Up``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pilldrops.node.isolation.diskspares import SPARES_DIR
from tests import leakcheck
from tests.e2e.fleet import clean_env, free_port

START_TIMEOUT_S = 300       # generous: a loaded shared machine; a healthy start takes seconds
SHARED_NAME = f"e2e{os.getpid()}"      # the shared `up`'s node name (tests/conftest.py ``shared_up``)
TEMPLATE_CACHE = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / "pilldrops"


def why_not_root(what: str = "these tests run a real `pilldrops up`") -> str | None:
    """Why a real `up` cannot run here (the tests skip with it), or None."""
    if os.geteuid() != 0:
        return f"{what}, which needs root (mounts, cgroups, crun)"
    if not shutil.which("crun"):
        return "crun is not installed (run scripts/install-system-deps)"
    return None


# data dirs where this session built the Debian templates from nothing (tests/e2e/test_debian_templates.py
# adds the shared `up`'s after its build): seeding prefers them to the machine's template cache
SESSION_BUILDS: list[Path] = []


def seed_templates(data: Path, names: Sequence[str]) -> None:
    """Make the built templates ``names`` (and their parents) usable in the data dir ``data``: this
    session's own build of them (``SESSION_BUILDS``) if there is one, else the machine's template cache
    (built there first if needed: once per machine, minutes). A manifest is copied; its layers stay where
    they were built. One already built in ``data`` (the session's own Debian build,
    tests/e2e/test_debian_templates.py) is kept: it is neither rebuilt in the cache nor replaced."""
    from pilldrops.node.templates import TemplateStore
    store, here = TemplateStore(TEMPLATE_CACHE), TemplateStore(data)
    todo = list(names)
    while todo:
        name = todo.pop()
        h = here.hash(name)
        if (data / "templates" / name / h / "manifest.json").exists():
            continue                                          # built or seeded here already (parents too)
        built = [d for d in SESSION_BUILDS if (d / "templates" / name / h / "manifest.json").exists()]
        if built:
            src = built[0] / "templates" / name / h / "manifest.json"
        else:
            h = store.ensure(name).hash
            src = TEMPLATE_CACHE / "templates" / name / h / "manifest.json"
        dst = data / "templates" / name / h
        dst.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst / "manifest.json")
        if not here.spec(name).is_builder:
            todo.append(here.spec(name).base)


@dataclass
class Up:
    root: Path                                   # data/, config/, up.log under it
    name: str                                    # node name; ``pilldrops-NAME`` is the leak-check scope
    templates: str = "tiny"
    extra: tuple[str, ...] = ()                  # more `up` flags (every start)
    env_extra: dict[str, str] = field(default_factory=dict)
    ports_listener: bool = False                 # the port-URL listener on a port of its own (else off)
    port_pair: bool = False                      # node port = API port + 1 (tests/network computes it)
    net_checked: bool = False                    # leak checks cover its egress links, netns and nft objects
    api_url: str = ""
    node_url: str = ""
    ports_url: str = ""
    api_key: str = ""
    proc: subprocess.Popen[bytes] | None = None
    isolations: tuple[str, ...] = ("container",)   # the modes its node runs (after ``running``'s warm-up)

    data_dir: Path = None        # type: ignore[assignment]   # default ROOT/data
    config_home: Path = None     # type: ignore[assignment]   # default ROOT/config
    log: Path = None             # type: ignore[assignment]   # default ROOT/up.log

    def __post_init__(self) -> None:
        self.data_dir = self.data_dir or self.root / "data"
        self.config_home = self.config_home or self.root / "config"
        self.log = self.log or self.root / "up.log"

    @property
    def match(self) -> str:
        return f"pilldrops-{self.name}"

    @property
    def crun_root(self) -> Path:
        return self.data_dir / "node" / "crun"

    @property
    def runsc_root(self) -> Path:
        return self.data_dir / "node" / "runtimes" / "gvisor" / "runsc"

    @property
    def tag(self) -> str | None:
        """The node's instance tag (its egress links are ``pd<tag>*``, its nft table ``pd_<tag>``)."""
        f = self.data_dir / "node" / "instance"
        return f.read_text().strip()[:4] if f.exists() else None

    @property
    def e2b_env(self) -> dict[str, str]:
        """The three lines of the README's "Coming from E2B"."""
        return {"E2B_API_URL": self.api_url, "E2B_SANDBOX_URL": self.api_url, "E2B_API_KEY": self.api_key}

    def snapshot(self, *, spares: bool = False) -> dict[str, object]:
        """Without ``spares`` the node's spare disks (``isolation.diskspares``: made ahead, one replaced at
        each create) are not counted: they are the running node's, not a test's; ``running``'s end check,
        after the node stopped, counts them (none may be left)."""
        cache = os.environ.get("PILLDROPS_MICROVM_CACHE")
        tag = self.tag if self.net_checked else None
        return leakcheck.snapshot([self.crun_root], match=self.match, runsc_roots=[self.runsc_root],
                                  qemu_dirs=[self.data_dir / "node" / "runtimes" / "microvm",
                                             *([Path(cache)] if cache else [])],
                                  net_prefix=f"pd{tag}" if tag else None, nft_table=f"pd_{tag}" if tag else None,
                                  ignore=() if spares else (f"/{SPARES_DIR}/",))

    def client(self, key: str | None = None, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.api_url, headers={"Authorization": f"Bearer {key or self.api_key}"},
                            timeout=kw.pop("timeout", 60), **kw)  # type: ignore[arg-type]

    def env(self) -> dict[str, str]:
        return clean_env(self.config_home, PYTHONUNBUFFERED="1", **self.env_extra)

    def _ports(self, new: bool) -> tuple[int, int, int]:
        if self.api_url and not new:
            return (int(self.api_url.rsplit(":", 1)[1]), int(self.node_url.rsplit(":", 1)[1]),
                    int(self.ports_url.rsplit(":", 1)[1]) if self.ports_url else 0)
        port = _free_port_pair() if self.port_pair else free_port()
        node = port + 1 if self.port_pair else free_port()
        return port, node, free_port() if self.ports_listener else 0

    def start(self, *extra: str, new_ports: bool = False) -> None:
        """Start `up` (on the ports it had, unless ``new_ports`` or never started); once more on new ports
        if it exits at once because another process on this shared machine took a port first."""
        for attempt in range(2):
            port, node_port, ports_port = self._ports(new_ports or attempt > 0)
            self.root.mkdir(parents=True, exist_ok=True)
            mark = len(self.log.read_text()) if self.log.exists() else 0     # a restart appends to the log
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "pilldrops", "up", "--port", str(port), "--node-port", str(node_port),
                     "--ports-port", str(ports_port), "--data-dir", str(self.data_dir), "--templates",
                     self.templates, "--node-name", self.name, *self.extra, *extra],
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env())
            self.api_url, self.node_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{node_port}"
            self.ports_url = f"http://127.0.0.1:{ports_port}" if ports_port else ""
            deadline = time.monotonic() + START_TIMEOUT_S
            try:
                while "is up at" not in (text := self.log.read_text()[mark:]):
                    if self.proc.poll() is not None and attempt == 0 and "already in use" in text:
                        break
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"pilldrops up did not start:\n{text[-3000:]}")
                    time.sleep(0.1)
                else:
                    self.api_key = json.loads((self.config_home / "pilldrops" / "config.json").read_text())["api_key"]
                    return
            except BaseException:          # incl. pytest-timeout: never leave a half-started `up` behind
                self.kill_hard()
                raise
        raise AssertionError("unreachable")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)

    def kill_hard(self) -> None:
        """SIGINT (it tears down what it started), SIGKILL if that does not end it."""
        if self.proc is None:
            return
        try:
            self.stop()
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def seed(self, *names: str, timeout: float = 60) -> None:
        """Seed cached built templates and wait until the node announces them."""
        seed_templates(self.data_dir, names)
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while not set(names) <= {t["name"] for t in c.get("/v1/templates").json()["items"]}:
                assert time.monotonic() < deadline, f"the node never announced the seeded templates {names}"
                time.sleep(0.2)

    def warm_up(self, bodies: Sequence[dict[str, object]] = ()) -> None:
        """A sandbox per isolation mode the node runs (container; gVisor when available), plus ``bodies``:
        the node's cgroup parents (and nft table) then exist for the life of `up` (removed when it stops,
        which ``running``'s end check covers), so they are there before the first per-test snapshot."""
        with self.client() as c:
            (node,) = c.get("/v1/nodes").raise_for_status().json()["items"]
            modes = ["container"] + (["gvisor"] if node["isolation"]["gvisor"]["available"] else [])
            todo = [{"template": self.templates.split(",")[0], "isolation": m} for m in modes] + list(bodies)
            for body in todo:
                sid = c.post("/v1/sandboxes", json=body).raise_for_status().json()["id"]
                c.delete(f"/v1/sandboxes/{sid}").raise_for_status()
        self.isolations = tuple(modes)


def start_up(data_dir: Path, config_home: Path, log: Path, *extra: str, name: str | None = None,
             templates: str = "tiny") -> tuple[subprocess.Popen[bytes], str]:
    """A `pilldrops up` of a test's own (one that restarts or SIGKILLs it): ``(process, API URL)``."""
    up = Up(data_dir.parent, name or SHARED_NAME, templates, data_dir=data_dir, config_home=config_home, log=log)
    up.start(*extra)
    assert up.proc is not None
    return up.proc, up.api_url


def stop_up(proc: subprocess.Popen[bytes], sig: int = signal.SIGINT, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(sig)
    return proc.wait(timeout=timeout)


def _free_port_pair() -> int:
    import socket
    for _ in range(50):
        p = free_port()
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p + 1))
            return p
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@contextmanager
def running(up: Up, *, warm: Sequence[dict[str, object]] = ()) -> Iterator[Up]:
    """``up`` started and warmed up; at the end stopped with SIGINT, which must exit 0 and leave nothing
    of it (containers, mounts, cgroups, processes, egress objects, spare disks) behind."""
    before = up.snapshot(spares=True)
    up.start()
    try:
        up.warm_up(warm)
    except BaseException:
        up.kill_hard()
        raise
    try:
        yield up
    finally:
        code = up.stop()        # (a test may have restarted it: up.proc is the live one)
        assert code == 0, f"`pilldrops up` exited {code} on SIGINT:\n{up.log.read_text()[-3000:]}"
        leakcheck.assert_no_leaks(before, settle=5)
        tag = up.tag if up.net_checked else None
        if tag:
            leakcheck.assert_none_left(net_prefix=f"pd{tag}", nft_table=f"pd_{tag}")


@contextmanager
def no_leaks_of(up: Up, settle: float = 5) -> Iterator[None]:
    """Around one test: none of the containers, mounts, cgroups, processes (and egress objects) its
    sandboxes made may be left afterwards."""
    before = up.snapshot()
    yield
    leakcheck.assert_no_leaks(before, settle=settle)
