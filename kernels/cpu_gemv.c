/* bf16 GEMV / small GEMM for CPU decode: y[m,n] = x[m,k] @ w[n,k]^T + bias[n], all bf16.
 *
 * Plain C (no torch headers) so it builds in about a second; loaded with ctypes by
 * kernels/cpu_gemv.py. Needs AVX2 + FMA (the Python side checks the CPU flags).
 *
 * At small m the product is bound by streaming the weights from memory, so the kernel:
 *   - converts x to fp32 once per call into a scratch buffer, deinterleaved per 16-element
 *     block (8 even elements, then 8 odd ones) so one 256-bit load of 16 bf16 weights turns
 *     into two fp32 vectors with a single AND (odd elements: the bf16 already sits in the high
 *     half of each 32-bit lane) and a single shift (even elements);
 *   - reads every weight row exactly once for all m rows of x (up to 8 at a time; more rows
 *     pass over cache-sized tiles of the weights in turn, so prefill reads them once too);
 *   - splits the output rows into one contiguous range per OpenMP thread (static schedule),
 *     and cuts each thread's range into NR (2 or 4) equal parts walked side by side, one row
 *     of each part at a time: NR far-apart sequential streams, each x load serving NR rows.
 *     Measured on a 2-core Zen 3 VM (m=1, one thread): one stream reads ~15 GB/s, two ~19,
 *     four ~23, eight ~20; interleaving *adjacent* rows instead (stride k) is slower than a
 *     single stream (~10 GB/s). Software prefetch made no difference once NR >= 2;
 *   - keeps P independent fp32 partial sums per (x row, weight row) where NR*MB is small,
 *     to hide the FMA latency.
 * The fp32 sums are rounded to bf16 with round-to-nearest-even, as torch's float->bf16 does.
 */
#include <immintrin.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#define QD_TARGET __attribute__((target("avx2,fma")))
#define QD_INLINE static inline __attribute__((always_inline)) QD_TARGET

/* Largest number of x rows handled in one pass over the weights. */
#define QD_MAX_MB 8
/* Below this many weight bytes a single thread does the whole product. */
#define QD_SERIAL_BYTES (64 * 1024)

QD_INLINE float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* acc[q][i][pe] += even elements, acc[q][i][po] += odd elements of the 16-element block at kk
 * of weight row wr[q] times x row i, for the NR rows q. Each x vector is loaded once. */
#define QD_STEP16(kk, pe, po)                                                              \
    do {                                                                                   \
        __m256 we[8], wo[8];                                                               \
        for (int q = 0; q < NR; q++) {                                                     \
            const __m256i v = _mm256_loadu_si256((const __m256i*)(wr[q] + (kk)));          \
            we[q] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));                         \
            wo[q] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));                     \
        }                                                                                  \
        for (int i = 0; i < MB; i++) {                                                     \
            const __m256 xe = _mm256_load_ps(xp + (size_t)i * ldx + (kk));                 \
            const __m256 xo = _mm256_load_ps(xp + (size_t)i * ldx + (kk) + 8);             \
            for (int q = 0; q < NR; q++) {                                                 \
                acc[q][i][pe] = _mm256_fmadd_ps(we[q], xe, acc[q][i][pe]);                 \
                acc[q][i][po] = _mm256_fmadd_ps(wo[q], xo, acc[q][i][po]);                 \
            }                                                                              \
        }                                                                                  \
    } while (0)

/* Output rows rows[0..NR) for MB rows of x, with P (1, 2 or 4) partial sums per x row.
 * xp: [MB][ldx] fp32 scratch (16-blocks deinterleaved, tail plain); y: [MB][ldy]. */
QD_INLINE void block_kernel(const float* xp, size_t ldx, const uint16_t* w, const uint16_t* bias,
                            uint16_t* y, size_t ldy, int k, const int* rows, const int MB,
                            const int P, const int NR) {
    const int k16 = k & ~15, k32 = k & ~31;
    const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
    const uint16_t* wr[8];
    for (int q = 0; q < NR; q++) wr[q] = w + (size_t)rows[q] * (size_t)k;
    __m256 acc[8][QD_MAX_MB][4];
    for (int q = 0; q < NR; q++)
        for (int i = 0; i < MB; i++)
            for (int p = 0; p < P; p++) acc[q][i][p] = _mm256_setzero_ps();
    int kk = 0;
    for (; kk < k32; kk += 32) { /* one 64-byte line of each row */
        QD_STEP16(kk, 0, P == 4 ? 1 : 0);
        QD_STEP16(kk + 16, P == 4 ? 2 : P - 1, P - 1);
    }
    if (kk < k16) QD_STEP16(kk, 0, 0);
    for (int q = 0; q < NR; q++) {
        const float b = bias ? bf16_to_f32(bias[rows[q]]) : 0.0f;
        for (int i = 0; i < MB; i++) {
            const float* xi = xp + (size_t)i * ldx;
            __m256 a = acc[q][i][0];
            for (int p = 1; p < P; p++) a = _mm256_add_ps(a, acc[q][i][p]);
            float s = hsum(a);
            for (int t = k16; t < k; t++) s += bf16_to_f32(wr[q][t]) * xi[t];
            y[(size_t)i * ldy + (size_t)rows[q]] = f32_to_bf16(s + b);
        }
    }
}

/* Output rows [r0, r1): the range is cut into NR equal parts walked side by side (NR weight
 * streams); the last (r1 - r0) % NR rows are done one at a time. */
QD_INLINE void rows_kernel(const float* xp, size_t ldx, const uint16_t* w, const uint16_t* bias,
                           uint16_t* y, size_t ldy, int k, int r0, int r1, const int MB,
                           const int P, const int NR) {
    int r = r0;
    if (NR > 1) {
        const int part = (r1 - r0) / NR;
        for (; r < r0 + part; r++) {
            int rows[8];
            for (int q = 0; q < NR; q++) rows[q] = r + q * part;
            block_kernel(xp, ldx, w, bias, y, ldy, k, rows, MB, P, NR);
        }
        r = r0 + NR * part;
    }
    for (; r < r1; r++) block_kernel(xp, ldx, w, bias, y, ldy, k, &r, MB, P, 1);
}

typedef void (*rows_fn)(const float*, size_t, const uint16_t*, const uint16_t*, uint16_t*, size_t,
                        int, int, int);

/* Per number of x rows MB: P partial sums per (x row, weight row) and NR weight rows (one
 * stream each) at once. NR*MB*P accumulators stay within 12 of the 16 ymm registers. */
#ifndef QD_P1
#define QD_P1 1
#endif
#ifndef QD_NR1
#define QD_NR1 4
#endif
#ifndef QD_P2
#define QD_P2 1
#endif
#ifndef QD_NR2
#define QD_NR2 4
#endif
#ifndef QD_P3
#define QD_P3 1
#endif
#ifndef QD_NR3
#define QD_NR3 4
#endif
#ifndef QD_P4
#define QD_P4 1
#endif
#ifndef QD_NR4
#define QD_NR4 2
#endif
#ifndef QD_NR5
#define QD_NR5 2
#endif
#ifndef QD_NR6
#define QD_NR6 2
#endif
#ifndef QD_NR7
#define QD_NR7 2
#endif
#ifndef QD_NR8
#define QD_NR8 2
#endif

#define QD_DEFINE(NAME, MB, P, NR)                                                           \
    static QD_TARGET void NAME(const float* xp, size_t ldx, const uint16_t* w,              \
                               const uint16_t* bias, uint16_t* y, size_t ldy, int k, int r0, \
                               int r1) {                                                    \
        rows_kernel(xp, ldx, w, bias, y, ldy, k, r0, r1, MB, P, NR);                        \
    }
QD_DEFINE(rows_1, 1, QD_P1, QD_NR1)
QD_DEFINE(rows_2, 2, QD_P2, QD_NR2)
QD_DEFINE(rows_3, 3, QD_P3, QD_NR3)
QD_DEFINE(rows_4, 4, QD_P4, QD_NR4)
QD_DEFINE(rows_5, 5, 1, QD_NR5)
QD_DEFINE(rows_6, 6, 1, QD_NR6)
QD_DEFINE(rows_7, 7, 1, QD_NR7)
QD_DEFINE(rows_8, 8, 1, QD_NR8)

static const rows_fn ROWS_FN[QD_MAX_MB + 1] = {NULL,   rows_1, rows_2, rows_3, rows_4,
                                                 rows_5, rows_6, rows_7, rows_8};

/* x row (bf16, length k) -> fp32 scratch row: each full 16-block as 8 even then 8 odd. */
static QD_TARGET void convert_x(const uint16_t* x, float* dst, int k) {
    const int k16 = k & ~15;
    for (int kk = 0; kk < k16; kk += 16) {
        for (int t = 0; t < 8; t++) {
            dst[kk + t] = bf16_to_f32(x[kk + 2 * t]);
            dst[kk + 8 + t] = bf16_to_f32(x[kk + 2 * t + 1]);
        }
    }
    for (int kk = k16; kk < k; kk++) dst[kk] = bf16_to_f32(x[kk]);
}

/* One thread's share: output rows [r0, r1) for every chunk of up to QD_MAX_MB rows of x.
 * With more x rows than one chunk, the output rows are walked in tiles of about
 * QD_TILE_BYTES of weights, and every x chunk passes over a tile while it is in cache: the
 * weights stream from memory once whatever m is (prefill), and each output element is still
 * computed by the same code in the same order as for a lone row (row-invariant). */
#define QD_TILE_BYTES (96 * 1024)
static void run_range(const float* xp, size_t ldx, const uint16_t* w, const uint16_t* bias,
                      uint16_t* y, int m, int n, int k, int r0, int r1) {
    int tile = r1 - r0;
    if (m > QD_MAX_MB) {
        tile = (int)(QD_TILE_BYTES / ((size_t)k * 2));
        if (tile < 8) tile = 8;
    }
    for (int t0 = r0; t0 < r1; t0 += tile) {
        const int t1 = t0 + tile < r1 ? t0 + tile : r1;
        for (int i0 = 0; i0 < m; i0 += QD_MAX_MB) {
            int mb = m - i0 < QD_MAX_MB ? m - i0 : QD_MAX_MB;
            ROWS_FN[mb](xp + (size_t)i0 * ldx, ldx, w, bias, y + (size_t)i0 * (size_t)n,
                        (size_t)n, k, t0, t1);
        }
    }
}

/* y[m,n] = x[m,k] @ w[n,k]^T + bias[n] (bias may be NULL). All bf16, row-major, contiguous.
 * nthreads <= 0 means omp_get_max_threads(). Returns 0 on success, -1 on bad arguments or
 * allocation failure (y is then left untouched). */
int qd_linear_bf16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y, int m,
                   int n, int k, int nthreads) {
    if (m <= 0 || n <= 0 || k <= 0 || !x || !w || !y) return -1;
    size_t ldx = ((size_t)k + 15) & ~(size_t)15; /* 64-byte aligned rows */
    float* xp = (float*)aligned_alloc(64, (size_t)m * ldx * sizeof(float));
    if (!xp) return -1;
    for (int i = 0; i < m; i++) convert_x(x + (size_t)i * (size_t)k, xp + (size_t)i * ldx, k);

    if (nthreads <= 0) nthreads = omp_get_max_threads();
    size_t bytes = (size_t)n * (size_t)k * 2;
    if (bytes < QD_SERIAL_BYTES || n < nthreads) nthreads = 1;
    if (nthreads == 1) {
        run_range(xp, ldx, w, bias, y, m, n, k, 0, n);
    } else {
#pragma omp parallel num_threads(nthreads)
        {
            int t = omp_get_thread_num(), nt = omp_get_num_threads();
            int r0 = (int)((long long)n * t / nt), r1 = (int)((long long)n * (t + 1) / nt);
            if (r1 > r0) run_range(xp, ldx, w, bias, y, m, n, k, r0, r1);
        }
    }
    free(xp);
    return 0;
}
