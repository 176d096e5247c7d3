"""The agent's intent journal: one small JSON file per sandbox, written atomically (write + rename).

Write intent before acting (``creating``) and confirm after (``running`` with the runtime handle), so a
restarted agent can tell a half-made sandbox (reap it) from a live one (adopt it).

No fsync, on purpose: the journal exists for agent restarts and crashes, which leave the kernel's page
cache intact, so a renamed file is always seen whole by the next agent. A host crash is the one case fsync
would cover, and it kills every sandbox process anyway (the next agent finds no runtime state and reaps).
Two fsyncs per create cost milliseconds on the hot path for no protection.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from pilldrops.node.runtime.base import Handle

Phase = Literal["creating", "running", "pausing", "paused", "resuming"]


@dataclass
class Entry:
    id: str
    phase: Phase
    spec: dict[str, Any]
    handle: dict[str, Any] = field(default_factory=dict)
    started_at: str | None = None
    started_mono: float | None = None     # CLOCK_MONOTONIC at start: survives agent restarts (not reboots)
    boot_id: str | None = None            # the boot started_mono belongs to
    run_s: float | None = None            # paused: running seconds so far (usage continues from here)
    checkpoint: str | None = None         # pausing/paused/resuming: the checkpoint's directory
    checkpoint_bytes: int | None = None

    def runtime_handle(self) -> Handle:
        return Handle(**self.handle) if self.handle else Handle(id=self.id)


def boot_id() -> str:
    """This boot's id: monotonic times recorded under another boot mean nothing now."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Journal:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, sandbox_id: str) -> Path:
        return self.dir / f"{sandbox_id}.json"

    def write(self, entry: Entry) -> None:
        path = self._path(entry.id)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(entry), f)
        os.replace(tmp, path)

    def remove(self, sandbox_id: str) -> None:
        self._path(sandbox_id).unlink(missing_ok=True)

    def entries(self) -> list[Entry]:
        out = []
        for p in sorted(self.dir.glob("*.json")):
            try:
                out.append(Entry(**json.loads(p.read_text())))
            except (OSError, ValueError, TypeError):
                p.unlink(missing_ok=True)   # a torn write of an intent: nothing was created from it yet
        return out
