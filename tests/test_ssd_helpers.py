"""Shared helpers for the SSD tests: tiny Llama pairs and an engine running SSDDecode."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout_ssd import EngineConfig, RolloutEngine, SpecConfig
from rollout_ssd.models.loader import load_pretrained
from rollout_ssd.ssd.config import SSDConfig
from rollout_ssd.ssd.decode import SSDDecode


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


def ssd_engine(target, draft, config: SSDConfig, batch: int = 3, max_model_len: int = 128, backup=None):
    """An engine whose decode strategy is SSDDecode (built the way engine._make_strategy should)."""
    engine = RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=batch,
                                                                        max_model_len=max_model_len))
    engine.strategy = SSDDecode(engine.runner, draft.model, config, engine.stats, backup=backup)
    return engine


def ar_engine(target, batch: int = 3, max_model_len: int = 128):
    return RolloutEngine(target, SpecConfig(method="ar"), EngineConfig(max_batch_size=batch,
                                                                      max_model_len=max_model_len))
