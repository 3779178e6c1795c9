"""The rounding-error bound a correct attention kernel meets against float64, computed from the case.

Used by the kernel's tests (tests/test_tree_attention.py) and the attention backends' tests
(tests/test_attention_backends.py): every output element of a kernel computing softmax(q k^T s) v with
fp32 sums and P rounded to the cache dtype must lie within `attention_error_bound` of the float64
result. The bound depends on the inputs only, not on this CPU's SDPA or BLAS, so it means the same on
every machine.
"""

from __future__ import annotations

import torch

# An fp32 sum of n terms errs by lambda * sqrt(n) * u * sum |terms|: rounding errors modelled as
# independent and zero-mean grow like sqrt(n) (Higham & Mary, "A new approach to probabilistic
# rounding error analysis", SISC 2019), lambda standard deviations. The worst case n * u is never met
# by a real summation and would let a much less accurate kernel pass. With lambda = 2 the float32
# kernel reaches 0.09-0.17 of the bound here (torch's CPU SDPA 0.08-0.20 on an AVX-512 bf16 CPU), and
# fails it when shifted by 1e-6 or scaled by 1 + 32 eps: room for another summation order (BLAS, CPU
# kind), none for the bugs it guards against (TF32 products err by 2^-11 relative each, P rounded to
# 16 bits by 2^-9 B, hundreds of times the float32 terms).
LAMBDA = 2.0
# exp2 in float32 errs by a few ulp (PTX ex2.approx: 2 ulp; numpy's SIMD exp2 under the interpreter
# a few); allow 4 ulp = 8 u (u = eps / 2, the unit roundoff).
EXP2_U = 8.0


def attention_error_bound(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot: torch.Tensor,
                          visible: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected, bound), both [Nq, Hq, D] float64: the float64 attention output of each query over the
    keys `visible` [Nq, L] marks in its slot (q [Nq, Hq, D]; caches [S, Hkv, L, D]; slot [Nq]), and how
    far a correct kernel's output element may be from it, for caches of `dtype`.

    First order in the unit roundoffs u (fp32) and u16 (the cache dtype; 0 for float32), for one
    query head with fp64 scores s_j, weights w_j, max score m, output o (per element, like v_j):

      score s_j (D-term dot product, times a rounded scale, in fp32): lambda sqrt(D) u a_j + 2 u a_j,
        a_j = scale * sum_d |q_d k_jd|. The online softmax subtracts a running max <= m: u (m - s_j).
        exp2: EXP2_U u. A relative error e_j of weight j moves o by sum_j w_j e_j (v_j - o), so
        these give u [(lambda sqrt(D) + 2) A + C + EXP2_U K] with A = sum_j w_j a_j |v_j - o|,
        C = sum_j w_j (m - s_j) |v_j - o|, K = sum_j w_j |v_j - o| (the softmax's condition).
      P V and the row sum l (n visible keys; at most 2n roundings each: n adds, at most one rescale
        per block): lambda sqrt(2n) u (B + |o|) with B = sum_j w_j |v_j|; the final division: u |o|.
        The rescale factor 2^(m_old - m_new) multiplies P V and l alike, so its own error cancels.
      16-bit caches: q, k products are exact in fp32 (8+8 or 11+11 significand bits <= 24); P rounded
        to the cache dtype for P V: u16 B; the output rounded to it: u16 |o|. (fp16 subnormal P below
        2^-14 errs by at most 2^-25 absolute per key, under 1% of u16 B at these sizes: neglected.)
    """
    hq, head_dim = q.shape[1:]
    group = hq // k_cache.shape[1]
    u = torch.finfo(torch.float32).eps / 2
    u16 = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    scale = head_dim ** -0.5
    visible = visible[:, None, :]                                                        # [Nq, 1, L]
    q = q.double()
    k = k_cache[slot].double().repeat_interleave(group, dim=1)                          # [Nq, Hq, L, D]
    v = v_cache[slot].double().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,qhld->qhl", q, k) * scale
    s = s.masked_fill(~visible, float("-inf"))
    w = torch.softmax(s, dim=-1)                                                         # 0 where hidden
    o = torch.einsum("qhl,qhld->qhd", w, v)
    a = torch.einsum("qhd,qhld->qhl", q.abs(), k.abs()) * scale
    gap = torch.where(visible, s.amax(dim=-1, keepdim=True) - s, 0.0)                    # m - s_j
    spread = (v - o[:, :, None, :]).abs()                                                # |v_j - o|
    weighted = lambda x: torch.einsum("qhl,qhld->qhd", w * x, spread)  # noqa: E731
    big_a, big_c, big_k = weighted(a), weighted(gap), weighted(torch.ones_like(w))
    big_b = torch.einsum("qhl,qhld->qhd", w, v.abs())
    n = visible.sum(dim=-1, keepdim=True).double()                                       # [Nq, 1, 1]
    scores = (LAMBDA * head_dim ** 0.5 + 2) * big_a + big_c + EXP2_U * big_k
    sums = LAMBDA * (2 * n).sqrt() * (big_b + o.abs()) + o.abs()
    return o, u * (scores + sums) + u16 * (big_b + o.abs())
