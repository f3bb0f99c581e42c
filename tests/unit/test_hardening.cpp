// Regression tests for the defects of issue 12 ("Hardening") and the API traps of issue 9 sec. 4: multimodal item
// ranges, append that can never fit, the 32-bit limits of the batch metadata, concurrent const lookups, a build
// that would drop writes or copies, and moving a manager.
#include <catch2/catch.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using pagedkv::AdmitStatus;
using pagedkv::AppendStatus;
using pagedkv::CacheConfig;
using pagedkv::Errc;
using pagedkv::MultimodalItem;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::build_step;
using pagedkv_test::expect_error;
using pagedkv_test::toks;
using Mgr = pagedkv::KVCacheManager<>;
using Toks = std::vector<TokenId>;
using Ids = std::vector<std::uint32_t>;

CacheConfig cfg(std::size_t num_blocks, std::uint32_t block_size) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  return c;
}

pagedkv::BlockHash image(std::uint8_t tag) {
  pagedkv::BlockHash h;
  for (auto& b : h.bytes) b = tag;
  return h;
}

Ids ids(const Mgr& m, SeqId s) { return Ids(m.block_ids(s).begin(), m.block_ids(s).end()); }

}  // namespace

TEST_CASE("multimodal items must lie inside the prompt: a wrapping range is a typed error",
          "[hardening][multimodal][regression]") {
  Mgr m(cfg(32, 4));
  const Toks p = toks(10, 12);
  // Before the fix an item at 2^64 - 2 with length 3 wrapped to "overlaps nothing", so its image was mixed into no
  // block hash and a request with another image at the same place hit these blocks.
  RequestKeys wrap;
  wrap.multimodal.push_back(MultimodalItem{image(1), std::numeric_limits<std::uint64_t>::max() - 1, 3});
  CHECK_THAT(expect_error([&] { m.try_admit(1, p, &wrap); }, Errc::kInvalidArgument),
             Catch::Contains("multimodal item 0") && Catch::Contains("inside the prompt of 12 tokens"));
  CHECK_THAT(expect_error([&] { (void)m.lookup(p, &wrap); }, Errc::kInvalidArgument),
             Catch::Contains("lookup: multimodal item 0"));
  CHECK_FALSE(m.contains(1));
  CHECK(m.stats().blocks_free == 31);
  CHECK(m.stats().prefix_query_requests == 0);

  RequestKeys past;  // ends one token past the prompt
  past.multimodal.push_back(MultimodalItem{image(2), 10, 3});
  CHECK_THAT(expect_error([&] { m.try_admit(1, p, &past); }, Errc::kInvalidArgument),
             Catch::Contains("offset 10 with length 3"));
  RequestKeys empty_item;
  empty_item.multimodal.push_back(MultimodalItem{image(3), 4, 0});
  CHECK_THAT(expect_error([&] { m.try_admit(1, p, &empty_item); }, Errc::kInvalidArgument),
             Catch::Contains("is empty"));
  RequestKeys unsorted;
  unsorted.multimodal.push_back(MultimodalItem{image(4), 8, 2});
  unsorted.multimodal.push_back(MultimodalItem{image(5), 1, 2});
  CHECK_THAT(expect_error([&] { m.try_admit(1, p, &unsorted); }, Errc::kInvalidArgument),
             Catch::Contains("multimodal item 1") && Catch::Contains("not sorted"));
  CHECK(m.num_sequences() == 0);

  // The last legal range (ending exactly at the prompt's end) is accepted and separates images.
  RequestKeys a, b;
  a.multimodal.push_back(MultimodalItem{image(6), 9, 3});
  b.multimodal.push_back(MultimodalItem{image(7), 9, 3});
  REQUIRE(m.try_admit(1, p, &a).admitted());
  build_step(m, {1});
  const Toks longer = toks(10, 13);
  CHECK(m.lookup(longer, &a) == 12);
  CHECK(m.lookup(longer, &b) == 8);  // the image's block differs; the two blocks before it are shared
  CHECK(m.lookup(longer) == 8);
}

TEST_CASE("an append that needs more blocks than the pool is 'never fits', not 'no capacity now'",
          "[hardening][append][regression]") {
  Mgr m(cfg(5, 4));  // 4 usable blocks of 4 tokens
  REQUIRE(m.try_admit(1, toks(0, 9)).admitted());  // 3 blocks
  build_step(m, {1});
  const auto before = m.stats();
  auto r = m.try_append(1, toks(9, 8));  // 17 tokens = 5 blocks > 4
  CHECK(r.status == AppendStatus::kNeverFits);
  CHECK(r.num_missing_blocks == 1);
  CHECK(r.slots.empty());
  CHECK(m.num_tokens(1) == 9);
  CHECK(m.stats().blocks_free == before.blocks_free);
  // 16 tokens fit the pool: alone, the sequence could hold them, so it is "no capacity now" while another holds a
  // block, and fits after that one is preempted (the documented preempt-and-retry).
  REQUIRE(m.try_admit(2, toks(100, 3)).admitted());
  r = m.try_append(1, toks(9, 7));
  CHECK(r.status == AppendStatus::kNoCapacity);
  CHECK(r.num_missing_blocks == 1);
  m.preempt(2);
  r = m.try_append(1, toks(9, 7));
  CHECK(r.ok());
  CHECK(m.num_tokens(1) == 16);

  SECTION("a copy forced by a hash counts, one forced by sharing does not") {
    build_step(m, {1});                        // 4 full registered blocks: the whole pool
    m.rewind(1, 2);                            // last block partial and hashed: the next append copies it
    r = m.try_append(1, Toks{1});
    CHECK(r.status == AppendStatus::kNeverFits);  // 4 blocks + the copy > 4
    CHECK(r.num_missing_blocks == 1);
    m.rewind(1, 2);                            // 12 tokens: 3 blocks, the last one full and hashed
    m.fork(1, 3);
    m.rewind(3, 1);                            // shared + hashed partial block
    r = m.try_append(3, Toks{5});
    CHECK(r.ok());                             // 3 blocks + the copy fit in 4
  }
}

TEST_CASE("admission reports how many blocks are missing", "[hardening][admit]") {
  Mgr m(cfg(5, 4));
  auto r = m.try_admit(1, toks(0, 21));  // 6 blocks > 4
  CHECK(r.status == AdmitStatus::kNeverFits);
  CHECK(r.num_missing_blocks == 2);
  REQUIRE(m.try_admit(1, toks(0, 12)).admitted());
  r = m.try_admit(2, toks(50, 9));  // 3 blocks, 1 available
  CHECK(r.status == AdmitStatus::kNoCapacity);
  CHECK(r.num_missing_blocks == 2);
}

TEST_CASE("the int32 limits of the batch metadata are explicit and checked", "[hardening][limits][regression]") {
  using pagedkv::kMaxMetadataValue;
  STATIC_REQUIRE(kMaxMetadataValue == 2147483647U);
  // Block ids are written as int32 (indices, block_tables, copies padded with -1): 2^31 blocks at most (the
  // largest id 2^31 - 1). Rejected before anything is allocated.
  CHECK_THAT(expect_error([] { Mgr m(cfg(kMaxMetadataValue + 2, 16)); }, Errc::kLimitExceeded),
             Catch::Contains("num_blocks - 1 (the largest block id) = 2147483648") &&
                 Catch::Contains("int32 limit"));
  // seq_lens is int32.
  auto c = cfg(8, 16);
  c.max_tokens_per_seq = kMaxMetadataValue + 1;
  CHECK_THAT(expect_error([&] { Mgr m(c); }, Errc::kLimitExceeded), Catch::Contains("max_tokens_per_seq"));
  c.max_tokens_per_seq = kMaxMetadataValue;
  CHECK(Mgr(c).max_tokens_per_seq() == kMaxMetadataValue);
  // The running totals of one build (indptr[batch], qo_indptr[batch]) go through the same check.
  CHECK_NOTHROW(pagedkv::detail::check_metadata_value(kMaxMetadataValue, "x"));
  CHECK_THAT(expect_error([] { pagedkv::detail::check_metadata_value(kMaxMetadataValue + 1, "total"); },
                          Errc::kLimitExceeded),
             Catch::Contains("total = 2147483648 exceeds the int32 limit"));
  // 16-bit ids: the allocator's own bound is exact at the boundary.
  using Mgr16 = pagedkv::KVCacheManager<pagedkv::Sha256Hasher, std::uint16_t>;
  CHECK(Mgr16(cfg(65535, 1)).stats().num_usable_blocks == 65534);
  CHECK_THAT(expect_error([] { Mgr16 m(cfg(65536, 1)); }, Errc::kInvalidArgument),
             Catch::Contains("does not fit the block id type"));
}

TEST_CASE("a build cannot drop the writes it registers or the copies it hands out", "[hardening][build][regression]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 10)).admitted());
  const pagedkv::BatchMetadataBuffers none;
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(std::vector<SeqId>{1}, none); }, Errc::kBadShape),
             Catch::Contains("slot_mapping is empty but the batch has 10 new tokens"));
  CHECK(m.prefix_index().size() == 0);  // nothing registered
  CHECK(m.pending_slots(1).size() == 10);
  build_step(m, {1});
  m.fork(1, 2);
  REQUIRE(m.try_append(2, Toks{5}).copy.has_value());
  // Sequence 2's copy belongs to a build of 2: an empty copies buffer would lose it.
  std::vector<std::int64_t> slots(4);
  pagedkv::BatchMetadataBuffers only_slots;
  only_slots.slot_mapping = slots;
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(std::vector<SeqId>{2}, only_slots); }, Errc::kBadShape),
             Catch::Contains("copies is empty but 1 copy-on-write copies belong to this build"));
  CHECK(m.pending_copies().size() == 1);
  const auto step = build_step(m, {1, 2});
  CHECK(step.copies == std::vector<std::int32_t>{3, 4});
}

TEST_CASE("const lookups may run concurrently", "[hardening][lookup][concurrency]") {
  // lookup() used to encode blocks into a mutable scratch buffer of the index: two concurrent lookups raced.
  // Four threads look up different prompts at once; every answer must equal the single-threaded one. (Run under
  // ThreadSanitizer by scripts/test.sh.)
  Mgr m(cfg(256, 4));
  std::vector<Toks> prompts;
  for (int i = 0; i < 8; ++i) {
    Toks p = toks(1000 * i, 40 + 3 * i);
    REQUIRE(m.try_admit(static_cast<SeqId>(i), p).admitted());
    prompts.push_back(std::move(p));
  }
  std::vector<SeqId> all;
  for (int i = 0; i < 8; ++i) all.push_back(static_cast<SeqId>(i));
  build_step(m, all);
  RequestKeys salt;
  salt.salt = "tenant";
  std::vector<std::size_t> want;
  for (const auto& p : prompts) want.push_back(m.lookup(p));
  for (std::size_t i = 0; i < prompts.size(); ++i) CHECK(want[i] == (prompts[i].size() - 1) / 4 * 4);
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 200; ++rep) {
        for (std::size_t i = 0; i < prompts.size(); ++i) {
          const std::size_t k = (i + static_cast<std::size_t>(t)) % prompts.size();
          if (m.lookup(prompts[k]) != want[k]) ++bad[static_cast<std::size_t>(t)];
          if (m.lookup(prompts[k], &salt) != 0) ++bad[static_cast<std::size_t>(t)];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(bad == std::vector<int>(4, 0));
}

TEST_CASE("KVCacheManager is movable - a move carries every sequence", "[hardening][move]") {
  Mgr a(cfg(32, 4));
  REQUIRE(a.try_admit(1, toks(0, 10)).admitted());
  build_step(a, {1});
  a.fork(1, 2);
  REQUIRE(a.try_append(2, Toks{7}).copy.has_value());
  const auto blocks = a.block_ids(1);  // a span into sequence 1's state
  const Ids before = ids(a, 1);

  Mgr b(std::move(a));
  CHECK(Ids(blocks.begin(), blocks.end()) == before);  // still valid: it now views b's state
  CHECK(ids(b, 1) == before);
  CHECK(b.pending_copies().size() == 1);
  std::vector<Mgr> pools;  // engines keep one manager per model in a container
  pools.push_back(std::move(b));
  pools.emplace_back(cfg(8, 4));
  Mgr& m = pools.front();
  const auto step = build_step(m, {1, 2});
  CHECK(step.copies.size() == 2);
  CHECK(m.lookup(toks(0, 10)) == 8);
  m.free(1);
  m.free(2);
  CHECK(m.stats().blocks_used == 0);
  Mgr c(cfg(4, 4));
  c = std::move(pools.front());
  CHECK(c.lookup(toks(0, 10)) == 8);
  CHECK(c.stats().blocks_cached == 2);
}
