// pagedkv/detail/id_lists.hpp: a fixed family of intrusive doubly-linked lists over block ids (the building block of
// the segmented and the priority eviction policies).
#pragma once

#include <cstddef>
#include <vector>

#include <pagedkv/config.hpp>

namespace pagedkv::detail {

/// `num_lists` doubly-linked lists threaded through one array of (prev, next) `Id` pairs indexed by block id (both
/// links of a block in one cache line, so unlinking a block costs one miss for its own links); a block is in at most one
/// list at a time, and which one is the caller's to remember (the policies keep a per-block byte anyway). Block 0
/// (the null block, never linked) is the "none" link, so the arrays need no sentinel slots and every id the
/// allocator can hand out fits. Each list keeps its head (least recently linked, the victim end), its tail (most
/// recently linked) and its length.
///
/// Cost: push_back, remove, front O(1); reset O(num_blocks + num_lists). No allocation after construction.
/// Memory: 2 * sizeof(Id) bytes per block + (2 * sizeof(Id) + sizeof(size_t)) per list.
/// Preconditions (not checked: the owning policy guarantees them): 0 < b < num_blocks; push_back only of an unlinked
/// block, remove only of a block linked in that list. Thread safety: none.
template <BlockIdType Id>
class IdLists {
 public:
  IdLists(std::size_t num_blocks, std::size_t num_lists)
      : links_(num_blocks, Links{kAbsent, kAbsent}), ends_(num_lists) {}

  /// Links `b` at the tail (most recent end) of list `l`.
  void push_back(std::size_t l, Id b) noexcept {
    Ends& e = ends_[l];
    links_[b] = Links{e.tail, 0};
    if (e.tail == 0) {
      e.head = b;
    } else {
      links_[e.tail].next = b;
    }
    e.tail = b;
    ++e.size;
  }
  /// Unlinks `b` from list `l`.
  void remove(std::size_t l, Id b) noexcept {
    Ends& e = ends_[l];
    const Links x = links_[b];
    if (x.prev == 0) {
      e.head = x.next;
    } else {
      links_[x.prev].next = x.next;
    }
    if (x.next == 0) {
      e.tail = x.prev;
    } else {
      links_[x.next].prev = x.prev;
    }
    links_[b] = Links{kAbsent, kAbsent};
    --e.size;
  }
  /// Head of list `l` (least recently linked), 0 when empty.
  [[nodiscard]] Id front(std::size_t l) const noexcept { return ends_[l].head; }
  /// The block after `b` towards the tail, 0 at the tail. Precondition: `b` is linked.
  [[nodiscard]] Id next(Id b) const noexcept { return links_[b].next; }
  /// Length of list `l`.
  [[nodiscard]] std::size_t size(std::size_t l) const noexcept { return ends_[l].size; }
  /// Whether `b` is linked in some list. Any `b` (out of range: false).
  [[nodiscard]] bool linked(Id b) const noexcept { return b != 0 && b < links_.size() && links_[b].prev != kAbsent; }
  /// Number of block slots (the pool size the lists were built for).
  [[nodiscard]] std::size_t num_blocks() const noexcept { return links_.size(); }
  /// Unlinks everything. O(num_blocks + num_lists).
  void reset() noexcept {
    for (Links& x : links_) x = Links{kAbsent, kAbsent};
    for (Ends& e : ends_) e = Ends{};
  }
  /// List `l` from head to tail (O(length); for tests and debugging).
  [[nodiscard]] std::vector<Id> items(std::size_t l) const {
    std::vector<Id> out;
    out.reserve(ends_[l].size);
    for (Id b = ends_[l].head; b != 0; b = links_[b].next) out.push_back(b);
    return out;
  }

 private:
  static constexpr Id kAbsent = static_cast<Id>(~Id{0});
  struct Links {
    Id prev;  // previous block in its list (0: none), kAbsent when unlinked
    Id next;  // next block in its list (0: none), kAbsent when unlinked
  };
  struct Ends {
    Id head = 0;
    Id tail = 0;
    std::size_t size = 0;
  };
  std::vector<Links> links_;  // [num_blocks]
  std::vector<Ends> ends_;  // [num_lists]
};

}  // namespace pagedkv::detail
