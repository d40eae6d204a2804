/* The AVX512-BF16 lane of cpu_attention.c ("dot" variant): q K^T and P V as bf16 pair dot
 * products (vdpbf16ps, 32 multiply-adds an instruction, fp32 accumulation) straight from the
 * bf16 cache, where the fp32 lane (cpu_attention_lane.h) converts K and V to fp32 and runs
 * fp32 FMAs. Included once, by cpu_attention.c (kernels/cbuild.py expands it).
 *
 * Arithmetic of one (query row, kv head) lane over a chunk of n <= QD_CHUNK positions:
 *   s_g[j] = scale * dot(q_g, k_j)   bf16 pairs accumulated in fp32, pairs in order 0..D/2-1
 *   the online softmax of softmax_step (fp32, as the fp32 lane)
 *   acc_g += sum_j bf16(w_g[j]) v_j  position pairs (0,1), (2,3), ... in order, fp32 sums
 * So P is rounded to bf16 before P V (as FlashAttention does on GPUs); the running sum l is
 * taken from the unrounded weights. Everything depends only on the lane's own q, the chunk
 * and the lane's state: the same bits whatever else is in the step, however lanes are
 * grouped into tasks and whatever the thread count (the fp32 lane's invariants, kept).
 * Needs head_dim % 32 == 0 (cpu_attention.c falls back to the fp32 lane otherwise). */
#ifndef QD_CPU_ATTENTION_DOT_H
#define QD_CPU_ATTENTION_DOT_H

#include <immintrin.h>
#include <stdint.h>

#include "cpu_attention_lane.h"

#define QD_DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

/* In-place transpose of a 16 x 16 matrix of 32-bit words held in r[0..15] (row i -> r[i]). */
static inline __attribute__((always_inline)) QD_DOT_TARGET void transpose16(__m512i* r) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane now holds a transposed 4 x 4 block; move the blocks */
    for (int i = 0; i < 4; ++i) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; ++i) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

/* A chunk's n K and V rows (bf16 [D] each) packed for the dot products, D % 32 == 0:
 *   kt [D/2][QD_CHUNK] words: kt[i][j] = (k_j[2i], k_j[2i+1]); positions j >= n are 0;
 *   vi [QD_CHUNK/2][D] words: vi[p][d] = (v_{2p}[d], v_{2p+1}[d]); a position >= n is 0.
 * Exact (bits are moved, not converted). */
static QD_DOT_TARGET void pack_chunk_dot(const uint16_t* const* krow, const uint16_t* const* vrow,
                                         int n, int D, uint32_t* kt, uint32_t* vi) {
    const int pairs = D / 2;
    for (int j0 = 0; j0 < QD_CHUNK; j0 += 16) {
        if (j0 >= n) { /* a whole half past the chunk's end: zeros */
            for (int i = 0; i < pairs; ++i)
                _mm512_store_si512((__m512i*)(kt + (size_t)i * QD_CHUNK + j0),
                                   _mm512_setzero_si512());
            continue;
        }
        for (int i0 = 0; i0 < pairs; i0 += 16) {
            __m512i r[16];
            for (int j = 0; j < 16; ++j)
                r[j] = j0 + j < n ? _mm512_loadu_si512((const void*)(krow[j0 + j] + 2 * i0))
                                  : _mm512_setzero_si512();
            transpose16(r);
            for (int i = 0; i < 16; ++i)
                _mm512_store_si512((__m512i*)(kt + (size_t)(i0 + i) * QD_CHUNK + j0), r[i]);
        }
    }
    for (int p = 0; 2 * p < n; ++p) {
        const uint16_t* a = vrow[2 * p];
        const uint16_t* b = 2 * p + 1 < n ? vrow[2 * p + 1] : NULL;
        for (int d = 0; d < D; d += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(a + d)));
            __m512i w = lo;
            if (b != NULL)
                w = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                            _mm256_loadu_si256((const __m256i*)(b + d))), 16));
            _mm512_store_si512((__m512i*)(vi + (size_t)p * D + d), w);
        }
    }
}

/* s[h][0..32) = scale * dot(q_h, k_j) for GN (1..4, a constant once inlined) heads: qb [GN][D]
 * bf16, kt as pack_chunk_dot; halves of 16 positions, the second only when n > 16. */
static inline __attribute__((always_inline)) QD_DOT_TARGET void qk_heads(
        const uint16_t* qb, const uint32_t* kt, float* s, int n, int D, float scale, int GN) {
    const int pairs = D / 2;
    const uint32_t* q32 = (const uint32_t*)qb;
    __m512 a[4][2];
    for (int h = 0; h < GN; ++h) a[h][0] = a[h][1] = _mm512_setzero_ps();
    if (n > 16) {
        for (int i = 0; i < pairs; ++i) {
            const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + (size_t)i * QD_CHUNK);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(kt + (size_t)i * QD_CHUNK + 16);
            for (int h = 0; h < GN; ++h) {
                const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)q32[h * pairs + i]);
                a[h][0] = _mm512_dpbf16_ps(a[h][0], k0, qv);
                a[h][1] = _mm512_dpbf16_ps(a[h][1], k1, qv);
            }
        }
    } else {
        for (int i = 0; i < pairs; ++i) {
            const __m512bh k0 = (__m512bh)_mm512_load_si512(kt + (size_t)i * QD_CHUNK);
            for (int h = 0; h < GN; ++h)
                a[h][0] = _mm512_dpbf16_ps(
                    a[h][0], k0, (__m512bh)_mm512_set1_epi32((int)q32[h * pairs + i]));
        }
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int h = 0; h < GN; ++h) {
        _mm512_store_ps(s + h * QD_CHUNK, _mm512_mul_ps(a[h][0], vs));
        _mm512_store_ps(s + h * QD_CHUNK + 16, _mm512_mul_ps(a[h][1], vs));
    }
}

/* acc[h] += sum_p (w_h[2p], w_h[2p+1]) . vi[p] for GN (1..4) heads: wp [GN][QD_CHUNK/2] bf16
 * weight pairs, acc [GN][D], 64 dims at a time (then 16), over np position pairs in order. */
static inline __attribute__((always_inline)) QD_DOT_TARGET void pv_heads_dot(
        const uint32_t* wp, float* acc, const uint32_t* vi, int np, int D, int GN) {
    int dd = 0;
    for (; dd + 64 <= D; dd += 64) {
        __m512 a[4][4];
        for (int h = 0; h < GN; ++h)
            for (int c = 0; c < 4; ++c) a[h][c] = _mm512_load_ps(acc + (size_t)h * D + dd + 16 * c);
        for (int p = 0; p < np; ++p) {
            const uint32_t* vr = vi + (size_t)p * D + dd;
            __m512bh v[4];
            for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_load_si512(vr + 16 * c);
            for (int h = 0; h < GN; ++h) {
                const __m512bh w = (__m512bh)_mm512_set1_epi32((int)wp[h * (QD_CHUNK / 2) + p]);
                for (int c = 0; c < 4; ++c) a[h][c] = _mm512_dpbf16_ps(a[h][c], v[c], w);
            }
        }
        for (int h = 0; h < GN; ++h)
            for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + (size_t)h * D + dd + 16 * c, a[h][c]);
    }
    for (; dd < D; dd += 16) {
        __m512 a[4];
        for (int h = 0; h < GN; ++h) a[h] = _mm512_load_ps(acc + (size_t)h * D + dd);
        for (int p = 0; p < np; ++p) {
            const __m512bh v = (__m512bh)_mm512_load_si512(vi + (size_t)p * D + dd);
            for (int h = 0; h < GN; ++h)
                a[h] = _mm512_dpbf16_ps(
                    a[h], v, (__m512bh)_mm512_set1_epi32((int)wp[h * (QD_CHUNK / 2) + p]));
        }
        for (int h = 0; h < GN; ++h) _mm512_store_ps(acc + (size_t)h * D + dd, a[h]);
    }
}

/* One row's step over a packed chunk of n positions for its G heads: qb [G][D] bf16 (not
 * scaled), acc [G][D], m, l [G] its running state; sc [G][QD_CHUNK] fp32 scratch. */
static QD_DOT_TARGET void row_chunk_dot(const uint16_t* qb, float* acc, float* m, float* l,
                                        float* sc, const uint32_t* kt, const uint32_t* vi, int n,
                                        int G, int D, float scale) {
    for (int g0 = 0; g0 < G; g0 += 4) {
        const uint16_t* q = qb + (size_t)g0 * D;
        float* s = sc + g0 * QD_CHUNK;
        switch (G - g0 < 4 ? G - g0 : 4) {
        case 1: qk_heads(q, kt, s, n, D, scale, 1); break;
        case 2: qk_heads(q, kt, s, n, D, scale, 2); break;
        case 3: qk_heads(q, kt, s, n, D, scale, 3); break;
        default: qk_heads(q, kt, s, n, D, scale, 4); break;
        }
    }
    softmax_step(sc, acc, m, l, n, G, D);
    /* the weights as bf16 pairs (0 past n): wp[g][p] = (w[2p], w[2p+1]) */
    uint32_t wp[64 * (QD_CHUNK / 2)] __attribute__((aligned(64)));
    const __mmask16 m0 = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1);
    const __mmask16 m1 = n >= 32 ? (__mmask16)0xffff
                                 : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : (__mmask16)0;
    for (int g = 0; g < G; ++g) {
        const float* w = sc + g * QD_CHUNK;
        const __m512 lo = _mm512_maskz_loadu_ps(m0, w), hi = _mm512_maskz_loadu_ps(m1, w + 16);
        _mm512_store_si512((__m512i*)(wp + g * (QD_CHUNK / 2)),
                           (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
    const int np = (n + 1) / 2;
    for (int g0 = 0; g0 < G; g0 += 4) {
        const uint32_t* w = wp + g0 * (QD_CHUNK / 2);
        float* a = acc + (size_t)g0 * D;
        switch (G - g0 < 4 ? G - g0 : 4) {
        case 1: pv_heads_dot(w, a, vi, np, D, 1); break;
        case 2: pv_heads_dot(w, a, vi, np, D, 2); break;
        case 3: pv_heads_dot(w, a, vi, np, D, 3); break;
        default: pv_heads_dot(w, a, vi, np, D, 4); break;
        }
    }
}

#endif
