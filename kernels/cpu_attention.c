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
 * Each (query row, kv head) lane is computed on its own: the G = num_heads / num_kv_heads query
 * heads sharing that kv head together, over the row's own visible context ctx = L - q_len +
 * i + 1 (a tree row's: base + its set bits), so its result is the same bits whatever else
 * is in the step and however lanes are grouped into tasks (verifying k+1 tokens == decoding
 * them one at a time). A task is a run of one sequence's rows and some of its kv heads: the
 * lanes share reading a chunk of K/V rows and converting it to fp32 once, for every chunk
 * that all its rows see whole at the same positions (a long context is memory-bound, so
 * verification rows and prefill rows ride on one stream of the cache). With enough
 * sequences a task takes all kv heads (contiguous in the cache); with few, a sequence past
 * two segments is cut into runs of positions (all heads), a shorter one into one kv head and
 * fewer rows a task, so that the threads have work.
 * Positions are walked in chunks of QD_CHUNK with an online softmax (running max and sum per
 * head; the accumulator is rescaled once per chunk), so no [ctx] buffer is needed. Every
 * QD_SEGMENT visible positions (cpu_attention_lane.h) a lane's softmax starts afresh and the
 * segments' states are folded in order (fold_segment): the cut points are fixed by visible
 * index, so a sequence with few rows and a long context can be split by positions between
 * threads (cpu_attention_tasks.h: its parts store their segments' states, merge_split folds
 * them) with the bits of the same lane computed whole, in one task. In the fp32
 * lane all math is fp32 (bf16 -> fp32 by shift; q is pre-multiplied by scale); the dot lane
 * (cpu_attention_dot.h, AVX512-BF16) takes q K^T and P V as bf16 pair dot products with fp32
 * sums, the rest as the fp32 lane; the AMX lane (cpu_attention_amx.h, AMX-BF16) takes them as
 * tile multiplies, up to 16 query heads a tile (a row's, or in a task's shared chunks several
 * rows'), each tile row on its own. One lane per process (qd_attention_use_lane). The output is
 * rounded to bf16 (round-to-nearest-even). exp is a Cephes-style polynomial (rel. error ~1e-7).
 *
 * Tasks run on OpenMP threads only when there is enough work (QD_PAR_TASKS tasks and more
 * than QD_PAR_CTX visible positions in total): a fork and join of the (spinning) pool costs
 * a few us, a decode row's 3 kv heads ~0.1 us a position. Threading never changes a lane's
 * arithmetic.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_attention_lane.h"
/* the dot lane needs a compiler that knows AVX512-BF16 (GCC 10+); without one it is left
 * out and qd_attention_use_lane refuses it */
#if defined(__clang__) ? (__clang_major__ >= 11) : (defined(__GNUC__) && __GNUC__ >= 10)
#define QD_HAVE_DOT 1
#include "cpu_attention_dot.h"
#else
#define QD_HAVE_DOT 0
#endif
#include "cpu_bf16.h"

#define QD_MAX_GD 8192       /* max (query heads per kv head) * head_dim */
#define QD_MAX_D 256         /* max head_dim (the fp32 K/V chunk scratch) */
/* the AMX lane needs AMX-BF16 intrinsics (GCC 11+) besides the dot lane's */
#if QD_HAVE_DOT && (defined(__clang__) ? (__clang_major__ >= 12) : (__GNUC__ >= 11))
#define QD_HAVE_AMX 1
#include "cpu_attention_amx.h"
#else
#define QD_HAVE_AMX 0
#endif
#define QD_MAX_ROWS 16       /* max query rows per task */
#define QD_MAX_LANES 64      /* max (query row, kv head) pairs per task */
#define QD_ROW_FLOATS 8192   /* max lanes * (query heads per kv head) * head_dim per task */
#if QD_HAVE_AMX /* its bf16 q (QD_ROW_FLOATS values at most) and 16 rows of zeros in qs */
_Static_assert(QD_AMX_HEADS * QD_MAX_D <= QD_ROW_FLOATS, "the AMX lane's q fits qs");
#endif
#define QD_PAR_TASKS 2
#define QD_PAR_CTX 64  /* threads above this many visible positions a call (docs/kernels.md) */

enum { QD_OK = 0, QD_EARG = -1, QD_EBLOCK = -2, QD_ELEN = -3, QD_EMASK = -4, QD_ENOMEM = -5 };

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
    int lane; /* every lane of the call: QD_LANE_FP32, _DOT or _AMX */
} Args;

/* The lanes (see qd_lane): fp32 (cpu_attention_lane.h), dot (cpu_attention_dot.h), AMX
 * (cpu_attention_amx.h). */
enum { QD_LANE_FP32 = 0, QD_LANE_DOT = 1, QD_LANE_AMX = 2 };

/* Where one query row's visible positions lie: visible index v < contig is position v; the
 * rest are ctx0 + j for the set bits j of bits, in increasing order (a tree row); ctx of
 * them in all. */
typedef struct {
    int ctx, contig, ctx0;
    uint64_t bits;
} RowSpan;

#include "cpu_attention_tasks.h"

/* A chunk's n K and V rows made ready for the call's lane: converted to fp32 (kf, vf) or
 * packed for the dot and AMX lanes (in the same buffers; for AMX, whose tiles read all 16
 * position pairs, the pairs past n are zeroed too). */
static QD_TARGET void ready_chunk(int lane, const uint16_t* const* krow,
                                  const uint16_t* const* vrow, int n, int D, float* kf,
                                  float* vf) {
#if QD_HAVE_DOT
    if (lane != QD_LANE_FP32) {
        pack_chunk_dot(krow, vrow, n, D, (uint32_t*)kf, (uint32_t*)vf);
        if (lane == QD_LANE_AMX && n < QD_CHUNK) {
            const int np = (n + 1) / 2;
            memset(vf + (size_t)np * D, 0, (size_t)(QD_CHUNK / 2 - np) * D * sizeof(float));
        }
        return;
    }
#endif
    load_chunk(krow, vrow, n, D, kf, vf);
}

/* One lane's step over a ready chunk in the call's lane: q is the lane's slot, holding the
 * fp32 lane's pre-scaled q or, for the dot lane, its bf16 q (at the slot's start). */
static QD_TARGET void lane_chunk(int lane, const float* q, float* acc, float* m, float* l,
                                 float* sc, const float* kf, const float* vf, int n, int G,
                                 int D, float scale) {
#if QD_HAVE_DOT
    if (lane == QD_LANE_DOT) {
        row_chunk_dot((const uint16_t*)q, acc, m, l, sc, (const uint32_t*)kf,
                      (const uint32_t*)vf, n, G, D, scale);
        return;
    }
#endif
    (void)scale; /* the fp32 lane's q is pre-scaled */
    row_chunk(q, acc, m, l, sc, kf, vf, n, G, D);
}

/* Lane (token t, kv head h)'s output: its fold fa [G][D] over its sum fl [G], rounded to
 * bf16 into out [t][heads][D]. */
static QD_TARGET void write_lane(const Args* a, int t, int h, const float* fa,
                                 const float* fl) {
    const int D = a->d, G = a->heads / a->kv_heads;
    uint16_t* dst = a->out + ((size_t)t * a->heads + (size_t)h * G) * D;
    for (int g = 0; g < G; ++g) {
        const float inv = 1.0f / fl[g];
        for (int dd = 0; dd < D; ++dd) dst[g * D + dd] = f32_to_bf16(fa[g * D + dd] * inv);
    }
}

/* The online-softmax state of a task's lanes (lane (r, h) = r * NH + h): its current
 * segment's accumulator [G][D], max and sum [G], and the fold of its segments so far. */
typedef struct {
    float acc[QD_ROW_FLOATS] __attribute__((aligned(64)));
    float fa[QD_ROW_FLOATS] __attribute__((aligned(64)));
    float m[QD_MAX_LANES * 64], l[QD_MAX_LANES * 64];
    float fm[QD_MAX_LANES * 64], fl[QD_MAX_LANES * 64];
    int nh; /* the task's kv heads */
} LaneState;

/* Rows [r0, r1) of a task of R rows, at its kv head h, over a ready chunk of n positions, in
 * the call's lane: one lane at a time, or (AMX) as many rows as a tile takes. qs: the lanes'
 * q as attend_task stores it for the lane. */
static QD_TARGET void rows_chunk(const Args* a, LaneState* st, const float* qs, float* sc,
                                 int R, int h, int r0, int r1, const float* kf, const float* vf,
                                 int n) {
    const int D = a->d, G = a->heads / a->kv_heads, GD = G * D, NH = st->nh;
#if QD_HAVE_AMX
    if (a->lane == QD_LANE_AMX) { /* qs: bf16 [NH][R][G][D], then 16 rows of zeros */
        const int per = QD_AMX_HEADS / G;
        float *acc[QD_AMX_HEADS], *m[QD_AMX_HEADS], *l[QD_AMX_HEADS];
        for (int r = r0; r < r1; r += per) {
            const int M = r1 - r < per ? r1 - r : per;
            for (int i = 0; i < M; ++i) {
                const size_t lane = (size_t)(r + i) * NH + h;
                acc[i] = st->acc + lane * GD;
                m[i] = st->m + lane * G;
                l[i] = st->l + lane * G;
            }
            rows_chunk_amx((const uint16_t*)qs + ((size_t)h * R + r) * GD, acc, m, l, sc,
                           (const uint32_t*)kf, (const uint32_t*)vf, n, M, G, D, a->scale);
        }
        return;
    }
#endif
    for (int r = r0; r < r1; ++r) {
        const size_t lane = (size_t)r * NH + h;
        lane_chunk(a->lane, qs + lane * GD, st->acc + lane * GD, st->m + lane * G,
                   st->l + lane * G, sc, kf, vf, n, G, D, a->scale);
    }
}

/* Row r's lanes have walked segment seg (their visible indices up to its end, or their
 * last): its state is folded (a task covering its lanes whole) or stored in the task's
 * slots (a part of a split sequence), and the lanes start the next segment afresh. */
static QD_TARGET void end_segment(const Args* a, const Task* task, LaneState* st, int r,
                                  int seg) {
    const int D = a->d, G = a->heads / a->kv_heads, GD = G * D;
    const int first = a->qsl == NULL ? task->s : a->qsl[task->s];
    for (int h = 0; h < st->nh; ++h) {
        const size_t lane = (size_t)r * st->nh + h;
        float *acc = st->acc + lane * GD, *m = st->m + lane * G, *l = st->l + lane * G;
        if (task->part != NULL) {
            float* slot = segment_slot(a, task, task->t0 + r - first, task->h0 + h, seg);
            memcpy(slot, acc, (size_t)GD * sizeof(float));
            memcpy(slot + GD, m, (size_t)G * sizeof(float));
            memcpy(slot + GD + G, l, (size_t)G * sizeof(float));
        } else {
            fold_segment(st->fa + lane * GD, st->fm + lane * G, st->fl + lane * G, acc, m, l,
                         G, D, seg == 0);
        }
        for (int x = 0; x < GD; x += 8) _mm256_store_ps(acc + x, _mm256_setzero_ps());
        for (int g = 0; g < G; ++g) {
            m[g] = -INFINITY;
            l[g] = 0.0f;
        }
    }
}

/* A task's rows and heads over the visible positions [plo, phi) (phi: INT32_MAX, each row's
 * end). Each (row, kv head) lane is computed exactly as it would be alone (same segments and
 * chunks, same arithmetic): lanes only share reading and converting the chunks that all rows
 * see whole at the same positions, so a task streams its sequence's K/V once, all heads' rows
 * together (contiguous in the cache). A task covering its lanes whole (part == NULL) folds
 * their segments and writes the output; a part of a split sequence stores each segment's
 * state in its slot of part for merge_split. Returns QD_OK or an error code (nothing else is
 * touched). */
static QD_TARGET int attend_task(const Args* a, const Task* task) {
    const int D = a->d, G = a->heads / a->kv_heads, GD = G * D, bs = a->block_size;
    const int s = task->s, t0 = task->t0, R = task->t1 - task->t0;
    const int h0 = task->h0, NH = task->h1 - task->h0;
    const int first = a->qsl == NULL ? s : a->qsl[s];
    const int q_len = a->qsl == NULL ? 1 : a->qsl[s + 1] - first;
    const int base_ctx = a->seq_lens[s] - q_len; /* positions before the new tokens */
    const int32_t* table = a->block_tables + (size_t)s * a->max_blocks;
    const size_t row_stride = (size_t)a->kv_heads * D;          /* between positions */
    const int lo = task->plo, hi = task->phi;

    RowSpan span[QD_MAX_ROWS];
    float qs[QD_ROW_FLOATS] __attribute__((aligned(64))); /* lane (r, h): q (pre-scaled) */
    LaneState st; /* the lanes' online-softmax states */
    st.nh = NH;
    float *acc = st.acc, *m = st.m, *l = st.l;
    float sc[64 * QD_CHUNK] __attribute__((aligned(64)));      /* [G][QD_CHUNK] */
    float kf[QD_CHUNK * QD_MAX_D] __attribute__((aligned(64)));
    float vf[QD_CHUNK * QD_MAX_D] __attribute__((aligned(64)));
    const int lane_kind = a->lane; /* q and the ready chunks in these buffers as it needs */
    const uint16_t* krow[QD_CHUNK];
    const uint16_t* vrow[QD_CHUNK];
    size_t offs[QD_CHUNK]; /* a chunk's positions (their head 0) in the cache */

    int common = INT32_MAX; /* visible indices [0, common) are the same positions for all rows */
    const __m256 vscale = _mm256_set1_ps(a->scale);
    for (int r = 0; r < R; ++r) {
        const int t = t0 + r, i = t - first;
        const int causal = base_ctx + i + 1;
        if (causal <= 0 || (long long)causal > (long long)a->max_blocks * bs) return QD_ELEN;
        RowSpan* sp = &span[r];
        sp->bits = a->tree_mask != NULL ? (uint64_t)a->tree_mask[t] : 0; /* checked by prepare */
        sp->ctx0 = sp->bits ? base_ctx : 0;
        sp->ctx = sp->bits ? base_ctx + __builtin_popcountll(sp->bits) : causal;
        sp->contig = sp->bits ? base_ctx : sp->ctx;
        if (sp->contig < common) common = sp->contig;
        if (sp->ctx <= lo) return QD_EARG; /* (make_tasks cuts below every row's end) */
        for (int h = 0; h < NH; ++h) {
            const uint16_t* qsrc = a->q + (size_t)t * a->ldq + (size_t)(h0 + h) * GD;
            const size_t lane = (size_t)r * NH + h;
            if (lane_kind == QD_LANE_DOT) /* the bf16 q at the start of the lane's fp32 slot */
                memcpy(qs + lane * GD, qsrc, (size_t)GD * sizeof(uint16_t));
            else if (lane_kind == QD_LANE_AMX) /* bf16, by kv head: [NH][R][G][D] */
                memcpy((uint16_t*)qs + ((size_t)h * R + r) * GD, qsrc,
                       (size_t)GD * sizeof(uint16_t));
            for (int x = 0; x < GD; x += 8) {
                if (lane_kind == QD_LANE_FP32)
                    _mm256_store_ps(qs + lane * GD + x, _mm256_mul_ps(load_bf16(qsrc + x), vscale));
                _mm256_store_ps(acc + lane * GD + x, _mm256_setzero_ps());
            }
            for (int g = 0; g < G; ++g) { m[lane * G + g] = -INFINITY; l[lane * G + g] = 0.0f; }
        }
    }
    if (lane_kind == QD_LANE_AMX) /* a tile reads 16 rows of q from any row: zeros past */
        memset((uint16_t*)qs + (size_t)NH * R * GD, 0,
               (size_t)QD_AMX_HEADS * D * sizeof(uint16_t));
    /* the shared whole chunks in [lo, hi): contiguous positions, converted once per head for
     * all R rows; the next chunk's K/V rows of a head are prefetched before this one's are
     * computed */
    const int shared_all = common - common % QD_CHUNK;
    const int shared = shared_all < hi ? shared_all : hi;
    int bi = lo / bs - 1, bo = bs; /* block index in the table, offset in the block */
    size_t base = 0;
    if (lo < shared && lo % bs) {
        bi = lo / bs;
        const int blk = table[bi];
        if (blk < 0 || blk >= a->num_blocks) return QD_EBLOCK;
        base = (size_t)blk * bs * row_stride;
        bo = lo % bs;
    }
    size_t ahead[2][QD_CHUNK]; /* positions (head 0) of this chunk and the next */
    for (int p0 = lo, cur = 0; p0 < shared; p0 += QD_CHUNK, cur ^= 1) {
        if (p0 > lo && p0 % QD_SEGMENT == 0)
            for (int r = 0; r < R; ++r) end_segment(a, task, &st, r, p0 / QD_SEGMENT - 1);
        for (int c = p0 == lo ? 0 : 1; c < 2 && p0 + c * QD_CHUNK < shared; ++c)
            for (int j = 0; j < QD_CHUNK; ++j) {
                if (bo == bs) {
                    const int blk = table[++bi];
                    if (blk < 0 || blk >= a->num_blocks) return QD_EBLOCK;
                    base = (size_t)blk * bs * row_stride;
                    bo = 0;
                }
                ahead[cur ^ c][j] = base + (size_t)bo++ * row_stride;
            }
        const int next = p0 + QD_CHUNK < shared;
        for (int h = 0; h < NH; ++h) {
            const size_t head_off = (size_t)(h0 + h) * D;
            for (int j = 0; j < QD_CHUNK; ++j) {
                krow[j] = a->k + ahead[cur][j] + head_off;
                vrow[j] = a->v + ahead[cur][j] + head_off;
            }
            ready_chunk(lane_kind, krow, vrow, QD_CHUNK, D, kf, vf);
            if (next)
                for (int j = 0; j < QD_CHUNK; ++j)
                    for (int x = 0; x < D; x += 32) { /* 64-byte lines */
                        _mm_prefetch((const char*)(a->k + ahead[cur ^ 1][j] + head_off + x),
                                     _MM_HINT_T0);
                        _mm_prefetch((const char*)(a->v + ahead[cur ^ 1][j] + head_off + x),
                                     _MM_HINT_T0);
                    }
            rows_chunk(a, &st, qs, sc, R, h, 0, R, kf, vf, QD_CHUNK);
        }
    }
    /* each row's own remaining chunks in [lo, hi): its contiguous positions, then its tree
     * bits; then its last segment */
    for (int r = 0; r < R; ++r) {
        const RowSpan* sp = &span[r];
        const int start = shared > lo ? shared : lo, end = sp->ctx < hi ? sp->ctx : hi;
        uint64_t bits = sp->bits;
        for (int skip = start - sp->contig; skip > 0; --skip) bits &= bits - 1;
        for (int p0 = start; p0 < end; p0 += QD_CHUNK) {
            if (p0 > lo && p0 % QD_SEGMENT == 0) end_segment(a, task, &st, r, p0 / QD_SEGMENT - 1);
            const int n = end - p0 < QD_CHUNK ? end - p0 : QD_CHUNK;
            for (int j = 0; j < n; ++j) {
                int p = p0 + j;
                if (p >= sp->contig) {
                    p = sp->ctx0 + __builtin_ctzll(bits);
                    bits &= bits - 1;
                }
                const int blk = table[p / bs];
                if (blk < 0 || blk >= a->num_blocks) return QD_EBLOCK;
                offs[j] = ((size_t)blk * bs + (size_t)(p % bs)) * row_stride;
            }
            for (int h = 0; h < NH; ++h) {
                const size_t head_off = (size_t)(h0 + h) * D;
                for (int j = 0; j < n; ++j) {
                    krow[j] = a->k + offs[j] + head_off;
                    vrow[j] = a->v + offs[j] + head_off;
                }
                ready_chunk(lane_kind, krow, vrow, n, D, kf, vf);
                rows_chunk(a, &st, qs, sc, R, h, r, r + 1, kf, vf, n);
            }
        }
        end_segment(a, task, &st, r, (end - 1) / QD_SEGMENT);
    }
    if (task->part != NULL) return QD_OK; /* merge_split writes the output */
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < NH; ++h) {
            const size_t lane = (size_t)r * NH + h;
            write_lane(a, t0 + r, h0 + h, st.fa + lane * GD, st.fl + lane * G);
        }
    return QD_OK;
}

/* attend_task with, for the AMX lane, this thread's tiles configured around it. */
static int run_task(const Args* a, const Task* task) {
#if QD_HAVE_AMX
    if (a->lane == QD_LANE_AMX) {
        amx_tiles_configure();
        const int rc = attend_task(a, task);
        amx_tiles_release();
        return rc;
    }
#endif
    return attend_task(a, task);
}

/* Lane `lane` (query row lane / kv_heads, kv head lane % kv_heads) of a split sequence's
 * output (task: one of its parts): its segment states, stored by the parts, folded in order
 * and written out. */
static QD_TARGET void merge_lane(const Args* a, const Task* task, int lane) {
    const int D = a->d, G = a->heads / a->kv_heads, GD = G * D, s = task->s, KH = a->kv_heads;
    const int first = a->qsl == NULL ? s : a->qsl[s];
    const int q_len = a->qsl == NULL ? 1 : a->qsl[s + 1] - first;
    const int base_ctx = a->seq_lens[s] - q_len;
    const int i = lane / KH, h = lane % KH, t = first + i;
    float fa[QD_MAX_GD] __attribute__((aligned(64)));
    float fm[64], fl[64];
    const uint64_t bits = a->tree_mask != NULL ? (uint64_t)a->tree_mask[t] : 0;
    const int ctx = bits ? base_ctx + __builtin_popcountll(bits) : base_ctx + i + 1;
    const int nseg = (ctx + QD_SEGMENT - 1) / QD_SEGMENT;
    const float* slot = segment_slot(a, task, i, h, 0);
    for (int seg = 0; seg < nseg; ++seg, slot += GD + 2 * G)
        fold_segment(fa, fm, fl, slot, slot + GD, slot + GD + G, G, D, seg == 0);
    write_lane(a, t, h, fa, fl);
}

/* Output rows of a split sequence s (task: one of its parts, holding part and nseg): every
 * lane merged, spread over nthreads threads from 4 lanes. */
static QD_TARGET void merge_split(const Args* a, const Task* task, int nthreads) {
    const int s = task->s;
    const int first = a->qsl == NULL ? s : a->qsl[s];
    const int lanes = (a->qsl == NULL ? 1 : a->qsl[s + 1] - first) * a->kv_heads;
    if (nthreads <= 1 || lanes < 4) { /* outside OpenMP: see kernels/cpu_fused.c's threads */
        for (int lane = 0; lane < lanes; ++lane) merge_lane(a, task, lane);
        return;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int lane = 0; lane < lanes; ++lane) merge_lane(a, task, lane);
}

/* Which lane every call runs: QD_LANE_FP32 (AVX2 + FMA), QD_LANE_DOT (AVX512-BF16; head_dim
 * % 32 == 0, other head sizes take the fp32 lane) or QD_LANE_AMX (AMX-BF16; head_dim % 32 ==
 * 0 and at most 16 query heads per kv head, other shapes take the dot or the fp32 lane). Set
 * once at load by kernels/cpu_attention.py, before any call (the lanes give different bits:
 * a process keeps one, so decoding and verification agree). */
static int qd_lane = QD_LANE_FP32;

/* Whether this CPU (and, for AMX, Linux) can run lane `lane`. */
static int lane_runs_here(int lane) {
    if (lane == QD_LANE_FP32) return 1;
#if QD_HAVE_DOT
    __builtin_cpu_init();
    const int dot = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw")
                    && __builtin_cpu_supports("avx512vl");
    if (lane == QD_LANE_DOT) return dot;
#if QD_HAVE_AMX
    if (lane == QD_LANE_AMX)
        return dot && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16")
               && qd_amx_permitted();
#endif
#endif
    return 0;
}

/* Selects lane `lane` (see qd_lane; < 0: leaves it); returns the lane now in use: a lane
 * this CPU cannot run is refused (the lane in use stays). */
int qd_attention_use_lane(int lane) {
    if (lane >= QD_LANE_FP32 && lane <= QD_LANE_AMX && lane_runs_here(lane)) qd_lane = lane;
    return qd_lane;
}

/* The lane a call of G query heads per kv head and head_dim d runs, in a process using lane
 * `lane`: the next one down where the shape does not suit it. */
static int call_lane(int lane, int G, int d) {
    if (d % 32) return QD_LANE_FP32;
    if (lane == QD_LANE_AMX && G > 16) return QD_LANE_DOT;
    return lane;
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
    if (G > 64 || G * d > QD_MAX_GD || d > QD_MAX_D || ldq < (size_t)heads * d) return QD_EARG;
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
                       max_blocks, num_seqs, scale, call_lane(qd_lane, G, d)};
    *a = args;
    *total = work;
    return QD_OK;
}

/* Every task of a prepared call, on nthreads threads (<= 0: OpenMP's default) when the work
 * is large enough, then the merge of split sequences. Returns 0, or a task's negative code
 * (bad block id, seq_len / q_len, no memory); on an error the output is unspecified. */
static int run_tasks(const Args* a, int num_tokens, long long total, int nthreads) {
    if (nthreads <= 0) nthreads = omp_get_max_threads();
    if (total <= QD_PAR_CTX) nthreads = 1;
    const int room = (num_tokens > 0 ? num_tokens : 1) * a->kv_heads
                     + a->num_seqs * (nthreads > 1 ? 3 * nthreads : 1);
    Task* tasks = malloc((size_t)room * sizeof(Task));
    if (tasks == NULL) return QD_ENOMEM;
    size_t part_floats = 0;
    const int n = make_tasks(a, nthreads, tasks, &part_floats);
    float* parts = NULL;
    if (part_floats > 0) {
        parts = malloc(part_floats * sizeof(float));
        if (parts == NULL) {
            free(tasks);
            return QD_ENOMEM;
        }
        for (int t = 0; t < n; ++t)
            if (tasks[t].part != NULL) tasks[t].part = parts + ((uintptr_t)tasks[t].part - 1);
    }
    if (n < QD_PAR_TASKS) nthreads = 1;
    if (nthreads > n) nthreads = n;
    int err = QD_OK;
    if (nthreads <= 1) {
        for (int t = 0; t < n && err == QD_OK; ++t) err = run_task(a, &tasks[t]);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int t = 0; t < n; ++t) {
            const int rc = run_task(a, &tasks[t]);
            if (rc != QD_OK) {
#pragma omp atomic write
                err = rc;
            }
        }
    }
    if (err == QD_OK && parts != NULL)
        for (int t = 0; t < n; ++t) /* once per split sequence: at its first part */
            if (tasks[t].part != NULL && tasks[t].plo == 0) merge_split(a, &tasks[t], nthreads);
    free(parts);
    free(tasks);
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
 * and v are stored at cache slot slots[t] (block slot / block_size, offset slot % block_size;
 * -1: not written, a row whose K/V the cache holds already, as attention_metadata.py's
 * slot_mapping says), then out = qd_ragged_attention_bf16 of the q columns. Every slot, the
 * query layout and the tree masks are checked before anything is written: a bad one returns
 * its code with the cache untouched (block ids are checked by the attention, after the
 * write). */
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
        if (slots[t] < -1 || slots[t] >= num_slots) return QD_EARG;
    Args a;
    long long total;
    const int rc = prepare(&a, &total, qkv, (size_t)ldq, kv, block_tables, seq_lens,
                           query_start_loc, tree_mask, out, num_seqs, num_tokens, heads,
                           kv_heads, d, block_size, num_blocks, max_blocks, scale);
    if (rc != QD_OK) return rc;
    const size_t row = (size_t)kv_heads * d, kv_half = (size_t)num_slots * row;
    uint16_t* kc = (uint16_t*)kv;
    for (int t = 0; t < num_tokens; ++t) {
        if (slots[t] < 0) continue;
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
