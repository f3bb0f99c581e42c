// pagedkv/prefix_hash_index.hpp: content-addressed, chained block hashes and the hash -> block index.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include <pagedkv/block_allocator.hpp>
#include <pagedkv/config.hpp>
#include <pagedkv/detail/block_hash_table.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/request_keys.hpp>

namespace pagedkv {

namespace detail {

/// Where the fields of one block's canonical encoding come from, and its size in bytes (see `encode_block`).
struct BlockEncodingLayout {
  std::size_t size_bytes = 0;
  std::uint32_t num_items = 0;  ///< Multimodal items overlapping the block.
  std::string_view salt;        ///< The salt (first block only).
  bool has_keys = false;
};

/// Whether multimodal item `m` overlaps token positions [block_start, block_end). Overflow-free for any item.
[[nodiscard]] inline bool item_overlaps(const MultimodalItem& m, std::uint64_t block_start,
                                        std::uint64_t block_end) noexcept {
  if (m.offset_tokens >= block_end) return false;
  return m.offset_tokens >= block_start || block_start - m.offset_tokens < m.length_tokens;
}

/// The layout of one block's encoding. O(items).
[[nodiscard]] inline BlockEncodingLayout block_encoding_layout(std::size_t num_tokens, std::uint64_t block_start,
                                                               const RequestKeys* keys, bool first_block) noexcept {
  BlockEncodingLayout l;
  l.has_keys = keys != nullptr && !keys->empty();
  if (l.has_keys) {
    const std::uint64_t block_end = block_start + num_tokens;
    for (const auto& m : keys->multimodal) l.num_items += item_overlaps(m, block_start, block_end) ? 1U : 0U;
    if (first_block) l.salt = keys->salt;
  }
  l.size_bytes = 16 + 4 + 4 * num_tokens + 8 + 4 + 24 * std::size_t{l.num_items} + 4 + l.salt.size();
  return l;
}

/// Writes the canonical, little-endian encoding of one block to `w` (`[layout.size_bytes]` bytes; docs/design.md
/// "Block hashes"):
///   parent[16] | u32 num_tokens | i32 tokens[num_tokens] | u64 adapter_id | u32 num_items |
///   (item_hash[16] | i64 item_offset - block_start)[num_items] | u32 salt_len | salt bytes (first block only)
/// Every variable-length field is length-prefixed, so two different inputs never encode to the same bytes.
inline void write_block_encoding(std::byte* w, const BlockEncodingLayout& l, const BlockHash& parent,
                                 std::span<const TokenId> tokens, std::uint64_t block_start,
                                 const RequestKeys* keys) noexcept {
  const auto put = [&w](const void* p, std::size_t n) {
    if (n == 0) return;  // p may be null (empty salt); memcpy with null is undefined even for 0 bytes
    std::memcpy(w, p, n);
    w += n;
  };
  const auto put_le = [&w](std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) *w++ = static_cast<std::byte>(v >> (8 * i));
  };
  put(parent.bytes.data(), parent.bytes.size());
  put_le(tokens.size(), 4);
  if constexpr (std::endian::native == std::endian::little) {
    put(tokens.data(), tokens.size_bytes());
  } else {
    for (TokenId t : tokens) put_le(static_cast<std::uint32_t>(t), 4);
  }
  put_le(l.has_keys ? keys->adapter_id : 0, 8);
  put_le(l.num_items, 4);
  if (l.num_items != 0) {
    const std::uint64_t block_end = block_start + tokens.size();
    for (const auto& m : keys->multimodal) {
      if (!item_overlaps(m, block_start, block_end)) continue;
      put(m.item_hash.bytes.data(), m.item_hash.bytes.size());
      put_le(m.offset_tokens - block_start, 8);  // two's complement: the signed offset, little-endian
    }
  }
  put_le(l.salt.size(), 4);
  put(l.salt.data(), l.salt.size());
}

/// The canonical encoding of one block (see `write_block_encoding`), replacing the contents of `out`.
inline void encode_block(std::vector<std::byte>& out, const BlockHash& parent, std::span<const TokenId> tokens,
                         std::uint64_t block_start, const RequestKeys* keys, bool first_block) {
  const BlockEncodingLayout l = block_encoding_layout(tokens.size(), block_start, keys, first_block);
  out.resize(l.size_bytes);
  write_block_encoding(out.data(), l, parent, tokens, block_start, keys);
}

}  // namespace detail

/// The prefix-cache index: chained block hashes (vLLM V1 / SGLang style content addressing) and the map from a
/// block hash to the one physical block holding that content.
///
/// block hash = H(parent hash, the block's token ids, extra keys); the first block's parent is the per-pool root
/// H("pagedkv.root.v1" | seed). Only full blocks are hashed. At most one block per hash is registered (the
/// manager switches a duplicate to the registered block), and the index remembers each registered block's hash so
/// eviction can drop it with one probe.
///
/// Template parameters: `Hasher` (Sha256Hasher by default, Xxh3Hasher for single-tenant speed), `Id`.
/// Memory: the hash of each block once (16 bytes), a registration bit, and a table of ids keyed through those
/// hashes (detail::BlockHashTable: 6.7 bytes per block with 32-bit ids): 22.8 bytes per block, all allocated at
/// construction. Cost: find / insert / erase one probe sequence each, O(1) expected, touching one 64-byte group
/// line (12 control bytes + 12 ids) and (on a 7-bit tag match) the candidate's hash.
/// Thread safety: one writer; const calls (`hash_block`, `hash_full_blocks`, `find`, `hash_of`, `prefetch`) may run
/// concurrently with each other (no scratch state: blocks are encoded on the caller's stack, or in a local buffer
/// beyond 512 bytes), never with a non-const call.
template <BlockHasher Hasher = Sha256Hasher, BlockIdType Id = std::uint32_t>
class PrefixHashIndex {
 public:
  using hasher_type = Hasher;

  /// An index for a pool of `num_blocks` blocks, with chain seed `seed` (per pool; equal seeds and hashers give
  /// equal hashes in every process).
  PrefixHashIndex(std::size_t num_blocks, std::uint64_t seed)
      : block_hash_(num_blocks), registered_((num_blocks + 63) / 64, 0), table_(num_blocks), root_(make_root(seed)) {}

  /// The chain root: the parent hash of every sequence's first block.
  [[nodiscard]] const BlockHash& root() const noexcept { return root_; }

  /// The chain root of a pool with seed `seed`: H("pagedkv.root.v1\0" | u64 seed, little-endian). Equal seeds and
  /// hashers give equal roots, hence equal block hashes, in every process and on every machine.
  [[nodiscard]] static BlockHash root_for_seed(std::uint64_t seed) { return make_root(seed); }

  /// Hash of the block holding `tokens` (a full block) at token position `block_start` of its sequence, after the
  /// block whose hash is `parent` (root() for the first block). `keys` may be null.
  [[nodiscard]] static BlockHash hash_block(const BlockHash& parent, std::span<const TokenId> tokens,
                                            std::uint64_t block_start, const RequestKeys* keys) {
    const detail::BlockEncodingLayout l = detail::block_encoding_layout(tokens.size(), block_start, keys,
                                                                        block_start == 0);
    if (l.size_bytes <= kStackEncodingBytes) [[likely]] {
      std::array<std::byte, kStackEncodingBytes> buf;  // a 16-token block without keys takes 100 bytes
      detail::write_block_encoding(buf.data(), l, parent, tokens, block_start, keys);
      return Hasher::hash(std::span<const std::byte>(buf.data(), l.size_bytes));
    }
    std::vector<std::byte> buf(l.size_bytes);
    detail::write_block_encoding(buf.data(), l, parent, tokens, block_start, keys);
    return Hasher::hash(buf);
  }

  /// Hashes of the full blocks of `tokens` (a sequence from position 0), appended to `out`, starting at full block
  /// `out.size()` (so existing hashes are reused as the chain's prefix). `block_size` tokens per block.
  void hash_full_blocks(std::span<const TokenId> tokens, std::uint32_t block_size, const RequestKeys* keys,
                        std::vector<BlockHash>& out) const {
    const std::size_t full = tokens.size() / block_size;
    for (std::size_t i = out.size(); i < full; ++i) {
      const BlockHash& parent = i == 0 ? root_ : out[i - 1];
      out.push_back(hash_block(parent, tokens.subspan(i * block_size, block_size), i * block_size, keys));
    }
  }

  /// The block registered under `h`, or nullopt (a prefix miss). O(1) expected.
  [[nodiscard]] std::optional<Id> find(const BlockHash& h) const {
    const Id b = table_.find(h, block_hash_.data());
    if (b == Id{0}) return std::nullopt;
    return b;
  }

  /// Hint the CPU to load what `find(h)` or `insert(h, ...)` will touch first (issue it one step ahead, e.g.
  /// while hashing the next block).
  void prefetch(const BlockHash& h) const noexcept { table_.prefetch(h); }

  /// Register block `b` under `h`. Returns `b` when inserted, or the already registered block (nothing changes).
  /// One probe sequence. Throws kBlockOutOfRange for b == 0 or b >= num_blocks, kInvalidArgument if `b` is
  /// already registered.
  Id insert(const BlockHash& h, Id b) {
    if (b == 0 || b >= block_hash_.size()) {
      detail::raise(Errc::kBlockOutOfRange, "PrefixHashIndex::insert: block id " + std::to_string(b) +
                                                " outside [1, " + std::to_string(block_hash_.size()) + ")");
    }
    if (is_registered(b)) {
      detail::raise(Errc::kInvalidArgument,
                    "PrefixHashIndex::insert: block " + std::to_string(b) + " is already registered");
    }
    const BlockHash old = block_hash_[b];
    block_hash_[b] = h;  // the table reads keys through this array
    const Id reg = table_.insert(h, b, block_hash_.data());
    if (reg != b) {
      block_hash_[b] = old;
      return reg;
    }
    registered_[b / 64] |= std::uint64_t{1} << (b % 64);
    return b;
  }

  /// Whether block `b` is registered; its hash if so.
  [[nodiscard]] std::optional<BlockHash> hash_of(Id b) const {
    if (b >= block_hash_.size() || !is_registered(b)) return std::nullopt;
    return block_hash_[b];
  }

  /// Unregister block `b` (eviction): one probe sequence, keyed by the hash the index keeps for `b`. Returns its
  /// hash, or nullopt if it was not registered. Always inlined: it sits in the manager's eviction path, which has
  /// more than one caller of it.
  [[gnu::always_inline]] std::optional<BlockHash> erase_block(Id b) {
    if (b >= block_hash_.size() || !is_registered(b)) return std::nullopt;
    registered_[b / 64] &= ~(std::uint64_t{1} << (b % 64));
    table_.erase(block_hash_[b], b);
    return block_hash_[b];
  }

  /// Number of registered blocks.
  [[nodiscard]] std::size_t size() const noexcept { return table_.size(); }

  /// The pool size this index was made for (block ids are below it).
  [[nodiscard]] std::size_t num_blocks() const noexcept { return block_hash_.size(); }

  /// Bytes this index holds (per-block hashes, registration bits, table), all allocated at construction.
  [[nodiscard]] std::size_t memory_bytes() const noexcept {
    return block_hash_.size() * sizeof(BlockHash) + registered_.size() * sizeof(std::uint64_t) +
           table_.memory_bytes();
  }

  /// In-place rehashes of the table so far (tombstone cleanups; for benchmarks and tests).
  [[nodiscard]] std::uint64_t num_rehashes() const noexcept { return table_.num_rehashes(); }

  /// Unregister everything.
  void clear() {
    table_.clear();
    std::fill(registered_.begin(), registered_.end(), std::uint64_t{0});
  }

 private:
  static BlockHash make_root(std::uint64_t seed) {
    std::byte buf[24] = {};
    std::memcpy(buf, "pagedkv.root.v1\0", 16);
    for (int i = 0; i < 8; ++i) buf[16 + i] = static_cast<std::byte>(seed >> (8 * i));
    return Hasher::hash(buf);
  }
  [[nodiscard]] bool is_registered(Id b) const noexcept {
    return ((registered_[b / 64] >> (b % 64)) & 1U) != 0;
  }

  std::vector<BlockHash> block_hash_;      // [num_blocks] the key of each registered block
  std::vector<std::uint64_t> registered_;  // [ceil(num_blocks / 64)] registration bits
  detail::BlockHashTable<Id> table_;
  BlockHash root_;
  static constexpr std::size_t kStackEncodingBytes = 512;
};

/// The key under which KV-cache group `g` registers a block whose hash is `h`, in the prefix index the groups share
/// and in the host tier: `h` itself for group 0 (so a one-group pool's keys are its block hashes), otherwise `h`
/// XOR a 16-byte mask derived from g (splitmix64 of g + 1, little-endian, repeated twice). An involution:
/// `group_block_key(group_block_key(h, g), g) == h`, so the index recovers a block's hash from its key and group.
/// Two groups' keys of one hash differ, so equal content cached by two groups occupies two entries, as it must
/// (each group's block holds different layers). O(1), no branch on the data.
[[nodiscard]] inline BlockHash group_block_key(const BlockHash& h, std::size_t g) noexcept {
  if (g == 0) return h;
  std::uint64_t z = 0x9E3779B97F4A7C15ULL * (static_cast<std::uint64_t>(g) + 1);  // splitmix64 of g
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  BlockHash k = h;
  if constexpr (std::endian::native == std::endian::little) {  // two 64-bit XORs: z's little-endian bytes, twice
    std::uint64_t half[2];
    std::memcpy(half, k.bytes.data(), 16);
    half[0] ^= z;
    half[1] ^= z;
    std::memcpy(k.bytes.data(), half, 16);
  } else {
    for (std::size_t i = 0; i < 16; ++i) k.bytes[i] ^= static_cast<std::uint8_t>(z >> (8 * (i % 8)));
  }
  return k;
}

/// One KV-cache group's part of a prefix index shared by several groups (KVCacheManager::prefix_index(g)): the
/// interface of PrefixHashIndex in the group's own hashes. The shared index keys group g's blocks by
/// `group_block_key(hash, g)` (one table sized for the pool, 22.8 bytes per pool block however many groups, rather
/// than one table per group); this view mixes the key on the way in and unmixes it on the way out, and counts the
/// group's registrations. A view is a few pointers: copy it freely; it is valid as long as its manager.
/// `Index` is `const PrefixHashIndex<H, Id>` for the read-only view the manager hands out (the mutating members
/// then do not compile), non-const inside the manager.
/// Source: vLLM's one BlockPool whose cached-block map is keyed by (block hash, group id); SGLang's one radix cache
/// with a component per attention type.
template <class Index>
class GroupPrefixIndexView {
 public:
  using index_type = std::remove_const_t<Index>;
  using id_type = decltype(std::declval<index_type&>().insert(BlockHash{}, 0));
  using count_type = std::conditional_t<std::is_const_v<Index>, const std::size_t, std::size_t>;

  /// The view of group `g` of `index`. `group_of` (null with one group) maps a block id to the group that holds
  /// it; `count` (null with one group) is the group's number of registered blocks.
  GroupPrefixIndexView(Index& index, std::size_t g, const std::uint8_t* group_of, count_type* count) noexcept
      : index_(&index), g_(g), group_of_(group_of), count_(count) {}

  /// The group this view belongs to.
  [[nodiscard]] std::size_t group() const noexcept { return g_; }
  /// The chain root (shared by every group: the groups hash the same tokens).
  [[nodiscard]] const BlockHash& root() const noexcept { return index_->root(); }
  /// PrefixHashIndex::hash_full_blocks (block hashes do not depend on the group).
  void hash_full_blocks(std::span<const TokenId> tokens, std::uint32_t block_size, const RequestKeys* keys,
                        std::vector<BlockHash>& out) const {
    index_->hash_full_blocks(tokens, block_size, keys, out);
  }
  /// The group's block registered under hash `h`, or nullopt. One probe of the shared table.
  [[nodiscard]] std::optional<id_type> find(const BlockHash& h) const { return index_->find(key(h)); }
  /// Prefetch what `find(h)` will touch.
  void prefetch(const BlockHash& h) const noexcept { index_->prefetch(key(h)); }
  /// Whether block `b` is registered by this group; its hash if so (nullopt for another group's block).
  /// (Always inlined: the manager's registration only tests the result, and inlined the unmixing is dropped.)
  [[nodiscard, gnu::always_inline]] std::optional<BlockHash> hash_of(id_type b) const {
    if (group_of_ != nullptr && b < index_->num_blocks() && group_of_[b] != g_) return std::nullopt;
    const auto k = index_->hash_of(b);
    if (!k) return std::nullopt;
    return key(*k);
  }
  /// Blocks registered by this group.
  [[nodiscard]] std::size_t size() const noexcept { return count_ != nullptr ? *count_ : index_->size(); }
  /// Register group block `b` under hash `h` (PrefixHashIndex::insert, keyed for the group). The caller has
  /// recorded `b` as this group's block. Returns `b`, or the group's block already registered under `h`.
  id_type insert(const BlockHash& h, id_type b) {
    const id_type r = index_->insert(key(h), b);
    if (r == b && count_ != nullptr) ++*count_;
    return r;
  }
  /// Unregister group block `b`; its hash, or nullopt when it was not registered.
  std::optional<BlockHash> erase_block(id_type b) {
    const auto k = index_->erase_block(b);
    if (!k) return std::nullopt;
    if (count_ != nullptr) --*count_;
    return key(*k);
  }

 private:
  [[nodiscard]] BlockHash key(const BlockHash& h) const noexcept { return group_block_key(h, g_); }

  Index* index_;
  std::size_t g_;
  const std::uint8_t* group_of_;
  count_type* count_;
};

/// Recompute the hash of a kBlockStored event from the event alone (what a KV-aware router does to check, or to
/// index, a stored block): H(parent_hash or the root of `seed`, token_ids, adapter, the event's multimodal items
/// relative to block_start, salt on the first block). Equals `e.hash` for every event a manager with this
/// `Hasher` and `seed` emits. Throws kInvalidArgument if `e` is not a kBlockStored event or its token_ids size
/// differs from block_size.
template <BlockHasher Hasher>
[[nodiscard]] BlockHash rehash_stored_event(const KVEvent& e, std::uint64_t seed) {
  if (e.type != KVEventType::kBlockStored || e.token_ids.size() != e.block_size) {
    detail::raise(Errc::kInvalidArgument, "rehash_stored_event: event " + std::to_string(e.seq_no) +
                                              " is not a stored block of block_size tokens");
  }
  RequestKeys keys;
  keys.adapter_id = e.adapter_id;
  keys.multimodal = e.multimodal_items;
  keys.salt = e.salt;
  const BlockHash parent = e.parent_hash ? *e.parent_hash : PrefixHashIndex<Hasher>::root_for_seed(seed);
  return PrefixHashIndex<Hasher>::hash_block(parent, e.token_ids, e.block_start, &keys);
}

}  // namespace pagedkv
