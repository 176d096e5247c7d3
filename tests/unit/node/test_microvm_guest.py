"""Pure pieces of the microVM runtime: guest-RAM size classes, content-keyed root disks, the newc cpio
writer (checked against the format's fixed-width header), and the QEMU command line's invariants."""

from __future__ import annotations

from pathlib import Path

from pilldrops.node.runtime.microvm import guest, vm
from pilldrops.node.runtime.qemu import guest_ram_mb


def test_guest_ram_classes_hold_the_limit() -> None:
    assert [guest_ram_mb(m) for m in (16, 256, 257, 512, 1000, 4096)] == [256, 256, 512, 512, 1024, 4096]


def test_root_disk_key_is_the_template_content_not_its_path(tmp_path: Path) -> None:
    def layer(root: Path, name: str, h: str) -> Path:
        d = root / "templates" / name / h / "layer"
        d.mkdir(parents=True)
        (d.parent / "manifest.json").write_text("{}")
        return d
    a, b = layer(tmp_path / "data1", "tiny", "abc"), layer(tmp_path / "data2", "tiny", "abc")
    other = layer(tmp_path / "data3", "tiny", "def")
    assert guest.image_key([a], 1024) == guest.image_key([b], 1024)        # two data dirs, one disk
    assert guest.image_key([a], 1024) != guest.image_key([other], 1024)
    assert guest.image_key([a], 1024) != guest.image_key([a], 2048)
    loose = tmp_path / "loose"
    loose.mkdir()
    assert guest.image_key([loose], 1024) != guest.image_key([a], 1024)    # no manifest: by path


def test_cpio_newc_layout() -> None:
    data = guest._cpio([("init", 0o100755, b"#!/bin/sh\n"), ("bin", 0o040755, b"")])
    assert data.startswith(b"070701")
    namesize = int(data[94:102], 16)
    assert data[110:110 + namesize] == b"init\0"
    filesize = int(data[54:62], 16)
    assert filesize == len(b"#!/bin/sh\n")
    assert b"TRAILER!!!\0" in data and len(data) % 4 == 0


def test_command_line_invariants(tmp_path: Path) -> None:
    cfg = vm.VmConfig(kernel="/k", initrd="/i", memory_mb=256, smp=1, accel="tcg", tag="pilldrops-x-y")
    cmd = vm.command(cfg, tmp_path, disk=tmp_path / "disk.qcow2", console=None, incoming=tmp_path / "it's.snap")
    assert "-daemonize" in cmd and str(tmp_path / "qemu.pid") in cmd    # never the agent's child
    assert cmd[cmd.index("-serial") + 1] == "null"                       # a sandbox's console goes nowhere
    assert "tsc_early_khz" in cmd[cmd.index("-append") + 1]
    assert cmd[cmd.index("-incoming") + 1] == f"exec:cat '{tmp_path}/it'\\''s.snap'"
    kvm = vm.command(vm.VmConfig(**{**cfg.__dict__, "accel": "kvm"}), tmp_path, disk=tmp_path / "d",
                     console=None, incoming=None)
    assert "tsc_early_khz" not in kvm[kvm.index("-append") + 1] and "-incoming" not in kvm
