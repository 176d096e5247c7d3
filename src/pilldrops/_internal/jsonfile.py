"""JSON the node agent writes to files of its own (journal entries, a sandbox's OCI config.json), cheaply.

``json.dump`` to a file runs the stdlib's pure-Python encoder (``iterencode``), and even ``json.dumps`` costs
~0.35 ms for a config.json; orjson takes ~0.03 ms (measured, issue 15). ``dumps`` is orjson's standard JSON
(UTF-8, compact), which ``json.loads`` reads back to equal values; what orjson refuses and the stdlib took
(a string with a lone surrogate, written as a ``\\udXXXX`` escape; an int past 64 bits; a key that is not a
string) is still written, by the stdlib, as before. Readers take the files' bytes (``json.loads(bytes)``
decodes UTF-8 whatever the locale). NaN and infinities, which nothing here writes, would come out as
``null`` (the stdlib wrote the non-standard ``NaN``). Needs orjson (the ``server`` extra, which runs the node).
"""

from __future__ import annotations

import json
import os
from typing import Any

import orjson

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def dumps(obj: Any) -> bytes:
    """``obj`` as JSON bytes (orjson; the stdlib for what orjson refuses)."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:
        return json.dumps(obj).encode()


def write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Create or truncate ``path`` and write ``data`` (mode 0666 less the umask, as ``open(path, "w")``),
    without the buffered file object ``open`` builds."""
    fd = os.open(path, _CREATE, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
