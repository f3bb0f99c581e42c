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
/// owner entry (whose `num_pending_copies` drops by one), and return its source, whose reference the caller
/// releases; nullopt when no copy writes `b`. `owners[i]` is the owner of `copies[i]`. O(copies).
template <class Copy, class Owner, class Id>
std::optional<Id> drop_pending_copy_into(std::vector<Copy>& copies, std::vector<Owner*>& owners, Id b) noexcept {
  for (std::size_t i = 0; i < copies.size(); ++i) {
    if (copies[i].dst != b) continue;
    const Id src = copies[i].src;
    --owners[i]->num_pending_copies;
    copies.erase(copies.begin() + static_cast<std::ptrdiff_t>(i));
    owners.erase(owners.begin() + static_cast<std::ptrdiff_t>(i));
    return src;
  }
  return std::nullopt;
}

}  // namespace pagedkv::detail
