/* A few rows of x times a bf16 weight, with avx512_bf16's dot instruction (vdpbf16ps).
 *
 * out[m, n] = x[m, k] @ w[n, k].T (+ bias[n]), x and w bf16, accumulated in float32, rounded once to
 * bf16 (round to nearest even, as torch's float -> bf16 cast). The weight is read in the blocked layout
 * `bf16_rows.pack` makes: tiles of 64 outputs, inside a tile one 256-byte line per pair of k indices
 * (lane j holds w[tile * 64 + j, 2p], w[tile * 64 + j, 2p + 1]), so a thread streams its tiles in
 * address order and each 64-byte load feeds one dot instruction per row.
 *
 * Why: at 1..8 rows a linear is bound by reading its weight; the float32 FMA kernels found (oneDNN's,
 * inductor's) convert every weight element and reach less than half the copy bandwidth from 2 rows on.
 * One vdpbf16ps does 32 multiply-adds on bf16 operands as they are.
 *
 * Each output's sum runs over k in the same order whatever the row count and whatever rows sit beside
 * it, so a row's result does not depend on the batch it is computed in. Rows go through in groups of
 * at most MAX_GROUP (the accumulators of a group stay in registers: 4 x rows of the 32 zmm); a tile is
 * read from memory by the first group and from the core's L2 by the next ones.
 */
#include <immintrin.h>
#include <stdint.h>

#define TILE 64
#define MAX_GROUP 7
/* How far ahead a thread asks for its weight stream (64-byte lines, into L2): without a prefetch, or
 * with one into L1, one thread read the weight more slowly than a plain sum over the same tensor; 64-128
 * lines ahead into L2 matched it (bench/RESULTS.md, "bf16 kernel for a few rows"). */
#define PREFETCH_LINES 64

static inline __attribute__((always_inline)) void tile_group(
    const int rows, const int32_t *x, long x_pairs, const __m512i *w, long pairs,
    const float *bias, uint16_t *out, long n_out, long col0)
{
    __m512 acc[MAX_GROUP][4];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) acc[r][t] = _mm512_setzero_ps();
    for (long p = 0; p < pairs; p++) {
        const __m512i *line = w + p * 4;
        _mm_prefetch((const char *)(line + PREFETCH_LINES), _MM_HINT_T1);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m512bh wt = (__m512bh)_mm512_load_si512(line + t);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)_mm512_set1_epi32(x[r * x_pairs + p]), wt);
        }
    }
#pragma GCC unroll 4
    for (int t = 0; t < 4; t++) {
        long col = col0 + t * 16;
        if (col >= n_out) break;
        long left = n_out - col;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < rows; r++) {
            __m256bh h = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][t], b));
            _mm256_mask_storeu_epi16(out + r * n_out + col, mask, (__m256i)h);
        }
    }
}

static void tile_rows(int rows, const int32_t *x, long x_pairs, const __m512i *w, long pairs,
                      const float *bias, uint16_t *out, long n_out, long col0)
{
    switch (rows) {  /* constant row counts: the accumulators become registers */
    case 1: tile_group(1, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 2: tile_group(2, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 3: tile_group(3, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 4: tile_group(4, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 5: tile_group(5, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 6: tile_group(6, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    default: tile_group(7, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    }
}

/* x [m, k] bf16 contiguous (k even), packed: ceil(n / 64) tiles of (k / 2) x 64 x 2 bf16, bias float32
 * [n] or NULL, out [m, n] bf16 contiguous. Tiles are shared among `threads` OpenMP threads (the runtime
 * torch itself uses, when torch's libgomp is the one loaded). */
void bf16_rows_linear(const uint16_t *x, long m, long k, const uint16_t *packed, long n, const float *bias,
                      uint16_t *out, int threads)
{
    if (m <= 0 || n <= 0)
        return;
    const long pairs = k / 2, tiles = (n + TILE - 1) / TILE;
    const long groups = (m + MAX_GROUP - 1) / MAX_GROUP;
    const long per_group = (m + groups - 1) / groups;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long tile = 0; tile < tiles; tile++) {
        const __m512i *w = (const __m512i *)(packed + tile * pairs * TILE * 2);
        for (long r0 = 0; r0 < m; r0 += per_group) {
            int rows = (int)(m - r0 < per_group ? m - r0 : per_group);
            tile_rows(rows, (const int32_t *)(x + r0 * k), pairs, w, pairs, bias, out + r0 * n, n, tile * TILE);
        }
    }
}
