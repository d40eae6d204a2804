// The draft head's layer and whole forward (DraftHeadRunner), included by cpu_layer.cpp
// inside its namespace: on raw buffers from an arena, as the target's layers (the same
// kernels, in the same order, as the head's torch calls in spec/draft_head.py, so the same
// bits); the op head_layer, and HeadStack, the whole forward with the head's weights bound
// once and a step's metadata as the packed array of kernels/attention_metadata.py.

// table[index] (table: contiguous bf16 [n, width]; index: contiguous int64 [rows], every
// value in [0, n), checked before anything is copied): a new [rows, width] tensor, the rows
// F.embedding copies.
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index) {
    check(table.dim() == 2 && table.is_contiguous() && table.scalar_type() == at::kBFloat16
              && table.is_cpu(),
          "a gathered table must be a contiguous bf16 [n, width] matrix");
    check(index.dim() == 1 && index.is_contiguous() && index.scalar_type() == at::kLong
              && index.is_cpu() && index.size(0) > 0,
          "ids and positions must be non-empty contiguous int64 vectors");
    const int64_t rows = index.size(0), n = table.size(0), width = table.size(1);
    const int64_t* ix = index.data_ptr<int64_t>();
    for (int64_t i = 0; i < rows; ++i) check(ix[i] >= 0 && ix[i] < n, "index out of range");
    at::Tensor out = empty_bf16(rows, width);
    const uint16_t* src = ptr<const uint16_t>(table);
    uint16_t* dst = ptr<uint16_t>(out);
    for (int64_t i = 0; i < rows; ++i)
        std::memcpy(dst + i * width, src + ix[i] * width, static_cast<size_t>(width) * 2);
    return out;
}

// dst [n, width] = src[ix[i]] for i < n (indices checked by the caller).
void gather_raw(const uint16_t* src, int64_t width, const int64_t* ix, int64_t n, uint16_t* dst) {
    for (int64_t i = 0; i < n; ++i)
        std::memcpy(dst + i * width, src + ix[i] * width, static_cast<size_t>(width) * 2);
}

// A vector's values, checked: each in [0, n) and, where asked, strictly increasing. Its
// data, or null when it is empty.
const int64_t* checked_indices(const std::vector<int64_t>& v, int64_t n, bool increasing,
                               const char* what) {
    for (size_t i = 0; i < v.size(); ++i)
        check(v[i] >= 0 && v[i] < n && (!increasing || i == 0 || v[i] > v[i - 1]), what);
    return v.empty() ? nullptr : v.data();
}

// The head layer's weights: in_norm, hidden_norm, qkv, o, post_norm, gate_up, down (each
// matrix 2 tensors for ATen's int4 kernel or 3 for q4q8: 11 or 15 in all).
struct HeadLayerWeights {
    const at::Tensor *in_norm, *hidden_norm, *post_norm;
    Matrix qkv, o, gate_up, down;
};

HeadLayerWeights head_layer_weights(at::TensorList weights) {
    const size_t nw = weights.size();
    check(nw == 11 || nw == 15, "expected 11 or 15 head weights");
    const bool q4q8 = nw == 15;
    check(!q4q8 || q4q8_fn != nullptr, "the q4q8 kernel is not available");
    const size_t per = q4q8 ? 3 : 2;
    auto matrix = [&](size_t first) {
        return Matrix{{&weights[first], &weights[first + 1], &weights[first + per - 1]}, q4q8};
    };
    return {&weights[0], &weights[1], &weights[2 + 2 * per],
            matrix(2), matrix(2 + per), matrix(3 + 2 * per), matrix(3 + 3 * per)};
}

// The draft head's one layer (spec/draft_head.py: layer_input, attention, finish_layer):
//
//   x      = [rms_norm(emb, in_norm) | rms_norm(hidden, hidden_norm)]   [r, 2 hidden]
//   qkv    = mm(x, qkv_w); rope in place; attn = write_kv_and_attend(qkv, kv_cache, meta)
//   a      = hidden + mm(attn, o_w)
//   y      = a + mm(silu_mul(mm(rms_norm(a, post_norm), gate_up_w)), down_w)
//
// emb, hidden, cos, sin: [r, .] for the r rows computed. step_ix (increasing indices of the
// step's step_rows rows, or null: r = step_rows, every row): a drafting round's new nodes
// among every node fed so far; the other rows are neither computed nor written (their K/V
// are cached already; they get a zero query). out_ix (indices of the r rows, exclusive with
// step_ix; null: all): the rows whose outputs are wanted (a catch-up's last row per request:
// nothing reads the others'); every row's K/V is still written, but o, the residual and the
// MLP run on those rows only. y: [n_out or r, hidden]. Each computed row is the same bits
// as in a call computing every row (every kernel here is row by row). Intermediates from
// ``arena``.
void head_layer_raw(const uint16_t* emb, const uint16_t* hidden, int64_t r, int64_t h,
                    const HeadLayerWeights& w, const uint16_t* cos, const uint16_t* sin,
                    const at::Tensor& kv_cache, const StepMeta& meta, int64_t step_rows,
                    const int64_t* step_ix, const int64_t* out_ix, int64_t n_out,
                    int64_t heads, int64_t kv_heads, double eps, double scale, Arena& arena,
                    uint16_t* y) {
    check(rms_fn && rope_fn && silu_fn && attend_fn, "set_cpu_kernels was not called");
    check(!(step_ix && out_ix), "rows and out_rows are exclusive");
    const int threads = at::get_num_threads();
    const int small_threads = r > par_rows ? threads : 1;

    uint16_t* e = take_bf16(arena, r, h);
    uint16_t* g = take_bf16(arena, r, h);
    rms_raw(emb, nullptr, *w.in_norm, e, nullptr, r, h, eps, small_threads);
    rms_raw(hidden, nullptr, *w.hidden_norm, g, nullptr, r, h, eps, small_threads);
    uint16_t* x = take_bf16(arena, r, 2 * h);  // e and g side by side, as at::cat
    for (int64_t i = 0; i < r; ++i) {
        std::memcpy(x + i * 2 * h, e + i * h, static_cast<size_t>(h) * 2);
        std::memcpy(x + i * 2 * h + h, g + i * h, static_cast<size_t>(h) * 2);
    }
    const int64_t width = out_features(w.qkv);  // (H + 2 KVH) * D
    const int64_t d = width / (heads + 2 * kv_heads), attn_width = heads * d;
    check(d * (heads + 2 * kv_heads) == width, "qkv width does not fit the heads");
    uint16_t* qkv = take_bf16(arena, r, width);
    mm_raw(x, r, 2 * h, w.qkv, qkv, threads, arena);
    rope_rows_raw(qkv, r, width, cos, sin, heads, kv_heads, small_threads);
    uint16_t* attn = take_bf16(arena, r, attn_width);
    if (step_ix == nullptr) {
        attend_raw(qkv, r, width, meta, kv_cache, heads, kv_heads, scale, threads, attn);
    } else {  // the step's other rows: a zero query, no K/V written (slot -1)
        uint16_t* full = take_bf16(arena, step_rows, width);
        std::memset(full, 0, static_cast<size_t>(step_rows * width) * 2);
        auto* written = static_cast<int32_t*>(arena.raw(static_cast<size_t>(step_rows) * 4));
        for (int64_t t = 0; t < step_rows; ++t) written[t] = -1;
        for (int64_t i = 0; i < r; ++i) {
            std::memcpy(full + step_ix[i] * width, qkv + i * width,
                        static_cast<size_t>(width) * 2);
            written[step_ix[i]] = meta.slots[step_ix[i]];
        }
        StepMeta only = meta;
        only.slots = written;
        uint16_t* all = take_bf16(arena, step_rows, attn_width);
        attend_raw(full, step_rows, width, only, kv_cache, heads, kv_heads, scale, threads, all);
        gather_raw(all, attn_width, step_ix, r, attn);
    }
    const uint16_t* residual = hidden;
    int64_t l = r;
    if (out_ix != nullptr) {  // every row's K/V is written: the rest on these rows
        uint16_t* picked = take_bf16(arena, n_out, attn_width);
        gather_raw(attn, attn_width, out_ix, n_out, picked);
        attn = picked;
        uint16_t* res = take_bf16(arena, n_out, h);
        gather_raw(hidden, h, out_ix, n_out, res);
        residual = res;
        l = n_out;
    }
    const int out_threads = l > par_rows ? threads : 1;
    check(out_features(w.o) == h && out_features(w.down) == h,
          "o's or down's output does not fit the hidden size");
    uint16_t* o = take_bf16(arena, l, h);
    mm_raw(attn, l, attn_width, w.o, o, threads, arena);
    uint16_t* a = take_bf16(arena, l, h);
    add_raw(residual, o, a, l * h);
    uint16_t* h2 = take_bf16(arena, l, h);
    rms_raw(a, nullptr, *w.post_norm, h2, nullptr, l, h, eps, out_threads);
    uint16_t* down = take_bf16(arena, l, h);
    mlp_raw(h2, l, h, w.gate_up, w.down, down, threads, out_threads, arena);
    add_raw(a, down, y, l * h);
}

// The head_layer op: head_layer_raw over tensors (rows: the step rows emb, hidden, cos and
// sin hold, or None: every row), its result allocated.
at::Tensor head_layer(const at::Tensor& emb, const at::Tensor& hidden, at::TensorList weights,
                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                      at::TensorList meta, int64_t heads, int64_t kv_heads, double eps,
                      double scale, const std::optional<at::Tensor>& rows_opt) {
    const HeadLayerWeights w = head_layer_weights(weights);
    for (const at::Tensor* t : {&emb, &hidden})
        check(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
              "emb and hidden must be contiguous bf16 [rows, hidden] matrices");
    check(emb.sizes() == hidden.sizes(), "emb and hidden differ in shape");
    const int64_t r = emb.size(0), h = emb.size(1);
    const int64_t d = out_features(w.qkv) / (heads + 2 * kv_heads);
    check(cos.numel() == r * d && sin.numel() == r * d && cos.is_contiguous()
              && sin.is_contiguous() && cos.scalar_type() == at::kBFloat16
              && sin.scalar_type() == at::kBFloat16,
          "qkv width or rope tables do not fit the heads");
    const int64_t step_rows = meta.empty() ? 0 : meta[0].numel();
    StepMeta m = step_meta(meta, step_rows);
    std::vector<int64_t> ix;
    if (rows_opt.has_value()) {
        const at::Tensor& idx = *rows_opt;
        check(idx.dim() == 1 && idx.numel() == r && idx.scalar_type() == at::kLong
                  && idx.is_contiguous(),
              "rows must be an int64 [r] vector, one per row of emb");
        ix.assign(idx.data_ptr<int64_t>(), idx.data_ptr<int64_t>() + r);
        checked_indices(ix, step_rows, true, "rows must be increasing indices of the step's rows");
    } else {
        check(step_rows == r, "slot_mapping must be an int32 [rows] vector");
    }
    at::Tensor y = empty_bf16(r, h);
    Arena arena;
    head_layer_raw(ptr<const uint16_t>(emb), ptr<const uint16_t>(hidden), r, h, w,
                   ptr<const uint16_t>(cos), ptr<const uint16_t>(sin), kv_cache, m, step_rows,
                   ix.empty() ? nullptr : ix.data(), nullptr, 0, heads, kv_heads, eps, scale,
                   arena, ptr<uint16_t>(y));
    return y;
}

// The draft head's whole forward, where from Python it took ~10 torch calls around the
// layer, each slow after a target step has left the dispatcher's code and data cold:
//
//   hidden = fc(hidden) when it is the target's fused features ([r, 3 hidden]), else as given
//   emb    = embed[ids]; cos, sin = the RoPE tables' rows at positions
//   out    = head_layer(emb, hidden, ...)[logit_rows]                      [l, hidden]
//   logits = fp32(lm_head(rms_norm(out, final_norm)))                      [l, V_d]
//
// weights: head_layer's 15 (q4q8), then final_norm and the LM head's 3 tensors, then
// (optionally) fc's 3.
struct HeadForwardWeights {
    HeadLayerWeights layer;
    const at::Tensor* final_norm;
    Matrix lm_head, fc;  // fc.parts[0] null: none
};

HeadForwardWeights head_forward_weights(at::TensorList weights) {
    check(weights.size() == 19 || weights.size() == 22,
          "expected the head layer's 15 weights, the final norm and the LM head's 3, "
          "and optionally fc's 3");
    HeadForwardWeights w{head_layer_weights(weights.slice(0, 15)), &weights[15],
                         Matrix{{&weights[16], &weights[17], &weights[18]}, true},
                         Matrix{{nullptr, nullptr, nullptr}, true}};
    if (weights.size() == 22) w.fc = Matrix{{&weights[19], &weights[20], &weights[21]}, true};
    return w;
}

// The forward over r rows (ids, positions: [r]; hidden_in [r, width]) of a step of
// step_rows rows (step_ix: head_layer_raw's; logit_ix: the n_out rows, of the r, whose
// outputs and logits are wanted, or null: all). Results into out [l, hidden] and logits
// [l, V_d] fp32. Every id, position and index is checked before anything is written.
void head_forward_raw(const int64_t* ids, const int64_t* positions, int64_t r,
                      const uint16_t* hidden_in, int64_t width, const HeadForwardWeights& w,
                      const at::Tensor& embed, const at::Tensor& cos_table,
                      const at::Tensor& sin_table, const at::Tensor& kv_cache,
                      const StepMeta& meta, int64_t step_rows, const int64_t* step_ix,
                      const int64_t* logit_ix, int64_t n_out, int64_t heads, int64_t kv_heads,
                      double eps, double scale, Arena& arena, uint16_t* out, float* logits) {
    const int64_t h = embed.size(1), d = cos_table.size(1);
    for (const at::Tensor* t : {&embed, &cos_table, &sin_table})
        check(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
              "embed and the rope tables must be contiguous bf16 matrices");
    check(sin_table.sizes() == cos_table.sizes()
              && d * (heads + 2 * kv_heads) == out_features(w.layer.qkv),
          "the rope tables do not fit the heads");
    for (int64_t i = 0; i < r; ++i)
        check(ids[i] >= 0 && ids[i] < embed.size(0) && positions[i] >= 0
                  && positions[i] < cos_table.size(0),
              "index out of range");
    const int threads = at::get_num_threads();
    const uint16_t* hidden = hidden_in;
    if (width != h) {  // the target's features: fuse them first
        check(w.fc.parts[0] != nullptr, "features given without fc's weights");
        uint16_t* fused = take_bf16(arena, r, h);
        mm_raw(hidden_in, r, width, w.fc, fused, threads, arena);
        hidden = fused;
    }
    uint16_t* emb = take_bf16(arena, r, h);
    gather_raw(ptr<const uint16_t>(embed), h, ids, r, emb);
    uint16_t* cos = take_bf16(arena, r, d);
    uint16_t* sin = take_bf16(arena, r, d);
    gather_raw(ptr<const uint16_t>(cos_table), d, positions, r, cos);
    gather_raw(ptr<const uint16_t>(sin_table), d, positions, r, sin);
    const bool out_rows = logit_ix != nullptr && step_ix == nullptr;
    const int64_t l = logit_ix != nullptr ? n_out : r;
    uint16_t* y = out_rows || logit_ix == nullptr ? out : take_bf16(arena, r, h);
    head_layer_raw(emb, hidden, r, h, w.layer, cos, sin, kv_cache, meta, step_rows, step_ix,
                   out_rows ? logit_ix : nullptr, n_out, heads, kv_heads, eps, scale, arena, y);
    if (logit_ix != nullptr && !out_rows) gather_raw(y, h, logit_ix, l, out);
    uint16_t* normed = take_bf16(arena, l, h);
    rms_raw(out, nullptr, *w.final_norm, normed, nullptr, l, h, eps, l > par_rows ? threads : 1);
    const int64_t vocab = out_features(w.lm_head);
    uint16_t* logits16 = take_bf16(arena, l, vocab);
    mm_raw(normed, l, h, w.lm_head, logits16, threads, arena);
    for (int64_t i = 0; i < l * vocab; ++i) logits[i] = bf16_to_f32(logits16[i]);
}

// The draft head bound once (its weights, the target's embeddings and RoPE tables), so that
// a proposal's forward is one method call taking plain integer lists: as an op it took ~27
// tensors (its weight list), three index tensors and an AttentionMetadata's views, which
// right after a target step (the interpreter's and the dispatcher's code and
// data cold) cost more than the forward's own arithmetic for a few rows (SmolLM2's head on
// the 2-core AVX2-only Zen 3 EPYC: ~0.25 ms to build a catch-up's metadata, ~0.1 ms for the
// index tensors, against ~0.7 ms for the forward itself). Intermediates come from an arena
// kept between calls.
struct HeadStack : torch::CustomClassHolder {
    std::vector<at::Tensor> weights;  // head_forward_weights' list
    HeadForwardWeights w;             // read from weights once
    at::Tensor embed, cos_table, sin_table;
    int64_t heads, kv_heads;
    double eps, scale;
    Arena arena;
    std::mutex lock;

    HeadStack(std::vector<at::Tensor> weights_, at::Tensor embed_, at::Tensor cos_table_,
              at::Tensor sin_table_, int64_t heads_, int64_t kv_heads_, double eps_,
              double scale_)
        : weights(std::move(weights_)), w(head_forward_weights(weights)),
          embed(std::move(embed_)), cos_table(std::move(cos_table_)),
          sin_table(std::move(sin_table_)), heads(heads_), kv_heads(kv_heads_), eps(eps_),
          scale(scale_) {}

    // head_forward_raw over the step whose metadata is ``packed`` (the int32 values of
    // attention_metadata.pack_step for num_seqs sequences and block tables max_blocks wide:
    // slot_mapping, query_start_loc, seq_lens, block_tables) and ``tree_mask`` (one int64
    // per step row, or empty: every row causal); rows and logit_rows empty: None.
    std::vector<at::Tensor> forward(std::vector<int64_t> ids, std::vector<int64_t> positions,
                                    const at::Tensor& hidden, const at::Tensor& kv_cache,
                                    std::vector<int64_t> packed, int64_t num_seqs,
                                    int64_t max_blocks, std::vector<int64_t> tree_mask,
                                    std::vector<int64_t> rows, std::vector<int64_t> logit_rows) {
        check_activations(hidden, "hidden");
        const int64_t r = static_cast<int64_t>(ids.size());
        check(r > 0 && positions.size() == ids.size() && hidden.size(0) == r,
              "ids, positions and hidden must have the same rows");
        check(num_seqs > 0 && max_blocks > 0, "a step has sequences and block tables");
        const int64_t step_rows =
            static_cast<int64_t>(packed.size()) - 2 * num_seqs - 1 - num_seqs * max_blocks;
        check(step_rows > 0, "packed does not fit num_seqs and max_blocks");
        check(rows.empty() ? step_rows == r : static_cast<int64_t>(rows.size()) == r,
              "rows must be an int64 [r] vector, one per row of emb");
        check(tree_mask.empty() || static_cast<int64_t>(tree_mask.size()) == step_rows,
              "tree_mask must have one value per row of the step");
        checked_indices(rows, step_rows, true, "rows must be increasing indices of the step's rows");
        checked_indices(logit_rows, r, false, "logit_rows out of range");
        std::vector<int32_t> meta32(packed.size());
        for (size_t i = 0; i < packed.size(); ++i) {
            check(packed[i] >= INT32_MIN && packed[i] <= INT32_MAX, "metadata out of int32");
            meta32[i] = static_cast<int32_t>(packed[i]);
        }
        const int32_t* base = meta32.data();
        const StepMeta m{base, base + step_rows + 2 * num_seqs + 1, base + step_rows + num_seqs + 1,
                         base + step_rows, tree_mask.empty() ? nullptr : tree_mask.data(),
                         static_cast<int>(num_seqs), static_cast<int>(max_blocks)};
        const int64_t l = logit_rows.empty() ? r : static_cast<int64_t>(logit_rows.size());
        at::Tensor out = empty_bf16(l, embed.size(1));
        at::Tensor logits = at::empty({l, out_features(w.lm_head)},
                                      at::TensorOptions().dtype(at::kFloat));
        const std::lock_guard<std::mutex> hold(lock);
        arena.reset();
        head_forward_raw(ids.data(), positions.data(), r, ptr<const uint16_t>(hidden),
                         hidden.size(1), w, embed, cos_table, sin_table, kv_cache, m, step_rows,
                         rows.empty() ? nullptr : rows.data(),
                         logit_rows.empty() ? nullptr : logit_rows.data(), l, heads, kv_heads,
                         eps, scale, arena, ptr<uint16_t>(out), logits.data_ptr<float>());
        arena.release_above(kArenaKeepBytes);
        return {out, logits};
    }
};
