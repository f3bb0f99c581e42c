// pagedkv/block_table.hpp: one sequence's logical -> physical block mapping, with fork, copy-on-write and rewind.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/block_allocator.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/detail/reserve.hpp>
#include <pagedkv/error.hpp>

namespace pagedkv {

/// A block copy (src block, dst block) for the `copy_blocks` kernel: copy-on-write of a shared partial block, in
/// KV-cache group `group` (0 with one group; GroupBlockCopy is this type).
template <BlockIdType Id = std::uint32_t>
struct BlockCopy {
  Id src;
  Id dst;
  std::uint32_t group = 0;
  friend constexpr bool operator==(const BlockCopy&, const BlockCopy&) = default;
};

/// One sequence's block table (PagedAttention sec. 4.2): logical block i holds tokens [i * block_size,
/// (i + 1) * block_size) in physical block `blocks()[i]`. The table holds one reference on each of its blocks in
/// the `BlockAllocator` it is used with; it does not own the allocator, so every call that changes references takes
/// it as an argument (always the same allocator).
///
/// Writability rule: a token may be written into the last block only if this table is its sole holder and the
/// block carries no hash (hashed blocks are immutable: other requests may hit them). Otherwise the next append
/// first copies the block to a fresh one (copy-on-write, PagedAttention sec. 4.4) and reports one `BlockCopy`.
///
/// Invalidation: `blocks()` spans are invalidated by any non-const call. Thread safety: none; one writer.
/// Errors: misuse throws `pagedkv::Error` and changes nothing.
template <BlockIdType Id = std::uint32_t>
class BlockTable {
 public:
  /// An empty table with `block_size` tokens per block. Throws kInvalidArgument if block_size == 0.
  explicit BlockTable(std::uint32_t block_size) : block_size_(block_size) {
    if (block_size == 0) detail::raise(Errc::kInvalidArgument, "block_size = 0: must be positive");
  }

  [[nodiscard]] std::uint32_t block_size() const noexcept { return block_size_; }
  /// Tokens in the sequence.
  [[nodiscard]] std::size_t num_tokens() const noexcept { return num_tokens_; }
  /// Blocks in the table: ceil(num_tokens / block_size).
  [[nodiscard]] std::size_t num_blocks() const noexcept { return blocks_.size(); }
  /// Physical block ids, logical order. `[num_blocks]`.
  [[nodiscard]] std::span<const Id> blocks() const noexcept { return blocks_; }
  /// Tokens in the last block, in [1, block_size]; 0 for an empty table (FlashInfer's last_page_len).
  [[nodiscard]] std::uint32_t last_block_len() const noexcept {
    if (num_tokens_ == 0) return 0;
    return static_cast<std::uint32_t>(num_tokens_ - (blocks_.size() - 1) * block_size_);
  }
  /// Slot of token position `pos`: block * block_size + pos % block_size. Precondition: pos < num_blocks() *
  /// block_size.
  [[nodiscard]] std::int64_t slot(std::size_t pos) const noexcept {
    return static_cast<std::int64_t>(blocks_[pos / block_size_]) * block_size_ +
           static_cast<std::int64_t>(pos % block_size_);
  }

  /// Make room for `n` blocks in total, so that growing to them cannot throw (strong guarantee for callers that
  /// reserve before mutating). May throw std::bad_alloc; changes no block.
  void reserve_blocks(std::size_t n) {
    if (n > blocks_.capacity()) blocks_.reserve(std::max(n, 2 * blocks_.capacity()));
  }

  /// Whether appending would first copy the partial last block (it is shared, or hashed after a rewind).
  template <class Alloc>
  [[nodiscard]] bool last_block_needs_copy(const Alloc& alloc) const {
    if (num_tokens_ % block_size_ == 0) return false;  // no partial last block
    const Id last = blocks_.back();
    return alloc.refcount(last) > 1 || alloc.is_hashed(last);
  }

  /// Blocks an append of `n` tokens takes from the allocator: new blocks plus one for a copy-on-write.
  template <class Alloc>
  [[nodiscard]] std::size_t blocks_needed_to_append(std::size_t n, const Alloc& alloc) const {
    if (n == 0) return 0;
    const std::size_t new_blocks = (num_tokens_ + n + block_size_ - 1) / block_size_ - blocks_.size();
    return new_blocks + (last_block_needs_copy(alloc) ? 1 : 0);
  }

  /// Reserve slots for `n` new tokens, all or nothing. Appends the n slots to `slots_out` (unless it is null) and,
  /// when the partial last block had to be copied first, sets `copy_out` to (old block, new block). The table's reference on the
  /// old block passes to `copy_out`: the caller releases it once the copy has been issued to the kernel, so the
  /// source cannot be reused (and overwritten) while the copy is pending.
  /// Returns false, changing nothing, when the allocator lacks blocks (an expected outcome). `on_evict` as in
  /// BlockAllocator::try_allocate.
  template <class Alloc, class OnEvict>
  [[nodiscard]] bool try_append(std::size_t n, Alloc& alloc, OnEvict&& on_evict, std::vector<std::int64_t>* slots_out,
                                std::optional<BlockCopy<Id>>& copy_out) {
    copy_out.reset();
    if (n == 0) return true;
    const bool cow = last_block_needs_copy(alloc);
    const std::size_t old_blocks = blocks_.size();
    const std::size_t new_blocks = (num_tokens_ + n + block_size_ - 1) / block_size_ - old_blocks;
    if (new_blocks + (cow ? 1 : 0) > alloc.num_available_blocks()) return false;
    if (slots_out != nullptr) detail::reserve_more(*slots_out, n);  // may throw before anything changed
    blocks_.resize(old_blocks + new_blocks);
    if (cow) {
      const Id dst = *alloc.try_allocate_one(on_evict);
      const Id src = blocks_[old_blocks - 1];
      blocks_[old_blocks - 1] = dst;
      copy_out = BlockCopy<Id>{src, dst};
    }
    const bool ok = alloc.try_allocate(std::span<Id>(blocks_).subspan(old_blocks), on_evict);
    (void)ok;  // guaranteed by the availability check above
    if (slots_out != nullptr) {  // one contiguous run per block: block * block_size + offset
      std::size_t w = slots_out->size();
      slots_out->resize(w + n);
      for (std::size_t p = num_tokens_; p < num_tokens_ + n;) {
        const std::size_t off = p % block_size_;
        const std::size_t run = std::min<std::size_t>(block_size_ - off, num_tokens_ + n - p);
        const std::int64_t base = static_cast<std::int64_t>(blocks_[p / block_size_]) * block_size_;
        for (std::size_t k = 0; k < run; ++k) (*slots_out)[w + k] = base + static_cast<std::int64_t>(off + k);
        w += run;
        p += run;
      }
    }
    num_tokens_ += n;
    return true;
  }

  /// Append `n` positions without allocating: each new logical block i is `entry(i)`, a block whose reference the
  /// caller took or the null block 0 (a recurrent-state group's table, which holds only checkpoint blocks). The
  /// caller reserved room (reserve_blocks); then it does not throw.
  template <class Entry>
  void extend(std::size_t n, Entry&& entry) {
    const std::size_t end = (num_tokens_ + n + block_size_ - 1) / block_size_;
    for (std::size_t i = blocks_.size(); i < end; ++i) blocks_.push_back(entry(i));
    num_tokens_ += n;
  }

  /// Append a full block whose reference the caller already took (a prefix-cache hit at admission).
  /// Throws kInvalidArgument unless the table ends on a block boundary.
  void append_full_block(Id b) {
    if (num_tokens_ % block_size_ != 0) {
      detail::raise(Errc::kInvalidArgument, "append_full_block: table ends inside a block (" +
                                                std::to_string(num_tokens_) + " tokens, block_size " +
                                                std::to_string(block_size_) + ")");
    }
    blocks_.push_back(b);
    num_tokens_ += block_size_;
  }

  /// Replace the whole table by `blocks` holding `num_tokens` tokens (a sequence resumed after swapping), whose
  /// references the caller took. Throws kInvalidArgument unless ceil(num_tokens / block_size) == blocks.size();
  /// nothing changes then. May throw std::bad_alloc before changing anything.
  void assign(std::span<const Id> blocks, std::size_t num_tokens) {
    if ((num_tokens + block_size_ - 1) / block_size_ != blocks.size()) {
      detail::raise(Errc::kInvalidArgument, "assign: " + std::to_string(blocks.size()) + " blocks cannot hold " +
                                                std::to_string(num_tokens) + " tokens of block_size " +
                                                std::to_string(block_size_));
    }
    blocks_.assign(blocks.begin(), blocks.end());
    num_tokens_ = num_tokens;
  }

  /// Replace logical block `i` by `b`, whose reference the caller took; returns the old block, whose reference
  /// the caller now owns (to release). Used to switch a freshly filled block to an identical cached one.
  Id replace_block(std::size_t i, Id b) {
    if (i >= blocks_.size()) {
      detail::raise(Errc::kInvalidArgument, "replace_block: logical block " + std::to_string(i) + " >= " +
                                                std::to_string(blocks_.size()) + " blocks");
    }
    const Id old = blocks_[i];
    blocks_[i] = b;
    return old;
  }

  /// A copy of this table sharing every block (refcount + 1 each); allocates no block (PagedAttention sec. 4.4,
  /// parallel sampling / beam search).
  template <class Alloc>
  [[nodiscard]] BlockTable fork(Alloc& alloc) const {
    BlockTable child(*this);  // may throw (memory) before any refcount changes
    for (Id b : blocks_) alloc.acquire(b);
    return child;
  }

  /// Release every block, last block first (so a sequence's tail is evicted before its shared head), and empty
  /// the table.
  template <class Alloc>
  void release_all(Alloc& alloc) {
    while (!blocks_.empty()) {
      alloc.release(blocks_.back());
      blocks_.pop_back();
    }
    num_tokens_ = 0;
  }

  /// Drop the last `n` tokens (rejected speculative tokens). Blocks left without tokens are released, last first;
  /// a block left partial keeps its contents and, if shared or hashed, is copied on the next append, so a shared
  /// or cached block is never written. Throws kLimitExceeded if n > num_tokens().
  template <class Alloc>
  void rewind(std::size_t n, Alloc& alloc) {
    if (n > num_tokens_) {
      detail::raise(Errc::kLimitExceeded, "rewind: n = " + std::to_string(n) + " exceeds the sequence's " +
                                              std::to_string(num_tokens_) + " tokens");
    }
    num_tokens_ -= n;
    const std::size_t keep = (num_tokens_ + block_size_ - 1) / block_size_;
    while (blocks_.size() > keep) {
      alloc.release(blocks_.back());
      blocks_.pop_back();
    }
  }

 private:
  std::vector<Id> blocks_;
  std::size_t num_tokens_ = 0;
  std::uint32_t block_size_;
};

}  // namespace pagedkv
