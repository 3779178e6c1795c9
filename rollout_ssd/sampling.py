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
    """log softmax(logits / T) over the full vocabulary, T = 1 for greedy rows (docs/DESIGN.md).

    logits: [N, V]; temperature: [N]. Returns float32 [N, V].
    """
    scaled = logits.float()
    if not _unit_temperatures(temperature):  # x / 1 is x exactly: only other temperatures divide
        temp = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(logits.device, torch.float32)
        scaled = scaled / temp[:, None]
    return torch.log_softmax(scaled, dim=-1)


def _unit_temperatures(temperature: torch.Tensor) -> bool:
    """Whether every row's logits are divided by 1: greedy rows (T <= 0, scaled as T = 1) and T = 1 ones."""
    return bool(((temperature <= 0) | (temperature == 1)).all())


TRUNCATION_CANDIDATES = 1024  # tokens examined before falling back to a full-vocabulary sort


def _drop_full_sort(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[N, V] bool: tokens outside top-k then top-p, by a stable descending sort of every token
    (ties: the lower token id ranks first)."""
    n, vocab = scaled.shape
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=scaled.device).expand(n, vocab)
    drop_sorted = rank >= k[:, None]
    probs_sorted = torch.softmax(sorted_logits.double().masked_fill(drop_sorted, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    drop_sorted |= (mass_before >= top_p.double()[:, None]) & (top_p < 1.0)[:, None]  # p = 1: no cut,
    # even where float32 cumulative mass rounds up to 1 before the last token
    drop_sorted[:, 0] = False
    return torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)


def _drop(scaled: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_drop_full_sort`'s answer, found from the M largest logits per row when that settles it.

    The kept set is a prefix of the stable descending order. A row is settled by its top M when the
    prefix ends before the M-th candidate and the last kept logit is strictly above the smallest
    candidate (then no token outside the candidates can rank before or tie with a kept one). Other
    rows take the full sort. Masses use the full row's normaliser, so they are those of the sort; both
    paths accumulate them in float64, so summation order cannot move the cut (float32 sums of the
    same masses in two orders differ by ~1e-7, enough to keep or drop the token at the boundary)."""
    n, vocab = scaled.shape
    m = min(vocab, max(TRUNCATION_CANDIDATES, int(torch.where(k < vocab, k, 0).max())))
    if m >= vocab // 2:
        return _drop_full_sort(scaled, k, top_p)
    vals, idx = torch.topk(scaled, m, dim=-1)  # [N, M] descending; tie order unspecified
    idx, perm = idx.sort(dim=-1)  # restore the stable order: token id ascending, then value descending
    vals, order = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(1, order)
    rank = torch.arange(m, device=scaled.device).expand(n, m)
    in_k = rank < k[:, None]
    wide = vals.double()
    lse_k = torch.logsumexp(wide.masked_fill(~in_k, float("-inf")), dim=-1)
    lse = torch.where(k < vocab, lse_k, torch.logsumexp(scaled.double(), dim=-1))  # [N]
    probs = torch.exp(wide - lse[:, None]).masked_fill(~in_k, 0.0)
    drop_c = ~in_k | (((torch.cumsum(probs, dim=-1) - probs) >= top_p.double()[:, None])
                      & (top_p < 1.0)[:, None])
    drop_c[:, 0] = False
    kept = (~drop_c).sum(dim=-1)  # [N] prefix length (drop_c is monotone along the row)
    last_kept = vals.gather(1, (kept - 1)[:, None])[:, 0]
    settled = (kept < m) & (last_kept > vals[:, -1])
    drop = torch.ones_like(scaled, dtype=torch.bool).scatter(1, idx, drop_c)
    if not bool(settled.all()):
        rest = (~settled).nonzero()[:, 0]
        drop[rest] = _drop_full_sort(scaled[rest], k[rest], top_p[rest])
    return drop


def target_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """The sampling law per row: softmax(logits / T) truncated by top-k then top-p, renormalised.

    logits: [N, V]; temperature, top_p: [N] float; top_k: [N] int (0 = off).
    Greedy rows (T == 0) get a point mass on argmax (lowest index on ties). Returns float32 [N, V].
    The parameters may stay on the host (as the engine builds them): which rows are greedy or
    truncated is then decided there, without waiting for the device.
    """
    n, vocab = logits.shape
    dev = logits.device
    logits = logits.float()
    greedy = temperature <= 0
    if bool(greedy.all()):  # every row a point mass: no softmax to compute and discard
        return _point_masses(logits)
    needs_trunc = (~greedy) & (((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    scaled = logits
    if not _unit_temperatures(temperature):
        scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).to(dev, torch.float32)[:, None]
    if bool(needs_trunc.any()):
        rows = needs_trunc.nonzero()[:, 0].to(dev)
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).to(dev)
        drop = _drop(scaled[rows], k[rows], top_p.to(dev)[rows])
        scaled = scaled.clone()
        scaled[rows] = scaled[rows].masked_fill(drop, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        probs = torch.where(greedy.to(dev)[:, None], _point_masses(logits), probs)
    return probs


def _point_masses(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] float32: each row's point mass on its argmax (the lowest index on ties), the greedy law."""
    return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(
        1, logits.argmax(dim=-1, keepdim=True), 1.0)


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
    # on the CPU the check is free and the fix-up rare; on an accelerator the check would be a host sync
    if probs.device.type != "cpu" or bool(bad.any()):
        last_pos = (probs > 0).cumsum(dim=-1).argmax(dim=-1)
        idx = torch.where(bad, last_pos, idx)
    return idx


def draw_tokens(probs: torch.Tensor, greedy: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """Next token per row: argmax for greedy rows (no draw), one uniform from the row's generator
    otherwise. probs: [N, V]; greedy: [N] bool; generators: N generators. Returns int64 [N]."""
    flags = greedy.tolist()  # on the host, as the engine builds it
    rows = [i for i, g in enumerate(flags) if not g]
    if not rows:
        return probs.argmax(dim=-1)
    u = torch.tensor([draw_uniform(generators[i]) for i in rows], dtype=torch.float64, device=probs.device)
    if len(rows) == len(flags):  # every row drawn: no argmax to compute and overwrite
        return sample_from_probs(probs, u)
    out = probs.argmax(dim=-1)
    index = torch.tensor(rows, dtype=torch.long, device=probs.device)
    out[index] = sample_from_probs(probs[index], u)
    return out


def row_params(rows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (temperature [B], top_k [B], top_p [B]) tensors of rows that carry `params`
    (SamplingParams): the target's sequences, or anything sampled with their law."""
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
    top_k = torch.tensor([r.params.top_k for r in rows], dtype=torch.long)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float32)
    return temperature, top_k, top_p
