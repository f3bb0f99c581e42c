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
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <pagedkv/block_identity.hpp>
#include <pagedkv/events_zmq/wire.hpp>

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

/// Which instances hold which blocks, by 64-bit block key (the router uses Dynamo's sequence hashes, DynamoKeys).
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

/// The router's block keys: NVIDIA Dynamo's sequence hashes (pagedkv/block_identity.hpp), recomputed from each
/// BlockStored's token ids as Dynamo's KV router does (lib/kv-router zmq_wire: tokens hash XXH3 seeded with 1337,
/// the event's lora_name and its "dynamo-cache-salt:" namespace, 64-hex multimodal ids as the u64 of their first
/// 16 digits; sequence hash chained from the parent's), so the index needs neither the engines' hasher nor their
/// seed, and a prompt is scored by `identity::dynamo_request_hashes`. Per instance: the engine's block key (wire
/// key) -> Dynamo key, to chain a stored block to its parent and to remove by the engine's key.
/// Thread safety: none (the router's thread).
class DynamoKeys {
 public:
  explicit DynamoKeys(std::size_t num_instances) : of_(num_instances) {}

  /// The Dynamo keys of the blocks of `s` stored by instance `i`, in order, remembered for later removals and
  /// children; empty (and `false`) when the event's parent is unknown, as Dynamo drops such an event.
  bool stored(std::size_t i, const pagedkv::events::WireBlockStored& s, std::vector<std::uint64_t>& keys) {
    namespace id = pagedkv::identity;
    keys.clear();
    auto& m = of_[i];
    std::optional<std::uint64_t> parent;
    if (s.parent_block_hash) {
      const auto it = m.find(s.parent_block_hash->key);
      if (it == m.end()) return false;
      parent = it->second;
    }
    const std::uint64_t seed = id::dynamo_salt_hash(s.lora_name.value_or(""), cache_namespace(s));
    std::vector<std::uint32_t> tokens;
    std::vector<std::uint64_t> mm;
    for (std::size_t b = 0; b < s.block_hashes.size(); ++b) {
      const auto t = s.block_tokens(b);
      tokens.assign(t.begin(), t.end());
      mm.clear();
      if (!s.extra_keys.empty() && s.extra_keys[b]) {
        for (const auto& k : *s.extra_keys[b]) {
          if (k.kind == pagedkv::events::WireExtraKey::Kind::kIdentifierWithOffset && k.text.size() == 64 &&
              k.text.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos) {
            mm.push_back(std::stoull(k.text.substr(0, 16), nullptr, 16));
          }
        }
        std::sort(mm.begin(), mm.end());
      }
      const std::uint64_t th = id::dynamo_tokens_hash(tokens, seed, mm);
      parent = parent ? id::dynamo_sequence_hash(*parent, th) : th;
      m[s.block_hashes[b].key] = *parent;
      keys.push_back(*parent);
    }
    return true;
  }

  /// The Dynamo key of instance `i`'s block `engine_key`, forgotten; nullopt when unknown.
  std::optional<std::uint64_t> removed(std::size_t i, std::uint64_t engine_key) {
    auto& m = of_[i];
    const auto it = m.find(engine_key);
    if (it == m.end()) return std::nullopt;
    const std::uint64_t k = it->second;
    m.erase(it);
    return k;
  }

  /// Instance `i` dropped everything.
  void cleared(std::size_t i) { of_[i].clear(); }

 private:
  /// Dynamo's cache namespace of an event: the first "dynamo-cache-salt:" string of its first block's extra keys,
  /// after skipping the first string equal to lora_name (Dynamo's extra_keys_to_cache_namespace).
  static std::string cache_namespace(const pagedkv::events::WireBlockStored& s) {
    if (s.extra_keys.empty() || !s.extra_keys[0]) return {};
    bool lora_pending = s.lora_name.has_value() && !s.lora_name->empty();
    for (const auto& k : *s.extra_keys[0]) {
      if (k.kind != pagedkv::events::WireExtraKey::Kind::kString) continue;
      if (lora_pending && k.text == *s.lora_name) {
        lora_pending = false;
        continue;
      }
      const std::string_view p = pagedkv::events::kDynamoCacheSaltPrefix;
      if (k.text.size() > p.size() && k.text.compare(0, p.size(), p) == 0) return k.text.substr(p.size());
    }
    return {};
  }

  std::vector<std::unordered_map<std::uint64_t, std::uint64_t>> of_;
};

}  // namespace router
