"""Issue 16 part 2: a disk quota per sandbox. ``dd`` past ``disk_mb`` fails with ENOSPC inside the sandbox
(``/`` and ``/tmp`` alike) and nothing else on the node notices; uploads (compressed, sparse members)
count at the size they unpack to and fail with ``disk_quota_exceeded`` before anything is written; the
disk goes with the sandbox, survives an agent restart (re-adopted) and a pause/resume; the API resolves
request > template > deployment default and refuses past the deployment's maximum with a typed 400.

The runtime cases drive the real crun runtime (and gVisor where runsc is installed); the API cases a
control plane + node agent in-process on the FakeRuntime (tests/stack.py).
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from pilldrops import errors
from pilldrops.node.dataplane import DataPlane, Target
from pilldrops.node.isolation import diskquota
from pilldrops.node.runtime.base import Handle, SandboxSpec
from tests.hostile._crun_fixtures import *
from tests.hostile._crun_fixtures import SESSION, sh
from tests.stack import stack

pytestmark = pytest.mark.anyio
MiB = 1 << 20


def spec(tiny, sid: str, disk_mb: int | None = 64) -> SandboxSpec:  # type: ignore[no-untyped-def]
    return SandboxSpec(id=sid, layers=tiny.layers, workdir=tiny.workdir, disk_mb=disk_mb)


def real_bytes(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def sparse_tar(tmp_path: Path, size: int) -> None:
    """``tmp_path/s.tar``: a GNU sparse member of ``size`` bytes with one real byte."""
    with open(tmp_path / "sparse", "wb") as f:
        f.truncate(size)
        f.write(b"x")
    subprocess.run(["tar", "-S", "-C", str(tmp_path), "-cf", str(tmp_path / "s.tar"), "sparse"], check=True)


async def chunks(data: bytes, size: int = 1 << 16):  # type: ignore[no-untyped-def]
    for i in range(0, len(data), size):
        yield data[i:i + size]


# -- the mechanism ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("disk_mb", [16, 64, 1024, 10_240])
def test_image_holds_at_least_disk_mb_and_little_more(hd_data_dir: Path, tmp_path: Path, disk_mb: int) -> None:
    d = tmp_path / f"sb{disk_mb}"
    d.mkdir()
    diskquota.make(hd_data_dir / "state", d, disk_mb)
    try:
        st = os.statvfs(d / diskquota.MOUNT)
        usable = st.f_bavail * st.f_frsize
        assert disk_mb * MiB <= usable <= disk_mb * MiB * 1.01 + 4 * MiB, usable / MiB
        assert real_bytes(d / diskquota.IMAGE) < 2 * MiB          # sparse: the host holds what is written
        # the per-mount kernel memory the node does without (bench/RESULTS.md, issue 15 session 7)
        line = next(ln.split() for ln in Path("/proc/self/mountinfo").read_text().splitlines()
                    if ln.split()[4] == str(d / diskquota.MOUNT))
        assert "nombcache" in line[line.index("-") + 3].split(","), line
    finally:
        diskquota.remove(d)


# -- crun -------------------------------------------------------------------------------------------------
@pytest.mark.integration
async def test_writes_past_disk_mb_fail_with_enospc_and_nothing_else_notices(crun_rt, tiny) -> None:  # type: ignore[no-untyped-def]
    a = await crun_rt.create(spec(tiny, "disk-a"))
    b = await crun_rt.create(spec(tiny, "disk-b"))
    try:
        for target in ("/big", "/tmp/big"):
            code, _, err, _ = await sh(crun_rt, a, f"dd if=/dev/zero of={target} bs=1M count=200", timeout=60)
            assert code != 0 and "No space left on device" in err, (code, err)
            await sh(crun_rt, a, f"rm -f {target}", timeout=30)
        code, _, err, _ = await sh(crun_rt, a, "dd if=/dev/zero of=/big bs=1M count=200; df -k /", timeout=60)
        used = crun_rt.disk_usage(a, 64)
        assert used is not None and 60 * MiB <= used.used_bytes <= 69 * MiB, used
        assert used.limit_bytes == 64 * MiB
        image = Path(a.bundle) / diskquota.IMAGE
        assert real_bytes(image) <= 72 * MiB           # the host's disk holds what the sandbox wrote, no more
        # the neighbour (and the host) go on writing
        assert (await sh(crun_rt, b, "dd if=/dev/zero of=/x bs=1M count=20 && echo ok", timeout=60))[1].endswith("ok\n")
        # the space comes back when the sandbox deletes
        await sh(crun_rt, a, "rm /big", timeout=30)
        assert crun_rt.disk_usage(a, 64).used_bytes < 2 * MiB
    finally:
        await crun_rt.destroy(a)
        await crun_rt.destroy(b)
    assert not Path(a.bundle).exists()


@pytest.mark.integration
async def test_a_spare_disk_holds_the_same_limit_and_goes_with_its_sandbox(crun_rt, tiny) -> None:  # type: ignore[no-untyped-def]
    """Disks made ahead (isolation.diskspares, issue 15): a create takes a ready one by a rename; past its
    size every write fails with ENOSPC as on a disk made on the create path; the sandbox's kill removes it
    and the runtime's close the spares still ready (the leak check: no mount or loop device is left)."""
    import anyio
    crun_rt.disk_spares.keep = 2
    first = await crun_rt.create(spec(tiny, "spare-0"))          # a miss: made on the create path
    assert (crun_rt.disk_spares.hits, crun_rt.disk_spares.misses) == (0, 1)
    with anyio.fail_after(30):
        while len(crun_rt.disk_spares._ready.get(64, ())) < 2:
            await anyio.sleep(0.05)
    a = await crun_rt.create(spec(tiny, "spare-a"))
    try:
        assert crun_rt.disk_spares.hits == 1
        assert diskquota.backing_device(Path(a.bundle) / diskquota.MOUNT) is not None
        code, _, err, _ = await sh(crun_rt, a, "dd if=/dev/zero of=/big bs=1M count=200", timeout=60)
        assert code != 0 and "No space left on device" in err, (code, err)
        assert crun_rt.disk_usage(a, 64).limit_bytes == 64 * MiB
        code, out, _, _ = await sh(crun_rt, a, "cat /etc/machine-id; ls -A /", timeout=30)
        assert code == 0 and len(out.split()[0]) == 32
    finally:
        await crun_rt.destroy(a)
        await crun_rt.destroy(first)
    assert not Path(a.bundle).exists()


@pytest.mark.integration
async def test_spares_are_kept_for_the_last_few_sizes_only(crun_rt) -> None:  # type: ignore[no-untyped-def]
    """A client asking for ever new ``disk_mb`` makes no more than MAX_SIZES x keep spare disks (each one a
    mount and a loop device of the host's): a size that falls off the last few asked has its spares removed;
    a killed agent's spares go at the next start (``reap``)."""
    import anyio

    from pilldrops.node.isolation.diskspares import MAX_SIZES

    sp = crun_rt.disk_spares
    stale = sp.root / "16-previouslife"
    stale.mkdir(parents=True)
    diskquota.make(sp.state_dir, stale, 16)          # what a killed agent left: mounted, a loop device
    sp.reap()
    assert not stale.exists()
    sp.keep = 1
    sizes = [16 + i for i in range(MAX_SIZES + 3)]
    for mb in sizes:
        assert not sp.take(mb, crun_rt.state_dir / f"never-{mb}")    # a first ask of a size is a miss
        with anyio.fail_after(30):
            while len(sp._ready.get(mb, ())) < 1:
                await anyio.sleep(0.02)
    kept = sizes[-MAX_SIZES:]
    sp.refill()
    with anyio.fail_after(30):
        while sorted(int(p.name.split("-")[0]) for p in sp.root.iterdir()) != kept:
            await anyio.sleep(0.05)
    assert sorted(sp._ready) == kept
    # the crun_rt fixture's close removes the rest; the leak check: no mount or loop device is left


@pytest.mark.integration
async def test_uploads_count_at_their_real_size(crun_rt, tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    h = await crun_rt.create(spec(tiny, "disk-up"))
    plane, t = DataPlane(crun_rt), Target(id=h.id, handle=h)
    try:
        # a 1 GiB sparse file: a tar of a few KiB (GNU sparse member)
        sparse_tar(tmp_path, 1 << 30)
        small = (tmp_path / "s.tar").read_bytes()
        assert len(small) < 64 * 1024
        before = crun_rt.disk_usage(h).used_bytes
        with pytest.raises(errors.DiskQuotaExceeded) as e:
            await plane.put_archive(t, "/root/up", chunks(small))
        assert e.value.code == "disk_quota_exceeded" and e.value.details["free_bytes"] <= 69 * MiB
        assert crun_rt.disk_usage(h).used_bytes - before < MiB        # refused before anything was written
        # gzip of 200 MiB of zeros (200 KiB on the wire)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            info = tarfile.TarInfo("zeros")
            info.size = 200 * MiB
            tf.addfile(info, io.BytesIO(bytes(info.size)))
        gz = gzip.compress(buf.getvalue())
        assert len(gz) < MiB
        with pytest.raises(errors.DiskQuotaExceeded):
            await plane.put_archive(t, "/root/up", chunks(gz))
        # one that fits is unpacked and counted at its unpacked size
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            info = tarfile.TarInfo("ten")
            info.size = 10 * MiB
            tf.addfile(info, io.BytesIO(os.urandom(info.size)))
        assert await plane.put_archive(t, "/root/up", chunks(gzip.compress(buf.getvalue()))) == 1
        assert crun_rt.disk_usage(h).used_bytes - before >= 10 * MiB
        # a single-file write past the disk: typed too, and the sandbox keeps working
        with pytest.raises(errors.DiskQuotaExceeded):
            await plane.write_file(t, "/root/huge", chunks(bytes(100 * MiB), 1 << 20))
        assert (await sh(crun_rt, h, "rm -f /root/huge; echo ok", timeout=30))[:2] == (0, "ok\n")
    finally:
        await crun_rt.destroy(h)


@pytest.mark.integration
async def test_disk_survives_an_agent_restart_and_goes_with_the_sandbox(crun_rt, tiny, hd_data_dir, hd_init) -> None:  # type: ignore[no-untyped-def]
    from pilldrops.node.runtime.crun import CrunRuntime
    h = await crun_rt.create(spec(tiny, "disk-re"))
    assert (await sh(crun_rt, h, "echo keep > /root/f", timeout=30))[0] == 0
    # a restarted agent: a new runtime instance over the same state dir adopts the sandbox as it is
    again = CrunRuntime(hd_data_dir / "state", name=SESSION, init_path=hd_init)
    adopted = Handle(id=h.id, pid=h.pid, pid_start_time=h.pid_start_time, bundle=h.bundle, extra=h.extra)
    assert (await sh(again, adopted, "cat /root/f", timeout=30))[1] == "keep\n"
    code, _, err, _ = await sh(again, adopted, "dd if=/dev/zero of=/big bs=1M count=100", timeout=60)
    assert code != 0 and "No space left" in err
    assert again.disk_usage(adopted, 64) is not None
    # its loop device, found from stat + sysfs (not the mount table): the same one the mount table names
    mnt = Path(h.bundle) / "disk"
    dev = diskquota.backing_device(mnt)
    mountinfo = Path("/proc/self/mountinfo").read_text().splitlines()
    named = [ln.split()[ln.split().index("-") + 2] for ln in mountinfo if ln.split()[4] == str(mnt)]
    assert dev is not None and dev.startswith("/dev/loop") and named == [dev]
    assert diskquota.backing_device(Path(h.bundle) / "rootfs") is None      # an overlay: no block device
    await again.destroy(adopted)
    assert not Path(h.bundle).exists() and diskquota.backing_device(Path(h.bundle) / "disk") is None
    # (the autouse leak check asserts no loop device or mount of this session is left)


@pytest.mark.integration
async def test_pause_resume_keeps_the_disk_and_its_limit(crun_rt, tiny, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    why = crun_rt.checkpoint_unsupported()
    if why:
        pytest.skip(f"checkpoint: {why}")
    h = await crun_rt.create(spec(tiny, "disk-ck"))
    assert (await sh(crun_rt, h, "dd if=/dev/zero of=/root/ten bs=1M count=10 2>/dev/null; echo ok",
                     timeout=30))[1] == "ok\n"
    img = tmp_path / "img"
    img.mkdir()
    size = await crun_rt.checkpoint(h, img)
    assert (img / diskquota.IMAGE).is_file() and not (img / "upper").exists()
    assert size >= 10 * MiB
    h2 = await crun_rt.restore(spec(tiny, "disk-ck"), img)
    try:
        assert (await sh(crun_rt, h2, "wc -c < /root/ten", timeout=30))[1].strip() == str(10 * MiB)
        code, _, err, _ = await sh(crun_rt, h2, "dd if=/dev/zero of=/big bs=1M count=100", timeout=60)
        assert code != 0 and "No space left" in err
    finally:
        await crun_rt.destroy(h2)


@pytest.mark.integration
async def test_gvisor_writes_past_disk_mb_fail_with_enospc(gvisor_rt, tiny) -> None:  # type: ignore[no-untyped-def]
    """Under gVisor the writable layer is the same host disk; /tmp is runsc's own tmpfs there (memory,
    bounded by memory_mb), so the case writes to /root."""
    h = await gvisor_rt.create(spec(tiny, "disk-gv"))
    try:
        code, _, err, _ = await sh(gvisor_rt, h, "dd if=/dev/zero of=/root/big bs=1M count=200", timeout=120)
        assert code != 0 and "No space left on device" in err, (code, err)
        assert 60 * MiB <= gvisor_rt.disk_usage(h, 64).used_bytes <= 69 * MiB
    finally:
        await gvisor_rt.destroy(h)


# -- the API ------------------------------------------------------------------------------------------------
async def test_api_resolves_disk_mb_and_refuses_past_the_maximum(tmp_path: Path) -> None:
    async with stack(tmp_path, templates=("tiny", "big"), max_disk_mb=40_960) as st, st.client() as c:
        tpls = st.agent.templates   # the fake store: give "big" a template default
        tpls.items["big"] = dataclasses.replace(tpls.items["big"], disk_mb=20_480)
        await st.agent.control_plane.heartbeat()      # the nodes report it

        def disk_of(sid: str) -> int | None:
            return st.runtime._boxes[sid].spec.disk_mb

        r = await c.post("/v1/sandboxes", json={"template": "tiny"})
        assert r.status_code == 201 and r.json()["disk_mb"] == 10_240 and disk_of(r.json()["id"]) == 10_240
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "disk_mb": 64})
        assert r.status_code == 201 and r.json()["disk_mb"] == 64 and disk_of(r.json()["id"]) == 64
        got = (await c.get(f"/v1/sandboxes/{r.json()['id']}")).json()
        assert got["disk_mb"] == 64
        r = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "disk_mb": 128, "count": 2})
        assert r.status_code == 200, r.text
        assert [disk_of(i["sandbox"]["id"]) for i in r.json()["items"]] == [128, 128]
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "disk_mb": 50_000})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_request" and err["details"]["max_disk_mb"] == 40_960
        r = await c.post("/v1/sandboxes/batch", json={"template": "tiny", "disk_mb": 50_000, "count": 2})
        assert r.status_code == 400 or all(i.get("error") for i in r.json()["items"]), r.text
        r = await c.post("/v1/sandboxes", json={"template": "tiny", "disk_mb": 8})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


async def test_template_default_disk_mb(tmp_path: Path) -> None:
    async with stack(tmp_path, templates=("tiny",)) as st:
        tpls = st.agent.templates
        tpls.items["tiny"] = dataclasses.replace(tpls.items["tiny"], disk_mb=20_480)
        infos = st.agent.template_cache.refresh()
        assert [i.disk_mb for i in infos] == [20_480]
        await st.agent.control_plane.heartbeat()
        async with st.client() as c:
            r = await c.post("/v1/sandboxes", json={"template": "tiny"})
            assert r.status_code == 201, r.text
            assert st.runtime._boxes[r.json()["id"]].spec.disk_mb == 20_480


def test_template_spec_disk_mb(tmp_path: Path) -> None:
    from pilldrops.node.templates import TemplateSpecError, parse_spec
    ok = tmp_path / "ok.toml"
    ok.write_text('name = "ok"\nfrom = "busybox"\ndisk_mb = 2048\n')
    assert parse_spec(ok).disk_mb == 2048
    for bad in ("0", "true", '"10"', "99999999999"):
        p = tmp_path / "bad.toml"
        p.write_text(f'name = "bad"\nfrom = "busybox"\ndisk_mb = {bad}\n')
        with pytest.raises(TemplateSpecError):
            parse_spec(p)


def test_sanitize_counts_members_at_their_unpacked_size(tmp_path: Path) -> None:
    """No root needed: the sanitizer refuses once the members' sizes pass what the disk has left, before
    reading the rest (a sparse member at its full size, a gzip'd one decompressed)."""
    from pilldrops.node.archive import sanitize
    sparse_tar(tmp_path, 1 << 30)
    with (open(tmp_path / "s.tar", "rb") as src, open(tmp_path / "out.tar", "wb") as dst,
          pytest.raises(errors.DiskQuotaExceeded) as e):
        sanitize(src, dst, max_bytes=64 * MiB)
    assert e.value.details == {"free_bytes": 64 * MiB, "member": "sparse"}
    assert (tmp_path / "out.tar").stat().st_size < MiB                # nothing of it was written out
    sparse_tar(tmp_path, 8 * MiB)
    with open(tmp_path / "s.tar", "rb") as src, open(tmp_path / "out.tar", "wb") as dst:
        assert sanitize(src, dst, max_bytes=9 * MiB) == 1               # fits: passes, at its full size
    assert (tmp_path / "out.tar").stat().st_size >= 8 * MiB
