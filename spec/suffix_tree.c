/* A suffix trie of bounded depth over token sequences, with occurrence counts, for suffix
 * decoding (SuffixDecoding, arXiv 2411.04975): every substring of length <= max_depth of the
 * sequences added so far is a path from the root, and a node's count is how many times its
 * substring occurs (in live sequences). Drafting finds the longest-scoring match of the
 * context's suffix and follows the most frequent continuations.
 *
 * Semantics (tests/spec/suffix_tree_reference.py is the plain-Python oracle):
 *   append(seq, tokens): for each appended token t, every suffix of the sequence ending at t
 *     of length 1..max_depth gets its node's count incremented (created at count 1);
 *   remove(seq): the counts the sequence added are taken back (nodes at count 0 are dead:
 *     never drafted, reused by nothing; callers rebuild a tree that holds too many);
 *   speculate(ctx, max_tokens, factor, min_prob, min_match): for each match length m =
 *     max(min_match, 1) .. min(len(ctx), max_depth) whose pattern ctx[-m:] has a live node,
 *     draft greedily from it:
 *     at each step take the live child with the highest count (ties: the smaller token id),
 *     p *= count(child) / sum of live children's counts, stop when p < min_prob or after
 *     min(max_tokens, floor(factor * m)) tokens; score = sum of the p of the drafted tokens.
 *     The result is the draft of the highest score (ties: the longer match).
 *
 * Nodes live in growable arrays; a node's children form a singly linked list (first_child,
 * next_sibling) and are found through one open-addressing hash table keyed by
 * (parent, token). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t* tokens;
    int len, cap;
    int alive;
    /* the nodes of the suffixes ending at the last token, shallowest first (lengths 1, 2,
     * ...), as the last append's walk left them; valid while active_len == len (else NULL
     * or stale): the next append starts from them instead of re-walking max_depth tokens,
     * and drafting for this sequence's own context reads its matches from them */
    int32_t* active;
    int n_active, active_len;
} Seq;

typedef struct {
    int max_depth;
    /* nodes */
    int32_t *token, *count, *depth, *first_child, *next_sibling;
    int n_nodes, cap_nodes, live_nodes;
    /* (parent << 32 | token) -> child, open addressing; EMPTY_KEY marks a free slot */
    uint64_t* keys;
    int32_t* vals;
    size_t hcap, hused;
    /* sequences, by id */
    Seq* seqs;
    int cap_seqs;
    /* scratch: the active nodes (suffixes ending at the last token) of the sequence being
     * walked, max_depth entries */
    int32_t *active, *next_active;
} Tree;

#define EMPTY_KEY UINT64_MAX

static uint64_t mix(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return k;
}

static int grow_nodes(Tree* t) {
    int cap = t->cap_nodes ? 2 * t->cap_nodes : 1024;
    int32_t** arrays[5] = {&t->token, &t->count, &t->depth, &t->first_child, &t->next_sibling};
    for (int i = 0; i < 5; ++i) {
        int32_t* p = (int32_t*)realloc(*arrays[i], (size_t)cap * sizeof(int32_t));
        if (!p) return -1;
        *arrays[i] = p;
    }
    t->cap_nodes = cap;
    return 0;
}

static int hash_rehash(Tree* t, size_t cap) {
    uint64_t* keys = (uint64_t*)malloc(cap * sizeof(uint64_t));
    int32_t* vals = (int32_t*)malloc(cap * sizeof(int32_t));
    if (!keys || !vals) {
        free(keys);
        free(vals);
        return -1;
    }
    for (size_t i = 0; i < cap; ++i) keys[i] = EMPTY_KEY;
    for (size_t i = 0; i < t->hcap; ++i) {
        if (t->keys[i] == EMPTY_KEY) continue;
        size_t j = mix(t->keys[i]) & (cap - 1);
        while (keys[j] != EMPTY_KEY) j = (j + 1) & (cap - 1);
        keys[j] = t->keys[i];
        vals[j] = t->vals[i];
    }
    free(t->keys);
    free(t->vals);
    t->keys = keys;
    t->vals = vals;
    t->hcap = cap;
    return 0;
}

static uint64_t key_of(int32_t parent, int32_t token) {
    return ((uint64_t)(uint32_t)parent << 32) | (uint32_t)token;
}

static int32_t find_child(const Tree* t, int32_t parent, int32_t token) {
    uint64_t key = key_of(parent, token);
    size_t j = mix(key) & (t->hcap - 1);
    while (t->keys[j] != EMPTY_KEY) {
        if (t->keys[j] == key) return t->vals[j];
        j = (j + 1) & (t->hcap - 1);
    }
    return -1;
}

/* The child of parent for token, created (count 0) if missing; -1 on no memory. */
static int32_t child_or_new(Tree* t, int32_t parent, int32_t token) {
    int32_t found = find_child(t, parent, token);
    if (found >= 0) return found;
    if (2 * (t->hused + 1) > t->hcap && hash_rehash(t, 2 * t->hcap) != 0) return -1;
    if (t->n_nodes == t->cap_nodes && grow_nodes(t) != 0) return -1;
    int32_t node = t->n_nodes++;
    t->token[node] = token;
    t->count[node] = 0;
    t->depth[node] = t->depth[parent] + 1;
    t->first_child[node] = -1;
    t->next_sibling[node] = t->first_child[parent];
    t->first_child[parent] = node;
    uint64_t key = key_of(parent, token);
    size_t j = mix(key) & (t->hcap - 1);
    while (t->keys[j] != EMPTY_KEY) j = (j + 1) & (t->hcap - 1);
    t->keys[j] = key;
    t->vals[j] = node;
    t->hused++;
    return node;
}

void* qd_st_new(int max_depth) {
    if (max_depth < 1 || max_depth > 1024) return NULL;
    Tree* t = (Tree*)calloc(1, sizeof(Tree));
    if (!t) return NULL;
    t->max_depth = max_depth;
    t->active = (int32_t*)malloc((size_t)max_depth * sizeof(int32_t));
    t->next_active = (int32_t*)malloc((size_t)max_depth * sizeof(int32_t));
    t->hcap = 1024;
    t->keys = (uint64_t*)malloc(t->hcap * sizeof(uint64_t));
    t->vals = (int32_t*)malloc(t->hcap * sizeof(int32_t));
    if (!t->active || !t->next_active || !t->keys || !t->vals || grow_nodes(t) != 0) {
        free(t->active);
        free(t->next_active);
        free(t->keys);
        free(t->vals);
        free(t);
        return NULL;
    }
    for (size_t i = 0; i < t->hcap; ++i) t->keys[i] = EMPTY_KEY;
    t->n_nodes = 1; /* the root */
    t->token[0] = -1;
    t->count[0] = 0;
    t->depth[0] = 0;
    t->first_child[0] = -1;
    t->next_sibling[0] = -1;
    return t;
}

void qd_st_free(void* handle) {
    Tree* t = (Tree*)handle;
    if (!t) return;
    for (int i = 0; i < t->cap_seqs; ++i) {
        free(t->seqs[i].tokens);
        free(t->seqs[i].active);
    }
    free(t->seqs);
    free(t->token);
    free(t->count);
    free(t->depth);
    free(t->first_child);
    free(t->next_sibling);
    free(t->keys);
    free(t->vals);
    free(t->active);
    free(t->next_active);
    free(t);
}

/* Walk the suffixes ending at each of tokens[from..len) of a sequence, adding delta to their
 * nodes' counts (creating nodes when delta > 0). The active set for position from - 1 is
 * `seq`'s cached one when that is valid (then every node in it exists: nodes are never
 * deleted, and ids never change), else rebuilt from the max_depth tokens before it (counts
 * untouched; find_child finds the same nodes, the rebuilt set only lacks the depth-max_depth
 * node, which has no child to walk to). With `seq`, its cache is set to the walk's end. */
static int walk(Tree* t, const int32_t* tokens, int from, int len, int delta, Seq* seq) {
    int n_active = 0;
    int start = from - t->max_depth + 1;
    if (start < 0) start = 0;
    if (seq && seq->active && seq->active_len == from) {
        n_active = seq->n_active;
        memcpy(t->active, seq->active, (size_t)n_active * sizeof(int32_t));
        start = from;
    }
    if (seq) seq->active_len = -1; /* stale until the walk completes */
    for (int i = start; i < len; ++i) {
        const int counting = i >= from;
        int n_next = 0;
        const int32_t tok = tokens[i];
        /* depth 1, then one deeper than each active node, shallowest first */
        const int32_t first = counting && delta > 0 ? child_or_new(t, 0, tok)
                                                    : find_child(t, 0, tok);
        if (first < 0) { /* no memory, or (remove / rebuild) a path that is not there */
            if (counting) return -1;
            n_active = 0;
            continue;
        }
        t->next_active[n_next++] = first;
        for (int a = 0; a < n_active; ++a) {
            const int32_t node = t->active[a];
            if (t->depth[node] >= t->max_depth) continue;
            int32_t c = counting && delta > 0 ? child_or_new(t, node, tok)
                                              : find_child(t, node, tok);
            if (c < 0) {
                if (counting) return -1;
                continue;
            }
            t->next_active[n_next++] = c;
        }
        if (counting) {
            for (int a = 0; a < n_next; ++a) {
                const int32_t node = t->next_active[a];
                if (t->count[node] == 0 && delta > 0) t->live_nodes++;
                t->count[node] += delta;
                if (t->count[node] == 0) t->live_nodes--;
            }
        }
        memcpy(t->active, t->next_active, (size_t)n_next * sizeof(int32_t));
        n_active = n_next;
    }
    if (seq && seq->active) {
        memcpy(seq->active, t->active, (size_t)n_active * sizeof(int32_t));
        seq->n_active = n_active;
        seq->active_len = len;
    }
    return 0;
}

int qd_st_append(void* handle, int seq_id, const int32_t* tokens, int n) {
    Tree* t = (Tree*)handle;
    if (!t || seq_id < 0 || n < 0 || (n > 0 && !tokens)) return -1;
    if (seq_id >= t->cap_seqs) {
        int cap = t->cap_seqs ? t->cap_seqs : 16;
        while (cap <= seq_id) cap *= 2;
        Seq* seqs = (Seq*)realloc(t->seqs, (size_t)cap * sizeof(Seq));
        if (!seqs) return -1;
        memset(seqs + t->cap_seqs, 0, (size_t)(cap - t->cap_seqs) * sizeof(Seq));
        t->seqs = seqs;
        t->cap_seqs = cap;
    }
    Seq* s = &t->seqs[seq_id];
    if (s->len + n > s->cap) {
        int cap = s->cap ? s->cap : 64;
        while (cap < s->len + n) cap *= 2;
        int32_t* p = (int32_t*)realloc(s->tokens, (size_t)cap * sizeof(int32_t));
        if (!p) return -1;
        s->tokens = p;
        s->cap = cap;
    }
    for (int i = 0; i < n; ++i)
        if (tokens[i] < 0) return -1;
    if (!s->active) {
        s->active = (int32_t*)malloc((size_t)t->max_depth * sizeof(int32_t));
        if (!s->active) return -1;
        s->active_len = -1;
    }
    memcpy(s->tokens + s->len, tokens, (size_t)n * sizeof(int32_t));
    const int from = s->len;
    s->len += n;
    s->alive = 1;
    return walk(t, s->tokens, from, s->len, +1, s);
}

int qd_st_remove(void* handle, int seq_id) {
    Tree* t = (Tree*)handle;
    if (!t || seq_id < 0 || seq_id >= t->cap_seqs || !t->seqs[seq_id].alive) return -1;
    Seq* s = &t->seqs[seq_id];
    int rc = walk(t, s->tokens, 0, s->len, -1, NULL);
    free(s->tokens);
    free(s->active);
    memset(s, 0, sizeof(Seq));
    return rc;
}

int qd_st_num_nodes(void* handle, int live) {
    Tree* t = (Tree*)handle;
    return t ? (live ? t->live_nodes : t->n_nodes - 1) : -1;
}

/* Whether node has a live child: its pattern occurred, followed by something, in a live
 * sequence (for a sequence's own context: before its last token). */
static int has_live_child(const Tree* t, int32_t node) {
    for (int32_t c = t->first_child[node]; c >= 0; c = t->next_sibling[c])
        if (t->count[c] > 0) return 1;
    return 0;
}

/* The greedy draft from node: returns its length, writes tokens and the score. */
static int draft_from(const Tree* t, int32_t node, int budget, float min_prob, int32_t* out,
                      float* score) {
    float p = 1.0f, s = 0.0f;
    int k = 0;
    while (k < budget) {
        int32_t best = -1;
        long long total = 0;
        for (int32_t c = t->first_child[node]; c >= 0; c = t->next_sibling[c]) {
            if (t->count[c] <= 0) continue;
            total += t->count[c];
            if (best < 0 || t->count[c] > t->count[best]
                || (t->count[c] == t->count[best] && t->token[c] < t->token[best]))
                best = c;
        }
        if (best < 0) break;
        const float q = p * (float)t->count[best] / (float)total;
        if (q < min_prob) break;
        out[k++] = t->token[best];
        s += q;
        p = q;
        node = best;
    }
    *score = s;
    return k;
}

/* The speculate() match: the best chain over the match lengths (see the header) into out;
 * its length, or -1 when out of memory. *node_out / *budget_out: where it starts and its
 * token budget (node 0 when nothing matched). The node of the pattern ctx[-m:] is walked
 * from the root, or read from `by_len` (by_len[m - 1], lengths 1..n_by_len: a sequence's
 * cached active set, when ctx is that sequence's tail). With `live_out` (else NULL), sets
 * *live_out to the largest such m whose node has a live child, if any (leaves it otherwise):
 * the longest suffix of ctx that occurred followed by something, whether or not a draft
 * from it passes min_prob.
 *
 * The loop stops at the first length whose pattern is missing or dead: every occurrence of
 * ctx[-(m+1):] ends with one of ctx[-m:] at the same position, counted by the same sequence,
 * so the longer pattern's count is at most the shorter's (and its node exists only if the
 * shorter's does). */
static int best_match(const Tree* t, const int32_t* ctx, int n, const int32_t* by_len,
                      int n_by_len, int max_tokens, float factor, float min_prob,
                      int min_match, int32_t* out, float* out_score, int* out_match,
                      int32_t* node_out, int* budget_out, int* live_out) {
    int32_t* buf = (int32_t*)malloc((size_t)(max_tokens > 0 ? max_tokens : 1) * sizeof(int32_t));
    if (!buf) return -1;
    int best_len = 0, best_match = 0, best_budget = 0;
    int32_t best_node = 0;
    float best_score = 0.0f;
    const int available = by_len ? n_by_len : n;
    const int longest = available < t->max_depth ? available : t->max_depth;
    for (int m = min_match > 1 ? min_match : 1; m <= longest; ++m) {
        int32_t node = 0;
        if (by_len)
            node = by_len[m - 1];
        else
            for (int i = n - m; i < n && node >= 0; ++i) node = find_child(t, node, ctx[i]);
        if (node < 0 || t->count[node] <= 0) break;
        if (live_out && has_live_child(t, node)) *live_out = m;
        int budget = (int)(factor * (float)m);
        if (budget > max_tokens) budget = max_tokens;
        float score;
        const int len = draft_from(t, node, budget, min_prob, buf, &score);
        if (len > 0 && score >= best_score) { /* ties: the longer match (m grows) */
            best_score = score;
            best_len = len;
            best_match = m;
            best_node = node;
            best_budget = budget;
            memcpy(out, buf, (size_t)len * sizeof(int32_t));
        }
    }
    free(buf);
    *out_score = best_score;
    *out_match = best_match;
    *node_out = best_node;
    *budget_out = best_budget;
    return best_len;
}

int qd_st_speculate(void* handle, const int32_t* ctx, int n, int max_tokens, float factor,
                    float min_prob, int min_match, int32_t* out, float* out_score,
                    int* out_match) {
    const Tree* t = (const Tree*)handle;
    if (!t || n < 0 || max_tokens < 0 || (n > 0 && !ctx) || !out || !out_score || !out_match)
        return -1;
    int32_t node;
    int budget;
    return best_match(t, ctx, n, NULL, 0, max_tokens, factor, min_prob, min_match, out,
                      out_score, out_match, &node, &budget, NULL);
}

typedef struct {
    float q;        /* path probability */
    int32_t parent; /* index among the drafted nodes, -1: below the match */
    int32_t node;   /* trie node */
} Cand;

/* a before b: higher q, then the earlier parent, then the smaller token */
static int cand_before(const Tree* t, const Cand* a, const Cand* b) {
    if (a->q != b->q) return a->q > b->q;
    if (a->parent != b->parent) return a->parent < b->parent;
    return t->token[a->node] < t->token[b->node];
}

/* Candidates for the live children of trie node `node` (drafted node `parent`, path
 * probability p) of the `limit` highest counts: only those can be drafted (a child is
 * drafted only after its more frequent siblings). Returns the new candidate count. */
static int push_children(const Tree* t, int32_t node, int32_t parent, float p, int limit,
                         Cand* cands, int nc) {
    long long total = 0;
    for (int32_t c = t->first_child[node]; c >= 0; c = t->next_sibling[c])
        if (t->count[c] > 0) total += t->count[c];
    if (total == 0) return nc;
    const int first = nc;
    for (int32_t c = t->first_child[node]; c >= 0; c = t->next_sibling[c]) {
        if (t->count[c] <= 0) continue;
        const Cand cand = {p * (float)t->count[c] / (float)total, parent, c};
        /* insertion into this node's sorted run [first, nc), at most `limit` long */
        int at = nc;
        while (at > first && cand_before(t, &cand, &cands[at - 1])) --at;
        if (at - first >= limit) continue;
        const int end = nc - first < limit ? nc : nc - 1;
        memmove(&cands[at + 1], &cands[at], (size_t)(end - at) * sizeof(Cand));
        cands[at] = cand;
        if (nc - first < limit) ++nc;
    }
    return nc;
}

/* The frequency-scored tree below the speculate() match (see the header): tokens, parents
 * (-1: a child of the match) and path probabilities of up to max_nodes nodes, best-first
 * (a parent before its children). Returns the node count, or -1 on bad input / no memory.
 * `live_out`: best_match's (the longest match that continued; NULL: not wanted). */
static int speculate_tree(const Tree* t, const int32_t* ctx, int n, const int32_t* by_len,
                          int n_by_len, int max_nodes, float factor, float min_prob,
                          int min_match, int32_t* tokens, int32_t* parents, float* probs,
                          int* out_match, int* live_out) {
    int32_t* chain = (int32_t*)malloc((size_t)(max_nodes > 0 ? max_nodes : 1) * sizeof(int32_t));
    int32_t* depth = (int32_t*)malloc((size_t)(max_nodes > 0 ? max_nodes : 1) * sizeof(int32_t));
    Cand* cands = (Cand*)malloc((size_t)(max_nodes + 1) * (size_t)(max_nodes + 1) * sizeof(Cand));
    if (!chain || !depth || !cands) { free(chain); free(depth); free(cands); return -1; }
    float score;
    int32_t match_node;
    int budget;
    const int len = best_match(t, ctx, n, by_len, n_by_len, max_nodes, factor, min_prob,
                               min_match, chain, &score, out_match, &match_node, &budget,
                               live_out);
    int count = 0;
    if (len > 0) {
        int nc = push_children(t, match_node, -1, 1.0f, max_nodes, cands, 0);
        while (count < max_nodes && nc > 0) {
            int best = 0;
            for (int i = 1; i < nc; ++i)
                if (cand_before(t, &cands[i], &cands[best])) best = i;
            const Cand c = cands[best];
            cands[best] = cands[--nc];
            if (c.q < min_prob) break; /* the best left is too unlikely: so are the rest */
            tokens[count] = t->token[c.node];
            parents[count] = c.parent;
            probs[count] = c.q;
            depth[count] = c.parent < 0 ? 1 : depth[c.parent] + 1;
            if (depth[count] < budget)
                nc = push_children(t, c.node, count, c.q, max_nodes - count - 1, cands, nc);
            ++count;
        }
    }
    free(chain);
    free(depth);
    free(cands);
    return len < 0 ? -1 : count;
}

int qd_st_speculate_tree(void* handle, const int32_t* ctx, int n, int max_nodes, float factor,
                         float min_prob, int min_match, int32_t* tokens, int32_t* parents,
                         float* probs, int* out_match) {
    const Tree* t = (const Tree*)handle;
    if (!t || n < 0 || max_nodes < 0 || max_nodes > 256 || (n > 0 && !ctx) || !tokens
        || !parents || !probs || !out_match)
        return -1;
    return speculate_tree(t, ctx, n, NULL, 0, max_nodes, factor, min_prob, min_match, tokens,
                          parents, probs, out_match, NULL);
}

/* A sequence's context for drafting: its last max_depth tokens (*n of them). */
static const int32_t* seq_context(const Tree* t, const Seq* s, int* n) {
    *n = s->len < t->max_depth ? s->len : t->max_depth;
    return s->tokens + (s->len - *n);
}

/* speculate_tree with ctx = sequence s's last max_depth tokens, its matches read from the
 * sequence's cached active set (no walks from the root); the same result. */
static int speculate_seq(const Tree* t, const Seq* s, int max_nodes, float factor,
                         float min_prob, int min_match, int32_t* tokens, int32_t* parents,
                         float* probs, int* out_match, int* live_out) {
    int n;
    const int32_t* ctx = seq_context(t, s, &n);
    const int cached = s->active && s->active_len == s->len;
    return speculate_tree(t, ctx, n, cached ? s->active : NULL,
                          cached ? s->n_active : 0, max_nodes, factor, min_prob, min_match,
                          tokens, parents, probs, out_match, live_out);
}

/* qd_st_speculate_tree with ctx = sequence seq_id's last max_depth tokens (speculate_seq). */
int qd_st_speculate_tree_seq(void* handle, int seq_id, int max_nodes, float factor,
                             float min_prob, int min_match, int32_t* tokens, int32_t* parents,
                             float* probs, int* out_match) {
    const Tree* t = (const Tree*)handle;
    if (!t || seq_id < 0 || seq_id >= t->cap_seqs || max_nodes < 0 || max_nodes > 256
        || !tokens || !parents || !probs || !out_match)
        return -1;
    const Seq* s = &t->seqs[seq_id];
    if (!s->alive) return -1;
    return speculate_seq(t, s, max_nodes, factor, min_prob, min_match, tokens, parents, probs,
                         out_match, NULL);
}

/* A request's proposal in one call (what the engine does each step it drafts): append
 * tokens[0..n) to sequence seq_id of `own`; draft a tree from that sequence's own context
 * (qd_st_speculate_tree_seq); when `other` is given (the tenant's trie of earlier outputs),
 * draft from it too, with the same context (the sequence's last max_depth tokens), and keep
 * the draft whose path probabilities sum higher (ties: the own trie's). Returns the node
 * count (outputs as qd_st_speculate_tree; out_match[1] = 0 own, 1 other; out_match[2] = the
 * longest match with a continuation in either trie, see best_match's `live_out`, 0 when
 * none is at least min_match long), -1 when the append fails, -2 on bad input.
 *
 * out_match[2] bounds the next proposals (spec/suffix.py, SuffixProposer.match_bound): j
 * tokens later, a longest match m means the context's last m - j tokens of then occurred
 * followed by something, so the longest match then is at most out_match[2] + j, as long as
 * neither trie gained a sequence (a request's own trie gains only its own tokens). */
int qd_st_extend_propose(void* own, int seq_id, const int32_t* new_tokens, int n_new,
                         void* other, int max_nodes, float factor, float min_prob,
                         int min_match, int32_t* tokens, int32_t* parents, float* probs,
                         int* out_match) {
    if (!own || max_nodes < 0 || max_nodes > 256 || !tokens || !parents || !probs
        || !out_match)
        return -2;
    if (qd_st_append(own, seq_id, new_tokens, n_new) != 0) return -1;
    const Tree* t = (const Tree*)own;
    int longest = 0;
    int count = speculate_seq(t, &t->seqs[seq_id], max_nodes, factor, min_prob, min_match,
                              tokens, parents, probs, out_match, &longest);
    if (count < 0) return -2;
    out_match[1] = 0;
    out_match[2] = longest;
    if (!other) return count;
    int n;
    const int32_t* ctx = seq_context(t, &t->seqs[seq_id], &n);
    int32_t alt_tokens[256], alt_parents[256];
    float alt_probs[256];
    int alt_match, alt_longest = 0;
    const int alt = speculate_tree((const Tree*)other, ctx, n, NULL, 0, max_nodes, factor,
                                   min_prob, min_match, alt_tokens, alt_parents, alt_probs,
                                   &alt_match, &alt_longest);
    if (alt < 0) return -2;
    if (alt_longest > longest) out_match[2] = alt_longest;
    double own_sum = 0.0, alt_sum = 0.0; /* (as Python sums the float32 probabilities) */
    for (int i = 0; i < count; ++i) own_sum += probs[i];
    for (int i = 0; i < alt; ++i) alt_sum += alt_probs[i];
    if (alt_sum > own_sum) {
        memcpy(tokens, alt_tokens, (size_t)alt * sizeof(int32_t));
        memcpy(parents, alt_parents, (size_t)alt * sizeof(int32_t));
        memcpy(probs, alt_probs, (size_t)alt * sizeof(float));
        out_match[0] = alt_match;
        out_match[1] = 1;
        count = alt;
    }
    return count;
}
