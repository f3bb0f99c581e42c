// Tests of pagedkv/prefix_hash_index.hpp and pagedkv/hash.hpp: the canonical block encoding (pinned by known
// answers derived outside this library, and re-encoded independently here and hashed with OpenSSL EVP / libxxhash),
// the chain property, extra keys (salt, adapter, multimodal items), per-pool seeds, both hash policies, and the
// hash -> block index itself.
#include <catch2/catch.hpp>

#include <openssl/evp.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/error.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)
#include <pagedkv/prefix_hash_index.hpp>

namespace {

using pagedkv::BlockHash;
using pagedkv::Errc;
using pagedkv::MultimodalItem;
using pagedkv::RequestKeys;
using pagedkv::Sha256Hasher;
using pagedkv::TokenId;
using pagedkv::Xxh3Hasher;
using Toks = std::vector<TokenId>;

using pagedkv_test::expect_error;

BlockHash item_hash(std::uint8_t first) {
  BlockHash h;
  for (std::uint8_t i = 0; i < 16; ++i) h.bytes[i] = static_cast<std::uint8_t>(first + i);
  return h;
}

// ---- An independent implementation of the documented encoding (docs/design.md "Block hashes") ----
struct Bytes {
  std::vector<unsigned char> v;
  void le(std::uint64_t x, int n) {
    for (int i = 0; i < n; ++i) v.push_back(static_cast<unsigned char>((x >> (8 * i)) & 0xff));
  }
  void raw(const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    v.insert(v.end(), c, c + n);
  }
};

std::vector<unsigned char> my_encode(const BlockHash& parent, const Toks& tokens, std::uint64_t block_start,
                                     const RequestKeys* keys) {
  Bytes b;
  b.raw(parent.bytes.data(), 16);
  b.le(tokens.size(), 4);
  for (TokenId t : tokens) b.le(static_cast<std::uint32_t>(t), 4);
  const std::uint64_t adapter = keys ? keys->adapter_id : 0;
  b.le(adapter, 8);
  std::vector<const MultimodalItem*> over;
  if (keys) {
    for (const auto& m : keys->multimodal) {
      const bool overlaps = m.offset_tokens < block_start + tokens.size() && m.offset_tokens + m.length_tokens > block_start;
      if (overlaps) over.push_back(&m);
    }
  }
  b.le(over.size(), 4);
  for (const auto* m : over) {
    b.raw(m->item_hash.bytes.data(), 16);
    b.le(static_cast<std::uint64_t>(static_cast<std::int64_t>(m->offset_tokens) - static_cast<std::int64_t>(block_start)), 8);
  }
  const std::string salt = (keys && block_start == 0) ? keys->salt : std::string();
  b.le(salt.size(), 4);
  b.raw(salt.data(), salt.size());
  return b.v;
}

std::vector<unsigned char> root_encoding(std::uint64_t seed) {
  Bytes b;
  b.raw("pagedkv.root.v1", 16);  // 15 characters and the terminating NUL
  b.le(seed, 8);
  return b.v;
}

BlockHash evp_sha256_128(const std::vector<unsigned char>& msg) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  REQUIRE(EVP_Digest(msg.data(), msg.size(), md, &len, EVP_sha256(), nullptr) == 1);
  REQUIRE(len == 32);
  BlockHash h;
  std::memcpy(h.bytes.data(), md, 16);
  return h;
}

BlockHash xxh3_128(const std::vector<unsigned char>& msg) {
  const XXH128_hash_t d = XXH3_128bits(msg.data(), msg.size());
  BlockHash h;
  // Canonical (big-endian) form: high 64 bits first.
  for (int i = 0; i < 8; ++i) h.bytes[i] = static_cast<std::uint8_t>(d.high64 >> (56 - 8 * i));
  for (int i = 0; i < 8; ++i) h.bytes[8 + i] = static_cast<std::uint8_t>(d.low64 >> (56 - 8 * i));
  return h;
}

template <class H>
BlockHash reference_hash(const std::vector<unsigned char>& msg) {
  if constexpr (std::is_same_v<H, Sha256Hasher>) {
    return evp_sha256_128(msg);
  } else {
    return xxh3_128(msg);
  }
}

RequestKeys keyed_example() {
  RequestKeys k;
  k.adapter_id = 7;
  k.multimodal.push_back({item_hash(0), 2, 8});  // covers [2, 10): blocks 0, 1, 2 at block size 4
  k.salt = "tenant-a";
  return k;
}

}  // namespace

TEST_CASE("BlockHash: hex, low64, comparison", "[hash]") {
  const BlockHash h = item_hash(0);
  CHECK(h.hex() == "000102030405060708090a0b0c0d0e0f");
  CHECK(h.low64() == 0x0706050403020100ULL);
  BlockHash g = h;
  CHECK(g == h);
  g.bytes[15] = 0x10;
  CHECK(g != h);
  CHECK(h < g);
  CHECK(pagedkv::BlockHashHasher{}(h) == static_cast<std::size_t>(h.low64()));
  CHECK(BlockHash{}.hex() == std::string(32, '0'));
  CHECK(std::string(Sha256Hasher::kName) == "sha256");
  CHECK(std::string(Xxh3Hasher::kName) == "xxh3_128");
  STATIC_REQUIRE(Sha256Hasher::kCryptographic);
  STATIC_REQUIRE_FALSE(Xxh3Hasher::kCryptographic);
}

TEST_CASE("Sha256Hasher: truncated SHA-256 of known inputs", "[hash][sha256][kat]") {
  const auto hash_str = [](const std::string& s) {
    return Sha256Hasher::hash(std::as_bytes(std::span<const char>(s.data(), s.size())));
  };
  // FIPS 180-2 test vectors, first 16 bytes of the digest.
  CHECK(hash_str("abc").hex() == "ba7816bf8f01cfea414140de5dae2223");
  CHECK(hash_str("").hex() == "e3b0c44298fc1c149afbf4c8996fb924");
  // XXH3-128 of the empty input (canonical form), from the xxHash test suite: 99aa06d3014798d86001c324468d497f.
  CHECK(Xxh3Hasher::hash({}).hex() == "99aa06d3014798d86001c324468d497f");
}

TEST_CASE("PrefixHashIndex<Sha256>: known-answer test of the canonical block encoding", "[prefix_hash_index][kat]") {
  // Expected values computed once with Python's hashlib (an independent SHA-256) over the byte layout documented in
  // detail::encode_block:
  //   root   = sha256(b"pagedkv.root.v1\0" + u64le(seed))[:16]
  //   block  = sha256(parent16 + u32le(n) + i32le(tokens) + u64le(adapter) + u32le(items)
  //                   + (item16 + i64le(offset - block_start))* + u32le(salt_len) + salt)[:16]
  SECTION("seed 0, no keys") {
    pagedkv::PrefixHashIndex<> idx(8, 0);
    CHECK(idx.root().hex() == "1d8476004cfd180b410352e69b92070d");
    const BlockHash b0 = idx.hash_block(idx.root(), Toks{1, 2, 3, 4}, 0, nullptr);
    CHECK(b0.hex() == "0e2bc1e5dd754cd34151a29726e99829");
    const BlockHash b1 = idx.hash_block(b0, Toks{5, 6, 7, -8}, 4, nullptr);
    CHECK(b1.hex() == "72d0d29c57d60715778622d4158a7768");
    std::vector<BlockHash> chain;
    idx.hash_full_blocks(Toks{1, 2, 3, 4, 5, 6, 7, -8, 9}, 4, nullptr, chain);
    REQUIRE(chain.size() == 2);  // only full blocks
    CHECK(chain[0] == b0);
    CHECK(chain[1] == b1);
  }
  SECTION("seed 42") {
    pagedkv::PrefixHashIndex<> idx(8, 42);
    CHECK(idx.root().hex() == "287b896034e220aa912e205826b9e969");
    const BlockHash b0 = idx.hash_block(idx.root(), Toks{1, 2, 3, 4}, 0, nullptr);
    CHECK(b0.hex() == "563a1b5f59f8ec52295e9258ef122ad1");
    CHECK(idx.hash_block(b0, Toks{5, 6, 7, -8}, 4, nullptr).hex() == "f5a7e69bda7d55a53609b27260359c07");
  }
  SECTION("adapter 7, a multimodal item at offset 2 (length 8), salt \"tenant-a\"") {
    pagedkv::PrefixHashIndex<> idx(8, 0);
    const RequestKeys k = keyed_example();
    const BlockHash k0 = idx.hash_block(idx.root(), Toks{1, 2, 3, 4}, 0, &k);
    CHECK(k0.hex() == "c8cf9df501c502b998afd69b780450b7");
    // Second block: no salt; the item's offset relative to the block start is -2.
    CHECK(idx.hash_block(k0, Toks{5, 6, 7, -8}, 4, &k).hex() == "9964bd60c7aab283336a1ff12b520994");
    // An all-default RequestKeys is the same as no keys.
    const RequestKeys none;
    CHECK(idx.hash_block(idx.root(), Toks{1, 2, 3, 4}, 0, &none).hex() == "0e2bc1e5dd754cd34151a29726e99829");
  }
}

TEMPLATE_TEST_CASE("PrefixHashIndex: hashes equal an independent encoding hashed by OpenSSL EVP / libxxhash",
                   "[prefix_hash_index][kat]", Sha256Hasher, Xxh3Hasher) {
  std::mt19937_64 rng(20240611);
  for (int iter = 0; iter < 300; ++iter) {
    const std::uint64_t seed = rng();
    pagedkv::PrefixHashIndex<TestType> idx(4, seed);
    REQUIRE(idx.root() == reference_hash<TestType>(root_encoding(seed)));
    const std::uint32_t bs = 1 + static_cast<std::uint32_t>(rng() % 20);
    const std::size_t nblocks = 1 + rng() % 4;
    Toks tokens(bs * nblocks + rng() % bs);
    for (auto& t : tokens) t = static_cast<TokenId>(rng());  // negative ids too
    RequestKeys keys;
    const bool with_keys = rng() % 3 != 0;
    if (with_keys) {
      keys.adapter_id = rng() % 2 ? rng() : 0;
      const std::size_t items = rng() % 3;
      for (std::size_t i = 0; i < items; ++i) {
        keys.multimodal.push_back({item_hash(static_cast<std::uint8_t>(rng())), rng() % tokens.size(), 1 + rng() % 9});
      }
      if (rng() % 2) keys.salt = std::string(rng() % 12, static_cast<char>('a' + rng() % 26));
    }
    const RequestKeys* kp = with_keys ? &keys : nullptr;
    std::vector<BlockHash> chain;
    idx.hash_full_blocks(tokens, bs, kp, chain);
    REQUIRE(chain.size() == nblocks);
    BlockHash parent = idx.root();
    for (std::size_t i = 0; i < nblocks; ++i) {
      const Toks blk(tokens.begin() + static_cast<std::ptrdiff_t>(i * bs),
                     tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * bs));
      const BlockHash want = reference_hash<TestType>(my_encode(parent, blk, i * bs, kp));
      REQUIRE(chain[i] == want);
      REQUIRE(idx.hash_block(parent, blk, i * bs, kp) == want);
      parent = want;
    }
  }
}

TEMPLATE_TEST_CASE("PrefixHashIndex: chain property", "[prefix_hash_index][chain]", Sha256Hasher, Xxh3Hasher) {
  pagedkv::PrefixHashIndex<TestType> idx(8, 0);
  const Toks a{1, 2, 3, 4}, b{5, 6, 7, 8}, c{9, 9, 9, 9};
  const BlockHash ha = idx.hash_block(idx.root(), a, 0, nullptr);
  const BlockHash hc = idx.hash_block(idx.root(), c, 0, nullptr);
  // Same tokens at a different position (after a parent instead of first) hash differently.
  const BlockHash b_first = idx.hash_block(idx.root(), b, 0, nullptr);
  const BlockHash b_after_a = idx.hash_block(ha, b, 4, nullptr);
  const BlockHash b_after_c = idx.hash_block(hc, b, 4, nullptr);
  CHECK(b_first != b_after_a);
  CHECK(b_after_a != b_after_c);  // same tokens, same position, different parents
  CHECK(ha != hc);
  // Deterministic.
  CHECK(idx.hash_block(ha, b, 4, nullptr) == b_after_a);
  // Token order and block length matter.
  CHECK(idx.hash_block(idx.root(), Toks{2, 1, 3, 4}, 0, nullptr) != ha);
  CHECK(idx.hash_block(idx.root(), Toks{1, 2, 3}, 0, nullptr) != ha);
  // Without keys, the position only enters through the parent: the same parent and tokens at another start agree.
  CHECK(idx.hash_block(ha, b, 8, nullptr) == b_after_a);

  SECTION("hash_full_blocks extends an existing chain from out.size()") {
    std::vector<BlockHash> chain;
    idx.hash_full_blocks(Toks{1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9}, 4, nullptr, chain);
    REQUIRE(chain.size() == 3);
    CHECK(chain[0] == ha);
    CHECK(chain[1] == b_after_a);
    std::vector<BlockHash> partial{chain[0]};
    idx.hash_full_blocks(Toks{1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 9, 9}, 4, nullptr, partial);
    CHECK(partial == chain);
    // An existing entry is trusted as the chain's prefix (not recomputed).
    std::vector<BlockHash> fake{hc};
    idx.hash_full_blocks(Toks{1, 2, 3, 4, 5, 6, 7, 8}, 4, nullptr, fake);
    REQUIRE(fake.size() == 2);
    CHECK(fake[1] == b_after_c);
    // Nothing to add: unchanged.
    idx.hash_full_blocks(Toks{1, 2, 3}, 4, nullptr, partial);
    CHECK(partial == chain);
  }
}

TEMPLATE_TEST_CASE("PrefixHashIndex: extra keys", "[prefix_hash_index][keys]", Sha256Hasher, Xxh3Hasher) {
  pagedkv::PrefixHashIndex<TestType> idx(8, 0);
  const Toks t0{1, 2, 3, 4}, t1{5, 6, 7, 8}, t2{9, 10, 11, 12};
  const BlockHash p0 = idx.hash_block(idx.root(), t0, 0, nullptr);
  const BlockHash p1 = idx.hash_block(p0, t1, 4, nullptr);

  SECTION("salt: only the first block's own hash, every later block through the chain") {
    RequestKeys s;
    s.salt = "tenant-a";
    RequestKeys s2;
    s2.salt = "tenant-b";
    const BlockHash a0 = idx.hash_block(idx.root(), t0, 0, &s);
    const BlockHash b0 = idx.hash_block(idx.root(), t0, 0, &s2);
    CHECK(a0 != p0);
    CHECK(b0 != p0);
    CHECK(a0 != b0);
    // For a later block with the same parent the salt is not mixed in again...
    CHECK(idx.hash_block(p0, t1, 4, &s) == p1);
    // ...but its parent differs, so every block of a salted chain differs from the unsalted and other-salt chains.
    std::vector<BlockHash> ca, cb, cn;
    const Toks all{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    idx.hash_full_blocks(all, 4, &s, ca);
    idx.hash_full_blocks(all, 4, &s2, cb);
    idx.hash_full_blocks(all, 4, nullptr, cn);
    for (std::size_t i = 0; i < 3; ++i) {
      CHECK(ca[i] != cb[i]);
      CHECK(ca[i] != cn[i]);
    }
    // Salt bytes are length-prefixed: "" and a salt that is a prefix of another differ.
    RequestKeys s3;
    s3.salt = "tenant-";
    CHECK(idx.hash_block(idx.root(), t0, 0, &s3) != a0);
  }
  SECTION("adapter id changes every block's own hash") {
    RequestKeys k;
    k.adapter_id = 3;
    RequestKeys k2;
    k2.adapter_id = 4;
    CHECK(idx.hash_block(idx.root(), t0, 0, &k) != p0);
    CHECK(idx.hash_block(p0, t1, 4, &k) != p1);  // same parent: the adapter is mixed into every block
    CHECK(idx.hash_block(p0, t1, 4, &k) != idx.hash_block(p0, t1, 4, &k2));
  }
  SECTION("multimodal item: id and offset relative to the block start, only in blocks it overlaps") {
    RequestKeys img;
    img.multimodal.push_back({item_hash(1), 5, 2});  // positions 5, 6: block 1 only
    CHECK(idx.hash_block(idx.root(), t0, 0, &img) == p0);  // block 0 does not overlap
    const BlockHash m1 = idx.hash_block(p0, t1, 4, &img);
    CHECK(m1 != p1);
    // Another image with the same token ids: different hash.
    RequestKeys img2 = img;
    img2.multimodal[0].item_hash = item_hash(2);
    CHECK(idx.hash_block(p0, t1, 4, &img2) != m1);
    // Same image at another offset inside the block: different hash.
    RequestKeys img3 = img;
    img3.multimodal[0].offset_tokens = 6;
    CHECK(idx.hash_block(p0, t1, 4, &img3) != m1);
    // The offset is relative to the block start: the same block content at start 8 with the item at 9 agrees.
    RequestKeys img4 = img;
    img4.multimodal[0].offset_tokens = 9;
    CHECK(idx.hash_block(p0, t1, 8, &img4) == m1);
    // The length does not enter the hash (only overlap does): an item ending inside vs. past the block.
    RequestKeys img5 = img;
    img5.multimodal[0].length_tokens = 100;
    CHECK(idx.hash_block(p0, t1, 4, &img5) == m1);
    // ...but overlap does: an item starting just past the block does not affect it, one ending just inside does.
    RequestKeys after;
    after.multimodal.push_back({item_hash(1), 8, 3});
    CHECK(idx.hash_block(p0, t1, 4, &after) == p1);
    RequestKeys before;
    before.multimodal.push_back({item_hash(1), 1, 3});  // [1, 4): ends at the block start
    CHECK(idx.hash_block(p0, t1, 4, &before) == p1);
    before.multimodal[0].length_tokens = 4;  // [1, 5): overlaps position 4
    CHECK(idx.hash_block(p0, t1, 4, &before) != p1);
    // Later blocks change through the chain.
    std::vector<BlockHash> c;
    idx.hash_full_blocks(Toks{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 4, &img, c);
    CHECK(c[0] == p0);
    CHECK(c[1] == m1);
    CHECK(c[2] != idx.hash_block(p1, t2, 8, nullptr));
    CHECK(c[2] == idx.hash_block(m1, t2, 8, nullptr));  // block 2 itself has no item
  }
}

TEST_CASE("PrefixHashIndex: hash policies and seeds", "[prefix_hash_index][seed]") {
  const Toks t{11, 12, 13, 14, 15, 16, 17, 18};
  std::vector<BlockHash> sha_a, sha_b, sha_seed, xxh_a, xxh_b;
  pagedkv::PrefixHashIndex<Sha256Hasher> s1(4, 7), s2(4, 7), s3(4, 8);
  pagedkv::PrefixHashIndex<Xxh3Hasher> x1(4, 7), x2(4, 7);
  s1.hash_full_blocks(t, 4, nullptr, sha_a);
  s2.hash_full_blocks(t, 4, nullptr, sha_b);
  s3.hash_full_blocks(t, 4, nullptr, sha_seed);
  x1.hash_full_blocks(t, 4, nullptr, xxh_a);
  x2.hash_full_blocks(t, 4, nullptr, xxh_b);
  CHECK(sha_a == sha_b);  // same seed, same policy: equal
  CHECK(xxh_a == xxh_b);
  CHECK(s1.root() != s3.root());
  for (std::size_t i = 0; i < 2; ++i) {
    CHECK(sha_a[i] != sha_seed[i]);  // the seed changes every hash
    CHECK(sha_a[i] != xxh_a[i]);     // the policies differ
  }
  CHECK(s1.root() != x1.root());
}

TEST_CASE("PrefixHashIndex: the hash -> block map", "[prefix_hash_index][index]") {
  pagedkv::PrefixHashIndex<> idx(6, 0);
  const BlockHash h1 = idx.hash_block(idx.root(), Toks{1}, 0, nullptr);
  const BlockHash h2 = idx.hash_block(idx.root(), Toks{2}, 0, nullptr);
  const BlockHash h3 = idx.hash_block(idx.root(), Toks{3}, 0, nullptr);
  CHECK(idx.size() == 0);
  CHECK_FALSE(idx.find(h1).has_value());
  CHECK_FALSE(idx.hash_of(3).has_value());
  CHECK(idx.insert(h1, 3) == 3u);
  CHECK(idx.find(h1) == std::optional<std::uint32_t>(3));
  CHECK(idx.hash_of(3) == std::optional<BlockHash>(h1));
  CHECK(idx.size() == 1);
  // A second block with the same hash is not registered: the registered block comes back, nothing changes.
  CHECK(idx.insert(h1, 4) == 3u);
  CHECK_FALSE(idx.hash_of(4).has_value());
  CHECK(idx.size() == 1);
  CHECK(idx.insert(h2, 4) == 4u);
  CHECK(idx.size() == 2);

  SECTION("misuse throws and changes nothing") {
    CHECK_THAT(expect_error([&] { idx.insert(h3, 3); }, Errc::kInvalidArgument), Catch::Contains("block 3"));
    CHECK_THAT(expect_error([&] { idx.insert(h3, 0); }, Errc::kBlockOutOfRange), Catch::Contains("block id 0"));
    CHECK_THAT(expect_error([&] { idx.insert(h3, 6); }, Errc::kBlockOutOfRange), Catch::Contains("block id 6"));
    CHECK(idx.size() == 2);
    CHECK_FALSE(idx.find(h3).has_value());
    CHECK(idx.hash_of(3) == std::optional<BlockHash>(h1));
  }
  SECTION("erase_block") {
    CHECK(idx.erase_block(3) == std::optional<BlockHash>(h1));
    CHECK_FALSE(idx.find(h1).has_value());
    CHECK_FALSE(idx.hash_of(3).has_value());
    CHECK_FALSE(idx.erase_block(3).has_value());  // not registered any more
    CHECK_FALSE(idx.erase_block(5).has_value());
    CHECK_FALSE(idx.erase_block(100).has_value());
    CHECK(idx.size() == 1);
    CHECK(idx.insert(h1, 5) == 5u);  // the hash can be registered to another block now
    CHECK(idx.insert(h3, 3) == 3u);  // and block 3 can take another hash
  }
  SECTION("clear") {
    idx.clear();
    CHECK(idx.size() == 0);
    CHECK_FALSE(idx.find(h1).has_value());
    CHECK_FALSE(idx.hash_of(3).has_value());
    CHECK(idx.insert(h1, 4) == 4u);
  }
}

TEMPLATE_TEST_CASE("KVCacheManager hashing: reproducible across managers, separated by seed, salt, adapter, image",
                   "[prefix_hash_index][kv_cache_manager]", Sha256Hasher, Xxh3Hasher) {
  using Mgr = pagedkv::KVCacheManager<TestType>;
  pagedkv::CacheConfig cfg;
  cfg.num_blocks = 32;
  cfg.block_size = 4;
  cfg.hash_seed = 99;
  cfg.enable_events = true;
  const Toks prompt{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};

  const auto build = [](Mgr& m, std::vector<pagedkv::SeqId> batch) {
    pagedkv_test::build_step(m, batch);  // registers the batch's full blocks
  };
  auto stored_hashes = [&](Mgr& m) {
    std::vector<pagedkv::KVEvent> ev;
    m.drain_events(ev);
    std::vector<BlockHash> hs;
    for (const auto& e : ev) {
      if (e.type == pagedkv::KVEventType::kBlockStored) hs.push_back(e.hash);
    }
    return hs;
  };

  SECTION("two managers with the same seed agree with each other and with PrefixHashIndex") {
    Mgr m1(cfg), m2(cfg);
    REQUIRE(m1.try_admit(1, prompt).admitted());
    REQUIRE(m2.try_admit(5, prompt).admitted());
    build(m1, {1});
    build(m2, {5});
    const auto h1 = stored_hashes(m1);
    const auto h2 = stored_hashes(m2);
    REQUIRE(h1.size() == 3);
    CHECK(h1 == h2);
    pagedkv::PrefixHashIndex<TestType> idx(2, 99);
    std::vector<BlockHash> want;
    idx.hash_full_blocks(prompt, 4, nullptr, want);
    CHECK(h1 == want);
    CHECK(m1.prefix_index().hash_of(m1.block_ids(1)[0]) == std::optional<BlockHash>(want[0]));
  }
  SECTION("another seed gives other hashes") {
    Mgr m1(cfg);
    auto cfg2 = cfg;
    cfg2.hash_seed = 100;
    Mgr m2(cfg2);
    REQUIRE(m1.try_admit(1, prompt).admitted());
    REQUIRE(m2.try_admit(1, prompt).admitted());
    build(m1, {1});
    build(m2, {1});
    const auto h1 = stored_hashes(m1);
    const auto h2 = stored_hashes(m2);
    REQUIRE(h1.size() == 3);
    REQUIRE(h2.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) CHECK(h1[i] != h2[i]);
  }
  SECTION("different salts never share a block") {
    Mgr m(cfg);
    RequestKeys a, b;
    a.salt = "alice";
    b.salt = "bob";
    REQUIRE(m.try_admit(1, prompt, &a).admitted());
    build(m, {1});
    CHECK(m.lookup(prompt, &a) == 12);
    CHECK(m.lookup(prompt, &b) == 0);
    CHECK(m.lookup(prompt) == 0);
    const auto r = m.try_admit(2, prompt, &b);
    REQUIRE(r.admitted());
    CHECK(r.num_cached_tokens == 0);
    build(m, {2});  // same tokens, other salt: registered separately, not deduplicated
    for (std::size_t i = 0; i < 4; ++i) CHECK(m.block_ids(1)[i] != m.block_ids(2)[i]);
    CHECK(m.prefix_index().size() == 6);
    const auto r3 = m.try_admit(3, prompt, &a);  // same salt: hits all 3 full blocks
    CHECK(r3.num_cached_tokens == 12);
  }
  SECTION("an adapter id separates every block") {
    Mgr m(cfg);
    RequestKeys lora;
    lora.adapter_id = 12;
    REQUIRE(m.try_admit(1, prompt, &lora).admitted());
    build(m, {1});
    CHECK(m.lookup(prompt) == 0);
    CHECK(m.lookup(prompt, &lora) == 12);
  }
  SECTION("a multimodal item separates the blocks it overlaps and every later one") {
    Mgr m(cfg);
    RequestKeys img;
    img.multimodal.push_back({item_hash(3), 5, 2});  // block 1
    REQUIRE(m.try_admit(1, prompt, &img).admitted());
    build(m, {1});
    CHECK(m.lookup(prompt) == 4);  // block 0 is shared with the text-only prompt
    RequestKeys other = img;
    other.multimodal[0].item_hash = item_hash(4);
    CHECK(m.lookup(prompt, &other) == 4);
    CHECK(m.lookup(prompt, &img) == 12);
  }
}
