"""A small deterministic RL episode: a policy walks a 6x6 grid world with traps and a goal.

`python episode.py --policy N` prints the episode's total reward (a float) on stdout and nothing else.
The policy is a seeded softmax over four moves; the world is fixed. Pure standard library, so the demo
can check the sandboxed result against the same episode run on the host.
"""

from __future__ import annotations

import argparse
import math
import random

SIZE = 6
GOAL = (5, 5)
TRAPS = {(1, 3), (3, 1), (4, 4), (2, 2)}
MOVES = [(0, 1), (1, 0), (0, -1), (-1, 0)]


def episode(policy: int, steps: int = 400) -> float:
    rng = random.Random(policy)
    prefs = [rng.gauss(0, 1) for _ in MOVES]
    z = sum(math.exp(p) for p in prefs)
    probs = [math.exp(p) / z for p in prefs]
    x = y = 0
    reward = 0.0
    for _ in range(steps):
        dx, dy = rng.choices(MOVES, weights=probs)[0]
        x, y = min(max(x + dx, 0), SIZE - 1), min(max(y + dy, 0), SIZE - 1)
        if (x, y) in TRAPS:
            reward -= 1.0
            x = y = 0
        elif (x, y) == GOAL:
            reward += 10.0
            x = y = 0
        else:
            reward -= 0.01
    return round(reward, 4)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", type=int, required=True)
    print(episode(ap.parse_args().policy))
