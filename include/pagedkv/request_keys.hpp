// pagedkv/request_keys.hpp: the per-request extra keys mixed into block hashes (adapter, multimodal items, salt),
// and their validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <pagedkv/error.hpp>
#include <pagedkv/hash.hpp>

namespace pagedkv {

/// A multimodal input (image, audio clip) whose embeddings occupy prompt positions
/// [offset_tokens, offset_tokens + length_tokens). `item_hash` identifies its content (e.g. a hash of the pixels,
/// as vLLM's mm_hash does). Every block overlapping the item mixes (item_hash, offset of the item relative to the
/// block start) into its hash, so equal token ids with different images never share a block.
/// Valid items (checked at admission by `validate_request_keys`): length_tokens >= 1 and the whole range inside
/// the prompt, offset_tokens + length_tokens <= prompt length (no wrap past 2^64). Positions after the prompt
/// (decoded tokens) never carry multimodal items.
struct MultimodalItem {
  BlockHash item_hash;
  std::uint64_t offset_tokens = 0;
  std::uint64_t length_tokens = 0;
};

/// Per-request extra keys mixed into block hashes (vLLM's "extra keys"): the LoRA adapter id (0 = base model), the
/// request's multimodal items (sorted by offset), and a tenant salt mixed into the first block only, so requests
/// with different salts never share any block (vLLM's cache_salt).
struct RequestKeys {
  std::uint64_t adapter_id = 0;
  std::vector<MultimodalItem> multimodal;
  std::string salt;

  /// True when no key is set (the common case; hashing then skips the per-item scan).
  [[nodiscard]] bool empty() const noexcept { return adapter_id == 0 && multimodal.empty() && salt.empty(); }
};

/// Check `keys` for a prompt of `prompt_len` tokens: every multimodal item has length >= 1, lies wholly inside the
/// prompt (offset + length <= prompt_len, computed without overflow) and the items are sorted by offset
/// (non-decreasing). `keys` may be null. Throws kInvalidArgument naming the item index and its range; changes
/// nothing. O(items).
inline void validate_request_keys(const RequestKeys* keys, std::size_t prompt_len, const char* what) {
  if (keys == nullptr) return;
  std::uint64_t prev_offset = 0;
  for (std::size_t i = 0; i < keys->multimodal.size(); ++i) {
    const MultimodalItem& m = keys->multimodal[i];
    const auto range = [&] {
      return std::string(what) + ": multimodal item " + std::to_string(i) + " at offset " +
             std::to_string(m.offset_tokens) + " with length " + std::to_string(m.length_tokens);
    };
    if (m.length_tokens == 0) detail::raise(Errc::kInvalidArgument, range() + " is empty (length 0)");
    if (m.offset_tokens > prompt_len || m.length_tokens > prompt_len - m.offset_tokens) {
      detail::raise(Errc::kInvalidArgument, range() + " does not lie inside the prompt of " +
                                                std::to_string(prompt_len) + " tokens");
    }
    if (m.offset_tokens < prev_offset) {
      detail::raise(Errc::kInvalidArgument, range() + " is not sorted by offset (previous item at " +
                                                std::to_string(prev_offset) + ")");
    }
    prev_offset = m.offset_tokens;
  }
}

}  // namespace pagedkv
