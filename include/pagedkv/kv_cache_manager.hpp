// pagedkv/kv_cache_manager.hpp: the narrow facade an engine's scheduler calls (admit, append, fork, free, rewind,
// lookup, batch metadata), over BlockAllocator + BlockTable + PrefixHashIndex.
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
#include <utility>
#include <vector>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/detail/reserve.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/prefix_hash_index.hpp>

namespace pagedkv {

/// Configuration of one KV pool.
struct CacheConfig {
  std::size_t num_blocks = 0;                     ///< Pool size in blocks, including the null block 0 (>= 2).
  std::uint32_t block_size = kDefaultBlockSize;   ///< Tokens per block (> 0).
  bool enable_prefix_caching = true;              ///< Hash full blocks and reuse them across requests.
  std::uint64_t hash_seed = 0;                    ///< Per-pool chain seed (the root of every block-hash chain).
  std::size_t max_tokens_per_seq = 0;             ///< Per-sequence limit (max model length); 0 = none.
  bool enable_events = false;                     ///< Record KVEvents for drain_events().
};

/// Outcome of an admission. Only kAdmitted changes state.
enum class AdmitStatus : std::uint8_t {
  kAdmitted = 0,    ///< The sequence is live; its uncached prompt tokens have slots.
  kNoCapacity = 1,  ///< Not enough free + evictable blocks now; retry after others finish (or preempt).
  kNeverFits = 2,   ///< The prompt needs more blocks than the whole pool has: it can never be admitted.
};

/// Result of `try_admit`.
struct AdmitResult {
  AdmitStatus status = AdmitStatus::kNoCapacity;
  std::size_t num_cached_tokens = 0;  ///< Prompt tokens found in the prefix cache (a multiple of block_size).
  std::size_t num_new_blocks = 0;     ///< Blocks taken from the pool (allocated, possibly by eviction).
  [[nodiscard]] bool admitted() const noexcept { return status == AdmitStatus::kAdmitted; }
};

/// Outcome of an append.
enum class AppendStatus : std::uint8_t {
  kOk = 0,
  kNoCapacity = 1,  ///< Not enough blocks; nothing changed. The engine preempts a sequence and retries.
};

/// Result of `try_append`. `slots` views the sequence's pending slots of this call (`[n]`); it is invalidated by
/// the next non-const call. The slot mapping the builder writes may later turn some of them into -1 (a block
/// switched to an identical registered block; see build_batch_metadata).
template <BlockIdType Id>
struct AppendResult {
  AppendStatus status = AppendStatus::kNoCapacity;
  std::span<const std::int64_t> slots;
  std::optional<BlockCopy<Id>> copy;  ///< The copy-on-write this append needs, if any.
  [[nodiscard]] bool ok() const noexcept { return status == AppendStatus::kOk; }
};

/// The KV-cache manager an inference engine's scheduler calls: one per KV pool (all layers share the block ids).
///
/// Behaviour (DESIGN.md sec. 2; PagedAttention, Kwon et al. SOSP'23; vLLM V1 prefix caching):
///  - `try_admit` looks up the prompt's longest cached prefix (capped so at least one token is computed), takes
///    the hit blocks (protecting them from eviction) and allocates the rest, all or nothing.
///  - `try_append` reserves slots for new tokens (one per decode step, or a chunk), copying a shared or hashed
///    partial last block first (copy-on-write).
///  - A full block is registered in the prefix index by the `build_batch_metadata` call that issues the writes of
///    its K/V (so no request can ever hit a block whose K/V was never written: a sequence freed or preempted
///    before its step ran leaves nothing in the index). If an identical block is already registered, the sequence
///    switches to it and frees its own copy (no two cached blocks share a hash).
///  - `fork` shares every block (parallel sampling, beam search); `free`/`preempt` release tail first.
///  - `build_batch_metadata` writes the step's page table, slot mapping and copy list into caller buffers.
/// A pending copy (src, dst) holds a reference on src until the metadata that carries it is built, so no block is
/// both read and written by one copy_blocks launch. Precondition for engines: fork a sequence only after the
/// step's metadata has been built (no unbuilt slots: fork after prefill, as engines do). A fork with unbuilt slots
/// is not detected: the child's blocks would depend on writes a same-step copy reads too early, or that never
/// happen if the parent is freed first.
///
/// Template parameters: `Hasher` (BlockHasher: Sha256Hasher default, Xxh3Hasher), `Id` (BlockIdType),
/// `Evict` (EvictionPolicy, LRU default).
/// Thread safety: none; one writer (the scheduler thread). No global state: managers are independent.
/// Errors: misuse throws `pagedkv::Error` (codes in error.hpp) and leaves the manager unchanged; expected outcomes
/// (no capacity, never fits, prefix miss) are values.
/// Cost: admission O(prompt blocks) (hashing dominates); append O(new tokens) plus one hash per filled block; fork,
/// free, rewind O(blocks of the sequence); build O(batch + blocks + new tokens). None depends on pool size or on
/// the number of cached blocks.
template <BlockHasher Hasher = Sha256Hasher, BlockIdType Id = std::uint32_t,
          EvictionPolicy<Id> Evict = LruEviction<Id>>
class KVCacheManager {
 public:
  using block_id_type = Id;
  using hasher_type = Hasher;
  using allocator_type = BlockAllocator<Id, Evict>;
  using index_type = PrefixHashIndex<Hasher, Id>;
  using table_type = BlockTable<Id>;
  using copy_type = BlockCopy<Id>;

  /// A manager for a pool described by `config`. Throws kInvalidArgument for num_blocks < 2 or block_size == 0.
  explicit KVCacheManager(const CacheConfig& config)
      : config_(checked(config)),
        alloc_(config_.num_blocks),
        index_(config_.num_blocks, config_.hash_seed),
        max_tokens_per_seq_(config_.max_tokens_per_seq != 0 ? config_.max_tokens_per_seq
                                                            : std::numeric_limits<std::size_t>::max()) {}

  KVCacheManager(const KVCacheManager&) = delete;
  KVCacheManager& operator=(const KVCacheManager&) = delete;

  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  [[nodiscard]] std::uint32_t block_size() const noexcept { return config_.block_size; }
  /// Per-sequence token limit in force (SIZE_MAX when none was configured). A prompt longer than the pool but
  /// within this limit is answered kNeverFits, not an error.
  [[nodiscard]] std::size_t max_tokens_per_seq() const noexcept { return max_tokens_per_seq_; }

  // ---------------------------------------------------------------------------------------------------------------
  // Admission and growth

  /// Admit sequence `seq` with prompt `prompt` (`[prompt_len]` token ids, prompt_len >= 1) and optional extra keys.
  /// Finds the longest cached prefix of full blocks (at most `max_cached_tokens` tokens; default prompt_len - 1 so
  /// at least one token is computed), takes those blocks, and allocates blocks for the rest; the uncached tokens'
  /// slots become pending for the next `build_batch_metadata`. All or nothing: on kNoCapacity / kNeverFits
  /// nothing changes (no refcount, no LRU position, no counter).
  /// Throws kDuplicateSequence (seq is live), kInvalidArgument (empty prompt), kLimitExceeded (prompt_len >
  /// max_tokens_per_seq()).
  AdmitResult try_admit(SeqId seq, std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                        std::optional<std::size_t> max_cached_tokens = std::nullopt) {
    if (seqs_.contains(seq)) {
      detail::raise(Errc::kDuplicateSequence, "try_admit: sequence " + std::to_string(seq) + " is already live");
    }
    if (prompt.empty()) {
      detail::raise(Errc::kInvalidArgument, "try_admit: sequence " + std::to_string(seq) + " has an empty prompt");
    }
    if (prompt.size() > max_tokens_per_seq_) {
      detail::raise(Errc::kLimitExceeded, "try_admit: prompt of " + std::to_string(prompt.size()) +
                                              " tokens exceeds max_tokens_per_seq = " +
                                              std::to_string(max_tokens_per_seq_));
    }
    const std::size_t bs = config_.block_size;
    const std::size_t total_blocks = (prompt.size() + bs - 1) / bs;
    if (total_blocks > alloc_.num_usable_blocks()) return {AdmitStatus::kNeverFits, 0, 0};

    std::vector<BlockHash> hashes;
    if (config_.enable_prefix_caching) {
      hashes.reserve(prompt.size() / bs);
      index_.hash_full_blocks(prompt, config_.block_size, keys, hashes);
    }
    const std::size_t cap = std::min(max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
    hit_scratch_.clear();
    std::size_t evictable_hits = 0;
    for (std::size_t i = 0; i < std::min(hashes.size(), cap / bs); ++i) {
      const auto b = index_.find(hashes[i]);
      if (!b) break;
      hit_scratch_.push_back(*b);
      if (alloc_.is_cached(*b)) ++evictable_hits;
    }
    const std::size_t hits = hit_scratch_.size();
    const std::size_t new_blocks = total_blocks - hits;
    if (new_blocks > alloc_.num_available_blocks() - evictable_hits) return {AdmitStatus::kNoCapacity, 0, 0};

    // Commit. Everything that can throw bad_alloc is done before the first refcount changes.
    auto keys_ptr = keys != nullptr && !keys->empty() ? std::make_shared<const RequestKeys>(*keys) : nullptr;
    Sequence s(config_.block_size);
    s.tokens.assign(prompt.begin(), prompt.end());
    s.pending_slots.reserve(prompt.size() - hits * bs);
    s.keys = std::move(keys_ptr);
    auto [it, inserted] = seqs_.try_emplace(seq, std::move(s));
    Sequence& q = it->second;
    Proxy pool{this};
    for (Id b : hit_scratch_) {
      alloc_.acquire(b);
      q.table.append_full_block(b);
    }
    q.hashes = std::move(hashes);
    q.num_registered = hits;
    std::optional<copy_type> no_copy;
    const bool ok = q.table.try_append(prompt.size() - hits * bs, pool, evictor(), q.pending_slots, no_copy);
    (void)ok;  // guaranteed by the capacity check

    ++stats_.prefix_query_requests;
    stats_.prefix_query_tokens += prompt.size();
    if (hits > 0) ++stats_.prefix_hit_requests;
    stats_.prefix_hit_tokens += hits * bs;
    return {AdmitStatus::kAdmitted, hits * bs, new_blocks};
  }

  /// Append `tokens` (`[n]` token ids, e.g. the one sampled token of a decode step, or draft tokens) to live
  /// sequence `seq`, reserving n slots (pending for the next build) and copying a shared or hashed partial last
  /// block first (copy-on-write: one copy, pending too). All or nothing: kNoCapacity changes nothing.
  /// Throws kUnknownSequence, kLimitExceeded (length would exceed max_tokens_per_seq()).
  AppendResult<Id> try_append(SeqId seq, std::span<const TokenId> tokens) {
    Sequence& q = live(seq, "try_append");
    if (q.table.num_tokens() + tokens.size() > max_tokens_per_seq_) {
      detail::raise(Errc::kLimitExceeded, "try_append: sequence " + std::to_string(seq) + " would reach " +
                                              std::to_string(q.table.num_tokens() + tokens.size()) +
                                              " tokens, above max_tokens_per_seq = " +
                                              std::to_string(max_tokens_per_seq_));
    }
    if (tokens.empty()) return {AppendStatus::kOk, {}, std::nullopt};
    detail::reserve_more(q.tokens, tokens.size());
    detail::reserve_more(pending_copies_, 1);
    const std::size_t first = q.pending_slots.size();
    Proxy pool{this};
    std::optional<copy_type> copy;
    if (!q.table.try_append(tokens.size(), pool, evictor(), q.pending_slots, copy)) {
      return {AppendStatus::kNoCapacity, {}, std::nullopt};
    }
    if (copy) {
      pending_copies_.push_back(*copy);
      ++stats_.cow_copies;
      // Unbuilt slots of earlier appends that point into the copied block now belong in its copy.
      const std::size_t bs = config_.block_size;
      const std::size_t old_len = q.table.num_tokens() - tokens.size();
      const std::size_t first_pending_pos = q.table.num_tokens() - q.pending_slots.size();
      for (std::size_t p = std::max(first_pending_pos, (old_len - 1) / bs * bs); p < old_len; ++p) {
        q.pending_slots[p - first_pending_pos] = q.table.slot(p);
      }
    }
    q.tokens.insert(q.tokens.end(), tokens.begin(), tokens.end());
    if (config_.enable_prefix_caching) {
      index_.hash_full_blocks(q.tokens, config_.block_size, q.keys.get(), q.hashes);
    }
    return {AppendStatus::kOk, std::span<const std::int64_t>(q.pending_slots).subspan(first), copy};
  }

  /// Fork live sequence `parent` into new sequence `child` (parallel sampling, beam search): the child's block
  /// table is a copy of the parent's, every block's refcount + 1, nothing allocated. The first append to a shared
  /// partial last block, by either side, copies it. Precondition: the parent has no unbuilt slots (fork after the
  /// step that computes them has been built). Throws kUnknownSequence (parent), kDuplicateSequence (child live, or
  /// child == parent).
  void fork(SeqId parent, SeqId child) {
    if (seqs_.contains(child)) {
      detail::raise(Errc::kDuplicateSequence, "fork: child sequence " + std::to_string(child) + " is already live");
    }
    const Sequence& p = live(parent, "fork");
    Sequence c(config_.block_size);
    c.tokens = p.tokens;
    c.hashes = p.hashes;
    c.num_registered = p.hashes.size();  // the parent registers the blocks it is writing
    c.keys = p.keys;
    c.table = p.table;  // copy first (may throw), take references after
    auto [it, inserted] = seqs_.try_emplace(child, std::move(c));
    (void)inserted;
    for (Id b : it->second.table.blocks()) alloc_.acquire(b);
  }

  /// Free live sequence `seq` (finished or aborted): release its blocks, last block first, and forget its pending
  /// slots. Full blocks stay cached until evicted. Throws kUnknownSequence (also on a double free).
  void free(SeqId seq) {
    Sequence& q = live(seq, "free");
    Proxy pool{this};
    q.table.release_all(pool);
    seqs_.erase(seq);
  }

  /// `free`, counted as a preemption (recompute: the engine re-admits the request later and its full blocks are
  /// likely still cached). Throws kUnknownSequence.
  void preempt(SeqId seq) {
    free(seq);
    ++stats_.preemptions;
  }

  /// Drop the last `n` tokens of live sequence `seq` (rejected speculative tokens). Blocks left empty are
  /// released last first; a partial block that is shared or cached stays intact and is copied on the next append.
  /// Throws kUnknownSequence, kLimitExceeded (n > the sequence's tokens).
  void rewind(SeqId seq, std::size_t n) {
    Sequence& q = live(seq, "rewind");
    if (n > q.table.num_tokens()) {
      detail::raise(Errc::kLimitExceeded, "rewind: n = " + std::to_string(n) + " exceeds sequence " +
                                              std::to_string(seq) + "'s " + std::to_string(q.table.num_tokens()) +
                                              " tokens");
    }
    const std::size_t len = q.table.num_tokens() - n;
    Proxy pool{this};
    q.table.rewind(n, pool);
    q.tokens.resize(len);
    q.hashes.resize(std::min(q.hashes.size(), len / config_.block_size));
    q.num_registered = std::min(q.num_registered, q.hashes.size());
    q.pending_slots.resize(q.pending_slots.size() - std::min(n, q.pending_slots.size()));
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Queries

  /// Cached prefix length in tokens of `prompt` (with `keys`) if it were admitted now, capped at
  /// `max_cached_tokens` (default prompt_len - 1). Pure: takes no reference, moves no LRU entry, counts nothing.
  /// 0 when prefix caching is off or the prompt is empty.
  [[nodiscard]] std::size_t lookup(std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                                   std::optional<std::size_t> max_cached_tokens = std::nullopt) const {
    if (!config_.enable_prefix_caching || prompt.empty()) return 0;
    const std::size_t bs = config_.block_size;
    const std::size_t cap = std::min(max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
    BlockHash parent = index_.root();
    std::size_t i = 0;
    for (; i < cap / bs; ++i) {
      parent = index_.hash_block(parent, prompt.subspan(i * bs, bs), i * bs, keys);
      if (!index_.find(parent)) break;
    }
    return i * bs;
  }

  /// Whether `seq` is live.
  [[nodiscard]] bool contains(SeqId seq) const { return seqs_.contains(seq); }
  /// Number of live sequences.
  [[nodiscard]] std::size_t num_sequences() const noexcept { return seqs_.size(); }
  /// Tokens of live sequence `seq`. Throws kUnknownSequence.
  [[nodiscard]] std::size_t num_tokens(SeqId seq) const { return live(seq, "num_tokens").table.num_tokens(); }
  /// Block ids of live sequence `seq` (`[num_blocks]`; invalidated by any non-const call). Throws kUnknownSequence.
  [[nodiscard]] std::span<const Id> block_ids(SeqId seq) const { return live(seq, "block_ids").table.blocks(); }
  /// Token ids of live sequence `seq` (`[num_tokens]`). Throws kUnknownSequence.
  [[nodiscard]] std::span<const TokenId> token_ids(SeqId seq) const { return live(seq, "token_ids").tokens; }
  /// Pending slots of `seq` (appended since its last build). Throws kUnknownSequence.
  [[nodiscard]] std::span<const std::int64_t> pending_slots(SeqId seq) const {
    return live(seq, "pending_slots").pending_slots;
  }
  /// Copy-on-write copies not yet handed out by build_batch_metadata.
  [[nodiscard]] std::span<const copy_type> pending_copies() const noexcept { return pending_copies_; }
  /// Visit every live sequence as f(SeqId, std::span<const Id> blocks, std::size_t num_tokens).
  template <class F>
  void for_each_sequence(F&& f) const {
    for (const auto& [id, q] : seqs_) f(id, q.table.blocks(), q.table.num_tokens());
  }

  /// Counters and block counts now.
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
  /// The allocator (read-only: refcounts, states, eviction order).
  [[nodiscard]] const allocator_type& allocator() const noexcept { return alloc_; }
  /// The prefix index (read-only).
  [[nodiscard]] const index_type& prefix_index() const noexcept { return index_; }

  // ---------------------------------------------------------------------------------------------------------------
  // Prefix cache maintenance and events

  /// Drop every block hash (e.g. after a weight update), making cached blocks free. Succeeds, returning true, only
  /// when no block is referenced (no live sequence and no pending copy); otherwise returns false and changes
  /// nothing.
  bool reset_prefix_cache() {
    if (alloc_.num_used_blocks() != 0) return false;
    alloc_.clear_hashes([](Id) {});
    index_.clear();
    if (config_.enable_events) push_event(KVEventType::kAllCleared);
    return true;
  }

  /// Move the recorded events (oldest first) to the end of `out`; returns how many. Events are recorded only with
  /// `enable_events`.
  std::size_t drain_events(std::vector<KVEvent>& out) {
    const std::size_t n = events_.size();
    out.insert(out.end(), std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
    events_.clear();
    return n;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Batch metadata

  /// Write this step's metadata for the sequences `batch` (in that order) into `buf` (see BatchMetadataBuffers for
  /// shapes and padding), then clear those sequences' pending slots and hand out every pending copy (releasing
  /// the references the copies held on their sources). Slots of sequence b occupy
  /// slot_mapping[qo_indptr[b], qo_indptr[b + 1]).
  /// Before writing, the batch's full blocks not yet registered are registered in the prefix index (their K/V is
  /// written by the kernels of the step this metadata describes). A full block whose hash is already registered
  /// to another block, and that only this sequence holds, is switched to the registered block and released; its
  /// slots in this step become -1 (deduplication; the registered block already holds, or earlier in this step's
  /// write_kv receives, the same K/V).
  /// Throws kUnknownSequence, kInvalidArgument (a sequence twice in `batch`), kBadShape (a buffer too small, or a
  /// sequence longer than max_blocks_per_seq): then nothing is written and nothing changes.
  BatchMetadataSizes build_batch_metadata(std::span<const SeqId> batch, const BatchMetadataBuffers& buf) {
    batch_scratch_.clear();
    batch_scratch_.reserve(batch.size());
    BatchMetadataSizes sz;
    sz.batch_size = batch.size();
    const auto fail = [&](Errc c, std::string msg) {
      for (Sequence* p : batch_scratch_) p->in_batch = false;
      detail::raise(c, "build_batch_metadata: " + std::move(msg));
    };
    for (SeqId id : batch) {
      const auto it = seqs_.find(id);
      if (it == seqs_.end()) fail(Errc::kUnknownSequence, "sequence " + std::to_string(id) + " is not live");
      Sequence& q = it->second;
      if (q.in_batch) fail(Errc::kInvalidArgument, "sequence " + std::to_string(id) + " appears twice");
      q.in_batch = true;
      batch_scratch_.push_back(&q);
      sz.num_indices += q.table.num_blocks();
      sz.num_new_tokens += q.pending_slots.size();
      if (!buf.block_tables.empty() && q.table.num_blocks() > static_cast<std::size_t>(buf.max_blocks_per_seq)) {
        fail(Errc::kBadShape, "sequence " + std::to_string(id) + " has " + std::to_string(q.table.num_blocks()) +
                                  " blocks > max_blocks_per_seq = " + std::to_string(buf.max_blocks_per_seq));
      }
    }
    sz.num_copies = pending_copies_.size();
    const auto need = [&](std::size_t have, std::size_t want, const char* name) {
      if (have != 0 && have < want) {
        fail(Errc::kBadShape, std::string(name) + " holds " + std::to_string(have) + " entries, needs " +
                                  std::to_string(want));
      }
    };
    const std::size_t B = batch.size();
    need(buf.indptr.size(), B + 1, "indptr");
    need(buf.indices.size(), sz.num_indices, "indices");
    need(buf.last_page_len.size(), B, "last_page_len");
    need(buf.seq_lens.size(), B, "seq_lens");
    need(buf.qo_indptr.size(), B + 1, "qo_indptr");
    need(buf.slot_mapping.size(), sz.num_new_tokens, "slot_mapping");
    need(buf.copies.size(), 2 * sz.num_copies, "copies");
    if (!buf.block_tables.empty()) {
      if (buf.max_blocks_per_seq <= 0) fail(Errc::kBadShape, "block_tables set but max_blocks_per_seq <= 0");
      need(buf.block_tables.size(), B * static_cast<std::size_t>(buf.max_blocks_per_seq), "block_tables");
    }
    if (sz.num_indices > 0 && buf.indices.empty() && !buf.indptr.empty()) {
      fail(Errc::kBadShape, "indptr is set but indices is empty");
    }

    // Validated. Register the batch's newly full blocks (their K/V is written by this step's kernels, before any
    // later step can read them), switching duplicates to the registered block. Then write. Nothing below throws.
    for (Sequence* p : batch_scratch_) register_full_blocks(*p);
    sz.num_copies = pending_copies_.size();
    std::int32_t blk = 0;
    std::int32_t tok = 0;
    for (std::size_t b = 0; b < B; ++b) {
      Sequence& q = *batch_scratch_[b];
      q.in_batch = false;
      const auto blocks = q.table.blocks();
      if (!buf.indptr.empty()) {
        buf.indptr[b] = blk;
        std::copy(blocks.begin(), blocks.end(), buf.indices.begin() + blk);
      }
      blk += static_cast<std::int32_t>(blocks.size());
      if (!buf.last_page_len.empty()) buf.last_page_len[b] = static_cast<std::int32_t>(q.table.last_block_len());
      if (!buf.block_tables.empty()) {
        auto row = buf.block_tables.subspan(b * static_cast<std::size_t>(buf.max_blocks_per_seq),
                                            static_cast<std::size_t>(buf.max_blocks_per_seq));
        std::copy(blocks.begin(), blocks.end(), row.begin());
        std::fill(row.begin() + static_cast<std::ptrdiff_t>(blocks.size()), row.end(), std::int32_t{0});
      }
      if (!buf.seq_lens.empty()) buf.seq_lens[b] = static_cast<std::int32_t>(q.table.num_tokens());
      if (!buf.qo_indptr.empty()) buf.qo_indptr[b] = tok;
      if (!buf.slot_mapping.empty()) {
        std::copy(q.pending_slots.begin(), q.pending_slots.end(), buf.slot_mapping.begin() + tok);
      }
      tok += static_cast<std::int32_t>(q.pending_slots.size());
      q.pending_slots.clear();
    }
    if (!buf.indptr.empty()) std::fill(buf.indptr.begin() + static_cast<std::ptrdiff_t>(B), buf.indptr.end(), blk);
    if (!buf.qo_indptr.empty()) {
      std::fill(buf.qo_indptr.begin() + static_cast<std::ptrdiff_t>(B), buf.qo_indptr.end(), tok);
    }
    if (!buf.last_page_len.empty()) {
      std::fill(buf.last_page_len.begin() + static_cast<std::ptrdiff_t>(B), buf.last_page_len.end(), 0);
    }
    if (!buf.seq_lens.empty()) std::fill(buf.seq_lens.begin() + static_cast<std::ptrdiff_t>(B), buf.seq_lens.end(), 0);
    if (!buf.slot_mapping.empty()) {
      std::fill(buf.slot_mapping.begin() + tok, buf.slot_mapping.end(), std::int64_t{-1});
    }
    if (!buf.copies.empty()) {
      for (std::size_t i = 0; i < pending_copies_.size(); ++i) {
        buf.copies[2 * i] = static_cast<std::int32_t>(pending_copies_[i].src);
        buf.copies[2 * i + 1] = static_cast<std::int32_t>(pending_copies_[i].dst);
      }
      std::fill(buf.copies.begin() + static_cast<std::ptrdiff_t>(2 * pending_copies_.size()), buf.copies.end(), -1);
    }
    // The copies are issued: release the references they held on their sources.
    copy_scratch_.swap(pending_copies_);
    pending_copies_.clear();
    for (const copy_type& c : copy_scratch_) release_block(c.src);
    copy_scratch_.clear();
    return sz;
  }

 private:
  struct Sequence {
    explicit Sequence(std::uint32_t block_size) : table(block_size) {}
    table_type table;
    std::vector<TokenId> tokens;                // [num_tokens]
    std::vector<BlockHash> hashes;              // hashes of every full block, [num_tokens / block_size]
    std::size_t num_registered = 0;             // leading full blocks this sequence need not register
    std::shared_ptr<const RequestKeys> keys;    // null = no extra keys
    std::vector<std::int64_t> pending_slots;    // slots of tokens appended since the last build
    bool in_batch = false;                      // scratch mark for build_batch_metadata
  };

  // The allocator as BlockTable sees it: releases go through release_block so pending copies stay consistent.
  struct Proxy {
    KVCacheManager* m;
    // Table holders only: a pending copy's reference on its source does not make the block shared (the copy
    // runs before this step's writes), so the one table still holding it may write in place.
    [[nodiscard]] std::uint32_t refcount(Id b) const { return m->alloc_.refcount(b) - m->pins(b); }
    [[nodiscard]] bool is_hashed(Id b) const { return m->alloc_.is_hashed(b); }
    [[nodiscard]] std::size_t num_available_blocks() const noexcept { return m->alloc_.num_available_blocks(); }
    template <class F>
    [[nodiscard]] std::optional<Id> try_allocate_one(F&& f) {
      return m->alloc_.try_allocate_one(f);
    }
    template <class F>
    [[nodiscard]] bool try_allocate(std::span<Id> out, F&& f) {
      return m->alloc_.try_allocate(out, f);
    }
    void acquire(Id b) { m->alloc_.acquire(b); }
    void release(Id b) { m->release_block(b); }
  };

  static CacheConfig checked(const CacheConfig& c) {
    if (c.num_blocks < 2) {
      detail::raise(Errc::kInvalidArgument, "CacheConfig.num_blocks = " + std::to_string(c.num_blocks) +
                                                ": need at least 2 (the null block + one usable)");
    }
    if (c.block_size == 0) detail::raise(Errc::kInvalidArgument, "CacheConfig.block_size = 0: must be positive");
    return c;
  }

  Sequence& live(SeqId seq, const char* what) {
    const auto it = seqs_.find(seq);
    if (it == seqs_.end()) {
      detail::raise(Errc::kUnknownSequence, std::string(what) + ": sequence " + std::to_string(seq) + " is not live");
    }
    return it->second;
  }
  const Sequence& live(SeqId seq, const char* what) const { return const_cast<KVCacheManager*>(this)->live(seq, what); }

  // Called by the allocator just before a cached block is reused: drop its hash.
  auto evictor() {
    return [this](Id b) {
      const auto h = index_.erase_block(b);
      if (h && config_.enable_events) {
        KVEvent& e = push_event(KVEventType::kBlockRemoved);
        e.hash = *h;
      }
    };
  }

  // Release one reference. A block that becomes unreferenced is no longer the destination of a pending copy
  // (nobody needs its contents), so that copy is dropped and its source reference released.
  void release_block(Id b) {
    alloc_.release(b);
    if (pending_copies_.empty() || alloc_.refcount(b) != 0) return;
    for (std::size_t i = 0; i < pending_copies_.size(); ++i) {
      if (pending_copies_[i].dst == b) {
        const Id src = pending_copies_[i].src;
        pending_copies_.erase(pending_copies_.begin() + static_cast<std::ptrdiff_t>(i));
        release_block(src);
        return;
      }
    }
  }

  // Number of pending copies reading block b (each holds a reference on it).
  [[nodiscard]] std::uint32_t pins(Id b) const noexcept {
    std::uint32_t n = 0;
    for (const copy_type& c : pending_copies_) n += c.src == b ? 1U : 0U;
    return n;
  }

  // Register the full blocks of `q` beyond q.num_registered (called when the metadata that writes them is built).
  // A block whose hash is already registered to another block is switched to that block when `q` is its only
  // table holder: its own copy is released and the pending slots that pointed into it become -1 (the registered
  // block holds the same K/V, written in an earlier step or earlier in this step's write_kv). A shared duplicate
  // stays as it is, unregistered.
  void register_full_blocks(Sequence& q) {
    if (!config_.enable_prefix_caching) return;
    const std::size_t bs = config_.block_size;
    for (std::size_t i = q.num_registered; i < q.hashes.size(); ++i) {
      const BlockHash& h = q.hashes[i];
      const Id own = q.table.blocks()[i];
      if (index_.hash_of(own)) continue;  // already registered (by a sequence sharing it)
      const Id reg = index_.insert(h, own);  // one map probe: inserts, or finds the registered block
      if (reg == own) {
        alloc_.set_hashed(own, true);
        if (config_.enable_events) record_stored(q, i, h);
        continue;
      }
      if (alloc_.refcount(own) - pins(own) != 1) continue;  // shared duplicate: leave it unregistered
      // Duplicate content: switch to the registered block, free ours.
      alloc_.acquire(reg);
      q.table.replace_block(i, reg);
      release_block(own);
      ++stats_.dedup_blocks;
      const std::size_t first_pending_pos = q.table.num_tokens() - q.pending_slots.size();
      for (std::size_t p = std::max(first_pending_pos, i * bs); p < (i + 1) * bs; ++p) {
        q.pending_slots[p - first_pending_pos] = -1;
      }
    }
    q.num_registered = q.hashes.size();
  }

  KVEvent& push_event(KVEventType t) {
    KVEvent& e = events_.emplace_back();
    e.seq_no = next_event_seq_no_++;
    e.type = t;
    return e;
  }

  void record_stored(const Sequence& q, std::size_t i, const BlockHash& h) {
    const std::size_t bs = config_.block_size;
    KVEvent& e = push_event(KVEventType::kBlockStored);
    e.hash = h;
    if (i > 0) e.parent_hash = q.hashes[i - 1];
    e.token_ids.assign(q.tokens.begin() + static_cast<std::ptrdiff_t>(i * bs),
                       q.tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * bs));
    if (q.keys) {
      e.adapter_id = q.keys->adapter_id;
      for (const auto& m : q.keys->multimodal) {
        if (m.offset_tokens < (i + 1) * bs && m.offset_tokens + m.length_tokens > i * bs) {
          e.multimodal_item_hashes.push_back(m.item_hash);
        }
      }
    }
  }

  CacheConfig config_;
  allocator_type alloc_;
  index_type index_;
  std::size_t max_tokens_per_seq_;
  std::unordered_map<SeqId, Sequence> seqs_;
  std::vector<copy_type> pending_copies_;  // each holds one reference on its src
  std::vector<copy_type> copy_scratch_;
  std::vector<Id> hit_scratch_;
  std::vector<Sequence*> batch_scratch_;
  std::vector<KVEvent> events_;
  std::uint64_t next_event_seq_no_ = 1;
  CacheStats stats_;
};

}  // namespace pagedkv
