// pagedkv/manager_results.hpp: what the cache manager's admission, growth and capacity calls take as options and
// return (results for expected outcomes: no capacity, never fits, transfer pending).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include <pagedkv/block_table.hpp>  // BlockCopy
#include <pagedkv/config.hpp>
#include <pagedkv/eviction_history.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/request_keys.hpp>
#include <pagedkv/retention.hpp>
#include <pagedkv/stats.hpp>

namespace pagedkv {

/// Outcome of an admission. Only kAdmitted changes state.
enum class AdmitStatus : std::uint8_t {
  kAdmitted = 0,    ///< The sequence is live; its uncached prompt tokens have slots.
  kNoCapacity = 1,  ///< Not enough free + evictable blocks now; retry after others finish (or preempt).
  kNeverFits = 2,   ///< The prompt needs more blocks than the whole pool has: it can never be admitted.
  kTransferPending = 3,  ///< try_resume: a host copy the sequence needs has not completed yet; retry after
                         ///< complete_transfers.
};

/// Result of `try_admit` and `try_resume`.
struct AdmitResult {
  AdmitStatus status = AdmitStatus::kNoCapacity;
  std::size_t num_cached_tokens = 0;   ///< Prompt tokens found in the prefix cache (a multiple of block_size),
                                       ///< in either tier. try_resume: the resumed sequence's tokens.
  std::size_t num_host_cached_tokens = 0;  ///< Of which served by the host tier (onboarded by this build's swap_in);
                                           ///< always <= num_cached_tokens (a partial block counts its tokens).
  std::size_t num_new_blocks = 0;      ///< Blocks taken from the pool (allocated, possibly by eviction).
  std::size_t num_missing_blocks = 0;  ///< kNoCapacity: blocks that would have to become available now;
                                       ///< kNeverFits: blocks beyond the whole pool. 0 when admitted.
  [[nodiscard]] bool admitted() const noexcept { return status == AdmitStatus::kAdmitted; }
};

/// Options of one admission.
struct AdmitOptions {
  /// Most prompt tokens taken from the prefix cache; default prompt_len - 1, so at least one token is computed
  /// (its logits sample the first output token). Any value is clamped to the prompt length.
  std::optional<std::size_t> max_cached_tokens = std::nullopt;
  /// Chunked admission: reserve slots (and blocks) only for the first `num_reserved_tokens` uncached prompt tokens
  /// now; the rest get them chunk by chunk through `try_reserve`, each all or nothing (then kNoCapacity is a
  /// preemption signal, as in vLLM's allocate_slots). Default: the whole prompt (vLLM's full-prompt-must-fit
  /// gate, so a running prefill is never preempted for lack of blocks). Clamped to the uncached tokens. 0 admits the
  /// sequence with its cached prefix only: it has no slots, and a build refuses it (kInvalidArgument) until
  /// `try_reserve` gives it some.
  std::optional<std::size_t> num_reserved_tokens = std::nullopt;
  /// Retention priorities of the request's blocks (TensorRT-LLM's KvCacheRetentionConfig; see RetentionConfig):
  /// applied when the sequence releases its blocks (free, preempt, rewind) under a RetentionEvictionPolicy such as
  /// PriorityLruEviction, ignored under others. Shared, not copied: forks inherit it. Null = default priority.
  std::shared_ptr<const RetentionConfig> retention = nullptr;
  /// Sparse window retention only (CacheConfig::window_retention_interval; without it validated, then unused): the
  /// prompt length whose replay boundary, token prompt_retention_tokens - 1, keeps its window tail registered.
  /// Default: the admitted prompt's length. vLLM's `request.num_prompt_tokens`: a preempted request readmitted with its output
  /// tokens as prompt keeps its original prompt's boundary. In [1, prompt_len] (kInvalidArgument otherwise).
  std::optional<std::size_t> prompt_retention_tokens = std::nullopt;
  /// Sparse window retention only (validated always): the shared-prefix junction (tokens; 0 = none), a second boundary whose window
  /// tail the sequence registers, so that a later request sharing the prompt up to there hits its windows too.
  /// vLLM's `Request.shared_prefix_boundary`, set when a full-attention group's cached prefix is longer than the
  /// window groups' hit (the prefix other requests share, KVCacheCoordinator.find_longest_cache_hit's third value).
  /// At most prompt_len (kInvalidArgument otherwise).
  std::size_t shared_prefix_boundary = 0;
};

/// A prompt validated and hashed once by `KVCacheManager::prepare_prompt` (its token ids, extra keys and the hashes
/// of its full blocks, `[prompt_len / block_size]`), for admissions an engine retries step after step while the
/// pool is full: `try_admit(seq, prepared)` walks the cache without hashing again. Tied to the hasher, seed and
/// block size of the manager that prepared it (checked through the chain root).
struct PreparedPrompt {
  std::vector<TokenId> tokens;
  std::shared_ptr<const RequestKeys> keys;  ///< null = no extra keys
  std::vector<BlockHash> hashes;
  BlockHash root;                           ///< The chain root it was hashed under.
  std::uint32_t block_size = 0;             ///< Tokens per block it was hashed with (0: not prepared).
};

/// Outcome of a capacity query (`query_admit`, `query_append`): what the call would answer now.
enum class CapacityStatus : std::uint8_t {
  kFits = 0,        ///< It would succeed now.
  kNoCapacity = 1,  ///< Not now: `num_missing_blocks` more blocks must become free or evictable.
  kNeverFits = 2,   ///< Never, whatever is preempted: `num_missing_blocks` beyond the whole pool.
};

/// What an admission or a growth (append, reserve, lookahead) would take from the pool now. Pure: computing it
/// changes nothing.
struct CapacityQuery {
  CapacityStatus status = CapacityStatus::kFits;
  std::size_t num_blocks = 0;          ///< Blocks it would take from the pool (new blocks + a copy-on-write).
  std::size_t num_missing_blocks = 0;  ///< kNoCapacity / kNeverFits: how many are missing; 0 when it fits.
  std::size_t num_cached_tokens = 0;   ///< Admission: prompt tokens the prefix cache would serve.
  [[nodiscard]] bool fits() const noexcept { return status == CapacityStatus::kFits; }
};

/// Outcome of an append.
enum class AppendStatus : std::uint8_t {
  kOk = 0,
  kNoCapacity = 1,  ///< Not enough blocks now; nothing changed. The engine preempts a sequence and retries.
  kNeverFits = 2,   ///< The sequence would hold more blocks than the whole pool: preempting others cannot help.
};

/// Result of `try_append`. `slots` views the slots reserved by this call (`[n]`, position order); the view is
/// invalidated by the next non-const call on the manager. The slot mapping a build writes may differ for some of
/// them: a later copy-on-write moves them into the copy, and deduplication turns them into -1 (see
/// build_batch_metadata); the build's slot mapping is the authority.
template <BlockIdType Id>
struct AppendResult {
  AppendStatus status = AppendStatus::kNoCapacity;
  std::span<const std::int64_t> slots;
  std::optional<BlockCopy<Id>> copy;   ///< The copy-on-write this append needs, if any.
  std::size_t num_missing_blocks = 0;  ///< kNoCapacity / kNeverFits: as in AdmitResult.
  std::size_t num_new_blocks = 0;      ///< kOk: blocks taken from the pool over all groups (new + copies).
  [[nodiscard]] bool ok() const noexcept { return status == AppendStatus::kOk; }
};

/// Why an admission's prefix hit ends where it does (`KVCacheManager::explain_admit`): the first cause that stops
/// the hit, in the order the walk meets them. The field's common question, "is caching working?" (vLLM, llm-d and
/// Dynamo users ask it in their trackers), answered per request.
enum class MissCause : std::uint8_t {
  kNone = 0,              ///< No miss: every full block of the prompt is served (the rest is a partial block).
  kPrefixCachingOff = 1,  ///< CacheConfig::enable_prefix_caching is false.
  kShortPrompt = 2,       ///< The prompt holds no full block (only full blocks are cached).
  kCapped = 3,            ///< The next block is cached but the cap stops the hit: prompt_len - 1 (one token is always
                          ///< computed, its logits sample the first output token) or AdmitOptions::max_cached_tokens.
  kNotCached = 4,         ///< Block `first_miss_block` is cached in no tier: never stored, or evicted longer ago than
                          ///< the eviction history remembers (CacheConfig::eviction_history; 0 = no history).
  kKeyMismatch = 5,       ///< Not cached under this request's extra keys, but the same tokens are cached without
                          ///< them: the salt, adapter or multimodal items differ from the requests that stored them.
  kLimitedByGroup = 6,    ///< The full-attention groups could serve more; group `limiting_group` (a window, a
                          ///< recurrent group, or a coarse-page group) lacks a block it needs at the next length.
  kEvicted = 7,           ///< Block `first_miss_block` was cached and has been evicted (the eviction history has it:
                          ///< AdmitExplanation::eviction says from which tier and how long ago).
};
static_assert(static_cast<std::size_t>(MissCause::kEvicted) + 1 == kNumMissCauses);

/// "none", "prefix_caching_off", "short_prompt", "capped", "not_cached", "key_mismatch", "limited_by_group",
/// "evicted" (the label values of docs/groups.md's counters).
[[nodiscard]] constexpr const char* to_string(MissCause c) noexcept {
  switch (c) {
    case MissCause::kPrefixCachingOff: return "prefix_caching_off";
    case MissCause::kShortPrompt: return "short_prompt";
    case MissCause::kCapped: return "capped";
    case MissCause::kNotCached: return "not_cached";
    case MissCause::kKeyMismatch: return "key_mismatch";
    case MissCause::kLimitedByGroup: return "limited_by_group";
    case MissCause::kEvicted: return "evicted";
    case MissCause::kNone: break;
  }
  return "none";
}

/// The breakdown of an admission's prefix hit, what `try_admit` would find now (tokens; multiples of block_size).
struct AdmitExplanation {
  std::size_t prompt_tokens = 0;       ///< The prompt's length.
  std::size_t cap_tokens = 0;          ///< The cap in force (prompt_len - 1 by default).
  std::size_t hit_tokens = 0;          ///< What admission would take from the cache (= lookup()).
  std::size_t host_hit_tokens = 0;     ///< Of which served by the host tier (some group's block onboarded).
  MissCause cause = MissCause::kNone;  ///< Why the hit ends there.
  std::size_t first_miss_block = 0;    ///< kNotCached / kKeyMismatch / kLimitedByGroup / kEvicted: the logical block
                                       ///< that stops it.
  std::uint32_t limiting_group = 0;    ///< kLimitedByGroup: the group; else the group whose miss stops it (0).
  /// Per group `[num_groups]`: its longest run of cached blocks from block 0 in either tier, in tokens (a windowed
  /// group needs only its window's blocks, so its run may be shorter than the hit).
  std::vector<std::size_t> group_cached_run_tokens;
  /// kEvicted: the eviction of block `first_miss_block` of group `limiting_group` (its tier, its number in that
  /// tier's evictions); nullopt otherwise.
  std::optional<EvictionRecord> eviction;
  /// kEvicted: evictions from the same tier since that one (how long ago, in evictions; 0 = the latest).
  std::uint64_t evictions_since = 0;
};

}  // namespace pagedkv
