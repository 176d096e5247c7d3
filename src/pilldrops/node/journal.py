"""The agent's intent journal: one small JSON file per sandbox, written atomically (write + rename).

A create is written once, when the sandbox runs (``running`` with the runtime handle), before the create
is answered; a half-made one has no entry, and a restarted agent reaps every sandbox the runtime holds that
no entry names (``Recovery``), so it can tell a half-made sandbox (reap it) from a live one (adopt it).
(``creating`` entries, written before acting by older agents, are still read: reaped as failed starts.)
Other changes (pause, teardown) are still journaled before acting.

No fsync, on purpose: the journal exists for agent restarts and crashes, which leave the kernel's page
cache intact, so a renamed file is always seen whole by the next agent. A host crash is the one case fsync
would cover, and it kills every sandbox process anyway (the next agent finds no runtime state and reaps).
Two fsyncs per create cost milliseconds on the hot path for no protection.

Entries are written with orjson (``_internal.jsonfile``: ~1 µs to encode instead of the ~0.3 ms that
``json.dump(asdict(entry))`` took, issue 15) and read with ``json.loads`` from their bytes, so what an older
agent wrote (the stdlib's ASCII-escaped JSON) reads as before, and its entries are read by this one. They
are UTF-8: an older agent reading them back after a downgrade decodes them with its locale's encoding
(``read_text``), which is UTF-8 under a UTF-8 or the C locale (Python's UTF-8 mode); under another explicit
locale a non-ASCII value (an env of the sandbox) would read garbled.

Every record carries a format version (``version``), and so does the runtime handle inside it. Records
written before versions existed have none and are read as version 1 (the same layout), so an upgraded agent
re-adopts the sandboxes an older one started. A record of a newer version than this agent knows (a
downgrade) is left on disk untouched and its sandbox is neither adopted nor reaped (``Journal.skipped``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pilldrops._internal import jsonfile
from pilldrops.node.runtime.base import Handle

log = logging.getLogger("pilldrops.node")
Phase = Literal["creating", "running", "pausing", "paused", "resuming"]
FORMAT_VERSION = 1           # of a journal entry; unversioned (older) entries are version 1
HANDLE_FORMAT_VERSION = 1    # of the runtime handle stored in an entry; unversioned ones are version 1
_HANDLE_NAMES = tuple(f.name for f in dataclasses.fields(Handle))
_HANDLE_FIELDS = frozenset(_HANDLE_NAMES)


class NewerFormat(ValueError):
    """A record written by a newer agent: this one cannot read it and must not act on it."""


def handle_record(handle: Handle) -> dict[str, Any]:
    """A runtime handle as it is persisted: its fields plus its format version (what
    ``{**asdict(handle), "version": ...}`` gave, without its deep copy: the fields are scalars and the
    ``extra`` dict of strings, which is copied)."""
    record = {name: getattr(handle, name) for name in _HANDLE_NAMES}
    record["extra"] = dict(handle.extra)
    record["version"] = HANDLE_FORMAT_VERSION
    return record


def handle_from_record(record: dict[str, Any], default_id: str) -> Handle:
    if not record:
        return Handle(id=default_id)
    version = int(record.get("version", 1))
    if version > HANDLE_FORMAT_VERSION:
        raise NewerFormat(f"runtime handle format {version} (this agent reads up to {HANDLE_FORMAT_VERSION})")
    return Handle(**{k: v for k, v in record.items() if k in _HANDLE_FIELDS})


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
    # running, being torn down: why, and CLOCK_MONOTONIC when its teardown began (a restarted agent finishes
    # the teardown and bills it up to then, not up to its own restart)
    end_reason: str | None = None
    ended_mono: float | None = None
    version: int = FORMAT_VERSION

    def runtime_handle(self) -> Handle:
        return handle_from_record(self.handle, self.id)

    def record(self) -> dict[str, Any]:
        """The entry as it is written: its fields in order, as ``asdict`` gives them but not deep-copied (the
        record is encoded at once, and ``spec``/``handle`` are the entry's own, made for it)."""
        return {name: getattr(self, name) for name in _ENTRY_NAMES}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Entry:
        if not isinstance(record, dict):
            raise TypeError(f"a journal entry is a JSON object, not {type(record).__name__}")
        version = int(record.get("version", 1))
        if version > FORMAT_VERSION:
            raise NewerFormat(f"journal entry format {version} (this agent reads up to {FORMAT_VERSION})")
        entry = cls(**{**record, "version": version})
        entry.runtime_handle()          # a newer handle format is refused here, before anything acts on it
        return entry


_ENTRY_NAMES = tuple(f.name for f in dataclasses.fields(Entry))


@functools.cache
def boot_id() -> str:
    """This boot's id: monotonic times recorded under another boot mean nothing now. Read once: a process
    never outlives its boot (every journal write asked /proc for it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class Journal:
    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.skipped: set[str] = set()   # sandbox/runtime ids of records the last ``entries()`` left (newer)

    def _path(self, sandbox_id: str) -> str:
        return os.path.join(self.dir, f"{sandbox_id}.json")

    def write(self, entry: Entry) -> None:
        path = self._path(entry.id)
        tmp = path[:-len(".json")] + ".tmp"
        jsonfile.write_bytes(tmp, jsonfile.dumps(entry.record()))
        os.replace(tmp, path)

    def remove(self, sandbox_id: str) -> None:
        try:
            os.unlink(self._path(sandbox_id))
        except FileNotFoundError:
            pass

    def remove_ended(self, sandbox_id: str) -> None:
        """Drop the entry of a sandbox whose teardown was journaled (``end_reason``) once its end is reported."""
        try:
            with open(self._path(sandbox_id), "rb") as f:
                record = json.loads(f.read())
        except (OSError, ValueError):
            return
        if isinstance(record, dict) and record.get("end_reason") is not None:
            self.remove(sandbox_id)

    def entries(self) -> list[Entry]:
        out = []
        self.skipped = set()
        for p in sorted(self.dir.glob("*.json")):
            try:
                record = json.loads(p.read_bytes())
                out.append(Entry.from_record(record))
            except NewerFormat as exc:
                log.error("journal record %s left alone: %s", p.name, exc)
                handle = record.get("handle") if isinstance(record.get("handle"), dict) else {}
                self.skipped |= {p.stem, str(handle.get("id") or p.stem)}
            except (OSError, ValueError, TypeError):
                p.unlink(missing_ok=True)   # a torn write of an intent: nothing was created from it yet
        return out
