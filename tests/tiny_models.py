"""Tiny random Llama / Qwen2 / Qwen3 checkpoints for tests, and the transformers references.

A tiny model is built by transformers from its own config class, re-initialised from a seeded
generator (every tensor, norms and biases included, so an ignored bias or q/k norm shows up), saved
with `save_pretrained(safe_serialization=True)` and loaded back by our loader. transformers' model is
then the reference for logits and greedy generation.

The SmolLM2 reference is transformers' own GGUF loader. It spends most of its ~30-90 s parsing the
GGUF metadata (twice), so it is loaded once per test process (`hf_default_model`).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional

import torch

# name -> (model_type, config overrides). Together they cover GQA and MHA, tied and untied embeddings,
# q/k/v biases (qwen2), per-head q/k norm and head_dim != hidden / heads (qwen3), and the static rope
# scalings (linear, llama3, yarn).
FAMILIES: dict[str, tuple[str, dict]] = {
    "llama-gqa-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mha-tied-linear": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0})),
    "llama-llama3": ("llama", dict(
        num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen2-bias-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3-qknorm-yarn": ("qwen3", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32})),
}


def hf_config(family: str, vocab_size: int = 96, eos_token_id: Optional[int] = None, **overrides):
    """A tiny transformers config of `family` (no EOS and no BOS unless given)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    model_type, family_kwargs = FAMILIES[family]
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[model_type]
    kwargs = dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  max_position_embeddings=128, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=eos_token_id,
                  pad_token_id=None)
    kwargs.update(family_kwargs)
    kwargs.update(overrides)
    return cls(**kwargs)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, logit_scale: float = 1.0) -> None:
    """Re-initialise every tensor from a seeded generator: weights ~ N(0, 1/fan_in) (embeddings N(0, 1)),
    norm weights 1 + N(0, 0.2^2), biases N(0, 0.2^2). `logit_scale` multiplies the LM head (a sharper
    or flatter next-token law)."""
    if getattr(model.config, "tie_word_embeddings", False) and logit_scale != 1.0:
        raise ValueError("logit_scale needs untied embeddings")
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            value = 1.0 + 0.2 * noise
        elif name.endswith(".bias"):
            value = 0.2 * noise
        elif "embed_tokens" in name:
            value = noise
        else:
            value = noise / math.sqrt(p.shape[-1])
            if name.startswith("lm_head"):
                value = value * logit_scale
        p.copy_(value.to(p.dtype))


def build_tiny(directory: Path, family: str, seed: int = 0, logit_scale: float = 1.0, **config_overrides):
    """Build, randomise and save a tiny transformers model; returns the (float32, eval) HF model."""
    from transformers import AutoModelForCausalLM

    config = hf_config(family, **config_overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model, seed, logit_scale)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max |ours - ref| / max |ref|, over every element compared."""
    ref = ref.double()
    return float((ours.double() - ref).abs().max() / ref.abs().max())


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits [T, V] for one unpadded sequence."""
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def hf_greedy(model, ids: list[int], max_new_tokens: int, eos_token_id=None, with_logits: bool = False):
    """transformers' greedy generate (batch 1, unpadded): the new tokens, and with_logits also their
    float32 logits [n, V]. eos_token_id=None: the model's generation config decides (a tiny model
    without EOS runs to max_new_tokens)."""
    kwargs = {} if eos_token_id is None else {"eos_token_id": eos_token_id}
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=with_logits, **kwargs)
    tokens = out.sequences[0, len(ids):].tolist()
    if not with_logits:
        return tokens
    return tokens, torch.cat(out.logits, dim=0).float()


@functools.cache
def hf_default_model():
    """transformers' own GGUF loading of the built-in SmolLM2 (float32, eval), once per process."""
    from transformers import AutoModelForCausalLM

    from rollout_ssd.models.registry import resolve_builtin

    path = resolve_builtin("smollm2-135m-instruct")
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
