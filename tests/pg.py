"""A throwaway PostgreSQL for tests: its own cluster (Debian's binaries, run as the ``postgres`` user),
a free loopback port, a temp data dir; ``new_database()`` gives each test an empty database."""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

_counter = itertools.count()


def bindir() -> Path | None:
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"))
    return Path(dirs[-1]) if dirs else None


def why_not() -> str | None:
    if os.geteuid() != 0:
        return "the PostgreSQL tier starts its own cluster as the postgres user and needs root"
    if bindir() is None:
        return "PostgreSQL is not installed (scripts/install-system-deps installs it)"
    return None


class Postgres:
    def __init__(self) -> None:
        b = bindir()
        assert b is not None
        self.root = Path(tempfile.mkdtemp(prefix="pilldrops-pg-"))
        self.data = self.root / "data"
        shutil.chown(self.root, "postgres", "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        as_pg = ["runuser", "-u", "postgres", "--"]
        subprocess.run([*as_pg, str(b / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                        "--no-sync", "-E", "UTF8"], check=True, capture_output=True)
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off -c max_connections=300")
        subprocess.run([*as_pg, str(b / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l",
                        str(self.root / "log"), "-w", "start"], check=True, capture_output=True)
        self._pg_ctl = [*as_pg, str(b / "pg_ctl"), "-D", str(self.data)]
        self._psql = [*as_pg, str(b / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "-q"]

    def new_database(self) -> str:
        name = f"pd_{os.getpid()}_{next(_counter)}"
        subprocess.run([*self._psql, "-c", f"CREATE DATABASE {name}"], check=True, capture_output=True)
        return f"postgresql://postgres@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        subprocess.run([*self._pg_ctl, "-m", "immediate", "stop"], capture_output=True, check=False)
        shutil.rmtree(self.root, ignore_errors=True)
