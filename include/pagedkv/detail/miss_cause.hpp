// pagedkv/detail/miss_cause.hpp: why an admission's prefix hit ends where it ends (issue 20, "hits that explain
// themselves"): the cause the per-cause counters count and explain_admit reports, computed from the groups' windows
// and page factors and a tier probe, nothing else. Pure: no manager state, no allocation (docs/design.md "The
// manager in parts").
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

#include <pagedkv/group_policy.hpp>
#include <pagedkv/kernel_params.hpp>    // AttentionWindow
#include <pagedkv/manager_results.hpp>  // MissCause

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

}  // namespace pagedkv::detail
