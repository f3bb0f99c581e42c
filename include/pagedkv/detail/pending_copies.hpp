// pagedkv/detail/pending_copies.hpp: the copy-on-write list both managers keep between an append and the build that
// hands it to the kernels: copies (each holding one reference on its source) beside the sequence whose table holds
// each destination.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace pagedkv::detail {

/// Pending copies reading block `b` (each holds a reference on its source). `Copy` has `src` and `dst`. O(copies).
template <class Copy, class Id>
[[nodiscard]] std::uint32_t pending_reads(const std::vector<Copy>& copies, Id b) noexcept {
  std::uint32_t n = 0;
  for (const Copy& c : copies) n += c.src == b ? 1U : 0U;
  return n;
}

/// Drop the pending copy into block `b` (its destination became unreferenced: nobody needs its contents), with its
/// owner entry (whose `num_pending_copies` drops by one) and, while a build holds its selection
/// (`take.size() == copies.size()`, see select_batch_copies), its selection flag; return its source, whose
/// reference the caller releases; nullopt when no copy writes `b`. `owners[i]` is the owner of `copies[i]`.
/// O(copies).
template <class Copy, class Owner, class Id>
std::optional<Id> drop_pending_copy_into(std::vector<Copy>& copies, std::vector<Owner*>& owners,
                                         std::vector<std::uint8_t>& take, Id b) noexcept {
  for (std::size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].dst != b) continue;
    const Id src = copies[i].src;
    --owners[i]->num_pending_copies;
    if (take.size() == copies.size()) take.erase(take.begin() + static_cast<std::ptrdiff_t>(i));
    copies.erase(copies.begin() + static_cast<std::ptrdiff_t>(i));
    owners.erase(owners.begin() + static_cast<std::ptrdiff_t>(i));
    return src;
  }
  return std::nullopt;
}

/// Marks in `take` (`[copies]`) the pending copies a build hands out, and returns how many: the copies the caller's
/// `in_batch(*owner)` claims (the tables of the batch's own sequences, and of sequences with nothing pending that no
/// build of their own would reach), plus any other copy whose source block receives a write from this build
/// (`writes(copy)`): the copy must read it first, and copy_blocks runs before write_kv in the same step. Every
/// other copy stays pending for the build of its owner's batch, so an engine that builds its prefill and decode
/// batches separately (vLLM, SGLang) gets each batch's copies with that batch. `writes` is asked only for copies
/// `in_batch` does not claim. O(copies) plus the `writes` tests.
template <class Copy, class Owner, class InBatch, class Writes>
std::size_t select_batch_copies(const std::vector<Copy>& copies, const std::vector<Owner*>& owners, InBatch&& in_batch,
                                Writes&& writes, std::vector<std::uint8_t>& take) {
  take.assign(copies.size(), 0);
  std::size_t n = 0;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    if (in_batch(*owners[i]) || writes(copies[i])) {
      take[i] = 1;
      ++n;
    }
  }
  return n;
}

/// Moves the copies marked in `take` (by select_batch_copies) from `copies` / `owners` to the end of `out`, in list
/// order, keeping the order of those left, and clears `take`; each moved copy's owner has one pending copy less.
/// The caller then releases the reference each moved copy held on its source. O(copies); no allocation beyond
/// `out`'s growth.
template <class Copy, class Owner>
void take_selected_copies(std::vector<Copy>& copies, std::vector<Owner*>& owners, std::vector<std::uint8_t>& take,
                          std::vector<Copy>& out) {
  std::size_t kept = 0;
  for (std::size_t i = 0; i < copies.size(); ++i) {
    if (take[i] != 0) {
      out.push_back(copies[i]);
      --owners[i]->num_pending_copies;
      continue;
    }
    copies[kept] = copies[i];
    owners[kept] = owners[i];
    ++kept;
  }
  copies.resize(kept);
  owners.resize(kept);
  take.clear();  // the selection is used up (drop_pending_copy_into stops following it)
}

}  // namespace pagedkv::detail
