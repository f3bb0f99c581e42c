// examples/decode_loop/backend_cuda.cpp: the CUDA backend (pagedkv::cuda launchers, device memory). Compiled in
// only when the build has pagedkv::cuda (PAGEDKV_WITH_CUDA); otherwise make_cuda_backend explains why not.
//
// Per step: one host -> device copy of each fixed-capacity metadata buffer. Per layer, on one stream with no host
// synchronization between them: upload q and the new K/V rows, copy_blocks -> write_kv -> attention, download o
// and lse, then one stream synchronization (the example checks every layer's output on the host).
#include <memory>
#include <string>

#include "backend.hpp"

#if defined(PAGEDKV_WITH_CUDA)

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include <pagedkv/cuda/launch.hpp>

namespace decode_loop {
namespace {

using pagedkv::Status;

/// cudaMalloc'ed bytes, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), bytes_(o.bytes_) {
    o.p_ = nullptr;
    o.bytes_ = 0;
  }
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;
  ~DeviceBuffer() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  /// Allocates max(bytes, 16) bytes; false on failure.
  bool allocate(std::size_t bytes) {
    bytes_ = bytes;
    return cudaMalloc(&p_, bytes < 16 ? 16 : bytes) == cudaSuccess;
  }
  [[nodiscard]] void* get() const noexcept { return p_; }
  template <class T>
  [[nodiscard]] T* as() const noexcept {
    return static_cast<T*>(p_);
  }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_; }

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

BackendResult fail(const std::string& op, Status s, const std::string& detail = {}) {
  return {s, op + ": " + pagedkv::to_string(s) + (detail.empty() ? "" : " (" + detail + ")")};
}

BackendResult cuda_fail(const std::string& op, cudaError_t e) {
  return fail(op, Status::kCudaError, cudaGetErrorString(e));
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(const Shape& shape, const Capacity& cap, std::int32_t sm_count)
      : shape_(shape), cap_(cap), sm_count_(sm_count) {}

  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;
  ~CudaBackend() override {
    if (stream_ != nullptr) (void)cudaStreamDestroy(stream_);
  }

  /// Allocates everything (pools poisoned with NaN); the Status text on failure.
  BackendResult init() {
    if (const cudaError_t e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); e != cudaSuccess) {
      return cuda_fail("cudaStreamCreate", e);
    }
    k_.resize(static_cast<std::size_t>(shape_.num_layers));
    v_.resize(static_cast<std::size_t>(shape_.num_layers));
    for (int l = 0; l < shape_.num_layers; ++l) {
      auto& k = k_[static_cast<std::size_t>(l)];
      auto& v = v_[static_cast<std::size_t>(l)];
      if (!k.allocate(shape_.k_buffer_bytes())) return cuda_fail("cudaMalloc(pool)", cudaGetLastError());
      if (cudaMemset(k.get(), 0xff, k.bytes()) != cudaSuccess) return cuda_fail("cudaMemset", cudaGetLastError());
      if (shape_.v_buffer_bytes() > 0) {
        if (!v.allocate(shape_.v_buffer_bytes())) return cuda_fail("cudaMalloc(pool)", cudaGetLastError());
        if (cudaMemset(v.get(), 0xff, v.bytes()) != cudaSuccess) return cuda_fail("cudaMemset", cudaGetLastError());
      }
      views_.push_back(shape_.view(k.get(), shape_.v_buffer_bytes() > 0 ? v.get() : nullptr));
    }
    const std::size_t es = shape_.elem_bytes();
    const auto i32 = sizeof(std::int32_t);
    const auto mb = static_cast<std::size_t>(cap_.max_batch);
    const bool ok =
        indptr_.allocate((mb + 1) * i32) && indices_.allocate(static_cast<std::size_t>(cap_.max_indices) * i32) &&
        last_page_len_.allocate(mb * i32) &&
        block_tables_.allocate(mb * static_cast<std::size_t>(cap_.max_blocks_per_seq) * i32) &&
        seq_lens_.allocate(mb * i32) && qo_indptr_.allocate((mb + 1) * i32) &&
        slot_mapping_.allocate(static_cast<std::size_t>(cap_.max_new_tokens) * sizeof(std::int64_t)) &&
        copies_.allocate(2 * static_cast<std::size_t>(cap_.max_copies) * i32) &&
        q_.allocate(static_cast<std::size_t>(cap_.max_q_rows) * static_cast<std::size_t>(shape_.q_row_elems()) * es) &&
        o_.allocate(q_.bytes()) &&
        lse_.allocate(static_cast<std::size_t>(cap_.max_q_rows) * static_cast<std::size_t>(shape_.num_qo_heads) *
                      sizeof(float)) &&
        key_.allocate(static_cast<std::size_t>(cap_.max_new_tokens) * static_cast<std::size_t>(shape_.kv_row_elems()) *
                      es) &&
        value_.allocate(key_.bytes()) &&
        workspace_.allocate(std::max(pagedkv::decode_workspace_bytes(cap_.max_batch, cap_.max_num_chunks,
                                                                     shape_.num_qo_heads, shape_.head_dim),
                                     cap_.plan_cap.workspace_bytes)) &&
        plan_items_.allocate(static_cast<std::size_t>(cap_.plan_cap.items) * sizeof(pagedkv::DecodeWorkItem)) &&
        plan_merges_.allocate(static_cast<std::size_t>(cap_.plan_cap.merges) * sizeof(pagedkv::DecodeMergeItem));
    if (!ok) return cuda_fail("cudaMalloc", cudaGetLastError());
    return {};
  }

  std::string name() const override { return "cuda (" + std::to_string(sm_count_) + " SMs)"; }

  BackendResult set_metadata(const Metadata& md) override {
    struct Up {
      const DeviceBuffer& dst;
      const void* src;
      std::size_t bytes;
    };
    const Up ups[] = {
        {indptr_, md.indptr.data(), md.indptr.size() * sizeof(std::int32_t)},
        {indices_, md.indices.data(), md.indices.size() * sizeof(std::int32_t)},
        {last_page_len_, md.last_page_len.data(), md.last_page_len.size() * sizeof(std::int32_t)},
        {block_tables_, md.block_tables.data(), md.block_tables.size() * sizeof(std::int32_t)},
        {seq_lens_, md.seq_lens.data(), md.seq_lens.size() * sizeof(std::int32_t)},
        {qo_indptr_, md.qo_indptr.data(), md.qo_indptr.size() * sizeof(std::int32_t)},
        {slot_mapping_, md.slot_mapping.data(), md.slot_mapping.size() * sizeof(std::int64_t)},
        {copies_, md.copies.data(), md.copies.size() * sizeof(std::int32_t)},
        {plan_items_, md.plan_items.data(), md.plan_items.size() * sizeof(pagedkv::DecodeWorkItem)},
        {plan_merges_, md.plan_merges.data(), md.plan_merges.size() * sizeof(pagedkv::DecodeMergeItem)},
    };
    for (const Up& u : ups) {
      if (u.bytes == 0) continue;
      if (const cudaError_t e = cudaMemcpyAsync(u.dst.get(), u.src, u.bytes, cudaMemcpyHostToDevice, stream_);
          e != cudaSuccess) {
        return cuda_fail("upload metadata", e);
      }
    }
    // The host buffers are pageable and reused next step: make sure the copies have consumed them.
    if (const cudaError_t e = cudaStreamSynchronize(stream_); e != cudaSuccess) return cuda_fail("upload metadata", e);
    return {};
  }

  BackendResult run_layer(const LayerWork& w) override {
    const pagedkv::KVPoolView& kv = views_[static_cast<std::size_t>(w.layer)];
    const std::size_t es = shape_.elem_bytes();
    const auto q_bytes = static_cast<std::size_t>(w.total_q_rows) * static_cast<std::size_t>(shape_.q_row_elems()) * es;
    const auto kv_bytes =
        static_cast<std::size_t>(w.num_new_tokens) * static_cast<std::size_t>(shape_.kv_row_elems()) * es;
    const auto lse_bytes = static_cast<std::size_t>(w.total_q_rows) * static_cast<std::size_t>(shape_.num_qo_heads) *
                           sizeof(float);
    cudaError_t e = cudaSuccess;
    if (q_bytes > 0) e = cudaMemcpyAsync(q_.get(), w.q, q_bytes, cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess && kv_bytes > 0) e = cudaMemcpyAsync(key_.get(), w.key, kv_bytes, cudaMemcpyHostToDevice, stream_);
    if (e == cudaSuccess && kv_bytes > 0) {
      e = cudaMemcpyAsync(value_.get(), w.value, kv_bytes, cudaMemcpyHostToDevice, stream_);
    }
    if (e != cudaSuccess) return cuda_fail("upload q/k/v", e);

    // 1. copy_blocks: the copy list is read from device memory, capacity-padded with (-1, -1).
    const pagedkv::CopyBlocksParams cp{&kv, 1, copies_.as<std::int32_t>(), cap_.max_copies};
    if (const Status s = pagedkv::cuda::copy_blocks(cp, stream_); s != Status::kSuccess) return fail("cuda::copy_blocks", s);

    // 2. write_kv over the whole slot-mapping capacity (padding slots are -1 and skipped on the device).
    pagedkv::WriteKVParams wp;
    wp.key = key_.get();
    wp.value = value_.get();
    wp.slot_mapping = slot_mapping_.as<std::int64_t>();
    wp.num_tokens = cap_.max_new_tokens;
    wp.kv = kv;
    if (const Status s = pagedkv::cuda::write_kv(wp, stream_); s != Status::kSuccess) return fail("cuda::write_kv", s);

    // 3. Attention.
    if (w.prefill) {
      pagedkv::PrefillParams p;
      p.q = q_.get();
      p.o = o_.get();
      p.lse = lse_.as<float>();
      p.qo_indptr = qo_indptr_.as<std::int32_t>();
      p.total_q_tokens = w.total_q_rows;
      p.kv = kv;
      p.pages = pagedkv::PageTable::csr(cap_.max_batch, indptr_.as<std::int32_t>(), indices_.as<std::int32_t>(),
                                        last_page_len_.as<std::int32_t>());
      p.num_qo_heads = shape_.num_qo_heads;
      p.sm_scale = shape_.sm_scale();
      if (const Status s = pagedkv::cuda::prefill(p, stream_); s != Status::kSuccess) return fail("cuda::prefill", s);
    } else {
      pagedkv::DecodeParams p;
      p.q = q_.get();
      p.o = o_.get();
      p.lse = lse_.as<float>();
      p.kv = kv;
      p.pages = w.format == pagedkv::PageTableFormat::kCsr
                    ? pagedkv::PageTable::csr(cap_.max_batch, indptr_.as<std::int32_t>(), indices_.as<std::int32_t>(),
                                              last_page_len_.as<std::int32_t>())
                    : pagedkv::PageTable::padded(cap_.max_batch, block_tables_.as<std::int32_t>(),
                                                 cap_.max_blocks_per_seq, seq_lens_.as<std::int32_t>());
      p.num_qo_heads = shape_.num_qo_heads;
      p.sm_scale = shape_.sm_scale();
      p.kv_chunk_size_tokens = w.kv_chunk_size_tokens;
      p.max_num_chunks = w.max_num_chunks;
      p.workspace = workspace_.get();
      p.workspace_bytes = workspace_.bytes();
      // With a plan: the same work list, at the device copies set_metadata uploaded.
      const Status s = w.use_plan ? pagedkv::cuda::decode(p,
                                                          w.plan.relocated(plan_items_.as<pagedkv::DecodeWorkItem>(),
                                                                           plan_merges_.as<pagedkv::DecodeMergeItem>()),
                                                          stream_)
                                  : pagedkv::cuda::decode(p, stream_);
      if (s != Status::kSuccess) return fail("cuda::decode", s);
    }

    if (q_bytes > 0) e = cudaMemcpyAsync(w.o, o_.get(), q_bytes, cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess && lse_bytes > 0) e = cudaMemcpyAsync(w.lse, lse_.get(), lse_bytes, cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);  // also surfaces asynchronous kernel faults
    if (e != cudaSuccess) return cuda_fail("layer " + std::to_string(w.layer), e);
    return {};
  }

 private:
  Shape shape_;
  Capacity cap_;
  std::int32_t sm_count_;
  cudaStream_t stream_ = nullptr;
  std::vector<DeviceBuffer> k_, v_;
  std::vector<pagedkv::KVPoolView> views_;
  DeviceBuffer indptr_, indices_, last_page_len_, block_tables_, seq_lens_, qo_indptr_, slot_mapping_, copies_;
  DeviceBuffer q_, o_, lse_, key_, value_, workspace_, plan_items_, plan_merges_;
};

}  // namespace

bool cuda_plan_config(const Shape& shape, pagedkv::DecodePlanConfig* cfg, std::string* error) {
  const Status s = pagedkv::cuda::decode_plan_config(0, shape.dtype, shape.head_dim, shape.num_qo_heads,
                                                     shape.num_kv_heads, cfg);
  if (s != Status::kSuccess) {
    *error = std::string("pagedkv::cuda::decode_plan_config: ") + pagedkv::to_string(s) +
             (s == Status::kNoDevice ? " (no CUDA device is present)" : "");
    return false;
  }
  cfg->min_chunk_tokens = 8;  // cut the example's short sequences too
  return true;
}

std::unique_ptr<Backend> make_cuda_backend(const Shape& shape, const Capacity& cap, std::string* error) {
  std::int32_t sms = 0;
  if (const Status s = pagedkv::cuda::device_sm_count(0, &sms); s != Status::kSuccess) {
    *error = std::string("pagedkv::cuda::device_sm_count: ") + pagedkv::to_string(s) +
             (s == Status::kNoDevice ? " (no CUDA device is present)" : "");
    return nullptr;
  }
  if (!pagedkv::cuda::is_supported(shape.dtype, shape.head_dim)) {
    *error = std::string("pagedkv::cuda: ") + pagedkv::to_string(Status::kUnsupported) + " (" +
             dtype_name(shape.dtype) + " x head_dim " + std::to_string(shape.head_dim) + ")";
    return nullptr;
  }
  auto b = std::make_unique<CudaBackend>(shape, cap, sms);
  if (BackendResult r = b->init(); !r.ok()) {
    *error = r.what;
    return nullptr;
  }
  return b;
}

}  // namespace decode_loop

#else  // !PAGEDKV_WITH_CUDA

namespace decode_loop {

bool cuda_plan_config(const Shape& /*shape*/, pagedkv::DecodePlanConfig* /*cfg*/, std::string* error) {
  *error =
      "this build has no CUDA support: pagedkv::cuda was not built (no CUDA compiler found at configure time, or "
      "PAGEDKV_ENABLE_CUDA=OFF); rebuild with CUDA or use --device cpu";
  return false;
}

std::unique_ptr<Backend> make_cuda_backend(const Shape& /*shape*/, const Capacity& /*cap*/, std::string* error) {
  *error =
      "this build has no CUDA support: pagedkv::cuda was not built (no CUDA compiler found at configure time, or "
      "PAGEDKV_ENABLE_CUDA=OFF); rebuild with CUDA or use --device cpu";
  return nullptr;
}

}  // namespace decode_loop

#endif
