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
#include <span>
#include <utility>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/detail/metadata_writer.hpp>
#include <pagedkv/sequence_state.hpp>

namespace pagedkv::detail {

/// Recurrent group `g` of a manager (KVCacheGroupSpec with AttentionKind::kRecurrent): `block_size` tokens per match
/// block, a checkpoint every `interval` tokens (the spec's window_tokens), `prefix_caching` (checkpoints are kept
/// and registered only with it), `last_checkpoint` (KVCacheGroupSpec::last_checkpoint). A sequence's group state is
/// its GroupTableState (table, state, last_block / last_pos, drafts). `Pool`: the manager's DevicePool. Hooks never
/// allocate memory; block allocation goes through the caller's `take()` (capacity checked by the caller).
template <class Id>
struct RecurrentGroup {
  using sequence_type = SequenceState<Id>;

  std::size_t g = 0;
  std::size_t block_size = 0;
  std::size_t interval = 0;
  bool prefix_caching = false;
  bool last_checkpoint = false;

  /// Whether the group keeps the state at each sequence's last block boundary (KVCacheGroupSpec::last_checkpoint).
  [[nodiscard]] bool keeps_last() const noexcept { return prefix_caching && last_checkpoint; }
  /// Blocks a sequence holds in this group whatever its length: its working state and its last checkpoint.
  [[nodiscard]] std::size_t state_blocks() const noexcept { return keeps_last() ? 2 : 1; }
  /// The checkpoints that positions (from, to] complete (multiples of the interval), with prefix caching on; 0
  /// otherwise.
  [[nodiscard]] std::size_t checkpoints_between(std::size_t from, std::size_t to) const noexcept {
    if (!prefix_caching) return 0;
    return to / interval - from / interval;
  }
  // Upper bound of the checkpoints a build lists for this group of q computing positions [first, end): the
  // table's checkpoint blocks ending inside, the last checkpoint, and with lookahead positions inside, the working
  // state at the last known token and one draft state per lookahead position.
  [[nodiscard]] std::size_t checkpoints_in_step(const sequence_type& q, std::size_t first,
                                                std::size_t end) const noexcept {
    const std::size_t bs = block_size;
    const auto blocks = q.table_of(g).blocks();
    std::size_t n = keeps_last() ? 1 : 0;
    for (std::size_t i = first / bs; (i + 1) * bs <= end; ++i) n += blocks[i] != Id{0} ? 1 : 0;
    const std::size_t base = q.num_known();  // lookahead: the working state at base, a draft state per position
    if (end > base) n += (first < base ? 1 : 0) + end - std::max(first, base);
    return n;
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

  // The last checkpoint of q in this group, as q leaves the device: registered under the chain hash of the
  // blocks before its position unless that state is registered already (or it holds none), then released (to the
  // cache when registered). Room for its event reserved by the caller.
  template <class Pool>
  void release_last_checkpoint(Pool& pool, sequence_type& q) const {
    GroupTableState<Id>& st = q.other_groups[g - 1];
    const Id b = st.last_block;
    const std::size_t i = st.last_pos / block_size;  // the state after blocks [0, i)
    if (i > 0 && i <= q.hashes.size() && pool.alloc().refcount(b) - pool.pins(b) == 1 &&
        !pool.ix(g).find(q.hashes[i - 1])) {
      (void)pool.ix(g).insert(q.hashes[i - 1], b);
      pool.alloc().set_hashed(b, true);
      if (pool.events().enabled()) pool.record_stored(q, i - 1, q.hashes[i - 1], g);
    }
    pool.release_block(b);
    st.last_block = Id{0};
    st.last_pos = 0;
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
