"""Scores of an eval: pass@k (the unbiased estimator) and a mean with a confidence interval that treats
the samples of one task as correlated (clustered by task). Pure standard library."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn from n (c of them correct) is correct:
    1 - C(n-c, k) / C(n, k) (Chen et al., 2021, "Evaluating Large Language Models Trained on Code")."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task (got {n})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(per_task: Mapping[str, Sequence[bool]], k: int) -> float:
    return statistics.fmean(pass_at_k(len(v), sum(v), k) for v in per_task.values())


def mean_ci(per_task: Mapping[str, Sequence[float]], z: float = 1.96) -> tuple[float, float, float]:
    """(mean, low, high): the mean over tasks of each task's mean reward, with a normal-approximation
    95% interval over tasks (samples of one task are not independent, so the tasks are the units)."""
    means = [statistics.fmean(v) for v in per_task.values() if v]
    if not means:
        return (math.nan, math.nan, math.nan)
    m = statistics.fmean(means)
    if len(means) < 2:
        return (m, math.nan, math.nan)
    half = z * statistics.stdev(means) / math.sqrt(len(means))
    return (m, max(0.0, m - half), min(1.0, m + half))
