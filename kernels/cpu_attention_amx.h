/* The AMX-BF16 lane of cpu_attention.c ("amx" variant: Intel Sapphire Rapids and later): the
 * dot lane's q K^T and P V (cpu_attention_dot.h) as tile multiplies (tdpbf16ps), for up to
 * 16 query heads at once: the G heads of one row, or of several rows of a task that read the
 * same chunk (a verification's rows, a prefill chunk). Included once, by cpu_attention.c
 * (kernels/cbuild.py expands it).
 *
 * Arithmetic of one (query row, kv head) lane over a chunk of n <= QD_CHUNK positions, the
 * chunk packed by pack_chunk_dot (kt: K as dim pairs x positions, AMX's B layout; vi: V as
 * position pairs x dims, zero past n):
 *   s_g[j] = scale * tdot(q_g, k_j)     the tile's fp32 sum over D / 32 steps of 32 dims
 *   the online softmax of softmax_step in 16 lanes (softmax_head16: the same max and
 *   weights exp(s - m), the chunk's sum of weights in another order)
 *   acc_g += tdot(bf16(w_g), V)         one tile sum from zero over the 16 position pairs,
 *                                       then added to acc_g in fp32
 * Every tile row (query head) is computed on its own: which other heads share the tile (the
 * row's alone, or other rows' too, or stale rows past the last) never changes its bits (one
 * row of C depends only on its row of A and on B; checked on the 2-core AMX Xeon VM, and by
 * the tests: verification rows against lone decodes). So a lane's bits depend only on its q,
 * the chunk and its state, as in the other lanes: the same whatever else is in the step,
 * however lanes are grouped into tasks, whatever the thread count. The lanes may differ in
 * the last bits (tdpbf16ps sums in another order than vdpbf16ps; in practice the outputs
 * equalled the dot lane's on random inputs: both round P to bf16, and an fp32 sum's last bit
 * moves a bf16 output only at a rounding boundary). Needs head_dim % 32 == 0 and
 * at most 16 heads per kv head (cpu_attention.c falls back to the dot lane otherwise).
 *
 * Tiles (every one 16 rows of 64 bytes, configured once a task: the configuration is a
 * thread's state, which oneDNN's and cpu_q4q8's tile code change too; released after):
 *   q K^T: 0, 1 = S for positions 0-15, 16-31 (fp32 [16 heads][16]); 2 = q (bf16 [16][32
 *          dims]); 3, 4 = kt for the two halves (words [16 dim pairs][16 positions]);
 *   P V:   2 = the weights (bf16 [16 heads][32 positions]); 3, 4 = vi (words [16 position
 *          pairs][16 dims]); 5, 6 = their products (fp32 [16 heads][16 dims]). */
#ifndef QD_CPU_ATTENTION_AMX_H
#define QD_CPU_ATTENTION_AMX_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_amx.h"
#include "cpu_attention_dot.h"
#include "cpu_attention_lane.h"

#define QD_AMX_TARGET __attribute__((target( \
    "avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,amx-tile,amx-bf16")))
#define QD_AMX_HEADS 16 /* query heads a tile multiply takes (its rows) */

/* This thread's tiles 0-6, every one 16 rows of 64 bytes. */
static QD_AMX_TARGET void amx_tiles_configure(void) {
    QdTileConfig c;
    memset(&c, 0, sizeof c);
    for (int t = 0; t < 7; ++t) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    qd_tiles_load(&c);
}

static QD_AMX_TARGET void amx_tiles_release(void) { _tile_release(); }

/* exp_ps (cpu_attention_lane.h) in 16 lanes: the same definition (QD_DEFINE_EXP), so the
 * same values. (Two exp_ps calls on the halves made a chunk's step 1.22-1.37x slower,
 * `/work/prof/s56/micro`, 1 and 5 rows.) */
QD_DEFINE_EXP(exp16, 512, _mm512_roundscale_ps, QD_AMX_TARGET)

/* One head's online-softmax step over a chunk of n raw scores s [QD_CHUNK] (q.k, not yet
 * scaled): the running max *m and sum *l, acc [D] rescaled when the max rises, and the
 * weights exp(scale s - m), 0 past n, stored as bf16 into w [QD_CHUNK]. */
static inline __attribute__((always_inline)) QD_AMX_TARGET void softmax_head16(
        const float* s, float* acc, float* m, float* l, uint16_t* w, __mmask16 m0,
        __mmask16 m1, int D, __m512 vscale) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    const __m512 s0 = _mm512_mul_ps(_mm512_load_ps(s), vscale);
    const __m512 s1 = _mm512_mul_ps(_mm512_load_ps(s + 16), vscale);
    const float cmax = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_mask_mov_ps(ninf, m0, s0), _mm512_mask_mov_ps(ninf, m1, s1)));
    const float mnew = cmax > *m ? cmax : *m;
    if (mnew > *m) {
        const float alpha = expf(*m - mnew); /* 0 on the first chunk */
        *l *= alpha;
        const __m512 va = _mm512_set1_ps(alpha);
        for (int dd = 0; dd < D; dd += 16)
            _mm512_storeu_ps(acc + dd, _mm512_mul_ps(_mm512_loadu_ps(acc + dd), va));
        *m = mnew;
    }
    const __m512 vm = _mm512_set1_ps(mnew);
    const __m512 w0 = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(s0, vm)));
    const __m512 w1 = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(s1, vm)));
    *l += _mm512_reduce_add_ps(_mm512_add_ps(w0, w1));
    _mm512_store_si512((__m512i*)w, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}

/* The step of M rows (M * G <= 16 heads) of one kv head over a chunk of n positions packed
 * by pack_chunk_dot, vi zero past n (pairs n/2 .. 15 included). qa: the rows' bf16 q,
 * [M * G][D] stacked, readable for 16 rows (rows past M * G are ignored); acc[i] ([G][D]),
 * m[i], l[i] ([G]): row i's running state; sc: [16][QD_CHUNK] fp32 scratch. */
static QD_AMX_TARGET void rows_chunk_amx(const uint16_t* qa, float* const* acc,
                                         float* const* m, float* const* l, float* sc,
                                         const uint32_t* kt, const uint32_t* vi, int n, int M,
                                         int G, int D, float scale) {
    const int heads = M * G, two = n > 16;
    /* S [16][QD_CHUNK] = q K^T, 32 dims a step */
    _tile_zero(0);
    _tile_zero(1);
    for (int k0 = 0; k0 < D; k0 += 32) {
        const uint32_t* kb = kt + (size_t)(k0 / 2) * QD_CHUNK;
        _tile_loadd(2, qa + k0, D * 2);
        _tile_loadd(3, kb, QD_CHUNK * 4);
        _tile_dpbf16ps(0, 2, 3);
        if (two) {
            _tile_loadd(4, kb + 16, QD_CHUNK * 4);
            _tile_dpbf16ps(1, 2, 4);
        }
    }
    _tile_stored(0, sc, QD_CHUNK * 4);
    if (two) _tile_stored(1, sc + 16, QD_CHUNK * 4);
    /* the weights, bf16 [16][QD_CHUNK] (0 past n; heads past the last: 0) */
    uint16_t w[QD_AMX_HEADS * QD_CHUNK] __attribute__((aligned(64)));
    const __mmask16 m0 = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? (__mmask16)0xffff
                                 : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : (__mmask16)0;
    const __m512 vs = _mm512_set1_ps(scale);
    for (int x = 0; x < heads; ++x)
        softmax_head16(sc + x * QD_CHUNK, acc[x / G] + (size_t)(x % G) * D, m[x / G] + x % G,
                       l[x / G] + x % G, w + x * QD_CHUNK, m0, m1, D, vs);
    for (int x = heads; x < QD_AMX_HEADS; ++x)
        _mm512_store_si512((__m512i*)(w + x * QD_CHUNK), _mm512_setzero_si512());
    /* P V [16][D], 32 dims (two tiles) at a time, into pv; then acc += pv per head */
    float pv[QD_AMX_HEADS * QD_MAX_D] __attribute__((aligned(64)));
    _tile_loadd(2, w, QD_CHUNK * 2);
    for (int d0 = 0; d0 < D; d0 += 32) {
        _tile_zero(5);
        _tile_zero(6);
        _tile_loadd(3, vi + d0, D * 4);
        _tile_loadd(4, vi + d0 + 16, D * 4);
        _tile_dpbf16ps(5, 2, 3);
        _tile_dpbf16ps(6, 2, 4);
        _tile_stored(5, pv + d0, D * 4);
        _tile_stored(6, pv + d0 + 16, D * 4);
    }
    for (int x = 0; x < heads; ++x) {
        float* a = acc[x / G] + (size_t)(x % G) * D;
        const float* p = pv + (size_t)x * D;
        for (int dd = 0; dd < D; dd += 16)
            _mm512_storeu_ps(a + dd,
                             _mm512_add_ps(_mm512_loadu_ps(a + dd), _mm512_load_ps(p + dd)));
    }
}

#endif
