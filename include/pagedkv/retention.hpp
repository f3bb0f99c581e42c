// pagedkv/retention.hpp: per-request retention priorities (TensorRT-LLM's KvCacheRetentionConfig): which priority,
// and for how long, each block of a request keeps once it is cached.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <pagedkv/error.hpp>
#include <pagedkv/eviction.hpp>

namespace pagedkv {

/// Priority of the prompt tokens [begin, end) of a request (TensorRT-LLM's TokenRangeRetentionConfig). Units:
/// token positions from the start of the prompt. `priority` in [kMinRetentionPriority, kMaxRetentionPriority]
/// (0..100, higher = evicted later); `duration`: how long after the block is cached the priority holds before it
/// falls back to kDefaultRetentionPriority (nullopt = for as long as the block stays cached), counted on the
/// manager's retention clock (`KVCacheManager::expire_retention`).
struct TokenRangeRetention {
  std::size_t begin = 0;                                 ///< First token position of the range.
  std::optional<std::size_t> end = std::nullopt;         ///< One past the last; nullopt = to the end of the prompt.
  std::uint8_t priority = kDefaultRetentionPriority;     ///< 0..100.
  std::optional<std::chrono::nanoseconds> duration = std::nullopt;  ///< > 0 when set.
};

/// A request's retention config: prompt token ranges (sorted by `begin`, non-overlapping; the positions they do
/// not cover have the default priority) and the priority of blocks that hold only generated tokens (TensorRT-LLM's
/// decode_retention_priority / decode_duration_ms; e.g. 0-10 to let prompt blocks outlive generated ones).
///
/// A block of `block_size` tokens at positions [s, s + block_size) takes, when its last table holder releases it:
/// the highest priority among the ranges overlapping [s, min(s + block_size, prompt_len)) with that range's
/// duration (a block a system-prompt range ends inside is protected), the default priority if it overlaps the
/// prompt but no range, and `decode_priority` / `decode_duration` if it starts at or after the prompt's end.
/// Source: TensorRT-LLM KV cache reuse docs ("KV cache retention"), arXiv 2309.06180 for the pool it applies to.
struct RetentionConfig {
  std::vector<TokenRangeRetention> ranges;                 ///< Sorted by begin, non-overlapping.
  std::uint8_t decode_priority = kDefaultRetentionPriority;  ///< Blocks past the prompt: 0..100.
  std::optional<std::chrono::nanoseconds> decode_duration = std::nullopt;  ///< > 0 when set.
};

/// The priority and expiry one block takes (see RetentionConfig).
struct BlockRetention {
  std::uint8_t priority = kDefaultRetentionPriority;               ///< 0..100.
  std::optional<std::chrono::nanoseconds> duration = std::nullopt;  ///< From the moment it is cached.
};

/// Check `config`: every priority <= kMaxRetentionPriority, every duration > 0, every range non-empty
/// (`end > begin`) and the ranges sorted by begin without overlap (a range with no end must be the last). Throws
/// kInvalidArgument naming the range index and the bad value; `what` prefixes the message.
inline void validate_retention(const RetentionConfig& config, const char* what) {
  auto fail = [&](const std::string& msg) { detail::raise(Errc::kInvalidArgument, std::string(what) + ": " + msg); };
  auto check_prio = [&](std::uint8_t p, const std::string& where) {
    if (p > kMaxRetentionPriority) {
      fail(where + " priority " + std::to_string(p) + " outside [0, " + std::to_string(kMaxRetentionPriority) + "]");
    }
  };
  auto check_duration = [&](const std::optional<std::chrono::nanoseconds>& d, const std::string& where) {
    if (d && d->count() <= 0) fail(where + " duration " + std::to_string(d->count()) + " ns is not positive");
  };
  check_prio(config.decode_priority, "retention decode");
  check_duration(config.decode_duration, "retention decode");
  for (std::size_t i = 0; i < config.ranges.size(); ++i) {
    const TokenRangeRetention& r = config.ranges[i];
    const std::string where = "retention range " + std::to_string(i);
    check_prio(r.priority, where);
    check_duration(r.duration, where);
    if (r.end && *r.end <= r.begin) {
      fail(where + " [" + std::to_string(r.begin) + ", " + std::to_string(*r.end) + ") is empty");
    }
    if (i + 1 < config.ranges.size()) {
      const TokenRangeRetention& n = config.ranges[i + 1];
      if (!r.end || *r.end > n.begin) {
        fail(where + " overlaps or follows range " + std::to_string(i + 1) + " (begin " + std::to_string(n.begin) +
             "): ranges must be sorted by begin and disjoint");
      }
    }
  }
}

/// The retention of the block covering token positions [block_begin, block_begin + block_size) of a request whose
/// prompt has `prompt_len` tokens (see RetentionConfig). Precondition: `config` validated. O(log ranges).
[[nodiscard]] inline BlockRetention block_retention(const RetentionConfig& config, std::size_t block_begin,
                                                    std::size_t block_size, std::size_t prompt_len) {
  if (block_begin >= prompt_len) return {config.decode_priority, config.decode_duration};
  const std::size_t block_end = std::min(block_begin + block_size, prompt_len);
  BlockRetention out;
  bool any = false;
  // First range that may overlap: the last one beginning before block_end, walking back while they overlap.
  const auto& rs = config.ranges;
  std::size_t lo = 0;
  std::size_t hi = rs.size();
  while (lo < hi) {  // first range with begin >= block_end
    const std::size_t mid = (lo + hi) / 2;
    if (rs[mid].begin < block_end) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  for (std::size_t i = lo; i-- > 0;) {
    const TokenRangeRetention& r = rs[i];
    const std::size_t r_end = r.end.value_or(prompt_len);
    if (r_end <= block_begin) break;  // sorted and disjoint: earlier ranges end earlier
    if (!any || r.priority > out.priority) {
      out = {r.priority, r.duration};
      any = true;
    }
  }
  return out;
}

}  // namespace pagedkv
