"""What a finished run shows: did it learn, how long it took to get there, and with which rollouts.

`reward_gain`: the mean `reward/mean` of the last k steps minus that of the first k, with a bootstrap
interval over the steps (each window resampled with replacement on its own).
`time_to_reward`: the first step whose trailing k-step mean reaches the threshold (by default midway
between the first-k and last-k means), and the wall-clock to get there when each step costs its own
non-rollout seconds plus its rollout tokens at a method's tokens/s. `projected_rest` replaces the
measured non-rollout seconds by those that would make rollout (at a reference method's rate) a given
share of each step (what GPU RL runs report): a projection, labelled as one wherever it is printed.

The interval resamples steps as if independent; a run's steps are correlated (the policy trends within a
window), so read it as a check that the gain is not one lucky step, not as exact coverage.

Pure functions over lists of numbers, so the benches and the tests share them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Optional, Sequence


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


@dataclass(frozen=True)
class Gain:
    first: float  # mean over the first k steps
    last: float  # mean over the last k steps
    gain: float  # last - first
    low: float  # the bootstrap interval of `gain`
    high: float
    level: float


def reward_gain(rewards: Sequence[float], k: int = 10, level: float = 0.95, resamples: int = 10_000,
                seed: int = 0) -> Gain:
    """last-k mean minus first-k mean of `rewards` (one value per step), with a percentile bootstrap
    interval at `level` (the two windows resampled independently; deterministic for a seed)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    if k < 1 or len(rewards) < 2 * k:
        raise ValueError(f"reward_gain needs at least 2k = {2 * k} steps, got {len(rewards)}")
    first, last = list(rewards[:k]), list(rewards[-k:])
    rng = random.Random(seed)
    diffs = sorted(_mean(rng.choices(last, k=k)) - _mean(rng.choices(first, k=k)) for _ in range(resamples))
    tail = (1 - level) / 2
    low = diffs[int(tail * (resamples - 1))]
    high = diffs[int((1 - tail) * (resamples - 1))]
    return Gain(_mean(first), _mean(last), _mean(last) - _mean(first), low, high, level)


def trailing_means(values: Sequence[float], k: int) -> list[float]:
    """The mean of values[max(0, i-k+1) .. i] for each i."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


def threshold_step(rewards: Sequence[float], k: int = 10, threshold: Optional[float] = None) -> tuple[float, Optional[int]]:
    """(threshold, the 1-based step at which the trailing k-step mean first reaches it, or None). The
    default threshold is midway between the first-k and last-k means, and a run whose last-k mean is not
    above its first-k mean reaches none (it did not learn). Only steps with a full window (from step k
    on) count, so the first steps' noise cannot cross it early."""
    if threshold is None:
        first, last = _mean(rewards[:k]), _mean(rewards[-k:])
        threshold = (first + last) / 2
        if last <= first:
            return threshold, None
    for i, m in enumerate(trailing_means(rewards, k)):
        if i + 1 >= k and m >= threshold:
            return threshold, i + 1
    return threshold, None


def time_to_reward(steps: int, tokens: Sequence[float], rest_seconds: Sequence[float],
                   tokens_per_s: Callable[[int], float]) -> float:
    """Seconds to finish steps 1..`steps` when step i (1-based) costs rest_seconds[i-1] (learner, sync,
    follow, drift) plus tokens[i-1] / tokens_per_s(i)."""
    if steps > len(tokens) or steps > len(rest_seconds):
        raise ValueError(f"{steps} steps asked, the run has {min(len(tokens), len(rest_seconds))}")
    return sum(rest_seconds[i] + tokens[i] / tokens_per_s(i + 1) for i in range(steps))


def projected_rest(tokens: Sequence[float], tokens_per_s: Callable[[int], float], share: float) -> list[float]:
    """Non-rollout seconds per step that make rollout (at `tokens_per_s`) `share` of each step."""
    if not 0 < share < 1:
        raise ValueError(f"share must be in (0, 1), got {share!r}")
    return [tokens[i] / tokens_per_s(i + 1) * (1 - share) / share for i in range(len(tokens))]


def nearest(points: dict[int, float]) -> Callable[[int], float]:
    """step -> the value at the checkpoint step nearest to it (ties: the earlier one)."""
    if not points:
        raise ValueError("no points")
    keys = sorted(points)
    return lambda step: points[min(keys, key=lambda c: (abs(c - step), c))]
