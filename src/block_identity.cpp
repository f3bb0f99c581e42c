// The keys of one block in vLLM's, Dynamo's and llm-d's schemes (pagedkv/block_identity.hpp; the facts and their
// sources are in that header and in docs/events-wire.md section 9).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <string>

#include <pagedkv/block_identity.hpp>
#include <pagedkv/error.hpp>

namespace pagedkv::identity {

namespace {

Sha256Digest sha256(std::span<const std::uint8_t> bytes) {
  Sha256Digest d{};
  unsigned int len = 0;
  if (EVP_Digest(bytes.data(), bytes.size(), d.data(), &len, EVP_sha256(), nullptr) != 1 || len != d.size()) {
    detail::raise(Errc::kInvalidArgument, "block_identity: SHA-256 failed inside OpenSSL");
  }
  return d;
}

std::uint64_t xxh3_64(const void* p, std::size_t n, std::uint64_t seed) noexcept {
  return XXH3_64bits_withSeed(p, n, seed);
}

void put_le(std::vector<std::uint8_t>& out, std::uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}

void require_block_size(std::size_t block_size, const char* what) {
  if (block_size == 0) {
    detail::raise(Errc::kInvalidArgument, std::string(what) + ": block_size must be >= 1 (got 0)");
  }
}

}  // namespace

// ---- vLLM ----

std::vector<std::uint8_t> vllm_block_cbor(const Sha256Digest& parent, std::span<const std::uint32_t> token_ids,
                                          const VllmExtraKeys* extra) {
  CborWriter w;
  w.array(3);
  w.bytes(parent);
  w.array(token_ids.size());
  for (std::uint32_t t : token_ids) w.uint(t);
  if (extra == nullptr || extra->empty()) {
    w.null();
    return w.data();
  }
  const std::size_t n = (extra->lora_name ? 1 : 0) + extra->mm.size() + (extra->cache_salt ? 1 : 0) +
                        (extra->prompt_embeds_hash ? 1 : 0);
  w.array(n);
  if (extra->lora_name) w.text(*extra->lora_name);
  for (const VllmMmKey& m : extra->mm) {
    if (m.offset) {
      w.array(2);
      w.text(m.identifier);
      w.sint(*m.offset);
    } else {
      w.text(m.identifier);
    }
  }
  if (extra->cache_salt) w.text(*extra->cache_salt);
  if (extra->prompt_embeds_hash) w.bytes(*extra->prompt_embeds_hash);
  return w.data();
}

Sha256Digest vllm_none_hash(std::string_view seed) {
  CborWriter w;
  w.text(seed);
  return sha256(w.data());
}

Sha256Digest vllm_block_hash(const Sha256Digest& parent, std::span<const std::uint32_t> token_ids,
                             const VllmExtraKeys* extra) {
  return sha256(vllm_block_cbor(parent, token_ids, extra));
}

std::vector<Sha256Digest> vllm_request_block_hashes(std::span<const std::uint32_t> token_ids, std::size_t block_size,
                                                    const VllmRequestKeys& keys, const Sha256Digest& none_hash) {
  require_block_size(block_size, "vllm_request_block_hashes");
  for (std::size_t i = 1; i < keys.mm.size(); ++i) {
    if (keys.mm[i].offset_tokens < keys.mm[i - 1].offset_tokens) {
      detail::raise(Errc::kInvalidArgument, "vllm_request_block_hashes: multimodal item " + std::to_string(i) +
                                                " at offset " + std::to_string(keys.mm[i].offset_tokens) +
                                                " is not sorted by offset (previous item at " +
                                                std::to_string(keys.mm[i - 1].offset_tokens) + ")");
    }
  }
  const std::size_t num_blocks = token_ids.size() / block_size;
  std::vector<Sha256Digest> out;
  out.reserve(num_blocks);
  Sha256Digest parent = none_hash;
  VllmExtraKeys extra;
  for (std::size_t b = 0; b < num_blocks; ++b) {
    const std::uint64_t start = b * block_size;
    const std::uint64_t end = start + block_size;
    extra = VllmExtraKeys{};
    extra.lora_name = keys.lora_name;
    for (const VllmMmItem& m : keys.mm) {
      // vLLM's _gen_mm_extra_hash_keys: the item overlaps [start, end) when offset < end and offset + length >
      // start; it is keyed with its offset relative to the block start.
      if (m.offset_tokens >= end) break;
      if (m.offset_tokens + m.length_tokens <= start) continue;
      VllmMmKey k{m.identifier, std::nullopt};
      if (!keys.mm_bare_identifiers) {
        k.offset = static_cast<std::int64_t>(m.offset_tokens) - static_cast<std::int64_t>(start);
      }
      extra.mm.push_back(std::move(k));
    }
    if (b == 0 && !keys.cache_salt.empty()) extra.cache_salt = keys.cache_salt;
    parent = vllm_block_hash(parent, token_ids.subspan(start, block_size), &extra);
    out.push_back(parent);
  }
  return out;
}

// ---- Dynamo ----

std::uint64_t dynamo_salt_hash(std::string_view lora_name, std::string_view salt) noexcept {
  std::uint64_t seed = kDynamoXxh3Seed;
  if (!lora_name.empty()) seed += xxh3_64(lora_name.data(), lora_name.size(), 0);  // unsigned: wraps mod 2^64
  if (!salt.empty()) seed += xxh3_64(salt.data(), salt.size(), 1);
  return seed;
}

std::uint64_t dynamo_tokens_hash(std::span<const std::uint32_t> token_ids, std::uint64_t seed,
                                 std::span<const std::uint64_t> mm_hashes) {
  std::vector<std::uint8_t> bytes;
  bytes.reserve(4 * token_ids.size() + 8 * mm_hashes.size());
  for (std::uint32_t t : token_ids) put_le(bytes, t, 4);
  if (!mm_hashes.empty()) {
    std::vector<std::uint64_t> sorted(mm_hashes.begin(), mm_hashes.end());
    std::sort(sorted.begin(), sorted.end());
    for (std::uint64_t h : sorted) put_le(bytes, h, 8);
  }
  return xxh3_64(bytes.data(), bytes.size(), seed);
}

std::uint64_t dynamo_sequence_hash(std::uint64_t parent_sequence_hash, std::uint64_t tokens_hash,
                                   std::uint64_t chain_seed) noexcept {
  std::uint8_t bytes[16];
  for (int i = 0; i < 8; ++i) {
    bytes[i] = static_cast<std::uint8_t>(parent_sequence_hash >> (8 * i));
    bytes[8 + i] = static_cast<std::uint8_t>(tokens_hash >> (8 * i));
  }
  return xxh3_64(bytes, sizeof bytes, chain_seed);
}

DynamoBlockHashes dynamo_request_hashes(std::span<const std::uint32_t> token_ids, std::size_t block_size,
                                        std::uint64_t seed, std::uint64_t chain_seed) {
  require_block_size(block_size, "dynamo_request_hashes");
  const std::size_t num_blocks = token_ids.size() / block_size;
  DynamoBlockHashes out;
  out.tokens_hashes.reserve(num_blocks);
  out.sequence_hashes.reserve(num_blocks);
  for (std::size_t b = 0; b < num_blocks; ++b) {
    const std::uint64_t h = dynamo_tokens_hash(token_ids.subspan(b * block_size, block_size), seed);
    out.tokens_hashes.push_back(h);
    out.sequence_hashes.push_back(b == 0 ? h : dynamo_sequence_hash(out.sequence_hashes.back(), h, chain_seed));
  }
  return out;
}

// ---- llm-d ----

std::uint64_t llmd_init_hash(std::string_view hash_seed) noexcept {
  return fnv1a64({reinterpret_cast<const std::uint8_t*>(hash_seed.data()), hash_seed.size()});
}

std::vector<std::uint8_t> llmd_root_cbor(std::string_view hash_seed, std::string_view model_name) {
  CborWriter w;
  w.array(3);
  w.uint(llmd_init_hash(hash_seed));
  w.null();  // a nil []uint32: fxamacker/cbor's default NilContainersMode writes null
  w.text(model_name);
  return w.data();
}

std::uint64_t llmd_root_hash(std::string_view hash_seed, std::string_view model_name) {
  return fnv1a64(llmd_root_cbor(hash_seed, model_name));
}

std::vector<std::uint8_t> llmd_block_cbor(std::uint64_t parent, std::span<const std::uint32_t> token_ids,
                                          std::span<const std::string> mm_identifiers) {
  CborWriter w;
  w.array(3);
  w.uint(parent);
  w.array(token_ids.size());
  for (std::uint32_t t : token_ids) w.uint(t);
  if (mm_identifiers.empty()) {
    w.null();
  } else {
    w.array(mm_identifiers.size());
    for (const std::string& id : mm_identifiers) {
      w.map(1);
      w.text("Hash");
      w.text(id);
    }
  }
  return w.data();
}

std::uint64_t llmd_block_key(std::uint64_t parent, std::span<const std::uint32_t> token_ids,
                             std::span<const std::string> mm_identifiers) {
  return fnv1a64(llmd_block_cbor(parent, token_ids, mm_identifiers));
}

std::vector<std::uint8_t> llmd_block_cbor_mm(std::uint64_t parent, std::span<const std::uint32_t> token_ids,
                                             std::span<const LlmdMmHash> mm) {
  CborWriter w;
  w.array(3);
  w.uint(parent);
  w.array(token_ids.size());
  for (std::uint32_t t : token_ids) w.uint(t);
  if (mm.empty()) {
    w.null();
  } else {
    w.array(mm.size());
    for (const LlmdMmHash& m : mm) {
      w.map(2);
      w.text("Hash");
      w.text(m.hash);
      w.text("Offset");
      w.sint(m.offset);
    }
  }
  return w.data();
}

std::uint64_t llmd_block_key_mm(std::uint64_t parent, std::span<const std::uint32_t> token_ids,
                                std::span<const LlmdMmHash> mm) {
  return fnv1a64(llmd_block_cbor_mm(parent, token_ids, mm));
}

std::vector<std::uint64_t> llmd_request_keys(std::span<const std::uint32_t> token_ids, std::size_t block_size,
                                             std::string_view hash_seed, std::string_view model_name) {
  require_block_size(block_size, "llmd_request_keys");
  const std::size_t num_blocks = token_ids.size() / block_size;
  std::vector<std::uint64_t> out;
  out.reserve(num_blocks);
  std::uint64_t parent = llmd_root_hash(hash_seed, model_name);
  for (std::size_t b = 0; b < num_blocks; ++b) {
    parent = llmd_block_key(parent, token_ids.subspan(b * block_size, block_size));
    out.push_back(parent);
  }
  return out;
}

}  // namespace pagedkv::identity
