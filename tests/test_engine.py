"""RolloutEngine ("ar") end to end: greedy equals transformers' generate, the sampled law, seeds,
logprobs, stopping and ordering (docs/DESIGN.md's contract for `sample`).

Greedy is compared token for token in float32 (docs/DESIGN.md: "exactly in float32"), with transformers run
on each prompt alone and unpadded, against our engine at batch 1 and inside larger ragged batches whose
sequences finish at different steps (so continuous batching admits waiting ones mid-run).
"""

from __future__ import annotations

import pytest
import torch

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.models.loader import load_pretrained
from tests.support.hf_reference import hf_greedy, hf_logits
from tests.support.laws import exact_law, hf_next_logits
from tests.support.models import FAMILIES, build_tiny
from tests.support.stats import assert_fits


def _engine(loaded, max_batch_size: int = 8, max_model_len=None) -> RolloutEngine:
    return RolloutEngine(loaded, SpecConfig(method="ar"),
                         EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len))


def _prompts(lengths, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _assert_idle(engine: RolloutEngine) -> None:
    """Every KV slot is free again after `sample` returns."""
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots


def _logprobs_ref(hf, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log softmax(transformers' logits / T) at the emitted tokens (T = 1 when greedy). [len(tokens)]"""
    logits = hf_logits(hf, prompt + tokens)[len(prompt) - 1: -1]
    temp = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / temp, dim=-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tiny GQA Llama (V = 96, no EOS), float32: (transformers model, our LoadedModel)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = build_tiny(path, "llama-gqa-untied", seed=3, logit_scale=2.0)
    return hf, load_pretrained(str(path), dtype="float32")


# ---- greedy == transformers' greedy generate ------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_hf_generate_tiny(family, tmp_path):
    """Five ragged prompts, up to 32 new tokens, max_model_len 36 (so rows with longer prompts stop
    earlier, by length): alone (max_batch_size 1), all together, and 3 slots for 10 sequences (n = 2)."""
    hf = build_tiny(tmp_path, family, seed=21)
    loaded = load_pretrained(str(tmp_path), dtype="float32")
    prompts = _prompts([3, 9, 1, 14, 6], hf.config.vocab_size, seed=22)
    max_new, max_len = 32, 36
    refs = [hf_greedy(hf, p, min(max_new, max_len - len(p))) for p in prompts]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=max_new)
    for batch in (1, 16, 3):
        engine = _engine(loaded, batch, max_model_len=max_len)
        out = engine.sample(prompts, params)
        assert [(r.prompt_index, r.sample_index) for r in out] == [(i, j) for i in range(5) for j in range(2)]
        for r in out:
            assert r.token_ids == refs[r.prompt_index], f"batch {batch}, prompt {r.prompt_index}"
            assert r.finish_reason == "length" and r.prompt_token_ids == prompts[r.prompt_index]
        _assert_idle(engine)


@pytest.mark.slow
def test_greedy_matches_hf_generate_default(default_model_f32, hf_default):
    """SmolLM2, float32, 24 new tokens: two prompts alone (1 slot), then the same two mixed with a
    shorter one in 2 slots under max_model_len 30, so rows stop at different steps (24, 24 and 30 minus
    the prompt length, or at EOS) and the third is admitted mid-run. Tokens, finish reasons, text, and
    logprobs (against the logits transformers' generate saw) all match."""
    tok = default_model_f32.tokenizer
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there", "def add(a, b):"]
    eos = default_model_f32.model.cfg.eos_token_ids
    refs = [hf_greedy(hf_default, tok(t).input_ids, 24, with_logits=True) for t in texts]

    def check(rollout, budget):
        ref_tokens, ref_logits = refs[rollout.prompt_index]
        ref_tokens = ref_tokens[:budget]  # a shorter greedy run is a prefix of a longer one
        assert rollout.token_ids == ref_tokens, texts[rollout.prompt_index]
        stopped = ref_tokens[-1] in eos
        assert rollout.finish_reason == ("stop" if stopped else "length")
        assert len(ref_tokens) == budget or stopped
        assert rollout.text == tok.decode(rollout.token_ids, skip_special_tokens=True)
        ref_logprobs = torch.log_softmax(ref_logits[: len(ref_tokens)], dim=-1)
        ref_logprobs = ref_logprobs.gather(1, torch.tensor(ref_tokens)[:, None]).squeeze(1)
        torch.testing.assert_close(torch.tensor(rollout.logprobs), ref_logprobs, rtol=0, atol=1e-4)

    alone = _engine(default_model_f32, 1, max_model_len=64)
    for r in alone.sample(texts[:2], SamplingParams(temperature=0.0, max_new_tokens=24)):
        check(r, 24)
    mixed = _engine(default_model_f32, 2, max_model_len=30)
    out = mixed.sample(texts, SamplingParams(temperature=0.0, max_new_tokens=24))
    budgets = [min(24, 30 - len(r.prompt_token_ids)) for r in out]
    assert len(set(budgets)) > 1, "rows must finish at different steps"
    for r, budget in zip(out, budgets):
        check(r, budget)
    _assert_idle(mixed)


def test_greedy_stopping_matches_hf(tmp_path):
    """EOS from the config ends a rollout exactly where transformers' generate stops (EOS included,
    finish "stop"); ignore_eos runs on to max_new_tokens ("length"); stop_token_ids stop too."""
    family, seed, prompt = "qwen2-bias-tied", 31, [5, 17, 2, 40]
    hf = build_tiny(tmp_path / "no-eos", family, seed=seed)
    free_run = hf_greedy(hf, prompt, 20)
    first_new = [i for i, t in enumerate(free_run) if t not in free_run[:i]]
    eos_at, stop_at = first_new[2], first_new[1]  # the 3rd and 2nd distinct tokens of the greedy run
    eos, stop = free_run[eos_at], free_run[stop_at]
    hf_eos = build_tiny(tmp_path / "eos", family, seed=seed, eos_token_id=eos)  # same weights, an EOS
    assert hf_greedy(hf_eos, prompt, 20) == free_run[: eos_at + 1]
    engine = _engine(load_pretrained(str(tmp_path / "eos"), dtype="float32"), 4)

    (r,) = engine.sample([prompt], SamplingParams(temperature=0.0, max_new_tokens=20))
    assert r.token_ids == free_run[: eos_at + 1] and r.finish_reason == "stop"
    (r,) = engine.sample([prompt], SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True))
    assert r.token_ids == free_run and r.finish_reason == "length"
    (r,) = engine.sample([prompt], SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[stop]))
    assert r.token_ids == free_run[: stop_at + 1] and r.finish_reason == "stop"
    (r,) = engine.sample([prompt], SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=[eos],
                                                  ignore_eos=True))
    assert r.token_ids == free_run[: eos_at + 1] and r.finish_reason == "stop"  # stop ids survive ignore_eos
    (r,) = engine.sample([prompt], SamplingParams(temperature=0.0, max_new_tokens=eos_at))
    assert r.token_ids == free_run[:eos_at] and r.finish_reason == "length"
    _assert_idle(engine)


# ---- the sampled law ----------------------------------------------------------------------------

LAW_VOCAB, LAW_STEPS = 10, 3


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A tiny Llama with V = 10 and a sharp-ish head (so top-p and top-k cut real mass)."""
    path = tmp_path_factory.mktemp("small-vocab")
    hf = build_tiny(path, "llama-gqa-untied", seed=41, vocab_size=LAW_VOCAB, logit_scale=2.5)
    return hf, load_pretrained(str(path), dtype="float32")


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.9), (0.7, 3, 1.0)])
def test_sampled_law_matches_enumeration(small_vocab, temperature, top_k, top_p):
    """The empirical law of 3-token continuations (two prompts of different lengths in one batch,
    n = 1000 per prompt, 3 seeds: 3000 samples per prompt) against the exact law by enumeration.
    Chi-square at alpha = 1e-4 per prompt: this test fails by chance with probability <= 2e-4 per
    parameter set (4e-4 for both). Paths of probability 0 (truncated by top-k/top-p) must never occur."""
    hf, loaded = small_vocab
    prompts = [[3, 7], [1, 4, 4, 9, 2]]
    engine = _engine(loaded, 2048, max_model_len=16)
    counts = torch.zeros(len(prompts), LAW_VOCAB ** LAW_STEPS, dtype=torch.long)
    for seed in range(3):
        params = SamplingParams(n=1000, temperature=temperature, top_k=top_k, top_p=top_p,
                                max_new_tokens=LAW_STEPS, seed=seed)
        for r in engine.sample(prompts, params):
            assert len(r.token_ids) == LAW_STEPS and r.finish_reason == "length"
            t1, t2, t3 = r.token_ids
            counts[r.prompt_index, (t1 * LAW_VOCAB + t2) * LAW_VOCAB + t3] += 1
    _assert_idle(engine)
    for i, prompt in enumerate(prompts):
        law = exact_law(hf_next_logits(hf), prompt, LAW_STEPS, LAW_VOCAB, temperature, top_k, top_p).flatten()
        untruncated = exact_law(hf_next_logits(hf), prompt, LAW_STEPS, LAW_VOCAB, temperature).flatten()
        assert float(untruncated[law == 0].sum()) > 0.01, "truncation must cut real mass"
        assert int(counts[i][law == 0].sum()) == 0, f"prompt {i}: a zero-probability path was sampled"
        assert_fits(counts[i], law, alpha=1e-4, what=f"prompt {i}: ")  # fails by chance w.p. 1e-4 per prompt


# ---- seeds, logprobs, stopping, ordering --------------------------------------------------------


def test_same_seed_same_rollouts_regardless_of_batch(tiny_llama):
    """At T = 1 the rollout of (prompt index i, sample j, seed) is the same whatever else is in the
    batch, the batch size, n, or the admission order. The rule (docs/DESIGN.md): randomness depends on
    (seed, i, j), so the same prompt at another index gets another (equally valid) rollout."""
    hf, loaded = tiny_llama
    a, b, c, x = _prompts([4, 9, 2, 6], hf.config.vocab_size, seed=51)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=5)
    reference = _engine(loaded, 16).sample([a, b, c], params)
    key = lambda rollouts: {(r.prompt_index, r.sample_index): r for r in rollouts}  # noqa: E731
    ref = key(reference)

    one_slot = key(_engine(loaded, 1).sample([a, b, c], params))
    bigger_n = key(_engine(loaded, 4).sample([a, x, c], SamplingParams(n=3, temperature=1.0, max_new_tokens=12,
                                                                        seed=5)))
    for (i, j), r in ref.items():
        assert one_slot[i, j].token_ids == r.token_ids
        torch.testing.assert_close(torch.tensor(one_slot[i, j].logprobs), torch.tensor(r.logprobs), rtol=0, atol=1e-5)
        if i != 1:
            assert bigger_n[i, j].token_ids == r.token_ids
    c_first = key(_engine(loaded, 1).sample([c, a], params))
    assert c_first[0, 0].token_ids == key(_engine(loaded, 3).sample([c], params))[0, 0].token_ids
    assert len({tuple(r.token_ids) for r in reference}) == len(reference), "samples must differ"
    other_seed = _engine(loaded, 16).sample([a, b, c], SamplingParams(n=2, temperature=1.0, max_new_tokens=12,
                                                                      seed=6))
    assert [r.token_ids for r in other_seed] != [r.token_ids for r in reference]


def test_split_job_with_global_prompt_indices_reproduces_one_call(tiny_llama):
    """A job split into parts that pass their prompts' global indices gets exactly the rollouts of one
    call over all prompts (how actors and the dataset job split work)."""
    hf, loaded = tiny_llama
    prompts = _prompts([4, 9, 2, 6, 3], hf.config.vocab_size, seed=52)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=9)
    whole = _engine(loaded, 8).sample(prompts, params)
    parts = (_engine(loaded, 2).sample(prompts[3:], params, prompt_indices=[3, 4])
             + _engine(loaded, 3).sample(prompts[:3], params, prompt_indices=[0, 1, 2]))
    parts.sort(key=lambda r: (r.prompt_index, r.sample_index))
    assert [(r.prompt_index, r.sample_index, r.token_ids) for r in parts] == \
        [(r.prompt_index, r.sample_index, r.token_ids) for r in whole]
    with pytest.raises(ValueError, match="prompt_indices"):
        _engine(loaded, 2).sample(prompts[:2], params, prompt_indices=[1, 1])


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)])
def test_logprobs_are_full_vocab_log_softmax(tiny_llama, temperature, top_p):
    """logprobs[i] = log softmax(transformers' logits / T)[token_ids[i]] over the full vocabulary,
    before top-p (T = 1 when greedy)."""
    hf, loaded = tiny_llama
    prompts = _prompts([5, 2, 8], hf.config.vocab_size, seed=61)
    params = SamplingParams(n=2, temperature=temperature, top_p=top_p, max_new_tokens=10, seed=1)
    for r in _engine(loaded, 4).sample(prompts, params):
        ref = _logprobs_ref(hf, r.prompt_token_ids, r.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, rtol=0, atol=1e-5)


def test_rollout_fields_ordering_and_length_stops(tiny_llama):
    """len(prompts) * n rollouts ordered by (prompt, sample); "length" at max_new_tokens and at the
    context limit; no tokenizer -> text None; an empty prompt list gives []."""
    hf, loaded = tiny_llama
    prompts = _prompts([3, 20, 7], hf.config.vocab_size, seed=71)
    engine = _engine(loaded, 2, max_model_len=24)
    out = engine.sample(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=8, seed=2))
    assert [(r.prompt_index, r.sample_index) for r in out] == [(i, j) for i in range(3) for j in range(3)]
    for r in out:
        assert r.prompt_token_ids == prompts[r.prompt_index]
        assert len(r.token_ids) == len(r.logprobs) == (8 if r.prompt_index != 1 else 24 - 20)
        assert r.finish_reason == "length" and r.text is None and r.weight_version == 0
        assert all(0 <= t < hf.config.vocab_size for t in r.token_ids)
    assert engine.sample([], SamplingParams(n=4)) == []
    _assert_idle(engine)


def test_sampled_rollouts_end_at_their_first_stop_token(tiny_llama):
    """At T = 1 with several stop tokens: a rollout ends with its first stop token ("stop", the token
    included) or runs to max_new_tokens without one ("length"); both outcomes occur."""
    hf, loaded = tiny_llama
    prompts = _prompts([4, 7], hf.config.vocab_size, seed=81)
    stops = tuple(range(0, hf.config.vocab_size, 9))  # 11 of 96 tokens
    out = _engine(loaded, 8).sample(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=10, seed=4,
                                                            stop_token_ids=stops))
    for r in out:
        hits = [i for i, t in enumerate(r.token_ids) if t in stops]
        if r.finish_reason == "stop":
            assert hits == [len(r.token_ids) - 1]
        else:
            assert r.finish_reason == "length" and not hits and len(r.token_ids) == 10
    assert {r.finish_reason for r in out} == {"stop", "length"}


def test_every_method_and_speculator_name_has_a_builder():
    """config.METHODS / SPECULATORS are the one source of names; methods.py builds each of them."""
    from rollout_ssd.config import METHODS, SPECULATORS
    from rollout_ssd.methods import METHOD_BUILDERS, SPECULATOR_BUILDERS

    assert set(METHOD_BUILDERS) == set(METHODS)
    assert set(SPECULATOR_BUILDERS) == set(SPECULATORS)


def test_metric_names_are_the_documented_ones():
    """The constants spell docs/DESIGN.md's names (dashboards and JSONL records key on them)."""
    from rollout_ssd import metric_names as names

    assert (names.ROLLOUT_TOKENS_PER_S, names.ROLLOUT_TOKENS_PER_ROUND) == ("rollout/tokens_per_s",
                                                                             "rollout/tokens_per_round")
    assert (names.SPEC_ACCEPT_RATE, names.SPEC_ACCEPT_LENGTH, names.SPEC_ACCEPTED_PER_PROPOSED) == (
        "spec/accept_rate", "spec/accept_length", "spec/accepted_per_proposed")
    assert names.spec_accept_rate_pos(2) == "spec/accept_rate_pos_2"
    assert (names.SSD_HIT_RATE, names.SSD_STRATEGY, names.ssd_state("T_p")) == ("ssd/hit_rate", "ssd/strategy",
                                                                                "ssd/T_p")
    assert (names.SYNC_VERSION, names.SYNC_BYTES, names.SYNC_SECONDS, names.SYNC_REJECTED) == (
        "sync/version", "sync/bytes", "sync/seconds", "sync/rejected")
    assert (names.SYNC_DRAFT_VERSION, names.SYNC_DRAFT_REJECTED) == ("sync/draft_version", "sync/draft_rejected")
    assert names.DRIFT_KL_TARGET_DRAFT == "drift/kl_target_draft"
