// pagedkv/events.hpp: KV-cache events for KV-aware routers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/stats.hpp>  // CacheStats used to live here

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

}  // namespace pagedkv
