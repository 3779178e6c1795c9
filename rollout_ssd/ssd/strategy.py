"""Which way to speculate, from live estimates (Theorem 7, Corollary 9, Corollary 16 / Theorem 17).

Time is in verify units (one target verify forward of the batch = 1). Per sequence and round:

    E(a, K) = (1 - a^(K+1)) / (1 - a)                         tokens per round at acceptance a
    S_SSD   = [p·E_hit + (1-p)·E_miss] / [p·(max(1, T_p) + T_o) + (1-p)·(1 + T_b)]   (Theorem 7, T_o = 0)
    S_SD    = E_SD / (1 + T_SD)

A batch of b sequences hits entirely with probability p^b (hits are independent, Corollary 16); one
miss makes the whole batch wait for the backup. `StrategyRule` scores every strategy as batch tokens per
second with

    ssd+X:  b·[p·E_hit + (1-p)·E_X] / ( p^b·(max(1, T_p) + T_o) + (1 - p^b)·(1 + T_X) ) / t_verify
    sd, suffix (plain speculation with that speculator):  b·E / (1 + T_draft) / t_verify
    ar:     b / t_decode

which is Theorem 7 at b = 1 and Theorem 17's two expressions when T_p <= 1 and the fast backup costs 0,
so between "ssd+neural" and one zero-cost fast backup the rule picks neural exactly when b < b*.
AR's round is one decode step, not a K+1-token verify: on a CPU these differ, hence t_decode
(THEORY: tokens/s over AR = S × t_decode / t_verify).

Every draft-side time is what the TARGET waits, measured on the target side: T_X (and T_SD) is the wait
for chains drafted on demand, request to validated reply, so it includes the transfer of the chains and
their q; T_o is the wait on a round whose chains all came from the cache, less any part of the cache
build that outlasted the verify (T_p already counts that): the transfer cost the theorem leaves out
(T_o = 0). Left out, they made SD and SSD look as fast as AR at batch 16 on a CPU when they were 0.65x.

`LiveEstimates` turns per-round counters into these inputs with exponentially weighted counts.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

STRATEGIES = ("ssd+neural", "ssd+suffix", "ssd+random", "sd", "suffix", "ar")
SPECULATORS = ("neural", "suffix", "random")


def expected_tokens_per_round(a: float, K: int) -> float:
    """E(a, K) = (1 - a^(K+1)) / (1 - a) = sum_{i<=K} a^i; K + 1 at a = 1."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"a must be in [0, 1], got {a!r}")
    if not isinstance(K, int) or K < 0:
        raise ValueError(f"K must be an integer >= 0, got {K!r}")
    return sum(a**i for i in range(K + 1))  # the sum form is exact at and near a = 1


def tokens_from_acceptance(accept: Mapping[str, float], K: int) -> dict[str, float]:
    """E(a, K) per path from per-speculator acceptance; cache hits carry neural-draft chains."""
    tokens = {s: expected_tokens_per_round(accept[s], K) for s in SPECULATORS}
    return {"hit": tokens["neural"], **tokens}


def ssd_speedup(p_hit: float, E_hit: float, E_miss: float, T_p: float, T_b: float, T_o: float = 0.0) -> float:
    """Theorem 7: SSD speedup over AR (verify = 1 time unit); T_o: the hit path's transfer overhead."""
    return (p_hit * E_hit + (1 - p_hit) * E_miss) / (p_hit * (max(1.0, T_p) + T_o) + (1 - p_hit) * (1 + T_b))


def sd_speedup(E_sd: float, T_sd: float) -> float:
    """Theorem 7: SD speedup over AR."""
    return E_sd / (1.0 + T_sd)


def b_star(p: float, N: float, F: float, T_n: float) -> float:
    """Theorem 17: the neural backup beats a zero-cost fast backup iff batch size b < b*.

    p: per-sequence hit rate; N, F: tokens per round per sequence with the neural / fast backup;
    T_n: neural backup latency (verify units). b* = ln(1 - (R - 1)/T_n) / ln p with R = N / F;
    math.inf when R - 1 >= T_n (neural always better); 0.0 when neural is never better (R <= 1, or
    p = 0 with R < 1 + T_n, or p = 1 with R <= 1).
    """
    if not 0.0 <= p <= 1.0 or N <= 0 or F <= 0 or T_n < 0:
        raise ValueError(f"bad b* inputs: p={p}, N={N}, F={F}, T_n={T_n}")
    R = N / F
    if R - 1.0 >= T_n:
        return math.inf
    if R <= 1.0 or p == 0.0:
        return 0.0
    if p == 1.0:  # the batch always hits: neural costs nothing extra and R > 1
        return math.inf
    return max(0.0, math.log(1.0 - (R - 1.0) / T_n) / math.log(p))


@dataclass(frozen=True)
class StrategyInputs:
    """Live estimates for one decision. Times in seconds, for the whole batch, per round.

    tokens: E per round per sequence when a chain comes from: "hit" (the speculation cache) or a
        speculator run on demand ("neural", "suffix", "random").
    draft_seconds: time to draft K tokens serially with each speculator (SD / backup latency T_b).
    primary_seconds: T_p, cache construction per round. decode_seconds: one AR decode step.
    overhead_seconds: T_o, the target's wait for cached chains beyond T_p (their transfer).
    """

    p_hit: float
    tokens: Mapping[str, float]
    draft_seconds: Mapping[str, float]
    primary_seconds: float
    verify_seconds: float
    decode_seconds: float
    batch_size: int
    k: int
    overhead_seconds: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.p_hit <= 1.0:
            raise ValueError(f"StrategyInputs.p_hit must be in [0, 1], got {self.p_hit!r}")
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"StrategyInputs.k must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"StrategyInputs.batch_size must be an integer >= 1, got {self.batch_size!r}")
        for name in ("hit",) + SPECULATORS:
            e = self.tokens.get(name)
            if e is None or not 1.0 <= e <= self.k + 1 + 1e-9:
                raise ValueError(f"StrategyInputs.tokens[{name!r}] must be in [1, k+1], got {e!r}")
        for name in SPECULATORS:
            t = self.draft_seconds.get(name)
            if t is None or not t >= 0:
                raise ValueError(f"StrategyInputs.draft_seconds[{name!r}] must be >= 0, got {t!r}")
        if not self.primary_seconds >= 0:
            raise ValueError(f"StrategyInputs.primary_seconds must be >= 0, got {self.primary_seconds!r}")
        if not self.overhead_seconds >= 0:
            raise ValueError(f"StrategyInputs.overhead_seconds must be >= 0, got {self.overhead_seconds!r}")
        if not (self.verify_seconds > 0 and self.decode_seconds > 0):
            raise ValueError("StrategyInputs.verify_seconds and decode_seconds must be > 0")
        object.__setattr__(self, "tokens", dict(self.tokens))
        object.__setattr__(self, "draft_seconds", dict(self.draft_seconds))


@dataclass(frozen=True)
class StrategyDecision:
    chosen: str
    scores: dict[str, float]  # batch tokens per second, per candidate
    inputs: StrategyInputs
    b_star: float  # Theorem 17 (neural vs the better zero-cost fast backup), nan if not applicable
    predicted_speedup: float  # chosen score / AR score


def strategy_scores(inputs: StrategyInputs, names: tuple[str, ...] = STRATEGIES) -> dict[str, float]:
    """Batch tokens per second of each named strategy (formulas in the module docstring)."""
    b, p, tv = inputs.batch_size, inputs.p_hit, inputs.verify_seconds
    all_hit = p**b
    t_p = inputs.primary_seconds / tv
    t_o = inputs.overhead_seconds / tv
    scores = {}
    for name in names:
        if name.startswith("ssd+"):
            backup = name[4:]
            per_seq = p * inputs.tokens["hit"] + (1 - p) * inputs.tokens[backup]
            t_b = inputs.draft_seconds[backup] / tv
            time_units = all_hit * (max(1.0, t_p) + t_o) + (1 - all_hit) * (1 + t_b)
            scores[name] = b * per_seq / time_units / tv
        elif name in ("sd", "suffix"):
            kind = "neural" if name == "sd" else "suffix"
            t_d = inputs.draft_seconds[kind] / tv
            scores[name] = b * inputs.tokens[kind] / (1 + t_d) / tv
        elif name == "ar":
            scores[name] = b / inputs.decode_seconds
        else:
            raise ValueError(f"unknown strategy {name!r}; known: {STRATEGIES}")
    return scores


@dataclass(frozen=True)
class StrategyConfig:
    """candidates: strategies the rule may pick. fixed: always pick this one (still scored).
    hysteresis: keep the current strategy unless the best beats it by this fraction (0: no stickiness).
    switch_after: ... and unless that same strategy has been the best (by the margin) on this many
    decisions in a row (1: at once): a single round's timing outlier then cannot move the rule.
    """

    candidates: tuple[str, ...] = STRATEGIES
    fixed: str | None = None
    hysteresis: float = 0.0
    switch_after: int = 1

    def __post_init__(self):
        object.__setattr__(self, "candidates", tuple(self.candidates))
        unknown = [c for c in self.candidates if c not in STRATEGIES]
        if unknown or not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(
                f"StrategyConfig.candidates must be distinct names from {STRATEGIES}, got {self.candidates!r}"
            )
        if self.fixed is not None and self.fixed not in self.candidates:
            raise ValueError(f"StrategyConfig.fixed must be one of the candidates, got {self.fixed!r}")
        if not self.hysteresis >= 0:
            raise ValueError(f"StrategyConfig.hysteresis must be >= 0, got {self.hysteresis!r}")
        if not isinstance(self.switch_after, int) or isinstance(self.switch_after, bool) or self.switch_after < 1:
            raise ValueError(f"StrategyConfig.switch_after must be an integer >= 1, got {self.switch_after!r}")


class StrategyRule:
    """Pick the strategy with the most expected batch tokens per second."""

    def __init__(self, config: StrategyConfig):
        self.config = config
        self._challenger: tuple[str, int] | None = None  # (strategy, decisions in a row it has won)

    def decide(self, inputs: StrategyInputs, current: str | None = None) -> StrategyDecision:
        cfg = self.config
        names = cfg.candidates if "ar" in cfg.candidates else cfg.candidates + ("ar",)
        scores = strategy_scores(inputs, names)
        ar_score = scores["ar"]
        if "ar" not in cfg.candidates:
            del scores["ar"]
        if cfg.fixed is not None:
            chosen = cfg.fixed
        else:
            chosen = max(cfg.candidates, key=lambda n: scores[n])  # first listed wins ties
            challenger, self._challenger = self._challenger, None
            if current in scores and current in cfg.candidates and chosen != current:
                if scores[chosen] <= scores[current] * (1 + cfg.hysteresis):
                    chosen = current
                else:
                    wins = challenger[1] + 1 if challenger and challenger[0] == chosen else 1
                    if wins < cfg.switch_after:
                        self._challenger, chosen = (chosen, wins), current
        return StrategyDecision(chosen, scores, inputs, _decision_b_star(inputs, cfg.candidates),
                                scores[chosen] / ar_score)


def _decision_b_star(inputs: StrategyInputs, candidates: tuple[str, ...]) -> float:
    fast = [n[4:] for n in ("ssd+suffix", "ssd+random") if n in candidates]
    if "ssd+neural" not in candidates or not fast:
        return math.nan
    p, e = inputs.p_hit, inputs.tokens
    best_fast = max(p * e["hit"] + (1 - p) * e[f] for f in fast)
    neural = p * e["hit"] + (1 - p) * e["neural"]
    return b_star(p, neural, best_fast, inputs.draft_seconds["neural"] / inputs.verify_seconds)


# ----------------------------------------------------------------------------------------------
# Live estimates


@dataclass(frozen=True)
class EstimatesConfig:
    """k: speculated tokens per round. halflife_rounds: EMA half-life, in rounds, of every estimate.
    prior_accept: per-speculator acceptance a before data; tokens priors are E(prior a, k).
    prior_p_hit: hit rate before data. prior_weight: the priors' weight, in sequence-rounds
    (resp. judged tokens). prior_time_units: times before measurement, in verify units.
    """

    k: int
    halflife_rounds: float = 50.0
    prior_p_hit: float = 0.6
    prior_accept: Mapping[str, float] = field(
        default_factory=lambda: {"neural": 0.6, "suffix": 0.3, "random": 0.0})
    prior_weight: float = 4.0
    prior_time_units: Mapping[str, float] = field(
        default_factory=lambda: {"primary": 0.9, "overhead": 0.0, "decode": 1.0, "neural": 0.5, "suffix": 0.01,
                                 "random": 0.0})

    def __post_init__(self):
        if not isinstance(self.k, int) or self.k < 1:
            raise ValueError(f"EstimatesConfig.k must be an integer >= 1, got {self.k!r}")
        if not self.halflife_rounds > 0:
            raise ValueError(f"EstimatesConfig.halflife_rounds must be > 0, got {self.halflife_rounds!r}")
        if not 0.0 <= self.prior_p_hit <= 1.0:
            raise ValueError(f"EstimatesConfig.prior_p_hit must be in [0, 1], got {self.prior_p_hit!r}")
        if set(self.prior_accept) != set(SPECULATORS) or not all(0 <= v <= 1 for v in self.prior_accept.values()):
            raise ValueError(f"EstimatesConfig.prior_accept needs {SPECULATORS} in [0, 1], got {self.prior_accept!r}")
        if not self.prior_weight > 0:
            raise ValueError(f"EstimatesConfig.prior_weight must be > 0, got {self.prior_weight!r}")
        needed = {"primary", "overhead", "decode"} | set(SPECULATORS)
        if set(self.prior_time_units) != needed or not all(v >= 0 for v in self.prior_time_units.values()):
            raise ValueError(f"EstimatesConfig.prior_time_units needs keys {sorted(needed)} >= 0")
        object.__setattr__(self, "prior_accept", dict(self.prior_accept))
        object.__setattr__(self, "prior_time_units", dict(self.prior_time_units))


class _Ratio:
    """Exponentially weighted num / den, starting from a prior worth `weight` denominator units."""

    def __init__(self, prior: float, weight: float, decay: float):
        self.num, self.den, self.decay = prior * weight, weight, decay

    def add(self, num: float, den: float) -> None:
        self.num = self.decay * self.num + num
        self.den = self.decay * self.den + den

    @property
    def value(self) -> float:
        return self.num / self.den


class _Mean(_Ratio):
    """Exponentially weighted mean of the values seen: a `_Ratio` with no prior and one denominator
    unit per value (normalised: the first value is not held at full weight, so one slow warm-up round
    fades as soon as steady ones arrive). None before the first value."""

    def __init__(self, decay: float):
        super().__init__(0.0, 0.0, decay)

    def add(self, x: float) -> None:
        super().add(x, 1.0)

    @property
    def value(self) -> float | None:
        return self.num / self.den if self.den else None


class _RecentMedian:
    """Median of the last `size` values: for AR's decode time, measured by rare one-step calibrations
    (and by AR rounds), where one outlier (a first, cold forward) must not set the estimate."""

    def __init__(self, size: int):
        self.values: list[float] = []
        self.size = size

    def add(self, x: float) -> None:
        self.values = (self.values + [x])[-self.size:]

    @property
    def value(self) -> float | None:
        if not self.values:
            return None
        ordered = sorted(self.values)
        n = len(ordered)
        return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


class _BatchTimes:
    """A time per round as a function of the batch size b: one estimator (`make()`) per b seen, and for
    a b not seen, a line t = alpha + beta*b fitted to the others (least squares over their estimates,
    weighted by how often each was measured; alpha, beta >= 0: a forward costs a fixed weight read plus
    work per sequence). The slope is shrunk towards the prior shape t ∝ b + B0 through the data's mean
    (B0 = BATCH_PRIOR sequences cost what the weight read costs) with the weight of a spread of B0 in b:
    with one b seen, or sizes close together (16 and 15 at the end of a generation, whose slope is
    noise), t(b) = t(b0) * (b + B0) / (b0 + B0); sizes spread widely set the slope themselves. The
    batch shrinks at the end of a generation and grows as rollouts are admitted; a time measured at 16
    sequences says little about 3 otherwise."""

    BATCH_PRIOR = 4.0

    def __init__(self, make):
        self.make = make
        self.by_batch: dict[int, object] = {}
        self.counts: dict[int, int] = {}

    def add(self, batch: int, seconds: float) -> None:
        if batch not in self.by_batch:
            self.by_batch[batch], self.counts[batch] = self.make(), 0
        self.by_batch[batch].add(seconds)
        self.counts[batch] += 1

    def value(self, batch: int) -> float | None:
        if batch in self.by_batch:
            return self.by_batch[batch].value
        if not self.by_batch:
            return None
        points = [(b, est.value, self.counts[b]) for b, est in self.by_batch.items()]
        w = sum(n for _, _, n in points)
        mb = sum(n * b for b, _, n in points) / w
        mt = sum(n * t for _, t, n in points) / w
        sxx = sum(n * (b - mb) ** 2 for b, _, n in points)
        sxy = sum(n * (b - mb) * (t - mt) for b, t, n in points)
        prior_slope, prior_weight = mt / (mb + self.BATCH_PRIOR), w * self.BATCH_PRIOR**2
        beta = max(0.0, (sxy + prior_weight * prior_slope) / (sxx + prior_weight))
        alpha = mt - beta * mb
        if alpha < 0:  # through the origin instead: t = beta * b
            alpha, beta = 0.0, sum(n * b * t for b, t, n in points) / sum(n * b * b for b, _, n in points)
        return alpha + beta * batch


class LiveEstimates:
    """Per-round counters in, `StrategyInputs` out.

    Every estimate is a ratio of exponentially weighted sums (each `observe_*` call first decays the
    sums it updates by 0.5^(1/halflife_rounds), so the half-life counts calls: one per round and path),
    so busy rounds weigh more than quiet ones and old rounds fade: in RL the policy moves every step
    and hit rate and acceptance drift with it. Priors enter as pseudo-counts that fade the same way.
    Paths: "hit" = chain from the speculation cache (drafted by the neural draft); "neural",
    "suffix", "random" = chain from that speculator on demand.
    Times are per batch size (`_BatchTimes`): normalised exponentially weighted means of the
    measurements (a prior time is used until the first one); AR's decode time, measured rarely, is the
    median of its last DECODE_WINDOW values.
    """

    DECODE_WINDOW = 15

    PATHS = ("hit",) + SPECULATORS
    TIMES = ("verify", "primary", "overhead", "decode") + SPECULATORS

    def __init__(self, config: EstimatesConfig):
        self.config = config
        d = 0.5 ** (1.0 / config.halflife_rounds)
        w = config.prior_weight
        self._hit = _Ratio(config.prior_p_hit, w, d)
        a = config.prior_accept
        self._accept = {s: _Ratio(a[s], w, d) for s in SPECULATORS}
        e = tokens_from_acceptance(a, config.k)
        self._tokens = {path: _Ratio(e[path], w, d) for path in self.PATHS}
        self._times = {name: _BatchTimes((lambda: _RecentMedian(self.DECODE_WINDOW)) if name == "decode"
                                         else (lambda: _Mean(d)))
                       for name in self.TIMES}

    def observe_cache(self, hits: int, misses: int) -> None:
        """Sequences whose verdict was found in the speculation cache this round, and those that were not."""
        if hits < 0 or misses < 0:
            raise ValueError(f"hits and misses must be >= 0, got {hits}, {misses}")
        self._hit.add(hits, hits + misses)

    def observe_round(self, path: str, sequences: int, accepted: int, judged: int, emitted: int) -> None:
        """One round's verification results for the sequences whose chain came by `path`."""
        if path not in self.PATHS:
            raise ValueError(f"unknown path {path!r}; known: {self.PATHS}")
        if not (0 <= accepted <= judged and sequences >= 0 and emitted >= 0):
            raise ValueError(
                f"bad counts: sequences={sequences}, accepted={accepted}, judged={judged}, emitted={emitted}"
            )
        if sequences == 0:
            return
        kind = "neural" if path == "hit" else path
        self._accept[kind].add(accepted, judged)
        self._tokens[path].add(emitted, sequences)

    def observe_time(self, name: str, seconds: float, batch: int) -> None:
        """A measured time per round of a batch of `batch` sequences: "verify", "primary" (T_p),
        "overhead" (T_o), "decode" (one AR step), or a speculator name (the target's wait for K tokens
        drafted with it: T_SD for "neural", T_b for backups)."""
        if name not in self.TIMES:
            raise ValueError(f"unknown time {name!r}; known: {self.TIMES}")
        if not seconds >= 0:
            raise ValueError(f"time must be >= 0, got {seconds!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be an integer >= 1, got {batch!r}")
        self._times[name].add(batch, seconds)

    @property
    def p_hit(self) -> float:
        return self._hit.value

    def accept_rate(self, speculator: str) -> float:
        return self._accept[speculator].value

    def tokens_per_round(self, path: str) -> float:
        return self._tokens[path].value

    def seconds(self, name: str, batch: int) -> float:
        """A time estimate at `batch` sequences; before any measurement of it: its prior in verify units
        times the verify time."""
        t = self._times[name].value(batch)
        if t is not None:
            return t
        verify = None if name == "verify" else self._times["verify"].value(batch)
        if verify is None:
            raise ValueError(f"no measurement of {name!r} nor of the verify time yet")
        return self.config.prior_time_units[name] * verify

    def inputs(self, batch_size: int) -> StrategyInputs:
        k = self.config.k
        return StrategyInputs(
            p_hit=self.p_hit,
            tokens={path: min(max(self.tokens_per_round(path), 1.0), k + 1.0) for path in self.PATHS},
            draft_seconds={s: self.seconds(s, batch_size) for s in SPECULATORS},
            primary_seconds=self.seconds("primary", batch_size),
            overhead_seconds=self.seconds("overhead", batch_size),
            verify_seconds=self.seconds("verify", batch_size),
            decode_seconds=self.seconds("decode", batch_size),
            batch_size=batch_size,
            k=k,
        )
