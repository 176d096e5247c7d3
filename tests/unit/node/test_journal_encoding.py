"""Journal entries written with orjson (``_internal.jsonfile``) hold what ``json.dump(asdict(entry))`` wrote:
the same values for a reader with ``json.loads``, the stdlib's own output where orjson refuses a value, and
entries an older agent wrote (ASCII-escaped by the stdlib) read back the same."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest

from pilldrops._internal import jsonfile
from pilldrops.node.journal import Entry, Journal, handle_record
from pilldrops.node.runtime.base import Handle

ODD = {"PLAIN": "x", "LATIN": "é ü", "CJK": "沙箱", "EMOJI": "🦀", "CTRL": "a\nb\t\x00\x1f\"\\", "LONE": "\ud800z"}


def entry(sid: str = "sb_enc", envs: dict[str, str] | None = None) -> Entry:
    handle = Handle(id=sid, pid=4242, pid_start_time=987654321, bundle=f"/var/lib/pd/{sid}",
                    extra={"cgroup": f"/pilldrops-n/{sid}", "crun_root": "/var/lib/pd/crun"})
    spec = {"id": sid, "template": "tiny", "vcpu": 0.25, "memory_mb": 128, "envs": envs or {},
            "end_at": "2030-01-01T00:00:00Z", "access_token": "t", "disk_mb": None, "network": None}
    return Entry(id=sid, phase="running", spec=spec, handle=handle_record(handle),
                 started_at="2029-12-31T23:59:00+00:00", started_mono=12345.678901234, boot_id="b-1",
                 end_reason="killed", ended_mono=12400.5)


def test_the_record_is_asdicts_output() -> None:
    e = entry(envs=ODD)
    assert e.record() == dataclasses.asdict(e)
    assert list(e.record()) == [f.name for f in dataclasses.fields(Entry)]
    h = Handle(id="x", pid=1, pid_start_time=2, bundle="/b", extra={"k": "v"})
    record = handle_record(h)
    assert record == {**dataclasses.asdict(h), "version": 1}
    record["extra"]["k"] = "changed"
    assert h.extra == {"k": "v"}          # the handle's own dict is not the record's


@pytest.mark.parametrize("envs", [{}, ODD], ids=["ascii", "odd"])
def test_a_written_entry_reads_as_the_stdlib_wrote_it(tmp_path: Path, envs: dict[str, str]) -> None:
    journal = Journal(tmp_path / "journal")
    e = entry(envs=envs)
    journal.write(e)
    path = tmp_path / "journal" / "sb_enc.json"
    assert json.loads(path.read_bytes()) == json.loads(json.dumps(dataclasses.asdict(e)))
    assert journal.entries() == [e]
    assert not list((tmp_path / "journal").glob("*.tmp"))


def test_an_older_agents_entry_reads_the_same(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal")
    e = entry(envs=ODD)
    with open(tmp_path / "journal" / "sb_enc.json", "w") as f:      # what agents before orjson wrote
        json.dump(dataclasses.asdict(e), f)
    assert journal.entries() == [e]
    journal.remove_ended("sb_enc")                                  # journaled teardown: dropped
    assert journal.entries() == []


def test_remove_ended_keeps_a_live_entry(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal")
    live = dataclasses.replace(entry(), end_reason=None, ended_mono=None)
    journal.write(live)
    journal.remove_ended(live.id)
    assert journal.entries() == [live]
    journal.remove(live.id)
    journal.remove(live.id)                  # twice: already gone is fine
    assert journal.entries() == []


@pytest.mark.parametrize("value", [
    {"a": [1, 2.5, None, True, "x"], "b": {"c": -(2**63)}, "d": 2**64 - 1},
    ODD,
    {"big": 2**70},                          # orjson refuses: the stdlib writes it
    {1: "int key", "s": "x"},                # orjson refuses: the stdlib writes it as "1"
    ["\udfff"],                              # a lone surrogate: the stdlib's \\udfff escape
])
def test_dumps_reads_back_as_the_stdlib_wrote_it(value: object) -> None:
    assert json.loads(jsonfile.dumps(value)) == json.loads(json.dumps(value))


def test_dumps_refuses_what_the_stdlib_refused() -> None:
    with pytest.raises(TypeError):
        jsonfile.dumps({"p": Path("/x")})


def test_write_bytes_creates_truncates_and_honours_the_umask(tmp_path: Path) -> None:
    p = tmp_path / "f.json"
    old = os.umask(0o027)
    try:
        jsonfile.write_bytes(p, b"x" * 100_000)
        jsonfile.write_bytes(p, b"{}")
    finally:
        os.umask(old)
    assert p.read_bytes() == b"{}"
    assert stat.S_IMODE(p.stat().st_mode) == 0o640
