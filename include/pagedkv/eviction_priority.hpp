// pagedkv/eviction_priority.hpp: LRU eviction within retention priority levels, with expiring priorities.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/detail/id_lists.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/eviction.hpp>

namespace pagedkv {

/// Retention-priority LRU (TensorRT-LLM's priority-based eviction, KvCacheRetentionConfig): every block carries a
/// retention priority in [0, 100] (kMinRetentionPriority .. kMaxRetentionPriority, default 35); evictable blocks live
/// in one LRU list per priority level (101 lists), and the victim is the least recently released block of the
/// **lowest non-empty level**. A priority may carry an absolute expiry, after which it falls back to the default.
///
/// Priorities. `set_priority(b, priority, expires_at)` is called by the cache manager while `b` is *not* cached
/// (held: when it registers b, or just before the release that will cache it; TensorRT-LLM lets the last request
/// that releases a block decide its priority). The assignment stays with b across hits (erase, insert) until
/// `set_priority` is called again, b is evicted (`pop_victim`), its hash is dropped (`forget`), or it expires. A
/// block nobody assigned a priority has the default. TensorRT-LLM's duration ("the priority applies until the
/// duration has passed after no period of reuse") is `expires_at = release time + duration`, computed by the caller.
///
/// Expiry. The policy never reads a clock: `expire(now)` is the only place time enters. It moves every cached block
/// whose expiry is `<= now` (an expiry exactly at `now` has expired) to the default level, and records `now` (the
/// largest value seen; an earlier `now` expires nothing new). Where expired blocks land: at the **MRU end of the
/// default level**, after every block already there, in the order they were inserted (released) among themselves;
/// i.e. an expired block counts as released at the moment its priority lapsed. A block that is not cached when its
/// priority lapses falls back when it is inserted: `insert` puts a block whose expiry is `<= ` the recorded now
/// into the default level directly. Callers (the allocator or manager) call `expire(now)` once per scheduling step,
/// before choosing victims; between calls, priorities that lapsed are still honoured (at most one step late).
///
/// Time: `RetentionTimePoint` (std::chrono::steady_clock::time_point, int64 nanoseconds); `time_point::max()` or no
/// expiry = never. A steady clock is required so wall-clock adjustments neither expire nor extend priorities.
///
/// Cost: insert, erase, forget, pop_victim O(1) for blocks without an expiry, O(log h) with one (h: cached blocks
/// whose priority has an expiry; an indexed 4-ary min-heap); finding the lowest non-empty level is O(1) (a 128-bit
/// occupancy mask); set_priority O(1); expire O(k log h + k log k) for k expired blocks (popped into the heap's own
/// tail and sorted there by release order); clear O(num_blocks). No allocation after construction.
/// Memory: 4 * sizeof(Id) + 17 bytes per block (33 B with 32-bit ids): LRU links 2 x Id, priority 1 B, expiry 8 B,
/// release stamp 8 B (orders blocks expiring together), heap slot and heap position 2 x Id; plus ~1.6 KB of list ends.
/// Thread safety: none (single writer, like the allocator that owns it).
template <BlockIdType Id>
class PriorityLruEviction {
  using rep = RetentionTimePoint::rep;
  static constexpr rep kNever = std::numeric_limits<rep>::max();
  static constexpr std::uint8_t kInHeap = 0x80;     // tag_ bit: the block has a heap entry (heap_pos_ is valid)
  static constexpr std::uint8_t kLevelMask = 0x7F;  // tag_ bits: the level

 public:
  /// Number of priority levels (one LRU list each): 0 .. kMaxRetentionPriority.
  static constexpr std::size_t kNumLevels = std::size_t{kMaxRetentionPriority} + 1;
  static_assert(kNumLevels <= 128, "the occupancy mask has 128 bits");

  /// `num_blocks`: pool size in blocks, including the null block. Every block starts with the default priority.
  explicit PriorityLruEviction(std::size_t num_blocks)
      : lists_(num_blocks, kNumLevels),
        tag_(num_blocks, kDefaultRetentionPriority),
        expires_(num_blocks, kNever),
        stamp_(num_blocks, 0),
        heap_(num_blocks, 0),
        heap_pos_(num_blocks, 0) {}

  /// Assigns the retention priority block `b` takes when it is next inserted: `priority` in [0, 100], higher =
  /// evicted later; `expires_at`: when it falls back to kDefaultRetentionPriority (nullopt or time_point::max():
  /// never; ignored when `priority` is the default; an expiry `<=` the recorded now makes the next insert use the
  /// default). Replaces any earlier assignment. Throws (state unchanged): kBlockOutOfRange if b == 0 or
  /// b >= num_blocks; kInvalidArgument if priority > 100, or if b is cached (re-prioritizing a cached block would
  /// need a position in the new level's recency order that the caller cannot name: assign before the release).
  /// O(1).
  void set_priority(Id b, std::uint8_t priority, std::optional<RetentionTimePoint> expires_at = std::nullopt) {
    if (b == 0 || b >= tag_.size()) {
      detail::raise(Errc::kBlockOutOfRange, "PriorityLruEviction::set_priority: block id " + std::to_string(b) +
                                                " outside [1, " + std::to_string(tag_.size()) + ")");
    }
    if (priority > kMaxRetentionPriority) {
      detail::raise(Errc::kInvalidArgument, "PriorityLruEviction::set_priority: priority " +
                                                std::to_string(priority) + " for block " + std::to_string(b) +
                                                " outside [0, " + std::to_string(kMaxRetentionPriority) + "]");
    }
    if (lists_.linked(b)) {
      detail::raise(Errc::kInvalidArgument, "PriorityLruEviction::set_priority: block " + std::to_string(b) +
                                                " is cached; set its priority before the release that caches it");
    }
    tag_[b] = priority;  // not cached, so no heap entry
    expires_[b] = (priority == kDefaultRetentionPriority || !expires_at) ? kNever
                                                                         : expires_at->time_since_epoch().count();
  }

  /// Records `now` and moves every cached block whose priority expired (expiry `<= now`) to the MRU end of the
  /// default level, in their release order (see the class). Returns how many blocks moved. O(k log h + k log k).
  std::size_t expire(RetentionTimePoint now) noexcept {
    now_ = std::max(now_, now.time_since_epoch().count());
    const std::size_t end = heap_size_;
    while (heap_size_ > 0 && expires_[heap_[0]] <= now_) {
      const Id b = heap_[0];
      heap_erase_at(0);
      heap_[heap_size_] = b;  // the slot the heap just gave up: expired blocks collect in [heap_size_, end)
    }
    const auto first = heap_.begin() + static_cast<std::ptrdiff_t>(heap_size_);
    const auto last = heap_.begin() + static_cast<std::ptrdiff_t>(end);
    std::sort(first, last, [this](Id x, Id y) { return stamp_[x] < stamp_[y]; });
    for (auto it = first; it != last; ++it) {
      const Id b = *it;
      unlink(b);
      tag_[b] = kDefaultRetentionPriority;  // heap entry already gone
      expires_[b] = kNever;
      link(b);
    }
    return end - heap_size_;
  }

  /// Caches `b` (its refcount dropped to 0) at the MRU end of its priority's level (the default if its expiry is
  /// `<=` the recorded now). Precondition: 0 < b < num_blocks, b not in the set. O(1), O(log h) with an expiry.
  void insert(Id b) noexcept {
    if (expires_[b] != kNever && expires_[b] <= now_) {
      tag_[b] = kDefaultRetentionPriority;
      expires_[b] = kNever;
    }
    link(b);
    if (expires_[b] != kNever) {
      stamp_[b] = next_stamp_++;
      heap_push(b);
    }
  }
  /// `b` was hit (acquired while cached): it leaves the set and keeps its priority assignment for its next insert.
  /// Precondition: contains(b). O(1), O(log h) with an expiry.
  void erase(Id b) noexcept { remove(b); }
  /// `b`'s hash was dropped: it leaves the set if it is there and its priority is reset to the default (no expiry).
  /// b may be held or free. Precondition: 0 < b < num_blocks. O(1), O(log h) with an expiry.
  void forget(Id b) noexcept {
    if (lists_.linked(b)) remove(b);
    reset_priority(b);
  }
  /// Removes and returns the least recently released block of the lowest non-empty level, resetting its priority
  /// (its content is being replaced); nullopt when the set is empty. O(1), O(log h) with an expiry.
  [[nodiscard]] std::optional<Id> pop_victim() noexcept {
    const Id v = peek_victim();
    if (v == 0) return std::nullopt;
    remove(v);
    reset_priority(v);
    return v;
  }
  /// The block `pop_victim` would return, without removing it (0 when empty). O(1).
  [[nodiscard]] Id peek_victim() const noexcept {
    const int l = lowest_level();
    return l < 0 ? Id{0} : lists_.front(static_cast<std::size_t>(l));
  }
  /// Number of evictable blocks (all levels).
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Whether `b` is evictable. Any `b` (out of range: false).
  [[nodiscard]] bool contains(Id b) const noexcept { return lists_.linked(b); }
  /// Back to the state after construction, except the recorded now: the set is emptied and every block's priority
  /// reset to the default (held blocks included). O(num_blocks).
  void clear() noexcept {
    lists_.reset();
    std::fill(tag_.begin(), tag_.end(), kDefaultRetentionPriority);
    std::fill(expires_.begin(), expires_.end(), kNever);
    heap_size_ = 0;
    size_ = 0;
    occupied_[0] = occupied_[1] = 0;
  }

  /// The priority `b` has (cached) or will have when next inserted (the default once its expiry is `<=` the
  /// recorded now). Throws kBlockOutOfRange if b == 0 or b >= num_blocks.
  [[nodiscard]] std::uint8_t priority(Id b) const {
    check(b, "priority");
    return lapsed(b) ? kDefaultRetentionPriority : static_cast<std::uint8_t>(tag_[b] & kLevelMask);
  }
  /// When `b`'s priority falls back to the default; nullopt for never (or already lapsed, or the default).
  /// Throws kBlockOutOfRange if b == 0 or b >= num_blocks.
  [[nodiscard]] std::optional<RetentionTimePoint> expires_at(Id b) const {
    check(b, "expires_at");
    if (expires_[b] == kNever || lapsed(b)) return std::nullopt;
    return RetentionTimePoint(RetentionTimePoint::duration(expires_[b]));
  }
  /// The largest `now` passed to expire (time_point::min() before the first call).
  [[nodiscard]] RetentionTimePoint now() const noexcept {
    return RetentionTimePoint(RetentionTimePoint::duration(now_));
  }
  /// Cached blocks at priority `level` (0 for a level above 100).
  [[nodiscard]] std::size_t size_at(std::uint8_t level) const noexcept {
    return level < kNumLevels ? lists_.size(level) : 0;
  }
  /// Cached blocks whose priority has an expiry (the heap's size).
  [[nodiscard]] std::size_t num_expiring() const noexcept { return heap_size_; }
  /// The eviction order if nothing else happens: level 0 LRU -> MRU, then level 1, ..., level 100 (O(size)).
  [[nodiscard]] std::vector<Id> order() const {
    std::vector<Id> out;
    out.reserve(size_);
    for (std::size_t l = 0; l < kNumLevels; ++l) {
      for (Id b = lists_.front(l); b != 0; b = lists_.next(b)) out.push_back(b);
    }
    return out;
  }

 private:
  void check(Id b, const char* what) const {
    if (b == 0 || b >= tag_.size()) {
      detail::raise(Errc::kBlockOutOfRange, std::string("PriorityLruEviction::") + what + ": block id " +
                                                std::to_string(b) + " outside [1, " + std::to_string(tag_.size()) +
                                                ")");
    }
  }
  [[nodiscard]] bool lapsed(Id b) const noexcept { return expires_[b] != kNever && expires_[b] <= now_; }
  // Precondition: b has no heap entry (not cached, or just removed).
  void reset_priority(Id b) noexcept {
    tag_[b] = kDefaultRetentionPriority;
    expires_[b] = kNever;
  }

  // Lists and the occupancy mask.
  void link(Id b) noexcept {
    const auto l = static_cast<std::uint8_t>(tag_[b] & kLevelMask);
    lists_.push_back(l, b);
    occupied_[l >> 6] |= std::uint64_t{1} << (l & 63);
    ++size_;
  }
  void unlink(Id b) noexcept {
    const auto l = static_cast<std::uint8_t>(tag_[b] & kLevelMask);
    lists_.remove(l, b);
    if (lists_.size(l) == 0) occupied_[l >> 6] &= ~(std::uint64_t{1} << (l & 63));
    --size_;
  }
  void remove(Id b) noexcept {
    unlink(b);
    if ((tag_[b] & kInHeap) != 0) heap_erase_at(heap_pos_[b]);
  }
  [[nodiscard]] int lowest_level() const noexcept {
    if (occupied_[0] != 0) return std::countr_zero(occupied_[0]);
    if (occupied_[1] != 0) return 64 + std::countr_zero(occupied_[1]);
    return -1;
  }

  // Indexed 4-ary min-heap of cached blocks with an expiry, keyed by expires_ (4-ary: half the depth of a binary
  // heap, and a node's children share one cache line of heap_, so sifting a large heap costs fewer dependent misses).
  static constexpr std::size_t kArity = 4;
  void heap_place(std::size_t i, Id b) noexcept {
    heap_[i] = b;
    heap_pos_[b] = static_cast<Id>(i);
  }
  // Moves `b` (key `key`) from hole i towards the root; returns its final position (not yet written).
  std::size_t sift_up(std::size_t i, rep key) noexcept {
    while (i > 0) {
      const std::size_t parent = (i - 1) / kArity;
      if (expires_[heap_[parent]] <= key) break;
      heap_place(i, heap_[parent]);
      i = parent;
    }
    return i;
  }
  void heap_push(Id b) noexcept {
    tag_[b] |= kInHeap;
    heap_place(sift_up(heap_size_++, expires_[b]), b);
  }
  // Removes the entry at position i (its block loses kInHeap); the last entry fills the hole, moving up (the hole
  // may be below a larger parent) or down.
  void heap_erase_at(std::size_t i) noexcept {
    tag_[heap_[i]] &= static_cast<std::uint8_t>(~kInHeap);
    const Id last = heap_[--heap_size_];
    if (i == heap_size_) return;
    const rep key = expires_[last];
    const std::size_t up = sift_up(i, key);
    if (up != i) {
      heap_place(up, last);
      return;
    }
    for (;;) {
      const std::size_t first = kArity * i + 1;
      if (first >= heap_size_) break;
      const std::size_t end = std::min(first + kArity, heap_size_);
      std::size_t best = first;
      rep best_key = expires_[heap_[first]];
      for (std::size_t c = first + 1; c < end; ++c) {
        const rep k = expires_[heap_[c]];
        if (k < best_key) {
          best = c;
          best_key = k;
        }
      }
      if (key <= best_key) break;
      heap_place(i, heap_[best]);
      i = best;
    }
    heap_place(i, last);
  }

  detail::IdLists<Id> lists_;            // one LRU list per level; head = least recently released
  std::vector<std::uint8_t> tag_;        // [num_blocks] level b is in (cached) or will enter | kInHeap
  std::vector<rep> expires_;             // [num_blocks] expiry of b's level (ns, steady clock); kNever if none
  std::vector<std::uint64_t> stamp_;     // [num_blocks] insert order of a cached block with an expiry
  std::vector<Id> heap_;                 // [num_blocks] heap of cached blocks with an expiry, then scratch
  std::vector<Id> heap_pos_;             // [num_blocks] position in heap_ (valid when tag_ has kInHeap)
  std::size_t heap_size_ = 0;
  std::size_t size_ = 0;                 // cached blocks
  std::uint64_t occupied_[2] = {0, 0};   // bit l: level l's list is non-empty
  std::uint64_t next_stamp_ = 0;
  rep now_ = std::numeric_limits<rep>::min();
};

static_assert(EvictionPolicy<PriorityLruEviction<std::uint32_t>, std::uint32_t>);
static_assert(ForgettingEvictionPolicy<PriorityLruEviction<std::uint32_t>, std::uint32_t>);
static_assert(RetentionEvictionPolicy<PriorityLruEviction<std::uint32_t>, std::uint32_t>);

}  // namespace pagedkv
