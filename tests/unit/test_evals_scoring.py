"""The evals example's scoring (examples/evals/scoring.py) and its task suite, without sandboxes."""

from __future__ import annotations

import itertools
import math
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "evals"))
from scoring import mean_ci, mean_pass_at_k, pass_at_k
from tasks import all_tasks


def test_pass_at_k_is_the_chance_that_a_k_subset_holds_a_correct_sample() -> None:
    for n, c, k in [(5, 2, 1), (5, 2, 3), (4, 0, 2), (6, 6, 6), (10, 3, 4)]:
        samples = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(samples, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)
    assert mean_pass_at_k({"a": [True, False], "b": [False, False]}, 1) == 0.25


def test_mean_ci_is_over_tasks() -> None:
    m, lo, hi = mean_ci({"a": [0.5, 0.5], "b": [0.0, 0.5], "c": [0.5, 1.0]})     # task means .5, .25, .75
    half = 1.96 * statistics.stdev([0.5, 0.25, 0.75]) / math.sqrt(3)
    assert m == 0.5 and (lo, hi) == (pytest.approx(0.5 - half), pytest.approx(0.5 + half))
    assert mean_ci({"a": [1.0], "b": [0.0]}) == (0.5, 0.0, 1.0)           # clipped to [0, 1]
    assert math.isnan(mean_ci({"a": [1.0]})[1]) and math.isnan(mean_ci({})[0])


def test_fifty_tasks_whose_references_pass_their_hidden_tests() -> None:
    tasks = all_tasks()
    assert len(tasks) == 50 and len({t.id for t in tasks}) == 50
    for t in tasks:
        ns: dict = {}  # type: ignore[type-arg]
        exec(t.reference, ns)  # noqa: S102 - runs the episode's own code, in its sandbox
        assert all(ns[t.entry](*args) == want for args, want in t.tests), t.id
        assert t.entry in t.prompt and repr(t.tests[1][0]) not in t.prompt      # names the function, hides tests
