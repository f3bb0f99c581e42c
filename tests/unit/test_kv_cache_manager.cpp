// Tests of pagedkv/kv_cache_manager.hpp: admission (prefix hits, cap, all-or-nothing, hit protection, never fits),
// lookup purity, release order, deduplication, fork / copy-on-write, rewind, reset_prefix_cache, events, counters.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/error.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

namespace {

using pagedkv::AdmitStatus;
using pagedkv::BlockHash;
using pagedkv::CacheConfig;
using pagedkv::CacheStats;
using pagedkv::Errc;
using pagedkv::KVEvent;
using pagedkv::KVEventType;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Mgr = pagedkv::KVCacheManager<>;
using Copy = pagedkv::BlockCopy<std::uint32_t>;
using Toks = std::vector<TokenId>;
using Ids = std::vector<std::uint32_t>;
using Slots = std::vector<std::int64_t>;

using pagedkv_test::expect_error;

CacheConfig cfg(std::size_t num_blocks, std::uint32_t bs, bool events = false) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = bs;
  c.enable_events = events;
  return c;
}

// first, first + 1, ..., first + n - 1
using pagedkv_test::toks;
Toks cat(Toks a, const Toks& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

template <class M>
Ids ids(const M& m, SeqId s) {
  const auto b = m.block_ids(s);
  return Ids(b.begin(), b.end());
}
template <class M>
Slots pending(const M& m, SeqId s) {
  const auto p = m.pending_slots(s);
  return Slots(p.begin(), p.end());
}
template <class M>
Ids lru(const M& m) {
  return m.allocator().eviction_policy().order();
}

auto stats_tuple(const CacheStats& s) {
  return std::make_tuple(s.num_usable_blocks, s.blocks_used, s.blocks_cached, s.blocks_free, s.usage,
                         s.prefix_query_requests, s.prefix_hit_requests, s.prefix_query_tokens, s.prefix_hit_tokens,
                         s.evictions, s.cow_copies, s.dedup_blocks, s.preemptions, s.block_ops);
}

// The full observable state of a manager.
struct Snapshot {
  decltype(stats_tuple(CacheStats{})) stats;
  std::map<SeqId, std::tuple<Ids, std::size_t, Toks, Slots>> seqs;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> copies;
  std::vector<std::tuple<std::uint32_t, bool, bool, std::optional<BlockHash>>> blocks;  // refcount, hashed, cached
  Ids lru;
  std::size_t index_size = 0;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

template <class M>
Snapshot snapshot(const M& m) {
  Snapshot s;
  s.stats = stats_tuple(m.stats());
  m.for_each_sequence([&](SeqId id, std::span<const std::uint32_t> blocks, std::size_t n) {
    const auto t = m.token_ids(id);
    s.seqs[id] = {Ids(blocks.begin(), blocks.end()), n, Toks(t.begin(), t.end()), pending(m, id)};
  });
  for (const auto& c : m.pending_copies()) s.copies.emplace_back(c.src, c.dst);
  const auto& a = m.allocator();
  for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
    s.blocks.emplace_back(a.refcount(b), a.is_hashed(b), a.is_cached(b), m.prefix_index().hash_of(b));
  }
  s.lru = lru(m);
  s.index_size = m.prefix_index().size();
  return s;
}

// Builds metadata for the sequences of `requested` that have something to compute (an engine leaves the others
// out; a build refuses them) into ample buffers; returns (slot_mapping, copies) as written.
template <class M>
std::pair<Slots, std::vector<std::int32_t>> build(M& m, const std::vector<SeqId>& requested) {
  std::vector<SeqId> batch;
  for (SeqId id : requested) {
    if (!m.contains(id) || !m.pending_slots(id).empty()) batch.push_back(id);
  }
  std::vector<std::int32_t> indptr(batch.size() + 1), indices(1024), lpl(batch.size()), qo(batch.size() + 1);
  std::vector<std::int64_t> slots(1024);
  std::vector<std::int32_t> copies(2 * 64);
  pagedkv::BatchMetadataBuffers buf;
  buf.indptr = indptr;
  buf.indices = indices;
  buf.last_page_len = lpl;
  buf.qo_indptr = qo;
  buf.slot_mapping = slots;
  buf.copies = copies;
  const auto sz = m.build_batch_metadata(batch, buf);
  slots.resize(sz.num_new_tokens);
  copies.resize(2 * sz.num_copies);
  return {slots, copies};
}

std::vector<KVEvent> drain(Mgr& m) {
  std::vector<KVEvent> ev;
  m.drain_events(ev);
  return ev;
}

}  // namespace

TEST_CASE("KVCacheManager: configuration", "[kv_cache_manager][config]") {
  CHECK_THAT(expect_error([] { Mgr m(cfg(1, 4)); }, Errc::kInvalidArgument), Catch::Contains("num_blocks = 1"));
  CHECK_THAT(expect_error([] { Mgr m(cfg(0, 4)); }, Errc::kInvalidArgument), Catch::Contains("num_blocks = 0"));
  CHECK_THAT(expect_error([] { Mgr m(cfg(8, 0)); }, Errc::kInvalidArgument), Catch::Contains("block_size = 0"));
  Mgr m(cfg(9, 4));
  CHECK(m.block_size() == 4);
  // Default: no per-sequence limit beyond the int32 seq_lens of the batch metadata.
  CHECK(m.max_tokens_per_seq() == pagedkv::kMaxMetadataValue);
  CHECK(pagedkv::kMaxMetadataValue == 2147483647U);
  CHECK(m.config().num_blocks == 9);
  auto c = cfg(9, 4);
  c.max_tokens_per_seq = 5;
  Mgr m2(c);
  CHECK(m2.max_tokens_per_seq() == 5);
  const CacheStats s = m.stats();
  CHECK(s.num_usable_blocks == 8);
  CHECK(s.blocks_free == 8);
  CHECK(s.blocks_used == 0);
  CHECK(s.blocks_cached == 0);
  CHECK(s.usage == 0.0);
  CHECK(m.num_sequences() == 0);
  CHECK(Mgr(cfg(2, 16)).stats().num_usable_blocks == 1);
}

TEST_CASE("KVCacheManager: admission allocates in id order and reserves the prompt's slots", "[kv_cache_manager][admit]") {
  Mgr m(cfg(16, 4));
  const Toks p = toks(100, 10);
  const auto r = m.try_admit(7, p);
  CHECK(r.status == AdmitStatus::kAdmitted);
  CHECK(r.admitted());
  CHECK(r.num_cached_tokens == 0);
  CHECK(r.num_new_blocks == 3);
  CHECK(m.contains(7));
  CHECK_FALSE(m.contains(8));
  CHECK(m.num_sequences() == 1);
  CHECK(m.num_tokens(7) == 10);
  CHECK(ids(m, 7) == Ids{1, 2, 3});
  const auto t = m.token_ids(7);
  CHECK(Toks(t.begin(), t.end()) == p);
  CHECK(pending(m, 7) == Slots{4, 5, 6, 7, 8, 9, 10, 11, 12, 13});
  // Full blocks are registered by the build that issues their writes, not at admission.
  CHECK_FALSE(m.allocator().is_hashed(1));
  CHECK(m.prefix_index().size() == 0);
  const CacheStats s = m.stats();
  CHECK(s.blocks_used == 3);
  CHECK(s.blocks_free == 12);
  CHECK(s.usage == Approx(3.0 / 15.0));
  CHECK(s.prefix_query_requests == 1);
  CHECK(s.prefix_query_tokens == 10);
  CHECK(s.prefix_hit_requests == 0);
  CHECK(s.prefix_hit_tokens == 0);
  CHECK(s.block_ops == 3);
  CHECK(m.pending_copies().empty());
  const auto [slots, copies] = build(m, {7});
  CHECK(slots == Slots{4, 5, 6, 7, 8, 9, 10, 11, 12, 13});
  CHECK(copies.empty());
  CHECK(m.allocator().is_hashed(1));
  CHECK(m.allocator().is_hashed(2));
  CHECK_FALSE(m.allocator().is_hashed(3));  // the partial block never is
  CHECK(m.prefix_index().size() == 2);
  CHECK(m.pending_slots(7).empty());

  SECTION("appending fills the partial block, then opens new ones; filled blocks are registered at the build") {
    const auto a = m.try_append(7, Toks{1, 2, 3});
    REQUIRE(a.ok());
    CHECK(Slots(a.slots.begin(), a.slots.end()) == Slots{14, 15, 16});
    CHECK_FALSE(a.copy.has_value());
    CHECK(ids(m, 7) == Ids{1, 2, 3, 4});
    CHECK_FALSE(m.allocator().is_hashed(3));
    build(m, {7});
    CHECK(m.allocator().is_hashed(3));
    CHECK_FALSE(m.allocator().is_hashed(4));
    CHECK(m.num_tokens(7) == 13);
    CHECK(pending(m, 7).empty());
    const auto e = m.try_append(7, Toks{});
    CHECK(e.ok());
    CHECK(e.slots.empty());
    CHECK(m.num_tokens(7) == 13);
  }
}

TEST_CASE("KVCacheManager: lookup is pure and capped", "[kv_cache_manager][lookup]") {
  Mgr m(cfg(16, 4));
  const Toks p = toks(0, 12);  // three full blocks
  REQUIRE(m.try_admit(1, p).admitted());
  CHECK(m.lookup(cat(p, Toks{99})) == 0);  // not registered before the build that writes it
  build(m, {1});

  auto check_lookups = [&] {
    CHECK(m.lookup(p) == 8);                                    // floor((12 - 1) / 4) * 4
    CHECK(m.lookup(cat(p, Toks{99})) == 12);                    // one more token: every full block
    CHECK(m.lookup(p, nullptr, 12) == 12);                      // the cap parameter
    CHECK(m.lookup(p, nullptr, 11) == 8);                       // rounded down to blocks
    CHECK(m.lookup(p, nullptr, 4) == 4);
    CHECK(m.lookup(p, nullptr, 0) == 0);
    CHECK(m.lookup(p, nullptr, 1000) == 12);                    // never more than the prompt
    CHECK(m.lookup(toks(0, 5)) == 4);
    CHECK(m.lookup(toks(0, 4)) == 0);                           // 4 tokens: cap 3 -> no block
    CHECK(m.lookup(cat(toks(0, 4), toks(50, 8))) == 4);         // stops at the first miss
    CHECK(m.lookup(cat(Toks{-1}, toks(1, 11))) == 0);           // first block differs
    CHECK(m.lookup(Toks{}) == 0);
    RequestKeys salted;
    salted.salt = "x";
    CHECK(m.lookup(cat(p, Toks{99}), &salted) == 0);
  };
  const Snapshot held = snapshot(m);
  check_lookups();
  CHECK(snapshot(m) == held);

  m.free(1);
  REQUIRE(lru(m) == Ids{3, 2, 1});
  const Snapshot cached = snapshot(m);
  check_lookups();
  CHECK(snapshot(m) == cached);  // no refcount, no LRU move, no counter

  SECTION("prefix caching off: lookup finds nothing") {
    auto c = cfg(16, 4);
    c.enable_prefix_caching = false;
    Mgr off(c);
    REQUIRE(off.try_admit(1, p).admitted());
    build(off, {1});
    off.free(1);
    CHECK(off.lookup(cat(p, Toks{99})) == 0);
  }
}

TEST_CASE("KVCacheManager: admission takes cached blocks and honours the cap", "[kv_cache_manager][admit][prefix]") {
  Mgr m(cfg(16, 4));
  const Toks p = toks(0, 12);
  REQUIRE(m.try_admit(1, p).admitted());  // 1, 2, 3
  build(m, {1});
  m.free(1);

  SECTION("a longer prompt hits every full block") {
    const auto r = m.try_admit(2, cat(p, Toks{99}));
    REQUIRE(r.admitted());
    CHECK(r.num_cached_tokens == 12);
    CHECK(r.num_new_blocks == 1);
    CHECK(ids(m, 2) == Ids{1, 2, 3, 4});
    CHECK(pending(m, 2) == Slots{16});  // only the uncached token gets a slot
    CHECK(lru(m).empty());
    for (std::uint32_t b : {1u, 2u, 3u}) CHECK(m.allocator().refcount(b) == 1);
    const CacheStats s = m.stats();
    CHECK(s.prefix_query_requests == 2);
    CHECK(s.prefix_query_tokens == 25);
    CHECK(s.prefix_hit_requests == 1);
    CHECK(s.prefix_hit_tokens == 12);
    CHECK(s.blocks_cached == 0);
    // A second request with the same prefix shares the held blocks.
    const auto r2 = m.try_admit(3, cat(p, Toks{98, 97}));
    CHECK(r2.num_cached_tokens == 12);
    for (std::uint32_t b : {1u, 2u, 3u}) CHECK(m.allocator().refcount(b) == 2);
    CHECK(ids(m, 3) == Ids{1, 2, 3, 5});
    CHECK(m.stats().prefix_hit_requests == 2);
  }
  SECTION("the same prompt: capped at one token short, the last block is recomputed and deduplicated") {
    const auto r = m.try_admit(2, p);
    REQUIRE(r.admitted());
    CHECK(r.num_cached_tokens == 8);
    CHECK(r.num_new_blocks == 1);
    CHECK(ids(m, 2) == Ids{1, 2, 4});
    CHECK(pending(m, 2) == Slots{16, 17, 18, 19});
    // At the build, the fresh block 4 (same tokens as block 3) is switched to 3 and freed; its slots become -1.
    const auto [slots, copies] = build(m, {2});
    CHECK(slots == Slots{-1, -1, -1, -1});
    CHECK(ids(m, 2) == Ids{1, 2, 3});
    CHECK(m.stats().dedup_blocks == 1);
    CHECK(m.allocator().refcount(4) == 0);
    CHECK_FALSE(m.allocator().is_hashed(4));
    CHECK(m.allocator().refcount(3) == 1);
  }
  SECTION("max_cached_tokens above the default: the whole prompt can come from the cache") {
    const auto r = m.try_admit(2, p, nullptr, {.max_cached_tokens = 12});
    REQUIRE(r.admitted());
    CHECK(r.num_cached_tokens == 12);
    CHECK(r.num_new_blocks == 0);
    CHECK(pending(m, 2).empty());
    CHECK(ids(m, 2) == Ids{1, 2, 3});
    CHECK(m.stats().blocks_used == 3);
  }
  SECTION("max_cached_tokens below the default") {
    const auto r = m.try_admit(2, cat(p, Toks{99}), nullptr, {.max_cached_tokens = 5});
    REQUIRE(r.admitted());
    CHECK(r.num_cached_tokens == 4);
    CHECK(r.num_new_blocks == 3);
    CHECK(ids(m, 2) == Ids{1, 4, 5, 6});
    // Blocks 1 and 2 of the prompt were recomputed into 4 and 5, deduplicated to 2 and 3 at the build.
    const auto [slots, copies] = build(m, {2});
    CHECK(slots == Slots{-1, -1, -1, -1, -1, -1, -1, -1, 24});
    CHECK(ids(m, 2) == Ids{1, 2, 3, 6});
    CHECK(m.stats().dedup_blocks == 2);
    CHECK(m.stats().prefix_hit_tokens == 4);
  }
  SECTION("max_cached_tokens 0: no hit at all") {
    const auto r = m.try_admit(2, cat(p, Toks{99}), nullptr, {.max_cached_tokens = 0});
    CHECK(r.num_cached_tokens == 0);
    CHECK(m.stats().prefix_hit_requests == 0);
  }
}

TEST_CASE("KVCacheManager: hit blocks are protected from eviction by the request that hit them",
          "[kv_cache_manager][admit][evict]") {
  Mgr m(cfg(5, 4, true));  // 4 usable
  REQUIRE(m.try_admit(1, toks(0, 8)).admitted());    // 1, 2
  REQUIRE(m.try_admit(2, toks(50, 4)).admitted());   // 3
  REQUIRE(m.try_admit(3, toks(60, 4)).admitted());   // 4
  build(m, {1, 2, 3});
  m.free(1);
  m.free(2);
  m.free(3);
  REQUIRE(lru(m) == Ids{2, 1, 3, 4});  // 1 and 2 are the oldest: the first victims, were they not hits
  const auto h3 = m.prefix_index().hash_of(3);
  REQUIRE(h3.has_value());
  drain(m);

  const auto r = m.try_admit(4, cat(toks(0, 8), Toks{9}));
  REQUIRE(r.admitted());
  CHECK(r.num_cached_tokens == 8);
  CHECK(r.num_new_blocks == 1);
  CHECK(ids(m, 4) == Ids{1, 2, 3});  // 3 was evicted, not the hit blocks
  CHECK(lru(m) == Ids{4});
  CHECK(m.stats().evictions == 1);
  const auto ev = drain(m);
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].type == KVEventType::kBlockRemoved);
  CHECK(ev[0].hash == *h3);
  CHECK(m.lookup(cat(toks(50, 4), Toks{1})) == 0);

  SECTION("when only the hit blocks are available, the admission fails and changes nothing") {
    m.free(4);  // 3 free (partial), LRU 4, 2, 1
    REQUIRE(m.try_admit(5, cat(toks(70, 4), Toks{1})).admitted());  // takes free 3, evicts 4
    REQUIRE(ids(m, 5) == Ids{3, 4});
    REQUIRE(lru(m) == Ids{2, 1});
    drain(m);
    const Snapshot before = snapshot(m);
    const auto f = m.try_admit(6, cat(toks(0, 8), Toks{9}));
    CHECK(f.status == AdmitStatus::kNoCapacity);
    CHECK_FALSE(f.admitted());
    CHECK(f.num_cached_tokens == 0);
    CHECK(f.num_new_blocks == 0);
    CHECK(snapshot(m) == before);  // no refcount, no LRU position, no counter
    CHECK(drain(m).empty());
    CHECK_FALSE(m.contains(6));
    CHECK(m.lookup(cat(toks(0, 8), Toks{9})) == 8);  // the hit blocks are still there
  }
}

TEST_CASE("KVCacheManager: failed admissions change nothing", "[kv_cache_manager][admit][atomic]") {
  auto c = cfg(5, 4, true);  // 4 usable
  c.max_tokens_per_seq = 100;
  Mgr m(c);
  REQUIRE(m.try_admit(1, toks(0, 8)).admitted());  // 1, 2 (cached after free)
  build(m, {1});
  m.free(1);
  REQUIRE(m.try_admit(2, toks(20, 5)).admitted());  // 3, 4
  build(m, {2});
  drain(m);
  const Snapshot before = snapshot(m);

  SECTION("no capacity now") {
    // 13 tokens: 2 hit blocks + 2 new ones, but the only available blocks are the (cached) hits themselves.
    const auto r = m.try_admit(3, cat(toks(0, 8), toks(40, 5)));
    CHECK(r.status == AdmitStatus::kNoCapacity);
    CHECK(snapshot(m) == before);
    CHECK(drain(m).empty());
  }
  SECTION("never fits: more blocks than the pool, a different answer") {
    const auto r = m.try_admit(3, toks(0, 17));  // 5 blocks > 4 usable
    CHECK(r.status == AdmitStatus::kNeverFits);
    CHECK(r.num_cached_tokens == 0);
    CHECK(snapshot(m) == before);
    m.free(2);
    const auto again = m.try_admit(3, toks(0, 17));  // even on an empty pool
    CHECK(again.status == AdmitStatus::kNeverFits);
    const auto fits = m.try_admit(3, toks(0, 16));  // exactly the pool
    CHECK(fits.status == AdmitStatus::kAdmitted);
    CHECK(fits.num_cached_tokens == 8);
  }
  SECTION("an admission that fits only by evicting succeeds") {
    const auto r = m.try_admit(3, toks(40, 6));
    CHECK(r.admitted());
    CHECK(m.stats().evictions == 2);
  }
}

TEST_CASE("KVCacheManager: a prompt larger than the pool is 'never fits' under the default limits",
          "[kv_cache_manager][admit]") {
  // docs/contract.md sec. 2: "a request larger than the whole pool gets 'can never fit', a different answer" (a value, not
  // an error). Regression: the default per-sequence limit used to be exactly the pool, so this threw kLimitExceeded.
  Mgr m(cfg(5, 4));  // 4 usable blocks = 16 tokens
  pagedkv::AdmitResult r;
  REQUIRE_NOTHROW(r = m.try_admit(1, toks(0, 17)));
  CHECK(r.status == AdmitStatus::kNeverFits);
  CHECK_FALSE(m.contains(1));
  CHECK(m.stats().prefix_query_requests == 0);
  REQUIRE_NOTHROW(r = m.try_admit(1, toks(0, 1000000)));
  CHECK(r.status == AdmitStatus::kNeverFits);
  CHECK(m.try_admit(1, toks(0, 16)).admitted());
}

TEST_CASE("KVCacheManager: release is tail first, visible in the LRU order", "[kv_cache_manager][lru]") {
  Mgr m(cfg(6, 4, true));  // 5 usable
  REQUIRE(m.try_admit(1, toks(0, 12)).admitted());   // 1, 2, 3
  REQUIRE(m.try_admit(2, toks(50, 8)).admitted());   // 4, 5
  build(m, {1, 2});
  m.free(1);
  CHECK(lru(m) == Ids{3, 2, 1});
  m.preempt(2);
  CHECK(lru(m) == Ids{3, 2, 1, 5, 4});
  CHECK(m.stats().preemptions == 1);
  CHECK(m.stats().blocks_cached == 5);
  CHECK(m.num_sequences() == 0);
  build(m, {});
  std::vector<BlockHash> order;
  for (std::uint32_t b : lru(m)) order.push_back(*m.prefix_index().hash_of(b));
  drain(m);
  // A 3-block request evicts the tail of sequence 1 first: 3, 2, 1.
  REQUIRE(m.try_admit(3, toks(90, 9)).admitted());
  CHECK(ids(m, 3) == Ids{3, 2, 1});
  std::vector<BlockHash> removed;
  for (const auto& e : drain(m)) {
    if (e.type == KVEventType::kBlockRemoved) removed.push_back(e.hash);
  }
  CHECK(removed == std::vector<BlockHash>(order.begin(), order.begin() + 3));
  CHECK(m.stats().evictions == 3);
  CHECK(lru(m) == Ids{5, 4});
  // Sequence 2's prefix (blocks 4, 5) survived.
  CHECK(m.lookup(cat(toks(50, 8), Toks{1})) == 8);
}

TEST_CASE("KVCacheManager: with deduplicate_blocks off a duplicate keeps its id, unregistered",
          "[kv_cache_manager][dedup]") {
  // An engine whose workers keep append-only block tables (vLLM's) must never see a handed-out id change.
  CacheConfig c = cfg(16, 4, true);
  c.deduplicate_blocks = false;
  Mgr m(c);
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());  // 1 (full), 2 (2 tokens)
  build(m, {1});
  REQUIRE(m.try_admit(2, toks(0, 6)).num_cached_tokens == 4);  // hits 1, takes 3
  build(m, {2});
  drain(m);
  REQUIRE(m.try_append(1, Toks{6, 7}).ok());  // block 2 full
  REQUIRE(m.try_append(2, Toks{6, 7}).ok());  // block 3 full with the same content
  const auto [slots, copies] = build(m, {1, 2});
  CHECK(slots == Slots{10, 11, 14, 15});  // both copies written
  CHECK(ids(m, 1) == Ids{1, 2});
  CHECK(ids(m, 2) == Ids{1, 3});  // as handed out
  CHECK(m.allocator().is_hashed(2));
  CHECK_FALSE(m.allocator().is_hashed(3));
  CHECK(m.allocator().refcount(3) == 1);
  CHECK(m.stats().dedup_blocks == 0);
  CHECK(drain(m).size() == 1);  // only block 2 was stored
  // The registered copy serves hits; freeing the duplicate's owner returns it unregistered.
  CHECK(m.lookup(toks(0, 9)) == 8);
  m.free(2);
  CHECK(m.allocator().refcount(3) == 0);
  CHECK_FALSE(m.allocator().is_cached(3));
  CHECK(m.lookup(toks(0, 9)) == 8);
}

TEST_CASE("KVCacheManager: a newly full block whose content is registered is deduplicated at the build",
          "[kv_cache_manager][dedup]") {
  Mgr m(cfg(16, 4, true));
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());  // 1 (full), 2 (2 tokens)
  build(m, {1});                                    // registers block 1
  const auto r = m.try_admit(2, toks(0, 6));       // hits 1, takes 3
  REQUIRE(r.num_cached_tokens == 4);
  REQUIRE(ids(m, 2) == Ids{1, 3});
  REQUIRE(pending(m, 2) == Slots{12, 13});
  drain(m);

  SECTION("the first sequence of the batch registers; the second switches and its slots become -1") {
    build(m, {1, 2});
    REQUIRE(m.try_append(1, Toks{6, 7}).ok());   // block 2 full
    const auto a = m.try_append(2, Toks{6, 7});  // block 3 full with the same content
    REQUIRE(a.ok());
    CHECK(Slots(a.slots.begin(), a.slots.end()) == Slots{14, 15});  // the reservation itself is not -1
    CHECK_FALSE(a.copy.has_value());
    CHECK(ids(m, 2) == Ids{1, 3});
    CHECK_FALSE(m.allocator().is_hashed(2));
    const auto [slots, copies] = build(m, {1, 2});
    CHECK(slots == Slots{10, 11, -1, -1});
    CHECK(ids(m, 1) == Ids{1, 2});
    CHECK(ids(m, 2) == Ids{1, 2});
    CHECK(m.allocator().refcount(2) == 2);
    CHECK(m.allocator().refcount(3) == 0);
    CHECK_FALSE(m.allocator().is_hashed(3));
    CHECK_FALSE(m.allocator().is_cached(3));
    CHECK(m.stats().dedup_blocks == 1);
    const auto ev = drain(m);
    REQUIRE(ev.size() == 1);  // only block 2 was stored
    CHECK(ev[0].hash == *m.prefix_index().hash_of(2));
    // 3 went back to the free stack; never-used blocks still come first.
    REQUIRE(m.try_append(2, Toks{8}).ok());
    CHECK(ids(m, 2) == Ids{1, 2, 4});
  }
  SECTION("batch order decides which copy is kept") {
    build(m, {1, 2});
    REQUIRE(m.try_append(1, Toks{6, 7}).ok());
    REQUIRE(m.try_append(2, Toks{6, 7}).ok());
    const auto [slots, copies] = build(m, {2, 1});
    CHECK(slots == Slots{14, 15, -1, -1});
    CHECK(ids(m, 1) == Ids{1, 3});
    CHECK(ids(m, 2) == Ids{1, 3});
    CHECK(m.allocator().refcount(2) == 0);
  }
  SECTION("without an intermediate build: every slot of the switched block becomes -1, earlier ones included") {
    REQUIRE(m.try_append(1, Toks{6, 7}).ok());
    const auto a = m.try_append(2, Toks{6, 7, 8});
    REQUIRE(a.ok());
    CHECK(ids(m, 2) == Ids{1, 3, 4});
    CHECK(pending(m, 2) == Slots{12, 13, 14, 15, 16});
    const auto [slots, copies] = build(m, {1, 2});
    CHECK(slots == Slots{10, 11, -1, -1, -1, -1, 16});
    CHECK(ids(m, 2) == Ids{1, 2, 4});
    CHECK(pending(m, 2).empty());
  }
  SECTION("a sequence not in the batch is not deduplicated (nor registered) yet") {
    build(m, {1, 2});
    REQUIRE(m.try_append(1, Toks{6, 7}).ok());
    REQUIRE(m.try_append(2, Toks{6, 7}).ok());
    build(m, {1});
    CHECK(ids(m, 2) == Ids{1, 3});
    CHECK(m.stats().dedup_blocks == 0);
    const auto [slots, copies] = build(m, {2});
    CHECK(slots == Slots{-1, -1});
    CHECK(ids(m, 2) == Ids{1, 2});
  }
  SECTION("a duplicate is switched before anyone can share it: fork waits for the build") {
    build(m, {1, 2});
    REQUIRE(m.try_append(1, Toks{6, 7}).ok());
    REQUIRE(m.try_append(2, Toks{6, 7}).ok());
    build(m, {1});  // block 2 registered
    // Forking 2 now would share its unbuilt duplicate block 3: refused, nothing changes.
    const auto before = snapshot(m);
    CHECK_THAT(expect_error([&] { m.fork(2, 3); }, Errc::kInvalidArgument),
               Catch::Contains("parent sequence 2") && Catch::Contains("2 unbuilt slots"));
    CHECK(snapshot(m) == before);
    const auto [slots, copies] = build(m, {2});
    CHECK(slots == Slots{-1, -1});
    m.fork(2, 3);
    CHECK(ids(m, 2) == Ids{1, 2});
    CHECK(ids(m, 3) == Ids{1, 2});
    CHECK(m.stats().dedup_blocks == 1);
  }
  SECTION("the copy-on-write destination of a deduplicated block is dropped with its copy") {
    build(m, {1, 2});
    REQUIRE(m.try_append(1, Toks{6, 7}).ok());  // block 2 = [4, 5, 6, 7]
    build(m, {1});                                // registered
    m.fork(2, 3);                                 // 3 shares the partial block 3
    const auto a = m.try_append(2, Toks{6, 7});  // copy 3 -> 4; block 4 is full and equal to 2
    REQUIRE(a.ok());
    REQUIRE(a.copy.has_value());
    CHECK(*a.copy == Copy{3, 4});
    CHECK(m.allocator().refcount(3) == 2);  // sequence 3 + the pending copy
    const auto [slots, copies] = build(m, {2});
    CHECK(copies.empty());  // the copy went with its destination
    CHECK(slots == Slots{-1, -1});
    CHECK(m.pending_copies().empty());
    CHECK(ids(m, 2) == Ids{1, 2});
    CHECK(m.allocator().refcount(3) == 1);  // only sequence 3; the copy's reference was released
    CHECK(m.allocator().refcount(4) == 0);
    CHECK(m.stats().cow_copies == 1);
    CHECK(m.stats().dedup_blocks == 1);
  }
}

TEST_CASE("KVCacheManager: blocks are registered only by the build that issues their writes",
          "[kv_cache_manager][prefix][register]") {
  Mgr m(cfg(16, 4, true));
  const Toks p = toks(0, 9);
  SECTION("a sequence freed before its step ran leaves no cache hit behind") {
    REQUIRE(m.try_admit(1, p).admitted());
    m.free(1);  // aborted in the same step: its prefill never ran
    CHECK(m.lookup(p) == 0);
    CHECK(m.try_admit(2, p).num_cached_tokens == 0);
    CHECK(drain(m).empty());
    CHECK(m.stats().blocks_cached == 0);
  }
  SECTION("preempted in the step that filled a block: only the blocks built before are cached") {
    REQUIRE(m.try_admit(1, toks(0, 7)).admitted());
    build(m, {1});                           // the prefill step: positions 0..6 written, block 0 registered
    REQUIRE(m.try_append(1, Toks{7}).ok());  // the decode token fills block 1 (not yet written)
    m.preempt(1);
    const auto r = m.try_admit(1, toks(0, 9));
    CHECK(r.num_cached_tokens == 4);
  }
  SECTION("two identical prompts in one step: no same-step hit; the duplicate is removed at the build") {
    REQUIRE(m.try_admit(1, p).admitted());  // 1, 2, 3
    const auto r = m.try_admit(2, p);
    CHECK(r.num_cached_tokens == 0);
    CHECK(ids(m, 2) == Ids{4, 5, 6});
    const auto [slots, copies] = build(m, {1, 2});
    CHECK(slots == Slots{4, 5, 6, 7, 8, 9, 10, 11, 12, -1, -1, -1, -1, -1, -1, -1, -1, 24});
    CHECK(ids(m, 2) == Ids{1, 2, 6});
    CHECK(m.stats().dedup_blocks == 2);
    CHECK(drain(m).size() == 2);
  }
  SECTION("a parent is forked only once its blocks are built, so a child never inherits unwritten blocks") {
    REQUIRE(m.try_admit(1, p).admitted());
    build(m, {1});
    REQUIRE(m.try_append(1, toks(9, 3)).ok());  // block 3 full, unbuilt
    CHECK_THAT(expect_error([&] { m.fork(1, 2); }, Errc::kInvalidArgument), Catch::Contains("3 unbuilt slots"));
    CHECK_FALSE(m.contains(2));
    CHECK_FALSE(m.allocator().is_hashed(3));
    build(m, {1});
    CHECK(m.allocator().is_hashed(3));
    m.fork(1, 2);
    CHECK(ids(m, 2) == ids(m, 1));
    CHECK(m.lookup(toks(0, 13)) == 12);
  }
}

TEST_CASE("KVCacheManager: fork shares blocks - the first append to the shared partial block copies it",
          "[kv_cache_manager][fork][cow]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());  // 1, 2
  build(m, {1});
  const auto free_before = m.stats().blocks_free;
  m.fork(1, 2);
  CHECK(m.stats().blocks_free == free_before);
  CHECK(ids(m, 2) == Ids{1, 2});
  CHECK(m.num_tokens(2) == 6);
  CHECK(Toks(m.token_ids(2).begin(), m.token_ids(2).end()) == toks(0, 6));
  CHECK(pending(m, 2).empty());
  CHECK(m.allocator().refcount(1) == 2);
  CHECK(m.allocator().refcount(2) == 2);

  const auto a = m.try_append(1, Toks{6});
  REQUIRE(a.ok());
  REQUIRE(a.copy.has_value());
  CHECK(*a.copy == Copy{2, 3});
  CHECK(Slots(a.slots.begin(), a.slots.end()) == Slots{14});
  CHECK(ids(m, 1) == Ids{1, 3});
  CHECK(m.pending_copies().size() == 1);
  CHECK(m.pending_copies()[0] == Copy{2, 3});
  CHECK(m.stats().cow_copies == 1);
  CHECK(m.allocator().refcount(2) == 2);  // sequence 2 + the pending copy

  SECTION("the other side, in the same step, writes in place: the copy runs before the step's writes") {
    const auto b = m.try_append(2, Toks{7});
    REQUIRE(b.ok());
    CHECK_FALSE(b.copy.has_value());
    CHECK(Slots(b.slots.begin(), b.slots.end()) == Slots{10});
    CHECK(m.stats().cow_copies == 1);
    const auto [slots, copies] = build(m, {1, 2});
    CHECK(copies == std::vector<std::int32_t>{2, 3});
    CHECK(slots == Slots{14, 10});
    CHECK(m.allocator().refcount(2) == 1);
  }
  SECTION("after the build, the other side is the only holder: written in place") {
    const auto [slots, copies] = build(m, {1, 2});
    CHECK(copies == std::vector<std::int32_t>{2, 3});
    CHECK(slots == Slots{14});
    CHECK(m.allocator().refcount(2) == 1);
    CHECK(m.pending_copies().empty());
    const auto b = m.try_append(2, Toks{6});
    REQUIRE(b.ok());
    CHECK_FALSE(b.copy.has_value());
    CHECK(Slots(b.slots.begin(), b.slots.end()) == Slots{10});
    CHECK(m.stats().cow_copies == 1);
  }
  SECTION("three holders: two copies, the last one writes in place") {
    m.fork(2, 4);  // block 2: sequences 2, 4 + the pending copy
    const auto c2 = m.try_append(2, Toks{8});
    REQUIRE(c2.copy.has_value());
    CHECK(*c2.copy == Copy{2, 4});
    const auto c4 = m.try_append(4, Toks{9});
    CHECK_FALSE(c4.copy.has_value());
    CHECK(ids(m, 4) == Ids{1, 2});
    CHECK(m.allocator().refcount(2) == 3);  // sequence 4 + two pending copies
    const auto [slots, copies] = build(m, {1, 2, 4});
    CHECK(copies == std::vector<std::int32_t>{2, 3, 2, 4});
    CHECK(slots == Slots{14, 18, 10});
    CHECK(m.allocator().refcount(2) == 1);
  }
  SECTION("appends to unshared blocks never copy") {
    build(m, {1, 2});
    for (int i = 0; i < 10; ++i) {
      CHECK_FALSE(m.try_append(1, Toks{i}).copy.has_value());
      CHECK_FALSE(m.try_append(2, Toks{i}).copy.has_value());
    }
    CHECK(m.stats().cow_copies == 1);
  }
  SECTION("a block-aligned fork never copies") {
    REQUIRE(m.try_append(1, Toks{7}).ok());  // sequence 1 = 8 tokens: blocks 1, 3 full
    build(m, {1, 2});
    m.fork(1, 3);
    CHECK_FALSE(m.try_append(3, Toks{8}).copy.has_value());
    CHECK_FALSE(m.try_append(1, Toks{8}).copy.has_value());
    CHECK(m.stats().cow_copies == 1);
  }
  SECTION("freeing the copier before the build drops the copy and its source reference") {
    build(m, {1, 2});
    REQUIRE(m.try_append(2, Toks{6, 7, 8}).ok());  // 2 = [1, 2, 4]
    build(m, {1, 2});
    m.fork(2, 3);
    const auto c = m.try_append(3, Toks{9});
    REQUIRE(c.copy.has_value());
    CHECK(*c.copy == Copy{4, 5});
    CHECK(m.allocator().refcount(4) == 2);
    m.free(3);
    CHECK(m.pending_copies().empty());
    CHECK(m.allocator().refcount(4) == 1);
    CHECK(m.allocator().refcount(5) == 0);
  }
}

TEST_CASE("KVCacheManager: rewind", "[kv_cache_manager][rewind]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 10)).admitted());  // 1, 2 (full), 3 (2 tokens)

  SECTION("pending slots of dropped tokens are removed") {
    m.rewind(1, 3);
    CHECK(m.num_tokens(1) == 7);
    CHECK(Toks(m.token_ids(1).begin(), m.token_ids(1).end()) == toks(0, 7));
    CHECK(pending(m, 1) == Slots{4, 5, 6, 7, 8, 9, 10});
    CHECK(ids(m, 1) == Ids{1, 2});
    CHECK(m.allocator().refcount(3) == 0);
  }
  SECTION("rewinding unbuilt tokens: the block is not registered yet, so it is written in place") {
    m.rewind(1, 4);  // 6 tokens: block 2 keeps 2 tokens
    const auto a = m.try_append(1, Toks{100});
    CHECK_FALSE(a.copy.has_value());
    CHECK(Slots(a.slots.begin(), a.slots.end()) == Slots{10});
    const auto [slots, copies] = build(m, {1});
    CHECK(slots == Slots{4, 5, 6, 7, 8, 9, 10});
    CHECK(copies.empty());
    CHECK(m.prefix_index().size() == 1);  // block 1 only
  }
  SECTION("rewinding into a registered block: the block stays intact and the next append copies it") {
    build(m, {1});
    m.rewind(1, 4);  // 6 tokens: block 2 keeps 2 tokens but is hashed
    CHECK(ids(m, 1) == Ids{1, 2});
    CHECK(pending(m, 1).empty());
    const auto a = m.try_append(1, Toks{100});
    REQUIRE(a.copy.has_value());
    CHECK(*a.copy == Copy{2, 4});
    CHECK(ids(m, 1) == Ids{1, 4});
    CHECK(Slots(a.slots.begin(), a.slots.end()) == Slots{18});
    build(m, {1});
    CHECK(m.allocator().is_cached(2));  // intact and still cached
    CHECK(m.lookup(cat(toks(0, 8), Toks{1})) == 8);
    REQUIRE(m.try_append(1, Toks{101}).ok());  // block 4 = [4, 5, 100, 101]: another hash
    build(m, {1});
    CHECK(m.lookup(Toks{0, 1, 2, 3, 4, 5, 100, 101, 0}) == 8);
    CHECK(m.prefix_index().size() == 3);
  }
  SECTION("rewinding the whole sequence leaves it live and empty") {
    build(m, {1});
    m.rewind(1, 10);
    CHECK(m.contains(1));
    CHECK(m.num_tokens(1) == 0);
    CHECK(ids(m, 1).empty());
    CHECK(lru(m) == Ids{2, 1});  // 3 free, then 2 and 1 cached, tail first
    REQUIRE(m.try_append(1, toks(0, 5)).ok());  // fresh blocks 4, 5; block 4 = [0..3] is registered as block 1
    CHECK(ids(m, 1) == Ids{4, 5});
    const auto [slots, copies] = build(m, {1});
    CHECK(slots == Slots{-1, -1, -1, -1, 20});
    CHECK(ids(m, 1) == Ids{1, 5});
    CHECK(m.stats().dedup_blocks == 1);
  }
}

TEST_CASE("KVCacheManager: append with no capacity changes nothing", "[kv_cache_manager][append][atomic]") {
  Mgr m(cfg(4, 4, true));  // 3 usable
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());  // 1, 2
  REQUIRE(m.try_admit(2, toks(10, 3)).admitted());  // 3
  build(m, {1, 2});
  m.fork(1, 3);
  drain(m);
  const Snapshot before = snapshot(m);
  const auto a = m.try_append(1, Toks{1});  // needs a copy block: none
  CHECK(a.status == pagedkv::AppendStatus::kNoCapacity);
  CHECK_FALSE(a.ok());
  CHECK(a.slots.empty());
  CHECK_FALSE(a.copy.has_value());
  CHECK(m.try_append(2, toks(0, 2)).status == pagedkv::AppendStatus::kNoCapacity);
  CHECK(snapshot(m) == before);
  CHECK(drain(m).empty());
  CHECK(m.try_append(2, Toks{1}).ok());  // fits in block 3
}

TEST_CASE("KVCacheManager: reset_prefix_cache", "[kv_cache_manager][reset]") {
  Mgr m(cfg(8, 4, true));
  REQUIRE(m.try_admit(1, toks(0, 9)).admitted());
  REQUIRE(m.try_admit(2, toks(50, 4)).admitted());
  build(m, {1, 2});
  m.free(2);
  const auto stored = drain(m);
  REQUIRE(stored.size() == 3);
  const Snapshot before = snapshot(m);
  CHECK_FALSE(m.reset_prefix_cache());  // a block is held
  CHECK(snapshot(m) == before);
  CHECK(drain(m).empty());
  m.free(1);
  CHECK(m.stats().blocks_cached == 3);
  CHECK(m.reset_prefix_cache());
  const CacheStats s = m.stats();
  CHECK(s.blocks_cached == 0);
  CHECK(s.blocks_free == 7);
  CHECK(s.blocks_used == 0);
  CHECK(m.prefix_index().size() == 0);
  for (std::uint32_t b = 1; b < 8; ++b) CHECK_FALSE(m.allocator().is_hashed(b));
  CHECK(m.lookup(toks(0, 9)) == 0);
  const auto ev = drain(m);
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].type == KVEventType::kAllCleared);
  CHECK(ev[0].seq_no == stored.back().seq_no + 1);
  CHECK(m.reset_prefix_cache());  // idempotent
  CHECK(m.try_admit(3, toks(0, 9)).num_cached_tokens == 0);
}

TEST_CASE("KVCacheManager: KV events", "[kv_cache_manager][events]") {
  Mgr m(cfg(6, 4, true));  // 5 usable
  RequestKeys keys;
  keys.adapter_id = 5;
  BlockHash img;
  img.bytes[0] = 0xab;
  keys.multimodal.push_back({img, 6, 1});  // in block 1
  REQUIRE(m.try_admit(1, toks(0, 9), &keys).admitted());  // 1, 2 full; 3 partial
  std::vector<KVEvent> ev;
  CHECK(m.drain_events(ev) == 0);  // stored by the build, not at admission
  build(m, {1});
  CHECK(m.drain_events(ev) == 2);
  REQUIRE(ev.size() == 2);
  CHECK(ev[0].seq_no == 1);
  CHECK(ev[0].type == KVEventType::kBlockStored);
  CHECK(ev[0].hash == *m.prefix_index().hash_of(1));
  CHECK_FALSE(ev[0].parent_hash.has_value());
  CHECK(ev[0].token_ids == toks(0, 4));
  CHECK(ev[0].adapter_id == 5);
  CHECK(ev[0].multimodal_items.empty());
  CHECK(ev[0].block_size == 4);
  CHECK(ev[0].block_start == 0);
  CHECK(ev[0].medium == pagedkv::Medium::kGpu);
  CHECK(ev[1].seq_no == 2);
  CHECK(ev[1].hash == *m.prefix_index().hash_of(2));
  CHECK(ev[1].parent_hash == std::optional<BlockHash>(ev[0].hash));
  CHECK(ev[1].token_ids == toks(4, 4));
  CHECK(ev[1].adapter_id == 5);
  REQUIRE(ev[1].multimodal_items.size() == 1);
  CHECK(ev[1].multimodal_items[0].item_hash == img);
  CHECK(ev[1].multimodal_items[0].offset_tokens == 6);
  CHECK(ev[1].block_start == 4);
  CHECK(m.drain_events(ev) == 0);  // drained
  CHECK(ev.size() == 2);           // appended to, not replaced

  REQUIRE(m.try_append(1, Toks{9, 10, 11}).ok());  // block 3 full
  build(m, {1});
  const auto e2 = drain(m);
  REQUIRE(e2.size() == 1);
  CHECK(e2[0].seq_no == 3);
  CHECK(e2[0].parent_hash == std::optional<BlockHash>(ev[1].hash));
  CHECK(e2[0].token_ids == toks(8, 4));

  m.free(1);  // LRU: 3, 2, 1
  REQUIRE(m.try_admit(2, toks(100, 13)).admitted());  // 4 blocks: 4, 5 never used, then evicts 3, 2
  const auto e3 = drain(m);
  REQUIRE(e3.size() == 2);
  CHECK(e3[0].type == KVEventType::kBlockRemoved);
  CHECK(e3[0].seq_no == 4);
  CHECK(e3[0].hash == e2[0].hash);  // block 3 went first (tail first)
  CHECK(e3[1].type == KVEventType::kBlockRemoved);
  CHECK(e3[1].seq_no == 5);
  CHECK(e3[1].hash == ev[1].hash);
  CHECK(e3[0].token_ids.empty());
  CHECK_FALSE(e3[0].parent_hash.has_value());
  build(m, {2});
  const auto e4 = drain(m);
  REQUIRE(e4.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) {
    CHECK(e4[i].type == KVEventType::kBlockStored);
    CHECK(e4[i].seq_no == 6 + i);
  }

  SECTION("events are off by default") {
    Mgr quiet(cfg(6, 4));
    REQUIRE(quiet.try_admit(1, toks(0, 9)).admitted());
    build(quiet, {1});
    quiet.free(1);
    CHECK(quiet.reset_prefix_cache());
    std::vector<KVEvent> none;
    CHECK(quiet.drain_events(none) == 0);
    CHECK(none.empty());
  }
}

TEST_CASE("KVCacheManager: counters", "[kv_cache_manager][stats]") {
  Mgr m(cfg(6, 2));  // 5 usable
  REQUIRE(m.try_admit(1, toks(0, 5)).admitted());  // 1, 2, 3
  CHECK(m.stats().block_ops == 3);
  build(m, {1});
  m.fork(1, 2);
  CHECK(m.stats().block_ops == 6);
  REQUIRE(m.try_append(2, Toks{9}).ok());  // copy 3 -> 4
  CHECK(m.stats().cow_copies == 1);
  CHECK(m.stats().block_ops == 7);
  build(m, {1, 2});
  CHECK(m.stats().block_ops == 8);  // the copy's source reference
  m.preempt(1);
  m.preempt(2);
  CHECK(m.stats().preemptions == 2);
  const CacheStats s = m.stats();
  CHECK(s.blocks_used == 0);
  CHECK(s.blocks_cached == 3);  // 1, 2 and (2's) 4 = [4, 9]
  CHECK(s.blocks_free == 2);
  CHECK(s.usage == 0.0);
  REQUIRE(m.try_admit(3, cat(toks(0, 4), Toks{4, 9, 7})).admitted());
  const CacheStats t = m.stats();
  CHECK(t.prefix_query_requests == 2);
  CHECK(t.prefix_hit_requests == 1);
  CHECK(t.prefix_query_tokens == 12);
  CHECK(t.prefix_hit_tokens == 6);
  CHECK(t.usage == Approx(4.0 / 5.0));
  m.free(3);  // free stack 3, 5; LRU 4, 2, 1
  REQUIRE(m.try_admit(4, toks(50, 8)).admitted());  // free blocks first (5, 3), then the LRU victims 4, 2
  CHECK(ids(m, 4) == Ids{5, 3, 4, 2});
  CHECK(m.stats().evictions == 2);
}

TEST_CASE("KVCacheManager: prefix caching off", "[kv_cache_manager][config]") {
  auto c = cfg(8, 4, true);
  c.enable_prefix_caching = false;
  Mgr m(c);
  REQUIRE(m.try_admit(1, toks(0, 9)).admitted());
  build(m, {1});
  CHECK_FALSE(m.allocator().is_hashed(1));
  m.free(1);
  CHECK(m.stats().blocks_cached == 0);
  CHECK(m.stats().blocks_free == 7);
  const auto r = m.try_admit(2, toks(0, 9));
  CHECK(r.num_cached_tokens == 0);
  CHECK(ids(m, 2) == Ids{4, 5, 6});  // never-used first
  REQUIRE(m.try_admit(3, toks(0, 9)).admitted());
  CHECK(ids(m, 3) == Ids{7, 1, 2});  // then the free stack: 1 was released last (tail first)
  build(m, {2, 3});
  CHECK(m.stats().dedup_blocks == 0);
  CHECK(drain(m).empty());
}

TEMPLATE_TEST_CASE("KVCacheManager works with both hash policies", "[kv_cache_manager][hash]", pagedkv::Sha256Hasher,
                   pagedkv::Xxh3Hasher) {
  pagedkv::KVCacheManager<TestType> m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 12)).admitted());
  build(m, {1});
  CHECK(m.try_admit(2, toks(0, 13)).num_cached_tokens == 12);
  REQUIRE(m.try_admit(3, toks(0, 6)).admitted());
  REQUIRE(m.try_append(3, Toks{6, 7}).ok());
  build(m, {2, 3});  // sequence 3's second block is switched to block 2
  CHECK(ids(m, 3) == Ids{1, 2});
  CHECK(m.stats().dedup_blocks == 1);
}

TEST_CASE("KVCacheManager: 16-bit block ids", "[kv_cache_manager][id_type]") {
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint16_t> m(cfg(100, 16));
  REQUIRE(m.try_admit(1, toks(0, 40)).admitted());
  const auto b = m.block_ids(1);
  CHECK(std::vector<std::uint16_t>(b.begin(), b.end()) == std::vector<std::uint16_t>{1, 2, 3});
  CHECK(m.pending_slots(1)[39] == 3 * 16 + 7);
}

// ---- Findings --------------------------------------------------------------------------------------------------

namespace {
// A shadow KV pool: each slot holds the token id whose K/V was written there (-1: never written). `step` runs one
// built step as the kernels do (docs/contract.md sec. 1): copy_blocks over the copy list, then write_kv over the slot
// mapping; `reads_own_tokens` checks that every position of a sequence reads its own token's K/V.
struct ShadowKV {
  std::uint32_t bs;
  std::vector<std::int64_t> kv;
  ShadowKV(std::size_t num_blocks, std::uint32_t block_size) : bs(block_size), kv(num_blocks * block_size, -1) {}
  void step(Mgr& m, const std::vector<SeqId>& batch) {
    std::vector<std::int64_t> tokens_in_order;  // the token of every new slot, in batch order
    for (SeqId id : batch) {
      const auto t = m.token_ids(id);
      const std::size_t n = m.pending_slots(id).size();
      tokens_in_order.insert(tokens_in_order.end(), t.end() - static_cast<std::ptrdiff_t>(n), t.end());
    }
    const auto [slots, copies] = build(m, batch);
    for (std::size_t i = 0; i < copies.size(); i += 2) {
      std::copy_n(kv.begin() + copies[i] * bs, bs, kv.begin() + copies[i + 1] * bs);
    }
    for (std::size_t i = 0; i < slots.size(); ++i) {
      if (slots[i] >= 0) kv[static_cast<std::size_t>(slots[i])] = tokens_in_order[i];
    }
  }
  bool reads_own_tokens(const Mgr& m, SeqId id) const {
    const auto t = m.token_ids(id);
    const auto b = m.block_ids(id);
    for (std::size_t p = 0; p < t.size(); ++p) {
      if (kv[b[p / bs] * bs + p % bs] != t[p]) return false;
    }
    return true;
  }
};
}  // namespace

TEST_CASE("KVCacheManager: engine-ordered steps read the right K/V (shadow pool)", "[kv_cache_manager][cow][shadow]") {
  Mgr m(cfg(16, 4));
  ShadowKV kv(16, 4);
  REQUIRE(m.try_admit(1, toks(100, 6)).admitted());
  kv.step(m, {1});
  m.fork(1, 2);  // after the prefill step: allowed
  REQUIRE(m.try_append(1, Toks{106}).copy.has_value());  // copy 2 -> 3
  REQUIRE_FALSE(m.try_append(2, Toks{206}).copy.has_value());  // written in place after the copy
  kv.step(m, {1, 2});
  CHECK(kv.reads_own_tokens(m, 1));
  CHECK(kv.reads_own_tokens(m, 2));
  REQUIRE(m.try_admit(3, cat(toks(100, 4), Toks{9})).num_cached_tokens == 4);  // a hit
  kv.step(m, {1, 2, 3});
  CHECK(kv.reads_own_tokens(m, 3));
}

TEST_CASE("KVCacheManager: no copy list has a block that is both a source and a destination",
          "[kv_cache_manager][cow][regression]") {
  // Issue 12, defect 1: admit A, build, fork A->S, append to A (copy 2->3), rewind A by 1 (its pending slot is
  // gone, the copy still pending), fork A->C, append to C (copy 3->4), build A and C together: the list held
  // (2->3), (3->4), which reference::validate rejects and a parallel copy kernel would turn into garbage K/V for
  // C. The fork of a parent with a pending copy into its table is now refused, state unchanged.
  Mgr m(cfg(8, 4));
  REQUIRE(m.try_admit(1, toks(100, 6)).admitted());  // A: blocks 1, 2
  build(m, {1});
  m.fork(1, 2);                                       // S shares 1, 2
  const auto a = m.try_append(1, Toks{106});
  REQUIRE(a.copy == Copy{2, 3});
  m.rewind(1, 1);
  CHECK(m.pending_slots(1).empty());
  REQUIRE(m.pending_copies().size() == 1);
  const auto before = snapshot(m);
  CHECK_THAT(expect_error([&] { m.fork(1, 3); }, Errc::kInvalidArgument),
             Catch::Contains("parent sequence 1") && Catch::Contains("1 pending copy-on-write"));
  CHECK(snapshot(m) == before);
  // After the build the copy is issued and the fork is legal; C's copy reads a block whose fill was issued in an
  // earlier launch.
  const auto [s1, c1] = build(m, {1});
  CHECK(c1 == std::vector<std::int32_t>{2, 3});
  m.fork(1, 3);
  const auto c = m.try_append(3, Toks{107});
  REQUIRE(c.copy == Copy{3, 4});
  const auto [s2, c2] = build(m, {1, 3});
  CHECK(c2 == std::vector<std::int32_t>{3, 4});
  CHECK(s2 == Slots{18});  // C's position 6: block 4, offset 2
}
