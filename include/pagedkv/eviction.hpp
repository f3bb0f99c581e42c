// pagedkv/eviction.hpp: eviction policies for unreferenced cached blocks, and the concept they satisfy.
#pragma once

#include <concepts>
#include <cstddef>
#include <optional>
#include <vector>

#include <pagedkv/config.hpp>

namespace pagedkv {

/// Requirements on an eviction policy over block ids of type `Id`. The policy holds the evictable set: blocks whose
/// refcount is 0 and that carry a block hash. `BlockAllocator` calls `insert` when a cached block's refcount drops
/// to 0 (most recently released), `erase` when such a block is referenced again (a prefix hit) or its hash is
/// dropped, and `pop_victim` when it must reuse one. All must be O(1) so allocation cost does not grow with the
/// number of cached blocks. Constructed with the pool size (blocks, including the null block 0, which is never
/// inserted).
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
  [[nodiscard]] std::optional<Id> pop_victim() noexcept {
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

}  // namespace pagedkv
