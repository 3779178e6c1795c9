"""The decoder's own config, derived from a transformers config (the source of truth for a family).

Supported families: Llama (and SmolLM, Mistral-style dense models under model_type "llama"), Qwen2
(q/k/v biases) and Qwen3 (per-head q/k RMSNorm). RoPE inverse frequencies come from transformers'
own rope initialisers, so every scaling variant it knows (linear, llama3, yarn) is computed the same
way; variants whose frequencies depend on the running sequence length (dynamic, longrope) are refused
because a KV cache written under one set of frequencies cannot be read under another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]
    # Drafts only: the LM head covers `head_vocab_size` token ids (stored as lm_head.token_ids), and
    # the input embedding is the target's, shared at load time rather than stored.
    head_vocab_size: Optional[int] = None
    shares_target_embedding: bool = False

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads {self.num_kv_heads}")

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def model_config_from_hf(hf_config) -> ModelConfig:
    """Read what the decoder needs from a transformers PretrainedConfig."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
    _refuse_sliding_window(hf_config)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    eos = _eos_ids(getattr(hf_config, "eos_token_id", None))
    gen_cfg_eos = getattr(hf_config, "_extra_eos_token_ids", None)
    if gen_cfg_eos:
        eos = tuple(dict.fromkeys(eos + _eos_ids(gen_cfg_eos)))
    return ModelConfig(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_norm=model_type == "qwen3",
        max_position_embeddings=hf_config.max_position_embeddings,
        bos_token_id=getattr(hf_config, "bos_token_id", None),
        eos_token_ids=eos,
        head_vocab_size=getattr(hf_config, "head_vocab_size", None),
        shares_target_embedding=bool(getattr(hf_config, "shares_target_embedding", False)),
    )


def _refuse_sliding_window(hf_config) -> None:
    """Sliding-window layers (Qwen2/Qwen3 with use_sliding_window) are not implemented: refuse them
    rather than silently attending over the whole context."""
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        sliding = any(t != "full_attention" for t in layer_types)
    else:
        sliding = bool(getattr(hf_config, "use_sliding_window", False))
    if sliding and getattr(hf_config, "sliding_window", None):
        raise ValueError(
            f"config.use_sliding_window / layer_types: sliding-window attention (window "
            f"{hf_config.sliding_window}) is not supported; only full attention is"
        )


def rope_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling) from transformers' rope initialisers."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"config.rope_parameters.rope_type {rope_type!r} is not supported (supported: {STATIC_ROPE_TYPES})"
        )
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)
