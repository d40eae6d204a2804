/* The AMX loops of cpu_q4q8.c (Intel AMX-INT8: Sapphire Rapids and later), for the rows of a
 * verification or a prefill: a block's integer dot products for every row and 16 (4-bit) or
 * 8 (Q8_0) output columns in one tile multiply, instead of one vpdpbusd chain per row.
 *
 * Per block of 32 inputs:
 *   - tile QD_TX: the rows' 32 int8 of x (R rows, read in place: xq's rows are k bytes apart);
 *   - tile QD_TW (4-bit) or QD_TW8 (Q8_0): the weights in AMX's "B" layout, 8 rows (k / 4) of
 *     [columns][4 bytes]. That is exactly how the kernel stores a block (chunk j holds each
 *     column's codes of k = 4j .. 4j + 3 for the low nibbles, k = 16 + 4j .. for the high
 *     ones), so a Q8_0 block is loaded straight from the weights and a 4-bit one after the
 *     unpacking every loop does (its 8 chunks stored to a 512-byte buffer);
 *   - tdpbsud (s8 x u8: 4-bit codes) or tdpbssd (s8 x s8: Q8_0 codes) into tile QD_TC /
 *     QD_TC8: isum [R rows][columns] int32, the exact integers the VNNI and AVX2 loops compute
 *     (for Q8_0 without their +128 offset and its correction: the same sum);
 *   - then, per row, tile16_vnni's / tile8_vnni's fp32 operations in their order on those
 *     integers: cvt, the scale product, one (Q8_0) or two (4-bit) fused multiply-adds.
 * So the bits are those of the VNNI and AVX2 loops, whatever the rows, threads and loop.
 *
 * The tile configuration is a thread's state that other code (oneDNN's AMX matmuls in torch)
 * changes too: linear_any loads it in each thread that runs these loops, once a call and
 * again when a pass's row count changes, and releases the tiles before returning. Linux needs
 * the process's permission first (qd_amx_enable, called by kernels/cpu_q4q8.py at load).
 *
 * Included by cpu_q4q8.c only (it uses its helpers: load4, prefetch_ahead, store_rows,
 * store_rows16, scales16). */
#include "cpu_amx.h"

#define QD_AMX __attribute__((target( \
    "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni,amx-tile,amx-int8")))

/* Tiles: two sets of (x, weights, isum) so that two blocks' tile work overlaps: set 0 is
 * tiles 0-2, set 1 tiles 3-5; the weights' and isum's widths are those of the loop's
 * columns, 16 (4-bit pairs) or 8 (Q8_0). One block at a time, unpacking each block just
 * before its tile load and reading its isums right after the tile store, the 4-bit loop
 * took ~130 cycles a block at 1 row on the 2-core AMX Xeon VM (4x the VNNI loop); with two
 * sets ~90, and unpacking a batch of blocks before any of their tile loads ~65
 * (docs/kernels.md). */
#define QD_AMX_BATCH 8  /* blocks whose isums are computed before their fp32 part runs */

/* Ask Linux for the AMX tile state (cpu_amx.h): 1 when granted (or already), else 0. */
int qd_amx_enable(void) { return qd_amx_permitted(); }

/* Load this thread's tile shapes for passes of R rows (1..16) and ``columns`` (16 or 8). */
static QD_AMX void amx_configure(int R, int columns) {
    QdTileConfig c;
    memset(&c, 0, sizeof c);
    for (int set = 0; set < 2; set++) {
        c.rows[3 * set] = (uint8_t)R;      c.colsb[3 * set] = 32;  /* x: R rows of 32 int8 */
        c.rows[3 * set + 1] = 8;           /* weights: [k/4][columns][4] codes */
        c.colsb[3 * set + 1] = (uint16_t)(4 * columns);
        c.rows[3 * set + 2] = (uint8_t)R;  /* isum: [R][columns] int32 */
        c.colsb[3 * set + 2] = (uint16_t)(4 * columns);
    }
    qd_tiles_load(&c);
}

static QD_AMX void amx_release(void) { _tile_release(); }

/* isum [R][columns] int32 of one block on the tiles (TX, TW, TC): x rows at xb (k bytes
 * apart), the block's codes at wb (4 * columns bytes a k/4 row), signed (Q8_0, SIGNED 1) or
 * unsigned (4-bit) codes. */
#define QD_AMX_BLOCK(TX, TW, TC, SIGNED, xb, k, wb, columns, out)                          \
    do {                                                                                   \
        _tile_loadd(TW, wb, 4 * (columns));                                                \
        _tile_loadd(TX, xb, k);                                                            \
        _tile_zero(TC);                                                                    \
        if (SIGNED) _tile_dpbssd(TC, TX, TW);                                              \
        else _tile_dpbsud(TC, TX, TW);                                                     \
        _tile_stored(TC, out, 4 * (columns));                                              \
    } while (0)

/* The batch of blocks from g0 (at most QD_AMX_BATCH; none when g0 >= groups) of one column
 * range, whose blocks are 256 bytes apart (a 4-bit pair's or a Q8_0 group's): their isums
 * into isum [nb][R][columns], two blocks at a time on the two tile sets; ``unpack`` (4-bit)
 * first writes every block's codes (0..15) to wt in the weights tile's layout. Its callers
 * issue batch b + 1's tile work before batch b's fp32 part reads batch b's isums from the
 * other half of a [2][QD_AMX_BATCH][R][columns] buffer, so that the tile stores have landed
 * by then (on this VM it measured the same as computing each batch's isums just before its
 * fp32 part: kept for machines where a tile store's data reaches vector loads late). */
static inline __attribute__((always_inline)) QD_AMX void amx_batch(
        const int R, const int columns, const int unpack, const uint8_t* cb, const int8_t* xq,
        int k, int groups, int g0, int32_t* isum) {
    const int nb = groups - g0 < QD_AMX_BATCH ? groups - g0 : QD_AMX_BATCH;
    _Alignas(64) uint8_t wt[QD_AMX_BATCH][8 * 64];
    const uint8_t* w[QD_AMX_BATCH];
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int i = 0; i < nb; i++) {
        const uint8_t* src = cb + (size_t)(g0 + i) * 256;
        prefetch_ahead(src, 256, unpack ? QD_AHEAD_4BIT : QD_AHEAD_8BIT);
        w[i] = src;
        if (unpack) {  /* (all the batch's stores before any tile load reads them) */
            for (int j = 0; j < 4; j++) {
                const __m512i b = _mm512_loadu_si512((const void*)(src + 64 * j));
                _mm512_store_si512((void*)(wt[i] + 64 * j), _mm512_and_si512(b, low));
                _mm512_store_si512((void*)(wt[i] + 64 * (4 + j)),
                                   _mm512_and_si512(_mm512_srli_epi32(b, 4), low));
            }
            w[i] = wt[i];
        }
    }
    for (int i = 0; i < nb; i += 2) {
        const int8_t* x0 = xq + (size_t)(g0 + i) * 32;
        int32_t* out0 = isum + (size_t)i * R * columns;
        QD_AMX_BLOCK(0, 1, 2, !unpack, x0, k, w[i], columns, out0);
        if (i + 1 < nb)
            QD_AMX_BLOCK(3, 4, 5, !unpack, x0 + 32, k, w[i + 1], columns, out0 + R * columns);
    }
}

/* 4-bit weights: groups cg (even) and cg + 1, R rows (tile16_vnni's arithmetic). */
static inline __attribute__((always_inline)) QD_AMX void tile16_amx(
        const int R, const uint8_t* codes, const uint16_t* d, const uint16_t* mn,
        const int8_t* xq, const float* sx, const float* sumx, uint16_t* y, int cg, int n,
        int k) {
    const int groups = k / 32;
    __m512 acc[QD_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const uint8_t* cb = codes + (size_t)cg * groups * 128;  /* [k/32][4][16][4] */
    const uint16_t* db = d + (size_t)cg * groups * 8;       /* [k/32][16] */
    const uint16_t* mb = mn + (size_t)cg * groups * 8;
    _Alignas(64) int32_t isum[2][QD_AMX_BATCH * QD_MAX_ROWS * 16];  /* (amx_batch) */
    amx_batch(R, 16, 1, cb, xq, k, groups, 0, isum[0]);
    for (int g0 = 0, b = 0; g0 < groups; g0 += QD_AMX_BATCH, b ^= 1) {
        amx_batch(R, 16, 1, cb, xq, k, groups, g0 + QD_AMX_BATCH, isum[b ^ 1]);
        const int nb = groups - g0 < QD_AMX_BATCH ? groups - g0 : QD_AMX_BATCH;
        for (int i = 0; i < nb; i++) {
            const int g = g0 + i;
            const __m512 dv = scales16(db, g), mv = scales16(mb, g);
            for (int r = 0; r < R; r++) {
                const __m512 scale = _mm512_mul_ps(dv, _mm512_set1_ps(sx[(size_t)r * groups + g]));
                const __m512i s = _mm512_load_si512((const void*)(isum[b] + (i * R + r) * 16));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, acc[r]);
                acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(sumx[(size_t)r * groups + g]),
                                         acc[r]);
            }
        }
    }
    store_rows16(acc, R, y, cg, n);
}

/* Column groups [lo, hi) (lo even) of paired 4-bit weights: pairs on the AMX tiles, an odd
 * last group on the 8-column VNNI loop. */
static QD_AMX void wide_amx(int R, const uint8_t* codes, const uint16_t* d, const uint16_t* mn,
                            const int8_t* xq, const float* sx, const float* sumx, uint16_t* y,
                            int lo, int hi, int n, int k) {
    int cg = lo;
    for (; cg + 1 < hi; cg += 2) {
        QD_BY_ROWS(R, tile16_amx, codes, d, mn, xq, sx, sumx, y, cg, n, k)
    }
    if (cg < hi) columns_vnni(R, codes, d, mn, xq, sx, sumx, y, cg, hi, n, k, 1);
}

/* Q8_0 weights: group cg, R rows (tile8_vnni's arithmetic; sumx's -128 * sum(xq) unused). */
static inline __attribute__((always_inline)) QD_AMX void tile8_amx(
        const int R, const int8_t* codes, const uint16_t* d, const int8_t* xq, const float* sx,
        const float* sumx, uint16_t* y, int cg, int n, int k) {
    (void)sumx;
    const int groups = k / 32;
    __m256 acc[QD_MAX_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t* cb = (const uint8_t*)codes + (size_t)cg * groups * 256;  /* [k/32][8][8][4] */
    const uint16_t* db = d + (size_t)cg * groups * 8;
    _Alignas(64) int32_t isum[2][QD_AMX_BATCH * QD_MAX_ROWS * 8];  /* (amx_batch) */
    amx_batch(R, 8, 0, cb, xq, k, groups, 0, isum[0]);
    for (int g0 = 0, b = 0; g0 < groups; g0 += QD_AMX_BATCH, b ^= 1) {
        amx_batch(R, 8, 0, cb, xq, k, groups, g0 + QD_AMX_BATCH, isum[b ^ 1]);
        const int nb = groups - g0 < QD_AMX_BATCH ? groups - g0 : QD_AMX_BATCH;
        for (int i = 0; i < nb; i++) {
            const int g = g0 + i;
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(db + g * 8)));
            for (int r = 0; r < R; r++) {
                const __m256 scale = _mm256_mul_ps(dv, _mm256_set1_ps(sx[(size_t)r * groups + g]));
                const __m256i s = _mm256_load_si256((const __m256i*)(isum[b] + (i * R + r) * 8));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scale, acc[r]);
            }
        }
    }
    store_rows(acc, R, y, cg, n);
}

static QD_AMX void columns8_amx(int R, const int8_t* codes, const uint16_t* d, const int8_t* xq,
                                const float* sx, const float* sumx, uint16_t* y, int lo,
                                int hi, int n, int k) {
    for (int cg = lo; cg < hi; cg++) {
        QD_BY_ROWS(R, tile8_amx, codes, d, xq, sx, sumx, y, cg, n, k)
    }
}
