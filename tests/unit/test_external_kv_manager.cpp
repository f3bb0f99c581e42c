// Tests of the manager's external-KV calls (pagedkv/external_kv_calls.hpp, issue 33): a producer and a consumer
// manager handing a prompt's blocks over (in process: the "transfer" is a check of the descriptor's generations),
// and directed tests of the bug classes the field shipped: vLLM #46283 (an aborted request's blocks held forever),
// #52234 (a stale reference served), #46304 (receive and send done in one step), #50558 (off-by-one block count),
// #42895 (block size mismatch found per request), TensorRT-LLM #12542 (evicted while sending), LMCache #5248
// (preempted while saving).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/external_kv.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

namespace {

using pagedkv::ExternalFailurePolicy;
using pagedkv::ExternalSignal;
using pagedkv::ExternalTimePoint;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::build_step;
using pagedkv_test::expect_error;
using pagedkv_test::toks;
using Mgr = pagedkv::KVCacheManager<>;
using std::chrono::seconds;

ExternalTimePoint at(long s) { return ExternalTimePoint{} + seconds(s); }

pagedkv::CacheConfig config(std::size_t num_blocks, std::uint32_t block_size = 4) {
  pagedkv::CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.enable_events = true;
  return c;
}
pagedkv::KvLayoutFingerprint fp(const Mgr& m) { return m.layout_fingerprint("nhd", "bf16", 8, 128); }

// Admit and compute `prompt` as `seq` on `m` (one build).
void compute(Mgr& m, SeqId seq, const std::vector<TokenId>& prompt) {
  REQUIRE(m.try_admit(seq, prompt).admitted());
  build_step(m, {seq});
}

std::size_t stored_events(Mgr& m) {
  std::vector<pagedkv::KVEvent> ev;
  m.drain_events(ev);
  return static_cast<std::size_t>(std::count_if(ev.begin(), ev.end(), [](const pagedkv::KVEvent& e) {
    return e.type == pagedkv::KVEventType::kBlockStored;
  }));
}

// Fill the pool with new sequences until an admission fails; returns their ids (to free) and every block they got.
std::vector<std::uint32_t> pressure(Mgr& m, SeqId first, std::vector<SeqId>& ids) {
  std::vector<std::uint32_t> got;
  for (SeqId s = first;; ++s) {
    if (!m.try_admit(s, toks(static_cast<TokenId>(100000 + 64 * s), 4)).admitted()) break;
    ids.push_back(s);
    for (auto b : m.block_ids(s)) got.push_back(b);
  }
  return got;
}

TEST_CASE("P/D hand-off: lease, import plan, fill, completion registers the valid prefix", "[external_kv][manager]") {
  Mgr prod(config(32));
  Mgr cons(config(32));
  const auto prompt = toks(1, 18);
  compute(prod, 1, prompt);
  stored_events(prod);
  const auto desc = prod.finish_with_lease(1, fp(prod), at(100));
  CHECK_FALSE(prod.contains(1));
  CHECK(desc.num_tokens == 18);
  CHECK(desc.num_blocks() == 5);
  CHECK(desc.identities.size() == 4);
  CHECK(prod.stats().blocks_used == 5);  // the lease keeps every block, the partial one too
  CHECK(prod.lookup(toks(1, 18)) == 16);  // registered and hit-able while leased

  auto plan = cons.plan_import(desc, fp(cons), prompt);
  CHECK(plan.first_token == 0);
  CHECK(plan.end_token == 17);  // the last prompt token is computed here
  CHECK(plan.num_blocks == 5);
  CHECK(cons.stats().external.blocks_transferred == 0);  // counted at admission, not at plan time
  auto r = cons.try_admit_external(7, prompt, plan);
  REQUIRE(r.admit.admitted());
  REQUIRE(r.ticket.fill_id != 0);
  CHECK(r.ticket.num_blocks() == plan.num_blocks);
  CHECK(r.ticket.first_block == plan.first_block);
  CHECK(cons.external_fill_of(7) == r.ticket.fill_id);
  CHECK(cons.lookup(prompt) == 0);  // fill blocks are never matchable
  CHECK(stored_events(cons) == 0);
  CHECK(expect_error([&] { build_step(cons, {7}); }, pagedkv::Errc::kInvalidArgument)
            .find("sequence 7 waits for external KV") != std::string::npos);
  CHECK(expect_error([&] { cons.rewind(7, 1); }, pagedkv::Errc::kInvalidArgument).find("sequence 7") !=
        std::string::npos);
  for (auto b : r.ticket.blocks) CHECK(cons.allocator().refcount(b) == 2);  // table + fill
  expect_error([&] { cons.fork(7, 8); }, pagedkv::Errc::kInvalidArgument);  // not forkable while it waits
  expect_error([&] { (void)cons.try_admit_external(7, prompt, 4); }, pagedkv::Errc::kDuplicateSequence);
  CHECK(cons.stats().external.fills_started == 1);

  // The transfer: every remote reference is current on the producer.
  for (std::size_t i = 0; i < plan.remote_blocks.size(); ++i) {
    CHECK(prod.is_current_block(plan.remote_blocks[i], plan.remote_generations[i]));
  }
  const auto done = cons.complete_external_fill(r.ticket.fill_id, r.ticket.num_blocks());
  CHECK(done.signal == ExternalSignal::kApplied);
  CHECK(done.num_computed_tokens == 17);
  CHECK(cons.num_built(7) == 17);
  CHECK(stored_events(cons) == 4);
  CHECK(cons.lookup(toks(1, 20)) == 16);
  CHECK(build_step(cons, {7}).slots.size() == 1);  // the last prompt token
  CHECK(prod.release_lease(desc.hold_id) == ExternalSignal::kApplied);
  CHECK(prod.release_lease(desc.hold_id) == ExternalSignal::kDuplicate);
  CHECK(prod.stats().blocks_used == 0);
  CHECK(prod.stats().blocks_cached == 4);
  CHECK(cons.complete_external_fill(r.ticket.fill_id, 5).signal == ExternalSignal::kDuplicate);

  // A second request sharing the prefix: the consumer's own hit is not transferred again.
  const auto prompt2 = toks(1, 26);
  compute(prod, 2, prompt2);
  const auto desc2 = prod.finish_with_lease(2, fp(prod), at(100));
  const auto plan2 = cons.plan_import(desc2, fp(cons), prompt2);
  CHECK(plan2.skipped_blocks == 4);
  CHECK(plan2.first_token == 16);
  CHECK(plan2.num_blocks == 3);  // tokens [16, 25)
  const auto s = cons.stats().external;
  CHECK(s.blocks_skipped == 0);  // plan2 is not admitted: only the first import counts
  CHECK(s.blocks_transferred == 5);
  CHECK(s.fills_started == 1);
  CHECK(s.fills_completed == 1);
  CHECK(s.duplicate_signals == 1);
  CHECK(prod.stats().external.leases_started == 2);
}

TEST_CASE("vllm#50558: block counts from token counts on both sides, never off by one", "[external_kv][manager]") {
  for (std::size_t len = 1; len <= 21; ++len) {
    CAPTURE(len);
    Mgr prod(config(32));
    Mgr cons(config(32));
    const auto prompt = toks(5, len);
    compute(prod, 1, prompt);
    const auto desc = prod.finish_with_lease(1, fp(prod), std::nullopt);
    CHECK(desc.num_blocks() == (len + 3) / 4);
    const auto plan = cons.plan_import(desc, fp(cons), prompt);
    CHECK(plan.end_token == len - 1);
    CHECK(plan.num_blocks == (len - 1 + 3) / 4);
    const auto r = cons.try_admit_external(9, prompt, plan.end_token - plan.first_token);
    REQUIRE(r.admit.admitted());
    CHECK(r.ticket.num_blocks() == plan.num_blocks);
    CHECK(plan.remote_blocks.size() == r.ticket.blocks.size());
    if (r.ticket.fill_id != 0) cons.complete_external_fill(r.ticket.fill_id, plan.num_blocks);
    CHECK(cons.num_built(9) == len - 1);
  }
  // A descriptor whose block count disagrees with its token count is refused, naming both.
  Mgr prod(config(32));
  Mgr cons(config(32));
  compute(prod, 1, toks(5, 16));
  auto desc = prod.finish_with_lease(1, fp(prod), std::nullopt);
  desc.blocks.push_back(desc.blocks.back());
  desc.generations.push_back(0);
  CHECK(expect_error([&] { (void)cons.plan_import(desc, fp(cons), toks(5, 16)); }, pagedkv::Errc::kInvalidArgument)
            .find("ceil(16 / 4) = 4 blocks per group") != std::string::npos);
}

TEST_CASE("the partial last block is imported only for the same tokens", "[external_kv][manager]") {
  Mgr prod(config(32));
  const auto prompt = toks(1, 22);  // 5 full blocks and 2 tokens of a sixth
  compute(prod, 1, prompt);
  const auto desc = prod.finish_with_lease(1, fp(prod), std::nullopt);
  REQUIRE(desc.tail_tokens == std::vector<TokenId>(prompt.begin() + 20, prompt.end()));
  // A consumer prompt equal in every full block, different at token 20 or 21 (inside the partial block): refused,
  // naming the token, when the import reaches it; a prompt ending before it imports the full blocks.
  for (const std::size_t pos : {std::size_t{20}, std::size_t{21}}) {
    Mgr cons(config(32));
    auto other = toks(1, 23);
    other[pos] += 1000;
    const std::string msg = expect_error([&] { (void)cons.plan_import(desc, fp(cons), other); },
                                         pagedkv::Errc::kInvalidArgument);
    CHECK(msg.find("token " + std::to_string(pos) + " of the partial block 5 differs") != std::string::npos);
    CHECK(cons.stats().external.blocks_transferred == 0);
    CHECK(cons.plan_import(desc, fp(cons), std::vector<TokenId>(other.begin(), other.begin() + 21)).end_token ==
          20U);  // positions before 20 only: the same
  }
  Mgr cons(config(32));
  CHECK(cons.plan_import(desc, fp(cons), prompt).end_token == 21);
  // A descriptor whose tail does not match its token count is refused by its shape.
  auto bad = desc;
  bad.tail_tokens.pop_back();
  CHECK(expect_error([&] { (void)cons.plan_import(bad, fp(cons), prompt); }, pagedkv::Errc::kInvalidArgument)
            .find("holds 1 tail tokens; expected 22 % 4 = 2") != std::string::npos);
  CHECK(prod.release_lease(desc.hold_id) == ExternalSignal::kApplied);
}

TEST_CASE("vllm#42895: a layout mismatch is refused at hand-shake, naming the field", "[external_kv][manager]") {
  Mgr prod(config(32, 4));
  Mgr cons(config(32, 8));
  compute(prod, 1, toks(5, 16));
  const auto desc = prod.finish_with_lease(1, fp(prod), std::nullopt);
  CHECK(expect_error([&] { (void)cons.plan_import(desc, fp(cons), toks(5, 16)); }, pagedkv::Errc::kInvalidArgument)
            .find("block_size: 8 vs 4") != std::string::npos);
  auto other = fp(prod);
  other.dtype = "fp8_e4m3";
  CHECK(expect_error([&] { (void)prod.plan_import(desc, other, toks(5, 16)); }, pagedkv::Errc::kInvalidArgument)
            .find("dtype: fp8_e4m3 vs bf16") != std::string::npos);
  CHECK(cons.stats().external.blocks_transferred == 0);
  // A descriptor of another prompt is refused by identity.
  Mgr cons2(config(32, 4));
  CHECK(expect_error([&] { (void)cons2.plan_import(desc, fp(cons2), toks(6, 16)); }, pagedkv::Errc::kInvalidArgument)
            .find("identity differs") != std::string::npos);
}

TEST_CASE("vllm#46283: an abort while the fill is in flight never holds blocks forever, never reuses them early",
          "[external_kv][manager]") {
  Mgr m(config(16));
  m.set_orphan_timeout(seconds(30));
  m.reap_external(at(0));
  const auto r = m.try_admit_external(1, toks(1, 17), 16);
  REQUIRE(r.ticket.fill_id != 0);
  const auto blocks = r.ticket.blocks;
  m.free(1);  // not quiescent: an orphan hold
  CHECK(m.stats().external.orphan_holds == 1);
  CHECK(m.stats().blocks_used == blocks.size());
  std::vector<SeqId> ids;
  for (auto b : pressure(m, 100, ids)) CHECK(std::find(blocks.begin(), blocks.end(), b) == blocks.end());
  for (auto s : ids) m.free(s);
  CHECK(m.reap_external(at(29)) == 0);
  CHECK(m.reap_external(at(30)) == 1);
  CHECK(m.stats().blocks_used == 0);
  CHECK(m.complete_external_fill(r.ticket.fill_id, 4).signal == ExternalSignal::kLate);
  CHECK(m.stats().blocks_used == 0);

  // Quiescent abort: at once. Late signal after it: counted.
  const auto r2 = m.try_admit_external(2, toks(1, 17), 16);
  m.abort_sequence(2, true);
  CHECK(m.stats().blocks_used == 0);
  CHECK(m.complete_external_fill(r2.ticket.fill_id, 1).signal == ExternalSignal::kLate);
  // Non-quiescent abort ended by the late signal (no deadline reached).
  const auto r3 = m.try_admit_external(3, toks(1, 17), 16);
  m.preempt(3);
  CHECK(m.stats().blocks_used == r3.ticket.blocks.size());
  CHECK(m.complete_external_fill(r3.ticket.fill_id, 4).signal == ExternalSignal::kLate);
  CHECK(m.stats().blocks_used == 0);
  const auto s = m.stats().external;
  CHECK(s.fills_aborted == 3);
  CHECK(s.orphans_expired == 1);
  CHECK(s.orphans_released == 1);
  CHECK(s.late_signals == 3);
  CHECK(s.blocks_held == 0);
}

TEST_CASE("vllm#52234: a stale reference is refused after the lease ends and the block is reused",
          "[external_kv][manager]") {
  Mgr prod(config(10));
  compute(prod, 1, toks(1, 16));
  const auto desc = prod.finish_with_lease(1, fp(prod), at(10));
  CHECK(prod.is_current_block(desc.blocks[0], desc.generations[0]));
  CHECK(prod.reap_external(at(10)) == 1);  // the consumer never confirmed: the lease expired
  std::vector<SeqId> ids;
  const auto got = pressure(prod, 10, ids);
  CHECK(std::find(got.begin(), got.end(), desc.blocks[0]) != got.end());  // reused
  for (std::size_t i = 0; i < desc.blocks.size(); ++i) {
    CHECK_FALSE(prod.is_current_block(desc.blocks[i], desc.generations[i]));
  }
  CHECK(prod.release_lease(desc.hold_id) == ExternalSignal::kLate);
  CHECK(prod.stats().external.stale_generations == desc.blocks.size());
  CHECK(prod.stats().external.leases_expired == 1);
}

TEST_CASE("vllm#46304: receive done and free in the same step, either order", "[external_kv][manager]") {
  for (int order = 0; order < 2; ++order) {
    Mgr m(config(16));
    const auto r = m.try_admit_external(1, toks(1, 13), 12);
    if (order == 0) {
      CHECK(m.complete_external_fill(r.ticket.fill_id, 3).signal == ExternalSignal::kApplied);
      m.free(1);
    } else {
      m.free(1);
      CHECK(m.complete_external_fill(r.ticket.fill_id, 3).signal == ExternalSignal::kLate);
    }
    CHECK(m.stats().blocks_used == 0);
    CHECK(m.stats().external.blocks_held == 0);
  }
}

TEST_CASE("TensorRT-LLM#12542 / LMCache#5248: leased or save-pinned blocks are never evicted or reused",
          "[external_kv][manager]") {
  Mgr m(config(12));
  compute(m, 1, toks(1, 16));
  compute(m, 2, toks(500, 16));
  const auto desc = m.finish_with_lease(1, fp(m), std::nullopt);
  const std::vector<std::uint32_t> pinned(m.block_ids(2).begin(), m.block_ids(2).end());
  const auto pin = m.pin_for_save(2);
  m.preempt(2);  // preempted while saving
  std::vector<SeqId> ids;
  for (auto b : pressure(m, 10, ids)) {
    CHECK(std::find(desc.blocks.begin(), desc.blocks.end(), b) == desc.blocks.end());
    CHECK(std::find(pinned.begin(), pinned.end(), b) == pinned.end());
  }
  for (std::size_t i = 0; i < desc.blocks.size(); ++i) CHECK(m.is_current_block(desc.blocks[i], desc.generations[i]));
  for (auto s : ids) m.free(s);
  CHECK(m.end_save(pin) == ExternalSignal::kApplied);
  CHECK(m.release_lease(desc.hold_id) == ExternalSignal::kApplied);
  CHECK(m.stats().blocks_used == 0);
}

TEST_CASE("partial failures: recompute keeps the valid prefix, fail frees the sequence - dedup at completion",
          "[external_kv][manager]") {
  Mgr m(config(32));
  const auto prompt = toks(1, 21);
  auto r = m.try_admit_external(1, prompt, 20);
  REQUIRE(r.ticket.num_blocks() == 5);
  const std::vector<std::size_t> failed{3, 2};
  const auto c = m.complete_external_fill(r.ticket.fill_id, failed);
  CHECK(c.num_valid_blocks == 2);
  CHECK(c.num_computed_tokens == 8);
  CHECK(m.num_built(1) == 8);
  CHECK(m.lookup(prompt) == 8);
  CHECK(build_step(m, {1}).slots.size() == 13);  // recomputed: tokens [8, 21)
  CHECK(m.lookup(prompt) == 20);
  m.free(1);

  const auto r2 = m.try_admit_external(2, toks(700, 21), 20);
  const auto c2 = m.complete_external_fill(r2.ticket.fill_id, 1, ExternalFailurePolicy::kFail);
  CHECK(c2.sequence_failed);
  CHECK_FALSE(m.contains(2));
  const auto r3 = m.try_admit_external(3, toks(900, 9), 8);
  CHECK(expect_error([&] { (void)m.complete_external_fill(r3.ticket.fill_id, 3); }, pagedkv::Errc::kInvalidArgument)
            .find("2 blocks per group, not 3") != std::string::npos);
  m.free(3);  // not quiescent: its fill's blocks become an orphan hold (no deadline: reap_external never called)
  CHECK(m.stats().external.orphan_holds == 1);
  CHECK(m.stats().blocks_used == 2);
  CHECK(m.reap_external(at(100000)) == 0);
  CHECK(m.complete_external_fill(r3.ticket.fill_id, 2).signal == ExternalSignal::kLate);

  // Dedup: the same prefix is computed locally while the fill is in flight; completion switches to it.
  const auto r4 = m.try_admit_external(4, toks(300, 9), 8);
  compute(m, 5, toks(300, 9));
  const auto dedup = m.stats().dedup_blocks;
  m.complete_external_fill(r4.ticket.fill_id, 2);
  CHECK(m.stats().dedup_blocks == dedup + 2);
  CHECK(std::equal(m.block_ids(4).begin(), m.block_ids(4).begin() + 2, m.block_ids(5).begin()));
  m.free(4);
  m.free(5);
  const auto s = m.stats();
  CHECK(s.blocks_used == 0);
  CHECK(s.external.fills_partial == 1);
  CHECK(s.external.fills_failed == 1);
  CHECK(s.external.fills_completed == 1);
}

TEST_CASE("admission: never fits vs not now, headroom, nothing external after the clamp", "[external_kv][manager]") {
  Mgr m(config(8));  // 7 usable blocks
  CHECK(m.try_admit_external(1, toks(1, 40), 39).admit.status == pagedkv::AdmitStatus::kNeverFits);
  const auto r = m.try_admit_external(1, toks(1, 9), 8, nullptr, {}, /*headroom_blocks=*/5);
  CHECK(r.admit.status == pagedkv::AdmitStatus::kNoCapacity);
  CHECK(r.admit.num_missing_blocks == 1);
  CHECK(m.stats().blocks_used == 0);
  const auto r2 = m.try_admit_external(1, toks(1, 9), 100);  // clamped to prompt_len - 1
  CHECK(r2.ticket.end_token == 8);
  const auto r3 = m.try_admit_external(2, toks(1, 1), 5);  // a one-token prompt: nothing external
  CHECK(r3.admit.admitted());
  CHECK(r3.ticket.fill_id == 0);
  // A duplicate id is an error even when the headroom would refuse the admission (found while writing the fuzzer's mirror).
  const auto used = m.stats().blocks_used;
  CHECK(expect_error([&] { (void)m.try_admit_external(1, toks(1, 9), 8, nullptr, {}, 100); },
                     pagedkv::Errc::kDuplicateSequence)
            .find('1') != std::string::npos);
  CHECK(m.stats().blocks_used == used);
  m.abort_sequence(1, true);
  m.free(2);
  CHECK(m.stats().blocks_used == 0);
}

TEST_CASE("explain_admit_external names the external hit the admission then takes", "[external_kv][manager]") {
  std::mt19937 rng(33);
  for (int round = 0; round < 200; ++round) {
    Mgr m(config(64));
    const auto len = static_cast<std::size_t>(1 + rng() % 30);
    const auto prompt = toks(1, len);
    const std::size_t cached = rng() % (len + 1);  // a computed prefix of `cached` tokens leaves its full blocks
    if (cached != 0) {
      compute(m, 99, std::vector<TokenId>(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(cached)));
      m.free(99);
    }
    const std::size_t offered = rng() % (len + 3);
    const auto x = m.explain_admit_external(prompt, offered);
    CHECK(x.local.hit_tokens == m.lookup(prompt));
    CHECK(x.external_tokens + x.clamped_tokens == offered);
    CHECK(x.local.hit_tokens + x.external_tokens <= std::max<std::size_t>(len - 1, x.local.hit_tokens));
    const auto r = m.try_admit_external(1, prompt, offered);
    REQUIRE(r.admit.admitted());
    CHECK(r.admit.num_cached_tokens == x.local.hit_tokens);
    CHECK(r.ticket.end_token - r.ticket.first_token == x.external_tokens);
    CHECK(r.ticket.num_blocks() == x.external_blocks);
    if (x.external_tokens != 0) {
      CHECK(r.ticket.first_block == x.first_external_block);
      CHECK(x.skipped_blocks == x.local.hit_tokens / 4);
      CHECK(m.complete_external_fill(r.ticket.fill_id, r.ticket.num_blocks()).num_computed_tokens ==
            x.computed_tokens());
    } else {
      CHECK(r.ticket.fill_id == 0);
    }
  }
}

TEST_CASE("two full-attention groups: per-group blocks in descriptors, plans and tickets", "[external_kv][manager]") {
  auto c = config(64);
  c.groups.resize(2);
  Mgr prod(c);
  Mgr cons(c);
  const auto prompt = toks(1, 14);
  REQUIRE(prod.try_admit(1, prompt).admitted());
  std::vector<std::int64_t> s0(14), s1(14);
  std::vector<pagedkv::BatchMetadataBuffers> bufs(2);
  bufs[0].slot_mapping = s0;
  bufs[1].slot_mapping = s1;
  const std::vector<SeqId> batch{1};
  prod.build_batch_metadata(batch, bufs);
  const auto desc = prod.finish_with_lease(1, fp(prod), std::nullopt);
  CHECK(desc.num_groups == 2);
  CHECK(desc.blocks.size() == 8);
  const auto plan = cons.plan_import(desc, fp(cons), prompt);
  CHECK(plan.num_blocks == 4);
  CHECK(plan.remote_blocks.size() == 8);
  CHECK(plan.remote_blocks[4] == desc.blocks[4]);  // group 1's first block
  const auto r = cons.try_admit_external(2, prompt, plan.end_token);
  CHECK(r.ticket.blocks.size() == 8);
  CHECK(std::equal(r.ticket.group_blocks(1).begin(), r.ticket.group_blocks(1).end(), cons.block_ids(2, 1).begin()));
  const auto done = cons.complete_external_fill(r.ticket.fill_id, 4);
  CHECK(done.num_computed_tokens == 13);
  CHECK(cons.lookup(prompt) == 12);
  CHECK(cons.prefix_index(1).size() == 3);
  cons.free(2);
  CHECK(prod.release_lease(desc.hold_id) == ExternalSignal::kApplied);
  CHECK(prod.stats().blocks_used == 0);
  CHECK(cons.stats().blocks_used == 0);
}

TEST_CASE("a save pin refuses a recurrent group, naming it", "[external_kv][manager]") {
  // A recurrent group takes part in fills and hand-offs (test_external_kv_recurrent.cpp), coarse pages too
  // (test_external_kv_coarse.cpp); a save pin cannot keep a working state that every build rewrites in place.
  auto rc = config(32);
  rc.groups.resize(2);
  rc.groups[1].kind = pagedkv::AttentionKind::kRecurrent;
  rc.groups[1].window_tokens = 8;
  Mgr r(rc);
  REQUIRE(r.try_admit(1, toks(1, 17)).admitted());
  const auto used = r.stats().blocks_used;
  CHECK(expect_error([&] { (void)r.pin_for_save(1); }, pagedkv::Errc::kInvalidArgument)
            .find("group 1 is recurrent: a save pin cannot keep a working state") != std::string::npos);
  CHECK(r.stats().blocks_used == used);
  CHECK(r.stats().external.holds_active == 0);
  CHECK(r.try_admit_external(2, toks(1, 9), 8).ticket.fill_id != 0);
}

TEST_CASE("vLLM identities: sha256_cbor hashes in the descriptor", "[external_kv][manager]") {
  Mgr prod(config(32));
  Mgr cons(config(32));
  const auto prompt = toks(1, 12);
  compute(prod, 1, prompt);
  const auto f = prod.layout_fingerprint("nhd", "bf16", 8, 128, pagedkv::BlockIdentityConvention::kVllmSha256Cbor);
  const auto desc = prod.finish_with_lease(1, f, std::nullopt);
  const std::vector<std::uint32_t> t(prompt.begin(), prompt.end());
  const auto want = pagedkv::identity::vllm_request_block_hashes(t, 4, {}, pagedkv::identity::vllm_none_hash());
  REQUIRE(desc.identities.size() == 3);
  for (std::size_t i = 0; i < 3; ++i) CHECK(desc.identities[i] == want[i]);
  const auto fc = cons.layout_fingerprint("nhd", "bf16", 8, 128, pagedkv::BlockIdentityConvention::kVllmSha256Cbor);
  CHECK(cons.plan_import(desc, fc, prompt).num_blocks == 3);
  CHECK(expect_error([&] { (void)cons.plan_import(desc, fp(cons), prompt); }, pagedkv::Errc::kInvalidArgument)
            .find("hash_algorithm") != std::string::npos);
}

}  // namespace

namespace {

// Randomized: one manager as producer and consumer at once (its own descriptors are imported by others of its
// sequences), with random fills, completions with partial failures under both policies, aborts quiescent or not,
// frees and preemptions mid-fill, leases, save pins, heartbeats, reaps, late / duplicate / unknown signals and
// builds. After every operation: refcount = table holders + the model's external references, no fill block is
// registered (so no hit can land on one), no block of a fill or hold is in another sequence's table (no reuse while
// a transfer holds it); at quiescence nothing is held.
TEST_CASE("model-based: the manager's external KV under random operations", "[external_kv][manager][model]") {
  for (std::uint32_t seed = 1; seed <= 12; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
    Mgr m(config(24 + pick(24)));
    m.set_orphan_timeout(seconds(5));
    long now = 0;
    m.reap_external(at(now));
    struct Fill {
      SeqId seq;
      std::vector<std::uint32_t> blocks;
    };
    struct Hold {
      std::vector<std::uint32_t> blocks;
      std::optional<long> deadline;
    };
    std::map<std::uint64_t, Fill> fills;     // live fills
    std::map<std::uint64_t, Hold> orphans;   // by fill id
    std::map<std::uint64_t, Hold> holds;     // leases and pins by id
    std::vector<SeqId> live;
    std::uint64_t max_id = 0;
    SeqId next = 1;
    const std::vector<std::vector<TokenId>> prompts{toks(1, 13), toks(1, 22), toks(40, 9), toks(1, 30)};
    auto drop_seq = [&](SeqId s) { live.erase(std::find(live.begin(), live.end(), s)); };
    auto fill_of = [&](SeqId s) -> std::uint64_t {
      for (auto& [id, f] : fills) {
        if (f.seq == s) return id;
      }
      return 0;
    };
    for (int step = 0; step < 300; ++step) {
      const std::size_t op = pick(10);
      if (op <= 1 || live.empty()) {  // admission, with external tokens or plain
        const auto& p = prompts[pick(prompts.size())];
        const SeqId s = next++;
        const auto r = m.try_admit_external(s, p, pick(p.size() + 2), nullptr, {}, pick(3));
        if (!r.admit.admitted()) continue;
        live.push_back(s);
        if (r.ticket.fill_id != 0) {
          fills[r.ticket.fill_id] = {s, r.ticket.blocks};
          max_id = std::max(max_id, r.ticket.fill_id);
        }
      } else if (op == 2 && !fills.empty()) {  // completion, maybe partial, either policy
        auto it = std::next(fills.begin(), pick(fills.size()));
        const std::uint64_t id = it->first;
        const SeqId s = it->second.seq;
        const std::size_t nb = it->second.blocks.size();  // one group
        const std::size_t valid = pick(nb + 1);
        const auto policy = pick(2) == 0 ? ExternalFailurePolicy::kRecompute : ExternalFailurePolicy::kFail;
        fills.erase(it);
        const std::size_t built = m.num_built(s);
        const auto c = m.complete_external_fill(id, valid, policy);
        REQUIRE(c.signal == ExternalSignal::kApplied);
        const bool failed = policy == ExternalFailurePolicy::kFail && valid < nb;
        REQUIRE(c.sequence_failed == failed);
        REQUIRE(m.contains(s) == !failed);
        if (failed) {
          drop_seq(s);
        } else {
          if (valid < nb) REQUIRE(m.num_built(s) == built + valid * 4);  // the valid prefix, block aligned
          REQUIRE(m.num_built(s) == c.num_computed_tokens);
          REQUIRE(c.num_computed_tokens < m.sequence(s).num_prompt_tokens);  // the last prompt token is computed
        }
      } else if (op == 3) {  // a signal for an id that is not a live fill
        const std::uint64_t id = pick(max_id + 3);
        if (fills.contains(id)) continue;
        const auto c = m.complete_external_fill(id, pick(3));
        if (orphans.contains(id)) {
          REQUIRE(c.signal == ExternalSignal::kLate);
          orphans.erase(id);
        } else {
          REQUIRE(c.signal != ExternalSignal::kApplied);
        }
      } else if (op == 4) {  // free, preempt or abort any live sequence
        const SeqId s = live[pick(live.size())];
        const std::uint64_t f = fill_of(s);
        const std::size_t how = pick(3);
        const bool quiescent = how == 2 && pick(2) == 0;
        if (how == 0) {
          m.free(s);
        } else if (how == 1) {
          m.preempt(s);
        } else {
          m.abort_sequence(s, quiescent);
        }
        if (f != 0) {
          if (!quiescent) orphans[f] = {fills[f].blocks, now + 5};
          fills.erase(f);
        }
        drop_seq(s);
      } else if (op == 5) {  // build every sequence that waits for nothing
        std::vector<SeqId> batch;
        for (SeqId s : live) {
          if (fill_of(s) == 0 && !m.pending_slots(s).empty()) batch.push_back(s);
        }
        build_step(m, batch);
      } else if (op == 6) {  // producer: finish with a lease, or pin for a save
        const SeqId s = live[pick(live.size())];
        if (fill_of(s) != 0 || !m.pending_slots(s).empty()) continue;
        const std::optional<long> dl = pick(3) == 0 ? std::nullopt : std::optional<long>(now + 1 + long(pick(10)));
        if (pick(2) == 0) {
          const auto d = m.finish_with_lease(s, fp(m), dl ? std::optional(at(*dl)) : std::nullopt);
          holds[d.hold_id] = {d.blocks, dl};
          max_id = std::max(max_id, d.hold_id);
          drop_seq(s);
        } else {
          std::vector<std::uint32_t> blocks;
          const std::size_t n = m.num_built(s) / 4;
          for (auto b : m.block_ids(s).first(n)) blocks.push_back(b);
          const auto id = m.pin_for_save(s, dl ? std::optional(at(*dl)) : std::nullopt);
          holds[id] = {blocks, dl};
          max_id = std::max(max_id, id);
        }
      } else if (op == 7 && !holds.empty()) {  // read-done / save done, or a heartbeat
        auto it = std::next(holds.begin(), pick(holds.size()));
        if (pick(2) == 0) {
          REQUIRE(m.release_lease(it->first) == ExternalSignal::kApplied);
          holds.erase(it);
        } else {
          it->second.deadline = now + 1 + long(pick(10));
          REQUIRE(m.extend_lease(it->first, at(*it->second.deadline)) == ExternalSignal::kApplied);
        }
      } else if (op == 8) {  // time passes
        now += long(pick(4));
        std::size_t want = 0;
        for (auto* map : {&holds, &orphans}) {
          for (auto it = map->begin(); it != map->end();) {
            if (it->second.deadline && *it->second.deadline <= now) {
              it = map->erase(it);
              ++want;
            } else {
              ++it;
            }
          }
        }
        REQUIRE(m.reap_external(at(now)) == want);
      } else {  // pressure: fill the pool, then free those sequences
        std::vector<SeqId> ids;
        pressure(m, 1'000'000 + step * 100, ids);
        for (auto s : ids) m.free(s);
      }

      // Invariants.
      std::vector<std::uint32_t> ext(m.allocator().num_blocks(), 0), tab(m.allocator().num_blocks(), 0);
      for (auto& [id, f] : fills) {
        for (auto b : f.blocks) ++ext[b];
      }
      for (auto* map : {&holds, &orphans}) {
        for (auto& [id, h] : *map) {
          for (auto b : h.blocks) ++ext[b];
        }
      }
      m.for_each_sequence([&](SeqId, std::span<const std::uint32_t> blocks, std::size_t) {
        for (auto b : blocks) ++tab[b];
      });
      for (std::uint32_t b = 1; b < m.allocator().num_blocks(); ++b) {
        REQUIRE(m.allocator().refcount(b) == tab[b] + ext[b]);
      }
      for (auto& [id, f] : fills) {
        for (auto b : f.blocks) {
          REQUIRE_FALSE(m.prefix_index().hash_of(b));  // never matchable
          REQUIRE(tab[b] == 1);                         // only its own table: never handed to another sequence
        }
      }
      for (auto& [id, h] : orphans) {
        for (auto b : h.blocks) REQUIRE(tab[b] == 0);  // an orphan's blocks are in no table
      }
      const auto s = m.stats().external;
      REQUIRE(s.fills_in_flight == fills.size());
      REQUIRE(s.holds_active == holds.size() + orphans.size());
    }
    // Quiescence.
    for (SeqId s : std::vector<SeqId>(live)) m.abort_sequence(s, true);
    for (auto& [id, h] : holds) REQUIRE(m.release_lease(id) == ExternalSignal::kApplied);
    for (auto& [id, h] : orphans) REQUIRE(m.complete_external_fill(id, 0).signal == ExternalSignal::kLate);
    const auto st = m.stats();
    if (seed == 1) {
      INFO("fills " << st.external.fills_started << " completed " << st.external.fills_completed << " partial "
                    << st.external.fills_partial << " failed " << st.external.fills_failed << " aborted "
                    << st.external.fills_aborted << " orphans " << st.external.orphan_holds << " expired "
                    << st.external.orphans_expired << " leases " << st.external.leases_started << " expired "
                    << st.external.leases_expired << " pins " << st.external.save_pins_started << " late "
                    << st.external.late_signals << " dup " << st.external.duplicate_signals << " unknown "
                    << st.external.unknown_signals << " dedup " << st.dedup_blocks);
      CHECK(st.external.fills_partial + st.external.fills_failed > 0);
      CHECK(st.external.orphans_expired > 0);
      CHECK(st.external.leases_started > 0);
    }
    CHECK(st.blocks_used == 0);
    CHECK(st.external.blocks_held == 0);
    CHECK(st.external.holds_active == 0);
  }
}

}  // namespace
