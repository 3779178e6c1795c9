/* A few rows of x times a float32 weight, streaming the weight once for every row (AVX-512F or AVX2+FMA).
 *
 * out[m, n] = x[m, k] @ w[n, k].T (+ bias[n]), all float32. The weight is read in the blocked layout
 * `f32_rows.pack` makes: tiles of TILE outputs, inside a tile one line of TILE floats per k index (lane j
 * holds w[tile * TILE + j, k]), so a thread streams its tiles in address order and each vector load
 * feeds one multiply-add per row (x[r, k] broadcast).
 *
 * Why: at 1..8 rows (a decode step, a verify of K+1 tokens, a draft's tree step) a linear is bound by
 * reading its weight, yet MKL's few-row sgemm ran a 4-row verify at about 1.5 one-row steps on the
 * AVX-512 Xeon (bench/RESULTS.md, "A sixth CPU kind"): here every row's multiply-adds ride on the one
 * read of the weight.
 *
 * Each output's sum runs over k in one fixed order (one fused multiply-add per k, k ascending) whatever
 * the row count, the rows beside it and the thread count, so a row's result does not depend on the batch
 * it is computed in, among the row counts this kernel serves.
 * Rows go through in groups of at most MAX_GROUP (a group's accumulators stay in registers); a tile is
 * read from memory by the first group and from the core's L2 by the next ones.
 */
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define TILE 64          /* 4 zmm lines of 16 floats */
#define LANES 16
#define MAX_GROUP 7      /* 28 accumulators + the broadcast of 32 zmm */
#define VEC __m512
#define VZERO _mm512_setzero_ps
#define VLOAD _mm512_load_ps
#define VSET1 _mm512_set1_ps
#define VFMA _mm512_fmadd_ps
#define EXPORT f32_rows_linear_avx512
#else
#define TILE 32          /* 4 ymm lines of 8 floats */
#define LANES 8
#define MAX_GROUP 3      /* 12 accumulators + the broadcast of 16 ymm (the weight as a memory operand) */
#define VEC __m256
#define VZERO _mm256_setzero_ps
#define VLOAD _mm256_load_ps
#define VSET1 _mm256_set1_ps
#define VFMA _mm256_fmadd_ps
#define EXPORT f32_rows_linear_avx2
#endif
#define LINES (TILE / LANES)
/* How far ahead a thread asks for its weight stream, in bytes. On the AVX-512 Xeon 0 to 16 KiB ahead
 * measured within noise of each other, into L1 (T0) a little ahead of into L2, a non-temporal hint 2x
 * slower; huge pages for the packed copies changed nothing. */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

static inline __attribute__((always_inline)) void tile_group(
    const int rows, const float *x, long k, const float *w, const float *bias, float *out, long n_out, long col0)
{
    VEC acc[MAX_GROUP][LINES];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int t = 0; t < LINES; t++) acc[r][t] = VZERO();
    for (long p = 0; p < k; p++) {
        const float *line = w + p * TILE;
#if PREFETCH_BYTES > 0
        _mm_prefetch((const char *)line + PREFETCH_BYTES, _MM_HINT_T0);
#endif
#if PREFETCH_BYTES > 0 && LINES * LANES * 4 > 64
        _mm_prefetch((const char *)line + PREFETCH_BYTES + 64, _MM_HINT_T0);
#endif
#if PREFETCH_BYTES > 0 && LINES * LANES * 4 > 128
        _mm_prefetch((const char *)line + PREFETCH_BYTES + 128, _MM_HINT_T0);
        _mm_prefetch((const char *)line + PREFETCH_BYTES + 192, _MM_HINT_T0);
#endif
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            VEC xr = VSET1(x[r * k + p]);
#pragma GCC unroll 4
            for (int t = 0; t < LINES; t++) acc[r][t] = VFMA(xr, VLOAD(line + t * LANES), acc[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < LINES; t++) {
        long col = col0 + t * LANES;
        if (col >= n_out) break;
        long left = n_out - col;
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            float lane[LANES] __attribute__((aligned(64)));
#if defined(__AVX512F__)
            _mm512_store_ps(lane, acc[r][t]);
#else
            _mm256_store_ps(lane, acc[r][t]);
#endif
            float *dst = out + r * n_out + col;
            for (long j = 0; j < LANES && j < left; j++) dst[j] = bias ? lane[j] + bias[col + j] : lane[j];
        }
    }
}



static void tile_rows(int rows, const float *x, long k, const float *w, const float *bias, float *out,
                      long n_out, long col0)
{
    switch (rows) {  /* constant row counts: the accumulators become registers */
    case 1: tile_group(1, x, k, w, bias, out, n_out, col0); break;
    case 2: tile_group(2, x, k, w, bias, out, n_out, col0); break;
#if MAX_GROUP > 3
    case 3: tile_group(3, x, k, w, bias, out, n_out, col0); break;
    case 4: tile_group(4, x, k, w, bias, out, n_out, col0); break;
    case 5: tile_group(5, x, k, w, bias, out, n_out, col0); break;
    case 6: tile_group(6, x, k, w, bias, out, n_out, col0); break;
#endif
    default: tile_group(MAX_GROUP, x, k, w, bias, out, n_out, col0); break;
    }
}

/* x [m, k] float32 contiguous, packed: ceil(n / TILE) tiles of k x TILE float32 (64-byte aligned), bias
 * float32 [n] or NULL, out [m, n] float32 contiguous. Tiles are shared among `threads` OpenMP threads
 * (the runtime torch itself uses, when torch's libgomp is the one loaded). Returns TILE, so the caller
 * can check the layout it packed for. */
int EXPORT(const float *x, long m, long k, const float *packed, long n, const float *bias, float *out,
           int threads)
{
    if (m <= 0 || n <= 0)
        return TILE;
    const long tiles = (n + TILE - 1) / TILE;
    const long groups = (m + MAX_GROUP - 1) / MAX_GROUP;
    const long per_group = (m + groups - 1) / groups;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long tile = 0; tile < tiles; tile++) {
        const float *w = packed + tile * k * TILE;
        for (long r0 = 0; r0 < m; r0 += per_group) {
            int rows = (int)(m - r0 < per_group ? m - r0 : per_group);
            tile_rows(rows, x + r0 * k, k, w, bias, out + r0 * n, n, tile * TILE);
        }
    }
    return TILE;
}

