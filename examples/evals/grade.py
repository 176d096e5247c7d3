"""The grader, run INSIDE the episode's sandbox: `python grade.py` with /eval/solution.py, /eval/tests.json.

Imports the untrusted solution, calls its entry function on every hidden test (each with a time limit)
and prints one JSON line: {"passed": n, "total": m, "error": "..."}. Whatever the solution does (hang,
crash, exit, fill the disk) it does inside a disposable sandbox; the harness also bounds the whole run
with its own timeout. Standard library only.
"""

import json
import signal
import sys
import traceback

PER_TEST_S = 1


def _alarm(*_):
    raise TimeoutError(f"test took longer than {PER_TEST_S} s")


def main() -> None:
    spec = json.load(open("/eval/tests.json"))
    out = {"passed": 0, "total": len(spec["tests"]), "error": None}
    try:
        ns = {}
        exec(compile(open("/eval/solution.py").read(), "solution.py", "exec"), ns)  # noqa: S102 - runs the episode's own code, in its sandbox
        fn = ns[spec["entry"]]
    except BaseException as e:                        # noqa: BLE001 - a broken solution scores 0
        out["error"] = f"load: {type(e).__name__}: {e}"
        print(json.dumps(out))
        return
    signal.signal(signal.SIGALRM, _alarm)
    for args, expected in spec["tests"]:
        signal.alarm(PER_TEST_S)
        try:
            got = fn(*args)
            if got == expected or (isinstance(expected, list) and list(got) == expected):
                out["passed"] += 1
            elif out["error"] is None:
                out["error"] = f"{spec['entry']}{tuple(args)} returned {got!r}, expected {expected!r}"
        except BaseException as e:                    # noqa: BLE001
            if out["error"] is None:
                out["error"] = f"{spec['entry']}{tuple(args)}: {type(e).__name__}: {e}"[:300]
                traceback.print_exc(file=sys.stderr)
            if isinstance(e, TimeoutError):
                break                                 # a solution that hangs fails the rest too
        finally:
            signal.alarm(0)
    print(json.dumps(out))


main()
