// Retention priorities (issue 10 sec. 3, TensorRT-LLM's KvCacheRetentionConfig) wired through the allocator and the
// manager: the per-block mapping of a request's config, validation, which blocks an eviction takes under
// PriorityLruEviction (each scenario also run under LRU, where the outcome differs, so the test can fail), expiry on
// the retention clock, forgetting a dropped block's history, fork inheritance, minimum offload priority, and a host
// tier with its own eviction policy.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <type_traits>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/retention.hpp>

namespace {

using namespace std::chrono_literals;
using pagedkv::AdmitOptions;
using pagedkv::AdmitStatus;
using pagedkv::BlockRetention;
using pagedkv::CacheConfig;
using pagedkv::Errc;
using pagedkv::kDefaultRetentionPriority;
using pagedkv::RetentionConfig;
using pagedkv::RetentionTimePoint;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv::TokenRangeRetention;
using pagedkv_test::build_step;
using pagedkv_test::expect_error;
using pagedkv_test::toks;
using Prio = pagedkv::PriorityLruEviction<std::uint32_t>;
using Lru = pagedkv::LruEviction<std::uint32_t>;
using Toks = std::vector<TokenId>;

constexpr std::uint32_t kBs = 4;

CacheConfig cfg(std::size_t blocks) {
  CacheConfig c;
  c.num_blocks = blocks;
  c.block_size = kBs;
  return c;
}

std::shared_ptr<const RetentionConfig> retention(std::vector<TokenRangeRetention> ranges, std::uint8_t decode,
                                                 std::optional<std::chrono::nanoseconds> decode_for = std::nullopt) {
  auto r = std::make_shared<RetentionConfig>();
  r->ranges = std::move(ranges);
  r->decode_priority = decode;
  r->decode_duration = decode_for;
  return r;
}

// Admit `prompt` as `seq` (fully, no cache hit expected to matter), build it, free it: its full blocks are cached.
template <class M>
void run_and_free(M& m, SeqId seq, const Toks& prompt, std::shared_ptr<const RetentionConfig> r = nullptr,
                  std::size_t decode_tokens = 0) {
  AdmitOptions o;
  o.retention = std::move(r);
  REQUIRE(m.try_admit(seq, prompt, nullptr, o).status == AdmitStatus::kAdmitted);
  build_step(m, {seq});
  for (std::size_t i = 0; i < decode_tokens; ++i) {
    const TokenId t = 900000 + static_cast<TokenId>(seq * 1000 + i);
    REQUIRE(m.try_append(seq, std::span<const TokenId>(&t, 1)).ok());
    build_step(m, {seq});
  }
  m.free(seq);
}

// Tokens of `prompt` (ending in one extra token so a full-prompt hit is possible) the cache serves now.
template <class M>
std::size_t hit_tokens(const M& m, const Toks& prompt) {
  Toks p = prompt;
  p.push_back(777777);
  return m.query_admit(p).num_cached_tokens;
}

// Allocate (and free) `n` fresh unhashed blocks: evicts the n lowest-ranked cached blocks.
template <class M>
void pressure(M& m, SeqId seq, std::size_t n) {
  AdmitOptions o;
  o.max_cached_tokens = 0;
  REQUIRE(m.try_admit(seq, toks(500000 + static_cast<TokenId>(seq) * 100, n * kBs - 1), nullptr, o).status ==
          AdmitStatus::kAdmitted);
  m.free(seq);  // unbuilt: nothing registered, the blocks go back free
}

}  // namespace

TEST_CASE("block_retention maps ranges, decode blocks and uncovered blocks", "[retention]") {
  RetentionConfig c;
  c.ranges = {{0, 6, 90, std::nullopt}, {8, 12, 10, 5s}, {12, std::nullopt, 60, std::nullopt}};
  c.decode_priority = 3;
  c.decode_duration = 2s;
  pagedkv::validate_retention(c, "test");
  const std::size_t prompt = 20;
  auto at = [&](std::size_t begin) { return pagedkv::block_retention(c, begin, 4, prompt); };
  CHECK(at(0).priority == 90);   // [0, 4) inside range 0
  CHECK(at(4).priority == 90);   // [4, 8): range 0 ends inside it (system prompt protects its last block)
  CHECK_FALSE(at(4).duration);
  CHECK(at(8).priority == 10);   // [8, 12): range 1
  CHECK(at(8).duration == std::chrono::nanoseconds(5s));
  CHECK(at(12).priority == 60);  // open range to the prompt's end
  CHECK(at(16).priority == 60);
  CHECK(at(20).priority == 3);   // past the prompt: decode
  CHECK(at(20).duration == std::chrono::nanoseconds(2s));
  CHECK(pagedkv::block_retention(c, 18, 4, 19).priority == 60);  // straddles the prompt's end: prompt rule
  // Max over overlapping ranges; uncovered blocks default.
  RetentionConfig d;
  d.ranges = {{2, 5, 20, std::nullopt}, {5, 7, 70, std::nullopt}};
  CHECK(pagedkv::block_retention(d, 4, 4, 100).priority == 70);
  CHECK(pagedkv::block_retention(d, 0, 2, 100).priority == kDefaultRetentionPriority);
  CHECK(pagedkv::block_retention(d, 8, 4, 100).priority == kDefaultRetentionPriority);
  // Randomized against a brute-force per-token oracle.
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    RetentionConfig r;
    std::size_t pos = rng() % 4;
    const int n = static_cast<int>(rng() % 5);
    for (int i = 0; i < n; ++i) {
      const std::size_t len = 1 + rng() % 7;
      const bool open = i == n - 1 && rng() % 3 == 0;
      r.ranges.push_back({pos, open ? std::nullopt : std::optional<std::size_t>(pos + len),
                          static_cast<std::uint8_t>(rng() % 101), std::nullopt});
      pos += len + rng() % 3;
    }
    pagedkv::validate_retention(r, "trial");
    const std::size_t plen = 1 + rng() % 40;
    const std::size_t bs = 1 + rng() % 8;
    for (std::size_t b = 0; b < plen + 2 * bs; b += bs) {
      int best = -1;
      for (std::size_t t = b; t < std::min(b + bs, plen); ++t) {
        for (const auto& x : r.ranges) {
          if (t >= x.begin && t < x.end.value_or(plen)) best = std::max(best, static_cast<int>(x.priority));
        }
      }
      const std::uint8_t want = b >= plen ? r.decode_priority
                                          : (best < 0 ? kDefaultRetentionPriority : static_cast<std::uint8_t>(best));
      INFO("trial " << trial << " block at " << b << " bs " << bs << " prompt " << plen);
      CHECK(pagedkv::block_retention(r, b, bs, plen).priority == want);
    }
  }
}

TEST_CASE("validate_retention names the bad value", "[retention][errors]") {
  RetentionConfig c;
  c.ranges = {{0, 4, 101, std::nullopt}};
  CHECK_THAT(expect_error([&] { pagedkv::validate_retention(c, "t"); }, Errc::kInvalidArgument),
             Catch::Contains("priority 101"));
  c.ranges = {{4, 4, 50, std::nullopt}};
  CHECK_THAT(expect_error([&] { pagedkv::validate_retention(c, "t"); }, Errc::kInvalidArgument),
             Catch::Contains("[4, 4) is empty"));
  c.ranges = {{0, 8, 50, std::nullopt}, {6, 10, 50, std::nullopt}};
  CHECK_THAT(expect_error([&] { pagedkv::validate_retention(c, "t"); }, Errc::kInvalidArgument),
             Catch::Contains("overlaps"));
  c.ranges = {{0, std::nullopt, 50, std::nullopt}, {6, 10, 50, std::nullopt}};
  expect_error([&] { pagedkv::validate_retention(c, "t"); }, Errc::kInvalidArgument);
  c.ranges = {{0, 4, 50, std::chrono::nanoseconds(0)}};
  CHECK_THAT(expect_error([&] { pagedkv::validate_retention(c, "t"); }, Errc::kInvalidArgument),
             Catch::Contains("not positive"));
  c.ranges.clear();
  c.decode_priority = 200;
  CHECK_THAT(expect_error([&] { pagedkv::validate_retention(c, "t"); }, Errc::kInvalidArgument),
             Catch::Contains("decode priority 200"));
}

TEST_CASE("try_admit with a bad retention config throws and changes nothing", "[retention][errors]") {
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, Prio> m(cfg(16));
  run_and_free(m, 1, toks(1, 12));
  const auto before = m.stats();
  AdmitOptions o;
  o.retention = retention({{0, 4, 150, std::nullopt}}, 10);
  expect_error([&] { (void)m.try_admit(2, toks(1, 13), nullptr, o); }, Errc::kInvalidArgument);
  expect_error([&] { (void)m.query_admit(toks(1, 13), nullptr, o); }, Errc::kInvalidArgument);  // query and call agree
  expect_error([&] { (void)m.query_admit(m.prepare_prompt(toks(1, 13)), o); }, Errc::kInvalidArgument);
  CHECK_FALSE(m.contains(2));
  const auto after = m.stats();
  CHECK(after.blocks_free == before.blocks_free);
  CHECK(after.blocks_cached == before.blocks_cached);
  CHECK(after.prefix_query_tokens == before.prefix_query_tokens);
  CHECK(hit_tokens(m, toks(1, 12)) == 12);
}

TEMPLATE_TEST_CASE("a high-priority prompt outlives a later default one - LRU evicts it first", "[retention]", Prio,
                   Lru) {
  // 9 usable blocks. A (system prompt, priority 80) is freed before B (default): LRU would evict A first.
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, TestType> m(cfg(10));
  const Toks a = toks(1000, 8), b = toks(2000, 8);
  run_and_free(m, 1, a, retention({{0, std::nullopt, 80, std::nullopt}}, kDefaultRetentionPriority));
  run_and_free(m, 2, b);
  REQUIRE(hit_tokens(m, a) == 8);
  REQUIRE(hit_tokens(m, b) == 8);
  // 7 blocks are free or never used; 4 cached. Taking 9 evicts exactly two cached blocks.
  pressure(m, 3, 7);
  if constexpr (std::is_same_v<TestType, Prio>) {
    CHECK(hit_tokens(m, a) == 8);  // protected
    CHECK(hit_tokens(m, b) == 0);
  } else {
    CHECK(hit_tokens(m, a) == 0);  // LRU: least recently released
    CHECK(hit_tokens(m, b) == 8);
  }
}

TEMPLATE_TEST_CASE("low decode priority: generated blocks go before older prompt blocks", "[retention]", Prio, Lru) {
  // B (default, prompt only) is freed first; then A, whose 2 decode-produced blocks have priority 0.
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, TestType> m(cfg(12));
  const Toks a = toks(1000, 8), b = toks(2000, 8);
  run_and_free(m, 2, b);
  run_and_free(m, 1, a, retention({}, 0), 8);  // 8 decode tokens: blocks 2 and 3 of A hold only generated tokens
  REQUIRE(m.stats().blocks_cached == 6);
  pressure(m, 3, 7);  // 5 free + 2 evicted
  if constexpr (std::is_same_v<TestType, Prio>) {
    CHECK(hit_tokens(m, b) == 8);
    CHECK(hit_tokens(m, a) == 8);
  } else {
    CHECK(hit_tokens(m, b) == 0);
  }
}

TEST_CASE("retention durations expire on the manager's clock and fall back to the default", "[retention]") {
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, Prio> m(cfg(10));
  const RetentionTimePoint t0 = RetentionTimePoint(std::chrono::seconds(1000));
  m.expire_retention(t0);
  CHECK(m.retention_now() == t0);
  const Toks a = toks(1000, 8), c = toks(3000, 8);
  run_and_free(m, 3, c, retention({{0, std::nullopt, 50, std::nullopt}}, 50));    // 50, no expiry
  run_and_free(m, 1, a, retention({{0, std::nullopt, 80, 10s}}, 80));             // 80 for 10 s
  CHECK(m.expire_retention(t0 + 5s) == 0);
  CHECK(m.expire_retention(t0 + 1s) == 0);  // the clock never goes back
  CHECK(m.retention_now() == t0 + 5s);
  CHECK(m.expire_retention(t0 + 11s) == 2);  // A's two blocks fall back to 35 < C's 50
  pressure(m, 4, 7);
  CHECK(hit_tokens(m, a) == 0);
  CHECK(hit_tokens(m, c) == 8);
}

TEST_CASE("before expiry the longer priority wins", "[retention]") {
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, Prio> m(cfg(10));
  const RetentionTimePoint t0 = RetentionTimePoint(std::chrono::seconds(1000));
  m.expire_retention(t0);
  const Toks a = toks(1000, 8), c = toks(3000, 8);
  run_and_free(m, 3, c, retention({{0, std::nullopt, 50, std::nullopt}}, 50));
  run_and_free(m, 1, a, retention({{0, std::nullopt, 80, 10s}}, 80));
  CHECK(m.expire_retention(t0 + 9s) == 0);
  pressure(m, 4, 7);
  CHECK(hit_tokens(m, a) == 8);
  CHECK(hit_tokens(m, c) == 0);
}

TEST_CASE("a fork inherits its parent's retention - the last releaser decides", "[retention]") {
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, Prio> m(cfg(10));
  const Toks a = toks(1000, 8), b = toks(2000, 8);
  AdmitOptions o;
  o.retention = retention({{0, std::nullopt, 90, std::nullopt}}, 90);
  REQUIRE(m.try_admit(1, a, nullptr, o).status == AdmitStatus::kAdmitted);
  build_step(m, {1});
  m.fork(1, 5);
  m.free(1);      // blocks still held by the child
  run_and_free(m, 2, b);
  m.free(5);      // the child's release caches them at the inherited 90
  pressure(m, 3, 7);
  CHECK(hit_tokens(m, a) == 8);
  CHECK(hit_tokens(m, b) == 0);
}

TEST_CASE("the allocator forgets a dropped block's priority", "[retention][allocator]") {
  pagedkv::BlockAllocator<std::uint32_t, Prio> al(8);
  std::uint32_t b[2] = {0, 0};
  REQUIRE(al.try_allocate(b));
  al.set_hashed(b[0], true);
  al.set_retention_priority(b[0], 90, std::nullopt);
  CHECK(al.eviction_policy().priority(b[0]) == 90);
  al.set_hashed(b[0], false);  // hash dropped while held: its history goes
  CHECK(al.eviction_policy().priority(b[0]) == kDefaultRetentionPriority);
  al.set_retention_priority(b[1], 70, std::nullopt);
  al.release(b[1]);  // unhashed: free, and its assignment must not reach its next content
  CHECK(al.eviction_policy().priority(b[1]) == kDefaultRetentionPriority);
  // Misuse: free block, cached block, out of range, priority > 100 (state unchanged).
  expect_error([&] { al.set_retention_priority(b[1], 50, std::nullopt); }, Errc::kInvalidArgument);
  al.set_hashed(b[0], true);
  al.set_retention_priority(b[0], 60, std::nullopt);
  al.release(b[0]);
  REQUIRE(al.is_cached(b[0]));
  CHECK(al.eviction_policy().priority(b[0]) == 60);
  expect_error([&] { al.set_retention_priority(b[0], 50, std::nullopt); }, Errc::kInvalidArgument);
  CHECK(al.eviction_policy().priority(b[0]) == 60);
  expect_error([&] { al.set_retention_priority(0, 50, std::nullopt); }, Errc::kBlockOutOfRange);
  expect_error([&] { al.set_retention_priority(8, 50, std::nullopt); }, Errc::kBlockOutOfRange);
  std::uint32_t c = 0;
  REQUIRE(al.try_allocate(std::span<std::uint32_t>(&c, 1)));
  expect_error([&] { al.set_retention_priority(c, 101, std::nullopt); }, Errc::kInvalidArgument);
  // clear_hashes forgets held blocks' assignments too.
  al.set_hashed(c, true);
  al.set_retention_priority(c, 99, std::nullopt);
  al.clear_hashes([](std::uint32_t) {});
  CHECK(al.eviction_policy().priority(c) == kDefaultRetentionPriority);
}

TEST_CASE("write-back offloads only blocks at or above min_offload_priority, with their priority",
          "[retention][host_tier]") {
  CacheConfig c = cfg(10);
  c.num_host_blocks = 16;
  c.offload = pagedkv::OffloadPolicy::kWriteBack;
  c.min_offload_priority = 50;
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, Prio> m(c);
  const Toks a = toks(1000, 8), b = toks(2000, 8);
  AdmitOptions oa;
  oa.retention = retention({{0, std::nullopt, 80, std::nullopt}}, 80);
  REQUIRE(m.try_admit(1, a, nullptr, oa).status == AdmitStatus::kAdmitted);
  build_step(m, {1});
  const std::vector<pagedkv::BlockHash> ha(m.sequence(1).hashes.begin(), m.sequence(1).hashes.end());
  m.free(1);
  run_and_free(m, 2, b, retention({}, 10));  // B's blocks: default 35 < 50
  pressure(m, 3, 9);                         // evicts all four cached blocks
  const auto s = m.stats();
  CHECK(s.offloads == 2);
  CHECK(s.offloads_below_priority == 2);
  for (const auto& h : ha) {
    const auto hb = m.host_tier()->find(h);
    REQUIRE(hb);
    CHECK(m.host_tier()->allocator().eviction_policy().priority(*hb) == 80);
  }
}

TEST_CASE("the host tier takes its own eviction policy", "[retention][host_tier]") {
  using M = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, Prio, pagedkv::SlruEviction<std::uint32_t>>;
  static_assert(std::is_same_v<M::host_tier_type::allocator_type::eviction_policy_type,
                               pagedkv::SlruEviction<std::uint32_t>>);
  static_assert(std::is_same_v<M::allocator_type::eviction_policy_type, Prio>);
  CacheConfig c = cfg(6);
  c.num_host_blocks = 16;
  M m(c);
  const Toks a = toks(1000, 8);
  run_and_free(m, 1, a);
  pressure(m, 2, 5);  // evicts A's blocks: offloaded
  CHECK(m.stats().offloads == 2);
  CHECK(hit_tokens(m, a) == 0);  // not ready until the copies complete
  // The engine runs the step that issues the offloads, then acknowledges them.
  std::vector<std::int32_t> out(8, -2), in(8, -2);
  pagedkv::BatchMetadataBuffers buf;
  buf.swap_out = out;
  buf.swap_in = in;
  const auto sz = m.build_batch_metadata(std::span<const SeqId>{}, buf);
  CHECK(sz.num_swap_out == 2);
  m.complete_transfers(sz.transfer_token);
  CHECK(hit_tokens(m, a) == 8);  // served by the host tier
}
