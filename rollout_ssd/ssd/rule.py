"""The strategy rule: which way to speculate, scored from live estimates (Theorem 7, Corollary 9,
Corollary 16 / Theorem 17). The estimates themselves are ssd/estimates.py.

Time is in verify units (one target verify forward of the batch = 1). Per sequence and round:

    E(a, K) = (1 - a^(K+1)) / (1 - a)                         tokens per round at acceptance a
    S_SSD   = [p·E_hit + (1-p)·E_miss] / [p·(max(1, T_p) + T_o) + (1-p)·(1 + T_b)]   (Theorem 7, T_o = 0)
    S_SD    = E_SD / (1 + T_SD)

A batch of b sequences hits entirely with probability p^b (hits are independent, Corollary 16); one
miss makes the whole batch wait for the backup. `StrategyRule` scores every strategy as batch tokens per
second with

    ssd+X:  b·[p·E_hit + (1-p)·E_X] / ( p^b·(max(1, T_p) + T_o) + (1 - p^b)·(1 + T_X) ) / t_verify
    sd, suffix (plain speculation with that speculator):  b·E / (t_plain + t_draft)
(t_plain, and SD's t_draft: the verify and the drafting of a round with no cache build beside it, which
on a CPU run on the worker's core too; t_verify and T_SD's time where they cost the same)
    ar:     b / t_decode

which is Theorem 7 at b = 1 and Theorem 17's two expressions when T_p <= 1 and the fast backup costs 0,
so between "ssd+neural" and one zero-cost fast backup the rule picks the draft backup exactly when b < b*.
AR's round is one decode step, not a K+1-token verify: on a CPU these differ, hence t_decode
(THEORY: tokens/s over AR = S × t_decode / t_verify).

Every draft-side time is what the TARGET waits, measured on the target side: T_X (and T_SD) is the wait
for chains drafted on demand, request to validated reply, so it includes the transfer of the chains and
their q; T_o is the wait on a round whose chains all came from the cache, less any part of the cache
build that outlasted the verify (T_p already counts that): the transfer cost the theorem leaves out
(T_o = 0). Left out, they made SD and SSD look as fast as AR at batch 16 on a CPU when they were
slower (bench/RESULTS.md, the rule traces).

Names: a strategy is named by its label (what `ssd/strategy` and `ssd/scores` report: "ssd+neural",
"ssd+suffix", "ssd+random", "sd", "suffix", "ar"); the inputs are keyed by the speculator that drafts
("draft" = the draft model, "suffix", "random"; SPECULATORS) and "hit" for chains from the cache.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from rollout_ssd.config import SPECULATORS

SSD_BACKUPS = {"ssd+neural": "draft", "ssd+suffix": "suffix", "ssd+random": "random"}  # label -> covers misses
PLAIN = {"sd": "draft", "suffix": "suffix"}  # plain speculation: label -> its speculator
STRATEGIES = (*SSD_BACKUPS, *PLAIN, "ar")


def expected_tokens_per_round(a: float, K: int) -> float:
    """E(a, K) = (1 - a^(K+1)) / (1 - a) = sum_{i<=K} a^i; K + 1 at a = 1."""
    if not 0.0 <= a <= 1.0:
        raise ValueError(f"a must be in [0, 1], got {a!r}")
    if not isinstance(K, int) or K < 0:
        raise ValueError(f"K must be an integer >= 0, got {K!r}")
    return sum(a**i for i in range(K + 1))  # the sum form is exact at and near a = 1


def tokens_from_acceptance(accept: Mapping[str, float], K: int) -> dict[str, float]:
    """E(a, K) per path from per-speculator acceptance; cache hits carry draft-model chains."""
    tokens = {s: expected_tokens_per_round(accept[s], K) for s in SPECULATORS}
    return {"hit": tokens["draft"], **tokens}


def ssd_speedup(p_hit: float, E_hit: float, E_miss: float, T_p: float, T_b: float, T_o: float = 0.0) -> float:
    """Theorem 7: SSD speedup over AR (verify = 1 time unit); T_o: the hit path's transfer overhead."""
    return (p_hit * E_hit + (1 - p_hit) * E_miss) / (p_hit * (max(1.0, T_p) + T_o) + (1 - p_hit) * (1 + T_b))


def sd_speedup(E_sd: float, T_sd: float) -> float:
    """Theorem 7: SD speedup over AR."""
    return E_sd / (1.0 + T_sd)


def b_star(p: float, N: float, F: float, T_n: float) -> float:
    """Theorem 17: the draft backup (SpecConfig.backup="neural") beats a zero-cost fast backup iff batch size b < b*.

    p: per-sequence hit rate; N, F: tokens per round per sequence with the draft / fast backup;
    T_n: draft backup latency (verify units). b* = ln(1 - (R - 1)/T_n) / ln p with R = N / F;
    math.inf when R - 1 >= T_n (the draft always better); 0.0 when it is never better (R <= 1, or
    p = 0 with R < 1 + T_n, or p = 1 with R <= 1).
    """
    if not 0.0 <= p <= 1.0 or N <= 0 or F <= 0 or T_n < 0:
        raise ValueError(f"bad b* inputs: p={p}, N={N}, F={F}, T_n={T_n}")
    R = N / F
    if R - 1.0 >= T_n:
        return math.inf
    if R <= 1.0 or p == 0.0:
        return 0.0
    if p == 1.0:  # the batch always hits: the draft costs nothing extra and R > 1
        return math.inf
    return max(0.0, math.log(1.0 - (R - 1.0) / T_n) / math.log(p))


@dataclass(frozen=True)
class StrategyInputs:
    """Live estimates for one decision. Times in seconds, for the whole batch, per round.

    tokens: E per round per sequence when a chain comes from: "hit" (the speculation cache) or a
        speculator run on demand ("draft", "suffix", "random").
    draft_seconds: time to draft K tokens serially with each speculator (SD / backup latency T_b).
    primary_seconds: T_p, cache construction per round. decode_seconds: one AR decode step.
    overhead_seconds: T_o, the target's wait for cached chains beyond T_p (their transfer).
    plain_verify_seconds: the verify of a plain speculation round, which has no cache build beside it
        (on a CPU the target then runs on the worker's core too: ssd/cores.py); None = verify_seconds.
    plain_draft_seconds: SD's drafting of K tokens (on a CPU in the target's process, on every core);
        None = draft_seconds["draft"].
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
    plain_verify_seconds: float | None = None
    plain_draft_seconds: float | None = None

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
        if self.plain_verify_seconds is not None and not self.plain_verify_seconds > 0:
            raise ValueError(f"StrategyInputs.plain_verify_seconds must be > 0, got {self.plain_verify_seconds!r}")
        if self.plain_draft_seconds is not None and not self.plain_draft_seconds >= 0:
            raise ValueError(f"StrategyInputs.plain_draft_seconds must be >= 0, got {self.plain_draft_seconds!r}")
        object.__setattr__(self, "tokens", dict(self.tokens))
        object.__setattr__(self, "draft_seconds", dict(self.draft_seconds))


@dataclass(frozen=True)
class StrategyDecision:
    chosen: str
    scores: dict[str, float]  # batch tokens per second, per candidate
    inputs: StrategyInputs
    b_star: float  # Theorem 17 (the draft vs the better zero-cost fast backup), nan if not applicable
    predicted_speedup: float  # chosen score / AR score


def strategy_scores(inputs: StrategyInputs, names: tuple[str, ...] = STRATEGIES) -> dict[str, float]:
    """Batch tokens per second of each named strategy (formulas in the module docstring)."""
    b, p, tv = inputs.batch_size, inputs.p_hit, inputs.verify_seconds
    all_hit = p**b
    t_p = inputs.primary_seconds / tv
    t_o = inputs.overhead_seconds / tv
    scores = {}
    for name in names:
        if name in SSD_BACKUPS:
            backup = SSD_BACKUPS[name]
            per_seq = p * inputs.tokens["hit"] + (1 - p) * inputs.tokens[backup]
            t_b = inputs.draft_seconds[backup] / tv
            time_units = all_hit * (max(1.0, t_p) + t_o) + (1 - all_hit) * (1 + t_b)
            scores[name] = b * per_seq / time_units / tv
        elif name in PLAIN:
            kind = PLAIN[name]
            t_plain = inputs.plain_verify_seconds or tv
            t_draft = inputs.draft_seconds[kind]
            if kind == "draft" and inputs.plain_draft_seconds is not None:
                t_draft = inputs.plain_draft_seconds
            scores[name] = b * inputs.tokens[kind] / (t_plain + t_draft)
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
    fast = [SSD_BACKUPS[n] for n in ("ssd+suffix", "ssd+random") if n in candidates]
    if "ssd+neural" not in candidates or not fast:
        return math.nan
    p, e = inputs.p_hit, inputs.tokens
    best_fast = max(p * e["hit"] + (1 - p) * e[f] for f in fast)
    with_draft = p * e["hit"] + (1 - p) * e["draft"]
    return b_star(p, with_draft, best_fast, inputs.draft_seconds["draft"] / inputs.verify_seconds)

