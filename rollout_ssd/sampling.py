"""Token sampling: the target law, logprobs and per-sequence randomness.

The law a rollout is drawn from is fixed here and nowhere else: logits are divided by the
temperature, then top-k keeps the k largest, then top-p keeps the smallest prefix of the sorted
distribution whose mass reaches p (the token that crosses p is kept). Temperature 0 means greedy.
Speculative paths verify against `target_probs`, so AR, SD and SSD share one law by construction.

Randomness: every sequence owns a `torch.Generator` seeded from (seed, prompt index, sample index);
a draw is one uniform per decision, turned into a token by inverse CDF, so how many other rows are
in the batch never changes what a row draws. Rows with nothing to decide (greedy) draw nothing.
"""

from __future__ import annotations

import hashlib

import torch


def sequence_generator(seed: int, prompt_index: int, sample_index: int, stream: int = 0) -> torch.Generator:
    """A CPU generator whose state depends only on (seed, prompt_index, sample_index, stream)."""
    digest = hashlib.blake2b(
        f"{seed}:{prompt_index}:{sample_index}:{stream}".encode(), digest_size=8
    ).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def draw_uniform(gen: torch.Generator) -> float:
    """One U[0, 1) draw from a sequence's own generator."""
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def full_logprobs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T) over the full vocabulary, T = 1 for greedy rows (DESIGN.md).

    logits: [N, V]; temperature: [N]. Returns float32 [N, V].
    """
    temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    return torch.log_softmax(logits.float() / temp[:, None], dim=-1)


def target_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The sampling law per row: softmax(logits / T) truncated by top-k then top-p, renormalised.

    logits: [N, V]; temperature, top_p: [N] float; top_k: [N] int (0 = off).
    Greedy rows (T == 0) get a point mass on argmax (lowest index on ties). Returns float32 [N, V].
    """
    n, vocab = logits.shape
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).to(torch.float32)
    scaled = logits / temp[:, None]
    needs_trunc = (~greedy) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    if bool(needs_trunc.any()):
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=logits.device).expand(n, vocab)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).to(logits.device)
        drop_sorted = rank >= k[:, None]
        probs_sorted = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
        mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
        drop_sorted |= mass_before >= top_p.to(torch.float32)[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        scaled = scaled.masked_fill(drop & needs_trunc[:, None], float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        point = torch.zeros_like(probs)
        point.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], point, probs)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: row i takes the first token whose cumulative mass exceeds u_i.

    probs: [N, V] (rows need not be normalised); uniforms: [N] in [0, 1). Returns int64 [N].
    Tokens of zero mass are never returned.
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    total = cdf[:, -1:]
    u = uniforms.double()[:, None] * total
    idx = torch.searchsorted(cdf, u, right=True).squeeze(1)
    idx = idx.clamp_(max=probs.shape[1] - 1)
    # Guard against rounding landing on a zero-mass tail: step back to the last positive token.
    bad = probs.gather(1, idx[:, None]).squeeze(1) <= 0
    if bool(bad.any()):
        last_pos = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
        idx = torch.where(bad, last_pos, idx)
    return idx


def draw_tokens(probs: torch.Tensor, greedy: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: argmax for greedy rows (no draw), one uniform from the row's generator
    otherwise. probs: [N, V]; greedy: [N] bool; generators: N generators. Returns int64 [N]."""
    out = probs.argmax(dim=-1)
    rows = [i for i in range(probs.shape[0]) if not bool(greedy[i])]
    if rows:
        u = torch.tensor([draw_uniform(generators[i]) for i in rows], dtype=torch.float64)
        out[rows] = sample_from_probs(probs[rows], u)
    return out
