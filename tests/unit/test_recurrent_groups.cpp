// Tests of recurrent-state groups (AttentionKind::kRecurrent; issue 20 sec. 1; docs/groups.md "Recurrent-state
// groups"): a working state per sequence updated in place by every build, checkpoints every `interval` tokens
// content-addressed by the chain hash of the blocks before them, prefix hits that resume from the latest checkpoint.
//
//  - [config]  bad configurations are typed errors naming the value;
//  - [toy]     a toy recurrence (an affine scan over the tokens) plays the SSM kernel: a shadow pool executes each
//              build's copies, reads state_in, scans the step's tokens, writes each checkpoint and state_out; after
//              every operation every built sequence's working state equals the scan computed contiguously over its
//              tokens, and every registered checkpoint holds the scan of the prefix its hash names. Through
//              admission (whole and chunked), hits, fork, growth, partial builds, rewind of unbuilt positions,
//              preemption by recompute and re-admission, eviction under a small pool. Free blocks are poisoned
//              after every operation; refcounts and per-group held counts are recounted from the tables;
//  - [prefix]  the hit is the brute-force maximum over the groups (full run, window blocks, the checkpoint at the
//              end of the hit) and always a multiple of the interval;
//  - [lookahead] speculative decoding: draft states per lookahead slot; commit keeps the state after the last
//              accepted draft (and the last checkpoint among them), whatever the verification accepts;
//  - [strong]  refused calls (swap preemption, rewinding built positions, a mark inside lookahead slots, a build
//              without the state outputs, a pool too small) are typed errors or results and change nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <pagedkv/kv_cache_manager.hpp>

#include "../fuzz/recurrent_model.hpp"
#include "test_support.hpp"

namespace {

using pagedkv::AttentionKind;
using pagedkv::BatchMetadataBuffers;
using pagedkv::CacheConfig;
using pagedkv::Errc;
using pagedkv::KVCacheGroupSpec;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::expect_error;

using pagedkv_recurrent::Manager;

// Catch2's failure for the shared engine's checks (tests/fuzz/recurrent_model.hpp).
struct CatchFail {
  void operator()(const std::string& what) const { FAIL(what); }
};
struct Engine : pagedkv_recurrent::Engine<CatchFail> {
  Engine(const CacheConfig& c, std::uint64_t seed) : pagedkv_recurrent::Engine<CatchFail>(c, seed, CatchFail{}) {}
};

CacheConfig config(std::size_t num_blocks, std::uint32_t bs, std::vector<KVCacheGroupSpec> groups) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = bs;
  c.groups = std::move(groups);
  return c;
}

pagedkv_recurrent::Counts run_model(const CacheConfig& c, std::uint64_t seed, std::size_t steps) {
  Engine e(c, seed);
  std::mt19937_64 rng(seed);
  const auto n = pagedkv_recurrent::run_ops(
      e, steps, [&](std::size_t k) { return static_cast<std::size_t>(rng() % std::max<std::size_t>(k, 1)); },
      [] { return false; });
  INFO("admits " << n.admits << " hits " << n.hits << " forks " << n.forks << " builds " << n.builds << " rewinds "
                 << n.rewinds << " refusals " << n.refusals << " preemptions " << n.preemptions << " marks "
                 << n.marks << " swaps " << n.swaps << " resumes " << n.resumes << " lookaheads " << n.lookaheads
                 << " accepted " << n.accepted);
  CHECK(n.admits > 20);
  CHECK(n.hits > 5);  // hits from checkpoints did happen (the state checks saw them)
  CHECK(n.forks > 3);
  CHECK(n.builds > 50);
  CHECK(n.preemptions > 10);
  CHECK(n.marks > 3);
  CHECK(n.lookaheads > 5);
  CHECK(n.accepted > 5);
  return n;
}

}  // namespace

TEST_CASE("Recurrent groups: invalid configurations are typed errors naming the value", "[recurrent][config]") {
  const auto bad = [](std::vector<KVCacheGroupSpec> g, const char* needle) {
    const std::string msg = expect_error([&] { Manager m(config(64, 4, g)); }, Errc::kInvalidArgument);
    INFO(msg);
    CHECK(msg.find(needle) != std::string::npos);
  };
  bad({{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 0, 1}}, "window_tokens = 0");
  bad({{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 6, 1}}, "multiple of the block size 4");
  bad({{AttentionKind::kRecurrent, 8, 1}, {AttentionKind::kFull, 0, 1}}, "group 0 must be an attention group");
  bad({{AttentionKind::kFull, 0, 1, 1024}, {AttentionKind::kRecurrent, 8, 1}}, "only a recurrent group has a state");
  // Byte accounting: a block holds one state per layer slot when the state is larger than a page.
  CacheConfig c = config(64, 4, {{AttentionKind::kFull, 0, 2}, {AttentionKind::kRecurrent, 8, 6, 5000}});
  c.page_size_bytes = 1000;
  Manager m(c);
  CHECK(m.bytes_per_block() == 5000 * 6);
  CHECK(m.is_recurrent(1));
  CHECK_FALSE(m.is_recurrent(0));
  CHECK_FALSE(m.window_block_bound(1, 16).has_value());
}

TEST_CASE("Recurrent groups: a toy recurrence through hits, fork, partial builds, rewind, marks, preemption and swap",
          "[recurrent][toy]") {
  const std::uint64_t seed = GENERATE(1, 2, 3);
  SECTION("full + recurrent every 8, block size 4, a roomy pool") {
    run_model(config(400, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1}}), seed, 1500);
  }
  SECTION("full + sliding window 6 + two recurrent groups (every 4 and 12), a small pool that evicts") {
    run_model(config(120, 4,
                     {{AttentionKind::kFull, 0, 1},
                      {AttentionKind::kSlidingWindow, 6, 1},
                      {AttentionKind::kRecurrent, 4, 1},
                      {AttentionKind::kRecurrent, 12, 1}}),
              seed, 1500);
  }
  SECTION("a host tier: swap preemption and resume carry the working state, evicted checkpoints come back") {
    CacheConfig c = config(90, 4,
                           {{AttentionKind::kFull, 0, 1},
                            {AttentionKind::kRecurrent, 8, 1, 0, true},
                            {AttentionKind::kSlidingWindow, 5, 1}});
    c.num_host_blocks = 120;
    const auto n = run_model(c, seed, 1500);
    CHECK(n.swaps > 5);
    CHECK(n.resumes > 3);
  }
  SECTION("full + recurrent every 16 keeping the last checkpoint, and one without") {
    run_model(config(200, 4,
                     {{AttentionKind::kFull, 0, 1},
                      {AttentionKind::kRecurrent, 16, 1, 0, true},
                      {AttentionKind::kRecurrent, 8, 1}}),
              seed, 1500);
  }
}

TEST_CASE("Recurrent groups: a hit resumes from the latest checkpoint inside the shared prefix",
          "[recurrent][prefix]") {
  Engine e(config(200, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1}}), 7);
  Manager& m = e.m;
  const auto a = pagedkv_test::toks(100, 30);
  REQUIRE(m.try_admit(1, a).status == pagedkv::AdmitStatus::kAdmitted);
  e.build({1}, {30});
  e.check();
  // Checkpoints at 8, 16, 24 were written and registered; the full group has blocks 0..6 (28 tokens).
  for (const std::size_t p : {8, 16, 24}) {
    CHECK(m.prefix_index(1).find(m.sequence(1).hashes[p / 4 - 1]).has_value());
  }
  CHECK_FALSE(m.prefix_index(1).find(m.sequence(1).hashes[4]).has_value());  // 20 is not a checkpoint
  // A prompt sharing 22 tokens resumes at 16 (the latest checkpoint at or before the shared blocks).
  auto b = pagedkv_test::toks(100, 22);
  for (int i = 0; i < 9; ++i) b.push_back(7);
  const auto r = m.try_admit(2, b);
  REQUIRE(r.status == pagedkv::AdmitStatus::kAdmitted);
  CHECK(r.num_cached_tokens == 16);
  const auto why = m.explain_admit(b);
  CHECK(why.hit_tokens == 16);
  CHECK(why.cause == pagedkv::MissCause::kLimitedByGroup);  // the full group holds block 4, the checkpoint not
  CHECK(why.limiting_group == 1);
  CHECK(why.first_miss_block == 4);
  e.build({2}, {15});
  e.check();
  // The same prompt again hits 24 now: the second request wrote the checkpoint at 24 of its own tokens.
  CHECK(m.try_admit(3, b).num_cached_tokens == 24);
  e.check();
}

TEST_CASE("Recurrent groups: the last checkpoint makes a conversation's next turn hit its whole previous prompt",
          "[recurrent][prefix]") {
  Engine e(config(200, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 64, 1, 0, true}}), 5);
  Manager& m = e.m;
  auto turn = pagedkv_test::toks(300, 30);
  REQUIRE(m.try_admit(1, turn).status == pagedkv::AdmitStatus::kAdmitted);
  e.build({1}, {30});
  REQUIRE(m.try_append(1, pagedkv_test::toks(900, 9)).status == pagedkv::AppendStatus::kOk);  // the answer
  e.build({1}, {9});
  CHECK(m.sequence(1).other_groups[0].last_pos == 36);  // 39 tokens: the last block boundary is 36
  const auto tokens = m.sequence(1).tokens;
  m.free(1);  // registers the state after 36 tokens
  e.check();
  std::vector<TokenId> next(tokens.begin(), tokens.end());
  for (int i = 0; i < 8; ++i) next.push_back(5);
  const auto r = m.try_admit(2, next);
  CHECK(r.num_cached_tokens == 36);  // without the last checkpoint: 0 (no multiple of 64 inside)
  e.check();
  e.build({2}, {static_cast<std::uint32_t>(next.size() - 36)});
  e.check();
  m.free(2);
  // Without it, the same conversation hits nothing.
  Engine f(config(200, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 64, 1}}), 5);
  REQUIRE(f.m.try_admit(1, tokens).status == pagedkv::AdmitStatus::kAdmitted);
  f.build({1}, {static_cast<std::uint32_t>(tokens.size())});
  f.m.free(1);
  CHECK(f.m.try_admit(2, next).num_cached_tokens == 0);
}

TEST_CASE("Recurrent groups: a marked checkpoint (the end of a turn) serves the next request sharing it",
          "[recurrent][prefix]") {
  Engine e(config(200, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 64, 1}}), 9);
  Manager& m = e.m;
  const auto turn = pagedkv_test::toks(40, 30);  // a system prompt of 20 tokens, then a question
  REQUIRE(m.try_admit(1, turn).status == pagedkv::AdmitStatus::kAdmitted);
  REQUIRE(e.mark(1, 20) == pagedkv::AppendStatus::kOk);  // the end of the system prompt
  CHECK(m.block_ids(1, 1)[4] != 0);
  e.build({1}, {30});
  e.check();
  m.free(1);
  auto other = pagedkv_test::toks(40, 20);  // the same system prompt, another question
  for (int i = 0; i < 12; ++i) other.push_back(900 + i);
  CHECK(m.try_admit(2, other).num_cached_tokens == 20);  // without the mark: 0 (no multiple of 64 inside)
  e.build({2}, {12});
  e.check();
  // Bad marks are refused, naming the position, and change nothing.
  REQUIRE(m.try_append(2, pagedkv_test::toks(7, 5)).status == pagedkv::AppendStatus::kOk);  // 37 slots, 32 built
  const std::vector<std::uint32_t> before(m.block_ids(2, 1).begin(), m.block_ids(2, 1).end());
  CHECK(expect_error([&] { (void)m.mark_checkpoint(2, 34); }, Errc::kInvalidArgument).find("multiple") !=
        std::string::npos);
  CHECK(expect_error([&] { (void)m.mark_checkpoint(2, 32); }, Errc::kInvalidArgument).find("built") !=
        std::string::npos);
  CHECK(expect_error([&] { (void)m.mark_checkpoint(2, 40); }, Errc::kLimitExceeded).find("beyond") !=
        std::string::npos);
  CHECK(std::vector<std::uint32_t>(m.block_ids(2, 1).begin(), m.block_ids(2, 1).end()) == before);
  CHECK(e.mark(2, 36) == pagedkv::AppendStatus::kOk);
  Manager plain(config(16, 4, {}));
  REQUIRE(plain.try_admit(1, pagedkv_test::toks(1, 9)).status == pagedkv::AdmitStatus::kAdmitted);
  expect_error([&] { (void)plain.mark_checkpoint(1, 8); }, Errc::kInvalidArgument);
}

TEST_CASE("Recurrent groups: refused calls are typed errors and change nothing", "[recurrent][strong]") {
  CacheConfig c = config(64, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1}});
  c.num_host_blocks = 16;
  Engine e(c, 11);
  Manager& m = e.m;
  REQUIRE(m.try_admit(1, pagedkv_test::toks(1, 10)).status == pagedkv::AdmitStatus::kAdmitted);
  e.build({1}, {10});
  e.check();
  const auto snapshot = [&] {
    const auto& q = m.sequence(1);
    const auto t = q.table.blocks();
    return std::tuple(q.num_built, q.num_known(), std::vector<std::uint32_t>(t.begin(), t.end()),
                      q.other_groups[0].state, m.allocator().num_free_blocks(), m.num_sequences());
  };
  const auto before = snapshot();
  expect_error([&] { m.rewind(1, 1); }, Errc::kLimitExceeded);
  CHECK(snapshot() == before);
  // A build whose recurrent group's buffers lack the state outputs.
  REQUIRE(m.try_append(1, pagedkv_test::toks(50, 1)).status == pagedkv::AppendStatus::kOk);
  std::vector<BatchMetadataBuffers> bufs;
  for (auto& st : e.store) bufs.push_back(st.buffers());
  bufs[1].state_out = {};
  const std::vector<SeqId> batch{1};
  const std::string msg = expect_error([&] { (void)m.build_batch_metadata(batch, bufs); }, Errc::kBadShape);
  CHECK(msg.find("state_out") != std::string::npos);
  CHECK(m.sequence(1).num_built == 10);
  e.build({1}, {1});
  e.check();
  // A pool with one usable block cannot hold a sequence's K/V block and its state: never fits, nothing held.
  Manager tiny(config(2, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 4, 1}}));
  CHECK(tiny.try_admit(1, pagedkv_test::toks(1, 3)).status == pagedkv::AdmitStatus::kNeverFits);
  CHECK(tiny.num_sequences() == 0);
  CHECK(tiny.allocator().num_free_blocks() == 1);
}

TEST_CASE("Recurrent groups: lookahead keeps a draft state per slot and commit keeps the accepted prefix's state",
          "[recurrent][lookahead]") {
  // Block 4, checkpoints every 8, a last checkpoint: the sequence has 10 built tokens, then a sampled token
  // (position 10) and 4 drafts (positions 11..14) are computed in one step; the verification accepts 0 to 4 drafts.
  // Accepting one ends exactly on the block boundary 12: the last checkpoint takes that draft's state and the
  // working state becomes a copy of it.
  for (std::size_t accept = 0; accept <= 4; ++accept) {
    DYNAMIC_SECTION("accepting " << accept << " of 4 drafts") {
      Engine e(config(64, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1, 0, true}}), 13);
      Manager& m = e.m;
      REQUIRE(m.try_admit(1, pagedkv_test::toks(1, 10)).status == pagedkv::AdmitStatus::kAdmitted);
      e.build({1}, {10});
      REQUIRE(m.try_append(1, pagedkv_test::toks(70, 1)).status == pagedkv::AppendStatus::kOk);
      const std::size_t free_before = m.allocator().num_free_blocks();
      REQUIRE(e.lookahead(1, {7, 8, 9, 10}) == pagedkv::AppendStatus::kOk);
      CHECK(m.sequence(1).other_groups[0].drafts.size() == 4);
      // K/V: positions 11..15 need block 3 (12..15; block 2 has room for 11); recurrent: 4 drafts, no checkpoint.
      CHECK(free_before - m.allocator().num_free_blocks() == 1 + 4);
      const auto sizes = e.build({1}, {5});
      CHECK(e.store[1].state_out[0] == -1);
      CHECK(sizes[1].num_checkpoints == 1 + 4);  // the working state at 11, a draft state at each of 12..15
      e.check();
      e.commit(1, accept);
      e.check();
      const auto& q = m.sequence(1);
      CHECK(q.num_known() == 11 + accept);
      CHECK(q.num_built == 11 + accept);
      CHECK(q.other_groups[0].drafts.empty());
      // The last boundary is 12 once a draft is accepted; else none (the interval checkpoint at 8 is the last).
      CHECK(q.other_groups[0].last_pos == (accept >= 1 ? 12U : 0U));
      // The next step continues from the accepted state (check() compares it with the contiguous scan).
      REQUIRE(m.try_append(1, pagedkv_test::toks(90, 1)).status == pagedkv::AppendStatus::kOk);
      e.build({1}, {1});
      e.check();
      m.free(1);
      e.check();
      CHECK(m.allocator().num_free_blocks() + m.allocator().num_cached_blocks() == 63);
    }
  }
}

TEST_CASE("Recurrent groups: lookahead slots rewind with their drafts, marks inside them are refused",
          "[recurrent][lookahead][strong]") {
  Engine e(config(64, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1}}), 17);
  Manager& m = e.m;
  REQUIRE(m.try_admit(1, pagedkv_test::toks(1, 6)).status == pagedkv::AdmitStatus::kAdmitted);
  e.build({1}, {6});
  REQUIRE(e.lookahead(1, {3, 4, 5, 6, 7}) == pagedkv::AppendStatus::kOk);  // positions 6..10
  e.build({1}, {2});  // a partial build: drafts 0 and 1
  e.check();
  expect_error([&] { (void)m.mark_checkpoint(1, 8); }, Errc::kLimitExceeded);  // inside the lookahead slots
  e.rewind(1, 2);  // drop the last two drafts
  CHECK(m.sequence(1).num_lookahead == 3);
  CHECK(m.sequence(1).other_groups[0].drafts.size() == 3);
  e.check();
  e.build({1}, {1});  // draft 2 starts from draft 1's state
  e.check();
  expect_error([&] { e.rewind(1, 4); }, Errc::kLimitExceeded);  // 3 lookahead slots + a built known token
  e.commit(1, 3);
  CHECK(m.sequence(1).num_known() == 9);
  e.check();
  m.free(1);
  e.check();
}
