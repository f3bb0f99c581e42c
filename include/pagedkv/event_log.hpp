// pagedkv/event_log.hpp: the cache manager's record of KV events (block stored / removed / all cleared), drained
// by the engine and forwarded to KV-aware routers.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

#include <pagedkv/events.hpp>

namespace pagedkv {

/// An append-only log of KVEvents with per-event sequence numbers (1, 2, 3, ... over the log's lifetime), drained
/// by the engine. Disabled logs record nothing and cost one branch per would-be event.
/// Thread safety: none (one writer, the manager's). Allocation: amortized O(1) per event; draining moves events out.
class EventLog {
 public:
  /// A log that records only when `enabled`.
  explicit EventLog(bool enabled) : enabled_(enabled) {}

  /// Whether events are recorded.
  [[nodiscard]] bool enabled() const noexcept { return enabled_; }

  /// Record a new event of type `t` with the next sequence number; returns it for the caller to fill.
  /// Precondition: enabled().
  KVEvent& push(KVEventType t) {
    KVEvent& e = events_.emplace_back();
    e.seq_no = next_seq_no_++;
    e.type = t;
    return e;
  }

  /// Reserve room for `n` more events, so that recording them cannot throw (call before a mutation that must not
  /// fail halfway). No-op when disabled.
  void reserve_more(std::size_t n) {
    if (!enabled_ || events_.capacity() - events_.size() >= n) return;
    events_.reserve(std::max(events_.size() + n, 2 * events_.capacity()));
  }

  /// Move the recorded events (oldest first) to the end of `out`; returns how many.
  std::size_t drain(std::vector<KVEvent>& out) {
    const std::size_t n = events_.size();
    out.insert(out.end(), std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
    events_.clear();
    return n;
  }

  /// Events recorded and not yet drained.
  [[nodiscard]] std::size_t size() const noexcept { return events_.size(); }

 private:
  bool enabled_;
  std::vector<KVEvent> events_;
  std::uint64_t next_seq_no_ = 1;
};

}  // namespace pagedkv
