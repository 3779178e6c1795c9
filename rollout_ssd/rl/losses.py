"""GRPO and PPO losses as pure functions of tensors: no model, no optimizer, no state.

Symbols: B rows (sequences), T completion positions, N = B rewards; `mask` [B, T] (bool or 0/1 float)
marks real completion tokens (padding and, in multi-turn, tool output are 0).

- GRPO (DeepSeekMath): advantage of a sample = its reward minus its group's mean (the group = the
  samples of one prompt), divided by the group's std. Dr.GRPO drops the std division (`scale=False`)
  and normalizes the summed token loss by a constant length ("seq-mean-token-sum-norm").
  We divide by the population std (ddof 0), not the unbiased one some implementations use: it is
  defined for groups of one (advantage 0) and differs only by the constant sqrt((G-1)/G).
- PPO clipped surrogate, per token: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), r = pi/pi_old;
  eps_low != eps_high is DAPO's "clip higher". Aggregations: "token-mean" (all real tokens of the
  batch weigh alike, DAPO), "seq-mean-token-mean" (rows weigh alike, original GRPO),
  "seq-mean-token-sum-norm" (row sums over a constant max_len, Dr.GRPO).
- KL estimators of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence"), with
  log_ratio = log pi - log pi_ref: k1 = log_ratio, k2 = log_ratio^2 / 2, k3 = (q - 1) - log q with
  q = pi_ref / pi (unbiased and never negative).
- GAE (Schulman et al. 2016) over each row's real tokens: masked positions are skipped, so trailing
  padding contributes nothing and the value after a row's last real token is 0.

Old log-probs, advantages, rewards and values used as targets are treated as constants (detached).
Losses are computed in float32 whatever the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_KINDS = ("k1", "k2", "k3")


def _check_2d(name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be [B, T], got shape {tuple(x.shape)}")


def _check_same(name: str, x: Tensor, like: Tensor, like_name: str) -> None:
    if x.shape != like.shape:
        raise ValueError(f"{name} must have the shape of {like_name} {tuple(like.shape)}, got {tuple(x.shape)}")


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of x over positions where mask is 1 (over all of them, or along `dim`); 0 where none.
    x, mask: same shape. Returns a scalar, or x's shape without `dim`."""
    _check_same("mask", mask, x, "x")
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp_min(1.0)
    return (x * m).sum(dim) / m.sum(dim).clamp_min(1.0)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(x - mean) / std over the real positions (population variance, eps 1e-8); with shift_mean=False
    the mean is added back (only the scale changes). Masked positions come out 0. Shape of x."""
    m = mask.to(x.dtype)
    mean = masked_mean(x, m)
    var = masked_mean((x - mean) ** 2, m)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * m


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages. rewards [N] ordered (prompt, sample): groups are `group_size` consecutive rows.
    A = r - mean_group, divided by (population std_group + eps) when `scale` (GRPO; a group with
    std + eps = 0 gets A = 0); scale=False is Dr.GRPO. Returns [N] float32."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an integer >= 1, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"group_size {group_size} must divide the number of rewards {rewards.numel()}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    groups = rewards.detach().float().view(-1, group_size)  # [N / G, G]
    centered = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        denom = groups.std(dim=1, unbiased=False, keepdim=True) + eps  # [N / G, 1]
        centered = torch.where(denom > 0, centered / denom.clamp_min(1e-30), torch.zeros_like(centered))
    return centered.reshape(-1)


def _aggregate(loss: Tensor, mask: Tensor, aggregation: str, max_len: Optional[int]) -> Tensor:
    """loss, mask [B, T] -> scalar, by `aggregation` (see the module docstring)."""
    if aggregation == "token-mean":
        return masked_mean(loss, mask)
    if aggregation == "seq-mean-token-mean":
        return masked_mean(loss, mask, dim=1).mean()
    norm = loss.shape[1] if max_len is None else max_len
    return ((loss * mask).sum(dim=1) / norm).mean()


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    aggregation: str = "token-mean",
    max_len: Optional[int] = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate. logp, old_logp, mask: [B, T]; advantages: [B] (one per row, broadcast over
    T) or [B, T]. max_len: the constant of "seq-mean-token-sum-norm" (default T).
    Returns (scalar loss, stats): clip_frac (share of real tokens where the clipped term is taken),
    ratio_mean, ratio_max, approx_kl (k3 estimate of KL(pi_old || pi), mean over real tokens)."""
    _check_2d("logp", logp)
    _check_same("old_logp", old_logp, logp, "logp")
    _check_same("mask", mask, logp, "logp")
    if advantages.shape == logp.shape[:1]:
        advantages = advantages[:, None]  # [B, 1], broadcast over T
    elif advantages.shape != logp.shape:
        raise ValueError(f"advantages must be [B] or [B, T] with [B, T] = {tuple(logp.shape)}, "
                         f"got {tuple(advantages.shape)}")
    if not 0 <= clip_low < 1:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be an integer >= 1 or None, got {max_len!r}")

    m = mask.float()  # [B, T]
    adv = advantages.detach().float()  # [B, 1] or [B, T]
    log_ratio = logp.float() - old_logp.detach().float()  # [B, T]
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))  # no inf (inf * 0 advantage = nan) on stale tokens
    unclipped = -ratio * adv  # [B, T]
    clipped = -torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = torch.maximum(unclipped, clipped)  # = -min(r A, clip(r) A)
    loss = _aggregate(per_token, m, aggregation, max_len)

    with torch.no_grad():
        real = m > 0
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).float(), m).item(),
            "ratio_mean": masked_mean(ratio, m).item(),
            "ratio_max": ratio[real].max().item() if real.any() else 0.0,
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, m).item(),
        }
    return loss, stats


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi. logp, ref_logp: same shape
    (e.g. [B, T]); returns that shape. kind: "k1" | "k2" | "k3" (see the module docstring)."""
    _check_same("ref_logp", ref_logp, logp, "logp")
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    log_ratio = logp.float() - ref_logp.detach().float()  # log pi - log pi_ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1.0 + log_ratio  # (q - 1) - log q, q = pi_ref / pi


def gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation. token_rewards, values, mask: [B, T].
    delta_t = r_t + gamma V_next - V_t; A_t = delta_t + gamma lam A_next, where "next" is the row's next
    real token (V = A = 0 after the last one). Returns (advantages [B, T], returns = A + V [B, T]), both 0
    at masked positions; float32, detached."""
    _check_2d("token_rewards", token_rewards)
    _check_same("values", values, token_rewards, "token_rewards")
    _check_same("mask", mask, token_rewards, "token_rewards")
    if not 0 <= gamma <= 1:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    if not 0 <= lam <= 1:
        raise ValueError(f"lam must be in [0, 1], got {lam}")
    rewards, vals, real = token_rewards.detach().float(), values.detach().float(), mask.bool()
    B, T = rewards.shape
    advantages = torch.zeros_like(rewards)  # [B, T]
    next_value = rewards.new_zeros(B)  # [B] value of each row's next real token
    next_adv = rewards.new_zeros(B)  # [B] advantage of each row's next real token
    for t in range(T - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]  # [B]
        adv_t = delta + gamma * lam * next_adv
        here = real[:, t]
        advantages[:, t] = torch.where(here, adv_t, torch.zeros_like(adv_t))
        next_adv = torch.where(here, adv_t, next_adv)  # masked positions pass the future through
        next_value = torch.where(here, vals[:, t], next_value)
    returns = (advantages + vals) * real
    return advantages, returns


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float = 0.2
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss, token-mean over real tokens: 0.5 max((v - R)^2, (clip(v, old - c, old + c) - R)^2).
    values, old_values, returns, mask: [B, T]. Returns (scalar loss, {"value_clip_frac"}: share of real
    tokens where the clipped term is the larger)."""
    _check_2d("values", values)
    _check_same("old_values", old_values, values, "values")
    _check_same("returns", returns, values, "values")
    _check_same("mask", mask, values, "values")
    if clip <= 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    m = mask.float()
    v = values.float()
    old, target = old_values.detach().float(), returns.detach().float()
    v_clipped = old + torch.clamp(v - old, -clip, clip)  # [B, T]
    unclipped_sq, clipped_sq = (v - target) ** 2, (v_clipped - target) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped_sq, clipped_sq), m)
    with torch.no_grad():
        stats = {"value_clip_frac": masked_mean((clipped_sq > unclipped_sq).float(), m).item()}
    return loss, stats
