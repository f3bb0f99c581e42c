// pagedkv/kv_cache_groups.hpp: the spellings of the hybrid (several KV-cache groups) manager from before the
// managers merged (issue 17). KVCacheManager is the one manager: a plain full-attention pool is its one-group case,
// a hybrid model (full + sliding-window + chunked-local groups) configures CacheConfig::groups. Group policies and
// the prefix-hit fixed point are in group_policy.hpp; docs/groups.md describes them.
#pragma once

#include <cstdint>

#include <pagedkv/block_table.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace pagedkv {

/// The configuration of a pool shared by several KV-cache groups: CacheConfig (its `groups`, `page_size_bytes`).
using HybridCacheConfig = CacheConfig;

/// The outcome of a growth of a sequence of a manager with groups: AppendResult (`num_new_blocks` over all groups;
/// `slots` and `copy` are group 0's).
using HybridGrowthResult = AppendResult<std::uint32_t>;

/// A pending copy-on-write of a group: BlockCopy (its `group`).
template <BlockIdType Id = std::uint32_t>
using GroupBlockCopy = BlockCopy<Id>;

/// The manager of several KV-cache groups: KVCacheManager (LRU eviction by default, as before the merge; every
/// eviction policy and the host tier work with groups too).
template <BlockHasher Hasher = Sha256Hasher, BlockIdType Id = std::uint32_t>
using HybridKVCacheManager = KVCacheManager<Hasher, Id>;

}  // namespace pagedkv
