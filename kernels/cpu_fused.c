/* Fused bf16 element-wise kernels for CPU decode: RMSNorm (optionally with the residual add),
 * neox RoPE (in place, strided q/k views) and SiLU(gate) * up; the argmax of logits rows
 * (greedy sampling and verification); and the top-k of logits rows with their
 * log-softmax values (a draft head's candidates).
 *
 * Plain C (no torch headers), loaded with ctypes by kernels/cpu_fused.py; needs AVX2 + FMA
 * (the Python side checks the CPU flags). At batch 1 these ops work on a few KB each, so what
 * they replace is mostly torch's per-op overhead; each kernel here is one call per op.
 *
 * Every kernel reproduces the plain-torch reference in cpu_fused.py bit for bit (fp32 math,
 * the same intermediate roundings to bf16, round-to-nearest-even), so it must be built with
 * -ffp-contract=off: a mul + add contracted into an FMA would round differently.
 *   - RMSNorm: the sum of squares follows one fixed order on every CPU, that of ATen's AVX2
 *     vectorised cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp: 4 interleaved
 *     accumulator vectors of 8 floats, cascaded every 16 steps, then the scalar tail, then the
 *     lanes in order), mean is sum / n and rsqrt is 1 / sqrt (both correctly rounded, as in
 *     ATen). Bit-equal to torch where torch dispatches to AVX2; within an ulp of it where it
 *     dispatches to AVX512 (16 lanes) or DEFAULT.
 *   - SiLU: exp is a port of SLEEF's expf_u10 (what ATen's Vectorized<float>::exp calls), and
 *     the last `inter % vec_block` elements of each row use libm's expf, as ATen's scalar tail
 *     loop does.
 * NaN rounds to 0x7fc0 (torch's scalar conversion; its AVX2 one gives 0xffff, also a NaN).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define QD_TARGET __attribute__((target("avx2,fma")))
#define QD_INLINE static inline __attribute__((always_inline)) QD_TARGET

/* Threads: the caller decides (nthreads; <= 0: OpenMP's count). One thread runs its loop
 * outside any OpenMP construct: a `parallel if (0)` region still enters libgomp, which builds
 * a team of one and wakes its barrier, ~0.4 us a call on the 2-core AVX2-only Zen 4 (a 1-row
 * step made ~240 such calls). Where the callers draw the line: cpu_fused.py, _PAR_ROWS. */

/* ------------------------------------------------------------------------------------------ */
/* scalar helpers */

/* f rounded to the nearest bf16, as an fp32 value. */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* ------------------------------------------------------------------------------------------ */
/* vector helpers (8 lanes) */

QD_INLINE __m256 load_bf16(const uint16_t* p) {
    const __m128i v = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

/* Round to nearest even, result in the high half of each 32-bit lane (low half zero);
 * NaN lanes become 0x7fc0. */
QD_INLINE __m256i round_bits(__m256 f) {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    const __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_ORD_Q));
    return _mm256_blendv_epi8(_mm256_set1_epi32(0x7fc00000), r, ordered);
}

/* f rounded to the nearest bf16, as fp32 lanes. */
QD_INLINE __m256 round_bf16_v(__m256 f) { return _mm256_castsi256_ps(round_bits(f)); }

QD_INLINE void store_bf16(uint16_t* p, __m256 f) {
    __m256i r = _mm256_srli_epi32(round_bits(f), 16);
    r = _mm256_packus_epi32(r, r);            /* 0-3 0-3 | 4-7 4-7 */
    r = _mm256_permute4x64_epi64(r, 0xd8);    /* 0-3 4-7 | ... */
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(r));
}

/* ------------------------------------------------------------------------------------------ */
/* RMSNorm */

static int ceil_log2(long long x) {
    if (x <= 2) return 1;
    return 64 - __builtin_clzll((unsigned long long)(x - 1));
}

/* Sum of xf[i]^2 (each square rounded to fp32) in ATen's AVX2 order (8-lane vectors) for a
 * contiguous inner reduction of n >= 8 floats. The order is fixed: the same on every x86-64
 * CPU, whatever torch itself dispatches to (its AVX512 build sums in 16 lanes, so there the
 * kernel is within an ulp of torch instead of bit-equal). */
QD_INLINE float torch_sumsq_vec(const float* xf, long long n) {
    const long long vec_size = n / 8;
    /* row_sum(): vec_size vectors seen as a (-1, 4) array; multi_row_sum() over its rows */
    const long long size_ilp = vec_size / 4;
    int lp = ceil_log2(size_ilp) / 4;
    if (lp < 4) lp = 4;
    const long long step = 1LL << lp, mask = step - 1;
    __m256 acc[4][4];
    for (int l = 0; l < 4; l++)
        for (int k = 0; k < 4; k++) acc[l][k] = _mm256_setzero_ps();
#define QD_ACC_SQ(dst, p)                                                   \
    do {                                                                    \
        const __m256 t = _mm256_loadu_ps(p);                                \
        (dst) = _mm256_add_ps((dst), _mm256_mul_ps(t, t));                  \
    } while (0)
    long long i = 0;
    while (i + step <= size_ilp) {
        for (long long j = 0; j < step; j++, i++) {
            const float* base = xf + i * 32;
            for (int k = 0; k < 4; k++) QD_ACC_SQ(acc[0][k], base + k * 8);
        }
        for (int l = 1; l < 4; l++) {
            for (int k = 0; k < 4; k++) {
                acc[l][k] = _mm256_add_ps(acc[l][k], acc[l - 1][k]);
                acc[l - 1][k] = _mm256_setzero_ps();
            }
            if ((i & (mask << (l * lp))) != 0) break;
        }
    }
    for (; i < size_ilp; i++) {
        const float* base = xf + i * 32;
        for (int k = 0; k < 4; k++) QD_ACC_SQ(acc[0][k], base + k * 8);
    }
    for (int l = 1; l < 4; l++)
        for (int k = 0; k < 4; k++) acc[0][k] = _mm256_add_ps(acc[0][k], acc[l][k]);
    for (long long r = size_ilp * 4; r < vec_size; r++) QD_ACC_SQ(acc[0][0], xf + r * 8);
#undef QD_ACC_SQ
    for (int k = 1; k < 4; k++) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
    /* vectorized_inner_sum(): scalar tail first, then the lanes of the vector sum in order */
    float total = 0.0f;
    for (long long t = vec_size * 8; t < n; t++) total += xf[t] * xf[t];
    float lanes[8];
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int l = 0; l < 8; l++) total += lanes[l];
    return total;
}

/* ATen's scalar_inner_sum() (n below one torch vector): row_sum() on scalars. */
static float torch_sumsq_scalar(const float* xf, long long n) {
    const long long size_ilp = n / 4;
    int lp = ceil_log2(size_ilp) / 4;
    if (lp < 4) lp = 4;
    const long long step = 1LL << lp, mask = step - 1;
    float acc[4][4] = {{0}};
    long long i = 0;
    while (i + step <= size_ilp) {
        for (long long j = 0; j < step; j++, i++)
            for (int k = 0; k < 4; k++) acc[0][k] += xf[4 * i + k] * xf[4 * i + k];
        for (int l = 1; l < 4; l++) {
            for (int k = 0; k < 4; k++) {
                acc[l][k] += acc[l - 1][k];
                acc[l - 1][k] = 0.0f;
            }
            if ((i & (mask << (l * lp))) != 0) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int k = 0; k < 4; k++) acc[0][k] += xf[4 * i + k] * xf[4 * i + k];
    for (int l = 1; l < 4; l++)
        for (int k = 0; k < 4; k++) acc[0][k] += acc[l][k];
    for (long long t = size_ilp * 4; t < n; t++) acc[0][0] += xf[t] * xf[t];
    for (int k = 1; k < 4; k++) acc[0][0] += acc[0][k];
    return acc[0][0];
}

static QD_TARGET float torch_sumsq(const float* xf, long long n) {
    return n >= 8 ? torch_sumsq_vec(xf, n) : torch_sumsq_scalar(xf, n);
}

/* Exported for the tests: out[r] = sum of x[r, :]^2 over rows of a [rows, n] fp32 matrix, in
 * the order above (tests/kernels/sum_order_oracle.py; torch's x.pow(2).sum(-1) under AVX2). */
int qd_sumsq_f32(const float* x, float* out, int rows, int n) {
    if (rows < 0 || n <= 0 || !x || !out) return -1;
    for (int r = 0; r < rows; r++) out[r] = torch_sumsq(x + (size_t)r * (size_t)n, n);
    return 0;
}

/* One row: r = bf16(x + res) (or x), y = bf16(w * bf16(r * rsqrt(mean(r^2) + eps))). */
static QD_TARGET void rms_row(const uint16_t* x, const uint16_t* res, const uint16_t* w,
                              uint16_t* y, uint16_t* res_out, int n, float eps, float* xf) {
    const int n8 = n & ~7;
    int i = 0;
    if (res) {
        for (; i < n8; i += 8) {
            const __m256 r = round_bf16_v(_mm256_add_ps(load_bf16(x + i), load_bf16(res + i)));
            store_bf16(res_out + i, r);
            _mm256_storeu_ps(xf + i, r);
        }
        for (; i < n; i++) {
            const uint16_t r = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(res[i]));
            res_out[i] = r;
            xf[i] = bf16_to_f32(r);
        }
    } else {
        for (; i < n8; i += 8) _mm256_storeu_ps(xf + i, load_bf16(x + i));
        for (; i < n; i++) xf[i] = bf16_to_f32(x[i]);
    }
    const float var = torch_sumsq(xf, n) / (float)n;
    const float inv = 1.0f / sqrtf(var + eps);
    const __m256 vinv = _mm256_set1_ps(inv);
    for (i = 0; i < n8; i += 8) {
        const __m256 h = round_bf16_v(_mm256_mul_ps(_mm256_loadu_ps(xf + i), vinv));
        store_bf16(y + i, _mm256_mul_ps(load_bf16(w + i), h));
    }
    for (; i < n; i++) y[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(xf[i] * inv));
}

/* Rows [r0, r1) of qd_rms_norm_bf16's arrays, with n floats of scratch of their own; -1 when
 * that scratch cannot be allocated (nothing written). */
static QD_TARGET int rms_rows(const uint16_t* x, const uint16_t* res, const uint16_t* w,
                              uint16_t* y, uint16_t* res_out, int r0, int r1, int n, float eps) {
    float stack_buf[2048];
    float* xf = n <= 2048 ? stack_buf : (float*)malloc((size_t)n * sizeof(float));
    if (!xf) return -1;
    for (int r = r0; r < r1; r++) {
        const size_t off = (size_t)r * (size_t)n;
        rms_row(x + off, res ? res + off : NULL, w, y + off, res_out ? res_out + off : NULL, n,
                eps, xf);
    }
    if (xf != stack_buf) free(xf);
    return 0;
}

/* y[rows, n] = rms_norm(x (+ res)) * w; with res, res_out[rows, n] = bf16(x + res).
 * x, res, y, res_out: [rows, n] contiguous bf16 (res, res_out may be NULL; res_out may alias
 * x or res, y may alias x when res is NULL); w: [n]. Returns 0, or -1 on bad arguments / no
 * memory. */
int qd_rms_norm_bf16(const uint16_t* x, const uint16_t* res, const uint16_t* w, uint16_t* y,
                     uint16_t* res_out, int rows, int n, float eps, int nthreads) {
    if (rows < 0 || n <= 0 || !x || !w || !y || (res && !res_out)) return -1;
    if (rows == 0) return 0;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    if (nthreads > rows) nthreads = rows;
    if (nthreads <= 1) return rms_rows(x, res, w, y, res_out, 0, rows, n, eps);
    int status = 0;
#pragma omp parallel num_threads(nthreads)
    {
        /* each thread its contiguous share of the rows (every row is computed alone, so the
         * split does not change a bit) */
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int r0 = (int)((long long)rows * t / nt), r1 = (int)((long long)rows * (t + 1) / nt);
        if (rms_rows(x, res, w, y, res_out, r0, r1, n, eps) != 0) {
#pragma omp atomic write
            status = -1;
        }
    }
    return status;
}

/* ------------------------------------------------------------------------------------------ */
/* neox RoPE */

/* One head in place: out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)). */
static QD_TARGET void rope_head(uint16_t* x, const uint16_t* c, const uint16_t* s, int d) {
    const int half = d / 2, h8 = half & ~7;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i < h8; i += 8) {
        const __m256 a = load_bf16(x + i), b = load_bf16(x + half + i);
        const __m256 lo = _mm256_add_ps(
            round_bf16_v(_mm256_mul_ps(a, load_bf16(c + i))),
            round_bf16_v(_mm256_mul_ps(_mm256_xor_ps(b, sign), load_bf16(s + i))));
        const __m256 hi = _mm256_add_ps(round_bf16_v(_mm256_mul_ps(b, load_bf16(c + half + i))),
                                        round_bf16_v(_mm256_mul_ps(a, load_bf16(s + half + i))));
        store_bf16(x + i, lo);
        store_bf16(x + half + i, hi);
    }
    for (; i < half; i++) {
        const float a = bf16_to_f32(x[i]), b = bf16_to_f32(x[half + i]);
        const float lo = round_bf16(a * bf16_to_f32(c[i])) + round_bf16(-b * bf16_to_f32(s[i]));
        const float hi = round_bf16(b * bf16_to_f32(c[half + i])) +
                         round_bf16(a * bf16_to_f32(s[half + i]));
        x[i] = f32_to_bf16(lo);
        x[half + i] = f32_to_bf16(hi);
    }
}

/* Row r of qd_rope_neox_bf16's x, every head. */
static QD_TARGET void rope_row(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int r,
                               int heads, int d, long long row_stride, long long head_stride) {
    const uint16_t* c = cos + (size_t)r * (size_t)d;
    const uint16_t* s = sin + (size_t)r * (size_t)d;
    for (int h = 0; h < heads; h++) rope_head(x + r * row_stride + h * head_stride, c, s, d);
}

/* x: [rows, heads, d] bf16 with element strides (row_stride, head_stride, 1), rotated in
 * place; cos, sin: [rows, d] contiguous bf16 shared by all heads. d must be even. */
int qd_rope_neox_bf16(uint16_t* x, const uint16_t* cos, const uint16_t* sin, int rows, int heads,
                      int d, long long row_stride, long long head_stride, int nthreads) {
    if (rows < 0 || heads < 0 || d <= 0 || (d & 1) || !x || !cos || !sin) return -1;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    if (nthreads <= 1) {
        for (int r = 0; r < rows; r++) rope_row(x, cos, sin, r, heads, d, row_stride, head_stride);
        return 0;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < rows; r++) rope_row(x, cos, sin, r, heads, d, row_stride, head_stride);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* SiLU(gate) * up */

/* SLEEF 3.x xexpf (u10) for AVX2 + FMA, operation for operation. */
QD_INLINE __m256 sleef_expf(__m256 d) {
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, _mm256_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)));
    const __m256 qf = _mm256_cvtepi32_ps(q);
    __m256 s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-0.693145751953125f), d);
    s = _mm256_fmadd_ps(qf, _mm256_set1_ps(-1.428606765330187045e-06f), s);
    __m256 u = _mm256_set1_ps(0.000198527617612853646278381f);
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00139304355252534151077271f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.00833336077630519866943359f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.0416664853692054748535156f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.166666671633720397949219f));
    u = _mm256_fmadd_ps(u, s, _mm256_set1_ps(0.5f));
    u = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
    /* vldexp2: u * 2^(q >> 1) * 2^(q - (q >> 1)) */
    const __m256i q1 = _mm256_srai_epi32(q, 1), q2 = _mm256_sub_epi32(q, q1);
    const __m256i bias = _mm256_set1_epi32(0x7f);
    u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q1, bias), 23)));
    u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q2, bias), 23)));
    u = _mm256_andnot_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-104.0f), _CMP_LT_OQ), u);
    u = _mm256_blendv_ps(u, _mm256_set1_ps(INFINITY),
                         _mm256_cmp_ps(_mm256_set1_ps(100.0f), d, _CMP_LT_OQ));
    return u;
}

/* Exported for the tests: fp32 y = x / (1 + exp(-x)) with sleef_expf for each full group of
 * 8, libm's expf for the rest: must equal F.silu on fp32 bit for bit when n % 16 == 0. */
QD_TARGET int qd_silu_f32(const float* x, float* y, int n) {
    if (n < 0 || !x || !y) return -1;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(x + i);
        _mm256_storeu_ps(y + i, _mm256_div_ps(a, _mm256_add_ps(one, sleef_expf(_mm256_xor_ps(a, sign)))));
    }
    for (; i < n; i++) y[i] = x[i] / (1.0f + expf(-x[i]));
    return 0;
}

static QD_TARGET void silu_mul_row(const uint16_t* g, const uint16_t* up, uint16_t* y, int n,
                                   int vec_end) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int i = 0;
    for (; i + 8 <= vec_end; i += 8) {
        const __m256 a = load_bf16(g + i);
        const __m256 e = sleef_expf(_mm256_xor_ps(a, sign));
        const __m256 act = round_bf16_v(_mm256_div_ps(a, _mm256_add_ps(one, e)));
        store_bf16(y + i, _mm256_mul_ps(act, load_bf16(up + i)));
    }
    for (; i < n; i++) {
        const float a = bf16_to_f32(g[i]);
        const float act = round_bf16(a / (1.0f + expf(-a)));
        y[i] = f32_to_bf16(act * bf16_to_f32(up[i]));
    }
}

/* Row r of qd_silu_mul_bf16's arrays. */
static QD_TARGET void silu_row_at(const uint16_t* gate_up, uint16_t* y, int r, int inter,
                                  int vec_end) {
    const uint16_t* g = gate_up + (size_t)r * 2 * (size_t)inter;
    silu_mul_row(g, g + inter, y + (size_t)r * (size_t)inter, inter, vec_end);
}

/* y[rows, inter] = bf16(bf16(silu(gate)) * up) with gate, up the two halves of each row of
 * gate_up[rows, 2 * inter] (contiguous bf16). vec_block: elements per iteration of torch's
 * vectorised loop (2 bf16 vectors: 32 on AVX2, 64 on AVX512; 0: torch has no vector exp);
 * the last inter % vec_block of each row use libm's expf, as torch does. */
int qd_silu_mul_bf16(const uint16_t* gate_up, uint16_t* y, int rows, int inter, int vec_block,
                     int nthreads) {
    if (rows < 0 || inter <= 0 || vec_block < 0 || (vec_block & 7) || !gate_up || !y) return -1;
    const int vec_end = vec_block ? inter - inter % vec_block : 0;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    if (nthreads <= 1) {
        for (int r = 0; r < rows; r++) silu_row_at(gate_up, y, r, inter, vec_end);
        return 0;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int r = 0; r < rows; r++) silu_row_at(gate_up, y, r, inter, vec_end);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* argmax of fp32 rows (greedy tokens from logits) */

/* First index of the row's largest value, torch.argmax's answer: ties go to the first index,
 * a NaN counts as the largest (the first NaN wins), -0.0 and +0.0 tie. Two passes: the max
 * 16 lanes at a time (and whether any lane saw a NaN), then the first index equal to it.
 * torch's own CPU argmax ran 43 us for one 49152-wide row and 222 us for 9 (2026-11-27, the
 * 2-core AVX512-BF16 EPYC): ~2 % of a batch-8 step. AVX2 only: the same code on both kinds. */
static QD_TARGET long long argmax_row(const float* x, long long n) {
    long long i = 0;
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0, unordered = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
        m0 = _mm256_max_ps(m0, a);
        m1 = _mm256_max_ps(m1, b);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    float best = lanes[0];
    for (int l = 1; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (long long j = i; j < n; j++) {
        nan |= x[j] != x[j];
        best = x[j] > best ? x[j] : best;
    }
    if (nan) {
        for (long long j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    }
    const __m256 target = _mm256_set1_ps(best);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target,
                                                         _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0;  /* (unreachable: best is one of the row's values) */
}

/* out[r] = argmax of row r of x [rows, n] fp32, as int64. */
int qd_argmax_f32(const float* x, int64_t* out, int rows, long long n, int threads) {
    if (rows < 0 || n <= 0 || !x || !out) return -1;
    if (threads <= 1 || rows <= 1) {
        for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * (size_t)n, n);
        return 0;
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) out[r] = argmax_row(x + (size_t)r * (size_t)n, n);
    return 0;
}

/* ------------------------------------------------------------------------------------------ */
/* top-k log-softmax of fp32 rows (a draft head's candidates) */

/* a ranks before b: the larger value, a NaN above any number (as torch.topk), then the
 * smaller index */
static inline int ranks_before(float a, long long ia, float b, long long ib) {
    const int na = a != a, nb = b != b;
    if (na != nb) return na;
    if (!na && a != b) return a > b;
    return ia < ib;
}

/* The row's k best (value, index) pairs, best first (ranks_before), turned into
 * log-softmax values as torch computes them: (x - max) - log(sum(exp(x - max))), the sum
 * with sleef_expf 8 at a time (a NaN or all -inf row gives NaNs). A value that cannot enter
 * the current top k is rejected 8 at a time against the k-th value. */
static QD_TARGET void top_row(const float* x, long long n, int k, float* vals,
                              long long* idx) {
    int have = 0;
    float kth = -INFINITY;  /* the k-th value once k are held (a candidate must beat it) */
    long long i = 0;
    for (; i < n; i += 8) {
        const int full = i + 8 <= n;
        if (full && have == k) {
            const __m256 a = _mm256_loadu_ps(x + i);
            /* lanes that may enter: > kth, == kth (a tie ranks by index: a later index
             * never wins, so == is rejected too), or NaN */
            const int may = _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(kth),
                                                             _CMP_NLE_UQ));
            if (!may) continue;
        }
        const long long end = full ? i + 8 : n;
        for (long long j = i; j < end; j++) {
            const float v = x[j];
            if (have == k && !ranks_before(v, j, vals[k - 1], idx[k - 1])) continue;
            int at = have < k ? have++ : k - 1;
            while (at > 0 && ranks_before(v, j, vals[at - 1], idx[at - 1])) {
                vals[at] = vals[at - 1];
                idx[at] = idx[at - 1];
                at--;
            }
            vals[at] = v;
            idx[at] = j;
            if (have == k) kth = vals[k - 1] != vals[k - 1] ? INFINITY : vals[k - 1];
        }
    }
    const float top = vals[0];
    const __m256 m = _mm256_set1_ps(top);
    __m256 acc = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8)
        acc = _mm256_add_ps(acc, sleef_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    float sum = 0.0f;
    for (int l = 0; l < 8; l++) sum += lanes[l];
    for (; i < n; i++) sum += expf(x[i] - top);
    const float log_sum = logf(sum);
    for (int j = 0; j < k; j++) vals[j] = (vals[j] - top) - log_sum;
}

/* For each row r of x [rows, n] fp32: its min(k, n) best entries (larger values first, a NaN
 * above any number, ties to the smaller index) as indices idx[r, :] (int64) and
 * log-softmax values vals[r, :] = x - logsumexp(row). 0, or -1 on bad arguments. */
int qd_top_log_softmax_f32(const float* x, float* vals, int64_t* idx, int rows, long long n,
                           int k) {
    if (rows < 0 || n <= 0 || k <= 0 || k > n || !x || !vals || !idx) return -1;
    for (int r = 0; r < rows; r++) {
        top_row(x + (size_t)r * (size_t)n, n, k, vals + (size_t)r * (size_t)k,
                (long long*)(idx + (size_t)r * (size_t)k));
    }
    return 0;
}
