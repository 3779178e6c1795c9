/* A few rows of bf16 x times an int4 weight (an int4 draft's linears), read at memory speed with avx512_bf16.

   out[m, n] = x[m, k] @ w[n, k].T (+ bias[n]), w = q * s + lo per group of 32 consecutive k of an output
   row (q in 0..15; s, lo bf16: the group's step and minimum, quant.int4_codes' rounding), accumulated in
   float32, rounded once to bf16 (round to nearest even).

   Why: a step of a few rows is bound by reading the weights, and int4 codes are a quarter of bf16's bytes
   (plus a sixteenth for the groups' s and lo). torch's CPU int4 kernel converts each code to float32 and
   multiplies in float32; here a code becomes a bf16 by bit arithmetic alone: the bf16 whose bits are
   0x4300 | q is 128 + q exactly, so one dot instruction sums x (128 + q) over a pair of k, and per group
        sum_k x w = s * sum_k x (128 + q) + (lo - 128 s) * sum_k x,
   the last sum taken once per row and group.

   Layout (`quant.pack_int4_rows`): tiles of 64 outputs (n padded with zero codes); in a tile, 64 bytes per
   pair p of k. Byte b = 16 i + r (i: its 128-bit lane) holds in its low nibble the code at k = 2p + r % 2 of
   output 4 i + (r % 8) / 2, plus 16 where r >= 8, and in its high nibble the same for the output 32 past
   that. Masking the nibbles and interleaving each 128-bit lane's bytes with 0x43 (unpacklo / unpackhi)
   then gives, per 16 outputs, the 16 dwords (code at 2p, code at 2p + 1) the dot instruction takes, in
   output order. Scales: per tile and group, 64 steps s then 64 minimums lo, bf16 ([tiles, k / 32, 2, 64]).

   Each output's sum runs over k in one order whatever the rows beside it, so a row's result does not
   depend on the thread count, nor on its batch within each path: in the amx build one row takes the dot
   instructions and 2+ rows the tile unit, whose sums within a group may round differently (about one
   output in 3,000 differed by a bf16 ulp); the tile path at one row measured no faster. A draft's
   outputs need not be batch-invariant: the target's verification keeps the engine exact.

   Included after bf16_rows.c (decoder_layer.c), whose store_tile and AMX tile configuration it uses. */

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__)
#define INT4_GROUP 32
#define INT4_MAX_ROWS 3 /* rows a pass over a tile carries in registers: 8 accumulators a row */

static inline __m512 int4_bf16x16(const uint16_t *p) {  /* 16 bf16 as float32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __attribute__((always_inline)) void int4_tile(
    const int rows, const uint16_t *x, long k, const float *xsum, const uint8_t *codes, const uint16_t *scales,
    long pairs, const float *bias, uint16_t *out, long n_out, long col0) {
    __m512 acc[INT4_MAX_ROWS][4], part[INT4_MAX_ROWS][4];
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x43);
    const long groups = pairs / (INT4_GROUP / 2);
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < 4; t++) acc[r][t] = _mm512_setzero_ps();
    for (long g = 0; g < groups; g++) {
        for (int r = 0; r < rows; r++)
            for (int t = 0; t < 4; t++) part[r][t] = _mm512_setzero_ps();
        for (long p = g * (INT4_GROUP / 2); p < (g + 1) * (INT4_GROUP / 2); p++) {
            const __m512i v = _mm512_loadu_si512((const void *)(codes + p * 64));
            _mm_prefetch((const char *)(codes + p * 64 + 1024), _MM_HINT_T1);
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            __m512i w[4];  /* each code byte beside 0x43: the bf16 words 0x4300 | q */
            w[0] = _mm512_unpacklo_epi8(lo, top);
            w[1] = _mm512_unpackhi_epi8(lo, top);
            w[2] = _mm512_unpacklo_epi8(hi, top);
            w[3] = _mm512_unpackhi_epi8(hi, top);
            for (int r = 0; r < rows; r++) {
                const __m512bh xp = (__m512bh)_mm512_set1_epi32(((const int32_t *)(x + r * k))[p]);
                for (int t = 0; t < 4; t++) part[r][t] = _mm512_dpbf16_ps(part[r][t], xp, (__m512bh)w[t]);
            }
        }
        const uint16_t *sg = scales + g * 128;
        for (int t = 0; t < 4; t++) {
            const __m512 s = int4_bf16x16(sg + 16 * t), m = int4_bf16x16(sg + 64 + 16 * t);
            const __m512 z = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, m);  /* lo - 128 s */
            for (int r = 0; r < rows; r++)
                acc[r][t] = _mm512_fmadd_ps(s, part[r][t],
                                            _mm512_fmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), acc[r][t]));
        }
    }
    float sums[INT4_MAX_ROWS * 64];
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(sums + r * 64 + t * 16, acc[r][t]);
    store_tile(sums, rows, bias, out, n_out, col0);
}

static void int4_tile_rows(int rows, const uint16_t *x, long k, const float *xsum, const uint8_t *codes,
                           const uint16_t *scales, long pairs, const float *bias, uint16_t *out, long n_out, long col0) {
    switch (rows) {  /* constant row counts: the accumulators become registers */
    case 1: int4_tile(1, x, k, xsum, codes, scales, pairs, bias, out, n_out, col0); break;
    case 2: int4_tile(2, x, k, xsum, codes, scales, pairs, bias, out, n_out, col0); break;
    default: int4_tile(3, x, k, xsum, codes, scales, pairs, bias, out, n_out, col0); break;
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* 2 to 16 rows on AMX's tile unit (the amx build, bf16_rows.c's tile configuration: C tiles 0-3, A 4, B 5-7):
   a group's 16 code lines widened once into four B tiles (bf16 0x4300 | q, 16 pairs x 16 outputs each), one
   tile multiply per 16 outputs for every row, the group's step and minimum applied to the C tiles' sums
   in float32, so the cost of a group no longer grows with the rows as the dot instructions' did. */
static void int4_amx_tile(int rows, const uint16_t *x, long k, const float *xsum, const uint8_t *codes,
                          const uint16_t *scales, long pairs, const float *bias, uint16_t *out, long n_out, long col0) {
    __attribute__((aligned(64))) uint16_t b[4 * 16 * 32];
    __attribute__((aligned(64))) float c[16 * 64], acc[16 * 64];
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x43);
    const long groups = pairs / (INT4_GROUP / 2);
    memset(acc, 0, sizeof(float) * (size_t)rows * 64);
    for (long g = 0; g < groups; g++) {
        for (int p = 0; p < INT4_GROUP / 2; p++) {
            const __m512i v = _mm512_loadu_si512((const void *)(codes + (g * (INT4_GROUP / 2) + p) * 64));
            _mm_prefetch((const char *)(codes + (g * (INT4_GROUP / 2) + p) * 64 + 1024), _MM_HINT_T1);
            const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            _mm512_store_si512((void *)(b + 0 * 512 + p * 32), _mm512_unpacklo_epi8(lo, top));
            _mm512_store_si512((void *)(b + 1 * 512 + p * 32), _mm512_unpackhi_epi8(lo, top));
            _mm512_store_si512((void *)(b + 2 * 512 + p * 32), _mm512_unpacklo_epi8(hi, top));
            _mm512_store_si512((void *)(b + 3 * 512 + p * 32), _mm512_unpackhi_epi8(hi, top));
        }
        AMX_MEMORY();  /* the B tiles' stores above, before the tile loads read them */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, x + g * INT4_GROUP, k * 2);
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, b + 512, 64);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, b + 1024, 64);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, b + 1536, 64);
        _tile_dpbf16ps(3, 4, 5);
        _tile_stored(0, c, 256);
        _tile_stored(1, c + 16, 256);
        _tile_stored(2, c + 32, 256);
        _tile_stored(3, c + 48, 256);
        AMX_MEMORY();  /* the C tiles' stores, before c is read */
        const uint16_t *sg = scales + g * 128;
        for (int t = 0; t < 4; t++) {
            const __m512 s = int4_bf16x16(sg + 16 * t), m = int4_bf16x16(sg + 64 + 16 * t);
            const __m512 z = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, m);  /* lo - 128 s */
            for (int r = 0; r < rows; r++) {
                float *a = acc + r * 64 + t * 16;
                __m512 v = _mm512_fmadd_ps(z, _mm512_set1_ps(xsum[r * groups + g]), _mm512_load_ps(a));
                _mm512_store_ps(a, _mm512_fmadd_ps(s, _mm512_load_ps(c + r * 64 + t * 16), v));
            }
        }
    }
    store_tile(acc, rows, bias, out, n_out, col0);
}
#define INT4_AMX 1
#else
#define INT4_AMX 0
#endif

/* x [m, k] bf16 contiguous (k a multiple of 32), codes and scales as above for n outputs, bias float32 [n]
   or NULL, out [m, n] bf16. Returns 0, -1 where the rows' group sums could not be allocated, -2 where k
   is not a multiple of 32. In the amx build 2+ rows take the tile unit, 16 at a time. */
int int4_rows_linear(const uint16_t *x, long m, long k, const uint8_t *codes, const uint16_t *scales, long n,
                     const float *bias, uint16_t *out, int threads) {
    if (m <= 0 || n <= 0) return 0;
    if (k % INT4_GROUP) return -2;
    const long groups = k / INT4_GROUP, pairs = k / 2, tiles = (n + 63) / 64;
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(m * groups));
    if (!xsum) return -1;
    for (long r = 0; r < m; r++)
        for (long g = 0; g < groups; g++) {
            float s = 0.0f;
            for (long i = 0; i < INT4_GROUP; i++) {
                union { uint32_t u; float f; } c;
                c.u = (uint32_t)x[r * k + g * INT4_GROUP + i] << 16;
                s += c.f;
            }
            xsum[r * groups + g] = s;
        }
#if INT4_AMX
    if (m >= 2 && bf16_rows_amx_ready()) {
#pragma omp parallel num_threads(threads) if (threads > 1)
        for (long r0 = 0; r0 < m; r0 += 16) {  /* every thread configures its tiles for the chunk's rows */
            const int rows = (int)(m - r0 < 16 ? m - r0 : 16);
            amx_configure(rows);
#pragma omp for schedule(static)
            for (long tile = 0; tile < tiles; tile++)
                int4_amx_tile(rows, x + r0 * k, k, xsum + r0 * groups, codes + tile * pairs * 64,
                              scales + tile * groups * 128, pairs, bias, out + r0 * n, n, tile * 64);
            if (r0 + 16 >= m) _tile_release();
        }
        free(xsum);
        return 0;
    }
#endif
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long tile = 0; tile < tiles; tile++)
        for (long r0 = 0; r0 < m; r0 += INT4_MAX_ROWS) {
            int rows = (int)(m - r0 < INT4_MAX_ROWS ? m - r0 : INT4_MAX_ROWS);
            int4_tile_rows(rows, x + r0 * k, k, xsum + r0 * groups, codes + tile * pairs * 64,
                           scales + tile * groups * 128, pairs, bias, out + r0 * n, n, tile * 64);
        }
    free(xsum);
    return 0;
}
#endif
