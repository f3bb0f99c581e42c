// pagedkv/events_zmq/group_specs.hpp: vLLM's `kv_cache_spec_kind` / `kv_cache_spec_sliding_window` of a
// KVCacheManager's groups, for EncodeOptions::group_specs.
#pragma once

#include <vector>

#include <pagedkv/events_zmq/wire.hpp>
#include <pagedkv/kv_cache_groups.hpp>  // CacheConfig (HybridCacheConfig)

namespace pagedkv::events {

/// One GroupSpec per group of `config`, in group order, with vLLM's KVCacheSpecKind values: kFull ->
/// "full_attention" (no window), kSlidingWindow -> "sliding_window" with its window W in tokens, kChunkedLocal ->
/// "chunked_local_attention" with its chunk C in tokens (vLLM's ChunkedLocalAttentionSpec; pagedkv writes the
/// chunk where vLLM has no field of its own: a consumer that reads the window only for "sliding_window" ignores
/// it), kRecurrent -> "mamba" (vLLM's MambaSpec; its checkpoints are stored blocks of that group, keyed by the hash
/// of the blocks before them). A config without groups is one full-attention group. Allocates the result.
[[nodiscard]] inline std::vector<GroupSpec> group_specs(const CacheConfig& config) {
  std::vector<GroupSpec> out;
  if (config.groups.empty()) out.push_back({"full_attention", std::nullopt});
  out.reserve(config.groups.size());
  for (const KVCacheGroupSpec& g : config.groups) {
    switch (g.kind) {
      case AttentionKind::kFull: out.push_back({"full_attention", std::nullopt}); break;
      case AttentionKind::kSlidingWindow: out.push_back({"sliding_window", g.window_tokens}); break;
      case AttentionKind::kChunkedLocal: out.push_back({"chunked_local_attention", g.window_tokens}); break;
      case AttentionKind::kRecurrent: out.push_back({"mamba", std::nullopt}); break;
    }
  }
  return out;
}

}  // namespace pagedkv::events
