"""top-k / top-p truncation from the M largest logits (sampling._drop) decides exactly what the stable
full-vocabulary sort (sampling._drop_full_sort) decides: same kept set on random rows, rows with tied
logits, flat rows that need the fallback, top-k above the candidate count, and mixed batches."""

import pytest
import torch

from rollout_ssd import sampling
from rollout_ssd.sampling import _drop, _drop_full_sort, target_probs

V = 8192


def _case(seed: int, n: int = 24, ties: bool = False, flat: bool = False):
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, 1, generator=gen) * 6 + (0.05 if flat else 0.5)
    logits = torch.randn(n, V, generator=gen) * scale
    if ties:
        logits = (logits * 2).round() / 2  # many exact ties, also at the truncation boundary
    k = torch.tensor([[0, 5, 40, 900, 3000, V][i % 6] for i in range(n)])
    k = torch.where(k > 0, k, torch.full_like(k, V))
    top_p = torch.tensor([[0.9, 0.77, 0.995, 1.0, 0.3, 0.61][(i // 6) % 6] for i in range(n)])
    return logits, k, top_p


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ties, flat", [(False, False), (True, False), (False, True), (True, True)])
def test_candidate_truncation_equals_full_sort(seed, ties, flat):
    logits, k, top_p = _case(seed, ties=ties, flat=flat)
    assert torch.equal(_drop(logits, k, top_p), _drop_full_sort(logits, k, top_p))


def test_fallback_rows_are_exercised(monkeypatch):
    """Flat rows with top_p near 1 cross p beyond the candidates: the fallback decides them, and a
    batch mixing settled and fallback rows still matches the sort row for row."""
    flat = torch.zeros(3, V)
    flat[1, :10] = 30.0  # peaked row (10 tokens of mass ~0.1 each): settled by the candidates
    k = torch.full((3,), V)
    top_p = torch.tensor([0.99, 0.85, 0.5])
    calls = []
    original = sampling._drop_full_sort
    monkeypatch.setattr(sampling, "_drop_full_sort", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    drop = sampling._drop(flat, k, top_p)
    assert calls == [2]  # rows 0 and 2 (all logits tied) fall back; row 1 does not
    assert torch.equal(drop, original(flat, k, top_p))
    assert int((~drop[1]).sum()) == 9


def test_target_probs_mixed_batch_matches_the_sort():
    logits, k, top_p = _case(7, n=12)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * 3)
    top_k = torch.where(k == V, torch.zeros_like(k), k)
    probs = target_probs(logits, temperature, top_k, top_p)
    greedy = temperature <= 0
    for i in range(12):
        if greedy[i]:
            assert probs[i].argmax() == logits[i].argmax() and probs[i].max() == 1.0
            continue
        scaled = logits[i:i + 1] / temperature[i]
        drop = _drop_full_sort(scaled, k[i:i + 1], top_p[i:i + 1])
        ref = torch.softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)[0]
        assert torch.equal(probs[i] > 0, ref > 0)
        torch.testing.assert_close(probs[i], ref, rtol=1e-5, atol=1e-7)
