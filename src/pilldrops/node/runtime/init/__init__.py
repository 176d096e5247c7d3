"""The sandbox init (``pd-init.c``) and its build: a static, cached binary under ``<data_dir>/bin``.

``build_init(data_dir)`` compiles with ``gcc -static -Os`` only when the source hash changed; the hash
sits next to the binary. Safe against concurrent callers (build to a temp file, rename).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("pd-init.c")
CFLAGS = ["-static", "-Os", "-s", "-Wall", "-Werror"]


class InitBuildError(RuntimeError):
    pass


def source_hash() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    return h.hexdigest()[:16]


def build_init(data_dir: Path) -> Path:
    """Return the path of the compiled init, building it if missing or stale."""
    bindir = Path(data_dir) / "bin"
    out = bindir / "pd-init"
    stamp = bindir / "pd-init.hash"
    want = source_hash()
    if out.exists() and stamp.exists() and stamp.read_text().strip() == want:
        return out
    if not shutil.which("gcc"):
        raise InitBuildError("gcc is not installed: run `scripts/install-system-deps` first")
    bindir.mkdir(parents=True, exist_ok=True)
    tmp = bindir / f".pd-init.{os.getpid()}.tmp"
    r = subprocess.run(["gcc", *CFLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise InitBuildError(f"gcc failed building pd-init: {r.stderr.strip()}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    stamp_tmp = bindir / f".pd-init.hash.{os.getpid()}.tmp"
    stamp_tmp.write_text(want + "\n")
    os.replace(stamp_tmp, stamp)
    return out
