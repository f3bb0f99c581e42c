// pagedkv/block_allocator.hpp: the fixed pool of physical KV blocks with refcounts and eviction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/eviction.hpp>

namespace pagedkv {

/// The pool of `num_blocks` physical KV blocks (PagedAttention, Kwon et al. SOSP'23 sec. 4.2), with refcounts for
/// sharing and an eviction policy over unreferenced cached blocks.
///
/// Every block except the null block 0 is in exactly one state:
///  - free:    refcount 0, no hash. Never-used blocks, then released unhashed blocks.
///  - cached:  refcount 0, hashed. Evictable; held by the eviction policy (LRU by default).
///  - held:    refcount > 0 (hashed or not).
/// Allocation order (docs/contract.md sec. 2): never-used blocks first in increasing id order; then released unhashed
/// blocks, most recently released first; then the eviction policy's victim (LRU: least recently released cached
/// block), whose hash the caller drops through the `on_evict` callback before the block is reused.
///
/// Cost: every operation O(1) (multi-block calls O(n)); nothing allocates after construction.
/// Memory: sizeof(uint32_t) + 1 + 3 * sizeof(Id) bytes per block (17 for uint32 ids: refcount, hash mark, LRU
/// links, free-stack slot). A KVCacheManager adds the PrefixHashIndex (see there).
/// Thread safety: none; one writer (the scheduler thread). Errors: misuse throws `pagedkv::Error` and changes
/// nothing (strong guarantee).
template <BlockIdType Id = std::uint32_t, EvictionPolicy<Id> Evict = LruEviction<Id>>
class BlockAllocator {
 public:
  using block_id_type = Id;
  using eviction_policy_type = Evict;

  /// A pool of `num_blocks` blocks, including the null block 0 (so `num_blocks - 1` are usable).
  /// Throws kInvalidArgument if num_blocks < 2 or does not fit `Id`.
  explicit BlockAllocator(std::size_t num_blocks) : BlockAllocator(checked(num_blocks), 0) {}

  /// Pool size in blocks, including the null block.
  [[nodiscard]] std::size_t num_blocks() const noexcept { return refcount_.size(); }
  /// Blocks that can ever be handed out: num_blocks() - 1.
  [[nodiscard]] std::size_t num_usable_blocks() const noexcept { return refcount_.size() - 1; }
  /// Free blocks (never used, or released without a hash).
  [[nodiscard]] std::size_t num_free_blocks() const noexcept {
    return (refcount_.size() - next_never_used_) + free_.size();
  }
  /// Cached blocks: unreferenced but hashed, hence evictable.
  [[nodiscard]] std::size_t num_cached_blocks() const noexcept { return evict_.size(); }
  /// Blocks an allocation can obtain now: free + cached.
  [[nodiscard]] std::size_t num_available_blocks() const noexcept { return num_free_blocks() + evict_.size(); }
  /// Blocks with refcount > 0.
  [[nodiscard]] std::size_t num_used_blocks() const noexcept { return num_usable_blocks() - num_available_blocks(); }
  /// Blocks evicted so far (reused while cached).
  [[nodiscard]] std::uint64_t num_evictions() const noexcept { return evictions_; }
  /// Block operations so far: allocations + acquires + releases (one per block).
  [[nodiscard]] std::uint64_t num_block_ops() const noexcept { return ops_; }

  /// Refcount of block `b` (number of block tables holding it). Throws kBlockOutOfRange.
  [[nodiscard]] std::uint32_t refcount(Id b) const {
    check_range(b, "refcount");
    return refcount_[b];
  }
  /// Whether block `b` carries a block hash (registered in a prefix index). Throws kBlockOutOfRange.
  [[nodiscard]] bool is_hashed(Id b) const {
    check_range(b, "is_hashed");
    return hashed_[b] != 0;
  }
  /// Whether block `b` is cached (refcount 0 and hashed: evictable). Throws kBlockOutOfRange.
  [[nodiscard]] bool is_cached(Id b) const {
    check_range(b, "is_cached");
    return evict_.contains(b);
  }
  /// The eviction policy (read-only; e.g. LruEviction::order() in tests).
  [[nodiscard]] const Evict& eviction_policy() const noexcept { return evict_; }

  /// Allocate `out.size()` blocks, all or nothing, each with refcount 1 and no hash. For every cached block that
  /// is evicted to satisfy the request, `on_evict(Id)` is called (before reuse) so the caller can drop its hash.
  /// Returns false and changes nothing when fewer than `out.size()` blocks are available (an expected outcome).
  template <class OnEvict>
  [[nodiscard]] bool try_allocate(std::span<Id> out, OnEvict&& on_evict) {
    if (out.size() > num_available_blocks()) return false;
    for (Id& slot : out) slot = take_one(on_evict);
    return true;
  }
  /// Allocate `out.size()` blocks; no block may be cached (for pools used without prefix caching).
  [[nodiscard]] bool try_allocate(std::span<Id> out) {
    return try_allocate(out, [](Id) {});
  }
  /// Allocate one block, or nullopt when none is available. See the span overload.
  template <class OnEvict>
  [[nodiscard]] std::optional<Id> try_allocate_one(OnEvict&& on_evict) {
    if (num_available_blocks() == 0) return std::nullopt;
    return take_one(on_evict);
  }

  /// Take one more reference to a held or cached block (fork, or a prefix hit). A cached block leaves the
  /// evictable set. Throws kBlockOutOfRange (b == 0 or b >= num_blocks) or kInvalidArgument (b is free).
  void acquire(Id b) {
    check_range(b, "acquire");
    if (refcount_[b] == 0) {
      if (!evict_.contains(b)) {
        detail::raise(Errc::kInvalidArgument, "acquire: block " + std::to_string(b) + " is free, not held or cached");
      }
      evict_.erase(b);
    }
    ++refcount_[b];
    ++ops_;
  }

  /// Drop one reference. At refcount 0 a hashed block becomes cached (most recently released), an unhashed one
  /// free. Throws kBlockOutOfRange, or kDoubleFree when the refcount is already 0.
  void release(Id b) {
    check_range(b, "release");
    if (refcount_[b] == 0) {
      detail::raise(Errc::kDoubleFree, "release: block " + std::to_string(b) + " has refcount 0");
    }
    ++ops_;
    if (--refcount_[b] != 0) return;
    if (hashed_[b] != 0) {
      evict_.insert(b);
    } else {
      free_.push_back(b);
    }
  }

  /// Mark held block `b` as carrying a block hash (`true`) or not. Once hashed, the block becomes cached instead of
  /// free when released. Throws kBlockOutOfRange, or kInvalidArgument if b is not held.
  void set_hashed(Id b, bool hashed) {
    check_range(b, "set_hashed");
    if (refcount_[b] == 0) {
      detail::raise(Errc::kInvalidArgument, "set_hashed: block " + std::to_string(b) + " is not held");
    }
    hashed_[b] = hashed ? 1 : 0;
  }

  /// Drop every hash: cached blocks become free (in least-recently-released order), held blocks lose their mark.
  /// Calls `on_drop(Id)` for every hashed block. Used by reset_prefix_cache.
  template <class OnDrop>
  void clear_hashes(OnDrop&& on_drop) {
    while (auto b = evict_.pop_victim()) {
      hashed_[*b] = 0;
      on_drop(*b);
      free_.push_back(*b);
    }
    for (std::size_t b = 1; b < hashed_.size(); ++b) {
      if (hashed_[b] != 0) {
        hashed_[b] = 0;
        on_drop(static_cast<Id>(b));
      }
    }
  }

 private:
  struct Checked {
    std::size_t n;
  };
  static Checked checked(std::size_t num_blocks) {
    if (num_blocks < 2) {
      detail::raise(Errc::kInvalidArgument,
                    "num_blocks = " + std::to_string(num_blocks) + ": need at least 2 (the null block + one usable)");
    }
    if (num_blocks - 1 > static_cast<std::size_t>(std::numeric_limits<Id>::max() - 1)) {
      detail::raise(Errc::kInvalidArgument, "num_blocks = " + std::to_string(num_blocks) +
                                                " does not fit the block id type (max " +
                                                std::to_string(std::numeric_limits<Id>::max() - 1) + ")");
    }
    return {num_blocks};
  }
  BlockAllocator(Checked c, int)
      : refcount_(c.n, 0), hashed_(c.n, 0), evict_(c.n), next_never_used_(1) {
    free_.reserve(c.n);
  }

  void check_range(Id b, const char* what) const {
    if (b == 0 || b >= refcount_.size()) [[unlikely]] out_of_range(b, what);
  }
  [[noreturn, gnu::cold, gnu::noinline]] void out_of_range(Id b, const char* what) const {
    detail::raise(Errc::kBlockOutOfRange, std::string(what) + ": block id " + std::to_string(b) + " outside [1, " +
                                              std::to_string(refcount_.size()) + ")");
  }

  // Precondition: num_available_blocks() > 0.
  template <class OnEvict>
  Id take_one(OnEvict& on_evict) {
    Id b;
    if (next_never_used_ < refcount_.size()) {
      b = static_cast<Id>(next_never_used_++);
    } else if (!free_.empty()) {
      b = free_.back();
      free_.pop_back();
    } else {
      b = *evict_.pop_victim();
      hashed_[b] = 0;
      ++evictions_;
      on_evict(b);
    }
    refcount_[b] = 1;
    ++ops_;
    return b;
  }

  std::vector<std::uint32_t> refcount_;  // [num_blocks]
  std::vector<std::uint8_t> hashed_;     // [num_blocks] 1 = carries a block hash
  Evict evict_;                          // cached (refcount 0, hashed) blocks
  std::vector<Id> free_;                 // released unhashed blocks (stack)
  std::size_t next_never_used_;          // blocks [next_never_used_, num_blocks) were never handed out
  std::uint64_t evictions_ = 0;
  std::uint64_t ops_ = 0;
};

}  // namespace pagedkv
