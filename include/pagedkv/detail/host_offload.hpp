// pagedkv/detail/host_offload.hpp: the host tier's part of the cache manager (issue 32, docs/design.md "The manager
// in parts"): the host tier and the transfer queue, the group each host block was taken for, the write-through list,
// and the held-back host events (a host copy's BlockStored kept aside until its parent is reported); and the host
// work over that state and the device pool: completion of transfers, write-back / write-through offload, onboarding
// fills, the host tier's eviction hook, and swap out / resume on a flat [groups x blocks] list
// (detail/host_swap.hpp). Nothing here knows the manager: the device pool (DevicePool) and the counters
// (CacheStats) are passed in; the facade checks arguments and calls these per call.
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

#include <pagedkv/detail/hit_search.hpp>  // CachedAt
#include <pagedkv/detail/reserve.hpp>
#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/eviction_history.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/sequence_state.hpp>
#include <pagedkv/stats.hpp>
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

  // --- The two tiers' probes (Pool: DevicePool) ---
  /// Where group g's block with hash h is cached: tier 1 = the device pool (block: its device block), 2 = a ready
  /// host block (block: the host block), 0 = neither (block 0). The device tier is probed first.
  template <class Pool>
  [[nodiscard]] CachedAt<Id> cached_at(const Pool& pool, const BlockHash& h, std::size_t g) const {
    if (const auto b = pool.ix(g).find(h)) return {1, *b};
    if (tier_) {
      if (const auto hb = tier_->find_ready(group_block_key(h, g))) return {2, *hb};
    }
    return {};
  }
  /// Whether group g's block with hash h is cached in a tier and its BlockStored was published: a device-registered
  /// block, or a ready host block not held back.
  template <class Pool>
  [[nodiscard]] bool reported_cached(const Pool& pool, const BlockHash& h, std::uint32_t g) const {
    const CachedAt<Id> c = cached_at(pool, h, g);
    return c.tier == 1 || (c.tier == 2 && !is_held_back(c.block));
  }
  /// The host block holding group g's device block b (by its hash), if any. Precondition: a host tier exists.
  template <class Pool>
  [[nodiscard]] std::optional<Id> copy_of(const Pool& pool, Id b, std::size_t g) const {
    const auto h = pool.ix(g).hash_of(b);
    return h ? tier_->find(group_block_key(*h, g)) : std::nullopt;
  }

  // --- Completion ---
  /// complete_transfers(token) after its check (precondition: `token` is in flight): a device -> host copy makes
  /// its host block ready (its kept stored event published, medium CPU, or held back); a host -> device copy ends
  /// its fill and registers the device block unless its hash was registered meanwhile (the stored event re-published
  /// with medium GPU); both copies' pins are released. Reserves first: may throw std::bad_alloc before anything
  /// changed.
  template <class Pool>
  [[gnu::noinline]] void complete(std::uint64_t token, Pool& pool, CacheStats& stats) {
    EventLog& events = pool.events();
    events.reserve_more(transfers_.in_flight().size() + num_held_back());
    const auto reported = [&](const BlockHash& h, std::uint32_t g) { return reported_cached(pool, h, g); };
    for (const Transfer<Id>& t : take_completed(token)) {
      if (is_device_to_host(t.kind)) {  // offload, swap-out: the host block is filled
        tier_->mark_ready(t.host);
        if (t.hashed) emit_stored_from(events, t.host, t.hash, Medium::kCpu, t.group, reported, stats.events_held_back);
        tier_->release(t.host);  // the copy's hold
        continue;
      }
      // onboard, swap-in: the device block is filled; register it if its hash is not registered yet
      pool.end_fill(t.device);
      if (t.hashed && !pool.ix(t.group).hash_of(t.device)) {
        const Id reg = pool.ix(t.group).insert(t.hash, t.device);
        if (reg == t.device) {
          pool.alloc().set_hashed(t.device, true);
          if (events.enabled()) {
            auto e = events.find_stored(t.hash, Medium::kCpu, t.group);
            if (!e && is_held_back(t.host)) {  // its host copy was never reported: the content waited there
              if (const KVEvent* held = held_content(t.host)) e = *held;
            }
            if (e) publish_kept(events, std::move(*e)).medium = Medium::kGpu;
          }
        }
      }
      tier_->release(t.host);        // the copy's pin on its source
      pool.release_block(t.device);  // the copy's pin on its destination (the sequence may be gone)
    }
    retry_held_back(events, reported);  // a copy whose parent completed after it in this call
    clear_completed();
  }

  // --- Offload (device -> host) ---
  /// The host tier's eviction hook: counts the eviction, records it in the pool's eviction history, and reports
  /// kBlockRemoved (medium CPU) unless its stored event was held back (never reported).
  template <class Pool>
  auto evictor(Pool& pool, CacheStats& stats) {
    return [this, &pool, &stats](Id hb, const BlockHash& key) {
      ++stats.host_evictions;
      if (pool.history().enabled()) pool.record_eviction(key, EvictedTier::kHost, group_of(hb));
      if (!pool.events().enabled()) return;
      if (forget_held_back(hb)) return;  // never reported: nothing to remove
      const std::uint32_t g = group_of(hb);
      KVEvent& e = pool.events().push(KVEventType::kBlockRemoved);
      e.hash = group_block_key(key, g);  // the key unmixed: the block's hash
      e.medium = Medium::kCpu;
      e.group = g;
    };
  }
  /// Write-back: device block b (hash h, group g) is being evicted with retention priority `prio`; copy it to the
  /// host first unless `prio` < `min_priority` (counted in offloads_below_priority). Precondition: a host tier.
  template <class Pool>
  [[gnu::noinline]] void offload_evicted(Pool& pool, CacheStats& stats, Id b, const BlockHash& h, std::uint32_t g,
                                        std::uint8_t prio, std::uint8_t min_priority) {
    if (prio < min_priority) {
      ++stats.offloads_below_priority;
      return;
    }
    offload(pool, stats, b, h, g, prio);
  }
  /// Copy device block `b` holding hash `h` to the host tier unless the host has it; the host block is registered
  /// (not ready, retention `priority`) and held by the transfer until completion. Dropped (counted in
  /// offloads_dropped) when every host block is held. Precondition: a host tier; room reserved for the transfer and
  /// the host eviction's event.
  template <class Pool>
  void offload(Pool& pool, CacheStats& stats, Id b, const BlockHash& h, std::uint32_t g,
               std::uint8_t priority = kDefaultRetentionPriority) {
    const BlockHash key = group_block_key(h, g);
    if (tier_->find(key)) return;
    const auto hb = tier_->allocate(&key, evictor(pool, stats));
    if (!hb) {
      ++stats.offloads_dropped;
      return;
    }
    set_group(*hb, g);
    tier_->set_retention_priority(*hb, priority, std::nullopt);  // the device block's (its expiry is not carried)
    remember_content(pool.events(), h, *hb, Medium::kGpu, g, stats.events_lost);
    transfers_.push({b, *hb, TransferKind::kOffload, true, h, 0, g});
    ++stats.offloads;
  }
  /// Write-through: how many blocks the last build registered are still registered under their hash and not on the
  /// host (an upper bound of the offloads offload_registered() queues).
  template <class Pool>
  [[nodiscard, gnu::noinline]] std::size_t num_write_through(const Pool& pool) const {
    std::size_t n = 0;
    for (const auto& [b, h] : recent_registered_) {
      const std::uint32_t g = pool.group_of_block(b);
      if (pool.ix(g).hash_of(b) == std::optional<BlockHash>(h) && !tier_->find(group_block_key(h, g))) ++n;
    }
    return n;
  }
  /// Write-through: offload every block the last build registered (its K/V is written by now) that is still
  /// registered under its hash, and empty the list. Precondition: room reserved for num_write_through() offloads.
  template <class Pool>
  [[gnu::noinline]] void offload_registered(Pool& pool, CacheStats& stats) {
    for (const auto& [b, h] : recent_registered_) {
      const std::uint32_t g = pool.group_of_block(b);
      if (pool.ix(g).hash_of(b) == std::optional<BlockHash>(h)) offload(pool, stats, b, h, g);
    }
    recent_registered_.clear();
  }

  // --- Onboarding (host -> device) ---
  /// Queue a host -> device copy into device block `dst` (onboarding or swap-in) from host block `src`: both are
  /// pinned by the transfer (one more reference each; `src_pinned`: the caller took the source's already) until
  /// completion; `dst` is marked filling (no fork, no swap of a sequence holding it, never hit by others: it is
  /// registered only when filled). Precondition: room reserved in the queue.
  template <class Pool>
  void queue_fill(Pool& pool, CacheStats& stats, Id dst, Id src, TransferKind kind, const BlockHash* h,
                  bool src_pinned, std::size_t g) {
    pool.alloc().acquire(dst);
    if (!src_pinned) tier_->acquire(src);
    pool.mark_fill(dst, h == nullptr);
    transfers_.push({dst, src, kind, h != nullptr, h != nullptr ? *h : BlockHash{}, 0, static_cast<std::uint32_t>(g)});
    ++(kind == TransferKind::kOnboard ? stats.onboards : stats.swap_ins);
  }
  /// Onboard an admission's host hits: `hits` [groups x k] with `on_host[j]` for a host block, hashes[i] the hash
  /// of match block i. Holds each host hit (the copy's pin on its source), then per host hit in order allocates a
  /// device block (`take(g)`) into out[j] and queues its kOnboard fill. The device hits are the caller's.
  /// Precondition: capacity checked, room reserved for the allocations and copies. Nothing throws.
  template <class Pool, class Take>
  [[gnu::noinline]] void onboard(Pool& pool, CacheStats& stats, std::span<const Id> hits,
                                const std::vector<bool>& on_host, std::span<const BlockHash> hashes, std::size_t k,
                                std::span<Id> out, Take&& take) {
    for (std::size_t j = 0; j < hits.size(); ++j) {
      if (hits[j] != Id{0} && on_host[j]) tier_->acquire(hits[j]);
    }
    for (std::size_t j = 0; j < hits.size(); ++j) {
      if (hits[j] == Id{0} || !on_host[j]) continue;
      const std::size_t g = j / k;
      const Id dst = take(g);  // guaranteed by the capacity check
      out[j] = dst;
      queue_fill(pool, stats, dst, hits[j], TransferKind::kOnboard, &hashes[j % k], /*src_pinned=*/true, g);
    }
  }
  /// Whether any block of `q`'s `num_groups` tables is being filled by a host -> device copy not yet completed.
  template <class Pool>
  [[nodiscard]] static bool has_filling_block(const Pool& pool, const CacheStats& stats, const SequenceState<Id>& q,
                                              std::size_t num_groups) noexcept {
    if (stats.onboards + stats.swap_ins == pool.completed_fills()) return false;  // none in flight anywhere
    for (std::size_t g = 0; g < num_groups; ++g) {
      for (Id b : q.table_of(g).blocks()) {
        if (b != Id{0} && pool.is_filling(b)) return true;
      }
    }
    return false;
  }

  // --- Build, statistics, reset ---
  /// Room for a build: `write_through` offloads queued and issued, `registrations` more write-through entries.
  /// May throw std::bad_alloc. Precondition: a host tier.
  [[gnu::noinline]] void reserve_build(std::size_t write_through, std::size_t registrations) {
    transfers_.reserve_more(write_through);
    transfers_.reserve_issue(write_through);
    if (registrations != 0) recent_registered_.reserve(recent_registered_.size() + registrations);
  }
  /// The host tier's gauges into `s` (its blocks, and the copies queued and in flight).
  [[gnu::noinline]] void add_gauges(CacheStats& s) const noexcept {
    if (tier_) {
      const auto& h = tier_->allocator();
      s.host_num_usable_blocks = h.num_usable_blocks();
      s.host_blocks_used = h.num_used_blocks();
      s.host_blocks_cached = h.num_cached_blocks();
      s.host_blocks_free = h.num_free_blocks();
    }
    s.transfers_in_flight = transfers_.in_flight().size();
    s.transfers_queued = transfers_.queued().size();
  }
  /// Whether a reset may clear the host tier: no host block held and no copy queued (true without a host tier).
  [[nodiscard]] bool can_clear() const noexcept {
    return !tier_ || (tier_->allocator().num_used_blocks() == 0 && transfers_.queued().empty());
  }
  /// Reset: drop the write-through list; with a host tier, drop every host hash and kept event and report
  /// kAllCleared (medium CPU) when events are on. Precondition: can_clear(); room for one event reserved.
  [[gnu::noinline]] void clear(EventLog& events) noexcept {
    recent_registered_.clear();
    if (!tier_) return;
    tier_->clear([](Id, const BlockHash&) {});
    clear_events();
    if (events.enabled()) events.push(KVEventType::kAllCleared).medium = Medium::kCpu;
  }

  // --- Issue ---
  /// Issue every queued copy under a new token (0: none queued) and write them as (device, host) pairs into
  /// `swap_out` and (host, device) pairs into `swap_in`; `num_out` / `num_in`: the pairs written. Precondition: the
  /// buffers hold num_queued(true) / num_queued(false) pairs; room reserved by reserve_issue.
  [[gnu::noinline]] std::uint64_t issue(std::span<std::int32_t> swap_out, std::span<std::int32_t> swap_in,
                                        std::size_t& num_out, std::size_t& num_in) {
    const std::uint64_t token = transfers_.issue();
    std::size_t o = 0, i = 0;
    for (const Transfer<Id>& t : transfers_.in_flight()) {
      if (token == 0 || t.token != token) continue;
      if (is_device_to_host(t.kind)) {
        swap_out[2 * o] = static_cast<std::int32_t>(t.device);
        swap_out[2 * o + 1] = static_cast<std::int32_t>(t.host);
        ++o;
      } else {
        swap_in[2 * i] = static_cast<std::int32_t>(t.host);
        swap_in[2 * i + 1] = static_cast<std::int32_t>(t.device);
        ++i;
      }
    }
    num_out = o;
    num_in = i;
    return token;
  }

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
  /// retry_held_back over the two tiers of `pool` and this host tier (reported_cached). Precondition: room for
  /// num_held_back() events reserved in pool.events().
  template <class Pool>
  void retry_held_back(Pool& pool) noexcept {
    retry_held_back(pool.events(), [&](const BlockHash& h, std::uint32_t g) { return reported_cached(pool, h, g); });
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
