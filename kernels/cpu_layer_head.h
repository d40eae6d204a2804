// The draft head's layer and whole forward (DraftHeadRunner), included by cpu_layer.cpp
// inside its namespace: tensor wrappers around the layer's raw steps (their outputs
// allocated), the head's layer, and its forward with the fused features, the gathers and
// the LM head around that layer.

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

// -- the same on tensors, for the draft head's layer (its outputs allocated)

// y = norm(x (+ residual)); r = x + residual. residual undefined: r = x.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps, int threads) {
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor y = empty_bf16(rows, n);
    at::Tensor r = residual.defined() ? empty_bf16(rows, n) : x;
    rms_raw(ptr<const uint16_t>(x), residual.defined() ? ptr<const uint16_t>(residual) : nullptr,
            w, ptr<uint16_t>(y), ptr<uint16_t>(r), rows, n, eps, threads);
    return {y, r};
}

at::Tensor mm(const at::Tensor& x, const Matrix& w, int threads) {
    if (!w.q4q8) return at::cpu::_weight_int4pack_mm_for_cpu(x, *w.parts[0], kGroup, *w.parts[1]);
    const int64_t rows = x.size(0), k = x.size(1);
    at::Tensor y = empty_bf16(rows, out_features(w));
    at::Tensor scratch = at::empty({static_cast<int64_t>(q4q8_scratch_bytes(rows, k))},
                                   at::TensorOptions().dtype(at::kByte));
    q4q8_mm(ptr<const uint16_t>(x), rows, k, w, ptr<uint16_t>(y), threads, scratch.data_ptr());
    return y;
}

// ``slots`` (int32 [rows]) in place of meta's slot_mapping: the head's rounds write only
// their new rows.
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& slots, const at::Tensor& kv_cache,
                  at::TensorList meta, int64_t heads, int64_t kv_heads, double scale,
                  int threads) {
    const int64_t rows = qkv.size(0), width = qkv.size(1);
    StepMeta m = step_meta(meta, rows);
    check(slots.numel() == rows && slots.scalar_type() == at::kInt && slots.is_contiguous(),
          "slot_mapping must be an int32 [rows] vector");
    m.slots = ptr<const int32_t>(slots);
    at::Tensor attn = empty_bf16(rows, heads * (width / (heads + 2 * kv_heads)));
    attend_raw(ptr<const uint16_t>(qkv), rows, width, m, kv_cache, heads, kv_heads, scale,
               threads, ptr<uint16_t>(attn));
    return attn;
}

// The MLP: mm(silu_mul(mm(h, gate_up_w)), down_w).
at::Tensor mlp(const at::Tensor& h, const Matrix& gate_up_w, const Matrix& down_w, int threads,
               int small_threads) {
    at::Tensor gate_up = mm(h, gate_up_w, threads);  // [T, 2 * inter]
    const int64_t rows = h.size(0), inter = gate_up.size(1) / 2;
    at::Tensor act = empty_bf16(rows, inter);
    silu_raw(ptr<const uint16_t>(gate_up), ptr<uint16_t>(act), rows, inter, small_threads);
    return mm(act, down_w, threads);
}

// The draft head's one layer (spec/draft_head.py: layer_input, attention, finish_layer), in
// the same kernels and order as its Python form over these weights:
//
//   x      = [rms_norm(emb, in_norm) | rms_norm(hidden, hidden_norm)]   [T, 2 hidden]
//   qkv    = mm(x, qkv_w); rope in place; attn = write_kv_and_attend(qkv, kv_cache, meta)
//   a      = hidden + mm(attn, o_w)
//   return a + mm(silu_mul(mm(rms_norm(a, post_norm), gate_up_w)), down_w)
//
// weights: in_norm, hidden_norm, qkv, o, post_norm, gate_up, down (each matrix 2 tensors for
// ATen's int4 kernel or 3 for q4q8: 11 or 15 in all); meta as decoder_layer's.
// rows (int64 [r], increasing): emb, hidden, cos and sin hold only these rows of the step
// that meta describes (a drafting round's new nodes among every node fed so far); the other
// rows are neither computed nor written (their K/V are cached already), and the result is
// [r, hidden], each row the same bits as when every row is computed. None: every row.
//
// out_rows (int64 [l], checked in range by the caller; only without rows): the rows whose
// outputs are wanted (a catch-up's last row per request: nothing reads the others'). Every
// row's K/V is still written, but o, the residual and the MLP run on those rows only, and the
// result is [l, hidden], each row the same bits as in the call over every row.
at::Tensor head_layer_rows(const at::Tensor& emb, const at::Tensor& hidden,
                           at::TensorList weights, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& kv_cache, at::TensorList meta, int64_t heads,
                           int64_t kv_heads, double eps, double scale,
                           const std::optional<at::Tensor>& rows_opt,
                           const std::optional<at::Tensor>& out_rows_opt) {
    check(rms_fn && rope_fn && silu_fn && attend_fn, "set_cpu_kernels was not called");
    check(!(rows_opt.has_value() && out_rows_opt.has_value()), "rows and out_rows are exclusive");
    const size_t nw = weights.size();
    check(nw == 11 || nw == 15, "expected 11 or 15 head weights");
    const bool q4q8 = nw == 15;
    check(!q4q8 || q4q8_fn != nullptr, "the q4q8 kernel is not available");
    const size_t per = q4q8 ? 3 : 2;
    auto matrix = [&](size_t first) {
        return Matrix{{&weights[first], &weights[first + 1], &weights[first + per - 1]}, q4q8};
    };
    const Matrix qkv_w = matrix(2), o_w = matrix(2 + per), gate_up_w = matrix(3 + 2 * per),
                 down_w = matrix(3 + 3 * per);
    const at::Tensor& post_norm = weights[2 + 2 * per];
    check(meta.size() == 5, "expected 5 metadata tensors");
    for (const at::Tensor* t : {&emb, &hidden})
        check(t->dim() == 2 && t->is_contiguous() && t->scalar_type() == at::kBFloat16,
              "emb and hidden must be contiguous bf16 [rows, hidden] matrices");
    check(emb.sizes() == hidden.sizes(), "emb and hidden differ in shape");
    const int64_t rows = emb.size(0);
    const int threads = at::get_num_threads();
    const int small_threads = rows > par_rows ? threads : 1;
    const at::Tensor none;

    auto [e, e_unused] = add_rms_norm(emb, none, weights[0], eps, small_threads);
    auto [g, g_unused] = add_rms_norm(hidden, none, weights[1], eps, small_threads);
    at::Tensor qkv = mm(at::cat({e, g}, 1), qkv_w, threads);  // [r, (H + 2 KVH) * D]
    rope_raw(ptr<uint16_t>(qkv), qkv.size(0), qkv.size(1), cos, sin, heads, kv_heads,
             small_threads);
    at::Tensor attn;
    if (!rows_opt.has_value()) {
        attn = attend(qkv, meta[0], kv_cache, meta, heads, kv_heads, scale, threads);
    } else {
        // only the listed rows of the step: the others (earlier rounds' nodes, their K/V
        // already cached) get a zero query and write nothing; each computed row's result is
        // the same bits as in a step computing every row (every kernel here is row by row)
        const at::Tensor& idx = *rows_opt;
        const at::Tensor& slots = meta[0];
        const int64_t total = slots.numel();
        check(idx.dim() == 1 && idx.numel() == rows && idx.scalar_type() == at::kLong
                  && idx.is_contiguous() && slots.scalar_type() == at::kInt
                  && slots.is_contiguous(),
              "rows must be an int64 [r] vector, one per row of emb");
        const int64_t* ix = idx.data_ptr<int64_t>();
        for (int64_t i = 0; i < rows; i++)
            check(ix[i] >= (i ? ix[i - 1] + 1 : 0) && ix[i] < total,
                  "rows must be increasing indices of the step's rows");
        const int64_t width = qkv.size(1);
        // [T, width]: zero but the listed rows
        at::Tensor full = empty_bf16(total, width);
        std::memset(full.data_ptr(), 0, static_cast<size_t>(total * width) * 2);
        at::Tensor written = at::empty({total}, slots.options());  // their slots, else -1
        const int32_t* from = slots.data_ptr<int32_t>();
        int32_t* to = written.data_ptr<int32_t>();
        for (int64_t t = 0; t < total; t++) to[t] = -1;
        const auto* src = static_cast<const uint16_t*>(qkv.data_ptr());
        auto* dst = static_cast<uint16_t*>(full.data_ptr());
        for (int64_t i = 0; i < rows; i++) {
            std::memcpy(dst + ix[i] * width, src + i * width, static_cast<size_t>(width) * 2);
            to[ix[i]] = from[ix[i]];
        }
        at::Tensor all = attend(full, written, kv_cache, meta, heads, kv_heads, scale, threads);
        const int64_t hd = all.size(1);
        attn = empty_bf16(rows, hd);  // [r, H * D]
        const auto* a_src = static_cast<const uint16_t*>(all.data_ptr());
        auto* a_dst = static_cast<uint16_t*>(attn.data_ptr());
        for (int64_t i = 0; i < rows; i++)
            std::memcpy(a_dst + i * hd, a_src + ix[i] * hd, static_cast<size_t>(hd) * 2);
    }
    at::Tensor residual = hidden;
    int out_threads = small_threads;
    if (out_rows_opt.has_value()) {  // every row's K/V is written: the rest on these rows
        attn = gather_rows(attn, *out_rows_opt);  // [l, H * D]
        residual = gather_rows(hidden, *out_rows_opt);  // [l, hidden]
        out_threads = attn.size(0) > par_rows ? threads : 1;
    }
    at::Tensor a = at::add(residual, mm(attn, o_w, threads));
    auto [h2, h2_unused] = add_rms_norm(a, none, post_norm, eps, out_threads);
    return at::add(a, mlp(h2, gate_up_w, down_w, threads, out_threads));
}

at::Tensor head_layer(const at::Tensor& emb, const at::Tensor& hidden, at::TensorList weights,
                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                      at::TensorList meta, int64_t heads, int64_t kv_heads, double eps,
                      double scale, const std::optional<at::Tensor>& rows_opt) {
    return head_layer_rows(emb, hidden, weights, cos, sin, kv_cache, meta, heads, kv_heads, eps,
                           scale, rows_opt, std::nullopt);
}

// The draft head's whole forward over a step's rows in one call (DraftHeadRunner.propose:
// a catch-up or a drafting round), where from Python it took ~10 torch calls around
// head_layer, each slow after a target step has left the dispatcher's code and data cold:
//
//   hidden = fc(hidden) when it is the target's fused features ([T, 3 hidden]), else as given
//   emb    = embed[ids]; cos, sin = the RoPE tables' rows at positions
//   out    = head_layer(emb, hidden, ...)[logit_rows]                      [l, hidden]
//   logits = fp32(lm_head(rms_norm(out, final_norm)))                      [l, V_d]
//
// the same kernels in the same order as those torch calls, so the same bits. weights:
// head_layer's 15 (q4q8), then final_norm and the LM head's 3 tensors, then (optionally)
// fc's 3. rows as head_layer's (ids, positions and hidden hold only those rows); logit_rows
// (int64, indices into the rows; None: every row) the rows the LM head reads, and then the
// only rows whose outputs are computed (head_layer_rows' out_rows; with rows, those rows'
// outputs gathered): out is [l, hidden]. Returns {out, logits}.
std::vector<at::Tensor> head_forward(const at::Tensor& ids, const at::Tensor& positions,
                                     const at::Tensor& hidden_in, const at::Tensor& embed,
                                     const at::Tensor& cos_table, const at::Tensor& sin_table,
                                     at::TensorList weights, const at::Tensor& kv_cache,
                                     at::TensorList meta, int64_t heads, int64_t kv_heads,
                                     double eps, double scale,
                                     const std::optional<at::Tensor>& rows_opt,
                                     const std::optional<at::Tensor>& logit_rows_opt) {
    check(weights.size() == 19 || weights.size() == 22,
          "expected the head layer's 15 weights, the final norm and the LM head's 3, "
          "and optionally fc's 3");
    check(ids.sizes() == positions.sizes(), "ids and positions differ in length");
    check_activations(hidden_in, "hidden");
    if (logit_rows_opt.has_value()) {  // checked before anything is written
        const at::Tensor& picked = *logit_rows_opt;
        check(picked.dim() == 1 && picked.is_contiguous() && picked.scalar_type() == at::kLong,
              "logit_rows must be a contiguous int64 vector");
        const int64_t* ix = picked.data_ptr<int64_t>();
        for (int64_t i = 0; i < picked.numel(); ++i)
            check(ix[i] >= 0 && ix[i] < ids.size(0), "logit_rows out of range");
    }
    const int threads = at::get_num_threads();
    const int64_t h = embed.size(1);
    at::Tensor hidden = hidden_in;
    if (hidden_in.size(1) != h) {  // the target's features: fuse them first
        check(weights.size() == 22, "features given without fc's weights");
        hidden = mm(hidden_in, Matrix{{&weights[19], &weights[20], &weights[21]}, true},
                    threads);
    }
    const at::Tensor emb = gather_rows(embed, ids);
    const at::Tensor cos = gather_rows(cos_table, positions);
    const at::Tensor sin = gather_rows(sin_table, positions);
    const bool out_rows = logit_rows_opt.has_value() && !rows_opt.has_value();
    at::Tensor picked = head_layer_rows(emb, hidden, weights.slice(0, 15), cos, sin, kv_cache,
                                        meta, heads, kv_heads, eps, scale, rows_opt,
                                        out_rows ? logit_rows_opt : std::nullopt);
    if (logit_rows_opt.has_value() && !out_rows) picked = gather_rows(picked, *logit_rows_opt);
    const int64_t rows = picked.size(0);
    const at::Tensor none;
    auto [normed, normed_unused] = add_rms_norm(picked, none, weights[15], eps,
                                                rows > par_rows ? threads : 1);
    const at::Tensor logits16 = mm(normed, Matrix{{&weights[16], &weights[17], &weights[18]},
                                                  true}, threads);  // [l, V_d] bf16
    at::Tensor logits = at::empty({rows, logits16.size(1)},
                                  at::TensorOptions().dtype(at::kFloat));
    const uint16_t* src = ptr<const uint16_t>(logits16);
    float* dst = logits.data_ptr<float>();
    for (int64_t i = 0; i < logits16.numel(); ++i) dst[i] = bf16_to_f32(src[i]);
    return {picked, logits};
}
