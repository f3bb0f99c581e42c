// examples/replay/modes.cpp: helpers shared by the mode implementations.
#include "modes.hpp"

#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

namespace replay {
namespace {

std::string format_tokens(double tokens) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", tokens);
  return buf;
}

}  // namespace

const char* to_string(HashKind hash) noexcept {
  switch (hash) {
    case HashKind::kSha256: return "sha256";
    case HashKind::kXxh3: return "xxh3";
  }
  return "unknown";
}

std::size_t usable_blocks_for(double capacity_tokens, std::uint32_t block_size) {
  const double blocks = std::floor(capacity_tokens / block_size);
  if (!(blocks >= 1.0)) {
    throw std::invalid_argument("--capacity-tokens " + format_tokens(capacity_tokens) + " holds no block of " +
                                std::to_string(block_size) + " tokens");
  }
  if (blocks >= static_cast<double>(std::numeric_limits<std::uint32_t>::max())) {
    throw std::invalid_argument("--capacity-tokens " + format_tokens(capacity_tokens) +
                                " needs more than 2^32 - 1 blocks");
  }
  return static_cast<std::size_t>(blocks);
}

std::string trace_name(const Trace& trace) { return trace.path.stem().string(); }

void add_cost_fields(Row& row, double manager_seconds, std::uint64_t block_ops) {
  row.add("manager_seconds", manager_seconds, 3)
      .add("block_ops", block_ops)
      .add("ns_per_block_op", block_ops == 0 ? 0.0 : manager_seconds * 1e9 / static_cast<double>(block_ops), 1);
}

MetadataBuffers::MetadataBuffers(std::size_t max_batch, std::size_t max_indices, std::size_t max_new_tokens,
                                 std::size_t max_copies)
    : indptr_(max_batch + 1),
      indices_(max_indices),
      last_page_len_(max_batch),
      seq_lens_(max_batch),
      qo_indptr_(max_batch + 1),
      copies_(2 * max_copies),
      slot_mapping_(max_new_tokens) {}

pagedkv::BatchMetadataBuffers MetadataBuffers::view(std::size_t num_indices, std::size_t num_new_tokens) {
  if (num_indices > indices_.size() || num_new_tokens > slot_mapping_.size()) {
    throw std::logic_error("metadata buffers too small: " + std::to_string(num_indices) + " indices (capacity " +
                           std::to_string(indices_.size()) + "), " + std::to_string(num_new_tokens) +
                           " new tokens (capacity " + std::to_string(slot_mapping_.size()) + ")");
  }
  pagedkv::BatchMetadataBuffers b;
  b.indptr = indptr_;
  b.indices = std::span<std::int32_t>(indices_).first(num_indices);
  b.last_page_len = last_page_len_;
  b.seq_lens = seq_lens_;
  b.qo_indptr = qo_indptr_;
  b.slot_mapping = std::span<std::int64_t>(slot_mapping_).first(num_new_tokens);
  b.copies = copies_;
  return b;
}

double hit_ratio(const pagedkv::CacheStats& stats) noexcept {
  return stats.prefix_query_tokens == 0
             ? 0.0
             : static_cast<double>(stats.prefix_hit_tokens) / static_cast<double>(stats.prefix_query_tokens);
}

}  // namespace replay
