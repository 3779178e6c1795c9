"""The draft package on a model's device (issue 17 part B): distillation's batches, the teacher pass,
drift's visited logits and the cost timer build their tensors where the model is, not on the host.

The models go to `fake_device`'s tagged `meta` tensors (tests/support/fake_device.py), which compute
on the CPU but raise on any op that mixes them with a host tensor, as a GPU would. Every number must
equal the CPU run's: the same kernels on the same data, so bit for bit except the LM head's GEMM form
(the CPU backend's choice applies to CPU tensors only), which moves float32 logits by rounding
(~1e-7 relative); KLs and losses are compared within 1e-5 of each other.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rollout_ssd.draft.acceptance import measure_cost
from rollout_ssd.draft.drift import kl_target_draft, token_mult_prob_error, visited_logits
from rollout_ssd.draft.loss import distill_loss, make_batch
from rollout_ssd.draft.teacher import load_samples, save_samples, teacher_topk
from tests.support.fake_device import fake_device
from tests.support.models import tiny_pair

SEQUENCES = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14, 15]]
PROMPT_LENS = [2, 1, 3]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = tiny_pair(tmp_path_factory.mktemp("pair"), vocab=48)
    return target.model, draft.model


def _on_host(pair):
    target, draft = pair
    teacher = teacher_topk(target, SEQUENCES, PROMPT_LENS, top_k=8)
    batch = make_batch(teacher)
    with torch.no_grad():
        loss = float(distill_loss(draft, batch, torch.arange(48)))
    pairs = [(s[:n], s[n:]) for s, n in zip(SEQUENCES, PROMPT_LENS)]
    return teacher, loss, visited_logits(target, pairs), kl_target_draft(target, draft, pairs)


def test_distillation_and_drift_run_on_the_models_device(pair, tmp_path):
    want_teacher, want_loss, want_logits, want_kl = _on_host(pair)
    with fake_device() as device:
        target, draft = (copy.deepcopy(m).to("meta") for m in pair)
        teacher = teacher_topk(target, SEQUENCES, PROMPT_LENS, top_k=8)
        assert all(s.topk_ids.device.type == "meta" for s in teacher)
        batch = make_batch(teacher, draft.embed.device)
        assert {t.device.type for t in vars(batch).values()} == {"meta"}
        with torch.no_grad():
            loss = float(distill_loss(draft, make_batch(teacher), torch.arange(48, device="meta")))  # moved there
            assert float(distill_loss(draft, batch, torch.arange(48, device="meta"))) == loss
        pairs = [(s[:n], s[n:]) for s, n in zip(SEQUENCES, PROMPT_LENS)]
        logits = visited_logits(target, pairs)
        assert logits.device.type == "meta"
        logits = logits.cpu()
        kl = kl_target_draft(target, draft, pairs)
        mismatch = token_mult_prob_error(torch.zeros(2, 3).to("meta"), [[0.0] * 3] * 2)  # a device tensor and lists
        save_samples(tmp_path / "teacher.pt", teacher, next_prompt=3)  # a GPU's samples load on any machine
    assert device.ops > 500
    for got, want in zip(load_samples(tmp_path / "teacher.pt")[0], want_teacher):
        assert got.token_ids == want.token_ids and torch.equal(got.topk_ids, want.topk_ids)
        torch.testing.assert_close(got.topk_logp, want.topk_logp, rtol=0, atol=1e-3)  # float16 rounding
    assert loss == pytest.approx(want_loss, rel=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert kl == pytest.approx(want_kl, rel=1e-5, abs=1e-7)
    assert mismatch == 1.0


def test_measure_cost_times_device_work_on_the_models_device(pair, monkeypatch):
    """Each step is timed by a DeviceTimer for the runner's device (CUDA events on a GPU)."""
    import rollout_ssd.draft.acceptance as acceptance

    made = []

    class FixedTimer:  # seconds by device: what measure_cost reports must come from the timer
        def __init__(self, device):
            made.append(torch.device(device))
            self.seconds = 0.0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.seconds = 0.25

    monkeypatch.setattr(acceptance, "DeviceTimer", FixedTimer)
    with fake_device():
        target, draft = (copy.deepcopy(m).to("meta") for m in pair)
        cost = measure_cost(target, draft, batch_sizes=(2,), context=8, steps=3)
    assert [d.type for d in made] == ["meta", "meta"]
    assert cost[2] == {"target_s": 0.25, "draft_s": 0.25, "ratio": 1.0}
