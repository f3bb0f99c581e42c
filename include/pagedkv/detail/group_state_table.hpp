// pagedkv/detail/group_state_table.hpp: a recurrent group whose states live in its table (KVCacheGroupSpec::
// state_in_table; vLLM V1's MambaManager in mamba_cache_mode 'align', single_type_kv_cache_manager.py, whose layout
// docs/vllm-mamba-align.md records). The table is indexed by position: the state after a step that ends at token n
// is the block at logical block ceil(n / bs) - 1; a step that enters a new logical block takes a block there (the
// blocks between stay null) and reads its initial state from the block of the previous step's end; a step that ends
// exactly on a block boundary leaves the state there, which is registered as that position's checkpoint. The rest
// of the recurrent kind (hits over a 2-token window, take_hit, the release to the cache) is detail/group_recurrent.hpp's,
// which forwards here when the group has the flag. Nothing here knows the manager or the host tier.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv::detail {

/// Throws kInvalidArgument naming `call` and sequence `seq` when a group of `layout` keeps its states in its table
/// (KVCacheGroupSpec::state_in_table): `call` (lookahead slots and their commit, marked checkpoints, swap
/// preemption, rewind, external KV) assumes a working state apart from the table. Changes nothing.
inline void refuse_state_table(const GroupLayout& layout, const char* call, SeqId seq) {
  if (!layout.any_state_table) return;
  for (std::size_t g = 0; g < layout.num_groups; ++g) {
    if (!layout.is_state_table(g)) continue;
    raise(Errc::kInvalidArgument, std::string(call) + ": sequence " + std::to_string(seq) + ": group " +
                                      std::to_string(g) + " keeps its states in its table (state_in_table, vLLM's "
                                      "Mamba 'align' layout), which " + call + " does not support yet");
  }
}

/// The table rules of state-in-table recurrent group `g` (`block_size` tokens per block; `retention`: the group's
/// sparse retention, GroupLayout::retention_of; `checkpoint_align`: KVCacheGroupSpec::prefill_checkpoint_alignment,
/// 0 = no prefill checkpoint). A plain value built per call by RecurrentGroup. Hooks never allocate memory; blocks
/// come from the caller's `take()` (capacity checked by the caller: `need`).
template <class Id>
struct StateTable {
  using sequence_type = SequenceState<Id>;
  static constexpr std::size_t kNone = static_cast<std::size_t>(-1);

  std::size_t g = 0;
  std::size_t block_size = 0;
  bool prefix_caching = false;
  WindowRetention retention{};
  std::uint32_t checkpoint_align = 0;

  /// The logical block holding the state after `n` > 0 tokens: ceil(n / block_size) - 1.
  [[nodiscard]] std::size_t column(std::size_t n) const noexcept { return (n + block_size - 1) / block_size - 1; }

  /// The logical block of the prefill checkpoint a step computing positions [from, end) keeps (vLLM's
  /// _needs_internal_checkpoint and is_mamba_prefill_checkpoint_valid, docs/vllm-mamba-align.md section 5), or
  /// kNone: the state at pos = floor_bs(end - 1), the last block boundary inside the step, in the block that ends
  /// there, when the step starts on a block boundary, pos is at least a block after it and (pos - from) a multiple of
  /// checkpoint_align; under retention interval 0 only for a step reaching `prefill_end` (vLLM passes it then only).
  /// Pure.
  [[nodiscard]] std::size_t checkpoint_column(std::size_t from, std::size_t end, std::size_t prefill_end) const noexcept {
    const std::size_t bs = block_size;
    if (checkpoint_align == 0 || end <= from || from % bs != 0) return kNone;
    const std::size_t pos = (end - 1) / bs * bs;
    if (from + bs > pos || pos >= end || (pos - from) % checkpoint_align != 0) return kNone;
    if (retention.sparse && retention.period == 0 && end < prefill_end) return kNone;
    return pos / bs - 1;  // > the column of the state at `from`, < column(end)
  }
  /// The prefill end vLLM passes for q (used under retention interval 0): max(prompt length, known tokens - 1).
  [[nodiscard]] static std::size_t prefill_end(const sequence_type& q) noexcept {
    const std::size_t known = q.num_known();
    return std::max(q.retention_replay + 1, known != 0 ? known - 1 : 0);
  }
  /// The prefill checkpoint blocks (0 or 1) an admission reserving [start, start + reserved) takes besides the block
  /// where it ends (RecurrentGroup::admit_need). `prefill_end`: as prefill_end(q) for the admitted prompt. Pure.
  [[nodiscard]] std::size_t admit_checkpoints(std::size_t start, std::size_t reserved,
                                              std::size_t prefill_end) const noexcept {
    return reserved != 0 && checkpoint_column(start, start + reserved, prefill_end) != kNone ? 1 : 0;
  }

  /// Blocks growing q's table by n > 0 positions takes: one when the growth ends in a logical block after the
  /// running one (or q has none yet), plus its prefill checkpoint; one for a copy when it stays in a running block
  /// another table shares (a fork); else none. Pure.
  template <class Pool>
  [[nodiscard]] std::size_t need(const Pool& pool, const sequence_type& q, std::size_t n) const {
    const BlockTable<Id>& t = q.table_of(g);
    const std::size_t from = t.num_tokens();
    if (n == 0) return 0;
    if (from == 0 || column(from + n) != column(from)) {
      return 1 + (checkpoint_column(from, from + n, prefill_end(q)) != kNone ? 1 : 0);
    }
    const Id b = t.blocks()[column(from)];
    return b != Id{0} && pool.table_refcount(b) > 1 ? 1 : 0;
  }
  /// Blocks q holds in the group after growing by n positions (growth_need's held_after). Pure.
  [[nodiscard]] std::size_t held_after(const sequence_type& q, std::size_t n) const {
    const BlockTable<Id>& t = q.table_of(g);
    std::size_t held = 0;
    for (std::size_t i = q.released_of(g); i < t.num_blocks(); ++i) held += t.blocks()[i] != Id{0} ? 1 : 0;
    const std::size_t from = t.num_tokens();
    if (n == 0 || (from != 0 && column(from + n) == column(from))) return held;
    return held + 1 + (checkpoint_column(from, from + n, prefill_end(q)) != kNone ? 1 : 0);
  }

  /// Extend q's table by n positions: null entries, but a fresh block (`take()`) at the logical block where the
  /// growth ends when it is a new one, and at its prefill checkpoint (checkpoint_column) when it keeps one (taken
  /// first: vLLM appends in position order). Room reserved by the caller.
  template <class Take>
  void extend(sequence_type& q, std::size_t n, Take&& take) const {
    BlockTable<Id>& t = q.table_of(g);
    if (n == 0) return;
    const std::size_t from = t.num_tokens();
    const std::size_t last = column(from + n);
    const std::size_t ck = from == 0 || last != column(from) ? checkpoint_column(from, from + n, prefill_end(q)) : kNone;
    t.extend(n, [&](std::size_t i) { return i == last || i == ck ? take() : Id{0}; });
  }
  /// grow: extend, after giving a running block another table shares (a fork) a copy of its own (queued in the
  /// pool's copy list, which holds q's reference on the source until it completes). Returns whether a copy was
  /// queued. Capacity checked (need) and room reserved by the caller.
  template <class Pool, class Take>
  bool grow(Pool& pool, sequence_type& q, std::size_t n, Take&& take) const {
    BlockTable<Id>& t = q.table_of(g);
    const std::size_t from = t.num_tokens();
    bool copied = false;
    if (n != 0 && from != 0 && column(from + n) == column(from)) {
      const std::size_t i = column(from);
      const Id src = t.blocks()[i];
      if (src != Id{0} && pool.table_refcount(src) > 1) {
        const Id dst = take();
        (void)t.replace_block(i, dst);
        pool.copies().push(BlockCopy<Id>{src, dst, static_cast<std::uint32_t>(g)}, q);
        copied = true;
      }
    }
    extend(q, n, take);
    return copied;
  }

  /// The logical blocks a step computing [first, seq_len) passes (holds a state at each one's end, written mid-step:
  /// a prefill checkpoint, or the end of an earlier growth built in the same step): [lo, column(seq_len)).
  [[nodiscard]] std::size_t first_passed(std::size_t first) const noexcept { return first == 0 ? 0 : column(first) + 1; }
  /// The checkpoint entries a step of q computing [first, seq_len) writes: its real blocks strictly between the
  /// state it reads and the one it writes. Pure.
  [[nodiscard]] std::size_t checkpoints_in_step(const sequence_type& q, std::size_t first,
                                                std::size_t seq_len) const noexcept {
    if (seq_len == 0) return 0;
    const auto blocks = q.table_of(g).blocks();
    std::size_t n = 0;
    for (std::size_t i = first_passed(first); i < column(seq_len) && i < blocks.size(); ++i) {
      n += blocks[i] != Id{0} ? 1 : 0;
    }
    return n;
  }

  /// Register the states a build of q computing [first, seq_len) leaves within the known tokens: each block it
  /// passes that holds one (checkpoints_in_step), then the block where it ends when seq_len is a block boundary;
  /// each under the chain hash of the blocks before its end (group g's key), unless the block is null, registered
  /// already, another block holds that hash (this one stays unregistered: it holds the same state), or the sparse
  /// retention keeps no state there (its landing points, aligned down to its alignment). The cursor moves past
  /// them. `on_registered(block, hash)` runs for a registration. Precondition: room for the events reserved.
  template <class Pool, class OnRegistered>
  [[gnu::noinline]] void register_states(Pool& pool, sequence_type& q, std::size_t first, std::size_t seq_len,
                                         OnRegistered&& on_registered) const {
    const std::size_t bs = block_size;
    const std::size_t end = std::min(seq_len, q.num_known());
    if (!prefix_caching || end == 0) return;
    std::size_t& registered = q.registered_of(g);
    const auto blocks = q.table_of(g).blocks();
    const WindowRetention::Ends tails =
        retention.sparse ? retention.ends(q.retention_replay, q.retention_junction, bs) : WindowRetention::Ends{};
    const auto one = [&](std::size_t i) {
      if (i < registered || i >= q.hashes.size() || i >= blocks.size()) return;
      registered = i + 1;
      const Id own = blocks[i];
      if (own == Id{0}) return;
      if (retention.sparse) {
        if ((i + 1) % retention.align != 0) return;  // past the alignment's horizon: no hit lands here
        if (!retention.keeps(i, tails)) return;
      }
      auto index = pool.ix(g);
      if (index.hash_of(own)) return;
      const BlockHash& h = q.hashes[i];
      if (index.find(h)) return;
      (void)index.insert(h, own);
      pool.alloc().set_hashed(own, true);
      if (pool.events().enabled()) pool.record_stored(q, i, h, g);
      on_registered(own, h);
    };
    for (std::size_t i = first_passed(first); (i + 1) * bs <= end && i < column(seq_len); ++i) one(i);
    if (end % bs == 0) one(end / bs - 1);
  }

  /// This group's outputs of batch row b (q computing positions [first, seq_len)): state_in, the block of the state
  /// at `first` (-1: the zero state at 0), state_out, the block at seq_len's logical block, and a checkpoint entry
  /// (its end position, its block) for each real block the step passes (a prefill checkpoint), in position order.
  void write_state_row(const sequence_type& q, std::size_t b, std::size_t first, std::size_t seq_len,
                       const BatchMetadataBuffers& buf, std::size_t& num_checkpoints) const {
    const auto blocks = q.table_of(g).blocks();
    buf.state_in[b] = first == 0 ? -1 : static_cast<std::int32_t>(blocks[column(first)]);
    buf.state_out[b] = static_cast<std::int32_t>(blocks[column(seq_len)]);
    if (b == 0) buf.checkpoint_indptr[0] = 0;
    for (std::size_t i = first_passed(first); i < column(seq_len); ++i) {
      if (blocks[i] == Id{0}) continue;
      buf.checkpoint_positions[num_checkpoints] = static_cast<std::int32_t>((i + 1) * block_size);
      buf.checkpoint_blocks[num_checkpoints] = static_cast<std::int32_t>(blocks[i]);
      ++num_checkpoints;
    }
    buf.checkpoint_indptr[b + 1] = static_cast<std::int32_t>(num_checkpoints);
  }
};

}  // namespace pagedkv::detail
