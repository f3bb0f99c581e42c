// pagedkv/host_tier.hpp: the host-memory tier of a KV cache: a second pool of blocks in (pinned) host memory with
// its own allocator, eviction order and prefix index, holding blocks offloaded from the device pool so that they
// stay matchable (TensorRT-LLM's secondary pool, SGLang's HiCache host layer, vLLM's CPU offloading).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

#include <pagedkv/block_allocator.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/prefix_hash_index.hpp>

namespace pagedkv {

/// The host tier: `num_blocks` host blocks (the null block 0 included), refcounts, an eviction policy over cached
/// host blocks, and a prefix index keyed by the same block hashes as the device pool's (same hasher, same seed:
/// salt and every extra key are part of the key in both tiers, because both are keyed by the one hash).
///
/// A host block is *registered* under a hash as soon as a copy into it is queued (so no second copy of that hash
/// is queued) and *ready* once the engine acknowledged the copy that fills it (registered or not: a swapped
/// sequence's partial block is ready too); only ready blocks serve prefix hits or resume a swapped sequence. Holders of a host block: the transfers reading or filling it (until
/// acknowledged) and the swapped sequences whose table holds it.
/// Thread safety: none (the manager's single writer). Memory: the allocator's 12 bytes + the index's 22.8 bytes +
/// 1 bit per host block.
template <BlockHasher Hasher, BlockIdType Id = std::uint32_t, EvictionPolicy<Id> Evict = LruEviction<Id>>
class HostTier {
 public:
  using allocator_type = BlockAllocator<Id, Evict>;
  using index_type = PrefixHashIndex<Hasher, Id>;

  /// A tier of `num_blocks` host blocks (>= 2: the null block + one usable), keyed under the chain seed `seed`.
  /// Throws kInvalidArgument as BlockAllocator.
  HostTier(std::size_t num_blocks, std::uint64_t seed)
      : alloc_(num_blocks), index_(num_blocks, seed), ready_((num_blocks + 63) / 64, 0) {}

  /// The ready block registered under `h` (a host-tier prefix hit), or nullopt.
  [[nodiscard]] std::optional<Id> find_ready(const BlockHash& h) const {
    const auto b = index_.find(h);
    if (!b || !is_ready(*b)) return std::nullopt;
    return b;
  }
  /// The block registered under `h`, ready or still being filled, or nullopt.
  [[nodiscard]] std::optional<Id> find(const BlockHash& h) const { return index_.find(h); }
  /// Hint the CPU to load what `find(h)` touches first.
  void prefetch(const BlockHash& h) const noexcept { index_.prefetch(h); }

  /// Allocate one host block held once by the caller (refcount 1), evicting the least valuable cached host block
  /// if needed (`on_evict(Id, const BlockHash&)` is called for it after its hash was dropped). With `h`, the block
  /// is registered under it, not ready. Returns nullopt when every host block is held (nothing changed).
  /// Precondition: no block is registered under `h`.
  template <class OnEvict>
  [[nodiscard]] std::optional<Id> allocate(const BlockHash* h, OnEvict&& on_evict) {
    const auto b = alloc_.try_allocate_one([&](Id victim) {
      const auto dropped = index_.erase_block(victim);
      ready_[victim / 64] &= ~(std::uint64_t{1} << (victim % 64));
      if (dropped) on_evict(victim, *dropped);
    });
    if (!b) return std::nullopt;
    ready_[*b / 64] &= ~(std::uint64_t{1} << (*b % 64));
    if (h != nullptr) {
      index_.insert(*h, *b);
      alloc_.set_hashed(*b, true);
    }
    return b;
  }

  /// Retention priority held block `b` takes when it is next cached (BlockAllocator::set_retention_priority; a
  /// no-op unless `Evict` is a RetentionEvictionPolicy). Throws as that call.
  void set_retention_priority(Id b, std::uint8_t priority, std::optional<RetentionTimePoint> expires_at) {
    alloc_.set_retention_priority(b, priority, expires_at);
  }
  /// Expire retention priorities at `now` (BlockAllocator::expire_retention); returns how many cached blocks moved.
  std::size_t expire_retention(RetentionTimePoint now) { return alloc_.expire_retention(now); }
  /// Mark held block `b` ready (its filling copy completed): registered, it now serves hits.
  void mark_ready(Id b) noexcept { ready_[b / 64] |= std::uint64_t{1} << (b % 64); }
  /// Whether `b` is ready (registered and filled).
  [[nodiscard]] bool is_ready(Id b) const noexcept { return ((ready_[b / 64] >> (b % 64)) & 1U) != 0; }

  /// One more holder of held or cached block `b`. Throws as BlockAllocator::acquire.
  void acquire(Id b) { alloc_.acquire(b); }
  /// One holder less. At refcount 0 a registered block becomes cached (evictable), an unregistered one free.
  void release(Id b) { alloc_.release(b); }

  /// Drop every hash: cached host blocks become free. Precondition: no host block is held.
  template <class OnDrop>
  void clear(OnDrop&& on_drop) {
    alloc_.clear_hashes([&](Id b) {
      if (const auto h = index_.hash_of(b)) on_drop(b, *h);
    });
    index_.clear();
    std::fill(ready_.begin(), ready_.end(), std::uint64_t{0});
  }

  /// The allocator (read-only: refcounts, states, eviction order).
  [[nodiscard]] const allocator_type& allocator() const noexcept { return alloc_; }
  /// The index (read-only).
  [[nodiscard]] const index_type& index() const noexcept { return index_; }

 private:
  allocator_type alloc_;
  index_type index_;
  std::vector<std::uint64_t> ready_;  // [ceil(num_blocks / 64)]
};

}  // namespace pagedkv
