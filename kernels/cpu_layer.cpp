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
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_bf16.h"
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

// ---- The layer's steps -----------------------------------------------------------------
// Each kernel call is written once, on raw buffers (what LayerStack and the decoder_layer
// op run: a SmolLM2 step used to make ~420 tensor headers for its intermediates, the
// stack's own ~0.17 ms a step on the AVX2-only Zen 4); the draft head's layer calls the
// same functions through thin tensor wrappers.

at::Tensor empty_bf16(int64_t rows, int64_t cols) {
    return at::empty({rows, cols}, at::TensorOptions().dtype(at::kBFloat16));
}

template <typename T>
T* ptr(const at::Tensor& t) {
    return static_cast<T*>(t.data_ptr());
}

void check_activations(const at::Tensor& t, const char* name) {
    check(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kBFloat16 && t.is_cpu(),
          (std::string(name) + " must be a contiguous bf16 [rows, hidden] matrix").c_str());
}

// The step's metadata as the attention kernel reads it: pointers into meta's tensors,
// checked once a step.
struct StepMeta {
    const int32_t* slots;      // [rows]
    const int32_t* tables;     // [num_seqs, max_blocks]
    const int32_t* lens;       // [num_seqs]
    const int32_t* qsl;        // [num_seqs + 1]
    const int64_t* tree_mask;  // [rows] or null (every row causal)
    int num_seqs, max_blocks;
};

// meta: slot_mapping, block_tables, seq_lens, query_start_loc (int32, the step's metadata)
//       [, tree_mask (int64 [rows], the rows' ancestor bits; empty: every row causal)]
StepMeta step_meta(at::TensorList meta, int64_t rows) {
    check(meta.size() == 4 || meta.size() == 5, "expected 4 or 5 metadata tensors");
    for (size_t i = 0; i < 4; ++i)
        check(meta[i].scalar_type() == at::kInt && meta[i].is_contiguous() && meta[i].is_cpu(),
              "the metadata must be contiguous int32 CPU tensors");
    check(meta[0].numel() == rows, "slot_mapping must be an int32 [rows] vector");
    check(meta[1].dim() == 2 && meta[1].size(0) == meta[2].numel()
              && meta[3].numel() == meta[2].numel() + 1,
          "block_tables, seq_lens and query_start_loc do not fit one another");
    StepMeta m{ptr<const int32_t>(meta[0]), ptr<const int32_t>(meta[1]),
               ptr<const int32_t>(meta[2]), ptr<const int32_t>(meta[3]), nullptr,
               static_cast<int>(meta[2].numel()), static_cast<int>(meta[1].size(1))};
    if (meta.size() == 5 && meta[4].numel() > 0) {
        check(meta[4].scalar_type() == at::kLong && meta[4].is_cpu()
                  && meta[4].is_contiguous() && meta[4].numel() == rows,
              "tree_mask must be a contiguous int64 [rows] vector");
        m.tree_mask = ptr<const int64_t>(meta[4]);
    }
    return m;
}

uint16_t* take_bf16(Arena& arena, int64_t rows, int64_t cols) {
    return static_cast<uint16_t*>(arena.raw(static_cast<size_t>(rows * cols) * 2));
}

// y = norm(x (+ residual)) into y; with a residual, x + residual into r_out.
void rms_raw(const uint16_t* x, const uint16_t* residual, const at::Tensor& w, uint16_t* y,
             uint16_t* r_out, int64_t rows, int64_t n, double eps, int threads) {
    check(rms_fn(x, residual, w.data_ptr(), y, residual ? r_out : nullptr,
                 static_cast<int>(rows), static_cast<int>(n), static_cast<float>(eps),
                 threads) == 0,
          "rms_norm kernel failed");
}

// One matrix: (packed, scales_and_zeros) for ATen's kernel; (codes, d, m) for q4q8's 4-bit
// loop, (codes, sc, d) for its 6-bit one or (codes, sm, dd) for its Q4_K one, told apart by
// the second tensor's dtype (fp16, int8, uint8).
struct Matrix {
    const at::Tensor* parts[3];
    bool q4q8;
};

int64_t out_features(const Matrix& w) {  // n of a matrix's [n, k]
    return w.q4q8 ? w.parts[0]->size(0) * 8 : w.parts[0]->size(0);
}

size_t q4q8_scratch_bytes(int64_t rows, int64_t k) {  // the int8 rows, their scales and sums
    return static_cast<size_t>(rows * (k + 8 * (k / kGroup)));
}

// y [rows, n] = x [rows, k] @ w^T on q4q8's loop for the matrix's format.
void q4q8_mm(const uint16_t* x, int64_t rows, int64_t k, const Matrix& w, uint16_t* y,
             int threads, void* scratch) {
    // [n/8, k/32, 4, 8, 4] uint8 4-bit codes or [n/8, k/32, 6, 8, 4] 6-bit ones (cpu_q4q8.c)
    const at::Tensor& codes = *w.parts[0];
    const at::ScalarType second = w.parts[1]->scalar_type();
    const Q4Q8Fn fn = second == at::kChar ? q6q8_fn : second == at::kByte ? q4kq8_fn : q4q8_fn;
    check(fn != nullptr, "the q4q8 kernel's 6-bit or Q4_K entry point is not available");
    check(codes.size(1) * kGroup == k, "q4q8 weight does not fit the activations");
    check(fn(x, codes.data_ptr(), w.parts[1]->data_ptr(), w.parts[2]->data_ptr(), y,
             static_cast<int>(rows), static_cast<int>(out_features(w)), static_cast<int>(k),
             threads, static_cast<int>(q4q8_flags), scratch) == 0,
          "q4q8 kernel rejected the shapes");
}

// y [rows, n] = x [rows, k] @ w^T, the q4q8 scratch from the arena.
void mm_raw(const uint16_t* x, int64_t rows, int64_t k, const Matrix& w, uint16_t* y,
            int threads, Arena& arena) {
    if (w.q4q8) return q4q8_mm(x, rows, k, w, y, threads, arena.raw(q4q8_scratch_bytes(rows, k)));
    // ATen's int4 kernel takes and returns tensors
    at::Tensor xt = at::from_blob(const_cast<uint16_t*>(x), {rows, k},
                                  at::TensorOptions().dtype(at::kBFloat16));
    at::Tensor yt = at::cpu::_weight_int4pack_mm_for_cpu(xt, *w.parts[0], kGroup, *w.parts[1]);
    check(yt.is_contiguous() && yt.size(1) == out_features(w), "int4 matmul output shape");
    std::memcpy(y, yt.data_ptr(), static_cast<size_t>(yt.numel()) * 2);
}

// RoPE in place on the q and k columns of qkv [rows, (H + 2 KVH) * D] (cos, sin: bf16
// [rows, D], D = width / (H + 2 KVH), which the caller checked).
void rope_rows_raw(uint16_t* qkv, int64_t rows, int64_t width, const uint16_t* cos,
                   const uint16_t* sin, int64_t heads, int64_t kv_heads, int small_threads) {
    const int64_t d = width / (heads + 2 * kv_heads);
    check(rope_fn(qkv, cos, sin, static_cast<int>(rows), static_cast<int>(heads + kv_heads),
                  static_cast<int>(d), width, d, small_threads) == 0,
          "rope kernel failed");
}

// rope_rows_raw with the tables as tensors (checked to fit).
void rope_raw(uint16_t* qkv, int64_t rows, int64_t width, const at::Tensor& cos,
              const at::Tensor& sin, int64_t heads, int64_t kv_heads, int small_threads) {
    const int64_t d = width / (heads + 2 * kv_heads);
    check(d * (heads + 2 * kv_heads) == width && cos.numel() == rows * d
              && sin.numel() == rows * d && cos.is_contiguous() && sin.is_contiguous()
              && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
          "qkv width or rope tables do not fit the heads");
    rope_rows_raw(qkv, rows, width, ptr<const uint16_t>(cos), ptr<const uint16_t>(sin), heads,
                  kv_heads, small_threads);
}

// The KV write (at meta.slots) and the attention over the paged cache for every row of the
// rotated qkv [rows, (H + 2 KVH) * D] into out [rows, H * D]. The kernel checks the whole
// step before writing anything.
void attend_raw(const uint16_t* qkv, int64_t rows, int64_t width, const StepMeta& meta,
                const at::Tensor& kv_cache, int64_t heads, int64_t kv_heads, double scale,
                int threads, uint16_t* out) {
    const int64_t d = width / (heads + 2 * kv_heads);
    check(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kBFloat16
              && kv_cache.dim() == 5 && kv_cache.size(3) == kv_heads && kv_cache.size(4) == d,
          "kv_cache must be a contiguous bf16 [2, blocks, block_size, kv_heads, head_dim]");
    check(attend_fn(qkv, static_cast<int>(width), meta.slots, kv_cache.data_ptr(), meta.tables,
                    meta.lens, meta.qsl, meta.tree_mask, out, meta.num_seqs,
                    static_cast<int>(rows), static_cast<int>(heads), static_cast<int>(kv_heads),
                    static_cast<int>(d), static_cast<int>(kv_cache.size(2)),
                    static_cast<int>(kv_cache.size(1)), meta.max_blocks,
                    static_cast<float>(scale),
                    rows * kv_heads >= 2 ? threads : 1) == 0,  // as cpu_attention.py
          "attention kernel rejected the step (bad slot, block id, layout or mask)");
}

// act [rows, inter] = silu(gate) * up of gate_up [rows, 2 * inter].
void silu_raw(const uint16_t* gate_up, uint16_t* act, int64_t rows, int64_t inter,
              int small_threads) {
    check(silu_fn(gate_up, act, static_cast<int>(rows), static_cast<int>(inter),
                  static_cast<int>(silu_vec_block), small_threads) == 0,
          "silu_mul kernel failed");
}

// out[i] = a[i] + b[i] for n bf16 values: the sum in fp32 rounded to nearest even, the bits of
// torch's bf16 add. (The stack's aux streams: at::add there cost ~24 us a stream on the
// 2-core AVX2-only Zen 4, 2 % of a 1-row SmolLM2 step for a draft head's three, against
// ~2 us from Python: between layers that have streamed their weights through the caches
// the dispatcher's code and data are cold, as for the F.embedding calls forward_normed_ids
// replaced. This loop: ~1 us.)
void add_raw(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t n) {
    for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
}

// y [rows, hidden] = mm(silu_mul(mm(h, gate_up)), down), its intermediates from ``arena``.
void mlp_raw(const uint16_t* h, int64_t rows, int64_t hidden, const Matrix& gate_up,
             const Matrix& down, uint16_t* y, int threads, int small_threads, Arena& arena) {
    const int64_t gu = out_features(gate_up), inter = gu / 2;
    uint16_t* gate_up_out = take_bf16(arena, rows, gu);
    mm_raw(h, rows, hidden, gate_up, gate_up_out, threads, arena);
    uint16_t* act = take_bf16(arena, rows, inter);
    silu_raw(gate_up_out, act, rows, inter, small_threads);
    mm_raw(act, rows, inter, down, y, threads, arena);
}

// ---- A decoder layer on raw buffers ------------------------------------------------------

// A layer's matrices and vectors, read from its weight list (once, for LayerStack):
// weights: ln1, qkv_packed, qkv_sz, o_packed, o_sz, ln2, gate_up_packed, gate_up_sz,
//          down_packed, down_sz[, qkv_bias]                       (ATen int4: 10 or 11)
//      or  ln1, qkv (3 tensors, or 6: two matrices side by side), o (3), ln2, gate_up (3),
//          down (3)[, qkv_bias]                                   (q4q8: 14, 15, 17 or 18)
// The pointers are into ``weights``, which must outlive it.
struct LayerWeights {
    std::vector<Matrix> qkv;  // one matrix, or parts side by side
    Matrix o, gate_up, down;
    const at::Tensor *ln1, *ln2, *qkv_bias;  // qkv_bias null without one
};

LayerWeights layer_weights(at::TensorList weights) {
    const size_t nw = weights.size();
    check(nw == 10 || nw == 11 || nw == 14 || nw == 15 || nw == 17 || nw == 18,
          "expected 10, 11, 14, 15, 17 or 18 weights");
    const bool q4q8 = nw >= 14;
    const size_t per = q4q8 ? 3 : 2;  // tensors per matrix
    const size_t qkv_parts = nw >= 17 ? 2 : 1;
    auto matrix = [&](size_t first) {
        return Matrix{{&weights[first], &weights[first + 1], &weights[first + per - 1]}, q4q8};
    };
    LayerWeights lw;
    for (size_t p = 0; p < qkv_parts; ++p) lw.qkv.push_back(matrix(1 + p * per));
    const size_t o_at = 1 + qkv_parts * per;  // then o, ln2, gate_up, down[, qkv_bias]
    lw.o = matrix(o_at);
    lw.gate_up = matrix(o_at + per + 1);
    lw.down = matrix(o_at + 2 * per + 1);
    lw.ln1 = &weights[0];
    lw.ln2 = &weights[o_at + per];
    lw.qkv_bias = nw == o_at + 3 * per + 2 ? &weights[nw - 1] : nullptr;
    if (lw.qkv_bias) {
        int64_t width = 0;
        for (const Matrix& w : lw.qkv) width += out_features(w);
        check(lw.qkv_bias->numel() == width && lw.qkv_bias->scalar_type() == at::kBFloat16
                  && lw.qkv_bias->is_contiguous(),
              "qkv bias must be a contiguous bf16 [width] vector");
    }
    return lw;
}

// One decoder layer on buffers: y, r_out [rows, hidden] (r_out = x + residual; x itself
// when residual is null) from x [rows, hidden]; its intermediates from ``arena``.
// cos, sin: [rows, head_dim] bf16 (contiguous). The steps in the file's header comment.
void run_layer_raw(const uint16_t* x, const uint16_t* residual, int64_t rows, int64_t hidden,
                   uint16_t* y, uint16_t* r_out, const LayerWeights& lw, const at::Tensor& cos,
                   const at::Tensor& sin, const at::Tensor& kv_cache, const StepMeta& meta,
                   int64_t heads, int64_t kv_heads, double eps, double scale, Arena& arena) {
    check(rms_fn && rope_fn && silu_fn && attend_fn, "set_cpu_kernels was not called");
    const int threads = at::get_num_threads();
    const int small_threads = rows > par_rows ? threads : 1;

    uint16_t* h = take_bf16(arena, rows, hidden);
    rms_raw(x, residual, *lw.ln1, h, r_out, rows, hidden, eps, small_threads);
    const uint16_t* res = residual ? r_out : x;

    int64_t width = 0;  // qkv's parts side by side, as at::cat put them
    for (const Matrix& w : lw.qkv) width += out_features(w);
    uint16_t* qkv = take_bf16(arena, rows, width);
    if (lw.qkv.size() == 1) {
        mm_raw(h, rows, hidden, lw.qkv[0], qkv, threads, arena);
    } else {
        int64_t at = 0;
        for (const Matrix& w : lw.qkv) {
            const int64_t n = out_features(w);
            uint16_t* part = take_bf16(arena, rows, n);
            mm_raw(h, rows, hidden, w, part, threads, arena);
            for (int64_t i = 0; i < rows; ++i)
                std::memcpy(qkv + i * width + at, part + i * n, static_cast<size_t>(n) * 2);
            at += n;
        }
    }
    if (lw.qkv_bias) {  // as torch's bf16 add: the fp32 sum rounded to bf16
        const uint16_t* b = ptr<const uint16_t>(*lw.qkv_bias);
        for (int64_t i = 0; i < rows; ++i)
            for (int64_t j = 0; j < width; ++j)
                qkv[i * width + j] =
                    f32_to_bf16(bf16_to_f32(qkv[i * width + j]) + bf16_to_f32(b[j]));
    }
    rope_raw(qkv, rows, width, cos, sin, heads, kv_heads, small_threads);
    const int64_t attn_width = heads * (width / (heads + 2 * kv_heads));
    uint16_t* attn = take_bf16(arena, rows, attn_width);
    attend_raw(qkv, rows, width, meta, kv_cache, heads, kv_heads, scale, threads, attn);

    check(out_features(lw.o) == hidden && out_features(lw.down) == hidden,
          "o's or down's output does not fit the hidden size");
    uint16_t* o = take_bf16(arena, rows, hidden);
    mm_raw(attn, rows, attn_width, lw.o, o, threads, arena);
    uint16_t* h2 = take_bf16(arena, rows, hidden);
    rms_raw(o, res, *lw.ln2, h2, r_out, rows, hidden, eps, small_threads);

    mlp_raw(h2, rows, hidden, lw.gate_up, lw.down, y, threads, small_threads, arena);
}

// The op: one layer (weights as layer_weights reads them; meta as step_meta's), its
// results allocated, its intermediates in an arena of its own.
std::tuple<at::Tensor, at::Tensor> decoder_layer(
        const at::Tensor& x, const std::optional<at::Tensor>& residual_opt,
        at::TensorList weights, const at::Tensor& cos, const at::Tensor& sin,
        const at::Tensor& kv_cache, at::TensorList meta, int64_t heads, int64_t kv_heads,
        double eps, double scale) {
    check_activations(x, "x");
    const int64_t rows = x.size(0), hidden = x.size(1);
    const uint16_t* residual = nullptr;
    if (residual_opt.has_value()) {
        check_activations(*residual_opt, "residual");
        check(residual_opt->sizes() == x.sizes(), "residual and x differ in shape");
        residual = ptr<const uint16_t>(*residual_opt);
    }
    at::Tensor y = empty_bf16(rows, hidden), r = empty_bf16(rows, hidden);
    Arena arena;
    run_layer_raw(ptr<const uint16_t>(x), residual, rows, hidden, ptr<uint16_t>(y),
                  ptr<uint16_t>(r), layer_weights(weights), cos, sin, kv_cache,
                  step_meta(meta, rows), heads, kv_heads, eps, scale, arena);
    return {y, r};
}

#include "cpu_layer_head.h"

// A model's decoder layers bound once (each layer's decoder_layer weights, and its KV cache),
// so that a step runs them all in one call: called layer by layer from Python, each call
// converts its ~25 arguments (the weight list above all) for the dispatcher, ~17 us a layer
// on the 2-core AVX2-only EPYC, ~9 % of a SmolLM2 decode step there. The layers run exactly
// as 30 decoder_layer calls would (the same function and kernels, in order), so the bits are
// the same; their tensors come from two arenas kept from step to step (cpu_layer_arena.h).
struct LayerStack : torch::CustomClassHolder {
    std::vector<std::vector<at::Tensor>> weights;  // per layer, as decoder_layer takes them
    std::vector<LayerWeights> layers;              // per layer, read from weights once
    std::vector<at::Tensor> kv_caches;             // per layer
    int64_t heads, kv_heads;
    double eps, scale;
    Arena arenas[2];  // layer l's buffers in arenas[l % 2]; one step at a time (step_lock)
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
        for (const std::vector<at::Tensor>& w : weights) layers.push_back(layer_weights(w));
    }

    // [x, residual, then (when aux_after, ascending layer counts in 1..L, is not empty) the
    // residual streams x + residual after those layers side by side, [rows, n * hidden]]:
    // what the Python loop over decoder_layer returns (the streams torch.cat'ed). The
    // attention kernel checks the step before it writes anything, and every layer sees the
    // same metadata, so a rejected step throws from the first layer with nothing written.
    std::vector<at::Tensor> forward(const at::Tensor& x0, const at::Tensor& cos,
                                    const at::Tensor& sin, std::vector<at::Tensor> meta,
                                    std::vector<int64_t> aux_after) {
        const std::lock_guard<std::mutex> hold(step_lock);
        const Layers out = run_layers(x0, cos, sin, meta, aux_after, 0);
        // the arenas' memory is reused by the next step: the results leave as copies
        std::vector<at::Tensor> results{copy_out(out.x, x0), out.residual != nullptr
                                        ? copy_out(out.residual, x0) : x0};
        for (Arena& arena : arenas) arena.release_above(kArenaKeepBytes);
        if (out.aux.defined()) results.push_back(out.aux);
        return results;
    }

    // [norm(x + residual) with the model's final norm (norm_w, norm_eps), then the aux
    // streams as forward's]: the model's hidden states in the same call (the same kernel
    // as the Python norm after forward, so the same bits), without copying x and the
    // residual out first.
    std::vector<at::Tensor> forward_normed(const at::Tensor& x0, const at::Tensor& cos,
                                           const at::Tensor& sin, std::vector<at::Tensor> meta,
                                           std::vector<int64_t> aux_after,
                                           const at::Tensor& norm_w, double norm_eps) {
        return run_normed(x0, cos, sin, meta, aux_after, norm_w, norm_eps, 0);
    }

    // forward_normed from the step's token ids and positions (int64 [rows] each): the
    // embeddings (rows of embed [vocab, hidden]) and the RoPE rows (of cos_table,
    // sin_table [positions, head_dim]) gathered here, the rows F.embedding copies, instead of
    // by three torch calls before this one. aux_after may start with 0: the embeddings
    // themselves, first among the aux streams. Every id and position is checked first: one
    // out of range throws with nothing written (the caller's Python path then raises its
    // error).
    std::vector<at::Tensor> forward_normed_ids(const at::Tensor& ids, const at::Tensor& positions,
                                               const at::Tensor& embed,
                                               const at::Tensor& cos_table,
                                               const at::Tensor& sin_table,
                                               std::vector<at::Tensor> meta,
                                               std::vector<int64_t> aux_after,
                                               const at::Tensor& norm_w, double norm_eps) {
        check(ids.sizes() == positions.sizes(), "ids and positions differ in length");
        const at::Tensor x0 = gather_rows(embed, ids);
        const at::Tensor cos = gather_rows(cos_table, positions);
        const at::Tensor sin = gather_rows(sin_table, positions);
        const bool with_x0 = !aux_after.empty() && aux_after.front() == 0;
        if (with_x0) aux_after.erase(aux_after.begin());
        std::vector<at::Tensor> out = run_normed(x0, cos, sin, meta, aux_after, norm_w,
                                                 norm_eps, with_x0 ? 1 : 0);
        if (with_x0) {  // the embeddings, the first block of the streams (x0 is never written)
            const int64_t rows = x0.size(0), hidden = x0.size(1), width = out[1].size(1);
            const uint16_t* src = ptr<const uint16_t>(x0);
            uint16_t* dst = ptr<uint16_t>(out[1]);
            for (int64_t i = 0; i < rows; ++i)
                std::memcpy(dst + i * width, src + i * hidden, static_cast<size_t>(hidden) * 2);
        }
        return out;
    }

  private:
    // forward_normed, the aux streams' tensor with `lead` blocks of columns before them for
    // the caller to fill (forward_normed_ids: the embeddings).
    std::vector<at::Tensor> run_normed(const at::Tensor& x0, const at::Tensor& cos,
                                       const at::Tensor& sin, const std::vector<at::Tensor>& meta,
                                       const std::vector<int64_t>& aux_after,
                                       const at::Tensor& norm_w, double norm_eps, int64_t lead) {
        check_activations(x0, "x");
        check(norm_w.dim() == 1 && norm_w.size(0) == x0.size(1) && norm_w.is_contiguous()
                  && norm_w.scalar_type() == at::kBFloat16,
              "the final norm's weight must be a contiguous bf16 [hidden] vector");
        const std::lock_guard<std::mutex> hold(step_lock);
        const Layers out = run_layers(x0, cos, sin, meta, aux_after, lead);
        const int64_t rows = x0.size(0), hidden = x0.size(1);
        at::Tensor normed = empty_bf16(rows, hidden);
        // x + residual is written too (the kernel's contract), to the last layer's arena
        uint16_t* sum = out.residual != nullptr
            ? take_bf16(arenas[(weights.size() + 1) % 2], rows, hidden) : nullptr;
        check(rms_fn(out.x, out.residual, norm_w.data_ptr(), normed.data_ptr(), sum,
                     static_cast<int>(rows), static_cast<int>(hidden),
                     static_cast<float>(norm_eps),
                     rows > par_rows ? at::get_num_threads() : 1) == 0,
              "rms_norm kernel failed");
        for (Arena& arena : arenas) arena.release_above(kArenaKeepBytes);
        std::vector<at::Tensor> results{normed};
        if (out.aux.defined()) results.push_back(out.aux);
        return results;
    }

    struct Layers {
        const uint16_t* x;         // [rows, hidden], in an arena (or x0's, without layers)
        const uint16_t* residual;  // likewise, or null without layers
        at::Tensor aux;  // [rows, (lead + n) * hidden] or undefined (none asked for)
    };

    static at::Tensor copy_out(const uint16_t* p, const at::Tensor& like) {
        at::Tensor t = empty_bf16(like.size(0), like.size(1));
        std::memcpy(t.data_ptr(), p, static_cast<size_t>(like.numel()) * 2);
        return t;
    }

    // Every layer in turn; x and residual stay in the arenas (valid until the next step's
    // layers reset them); the aux streams go to one allocated tensor, the stream after
    // aux_after[j] layers in its columns [(lead + j) * hidden, +hidden) (the first lead
    // blocks left to the caller). The caller holds step_lock.
    Layers run_layers(const at::Tensor& x0, const at::Tensor& cos, const at::Tensor& sin,
                      const std::vector<at::Tensor>& meta, const std::vector<int64_t>& aux_after,
                      int64_t lead) {
        for (size_t i = 0; i < aux_after.size(); ++i)
            check(aux_after[i] >= 1 && aux_after[i] <= static_cast<int64_t>(weights.size())
                      && (i == 0 || aux_after[i] > aux_after[i - 1]),
                  "aux_after must be ascending layer counts in 1..L");
        check_activations(x0, "x");
        const int64_t rows = x0.size(0), hidden = x0.size(1);
        const StepMeta step = step_meta(meta, rows);
        Layers out{static_cast<const uint16_t*>(x0.data_ptr()), nullptr, {}};
        const int64_t blocks = lead + static_cast<int64_t>(aux_after.size());
        if (blocks > 0) out.aux = empty_bf16(rows, blocks * hidden);
        size_t next = 0;
        for (size_t l = 0; l < weights.size(); ++l) {
            // layer l - 2's buffers, the last in this arena, are dead: l - 1 read them
            Arena& arena = arenas[l % 2];
            arena.reset();
            uint16_t* y = take_bf16(arena, rows, hidden);
            uint16_t* r = take_bf16(arena, rows, hidden);
            run_layer_raw(out.x, out.residual, rows, hidden, y, r, layers[l], cos, sin,
                          kv_caches[l], step, heads, kv_heads, eps, scale, arena);
            out.x = y;
            out.residual = r;
            while (next < aux_after.size() && aux_after[next] == static_cast<int64_t>(l + 1)) {
                const int64_t column = (lead + static_cast<int64_t>(next)) * hidden;
                uint16_t* dst = ptr<uint16_t>(out.aux) + column;
                for (int64_t i = 0; i < rows; ++i)
                    add_raw(y + i * hidden, r + i * hidden, dst + i * blocks * hidden, hidden);
                ++next;
            }
        }
        return out;
    }
};

}  // namespace

TORCH_LIBRARY(quickdraft_cpu, m) {
    m.class_<LayerStack>("LayerStack")
        .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>,
                         std::vector<at::Tensor>, int64_t, int64_t, double, double>())
        .def("forward", &LayerStack::forward)
        .def("forward_normed", &LayerStack::forward_normed)
        .def("forward_normed_ids", &LayerStack::forward_normed_ids);
    m.class_<HeadStack>("HeadStack")
        .def(torch::init<std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor, int64_t,
                         int64_t, double, double>())
        .def("forward", &HeadStack::forward);
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
