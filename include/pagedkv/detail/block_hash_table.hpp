// pagedkv/detail/block_hash_table.hpp: the open-addressing table behind PrefixHashIndex: block ids keyed by the
// 128-bit block hash that the index stores once per block (so a slot is an id plus one control byte).
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <pagedkv/config.hpp>
#include <pagedkv/hash.hpp>

namespace pagedkv::detail {

/// A fixed-capacity set of block ids, looked up by the block's hash, in the style of a Swiss table (Abseil's
/// flat_hash_map, Google 2017): slots in groups of 12 with one control byte each (empty, deleted, or 7 bits of the
/// hash), a group's control bytes, its overflow byte and its 12 ids in one 64-byte cache line; a lookup compares
/// the group's control bytes at once (SSE2) and touches the per-block hash array only on a 7-bit match, so a hit
/// costs two cache lines (the group, the key) and most misses one. The keys are not stored: `hashes[id]` is the
/// key of `id` (the index's own per-block array), so with at most 80% of the slots live the table takes
/// 64 / (12 * 0.8) = 6.7 bytes per entry of capacity for 32-bit ids. (Groups of 16 with control bytes, ids and
/// overflow bits in three arrays took 6.3 bytes but three lines per probe: 1.3-2x slower finds in a table larger
/// than the caches, docs/benchmarks.md.) (At 87.5%, Abseil's
/// load, the eviction churn of a full prefix cache left so few free slots that tombstones forced an in-place
/// rehash every ~25k evictions; at 80% every ~100k: docs/benchmarks.md.)
///
/// Why not a library map: the generic maps store the 16-byte key in every bucket beside the block's own copy of it
/// (32-64 bytes per block with tsl::hopscotch_map), which is what kept the prefix index of a 1e7-token pool out of
/// the L3 cache (docs/benchmarks.md); a map of ids keyed through an external array is not something the packaged
/// maps offer without storing the key or its hash again.
///
/// Probing: group-aligned, from the home group fastrange(low64 of the hash, groups), then the following groups
/// (wrapping). Each group has an "overflowed" bit, set when an insert passes over it because it is full; a lookup
/// stops at the first group without the bit (most lookups, hits and misses alike, read one group). Deletion writes
/// "empty" in a group that never overflowed (no probe passes it), else a tombstone; inserts reuse a tombstone of
/// their first group with room before an empty slot, and an in-place rehash, O(capacity) with no allocation, drops
/// the tombstones and recomputes the bits when live + tombstones would fill 15/16 of the slots (amortized O(1): at
/// least capacity/16 erases separate two rehashes).
/// Capacity is fixed at construction (the index never holds more entries than the pool has blocks), so nothing
/// ever allocates after construction and no operation throws.
/// Thread safety: const members may run concurrently with each other; no concurrent writer.
template <BlockIdType Id>
class BlockHashTable {
 public:
  /// Slots per group: the 12 control bytes, the group's overflow byte and 12 32-bit ids fill one 64-byte line.
  static constexpr std::size_t kGroup = 12;

  /// A table for up to `max_entries` ids.
  explicit BlockHashTable(std::size_t max_entries)
      : groups_(std::max<std::size_t>(1, (max_entries * 5 + 4 * kGroup - 1) / (4 * kGroup))), g_(groups_) {}

  /// The id whose key `hashes[id]` equals `h`, or 0 (not present). One probe sequence; O(1) expected.
  [[nodiscard]] Id find(const BlockHash& h, const BlockHash* hashes) const noexcept {
    const std::uint8_t h2 = tag(h);
    std::size_t g = home(h);
    for (std::size_t n = 0; n < groups_; ++n) {
      const Group& gr = g_[g];
      for (std::uint32_t m = match(gr, h2); m != 0; m &= m - 1) {
        const Id id = gr.ids[std::countr_zero(m)];
        if (hashes[id] == h) return id;
      }
      if (gr.ctrl[kOverflow] == 0) return Id{0};
      g = g + 1 == groups_ ? 0 : g + 1;
    }
    return Id{0};
  }

  /// Insert `id`, whose key `hashes[id]` is `h`, unless an id with key `h` is present: returns that id, or `id`
  /// when inserted. Precondition: fewer than the construction's max_entries ids are present.
  [[gnu::always_inline]] Id insert(const BlockHash& h, Id id, const BlockHash* hashes) noexcept {
    if (size_ + tombstones_ + 1 > max_fill()) rehash_in_place(hashes);
    const std::uint8_t h2 = tag(h);
    std::size_t g = home(h);
    Group* tg = nullptr;
    std::size_t ti = 0;
    for (std::size_t n = 0; n < groups_; ++n) {
      Group& gr = g_[g];
      for (std::uint32_t m = match(gr, h2); m != 0; m &= m - 1) {
        const Id other = gr.ids[std::countr_zero(m)];
        if (hashes[other] == h) return other;
      }
      if (tg == nullptr) {  // the first group with room; a tombstone there is reused before an empty slot
        const std::uint32_t dead = match(gr, kDeleted);
        const std::uint32_t avail = dead != 0 ? dead : available(gr);
        if (avail != 0) {
          tg = &gr;
          ti = static_cast<std::size_t>(std::countr_zero(avail));
        } else {
          gr.ctrl[kOverflow] = 1;  // full: this insert's probe passes it
        }
      }
      if (gr.ctrl[kOverflow] == 0) break;  // no key with h can be further along
      g = g + 1 == groups_ ? 0 : g + 1;
    }
    if (tg->ctrl[ti] == kDeleted) --tombstones_;
    tg->ctrl[ti] = h2;
    tg->ids[ti] = id;
    ++size_;
    return id;
  }

  /// Remove `id`, whose key is `h`. Returns whether it was present.
  bool erase(const BlockHash& h, Id id) noexcept {
    const std::uint8_t h2 = tag(h);
    std::size_t g = home(h);
    for (std::size_t n = 0; n < groups_; ++n) {
      Group& gr = g_[g];
      for (std::uint32_t m = match(gr, h2); m != 0; m &= m - 1) {
        const auto i = static_cast<std::size_t>(std::countr_zero(m));
        if (gr.ids[i] != id) continue;
        // Empty is safe only if no probe ever passed this group.
        if (gr.ctrl[kOverflow] == 0) {
          gr.ctrl[i] = kEmpty;
        } else {
          gr.ctrl[i] = kDeleted;
          ++tombstones_;
        }
        --size_;
        return true;
      }
      if (gr.ctrl[kOverflow] == 0) return false;
      g = g + 1 == groups_ ? 0 : g + 1;
    }
    return false;
  }

  /// Hint the CPU to load the home group of `h` (its control bytes and ids: one cache line) ahead of a find or
  /// insert.
  void prefetch(const BlockHash& h) const noexcept { __builtin_prefetch(&g_[home(h)]); }

  /// Remove every id.
  void clear() noexcept {
    for (Group& gr : g_) gr.reset();
    size_ = tombstones_ = 0;
  }

  /// Ids present.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Slots (groups * kGroup).
  [[nodiscard]] std::size_t capacity() const noexcept { return groups_ * kGroup; }
  /// Bytes of the table (the groups).
  [[nodiscard]] std::size_t memory_bytes() const noexcept { return groups_ * sizeof(Group); }
  /// In-place rehashes so far (tombstone cleanups).
  [[nodiscard]] std::uint64_t num_rehashes() const noexcept { return rehashes_; }

 private:
  static constexpr std::uint8_t kEmpty = 0x80;
  static constexpr std::uint8_t kDeleted = 0xFE;
  static constexpr std::size_t kOverflow = kGroup;  // ctrl[12]: 1 = an insert passed this group since the rehash
  static constexpr std::uint32_t kSlotMask = (1U << kGroup) - 1;

  // One probe unit: ctrl[0, 12) control bytes (kEmpty, kDeleted or the tag of a live slot), ctrl[12] the overflow
  // byte, ctrl[13, 16) unused (0); then the ids. 64 bytes (one cache line) for 32-bit ids.
  struct alignas(64) Group {
    std::uint8_t ctrl[16];
    Id ids[kGroup];
    Group() noexcept { reset(); }
    void reset() noexcept {
      std::fill(ctrl, ctrl + kGroup, kEmpty);
      std::fill(ctrl + kGroup, ctrl + 16, std::uint8_t{0});
      std::fill(ids, ids + kGroup, Id{0});
    }
  };
  static_assert(sizeof(Id) != 4 || sizeof(Group) == 64, "a group of 32-bit ids is one cache line");

  [[nodiscard]] std::size_t max_fill() const noexcept { return capacity() - capacity() / 16; }
  // Fastrange (Lemire): the high 64 bits of low64 * groups. `__extension__` keeps -Wpedantic consumers quiet.
  [[nodiscard]] std::size_t home(const BlockHash& h) const noexcept {
    __extension__ using u128 = unsigned __int128;
    return static_cast<std::size_t>((static_cast<u128>(h.low64()) * groups_) >> 64);
  }
  // 7 bits of the hash independent of the home group's (the hash's second half).
  [[nodiscard]] static std::uint8_t tag(const BlockHash& h) noexcept { return h.bytes[8] & 0x7F; }

  // Bit i (i < 12) set where ctrl[i] == c.
  [[nodiscard]] static std::uint32_t match(const Group& gr, std::uint8_t c) noexcept {
#if defined(__SSE2__)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gr.ctrl));
    return static_cast<std::uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(static_cast<char>(c))))) &
           kSlotMask;
#else
    std::uint32_t m = 0;
    for (std::size_t i = 0; i < kGroup; ++i) m |= static_cast<std::uint32_t>(gr.ctrl[i] == c) << i;
    return m;
#endif
  }
  // Bit i set where ctrl[i] is empty or deleted (the high bit: full tags are 0..127).
  [[nodiscard]] static std::uint32_t available(const Group& gr) noexcept {
#if defined(__SSE2__)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(gr.ctrl));
    return static_cast<std::uint32_t>(_mm_movemask_epi8(v)) & kSlotMask;
#else
    std::uint32_t m = 0;
    for (std::size_t i = 0; i < kGroup; ++i) m |= static_cast<std::uint32_t>(gr.ctrl[i] >> 7) << i;
    return m;
#endif
  }

  // Drop the tombstones without allocating (Abseil's "drop deletes without resize"): every live slot is marked
  // unplaced (kDeleted), every tombstone freed (kEmpty); then each unplaced id moves to the first available slot of
  // its probe sequence: it stays if that slot is in its own group, moves if the slot is empty, or swaps with the
  // unplaced id there and that one is placed next.
  void rehash_in_place(const BlockHash* hashes) noexcept {
    for (Group& gr : g_) {
      for (std::size_t i = 0; i < kGroup; ++i) gr.ctrl[i] = (gr.ctrl[i] & 0x80) != 0 ? kEmpty : kDeleted;
      gr.ctrl[kOverflow] = 0;
    }
    for (std::size_t gi = 0; gi < groups_; ++gi) {
      Group& cur = g_[gi];
      for (std::size_t i = 0; i < kGroup; ++i) {
        while (cur.ctrl[i] == kDeleted) {
          const BlockHash& h = hashes[cur.ids[i]];
          std::size_t g = home(h);
          std::size_t tgi = groups_;
          std::size_t ti = 0;
          for (std::size_t n = 0; n < groups_ && tgi == groups_; ++n) {
            const std::uint32_t avail = available(g_[g]);
            if (avail != 0) {
              tgi = g;
              ti = static_cast<std::size_t>(std::countr_zero(avail));
            } else {
              g_[g].ctrl[kOverflow] = 1;  // full (of placed or still unplaced ids): this id's probe passes it
            }
            g = g + 1 == groups_ ? 0 : g + 1;
          }
          Group& t = g_[tgi];
          if (tgi == gi) {  // already in the first group with room: stays
            cur.ctrl[i] = tag(h);
          } else if (t.ctrl[ti] == kEmpty) {  // move
            t.ids[ti] = cur.ids[i];
            t.ctrl[ti] = tag(h);
            cur.ctrl[i] = kEmpty;
          } else {  // swap with another unplaced id, then place that one (loop)
            std::swap(t.ids[ti], cur.ids[i]);
            t.ctrl[ti] = tag(h);
          }
        }
      }
    }
    tombstones_ = 0;
    ++rehashes_;
  }

  std::size_t groups_;
  std::vector<Group> g_;  // [groups_]
  std::size_t size_ = 0;
  std::size_t tombstones_ = 0;
  std::uint64_t rehashes_ = 0;
};

}  // namespace pagedkv::detail
