/* A fixed corpus of token sequences that suffix decoding drafts from, beside its tries: the
 * target's own answers to prompts written for it or by it (spec/suffix_corpus.py: where they
 * come from). A depth-limited trie over millions of tokens would take gigabytes, so the
 * corpus is indexed by a suffix array over *reversed* contexts instead: 4 bytes a token.
 *
 * Semantics (tests/spec/suffix_corpus_reference.py is the plain-Python oracle):
 *   tokens: int32 [n], SEP (-1) between sequences. A position p is a continuation start
 *     when tokens[p] != SEP and p > 0 and tokens[p - 1] != SEP; its context is tokens[p - 1],
 *     tokens[p - 2], ... (most recent first) up to the sequence's start.
 *   index: the continuation starts sorted by context, compared token by token, most recent
 *     first, over at most max_depth tokens; a context that ends (sequence start) sorts
 *     before any token; ties by position. Positions whose contexts share their first m
 *     tokens are then one contiguous run, found by binary search.
 *   speculate_tree(ctx, max_nodes, factor, min_prob, min_match, max_sources):
 *     m = the largest length <= min(len(ctx), max_depth) such that some continuation start
 *     has ctx[-m:] (reversed) as its context's first m tokens; none, or m < min_match: no
 *     draft. The run's starts (at most max_sources of them, evenly spaced in index order)
 *     continue as sequences of at most budget = min(max_nodes, floor(factor * m)) tokens,
 *     each stopping at its sequence's end; they form a trie whose node counts are how many
 *     of them pass through it. The draft is that trie's best-first tree, as the suffix
 *     trie's (spec/suffix_tree.c): a node's path probability is its parent's times
 *     count(node) / sum of its siblings' counts (the root's: 1); repeatedly take the
 *     candidate of the highest probability (ties: the earlier parent, then the smaller
 *     token) until max_nodes are taken or the best is below min_prob; a taken node's
 *     children become candidates. Output best-first: tokens, parents (-1: below the
 *     context), path probabilities; the return value is the node count, *match = m.
 *     scratch: scratch_bytes the look-up may use for its trie (qd_sc_scratch_bytes(nodes)
 *     for one of that many nodes: sources * budget + 1); NULL or too small: it allocates. */

#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define SEP (-1)

typedef struct {
    const int32_t* tok; /* a copy of the caller's tokens (see below) */
    int64_t n;
    int32_t* pos;       /* continuation starts, sorted */
    int64_t npos;
    int max_depth;
    /* the runs of one context token: the starts whose context begins with token t are
     * pos[first[t + 1] .. first[t + 2]) (t = SEP: a context that has ended), for t up to
     * ntok - 2; the first level of every look-up without a binary search over all starts,
     * whose ~45 dependent probes into two arrays of 20 MB each cost the most once a model
     * step had evicted them (the native look-up 67 -> 53 us median with the table on the
     * AVX2-only Zen 4, 5 M tokens) */
    int64_t* first;
    int64_t ntok;
} Corpus;
/* tok, pos and first live in memory the caller gives qd_sc_new (spec/suffix_corpus.py: on
 * 2 MiB pages, kernels/huge_pages.py): a look-up after a model step finds them evicted, and
 * on 4 KiB pages each of its probes also walked the page tables (40 MB is ~10,000 pages,
 * far more than the TLB holds). */

#define QD_SC_BATCH 64 /* sources prefetched together */
static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

/* Where the index's arrays go in its memory: the tokens' copy, then the sorted starts, then
 * the first-token table (each from a 64-byte boundary); the starts' count and the table's
 * size as well. Returns the bytes in all. */
static size_t layout(const int32_t* tokens, int64_t n, int64_t* count, int64_t* ntok,
                     size_t* tok_bytes, size_t* pos_bytes) {
    int32_t top = SEP;
    *count = 0;
    for (int64_t p = 0; p < n; ++p) {
        *count += p > 0 && tokens[p] != SEP && tokens[p - 1] != SEP;
        top = tokens[p] > top ? tokens[p] : top;
    }
    *ntok = (int64_t)top + 2; /* SEP and 0 .. top */
    *tok_bytes = round_up((size_t)n * sizeof(int32_t), 64);
    *pos_bytes = round_up((size_t)(*count > 0 ? *count : 1) * sizeof(int32_t), 64);
    return *tok_bytes + *pos_bytes + ((size_t)*ntok + 1) * sizeof(int64_t);
}

/* Bytes of memory the index of these tokens needs (qd_sc_new); -1 for bad arguments. */
int64_t qd_sc_index_bytes(const int32_t* tokens, int64_t n) {
    if (!tokens || n < 0 || n > INT32_MAX) return -1;
    int64_t count, ntok;
    size_t tok_bytes, pos_bytes;
    return (int64_t)layout(tokens, n, &count, &ntok, &tok_bytes, &pos_bytes);
}

static inline int32_t ctx_at(const Corpus* c, int64_t p, int d) {
    /* the d-th context token before p (d >= 1), SEP once the sequence has started */
    for (int i = 1; i <= d; ++i)
        if (p - i < 0 || c->tok[p - i] == SEP) return SEP;
    return c->tok[p - d];
}

static int cmp_starts(const void* a, const void* b, void* arg) {
    const Corpus* c = (const Corpus*)arg;
    const int64_t p = *(const int32_t*)a, q = *(const int32_t*)b;
    for (int d = 1; d <= c->max_depth; ++d) {
        const int32_t x = p - d >= 0 ? c->tok[p - d] : SEP;
        const int32_t y = q - d >= 0 ? c->tok[q - d] : SEP;
        if (x != y) return x < y ? -1 : 1;
        if (x == SEP) break; /* both contexts ended: equal */
    }
    return p < q ? -1 : (p > q);
}

/* The first 4 context tokens of p as one key that orders like cmp_starts over them (each
 * token + 1, 0 once the context has ended, capped at 16 bits: a capped token only makes
 * keys equal, and equal keys are ordered by cmp_starts below). */
static uint64_t key4(const Corpus* c, int64_t p) {
    uint64_t key = 0;
    int ended = 0;
    for (int d = 1; d <= 4; ++d) {
        uint64_t v = 0;
        if (!ended && d <= c->max_depth && p - d >= 0 && c->tok[p - d] != SEP) {
            const int64_t t = (int64_t)c->tok[p - d] + 1;
            v = t > 0xFFFF ? 0xFFFF : (uint64_t)t;
        } else {
            ended = 1;
        }
        key = key << 16 | v;
    }
    return key;
}

/* Sorts c->pos as cmp_starts does, faster: an LSD radix sort of (key4, position) pairs,
 * then cmp_starts within each run of equal keys (they may differ deeper). Returns 0, or -1
 * when out of memory (the caller then sorts with cmp_starts alone). */
static int presort(Corpus* c) {
    const size_t n = (size_t)c->npos;
    int32_t* const home = c->pos; /* the sorted starts end here whatever the passes' count */
    uint64_t* key = (uint64_t*)malloc(n * sizeof(uint64_t) + 1);
    uint64_t* key2 = (uint64_t*)malloc(n * sizeof(uint64_t) + 1);
    int32_t* pos2 = (int32_t*)malloc(n * sizeof(int32_t) + 1);
    if (!key || !key2 || !pos2) { free(key); free(key2); free(pos2); return -1; }
    for (size_t i = 0; i < n; ++i) key[i] = key4(c, c->pos[i]);
    /* stable passes over 16-bit digits, least significant first (positions start in
     * increasing order, so equal keys stay by position) */
    size_t* count = (size_t*)calloc(65536, sizeof(size_t));
    if (!count) { free(key); free(key2); free(pos2); return -1; }
    for (int shift = 0; shift < 64; shift += 16) {
        memset(count, 0, 65536 * sizeof(size_t));
        for (size_t i = 0; i < n; ++i) count[(key[i] >> shift) & 0xFFFF]++;
        size_t sum = 0;
        for (int d = 0; d < 65536; ++d) { const size_t k = count[d]; count[d] = sum; sum += k; }
        for (size_t i = 0; i < n; ++i) {
            const size_t at = count[(key[i] >> shift) & 0xFFFF]++;
            key2[at] = key[i];
            pos2[at] = c->pos[i];
        }
        uint64_t* tk = key; key = key2; key2 = tk;
        int32_t* tp = c->pos; c->pos = pos2; pos2 = tp;
    }
    free(count);
    if (c->pos != home) {
        memcpy(home, c->pos, n * sizeof(int32_t));
        pos2 = c->pos;
        c->pos = home;
    }
    for (size_t i = 0; i < n;) {
        size_t j = i + 1;
        while (j < n && key[j] == key[i]) ++j;
        if (j - i > 1) /* equal keys: the contexts may differ deeper (or at a capped token) */
            qsort_r(c->pos + i, j - i, sizeof(int32_t), cmp_starts, c);
        i = j;
    }
    free(key);
    free(key2);
    free(pos2);
    return 0;
}

/* The index of ``tokens`` (copied) in ``memory``: memory_bytes >= qd_sc_index_bytes, zeroed,
 * 64-byte aligned, alive and untouched by the caller until qd_sc_free. NULL for bad
 * arguments (or no memory for the handle). */
void* qd_sc_new(const int32_t* tokens, int64_t n, int max_depth, void* memory,
                int64_t memory_bytes) {
    if (!tokens || n < 0 || n > INT32_MAX || max_depth < 1 || max_depth > 1024 || !memory
        || ((uintptr_t)memory & 63))
        return NULL;
    int64_t count;
    size_t tok_bytes, pos_bytes;
    Corpus* c = (Corpus*)calloc(1, sizeof(Corpus));
    if (!c) return NULL;
    if (memory_bytes < 0
        || layout(tokens, n, &count, &c->ntok, &tok_bytes, &pos_bytes) > (size_t)memory_bytes) {
        free(c);
        return NULL;
    }
    c->n = n;
    c->max_depth = max_depth;
    char* at = (char*)memory;
    memcpy(at, tokens, (size_t)n * sizeof(int32_t));
    c->tok = (const int32_t*)at;
    c->pos = (int32_t*)(at + tok_bytes);
    c->first = (int64_t*)(at + tok_bytes + pos_bytes);
    for (int64_t p = 1; p < n; ++p)
        if (tokens[p] != SEP && tokens[p - 1] != SEP) c->pos[c->npos++] = (int32_t)p;
    if (presort(c) != 0) qsort_r(c->pos, (size_t)c->npos, sizeof(int32_t), cmp_starts, c);
    for (int64_t i = 0; i < c->npos; ++i) c->first[ctx_at(c, c->pos[i], 1) + 2]++;
    for (int64_t t = 1; t <= c->ntok; ++t) c->first[t] += c->first[t - 1];
    return c;
}

void qd_sc_free(void* handle) { free(handle); /* (its memory is the caller's) */ }

int64_t qd_sc_num_starts(void* handle) { return handle ? ((Corpus*)handle)->npos : -1; }

/* -1 / 0 / 1: start p's context's d-th token against the query's (q[d - 1]) */
static inline int cmp_token(const Corpus* c, int64_t p, int d, int32_t want) {
    const int32_t x = ctx_at(c, p, d);
    return x == want ? 0 : (x < want ? -1 : 1);
}

/* Within [*lo, *hi) (all sharing the query's first d - 1 context tokens), the run whose
 * d-th token is q. Returns its length. */
static int64_t narrow(const Corpus* c, int d, int32_t q, int64_t* lo, int64_t* hi) {
    int64_t a = *lo, b = *hi;
    while (a < b) { /* first with token >= q */
        const int64_t mid = a + (b - a) / 2;
        if (cmp_token(c, c->pos[mid], d, q) < 0) a = mid + 1; else b = mid;
    }
    int64_t e = a, f = *hi;
    while (e < f) { /* first with token > q */
        const int64_t mid = e + (f - e) / 2;
        if (cmp_token(c, c->pos[mid], d, q) <= 0) e = mid + 1; else f = mid;
    }
    *lo = a;
    *hi = e;
    return e - a;
}

typedef struct {
    int32_t token, count, first_child, next_sibling, depth;
} Node;

typedef struct {
    float q;
    int32_t parent; /* drafted index, -1: below the context */
    int32_t node;
} Cand;

/* Scratch bytes a look-up's trie of ``nodes`` nodes takes (qd_sc_speculate_tree). */
int64_t qd_sc_scratch_bytes(int64_t nodes) {
    return nodes < 0 ? -1 : nodes * (int64_t)(sizeof(Node) + sizeof(Cand));
}

static int cand_before(const Node* nodes, const Cand* a, const Cand* b) {
    if (a->q != b->q) return a->q > b->q;
    if (a->parent != b->parent) return a->parent < b->parent;
    return nodes[a->node].token < nodes[b->node].token;
}

static int push_children(const Node* nodes, int32_t node, int32_t parent, float p, Cand* cands,
                         int nc) {
    long long total = 0;
    for (int32_t k = nodes[node].first_child; k >= 0; k = nodes[k].next_sibling)
        total += nodes[k].count;
    for (int32_t k = nodes[node].first_child; k >= 0; k = nodes[k].next_sibling)
        cands[nc++] = (Cand){p * (float)nodes[k].count / (float)total, parent, k};
    return nc;
}

int qd_sc_speculate_tree(void* handle, const int32_t* ctx, int n, int max_nodes, float factor,
                         float min_prob, int min_match, int max_sources, int32_t* tokens,
                         int32_t* parents, float* probs, int* out_match, void* scratch,
                         int64_t scratch_bytes) {
    const Corpus* c = (const Corpus*)handle;
    if (!c || n < 0 || (n > 0 && !ctx) || max_nodes < 0 || max_nodes > 256 || max_sources < 1
        || !tokens || !parents || !probs || !out_match)
        return -1;
    *out_match = 0;
    int64_t lo = 0, hi = c->npos;
    int m = 0;
    const int longest = n < c->max_depth ? n : c->max_depth;
    if (longest > 0 && ctx[n - 1] != SEP) { /* the first level from the table */
        const int64_t t = ctx[n - 1];
        if (t < 0 || t + 2 > c->ntok || c->first[t + 1] == c->first[t + 2]) return 0;
        lo = c->first[t + 1];
        hi = c->first[t + 2];
        m = 1;
    }
    while (m < longest) {
        int64_t a = lo, b = hi;
        if (ctx[n - 1 - m] == SEP || narrow(c, m + 1, ctx[n - 1 - m], &a, &b) == 0) break;
        lo = a;
        hi = b;
        ++m;
    }
    if (m == 0 || m < min_match) return 0;
    *out_match = m;
    int budget = (int)(factor * (float)m);
    if (budget > max_nodes) budget = max_nodes;
    if (budget < 1) return 0;
    const int64_t run = hi - lo;
    const int sources = run < max_sources ? (int)run : max_sources;
    const size_t cap = (size_t)sources * (size_t)budget + 1;
    /* the caller's scratch when it holds the trie (the engine's: 256 sources x 16 nodes);
     * else allocated. A malloc and free of ~130 KB a call let glibc hand the pages back and
     * fault them in again on the next, ~90 us a look-up on the 2-core AMX Xeon VM. */
    const int on_heap = scratch == NULL || scratch_bytes < 0
                        || cap * (sizeof(Node) + sizeof(Cand)) > (size_t)scratch_bytes;
    Node* nodes = on_heap ? (Node*)malloc(cap * sizeof(Node)) : (Node*)scratch;
    Cand* cands = on_heap ? (Cand*)malloc(cap * sizeof(Cand)) : (Cand*)(nodes + cap);
    if (!nodes || !cands) {
        if (on_heap) { free(nodes); free(cands); }
        return -1;
    }
    int32_t used = 1;
    nodes[0] = (Node){SEP, 0, -1, -1, 0};
    /* the sources' continuations are far apart: ask for a batch of them before reading
     * any (their positions first), so that their cache misses overlap */
    int64_t starts[QD_SC_BATCH];
    for (int s = 0; s < sources; ++s) {
        if (s % QD_SC_BATCH == 0) {
            const int end = s + QD_SC_BATCH < sources ? s + QD_SC_BATCH : sources;
            for (int i = s; i < end; ++i) { /* (an index into pos, then a position) */
                starts[i - s] = lo + (int64_t)i * run / sources;
                __builtin_prefetch(&c->pos[starts[i - s]]);
            }
            for (int i = s; i < end; ++i) {
                starts[i - s] = c->pos[starts[i - s]];
                __builtin_prefetch(&c->tok[starts[i - s]]);
            }
        }
        const int64_t p = starts[s % QD_SC_BATCH];
        int32_t at = 0;
        for (int d = 0; d < budget && p + d < c->n && c->tok[p + d] != SEP; ++d) {
            const int32_t t = c->tok[p + d];
            int32_t k = nodes[at].first_child, last = -1;
            while (k >= 0 && nodes[k].token != t) { last = k; k = nodes[k].next_sibling; }
            if (k < 0) {
                k = used++;
                nodes[k] = (Node){t, 0, -1, -1, d + 1};
                if (last < 0) nodes[at].first_child = k; else nodes[last].next_sibling = k;
            }
            nodes[k].count++;
            at = k;
        }
    }
    int nc = push_children(nodes, 0, -1, 1.0f, cands, 0);
    int count = 0;
    while (count < max_nodes && nc > 0) {
        int best = 0;
        for (int i = 1; i < nc; ++i)
            if (cand_before(nodes, &cands[i], &cands[best])) best = i;
        const Cand cb = cands[best];
        cands[best] = cands[--nc];
        if (cb.q < min_prob) break; /* the best left is too unlikely: so are the rest */
        tokens[count] = nodes[cb.node].token;
        parents[count] = cb.parent;
        probs[count] = cb.q;
        if (nodes[cb.node].depth < budget)
            nc = push_children(nodes, cb.node, count, cb.q, cands, nc);
        ++count;
    }
    if (on_heap) {
        free(nodes);
        free(cands);
    }
    return count;
}
