// pagedkv/detail/host_swap.hpp: swap preemption's host work (issue 32, docs/design.md "The manager in parts"):
// copying a sequence's blocks to the host tier (preempt(kSwap)), planning and queueing their copies back
// (try_resume), and releasing its host blocks (try_resume, free). The idea is vLLM's swap preemption (Kwon et al.,
// SOSP'23, sec. 4.5). The blocks are a flat [groups x blocks] list, group-major, 0 for a null entry (a windowed
// group's blocks before its window); a recurrent group's working state is one more block per group. The facade
// keeps the sequence (SequenceState, its recurrent groups' kinds) and the swapped map; these functions see only
// blocks, hashes and the two tiers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <pagedkv/detail/host_offload.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/manager_results.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/sequence_state.hpp>
#include <pagedkv/stats.hpp>
#include <pagedkv/transfer_queue.hpp>

namespace pagedkv::detail {

/// A sequence preempted by swapping: its state without device blocks, and the host block of each logical block.
template <class Id>
struct SwappedSequence {
  SequenceState<Id> state;      // tokens, hashes, keys, cursors (tables empty)
  std::vector<Id> host_blocks;  // [groups x blocks] held once each by this sequence (0: a null entry)
  std::size_t num_tokens = 0;   // positions (all built)
  std::vector<Id> states;       // [groups] a recurrent group's working state on the host, held once (0: none)
};

/// Swap-out plan of a sequence with `num_groups` groups: `table(g)` gives group g's blocks (0 = null), `state(g)`
/// the recurrent working state to copy (0 = none). A full block whose hash the host holds is shared, any other is
/// copied. Returns the copies to queue, or nullopt when the host tier lacks free or evictable blocks for them
/// (cached host blocks about to be shared do not count as evictable). Precondition: a host tier.
template <class Id, class Tier, class Pool, class Table, class State>
[[nodiscard, gnu::noinline]] std::optional<std::size_t> plan_swap_out(const HostOffload<Id, Tier>& host,
                                                                     const Pool& pool, std::size_t num_groups,
                                                                     Table&& table, State&& state) {
  std::size_t to_fill = 0, shared_cached = 0;
  for (std::size_t g = 0; g < num_groups; ++g) {
    for (Id b : table(g)) {
      if (b == Id{0}) continue;
      const auto hb = host.copy_of(pool, b, g);
      if (!hb) {
        ++to_fill;
      } else if (host.tier().allocator().is_cached(*hb)) {
        ++shared_cached;
      }
    }
  }
  for (std::size_t g = 1; g < num_groups; ++g) to_fill += state(g) != Id{0} ? 1 : 0;
  if (to_fill > host.tier().allocator().num_available_blocks() - shared_cached) return std::nullopt;
  return to_fill;
}

/// Swap out (the commit of plan_swap_out, same `table` and `state`, `nb` blocks per table): hold each shared host
/// block, then allocate, hold and queue a kSwapOut copy (remembering its stored event's content) for every other
/// block and working state. Writes the host blocks into `host_blocks` ([groups x nb], entries of null blocks left
/// as they are) and the states' into `states` ([groups]; may be empty when no group has a state). The device
/// blocks are the caller's to release. Precondition: plan_swap_out succeeded; room for its copies reserved in the
/// queue and for their host evictions' events in the log. Counted in swap_outs.
template <class Id, class Tier, class Pool, class Table, class State>
[[gnu::noinline]] void swap_out(HostOffload<Id, Tier>& host, Pool& pool, CacheStats& stats, std::size_t num_groups,
                               std::size_t nb, Table&& table, State&& state, std::span<Id> host_blocks,
                               std::span<Id> states) {
  for (std::size_t g = 0; g < num_groups; ++g) {  // shared host blocks first (allocations cannot evict them)
    const auto blocks = table(g);
    for (std::size_t i = 0; i < nb; ++i) {
      if (blocks[i] == Id{0}) continue;
      if (const auto hb = host.copy_of(pool, blocks[i], g)) {
        host.tier().acquire(*hb);
        host_blocks[g * nb + i] = *hb;
      }
    }
  }
  for (std::size_t g = 0; g < num_groups; ++g) {
    const auto blocks = table(g);
    for (std::size_t i = 0; i < nb; ++i) {
      if (blocks[i] == Id{0} || host_blocks[g * nb + i] != Id{0}) continue;  // null, or shared above
      const auto h = pool.ix(g).hash_of(blocks[i]);
      const BlockHash key = h ? group_block_key(*h, g) : BlockHash{};
      const Id hb = *host.tier().allocate(h ? &key : nullptr, host.evictor(pool, stats));  // guaranteed by the plan
      host.tier().acquire(hb);  // the copy's own hold, released when it completes
      host.set_group(hb, g);
      host_blocks[g * nb + i] = hb;
      if (h) {
        host.remember_content(pool.events(), *h, hb, Medium::kGpu, static_cast<std::uint32_t>(g), stats.events_lost);
      }
      host.transfers().push({blocks[i], hb, TransferKind::kSwapOut, h.has_value(), h ? *h : BlockHash{}, 0,
                             static_cast<std::uint32_t>(g)});
      ++stats.swap_outs;
    }
  }
  for (std::size_t g = 1; g < num_groups; ++g) {  // working states (unhashed: always copied)
    const Id st = state(g);
    if (st == Id{0}) continue;
    const Id hb = *host.tier().allocate(nullptr, host.evictor(pool, stats));  // guaranteed by the plan
    host.tier().acquire(hb);
    host.set_group(hb, g);
    states[g] = hb;
    host.transfers().push({st, hb, TransferKind::kSwapOut, false, BlockHash{}, 0, static_cast<std::uint32_t>(g)});
    ++stats.swap_outs;
  }
}

/// What resuming a swapped sequence takes: `pending` when a copy that filled one of its host blocks has not
/// completed; else the blocks to copy back (`to_fill`) and the device hits that are cached (evictable) now.
struct ResumePlan {
  bool pending = false;
  std::size_t to_fill = 0;
  std::size_t evictable_hits = 0;
};

/// Resume plan over `host_blocks` ([groups x nb], 0 = null): `hits[j]` = the device block caching entry j's hash
/// (0: none, copied back then). `hits` is resized to host_blocks.size() (may throw std::bad_alloc).
template <class Id, class Tier, class Pool>
[[nodiscard, gnu::noinline]] ResumePlan plan_resume(const HostOffload<Id, Tier>& host, const Pool& pool,
                                     std::span<const Id> host_blocks, std::size_t nb, std::vector<Id>& hits) {
  ResumePlan p;
  hits.assign(host_blocks.size(), Id{0});
  for (std::size_t j = 0; j < host_blocks.size(); ++j) {
    const Id hb = host_blocks[j];
    if (hb == Id{0}) continue;
    if (!host.tier().is_ready(hb)) return {true, 0, 0};
    const std::size_t g = j / nb;
    const auto key = host.tier().index().hash_of(hb);
    // (the key unmixed: the hash)
    if (const auto b = key ? pool.ix(g).find(group_block_key(*key, g)) : std::nullopt) {
      hits[j] = *b;
      if (pool.alloc().is_cached(*b)) ++p.evictable_hits;
    } else {
      ++p.to_fill;
    }
  }
  return p;
}

/// KVCacheManager::try_resume's answer before its commit, for swapped sequence `s` over `num_groups` groups:
/// kTransferPending while the copy of a working state (`s.states`) or of a host block has not completed, kNeverFits /
/// kNoCapacity (with the missing blocks) as admission answers, else kAdmitted with the blocks to copy back
/// (`to_fill`) and the fresh ones (`fresh`: `state_blocks(g)` per group, a recurrent group's working state and last
/// checkpoint). Fills `hits` (plan_resume). Changes nothing else.
struct ResumeNeed {
  AdmitStatus status = AdmitStatus::kAdmitted;
  std::size_t missing = 0;
  std::size_t to_fill = 0;
  std::size_t fresh = 0;
};
template <class Id, class Tier, class Pool, class StateBlocks>
[[nodiscard]] ResumeNeed resume_need(const HostOffload<Id, Tier>& host, const Pool& pool, const SwappedSequence<Id>& s,
                                     std::size_t num_groups, StateBlocks&& state_blocks, std::vector<Id>& hits) {
  ResumeNeed r;
  std::size_t held = 0;
  for (Id hb : s.host_blocks) held += hb != Id{0} ? 1 : 0;
  for (std::size_t g = 1; g < num_groups; ++g) {
    r.fresh += state_blocks(g);
    if (s.states.size() > g && s.states[g] != Id{0} && !host.tier().is_ready(s.states[g])) {
      return {AdmitStatus::kTransferPending, 0, 0, 0};
    }
  }
  held += r.fresh;
  if (held > pool.alloc().num_usable_blocks()) {
    return {AdmitStatus::kNeverFits, held - pool.alloc().num_usable_blocks(), 0, 0};
  }
  const ResumePlan plan = plan_resume(host, pool, std::span<const Id>(s.host_blocks),
                                      s.host_blocks.size() / num_groups, hits);
  if (plan.pending) return {AdmitStatus::kTransferPending, 0, 0, 0};
  r.to_fill = plan.to_fill;
  const std::size_t available = pool.alloc().num_available_blocks() - plan.evictable_hits;
  if (r.to_fill + r.fresh > available) {
    return {AdmitStatus::kNoCapacity, r.to_fill + r.fresh - available, r.to_fill, r.fresh};
  }
  return r;
}

/// Resume (the commit of plan_resume, same `hits`): hold each device hit, allocate a device block per other entry
/// (`take(g)`) and queue its kSwapIn copy; writes the device blocks into `out` ([groups x nb], 0 for null
/// entries). Returns the tokens of the logical blocks some group copies back (a partial last block of a
/// `num_tokens`-token sequence counts its tokens only, blocks of `bs` tokens). Precondition: capacity for the
/// plan's to_fill blocks checked, room reserved for their allocations and copies. Nothing throws.
template <class Id, class Tier, class Pool, class Take>
[[gnu::noinline]] std::size_t resume(HostOffload<Id, Tier>& host, Pool& pool, CacheStats& stats,
                                     std::span<const Id> host_blocks, std::size_t nb, std::size_t num_tokens,
                                     std::size_t bs, std::span<const Id> hits, std::span<Id> out, Take&& take) {
  const std::size_t n = host_blocks.size();
  for (std::size_t j = 0; j < n; ++j) {
    if (hits[j] != Id{0}) pool.acquire_block(hits[j]);
  }
  for (std::size_t j = 0; j < n; ++j) {
    if (host_blocks[j] == Id{0}) continue;
    if (hits[j] != Id{0}) {
      out[j] = hits[j];
      continue;
    }
    const std::size_t g = j / nb;
    const Id dst = take(g);  // guaranteed by the capacity check
    const auto key = host.tier().index().hash_of(host_blocks[j]);
    const BlockHash h = key ? group_block_key(*key, g) : BlockHash{};
    host.queue_fill(pool, stats, dst, host_blocks[j], TransferKind::kSwapIn, key ? &h : nullptr,
                    /*src_pinned=*/false, g);
    out[j] = dst;
  }
  // Tokens of the logical blocks some group copies back, not blocks times block size: the last may be partial.
  const std::size_t groups = nb != 0 ? n / nb : 0;
  std::size_t host_tokens = 0;
  for (std::size_t i = 0; i < nb; ++i) {
    for (std::size_t g = 0; g < groups; ++g) {
      const std::size_t j = g * nb + i;
      if (host_blocks[j] == Id{0} || hits[j] != Id{0}) continue;
      host_tokens += std::min(bs, num_tokens - std::min(num_tokens, i * bs));
      break;
    }
  }
  return host_tokens;
}

/// Release a swapped sequence's holds on its host blocks (last block first) and working states.
template <class Id, class Tier>
[[gnu::noinline]] void release_swapped(HostOffload<Id, Tier>& host, std::span<const Id> host_blocks,
                                       std::span<const Id> states) {
  for (auto hb = host_blocks.rbegin(); hb != host_blocks.rend(); ++hb) {
    if (*hb != Id{0}) host.tier().release(*hb);
  }
  for (Id hb : states) {
    if (hb != Id{0}) host.tier().release(hb);
  }
}

}  // namespace pagedkv::detail
