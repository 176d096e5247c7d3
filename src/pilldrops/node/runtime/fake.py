"""FakeRuntime: a ``Runtime`` for fast unit tests of the agent. TEST-ONLY, NO ISOLATION.

Each sandbox is a plain temp directory; ``exec`` runs argv as an ordinary host subprocess with its cwd
inside that directory (``cwd="/x"`` maps to ``<dir>/x``) and the sandbox env merged over a minimal host
env. It keeps the same ``ExecProcess`` semantics as crun (chunks in arrival order, 128+N exit codes,
``kill`` of the whole tree) and needs no root. Never a product path: nothing outside tests constructs it.

Knobs for failure tests: ``fail_create`` (bool, or an exception to raise) makes the next creates fail;
``simulate_exit(handle, code)`` / ``simulate_oom(handle)`` make ``state`` report a stopped sandbox;
``fail_checkpoint`` / ``fail_restore`` make those fail; ``checkpoint_delay`` slows checkpoints down.
``oom_kills`` counts what the integer in the sandbox's file ``oom_kills`` says, so a test command can play the
memory cgroup's OOM killer (``echo 1 > oom_kills; kill -9 $$`` run with ``cwd="/"``).

Checkpoint/restore keeps the sandbox's files (moved into the image) but, unlike CRIU, not its processes:
commands still running are killed. Unit tests use it for the agent's and control plane's logic only.

State lives on disk, not in the instance: each sandbox has a record in ``<root>/.meta/<id>.json`` (its
spec, pid and status), so a fresh ``FakeRuntime`` over the same root finds the same sandboxes, as a
restarted agent finds crun's (the runtime contract suite, tests/contract, checks both the same way).
Commands in flight are the one thing a fresh instance does not know (they belong to the instance that
started them); ``destroy`` through any instance removes the sandbox's files and record.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterable
from dataclasses import asdict, dataclass
from pathlib import Path

import anyio

from pilldrops.node.isolation.execproc import PipeExec
from pilldrops.node.isolation.rmtree import remove_tree_quietly
from pilldrops.node.runtime.base import Handle, RuntimeFailure, RuntimeState, SandboxSpec

_HOST_ENV_KEEP = ("PATH", "LANG", "LC_ALL", "TMPDIR")


@dataclass
class _Sandbox:
    spec: SandboxSpec
    dir: Path
    pid: int
    status: str = "running"
    oom: bool = False
    exit_code: int | None = None


class FakeRuntime:
    """Sandboxes as temp dirs under ``root`` (a fresh temp dir by default)."""

    name = "fake"

    def __init__(self, root: Path | None = None, *, fail_create: bool | BaseException = False,
                 checkpoint: bool = True) -> None:
        self._own_root = root is None
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="pilldrops-fake-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self._meta = self.root / ".meta"
        self._meta.mkdir(exist_ok=True)
        self.fail_create = fail_create
        self._boxes: dict[str, _Sandbox] = {}
        self._execs: dict[str, list[PipeExec]] = {}
        self._load()
        self._pids = itertools.count(max([b.pid + 1 for b in self._boxes.values()], default=100_000))
        self.checkpoint_supported = checkpoint
        self.fail_checkpoint = False
        self.fail_restore = False
        self.checkpoint_delay = 0.0
        self.create_delay = 0.0            # seconds each create takes (concurrency tests)
        self.create_calls = 0
        self.creating_now = 0
        self.max_concurrent_creates = 0

    # -- the on-disk records (state from facts) ----------------------------------------------------
    def _load(self) -> None:
        for f in sorted(self._meta.glob("*.json")):
            try:
                rec = json.loads(f.read_text())
                spec = SandboxSpec(**{**rec["spec"], "layers": tuple(Path(p) for p in rec["spec"]["layers"])})
                self._boxes[spec.id] = _Sandbox(spec=spec, dir=self.root / spec.id, pid=rec["pid"],
                                                status=rec["status"], oom=rec["oom"], exit_code=rec["exit_code"])
            except (OSError, ValueError, KeyError, TypeError):
                f.unlink(missing_ok=True)      # a torn write: the sandbox it described never finished

    def _save(self, box: _Sandbox) -> None:
        rec = {"spec": {**asdict(box.spec), "layers": [str(p) for p in box.spec.layers]}, "pid": box.pid,
               "status": box.status, "oom": box.oom, "exit_code": box.exit_code}
        tmp = self._meta / f"{box.spec.id}.tmp"
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, self._meta / f"{box.spec.id}.json")

    def _reread(self, sandbox_id: str) -> _Sandbox | None:
        """The sandbox as its record says now (another instance may have changed or removed it)."""
        try:
            rec = json.loads((self._meta / f"{sandbox_id}.json").read_text())
        except (OSError, ValueError):
            self._boxes.pop(sandbox_id, None)
            return None
        box = self._boxes.get(sandbox_id)
        if box is None:
            self._load()
            return self._boxes.get(sandbox_id)
        box.status, box.oom, box.exit_code = rec["status"], rec["oom"], rec["exit_code"]
        return box

    def _forget(self, sandbox_id: str) -> _Sandbox | None:
        (self._meta / f"{sandbox_id}.json").unlink(missing_ok=True)
        return self._boxes.pop(sandbox_id, None)

    async def create(self, spec: SandboxSpec) -> Handle:
        self.create_calls += 1
        self.creating_now += 1
        self.max_concurrent_creates = max(self.max_concurrent_creates, self.creating_now)
        try:
            if self.create_delay:
                await anyio.sleep(self.create_delay)
            return self._create(spec)
        finally:
            self.creating_now -= 1

    def _create(self, spec: SandboxSpec) -> Handle:
        if self.fail_create:
            if isinstance(self.fail_create, BaseException):
                raise self.fail_create
            raise RuntimeFailure(f"fake create of {spec.id} failed", detail="fail_create is set")
        if spec.id in self._boxes:
            raise RuntimeFailure(f"sandbox {spec.id} already exists")
        d = self.root / spec.id
        d.mkdir(parents=True)
        (d / spec.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        pid = next(self._pids)
        self._boxes[spec.id] = box = _Sandbox(spec=spec, dir=d, pid=pid)
        self._save(box)
        return Handle(id=spec.id, pid=pid, pid_start_time=pid, bundle=str(d))

    def _box(self, handle: Handle) -> _Sandbox:
        box = self._boxes.get(handle.id)
        if box is None:
            raise RuntimeFailure(f"sandbox {handle.id} does not exist")
        return box

    async def exec(self, handle: Handle, argv: list[str], *, env: dict[str, str], cwd: str | None,
                   stdin: AsyncIterable[bytes] | bytes | None = None, timeout: float | None = None,
                   output_cap: int | None = None, user: str | None = None,
                   pid_late: bool = False) -> PipeExec:
        box = self._box(handle)
        if box.status != "running":
            raise RuntimeFailure(f"sandbox {handle.id} is not running")
        if not argv:
            raise RuntimeFailure("exec needs a non-empty argv")
        workdir = box.dir / (cwd or box.spec.workdir).lstrip("/")
        if not workdir.is_dir():
            raise RuntimeFailure(f"cwd {cwd!r} does not exist in sandbox {handle.id}")
        full_env = {k: os.environ[k] for k in _HOST_ENV_KEEP if k in os.environ}
        full_env.update(box.spec.envs)
        full_env.update(env)
        try:
            proc = PipeExec(list(argv), stdin=stdin, env=full_env, cwd=workdir, timeout=timeout,
                            output_cap=output_cap)
        except OSError as e:           # like crun exec: the runtime reports, the command exits 127
            raise RuntimeFailure(f"cannot exec {argv[0]!r}", detail=str(e)) from e
        self._execs.setdefault(handle.id, []).append(proc)
        return proc

    def oom_kills(self, handle: Handle) -> int | None:
        try:
            return int((self._box(handle).dir / "oom_kills").read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def running_by_pid(self, handle: Handle) -> bool:
        return False        # no cheaper check than ``state`` here

    async def state(self, handle: Handle) -> RuntimeState:
        box = self._reread(handle.id)
        if box is None:
            return RuntimeState(status="gone")
        if box.status == "running":
            return RuntimeState(status="running", pid=box.pid, oom_killed=box.oom)
        return RuntimeState(status="stopped", oom_killed=box.oom, exit_code=box.exit_code)

    async def destroy(self, handle: Handle) -> None:
        box = self._forget(handle.id)
        for proc in self._execs.pop(handle.id, []):
            await proc.kill()
        if box is not None:
            await anyio.to_thread.run_sync(remove_tree_quietly, box.dir)

    async def list_ids(self) -> list[str]:
        return sorted(f.stem for f in self._meta.glob("*.json"))

    def checkpoint_unsupported(self) -> str | None:
        return None if self.checkpoint_supported else "the fake runtime was made with checkpoint=False"

    async def checkpoint(self, handle: Handle, image_dir: Path) -> int:
        box = self._box(handle)
        if self.checkpoint_delay:
            await anyio.sleep(self.checkpoint_delay)
        if self.fail_checkpoint:
            raise RuntimeFailure(f"fake checkpoint of {handle.id} failed", detail="fail_checkpoint is set")
        for proc in self._execs.pop(handle.id, []):
            await proc.kill()
        (image_dir / "spec.json").write_text(json.dumps({"id": box.spec.id, "hostname": box.spec.hostname}))
        shutil.move(str(box.dir), image_dir / "fs")
        self._forget(handle.id)
        return sum(f.stat().st_size for f in image_dir.rglob("*") if f.is_file())

    async def restore(self, spec: SandboxSpec, image_dir: Path) -> Handle:
        if self.fail_restore:
            raise RuntimeFailure(f"fake restore of {spec.id} failed", detail="fail_restore is set")
        if spec.id in self._boxes:
            raise RuntimeFailure(f"sandbox {spec.id} already exists")
        if json.loads((image_dir / "spec.json").read_text())["id"] != spec.id:
            raise RuntimeFailure(f"image in {image_dir} is not of {spec.id}")
        d = self.root / spec.id
        shutil.copytree(image_dir / "fs", d, symlinks=True)     # the image stays intact (retryable)
        pid = next(self._pids)
        self._boxes[spec.id] = box = _Sandbox(spec=spec, dir=d, pid=pid)
        self._save(box)
        return Handle(id=spec.id, pid=pid, pid_start_time=pid, bundle=str(d))

    # -- test knobs ----------------------------------------------------------------------------
    async def simulate_exit(self, handle: Handle, code: int = 0) -> None:
        """The sandbox's init exited: every command dies, ``state`` says stopped with ``code``."""
        box = self._box(handle)
        box.status, box.exit_code = "stopped", code
        self._save(box)
        for proc in self._execs.pop(handle.id, []):
            await proc.kill()

    async def simulate_oom(self, handle: Handle) -> None:
        """The sandbox was OOM-killed: stopped, ``oom_killed`` true, exit code 137."""
        self._box(handle).oom = True
        await self.simulate_exit(handle, 137)     # saves the record, oom included

    async def close(self) -> None:
        for sid in list(self._boxes):
            await self.destroy(Handle(id=sid))
        if self._own_root:
            remove_tree_quietly(self.root)
