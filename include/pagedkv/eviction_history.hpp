// pagedkv/eviction_history.hpp: a bounded record of recently evicted block keys, so that a prefix miss can say
// whether the block it needed was never stored or was evicted, from which tier, and how long ago.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include <pagedkv/hash.hpp>

namespace pagedkv {

/// The tier a block was evicted from.
enum class EvictedTier : std::uint8_t {
  kDevice = 0,  ///< The device pool (the block's hash was dropped when the block was reused).
  kHost = 1,    ///< The host tier (offloaded, then evicted from host memory).
};

/// "device" or "host".
[[nodiscard]] constexpr const char* to_string(EvictedTier t) noexcept {
  return t == EvictedTier::kHost ? "host" : "device";
}

/// One remembered eviction.
struct EvictionRecord {
  EvictedTier tier = EvictedTier::kDevice;
  std::uint32_t group = 0;              ///< The KV-cache group whose block it was.
  std::uint64_t eviction_number = 0;    ///< That tier's evictions before this one (0 = the tier's first).
};

/// Recent evictions (device and host tiers together), keyed by the block's key in its tier's index
/// (`group_block_key(hash, group)`): a direct-mapped table of `capacity` slots (the slot from the key's first 8
/// bytes), each holding the latest eviction whose key maps there, with the key's other 8 bytes as its fingerprint.
/// So `find` names a wrong block only when two keys agree in slot and fingerprint (about 2^-64 per lookup, as likely
/// as a block-hash collision) and always finds the latest eviction, while an older one survives n later evictions
/// with probability about (1 - 1/capacity)^n (e^-1 after `capacity` of them): size it at a few times the pool's block
/// count to tell "evicted" from "never stored" over the pool's turnover. A ghost list in the sense of ARC (Megiddo
/// & Modha, FAST 2003), made direct-mapped so that recording costs one store (an exact LRU ring with a hash table
/// cost 95 ns per eviction in BM_AdmitFreeMissCauses, 1.44x the admission's time: docs/benchmarks.md); used for
/// diagnosis only, it never changes what is cached or evicted. 16 bytes per slot, allocated at construction.
/// Capacity 0 = off: `record` and `find` do nothing. Thread safety: one writer; const calls concurrent with each
/// other only.
class EvictionHistory {
 public:
  /// A history of `capacity` slots (0 = off). Allocates them.
  explicit EvictionHistory(std::size_t capacity) : slots_(capacity) {}

  /// Whether the history is on (capacity > 0).
  [[nodiscard]] bool enabled() const noexcept { return !slots_.empty(); }
  /// Its number of slots.
  [[nodiscard]] std::size_t capacity() const noexcept { return slots_.size(); }
  /// Evictions recorded so far in tier `t` (the next record's eviction_number), counted while the history is on.
  [[nodiscard]] std::uint64_t evictions(EvictedTier t) const noexcept {
    return counts_[static_cast<std::size_t>(t)];
  }

  /// Remember that the block with key `key` of group `group` was evicted from tier `t` now (replacing whatever
  /// eviction its slot held).
  void record(const BlockHash& key, EvictedTier t, std::uint32_t group) noexcept {
    if (slots_.empty()) return;
    const std::uint64_t n = counts_[static_cast<std::size_t>(t)]++;
    slots_[slot_of(key)] = Slot{fingerprint(key), (n << 8) | (std::uint64_t{group & 0x3F} << 1) |
                                                      (t == EvictedTier::kHost ? 1U : 0U) | kUsed};
  }

  /// The latest eviction of `key` if its slot still holds it, or nullopt (never evicted, or overwritten since).
  [[nodiscard]] std::optional<EvictionRecord> find(const BlockHash& key) const noexcept {
    if (slots_.empty()) return std::nullopt;
    const Slot& s = slots_[slot_of(key)];
    if ((s.packed & kUsed) == 0 || s.fingerprint != fingerprint(key)) return std::nullopt;
    EvictionRecord r;
    r.tier = (s.packed & 1U) != 0 ? EvictedTier::kHost : EvictedTier::kDevice;
    r.group = static_cast<std::uint32_t>((s.packed >> 1) & 0x3F);
    r.eviction_number = s.packed >> 8;
    return r;
  }

  /// Forget everything (the counts too).
  void clear() noexcept {
    for (Slot& s : slots_) s = Slot{};
    counts_ = {};
  }

 private:
  struct Slot {
    std::uint64_t fingerprint = 0;  // the key's second 8 bytes
    std::uint64_t packed = 0;       // eviction_number << 8 | used << 7 | group (6 bits: < kMaxGroups) << 1 | host
  };
  static constexpr std::uint64_t kUsed = std::uint64_t{1} << 7;
  // Fastrange (Lemire) over the key's first 8 bytes.
  [[nodiscard]] std::size_t slot_of(const BlockHash& key) const noexcept {
    __extension__ using u128 = unsigned __int128;
    return static_cast<std::size_t>((static_cast<u128>(key.low64()) * slots_.size()) >> 64);
  }
  [[nodiscard]] static std::uint64_t fingerprint(const BlockHash& key) noexcept {
    std::uint64_t v;
    std::memcpy(&v, key.bytes.data() + 8, sizeof v);
    return v;
  }
  std::vector<Slot> slots_;                // [capacity]
  std::array<std::uint64_t, 2> counts_{};  // per tier
};

}  // namespace pagedkv
