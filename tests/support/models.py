"""Tiny random Llama / Qwen2 / Qwen3 checkpoints for tests: one builder, `build_tiny`; on top of it
`tiny_model` (built and loaded) and `tiny_pair` (a target and a noisy copy as its draft).

A tiny model is built by transformers from its own config class, initialised from a seed, saved with
`save_pretrained(safe_serialization=True)` and loaded back by our loader, so transformers' model is the
reference for logits and greedy generation. Two initialisations, both deterministic:

- `init="seeded"` (the default): every tensor re-drawn from a private generator (`randomize`), norms
  and biases included, so an ignored bias or q/k norm shows up.
- `init="transformers"`: transformers' own initialisation drawn from torch's global generator after
  `torch.manual_seed(seed)`. Older tests' thresholds (hit rates, measured KLs, chain lengths) were set
  on these models, so they keep them bit for bit; `tiny_pair`'s draft noise continues the same stream.
"""

from __future__ import annotations

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

INITS = ("seeded", "transformers")
TOKENIZERS = ("words", "smollm2")


def hf_config(family: str, vocab_size: int = 96, eos_token_id: Optional[int] = None, **overrides):
    """A tiny transformers config of `family` (no EOS and no BOS unless given): hidden 32, MLP 48,
    2 layers, 128 positions unless overridden."""
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


def build_tiny(directory: Path, family: str = "llama-gqa-untied", seed: int = 0, logit_scale: float = 1.0,
               init: str = "seeded", tokenizer: Optional[str] = None, **config_overrides):
    """Build, initialise and save a tiny transformers model in `directory`; returns the (float32, eval)
    transformers model. `config_overrides` go to `hf_config` (vocab_size, num_hidden_layers, ...).

    logit_scale: multiplies the LM head. With init="seeded" it needs untied embeddings; with
      init="transformers" it scales the head in place, so a tied model's input embedding scales too.
    tokenizer: None (ids only), "words" (a word-level tokenizer: "[UNK]" is id 0, "w<i>" is id i, and a
      chat template `w1 <content> w2` per message) or "smollm2" (SmolLM2's tokenizer: vocab_size 49152).
    """
    from transformers import AutoModelForCausalLM

    if init not in INITS:
        raise ValueError(f"init must be one of {INITS}, got {init!r}")
    if tokenizer is not None and tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be None or one of {TOKENIZERS}, got {tokenizer!r}")
    config = hf_config(family, **config_overrides)
    if init == "seeded":
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize(model, seed, logit_scale)
    else:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if logit_scale != 1.0:
            with torch.no_grad():
                model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(str(directory), safe_serialization=True)
    if tokenizer == "words":
        _words_tokenizer(config.vocab_size).save_pretrained(str(directory))
    elif tokenizer == "smollm2":
        from rollout_ssd.models.loader import gguf_tokenizer
        from rollout_ssd.models.registry import resolve_builtin

        gguf_tokenizer(resolve_builtin("smollm2-135m-instruct")).save_pretrained(str(directory))
    return model.eval()


def tiny_pair(directory: Path, vocab: int, seed: int = 0, draft_noise: float = 0.3, logit_scale: float = 8.0):
    """(target, draft) LoadedModels saved in directory/"target" and directory/"draft": a tiny Llama
    (transformers' init, sharpened head) and a noisy copy of it, each tensor plus draft_noise * its std
    * N(0, 1), so the draft agrees with the target often but not always (cache hits and misses both
    happen)."""
    from rollout_ssd.models.loader import load_pretrained

    model = build_tiny(directory / "target", seed=seed, logit_scale=logit_scale, init="transformers",
                       vocab_size=vocab, intermediate_size=64, max_position_embeddings=256)
    with torch.no_grad():  # torch's global generator, continuing from build_tiny's seed
        for p in model.parameters():
            p.add_(draft_noise * p.std() * torch.randn_like(p))
    model.save_pretrained(str(directory / "draft"), safe_serialization=True)
    return (load_pretrained(str(directory / "target"), dtype="float32"),
            load_pretrained(str(directory / "draft"), dtype="float32"))


def tiny_model(directory: Path, **build_kwargs):
    """`build_tiny`, then our loader on the checkpoint: (transformers model, float32 LoadedModel)."""
    from rollout_ssd.models.loader import load_pretrained

    model = build_tiny(directory, **build_kwargs)
    return model, load_pretrained(str(directory), dtype="float32")


def _words_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]"] + [f"w{i}" for i in range(1, vocab_size)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}"
    return fast

