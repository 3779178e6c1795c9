"""The whole engine on a second device type (issue 17, part A): AR, SD and SSD with the target (and,
where it says, the draft) on `fake_device`'s tagged `meta` tensors, which compute on the CPU but raise on
any op that mixes them with host tensors. Their rollouts must equal the CPU engine's, so every tensor
a forward, a verification, a sampling step or a tree step needs is made where the model is, and the
host reads (syncs) are counted.

Token ids are compared exactly. The device path and the CPU path differ only in the LM head's GEMM form
(the CPU-tuned forms in models/cpu_backend.py apply to CPU tensors), which moves float32 logits by
rounding (~1e-7): a seeded T=1 draw could then flip only when its uniform lands that close to a CDF
boundary, about 1e-6 per draw over the ~200 draws here; logprobs are compared within 1e-5.
"""

from __future__ import annotations

import pytest

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from tests.support.fake_device import fake_device
from tests.support.models import tiny_pair
from tests.support.ran import assert_ran

PROMPTS = [[1, 2, 3], [4, 5], [6]]
CASES = [("ar", {}, False), ("sd", {}, True), ("ssd", {"worker": False, "strategy_rule": False}, False),
         ("ssd", {"worker": False, "strategy_rule": False}, True)]
PLANS = {"sd": "spec", "ssd": "ssd"}  # what each engine proves it ran (tests.support.ran): SD verified proposals


def _run(directory, method, spec, params, on_device: bool, draft_too: bool):
    target, draft = tiny_pair(directory, vocab=48)
    config = (SpecConfig(method=method, k=3, **spec), EngineConfig(max_batch_size=8, max_model_len=64))
    if not on_device:
        engine = RolloutEngine(target, *config, draft=None if method == "ar" else draft)
        try:
            out = engine.sample(PROMPTS, params)
            if method != "ar":
                assert_ran(engine, PLANS[method])
            return out, None
        finally:
            engine.close()
    with fake_device() as device:
        target.model.to("meta")
        if draft_too:
            draft.model.to("meta")
        engine = RolloutEngine(target, *config, draft=None if method == "ar" else draft)
        assert engine.runner.cache.keys[0].device.type == "meta"
        try:
            out = engine.sample(PROMPTS, params)
            if method != "ar":
                assert_ran(engine, PLANS[method])
            return out, device
        finally:
            engine.close()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method, spec, draft_too", CASES, ids=["ar", "sd", "ssd-draft-on-cpu", "ssd-draft-on-device"])
def test_engine_on_a_second_device_equals_the_cpu_engine(method, spec, draft_too, temperature, tmp_path):
    params = SamplingParams(temperature=temperature, max_new_tokens=10, ignore_eos=True, n=2, seed=5)
    want, _ = _run(tmp_path / "cpu", method, spec, params, on_device=False, draft_too=draft_too)
    got, device = _run(tmp_path / "dev", method, spec, params, on_device=True, draft_too=draft_too)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert all(len(r.token_ids) == 10 for r in want)
    for g, w in zip(got, want):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)
    assert device.ops > 1000
    if method == "ar":  # one host read per round: the tokens (and logprobs) to commit
        assert device.syncs == params.max_new_tokens


def test_fake_device_raises_on_a_host_tensor_and_counts_reads():
    import torch

    with fake_device() as device:
        x = torch.ones(3).to("meta")
        with pytest.raises(RuntimeError, match="mixes device tensors with host tensors"):
            x + torch.ones(3)
        assert (x + torch.tensor(2.0)).tolist() == [3.0, 3.0, 3.0]  # a 0-dim CPU scalar is fine, as on CUDA
        assert device.syncs == 1
        assert torch.arange(2, device="meta").device.type == "meta"


def test_from_pretrained_places_the_draft_and_names_bad_devices(tmp_path):
    # ran-check: the draft's placement and refused devices only; the one engine built never samples
    tiny_pair(tmp_path, vocab=48)
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    engine = RolloutEngine.from_pretrained(target, draft=draft, spec=SpecConfig(method="ssd", k=3, worker=False),
                                           dtype="float32", max_batch_size=2, max_model_len=32)
    assert engine.spec.draft_device == "cpu"  # on a CPU machine the draft side stays on the CPU
    engine.close()
    with pytest.raises(ValueError, match="draft_device applies to SpecConfig.method='ssd'"):
        RolloutEngine.from_pretrained(target, draft=draft, spec=SpecConfig(method="sd"), draft_device="cpu")
    with pytest.raises(ValueError, match="draft_device 'cuda:0' is not available"):
        RolloutEngine.from_pretrained(target, draft=draft, spec=SpecConfig(method="ssd"), draft_device="cuda:0")
    with pytest.raises(ValueError, match="device 'tpu' is not a device name"):
        RolloutEngine.from_pretrained(target, device="tpu")
    with pytest.raises(ValueError, match="SpecConfig.draft_device must name a torch device"):
        SpecConfig(method="ssd", draft_device="gpu0")


def test_default_draft_device_is_the_next_gpu_or_the_targets():
    import torch

    from rollout_ssd.gpu.devices import default_draft_device

    assert default_draft_device(torch.device("cpu")) == torch.device("cpu")
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert default_draft_device(torch.device("cuda", 0)) == torch.device("cuda", 1 if count > 1 else 0)


def test_resolved_names_one_device_one_way():
    import torch

    from rollout_ssd.gpu.devices import resolved

    assert resolved("cpu") == torch.device("cpu")
    if torch.cuda.is_available():
        assert resolved("cuda") == resolved(f"cuda:{torch.cuda.current_device()}")
