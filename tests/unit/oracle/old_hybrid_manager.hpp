// tests/unit/oracle/old_hybrid_manager.hpp: the hybrid (KV-cache groups) manager as it was before the managers
// merged (issue 17; `git show f655591:include/pagedkv/kv_cache_groups.hpp`), kept as a test oracle for the
// differential test (test_groups_oracle.cpp). Changes from f655591, only so it compiles beside the merged manager:
//  - namespace pagedkv_test::old; the class HybridKVCacheManager is OldHybridKVCacheManager;
//  - AttentionKind, KVCacheGroupSpec and detail::first_kept_block / block_can_serve_hit / fixed_point_hit_blocks are
//    pagedkv's (group_policy.hpp, moved there unchanged by the merge) and no longer defined here;
//  - its HybridCacheConfig is pagedkv::CacheConfig (num_blocks, block_size, groups, enable_prefix_caching,
//    hash_seed, max_tokens_per_seq, enable_events, page_size_bytes; the host-tier fields are ignored), its
//    GroupBlockCopy is pagedkv::BlockCopy (which has a `group` field now), its HybridGrowthResult is
//    old::GrowthResult.
// Not part of the library: only tests include it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/detail/pending_copies.hpp>
#include <pagedkv/detail/reserve.hpp>
#include <pagedkv/detail/stored_event.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/group_policy.hpp>  // AttentionKind, KVCacheGroupSpec, the window rules (moved there)
#include <pagedkv/hash.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/kv_cache_manager.hpp>  // AdmitStatus, AdmitResult, AdmitOptions, CapacityQuery, AppendStatus
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/request_keys.hpp>
#include <pagedkv/stats.hpp>

namespace pagedkv_test::old {

using namespace pagedkv;  // NOLINT: the oracle is f655591's code, written inside namespace pagedkv

struct GrowthResult {
  AppendStatus status = AppendStatus::kNoCapacity;
  std::size_t num_new_blocks = 0;      ///< kOk: blocks taken from the pool over all groups (new + copies).
  std::size_t num_missing_blocks = 0;  ///< kNoCapacity / kNeverFits: as in AdmitResult.
  [[nodiscard]] bool ok() const noexcept { return status == AppendStatus::kOk; }
};

/// A KV-cache manager over several KV-cache groups sharing one block pool (hybrid models: Gemma 2/3 and gpt-oss
/// alternate sliding-window and full-attention layers, Llama 4 adds chunked-local layers). Ideas taken from vLLM's
/// hybrid allocator (KVCacheCoordinator: one block table per group, one pool, the prefix-hit fixed point over
/// groups, SlidingWindowManager's release of skipped blocks), TensorRT-LLM's variable-window block managers and
/// SGLang's SWA radix cache (out-of-window KV is freed while the tokens stay indexed). docs/groups.md has the
/// design; the single-group facade is KVCacheManager.
///
/// Per sequence: one token list, one chain of block hashes (the same for every group: content addressing does not
/// depend on the layer type), one *built* cursor (positions whose K/V writes a build issued; every group's layers
/// are written by the same step), and per group a BlockTable whose leading entries may be the null block 0:
///  - **Release rule.** After each build, a windowed group (sliding window W or chunked-local C) releases every
///    block wholly before `window.first_visible(num_built)` (the next query is at position num_built and
///    first_visible is non-decreasing: AttentionWindow::first_needed_token's rule) and puts the null block in its
///    table. Positions stay absolute: the page table keeps one entry per logical block, null before the window,
///    which the kernels never read (docs/kernels.md "Local attention"). A sliding-window group that grows by at
///    most `chunk` tokens per build holds at most ceil((W - 1 + chunk) / block_size) + 1 blocks.
///  - **Prefix hits.** One PrefixHashIndex per group (a block belongs to one group; its id is registered in that
///    group's index only). The hit length is detail::fixed_point_hit_blocks over the groups; a windowed group takes
///    only the hit blocks its first computed query sees, the leading ones are null.
///  - **Registration.** At the build that issues a full block's last write (as KVCacheManager), in its group's
///    index, unless the block can never serve a hit in that group (detail::block_can_serve_hit: W = 1, or the last
///    block of a chunked-local chunk); duplicates are switched to the registered block (slots -1).
///  - **Capacity.** Admission and growth count the blocks of every group against the one pool, all or nothing.
///  - **Copy-on-write, fork, rewind, preempt, events** per group (KVEvent::group); a pending copy holds a reference
///    on its source until the build hands it out, as in KVCacheManager.
/// Not supported (docs/groups.md "Known gaps"): lookahead slots, a host tier, swap preemption, prepared prompts.
///
/// Template parameters: `Hasher` (BlockHasher), `Id` (BlockIdType). Eviction: LRU over every group's cached blocks.
/// Thread safety: one writer; const calls may run concurrently with each other, never with a non-const call.
/// Errors: misuse throws pagedkv::Error and leaves the manager unchanged; expected outcomes are values.
/// Cost: admission O(groups x prompt blocks) index probes (hashing once); append O(groups + new tokens); build
/// O(groups x (batch + blocks + new tokens)); fork / free / rewind O(groups x blocks). None depends on pool size.
/// Memory: per pool block the allocator (12 B) + one PrefixHashIndex per group (22.8 B each) + 1 B group tag.
template <BlockHasher Hasher = Sha256Hasher, BlockIdType Id = std::uint32_t>
class OldHybridKVCacheManager {
 public:
  using block_id_type = Id;
  using hasher_type = Hasher;
  using allocator_type = BlockAllocator<Id, LruEviction<Id>>;
  using index_type = PrefixHashIndex<Hasher, Id>;
  using copy_type = BlockCopy<Id>;

  /// Most groups per manager.
  static constexpr std::size_t kMaxGroups = 64;

  /// A manager for the pool and groups of `config`. Throws kInvalidArgument (num_blocks < 2, block_size outside
  /// [1, kMaxBlockSize], no group or more than kMaxGroups, a full group with window_tokens != 0, a windowed group with window_tokens == 0
  /// or > 2^31 - 1, num_layers == 0, pool bytes overflowing size_t), kLimitExceeded (num_blocks > 2^31,
  /// max_tokens_per_seq > 2^31 - 1), each naming the group and value, before anything is allocated.
  explicit OldHybridKVCacheManager(const CacheConfig& config)
      : config_(checked(config)),
        alloc_(config_.num_blocks),
        max_tokens_per_seq_(config_.max_tokens_per_seq != 0 ? config_.max_tokens_per_seq : kMaxMetadataValue),
        group_of_(config_.num_blocks, 0),
        held_(config_.groups.size(), 0),
        peak_held_(config_.groups.size(), 0),
        events_(config_.enable_events) {
    index_.reserve(config_.groups.size());
    for (std::size_t g = 0; g < config_.groups.size(); ++g) {
      index_.emplace_back(config_.num_blocks, config_.hash_seed);
      windows_.push_back(config_.groups[g].window());
    }
  }

  OldHybridKVCacheManager(const OldHybridKVCacheManager&) = delete;
  OldHybridKVCacheManager& operator=(const OldHybridKVCacheManager&) = delete;
  OldHybridKVCacheManager(OldHybridKVCacheManager&&) noexcept = default;
  OldHybridKVCacheManager& operator=(OldHybridKVCacheManager&&) noexcept = default;
  ~OldHybridKVCacheManager() = default;

  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] std::uint32_t block_size() const noexcept { return config_.block_size; }
  [[nodiscard]] std::size_t num_groups() const noexcept { return config_.groups.size(); }
  /// The AttentionWindow of group g (what its kernels and decode plan take). Precondition: g < num_groups().
  [[nodiscard]] const AttentionWindow& window(std::size_t g) const noexcept { return windows_[g]; }
  [[nodiscard]] std::size_t max_tokens_per_seq() const noexcept { return max_tokens_per_seq_; }
  /// Bytes of one pool block: page_size_bytes x max_g num_layers (every block the same size).
  [[nodiscard]] std::size_t bytes_per_block() const noexcept { return config_.page_size_bytes * max_layers(); }

  /// The footprint bound of a sliding-window group g growing by `chunk_tokens` per build: ceil((W - 1 + chunk) /
  /// block_size) + 1 blocks per sequence (chunked-local: C - 1 in place of W - 1). nullopt for a full group.
  [[nodiscard]] std::optional<std::size_t> window_block_bound(std::size_t g, std::size_t chunk_tokens) const {
    check_group(g, "window_block_bound");
    if (!windows_[g].enabled()) return std::nullopt;
    const std::size_t bs = config_.block_size;
    return (config_.groups[g].window_tokens - 1 + chunk_tokens + bs - 1) / bs + 1;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Admission and growth

  /// Admit sequence `seq` with prompt `prompt` (`[prompt_len]` token ids, >= 1) and optional extra keys: finds the
  /// longest block-aligned prefix every group can serve (the fixed point; at most opts.max_cached_tokens, default
  /// prompt_len - 1), takes those blocks (a windowed group only those its first computed query sees; null before),
  /// and allocates, in every group, blocks for the first `opts.num_reserved_tokens` uncached tokens (default all;
  /// the rest through try_reserve). All or nothing: on kNoCapacity / kNeverFits nothing changes. kNeverFits: the
  /// blocks this admission holds, or the blocks the prompt needs at least (every full group ceil(prompt_len /
  /// block_size), every windowed group 1), exceed the pool.
  /// Throws kDuplicateSequence, kInvalidArgument (empty prompt, invalid keys, `opts.retention` set: retention
  /// priorities need KVCacheManager until the managers merge; they used to be dropped silently), kLimitExceeded
  /// (prompt_len > max_tokens_per_seq()).
  AdmitResult try_admit(SeqId seq, std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                        const AdmitOptions& opts = {}) {
    if (seqs_.contains(seq)) {
      detail::raise(Errc::kDuplicateSequence, "try_admit: sequence " + std::to_string(seq) + " is already live");
    }
    validate_prompt(prompt, keys, "try_admit");
    refuse_retention(opts, "try_admit");
    Plan plan = plan_admit(prompt, keys, opts);
    if (!plan.query.fits()) return {static_cast<AdmitStatus>(plan.query.status), 0, 0, 0, plan.query.num_missing_blocks};
    const std::size_t G = num_groups();
    const std::size_t bs = config_.block_size;
    const std::size_t k = plan.hit_blocks;
    // Commit: everything that may throw first.
    auto [it, inserted] = seqs_.try_emplace(seq);
    (void)inserted;
    Seq& s = it->second;
    try {
      s.tokens.assign(prompt.begin(), prompt.end());
      s.hashes = std::move(plan.hashes);
      if (keys != nullptr && !keys->empty()) s.keys = std::make_shared<const RequestKeys>(*keys);
      s.tables.assign(G, BlockTable<Id>(config_.block_size));
      s.registered.assign(G, k);
      s.released.assign(G, 0);
      const std::size_t total_blocks = (k * bs + plan.reserved + bs - 1) / bs;
      for (auto& t : s.tables) t.reserve_blocks(total_blocks);
      events_.reserve_more(2 * plan.query.num_blocks);
    } catch (...) {
      seqs_.erase(it);
      throw;
    }
    // Nothing below throws. Hit blocks first, so that allocating the rest cannot evict them.
    for (std::size_t g = 0; g < G; ++g) {
      for (std::size_t i = 0; i < k; ++i) {
        if (plan.hits[g][i] != Id{0}) acquire_block(plan.hits[g][i]);
      }
    }
    for (std::size_t g = 0; g < G; ++g) {
      for (std::size_t i = 0; i < k; ++i) s.tables[g].append_full_block(plan.hits[g][i]);
      s.released[g] = detail::first_kept_block(windows_[g], k * bs, config_.block_size);
      std::optional<BlockCopy<Id>> copy;
      Pool pool{this, static_cast<std::uint32_t>(g)};
      const bool ok = s.tables[g].try_append(plan.reserved, pool, evictor(), nullptr, copy);
      (void)ok;  // guaranteed by the capacity check; no copy (the table ends on a block boundary)
    }
    s.num_built = k * bs;
    const bool readmitted = preempted_.erase(seq) != 0;
    stats_.prefix_query_requests += 1;
    stats_.prefix_query_tokens += prompt.size();
    stats_.prefix_hit_tokens += k * bs;
    stats_.prefix_hit_requests += k > 0 ? 1 : 0;
    if (readmitted) {
      ++stats_.readmitted_requests;
      stats_.readmitted_query_tokens += prompt.size();
      stats_.readmitted_hit_tokens += k * bs;
    }
    interval_.record(prompt.size(), k * bs, readmitted);
    return {AdmitStatus::kAdmitted, k * bs, 0, plan.query.num_blocks, 0};
  }

  /// What try_admit(seq, prompt, keys, opts) would answer now (kFits = admitted), without changing anything: blocks
  /// taken, blocks missing, cached tokens. Hashes the prompt. Throws as try_admit for invalid input.
  [[nodiscard]] CapacityQuery query_admit(std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                                          const AdmitOptions& opts = {}) const {
    validate_prompt(prompt, keys, "query_admit");
    refuse_retention(opts, "query_admit");
    return plan_admit(prompt, keys, opts).query;
  }

  /// Cached prefix length in tokens (a multiple of block_size) of `prompt` if it were admitted now: the fixed point
  /// over groups, capped at `max_cached_tokens` (default prompt_len - 1). Pure. 0 without prefix caching or for an
  /// empty prompt. Throws kInvalidArgument for invalid keys.
  [[nodiscard]] std::size_t lookup(std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                                   std::optional<std::size_t> max_cached_tokens = std::nullopt) const {
    validate_request_keys(keys, prompt.size(), "lookup");
    if (prompt.empty()) return 0;
    AdmitOptions o;
    o.max_cached_tokens = max_cached_tokens;
    return plan_admit(prompt, keys, o).hit_blocks * config_.block_size;
  }

  /// Append `tokens` (`[n]`, e.g. one sampled token) to live sequence `seq`: n slots in every group (pending for
  /// the next builds), a copy-on-write of a shared or hashed partial tail per group first. All or nothing over the
  /// groups; kNoCapacity / kNeverFits change nothing (kNeverFits: the sequence alone would hold more blocks, over
  /// all groups, than the pool). Throws kUnknownSequence, kInvalidArgument (prompt tokens without slots: try_reserve
  /// them first), kLimitExceeded (length past max_tokens_per_seq()).
  GrowthResult try_append(SeqId seq, std::span<const TokenId> tokens) {
    Seq& s = live(seq, "try_append");
    if (s.unslotted() != 0) {
      detail::raise(Errc::kInvalidArgument, "try_append: sequence " + std::to_string(seq) + " has " +
                                                std::to_string(s.unslotted()) +
                                                " prompt tokens without slots (try_reserve them first)");
    }
    const std::size_t n = tokens.size();
    if (s.tokens.size() + n > max_tokens_per_seq_) {
      detail::raise(Errc::kLimitExceeded, "try_append: sequence " + std::to_string(seq) + " would reach " +
                                              std::to_string(s.tokens.size() + n) +
                                              " tokens, above max_tokens_per_seq = " +
                                              std::to_string(max_tokens_per_seq_));
    }
    if (n == 0) return {AppendStatus::kOk, 0, 0};
    const CapacityQuery cq = query_growth(s, n);
    if (!cq.fits()) return {static_cast<AppendStatus>(cq.status), 0, cq.num_missing_blocks};
    prepare_growth(s, n);
    const std::size_t old_known = s.tokens.size();
    const std::size_t old_hashes = s.hashes.size();
    if (config_.enable_prefix_caching) {
      detail::reserve_more(s.hashes, (old_known + n) / config_.block_size - std::min(old_hashes, (old_known + n) / config_.block_size));
    }
    detail::reserve_more(s.tokens, n);
    s.tokens.insert(s.tokens.end(), tokens.begin(), tokens.end());
    if (config_.enable_prefix_caching) {
      try {
        index_[0].hash_full_blocks(s.tokens, config_.block_size, s.keys.get(), s.hashes);
      } catch (...) {
        s.tokens.resize(old_known);
        s.hashes.resize(old_hashes);
        throw;
      }
    }
    commit_growth(s, n);
    return {AppendStatus::kOk, cq.num_blocks, 0};
  }

  /// Chunked prefill: slots, in every group, for the next `n` prompt tokens of `seq` that have none (admitted with
  /// AdmitOptions::num_reserved_tokens), all or nothing. kNoCapacity is the engine's preemption signal. Throws
  /// kUnknownSequence, kInvalidArgument (n > the prompt tokens without slots).
  GrowthResult try_reserve(SeqId seq, std::size_t n) {
    Seq& s = live(seq, "try_reserve");
    if (n > s.unslotted()) {
      detail::raise(Errc::kInvalidArgument, "try_reserve: sequence " + std::to_string(seq) + " has " +
                                                std::to_string(s.unslotted()) +
                                                " prompt tokens without slots, asked for " + std::to_string(n));
    }
    if (n == 0) return {AppendStatus::kOk, 0, 0};
    const CapacityQuery cq = query_growth(s, n);
    if (!cq.fits()) return {static_cast<AppendStatus>(cq.status), 0, cq.num_missing_blocks};
    prepare_growth(s, n);
    commit_growth(s, n);
    return {AppendStatus::kOk, cq.num_blocks, 0};
  }

  /// What growing `seq` by `n` slots (try_append of n tokens or try_reserve(n)) would take now, over all groups.
  /// Pure. Throws kUnknownSequence.
  [[nodiscard]] CapacityQuery query_append(SeqId seq, std::size_t n) const {
    const Seq& s = live(seq, "query_append");
    if (n == 0) return {};
    return query_growth(s, n);
  }

  /// Fork live, settled sequence `parent` into new sequence `child`: every group's table is copied (null entries
  /// included), every block's refcount + 1, nothing allocated; the first append to a shared partial tail, by either
  /// side, copies it (per group). Throws kUnknownSequence, kDuplicateSequence (child live), kInvalidArgument (the
  /// parent has unbuilt slots, prompt tokens without slots or a pending copy into its tables: fork after the build).
  void fork(SeqId parent, SeqId child) {
    if (seqs_.contains(child)) {
      detail::raise(Errc::kDuplicateSequence, "fork: child sequence " + std::to_string(child) + " is already live");
    }
    const Seq& p = live(parent, "fork");
    if (!(p.num_built == p.slotted() && p.slotted() == p.tokens.size() && p.num_pending_copies == 0)) {
      detail::raise(Errc::kInvalidArgument, "fork: parent sequence " + std::to_string(parent) + " has unbuilt state (" +
                                                std::to_string(p.slotted() - p.num_built) + " unbuilt slots, " +
                                                std::to_string(p.unslotted()) + " prompt tokens without slots, " +
                                                std::to_string(p.num_pending_copies) +
                                                " pending copies): build the step's metadata before forking");
    }
    Seq c;  // copy first (may throw), take references after
    c.tokens = p.tokens;
    c.hashes = p.hashes;
    c.keys = p.keys;
    c.tables = p.tables;
    c.registered = p.registered;
    c.released = p.released;
    c.num_built = p.num_built;
    auto [it, inserted] = seqs_.try_emplace(child, std::move(c));
    (void)inserted;
    for (const auto& t : it->second.tables) {
      for (Id b : t.blocks()) {
        if (b != Id{0}) acquire_block(b);
      }
    }
  }

  /// Free live sequence `seq`: every group's blocks are released, last block first; registered blocks stay cached.
  /// Throws kUnknownSequence (also on a double free).
  void free(SeqId seq) {
    Seq& s = live(seq, "free");
    for (std::size_t g = 0; g < s.tables.size(); ++g) {
      Pool pool{this, static_cast<std::uint32_t>(g)};
      s.tables[g].release_all(pool);
    }
    seqs_.erase(seq);
  }

  /// `free`, counted as a preemption by recompute (the engine re-admits the request later; that admission is
  /// counted as a re-admission). Throws kUnknownSequence.
  void preempt(SeqId seq) {
    (void)live(seq, "preempt");
    preempted_.insert(seq);
    free(seq);
    ++stats_.preemptions;
  }

  /// Drop the last `n` tokens of `seq` (rejected speculative tokens): blocks left empty are released in every
  /// group; a shared or hashed partial block is copied on the next append. Only as far back as every windowed group
  /// still holds what the next query needs: a block released when the window moved past it cannot come back.
  /// Throws kUnknownSequence, kLimitExceeded (n > the sequence's tokens, or the rewind would need a released block;
  /// the message names the group and the block).
  void rewind(SeqId seq, std::size_t n) {
    Seq& s = live(seq, "rewind");
    const std::size_t len = s.tokens.size();
    if (n > len) {
      detail::raise(Errc::kLimitExceeded, "rewind: n = " + std::to_string(n) + " exceeds sequence " +
                                              std::to_string(seq) + "'s " + std::to_string(len) + " tokens");
    }
    const std::size_t new_len = len - n;
    const std::size_t new_slotted = std::min(s.slotted(), new_len);
    const std::size_t new_built = std::min(s.num_built, new_slotted);
    for (std::size_t g = 0; g < s.tables.size(); ++g) {
      const std::size_t need = detail::first_kept_block(windows_[g], new_built, config_.block_size);
      if (s.released[g] > need) {
        detail::raise(Errc::kLimitExceeded,
                      "rewind: sequence " + std::to_string(seq) + " back to " + std::to_string(new_len) +
                          " tokens needs logical block " + std::to_string(need) + " of group " + std::to_string(g) +
                          " (" + to_string(config_.groups[g].kind) + " " +
                          std::to_string(config_.groups[g].window_tokens) + "), released when its window moved past it");
      }
    }
    for (std::size_t g = 0; g < s.tables.size(); ++g) {
      Pool pool{this, static_cast<std::uint32_t>(g)};
      s.tables[g].rewind(s.tables[g].num_tokens() - new_slotted, pool);
    }
    s.tokens.resize(new_len);
    s.hashes.resize(std::min(s.hashes.size(), new_len / config_.block_size));
    for (auto& r : s.registered) r = std::min(r, s.hashes.size());
    s.num_built = new_built;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Batch metadata

  /// Write this step's metadata of the sequences `batch`, one BatchMetadataBuffers per group (`per_group`, `[G]`),
  /// with the conventions of KVCacheManager::build_batch_metadata (shapes, padding, which spans may be empty),
  /// per group: page table (indptr / indices / last_page_len / block_tables, one entry per logical block, the null
  /// block 0 before a windowed group's window: the kernels never read those pages), seq_lens and qo_indptr (equal
  /// in every group: positions are absolute), slot_mapping (the group's own blocks) and copies (the group's
  /// copy-on-writes that belong to this build, by KVCacheManager::build_batch_metadata's rule). `num_scheduled_tokens` (`[batch]`, optional; empty = every pending position): each sequence's
  /// query length this step (chunked prefill). Before writing, every group registers the full blocks whose last
  /// write this build issues (duplicates switched, their slots -1); after writing, every windowed group releases
  /// the blocks wholly before first_visible(num_built) of each sequence of the batch (the release rule: the
  /// kernels of this step still read them; they are reused only by later steps).
  /// Returns the sizes written, `[G]`. Throws kBadShape (per_group.size() != G, a buffer too small or wrongly
  /// empty, num_scheduled_tokens of the wrong size, a sequence longer than max_blocks_per_seq), kUnknownSequence,
  /// kInvalidArgument (a sequence twice; more tokens scheduled than pending, or none: every sequence of the batch
  /// computes at least one token), kLimitExceeded (an int32 total): then nothing is written and nothing changes.
  std::vector<BatchMetadataSizes> build_batch_metadata(std::span<const SeqId> batch,
                                                       std::span<const BatchMetadataBuffers> per_group,
                                                       std::span<const std::uint32_t> num_scheduled_tokens = {}) {
    const std::size_t G = num_groups();
    if (per_group.size() != G) {
      detail::raise(Errc::kBadShape, "build_batch_metadata: " + std::to_string(per_group.size()) +
                                         " buffer sets for " + std::to_string(G) + " groups");
    }
    if (!num_scheduled_tokens.empty() && num_scheduled_tokens.size() != batch.size()) {
      detail::raise(Errc::kBadShape, "build_batch_metadata: num_scheduled_tokens holds " +
                                         std::to_string(num_scheduled_tokens.size()) + " entries for a batch of " +
                                         std::to_string(batch.size()));
    }
    const std::size_t bs = config_.block_size;
    batch_scratch_.clear();
    batch_scratch_.reserve(batch.size());
    qlen_scratch_.clear();
    qlen_scratch_.reserve(batch.size());
    const auto fail = [&](Errc c, std::string msg) {
      for (Seq* p : batch_scratch_) p->in_batch = false;
      detail::raise(c, "build_batch_metadata: " + std::move(msg));
    };
    std::size_t num_indices = 0, num_new_tokens = 0, max_registrations = 0, max_blocks = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const SeqId id = batch[b];
      const auto it = seqs_.find(id);
      if (it == seqs_.end()) fail(Errc::kUnknownSequence, "sequence " + std::to_string(id) + " is not live");
      Seq& s = it->second;
      if (s.in_batch) fail(Errc::kInvalidArgument, "sequence " + std::to_string(id) + " appears twice");
      s.in_batch = true;
      batch_scratch_.push_back(&s);
      const std::size_t pending = s.slotted() - s.num_built;
      const std::size_t q_len = num_scheduled_tokens.empty() ? pending : num_scheduled_tokens[b];
      if (q_len > pending) {
        fail(Errc::kInvalidArgument, "sequence " + std::to_string(id) + " is scheduled " + std::to_string(q_len) +
                                         " tokens but has " + std::to_string(pending) + " pending slots");
      }
      qlen_scratch_.push_back(static_cast<std::uint32_t>(q_len));
      const std::size_t seq_len = s.num_built + q_len;
      const std::size_t blocks = (seq_len + bs - 1) / bs;
      num_indices += blocks;
      num_new_tokens += q_len;
      max_blocks = std::max(max_blocks, blocks);
      if (config_.enable_prefix_caching) {
        const std::size_t reg_end = std::min(seq_len, s.tokens.size()) / bs;
        for (std::size_t g = 0; g < G; ++g) max_registrations += reg_end - std::min(reg_end, s.registered[g]);
      }
    }
    // Every row computes something (after the checks of ids, so an unknown or repeated id is named first).
    for (std::size_t r = 0; r < batch.size(); ++r) {
      if (qlen_scratch_[r] != 0) continue;
      fail(Errc::kInvalidArgument, detail::idle_row_message(batch[r], r, !num_scheduled_tokens.empty(),
                                                            batch_scratch_[r]->unslotted()));
    }
    // The copies this build hands out, per group: its batch's own, and those reading a block it writes.
    std::vector<std::size_t> copies_per_group(G, 0);
    const std::size_t num_copies = detail::select_batch_copies(
        pending_copies_, copy_owners_,
        [](const Seq& owner) { return owner.in_batch || owner.num_built == owner.slotted(); },
        [&](const copy_type& c) { return batch_writes(c.src, c.group); }, take_scratch_);
    for (std::size_t i = 0; i < pending_copies_.size(); ++i) copies_per_group[pending_copies_[i].group] += take_scratch_[i];
    if (num_indices > kMaxMetadataValue || num_new_tokens > kMaxMetadataValue) {
      for (Seq* p : batch_scratch_) p->in_batch = false;
      detail::check_metadata_value(num_indices, "build_batch_metadata: total blocks of the batch (indptr[batch])");
      detail::check_metadata_value(num_new_tokens,
                                   "build_batch_metadata: total new tokens of the batch (qo_indptr[batch])");
    }
    const std::size_t B = batch.size();
    for (std::size_t g = 0; g < G; ++g) {
      const BatchMetadataBuffers& buf = per_group[g];
      const auto grp = [g] { return "group " + std::to_string(g) + ": "; };
      const auto need = [&](std::size_t have, std::size_t want, const char* name) {
        if (have != 0 && have < want) {
          fail(Errc::kBadShape, grp() + name + " holds " + std::to_string(have) + " entries, needs " + std::to_string(want));
        }
      };
      need(buf.indptr.size(), B + 1, "indptr");
      need(buf.indices.size(), num_indices, "indices");
      need(buf.last_page_len.size(), B, "last_page_len");
      need(buf.seq_lens.size(), B, "seq_lens");
      need(buf.qo_indptr.size(), B + 1, "qo_indptr");
      need(buf.slot_mapping.size(), num_new_tokens, "slot_mapping");
      need(buf.copies.size(), 2 * copies_per_group[g], "copies");
      if (!buf.block_tables.empty()) {
        if (buf.max_blocks_per_seq <= 0) fail(Errc::kBadShape, grp() + "block_tables set but max_blocks_per_seq <= 0");
        if (max_blocks > static_cast<std::size_t>(buf.max_blocks_per_seq)) {
          fail(Errc::kBadShape, grp() + "a sequence has " + std::to_string(max_blocks) +
                                    " blocks > max_blocks_per_seq = " + std::to_string(buf.max_blocks_per_seq));
        }
        need(buf.block_tables.size(), B * static_cast<std::size_t>(buf.max_blocks_per_seq), "block_tables");
      }
      if (num_indices > 0 && buf.indices.empty() && !buf.indptr.empty()) {
        fail(Errc::kBadShape, grp() + "indptr is set but indices is empty");
      }
      if (num_new_tokens > 0 && buf.slot_mapping.empty()) {
        fail(Errc::kBadShape, grp() + "slot_mapping is empty but the batch has " + std::to_string(num_new_tokens) +
                                  " new tokens: their writes would never be issued");
      }
      if (copies_per_group[g] > 0 && buf.copies.empty()) {
        fail(Errc::kBadShape, grp() + "copies is empty but " + std::to_string(copies_per_group[g]) +
                                  " copy-on-write copies belong to this build: they would be lost");
      }
    }
    std::vector<BatchMetadataSizes> sizes;
    try {
      sizes.assign(G, BatchMetadataSizes{});
      copy_scratch_.clear();
      copy_scratch_.reserve(num_copies);
      events_.reserve_more(max_registrations);
      switched_scratch_.clear();
      switched_scratch_.reserve(max_blocks);
      group_cursor_blk_.assign(G, 0);
      group_cursor_tok_.assign(G, 0);
    } catch (...) {
      for (Seq* p : batch_scratch_) p->in_batch = false;
      throw;
    }
    // Validated; nothing below throws. Per sequence: mark the scheduled positions built; per group register, write.
    std::vector<std::size_t>& blk = group_cursor_blk_;
    std::vector<std::size_t>& tok = group_cursor_tok_;
    for (std::size_t b = 0; b < B; ++b) {
      Seq& s = *batch_scratch_[b];
      s.in_batch = false;
      const std::size_t first = s.num_built;
      const std::size_t q_len = qlen_scratch_[b];
      s.num_built += q_len;
      const std::size_t seq_len = s.num_built;
      const std::size_t nblocks = (seq_len + bs - 1) / bs;
      for (std::size_t g = 0; g < G; ++g) {
        const BatchMetadataBuffers& buf = per_group[g];
        switched_scratch_.clear();
        register_full_blocks(s, g);
        const auto blocks = s.tables[g].blocks().first(nblocks);
        if (!buf.indptr.empty()) {
          buf.indptr[b] = static_cast<std::int32_t>(blk[g]);
          std::copy(blocks.begin(), blocks.end(), buf.indices.begin() + static_cast<std::ptrdiff_t>(blk[g]));
        }
        blk[g] += nblocks;
        if (!buf.last_page_len.empty()) {
          buf.last_page_len[b] = static_cast<std::int32_t>(seq_len == 0 ? 0 : seq_len - (nblocks - 1) * bs);
        }
        if (!buf.block_tables.empty()) {
          auto row = buf.block_tables.subspan(b * static_cast<std::size_t>(buf.max_blocks_per_seq),
                                              static_cast<std::size_t>(buf.max_blocks_per_seq));
          std::copy(blocks.begin(), blocks.end(), row.begin());
          std::fill(row.begin() + static_cast<std::ptrdiff_t>(nblocks), row.end(), std::int32_t{0});
        }
        if (!buf.seq_lens.empty()) buf.seq_lens[b] = static_cast<std::int32_t>(seq_len);
        if (!buf.qo_indptr.empty()) buf.qo_indptr[b] = static_cast<std::int32_t>(tok[g]);
        if (!buf.slot_mapping.empty()) write_slots(s, g, first, q_len, buf.slot_mapping.subspan(tok[g], q_len));
        tok[g] += q_len;
      }
    }
    const auto pad_from = [](auto span, std::size_t from, auto value) {
      if (!span.empty()) std::fill(span.begin() + static_cast<std::ptrdiff_t>(from), span.end(), value);
    };
    // The selected copies (less any whose destination was switched out above) are handed out; the rest stay
    // pending for their own batch's build.
    detail::take_selected_copies(pending_copies_, copy_owners_, take_scratch_, copy_scratch_);
    for (std::size_t g = 0; g < G; ++g) {
      const BatchMetadataBuffers& buf = per_group[g];
      pad_from(buf.indptr, B, static_cast<std::int32_t>(blk[g]));
      pad_from(buf.qo_indptr, B, static_cast<std::int32_t>(tok[g]));
      pad_from(buf.last_page_len, B, std::int32_t{0});
      pad_from(buf.seq_lens, B, std::int32_t{0});
      pad_from(buf.slot_mapping, tok[g], std::int64_t{-1});
      std::size_t c = 0;
      for (const copy_type& cp : copy_scratch_) {
        if (cp.group != g) continue;
        buf.copies[2 * c] = static_cast<std::int32_t>(cp.src);
        buf.copies[2 * c + 1] = static_cast<std::int32_t>(cp.dst);
        ++c;
      }
      pad_from(buf.copies, 2 * c, std::int32_t{-1});
      sizes[g] = {B, blk[g], tok[g], c, 0, 0, 0};
    }
    // The copies are issued: release the references they held on their sources.
    for (const copy_type& c : copy_scratch_) release_block(c.src);
    copy_scratch_.clear();
    // The release rule: this step's kernels read these blocks; later steps may reuse them.
    for (Seq* s : batch_scratch_) release_out_of_window(*s);
    return sizes;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Queries

  [[nodiscard]] bool contains(SeqId seq) const { return seqs_.contains(seq); }
  [[nodiscard]] std::size_t num_sequences() const noexcept { return seqs_.size(); }
  /// Positions of `seq` with slots (every group the same). Throws kUnknownSequence.
  [[nodiscard]] std::size_t num_tokens(SeqId seq) const { return live(seq, "num_tokens").slotted(); }
  /// Positions of `seq` whose writes a build issued (or prefix hits). Throws kUnknownSequence.
  [[nodiscard]] std::size_t num_built(SeqId seq) const { return live(seq, "num_built").num_built; }
  /// Known token ids of `seq` (`[num_known]`). Valid until the next non-const call. Throws kUnknownSequence.
  [[nodiscard]] std::span<const TokenId> token_ids(SeqId seq) const { return live(seq, "token_ids").tokens; }
  /// Group g's block table of `seq` (`[ceil(num_tokens / block_size)]`, null block 0 for released or never-taken
  /// leading blocks). Valid until the next non-const call. Throws kUnknownSequence, kInvalidArgument (g).
  [[nodiscard]] std::span<const Id> block_ids(SeqId seq, std::size_t g) const {
    check_group(g, "block_ids");
    return live(seq, "block_ids").tables[g].blocks();
  }
  /// Leading null blocks of group g's table of `seq` (released, or before the window at a prefix hit).
  [[nodiscard]] std::size_t num_null_blocks(SeqId seq, std::size_t g) const {
    check_group(g, "num_null_blocks");
    return live(seq, "num_null_blocks").released[g];
  }
  /// Slots of the pending positions of `seq` in group g, position order. A new vector. Throws kUnknownSequence.
  [[nodiscard]] std::vector<std::int64_t> pending_slots(SeqId seq, std::size_t g) const {
    check_group(g, "pending_slots");
    const Seq& s = live(seq, "pending_slots");
    std::vector<std::int64_t> out(s.slotted() - s.num_built);
    for (std::size_t p = s.num_built; p < s.slotted(); ++p) out[p - s.num_built] = s.tables[g].slot(p);
    return out;
  }
  /// Copy-on-write copies not yet handed out (every group). Valid until the next non-const call.
  [[nodiscard]] std::span<const copy_type> pending_copies() const noexcept { return pending_copies_; }
  /// Visit every live sequence as f(SeqId, std::size_t num_tokens). `f` must not call a non-const member.
  template <class F>
  void for_each_sequence(F&& f) const {
    for (const auto& [id, s] : seqs_) f(id, s.slotted());
  }

  /// Blocks held (refcount > 0) by group g now, each shared block once. O(1).
  [[nodiscard]] std::size_t held_blocks(std::size_t g) const {
    check_group(g, "held_blocks");
    return held_[g];
  }
  /// The most blocks group g held at once since construction or reset_peaks().
  [[nodiscard]] std::size_t peak_held_blocks(std::size_t g) const {
    check_group(g, "peak_held_blocks");
    return peak_held_[g];
  }
  /// The most blocks all groups held at once since construction or reset_peaks().
  [[nodiscard]] std::size_t peak_used_blocks() const noexcept { return peak_used_; }
  /// Restart the peaks at the current values.
  void reset_peaks() noexcept {
    peak_held_ = held_;
    peak_used_ = alloc_.num_used_blocks();
  }
  /// Bytes of the blocks group g holds: held_blocks(g) x bytes_per_block().
  [[nodiscard]] std::size_t held_bytes(std::size_t g) const { return held_blocks(g) * bytes_per_block(); }

  /// Counters and block counts now (KVCacheManager's CacheStats; the host-tier fields stay 0).
  [[nodiscard]] CacheStats stats() const noexcept {
    CacheStats s = stats_;
    s.num_usable_blocks = alloc_.num_usable_blocks();
    s.blocks_used = alloc_.num_used_blocks();
    s.blocks_cached = alloc_.num_cached_blocks();
    s.blocks_free = alloc_.num_free_blocks();
    s.usage = static_cast<double>(s.blocks_used) / static_cast<double>(s.num_usable_blocks);
    s.evictions = alloc_.num_evictions();
    s.block_ops = alloc_.num_block_ops();
    return s;
  }
  /// Prefix-cache statistics since the previous call (vLLM's PrefixCacheStats), then a new interval.
  PrefixCacheStats take_prefix_cache_stats() noexcept {
    const PrefixCacheStats out = interval_;
    interval_ = {};
    return out;
  }
  /// The shared allocator (read-only). Valid as long as the manager.
  [[nodiscard]] const allocator_type& allocator() const noexcept { return alloc_; }
  /// Group g's prefix index (read-only). Throws kInvalidArgument for g >= num_groups().
  [[nodiscard]] const index_type& prefix_index(std::size_t g) const {
    check_group(g, "prefix_index");
    return index_[g];
  }
  /// The group whose table holds (or last held) block b. Precondition: 0 < b < num_blocks.
  [[nodiscard]] std::uint32_t group_of(Id b) const noexcept { return group_of_[b]; }

  /// Drop every block hash of every group, when no block is referenced (true); else false, nothing changes.
  bool reset_prefix_cache() {
    if (alloc_.num_used_blocks() != 0) return false;
    events_.reserve_more(1);
    alloc_.clear_hashes([](Id) {});
    for (auto& ix : index_) ix.clear();
    interval_.reset = true;
    if (events_.enabled()) events_.push(KVEventType::kAllCleared);
    return true;
  }

  /// Move the recorded events (oldest first) to `out`; returns how many (enable_events only).
  std::size_t drain_events(std::vector<KVEvent>& out) { return events_.drain(out); }
  /// The events since the last take or drain as the next numbered batch; nullopt when nothing happened.
  std::optional<KVEventBatch> take_event_batch(double ts) { return events_.take_batch(ts); }
  /// What the events taken so far say is cached, one stored event per (hash, group).
  [[nodiscard]] KVEventSnapshot event_snapshot() const { return events_.snapshot(); }

 private:
  struct Seq {
    std::vector<TokenId> tokens;              // known token ids
    std::vector<BlockHash> hashes;            // chain hashes of the known full blocks
    std::shared_ptr<const RequestKeys> keys;  // null = none
    std::vector<BlockTable<Id>> tables;       // [G]
    std::vector<std::size_t> registered;      // [G] leading full blocks needing no registration attempt
    std::vector<std::size_t> released;        // [G] leading logical blocks that are null
    std::size_t num_built = 0;
    std::uint32_t num_pending_copies = 0;
    bool in_batch = false;
    [[nodiscard]] std::size_t slotted() const noexcept { return tables.front().num_tokens(); }
    [[nodiscard]] std::size_t unslotted() const noexcept { return tokens.size() - std::min(tokens.size(), slotted()); }
  };
  // The allocator as one group's BlockTable sees it: the null block carries no reference; allocations are tagged
  // with the group; releases go through release_block (pending copies, held counts).
  struct Pool {
    OldHybridKVCacheManager* m;
    std::uint32_t g;
    [[nodiscard]] std::uint32_t refcount(Id b) const { return m->alloc_.refcount(b) - m->pins(b); }
    [[nodiscard]] bool is_hashed(Id b) const { return m->alloc_.is_hashed(b); }
    [[nodiscard]] std::size_t num_available_blocks() const noexcept { return m->alloc_.num_available_blocks(); }
    template <class F>
    [[nodiscard]] std::optional<Id> try_allocate_one(F&& f) {
      const auto b = m->alloc_.try_allocate_one(f);
      if (b) m->on_allocated(*b, g);
      return b;
    }
    template <class F>
    [[nodiscard]] bool try_allocate(std::span<Id> out, F&& f) {
      if (!m->alloc_.try_allocate(out, f)) return false;
      for (Id b : out) m->on_allocated(b, g);
      return true;
    }
    void acquire(Id b) {
      if (b != Id{0}) m->acquire_block(b);
    }
    void release(Id b) {
      if (b != Id{0}) m->release_block(b);
    }
  };
  struct ConstPool {
    const OldHybridKVCacheManager* m;
    [[nodiscard]] std::uint32_t refcount(Id b) const { return m->alloc_.refcount(b) - m->pins(b); }
    [[nodiscard]] bool is_hashed(Id b) const { return m->alloc_.is_hashed(b); }
  };
  struct Plan {
    CapacityQuery query;
    std::vector<BlockHash> hashes;
    std::vector<std::vector<Id>> hits;  // [G][hit_blocks] the block each group takes (0 = null, not needed)
    std::size_t hit_blocks = 0;
    std::size_t reserved = 0;
  };

  [[nodiscard]] std::size_t max_layers() const noexcept {
    std::size_t m = 0;
    for (const auto& g : config_.groups) m = std::max<std::size_t>(m, g.num_layers);
    return m;
  }
  void check_group(std::size_t g, const char* what) const {
    if (g >= config_.groups.size()) {
      detail::raise(Errc::kInvalidArgument, std::string(what) + ": group " + std::to_string(g) + " >= " +
                                                std::to_string(config_.groups.size()) + " groups");
    }
  }
  static CacheConfig checked(const CacheConfig& c) {
    if (c.num_blocks < 2) {
      detail::raise(Errc::kInvalidArgument, "CacheConfig.num_blocks = " + std::to_string(c.num_blocks) +
                                                ": need at least 2 (the null block + one usable)");
    }
    if (c.block_size == 0 || c.block_size > kMaxBlockSize) {
      detail::raise(Errc::kInvalidArgument, "CacheConfig.block_size = " + std::to_string(c.block_size) +
                                                ": must be in [1, kMaxBlockSize = " + std::to_string(kMaxBlockSize) +
                                                "] tokens");
    }
    detail::check_metadata_value(c.num_blocks - 1, "CacheConfig.num_blocks - 1 (the largest block id)");
    detail::check_metadata_value(c.max_tokens_per_seq, "CacheConfig.max_tokens_per_seq (seq_lens)");
    if (c.groups.empty() || c.groups.size() > kMaxGroups) {
      detail::raise(Errc::kInvalidArgument, "CacheConfig.groups has " + std::to_string(c.groups.size()) +
                                                " groups: need 1 to " + std::to_string(kMaxGroups));
    }
    std::size_t layers = 0;
    for (std::size_t g = 0; g < c.groups.size(); ++g) {
      const KVCacheGroupSpec& s = c.groups[g];
      const std::string who = "CacheConfig.groups[" + std::to_string(g) + "] (" + to_string(s.kind) + ")";
      if (s.kind != AttentionKind::kFull && s.kind != AttentionKind::kSlidingWindow &&
          s.kind != AttentionKind::kChunkedLocal) {
        detail::raise(Errc::kInvalidArgument, who + ": unknown attention kind " +
                                                  std::to_string(static_cast<int>(s.kind)));
      }
      if (s.kind == AttentionKind::kFull && s.window_tokens != 0) {
        detail::raise(Errc::kInvalidArgument, who + ".window_tokens = " + std::to_string(s.window_tokens) +
                                                  ": a full-attention group has no window (0)");
      }
      if (s.kind != AttentionKind::kFull &&
          (s.window_tokens == 0 || s.window_tokens > static_cast<std::uint32_t>(std::numeric_limits<std::int32_t>::max()))) {
        detail::raise(Errc::kInvalidArgument, who + ".window_tokens = " + std::to_string(s.window_tokens) +
                                                  ": must be in [1, 2^31 - 1]");
      }
      if (s.num_layers == 0) detail::raise(Errc::kInvalidArgument, who + ".num_layers = 0: must be positive");
      layers = std::max<std::size_t>(layers, s.num_layers);
    }
    if (c.page_size_bytes != 0 && (layers > std::numeric_limits<std::size_t>::max() / c.page_size_bytes ||
                                   c.num_blocks > std::numeric_limits<std::size_t>::max() / (layers * c.page_size_bytes))) {
      detail::raise(Errc::kInvalidArgument, "CacheConfig.page_size_bytes = " + std::to_string(c.page_size_bytes) +
                                                " x " + std::to_string(layers) + " layers x " +
                                                std::to_string(c.num_blocks) + " blocks overflows size_t");
    }
    return c;
  }
  // Retention priorities (AdmitOptions::retention) are applied by KVCacheManager's retention eviction policies; this
  // manager has none, so a request carrying them is refused rather than admitted without them.
  static void refuse_retention(const AdmitOptions& opts, const char* what) {
    if (opts.retention) {
      detail::raise(Errc::kInvalidArgument, std::string(what) +
                                                ": AdmitOptions::retention is not supported by OldHybridKVCacheManager "
                                                "(its eviction is LRU; retention priorities need KVCacheManager with a "
                                                "RetentionEvictionPolicy): not applied, so refused");
    }
  }
  void validate_prompt(std::span<const TokenId> prompt, const RequestKeys* keys, const char* what) const {
    if (prompt.empty()) detail::raise(Errc::kInvalidArgument, std::string(what) + ": empty prompt");
    if (prompt.size() > max_tokens_per_seq_) {
      detail::raise(Errc::kLimitExceeded, std::string(what) + ": prompt of " + std::to_string(prompt.size()) +
                                              " tokens exceeds max_tokens_per_seq = " +
                                              std::to_string(max_tokens_per_seq_));
    }
    validate_request_keys(keys, prompt.size(), what);
  }
  Seq& live(SeqId seq, const char* what) {
    const auto it = seqs_.find(seq);
    if (it == seqs_.end()) {
      detail::raise(Errc::kUnknownSequence, std::string(what) + ": sequence " + std::to_string(seq) + " is not live");
    }
    return it->second;
  }
  const Seq& live(SeqId seq, const char* what) const { return const_cast<OldHybridKVCacheManager*>(this)->live(seq, what); }

  // Plan an admission (pure): the prompt's hashes, the fixed-point hit, each group's hit blocks, what it takes.
  Plan plan_admit(std::span<const TokenId> prompt, const RequestKeys* keys, const AdmitOptions& opts) const {
    const std::size_t G = num_groups();
    const std::size_t bs = config_.block_size;
    Plan p;
    p.hits.resize(G);
    const std::size_t full = prompt.size() / bs;
    if (config_.enable_prefix_caching) index_[0].hash_full_blocks(prompt, config_.block_size, keys, p.hashes);
    const std::size_t cap = std::min(opts.max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
    const std::size_t walk = config_.enable_prefix_caching ? std::min(full, cap / bs) : 0;
    // found[g][i]: the block group g's index holds for prompt block i (0 = miss); looked up once each.
    std::vector<std::vector<Id>> found(G);
    for (std::size_t g = 0; g < G; ++g) found[g].assign(walk, Id{0});
    std::vector<std::vector<bool>> looked(G, std::vector<bool>(walk, false));
    const auto cached = [&](std::size_t g, std::size_t i) {
      if (!looked[g][i]) {
        looked[g][i] = true;
        if (const auto b = index_[g].find(p.hashes[i])) found[g][i] = *b;
      }
      return found[g][i] != Id{0};
    };
    const std::size_t k = detail::fixed_point_hit_blocks(windows_, config_.block_size, walk, cached);
    p.hit_blocks = k;
    std::size_t evictable = 0, held_hits = 0;
    for (std::size_t g = 0; g < G; ++g) {
      p.hits[g].assign(k, Id{0});
      const std::size_t lo = detail::first_kept_block(windows_[g], k * bs, config_.block_size);
      for (std::size_t i = lo; i < k; ++i) {
        (void)cached(g, i);
        p.hits[g][i] = found[g][i];
        ++held_hits;
        if (alloc_.is_cached(found[g][i])) ++evictable;
      }
    }
    p.reserved = std::min(opts.num_reserved_tokens.value_or(prompt.size()), prompt.size() - k * bs);
    const std::size_t new_per_group = (k * bs + p.reserved + bs - 1) / bs - k;
    const std::size_t new_blocks = new_per_group * G;
    const std::size_t usable = alloc_.num_usable_blocks();
    std::size_t lower_bound = 0;  // blocks the prompt needs at least, however it is reserved
    for (std::size_t g = 0; g < G; ++g) lower_bound += windows_[g].enabled() ? 1 : (prompt.size() + bs - 1) / bs;
    const std::size_t held_after = held_hits + new_blocks;
    const std::size_t never = std::max(lower_bound, held_after);
    if (never > usable) {
      p.query = {CapacityStatus::kNeverFits, new_blocks, never - usable, k * bs};
      return p;
    }
    const std::size_t available = alloc_.num_available_blocks() - evictable;
    if (new_blocks > available) {
      p.query = {CapacityStatus::kNoCapacity, new_blocks, new_blocks - available, k * bs};
      return p;
    }
    p.query = {CapacityStatus::kFits, new_blocks, 0, k * bs};
    return p;
  }
  CapacityQuery query_growth(const Seq& s, std::size_t n) const {
    const std::size_t bs = config_.block_size;
    std::size_t needed = 0, held_after = 0;
    for (std::size_t g = 0; g < s.tables.size(); ++g) {
      const BlockTable<Id>& t = s.tables[g];
      const std::size_t new_blocks = (s.slotted() + n + bs - 1) / bs - t.num_blocks();
      const bool cow = t.last_block_needs_copy(ConstPool{this});
      const bool hashed_partial = cow && alloc_.is_hashed(t.blocks().back());
      needed += new_blocks + (cow ? 1 : 0);
      held_after += t.num_blocks() - s.released[g] + new_blocks + (hashed_partial ? 1 : 0);
    }
    const std::size_t usable = alloc_.num_usable_blocks();
    if (held_after > usable) return {CapacityStatus::kNeverFits, needed, held_after - usable, 0};
    if (needed > alloc_.num_available_blocks()) {
      return {CapacityStatus::kNoCapacity, needed, needed - alloc_.num_available_blocks(), 0};
    }
    return {CapacityStatus::kFits, needed, 0, 0};
  }
  // Reserve everything commit_growth needs, so that it cannot throw. May throw; changes nothing visible.
  void prepare_growth(Seq& s, std::size_t n) {
    const std::size_t bs = config_.block_size;
    const std::size_t G = s.tables.size();
    detail::reserve_more(pending_copies_, G);
    detail::reserve_more(copy_owners_, G);
    for (auto& t : s.tables) t.reserve_blocks((s.slotted() + n + bs - 1) / bs);
    events_.reserve_more(2 * G * ((n + bs - 1) / bs + 2));
  }
  // Give `s` n more slots in every group (capacity checked, room reserved). Never throws.
  void commit_growth(Seq& s, std::size_t n) {
    for (std::size_t g = 0; g < s.tables.size(); ++g) {
      std::optional<BlockCopy<Id>> copy;
      Pool pool{this, static_cast<std::uint32_t>(g)};
      const bool ok = s.tables[g].try_append(n, pool, evictor(), nullptr, copy);
      (void)ok;
      if (copy) {
        pending_copies_.push_back({copy->src, copy->dst, static_cast<std::uint32_t>(g)});
        copy_owners_.push_back(&s);
        ++s.num_pending_copies;
        ++stats_.cow_copies;
      }
    }
  }
  // Called by the allocator just before a cached block is reused: drop its hash from its group's index.
  auto evictor() {
    return [this](Id b) {
      const std::uint32_t g = group_of_[b];
      const auto h = index_[g].erase_block(b);
      if (h && events_.enabled()) {
        KVEvent& e = events_.push(KVEventType::kBlockRemoved);
        e.hash = *h;
        e.group = g;
      }
    };
  }
  void on_allocated(Id b, std::uint32_t g) noexcept {
    group_of_[b] = static_cast<std::uint8_t>(g);
    bump_held(g);
  }
  void bump_held(std::uint32_t g) noexcept {
    peak_held_[g] = std::max(peak_held_[g], ++held_[g]);
    peak_used_ = std::max(peak_used_, alloc_.num_used_blocks());
  }
  void acquire_block(Id b) {
    const bool was_unheld = alloc_.refcount(b) == 0;
    alloc_.acquire(b);
    if (was_unheld) bump_held(group_of_[b]);
  }
  // Release one reference; a block that becomes unreferenced leaves its group's held count, and a pending copy
  // into it is dropped with its source reference (nobody needs its contents).
  // Whether the build being validated writes into group g's block b: a position it schedules (rows
  // batch_scratch_ / qlen_scratch_, from each row's first unbuilt position) lies in b. O(blocks the build writes).
  [[nodiscard]] bool batch_writes(Id b, std::size_t g) const noexcept {
    const std::size_t bs = config_.block_size;
    for (std::size_t r = 0; r < batch_scratch_.size(); ++r) {
      const Seq& q = *batch_scratch_[r];
      const std::size_t n = qlen_scratch_[r];
      if (n == 0) continue;
      const auto blocks = q.tables[g].blocks();
      for (std::size_t i = q.num_built / bs; i <= (q.num_built + n - 1) / bs; ++i) {
        if (blocks[i] == b) return true;
      }
    }
    return false;
  }
  void release_block(Id b) {
    alloc_.release(b);
    if (alloc_.refcount(b) != 0) return;
    --held_[group_of_[b]];
    if (const auto src = detail::drop_pending_copy_into(pending_copies_, copy_owners_, take_scratch_, b)) release_block(*src);
  }
  [[nodiscard]] std::uint32_t pins(Id b) const noexcept { return detail::pending_reads(pending_copies_, b); }
  // Register group g's registrable full blocks of `s` (see the class comment); duplicates that only `s` holds are
  // switched to the registered block, their logical index recorded in switched_scratch_.
  void register_full_blocks(Seq& s, std::size_t g) {
    if (!config_.enable_prefix_caching) return;
    const std::size_t bs = config_.block_size;
    const std::size_t end = std::min({s.num_built, s.tokens.size(), s.slotted()}) / bs;
    index_type& ix = index_[g];
    for (std::size_t i = s.registered[g]; i < std::min(end, s.hashes.size()); ++i) {
      const Id own = s.tables[g].blocks()[i];
      if (own == Id{0} || !detail::block_can_serve_hit(windows_[g], i, config_.block_size)) continue;
      if (ix.hash_of(own)) continue;
      const BlockHash& h = s.hashes[i];
      const Id reg = ix.insert(h, own);
      if (reg == own) {
        alloc_.set_hashed(own, true);
        if (events_.enabled()) record_stored(s, i, h, static_cast<std::uint32_t>(g));
        continue;
      }
      if (alloc_.refcount(own) - pins(own) != 1) continue;  // shared duplicate: left unregistered
      acquire_block(reg);
      s.tables[g].replace_block(i, reg);
      release_block(own);
      ++stats_.dedup_blocks;
      switched_scratch_.push_back(i);
    }
    s.registered[g] = std::max(s.registered[g], end);
  }
  void write_slots(const Seq& s, std::size_t g, std::size_t first, std::size_t n, std::span<std::int64_t> out) const {
    const std::size_t bs = config_.block_size;
    const auto blocks = s.tables[g].blocks();
    for (std::size_t p = first; p < first + n; ++p) {
      const std::size_t blk = p / bs;
      const bool switched = std::find(switched_scratch_.begin(), switched_scratch_.end(), blk) != switched_scratch_.end();
      out[p - first] = switched ? std::int64_t{-1}
                                : static_cast<std::int64_t>(blocks[blk]) * static_cast<std::int64_t>(bs) +
                                      static_cast<std::int64_t>(p - blk * bs);
    }
  }
  // The release rule for every windowed group of `s`.
  void release_out_of_window(Seq& s) {
    for (std::size_t g = 0; g < s.tables.size(); ++g) {
      if (!windows_[g].enabled()) continue;
      const std::size_t target =
          std::min(detail::first_kept_block(windows_[g], s.num_built, config_.block_size), s.tables[g].num_blocks());
      for (std::size_t i = s.released[g]; i < target; ++i) {
        const Id old = s.tables[g].replace_block(i, Id{0});
        if (old != Id{0}) release_block(old);
      }
      s.released[g] = std::max(s.released[g], target);
    }
  }
  void record_stored(const Seq& s, std::size_t i, const BlockHash& h, std::uint32_t g) {
    KVEvent& e = events_.push(KVEventType::kBlockStored);
    detail::fill_stored_event(e, h, i, config_.block_size, s.tokens, s.hashes, s.keys.get());
    e.group = g;
  }

  CacheConfig config_;
  allocator_type alloc_;
  std::vector<index_type> index_;        // [G]
  std::vector<AttentionWindow> windows_; // [G]
  std::size_t max_tokens_per_seq_;
  std::vector<std::uint8_t> group_of_;   // [num_blocks] the group a block was last allocated for
  std::vector<std::size_t> held_;        // [G]
  std::vector<std::size_t> peak_held_;   // [G]
  std::size_t peak_used_ = 0;
  std::unordered_map<SeqId, Seq> seqs_;  // node-based: Seq addresses are stable (copy owners point at them)
  std::vector<copy_type> pending_copies_;  // each holds one reference on its src
  std::vector<Seq*> copy_owners_;          // [pending_copies_.size()]
  std::vector<copy_type> copy_scratch_;
  std::vector<std::uint8_t> take_scratch_;  // build: [pending_copies_] 1 = handed out by this build
  std::vector<Seq*> batch_scratch_;
  std::vector<std::uint32_t> qlen_scratch_;
  std::vector<std::size_t> switched_scratch_;
  std::vector<std::size_t> group_cursor_blk_, group_cursor_tok_;
  std::unordered_set<SeqId> preempted_;
  EventLog events_;
  CacheStats stats_;
  PrefixCacheStats interval_;
};

}  // namespace pagedkv_test::old
