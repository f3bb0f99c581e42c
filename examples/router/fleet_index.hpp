// examples/router/fleet_index.hpp: the router's view of the fleet's prefix caches, built from the engines' KV
// events alone: wire block key -> bit mask of the instances that hold the block.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace router {

/// Byte counters shared by the copies of one CountingAllocator (its container's nodes and buckets).
struct ByteCount {
  std::size_t current = 0;
  std::size_t peak = 0;
};

/// A std::allocator that counts the bytes its container holds, so the index reports its real memory (nodes and
/// bucket array), not an estimate.
template <class T>
struct CountingAllocator {
  using value_type = T;
  ByteCount* count;
  explicit CountingAllocator(ByteCount* c) noexcept : count(c) {}
  template <class U>
  CountingAllocator(const CountingAllocator<U>& o) noexcept : count(o.count) {}  // NOLINT: rebinding
  T* allocate(std::size_t n) {
    count->current += n * sizeof(T);
    count->peak = std::max(count->peak, count->current);
    return std::allocator<T>().allocate(n);
  }
  void deallocate(T* p, std::size_t n) noexcept {
    count->current -= n * sizeof(T);
    std::allocator<T>().deallocate(p, n);
  }
  template <class U>
  bool operator==(const CountingAllocator<U>& o) const noexcept {
    return count == o.count;
  }
};

/// Which instances hold which blocks, by wire key (pagedkv::events::WireHash::key, 64 bits).
/// stored / removed / cleared come from each instance's event stream (EventStreamFollower callbacks); match()
/// answers, for a prompt's chain of block keys, how many leading blocks each instance holds. Up to 64 instances.
/// Memory: one hash-map node per distinct block cached anywhere in the fleet (key + mask + node overhead), counted
/// exactly by bytes(). Thread safety: none (the router's thread).
class FleetIndex {
 public:
  explicit FleetIndex(std::size_t num_instances)
      : held_(num_instances, 0), map_(16, std::hash<std::uint64_t>(), std::equal_to<>(), Alloc(&bytes_)) {
    if (num_instances == 0 || num_instances > 64) {
      throw std::invalid_argument("FleetIndex: " + std::to_string(num_instances) + " instances (1..64 supported)");
    }
  }

  /// Instance `i` stored block `key` (idempotent).
  void stored(std::size_t i, std::uint64_t key) {
    std::uint64_t& m = map_[key];
    if ((m & bit(i)) == 0) ++held_[i];
    m |= bit(i);
  }

  /// Instance `i` removed block `key`; false when the index did not have it there (a stream inconsistency).
  bool removed(std::size_t i, std::uint64_t key) {
    const auto it = map_.find(key);
    if (it == map_.end() || (it->second & bit(i)) == 0) return false;
    it->second &= ~bit(i);
    --held_[i];
    if (it->second == 0) map_.erase(it);
    return true;
  }

  /// Instance `i` dropped every block (AllBlocksCleared, or the start of a snapshot). O(index).
  void cleared(std::size_t i) {
    for (auto it = map_.begin(); it != map_.end();) {
      it->second &= ~bit(i);
      it = it->second == 0 ? map_.erase(it) : std::next(it);
    }
    held_[i] = 0;
  }

  /// For each instance, the number of leading blocks of `keys` (a prompt's block chain) it holds, into
  /// `prefix_blocks` (`[num_instances]`). O(blocks matched by anyone + instances).
  void match(std::span<const std::uint64_t> keys, std::span<std::size_t> prefix_blocks) const {
    std::uint64_t alive = held_.size() == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << held_.size()) - 1;
    std::fill(prefix_blocks.begin(), prefix_blocks.end(), keys.size());
    for (std::size_t j = 0; j < keys.size() && alive != 0; ++j) {
      const auto it = map_.find(keys[j]);
      const std::uint64_t has = it == map_.end() ? 0 : it->second;
      std::uint64_t lost = alive & ~has;
      while (lost != 0) {
        const int i = std::countr_zero(lost);
        prefix_blocks[static_cast<std::size_t>(i)] = j;
        lost &= lost - 1;
      }
      alive &= has;
    }
  }

  [[nodiscard]] std::size_t entries() const noexcept { return map_.size(); }
  [[nodiscard]] std::size_t held(std::size_t i) const noexcept { return held_[i]; }
  [[nodiscard]] std::size_t bytes() const noexcept { return bytes_.current; }
  [[nodiscard]] std::size_t peak_bytes() const noexcept { return bytes_.peak; }
  [[nodiscard]] std::size_t peak_entries() const noexcept { return peak_entries_; }
  void note_peak() noexcept { peak_entries_ = std::max(peak_entries_, map_.size()); }

 private:
  using Alloc = CountingAllocator<std::pair<const std::uint64_t, std::uint64_t>>;
  static std::uint64_t bit(std::size_t i) noexcept { return std::uint64_t{1} << i; }

  ByteCount bytes_;
  std::vector<std::size_t> held_;
  std::size_t peak_entries_ = 0;
  std::unordered_map<std::uint64_t, std::uint64_t, std::hash<std::uint64_t>, std::equal_to<>, Alloc> map_;
};

}  // namespace router
