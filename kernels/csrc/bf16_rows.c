/* A few rows of x times a bf16 weight, read at memory speed (AVX-512; avx512_bf16's dot instruction where
 * the CPU has it).
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
 * Without avx512_bf16 (built without -mavx512bf16: __AVX512BF16__ undefined) the same layout is widened
 * in registers: a bf16 is the top half of a float32, so a 64-byte line of pairs gives the even k's
 * floats by a 16-bit left shift and the odd k's by masking off the low halves, two integer operations,
 * then one float32 fused multiply-add per row and k, whose x operand is a broadcast from a float32 copy
 * of x made once per block of up to X_BLOCK rows (widening x per tile cost a fifth more at 24 rows). The weight is read as
 * bf16 (half a float32 model's bytes), which is what bounds a few-row linear; oneDNN's emulated bf16 on
 * such a CPU ran slower than float32 (bench/RESULTS.md, "A sixth CPU kind", "bf16 without bf16 units").
 *
 * Each output's sum runs over k in the same order whatever the row count and whatever rows sit beside
 * it, so a row's result does not depend on the batch it is computed in. Rows go through in groups of
 * at most MAX_GROUP (the accumulators of a group stay in registers: 4 x rows of the 32 zmm); a tile is
 * read from memory by the first group and from the core's L2 by the next ones.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define TILE 64
#if defined(__AVX512BF16__)
#define MAX_GROUP 7
#define EXPORT bf16_rows_linear
#else
#define MAX_GROUP 5      /* 20 accumulators, a line's two widened halves, the mask, the broadcasts */
#define EXPORT bf16_rows_linear_widened
/* Rows of x widened to float32 at a time (the copy's size: X_BLOCK x k floats, 9 MB at k = 8960). */
#define X_BLOCK 256
#endif
/* How far ahead a thread asks for its weight stream (64-byte lines, into L2): without a prefetch, or
 * with one into L1, one thread read the weight more slowly than a plain sum over the same tensor; 64-128
 * lines ahead into L2 matched it (bench/RESULTS.md, "bf16 kernel for a few rows"). */
#define PREFETCH_LINES 64

/* rows x 64 float32 sums (row r at sums + 64 r) of the tile of outputs from col0, plus the bias, rounded
 * once to bf16 (round to nearest even, as torch's float -> bf16 cast) into out [rows, n_out]; columns past
 * n_out are dropped. Every build's and every path's output goes through here. */
static inline void store_tile(const float *sums, int rows, const float *bias, uint16_t *out, long n_out, long col0)
{
    for (int t = 0; t < 4; t++) {
        long col = col0 + t * 16;
        if (col >= n_out) break;
        long left = n_out - col;
        __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            __m512 v = _mm512_add_ps(_mm512_loadu_ps(sums + r * TILE + t * 16), b);
#if defined(__AVX512BF16__)
            __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
#else  /* round to nearest even by integer arithmetic, as torch's float -> bf16 cast (subnormals kept, NaN kept a quiet NaN) */
            __m512i bits = _mm512_castps_si512(v);
            __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
            __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            rounded = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
            __m256i h = _mm512_cvtepi32_epi16(rounded);
#endif
            _mm256_mask_storeu_epi16(out + r * n_out + col, mask, h);
        }
    }
}

static inline __attribute__((always_inline)) void tile_group(
    const int rows, const void *x, long x_pairs, const __m512i *w, long pairs,
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
#if defined(__AVX512BF16__)
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m512bh wt = (__m512bh)_mm512_load_si512(line + t);
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)_mm512_set1_epi32(((const int32_t *)x)[r * x_pairs + p]), wt);
        }
#else  /* x: the rows widened to float32 ([rows, 2 * x_pairs] floats), a block of rows at a time */
        const __m512i high = _mm512_set1_epi32((int)0xFFFF0000u);
        const float *xf = (const float *)x + 2 * p;
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            __m512i wt = _mm512_load_si512(line + t);
            __m512 w_even = _mm512_castsi512_ps(_mm512_slli_epi32(wt, 16));
            __m512 w_odd = _mm512_castsi512_ps(_mm512_and_si512(wt, high));
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const float *xr = xf + r * 2 * x_pairs;
                acc[r][t] = _mm512_fmadd_ps(_mm512_set1_ps(xr[1]), w_odd,
                                            _mm512_fmadd_ps(_mm512_set1_ps(xr[0]), w_even, acc[r][t]));
            }
        }
#endif
    }
    float sums[MAX_GROUP * TILE];
#pragma GCC unroll 8
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) _mm512_storeu_ps(sums + r * TILE + t * 16, acc[r][t]);
    store_tile(sums, rows, bias, out, n_out, col0);
}

static void tile_rows(int rows, const void *x, long x_pairs, const __m512i *w, long pairs,
                      const float *bias, uint16_t *out, long n_out, long col0)
{
    switch (rows) {  /* constant row counts: the accumulators become registers */
    case 1: tile_group(1, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 2: tile_group(2, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 3: tile_group(3, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    case 4: tile_group(4, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
#if MAX_GROUP > 4
    case 5: tile_group(5, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
#endif
#if MAX_GROUP > 5
    case 6: tile_group(6, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
#endif
    default: tile_group(MAX_GROUP, x, x_pairs, w, pairs, bias, out, n_out, col0); break;
    }
}

/* m rows of x (row r at x_rows + r * row_bytes: bf16 pairs for the dot build, floats for the widened one)
 * times every tile, the tiles shared among `threads` OpenMP threads (the runtime torch itself uses, when
 * torch's libgomp is the one loaded), the rows in groups of at most MAX_GROUP. */
static void rows_by_tiles(const char *x_rows, long row_bytes, long m, long pairs, const uint16_t *packed, long n,
                          const float *bias, uint16_t *out, int threads)
{
    const long tiles = (n + TILE - 1) / TILE;
    const long groups = (m + MAX_GROUP - 1) / MAX_GROUP;
    const long per_group = (m + groups - 1) / groups;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long tile = 0; tile < tiles; tile++) {
        const __m512i *w = (const __m512i *)(packed + tile * pairs * TILE * 2);
        for (long r0 = 0; r0 < m; r0 += per_group) {
            int rows = (int)(m - r0 < per_group ? m - r0 : per_group);
            tile_rows(rows, x_rows + r0 * row_bytes, pairs, w, pairs, bias, out + r0 * n, n, tile * TILE);
        }
    }
}

/* x [m, k] bf16 contiguous (k even), packed: ceil(n / 64) tiles of (k / 2) x 64 x 2 bf16, bias float32
 * [n] or NULL, out [m, n] bf16 contiguous, `threads` OpenMP threads. Returns 0, or -1 where the widened
 * build could not allocate its float32 copy of x (out not written). */
int EXPORT(const uint16_t *x, long m, long k, const uint16_t *packed, long n, const float *bias,
           uint16_t *out, int threads)
{
    if (m <= 0 || n <= 0)
        return 0;
    const long pairs = k / 2;
#if defined(__AVX512BF16__)
    rows_by_tiles((const char *)x, k * 2, m, pairs, packed, n, bias, out, threads);
#else
    /* x widened once per block of rows rather than once per tile (a bf16 is a float32's top half); a
     * row's sums do not depend on the block or the group it is in */
    const long block = m < X_BLOCK ? m : X_BLOCK;
    uint32_t *wide = (uint32_t *)malloc((size_t)block * (size_t)k * sizeof(uint32_t));
    if (!wide)
        return -1;
    for (long b0 = 0; b0 < m; b0 += block) {
        const long rows = m - b0 < block ? m - b0 : block;
        const uint16_t *src = x + b0 * k;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && rows * k >= (1L << 16))
        for (long i = 0; i < rows * k; i++)
            wide[i] = (uint32_t)src[i] << 16;
        rows_by_tiles((const char *)wide, k * 4, rows, pairs, packed, n, bias, out + b0 * n, threads);
    }
    free(wide);
#endif
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* The same product on AMX's tile unit (Sapphire Rapids and later), for the layer kernel's steps of a few
 * tokens (decoder_layer.c): one tile multiply takes 16 rows x 32 k against 16 outputs, so 3 to 16 rows cost
 * one row's instructions, where the dot kernel's cost grows with the rows (1.5 one-row passes at 5 rows
 * on an AMX Xeon: bench/RESULTS.md, "One C call a layer"). It reads the same packed layout: a B tile is 16
 * pairs of k for 16 of a weight tile's 64 outputs, rows 256 bytes apart. k must be a multiple of 32 (a
 * tile's depth). Each output's sum runs over k in chunks of 32 in order, whatever the rows beside it, so a
 * row's result does not depend on its batch; the order within a chunk is the tile unit's, so the results
 * are not the dot kernel's bits (both float32 sums of the same products, rounded once to bf16).
 * Linux lends a process the tile registers only on request (arch_prctl ARCH_REQ_XCOMP_PERM), made once. */
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* GCC's tile intrinsics tell the compiler little about memory: _tile_loadconfig names 8 bytes of the
   configuration (the stores to the rest could be dropped), _tile_loadd and _tile_stored none at all (a
   buffer written only for a tile load could be dropped, one read after a tile store read early). So the
   configuration is loaded with its whole struct as the operand, and AMX_MEMORY() fences the compiler
   (no instruction) between plain stores and tile loads, and tile stores and plain loads. */
#define AMX_MEMORY() __asm__ volatile("" ::: "memory")

int bf16_rows_amx_ready(void) {  /* 1 where this process may use the tiles (asked once), else 0 */
    static int state;  /* 0: not asked yet; 1: granted; -1: refused */
    if (state == 0) {
        int ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
        __atomic_store_n(&state, ok ? 1 : -1, __ATOMIC_RELEASE);
    }
    return state == 1;
}

static void amx_configure(int rows) {  /* tiles 0-3: C (rows x 16 floats); 4: A (rows x 32 bf16); 5-7: B */
    amx_config_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.rows[t] = (uint8_t)rows;
        c.colsb[t] = 64;
    }
    for (int t = 5; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" : : "m"(c) : "memory");
}

/* the configured rows of x times one 64-output weight tile, the first `keep` rows written to out */
static void amx_tile(int keep, const uint16_t *x, long k, const uint16_t *w, long pairs, const float *bias,
                     uint16_t *out, long n_out, long col0) {
    float acc[16 * 64];
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    AMX_MEMORY();  /* x and the packed weight: written before this call */
    for (long p = 0; p < pairs; p += 16) {
        const uint16_t *line = w + p * TILE * 2;
        for (int i = 0; i < 64; i++)  /* the next chunk's 64 lines (4 KB), into L2 */
            _mm_prefetch((const char *)(line + 16 * TILE * 2 + i * 32), _MM_HINT_T1);
        _tile_loadd(4, x + 2 * p, k * 2);
        _tile_loadd(5, line, TILE * 4);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, line + 32, TILE * 4);
        _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(7, line + 64, TILE * 4);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, line + 96, TILE * 4);
        _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, acc, 256);
    _tile_stored(1, acc + 16, 256);
    _tile_stored(2, acc + 32, 256);
    _tile_stored(3, acc + 48, 256);
    AMX_MEMORY();
    store_tile(acc, keep, bias, out, n_out, col0);
}

/* bf16_rows_linear's contract on the tile unit where k is a multiple of 32 and the process has the tiles
 * (bf16_rows_amx_ready()); elsewhere bf16_rows_linear itself (a weight's form depends on its shape only). */
int bf16_rows_linear_amx(const uint16_t *x, long m, long k, const uint16_t *packed, long n, const float *bias,
                         uint16_t *out, int threads) {
    if (m <= 0 || n <= 0) return 0;
    if (k % 32 || !bf16_rows_amx_ready()) return EXPORT(x, m, k, packed, n, bias, out, threads);
    /* rows in groups of equal size (at most 16: a tile's rows), so that one tile configuration serves them
       all; x copied with zero rows to a whole number of groups where m is not one (their outputs dropped).
       Every group of a weight tile runs before the next tile, which is then read from memory once. */
    const long pairs = k / 2, tiles = (n + TILE - 1) / TILE, groups = (m + 15) / 16, per = (m + groups - 1) / groups;
    uint16_t *padded = NULL;
    if (groups * per != m) {
        padded = (uint16_t *)calloc((size_t)(groups * per) * (size_t)k, sizeof(uint16_t));
        if (!padded) return -1;
        memcpy(padded, x, (size_t)m * (size_t)k * sizeof(uint16_t));
        x = padded;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        amx_configure((int)per);
#pragma omp for schedule(static)
        for (long tile = 0; tile < tiles; tile++)
            for (long g = 0; g < groups; g++) {
                long r0 = g * per, rows = m - r0 < per ? m - r0 : per;
                amx_tile((int)rows, x + r0 * k, k, packed + tile * pairs * TILE * 2, pairs, bias,
                         out + r0 * n, n, tile * TILE);
            }
        _tile_release();
    }
    free(padded);
    return 0;
}
#define ROWS_LINEAR bf16_rows_linear_amx  /* what the layer kernel and the op call: the build's best form */
#else
#define ROWS_LINEAR EXPORT
#endif
