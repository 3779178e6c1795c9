"""Shared helpers for the SSD tests: tiny Llama pairs and SSD engines built through the public API."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig
from rollout_ssd.models.loader import load_pretrained


def tiny_pair(directory: Path, vocab: int, seed: int = 0, draft_noise: float = 0.3, logit_scale: float = 8.0):
    """(target, draft) LoadedModels: a random tiny Llama and a noisy copy of it (so the draft agrees with
    the target often but not always: both cache hits and misses happen)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=None, bos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(directory / "target")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(draft_noise * p.std() * torch.randn_like(p))
    model.save_pretrained(directory / "draft")
    return (load_pretrained(str(directory / "target"), dtype="float32"),
            load_pretrained(str(directory / "draft"), dtype="float32"))


def ssd_engine(target, draft, batch: int = 3, max_model_len: int = 128, **spec):
    """RolloutEngine(target, SpecConfig(method="ssd", **spec), ...) with the draft in process and the
    strategy rule off unless `spec` says otherwise (what these tests were written against)."""
    spec = {"worker": False, "strategy_rule": False, **spec}
    return RolloutEngine(target, SpecConfig(method="ssd", **spec),
                         EngineConfig(max_batch_size=batch, max_model_len=max_model_len), draft=draft)


def ar_engine(target, batch: int = 3, max_model_len: int = 128):
    return RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=batch,
                                                                      max_model_len=max_model_len))
