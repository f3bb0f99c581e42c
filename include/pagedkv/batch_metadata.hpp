// pagedkv/batch_metadata.hpp: the caller-owned, fixed-capacity buffers the batch-metadata builder fills.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include <pagedkv/error.hpp>

namespace pagedkv {

/// The largest value an int32 field of the batch metadata can hold (2^31 - 1). It bounds, and the manager checks
/// (kLimitExceeded naming the limit): block ids (so a pool has at most 2^31 blocks, the null block included, and
/// the -1 padding never collides with a block id), tokens per sequence (`seq_lens`), and one build's running
/// totals (`indptr[batch]`, `qo_indptr[batch]`).
inline constexpr std::size_t kMaxMetadataValue = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());

namespace detail {
/// Throws kLimitExceeded, naming `what` and the limit, when `value` > kMaxMetadataValue.
inline void check_metadata_value(std::size_t value, const char* what) {
  if (value > kMaxMetadataValue) [[unlikely]] {
    raise(Errc::kLimitExceeded, std::string(what) + " = " + std::to_string(value) +
                                    " exceeds the int32 limit of the batch metadata (" +
                                    std::to_string(kMaxMetadataValue) + ")");
  }
}
}  // namespace detail

/// Caller-owned output buffers for one step's batch metadata (docs/contract.md sec. 3), in host memory; the engine
/// copies them to fixed device buffers (or allocates them pinned and maps them), so a CUDA graph captured once can
/// be replayed. Every span may be empty, which skips that output. Capacities are the spans' sizes:
///  - `indptr`        `[max_batch + 1]` int32, CSR page table row pointers (FlashInfer `paged_kv_indptr`).
///  - `indices`       `[max_total_blocks]` int32, block ids of every sequence in order (`paged_kv_indices`).
///  - `last_page_len` `[max_batch]` int32, tokens in each sequence's last block, in [1, block_size].
///  - `block_tables`  `[max_batch, max_blocks_per_seq]` int32 row-major, padded with the null block 0 (vLLM).
///  - `seq_lens`      `[max_batch]` int32, tokens per sequence (vLLM `seq_lens`).
///  - `qo_indptr`     `[max_batch + 1]` int32, offsets of each sequence's new tokens (queries) in the step.
///  - `slot_mapping`  `[max_num_tokens]` int64, one slot per new token (block * block_size + offset); -1 = skip.
///  - `copies`        `[max_copies, 2]` int32 (src, dst) copy-on-write pairs; (-1, -1) = padding.
///  - `swap_out`      `[max_swaps, 2]` int32 (device block, host block) pairs: device -> host copies (offload,
///                    swap preemption); (-1, -1) = padding. Consumed by swap_blocks(kDeviceToHost).
///  - `swap_in`       `[max_swaps, 2]` int32 (host block, device block) pairs: host -> device copies (onboarding
///                    of a host-tier hit, resume of a swapped sequence); (-1, -1) = padding. swap_blocks(kHostToDevice).
/// Order of one step's work on the device (the contract the lists are built for): swap_out, then swap_in, then
/// copy_blocks (copies), then write_kv (slot_mapping) and attention, in stream order; then the engine calls
/// `complete_transfers(transfer_token)` once the swaps finished (blocks they read or fill stay pinned until then).
/// Padding beyond the batch: indptr / qo_indptr repeat their last value, last_page_len and seq_lens are 0,
/// slot_mapping and copies are -1 to their capacity; block_tables rows beyond the batch are left untouched (their
/// seq_lens are 0, so kernels never read them).
struct BatchMetadataBuffers {
  std::span<std::int32_t> indptr;
  std::span<std::int32_t> indices;
  std::span<std::int32_t> last_page_len;
  std::span<std::int32_t> block_tables;
  std::int32_t max_blocks_per_seq = 0;  ///< Row length of block_tables; required when block_tables is set.
  std::span<std::int32_t> seq_lens;
  std::span<std::int32_t> qo_indptr;
  std::span<std::int64_t> slot_mapping;
  std::span<std::int32_t> copies;
  std::span<std::int32_t> swap_out;
  std::span<std::int32_t> swap_in;
};

/// What one build wrote: the live extents inside the buffers.
struct BatchMetadataSizes {
  std::size_t batch_size = 0;     ///< Sequences in the batch (rows written).
  std::size_t num_indices = 0;    ///< indptr[batch_size]: block ids written to `indices`.
  std::size_t num_new_tokens = 0; ///< qo_indptr[batch_size]: slots written to `slot_mapping` before padding.
  std::size_t num_copies = 0;     ///< Copy-on-write pairs written to `copies` before padding.
  std::size_t num_swap_out = 0;   ///< Pairs written to `swap_out` before padding.
  std::size_t num_swap_in = 0;    ///< Pairs written to `swap_in` before padding.
  std::uint64_t transfer_token = 0;  ///< Token naming this build's swaps for complete_transfers (0: none).
};

}  // namespace pagedkv
