// pagedkv/events.hpp: KV-cache events for KV-aware routers (vLLM's KVEventBatch: BlockStored / BlockRemoved /
// AllBlocksCleared), carrying everything a consumer needs to recompute a stored block's hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/request_keys.hpp>
#include <pagedkv/stats.hpp>  // CacheStats used to live here

namespace pagedkv {

/// Kind of a KV-cache event (vLLM's BlockStored / BlockRemoved / AllBlocksCleared).
enum class KVEventType : std::uint8_t {
  kBlockStored = 0,  ///< A full block became hit-able in a tier (registered in the prefix index).
  kBlockRemoved = 1, ///< A block left a tier (evicted, its hash dropped there).
  kAllCleared = 2,   ///< reset_prefix_cache() dropped every hash.
};

/// The memory tier holding a block (vLLM's `medium`: "GPU", "CPU").
enum class Medium : std::uint8_t {
  kGpu = 0,  ///< The device pool the kernels read.
  kCpu = 1,  ///< A host-memory tier (offloaded blocks).
};

/// vLLM's spelling of a medium: "GPU" or "CPU". Never null.
[[nodiscard]] constexpr const char* to_string(Medium m) noexcept { return m == Medium::kCpu ? "CPU" : "GPU"; }

/// One KV-cache event.
///
/// `seq_no` increases by one per event over the manager's lifetime. For kBlockStored every field is set, so a
/// consumer can recompute `hash` from the event alone (`rehash_stored_event` in prefix_hash_index.hpp, or the
/// canonical encoding of docs/design.md "Block hashes" with the pool's hasher and seed):
///   hash = H(parent_hash or the pool's root, token_ids, adapter_id, multimodal items overlapping the block with
///            offsets relative to block_start, salt if block_start == 0; `salt` is set on every block).
/// For kBlockRemoved: hash, medium, group. For kAllCleared: medium (the tier cleared).
struct KVEvent {
  std::uint64_t seq_no = 0;
  KVEventType type = KVEventType::kBlockStored;
  BlockHash hash;
  std::optional<BlockHash> parent_hash;  ///< nullopt for a sequence's first block (its parent is the pool root).
  std::vector<TokenId> token_ids;        ///< `[block_size]` token ids of the block.
  std::uint32_t block_size = 0;          ///< Tokens per block of the pool.
  std::uint64_t block_start = 0;         ///< Position of the block's first token in its sequence (tokens).
  std::uint64_t adapter_id = 0;          ///< LoRA adapter (0 = base model).
  std::vector<MultimodalItem> multimodal_items;  ///< Items overlapping the block (absolute prompt offsets).
  std::string salt;                      ///< The request's cache salt, on every block of the sequence; only the
                                         ///< first block (block_start 0) mixes it into its hash.
  Medium medium = Medium::kGpu;          ///< Tier the block entered or left.
  std::uint32_t group = 0;               ///< KV-cache group (0 while a manager has one group).
};

/// The events of one engine step (vLLM's KVEventBatch), numbered 1, 2, 3, ... per manager. `ts` is the caller's
/// timestamp (vLLM: seconds since the epoch, as a double).
struct KVEventBatch {
  std::uint64_t seq_no = 0;
  double ts = 0.0;
  std::vector<KVEvent> events;
};

}  // namespace pagedkv
