// pagedkv/detail/admission_plan.hpp: what an admission would take (issue 32, docs/design.md "The manager in parts"):
// the prefix hit (detail/hit_search.hpp) and what it costs each group as its kind, against the pool's usable and
// available blocks. Pure over the state passed in (the device pool, the host part, the layout, the config): the
// facade's try_admit / query_admit / lookup plan with it, and admit_prompt commits the plan. No manager state, no
// allocation once the scratch has grown. The includer includes the group kind headers (detail::visit_group).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/cache_config.hpp>     // CacheConfig
#include <pagedkv/detail/hit_search.hpp>
#include <pagedkv/error.hpp>          // raise
#include <pagedkv/external_kv.hpp>      // importable_tokens
#include <pagedkv/group_policy.hpp>     // GroupLayout, visit_group
#include <pagedkv/hash.hpp>             // BlockHash, TokenId
#include <pagedkv/manager_results.hpp>  // AdmitOptions, CapacityQuery
#include <pagedkv/request_keys.hpp>     // RequestKeys
#include <pagedkv/stats.hpp>            // CacheStats, PrefixCacheStats

namespace pagedkv::detail {

/// An admission's sparse window retention boundaries (AdmitOptions::prompt_retention_tokens, shared_prefix_boundary)
/// against a prompt of `prompt_len` tokens: throws kInvalidArgument naming the call `who`, the field and the value.
/// Checked on every admission (try_admit, try_admit_external), before anything changes.
inline void check_retention_boundaries(const AdmitOptions& opts, std::size_t prompt_len, const char* who) {
  const std::optional<std::size_t>& p = opts.prompt_retention_tokens;
  if (p && (*p == 0 || *p > prompt_len)) {
    raise(Errc::kInvalidArgument, std::string(who) + ": AdmitOptions.prompt_retention_tokens = " +
                                      std::to_string(*p) + ": must be in [1, " + std::to_string(prompt_len) +
                                      "] (the prompt's length)");
  }
  if (opts.shared_prefix_boundary > prompt_len) {
    raise(Errc::kInvalidArgument, std::string(who) + ": AdmitOptions.shared_prefix_boundary = " +
                                      std::to_string(opts.shared_prefix_boundary) + ": must be at most " +
                                      std::to_string(prompt_len) + " (the prompt's length)");
  }
}

/// The blocks after a hit of `k` match blocks that group g of an admission taking `external_tokens` more prompt
/// tokens from a fill (KVCacheManager::try_admit_external) does not take: a window group's blocks wholly before the
/// window of the first query it computes, at the fill's end: the hit + importable_tokens (the last prompt token is
/// computed here). The positions before it are filled elsewhere and no later query sees them, so those blocks are
/// null in the table from the admission on (vLLM's SlidingWindowManager pads an external load's skipped blocks with
/// its null block). 0 for the other kinds (a recurrent group holds states; a coarse group has no window). Pure.
[[nodiscard]] inline std::size_t window_external_skip(const GroupLayout& layout, std::size_t g, std::size_t k,
                                                      std::size_t prompt_len, std::size_t external_tokens) noexcept {
  if (layout.is_recurrent(g) || layout.is_coarse(g)) return 0;
  const std::size_t bs = layout.block_size;
  const std::size_t end = k * bs + importable_tokens(k * bs + external_tokens, prompt_len, k * bs);
  const std::size_t first = first_kept_block(layout.windows[g], end, static_cast<std::uint32_t>(bs));
  return first > k ? first - k : 0;
}

/// An admission's plan: what it would take (`query`) and what its commit needs (blocks and tokens).
struct AdmitPlan {
  CapacityQuery query;
  std::size_t num_reserved = 0;     ///< Uncached prompt tokens that get slots now.
  std::size_t num_host_hits = 0;    ///< Hit entries served by the host tier (each a device block + a swap_in).
  std::size_t hit_blocks = 0;       ///< k: logical blocks served by the cache.
  std::size_t host_hit_blocks = 0;  ///< Logical blocks of the hit some group serves from the host tier.
};

/// The plan of an admission over several groups or a windowed one (vLLM's hybrid KVCacheCoordinator): the hit
/// length is the fixed point over groups (detail::groups_hit), where group g has block i cached when its device
/// index holds the hash, or (with a host tier) the host tier holds the hash mixed with g, ready; a windowed group
/// takes only the blocks its first computed query sees. Each group's blocks after the hit as its kind counts them
/// (`admit_need`), less the blocks a fill of `external_tokens` leaves out (window_external_skip). kNeverFits: the
/// blocks the admission holds, or the blocks the prompt needs at least (each full group ceil(prompt_len /
/// block_size), each windowed group 1: `min_need`), exceed the pool. `pool`: the DevicePool; `host`: the
/// HostOffload part (its two-tier probe `cached_at`). Arguments as plan_admission.
template <class Id, class Pool, class Host>
AdmitPlan plan_groups(const Pool& pool, const Host& host, const GroupLayout& layout, const CacheConfig& config,
                      std::span<const TokenId> prompt, const RequestKeys* keys, const AdmitOptions& opts,
                      std::vector<BlockHash>& hashes, bool hashes_ready, HitScratch<Id>& sc,
                      std::size_t external_tokens) {
  const std::size_t G = layout.num_groups;
  const std::size_t bs = config.block_size;
  const std::size_t full = prompt.size() / bs;
  if (config.enable_prefix_caching && !hashes_ready) pool.index().hash_full_blocks(prompt, bs, keys, hashes);
  const std::size_t cap = std::min(opts.max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
  const std::size_t walk = config.enable_prefix_caching ? std::min(full, cap / bs) : 0;
  const HitCounts hit = groups_hit(
      layout, walk, [&](std::size_t g, std::size_t i) { return host.cached_at(pool, hashes[i], g); },
      [&](Id b) { return pool.alloc().is_cached(b); }, sc);
  const std::size_t k = hit.k;
  const std::size_t held_hits = hit.held, host_hits = hit.host, host_hit_blocks = hit.host_blocks;
  const std::size_t evictable = hit.evictable;
  const std::size_t reserved = std::min(opts.num_reserved_tokens.value_or(prompt.size()), prompt.size() - k * bs);
  std::size_t new_table_blocks = 0;  // per group as its kind: the blocks after the hit
  std::size_t lower_bound = 0;       // blocks the prompt needs at least, however it is reserved
  for (std::size_t g = 0; g < G; ++g) {
    visit_group<Id>(layout, g, [&](const auto& kind) {
      new_table_blocks += kind.admit_need(pool, k, reserved, std::span<const Id>(sc.hits).subspan(g * k, k));
      lower_bound += kind.min_need(prompt.size());
    });
    if (layout.is_state_table(g)) [[unlikely]] {  // a prefill checkpoint (vLLM's Mamba 'align', Mamba-2 layers)
      const std::size_t prompt_tokens = opts.prompt_retention_tokens.value_or(prompt.size());
      new_table_blocks += recurrent_group<Id>(layout, g).table().admit_checkpoints(
          k * bs, reserved, std::max(prompt_tokens, prompt.empty() ? 0 : prompt.size() - 1));
    }
    if (external_tokens != 0) new_table_blocks -= window_external_skip(layout, g, k, prompt.size(), external_tokens);
  }
  const std::size_t new_blocks = new_table_blocks + host_hits;
  const std::size_t usable = pool.alloc().num_usable_blocks();
  const std::size_t never = std::max(lower_bound, held_hits + new_table_blocks);
  AdmitPlan p{{CapacityStatus::kFits, new_blocks, 0, k * bs}, reserved, host_hits, k, host_hit_blocks};
  if (never > usable) {
    p.query.status = CapacityStatus::kNeverFits;
    p.query.num_missing_blocks = never - usable;
    return p;
  }
  const std::size_t available = pool.alloc().num_available_blocks() - evictable;
  if (new_blocks > available) {
    p.query.status = CapacityStatus::kNoCapacity;
    p.query.num_missing_blocks = new_blocks - available;
  }
  return p;
}

/// Plan an admission of a validated `prompt` (with `keys`, `opts`): the prompt's block hashes appended to `hashes`
/// (unless `hashes_ready`: a PreparedPrompt's, then `hashes` is only read), the hit blocks into `sc.hits` /
/// `sc.on_host`, what it would take (kNeverFits: more blocks than the pool has usable; kNoCapacity: more than are
/// available now, the hit's evictable blocks not counted as available). Pure. One full-attention group
/// (`layout.simple`): the pipelined walk over both tiers (detail::one_group_hit). Otherwise plan_groups. The search
/// finds the hit; what it costs each group is counted here. vLLM's KVCacheManager.get_computed_blocks +
/// allocate_slots' capacity check, as one pure call.
template <class Id, class Pool, class Host>
AdmitPlan plan_admission(const Pool& pool, const Host& host, const GroupLayout& layout, const CacheConfig& config,
                         std::span<const TokenId> prompt, const RequestKeys* keys, const AdmitOptions& opts,
                         std::vector<BlockHash>& hashes, bool hashes_ready, HitScratch<Id>& sc,
                         std::size_t external_tokens = 0) {
  if (!layout.simple) {
    return plan_groups(pool, host, layout, config, prompt, keys, opts, hashes, hashes_ready, sc, external_tokens);
  }
  const std::size_t bs = config.block_size;
  const std::size_t total_blocks = (prompt.size() + bs - 1) / bs;
  const std::size_t usable = pool.alloc().num_usable_blocks();
  sc.hits.clear();
  sc.on_host.clear();
  if (total_blocks > usable) {
    return {{CapacityStatus::kNeverFits, total_blocks, total_blocks - usable, 0}, 0, 0, 0, 0};
  }
  const std::size_t full = config.enable_prefix_caching ? prompt.size() / bs : 0;
  const std::size_t cap = std::min(opts.max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
  const std::size_t walk = std::min(full, cap / bs);
  const HitCounts hit = one_group_hit(pool.index(), host.get(), prompt, bs, full, walk, keys, hashes, hashes_ready,
                                      [&](Id b) { return pool.alloc().is_cached(b); }, sc);
  const std::size_t evictable_hits = hit.evictable;
  const std::size_t host_hits = hit.host;
  const std::size_t k = hit.k;
  const std::size_t cached = k * bs;
  const std::size_t reserved = std::min(opts.num_reserved_tokens.value_or(prompt.size()), prompt.size() - cached);
  // Device blocks: one per host hit (its onboarding destination) plus the new ones.
  const std::size_t new_blocks = (cached + reserved + bs - 1) / bs - k + host_hits;
  const std::size_t available = pool.alloc().num_available_blocks() - evictable_hits;
  if (new_blocks > available) {
    return {{CapacityStatus::kNoCapacity, new_blocks, new_blocks - available, cached}, reserved, host_hits, k,
            host_hits};
  }
  return {{CapacityStatus::kFits, new_blocks, 0, cached}, reserved, host_hits, k, host_hits};
}

/// Count an admitted prompt of `prompt_len` tokens that hit `hit_tokens` (`host_hit_tokens` of them from the host
/// tier) in `stats` and `interval` (vLLM's PrefixCacheStats); `readmission`: the request was preempted before.
inline void count_admission(CacheStats& stats, PrefixCacheStats& interval, std::size_t prompt_len,
                            std::size_t hit_tokens, std::size_t host_hit_tokens, bool readmission) noexcept {
  ++stats.prefix_query_requests;
  stats.prefix_query_tokens += prompt_len;
  if (hit_tokens > 0) ++stats.prefix_hit_requests;
  stats.prefix_hit_tokens += hit_tokens;
  stats.host_hit_tokens += host_hit_tokens;
  if (readmission) {
    ++stats.readmitted_requests;
    stats.readmitted_query_tokens += prompt_len;
    stats.readmitted_hit_tokens += hit_tokens;
  }
  interval.record(prompt_len, hit_tokens, readmission);
}

}  // namespace pagedkv::detail
