// pagedkv/detail/group_full.hpp: the full-attention group kind (docs/groups.md; issue 32's "one small type per group
// kind"): every block of a sequence stays in its table, at the pool's match unit. It is also the base of the other
// attention kinds (detail/group_window.hpp, detail/group_coarse.hpp): a hook a kind does not override is this one.
// vLLM V1 keeps the same in FullAttentionManager (single_type_kv_cache_manager.py). The kind is a small value (group
// index, match unit) built once per call and group by visit_group (group_policy.hpp); the one-group pool's compiled
// path (the facade's kOne) builds it statically, so its hooks are always inlined. Nothing here knows the manager or
// the host tier.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv::detail {

/// Full-attention group `g` of a manager whose match unit is `block_size` tokens (KVCacheGroupSpec with
/// AttentionKind::kFull at the pool's block size). Hooks take the manager's DevicePool (`Pool`) and the sequence;
/// none allocates a block: allocation stays with the caller, after its capacity check.
template <class Id>
struct FullGroup {
  using sequence_type = SequenceState<Id>;

  std::size_t g = 0;
  std::size_t block_size = 0;

  /// The window of the hit and registration rules (KVCacheGroupSpec::hit_window): off.
  [[nodiscard]] static constexpr AttentionWindow window() noexcept { return {}; }
  /// Tokens per block of the group's pages: the match unit.
  [[nodiscard]] std::size_t page_tokens() const noexcept { return block_size; }
  /// Index events a registration of one match block may record (BlockStored; a coarse re-key records more).
  [[nodiscard]] static constexpr std::size_t events_per_registration() noexcept { return 1; }

  /// Blocks an admission hitting `k` match blocks (`hits`: the group's k hit blocks) and reserving `reserved` tokens
  /// after them takes from the pool in this group: the table blocks after the hit.
  template <class Pool>
  [[nodiscard]] std::size_t admit_need(const Pool&, std::size_t k, std::size_t reserved, std::span<const Id>) const {
    return (k * block_size + reserved + block_size - 1) / block_size - k;
  }
  /// Blocks a prompt of `prompt_len` tokens needs in this group at least, however it is reserved (kNeverFits).
  [[nodiscard]] std::size_t min_need(std::size_t prompt_len) const noexcept {
    return (prompt_len + block_size - 1) / block_size;
  }
  /// The admission's hit in this group: `hit` (k entries: a held device block, or the device block an onboarding
  /// fills) becomes the first k blocks of q's table, registered (onboarded blocks are registered when filled).
  /// `simple`: the one-group pool, whose release cursor never moves. Precondition: room reserved in the table.
  void take_hit(sequence_type& q, std::span<const Id> hit, bool simple) const {
    BlockTable<Id>& t = q.table_of(g);
    for (const Id b : hit) t.append_full_block(b);
    if (!simple) q.released_of(g) = 0;
    q.registered_of(g) = hit.size();
  }
  /// A build's check of the group's buffers beyond the page table's (`rows`: the batch's sequences, `q_lens`: the
  /// tokens each computes): the kBadShape message, or none. None here.
  [[nodiscard]] static std::optional<std::string> buffer_error(const BatchMetadataBuffers&,
                                                               std::span<sequence_type* const>,
                                                               std::span<const std::uint32_t>) {
    return std::nullopt;
  }
  /// Register q's registrable blocks of this group beyond its registered cursor (DevicePool::register_blocks).
  /// Precondition: room reserved in the pool's switched() and event log.
  template <bool kOne, class Pool, class OnRegistered>
  [[gnu::always_inline]] void register_new(Pool& pool, sequence_type& q, OnRegistered&& on_registered) const {
    pool.template register_blocks<kOne>(q, g, window(), nullptr, on_registered);
  }
  /// The release rule after a build whose committed positions end at `committed`: nothing (every block is kept).
  template <class Pool>
  void release(Pool&, sequence_type&, std::size_t) const noexcept {}
  /// The logical block a rewind of q to `new_built` built positions needs that this group released already (the
  /// rewind is refused, kLimitExceeded naming it); none here (nothing is released).
  [[nodiscard]] std::optional<std::size_t> rewind_needs_released(const sequence_type&, std::size_t) const noexcept {
    return std::nullopt;
  }
  /// After q's table of this group was rewound to `kept_blocks` known match blocks: nothing more, here.
  template <class Pool>
  void after_rewind(Pool&, sequence_type&, std::size_t) const noexcept {}

  /// Release q's blocks of group g in [released, target) (null in the table from then on), last holder's retention
  /// priority first, and move the release cursor to target. The release rule of the windowed kinds.
  template <class Pool>
  static void release_before(Pool& pool, sequence_type& q, std::size_t g, std::size_t target) {
    BlockTable<Id>& t = q.table_of(g);
    target = std::min(target, t.num_blocks());
    std::size_t& released = q.released_of(g);
    if (target > released) {
      pool.apply_retention(t.blocks(), t.block_size(), q.retention.get(), q.num_prompt_tokens, released, target);
    }
    for (std::size_t i = target; i-- > released;) {  // last block first, as vLLM's remove_skipped_blocks frees them
      const Id old = t.replace_block(i, Id{0});
      if (old != Id{0}) pool.release_block(old);
    }
    released = std::max(released, target);
  }
};

}  // namespace pagedkv::detail
