/* 4-bit weights x 8-bit activations for CPU decode and verification:
 *     y[m, n] = x[m, k] @ W[n, k]^T,   W in GGUF Q4_1 blocks of 32 (w = d * q + mn, q in 0..15)
 *
 * Plain C (no torch headers); loaded with ctypes by kernels/cpu_q4q8.py.
 *
 * Why: torch's int4 kernel costs about one more 1-row product for every extra row of x, so
 * verifying k drafts costs nearly k decode steps. Here every block of 32 weights is unpacked
 * once and then used by every row of x (up to QD_MAX_ROWS a pass), as llama.cpp does:
 *   - each row of x is rounded once per call to int8 in blocks of 32 (Q8: x ~ sx * xq,
 *     sx = max|x| / 127), with the block's sum  sumx = sx * sum(xq);
 *   - a block's dot product is exact integer arithmetic (u8 weight codes x s8 activations,
 *     4 products per 32-bit lane: vpdpbusd with AVX512-VNNI, vpmaddubsw + vpmaddwd on plain
 *     AVX2; the same integers either way, no saturation as 2 * 15 * 127 < 2^15);
 *   - y = sum_g (d[n,g] * sx[g] * isum[g] + mn[n,g] * sumx[g]) in fp32, fused multiply-adds
 *     in block order, one output column per vector lane (no horizontal sums), rounded once
 *     to bf16 (round to nearest even).
 * Every output element is computed by the same instructions in the same order whatever the
 * row count, the thread count and the instruction set (VNNI or AVX2), so a request's result
 * does not depend on its batch, on speculation or on the CPU kind. Where the CPU has
 * AMX-INT8, passes of many rows take their integer sums from tile multiplies instead
 * (cpu_q4q8_amx.h): the same integers, then the same fp32 operations in the same order.
 *
 * Layout (kernels/cpu_q4q8.py packs it; see QD_TILE): output columns in groups of 8, each
 * group's blocks interleaved column by column (per block: 4 chunks of [8 columns][4 bytes]
 * uint8 codes, [8] fp16 scales d and offsets mn). Where the VNNI loops run, groups 2p and
 * 2p + 1 are stored as a pair (flag QD_PAIRED), block by block: chunk j of block g holds
 * group 2p's 32 bytes then group 2p + 1's, and the block's d (and mn) group 2p's 8 then
 * group 2p + 1's; so one 64-byte load holds the chunk of 16 columns (cpu_q4q8_wide.h), while
 * the 8-column loops read their half. A last, odd group is stored alone. Either way group
 * cg's data starts at cg * (k/32) * 128 bytes of codes and cg * (k/32) * 8 scales
 * (group_at).
 *
 * qd_q8q8_linear does the same for Q8_0 weights (w = d * q, q int8: a GGUF's 8-bit LM head /
 * tied embedding), with its own layout (see QD_TILE8), and qd_q6q8_linear for Q6_K ones
 * (w = d * sc * q, q in -32..31, an int8 sc per 16 weights and an fp16 d per 256:
 * Qwen2.5's head and some of its layer matrices; see cpu_q4q8_six.h), and qd_q4kq8_linear
 * for 4-bit weights with a Q4_K file's own scales (see cpu_q4q8_k.h).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define QD_MAX_ROWS 16       /* rows of x per pass over the weights */
#define QD_GROUPS_PER_TASK 4  /* groups of 8 output columns a thread takes at a time */
#define QD_SERIAL_BYTES (48 * 1024)
_Static_assert(QD_GROUPS_PER_TASK % 2 == 0, "a task's groups are whole pairs (the layout)");

#define QD_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QD_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")))

/* Round row r of x (bf16 [rows, k]) to int8 blocks: xq [rows, k], sx and sumx
 * [rows, k / 32]. Per block of 32: amax = max |x| (NaNs skipped), sx = amax / 127,
 * q = clamp(round-to-nearest-even(x * (127 / amax)), -127, 127), sumx = sx * sum(q)
 * (``int_sums`` 1: the int32 -128 * sum(q) in sumx's place instead, for Q8_0 weights; 2:
 * the sums of the block's two halves of 16 as two int16s, low half first, for Q6_K ones).
 * Elementwise AVX2 on every CPU kind (the same instructions and roundings on both, lane by
 * lane: a scalar loop computing the same formula gives the same bits). */
static QD_AVX2 void quantize_row(const uint16_t* x, int r, int k, int8_t* xq, float* sx,
                                 float* sumx, int int_sums) {
    const int groups = k / 32;
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int g = 0; g < groups; g++) {
        const uint16_t* src = x + (size_t)r * k + (size_t)g * 32;
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            const __m128i h = _mm_loadu_si128((const __m128i*)(src + 8 * j));
            v[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            /* max(|x|, amax): the second operand wins on a NaN, so NaNs are skipped */
            amax = _mm256_max_ps(_mm256_and_ps(v[j], abs_mask), amax);
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float block_max = _mm_cvtss_f32(m4);
        const float scale = block_max / 127.0f;
        const __m256 inv = _mm256_set1_ps(block_max > 0.0f ? 127.0f / block_max : 0.0f);
        __m256i q[4];
        __m256i total = _mm256_setzero_si256();
        for (int j = 0; j < 4; j++) {
            const __m256 t = _mm256_round_ps(_mm256_mul_ps(v[j], inv),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[j] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(t),
                                                     _mm256_set1_epi32(127)),
                                    _mm256_set1_epi32(-127));
            total = _mm256_add_epi32(total, q[j]);
        }
        /* int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                  _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i*)(xq + (size_t)r * k + (size_t)g * 32),
                            _mm256_permutevar8x32_epi32(packed, order));
        __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total),
                                   _mm256_extracti128_si256(total, 1));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4e));
        t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xb1));
        sx[(size_t)r * groups + g] = scale;
        const int32_t block_sum = _mm_cvtsi128_si32(t4);
        if (int_sums == 2) {  /* Q6_K weights (cpu_q4q8_six.h): |sum of 16| <= 16 * 127 */
            const __m256i h = _mm256_add_epi32(q[0], q[1]);
            __m128i h4 = _mm_add_epi32(_mm256_castsi256_si128(h),
                                       _mm256_extracti128_si256(h, 1));
            h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0x4e));
            h4 = _mm_add_epi32(h4, _mm_shuffle_epi32(h4, 0xb1));
            const int32_t low = _mm_cvtsi128_si32(h4);
            ((int32_t*)sumx)[(size_t)r * groups + g] =
                (int32_t)((uint32_t)(uint16_t)(int16_t)low
                          | (uint32_t)(uint16_t)(int16_t)(block_sum - low) << 16);
        } else if (int_sums) {  /* Q8_0 weights: -128 * sum(q), see dot8s_vnni */
            ((int32_t*)sumx)[(size_t)r * groups + g] = -128 * block_sum;
        } else {
            sumx[(size_t)r * groups + g] = scale * (float)block_sum;
        }
    }
}

/* quantize_row for rows [0, rows): split between threads from 16 rows (a prefill chunk);
 * fewer run outside any OpenMP construct (a `parallel if (0)` region still enters libgomp:
 * ~0.4 us a call on the 2-core AVX2-only Zen 4, one per matmul). */
static QD_AVX2 void quantize_rows(const uint16_t* x, int rows, int k, int8_t* xq, float* sx,
                                  float* sumx, int int_sums, int threads) {
    if (rows < 16 || threads <= 1) {
        for (int r = 0; r < rows; r++) quantize_row(x, r, k, xq, sx, sumx, int_sums);
        return;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) quantize_row(x, r, k, xq, sx, sumx, int_sums);
}


/* The weights stream from DRAM once a step (96 MB for SmolLM2), and the hardware prefetcher
 * alone leaves the loops waiting: each tile also asks for the block ``ahead`` bytes past
 * the one it reads (past a tile's end: the next tile's, which follows in memory). On the
 * 2-core AVX512-BF16 EPYC the 16-column loop was 5-9 % slower than the 8-column one at 1-5 rows
 * from DRAM without it, and 1-6 % faster with it (docs/kernels.md). How far: 1 KB (4-bit)
 * and 2 KB (Q8_0) until session 54; 2-4 KB and 4-6 KB read within noise of those on the
 * AVX2-only EPYCs (whole steps 0.95-1.06x), and on the AMX Xeon VM 4 and 8 KB made
 * SmolLM2's whole 1-4-row steps 0.82-0.89x the time (short matrices, whose streams the
 * hardware prefetcher finds late; Qwen2.5-1.5B's 0.95-0.99x). */
#define QD_AHEAD_4BIT 4096
#define QD_AHEAD_8BIT 8192
#define QD_AHEAD_6BIT 2048  /* (an 8-column block; a 16-column one twice as far; 4 KB: noise) */

static inline __attribute__((always_inline)) void prefetch_ahead(const void* block, int bytes,
                                                                 int ahead) {
    for (int i = 0; i < bytes; i += 64)
        _mm_prefetch((const char*)block + ahead + i, _MM_HINT_T0);
}

/* Where column group cg's blocks are (the layouts in the header and cpu_q4q8_six.h), for
 * weights whose one group's block is ``block_bytes`` of codes (32-byte chunks) and 8 scales of
 * each kind: its first chunk and scales, and the strides between blocks and between chunks. */
typedef struct {
    size_t first;  /* column groups stored before its own (or its pair's) */
    int lane;      /* 0, or 1 for the second group of a pair: 8 columns into each chunk */
    size_t code0, scale0;  /* offsets of block 0's first chunk (bytes) and scales (values) */
    int block, chunk, scales;  /* strides: bytes per block and per chunk, values per block */
} GroupAt;

static inline __attribute__((always_inline)) GroupAt group_at(int cg, int col_groups,
                                                              int groups, int paired,
                                                              int block_bytes) {
    /* unpaired weights, or the odd last group of paired ones */
    const int alone = !paired || (cg == col_groups - 1 && col_groups % 2);
    GroupAt at;
    at.first = (size_t)(alone ? cg : cg & ~1);
    at.lane = alone ? 0 : cg & 1;
    at.code0 = at.first * groups * block_bytes + at.lane * 32;
    at.scale0 = at.first * groups * 8 + at.lane * 8;
    at.block = alone ? block_bytes : 2 * block_bytes;
    at.chunk = alone ? 32 : 64;
    at.scales = alone ? 8 : 16;
    return at;
}

/* Row r's 8 accumulated columns of group cg, rounded to bf16, into y [rows, n]. */
static inline __attribute__((always_inline)) QD_AVX2 void store_rows(const __m256* acc, int R,
                                                                     uint16_t* y, int cg,
                                                                     int n) {
    for (int r = 0; r < R; r++) {
        float out[8];
        _mm256_storeu_ps(out, acc[r]);
        for (int i = 0; i < 8; i++) y[(size_t)r * n + (size_t)cg * 8 + i] = f32_to_bf16(out[i]);
    }
}

/* A block's 8 chunks of codes (0..15) from its 4 stored chunks, ``chunk`` bytes apart: chunk j's
 * low nibbles (k = 32g + 4j .. +3) into w[j], its high nibbles (k + 16) into w[4 + j]. */
static inline __attribute__((always_inline)) QD_AVX2 void unpack4(const uint8_t* block,
                                                                  int chunk, __m256i* w) {
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int j = 0; j < 4; j++) {
        const __m256i b = _mm256_loadu_si256((const __m256i*)(block + chunk * j));
        w[j] = _mm256_and_si256(b, low);
        w[4 + j] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
    }
}

/* 8 output columns (group ``cg``) for R rows of x. The weights of a group are interleaved
 * so that 32-bit lane i of every vector belongs to column i: block g of the group is 4
 * 32-byte chunks, chunk j holding for each column 4 bytes whose low nibbles are the codes of
 * k = 32g + 4j .. +3 and whose high nibbles those of k = 32g + 16 + 4j .. +3. A block's dot
 * product is then 8 lane-wise integer dot products against 4 broadcast bytes of x each, with
 * no horizontal sums; per row and block:
 *     acc = fma(float(isum), d * sx, acc);   acc = fma(mn, sumx, acc)
 * with d and mn the 8 columns' fp16 scales (exact in fp32). The same instructions in the same
 * order run for every (column, row) pair whatever R is. */
#define QD_TILE(NAME, TARGET, DOT8)                                                        \
    static inline __attribute__((always_inline)) TARGET void NAME(                         \
            const int R, const uint8_t* codes, const uint16_t* d, const uint16_t* mn,      \
            const int8_t* xq, const float* sx, const float* sumx, uint16_t* y, int cg,     \
            int n, int k, int paired) {                                                    \
        const int groups = k / 32;                                                         \
        __m256 acc[QD_MAX_ROWS];                                                           \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                          \
        const GroupAt at = group_at(cg, n / 8, groups, paired, 128);                       \
        const uint8_t* cb = codes + at.code0;                                              \
        const uint16_t* db = d + at.scale0;                                                \
        const uint16_t* mb = mn + at.scale0;                                               \
        for (int g = 0; g < groups; g++) {                                                 \
            __m256i w[8];                                                                  \
            prefetch_ahead(cb + (size_t)g * at.block, at.block, QD_AHEAD_4BIT);            \
            unpack4(cb + (size_t)g * at.block, at.chunk, w);                               \
            const __m256 dv = _mm256_cvtph_ps(                                             \
                _mm_loadu_si128((const __m128i*)(db + (size_t)g * at.scales)));            \
            const __m256 mv = _mm256_cvtph_ps(                                             \
                _mm_loadu_si128((const __m128i*)(mb + (size_t)g * at.scales)));            \
            for (int r = 0; r < R; r++) {                                                  \
                const int8_t* xb = xq + (size_t)r * k + (size_t)g * 32;                    \
                const __m256i isum = DOT8(w, xb);                                          \
                const __m256 scale = _mm256_mul_ps(                                        \
                    dv, _mm256_set1_ps(sx[(size_t)r * groups + g]));                       \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);         \
                acc[r] = _mm256_fmadd_ps(                                                  \
                    mv, _mm256_set1_ps(sumx[(size_t)r * groups + g]), acc[r]);             \
            }                                                                              \
        }                                                                                  \
        store_rows(acc, R, y, cg, n);                                                      \
    }

static inline int32_t load4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* sum over the block's 32 (weight code, x) products per column lane. */
static inline __attribute__((always_inline)) QD_VNNI __m256i dot8_vnni(const __m256i* w,
                                                                       const int8_t* xb) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int j = 0; j < 4; j += 2) {
        a = _mm256_dpbusd_epi32(a, w[j], _mm256_set1_epi32(load4(xb + 4 * j)));
        b = _mm256_dpbusd_epi32(b, w[j + 1], _mm256_set1_epi32(load4(xb + 4 * j + 4)));
        a = _mm256_dpbusd_epi32(a, w[4 + j], _mm256_set1_epi32(load4(xb + 16 + 4 * j)));
        b = _mm256_dpbusd_epi32(b, w[5 + j], _mm256_set1_epi32(load4(xb + 20 + 4 * j)));
    }
    return _mm256_add_epi32(a, b);
}

/* AVX2: pairs of products as int16 (|sum of 8 pairs| <= 8 * 2 * 15 * 127 < 2^15), then
 * widened pairwise: the same integers as dot8_vnni. */
static inline __attribute__((always_inline)) QD_AVX2 __m256i dot8_avx2(const __m256i* w,
                                                                       const int8_t* xb) {
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(load4(xb + 4 * j))));
        s = _mm256_add_epi16(
            s, _mm256_maddubs_epi16(w[4 + j], _mm256_set1_epi32(load4(xb + 16 + 4 * j))));
    }
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

QD_TILE(tile_avx2, QD_AVX2, dot8_avx2)
QD_TILE(tile_vnni, QD_VNNI, dot8_vnni)

/* TILE(R, ...) with R a constant 1..QD_MAX_ROWS, so that the tiles' row loops unroll. */
#define QD_BY_ROWS(R, TILE, ...)                                                           \
    switch (R) {                                                                           \
    case 1: TILE(1, __VA_ARGS__); break;   case 2: TILE(2, __VA_ARGS__); break;            \
    case 3: TILE(3, __VA_ARGS__); break;   case 4: TILE(4, __VA_ARGS__); break;            \
    case 5: TILE(5, __VA_ARGS__); break;   case 6: TILE(6, __VA_ARGS__); break;            \
    case 7: TILE(7, __VA_ARGS__); break;   case 8: TILE(8, __VA_ARGS__); break;            \
    case 9: TILE(9, __VA_ARGS__); break;   case 10: TILE(10, __VA_ARGS__); break;          \
    case 11: TILE(11, __VA_ARGS__); break; case 12: TILE(12, __VA_ARGS__); break;          \
    case 13: TILE(13, __VA_ARGS__); break; case 14: TILE(14, __VA_ARGS__); break;          \
    case 15: TILE(15, __VA_ARGS__); break; default: TILE(16, __VA_ARGS__); break;          \
    }

/* Column groups [lo, hi) for R rows. */
#define QD_COLUMNS(NAME, TARGET, TILE)                                                     \
    static TARGET void NAME(int R, const uint8_t* codes, const uint16_t* d,                \
                            const uint16_t* mn, const int8_t* xq, const float* sx,         \
                            const float* sumx, uint16_t* y, int lo, int hi, int n, int k,  \
                            int paired) {                                                  \
        for (int cg = lo; cg < hi; cg++) {                                                 \
            QD_BY_ROWS(R, TILE, codes, d, mn, xq, sx, sumx, y, cg, n, k, paired)           \
        }                                                                                  \
    }
QD_COLUMNS(columns_avx2, QD_AVX2, tile_avx2)
QD_COLUMNS(columns_vnni, QD_VNNI, tile_vnni)

/* ---- Q8_0 weights (w = d * q, q int8, blocks of 32): a model's 8-bit LM head --------------
 * Layout: codes [n/8][k/32][8][8][4] int8 (block g of a column group: 8 chunks of 32 bytes,
 * chunk j holding for each column the 4 codes of k = 32g + 4j .. +3), d [n/8][k/32][8] fp16;
 * column groups unpaired (16 columns a vector gained nothing here: cpu_q4q8_wide.h).
 * The products are signed x signed, the instructions unsigned x signed; both loops give the
 * exact integer sum(w * xq), so the same bits on VNNI and AVX2:
 *   - AVX2 feeds |w| and x with w's sign (vpsignb) to vpmaddubsw (|pair| <= 2 * 128 * 127 <
 *     2^15, no saturation);
 *   - VNNI feeds w + 128 (w xor 0x80, once per block for every row) to vpdpbusd, starting
 *     the sum at -128 * sum(xq) (quantize_rows stores it in sumx's place, which Q8_0 weights
 *     have no use for): no vpsignb per row and chunk, the LM head 10-20 % faster a call.
 * Per row and block:  acc = fma(float(isum), d * sx, acc). */
static inline __attribute__((always_inline)) QD_VNNI __m256i dot8s_vnni(const __m256i* uw,
                                                                        const __m256i* w,
                                                                        const int8_t* xb,
                                                                        int32_t corr) {
    (void)w;
    __m256i a = _mm256_set1_epi32(corr), b = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        a = _mm256_dpbusd_epi32(a, uw[j], _mm256_set1_epi32(load4(xb + 4 * j)));
        b = _mm256_dpbusd_epi32(b, uw[j + 1], _mm256_set1_epi32(load4(xb + 4 * j + 4)));
    }
    return _mm256_add_epi32(a, b);
}

static inline __attribute__((always_inline)) QD_AVX2 __m256i dot8s_avx2(const __m256i* aw,
                                                                        const __m256i* w,
                                                                        const int8_t* xb,
                                                                        int32_t corr) {
    (void)corr;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(load4(xb + 4 * j)), w[j]);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(aw[j], xs), ones));
    }
    return s;
}

#define QD_TILE8(NAME, TARGET, PREP, DOT8)                                                 \
    static inline __attribute__((always_inline)) TARGET void NAME(                         \
            const int R, const int8_t* codes, const uint16_t* d, const int8_t* xq,         \
            const float* sx, const float* sumx, uint16_t* y, int cg, int n, int k) {       \
        const int groups = k / 32;                                                         \
        __m256 acc[QD_MAX_ROWS];                                                           \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                          \
        const int8_t* cb = codes + (size_t)cg * groups * 256;                              \
        const uint16_t* db = d + (size_t)cg * groups * 8;                                  \
        for (int g = 0; g < groups; g++) {                                                 \
            __m256i w[8], aw[8];                                                           \
            prefetch_ahead(cb + g * 256, 256, QD_AHEAD_8BIT);                              \
            for (int j = 0; j < 8; j++) {                                                  \
                w[j] = _mm256_loadu_si256((const __m256i*)(cb + g * 256 + 32 * j));        \
                aw[j] = PREP(w[j]);                                                        \
            }                                                                              \
            const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(db + g * 8))); \
            for (int r = 0; r < R; r++) {                                                  \
                const __m256i isum = DOT8(aw, w, xq + (size_t)r * k + (size_t)g * 32,      \
                                          ((const int32_t*)sumx)[(size_t)r * groups + g]); \
                const __m256 scale = _mm256_mul_ps(                                        \
                    dv, _mm256_set1_ps(sx[(size_t)r * groups + g]));                       \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);         \
            }                                                                              \
        }                                                                                  \
        store_rows(acc, R, y, cg, n);                                                      \
    }

#define QD_ABS8(v) _mm256_abs_epi8(v)
#define QD_UNSIGNED8(v) _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80))
QD_TILE8(tile8_avx2, QD_AVX2, QD_ABS8, dot8s_avx2)
QD_TILE8(tile8_vnni, QD_VNNI, QD_UNSIGNED8, dot8s_vnni)

#define QD_COLUMNS8(NAME, TARGET, TILE)                                                    \
    static TARGET void NAME(int R, const int8_t* codes, const uint16_t* d, const int8_t* xq, \
                            const float* sx, const float* sumx, uint16_t* y, int lo, int hi, \
                            int n, int k) {                                                \
        for (int cg = lo; cg < hi; cg++) {                                                 \
            QD_BY_ROWS(R, TILE, codes, d, xq, sx, sumx, y, cg, n, k)                       \
        }                                                                                  \
    }
QD_COLUMNS8(columns8_avx2, QD_AVX2, tile8_avx2)
QD_COLUMNS8(columns8_vnni, QD_VNNI, tile8_vnni)

#include "cpu_q4q8_wide.h"
#include "cpu_q4q8_six.h"
#include "cpu_q4q8_k.h"
#include "cpu_q4q8_amx.h"

/* ``flags`` of the entry points: which loops run and how the weights are laid out. */
#define QD_LOOP_VNNI 1  /* the AVX512-VNNI loops (else AVX2; the same bits) */
#define QD_PAIRED 2     /* 4- or 6-bit weights, column groups in pairs (the header's layout) */
#define QD_LOOP_AMX 4   /* with QD_LOOP_VNNI: the AMX loops for passes of enough rows */
/* with QD_LOOP_AMX: the fewest rows a pass runs on the AMX loops, for paired 4-bit weights
 * (bits 8-12) and Q8_0 ones (bits 13-17); 0: never (kernels/cpu_q4q8.py measures them) */
#define QD_AMX_ROWS4(flags) (((flags) >> 8) & 31)
#define QD_AMX_ROWS8(flags) (((flags) >> 13) & 31)

/* y [rows, n] bf16 = x [rows, k] bf16 @ W^T. ``scratch`` holds rows * (k + 8 * k / 32) bytes
 * (the int8 rows and their block scales and sums). Returns 0, or -1 for shapes it does not
 * take (k % 32 != 0, n < 1, rows < 1; only 4- and 6-bit weights paired; Q4_K ones need
 * k % 256 == 0). VNNI on paired 4- or 6-bit weights runs 16 columns a vector
 * (cpu_q4q8_wide.h, cpu_q4q8_six.h); everything else the 8-column loops, which read either
 * layout. */
enum { QD_Q4 = 0, QD_Q8 = 1, QD_Q6 = 2, QD_Q4K = 3 };  /* linear_any's weight kinds */

/* ``yf`` (may be NULL): also y's values as fp32 [rows, n] (exact: bf16 -> fp32), each
 * task's columns converted by the thread that computed them, while they are in its cache. */
static int linear_any(const uint16_t* x, const void* codes, const void* d,
                      const uint16_t* mn, int kind, uint16_t* y, float* yf, int rows, int n,
                      int k, int threads, int flags, void* scratch) {
    const int vnni = flags & QD_LOOP_VNNI, paired = (flags & QD_PAIRED) != 0;
    if (rows < 1 || n < 8 || n % 8 || k < 32 || k % 32
        || (kind != QD_Q4 && kind != QD_Q6 && paired) || (kind == QD_Q4K && k % 256))
        return -1;
    const int groups = k / 32;
    int8_t* xq = (int8_t*)scratch;
    float* sx = (float*)(xq + (size_t)rows * k);
    float* sumx = sx + (size_t)rows * groups;
    quantize_rows(x, rows, k, xq, sx, sumx, kind == QD_Q6 ? 2 : kind == QD_Q8,
                  threads < 1 ? 1 : threads);
    const int col_groups = n / 8;
    const int tasks = (col_groups + QD_GROUPS_PER_TASK - 1) / QD_GROUPS_PER_TASK;
    const size_t bytes = (size_t)n * groups * (kind == QD_Q4 ? 20 : kind == QD_Q4K ? 18
                                                : kind == QD_Q6 ? 26 : 34);
    if (threads < 1 || bytes < QD_SERIAL_BYTES) threads = 1;
    const int amx = (flags & QD_LOOP_AMX) && vnni;
    const int amx4 = amx && kind == QD_Q4 && paired ? QD_AMX_ROWS4(flags) : 0;
    const int amx8 = amx && kind == QD_Q8 ? QD_AMX_ROWS8(flags) : 0;
#pragma omp parallel num_threads(threads)
    {
        int tiles = 0;  /* the shapes this thread's AMX tiles have (R * 32 + columns); 0: none */
#pragma omp for schedule(static)
        for (int t = 0; t < tasks; t++) {
            const int lo = t * QD_GROUPS_PER_TASK;
            const int hi = lo + QD_GROUPS_PER_TASK < col_groups ? lo + QD_GROUPS_PER_TASK
                                                                : col_groups;
            for (int r0 = 0; r0 < rows; r0 += QD_MAX_ROWS) {
                const int R = rows - r0 < QD_MAX_ROWS ? rows - r0 : QD_MAX_ROWS;
                const int8_t* xr = xq + (size_t)r0 * k;
                const float* sr = sx + (size_t)r0 * groups;
                const float* ur = sumx + (size_t)r0 * groups;
                uint16_t* yr = y + (size_t)r0 * n;
                const int on_amx = (amx4 && R >= amx4) || (amx8 && R >= amx8);
                const int columns = kind == QD_Q8 ? 8 : 16;  /* an AMX tile multiply's */
                if (on_amx && tiles != R * 32 + columns) {
                    tiles = R * 32 + columns;
                    amx_configure(R, columns);
                }
                if (kind == QD_Q4K) {
                    columnsk_avx2(R, (const uint8_t*)codes, (const uint8_t*)d, mn, xr, sr, ur,
                                  yr, lo, hi, n, k);
                } else if (kind == QD_Q6) {
                    const uint8_t* c6 = (const uint8_t*)codes;
                    const int8_t* s6 = (const int8_t*)d;
                    if (vnni && paired)
                        wide6_vnni(R, c6, s6, mn, xr, sr, ur, yr, lo, hi, n, k);
                    else
                        (vnni ? columns6_vnni : columns6_avx2)(R, c6, s6, mn, xr, sr, ur, yr,
                                                               lo, hi, n, k, paired);
                } else if (kind == QD_Q8) {
                    const int8_t* c8 = (const int8_t*)codes;
                    const uint16_t* d8 = (const uint16_t*)d;
                    if (on_amx)
                        columns8_amx(R, c8, d8, xr, sr, ur, yr, lo, hi, n, k);
                    else if (vnni)
                        columns8_vnni(R, c8, d8, xr, sr, ur, yr, lo, hi, n, k);
                    else
                        columns8_avx2(R, c8, d8, xr, sr, ur, yr, lo, hi, n, k);
                } else {
                    const uint8_t* c4 = (const uint8_t*)codes;
                    const uint16_t* d4 = (const uint16_t*)d;
                    if (on_amx)
                        wide_amx(R, c4, d4, mn, xr, sr, ur, yr, lo, hi, n, k);
                    else if (vnni && paired)
                        wide_vnni(R, c4, d4, mn, xr, sr, ur, yr, lo, hi, n, k);
                    else if (vnni)
                        columns_vnni(R, c4, d4, mn, xr, sr, ur, yr, lo, hi, n, k, 0);
                    else
                        columns_avx2(R, c4, d4, mn, xr, sr, ur, yr, lo, hi, n, k, paired);
                }
            }
            if (yf) {
                for (int r = 0; r < rows; r++)
                    for (int c = lo * 8; c < hi * 8; c++)
                        yf[(size_t)r * n + c] = bf16_to_f32(y[(size_t)r * n + c]);
            }
        }
        if (tiles) amx_release();
    }
    return 0;
}

/* 4-bit weights (the layout above QD_TILE). */
int qd_q4q8_linear(const uint16_t* x, const uint8_t* codes, const uint16_t* d, const uint16_t* mn,
                   uint16_t* y, int rows, int n, int k, int threads, int flags, void* scratch) {
    return linear_any(x, codes, d, mn, QD_Q4, y, NULL, rows, n, k, threads, flags, scratch);
}

/* Q8_0 weights (the layout above QD_TILE8); same scratch. */
int qd_q8q8_linear(const uint16_t* x, const int8_t* codes, const uint16_t* d, uint16_t* y,
                   int rows, int n, int k, int threads, int flags, void* scratch) {
    return linear_any(x, codes, d, NULL, QD_Q8, y, NULL, rows, n, k, threads, flags, scratch);
}

/* qd_q8q8_linear, also writing the result as fp32 into yf [rows, n] (an LM head's logits:
 * no separate conversion pass); y still receives the bf16 result. */
int qd_q8q8_linear_f32(const uint16_t* x, const int8_t* codes, const uint16_t* d, uint16_t* y,
                       float* yf, int rows, int n, int k, int threads, int flags,
                       void* scratch) {
    if (!yf) return -1;
    return linear_any(x, codes, d, NULL, QD_Q8, y, yf, rows, n, k, threads, flags, scratch);
}

/* Q6_K weights (the layout in cpu_q4q8_six.h: sc in d's place, d in mn's; paired or not, as
 * 4-bit ones); same scratch. */
int qd_q6q8_linear(const uint16_t* x, const uint8_t* codes, const int8_t* sc,
                   const uint16_t* d, uint16_t* y, int rows, int n, int k, int threads,
                   int flags, void* scratch) {
    return linear_any(x, codes, sc, d, QD_Q6, y, NULL, rows, n, k, threads, flags, scratch);
}

/* qd_q6q8_linear with qd_q8q8_linear_f32's fp32 copy of the result. */
int qd_q6q8_linear_f32(const uint16_t* x, const uint8_t* codes, const int8_t* sc,
                       const uint16_t* d, uint16_t* y, float* yf, int rows, int n, int k,
                       int threads, int flags, void* scratch) {
    if (!yf) return -1;
    return linear_any(x, codes, sc, d, QD_Q6, y, yf, rows, n, k, threads, flags, scratch);
}

/* Q4_K weights with the file's own scales (the layout in cpu_q4q8_k.h: sm in d's place, dd in
 * mn's; k % 256 == 0); same scratch; the AVX2 loop whatever flags. */
int qd_q4kq8_linear(const uint16_t* x, const uint8_t* codes, const uint8_t* sm,
                    const uint16_t* dd, uint16_t* y, int rows, int n, int k, int threads,
                    int flags, void* scratch) {
    return linear_any(x, codes, sm, dd, QD_Q4K, y, NULL, rows, n, k, threads,
                      flags & ~QD_PAIRED, scratch);
}
