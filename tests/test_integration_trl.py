"""The TRL adapter (issue 18): `make_rollout_func(engine)` as the `rollout_func` of TRL's unchanged
`GRPOTrainer`, on the tiny target/draft pair (real HF directories, char-level tokenizer).

- Unit: identical consecutive prompts are grouped (one prompt with n = run length; runs of equal
  length share one `sample` call) and come back in input order; prompt indices are fresh on every
  call and per process; the trainer's sampling settings map onto SamplingParams; options the engine
  cannot honour (min_p, repetition_penalty, generation_kwargs, temperature 0) and bad overrides
  raise ValueError naming the field; weight sync reconciles tied LM heads and refuses PEFT and
  sharded parameters.
- GRPOTrainer (slow): TRL trains 3 steps with AR, SD (conversational prompts) and SSD engines. At
  every call: the engine's weights are bitwise the trainer's right after the sync, the weight version
  advances once per new global step (and not on a second call at the same step), prompt_ids are
  TRL's own tokenization, and the returned logprobs equal the trainer model's log_softmax(logits / T)
  at the completion tokens over the full vocabulary, and TRL's own per-token logprobs of its policy.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")

from rollout_ssd import RolloutEngine, SamplingParams, SpecConfig  # noqa: E402
from rollout_ssd.integrations.trl import group_runs, make_rollout_func, sampling_params, sync_weights  # noqa: E402
from rollout_ssd.rl.tasks import ALPHABET, DIGIT_PROMPTS  # noqa: E402
from rollout_ssd.rl.tiny import TinyConfig, build_tiny_pair  # noqa: E402
from tests.support.models import build_tiny  # noqa: E402
from tests.support.ran import assert_ran  # noqa: E402

# A chat template over the tiny alphabet's characters; `greet` exercises chat_template_kwargs.
CHAT_TEMPLATE = ("{% if greet %}hi {% endif %}{% for m in messages %}{{ m['role'][0] }}: {{ m['content'] }} "
                 "{% endfor %}{% if add_generation_prompt %}a:{% endif %}")
MAX_COMPLETION = 8
# Engine (our decoder) and trainer (transformers' Llama) compute the same float32 logits with
# differently fused and ordered GEMMs, so logprobs differ at float32 rounding level (a few ulps of
# values of order 1-10). 1e-4 is far above that and far below what any real mismatch produces: a
# wrong temperature, a truncated distribution or a shifted token moves a logprob by 1e-2 or more.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return build_tiny_pair(tmp_path_factory.mktemp("trl_tiny"), ALPHABET, TinyConfig(seed=5))


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_pair[0]))


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


class _Accelerator:
    def __init__(self, process_index=0, num_processes=1, zero_stage=None, fsdp=False):
        self.process_index, self.num_processes = process_index, num_processes
        self.state = SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=zero_stage) if zero_stage else None,
                                     fsdp_plugin=object() if fsdp else None)

    def unwrap_model(self, model):
        return model


def _fake_trainer(model, tokenizer, accelerator=None, args=None, **attrs):
    """The GRPOTrainer attributes the adapter reads, with trl 1.16's defaults."""
    values = dict(state=SimpleNamespace(global_step=0), accelerator=accelerator or _Accelerator(), model=model,
                  processing_class=tokenizer, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
                  max_completion_length=MAX_COMPLETION, eos_token_ids=[tokenizer.eos_token_id], tools=[],
                  chat_template=None, chat_template_kwargs={}, environment_factories=None,
                  args=SimpleNamespace(**{"generation_kwargs": None, "seed": 0, **(args or {})}))
    values.update(attrs)
    return SimpleNamespace(**values)


def _spy(engine):
    """Record (number of prompts, n, prompt_indices) of every engine.sample call."""
    calls, real = [], engine.sample

    def sample(prompts, params=None, progress=False, prompt_indices=None):
        calls.append((len(prompts), params.n, list(prompt_indices)))
        return real(prompts, params, progress=progress, prompt_indices=prompt_indices)

    engine.sample = sample
    return calls


def _bits(t: torch.Tensor) -> torch.Tensor:
    assert t.dtype == torch.float32
    return t.detach().contiguous().view(torch.int32)


def _assert_engine_holds(engine, model):
    params = dict(model.named_parameters())
    engine_params = engine.target.model.hf_parameters()
    assert set(engine_params) == set(params)
    for name, tensor in engine_params.items():
        assert torch.equal(_bits(tensor), _bits(params[name])), f"{name} differs from the trainer's"


def _recomputed_logprobs(model, prompt_ids, completion_ids, temperature):
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0, len(prompt_ids) - 1:-1]
        logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(completion_ids)[:, None])[:, 0]


# ---------------------------------------------------------------------------------------------- unit


def test_group_runs():
    assert group_runs([[1], [1], [2, 3], [2, 3], [2, 3], [1]]) == [(0, 2), (2, 3), (5, 1)]
    assert group_runs([]) == []


def test_groups_share_a_call_per_run_length_and_keep_input_order(tiny_pair, tokenizer):
    engine = RolloutEngine.from_pretrained(str(tiny_pair[0]), dtype="float32")
    calls = _spy(engine)
    trainer = _fake_trainer(_hf_model(tiny_pair[0]), tokenizer)
    prompts = ["Digits:"] * 4 + ["Write digits:"] * 4 + ["Digits:"] * 2
    out = make_rollout_func(engine)(prompts, trainer)
    # two runs of 4 in one call (n=4), the trailing run of 2 in another (n=2)
    assert sorted((num, n) for num, n, _ in calls) == [(1, 2), (2, 4)]
    expected_ids = tokenizer(text=prompts)["input_ids"]
    assert out["prompt_ids"] == expected_ids
    assert set(out) == {"prompt_ids", "completion_ids", "logprobs", "weight_version", "finish_reason"}
    assert all(len(out[k]) == len(prompts) for k in out)
    eos = tokenizer.eos_token_id
    for ids, lps, reason in zip(out["completion_ids"], out["logprobs"], out["finish_reason"]):
        assert len(ids) == len(lps) >= 1
        assert reason == ("stop" if ids[-1] == eos else "length")
        assert reason == "stop" or len(ids) == MAX_COMPLETION
    # siblings of a group are independent samples
    assert len({tuple(ids) for ids in out["completion_ids"][:4]}) > 1
    assert out["weight_version"] == [1] * len(prompts)  # synced once, on the first call


def test_prompt_indices_are_fresh_across_calls_and_processes(tiny_pair, tokenizer):
    engine = RolloutEngine.from_pretrained(str(tiny_pair[0]), dtype="float32")
    calls = _spy(engine)
    model = _hf_model(tiny_pair[0])
    prompts = ["Digits:"] * 4 + ["Write digits:"] * 4
    rank0 = _fake_trainer(model, tokenizer, _Accelerator(0, 2))
    rank1 = _fake_trainer(model, tokenizer, _Accelerator(1, 2))
    func0, func1 = make_rollout_func(engine), make_rollout_func(engine)
    first = func0(prompts, rank0)
    second = func0(prompts, rank0)
    other = func1(prompts, rank1)
    indices = [i for _, _, idx in calls for i in idx]
    assert len(indices) == 6 and len(set(indices)) == 6
    assert [idx for _, _, idx in calls] == [[0, 2], [4, 6], [1, 3]]
    assert first["completion_ids"] != second["completion_ids"]  # new randomness on the next call
    assert first["completion_ids"] != other["completion_ids"]
    # the same seed reproduces the same rollouts from a fresh function (same weights)
    again = make_rollout_func(engine)(prompts, rank0)
    assert again["completion_ids"] == first["completion_ids"] and again["logprobs"] == first["logprobs"]
    # a different seed draws new ones
    reseeded = make_rollout_func(engine, seed=1)(prompts, rank0)
    assert reseeded["completion_ids"] != first["completion_ids"]


def test_sampling_params_follow_the_trainer(tiny_pair, tokenizer):
    trainer = _fake_trainer(None, tokenizer, temperature=0.7, top_p=0.9, top_k=-1, args={"seed": 11},
                            eos_token_ids=[2, 5])
    params = sampling_params(trainer, {})
    assert params == SamplingParams(n=1, temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=MAX_COMPLETION, seed=11,
                                    stop_token_ids=(2, 5), ignore_eos=True)
    over = sampling_params(trainer, {"seed": 3, "top_k": 5, "max_new_tokens": 4})
    assert (over.seed, over.top_k, over.max_new_tokens, over.temperature) == (3, 5, 4, 0.7)
    with_engine_eos = sampling_params(trainer, {"ignore_eos": False})
    assert (with_engine_eos.stop_token_ids, with_engine_eos.ignore_eos) == ((2, 5), False)


@pytest.mark.parametrize("attrs, args, field", [
    ({"min_p": 0.1}, {}, "min_p"),
    ({"repetition_penalty": 1.1}, {}, "repetition_penalty"),
    ({}, {"generation_kwargs": {"num_beams": 2}}, "generation_kwargs"),
    ({"temperature": 0.0}, {}, "temperature"),
    ({"top_k": -3}, {}, "top_k"),
    ({"max_completion_length": None}, {}, "max_completion_length"),
])
def test_refuses_options_it_cannot_honour(attrs, args, field, tiny_pair, tokenizer):
    engine = RolloutEngine.from_pretrained(str(tiny_pair[0]), dtype="float32")
    trainer = _fake_trainer(_hf_model(tiny_pair[0]), tokenizer, args=args, **attrs)
    with pytest.raises(ValueError, match=f"GRPOConfig.{field}"):
        make_rollout_func(engine)(["Digits:"] * 2, trainer)
    assert engine.weight_version == 0  # refused before any work


@pytest.mark.parametrize("overrides, match", [
    ({"min_p": 0.1}, "min_p"),
    ({"bogus": 1}, "bogus"),
    ({"n": 2}, "SamplingParams.n"),
    ({"chat": True}, "SamplingParams.chat"),
    ({"top_p": 2.0}, "SamplingParams.top_p"),
])
def test_bad_overrides_raise(overrides, match):
    with pytest.raises(ValueError, match=match):
        make_rollout_func(object(), **overrides)


def test_sync_refuses_peft_and_sharded_models(tiny_pair, tokenizer):
    engine = RolloutEngine.from_pretrained(str(tiny_pair[0]), dtype="float32")
    model = _hf_model(tiny_pair[0])
    with pytest.raises(ValueError, match="ZeRO-3"):
        sync_weights(engine, _fake_trainer(model, tokenizer, _Accelerator(zero_stage=3)))
    with pytest.raises(ValueError, match="FSDP"):
        sync_weights(engine, _fake_trainer(model, tokenizer, _Accelerator(fsdp=True)))
    model.model.norm.weight.ds_id = 7  # what a ZeRO-3 partitioned parameter carries
    with pytest.raises(ValueError, match="model.norm.weight.*ZeRO-3"):
        sync_weights(engine, _fake_trainer(model, tokenizer))
    del model.model.norm.weight.ds_id
    model.peft_config = {"default": object()}
    with pytest.raises(ValueError, match="PEFT"):
        sync_weights(engine, _fake_trainer(model, tokenizer))
    assert engine.weight_version == 0


def test_sync_reconciles_tied_lm_heads(tmp_path, tokenizer):
    kwargs = dict(init="transformers", seed=0, vocab_size=len(tokenizer), intermediate_size=64, num_hidden_layers=1,
                  max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id)
    tied = build_tiny(tmp_path / "tied", tie_word_embeddings=True, **kwargs)
    untied = build_tiny(tmp_path / "untied", tie_word_embeddings=False, **kwargs)
    with torch.no_grad():
        for p in list(tied.parameters()) + list(untied.parameters()):
            p.add_(0.01 * torch.randn_like(p))
    # tied on both sides: the embedding is sent once
    engine = RolloutEngine.from_pretrained(str(tmp_path / "tied"), dtype="float32")
    sync_weights(engine, _fake_trainer(tied, tokenizer))
    assert "lm_head.weight" not in engine.target.model.hf_parameters()
    _assert_engine_holds(engine, tied)
    # the engine ties the head but the trainer trains a separate one: refused
    with pytest.raises(ValueError, match="ties the LM head"):
        sync_weights(engine, _fake_trainer(untied, tokenizer))
    # tied in the trainer, separate in the engine: the embedding fills both
    engine = RolloutEngine.from_pretrained(str(tmp_path / "untied"), dtype="float32")
    sync_weights(engine, _fake_trainer(tied, tokenizer))
    held = engine.target.model.hf_parameters()
    assert torch.equal(_bits(held["lm_head.weight"]), _bits(tied.model.embed_tokens.weight))
    assert torch.equal(_bits(held["model.embed_tokens.weight"]), _bits(tied.model.embed_tokens.weight))


# ---------------------------------------------------------------------------------------------- GRPOTrainer


@pytest.mark.slow
def test_tokenization_is_trls_own(tiny_pair, tmp_path, monkeypatch):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rollout_ssd.integrations.trl import tokenize_prompts

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = AutoTokenizer.from_pretrained(str(tiny_pair[0]))
    tok.chat_template = CHAT_TEMPLATE
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      per_device_train_batch_size=4, num_generations=4, max_completion_length=MAX_COMPLETION,
                      chat_template_kwargs={"greet": True})
    trainer = GRPOTrainer(model=_hf_model(tiny_pair[0]), processing_class=tok, reward_funcs=lambda completions, **k:
                          [0.0] * len(completions), args=args, train_dataset=Dataset.from_list([{"prompt": "Digits:"}]),
                          rollout_func=lambda prompts, trainer: {})
    text = list(DIGIT_PROMPTS)
    chats = [[{"role": "system", "content": "Be short."}, {"role": "user", "content": p}] for p in DIGIT_PROMPTS]
    for prompts in (text, chats):
        assert tokenize_prompts(prompts, trainer) == [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
    assert tok.decode(tokenize_prompts(chats[:1], trainer)[0]) == "hi s: Be short. u: Write digits: a:"


SPECS = {
    "ar": SpecConfig(method="ar"),
    "sd": SpecConfig(method="sd", k=3),
    "ssd": SpecConfig(method="ssd", k=3, strategy_rule=False),  # the rule off: every round is an SSD round
}


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ar", "sd", "ssd"])
def test_grpo_trainer_trains_on_engine_rollouts(method, tiny_pair, tmp_path, monkeypatch):
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    target, draft = tiny_pair
    tok = AutoTokenizer.from_pretrained(str(target))
    chat = method == "sd"  # one run with conversational prompts through the chat template
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    rows = [{"prompt": [{"role": "user", "content": p}] if chat else p} for p in DIGIT_PROMPTS]
    model = _hf_model(target)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    temperature = 0.9
    # AR: two generations per optimizer step (gradient accumulation 2, a generation every micro-step),
    # so the second call of each step must not sync again
    accumulation = 2 if method == "ar" else 1
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                      max_steps=3, per_device_train_batch_size=8, gradient_accumulation_steps=accumulation,
                      steps_per_generation=1, num_generations=4, max_completion_length=MAX_COMPLETION,
                      temperature=temperature, learning_rate=1e-2, logging_steps=1, use_vllm=False, seed=0)
    engine = RolloutEngine.from_pretrained(str(target), draft=str(draft), spec=SPECS[method], dtype="float32")
    rollout = make_rollout_func(engine)
    seen, rewarded = [], []

    def checked_rollout(prompts, trainer):
        before, step = engine.weight_version, trainer.state.global_step
        out = rollout(prompts, trainer)
        new_step = not seen or seen[-1][0] != step
        assert engine.weight_version == before + (1 if new_step else 0)
        policy = trainer.accelerator.unwrap_model(trainer.model)
        _assert_engine_holds(engine, policy)
        assert out["prompt_ids"] == [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]
        assert out["weight_version"] == [engine.weight_version] * len(prompts)
        worst = 0.0
        for p_ids, c_ids, lps in zip(out["prompt_ids"], out["completion_ids"], out["logprobs"]):
            assert 1 <= len(c_ids) <= MAX_COMPLETION and len(lps) == len(c_ids)
            ref = _recomputed_logprobs(policy, p_ids, c_ids, temperature)
            worst = max(worst, float((ref - torch.tensor(lps)).abs().max()))
            with torch.no_grad():  # and TRL's own (fused LM head) computation of its policy logprobs
                ids = torch.tensor([p_ids + c_ids])
                trl_lps = trainer._get_per_token_logps_and_entropies(policy, ids, torch.ones_like(ids), len(c_ids))[0]
            worst = max(worst, float((trl_lps[0] - torch.tensor(lps)).abs().max()))
        assert worst < LOGPROB_ATOL, f"rollout logprobs differ from the trainer's by {worst}"
        seen.append((step, engine.weight_version, len(prompts)))
        return out

    def reward(completions, weight_version, finish_reason, **kwargs):  # extra fields reach the reward
        rewarded.append((list(weight_version), list(finish_reason)))
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]

    try:
        trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_list(rows * 4), rollout_func=checked_rollout)
        trainer.train()
        metrics = engine.metrics()
    finally:
        engine.close()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logs] == [1, 2, 3]
    assert all("reward" in h and "loss" in h for h in logs)
    steps = [s for s, _, _ in seen]
    assert sorted(set(steps)) == [0, 1, 2] and len(seen) == 3 * accumulation
    assert engine.weight_version == 3  # one sync per new global step
    assert [v for _, v, _ in seen] == [1 + s for s in steps]
    assert all(n == 8 for _, _, n in seen)
    assert len(rewarded) == len(seen) and all(set(r) <= {"stop", "length"} for _, r in rewarded)
    assert any(not torch.equal(p, initial[n]) for n, p in model.named_parameters()), "the trainer did not train"
    if method == "sd":  # chains proposed and some of their tokens accepted (the tiny pair's draft is close)
        assert_ran(metrics, "spec", accepted=True)
    if method == "ssd":  # SSD rounds, some served from the speculation cache, beside its worker process
        assert_ran(metrics, "ssd", hits=True)
        assert metrics["ssd/worker_failures"] == 0
