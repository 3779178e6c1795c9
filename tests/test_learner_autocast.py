"""The learner's bf16 autocast (issue 49, rl/precision.py): the loss and the gradients stay within a
tolerance of float32's that follows from bf16's rounding, the master weights, their gradients and the
optimizer state stay float32, and "auto" picks bf16 only where the hardware has bf16 units. And the
learner's `learner/kl_initial` (KL to the initial policy): 0 before any update, the k3 estimate on the
configured rows after one.

CPU autocast to bf16 runs on any x86 CPU (slowly without bf16 units), so these tests run everywhere.
"""

from __future__ import annotations

import pytest
import torch

from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.rl import precision
from rollout_ssd.rl.learner import Learner, LearnerConfig, RolloutBatch
from tests.support.models import build_tiny

# bf16 keeps 8 significant bits: rounding a value to bf16 perturbs it by at most u = 2^-8 relatively.
# Autocast rounds both operands of every matmul (float32 accumulation), so each matmul on the path from
# the embeddings to the logits adds at most 2u to the relative perturbation of what flows through it
# (first order; norms, rope, softmax and residual adds are float32 and, to first order, carry a relative
# perturbation through unchanged in size). The tiny model's deepest path has D = 2 layers x 6 matmuls
# (qkv, q.k, p.v, o, gate/up, down) + the LM head = 13, so the loss, the logprobs' scale and each
# gradient agree with float32's within EPS = 2 D u relatively, and the gradients' cosine similarity is at
# least 1 - EPS^2 / 2 (a perturbation e with |e| <= EPS |g| turns g by at most asin(EPS)).
U = 2.0 ** -8
DEPTH = 2 * 6 + 1
EPS = 2 * DEPTH * U
MIN_COSINE = 1 - EPS ** 2 / 2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("autocast") / "tiny"
    build_tiny(path, family="llama-gqa-untied", seed=3, vocab_size=96, num_hidden_layers=2)
    return path


def learner(checkpoint, autocast: str) -> Learner:
    model = load_pretrained(str(checkpoint), dtype="float32", with_tokenizer=False).model
    return Learner(model, LearnerConfig(autocast=autocast))


def batch() -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (int(n),), generator=gen).tolist() for n in (5, 9, 7, 12)]
    completions = [torch.randint(0, 96, (int(n),), generator=gen).tolist() for n in (16, 11, 20, 14)]
    return RolloutBatch(prompts, completions, [[0.0] * len(c) for c in completions], [1.0, 0.0, 0.5, 0.25], 2)


def loss_and_grads(lrn: Learner, b: RolloutBatch, advantages: torch.Tensor):
    """The mean token NLL and the GRPO surrogate's value at ratio 1, and each one's gradient (flat)."""
    out = []
    for weights in (None, advantages):
        lrn.trainer.zero_grad()
        logp, _ = lrn._forward(lrn.model, b.prompts, b.completions, b.temperature)
        mask = torch.zeros_like(logp)
        for i, c in enumerate(b.completions):
            mask[i, :len(c)] = 1.0
        w = mask if weights is None else mask * weights[:, None]
        loss = -(logp * w).sum() / mask.sum()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in lrn.model.parameters() if p.grad is not None])
        out.append((float(loss.detach()), grads.clone(), logp.detach()))
    lrn.trainer.zero_grad()
    return out


def test_bf16_loss_and_gradients_within_the_rounding_bound(checkpoint):
    b = batch()
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    exact = loss_and_grads(learner(checkpoint, "off"), b, advantages)
    bf16_learner = learner(checkpoint, "bf16")
    assert bf16_learner.autocast_dtype == torch.bfloat16
    rounded = loss_and_grads(bf16_learner, b, advantages)
    for (loss, grad, logp), (loss16, grad16, logp16) in zip(exact, rounded):
        assert not torch.equal(logp, logp16), "the bf16 forward computed float32's bits: autocast did not run"
        assert logp16.dtype == torch.float32
        assert abs(loss16 - loss) <= EPS * abs(loss), (loss, loss16)
        norm, norm16 = float(grad.norm()), float(grad16.norm())
        assert abs(norm16 - norm) <= EPS * norm, (norm, norm16)
        cosine = float(torch.dot(grad, grad16) / (norm * norm16))
        assert cosine >= MIN_COSINE, cosine


def test_master_weights_gradients_and_optimizer_state_stay_float32(checkpoint):
    lrn = learner(checkpoint, "bf16")
    metrics = lrn.step(batch())
    assert metrics["learner/autocast"] == "bf16"
    assert all(p.dtype == torch.float32 for p in lrn.model.parameters())
    state = [t for s in lrn.trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    assert state and all(t.dtype == torch.float32 for t in state)
    assert metrics["learner/grad_norm"] > 0


def test_off_is_float32_bit_for_bit(checkpoint):
    b = batch()
    a = learner(checkpoint, "off").logprobs(b)
    c = Learner(load_pretrained(str(checkpoint), dtype="float32", with_tokenizer=False).model,
                LearnerConfig(autocast="off")).logprobs(b)
    assert torch.equal(a, c)


def test_auto_picks_bf16_only_with_bf16_units(monkeypatch):
    monkeypatch.setattr(precision, "_bf16_units", lambda: True)
    assert precision.resolve_autocast("auto", torch.device("cpu")) == torch.bfloat16
    monkeypatch.setattr(precision, "_bf16_units", lambda: False)
    assert precision.resolve_autocast("auto", torch.device("cpu")) is None
    assert precision.resolve_autocast("bf16", torch.device("cpu")) == torch.bfloat16
    assert precision.resolve_autocast("off", torch.device("cpu")) is None
    assert precision.label(torch.bfloat16) == "bf16" and precision.label(None) == "off"
    with pytest.raises(ValueError, match="autocast"):
        LearnerConfig(autocast="fp16")
    with pytest.raises(ValueError, match="kl_initial_rollouts"):
        LearnerConfig(kl_initial_rollouts=-1)


def test_kl_to_the_initial_policy(checkpoint):
    from rollout_ssd.rl import losses
    from rollout_ssd.rl.optim import OptimConfig

    model = load_pretrained(str(checkpoint), dtype="float32", with_tokenizer=False).model
    lrn = Learner(model, LearnerConfig(autocast="off", kl_initial_rollouts=2, optim=OptimConfig(lr=0.05)))
    b = batch()
    assert lrn.step(b)["learner/kl_initial"] == 0.0  # the policy is still the initial one, bit for bit
    rows = [0, 2]  # two of the four rows, evenly spaced
    before = lrn.logprobs(b)  # the policy the second step's estimate is taken under
    initial = lrn._score(b, lrn.reference, only=rows)[0]
    mask = torch.zeros_like(before)
    for i, c in enumerate(b.completions):
        mask[i, :len(c)] = 1.0
    expected = float(losses.masked_mean(losses.kl_penalty(before[rows], initial[rows], kind="k3"), mask[rows]))
    second = lrn.step(b)
    assert second["learner/kl_initial"] == expected > 0
    assert second["time/kl_initial_s"] > 0
    off = Learner(load_pretrained(str(checkpoint), dtype="float32", with_tokenizer=False).model,
                  LearnerConfig(autocast="off", kl_initial_rollouts=0))
    assert off.reference is None and "learner/kl_initial" not in off.step(b)
