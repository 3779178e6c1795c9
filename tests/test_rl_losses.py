"""GRPO / PPO losses (rollout_ssd/rl/losses.py) against hand-computed examples, plus: one SGD step moves
log-probs the way the advantage says, clipping stops the gradient exactly outside the trust region,
GAE equals a plain-python double loop on seeded random inputs, and every bad argument is refused.
All deterministic (seeded or hand-made inputs): no test here can fail by chance."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from rollout_ssd.rl.losses import (
    gae,
    group_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)

LN = math.log


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert_close(masked_mean(x, mask), torch.tensor(7.0 / 3.0))
    assert_close(masked_mean(x, mask.float(), dim=1), torch.tensor([1.5, 4.0]))
    assert_close(masked_mean(x, torch.zeros_like(mask)), torch.tensor(0.0))  # no real token: 0, not nan


def test_masked_whiten():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 7.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # real values 1, 3, 5, 7: mean 4, population var 5
    expected = torch.tensor([[-3.0, -1.0, 0.0], [1.0, 3.0, 0.0]]) / math.sqrt(5.0)
    assert_close(masked_whiten(x, mask), expected)
    assert_close(masked_whiten(x, mask, shift_mean=False), (expected + 4.0) * mask)


def test_group_advantages_hand_example():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # group 1: mean 0.5, population std 0.5; group 2: all equal -> 0
    assert_close(group_advantages(rewards, 4, eps=0.0), torch.tensor([1.0, -1.0, -1.0, 1.0, 0, 0, 0, 0]))
    assert_close(group_advantages(rewards, 4, scale=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    assert_close(group_advantages(torch.tensor([0, 1, 2]), 3, eps=0.0),
                 torch.tensor([-1.0, 0.0, 1.0]) / math.sqrt(2.0 / 3.0))
    assert_close(group_advantages(rewards, 1), torch.zeros(8))  # a group of one has nothing to compare


def _hand_batch():
    """B=2, T=3. Ratios row 0: 1.5, 0.5, 1.1; row 1: 1.5, 0.5, 3.0 (last token masked). A = +1, -1."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.2, -0.3, -2.0]])
    logp = old + torch.log(torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 3.0]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return logp, old, torch.tensor([1.0, -1.0]), mask


def test_policy_loss_hand_example():
    logp, old, adv, mask = _hand_batch()
    # per token -min(rA, clip(r)A), clip to [0.8, 1.2]:
    # row 0 (A=+1): r=1.5 -> -1.2 (clipped), r=0.5 -> -0.5, r=1.1 -> -1.1
    # row 1 (A=-1): r=1.5 -> 1.5, r=0.5 -> 0.8 (clipped)
    loss, stats = policy_loss(logp, old, adv, mask)
    assert_close(loss, torch.tensor((-1.2 - 0.5 - 1.1 + 1.5 + 0.8) / 5))
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean")
    assert_close(loss, torch.tensor((-2.8 / 3 + 2.3 / 2) / 2))
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum-norm", max_len=4)
    assert_close(loss, torch.tensor((-2.8 / 4 + 2.3 / 4) / 2))
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum-norm")  # max_len = T = 3
    assert_close(loss, torch.tensor((-2.8 / 3 + 2.3 / 3) / 2))
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5 + 0.5) / 5)
    assert stats["ratio_max"] == pytest.approx(1.5)  # the masked 3.0 is ignored
    k3 = lambda r: (r - 1) - LN(r)
    assert stats["approx_kl"] == pytest.approx((2 * k3(1.5) + 2 * k3(0.5) + k3(1.1)) / 5)
    assert all(isinstance(v, float) for v in stats.values())


def test_policy_loss_asymmetric_clip_and_per_token_advantages():
    logp, old, adv, mask = _hand_batch()
    # clip to [0.8, 1.28] (DAPO clip-higher): row 0 r=1.5 now gives -1.28; per-token A equal to per-row A
    loss, stats = policy_loss(logp, old, adv[:, None].expand(2, 3), mask, clip_high=0.28)
    assert_close(loss, torch.tensor((-1.28 - 0.5 - 1.1 + 1.5 + 0.8) / 5))
    assert stats["clip_frac"] == pytest.approx(2 / 5)


def test_policy_loss_at_rest_is_minus_advantage():
    adv = torch.tensor([[0.3, -2.0]])
    logp = torch.tensor([[-1.0, -3.0]], requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach(), adv, torch.ones(1, 2))
    assert_close(loss, torch.tensor((-0.3 + 2.0) / 2))
    assert stats == {"clip_frac": 0.0, "ratio_mean": 1.0, "ratio_max": 1.0, "approx_kl": 0.0}
    loss.backward()
    assert_close(logp.grad, -adv / 2)  # d(-rA)/dlogp = -rA, r = 1, token-mean over 2


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_one_sgd_step_follows_the_advantage(advantage):
    theta = torch.zeros(5, requires_grad=True)  # logits of a 5-token policy
    tokens = torch.tensor([[2, 2, 4]])

    def logp_of(theta):
        return torch.log_softmax(theta, dim=0)[tokens]  # [1, 3]

    before = logp_of(theta).detach()
    loss, _ = policy_loss(logp_of(theta), before, torch.tensor([advantage]), torch.ones(1, 3))
    loss.backward()
    with torch.no_grad():
        theta -= 0.1 * theta.grad
    after = logp_of(theta).detach()
    assert bool(((after - before) * advantage > 0).all())


@pytest.mark.parametrize(
    "ratio, advantage, has_grad",
    [
        (1.19, 1.0, True), (1.21, 1.0, False),  # A > 0: gain capped above 1 + clip_high
        (0.81, 1.0, True), (0.79, 1.0, True),  # ... but never below
        (0.81, -1.0, True), (0.79, -1.0, False),  # A < 0: capped below 1 - clip_low
        (1.19, -1.0, True), (1.21, -1.0, True),  # ... but never above
    ],
)
def test_clipping_boundary(ratio, advantage, has_grad):
    logp = torch.tensor([[LN(ratio)]], requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, 1), torch.tensor([advantage]), torch.ones(1, 1))
    loss.backward()
    expected_grad = -ratio * advantage if has_grad else 0.0
    assert_close(logp.grad, torch.tensor([[expected_grad]]))
    assert stats["clip_frac"] == (0.0 if has_grad else 1.0)


def test_kl_penalty_hand_values():
    logp = torch.tensor([LN(0.5), LN(0.2), LN(0.3)])
    ref = torch.tensor([LN(0.25), LN(0.2), LN(0.6)])
    l2 = LN(2.0)
    assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([l2, 0.0, -l2]))
    assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * l2**2, 0.0, 0.5 * l2**2]))
    # k3 = (q - 1) - log q, q = pi_ref / pi: q = 0.5, 1, 2
    assert_close(kl_penalty(logp, ref), torch.tensor([-0.5 + l2, 0.0, 1.0 - l2]))


def _gae_reference(rewards, values, mask, gamma, lam):
    """Plain python: per row, GAE over the list of real positions, V = A = 0 after the last one."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        real = [t for t in range(T) if mask[b][t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(real):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            adv[b][t] = delta + gamma * lam * next_adv
            next_value, next_adv = values[b][t], adv[b][t]
    returns = [[(adv[b][t] + values[b][t]) if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return adv, returns


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0), (0.99, 0.0)])
def test_gae_matches_python_loop(gamma, lam, holes):
    g = torch.Generator().manual_seed(11)
    B, T = 5, 9
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    if holes:  # arbitrary masks (e.g. tool output masked mid-row)
        mask = torch.rand(B, T, generator=g) < 0.6
    else:  # right padding: lengths 0..T
        lengths = torch.tensor([0, 1, 4, 8, 9])
        mask = torch.arange(T)[None, :] < lengths[:, None]
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    ref_adv, ref_ret = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    assert_close(adv, torch.tensor(ref_adv))
    assert_close(ret, torch.tensor(ref_ret))


def test_gae_hand_example():
    # gamma = lam = 1: A_t = (sum of rewards from t on) - V_t; the padded tail is ignored
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.25, 2.0, 9.0]])
    adv, ret = gae(rewards, values, torch.tensor([[1, 1, 1, 0]]), gamma=1.0, lam=1.0)
    assert_close(adv, torch.tensor([[0.5, 0.75, -1.0, 0.0]]))
    assert_close(ret, torch.tensor([[1.0, 1.0, 1.0, 0.0]]))


def test_value_loss_hand_example():
    values = torch.tensor([[1.0, 2.0, 1.0, 50.0]], requires_grad=True)
    old = torch.tensor([[0.9, 1.5, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # token 0: (1-2)^2 = 1, clipped v = 1.0 -> 1: 1.   token 1: 1 vs (1.7-1)^2 = 0.49: 1.
    # token 2: 0 vs (0.2-1)^2 = 0.64 (clipped wins): 0.64.   token 3 masked.
    loss, stats = value_loss(values, old, returns, mask, clip=0.2)
    assert_close(loss, torch.tensor(0.5 * (1.0 + 1.0 + 0.64) / 3))
    assert stats["value_clip_frac"] == pytest.approx(1 / 3)
    loss.backward()
    assert_close(values.grad, torch.tensor([[-1.0, 1.0, 0.0, 0.0]]) / 3)  # no gradient through the clip


def test_bad_input():
    x2, x3 = torch.zeros(2, 3), torch.zeros(2, 4)
    ones = torch.ones(2, 3)
    cases = [
        ("mask", lambda: masked_mean(x2, torch.ones(3))),
        ("rewards", lambda: group_advantages(x2, 2)),
        ("group_size", lambda: group_advantages(torch.zeros(4), 0)),
        ("group_size", lambda: group_advantages(torch.zeros(5), 2)),
        ("eps", lambda: group_advantages(torch.zeros(4), 2, eps=-1.0)),
        ("logp", lambda: policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))),
        ("old_logp", lambda: policy_loss(x2, x3, torch.zeros(2), ones)),
        ("mask", lambda: policy_loss(x2, x2, torch.zeros(2), torch.ones(2, 4))),
        ("advantages", lambda: policy_loss(x2, x2, torch.zeros(3), ones)),
        ("advantages", lambda: policy_loss(x2, x2, torch.zeros(2, 4), ones)),
        ("clip_low", lambda: policy_loss(x2, x2, torch.zeros(2), ones, clip_low=1.0)),
        ("clip_low", lambda: policy_loss(x2, x2, torch.zeros(2), ones, clip_low=-0.1)),
        ("clip_high", lambda: policy_loss(x2, x2, torch.zeros(2), ones, clip_high=-0.1)),
        ("aggregation", lambda: policy_loss(x2, x2, torch.zeros(2), ones, aggregation="sum")),
        ("max_len", lambda: policy_loss(x2, x2, torch.zeros(2), ones, max_len=0)),
        ("ref_logp", lambda: kl_penalty(x2, x3)),
        ("kind", lambda: kl_penalty(x2, x2, kind="k4")),
        ("token_rewards", lambda: gae(torch.zeros(3), torch.zeros(3), torch.ones(3))),
        ("values", lambda: gae(x2, x3, ones)),
        ("mask", lambda: gae(x2, x2, torch.ones(2, 4))),
        ("gamma", lambda: gae(x2, x2, ones, gamma=1.5)),
        ("lam", lambda: gae(x2, x2, ones, lam=-0.5)),
        ("values", lambda: value_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3))),
        ("old_values", lambda: value_loss(x2, x3, x2, ones)),
        ("returns", lambda: value_loss(x2, x2, x3, ones)),
        ("mask", lambda: value_loss(x2, x2, x2, torch.ones(2, 4))),
        ("clip", lambda: value_loss(x2, x2, x2, ones, clip=0.0)),
    ]
    for field, call in cases:
        with pytest.raises(ValueError, match=field):
            call()
