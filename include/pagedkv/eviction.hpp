// pagedkv/eviction.hpp: eviction policies for unreferenced cached blocks, and the concept they satisfy.
#pragma once

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <pagedkv/config.hpp>

namespace pagedkv {

/// Requirements on an eviction policy over block ids of type `Id`. The policy holds the evictable set: blocks whose
/// refcount is 0 and that carry a block hash. `BlockAllocator` calls `insert` when a cached block's refcount drops
/// to 0 (most recently released), `erase` when such a block is referenced again (a prefix hit), and `pop_victim`
/// when it must reuse one. A cached block whose hash is dropped without a hit leaves the set through
/// `forget_block` (below), which is `erase` for policies that keep no per-block history. Every operation must be
/// O(1) or O(log n) so allocation cost does not grow (or grows only logarithmically) with the number of cached
/// blocks. Constructed with the pool size (blocks, including the null block 0, which is never inserted).
/// Implementations: `LruEviction` (here, the default), `SlruEviction` (pagedkv/eviction_slru.hpp),
/// `PriorityLruEviction` (pagedkv/eviction_priority.hpp); docs/eviction.md compares them.
template <class P, class Id>
concept EvictionPolicy = BlockIdType<Id> && std::constructible_from<P, std::size_t> &&
                         requires(P p, const P cp, Id b) {
                           p.insert(b);
                           p.erase(b);
                           { p.pop_victim() } -> std::same_as<std::optional<Id>>;
                           { cp.size() } -> std::convertible_to<std::size_t>;
                           { cp.contains(b) } -> std::convertible_to<bool>;
                           p.clear();
                         };

/// Least-recently-released eviction (vLLM V1's free-block queue, SGLang's radix-tree LRU): the victim is the block
/// whose refcount reached 0 longest ago. An intrusive doubly-linked list over two `Id` arrays indexed by block id,
/// with the null block 0 as the list's sentinel (it is never evictable), so every operation is O(1) and allocates
/// nothing after construction. Memory: 2 * sizeof(Id) bytes per block.
/// Thread safety: none (single writer, like the allocator that owns it).
template <BlockIdType Id>
class LruEviction {
 public:
  /// `num_blocks`: pool size in blocks, including the null block.
  explicit LruEviction(std::size_t num_blocks) : prev_(num_blocks, kAbsent), next_(num_blocks, kAbsent) {
    if (num_blocks > 0) prev_[0] = next_[0] = 0;  // empty circular list around the sentinel
  }

  /// Append `b` as the most recently released block. Precondition: `b` is not in the set and b != 0.
  void insert(Id b) noexcept {
    const Id tail = prev_[0];
    prev_[b] = tail;
    next_[b] = 0;
    next_[tail] = b;
    prev_[0] = b;
    ++size_;
  }
  /// Remove `b` from the set. Precondition: `contains(b)`.
  void erase(Id b) noexcept {
    next_[prev_[b]] = next_[b];
    prev_[next_[b]] = prev_[b];
    prev_[b] = next_[b] = kAbsent;
    --size_;
  }
  /// Remove and return the least recently released block, or nullopt when the set is empty.
  [[nodiscard, gnu::always_inline]] std::optional<Id> pop_victim() noexcept {
    const Id head = next_[0];
    if (head == 0) return std::nullopt;
    erase(head);
    return head;
  }
  /// The block `pop_victim` would return, without removing it (0 when empty).
  [[nodiscard]] Id peek_victim() const noexcept { return next_[0]; }
  /// Number of evictable blocks.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Whether `b` is evictable.
  [[nodiscard]] bool contains(Id b) const noexcept { return b != 0 && b < next_.size() && next_[b] != kAbsent; }
  /// Empty the set.
  void clear() noexcept {
    while (pop_victim()) {
    }
  }
  /// Blocks from least to most recently released (O(size); for tests and debugging).
  [[nodiscard]] std::vector<Id> order() const {
    std::vector<Id> out;
    out.reserve(size_);
    for (Id b = next_[0]; b != 0; b = next_[b]) out.push_back(b);
    return out;
  }

 private:
  static constexpr Id kAbsent = static_cast<Id>(~Id{0});
  std::vector<Id> prev_;
  std::vector<Id> next_;
  std::size_t size_ = 0;
};

static_assert(EvictionPolicy<LruEviction<std::uint32_t>, std::uint32_t>);

// ---- optional extensions (a policy opts in by having the member; callers dispatch through the helpers) ----------

/// An eviction policy that keeps per-block history which must not outlive the block's content: `SlruEviction`
/// remembers that a block was hit, `PriorityLruEviction` remembers a block's retention priority. `forget(b)` says
/// "block b's hash was dropped (its content is gone)": b leaves the evictable set if it is there, *not* counted as a
/// hit, and its history is cleared; b may also be held (refcount > 0) or free. Precondition: 0 < b < num_blocks.
///
/// Why a separate call and not `erase`: a hit (`erase`, then a later `insert` when the block is released again)
/// and a drop followed by reuse (the block goes to the free list, is allocated for new content, hashed and released:
/// again `erase` ... `insert`) look the same to the policy, since allocations from the free list never reach it. So
/// the history of a dropped block would wrongly survive into its next content without this call.
template <class P, class Id>
concept ForgettingEvictionPolicy = EvictionPolicy<P, Id> && requires(P p, Id b) { p.forget(b); };

/// What an allocator calls when block `b`'s hash is dropped (b cached, held or free; 0 < b < num_blocks):
/// `policy.forget(b)` for a ForgettingEvictionPolicy, else `policy.erase(b)` if b is in the set (the behaviour every
/// policy had before the extension). Cost: the policy's forget / erase. Thread safety: that of the policy.
template <class Id, class P>
  requires EvictionPolicy<P, Id>
void forget_block(P& policy, Id b) {
  if constexpr (ForgettingEvictionPolicy<P, Id>) {
    policy.forget(b);
  } else if (policy.contains(b)) {
    policy.erase(b);
  }
}

/// Retention priorities (TensorRT-LLM's KvCacheRetentionConfig): an integer in [kMinRetentionPriority,
/// kMaxRetentionPriority]; higher = retained longer; blocks nobody gave a priority have kDefaultRetentionPriority.
inline constexpr std::uint8_t kMinRetentionPriority = 0;
/// The highest retention priority (evicted last).
inline constexpr std::uint8_t kMaxRetentionPriority = 100;
/// The priority of a block nobody set one for, and the one an expired priority falls back to (TensorRT-LLM's 35).
inline constexpr std::uint8_t kDefaultRetentionPriority = 35;

/// The clock of retention expiries. Policies never read it: callers pass `now` explicitly (`expire`), so tests and
/// trace replays run on simulated time. A steady clock: wall-clock jumps must not expire or extend priorities.
using RetentionClock = std::chrono::steady_clock;
/// An absolute retention expiry or "now" (integral: nanoseconds since the steady clock's epoch).
using RetentionTimePoint = RetentionClock::time_point;

/// An eviction policy with per-block retention priorities: `set_priority(b, priority, expires_at)` assigns the
/// priority b takes when it is next inserted (cached), and `expire(now)` makes every priority whose expiry is
/// `<= now` fall back to kDefaultRetentionPriority, returning how many cached blocks moved.
template <class P, class Id>
concept RetentionEvictionPolicy =
    EvictionPolicy<P, Id> &&
    requires(P p, Id b, std::uint8_t prio, std::optional<RetentionTimePoint> at, RetentionTimePoint now) {
      p.set_priority(b, prio, at);
      { p.expire(now) } -> std::convertible_to<std::size_t>;
    };

/// Forwards to `policy.set_priority(b, priority, expires_at)` for a RetentionEvictionPolicy; does nothing for other
/// policies (so a manager can pass request priorities whatever its policy). Errors and cost: the policy's.
template <class Id, class P>
  requires EvictionPolicy<P, Id>
void set_block_priority(P& policy, Id b, std::uint8_t priority, std::optional<RetentionTimePoint> expires_at) {
  if constexpr (RetentionEvictionPolicy<P, Id>) policy.set_priority(b, priority, expires_at);
}

/// Forwards to `policy.expire(now)` for a policy that has it (a RetentionEvictionPolicy) and returns its count; 0
/// for other policies. Errors and cost: the policy's.
template <class P>
std::size_t expire_priorities(P& policy, RetentionTimePoint now) {
  if constexpr (requires { { policy.expire(now) } -> std::convertible_to<std::size_t>; }) {
    return policy.expire(now);
  } else {
    return 0;
  }
}

}  // namespace pagedkv
