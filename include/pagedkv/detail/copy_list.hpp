// pagedkv/detail/copy_list.hpp: the copy-on-write copies a manager keeps between an append and the build that hands
// them to the kernels: each copy holds one reference on its source, beside the sequence whose table holds its
// destination (its owner), plus a build's selection and the copies it took (docs/design.md "Copy-on-write and the
// pending-copy reference", "The manager in parts").
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include <pagedkv/detail/reserve.hpp>

namespace pagedkv::detail {

/// Pending copy-on-write copies (`Copy`: `src`, `dst`, `group`; BlockCopy<Id>) and their owners (`Owner`: a
/// sequence with a `num_pending_copies` counter, which the list keeps equal to the copies it owns). The list holds
/// no reference itself: the caller acquires each copy's source reference before `push` and releases it after
/// `take_selected` or `drop_into`. No allocation in `push` once `reserve_room` made room; O(copies) per call.
template <class Copy, class Owner>
class CopyList {
 public:
  using id_type = decltype(Copy{}.src);

  /// Every pending copy, in queue order.
  [[nodiscard]] std::span<const Copy> copies() const noexcept { return copies_; }
  [[nodiscard]] bool empty() const noexcept { return copies_.empty(); }
  [[nodiscard]] std::size_t size() const noexcept { return copies_.size(); }

  /// Make room for `n` more pushes (may throw std::bad_alloc; changes nothing visible).
  void reserve_room(std::size_t n) {
    // (the tests inline: reserve_more stays out of line, and growth calls this on every append)
    if (copies_.capacity() - copies_.size() < n) reserve_more(copies_, n);
    if (owners_.capacity() - owners_.size() < n) reserve_more(owners_, n);
  }

  /// Queue copy `c` into one of `owner`'s blocks: handed out with the next build that includes `owner`, counted in
  /// owner.num_pending_copies. Precondition: room reserved (reserve_room).
  void push(const Copy& c, Owner& owner) {
    copies_.push_back(c);
    owners_.push_back(&owner);
    ++owner.num_pending_copies;
  }

  /// Pending copies reading block `b` (each holds a reference on it). O(copies).
  [[nodiscard]] std::uint32_t pins(id_type b) const noexcept {
    std::uint32_t n = 0;
    for (const Copy& c : copies_) n += c.src == b ? 1U : 0U;
    return n;
  }

  /// Drop the pending copy into block `b` (its destination became unreferenced: nobody needs its contents), with
  /// its owner's count and, while a build holds its selection (see select), its selection flag; return its source,
  /// whose reference the caller releases; nullopt when no copy writes `b`. O(copies).
  std::optional<id_type> drop_into(id_type b) noexcept {
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      if (copies_[i].dst != b) continue;
      const id_type src = copies_[i].src;
      --owners_[i]->num_pending_copies;
      if (take_.size() == copies_.size()) take_.erase(take_.begin() + static_cast<std::ptrdiff_t>(i));
      copies_.erase(copies_.begin() + static_cast<std::ptrdiff_t>(i));
      owners_.erase(owners_.begin() + static_cast<std::ptrdiff_t>(i));
      return src;
    }
    return std::nullopt;
  }

  /// Marks the pending copies a build hands out, and returns how many: the copies the caller's `in_batch(owner)`
  /// claims (the tables of the batch's own sequences, and of sequences with nothing pending that no build of their
  /// own would reach), plus any other copy whose source block receives a write from this build (`writes(copy)`):
  /// the copy must read it first, and copy_blocks runs before write_kv in the same step. Every other copy stays
  /// pending for the build of its owner's batch, so an engine that builds its prefill and decode batches
  /// separately (vLLM, SGLang) gets each batch's copies with that batch. `writes` is asked only for copies
  /// `in_batch` does not claim. The selection lasts until take_selected (drop_into keeps it aligned).
  /// O(copies) plus the `writes` tests; allocates only while the list is larger than ever before.
  /// Out of line (with take_selected): once per build, and inlined they grew the build's per-block loop (callgrind:
  /// +2.2% in build_groups_in, docs/benchmarks.md "Manager split gate").
  template <class InBatch, class Writes>
  [[gnu::noinline]] std::size_t select(InBatch&& in_batch, Writes&& writes) {
    take_.assign(copies_.size(), 0);
    std::size_t n = 0;
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      if (in_batch(*owners_[i]) || writes(copies_[i])) {
        take_[i] = 1;
        ++n;
      }
    }
    return n;
  }

  /// Selected copies (by the last select) of group `g`. O(copies).
  [[nodiscard]] std::size_t num_selected_in(std::uint32_t g) const noexcept {
    std::size_t n = 0;
    for (std::size_t i = 0; i < copies_.size(); ++i) n += (take_[i] != 0 && copies_[i].group == g) ? 1 : 0;
    return n;
  }

  /// Make room for `n` taken copies (a build's, before its commit; may throw std::bad_alloc). Clears `taken()`.
  void reserve_taken(std::size_t n) {
    taken_.clear();
    taken_.reserve(n);
  }

  /// Moves the selected copies from the list to `taken()`, in list order, keeping the order of those left, and
  /// ends the selection; each moved copy's owner has one pending copy less. The caller then releases the
  /// reference each taken copy held on its source, and clears them (clear_taken). O(copies); no allocation once
  /// reserve_taken made room.
  [[gnu::noinline]] void take_selected() {
    std::size_t kept = 0;
    for (std::size_t i = 0; i < copies_.size(); ++i) {
      if (take_[i] != 0) {
        taken_.push_back(copies_[i]);
        --owners_[i]->num_pending_copies;
        continue;
      }
      copies_[kept] = copies_[i];
      owners_[kept] = owners_[i];
      ++kept;
    }
    copies_.resize(kept);
    owners_.resize(kept);
    take_.clear();  // the selection is used up (drop_into stops following it)
  }

  /// The copies the last take_selected moved out (until clear_taken).
  [[nodiscard]] std::span<const Copy> taken() const noexcept { return taken_; }
  void clear_taken() noexcept { taken_.clear(); }

 private:
  std::vector<Copy> copies_;          // each holds one reference on its src
  std::vector<Owner*> owners_;        // [copies_] the sequence whose table has dst
  std::vector<std::uint8_t> take_;    // a build's selection: [copies_] 1 = handed out by this build
  std::vector<Copy> taken_;           // the selected copies, moved out by take_selected
};

}  // namespace pagedkv::detail
