// Scheduler-grade manager (issue 9): chunked prefill (chunked admission, try_reserve, partial scheduling in the
// build), speculative lookahead (try_reserve_lookahead / commit_lookahead), capacity queries, interval prefix-cache
// statistics; mixed batches executed by the CPU reference kernels against a float64 oracle; and a property test
// that lookahead + commit leaves the same state as appending only the accepted tokens.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)
#include <pagedkv/reference/copy_blocks.hpp>
#include <pagedkv/reference/prefill.hpp>
#include <pagedkv/reference/write_kv.hpp>

namespace {

using pagedkv::AdmitStatus;
using pagedkv::AppendStatus;
using pagedkv::BlockHash;
using pagedkv::CacheConfig;
using pagedkv::CapacityStatus;
using pagedkv::Errc;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::build_step;
using pagedkv_test::expect_error;
using pagedkv_test::toks;
using Mgr = pagedkv::KVCacheManager<>;
using Toks = std::vector<TokenId>;
using Ids = std::vector<std::uint32_t>;
using I32 = std::vector<std::int32_t>;
using I64 = std::vector<std::int64_t>;

CacheConfig cfg(std::size_t num_blocks, std::uint32_t block_size) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.enable_events = true;
  return c;
}

Ids ids(const Mgr& m, SeqId s) { return Ids(m.block_ids(s).begin(), m.block_ids(s).end()); }

// Full metadata of one build, exactly sized.
struct Step {
  pagedkv::BatchMetadataSizes sz;
  I32 indptr, indices, last_page_len, seq_lens, qo_indptr, copies;
  I64 slots;
};

template <class M>
Step build(M& m, const std::vector<SeqId>& batch, const std::vector<std::uint32_t>& sched = {}) {
  Step s;
  std::size_t tokens = 0, blocks = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const auto& q = m.sequence(batch[b]);
    const std::size_t n = sched.empty() ? q.num_pending() : sched[b];
    tokens += n;
    blocks += (q.num_built + n + m.block_size() - 1) / m.block_size();
  }
  s.indptr.assign(batch.size() + 1, -7);
  s.indices.assign(blocks, -7);
  s.last_page_len.assign(batch.size(), -7);
  s.seq_lens.assign(batch.size(), -7);
  s.qo_indptr.assign(batch.size() + 1, -7);
  s.copies.assign(2 * m.pending_copies().size(), -7);
  s.slots.assign(tokens, -7);
  pagedkv::BatchMetadataBuffers buf;
  buf.indptr = s.indptr;
  buf.indices = s.indices;
  buf.last_page_len = s.last_page_len;
  buf.seq_lens = s.seq_lens;
  buf.qo_indptr = s.qo_indptr;
  buf.slot_mapping = s.slots;
  buf.copies = s.copies;
  s.sz = m.build_batch_metadata(batch, buf, sched);
  s.copies.resize(2 * s.sz.num_copies);
  return s;
}

}  // namespace

TEST_CASE("chunked admission reserves the first chunk - try_reserve grows it, all or nothing",
          "[scheduler][chunked]") {
  Mgr m(cfg(9, 4));  // 8 usable blocks
  const Toks p = toks(0, 26);  // 7 blocks
  const auto r = m.try_admit(1, p, nullptr, {.num_reserved_tokens = 10});
  REQUIRE(r.admitted());
  CHECK(r.num_new_blocks == 3);
  CHECK(m.num_tokens(1) == 10);
  CHECK(m.sequence(1).num_known() == 26);
  CHECK(m.sequence(1).num_unslotted() == 16);
  CHECK_FALSE(m.sequence(1).settled());
  // The prompt's tokens are known: append and lookahead must wait until every prompt token has a slot.
  CHECK_THAT(expect_error([&] { m.try_append(1, Toks{1}); }, Errc::kInvalidArgument),
             Catch::Contains("16 prompt tokens without slots"));
  CHECK_THAT(expect_error([&] { m.try_reserve(1, 17); }, Errc::kInvalidArgument),
             Catch::Contains("has 16 prompt tokens without slots, asked for 17"));
  CHECK_THAT(expect_error([&] { m.fork(1, 2); }, Errc::kInvalidArgument),
             Catch::Contains("16 prompt tokens without slots"));

  // Step 1 computes the first chunk: blocks 0 and 1 are full and written, so they are registered.
  auto s1 = build(m, {1}, {10});
  CHECK(s1.seq_lens == I32{10});
  CHECK(s1.qo_indptr == I32{0, 10});
  CHECK(s1.indices == I32{1, 2, 3});
  CHECK(s1.last_page_len == I32{2});
  CHECK(m.lookup(toks(0, 26)) == 8);
  // Another sequence takes 4 blocks; the next chunk of 12 needs 3 more blocks, only 1 is left: no capacity (the
  // preemption signal), nothing changes.
  REQUIRE(m.try_admit(2, toks(100, 16)).admitted());
  CHECK(m.query_append(1, 12).status == CapacityStatus::kNoCapacity);
  CHECK(m.query_append(1, 12).num_missing_blocks == 2);
  auto g = m.try_reserve(1, 12);
  CHECK(g.status == AppendStatus::kNoCapacity);
  CHECK(g.num_missing_blocks == 2);
  CHECK(m.num_tokens(1) == 10);
  m.preempt(2);
  g = m.try_reserve(1, 12);
  REQUIRE(g.ok());
  CHECK(g.slots.size() == 12);
  CHECK(m.sequence(1).num_unslotted() == 4);
  // Partial scheduling: the build emits 6 of the 12 pending positions; the page table covers 16 tokens.
  auto s2 = build(m, {1}, {6});
  CHECK(s2.seq_lens == I32{16});
  CHECK(s2.slots.size() == 6);
  CHECK(m.sequence(1).num_pending() == 6);
  CHECK(m.lookup(toks(0, 26)) == 16);  // blocks 2, 3 registered by the build that issued their last writes
  REQUIRE(m.try_reserve(1, 4).ok());
  auto s3 = build(m, {1});  // everything left: 6 + 4
  CHECK(s3.seq_lens == I32{26});
  CHECK(s3.qo_indptr == I32{0, 10});
  CHECK(m.sequence(1).settled());
  CHECK(m.lookup(toks(0, 27)) == 24);
  m.fork(1, 3);  // settled now
}

TEST_CASE("build_batch_metadata rejects schedules it cannot honour, changing nothing", "[scheduler][build]") {
  Mgr m(cfg(16, 4));
  REQUIRE(m.try_admit(1, toks(0, 10)).admitted());
  REQUIRE(m.try_admit(2, toks(50, 3)).admitted());
  const std::vector<SeqId> batch{1, 2};
  std::vector<std::int64_t> slots(32);
  pagedkv::BatchMetadataBuffers buf;
  buf.slot_mapping = slots;
  const std::vector<std::uint32_t> too_many{10, 4};
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(batch, buf, too_many); }, Errc::kInvalidArgument),
             Catch::Contains("sequence 2 is scheduled 4 tokens but has 3 pending slots"));
  const std::vector<std::uint32_t> wrong_size{1};
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(batch, buf, wrong_size); }, Errc::kBadShape),
             Catch::Contains("num_scheduled_tokens holds 1 entries for a batch of 2"));
  CHECK(m.sequence(1).num_pending() == 10);
  CHECK(m.sequence(2).num_pending() == 3);
  CHECK(m.prefix_index().size() == 0);
  // Zero tokens for a sequence is refused: a row without queries hands an attention kernel nothing to compute
  // (leave the sequence out of the batch instead).
  const std::vector<std::uint32_t> zero{0, 3};
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(batch, buf, zero); }, Errc::kInvalidArgument),
             Catch::Contains("sequence 1 has no tokens to compute in this build (num_scheduled_tokens[0] = 0"));
  CHECK(m.sequence(1).num_pending() == 10);
  CHECK(m.sequence(2).num_pending() == 3);
  const auto s = build(m, {2}, {3});
  CHECK(s.qo_indptr == I32{0, 3});
  CHECK(s.seq_lens == I32{3});
  CHECK(s.indptr == I32{0, 1});
}

TEST_CASE("capacity queries answer what the call would, and change nothing", "[scheduler][capacity]") {
  Mgr m(cfg(6, 4));  // 5 usable
  const Toks p = toks(0, 9);
  auto q = m.query_admit(p);
  CHECK(q.fits());
  CHECK(q.num_blocks == 3);
  CHECK(q.num_cached_tokens == 0);
  REQUIRE(m.try_admit(1, p).admitted());
  build_step(m, {1});
  m.free(1);  // 2 blocks cached, 1 free (partial), 2 never used
  q = m.query_admit(toks(0, 13));
  CHECK(q.fits());
  CHECK(q.num_cached_tokens == 8);
  CHECK(q.num_blocks == 2);  // 8 tokens cached, 5 more tokens: 2 blocks
  CHECK(m.query_admit(toks(0, 30)).status == CapacityStatus::kNeverFits);
  CHECK(m.query_admit(toks(0, 30)).num_missing_blocks == 3);
  REQUIRE(m.try_admit(2, toks(100, 12)).admitted());  // never-used 4, 5, then the free 3; cached 2, 1 remain
  const auto stats = m.stats();
  q = m.query_admit(toks(0, 13));
  // Its 2 hits are the 2 cached blocks: taking them leaves nothing to allocate the other 2 from.
  CHECK(q.status == CapacityStatus::kNoCapacity);
  CHECK(q.num_missing_blocks == 2);
  CHECK(q.num_cached_tokens == 8);
  CHECK(m.query_admit(toks(200, 9)).status == CapacityStatus::kNoCapacity);
  CHECK(m.query_admit(toks(200, 9)).num_missing_blocks == 1);  // 3 blocks, 2 evictable
  CHECK(m.query_append(2, 1).num_blocks == 1);
  CHECK(m.query_append(2, 1).fits());
  CHECK(m.query_append(2, 8).fits());                         // 20 tokens: 5 blocks, the whole pool
  CHECK(m.query_append(2, 9).status == CapacityStatus::kNeverFits);
  CHECK(m.query_append(2, 9).num_missing_blocks == 1);
  CHECK(m.stats().prefix_query_requests == stats.prefix_query_requests);
  CHECK(m.stats().blocks_cached == stats.blocks_cached);
  CHECK(m.allocator().eviction_policy().order() == Ids{2, 1});
  CHECK_THAT(expect_error([&] { (void)m.query_append(99, 1); }, Errc::kUnknownSequence), Catch::Contains("99"));
  CHECK(m.query_admit(Toks{}).fits());  // an empty prompt: a sequence with no token yet, no block
  CHECK(m.query_admit(Toks{}).num_blocks == 0);
}

TEST_CASE("lookahead slots are built like any slot, never registered until their ids are committed",
          "[scheduler][lookahead]") {
  Mgr m(cfg(32, 4));
  REQUIRE(m.try_admit(1, toks(0, 6)).admitted());
  build_step(m, {1});
  REQUIRE(m.try_append(1, Toks{6}).ok());  // the token sampled last step
  auto la = m.try_reserve_lookahead(1, 3);  // drafts for positions 7, 8, 9
  REQUIRE(la.ok());
  CHECK(la.slots.size() == 3);
  CHECK(m.num_tokens(1) == 10);
  CHECK(m.sequence(1).num_known() == 7);
  CHECK(m.sequence(1).num_lookahead == 3);
  CHECK_THAT(expect_error([&] { m.try_append(1, Toks{1}); }, Errc::kInvalidArgument),
             Catch::Contains("3 uncommitted lookahead slots"));
  CHECK_THAT(expect_error([&] { m.try_reserve_lookahead(1, 1); }, Errc::kInvalidArgument),
             Catch::Contains("lookahead"));
  CHECK_THAT(expect_error([&] { m.fork(1, 2); }, Errc::kInvalidArgument), Catch::Contains("3 lookahead slots"));
  // The verification step: 1 + 3 query tokens; block 1 (positions 4..7) is now fully written but position 7 holds
  // a draft whose id the host does not know: not registered.
  const auto s = build(m, {1});
  CHECK(s.qo_indptr == I32{0, 4});
  CHECK(s.seq_lens == I32{10});
  CHECK(m.prefix_index().size() == 1);
  CHECK(m.lookup(toks(0, 9)) == 4);
  // Two drafts accepted (ids 7, 8 as the target model sampled them), the third rejected and rewound.
  CHECK_THAT(expect_error([&] { m.commit_lookahead(1, Toks{7, 8, 9, 10}); }, Errc::kInvalidArgument),
             Catch::Contains("accepts 4 tokens but has 3 lookahead slots"));
  m.commit_lookahead(1, Toks{7, 8});
  CHECK(m.num_tokens(1) == 9);
  CHECK(m.sequence(1).num_lookahead == 0);
  CHECK(m.sequence(1).num_built == 9);
  CHECK(m.sequence(1).settled());
  CHECK(m.prefix_index().size() == 2);  // block 1 registered at the commit: written and now known
  CHECK(m.lookup(toks(0, 10)) == 8);
  std::vector<pagedkv::KVEvent> ev;
  m.drain_events(ev);
  REQUIRE(ev.size() == 2);
  CHECK(ev[1].token_ids == Toks{4, 5, 6, 7});
  // Rewind drops lookahead first.
  REQUIRE(m.try_reserve_lookahead(1, 2).ok());
  m.rewind(1, 3);
  CHECK(m.sequence(1).num_lookahead == 0);
  CHECK(m.num_tokens(1) == 8);
  CHECK(m.sequence(1).num_known() == 8);
}

TEST_CASE("an empty prompt admits a sequence with no token yet: its slots come as lookahead or appends",
          "[scheduler][lookahead][empty]") {
  // vLLM's allocate_slots of a request with no token yet and lookahead slots (its test_allocate_with_lookahead):
  // ceil((3 + 2) / 4) = 2 blocks. pagedkv: the sequence is admitted empty (no hit, no block, no pending slot), and the
  // slots are lookahead slots past its zero known tokens.
  for (const bool window : {false, true}) {
    INFO("window group " << window);
    CacheConfig c = cfg(16, 4);
    if (window) {
      c.groups.resize(2);
      c.groups[1] = {pagedkv::AttentionKind::kSlidingWindow, 6, 1};
    }
    Mgr m(c);
    REQUIRE(m.try_admit(9, toks(100, 8)).admitted());  // another sequence, cached blocks to be found or not
    pagedkv_test::step_groups(m, 9);
    const auto before = m.stats();
    const auto r = m.try_admit(1, Toks{});
    REQUIRE(r.admitted());
    CHECK(r.num_cached_tokens == 0);
    CHECK(r.num_new_blocks == 0);
    CHECK(m.num_tokens(1) == 0);
    CHECK(m.block_ids(1).empty());
    CHECK(m.pending_slots(1).empty());
    CHECK(m.stats().blocks_used == before.blocks_used);
    CHECK(m.lookup(Toks{}) == 0);
    CHECK(m.explain_admit(Toks{}).hit_tokens == 0);
    CHECK(m.explain_admit(Toks{}).cap_tokens == 0);
    // Five lookahead slots: two blocks per group, the first known token will be position 0.
    const auto la = m.try_reserve_lookahead(1, 5);
    REQUIRE(la.ok());
    CHECK(la.slots.size() == 5);
    CHECK(m.block_ids(1).size() == 2);
    CHECK(m.num_tokens(1) == 5);
    CHECK(m.sequence(1).num_known() == 0);
    // The verification step computes the five positions; three drafts are accepted, block 1 is released.
    if (window) {
      for (std::size_t g = 0; g < 2; ++g) CHECK(m.sequence(1).table_of(g).num_blocks() == 2);
      pagedkv_test::step_groups(m, 1);
    } else {
      const auto s = build(m, {1});
      CHECK(s.qo_indptr == I32{0, 5});
      CHECK(s.seq_lens == I32{5});
    }
    CHECK(m.lookup(toks(500, 6)) == 0);
    m.commit_lookahead(1, Toks{500, 501, 502});
    CHECK(m.num_tokens(1) == 3);
    CHECK(m.block_ids(1).size() == 1);
    CHECK(m.token_ids(1).size() == 3);
    // Position 3 fills block 0, registered at its build: a later prompt starting with these tokens hits it.
    REQUIRE(m.try_append(1, Toks{503}).ok());
    pagedkv_test::step_groups(m, 1);
    CHECK(m.lookup(toks(500, 6)) == 4);
    // Freed, every block comes back; an empty sequence forks, preempts and frees like any.
    m.free(1);
    REQUIRE(m.try_admit(2, Toks{}).admitted());
    m.fork(2, 4);  // a child with no token either
    CHECK(m.num_tokens(4) == 0);
    REQUIRE(m.try_append(4, Toks{8, 9}).ok());
    CHECK(m.num_tokens(2) == 0);
    REQUIRE(m.try_append(2, Toks{7}).ok());
    m.preempt(2);  // recomputed from its one token when admitted again
    CHECK_FALSE(m.contains(2));
    REQUIRE(m.try_admit(2, Toks{7}).admitted());
    m.free(2);
    m.free(4);
    REQUIRE(m.try_admit(3, Toks{}).admitted());
    m.preempt(3);
    m.free(9);
    CHECK(m.stats().blocks_used == 0);
  }
}

TEST_CASE("a prepared prompt is hashed once and admits like the prompt itself", "[scheduler][prepared]") {
  Mgr m(cfg(8, 4));  // 7 usable
  const Toks p = toks(0, 14);
  RequestKeys k;
  k.salt = "t";
  const pagedkv::PreparedPrompt pp = m.prepare_prompt(p, &k);
  CHECK(pp.hashes.size() == 3);
  CHECK(pp.tokens == p);
  REQUIRE(m.try_admit(1, toks(0, 14), &k).admitted());  // the same prompt, hashed by try_admit itself
  build_step(m, {1});
  CHECK(m.query_admit(pp).num_cached_tokens == 12);
  REQUIRE(m.try_admit(2, toks(50, 12)).admitted());  // 3 blocks: 0 left
  auto r = m.try_admit(3, pp);                       // retried while full: no hashing, same answer as the plain call
  CHECK(r.status == AdmitStatus::kNoCapacity);
  CHECK(r.num_missing_blocks == 1);
  m.free(2);
  r = m.try_admit(3, pp);
  REQUIRE(r.admitted());
  CHECK(r.num_cached_tokens == 12);
  CHECK(ids(m, 3) == Ids{ids(m, 1)[0], ids(m, 1)[1], ids(m, 1)[2], ids(m, 3)[3]});
  CHECK(m.sequence(3).keys->salt == "t");
  // A prompt prepared under another seed (or hasher, or block size) is refused, state unchanged.
  CacheConfig other = cfg(8, 4);
  other.hash_seed = 1;
  Mgr m2(other);
  const auto foreign = m2.prepare_prompt(p);
  CHECK_THAT(expect_error([&] { m.try_admit(4, foreign); }, Errc::kInvalidArgument),
             Catch::Contains("not prepared by a manager with this hasher, seed and block size"));
  CHECK_FALSE(m.contains(4));
  CHECK(m.prepare_prompt(Toks{}).hashes.empty());  // an empty prompt: nothing to hash
  {  // Another block size with the same number of full blocks (6 tokens: one block of 4, one of 5) is refused too:
     // it was accepted, and the block hashed over tokens [0, 4) was registered for [0, 5), a wrong hit later.
    Mgr m4(cfg(16, 4));
    Mgr m5(cfg(16, 5));
    const auto by4 = m4.prepare_prompt(toks(0, 6));
    REQUIRE(by4.hashes.size() == 6 / 5);
    CHECK_THAT(expect_error([&] { m5.try_admit(1, by4); }, Errc::kInvalidArgument),
               Catch::Contains("prepared with block size 4, this manager's is 5"));
    CHECK_THAT(expect_error([&] { (void)m5.query_admit(by4); }, Errc::kInvalidArgument),
               Catch::Contains("block size"));
    CHECK_FALSE(m5.contains(1));
    CHECK(m5.stats().blocks_used == 0);
  }
}

TEST_CASE("interval prefix-cache statistics use vLLM's names and count re-admissions apart",
          "[scheduler][stats]") {
  Mgr m(cfg(32, 4));
  REQUIRE(m.try_admit(1, toks(0, 12)).admitted());
  build_step(m, {1});
  REQUIRE(m.try_admit(2, toks(0, 10)).admitted());  // hits 8
  auto st = m.take_prefix_cache_stats();
  CHECK(st.requests == 2);
  CHECK(st.queries == 22);
  CHECK(st.hits == 8);
  CHECK(st.hit_rate() == Approx(8.0 / 22.0));
  CHECK(st.preempted_requests == 0);
  CHECK_FALSE(st.reset);
  m.preempt(2);
  REQUIRE(m.try_admit(2, toks(0, 11)).admitted());  // recompute: counted apart
  m.free(1);
  st = m.take_prefix_cache_stats();
  CHECK(st.requests == 0);
  CHECK(st.queries == 0);
  CHECK(st.hit_rate() == 0.0);
  CHECK(st.preempted_requests == 1);
  CHECK(st.preempted_queries == 11);
  CHECK(st.preempted_hits == 8);
  CHECK(m.stats().readmitted_requests == 1);
  CHECK(m.stats().prefix_query_requests == 3);  // lifetime totals count every admission
  m.free(2);
  REQUIRE(m.reset_prefix_cache());
  st = m.take_prefix_cache_stats();
  CHECK(st.reset);
  CHECK_FALSE(m.take_prefix_cache_stats().reset);
  // An id preempted and re-admitted twice counts twice; a fresh admission of another id does not.
  REQUIRE(m.try_admit(5, toks(0, 3)).admitted());
  m.preempt(5);
  CHECK_THAT(expect_error([&] { m.preempt(5); }, Errc::kUnknownSequence), Catch::Contains("preempt: sequence 5"));
  REQUIRE(m.try_admit(5, toks(0, 3)).admitted());
  REQUIRE(m.try_admit(6, toks(0, 3)).admitted());
  st = m.take_prefix_cache_stats();
  CHECK(st.requests == 2);
  CHECK(st.preempted_requests == 1);
}

// ---------------------------------------------------------------------------------------------------------------
// Mixed batches (decode tokens, prefill chunks, lookahead verification) executed by the CPU reference kernels.

namespace {

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A value in +-[0.1, 1] drawn from `key` (never zero).
float val(std::uint64_t key) {
  const std::uint64_t r = mix(key);
  const float mag = 0.1f + 0.9f * static_cast<float>(r >> 40) / static_cast<float>(1ULL << 24);
  return (r & 1) != 0 ? mag : -mag;
}

}  // namespace

TEST_CASE("mixed batches of decodes, prefill chunks and lookahead: reference write_kv + prefill match float64",
          "[scheduler][chunked][kernels]") {
  const std::uint32_t bs = GENERATE(1U, 4U, 16U);
  constexpr int kHkv = 2, kHq = 4, kDim = 64;
  const std::size_t num_blocks = 4096 / bs + 64;
  Mgr m(cfg(num_blocks, bs));
  // fp32 NHD pool; unused slots NaN so a kernel that reads past a sequence's length fails.
  std::vector<float> pool(num_blocks * 2 * bs * kHkv * kDim, std::nanf(""));
  const auto kv = pagedkv::KVPoolView::nhd(pool.data(), pagedkv::DType::kFloat32, static_cast<std::int32_t>(num_blocks),
                                           static_cast<std::int32_t>(bs), kHkv, kDim);
  std::mt19937_64 rng(0xC0FFEE + bs);
  // Per sequence: all its token ids (known + drafts) and the fingerprint of each position's prefix: the K/V at a
  // position is a function of its prefix only (as in a real model), so prefix hits share it.
  struct S {
    Toks tokens;                      // known + drafts
    std::vector<std::uint64_t> fp;
    std::size_t drafts = 0;
  };
  std::map<SeqId, S> seqs;
  const auto extend = [](S& s, TokenId t) {
    s.fp.push_back(mix((s.fp.empty() ? 0x5eed : s.fp.back()) ^ (static_cast<std::uint64_t>(t) * 0x100000001b3ULL)));
    s.tokens.push_back(t);
  };
  const auto k_at = [](std::uint64_t fp, int h, int d) { return val(fp * 31 + static_cast<std::uint64_t>(h * kDim + d)); };
  const auto v_at = [](std::uint64_t fp, int h, int d) { return val(~fp * 17 + static_cast<std::uint64_t>(h * kDim + d)); };
  const std::vector<Toks> bases{toks(0, 300), toks(1000, 200)};
  SeqId next = 1;
  std::size_t steps = 0, mixed_steps = 0, chunk_rows = 0, checked_rows = 0;
  double worst = 0.0;
  for (int step = 0; step < 40; ++step) {
    // Admissions: prompts sharing prefixes (hits), reserved whole or by chunk.
    for (int a = 0; a < 2; ++a) {
      const Toks& base = bases[rng() % bases.size()];
      Toks p(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(1 + rng() % base.size()));
      for (int e = 0; e < static_cast<int>(rng() % 5); ++e) p.push_back(static_cast<TokenId>(5000 + rng() % 50));
      pagedkv::AdmitOptions o;
      if (rng() % 2 == 0) o.num_reserved_tokens = 1 + rng() % 40;
      if (m.try_admit(next, p, nullptr, o).admitted()) {
        S s;
        for (TokenId t : p) extend(s, t);
        seqs.emplace(next, std::move(s));
      }
      ++next;
    }
    // Growth: reserve the next chunk, append the sampled token, or reserve lookahead for drafts.
    for (auto& [id, s] : seqs) {
      const auto& q = m.sequence(id);
      if (q.num_unslotted() > 0) {
        (void)m.try_reserve(id, std::min<std::size_t>(q.num_unslotted(), 1 + rng() % 40));
      } else if (q.num_pending() == 0 && s.drafts == 0) {
        const TokenId t = static_cast<TokenId>(rng() % 100);
        if (m.try_append(id, Toks{t}).ok()) {
          extend(s, t);
          if (rng() % 3 == 0) {
            const std::size_t k = 1 + rng() % 3;
            if (m.try_reserve_lookahead(id, k).ok()) {
              for (std::size_t i = 0; i < k; ++i) extend(s, static_cast<TokenId>(rng() % 100));
              s.drafts = k;
            }
          }
        }
      }
    }
    // Schedule under a token budget: every pending position of decodes, chunks of prefills.
    std::vector<SeqId> batch;
    std::vector<std::uint32_t> sched;
    std::size_t budget = 96;
    for (auto& [id, s] : seqs) {
      const std::size_t pend = m.sequence(id).num_pending();
      if (pend == 0 || budget == 0) continue;
      const std::size_t n = std::min(pend, budget);
      budget -= n;
      batch.push_back(id);
      sched.push_back(static_cast<std::uint32_t>(n));
    }
    const Step st = build(m, batch, sched);
    ++steps;
    std::size_t decodes = 0, chunks = 0;
    for (std::size_t b = 0; b < batch.size(); ++b) (sched[b] == 1 ? decodes : chunks)++;
    if (decodes > 0 && chunks > 0) ++mixed_steps;
    // copy_blocks, then write_kv of this step's new tokens (rows in slot-mapping order), then prefill.
    const std::int32_t ncopies = static_cast<std::int32_t>(st.sz.num_copies);
    pagedkv::CopyBlocksParams cp{&kv, 1, st.copies.data(), ncopies};
    REQUIRE(pagedkv::reference::copy_blocks(cp) == pagedkv::Status::kSuccess);
    const std::size_t T = st.sz.num_new_tokens;
    std::vector<float> key(T * kHkv * kDim), value(T * kHkv * kDim), q(T * kHq * kDim), o(T * kHq * kDim);
    std::vector<std::size_t> row_pos(T);
    std::vector<SeqId> row_seq(T);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const S& s = seqs.at(batch[b]);
      const std::size_t seq_len = static_cast<std::size_t>(st.seq_lens[b]);
      for (std::int32_t r = st.qo_indptr[b]; r < st.qo_indptr[b + 1]; ++r) {
        const std::size_t pos = seq_len - static_cast<std::size_t>(st.qo_indptr[b + 1] - r);
        row_pos[static_cast<std::size_t>(r)] = pos;
        row_seq[static_cast<std::size_t>(r)] = batch[b];
        for (int h = 0; h < kHkv; ++h) {
          for (int d = 0; d < kDim; ++d) {
            key[(static_cast<std::size_t>(r) * kHkv + h) * kDim + d] = k_at(s.fp[pos], h, d);
            value[(static_cast<std::size_t>(r) * kHkv + h) * kDim + d] = v_at(s.fp[pos], h, d);
          }
        }
        for (std::size_t i = 0; i < kHq * kDim; ++i) {
          q[static_cast<std::size_t>(r) * kHq * kDim + i] = val(rng());
        }
      }
    }
    pagedkv::WriteKVParams w{key.data(), value.data(), 0, st.slots.data(), static_cast<std::int32_t>(T), kv};
    REQUIRE(pagedkv::reference::write_kv(w) == pagedkv::Status::kSuccess);
    pagedkv::PrefillParams pf;
    pf.q = q.data();
    pf.o = o.data();
    pf.qo_indptr = st.qo_indptr.data();
    pf.total_q_tokens = static_cast<std::int32_t>(T);
    pf.kv = kv;
    pf.pages = pagedkv::PageTable::csr(static_cast<std::int32_t>(batch.size()), st.indptr.data(), st.indices.data(),
                                       st.last_page_len.data());
    pf.num_qo_heads = kHq;
    pf.sm_scale = 1.f / std::sqrt(static_cast<float>(kDim));
    REQUIRE(pagedkv::reference::prefill(pf) == pagedkv::Status::kSuccess);
    // float64 oracle from the sequences' own K/V (contiguous, by fingerprint): causal over [0, pos]. Error as in
    // the reference kernel tests: max_i |o_i - ref_i| / max_i |ref_i| over the step's whole output.
    double max_diff = 0.0, max_ref = 1e-30;
    for (std::size_t r = 0; r < T; ++r) {
      const S& s = seqs.at(row_seq[r]);
      const std::size_t pos = row_pos[r];
      for (int h = 0; h < kHq; ++h) {
        const int g = h / (kHq / kHkv);
        std::vector<double> logit(pos + 1);
        double mx = -1e300;
        for (std::size_t t = 0; t <= pos; ++t) {
          double dot = 0;
          for (int d = 0; d < kDim; ++d) dot += double{q[(r * kHq + h) * kDim + d]} * k_at(s.fp[t], g, d);
          logit[t] = dot * pf.sm_scale;
          mx = std::max(mx, logit[t]);
        }
        double den = 0;
        for (double& l : logit) den += (l = std::exp(l - mx));
        for (int d = 0; d < kDim; ++d) {
          double acc = 0;
          for (std::size_t t = 0; t <= pos; ++t) acc += logit[t] * v_at(s.fp[t], g, d);
          const double want = acc / den;
          const double got = o[(r * kHq + h) * kDim + d];
          REQUIRE(std::isfinite(got));
          max_diff = std::max(max_diff, std::abs(got - want));
          max_ref = std::max(max_ref, std::abs(want));
        }
      }
      ++checked_rows;
      if (row_pos[r] + 1 < s.tokens.size()) ++chunk_rows;
    }
    worst = std::max(worst, max_diff / max_ref);
    // After the step: commit the drafts (a random number accepted), finish some sequences.
    for (auto it = seqs.begin(); it != seqs.end();) {
      S& s = it->second;
      const auto& sq = m.sequence(it->first);
      if (s.drafts > 0 && sq.num_pending() == 0) {
        const std::size_t a = rng() % (s.drafts + 1);
        const Toks acc(s.tokens.end() - static_cast<std::ptrdiff_t>(s.drafts),
                       s.tokens.end() - static_cast<std::ptrdiff_t>(s.drafts - a));
        m.commit_lookahead(it->first, acc);
        s.tokens.resize(s.tokens.size() - (s.drafts - a));
        s.fp.resize(s.tokens.size());
        s.drafts = 0;
      }
      if (sq.settled() && s.tokens.size() > 40 && rng() % 4 == 0) {
        m.free(it->first);
        it = seqs.erase(it);
      } else {
        ++it;
      }
    }
  }
  INFO("block size " << bs << ": " << steps << " steps, " << mixed_steps << " mixed, " << checked_rows
                     << " query rows checked, worst relative error " << worst);
  CHECK(worst < 1e-5);
  CHECK(mixed_steps > 5);
  CHECK(chunk_rows > 100);
  CHECK(checked_rows > 1000);
  CHECK(m.stats().prefix_hit_tokens > 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Property: speculative lookahead + commit == appending only the accepted tokens.

TEST_CASE("lookahead with random accept/reject leaves the state of a run that appended only accepted tokens",
          "[scheduler][lookahead][property]") {
  const std::uint32_t bs = GENERATE(1U, 4U, 16U);
  const std::uint64_t seed = 0xABC + bs;
  std::mt19937_64 rng(seed);
  // Ample pools: no eviction, so the prefix indexes must hold the same hashes. Block ids may differ (A allocates
  // blocks for drafts that B never sees), so tables are compared through a bijection of block ids.
  Mgr a(cfg(4096, bs));  // with lookahead
  Mgr b(cfg(4096, bs));  // accepted tokens only
  std::vector<SeqId> live;
  SeqId next = 1;
  std::size_t accepted = 0, rejected = 0, forks = 0, hits = 0;
  const auto step_all = [&] {
    build_step(a, live);
    build_step(b, live);
  };
  const auto compare = [&] {
    std::map<std::uint32_t, std::uint32_t> ab, ba;
    for (SeqId id : live) {
      REQUIRE(a.num_tokens(id) == b.num_tokens(id));
      const auto ta = a.token_ids(id), tb = b.token_ids(id);
      REQUIRE(Toks(ta.begin(), ta.end()) == Toks(tb.begin(), tb.end()));
      const Ids ia = ids(a, id), ib = ids(b, id);
      REQUIRE(ia.size() == ib.size());
      for (std::size_t i = 0; i < ia.size(); ++i) {
        const auto [x, nx] = ab.emplace(ia[i], ib[i]);
        const auto [y, ny] = ba.emplace(ib[i], ia[i]);
        REQUIRE(x->second == ib[i]);  // a bijection
        REQUIRE(y->second == ia[i]);
        REQUIRE(a.allocator().refcount(ia[i]) == b.allocator().refcount(ib[i]));
        REQUIRE(a.prefix_index().hash_of(ia[i]) == b.prefix_index().hash_of(ib[i]));
      }
    }
    REQUIRE(a.prefix_index().size() == b.prefix_index().size());
    REQUIRE(a.stats().blocks_used == b.stats().blocks_used);
    REQUIRE(a.stats().blocks_cached == b.stats().blocks_cached);
  };
  const Toks base = toks(0, 64);
  for (int round = 0; round < 300; ++round) {
    const auto r = rng() % 10;
    if (r < 2 || live.empty()) {  // admit, often with a shared prefix (prefix hits)
      Toks p(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(1 + rng() % base.size()));
      p.push_back(static_cast<TokenId>(100 + rng() % 7));
      const auto ra = a.try_admit(next, p);
      const auto rb = b.try_admit(next, p);
      REQUIRE(ra.admitted());
      REQUIRE(rb.num_cached_tokens == ra.num_cached_tokens);
      if (ra.num_cached_tokens > 0) ++hits;
      live.push_back(next++);
      step_all();
    } else if (r < 3) {  // fork a settled sequence (beam search)
      const SeqId p = live[rng() % live.size()];
      a.fork(p, next);
      b.fork(p, next);
      live.push_back(next++);
      ++forks;
    } else if (r < 4 && live.size() > 2) {  // finish one
      const std::size_t i = rng() % live.size();
      a.free(live[i]);
      b.free(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else {  // a speculative step on one sequence: sampled token + k drafts, verify, accept a prefix
      const SeqId id = live[rng() % live.size()];
      const TokenId sampled = static_cast<TokenId>(rng() % 5);
      const std::size_t k = 1 + rng() % 4;
      Toks drafts(k);
      for (auto& t : drafts) t = static_cast<TokenId>(rng() % 5);
      const std::size_t acc = rng() % (k + 1);
      REQUIRE(a.try_append(id, Toks{sampled}).ok());
      REQUIRE(a.try_reserve_lookahead(id, k).ok());
      build_step(a, live);  // the verification step
      a.commit_lookahead(id, Toks(drafts.begin(), drafts.begin() + static_cast<std::ptrdiff_t>(acc)));
      Toks add{sampled};
      add.insert(add.end(), drafts.begin(), drafts.begin() + static_cast<std::ptrdiff_t>(acc));
      REQUIRE(b.try_append(id, add).ok());
      build_step(b, live);
      accepted += acc;
      rejected += k - acc;
    }
    compare();
  }
  INFO("block size " << bs << ", seed " << seed << ": accepted " << accepted << ", rejected " << rejected
                     << ", forks " << forks << ", admissions with hits " << hits);
  CHECK(accepted > 100);
  CHECK(rejected > 100);
  CHECK(forks > 10);
  CHECK(hits > 10);
}
