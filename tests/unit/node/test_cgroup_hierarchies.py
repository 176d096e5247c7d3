"""``cgroups.hierarchies`` reads the mount table once, not per kill (issue 15: 3 mount lines per sandbox)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pilldrops.node.isolation import cgroups


def test_the_mount_table_is_read_again_only_when_the_cgroup_root_changes(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    scans: list[int] = []

    def scan() -> list[Path]:
        scans.append(1)
        return sorted(tmp_path / n for n in ("cpu", "memory"))

    (tmp_path / "cpu").mkdir()
    (tmp_path / "memory").mkdir()
    monkeypatch.setattr(cgroups, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(cgroups, "_scan", scan)
    cgroups.forget()
    first = cgroups.hierarchies()
    assert first == [tmp_path / "cpu", tmp_path / "memory"]
    first.append(tmp_path / "x")                        # a caller's list is its own
    assert cgroups.hierarchies() == [tmp_path / "cpu", tmp_path / "memory"] and len(scans) == 1
    (tmp_path / "cpu" / "sb").mkdir()
    assert cgroups.cgroup_dirs("/sb/") == [tmp_path / "cpu" / "sb"] and len(scans) == 1
    (tmp_path / "hugetlb").mkdir()                      # a hierarchy mounted on a new directory
    cgroups.hierarchies()
    assert len(scans) == 2
    cgroups.forget()                                    # prepare_host mounted one on an existing directory
    cgroups.hierarchies()
    assert len(scans) == 3
    cgroups.forget()


def test_the_real_scan_matches_the_cache() -> None:
    cgroups.forget()
    assert cgroups.hierarchies() == cgroups._scan()
