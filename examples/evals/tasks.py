"""50 small Python tasks, each a function to write and hidden tests to grade it.

A task is ``Task(id, prompt, entry, tests)``: the prompt is what a model sees; ``tests`` (``[(args,
expected), ...]``) are hidden from it and only ever go into the grading sandbox. Ten families of five
variants each (the variant changes the constants), so the suite is large enough to score with confidence
intervals and small enough to run anywhere. Pure standard library.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Task:
    id: str
    prompt: str
    entry: str                                  # the function the solution must define
    tests: list[tuple[list[Any], Any]]          # hidden: (arguments, expected result)
    reference: str                              # a correct solution's source (the toy model starts from it)


def _family(name: str, prompt: str, body: str, fn: Callable[..., Any], inputs: list[list[Any]], k: int) -> Task:
    entry = f"{name}_{k}"
    src = f"def {entry}({body.split(':', 1)[0]}):\n    return {body.split(':', 1)[1].strip()}\n".replace("K", str(k))
    return Task(id=f"{name}-{k}", prompt=prompt.replace("K", str(k)).replace("FN", entry), entry=entry,
                tests=[(args, fn(*args)) for args in inputs], reference=src)


def all_tasks() -> list[Task]:
    ints = [[0], [1], [7], [-3], [12], [100]]
    lists = [[[]], [[1, 2, 3]], [[5, -1, 4, 4]], [[10] * 7], [[-2, -8, 3]]]
    words = [[""], ["abc"], ["Hello World"], ["racecar"], ["aeiou xyz"]]
    out = []
    for k in range(1, 6):
        out += [
            _family("add", "Write FN(x) returning x + K.", "x: x + K", lambda x, k=k: x + k, ints, k),
            _family("mul", "Write FN(x) returning x times K.", "x: x * K", lambda x, k=k: x * k, ints, k),
            _family("pow", "Write FN(x) returning x to the power K.", "x: x ** K", lambda x, k=k: x ** k, ints, k),
            _family("multiple", "Write FN(x) returning True when x is a multiple of K+1.", "x: x % (K + 1) == 0",
                    lambda x, k=k: x % (k + 1) == 0, ints, k),
            _family("sumk", "Write FN(xs) returning the sum of xs plus K.", "xs: sum(xs) + K",
                    lambda xs, k=k: sum(xs) + k, lists, k),
            _family("topk", "Write FN(xs) returning the K largest items of xs, largest first.",
                    "xs: sorted(xs, reverse=True)[:K]", lambda xs, k=k: sorted(xs, reverse=True)[:k], lists, k),
            _family("countk", "Write FN(xs) returning how many items of xs are greater than K.",
                    "xs: sum(1 for x in xs if x > K)", lambda xs, k=k: sum(1 for x in xs if x > k), lists, k),
            _family("rot", "Write FN(s) returning s rotated left by K characters (unchanged when empty).",
                    "s: s[K % len(s):] + s[:K % len(s)] if s else s",
                    lambda s, k=k: s[k % len(s):] + s[:k % len(s)] if s else s, words, k),
            _family("repeat", "Write FN(s) returning s repeated K times.", "s: s * K", lambda s, k=k: s * k, words, k),
            _family("gcd", "Write FN(x) returning the greatest common divisor of x and K*6.",
                    "x: __import__('math').gcd(x, K * 6)", lambda x, k=k: math.gcd(x, k * 6), ints, k),
        ]
    return out
