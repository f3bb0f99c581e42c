// Tests of pagedkv/batch_metadata.hpp through KVCacheManager::build_batch_metadata: the CSR page table, the padded
// block table, seq_lens, qo_indptr, slot mapping and copy list with their padding; copies releasing their source
// references; empty spans; validation failures that write nothing and change nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

namespace {

using pagedkv::BatchMetadataBuffers;
using pagedkv::CacheStats;
using pagedkv::Errc;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Mgr = pagedkv::KVCacheManager<>;
using Toks = std::vector<TokenId>;
using Ids = std::vector<std::uint32_t>;
using I32 = std::vector<std::int32_t>;
using I64 = std::vector<std::int64_t>;

using pagedkv_test::expect_error;

using pagedkv_test::toks;

constexpr std::int32_t kS = 777;  // sentinel: "not written"

// Caller-owned buffers with given capacities, pre-filled with the sentinel.
struct Buffers {
  I32 indptr, indices, last_page_len, block_tables, seq_lens, qo_indptr, copies;
  I64 slot_mapping;
  std::int32_t max_blocks_per_seq = 0;
  Buffers(std::size_t max_batch, std::size_t max_blocks, std::int32_t row, std::size_t max_tokens,
          std::size_t max_copies)
      : indptr(max_batch + 1, kS),
        indices(max_blocks, kS),
        last_page_len(max_batch, kS),
        block_tables(max_batch * static_cast<std::size_t>(row), kS),
        seq_lens(max_batch, kS),
        qo_indptr(max_batch + 1, kS),
        copies(2 * max_copies, kS),
        slot_mapping(max_tokens, kS),
        max_blocks_per_seq(row) {}
  BatchMetadataBuffers view() {
    BatchMetadataBuffers b;
    b.indptr = indptr;
    b.indices = indices;
    b.last_page_len = last_page_len;
    b.block_tables = block_tables;
    b.max_blocks_per_seq = max_blocks_per_seq;
    b.seq_lens = seq_lens;
    b.qo_indptr = qo_indptr;
    b.slot_mapping = slot_mapping;
    b.copies = copies;
    return b;
  }
  auto tie() const {
    return std::tie(indptr, indices, last_page_len, block_tables, seq_lens, qo_indptr, copies, slot_mapping);
  }
  friend bool operator==(const Buffers& a, const Buffers& b) { return a.tie() == b.tie(); }
};

auto stats_tuple(const CacheStats& s) {
  return std::make_tuple(s.num_usable_blocks, s.blocks_used, s.blocks_cached, s.blocks_free, s.usage,
                         s.prefix_query_requests, s.prefix_hit_requests, s.prefix_query_tokens, s.prefix_hit_tokens,
                         s.evictions, s.cow_copies, s.dedup_blocks, s.preemptions, s.block_ops);
}

struct Snapshot {
  decltype(stats_tuple(CacheStats{})) stats;
  std::map<SeqId, std::tuple<Ids, std::size_t, Toks, I64>> seqs;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> copies;
  std::vector<std::tuple<std::uint32_t, bool, bool>> blocks;
  Ids lru;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

Snapshot snapshot(const Mgr& m) {
  Snapshot s;
  s.stats = stats_tuple(m.stats());
  m.for_each_sequence([&](SeqId id, std::span<const std::uint32_t> blocks, std::size_t n) {
    const auto t = m.token_ids(id);
    const auto p = m.pending_slots(id);
    s.seqs[id] = {Ids(blocks.begin(), blocks.end()), n, Toks(t.begin(), t.end()), I64(p.begin(), p.end())};
  });
  for (const auto& c : m.pending_copies()) s.copies.emplace_back(c.src, c.dst);
  for (std::uint32_t b = 1; b < m.allocator().num_blocks(); ++b) {
    s.blocks.emplace_back(m.allocator().refcount(b), m.allocator().is_hashed(b), m.allocator().is_cached(b));
  }
  s.lru = m.allocator().eviction_policy().order();
  return s;
}

pagedkv::CacheConfig cfg(std::size_t num_blocks, std::uint32_t bs) {
  pagedkv::CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = bs;
  return c;
}

I64 range64(std::int64_t first, std::int64_t n) {
  I64 v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(first + i);
  return v;
}
I64 cat(I64 a, const I64& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("build_batch_metadata: every output with its padding", "[batch_metadata]") {
  Mgr m(cfg(32, 4));
  REQUIRE(m.try_admit(10, toks(0, 10)).admitted());   // 1, 2, 3: slots 4..13
  REQUIRE(m.try_admit(20, toks(100, 4)).admitted());  // 4: slots 16..19
  REQUIRE(m.try_admit(30, toks(200, 1)).admitted());  // 5: slot 20
  Buffers b(5, 16, 4, 20, 3);
  const std::vector<SeqId> batch{20, 10, 30};
  const auto sz = m.build_batch_metadata(batch, b.view());
  CHECK(sz.batch_size == 3);
  CHECK(sz.num_indices == 5);
  CHECK(sz.num_new_tokens == 15);
  CHECK(sz.num_copies == 0);

  CHECK(b.indptr == I32{0, 1, 4, 5, 5, 5});  // CSR; padding repeats the last value
  CHECK(I32(b.indices.begin(), b.indices.begin() + 5) == I32{4, 1, 2, 3, 5});
  CHECK(b.last_page_len == I32{4, 2, 1, 0, 0});  // in [1, block_size]; 0 beyond the batch
  CHECK(b.block_tables == I32{4, 0, 0, 0,        // padded with the null block
                              1, 2, 3, 0,
                              5, 0, 0, 0,
                              kS, kS, kS, kS,     // rows beyond the batch are not written
                              kS, kS, kS, kS});
  CHECK(b.seq_lens == I32{4, 10, 1, 0, 0});
  CHECK(b.qo_indptr == I32{0, 4, 14, 15, 15, 15});
  I64 want_slots = cat(cat(range64(16, 4), range64(4, 10)), I64{20});
  want_slots.resize(20, -1);  // -1 padding to capacity
  CHECK(b.slot_mapping == want_slots);
  CHECK(b.copies == I32(6, -1));

  // The pending slots were handed out: a sequence with nothing to compute is refused by the next build (a decode
  // step whose token was never appended would otherwise run attention with a query whose K/V is never written),
  // writing nothing and changing nothing.
  for (SeqId s : batch) CHECK(m.pending_slots(s).empty());
  Buffers again(5, 16, 4, 20, 3);
  const Buffers untouched = again;
  const Snapshot before = snapshot(m);
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(batch, again.view()); }, Errc::kInvalidArgument),
             Catch::Contains("sequence 20 has no tokens to compute in this build (no pending slots"));
  const std::vector<std::uint32_t> zero{0, 0, 0};
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(batch, again.view(), zero); }, Errc::kInvalidArgument),
             Catch::Contains("sequence 20 has no tokens to compute"));
  CHECK(again == untouched);
  CHECK(snapshot(m) == before);

  SECTION("decode step: one slot per sequence at its new position") {
    REQUIRE(m.try_append(10, Toks{1}).ok());   // position 10: block 3 offset 2 -> 14
    REQUIRE(m.try_append(30, Toks{1}).ok());   // position 1: block 5 offset 1 -> 21
    REQUIRE(m.try_append(20, Toks{1}).ok());   // position 4: new block 6 offset 0 -> 24
    Buffers d(4, 8, 3, 4, 1);
    const auto s3 = m.build_batch_metadata(batch, d.view());
    CHECK(s3.num_new_tokens == 3);
    CHECK(d.slot_mapping == I64{24, 14, 21, -1});
    CHECK(d.qo_indptr == I32{0, 1, 2, 3, 3});
    CHECK(d.indptr == I32{0, 2, 5, 6, 6});
    CHECK(I32(d.indices.begin(), d.indices.begin() + 6) == I32{4, 6, 1, 2, 3, 5});
    CHECK(d.last_page_len == I32{1, 3, 2, 0});
    CHECK(d.seq_lens == I32{5, 11, 2, 0});
    CHECK(d.block_tables == I32{4, 6, 0, 1, 2, 3, 5, 0, 0, kS, kS, kS});
    CHECK(d.copies == I32{-1, -1});
  }
}

TEST_CASE("build_batch_metadata: copies, then -1 - building releases the copies' source references",
          "[batch_metadata][cow]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(10, toks(0, 10)).admitted());  // 1, 2, 3 (2 tokens)
  Buffers warm(2, 8, 4, 16, 2);
  m.build_batch_metadata(std::vector<SeqId>{10}, warm.view());
  m.fork(10, 40);
  m.fork(10, 50);
  REQUIRE(m.allocator().refcount(3) == 3);
  const auto a = m.try_append(10, Toks{1});  // copy 3 -> 4
  const auto d = m.try_append(40, Toks{2});  // 3 still has two table holders (40, 50): copy 3 -> 5
  const auto e = m.try_append(50, Toks{3});  // 50 is the only table holder left: written in place
  REQUIRE(a.copy.has_value());
  REQUIRE(d.copy.has_value());
  CHECK_FALSE(e.copy.has_value());
  CHECK(m.allocator().refcount(3) == 3);  // sequence 50 + the two pending copies
  const auto used_before = m.stats().blocks_used;

  Buffers b(3, 12, 4, 4, 3);
  const auto sz = m.build_batch_metadata(std::vector<SeqId>{10, 40, 50}, b.view());
  CHECK(sz.num_copies == 2);
  CHECK(b.copies == I32{3, 4, 3, 5, -1, -1});
  CHECK(b.slot_mapping == I64{4 * 4 + 2, 5 * 4 + 2, 3 * 4 + 2, -1});
  CHECK(b.block_tables == I32{1, 2, 4, 0, 1, 2, 5, 0, 1, 2, 3, 0});
  CHECK(m.pending_copies().empty());
  CHECK(m.allocator().refcount(3) == 1);  // both copy references released
  CHECK(m.stats().blocks_used == used_before);

  SECTION("the next build has no copies") {
    for (SeqId s : {10, 40, 50}) REQUIRE(m.try_append(s, Toks{6}).ok());  // in their own blocks: no copy
    Buffers c(3, 12, 4, 4, 3);
    CHECK(m.build_batch_metadata(std::vector<SeqId>{10, 40, 50}, c.view()).num_copies == 0);
    CHECK(c.copies == I32(6, -1));
  }
  SECTION("a copy's source whose last holder is gone is released by the build") {
    m.fork(50, 60);
    REQUIRE(m.try_append(60, Toks{5}).copy.has_value());  // copy 3 -> 6
    m.free(50);
    CHECK(m.allocator().refcount(3) == 1);  // only the pending copy
    Buffers c(2, 8, 4, 4, 1);
    m.build_batch_metadata(std::vector<SeqId>{60}, c.view());
    CHECK(c.copies == I32{3, 6});
    CHECK(m.allocator().refcount(3) == 0);
    CHECK_FALSE(m.allocator().is_cached(3));  // never full, so free
  }
}

TEST_CASE("build_batch_metadata: a partial batch", "[batch_metadata]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());
  REQUIRE(m.try_admit(2, toks(50, 3)).admitted());
  Buffers first(1, 4, 2, 8, 1);
  m.build_batch_metadata(std::vector<SeqId>{1}, first.view());
  CHECK(m.pending_slots(1).empty());
  CHECK(m.pending_slots(2).size() == 3);  // not in the batch: kept for a later build
  m.fork(1, 3);
  REQUIRE(m.try_append(3, Toks{9}).copy.has_value());
  // A copy belongs to the build of its own sequence's batch: an engine that builds prefill and decode batches
  // apart (vLLM, SGLang) runs each build's copies with that build, and none is lost.
  Buffers second(1, 4, 2, 8, 1);
  const auto sz = m.build_batch_metadata(std::vector<SeqId>{2}, second.view());
  CHECK(sz.num_copies == 0);
  CHECK(second.copies == I32{-1, -1});
  CHECK(second.slot_mapping == I64{12, 13, 14, -1, -1, -1, -1, -1});
  CHECK(m.pending_slots(3).size() == 1);
  REQUIRE(m.pending_copies().size() == 1);
  CHECK(m.allocator().refcount(2) == 2);  // sequence 1 + the copy's reference, still held
  Buffers third(1, 4, 2, 8, 1);
  const auto sz3 = m.build_batch_metadata(std::vector<SeqId>{3}, third.view());
  CHECK(sz3.num_copies == 1);
  CHECK(third.copies == I32{2, 4});
  CHECK(third.slot_mapping == I64{4 * 4 + 2, -1, -1, -1, -1, -1, -1, -1});
  CHECK(m.pending_copies().empty());
  CHECK(m.allocator().refcount(2) == 1);
}

TEST_CASE("build_batch_metadata: a build that writes a pending copy's source hands that copy out first",
          "[batch_metadata][cow]") {
  // Sequence 1 and its fork 3 share the partial block 2 (tokens 4, 5). 3 appends: copy 2 -> 3 (3's). 1 rewinds a
  // shared token and appends another: block 2 now has one table holder (the pending copy is no holder), so the
  // write lands in place, at a position the copy must still read. A build of {1} alone must hand out 3's copy:
  // copy_blocks runs before write_kv in that step.
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());
  pagedkv_test::build_step(m, {1});
  m.fork(1, 3);
  REQUIRE(m.try_append(3, Toks{9}).copy.has_value());
  m.rewind(1, 1);
  const auto a = m.try_append(1, Toks{42});
  REQUIRE(a.ok());
  CHECK_FALSE(a.copy.has_value());  // in place
  REQUIRE(a.slots.size() == 1);
  CHECK(a.slots[0] == 2 * 4 + 1);
  Buffers b(1, 4, 2, 4, 2);
  const auto sz = m.build_batch_metadata(std::vector<SeqId>{1}, b.view());
  CHECK(sz.num_copies == 1);
  CHECK(b.copies == I32{2, 3, -1, -1});
  CHECK(b.slot_mapping == I64{9, -1, -1, -1});
  CHECK(m.pending_copies().empty());
  // 3's own build later has no copy left, and its slot is in its copy.
  Buffers c(1, 4, 2, 4, 1);
  const auto sz3 = m.build_batch_metadata(std::vector<SeqId>{3}, c.view());
  CHECK(sz3.num_copies == 0);
  CHECK(c.slot_mapping == I64{3 * 4 + 2, -1, -1, -1});
}

TEST_CASE("build_batch_metadata: empty spans skip their output", "[batch_metadata]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());

  SECTION("slot mapping only") {
    I64 slots(8, kS);
    BatchMetadataBuffers b;
    b.slot_mapping = slots;
    const auto sz = m.build_batch_metadata(std::vector<SeqId>{1}, b);
    CHECK(sz.num_indices == 2);
    CHECK(sz.num_new_tokens == 6);
    CHECK(slots == I64{4, 5, 6, 7, 8, 9, -1, -1});
    CHECK(m.pending_slots(1).empty());
  }
  SECTION("padded block table (and the slot mapping a build cannot skip)") {
    I32 table(2 * 3, kS), lens(2, kS);
    I64 slots(6, kS);
    BatchMetadataBuffers b;
    b.slot_mapping = slots;
    b.block_tables = table;
    b.max_blocks_per_seq = 3;
    b.seq_lens = lens;
    m.build_batch_metadata(std::vector<SeqId>{1}, b);
    CHECK(table == I32{1, 2, 0, kS, kS, kS});
    CHECK(lens == I32{6, 0});
  }
  SECTION("nothing at all: refused while slots are pending (their writes would never be issued)") {
    const std::string msg = expect_error([&] { m.build_batch_metadata(std::vector<SeqId>{1}, BatchMetadataBuffers{}); },
                                         pagedkv::Errc::kBadShape);
    CHECK_THAT(msg, Catch::Contains("slot_mapping is empty") && Catch::Contains("6 new tokens"));
    CHECK(m.pending_slots(1).size() == 6);
    CHECK(m.prefix_index().size() == 0);
    // With nothing pending, an all-empty build of an empty batch is fine (it would issue queued swaps).
    pagedkv_test::build_step(m, {1});
    const auto sz = m.build_batch_metadata(std::vector<SeqId>{}, BatchMetadataBuffers{});
    CHECK(sz.batch_size == 0);
    CHECK(sz.num_new_tokens == 0);
    CHECK(sz.num_indices == 0);
  }
  SECTION("an empty batch pads everything") {
    Buffers b(2, 4, 2, 3, 1);
    const auto sz = m.build_batch_metadata(std::vector<SeqId>{}, b.view());
    CHECK(sz.batch_size == 0);
    CHECK(sz.num_indices == 0);
    CHECK(b.indptr == I32{0, 0, 0});
    CHECK(b.qo_indptr == I32{0, 0, 0});
    CHECK(b.last_page_len == I32{0, 0});
    CHECK(b.seq_lens == I32{0, 0});
    CHECK(b.slot_mapping == I64{-1, -1, -1});
    CHECK(b.copies == I32{-1, -1});
    CHECK(b.block_tables == I32(4, kS));
    CHECK(m.pending_slots(1).size() == 6);
  }
  SECTION("exact capacities (no padding)") {
    Buffers b(1, 2, 2, 6, 0);
    const auto sz = m.build_batch_metadata(std::vector<SeqId>{1}, b.view());
    CHECK(sz.num_new_tokens == 6);
    CHECK(b.indptr == I32{0, 2});
    CHECK(b.indices == I32{1, 2});
    CHECK(b.block_tables == I32{1, 2});
    CHECK(b.slot_mapping == I64{4, 5, 6, 7, 8, 9});
  }
}

TEST_CASE("build_batch_metadata: invalid input throws, writes nothing and changes nothing",
          "[batch_metadata][errors]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(10, toks(0, 10)).admitted());  // 3 blocks, 10 slots
  REQUIRE(m.try_admit(20, toks(100, 5)).admitted());  // 2 blocks, 5 slots
  Buffers warm(2, 8, 4, 16, 2);
  m.build_batch_metadata(std::vector<SeqId>{10}, warm.view());
  m.fork(10, 30);
  REQUIRE(m.try_append(30, Toks{7}).copy.has_value());  // one pending copy; 30 has 1 slot
  REQUIRE_FALSE(m.try_append(10, Toks{8}).copy.has_value());  // 10 has 1 slot, in place (30 left block 3)
  // Needs for batch {10, 20, 30}: indptr 4, indices 8, per-seq arrays 3, slots 7, copies 2, rows of 3 blocks.
  const std::vector<SeqId> batch{10, 20, 30};
  const Snapshot before = snapshot(m);

  struct Case {
    const char* what;
    Buffers buf;
    Errc code;
    const char* needle;
  };
  std::vector<Case> cases{
      {"indptr", Buffers(2, 8, 3, 7, 1), Errc::kBadShape, "indptr holds 3 entries, needs 4"},
      {"indices", Buffers(3, 7, 3, 7, 1), Errc::kBadShape, "indices holds 7 entries, needs 8"},
      {"slots", Buffers(3, 8, 3, 6, 1), Errc::kBadShape, "slot_mapping holds 6 entries, needs 7"},
      {"row", Buffers(3, 8, 2, 7, 1), Errc::kBadShape, "sequence 10 has 3 blocks > max_blocks_per_seq = 2"},
  };
  {
    Buffers c(3, 8, 3, 7, 1);
    c.copies.resize(1);  // one entry of a [1, 2] list
    cases.push_back({"copies (odd)", c, Errc::kBadShape, "copies holds 1 entries, needs 2"});
    Buffers l(3, 8, 3, 7, 1);
    l.last_page_len.resize(2);
    cases.push_back({"last_page_len", l, Errc::kBadShape, "last_page_len holds 2 entries, needs 3"});
    Buffers s(3, 8, 3, 7, 1);
    s.seq_lens.resize(2);
    cases.push_back({"seq_lens", s, Errc::kBadShape, "seq_lens holds 2 entries, needs 3"});
    Buffers q(3, 8, 3, 7, 1);
    q.qo_indptr.resize(3);
    cases.push_back({"qo_indptr", q, Errc::kBadShape, "qo_indptr holds 3 entries, needs 4"});
    Buffers t(3, 8, 3, 7, 1);
    t.block_tables.resize(8);
    cases.push_back({"block_tables", t, Errc::kBadShape, "block_tables holds 8 entries, needs 9"});
    Buffers z(3, 8, 3, 7, 1);
    z.max_blocks_per_seq = 0;
    cases.push_back({"max_blocks_per_seq 0", z, Errc::kBadShape, "max_blocks_per_seq"});
    Buffers n(3, 8, 3, 7, 1);
    n.indices.clear();
    cases.push_back({"indptr without indices", n, Errc::kBadShape, "indices is empty"});
  }
  for (auto& c : cases) {
    INFO(c.what);
    const Buffers untouched = c.buf;
    const std::string msg = expect_error([&] { m.build_batch_metadata(batch, c.buf.view()); }, c.code);
    CHECK_THAT(msg, Catch::Contains(c.needle));
    CHECK(c.buf == untouched);
    CHECK(snapshot(m) == before);
  }

  SECTION("a sequence twice") {
    Buffers b(4, 12, 3, 8, 1);
    const Buffers untouched = b;
    CHECK_THAT(expect_error([&] { m.build_batch_metadata(std::vector<SeqId>{10, 20, 10}, b.view()); },
                            Errc::kInvalidArgument),
               Catch::Contains("sequence 10 appears twice"));
    CHECK(b == untouched);
    CHECK(snapshot(m) == before);
  }
  SECTION("an unknown sequence") {
    Buffers b(4, 12, 3, 8, 1);
    const Buffers untouched = b;
    CHECK_THAT(expect_error([&] { m.build_batch_metadata(std::vector<SeqId>{10, 20, 99}, b.view()); },
                            Errc::kUnknownSequence),
               Catch::Contains("sequence 99 is not live"));
    CHECK(b == untouched);
    CHECK(snapshot(m) == before);
  }
  // After every failure, the same batch still builds (no sequence is left marked as "in the batch").
  Buffers ok(3, 8, 3, 7, 1);
  const auto sz = m.build_batch_metadata(batch, ok.view());
  CHECK(sz.num_new_tokens == 7);
  CHECK(ok.copies == I32{3, 6});
  CHECK(ok.indptr == I32{0, 3, 5, 8});
}

TEST_CASE("BatchMetadataStorage sized from the engine's limits holds every build within them",
          "[batch_metadata][capacity]") {
  // An engine of at most 8 sequences of at most 100 tokens (block size 4: 25 blocks each) and 64 new tokens per
  // step: prompts of up to 8 tokens, decode, forks (copy-on-write), frees, on random input. Every build into the
  // storage sized once from these limits succeeds (a guess that fails only when the first long sequence arrives
  // is what this replaces).
  const pagedkv::BatchMetadataLimits limits{8, 64, 25, 0, 0};
  const pagedkv::BatchMetadataCapacity cap = pagedkv::batch_metadata_capacity(limits);
  CHECK(cap.indptr == 9);
  CHECK(cap.indices == 200);
  CHECK(cap.block_tables == 200);
  CHECK(cap.max_blocks_per_seq == 25);
  CHECK(cap.slot_mapping == 64);
  CHECK(cap.copies == 16);
  CHECK(cap.swap_out == 0);
  pagedkv::BatchMetadataStorage storage(limits);
  pagedkv::CacheConfig c = cfg(8 * 25 + 9, 4);
  c.max_tokens_per_seq = 100;
  Mgr m(c);
  std::mt19937_64 rng(0x5eed);
  std::vector<SeqId> live;
  SeqId next = 1;
  std::size_t builds = 0, copies = 0, longest = 0;
  for (int step = 0; step < 2000; ++step) {
    if (live.size() < 8 && rng() % 3 == 0) {
      const SeqId parent = live.empty() ? 0 : live[rng() % live.size()];
      if (parent != 0 && rng() % 2 == 0 && m.sequence(parent).settled()) {
        m.fork(parent, next);
      } else {
        REQUIRE(m.try_admit(next, toks(static_cast<TokenId>(rng() % 5), 1 + rng() % 8)).admitted());
      }
      live.push_back(next++);
    }
    std::vector<SeqId> batch;
    for (SeqId id : live) {
      if (m.sequence(id).num_pending() == 0) {
        if (m.num_tokens(id) >= 100) continue;
        REQUIRE(m.try_append(id, toks(static_cast<TokenId>(rng() % 3), 1)).ok());
      }
      batch.push_back(id);
    }
    if (batch.empty()) continue;
    const auto sz = m.build_batch_metadata(batch, storage.buffers());
    ++builds;
    copies += sz.num_copies;
    for (SeqId id : live) longest = std::max(longest, m.num_tokens(id));
    for (std::size_t i = 0; i < live.size();) {
      if (m.num_tokens(live[i]) >= 100 && rng() % 4 == 0) {
        m.free(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }
  CHECK(builds > 1000);
  CHECK(copies > 20);
  CHECK(longest == 100);

  CHECK_THAT(expect_error([] { (void)pagedkv::batch_metadata_capacity({0, 64, 25, 0, 0}); }, Errc::kInvalidArgument),
             Catch::Contains("max_batch = 0"));
  CHECK_THAT(expect_error([] { (void)pagedkv::batch_metadata_capacity({std::size_t{1} << 20, 64, std::size_t{1} << 12, 0, 0}); },
                          Errc::kLimitExceeded),
             Catch::Contains("max_batch * max_blocks_per_seq"));
}
