// One decoder layer of the CPU bf16 int4 fast path in one native call.
//
// The same kernels, in the same order and on the same buffers, as the Python layer
// (engine/models/llama.py DecoderLayer.forward with FUSED_CPU_OPS and int4 weights), so the
// result is bit-identical; only the ~30 Python-level calls a layer are gone:
//
//   h, r   = add_rms_norm(x, residual, ln1)          (rms_norm(x), x on the first layer)
//   qkv    = int4_mm(h, qkv_w) (+ qkv_bias)           [T, (H + 2 KVH) * D]
//   rope in place on the q and k columns of qkv
//   out    = write_kv_and_attend(qkv, kv_cache, metadata)   [T, H * D]
//   h2     = int4_mm(out, o_w)
//   h3, r  = add_rms_norm(h2, r, ln2)
//   y      = int4_mm(silu_mul(int4_mm(h3, gate_up_w)), down_w)
//   return (y, r)
//
// The C kernels (cpu_fused.c, cpu_attention.c) are built and loaded by their Python modules;
// their addresses are handed over once with set_cpu_kernels. The int4 matmul is ATen's CPU
// kernel, called directly (at::cpu::, no dispatcher).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace {

using RmsFn = int (*)(const void*, const void*, const void*, void*, void*, int, int, float, int);
using RopeFn = int (*)(void*, const void*, const void*, int, int, int, long long, long long, int);
using SiluFn = int (*)(const void*, void*, int, int, int, int);
using AttendFn = int (*)(const void*, int, const int32_t*, void*, const int32_t*,
                         const int32_t*, const int32_t*, const int64_t*, void*, int, int, int,
                         int, int, int, int, int, float, int);

RmsFn rms_fn = nullptr;
RopeFn rope_fn = nullptr;
SiluFn silu_fn = nullptr;
AttendFn attend_fn = nullptr;
int64_t silu_vec_block = 0;
int64_t par_rows = 1;  // the small ops use threads above this many rows (as cpu_fused.py)

constexpr int64_t kGroup = 32;

void check(bool ok, const char* what) {
    if (!ok) throw std::invalid_argument(std::string("quickdraft::decoder_layer: ") + what);
}

void set_cpu_kernels(int64_t rms, int64_t rope, int64_t silu, int64_t attend,
                     int64_t vec_block, int64_t parallel_rows) {
    rms_fn = reinterpret_cast<RmsFn>(rms);
    rope_fn = reinterpret_cast<RopeFn>(rope);
    silu_fn = reinterpret_cast<SiluFn>(silu);
    attend_fn = reinterpret_cast<AttendFn>(attend);
    silu_vec_block = vec_block;
    par_rows = parallel_rows;
}

at::Tensor bf16_empty(int64_t rows, int64_t cols) {
    return at::empty({rows, cols}, at::TensorOptions().dtype(at::kBFloat16));
}

// y = norm(x (+ residual)); r = x + residual. residual undefined: r = x.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& w, double eps, int threads) {
    const int64_t rows = x.size(0), n = x.size(1);
    at::Tensor y = bf16_empty(rows, n);
    at::Tensor r = residual.defined() ? bf16_empty(rows, n) : x;
    int rc = rms_fn(x.data_ptr(), residual.defined() ? residual.data_ptr() : nullptr,
                    w.data_ptr(), y.data_ptr(), residual.defined() ? r.data_ptr() : nullptr,
                    static_cast<int>(rows), static_cast<int>(n), static_cast<float>(eps),
                    threads);
    check(rc == 0, "rms_norm kernel failed");
    return {y, r};
}

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz) {
    return at::cpu::_weight_int4pack_mm_for_cpu(x, packed, kGroup, sz);
}

// weights: ln1, qkv_packed, qkv_sz, o_packed, o_sz, ln2, gate_up_packed, gate_up_sz,
//          down_packed, down_sz[, qkv_bias]
// meta: slot_mapping, block_tables, seq_lens, query_start_loc (int32, the step's metadata)
//       [, tree_mask (int64 [T], the rows' ancestor bits; empty: every row causal)]
std::tuple<at::Tensor, at::Tensor> decoder_layer(
        const at::Tensor& x, const std::optional<at::Tensor>& residual_opt,
        at::TensorList weights, const at::Tensor& cos, const at::Tensor& sin,
        const at::Tensor& kv_cache, at::TensorList meta, int64_t heads, int64_t kv_heads,
        double eps, double scale) {
    check(rms_fn && rope_fn && silu_fn && attend_fn, "set_cpu_kernels was not called");
    check(weights.size() == 10 || weights.size() == 11, "expected 10 or 11 weights");
    check(meta.size() == 4 || meta.size() == 5, "expected 4 or 5 metadata tensors");
    check(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
          "x must be a contiguous bf16 [rows, hidden] matrix");
    const at::Tensor residual = residual_opt.has_value() ? *residual_opt : at::Tensor();
    const int64_t rows = x.size(0);
    const int threads = at::get_num_threads();
    const int small_threads = rows > par_rows ? threads : 1;

    auto [h, r] = add_rms_norm(x, residual, weights[0], eps, small_threads);
    at::Tensor qkv = int4_mm(h, weights[1], weights[2]);  // [T, (H + 2 KVH) * D]
    if (weights.size() == 11) qkv.add_(weights[10]);
    const int64_t width = qkv.size(1), d = width / (heads + 2 * kv_heads);
    check(d * (heads + 2 * kv_heads) == width && cos.numel() == rows * d
              && sin.numel() == rows * d && cos.is_contiguous() && sin.is_contiguous()
              && cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
          "qkv width or rope tables do not fit the heads");
    check(kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kBFloat16
              && kv_cache.dim() == 5 && kv_cache.size(3) == kv_heads && kv_cache.size(4) == d,
          "kv_cache must be a contiguous bf16 [2, blocks, block_size, kv_heads, head_dim]");
    int rc = rope_fn(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), static_cast<int>(rows),
                     static_cast<int>(heads + kv_heads), static_cast<int>(d), width, d,
                     small_threads);
    check(rc == 0, "rope kernel failed");

    const at::Tensor& slots = meta[0];
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
    at::Tensor attn = bf16_empty(rows, heads * d);
    rc = attend_fn(qkv.data_ptr(), static_cast<int>(width), slots.data_ptr<int32_t>(),
                   kv_cache.data_ptr(), tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                   qsl.data_ptr<int32_t>(), tree_mask, attn.data_ptr(),
                   static_cast<int>(lens.size(0)), static_cast<int>(rows),
                   static_cast<int>(heads), static_cast<int>(kv_heads),
                   static_cast<int>(d), static_cast<int>(kv_cache.size(2)),
                   static_cast<int>(kv_cache.size(1)), static_cast<int>(tables.size(1)),
                   static_cast<float>(scale), rows * kv_heads >= 4 ? threads : 1);
    check(rc == 0, "attention kernel rejected the step (bad slot, block id, layout or mask)");

    at::Tensor o = int4_mm(attn, weights[3], weights[4]);
    auto [h2, r2] = add_rms_norm(o, r, weights[5], eps, small_threads);
    at::Tensor gate_up = int4_mm(h2, weights[6], weights[7]);  // [T, 2 * inter]
    const int64_t inter = gate_up.size(1) / 2;
    at::Tensor act = bf16_empty(rows, inter);
    rc = silu_fn(gate_up.data_ptr(), act.data_ptr(), static_cast<int>(rows),
                 static_cast<int>(inter), static_cast<int>(silu_vec_block), small_threads);
    check(rc == 0, "silu_mul kernel failed");
    return {int4_mm(act, weights[8], weights[9]), r2};
}

}  // namespace

TORCH_LIBRARY(quickdraft_cpu, m) {
    m.def("set_cpu_kernels(int rms, int rope, int silu, int attend, int vec_block, "
          "int parallel_rows) -> ()");
    m.def("decoder_layer(Tensor x, Tensor? residual, Tensor[] weights, Tensor cos, "
          "Tensor sin, Tensor(a!) kv_cache, Tensor[] meta, int heads, int kv_heads, "
          "float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(quickdraft_cpu, CompositeExplicitAutograd, m) {
    m.impl("decoder_layer", &decoder_layer);
}

TORCH_LIBRARY_IMPL(quickdraft_cpu, CatchAll, m) {
    m.impl("set_cpu_kernels", &set_cpu_kernels);
}
