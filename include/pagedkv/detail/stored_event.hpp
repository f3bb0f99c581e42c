// pagedkv/detail/stored_event.hpp: the self-contained kBlockStored event of one full block, shared by the managers
// (KVCacheManager, HybridKVCacheManager) so every event carries the same fields.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include <pagedkv/events.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/request_keys.hpp>

namespace pagedkv::detail {

/// Fill `e` (a fresh kBlockStored event) for full block `i` of a sequence: its hash `h`, its parent (block i - 1's
/// hash, none for block 0), its `block_size` token ids from `tokens`, position, adapter, the multimodal items
/// overlapping it and the request's salt (on every block: only block 0 mixes it into its hash, but a router that
/// seeds every block's key with it, as Dynamo does, needs it on every event; issue 21), so a consumer can
/// recompute `h` (rehash_stored_event).
/// Preconditions: tokens.size() >= (i + 1) * block_size, hashes.size() >= i.
inline void fill_stored_event(KVEvent& e, const BlockHash& h, std::size_t i, std::uint32_t block_size,
                              std::span<const TokenId> tokens, std::span<const BlockHash> hashes,
                              const RequestKeys* keys) {
  const std::size_t bs = block_size;
  e.hash = h;
  if (i > 0) e.parent_hash = hashes[i - 1];
  e.token_ids.assign(tokens.begin() + static_cast<std::ptrdiff_t>(i * bs),
                     tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * bs));
  e.block_size = block_size;
  e.block_start = i * bs;
  if (keys != nullptr) {
    e.adapter_id = keys->adapter_id;
    for (const auto& m : keys->multimodal) {
      if (item_overlaps(m, i * bs, (i + 1) * bs)) e.multimodal_items.push_back(m);
    }
    e.salt = keys->salt;
  }
}

}  // namespace pagedkv::detail
