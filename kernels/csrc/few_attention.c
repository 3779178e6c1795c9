/* Attention of a few queries per row over a bf16 or float32 KV cache, in float32 arithmetic.

   out[b, h, t] = softmax(scale * q[b, h, t] . k[b, h / g, l], over the keys l that mask[b, t] shows) @ v[b, h / g]
   with g = Hq / Hkv query heads per KV head (GQA). One task per (row, KV head): its keys and values are
   read once for all g * T queries that use them, converted to float32 (16 at a time on AVX-512, the values
   in registers as P @ V reads them, and asked into L2 while the scores of the same keys run: a task's
   few kilobytes are too short a stream for the hardware prefetcher; the loops specialised for head dims
   64 and 128, so that the accumulators stay in registers); scores, softmax and
   P @ V are float32 (the probabilities are not rounded to 16 bits, unlike PyTorch's CPU flash kernel);
   each output is rounded once to bf16, to nearest even, as torch's cast rounds.

   q:    bf16 [B, Hq, T, D], contiguous
   k, v: bf16 (kv_f32 = 0) or float32 (kv_f32 = 1), element strides (row, head, position), D contiguous
   mask: uint8 [B, T, L] contiguous (nonzero: visible), or NULL (every query sees every key)
   out:  bf16 [B, Hq, T, D], contiguous
   Returns 0; -1 where a task's float32 scratch could not be allocated (out is then incomplete). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* e^x for x in [-87, 88], relative error about 2e-7. Plain arithmetic, so loops over it vectorize (libm's
   expf is a call per element). */
static inline float exp_reduced(float x) {
    /* n = x log2(e) rounded to nearest: adding 1.5 * 2^23 leaves no fraction bits (|x log2(e)| < 2^22);
       needs float arithmetic as written (no -ffast-math, which could fold the two operations away) */
    float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;  /* x - n ln 2 in two parts (Cody-Waite) */
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f
              + r * 1.3888889e-3f)))));
    union { uint32_t u; float f; } s;
    s.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * s.f;
}

/* e^x for x <= 0 (a score minus its row's maximum); x below -87 gives e^-87 (under 2e-38: nothing beside
   the maximum's 1). */
static inline float exp_nonpositive(float x) { return exp_reduced(x < -87.0f ? -87.0f : x); }

/* e^x for any x: past 88 as 2 e^(x - ln 2) (2^n with n = 128 has no float32 exponent), +inf past
   88.7228 where float32 overflows; e^-87 below -87 (a floor: 1 + e^x is 1 there); NaN stays NaN (and never
   reaches the float-to-int conversion). Branch-free, so loops over it vectorize. */
static inline float exp_any(float x) {
    float lo = x != x ? 0.0f : x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    float hi = x > 88.0f && x <= 88.7228f ? x - 0.693147181f : 0.0f;
    float e = exp_reduced(lo), e2 = 2.0f * exp_reduced(hi);
    return x != x ? x : x > 88.7228f ? INFINITY : x > 88.0f ? e2 : e;
}

static inline const void *row_at(const void *base, int f32, long offset) {
    return f32 ? (const void *)((const float *)base + offset) : (const void *)((const uint16_t *)base + offset);
}

static inline void load_row(float *dst, const void *src, int f32, int d) {
    if (f32) {
        memcpy(dst, src, (size_t)d * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int i = 0; i < d; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 consecutive elements at element offset `off` of a bf16 or float32 array, as float32 */
static inline __m512 load16(const void *base, int f32, long off) {
    if (f32) return _mm512_loadu_ps((const float *)base + off);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lane j of the result: the sum of the 16 lanes of v[j] (16 dot products' partial sums at once) */
static inline __m512 sum16(const __m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xdd));
    /* a[i]: keys 2i, 2i+1 over lane pairs; b[i]: keys 4i..4i+3 per 128-bit quarter; c[i]: keys 8i..8i+7 over
       half the quarters; this: keys 0..15 in order */
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xdd));
}

/* Up to 16 keys (or values) from position j0 as float32 rows of d in kb [16][d]; rows past n are zeros. */
static inline void block16(float *kb, const void *k, int f32, long base, long sl, int j0, int n, int d) {
    for (int jj = 0; jj < 16; jj++)
        for (int c = 0; c < d / 16; c++)
            _mm512_storeu_ps(kb + jj * d + 16 * c, jj < n ? load16(k, f32, base + (j0 + jj) * sl + 16 * c)
                                                          : _mm512_setzero_ps());
}

/* The scores and P @ V of `task` with AVX-512, for head dims of 16..128 in steps of 16: keys converted 16
   at a time into kb (L1-resident) and read from there by every query row; values widened as read. */

/* The scores of the keys j0..j0+n-1 (widened into kb) for one query row, CHUNKS = d / 16 a constant where it
   is inlined (the query's chunks stay in registers): each score is q . k over the chunks in order, then the
   16 lanes (sum16), times scale. */
static inline __attribute__((always_inline)) void score_row(const float *qr, const float *kb, const int chunks,
                                                            float scale, const uint8_t *mrow, int n, float *sr) {
    __m512 part[16];
    for (int jj = 0; jj < 16; jj++) {
        __m512 p = _mm512_mul_ps(_mm512_loadu_ps(qr), _mm512_loadu_ps(kb + jj * chunks * 16));
        for (int c = 1; c < chunks; c++)
            p = _mm512_fmadd_ps(_mm512_loadu_ps(qr + 16 * c), _mm512_loadu_ps(kb + jj * chunks * 16 + 16 * c), p);
        part[jj] = p;
    }
    float dots[16];
    _mm512_storeu_ps(dots, _mm512_mul_ps(sum16(part), _mm512_set1_ps(scale)));
    for (int jj = 0; jj < n; jj++) sr[jj] = mrow && !mrow[jj] ? -INFINITY : dots[jj];
}

static void scores_avx512(const float *qf, const void *k, int f32, long kbase, long ksl, const uint8_t *mrow0,
                          int t, int rows, int l, int d, float scale, float *s, float *kb, const void *v, long vbase,
                          long vsl) {
    int chunks = d / 16;
    const int bytes = d * (f32 ? 4 : 2);
    for (int j0 = 0; j0 < l; j0 += 16) {
        int n = l - j0 < 16 ? l - j0 : 16;
        for (int jj = 0; jj < n; jj++)  /* the same keys' values, into L2 for P @ V */
            for (int off = 0; off < bytes; off += 64)
                _mm_prefetch((const char *)row_at(v, f32, vbase + (j0 + jj) * vsl) + off, _MM_HINT_T1);
        block16(kb, k, f32, kbase, ksl, j0, n, d);
        for (int r = 0; r < rows; r++) {
            const float *qr = qf + (size_t)r * d;
            const uint8_t *mrow = mrow0 ? mrow0 + (size_t)(r % t) * l + j0 : NULL;
            float *sr = s + (size_t)r * l + j0;
            if (chunks == 4)
                score_row(qr, kb, 4, scale, mrow, n, sr);
            else if (chunks == 8)
                score_row(qr, kb, 8, scale, mrow, n, sr);
            else
                score_row(qr, kb, chunks, scale, mrow, n, sr);
        }
    }
}

/* P @ V over the keys j0..j0+n-1 for rows r0..r0+NR-1, NR <= 4 and CHUNKS = d / 16 constants where it is
   inlined, so the accumulators stay in registers; each value row is widened to float32 in registers as it
   is read (no copy). Every output element sums p * v over the keys in key order, one FMA each. */
static inline __attribute__((always_inline)) void pv_rows(const float *s, const void *v, int f32, long vbase,
                                                          long vsl, int l, int j0, int n, int r0, const int nr,
                                                          const int chunks, float *acc) {
    __m512 a[4][8];
    for (int rr = 0; rr < nr; rr++)
        for (int c = 0; c < chunks; c++) a[rr][c] = _mm512_loadu_ps(acc + (size_t)(r0 + rr) * chunks * 16 + 16 * c);
    for (int jj = 0; jj < n; jj++) {
        __m512 vr[8];
        for (int c = 0; c < chunks; c++) vr[c] = load16(v, f32, vbase + (j0 + jj) * vsl + 16 * c);
        for (int rr = 0; rr < nr; rr++) {
            float p = s[(size_t)(r0 + rr) * l + j0 + jj];
            if (p == 0.0f) continue;
            __m512 pp = _mm512_set1_ps(p);
            for (int c = 0; c < chunks; c++) a[rr][c] = _mm512_fmadd_ps(pp, vr[c], a[rr][c]);
        }
    }
    for (int rr = 0; rr < nr; rr++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(acc + (size_t)(r0 + rr) * chunks * 16 + 16 * c, a[rr][c]);
}

#define PV_ROWS(NR, CHUNKS) pv_rows(s, v, f32, vbase, vsl, l, j0, n, r0, NR, CHUNKS, acc)
#define PV_CHUNKS(CHUNKS)                                                                      \
    switch (nr) {                                                                              \
        case 1: PV_ROWS(1, CHUNKS); break;                                                     \
        case 2: PV_ROWS(2, CHUNKS); break;                                                     \
        case 3: PV_ROWS(3, CHUNKS); break;                                                     \
        default: PV_ROWS(4, CHUNKS); break;                                                    \
    }

static void pv_avx512(const float *s, const void *v, int f32, long vbase, long vsl, int rows, int l, int d,
                      float *acc) {
    int chunks = d / 16;
    for (int j0 = 0; j0 < l; j0 += 16) {  /* 16 keys at a time: their values stay in L1 for every row group */
        int n = l - j0 < 16 ? l - j0 : 16;
        for (int r0 = 0; r0 < rows; r0 += 4) {
            int nr = rows - r0 < 4 ? rows - r0 : 4;
            if (chunks == 4) {
                PV_CHUNKS(4)
            } else if (chunks == 8) {
                PV_CHUNKS(8)
            } else {
                pv_rows(s, v, f32, vbase, vsl, l, j0, n, r0, nr, chunks, acc);
            }
        }
    }
}
#endif

static int task(const uint16_t *q, const void *k, const void *v, int f32, long ksb, long ksh, long ksl,
                long vsb, long vsh, long vsl, const uint8_t *mask, uint16_t *out, int b, int h, int hq, int hkv,
                int t, int l, int d, float scale) {
    int g = hq / hkv, rows = g * t;
    if (rows <= 0 || d <= 0) return 0;
    /* scratch: the queries [rows, d], 16 keys [16, d] (or values: the plain loops), scores [rows, l], accumulators [rows, d] */
    float *qf = (float *)malloc(sizeof(float) * ((size_t)rows * d + 16 * (size_t)d + (size_t)rows * l + (size_t)rows * d));
    if (!qf) return -1;
    float *kf = qf + (size_t)rows * d, *s = kf + 16 * (size_t)d, *acc = s + (size_t)rows * l;
    for (int gi = 0; gi < g; gi++)  /* row r = gi * t + ti: query head h * g + gi, query ti */
        for (int ti = 0; ti < t; ti++)
            load_row(qf + (size_t)(gi * t + ti) * d, q + (((size_t)b * hq + h * g + gi) * t + ti) * d, 0, d);
#if defined(__AVX512F__)
    int fast = d % 16 == 0 && d >= 16 && d <= 128;
    if (fast)
        scores_avx512(qf, k, f32, b * ksb + h * ksh, ksl, mask ? mask + (size_t)b * t * l : NULL, t, rows, l, d,
                      scale, s, kf, v, b * vsb + h * vsh, vsl);
#else
    int fast = 0;
#endif
    for (int j = 0; j < l && !fast; j++) {
        load_row(kf, row_at(k, f32, b * ksb + h * ksh + j * ksl), f32, d);
        for (int r = 0; r < rows; r++) {
            int ti = r % t;
            if (mask && !mask[((size_t)b * t + ti) * l + j]) {
                s[(size_t)r * l + j] = -INFINITY;
                continue;
            }
            const float *qr = qf + (size_t)r * d;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < d; i++) dot += qr[i] * kf[i];
            s[(size_t)r * l + j] = dot * scale;
        }
    }
    float inv[rows];
    for (int r = 0; r < rows; r++) {
        float *sr = s + (size_t)r * l, m = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : m)
        for (int j = 0; j < l; j++) m = sr[j] > m ? sr[j] : m;
        if (m == -INFINITY) {  /* every score hidden (zeros: callers always show a key) or NaN (NaN, as SDPA) */
            int nan = 0;
            for (int j = 0; j < l; j++) nan |= sr[j] != sr[j];
            for (int j = 0; j < l; j++) sr[j] = nan ? NAN : 0.0f;
            inv[r] = nan ? NAN : 0.0f;
            continue;
        }
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < l; j++) {
            float e = sr[j] == -INFINITY ? 0.0f : exp_nonpositive(sr[j] - m);
            sr[j] = e;
            sum += e;
        }
        inv[r] = 1.0f / sum;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * d);
#if defined(__AVX512F__)
    if (fast) pv_avx512(s, v, f32, b * vsb + h * vsh, vsl, rows, l, d, acc);
#endif
    for (int j = 0; j < l && !fast; j++) {
        load_row(kf, row_at(v, f32, b * vsb + h * vsh + j * vsl), f32, d);
        for (int r = 0; r < rows; r++) {
            float p = s[(size_t)r * l + j];
            if (p == 0.0f) continue;
            float *ar = acc + (size_t)r * d;
#pragma omp simd
            for (int i = 0; i < d; i++) ar[i] += p * kf[i];
        }
    }
    for (int r = 0; r < rows; r++) {
        int gi = r / t, ti = r % t;
        uint16_t *o = out + (((size_t)b * hq + h * g + gi) * t + ti) * d;
        const float *ar = acc + (size_t)r * d;
        for (int i = 0; i < d; i++) o[i] = f32_to_bf16(ar[i] * inv[r]);
    }
    free(qf);
    return 0;
}

int few_attention(const uint16_t *q, const void *k, const void *v, int kv_f32, long ksb, long ksh, long ksl,
                  long vsb, long vsh, long vsl, const uint8_t *mask, uint16_t *out, int b, int hq, int hkv,
                  int t, int l, int d, float scale, int threads) {
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(| : failed)
    for (int task_id = 0; task_id < b * hkv; task_id++)
        failed |= task(q, k, v, kv_f32, ksb, ksh, ksl, vsb, vsh, vsl, mask, out, task_id / hkv, task_id % hkv, hq,
                       hkv, t, l, d, scale);
    return failed ? -1 : 0;
}
