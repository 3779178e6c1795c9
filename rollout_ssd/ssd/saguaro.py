"""Saguaro sampling (Definition 14 / Theorem 15): bend the draft toward the cache's residual.

At a depth whose cache holds the top-F draft tokens S, the draft samples from

    q_C(t) ∝ C·q(t) for t in S,   q(t) otherwise,   0 < C <= 1,

i.e. with Q = q(S) and Z = 1 - (1 - C)·Q: q_C = C·q/Z on S and q/Z off S. Verification accepts s with
min(1, p(s)/q_C(s)) and, on rejection, draws the bonus token from max(p - q_C, 0): lowering q_C on S
moves that residual onto S, so the bonus token lands in the cache more often (the hit probability is
non-increasing in C), while acceptance sum_t min(p, q_C) usually falls. The output law stays the
target's as long as verification uses q_C itself.

The reference engine downweights the top-F tokens of the draft's probabilities (its "sampler_x"), and
builds the cache at each depth from the top-F draft tokens excluding the token that was sent. We follow
both: `hit_probability` with an integer fan-out uses exactly that cache rule.

Adaptive C is our own choice (the paper fixes C by hand; see `adaptive_c`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


def _check_c(C: float | torch.Tensor) -> None:
    if isinstance(C, torch.Tensor):
        if not bool(((C > 0) & (C <= 1)).all()):
            raise ValueError("Saguaro C must lie in (0, 1] for every row")
    elif not (isinstance(C, (int, float)) and 0.0 < C <= 1.0):
        raise ValueError(f"Saguaro C must lie in (0, 1], got {C!r}")


def top_f_mask(probs: torch.Tensor, fanout: int) -> torch.Tensor:
    """Bool mask of each row's top-`fanout` tokens (stable: lower index first on ties).

    probs: [N, V]. Returns bool [N, V].
    """
    n, vocab = probs.shape
    mask = torch.zeros(n, vocab, dtype=torch.bool, device=probs.device)
    f = min(max(int(fanout), 0), vocab)
    if f > 0:
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :f]
        mask.scatter_(1, order, True)
    return mask


def saguaro_probs(
    q: torch.Tensor, cached_mask: torch.Tensor, C: float | torch.Tensor
) -> torch.Tensor:
    """q_C ∝ C·q on the cached set, q off it; renormalised per row.

    q: [N, V] probabilities; cached_mask: [N, V] bool; C: float or [N]. Returns [N, V], q's dtype.
    C = 1 returns q (up to renormalisation rounding).
    """
    if q.shape != cached_mask.shape:
        raise ValueError(f"q {tuple(q.shape)} and cached_mask {tuple(cached_mask.shape)} differ in shape")
    _check_c(C)
    scale = C[:, None].to(q.dtype) if isinstance(C, torch.Tensor) else torch.tensor(C, dtype=q.dtype)
    weighted = torch.where(cached_mask, q * scale, q)
    return weighted / weighted.sum(dim=-1, keepdim=True)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in nats per row. probs: [N, V]. Returns [N]."""
    logs = torch.where(probs > 0, probs.log(), torch.zeros_like(probs))
    return -(probs * logs).sum(dim=-1)


def adaptive_c(
    entropy_nats: torch.Tensor, c_min: float, c_max: float = 1.0, h_ref: float = math.log(8.0)
) -> torch.Tensor:
    """Per-context C, linear in entropy: C = c_max - (c_max - c_min)·min(1, H / h_ref).

    entropy_nats: [N] (the draft's entropy at the depth being sampled is available at sampling time;
    the target's entropy from the previous round is a good alternative). Returns [N] in [c_min, c_max].

    Reasoning (our own rule, not from the paper): in a low-entropy context the draft is usually
    accepted, rejections are rare, and downweighting the dominant cached token moves real mass off it,
    so acceptance pays and the hit rate barely matters: keep C near 1. In a high-entropy context
    rejections are common and the residual is spread thin over many tokens, so pushing it onto the
    cached ones buys the most hits, while acceptance there is already low and loses less in
    proportion: push C toward c_min. h_ref = ln 8 means "as spread as a uniform over 8 tokens" is the
    saturation point. c_min is a knob, found by sweeping (bench/), as in the paper.
    """
    if not 0.0 < c_min <= c_max <= 1.0:
        raise ValueError(f"need 0 < c_min <= c_max <= 1, got c_min={c_min!r}, c_max={c_max!r}")
    if not h_ref > 0:
        raise ValueError(f"h_ref must be > 0, got {h_ref!r}")
    spread = (entropy_nats / h_ref).clamp(0.0, 1.0)
    return c_max - (c_max - c_min) * spread


def acceptance_probability(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """sum_t min(p, q): the probability that a draft token sampled from q is accepted. [..., V] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)


def hit_probability(
    p: torch.Tensor, q: torch.Tensor, cached_set: int | Iterable[int] | torch.Tensor, C: float = 1.0
) -> float:
    """P(bonus token is cached | the draft token is rejected) at one position, computed exactly.

    p, q: [V] target and (unmodified) draft probabilities. The draft samples s from q_C.
    cached_set:
      - an int F: the engine's rule. Saguaro downweights S = top-F of q; the cache holds the top-F
        tokens of q excluding the sent token s, so if s is in S the (F+1)-th token steps in.
      - token ids or a bool [V] mask: a fixed set S, both downweighted and cached.
    Returns 1.0 when rejection is impossible (q_C == p): no bonus is drawn from a residual, so this
    position can cause no miss. Computed in float64.

    THEORY's "p_hit is non-increasing in C" holds for a fixed set. Under the int rule it can fail,
    because lowering C also shrinks the residual on the (F+1)-th token: p = (.1, .2, .7),
    q = (.8, .1, .1), F = 1 gives 1/7 at C = 1 but 1/17 at C = 1/2.
    """
    p = p.detach().to(torch.float64).reshape(-1)
    q = q.detach().to(torch.float64).reshape(-1)
    vocab = p.numel()
    if q.numel() != vocab:
        raise ValueError(f"p has {vocab} entries, q has {q.numel()}")
    if isinstance(cached_set, int):
        order = torch.sort(q, descending=True, stable=True).indices
        downweighted = torch.zeros(vocab, dtype=torch.bool)
        downweighted[order[:cached_set]] = True
        extra = int(order[cached_set]) if cached_set < vocab else None
    else:
        if isinstance(cached_set, torch.Tensor) and cached_set.dtype == torch.bool:
            downweighted = cached_set.reshape(-1).clone()
        else:
            downweighted = torch.zeros(vocab, dtype=torch.bool)
            downweighted[list(cached_set)] = True
        extra = None
    q_c = saguaro_probs(q[None], downweighted[None], C)[0]
    residual = (p - q_c).clamp_min(0.0)  # bonus law on rejection, unnormalised; its mass = P(reject)
    overshoot = (q_c - p).clamp_min(0.0)  # P(sent s and rejected) per s
    total = float(residual.sum())
    if total <= 1e-15:
        return 1.0
    in_set = float(residual[downweighted].sum())
    # A rejected s has residual(s) == 0, so excluding s from the cache never loses a hit; the only
    # effect of the exclusion rule is the (F+1)-th token joining the cache when s was in S.
    hit_mass = in_set * total
    if extra is not None:
        hit_mass += float(overshoot[downweighted].sum()) * float(residual[extra])
    return hit_mass / total**2
