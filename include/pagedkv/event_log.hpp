// pagedkv/event_log.hpp: the cache manager's record of KV events (block stored / removed / all cleared): per-step
// batches with sequence numbers, and a snapshot of what the published stream says is cached, for consumers that
// join late or lost messages.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <optional>
#include <unordered_map>
#include <vector>

#include <pagedkv/events.hpp>

namespace pagedkv {

/// What the event stream says is cached at batch `seq_no`: one kBlockStored event per (hash, medium, group) still
/// present, oldest first. Applying the batches numbered > seq_no to it gives the stream's later states.
struct KVEventSnapshot {
  std::uint64_t seq_no = 0;          ///< The last batch taken before the snapshot (0: none yet).
  std::vector<KVEvent> stored;       ///< kBlockStored events, in the order they were recorded.
};

/// An append-only log of KVEvents with per-event sequence numbers (1, 2, 3, ... over the log's lifetime), taken by
/// the engine once per step as a numbered batch (vLLM's KVEventBatch) or drained as a plain list. Disabled logs
/// record nothing and cost one branch per would-be event.
///
/// Snapshot: the log mirrors the stream it has handed out (taken or drained events) in a registry keyed by (hash,
/// medium, group): a stored event inserts, a removed event erases, an all-cleared event erases its medium. So
/// `snapshot()` at batch n plus the batches after n reproduces exactly the set a consumer of the whole stream
/// holds. Memory: one KVEvent per cached block while events are enabled (about 100 bytes + the block's token
/// ids), nothing when disabled.
/// Thread safety: none (one writer, the manager's). Allocation: amortized O(1) per event.
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

  /// The events recorded since the last take or drain, as the next numbered batch with timestamp `ts`; nullopt
  /// (and no number used) when there are none, so a consumer sees consecutive numbers exactly when it missed
  /// nothing. Updates the snapshot registry.
  std::optional<KVEventBatch> take_batch(double ts) {
    if (events_.empty()) return std::nullopt;
    KVEventBatch b;
    b.seq_no = ++last_batch_seq_no_;
    b.ts = ts;
    apply(events_);
    b.events.swap(events_);
    return b;
  }

  /// Move the recorded events (oldest first) to the end of `out`, unbatched; returns how many. Updates the
  /// snapshot registry.
  std::size_t drain(std::vector<KVEvent>& out) {
    const std::size_t n = events_.size();
    apply(events_);
    out.insert(out.end(), std::make_move_iterator(events_.begin()), std::make_move_iterator(events_.end()));
    events_.clear();
    return n;
  }

  /// The number of the last batch taken (0 before the first).
  [[nodiscard]] std::uint64_t last_batch_seq_no() const noexcept { return last_batch_seq_no_; }

  /// What the events handed out so far say is cached (see KVEventSnapshot), parents before children: ordered by
  /// block_start (a block's parent starts block_size tokens earlier), then by the order they were published. (In
  /// publication order a host-tier copy could come before its parent's host-tier entry, when the parent's device
  /// entry it was published against has been removed since: a consumer that checks parents, as llm-d's and
  /// Dynamo's indexers do, dropped it.) An entry whose parent is cached in no tier any more can still be listed:
  /// the stream published it while its parent was cached. O(cached blocks log cached blocks); allocates.
  [[nodiscard]] KVEventSnapshot snapshot() const {
    KVEventSnapshot s;
    s.seq_no = last_batch_seq_no_;
    s.stored.reserve(registry_.size());
    for (const auto& [key, e] : registry_) s.stored.push_back(e);
    std::sort(s.stored.begin(), s.stored.end(), [](const KVEvent& a, const KVEvent& b) {
      return a.block_start != b.block_start ? a.block_start < b.block_start : a.seq_no < b.seq_no;
    });
    return s;
  }

  /// The last stored event of (hash, medium, group) recorded or handed out and not removed since, or nullopt (the
  /// content of a block that moves to another tier: its stored event there repeats it with the new medium).
  /// O(events not yet taken) + O(1).
  [[nodiscard]] std::optional<KVEvent> find_stored(const BlockHash& h, Medium medium, std::uint32_t group) const {
    for (auto it = events_.rbegin(); it != events_.rend(); ++it) {
      if (it->type == KVEventType::kBlockStored && it->hash == h && it->medium == medium && it->group == group) {
        return *it;
      }
    }
    const auto it = registry_.find(Key{h, medium, group});
    if (it == registry_.end()) return std::nullopt;
    return it->second;
  }

  /// Events recorded and not yet taken or drained.
  [[nodiscard]] std::size_t size() const noexcept { return events_.size(); }

 private:
  struct Key {
    BlockHash hash;
    Medium medium;
    std::uint32_t group;
    friend bool operator==(const Key&, const Key&) = default;
  };
  struct KeyHash {
    std::size_t operator()(const Key& k) const noexcept {
      return static_cast<std::size_t>(k.hash.low64() ^ (std::uint64_t{k.group} << 8) ^ static_cast<std::uint64_t>(k.medium));
    }
  };

  void apply(const std::vector<KVEvent>& events) {
    for (const KVEvent& e : events) {
      switch (e.type) {
        case KVEventType::kBlockStored: registry_.insert_or_assign(Key{e.hash, e.medium, e.group}, e); break;
        case KVEventType::kBlockRemoved: registry_.erase(Key{e.hash, e.medium, e.group}); break;
        case KVEventType::kAllCleared:
          std::erase_if(registry_, [&](const auto& kv) { return kv.first.medium == e.medium; });
          break;
      }
    }
  }

  bool enabled_;
  std::vector<KVEvent> events_;
  std::uint64_t next_seq_no_ = 1;
  std::uint64_t last_batch_seq_no_ = 0;
  std::unordered_map<Key, KVEvent, KeyHash> registry_;
};

}  // namespace pagedkv
