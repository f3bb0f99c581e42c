// pagedkv/events_zmq/wire.hpp: KV events in vLLM's wire format (msgpack, the byte layout of vLLM's
// ZmqEventPublisher), an encoder for pagedkv's KVEventBatch, a decoder for any vLLM-format stream, and the rehash
// of a stored block from its wire event. docs/events-wire.md describes the format field by field with its sources.
//
// No ZeroMQ and no msgpack in this header: both stay inside libpagedkv_events_zmq.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <pagedkv/error.hpp>
#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/events_zmq/export.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/request_keys.hpp>

namespace pagedkv::events {

// -----------------------------------------------------------------------------------------------------------------
// Encoding choices

/// How each event is laid out in the msgpack payload. The batch itself is always a 3-element array
/// [ts, events, data_parallel_rank] (vLLM's EventBatch is `array_like=True` in every version).
enum class EventLayout : std::uint8_t {
  /// A tagged array ["BlockStored", field, ...] in vLLM's field order: msgspec `array_like=True, tag=True`, what
  /// vLLM published up to v0.23 and what every version of Dynamo's KV router, llm-d and vLLM's own
  /// kv_events_subscriber example (up to v0.23) decode. The default: the widest set of existing consumers.
  kArray = 0,
  /// A tagged map {"type": "BlockStored", "block_hashes": ..., ...}: msgspec `tag=True` without `array_like`,
  /// what vLLM publishes since vllm-project/vllm#42892 (v0.24 on), decoded by Dynamo and llm-d since mid-2026 and
  /// by `msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)` of those versions. Fields whose value
  /// is msgspec's default (None) are omitted, as `omit_defaults=True` does for maps.
  kMap = 1,
};

/// How block hashes (vLLM's `ExternalBlockHash = bytes | int`) are written.
enum class HashFormat : std::uint8_t {
  /// A msgpack unsigned integer: the low 64 bits of the hash read as a big-endian integer (`wire_key`), the same
  /// conversion vLLM applies with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (its default). The default here: Dynamo's
  /// decoder accepts only integer hashes. 64 bits identify blocks on the wire; the engine keeps using all 128.
  kUint64 = 0,
  /// A msgpack bin of the 16 hash bytes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends its 32 SHA-256
  /// bytes the same way). Lossless: a consumer can recompute every stored block's hash from its event alone
  /// (`rehash_wire_block`). Not accepted by Dynamo's KV router.
  kBytes16 = 1,
};

/// Name of a layout ("array", "map") or hash format ("uint64", "bytes16"). Never null.
[[nodiscard]] constexpr const char* to_string(EventLayout l) noexcept { return l == EventLayout::kMap ? "map" : "array"; }
[[nodiscard]] constexpr const char* to_string(HashFormat f) noexcept {
  return f == HashFormat::kBytes16 ? "bytes16" : "uint64";
}

/// How a block-0 cache salt is written into `extra_keys` (docs/events-wire.md section 6). Each router reads a
/// different convention; the default is the one every consumer named there indexes correctly.
enum class SaltForm : std::uint8_t {
  /// `"dynamo-cache-salt:" + salt` (a str): the default. NVIDIA Dynamo's KV router takes a block-0 string with this
  /// prefix as the request's cache namespace and mixes it into its block hashes (Dynamo's vLLM handler prefixes the
  /// salt before handing it to vLLM, so this is what vLLM itself emits under Dynamo). llm-d skips every non-tuple
  /// entry (no salt support), so it sees the same blocks whatever the form.
  kDynamo = 0,
  /// The bare salt (str, or bin when not UTF-8), as vLLM's `generate_block_hash_extra_keys` writes `cache_salt`.
  /// Dynamo ignores it (it takes bare strings as LoRA names or legacy multimodal hashes; a 64-hex salt would be
  /// misread as an image), so Dynamo then merges tenants.
  kVllm = 1,
  /// Both: the bare salt, then the prefixed one (for consumers of either convention on one stream).
  kBoth = 2,
};

/// How a multimodal item's identifier is written in `extra_keys` (`[identifier, offset]`).
enum class MmIdForm : std::uint8_t {
  /// 64 lower-case hex digits: the 32 of the item's 16-byte hash followed by 32 '0'. The default: the length of
  /// vLLM's own identifiers (a hex SHA-256), which Dynamo parses as a canonical digest, taking its first 16 hex
  /// digits (the item hash's first 8 bytes, big-endian) as the item's u64; llm-d hashes the string as given.
  kHex64 = 0,
  /// 32 lower-case hex digits of the 16-byte item hash (pagedkv before issue 21). Dynamo hashes such ids with XXH3.
  kHex32 = 1,
};

/// Name of a salt form ("dynamo", "vllm", "both") or multimodal id form ("hex64", "hex32"). Never null.
[[nodiscard]] constexpr const char* to_string(SaltForm f) noexcept {
  return f == SaltForm::kVllm ? "vllm" : f == SaltForm::kBoth ? "both" : "dynamo";
}
[[nodiscard]] constexpr const char* to_string(MmIdForm f) noexcept { return f == MmIdForm::kHex32 ? "hex32" : "hex64"; }

/// Dynamo's tag of a cache salt inside `extra_keys` (Dynamo `lib/kv-router/src/zmq_wire/extra_keys.rs`,
/// DYNAMO_CACHE_SALT_PREFIX).
inline constexpr std::string_view kDynamoCacheSaltPrefix = "dynamo-cache-salt:";

/// The attention kind and sliding window of one KV-cache group, for vLLM's `kv_cache_spec_kind` /
/// `kv_cache_spec_sliding_window` (BlockStored positions 10 and 11). The engine knows its groups; pagedkv's
/// managers do not carry these strings, so the encoder takes them from `EncodeOptions::group_specs`.
struct GroupSpec {
  /// vLLM's KVCacheSpecKind value: "full_attention", "sliding_window", "chunked_local_attention",
  /// "mla_attention", "mamba", ... Written as given (non-empty).
  std::string kind = "full_attention";
  /// The window in tokens for sliding-window (or the chunk for chunked-local) groups; nullopt = None.
  std::optional<std::uint32_t> sliding_window;
  friend bool operator==(const GroupSpec&, const GroupSpec&) = default;
};

/// Options of `encode_batch` / `encode_snapshot`.
struct EncodeOptions {
  EventLayout layout = EventLayout::kArray;
  HashFormat hash_format = HashFormat::kUint64;
  /// The batch's `data_parallel_rank` (vLLM's publisher always sets it, so it is always written).
  std::int32_t data_parallel_rank = 0;
  /// Merge runs of stored events that chain (each one's parent is the previous one's hash, same block size,
  /// adapter, tier and group, consecutive positions) into one BlockStored with several hashes, as vLLM does per
  /// request; and runs of removals of one tier and group into one BlockRemoved. Decoding yields the same blocks.
  bool merge_runs = true;
  /// vLLM's `lora_name` of an adapter id (pagedkv knows only ids); empty function or nullopt = None. Dynamo uses
  /// lora_name to keep different adapters' blocks apart in its own index.
  /// Written twice, where vLLM writes it: the `lora_name` field and the first element of every block's
  /// `extra_keys` (replacing the adapter id, which stays in `lora_id`). llm-d roots an adapter's keys at its name
  /// (the name replaces the model name); Dynamo seeds its block hash with it. Without a name the id is written in
  /// `extra_keys` as an int (neither router can then tell adapters apart from the base model).
  std::function<std::optional<std::string>(std::uint64_t adapter_id)> lora_name;
  /// How the cache salt is written (SaltForm; default Dynamo's prefixed form).
  SaltForm salt_form = SaltForm::kDynamo;
  /// How multimodal identifiers are written (MmIdForm; default 64 hex digits).
  MmIdForm mm_id_form = MmIdForm::kHex64;
  /// The identifier of an item (e.g. vLLM's `mm_hash` string the engine received with the request); empty
  /// function or nullopt = the `mm_id_form` of its hash. Consumers cannot recompute pagedkv hashes from such
  /// identifiers (`pagedkv_block_keys` throws on them).
  std::function<std::optional<std::string>(const BlockHash& item_hash)> mm_identifier;
  /// `kv_cache_spec_kind` / `kv_cache_spec_sliding_window` per KV-cache group, indexed by `KVEvent::group`.
  /// Empty (default): a one-group full-attention engine, so group 0 is written as "full_attention" with no
  /// window and other groups without a kind. Non-empty: every stored event's group must have an entry
  /// (encode_batch throws kInvalidArgument naming the group otherwise). Written at array positions 10-11 (the
  /// event then has 12 elements, as vLLM >= 0.23 sends) or as map keys.
  std::vector<GroupSpec> group_specs;
  /// With `group_specs`: write only the events of main-attention groups (kinds "full_attention",
  /// "mla_attention", "sink_full_attention"; `is_main_attention`). Default true: NVIDIA Dynamo indexes only those
  /// kinds (zmq_wire filter.rs, `is_main_attention`), and llm-d keys its index by pod and tier without the group,
  /// so a sliding-window group's removal of a block the full-attention group still holds (same hash) would erase
  /// it there. False: every group, as vLLM publishes them.
  bool main_groups_only = true;
};

/// Whether vLLM's `kv_cache_spec_kind` names a main-attention kind, whose blocks a prefix match can reuse on their
/// own ("full_attention", "mla_attention", "sink_full_attention"; Dynamo's `KvCacheSpecKind::is_main_attention`).
[[nodiscard]] constexpr bool is_main_attention(std::string_view kind) noexcept {
  return kind == "full_attention" || kind == "mla_attention" || kind == "sink_full_attention";
}

/// The wire form of a 128-bit block hash as an integer (HashFormat::kUint64): bytes 8..15 read big-endian, i.e.
/// `int.from_bytes(hash, "big") & (2**64 - 1)`, vLLM's own bytes-to-int rule (`maybe_convert_block_hash`).
/// A consumer sees the same key for a block whichever HashFormat the engine uses (WireHash::key). O(1).
[[nodiscard]] constexpr std::uint64_t wire_key(const BlockHash& h) noexcept {
  std::uint64_t v = 0;
  for (std::size_t i = 8; i < 16; ++i) v = (v << 8) | h.bytes[i];
  return v;
}

/// Encode `batch` as vLLM's msgpack payload (the third frame of a published message):
///   [ts, [event, ...], data_parallel_rank]
/// with each KVEvent mapped as docs/events-wire.md describes (BlockStored / BlockRemoved / AllBlocksCleared).
/// Returns the bytes. Throws pagedkv::Error kInvalidArgument, naming the event, when a stored event's token_ids
/// do not hold block_size tokens or block_size is 0. Deterministic: equal batches and options give equal bytes.
/// Thread-safe (no shared state); allocates the result. O(events + tokens).
[[nodiscard]] PAGEDKV_EVENTS_ZMQ_API std::vector<std::byte> encode_batch(const KVEventBatch& batch,
                                                                        const EncodeOptions& options = {});

/// Encode `snapshot` as one batch that turns any consumer's state for this engine into the snapshot:
/// [ts, [AllBlocksCleared, BlockStored..., ], rank]. Its sequence number on the wire is `snapshot.seq_no`, so a
/// consumer applies the batches numbered after it next (the publisher's snapshot reply, docs/events-wire.md).
/// Errors, thread safety and cost as `encode_batch`.
[[nodiscard]] PAGEDKV_EVENTS_ZMQ_API std::vector<std::byte> encode_snapshot(const KVEventSnapshot& snapshot, double ts,
                                                                           const EncodeOptions& options = {});

// -----------------------------------------------------------------------------------------------------------------
// Decoded form (any vLLM-format producer: pagedkv, vLLM, SGLang in vLLM format)

/// A block hash as received: vLLM's `ExternalBlockHash` (int or bytes).
struct WireHash {
  /// The integer form: the int itself (a negative one reinterpreted as unsigned, as Dynamo does), or for bytes
  /// `int.from_bytes(b, "big") & (2**64 - 1)` (vLLM's conversion), so both forms of one block agree.
  std::uint64_t key = 0;
  /// The 16 bytes when the producer sent exactly 16 bytes (pagedkv's HashFormat::kBytes16).
  std::optional<BlockHash> full;
  friend bool operator==(const WireHash&, const WireHash&) = default;
};

/// One element of a block's `extra_keys` tuple, by msgpack type. pagedkv writes kUnsigned (adapter id),
/// kIdentifierWithOffset (multimodal item: hex of its 16-byte hash, offset relative to the block start) and
/// kString or kBytes (the salt); vLLM writes the LoRA name and cache salt as kString, multimodal items as
/// kIdentifierWithOffset (or a bare kString before v0.19) and prompt-embedding hashes as kBytes.
struct WireExtraKey {
  enum class Kind : std::uint8_t { kUnsigned, kSigned, kString, kBytes, kIdentifierWithOffset, kOther };
  Kind kind = Kind::kOther;
  std::uint64_t unsigned_value = 0;  ///< kUnsigned.
  std::int64_t signed_value = 0;     ///< kSigned, and the offset of kIdentifierWithOffset.
  std::string text;                  ///< kString, kBytes (raw bytes), the identifier of kIdentifierWithOffset.
  friend bool operator==(const WireExtraKey&, const WireExtraKey&) = default;
};

/// vLLM's BlockStored: one or more full blocks that chain (block_hashes[i]'s parent is block_hashes[i - 1]; the
/// first one's parent is parent_block_hash, none for a sequence's first block).
struct WireBlockStored {
  std::vector<WireHash> block_hashes;
  std::optional<WireHash> parent_block_hash;
  std::vector<TokenId> token_ids;       ///< `[block_hashes.size() * block_size]`, the blocks' tokens in order.
  std::uint32_t block_size = 0;
  std::optional<std::int64_t> lora_id;  ///< pagedkv: the adapter id (none for the base model).
  std::optional<std::string> medium;    ///< "GPU" / "CPU" (none: unspecified, GPU by vLLM's convention).
  std::optional<std::string> lora_name;
  /// Per block (`[block_hashes.size()]`, or empty when the producer sent none): the block's extra keys, nullopt
  /// for a block without any.
  std::vector<std::optional<std::vector<WireExtraKey>>> extra_keys;
  std::optional<std::int64_t> group_idx;  ///< KV-cache group.
  std::optional<std::string> kv_cache_spec_kind;              ///< "full_attention", "sliding_window", ...
  std::optional<std::int64_t> kv_cache_spec_sliding_window;  ///< Window in tokens (sliding groups).
  /// The token ids of block `i` (`[block_size]`). Precondition: i < block_hashes.size().
  [[nodiscard]] std::span<const TokenId> block_tokens(std::size_t i) const {
    return std::span<const TokenId>(token_ids).subspan(i * block_size, block_size);
  }
  friend bool operator==(const WireBlockStored&, const WireBlockStored&) = default;
};

/// vLLM's BlockRemoved: blocks that left a tier.
struct WireBlockRemoved {
  std::vector<WireHash> block_hashes;
  std::optional<std::string> medium;
  std::optional<std::int64_t> group_idx;
  friend bool operator==(const WireBlockRemoved&, const WireBlockRemoved&) = default;
};

/// vLLM's AllBlocksCleared: every block of the engine left every tier (the wire names no tier).
struct WireAllBlocksCleared {
  friend bool operator==(const WireAllBlocksCleared&, const WireAllBlocksCleared&) = default;
};

/// One decoded event.
using WireEvent = std::variant<WireBlockStored, WireBlockRemoved, WireAllBlocksCleared>;

/// A decoded payload: vLLM's KVEventBatch.
struct WireBatch {
  double ts = 0.0;
  std::vector<WireEvent> events;
  std::optional<std::int64_t> data_parallel_rank;
  std::size_t num_unknown_events = 0;  ///< Events with a tag this decoder does not know (skipped).
};

/// Decode one payload (either EventLayout, either hash form, optional trailing fields present or not; unknown map
/// keys and extra trailing array elements are ignored, as msgspec does). Throws pagedkv::Error kInvalidArgument
/// naming the event index and field when the bytes are not a vLLM KVEventBatch (truncated or trailing bytes, a
/// wrong type, a missing required field, token_ids not a multiple of block_size, a token outside int32).
/// Thread-safe; allocates. O(payload bytes).
[[nodiscard]] PAGEDKV_EVENTS_ZMQ_API WireBatch decode_batch(std::span<const std::byte> payload);

// -----------------------------------------------------------------------------------------------------------------
// What a pagedkv block hash depends on, read back from the wire

/// The extra keys pagedkv mixes into one block's hash (docs/design.md "Block hashes"), as its events carry them.
struct WireBlockKeys {
  std::uint64_t adapter_id = 0;
  /// Multimodal items overlapping the block: (item hash, item offset - block start in tokens; negative when the
  /// item started in an earlier block), in the order the request listed them.
  std::vector<std::pair<BlockHash, std::int64_t>> items;
  std::string salt;  ///< The cache salt (a sequence's first block only).
};

/// The pagedkv extra keys of block `i` of `e`: the adapter id from an unsigned element, else from `lora_id` (when
/// the adapter's name was written instead; the first string equal to `lora_name` is that name and skipped, as
/// Dynamo does), items from (32 hex digits, or 64 whose last 32 are '0', offset) pairs, the salt from a string
/// or bytes element, with or without Dynamo's "dynamo-cache-salt:" prefix (both forms present must agree); none
/// = all defaults. Throws pagedkv::Error kInvalidArgument when `i` is out of range or an element does not fit
/// pagedkv's layout (e.g. a stream from vLLM, whose hashes pagedkv cannot recompute anyway). O(keys).
[[nodiscard]] PAGEDKV_EVENTS_ZMQ_API WireBlockKeys pagedkv_block_keys(const WireBlockStored& e, std::size_t i);

/// Recompute the full 128-bit hash of block `i` of a stored event published by a pagedkv engine using `Hasher` and
/// chain seed `seed`: H(parent, the block's tokens, its extra keys), exactly as the engine computed it.
/// `parent` is the block's full parent hash; when null it is taken from the event: the seed's root for a
/// sequence's first block (no parent_block_hash and i == 0), else the 16 bytes of block_hashes[i - 1] or
/// parent_block_hash (sent with HashFormat::kBytes16). With HashFormat::kUint64 the wire carries 64-bit keys only,
/// so the caller passes the parent it recomputed earlier in the chain.
/// Throws pagedkv::Error kInvalidArgument when i is out of range, the parent is needed and not available, or the
/// keys do not fit pagedkv's layout (pagedkv_block_keys). Thread-safe. O(block_size + keys).
template <BlockHasher Hasher>
[[nodiscard]] BlockHash rehash_wire_block(const WireBlockStored& e, std::size_t i, std::uint64_t seed,
                                          const BlockHash* parent = nullptr) {
  const auto fail = [&](const std::string& why) {
    pagedkv::detail::raise(Errc::kInvalidArgument, "rehash_wire_block: block " + std::to_string(i) + " of a stored event " +
                                              "with " + std::to_string(e.block_hashes.size()) + " blocks: " + why);
  };
  if (i >= e.block_hashes.size()) fail("index out of range");
  if (e.block_size == 0 || e.token_ids.size() != e.block_hashes.size() * e.block_size) {
    fail("token_ids hold " + std::to_string(e.token_ids.size()) + " tokens, not blocks x block_size " +
         std::to_string(e.block_size));
  }
  const bool first_block = i == 0 && !e.parent_block_hash;
  BlockHash p;
  if (parent != nullptr) {
    p = *parent;
  } else if (first_block) {
    p = PrefixHashIndex<Hasher>::root_for_seed(seed);
  } else {
    const WireHash& w = i > 0 ? e.block_hashes[i - 1] : *e.parent_block_hash;
    if (!w.full) fail("the parent hash was sent as a 64-bit integer; pass the full parent hash");
    p = *w.full;
  }
  const WireBlockKeys k = pagedkv_block_keys(e, i);
  // Rebuild request keys with absolute positions that reproduce the relative offsets: the block starts at
  // `start` (0 for a first block, which the salt needs), each item at start + offset, long enough to overlap it.
  std::uint64_t start = 0;
  for (const auto& [h, off] : k.items) {
    if (off < 0) {
      if (first_block) fail("an item of a sequence's first block starts before it");
      start = std::max<std::uint64_t>(start, static_cast<std::uint64_t>(-(off + 1)) + 1);
    }
  }
  if (!first_block) start = std::max<std::uint64_t>(start, e.block_size);
  RequestKeys keys;
  keys.adapter_id = k.adapter_id;
  keys.salt = first_block ? k.salt : std::string();
  keys.multimodal.reserve(k.items.size());
  for (const auto& [h, off] : k.items) {
    const std::uint64_t at = start + static_cast<std::uint64_t>(off);  // two's complement: start - |off| for off < 0
    const std::uint64_t len = off < 0 ? static_cast<std::uint64_t>(-(off + 1)) + 2 : 1;
    keys.multimodal.push_back(MultimodalItem{h, at, len});
  }
  return PrefixHashIndex<Hasher>::hash_block(p, e.block_tokens(i), start, &keys);
}

}  // namespace pagedkv::events
