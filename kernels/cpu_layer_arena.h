// Memory for a LayerStack step's intermediate buffers, kept from step to step.
//
// A decoder layer makes ~14 buffers (norm outputs, each matmul's output and its int8
// scratch, the attention output, SiLU·up): 420 a SmolLM2 step. Allocated as tensors, each
// went through posix_memalign (glibc's slow path) and a TensorImpl: on the 2-core AVX2-only
// EPYC ~0.2 ms of a ~5 ms 1-row decode step on the calling thread, while the other thread
// waits at the next barrier; prefill chunks' larger buffers also went to mmap and came back
// as zeroed pages each step. LayerStack instead carves them out of two arenas as raw memory
// (no tensor headers either), one for even layers and one for odd (a layer reads the
// previous layer's outputs, so those must live until it is done), and copies only its
// results out.
//
// Included once, by cpu_layer.cpp (kernels/cbuild.py expands it into the one source it
// builds).
#ifndef QD_CPU_LAYER_ARENA_H
#define QD_CPU_LAYER_ARENA_H

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

class Arena {
  public:
    // ``bytes`` of the arena's memory, 64-byte aligned. Valid until the next reset(); nothing
    // taken here may be returned to the caller of the step.
    void* raw(size_t bytes) { return take(bytes); }

    // Everything taken so far may be overwritten. If the last round needed more than one
    // chunk, they become one chunk as large as all of them (no tensor may still point
    // into them: the caller's contract), so the steady state takes from a single chunk.
    void reset() {
        if (chunks_.size() > 1) {
            const size_t total = capacity();
            chunks_.clear();
            chunks_.push_back(new_chunk(total));
        }
        off_ = 0;
    }

    // Gives the memory back if it holds more than ``keep`` bytes (a long prefill chunk's),
    // so that one large step does not pin its buffers for the process's life; the same
    // contract as reset().
    void release_above(size_t keep) {
        if (capacity() > keep) chunks_.clear();
        off_ = 0;
    }

  private:
    size_t capacity() const {  // bytes in all chunks
        size_t total = 0;
        for (const at::Tensor& c : chunks_) total += static_cast<size_t>(c.numel());
        return total;
    }

    static constexpr size_t kAlign = 64;     // as c10's CPU allocator
    static constexpr size_t kMinChunk = 64 << 10;

    static at::Tensor new_chunk(size_t bytes) {
        return at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte));
    }

    void* take(size_t bytes) {
        bytes = (bytes + kAlign - 1) / kAlign * kAlign;
        if (chunks_.empty() || off_ + bytes > static_cast<size_t>(chunks_.back().numel())) {
            const size_t last = chunks_.empty() ? 0 : static_cast<size_t>(chunks_.back().numel());
            chunks_.push_back(new_chunk(std::max({bytes, 2 * last, kMinChunk})));
            off_ = 0;
        }
        // invariant: a chunk's memory is 64-byte aligned (c10's allocator) and so is off_
        uint8_t* base = static_cast<uint8_t*>(chunks_.back().data_ptr());
        void* p = base + off_;
        off_ += bytes;
        return p;
    }

    std::vector<at::Tensor> chunks_;  // uint8; only the last one has room left
    size_t off_ = 0;                  // bytes taken from the last chunk
};

}  // namespace

#endif
