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

const char* to_string(EvictionKind eviction) noexcept {
  switch (eviction) {
    case EvictionKind::kLru: return "lru";
    case EvictionKind::kSlru: return "slru";
    case EvictionKind::kPriority: return "priority";
  }
  return "unknown";
}

const char* to_string(ReserveKind reserve) noexcept {
  switch (reserve) {
    case ReserveKind::kPrompt: return "prompt";
    case ReserveKind::kChunk: return "chunk";
  }
  return "unknown";
}

const char* to_string(pagedkv::OffloadPolicy offload) noexcept {
  switch (offload) {
    case pagedkv::OffloadPolicy::kNone: return "none";
    case pagedkv::OffloadPolicy::kWriteBack: return "write-back";
    case pagedkv::OffloadPolicy::kWriteThrough: return "write-through";
  }
  return "unknown";
}

const char* to_string(pagedkv::PreemptMode preempt) noexcept {
  switch (preempt) {
    case pagedkv::PreemptMode::kRecompute: return "recompute";
    case pagedkv::PreemptMode::kSwap: return "swap";
  }
  return "unknown";
}

std::size_t usable_blocks_for(double capacity_tokens, std::uint32_t block_size, const char* flag) {
  const double blocks = std::floor(capacity_tokens / block_size);
  if (!(blocks >= 1.0)) {
    throw OptionError(std::string(flag) + " " + format_tokens(capacity_tokens) + " holds no block of " +
                                std::to_string(block_size) + " tokens");
  }
  if (blocks >= static_cast<double>(std::numeric_limits<std::uint32_t>::max())) {
    throw OptionError(std::string(flag) + " " + format_tokens(capacity_tokens) +
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

void add_tier_fields(Row& row, const pagedkv::CacheStats& s, const Options& opt) {
  const double q = static_cast<double>(s.prefix_query_tokens);
  const std::uint64_t gpu_hits = s.prefix_hit_tokens - s.host_hit_tokens;
  const auto bytes = [&](std::uint64_t blocks) {
    return static_cast<double>(blocks) * opt.block_size * static_cast<double>(opt.kv_bytes_per_token);
  };
  row.add("gpu_hit_ratio", q == 0 ? 0.0 : static_cast<double>(gpu_hits) / q, 4)
      .add("host_hit_ratio", q == 0 ? 0.0 : static_cast<double>(s.host_hit_tokens) / q, 4)
      .add("gpu_hit_share", s.prefix_hit_tokens == 0 ? 0.0
                                                     : static_cast<double>(gpu_hits) /
                                                           static_cast<double>(s.prefix_hit_tokens), 4)
      .add("onboards", s.onboards)
      .add("onboarded_gb", bytes(s.onboards) / 1e9, 2)
      .add("offloads", s.offloads)
      .add("offloaded_gb", bytes(s.offloads) / 1e9, 2)
      .add("offloads_dropped", s.offloads_dropped)
      .add("host_evictions", s.host_evictions)
      .add("swap_outs", s.swap_outs)
      .add("swapped_out_gb", bytes(s.swap_outs) / 1e9, 2)
      .add("swap_ins", s.swap_ins)
      .add("swapped_in_gb", bytes(s.swap_ins) / 1e9, 2);
}

MetadataBuffers::MetadataBuffers(std::size_t max_batch, std::size_t max_indices, std::size_t max_new_tokens,
                                 std::size_t max_copies, std::size_t max_swaps)
    : indptr_(max_batch + 1),
      indices_(max_indices),
      last_page_len_(max_batch),
      seq_lens_(max_batch),
      qo_indptr_(max_batch + 1),
      copies_(2 * max_copies),
      swap_out_(2 * max_swaps),
      swap_in_(2 * max_swaps),
      slot_mapping_(max_new_tokens) {}

pagedkv::BatchMetadataBuffers MetadataBuffers::view(std::size_t num_indices, std::size_t num_new_tokens,
                                                    std::size_t num_swap_out, std::size_t num_swap_in) {
  if (num_indices > indices_.size() || num_new_tokens > slot_mapping_.size() ||
      2 * num_swap_out > swap_out_.size() || 2 * num_swap_in > swap_in_.size()) {
    throw std::logic_error("metadata buffers too small: " + std::to_string(num_indices) + " indices (capacity " +
                           std::to_string(indices_.size()) + "), " + std::to_string(num_new_tokens) +
                           " new tokens (capacity " + std::to_string(slot_mapping_.size()) + "), " +
                           std::to_string(num_swap_out) + " / " + std::to_string(num_swap_in) +
                           " swap pairs (capacity " + std::to_string(swap_out_.size() / 2) + ")");
  }
  pagedkv::BatchMetadataBuffers b;
  b.indptr = indptr_;
  b.indices = std::span<std::int32_t>(indices_).first(num_indices);
  b.last_page_len = last_page_len_;
  b.seq_lens = seq_lens_;
  b.qo_indptr = qo_indptr_;
  b.slot_mapping = std::span<std::int64_t>(slot_mapping_).first(num_new_tokens);
  b.copies = copies_;
  b.swap_out = std::span<std::int32_t>(swap_out_).first(2 * num_swap_out);
  b.swap_in = std::span<std::int32_t>(swap_in_).first(2 * num_swap_in);
  return b;
}

double hit_ratio(const pagedkv::CacheStats& stats) noexcept {
  return stats.prefix_query_tokens == 0
             ? 0.0
             : static_cast<double>(stats.prefix_hit_tokens) / static_cast<double>(stats.prefix_query_tokens);
}

}  // namespace replay
