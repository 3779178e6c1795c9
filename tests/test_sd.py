"""Speculative decoding in the engine: greedy SD == greedy AR token for token, SD logprobs == AR
logprobs, and the law of short continuations equals the exact target law for every draft kind."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from tests.support.laws import exact_law, hf_next_logits
from tests.support.models import tiny_model
from tests.support.ran import assert_ran
from tests.support.stats import assert_fits

PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [3, 3, 3, 3]]


TINY = dict(init="transformers", max_position_embeddings=256)  # transformers' own init, seeded
ONE_LAYER_16 = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd")
    # the head x 8: sharper logits than the default init, so greedy paths are not near-ties
    hf_target, target = tiny_model(tmp / "target", seed=0, logit_scale=8.0, vocab_size=48, intermediate_size=64,
                                   **TINY)
    _, draft = tiny_model(tmp / "draft", seed=1, logit_scale=8.0, vocab_size=48, **ONE_LAYER_16, **TINY)
    return target, draft, hf_target


def _engine(target, draft, method, speculator="draft", k=3, batch=3, stop_prob=0.0):
    return RolloutEngine(target, SpecConfig(method=method, k=k, speculator=speculator, stop_prob=stop_prob),
                         EngineConfig(max_batch_size=batch, max_model_len=128), draft=draft)


@pytest.mark.parametrize("speculator", ["draft", "draft-stop", "self", "suffix", "random"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_sd_equals_ar(pair, speculator, batch):
    target, draft, _ = pair
    params = SamplingParams(temperature=0, max_new_tokens=24, n=2, ignore_eos=True)
    ar = _engine(target, None, "ar", batch=batch).sample(PROMPTS, params)
    sd_draft = target if speculator == "self" else draft
    spec = "draft" if speculator in ("self", "draft-stop") else speculator
    eng = _engine(target, sd_draft, "sd", speculator=spec, k=3, batch=batch,
                  stop_prob=0.6 if speculator == "draft-stop" else 0.0)
    sd = eng.sample(PROMPTS, params)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    for a, b in zip(ar, sd, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
    # chains were proposed and verified, and (but for random tokens) some of their tokens accepted
    m = assert_ran(eng, "spec", accepted=True if speculator != "random" else None)
    if speculator == "self":
        assert m["spec/accept_rate"] == 1.0  # a draft equal to the target is always accepted when greedy


def test_stop_token_inside_accepted_run(pair):
    """A stop token that lands inside an accepted run ends the rollout there, exactly as AR."""
    target, _, _ = pair
    base = SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)
    free = _engine(target, None, "ar").sample([PROMPTS[0]], base)[0].token_ids
    stop = free[5]
    params = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=(stop,))
    ar = _engine(target, None, "ar").sample([PROMPTS[0]], params)[0]
    eng = _engine(target, target, "sd", k=4)
    sd = eng.sample([PROMPTS[0]], params)[0]
    assert_ran(eng, "spec", accepted=True)  # the self-draft's runs are accepted: the stop lands inside one
    assert sd.token_ids == ar.token_ids and sd.token_ids[-1] == stop and sd.finish_reason == "stop"
    assert len(sd.logprobs) == len(sd.token_ids)


def _restricted_head(draft, token_ids):
    """The same draft with its LM head cut to `token_ids` (a sparse q, as the default draft has)."""
    from rollout_ssd.models.decoder import Decoder
    from rollout_ssd.models.loader import LoadedModel

    src = draft.model
    cfg = dataclasses.replace(src.cfg, head_vocab_size=len(token_ids), tie_word_embeddings=False)
    model = Decoder(cfg, src.inv_freq, src.rope_scaling, dtype=src.dtype)
    params, src_params = model.hf_parameters(), src.hf_parameters()
    with torch.no_grad():
        for name, tensor in params.items():
            if name == "lm_head.weight":
                tensor.copy_(src.lm_head[token_ids])
            elif name == "lm_head.token_ids":
                tensor.copy_(torch.tensor(token_ids))
            else:
                tensor.copy_(src_params[name])
    return LoadedModel(model=model, hf_config=draft.hf_config, tokenizer=None, source="restricted")


@pytest.mark.parametrize("speculator,temperature,top_p,top_k", [
    ("draft", 1.0, 1.0, 0), ("draft", 0.7, 0.9, 0), ("suffix", 1.0, 1.0, 0), ("random", 0.7, 0.9, 0),
    ("draft", 1.0, 1.0, 2), ("sparse", 1.0, 1.0, 0), ("sparse", 0.7, 0.9, 0), ("sparse-unsorted", 1.0, 1.0, 0),
    ("draft-stop", 1.0, 1.0, 0), ("draft-stop", 0.7, 0.9, 0), ("sparse-stop", 1.0, 1.0, 0),
])
def test_sd_law_matches_target(tmp_path, speculator, temperature, top_p, top_k):
    """Empirical law of 4-token continuations under SD vs the exact enumerated target law (the first
    token comes from the prefill, the next three from one SD round with K=2 drafted tokens).
    "-stop" cases end a chain after a token the draft drew with probability < 0.6 (SpecConfig.stop_prob),
    which here cuts many chains to one token (checked: fewer draft tokens per round than without).
    Chi-square with cells pooled as tests/support/stats.py says; alpha = 1e-4, so this test fails by
    chance with probability 1e-4 (seeds are fixed, so a given run is deterministic)."""
    stop_prob = 0.6 if speculator.endswith("-stop") else 0.0
    speculator = speculator.removesuffix("-stop")
    # the head x 2 (x 8 in `pair`): a spread-out law (V=4) so every cell is exercised
    hf_target, target = tiny_model(tmp_path / "t", seed=3, logit_scale=2.0, vocab_size=4, **ONE_LAYER_16, **TINY)
    # an unrelated model: far from the target
    _, draft = tiny_model(tmp_path / "d", seed=4, logit_scale=8.0, vocab_size=4, **ONE_LAYER_16, **TINY)
    if speculator == "sparse":  # q on 2 of the 4 tokens only: the other two are never proposed
        draft, speculator = _restricted_head(draft, [0, 2]), "draft"
    elif speculator == "sparse-unsorted":  # the draft samples over head rows: row -> token must hold
        draft, speculator = _restricted_head(draft, [3, 1, 2]), "draft"
    prompt = [1, 2, 3]
    n = 4000
    eng = RolloutEngine(target, SpecConfig(method="sd", k=2, speculator=speculator, stop_prob=stop_prob),
                        EngineConfig(max_batch_size=256, max_model_len=16), draft=draft)
    params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=4,
                            ignore_eos=True, seed=11)
    rollouts = eng.sample([prompt], params)
    law = exact_law(hf_next_logits(hf_target), prompt, 4, 4, temperature, top_k, top_p)  # [V, V, V, V]
    counts = torch.zeros_like(law)
    for r in rollouts:
        key = tuple(r.token_ids)
        assert len(key) == 4 and law[key] > 0, f"continuation {key} has probability 0 under the target"
        counts[key] += 1
    assert_fits(counts, law, alpha=1e-4)  # fails by chance w.p. 1e-4
    proposed = assert_ran(eng, "spec")["spec/proposed_per_round"]
    if stop_prob:  # the early stop really cut chains: fewer draft tokens per round than without it
        full = RolloutEngine(target, SpecConfig(method="sd", k=2, speculator=speculator, stop_prob=0.0),
                             EngineConfig(max_batch_size=256, max_model_len=16), draft=draft)
        full.sample([prompt], dataclasses.replace(params, n=500))
        assert proposed < 0.9 * full.metrics()["spec/proposed_per_round"]


def test_stop_prob_shortens_chains(pair):
    """stop_prob ends a chain after an unsure draw: at 0.99 nearly every chain of this random draft stops
    after its first token, at 0 every chain has K tokens, sampled and greedy; bad values are refused by name."""
    target, draft, _ = pair
    for temperature in (1.0, 0.0):  # greedy rows judge by the draft's T=1 softmax, not their point mass
        params = SamplingParams(temperature=temperature, max_new_tokens=16, ignore_eos=True, seed=3)
        per_round = {}
        for stop in (0.0, 0.99):
            eng = _engine(target, draft, "sd", k=4, stop_prob=stop)
            eng.sample(PROMPTS, params)
            per_round[stop] = assert_ran(eng, "spec")["spec/proposed_per_round"]
        assert per_round[0.0] > 3.0 and per_round[0.99] < 1.5, (temperature, per_round)  # K=4 (last rounds: budget)
    for bad in (-0.1, 1.0, "0.3", True):
        with pytest.raises(ValueError, match="stop_prob"):
            SpecConfig(method="sd", stop_prob=bad)


def test_sd_metrics_names(pair):
    target, draft, _ = pair
    eng = _engine(target, draft, "sd", k=3)
    eng.sample(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True))
    m = assert_ran(eng, "spec", accepted=True)
    for key in ("spec/accept_rate", "spec/accepted_per_proposed", "spec/accept_length", "rollout/tokens_per_round",
                "spec/accept_rate_pos_1", "spec/draft_seconds", "spec/verify_seconds", "rollout/tokens_per_s"):
        assert key in m
    assert 0.0 <= m["spec/accept_rate"] <= 1.0
    assert m["spec/accepted_per_proposed"] <= m["spec/accept_rate"] + 1e-12
    assert 1.0 <= m["spec/accept_length"] <= 4.0
    # decode tok/s leaves out the prefill (its time, and the first token of each rollout it sampled)
    assert 0 < m["rollout/prefill_seconds"] < m["rollout/seconds"]
    assert m["rollout/decode_tokens_per_s"] == pytest.approx(
        (m["rollout/tokens"] - 2) / (m["rollout/seconds"] - m["rollout/prefill_seconds"]))
    eng.metrics(reset=True)
    assert "spec/accept_rate" not in eng.metrics()


