"""Tests for rollout_ssd.spec.verify: exact greedy cases, per-row independence, logprobs, and the law.

The law tests run whole SD generations on a toy "model" (logits = a fixed random table indexed by the last
token, V = 6) with a draft that is a different function, and compare the empirical law of the 3-token
continuation with the exact target law (a product of target_probs along the path, by enumeration).
"""

from __future__ import annotations

import pytest
import torch

from rollout_ssd.sampling import (
    draw_uniform,
    sample_from_probs,
    sequence_generator,
    target_probs,
)
from rollout_ssd.spec.verify import (
    DenseDraft,
    MixedDraft,
    PointDraft,
    SparseDraft,
    verify,
)
from tests.support.laws import exact_law
from tests.support.stats import assert_fits

V, L, START = 6, 3, 0  # vocabulary, continuation length, context token
_tables = torch.Generator().manual_seed(1234)
TARGET = 1.5 * torch.randn(V, V, generator=_tables)  # target logits given the last token
DRAFT_NEAR = TARGET + 0.7 * torch.randn(V, V, generator=_tables)
DRAFT_FAR = -2.0 * TARGET  # puts its mass where the target has least
NGRAM = DRAFT_NEAR.argmax(dim=1)  # deterministic next-token guess, correlated with the target's argmax


def _sampling(batch: int, temperature: float, top_k: int = 0, top_p: float = 1.0):
    return (
        torch.full((batch,), temperature),
        torch.full((batch,), top_k, dtype=torch.int64),
        torch.full((batch,), top_p),
    )


def _verify(logits, tokens, num_draft, dist, temperature, top_k=0, top_p=1.0, gens=None):
    batch = logits.shape[0]
    gens = gens if gens is not None else [torch.Generator().manual_seed(i) for i in range(batch)]
    return verify(logits, tokens, num_draft, dist, *_sampling(batch, temperature, top_k, top_p), gens)


# ---- greedy: exact ------------------------------------------------------------------------------


def test_greedy_cases_exact_and_draw_nothing():
    logits = torch.randn(6, 4, V, generator=torch.Generator().manual_seed(0))
    logits[5, 0] = torch.tensor([0.0, 3.0, 3.0, 1.0, 0.0, 0.0])  # a tie: argmax is the first index, 1
    am = logits.argmax(dim=-1)  # [B, 4]
    wrong = (am + 1) % V
    tokens = am[:, :3].clone()
    tokens[1, 0] = wrong[1, 0]  # first rejected
    tokens[2, 1] = wrong[2, 1]  # middle rejected
    tokens[4, 2] = -1  # row 4 drafts only 2 (ragged), padding -1
    tokens[5, 0] = 2  # the other tied token: rejected
    num_draft = torch.tensor([3, 3, 3, 0, 2, 3])
    expected = torch.tensor([
        [am[0, 0], am[0, 1], am[0, 2], am[0, 3]],
        [am[1, 0], -1, -1, -1],
        [am[2, 0], am[2, 1], -1, -1],
        [am[3, 0], -1, -1, -1],
        [am[4, 0], am[4, 1], am[4, 2], -1],
        [1, -1, -1, -1],
    ])
    q = torch.softmax(torch.randn(6, 3, V, generator=torch.Generator().manual_seed(1)), dim=-1)
    for dist in (PointDraft(), DenseDraft(q)):
        gens = [torch.Generator().manual_seed(i) for i in range(6)]
        states = [g.get_state() for g in gens]
        res = _verify(logits, tokens, num_draft, dist, 0.0, gens=gens)
        assert torch.equal(res.tokens, expected)
        assert torch.equal(res.num_accepted, torch.tensor([3, 0, 1, 0, 2, 0]))
        assert torch.equal(res.num_emitted, res.num_accepted + 1)
        assert torch.equal(res.rejected, torch.tensor([False, True, True, False, False, True]))
        assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, states))


# ---- per-row independence, draw counts, logprobs ------------------------------------------------


def _mixed_rows(seed: int):
    """Six rows of different kinds and sampling params, K ragged in [0, 3]."""
    g = torch.Generator().manual_seed(seed)
    k = 3
    logits = 2 * torch.randn(6, k + 1, V, generator=g)
    dense = torch.softmax(torch.randn(6, k, V, generator=g), dim=-1)
    sp_idx = torch.stack([torch.randperm(V, generator=g)[:3] for _ in range(6 * k)]).view(6, k, 3)
    sp_probs = torch.softmax(torch.randn(6, k, 3, generator=g), dim=-1)
    rows = [
        DenseDraft(dense[0:1]), SparseDraft(sp_idx[1:2], sp_probs[1:2]), PointDraft(),
        DenseDraft(dense[3:4]), SparseDraft(sp_idx[4:5], sp_probs[4:5]), PointDraft(),
    ]
    tokens = torch.randint(0, V, (6, k), generator=g)
    tokens[1] = sp_idx[1, :, 0]
    tokens[4] = sp_idx[4, :, 1]
    num_draft = torch.tensor([3, 2, 3, 1, 3, 0])
    params = (
        torch.tensor([1.0, 0.7, 0.8, 0.0, 1.0, 1.3]),
        torch.tensor([0, 0, 3, 0, 2, 0]),
        torch.tensor([1.0, 0.9, 1.0, 1.0, 1.0, 0.8]),
    )
    return logits, tokens, num_draft, rows, params


@pytest.mark.parametrize("seed", range(8))
def test_mixed_batch_equals_rows_alone(seed):
    logits, tokens, num_draft, rows, (temp, top_k, top_p) = _mixed_rows(seed)
    gens = [sequence_generator(seed, 0, b) for b in range(6)]
    res = verify(logits, tokens, num_draft, MixedDraft(rows), temp, top_k, top_p, gens)
    for b in range(6):
        gen = sequence_generator(seed, 0, b)
        one = verify(
            logits[b : b + 1], tokens[b : b + 1], num_draft[b : b + 1], rows[b],
            temp[b : b + 1], top_k[b : b + 1], top_p[b : b + 1], [gen],
        )
        assert torch.equal(one.tokens[0], res.tokens[b])
        assert torch.equal(one.num_accepted[0], res.num_accepted[b])
        assert torch.equal(one.rejected[0], res.rejected[b])
        assert torch.equal(one.logprobs[0], res.logprobs[b])
        assert torch.equal(gen.get_state(), gens[b].get_state())
        # Draws: none for the greedy row, else one per judged draft token and one for the bonus.
        fresh = sequence_generator(seed, 0, b)
        judged = int(res.num_accepted[b]) + int(res.rejected[b])
        for _ in range(0 if temp[b] == 0 else judged + 1):
            draw_uniform(fresh)
        assert torch.equal(fresh.get_state(), gens[b].get_state())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_target_probs_and_logprobs_shortcuts_equal_the_general_path(temperature):
    """An all-greedy batch (no softmax computed) and one at T = 1 only (no division) give bitwise what the
    same rows give beside a row at another temperature, which takes the general path; ties in a greedy
    row go to the lowest index either way."""
    from rollout_ssd.sampling import full_logprobs

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(7)) * 3
    logits[1, 10] = logits[1, 30] = logits[1].max() + 1.0  # a tie for the largest logit
    alone = torch.full((4,), temperature)
    beside = torch.cat([alone, torch.tensor([0.7])])
    wide = torch.cat([logits, logits[:1]])
    k, p = torch.zeros(5, dtype=torch.int64), torch.ones(5)
    assert torch.equal(target_probs(logits, alone, k[:4], p[:4]), target_probs(wide, beside, k, p)[:4])
    assert torch.equal(full_logprobs(logits, alone), full_logprobs(wide, beside)[:4])
    if temperature == 0.0:
        assert int(target_probs(logits, alone, k[:4], p[:4])[1].argmax()) == 10


@pytest.mark.parametrize("greedy_rows", [(), (1,), (0, 1, 2, 3)])
def test_draw_tokens_gives_each_row_what_it_gets_alone(greedy_rows):
    """draw_tokens over a batch all sampled (no argmax computed), mixed, or all greedy: each row's token is
    the one it gets alone (argmax, or its own generator's inverse-CDF draw), each sampled row's generator
    advanced by one draw."""
    from rollout_ssd.sampling import draw_tokens

    probs = torch.softmax(torch.randn(4, 50, generator=torch.Generator().manual_seed(3)) * 2, dim=-1)
    greedy = torch.tensor([i in greedy_rows for i in range(4)])
    gens = [sequence_generator(5, 0, b) for b in range(4)]
    out = draw_tokens(probs, greedy, gens)
    for b in range(4):
        gen = sequence_generator(5, 0, b)
        alone = draw_tokens(probs[b:b + 1], greedy[b:b + 1], [gen])
        assert torch.equal(alone, out[b:b + 1]) and torch.equal(gen.get_state(), gens[b].get_state())
    assert out.dtype == torch.int64 and all(int(out[b]) == int(probs[b].argmax()) for b in greedy_rows)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bf16_logits_are_judged_as_their_float32_copy(temperature):
    """verify and draw_rows convert 16-bit logits once: bitwise what their float32 copy gives."""
    from types import SimpleNamespace

    from rollout_ssd.decode import draw_rows
    from rollout_ssd.params import SamplingParams

    logits = (torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(11)) * 3).to(torch.bfloat16)
    tokens = torch.randint(0, 50, (3, 3), generator=torch.Generator().manual_seed(12))
    num_draft = torch.tensor([3, 2, 0])
    q = DenseDraft(torch.softmax(torch.randn(3, 3, 50, generator=torch.Generator().manual_seed(13)), dim=-1))
    temp, k, p = torch.full((3,), temperature), torch.zeros(3, dtype=torch.int64), torch.ones(3)
    results = [verify(x, tokens, num_draft, q, temp, k, p, [sequence_generator(1, 0, b) for b in range(3)])
               for x in (logits, logits.float())]
    for field in ("tokens", "num_accepted", "rejected", "logprobs"):
        assert torch.equal(getattr(results[0], field), getattr(results[1], field)), field
    params = SamplingParams(temperature=temperature, seed=1)
    drawn = []
    for x in (logits[:, 0], logits[:, 0].float()):
        seqs = [SimpleNamespace(params=params, generator=sequence_generator(1, 0, b)) for b in range(3)]
        drawn.append(draw_rows(seqs, x))
    assert all(torch.equal(a, b) for a, b in zip(*drawn))


def test_logprobs_are_full_log_softmax_at_emitted_tokens():
    logits, tokens, num_draft, rows, (temp, top_k, top_p) = _mixed_rows(99)
    res = verify(logits, tokens, num_draft, MixedDraft(rows), temp, top_k, top_p,
                 [torch.Generator().manual_seed(b) for b in range(6)])
    for b in range(6):
        t = float(temp[b]) if temp[b] > 0 else 1.0
        ref = torch.log_softmax(logits[b] / t, dim=-1)  # [K+1, V], full vocabulary, no truncation
        n = int(res.num_emitted[b])
        emitted = res.tokens[b, :n]
        assert (emitted >= 0).all() and (res.tokens[b, n:] == -1).all()
        assert (res.logprobs[b, :n] - ref[torch.arange(n), emitted]).abs().max() <= 1e-6
        assert (res.logprobs[b, n:] == 0).all()
    assert res.logprobs.dtype == torch.float32 and res.tokens.dtype == torch.int64


def test_all_zero_residual_falls_back_to_target():
    """q >= p everywhere (an unnormalised q) makes the residual all zero; the bonus must come from p."""
    logits = torch.randn(200, 2, V, generator=torch.Generator().manual_seed(5))
    temp, top_k, top_p = _sampling(200, 1.0, top_k=3)
    p = target_probs(logits[:, 0], temp, top_k, top_p)  # [B, V]
    tokens = p.argmax(dim=1, keepdim=True)  # [B, 1]
    q = p.clone()
    q.scatter_(1, tokens, 2 * p.gather(1, tokens))  # q(s) = 2 p(s): rejected with prob 1/2
    res = verify(logits, tokens, torch.ones(200, dtype=torch.int64), DenseDraft(q[:, None]), temp, top_k,
                 top_p, [torch.Generator().manual_seed(b) for b in range(200)])
    rej = res.rejected
    assert 50 < int(rej.sum()) < 150
    bonus = res.tokens[rej, 0]
    assert (p[rej].gather(1, bonus[:, None]) > 0).all()


@pytest.mark.parametrize("case", ["k_too_big", "generators", "width", "token", "mixed_rows"])
def test_bad_input_raises(case):
    logits, tokens, num_draft = torch.randn(2, 3, V), torch.zeros(2, 2, dtype=torch.int64), torch.tensor([2, 1])
    dist, gens = PointDraft(), [torch.Generator(), torch.Generator()]
    if case == "k_too_big":
        num_draft = torch.tensor([3, 1])
    elif case == "generators":
        gens = gens[:1]
    elif case == "width":
        dist = DenseDraft(torch.full((2, 1, V), 1.0 / V))
    elif case == "token":
        tokens[0, 1] = V
    with pytest.raises(ValueError):
        if case == "mixed_rows":
            MixedDraft([DenseDraft(torch.full((2, 2, V), 1.0 / V))])
        _verify(logits, tokens, num_draft, dist, 1.0, gens=gens)


# ---- the law: SD generations against the exact target law -----------------------------------------


def _table_drafter(table: torch.Tensor, support: int = 0):
    """Neural-like draft: q = softmax(table[last]); with `support`, the draft samples from its top-`support`
    tokens renormalised and reports q exactly on that support (SparseDraft)."""

    def propose(last, k, gen):
        toks, qs, idxs = [], [], []
        for _ in range(k):
            q = torch.softmax(table[last], dim=-1)  # [N, V]
            u = torch.rand(last.shape[0], generator=gen, dtype=torch.float64)
            if support:
                q, idx = q.topk(support, dim=-1)
                q = q / q.sum(dim=-1, keepdim=True)
                last = idx.gather(1, sample_from_probs(q, u)[:, None]).squeeze(1)
                idxs.append(idx)
            else:
                last = sample_from_probs(q, u)
            toks.append(last)
            qs.append(q)
        tokens, q = torch.stack(toks, dim=1), torch.stack(qs, dim=1)
        return tokens, (SparseDraft(torch.stack(idxs, dim=1), q) if support else DenseDraft(q))

    return propose


def _point_drafter(random: bool):
    """Point-mass proposals: an n-gram-like deterministic guess, or a uniformly random token."""

    def propose(last, k, gen):
        toks = []
        for _ in range(k):
            last = torch.randint(0, V, last.shape, generator=gen) if random else NGRAM[last]
            toks.append(last)
        return torch.stack(toks, dim=1), PointDraft()

    return propose


DRAFTERS = {
    "dense_near": _table_drafter(DRAFT_NEAR),
    "dense_far": _table_drafter(DRAFT_FAR),
    "sparse_top3": _table_drafter(DRAFT_NEAR, support=3),
    "point_ngram": _point_drafter(random=False),
    "point_random": _point_drafter(random=True),
}


def _sd_generate(propose, k: int, temperature: float, top_k: int, top_p: float, n: int, seed: int):
    """n independent SD generations of L tokens from START, K ragged in [0, k] per row and round."""
    draft_gen = torch.Generator().manual_seed(seed)
    gens = [sequence_generator(seed, 0, i) for i in range(n)]
    out = [[] for _ in range(n)]
    active = list(range(n))
    while active:
        last = torch.tensor([out[i][-1] if out[i] else START for i in active])  # [R]
        tokens, dist = propose(last, k, draft_gen)  # [R, k]
        num_draft = torch.randint(0, k + 1, (len(active),), generator=draft_gen)
        tokens[torch.arange(k)[None, :] >= num_draft[:, None]] = -1  # padding
        context = torch.cat([last[:, None], tokens.clamp(min=0)], dim=1)  # the token before each position
        res = verify(TARGET[context], tokens, num_draft, dist, *_sampling(len(active), temperature, top_k, top_p),
                     [gens[i] for i in active])
        for i, emitted, m in zip(active, res.tokens.tolist(), res.num_emitted.tolist()):
            out[i].extend(emitted[:m])
        active = [i for i in active if len(out[i]) < L]
    return torch.tensor([seq[:L] for seq in out])  # [n, L]


LAW_CASES = [(name, 1.0, 0, 1.0) for name in DRAFTERS]
LAW_CASES += [(name, 0.7, 0, 0.9) for name in DRAFTERS]
LAW_CASES += [("dense_far", 1.0, 3, 1.0), ("point_ngram", 0.8, 2, 1.0)]


@pytest.mark.parametrize("drafter,temperature,top_k,top_p", LAW_CASES)
def test_sd_law_matches_target(drafter, temperature, top_k, top_p):
    """5000 SD generations (K ragged in [0, 3]) fit the exact target law: chi-square at alpha = 1e-4, so a
    correct verifier fails this test with probability 1e-4 per case (seeded: the outcome is fixed)."""
    samples = _sd_generate(DRAFTERS[drafter], 3, temperature, top_k, top_p, n=5000, seed=7)
    counts = torch.bincount((samples[:, 0] * V + samples[:, 1]) * V + samples[:, 2], minlength=V**L)
    law = exact_law(lambda contexts: TARGET[contexts[:, -1]], [START], L, V, temperature, top_k, top_p)
    assert_fits(counts, law, alpha=1e-4)  # fails by chance w.p. 1e-4 per case


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_sd_greedy_equals_greedy_ar(drafter):
    greedy_path = [START]
    for _ in range(L):
        greedy_path.append(int(TARGET[greedy_path[-1]].argmax()))
    samples = _sd_generate(DRAFTERS[drafter], 3, 0.0, 0, 1.0, n=64, seed=3)
    assert torch.equal(samples, torch.tensor(greedy_path[1:]).expand(64, L))
