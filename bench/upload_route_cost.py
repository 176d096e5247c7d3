"""CPU of the file write's and the archive upload's HTTP edge on the node: the raw route
(``node/uploadroute.py``) against the FastAPI routes it fronts, in the same process and minutes; or this
tree against another (``--ab-src``, e.g. main's), each as it serves the two routes.

    .venv/bin/python bench/upload_route_cost.py [--n 2000] [--rounds 7] [--whole 300] [--crun]
    .venv/bin/python bench/upload_route_cost.py --ab-src /path/to/main/src [--rounds 8] [--n 1000] ...

No root, no crun (but with ``--crun``): one control plane (SQLite) and one node agent in-process on the fake
runtime (``tests/stack.py``), one sandbox. Each request is one direct ASGI call of the node's whole app (its
middlewares included: what uvicorn calls), with the SDK's headers and a body given in parts as uvicorn gives
them: a 1 KiB ``files.write`` (one part) and a 60 KiB ``upload`` tar of three files (four parts). ``raw`` is
the app as served; ``fastapi`` is the same app without the raw route in front, so the difference is the
framework's share. Rounds alternate the two (``--ab-src``: one subprocess per tree and round, alternated).

1. Framework only: ``DataPlane.write_file`` / ``put_archive`` stubbed (they read the body through and
   answer a fixed ``FileInfo`` / count), ``--n`` requests per round.
2. Whole call: the real data plane, ``--whole`` requests per round: on the fake runtime (a host ``sh`` per
   call: its fork and the exec's threads are in the figure), or with ``--crun`` (root) on a real crun
   sandbox of the ``tiny`` template through pd-init (the node's own path; the sandbox's side is not in this
   process's CPU).

Prints the median µs of CPU (``process_time``: this process, all its threads) per request over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pilldrops.node.api import create_node_app
from pilldrops.node.dataplane import DataPlane, Target
from pilldrops.schema.api import FileInfo
from tests.stack import TOKEN, stack
from tests.unit.rawroutes import without

FILE = b"x" * 1024


def _tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for i in range(3):
            ti = tarfile.TarInfo(f"env/f{i}.py")
            data = bytes([65 + i]) * 16000
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    return buf.getvalue()          # 60 KiB


TAR = _tar()
BODIES = {"files": [FILE], "archive": [TAR[i:i + 16384] for i in range(0, len(TAR), 16384)]}
CTYPE = {"files": b"application/octet-stream", "archive": b"application/x-tar"}


def _scope(path: str, tail: str, dest: str, token: str) -> dict[str, Any]:
    size = sum(map(len, BODIES[tail]))
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "PUT", "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": f"path={dest}".encode(), "server": ("127.0.0.1", 8001), "client": ("127.0.0.1", 50000),
            "headers": [(b"host", b"127.0.0.1:8001"), (b"user-agent", b"pilldrops-python/0.1 python-httpx/0.28.1"),
                        (b"accept", b"*/*"), (b"accept-encoding", b"gzip, deflate"), (b"connection", b"keep-alive"),
                        (b"x-access-token", token.encode()), (b"content-type", CTYPE[tail]),
                        (b"content-length", str(size).encode())]}


def _receiver(parts: list[bytes]) -> Any:
    """An ASGI ``receive`` giving ``parts`` as uvicorn gives a body."""
    it = iter(enumerate(parts, 1))

    async def receive() -> dict[str, Any]:
        i, part = next(it)
        return {"type": "http.request", "body": part, "more_body": i < len(parts)}

    return receive


async def _calls(app: Any, sid: str, tail: str, dest: str, token: str, n: int) -> float:
    """µs of CPU per request over ``n`` direct ASGI calls of ``app``."""
    status: list[int] = []
    parts = BODIES[tail]

    async def send(msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            status.append(msg["status"])

    t = time.process_time()
    for _ in range(n):
        await app(_scope(f"/v1/sandboxes/{sid}/{tail}", tail, dest, token), _receiver(parts), send)
    dt = time.process_time() - t
    assert status == [200] * n, status[:3]
    return dt / n * 1e6


async def _drained(body: AsyncIterable[bytes]) -> int:
    n = 0
    async for chunk in body:
        n += len(chunk)
    return n


async def _parts(tail: str) -> AsyncIterator[bytes]:
    for p in BODIES[tail]:
        yield p


async def _service(call: Any, tail: str, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        await call(tail)
    return (time.process_time() - t) / n * 1e6


async def _rounds(apps: dict[str, Any], sid: str, token: str, dest: dict[str, str], n: int, rounds: int,
                  extra: dict[str, Any] | None = None) -> dict[str, list[float]]:
    cases = [(f"{tail} {kind}", app, tail) for tail in ("files", "archive") for kind, app in apps.items()]
    for _, app, tail in cases:         # warm up (FastAPI builds its stack on the first call)
        await _calls(app, sid, tail, dest[tail], token, min(n, 100))
    out: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    out.update({k: [] for k in extra or {}})
    for r in range(rounds):
        for name, app, tail in (cases if r % 2 == 0 else list(reversed(cases))):
            out[name].append(await _calls(app, sid, tail, dest[tail], token, n))
            await anyio.sleep(0.05)       # (untimed) the loop's own tasks run: heartbeats, ...
        for k, (call, tail) in (extra or {}).items():
            out[k].append(await _service(call, tail, n))
    return out


@contextlib.asynccontextmanager
async def _crun_target() -> AsyncIterator[tuple[DataPlane, Target]]:
    from pilldrops.node.isolation.host import prepare_host
    from pilldrops.node.runtime.base import Handle, SandboxSpec
    from pilldrops.node.runtime.crun import CrunRuntime
    from pilldrops.node.runtime.init import build_init
    from pilldrops.node.templates import TemplateStore

    prepare_host()
    with tempfile.TemporaryDirectory(prefix="pilldrops-bench-upload-") as d:
        data = Path(d)
        tiny = TemplateStore(data).ensure("tiny")
        rt = CrunRuntime(data / "state", name=f"bupr{os.getpid()}", init_path=build_init(data))
        h = await rt.create(SandboxSpec(id="bench-upload", layers=tiny.layers, workdir=tiny.workdir))
        try:
            yield DataPlane(rt), Target(id=h.id, handle=h, workdir=tiny.workdir)
        finally:
            await rt.destroy(Handle(id=h.id))
            await rt.close()


async def measure(n: int, rounds: int, whole: int, crun: bool, served_only: bool) -> dict[str, list[float]]:
    """µs of CPU per request, per round: ``{files,archive} {raw,fastapi}`` (or ``... served``: the app as
    this tree serves it, whichever its routes are), stubbed; the same prefixed ``whole`` for the whole call;
    ``service {files,archive}``: the stubs alone."""
    info = FileInfo(name="x.txt", path="/tmp/x.txt", type="file", size=len(FILE), mode=0o644, mtime=1754000000.0)
    real_write, real_put = DataPlane.write_file, DataPlane.put_archive

    async def write_file(self: DataPlane, t: Target, path: str, body: AsyncIterable[bytes]) -> FileInfo:
        await _drained(body)
        return info

    async def put_archive(self: DataPlane, t: Target, dest: str, body: AsyncIterable[bytes], **kw: Any) -> int:
        await _drained(body)
        return 3

    async def service(tail: str) -> None:
        await (write_file(None, None, "/tmp/x.txt", _parts(tail)) if tail == "files"   # type: ignore[arg-type]
               else put_archive(None, None, "/up", _parts(tail)))                        # type: ignore[arg-type]

    with tempfile.TemporaryDirectory() as tmp:
        async with stack(Path(tmp)) as st, st.client() as c:
            sb = (await c.post("/v1/sandboxes", json={"template": "tiny"})).json()
            sid, token = sb["id"], sb["access_token"]
            if served_only:
                apps = {"served": create_node_app(st.agent, TOKEN)}
            else:
                from pilldrops.node.uploadroute import UploadRoute
                apps = {"raw": create_node_app(st.agent, TOKEN),
                        "fastapi": without(create_node_app(st.agent, TOKEN), UploadRoute)}
            DataPlane.write_file, DataPlane.put_archive = write_file, put_archive   # type: ignore[method-assign]
            try:
                out = await _rounds(apps, sid, token, {"files": "/tmp/x.txt", "archive": "/up"}, n, rounds,
                                    {"service files": (service, "files"), "service archive": (service, "archive")})
            finally:
                DataPlane.write_file, DataPlane.put_archive = real_write, real_put  # type: ignore[method-assign]
            if not whole:
                return out
            async with contextlib.AsyncExitStack() as stack_:
                if crun:
                    plane, target = await stack_.enter_async_context(_crun_target())

                    async def w(self: DataPlane, t: Target, path: str, body: AsyncIterable[bytes]) -> FileInfo:
                        return await real_write(plane, target, path, body)

                    async def p(self: DataPlane, t: Target, dest: str, body: AsyncIterable[bytes], **kw: Any) -> int:
                        return await real_put(plane, target, dest, body, **kw)

                    DataPlane.write_file, DataPlane.put_archive = w, p   # type: ignore[method-assign]
                    dest = {"files": "/root/x.txt", "archive": "/root/up"}
                else:
                    dest = {"files": f"{tmp}/w/x.txt", "archive": f"{tmp}/up"}
                try:
                    out.update({f"whole {k}": v for k, v in (await _rounds(apps, sid, token, dest, whole, rounds)).items()})
                finally:
                    DataPlane.write_file, DataPlane.put_archive = real_write, real_put  # type: ignore[method-assign]
            return out


def _print(out: dict[str, list[float]], a: str, b: str) -> None:
    """Medians (min-max) of every figure, and ``b`` against ``a`` (e.g. fastapi -> raw, main -> this tree)."""
    med = {k: statistics.median(v) for k, v in out.items()}
    for k, v in out.items():
        print(f"  {k:28s} {med[k]:9.1f}   ({min(v):.1f}-{max(v):.1f})")
    for tail in ("files", "archive"):
        if f"service {tail}" in med:
            s = med[f"service {tail}"]
            x, y = med[f"{tail} {a}"] - s, med[f"{tail} {b}"] - s
            print(f"  {tail}: framework share per request {a} {x:.1f} -> {b} {y:.1f} µs ({y / x:.2f}x)")
        if f"whole {tail} {a}" in med:
            x, y = med[f"whole {tail} {a}"], med[f"whole {tail} {b}"]
            print(f"  {tail}: whole call {a} {x:.1f} -> {b} {y:.1f} µs ({y / x:.2f}x, {x - y:.1f} µs less)")


def ab(other_src: str, n: int, rounds: int, whole: int, crun: bool) -> None:
    """This tree against ``other_src`` (e.g. main's ``src``), each as it serves the two routes: one
    subprocess per tree and round, alternated."""
    here = str(Path(__file__).resolve().parents[1] / "src")
    out: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, src in ((("main", other_src), ("this", here)) if r % 2 == 0 else
                          (("this", here), ("main", other_src))):
            argv = [sys.executable, __file__, "--as-served", "--n", str(n), "--rounds", "1", "--whole", str(whole)]
            done = subprocess.run([*argv, *(["--crun"] if crun else [])], env={**os.environ, "PYTHONPATH": src},
                                  capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{name} ({src}) failed:\n{done.stderr[-3000:]}")
            for k, v in json.loads(done.stdout.splitlines()[-1]).items():
                out.setdefault(k.replace("served", name) if "service" not in k else f"{k} ({name})", []).extend(v)
    for tail in ("files", "archive"):
        out[f"service {tail}"] = out.pop(f"service {tail} (this)") + out.pop(f"service {tail} (main)")
    print(f"{other_src} (main) against this tree, {rounds} rounds alternated, {n} stubbed and {whole} whole calls "
          "per round; median µs of CPU per request (min-max):")
    _print(out, "main", "this")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--whole", type=int, default=300, help="requests per round of the whole call (0: none)")
    ap.add_argument("--crun", action="store_true", help="the whole call on a real crun sandbox (root)")
    ap.add_argument("--ab-src", help="another tree's src (e.g. main's): it against this one, as each serves")
    ap.add_argument("--as-served", action="store_true", help=argparse.SUPPRESS)   # one A/B round, as JSON
    a = ap.parse_args()
    if a.ab_src:
        ab(a.ab_src, a.n, a.rounds, a.whole, a.crun)
        return
    out = anyio.run(measure, a.n, a.rounds, a.whole, a.crun, a.as_served)
    if a.as_served:
        print(json.dumps(out))
        return
    print(f"{a.n} stubbed and {a.whole} whole calls x {a.rounds} rounds (whole: "
          f"{'a real crun sandbox, tiny, through pd-init' if a.crun else 'the fake runtime, a host sh per call'}); "
          "median µs of CPU per request (min-max):")
    _print(out, "fastapi", "raw")


if __name__ == "__main__":
    main()
