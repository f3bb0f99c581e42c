// pagedkv/block_identity.hpp: the keys that each router ecosystem computes for one KV-cache block (vLLM's
// sha256_cbor block hash and its 64-bit event form, NVIDIA Dynamo's tokens/sequence hashes, llm-d's request keys),
// computed from the same inputs: parent, token ids, LoRA, salt, multimodal items.
//
// Why: a KV-aware router matches what an engine *says* it holds (KV events, docs/events-wire.md) against what a new
// request *would* need. Each ecosystem names a block its own way; an engine or router built on pagedkv must
// reproduce those names bit for bit to join them. Every definition below cites the source file it was read from
// (stored snapshots of the public repositories, 2026); docs/events-wire.md section 9 lists them side by side.
//
// Tested against golden vectors recomputed by an independent encoder (Python cbor2 + hashlib + xxhash;
// tests/unit/golden/make_block_identity_vectors.py) and against Dynamo's own published constants
// (tests/unit/test_block_identity.cpp).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pagedkv/config.hpp>

namespace pagedkv::identity {

// ------------------------------------------------------------------------------------------------------------------
// Canonical CBOR (RFC 8949 section 4.2.1, "core deterministic encoding"), the subset the three ecosystems hash:
// unsigned and negative integers, byte strings, text strings, arrays, one-entry maps, null.
//
// Why our own encoder: Debian's libcbor (0.8) encodes but leaves canonical form (shortest heads) to the caller, and
// the subset needed is six item kinds with one rule (the shortest head for every length and integer), about 40
// lines. Maps with several keys (whose canonical key order differs between RFC 7049 "length-first" and RFC 8949
// "bytewise") are deliberately not offered: no hashed structure here has one.
// ------------------------------------------------------------------------------------------------------------------

/// Appends canonical CBOR items to a byte buffer. Every head uses the shortest form (RFC 8949 4.2.1), so equal
/// values always give equal bytes, as Python's `cbor2.dumps(x, canonical=True)` and Go's
/// `fxamacker/cbor CanonicalEncOptions()` produce them for these item kinds.
/// Thread safety: none (one writer per buffer). Allocates as the buffer grows.
class CborWriter {
 public:
  /// Major type 0: an unsigned integer.
  void uint(std::uint64_t v) { head(0, v); }
  /// Major type 0 or 1: a signed integer (negative n is written as major 1 with argument -1 - n).
  void sint(std::int64_t v) {
    if (v >= 0) {
      head(0, static_cast<std::uint64_t>(v));
    } else {
      head(1, static_cast<std::uint64_t>(-1 - v));
    }
  }
  /// Major type 2: a byte string.
  void bytes(std::span<const std::uint8_t> b) {
    head(2, b.size());
    out_.insert(out_.end(), b.begin(), b.end());
  }
  /// Major type 3: a text string (the caller's bytes, expected UTF-8; not validated).
  void text(std::string_view s) {
    head(3, s.size());
    out_.insert(out_.end(), s.begin(), s.end());
  }
  /// Major type 4: the head of an array of `n` items (the caller writes the items next).
  void array(std::size_t n) { head(4, n); }
  /// Major type 5: the head of a map of `n` pairs (the caller writes key, value, ... in canonical key order).
  void map(std::size_t n) { head(5, n); }
  /// Simple value 22: null (Python None, Go nil).
  void null() { out_.push_back(0xf6); }

  /// The bytes written so far.
  [[nodiscard]] const std::vector<std::uint8_t>& data() const noexcept { return out_; }
  /// Forget the bytes (keeps the capacity).
  void clear() noexcept { out_.clear(); }

 private:
  void head(std::uint8_t major, std::uint64_t arg) {
    const auto m = static_cast<std::uint8_t>(major << 5);
    if (arg < 24) {
      out_.push_back(static_cast<std::uint8_t>(m | arg));
      return;
    }
    int n = 8;
    std::uint8_t info = 27;
    if (arg <= 0xff) {
      n = 1;
      info = 24;
    } else if (arg <= 0xffff) {
      n = 2;
      info = 25;
    } else if (arg <= 0xffffffffULL) {
      n = 4;
      info = 26;
    }
    out_.push_back(static_cast<std::uint8_t>(m | info));
    for (int i = n - 1; i >= 0; --i) out_.push_back(static_cast<std::uint8_t>(arg >> (8 * i)));
  }
  std::vector<std::uint8_t> out_;
};

// ------------------------------------------------------------------------------------------------------------------
// vLLM: `--prefix-caching-hash-algo sha256_cbor`
//
// Source: vllm-project/vllm vllm/v1/core/kv_cache_utils.py (`hash_block_tokens`, `generate_block_hash_extra_keys`,
// `_gen_mm_extra_hash_keys`, `init_none_hash`, `resolve_none_hash_seed`, `maybe_convert_block_hash`) and
// vllm/utils/hashing.py (`sha256_cbor`):
//  - sha256_cbor(x) = SHA-256(cbor2.dumps(x, canonical=True)), a 32-byte digest.
//  - block hash = sha256_cbor((parent, tuple(token_ids), extra_keys)); a tuple is a CBOR array, the parent a byte
//    string (the parent block's 32-byte digest), token ids integers, extra_keys None or a tuple.
//  - the first block's parent is NONE_HASH = hash_fn(seed) with seed = $PYTHONHASHSEED when set; when unset, the
//    newest vLLM uses DEFAULT_NONE_HASH_SEED = "vllm-none-hash" for the cryptographic algorithms (sha256,
//    sha256_cbor) and 32 random bytes (hex) for xxhash; older releases used os.urandom(32) for every algorithm when
//    PYTHONHASHSEED was unset (hashes then differ per process and cannot be reproduced by anyone).
//    The seed is a Python str, so NONE_HASH = SHA-256(CBOR text string seed).
//  - extra_keys of a block = lora_name (when the request has a LoRA), then one entry per multimodal item
//    overlapping the block, then cache_salt (first block only, start_token_idx == 0, and only when non-empty), then
//    the SHA-256 of the block's prompt embeddings (bytes, when the request has prompt_embeds); None when empty.
//    A multimodal entry is `(identifier, item offset - block start)` in the newest source; earlier releases wrote
//    the bare identifier (llm-d's ParseRawExtraKeys accepts both shapes).
//  - events carry int.from_bytes(digest, "big") & (2^64 - 1), the last 8 bytes read big-endian, while
//    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES is on (its default), else the 32 raw bytes.
// ------------------------------------------------------------------------------------------------------------------

/// A SHA-256 digest, as vLLM's `BlockHash` bytes.
using Sha256Digest = std::array<std::uint8_t, 32>;

/// vLLM's `DEFAULT_NONE_HASH_SEED`: the NONE_HASH seed of sha256 / sha256_cbor when PYTHONHASHSEED is unset.
inline constexpr std::string_view kVllmDefaultNoneHashSeed = "vllm-none-hash";

/// One multimodal entry of vLLM's per-block extra keys.
struct VllmMmKey {
  std::string identifier;             ///< `mm_feature.identifier` (vLLM: the item's content hash, a str).
  std::optional<std::int64_t> offset; ///< Item offset - block start, in tokens (negative when the item began in
                                      ///< an earlier block). nullopt: the bare-identifier form of older vLLM.
};

/// vLLM's extra keys of one block, in the order `generate_block_hash_extra_keys` concatenates them.
struct VllmExtraKeys {
  std::optional<std::string> lora_name;  ///< `lora_request.lora_name` (present even when empty, as vLLM does).
  std::vector<VllmMmKey> mm;             ///< Multimodal items overlapping the block, sorted by offset.
  std::optional<std::string> cache_salt; ///< First block only; vLLM omits an empty salt (the caller's job here).
  std::optional<Sha256Digest> prompt_embeds_hash;  ///< SHA-256 of the block's prompt-embedding tensor bytes.

  /// True when vLLM would pass `extra_keys=None` (no element at all).
  [[nodiscard]] bool empty() const noexcept {
    return !lora_name && mm.empty() && !cache_salt && !prompt_embeds_hash;
  }
};

/// The canonical CBOR bytes vLLM's sha256_cbor hashes for one block: the 3-array
/// `[bytes parent, [token ids...], extra]`, extra = null when `extra` is null or empty, else an array of the keys
/// (text lora_name, `[text identifier, int offset]` or text identifier per item, text salt, bytes embeds hash).
/// `parent`: the parent's digest, or NONE_HASH (vllm_none_hash) for a sequence's first block. Allocates.
[[nodiscard]] PAGEDKV_API std::vector<std::uint8_t> vllm_block_cbor(const Sha256Digest& parent,
                                                                    std::span<const std::uint32_t> token_ids,
                                                                    const VllmExtraKeys* extra);

/// vLLM's NONE_HASH under sha256_cbor: SHA-256 of the CBOR text string `seed` (vLLM passes the seed str itself to
/// the hash function). The default seed is what the newest vLLM uses when PYTHONHASHSEED is unset; pass the value
/// of PYTHONHASHSEED when the engine sets it. Engines of older releases without PYTHONHASHSEED are irreproducible.
[[nodiscard]] PAGEDKV_API Sha256Digest vllm_none_hash(std::string_view seed = kVllmDefaultNoneHashSeed);

/// vLLM's block hash under sha256_cbor: SHA-256(vllm_block_cbor(parent, token_ids, extra)). Thread-safe.
[[nodiscard]] PAGEDKV_API Sha256Digest vllm_block_hash(const Sha256Digest& parent,
                                                       std::span<const std::uint32_t> token_ids,
                                                       const VllmExtraKeys* extra);

/// The 64-bit block hash a vLLM KV event carries (`maybe_convert_block_hash`): the digest's last 8 bytes read
/// big-endian. Also llm-d's `getHashAsUint64` for byte hashes of 8 bytes or more.
[[nodiscard]] constexpr std::uint64_t vllm_event_hash(const Sha256Digest& d) noexcept {
  std::uint64_t v = 0;
  for (std::size_t i = d.size() - 8; i < d.size(); ++i) v = (v << 8) | d[i];
  return v;
}

/// One multimodal item of a request, in absolute prompt positions (vLLM's `mm_feature.identifier` and
/// `mm_position` offset / length).
struct VllmMmItem {
  std::string identifier;
  std::uint64_t offset_tokens = 0;
  std::uint64_t length_tokens = 0;
};

/// The per-request inputs of vLLM's block hasher (`get_request_block_hasher`).
struct VllmRequestKeys {
  std::optional<std::string> lora_name;  ///< The request's LoRA name, if it has a LoRA.
  std::vector<VllmMmItem> mm;            ///< Multimodal items, sorted by offset (vLLM assumes so).
  std::string cache_salt;                ///< Empty = none (vLLM tests its truthiness).
  bool mm_bare_identifiers = false;      ///< Write items as bare identifiers (older vLLM) instead of pairs.
};

/// The block hashes vLLM computes for a request's full blocks: block i covers tokens
/// [i * block_size, (i + 1) * block_size); a trailing partial block is not hashed. The first parent is
/// `none_hash`. Items overlapping a block [start, end) (offset < end and offset + length > start) are mixed in as
/// (identifier, offset - start). Throws pagedkv::Error kInvalidArgument when block_size == 0 or the items are not
/// sorted by offset; allocates the result.
[[nodiscard]] PAGEDKV_API std::vector<Sha256Digest> vllm_request_block_hashes(
    std::span<const std::uint32_t> token_ids, std::size_t block_size, const VllmRequestKeys& keys,
    const Sha256Digest& none_hash);

// ------------------------------------------------------------------------------------------------------------------
// NVIDIA Dynamo: XXH3-64 tokens hashes (the KV router's `LocalBlockHash`, the `tokens_hash` of its indexer) and
// rolling sequence hashes.
//
// Sources: ai-dynamo/dynamo lib/kv-router/src/protocols.rs (`XXH3_SEED = 1337`, `compute_block_hash_for_seq`,
// `compute_seq_hash_for_block`), lib/kv-hashing/src/salt.rs (`compute_salt_hash`), lib/tokens/src/lib.rs
// (`compute_block_hash`, `TokenBlock::from_chunk`, and its test constants HASH_1_4, SEQ_HASH_5_8, ...):
//  - tokens hash = XXH3-64(token ids as little-endian u32, seed); seed = 1337 plus, wrapping, XXH3-64(lora_name,
//    seed 0) when a non-empty LoRA name is given, plus XXH3-64(salt, seed 1) when a non-empty salt (Dynamo's
//    "cache namespace") is given. For blocks with multimodal objects the router appends their u64 mm hashes,
//    sorted ascending, little-endian, after the tokens. (The newest lib/tokens encodes MM blocks as 13-byte
//    per-slot frames instead; not reproduced here.)
//  - sequence hash: seq[0] = tokens hash of block 0; seq[i] = XXH3-64(le u64 seq[i-1] | le u64 hash[i], chain
//    seed). The chain seed differs by component and revision: 1337 in the kv-router (`compute_hash` with
//    XXH3_SEED) and in lib/tokens revisions that name it CHAIN_XXH3_SEED; the request's salt hash in older
//    lib/tokens (its tests' SEQ_HASH_5_8 = 4945711292740353085 with salt 1337); 0 in the newest lib/tokens
//    (SEQ_HASH_5_8 = 13257339816715102022). So it is a parameter here.
// ------------------------------------------------------------------------------------------------------------------

/// Dynamo's `XXH3_SEED` (kv-router) / `CHAIN_XXH3_SEED`: the base seed of every tokens hash.
inline constexpr std::uint64_t kDynamoXxh3Seed = 1337;

/// Dynamo's salt hash (`compute_salt_hash(salt, lora_name)`): 1337 + XXH3-64(lora_name, 0) + XXH3-64(salt, 1),
/// wrapping, each term only when its string is non-empty. With both empty: 1337, the router's plain seed.
[[nodiscard]] PAGEDKV_API std::uint64_t dynamo_salt_hash(std::string_view lora_name, std::string_view salt) noexcept;

/// Dynamo's tokens hash of one block (`compute_block_hash_for_seq` per chunk): XXH3-64 over the token ids as
/// little-endian u32, followed by `mm_hashes` sorted ascending as little-endian u64 (empty for a text block),
/// with `seed` (dynamo_salt_hash). Thread-safe; allocates only for multimodal blocks.
[[nodiscard]] PAGEDKV_API std::uint64_t dynamo_tokens_hash(std::span<const std::uint32_t> token_ids,
                                                           std::uint64_t seed = kDynamoXxh3Seed,
                                                           std::span<const std::uint64_t> mm_hashes = {});

/// One step of Dynamo's rolling sequence hash: XXH3-64(le u64 parent_sequence_hash | le u64 tokens_hash,
/// chain_seed). See the section comment for which chain seed each Dynamo component uses.
[[nodiscard]] PAGEDKV_API std::uint64_t dynamo_sequence_hash(std::uint64_t parent_sequence_hash,
                                                             std::uint64_t tokens_hash,
                                                             std::uint64_t chain_seed = kDynamoXxh3Seed) noexcept;

/// Tokens hashes and sequence hashes of a request's full blocks (a trailing partial block is skipped), as
/// `compute_block_hash_for_seq` + `compute_seq_hash_for_block` give them. Throws kInvalidArgument when
/// block_size == 0.
struct DynamoBlockHashes {
  std::vector<std::uint64_t> tokens_hashes;
  std::vector<std::uint64_t> sequence_hashes;
};
[[nodiscard]] PAGEDKV_API DynamoBlockHashes dynamo_request_hashes(std::span<const std::uint32_t> token_ids,
                                                                  std::size_t block_size, std::uint64_t seed,
                                                                  std::uint64_t chain_seed = kDynamoXxh3Seed);

// ------------------------------------------------------------------------------------------------------------------
// llm-d: request keys of the precise prefix-cache scorer / KV-cache indexer.
//
// Source: llm-d/llm-d-kv-cache pkg/kvcache/kvblock/token_processor.go (`NewChunkedTokenDatabase`, `getInitHash`,
// `hash`, `prefixHashes`) and extra_keys.go (`MMHash`, `BlockExtraFeatures`):
//  - FNV-1a 64 (Go's hash/fnv New64a) over fxamacker/cbor `CanonicalEncOptions()` bytes of the Go value
//    `[]interface{}{parent uint64, tokens []uint32, extra}`.
//  - init hash = FNV-1a 64 of the HashSeed string's bytes (configured to match the engines' PYTHONHASHSEED;
//    default ""). root (the parent of a request's first block) = hash(init, nil tokens, model name): a nil Go
//    slice encodes as CBOR null, the model name as a text string.
//  - block key = hash(parent, block tokens, extra); extra = nil for text blocks, else the block's []MMHash, whose
//    elements (a Go struct with one field `Hash string` and no tags) encode as the one-entry map {"Hash": id}.
//  - full blocks only (chunkTokens drops the tail). The keys are llm-d's own: it indexes engine events by
//    recomputing these from the events' token_ids and extra_keys, not by the engine's hashes.
// ------------------------------------------------------------------------------------------------------------------

/// FNV-1a 64-bit (offset basis 14695981039346656037, prime 1099511628211) over `bytes`.
[[nodiscard]] constexpr std::uint64_t fnv1a64(std::span<const std::uint8_t> bytes) noexcept {
  std::uint64_t h = 14695981039346656037ULL;
  for (std::uint8_t b : bytes) {
    h ^= b;
    h *= 1099511628211ULL;
  }
  return h;
}

/// llm-d's `initHash`: FNV-1a 64 of the seed string's bytes.
[[nodiscard]] PAGEDKV_API std::uint64_t llmd_init_hash(std::string_view hash_seed) noexcept;

/// The CBOR bytes llm-d hashes for the root: `[uint init, null, text model_name]`. Allocates.
[[nodiscard]] PAGEDKV_API std::vector<std::uint8_t> llmd_root_cbor(std::string_view hash_seed,
                                                                   std::string_view model_name);

/// llm-d's root key for a model (`getInitHash(modelName)`): FNV-1a 64 of llmd_root_cbor.
[[nodiscard]] PAGEDKV_API std::uint64_t llmd_root_hash(std::string_view hash_seed, std::string_view model_name);

/// The CBOR bytes llm-d hashes for one block: `[uint parent, [uint tokens...], extra]`, extra = null when
/// `mm_identifiers` is empty, else `[{"Hash": id}, ...]` in the given order. Allocates.
[[nodiscard]] PAGEDKV_API std::vector<std::uint8_t> llmd_block_cbor(std::uint64_t parent,
                                                                    std::span<const std::uint32_t> token_ids,
                                                                    std::span<const std::string> mm_identifiers = {});

/// llm-d's key of one block: FNV-1a 64 of llmd_block_cbor(parent, token_ids, mm_identifiers).
[[nodiscard]] PAGEDKV_API std::uint64_t llmd_block_key(std::uint64_t parent, std::span<const std::uint32_t> token_ids,
                                                       std::span<const std::string> mm_identifiers = {});

/// One multimodal entry of llm-d's per-block extra features in its newest form (`kvblock.MMHash{Hash string;
/// Offset int64}`, llm-d-kv-cache pkg/kvcache/kvblock/extra_keys.go at 026424fd, parsed from the event's
/// `[identifier, offset]` pairs by ParseRawExtraKeys; bare strings are skipped there).
struct LlmdMmHash {
  std::string hash;          ///< The identifier as the event carries it.
  std::int64_t offset = 0;   ///< Item offset - block start, in tokens (negative when it began in an earlier block).
};

/// The CBOR bytes llm-d (newest) hashes for one block with multimodal features: `[uint parent, [uint tokens...],
/// [{"Hash": id, "Offset": off}, ...]]` (a Go struct of two untagged fields encodes as a two-key map; under
/// `CanonicalEncOptions` "Hash" sorts before "Offset" by length and bytewise alike), or extra = null when `mm` is
/// empty. Allocates. The two-key form is inferred from fxamacker/cbor's defaults, not run (docs/events-wire.md).
[[nodiscard]] PAGEDKV_API std::vector<std::uint8_t> llmd_block_cbor_mm(std::uint64_t parent,
                                                                       std::span<const std::uint32_t> token_ids,
                                                                       std::span<const LlmdMmHash> mm);

/// llm-d's (newest) key of one block with multimodal features: FNV-1a 64 of llmd_block_cbor_mm.
[[nodiscard]] PAGEDKV_API std::uint64_t llmd_block_key_mm(std::uint64_t parent, std::span<const std::uint32_t> token_ids,
                                                          std::span<const LlmdMmHash> mm);

/// llm-d's keys of a text request's full blocks (`TokensToKVBlockKeys(EmptyBlockHash, tokens, model, nil)`): the
/// chain starts at llmd_root_hash(hash_seed, model_name). Throws kInvalidArgument when block_size == 0.
[[nodiscard]] PAGEDKV_API std::vector<std::uint64_t> llmd_request_keys(std::span<const std::uint32_t> token_ids,
                                                                       std::size_t block_size,
                                                                       std::string_view hash_seed,
                                                                       std::string_view model_name);

}  // namespace pagedkv::identity
