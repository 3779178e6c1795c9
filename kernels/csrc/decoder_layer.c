/* One decoder layer of a bf16 Llama-family model (Llama, Qwen2, Qwen3) for a few rows, in one call.

   Why: at one to a few tokens a step, a layer's four linears read its weights at memory speed (the bf16
   rows kernel, bf16_rows.c) and everything between them is a few thousand floats of arithmetic, yet in
   eager PyTorch that arithmetic is some twenty ops a layer (RMSNorm's five, RoPE's, the cache writes,
   SwiGLU's, the residual adds), each a dispatch of microseconds: about a third of a batch-1 decode step
   of SmolLM2-135M (bench/RESULTS.md, "Where an eager step's time goes"). Here the layer runs as one C
   call: the linears on the rows kernel, the attention on the few-query kernel (few_attention.c), and the
   small ops in between as plain loops over the rows.

   The arithmetic is the eager decoder's (models/decoder.py, transformers' rounding order) op for op, in
   float32 between bf16 roundings:
     h    = bf16(w_in * bf16(x * rsqrt(mean(x^2) + eps)))            RMSNorm: float32, cast, times the weight
     qkv  = h @ Wqkv^T (+ bias)                                        rows kernel, one bf16 rounding
     q, k = RMSNorm per head (qk_norm, Qwen3), then
            bf16(bf16(x * cos) + bf16(roll(x, D/2) * signed_sin))     RoPE, three roundings as three bf16 ops
     the new k, v written to the cache at each row's positions (widened exactly into a float32 cache)
     a    = attention over the row's visible keys                     few_attention.c, float32 inside
     x    = bf16(x + a @ Wo^T)
     h    = RMSNorm(x);  g, u = h @ Wgu^T
     x    = bf16(x + bf16(bf16(silu(g)) * u) @ Wdown^T)
   It differs from the eager ops only where two float32 computations of one value differ in their last
   bits (the sum of squares' order; SiLU's exponential, few_attention.c's polynomial against PyTorch's)
   and that difference crosses a bf16 rounding boundary (tests/test_layer_kernel.py bounds the effect on
   the logits). From GLUE_PARALLEL_ROWS tokens the arithmetic between the linears runs on every thread.

   Shapes (element strides, row-major, contiguous unless said):
     x       bf16 [m, H], m = b * t tokens (row i's token j at i * t + j), updated in place
     cos, ss bf16 [m, D]: RoPE's cos and signed sin per token
     kc, vc  bf16 (kv_f32 = 0) or float32 (kv_f32 = 1) caches at the batch's first slot, strides (slot, head,
             position) = cs[0..2], D contiguous; row i is slot i past the first
     starts, num_new [b]: the row's cache length before the step and its real tokens (the rest padding:
             not written, their outputs unused)
     mask    uint8 [b, t, l] (nonzero: visible) or NULL (every query sees keys 0..l-1)
     packed weights in bf16_rows.c's layout, or (an int4 draft's, `scales` given: their four scale arrays)
             int4_rows.c's codes; bias float32 [qkv] or NULL; q_norm, k_norm bf16 [D] or NULL.
   Returns 0, or -1 where scratch memory could not be allocated (then x may be incomplete; the cache holds
   no unset values: a failure before the writes returns before them, later ones write computed keys). */

#include "bf16_rows.c"
#include "few_attention.c"
#include "int4_rows.c"

/* One linear: over int4 codes where the weight has scales (an int4 draft's, int4_rows.c), else bf16. */
static int linear_any(const uint16_t *x, long m, long k, const void *w, const uint16_t *scales, long n,
                      const float *bias, uint16_t *out, int threads) {
#if defined(__AVX512BF16__)
    if (scales) return int4_rows_linear(x, m, k, (const uint8_t *)w, scales, n, bias, out, threads);
#endif
    if (scales) return -2;  /* no int4 kernel in this build: the caller never passes scales to it */
    return ROWS_LINEAR(x, m, k, (const uint16_t *)w, n, bias, out, threads);
}

static inline uint16_t bmul(uint16_t a, uint16_t b) { return f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b)); }

/* From this many rows (tokens) a step, the row-wise arithmetic between the linears (RMSNorm, RoPE, SwiGLU,
   the residual adds) is shared among the threads: each row's arithmetic is the same whichever thread does
   it, so the results do not depend on the thread count. Below it one thread does it (waking the others
   costs more than a few rows' arithmetic). */
#define GLUE_PARALLEL_ROWS 4

/* o = RMSNorm(x) for one vector of n (o may be x) */
static void rms_row(const uint16_t *x, long n, const uint16_t *w, float eps, uint16_t *o) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < n; i++) {
        float v = bf16_to_f32(x[i]);
        ss += v * v;
    }
    float inv = 1.0f / sqrtf(ss / (float)n + eps);
#pragma omp simd
    for (long i = 0; i < n; i++) o[i] = bmul(w[i], f32_to_bf16(bf16_to_f32(x[i]) * inv));
}

/* out[r] = RMSNorm(x[r]) for `rows` vectors of n at stride `stride` (in and out alike) */
static void rms_rows(const uint16_t *x, long rows, long n, long stride, const uint16_t *w, float eps,
                     uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= GLUE_PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) rms_row(x + r * stride, n, w, eps, out + r * stride);
}

/* RoPE over `heads` vectors of d (in place) with one token's cos and signed sin */
static void rope_heads(uint16_t *x, long heads, long d, const uint16_t *cos, const uint16_t *ss) {
    const long half = d / 2;
    float rot[d];
    for (long h = 0; h < heads; h++) {
        uint16_t *v = x + h * d;
        for (long i = 0; i < d; i++) rot[i] = bf16_to_f32(v[i < half ? i + half : i - half]);
#pragma omp simd
        for (long i = 0; i < d; i++) {
            uint16_t a = f32_to_bf16(bf16_to_f32(v[i]) * bf16_to_f32(cos[i]));
            uint16_t b = f32_to_bf16(rot[i] * bf16_to_f32(ss[i]));
            v[i] = f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b));
        }
    }
}

static inline void store_row(void *cache, int f32, long off, const uint16_t *src, long d) {
    if (f32) {
        float *dst = (float *)cache + off;
        for (long i = 0; i < d; i++) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy((uint16_t *)cache + off, src, (size_t)d * sizeof(uint16_t));
    }
}

static inline void add_rows(uint16_t *x, const uint16_t *y, long rows, long n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows >= GLUE_PARALLEL_ROWS)
    for (long r = 0; r < rows; r++) {
        uint16_t *xr = x + r * n;
        const uint16_t *yr = y + r * n;
#pragma omp simd
        for (long i = 0; i < n; i++) xr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(yr[i]));
    }
}

int decoder_layer(uint16_t *x, long b, long t, long hidden, long hq, long hkv, long d, long inter,
                  const uint16_t *norm_in, const uint16_t *norm_post, const uint16_t *q_norm, const uint16_t *k_norm,
                  const void *wqkv, const float *bqkv, const void *wo, const void *wgu, const void *wdown,
                  const uint16_t *const *scales, const uint16_t *cos, const uint16_t *ss, void *kc, void *vc, int kv_f32,
                  const long *cs, const long *starts, const long *num_new, const uint8_t *mask, long l,
                  float eps, float scale, int threads) {
    const long m = b * t, heads = hq + 2 * hkv, nqkv = heads * d, nq = hq * d;
    const long scratch = hidden + nqkv + 2 * nq + 2 * inter + inter + hidden;  /* per token, bf16 */
    uint16_t *buf = (uint16_t *)malloc((size_t)m * (size_t)scratch * sizeof(uint16_t));
    if (!buf) return -1;
    uint16_t *h = buf, *qkv = h + m * hidden, *q = qkv + m * nqkv, *att = q + m * nq, *gu = att + m * nq,
             *act = gu + m * 2 * inter, *y = act + m * inter;
    int failed = 0;

    rms_rows(x, m, hidden, hidden, norm_in, eps, h, threads);
    if (linear_any(h, m, hidden, wqkv, scales ? scales[0] : NULL, nqkv, bqkv, qkv, threads)) {
        free(buf);  /* nothing written: no unset keys or values reach the cache */
        return -1;
    }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m >= GLUE_PARALLEL_ROWS)
    for (long r = 0; r < m; r++) {
        uint16_t *row = qkv + r * nqkv;
        if (q_norm) {
            for (long hh = 0; hh < hq; hh++) rms_row(row + hh * d, d, q_norm, eps, row + hh * d);
            for (long hh = 0; hh < hkv; hh++) rms_row(row + nq + hh * d, d, k_norm, eps, row + nq + hh * d);
        }
        rope_heads(row, hq + hkv, d, cos + r * d, ss + r * d);
    }
    for (long i = 0; i < b; i++)  /* queries to [b, hq, t, d]; the real tokens' keys and values to the cache */
        for (long j = 0; j < t; j++) {
            const uint16_t *row = qkv + (i * t + j) * nqkv;
            for (long hh = 0; hh < hq; hh++)
                memcpy(q + ((i * hq + hh) * t + j) * d, row + hh * d, (size_t)d * sizeof(uint16_t));
            if (j >= num_new[i]) continue;
            for (long hh = 0; hh < hkv; hh++) {
                long off = i * cs[0] + hh * cs[1] + (starts[i] + j) * cs[2];
                store_row(kc, kv_f32, off, row + nq + hh * d, d);
                store_row(vc, kv_f32, off, row + nq + (hkv + hh) * d, d);
            }
        }
    failed |= few_attention(q, kc, vc, kv_f32, cs[0], cs[1], cs[2], cs[0], cs[1], cs[2], mask, att, (int)b,
                            (int)hq, (int)hkv, (int)t, (int)l, (int)d, scale, threads);
    for (long i = 0; i < b; i++)  /* [b, hq, t, d] -> [b, t, hq * d], o_proj's input */
        for (long hh = 0; hh < hq; hh++)
            for (long j = 0; j < t; j++)
                memcpy(q + (i * t + j) * nq + hh * d, att + ((i * hq + hh) * t + j) * d, (size_t)d * sizeof(uint16_t));
    failed |= linear_any(q, m, nq, wo, scales ? scales[1] : NULL, hidden, NULL, y, threads);
    add_rows(x, y, m, hidden, threads);

    rms_rows(x, m, hidden, hidden, norm_post, eps, h, threads);
    failed |= linear_any(h, m, hidden, wgu, scales ? scales[2] : NULL, 2 * inter, NULL, gu, threads);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && m >= GLUE_PARALLEL_ROWS)
    for (long r = 0; r < m; r++) {
        const uint16_t *g = gu + r * 2 * inter, *u = g + inter;
        uint16_t *a = act + r * inter;
#pragma omp simd
        for (long i = 0; i < inter; i++) {  /* SiLU as x / (1 + e^-x), exp_any vectorized (few_attention.c) */
            float gv = bf16_to_f32(g[i]);
            a[i] = bmul(f32_to_bf16(gv / (1.0f + exp_any(-gv))), u[i]);
        }
    }
    failed |= linear_any(act, m, inter, wdown, scales ? scales[3] : NULL, hidden, NULL, y, threads);
    add_rows(x, y, m, hidden, threads);
    free(buf);
    return failed ? -1 : 0;
}
