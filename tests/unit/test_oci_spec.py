"""oci_spec.build_spec is pure: namespaces, capabilities, seccomp rules, limits, mounts, env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pilldrops.node.runtime import oci_spec
from pilldrops.node.runtime.base import SandboxSpec


def build(**kw) -> dict:  # type: ignore[no-untyped-def]
    spec = SandboxSpec(id="sb-1", layers=(Path("/l"),), **kw)
    return oci_spec.build_spec(spec, rootfs=Path("/s/rootfs"), init_path=Path("/d/bin/pd-init"),
                               cgroup_parent="pilldrops-test", template_env={"LANG": "C.UTF-8", "A": "t"})


def test_namespaces_root_cgroup_path() -> None:
    c = build()
    json.dumps(c)                                           # serialisable
    assert {n["type"] for n in c["linux"]["namespaces"]} == {"pid", "mount", "network", "ipc", "uts", "cgroup"}
    assert all("path" not in n for n in c["linux"]["namespaces"])
    assert c["root"] == {"path": "/s/rootfs", "readonly": False}
    assert c["linux"]["cgroupsPath"] == "/pilldrops-test/sb-1"
    assert c["process"]["args"] == [oci_spec.INIT_PATH_IN_SANDBOX]
    assert c["process"]["terminal"] is False and c["process"]["noNewPrivileges"] is True


def test_limits_computed() -> None:
    r = build(vcpu=1.5, memory_mb=256, pids_limit=64)["linux"]["resources"]
    assert r["cpu"] == {"quota": 150_000, "period": 100_000}
    assert r["memory"] == {"limit": 256 << 20, "swap": 256 << 20}
    assert r["pids"] == {"limit": 64}
    assert build(vcpu=0.25)["linux"]["resources"]["cpu"]["quota"] == 25_000
    for bad in ({"vcpu": 0}, {"memory_mb": 0}, {"pids_limit": -1}):
        with pytest.raises(ValueError):
            build(**bad)


def test_capabilities_docker_default_minus_net_raw_and_mknod() -> None:
    caps = build()["process"]["capabilities"]
    want = {"CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_SETGID", "CAP_SETUID",
            "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE"}
    for k in ("bounding", "effective", "permitted"):
        assert set(caps[k]) == want
    assert caps["inheritable"] == [] and caps["ambient"] == []


def test_seccomp_rules() -> None:
    sc = build()["linux"]["seccomp"]
    assert sc["defaultAction"] == "SCMP_ACT_ALLOW"
    assert set(sc["architectures"]) == {"SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"}
    denied = {n for r in sc["syscalls"] if "args" not in r and r["errnoRet"] == 1 for n in r["names"]}
    for name in ("keyctl", "bpf", "mount", "umount2", "unshare", "setns", "ptrace" if False else "kcmp",
                 "perf_event_open", "userfaultfd", "open_by_handle_at", "process_vm_readv", "reboot",
                 "init_module", "pivot_root", "syslog", "move_mount", "fsopen"):
        assert name in denied, name
    clone3 = [r for r in sc["syscalls"] if r["names"] == ["clone3"]]
    assert clone3 == [{"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]
    clone_bits = {r["args"][0]["value"] for r in sc["syscalls"] if r["names"] == ["clone"]}
    assert clone_bits == {0x20000, 0x2000000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000}
    for r in sc["syscalls"]:
        if r["names"] == ["clone"]:
            a = r["args"][0]
            assert a["op"] == "SCMP_CMP_MASKED_EQ" and a["value"] == a["valueTwo"] and a["index"] == 0


def test_personality_rules_allow_exactly_dockers_values() -> None:
    allowed = {0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF}
    for x in allowed:
        assert oci_spec.personality_allowed(x)
    for x in (0x1, 0x4, 0x10, 0x40000, 0x20009, 0x80000000, 0x7FFFFFFF, 0xFFFFFFFE, 0x0400000):
        assert not oci_spec.personality_allowed(x), hex(x)


def test_paths_and_mounts() -> None:
    c = build()
    assert c["linux"]["maskedPaths"] == ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                                         "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug",
                                         "/sys/firmware", "/proc/scsi", "/sys/devices/virtual/powercap"]
    assert c["linux"]["readonlyPaths"] == ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                                           "/proc/sysrq-trigger"]
    m = {x["destination"]: x for x in c["mounts"]}
    assert set(m) == {"/proc", "/dev", "/dev/pts", "/dev/shm", "/dev/mqueue", "/sys", "/sys/fs/cgroup",
                      oci_spec.INIT_PATH_IN_SANDBOX}
    assert "ro" in m["/sys"]["options"] and {"nosuid", "noexec", "nodev"} <= set(m["/sys"]["options"])
    assert "ro" in m["/sys/fs/cgroup"]["options"]
    assert any(o.startswith("size=") for o in m["/dev/shm"]["options"])
    init = m[oci_spec.INIT_PATH_IN_SANDBOX]
    assert init["source"] == "/d/bin/pd-init" and "ro" in init["options"] and "bind" in init["options"]


def test_env_cwd_hostname_rlimits() -> None:
    c = build(envs={"A": "spec", "B": "b"}, workdir="/home/user", hostname="h1")
    env = dict(e.split("=", 1) for e in c["process"]["env"])
    assert env["PATH"] == oci_spec.DEFAULT_PATH and env["LANG"] == "C.UTF-8"
    assert env["A"] == "spec" and env["B"] == "b"            # spec.envs win over the template env
    assert c["process"]["cwd"] == "/home/user" and c["hostname"] == "h1"
    assert c["process"]["rlimits"] == [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}]
    spec = SandboxSpec(id="x", layers=())
    c2 = oci_spec.build_spec(spec, rootfs=Path("/r"), init_path=Path("/i"), cgroup_parent="p", nofile=20000)
    assert c2["process"]["rlimits"][0]["hard"] == 20000


def test_gvisor_command_cgroups_give_pd_init_alone_cap_sys_admin_and_mount() -> None:
    """gVisor's config for pd-init's cgroup per command (issue 16 part 3): ``--cgroups``, CAP_SYS_ADMIN in
    pd-init's effective and permitted sets but never the bounding set (what it execs never gets it), mount
    and umount2 let through seccomp (gVisor then gates them on that capability), every other rule kept, and
    the shared profile untouched."""
    from pilldrops.node.runtime.gvisor import MOUNT_SYSCALLS, with_command_cgroups
    before = json.dumps(oci_spec.seccomp_profile(), sort_keys=True)
    c = with_command_cgroups(build())
    assert c["process"]["args"] == [oci_spec.INIT_PATH_IN_SANDBOX, "--cgroups"]
    caps = c["process"]["capabilities"]
    assert "CAP_SYS_ADMIN" in caps["effective"] and "CAP_SYS_ADMIN" in caps["permitted"]
    assert "CAP_SYS_ADMIN" not in caps["bounding"] + caps["inheritable"] + caps["ambient"]
    assert caps["bounding"] == oci_spec.CAPABILITIES
    denied = {n for r in c["linux"]["seccomp"]["syscalls"] for n in r["names"] if r["action"] == "SCMP_ACT_ERRNO"}
    assert denied == set(oci_spec.DENIED_SYSCALLS) - set(MOUNT_SYSCALLS) | {"clone3", "clone", "personality"}
    assert {"unshare", "setns", "pivot_root", "fsopen"} <= denied
    assert json.dumps(oci_spec.seccomp_profile(), sort_keys=True) == before
    assert all(r["names"] for r in c["linux"]["seccomp"]["syscalls"])


def test_gvisor_exec_process_never_has_pd_inits_cap_sys_admin() -> None:
    """``runsc exec``'s process.json (the fallback without pd-init's socket): a root command gets the
    bounding set, a non-root one no capability, neither pd-init's CAP_SYS_ADMIN, nothing inheritable."""
    from pilldrops.node.runtime.gvisor import exec_process, with_command_cgroups
    c = with_command_cgroups(build())
    root = exec_process(c, ["sh", "-c", "x"], {"A": "1"}, "/w")
    assert root["args"] == ["sh", "-c", "x"] and root["env"] == ["A=1"] and root["cwd"] == "/w"
    assert root["user"] == {"uid": 0, "gid": 0} and root["noNewPrivileges"] is True
    caps = root["capabilities"]
    assert caps["effective"] == caps["permitted"] == caps["bounding"] == oci_spec.CAPABILITIES
    assert caps["inheritable"] == caps["ambient"] == []
    other = exec_process(c, ["id"], {}, "/", user="1000:1001")
    assert other["user"] == {"uid": 1000, "gid": 1001}
    assert other["capabilities"]["effective"] == other["capabilities"]["permitted"] == []
    assert other["capabilities"]["bounding"] == oci_spec.CAPABILITIES
    with pytest.raises(ValueError):
        exec_process(c, ["id"], {}, "/", user="nobody")
