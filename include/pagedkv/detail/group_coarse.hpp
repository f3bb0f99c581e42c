// pagedkv/detail/group_coarse.hpp: the coarse-page group kind (docs/groups.md "Coarse pages"; issue 32's "one small
// type per group kind"): a full-attention group whose pages hold `factor` match blocks (a compressed or indexer
// cache at 64 or 128 tokens beside attention at 16, DeepSeek-V4; vLLM RFC #45702's idea). Its hits are still computed
// per match block: each page is keyed by the hash of the last match block its content reaches (a partial page
// re-keyed as it fills: DevicePool::register_coarse). The kind is a small value (group index, match unit, factor)
// built once per call and group by visit_group (group_policy.hpp); a hook it does not override is the full kind's
// (detail/group_full.hpp). Nothing here knows the manager or the host tier.
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>

#include <pagedkv/block_table.hpp>
#include <pagedkv/detail/group_full.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv::detail {

/// Coarse group `g` (KVCacheGroupSpec with AttentionKind::kFull and block_size = `factor` x the match unit
/// `block_size`, factor >= 2). Its table holds ceil(tokens / page_tokens()) pages.
template <class Id>
struct CoarseGroup : FullGroup<Id> {
  using base = FullGroup<Id>;
  using typename base::sequence_type;
  using base::block_size;
  using base::g;

  std::size_t factor = 1;

  /// Tokens per page.
  [[nodiscard]] std::size_t page_tokens() const noexcept { return factor * block_size; }
  /// Index events a registration of one match block may record: at most one page per match block + 1, each a
  /// BlockRemoved + BlockStored on a re-key.
  [[nodiscard]] static constexpr std::size_t events_per_registration() noexcept { return 4; }

  /// Blocks an admission hitting `k` match blocks and reserving `reserved` tokens takes in this group: the pages
  /// after those the hit holds, and a copy of a hit page that ends inside and that a table holds (the appends after
  /// the hit would write into it). `hits`: the group's k hit entries, the page of each match block.
  template <class Pool>
  [[nodiscard]] std::size_t admit_need(const Pool& pool, std::size_t k, std::size_t reserved,
                                       std::span<const Id> hits) const {
    const std::size_t gb = page_tokens(), held = (k * block_size + gb - 1) / gb;
    const Id tail = k * block_size % gb != 0 ? hits[k - 1] : Id{0};
    return (k * block_size + reserved + gb - 1) / gb - held +
           (tail != Id{0} && reserved > 0 && pool.table_refcount(tail) > 0 ? 1 : 0);
  }
  /// Pages a prompt of `prompt_len` tokens needs at least.
  [[nodiscard]] std::size_t min_need(std::size_t prompt_len) const noexcept {
    return (prompt_len + page_tokens() - 1) / page_tokens();
  }
  /// The admission's hit: page c is the hit's entry at the match block where page c (or the hit) ends; the table
  /// holds the hit's k * block_size tokens. Precondition: room reserved in the table.
  void take_hit(sequence_type& q, std::span<const Id> hit, bool) const {
    const std::size_t k = hit.size();
    q.table_of(g).extend(k * block_size, [&](std::size_t c) { return hit[std::min((c + 1) * factor, k) - 1]; });
    q.registered_of(g) = k;
  }
  /// Key q's pages holding registrable match blocks beyond the registered cursor (DevicePool::register_coarse).
  template <bool kOne, class Pool, class OnRegistered>
  void register_new(Pool& pool, sequence_type& q, OnRegistered&&) const {
    pool.register_coarse(q, g, factor);
  }
  /// After a rewind to `kept_blocks` known match blocks: the last page, left partial, loses a key beyond them
  /// (DevicePool::unkey_rewound_page). Room for its event reserved by the caller.
  template <class Pool>
  void after_rewind(Pool& pool, sequence_type& q, std::size_t kept_blocks) const {
    pool.unkey_rewound_page(q, g, factor, kept_blocks);
  }
};

}  // namespace pagedkv::detail
