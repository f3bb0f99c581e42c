// pagedkv/detail/growth.hpp: a live sequence's growth and rewind checks, the cache manager's part behind try_append,
// try_reserve, try_reserve_lookahead, query_append and rewind (issue 32, docs/design.md "The manager in parts"):
// the misuse checks, what a growth of n slots takes in every group (new blocks, a copy-on-write of a shared or hashed
// partial tail, a recurrent group's checkpoints and draft states), the room reserved so that the growth cannot throw,
// the growth itself, and the rewind floor of windowed and recurrent groups. vLLM V1 does the same in
// KVCacheManager.allocate_slots (num_blocks_to_allocate, then allocate_new_blocks per SingleTypeKVCacheManager).
// Free function templates over the device pool (DevicePool), the group layout, the config and the counters, passed
// in by the facade per call: the growth keeps no state of its own (its slot scratch is the caller's). Nothing here
// knows the manager or the host tier (the caller's room reservation and evictor are callables).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/block_table.hpp>
#include <pagedkv/cache_config.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/detail/group_coarse.hpp>
#include <pagedkv/detail/group_full.hpp>
#include <pagedkv/detail/group_recurrent.hpp>
#include <pagedkv/detail/group_window.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/manager_results.hpp>
#include <pagedkv/sequence_state.hpp>
#include <pagedkv/stats.hpp>

namespace pagedkv::detail {

/// Misuse checks shared by the calls that add positions after the last token of live sequence `seq` (its state
/// `q`) by `n`: append, lookahead (`what` names the call in the message). Throws kInvalidArgument (prompt tokens
/// without slots, uncommitted lookahead slots), kLimitExceeded (q would hold more than `max_tokens_per_seq` tokens).
template <class Id>
void check_growable(const SequenceState<Id>& q, SeqId seq, std::size_t n, std::size_t max_tokens_per_seq,
                    const char* what) {
  if (q.num_unslotted() != 0) {
    raise(Errc::kInvalidArgument, std::string(what) + ": sequence " + std::to_string(seq) + " has " +
                                      std::to_string(q.num_unslotted()) +
                                      " prompt tokens without slots (try_reserve them first)");
  }
  if (q.num_lookahead != 0) {
    raise(Errc::kInvalidArgument, std::string(what) + ": sequence " + std::to_string(seq) + " has " +
                                      std::to_string(q.num_lookahead) +
                                      " uncommitted lookahead slots (commit_lookahead first)");
  }
  if (q.num_known() + n > max_tokens_per_seq) {
    raise(Errc::kLimitExceeded, std::string(what) + ": sequence " + std::to_string(seq) + " would reach " +
                                    std::to_string(q.num_known() + n) + " tokens, above max_tokens_per_seq = " +
                                    std::to_string(max_tokens_per_seq));
  }
}

/// Add `tokens` to q's known token ids and, with prefix caching on, hash (pool's prefix index, q's keys) the full
/// blocks of `config.block_size` tokens they complete. Room reserved by the caller. Hashing may throw for very large
/// blocks (they encode on the heap): then q is as before.
template <class Pool, class Id>
[[gnu::always_inline]] inline void append_known_tokens(Pool& pool, const CacheConfig& config, SequenceState<Id>& q, std::span<const TokenId> tokens) {
  const std::size_t old_known = q.num_known();
  const std::size_t old_hashes = q.hashes.size();
  q.tokens.insert(q.tokens.end(), tokens.begin(), tokens.end());
  if (!config.enable_prefix_caching) return;
  try {
    pool.index().hash_full_blocks(q.tokens, config.block_size, q.keys.get(), q.hashes);
  } catch (...) {
    q.tokens.resize(old_known);
    q.hashes.resize(old_hashes);
    throw;
  }
}

// The growth's loops are compiled twice: kOne = one full-attention group (layout.simple: group 0 only, no null
// entries, the loops unrolled to the plain pool's code) and the general form; each entry point picks one from
// layout.simple.

/// What growing `q` by n > 0 slots takes from `pool` now, over every group of `layout` (blocks of `block_size`
/// match tokens): kFits, kNoCapacity, or kNeverFits (even with every other sequence gone, `q` would hold more
/// blocks than the pool: a copy forced by sharing would vanish with the sharers; one forced by a hash not).
/// `drafts`: lookahead slots among the n (a draft state each in every recurrent group). Pure.
template <bool kOne, class Pool, class Id>
[[nodiscard]] CapacityQuery query_growth_in(const Pool& pool, const GroupLayout& layout, std::size_t block_size,
                                            const SequenceState<Id>& q, std::size_t n, std::size_t drafts) {
  const std::size_t bs = block_size;
  std::size_t needed = 0, held_after = 0;
  for (std::size_t g = 0; g < layout.groups<kOne>(); ++g) {
    const BlockTable<Id>& t = table_in<kOne>(q, g);
    const std::size_t nblocks = t.num_blocks();
    if constexpr (!kOne) {
      if (layout.is_recurrent(g)) {
        recurrent_group<Id>(layout, g).growth_need(pool, q, n, drafts, needed, held_after);
        continue;
      }
    }
    const std::size_t tb = kOne ? bs : t.block_size();  // a coarse group's pages
    const std::size_t new_blocks = (q.num_slotted() + n + tb - 1) / tb - nblocks;
    const bool cow = t.last_block_needs_copy(pool.template table_view<kOne>(layout, g));
    const bool hashed_partial = cow && pool.template table_view<kOne>(layout, g).is_hashed(t.blocks().back());
    needed += new_blocks + (cow ? 1 : 0);
    held_after += nblocks - (kOne ? 0 : q.released_of(g)) + new_blocks + (hashed_partial ? 1 : 0);
  }
  if (held_after > pool.alloc().num_usable_blocks()) {
    return {CapacityStatus::kNeverFits, needed, held_after - pool.alloc().num_usable_blocks(), 0};
  }
  if (needed > pool.alloc().num_available_blocks()) {
    return {CapacityStatus::kNoCapacity, needed, needed - pool.alloc().num_available_blocks(), 0};
  }
  return {CapacityStatus::kFits, needed, 0, 0};
}
/// query_growth_in's several-groups case, kept out of line: inlined into try_append's caller it cost the one-group
/// decode step 12.5 instructions per append (register pressure; the gate's decode rows, issue 32 move 7b).
template <class Pool, class Id>
[[gnu::noinline]] CapacityQuery query_growth_groups(const Pool& pool, const GroupLayout& layout, std::size_t block_size,
                                                    const SequenceState<Id>& q, std::size_t n, std::size_t drafts) {
  return query_growth_in<false>(pool, layout, block_size, q, n, drafts);
}
/// query_growth_in, compiled for layout.simple or not.
template <class Pool, class Id>
[[nodiscard]] CapacityQuery query_growth(const Pool& pool, const GroupLayout& layout, std::size_t block_size,
                                         const SequenceState<Id>& q, std::size_t n, std::size_t drafts) {
  return layout.simple ? query_growth_in<true>(pool, layout, block_size, q, n, 0)
                       : query_growth_groups(pool, layout, block_size, q, n, drafts);
}

/// Reserve everything commit_growth(q, n) needs, so that it cannot throw: room for a copy per group in the pool's
/// copy list, every table's blocks, `slots` (emptied: the result's slots), a recurrent group's draft states, and
/// `reserve_allocations(device_blocks)` (the caller's: the events and transfers of that many allocations).
/// `drafts`: lookahead slots among the n. May throw; changes nothing visible.
template <class Pool, class Id, class ReserveAllocations>
void prepare_growth(Pool& pool, const GroupLayout& layout, std::size_t block_size, SequenceState<Id>& q, std::size_t n,
                    std::size_t drafts, std::vector<std::int64_t>& slots, ReserveAllocations&& reserve_allocations) {
  const std::size_t bs = block_size;
  const std::size_t new_blocks = (q.num_slotted() + n + bs - 1) / bs - q.table.num_blocks();
  const std::size_t G = layout.num_groups;
  pool.copies().reserve_room(G);
  for (std::size_t g = 0; g < G; ++g) q.table_of(g).reserve_blocks(q.table.num_blocks() + new_blocks);
  if (slots.capacity() < n) slots.reserve(n);
  slots.clear();
  reserve_allocations(G * (new_blocks + 2 + drafts));  // + a copy; recurrent: + a completed partial block
  for (std::size_t g = 1; g < G && drafts != 0; ++g) {
    if (layout.is_recurrent(g)) q.other_groups[g - 1].drafts.reserve(drafts);
  }
}

/// Give `q` n more slots in every group (capacity checked by query_growth, room reserved by prepare_growth): new
/// blocks from `pool` (`evict`: the evictor, DevicePool::evictor), a copy-on-write queued for a shared or hashed
/// partial tail (counted in stats.cow_copies), a recurrent group's checkpoints. The result's slots (into `slots`)
/// and copy are group 0's; `num_new_blocks`: query_growth's num_blocks. Never throws.
template <bool kOne, class Pool, class Id, class Evict>
AppendResult<Id> commit_growth_in(Pool& pool, const GroupLayout& layout, CacheStats& stats, SequenceState<Id>& q,
                                  std::size_t n, std::size_t num_new_blocks, std::vector<std::int64_t>& slots,
                                  const Evict& evict) {
  std::optional<BlockCopy<Id>> copy0;
  for (std::size_t g = 0; g < layout.groups<kOne>(); ++g) {
    if constexpr (!kOne) {
      if (layout.is_recurrent(g)) {
        const auto take = [&pool, &evict, g] { return pool.allocate_one(g, evict); };
        stats.cow_copies += recurrent_group<Id>(layout, g).grow_shared(pool, q, n, take) ? 1 : 0;
        continue;
      }
    }
    auto alloc = pool.template table_allocator<kOne>(layout, g);
    std::optional<BlockCopy<Id>> copy;
    const bool ok = table_in<kOne>(q, g).try_append(n, alloc, Evict(evict), g == 0 ? &slots : nullptr, copy);
    (void)ok;
    if (copy) {
      copy->group = static_cast<std::uint32_t>(g);
      pool.copies().push(*copy, q);
      ++stats.cow_copies;
      if (g == 0) copy0 = copy;
    }
  }
  pool.note_peak();
  return {AppendStatus::kOk, slots, copy0, 0, num_new_blocks};
}
/// commit_growth_in's several-groups case: out of line, with everything it calls inlined into it (the table's
/// try_append and the evictor; the gate's groups rows, issue 32 move 8c).
template <class Pool, class Id, class Evict>
[[gnu::noinline, gnu::flatten]] AppendResult<Id> commit_growth_groups(Pool& pool, const GroupLayout& layout,
                                                                     CacheStats& stats, SequenceState<Id>& q,
                                                                     std::size_t n, std::size_t num_new_blocks,
                                                                     std::vector<std::int64_t>& slots,
                                                                     const Evict& evict) {
  return commit_growth_in<false>(pool, layout, stats, q, n, num_new_blocks, slots, evict);
}
/// commit_growth_in, compiled for layout.simple or not.
template <class Pool, class Id, class Evict>
AppendResult<Id> commit_growth(Pool& pool, const GroupLayout& layout, CacheStats& stats, SequenceState<Id>& q,
                               std::size_t n, std::size_t num_new_blocks, std::vector<std::int64_t>& slots,
                               Evict evict) {
  return layout.simple ? commit_growth_in<true>(pool, layout, stats, q, n, num_new_blocks, slots, evict)
                       : commit_growth_groups(pool, layout, stats, q, n, num_new_blocks, slots, evict);
}

/// The rewind floor of every windowed and recurrent group of `layout` (groups `config.groups`): rewinding live
/// sequence `seq` (its state `q`) to `len` known tokens, keeping `keep_slotted` slotted positions, must not take a
/// recurrent group's state back behind its built positions (it is updated in place) nor need a block a windowed
/// group released when its window moved past it. Throws kLimitExceeded naming the group; changes nothing.
template <class Id>
void check_rewind_floor(const GroupLayout& layout, const CacheConfig& config, const SequenceState<Id>& q, SeqId seq,
                        std::size_t len, std::size_t keep_slotted) {
  const std::size_t new_built = std::min(q.num_built, keep_slotted);
  const std::size_t built_known = std::min(q.num_built, q.num_known());  // lookahead positions may go
  for (std::size_t g = 0; g < layout.num_groups; ++g) {
    if (layout.is_recurrent(g) && len < built_known) {
      raise(Errc::kLimitExceeded,
            "rewind: sequence " + std::to_string(seq) + " back to " + std::to_string(len) +
                " tokens would take the state of recurrent group " + std::to_string(g) + " back from " +
                std::to_string(built_known) + " built positions to " + std::to_string(len) +
                ": a recurrent state cannot be rewound (only unbuilt or lookahead positions can)");
    }
    const auto need = visit_group<Id>(layout, g, [&](const auto& kind) { return kind.rewind_needs_released(q, new_built); });
    if (need) {
      raise(Errc::kLimitExceeded, "rewind: sequence " + std::to_string(seq) + " back to " + std::to_string(len) +
                                      " tokens needs logical block " + std::to_string(*need) + " of group " +
                                      std::to_string(g) + " (" + to_string(config.groups[g].kind) + " " +
                                      std::to_string(config.groups[g].window_tokens) +
                                      "), released when its window moved past it");
    }
  }
}

}  // namespace pagedkv::detail
