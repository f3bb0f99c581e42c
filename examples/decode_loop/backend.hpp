// examples/decode_loop/backend.hpp: where the kernels run. The runtime loop (main.cpp) builds each step's batch
// metadata on the host into fixed-capacity buffers and hands a backend one layer at a time; a backend owns the KV
// pools and runs copy_blocks -> write_kv -> attention for that layer. Two backends: the CPU reference
// (pagedkv::reference, host memory) and the CUDA kernels (pagedkv::cuda, device memory; only when the build has
// them).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/decode_plan.hpp>
#include <pagedkv/kernel_params.hpp>

#include "model.hpp"

namespace decode_loop {

/// Fixed capacities of every per-step buffer (chosen once, before the first step, as a runtime sizes the buffers
/// a captured CUDA graph replays).
struct Capacity {
  int max_batch = 0;           ///< Sequences per step (rows of indptr - 1, last_page_len, seq_lens, block_tables).
  int max_blocks_per_seq = 0;  ///< Row length of block_tables.
  int max_indices = 0;         ///< CSR indices.
  int max_new_tokens = 0;      ///< slot_mapping entries, rows of the new K/V.
  int max_q_rows = 0;          ///< Rows of q / o: max(max_new_tokens, max_batch).
  int max_copies = 0;          ///< (src, dst) pairs of the copy list.
  int max_num_chunks = 0;      ///< Split-KV chunks per sequence the decode workspace is sized for (chunk rule).
  int max_swaps = 0;           ///< (src, dst) pairs of each swap list (swap_out, swap_in); 0 without a host tier.
  int num_host_blocks = 0;     ///< Host tier pool size, its null block 0 included; 0 = no host tier.
  pagedkv::DecodePlanConfig plan;       ///< What decode plans are made for (the backend's device).
  pagedkv::DecodePlanCapacity plan_cap; ///< decode_plan_capacity(max_batch, plan): item / merge / partial-row buffers.
};

/// Host copies of one step's batch metadata, every buffer at its fixed capacity (what a runtime keeps pinned and
/// copies to the device once per step). The manager's build pads each buffer to its capacity.
struct Metadata {
  Capacity cap;
  std::vector<std::int32_t> indptr;         // [max_batch + 1]
  std::vector<std::int32_t> indices;        // [max_indices]
  std::vector<std::int32_t> last_page_len;  // [max_batch]
  std::vector<std::int32_t> block_tables;   // [max_batch, max_blocks_per_seq]
  std::vector<std::int32_t> seq_lens;       // [max_batch]
  std::vector<std::int32_t> qo_indptr;      // [max_batch + 1]
  std::vector<std::int64_t> slot_mapping;   // [max_new_tokens]
  std::vector<std::int32_t> copies;         // [max_copies, 2]
  std::vector<std::int32_t> swap_out;       // [max_swaps, 2] (device block, host block)
  std::vector<std::int32_t> swap_in;        // [max_swaps, 2] (host block, device block)
  std::vector<pagedkv::DecodeWorkItem> plan_items;    // [plan_cap.items]: this step's decode plan (decode steps)
  std::vector<pagedkv::DecodeMergeItem> plan_merges;  // [plan_cap.merges]

  explicit Metadata(const Capacity& c);
  /// Spans over every buffer, for KVCacheManager::build_batch_metadata.
  [[nodiscard]] pagedkv::BatchMetadataBuffers buffers();
  /// The plan buffers, for plan_decode.
  [[nodiscard]] pagedkv::DecodePlanBuffers plan_buffers();
};

/// One layer's work of one step. Host pointers; the backend moves them to its memory space.
struct LayerWork {
  int layer = 0;
  bool prefill = false;
  pagedkv::PageTableFormat format = pagedkv::PageTableFormat::kCsr;  ///< Decode only; prefill uses CSR.
  int total_q_rows = 0;           ///< Prefill: qo_indptr[max_batch]; decode: max_batch (padding rows included).
  int num_new_tokens = 0;         ///< Rows of key/value that carry data (the rest, to capacity, is skipped: slot -1).
  int kv_chunk_size_tokens = 0;   ///< Decode split-KV (see DecodeParams); 0 with max_num_chunks 0 = no split.
  int max_num_chunks = 0;
  bool use_plan = false;          ///< Decode: execute the step's plan (Metadata::plan_items / plan_merges).
  pagedkv::DecodeWorkList plan;   ///< Decode with use_plan: the plan as plan_decode returned it (host pointers).
  const void* q = nullptr;        ///< [total_q_rows, num_qo_heads, head_dim], dtype.
  const void* key = nullptr;      ///< [max_new_tokens, num_kv_heads, head_dim], dtype.
  const void* value = nullptr;
  void* o = nullptr;              ///< [total_q_rows, num_qo_heads, head_dim], dtype (written).
  float* lse = nullptr;           ///< [total_q_rows, num_qo_heads] (written).
};

/// Outcome of a backend call: the failing op's name with its Status, or success.
struct BackendResult {
  pagedkv::Status status = pagedkv::Status::kSuccess;
  std::string what;  ///< "op: status (detail)" when status != kSuccess.
  [[nodiscard]] bool ok() const noexcept { return status == pagedkv::Status::kSuccess; }
};

/// A place to run the kernels. Owns num_layers KV pools (every element NaN at creation) and its copy of the
/// step's metadata. Not thread safe.
class Backend {
 public:
  virtual ~Backend() = default;
  [[nodiscard]] virtual std::string name() const = 0;
  /// Takes this step's metadata (every buffer, whole capacity). Called once per step, before run_layer.
  [[nodiscard]] virtual BackendResult set_metadata(const Metadata& md) = 0;
  /// copy_blocks (the step's copy list, this layer) -> write_kv (num_new_tokens rows by slot mapping) ->
  /// prefill or decode attention; o and lse land in w.o / w.lse when it returns.
  [[nodiscard]] virtual BackendResult run_layer(const LayerWork& w) = 0;
  /// The step's swaps, every layer, before its first run_layer: swap_out (device -> host tier), then swap_in
  /// (host tier -> device), from the metadata given to set_metadata (the first `num_out` / `num_in` pairs).
  /// Default: kUnsupported (a backend without a host pool).
  [[nodiscard]] virtual BackendResult run_swaps(int num_out, int num_in) {
    (void)num_out;
    (void)num_in;
    return {pagedkv::Status::kUnsupported, "swap_blocks: this backend has no host tier"};
  }
};

/// The CPU reference backend (pagedkv::reference). Never fails to construct. With cap.num_host_blocks > 0 it also
/// owns a host tier pool per layer (same block shape, poisoned like the device pools) and runs swap_blocks.
[[nodiscard]] std::unique_ptr<Backend> make_cpu_backend(const Shape& shape, const Capacity& cap);

/// The plan configuration for the CPU backend: a small "device" (4 SMs x 2 CTAs, chunks of >= 8 tokens) so that
/// the example's sequences of a few hundred tokens really are cut, with the CUDA kernel's head tiling.
[[nodiscard]] pagedkv::DecodePlanConfig cpu_plan_config(const Shape& shape);

/// The plan configuration for the CUDA backend: pagedkv::cuda::decode_plan_config of device 0 (SMs, occupancy, head
/// tiling), with chunks of >= 8 tokens. False with *error set when the build has no CUDA or no device is usable.
[[nodiscard]] bool cuda_plan_config(const Shape& shape, pagedkv::DecodePlanConfig* cfg, std::string* error);

/// The CUDA backend (pagedkv::cuda), or null with *error set: the build has no CUDA support, or no device is
/// usable (the error then carries the Status text).
[[nodiscard]] std::unique_ptr<Backend> make_cuda_backend(const Shape& shape, const Capacity& cap, std::string* error);

}  // namespace decode_loop
