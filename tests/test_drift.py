"""Drift telemetry: kl_target_draft against an independent computation (transformers' logits,
F.kl_div), token_mult_prob_error against hand computations, and DriftLog's per-version rows."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.draft.build import make_draft
from rollout_ssd.draft.drift import DriftLog, kl_target_draft, token_mult_prob_error
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.weight_sync import TransferStats
from tests.support.models import tiny_pair

PAIRS = [([1, 2, 3], [4, 5, 6, 7]), ([9], [10, 11]), ([12, 13], []), ([20, 21, 22, 23], [24])]


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("drift")
    tiny_pair(directory, vocab=48)
    return directory


def _hf_visited_logits(path, pairs) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt, completion in pairs:
            if completion:
                logits = model(torch.tensor([prompt + completion])).logits[0].float()
                rows.append(logits[len(prompt) - 1:len(prompt) + len(completion) - 1])
    return torch.cat(rows)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kl_target_draft_matches_an_independent_computation(pair_dir, temperature):
    target = load_pretrained(str(pair_dir / "target"), dtype="float32").model
    draft = load_pretrained(str(pair_dir / "draft"), dtype="float32").model
    p = _hf_visited_logits(pair_dir / "target", PAIRS).double() / temperature
    q = _hf_visited_logits(pair_dir / "draft", PAIRS).double() / temperature
    assert p.shape[0] == 7  # visited positions: 4 + 2 + 0 + 1
    ref = F.kl_div(torch.log_softmax(q, -1), torch.log_softmax(p, -1), log_target=True, reduction="none").sum(-1).mean()
    ours = kl_target_draft(target, draft, PAIRS, temperature=temperature)
    assert ours > 0.01 and math.isclose(ours, float(ref), rel_tol=1e-4)
    assert kl_target_draft(target, target, PAIRS, temperature=temperature) == 0.0
    with pytest.raises(ValueError, match="temperature"):
        kl_target_draft(target, draft, PAIRS, temperature=0.0)


def test_kl_with_a_restricted_head_draft_renormalises_p_on_the_head(pair_dir):
    target = load_pretrained(str(pair_dir / "target"), dtype="float32").model
    head = torch.arange(0, 48, 2)
    draft = make_draft(target, head, num_layers=1)
    p = _hf_visited_logits(pair_dir / "target", PAIRS).double()[:, head]
    with torch.no_grad():
        rows = []
        for prompt, completion in PAIRS:
            if completion:
                hidden = draft.forward_train(torch.tensor([prompt + completion[:-1]]))[0, len(prompt) - 1:]
                rows.append(F.linear(hidden, draft.lm_head).double())
    q = torch.cat(rows)
    ref = (torch.softmax(p, -1) * (torch.log_softmax(p, -1) - torch.log_softmax(q, -1))).sum(-1).mean()
    ours = kl_target_draft(target, draft, PAIRS)
    assert math.isfinite(ours) and math.isclose(ours, float(ref), rel_tol=1e-4)


def test_token_mult_prob_error_by_hand():
    lp = [[-1.0, -2.0], [-0.5]]
    assert token_mult_prob_error(lp, lp) == 1.0
    assert token_mult_prob_error(torch.tensor([[-1.0, -3.0]]), torch.tensor([[-1.0, -3.0]])) == 1.0
    other = [[-1.5, -2.0], [-0.25]]
    assert token_mult_prob_error(lp, other) == pytest.approx((math.exp(0.5) + 1.0 + math.exp(0.25)) / 3, rel=1e-12)
    # tensors with a mask: only the unmasked tokens count (NeMo-RL masks padding and prompt tokens)
    a = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -7.0, -7.0]])
    b = torch.tensor([[-1.5, -2.0, -1.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert token_mult_prob_error(a, b, mask) == pytest.approx((math.exp(0.5) + 1.0 + math.exp(0.25)) / 3, rel=1e-12)
    with pytest.raises(ValueError, match="sequence 1"):
        token_mult_prob_error(lp, [[-1.0, -2.0], [-0.5, -0.5]])
    with pytest.raises(ValueError, match="shape"):
        token_mult_prob_error(torch.zeros(2, 3), torch.zeros(3, 2))


def test_mult_prob_error_of_engine_rollouts_against_the_learner(pair_dir):
    """The learner recomputing the rollouts' logprobs on the same weights gets ~1 (float32 kernels of
    different shapes agree to ~1e-6); after a learner step the rollouts no longer match (> 1.001)."""
    loaded = load_pretrained(str(pair_dir / "target"), dtype="float32")
    engine = RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=4, max_model_len=64))
    rollouts = engine.sample([[1, 2, 3], [4, 5]], SamplingParams(temperature=1.0, n=2, max_new_tokens=12, seed=5,
                                                                 ignore_eos=True))

    def learner_logprobs(model):
        out = []
        with torch.no_grad():
            for r in rollouts:
                ids = r.prompt_token_ids + r.token_ids
                hidden = model.forward_train(torch.tensor([ids[:-1]]))[0, len(r.prompt_token_ids) - 1:]
                logp = torch.log_softmax(model.logits(hidden), -1)
                out.append(logp.gather(1, torch.tensor(r.token_ids)[:, None]).squeeze(1).tolist())
        return out

    learner = load_pretrained(str(pair_dir / "target"), dtype="float32").model
    same = token_mult_prob_error(learner_logprobs(learner), [r.logprobs for r in rollouts])
    assert 1.0 <= same < 1.0 + 1e-4
    with torch.no_grad():
        for t in learner.hf_parameters().values():
            t.add_(0.05 * t.std() * torch.randn(t.shape, generator=torch.Generator().manual_seed(1)))
    assert token_mult_prob_error(learner_logprobs(learner), [r.logprobs for r in rollouts]) > 1.001


def test_drift_log_rows(tmp_path):
    log = DriftLog()
    stats = TransferStats(version=3, base_version=2, kind="delta", num_tensors=4, num_full=0, num_delta=4,
                          num_elements=100, changed_elements=7, bytes_sent=1234, full_bytes=200,
                          encode_seconds=0.25, send_seconds=0.5)
    metrics = {"spec/accept_rate": 0.75, "ssd/hit_rate": 0.5, "spec/accept_length": 2.5, "sync/draft_version": 2,
               "rollout/tokens": 99}
    row = log.record(3, metrics=metrics, target_sync=stats, token_mult_prob_error=1.01)
    assert row == {"sync/version": 3, "sync/draft_version": 2, "spec/accept_rate": 0.75, "ssd/hit_rate": 0.5,
                   "spec/accept_length": 2.5, "mismatch/token_mult_prob_error": 1.01, "sync/bytes": 1234,
                   "sync/seconds": 0.75}
    row = log.record(3, kl_target_draft=0.125, draft_sync=stats, mode="follow")  # the same version: merged
    assert row["drift/kl_target_draft"] == 0.125 and row["sync/draft_bytes"] == 1234 and row["mode"] == "follow"
    assert row["spec/accept_rate"] == 0.75
    log.record(4, kl_target_draft=0.5)
    assert [r["sync/version"] for r in log.rows()] == [3, 4]
    log.write_jsonl(tmp_path / "drift.jsonl")
    lines = (tmp_path / "drift.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == log.rows()
