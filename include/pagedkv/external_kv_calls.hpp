// pagedkv/external_kv_calls.hpp: the external-KV calls of KVCacheManager (prefill/decode disaggregation, KV
// stores; issue 33, docs/design.md "External KV"), a part of their own: a base of the manager over its state.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/detail/admission_plan.hpp>  // check_retention_boundaries
#include <pagedkv/detail/external_kv.hpp>
#include <pagedkv/detail/external_kv_handoff.hpp>
#include <pagedkv/detail/group_state_table.hpp>  // refuse_state_table
#include <pagedkv/detail/hit_search.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/external_kv.hpp>
#include <pagedkv/manager_results.hpp>
#include <pagedkv/request_keys.hpp>
#include <pagedkv/retention.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv {

/// The external-KV calls of `KVCacheManager`: blocks filled by another engine or a store, and blocks handed to one
/// (prefill/decode disaggregation, KV stores; vLLM's KV connector lifecycle, TensorRT-LLM's kDISAGG_* states). An
/// engine calls them on its manager (include kv_cache_manager.hpp, not this header), which derives from this class:
/// the calls are documented here, and generated documentation lists them as the manager's inherited members. CRTP:
/// `Manager` is the manager type, which befriends this class, and `Id` its `block_id_type`; never used alone. Taking
/// a call's address (`&KVCacheManager<>::try_admit_external`) gives a pointer to a member of this base, and the
/// calls are overloaded: a binding takes a lambda or a static_cast to the overload. This part owns the external
/// state, `detail::ExternalKvState` (fills in flight, leases, save pins, orphan holds, generations, counters:
/// detail/external_kv.hpp), and forwards to the pure hand-off pieces (detail/external_kv_handoff.hpp); it reaches the
/// manager's sequence map, pool, layout and admission through `self()`. The manager's one-engine paths reach it only
/// through three hooks (free, rewind, build), each behind `ext_.num_fills() != 0`, and `stats()`'s copy of the
/// counters. Every group kind takes part: a window group hands off only the blocks inside the window of the
/// consumer's first query (handoff_first_block), a recurrent group only the state the consumer resumes from
/// (RecurrentGroup's hand-off hooks), a coarse group whole pages, so a fill starts on a page boundary
/// (detail::page_aligned_hit). Thread safety, errors and moves: as the manager's.
template <class Manager, class Id>
class ExternalKvCalls {
 public:
  /// Admit `seq` as try_admit does, taking `num_external_tokens` more prompt tokens from an external source after
  /// the local prefix hit (vLLM's `num_external_computed_tokens` after `get_num_new_matched_tokens`; clamped so the
  /// last prompt token is always computed here, for its logits). All groups, all or nothing; kNoCapacity and
  /// kNeverFits as every admission (nothing changes). `headroom_blocks`: also answer kNoCapacity unless that many
  /// blocks stay available after the admission (room for fills in flight), counting every hit block as if cached
  /// (conservative). When external tokens remain after the clamp, the result carries a FillTicket: the blocks of
  /// positions [first_token, end_token) are held by the fill (one reference each), never registered, matched,
  /// evicted or reported (no event) until `complete_external_fill`; the sequence waits for it (a build refuses
  /// it, naming it). A window group's blocks wholly outside the window of the query at end_token are not taken:
  /// null in the table and the ticket from the admission on, never transferred, not counted by the capacity check
  /// or the headroom (vLLM's SlidingWindowManager pads an external load's skipped blocks with its null block the
  /// same way; detail::window_external_skip); the local hit's blocks there stay held. A recurrent group's row is
  /// null but its last entry, the block that receives the state after end_token tokens
  /// (the source must provide exactly that state: vLLM's N-1 prefill, vllm#37310). With a coarse group the local
  /// hit taken is lowered to a page boundary of every group (detail::page_aligned_hit) and the fill starts there
  /// (ticket.first_token): a coarse group's pages move whole, at their first match block's entry (null at the
  /// others); the external tokens still end where the full hit plus `num_external_tokens` ends.
  /// `opts.num_reserved_tokens`, when given, is raised to cover the external tokens. Throws as try_admit.
  ExternalAdmitResult<Id> try_admit_external(SeqId seq, std::span<const TokenId> prompt,
                                             std::size_t num_external_tokens, const RequestKeys* keys = nullptr,
                                             const AdmitOptions& opts = {}, std::size_t headroom_blocks = 0) {
    return admit_external(seq, prompt, keys, nullptr, num_external_tokens, opts, headroom_blocks);
  }

  /// `try_admit_external` of a prompt hashed beforehand by `prepare_prompt` (its keys are the prepared ones): the
  /// admission, its coarse-page hit and its headroom check read the prompt's hashes and hash nothing, so a KV
  /// connector's admission retried every step while the pool is full (vLLM's get_num_new_matched_tokens, then
  /// allocate_slots) hashes each prompt once per request. Same outcomes and errors as the other overload; also
  /// kInvalidArgument when `prompt` was prepared by a manager with another hasher, seed or block size (nothing
  /// changes).
  ExternalAdmitResult<Id> try_admit_external(SeqId seq, const PreparedPrompt& prompt, std::size_t num_external_tokens,
                                             const AdmitOptions& opts = {}, std::size_t headroom_blocks = 0) {
    return admit_external(seq, prompt.tokens, prompt.keys.get(), &prompt, num_external_tokens, opts, headroom_blocks);
  }

  /// Consumer: `try_admit_external` of the tokens import `plan` (plan_import's, for this `prompt` and `keys`)
  /// provides, so that the ticket pairs one to one with plan.remote_blocks: ticket.first_block ==
  /// plan.first_block, ticket.num_blocks() == plan.num_blocks. Counts the import's blocks (transferred, skipped
  /// thanks to the local hit) when admitted, never at plan time. Throws kInvalidArgument, nothing changed, when the
  /// local prefix hit is no longer the plan's (a block was registered or evicted in between: plan again), or when
  /// the plan does not fit this pool or prompt (groups, token range); otherwise as the other overload. Should the
  /// admission itself hit otherwise than `lookup` said (not expected), it is undone (the sequence freed, its fill
  /// aborted as quiescent: no transfer has its ticket) before the same error.
  ExternalAdmitResult<Id> try_admit_external(SeqId seq, std::span<const TokenId> prompt, const ImportPlan<Id>& plan,
                                             const RequestKeys* keys = nullptr, const AdmitOptions& opts = {},
                                             std::size_t headroom_blocks = 0) {
    auto& m = self();
    const std::size_t hit = prompt.empty()         ? 0
                            : plan.num_blocks == 0 ? m.lookup(prompt, keys, opts.max_cached_tokens)
                                                   : external_hit(prompt, keys, nullptr, opts.max_cached_tokens);
    detail::check_plan_matches(plan, m.layout_.num_groups, m.config_.block_size, prompt.size(), hit);
    ExternalAdmitResult<Id> r =
        try_admit_external(seq, prompt, plan.end_token - plan.first_token, keys, opts, headroom_blocks);
    if (!r.admit.admitted()) return r;
    if (r.admit.num_cached_tokens != plan.first_token ||
        (r.ticket.fill_id != 0 && (r.ticket.first_block != plan.first_block ||
                                   r.ticket.num_blocks() != plan.num_blocks))) [[unlikely]] {
      abort_sequence(seq, true);  // no transfer started on this ticket yet
      detail::raise(Errc::kInvalidArgument,
                    "try_admit_external: the admission hit " + std::to_string(r.admit.num_cached_tokens) +
                        " tokens, the import plan's local hit is " + std::to_string(plan.first_token) +
                        ": plan again (the admission was undone)");
    }
    // Transferred: the plan's non-null pairs (a window group's blocks outside the window are not moved).
    const auto not_sent = std::count(plan.remote_blocks.begin(), plan.remote_blocks.end(), Id{0});
    ext_.count_import(plan.remote_blocks.size() - static_cast<std::size_t>(not_sent),
                      plan.skipped_blocks * m.layout_.num_groups);
    return r;
  }

  /// The fill `fill_id` is done: its first `num_valid_blocks` blocks (per group, from the ticket's first_block)
  /// hold the external K/V, the rest failed (vLLM's `finished_recving` with `invalid_block_ids`). The fill's
  /// references go; the valid prefix counts as computed (num_built: first_token + num_valid_blocks x block_size, or
  /// end_token when every block is valid) and its full blocks are registered now (deduplicated against blocks
  /// registered meanwhile, BlockStored events), as a build registers its own. With failed blocks, `policy`:
  /// kRecompute keeps the sequence (the positions from the first failed block on stay pending in their blocks: the
  /// scheduler computes them); kFail frees the sequence and reports it failed. With a window group, a valid prefix
  /// whose next query would see a block left out of the transfer (detail::window_valid_blocks) counts as 0 valid
  /// blocks under kRecompute: the positions after the local hit are all recomputed; so does any partial fill with a
  /// recurrent group (its one transferred state, at end_token, is the fill's last block: detail::fill_valid_blocks).
  /// Such a recompute writes the window blocks the admission did not take: they are taken now, and when the pool
  /// cannot provide them the sequence fails (freed, reported in `sequence_failed`) whatever the policy.
  /// Blocks outside the window of the next query become null (as after a build). A signal for a fill that is not live
  /// is counted and changes nothing (late: its sequence was aborted, and an orphan hold ends now; duplicate;
  /// unknown), never thrown. Throws kInvalidArgument (num_valid_blocks beyond the fill's blocks) for a live fill;
  /// nothing changes then.
  ExternalCompletion complete_external_fill(std::uint64_t fill_id, std::size_t num_valid_blocks,
                                            ExternalFailurePolicy policy = ExternalFailurePolicy::kRecompute) {
    auto& m = self();
    const std::size_t nb = ext_.check_valid_blocks(fill_id, num_valid_blocks);
    m.pool_.events().reserve_more(nb * m.layout_.num_groups);
    m.pool_.switched().reserve(nb);
    auto sig = ext_.take_fill(fill_id, ext_release());
    ExternalCompletion out{sig.status};
    if (sig.status != ExternalSignal::kApplied) return out;
    out.seq = sig.fill->seq;
    out.sequence_failed = num_valid_blocks < nb && policy == ExternalFailurePolicy::kFail;
    // A window group's next query must see only transferred blocks; else the fill is recomputed from the hit.
    const auto& f = *sig.fill;
    out.num_valid_blocks = m.layout_.simple ? num_valid_blocks
                                          : detail::fill_valid_blocks(m.layout_, f.first_block, f.first_token,
                                                                      f.end_token, nb, num_valid_blocks);
    sequence_type& q = m.seqs_.find(out.seq)->second;  // live: a fill ends with its sequence (abort_fill)
    const std::size_t built = std::max(q.num_built, f.computed_end(out.num_valid_blocks, m.config_.block_size));
    // A recompute writes the window blocks the admission left out (detail::window_external_skip): taken back now;
    // when the pool cannot provide them, the sequence fails (freed, reported) rather than compute into null blocks.
    std::size_t retake = 0;
    if (!m.layout_.simple && !out.sequence_failed) {
      detail::for_each_null_block_from<Id>(m.layout_, q, built, [&](std::size_t, std::size_t) { ++retake; });
    }
    if (retake > m.pool_.alloc().num_available_blocks()) out.sequence_failed = true;
    ext_.count_completion(out.num_valid_blocks, num_valid_blocks < nb, out.sequence_failed);
    if (out.sequence_failed) {
      m.free(out.seq);
      return out;
    }
    if (retake != 0) {
      m.reserve_for_allocations(retake, 0);
      detail::for_each_null_block_from<Id>(m.layout_, q, built, [&](std::size_t g, std::size_t i) {
        (void)q.table_of(g).replace_block(i, m.allocate_one(g));
      });
    }
    q.num_built = built;
    if (out.num_valid_blocks == nb) detail::complete_recurrent_fill<Id>(m.layout_, q, f.end_token);
    // Unwritten checkpoint blocks (and blocks the new built position leaves outside a window): null before
    // registration.
    if (!m.layout_.simple) m.release_out_of_window(q);
    for (std::size_t g = 0; g < m.layout_.num_groups; ++g) {
      m.pool_.switched().clear();
      m.register_full_blocks(q, g);
    }
    out.num_computed_tokens = q.num_built;
    return out;
  }
  /// `complete_external_fill` with the set of failed blocks (indices from the ticket's first_block, any order):
  /// the blocks before the first failed one are valid. Throws kInvalidArgument for an index beyond the fill's
  /// blocks (live fill only).
  ExternalCompletion complete_external_fill(std::uint64_t fill_id, std::span<const std::size_t> failed_blocks,
                                            ExternalFailurePolicy policy = ExternalFailurePolicy::kRecompute) {
    return complete_external_fill(fill_id, ext_.valid_prefix(fill_id, failed_blocks), policy);
  }

  /// Abort `seq` (live or swapped) as `free` does. `transfer_quiescent`: the caller knows no transfer can still
  /// write its fill's blocks, so they return at once; otherwise they become an orphan hold (in no table, never
  /// reused) until the fill's late signal or `reap_external` past the orphan timeout. `free` and `preempt` of a
  /// sequence whose fill is in flight act as a non-quiescent abort. Throws kUnknownSequence.
  void abort_sequence(SeqId seq, bool transfer_quiescent) {
    auto& m = self();
    if (ext_.num_fills() != 0 && m.seqs_.contains(seq)) ext_.abort_fill(seq, transfer_quiescent, ext_release());
    m.free(seq);
  }

  /// `explain_admit` with the external hit named: of `num_external_tokens` offered after the local hit (vLLM's
  /// `get_num_new_matched_tokens`), how many an admission by `try_admit_external` would take (clamped so the last
  /// prompt token is computed here), from which block, how many blocks per group the fill would hold and how many
  /// it skips thanks to the local hit. Pure; allocates. Throws as explain_admit.
  [[nodiscard]] ExternalAdmitExplanation explain_admit_external(std::span<const TokenId> prompt,
                                                                std::size_t num_external_tokens,
                                                                const RequestKeys* keys = nullptr,
                                                                const AdmitOptions& opts = {}) const {
    auto& m = self();
    const std::size_t from = m.layout_.any_coarse && num_external_tokens != 0 && !prompt.empty()
                                 ? external_hit(prompt, keys, nullptr, opts.max_cached_tokens)
                                 : std::numeric_limits<std::size_t>::max();
    return detail::explain_external(m.explain_admit(prompt, keys, opts), num_external_tokens, m.config_.block_size,
                                    from);
  }

  /// What `try_admit_external(seq, prompt, num_external_tokens, keys, opts)` would take now (without headroom), as
  /// `query_admit` says of try_admit: the blocks of every group after the hit (lowered to a page boundary with a
  /// coarse group, as the admission lowers it), but a window group's blocks the fill would leave out (not taken:
  /// detail::window_external_skip), kNoCapacity / kNeverFits as the admission would answer (vLLM's
  /// get_num_blocks_to_allocate with `num_external_computed_tokens`). Pure; allocates. Throws as query_admit.
  [[nodiscard]] CapacityQuery query_admit_external(std::span<const TokenId> prompt, std::size_t num_external_tokens,
                                                   const RequestKeys* keys = nullptr,
                                                   const AdmitOptions& opts = {}) const {
    return plan_external(prompt, num_external_tokens, keys, nullptr, opts, "query_admit_external");
  }
  /// `query_admit_external` of a prompt hashed by `prepare_prompt` (its keys are the prepared ones): no hashing.
  /// Throws as query_admit of a prepared prompt.
  [[nodiscard]] CapacityQuery query_admit_external(const PreparedPrompt& prompt, std::size_t num_external_tokens,
                                                   const AdmitOptions& opts = {}) const {
    return plan_external(prompt.tokens, num_external_tokens, prompt.keys.get(), &prompt, opts,
                         "query_admit_external");
  }

  /// The fill `seq` waits for (0: none).
  [[nodiscard]] std::uint64_t external_fill_of(SeqId seq) const { return ext_.fill_of(seq); }

  /// The fingerprint of this pool's layout for a hand-shake: block_size, the groups, the hash algorithm and seed
  /// from the configuration; the page layout ("nhd", ...), storage dtype ("bf16", ...), KV heads and head_dim from
  /// the caller (the manager does not know them). `convention`: the identities exported; `vllm_seed`: vLLM's
  /// NONE_HASH seed (kVllmSha256Cbor only). Pure; allocates.
  [[nodiscard]] KvLayoutFingerprint layout_fingerprint(
      std::string page_layout, std::string dtype, std::uint32_t num_kv_heads, std::uint32_t head_dim,
      BlockIdentityConvention convention = BlockIdentityConvention::kPagedkv,
      std::string_view vllm_seed = identity::kVllmDefaultNoneHashSeed) const {
    auto& m = self();
    return detail::external_layout_fingerprint(m.config_, std::move(page_layout), std::move(dtype), num_kv_heads,
                                               head_dim, convention, vllm_seed);
  }

  /// Producer: finish settled sequence `seq`, keeping its blocks under a lease (registered, hit-able, read-only,
  /// never evicted or reused) until `release_lease` (the consumer's read-done; vLLM `finished_sending`),
  /// `reap_external` past `lease_deadline` (heartbeats move it: `extend_lease`), and return what the consumer needs:
  /// every group's blocks of positions [0, num_tokens) with their generations, the full blocks' identities under
  /// `layout.hash_algorithm`, the partial last block's token ids, `layout`. A window group's entries are those
  /// inside the window of the query at num_tokens - 1 (a consumer recomputes its last prompt token), taken back from
  /// the cache when the last build's window released them; the rest are null (generation 0), as is one that was
  /// evicted meanwhile. A recurrent group's entry at block i is the state after the tokens up to the end of block i:
  /// the working state for the last block, the checkpoints q kept or the pool caches for the others (null where
  /// there is none); the last checkpoint is registered first, as a free would. Throws kUnknownSequence;
  /// kInvalidArgument (layout's block_size, groups or hash fields differ from this pool's: named; the sequence is
  /// not settled or waits for a fill; vLLM identities of a request with extra keys; coarse pages)
  /// before anything changes.
  HandoffDescriptor<Id> finish_with_lease(SeqId seq, const KvLayoutFingerprint& layout,
                                          std::optional<ExternalTimePoint> lease_deadline) {
    auto& m = self();
    const sequence_type& q = m.live(seq, "finish_with_lease");
    detail::refuse_state_table(m.layout_, "finish_with_lease", seq);
    detail::check_pool_layout(m.config_, layout, "finish_with_lease: this pool vs `layout`");
    ext_.check_settled(seq, m.settled(q), "finish_with_lease");
    auto ids = detail::block_identities(q.tokens, q.hashes, q.keys && !q.keys->empty(), m.config_.block_size, layout,
                                        "finish_with_lease");  // may throw: before anything changes
    const std::size_t bs = m.config_.block_size, n = q.num_known();
    std::vector<TokenId> tail(q.tokens.begin() + static_cast<std::ptrdiff_t>(n / bs * bs),
                              q.tokens.begin() + static_cast<std::ptrdiff_t>(n));
    // The lease holds them cached.
    detail::register_last_checkpoints<Id>(m.layout_, m.pool_, m.seqs_.find(seq)->second);
    const auto block_at = [&](std::size_t g, std::size_t i) {
      return detail::handoff_block_at<Id>(m.pool_, m.layout_, q, g, i);
    };
    HandoffDescriptor<Id> d = ext_.open_lease(seq, n, m.layout_.num_groups, bs, block_at, std::move(ids), layout,
                                              lease_deadline, ext_acquire(), ext_release());
    d.tail_tokens = std::move(tail);
    m.free(seq);
    return d;
  }
  /// The consumer has read lease `hold_id`'s blocks: the lease ends (kApplied), or the signal is counted (late: it
  /// expired; duplicate; unknown). Never throws.
  ExternalSignal release_lease(std::uint64_t hold_id) { return ext_.release_hold(hold_id, ext_release()); }
  /// Heartbeat: lease (or save pin) `hold_id` now ends at `deadline` (nullopt: only by its release). Counted when
  /// it has ended. Never throws.
  ExternalSignal extend_lease(std::uint64_t hold_id, std::optional<ExternalTimePoint> deadline) {
    return ext_.extend(hold_id, deadline);
  }
  /// Pin the built full blocks of live `seq` (every group) for a save to a store (vLLM's offloading connector,
  /// LMCache): until `end_save`, a preemption, free or eviction never hands them to another sequence while the save
  /// reads them. Returns the pin id. Throws kUnknownSequence; kInvalidArgument for coarse pages or a recurrent
  /// group (a working state is rewritten in place by every build) (nothing changes).
  std::uint64_t pin_for_save(SeqId seq, std::optional<ExternalTimePoint> deadline = std::nullopt) {
    auto& m = self();
    detail::check_save_pin_groups(m.config_, m.layout_, "pin_for_save");
    const sequence_type& q = m.live(seq, "pin_for_save");
    const std::size_t full = std::min(q.num_built, q.num_slotted()) / m.config_.block_size;
    return ext_.pin_for_save(seq, m.layout_.num_groups, full,
                             [&](std::size_t g) {  // a coarse group: the pages holding those blocks
                               const auto b = q.table_of(g).blocks();
                               const std::size_t f = m.layout_.coarse_factor(g);
                               return b.first(std::min(b.size(), (full + f - 1) / f));
                             },
                             deadline, ext_acquire(), ext_release());
  }
  /// The save of pin `pin_id` completed or failed: its blocks are released. Counted when it has ended.
  ExternalSignal end_save(std::uint64_t pin_id) { return ext_.release_hold(pin_id, ext_release()); }
  /// Whether (block, generation) is a reference an external hold keeps now: a transfer checks it before it serves
  /// or writes a block; a stale one (the hold ended, so the block may have been reused) is refused and counted.
  [[nodiscard]] bool is_current_block(Id b, std::uint32_t generation) { return ext_.is_current(b, generation); }
  /// Producer: check a consumer's claim in one call: lease or save pin `hold_id` and entries (blocks[i],
  /// generations[i]) (a descriptor's or an import plan's remote blocks, any subset, any order). kOk when every entry
  /// names a block of that hold at its current generation, a null entry (block 0, generation 0: a window group's
  /// block outside the window, never transferred) aside; otherwise the first failing entry and why (unknown hold,
  /// block not in the hold, stale generation: counted in stale_generations). Nothing else changes. Throws
  /// kInvalidArgument when the spans differ in length.
  [[nodiscard]] ClaimCheck check_claim(std::uint64_t hold_id, std::span<const Id> blocks,
                                       std::span<const std::uint32_t> generations) {
    return ext_.check_claim(hold_id, blocks, generations);
  }
  /// Evict device block `b`'s hash now, by id (vLLM's `evict_blocks` after a failed load: the block's content is
  /// wrong, so its hash must never be served): it leaves the prefix index at once (BlockRemoved, and the eviction
  /// history, as other evictions), and loses its hashed mark. A cached block becomes free; a block a table or an
  /// external hold still references stays there, never matchable again, and becomes free on its last release.
  /// Returns whether b was registered (false: nothing to evict; nothing changes). Throws kBlockOutOfRange (b == 0
  /// or b >= num_blocks); std::bad_alloc before any change. The host tier's copy of that hash, if any, is not
  /// touched (it holds the content written before the failed load).
  bool evict_cached_block(Id b) {
    auto& m = self();
    if (b == Id{0} || b >= m.pool_.alloc().num_blocks()) {
      detail::raise(Errc::kBlockOutOfRange, "evict_cached_block: block " + std::to_string(b) + " outside [1, " +
                                                std::to_string(m.pool_.alloc().num_blocks()) + ")");
    }
    return m.pool_.evict_by_id(b);
  }
  /// External clock tick: ends every lease, save pin and orphan hold whose deadline is at or before `now`; records
  /// `now` for the orphan deadlines of later aborts. Returns how many ended. O(holds).
  std::size_t reap_external(ExternalTimePoint now) { return ext_.tick(now, ext_release()); }
  /// How long an orphan hold waits for its late signal, counted from the last reap_external's `now` (default 480 s,
  /// vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT). An engine calls reap_external every step; before its first call an
  /// orphan hold has no deadline (only its late signal ends it).
  void set_orphan_timeout(ExternalClock::duration d) noexcept { ext_.set_orphan_timeout(d); }

  /// Consumer: what to transfer of hand-off `desc` for `prompt` (with `keys`): first the fingerprints (`ours` vs
  /// the descriptor's: a mismatch is kInvalidArgument naming the field, at hand-shake, before anything per request:
  /// vLLM #42895), then the descriptor's shape (blocks per group = ceil(num_tokens / block_size), computed from the
  /// token count, never trusted: vLLM #50558), then the identities of the blocks to transfer against this prompt's.
  /// Only the blocks after this pool's own prefix hit are planned (the hit is not transferred again), up to
  /// importable_tokens (the last prompt token is computed here); a window group's blocks outside the window of the
  /// query at the plan's end are null in remote_blocks (never transferred), and a descriptor that lacks one inside
  /// that window makes an empty plan (the consumer computes the prompt). With a recurrent group the plan ends at the
  /// latest position whose state the descriptor holds in every recurrent group (detail::recurrent_import_end) and
  /// moves that state only. Counts nothing: the blocks transferred and
  /// skipped are counted by the admission that takes the plan (try_admit_external with the plan). Throws
  /// kInvalidArgument (each check above, naming the values; an unsupported group kind).
  ImportPlan<Id> plan_import(const HandoffDescriptor<Id>& desc, const KvLayoutFingerprint& ours,
                             std::span<const TokenId> prompt, const RequestKeys* keys = nullptr) {
    auto& m = self();
    check_same_layout(ours, desc.layout, "plan_import: consumer vs producer");
    detail::check_pool_layout(m.config_, ours, "plan_import: this pool vs `ours`");
    ImportPlan<Id> p = detail::make_import_plan(
        desc, m.layout_, prompt,
        [&] {
          const std::size_t h = prompt.empty() ? 0 : m.lookup(prompt, keys);
          return std::pair{m.layout_.any_coarse && h != 0 ? external_hit(prompt, keys, nullptr, std::nullopt) : h, h};
        },
        [&] {
          return detail::block_identities(prompt, m.prepare_prompt(prompt, keys).hashes, keys && !keys->empty(),
                                          m.config_.block_size, desc.layout, "plan_import");
        });
    return p;
  }

 protected:
  explicit ExternalKvCalls(std::size_t num_blocks) : ext_(num_blocks) {}
  ExternalKvCalls(const ExternalKvCalls&) = delete;
  ExternalKvCalls& operator=(const ExternalKvCalls&) = delete;
  ExternalKvCalls(ExternalKvCalls&&) noexcept = default;
  ExternalKvCalls& operator=(ExternalKvCalls&&) noexcept = default;
  ~ExternalKvCalls() = default;

  // The manager's free / preempt of a sequence whose fill is in flight: the fill's blocks become an orphan hold.
  [[gnu::cold, gnu::noinline]] void abort_external_fill(SeqId seq) { ext_.abort_fill(seq, false, ext_release()); }

  detail::ExternalKvState<Id> ext_;  // fills, leases, save pins, orphan holds (detail/external_kv.hpp)

 private:
  using sequence_type = SequenceState<Id>;
  Manager& self() noexcept { return static_cast<Manager&>(*this); }
  const Manager& self() const noexcept { return static_cast<const Manager&>(*this); }

  // try_admit_external's options for a new sequence: with a coarse group the hit lowered to a page boundary of
  // every group (detail::page_aligned_hit), the tokens between it and the full hit external too; the reservation
  // raised to cover the external tokens. `prepared`: the prompt's PreparedPrompt, whose hashes the hits read.
  void external_options(std::span<const TokenId> prompt, const RequestKeys* keys, const PreparedPrompt* prepared,
                        AdmitOptions& o, std::size_t& num_external_tokens) const {
    auto& m = self();
    if (m.layout_.any_coarse && num_external_tokens != 0 && !prompt.empty()) {  // on a page
      const std::size_t full = hit_of(prompt, keys, prepared, o.max_cached_tokens);
      const std::size_t from = external_hit(prompt, keys, prepared, o.max_cached_tokens);
      o.max_cached_tokens = from;
      num_external_tokens += full - from;
    }
    if (o.num_reserved_tokens) o.num_reserved_tokens = std::max(*o.num_reserved_tokens, num_external_tokens);
  }

  // What try_admit_external would take now (query_admit_external; `who` names the call in errors): of a prompt
  // hashed by prepare_prompt when `prepared` (its block hashes read, not recomputed; checked), else of `prompt`
  // and `keys` (validated, hashed). Pure.
  CapacityQuery plan_external(std::span<const TokenId> prompt, std::size_t num_external_tokens,
                              const RequestKeys* keys, const PreparedPrompt* prepared, const AdmitOptions& opts,
                              const char* who) const {
    auto& m = self();
    if (prepared != nullptr) {
      m.check_prepared(*prepared, who);
    } else {
      m.validate_prompt(prompt, keys, who, nullptr);
    }
    if (opts.retention) validate_retention(*opts.retention, who);
    AdmitOptions o = opts;
    external_options(prompt, keys, prepared, o, num_external_tokens);
    std::vector<BlockHash> hashes;
    detail::HitScratch<Id> scratch;
    auto& h = prepared != nullptr ? Manager::ready_hashes(*prepared) : hashes;
    return m.plan_admit_into(prompt, keys, o, h, prepared != nullptr, scratch, num_external_tokens).query;
  }

  // try_admit_external's `headroom_blocks` check: how many blocks the pool lacks for the admission plus the
  // headroom, counting every hit block as if cached (conservative); 0 when it has them or the admission does not
  // fit anyway (the admission answers then). Pure.
  std::size_t headroom_short(std::span<const TokenId> prompt, const RequestKeys* keys, const PreparedPrompt* prepared,
                             std::size_t num_external_tokens, const AdmitOptions& opts,
                             std::size_t headroom_blocks) const {
    auto& m = self();
    const CapacityQuery cq = plan_external(prompt, num_external_tokens, keys, prepared, opts, "try_admit_external");
    if (!cq.fits()) return 0;
    const std::size_t hit_blocks = hit_of(prompt, keys, prepared, opts.max_cached_tokens) / m.config_.block_size;
    const std::size_t need = cq.num_blocks + headroom_blocks + hit_blocks * m.layout_.num_groups;
    const std::size_t avail = m.pool_.alloc().num_available_blocks();
    return avail < need ? need - avail : 0;
  }

  // try_admit_external of `prompt` and `keys`, or of the PreparedPrompt `prepared` (then its tokens and keys, its
  // hashes read): the headroom check, the options, the admission, then the fill's ticket of the importable external
  // tokens after the hit (none when there are none). Undoes the admission on bad_alloc.
  ExternalAdmitResult<Id> admit_external(SeqId seq, std::span<const TokenId> prompt, const RequestKeys* keys,
                                         const PreparedPrompt* prepared, std::size_t num_external_tokens,
                                         const AdmitOptions& opts, std::size_t headroom_blocks) {
    auto& m = self();
    detail::refuse_state_table(m.layout_, "try_admit_external", seq);
    // Bad retention boundaries are an error before the headroom answer (which changes nothing either way).
    detail::check_retention_boundaries(opts, prepared != nullptr ? prepared->tokens.size() : prompt.size(),
                                       "try_admit_external");
    // Every hit block counted as if cached (conservative); a duplicate id is try_admit's error, not "no room".
    if (headroom_blocks != 0 && !prompt.empty() && !m.seqs_.contains(seq) && !m.swapped_.contains(seq)) {
      const auto short_by = headroom_short(prompt, keys, prepared, num_external_tokens, opts, headroom_blocks);
      if (short_by != 0) return {{AdmitStatus::kNoCapacity, 0, 0, 0, short_by}, {}};
    }
    AdmitOptions o = opts;
    if (!m.seqs_.contains(seq)) external_options(prompt, keys, prepared, o, num_external_tokens);
    ExternalAdmitResult<Id> r{
        prepared != nullptr ? m.admit_prepared(seq, *prepared, o, "try_admit_external", num_external_tokens)
                            : m.admit_new(seq, prompt, keys, o, "try_admit_external", num_external_tokens),
        {}};
    const std::size_t h = r.admit.num_cached_tokens;
    const std::size_t n = importable_tokens(h + num_external_tokens, prompt.size(), h);
    if (!r.admit.admitted() || n == 0) return r;
    try {
      const sequence_type& q = m.live(seq, "try_admit_external");
      std::vector<Id> row;  // scratch for a recurrent or coarse group's row
      r.ticket = ext_.open_fill(
          seq, m.layout_.num_groups, m.config_.block_size, h, n,
          [&](std::size_t g) { return detail::ticket_row<Id>(m.layout_, q, g, h + n, row); },
          [&](std::size_t g) { return detail::ticket_first_block(m.layout_, g, h, h + n); },
          ext_acquire(), ext_release());
    } catch (...) {
      m.free(seq);  // bad_alloc: undo the admission
      throw;
    }
    return r;
  }
  // References through the pool's reference rules (an external holder is a reference).
  auto ext_acquire() {
    return [this](Id b) { self().pool_.acquire_block(b); };
  }
  auto ext_release() {
    return [this](Id b) { self().pool_.release_block(b); };
  }
  // The local hit of an external admission or import: lookup's (hit_of), on a page boundary of every coarse group.
  std::size_t external_hit(std::span<const TokenId> prompt, const RequestKeys* keys, const PreparedPrompt* prepared,
                           std::optional<std::size_t> cap) const {
    auto& m = self();
    const auto at = [&](std::optional<std::size_t> c) { return hit_of(prompt, keys, prepared, c); };
    return detail::page_aligned_hit(m.layout_, cap, at);
  }
  // lookup(prompt, keys, cap); of a prepared prompt (`prepared`, checked by the caller), the same hit read from its
  // hashes by the admission's plan, no hashing (with several groups lookup is that plan; with one group the plan's
  // walk is lookup's, but for a prompt that never fits the pool, where the plan answers 0: the callers read the hit
  // only for a plan that fits).
  std::size_t hit_of(std::span<const TokenId> prompt, const RequestKeys* keys, const PreparedPrompt* prepared,
                     std::optional<std::size_t> cap) const {
    auto& m = self();
    if (prepared == nullptr) return m.lookup(prompt, keys, cap);
    if (!m.config_.enable_prefix_caching) return 0;
    AdmitOptions o;
    o.max_cached_tokens = cap;
    detail::HitScratch<Id> scratch;
    return m.plan_admit_into(prompt, keys, o, Manager::ready_hashes(*prepared), true, scratch).query.num_cached_tokens;
  }
};

}  // namespace pagedkv
