/* One (query row, kv head) lane of cpu_attention.c: its online softmax over a chunk of K/V
 * positions, in fp32 with AVX2 + FMA. Included once, by cpu_attention.c (kernels/cbuild.py
 * expands it into the one source it builds). */
#ifndef QD_CPU_ATTENTION_LANE_H
#define QD_CPU_ATTENTION_LANE_H

#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#define QD_TARGET __attribute__((target("avx2,fma")))
#define QD_INLINE static inline __attribute__((always_inline)) QD_TARGET

#define QD_CHUNK 32          /* positions per online-softmax step (multiple of 8) */

QD_INLINE __m256 load_bf16(const uint16_t* p) {
    const __m128i v = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

QD_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lane j of the result = horizontal sum of a[j]. */
QD_INLINE __m256 hsum8(const __m256* a) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
    const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
    const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1); /* a0 a1 a2 a3 (lo) | a0 a1 a2 a3 (hi) */
    const __m256 u1 = _mm256_hadd_ps(t2, t3); /* a4 a5 a6 a7 (lo) | ... (hi) */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* exp(x) for x <= 0 (clamped below so that 2^n stays normal), elementwise in vectors of W
 * bits: NAME(__mW x) with target ATTRS, ROUND the width's round-to-nearest. One definition
 * for every width, so that each lane gets the same values: exp_ps (8 lanes, below) and the
 * AMX lane's exp16 (cpu_attention_amx.h). */
#define QD_DEFINE_EXP(NAME, W, ROUND, ATTRS)                                                 \
    static inline __attribute__((always_inline)) ATTRS __m##W NAME(__m##W x) {             \
        x = _mm##W##_max_ps(x, _mm##W##_set1_ps(-87.0f));                                   \
        x = _mm##W##_min_ps(x, _mm##W##_set1_ps(88.0f));                                    \
        const __m##W fx = ROUND(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)), \
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);            \
        __m##W r = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(0.693359375f), x);               \
        r = _mm##W##_fnmadd_ps(fx, _mm##W##_set1_ps(-2.12194440e-4f), r);                   \
        __m##W y = _mm##W##_set1_ps(1.9875691500e-4f);                                      \
        y = _mm##W##_fmadd_ps(y, r, _mm##W##_set1_ps(1.3981999507e-3f));                    \
        y = _mm##W##_fmadd_ps(y, r, _mm##W##_set1_ps(8.3334519073e-3f));                    \
        y = _mm##W##_fmadd_ps(y, r, _mm##W##_set1_ps(4.1665795894e-2f));                    \
        y = _mm##W##_fmadd_ps(y, r, _mm##W##_set1_ps(1.6666665459e-1f));                    \
        y = _mm##W##_fmadd_ps(y, r, _mm##W##_set1_ps(5.0000001201e-1f));                    \
        y = _mm##W##_fmadd_ps(y, _mm##W##_mul_ps(r, r),                                     \
                              _mm##W##_add_ps(r, _mm##W##_set1_ps(1.0f)));                  \
        const __m##W##i n = _mm##W##_slli_epi32(                                            \
            _mm##W##_add_epi32(_mm##W##_cvtps_epi32(fx), _mm##W##_set1_epi32(127)), 23);    \
        return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(n));                              \
    }

QD_DEFINE_EXP(exp_ps, 256, _mm256_round_ps, QD_TARGET)

/* max(s[0..n)), n >= 1, 8 lanes at a time (max is exact: the same value as a scalar scan;
 * the scores are finite). */
QD_INLINE float chunk_max(const float* s, int n) {
    int j = 0;
    float best = s[0];
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        best = _mm_cvtss_f32(h);
    }
    for (; j < n; ++j) best = s[j] > best ? s[j] : best;
    return best;
}

/* Converts the n K and V rows of a chunk to fp32: kf, vf [n][D] (exact: bf16 -> fp32). */
QD_INLINE void load_chunk(const uint16_t* const* krow, const uint16_t* const* vrow, int n,
                          int D, float* kf, float* vf) {
    for (int j = 0; j < n; ++j)
        for (int dd = 0; dd < D; dd += 8) {
            _mm256_store_ps(kf + (size_t)j * D + dd, load_bf16(krow[j] + dd));
            _mm256_store_ps(vf + (size_t)j * D + dd, load_bf16(vrow[j] + dd));
        }
}

/* acc[h] += sum_j w[h][j] * v_j for GN (1..4, a constant once inlined) heads: w [GN][QD_CHUNK],
 * acc [GN][D], vf [n][D]; 16 dims at a time (then 8), the accumulators in registers over
 * the chunk, each summing over j in order. */
QD_INLINE void pv_heads(const float* w, float* acc, const float* vf, int n, int D, int GN) {
    int dd = 0;
    for (; dd + 16 <= D; dd += 16) {
        __m256 a[4][2];
        for (int h = 0; h < GN; ++h) {
            a[h][0] = _mm256_load_ps(acc + (size_t)h * D + dd);
            a[h][1] = _mm256_load_ps(acc + (size_t)h * D + dd + 8);
        }
        for (int j = 0; j < n; ++j) {
            const float* vr = vf + (size_t)j * D + dd;
            const __m256 v0 = _mm256_load_ps(vr), v1 = _mm256_load_ps(vr + 8);
            for (int h = 0; h < GN; ++h) {
                const __m256 wj = _mm256_broadcast_ss(w + h * QD_CHUNK + j);
                a[h][0] = _mm256_fmadd_ps(wj, v0, a[h][0]);
                a[h][1] = _mm256_fmadd_ps(wj, v1, a[h][1]);
            }
        }
        for (int h = 0; h < GN; ++h) {
            _mm256_store_ps(acc + (size_t)h * D + dd, a[h][0]);
            _mm256_store_ps(acc + (size_t)h * D + dd + 8, a[h][1]);
        }
    }
    for (; dd < D; dd += 8) {
        __m256 a[4];
        for (int h = 0; h < GN; ++h) a[h] = _mm256_load_ps(acc + (size_t)h * D + dd);
        for (int j = 0; j < n; ++j) {
            const __m256 v0 = _mm256_load_ps(vf + (size_t)j * D + dd);
            for (int h = 0; h < GN; ++h)
                a[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(w + h * QD_CHUNK + j), v0, a[h]);
        }
        for (int h = 0; h < GN; ++h) _mm256_store_ps(acc + (size_t)h * D + dd, a[h]);
    }
}

/* The online-softmax step of one row's G heads over a chunk of n scores sc [G][QD_CHUNK]:
 * the new running max m and sum l, the accumulators acc [G][D] rescaled when the max
 * rises, and sc[g][j < n] replaced by the weights exp(s - m). */
QD_INLINE void softmax_step(float* sc, float* acc, float* m, float* l, int n, int G, int D) {
    for (int g = 0; g < G; ++g) {
        float* sg = sc + g * QD_CHUNK;
        float cmax = chunk_max(sg, n);
        const float mnew = cmax > m[g] ? cmax : m[g];
        if (mnew > m[g]) {
            const float alpha = expf(m[g] - mnew); /* 0 on the first chunk */
            l[g] *= alpha;
            const __m256 va = _mm256_set1_ps(alpha);
            float* ag = acc + (size_t)g * D;
            for (int dd = 0; dd < D; dd += 8)
                _mm256_store_ps(ag + dd, _mm256_mul_ps(_mm256_load_ps(ag + dd), va));
            m[g] = mnew;
        }
        const __m256 vm = _mm256_set1_ps(mnew);
        __m256 vsum = _mm256_setzero_ps();
        int j = 0;
        for (; j + 8 <= n; j += 8) {
            const __m256 w = exp_ps(_mm256_sub_ps(_mm256_load_ps(sg + j), vm));
            _mm256_store_ps(sg + j, w);
            vsum = _mm256_add_ps(vsum, w);
        }
        if (j < n) {
            float tmp[8] __attribute__((aligned(32)));
            for (int t = 0; t < 8; ++t) tmp[t] = j + t < n ? sg[j + t] : mnew;
            __m256 w = exp_ps(_mm256_sub_ps(_mm256_load_ps(tmp), vm));
            _mm256_store_ps(tmp, w);
            for (int t = 0; j + t < n; ++t) { sg[j + t] = tmp[t]; l[g] += tmp[t]; }
        }
        l[g] += hsum(vsum);
    }
}

/* Positions a lane's online softmax runs over before it starts afresh: a row's visible
 * positions are cut into segments of QD_SEGMENT (by visible index, so at fixed places
 * whatever the call), each walked chunk by chunk from a fresh state, and the segments' states
 * are folded left to right by fold_segment. So a long context can be split between threads
 * at segment boundaries without changing a lane's bits. */
#define QD_SEGMENT 128
_Static_assert(QD_SEGMENT % QD_CHUNK == 0, "a segment is whole chunks");

/* Folds one segment's state of G heads (acc [G][D], m, l [G]) into a lane's running fold
 * (fa [G][D], fm, fl [G]): the first segment is copied; a later one is merged as two online-
 * softmax states are, M = max(fm, m): fa = fa e^(fm - M) + acc e^(m - M), fl likewise (the
 * weights by exp_ps, 8 heads a vector). The same instructions wherever it runs (in a task or
 * in the merge after split tasks). */
static QD_TARGET void fold_segment(float* fa, float* fm, float* fl, const float* acc,
                                   const float* m, const float* l, int G, int D, int first) {
    if (first) {
        for (int x = 0; x < G * D; x += 8) _mm256_storeu_ps(fa + x, _mm256_loadu_ps(acc + x));
        for (int g = 0; g < G; ++g) {
            fm[g] = m[g];
            fl[g] = l[g];
        }
        return;
    }
    for (int g0 = 0; g0 < G; g0 += 8) { /* 8 heads' weights at a time (exp_ps, as the chunks) */
        const int n = G - g0 < 8 ? G - g0 : 8;
        float t[3][8] __attribute__((aligned(32))) = {{0}};
        for (int g = 0; g < n; ++g) {
            t[0][g] = fm[g0 + g];
            t[1][g] = m[g0 + g];
        }
        const __m256 old = _mm256_load_ps(t[0]), seg = _mm256_load_ps(t[1]);
        const __m256 mx = _mm256_max_ps(old, seg);
        const __m256 wa = exp_ps(_mm256_sub_ps(old, mx)), wb = exp_ps(_mm256_sub_ps(seg, mx));
        _mm256_store_ps(t[0], wa);
        _mm256_store_ps(t[1], wb);
        _mm256_store_ps(t[2], mx);
        for (int g = 0; g < n; ++g) {
            const int h = g0 + g;
            fl[h] = fmaf(l[h], t[1][g], fl[h] * t[0][g]);
            fm[h] = t[2][g];
            const __m256 va = _mm256_set1_ps(t[0][g]), vb = _mm256_set1_ps(t[1][g]);
            float* fh = fa + (size_t)h * D;
            const float* ah = acc + (size_t)h * D;
            for (int dd = 0; dd < D; dd += 8)
                _mm256_storeu_ps(fh + dd, _mm256_fmadd_ps(_mm256_loadu_ps(ah + dd), vb,
                                                         _mm256_mul_ps(_mm256_loadu_ps(fh + dd), va)));
        }
    }
}

/* One row's online-softmax step over a chunk of n converted positions, for its G heads.
 * qs [G][D] (q pre-scaled), acc [G][D], m, l [G] are the row's running state; sc is
 * [G][QD_CHUNK] scratch. The arithmetic depends only on the row's state and the chunk. */
static QD_TARGET void row_chunk(const float* qs, float* acc, float* m, float* l, float* sc,
                                const float* kf, const float* vf, int n, int G, int D) {
    /* scores sc[g][j] = (scale q_g) . k_j */
    for (int g = 0; g < G; ++g) {
        const float* qg = qs + (size_t)g * D;
        float* sg = sc + g * QD_CHUNK;
        int j = 0;
        /* 8 positions at a time, q held in registers over 64-dim slabs: lane x of part[t]
         * sums q[x + 8i] k_t[x + 8i] over i in order, as the lone positions below do */
        for (; j + 8 <= n; j += 8) {
            const float* kj = kf + (size_t)j * D;
            __m256 part[8];
            for (int t = 0; t < 8; ++t) part[t] = _mm256_setzero_ps();
            int dd = 0;
            for (; dd + 64 <= D; dd += 64) {
                const __m256 q0 = _mm256_load_ps(qg + dd), q1 = _mm256_load_ps(qg + dd + 8);
                const __m256 q2 = _mm256_load_ps(qg + dd + 16), q3 = _mm256_load_ps(qg + dd + 24);
                const __m256 q4 = _mm256_load_ps(qg + dd + 32), q5 = _mm256_load_ps(qg + dd + 40);
                const __m256 q6 = _mm256_load_ps(qg + dd + 48), q7 = _mm256_load_ps(qg + dd + 56);
                for (int t = 0; t < 8; ++t) {
                    const float* kr = kj + (size_t)t * D + dd;
                    __m256 x = part[t];
                    x = _mm256_fmadd_ps(q0, _mm256_load_ps(kr), x);
                    x = _mm256_fmadd_ps(q1, _mm256_load_ps(kr + 8), x);
                    x = _mm256_fmadd_ps(q2, _mm256_load_ps(kr + 16), x);
                    x = _mm256_fmadd_ps(q3, _mm256_load_ps(kr + 24), x);
                    x = _mm256_fmadd_ps(q4, _mm256_load_ps(kr + 32), x);
                    x = _mm256_fmadd_ps(q5, _mm256_load_ps(kr + 40), x);
                    x = _mm256_fmadd_ps(q6, _mm256_load_ps(kr + 48), x);
                    x = _mm256_fmadd_ps(q7, _mm256_load_ps(kr + 56), x);
                    part[t] = x;
                }
            }
            for (; dd < D; dd += 8) {
                const __m256 qv = _mm256_load_ps(qg + dd);
                for (int t = 0; t < 8; ++t)
                    part[t] = _mm256_fmadd_ps(qv, _mm256_load_ps(kj + (size_t)t * D + dd), part[t]);
            }
            _mm256_store_ps(sg + j, hsum8(part));
        }
        for (; j < n; ++j) {
            const float* kr = kf + (size_t)j * D;
            __m256 s0 = _mm256_setzero_ps();
            for (int dd = 0; dd < D; dd += 8)
                s0 = _mm256_fmadd_ps(_mm256_load_ps(qg + dd), _mm256_load_ps(kr + dd), s0);
            sg[j] = hsum(s0);
        }
    }
    softmax_step(sc, acc, m, l, n, G, D);
    /* acc[g] += sum_j w[g][j] * v_j, heads in groups of up to 4 (each V load serves the
     * group; every accumulator still sums its terms over j in order, as one head alone) */
    for (int g0 = 0; g0 < G; g0 += 4) {
        const float* wg = sc + g0 * QD_CHUNK;
        float* ag = acc + (size_t)g0 * D;
        switch (G - g0 < 4 ? G - g0 : 4) {
        case 1: pv_heads(wg, ag, vf, n, D, 1); break;
        case 2: pv_heads(wg, ag, vf, n, D, 2); break;
        case 3: pv_heads(wg, ag, vf, n, D, 3); break;
        default: pv_heads(wg, ag, vf, n, D, 4); break;
        }
    }
}

#endif
