// One decoder layer of the CPU bf16 int4 fast path in one native call (and the draft head's
// layer, head_layer, below).
//
// The same kernels, in the same order and on the same buffers, as the Python layer
// (engine/models/llama.py DecoderLayer.forward with FUSED_CPU_OPS and int4 weights), so the
// result is bit-identical; only the ~30 Python-level calls a layer are gone:
//
//   h, r   = add_rms_norm(x, residual, ln1)          (rms_norm(x), x on the first layer)
//   qkv    = mm(h, qkv_w) (+ qkv_bias)                [T, (H + 2 KVH) * D]
//   rope in place on the q and k columns of qkv
//   out    = write_kv_and_attend(qkv, kv_cache, metadata)   [T, H * D]
//   h2     = mm(out, o_w)
//   h3, r  = add_rms_norm(h2, r, ln2)
//   y      = mm(silu_mul(mm(h3, gate_up_w)), down_w)
//   return (y, r)
//
// mm is one of two 4-bit matmuls, told apart by the weight list: ATen's CPU int4 kernel
// (each matrix as packed + scales_and_zeros; called directly, at::cpu::, no dispatcher) or
// the 4-bit x 8-bit kernel of cpu_q4q8.c (each matrix as codes + d + m; as codes + sc + d
// on its 6-bit loop for a GGUF's Q6_K matrices, sc int8; as codes + sm + dd on its Q4_K
// loop, sm uint8; qkv may be two such matrices, outputs side by side, as Qwen2.5's q, k in
// 4 bits and v in 6). The C kernels
// (cpu_fused.c, cpu_attention.c, cpu_q4q8.c) are built and loaded by their Python modules;
// their addresses are handed over once with set_cpu_kernels.

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu_cpu_dispatch.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_layer_arena.h"

namespace {

using RmsFn = int (*)(const void*, const void*, const void*, void*, void*, int, int, float, int);
using RopeFn = int (*)(void*, const void*, const void*, int, int, int, long long, long long, int);
using SiluFn = int (*)(const void*, void*, int, int, int, int);
using AttendFn = int (*)(const void*, int, const int32_t*, void*, const int32_t*,
                         const int32_t*, const int32_t*, const int64_t*, void*, int, int, int,
                         int, int, int, int, int, float, int);
using Q4Q8Fn = int (*)(const void*, const void*, const void*, const void*, void*, int, int, int,
                       int, int, void*);

RmsFn rms_fn = nullptr;
RopeFn rope_fn = nullptr;
SiluFn silu_fn = nullptr;
AttendFn attend_fn = nullptr;
Q4Q8Fn q4q8_fn = nullptr;  // null: the q4q8 kernel is not available
Q4Q8Fn q6q8_fn = nullptr;  // its 6-bit entry point (the same arguments: codes, sc, d)
Q4Q8Fn q4kq8_fn = nullptr;  // its Q4_K entry point (codes, sm, dd)
int64_t q4q8_flags = 0;  // its loop and the weights' layout (cpu_q4q8.c's flags)
int64_t silu_vec_block = 0;
int64_t par_rows = 1;  // the small ops use threads above this many rows (as cpu_fused.py)

constexpr int64_t kGroup = 32;
// Most bytes an arena keeps between steps: SmolLM2's and Qwen2.5-1.5B's 64-row steps fit
// (~1.5 and ~6 MB a layer), a 2,048-token prefill chunk's (~47 and ~200 MB) is given back.
constexpr size_t kArenaKeepBytes = 32 << 20;

void check(bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("quickdraft::decoder_layer: ") + what);
}

void set_cpu_kernels(int64_t rms, int64_t rope, int64_t silu, int64_t attend,
                     int64_t vec_block, int64_t parallel_rows, int64_t q4q8, int64_t q6q8,
                     int64_t q4kq8, int64_t q4q8_loop) {
    q4q8_fn = reinterpret_cast<Q4Q8Fn>(q4q8);
    q6q8_fn = reinterpret_cast<Q4Q8Fn>(q6q8);
    q4kq8_fn = reinterpret_cast<Q4Q8Fn>(q4kq8);
    q4q8_flags = q4q8_loop;
    rms_fn = reinterpret_cast<RmsFn>(rms);
    rope_fn = reinterpret_cast<RopeFn>(rope);
    silu_fn = reinterpret_cast<SiluFn>(silu);
    attend_fn = reinterpret_cast<AttendFn>(attend);
    silu_vec_block = vec_block;
    par_rows = parallel_rows;
}

// Every helper below takes its outputs from ``arena`` (cpu_layer_arena.h) when one is given,
// else allocates them.

// y = norm(x (+ residual)); r = x + residual. residual undefined: r = x.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps, int threads,
                                                Arena* arena = nullptr) {
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor y = bf16_tensor(arena, rows, n);
    at::Tensor r = residual.defined() ? bf16_tensor(arena, rows, n) : x;
    int rc = rms_fn(x.data_ptr(), residual.defined() ? residual.data_ptr() : nullptr,
                    w.data_ptr(), y.data_ptr(), residual.defined() ? r.data_ptr() : nullptr,
                    static_cast<int>(rows), static_cast<int>(n), static_cast<float>(eps),
                    threads);
    check(rc == 0, "rms_norm kernel failed");
    return {y, r};
}

// One matrix: (packed, scales_and_zeros) for ATen's kernel; (codes, d, m) for q4q8's 4-bit
// loop, (codes, sc, d) for its 6-bit one or (codes, sm, dd) for its Q4_K one, told apart by
// the second tensor's dtype (fp16, int8, uint8).
struct Matrix {
    const at::Tensor* parts[3];
    bool q4q8;
};

at::Tensor mm(const at::Tensor& x, const Matrix& w, int threads, Arena* arena = nullptr) {
    if (!w.q4q8) return at::cpu::_weight_int4pack_mm_for_cpu(x, *w.parts[0], kGroup, *w.parts[1]);
    // [n/8, k/32, 4, 8, 4] uint8 4-bit codes or [n/8, k/32, 6, 8, 4] 6-bit ones (cpu_q4q8.c)
    const at::Tensor& codes = *w.parts[0];
    const at::ScalarType second = w.parts[1]->scalar_type();
    const Q4Q8Fn fn = second == at::kChar ? q6q8_fn : second == at::kByte ? q4kq8_fn : q4q8_fn;
    check(fn != nullptr, "the q4q8 kernel's 6-bit or Q4_K entry point is not available");
    const int64_t rows = x.size(0), n = codes.size(0) * 8, k = codes.size(1) * kGroup;
    check(x.size(1) == k, "q4q8 weight does not fit the activations");
    at::Tensor y = bf16_tensor(arena, rows, n);
    at::Tensor scratch = byte_tensor(arena, rows * (k + 8 * (k / kGroup)));
    int rc = fn(x.data_ptr(), codes.data_ptr(), w.parts[1]->data_ptr(), w.parts[2]->data_ptr(),
                y.data_ptr(), static_cast<int>(rows), static_cast<int>(n), static_cast<int>(k),
                threads, static_cast<int>(q4q8_flags), scratch.data_ptr());
    check(rc == 0, "q4q8 kernel rejected the shapes");
    return y;
}

// Matrices side by side (a fused qkv whose parts the file stores in different formats):
// each part's output for the same rows, concatenated by columns as the Python layer does.
at::Tensor mm_parts(const at::Tensor& x, const std::vector<Matrix>& parts, int threads,
                    Arena* arena) {
    if (parts.size() == 1) return mm(x, parts[0], threads, arena);
    std::vector<at::Tensor> outs;
    for (const Matrix& w : parts) outs.push_back(mm(x, w, threads, arena));
    return at::cat(outs, 1);
}

// RoPE in place on the q and k columns of qkv [T, (H + 2 KVH) * D] (cos, sin: [T, D]).
void rope_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
               int64_t kv_heads, int small_threads) {
    const int64_t rows = qkv.size(0), width = qkv.size(1), d = width / (heads + 2 * kv_heads);
    check(d * (heads + 2 * kv_heads) == width && cos.numel() == rows * d
              && sin.numel() == rows * d && cos.is_contiguous() && sin.is_contiguous()
              && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
          "qkv width or rope tables do not fit the heads");
    int rc = rope_fn(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), static_cast<int>(rows),
                     static_cast<int>(heads + kv_heads), static_cast<int>(d), width, d,
                     small_threads);
    check(rc == 0, "rope kernel failed");
}

// The KV write (at ``slots``: the metadata's slot_mapping, or a copy of it) and the attention
// over the paged cache for every row of the rotated qkv [T, (H + 2 KVH) * D]: returns the
// attention output [T, H * D]. The kernel checks the whole step before writing anything.
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& slots, const at::Tensor& kv_cache,
                  at::TensorList meta, int64_t heads, int64_t kv_heads, double scale,
                  int threads, Arena* arena = nullptr) {
    const int64_t rows = qkv.size(0), width = qkv.size(1), d = width / (heads + 2 * kv_heads);
    check(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kBFloat16
              && kv_cache.dim() == 5 && kv_cache.size(3) == kv_heads && kv_cache.size(4) == d,
          "kv_cache must be a contiguous bf16 [2, blocks, block_size, kv_heads, head_dim]");
    check(slots.numel() == rows && slots.scalar_type() == at::kInt && slots.is_contiguous(),
          "slot_mapping must be an int32 [rows] vector");
    const at::Tensor& tables = meta[1];
    const at::Tensor& lens = meta[2];
    const at::Tensor& qsl = meta[3];
    const int64_t* tree_mask = nullptr;
    if (meta.size() == 5 && meta[4].numel() > 0) {
        check(meta[4].scalar_type() == at::kLong && meta[4].is_cpu()
                  && meta[4].is_contiguous() && meta[4].numel() == rows,
              "tree_mask must be a contiguous int64 [rows] vector");
        tree_mask = meta[4].data_ptr<int64_t>();
    }
    at::Tensor attn = bf16_tensor(arena, rows, heads * d);
    int rc = attend_fn(qkv.data_ptr(), static_cast<int>(width), slots.data_ptr<int32_t>(),
                       kv_cache.data_ptr(), tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                       qsl.data_ptr<int32_t>(), tree_mask, attn.data_ptr(),
                       static_cast<int>(lens.size(0)), static_cast<int>(rows),
                       static_cast<int>(heads), static_cast<int>(kv_heads),
                       static_cast<int>(d), static_cast<int>(kv_cache.size(2)),
                       static_cast<int>(kv_cache.size(1)), static_cast<int>(tables.size(1)),
                       static_cast<float>(scale),
                       rows * kv_heads >= 2 ? threads : 1);  // as cpu_attention.py
    check(rc == 0, "attention kernel rejected the step (bad slot, block id, layout or mask)");
    return attn;
}

// RoPE, then the KV write and the attention: the attention output [T, H * D].
at::Tensor rope_and_attend(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                           const at::Tensor& kv_cache, at::TensorList meta, int64_t heads,
                           int64_t kv_heads, double scale, int threads, int small_threads,
                           Arena* arena) {
    rope_rows(qkv, cos, sin, heads, kv_heads, small_threads);
    return attend(qkv, meta[0], kv_cache, meta, heads, kv_heads, scale, threads, arena);
}

// The MLP: mm(silu_mul(mm(h, gate_up_w)), down_w).
at::Tensor mlp(const at::Tensor& h, const Matrix& gate_up_w, const Matrix& down_w, int threads,
               int small_threads, Arena* arena = nullptr) {
    at::Tensor gate_up = mm(h, gate_up_w, threads, arena);  // [T, 2 * inter]
    const int64_t rows = h.size(0), inter = gate_up.size(1) / 2;
    at::Tensor act = bf16_tensor(arena, rows, inter);
    int rc = silu_fn(gate_up.data_ptr(), act.data_ptr(), static_cast<int>(rows),
                     static_cast<int>(inter), static_cast<int>(silu_vec_block), small_threads);
    check(rc == 0, "silu_mul kernel failed");
    return mm(act, down_w, threads, arena);
}

// weights: ln1, qkv_packed, qkv_sz, o_packed, o_sz, ln2, gate_up_packed, gate_up_sz,
//          down_packed, down_sz[, qkv_bias]                       (ATen int4: 10 or 11)
//      or  ln1, qkv (3 tensors, or 6: two matrices side by side), o (3), ln2, gate_up (3),
//          down (3)[, qkv_bias]                                   (q4q8: 14, 15, 17 or 18)
// meta: slot_mapping, block_tables, seq_lens, query_start_loc (int32, the step's metadata)
//       [, tree_mask (int64 [T], the rows' ancestor bits; empty: every row causal)]
// arena: where its tensors go (LayerStack's), or null: allocated (the op below); with an
// arena the two results live there too.
std::tuple<at::Tensor, at::Tensor> run_layer(
        const at::Tensor& x, const std::optional<at::Tensor>& residual_opt,
        at::TensorList weights, const at::Tensor& cos, const at::Tensor& sin,
        const at::Tensor& kv_cache, at::TensorList meta, int64_t heads, int64_t kv_heads,
        double eps, double scale, Arena* arena) {
    check(rms_fn && rope_fn && silu_fn && attend_fn, "set_cpu_kernels was not called");
    const size_t nw = weights.size();
    check(nw == 10 || nw == 11 || nw == 14 || nw == 15 || nw == 17 || nw == 18,
          "expected 10, 11, 14, 15, 17 or 18 weights");
    const bool q4q8 = nw >= 14;
    check(!q4q8 || q4q8_fn != nullptr, "the q4q8 kernel is not available");
    const size_t per = q4q8 ? 3 : 2;  // tensors per matrix
    const size_t qkv_parts = nw >= 17 ? 2 : 1;
    auto matrix = [&](size_t first) {
        return Matrix{{&weights[first], &weights[first + 1], &weights[first + per - 1]}, q4q8};
    };
    std::vector<Matrix> qkv_w;
    for (size_t p = 0; p < qkv_parts; ++p) qkv_w.push_back(matrix(1 + p * per));
    const size_t o_at = 1 + qkv_parts * per;  // then o, ln2, gate_up, down[, qkv_bias]
    const Matrix o_w = matrix(o_at), gate_up_w = matrix(o_at + per + 1),
                 down_w = matrix(o_at + 2 * per + 1);
    const at::Tensor& ln2 = weights[o_at + per];
    const bool has_bias = nw == o_at + 3 * per + 2;
    check(meta.size() == 4 || meta.size() == 5, "expected 4 or 5 metadata tensors");
    check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
          "x must be a contiguous bf16 [rows, hidden] matrix");
    const at::Tensor residual = residual_opt.has_value() ? *residual_opt : at::Tensor();
    const int64_t rows = x.size(0);
    const int threads = at::get_num_threads();
    const int small_threads = rows > par_rows ? threads : 1;

    auto [h, r] = add_rms_norm(x, residual, weights[0], eps, small_threads, arena);
    at::Tensor qkv = mm_parts(h, qkv_w, threads, arena);  // [T, (H + 2 KVH) * D]
    if (has_bias) qkv.add_(weights[nw - 1]);
    at::Tensor attn = rope_and_attend(qkv, cos, sin, kv_cache, meta, heads, kv_heads, scale,
                                      threads, small_threads, arena);
    at::Tensor o = mm(attn, o_w, threads, arena);
    auto [h2, r2] = add_rms_norm(o, r, ln2, eps, small_threads, arena);
    return {mlp(h2, gate_up_w, down_w, threads, small_threads, arena), r2};
}

// The op: one layer, its tensors allocated.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
        const at::Tensor& x, const std::optional<at::Tensor>& residual_opt,
        at::TensorList weights, const at::Tensor& cos, const at::Tensor& sin,
        const at::Tensor& kv_cache, at::TensorList meta, int64_t heads, int64_t kv_heads,
        double eps, double scale) {
    return run_layer(x, residual_opt, weights, cos, sin, kv_cache, meta, heads, kv_heads, eps,
                     scale, nullptr);
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
at::Tensor head_layer(const at::Tensor& emb, const at::Tensor& hidden, at::TensorList weights,
                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
                      at::TensorList meta, int64_t heads, int64_t kv_heads, double eps,
                      double scale, const std::optional<at::Tensor>& rows_opt) {
    check(rms_fn && rope_fn && silu_fn && attend_fn, "set_cpu_kernels was not called");
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
    rope_rows(qkv, cos, sin, heads, kv_heads, small_threads);
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
        at::Tensor full = bf16_tensor(nullptr, total, width);
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
        attn = bf16_tensor(nullptr, rows, hd);  // [r, H * D]
        const auto* a_src = static_cast<const uint16_t*>(all.data_ptr());
        auto* a_dst = static_cast<uint16_t*>(attn.data_ptr());
        for (int64_t i = 0; i < rows; i++)
            std::memcpy(a_dst + i * hd, a_src + ix[i] * hd, static_cast<size_t>(hd) * 2);
    }
    at::Tensor a = at::add(hidden, mm(attn, o_w, threads));
    auto [h2, h2_unused] = add_rms_norm(a, none, post_norm, eps, small_threads);
    return at::add(a, mlp(h2, gate_up_w, down_w, threads, small_threads));
}

// A model's decoder layers bound once (each layer's decoder_layer weights, and its KV cache),
// so that a step runs them all in one call: called layer by layer from Python, each call
// converts its ~25 arguments (the weight list above all) for the dispatcher, ~17 us a layer
// on the 2-core AVX2-only EPYC, ~9 % of a SmolLM2 decode step there. The layers run exactly
// as 30 decoder_layer calls would (the same function and kernels, in order), so the bits are
// the same; their tensors come from two arenas kept from step to step (cpu_layer_arena.h).
struct LayerStack : torch::CustomClassHolder {
    std::vector<std::vector<at::Tensor>> weights;  // per layer, as decoder_layer takes them
    std::vector<at::Tensor> kv_caches;             // per layer
    int64_t heads, kv_heads;
    double eps, scale;
    Arena arenas[2];  // layer l's tensors in arenas[l % 2]; one step at a time (step_lock)
    std::mutex step_lock;

    // flat: every layer's weight list in turn, lengths[l] tensors for layer l
    LayerStack(std::vector<at::Tensor> flat, std::vector<int64_t> lengths,
               std::vector<at::Tensor> kv, int64_t heads_, int64_t kv_heads_, double eps_,
               double scale_)
        : kv_caches(std::move(kv)), heads(heads_), kv_heads(kv_heads_), eps(eps_),
          scale(scale_) {
        check(lengths.size() == kv_caches.size(), "LayerStack: one length per KV cache");
        size_t at = 0;
        for (int64_t n : lengths) {
            check(n > 0 && at + static_cast<size_t>(n) <= flat.size(),
                  "LayerStack: the lengths do not fit the weights");
            weights.emplace_back(flat.begin() + at, flat.begin() + at + n);
            at += static_cast<size_t>(n);
        }
        check(at == flat.size(), "LayerStack: the lengths do not fit the weights");
    }

    // [x, residual, then x + residual after each layer count in aux_after (ascending, 1..L)]:
    // what the Python loop over decoder_layer returns. The attention kernel checks the step
    // before it writes anything, and every layer sees the same metadata, so a rejected step
    // throws from the first layer with nothing written.
    std::vector<at::Tensor> forward(const at::Tensor& x0, const at::Tensor& cos,
                                    const at::Tensor& sin, std::vector<at::Tensor> meta,
                                    std::vector<int64_t> aux_after) {
        const std::lock_guard<std::mutex> hold(step_lock);
        auto [x, residual, aux] = run_layers(x0, cos, sin, meta, aux_after);
        // the arenas' memory is reused by the next step: the results leave as copies
        std::vector<at::Tensor> out{x.clone(), residual.defined() ? residual.clone() : x};
        for (Arena& arena : arenas) arena.release_above(kArenaKeepBytes);
        out.insert(out.end(), aux.begin(), aux.end());
        return out;
    }

    // [norm(x + residual) with the model's final norm (norm_w, norm_eps), then the aux
    // streams as forward's]: the model's hidden states in the same call (the same kernel
    // as the Python norm after forward, so the same bits), without copying x and the
    // residual out first.
    std::vector<at::Tensor> forward_normed(const at::Tensor& x0, const at::Tensor& cos,
                                           const at::Tensor& sin, std::vector<at::Tensor> meta,
                                           std::vector<int64_t> aux_after,
                                           const at::Tensor& norm_w, double norm_eps) {
        check(x0.dim() == 2 && norm_w.dim() == 1 && norm_w.size(0) == x0.size(1)
                  && norm_w.is_contiguous() && norm_w.scalar_type() == at::kBFloat16,
              "the final norm's weight must be a contiguous bf16 [hidden] vector");
        const std::lock_guard<std::mutex> hold(step_lock);
        auto [x, residual, aux] = run_layers(x0, cos, sin, meta, aux_after);
        const int small_threads = x.size(0) > par_rows ? at::get_num_threads() : 1;
        std::vector<at::Tensor> out{
            std::get<0>(add_rms_norm(x, residual, norm_w, norm_eps, small_threads))};
        for (Arena& arena : arenas) arena.release_above(kArenaKeepBytes);
        out.insert(out.end(), aux.begin(), aux.end());
        return out;
    }

  private:
    // Every layer in turn: (x, residual, aux) with x and residual in the arenas (valid until
    // the next step's layers reset them). The caller holds step_lock.
    std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> run_layers(
            const at::Tensor& x0, const at::Tensor& cos, const at::Tensor& sin,
            const std::vector<at::Tensor>& meta, const std::vector<int64_t>& aux_after) {
        for (size_t i = 0; i < aux_after.size(); ++i)
            check(aux_after[i] >= 1 && aux_after[i] <= static_cast<int64_t>(weights.size())
                      && (i == 0 || aux_after[i] > aux_after[i - 1]),
                  "aux_after must be ascending layer counts in 1..L");
        at::Tensor x = x0;
        std::optional<at::Tensor> residual;
        std::vector<at::Tensor> aux;
        size_t next = 0;
        for (size_t l = 0; l < weights.size(); ++l) {
            // layer l - 2's tensors, the last in this arena, are dead: l - 1 read them
            Arena& arena = arenas[l % 2];
            arena.reset();
            auto [y, r] = run_layer(x, residual, weights[l], cos, sin, kv_caches[l], meta,
                                    heads, kv_heads, eps, scale, &arena);
            x = y;
            residual = r;
            while (next < aux_after.size() && aux_after[next] == static_cast<int64_t>(l + 1)) {
                aux.push_back(at::add(x, r));  // allocated: it outlives the step
                ++next;
            }
        }
        return {x, residual.has_value() ? *residual : at::Tensor(), aux};
    }
};

}  // namespace

TORCH_LIBRARY(quickdraft_cpu, m) {
    m.class_<LayerStack>("LayerStack")
        .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>,
                         std::vector<at::Tensor>, int64_t, int64_t, double, double>())
        .def("forward", &LayerStack::forward)
        .def("forward_normed", &LayerStack::forward_normed);
    m.def("set_cpu_kernels(int rms, int rope, int silu, int attend, int vec_block, "
          "int parallel_rows, int q4q8, int q6q8, int q4kq8, int q4q8_flags) -> ()");
    m.def("decoder_layer(Tensor x, Tensor? residual, Tensor[] weights, Tensor cos, "
          "Tensor sin, Tensor(a!) kv_cache, Tensor[] meta, int heads, int kv_heads, "
          "float eps, float scale) -> (Tensor, Tensor)");
    m.def("head_layer(Tensor emb, Tensor hidden, Tensor[] weights, Tensor cos, Tensor sin, "
          "Tensor(a!) kv_cache, Tensor[] meta, int heads, int kv_heads, float eps, "
          "float scale, Tensor? rows=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(quickdraft_cpu, CompositeExplicitAutograd, m) {
    m.impl("decoder_layer", &decoder_layer);
    m.impl("head_layer", &head_layer);
}

TORCH_LIBRARY_IMPL(quickdraft_cpu, CatchAll, m) {
    m.impl("set_cpu_kernels", &set_cpu_kernels);
}
