// Tests of pagedkv/error.hpp and of every misuse path of the host API: each Errc is triggered through the public
// API, its code and message (naming the bad value) are checked, and the full observable state is compared before
// and after (strong guarantee): counters, every live sequence's blocks / tokens / pending slots, pending copies,
// every block's refcount / hash mark / cached state / registered hash, the LRU order, and the event stream.
#include <catch2/catch.hpp>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)
#include <pagedkv/prefix_hash_index.hpp>

namespace {

using pagedkv::BlockHash;
using pagedkv::CacheStats;
using pagedkv::Errc;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Mgr = pagedkv::KVCacheManager<>;
using Toks = std::vector<TokenId>;
using Ids = std::vector<std::uint32_t>;
using Slots = std::vector<std::int64_t>;

using pagedkv_test::toks;

// Runs f; requires a pagedkv::Error with `code`; checks what() = "pagedkv: <code name>: <message>"; returns message.
std::string expect_error(const std::function<void()>& f, Errc code) {
  try {
    f();
  } catch (const pagedkv::Error& e) {
    CHECK(e.code() == code);
    CHECK(std::string(e.what()) == std::string("pagedkv: ") + pagedkv::to_string(code) + ": " + e.message());
    return e.message();
  } catch (const std::exception& e) {
    FAIL("expected pagedkv::Error, got std::exception: " << e.what());
  }
  FAIL("expected pagedkv::Error(" << pagedkv::to_string(code) << "), nothing was thrown");
  return {};
}

auto stats_tuple(const CacheStats& s) {
  return std::make_tuple(s.num_usable_blocks, s.blocks_used, s.blocks_cached, s.blocks_free, s.usage,
                         s.prefix_query_requests, s.prefix_hit_requests, s.prefix_query_tokens, s.prefix_hit_tokens,
                         s.evictions, s.cow_copies, s.dedup_blocks, s.preemptions, s.block_ops);
}

struct Snapshot {
  decltype(stats_tuple(CacheStats{})) stats;
  std::size_t num_sequences = 0;
  std::map<SeqId, std::tuple<Ids, std::size_t, Toks, Slots>> seqs;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> copies;
  std::vector<std::tuple<std::uint32_t, bool, bool, std::optional<BlockHash>>> blocks;
  Ids lru;
  std::size_t index_size = 0;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

Snapshot snapshot(const Mgr& m) {
  Snapshot s;
  s.stats = stats_tuple(m.stats());
  s.num_sequences = m.num_sequences();
  m.for_each_sequence([&](SeqId id, std::span<const std::uint32_t> blocks, std::size_t n) {
    const auto t = m.token_ids(id);
    const auto p = m.pending_slots(id);
    CHECK(m.num_tokens(id) == n);
    CHECK(Ids(m.block_ids(id).begin(), m.block_ids(id).end()) == Ids(blocks.begin(), blocks.end()));
    s.seqs[id] = {Ids(blocks.begin(), blocks.end()), n, Toks(t.begin(), t.end()), Slots(p.begin(), p.end())};
  });
  for (const auto& c : m.pending_copies()) s.copies.emplace_back(c.src, c.dst);
  const auto& a = m.allocator();
  for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
    s.blocks.emplace_back(a.refcount(b), a.is_hashed(b), a.is_cached(b), m.prefix_index().hash_of(b));
  }
  s.lru = a.eviction_policy().order();
  s.index_size = m.prefix_index().size();
  return s;
}

// A manager in a state with a bit of everything: shared blocks, a pending copy, pending slots, cached and free
// blocks. max_tokens_per_seq = 40.
std::unique_ptr<Mgr> busy_manager() {
  pagedkv::CacheConfig c;
  c.num_blocks = 12;
  c.block_size = 4;
  c.enable_events = true;
  c.max_tokens_per_seq = 40;
  auto m = std::make_unique<Mgr>(c);
  REQUIRE(m->try_admit(1, toks(0, 10)).admitted());  // 1, 2, 3
  pagedkv_test::build_step(*m, {1});
  REQUIRE(m->try_admit(2, toks(0, 9)).num_cached_tokens == 8);  // 1, 2, 4
  REQUIRE(m->try_admit(3, toks(50, 8)).admitted());             // 5, 6
  pagedkv_test::build_step(*m, {3});                            // registers 5, 6
  m->free(3);                                                   // cached 6, 5
  m->fork(1, 4);
  REQUIRE(m->try_append(4, Toks{99}).copy.has_value());  // pending copy 3 -> 7
  std::vector<pagedkv::KVEvent> ev;
  m->drain_events(ev);
  REQUIRE(m->pending_copies().size() == 1);
  REQUIRE(m->stats().blocks_cached == 2);
  return m;
}

// Requires that `f` throws `code` with a message containing every needle, and that nothing changed.
void check_rejected(Mgr& m, const std::function<void()>& f, Errc code, const std::vector<std::string>& needles) {
  const Snapshot before = snapshot(m);
  const std::string msg = expect_error(f, code);
  for (const auto& n : needles) CHECK_THAT(msg, Catch::Contains(n));
  CHECK(snapshot(m) == before);
  std::vector<pagedkv::KVEvent> ev;
  CHECK(m.drain_events(ev) == 0);
}

}  // namespace

TEST_CASE("Errc names and the Error type", "[errors]") {
  CHECK(std::string(pagedkv::to_string(Errc::kInvalidArgument)) == "invalid_argument");
  CHECK(std::string(pagedkv::to_string(Errc::kUnknownSequence)) == "unknown_sequence");
  CHECK(std::string(pagedkv::to_string(Errc::kDuplicateSequence)) == "duplicate_sequence");
  CHECK(std::string(pagedkv::to_string(Errc::kDoubleFree)) == "double_free");
  CHECK(std::string(pagedkv::to_string(Errc::kLimitExceeded)) == "limit_exceeded");
  CHECK(std::string(pagedkv::to_string(Errc::kBlockOutOfRange)) == "block_out_of_range");
  CHECK(std::string(pagedkv::to_string(Errc::kBadShape)) == "bad_shape");
  CHECK(std::string(pagedkv::to_string(static_cast<Errc>(99))) == "unknown_error");
  // Stable values.
  CHECK(static_cast<int>(Errc::kInvalidArgument) == 1);
  CHECK(static_cast<int>(Errc::kUnknownSequence) == 2);
  CHECK(static_cast<int>(Errc::kDuplicateSequence) == 3);
  CHECK(static_cast<int>(Errc::kDoubleFree) == 4);
  CHECK(static_cast<int>(Errc::kLimitExceeded) == 5);
  CHECK(static_cast<int>(Errc::kBlockOutOfRange) == 6);
  CHECK(static_cast<int>(Errc::kBadShape) == 7);

  const pagedkv::Error e(Errc::kBadShape, "x is 3");
  CHECK(e.code() == Errc::kBadShape);
  CHECK(e.message() == "x is 3");
  CHECK(std::string(e.what()) == "pagedkv: bad_shape: x is 3");
  STATIC_REQUIRE(std::is_base_of_v<std::exception, pagedkv::Error>);
  try {
    pagedkv::detail::raise(Errc::kDoubleFree, "block 9");
  } catch (const std::exception& ex) {  // catchable as std::exception
    CHECK(std::string(ex.what()) == "pagedkv: double_free: block 9");
  }
}

TEST_CASE("Errc::kInvalidArgument", "[errors][invalid_argument]") {
  auto m = busy_manager();
  SECTION("a retention boundary outside the prompt") {
    pagedkv::AdmitOptions o;
    o.prompt_retention_tokens = 0;
    check_rejected(*m, [&] { m->try_admit(77, Toks{1, 2, 3}, nullptr, o); }, Errc::kInvalidArgument,
                   {"try_admit", "prompt_retention_tokens = 0", "[1, 3]"});
  }
  SECTION("a sequence twice in a batch") {
    check_rejected(
        *m, [&] { m->build_batch_metadata(std::vector<SeqId>{2, 1, 2}, pagedkv::BatchMetadataBuffers{}); },
        Errc::kInvalidArgument, {"sequence 2 appears twice"});
  }
  SECTION("bad pool configuration") {
    pagedkv::CacheConfig c;
    c.num_blocks = 1;
    CHECK_THAT(expect_error([&] { Mgr bad(c); }, Errc::kInvalidArgument), Catch::Contains("num_blocks = 1"));
    c.num_blocks = 8;
    c.block_size = 0;
    CHECK_THAT(expect_error([&] { Mgr bad(c); }, Errc::kInvalidArgument), Catch::Contains("block_size = 0"));
    // A block size the kernels' int32 pool view cannot hold (2^31 used to be accepted and wrapped negative there).
    c.block_size = std::uint32_t{1} << 31;
    CHECK_THAT(expect_error([&] { Mgr bad(c); }, Errc::kInvalidArgument),
               Catch::Contains("block_size = 2147483648") && Catch::Contains("kMaxBlockSize = 65536"));
    c.block_size = pagedkv::kMaxBlockSize + 1;
    CHECK_THAT(expect_error([&] { Mgr bad(c); }, Errc::kInvalidArgument), Catch::Contains("65537"));
    c.block_size = pagedkv::kMaxBlockSize;  // the largest accepted
    Mgr ok(c);
    CHECK(ok.block_size() == pagedkv::kMaxBlockSize);
  }
  SECTION("acquire of a free block, set_hashed of a block not held (allocator)") {
    pagedkv::BlockAllocator<> a(6);
    std::vector<std::uint32_t> out(2);
    REQUIRE(a.try_allocate(std::span<std::uint32_t>(out)));
    a.release(2);
    const auto rc = [&] {
      std::vector<std::uint32_t> v;
      for (std::uint32_t b = 1; b < 6; ++b) v.push_back(a.refcount(b));
      return std::make_tuple(v, a.num_free_blocks(), a.num_block_ops());
    };
    const auto before = rc();
    CHECK_THAT(expect_error([&] { a.acquire(2); }, Errc::kInvalidArgument), Catch::Contains("block 2"));
    CHECK_THAT(expect_error([&] { a.acquire(4); }, Errc::kInvalidArgument), Catch::Contains("block 4"));
    CHECK_THAT(expect_error([&] { a.set_hashed(3, true); }, Errc::kInvalidArgument), Catch::Contains("block 3"));
    CHECK(rc() == before);
    CHECK_FALSE(a.is_hashed(3));
  }
  SECTION("block table misuse") {
    CHECK_THAT(expect_error([] { pagedkv::BlockTable<> t(0); }, Errc::kInvalidArgument),
               Catch::Contains("block_size = 0"));
    pagedkv::BlockAllocator<> a(6);
    pagedkv::BlockTable<> t(4);
    Slots s;
    std::optional<pagedkv::BlockCopy<>> c;
    REQUIRE(t.try_append(3, a, [](std::uint32_t) {}, &s, c));
    CHECK_THAT(expect_error([&] { t.append_full_block(2); }, Errc::kInvalidArgument), Catch::Contains("3 tokens"));
    CHECK_THAT(expect_error([&] { t.replace_block(1, 2); }, Errc::kInvalidArgument),
               Catch::Contains("logical block 1"));
    CHECK(t.num_tokens() == 3);
    CHECK(Ids(t.blocks().begin(), t.blocks().end()) == Ids{1});
  }
}

TEST_CASE("Errc::kUnknownSequence", "[errors][unknown_sequence]") {
  auto m = busy_manager();
  const std::vector<std::string> id{"sequence 12345", "not live"};
  check_rejected(*m, [&] { m->try_append(12345, Toks{1}); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { m->try_append(12345, Toks{}); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { m->fork(12345, 777); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { m->free(12345); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { m->preempt(12345); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { m->rewind(12345, 0); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { (void)m->num_tokens(12345); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { (void)m->block_ids(12345); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { (void)m->token_ids(12345); }, Errc::kUnknownSequence, id);
  check_rejected(*m, [&] { (void)m->pending_slots(12345); }, Errc::kUnknownSequence, id);
  check_rejected(
      *m, [&] { m->build_batch_metadata(std::vector<SeqId>{1, 12345}, pagedkv::BatchMetadataBuffers{}); },
      Errc::kUnknownSequence, id);
  CHECK_FALSE(m->contains(12345));

  SECTION("freeing a sequence twice") {
    m->free(2);
    check_rejected(*m, [&] { m->free(2); }, Errc::kUnknownSequence, {"sequence 2 "});
    check_rejected(*m, [&] { m->preempt(2); }, Errc::kUnknownSequence, {"sequence 2 "});
  }
  SECTION("the largest id") {
    const SeqId big = ~SeqId{0};
    check_rejected(*m, [&] { m->free(big); }, Errc::kUnknownSequence, {"18446744073709551615"});
  }
}

TEST_CASE("Errc::kDuplicateSequence", "[errors][duplicate_sequence]") {
  auto m = busy_manager();
  check_rejected(*m, [&] { m->try_admit(2, toks(300, 5)); }, Errc::kDuplicateSequence, {"sequence 2", "already live"});
  check_rejected(*m, [&] { m->fork(1, 4); }, Errc::kDuplicateSequence, {"child sequence 4", "already live"});
  check_rejected(*m, [&] { m->fork(2, 2); }, Errc::kDuplicateSequence, {"child sequence 2"});
  // A duplicate admission is misuse even when the pool has no room (checked before capacity).
  check_rejected(*m, [&] { m->try_admit(1, toks(0, 40)); }, Errc::kDuplicateSequence, {"sequence 1"});
}

TEST_CASE("Errc::kDoubleFree", "[errors][double_free]") {
  // Only the allocator can see a double free: the manager turns a repeated free into kUnknownSequence.
  pagedkv::BlockAllocator<> a(6);
  std::vector<std::uint32_t> out(3);
  REQUIRE(a.try_allocate(std::span<std::uint32_t>(out)));
  a.set_hashed(3, true);
  a.release(3);  // cached
  a.release(2);  // free
  const auto state = [&] {
    std::vector<std::tuple<std::uint32_t, bool, bool>> v;
    for (std::uint32_t b = 1; b < 6; ++b) v.emplace_back(a.refcount(b), a.is_hashed(b), a.is_cached(b));
    return std::make_tuple(v, a.eviction_policy().order(), a.num_free_blocks(), a.num_block_ops());
  };
  const auto before = state();
  CHECK_THAT(expect_error([&] { a.release(2); }, Errc::kDoubleFree), Catch::Contains("block 2"));
  CHECK_THAT(expect_error([&] { a.release(3); }, Errc::kDoubleFree), Catch::Contains("block 3"));
  CHECK_THAT(expect_error([&] { a.release(5); }, Errc::kDoubleFree), Catch::Contains("block 5"));
  CHECK(state() == before);

  SECTION("through a block table released against the wrong allocator state") {
    pagedkv::BlockAllocator<> b(4);
    pagedkv::BlockTable<> t(2);
    Slots s;
    std::optional<pagedkv::BlockCopy<>> c;
    REQUIRE(t.try_append(2, b, [](std::uint32_t) {}, &s, c));  // block 1
    b.release(1);                                              // someone else dropped the table's reference
    CHECK_THAT(expect_error([&] { t.rewind(2, b); }, Errc::kDoubleFree), Catch::Contains("block 1"));
  }
}

TEST_CASE("Errc::kLimitExceeded", "[errors][limit_exceeded]") {
  auto m = busy_manager();  // max_tokens_per_seq = 40; sequence 1 has 10 tokens
  check_rejected(*m, [&] { m->try_append(1, toks(0, 31)); }, Errc::kLimitExceeded,
                 {"sequence 1 ", "41 tokens", "max_tokens_per_seq = 40"});
  check_rejected(*m, [&] { m->try_admit(9, toks(0, 41)); }, Errc::kLimitExceeded,
                 {"41 tokens", "max_tokens_per_seq = 40"});
  check_rejected(*m, [&] { m->rewind(1, 11); }, Errc::kLimitExceeded, {"n = 11", "sequence 1's 10 tokens"});
  check_rejected(*m, [&] { m->rewind(4, 12); }, Errc::kLimitExceeded, {"n = 12", "sequence 4's 11 tokens"});
  // The limits themselves are fine (but the pool decides whether 30 more tokens fit).
  CHECK_NOTHROW(m->rewind(1, 10));
  CHECK(m->num_tokens(1) == 0);
  CHECK_NOTHROW(m->try_admit(9, toks(0, 40)));
}

TEST_CASE("Errc::kBlockOutOfRange", "[errors][block_out_of_range]") {
  auto m = busy_manager();  // 12 blocks
  for (std::uint32_t bad : {0u, 12u, 4000000000u}) {
    const std::string needle = "block id " + std::to_string(bad);
    check_rejected(*m, [&] { (void)m->allocator().refcount(bad); }, Errc::kBlockOutOfRange, {needle, "[1, 12)"});
    check_rejected(*m, [&] { (void)m->allocator().is_cached(bad); }, Errc::kBlockOutOfRange, {needle});
    check_rejected(*m, [&] { (void)m->allocator().is_hashed(bad); }, Errc::kBlockOutOfRange, {needle});
  }
  SECTION("allocator and index mutators") {
    pagedkv::BlockAllocator<> a(4);
    CHECK_THAT(expect_error([&] { a.acquire(0); }, Errc::kBlockOutOfRange), Catch::Contains("block id 0"));
    CHECK_THAT(expect_error([&] { a.release(4); }, Errc::kBlockOutOfRange), Catch::Contains("block id 4"));
    CHECK(a.num_free_blocks() == 3);
    pagedkv::PrefixHashIndex<> idx(4, 0);
    CHECK_THAT(expect_error([&] { idx.insert(BlockHash{}, 0); }, Errc::kBlockOutOfRange), Catch::Contains("block id 0"));
    CHECK_THAT(expect_error([&] { idx.insert(BlockHash{}, 9); }, Errc::kBlockOutOfRange), Catch::Contains("block id 9"));
    CHECK(idx.size() == 0);
  }
}

TEST_CASE("Errc::kBadShape", "[errors][bad_shape]") {
  auto m = busy_manager();
  // Batch {2, 4}: sequence 2 has 1 pending slot, 4 has 1 (and a pending copy); 3 blocks each.
  std::vector<std::int64_t> slots(1);
  pagedkv::BatchMetadataBuffers b;
  b.slot_mapping = slots;
  check_rejected(*m, [&] { m->build_batch_metadata(std::vector<SeqId>{2, 4}, b); }, Errc::kBadShape,
                 {"slot_mapping holds 1 entries, needs 2"});
  CHECK(slots[0] == 0);
  std::vector<std::int32_t> table(2 * 2, 5);
  pagedkv::BatchMetadataBuffers t;
  t.block_tables = table;
  t.max_blocks_per_seq = 2;
  check_rejected(*m, [&] { m->build_batch_metadata(std::vector<SeqId>{2, 4}, t); }, Errc::kBadShape,
                 {"sequence 2 has 3 blocks > max_blocks_per_seq = 2"});
  CHECK(table == std::vector<std::int32_t>(4, 5));
  std::vector<std::int32_t> copies(1);
  std::vector<std::int64_t> one_slot(1);
  pagedkv::BatchMetadataBuffers c;
  c.copies = copies;
  c.slot_mapping = one_slot;
  check_rejected(*m, [&] { m->build_batch_metadata(std::vector<SeqId>{4}, c); }, Errc::kBadShape,
                 {"copies holds 1 entries, needs 2"});
}
