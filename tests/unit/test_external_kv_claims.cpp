// Tests of the producer's batch claim check (check_claim), the import plan paired with its admission
// (try_admit_external with an ImportPlan: blocks counted when admitted, never at plan time) and eviction of a cached
// block by id (evict_cached_block: vLLM's evict_blocks after a failed load). Issue 33, second round.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
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

using pagedkv::ClaimStatus;
using pagedkv::ExternalSignal;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::build_step;
using pagedkv_test::expect_error;
using Mgr = pagedkv::KVCacheManager<>;

pagedkv::CacheConfig config(std::size_t num_blocks, std::uint32_t block_size = 4) {
  pagedkv::CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.enable_events = true;
  return c;
}
pagedkv::KvLayoutFingerprint fp(const Mgr& m) { return m.layout_fingerprint("nhd", "bf16", 8, 128); }

std::vector<TokenId> random_prompt(std::mt19937& rng, std::size_t n) {
  std::uniform_int_distribution<TokenId> d(1, 50000);
  std::vector<TokenId> p(n);
  for (auto& t : p) t = d(rng);
  return p;
}

void compute(Mgr& m, SeqId seq, const std::vector<TokenId>& prompt) {
  REQUIRE(m.try_admit(seq, prompt).admitted());
  build_step(m, {seq});
}

TEST_CASE("check_claim names the first failing entry and why, on random claims", "[external_kv][claim]") {
  std::mt19937 rng(20261129);
  for (int round = 0; round < 40; ++round) {
    CAPTURE(round);
    Mgr prod(config(64));
    const auto prompt = random_prompt(rng, 5 + rng() % 30);
    compute(prod, 1, prompt);
    const auto d = prod.finish_with_lease(1, fp(prod), std::nullopt);
    const std::size_t n = d.blocks.size();
    // A random subset in random order of the hold's blocks at their generations: accepted.
    std::vector<std::size_t> idx(n);
    for (std::size_t i = 0; i < n; ++i) idx[i] = i;
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(1 + rng() % n);
    std::vector<std::uint32_t> blocks, gens;
    for (std::size_t i : idx) {
      blocks.push_back(d.blocks[i]);
      gens.push_back(d.generations[i]);
    }
    auto c = prod.check_claim(d.hold_id, blocks, gens);
    CHECK(c.ok());
    CHECK(c.entry == blocks.size());
    // Corrupt one random entry: the answer names exactly it.
    const std::size_t bad = rng() % blocks.size();
    auto gens2 = gens;
    gens2[bad] += 1 + static_cast<std::uint32_t>(rng() % 5);
    const auto stale_before = prod.stats().external.stale_generations;
    c = prod.check_claim(d.hold_id, blocks, gens2);
    CHECK(c.status == ClaimStatus::kStaleGeneration);
    CHECK(c.entry == bad);
    CHECK(c.current_generation == gens[bad]);
    CHECK(prod.stats().external.stale_generations == stale_before + 1);
    auto blocks2 = blocks;
    std::uint32_t other = 1;
    while (std::find(d.blocks.begin(), d.blocks.end(), other) != d.blocks.end()) ++other;
    blocks2[bad] = other;
    c = prod.check_claim(d.hold_id, blocks2, gens);
    CHECK(c.status == ClaimStatus::kNotInHold);
    CHECK(c.entry == bad);
    blocks2[bad] = 9999;  // out of range: not in the hold either
    CHECK(prod.check_claim(d.hold_id, blocks2, gens).status == ClaimStatus::kNotInHold);
    CHECK(prod.check_claim(d.hold_id + 1, blocks, gens).status == ClaimStatus::kUnknownHold);
    // is_current_block keeps working, entry by entry.
    for (std::size_t i = 0; i < blocks.size(); ++i) CHECK(prod.is_current_block(blocks[i], gens[i]));
    // Once the lease is released the whole claim is refused by its hold, and every old generation is stale.
    CHECK(prod.release_lease(d.hold_id) == ExternalSignal::kApplied);
    CHECK(prod.check_claim(d.hold_id, blocks, gens).status == ClaimStatus::kUnknownHold);
    for (std::size_t i = 0; i < blocks.size(); ++i) CHECK_FALSE(prod.is_current_block(blocks[i], gens[i]));
  }
  Mgr m(config(16));
  const std::vector<std::uint32_t> b{1, 2};
  const std::vector<std::uint32_t> g{0};
  CHECK(expect_error([&] { (void)m.check_claim(1, b, g); }, pagedkv::Errc::kInvalidArgument)
            .find("2 blocks but 1 generations") != std::string::npos);
}

TEST_CASE("check_claim: a lease's stale reference after the block is reused under a second lease",
          "[external_kv][claim]") {
  Mgr prod(config(8));
  std::mt19937 rng(7);
  const auto p1 = random_prompt(rng, 12);
  compute(prod, 1, p1);
  const auto d1 = prod.finish_with_lease(1, fp(prod), std::nullopt);
  REQUIRE(prod.release_lease(d1.hold_id) == ExternalSignal::kApplied);
  // Evict everything by pressure; a new sequence reuses the blocks under a new lease.
  const auto p2 = random_prompt(rng, 28);
  compute(prod, 2, p2);
  const auto d2 = prod.finish_with_lease(2, fp(prod), std::nullopt);
  std::vector<std::uint32_t> reused, old_gens;
  for (std::size_t i = 0; i < d1.blocks.size(); ++i) {
    if (std::find(d2.blocks.begin(), d2.blocks.end(), d1.blocks[i]) != d2.blocks.end()) {
      reused.push_back(d1.blocks[i]);
      old_gens.push_back(d1.generations[i]);
    }
  }
  REQUIRE(!reused.empty());
  const auto c = prod.check_claim(d2.hold_id, reused, old_gens);
  CHECK(c.status == ClaimStatus::kStaleGeneration);
  CHECK(c.entry == 0);
  CHECK(c.current_generation != old_gens[0]);
}

TEST_CASE("try_admit_external with the plan: counted when admitted, refused when the local hit changed",
          "[external_kv][plan]") {
  std::mt19937 rng(99);
  for (int round = 0; round < 30; ++round) {
    CAPTURE(round);
    Mgr prod(config(64));
    Mgr cons(config(64));
    const auto prompt = random_prompt(rng, 6 + rng() % 30);
    compute(prod, 1, prompt);
    const auto d = prod.finish_with_lease(1, fp(prod), std::nullopt);
    // The consumer holds a random part of the prefix already.
    // At most (size - 1) / 4 blocks, so the local prompt (those blocks and one token) fits inside the prompt.
    const std::size_t local_blocks = rng() % ((prompt.size() - 1) / 4 + 1);
    if (local_blocks != 0) {
      compute(cons, 50, std::vector<TokenId>(prompt.begin(), prompt.begin() + local_blocks * 4 + 1));
      cons.free(50);
    }
    const auto plan = cons.plan_import(d, fp(cons), prompt);
    CHECK(cons.stats().external.blocks_transferred == 0);
    CHECK(cons.stats().external.blocks_skipped == 0);
    // A failed admission (a full pool) counts nothing.
    Mgr tiny(config(2));
    const auto plan_tiny = tiny.plan_import(d, fp(tiny), prompt);
    if (plan_tiny.num_blocks > 1) {
      CHECK(tiny.try_admit_external(3, prompt, plan_tiny).admit.status == pagedkv::AdmitStatus::kNeverFits);
      CHECK(tiny.stats().external.blocks_transferred == 0);
    }
    const auto r = cons.try_admit_external(2, prompt, plan);
    REQUIRE(r.admit.admitted());
    CHECK(r.admit.num_cached_tokens == plan.first_token);
    if (plan.num_blocks != 0) {
      REQUIRE(r.ticket.fill_id != 0);
      CHECK(r.ticket.first_block == plan.first_block);
      CHECK(r.ticket.num_blocks() == plan.num_blocks);
      CHECK(prod.check_claim(d.hold_id, plan.remote_blocks, plan.remote_generations).ok());
      CHECK(cons.complete_external_fill(r.ticket.fill_id, plan.num_blocks).signal == ExternalSignal::kApplied);
    } else {
      CHECK(r.ticket.fill_id == 0);
    }
    CHECK(cons.stats().external.blocks_transferred == plan.num_blocks);
    CHECK(cons.stats().external.blocks_skipped == plan.skipped_blocks);
    CHECK(cons.num_built(2) == plan.end_token);
  }
  // The local hit grows between plan and admission: refused, naming both hits, nothing changed.
  Mgr prod(config(32));
  Mgr cons(config(32));
  const auto prompt = random_prompt(rng, 21);
  compute(prod, 1, prompt);
  const auto d = prod.finish_with_lease(1, fp(prod), std::nullopt);
  const auto plan = cons.plan_import(d, fp(cons), prompt);
  REQUIRE(plan.first_token == 0);
  compute(cons, 50, std::vector<TokenId>(prompt.begin(), prompt.begin() + 9));  // 2 blocks registered meanwhile
  const auto before = cons.stats();
  CHECK(expect_error([&] { (void)cons.try_admit_external(2, prompt, plan); }, pagedkv::Errc::kInvalidArgument)
            .find("local prefix hit changed since the import plan (0 tokens then, 8 now)") != std::string::npos);
  CHECK_FALSE(cons.contains(2));
  CHECK(cons.stats().blocks_used == before.blocks_used);
  CHECK(cons.stats().external.fills_started == 0);
  CHECK(cons.stats().external.blocks_transferred == 0);
  // A plan of another pool shape is refused.
  auto bad = plan;
  bad.num_groups = 2;
  CHECK(expect_error([&] { (void)cons.try_admit_external(2, prompt, bad); }, pagedkv::Errc::kInvalidArgument)
            .find("does not fit a prompt of 21 tokens") != std::string::npos);
}

}  // namespace

namespace {

std::vector<pagedkv::KVEvent> drain(Mgr& m) {
  std::vector<pagedkv::KVEvent> ev;
  m.drain_events(ev);
  return ev;
}

TEST_CASE("evict_cached_block: the hash leaves the index now, cached or still in a table", "[external_kv][evict]") {
  std::mt19937 rng(4242);
  for (int round = 0; round < 30; ++round) {
    CAPTURE(round);
    Mgr m(config(64));
    const auto prompt = random_prompt(rng, 9 + rng() % 30);
    compute(m, 1, prompt);
    const std::size_t full = prompt.size() / 4;
    const auto table = m.block_ids(1);
    const std::vector<std::uint32_t> blocks(table.begin(), table.end());
    const bool keep_live = rng() % 2 == 0;
    if (!keep_live) m.free(1);
    (void)drain(m);
    const std::size_t victim = rng() % full;  // a full (registered) block
    const auto before = m.stats();
    CHECK(m.lookup(prompt) == (prompt.size() - 1) / 4 * 4);
    REQUIRE(m.evict_cached_block(blocks[victim]));
    // Never matchable again: the hit ends before it.
    CHECK(m.lookup(prompt) == victim * 4);
    const auto ev = drain(m);
    REQUIRE(ev.size() == 1);
    CHECK(ev[0].type == pagedkv::KVEventType::kBlockRemoved);
    const auto after = m.stats();
    if (keep_live) {
      CHECK(m.block_ids(1)[victim] == blocks[victim]);  // stays in the table
      CHECK(m.allocator().refcount(blocks[victim]) == 1);
      CHECK(after.blocks_cached == before.blocks_cached);
      m.free(1);
      CHECK(m.stats().blocks_free == after.blocks_free + 1 + (prompt.size() % 4 != 0 ? 1 : 0));
    } else {
      CHECK(after.blocks_cached == before.blocks_cached - 1);
      CHECK(after.blocks_free == before.blocks_free + 1);
    }
    CHECK_FALSE(m.allocator().is_hashed(blocks[victim]));
    CHECK_FALSE(m.evict_cached_block(blocks[victim]));  // a second eviction finds nothing
    CHECK(drain(m).empty());
    // A new sequence of the same prompt recomputes from the victim on and registers it afresh.
    compute(m, 2, prompt);
    CHECK(m.lookup(prompt) == (prompt.size() - 1) / 4 * 4);
    m.free(2);
    CHECK(m.stats().blocks_used == 0);
  }
  Mgr m(config(16));
  CHECK_FALSE(m.evict_cached_block(3));  // free: nothing to evict
  expect_error([&] { (void)m.evict_cached_block(0); }, pagedkv::Errc::kBlockOutOfRange);
  CHECK(expect_error([&] { (void)m.evict_cached_block(16); }, pagedkv::Errc::kBlockOutOfRange)
            .find("block 16 outside [1, 16)") != std::string::npos);
}

TEST_CASE("evict_cached_block on a leased block: the lease keeps it, no hit serves it", "[external_kv][evict]") {
  Mgr prod(config(32));
  std::mt19937 rng(5);
  const auto prompt = random_prompt(rng, 17);
  compute(prod, 1, prompt);
  const auto d = prod.finish_with_lease(1, fp(prod), std::nullopt);
  REQUIRE(prod.evict_cached_block(d.blocks[2]));
  CHECK(prod.lookup(prompt) == 8);
  CHECK(prod.check_claim(d.hold_id, d.blocks, d.generations).ok());  // the lease still holds every block
  CHECK(prod.release_lease(d.hold_id) == ExternalSignal::kApplied);
  CHECK(prod.stats().blocks_used == 0);
  CHECK(prod.lookup(prompt) == 8);
}

}  // namespace
