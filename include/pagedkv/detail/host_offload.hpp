// pagedkv/detail/host_offload.hpp: the host tier's part of the cache manager (issue 32, docs/design.md "The manager
// in parts"): the host tier and the transfer queue, the group each host block was taken for, the write-through list, and the held-back host events (a host copy's BlockStored kept
// aside until its parent is reported). It owns that state; the facade orchestrates offload, onboarding, swap and
// completion over it and the device pool. Nothing here knows the manager: the event log, the counters and the
// "is it reported" probe are passed in.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pagedkv/detail/reserve.hpp>
#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/transfer_queue.hpp>

namespace pagedkv::detail {

/// The host-offload state of a manager with `num_host_blocks` host blocks (0 = no host tier: the queue still exists,
/// empty). The device blocks a host -> device copy fills are marked in the device pool (DevicePool::mark_fill: they
/// are a reference rule). `Tier`: HostTier<Hasher, Id, HostEvict>.
template <class Id, class Tier>
class HostOffload {
 public:
  HostOffload(std::size_t num_host_blocks, std::uint64_t hash_seed, std::size_t num_groups, bool events)
      : tier_(num_host_blocks != 0 ? std::make_unique<Tier>(num_host_blocks, hash_seed) : nullptr) {
    if (tier_ && num_groups > 1) group_of_.assign(num_host_blocks, 0);
    if (tier_ && events) held_back_.assign((num_host_blocks + 63) / 64, 0);
  }

  /// Whether a host tier exists.
  explicit operator bool() const noexcept { return tier_ != nullptr; }
  /// The host tier. Precondition: one exists.
  [[nodiscard]] Tier& tier() noexcept { return *tier_; }
  [[nodiscard]] const Tier& tier() const noexcept { return *tier_; }
  /// The host tier, or null without one.
  [[nodiscard]] const Tier* get() const noexcept { return tier_.get(); }
  /// The copies queued for the next build and in flight.
  [[nodiscard]] TransferQueue<Id>& transfers() noexcept { return transfers_; }
  [[nodiscard]] const TransferQueue<Id>& transfers() const noexcept { return transfers_; }

  // --- Host blocks' groups (several groups only; group 0 otherwise) ---
  void set_group(Id hb, std::size_t g) noexcept {
    if (!group_of_.empty()) group_of_[hb] = static_cast<std::uint8_t>(g);
  }
  [[nodiscard]] std::uint32_t group_of(Id hb) const noexcept { return group_of_.empty() ? 0U : group_of_[hb]; }

  // --- Write-through: the (device block, hash) pairs the last build registered, offloaded by the next ---
  [[nodiscard]] std::vector<std::pair<Id, BlockHash>>& recent_registered() noexcept { return recent_registered_; }

  // --- Completion ---
  /// Take the copies of `token` out of flight (precondition: it is in flight); valid until clear_completed().
  /// Reserves first: may throw std::bad_alloc before anything changed.
  [[nodiscard]] std::span<const Transfer<Id>> take_completed(std::uint64_t token) {
    completed_.clear();
    completed_.reserve(transfers_.in_flight().size());
    reserve_held_back(transfers_.in_flight().size());
    transfers_.take_completed(token, completed_);
    return completed_;
  }
  void clear_completed() noexcept { completed_.clear(); }

  // --- Held-back host events (events on, with a host tier) ---
  /// Keep the stored event of hash `h` in `from` (its content, from `events`) for the stored event of host block
  /// `hb` once the copy into it completes. Out of memory: that event is lost, counted in `lost`, nothing else.
  void remember_content(const EventLog& events, const BlockHash& h, Id hb, Medium from, std::uint32_t g,
                        std::uint64_t& lost) noexcept {
    if (!events.enabled()) return;
    try {
      if (auto e = events.find_stored(h, from, g)) pending_content_.insert_or_assign(hb, std::move(*e));
    } catch (...) {
      ++lost;
    }
  }
  /// The copy into host block `hb` (hash `h`, group g) completed into `to`: publish its kept stored event, or hold
  /// it back (counted in `held_back`) while `reported(parent_hash, g)` is false: its parent left every tier, and the
  /// stream must never report a block no router could place. Precondition: room reserved for one event and one
  /// more held-back block (take_completed does the latter).
  template <class Reported>
  void emit_stored_from(EventLog& events, Id hb, const BlockHash& h, Medium to, std::uint32_t g,
                        Reported&& reported, std::uint64_t& held_back) {
    if (!events.enabled()) return;
    const auto it = pending_content_.find(hb);
    if (it == pending_content_.end()) return;
    it->second.medium = to;
    it->second.hash = h;
    it->second.group = g;
    if (it->second.parent_hash && !reported(*it->second.parent_hash, g)) {
      held_back_[hb / 64] |= std::uint64_t{1} << (hb % 64);
      held_back_list_.push_back(hb);
      ++held_back;
      return;
    }
    publish_kept(events, std::move(it->second));
    pending_content_.erase(it);
  }
  /// Publish every held-back host block whose parent `reported` says is reported by now, parents before children.
  /// Precondition: room for num_held_back() events reserved.
  template <class Reported>
  void retry_held_back(EventLog& events, Reported&& reported) noexcept {
    for (bool progress = true; progress && !held_back_list_.empty();) {
      progress = false;
      for (std::size_t i = 0; i < held_back_list_.size();) {
        const Id hb = held_back_list_[i];
        const auto it = pending_content_.find(hb);
        if (it != pending_content_.end() && !reported(*it->second.parent_hash, it->second.group)) {
          ++i;
          continue;
        }
        held_back_[hb / 64] &= ~(std::uint64_t{1} << (hb % 64));
        held_back_list_[i] = held_back_list_.back();
        held_back_list_.pop_back();
        progress = true;
        if (it == pending_content_.end()) continue;
        publish_kept(events, std::move(it->second));
        pending_content_.erase(it);
      }
    }
  }
  /// Whether host block hb's stored event is held back.
  [[nodiscard]] bool is_held_back(Id hb) const noexcept {
    return !held_back_.empty() && ((held_back_[hb / 64] >> (hb % 64)) & 1U) != 0;
  }
  /// The kept content of held-back host block hb, or null.
  [[nodiscard]] const KVEvent* held_content(Id hb) const {
    const auto it = pending_content_.find(hb);
    return it != pending_content_.end() ? &it->second : nullptr;
  }
  /// Host block hb was evicted: drop its held-back event (never reported, so nothing to remove). Returns whether it
  /// was held back.
  bool forget_held_back(Id hb) {
    if (!is_held_back(hb)) return false;
    held_back_[hb / 64] &= ~(std::uint64_t{1} << (hb % 64));
    std::erase(held_back_list_, hb);
    pending_content_.erase(hb);
    return true;
  }
  /// Host blocks whose event is held back.
  [[nodiscard]] std::size_t num_held_back() const noexcept { return held_back_list_.size(); }
  /// Room for `n` more held-back blocks (events on); may throw std::bad_alloc.
  void reserve_held_back(std::size_t n) {
    if (!held_back_.empty()) reserve_more(held_back_list_, n);
  }
  /// Forget every kept and held-back event (the host tier was cleared).
  void clear_events() noexcept {
    pending_content_.clear();
    std::fill(held_back_.begin(), held_back_.end(), std::uint64_t{0});
    held_back_list_.clear();
  }

  /// Publish `content` (a stored event kept aside: a host copy's content, or a device event re-published on
  /// onboarding) as the log's next event: its fields, the log's seq_no. Precondition: room reserved.
  static KVEvent& publish_kept(EventLog& events, KVEvent&& content) {
    KVEvent& out = events.push(KVEventType::kBlockStored);
    const std::uint64_t seq_no = out.seq_no;
    out = std::move(content);
    out.seq_no = seq_no;
    return out;
  }

 private:
  std::unique_ptr<Tier> tier_;                                // null = no host tier
  TransferQueue<Id> transfers_;
  std::vector<std::uint8_t> group_of_;                        // [num_host_blocks] when G > 1 with a host tier
  std::vector<std::pair<Id, BlockHash>> recent_registered_;   // write-through: registered by the last build
  std::vector<Transfer<Id>> completed_;                       // complete_transfers' scratch
  std::unordered_map<Id, KVEvent> pending_content_;           // events on: host block -> content of its stored event
  std::vector<std::uint64_t> held_back_;                      // events on: host blocks whose event is held back
  std::vector<Id> held_back_list_;                            // the host blocks marked in held_back_
};

}  // namespace pagedkv::detail
