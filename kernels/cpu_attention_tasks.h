/* The tasks of one cpu_attention.c call: which rows, kv heads and positions each takes.
 * Included once, by cpu_attention.c, after its Args (kernels/cbuild.py expands it into the
 * one source it builds). How rows, heads and positions are grouped never changes a lane's
 * arithmetic (the segments are fixed by visible index: cpu_attention_lane.h, QD_SEGMENT);
 * it only decides how the work spreads over threads and how the K/V stream is read. */
#ifndef QD_CPU_ATTENTION_TASKS_H
#define QD_CPU_ATTENTION_TASKS_H

#include <stdint.h>
#include <stdlib.h>

/* Most floats of segment states a call's split sequences may need (8 MB, allocated per
 * call): a longer context, with its rows, is not split (one-head tasks instead). SmolLM2's
 * 8,192 positions with 14 rows need 0.53 M. */
#define QD_SPLIT_FLOATS ((size_t)2 << 20)

/* One task: query rows [t0, t1) of sequence s (consecutive tokens), kv heads [h0, h1), over
 * the visible positions [plo, phi) (multiples of QD_SEGMENT; phi INT32_MAX: to each row's end).
 * part: NULL, or (a part of a split sequence) where its lanes' segment states go: lane (row i
 * of the sequence, kv head h), segment g at float ((i * kv_heads + h) * nseg + g) *
 * (G * D + 2 G), holding acc [G][D], m [G], l [G]. */
typedef struct {
    int s, t0, t1, h0, h1;
    int plo, phi, nseg;
    float* part;
    long long cost; /* rows * heads * visible positions (an estimate, for the task order) */
} Task;

/* Where a split sequence's lane (its row i, kv head h) keeps segment seg's state (Task). */
static inline float* segment_slot(const Args* a, const Task* t, int i, int h, int seg) {
    const int G = a->heads / a->kv_heads;
    return t->part + (((size_t)i * a->kv_heads + h) * t->nseg + seg) * (G * a->d + 2 * G);
}

/* Cuts sequence s's q_len rows into parts groups of consecutive rows (sizes differ by at
 * most one), each with kv heads [h0, h1) over all its positions, appended to tasks[*n]. */
static void add_tasks(const Args* a, int s, int parts, int h0, int h1, Task* tasks, int* n) {
    const int first = a->qsl == NULL ? s : a->qsl[s];
    const int q_len = a->qsl == NULL ? 1 : a->qsl[s + 1] - first;
    const long long ctx = a->seq_lens[s];
    for (int k = 0; k < parts; ++k) {
        Task* t = &tasks[(*n)++];
        t->s = s;
        t->t0 = first + (int)((long long)q_len * k / parts);
        t->t1 = first + (int)((long long)q_len * (k + 1) / parts);
        t->h0 = h0;
        t->h1 = h1;
        t->plo = 0;
        t->phi = INT32_MAX;
        t->nseg = 0;
        t->part = NULL;
        t->cost = (long long)(t->t1 - t->t0) * (h1 - h0) * ctx;
    }
}

/* Cuts sequence s (all its kv heads in each task) into up to parts runs of whole segments,
 * appended to tasks[*n]; every cut lies below every row's end (at most the positions before
 * its new tokens), so each part sees some of every lane. The last run holds each row's own
 * last positions (walked row by row); when it holds less than a segment before the new
 * tokens it is cut by rows too, into min(q_len, parts / 2) groups: with a few rows sharing
 * every earlier chunk (the AMX lane's tiles take them together), the rows' own chunks then
 * outweigh a run (a longer last run is not: each group would walk its shared chunks again).
 * The floats of segment states its parts share (see Task) are added to *part_floats; until
 * run_tasks allocates them, the tasks' part holds their offset + 1. Returns how many tasks
 * (at most 1.5 parts). */
static int add_split(const Args* a, int s, int parts, Task* tasks, int* n,
                     size_t* part_floats) {
    const int first = a->qsl == NULL ? s : a->qsl[s];
    const int q_len = a->qsl == NULL ? 1 : a->qsl[s + 1] - first;
    const int ctx = a->seq_lens[s], top = (ctx - q_len) / QD_SEGMENT; /* cuts: 1..top segs */
    const int nseg = (ctx + QD_SEGMENT - 1) / QD_SEGMENT, G = a->heads / a->kv_heads;
    int made = 0, prev = 0;
    for (int k = 1; k <= parts; ++k) {
        int cut = k == parts ? INT32_MAX : (int)((long long)nseg * k / parts);
        if (cut != INT32_MAX && cut > top) cut = top;
        if (cut != INT32_MAX && cut <= prev) continue;
        int groups = cut == INT32_MAX && ctx - q_len - prev * QD_SEGMENT < QD_SEGMENT
                     ? parts / 2 : 1;
        if (groups > q_len) groups = q_len;
        if (groups < 1) groups = 1;
        for (int g = 0; g < groups; ++g) {
            Task* t = &tasks[(*n)++];
            t->s = s;
            t->t0 = first + (int)((long long)q_len * g / groups);
            t->t1 = first + (int)((long long)q_len * (g + 1) / groups);
            t->h0 = 0;
            t->h1 = a->kv_heads;
            t->plo = prev * QD_SEGMENT;
            t->phi = cut == INT32_MAX ? INT32_MAX : cut * QD_SEGMENT;
            t->nseg = nseg;
            t->part = (float*)(uintptr_t)(*part_floats + 1); /* offset + 1 until allocated */
            t->cost = (long long)(t->t1 - t->t0) * a->kv_heads
                      * ((cut == INT32_MAX ? ctx : t->phi) - t->plo);
            ++made;
        }
        prev = cut;
    }
    *part_floats += (size_t)q_len * a->kv_heads * nseg * (G * a->d + 2 * G);
    return made;
}

static int by_cost_desc(const void* x, const void* y) {
    const long long cx = ((const Task*)x)->cost, cy = ((const Task*)y)->cost;
    return (cx < cy) - (cx > cy);
}

/* The tasks of a prepared call, costliest first (so a dynamic schedule balances threads).
 * With enough sequences to keep nthreads busy (two each), a task takes all kv heads of a
 * sequence's rows: it streams that sequence's K/V contiguously, once. With fewer, a sequence
 * whose rows fit one task and whose context before its new tokens holds two whole segments
 * is cut by positions into runs of segments (all heads still streamed together; up to
 * QD_SPLIT_FLOATS of segment states a call); any other
 * takes one kv head a task, its rows cut into groups until there are enough tasks. Each task
 * has at most QD_MAX_ROWS rows and QD_MAX_LANES (row, kv head) lanes of QD_ROW_FLOATS floats
 * of q in all. How rows, heads and positions are grouped never changes a lane's arithmetic.
 * tasks: room for num_tokens * kv_heads + num_seqs * 3 * nthreads. *part_floats: the floats
 * split sequences need (0: none). Returns how many tasks were filled. */
static int make_tasks(const Args* a, int nthreads, Task* tasks, size_t* part_floats) {
    const int GD = a->heads / a->kv_heads * a->d, KH = a->kv_heads;
    const int want = nthreads > 1 ? 2 * nthreads : 1;
    /* most rows per task with all heads (0: too many heads for one task), and with one */
    int rmax_all = QD_ROW_FLOATS / (GD * KH);
    if (rmax_all > QD_MAX_LANES / KH) rmax_all = QD_MAX_LANES / KH;
    if (rmax_all > QD_MAX_ROWS) rmax_all = QD_MAX_ROWS;
    int rmax_one = QD_ROW_FLOATS / GD;
    if (rmax_one > QD_MAX_ROWS) rmax_one = QD_MAX_ROWS;
    int active = 0;
    for (int s = 0; s < a->num_seqs; ++s) active += a->qsl == NULL || a->qsl[s + 1] > a->qsl[s];
    int n = 0;
    *part_floats = 0;
    if (active == 0) return 0;
    const int all_heads = rmax_all >= 1 && active >= want;
    const int rmax = all_heads ? rmax_all : rmax_one;
    /* one head per task: cut rows into as many groups as it takes to have want tasks */
    const int split = all_heads ? 1 : (want + active * KH - 1) / (active * KH);
    for (int s = 0; s < a->num_seqs; ++s) {
        const int q_len = a->qsl == NULL ? 1 : a->qsl[s + 1] - a->qsl[s];
        if (q_len <= 0) continue;
        const int nseg = (a->seq_lens[s] + QD_SEGMENT - 1) / QD_SEGMENT;
        const size_t need = (size_t)q_len * KH * nseg * (GD + 2 * (GD / a->d));
        if (!all_heads && rmax_all >= q_len && a->seq_lens[s] - q_len >= 2 * QD_SEGMENT
            && *part_floats + need <= QD_SPLIT_FLOATS) {
            /* (at least two parts: cuts at the first segments' ends are always there) */
            add_split(a, s, (want + active - 1) / active, tasks, &n, part_floats);
            continue;
        }
        int parts = (q_len + rmax - 1) / rmax;
        if (parts < split) parts = split > q_len ? q_len : split;
        if (all_heads)
            add_tasks(a, s, parts, 0, KH, tasks, &n);
        else
            for (int h = 0; h < KH; ++h) add_tasks(a, s, parts, h, h + 1, tasks, &n);
    }
    qsort(tasks, (size_t)n, sizeof(Task), by_cost_desc);
    return n;
}

#endif
