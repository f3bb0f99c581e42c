// pagedkv/detail/miss_cause.hpp: why an admission's prefix hit ends where it ends (issue 20, "hits that explain
// themselves"): the cause the per-cause counters count and explain_admit reports, computed from the groups' windows
// and page factors and a tier probe (miss_point, cached_run_blocks, host_hit_tokens: no allocation), then named
// with the device pool's eviction history (classify_miss, admission_miss_cause) and spelled out in full
// (explain_admission: allocates). Pure: no manager state (docs/design.md "The manager in parts").
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <pagedkv/cache_config.hpp>  // CacheConfig
#include <pagedkv/eviction_history.hpp>  // EvictionRecord
#include <pagedkv/group_policy.hpp>
#include <pagedkv/hash.hpp>               // BlockHash, TokenId
#include <pagedkv/kernel_params.hpp>      // AttentionWindow
#include <pagedkv/manager_results.hpp>    // MissCause, AdmitExplanation, AdmitOptions
#include <pagedkv/prefix_hash_index.hpp>  // group_block_key
#include <pagedkv/request_keys.hpp>       // RequestKeys

namespace pagedkv::detail {

/// Where the hit of an admission stops: the cause, the first block that stops it and the group that misses it.
/// `group_missed`: a group misses `block` (cause kNotCached); the caller may turn it into kEvicted (its eviction
/// history has the block's key) or kKeyMismatch (cached without the extra keys).
struct MissPoint {
  MissCause cause = MissCause::kNone;
  std::size_t block = 0;
  std::uint32_t group = 0;
  bool group_missed = false;
};

/// Group g's pages hold `factors[g]` match blocks (empty span: every group's pages are one match block).
[[nodiscard]] inline bool coarse_group(std::span<const std::uint32_t> factors, std::size_t g) noexcept {
  return g < factors.size() && factors[g] > 1;
}

/// Why a hit of `k` blocks ends there, for a prompt of `full` full blocks whose walk was capped at `walk` blocks
/// (prefix caching on, full >= 1). `cached(g, i)`: group g has block i in a tier. The fixed point's hit k means
/// every group serves length k; at length k + 1 a group needs block k (unless its window starts after it) and the
/// blocks of its window below k, which length k needed already. So block k is probed once per group; the window's
/// lower blocks only when no group misses block k (not expected). A full-attention group's miss names the block k
/// (kNotCached); only windowed (or coarse) groups missing, while a full group holds block k, is kLimitedByGroup.
/// `windows`: [groups] the hit rule's windows (KVCacheGroupSpec::hit_window); `factors`: [groups] or empty, as
/// fixed_point_hit_blocks. Cost: one probe per group, plus the windows' lower blocks when none misses block k.
template <class Cached>
[[nodiscard]] MissPoint miss_point(std::span<const AttentionWindow> windows, std::span<const std::uint32_t> factors,
                                   std::uint32_t block_size, std::size_t full, std::size_t walk, std::size_t k,
                                   Cached&& cached) {
  MissPoint v;
  if (k >= full) return v;  // kNone
  const std::size_t G = windows.size();
  const std::size_t len = (k + 1) * block_size;
  constexpr std::size_t kNo = ~std::size_t{0};
  std::size_t full_miss = kNo, window_miss = kNo, window_block = k;
  bool any_full = false;
  for (std::size_t g = 0; g < G; ++g) {
    const bool windowed = windows[g].enabled() || coarse_group(factors, g);  // a coarse group limits like a window
    any_full = any_full || !windowed;
    if (first_kept_block(windows[g], len, block_size) > k || cached(g, k)) continue;
    if (!windowed && full_miss == kNo) full_miss = g;
    if (windowed && window_miss == kNo) window_miss = g;
  }
  for (std::size_t g = 0; g < G && full_miss == kNo && window_miss == kNo; ++g) {
    if (!windows[g].enabled()) continue;  // (a coarse group needs no block below k that length k lacked)
    for (std::size_t i = first_kept_block(windows[g], len, block_size); i < k; ++i) {
      if (!cached(g, i)) {
        window_miss = g;
        window_block = i;
        break;
      }
    }
  }
  if (full_miss == kNo && window_miss == kNo) {  // every group could serve block k: the cap stops the hit
    v.cause = MissCause::kCapped;
    if (k != walk) {  // (not expected: the fixed point would have taken block k)
      v.cause = MissCause::kNotCached;
      v.block = k;
    }
    return v;
  }
  if (full_miss == kNo && any_full) {
    v.cause = MissCause::kLimitedByGroup;
    v.group = static_cast<std::uint32_t>(window_miss);
    v.block = window_block;
    return v;
  }
  v.group = static_cast<std::uint32_t>(full_miss != kNo ? full_miss : window_miss);
  v.block = full_miss != kNo ? k : window_block;
  v.cause = MissCause::kNotCached;
  v.group_missed = true;
  return v;
}

/// Group g's cached run from block 0 in match blocks, for explain_admit: `cached(i)` for i < full says whether the
/// group has block i in a tier. A group of one match block per page: its run of cached blocks from block 0. A coarse
/// group (`factor` > 1 match blocks per page): its full pages cached from block 0 (each registered under its last
/// match block), then the longest entry inside the next page (a partial page is registered where its content ends).
template <class Cached>
[[nodiscard]] std::size_t cached_run_blocks(std::size_t full, std::size_t factor, Cached&& cached) {
  std::size_t run = 0;
  while (run < full && cached(run)) ++run;
  if (factor <= 1) return run;
  std::size_t c = 0;
  while ((c + 1) * factor <= full && cached((c + 1) * factor - 1)) ++c;
  run = c * factor;
  for (std::size_t m = std::min(full, (c + 1) * factor); m > c * factor; --m) {
    if (cached(m - 1)) return m;
  }
  return run;
}

/// Tokens of a hit of `k` blocks that the host tier serves: blocks i < k that some group needs (inside its window at
/// length k) and finds only on the host (`tier(g, i)` == 2; 1 = device, 0 = neither), one block_size each.
template <class Tier>
[[nodiscard]] std::size_t host_hit_tokens(std::span<const AttentionWindow> windows, std::uint32_t block_size,
                                          std::size_t k, Tier&& tier) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < k; ++i) {
    for (std::size_t g = 0; g < windows.size(); ++g) {
      if (i >= first_kept_block(windows[g], k * block_size, block_size) && tier(g, i) == 2) {
        n += block_size;
        break;
      }
    }
  }
  return n;
}

/// Why a hit of k blocks ends there, named (explain_admit and the counters share it): prefix caching off and
/// short prompts first, then miss_point; a group missing block `block` names the cause kEvicted, with its record,
/// when `history` (EvictionHistory) has the block's key (group_block_key(hashes[block], group)).
struct MissVerdict : MissPoint {
  std::optional<EvictionRecord> eviction;
};
/// classify_miss of a prompt of `full` full blocks (hashes `[>= full]`), its walk capped at `walk`, hit `k` blocks:
/// `cached(g, i)`: group g has block i in a tier. O(groups) probes (miss_point) plus one history lookup.
template <class History, class Cached>
[[nodiscard]] MissVerdict classify_miss(const GroupLayout& layout, const CacheConfig& config, const History& history,
                                        std::span<const BlockHash> hashes, std::size_t full, std::size_t walk,
                                        std::size_t k, Cached&& cached) {
  MissVerdict v;
  if (!config.enable_prefix_caching) {
    v.cause = MissCause::kPrefixCachingOff;
    return v;
  }
  if (full == 0) {
    v.cause = MissCause::kShortPrompt;
    return v;
  }
  static_cast<MissPoint&>(v) =
      miss_point(layout.windows, layout.coarse_factors(), config.block_size, full, walk, k, cached);
  if (v.group_missed && history.enabled()) {
    if ((v.eviction = history.find(group_block_key(hashes[v.block], v.group)))) v.cause = MissCause::kEvicted;
  }
  return v;
}

/// The miss cause of an admission of a `prompt_len`-token prompt (block hashes `hashes`, options `opts`) that hits
/// `k` blocks, for the per-cause counters (CacheConfig::count_miss_causes). `pool`: the DevicePool (its eviction
/// history); `host`: the HostOffload part (its two-tier probe `cached_at`). Out of line: the admission that calls
/// it stays small enough to inline its hashing.
template <class Pool, class Host>
[[nodiscard, gnu::noinline]] MissCause admission_miss_cause(const Pool& pool, const Host& host,
                                                            const GroupLayout& layout, const CacheConfig& config,
                                                            std::size_t prompt_len, std::span<const BlockHash> hashes,
                                                            std::size_t k, const AdmitOptions& opts) {
  const std::size_t bs = config.block_size;
  const std::size_t full = config.enable_prefix_caching ? prompt_len / bs : 0;
  const std::size_t cap = std::min(opts.max_cached_tokens.value_or(prompt_len - 1), prompt_len);
  const std::size_t walk = std::min(full, cap / bs);
  return classify_miss(layout, config, pool.history(), hashes, full, walk, k,
                       [&](std::size_t g, std::size_t i) { return host.cached_at(pool, hashes[i], g).tier != 0; })
      .cause;
}

/// explain_admit of a validated `prompt` (with `keys`, `opts`): the hit in tokens, how much of it the host tier
/// serves, each group's cached run from block 0 and the first cause that stops the hit (see
/// KVCacheManager::explain_admit). `pool`: the DevicePool (its prefix index hashes the prompt; its eviction
/// history); `host`: the HostOffload part (`cached_at`). Cost: one probe per (group, full block) in each tier, plus
/// hashing the prompt again without its extra keys when a miss could be a key mismatch. Allocates.
template <class Pool, class Host>
[[nodiscard]] AdmitExplanation explain_admission(const Pool& pool, const Host& host, const GroupLayout& layout,
                                                 const CacheConfig& config, std::span<const TokenId> prompt,
                                                 const RequestKeys* keys, const AdmitOptions& opts) {
  AdmitExplanation x;
  const std::size_t bs = config.block_size;
  const std::size_t G = layout.num_groups;
  x.prompt_tokens = prompt.size();
  x.cap_tokens = std::min(opts.max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
  x.group_cached_run_tokens.assign(G, 0);
  if (!config.enable_prefix_caching) {
    x.cause = MissCause::kPrefixCachingOff;
    return x;
  }
  const std::size_t full = prompt.size() / bs;
  if (full == 0) {
    x.cause = MissCause::kShortPrompt;
    return x;
  }
  std::vector<BlockHash> hashes;
  pool.index().hash_full_blocks(prompt, config.block_size, keys, hashes);
  // tier(g, i): 1 = device, 2 = host (ready), 0 = neither.
  const auto tier_of = [&](const std::vector<BlockHash>& hs, std::size_t g, std::size_t i) -> int {
    return host.cached_at(pool, hs[i], g).tier;
  };
  std::vector<std::uint8_t> tier(G * full);
  for (std::size_t g = 0; g < G; ++g) {
    for (std::size_t i = 0; i < full; ++i) tier[g * full + i] = static_cast<std::uint8_t>(tier_of(hashes, g, i));
    const std::size_t run = cached_run_blocks(full, layout.is_coarse(g) ? layout.coarse_factor(g) : 1,
                                              [&](std::size_t i) { return tier[g * full + i] != 0; });
    x.group_cached_run_tokens[g] = run * bs;
  }
  const auto cached = [&](std::size_t g, std::size_t i) { return tier[g * full + i] != 0; };
  const auto hit_blocks = [&](std::size_t max_blocks) {
    if (layout.simple) return std::min(max_blocks, x.group_cached_run_tokens[0] / bs);
    return fixed_point_hit_blocks(layout.windows, config.block_size, max_blocks, cached, layout.coarse_factors());
  };
  const std::size_t walk = std::min(full, x.cap_tokens / bs);
  const std::size_t k = hit_blocks(walk);
  x.hit_tokens = k * bs;
  x.host_hit_tokens = host_hit_tokens(layout.windows, config.block_size, k,
                                      [&](std::size_t g, std::size_t i) { return tier[g * full + i]; });
  const MissVerdict v = classify_miss(layout, config, pool.history(), hashes, full, walk, k, cached);
  x.cause = v.cause;
  x.first_miss_block = v.block;
  x.limiting_group = v.group;
  if (v.eviction) {
    x.evictions_since = pool.history().evictions(v.eviction->tier) - v.eviction->eviction_number - 1;
    x.eviction = v.eviction;
  }
  const std::size_t miss_group = v.group, miss_block = v.block;
  if (x.cause == MissCause::kNotCached && keys != nullptr && !keys->empty()) {  // cached without the extra keys?
    std::vector<BlockHash> plain;
    pool.index().hash_full_blocks(prompt.first((miss_block + 1) * bs), config.block_size, nullptr, plain);
    if (tier_of(plain, miss_group, miss_block) != 0) x.cause = MissCause::kKeyMismatch;
  }
  return x;
}

}  // namespace pagedkv::detail
