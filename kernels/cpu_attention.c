/* Attention of ragged query tokens over a paged bf16 KV cache, a whole batch in one call.
 *
 * Plain C (no torch headers), loaded with ctypes by kernels/cpu_attention.py; needs AVX2 +
 * FMA (the Python side checks the CPU flags). Cache layout (see paged_attention_ref.py):
 * kv[2][num_blocks][block_size][num_kv_heads][head_dim], 0 = K, 1 = V; position p of sequence
 * s lives in block block_tables[s][p / block_size] at offset p % block_size.
 *
 * Sequence s owns query rows [qsl[s], qsl[s+1]) (q_len of them) and has context length
 * L = seq_lens[s] (including its new tokens); its token i (0-based) attends positions
 * [0, L - q_len + i] (causal). Decode is the case q_len = 1 for every sequence (qsl = NULL).
 *
 * Tree verification (tree_mask, int64 [num_tokens], or NULL = every row causal; the rules are
 * kernels/attention_metadata.py's): a row with mask 0 is causal; a row i with a nonzero mask
 * sees the context [0, base) (base = L - q_len) plus base + j for each set bit j (read as
 * uint64: bit i set, no bit above i, q_len <= 64, else the call fails with QD_EMASK before
 * anything is touched). Its visible positions are walked in increasing order and chunked
 * exactly as a causal row over as many positions, so its bits equal those of a causal row
 * whose context holds the same K/V at contiguous positions (a verified path copied into place
 * is later seen exactly as verification saw it). Causal rows keep the contiguous walk.
 *
 * One task per (query token, kv head): the G = num_heads / num_kv_heads query heads sharing
 * that kv head are processed together, so each K/V row is read once per group. A task sees
 * only its own token's visible context ctx = L - q_len + i + 1 (a tree row's: base + its set
 * bits), so its result is the same bits whatever else is in the step (verifying k+1 tokens ==
 * decoding them one at a time).
 * Positions are walked in chunks of QD_CHUNK with an online softmax (running max and sum per
 * head; the accumulator is rescaled once per chunk), so no [ctx] buffer is needed. All math is
 * fp32 (bf16 -> fp32 by shift; q is pre-multiplied by scale), the output is rounded to bf16
 * (round-to-nearest-even). exp is a Cephes-style polynomial (rel. error ~1e-7).
 *
 * Tasks run on OpenMP threads only when there is enough work (QD_PAR_TASKS tasks and more
 * than QD_PAR_CTX visible positions in total): waking the pool costs ~10+ us. Threading never
 * changes a task's arithmetic.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QD_TARGET __attribute__((target("avx2,fma")))
#define QD_INLINE static inline __attribute__((always_inline)) QD_TARGET

#define QD_CHUNK 32          /* positions per online-softmax step (multiple of 8) */
#define QD_MAX_GD 8192       /* max (query heads per kv head) * head_dim per task */
#define QD_PAR_TASKS 2
#define QD_PAR_CTX 256

enum { QD_OK = 0, QD_EARG = -1, QD_EBLOCK = -2, QD_ELEN = -3, QD_EMASK = -4 };

/* ------------------------------------------------------------------------------------------ */

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

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

/* exp(x) for x <= 0 (clamped below so that 2^n stays normal). */
QD_INLINE __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

/* ------------------------------------------------------------------------------------------ */

typedef struct {
    const uint16_t* q;         /* token t's heads start at q + t * ldq */
    size_t ldq;
    const uint16_t* k;         /* kv[0] */
    const uint16_t* v;         /* kv[1] */
    const int32_t* block_tables;
    const int32_t* seq_lens;
    const int32_t* qsl;        /* [num_seqs + 1], or NULL: token t is sequence t's only one */
    const int64_t* tree_mask;  /* [num_tokens] ancestor bits (0: causal row), or NULL */
    uint16_t* out;
    int heads, kv_heads, d, block_size, num_blocks, max_blocks, num_seqs;
    float scale;
} Args;

/* The sequence owning query row t: the last s with qsl[s] <= t (empty sequences skipped). */
static int seq_of_token(const Args* a, int t) {
    if (a->qsl == NULL) return t;
    int lo = 0, hi = a->num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (a->qsl[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* One (query token t, kv head) task. Returns QD_OK or an error code (nothing else is
 * touched). */
static QD_TARGET int attend_one(const Args* a, int t, int kvh) {
    const int D = a->d, G = a->heads / a->kv_heads, bs = a->block_size;
    const int s = seq_of_token(a, t);
    /* visible context of causal token i = t - qsl[s] of a sequence with q_len tokens */
    const int causal = a->qsl == NULL ? a->seq_lens[s]
                                      : a->seq_lens[s] - (a->qsl[s + 1] - t) + 1;
    if (causal <= 0 || (long long)causal > (long long)a->max_blocks * bs) return QD_ELEN;
    /* a tree row (nonzero mask, checked by prepare) sees [0, ctx0) then ctx0 + j for its set
     * bits j; positions [0, contig) are walked contiguously */
    uint64_t bits = 0;
    int ctx0 = 0;
    if (a->tree_mask != NULL && a->tree_mask[t] != 0) {
        bits = (uint64_t)a->tree_mask[t];
        ctx0 = a->seq_lens[s] - (a->qsl == NULL ? 1 : a->qsl[s + 1] - a->qsl[s]);
    }
    const int ctx = bits ? ctx0 + __builtin_popcountll(bits) : causal;
    const int contig = bits ? ctx0 : ctx;
    const int32_t* table = a->block_tables + (size_t)s * a->max_blocks;
    const size_t row_stride = (size_t)a->kv_heads * D;          /* between positions */
    const size_t head_off = (size_t)kvh * D;

    float qs[QD_MAX_GD] __attribute__((aligned(32)));
    float acc[QD_MAX_GD] __attribute__((aligned(32)));
    float m[64], l[64];
    float sc[64 * QD_CHUNK] __attribute__((aligned(32)));      /* [G][QD_CHUNK] scores */
    const uint16_t* krow[QD_CHUNK];
    const uint16_t* vrow[QD_CHUNK];

    const uint16_t* qsrc = a->q + (size_t)t * a->ldq + (size_t)kvh * G * D;
    const __m256 vscale = _mm256_set1_ps(a->scale);
    for (int i = 0; i < G * D; i += 8) {
        _mm256_store_ps(qs + i, _mm256_mul_ps(load_bf16(qsrc + i), vscale));
        _mm256_store_ps(acc + i, _mm256_setzero_ps());
    }
    for (int g = 0; g < G; ++g) { m[g] = -INFINITY; l[g] = 0.0f; }

    int bi = -1, bo = bs; /* block index in the table, offset in the block (no divisions) */
    size_t base = 0;
    for (int p0 = 0; p0 < ctx; p0 += QD_CHUNK) {
        const int n = ctx - p0 < QD_CHUNK ? ctx - p0 : QD_CHUNK;
        /* row pointers of this chunk's positions: contiguous ones, then a tree row's set bits */
        const int nc = contig - p0 >= n ? n : (contig > p0 ? contig - p0 : 0);
        for (int j = 0; j < nc; ++j) {
            if (bo == bs) {
                const int blk = table[++bi];
                if (blk < 0 || blk >= a->num_blocks) return QD_EBLOCK;
                base = (size_t)blk * bs * row_stride + head_off;
                bo = 0;
            }
            const size_t off = base + (size_t)bo++ * row_stride;
            krow[j] = a->k + off;
            vrow[j] = a->v + off;
        }
        for (int j = nc; j < n; ++j) {
            const int p = ctx0 + __builtin_ctzll(bits);
            bits &= bits - 1;
            const int blk = table[p / bs];
            if (blk < 0 || blk >= a->num_blocks) return QD_EBLOCK;
            const size_t off = ((size_t)blk * bs + (size_t)(p % bs)) * row_stride + head_off;
            krow[j] = a->k + off;
            vrow[j] = a->v + off;
        }
        /* scores sc[g][j] = (scale q_g) . k_j */
        for (int g = 0; g < G; ++g) {
            const float* qg = qs + (size_t)g * D;
            float* sg = sc + g * QD_CHUNK;
            int j = 0;
            for (; j + 8 <= n; j += 8) {
                __m256 part[8];
                for (int t = 0; t < 8; ++t) {
                    const uint16_t* kr = krow[j + t];
                    __m256 s0 = _mm256_mul_ps(_mm256_load_ps(qg), load_bf16(kr));
                    __m256 s1 = _mm256_setzero_ps();
                    int dd = 8;
                    for (; dd + 16 <= D; dd += 16) {
                        s1 = _mm256_fmadd_ps(_mm256_load_ps(qg + dd), load_bf16(kr + dd), s1);
                        s0 = _mm256_fmadd_ps(_mm256_load_ps(qg + dd + 8), load_bf16(kr + dd + 8),
                                             s0);
                    }
                    for (; dd < D; dd += 8)
                        s1 = _mm256_fmadd_ps(_mm256_load_ps(qg + dd), load_bf16(kr + dd), s1);
                    part[t] = _mm256_add_ps(s0, s1);
                }
                _mm256_store_ps(sg + j, hsum8(part));
            }
            for (; j < n; ++j) {
                const uint16_t* kr = krow[j];
                __m256 s0 = _mm256_setzero_ps();
                for (int dd = 0; dd < D; dd += 8)
                    s0 = _mm256_fmadd_ps(_mm256_load_ps(qg + dd), load_bf16(kr + dd), s0);
                sg[j] = hsum(s0);
            }
        }
        /* online softmax: new max, rescale, weights */
        for (int g = 0; g < G; ++g) {
            float* sg = sc + g * QD_CHUNK;
            float cmax = sg[0];
            for (int j = 1; j < n; ++j) cmax = sg[j] > cmax ? sg[j] : cmax;
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
        /* acc[g] += sum_j w[g][j] * v_j */
        /* (the accumulator stays in registers over the chunk; V rows are re-read from L1) */
        for (int g = 0; g < G; ++g) {
            const float* wg = sc + g * QD_CHUNK;
            float* ag = acc + (size_t)g * D;
            int dd = 0;
            for (; dd + 32 <= D; dd += 32) {
                __m256 a0 = _mm256_load_ps(ag + dd), a1 = _mm256_load_ps(ag + dd + 8);
                __m256 a2 = _mm256_load_ps(ag + dd + 16), a3 = _mm256_load_ps(ag + dd + 24);
                for (int j = 0; j < n; ++j) {
                    const __m256 w = _mm256_broadcast_ss(wg + j);
                    const uint16_t* vr = vrow[j] + dd;
                    a0 = _mm256_fmadd_ps(w, load_bf16(vr), a0);
                    a1 = _mm256_fmadd_ps(w, load_bf16(vr + 8), a1);
                    a2 = _mm256_fmadd_ps(w, load_bf16(vr + 16), a2);
                    a3 = _mm256_fmadd_ps(w, load_bf16(vr + 24), a3);
                }
                _mm256_store_ps(ag + dd, a0);
                _mm256_store_ps(ag + dd + 8, a1);
                _mm256_store_ps(ag + dd + 16, a2);
                _mm256_store_ps(ag + dd + 24, a3);
            }
            for (; dd < D; dd += 8) {
                __m256 a0 = _mm256_load_ps(ag + dd);
                for (int j = 0; j < n; ++j)
                    a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(wg + j), load_bf16(vrow[j] + dd), a0);
                _mm256_store_ps(ag + dd, a0);
            }
        }
    }

    uint16_t* dst = a->out + ((size_t)t * a->heads + (size_t)kvh * G) * D;
    for (int g = 0; g < G; ++g) {
        const float inv = 1.0f / l[g];
        for (int dd = 0; dd < D; ++dd) dst[g * D + dd] = f32_to_bf16(acc[g * D + dd] * inv);
    }
    return QD_OK;
}

/* Checks the arguments and the query layout (query_start_loc: int32 [num_seqs + 1], 0,
 * nondecreasing, ending at num_tokens, or NULL for decode: num_tokens == num_seqs, one token
 * each) and the tree masks, fills *a and the work in visible positions *total. Returns 0 or
 * a negative code; touches nothing else. Contexts and block ids are checked per task. */
static int prepare(Args* a, long long* total, const void* q, size_t ldq, const void* kv,
                   const int32_t* block_tables, const int32_t* seq_lens,
                   const int32_t* query_start_loc, const int64_t* tree_mask, void* out,
                   int num_seqs, int num_tokens, int heads, int kv_heads, int d, int block_size,
                   int num_blocks, int max_blocks, float scale) {
    if (num_seqs < 0 || num_tokens < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads
        || d <= 0 || d % 8 || block_size <= 0 || num_blocks <= 0 || max_blocks <= 0)
        return QD_EARG;
    const int G = heads / kv_heads;
    if (G > 64 || G * d > QD_MAX_GD || ldq < (size_t)heads * d) return QD_EARG;
    long long work = 0;
    if (query_start_loc == NULL) {
        if (num_tokens != num_seqs) return QD_EARG;
        for (int s = 0; s < num_seqs; ++s) work += seq_lens[s];
    } else {
        if (query_start_loc[0] != 0 || query_start_loc[num_seqs] != num_tokens) return QD_EARG;
        for (int s = 0; s < num_seqs; ++s) {
            const long long n = (long long)query_start_loc[s + 1] - query_start_loc[s];
            if (n < 0) return QD_EARG;
            if (n > seq_lens[s]) return QD_ELEN;
            work += n * (seq_lens[s] - n) + n * (n + 1) / 2;
        }
    }
    if (tree_mask != NULL) { /* row i of a q_len-row sequence: 0, or bits i and below, i set */
        for (int s = 0; s < num_seqs; ++s) {
            const int start = query_start_loc == NULL ? s : query_start_loc[s];
            const int n = query_start_loc == NULL ? 1 : query_start_loc[s + 1] - start;
            for (int i = 0; i < n; ++i) {
                const uint64_t m = (uint64_t)tree_mask[start + i];
                if (m == 0) continue;
                if (n > 64 || m >> i != 1) return QD_EMASK;
                work -= i + 1 - __builtin_popcountll(m); /* hidden sibling branches */
            }
        }
    }
    const size_t kv_half = (size_t)num_blocks * block_size * kv_heads * d;
    const Args args = {(const uint16_t*)q, ldq, (const uint16_t*)kv,
                       (const uint16_t*)kv + kv_half, block_tables, seq_lens, query_start_loc,
                       tree_mask, (uint16_t*)out, heads, kv_heads, d, block_size, num_blocks,
                       max_blocks, num_seqs, scale};
    *a = args;
    *total = work;
    return QD_OK;
}

/* Every (token, kv head) task of a prepared call, on nthreads threads (<= 0: OpenMP's
 * default) when the work is large enough. Returns 0, or a task's negative code (bad block id,
 * seq_len / q_len); on an error the output is unspecified. */
static int run_tasks(const Args* a, int num_tokens, long long total, int nthreads) {
    const int tasks = num_tokens * a->kv_heads;
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    if (tasks < QD_PAR_TASKS || total <= QD_PAR_CTX) nthreads = 1;
    if (nthreads > tasks) nthreads = tasks;
    int err = QD_OK;
    if (nthreads <= 1) {
        for (int t = 0; t < tasks && err == QD_OK; ++t)
            err = attend_one(a, t / a->kv_heads, t % a->kv_heads);
        return err;
    }
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int t = 0; t < tasks; ++t) {
        const int rc = attend_one(a, t / a->kv_heads, t % a->kv_heads);
        if (rc != QD_OK) {
#pragma omp atomic write
            err = rc;
        }
    }
    return err;
}

/* out[num_tokens][heads][d] = softmax(scale q K^T) V per (query token, head) over each row's
 * visible positions (causal, or a tree row's; see the header). query_start_loc as prepare()
 * says; tree_mask: int64 [num_tokens] or NULL (every row causal). nthreads: the thread count
 * to use when the work is large enough (<= 0: OpenMP's default). Returns 0, or a negative code
 * (bad arguments, block id out of range, bad seq_len / q_len, bad tree mask); on an error the
 * output is unspecified. */
int qd_ragged_attention_bf16(const void* q, const void* kv, const int32_t* block_tables,
                             const int32_t* seq_lens, const int32_t* query_start_loc,
                             const int64_t* tree_mask, void* out, int num_seqs, int num_tokens,
                             int heads, int kv_heads, int d, int block_size, int num_blocks,
                             int max_blocks, float scale, int nthreads) {
    Args a;
    long long total;
    const int rc = prepare(&a, &total, q, (size_t)heads * d, kv, block_tables, seq_lens,
                           query_start_loc, tree_mask, out, num_seqs, num_tokens, heads,
                           kv_heads, d, block_size, num_blocks, max_blocks, scale);
    return rc != QD_OK ? rc : run_tasks(&a, num_tokens, total, nthreads);
}

/* The KV write and the attention of one layer in one call. qkv: [num_tokens][ldq] bf16 rows
 * holding q (heads * d), then k and v (kv_heads * d each), RoPE already applied; token t's k
 * and v are stored at cache slot slots[t] (block slot / block_size, offset slot % block_size),
 * then out = qd_ragged_attention_bf16 of the q columns. Every slot, the query layout and the
 * tree masks are checked before anything is written: a bad one returns its code with the
 * cache untouched (block ids are checked by the attention, after the write). */
int qd_write_kv_attention_bf16(const void* qkv, int ldq, const int32_t* slots, void* kv,
                               const int32_t* block_tables, const int32_t* seq_lens,
                               const int32_t* query_start_loc, const int64_t* tree_mask,
                               void* out, int num_seqs, int num_tokens, int heads, int kv_heads,
                               int d, int block_size, int num_blocks, int max_blocks,
                               float scale, int nthreads) {
    if (!qkv || !slots || !kv || num_tokens < 0 || heads <= 0 || kv_heads <= 0 || d <= 0
        || block_size <= 0 || num_blocks <= 0
        || (long long)ldq < (long long)(heads + 2 * kv_heads) * d)
        return QD_EARG;
    const long long num_slots = (long long)num_blocks * block_size;
    for (int t = 0; t < num_tokens; ++t)
        if (slots[t] < 0 || slots[t] >= num_slots) return QD_EARG;
    Args a;
    long long total;
    const int rc = prepare(&a, &total, qkv, (size_t)ldq, kv, block_tables, seq_lens,
                           query_start_loc, tree_mask, out, num_seqs, num_tokens, heads,
                           kv_heads, d, block_size, num_blocks, max_blocks, scale);
    if (rc != QD_OK) return rc;
    const size_t row = (size_t)kv_heads * d, kv_half = (size_t)num_slots * row;
    uint16_t* kc = (uint16_t*)kv;
    for (int t = 0; t < num_tokens; ++t) {
        const uint16_t* src = (const uint16_t*)qkv + (size_t)t * ldq + (size_t)heads * d;
        memcpy(kc + (size_t)slots[t] * row, src, row * sizeof(uint16_t));
        memcpy(kc + kv_half + (size_t)slots[t] * row, src + row, row * sizeof(uint16_t));
    }
    return run_tasks(&a, num_tokens, total, nthreads);
}

/* Decode (one query token per sequence, all causal): the q_len = 1 case of
 * qd_ragged_attention_bf16 (a tree mask could only be 0 or 1 there, both causal). */
int qd_decode_attention_bf16(const void* q, const void* kv, const int32_t* block_tables,
                             const int32_t* seq_lens, void* out, int num_seqs, int heads,
                             int kv_heads, int d, int block_size, int num_blocks, int max_blocks,
                             float scale, int nthreads) {
    return qd_ragged_attention_bf16(q, kv, block_tables, seq_lens, NULL, NULL, out, num_seqs,
                                    num_seqs, heads, kv_heads, d, block_size, num_blocks,
                                    max_blocks, scale, nthreads);
}
