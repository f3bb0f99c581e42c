// pagedkv/cache_config.hpp: the configuration of a KV-cache manager's pool, its KV-cache groups and its host tier,
// and its validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <pagedkv/batch_metadata.hpp>  // detail::check_metadata_value
#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/group_policy.hpp>

namespace pagedkv {

/// When the manager copies cached device blocks to the host tier (TensorRT-LLM's and SGLang HiCache's two modes).
enum class OffloadPolicy : std::uint8_t {
  kNone = 0,          ///< Never: the host tier only receives swapped-out sequences.
  kWriteBack = 1,     ///< When a cached block is evicted from the device pool (one copy per eviction).
  kWriteThrough = 2,  ///< As soon as a block is registered (its copy is issued by the next build), and at eviction
                      ///< if it is not on the host yet.
};

/// How `preempt` frees a running sequence's device blocks (vLLM SOSP'23 sec. 4.5).
enum class PreemptMode : std::uint8_t {
  kRecompute = 0,  ///< Drop them (full blocks stay cached); the engine re-admits the request and recomputes.
  kSwap = 1,       ///< Copy them to the host tier; `try_resume` copies them back. Needs a host tier.
};

/// Configuration of one KV pool and the KV-cache groups that share it (HybridCacheConfig is this type).
///
/// Memory model with several groups (vLLM's hybrid allocator): one block id per (group, logical block) of a
/// sequence; a block holds `block_size` tokens of K and V for one page per layer slot: `page_size_bytes` per layer
/// and max_g(num_layers) layer slots, so every block has the same size (`KVCacheManager::bytes_per_block()`). A
/// recurrent group's state (or checkpoint) takes one block, one layer's state per layer slot: a layer slot is
/// max(page_size_bytes, every recurrent group's state_bytes) bytes (vLLM's page-size unification; docs/groups.md).
struct CacheConfig {
  std::size_t num_blocks = 0;                     ///< Pool size in blocks, including the null block 0: [2, 2^31].
  std::uint32_t block_size = kDefaultBlockSize;   ///< Tokens per block: [1, kMaxBlockSize]. Kernels must see the
                                                  ///< same value: make their pool view with make_kv_pool_view.
  bool enable_prefix_caching = true;              ///< Hash full blocks and reuse them across requests.
  std::uint64_t hash_seed = 0;                    ///< Per-pool chain seed (the root of every block-hash chain).
  std::size_t max_tokens_per_seq = 0;             ///< Per-sequence limit (max model length), <= 2^31 - 1; 0 = the
                                                  ///< int32 limit of `seq_lens` (kMaxMetadataValue).
  bool enable_events = false;                     ///< Record KVEvents for drain_events().
  std::size_t num_host_blocks = 0;                ///< Host tier size in blocks, including its null block 0:
                                                  ///< 0 = no host tier, else [2, 2^31].
  OffloadPolicy offload = OffloadPolicy::kWriteBack;  ///< With a host tier: when cached blocks are copied there.
  /// Write-back offloads only evicted blocks whose retention priority is at least this (TensorRT-LLM's secondary
  /// offload minimum priority); 0 = every evicted block. Needs a RetentionEvictionPolicy to matter (every block
  /// has kDefaultRetentionPriority under the others).
  std::uint8_t min_offload_priority = 0;
  /// KV-cache groups sharing the pool, [0, kMaxGroups]; group g is index g in every API. Empty = one
  /// full-attention group (a plain pool).
  std::vector<KVCacheGroupSpec> groups;
  std::size_t page_size_bytes = 0;  ///< Bytes of one layer's K+V page of block_size tokens (0: no byte accounting).
  /// Slots of the eviction history (device and host tiers together), so that a miss can tell "evicted" from
  /// "never stored" (MissCause::kEvicted, explain_admit, the counters); 0 = off. Direct-mapped (EvictionHistory):
  /// an eviction survives n later ones with probability about e^(-n / eviction_history); 16 bytes per slot,
  /// allocated at construction; one store per eviction while on. At most 2^30.
  std::size_t eviction_history = 0;
  /// Count every admission's miss cause in CacheStats::admissions_by_miss_cause: per admitted request one probe per
  /// group of the block after the hit (each tier) and, with eviction_history, one history lookup. Off: no cost.
  bool count_miss_causes = false;
  /// When windowed and recurrent groups drop the blocks no later query needs (the release rule, docs/groups.md):
  /// true, at the end of the build that computed past them (this step's kernels still read them; only later
  /// allocations reuse them); false, only at `KVCacheManager::release_skipped_blocks(seq)` (and free / preempt), for
  /// a caller that hands the block table to its kernels after the build, as vLLM's worker reads it from
  /// `get_blocks` after `allocate_slots` (vLLM frees skipped blocks at the request's next allocation,
  /// SingleTypeKVCacheManager.remove_skipped_blocks). An external fill's completion releases either way.
  bool release_at_build = true;
  /// Sparse prefix-cache retention of sliding-window groups (vLLM 0.32's `prefix_cache_retention_interval`, whose
  /// engine default is 0; docs/vllm-swa-retention.md). Unset (default): a sliding-window group registers every full
  /// block that can serve a hit. Set to I tokens: it registers only the blocks a later hit can land after, the
  /// ceil((W - 1) / block_size) blocks ending at each multiple of I (none for I = 0) and at each sequence's
  /// retention boundaries (its replay boundary, prompt length - 1, and its shared-prefix junction: AdmitOptions),
  /// aligned down to window_retention_alignment (WindowRetention). Fewer window blocks stay cached; a hit that does
  /// not end at such a point misses the window group. A recurrent group with its states in its table
  /// (KVCacheGroupSpec::state_in_table, vLLM's Mamba 'align') follows the same rule with one block per landing point
  /// (vLLM's MambaManager.reachable_block_mask). Full-attention, chunked-local, coarse and other recurrent groups are
  /// unaffected. I must be a multiple of the alignment.
  std::optional<std::size_t> window_retention_interval = std::nullopt;
  /// Tokens the retention boundaries align down to (vLLM's hit alignment, the scheduler block size: an engine whose
  /// hits end only at multiples of it); 0 = block_size. A multiple of block_size, at most 2^31 - 1.
  std::size_t window_retention_alignment = 0;
  /// A full block whose content another registered block holds already (two sequences computed the same prefix
  /// at once, or a sequence recomputed blocks a shorter hit left out) is switched to that block when a build
  /// registers it, and its own copy released (CacheStats::dedup_blocks): true (default). False keeps every
  /// sequence's block ids as they were handed out, the duplicate unregistered (as vLLM keeps both copies): for an
  /// engine whose workers keep their own append-only copy of the block tables, as vLLM's do (pagedkv.vllm sets
  /// it), a switched block would be read after its release.
  bool deduplicate_blocks = true;
  /// With window_retention_interval set: the engine drafts with EAGLE and every sliding-window group is an EAGLE
  /// group (vLLM's `use_eagle`: its lookup matches one block past a hit, then drops it). Each such group's tails are
  /// one block longer and end one block later, the replay boundaries are EAGLE's two (one alignment below the
  /// aligned prompt length - 1 and below the aligned prompt length; vLLM's replay_boundaries, whose step is the
  /// scheduler block size: exact when window_retention_alignment is that size, as pagedkv.vllm sets it), and a build
  /// examines one block past the alignment horizon (vLLM's get_num_cacheable_tokens for an EAGLE group). False
  /// (default): no EAGLE. Unused without window_retention_interval.
  bool window_retention_eagle = false;
};

namespace detail {

/// `c` if it is a valid configuration with at most `max_groups` groups, else throws kInvalidArgument (num_blocks < 2,
/// a block_size outside [1, kMaxBlockSize], num_host_blocks = 1, too many groups, a full group with window_tokens
/// != 0, a windowed or recurrent group with window_tokens 0 or > 2^31 - 1, a recurrent group 0 or with a checkpoint
/// interval not a multiple of block_size, state_bytes / last_checkpoint / state_in_table on a non-recurrent group,
/// state_in_table with window_tokens other than block_size or with last_checkpoint, a group block_size other than 0 or
/// block_size that is not a multiple of it, on group 0, on a non-full group or with a host tier, num_layers 0, pool
/// bytes overflowing size_t) or
/// kLimitExceeded (num_blocks > 2^31, max_tokens_per_seq > 2^31 - 1, num_host_blocks > 2^31: the int32 batch
/// metadata; eviction_history > 2^30), each naming the field and value.
[[nodiscard]] inline CacheConfig checked_cache_config(const CacheConfig& c, std::size_t max_groups) {
  if (c.num_blocks < 2) {
    detail::raise(Errc::kInvalidArgument, "CacheConfig.num_blocks = " + std::to_string(c.num_blocks) +
                                              ": need at least 2 (the null block + one usable)");
  }
  if (c.block_size == 0 || c.block_size > kMaxBlockSize) {
    detail::raise(Errc::kInvalidArgument, "CacheConfig.block_size = " + std::to_string(c.block_size) +
                                              ": must be in [1, kMaxBlockSize = " + std::to_string(kMaxBlockSize) +
                                              "] tokens");
  }
  // Block ids 1 .. num_blocks - 1 are written as int32 (indices, block_tables, copies with -1 padding).
  detail::check_metadata_value(c.num_blocks - 1, "CacheConfig.num_blocks - 1 (the largest block id)");
  detail::check_metadata_value(c.max_tokens_per_seq, "CacheConfig.max_tokens_per_seq (seq_lens)");
  if (c.num_host_blocks == 1) {
    detail::raise(Errc::kInvalidArgument, "CacheConfig.num_host_blocks = 1: need 0 (no host tier) or at least 2 "
                                          "(the null block + one usable)");
  }
  if (c.num_host_blocks != 0) {
    detail::check_metadata_value(c.num_host_blocks - 1, "CacheConfig.num_host_blocks - 1 (the largest host block id)");
  }
  if (c.eviction_history > (std::size_t{1} << 30)) {
    detail::raise(Errc::kLimitExceeded, "CacheConfig.eviction_history = " + std::to_string(c.eviction_history) +
                                            ": at most 2^30 remembered evictions");
  }
  if (c.groups.size() > max_groups) {
    detail::raise(Errc::kInvalidArgument, "CacheConfig.groups has " + std::to_string(c.groups.size()) +
                                              " groups: need 0 (one full-attention group) to " +
                                              std::to_string(max_groups));
  }
  std::size_t layers = 1;
  std::size_t page = c.page_size_bytes;  // bytes of one layer slot of a block: max(page, every recurrent state)
  for (std::size_t g = 0; g < c.groups.size(); ++g) {
    const KVCacheGroupSpec& s = c.groups[g];
    const std::string who = "CacheConfig.groups[" + std::to_string(g) + "] (" + to_string(s.kind) + ")";
    if (s.kind != AttentionKind::kFull && s.kind != AttentionKind::kSlidingWindow &&
        s.kind != AttentionKind::kChunkedLocal && s.kind != AttentionKind::kRecurrent) {
      detail::raise(Errc::kInvalidArgument, who + ": unknown attention kind " +
                                                std::to_string(static_cast<int>(s.kind)));
    }
    if (s.kind == AttentionKind::kFull && s.window_tokens != 0) {
      detail::raise(Errc::kInvalidArgument, who + ".window_tokens = " + std::to_string(s.window_tokens) +
                                                ": a full-attention group has no window (0)");
    }
    if (s.kind != AttentionKind::kFull &&
        (s.window_tokens == 0 ||
         s.window_tokens > static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()))) {
      detail::raise(Errc::kInvalidArgument, who + ".window_tokens = " + std::to_string(s.window_tokens) +
                                                ": must be in [1, 2^31 - 1]");
    }
    if (s.recurrent()) {
      if (g == 0) {
        detail::raise(Errc::kInvalidArgument, who + ": group 0 must be an attention group (full, sliding window or "
                                                    "chunked-local); list the recurrent groups after it");
      }
      if (s.window_tokens % c.block_size != 0) {
        detail::raise(Errc::kInvalidArgument, who + ".window_tokens (checkpoint interval) = " +
                                                  std::to_string(s.window_tokens) + ": must be a multiple of the "
                                                  "block size " + std::to_string(c.block_size) +
                                                  " (a checkpoint is keyed by the hash of the block that ends there)");
      }
      if (s.state_in_table && (s.window_tokens != c.block_size || s.last_checkpoint)) {
        detail::raise(Errc::kInvalidArgument,
                      who + ".state_in_table with " +
                          (s.last_checkpoint ? std::string("last_checkpoint = true: the table holds the last state "
                                                           "already (use one of the two)")
                                             : "window_tokens = " + std::to_string(s.window_tokens) +
                                                   ": must be the block size " + std::to_string(c.block_size) +
                                                   " (a state can be kept at every block boundary a step ends on)"));
      }
      if (s.prefill_checkpoint_alignment != 0 &&
          (!s.state_in_table ||
           s.prefill_checkpoint_alignment > static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()))) {
        detail::raise(Errc::kInvalidArgument, who + ".prefill_checkpoint_alignment = " +
                                                  std::to_string(s.prefill_checkpoint_alignment) +
                                                  (s.state_in_table ? ": at most 2^31 - 1"
                                                                    : ": only with state_in_table (vLLM's Mamba 'align' layout)"));
      }
    } else if (s.state_bytes != 0 || s.last_checkpoint || s.state_in_table || s.prefill_checkpoint_alignment != 0) {
      detail::raise(Errc::kInvalidArgument, who + (s.last_checkpoint  ? ".last_checkpoint = true"
                                                   : s.state_in_table ? ".state_in_table = true"
                                                   : s.prefill_checkpoint_alignment != 0
                                                       ? ".prefill_checkpoint_alignment = " +
                                                             std::to_string(s.prefill_checkpoint_alignment)
                                                       : ".state_bytes = " + std::to_string(s.state_bytes)) +
                                                ": only a recurrent group has a state");
    }
    if (s.block_size != 0 && s.block_size != c.block_size) {  // a coarse page (docs/groups.md, "Coarse pages")
      const std::string bad = who + ".block_size = " + std::to_string(s.block_size) + ": ";
      if (s.kind != AttentionKind::kFull) {
        detail::raise(Errc::kInvalidArgument, bad + "only a full-attention group may have pages coarser than the "
                                                    "pool's block size " + std::to_string(c.block_size) +
                                                    " (0 = the pool's)");
      }
      if (g == 0) {
        detail::raise(Errc::kInvalidArgument, bad + "group 0 holds the pool's block size " +
                                                    std::to_string(c.block_size) +
                                                    " (the match unit); list the coarse groups after it");
      }
      if (s.block_size % c.block_size != 0 || s.block_size > kMaxBlockSize) {
        detail::raise(Errc::kInvalidArgument, bad + "must be a multiple of the pool's block size " +
                                                    std::to_string(c.block_size) + ", at most kMaxBlockSize = " +
                                                    std::to_string(kMaxBlockSize));
      }
      if (c.num_host_blocks != 0) {
        detail::raise(Errc::kInvalidArgument, bad + "a group with coarse pages does not yet work with the host tier "
                                                    "(num_host_blocks = " + std::to_string(c.num_host_blocks) +
                                                    "; issue 20)");
      }
    }
    if (s.num_layers == 0) detail::raise(Errc::kInvalidArgument, who + ".num_layers = 0: must be positive");
    layers = std::max<std::size_t>(layers, s.num_layers);
    page = std::max(page, s.state_bytes);
  }
  const std::size_t align = c.window_retention_alignment != 0 ? c.window_retention_alignment : c.block_size;
  if (align % c.block_size != 0 || align > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max())) {
    detail::raise(Errc::kInvalidArgument, "CacheConfig.window_retention_alignment = " +
                                              std::to_string(c.window_retention_alignment) +
                                              ": must be 0 or a multiple of the block size " +
                                              std::to_string(c.block_size) + ", at most 2^31 - 1");
  }
  if (c.window_retention_interval && (*c.window_retention_interval % align != 0 ||
                                      *c.window_retention_interval / c.block_size >
                                          static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))) {
    detail::raise(Errc::kInvalidArgument, "CacheConfig.window_retention_interval = " +
                                              std::to_string(*c.window_retention_interval) +
                                              ": must be a multiple of the retention alignment " +
                                              std::to_string(align) + " tokens, at most 2^31 - 1 blocks");
  }
  if (page != 0 && (layers > std::numeric_limits<std::size_t>::max() / page ||
                    c.num_blocks > std::numeric_limits<std::size_t>::max() / (layers * page))) {
    detail::raise(Errc::kInvalidArgument, "CacheConfig.page_size_bytes = " + std::to_string(c.page_size_bytes) +
                                              " (a recurrent state: up to " + std::to_string(page) + ") x " +
                                              std::to_string(layers) + " layers x " + std::to_string(c.num_blocks) +
                                              " blocks overflows size_t");
  }
  return c;
}

/// The GroupLayout of a validated configuration: its groups over the match unit, prefix caching, and the sliding-window
/// groups' sparse retention (CacheConfig::window_retention_interval) when set.
[[nodiscard]] inline GroupLayout group_layout(const CacheConfig& c) {
  GroupLayout layout(c.groups, c.block_size, c.enable_prefix_caching);
  if (c.window_retention_interval) {
    layout.set_window_retention(*c.window_retention_interval, c.window_retention_alignment, c.window_retention_eagle);
  }
  return layout;
}

}  // namespace detail

}  // namespace pagedkv
