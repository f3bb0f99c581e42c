// pagedkv/detail/hit_search.hpp: the admission's prefix hit over both tiers (issue 32, docs/design.md "The manager in
// parts"): the pipelined walk of one full-attention group and the fixed point over groups (vLLM's hybrid
// KVCacheCoordinator). Pure functions over the state passed in (the prefix index, the host tier, a tier probe, an
// evictability test): they find the hit and count its blocks; what the hit costs each group (its capacity) is the
// caller's, since it depends on the group's kind. No manager state, no allocation once the scratch has grown.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include <pagedkv/group_policy.hpp>  // GroupLayout, first_kept_block, fixed_point_hit_blocks
#include <pagedkv/hash.hpp>          // BlockHash, TokenId
#include <pagedkv/request_keys.hpp>  // RequestKeys

namespace pagedkv::detail {

/// Where a group's block is cached: tier 1 = the device pool (block: its device block), 2 = a ready host block
/// (block: the host block), 0 = neither (block 0).
template <class Id>
struct CachedAt {
  std::uint8_t tier = 0;
  Id block = 0;
};

/// An admission's hits: [groups x hit blocks] group-major (0 = a null entry: before a windowed group's window, or a
/// coarse group's match block where no page ends), with on_host[j]: entry j is a host-tier block, to be onboarded.
/// Plus the fixed point's scratch. Reused across admissions: no allocation once grown.
template <class Id>
struct HitScratch {
  std::vector<Id> hits;
  std::vector<bool> on_host;
  std::vector<Id> found;             // fixed point: [groups x walk] the cached block (0 = miss)
  std::vector<std::uint8_t> looked;  // [groups x walk] 0 = not looked up, 1 = device, 2 = host, 3 = miss
  std::vector<std::uint32_t> run;
};

/// What a hit search found (blocks): the hit `k` (match blocks every group serves), the entries the admission
/// will hold, the device entries an admission takes out of the evictor (they leave the available count), the host
/// entries (each needs a device block and an onboarding copy) and the match blocks some group serves from the host.
struct HitCounts {
  std::size_t k = 0;
  std::size_t held = 0;
  std::size_t evictable = 0;
  std::size_t host = 0;
  std::size_t host_blocks = 0;
};

/// One full-attention group's hit: blocks [0, k) of the prompt cached in the device index `index`, or (when `host`
/// is not null) ready in the host tier, k the first miss in both tiers within the first `walk` blocks. Unless
/// `hashes_ready`, the prompt's `full` block hashes are appended to `hashes` as it walks, pipelined: the home group
/// of block i's hash is prefetched while block i + 1 is hashed; with ready hashes, block j + 1 is prefetched while
/// block j is looked up. Hits go to `sc.hits` / `sc.on_host` (k entries). `evictable(b)`: device block b sits in
/// the evictor. Preconditions: walk <= full <= prompt.size() / block_size; hashes holds `full` hashes if
/// hashes_ready, else is empty.
template <class Index, class Host, class Evictable, class Id>
[[gnu::always_inline]] inline HitCounts one_group_hit(const Index& index, const Host* host,
                                                      std::span<const TokenId> prompt, std::size_t block_size,
                                                      std::size_t full, std::size_t walk, const RequestKeys* keys,
                                                      std::vector<BlockHash>& hashes, bool hashes_ready,
                                                      Evictable&& evictable, HitScratch<Id>& sc) {
  std::vector<Id>& hits = sc.hits;
  std::vector<bool>& on_host = sc.on_host;
  const std::size_t bs = block_size;
  HitCounts c;
  bool walking = walk > 0;
  const auto look = [&](std::size_t j) {  // block j of the walk, in order, until the first miss in both tiers
    if (!walking) return;
    if (j >= walk) {
      walking = false;
      return;
    }
    if (const auto b = index.find(hashes[j])) {
      hits.push_back(*b);
      on_host.push_back(false);
      if (evictable(*b)) ++c.evictable;
      return;
    }
    if (host) {
      if (const auto hb = host->find_ready(hashes[j])) {
        hits.push_back(*hb);
        on_host.push_back(true);
        ++c.host;
        return;
      }
    }
    walking = false;
  };
  if (!hashes_ready) {
    hashes.reserve(full);
    for (std::size_t i = 0; i < full; ++i) {
      const BlockHash& parent = i == 0 ? index.root() : hashes[i - 1];
      hashes.push_back(index.hash_block(parent, prompt.subspan(i * bs, bs), i * bs, keys));
      if (walking && i < walk) index.prefetch(hashes[i]);
      if (i > 0) look(i - 1);
    }
    if (full > 0) look(full - 1);
  } else {
    for (std::size_t j = 0; j < walk && walking; ++j) {
      if (j + 1 < walk) index.prefetch(hashes[j + 1]);
      look(j);
    }
  }
  c.k = hits.size();
  c.held = c.k;
  c.host_blocks = c.host;
  return c;
}

/// lookup's walk of one full-attention group: the cached prefix of `prompt` (with `keys`) in tokens, whole blocks
/// [0, i) each in the device index `index` or (when `host` is not null) ready in the host tier, within the first
/// `cap_tokens / block_size` blocks. Hashes as it walks and stops at the first miss in both tiers (no prefetch, no
/// hash kept: nothing allocated). Pure. Precondition: cap_tokens <= prompt.size().
template <class Index, class Host>
[[nodiscard]] std::size_t one_group_lookup(const Index& index, const Host* host, std::span<const TokenId> prompt,
                                           std::size_t block_size, std::size_t cap_tokens, const RequestKeys* keys) {
  const std::size_t bs = block_size;
  BlockHash parent = index.root();
  std::size_t i = 0;
  for (; i < cap_tokens / bs; ++i) {
    parent = index.hash_block(parent, prompt.subspan(i * bs, bs), i * bs, keys);
    if (!index.find(parent) && !(host && host->find_ready(parent))) break;
  }
  return i * bs;
}

/// The hit over the groups of `layout` (vLLM's hybrid KVCacheCoordinator): the fixed point k <= `walk` where every
/// group g has every block it needs cached (fixed_point_hit_blocks), group g having block i when `probe(g, i)`
/// (a CachedAt<Id>: device first, then a ready host block) says a tier holds it; each (group, block) is probed at
/// most once. A windowed group takes only the blocks its first computed query sees; a coarse group takes a page
/// only where it ends (or where the hit ends). Hits go to `sc.hits` / `sc.on_host` ([groups x k], group-major).
/// `evictable(b)`: device block b sits in the evictor.
template <class Probe, class Evictable, class Id>
HitCounts groups_hit(const GroupLayout& layout, std::size_t walk, Probe&& probe, Evictable&& evictable,
                     HitScratch<Id>& sc) {
  const std::size_t G = layout.num_groups;
  const std::size_t bs = layout.block_size;
  sc.found.assign(G * walk, Id{0});
  sc.looked.assign(G * walk, 0);
  const auto look = [&](std::size_t g, std::size_t i) {  // 1 device, 2 host, 3 miss; looked up once each
    std::uint8_t& l = sc.looked[g * walk + i];
    if (l == 0) {
      const CachedAt<Id> c = probe(g, i);
      sc.found[g * walk + i] = c.block;
      l = c.tier != 0 ? c.tier : 3;
    }
    return l;
  };
  HitCounts c;
  const std::size_t k = fixed_point_hit_blocks(
      layout.windows, layout.block_size, walk, [&](std::size_t g, std::size_t i) { return look(g, i) != 3; }, sc.run,
      layout.coarse_factors());
  c.k = k;
  sc.hits.assign(G * k, Id{0});
  sc.on_host.assign(G * k, false);
  for (std::size_t i = 0; i < k; ++i) {
    bool any_host = false;
    for (std::size_t g = 0; g < G; ++g) {
      if (i < first_kept_block(layout.windows[g], k * bs, layout.block_size)) continue;
      if (layout.is_coarse(g) && (i + 1) % layout.coarse_factor(g) != 0 && i + 1 != k) continue;  // no page ends at i
      const std::uint8_t l = look(g, i);
      sc.hits[g * k + i] = sc.found[g * walk + i];
      ++c.held;
      if (l == 2) {
        sc.on_host[g * k + i] = true;
        ++c.host;
        any_host = true;
      } else if (evictable(sc.found[g * walk + i])) {
        ++c.evictable;
      }
    }
    c.host_blocks += any_host ? 1 : 0;
  }
  return c;
}

}  // namespace pagedkv::detail
