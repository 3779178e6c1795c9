"""Triton span attention: each query attends to a few half-open intervals of its KV slot.

Two entry points over one kernel. `span_attention` takes the per-query spans directly, as device
tensors, with no host read: models/attention.py's "triton" backend calls it for decode (one span
[0, start + 1)), verify (query i of a row sees [0, start + i + 1)) and SSD's tree steps (the prefix
and each of the branch's own tokens). `tree_attention_triton` takes a `TreeAttentionMetadata`
(reference.py: prefix, glue up to the fork depth, own branch), validated on the host. The tests run
the kernel under Triton's CPU interpreter against a float64 reference.

One program per (query, kv head) computes the g = Hq / Hkv query heads that share the kv head as the
rows of one tile, so each key block is loaded once per GQA group. It walks only the keys the query
sees: its NUM_SPANS spans (empty ones cost nothing), in blocks of BLOCK_N, with the online softmax of
flash attention (running max m, running sum l, rescaled accumulator):

    m' = max(m, max_j s_j);  l' = l * 2^(m - m') + sum_j 2^(s_j - m');  acc' = acc * 2^(m - m') + P V

Both products run in the cache dtype with fp32 sums (IEEE for fp32 inputs, never TF32); scores are
kept in log2 units (scale * log2 e folded into one multiply) and P is rounded to the cache dtype for
P V, as in flash attention. Masked blocks are never loaded: the kernel walks only the spans, so only
a span's last block is partial. A query's result depends only on its own keys, not on the batch
around it or on Nq. The grid is fixed by (Nq, Hkv) and the spans are read from device memory, so a
launch with the same shapes can be captured in a CUDA graph and replayed with new spans.

Interpreter (CPU): run with TRITON_INTERPRET=1 set before triton is first imported in the process.
Triton reads the variable when a function is wrapped by `triton.jit`, not at launch, and triton.language
wraps its own helpers (tl.zeros, tl.max, tl.sum, ...) at import; setting it later leaves compiled
helpers that cannot run on CPU tensors. The launcher raises a ValueError saying so, as it does when
the kernel and triton.language disagree (the variable set between importing triton and this file).
The interpreter's tl.dot multiplies bfloat16 bit patterns (triton-lang/triton#11584, unsupported
upstream), and its fp32 -> bfloat16 cast truncates where the GPU rounds to nearest. So for bfloat16
under the interpreter (EMULATE_BF16) the operands go to fp32 (exact), P is rounded to bfloat16
precision to nearest even by bit arithmetic, and the output is written in fp32 for torch to round:
the same arithmetic as tensor cores, so the interpreter still tests the GPU numerics.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rollout_ssd.kernels.reference import check_shapes

_LOG2_E = 1.4426950408889634


@triton.jit
def _tree_attention_fwd(
    Q, K, V, Out, Slot, Spans,
    qk_scale,                                       # sm_scale * log2(e)
    stride_qn, stride_qh,
    stride_ks, stride_kh, stride_kl,
    stride_vs, stride_vh, stride_vl,
    stride_on, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPANS: tl.constexpr, DOT_PRECISION: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    query = tl.program_id(0)
    kv_head = tl.program_id(1)
    slot = tl.load(Slot + query).to(tl.int64)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(Q + query.to(tl.int64) * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)          # [BLOCK_H, BLOCK_D]
    if EMULATE_BF16:
        q = q.to(tl.float32)

    k_base = K + slot * stride_ks + kv_head.to(tl.int64) * stride_kh
    v_base = V + slot * stride_vs + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    for span in tl.static_range(NUM_SPANS):
        lo = tl.load(Spans + query * (2 * NUM_SPANS) + 2 * span)
        hi = tl.load(Spans + query * (2 * NUM_SPANS) + 2 * span + 1)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < hi
            k = tl.load(k_base + offs_n[None, :].to(tl.int64) * stride_kl + offs_d[:, None],
                        mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
            if EMULATE_BF16:
                k = k.to(tl.float32)
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale     # [BLOCK_H, BLOCK_N]
            s = tl.where(mask_n[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))                       # finite: start < hi
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vl + offs_d[None, :],
                        mask=mask_n[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
            if EMULATE_BF16:  # round P to bfloat16 precision, to nearest even, kept in fp32
                bits = p.to(tl.uint32, bitcast=True)
                bits = bits + 0x7FFF + ((bits >> 16) & 1)
                p = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
                v = v.to(tl.float32)
            else:
                p = p.to(V.dtype.element_ty)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
            m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + query.to(tl.int64) * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])


def _is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                          sm_scale: float | None = None, block_n: int = 64) -> torch.Tensor:
    """Tree attention with the Triton kernel: q [Nq, Hq, D] -> out [Nq, Hq, D] in q's dtype.

    k_cache, v_cache [S, Hkv, Lmax, D] with a contiguous last dim; meta a TreeAttentionMetadata from
    reference.py (anything with `.slot` [Nq], `.key_spans()` [Nq, 3, 2], `.num_slots`, `.max_key_end`)
    on q's device; sm_scale defaults to 1/sqrt(D); block_n keys per block (a power of 2, >= 16).
    """
    _check_shapes(q, k_cache, v_cache)
    if q.device != meta.slot.device:
        raise ValueError("meta: q, caches and metadata must be on one device")
    if meta.num_queries != q.shape[0] or meta.num_slots > k_cache.shape[0] or meta.max_key_end > k_cache.shape[2]:
        raise ValueError(f"meta: {meta.num_queries} queries over {meta.num_slots} slots x "
                         f"{meta.max_key_end} keys; q has {q.shape[0]}, cache {k_cache.shape[0]} x {k_cache.shape[2]}")
    return span_attention(q, k_cache, v_cache, meta.slot, meta.key_spans(), sm_scale, block_n)


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    check_shapes(q, k_cache, v_cache)
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (
            torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q: dtypes {q.dtype}, {k_cache.dtype}, {v_cache.dtype}; "
                         f"need one of float16, bfloat16, float32 for all three")
    if not (q.device == k_cache.device == v_cache.device):
        raise ValueError("q: q and caches must be on one device")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache: the head dim of both caches must be contiguous")


def span_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                   spans: torch.Tensor, sm_scale: float | None = None, block_n: int = 64) -> torch.Tensor:
    """Query i attends to the keys of slot[i] in spans[i]: q [Nq, Hq, D] -> out [Nq, Hq, D] in q's dtype.

    k_cache, v_cache [S, Hkv, Lmax, D] (head dim contiguous); slot [Nq] int; spans [Nq, NS, 2] int,
    half-open (start, end) per span, ordered and disjoint, empty spans allowed (start == end), every
    query with at least one key, every end <= Lmax. Shapes are checked, values are not (that would read
    them back to the host): a span past the cache reads out of bounds. sm_scale defaults to 1/sqrt(D);
    block_n keys per block (a power of 2, >= 16).
    """
    _check_shapes(q, k_cache, v_cache)
    nq, hq, d = q.shape
    hkv = k_cache.shape[1]
    if slot.shape != (nq,) or spans.dim() != 3 or spans.shape[0] != nq or spans.shape[2] != 2:
        raise ValueError(f"spans: expected slot [Nq] and spans [Nq, NS, 2] for Nq={nq}, got "
                         f"{tuple(slot.shape)} and {tuple(spans.shape)}")
    if slot.device != q.device or spans.device != q.device:
        raise ValueError("spans: q, caches, slot and spans must be on one device")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n: {block_n} is not a power of 2 >= 16")
    q = q if q.stride(-1) == 1 else q.contiguous()
    interpreted = _is_interpreted(_tree_attention_fwd)
    if interpreted != _is_interpreted(tl.zeros):
        raise ValueError("TRITON_INTERPRET: changed after triton was imported, so only part of Triton "
                         "is interpreted; set it before triton is first imported in this process")
    if q.device.type == "cpu" and not interpreted:
        raise ValueError("q: CPU tensors need the Triton interpreter; set TRITON_INTERPRET=1 before "
                         "triton is first imported in this process")
    # The interpreter's fp32 -> bfloat16 cast truncates (the GPU rounds to nearest): let torch round.
    emulate_bf16 = interpreted and q.dtype == torch.bfloat16
    out = torch.empty(q.shape, dtype=torch.float32 if emulate_bf16 else q.dtype, device=q.device)
    if nq == 0:
        return out.to(q.dtype)
    slot = slot.to(torch.int32).contiguous()
    spans = spans.to(torch.int32).contiguous()
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    group = hq // hkv
    _tree_attention_fwd[(nq, hkv)](
        q, k_cache, v_cache, out, slot, spans,
        scale * _LOG2_E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=block_n,
        NUM_SPANS=spans.shape[1],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32: unused by 16-bit operands
        EMULATE_BF16=emulate_bf16,
        num_warps=4,
    )
    return out if out.dtype == q.dtype else out.to(q.dtype)
