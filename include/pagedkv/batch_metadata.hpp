// pagedkv/batch_metadata.hpp: the caller-owned, fixed-capacity buffers the batch-metadata builder fills.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

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

/// The message of a build refusing row `row` (sequence `id`) for having nothing to compute: no pending slot, or
/// `num_scheduled_tokens[row] == 0` when `scheduled` (the span was given); `unslotted` prompt tokens still lack slots.
inline std::string idle_row_message(std::uint64_t id, std::size_t row, bool scheduled, std::size_t unslotted) {
  return "sequence " + std::to_string(id) + " has no tokens to compute in this build (" +
         (scheduled ? "num_scheduled_tokens[" + std::to_string(row) + "] = 0" : std::string("no pending slots")) +
         ", " + std::to_string(unslotted) +
         " prompt tokens without slots): leave it out of the batch, or give it slots first (try_append, try_reserve)";
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
/// A recurrent-state group (AttentionKind::kRecurrent; docs/groups.md, "Recurrent-state groups") has no K/V: its
/// slot_mapping is -1 and its page table holds only checkpoint blocks (the null block 0 elsewhere); a build of a
/// batch with rows needs these outputs in that group's buffers (kBadShape otherwise), and they stay unused in the
/// other groups' buffers:
///  - `state_in`      `[max_batch]` int32, the block to read row b's initial state from: its working state, the
///                    checkpoint of its prefix hit on its first build after admission, a draft state (a row that
///                    starts inside lookahead positions), or -1 (a zero state: the sequence starts at position 0).
///  - `state_out`     `[max_batch]` int32, the block that receives row b's state after its last token of the step
///                    (its working state; may equal state_in: an update in place); -1 for a row that computes
///                    lookahead positions (speculative drafts): its checkpoint entries then hold the state after
///                    its last known token (into the working state) and after each lookahead position (into that
///                    draft's block), so that commit_lookahead can keep any accepted prefix.
///  - `checkpoint_indptr` `[max_batch + 1]` int32, row b's checkpoints are entries [indptr[b], indptr[b + 1]).
///  - `checkpoint_positions` `[max_checkpoints]` int32, the position P of a checkpoint: the state after the first
///                    P tokens of the sequence (after its token P - 1, which this step computes). Non-decreasing
///                    within a row; a position may appear twice (two blocks receive the same state).
///  - `checkpoint_blocks` `[max_checkpoints]` int32, the block that receives that state.
/// Padding: state_in / state_out -1, checkpoint_indptr repeats its last value, checkpoint entries -1.
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
  std::span<std::int32_t> state_in;
  std::span<std::int32_t> state_out;
  std::span<std::int32_t> checkpoint_indptr;
  std::span<std::int32_t> checkpoint_positions;
  std::span<std::int32_t> checkpoint_blocks;
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
  std::size_t num_checkpoints = 0;   ///< checkpoint_indptr[batch_size]: checkpoints written (recurrent groups).
};

/// An engine's fixed limits for one build (what a CUDA-graph engine captures once): the buffers sized from them
/// never make a build fail with kBadShape for a batch within them. Units: sequences, tokens, blocks.
struct BatchMetadataLimits {
  std::size_t max_batch = 0;            ///< Sequences per build (vLLM max_num_seqs).
  std::size_t max_tokens_per_step = 0;  ///< New tokens per build, all sequences together (max_num_batched_tokens).
  std::size_t max_blocks_per_seq = 0;   ///< Blocks of the longest sequence: ceil(max_model_len / block_size).
  /// Copy-on-write pairs per build; 0 = max_batch (one per sequence: what decode, chunked prefill and lookahead
  /// produce between two builds; a rewind then an append into a shared block can add one more).
  std::size_t max_copies = 0;
  /// Swap pairs per direction per build (host tier: offloads of evicted blocks, swap preemption of whole
  /// sequences, onboarding of host hits); 0 = no host tier (no swap buffers).
  std::size_t max_swaps = 0;
  /// Checkpoints of recurrent-state groups per build; 0 = 2 x max_tokens_per_step (each entry ends on a token the
  /// step computes, and a position gets at most two: a checkpoint and, with lookahead, the working or a draft
  /// state; so this bound always holds).
  std::size_t max_checkpoints = 0;
};

/// Entries of each BatchMetadataBuffers span for `limits` (element counts; `copies` / `swap_*` count int32 entries,
/// two per pair). `indices` is max_batch * max_blocks_per_seq (every sequence at its longest).
struct BatchMetadataCapacity {
  std::size_t indptr = 0, indices = 0, last_page_len = 0, block_tables = 0, seq_lens = 0, qo_indptr = 0,
              slot_mapping = 0, copies = 0, swap_out = 0, swap_in = 0, state_in = 0, state_out = 0,
              checkpoint_indptr = 0, checkpoint_positions = 0, checkpoint_blocks = 0;
  std::int32_t max_blocks_per_seq = 0;  ///< The row length of block_tables.
};

/// The capacities of the buffers a build writes for an engine with `limits`. Throws kInvalidArgument (max_batch,
/// max_tokens_per_step or max_blocks_per_seq 0) or kLimitExceeded (a capacity beyond the int32 metadata).
[[nodiscard]] inline BatchMetadataCapacity batch_metadata_capacity(const BatchMetadataLimits& limits) {
  if (limits.max_batch == 0 || limits.max_tokens_per_step == 0 || limits.max_blocks_per_seq == 0) {
    detail::raise(Errc::kInvalidArgument, "batch_metadata_capacity: max_batch = " + std::to_string(limits.max_batch) +
                                              ", max_tokens_per_step = " + std::to_string(limits.max_tokens_per_step) +
                                              ", max_blocks_per_seq = " + std::to_string(limits.max_blocks_per_seq) +
                                              ": each must be > 0");
  }
  detail::check_metadata_value(limits.max_blocks_per_seq, "batch_metadata_capacity: max_blocks_per_seq");
  detail::check_metadata_value(limits.max_tokens_per_step, "batch_metadata_capacity: max_tokens_per_step");
  if (limits.max_batch > kMaxMetadataValue / limits.max_blocks_per_seq) {
    detail::raise(Errc::kLimitExceeded, "batch_metadata_capacity: max_batch * max_blocks_per_seq = " +
                                            std::to_string(limits.max_batch) + " * " +
                                            std::to_string(limits.max_blocks_per_seq) +
                                            " exceeds the int32 limit of the batch metadata");
  }
  BatchMetadataCapacity c;
  c.indptr = c.qo_indptr = limits.max_batch + 1;
  c.last_page_len = c.seq_lens = limits.max_batch;
  c.indices = c.block_tables = limits.max_batch * limits.max_blocks_per_seq;
  c.max_blocks_per_seq = static_cast<std::int32_t>(limits.max_blocks_per_seq);
  c.slot_mapping = limits.max_tokens_per_step;
  c.copies = 2 * (limits.max_copies != 0 ? limits.max_copies : limits.max_batch);
  c.swap_out = c.swap_in = 2 * limits.max_swaps;
  c.state_in = c.state_out = limits.max_batch;
  c.checkpoint_indptr = limits.max_batch + 1;
  c.checkpoint_positions = c.checkpoint_blocks =
      limits.max_checkpoints != 0 ? limits.max_checkpoints : 2 * limits.max_tokens_per_step;
  detail::check_metadata_value(c.checkpoint_positions, "batch_metadata_capacity: max_checkpoints");
  return c;
}

/// Owning host storage for one build's metadata, sized once by batch_metadata_capacity (allocates only in the
/// constructor); `buffers()` is the view a build writes into. An engine that mirrors the buffers on the device
/// copies `data()` of each vector after the build (or allocates its own pinned memory of the same capacities).
struct BatchMetadataStorage {
  std::vector<std::int32_t> indptr, indices, last_page_len, block_tables, seq_lens, qo_indptr, copies, swap_out, swap_in;
  std::vector<std::int32_t> state_in, state_out, checkpoint_indptr, checkpoint_positions, checkpoint_blocks;
  std::vector<std::int64_t> slot_mapping;
  std::int32_t max_blocks_per_seq = 0;

  /// Storage for `limits` (see batch_metadata_capacity, whose errors it raises).
  explicit BatchMetadataStorage(const BatchMetadataLimits& limits) {
    const BatchMetadataCapacity c = batch_metadata_capacity(limits);
    indptr.resize(c.indptr);
    indices.resize(c.indices);
    last_page_len.resize(c.last_page_len);
    block_tables.resize(c.block_tables);
    seq_lens.resize(c.seq_lens);
    qo_indptr.resize(c.qo_indptr);
    slot_mapping.resize(c.slot_mapping);
    copies.resize(c.copies);
    swap_out.resize(c.swap_out);
    swap_in.resize(c.swap_in);
    state_in.resize(c.state_in);
    state_out.resize(c.state_out);
    checkpoint_indptr.resize(c.checkpoint_indptr);
    checkpoint_positions.resize(c.checkpoint_positions);
    checkpoint_blocks.resize(c.checkpoint_blocks);
    max_blocks_per_seq = c.max_blocks_per_seq;
  }
  /// Every output (swap lists only with a host tier). Valid while this storage lives.
  [[nodiscard]] BatchMetadataBuffers buffers() noexcept {
    return {indptr,          indices,   last_page_len, block_tables,      max_blocks_per_seq,
            seq_lens,        qo_indptr, slot_mapping,  copies,            swap_out,
            swap_in,         state_in,  state_out,     checkpoint_indptr, checkpoint_positions,
            checkpoint_blocks};
  }
};

}  // namespace pagedkv
