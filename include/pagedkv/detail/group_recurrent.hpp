// pagedkv/detail/group_recurrent.hpp: the recurrent group kind (docs/groups.md "Recurrent groups"; issue 32's "one
// small type per group kind"): a Mamba / linear-attention layer's state per sequence, a working state block, an
// optional last checkpoint, checkpoint blocks at a fixed interval in its table, and a speculative draft state per
// lookahead position. vLLM V1 keeps the same in MambaManager (single_type_kv_cache_manager.py); SGLang in its
// MambaPool. The kind is a small value (group index, block size, interval, flags) built per call and group by the
// manager; its hooks take the device pool and the sequence. Nothing here knows the manager or the host tier.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/detail/group_full.hpp>
#include <pagedkv/detail/group_state_table.hpp>
#include <pagedkv/detail/metadata_writer.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv::detail {

/// Recurrent group `g` of a manager (KVCacheGroupSpec with AttentionKind::kRecurrent): `block_size` tokens per match
/// block, a checkpoint every `interval` tokens (the spec's window_tokens), `prefix_caching` (checkpoints are kept
/// and registered only with it), `last_checkpoint` (KVCacheGroupSpec::last_checkpoint). A sequence's group state is
/// its GroupTableState (table, state, last_block / last_pos, drafts). `Pool`: the manager's DevicePool. Hooks never
/// allocate memory; block allocation goes through the caller's `take()` (capacity checked by the caller).
// A hook it does not override is the full kind's (detail/group_full.hpp).
template <class Id>
struct RecurrentGroup : FullGroup<Id> {
  using base = FullGroup<Id>;
  using typename base::sequence_type;
  using base::block_size;
  using base::g;

  std::size_t interval = 0;
  bool prefix_caching = false;
  bool last_checkpoint = false;
  bool in_table = false;          ///< KVCacheGroupSpec::state_in_table: the hooks forward to table() where they differ.
  WindowRetention retention{};    ///< The group's sparse retention (in_table only; GroupLayout::retention_of).
  std::uint32_t checkpoint_align = 0;  ///< KVCacheGroupSpec::prefill_checkpoint_alignment (in_table only).

  /// The table rules of a group with its states in its table (detail/group_state_table.hpp).
  [[nodiscard]] StateTable<Id> table() const noexcept {
    return {g, block_size, prefix_caching, retention, checkpoint_align};
  }

  /// The window of the hit and registration rules (KVCacheGroupSpec::hit_window): a sliding window of 2 tokens, so
  /// a hit of k blocks needs the checkpoint kept with block k - 1 only.
  [[nodiscard]] static constexpr AttentionWindow window() noexcept {
    AttentionWindow w;
    w.sliding_window_tokens = 2;
    return w;
  }
  /// Blocks an admission hitting `k` match blocks and reserving `reserved` tokens takes in this group: its state
  /// blocks and the checkpoints the reservation completes.
  template <class Pool>
  [[nodiscard]] std::size_t admit_need(const Pool&, std::size_t k, std::size_t reserved, std::span<const Id>) const {
    if (in_table) return reserved != 0 ? 1 : 0;  // the block where the reservation ends
    return state_blocks() + checkpoints_between(k * block_size, k * block_size + reserved);
  }
  /// Blocks a prompt needs in this group at least: its state blocks (in_table: the block of its end).
  [[nodiscard]] std::size_t min_need(std::size_t) const noexcept { return in_table ? 1 : state_blocks(); }
  /// The admission's hit: the full kind's; every checkpoint before the hit's last one counts released.
  void take_hit(sequence_type& q, std::span<const Id> hit, bool simple) const {
    base::take_hit(q, hit, simple);
    q.released_of(g) = first_kept_block(window(), hit.size() * block_size, static_cast<std::uint32_t>(block_size));
  }
  /// DevicePool::register_blocks under the hit window (checkpoint blocks; null entries skipped). Nothing in_table:
  /// such a group registers only at its builds (StateTable::register_states: a block holds a state only where a
  /// step ended).
  template <bool kOne, class Pool, class OnRegistered>
  void register_new(Pool& pool, sequence_type& q, OnRegistered&& on_registered) const {
    if (in_table) return;
    pool.template register_blocks<kOne>(q, g, window(), nullptr, on_registered);
  }
  /// The release rule: no block is kept for the next query (the working state is apart); the written checkpoints
  /// before `committed` go to the cache, but the hit's checkpoint stays while it holds the state (no build wrote the
  /// working state yet: a commit_lookahead that accepted nothing built).
  template <class Pool>
  void release(Pool& pool, sequence_type& q, std::size_t committed) const {
    if (in_table) {  // every block before the one holding the state at `committed` (vLLM's remove_skipped_blocks)
      if (committed != 0) base::release_before(pool, q, g, table().column(committed));
      return;
    }
    const std::size_t kept = !q.other_groups[g - 1].state_valid && committed > 0 ? 1 : 0;
    base::release_before(pool, q, g, committed / block_size - kept);
  }
  /// After a rewind: a checkpoint block left partial is nulled, the dropped lookahead slots' drafts released
  /// (nothing in_table: its last block holds the running state; rewind is refused there but for n = 0).
  template <class Pool>
  void after_rewind(Pool& pool, sequence_type& q, std::size_t) const {
    if (in_table) return;
    null_partial_checkpoint(pool, q);
    release_drafts(pool, q.other_groups[g - 1], q.num_lookahead);
  }

  /// Whether the group keeps the state at each sequence's last block boundary (KVCacheGroupSpec::last_checkpoint).
  [[nodiscard]] bool keeps_last() const noexcept { return prefix_caching && last_checkpoint; }
  /// Blocks a sequence holds in this group apart from its table: its working state and its last checkpoint (none
  /// in_table).
  [[nodiscard]] std::size_t state_blocks() const noexcept { return in_table ? 0 : keeps_last() ? 2 : 1; }
  /// The checkpoints that positions (from, to] complete (multiples of the interval), with prefix caching on; 0
  /// otherwise.
  [[nodiscard]] std::size_t checkpoints_between(std::size_t from, std::size_t to) const noexcept {
    if (!prefix_caching || in_table) return 0;
    return to / interval - from / interval;
  }
  // Upper bound of the checkpoints a build lists for this group of q computing positions [first, end): the
  // table's checkpoint blocks ending inside, the last checkpoint, and with lookahead positions inside, the working
  // state at the last known token and one draft state per lookahead position.
  [[nodiscard]] std::size_t checkpoints_in_step(const sequence_type& q, std::size_t first,
                                                std::size_t end) const noexcept {
    if (in_table) return table().checkpoints_in_step(q, first, end);
    const std::size_t bs = block_size;
    const auto blocks = q.table_of(g).blocks();
    std::size_t n = keeps_last() ? 1 : 0;
    for (std::size_t i = first / bs; (i + 1) * bs <= end; ++i) n += blocks[i] != Id{0} ? 1 : 0;
    const std::size_t base = q.num_known();  // lookahead: the working state at base, a draft state per position
    if (end > base) n += (first < base ? 1 : 0) + end - std::max(first, base);
    return n;
  }

  /// An admission's states in this group (after take_hit): its working state, its last checkpoint when it keeps
  /// one, then the checkpoints the `reserved` tokens complete. Capacity checked by the caller (admit_need).
  template <class Take>
  void admit(sequence_type& q, std::size_t reserved, Take&& take) const {
    if (in_table) {
      table().extend(q, reserved, take);
      return;
    }
    q.other_groups[g - 1].state = take();
    if (keeps_last()) q.other_groups[g - 1].last_block = take();
    grow(q, reserved, take);
  }
  /// What growing q by n positions (`drafts` of them lookahead slots) takes in this group: into `needed` the
  /// checkpoints the growth completes, a draft state per lookahead slot, and a copy of a shared working state or
  /// last checkpoint; into `held_after` the blocks q holds in the group afterwards.
  template <class Pool>
  void growth_need(const Pool& pool, const sequence_type& q, std::size_t n, std::size_t drafts, std::size_t& needed,
                   std::size_t& held_after) const {
    if (in_table) {
      needed += table().need(pool, q, n);
      held_after += table().held_after(q, n);
      return;
    }
    const GroupTableState<Id>& st = q.other_groups[g - 1];
    const BlockTable<Id>& t = st.table;
    const std::size_t ck = checkpoints_between(q.num_slotted(), q.num_slotted() + n);
    needed += ck + drafts + (st.state != Id{0} && pool.table_refcount(st.state) > 1 ? 1 : 0) +
              (st.last_block != Id{0} && pool.table_refcount(st.last_block) > 1 ? 1 : 0);
    held_after += state_blocks() + ck + drafts;
    for (std::size_t i = q.released_of(g); i < t.num_blocks(); ++i) held_after += t.blocks()[i] != Id{0} ? 1 : 0;
  }
  /// Grow q by n positions in this group (grow), then give a shared working state its own block
  /// (copy_shared_state). Returns whether a copy-on-write was queued. Capacity checked, room reserved by the caller.
  template <class Pool, class Take>
  bool grow_shared(Pool& pool, sequence_type& q, std::size_t n, Take&& take) const {
    if (in_table) return table().grow(pool, q, n, take);
    grow(q, n, take);
    return copy_shared_state(pool, q, take);
  }
  /// A draft state per lookahead slot of q's `k` new ones. With every known position built but the working state
  /// not written yet (the hit's checkpoint holds the state), a step computing only drafts would not write it, so it
  /// takes a copy of the checkpoint now (pending like a copy-on-write). Room reserved by the caller.
  template <class Pool, class Take>
  void take_drafts(Pool& pool, sequence_type& q, std::size_t k, Take&& take) const {
    GroupTableState<Id>& st = q.other_groups[g - 1];
    for (std::size_t j = 0; j < k; ++j) st.drafts.push_back(take());
    if (!st.state_valid && q.num_built == q.num_known() && q.num_built > 0) {
      const Id src = st.table.blocks()[q.num_built / block_size - 1];
      pool.acquire_block(src);  // the copy's hold on its source
      pool.copies().push(BlockCopy<Id>{src, st.state, static_cast<std::uint32_t>(g)}, q);
      st.state_valid = true;
    }
  }
  /// q leaving the device in this group: its working state released, its last checkpoint registered and released
  /// (release_last_checkpoint), its draft states released. Holds nothing in a group of another kind (g >= 1), so
  /// the caller may call it for every g >= 1. Room for the events reserved by the caller.
  template <class Pool>
  [[gnu::noinline]] void release_states(Pool& pool, sequence_type& q) const {
    GroupTableState<Id>& st = q.other_groups[g - 1];
    if (st.state != Id{0}) {
      pool.release_block(st.state);
      st.state = Id{0};
      st.state_valid = false;
    }
    if (st.last_block != Id{0}) release_last_checkpoint(pool, q);
    if (!st.drafts.empty()) release_drafts(pool, st, 0);
  }

  /// Resume of a swapped sequence (KVCacheManager::try_resume): a new working state, filled by `fill(block,
  /// host_state)` (a kSwapIn copy) when the swap-out copied one (`host_state` != 0; else the zero or the hit's state
  /// stays to be computed), and a new last-checkpoint block when kept; state_blocks() blocks through `take()`
  /// (capacity checked by the caller).
  template <class Take, class Fill>
  void resume_states(sequence_type& q, Id host_state, Take&& take, Fill&& fill) const {
    GroupTableState<Id>& st = q.other_groups[g - 1];
    st.state = take();
    st.state_valid = host_state != Id{0};
    if (st.state_valid) fill(st.state, host_state);
    if (keeps_last()) st.last_block = take();
  }
  /// mark_checkpoint at logical block i: 1 when this group has no checkpoint block there yet (the block it takes).
  [[nodiscard]] std::size_t checkpoint_need(const sequence_type& q, std::size_t i) const noexcept {
    return q.table_of(g).blocks()[i] == Id{0} ? 1 : 0;
  }
  /// mark_checkpoint at logical block i: a checkpoint block there, through `take()`, unless one is kept already.
  template <class Take>
  void keep_checkpoint(sequence_type& q, std::size_t i, Take&& take) const {
    if (checkpoint_need(q, i) != 0) (void)q.table_of(g).replace_block(i, take());
  }

  /// A build's check of this group's buffers beyond the page table's: the state and checkpoint outputs of the
  /// batch `rows` (`q_lens`: tokens each computes) cannot be dropped. The kBadShape message naming the first short
  /// buffer, or none. Nothing changes.
  [[nodiscard]] std::optional<std::string> buffer_error(const BatchMetadataBuffers& buf,
                                                        std::span<sequence_type* const> rows,
                                                        std::span<const std::uint32_t> q_lens) const {
    const std::size_t B = rows.size();
    if (B == 0) return std::nullopt;
    std::size_t checkpoints = 0;
    for (std::size_t r = 0; r < B; ++r) {
      const std::size_t first = rows[r]->num_built;
      checkpoints += checkpoints_in_step(*rows[r], first, first + q_lens[r]);
    }
    const std::pair<std::size_t, std::size_t> need[] = {{buf.state_in.size(), B},
                                                         {buf.state_out.size(), B},
                                                         {buf.checkpoint_indptr.size(), B + 1},
                                                         {buf.checkpoint_positions.size(), checkpoints},
                                                         {buf.checkpoint_blocks.size(), checkpoints}};
    const char* names[] = {"state_in", "state_out", "checkpoint_indptr", "checkpoint_positions", "checkpoint_blocks"};
    for (std::size_t i = 0; i < 5; ++i) {
      if (need[i].first >= need[i].second) continue;
      return "group " + std::to_string(g) + " (recurrent): " + names[i] + " holds " + std::to_string(need[i].first) +
             " entries, needs " + std::to_string(need[i].second) +
             " (a recurrent group's state and checkpoint outputs cannot be dropped)";
    }
    return std::nullopt;
  }

  // Grow this group's table of q by n positions: null entries, except a fresh block for each logical block
  // the growth completes at a checkpoint (the state after its last token is kept there). Capacity checked and
  // room reserved by the caller; `take()` returns a fresh block of the group.
  template <class Take>
  void grow(sequence_type& q, std::size_t n, Take&& take) const {
    BlockTable<Id>& t = q.table_of(g);
    const std::size_t bs = block_size;
    const std::size_t from = t.num_tokens();
    const std::size_t end = from + n;
    const auto completes_checkpoint = [&](std::size_t i) {
      return (i + 1) * bs > from && (i + 1) * bs <= end && checkpoints_between(i * bs + bs - 1, (i + 1) * bs) != 0;
    };
    if (from % bs != 0 && completes_checkpoint(from / bs)) {
      const Id old = t.replace_block(from / bs, take());
      (void)old;  // null: a checkpoint block is taken when its block is complete (rewind nulls a partial one)
    }
    t.extend(n, [&](std::size_t i) { return completes_checkpoint(i) ? take() : Id{0}; });
  }

  // This group of q about to grow: a working state shared with a fork gets its own block, a copy of it when
  // it holds the state (else the state is still the zero state or the hit's checkpoint, which the table keeps); a
  // shared last checkpoint is left to the other side, this one starts a new one. Capacity checked and room
  // reserved by the caller. Returns whether a copy was queued (a copy-on-write).
  template <class Pool, class Take>
  bool copy_shared_state(Pool& pool, sequence_type& q, Take&& take) const {
    GroupTableState<Id>& st = q.other_groups[g - 1];
    if (st.last_block != Id{0} && pool.table_refcount(st.last_block) > 1) {  // a new last checkpoint, nothing in it yet
      const Id old = st.last_block;
      st.last_block = take();
      st.last_pos = 0;
      pool.release_block(old);
    }
    if (st.state == Id{0} || pool.table_refcount(st.state) <= 1) return false;
    const Id src = st.state;
    st.state = take();
    if (!st.state_valid) {
      pool.release_block(src);
      return false;
    }
    pool.copies().push(BlockCopy<Id>{src, st.state, static_cast<std::uint32_t>(g)}, q);  // holds our reference on src
    return true;
  }

  // A recurrent group's checkpoint block that a rewind left partial will not be written: null, as before it was
  // completed (grow takes a block again when a growth completes it).
  // (Out of line, as the other hooks here: the hot one-group paths stay small enough to inline.)
  template <class Pool>
  [[gnu::noinline]] void null_partial_checkpoint(Pool& pool, sequence_type& q) const {
    BlockTable<Id>& t = q.table_of(g);
    if (t.num_tokens() % block_size != 0 && t.blocks().back() != Id{0}) {
      pool.release_block(t.replace_block(t.num_blocks() - 1, Id{0}));
    }
  }

  // commit_lookahead of this group of q: `accepted` of the lookahead slots after `base` known tokens were
  // accepted. Of them, the first `built` = min(accepted, num_built - base) have their states in the drafts: the
  // state after the last of them becomes the working state (block ids swapped), the last block boundary among them
  // becomes the last checkpoint (KVCacheGroupSpec::last_checkpoint; when it is also the working state's position,
  // the working state is filled by a copy of it, pending like a copy-on-write). Every other draft is released. Room
  // for the copy reserved by the caller. Never throws.
  template <class Pool>
  [[gnu::noinline]] void resolve_drafts(Pool& pool, sequence_type& q, std::size_t base, std::size_t accepted) const {
    GroupTableState<Id>& st = q.other_groups[g - 1];
    const std::size_t bs = block_size;
    const std::size_t built = std::min(accepted, q.num_built > base ? q.num_built - base : 0);
    bool copied = false;
    const std::size_t boundary = (base + built) / bs * bs;  // the last boundary the accepted drafts cross
    if (built > 0 && keeps_last() && boundary > base) {
      st.last_pos = 0;  // as a build: the table's checkpoint there, if any, is the last one
      if (st.table.blocks()[boundary / bs - 1] == Id{0}) {
        std::swap(st.last_block, st.drafts[boundary - base - 1]);
        st.last_pos = boundary;
        if (boundary == base + built) {  // the working state is the same state: a copy of the last checkpoint
          pool.acquire_block(st.last_block);  // the copy's hold on its source
          pool.copies().push(BlockCopy<Id>{st.last_block, st.state, static_cast<std::uint32_t>(g)}, q);
          st.state_valid = true;
          copied = true;
        }
      }
    }
    if (built > 0 && !copied) {
      std::swap(st.state, st.drafts[built - 1]);
      st.state_valid = true;
    }
    release_drafts(pool, st, 0);
  }

  // Release the draft states of st from the `keep`-th on (lookahead slots dropped or resolved).
  template <class Pool>
  [[gnu::noinline]] static void release_drafts(Pool& pool, GroupTableState<Id>& st, std::size_t keep) {
    while (st.drafts.size() > keep) {
      pool.release_block(st.drafts.back());
      st.drafts.pop_back();
    }
  }

  // The last checkpoint of q in this group, as q leaves the device: registered (register_last_checkpoint), then
  // released (to the cache when registered). Room for its event reserved by the caller.
  template <class Pool>
  void release_last_checkpoint(Pool& pool, sequence_type& q) const {
    GroupTableState<Id>& st = q.other_groups[g - 1];
    register_last_checkpoint(pool, q);
    pool.release_block(st.last_block);
    st.last_block = Id{0};
    st.last_pos = 0;
  }

  /// The last checkpoint of q in this group registered under the chain hash of the blocks before its position,
  /// unless q holds none, shares it, or that state is registered already; q keeps it. Room for its event
  /// reserved by the caller.
  template <class Pool>
  void register_last_checkpoint(Pool& pool, sequence_type& q) const {
    const GroupTableState<Id>& st = q.other_groups[g - 1];
    const Id b = st.last_block;
    const std::size_t i = st.last_pos / block_size;  // the state after blocks [0, i)
    if (b != Id{0} && i > 0 && i <= q.hashes.size() && pool.alloc().refcount(b) - pool.pins(b) == 1 &&
        !pool.ix(g).find(q.hashes[i - 1])) {
      (void)pool.ix(g).insert(q.hashes[i - 1], b);
      pool.alloc().set_hashed(b, true);
      if (pool.events().enabled()) pool.record_stored(q, i - 1, q.hashes[i - 1], g);
    }
  }

  // --- External KV (issue 33, docs/design.md "External KV"): a state handed to another engine or taken from one.
  // A recurrent group's entry at logical block i of a hand-off is the state after min((i + 1) x block_size,
  // num_tokens) tokens (the tokens up to the end of that block): a checkpoint for a full block, the working state
  // for the last one. A consumer resumes from one state, at the end of its import, so only that entry moves (vLLM
  // hands over the working state of an N-1-token prefill the same way: vllm#37310).

  /// Producer: the block holding the state after min((i + 1) x block_size, num_built) tokens of settled q: the
  /// working state at num_built (while no build wrote it, the hit's checkpoint the table keeps), else the table's
  /// checkpoint block there, the last checkpoint, or the checkpoint the pool caches under the hash of blocks
  /// [0, i]; the null block 0 when q has no such state. Pure.
  template <class Pool>
  [[nodiscard]] Id handoff_state_at(const Pool& pool, const sequence_type& q, std::size_t i) const {
    const GroupTableState<Id>& st = q.other_groups[g - 1];
    const std::size_t pos = std::min((i + 1) * block_size, q.num_built);
    if (pos == 0) return Id{0};
    if (pos == q.num_built && st.state_valid) return st.state;
    if (pos % block_size != 0) return Id{0};
    const std::size_t j = pos / block_size - 1;
    const auto blocks = st.table.blocks();
    if (j < blocks.size() && blocks[j] != Id{0}) return blocks[j];
    if (st.last_block != Id{0} && st.last_pos == pos) return st.last_block;
    if (j >= q.hashes.size()) return Id{0};
    const auto c = pool.ix(g).find(q.hashes[j]);
    return c ? *c : Id{0};
  }
  /// Consumer: the logical block whose hand-off entry holds the state after `end_token` (> 0) tokens.
  [[nodiscard]] std::size_t state_entry(std::size_t end_token) const noexcept {
    return (end_token + block_size - 1) / block_size - 1;
  }
  /// Consumer (try_admit_external): whether the state after `end_token` tokens of admitted q is received into the
  /// table's checkpoint block there (the growth took one: end_token is a checkpoint position), rather than into
  /// the working state. The table's entry is the admission's until the fill ends (a waiting sequence is not built
  /// or rewound).
  [[nodiscard]] bool fills_checkpoint(const sequence_type& q, std::size_t end_token) const noexcept {
    return end_token % block_size == 0 && q.table_of(g).blocks()[state_entry(end_token)] != Id{0};
  }
  /// Consumer: this group's row of a fill ticket ending at `end_token` (> 0), over logical blocks
  /// [0, state_entry(end_token)]: null but the last, the block that receives the state after end_token tokens
  /// (fills_checkpoint: the table's checkpoint block; else the working state). Positions before end_token are not
  /// computed here, so no other state of the group is transferred. Allocates `row`.
  void ticket_row(const sequence_type& q, std::size_t end_token, std::vector<Id>& row) const {
    const std::size_t e = state_entry(end_token);
    row.assign(e + 1, Id{0});
    row[e] = fills_checkpoint(q, end_token) ? q.table_of(g).blocks()[e] : q.other_groups[g - 1].state;
  }
  /// Consumer: the fill of q up to `end_token` completed with every block valid: the working state holds the state
  /// when it received it (ticket_row); a checkpoint block that received it serves the next build as a hit's does.
  /// The checkpoint blocks before it were never written: the release rule of the completion frees them (they are
  /// not registered). Call before that release.
  void complete_fill(sequence_type& q, std::size_t end_token) const {
    if (!fills_checkpoint(q, end_token)) q.other_groups[g - 1].state_valid = true;
  }

  // This group's outputs of batch row b (sequence q computing positions [first, seq_len)): the block its
  // initial state is read from, its working state, and the checkpoints whose last position it computes (a block
  // switched to an identical registered one by this build is not written: it holds that state already), in position
  // order. A row reaching into lookahead positions (after the base = num_known known tokens) writes no state_out: the
  // working state is a checkpoint entry at base, each lookahead position's state an entry into its draft block. Marks
  // the working state valid when the row writes it. Room checked by the build. `switched_blocks`: the
  // logical blocks the build's registration switched (DevicePool::switched).
  [[gnu::noinline]] void write_state_row(sequence_type& q, std::size_t b, std::size_t first, std::size_t seq_len,
                                         const BatchMetadataBuffers& buf, std::size_t& num_checkpoints,
                                         std::span<const std::size_t> switched_blocks) const {
    if (in_table) {
      table().write_state_row(q, b, first, seq_len, buf, num_checkpoints);
      return;
    }
    GroupTableState<Id>& st = q.other_groups[g - 1];
    const auto blocks = st.table.blocks();
    const std::size_t bs = block_size;
    const std::size_t base = q.num_known();
    std::int32_t in = -1;  // the zero state
    if (first > base) {
      in = static_cast<std::int32_t>(st.drafts[first - base - 1]);
    } else if (st.state_valid) {
      in = static_cast<std::int32_t>(st.state);
    } else if (first > 0) {
      in = static_cast<std::int32_t>(blocks[first / bs - 1]);  // the hit's checkpoint
    }
    buf.state_in[b] = in;
    buf.state_out[b] = seq_len <= base ? static_cast<std::int32_t>(st.state) : -1;
    if (b == 0) buf.checkpoint_indptr[0] = 0;
    const auto put = [&](std::size_t pos, Id block) {
      buf.checkpoint_positions[num_checkpoints] = static_cast<std::int32_t>(pos);
      buf.checkpoint_blocks[num_checkpoints] = static_cast<std::int32_t>(block);
      ++num_checkpoints;
    };
    // The table's checkpoint blocks (of the interval, or marked) that end at position `pos` (a block boundary).
    const auto table_entry = [&](std::size_t pos) {
      const std::size_t i = pos / bs - 1;
      const bool switched = std::find(switched_blocks.begin(), switched_blocks.end(), i) != switched_blocks.end();
      if (blocks[i] != Id{0} && !switched) put(pos, blocks[i]);
    };
    const std::size_t known_end = std::min(seq_len, base);
    for (std::size_t pos = (first / bs + 1) * bs; pos <= known_end; pos += bs) table_entry(pos);
    // The last block boundary of the known positions this step crosses, into the last checkpoint (unless the table
    // keeps a checkpoint there already).
    const std::size_t boundary = known_end / bs * bs;
    if (keeps_last() && boundary > first) {
      st.last_pos = 0;
      if (blocks[boundary / bs - 1] == Id{0}) {
        put(boundary, st.last_block);
        st.last_pos = boundary;
      }
    }
    if (seq_len <= base || first < base) st.state_valid = true;
    if (seq_len > base) {  // lookahead positions
      if (first < base) put(base, st.state);
      for (std::size_t pos = std::max(first, base) + 1; pos <= seq_len; ++pos) {
        if (pos % bs == 0) table_entry(pos);
        put(pos, st.drafts[pos - base - 1]);
      }
    }
    buf.checkpoint_indptr[b + 1] = static_cast<std::int32_t>(num_checkpoints);
  }

  // Padding of a recurrent group's outputs after a build of `batch` rows and `n` checkpoints (see
  // BatchMetadataBuffers).
  static void pad_state_outputs(const BatchMetadataBuffers& buf, std::size_t batch, std::size_t n) {
    pad_from(buf.state_in, batch, -1);
    pad_from(buf.state_out, batch, -1);
    if (!buf.checkpoint_indptr.empty()) {
      buf.checkpoint_indptr[0] = batch == 0 ? 0 : buf.checkpoint_indptr[0];
      pad_from(buf.checkpoint_indptr, batch + 1, static_cast<std::int32_t>(n));
    }
    pad_from(buf.checkpoint_positions, n, -1);
    pad_from(buf.checkpoint_blocks, n, -1);
  }
};

}  // namespace pagedkv::detail
