"""Bad input gets a ValueError that names the offending field or prompt index (docs/DESIGN.md), raised before
any work starts, and the engine keeps working afterwards with nothing left over (no slot held, the
same rollouts as a fresh engine)."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout_ssd import EngineConfig, RolloutEngine, SamplingParams, SpecConfig
from rollout_ssd.models.loader import load_pretrained
from tests.support.models import build_tiny

MAX_LEN = 32
GOOD = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny Llama checkpoint without tokenizer files (V = 96)."""
    path = tmp_path_factory.mktemp("tiny-bad-input")
    build_tiny(path, "llama-gqa-untied", seed=5)
    return path


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_pretrained(str(tiny_dir), dtype="float32")


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A tiny Llama over SmolLM2's vocabulary (49152) with SmolLM2's tokenizer saved beside it."""
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tiny(path, "llama-gqa-untied", seed=6, vocab_size=49152, tokenizer="smollm2")
    loaded = load_pretrained(str(path), dtype="float32")
    assert loaded.tokenizer is not None
    return loaded


def _engine(loaded, max_batch_size: int = 4) -> RolloutEngine:
    return RolloutEngine(loaded, SpecConfig(method="ar"), EngineConfig(max_batch_size=max_batch_size,
                                                                       max_model_len=MAX_LEN))


def _tokens(rollouts):
    return [(r.prompt_index, r.sample_index, r.token_ids) for r in rollouts]


# ---- SamplingParams, SpecConfig, EngineConfig ----------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("n", -1), ("n", 1.5),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf), ("temperature", "1"),
    ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -1), ("top_p", math.nan),
    ("top_k", -1), ("top_k", 2.0),
    ("max_new_tokens", 0), ("max_new_tokens", -3),
    ("seed", 1.5), ("seed", None),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", 5),
])
def test_sampling_params_rejects(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("max_batch_size", 0), ("max_batch_size", -2), ("max_batch_size", 2.0),
    ("max_model_len", 1), ("max_model_len", 0), ("max_model_len", 16.0),
    ("kv_cache_bytes", 0), ("kv_cache_bytes", -5),
])
def test_engine_config_rejects(field, value):
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}"):
        EngineConfig(**{field: value})


@pytest.mark.parametrize("field,value", [("method", "beam"), ("k", 0), ("speculator", "oracle")])
def test_spec_config_rejects(field, value):
    with pytest.raises(ValueError, match=rf"SpecConfig\.{field}"):
        SpecConfig(**{field: value})


def test_kv_cache_too_small_for_one_sequence(tiny):
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        RolloutEngine(tiny, SpecConfig(method="ar"), EngineConfig(max_model_len=MAX_LEN, kv_cache_bytes=100))


def test_max_model_len_beyond_the_model_is_refused(tiny):
    too_long = tiny.model.cfg.max_position_embeddings + 1
    with pytest.raises(ValueError, match="max_model_len"):
        RolloutEngine(tiny, SpecConfig(method="ar"), EngineConfig(max_batch_size=1, max_model_len=too_long))


# ---- from_pretrained and checkpoints --------------------------------------------------------------


def test_from_pretrained_rejects_unknown_options(tiny_dir):
    with pytest.raises(ValueError, match="max_batch_sise"):
        RolloutEngine.from_pretrained(str(tiny_dir), max_batch_sise=4)
    with pytest.raises(ValueError, match="device"):
        RolloutEngine.from_pretrained(str(tiny_dir), device="tpu")
    with pytest.raises(ValueError, match="dtype"):
        RolloutEngine.from_pretrained(str(tiny_dir), dtype="float64")
    with pytest.raises(ValueError, match="max_batch_size"):
        RolloutEngine.from_pretrained(str(tiny_dir), max_batch_size=0)
    with RolloutEngine.from_pretrained(str(tiny_dir), dtype="float32", max_batch_size=2, max_model_len=MAX_LEN) as engine:
        assert len(engine.sample([[1, 2, 3]], GOOD)) == 2


def test_unknown_model_name_or_path(tmp_path):
    with pytest.raises(ValueError, match="no-such-model-xyz"):
        RolloutEngine.from_pretrained("no-such-model-xyz")
    with pytest.raises(ValueError, match="missing-dir"):
        load_pretrained(str(tmp_path / "missing-dir"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):  # a directory without config.json
        load_pretrained(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="model"):
        load_pretrained(None)


def _copy_checkpoint(src, dst, edit) -> None:
    """Copy a tiny checkpoint, letting `edit` change its state dict."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})


def test_checkpoint_with_missing_misshapen_or_unknown_tensor(tiny_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    _copy_checkpoint(tiny_dir, tmp_path / "missing", lambda s: s.pop(name))
    with pytest.raises(ValueError, match=rf"missing.*{name}"):
        load_pretrained(str(tmp_path / "missing"))
    _copy_checkpoint(tiny_dir, tmp_path / "misshapen", lambda s: s.update({name: s[name][:, :-1].contiguous()}))
    with pytest.raises(ValueError, match=rf"{name}.*shape"):
        load_pretrained(str(tmp_path / "misshapen"))
    _copy_checkpoint(tiny_dir, tmp_path / "unknown", lambda s: s.update({"model.layers.1.extra.weight": s[name].clone()}))
    with pytest.raises(ValueError, match=r"unknown.*model\.layers\.1\.extra\.weight"):
        load_pretrained(str(tmp_path / "unknown"))
    (tmp_path / "no-weights").mkdir()
    (tmp_path / "no-weights" / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        load_pretrained(str(tmp_path / "no-weights"))


@pytest.mark.parametrize("overrides,match", [
    (dict(attention_bias=True), r"o_proj\.bias"),  # Llama's o_proj bias is not implemented: loud, not dropped
    (dict(mlp_bias=True), r"gate_proj\.bias"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}), "rope_type"),
])
def test_unsupported_llama_features_fail_loudly(tmp_path, overrides, match):
    build_tiny(tmp_path, "llama-gqa-untied", seed=7, **overrides)
    with pytest.raises(ValueError, match=match):
        load_pretrained(str(tmp_path))


@pytest.mark.parametrize("family", ["qwen2-bias-tied", "qwen3-qknorm-yarn"])
def test_sliding_window_layers_are_refused(tmp_path, family):
    """transformers applies a sliding window on these layers; our decoder attends over everything, so
    loading must refuse rather than give other logits."""
    build_tiny(tmp_path, family, seed=7, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    with pytest.raises(ValueError, match="sliding"):
        load_pretrained(str(tmp_path))


def test_unsupported_model_type(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32).save_pretrained(str(tmp_path))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        load_pretrained(str(tmp_path))


# ---- prompts --------------------------------------------------------------------------------------

GOOD_IDS = [[1, 2, 3], [7, 8, 9, 10, 11]]


@pytest.mark.parametrize("bad,match", [
    ([], r"prompts\[1\] is empty"),
    ([5, 96], r"prompts\[1\].*outside \[0, 96\)"),
    ([-1, 5], r"prompts\[1\].*outside"),
    ([1.5], r"prompts\[1\]"),
    ([True, 2], r"prompts\[1\]"),
    (list(range(MAX_LEN)), r"prompts\[1\] has 32 tokens"),
    ("a text prompt", r"prompts\[1\].*tokenizer"),
    (None, r"prompts\[1\]"),
    ({"input_ids": [1]}, r"prompts\[1\]"),
])
def test_bad_prompt_named_by_index_and_engine_unharmed(tiny, bad, match):
    engine = _engine(tiny)
    with pytest.raises(ValueError, match=match):
        engine.sample([GOOD_IDS[0], bad, GOOD_IDS[1]], GOOD)
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots
    assert _tokens(engine.sample(GOOD_IDS, GOOD)) == _tokens(_engine(tiny).sample(GOOD_IDS, GOOD))


def test_bad_call_shapes(tiny):
    engine = _engine(tiny)
    with pytest.raises(ValueError, match="prompts"):
        engine.sample("one string, not a list", GOOD)
    with pytest.raises(ValueError, match="params"):
        engine.sample(GOOD_IDS, {"n": 2})
    with pytest.raises(ValueError, match=r"prompts\[0\].*chat"):
        engine.sample([[1, 2]], SamplingParams(chat=True))
    assert len(engine.sample(GOOD_IDS, GOOD)) == 4


@pytest.mark.slow
def test_text_prompts(with_tokenizer):
    engine = _engine(with_tokenizer)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        engine.sample(["Hello there", ""], GOOD)
    with pytest.raises(ValueError, match=r"prompts\[0\] has \d+ tokens"):
        engine.sample([" word" * MAX_LEN], GOOD)
    out = engine.sample(["Hello there", [1, 2]], GOOD)
    assert out[0].prompt_token_ids == with_tokenizer.tokenizer("Hello there").input_ids
    assert all(isinstance(r.text, str) for r in out)
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots


# ---- failures after validation --------------------------------------------------------------------


def test_update_weights_rejects_bad_tensors_and_keeps_serving(tiny_dir):
    loaded = load_pretrained(str(tiny_dir), dtype="float32")  # its own copy: this test writes weights
    engine = _engine(loaded)
    before = _tokens(engine.sample(GOOD_IDS, GOOD))
    name = "model.layers.0.mlp.up_proj.weight"
    shape = loaded.model.hf_parameters()[name].shape
    bad_updates = [
        ([("model.layers.9.mlp.up_proj.weight", torch.zeros(shape))], "model.layers.9.mlp.up_proj.weight"),
        ([(name, torch.zeros(shape[0], shape[1] + 1))], rf"{name}.*shape"),
        ([(name, torch.full(shape, math.nan))], rf"{name}.*NaN"),
        # a good tensor before a bad one must not be applied either
        ([("model.norm.weight", torch.zeros(32)), (name, torch.full(shape, math.inf))], rf"{name}.*Inf"),
    ]
    for update, match in bad_updates:
        with pytest.raises(ValueError, match=match):
            engine.update_weights(update, version=1)
    with pytest.raises(ValueError, match="version"):
        engine.update_weights([(name, torch.zeros(shape))], version=0)
    assert engine.weight_version == 0
    assert _tokens(engine.sample(GOOD_IDS, GOOD)) == before


def test_failure_inside_prefill_releases_every_slot(tiny, monkeypatch):
    """Sequences admitted in a prefill that fails give their KV slots back."""
    engine = _engine(tiny)

    def boom(*args, **kwargs):
        raise RuntimeError("injected prefill failure")

    monkeypatch.setattr(engine.runner, "prefill", boom)
    with pytest.raises(RuntimeError, match="injected"):
        engine.sample(GOOD_IDS, GOOD)
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots


def test_failure_inside_decode_releases_every_slot(tiny, monkeypatch):
    engine = _engine(tiny, max_batch_size=2)
    calls = {"n": 0}
    step = engine.strategy.step

    def flaky(running):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected decode failure")
        return step(running)

    monkeypatch.setattr(engine.strategy, "step", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        engine.sample(GOOD_IDS, GOOD)
    assert engine.runner.cache.num_free == engine.runner.cache.num_slots
    monkeypatch.setattr(engine.strategy, "step", step)
    assert _tokens(engine.sample(GOOD_IDS, GOOD)) == _tokens(_engine(tiny).sample(GOOD_IDS, GOOD))
