// pagedkv/eviction_slru.hpp: segmented LRU eviction (a probationary and a protected segment).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/detail/id_lists.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/eviction.hpp>

namespace pagedkv {

/// Segmented LRU (SLRU; Karedla, Love and Wherry, "Caching strategies to improve disk system performance", IEEE
/// Computer 1994; the main region of W-TinyLFU caches, Einziger et al. ACM TOS 2017): evictable blocks live in two
/// LRU segments.
///
///  - A block cached for the first time with its current content enters **probation** at its MRU end.
///  - A block that was hit while cached (the allocator `erase`d it because a request acquired it) enters the
///    **protected** segment at its MRU end when it is released again (`insert`), and so does every later release of
///    the same content: one hit is enough to be "frequent".
///  - The protected segment holds at most `protected_capacity()` = floor(protected_fraction * (num_blocks - 1))
///    blocks (a fraction of the usable pool; default 80%). When an insert makes it overflow, its LRU block is
///    demoted to probation's MRU end (it keeps its hit mark: hit again, it goes back to protected).
///  - Victim: probation's LRU block; protected's LRU block only when probation is empty.
///
/// So blocks reused once survive a scan of one-off prompts that would flush a plain LRU list, which is what
/// frequency-aware caches in the field use SLRU for.
///
/// Hit or drop: `erase(b)` always means "b was hit" (the allocator's only erase, in `acquire`); a cached block whose
/// hash is dropped without a hit leaves through `forget(b)` (via `pagedkv::forget_block`), which also clears the hit
/// mark of a held block that loses its hash. `pop_victim` clears the victim's mark (its content is being replaced).
/// The policy cannot infer a drop from the call sequence alone (eviction.hpp, ForgettingEvictionPolicy, says why).
///
/// Cost: insert, erase, forget, pop_victim O(1) (at most one demotion per insert); clear O(num_blocks). No allocation
/// after construction. Memory: 2 * sizeof(Id) + 1 bytes per block (9 B with 32-bit ids: the LRU links, shared by
/// both segments, and a segment / hit-mark byte), plus a few words.
/// Thread safety: none (single writer, like the allocator that owns it).
template <BlockIdType Id>
class SlruEviction {
 public:
  /// Default share of the usable pool the protected segment may hold (Karedla et al.'s and the field's ~80%).
  static constexpr double kDefaultProtectedFraction = 0.8;

  /// `num_blocks`: pool size in blocks, including the null block. `protected_fraction` in [0, 1]: the protected
  /// segment holds at most floor(protected_fraction * (num_blocks - 1)) blocks (0: every insert lands in probation
  /// eventually and the policy is exactly LRU; 1: nothing is ever demoted). Throws kInvalidArgument (nothing
  /// allocated) for a fraction outside [0, 1] or NaN. Memory: see the class.
  explicit SlruEviction(std::size_t num_blocks, double protected_fraction = kDefaultProtectedFraction)
      : protected_capacity_(capacity_for(num_blocks, protected_fraction)), lists_(num_blocks, 2),
        seg_(num_blocks, kFresh) {}

  /// Caches `b` (its refcount dropped to 0): protected MRU end if b was hit since its content was cached, else
  /// probation MRU end; may demote protected's LRU block to probation's MRU end. Precondition: 0 < b < num_blocks,
  /// b not in the set. O(1).
  void insert(Id b) noexcept {
    if (seg_[b] == kHitHeld) {
      seg_[b] = kProtected;
      lists_.push_back(1, b);
      if (lists_.size(1) > protected_capacity_) {
        const Id d = lists_.front(1);
        lists_.remove(1, d);
        lists_.push_back(0, d);
        seg_[d] = kProbation;
      }
    } else {
      seg_[b] = kProbation;
      lists_.push_back(0, b);
    }
  }
  /// `b` was hit (acquired while cached): it leaves the set and is marked, so its next insert goes to protected.
  /// Precondition: contains(b). O(1).
  void erase(Id b) noexcept {
    unlink(b);
    seg_[b] = kHitHeld;
  }
  /// `b`'s hash was dropped: it leaves the set if it is there (not as a hit) and its hit mark is cleared. b may be
  /// held or free. Precondition: 0 < b < num_blocks. O(1).
  void forget(Id b) noexcept {
    if (seg_[b] >= kProbation) unlink(b);
    seg_[b] = kFresh;
  }
  /// Removes and returns the victim (probation's LRU block, else protected's), clearing its hit mark; nullopt when
  /// the set is empty. O(1).
  [[nodiscard]] std::optional<Id> pop_victim() noexcept {
    const Id v = peek_victim();
    if (v == 0) return std::nullopt;
    unlink(v);
    seg_[v] = kFresh;
    return v;
  }
  /// The block `pop_victim` would return, without removing it (0 when empty). O(1).
  [[nodiscard]] Id peek_victim() const noexcept {
    const Id p = lists_.front(0);
    return p != 0 ? p : lists_.front(1);
  }
  /// Number of evictable blocks (both segments).
  [[nodiscard]] std::size_t size() const noexcept { return lists_.size(0) + lists_.size(1); }
  /// Whether `b` is evictable. Any `b` (out of range: false).
  [[nodiscard]] bool contains(Id b) const noexcept { return lists_.linked(b); }
  /// Back to the state after construction: the set is emptied and every hit mark cleared (held blocks included).
  /// The allocator's reset of the prefix cache empties the set through pop_victim instead. O(num_blocks).
  void clear() noexcept {
    lists_.reset();
    for (auto& s : seg_) s = kFresh;
  }

  /// Blocks in the protected segment.
  [[nodiscard]] std::size_t protected_size() const noexcept { return lists_.size(1); }
  /// Blocks in the probationary segment.
  [[nodiscard]] std::size_t probation_size() const noexcept { return lists_.size(0); }
  /// Most blocks the protected segment holds.
  [[nodiscard]] std::size_t protected_capacity() const noexcept { return protected_capacity_; }
  /// Whether `b` is in the protected segment. Any `b`.
  [[nodiscard]] bool is_protected(Id b) const noexcept { return contains(b) && seg_[b] == kProtected; }
  /// Whether `b`, not in the set, was hit since its content was cached (its next insert goes to protected). Any `b`.
  [[nodiscard]] bool is_marked_hit(Id b) const noexcept { return b < seg_.size() && seg_[b] == kHitHeld; }
  /// Probation from LRU to MRU (O(size); for tests and debugging).
  [[nodiscard]] std::vector<Id> probation_order() const { return lists_.items(0); }
  /// Protected from LRU to MRU (O(size); for tests and debugging).
  [[nodiscard]] std::vector<Id> protected_order() const { return lists_.items(1); }
  /// The eviction order if nothing else happens: probation LRU -> MRU, then protected LRU -> MRU (O(size)).
  [[nodiscard]] std::vector<Id> order() const {
    std::vector<Id> out = lists_.items(0);
    for (Id b : lists_.items(1)) out.push_back(b);
    return out;
  }

 private:
  // seg_ values. kFresh: not in the set, no hit since the content was cached (or free). kHitHeld: not in the set,
  // left it by a hit. kProbation / kProtected: in that segment (list 0 / list 1).
  static constexpr std::uint8_t kFresh = 0;
  static constexpr std::uint8_t kHitHeld = 1;
  static constexpr std::uint8_t kProbation = 2;
  static constexpr std::uint8_t kProtected = 3;

  static std::size_t capacity_for(std::size_t num_blocks, double fraction) {
    if (!(fraction >= 0.0 && fraction <= 1.0)) {
      detail::raise(Errc::kInvalidArgument,
                    "SlruEviction: protected_fraction = " + std::to_string(fraction) + ": must be in [0, 1]");
    }
    const std::size_t usable = num_blocks > 0 ? num_blocks - 1 : 0;
    return static_cast<std::size_t>(std::floor(fraction * static_cast<double>(usable)));
  }
  void unlink(Id b) noexcept { lists_.remove(static_cast<std::size_t>(seg_[b] - kProbation), b); }

  std::size_t protected_capacity_;  // most blocks in list 1 (first: validated before anything is allocated)
  detail::IdLists<Id> lists_;       // list 0: probation, list 1: protected; head = LRU
  std::vector<std::uint8_t> seg_;   // [num_blocks] kFresh / kHitHeld / kProbation / kProtected
};

static_assert(EvictionPolicy<SlruEviction<std::uint32_t>, std::uint32_t>);
static_assert(ForgettingEvictionPolicy<SlruEviction<std::uint32_t>, std::uint32_t>);

}  // namespace pagedkv
