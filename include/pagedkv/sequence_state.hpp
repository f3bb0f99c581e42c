// pagedkv/sequence_state.hpp: what the cache manager knows about one live sequence (request): its block table, its
// token ids and block hashes, and the cursors that say which positions have slots, which have had their K/V writes
// issued, and which hold tokens whose ids are not known yet (speculative lookahead).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include <pagedkv/block_table.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/request_keys.hpp>
#include <pagedkv/retention.hpp>

namespace pagedkv {

/// The block table of KV-cache group g >= 1 of a sequence (group 0's is SequenceState::table), with its two
/// per-group cursors. Every group's table covers the same positions; a windowed group's leading entries may be the
/// null block 0 (released, or before the window at a prefix hit).
template <BlockIdType Id = std::uint32_t>
struct GroupTableState {
  BlockTable<Id> table;            ///< Logical -> physical blocks of this group.
  std::size_t num_registered = 0;  ///< Leading full blocks that need no registration attempt in this group.
  std::size_t num_released = 0;    ///< Leading logical blocks that are the null block 0.
  /// Recurrent-state groups only (docs/groups.md): the block of the sequence's working state (0 = none), held
  /// while the sequence lives, updated in place by every build; shared after a fork until the next growth copies it.
  Id state = 0;
  /// Whether `state` holds the state after `num_built` tokens. False from admission to the first build: the state
  /// is then the zero state (num_built 0) or the prefix hit's checkpoint, logical block num_built / block_size - 1.
  bool state_valid = false;
  /// Recurrent groups with KVCacheGroupSpec::last_checkpoint: the block holding the state at the last block boundary
  /// a build crossed (0 = none), and that boundary (tokens; 0 = nothing written yet). Shared after a fork until the
  /// next growth of either side, which then starts a new one.
  Id last_block = 0;
  std::size_t last_pos = 0;
  /// Recurrent groups, while lookahead slots are outstanding (speculative decoding): `drafts[j]` receives the state
  /// after num_known + j + 1 tokens (the state after draft token j), one block per lookahead slot;
  /// commit_lookahead keeps the one after the last accepted draft as the working state and releases the others.
  std::vector<Id> drafts;
};

/// One live sequence as the KVCacheManager tracks it. A plain aggregate with derived queries; the manager keeps
/// every invariant below (the model-based test checks them after every operation).
///
/// Positions of a sequence, in token units, split by four cursors
/// (`num_built <= num_slotted`, `num_slotted <= num_known + num_lookahead`):
/// ```
///   [0, num_built)               K/V writes issued by a built step (or found in the prefix cache)
///   [num_built, num_slotted)     slots reserved, writes not yet issued ("pending": the next builds emit them)
///   [num_slotted, num_known)     prompt tokens known but without slots yet (chunked admission)
///   lookahead                    the last `num_lookahead` slotted positions hold tokens whose ids the host does
///                                not know yet (draft tokens proposed on the GPU); then num_slotted = num_known +
///                                num_lookahead and every known token has a slot
/// ```
/// `num_slotted` is `table.num_tokens()`; `num_known` is `tokens.size()`. With several KV-cache groups, `table`,
/// `num_registered` and `num_released` are group 0's and `other_groups[g - 1]` holds group g's (`table_of(g)`,
/// `registered_of(g)`, `released_of(g)`); the token, hash and build cursors are shared by every group (one step
/// writes every group's layers).
/// A full block i is *registrable* (may enter the prefix index) when `(i + 1) * block_size <= min(num_built,
/// num_known)`: its last write has been issued and every one of its token ids is known.
///
/// Thread safety: none (owned by the manager, one writer). Invalidation: spans into `tokens` / `table.blocks()`
/// are invalidated by any change to the sequence.
template <BlockIdType Id = std::uint32_t>
struct SequenceState {
  /// An empty sequence with `num_groups` >= 1 block tables of `block_size` tokens per block (group 0's always;
  /// group g's `group_block_sizes[g]` when that span has an entry for it that is not 0: a coarse-page group,
  /// KVCacheGroupSpec::block_size).
  explicit SequenceState(std::uint32_t block_size, std::size_t num_groups = 1,
                         std::span<const std::uint32_t> group_block_sizes = {})
      : table(block_size) {
    other_groups.reserve(num_groups - 1);
    for (std::size_t g = 1; g < num_groups; ++g) {
      const std::uint32_t b = g < group_block_sizes.size() && group_block_sizes[g] != 0 ? group_block_sizes[g]
                                                                                        : block_size;
      other_groups.push_back({BlockTable<Id>(b), 0, 0, Id{0}, false, Id{0}, 0, {}});
    }
  }

  BlockTable<Id> table;                     ///< Logical -> physical blocks for the slotted positions.
  std::vector<TokenId> tokens;              ///< Known token ids, `[num_known]`.
  std::vector<BlockHash> hashes;            ///< Chain hashes of the known full blocks, `[num_known / block_size]`.
  std::size_t num_registered = 0;           ///< Leading full blocks that need no registration attempt.
  std::shared_ptr<const RequestKeys> keys;  ///< Extra keys (salt, adapter, multimodal); null = none.
  std::shared_ptr<const RetentionConfig> retention;  ///< Retention priorities of its blocks; null = the default.
  std::size_t num_prompt_tokens = 0;        ///< Prompt length at admission (retention: later blocks are decode).
  std::size_t num_built = 0;                ///< Positions whose K/V writes have been issued (see above).
  std::size_t num_lookahead = 0;            ///< Trailing slotted positions whose token ids are unknown.
  std::uint32_t num_pending_copies = 0;     ///< Copy-on-write copies into this table not yet handed out.
  bool in_batch = false;                    ///< Scratch mark of build_batch_metadata.
  std::size_t num_released = 0;             ///< Group 0: leading logical blocks that are the null block 0.
  std::vector<GroupTableState<Id>> other_groups;  ///< Groups 1 .. G - 1 (empty with one group).
  /// Sparse window retention (CacheConfig::window_retention_interval): the token positions whose window tails the
  /// sequence's sliding-window groups register, fixed at admission (AdmitOptions; a fork keeps its parent's): the
  /// replay boundary (prompt_retention_tokens - 1) and the shared-prefix junction; 0 = none.
  std::size_t retention_replay = 0;
  std::size_t retention_junction = 0;

  /// KV-cache groups of the sequence.
  [[nodiscard]] std::size_t num_groups() const noexcept { return 1 + other_groups.size(); }
  /// Group g's block table. Precondition: g < num_groups().
  [[nodiscard]] BlockTable<Id>& table_of(std::size_t g) noexcept { return g == 0 ? table : other_groups[g - 1].table; }
  [[nodiscard]] const BlockTable<Id>& table_of(std::size_t g) const noexcept {
    return g == 0 ? table : other_groups[g - 1].table;
  }
  /// Group g's leading full blocks that need no registration attempt. Precondition: g < num_groups().
  [[nodiscard]] std::size_t& registered_of(std::size_t g) noexcept {
    return g == 0 ? num_registered : other_groups[g - 1].num_registered;
  }
  [[nodiscard]] std::size_t registered_of(std::size_t g) const noexcept {
    return g == 0 ? num_registered : other_groups[g - 1].num_registered;
  }
  /// Group g's leading null blocks (released, or before its window at a prefix hit). Precondition: g < num_groups().
  [[nodiscard]] std::size_t& released_of(std::size_t g) noexcept {
    return g == 0 ? num_released : other_groups[g - 1].num_released;
  }
  [[nodiscard]] std::size_t released_of(std::size_t g) const noexcept {
    return g == 0 ? num_released : other_groups[g - 1].num_released;
  }

  /// Positions with slots (tokens whose K/V has, or will have, a place in the pool).
  [[nodiscard]] std::size_t num_slotted() const noexcept { return table.num_tokens(); }
  /// Known token ids (prompt + committed).
  [[nodiscard]] std::size_t num_known() const noexcept { return tokens.size(); }
  /// Slotted positions whose writes a build has not issued yet.
  [[nodiscard]] std::size_t num_pending() const noexcept { return num_slotted() - num_built; }
  /// Known prompt tokens that have no slot yet (chunked admission reserves the prompt chunk by chunk).
  [[nodiscard]] std::size_t num_unslotted() const noexcept {
    return num_lookahead != 0 ? 0 : num_known() - std::min(num_known(), num_slotted());
  }
  /// Full blocks that may be registered now: their writes are issued and their token ids known.
  [[nodiscard]] std::size_t num_registrable_blocks() const noexcept {
    return std::min({num_built, num_known(), num_slotted()}) / table.block_size();
  }
  /// Nothing outstanding: every known token has a built slot, no lookahead, no copy into the table pending. Fork
  /// requires a settled parent (a child must never depend on writes or copies not yet issued).
  [[nodiscard]] bool settled() const noexcept {
    return num_built == num_slotted() && num_slotted() == num_known() && num_lookahead == 0 &&
           num_pending_copies == 0;
  }
  /// Slot of position `pos` (block id * block_size + offset). Precondition: pos < num_slotted().
  [[nodiscard]] std::int64_t slot(std::size_t pos) const noexcept { return table.slot(pos); }
  /// Empty every field but the block tables, keeping the vectors' capacity, for the next admission to reuse this
  /// state (the manager's spare sequences). Precondition: every group's table released (empty).
  void clear_for_reuse() noexcept {
    tokens.clear();
    hashes.clear();
    keys.reset();
    retention.reset();
    num_registered = 0;
    num_released = 0;
    num_prompt_tokens = 0;
    retention_replay = 0;
    retention_junction = 0;
    num_built = 0;
    num_lookahead = 0;
    num_pending_copies = 0;
    in_batch = false;
    for (auto& og : other_groups) {
      og.num_registered = 0;
      og.num_released = 0;
      og.state = Id{0};
      og.state_valid = false;
      og.last_block = Id{0};
      og.last_pos = 0;
      og.drafts.clear();
    }
  }
};

namespace detail {
/// Group g's block table of `q`. kOne: the loop is compiled for one full-attention group (statically `q.table`, g
/// unused); otherwise `q.table_of(g)`. Precondition: g < the sequence's groups.
template <bool kOne, class Seq>
[[nodiscard]] auto& table_in(Seq& q, std::size_t g) noexcept {
  if constexpr (kOne) {
    (void)g;
    return q.table;
  } else {
    return q.table_of(g);
  }
}
}  // namespace detail

}  // namespace pagedkv
