// pagedkv/events.hpp: KV-cache events for KV-aware routers, and the manager's counters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/hash.hpp>

namespace pagedkv {

/// Kind of a KV-cache event (vLLM's KVEventBatch: BlockStored / BlockRemoved / AllBlocksCleared).
enum class KVEventType : std::uint8_t {
  kBlockStored = 0,  ///< A full block was registered in the prefix cache.
  kBlockRemoved = 1, ///< A registered block was evicted (its hash dropped).
  kAllCleared = 2,   ///< reset_prefix_cache() dropped every hash.
};

/// One KV-cache event. `seq_no` increases by one per event over the manager's lifetime (gaps in a drained stream
/// mean nothing; there are none). For kBlockStored every field is set: the block's hash, its parent hash
/// (nullopt for a sequence's first block), its token ids `[block_size]`, and the request's adapter id and
/// multimodal item hashes overlapping the block; for kBlockRemoved only `hash`; for kAllCleared nothing.
struct KVEvent {
  std::uint64_t seq_no = 0;
  KVEventType type = KVEventType::kBlockStored;
  BlockHash hash;
  std::optional<BlockHash> parent_hash;
  std::vector<TokenId> token_ids;
  std::uint64_t adapter_id = 0;
  std::vector<BlockHash> multimodal_item_hashes;
};

/// Counters of a KVCacheManager (vLLM's PrefixCacheStats + KVCacheManager usage). Block counts exclude the null
/// block; `usage` = blocks_used / usable blocks. Prefix counters are updated on successful admission only, so
/// retries after "no capacity now" do not inflate them.
struct CacheStats {
  std::size_t num_usable_blocks = 0;
  std::size_t blocks_used = 0;    ///< refcount > 0
  std::size_t blocks_cached = 0;  ///< refcount 0, hashed (evictable)
  std::size_t blocks_free = 0;    ///< refcount 0, unhashed
  double usage = 0.0;
  std::uint64_t prefix_query_requests = 0;
  std::uint64_t prefix_hit_requests = 0;  ///< admissions with at least one cached block
  std::uint64_t prefix_query_tokens = 0;  ///< prompt tokens admitted
  std::uint64_t prefix_hit_tokens = 0;    ///< of which found in the cache
  std::uint64_t evictions = 0;
  std::uint64_t cow_copies = 0;
  std::uint64_t dedup_blocks = 0;  ///< newly full blocks switched to an identical cached block
  std::uint64_t preemptions = 0;
  std::uint64_t block_ops = 0;     ///< allocations + acquires + releases, one per block
};

}  // namespace pagedkv
