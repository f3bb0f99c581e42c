// pagedkv/detail/batch_build.hpp: the batch build of the cache manager (issue 32, docs/design.md "The manager in
// parts"): build_batch_metadata's validation (ids, scheduled tokens, buffer shapes), its reservations, the per-row
// loop (registration of full blocks, page-table rows, slot mapping, a recurrent group's state rows), the copies it
// hands out, the host tier's swaps and the release rule; with the build's scratch (its rows, their scheduled tokens,
// the page-table entries of each coarse group). The outputs are FlashInfer's paged layout and vLLM's slot mapping
// (batch_metadata.hpp). Nothing here knows the manager: the sequence map, the device pool, the host part, the
// counters and two hooks (write-through's on_registered, the release rule) are passed in per call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/cache_config.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/detail/group_coarse.hpp>
#include <pagedkv/detail/group_recurrent.hpp>
#include <pagedkv/detail/metadata_writer.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/sequence_state.hpp>
#include <pagedkv/stats.hpp>

namespace pagedkv::detail {

/// The batch build over block ids `Id`, with its scratch. One per manager; `build<kOne>` is one
/// build_batch_metadata call (kOne: the compiled one-full-group path, GroupLayout::simple).
template <class Id>
class BatchBuild {
 public:
  using sequence_type = SequenceState<Id>;
  using copy_type = BlockCopy<Id>;
  using coarse_type = CoarseGroup<Id>;
  using recurrent_type = RecurrentGroup<Id>;

  /// The scratch of a manager with `layout`'s groups (a page-table count per group when one is coarse).
  explicit BatchBuild(const GroupLayout& layout) {
    if (layout.any_coarse) coarse_indices_.assign(layout.num_groups, 0);
  }

  /// build_batch_metadata over `seqs` (SeqId -> SequenceState map), the device pool, the host part and the counters:
  /// writes one buffer set per group (`per_group`, [G]) and its sizes (`sizes_out`, [G]); `num_scheduled_tokens`
  /// empty (every pending slot) or [batch]. Validates everything first: an unknown or repeated id, a row scheduled
  /// more than its pending slots or nothing, a table over max_blocks_per_seq, totals over int32, a buffer too small
  /// raise kUnknownSequence / kInvalidArgument / kBadShape ("build_batch_metadata: ...") with nothing changed. Then
  /// registers the full blocks whose last write it issues (`on_registered(own, hash)` per registration: the
  /// write-through hook), writes the rows, hands out the selected copies, issues the swaps into group 0's buffers and
  /// applies `release_out_of_window(q)` per row (several groups; with config.release_at_build). The row loop dispatches the kinds inline per row
  /// and group (not visit_group: +1.6% instructions on the gate's groups1 row, docs/benchmarks.md "Manager split
  /// gate").
  template <bool kOne, class Seqs, class Pool, class Host, class OnRegistered, class Release>
  void build(const CacheConfig& config, const GroupLayout& layout, Seqs& seqs, Pool& pool, Host& host,
             CacheStats& stats, OnRegistered on_registered, Release release_out_of_window,
             std::span<const SeqId> batch, std::span<const BatchMetadataBuffers> per_group,
             std::span<const std::uint32_t> num_scheduled_tokens, std::span<BatchMetadataSizes> sizes_out) {
    const std::size_t G = layout.groups<kOne>();
    if (per_group.size() != G || sizes_out.size() != G) {
      detail::raise(Errc::kBadShape, "build_batch_metadata: " + std::to_string(per_group.size()) +
                                         " buffer sets and " + std::to_string(sizes_out.size()) + " sizes for " +
                                         std::to_string(G) + " groups");
    }
    if (!num_scheduled_tokens.empty() && num_scheduled_tokens.size() != batch.size()) {
      detail::raise(Errc::kBadShape, "build_batch_metadata: num_scheduled_tokens holds " +
                                         std::to_string(num_scheduled_tokens.size()) + " entries for a batch of " +
                                         std::to_string(batch.size()));
    }
    batch_scratch_.clear();
    batch_scratch_.reserve(batch.size());
    qlen_scratch_.clear();
    qlen_scratch_.reserve(batch.size());
    std::size_t num_indices = 0, num_new_tokens = 0;
    const std::size_t bs = config.block_size;
    if (layout.any_coarse) std::fill(coarse_indices_.begin(), coarse_indices_.end(), std::size_t{0});
    std::size_t max_registrations = 0, max_blocks = 0;
    const auto fail = [&](Errc c, std::string msg) {
      for (sequence_type* p : batch_scratch_) p->in_batch = false;
      detail::raise(c, "build_batch_metadata: " + std::move(msg));
    };
    std::size_t b_in = 0;
    for (SeqId id : batch) {
      const auto it = seqs.find(id);
      if (it == seqs.end()) fail(Errc::kUnknownSequence, "sequence " + std::to_string(id) + " is not live");
      sequence_type& q = it->second;
      if (q.in_batch) fail(Errc::kInvalidArgument, "sequence " + std::to_string(id) + " appears twice");
      q.in_batch = true;
      batch_scratch_.push_back(&q);
      const std::size_t q_len = num_scheduled_tokens.empty() ? q.num_pending() : num_scheduled_tokens[b_in];
      if (q_len > q.num_pending()) {
        fail(Errc::kInvalidArgument, "sequence " + std::to_string(id) + " is scheduled " + std::to_string(q_len) +
                                         " tokens but has " + std::to_string(q.num_pending()) + " pending slots");
      }
      if (!kOne && layout.any_state_table && q_len != 0 && q_len != q.num_pending()) [[unlikely]] {
        fail(Errc::kInvalidArgument, "sequence " + std::to_string(id) + " is scheduled " + std::to_string(q_len) +
                                         " of its " + std::to_string(q.num_pending()) +
                                         " pending slots: a recurrent group with its states in its table "
                                         "(state_in_table, vLLM's Mamba 'align') builds each growth whole (its "
                                         "state goes to the block where the growth ends)");
      }
      qlen_scratch_.push_back(static_cast<std::uint32_t>(q_len));
      ++b_in;
      const std::size_t seq_len = q.num_built + q_len;
      const std::size_t blocks = (seq_len + bs - 1) / bs;
      num_indices += blocks;
      num_new_tokens += q_len;
      max_blocks = std::max(max_blocks, blocks);
      if (config.enable_prefix_caching) {
        const std::size_t reg_end = std::min({seq_len, q.num_known()}) / bs;
        for (std::size_t g = 0; g < G; ++g) {
          const std::size_t registered = kOne ? q.num_registered : q.registered_of(g);
          // a coarse group: at most one page per match block + 1, each BlockRemoved + BlockStored on a re-key
          max_registrations += (reg_end - std::min(reg_end, registered)) *
                               (!kOne && layout.is_coarse(g) ? coarse_type::events_per_registration() : 1);
        }
      }
      for (std::size_t g = 0; g < per_group.size(); ++g) {
        const BatchMetadataBuffers& buf = per_group[g];
        std::size_t gblocks = blocks;
        if (!kOne && layout.is_coarse(g)) {  // a coarse group counts its pages
          gblocks = (seq_len + layout.page_tokens[g] - 1) / layout.page_tokens[g];
          coarse_indices_[g] += gblocks;
        }
        if (!buf.block_tables.empty() && gblocks > static_cast<std::size_t>(buf.max_blocks_per_seq)) {
          fail(Errc::kBadShape, (G > 1 ? "group " + std::to_string(g) + ": " : std::string()) + "sequence " +
                                    std::to_string(id) + " has " + std::to_string(gblocks) +
                                    " blocks > max_blocks_per_seq = " + std::to_string(buf.max_blocks_per_seq));
        }
      }
    }
    // Every row computes something (after the checks of ids, so an unknown or repeated id is named first).
    for (std::size_t r = 0; r < batch.size(); ++r) {
      if (qlen_scratch_[r] != 0) continue;
      fail(Errc::kInvalidArgument, detail::idle_row_message(batch[r], r, !num_scheduled_tokens.empty(),
                                                            batch_scratch_[r]->num_unslotted()));
    }
    // The copies this build hands out: its batch's own, and those reading a block it writes.
    const std::size_t num_copies = pool.copies().select(
        [](const sequence_type& owner) { return owner.in_batch || owner.num_pending() == 0; },
        [&](const copy_type& c) { return batch_writes<kOne>(config, layout, c.src, c.group); });
    if (num_indices > kMaxMetadataValue || num_new_tokens > kMaxMetadataValue) {
      for (sequence_type* p : batch_scratch_) p->in_batch = false;
      detail::check_metadata_value(num_indices, "build_batch_metadata: total blocks of the batch (indptr[batch])");
      detail::check_metadata_value(num_new_tokens,
                                   "build_batch_metadata: total new tokens of the batch (qo_indptr[batch])");
    }
    // Swaps: the queued ones, plus (write-through) an offload per block the previous build registered that the
    // host does not hold yet (an upper bound: the host may run out of blocks for some).
    const bool write_through = host && config.offload == OffloadPolicy::kWriteThrough;
    const std::size_t write_through_blocks = write_through ? host.num_write_through(pool) : 0;
    const std::size_t max_out = host ? host.transfers().num_queued(true) + write_through_blocks : 0;
    const std::size_t num_in = host ? host.transfers().num_queued(false) : 0;
    const std::size_t B = batch.size();
    for (std::size_t g = 0; g < G; ++g) {
      const BatchMetadataBuffers& buf = per_group[g];
      std::size_t group_copies = num_copies;
      if constexpr (!kOne) group_copies = pool.copies().num_selected_in(static_cast<std::uint32_t>(g));
      if (const auto bad = detail::buffer_shape_error(buf, B, layout.is_coarse(g) ? coarse_indices_[g] : num_indices,
                                                      num_new_tokens, group_copies,
                                                      g == 0 ? max_out : 0, g == 0 ? num_in : 0)) {
        fail(Errc::kBadShape, (G > 1 ? "group " + std::to_string(g) + ": " : std::string()) + *bad);
      }
      if constexpr (!kOne) {  // a kind's own outputs (a recurrent group's states and checkpoints)
        if (auto bad = detail::visit_group<Id>(layout, g, [&](const auto& kind) { return kind.buffer_error(buf, batch_scratch_, qlen_scratch_); })) {
          fail(Errc::kBadShape, std::move(*bad));
        }
      }
    }
    const BatchMetadataBuffers& buf0 = per_group[0];
    try {
      pool.events().reserve_more(max_registrations + write_through_blocks + host.num_held_back());
      pool.copies().reserve_taken(num_copies);
      pool.switched().clear();
      pool.switched().reserve(layout.simple ? max_registrations : max_blocks);
      if (host) host.reserve_build(write_through_blocks, write_through ? max_registrations : 0);
    } catch (...) {
      for (sequence_type* p : batch_scratch_) p->in_batch = false;
      throw;
    }

    // Validated. Write-through: offload what the previous build registered (its K/V is written by now). Then per
    // sequence: mark the scheduled slots built; per group register the full blocks whose last write this build
    // issues (switching duplicates to the registered block), then write. Nothing below throws.
    if (write_through) host.offload_registered(pool, stats);
    for (std::size_t g = 0; g < G; ++g) {
      sizes_out[g] = BatchMetadataSizes{};
      sizes_out[g].batch_size = B;
    }
    // Sparse window retention's rules per group (null: every group registers every block it can).
    const WindowRetention* const rules = kOne || layout.retention.empty() ? nullptr : layout.retention.data();
    for (std::size_t b = 0; b < B; ++b) {
      sequence_type& q = *batch_scratch_[b];
      q.in_batch = false;
      const std::size_t first = q.num_built;
      const std::size_t q_len = qlen_scratch_[b];
      q.num_built += q_len;
      const std::size_t seq_len = q.num_built;
      const std::size_t nblocks = (seq_len + bs - 1) / bs;
      for (std::size_t g = 0; g < G; ++g) {
        // Per row and group: the kinds' register_new and page size dispatched inline, not by visit_group (a visit
        // per row cost +1.6% instructions on the gate's groups1 row: docs/benchmarks.md "Manager split gate").
        const BatchMetadataBuffers& buf = per_group[g];
        std::size_t& blk = sizes_out[g].num_indices;
        std::size_t& tok = sizes_out[g].num_new_tokens;
        pool.switched().clear();
        if (!kOne && layout.registers_apart(g)) {  // (the dispatch here keeps DevicePool::register_blocks inlined)
          if (layout.is_state_table(g)) {
            detail::recurrent_group<Id>(layout, g).table().register_states(pool, q, first, seq_len, on_registered);
          } else {
            pool.register_coarse(q, g, layout.coarse_factor(g));
          }
        } else {
          pool.template register_blocks<kOne>(q, g, layout.windows[g], rules != nullptr ? rules + g : nullptr,
                                              on_registered);
        }
        std::size_t gb = bs, gn = nblocks;  // a coarse group counts in its pages
        if (!kOne && layout.is_coarse(g)) {
          gb = layout.page_tokens[g];
          gn = (seq_len + gb - 1) / gb;
        }
        detail::write_page_table_row(buf, b, detail::table_in<kOne>(q, g).blocks().first(gn), seq_len, gb, blk, tok);
        if constexpr (!kOne) {
          if (layout.is_recurrent(g)) {
            detail::recurrent_group<Id>(layout, g).write_state_row(q, b, first, seq_len, buf,
                                                                   sizes_out[g].num_checkpoints, pool.switched());
            if (!buf.slot_mapping.empty()) std::fill_n(buf.slot_mapping.begin() + tok, q_len, std::int64_t{-1});
            tok += q_len;
            continue;
          }
        }
        if (!buf.slot_mapping.empty()) {
          write_slots<kOne>(config, layout, pool.switched(), q, g, first, q_len, buf.slot_mapping.subspan(tok, q_len));
        }
        tok += q_len;
      }
    }
    // The selected copies (less any whose destination was switched out above) are issued: hand them out, then
    // release the references they held on their sources. The rest stay pending for their own batch's build.
    pool.copies().take_selected();
    for (std::size_t g = 0; g < G; ++g) {
      const BatchMetadataBuffers& buf = per_group[g];
      BatchMetadataSizes& sz = sizes_out[g];
      detail::pad_page_table(buf, B, sz.num_indices, sz.num_new_tokens);
      sz.num_copies = detail::write_copies(buf, pool.copies().taken(), static_cast<std::uint32_t>(g));
      if (layout.is_recurrent(g)) recurrent_type::pad_state_outputs(buf, B, sz.num_checkpoints);
    }
    for (const copy_type& c : pool.copies().taken()) pool.release_block(c.src);
    pool.copies().clear_taken();
    // The swaps: every queued copy under this build's token, into group 0's buffers.
    if (host) {
      const std::uint64_t token =
          host.issue(buf0.swap_out, buf0.swap_in, sizes_out[0].num_swap_out, sizes_out[0].num_swap_in);
      for (std::size_t g = 0; g < G; ++g) sizes_out[g].transfer_token = token;
    }
    detail::pad_from(buf0.swap_out, 2 * sizes_out[0].num_swap_out, -1);
    detail::pad_from(buf0.swap_in, 2 * sizes_out[0].num_swap_in, -1);
    // The release rule: this step's kernels read these blocks; later steps may reuse them (or, with
    // CacheConfig::release_at_build false, the caller's release_skipped_blocks).
    if constexpr (!kOne) {
      if (config.release_at_build) release_rows(release_out_of_window);
    }
    host.retry_held_back(pool);  // a held-back host copy whose parent this build registered again
    pool.note_peak();
  }

 private:
  // The release rule over the build's rows (out of line: the build's own body stays small enough for GCC to inline
  // the one-group paths of the unit, docs/benchmarks.md "Manager split gate").
  template <class Release>
  [[gnu::noinline]] void release_rows(Release& release_out_of_window) {
    for (sequence_type* q : batch_scratch_) release_out_of_window(*q);
  }

  // Whether the build being validated writes into block b: a position it schedules (rows batch_scratch_ /
  // qlen_scratch_, from each row's first unbuilt position) lies in b. O(blocks the build writes). This and
  // write_slots are always inlined: left to GCC, the move pushed the gate driver's unit past its inline-unit-growth
  // budget and one_group_hit's push_back went out of line (admitfree-xxh3 +0.56% Ir; docs/design.md, move 8a).
  template <bool kOne>
  [[nodiscard, gnu::always_inline]] bool batch_writes(const CacheConfig& config, const GroupLayout& layout, Id b,
                                  std::size_t g) const noexcept {
    const std::size_t bs = kOne ? config.block_size : layout.page_tokens[g];
    for (std::size_t r = 0; r < batch_scratch_.size(); ++r) {
      const sequence_type& q = *batch_scratch_[r];
      const std::size_t n = qlen_scratch_[r];
      if (n == 0) continue;
      const auto blocks = detail::table_in<kOne>(q, g).blocks();
      for (std::size_t i = q.num_built / bs; i <= (q.num_built + n - 1) / bs; ++i) {
        if (blocks[i] == b) return true;
      }
      if constexpr (!kOne) {
        if (g > 0 && q.other_groups[g - 1].state == b) return true;  // a working state is updated in place
      }
    }
    return false;
  }

  // Slots of positions [first, first + n) of `q` into out[0, n), -1 inside blocks switched by this build
  // (`switched`: ascending block indices). One run per block: a vectorizable fill of consecutive slots.
  template <bool kOne>
  [[gnu::always_inline]] static void write_slots(const CacheConfig& config, const GroupLayout& layout, const std::vector<std::size_t>& switched,
                          const sequence_type& q, std::size_t g, std::size_t first, std::size_t n,
                          std::span<std::int64_t> out) {
    const std::size_t bs = kOne ? config.block_size : layout.page_tokens[g];
    const auto blocks = detail::table_in<kOne>(q, g).blocks();
    std::int64_t* w = out.data();
    std::size_t k = 0;  // next switched block to consider (ascending)
    for (std::size_t p = first; p < first + n;) {
      const std::size_t blk = p / bs;
      const std::size_t off = p - blk * bs;
      const std::size_t run = std::min(bs - off, first + n - p);
      while (k < switched.size() && switched[k] < blk) ++k;
      if (k < switched.size() && switched[k] == blk) {
        std::fill_n(w, run, std::int64_t{-1});
      } else {
        const std::int64_t base = static_cast<std::int64_t>(blocks[blk]) * static_cast<std::int64_t>(bs) +
                                  static_cast<std::int64_t>(off);
        for (std::size_t j = 0; j < run; ++j) w[j] = base + static_cast<std::int64_t>(j);
      }
      w += run;
      p += run;
    }
  }

  std::vector<sequence_type*> batch_scratch_;  // the build's rows
  std::vector<std::uint32_t> qlen_scratch_;    // tokens scheduled per row
  std::vector<std::size_t> coarse_indices_;    // [G] the build's page-table entries per coarse group
};

}  // namespace pagedkv::detail
