// Tests of pagedkv/detail/block_hash_table.hpp, the table behind PrefixHashIndex: random insert / find / erase
// against std::unordered_map at full load with heavy churn (so tombstones pile up and in-place rehashes run),
// adversarial keys (every key in one home group, equal 7-bit tags), and the memory figure the docs quote.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <unordered_map>
#include <vector>

#include <pagedkv/detail/block_hash_table.hpp>
#include <pagedkv/prefix_hash_index.hpp>

namespace {

using pagedkv::BlockHash;
using Table = pagedkv::detail::BlockHashTable<std::uint32_t>;

struct KeyHash {
  std::size_t operator()(const BlockHash& h) const noexcept { return static_cast<std::size_t>(h.low64()); }
};

// A random key; with `home_bits` < 64 the low 64 bits (the home group) take only a few values, and with
// `same_tag` every key has the same 7-bit tag: worst cases for the probing.
BlockHash key(std::mt19937_64& rng, int home_bits, bool same_tag) {
  BlockHash h;
  std::uint64_t lo = rng();
  if (home_bits < 64) lo &= (std::uint64_t{1} << home_bits) - 1;
  const std::uint64_t hi = rng();
  for (int i = 0; i < 8; ++i) h.bytes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(lo >> (8 * i));
  for (int i = 0; i < 8; ++i) h.bytes[static_cast<std::size_t>(8 + i)] = static_cast<std::uint8_t>(hi >> (8 * i));
  if (same_tag) h.bytes[8] = 0x2a;
  return h;
}

void churn(std::size_t num_blocks, int home_bits, bool same_tag, std::uint64_t seed, std::size_t ops,
           bool expect_rehash) {
  std::mt19937_64 rng(seed);
  Table t(num_blocks);
  std::vector<BlockHash> hashes(num_blocks);            // the external key array, as the index keeps it
  std::unordered_map<BlockHash, std::uint32_t, KeyHash> model;
  std::vector<std::uint32_t> live, free_ids;
  for (std::uint32_t b = 1; b < num_blocks; ++b) free_ids.push_back(b);
  std::size_t finds = 0, misses = 0, dup = 0;
  for (std::size_t op = 0; op < ops; ++op) {
    const auto r = rng() % 100;
    if (r < 45 && !free_ids.empty()) {  // insert a fresh block (sometimes under a key already present)
      const std::uint32_t b = free_ids.back();
      const bool duplicate = !live.empty() && rng() % 8 == 0;
      const BlockHash h = duplicate ? hashes[live[rng() % live.size()]] : key(rng, home_bits, same_tag);
      const BlockHash old = hashes[b];
      hashes[b] = h;
      const std::uint32_t got = t.insert(h, b, hashes.data());
      const auto it = model.find(h);
      if (it != model.end()) {
        REQUIRE(got == it->second);
        hashes[b] = old;
        ++dup;
      } else {
        REQUIRE(got == b);
        model.emplace(h, b);
        live.push_back(b);
        free_ids.pop_back();
      }
    } else if (r < 80 && !live.empty()) {  // erase a random live block
      const std::size_t i = rng() % live.size();
      const std::uint32_t b = live[i];
      REQUIRE(t.erase(hashes[b], b));
      REQUIRE_FALSE(t.erase(hashes[b], b));  // gone
      model.erase(hashes[b]);
      live[i] = live.back();
      live.pop_back();
      free_ids.push_back(b);
    } else {  // find: a live key, or a random one
      ++finds;
      if (!live.empty() && rng() % 2 == 0) {
        const std::uint32_t b = live[rng() % live.size()];
        t.prefetch(hashes[b]);
        REQUIRE(t.find(hashes[b], hashes.data()) == b);
      } else {
        const BlockHash h = key(rng, home_bits, same_tag);
        const auto it = model.find(h);
        const std::uint32_t want = it == model.end() ? 0 : it->second;
        misses += want == 0;
        REQUIRE(t.find(h, hashes.data()) == want);
      }
    }
    REQUIRE(t.size() == model.size());
  }
  // Everything still findable at the end.
  for (const auto& [h, b] : model) REQUIRE(t.find(h, hashes.data()) == b);
  INFO("blocks " << num_blocks << ", home bits " << home_bits << ", same tag " << same_tag << ": " << finds
                 << " finds (" << misses << " misses), " << dup << " duplicate inserts, " << t.num_rehashes()
                 << " rehashes, capacity " << t.capacity());
  if (expect_rehash) CHECK(t.num_rehashes() > 0);  // churn near full load drops tombstones in place
  CHECK(dup > 0);
  CHECK(misses > 0);
  t.clear();
  CHECK(t.size() == 0);
  for (const auto& [h, b] : model) CHECK(t.find(h, hashes.data()) == 0);
}

}  // namespace

TEST_CASE("BlockHashTable: random churn at full load against std::unordered_map", "[block_hash_table]") {
  churn(16, 64, false, 1, 20000, false);     // two groups
  churn(97, 64, false, 2, 40000, true);      // 7 groups, nearly full: tombstones, in-place rehashes
  churn(4000, 64, false, 3, 200000, true);
}

TEST_CASE("BlockHashTable: adversarial keys (one home group, one tag) still answer exactly",
          "[block_hash_table]") {
  churn(200, 0, true, 4, 30000, false);   // every key homes to group 0 with the same tag: long probes, collisions
  churn(200, 2, false, 5, 30000, false);  // four home groups
}

TEST_CASE("PrefixHashIndex memory per block is the documented figure", "[block_hash_table][memory]") {
  const std::size_t n = 1000000;
  pagedkv::PrefixHashIndex<pagedkv::Xxh3Hasher> idx(n, 0);
  const double per_block = static_cast<double>(idx.memory_bytes()) / static_cast<double>(n);
  INFO("index bytes per block: " << per_block);
  CHECK(per_block < 22.8);  // 16 (hash) + 1/8 (bit) + 64 / (12 * 0.8) (table: one 64-byte group per 12 slots)
  CHECK(per_block > 22.7);
}
