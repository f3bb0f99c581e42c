// pagedkv/kv_cache_manager.hpp: the cache manager an engine's scheduler calls (admit, append, fork, free, rewind,
// lookup, swap, batch metadata) for one block pool shared by one or more KV-cache groups, over SequenceState (per
// sequence) + BlockAllocator + one PrefixHashIndex per group + HostTier + TransferQueue + EventLog. A plain
// full-attention model is the one-group case (docs/design.md "Reading order", docs/groups.md).
#pragma once

#include <algorithm>
#include <bit>
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
#include <pagedkv/cache_config.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/detail/admission_plan.hpp>
#include <pagedkv/detail/batch_build.hpp>
#include <pagedkv/detail/external_kv.hpp>
#include <pagedkv/detail/external_kv_handoff.hpp>
#include <pagedkv/detail/hit_search.hpp>
#include <pagedkv/detail/host_offload.hpp>
#include <pagedkv/detail/host_swap.hpp>
#include <pagedkv/detail/metadata_writer.hpp>
#include <pagedkv/detail/miss_cause.hpp>
#include <pagedkv/detail/copy_list.hpp>
#include <pagedkv/detail/device_pool.hpp>
#include <pagedkv/detail/group_coarse.hpp>
#include <pagedkv/detail/group_full.hpp>
#include <pagedkv/detail/group_recurrent.hpp>
#include <pagedkv/detail/group_window.hpp>
#include <pagedkv/detail/growth.hpp>
#include <pagedkv/detail/reserve.hpp>
#include <pagedkv/detail/stored_event.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/external_kv.hpp>
#include <pagedkv/external_kv_calls.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/host_tier.hpp>
#include <pagedkv/manager_results.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/request_keys.hpp>
#include <pagedkv/retention.hpp>
#include <pagedkv/sequence_state.hpp>
#include <pagedkv/stats.hpp>
#include <pagedkv/transfer_queue.hpp>

namespace pagedkv {

/// The KV-cache manager an inference engine's scheduler calls: one per KV pool, shared by the KV-cache groups of
/// `CacheConfig::groups` (one full-attention group when empty: every layer shares the block ids).
///
/// Behaviour (docs/contract.md sec. 2; PagedAttention, Kwon et al. SOSP'23; vLLM V1 prefix caching):
///  - `try_admit` looks up the prompt's longest cached prefix (capped so at least one token is computed), takes
///    the hit blocks (protecting them from eviction) and allocates the rest, all or nothing.
///  - `try_append` reserves slots for new tokens (one per decode step, or a chunk), copying a shared or hashed
///    partial last block first (copy-on-write: one copy, pending until the next build).
///  - A full block is registered in the prefix index by the `build_batch_metadata` call that issues the writes of
///    its K/V (so no request can ever hit a block whose K/V was never written: a sequence freed or preempted
///    before its step ran leaves nothing in the index). If an identical block is already registered, the sequence
///    switches to it and frees its own copy (no two cached blocks share a hash).
///  - `fork` shares every block (parallel sampling, beam search) of a *settled* parent (no unbuilt slot, no
///    pending copy into its table): a child never depends on a write or copy not yet issued, so no copy list ever
///    holds a block that is both a source and a destination. `free` / `preempt` release tail first.
///  - `build_batch_metadata` writes the step's page table, slot mapping and copy list into caller buffers.
///  - External KV (prefill/decode disaggregation, KV stores): blocks filled by another engine and blocks handed to
///    one, the calls of the base `ExternalKvCalls` (external_kv_calls.hpp: try_admit_external,
///    complete_external_fill, plan_import, finish_with_lease, leases, save pins).
/// A pending copy (src, dst) holds a reference on src until the metadata that carries it is built, so no block is
/// reused (and overwritten) while a copy still has to read it.
///
/// KV-cache groups (hybrid models: Gemma 2/3 and gpt-oss alternate sliding-window and full layers, Llama 4 adds
/// chunked-local layers; vLLM's KVCacheCoordinator over one SingleTypeKVCacheManager per group, TensorRT-LLM's
/// variable-window managers, SGLang's SWA radix cache). Per sequence: one token list, one chain of block hashes
/// (content addressing does not depend on the layer type), one built cursor, and per group a block table whose
/// leading entries may be the null block 0 (docs/groups.md):
///  - **Release rule.** After each build, a windowed group releases every block wholly before
///    `window.first_visible(min(num_built, num_known))` (built lookahead positions may still be rejected) and puts
///    the null block in its table (positions stay absolute; the kernels never read those pages). A sliding-window group growing by at most `chunk` tokens per build holds at most
///    `window_block_bound(g, chunk)` blocks per sequence.
///  - **Prefix hits.** One PrefixHashIndex per group. The hit is today's prefix walk with one full-attention group
///    and the fixed point over groups (detail::fixed_point_hit_blocks) otherwise; a windowed group takes only the
///    hit blocks its first computed query sees, the leading ones are null. A full block that can never serve a hit
///    in its group (detail::block_can_serve_hit) is not registered there.
///  - **Capacity** counts every group's blocks against the one pool, all or nothing; copy-on-write, fork, rewind
///    (never behind a released block), swap and resume (a host block belongs to one group: the host index keys a
///    group's block by its hash mixed with the group), events (KVEvent::group) and stats work per group.
///  - With one group, `build_batch_metadata(batch, buf)` writes its metadata; with several, one buffer set per group
///    (`build_batch_metadata(batch, per_group)`; the swap lists of the host tier go into group 0's buffers: block
///    ids are pool-wide).
///
/// Template parameters: `Hasher` (BlockHasher: Sha256Hasher default, Xxh3Hasher), `Id` (BlockIdType),
/// `Evict` (EvictionPolicy, LRU default) over every group's cached blocks, `HostEvict` (the host tier's).
/// Limits: at most 2^31 blocks and 2^31 - 1 tokens per sequence, and one build's block and token totals below
/// 2^31 (the batch metadata is int32: `kMaxMetadataValue`); each is checked with kLimitExceeded naming it.
/// Thread safety: one writer (the scheduler thread); const calls may run concurrently with each other (`lookup`
/// keeps no scratch state) but never with a non-const call. No global state: managers are independent.
/// Move: movable, not copyable. A move transfers every sequence; spans obtained from the source before the move
/// (block_ids, token_ids) stay valid and now view the destination's state; a moved-from manager may only be
/// destroyed or assigned to.
/// Errors: misuse throws `pagedkv::Error` (codes in error.hpp) and leaves the manager unchanged; expected outcomes
/// (no capacity, never fits, prefix miss) are values.
/// Cost: admission O(prompt blocks) (hashing dominates); append O(new tokens) plus one hash per filled block; fork,
/// free, rewind O(blocks of the sequence); build O(batch + blocks + new tokens); each times the number of groups.
/// None depends on pool size or on the number of cached blocks. No heap allocation per admission, growth or build
/// once the scratch buffers have grown (except the calls documented to allocate).
template <BlockHasher Hasher = Sha256Hasher, BlockIdType Id = std::uint32_t,
          EvictionPolicy<Id> Evict = LruEviction<Id>, EvictionPolicy<Id> HostEvict = Evict>
class KVCacheManager
    : public ExternalKvCalls<KVCacheManager<Hasher, Id, Evict, HostEvict>, Id> {  // external KV: its own part
  using external_calls = ExternalKvCalls<KVCacheManager, Id>;
  friend external_calls;  // the part reaches the sequence map, pool, layout and admission (self())

 public:
  using block_id_type = Id;
  using hasher_type = Hasher;
  using allocator_type = BlockAllocator<Id, Evict>;
  using index_type = PrefixHashIndex<Hasher, Id>;
  /// One group's part of the shared prefix index (prefix_index(g)); the mutable form is internal.
  using const_index_view = GroupPrefixIndexView<const index_type>;
  using table_type = BlockTable<Id>;
  using copy_type = BlockCopy<Id>;
  using sequence_type = SequenceState<Id>;
  using host_tier_type = HostTier<Hasher, Id, HostEvict>;
  using seq_map_type = std::unordered_map<SeqId, sequence_type>;
  using seq_node_type = typename seq_map_type::node_type;

  /// Most KV-cache groups per manager.
  static constexpr std::size_t kMaxGroups = 64;
  /// Freed sequences whose storage the manager keeps for later admissions (so an admission allocates nothing once
  /// warm), and the largest token capacity a kept one may have (tokens; larger ones are freed).
  static constexpr std::size_t kMaxSpareSequences = 64;
  static constexpr std::size_t kMaxSpareTokens = std::size_t{1} << 16;

  /// A manager for a pool described by `config`. Throws kInvalidArgument (num_blocks < 2, a block_size outside
  /// [1, kMaxBlockSize], more than kMaxGroups groups, a full group with window_tokens != 0, a windowed group with
  /// window_tokens 0 or > 2^31 - 1, num_layers 0, pool bytes overflowing size_t), kLimitExceeded (num_blocks >
  /// 2^31, max_tokens_per_seq > 2^31 - 1: the int32 batch metadata), each naming the value, before allocating
  /// anything.
  explicit KVCacheManager(const CacheConfig& config)
      : external_calls(config.num_blocks),
        config_(checked(config)),
        layout_(detail::group_layout(config_)),
        pool_(config_, layout_),
        build_(layout_),
        max_tokens_per_seq_(config_.max_tokens_per_seq != 0 ? config_.max_tokens_per_seq : kMaxMetadataValue),
        host_(config_.num_host_blocks, config_.hash_seed, layout_.num_groups,
              config_.enable_events) {
    if (config_.groups.empty()) config_.groups.push_back(KVCacheGroupSpec{});
    spare_.reserve(kMaxSpareSequences);
  }

  KVCacheManager(const KVCacheManager&) = delete;
  KVCacheManager& operator=(const KVCacheManager&) = delete;
  KVCacheManager(KVCacheManager&&) noexcept = default;
  KVCacheManager& operator=(KVCacheManager&&) noexcept = default;
  ~KVCacheManager() = default;

  [[nodiscard]] const CacheConfig& config() const noexcept { return config_; }
  /// Turn CacheConfig::deduplicate_blocks on or off for the builds that follow (an engine that reads a new
  /// sequence's table after its first build but keeps the ids of later growths, as vLLM's scheduler does, lets
  /// only the admission's build switch duplicates: pagedkv.vllm). Never throws.
  void set_deduplicate_blocks(bool on) noexcept {
    config_.deduplicate_blocks = on;
    pool_.set_deduplicate(on);
  }
  [[nodiscard]] std::uint32_t block_size() const noexcept { return config_.block_size; }
  /// Tokens per block of group g's pages (KVCacheGroupSpec::block_size, or the pool's block_size): what group g's
  /// block table, page table (last_page_len) and slot mapping count in. A multiple of block_size(), the match unit
  /// of hashes and hits. Precondition: g < num_groups().
  [[nodiscard]] std::uint32_t block_size(std::size_t g) const noexcept { return layout_.page_tokens[g]; }
  /// Per-sequence token limit in force (kMaxMetadataValue when none was configured). A prompt longer than the pool
  /// but within this limit is answered kNeverFits, not an error.
  [[nodiscard]] std::size_t max_tokens_per_seq() const noexcept { return max_tokens_per_seq_; }
  /// KV-cache groups (1 for a plain full-attention pool).
  [[nodiscard]] std::size_t num_groups() const noexcept { return layout_.num_groups; }
  /// The AttentionWindow of group g (what its kernels and decode plan take; off for full attention). A recurrent
  /// group has no attention: its window is the hit rule's (KVCacheGroupSpec::hit_window, 2 tokens).
  /// Precondition: g < num_groups().
  [[nodiscard]] const AttentionWindow& window(std::size_t g) const noexcept { return layout_.windows[g]; }
  /// Bytes of one pool block: max(page_size_bytes, every recurrent group's state_bytes) x max_g num_layers (every
  /// block the same size: a block is a K/V page or one state per layer slot).
  [[nodiscard]] std::size_t bytes_per_block() const noexcept {
    std::size_t m = 0, page = config_.page_size_bytes;
    for (const auto& g : config_.groups) {
      m = std::max<std::size_t>(m, g.num_layers);
      page = std::max(page, g.state_bytes);
    }
    return page * m;
  }
  /// Whether group g is a recurrent-state group (AttentionKind::kRecurrent). Precondition: g < num_groups().
  [[nodiscard]] bool is_recurrent(std::size_t g) const noexcept { return layout_.is_recurrent(g); }
  /// The footprint bound of a windowed group g growing by `chunk_tokens` per build: ceil((W - 1 + chunk) /
  /// block_size) + 1 blocks per sequence (chunked-local: C - 1 in place of W - 1); nullopt for a full or a recurrent
  /// group (a recurrent group holds its state plus the checkpoints its unbuilt positions will write).
  /// Throws kInvalidArgument for g >= num_groups().
  [[nodiscard]] std::optional<std::size_t> window_block_bound(std::size_t g, std::size_t chunk_tokens) const {
    check_group(g, "window_block_bound");
    if (!layout_.windows[g].enabled() || is_recurrent(g)) return std::nullopt;
    const std::size_t bs = config_.block_size;
    return (config_.groups[g].window_tokens - 1 + chunk_tokens + bs - 1) / bs + 1;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Admission and growth

  /// Admit sequence `seq` with prompt `prompt` (`[prompt_len]` token ids) and optional extra keys.
  /// Finds the longest cached prefix of full blocks (at most `opts.max_cached_tokens`), takes those blocks, and
  /// allocates blocks for the uncached tokens (all of them, or the first `opts.num_reserved_tokens`: chunked
  /// admission); their slots become pending for the next builds. All or nothing: on kNoCapacity / kNeverFits
  /// nothing changes (no refcount, no LRU position, no counter). kNeverFits: the whole prompt needs more blocks
  /// than the pool, however it is reserved. A preempted id admitted again counts as a re-admission. An empty prompt
  /// admits a sequence with no token and no K/V block (a recurrent group's state block only); its slots come from
  /// try_append / try_reserve_lookahead. Throws kDuplicateSequence (seq is live), kInvalidArgument (a multimodal
  /// item empty, unsorted or outside the prompt: MultimodalItem), kLimitExceeded (prompt_len > max_tokens_per_seq()).
  AdmitResult try_admit(SeqId seq, std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                        const AdmitOptions& opts = {}) {
    return admit_new(seq, prompt, keys, opts, "try_admit");
  }

  /// `try_admit` of a prompt hashed beforehand by `prepare_prompt`: no hashing, only the walk of the cache and the
  /// allocation, so an engine that retries an admission every step while the pool is full hashes each prompt once
  /// per request. Same outcomes and errors as try_admit; also kInvalidArgument when `prompt` was prepared by a
  /// manager with another hasher or seed (its chain root differs).
  AdmitResult try_admit(SeqId seq, const PreparedPrompt& prompt, const AdmitOptions& opts = {}) {
    return admit_prepared(seq, prompt, opts, "try_admit");
  }

  /// Validate `prompt` (with `keys`) and hash its full blocks once, for `try_admit` / `query_admit` retries. Pure;
  /// allocates the result (a copy of the tokens and keys, and 16 bytes per full block). Throws as try_admit for
  /// invalid input.
  [[nodiscard]] PreparedPrompt prepare_prompt(std::span<const TokenId> prompt, const RequestKeys* keys = nullptr) const {
    validate_prompt(prompt, keys, "prepare_prompt", nullptr);
    PreparedPrompt p;
    p.tokens.assign(prompt.begin(), prompt.end());
    if (keys != nullptr && !keys->empty()) p.keys = std::make_shared<const RequestKeys>(*keys);
    p.root = pool_.index().root();
    p.block_size = config_.block_size;
    if (config_.enable_prefix_caching) pool_.index().hash_full_blocks(prompt, config_.block_size, keys, p.hashes);
    return p;
  }

  /// Append `tokens` (`[n]` token ids, e.g. the one sampled token of a decode step) to live sequence `seq`,
  /// reserving n slots (pending for the next build) and copying a shared or hashed partial last block first
  /// (copy-on-write: one copy, pending too). All or nothing: kNoCapacity and kNeverFits change nothing.
  /// kNeverFits: the sequence would hold more blocks than the pool has even if every other sequence were preempted.
  /// Throws kUnknownSequence, kLimitExceeded (length would exceed max_tokens_per_seq()), kInvalidArgument (the
  /// sequence still has prompt tokens without slots, or uncommitted lookahead slots).
  AppendResult<Id> try_append(SeqId seq, std::span<const TokenId> tokens) {
    sequence_type& q = live(seq, "try_append");
    check_growable(q, seq, tokens.size(), "try_append");
    const std::size_t n = tokens.size();
    if (n == 0) return {AppendStatus::kOk, {}, std::nullopt, 0};
    const CapacityQuery cq = query_growth(q, n);
    if (!cq.fits()) return {static_cast<AppendStatus>(cq.status), {}, std::nullopt, cq.num_missing_blocks};
    prepare_growth(q, n);
    if (config_.enable_prefix_caching) {
      detail::reserve_more(q.hashes, (q.num_known() + n) / config_.block_size - q.hashes.size());
    }
    // Hash the blocks the new tokens fill (may throw for very large blocks, which encode on the heap): undone on
    // failure, before the table changes.
    detail::reserve_more(q.tokens, n);
    append_known_tokens(q, tokens);
    return commit_growth(q, n, cq.num_blocks);
  }

  /// Chunked prefill: reserve slots for the next `n` prompt tokens of `seq` that have none yet (admitted with
  /// `AdmitOptions::num_reserved_tokens`), all or nothing, copying a hashed partial tail first if needed. The
  /// slots are pending for the next builds. kNoCapacity is the engine's preemption signal (vLLM's
  /// allocate_slots returning None).
  /// Throws kUnknownSequence, kInvalidArgument (n > the prompt tokens without slots).
  AppendResult<Id> try_reserve(SeqId seq, std::size_t n) {
    sequence_type& q = live(seq, "try_reserve");
    if (n > q.num_unslotted()) {
      detail::raise(Errc::kInvalidArgument, "try_reserve: sequence " + std::to_string(seq) + " has " +
                                                std::to_string(q.num_unslotted()) +
                                                " prompt tokens without slots, asked for " + std::to_string(n));
    }
    if (n == 0) return {AppendStatus::kOk, {}, std::nullopt, 0};
    const CapacityQuery cq = query_growth(q, n);
    if (!cq.fits()) return {static_cast<AppendStatus>(cq.status), {}, std::nullopt, cq.num_missing_blocks};
    prepare_growth(q, n);
    return commit_growth(q, n, cq.num_blocks);
  }

  /// Keep the state after the first `pos` tokens of `seq` as a checkpoint of every recurrent-state group, besides
  /// those of the interval: the end of a chat turn or of a tool call's output, where a later request sharing the
  /// prefix will resume (docs/groups.md "Recurrent-state groups"). The build that computes token pos - 1 writes it
  /// (listed with the others in `checkpoint_positions` / `checkpoint_blocks`), then it is registered and cached like
  /// them. `pos` must be a block boundary (a checkpoint is keyed by the chain hash of the blocks before it) inside
  /// (num_built, min(num_slotted, num_known)]: its tokens have slots and known ids, its state is not computed yet.
  /// Returns kOk (also when a checkpoint is kept there already), or kNoCapacity, changing nothing, when the pool
  /// lacks the block each recurrent group needs. Throws kUnknownSequence; kInvalidArgument (no recurrent group,
  /// prefix caching off, pos not a multiple of block_size, pos <= num_built: that state is computed already and
  /// gone); kLimitExceeded (pos beyond the positions with slots, or inside lookahead slots); nothing changes then.
  AppendStatus mark_checkpoint(SeqId seq, std::size_t pos) {
    sequence_type& q = live(seq, "mark_checkpoint");
    detail::refuse_state_table(layout_, "mark_checkpoint", seq);
    const std::size_t bs = config_.block_size;
    const auto bad = [&](Errc c, const std::string& why) {
      detail::raise(c, "mark_checkpoint: sequence " + std::to_string(seq) + ", position " + std::to_string(pos) +
                           ": " + why);
    };
    if (!layout_.any_recurrent) bad(Errc::kInvalidArgument, "the manager has no recurrent-state group");
    if (!config_.enable_prefix_caching) bad(Errc::kInvalidArgument, "prefix caching is off (no checkpoints)");
    if (pos % bs != 0) bad(Errc::kInvalidArgument, "not a multiple of the block size " + std::to_string(bs));
    if (pos > q.num_slotted()) {
      bad(Errc::kLimitExceeded, "beyond the sequence's " + std::to_string(q.num_slotted()) + " positions with slots");
    }
    if (pos > q.num_known()) {
      bad(Errc::kLimitExceeded, "inside the lookahead slots (after the " + std::to_string(q.num_known()) +
                                    " known tokens): their token ids are not known");
    }
    if (pos <= q.num_built) {
      bad(Errc::kInvalidArgument, "at or before the " + std::to_string(q.num_built) +
                                      " built positions: that state is computed already");
    }
    const std::size_t i = pos / bs - 1;
    std::size_t need = 0;
    for (std::size_t g = 1; g < layout_.num_groups; ++g) need += is_recurrent(g) ? recurrent(g).checkpoint_need(q, i) : 0;
    if (need > pool_.alloc().num_available_blocks()) return AppendStatus::kNoCapacity;
    reserve_for_allocations(need, 0);
    for (std::size_t g = 1; g < layout_.num_groups; ++g) {
      if (is_recurrent(g)) recurrent(g).keep_checkpoint(q, i, taker(g));
    }
    pool_.note_peak();
    return AppendStatus::kOk;
  }

  /// Speculative decoding: reserve `k` lookahead slots after the last token of `seq` for tokens whose ids the host
  /// does not know yet (draft tokens proposed on the GPU), all or nothing. The builds emit them like any pending
  /// slot (the verification step writes the drafts' K/V there); `commit_lookahead` later keeps the accepted ones
  /// and rewinds the rest. A block holding a lookahead position is never hashed or registered until its ids are
  /// committed. With a recurrent-state group, each lookahead slot also takes one *draft state* block per such group
  /// (`GroupTableState::drafts`): the build writes the state after each draft token there (listed in the checkpoint
  /// outputs; see BatchMetadataBuffers::state_out), so that commit_lookahead can keep the state after the last
  /// accepted draft, whatever the verification accepts (vLLM keeps per-draft Mamba states for speculative decoding
  /// the same way). Throws kUnknownSequence, kLimitExceeded (length would exceed max_tokens_per_seq()),
  /// kInvalidArgument (prompt tokens without slots, or lookahead already outstanding: commit it first).
  AppendResult<Id> try_reserve_lookahead(SeqId seq, std::size_t k) {
    sequence_type& q = live(seq, "try_reserve_lookahead");
    detail::refuse_state_table(layout_, "try_reserve_lookahead", seq);
    check_growable(q, seq, k, "try_reserve_lookahead");
    if (k == 0) return {AppendStatus::kOk, {}, std::nullopt, 0};
    const CapacityQuery cq = query_growth(q, k, k);
    if (!cq.fits()) return {static_cast<AppendStatus>(cq.status), {}, std::nullopt, cq.num_missing_blocks};
    prepare_growth(q, k, k);
    if (layout_.any_recurrent) {  // the growth's copies (one per group) + a copy per recurrent group (below)
      pool_.copies().reserve_room(2 * layout_.num_groups);
    }
    AppendResult<Id> r = commit_growth(q, k, cq.num_blocks);
    for (std::size_t g = 1; g < layout_.num_groups && layout_.any_recurrent; ++g) {  // room reserved above
      if (is_recurrent(g)) recurrent(g).take_drafts(pool_, q, k, taker(g));
    }
    pool_.note_peak();
    q.num_lookahead = k;
    return r;
  }

  /// Resolve the outstanding lookahead of `seq`: the first `accepted.size()` lookahead positions hold the accepted
  /// token ids (their K/V, written by the verification step, is kept), the remaining positions are rewound
  /// (blocks left empty are released). Blocks that become full with known ids and whose writes have been issued
  /// are registered in the prefix index now (deduplicated as at a build). Rejection of every draft is
  /// `accepted` empty. Throws kUnknownSequence, kInvalidArgument (accepted.size() > the lookahead slots).
  void commit_lookahead(SeqId seq, std::span<const TokenId> accepted) {
    sequence_type& q = live(seq, "commit_lookahead");
    detail::refuse_state_table(layout_, "commit_lookahead", seq);
    const std::size_t a = accepted.size();
    if (a > q.num_lookahead) {
      detail::raise(Errc::kInvalidArgument, "commit_lookahead: sequence " + std::to_string(seq) + " accepts " +
                                                std::to_string(a) + " tokens but has " +
                                                std::to_string(q.num_lookahead) + " lookahead slots");
    }
    const std::size_t bs = config_.block_size;
    const std::size_t old_known = q.num_known();
    const std::size_t old_hashes = q.hashes.size();
    detail::reserve_more(q.tokens, a);
    std::size_t max_reg = 0;
    if (config_.enable_prefix_caching) {
      detail::reserve_more(q.hashes, (old_known + a) / bs - std::min(old_hashes, (old_known + a) / bs));
      for (std::size_t g = 0; g < layout_.num_groups; ++g) {
        max_reg = std::max(max_reg, (old_known + a) / bs - std::min((old_known + a) / bs, q.registered_of(g)));
      }
    }
    // (a coarse page re-key: two events)
    pool_.events().reserve_more(max_reg * layout_.num_groups * (layout_.any_coarse ? 4 : 1));
    pool_.switched().clear();
    pool_.switched().reserve(max_reg);
    if (layout_.any_recurrent) pool_.copies().reserve_room(layout_.num_groups);  // a copy a group (resolve_drafts)
    append_known_tokens(q, accepted);
    // Nothing below throws.
    const std::size_t rejected = q.num_lookahead - a;
    q.num_lookahead = 0;
    for (std::size_t g = 1; g < layout_.num_groups && layout_.any_recurrent; ++g) {
      if (is_recurrent(g)) recurrent(g).resolve_drafts(pool_, q, old_known, a);
    }
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {
      auto pool = pool_.template table_allocator<false>(layout_, g);
      q.table_of(g).rewind(rejected, pool);
      if (is_recurrent(g)) recurrent(g).null_partial_checkpoint(pool_, q);
    }
    q.num_built = std::min(q.num_built, q.num_slotted());
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {  // the accepted blocks whose writes were issued
      pool_.switched().clear();
      register_full_blocks(q, g);
    }
    if (layout_.any_recurrent) release_out_of_window(q);  // written checkpoints of accepted positions go to the cache
  }

  /// Fork live sequence `parent` into new sequence `child` (parallel sampling, beam search): the child's block
  /// table is a copy of the parent's, every block's refcount + 1, nothing allocated. The first append to a shared
  /// partial last block, by either side, copies it; so does the first growth of either side for the working state
  /// of a recurrent group (one copy, in that group's copy list).
  /// Throws kUnknownSequence (parent), kDuplicateSequence (child live, or child == parent), kInvalidArgument when
  /// the parent is not settled (slots not yet built, prompt tokens without slots, lookahead outstanding, or a
  /// copy-on-write into its table not yet handed out: fork after the build of the step that wrote them, as
  /// engines do after prefill).
  void fork(SeqId parent, SeqId child) {
    if (seqs_.contains(child) || swapped_.contains(child)) {
      detail::raise(Errc::kDuplicateSequence, "fork: child sequence " + std::to_string(child) + " is already live");
    }
    const sequence_type& p = live(parent, "fork");
    if (!settled(p)) {
      detail::raise(Errc::kInvalidArgument,
                    "fork: parent sequence " + std::to_string(parent) + " has unbuilt state (" +
                        std::to_string(p.num_pending()) + " unbuilt slots, " + std::to_string(p.num_unslotted()) +
                        " prompt tokens without slots, " + std::to_string(p.num_lookahead) + " lookahead slots, " +
                        std::to_string(p.num_pending_copies) + " pending copy-on-write copies" +
                        (has_filling_block(p) ? ", host copies into its blocks not completed" : "") +
                        "): build the step's metadata before forking");
    }
    sequence_type c = p;  // every group's table, cursors, hashes, keys: copy first (may throw), references after
    c.in_batch = false;
    auto [it, inserted] = seqs_.try_emplace(child, std::move(c));
    (void)inserted;
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {
      for (Id b : it->second.table_of(g).blocks()) {
        if (b != Id{0}) pool_.acquire_block(b);
      }
      if (g > 0) {
        const GroupTableState<Id>& st = it->second.other_groups[g - 1];
        if (st.state != Id{0}) pool_.acquire_block(st.state);
        if (st.last_block != Id{0}) pool_.acquire_block(st.last_block);
      }
    }
  }

  /// Free sequence `seq` (finished or aborted), live or swapped: release its blocks, last block first, and forget
  /// its pending slots. Full blocks stay cached until evicted. Copies in flight keep their own pins: a block a copy
  /// still reads or fills is released when the copy completes. Throws kUnknownSequence (also on a double free).
  void free(SeqId seq) {
    if (!swapped_.empty() && free_swapped(seq)) return;
    sequence_type& q = live(seq, "free");
    if (ext_.num_fills() != 0) [[unlikely]] abort_external_fill(seq);  // external KV: an orphan hold
    // (last checkpoints registered on the way out)
    if (layout_.any_recurrent) pool_.events().reserve_more(layout_.num_groups);
    release_all_groups(q);
    recycle(seqs_.extract(seq));
  }

  /// Preempt running sequence `seq` (vLLM SOSP'23 sec. 4.5). kRecompute: as `preempt(seq)`. kSwap: copy its blocks
  /// to the host tier and free its device blocks; `try_resume(seq)` brings it back. A full block whose hash the host
  /// tier already holds is shared, not copied; the copies are this manager's next swap_out list (they read the
  /// blocks before the step writes anything into them: the device blocks are reusable at once). All or nothing:
  /// returns false, changing nothing, when the host tier lacks free or evictable blocks (preempt by recompute
  /// then). A recurrent group's working state is copied too (its last checkpoint is registered and released, as
  /// at a free). Counted as a preemption. Throws kUnknownSequence; kInvalidArgument for kSwap without a host tier,
  /// or when the sequence is not settled (unbuilt slots, prompt tokens
  /// without slots, lookahead, or a copy into its table outstanding: swap after the step that computed it has been
  /// built).
  bool preempt(SeqId seq, PreemptMode mode) {
    if (mode == PreemptMode::kRecompute) {
      preempt(seq);
      return true;
    }
    sequence_type& q = live(seq, "preempt");
    detail::refuse_state_table(layout_, "preempt (swap)", seq);
    if (!host_) detail::raise(Errc::kInvalidArgument, "preempt: swapping sequence " + std::to_string(seq) +
                                                          " needs a host tier (CacheConfig.num_host_blocks)");
    if (!settled(q)) {
      detail::raise(Errc::kInvalidArgument, "preempt: sequence " + std::to_string(seq) +
                                                " is not settled (unbuilt slots, lookahead or a copy outstanding): "
                                                "swap it after its step's metadata was built and its copies completed");
    }
    // Plan: host blocks to share (the hash is there) or to fill (a copy each), every group's non-null blocks, and
    // the recurrent groups' working states (detail/host_swap.hpp).
    const std::size_t nb = q.table.num_blocks();  // every group's table has as many entries
    const auto table = [&](std::size_t g) { return q.table_of(g).blocks(); };
    const auto state = [&](std::size_t g) {
      return is_recurrent(g) && q.other_groups[g - 1].state_valid ? q.other_groups[g - 1].state : Id{0};
    };
    const auto to_fill = detail::plan_swap_out(host_, pool_, layout_.num_groups, table, state);
    if (!to_fill) return false;
    // Commit. Reserve first: nothing below throws.
    SwappedSequence sw{sequence_type(config_.block_size), {}, q.num_slotted(), {}};
    sw.host_blocks.assign(layout_.num_groups * nb, Id{0});
    if (layout_.any_recurrent) sw.states.assign(layout_.num_groups, Id{0});
    host_.transfers().reserve_more(*to_fill);
    pool_.events().reserve_more(*to_fill + layout_.num_groups);  // + the last checkpoints registered by the release
    auto [it, inserted] = swapped_.try_emplace(seq, std::move(sw));
    SwappedSequence& dst = it->second;
    detail::swap_out(host_, pool_, stats_, layout_.num_groups, nb, table, state, std::span<Id>(dst.host_blocks),
                     std::span<Id>(dst.states));
    release_all_groups(q);
    dst.state = std::move(q);
    seqs_.erase(seq);
    ++stats_.preemptions;
    return true;
  }

  /// Resume swapped sequence `seq`: device blocks again, each block copied back from the host tier (this
  /// manager's next swap_in list) unless the device pool still caches its hash. All or nothing. Returns kAdmitted
  /// (num_cached_tokens: the sequence's tokens; num_host_cached_tokens: those of them in blocks copied back, a
  /// partial last block counting its tokens only, so num_host_cached_tokens <= num_cached_tokens), kNoCapacity /
  /// kNeverFits as admission does, or kTransferPending while a copy that filled one of its host blocks has not
  /// completed. Its positions are built (nothing to compute); a build issues the copies. Throws
  /// kUnknownSequence when `seq` is not swapped.
  AdmitResult try_resume(SeqId seq) {
    const auto sw = swapped_.find(seq);
    if (sw == swapped_.end()) {
      detail::raise(Errc::kUnknownSequence, "try_resume: sequence " + std::to_string(seq) + " is not swapped out");
    }
    SwappedSequence& s = sw->second;
    const std::size_t n = s.host_blocks.size();  // [groups x blocks], 0 = a null entry of a windowed group
    const std::size_t nb = n / layout_.num_groups;
    const std::size_t bs = config_.block_size;
    const detail::ResumeNeed need = detail::resume_need(
        host_, pool_, s, layout_.num_groups,
        [&](std::size_t g) { return is_recurrent(g) ? recurrent(g).state_blocks() : std::size_t{0}; }, hit_scratch_);
    if (need.status != AdmitStatus::kAdmitted) return {need.status, 0, 0, 0, need.missing};
    const std::size_t to_fill = need.to_fill, fresh = need.fresh;  // fresh: recurrent groups' states, checkpoints
    // Commit. Reserve first.
    auto [it, inserted] = seqs_.try_emplace(seq, sequence_type(config_.block_size, layout_.num_groups, layout_.page_tokens));
    if (!inserted) {  // cannot happen: a swapped id is not live (admission refuses a swapped id)
      detail::raise(Errc::kDuplicateSequence, "try_resume: sequence " + std::to_string(seq) + " is live");
    }
    sequence_type& q = it->second;
    try {
      reserve_for_allocations(to_fill + fresh, to_fill + fresh);
      onboard_scratch_.assign(n, Id{0});
    } catch (...) {
      seqs_.erase(it);
      throw;
    }
    // of the sequence's tokens, those in blocks copied back from the host tier
    const std::size_t host_tokens =
        detail::resume(host_, pool_, stats_, std::span<const Id>(s.host_blocks), nb, s.num_tokens, bs,
                       std::span<const Id>(hit_scratch_), std::span<Id>(onboard_scratch_),
                       [this](std::size_t g) { return allocate_one(g); });
    const std::size_t num_tokens = s.num_tokens;
    q = std::move(s.state);
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {
      q.table_of(g).assign(std::span<const Id>(onboard_scratch_).subspan(g * nb, nb), num_tokens);
      q.registered_of(g) = q.hashes.size();  // device hits are registered, copied blocks when their copy completes
    }
    q.num_built = num_tokens;
    for (std::size_t g = 1; g < layout_.num_groups; ++g) {  // working states copied back; the zero or hit state stays so
      if (!is_recurrent(g)) continue;
      recurrent(g).resume_states(q, s.states[g], taker(g), [&](Id b, Id from) {
        host_.queue_fill(pool_, stats_, b, from, TransferKind::kSwapIn, nullptr, false, g);
      });
    }
    detail::release_swapped(host_, std::span<const Id>(s.host_blocks), std::span<const Id>(s.states));
    swapped_.erase(sw);
    pool_.note_peak();
    return {AdmitStatus::kAdmitted, num_tokens, host_tokens, to_fill + fresh, 0};
  }

  /// `free`, counted as a preemption (recompute: the engine re-admits the request later under the same id and its
  /// full blocks are likely still cached; that admission is counted as a re-admission). The manager remembers the
  /// id until it is admitted again (8-16 bytes per preempted id). Throws kUnknownSequence.
  void preempt(SeqId seq) {
    (void)live(seq, "preempt");  // kUnknownSequence before anything changes
    preempted_.insert(seq);      // may throw bad_alloc, before anything changed
    free(seq);                   // cannot fail now
    ++stats_.preemptions;
  }

  /// Drop the last `n` tokens of live sequence `seq` (rejected speculative tokens appended with try_append, or
  /// outstanding lookahead slots, which go first). Blocks left empty are released in every group, last first; a
  /// partial block that is shared or cached stays intact and is copied on the next append. Only as far back as
  /// every windowed group still holds what the next query needs: a block released when the window moved past it
  /// cannot come back, and never behind the built positions with a recurrent-state group (its state is updated in
  /// place). Throws kUnknownSequence, kLimitExceeded (n > the sequence's tokens, lookahead included, the rewind
  /// would need a released block, or built positions of a recurrent group: the message names the group); nothing
  /// changes then.
  void rewind(SeqId seq, std::size_t n) {
    sequence_type& q = live(seq, "rewind");
    detail::refuse_state_table(layout_, "rewind", seq);
    if (ext_.num_fills() != 0) [[unlikely]] ext_.refuse_waiting(std::span<const SeqId>(&seq, 1), "rewind");  // external KV
    const std::size_t length = q.num_known() + q.num_lookahead;
    if (n > length) {
      detail::raise(Errc::kLimitExceeded, "rewind: n = " + std::to_string(n) + " exceeds sequence " +
                                              std::to_string(seq) + "'s " + std::to_string(length) + " tokens");
    }
    const std::size_t drop_lookahead = std::min(n, q.num_lookahead);
    const std::size_t len = q.num_known() - (n - drop_lookahead);  // known tokens kept
    const std::size_t keep_slotted = std::min(q.num_slotted(), len + q.num_lookahead - drop_lookahead);
    if (!layout_.simple) detail::check_rewind_floor(layout_, config_, q, seq, len, keep_slotted);  // windows, states
    apply_retention(q, (keep_slotted + config_.block_size - 1) / config_.block_size);
    q.num_lookahead -= drop_lookahead;
    const std::size_t drop = q.num_slotted() - std::min(q.num_slotted(), len + q.num_lookahead);
    if (layout_.any_coarse) pool_.events().reserve_more(layout_.num_groups);
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {
      auto pool = pool_.template table_allocator<false>(layout_, g);
      BlockTable<Id>& t = q.table_of(g);
      t.rewind(drop, pool);
      visit_kind(g, [&](const auto& kind) { kind.after_rewind(pool_, q, len / config_.block_size); });
    }
    q.tokens.resize(len);
    q.hashes.resize(std::min(q.hashes.size(), len / config_.block_size));
    for (std::size_t g = 0; g < layout_.num_groups; ++g) q.registered_of(g) = std::min(q.registered_of(g), q.hashes.size());
    q.num_built = std::min(q.num_built, q.num_slotted());
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Capacity queries (pure: nothing changes, nothing is counted)

  /// What `try_admit(seq, prompt, keys, opts)` would take now: status (kFits = would be admitted), blocks taken
  /// from the pool, blocks missing, cached tokens. Hashes the prompt (as admission does).
  /// Throws as try_admit for invalid input (not for a live id: no id is given).
  [[nodiscard]] CapacityQuery query_admit(std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                                          const AdmitOptions& opts = {}) const {
    validate_prompt(prompt, keys, "query_admit", nullptr);
    if (opts.retention) validate_retention(*opts.retention, "query_admit");
    std::vector<BlockHash> hashes;
    PlanScratch scratch;
    return plan_admit_into(prompt, keys, opts, hashes, false, scratch).query;
  }
  /// `query_admit` of a prompt hashed by `prepare_prompt` (no hashing). Throws kInvalidArgument for a prompt
  /// prepared by a manager with another hasher or seed, or an invalid `opts.retention`.
  [[nodiscard]] CapacityQuery query_admit(const PreparedPrompt& prompt, const AdmitOptions& opts = {}) const {
    check_prepared(prompt, "query_admit");
    if (opts.retention) validate_retention(*opts.retention, "query_admit");
    PlanScratch scratch;
    return plan_admit_into(prompt.tokens, prompt.keys.get(), opts, ready_hashes(prompt), true, scratch).query;
  }

  /// What growing live sequence `seq` by `n` slots would take now (`try_append` of n tokens, `try_reserve(n)` or
  /// `try_reserve_lookahead(n)`): new blocks plus a copy-on-write of the tail. A lookahead of n also takes n draft
  /// states per recurrent-state group, not counted here. Throws kUnknownSequence.
  [[nodiscard]] CapacityQuery query_append(SeqId seq, std::size_t n) const {
    const sequence_type& q = live(seq, "query_append");
    if (n == 0) return {};
    return query_growth(q, n);
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Queries

  /// Cached prefix length in tokens of `prompt` (with `keys`) if it were admitted now, capped at
  /// `max_cached_tokens` (default prompt_len - 1). Pure: takes no reference, moves no LRU entry, counts nothing;
  /// safe to call from several threads at once (not concurrently with a non-const call).
  /// 0 when prefix caching is off or the prompt is empty. Throws kInvalidArgument for invalid keys (as try_admit).
  [[nodiscard]] std::size_t lookup(std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                                   std::optional<std::size_t> max_cached_tokens = std::nullopt) const {
    validate_request_keys(keys, prompt.size(), "lookup");
    if (!config_.enable_prefix_caching || prompt.empty()) return 0;
    if (!layout_.simple) {  // the fixed point over groups (allocates)
      AdmitOptions o;
      o.max_cached_tokens = max_cached_tokens;
      std::vector<BlockHash> hashes;
      PlanScratch scratch;
      return plan_admit_into(prompt, keys, o, hashes, false, scratch).query.num_cached_tokens;
    }
    const std::size_t cap = std::min(max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
    return detail::one_group_lookup(pool_.index(), host_.get(), prompt, config_.block_size, cap, keys);
  }

  /// Why admitting `prompt` (with `keys`, `opts`) now would hit what it hits (issue 20, "hits that explain
  /// themselves"): the hit in tokens (= lookup), how much of it the host tier serves, each group's cached run from
  /// block 0, and the first cause that stops the hit (MissCause, with the block and the group). Pure and on demand:
  /// admissions pay nothing for it. Cost: one probe per (group, full block) in each tier, plus hashing the prompt
  /// again without its extra keys when a miss could be a key mismatch. Allocates. Evicted and never-stored blocks
  /// are both kNotCached (the manager keeps no history of evicted hashes). Throws as query_admit for invalid input.
  [[nodiscard]] AdmitExplanation explain_admit(std::span<const TokenId> prompt, const RequestKeys* keys = nullptr,
                                               const AdmitOptions& opts = {}) const {
    validate_prompt(prompt, keys, "explain_admit", nullptr);
    return detail::explain_admission(pool_, host_, layout_, config_, prompt, keys, opts);
  }

  /// Whether `seq` is live.
  [[nodiscard]] bool contains(SeqId seq) const { return seqs_.contains(seq); }
  /// Number of live sequences.
  [[nodiscard]] std::size_t num_sequences() const noexcept { return seqs_.size(); }
  /// Tokens of live sequence `seq` (positions with slots). Throws kUnknownSequence.
  [[nodiscard]] std::size_t num_tokens(SeqId seq) const { return live(seq, "num_tokens").num_slotted(); }
  /// Block ids of live sequence `seq` (`[num_blocks]`; group 0's with several groups). Valid until the next
  /// non-const call on the manager. Throws kUnknownSequence.
  [[nodiscard]] std::span<const Id> block_ids(SeqId seq) const { return live(seq, "block_ids").table.blocks(); }
  /// Group g's block table of `seq` (`[ceil(num_tokens / block_size)]`, the null block 0 for released or
  /// never-taken leading blocks of a windowed group). Valid until the next non-const call. Throws
  /// kUnknownSequence, kInvalidArgument (g >= num_groups()).
  [[nodiscard]] std::span<const Id> block_ids(SeqId seq, std::size_t g) const {
    check_group(g, "block_ids");
    return live(seq, "block_ids").table_of(g).blocks();
  }
  /// Leading null blocks of group g's table of `seq` (released, or before the window at a prefix hit). Throws
  /// kUnknownSequence, kInvalidArgument (g).
  [[nodiscard]] std::size_t num_null_blocks(SeqId seq, std::size_t g) const {
    check_group(g, "num_null_blocks");
    return live(seq, "num_null_blocks").released_of(g);
  }
  /// The block of `seq`'s working state in recurrent group g (held from admission to free; a fork shares it until
  /// the next growth of either side copies it). Throws kUnknownSequence, kInvalidArgument (g is not a recurrent
  /// group).
  [[nodiscard]] Id state_block(SeqId seq, std::size_t g) const {
    check_group(g, "state_block");
    if (!is_recurrent(g)) {
      detail::raise(Errc::kInvalidArgument, "state_block: group " + std::to_string(g) + " (" +
                                                to_string(config_.groups[g].kind) + ") is not a recurrent group");
    }
    return live(seq, "state_block").other_groups[g - 1].state;
  }
  /// Positions of `seq` whose writes a build issued (or prefix hits). Throws kUnknownSequence.
  [[nodiscard]] std::size_t num_built(SeqId seq) const { return live(seq, "num_built").num_built; }
  /// Token ids of live sequence `seq` (`[num_tokens]`). Valid until the next non-const call on the manager.
  /// Throws kUnknownSequence.
  [[nodiscard]] std::span<const TokenId> token_ids(SeqId seq) const { return live(seq, "token_ids").tokens; }
  /// Slots of the pending (unbuilt) positions of `seq`, in position order (`[num_pending]`), as the block table
  /// holds them now: what a build scheduling them all would emit, before deduplication; -1 for a position whose
  /// block is null (a window group's block an open fill leaves out: no kernel writes it). A new vector: valid
  /// forever. Throws kUnknownSequence.
  [[nodiscard]] std::vector<std::int64_t> pending_slots(SeqId seq) const { return pending_slots(seq, 0); }
  /// `pending_slots` of group g. Throws kUnknownSequence, kInvalidArgument (g >= num_groups()).
  [[nodiscard]] std::vector<std::int64_t> pending_slots(SeqId seq, std::size_t g) const {
    check_group(g, "pending_slots");
    const sequence_type& q = live(seq, "pending_slots");
    std::vector<std::int64_t> out(q.num_pending());
    const BlockTable<Id>& t = q.table_of(g);
    for (std::size_t p = q.num_built; p < q.num_slotted(); ++p) {
      out[p - q.num_built] = t.blocks()[p / t.block_size()] == Id{0} ? -1 : t.slot(p);
    }
    return out;
  }
  /// Copy-on-write copies not yet handed out by build_batch_metadata. Valid until the next non-const call.
  [[nodiscard]] std::span<const copy_type> pending_copies() const noexcept { return pool_.copies().copies(); }
  /// The state of live sequence `seq` (read-only: cursors, hashes, keys; see SequenceState). Valid until the next
  /// non-const call. Throws kUnknownSequence.
  [[nodiscard]] const sequence_type& sequence(SeqId seq) const { return live(seq, "sequence"); }
  /// Visit every live sequence as f(SeqId, std::span<const Id> blocks, std::size_t num_tokens) (group 0's
  /// blocks; per group through sequence(seq).table_of(g)), or as f(SeqId, std::size_t num_tokens). `f` must not
  /// call a non-const member of the manager.
  template <class F>
  void for_each_sequence(F&& f) const {
    for (const auto& [id, q] : seqs_) {
      if constexpr (std::is_invocable_v<F&, SeqId, std::size_t>) {
        f(id, q.num_slotted());
      } else {
        f(id, q.table.blocks(), q.num_slotted());
      }
    }
  }

  /// Blocks held (refcount > 0) by group g now, each shared block once. O(1). Throws kInvalidArgument (g).
  [[nodiscard]] std::size_t held_blocks(std::size_t g) const {
    check_group(g, "held_blocks");
    return layout_.simple ? pool_.alloc().num_used_blocks() : pool_.held(g);
  }
  /// The most blocks group g held at once since construction or reset_peaks() (with one full-attention group:
  /// sampled at the end of each call that takes blocks). Throws kInvalidArgument (g).
  [[nodiscard]] std::size_t peak_held_blocks(std::size_t g) const {
    check_group(g, "peak_held_blocks");
    return layout_.simple ? pool_.peak_used() : pool_.peak_held(g);
  }
  /// The most blocks all groups held at once since construction or reset_peaks().
  [[nodiscard]] std::size_t peak_used_blocks() const noexcept { return pool_.peak_used(); }
  /// Restart the peaks at the current values.
  void reset_peaks() noexcept {
    pool_.reset_peaks();
  }
  /// Bytes of the blocks group g holds: held_blocks(g) x bytes_per_block(). Throws kInvalidArgument (g).
  [[nodiscard]] std::size_t held_bytes(std::size_t g) const { return held_blocks(g) * bytes_per_block(); }

  /// Counters and block counts now.
  [[nodiscard]] CacheStats stats() const noexcept {
    CacheStats s = stats_;
    s.num_usable_blocks = pool_.alloc().num_usable_blocks();
    s.blocks_used = pool_.alloc().num_used_blocks();
    s.blocks_cached = pool_.alloc().num_cached_blocks();
    s.blocks_free = pool_.alloc().num_free_blocks();
    s.usage = static_cast<double>(s.blocks_used) / static_cast<double>(s.num_usable_blocks);
    s.evictions = pool_.alloc().num_evictions();
    s.block_ops = pool_.alloc().num_block_ops();
    host_.add_gauges(s);
    s.external = ext_.counters();
    s.dedup_blocks = pool_.dedup_blocks();
    return s;
  }
  /// Prefix-cache statistics since the previous call (vLLM's PrefixCacheStats: requests / queries / hits of new
  /// requests, preempted_* of re-admissions, reset), then starts a new interval. The lifetime totals are in stats().
  PrefixCacheStats take_prefix_cache_stats() noexcept {
    const PrefixCacheStats out = interval_;
    interval_ = {};
    return out;
  }
  /// The allocator (read-only: refcounts, states, eviction order). Valid as long as the manager.
  [[nodiscard]] const allocator_type& allocator() const noexcept { return pool_.alloc(); }
  /// The prefix index (read-only). With several groups it is shared by them: group g's blocks are keyed by
  /// `group_block_key(hash, g)` (group 0's by their hashes), one table sized for the pool; `prefix_index(g)` reads
  /// one group's part in its own hashes. Valid as long as the manager.
  [[nodiscard]] const index_type& prefix_index() const noexcept { return pool_.index(); }
  /// Group g's part of the prefix index, read-only, in the group's own block hashes (`find(h)`, `hash_of(b)`,
  /// `size()`: the group's registered blocks). A small value (GroupPrefixIndexView), valid as long as the manager.
  /// Throws kInvalidArgument for g >= num_groups().
  [[nodiscard]] const_index_view prefix_index(std::size_t g) const {
    check_group(g, "prefix_index");
    return pool_.ix(g);
  }
  /// The group whose table holds (or last held) block b (0 with one group). Precondition: 0 < b < num_blocks.
  [[nodiscard]] std::uint32_t group_of(Id b) const noexcept { return pool_.group_of_block(b); }

  // ---------------------------------------------------------------------------------------------------------------
  // Prefix cache maintenance and events

  /// Drop every block hash (e.g. after a weight update), making cached blocks free. Succeeds, returning true, only
  /// when no block is referenced (no live sequence and no pending copy); otherwise returns false and changes
  /// nothing.
  bool reset_prefix_cache() {
    if (pool_.alloc().num_used_blocks() != 0) return false;
    if (!host_.can_clear()) return false;
    pool_.events().reserve_more(2);
    pool_.alloc().clear_hashes([](Id) {});
    pool_.index().clear();
    pool_.clear_group_counts();
    pool_.history().clear();  // the dropped hashes name content no longer meant to be served
    for (auto& [id, q] : seqs_) {  // (all empty: nothing is referenced)
      for (std::size_t g = 0; g < layout_.num_groups; ++g) q.registered_of(g) = 0;
    }
    interval_.reset = true;
    if (pool_.events().enabled()) pool_.events().push(KVEventType::kAllCleared);
    host_.clear(pool_.events());
    return true;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // Retention priorities

  /// Retention clock tick (TensorRT-LLM's retention durations): records `now` (the clock never goes back: an earlier
  /// `now` changes nothing) and lets every cached block whose retention priority expired at or before it fall back
  /// to kDefaultRetentionPriority, in both tiers. Durations of RetentionConfig count from the last `now` recorded
  /// here, so an engine calls this once per step with its steady clock (replays pass simulated time). Returns how
  /// many cached blocks changed priority; 0 without a RetentionEvictionPolicy. O(expired log cached).
  std::size_t expire_retention(RetentionTimePoint now) {
    const RetentionTimePoint t = pool_.advance_retention(now);
    std::size_t n = pool_.alloc().expire_retention(t);
    if (host_) n += host_.tier().expire_retention(t);
    return n;
  }
  /// The retention clock: the latest `now` given to expire_retention (the clock's epoch before the first call).
  [[nodiscard]] RetentionTimePoint retention_now() const noexcept { return pool_.retention_now(); }

  // ---------------------------------------------------------------------------------------------------------------
  // Host tier transfers

  /// The copies issued by the build that returned `token` (BatchMetadataSizes::transfer_token) have completed:
  /// unpin the blocks they read, and make the blocks they filled readable: an offloaded or swapped-out host block
  /// starts serving host-tier hits (kBlockStored, medium CPU), an onboarded or swapped-in device block is registered
  /// in the device index (kBlockStored, medium GPU) unless its hash was registered meanwhile. Tokens may be
  /// completed in any order. Until then the blocks stay pinned: capacity queries and admissions count them as
  /// held. Throws kInvalidArgument when `token` names no copies in flight (never issued, or completed already);
  /// nothing changes then. Cost: O(copies in flight).
  void complete_transfers(std::uint64_t token) {
    if (!host_.transfers().is_in_flight(token)) {
      detail::raise(Errc::kInvalidArgument, "complete_transfers: token " + std::to_string(token) +
                                                " names no copies in flight (never issued, or completed already)");
    }
    host_.complete(token, pool_, stats_);
  }

  /// Whether sequence `seq` is swapped out (preempted by kSwap, resumable).
  [[nodiscard]] bool is_swapped(SeqId seq) const { return swapped_.contains(seq); }
  /// Number of swapped-out sequences.
  [[nodiscard]] std::size_t num_swapped() const noexcept { return swapped_.size(); }
  /// Host blocks of swapped sequence `seq`, logical order (`[blocks]`; with several groups `[groups x blocks]`,
  /// group-major, 0 for a null entry of a windowed group). Valid until the next non-const call. Throws
  /// kUnknownSequence when `seq` is not swapped.
  [[nodiscard]] std::span<const Id> swapped_host_blocks(SeqId seq) const {
    const auto it = swapped_.find(seq);
    if (it == swapped_.end()) {
      detail::raise(Errc::kUnknownSequence, "swapped_host_blocks: sequence " + std::to_string(seq) +
                                                " is not swapped out");
    }
    return it->second.host_blocks;
  }
  /// Whether host block `hb`'s BlockStored event is held back: its copy completed after its parent had left every
  /// tier, so the event stream does not report it (no router could place it; CacheStats::events_held_back counts
  /// them). False without events or a host tier. Precondition: hb < num_host_blocks.
  [[nodiscard]] bool host_event_held_back(Id hb) const noexcept { return host_.is_held_back(hb); }
  /// The host tier (read-only: its allocator and index), or null without one. Valid as long as the manager.
  [[nodiscard]] const host_tier_type* host_tier() const noexcept { return host_.get(); }
  /// The copies queued for the next build and in flight (read-only). Valid until the next non-const call.
  [[nodiscard]] const TransferQueue<Id>& transfers() const noexcept { return host_.transfers(); }

  /// Move the recorded events (oldest first) to the end of `out`, unbatched; returns how many. Events are recorded
  /// only with `enable_events`.
  std::size_t drain_events(std::vector<KVEvent>& out) { return pool_.events().drain(out); }

  /// The events recorded since the last take or drain as the next numbered batch (vLLM's KVEventBatch; numbers
  /// 1, 2, 3, ... without gaps), stamped `ts` (vLLM: seconds since the epoch); nullopt when nothing happened.
  /// Call once per engine step, after the step's calls, and publish it. Allocates.
  std::optional<KVEventBatch> take_event_batch(double ts) { return pool_.events().take_batch(ts); }

  /// What the events taken so far say is cached: a stored event per cached (block hash, tier), at the number of the
  /// last batch taken. A consumer that joins late (or lost batches) applies it, then the batches after its number.
  /// O(cached blocks); allocates.
  [[nodiscard]] KVEventSnapshot event_snapshot() const { return pool_.events().snapshot(); }

  // ---------------------------------------------------------------------------------------------------------------
  // Batch metadata

  /// Write this step's metadata for the sequences `batch` (in that order) into `buf` (see BatchMetadataBuffers for
  /// shapes and padding), then mark the scheduled slots built and hand out this batch's copies (releasing the
  /// references the copies held on their sources). The copies of a build are the pending copy-on-writes into the
  /// tables of its own sequences, plus any other pending copy whose source block this build writes (that copy must
  /// run first: copy_blocks precedes write_kv in the step) or whose sequence has no pending slot (rewound past its
  /// new tokens: no build of its own would come before it grows again, and a fork waits for the copy); the others
  /// stay pending for the build of their own sequence's batch. So an engine may build several batches per step (prefill and decode apart, as vLLM and
  /// SGLang do), running each build's copies before that build's writes.
  /// `num_scheduled_tokens` (`[batch]`, optional): how many of each sequence's pending positions this step
  /// computes, in position order (its query length: 1 for a decode token, a chunk for chunked prefill, 1 + k with
  /// k lookahead slots); empty = all pending. The rest stay pending for later builds. Sequence b's new slots
  /// occupy slot_mapping[qo_indptr[b], qo_indptr[b + 1]); its page table (indices, block_tables) covers the
  /// seq_lens[b] tokens written up to the end of this step: its queries are the last qo_indptr[b + 1] -
  /// qo_indptr[b] of them (a mixed batch of decodes and prefill chunks is one ragged prefill, FlashInfer style).
  /// Before writing, the batch's full blocks whose last write this build issues are registered in the prefix
  /// index (their K/V is written by the kernels of the step this metadata describes). A full block whose hash is
  /// already registered to another block, and that only this sequence holds, is switched to the registered block
  /// and released; its slots in this step become -1 (deduplication; the registered block already holds, or
  /// earlier in this step's write_kv receives, the same K/V).
  /// Every span of `buf` may be empty to skip that output, except two that a build cannot drop: `slot_mapping`
  /// when the batch has new tokens (their writes would never be issued, yet their blocks would be registered) and
  /// `copies` when the build has copies to hand out (they would be handed out to nobody).
  /// Every sequence of `batch` must compute at least one token: one with no pending slot (or 0 scheduled tokens)
  /// is refused, since a row without queries would hand an attention kernel nothing to compute (a decode step
  /// whose token was never appended). A build of an empty batch issues the queued swaps and nothing else.
  /// Throws kUnknownSequence, kInvalidArgument (a sequence twice in `batch`; more tokens scheduled than pending, or
  /// none), kBadShape (a buffer too small or wrongly empty, a sequence longer than max_blocks_per_seq,
  /// num_scheduled_tokens not of the batch's size, a manager with several groups: use the per-group overload),
  /// kLimitExceeded (a total beyond the int32 metadata): then nothing is written and nothing changes.
  BatchMetadataSizes build_batch_metadata(std::span<const SeqId> batch, const BatchMetadataBuffers& buf,
                                          std::span<const std::uint32_t> num_scheduled_tokens = {}) {
    if (layout_.num_groups != 1) {
      detail::raise(Errc::kBadShape, "build_batch_metadata: the manager has " + std::to_string(layout_.num_groups) +
                                         " KV-cache groups: pass one BatchMetadataBuffers per group");
    }
    BatchMetadataSizes sz;
    build_groups(batch, std::span<const BatchMetadataBuffers>(&buf, 1), num_scheduled_tokens,
                 std::span<BatchMetadataSizes>(&sz, 1));
    return sz;
  }

  /// The metadata of every KV-cache group: one BatchMetadataBuffers per group (`per_group`, `[G]`), each with the
  /// conventions above, per group: page table (one entry per logical block, the null block 0 before a windowed
  /// group's window: the kernels never read those pages), seq_lens and qo_indptr (equal in every group: positions
  /// are absolute), slot_mapping (the group's own blocks) and copies (the group's copy-on-writes of this build).
  /// The host tier's swap lists are written into group 0's buffers (block ids are pool-wide; a swap copies the
  /// block in every layer slot), its transfer token into every group's sizes. After writing, every windowed group
  /// releases the blocks wholly before first_visible(min(num_built, num_known)) of each sequence of the batch (the
  /// release rule: this step's kernels still read them; only later steps reuse them). Returns the sizes written,
  /// `[G]` (allocates the vector; the overload with `sizes_out` does not). Throws as the one-group overload, and
  /// kBadShape when per_group.size() != num_groups().
  std::vector<BatchMetadataSizes> build_batch_metadata(std::span<const SeqId> batch,
                                                       std::span<const BatchMetadataBuffers> per_group,
                                                       std::span<const std::uint32_t> num_scheduled_tokens = {}) {
    std::vector<BatchMetadataSizes> sizes(layout_.num_groups);
    build_groups(batch, per_group, num_scheduled_tokens, sizes);
    return sizes;
  }
  /// The per-group build writing the sizes into `sizes_out` (`[G]`): no allocation once the scratch has grown.
  /// Throws as above, and kBadShape when sizes_out.size() != num_groups().
  void build_batch_metadata(std::span<const SeqId> batch, std::span<const BatchMetadataBuffers> per_group,
                            std::span<const std::uint32_t> num_scheduled_tokens,
                            std::span<BatchMetadataSizes> sizes_out) {
    build_groups(batch, per_group, num_scheduled_tokens, sizes_out);
  }
  /// The release rule for `seq` now (with CacheConfig::release_at_build false, where builds leave it to the caller):
  /// the blocks of windowed and recurrent groups that no query from its computed position on reads leave its
  /// tables (to the cache when registered, else free; null entries remain). Call it before the sequence grows for
  /// its next step, as vLLM's remove_skipped_blocks runs at the start of allocate_slots; never between a build and
  /// the kernels that read that build's tables. Returns how many table entries it released, over the groups (0:
  /// the tables did not change; an entry that was null already may count). Nothing to release with full-attention
  /// groups only. Throws kUnknownSequence.
  std::size_t release_skipped_blocks(SeqId seq) {
    sequence_type& q = live(seq, "release_skipped_blocks");
    if (layout_.simple) return 0;
    std::size_t before = 0, after = 0;
    for (std::size_t g = 1; g < layout_.num_groups; ++g) before += q.released_of(g);
    release_out_of_window(q);
    for (std::size_t g = 1; g < layout_.num_groups; ++g) after += q.released_of(g);
    return after - before;
  }

  // ---------------------------------------------------------------------------------------------------------------
  // External KV (prefill/decode disaggregation, KV stores): try_admit_external, complete_external_fill,
  // abort_sequence, plan_import, finish_with_lease, leases and save pins, in their own part (the base
  // ExternalKvCalls, include/pagedkv/external_kv_calls.hpp).

 private:
  using index_view = GroupPrefixIndexView<index_type>;
  using external_calls::ext_;                 // external KV state (ExternalKvCalls): four hooks read it
  using external_calls::abort_external_fill;
  using pool_type = detail::DevicePool<Hasher, Id, Evict>;
  using recurrent_type = detail::RecurrentGroup<Id>;
  using full_type = detail::FullGroup<Id>;
  using coarse_type = detail::CoarseGroup<Id>;
  void build_groups(std::span<const SeqId> batch, std::span<const BatchMetadataBuffers> per_group,
                    std::span<const std::uint32_t> num_scheduled_tokens, std::span<BatchMetadataSizes> sizes_out) {
    if (ext_.num_fills() != 0) [[unlikely]] ext_.refuse_waiting(batch, "build_batch_metadata");  // external KV
    // The build (detail/batch_build.hpp) over this manager's sequences, pool, host part and counters.
    const auto release = [this](sequence_type& q) { release_out_of_window(q); };
    if (layout_.simple) {
      build_.template build<true>(config_, layout_, seqs_, pool_, host_, stats_, on_registered(), release, batch,
                                  per_group, num_scheduled_tokens, sizes_out);
    } else {
      build_.template build<false>(config_, layout_, seqs_, pool_, host_, stats_, on_registered(), release, batch,
                                   per_group, num_scheduled_tokens, sizes_out);
    }
  }

  using SwappedSequence = detail::SwappedSequence<Id>;  // preempted by swapping (detail/host_swap.hpp)

  using AdmitPlan = detail::AdmitPlan;  // detail/admission_plan.hpp
  using PlanScratch = detail::HitScratch<Id>;  // an admission plan's hits, the fixed point's scratch

  void check_prepared(const PreparedPrompt& p, const char* what) const {
    validate_prompt(p.tokens, p.keys.get(), what, nullptr);
    // The block size is compared, not inferred from the hash count: 6 tokens hash 1 block at block size 4 and at 5,
    // and a block hashed over 4 tokens must never be registered for 5.
    if (!(p.root == pool_.index().root()) || p.block_size != config_.block_size ||
        (config_.enable_prefix_caching && p.hashes.size() != p.tokens.size() / config_.block_size)) {
      detail::raise(Errc::kInvalidArgument, std::string(what) +
                                                ": the prepared prompt was not prepared by a manager with this "
                                                "hasher, seed and block size (prepared with block size " +
                                                std::to_string(p.block_size) + ", this manager's is " +
                                                std::to_string(config_.block_size) + ")");
    }
  }

  // Validate a prompt for admission (`what` and, when given, `seq` name the call in messages; strings are built
  // only on error). Throws kInvalidArgument / kLimitExceeded.
  void validate_prompt(std::span<const TokenId> prompt, const RequestKeys* keys, const char* what,
                       const SeqId* seq) const {
    const auto who = [&] { return std::string(what) + (seq != nullptr ? ": sequence " + std::to_string(*seq) : ""); };
    if (prompt.size() > max_tokens_per_seq_) {
      detail::raise(Errc::kLimitExceeded, who() + ": prompt of " + std::to_string(prompt.size()) +
                                              " tokens exceeds max_tokens_per_seq = " +
                                              std::to_string(max_tokens_per_seq_));
    }
    if (keys != nullptr && !keys->multimodal.empty()) validate_request_keys(keys, prompt.size(), who().c_str());
  }

  // Plan an admission of a validated prompt (detail::plan_admission): the prompt's block hashes appended to
  // `hashes` unless `hashes_ready`, the hit blocks into `sc`, what it would take. Pure.
  // `external_tokens`: offered to a fill after the hit (try_admit_external; detail::window_external_skip).
  AdmitPlan plan_admit_into(std::span<const TokenId> prompt, const RequestKeys* keys, const AdmitOptions& opts,
                            std::vector<BlockHash>& hashes, bool hashes_ready, PlanScratch& sc,
                            std::size_t external_tokens = 0) const {
    return detail::plan_admission<Id>(pool_, host_, layout_, config_, prompt, keys, opts, hashes, hashes_ready, sc,
                                      external_tokens);
  }

  // A new sequence's admission (try_admit, try_admit_external; `who` names the call in errors): the duplicate and
  // prompt checks, then admit_prompt with `external_tokens`.
  AdmitResult admit_new(SeqId seq, std::span<const TokenId> prompt, const RequestKeys* keys, const AdmitOptions& opts,
                        const char* who, std::size_t external_tokens = 0) {
    if (seqs_.contains(seq) || swapped_.contains(seq)) {
      detail::raise(Errc::kDuplicateSequence, std::string(who) + ": sequence " + std::to_string(seq) +
                                                  " is already live");
    }
    validate_prompt(prompt, keys, who, &seq);
    detail::check_retention_boundaries(opts, prompt.size(), who);
    hash_scratch_.clear();
    return admit_prompt(seq, prompt, keys, nullptr, opts, hash_scratch_, false, external_tokens);
  }

  // A new sequence's admission of a prepared prompt (try_admit, try_admit_external of a PreparedPrompt): the
  // duplicate and preparation checks, then admit_prompt reading the prompt's hashes (hashes_ready: a retried
  // admission copies nothing until it commits).
  AdmitResult admit_prepared(SeqId seq, const PreparedPrompt& prompt, const AdmitOptions& opts, const char* who,
                             std::size_t external_tokens = 0) {
    if (seqs_.contains(seq) || swapped_.contains(seq)) {
      detail::raise(Errc::kDuplicateSequence, std::string(who) + ": sequence " + std::to_string(seq) +
                                                  " is already live");
    }
    check_prepared(prompt, who);
    detail::check_retention_boundaries(opts, prompt.tokens.size(), who);
    return admit_prompt(seq, prompt.tokens, prompt.keys.get(), prompt.keys, opts, ready_hashes(prompt), true,
                        external_tokens);
  }
  // A prepared prompt's block hashes as plan_admit_into / admit_prompt take them: with hashes_ready they are only
  // read (a retried admission copies nothing).
  static std::vector<BlockHash>& ready_hashes(const PreparedPrompt& p) noexcept {
    return const_cast<std::vector<BlockHash>&>(p.hashes);
  }

  // Admit a validated prompt whose block hashes are `hashes` (all of them if `hashes_ready`, read only; else an
  // empty scratch vector the plan hashes into). No allocation on kNoCapacity / kNeverFits once scratch has grown.
  // `external_tokens`: offered to a fill after the hit (try_admit_external): a window group takes no block wholly
  // outside the window of the fill's end (detail::window_external_skip; null in its table).
  AdmitResult admit_prompt(SeqId seq, std::span<const TokenId> prompt, const RequestKeys* keys,
                           std::shared_ptr<const RequestKeys> shared_keys, const AdmitOptions& opts,
                           std::vector<BlockHash>& hashes, bool hashes_ready, std::size_t external_tokens = 0) {
    if (opts.retention) validate_retention(*opts.retention, "try_admit");
    const AdmitPlan plan = plan_admit_into(prompt, keys, opts, hashes, hashes_ready, plan_scratch_, external_tokens);
    if (!plan.query.fits()) {
      return {static_cast<AdmitStatus>(plan.query.status), 0, 0, 0, plan.query.num_missing_blocks};
    }
    // The miss cause, before the commit's allocations can evict a block it would name (counted below).
    const MissCause cause = config_.count_miss_causes
                                ? detail::admission_miss_cause(pool_, host_, layout_, config_, prompt.size(), hashes,
                                                               plan.hit_blocks, opts)
                                : MissCause::kNone;
    const std::size_t bs = config_.block_size;
    const std::size_t G = layout_.num_groups;
    const std::size_t k = plan.hit_blocks;
    const std::size_t host_hits = plan.num_host_hits;
    const std::vector<Id>& hit = plan_scratch_.hits;        // [G x k]
    const std::vector<bool>& on_host = plan_scratch_.on_host;

    // Commit. Everything that can throw bad_alloc is done before the first refcount changes.
    if (!shared_keys && keys != nullptr && !keys->empty()) shared_keys = std::make_shared<const RequestKeys>(*keys);
    auto node = take_spare(seq);  // a freed sequence's node, its vectors' capacity kept: no allocation once warm
    sequence_type& s = node.mapped();
    s.tokens.assign(prompt.begin(), prompt.end());
    s.hashes.assign(hashes.begin(), hashes.end());
    s.keys = std::move(shared_keys);
    s.retention = opts.retention;
    s.num_prompt_tokens = prompt.size();
    s.retention_replay = std::max<std::size_t>(opts.prompt_retention_tokens.value_or(prompt.size()), 1) - 1;
    s.retention_junction = opts.shared_prefix_boundary;
    const std::size_t total_blocks = (k * bs + plan.num_reserved + bs - 1) / bs;
    for (std::size_t g = 0; g < G; ++g) s.table_of(g).reserve_blocks(total_blocks);
    reserve_for_allocations(plan.query.num_blocks, host_hits);
    if (layout_.any_coarse) {  // a coarse group's copy of a shared hit page
      pool_.copies().reserve_room(G);
    }
    onboard_scratch_.assign(G * k, Id{0});
    const bool readmission = !preempted_.empty() && preempted_.contains(seq);
    sequence_type& q = seqs_.insert(std::move(node)).position->second;
    // Hits first, in both tiers (so the allocations below, and the write-back offloads their evictions queue,
    // cannot evict them), then a device block per host hit (HostOffload::onboard), then the tables in order.
    for (std::size_t j = 0; j < G * k; ++j) {
      if (hit[j] == Id{0} || on_host[j]) continue;
      pool_.acquire_block(hit[j]);
      onboard_scratch_[j] = hit[j];
    }
    if (host_hits != 0) {
      host_.onboard(pool_, stats_, hit, on_host, hashes, k, onboard_scratch_,
                    [this](std::size_t g) { return allocate_one(g); });
    }
    for (std::size_t g = 0; g < G; ++g) {  // the hit's blocks of each group, as its kind takes them
      const std::span<const Id> row = std::span<const Id>(onboard_scratch_).subspan(g * k, k);
      if (layout_.simple) {
        full_type{g, bs}.take_hit(q, row, true);
      } else {
        visit_kind(g, [&](const auto& kind) { kind.take_hit(q, row, false); });
      }
    }
    q.num_built = k * bs;  // an onboarded block is filled by this step's swap_in, before its kernels
    for (std::size_t g = 0; g < G; ++g) {
      if (is_recurrent(g)) {  // guaranteed by the capacity check
        recurrent(g).admit(q, plan.num_reserved, taker(g));
        continue;
      }
      std::optional<copy_type> copy;
      auto pool = pool_.template table_allocator<false>(layout_, g);
      std::size_t reserved = plan.num_reserved;
      if (external_tokens != 0) [[unlikely]] {  // a window group's blocks the fill leaves out: null
        const std::size_t skip =
            std::min(detail::window_external_skip(layout_, g, k, prompt.size(), external_tokens) * bs, reserved);
        q.table_of(g).extend(skip, [](std::size_t) { return Id{0}; });
        reserved -= skip;
      }
      const bool ok = q.table_of(g).try_append(reserved, pool, evictor(), nullptr, copy);
      (void)ok;  // guaranteed by the capacity check; a copy only of a coarse group's shared hit page
      if (copy) {
        copy->group = static_cast<std::uint32_t>(g);
        queue_copy(q, *copy);
        ++stats_.cow_copies;
      }
    }
    if (readmission) preempted_.erase(seq);
    pool_.note_peak();

    detail::count_admission(stats_, interval_, prompt.size(), k * bs, plan.host_hit_blocks * bs, readmission);
    if (config_.count_miss_causes) ++stats_.admissions_by_miss_cause[static_cast<std::size_t>(cause)];
    return {AdmitStatus::kAdmitted, k * bs, plan.host_hit_blocks * bs, plan.query.num_blocks, 0};
  }

  // A node for a new sequence `seq`: a recycled one (free() keeps up to kMaxSpareSequences, their vectors' capacity
  // kept, so an admission allocates nothing once warm) or a new one. May throw std::bad_alloc; changes nothing.
  seq_node_type take_spare(SeqId seq) {
    if (spare_.empty()) {
      seq_map_type one;
      one.try_emplace(seq, config_.block_size, layout_.num_groups, std::span<const std::uint32_t>(layout_.page_tokens));
      return one.extract(one.begin());
    }
    seq_node_type node = std::move(spare_.back());
    spare_.pop_back();
    node.key() = seq;
    return node;
  }
  // Keep the node of a freed sequence (its tables already released) for the next admission, emptied; a node whose
  // token capacity is very large is dropped instead (its memory is not kept for a typical request).
  void recycle(seq_node_type node) noexcept {
    if (node.empty() || spare_.size() == spare_.capacity() || node.mapped().tokens.capacity() > kMaxSpareTokens) return;
    node.mapped().clear_for_reuse();
    spare_.push_back(std::move(node));  // room reserved at construction
  }

  // The growth (detail/growth.hpp) over this manager's pool, layout, counters and scratch.
  void append_known_tokens(sequence_type& q, std::span<const TokenId> tokens) {
    detail::append_known_tokens(pool_, config_, q, tokens);
  }
  void check_growable(const sequence_type& q, SeqId seq, std::size_t n, const char* what) const {
    detail::check_growable(q, seq, n, max_tokens_per_seq_, what);
  }
  [[nodiscard]] CapacityQuery query_growth(const sequence_type& q, std::size_t n, std::size_t drafts = 0) const {
    return detail::query_growth(pool_, layout_, config_.block_size, q, n, drafts);
  }
  void prepare_growth(sequence_type& q, std::size_t n, std::size_t drafts = 0) {
    detail::prepare_growth(pool_, layout_, config_.block_size, q, n, drafts, slot_scratch_,
                           [this](std::size_t blocks) { reserve_for_allocations(blocks, 0); });
  }
  AppendResult<Id> commit_growth(sequence_type& q, std::size_t n, std::size_t num_new_blocks) {
    return detail::commit_growth(pool_, layout_, stats_, q, n, num_new_blocks, slot_scratch_, evictor());
  }

  // A sequence that may be forked or swapped: SequenceState::settled and no block still being filled by a copy.
  [[nodiscard]] bool settled(const sequence_type& q) const noexcept { return q.settled() && !has_filling_block(q); }

  static CacheConfig checked(const CacheConfig& c) { return detail::checked_cache_config(c, kMaxGroups); }

  void check_group(std::size_t g, const char* what) const {
    if (g >= layout_.num_groups) {
      detail::raise(Errc::kInvalidArgument, std::string(what) + ": group " + std::to_string(g) + " >= " +
                                                std::to_string(layout_.num_groups) + " groups");
    }
  }

  // One block of group g from the pool (capacity checked by the caller).
  Id allocate_one(std::size_t g) { return pool_.allocate_one(g, evictor()); }
  // allocate_one(g) as a callable (a group kind's `take`).
  auto taker(std::size_t g) {
    return [this, g] { return allocate_one(g); };
  }
  // Recurrent group g as its kind (detail/group_recurrent.hpp). Precondition: is_recurrent(g).
  [[nodiscard]] recurrent_type recurrent(std::size_t g) const noexcept { return detail::recurrent_group<Id>(layout_, g); }
  // Group g as its kind (detail/group_*.hpp): f(kind), one switch (detail::visit_group). Never per block.
  template <class F>
  decltype(auto) visit_kind(std::size_t g, F&& f) const {
    return detail::visit_group<Id>(layout_, g, std::forward<F>(f));
  }
  // Release every group's blocks of q, retention priorities first.
  void release_all_groups(sequence_type& q) {
    apply_retention(q, 0);
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {
      auto pool = pool_.template table_allocator<false>(layout_, g);
      q.table_of(g).release_all(pool);
      if (g > 0) recurrent(g).release_states(pool_, q);  // (none held in a group of another kind)
    }
  }
  // free() of a sequence preempted by swapping: release its host blocks (last block first) and forget it; false,
  // changing nothing, when `seq` is not swapped. Out of line (rare): with it inline, free() passed GCC 12's
  // max-inline-insns-single after external KV's hook and was no longer inlined into pagedkv-replay's prefix loop
  // (callgrind, replay-xxh3 row of docs/benchmarks.md "Manager split gate": 2,471,415,585 -> 2,466,138,816 Ir).
  [[gnu::noinline]] bool free_swapped(SeqId seq) {
    const auto sw = swapped_.find(seq);
    if (sw == swapped_.end()) return false;
    detail::release_swapped(host_, std::span<const Id>(sw->second.host_blocks), std::span<const Id>(sw->second.states));
    swapped_.erase(sw);
    return true;
  }
  // The release rule for every windowed group of `q`: blocks wholly before first_visible(p) become null, where p =
  // min(num_built, num_known): built lookahead positions do not count, since commit_lookahead may reject them and
  // the next query then sits at the first rejected position, whose window reaches further back.
  // Each kind's `release` (detail/group_window.hpp, detail/group_recurrent.hpp; nothing for the others).
  void release_out_of_window(sequence_type& q) {
    const std::size_t committed = std::min(q.num_built, q.num_known());
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {
      if (!layout_.windows[g].enabled()) continue;
      visit_kind(g, [&](const auto& kind) { kind.release(pool_, q, committed); });
    }
  }

  // Whether group g's pages are coarser than the match unit, and by how many match blocks per page.
  [[nodiscard]] bool is_coarse(std::size_t g) const noexcept { return layout_.is_coarse(g); }
  [[nodiscard]] std::size_t coarse_factor(std::size_t g) const noexcept { return layout_.coarse_factor(g); }

  /// Queues copy c into one of q's blocks: handed out with the next build that includes q (its owner), counted in
  /// q.num_pending_copies. The hold on c.src is the caller's (acquired for the copy, or a reference handed over).
  /// Room in pool_.copies() is reserved by the caller.
  void queue_copy(sequence_type& q, const copy_type& c) { pool_.copies().push(c, q); }

  sequence_type& live(SeqId seq, const char* what) {
    const auto it = seqs_.find(seq);
    if (it == seqs_.end()) {
      detail::raise(Errc::kUnknownSequence, std::string(what) + ": sequence " + std::to_string(seq) + " is not live");
    }
    return it->second;
  }
  const sequence_type& live(SeqId seq, const char* what) const {
    return const_cast<KVCacheManager*>(this)->live(seq, what);
  }

  // Called by the allocator just before a cached block is reused: drop its hash (DevicePool::evictor); with a host
  // tier and an offload policy, copy it there first (write-back) unless the host already has (or is filling) that
  // hash. The copy reads the block at the start of the next build's step, before anything writes the block's new
  // contents (the swap lists run first). The caller reserved room for the events and the transfer (reserve_for_allocations).
  auto evictor() {
    return pool_.evictor([this](Id b, const BlockHash& h, std::uint32_t g) {
      if (host_ && config_.offload != OffloadPolicy::kNone) {
        host_.offload_evicted(pool_, stats_, b, h, g, pool_.alloc().last_evicted_priority(),
                              config_.min_offload_priority);
      }
    });
  }

  // Retention: give every block of q from logical block `first` on the priority (and expiry, from the retention
  // clock) its RetentionConfig assigns, before a release that may cache it. Last table holder's release decides.
  // Only for a RetentionEvictionPolicy (compiled out otherwise). Cannot throw: blocks are held, priorities valid.
  void apply_retention(const sequence_type& q, std::size_t first) {  // `first`: a match block
    for (std::size_t g = 0; g < layout_.num_groups; ++g) {
      const std::size_t fg = is_coarse(g) ? first / coarse_factor(g) : first;  // the page holding it
      apply_retention_group(q, g, fg, q.table_of(g).num_blocks());
    }
  }
  void apply_retention_group(const sequence_type& q, std::size_t g, std::size_t first, std::size_t end) {
    pool_.apply_retention(q.table_of(g).blocks(), layout_.page_tokens[g], q.retention.get(), q.num_prompt_tokens,
                          first, end);
  }

  // Whether any block of `q` is being filled by a host -> device copy not yet completed.
  [[nodiscard]] bool has_filling_block(const sequence_type& q) const noexcept {
    return decltype(host_)::has_filling_block(pool_, stats_, q, layout_.num_groups);
  }

  // Make every allocation of up to `device_blocks` device blocks (and `fills` queued host -> device copies)
  // unable to throw: events of evictions in both tiers, and the transfers they may queue.
  void reserve_for_allocations(std::size_t device_blocks, std::size_t fills) {
    pool_.events().reserve_more(2 * device_blocks);
    if (host_) host_.transfers().reserve_more(device_blocks + fills);
  }

  // Register group g's registrable full blocks of `q` beyond its registered cursor (DevicePool::register_blocks,
  // register_coarse by the group's kind). Precondition: room reserved in pool_.switched() and the event log.
  void register_full_blocks(sequence_type& q, std::size_t g) {
    if (layout_.simple) {
      full_type{g, config_.block_size}.template register_new<true>(pool_, q, on_registered());
    } else {
      visit_kind(g, [&](const auto& kind) { kind.template register_new<false>(pool_, q, on_registered()); });
    }
  }
  // With a host tier under write-through: each block registered is queued for its copy to the host (next build).
  auto on_registered() {
    return [this](Id own, const BlockHash& h) {
      if (host_ && config_.offload == OffloadPolicy::kWriteThrough) host_.recent_registered().emplace_back(own, h);
    };
  }

  CacheConfig config_;                                 // groups filled in: one full group when none was given
  GroupLayout layout_;                                 // what each group is (windows, pages; simple = kOne)
  pool_type pool_;                                     // allocator, shared index, reference rules, events, history
  detail::BatchBuild<Id> build_;                       // build_batch_metadata: the build and its scratch
  PlanScratch plan_scratch_;                           // admission: hits and the fixed point's scratch
  std::size_t max_tokens_per_seq_;
  seq_map_type seqs_;                                  // node-based: SequenceState addresses are stable
  std::vector<seq_node_type> spare_;                   // freed sequences' nodes, reused by admissions
  std::vector<BlockHash> hash_scratch_;                // admission: the prompt's block hashes
  std::vector<Id> hit_scratch_;                        // try_resume: [groups x blocks] device hits
  std::vector<std::int64_t> slot_scratch_;             // AppendResult::slots
  std::unordered_set<SeqId> preempted_;                // preempted ids not yet re-admitted
  std::vector<Id> onboard_scratch_;                    // admission, resume: [groups x blocks] device blocks
  detail::HostOffload<Id, host_tier_type> host_;       // host tier, transfers, fills, held-back host events
  std::unordered_map<SeqId, SwappedSequence> swapped_;  // preempted by swapping, resumable
  CacheStats stats_;
  PrefixCacheStats interval_;                          // since the last take_prefix_cache_stats()
};

}  // namespace pagedkv
