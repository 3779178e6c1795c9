"""The SSD formulas (docs/THEORY.md §3): fan-out (Theorem 12), Saguaro sampling (Definition 14), strategy
(Theorem 7, Corollary 9, Corollary 16 / Theorem 17). Pure maths on CPU; every random draw is seeded."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import minimize

from rollout_ssd.config import SpecConfig
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.estimates import EstimatesConfig, LiveEstimates
from rollout_ssd.ssd.fanout import (
    FanoutConfig,
    FanoutPlanner,
    expected_miss_rate,
    geometric_fanout,
    geometric_fanout_real,
    optimal_miss_rate,
    outcome_weights,
)
from rollout_ssd.ssd.rule import (
    STRATEGIES,
    StrategyConfig,
    StrategyInputs,
    StrategyRule,
    b_star,
    expected_tokens_per_round,
    sd_speedup,
    ssd_speedup,
    strategy_scores,
    tokens_from_acceptance,
)
from rollout_ssd.ssd.saguaro import (
    acceptance_probability,
    adaptive_c,
    entropy,
    hit_probability,
    saguaro_probs,
    top_f_mask,
)

GRID = [(a, K, B, r) for a in (0.05, 0.3, 0.5, 0.62, 0.8, 0.97) for K in (1, 3, 5, 8)
        for B in (0, 3, 7, 23, 64) for r in (0.5, 1.0, 2.0)]


# ---------------------------------------------------------------------------------------------- fan-out


def theory_closed_form(a, K, B, r):
    """docs/THEORY.md's formula, written out independently of the module."""
    c = a ** (1 / (1 + r))
    cap = (1 - a) ** (-1 / (1 + r))
    f0 = B / ((1 - c**K) / (1 - c) + c**K * cap)
    return [f0 * c**k for k in range(K)] + [f0 * c**K * cap]


@pytest.mark.parametrize("a", sorted({g[0] for g in GRID}))
def test_fanout_real_matches_closed_form_and_proportionality(a):
    for _, K, B, r in [g for g in GRID if g[0] == a]:
        check_real_fanout(a, K, B, r)


def check_real_fanout(a, K, B, r):
    real = geometric_fanout_real(a, K, B, r)
    assert len(real) == K + 1
    np.testing.assert_allclose(real, theory_closed_form(a, K, B, r), rtol=1e-12, atol=1e-12)
    w = np.array(outcome_weights(a, K)) ** (1 / (1 + r))  # F_k ∝ w_k^(1/(1+r))
    np.testing.assert_allclose(real, B * w / w.sum(), rtol=1e-10, atol=1e-12)
    assert math.isclose(sum(real), B, rel_tol=1e-12, abs_tol=1e-12)


@pytest.mark.parametrize("a", sorted({g[0] for g in GRID}))
def test_fanout_rounding_sums_to_budget_within_one(a):
    for _, K, B, r in [g for g in GRID if g[0] == a]:
        check_rounded_fanout(a, K, B, r)


def check_rounded_fanout(a, K, B, r):
    real = geometric_fanout_real(a, K, B, r)
    ints = geometric_fanout(a, K, B, r)
    assert all(isinstance(f, int) and f >= 0 for f in ints)
    assert sum(ints) == B
    assert all(abs(f - x) < 1 for f, x in zip(ints, real, strict=True))
    # non-increasing in depth below K, both real and rounded
    assert all(real[k] >= real[k + 1] for k in range(K - 1))
    assert all(ints[k] >= ints[k + 1] for k in range(K - 1))
    # the all-accepted outcome gets more than depth K-1 exactly when a > 1/2: F_K/F_{K-1} = (a/(1-a))^(1/(1+r))
    if B > 0 and a == 0.5:
        assert real[K] == pytest.approx(real[K - 1])
    elif B > 0:
        assert (real[K] > real[K - 1]) == (a > 0.5)


def test_fanout_edge_cases():
    assert geometric_fanout(0.0, 5, 23) == [23, 0, 0, 0, 0, 0]  # a -> 0: only depth 0 happens
    assert geometric_fanout(1.0, 5, 23) == [0, 0, 0, 0, 0, 23]  # a -> 1: only "all accepted" happens
    assert geometric_fanout(0.7, 0, 9) == [9]
    assert geometric_fanout(0.7, 5, 0) == [0] * 6
    small = geometric_fanout(0.6, 5, 3)  # B < K+1: some depths uncached
    assert sum(small) == 3 and small.count(0) == 3
    for bad in [(-0.1, 5, 8, 1.0), (1.5, 5, 8, 1.0), (math.nan, 5, 8, 1.0), (0.5, -1, 8, 1.0),
                (0.5, 5, -1, 1.0), (0.5, 5, 8, 0.0), (0.5, 5, 8.0, 1.0)]:
        with pytest.raises(ValueError):
            geometric_fanout(*bad)


@pytest.mark.parametrize("a,K,B,r", [(0.3, 3, 10, 1.0), (0.7, 5, 23, 1.0), (0.85, 5, 40, 0.5),
                                     (0.6, 4, 17, 2.0), (0.55, 7, 30, 1.3)])
def test_real_fanout_minimises_miss_rate(a, K, B, r):
    w = np.array(outcome_weights(a, K))
    real = np.array(geometric_fanout_real(a, K, B, r))
    best = float(np.sum(w * real ** (-r)))
    assert math.isclose(best, optimal_miss_rate(a, K, B, r), rel_tol=1e-10)
    assert math.isclose(best, expected_miss_rate(real.tolist(), a, r), rel_tol=1e-10)
    # scipy on the simplex {F > 0, sum F = B}, from a uniform start
    res = minimize(lambda f: float(np.sum(w * f ** (-r))), np.full(K + 1, B / (K + 1)), method="SLSQP",
                   bounds=[(1e-3, B)] * (K + 1), constraints=[{"type": "eq", "fun": lambda f: f.sum() - B}],
                   options={"ftol": 1e-14, "maxiter": 500})
    assert res.success
    assert best <= res.fun + 1e-9
    np.testing.assert_allclose(res.x, real, rtol=2e-3, atol=2e-3 * B)
    # random sum-preserving perturbations never do better
    rng = np.random.default_rng(0)
    for _ in range(500):
        d = rng.normal(size=K + 1)
        d -= d.mean()
        f = real + rng.uniform(0.001, 0.3) * d * real.min()
        assert np.all(f > 0)
        assert float(np.sum(w * f ** (-r))) >= best - 1e-12


def test_rounded_fanout_miss_rate_close_to_optimum():
    for a in (0.5, 0.7, 0.9):
        ints = geometric_fanout(a, 5, 30)
        assert expected_miss_rate(ints, a) <= 1.25 * optimal_miss_rate(a, 5, 30)
    assert expected_miss_rate([3, 0], 0.5) == pytest.approx(0.5 / 3 + 0.5)  # F=0: certain miss


def test_planner_fits_r_from_synthetic_hits():
    """Misses drawn as Bernoulli(0.8·F^-r) at F in {2,4,8,16}, 4,000 each; the 0.8 factor tests that
    only the slope matters. Over 300 simulated repeats the estimate's bias was <= 0.025 and its sd
    <= 0.04 (r = 1.5, the noisiest case), so |r̂ - r| < 0.2 is >= 4.4 sd from the mean: a fresh seed
    fails with probability < 1e-5 per case. Seeded here, so deterministic."""
    rng = np.random.default_rng(1234)
    fans = np.repeat([2, 4, 8, 16], 4000)
    for r_true in (0.7, 1.0, 1.5):
        planner = FanoutPlanner(FanoutConfig(k=5))
        miss = rng.random(fans.size) < 0.8 * fans.astype(float) ** -r_true
        planner.observe_cache(fans.tolist(), (~miss).tolist())
        assert abs(planner.r - r_true) < 0.2, (r_true, planner.r)


def test_planner_r_prior_dominates_thin_data_and_fanout_zero_ignored():
    rng = np.random.default_rng(7)
    planner = FanoutPlanner(FanoutConfig(k=5, r_prior=1.0))
    assert planner.r == 1.0
    fans = np.repeat([2, 4, 8, 16], 4)
    miss = rng.random(fans.size) < fans.astype(float) ** -2.5
    planner.observe_cache(fans.tolist(), (~miss).tolist())
    assert abs(planner.r - 1.0) < 0.35
    one_value = FanoutPlanner(FanoutConfig(k=5))
    one_value.observe_cache([4] * 100 + [0] * 50, [True] * 60 + [False] * 90)  # one F: no slope info
    assert one_value.r == 1.0


def test_planner_acceptance_budget_and_plan():
    cfg = FanoutConfig(k=4, a_prior=0.5, a_prior_weight=10.0, max_budget=40)
    planner = FanoutPlanner(cfg)
    assert planner.a == 0.5 and planner.budget == cfg.min_budget == 5
    planner.observe_acceptance(accepted=700, judged=1000)
    assert planner.a == pytest.approx((5 + 700) / 1010)
    # construction = 2 ms fixed + 0.5 ms per unit; verify 10 ms, 90% usable -> (9 - 2)/0.5 = 14
    for budget in (5, 10, 20):
        planner.observe_timing(construct_seconds=0.002 + 0.0005 * budget, budget=budget,
                               verify_seconds=0.010, fixed_seconds=0.002)
    assert planner.budget == 14
    plan = planner.plan()
    assert plan.budget == 14 and sum(plan.fanout) == 14 and len(plan.fanout) == 5
    assert plan.fanout == tuple(geometric_fanout(planner.a, 4, 14, planner.r))
    assert plan.predicted_miss_rate == pytest.approx(expected_miss_rate(plan.fanout, plan.a, plan.r))
    slow = FanoutPlanner(cfg)  # construction cannot fit: budget floors at min_budget
    slow.observe_timing(construct_seconds=0.05, budget=10, verify_seconds=0.01)
    assert slow.budget == cfg.min_budget
    fixed = FanoutPlanner(FanoutConfig(k=4, budget=9))
    fixed.observe_timing(0.05, 10, 0.01)
    assert fixed.budget == 9
    manual = FanoutPlanner(FanoutConfig(k=2, manual=(4, 2, 3)))
    assert manual.plan().fanout == (4, 2, 3) and manual.plan().budget == 9


def test_planner_decay_tracks_drift():
    planner = FanoutPlanner(FanoutConfig(k=3, decay=0.9))
    for _ in range(100):
        planner.observe_acceptance(9, 10)
    for _ in range(100):
        planner.observe_acceptance(2, 10)
    assert abs(planner.a - 0.2) < 0.01


@pytest.mark.parametrize("kwargs", [
    {"k": 0}, {"k": 3, "manual": (1, 2)}, {"k": 2, "manual": (0, 0, 0)}, {"k": 2, "manual": (1, -1, 2)},
    {"k": 3, "budget": 0}, {"k": 3, "min_budget": 10, "max_budget": 5}, {"k": 3, "initial_budget": 100},
    {"k": 3, "a_prior": 1.5}, {"k": 3, "r_prior": 10.0}, {"k": 3, "r_bounds": (0.0, 2.0)},
    {"k": 3, "decay": 0.0}, {"k": 3, "time_fraction": 1.5}, {"k": 3, "r_prior_weight": 0.0},
])
def test_fanout_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        FanoutConfig(**kwargs)
    with pytest.raises(TypeError):
        FanoutConfig(k=3, unknown_option=1)


# ---------------------------------------------------------------------------------------------- Saguaro

P_EX = torch.tensor([0.48, 0.48, 0.02, 0.02], dtype=torch.float64)
Q_EX = torch.tensor([0.49, 0.49, 0.01, 0.01], dtype=torch.float64)


def test_saguaro_probs_normalised_and_closed_form():
    g = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(6, 50, generator=g, dtype=torch.float64) * 2, dim=-1)
    mask = top_f_mask(q, 5)
    assert mask.sum(dim=-1).eq(5).all()
    assert torch.equal(saguaro_probs(q, mask, 1.0), q / q.sum(-1, keepdim=True))
    for C in (0.9, 0.3, 0.01):
        q_c = saguaro_probs(q, mask, C)
        torch.testing.assert_close(q_c.sum(-1), torch.ones(6, dtype=torch.float64))
        Z = 1 - (1 - C) * (q * mask).sum(-1, keepdim=True)  # THEORY: C·q/Z on S, q/Z off S
        torch.testing.assert_close(q_c, torch.where(mask, C * q / Z, q / Z))
    c_rows = torch.tensor([1.0, 0.5, 0.2, 0.9, 0.1, 0.7], dtype=torch.float64)
    per_row = saguaro_probs(q, mask, c_rows)
    for i in range(6):
        torch.testing.assert_close(per_row[i], saguaro_probs(q[i:i + 1], mask[i:i + 1], float(c_rows[i]))[0])
    for bad in (0.0, 1.5, torch.tensor([0.5, 0.0, 1, 1, 1, 1])):
        with pytest.raises(ValueError):
            saguaro_probs(q, mask, bad)


def test_saguaro_paper_example():
    """docs/THEORY.md's 4-token example, C = 47/147. The cache holds F = 2 tokens: the engine's rule is the
    top-F draft tokens excluding the one sent, and Saguaro downweights the top-F = {0, 1}.
    Before: rejection happens only when s ∈ {0, 1} (p < q there), the residual is uniform on {2, 3},
    and the cache {the other of 0/1, token 2} catches half of it: 50%. After: only s ∈ {2, 3} can be
    rejected, the residual is uniform on {0, 1}, both cached: 100%."""
    mask = torch.tensor([[True, True, False, False]])
    q_c = saguaro_probs(Q_EX[None], mask, 47 / 147)[0]
    torch.testing.assert_close(q_c, torch.tensor([0.47, 0.47, 0.03, 0.03], dtype=torch.float64))
    assert float(acceptance_probability(P_EX, Q_EX)) == pytest.approx(0.98)
    assert float(acceptance_probability(P_EX, q_c)) == pytest.approx(0.98)
    assert hit_probability(P_EX, Q_EX, 2, 1.0) == pytest.approx(0.5)
    assert hit_probability(P_EX, Q_EX, 2, 47 / 147) == pytest.approx(1.0)
    # with a fixed cached set {0, 1} (no (F+1)-th token stepping in) the move is 0% -> 100%
    assert hit_probability(P_EX, Q_EX, [0, 1], 1.0) == pytest.approx(0.0)
    assert hit_probability(P_EX, Q_EX, mask[0], 47 / 147) == pytest.approx(1.0)


def test_hit_probability_matches_simulation():
    """Simulate the round at one position: s ~ q_C, accept with min(1, p/q_C), bonus ~ max(p - q_C, 0),
    cache = top-F of q excluding s. ~150k rejections, so the hit frequency has sd <= 0.0013; the
    tolerance 0.01 is > 7 sd: a fresh seed fails with probability < 1e-11."""
    g = torch.Generator().manual_seed(11)
    p = torch.tensor([0.05, 0.35, 0.1, 0.3, 0.05, 0.15], dtype=torch.float64)
    q = torch.tensor([0.4, 0.05, 0.25, 0.1, 0.15, 0.05], dtype=torch.float64)
    F, C, n = 2, 0.6, 400_000
    q_c = saguaro_probs(q[None], top_f_mask(q[None], F), C)[0]
    s = torch.multinomial(q_c, n, replacement=True, generator=g)
    rejected = torch.rand(n, generator=g, dtype=torch.float64) >= (p[s] / q_c[s]).clamp(max=1.0)
    bonus = torch.multinomial((p - q_c).clamp_min(0), int(rejected.sum()), replacement=True, generator=g)
    order = torch.sort(q, descending=True, stable=True).indices.tolist()
    cache = torch.zeros(6, 6, dtype=torch.bool)  # [sent token, cached token]
    for t in range(6):
        cache[t, [x for x in order if x != t][:F]] = True
    hit = cache[s[rejected], bonus].double()
    assert rejected.sum() > 100_000
    assert abs(float(hit.mean()) - hit_probability(p, q, F, C)) < 0.01


@settings(max_examples=150, deadline=None)
@given(st.integers(min_value=2, max_value=8).flatmap(lambda v: st.tuples(
    st.lists(st.floats(0.001, 1.0), min_size=v, max_size=v),
    st.lists(st.floats(0.001, 1.0), min_size=v, max_size=v),
    st.lists(st.booleans(), min_size=v, max_size=v),
    st.floats(0.01, 1.0), st.floats(0.01, 1.0))))
def test_hit_probability_non_increasing_in_c(case):
    """THEORY's derived claim, for a fixed cached set S: lowering C never lowers p_hit."""
    p_raw, q_raw, s_mask, c1, c2 = case
    p = torch.tensor(p_raw, dtype=torch.float64)
    q = torch.tensor(q_raw, dtype=torch.float64)
    p, q = p / p.sum(), q / q.sum()
    mask = torch.tensor(s_mask)
    lo, hi = min(c1, c2), max(c1, c2)
    assert hit_probability(p, q, mask, lo) >= hit_probability(p, q, mask, hi) - 1e-9


def test_hit_probability_engine_rule_not_monotone():
    """The caveat in hit_probability's docstring: with the (F+1)-th token stepping in, lowering C can
    lower the hit rate (token 1's residual shrinks while S = {0} never gets any)."""
    p = torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64)
    q = torch.tensor([0.8, 0.1, 0.1], dtype=torch.float64)
    assert hit_probability(p, q, 1, 1.0) == pytest.approx(1 / 7)
    assert hit_probability(p, q, 1, 0.5) == pytest.approx(1 / 17)


def test_adaptive_c_rule():
    h = torch.tensor([0.0, 0.5, math.log(8.0), 5.0])
    c = adaptive_c(h, c_min=0.3)
    assert c[0] == pytest.approx(1.0) and c[2] == pytest.approx(0.3) and c[3] == pytest.approx(0.3)
    assert bool((c[:-1] >= c[1:]).all())  # more entropy, lower C
    peaked = torch.tensor([[0.97, 0.01, 0.01, 0.01]])
    flat = torch.full((1, 16), 1 / 16)
    assert float(adaptive_c(entropy(peaked), 0.3)) > float(adaptive_c(entropy(flat), 0.3)) == pytest.approx(0.3)
    assert float(entropy(flat)) == pytest.approx(math.log(16))
    with pytest.raises(ValueError):
        adaptive_c(h, c_min=0.0)


# ---------------------------------------------------------------------------------------------- strategy


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.0, 5) == 1.0
    assert expected_tokens_per_round(1.0, 5) == 6.0
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    for a in (0.1, 0.6, 0.99):
        assert expected_tokens_per_round(a, 7) == pytest.approx((1 - a**8) / (1 - a))
    assert expected_tokens_per_round(1 - 1e-12, 4) == pytest.approx(5.0)


def test_speedups_hand_computed():
    # (0.8·4 + 0.2·3) / (0.8·1 + 0.2·1.5) = 3.8 / 1.1
    assert ssd_speedup(0.8, 4.0, 3.0, 0.5, 0.5) == pytest.approx(3.8 / 1.1)
    # T_p > 1 is paid on hits: (0.5·4 + 0.5·2) / (0.5·2 + 0.5·1) = 2
    assert ssd_speedup(0.5, 4.0, 2.0, 2.0, 0.0) == pytest.approx(2.0)
    assert sd_speedup(3.0, 0.5) == pytest.approx(2.0)


def test_corollary9_sandwich():
    for p in np.linspace(0, 1, 11):
        for T in np.linspace(0, 1, 11):
            for E in (1.0, 2.5, 4.0):
                ratio = ssd_speedup(p, E, E, T, T) / sd_speedup(E, T)
                assert ratio == pytest.approx((1 + T) / (1 + (1 - p) * T))
                assert 1 - 1e-12 <= ratio <= 1 + T + 1e-12


def test_b_star_edge_cases():
    assert b_star(0.8, 5.0, 3.0, 0.5) == math.inf  # R - 1 = 2/3 >= T_n
    assert b_star(0.8, 3.0, 3.0, 0.5) == 0.0  # R = 1: never strictly better
    assert b_star(0.8, 2.0, 3.0, 0.5) == 0.0
    assert b_star(0.0, 3.3, 3.0, 0.5) == 0.0  # always waits for the backup, R < 1 + T_n
    assert b_star(1.0, 3.3, 3.0, 0.5) == math.inf  # never waits
    # hand value: R = 1.1, T_n = 0.5 -> ln(0.8) / ln(0.9)
    assert b_star(0.9, 3.3, 3.0, 0.5) == pytest.approx(math.log(0.8) / math.log(0.9))


def two_option_inputs(p, e_hit, e_draft, e_fast, t_n, t_p, b):
    return StrategyInputs(p_hit=p, tokens={"hit": e_hit, "draft": e_draft, "suffix": 1.0, "random": e_fast},
                          draft_seconds={"draft": t_n * 0.02, "suffix": 0.0, "random": 0.0},
                          primary_seconds=t_p * 0.02, verify_seconds=0.02, decode_seconds=0.015,
                          batch_size=b, k=5)


def test_rule_reduces_to_b_star():
    rule = StrategyRule(StrategyConfig(candidates=("ssd+neural", "ssd+random")))
    checked = 0
    for p in (0.3, 0.6, 0.8, 0.9, 0.97):
        for e_hit, e_draft, e_fast in ((4.0, 4.0, 1.0), (5.0, 3.5, 2.0), (3.0, 3.0, 2.5), (2.0, 2.0, 1.9)):
            for t_n in (0.05, 0.2, 0.5, 1.0):
                for t_p in (0.3, 1.0):
                    N = p * e_hit + (1 - p) * e_draft
                    F = p * e_hit + (1 - p) * e_fast
                    bs = b_star(p, N, F, t_n)
                    for b in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128):
                        if abs(b - bs) < 1e-6:
                            continue
                        d = rule.decide(two_option_inputs(p, e_hit, e_draft, e_fast, t_n, t_p, b))
                        assert d.chosen == ("ssd+neural" if b < bs else "ssd+random"), (p, e_hit, t_n, b, bs)
                        assert d.b_star == bs
                        checked += 1
    assert checked > 1000


def test_rule_scores_match_theorem7_at_batch_one():
    inp = StrategyInputs(p_hit=0.7, tokens={"hit": 4.0, "draft": 3.5, "suffix": 2.0, "random": 1.0},
                         draft_seconds={"draft": 0.01, "suffix": 0.001, "random": 0.0},
                         primary_seconds=0.03, verify_seconds=0.02, decode_seconds=0.01, batch_size=1, k=5)
    s = strategy_scores(inp)
    assert set(s) == set(STRATEGIES)
    tv = 0.02
    assert s["ssd+neural"] == pytest.approx(ssd_speedup(0.7, 4.0, 3.5, 1.5, 0.5) / tv)
    assert s["ssd+suffix"] == pytest.approx(ssd_speedup(0.7, 4.0, 2.0, 1.5, 0.05) / tv)
    assert s["sd"] == pytest.approx(sd_speedup(3.5, 0.5) / tv)
    assert s["suffix"] == pytest.approx(sd_speedup(2.0, 0.05) / tv)
    assert s["ar"] == pytest.approx(100.0)
    d = StrategyRule(StrategyConfig()).decide(inp)
    assert d.chosen == max(s, key=s.get) and d.predicted_speedup == pytest.approx(s[d.chosen] / 100.0)
    # THEORY: tokens/s over AR = S × t_decode / t_verify
    assert s["ssd+neural"] / s["ar"] == pytest.approx(ssd_speedup(0.7, 4.0, 3.5, 1.5, 0.5) * 0.01 / 0.02)
    assert StrategyRule(StrategyConfig(fixed="ar")).decide(inp).chosen == "ar"
    sticky = StrategyRule(StrategyConfig(hysteresis=10.0)).decide(inp, current="sd")
    assert sticky.chosen == "sd"
    # the hit path's transfer overhead T_o adds to its time: max(1, T_p) + T_o
    slow = dataclasses.replace(inp, overhead_seconds=0.01)
    assert strategy_scores(slow)["ssd+neural"] == pytest.approx(ssd_speedup(0.7, 4.0, 3.5, 1.5, 0.5, 0.5) / tv)
    assert ssd_speedup(0.7, 4.0, 3.5, 1.5, 0.5, 0.5) == pytest.approx((0.7 * 4 + 0.3 * 3.5) / (0.7 * 2.0 + 0.3 * 1.5))


def test_plain_speculation_scored_at_its_own_verify_time():
    """SD's round has no cache build beside it (and on a CPU, the worker's core too): its score uses
    plain_verify_seconds; SSD's and AR's do not move with it; None means the verify time."""
    inp = StrategyInputs(p_hit=0.7, tokens={"hit": 4.0, "draft": 3.5, "suffix": 2.0, "random": 1.0},
                         draft_seconds={"draft": 0.01, "suffix": 0.001, "random": 0.0},
                         primary_seconds=0.03, verify_seconds=0.02, decode_seconds=0.01, batch_size=2, k=5)
    base = strategy_scores(inp)
    fast = strategy_scores(dataclasses.replace(inp, plain_verify_seconds=0.012))
    assert fast["sd"] == pytest.approx(2 * 3.5 / (0.012 + 0.01)) and base["sd"] == pytest.approx(2 * 3.5 / 0.03)
    assert fast["suffix"] == pytest.approx(2 * 2.0 / (0.012 + 0.001))
    assert all(fast[n] == base[n] for n in ("ssd+neural", "ssd+suffix", "ssd+random", "ar"))
    local = strategy_scores(dataclasses.replace(inp, plain_verify_seconds=0.012, plain_draft_seconds=0.004))
    assert local["sd"] == pytest.approx(2 * 3.5 / (0.012 + 0.004)) and local["suffix"] == fast["suffix"]
    assert local["ssd+neural"] == base["ssd+neural"]  # its misses are drafted by the worker: draft_seconds
    with pytest.raises(ValueError, match="plain_verify_seconds"):
        dataclasses.replace(inp, plain_verify_seconds=0.0)


def test_plain_verify_estimate_scaled_by_the_two_decode_times_until_measured():
    est = LiveEstimates(EstimatesConfig(k=3))
    est.observe_time("verify", 0.03, 4)
    assert est.inputs(4).plain_verify_seconds == pytest.approx(0.03)  # nothing to scale by yet
    est.observe_time("decode", 0.012, 4)  # an AR step on every core
    assert est.inputs(4).plain_verify_seconds == pytest.approx(0.03)  # no narrow step to compare with
    est.observe_time("decode_narrow", 0.02, 4)  # the same step on the target's own core
    assert est.inputs(4).plain_verify_seconds == pytest.approx(0.03 * 0.6)
    assert est.inputs(4).verify_seconds == pytest.approx(0.03)  # SSD's own verify is not scaled
    est.observe_time("decode", 0.04, 4)
    est.observe_time("decode", 0.04, 4)  # wider but slower: never scaled above the verify time
    assert est.inputs(4).plain_verify_seconds == pytest.approx(0.03)
    est.observe_time("plain_verify", 0.017, 4)  # measured: taken as it is
    assert est.inputs(4).plain_verify_seconds == pytest.approx(0.017)
    # SD's drafting: the draft model's time, scaled the same way until measured
    est.observe_time("draft", 0.01, 4)
    est.observe_time("decode", 0.012, 4)
    est.observe_time("decode", 0.012, 4)  # the median of the wide steps is back to 0.012
    assert est.inputs(4).plain_draft_seconds == pytest.approx(0.01 * 0.6)
    est.observe_time("drafting", 0.005, 4)  # the draft side's own drafting time: a closer base than the wait
    assert est.inputs(4).plain_draft_seconds == pytest.approx(0.005 * 0.6)
    est.observe_time("plain_draft", 0.004, 4)
    assert est.inputs(4).plain_draft_seconds == pytest.approx(0.004)
    assert est.inputs(4).draft_seconds["draft"] == pytest.approx(0.01)  # SSD's miss cost is not moved
    with pytest.raises(ValueError, match="unknown time"):
        est.observe_time("plain", 0.01, 4)


def test_rule_switches_only_after_winning_in_a_row():
    inp = StrategyInputs(p_hit=0.7, tokens={"hit": 4.0, "draft": 3.5, "suffix": 2.0, "random": 1.0},
                         draft_seconds={"draft": 0.01, "suffix": 0.001, "random": 0.0},
                         primary_seconds=0.03, verify_seconds=0.02, decode_seconds=0.01, batch_size=1, k=5)
    best = max(strategy_scores(inp), key=strategy_scores(inp).get)
    assert best != "ar"
    rule = StrategyRule(StrategyConfig(switch_after=3))
    assert [rule.decide(inp, current="ar").chosen for _ in range(3)] == ["ar", "ar", best]
    slow_ar = dataclasses.replace(inp, decode_seconds=0.001)  # AR wins one decision: the count restarts
    assert [rule.decide(x, current="ar").chosen for x in (inp, inp, slow_ar, inp, inp, inp)] == \
        ["ar", "ar", "ar", "ar", "ar", best]
    assert StrategyRule(StrategyConfig(switch_after=3)).decide(inp).chosen == best  # no current: at once


def test_batch_coupling_penalises_slow_backup():
    """Corollary 16: at b = 16, p = 0.8, the whole batch hits only 2.8% of the time."""
    inp = two_option_inputs(0.8, 4.0, 4.0, 1.0, 1.0, 0.5, 16)
    s = strategy_scores(inp, ("ssd+neural",))
    all_hit = 0.8**16
    assert s["ssd+neural"] == pytest.approx(16 * 4.0 / (all_hit + (1 - all_hit) * 2.0) / 0.02)


def test_live_estimates():
    est = LiveEstimates(EstimatesConfig(k=4, halflife_rounds=20.0))
    assert est.p_hit == pytest.approx(0.6)
    with pytest.raises(ValueError):
        est.inputs(8)  # no verify time yet
    est.observe_time("verify", 0.02, 8)
    prior_inputs = est.inputs(8)
    assert prior_inputs.draft_seconds["draft"] == pytest.approx(0.01)
    prior_a = {"draft": 0.6, "suffix": 0.3, "random": 0.0}
    assert prior_inputs.tokens == pytest.approx(tokens_from_acceptance(prior_a, 4))
    assert prior_inputs.tokens["hit"] == pytest.approx(expected_tokens_per_round(0.6, 4))
    for _ in range(400):
        est.observe_cache(hits=6, misses=2)
        est.observe_round("hit", sequences=6, accepted=18, judged=24, emitted=24)
        est.observe_round("random", sequences=2, accepted=0, judged=2, emitted=2)
        est.observe_time("primary", 0.015, 8)
        est.observe_time("random", 0.0005, 8)
    assert est.p_hit == pytest.approx(0.75, abs=1e-6)
    assert est.accept_rate("draft") == pytest.approx(0.75, abs=1e-6)
    assert est.accept_rate("random") == pytest.approx(0.0, abs=1e-6)
    inp = est.inputs(8)
    assert inp.tokens["hit"] == pytest.approx(4.0, abs=1e-6) and inp.tokens["random"] == pytest.approx(1.0)
    assert inp.primary_seconds == pytest.approx(0.015) and inp.draft_seconds["random"] == pytest.approx(0.0005)
    assert StrategyRule(StrategyConfig()).decide(inp).chosen in STRATEGIES
    for _ in range(400):  # drift: the hit rate falls; the estimate follows
        est.observe_cache(hits=2, misses=6)
    assert est.p_hit == pytest.approx(0.25, abs=1e-3)
    with pytest.raises(ValueError):
        est.observe_round("eagle", 1, 0, 1, 1)
    with pytest.raises(ValueError):
        est.observe_round("hit", 1, 3, 2, 1)


def test_live_time_estimates_forget_a_slow_first_measurement():
    """Times are normalised weighted means (a slow warm-up round does not stay at full weight) and AR's
    decode time is the median of its last few measurements (one outlier among them is ignored)."""
    est = LiveEstimates(EstimatesConfig(k=3, halflife_rounds=50.0))
    est.observe_time("verify", 1.0, 4)  # cold first round
    for _ in range(9):
        est.observe_time("verify", 0.1, 4)
    d = 0.5 ** (1 / 50)
    weights = [d**i for i in range(10)]  # newest first; the slow one is the oldest
    expected = (0.1 * sum(weights[:9]) + 1.0 * weights[9]) / sum(weights)
    assert est.seconds("verify", 4) == pytest.approx(expected) and est.seconds("verify", 4) < 0.2
    for t in (0.5, 0.07, 0.08, 0.075):
        est.observe_time("decode", t, 4)
    assert est.seconds("decode", 4) == pytest.approx(0.0775)  # median of 4: (0.075 + 0.08) / 2
    for t in (0.07, 0.07, 0.07, 0.07, 0.07):  # the window keeps the last LiveEstimates.DECODE_WINDOW
        est.observe_time("decode", t, 4)
    assert est.seconds("decode", 4) == pytest.approx(0.07)


def test_plain_speculation_times_are_medians_so_one_slow_round_does_not_tip_a_near_tie_to_ar():
    """SD's verify and drafting times are medians of their last few, as AR's step is: the two plans the
    rule weighs against each other on a CPU are read alike. At 4 sequences AR makes 4 / 0.045 = 88.9
    tok/s and SD (2 tokens a sequence a round) 8 / (0.065 + 0.018) = 96.4 at its medians; one host hiccup
    (a 0.2 s verify) among SD's five rounds leaves that estimate, where their mean (about 0.092 s) would
    put SD at 72.7, below AR. SSD's verify stays a mean."""
    est = LiveEstimates(EstimatesConfig(k=3, halflife_rounds=50.0))
    for _ in range(3):
        est.observe_time("decode", 0.045, 4)
    for verify in (0.065, 0.066, 0.2, 0.064, 0.065):
        est.observe_time("plain_verify", verify, 4)
        est.observe_time("plain_draft", 0.018, 4)
        est.observe_time("verify", verify, 4)
    assert est.seconds("plain_verify", 4) == pytest.approx(0.065) and est.seconds("plain_draft", 4) == pytest.approx(0.018)
    assert 4 * 2.0 / (est.seconds("plain_verify", 4) + est.seconds("plain_draft", 4)) > 4 / est.seconds("decode", 4)
    assert est.seconds("verify", 4) > 0.09  # a mean: the hiccup is in it


def test_live_times_depend_on_the_batch_size():
    """A time seen at one batch size is scaled to another by (b + B0) / (b0 + B0); with two or more sizes
    seen, by the least-squares line alpha + beta * b (alpha, beta >= 0) whose slope is shrunk towards that
    prior shape with the weight of a spread of B0 in b: sizes close together (16 and 15 at the end of a
    generation) extrapolate like one size, sizes far apart set the slope; a size seen OWN_AFTER (3) times
    is its own estimate, one seen fewer is read off the line."""
    b0 = 4.0  # _BatchTimes.BATCH_PRIOR

    def fitted(points, b):  # the shrunk weighted least-squares line, written out
        w = sum(n for _, _, n in points)
        mb, mt = sum(n * x for x, _, n in points) / w, sum(n * t for _, t, n in points) / w
        sxx = sum(n * (x - mb) ** 2 for x, _, n in points)
        sxy = sum(n * (x - mb) * (t - mt) for x, t, n in points)
        beta = max(0.0, (sxy + w * b0**2 * mt / (mb + b0)) / (sxx + w * b0**2))
        return mt + beta * (b - mb)

    est = LiveEstimates(EstimatesConfig(k=3))
    est.observe_time("decode", 0.28, 16)
    assert est.seconds("decode", 1) == pytest.approx(0.28 * (1 + b0) / (16 + b0))
    for b, t in ((16, 0.28), (4, 0.10), (4, 0.10)):
        est.observe_time("decode", t, b)
    points = [(16, 0.28, 2), (4, 0.10, 2)]
    assert est.seconds("decode", 8) == pytest.approx(fitted(points, 8))
    assert est.seconds("decode", 1) == pytest.approx(fitted(points, 1))
    line = (0.28 - 0.10) / 12  # spread 6 > B0: closer to the two points' own line than to the prior
    assert abs(est.seconds("decode", 1) - (0.10 - 3 * line)) < abs(est.seconds("decode", 1) - 0.19 * 5 / 14)
    # a size seen fewer than OWN_AFTER (3) times is read off the line (its points in it); then it stands alone
    assert est.seconds("decode", 16) == pytest.approx(fitted(points, 16)) != pytest.approx(0.28)
    for b, t in ((16, 0.28), (4, 0.10)):
        est.observe_time("decode", t, b)
    assert est.seconds("decode", 16) == pytest.approx(0.28) and est.seconds("decode", 4) == pytest.approx(0.10)
    tail = LiveEstimates(EstimatesConfig(k=3))  # the end of a generation: 16 many times, then 15 once, slower
    for _ in range(40):
        tail.observe_time("verify", 0.29, 16)
    tail.observe_time("verify", 0.47, 15)
    scaled = 0.29 * (1 + b0) / (16 + b0)  # what 16 alone says about 1
    assert tail.seconds("verify", 1) == pytest.approx(fitted([(16, 0.29, 40), (15, 0.47, 1)], 1))
    assert abs(tail.seconds("verify", 1) - scaled) < 0.02  # without the prior: 0.33 (slope clamped at 0)
    # the one slow step at 15 (a host hiccup) does not set 15's estimate: the line through both does
    assert tail.seconds("verify", 15) == pytest.approx(fitted([(16, 0.29, 40), (15, 0.47, 1)], 15))
    assert tail.seconds("verify", 15) < 0.30
    fresh = LiveEstimates(EstimatesConfig(k=3))  # no AR time known: verify times are kept as they are
    fresh.observe_time("verify", 0.5, 2)
    fresh.observe_time("verify", 0.1, 10)  # falling with b: slope clamped at 0, the weighted mean
    assert fresh.seconds("verify", 6) == pytest.approx(0.3) and fresh.seconds("verify", 30) == pytest.approx(0.3)
    steep = LiveEstimates(EstimatesConfig(k=3))  # the fitted line would cross below 0: through the origin
    steep.observe_time("verify", 0.01, 2)
    steep.observe_time("verify", 1.0, 10)
    beta = (2 * 0.01 + 10 * 1.0) / (2 * 2 + 10 * 10)
    assert steep.seconds("verify", 6) == pytest.approx(6 * beta) and steep.seconds("verify", 1) == pytest.approx(beta)
    with pytest.raises(ValueError, match="batch"):
        est.observe_time("verify", 0.1, 0)


@pytest.mark.parametrize("make", [
    lambda: StrategyConfig(candidates=("ssd+eagle",)),
    lambda: StrategyConfig(candidates=()),
    lambda: StrategyConfig(fixed="ar", candidates=("sd",)),
    lambda: StrategyConfig(hysteresis=-1.0),
    lambda: StrategyConfig(switch_after=0),
    lambda: EstimatesConfig(k=0),
    lambda: EstimatesConfig(k=4, prior_accept={"draft": 0.5}),
    lambda: EstimatesConfig(k=4, halflife_rounds=0.0),
    lambda: two_option_inputs(1.2, 4.0, 4.0, 1.0, 0.5, 0.5, 4),
    lambda: two_option_inputs(0.8, 9.0, 4.0, 1.0, 0.5, 0.5, 4),  # E > k+1
    lambda: two_option_inputs(0.8, 4.0, 4.0, 1.0, 0.5, 0.5, 0),
])
def test_strategy_configs_reject_bad_values(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("field,value", [("hysteresis", -0.1), ("hysteresis", math.nan), ("hysteresis", "0.05"),
                                         ("hysteresis", True), ("switch_after", 0), ("switch_after", 2.0),
                                         ("decide_after", 0), ("decide_after", 1.5), ("decide_after", True),
                                         ("decide_margin", -0.1), ("decide_margin", math.nan), ("decide_margin", True)])
def test_ssd_config_rejects_bad_rule_settings(field, value):
    with pytest.raises(ValueError, match=rf"SSDConfig\.{field}"):
        SSDConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"SpecConfig\.{field}"):  # the public surface names its own field
        SpecConfig(method="ssd", **{field: value})


def test_ssd_config_is_the_spec_configs_ssd_knobs():
    """Every SSDConfig field is a SpecConfig field with the same default, and passes through unchanged."""
    spec_fields = {f.name: f.default for f in dataclasses.fields(SpecConfig)}
    for f in dataclasses.fields(SSDConfig):
        assert f.name in spec_fields and f.default == spec_fields[f.name], f.name
    spec = SpecConfig(method="ssd", k=3, fanout=(1, 1, 1, 2), hysteresis=0.2, worker=False, fallback="ar")
    ssd = spec.ssd_config()
    assert (ssd.k, ssd.fanout, ssd.hysteresis, ssd.worker, ssd.fallback) == (3, (1, 1, 1, 2), 0.2, False, "ar")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 300), st.integers(0, 12), st.integers(0, 2**31 - 1), st.booleans())
def test_top_candidates_equal_a_full_stable_sort(n, vocab, width, seed, masked):
    """The tree's bonus candidates: the first `width` of a stable descending sort (ties: lower id first),
    on logits with many ties (small integers) and, where `masked`, -inf outside a restricted head."""
    from rollout_ssd.ssd.tree import top_candidates

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(-3, 4, (n, vocab), generator=g).float()
    if masked:
        rows[:, vocab // 2:] = float("-inf")
    width = min(width, vocab)
    want = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :width].tolist()
    assert top_candidates(rows, width) == want


def _decided_chooser(inputs):
    """A Chooser past its early rounds whose estimates always say `inputs`."""
    from rollout_ssd.metrics import EngineMetrics
    from rollout_ssd.ssd.chooser import Chooser, Plan

    config = SSDConfig(k=inputs.k, worker=False, strategy_rule=True)
    chooser = Chooser(config, LiveEstimates(EstimatesConfig(k=inputs.k)), EngineMetrics(), backup=None)
    for batch in (1, 2, 4, 8, 16):  # every plan timed at every bucket used: nothing left to explore
        for name in ("decode",) + ("plain_verify", "plain_draft", "verify") * config.decide_after:
            chooser.estimates.observe_time(name, 0.01, batch)
    chooser.estimates.inputs = lambda batch: dataclasses.replace(inputs, batch_size=batch)
    for _ in range(config.decide_after):
        chooser.count_round(Plan.SSD_DRAFT, cold=False)
    return chooser


@pytest.mark.parametrize("sd_draft_ms,probes", [(8.0, True), (30.0, False)])
def test_chooser_probes_a_close_runner_up_now_and_then_and_keeps_its_choice(sd_draft_ms, probes):
    """AR chosen; SD within PROBE_WITHIN of it gets one round in PROBE_EVERY (its estimate is refreshed
    only by running it), a far-off SD never does; the choice at the batch size stays AR."""
    from rollout_ssd.ssd.chooser import PROBE_EVERY, PROBE_WITHIN, Plan

    inp = StrategyInputs(p_hit=0.1, tokens={"hit": 1.5, "draft": 1.5, "suffix": 1.0, "random": 1.0},
                         draft_seconds={"draft": 0.03, "suffix": 0.0, "random": 0.0}, primary_seconds=0.05,
                         verify_seconds=0.04, decode_seconds=0.03, batch_size=1, k=3,
                         plain_draft_seconds=sd_draft_ms / 1000)
    s = strategy_scores(inp)
    assert max(s, key=s.get) == "ar" and (s["sd"] >= s["ar"] * (1 - PROBE_WITHIN)) == probes
    chooser = _decided_chooser(inp)
    plans = [chooser.choose(1) for _ in range(3 * PROBE_EVERY)]
    expected = [Plan.SD if probes and (i + 1) % PROBE_EVERY == 0 else Plan.AR for i in range(3 * PROBE_EVERY)]
    assert plans == expected and chooser.current is Plan.AR
    assert [chooser.choose(4) for _ in range(PROBE_EVERY - 1)] == [Plan.AR] * (PROBE_EVERY - 1)  # its own count


class _CountingRunner:
    """A ModelRunner stand-in for `Chooser.calibrate`: records each forward's batch size, undoes nothing."""

    device, max_len = "cpu", 50

    def __init__(self):
        self.forwards: list[int] = []

    def extend(self, slots, rows, last_only):
        self.forwards.append(len(slots))

    def rollback(self, slot, n):
        pass


def _fresh_chooser(k: int = 3):
    from rollout_ssd.metrics import EngineMetrics
    from rollout_ssd.ssd.chooser import Chooser

    config = SSDConfig(k=k, worker=False, strategy_rule=True)
    return Chooser(config, LiveEstimates(EstimatesConfig(k=k)), EngineMetrics(), backup=None), config


@pytest.mark.parametrize("v,explored,shape", [(None, True, "decode"), (0.74, True, "decode"), (0.69, False, "decode"),
                                              (0.74, True, "verify"), (0.69, False, "verify")])
def test_chooser_measures_ar_then_sd_then_ssd_unless_corollary_9_caps_it_below_them(v, explored, shape):
    """At a batch bucket not decided at, the chooser runs AR (one timed round), then SD and SSD for
    decide_after timed rounds each, then lets the rule decide; SSD is skipped when its cap, b * E(a, K) * v /
    t_verify(SD) with v = (AR step on every core) / (AR step on the target's own core), is at most the
    best measured plan's rate. Priors here: a = 0.6 (E = 2.176 at K = 3); AR 1 / 0.02 = 50 tok/s, SD
    2.176 / (0.025 + 0.01) = 62.2 tok/s; the cap at v = 1 is 2.176 / 0.025 = 87.0, so SSD is explored
    for v > 62.2 / 87.0 = 0.714 (0.74) and not below (0.69). v from AR steps (decode / decode_narrow) or,
    where timed, from the verify's own shape (SD's verify / a K+1-token forward on the target's core)."""
    from rollout_ssd.ssd.chooser import Plan

    chooser, config = _fresh_chooser()
    est = chooser.estimates
    assert chooser.choose(1) is Plan.AR  # nothing timed yet
    est.observe_time("decode", 0.02, 1)
    chooser.count_round(Plan.AR, cold=False)  # (the round's own count: AR's step was timed)
    if v is not None and shape == "decode":
        est.observe_time("decode_narrow", 0.02 / v, 1)
    if v is not None and shape == "verify":
        est.observe_time("decode_narrow", 0.02, 1)  # AR steps alike: only the verify's shape says v
        est.observe_time("verify_narrow", 0.025 / v, 1)
    for _ in range(config.decide_after):  # SD for decide_after timed rounds (it stays within decide_margin)
        assert chooser.choose(1) is Plan.SD
        est.observe_time("plain_verify", 0.025, 1)
        est.observe_time("plain_draft", 0.01, 1)
    plans = []
    for _ in range(config.decide_after + 1):
        plans.append(chooser.choose(1))
        if plans[-1].is_ssd:
            est.observe_time("verify", 0.03, 1)
    rule_scores = chooser.stats.ssd_state["scores"]
    assert rule_scores["ar"] == pytest.approx(50.0) and rule_scores["sd"] == pytest.approx(2.176 / 0.035)
    if explored:
        assert plans[:-1] == [Plan.SSD_DRAFT] * config.decide_after
        assert plans[-1].label == max(rule_scores, key=rule_scores.get)  # then the rule decides
    else:  # never an SSD round: the rule decides between AR and SD (SD: 62.2 tok/s)
        assert plans == [Plan.SD] * len(plans) and not est.measured("verify", 1)
    assert chooser.budget_cap(1) is None  # decided at bucket 1


def test_an_sd_round_that_times_the_caps_verify_is_not_one_of_sds_exploring_rounds():
    """`_explore` runs SD for decide_after timed rounds (one try more: a round of first rounds times
    nothing); a round of it that verified on the target's own core (`narrow_verify`, timing the cap's
    v, no SD time) gives its try back (`count_round`), so SD is still timed decide_after times before
    the rule decides. Priors as above: SD (62.2 tok/s) within decide_margin of AR (50), and v = 0.025 /
    0.04 puts SSD's cap (54.4) below SD: never tried."""
    from rollout_ssd.ssd.chooser import Plan

    chooser, config = _fresh_chooser()
    est = chooser.estimates
    assert chooser.choose(1) is Plan.AR
    est.observe_time("decode", 0.02, 1)
    chooser.count_round(Plan.AR, cold=False)
    timed = rounds = 0
    while True:
        assert chooser.choose(1) is Plan.SD
        if chooser.budget_cap(1) is None:  # the rule decided at bucket 1 in this choice
            break
        rounds += 1
        if rounds == 1:  # the speculator's takeup: a round of first rounds
            chooser.count_round(Plan.SD, cold=True, batch=1)
        elif rounds == 3:  # the cap's one-core verify
            est.observe_time("verify_narrow", 0.04, 1)
            chooser.count_round(Plan.SD, cold=False, batch=1, narrow=True)
        else:
            est.observe_time("plain_verify", 0.025, 1)
            est.observe_time("plain_draft", 0.01, 1)
            chooser.count_round(Plan.SD, cold=False, batch=1)
            timed += 1
    assert timed == config.decide_after and rounds == config.decide_after + 2 and not est.measured("verify", 1)
    fixed, _ = _fresh_chooser()
    fixed.rule.config = type(fixed.rule.config)(candidates=fixed.rule.config.candidates, fixed="sd")
    fixed.estimates.observe_time("plain_verify", 0.025, 1)
    assert not fixed.narrow_verify(1, cores=object())  # the rule fixed: nothing to decide


def test_the_caps_v_is_one_moments_ratio_so_a_slower_host_later_does_not_let_ssd_in():
    """v = (SD's verify when the one-core verify was timed) / (that one-core verify): when the host
    slows down afterwards (or a later engine starts from the rule's cache on a busier machine), SD's
    live verify slows and the cap with it. Here v = 0.025 / 0.04 = 0.625; SD's verify then runs at
    0.0375 s (1.5x): SD 2.176 / 0.0475 = 45.8 tok/s, AR 50 the best; the cap b * E * v / t_verify(SD) =
    2.176 * 0.625 / 0.0375 = 36.3, below it (SSD stays out). With v from the live verify instead
    (0.0375 / 0.04) the cap would be 2.176 / 0.04 = 54.4, above AR: SSD would be tried."""
    chooser, config = _fresh_chooser()
    est = chooser.estimates
    chooser.choose(1)
    est.observe_time("decode", 0.02, 1)
    for _ in range(3):
        est.observe_time("plain_verify", 0.025, 1)
        est.observe_time("plain_draft", 0.01, 1)
    est.observe_time("verify_narrow", 0.04, 1)
    assert est.seconds("narrow_ref", 1) == pytest.approx(0.025)
    for _ in range(10):  # the host slows: SD's median verify follows
        est.observe_time("plain_verify", 0.0375, 1)
    inputs = est.inputs(1)
    scores = {"ar": 50.0, "sd": 2.176 / 0.0475}
    assert chooser._ssd_cap(1, inputs, v=None) == pytest.approx(36.3, abs=0.2)
    assert chooser._excluded(1, inputs, {**scores, "ssd+neural": 60.0}) == {"ssd+neural"}
    plans = {chooser.choose(1) for _ in range(3 * config.decide_after + 8)}
    assert not any(p.is_ssd for p in plans)
    # SD's verify kept from an earlier engine (the rule's cache) is not this moment's: no reference
    # until this engine timed SD's verify itself
    later = LiveEstimates(EstimatesConfig(k=3))
    later.restore(est.snapshot())
    assert later.measured("plain_verify", 1) and later.measured("narrow_ref", 1)
    fresh = LiveEstimates(EstimatesConfig(k=3))
    fresh.restore({**est.snapshot(), "times": {"plain_verify": {"1": [0.025, 3]}}})
    fresh.observe_time("verify_narrow", 0.04, 1)
    assert not fresh.measured("narrow_ref", 1) and not fresh.live("plain_verify", 1)
    fresh.observe_time("plain_verify", 0.03, 1)
    fresh.observe_time("verify_narrow", 0.04, 1)
    assert fresh.measured("narrow_ref", 1) and fresh.live("plain_verify", 1)
    # so the chooser times the one-core verify only after an SD round of its own at the bucket
    kept, _ = _fresh_chooser()
    kept.estimates.restore({**est.snapshot(), "times": {"decode": {"1": [0.02, 3]}, "plain_verify": {"1": [0.025, 3]},
                                                        "plain_draft": {"1": [0.01, 3]}}})
    assert not kept.narrow_verify(1, cores=object())
    kept.estimates.observe_time("plain_verify", 0.025, 1)
    assert kept.narrow_verify(1, cores=object())


@pytest.mark.parametrize("restored", [False, True])
def test_an_engine_from_kept_choices_retimes_ar_once_then_every_calibrate_every(restored):
    """The rule deciding, AR's step is timed in the first speculating round that can be timed, again
    FIRST_CALIBRATION_GAP rounds later (a second warm-up sample for the median), then every
    CALIBRATE_EVERY; an engine that started from kept choices (the rule's cache) skips the second
    warm-up at those buckets: its median holds the earlier runs' kept value."""
    from types import SimpleNamespace

    from rollout_ssd.ssd.chooser import CALIBRATE_EVERY, FIRST_CALIBRATION_GAP, Plan

    runner = _CountingRunner()
    chooser, _ = _fresh_chooser()
    if restored:
        chooser.restore_choices({1: Plan.SD})
    running = [SimpleNamespace(slot=0, last_token=7, num_tokens=10)]
    timed_at = []
    for i in range(FIRST_CALIBRATION_GAP + CALIBRATE_EVERY + 4):
        before = len(runner.forwards)
        chooser.calibrate(runner, running, cold=i == 0, plan=Plan.SD)
        if len(runner.forwards) > before:
            timed_at.append(i)
    # round 0 is cold; a gap of n rounds puts the next timing n + 1 rounds after the last
    if restored:
        assert timed_at == [1, 1 + CALIBRATE_EVERY + 1]
    else:
        second = 1 + FIRST_CALIBRATION_GAP + 1
        assert timed_at == [1, second, second + CALIBRATE_EVERY + 1]


def test_a_due_calibration_in_a_plain_speculation_plan_is_an_ar_round_not_a_forward_apart():
    """Where the rule runs SD (timed there), AR's due re-timing is one AR round (it emits the batch's
    tokens) instead of a forward that `calibrate` makes and undoes: an engine from kept choices runs one
    at its start (nothing calibrated yet), then one every CALIBRATE_EVERY rounds; no forward apart.
    AR (25 tok/s) is too far below SD (62.2) to be probed; SSD's cap (v = 0.625: 54.4) keeps it out."""
    from types import SimpleNamespace

    from rollout_ssd.ssd.chooser import CALIBRATE_EVERY, Plan

    runner = _CountingRunner()
    chooser, _ = _fresh_chooser()
    est = chooser.estimates
    est.observe_time("decode", 0.04, 1)
    for _ in range(3):
        est.observe_time("plain_verify", 0.025, 1)
        est.observe_time("plain_draft", 0.01, 1)
    est.observe_time("verify_narrow", 0.04, 1)
    chooser.restore_choices({1: Plan.SD})
    running = [SimpleNamespace(slot=0, last_token=7, num_tokens=10)]
    plans = []
    for _ in range(CALIBRATE_EVERY + 4):
        plan = chooser.choose(1)
        chooser.calibrate(runner, running, cold=False, plan=plan)
        chooser.count_round(plan, cold=False, batch=1)
        plans.append(plan)
    assert [i for i, p in enumerate(plans) if p is Plan.AR] == [0, CALIBRATE_EVERY + 1]
    assert set(plans) == {Plan.AR, Plan.SD} and not runner.forwards

    # a round of first rounds (a call's cold start) times nothing: the re-timing waits for the next
    # round instead of running an AR round that measures nothing, then a second one that does
    warm, _ = _fresh_chooser()
    warm.estimates.restore(est.snapshot())
    warm.restore_choices({1: Plan.SD})
    first = warm.choose(1, cold=True)
    warm.calibrate(runner, running, cold=True, plan=first)
    warm.count_round(first, cold=True, batch=1)
    second = warm.choose(1)
    assert (first, second) == (Plan.SD, Plan.AR)
    warm.calibrate(runner, running, cold=False, plan=second)
    warm.count_round(second, cold=False, batch=1)
    assert warm._calibrations == 1 and warm.choose(1) is Plan.SD  # that AR round was the re-timing


def test_beside_a_worker_one_verify_shaped_step_is_timed_per_bucket_where_it_could_change_the_cap():
    """In an AR round beside a worker, `calibrate` times one forward of K+1 tokens per sequence (within
    each sequence's room in the cache; every row's logits) on the target's own core as "verify_narrow",
    or, past VERIFY_SHAPE_MAX_ROWS rows (in SD rounds too), one AR step as "decode_narrow"; then undoes
    it, widens again, and times nothing more at that bucket. An SD round's own verify measures
    "verify_narrow" instead (`narrow_verify`). Only where SD's verify was measured and the
    cap at v = 1 exceeds the best measured rate (v <= 1: below it no v could let SSD in). Priors a = 0.6,
    K = 3: E = 2.176; at 3 sequences AR 3 / 0.02 = 150 tok/s; SD's verify 0.025 s: the cap at v = 1 is
    3 * 2.176 / 0.025 = 261 tok/s, above SD's 3 * 2.176 / 0.035 = 187 (timed); SD's verify 0.06 s: 109,
    below AR's 150 (not timed). A round of first rounds, or no worker, times nothing."""
    from types import SimpleNamespace

    from rollout_ssd.ssd.chooser import Plan, batch_bucket
    from rollout_ssd.ssd.ssd_cap import VERIFY_SHAPE_MAX_ROWS

    calls, shares = [], []

    class Runner:
        device, max_len = "cpu", 50

        def extend(self, slots, rows, last_only):
            calls.append((list(slots), [len(r) for r in rows], last_only))

        def rollback(self, slot, n):
            calls.append(("rollback", slot, n))

    def chooser_with(verify: float, batches=(3,)):
        chooser, _ = _fresh_chooser(k=3)
        for b in batches:
            chooser.estimates.observe_time("decode", 0.02 * b / 3, b)
            chooser.estimates.observe_time("plain_verify", verify * b / 3, b)
            chooser.estimates.observe_time("plain_draft", 0.01 * b / 3, b)
        return chooser

    cores = SimpleNamespace(narrow=lambda: shares.append("narrow"), widen=lambda: shares.append("widen"),
                            is_wide=True)
    running = [SimpleNamespace(slot=i, last_token=7, num_tokens=n) for i, n in enumerate((10, 48, 20))]
    fresh, _ = _fresh_chooser(k=3)
    fresh.estimates.observe_time("decode", 0.02, 3)
    assert fresh.calibrate(Runner(), running, cold=False, cores=cores, plan=Plan.AR) == 0.0  # SD's verify untimed
    chooser = chooser_with(verify=0.025)
    assert chooser.calibrate(Runner(), running, cold=True, cores=cores, plan=Plan.AR) == 0.0
    assert chooser.calibrate(Runner(), running, cold=False, cores=None, plan=Plan.AR) == 0.0
    assert not calls
    chooser.calibrate(Runner(), running, cold=False, cores=cores, plan=Plan.AR)
    # room in the cache: 50 - (num_tokens - 1) -> 4 (K+1), 3, 4 tokens
    assert calls == [([0, 1, 2], [4, 3, 4], False), ("rollback", 0, 9), ("rollback", 1, 47), ("rollback", 2, 19)]
    assert shares == ["narrow", "widen"] and chooser.estimates.times_measured("verify_narrow", 2) == 1
    calls.clear()
    chooser.calibrate(Runner(), running[:2], cold=False, cores=cores, plan=Plan.AR)  # bucket 2 again
    assert not calls
    # an SD round verifies on the target's core itself instead (`narrow_verify`): no forward apart, only
    # its own calibration step (due: none made yet), one token a row
    in_sd = chooser_with(verify=0.025)
    assert in_sd.narrow_verify(3, cores) and not in_sd.narrow_verify(3, None)
    in_sd.calibrate(Runner(), running, cold=False, cores=cores, plan=Plan.SD)
    assert [c for c in calls if c[0] != "rollback"] == [([0, 1, 2], [1, 1, 1], True)]
    assert not in_sd.estimates.measured("verify_narrow", 2)
    in_sd.estimates.observe_time("verify_narrow", 0.04, 3)  # (what that round's verify records)
    assert not in_sd.narrow_verify(3, cores) and not chooser.narrow_verify(3, cores)  # timed at bucket 2
    calls.clear()
    excluded_anyway = chooser_with(verify=0.06)
    excluded_anyway.calibrate(Runner(), running, cold=False, cores=cores, plan=Plan.AR)
    assert not calls and not excluded_anyway.estimates.measured("verify_narrow", 2)
    assert not excluded_anyway.narrow_verify(3, cores)
    n = VERIFY_SHAPE_MAX_ROWS // 4 + 1
    wide = [SimpleNamespace(slot=i, last_token=7, num_tokens=10) for i in range(n)]
    past = chooser_with(verify=0.025, batches=(n,))
    assert not past.narrow_verify(n, cores)  # past the rows: an AR step on one core, in AR and SD rounds alike
    past.calibrate(Runner(), wide, cold=False, cores=cores, plan=Plan.SD)
    assert calls[0] == (list(range(n)), [1] * n, True)
    assert past.estimates.times_measured("decode_narrow", batch_bucket(n)) == 1


def test_chooser_tries_a_plan_whose_rounds_time_nothing_once_more_then_moves_on():
    """A round of first rounds times nothing: a plan is run at most one round more than the timed rounds
    it needs (AR: 1, SD and SSD: decide_after), then the next plan is explored."""
    from rollout_ssd.ssd.chooser import Plan

    chooser, config = _fresh_chooser()
    n = config.decide_after + 1
    plans = [chooser.choose(1) for _ in range(2 + 2 * n)]
    assert plans == [Plan.AR] * 2 + [Plan.SD] * n + [Plan.SSD_DRAFT] * n


def test_budget_capped_until_the_rule_has_chosen_at_a_batch_size():
    """Before the rule chooses at a batch size, a cache spans EXPLORE_TREE_ROWS branches over the batch
    (a full tree over a large batch costs the fresh engine's first call several verifies); after, none."""
    from rollout_ssd.ssd.chooser import EXPLORE_TREE_ROWS

    inp = StrategyInputs(p_hit=0.5, tokens={"hit": 2.0, "draft": 2.0, "suffix": 1.0, "random": 1.0},
                         draft_seconds={"draft": 0.01, "suffix": 0.0, "random": 0.0}, primary_seconds=0.02,
                         verify_seconds=0.04, decode_seconds=0.05, batch_size=1, k=3)
    chooser = _decided_chooser(inp)
    assert chooser.budget_cap(24) == max(1, EXPLORE_TREE_ROWS // 24) and chooser.budget_cap(1) == EXPLORE_TREE_ROWS
    chooser.choose(24)
    assert chooser.budget_cap(24) is None and chooser.budget_cap(20) is None  # one bucket: 16-31
    assert chooser.budget_cap(4) == EXPLORE_TREE_ROWS // 4
    # once chosen: the chosen plan's rounds and non-SSD ones are not capped; an SSD round of another plan
    # (a try of a plan never timed there, a probe) only measures it and is
    from rollout_ssd.ssd.plans import Plan, batch_bucket

    chosen = chooser._choices[batch_bucket(24)]
    assert chooser.budget_cap(24, chosen) is None and chooser.budget_cap(24, Plan.SD) is None
    chooser._choices[batch_bucket(24)] = Plan.AR  # as where the rule chose AR at a GRPO batch
    assert chooser.budget_cap(20, Plan.SSD_DRAFT) == max(1, EXPLORE_TREE_ROWS // 20)
    assert chooser.budget_cap(20, Plan.AR) is None and chooser.budget_cap(20) is None
    planner = FanoutPlanner(FanoutConfig(k=3, initial_budget=8))
    assert planner.plan().budget == 8 and planner.plan(cap=2).budget == 2 and planner.plan(cap=0).budget == 1



@pytest.mark.parametrize("sd_verify_at_24,batch,ar_step,explored", [(0.2, 15, 0.06, False), (0.10, 15, 0.049, True),
                                                                 (0.37, 3, 0.03, True)])
def test_chooser_leaves_a_plan_that_lost_clearly_one_bucket_up_unmeasured(sd_verify_at_24, batch, ar_step, explored):
    """A GRPO-shaped call: at 24 sequences AR is timed (0.072 s a step: 333 tok/s) and SD's first timed
    round; with a 0.2 s verify SD scores 24 * 1.5 / 0.25 = ~144 tok/s, far below AR: left there. When the
    batch shrinks to 15 (the next bucket down) SD is not measured again, neither while exploring (its
    estimate there, scaled from 24, is more than decide_margin below AR's timed 15-row step: ~132 against
    250 tok/s) nor afterwards as a never-timed plan within UNMEASURED_WITHIN of the choice: nothing but AR
    runs there, and SSD stays capped out (its cap bounds SD's verify from the bucket above). It is
    measured again where SD was close at 24 (a 0.10 s verify: within decide_margin, so timed decide_after
    times there), and two buckets down (3 sequences, where a batch 8x smaller may turn the result)."""
    from rollout_ssd.ssd.chooser import Plan

    chooser, config = _fresh_chooser()
    est = chooser.estimates
    est.observe_round("draft", 24, 12, 24, 36)  # acceptance 0.5: SD's rounds make 1.5 tokens a sequence
    assert chooser.choose(24) is Plan.AR
    est.observe_time("decode", 0.072, 24)
    sd_rounds = 0
    while chooser.choose(24) is Plan.SD:
        sd_rounds += 1
        est.observe_time("plain_verify", sd_verify_at_24, 24)
        est.observe_time("plain_draft", 0.05, 24)
    assert sd_rounds == (1 if sd_verify_at_24 > 0.15 else config.decide_after)
    assert chooser.choose(batch) is Plan.AR  # AR first at the new bucket
    est.observe_time("decode", ar_step, batch)
    nxt = chooser.choose(batch)
    assert (nxt is Plan.SD) == explored
    if not explored:
        later = [chooser.choose(batch) for _ in range(40)]  # past UNMEASURED_AFTER, past a probe's turn
        assert nxt is Plan.AR and set(later) == {Plan.AR} and not est.measured("plain_verify", batch.bit_length())


def test_chooser_does_not_explore_a_new_bucket_in_a_calls_tail():
    """A GRPO call decided AR at 24 sequences; in its tail (every sequence within TAIL_ROUNDS tokens of its
    budget, one past TAIL_ROUNDS made: `call_tail`) the batch falls into a bucket never decided at: the plan
    running stands, AR for an SSD plan (an SSD round there would build an exploring tree and time it as that
    bucket's), nothing is calibrated, and the bucket stays undecided, so a call starting there explores it.
    Before anything was decided, and in a call shorter than TAIL_ROUNDS, the chooser explores as usual."""
    from types import SimpleNamespace

    from rollout_ssd.ssd.chooser import Plan, batch_bucket
    from rollout_ssd.ssd.plans import TAIL_ROUNDS, call_tail

    def seqs(made, left):
        return [SimpleNamespace(token_ids=[0] * m, budget=b) for m, b in zip(made, left)]

    assert call_tail(seqs([TAIL_ROUNDS, 5], [TAIL_ROUNDS - 1, 3]))
    assert not call_tail(seqs([TAIL_ROUNDS, 5], [TAIL_ROUNDS, 3]))  # one sequence has rounds to spare
    assert not call_tail(seqs([TAIL_ROUNDS - 1], [1]))  # a short call: never a tail
    chooser, config = _fresh_chooser()
    est = chooser.estimates
    assert chooser.choose(24, tail=True) is Plan.AR  # nothing decided: explored, AR first
    est.observe_round("draft", 24, 12, 24, 36)
    est.observe_time("decode", 0.072, 24)
    while chooser.choose(24) is not Plan.AR or not chooser._choices:
        est.observe_time("plain_verify", 0.2, 24)
        est.observe_time("plain_draft", 0.05, 24)
    assert chooser._choices == {batch_bucket(24): Plan.AR}
    chooser.current = Plan.SD  # whatever ran last stands (SD's state is warm: no one-off)
    tail = [chooser.choose(12, tail=True) for _ in range(10)]
    assert set(tail) == {Plan.SD} and batch_bucket(12) not in chooser._choices
    assert chooser.calibrate(None, [None] * 12, cold=False) == 0.0  # no calibration step in the tail
    chooser.current = Plan.SSD_DRAFT
    assert chooser.choose(12, tail=True) is Plan.AR
    assert chooser.choose(12) is Plan.AR and not chooser._tail_round  # not a tail: explored, AR first


@pytest.mark.parametrize("shares_cores,narrow,excluded", [(False, None, False), (True, None, True),
                                                           (True, 0.05, True), (True, 0.026, False)])
def test_ssd_waits_for_the_caps_one_core_time_beside_a_worker(shares_cores, narrow, excluded):
    """Beside a worker (`shares_cores`), an SSD plan the cap at v = 1 leaves in is left out until v's
    one-core time is measured at the bucket (`_v_pending`): then the cap decides. Priors a = 0.6, K = 3:
    E = 2.176; at 3 sequences AR 150 tok/s, SD 3 * 2.176 / 0.035 = 187 (timed); the cap at v = 1 is
    3 * 2.176 / 0.025 = 261. A one-core verify of 0.05 s gives v = 0.5 (cap 131: out), of 0.026 s
    v = 0.96 (cap 251: in). Without a worker nothing waits (v stays 1 there)."""
    from rollout_ssd.ssd import rule as rules

    chooser, _ = _fresh_chooser(k=3)
    chooser.shares_cores = shares_cores
    chooser.estimates.observe_time("decode", 0.02, 3)
    chooser.estimates.observe_time("plain_verify", 0.025, 3)
    chooser.estimates.observe_time("plain_draft", 0.01, 3)
    if narrow is not None:
        chooser.estimates.observe_time("verify_narrow", narrow, 3)
    inputs = chooser.estimates.inputs(3)
    scores = rules.strategy_scores(inputs, chooser.rule.config.candidates)
    assert scores["sd"] == pytest.approx(3 * 2.176 / 0.035) and chooser._ssd_cap(2, inputs, v=1.0) > scores["sd"]
    assert ("ssd+neural" in chooser._excluded(2, inputs, scores)) == excluded


@pytest.mark.parametrize("shares_cores,narrow,v,cap", [(True, 0.05, 0.5, 0.700), (True, 0.026, 0.025 / 0.026, 1.346),
                                                       (True, None, math.nan, 1.400), (False, None, 1.0, 1.400),
                                                       (False, 0.05, 0.5, 0.700)])
def test_the_cap_metric_says_whether_ssd_can_beat_the_best_plan_measured(shares_cores, narrow, v, cap):
    """`ssd/cap` (`cap_state`): the cap of the test above over the best timed plan. Priors a = 0.6, K = 3: E =
    2.176; at 3 sequences AR 150 tok/s, SD 186.5; the cap at v = 1 is 261.1 tok/s (1.400 of SD). A one-core
    verify of 0.05 s gives v = 0.5 (cap 0.700), of 0.026 s v = 0.962 (1.346); beside a worker and untimed,
    v is NaN and the cap the one at v = 1; without a worker v is 1 (or, timed while there was one, what
    `_excluded` takes: the metric and the rule agree). Published by a decided round, with the batch size
    it is for; NaN where no AR or SD round was timed (no stale value from another bucket)."""
    from rollout_ssd.ssd import rule as rules

    chooser, _ = _fresh_chooser(k=3)
    chooser.shares_cores = shares_cores
    est = chooser.estimates
    for name, seconds in (("decode", 0.02), ("plain_verify", 0.025), ("plain_draft", 0.01), ("verify_narrow", narrow)):
        for _ in range(3):
            if seconds is not None:
                est.observe_time(name, seconds, 3)
    inputs = est.inputs(3)
    state = chooser.cap_state(2, inputs, rules.strategy_scores(inputs, chooser.rule.config.candidates))
    assert state["cap"] == pytest.approx(cap, abs=1e-3) and state["cap_batch"] == 3
    assert state["v"] == pytest.approx(v, nan_ok=True)
    assert chooser._excluded(2, inputs, rules.strategy_scores(inputs, chooser.rule.config.candidates)) == (
        {"ssd+neural"} if cap < 1 or math.isnan(v) else set())  # the rule's cap agrees (untimed v: SSD waits for it)
    wider = est.inputs(4)  # (bucket 3: nothing timed there)
    empty = chooser.cap_state(3, wider, rules.strategy_scores(wider, chooser.rule.config.candidates))
    assert math.isnan(empty["cap"]) and math.isnan(empty["v"]) and empty["cap_batch"] == 4
    chooser._choices[2] = chooser.current  # a decided bucket: the next round publishes it
    chooser.choose(3)
    assert chooser.stats.ssd_state["cap"] == pytest.approx(cap, abs=1e-3)  # ssd/cap once a round is counted


@pytest.mark.parametrize("v", [None, 0.69, 0.74])
def test_beside_a_worker_exploring_waits_for_v_then_the_cap_decides(v):
    """The exploring order of the test above, beside a worker: once SD was timed and the cap at v = 1 (87.0
    tok/s) beats it (62.2), the chooser runs rounds of the better of AR and SD (SD here: its own verify
    times v on the target's core, `narrow_verify`) instead of deciding, and
    explores SSD only if the measured v lets it in (0.74: in, 0.69: out). Never timed (None), it waits
    V_WAIT_ROUNDS rounds and then explores SSD at v = 1, as without a worker; the bucket stays undecided
    while it waits."""
    from rollout_ssd.ssd.chooser import Plan
    from rollout_ssd.ssd.ssd_cap import V_WAIT_ROUNDS

    chooser, config = _fresh_chooser()
    chooser.shares_cores = True
    est = chooser.estimates
    assert chooser.choose(1) is Plan.AR
    est.observe_time("decode", 0.02, 1)
    chooser.count_round(Plan.AR, cold=False)
    for _ in range(config.decide_after):
        assert chooser.choose(1) is Plan.SD
        est.observe_time("plain_verify", 0.025, 1)
        est.observe_time("plain_draft", 0.01, 1)
    assert chooser.choose(1) is Plan.SD and chooser.budget_cap(1) is not None  # waiting: not decided
    assert chooser.narrow_verify(1, cores=object())  # that round's verify times v
    if v is not None:
        est.observe_time("verify_narrow", 0.025 / v, 1)  # what it records
    else:
        assert [chooser.choose(1) for _ in range(V_WAIT_ROUNDS - 1)] == [Plan.SD] * (V_WAIT_ROUNDS - 1)
    plans = [chooser.choose(1) for _ in range(config.decide_after)]
    assert plans == ([Plan.SD] * config.decide_after if v == 0.69 else [Plan.SSD_DRAFT] * config.decide_after)


@pytest.mark.parametrize("stale_draft,live_draft,switches", [(0.02, 0.005, True), (0.02, 0.0165, True), (0.02, 0.02, False),
                                                            (0.05, 0.005, False)])
def test_a_kept_choice_is_measured_again_where_the_runner_up_is_close_and_its_times_are_all_kept(
        stale_draft, live_draft, switches):
    """An engine from the rule's cache: AR kept at bucket 1 (AR 1 / 0.02 = 50 tok/s) and SD's times all kept
    from an earlier engine (verify 0.025 s, drafting `stale_draft`; priors a = 0.6, K = 3: E = 2.176). Where SD
    scores within PROBE_WITHIN of AR (drafting 0.02: 48.4 tok/s) it runs decide_after timed rounds (one try
    more) after UNMEASURED_AFTER decided rounds, and the rule decides again from them without the hysteresis:
    SD when its live drafting is 0.005 s (72.5 tok/s) or 0.0165 s (52.4 tok/s: within the hysteresis, which
    would have kept AR), AR again when it is as kept. Far below (drafting 0.05: 29 tok/s) it is not run."""
    from rollout_ssd.ssd.chooser import PROBE_EVERY, UNMEASURED_AFTER, Plan
    from rollout_ssd.ssd.rule import StrategyConfig, StrategyRule

    kept = LiveEstimates(EstimatesConfig(k=3))
    for _ in range(3):
        kept.observe_time("decode", 0.02, 1)
        kept.observe_time("plain_verify", 0.025, 1)
        kept.observe_time("plain_draft", stale_draft, 1)
    chooser, config = _fresh_chooser()
    rule = chooser.rule.config  # AR and SD only (an SSD plan the cap leaves out would stand in for SD otherwise)
    chooser.rule = StrategyRule(StrategyConfig(candidates=("sd", "ar"), hysteresis=rule.hysteresis,
                                               switch_after=rule.switch_after))
    chooser.estimates.restore(kept.snapshot())
    chooser.restore_choices({1: Plan.AR})
    plans = []
    for _ in range(PROBE_EVERY - 2):
        plan = chooser.choose(1)
        if plan is Plan.SD:
            chooser.estimates.observe_time("plain_verify", 0.025, 1)
            chooser.estimates.observe_time("plain_draft", live_draft, 1)
        else:
            chooser.estimates.observe_time("decode", 0.02, 1)
        chooser.count_round(plan, cold=False, batch=1)
        plans.append(plan)
    if stale_draft == 0.05:
        assert set(plans) == {Plan.AR}
        return
    first = UNMEASURED_AFTER - 1  # decided rounds before the one that counts UNMEASURED_AFTER
    assert plans[:first] == [Plan.AR] * first
    assert plans[first:first + config.decide_after] == [Plan.SD] * config.decide_after
    later = plans[first + config.decide_after:]
    if switches:
        assert chooser._choices[1] is Plan.SD and later[1:] == [Plan.SD] * (len(later) - 1)  # (first: the kept choice's)
    else:
        assert chooser._choices[1] is Plan.AR and set(later) == {Plan.AR}
