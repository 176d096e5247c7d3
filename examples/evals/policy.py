"""A stand-in for the model under evaluation: given a task and a sample number it writes a solution.

It is deterministic in (task, sample, turn) and right about 60% of the time; otherwise it makes the kind
of mistakes real models make (an off-by-one constant, a wrong operator, a syntax error, a loop that never
ends, a crash). Replace ``solve`` with a call to your model: it gets the prompt (never the hidden tests)
and returns source code. ``feedback`` is what a multi-turn agent is told after a failed attempt.
"""

from __future__ import annotations

import random

from tasks import Task

MISTAKES = ["off_by_one", "wrong_op", "syntax", "hang", "crash"]


def solve(task: Task, sample: int, turn: int = 0, feedback: str | None = None) -> str:
    rng = random.Random(f"{task.id}/{sample}/{turn}")
    p_right = 0.6 if feedback is None else 0.75      # a hint from the grader helps the next turn
    if rng.random() < p_right:
        return task.reference
    mistake = rng.choice(MISTAKES)
    head, _, expr = task.reference.partition("return ")
    if mistake == "off_by_one":
        return f"{head}return ({expr.strip()}) + 1\n"
    if mistake == "wrong_op":
        return task.reference.replace("+", "-", 1) if "+" in expr else f"{head}return None\n"
    if mistake == "syntax":
        return task.reference.replace("return", "retrun", 1)
    if mistake == "hang":
        return f"{head}while True:\n        pass\n"
    return f"{head}raise RuntimeError('model bug')\n"
