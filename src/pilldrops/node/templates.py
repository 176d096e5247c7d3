"""Templates: declarative TOML specs built into cached, read-only overlay layers.

A spec (``src/pilldrops/templates/<name>.toml``)::

    name = "code-interpreter"
    description = "..."
    from = "base"                  # a parent template, or a builder: "busybox" | "debootstrap"
    workdir = "/home/user"
    isolation = "gvisor"           # optional: the default isolation of its sandboxes (container | gvisor |
                                   # microvm; a create's own `isolation` wins; not inherited, not hashed)
    disk_mb = 20480                # optional: the default disk (writable layer) of its sandboxes in MiB (a
                                   # create's own `disk_mb` wins; else the deployment's; not inherited/hashed)
    [network]                      # optional: the default egress of its sandboxes (a create's own fields
    allow_internet_access = true   # win; not inherited, not hashed; build steps never have network)
    allow_out = ["10.0.0.0/8"]
    deny_out = ["10.1.0.0/16"]
    [env]
    LANG = "C.UTF-8"
    [[steps]]
    run = "apt-get update && ..."  # or: copy = {src = "file", dest = "/x"} (src relative to the spec)
                                   #     env = {K = "V"} / workdir = "/dir"  (affect later steps + result)

Each template is ONE layer dir on top of its parent's layers. A builder writes the layer directly; a
child runs its steps in a chroot over an overlay (lower = parent layers, upper = the new layer), so
deletions stay as overlay whiteouts (char 0/0) that keep working when the layer is used as a lower.
Layers live at ``<data_dir>/templates/<name>/<hash>/{layer,manifest.json}``; the hash covers the spec,
copied files and the parent's hash, so any change rebuilds. A build happens in a temp dir renamed into
place at the end (a crash never leaves a half template visible), under a per-template file lock.
Building needs root (chroot, mount). The ``debootstrap`` builder fetches from the Debian mirror named by
``$PILLDROPS_APT_MIRROR``, else from the one this machine's apt sources use (``apt_mirror``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import subprocess
import time
import tomllib
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pilldrops.errors import TemplateNotFound
from pilldrops.node.isolation.mounts import MS_BIND, mount, mount_overlay, umount_all_under
from pilldrops.node.rootfs_ops import copy_entries, in_root, mkdirs_owned, resolve_user, tree_entries
from pilldrops.schema.api import DISK_MB_CAP, ISOLATION_MODES, MIN_DISK_MB, TemplateNetwork

log = logging.getLogger("pilldrops.templates")
BUILDERS = ("busybox", "debootstrap")
BUILDER_VERSION = "1"          # bump to force rebuilds when builder code changes its output
SPEC_DIR = Path(__file__).resolve().parent.parent / "templates"
MIRROR_ENV = "PILLDROPS_APT_MIRROR"     # the Debian mirror for debootstrap, when apt's sources name none
APT_SOURCES = Path("/etc/apt")
DEFAULT_SUITE = "bookworm"
BUILD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")

Progress = Callable[[str], None]


class TemplateSpecError(ValueError):
    """A template spec file is invalid; the message names the file and the problem."""


class TemplateBuildError(RuntimeError):
    """A build step failed. ``str()`` is one line: what failed and the last line it printed; ``output``
    holds the tail of its output, ``exit_code`` the failed command's status and ``log_path`` (when set)
    the file with the whole build log."""

    def __init__(self, message: str, output: str = "", log_path: Path | None = None) -> None:
        last = next((ln.strip() for ln in reversed(output.splitlines()) if ln.strip()), "")
        self.message = f"{message}: {last[:300]}" if last else message
        super().__init__(self.message)
        self.output = output
        self.log_path = log_path
        self.exit_code: int | None = None

    def __str__(self) -> str:
        return self.message + (f" (full log: {self.log_path})" if self.log_path else "")


@dataclass(frozen=True)
class Step:
    kind: str                     # run | copy | env | workdir | user (user: Dockerfile templates)
    value: Any
    origin: str = ""              # where it came from, for messages ("Dockerfile:12 RUN"); not hashed
    line: int = 0


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    description: str
    base: str                     # the "from" field
    env: dict[str, str]
    workdir: str | None
    steps: tuple[Step, ...]
    path: Path
    isolation: str | None = None  # default isolation mode of its sandboxes (not part of the layer hash)
    disk_mb: int | None = None    # default disk size of its sandboxes in MiB (not part of the layer hash)
    network: dict[str, Any] | None = None   # default egress of its sandboxes ([network]; not hashed)
    context: Path | None = None   # copy srcs are relative to this (Dockerfile templates); else to path's folder
    fixed_hash: str | None = None  # a recorded spec (built from a Dockerfile): its hash as built

    @property
    def is_builder(self) -> bool:
        return self.base in BUILDERS or self.base.startswith("debootstrap:")

    @property
    def root(self) -> Path:
        """The folder copy sources are relative to."""
        return self.context if self.context is not None else self.path.parent

    def canonical(self) -> dict[str, Any]:
        return {"name": self.name, "from": self.base, "env": self.env, "workdir": self.workdir,
                "steps": [[s.kind, s.value] for s in self.steps]}


@dataclass(frozen=True)
class Template:
    name: str
    layers: tuple[Path, ...]      # top first, ready for SandboxSpec.layers
    env: dict[str, str]
    workdir: str
    hash: str
    size: int = 0                 # bytes of every layer (this one and its parents'): what a sandbox sees
    built_at: float = 0.0
    user: str | None = None       # "uid:gid" its commands run as (a Dockerfile's USER); None = root
    home: str | None = None       # that user's home (HOME of its commands)


@dataclass(frozen=True)
class TemplateStatus:
    name: str
    description: str
    base: str
    hash: str
    built: bool
    extra: dict[str, Any] = field(default_factory=dict)
    isolation: str | None = None
    disk_mb: int | None = None
    network: dict[str, Any] | None = None


# -- spec parsing ---------------------------------------------------------------------------------
_TOP_KEYS = {"name", "description", "from", "env", "workdir", "steps", "isolation", "disk_mb", "network"}


def _str_map(v: Any, where: str) -> dict[str, str]:
    if not isinstance(v, dict) or not all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()):
        raise TemplateSpecError(f"{where}: must be a table of strings")
    return dict(v)


def parse_spec(path: Path) -> TemplateSpec:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise TemplateSpecError(f"{path}: {e}") from e
    return spec_from_dict(data, path)


def spec_document(spec: TemplateSpec) -> dict[str, Any]:
    """The spec as a plain dict in the shape of its TOML file (what a remote build sends, and what a
    Dockerfile becomes): the inverse of :func:`spec_from_dict`."""
    return {"name": spec.name, "description": spec.description, "from": spec.base, "env": dict(spec.env),
            "workdir": spec.workdir, "isolation": spec.isolation, "disk_mb": spec.disk_mb,
            "network": dict(spec.network) if spec.network is not None else None,
            "steps": [{s.kind: s.value} for s in spec.steps]}


_USER_RE = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]*(:[A-Za-z0-9_.][A-Za-z0-9_.-]*)?$")
_COPY_EXTRA = {"entries", "chown", "chmod", "extract"}     # a Dockerfile's COPY/ADD (node/dockerfile.py)


def _rel_ok(p: str) -> bool:
    return not p.startswith("/") and ".." not in p.split("/") and "\0" not in p


def _check_copy(value: Any, where: str, path: Path) -> dict[str, Any]:
    if (not isinstance(value, dict) or not {"src", "dest"} <= set(value) or set(value) - {"src", "dest"} - _COPY_EXTRA
            or not isinstance(value["src"], str) or not isinstance(value["dest"], str) or not value["dest"]):
        raise TemplateSpecError(f"{where}: 'copy' must be {{src = \"rel\", dest = \"/abs\"}}")
    if Path(value["src"]).is_absolute():
        rel = os.path.relpath(value["src"], path.resolve().parent)
        raise TemplateSpecError(
            f"{where}: copy src {value['src']!r} is absolute; write it relative to the spec file "
            f"(e.g. {rel!r}) so that the spec and its files can move together")
    entries = value.get("entries")
    # what a Dockerfile's COPY writes, relative to src: never outside it (the document may come from afar)
    if entries is not None and (not isinstance(entries, list) or not _rel_ok(value["src"])
                                or not all(isinstance(e, str) and _rel_ok(e) for e in entries)):
        raise TemplateSpecError(f"{where}: copy entries must be relative paths inside src")
    if "chown" in value and not (isinstance(value["chown"], str) and _USER_RE.match(value["chown"])):
        raise TemplateSpecError(f"{where}: copy chown must be user[:group]")
    if "chmod" in value and not (isinstance(value["chmod"], str) and re.fullmatch(r"[0-7]{3,4}", value["chmod"])):
        raise TemplateSpecError(f"{where}: copy chmod must be an octal mode")
    if "extract" in value and not isinstance(value["extract"], bool):
        raise TemplateSpecError(f"{where}: copy extract must be true or false")
    return dict(value)


def spec_from_dict(data: Any, path: Path, *, context: Path | None = None) -> TemplateSpec:
    """A spec from its document (a TOML file's table, a Dockerfile's translation, or a remote build's JSON).
    ``path`` names where it came from; copy sources are relative to ``context``, else to its folder.
    A step's ``workdir`` and a copy's ``dest`` may be relative: to the workdir in effect at that step."""
    path = Path(path)
    if not isinstance(data, dict):
        raise TemplateSpecError(f"{path}: a template spec must be a table")
    data = {k: v for k, v in data.items() if v is not None}     # a document's null = the key left out
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise TemplateSpecError(f"{path}: unknown keys {sorted(unknown)}")
    name = data.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise TemplateSpecError(f"{path}: 'name' must match {_NAME_RE.pattern}")
    base = data.get("from")
    if not isinstance(base, str) or not base:
        raise TemplateSpecError(f"{path}: 'from' must name a parent template or a builder {BUILDERS}")
    if base == name:
        raise TemplateSpecError(f"{path}: template cannot be built from itself")
    workdir = data.get("workdir")
    if workdir is not None and (not isinstance(workdir, str) or not workdir.startswith("/")):
        raise TemplateSpecError(f"{path}: 'workdir' must be an absolute path")
    isolation = data.get("isolation")
    if isolation is not None and isolation not in ISOLATION_MODES:
        raise TemplateSpecError(f"{path}: 'isolation' must be one of {', '.join(ISOLATION_MODES)}")
    disk_mb = data.get("disk_mb")
    if disk_mb is not None and (isinstance(disk_mb, bool) or not isinstance(disk_mb, int)
                                or not MIN_DISK_MB <= disk_mb <= DISK_MB_CAP):
        raise TemplateSpecError(f"{path}: 'disk_mb' must be an integer from {MIN_DISK_MB} to {DISK_MB_CAP}")
    network = _network(data.get("network"), path)
    steps = []
    for i, raw in enumerate(data.get("steps", [])):
        where = f"{path}: steps[{i}]"
        if not isinstance(raw, dict) or len(raw) != 1:
            raise TemplateSpecError(f"{where}: each step has exactly one of run/copy/env/workdir/user")
        (kind, value), = raw.items()
        if kind == "run":
            if not isinstance(value, str) or not value.strip():
                raise TemplateSpecError(f"{where}: 'run' must be a non-empty string")
        elif kind == "copy":
            value = _check_copy(value, where, path)
        elif kind == "env":
            value = _str_map(value, where)
        elif kind == "workdir":
            if not isinstance(value, str) or not value or "\0" in value:
                raise TemplateSpecError(f"{where}: 'workdir' must be a path")
        elif kind == "user":
            if not isinstance(value, str) or not _USER_RE.match(value):
                raise TemplateSpecError(f"{where}: 'user' must be name, uid, name:group or uid:gid")
        else:
            raise TemplateSpecError(f"{where}: unknown step kind {kind!r}")
        steps.append(Step(kind, value))
    return TemplateSpec(name=name, description=str(data.get("description", "")), base=base,
                        env=_str_map(data.get("env", {}), f"{path}: env"), workdir=workdir,
                        steps=tuple(steps), path=path.resolve(), isolation=isolation, disk_mb=disk_mb, network=network,
                        context=Path(context).resolve() if context is not None else None)


def _network(raw: Any, path: Path) -> dict[str, Any] | None:
    """The ``[network]`` table, validated like a create's fields (CIDRs normalised)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TemplateSpecError(f"{path}: [network] must be a table")
    try:
        return TemplateNetwork.model_validate(raw).model_dump()
    except ValueError as e:
        raise TemplateSpecError(f"{path}: [network]: {e}") from None


def _hash_path(h: Any, p: Path) -> None:
    if p.is_dir():
        for sub in sorted(p.rglob("*")):
            h.update(str(sub.relative_to(p)).encode())
            if sub.is_file():
                h.update(sub.read_bytes())
    elif p.exists():
        h.update(p.read_bytes())
    else:
        raise TemplateSpecError(f"copy source missing: {p} (copy src is relative to the spec's folder)")


def spec_hash(spec: TemplateSpec, parent_hash: str) -> str:
    if spec.fixed_hash:
        return spec.fixed_hash
    h = hashlib.sha256()
    h.update(json.dumps({"spec": spec.canonical(), "parent": parent_hash, "builder": BUILDER_VERSION},
                        sort_keys=True).encode())
    for s in spec.steps:
        if s.kind == "copy" and "entries" in s.value:       # exactly what it copies (a Dockerfile's COPY)
            src = spec.root / s.value["src"]
            for e in s.value["entries"]:
                h.update(b"\0" + e.encode())
                if not e.endswith("/"):
                    _hash_path(h, src / e if e else src)
        elif s.kind == "copy":
            _hash_path(h, spec.root / s.value["src"])
    return h.hexdigest()[:16]


DEBIAN_TEMPLATE = re.compile(r"^debian-([a-z]+)$")   # FROM debian:<suite> (not bookworm: that is `base`)


def debian_spec(name: str) -> TemplateSpec | None:
    """The implicit template ``debian-<suite>``: a debootstrap minbase of that suite, workdir /."""
    m = DEBIAN_TEMPLATE.match(name)
    if not m:
        return None
    return TemplateSpec(name=name, description=f"Debian {m.group(1)} minbase (debootstrap from this machine's "
                        "apt mirror)", base=f"debootstrap:{m.group(1)}", env={}, workdir="/", steps=(),
                        path=SPEC_DIR / f"{name}.implicit")


RECORDED_SPEC = "spec.json"   # <data>/templates/<name>/spec.json: a spec built from outside the spec dirs


def spec_to_json(spec: TemplateSpec, h: str) -> dict[str, Any]:
    return {"version": 1, "name": spec.name, "description": spec.description, "from": spec.base, "env": spec.env,
            "workdir": spec.workdir, "isolation": spec.isolation, "hash": h, "path": str(spec.path),
            "context": str(spec.context) if spec.context else None,
            "steps": [{"kind": st.kind, "value": st.value, "origin": st.origin, "line": st.line}
                      for st in spec.steps]}


def spec_from_json(d: dict[str, Any]) -> TemplateSpec:
    return TemplateSpec(name=d["name"], description=d.get("description", ""), base=d["from"], env=dict(d["env"]),
                        workdir=d.get("workdir"), isolation=d.get("isolation"), path=Path(d["path"]),
                        context=Path(d["context"]) if d.get("context") else None, fixed_hash=d["hash"],
                        steps=tuple(Step(st["kind"], st["value"], st.get("origin", ""), st.get("line", 0))
                                    for st in d["steps"]))


def apt_mirror(env: dict[str, str] | None = None, apt_dir: Path | None = None) -> str:
    """The Debian mirror to debootstrap from: ``$PILLDROPS_APT_MIRROR`` if set, else the one this machine's
    apt uses (deb822 ``debian.sources`` first, then other ``*.sources`` and ``sources.list`` files; security
    archives skipped). With neither, a ``TemplateBuildError`` says which variable to set."""
    env = os.environ if env is None else env
    if env.get(MIRROR_ENV):
        return env[MIRROR_ENV].rstrip("/")
    apt = apt_dir or APT_SOURCES
    d = apt / "sources.list.d"
    deb822 = sorted(d.glob("*.sources"), key=lambda p: (p.name != "debian.sources", p.name)) if d.is_dir() else []
    for src in deb822:
        for line in _read(src).splitlines():
            if line.startswith("URIs:"):
                for uri in line.split()[1:]:
                    uri = uri.rstrip("/")
                    if not uri.endswith("-security") and (src.name == "debian.sources" or uri.endswith("/debian")):
                        return uri
    lists = [apt / "sources.list", *(sorted(d.glob("*.list")) if d.is_dir() else [])]
    for lst in lists:
        for line in _read(lst).splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in line:
                uri = next((p for p in parts[1:] if "://" in p), None)
                if uri and (lst.name == "sources.list" or uri.rstrip("/").endswith("/debian")):
                    return uri.rstrip("/")
    raise TemplateBuildError(f"no Debian mirror: this machine's apt sources ({apt}) name none; set {MIRROR_ENV} "
                             f"to the URL of a Debian mirror (the one apt-get would use)")


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# -- build helpers ---------------------------------------------------------------------------------
def _run(argv: list[str], progress: Progress | None, *, env: dict[str, str] | None = None) -> None:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    for raw in proc.stdout:
        line = raw.decode(errors="replace").rstrip()
        tail = (tail + [line])[-80:]
        if progress:
            progress(line)
    if proc.wait() != 0:
        err = TemplateBuildError(f"command failed (exit {proc.returncode}): {' '.join(argv)[:300]}",
                                 "\n".join(tail))
        err.exit_code = proc.returncode
        raise err


def _layer_size(layer: Path) -> int:
    """A built layer's size from its manifest (``<hash>/layer`` next to ``<hash>/manifest.json``)."""
    try:
        return int(json.loads((layer.parent / "manifest.json").read_text())["size"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _tree_size(p: Path) -> int:
    total = 0
    for root, dirs, files in os.walk(p):
        for n in dirs + files:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return total


PROXY_VARS = ("http_proxy", "https_proxy", "ftp_proxy", "no_proxy", "all_proxy")
BUILD_CA = "/tmp/.pilldrops-build-ca.crt"    # the host's CA bundle, inside the chroot during steps only
BUILD_APT_CONF = "/etc/apt/apt.conf.d/99pilldrops-build"
CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT", "GIT_SSL_CAINFO",
          "NODE_EXTRA_CA_CERTS")


def host_proxy_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The host's proxy settings (both spellings), for build steps: a build behind a proxy works."""
    environ = dict(os.environ if environ is None else environ)
    out: dict[str, str] = {}
    for var in PROXY_VARS:
        value = environ.get(var) or environ.get(var.upper())
        if value:
            out[var] = out[var.upper()] = value
    return out


def host_ca_bundle(environ: dict[str, str] | None = None) -> Path | None:
    """The CA bundle the host trusts (a proxy's CA included): the one its env names, else the system one."""
    environ = dict(os.environ if environ is None else environ)
    for var in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"):
        if environ.get(var) and Path(environ[var]).is_file():
            return Path(environ[var])
    system = Path("/etc/ssl/certs/ca-certificates.crt")
    return system if system.is_file() else None


def build_step_env(env: dict[str, str], ca_in_root: bool) -> dict[str, str]:
    """What a ``run`` step sees: a fixed PATH/HOME, the host's proxies and CA bundle, then the spec's env."""
    out = {"PATH": BUILD_PATH, "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C",
           **host_proxy_env()}
    if ca_in_root:
        out.update({var: BUILD_CA for var in CA_ENV})
    return {**out, **env}


def _dir_in_root(root: Path, path: str) -> bool:
    try:
        return in_root(root, path).is_dir()
    except ValueError:          # a symlink loop a build step made: no such folder then
        return False


@contextmanager
def _host_network_settings(root: Path) -> Iterator[bool]:
    """The host's CA bundle at BUILD_CA and an apt config for its proxy and CA while the steps run; both are
    removed after them (a file made in the overlay's upper and removed again leaves nothing in the layer).
    Yields whether the CA bundle is in place."""
    made: list[Path] = []
    ca_in_root = False
    ca = host_ca_bundle()
    try:
        if ca is not None and _dir_in_root(root, "/tmp"):
            dest = in_root(root, BUILD_CA)         # inside root even if a parent's step made /tmp a symlink
            shutil.copyfile(ca, dest)
            made.append(dest)
            ca_in_root = True
        lines = [f'Acquire::{k.split("_")[0]}::Proxy "{v}";' for k, v in host_proxy_env().items()
                 if k in ("http_proxy", "https_proxy")]
        if ca_in_root:
            lines.append(f'Acquire::https::CAInfo "{BUILD_CA}";')
        if lines and _dir_in_root(root, posixpath.dirname(BUILD_APT_CONF)):
            conf = in_root(root, BUILD_APT_CONF)
            conf.write_text("\n".join(lines) + "\n")
            made.append(conf)
        yield ca_in_root
    finally:
        for f in made:
            f.unlink(missing_ok=True)


@contextmanager
def _chroot_mounts(root: Path) -> Iterator[None]:
    """proc + /dev + the host's resolv.conf inside ``root`` for the duration of the build steps. A parent
    template whose /proc, /dev or /etc is a symlink is refused: mounting there would mount on the host."""
    for d in ("proc", "dev", "etc"):
        if (root / d).is_symlink():
            raise TemplateBuildError(f"the template's /{d} is a symlink ({os.readlink(root / d)}): refused")
        (root / d).mkdir(exist_ok=True)
    resolv = root / "etc" / "resolv.conf"
    saved: tuple[str, bytes | str] | None = None
    if resolv.is_symlink():
        saved = ("link", os.readlink(resolv))
    elif resolv.exists():
        saved = ("file", resolv.read_bytes())
    try:
        mount(b"proc", root / "proc", b"proc", 0, None)
        mount(b"/dev", root / "dev", None, MS_BIND, None)
        if resolv.is_symlink() or resolv.exists():
            resolv.unlink()
        if Path("/etc/resolv.conf").exists():
            shutil.copyfile("/etc/resolv.conf", resolv)
        yield
    finally:
        umount_all_under(root / "dev")
        umount_all_under(root / "proc")
        if resolv.is_symlink() or resolv.exists():
            resolv.unlink()
        if saved and saved[0] == "link":
            os.symlink(saved[1], resolv)
        elif saved:
            resolv.write_bytes(saved[1])  # type: ignore[arg-type]


def _build_busybox(layer: Path, progress: Progress | None) -> None:
    busybox = Path("/bin/busybox")
    if not busybox.exists():
        raise TemplateBuildError("/bin/busybox missing: run `scripts/install-system-deps` (busybox-static)")
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "root", "home", "proc", "sys", "dev", "var/tmp"):
        (layer / d).mkdir(parents=True, exist_ok=True)
    (layer / "tmp").mkdir(exist_ok=True)
    os.chmod(layer / "tmp", 0o1777)
    os.chmod(layer / "root", 0o700)
    shutil.copy2(busybox, layer / "bin" / "busybox")
    _run(["chroot", str(layer), "/bin/busybox", "--install", "-s"], progress)
    (layer / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n")
    (layer / "etc" / "group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (layer / "etc" / "hostname").write_text("sandbox\n")


def _build_debootstrap(layer: Path, progress: Progress | None, suite: str = DEFAULT_SUITE) -> None:
    if not shutil.which("debootstrap"):
        raise TemplateBuildError("debootstrap missing: run `scripts/install-system-deps`")
    mirror = apt_mirror()
    if progress:
        progress(f"debootstrap --variant=minbase {suite} from {mirror}")
    _run(["debootstrap", "--variant=minbase", suite, str(layer), mirror], progress)
    for pattern in ("var/lib/apt/lists/*", "var/cache/apt/*.bin", "var/cache/apt/archives/*.deb"):
        for p in layer.glob(pattern):
            if p.is_file() or p.is_symlink():
                p.unlink()
            elif p.is_dir() and p.name != "partial":
                shutil.rmtree(p)


def user_spec_dir() -> Path:
    """Where users put their own template specs: ``~/.config/pilldrops/templates/*.toml``."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "pilldrops" / "templates"


def default_spec_dirs(extra: Sequence[Path] = ()) -> list[Path]:
    """The packaged specs, then the user's, then any given (later ones override same-named specs)."""
    env = [Path(p) for p in os.environ.get("PILLDROPS_TEMPLATES_DIR", "").split(":") if p]
    return [SPEC_DIR, user_spec_dir(), *env, *(Path(p) for p in extra)]


# -- the store ---------------------------------------------------------------------------------------
class TemplateStore:
    """Specs from ``spec_dirs`` (later dirs override earlier; default: the packaged templates), built
    layers under ``<data_dir>/templates``. ``build``/``ensure`` block (run them in a worker thread from
    async code) and need root."""

    def __init__(self, data_dir: Path, *, spec_dirs: Sequence[Path] | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.root = self.data_dir / "templates"
        self.spec_dirs = [Path(p) for p in (spec_dirs if spec_dirs is not None else default_spec_dirs())]
        self._logged_errors: dict[str, str] = {}

    def signature(self) -> tuple[tuple[str, float], ...]:
        """Cheap fingerprint of the built templates (changes when a template is built or rebuilt)."""
        try:
            return tuple(sorted((p.name, p.stat().st_mtime) for p in self.root.iterdir() if p.is_dir()))
        except OSError:
            return ()

    # specs
    def specs(self) -> dict[str, TemplateSpec]:
        """Every valid spec by name: the spec dirs' files, then the specs recorded by :meth:`build_spec`
        (Dockerfile templates) under names no file defines. A file that does not parse is skipped and kept
        in :attr:`spec_errors` (logged once): one bad spec never takes the other templates, or a node, down."""
        out: dict[str, TemplateSpec] = {}
        errors: dict[str, str] = {}
        for d in self.spec_dirs:
            for f in sorted(Path(d).glob("*.toml")):
                try:
                    s = parse_spec(f)
                except TemplateSpecError as exc:
                    errors[str(f)] = str(exc)
                    continue
                out[s.name] = s
        for f in sorted(self.root.glob(f"*/{RECORDED_SPEC}")) if self.root.is_dir() else ():
            if f.parent.name in out:
                continue
            try:
                rec = spec_from_json(json.loads(f.read_text()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                errors[str(f)] = f"{f}: unreadable recorded spec: {exc}"
                continue
            out[rec.name] = rec
        for path, err in errors.items():
            if self._logged_errors.get(path) != err:
                log.warning("skipping template spec %s: %s", path, err)
        self._logged_errors = errors
        return out

    @property
    def spec_errors(self) -> dict[str, str]:
        """The spec files skipped by the last :meth:`specs` call, with why."""
        return dict(self._logged_errors)

    def spec(self, name: str) -> TemplateSpec:
        specs = self.specs()
        if name not in specs:
            implicit = debian_spec(name)
            if implicit is not None:
                return implicit
            bad = "; ".join(self._logged_errors.values())
            raise TemplateNotFound(f"no template spec named {name!r}" + (f" (skipped invalid specs: {bad})" if bad
                                                                         else ""), details={"template": name})
        return specs[name]

    def hash(self, name: str, _seen: tuple[str, ...] = ()) -> str:
        return self._hash_of(self.spec(name), _seen)

    def _hash_of(self, s: TemplateSpec, _seen: tuple[str, ...] = ()) -> str:
        if s.name in _seen:
            raise TemplateSpecError(f"template cycle: {' -> '.join(_seen + (s.name,))}")
        if s.fixed_hash:
            return s.fixed_hash
        parent = f"builder:{s.base}" if s.is_builder else self.hash(s.base, _seen + (s.name,))
        return spec_hash(s, parent)

    # built templates
    def _final(self, name: str, h: str) -> Path:
        return self.root / name / h

    def get(self, name: str) -> Template:
        h = self.hash(name)
        manifest = self._final(name, h) / "manifest.json"
        if not manifest.exists():
            raise TemplateNotFound(f"template {name!r} is not built (hash {h}); build it with "
                                   f"TemplateStore.build({name!r})", details={"template": name, "hash": h})
        m = json.loads(manifest.read_text())
        layers = tuple(Path(p) for p in m["layers"])
        return Template(name=m["name"], layers=layers, env=m["env"], workdir=m["workdir"], hash=m["hash"],
                        size=sum(_layer_size(p) for p in layers), built_at=m["built_at"],
                        user=m.get("user"), home=m.get("home"))

    def list(self) -> list[TemplateStatus]:
        out = []
        for name, s in sorted(self.specs().items()):
            h = self.hash(name)
            out.append(TemplateStatus(name=name, description=s.description, base=s.base, hash=h,
                                      built=(self._final(name, h) / "manifest.json").exists(),
                                      isolation=s.isolation, disk_mb=s.disk_mb, network=s.network))
        return out

    def ensure(self, name: str, progress: Progress | None = None) -> Template:
        try:
            return self.get(name)
        except TemplateNotFound:
            if name not in self.specs() and debian_spec(name) is None:
                raise
            return self.build(name, progress=progress)

    def build(self, name: str, progress: Progress | None = None, *, force: bool = False) -> Template:
        return self._build(self.spec(name), progress, force=force)

    def build_spec(self, spec: TemplateSpec, progress: Progress | None = None, *, force: bool = False) -> Template:
        """Build a spec that is in no spec dir (a Dockerfile's, from ``node/dockerfile.py``) and record it under
        ``<data>/templates/<name>/spec.json``, so that ``get``/``list``/``ensure`` find it afterwards like any
        other template (with the hash it was built with: its build context may be gone by then)."""
        for d in self.spec_dirs:
            for f in sorted(Path(d).glob("*.toml")):
                try:
                    taken = parse_spec(f).name == spec.name
                except TemplateSpecError:
                    continue
                if taken:
                    raise TemplateSpecError(f"template name {spec.name!r} is taken by the spec file {f}; "
                                            "pick another name")
        if not _NAME_RE.match(spec.name):
            raise TemplateSpecError(f"template name {spec.name!r} must match {_NAME_RE.pattern}")
        if spec.base == spec.name:
            raise TemplateSpecError(f"template {spec.name!r} cannot be built from itself")
        return self._build(replace(spec, fixed_hash=None), progress, force=force, record=True)

    def _build(self, s: TemplateSpec, progress: Progress | None, *, force: bool, record: bool = False) -> Template:
        name = s.name
        record = record or debian_spec(name) is not None
        parent = None if s.is_builder else self.ensure(s.base, progress)
        h = self._hash_of(s) if not (force and s.fixed_hash) else s.fixed_hash
        final = self._final(name, h)
        (self.root / name).mkdir(parents=True, exist_ok=True)
        with open(self.root / name / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._reap_stale(self.root / name)
            if (final / "manifest.json").exists() and not force:
                if record:
                    self._record(s, h)
                return self.get(name)
            t0 = time.monotonic()
            if progress:
                progress(f"building template {name} ({h}) from {s.base}")
            tmp = self.root / name / f".tmp-{h}-{uuid.uuid4().hex[:8]}"
            log_path = self.root / name / "build.log"
            log = open(log_path, "w")   # the whole output of the last build; errors point to it
            logged = _tee(progress, log)
            try:
                try:
                    result = self._build_into(s, parent, tmp, logged)
                except TemplateBuildError as exc:
                    exc.log_path = log_path
                    raise
                layers = [str(final / "layer")] + ([str(p) for p in parent.layers] if parent else [])
                manifest = {"name": name, "hash": h, "layers": layers, "env": result.env,
                            "workdir": result.workdir, "user": result.user, "home": result.home,
                            "size": _tree_size(tmp / "layer"), "built_at": time.time(),
                            "build_seconds": round(time.monotonic() - t0, 3), "from": s.base}
                (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
                if final.exists():             # force rebuild: move the old one out of the way
                    old = self.root / name / f".old-{h}-{uuid.uuid4().hex[:8]}"
                    os.rename(final, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(tmp, final)
                if record:
                    self._record(s, h)
            finally:
                log.close()
                if tmp.exists():
                    umount_all_under(tmp)
                    shutil.rmtree(tmp, ignore_errors=True)
            if progress:
                progress(f"built template {name} in {time.monotonic() - t0:.2f}s")
            return self.get(name)

    @staticmethod
    def _reap_stale(folder: Path) -> None:
        """What a build of this template that was killed mid-way left (its ``.tmp-*`` dir, with the overlay,
        ``proc`` and ``dev`` still mounted; a ``.old-*`` of a forced rebuild): the caller holds the
        template's build lock, so no build of it is running and every such dir is stale."""
        for p in folder.iterdir():
            if p.is_dir() and not p.is_symlink() and p.name.startswith((".tmp-", ".old-")):
                umount_all_under(p)
                shutil.rmtree(p, ignore_errors=True)

    def _record(self, s: TemplateSpec, h: str) -> None:
        dest = self.root / s.name / RECORDED_SPEC
        tmp = dest.with_name(f".{RECORDED_SPEC}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(spec_to_json(s, h), indent=2))
        os.rename(tmp, dest)

    @staticmethod
    def _resolve_env(s: TemplateSpec, parent: Template | None) -> tuple[dict[str, str], str]:
        """The env and workdir of a spec whose steps did not run (a builder's)."""
        env = dict(parent.env) if parent else {}
        env.update(s.env)
        workdir = s.workdir or (parent.workdir if parent else "/")
        for st in s.steps:
            if st.kind == "env":
                env.update(st.value)
            elif st.kind == "workdir":
                workdir = posixpath.normpath(posixpath.join(workdir, st.value))
        return env, workdir

    def _build_into(self, s: TemplateSpec, parent: Template | None, tmp: Path,
                    progress: Progress | None) -> _Result:
        layer = tmp / "layer"
        layer.mkdir(parents=True)
        if parent is None:
            builder, _, suite = s.base.partition(":")
            if builder == "debootstrap":
                _build_debootstrap(layer, progress, suite or DEFAULT_SUITE)
            else:
                _build_busybox(layer, progress)
            return self._run_steps(s, None, layer, progress) if s.steps else _Result(*self._resolve_env(s, None),
                                                                                      None, None)
        work, merged = tmp / "work", tmp / "merged"
        work.mkdir()
        merged.mkdir()
        mount_overlay(merged, list(parent.layers), layer, work)
        try:
            result = self._run_steps(s, parent, merged, progress)
        finally:
            umount_all_under(merged)
        shutil.rmtree(work, ignore_errors=True)
        merged.rmdir()
        return result

    def _run_steps(self, s: TemplateSpec, parent: Template | None, root: Path,
                   progress: Progress | None) -> _Result:
        env = dict(parent.env) if parent else {}
        env.update(s.env)
        workdir = s.workdir or (parent.workdir if parent else "/")
        user, home = (parent.user, parent.home) if parent else (None, None)
        n = len(s.steps)
        with _chroot_mounts(root), _host_network_settings(root) as ca_in_root:
            for i, st in enumerate(s.steps):
                label = f"step {i + 1}/{n}" + (f" ({st.origin})" if st.origin else "")
                if progress:
                    progress(f"[{s.name} {label}] {st.kind}: {_show(st)}")
                try:
                    if st.kind == "env":
                        env.update(st.value)
                    elif st.kind == "workdir":
                        workdir = posixpath.normpath(posixpath.join(workdir, st.value))
                        mkdirs_owned(root, workdir, user)   # as Docker's WORKDIR: made, owned by the USER
                    elif st.kind == "user":
                        user, home = resolve_user(root, st.value)
                    elif st.kind == "copy":
                        self._copy(s, st.value, root, workdir, user)
                    else:
                        self._run(s, st, label, root, workdir, env, ca_in_root, user, home, progress)
                except (OSError, ValueError) as exc:
                    raise TemplateBuildError(f"template {s.name}: {label} {st.kind} failed: {exc}") from None
        mkdirs_owned(root, workdir, None)
        return _Result(env, workdir, user, home)

    @staticmethod
    def _run(s: TemplateSpec, st: Step, label: str, root: Path, workdir: str, env: dict[str, str],
             ca_in_root: bool, user: str | None, home: str | None, progress: Progress | None) -> None:
        mkdirs_owned(root, workdir, None)      # (inside root even through a symlink a step planted)
        script = f"cd {_shq(workdir)} && {st.value}"
        argv = ["chroot", *([f"--userspec={user}"] if user else []), str(root), "/bin/sh", "-c", script]
        try:
            _run(argv, progress, env=build_step_env({**({"HOME": home} if home else {}), **env}, ca_in_root))
        except TemplateBuildError as exc:
            failed = TemplateBuildError(
                f"template {s.name}: {label} `{st.value[:120]}` failed (exit {exc.exit_code})", exc.output)
            failed.exit_code = exc.exit_code
            raise failed from None

    @staticmethod
    def _copy(s: TemplateSpec, v: dict[str, Any], root: Path, workdir: str, user: str | None) -> None:
        src = s.root / v["src"]
        dest = posixpath.normpath(posixpath.join(workdir, v["dest"]))
        if "entries" not in v:          # a TOML spec's copy: the source as it is (its symlinks as symlinks)
            if not src.exists():
                raise ValueError(f"copy source missing: {src}")
            copy_entries(src, {**v, "entries": tree_entries(src)}, s.root, root, dest, run=lambda argv: _run(argv, None),
                         links=True)
            return
        copy_entries(src, v, s.root, root, dest, run=lambda argv: _run(argv, None))


@dataclass(frozen=True)
class _Result:
    env: dict[str, str]
    workdir: str
    user: str | None
    home: str | None


def _show(st: Step) -> str:
    if st.kind == "copy" and "entries" in st.value:
        n = len(st.value["entries"])
        return f"{st.value['src']} -> {st.value['dest']}" + (f" ({n} entries)" if st.value["entries"] != [""] else "")
    return str(st.value).replace("\n", "; ")


def _tee(progress: Progress | None, log: Any) -> Progress:
    def both(line: str) -> None:
        log.write(line + "\n")
        if progress:
            progress(line)
    return both


def _shq(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
