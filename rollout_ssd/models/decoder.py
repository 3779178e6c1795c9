"""Our Llama-family decoder (Llama, Qwen2, Qwen3): GQA, RoPE, RMSNorm, SwiGLU, tied embeddings.

The arithmetic follows transformers' reference implementations op for op (RMSNorm in float32 then
cast back, cos/sin computed in float32 and cast to the model dtype, logits in the model dtype) so
float32 logits agree to rounding and bfloat16 ones to bfloat16 rounding.
Departures, for speed only: q/k/v and gate/up projections are fused into one matrix each; the HF
parameter names stay addressable as views into the fused tensors (`hf_parameters`), which is what
loaders and weight sync write into.

A forward takes new tokens per row (padded to T), their explicit positions, the KV slot each row
writes to and, optionally, a boolean mask over cache positions: that covers ragged prefill, decode,
multi-token verification and tree drafting with one code path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from rollout_ssd.kv_cache import KVCache
from rollout_ssd.models.attention import AttentionBackend, SDPABackend
from rollout_ssd.models.config import ModelConfig


@dataclass
class ForwardBatch:
    """Where a forward's new tokens go in the KV cache and what they may see.

    tokens, positions: [B, T] int64 (rows padded to T); num_new: [B] valid new tokens per row;
    slots: B slot ids; starts: B cache lengths before the forward (new tokens are written at
    starts[b] + t); mask: optional [B, T, L] bool over cache positions 0..L-1 (True = visible),
    L = max(starts[b] + num_new[b]); None means causal over the row's cache.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    num_new: list[int]
    slots: list[int]
    starts: list[int]
    mask: Optional[torch.Tensor] = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        p = lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)  # noqa: E731
        self.input_norm = p(h)
        self.post_attn_norm = p(h)
        self.wqkv = p(cfg.qkv_size, h)
        self.bqkv = p(cfg.qkv_size) if cfg.attention_bias else None
        self.wo = p(h, cfg.num_heads * d)
        self.q_norm = p(d) if cfg.qk_norm else None
        self.k_norm = p(d) if cfg.qk_norm else None
        self.w_gate_up = p(2 * cfg.intermediate_size, h)
        self.w_down = p(h, cfg.intermediate_size)

    def hf_parameters(self, prefix: str) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        out = {
            f"{prefix}.input_layernorm.weight": self.input_norm,
            f"{prefix}.post_attention_layernorm.weight": self.post_attn_norm,
            f"{prefix}.self_attn.q_proj.weight": self.wqkv[:nq],
            f"{prefix}.self_attn.k_proj.weight": self.wqkv[nq:nq + nkv],
            f"{prefix}.self_attn.v_proj.weight": self.wqkv[nq + nkv:],
            f"{prefix}.self_attn.o_proj.weight": self.wo,
            f"{prefix}.mlp.gate_proj.weight": self.w_gate_up[:inter],
            f"{prefix}.mlp.up_proj.weight": self.w_gate_up[inter:],
            f"{prefix}.mlp.down_proj.weight": self.w_down,
        }
        if self.bqkv is not None:
            out[f"{prefix}.self_attn.q_proj.bias"] = self.bqkv[:nq]
            out[f"{prefix}.self_attn.k_proj.bias"] = self.bqkv[nq:nq + nkv]
            out[f"{prefix}.self_attn.v_proj.bias"] = self.bqkv[nq + nkv:]
        if self.q_norm is not None:
            out[f"{prefix}.self_attn.q_norm.weight"] = self.q_norm
            out[f"{prefix}.self_attn.k_norm.weight"] = self.k_norm
        return out

    def forward(self, x, cos, sin, attend) -> torch.Tensor:
        cfg = self.cfg
        b, t, _ = x.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = F.linear(h, self.wqkv, self.bqkv)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = q.view(b, t, hq, d), k.view(b, t, hkv, d), v.view(b, t, hkv, d)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, self.k_norm, cfg.rms_norm_eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        attn = attend(q.transpose(1, 2), k, v)  # [B, Hq, T, D]
        x = x + F.linear(attn.transpose(1, 2).reshape(b, t, hq * d), self.wo)
        h = rms_norm(x, self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = F.linear(h, self.w_gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w_down)


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32, backend: Optional[AttentionBackend] = None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed = nn.Parameter(torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype), requires_grad=False)
        head_rows = cfg.head_vocab_size or cfg.vocab_size
        self.lm_head = (self.embed if cfg.tie_word_embeddings and cfg.head_vocab_size is None else
                        nn.Parameter(torch.zeros(head_rows, cfg.hidden_size, dtype=dtype), requires_grad=False))
        # Token id of each LM-head row (a draft's restricted head); None = the full vocabulary.
        self.head_token_ids = (nn.Parameter(torch.zeros(head_rows, dtype=torch.long), requires_grad=False)
                               if cfg.head_vocab_size is not None else None)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scaling = rope_scaling
        self.backend = backend or SDPABackend()
        self.scale = cfg.head_dim ** -0.5

    def hf_parameters(self) -> dict[str, torch.Tensor]:
        """HF parameter name -> tensor (a view into our fused storage; write with copy_)."""
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            out.update(layer.hf_parameters(f"model.layers.{i}"))
        if self.lm_head is not self.embed:
            out["lm_head.weight"] = self.lm_head
        if self.head_token_ids is not None:
            out["lm_head.token_ids"] = self.head_token_ids
        return out

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, D] in the model dtype for positions [B, T]."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)
        return cos[:, :, None, :], sin[:, :, None, :]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (after the final norm) -> float32 logits [..., V]. With a restricted head,
        tokens outside it get -inf, so the distribution is exactly what the head can sample."""
        head = F.linear(hidden, self.lm_head).float()
        if self.head_token_ids is None:
            return head
        full = head.new_full((*head.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_token_ids, head)

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run new tokens through the model, writing their K/V into `cache`.
        Returns the final-normed hidden states [B, T, H] (padded rows are garbage)."""
        b, t = batch.tokens.shape
        ends = [s + n for s, n in zip(batch.starts, batch.num_new)]
        if max(ends) > cache.max_len:
            raise ValueError(f"forward would write past the KV cache length {cache.max_len}")
        read_len = max(ends)
        # write indices: padded query rows go to the scratch slot
        ar = torch.arange(t)
        valid = ar[None, :] < torch.tensor(batch.num_new)[:, None]  # [B, T]
        write_slot = torch.where(valid, torch.tensor(batch.slots)[:, None], cache.scratch_slot)
        write_pos = torch.where(valid, torch.tensor(batch.starts)[:, None] + ar[None, :], ar[None, :])
        mask = batch.mask
        if mask is None:
            keys = torch.arange(read_len)
            mask = keys[None, None, :] <= (write_pos[:, :, None] * valid[:, :, None])
        else:
            mask = mask[:, :, :read_len] & valid[:, :, None]
        mask = mask.clone()
        mask[:, :, 0] |= ~valid  # padded queries see key 0 so softmax stays finite
        dense_mask = None if (t == 1 and len(set(ends)) == 1 and batch.mask is None) else mask[:, None]
        slots = batch.slots
        contiguous = slots == list(range(slots[0], slots[0] + b))

        def read(kv: torch.Tensor) -> torch.Tensor:
            if contiguous:
                return kv[slots[0]:slots[0] + b, :, :read_len]
            return kv.index_select(0, torch.tensor(slots))[:, :, :read_len]

        x = F.embedding(batch.tokens, self.embed)
        cos, sin = self.rope(batch.positions)
        for i, layer in enumerate(self.layers):
            kc, vc = cache.keys[i], cache.values[i]

            def attend(q, k, v, kc=kc, vc=vc):
                kc[write_slot, :, write_pos] = k
                vc[write_slot, :, write_pos] = v
                return self.backend(q, read(kc), read(vc), dense_mask, self.scale)

            x = layer(x, cos, sin, attend)
        for slot, end in zip(slots, ends):
            cache.lengths[slot] = end
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a KV cache (distillation). tokens [B, T] -> hidden [B, T, H]."""
        b, t = tokens.shape
        positions = torch.arange(t).expand(b, t)
        x = F.embedding(tokens, self.embed)
        cos, sin = self.rope(positions)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                  scale=self.scale, enable_gqa=True)

        for layer in self.layers:
            x = layer(x, cos, sin, attend)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)
