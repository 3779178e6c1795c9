"""Our Llama-family decoder (Llama, Qwen2, Qwen3): GQA, RoPE, RMSNorm, SwiGLU, tied embeddings.

The arithmetic follows transformers' reference implementations op for op (RMSNorm in float32 then
cast back, cos/sin computed in float32 and cast to the model dtype, logits in the model dtype) so
float32 logits agree to rounding and bfloat16 ones to bfloat16 rounding.
Departures, for speed only: q/k/v and gate/up projections are fused into one matrix each; the HF
parameter names stay addressable as views into the fused tensors (`hf_parameters`), which is what
loaders and weight sync write into, and RoPE is applied to the fused q|k block at once (bitwise HF's
rotate_half form). How the matmuls run on the machine found (weight layouts, GEMM forms, row padding)
is cpu_backend.py's choice, behind `layer_weight`, `linear` and `head_matmul`: those change float32
logits only at rounding level.

A forward takes new tokens per row (padded to T), their explicit positions, the KV slot each row
writes to and, optionally, what each query sees (a boolean mask over cache positions, or key spans):
that covers ragged prefill, decode, multi-token verification and tree drafting with one code path.
How attention reads the keys is the backend's (models/attention.py): the forward writes the new K/V
and describes the layout once (`KeyLayout`); SDPA builds a dense mask from it, the Triton backend
per-query key spans.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rollout_ssd.kv_cache import KVCache
from rollout_ssd.models import cpu_backend
from rollout_ssd.models.attention import AttentionBackend, KeyLayout, SDPABackend
from rollout_ssd.models.config import ModelConfig
from rollout_ssd.models.cpu_backend import head_matmul, layer_weight, linear
from rollout_ssd.models.weight_copies import WeightCopies


@dataclass
class ForwardBatch:
    """Where a forward's new tokens go in the KV cache and what they may see.

    tokens, positions: [B, T] int64 (rows padded to T); num_new: [B] valid new tokens per row;
    slots: B slot ids; starts: B cache lengths before the forward (new tokens are written at
    starts[b] + t); mask: optional [B, T, L] bool over cache positions 0..L-1 (True = visible),
    L = max(starts[b] + num_new[b]); spans: optional [B, T, S, 2] int, the same as half-open key spans
    per query (ordered, disjoint; empty ones allowed), which the Triton backend reads without a mask.
    Neither means causal over the row's cache.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    num_new: list[int]
    slots: list[int]
    starts: list[int]
    mask: Optional[torch.Tensor] = None
    spans: Optional[torch.Tensor] = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, cast back to x's dtype, times the weight (the one place the
    form is chosen). The float32 normalisation is torch's `F.rms_norm` without a weight: one call in
    place of five ops (on CUDA torch's fused kernel), bitwise the written-out ops on a CPU
    (tests/test_fused_ops.py); on a GPU its reduction order may differ from `mean`'s in the last float32
    bit, which bench/gpu_check.py's `fused` part counts. The weight multiply stays after the cast, HF's
    rounding order: `F.rms_norm` given a 16-bit weight multiplies before casting, one rounding where HF
    has two, which is not HF's bits. In float32 the cast is a no-op, so the weight goes inside."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with signed_sin = cat(-sin[:D/2], sin[D/2:]): rotate_half(x) is
    roll(x, D/2) with the sign moved onto sin, and (-a) * b == a * (-b) exactly, so the result is
    bitwise HF's in one copy instead of four."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        p = lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=dtype), requires_grad=False)  # noqa: E731
        self.input_norm = p(h)
        self.post_attn_norm = p(h)
        self.wqkv = layer_weight(cfg.qkv_size, h, dtype)
        self.bqkv = p(cfg.qkv_size) if cfg.attention_bias else None
        self.wo = layer_weight(h, cfg.num_heads * d, dtype)
        self.q_norm = p(d) if cfg.qk_norm else None
        self.k_norm = p(d) if cfg.qk_norm else None
        self.w_gate_up = layer_weight(2 * cfg.intermediate_size, h, dtype)
        self.w_down = layer_weight(h, cfg.intermediate_size, dtype)
        self.row_major = WeightCopies()

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

    def forward(self, x, cos, signed_sin, attend) -> torch.Tensor:
        """x [B, T, H]; cos, signed_sin [B, T, 1, D] (Decoder.rope_tables); attend(q [B, Hq, T, D],
        k [B, T, Hkv, D], v [B, T, Hkv, D]) -> [B, Hq, T, D]. Returns [B, T, H]."""
        cfg = self.cfg
        b, t, _ = x.shape
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = rms_norm(x, self.input_norm, cfg.rms_norm_eps)
        qkv = linear(h, self.wqkv, self.row_major, "wqkv", self.bqkv).view(b, t, hq + 2 * hkv, d)
        if self.q_norm is not None:
            q = apply_rope(rms_norm(qkv[:, :, :hq], self.q_norm, cfg.rms_norm_eps), cos, signed_sin)
            k = apply_rope(rms_norm(qkv[:, :, hq:hq + hkv], self.k_norm, cfg.rms_norm_eps), cos, signed_sin)
        else:  # q and k are adjacent heads of qkv: one rope over both
            q, k = apply_rope(qkv[:, :, :hq + hkv], cos, signed_sin).split([hq, hkv], dim=2)
        v = qkv[:, :, hq + hkv:]
        attn = attend(q.transpose(1, 2), k, v)  # [B, Hq, T, D]
        x = x + linear(attn.transpose(1, 2).reshape(b, t, hq * d), self.wo, self.row_major, "wo")
        h = rms_norm(x, self.post_attn_norm, cfg.rms_norm_eps)
        gate, up = linear(h, self.w_gate_up, self.row_major, "w_gate_up").chunk(2, dim=-1)
        return x + linear(F.silu(gate) * up, self.w_down, self.row_major, "w_down")


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0,
                 dtype: torch.dtype = torch.float32, backend: Optional[AttentionBackend] = None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        # row-major, unlike the layers' matrices: row lookups stay contiguous, and the LM head's GEMM
        # form per row count is the CPU backend's (`head_matmul`)
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
        self.copies = WeightCopies()  # the head's column-major copy (cpu_backend.head_matmul)

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

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed_sin [B, T, 1, D] for `apply_rope` (signed_sin = cat(-sin[:D/2], sin[D/2:]))."""
        cos, sin = self.rope(positions)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (after the final norm) -> float32 logits [..., head rows]: one per row of the
        LM head, i.e. over `head_token_ids` for a restricted head, else over the vocabulary. The GEMM
        form is the CPU backend's choice for the row count (`cpu_backend.head_matmul`)."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # [M, H]
        head = head_matmul(rows, self.lm_head, self.copies)
        return head.float().reshape(*hidden.shape[:-1], head.shape[-1])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (after the final norm) -> float32 logits [..., V]. With a restricted head,
        tokens outside it get -inf, so the distribution is exactly what the head can sample."""
        head = self.head_logits(hidden)
        if self.head_token_ids is None:
            return head
        full = head.new_full((*head.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.head_token_ids, head)

    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Run new tokens through the model, writing their K/V into `cache`.
        Returns the final-normed hidden states [B, T, H] (padded rows are garbage).

        Rows run sorted by slot (every op here is row-wise, so the order changes no bit), which makes
        a batch holding a contiguous range of slots, in any order, read its cache as a view; other
        batches gather their slots once per layer, after cutting the cache to the read length."""
        b, t = batch.tokens.shape
        ends = [s + n for s, n in zip(batch.starts, batch.num_new)]
        if max(ends) > cache.max_len:
            raise ValueError(f"forward would write past the KV cache length {cache.max_len}")
        dev = batch.tokens.device  # every index and mask is made here, next to the weights
        order = sorted(range(b), key=batch.slots.__getitem__)
        if order != list(range(b)):
            rows = torch.tensor(order, device=dev)
            pick = lambda x: None if x is None else x[rows]  # noqa: E731
            sorted_batch = ForwardBatch(
                pick(batch.tokens), pick(batch.positions), [batch.num_new[i] for i in order],
                [batch.slots[i] for i in order], [batch.starts[i] for i in order], pick(batch.mask), pick(batch.spans))
            return self.forward(sorted_batch, cache)[torch.argsort(rows)]
        slots, starts = batch.slots, batch.starts
        contiguous = slots == list(range(slots[0], slots[0] + b))
        if cpu_backend.one_call_layers(self, batch, cache, contiguous):  # a few causal tokens of a bf16 CPU model
            x = F.embedding(batch.tokens, self.embed)
            x = cpu_backend.forward_one_call_layers(self, x, *self.rope_tables(batch.positions), batch, cache, max(ends))
            return self._finish(x, slots, ends, cache)
        # one contiguous block of new entries: every row writes t tokens at the same position
        block_write = contiguous and len(set(starts)) == 1 and all(n == t for n in batch.num_new)
        # one token per row, every row ending at one length, nothing given: every query sees every key
        every_key = t == 1 and len(set(ends)) == 1 and batch.mask is None and batch.spans is None
        write_pos = valid = None
        if not every_key:  # write indices: padded query rows go to the scratch slot
            ar = torch.arange(t, device=dev)
            valid = ar[None, :] < torch.tensor(batch.num_new, device=dev)[:, None]  # [B, T]
            write_slot = torch.where(valid, torch.tensor(slots, device=dev)[:, None], cache.scratch_slot)
            write_pos = torch.where(valid, torch.tensor(starts, device=dev)[:, None] + ar[None, :], ar[None, :])
        elif not block_write:
            write_slot = torch.tensor(slots, device=dev)[:, None]
            write_pos = torch.tensor(starts, device=dev)[:, None]
        layout = KeyLayout(slots, contiguous, max(ends), None if every_key else write_pos, valid, batch.mask,
                           batch.spans, dev)
        keys = self.backend.prepare(layout)
        lo, hi, start = slots[0], slots[0] + b, starts[0]

        def write(kc: torch.Tensor, k: torch.Tensor) -> None:  # k [B, T, Hkv, D]
            if block_write:
                kc[lo:hi, :, start:start + t] = k.transpose(1, 2)
            else:  # (a float32 cache of a bf16 model, attention.cache_dtype: k widened exactly)
                kc[write_slot, :, write_pos] = k.to(kc.dtype)

        x = F.embedding(batch.tokens, self.embed)
        cos, signed_sin = self.rope_tables(batch.positions)
        for i, layer in enumerate(self.layers):
            kc, vc = cache.keys[i], cache.values[i]

            def attend(q, k, v, kc=kc, vc=vc):
                write(kc, k)
                write(vc, v)
                return self.backend(q, kc, vc, keys, self.scale)

            x = layer(x, cos, signed_sin, attend)
        return self._finish(x, slots, ends, cache)

    def _finish(self, x: torch.Tensor, slots: list[int], ends: list[int], cache: KVCache) -> torch.Tensor:
        """The rows' new cache lengths recorded; the final norm of the last layer's output."""
        for slot, end in zip(slots, ends):
            cache.lengths[slot] = end
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def forward_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """Plain causal forward without a KV cache (distillation). tokens [B, T] -> hidden [B, T, H]."""
        last = deque(self.layer_outputs(tokens), maxlen=1)  # the last layer's output (none without layers)
        x = last[0][1] if last else F.embedding(tokens, self.embed)
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def layer_outputs(self, tokens: torch.Tensor, layers: Optional[Sequence[int]] = None):
        """`forward_train`'s causal pass through `layers` (indices run in that order; None: all), yielding
        (index, residual stream [B, T, H] after that layer, before the final norm): for probes that read a
        layer's state or run the model with layers left out."""
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        x = F.embedding(tokens, self.embed)
        cos, signed_sin = self.rope_tables(positions)

        def attend(q, k, v):
            return F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                                  scale=self.scale, enable_gqa=True)

        for i in range(len(self.layers)) if layers is None else layers:
            x = self.layers[i](x, cos, signed_sin, attend)
            yield i, x
