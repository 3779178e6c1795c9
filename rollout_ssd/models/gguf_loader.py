"""GGUF -> (transformers config, HF-named float32 state dict), dequantizing with the `gguf` package."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF's half-split layout)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_hf_config(reader):
    from transformers import AutoConfig

    arch = _field(reader, "general.architecture")
    if arch not in ARCH_TO_MODEL_TYPE:
        raise ValueError(f"GGUF general.architecture {arch!r} is not supported (supported: {sorted(ARCH_TO_MODEL_TYPE)})")
    f = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    names = {t.name for t in reader.tensors}
    vocab = f("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    heads = int(f("attention.head_count"))
    hidden = int(f("embedding_length"))
    kwargs = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(f("feed_forward_length")),
        num_hidden_layers=int(f("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(f("attention.head_count_kv", heads)),
        head_dim=int(f("attention.key_length", hidden // heads)),
        max_position_embeddings=int(f("context_length", 2048)),
        rms_norm_eps=float(f("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        rope_parameters={"rope_type": "default", "rope_theta": float(f("rope.freq_base", 10000.0))},
    )
    scaling = f("rope.scaling.type")
    if scaling == "linear":
        kwargs["rope_parameters"].update(rope_type="linear", factor=float(f("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF {arch}.rope.scaling.type {scaling!r} is not supported")
    return AutoConfig.for_model(ARCH_TO_MODEL_TYPE[arch], **kwargs)


def load_gguf(path: Path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    hf_config = gguf_hf_config(reader)
    permute = hf_config.model_type == "llama"
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        match = BLOCK_RE.match(tensor.name)
        if match:
            suffix = BLOCK_NAMES.get(match.group(2))
            hf_name = suffix and f"model.layers.{match.group(1)}.{suffix}"
        else:
            hf_name = TENSOR_NAMES.get(tensor.name)
        if hf_name is None:
            if tensor.name == "rope_freqs.weight":
                raise ValueError("GGUF rope_freqs (llama3-style rope scaling) is not supported yet")
            raise ValueError(f"GGUF tensor {tensor.name!r} has no known HF name")
        w = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        if permute and match and match.group(2) in ("attn_q.weight", "attn_q.bias"):
            w = _unpermute(w, hf_config.num_attention_heads)
        elif permute and match and match.group(2) in ("attn_k.weight", "attn_k.bias"):
            w = _unpermute(w, hf_config.num_key_value_heads)
        state[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return hf_config, state
