// pagedkv/detail/group_window.hpp: the windowed group kinds, sliding window and chunked-local (docs/groups.md; issue
// 32's "one small type per group kind"): a query at p sees keys from window.first_visible(p) on, so the group keeps
// only the blocks from first_kept_block on and nulls the rest (positions stay absolute; the kernels never read those
// pages). vLLM V1 keeps the same in SlidingWindowManager and ChunkedLocalAttentionManager
// (single_type_kv_cache_manager.py); SGLang in its SWA radix cache. The kind is a small value (group index, match
// unit, window) built once per call and group by visit_group (group_policy.hpp); a hook it does not override is the
// full kind's (detail/group_full.hpp). Nothing here knows the manager or the host tier.
#pragma once

#include <cstddef>
#include <optional>
#include <span>

#include <pagedkv/detail/group_full.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv::detail {

/// Windowed group `g` (KVCacheGroupSpec with AttentionKind::kSlidingWindow or kChunkedLocal): match unit
/// `block_size` tokens, the kernels' window `attention` (KVCacheGroupSpec::window(); enabled). Its table holds the
/// null block 0 before `released_of(g)`.
template <class Id>
struct WindowGroup : FullGroup<Id> {
  using base = FullGroup<Id>;
  using typename base::sequence_type;
  using base::block_size;
  using base::g;

  AttentionWindow attention;
  WindowRetention retention{};  ///< A sliding-window group's sparse retention (GroupLayout::retention_of); off = dense.

  /// The window of the hit and registration rules: the group's own (a hit of k blocks needs blocks
  /// [first_kept_block(k * block_size), k); block_can_serve_hit).
  [[nodiscard]] AttentionWindow window() const noexcept { return attention; }
  /// First logical block the group must still hold for a sequence whose next query is at `pos` (first_kept_block).
  [[nodiscard]] std::size_t first_kept(std::size_t pos) const noexcept {
    return first_kept_block(attention, pos, static_cast<std::uint32_t>(block_size));
  }

  /// A windowed group needs one block at least, whatever the prompt (the one its last query writes).
  [[nodiscard]] static constexpr std::size_t min_need(std::size_t) noexcept { return 1; }
  /// The admission's hit: the full kind's, with the blocks before the first computed query's window counted
  /// released (the hit holds them null: the fixed point takes only the blocks the window sees).
  void take_hit(sequence_type& q, std::span<const Id> hit, bool simple) const {
    base::take_hit(q, hit, simple);
    q.released_of(g) = first_kept(hit.size() * block_size);
  }
  /// DevicePool::register_blocks under the group's window (a block no hit can use is not registered) and its sparse
  /// retention (a block no boundary's tail holds is not registered).
  template <bool kOne, class Pool, class OnRegistered>
  [[gnu::always_inline]] void register_new(Pool& pool, sequence_type& q, OnRegistered&& on_registered) const {
    pool.template register_blocks<kOne>(q, g, attention, &retention, on_registered);
  }
  /// The release rule: after a build, blocks wholly before first_visible(committed) become null, where committed =
  /// min(num_built, num_known): built lookahead positions do not count, since commit_lookahead may reject them and
  /// the next query then sits at the first rejected position, whose window reaches further back.
  template <class Pool>
  void release(Pool& pool, sequence_type& q, std::size_t committed) const {
    base::release_before(pool, q, g, first_kept(committed));
  }
  /// The released logical block a rewind of q to `new_built` built positions would need back (a released block
  /// cannot come back: the rewind is refused), if any.
  [[nodiscard]] std::optional<std::size_t> rewind_needs_released(const sequence_type& q,
                                                                 std::size_t new_built) const noexcept {
    const std::size_t need = first_kept(new_built);
    if (q.released_of(g) > need) return need;
    return std::nullopt;
  }
};

}  // namespace pagedkv::detail
