"""Host-level leak check for the TypeScript tests, over `tests/leakcheck.py` (crun containers, mounts,
cgroups, processes of one session's sandboxes).

    leaks.py snapshot CRUN_ROOT MATCH OUT.json   # what exists now (taken after `up`'s warm-up sandbox)
    leaks.py check SNAPSHOT.json [SETTLE_S]      # exit 1 listing anything new still there after SETTLE_S

The running node's spare disks (``isolation.diskspares``: made ahead, one replaced at each create) are not
a test's and are not counted here; ``with_up.py``'s end check, after `up` stopped, counts them.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import leakcheck

IGNORE = ("/disk-spares/",)      # pilldrops.node.isolation.diskspares.SPARES_DIR (this tool imports no pilldrops)


def main(argv: list[str]) -> int:
    if argv[:1] == ["snapshot"] and len(argv) == 4:
        snap = leakcheck.snapshot([Path(argv[1])], match=argv[2], ignore=IGNORE)
        Path(argv[3]).write_text(json.dumps({"roots": [str(r) for r in snap["roots"]], "match": snap["match"],
                                             "items": sorted(snap["items"])}))
        return 0
    if argv[:1] == ["check"] and len(argv) in (2, 3):
        data = json.loads(Path(argv[1]).read_text())
        before = {"roots": [Path(r) for r in data["roots"]], "match": data["match"], "items": set(data["items"]),
                  "ignore": IGNORE}
        deadline = time.monotonic() + (float(argv[2]) if len(argv) == 3 else 5.0)
        new = leakcheck.leaks(before)
        while new and time.monotonic() < deadline:
            time.sleep(0.05)
            new = leakcheck.leaks(before)
        if new:
            print("leaked: " + ", ".join(sorted(new)), file=sys.stderr)
            return 1
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
