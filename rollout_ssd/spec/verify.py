"""Speculative-decoding verification: one pure function of tensors and per-row generators.

Algorithm (docs/THEORY.md §1; Leviathan et al. 2023, Chen et al. 2023). Row b proposed draft tokens
s_1..s_K (K = num_draft[b], 0 <= K <= Kmax), each s_i sampled from the draft law q_i. The target scored
the K+1 positions; p_i = target_probs(logits_i) is the law a plain AR step would sample from there.
  1. For i = 1..K in order: draw u ~ U[0, 1) and accept s_i iff u < p_i(s_i) / q_i(s_i), i.e. with
     probability min(1, p_i(s_i) / q_i(s_i)). Stop at the first rejection, position j.
  2. Bonus token t*: rejected at j -> t* ~ r_j ∝ max(p_j - q_j, 0); all K accepted -> t* ~ p_{K+1}.
  3. Emit s_1..s_{j-1}, t*: between 1 and K+1 tokens. K = 0 is a plain AR step.
Why it is exact: at any position, P(emit x) = q(x)·min(1, p(x)/q(x)) + P(reject)·r(x)
  = min(p, q)(x) + max(p - q, 0)(x) = p(x), because P(reject) = Σ max(q - p, 0) = Σ max(p - q, 0)
is exactly r's normaliser. By induction the emitted sequence has the target's AR law.
Greedy rows (T = 0): p_i is a point mass on argmax logits_i (lowest index on ties), so the rule is
"accept while s_i == argmax; t* = argmax at the first mismatch (or at K+1)" and draws no random numbers.

The draft law q comes in the form the speculator has: `DenseDraft` (a full [V] vector per position),
`SparseDraft` (the draft sampled from an exact small support), `PointDraft` (q = δ at the proposed token:
suffix, n-gram, random-token speculators). A point mass is exact for ANY proposal chosen independently of
the verifier's uniforms: given x, accept with prob p(x), else draw from p with x removed, renormalised,
so x is emitted with prob p(x) and y != x with prob (1 - p(x))·p(y)/(1 - p(x)) = p(y).
Treating it as a greedy match at T > 0 would favour argmax p (THEORY §1.5); we do not.
`MixedDraft` combines one single-row law per row (in SSD a cache hit has the draft model's q, a miss a point mass).
Verification must use exactly the q each chain was sampled from (THEORY §2).

Randomness: row b draws only from generators[b], one uniform per judged draft token then one for the
bonus, so a row's result never depends on which other rows share the batch.
Logprobs: full_logprobs at each emitted token (full vocabulary, before top-k/top-p; T = 1 if greedy).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rollout_ssd.sampling import (
    draw_uniform,
    full_logprobs,
    sample_from_probs,
    target_probs,
)


class DraftDistribution(ABC):
    """The draft law q_i of every row b and draft position i (0-based), in the speculator's own form."""

    num_rows: int | None = None  # B, or None when any batch size fits

    def width(self, row: int) -> int | None:
        """How many draft positions `row` describes (None: any number)."""
        return None

    @abstractmethod
    def token_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        """q_i(tokens[b, i]) for tokens [B, K]; float32 [B, K], 1.0 at positions beyond a row's width."""

    @abstractmethod
    def dense(self, rows: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        """q at (rows[n], pos[n]) as float32 [N, V] vectors; tokens[n] is the draft token proposed there.
        rows, pos, tokens: [N] int64."""


def _pad_width(values: torch.Tensor, k: int) -> torch.Tensor:
    """[B, W] -> [B, k]: cut, or pad with 1.0 (positions a draft does not describe are never judged)."""
    if values.shape[1] >= k:
        return values[:, :k]
    return torch.cat([values, values.new_ones(values.shape[0], k - values.shape[1])], dim=1)


class DenseDraft(DraftDistribution):
    """q as full vectors: probs [B, W, V] (rows sum to 1 over V)."""

    def __init__(self, probs: torch.Tensor):
        if probs.dim() != 3:
            raise ValueError(f"DenseDraft.probs must be [B, K, V], got shape {tuple(probs.shape)}")
        self.probs = probs
        self.num_rows = probs.shape[0]

    def width(self, row: int) -> int | None:
        return self.probs.shape[1]

    def token_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        w = min(self.probs.shape[1], tokens.shape[1])
        q = self.probs[:, :w].gather(2, tokens[:, :w, None].to(self.probs.device)).squeeze(2)  # [B, w]
        return _pad_width(q.float().to(tokens.device), tokens.shape[1])

    def dense(self, rows: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        dev = self.probs.device
        return self.probs[rows.to(dev), pos.to(dev)].float()


class SparseDraft(DraftDistribution):
    """q on a small exact support: indices [B, W, S] int64, probs [B, W, S]; q(x) = Σ probs where
    indices == x (padding entries carry probability 0; a repeated index adds up)."""

    def __init__(self, indices: torch.Tensor, probs: torch.Tensor):
        if indices.dim() != 3 or indices.shape != probs.shape:
            raise ValueError(
                f"SparseDraft.indices and .probs must share a [B, K, S] shape, got "
                f"{tuple(indices.shape)} and {tuple(probs.shape)}"
            )
        self.indices, self.probs = indices, probs
        self.num_rows = indices.shape[0]

    def width(self, row: int) -> int | None:
        return self.indices.shape[1]

    def token_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        w = min(self.indices.shape[1], tokens.shape[1])
        hit = self.indices[:, :w] == tokens[:, :w, None].to(self.indices.device)  # [B, w, S]
        q = (self.probs[:, :w].float() * hit).sum(dim=2)  # [B, w]
        return _pad_width(q.to(tokens.device), tokens.shape[1])

    def dense(self, rows: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        rows, pos = rows.to(self.indices.device), pos.to(self.indices.device)
        q = torch.zeros(rows.shape[0], vocab, dtype=torch.float32, device=self.probs.device)
        return q.scatter_add_(1, self.indices[rows, pos], self.probs[rows, pos].float())


class PointDraft(DraftDistribution):
    """q = δ at the proposed token (suffix / n-gram / random-token speculators); fits any batch."""

    def token_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)

    def dense(self, rows: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(tokens, vocab).float()


class MixedDraft(DraftDistribution):
    """One single-row law per batch row, of any kinds: rows[b] describes row b as its own row 0."""

    def __init__(self, rows: Sequence[DraftDistribution]):
        for b, dist in enumerate(rows):
            if dist.num_rows not in (None, 1):
                raise ValueError(f"MixedDraft.rows[{b}] must describe one row, got {dist.num_rows} rows")
        self.rows = list(rows)
        self.num_rows = len(self.rows)

    def width(self, row: int) -> int | None:
        return self.rows[row].width(0)

    def token_probs(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.cat([dist.token_probs(tokens[b : b + 1]) for b, dist in enumerate(self.rows)], dim=0)

    def dense(self, rows: torch.Tensor, pos: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
        zero = torch.zeros(1, dtype=torch.int64, device=rows.device)
        return torch.cat([
            self.rows[int(r)].dense(zero, pos[n : n + 1], tokens[n : n + 1], vocab).to(rows.device)
            for n, r in enumerate(rows.tolist())
        ])


@dataclass(frozen=True)
class VerifyResult:
    """The verdict of one round for every row."""

    tokens: torch.Tensor  # [B, Kmax+1] int64: accepted draft tokens then the bonus, padded with -1
    num_emitted: torch.Tensor  # [B] int64: num_accepted + 1
    num_accepted: torch.Tensor  # [B] int64
    rejected: torch.Tensor  # [B] bool: a draft token was judged and rejected (judged = accepted + rejected)
    logprobs: torch.Tensor  # [B, Kmax+1] float32: full_logprobs at the emitted tokens, padded with 0


def _check_inputs(target_logits, draft_tokens, num_draft, q, temperature, top_k, top_p, generators):
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [B, Kmax+1, V], got shape {tuple(target_logits.shape)}")
    b, k1, vocab = target_logits.shape
    if tuple(draft_tokens.shape) != (b, k1 - 1):
        raise ValueError(f"draft_tokens must be [{b}, {k1 - 1}], got shape {tuple(draft_tokens.shape)}")
    for name, t in (("num_draft", num_draft), ("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if tuple(t.shape) != (b,):
            raise ValueError(f"{name} must be [{b}], got shape {tuple(t.shape)}")
    if len(generators) != b:
        raise ValueError(f"generators must hold one generator per row ({b}), got {len(generators)}")
    if q.num_rows not in (None, b):
        raise ValueError(f"q describes {q.num_rows} rows, the batch has {b}")
    ks = num_draft.tolist()
    for row, k in enumerate(ks):
        width = q.width(row)
        if not 0 <= k <= k1 - 1 or (width is not None and k > width):
            raise ValueError(
                f"num_draft[{row}] = {k} is outside [0, {k1 - 1}] or beyond the draft's width {width}"
            )
    judged = torch.arange(k1 - 1, device=num_draft.device)[None, :] < num_draft[:, None]  # [B, Kmax]
    bad = judged.to(draft_tokens.device) & ((draft_tokens < 0) | (draft_tokens >= vocab))
    if bool(bad.any()):
        row = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(f"draft_tokens[{row}] holds a token outside [0, {vocab}) among its judged positions")
    return ks


def _judge_sampled_rows(ks, greedy, p_draft, q_draft, generators, num_accepted) -> tuple[list[int], list[float]]:
    """Step 1 for the sampled rows, in row order: one uniform per judged draft token, stopping at the first
    rejection; writes num_accepted[b]. Then one more uniform per row, for its bonus. Returns the sampled
    rows and those bonus uniforms."""
    sampled, uniforms = [], []
    for b in range(len(ks)):
        if greedy[b]:
            continue
        a, gen = 0, generators[b]
        # Accept s_i with prob min(1, p/q)  <=>  u < p/q  <=>  u·q < p  (no division; q(s_i) > 0 as s_i ~ q).
        while a < ks[b] and draw_uniform(gen) * q_draft[b][a] < p_draft[b][a]:
            a += 1
        num_accepted[b] = a
        sampled.append(b)
        uniforms.append(draw_uniform(gen))
    return sampled, uniforms


def _draw_bonus(p: torch.Tensor, q: DraftDistribution, tokens_in: torch.Tensor, rows: torch.Tensor,
                accepted: torch.Tensor, rejected: torch.Tensor, u: torch.Tensor, any_rejected: bool) -> torch.Tensor:
    """Step 2 for the sampled `rows` [N]: t* from the residual r_j at a rejection, from p_{K+1} when all
    were accepted, by inverse CDF with the uniforms u [N]. p: [B, K+1, V]. Returns t* [N]."""
    vocab = p.shape[-1]
    at = accepted[rows]  # [N]: 0-based index of the rejected token, or of the bonus slot K if none
    dists = p[rows, at]  # [N, V]: p_{K+1} where all were accepted
    rej = rejected[rows]  # [N]
    if any_rejected:  # rej.any(), known on the host
        r_rows, r_at = rows[rej], at[rej]
        p_j = dists[rej]  # [R, V]
        q_j = q.dense(r_rows, r_at, tokens_in[r_rows, r_at], vocab).to(p.device)  # [R, V]
        residual = torch.clamp(p_j - q_j, min=0.0)  # r_j ∝ max(p_j - q_j, 0)
        # An all-zero residual means p_j <= q_j everywhere; as both sum to 1, p_j == q_j up to rounding,
        # and then P(reject at j) = Σ max(q_j - p_j, 0) = 0 in exact arithmetic: we only get here on a
        # measure-zero event (a rounding-sized excess of q), where any choice keeps the law. We draw
        # from p_j, the law this position would have had, which never emits a zero-mass token.
        dists[rej] = torch.where(residual.sum(dim=1, keepdim=True) > 0, residual, p_j)
    return sample_from_probs(dists, u)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    q: DraftDistribution,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generators: Sequence[torch.Generator],
) -> VerifyResult:
    """Verify one round of drafts for a batch with ragged K (see the module docstring).

    target_logits: [B, Kmax+1, V] raw target logits at the positions predicting s_1..s_Kmax and the bonus;
    draft_tokens: [B, Kmax] int64 (padding past num_draft[b] is ignored); num_draft: [B] int64;
    q: the draft law of every row; temperature, top_p: [B] float; top_k: [B] int; generators: one per row.
    """
    ks = _check_inputs(target_logits, draft_tokens, num_draft, q, temperature, top_k, top_p, generators)
    batch, k1, vocab = target_logits.shape
    kmax, device = k1 - 1, target_logits.device
    greedy = (temperature <= 0).tolist()

    target_logits = target_logits.float()  # once, for the law, the argmax and the logprobs (bitwise the same)
    flat_logits = target_logits.reshape(batch * k1, vocab)
    tokens_in = draft_tokens.to(device).clamp(0, vocab - 1)  # [B, Kmax], padding made a valid index
    if all(greedy):  # every row judged by its argmax alone (below): no law to build
        p, p_at = None, torch.zeros(batch, kmax, device=device)
        q_at = p_at
    else:
        # the parameters stay where the caller made them (the host): target_probs moves what it computes with
        p = target_probs(
            flat_logits, temperature.repeat_interleave(k1), top_k.repeat_interleave(k1), top_p.repeat_interleave(k1)
        ).view(batch, k1, vocab)  # p_i, [B, K+1, V]
        p_at = p[:, :kmax].gather(2, tokens_in[..., None]).squeeze(2)  # p_i(s_i), [B, Kmax]
        q_at = q.token_probs(tokens_in).to(device)  # q_i(s_i), [B, Kmax]
    argmax = target_logits.argmax(dim=-1)  # [B, K+1]; torch returns the first index on ties

    # Greedy rows, vectorised: accepted = length of the prefix where s_i == argmax_i.
    pos = torch.arange(kmax, device=device)
    match = (tokens_in == argmax[:, :kmax]) & (pos[None, :] < num_draft.to(device)[:, None])  # [B, Kmax]
    greedy_at = match.long().cumprod(dim=1).sum(dim=1)
    # what the host judges with, in one transfer (float64 holds float32 masses and counts exactly)
    host = torch.cat([p_at.double(), q_at.double(), greedy_at[:, None].double()], dim=1).tolist()
    p_draft = [row[:kmax] for row in host]  # [B][Kmax]
    q_draft = [row[kmax:2 * kmax] for row in host]
    greedy_accepted = [int(row[2 * kmax]) for row in host]

    # Sampled rows, in order: one uniform per judged draft token, then one for the bonus.
    num_accepted = list(greedy_accepted)  # greedy rows draw nothing: their generators stay untouched
    sampled, uniforms = _judge_sampled_rows(ks, greedy, p_draft, q_draft, generators, num_accepted)

    accepted = torch.tensor(num_accepted, dtype=torch.int64, device=device)  # [B]
    rejected_rows = [a < k for a, k in zip(num_accepted, ks)]  # known on the host: no wait for the device
    rejected = torch.tensor(rejected_rows, dtype=torch.bool, device=device)  # [B]
    bonus = argmax.gather(1, accepted[:, None]).squeeze(1)  # [B]; the greedy rows' t*
    if sampled:
        rows = torch.tensor(sampled, dtype=torch.int64, device=device)  # [N]
        u = torch.tensor(uniforms, dtype=torch.float64, device=device)  # [N]
        any_rejected = any(rejected_rows[i] for i in sampled)
        bonus[rows] = _draw_bonus(p, q, tokens_in, rows, accepted, rejected, u, any_rejected)

    # tokens = s_1..s_a, t*, -1 padding
    col = torch.arange(k1, device=device)[None, :]  # [1, K+1]
    drafted = torch.cat([tokens_in, tokens_in.new_zeros(batch, 1)], dim=1)  # [B, K+1]
    tokens = torch.where(col < accepted[:, None], drafted, torch.full_like(drafted, -1))
    tokens = torch.where(col == accepted[:, None], bonus[:, None], tokens)
    emitted = tokens >= 0  # [B, K+1]

    logp = full_logprobs(flat_logits, temperature.repeat_interleave(k1)).view(batch, k1, vocab)  # [B, K+1, V]
    logprobs = logp.gather(2, tokens.clamp(min=0)[..., None]).squeeze(2).masked_fill(~emitted, 0.0)

    return VerifyResult(
        tokens=tokens,
        num_emitted=accepted + 1,
        num_accepted=accepted,
        rejected=rejected,
        logprobs=logprobs,
    )
