"""Fan-out: how many bonus-token guesses the speculation cache holds at each depth (Theorem 12).

A verdict is (k, t*): k accepted draft tokens, then the bonus token t*. With per-token acceptance a,
the outcome weights are w_k = (1 - a)·a^k for k < K (rejection after k accepts) and w_K = a^K (all
accepted). If the cache keeps F_k guesses at depth k and a miss at fan-out F happens with probability
F^-r (the paper measures r ≈ 1), the expected miss rate is sum_k w_k·F_k^-r. Minimising it subject to
sum_k F_k = B gives F_k ∝ w_k^(1/(1+r)), i.e. with c = a^(1/(1+r)):

    F_k = F_0·c^k (k < K),   F_K = F_0·c^K·(1 - a)^(-1/(1+r)),
    F_0 = B / [ (1 - c^K)/(1 - c) + c^K·(1 - a)^(-1/(1+r)) ]

and the optimal miss rate (sum_k w_k^(1/(1+r)))^(1+r) / B^r.

Departures and choices (ours, not the paper's):
- Rounding: largest remainder. Each depth gets floor(F_k); the units still missing to reach B go to
  the depths with the largest fractional parts (ties to the shallower depth). The result sums to B
  exactly and every entry is within 1 of its real value. With B < K + 1 some depths get 0 (that
  outcome is then never cached: a certain miss).
- a is clamped into [A_MIN, A_MAX] before use, so a = 0 (all budget at depth 0) and a = 1 (all at
  depth K) are the limits of the formula rather than divisions by zero.
- The planner (`FanoutPlanner`) estimates a from accepted/judged counts, fits r from observed
  (fan-out at the realised depth, hit) pairs, and sizes B so cache construction fits in the verify time.
  The reference engine takes fan-outs by hand; a manual override is kept for that.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

A_MIN = 1e-6
A_MAX = 1.0 - 1e-6


def _check_args(a: float, K: int, budget: int, r: float) -> float:
    if not isinstance(K, int) or K < 0:
        raise ValueError(f"K must be an integer >= 0, got {K!r}")
    if not isinstance(budget, int) or budget < 0:
        raise ValueError(f"budget must be an integer >= 0, got {budget!r}")
    if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
        raise ValueError(f"r must be a finite number > 0, got {r!r}")
    if not (isinstance(a, (int, float)) and 0.0 <= a <= 1.0):  # also rejects NaN
        raise ValueError(f"a must be in [0, 1], got {a!r}")
    return min(max(float(a), A_MIN), A_MAX)


def outcome_weights(a: float, K: int) -> list[float]:
    """w_0..w_K: probability that verification accepts exactly k tokens (k = K: all accepted)."""
    a = _check_args(a, K, 0, 1.0)
    return [(1.0 - a) * a**k for k in range(K)] + [a**K]


def geometric_fanout_real(a: float, K: int, budget: int, r: float = 1.0) -> list[float]:
    """Theorem 12's real-valued optimum F_0..F_K (length K+1, sums to `budget`)."""
    a = _check_args(a, K, budget, r)
    s = 1.0 / (1.0 + r)
    c = a**s
    cap = c**K * (1.0 - a) ** (-s)  # F_K / F_0
    f0 = budget / (sum(c**k for k in range(K)) + cap)  # sum_{k<K} c^k == (1 - c^K)/(1 - c)
    return [f0 * c**k for k in range(K)] + [f0 * cap]


def largest_remainder(values: Sequence[float], total: int) -> list[int]:
    """Non-negative integers summing to `total`, each within 1 of `values` (which must sum to total)."""
    floors = [math.floor(v) for v in values]
    missing = total - sum(floors)
    # Stable sort: equal fractional parts go to the earlier (shallower) index first.
    order = sorted(range(len(values)), key=lambda i: floors[i] - values[i])
    for i in order[:missing]:
        floors[i] += 1
    return floors


def geometric_fanout(a: float, K: int, budget: int, r: float = 1.0) -> list[int]:
    """Integer fan-outs F_0..F_K summing exactly to `budget` (largest-remainder rounding of Theorem 12)."""
    return largest_remainder(geometric_fanout_real(a, K, budget, r), budget)


def optimal_miss_rate(a: float, K: int, budget: int, r: float = 1.0) -> float:
    """(sum_k w_k^(1/(1+r)))^(1+r) / B^r: the model's miss rate at the real-valued optimum.

    This is the power-law model's value; it exceeds 1 when the budget is so small that some F_k < 1.
    """
    if budget == 0:
        return 1.0
    _check_args(a, K, budget, r)
    s = 1.0 / (1.0 + r)
    return sum(w**s for w in outcome_weights(a, K)) ** (1.0 + r) / budget**r


def expected_miss_rate(fanout: Sequence[float], a: float, r: float = 1.0) -> float:
    """sum_k w_k·F_k^-r for F_0..F_K; an outcome with F_k <= 0 is never cached (miss probability 1)."""
    K = len(fanout) - 1
    w = outcome_weights(a, K)
    _check_args(a, K, 0, r)
    return sum(wk * (1.0 if fk <= 0 else fk ** (-r)) for wk, fk in zip(w, fanout, strict=True))


# ----------------------------------------------------------------------------------------------
# Online planner


@dataclass(frozen=True)
class FanoutConfig:
    """How the planner chooses fan-outs.

    k: speculated tokens per round (the plan has k+1 entries).
    manual: fixed F_0..F_k, used as is (the reference engine's hand-set fan-out); disables planning.
    budget: fixed B = sum F_k; None lets the time rule choose B in [min_budget, max_budget].
    initial_budget: B before any timing is observed (None: min_budget).
    a_prior, a_prior_weight: prior acceptance and its weight in judged-token pseudo-counts.
    r_prior, r_prior_weight: prior exponent and its precision, in the units of the weighted least
        squares (weights ≈ number of misses per fan-out value, times squared spread in log F).
    r_bounds: the fitted r is clamped into this range.
    decay: per-observation-call forgetting factor of all counts (1.0: keep everything; < 1 tracks drift).
    time_fraction: share of the verify time that cache construction may take (T_p <= 1 with margin).
    """

    k: int
    manual: tuple[int, ...] | None = None
    budget: int | None = None
    min_budget: int | None = None
    max_budget: int = 64
    initial_budget: int | None = None
    a_prior: float = 0.7
    a_prior_weight: float = 10.0
    r_prior: float = 1.0
    r_prior_weight: float = 20.0
    r_bounds: tuple[float, float] = (0.25, 4.0)
    decay: float = 1.0
    time_fraction: float = 0.9

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"FanoutConfig.k must be an integer >= 1, got {self.k!r}")
        if self.manual is not None:
            manual = tuple(self.manual)
            if len(manual) != self.k + 1 or any(not isinstance(f, int) or f < 0 for f in manual):
                raise ValueError(f"FanoutConfig.manual must be k+1={self.k + 1} integers >= 0, got {manual!r}")
            if sum(manual) == 0:
                raise ValueError("FanoutConfig.manual must cache at least one token")
            object.__setattr__(self, "manual", manual)
        if self.min_budget is None:
            object.__setattr__(self, "min_budget", self.k + 1)
        if not isinstance(self.min_budget, int) or self.min_budget < 1:
            raise ValueError(f"FanoutConfig.min_budget must be an integer >= 1, got {self.min_budget!r}")
        if not isinstance(self.max_budget, int) or self.max_budget < self.min_budget:
            raise ValueError(f"FanoutConfig.max_budget must be an integer >= min_budget, got {self.max_budget!r}")
        if self.budget is not None and (not isinstance(self.budget, int) or self.budget < 1):
            raise ValueError(f"FanoutConfig.budget must be an integer >= 1 or None, got {self.budget!r}")
        if self.initial_budget is None:
            object.__setattr__(self, "initial_budget", self.min_budget)
        if not isinstance(self.initial_budget, int) or not self.min_budget <= self.initial_budget <= self.max_budget:
            raise ValueError(
                f"FanoutConfig.initial_budget must be in [min_budget, max_budget], got {self.initial_budget!r}"
            )
        if not 0.0 <= self.a_prior <= 1.0:
            raise ValueError(f"FanoutConfig.a_prior must be in [0, 1], got {self.a_prior!r}")
        lo, hi = self.r_bounds
        if not 0.0 < lo <= hi or not math.isfinite(hi):
            raise ValueError(f"FanoutConfig.r_bounds must satisfy 0 < lo <= hi < inf, got {self.r_bounds!r}")
        if not lo <= self.r_prior <= hi:
            raise ValueError(f"FanoutConfig.r_prior must lie in r_bounds, got {self.r_prior!r}")
        for name in ("a_prior_weight", "r_prior_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"FanoutConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"FanoutConfig.decay must be in (0, 1], got {self.decay!r}")
        if not 0.0 < self.time_fraction <= 1.0:
            raise ValueError(f"FanoutConfig.time_fraction must be in (0, 1], got {self.time_fraction!r}")


@dataclass(frozen=True)
class FanoutPlan:
    """A plan and the estimates it came from (for metrics: ssd/fanout, ...)."""

    fanout: tuple[int, ...]  # F_0..F_K
    budget: int
    a: float
    r: float
    predicted_miss_rate: float  # expected_miss_rate(fanout, a, r)


class FanoutPlanner:
    """Online estimates of a, r and the budget B, turned into Theorem 12 fan-outs.

    - a: (a_prior·w0 + accepted) / (w0 + judged); all of these, prior included, decay by `decay`
      per call, so the prior fades as data comes.
    - r: the miss model F^-r only matters up to a constant factor (a factor m in m·F^-r does not move
      the argmin), so we fit log(miss rate) = b0 - r·log F by weighted least squares over the distinct
      observed fan-outs F >= 1, with miss rate (misses + 1/2)/(n + 1) and weights n·p/(1 - p) (inverse
      delta-method variance of log p̂). A Gaussian prior N(r_prior, 1/r_prior_weight) on the slope
      gives  r = (-Sxy + λ·r_prior) / (Sxx + λ); a single observed F (Sxx = 0) leaves r at the prior.
      Fan-out 0 carries no information about r (always a miss) and is ignored.
    - B: cache construction time is modelled as fixed + per_unit·B (fixed = glue forward etc.); the
      largest B with fixed + per_unit·B <= time_fraction·T_verify, clamped to [min_budget, max_budget].
      per_unit and T_verify are exponentially averaged with the same decay (plain means if decay = 1).
    """

    def __init__(self, config: FanoutConfig):
        self.config = config
        self._accepted = config.a_prior * config.a_prior_weight  # the prior as pseudo-counts, which fade
        self._judged = config.a_prior_weight
        self._cache: dict[int, list[float]] = {}  # F -> [rounds, misses]
        self._per_unit = _Average(config.decay)
        self._fixed = _Average(config.decay)
        self._verify = _Average(config.decay)

    # -- observations --------------------------------------------------------------------------
    def observe_acceptance(self, accepted: int, judged: int) -> None:
        """Accepted draft tokens out of the judged ones (accepted + the rejected one, if any)."""
        if not 0 <= accepted <= judged:
            raise ValueError(f"need 0 <= accepted <= judged, got accepted={accepted}, judged={judged}")
        d = self.config.decay
        self._accepted = d * self._accepted + accepted
        self._judged = d * self._judged + judged

    def observe_cache(self, fanouts: Sequence[int], hits: Sequence[bool]) -> None:
        """Pairs (fan-out the cache had at the realised depth, whether the verdict hit)."""
        if len(fanouts) != len(hits):
            raise ValueError(f"fanouts and hits differ in length: {len(fanouts)} != {len(hits)}")
        d = self.config.decay
        if d < 1.0:
            for counts in self._cache.values():
                counts[0] *= d
                counts[1] *= d
        for f, hit in zip(fanouts, hits, strict=True):
            f = int(f)
            if f < 0:
                raise ValueError(f"fan-out must be >= 0, got {f}")
            if f == 0:
                continue
            counts = self._cache.setdefault(f, [0.0, 0.0])
            counts[0] += 1.0
            counts[1] += 0.0 if bool(hit) else 1.0

    def observe_timing(self, construct_seconds: float, budget: int, verify_seconds: float,
                       fixed_seconds: float = 0.0) -> None:
        """One round's cache-construction time at `budget`, its fixed part, and the verify time."""
        if budget < 1 or construct_seconds < 0 or fixed_seconds < 0 or verify_seconds <= 0:
            raise ValueError(
                f"bad timing: construct={construct_seconds}, budget={budget}, verify={verify_seconds}, "
                f"fixed={fixed_seconds}"
            )
        self._per_unit.add(max(construct_seconds - fixed_seconds, 0.0) / budget)
        self._fixed.add(fixed_seconds)
        self._verify.add(verify_seconds)

    # -- estimates -----------------------------------------------------------------------------
    @property
    def a(self) -> float:
        return self._accepted / self._judged

    @property
    def r(self) -> float:
        c = self.config
        xs, ys, ws = [], [], []
        for f, (n, misses) in self._cache.items():
            if n <= 0:
                continue
            p = (misses + 0.5) / (n + 1.0)
            xs.append(math.log(f))
            ys.append(math.log(p))
            ws.append(n * p / (1.0 - p))
        lam = c.r_prior_weight
        sw = sum(ws)
        if sw <= 0:
            return c.r_prior
        xbar = sum(w * x for w, x in zip(ws, xs, strict=True)) / sw
        ybar = sum(w * y for w, y in zip(ws, ys, strict=True)) / sw
        sxx = sum(w * (x - xbar) ** 2 for w, x in zip(ws, xs, strict=True))
        sxy = sum(w * (x - xbar) * (y - ybar) for w, x, y in zip(ws, xs, ys, strict=True))
        r = (-sxy + lam * c.r_prior) / (sxx + lam)
        lo, hi = c.r_bounds
        return min(max(r, lo), hi)

    @property
    def budget(self) -> int:
        c = self.config
        if c.manual is not None:
            return sum(c.manual)
        if c.budget is not None:
            return c.budget
        if self._verify.value is None:
            return c.initial_budget
        room = c.time_fraction * self._verify.value - self._fixed.value
        per_unit = self._per_unit.value
        if per_unit <= 0:
            fit = c.max_budget
        else:
            fit = math.floor(room / per_unit) if room > 0 else 0
        return min(max(fit, c.min_budget), c.max_budget)

    def plan(self, cap: Optional[int] = None) -> FanoutPlan:
        """The fan-outs for the next round, with the estimates behind them; `cap` (>= 1) bounds the
        budget (a manual fan-out is kept as it is)."""
        a, r = self.a, self.r
        if self.config.manual is not None:
            fanout = list(self.config.manual)
        else:
            budget = self.budget if cap is None else max(1, min(self.budget, cap))
            fanout = geometric_fanout(a, self.config.k, budget, r)
        return FanoutPlan(tuple(fanout), sum(fanout), a, r, expected_miss_rate(fanout, a, r))


class _Average:
    """Exponentially weighted mean (plain running mean when decay == 1)."""

    def __init__(self, decay: float):
        self.decay = decay
        self._sum = 0.0
        self._weight = 0.0

    def add(self, x: float) -> None:
        self._sum = self.decay * self._sum + x
        self._weight = self.decay * self._weight + 1.0

    @property
    def value(self) -> float | None:
        return None if self._weight == 0 else self._sum / self._weight
