// pagedkv/block_allocator.hpp: the fixed pool of physical KV blocks with refcounts and eviction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
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
/// Allocation order (docs/contract.md sec. 2): never-used blocks first in increasing id order; then released
/// unhashed blocks, most recently released first; then the eviction policy's victim (LRU: least recently released
/// cached block), whose hash the caller drops through the `on_evict` callback before the block is reused.
///
/// Cost: every operation O(1) (multi-block calls O(n)); nothing allocates after construction.
/// Memory: one state word per block (4 bytes for ids up to 32 bits: the refcount and the hash mark of a held or
/// cached block, or the next link of the free stack, which is threaded through the words of free blocks) plus the
/// eviction policy's (8 bytes for LruEviction<uint32_t>): 12 bytes per block. A KVCacheManager adds the
/// PrefixHashIndex (see there).
/// Limits: at most 2^31 blocks (the free-stack links) and 2^30 - 1 references per block with 32-bit ids (a
/// further acquire is kLimitExceeded).
/// Thread safety: none; one writer (the scheduler thread). Errors: misuse throws `pagedkv::Error` and changes
/// nothing (strong guarantee).
template <BlockIdType Id = std::uint32_t, EvictionPolicy<Id> Evict = LruEviction<Id>>
class BlockAllocator {
  using word_type = std::conditional_t<(sizeof(Id) <= 4), std::uint32_t, std::uint64_t>;
  static constexpr unsigned kWordBits = sizeof(word_type) * 8;
  static constexpr word_type kFreeBit = word_type{1} << (kWordBits - 1);    // on the free stack; rest = next link
  static constexpr word_type kHashedBit = word_type{1} << (kWordBits - 2);  // held or cached: carries a hash
  static constexpr word_type kRefMask = kHashedBit - 1;                     // held or cached: the refcount

 public:
  using block_id_type = Id;
  using eviction_policy_type = Evict;

  /// Most references one block can carry (2^30 - 1 with 32-bit ids).
  static constexpr std::size_t kMaxRefcount = static_cast<std::size_t>(kRefMask);

  /// A pool of `num_blocks` blocks, including the null block 0 (so `num_blocks - 1` are usable).
  /// Throws kInvalidArgument if num_blocks < 2 or does not fit `Id` (or the free-stack links).
  explicit BlockAllocator(std::size_t num_blocks) : BlockAllocator(checked(num_blocks), 0) {}

  /// Pool size in blocks, including the null block.
  [[nodiscard]] std::size_t num_blocks() const noexcept { return state_.size(); }
  /// Blocks that can ever be handed out: num_blocks() - 1.
  [[nodiscard]] std::size_t num_usable_blocks() const noexcept { return state_.size() - 1; }
  /// Free blocks (never used, or released without a hash).
  [[nodiscard]] std::size_t num_free_blocks() const noexcept {
    return (state_.size() - next_never_used_) + num_released_free_;
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
    return static_cast<std::uint32_t>(ref_of(state_[b]));
  }
  /// Whether block `b` carries a block hash (registered in a prefix index). Throws kBlockOutOfRange.
  [[nodiscard, gnu::always_inline]] bool is_hashed(Id b) const {
    check_range(b, "is_hashed");
    return hashed_of(state_[b]);
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
  /// evictable set. Throws kBlockOutOfRange (b == 0 or b >= num_blocks), kInvalidArgument (b is free),
  /// kLimitExceeded (b already carries kMaxRefcount references).
  void acquire(Id b) {
    check_range(b, "acquire");
    const word_type w = state_[b];
    if (is_free_word(b, w)) {
      detail::raise(Errc::kInvalidArgument, "acquire: block " + std::to_string(b) + " is free, not held or cached");
    }
    if ((w & kRefMask) == kRefMask) {
      detail::raise(Errc::kLimitExceeded, "acquire: block " + std::to_string(b) + " already carries " +
                                              std::to_string(kMaxRefcount) + " references (the refcount limit)");
    }
    if ((w & kRefMask) == 0) evict_.erase(b);  // cached -> held
    state_[b] = w + 1;
    ++ops_;
  }

  /// Drop one reference. At refcount 0 a hashed block becomes cached (most recently released), an unhashed one
  /// free. Throws kBlockOutOfRange, or kDoubleFree when the refcount is already 0.
  [[gnu::always_inline]] void release(Id b) {
    check_range(b, "release");
    const word_type w = state_[b];
    if (ref_of(w) == 0) {
      detail::raise(Errc::kDoubleFree, "release: block " + std::to_string(b) + " has refcount 0");
    }
    ++ops_;
    state_[b] = w - 1;
    if (((w - 1) & kRefMask) != 0) return;
    if ((w & kHashedBit) != 0) {
      evict_.insert(b);
    } else {
      // Unhashed blocks carry no history; a priority assigned while held must not reach the block's next content.
      if constexpr (ForgettingEvictionPolicy<Evict, Id>) evict_.forget(b);
      push_free(b);
    }
  }

  /// Mark held block `b` as carrying a block hash (`true`) or not. Once hashed, the block becomes cached instead of
  /// free when released. Throws kBlockOutOfRange, or kInvalidArgument if b is not held.
  void set_hashed(Id b, bool hashed) {
    check_range(b, "set_hashed");
    if (ref_of(state_[b]) == 0) {
      detail::raise(Errc::kInvalidArgument, "set_hashed: block " + std::to_string(b) + " is not held");
    }
    const bool was = (state_[b] & kHashedBit) != 0;
    state_[b] = hashed ? (state_[b] | kHashedBit) : (state_[b] & ~kHashedBit);
    if (was && !hashed) forget_block(evict_, b);  // its content's history (hits, priority) must not outlive it
  }

  /// Retention priority block `b` takes when it is next cached (TensorRT-LLM's retention priorities): forwards to
  /// the policy's `set_priority` for a RetentionEvictionPolicy, does nothing for other policies. `priority` in
  /// [0, 100]; `expires_at`: when it falls back to kDefaultRetentionPriority (nullopt: never). Throws
  /// kBlockOutOfRange, kInvalidArgument (b is free or cached: set it while the block is held, before the release
  /// that caches it; priority > 100). O(1) (O(log n) with an expiry in PriorityLruEviction).
  void set_retention_priority(Id b, std::uint8_t priority, std::optional<RetentionTimePoint> expires_at) {
    check_range(b, "set_retention_priority");
    if (ref_of(state_[b]) == 0) {
      detail::raise(Errc::kInvalidArgument,
                    "set_retention_priority: block " + std::to_string(b) + " is not held (free or cached)");
    }
    set_block_priority(evict_, b, priority, expires_at);
  }

  /// Retention clock tick: every cached block whose priority expired at or before `now` falls back to the default
  /// priority (PriorityLruEviction::expire); returns how many moved, 0 for policies without priorities.
  std::size_t expire_retention(RetentionTimePoint now) { return expire_priorities(evict_, now); }

  /// Retention priority the last block evicted by an allocation had (kDefaultRetentionPriority for policies
  /// without priorities). Valid inside the allocation's `on_evict` callback: e.g. offload only blocks at or above
  /// a minimum priority.
  [[nodiscard]] std::uint8_t last_evicted_priority() const noexcept { return last_evicted_priority_; }

  /// Drop every hash: cached blocks become free (in least-recently-released order), held blocks lose their mark.
  /// Calls `on_drop(Id)` for every hashed block. Used by reset_prefix_cache.
  template <class OnDrop>
  void clear_hashes(OnDrop&& on_drop) {
    while (auto b = evict_.pop_victim()) {
      on_drop(*b);
      push_free(*b);
    }
    for (std::size_t b = 1; b < next_never_used_; ++b) {
      const word_type w = state_[b];
      if (!is_free_word(static_cast<Id>(b), w) && (w & kHashedBit) != 0) {
        state_[b] = w & ~kHashedBit;
        forget_block(evict_, static_cast<Id>(b));
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
    const std::size_t max_id = std::min<std::size_t>(std::numeric_limits<Id>::max() - 1,
                                                     static_cast<std::size_t>(kFreeBit - 1));
    if (num_blocks - 1 > max_id) {
      detail::raise(Errc::kInvalidArgument, "num_blocks = " + std::to_string(num_blocks) +
                                                " does not fit the block id type (max " + std::to_string(max_id) +
                                                ")");
    }
    return {num_blocks};
  }
  BlockAllocator(Checked c, int) : state_(c.n, 0), evict_(c.n), next_never_used_(1) {}

  void check_range(Id b, const char* what) const {
    if (b == 0 || b >= state_.size()) [[unlikely]] out_of_range(b, what);
  }
  [[noreturn, gnu::cold, gnu::noinline]] void out_of_range(Id b, const char* what) const {
    detail::raise(Errc::kBlockOutOfRange, std::string(what) + ": block id " + std::to_string(b) + " outside [1, " +
                                              std::to_string(state_.size()) + ")");
  }

  [[nodiscard]] static word_type ref_of(word_type w) noexcept { return (w & kFreeBit) != 0 ? 0 : (w & kRefMask); }
  [[nodiscard]] static bool hashed_of(word_type w) noexcept { return (w & (kFreeBit | kHashedBit)) == kHashedBit; }
  // Free (never used, or on the free stack).
  [[nodiscard]] bool is_free_word(Id b, word_type w) const noexcept {
    return (w & kFreeBit) != 0 || b >= next_never_used_;
  }

  void push_free(Id b) noexcept {
    state_[b] = kFreeBit | static_cast<word_type>(free_head_);
    free_head_ = b;
    ++num_released_free_;
  }

  // Precondition: num_available_blocks() > 0.
  template <class OnEvict>
  Id take_one(OnEvict& on_evict) {
    Id b;
    if (next_never_used_ < state_.size()) {
      b = static_cast<Id>(next_never_used_++);
    } else if (num_released_free_ != 0) {
      b = free_head_;
      free_head_ = static_cast<Id>(state_[b] & ~kFreeBit);
      --num_released_free_;
    } else {
      if constexpr (requires(const Evict& e, Id v) {
                      { e.peek_victim() } -> std::convertible_to<Id>;
                      { e.priority(v) } -> std::convertible_to<std::uint8_t>;
                    }) {
        last_evicted_priority_ = evict_.priority(evict_.peek_victim());
      }
      b = *evict_.pop_victim();
      ++evictions_;
      on_evict(b);
    }
    state_[b] = 1;  // held once, no hash
    ++ops_;
    return b;
  }

  std::vector<word_type> state_;     // [num_blocks] see kFreeBit / kHashedBit / kRefMask
  Evict evict_;                      // cached (refcount 0, hashed) blocks
  Id free_head_ = 0;                 // top of the free stack (released unhashed blocks), threaded through state_
  std::size_t num_released_free_ = 0;
  std::size_t next_never_used_;      // blocks [next_never_used_, num_blocks) were never handed out
  std::uint64_t evictions_ = 0;
  std::uint64_t ops_ = 0;
  std::uint8_t last_evicted_priority_ = kDefaultRetentionPriority;
};

}  // namespace pagedkv
