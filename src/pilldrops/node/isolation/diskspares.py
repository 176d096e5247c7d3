"""Spare disks: per-sandbox disks (``diskquota``) made ahead, off the create path (issue 15).

A cold create with ``disk_mb`` spent ~4.8 ms of its ~24 ms of our own on its disk (copy of the golden image,
LOOP_CONFIGURE, the ext4 mount, a thread hop, the overlay's dirs on the fresh file system; bench/RESULTS.md
"Cold create (issue 15, session 7)"). With ``keep`` > 0, ``take`` hands over a ready one instead: a
directory holding ``disk.img`` (copied from the golden image of that size) mounted on ``disk/`` with
``disk/upper/etc`` and ``disk/work`` made, renamed to the sandbox dir (the mount moves with its directory:
one rename on the create path). ``take`` also wakes one worker thread that makes the next while that
create's ``crun run`` runs, so that ``keep`` per size asked for are ready (for the last ``MAX_SIZES``
sizes asked for). A spare is what a create would have made itself (the same golden image, attach and
mount), so quotas are unchanged; a miss (none ready: the first create of a size, or a burst) makes the
disk on the create path as before.

Layout: ``<state_dir>/disk-spares/<disk_mb>-<token>/{disk.img,disk/}``. Nothing of it is a sandbox: the
spares of a previous life of the agent (killed) are removed by ``reap`` at the agent's start, and all of
them by ``close`` (the agent's shutdown, whether or not sandboxes outlive it).
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from pathlib import Path

from pilldrops.node.isolation import diskquota
from pilldrops.node.isolation.mounts import MountError, umount_all_under
from pilldrops.node.isolation.rmtree import remove_tree

SPARES_DIR = "disk-spares"
MAX_SIZES = 4          # spares are kept for the few sizes asked for last, never for every size ever asked
log = logging.getLogger("pilldrops.node")


def _remove(d: Path) -> bool:
    """Best effort (a spare is nobody's sandbox): False, logged, when something of it is left."""
    try:
        try:
            diskquota.remove(d)
        except MountError:
            umount_all_under(d)
        remove_tree(d)
        return True
    except OSError as e:
        log.warning("spare disk %s not removed: %s", d, e)
        return False


class DiskSpares:
    """Ready disks per size for one runtime's state dir. Thread-safe; ``keep`` = 0 turns it off."""

    def __init__(self, state_dir: Path, keep: int = 0) -> None:
        self.state_dir = state_dir
        self.root = state_dir / SPARES_DIR
        self.keep = keep
        self._ready: dict[int, list[Path]] = {}
        self._doomed: list[Path] = []         # spares to remove (a size no longer kept; a failed take)
        self._wanted: list[int] = []          # sizes asked for, the last asked last (at most MAX_SIZES; a
                                              # failed make drops its size)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._worker: threading.Thread | None = None
        self._closed = False
        self.hits = self.misses = 0

    def take(self, disk_mb: int, d: Path) -> bool:
        """Make the (absent) sandbox dir ``d`` a ready disk of ``disk_mb`` with its overlay dirs; False: none
        is ready (the caller makes it; ``refill`` makes spares of that size from now on)."""
        if self.keep <= 0 or self._closed:
            return False
        with self._lock:
            dropped = self._want(disk_mb)
            ready = self._ready.get(disk_mb)
            spare = ready.pop() if ready else None
        if dropped:
            with self._lock:
                self._doomed += dropped      # removed by the worker, off the create path
        self.refill()
        if spare is not None:
            try:
                os.rename(spare, d)
                self.hits += 1
                return True
            except OSError as e:
                log.warning("spare disk %s could not become %s: %s", spare, d, e)
                with self._lock:
                    self._doomed.append(spare)
        self.misses += 1
        return False

    def _want(self, disk_mb: int) -> list[Path]:
        """(Under the lock.) ``disk_mb`` is the size asked for last; a size that falls off the last
        ``MAX_SIZES`` has its ready spares returned, to be removed (a client asking for ever new sizes makes
        no more than ``MAX_SIZES`` × ``keep`` spares)."""
        if disk_mb in self._wanted:
            self._wanted.remove(disk_mb)
        self._wanted.append(disk_mb)
        dropped: list[Path] = []
        while len(self._wanted) > MAX_SIZES:
            dropped += self._ready.pop(self._wanted.pop(0), [])
        return dropped

    def refill(self) -> None:
        """Wake the worker to make spares of the sizes asked for. ``take`` does, so that it works while that
        create's ``crun run`` runs: the agent's event loop waits on crun then, and the worker's Python does
        not compete with it for the GIL (woken after the create, it delayed the client's next commands and
        its kill: bench/RESULTS.md)."""
        if self.keep <= 0 or self._closed or not (self._wanted or self._doomed):
            return
        self._wake.set()
        if self._worker is None:
            with self._lock:
                if self._worker is None and not self._closed:
                    self._worker = threading.Thread(target=self._run, name="pilldrops-disk-spares", daemon=True)
                    self._worker.start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            self._wake.clear()
            try:
                if not self._closed:
                    self._fill()
            except Exception:          # never a dead worker: creates would miss from then on, silently
                log.exception("making spare disks failed")

    def _next_size(self) -> int | None:
        with self._lock:
            if self._closed:
                return None
            return next((mb for mb in reversed(self._wanted) if len(self._ready.get(mb, ())) < self.keep), None)

    def _fill(self) -> None:
        with self._lock:
            doomed, self._doomed = self._doomed, []
        for p in doomed:
            _remove(p)
        while (mb := self._next_size()) is not None:
            d = self.root / f"{mb}-{uuid.uuid4().hex[:12]}"
            try:
                d.mkdir(parents=True)
                diskquota.make(self.state_dir, d, mb)
                diskquota.make_layer_dirs(d)
            except OSError as e:
                log.warning("cannot make a spare %d MiB disk (creates make theirs): %s", mb, e)
                with self._lock:
                    if mb in self._wanted:
                        self._wanted.remove(mb)
                _remove(d)
                continue
            with self._lock:
                keep = not self._closed and mb in self._wanted
                if keep:
                    self._ready.setdefault(mb, []).append(d)
            if not keep:
                _remove(d)

    def reap(self) -> None:
        """The spares a previous life of the agent left (killed): removed at the agent's start, whether or
        not it keeps spares itself."""
        self._remove_all(known=False)

    def _remove_all(self, *, known: bool) -> None:
        """Every spare under the root (``known``: also the ready ones of this instance)."""
        with self._lock:
            mine = set() if known else {p for ps in self._ready.values() for p in ps}
            if known:
                self._ready.clear()
                self._doomed.clear()
        if not self.root.is_dir():
            return
        for p in self.root.iterdir():
            if p not in mine:
                _remove(p)

    def close(self, timeout: float = 30.0) -> None:
        """Stop making spares and remove every one (their mounts and loop devices go with them)."""
        with self._lock:
            self._closed = True
            worker = self._worker
        self._wake.set()
        if worker is not None:
            worker.join(timeout)
        self._remove_all(known=True)
