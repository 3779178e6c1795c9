"""Weight updates reaching the engine: in process and through a weight_sync receiver.

Exactness: after updates the engine's parameters are bitwise the learner's and its greedy rollouts
and logprobs equal transformers' on the learner's weights; an update that arrives while `sample`
runs is applied between rounds, and each rollout reports the versions its tokens were verified under.
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaForCausalLM

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.weight_sync import InProcessTransport, SenderConfig, WeightReceiver, WeightSender
from tests.support.models import tiny_model
from tests.support.ran import assert_ran

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14]]


@pytest.fixture()
def setup(tmp_path):
    return tiny_model(tmp_path / "m", init="transformers", logit_scale=8.0, vocab_size=40, intermediate_size=64)


def _perturb(hf, scale, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def _hf_greedy(hf, prompt, n):
    """Greedy continuation by full forwards (no generate(): it would treat a pad-id token as padding)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _named(hf):
    return [(k, v.detach().clone()) for k, v in hf.state_dict().items() if k != "lm_head.weight"
            or not hf.config.tie_word_embeddings]


def test_update_weights_in_process(setup):
    hf, loaded = setup
    engine = RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=2, max_model_len=64))
    _perturb(hf, 0.05, seed=1)
    engine.update_weights(_named(hf), version=3)
    params = SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True)
    rollouts = engine.sample(PROMPTS, params)
    for prompt, r in zip(PROMPTS, rollouts):
        assert r.token_ids == _hf_greedy(hf, prompt, 12)
        assert r.weight_version == 3
    assert engine.metrics()["sync/version"] == 3


def test_an_older_version_queued_behind_a_newer_one_is_refused(setup):
    """Updates queued while rounds run are checked against the newest accepted version, not the applied
    one: v5 then v3 in one round would otherwise leave the engine serving v3."""
    hf, loaded = setup
    engine = RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=2, max_model_len=64))
    try:
        request = engine.submit(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True))
        engine.pause()  # the driver holds the request between rounds: updates queue
        deadline = time.monotonic() + 10
        while not engine.scheduler.counts().get("running") and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.update_weights(_named(hf), version=5)
        with pytest.raises(ValueError, match="newest version"):
            engine.update_weights(_named(hf), version=3)
        engine.resume()
        assert request.result()[0].weight_version == 5
        assert engine.weight_version == 5
    finally:
        engine.close()


def test_an_update_submitted_as_the_driver_stops_is_applied(setup, monkeypatch):
    """The driver's last apply and its stop are one step under the scheduler's lock: an update handed in
    from another thread at that moment waits for the driver to stop and is then applied by its sender,
    not left queued until the next `sample` call. The update is handed in deterministically right after
    the driver's final apply (the thread is given 0.3 s: it either blocks on the lock or, without the
    fix, queues the update behind a driver that is about to stop)."""
    import threading

    hf, loaded = setup
    engine = RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=2, max_model_len=64))
    apply, threads = engine.scheduler.apply_updates, []

    def apply_then_hand_in(running):
        changed = apply(running)
        if not running and engine.scheduler.driving and len(threads) < 5:  # an idle driver's apply
            t = threading.Thread(target=engine.update_weights, args=(_named(hf), 10 + len(threads)))
            threads.append(t)
            t.start()
            t.join(0.3)
        return changed

    monkeypatch.setattr(engine.scheduler, "apply_updates", apply_then_hand_in)
    engine.sample(PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    for t in threads:
        t.join(10)
    assert threads  # the driver's idle apply was reached
    assert engine.weight_version == 10 + len(threads) - 1  # the last one handed in is served
    engine.close()


@pytest.mark.parametrize("bad,match", [
    ("unknown", "unknown tensor"), ("shape", "shape"), ("nan", "NaN"), ("version", "version"),
])
def test_bad_updates_rejected_and_old_version_serves(setup, bad, match):
    hf, loaded = setup
    engine = RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=2, max_model_len=64))
    engine.update_weights(_named(hf), version=1)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    before = [r.token_ids for r in engine.sample(PROMPTS, params)]
    state = dict(_named(hf))
    name = "model.layers.0.mlp.up_proj.weight"
    version = 2
    state[name] = state[name] + 1.0  # would change the outputs if it were applied
    if bad == "unknown":
        state["model.layers.9.mlp.up_proj.weight"] = state[name]
    elif bad == "shape":
        state[name] = state[name][:, :-1]
    elif bad == "nan":
        state[name] = state[name].clone()
        state[name][0, 0] = float("nan")
    else:
        version = 1
    with pytest.raises(ValueError, match=match):
        engine.update_weights(list(state.items()), version=version)
    after = engine.sample(PROMPTS, params)
    assert [r.token_ids for r in after] == before
    assert all(r.weight_version == 1 for r in after)


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_update_during_sample_applies_between_rounds(setup, method):
    """An update issued mid-sample (here: from inside round 3) takes effect at the next round; tokens
    before it follow the old weights, tokens after it the new ones, exactly (greedy)."""
    hf, loaded = setup
    engine = RolloutEngine(loaded, SpecConfig(method=method, k=3), EngineConfig(max_batch_size=4, max_model_len=64),
                           draft=loaded if method == "sd" else None)
    old = {k: v.clone() for k, v in hf.state_dict().items()}
    _perturb(hf, 0.05, seed=7)
    new_state = _named(hf)
    rounds = {"n": 0, "lens": None}
    real_step = engine.strategy.step

    def step(running):
        emitted = real_step(running)
        rounds["n"] += 1
        if rounds["n"] == 3:
            rounds["lens"] = [len(s.token_ids) for s in running]
            engine.update_weights(new_state, version=5)
            assert engine.weight_version == 0  # queued, not applied inside the round
        return emitted

    engine.strategy.step = step
    rollouts = engine.sample(PROMPTS, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    if method == "sd":  # the target drafts for itself: SD verified proposals and accepted some
        assert_ran(engine, "spec", accepted=True)
    hf_old = LlamaForCausalLM(hf.config)
    hf_old.load_state_dict(old)
    for prompt, r, split in zip(PROMPTS, rollouts, rounds["lens"]):
        assert r.token_ids[:split] == _hf_greedy(hf_old, prompt, split)
        assert r.token_ids[split:] == _hf_greedy(hf, prompt + r.token_ids[:split], 16 - split)
        assert r.weight_version == 5 and r.extra["weight_versions"] == [0, 5]


def test_receiver_twenty_updates_full_and_delta_bitwise(setup):
    """20 learner updates through WeightSender -> InProcessTransport -> the engine's receiver, mixing
    full and delta transfers: the engine's parameters are bitwise the learner's after each one, and
    its logprobs equal transformers' on the learner's weights."""
    hf, loaded = setup
    engine = RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=2, max_model_len=64))
    transport = InProcessTransport(num_receivers=1)
    receiver = WeightReceiver(transport.receiver(0), version=0)
    engine.attach_receiver(receiver)
    sender = WeightSender(transport, SenderConfig(dtype=torch.float32, bucket_bytes=1 << 14))
    kinds = set()
    for version in range(1, 21):
        # small steps touch few elements (delta); every 5th is a large step that flips to full
        if version % 5 == 0:
            _perturb(hf, 0.02, seed=version)
        else:
            with torch.no_grad():
                w = hf.model.layers[version % 2].mlp.up_proj.weight
                w[version % w.shape[0], :4] += 0.01
        stats = sender.sync(_named(hf), version, timeout=30.0)
        kinds.add(stats.kind)
        deadline = time.time() + 30
        while engine.weight_version != version and time.time() < deadline:
            time.sleep(0.01)
        assert engine.weight_version == version
        ours = engine.target.model.hf_parameters()
        for name, tensor in _named(hf):
            assert torch.equal(ours[name].view(torch.int32), tensor.view(torch.int32)), name
    assert {"full", "delta"} <= kinds
    r = engine.sample([PROMPTS[0]], SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=3))[0]
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPTS[0] + r.token_ids])).logits[0, len(PROMPTS[0]) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(r.token_ids)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-5, rtol=0)
    assert r.weight_version == 20
    engine.close()


def test_an_update_is_not_checked_while_a_cuda_graph_is_captured(setup):
    """Checking an update runs kernels on its tensors (finiteness); on a GPU, kernels from another thread
    invalidate a CUDA graph being captured. So `update_weights` waits while `CUDA_CAPTURE_LOCK` (held by
    every capture) is held, and goes on once it is released."""
    import threading

    from rollout_ssd.gpu.devices import CUDA_CAPTURE_LOCK

    hf, loaded = setup
    engine = RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=2, max_model_len=64))
    _perturb(hf, 0.05, seed=1)
    done = threading.Event()
    worker = threading.Thread(target=lambda: (engine.update_weights(_named(hf), version=3), done.set()))
    try:
        with CUDA_CAPTURE_LOCK:  # as a capture on the engine's thread holds it
            worker.start()
            assert not done.wait(0.5)  # the update waits for the capture
        assert done.wait(10)  # and is taken once it is over
        assert engine.metrics()["sync/version"] == 3
    finally:
        worker.join(timeout=10)
        engine.close()
