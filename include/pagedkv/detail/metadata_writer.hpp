// pagedkv/detail/metadata_writer.hpp: the batch-metadata writer of the cache manager: shape checks of one
// BatchMetadataBuffers set, one row of a page table, the copy and swap lists, and the padding (batch_metadata.hpp
// has the conventions). Pure functions over caller buffers; the manager decides what goes in them.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include <pagedkv/batch_metadata.hpp>

namespace pagedkv::detail {

/// What is wrong with the shapes of `buf` for a build of `batch` rows, `num_indices` page-table entries,
/// `num_new_tokens` slots, `num_copies` copy pairs, `num_swap_out` / `num_swap_in` swap pairs (0 when the set
/// carries no swaps), or nullopt when they fit: a span too small (an empty span skips its output), a span that may
/// not be empty (slot_mapping with new tokens, copies or swaps with pairs to hand out: they would be lost), indices
/// empty beside indptr, block_tables without a positive max_blocks_per_seq. The message names the span and sizes.
[[nodiscard]] inline std::optional<std::string> buffer_shape_error(const BatchMetadataBuffers& buf, std::size_t batch,
                                                                   std::size_t num_indices, std::size_t num_new_tokens,
                                                                   std::size_t num_copies, std::size_t num_swap_out,
                                                                   std::size_t num_swap_in) {
  const auto small = [](std::size_t have, std::size_t want) { return have != 0 && have < want; };
  const auto msg = [](const char* name, std::size_t have, std::size_t want) {
    return std::string(name) + " holds " + std::to_string(have) + " entries, needs " + std::to_string(want);
  };
  const std::pair<std::size_t, std::size_t> sizes[] = {
      {buf.indptr.size(), batch + 1},        {buf.indices.size(), num_indices},
      {buf.last_page_len.size(), batch},     {buf.seq_lens.size(), batch},
      {buf.qo_indptr.size(), batch + 1},     {buf.slot_mapping.size(), num_new_tokens},
      {buf.copies.size(), 2 * num_copies}};
  const char* names[] = {"indptr", "indices", "last_page_len", "seq_lens", "qo_indptr", "slot_mapping", "copies"};
  for (std::size_t i = 0; i < 7; ++i) {
    if (small(sizes[i].first, sizes[i].second)) return msg(names[i], sizes[i].first, sizes[i].second);
  }
  if (!buf.block_tables.empty()) {
    if (buf.max_blocks_per_seq <= 0) return std::string("block_tables set but max_blocks_per_seq <= 0");
    const std::size_t want = batch * static_cast<std::size_t>(buf.max_blocks_per_seq);
    if (small(buf.block_tables.size(), want)) return msg("block_tables", buf.block_tables.size(), want);
  }
  if (num_indices > 0 && buf.indices.empty() && !buf.indptr.empty()) {
    return std::string("indptr is set but indices is empty");
  }
  if (num_new_tokens > 0 && buf.slot_mapping.empty()) {
    return "slot_mapping is empty but the batch has " + std::to_string(num_new_tokens) +
           " new tokens: their writes would never be issued";
  }
  if (num_copies > 0 && buf.copies.empty()) {
    return "copies is empty but " + std::to_string(num_copies) +
           " copy-on-write copies belong to this build: they would be lost";
  }
  if (small(buf.swap_out.size(), 2 * num_swap_out)) return msg("swap_out", buf.swap_out.size(), 2 * num_swap_out);
  if (small(buf.swap_in.size(), 2 * num_swap_in)) return msg("swap_in", buf.swap_in.size(), 2 * num_swap_in);
  if (num_swap_out > 0 && buf.swap_out.empty()) {
    return "swap_out is empty but " + std::to_string(num_swap_out) +
           " device -> host copies are queued: they would be lost";
  }
  if (num_swap_in > 0 && buf.swap_in.empty()) {
    return "swap_in is empty but " + std::to_string(num_swap_in) +
           " host -> device copies are queued: they would be lost";
  }
  return std::nullopt;
}

/// Write row `b` of the page table of `buf` (unless its spans are empty): indptr[b] = blk, the row's `blocks`
/// (`[ceil(seq_len / block_size)]`) into indices from blk and into block_tables (0 after them), last_page_len,
/// seq_lens = seq_len, qo_indptr[b] = tok. Advances `blk` by the row's blocks. Precondition: shapes checked.
template <class Id>
void write_page_table_row(const BatchMetadataBuffers& buf, std::size_t b, std::span<const Id> blocks,
                          std::size_t seq_len, std::size_t block_size, std::size_t& blk, std::size_t tok) noexcept {
  const std::size_t nblocks = blocks.size();
  if (!buf.indptr.empty()) {
    buf.indptr[b] = static_cast<std::int32_t>(blk);
    std::copy(blocks.begin(), blocks.end(), buf.indices.begin() + static_cast<std::ptrdiff_t>(blk));
  }
  blk += nblocks;
  if (!buf.last_page_len.empty()) {
    buf.last_page_len[b] = static_cast<std::int32_t>(seq_len == 0 ? 0 : seq_len - (nblocks - 1) * block_size);
  }
  if (!buf.block_tables.empty()) {
    auto row = buf.block_tables.subspan(b * static_cast<std::size_t>(buf.max_blocks_per_seq),
                                        static_cast<std::size_t>(buf.max_blocks_per_seq));
    std::copy(blocks.begin(), blocks.end(), row.begin());
    std::fill(row.begin() + static_cast<std::ptrdiff_t>(nblocks), row.end(), std::int32_t{0});
  }
  if (!buf.seq_lens.empty()) buf.seq_lens[b] = static_cast<std::int32_t>(seq_len);
  if (!buf.qo_indptr.empty()) buf.qo_indptr[b] = static_cast<std::int32_t>(tok);
}

/// Fill `span` from index `from` to its end with `value` (nothing for an empty span).
template <class T, class V>
void pad_from(std::span<T> span, std::size_t from, V value) noexcept {
  if (!span.empty()) std::fill(span.begin() + static_cast<std::ptrdiff_t>(from), span.end(), static_cast<T>(value));
}

/// The padding of a build of `batch` rows, `blk` page-table entries and `tok` slots (batch_metadata.hpp): indptr and
/// qo_indptr repeat their last value, last_page_len and seq_lens 0, slot_mapping -1.
inline void pad_page_table(const BatchMetadataBuffers& buf, std::size_t batch, std::size_t blk,
                           std::size_t tok) noexcept {
  pad_from(buf.indptr, batch, blk);
  pad_from(buf.qo_indptr, batch, tok);
  pad_from(buf.last_page_len, batch, 0);
  pad_from(buf.seq_lens, batch, 0);
  pad_from(buf.slot_mapping, tok, -1);
}

/// Write the (src, dst) pairs of `copies` whose group is `group` into buf.copies, -1 after them; returns how many.
/// Precondition: buf.copies holds them (or no copy of the group exists).
template <class Copy>
std::size_t write_copies(const BatchMetadataBuffers& buf, std::span<const Copy> copies, std::uint32_t group) noexcept {
  std::size_t c = 0;
  for (const Copy& cp : copies) {
    if (cp.group != group) continue;
    buf.copies[2 * c] = static_cast<std::int32_t>(cp.src);
    buf.copies[2 * c + 1] = static_cast<std::int32_t>(cp.dst);
    ++c;
  }
  pad_from(buf.copies, 2 * c, -1);
  return c;
}

}  // namespace pagedkv::detail
