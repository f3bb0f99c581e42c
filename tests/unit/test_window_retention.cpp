// tests/unit/test_window_retention.cpp: sparse prefix-cache retention of sliding-window groups
// (CacheConfig::window_retention_interval; vLLM 0.32's prefix_cache_retention_interval, docs/vllm-swa-retention.md).
//
//  - [vllm]    vLLM's worked example (docs/vllm-swa-retention.md section 3, run on vLLM's own Scheduler): the window
//              blocks each request registers and the hits of the next ones, under retention 0, 64 and unset, with
//              and without the shared-prefix junction, and a window-only pool;
//  - [random]  random pools, windows, intervals, alignments, boundaries, chunk sizes and decode lengths: the window
//              group registers exactly the blocks an independent oracle marks (ranges marked per boundary and per
//              interval multiple, not the rule's modular form), whatever the chunking;
//  - [errors]  bad options and configurations are typed errors naming the value, nothing changed;
//  - [release] out-of-window blocks are released last first (vLLM's order), so the cached ones are evicted in it.
#include <catch2/catch.hpp>

#include <cstdint>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "support/manager_instances.hpp"
#include "test_support.hpp"

namespace {

using pagedkv::AttentionKind;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Manager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;

// Group 0 full attention (block 16), group 1 a sliding window of 32 tokens: need = 2 blocks (the section 3 config).
pagedkv::CacheConfig fa_swa(std::optional<std::size_t> interval, std::uint32_t window = 32) {
  pagedkv::CacheConfig c;
  c.num_blocks = 64;
  c.block_size = 16;
  c.groups.resize(2);
  c.groups[1] = {AttentionKind::kSlidingWindow, window, 1};
  c.window_retention_interval = interval;
  return c;
}

// The full blocks of `seq` that group g's prefix index holds under the sequence's hashes.
std::set<std::size_t> cached_blocks(const Manager& m, SeqId seq, std::size_t g) {
  std::set<std::size_t> out;
  const auto& hashes = m.sequence(seq).hashes;
  for (std::size_t i = 0; i < hashes.size(); ++i) {
    if (m.prefix_index(g).find(hashes[i])) out.insert(i);
  }
  return out;
}

// One step computing every pending position of `seq` (each group's slot mapping and copies).
void step(Manager& m, SeqId seq) { pagedkv_test::step_groups(m, seq); }

// Admit `prompt` as `seq` (the hit the cache gives, junction `junction`), compute it in one step, then `decode`
// tokens one step each.
void run(Manager& m, SeqId seq, const std::vector<TokenId>& prompt, std::size_t junction = 0, std::size_t decode = 0) {
  pagedkv::AdmitOptions o;
  o.shared_prefix_boundary = junction;
  REQUIRE(m.try_admit(seq, prompt, nullptr, o).admitted());
  step(m, seq);
  for (std::size_t t = 0; t < decode; ++t) {
    const TokenId tok = 9000 + static_cast<TokenId>(t);
    REQUIRE(m.try_append(seq, std::span<const TokenId>(&tok, 1)).status == pagedkv::AppendStatus::kOk);
    step(m, seq);
  }
}

std::size_t hit_of(const Manager& m, const std::vector<TokenId>& prompt) {
  return m.query_admit(prompt).num_cached_tokens;
}

std::vector<TokenId> concat(std::vector<TokenId> a, const std::vector<TokenId>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The prompts of vLLM's worked example: A = tokens 100..199 (P = 100); B = A's first 64 + 20 others; C = A's first
// 64 + 20 others (not B's).
struct Example {
  std::vector<TokenId> A = pagedkv_test::toks(100, 100);
  std::vector<TokenId> shared = std::vector<TokenId>(A.begin(), A.begin() + 64);
  std::vector<TokenId> B = concat(shared, pagedkv_test::toks(500, 20));
  std::vector<TokenId> C = concat(shared, pagedkv_test::toks(700, 20));
};

}  // namespace

TEST_CASE("retention 0: vLLM's worked example (the replay tail, the junction, the hits)", "[window_retention][vllm]") {
  const Example e;
  const auto& [A, shared, B, C] = e;

  SECTION("with B's junction pinned, as vLLM's scheduler stores it") {
    Manager m(fa_swa(0));
    run(m, 1, A, 0, 3);
    // A registers only the tail that ends at floor16(99) = 96: blocks 4 and 5 (A@80, A@96); full attention all six.
    CHECK(cached_blocks(m, 1, 1) == std::set<std::size_t>{4, 5});
    CHECK(cached_blocks(m, 1, 0) == std::set<std::size_t>{0, 1, 2, 3, 4, 5});
    m.free(1);
    // B: full attention has 64 cached, the window none of blocks 2-3: hit 0 (vLLM: hit 0, J = 64).
    CHECK(hit_of(m, B) == 0);
    run(m, 2, B, 64, 3);
    // B registers the junction's tail {2, 3} and its replay tail (floor16(83) = 80: {3, 4}).
    CHECK(cached_blocks(m, 2, 1) == std::set<std::size_t>{2, 3, 4});
    m.free(2);
    // C hits 64 on B's junction blocks and registers only its replay tail's block past the hit.
    CHECK(hit_of(m, C) == 64);
    run(m, 3, C, 0, 3);
    CHECK(cached_blocks(m, 3, 1) == std::set<std::size_t>{2, 3, 4});
    m.free(3);
    // A resent hits 96 on its replay tail.
    CHECK(hit_of(m, A) == 96);
  }
  SECTION("without the junction, C misses as vLLM's does when J is not stored") {
    Manager m(fa_swa(0));
    run(m, 1, A, 0, 3);
    m.free(1);
    run(m, 2, B, 0, 3);
    CHECK(cached_blocks(m, 2, 1) == std::set<std::size_t>{3, 4});
    m.free(2);
    CHECK(hit_of(m, C) == 0);
  }
  SECTION("a readmission keeps its original prompt's replay boundary") {
    // A preempted request readmitted with its 20 outputs as prompt (120 tokens): vLLM's replay boundary is still
    // request.num_prompt_tokens - 1 = 99.
    Manager m(fa_swa(0));
    const auto A3 = concat(A, pagedkv_test::toks(9000, 20));
    pagedkv::AdmitOptions o;
    o.prompt_retention_tokens = 100;
    REQUIRE(m.try_admit(1, A3, nullptr, o).admitted());
    step(m, 1);
    CHECK(cached_blocks(m, 1, 1) == std::set<std::size_t>{4, 5});
    m.free(1);
    Manager d(fa_swa(0));  // the default boundary: the admitted prompt's, 119
    REQUIRE(d.try_admit(1, concat(A, pagedkv_test::toks(9000, 20)), nullptr, {}).admitted());
    step(d, 1);
    CHECK(cached_blocks(d, 1, 1) == std::set<std::size_t>{5, 6});  // P = 120: floor16(119) = 112
  }
}

TEST_CASE("retention 64 and unset: vLLM's worked example", "[window_retention][vllm]") {
  const Example e;
  const auto& [A, shared, B, C] = e;
  SECTION("64: the segment tail {2, 3} and the replay tail {4, 5}; B and C hit 64 with no junction") {
    Manager m(fa_swa(64));
    run(m, 1, A, 0, 3);
    CHECK(cached_blocks(m, 1, 1) == std::set<std::size_t>{2, 3, 4, 5});
    m.free(1);
    CHECK(hit_of(m, B) == 64);
    run(m, 2, B, 0, 3);
    CHECK(cached_blocks(m, 2, 1) == std::set<std::size_t>{2, 3, 4});
    m.free(2);
    CHECK(hit_of(m, C) == 64);
    CHECK(hit_of(m, A) == 96);
  }
  SECTION("unset: every block (dense), as vLLM's None with the alignment at the block size") {
    Manager m(fa_swa(std::nullopt));
    run(m, 1, A, 0, 3);
    CHECK(cached_blocks(m, 1, 1) == std::set<std::size_t>{0, 1, 2, 3, 4, 5});
    m.free(1);
    CHECK(hit_of(m, B) == 64);
  }
  SECTION("an interval whose tails cover every block is dense (need 2 >= 32 / 16)") {
    Manager m(fa_swa(32));
    run(m, 1, A, 0, 3);
    CHECK(cached_blocks(m, 1, 1) == std::set<std::size_t>{0, 1, 2, 3, 4, 5});
  }
}

TEST_CASE("retention 0 in a window-only pool: each request keeps its replay tail", "[window_retention][vllm]") {
  // vLLM's run_0_pure: B and C miss and recompute; each registers its replay tail {3, 4}; A resent hits 96.
  pagedkv::CacheConfig c;
  c.num_blocks = 64;
  c.block_size = 16;
  c.groups = {{AttentionKind::kSlidingWindow, 32, 1}};
  c.window_retention_interval = 0;
  Manager m(c);
  const Example e;
  const auto& [A, shared, B, C] = e;
  run(m, 1, A, 0, 3);
  CHECK(cached_blocks(m, 1, 0) == std::set<std::size_t>{4, 5});
  m.free(1);
  CHECK(hit_of(m, B) == 0);
  run(m, 2, B, 0, 3);
  CHECK(cached_blocks(m, 2, 0) == std::set<std::size_t>{3, 4});
  m.free(2);
  CHECK(hit_of(m, A) == 96);
}

TEST_CASE("random pools: the window group registers exactly the oracle's blocks, whatever the chunking",
          "[window_retention][random]") {
  std::mt19937 rng(20261130u);
  std::size_t checked = 0, kept = 0, dropped = 0, eagle_kept = 0, eagle_missed = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const std::uint32_t bs = (rng() % 2 == 0) ? 4 : 8;
    const std::uint32_t W = 1 + static_cast<std::uint32_t>(rng() % (5 * bs));
    const std::size_t A = bs * (1 + rng() % 2);
    const std::size_t I = A * (rng() % 4);  // 0 = boundaries only
    pagedkv::CacheConfig c;
    c.num_blocks = 200;
    c.block_size = bs;
    const bool window_only = rng() % 4 == 0;
    c.groups.resize(window_only ? 1 : 2);
    const std::size_t g = window_only ? 0 : 1;
    c.groups[g] = {AttentionKind::kSlidingWindow, W, 1};
    c.window_retention_interval = I;
    c.window_retention_alignment = A == bs && rng() % 2 == 0 ? 0 : A;
    const bool eagle = rng() % 3 == 0;  // EAGLE: tails one block longer, ending one block later; EAGLE's boundaries
    c.window_retention_eagle = eagle;
    Manager m(c);
    const std::size_t P = 1 + rng() % (12 * bs);
    const std::size_t orig = 1 + rng() % P;  // the original prompt (a readmission's) or P itself
    const std::size_t J = rng() % 3 == 0 ? 0 : rng() % (P + 1);
    const std::size_t decode = rng() % (3 * bs);
    const auto prompt = pagedkv_test::toks(static_cast<TokenId>(100000 * (trial + 1)), P);
    pagedkv::AdmitOptions o;
    if (orig != P || rng() % 2 == 0) o.prompt_retention_tokens = orig;
    o.shared_prefix_boundary = J;
    // Chunked: reserve a random chunk, build, reserve the next...
    const std::size_t chunk = 1 + rng() % (3 * bs);
    o.num_reserved_tokens = chunk;
    REQUIRE(m.try_admit(1, prompt, nullptr, o).admitted());
    step(m, 1);
    while (m.num_tokens(1) < P) {
      REQUIRE(m.try_reserve(1, std::min(chunk, P - m.num_tokens(1))).status == pagedkv::AppendStatus::kOk);
      step(m, 1);
    }
    for (std::size_t t = 0; t < decode; ++t) {
      const TokenId tok = static_cast<TokenId>(7 + t);
      REQUIRE(m.try_append(1, std::span<const TokenId>(&tok, 1)).status == pagedkv::AppendStatus::kOk);
      step(m, 1);
    }
    // The oracle: mark [e - need, e) for each boundary's tail end e and each interval multiple; every block when
    // the interval's tails cover them all; never a block no hit can use (W = 1); none past the horizon below.
    // vLLM's reachable_block_mask, whose closed form python/vllm_compat/research/swa_retention_rule.py checked
    // against vLLM.
    // Under EAGLE (vLLM's replay_boundaries and reachable_block_mask with use_eagle): need + 1 blocks, every end one
    // block later, the replay boundaries one alignment below floor_A(orig - 1) and below floor_A(orig).
    const std::size_t full = (P + decode) / bs;
    const std::size_t shift = eagle ? 1 : 0;
    const std::size_t need = (W > 1 ? (W - 1 + bs - 1) / bs : 0) + shift;
    std::vector<bool> mark(full, false);
    const auto mark_tail = [&](std::size_t end_block) {
      for (std::size_t i = end_block >= need ? end_block - need : 0; i < end_block && i < full; ++i) mark[i] = true;
    };
    const auto floor_a = [&](std::size_t t) { return t / A * A; };
    if (eagle) {
      for (const std::size_t b : {floor_a(orig - 1), floor_a(orig)}) mark_tail((b >= A ? b - A : 0) / bs + 1);
    } else {
      mark_tail(floor_a(orig - 1) / bs);
    }
    if (J > 0) mark_tail(floor_a(J) / bs + shift);
    if (I > 0) {
      if (need >= I / bs) {
        mark.assign(full, true);
      } else {
        // (a tail ending past the last full block still marks the blocks before it: vLLM's mask is periodic)
        for (std::size_t e = I / bs + shift; e < full + need; e += I / bs) mark_tail(e);
      }
    }
    // Examined only up to the alignment (vLLM's cacheable horizon, floor_A of the tokens computed), under EAGLE one
    // block past it when that is not 0.
    const auto horizon_at = [&](std::size_t n) {
      const std::size_t a = n / A * A / bs;
      return eagle && a != 0 ? std::min(n / bs, a + 1) : a;
    };
    const std::size_t horizon = horizon_at(P + decode);
    // The tokens computed after each build (the chunks, then one decode token a step). A marked block that the
    // first build whose horizon covers it finds below the window of the tokens computed before that build was
    // released already (vLLM's remove_skipped_blocks runs before its cache_blocks) and is never registered: only
    // under EAGLE (a tail clamped at block 0, or ending one block past a short window; docs/vllm-swa-retention.md
    // section 4, exception b).
    std::vector<std::size_t> builds;
    for (std::size_t n = 0; n < P;) builds.push_back(n += std::min(chunk, P - n));
    for (std::size_t t = 1; t <= decode; ++t) builds.push_back(P + t);
    const auto released_first = [&](std::size_t i) {
      std::size_t before = 0;
      for (const std::size_t n : builds) {
        if (horizon_at(n) > i) return before + 1 > W && i < (before + 1 - W) / bs;
        before = n;
      }
      return false;
    };
    const std::set<std::size_t> got = cached_blocks(m, 1, g);
    for (std::size_t i = 0; i < full; ++i) {
      const bool expect = mark[i] && W > 1 && i < horizon;
      INFO("trial " << trial << " bs " << bs << " W " << W << " A " << A << " I " << I << " P " << P << " orig "
                    << orig << " J " << J << " chunk " << chunk << " decode " << decode << " eagle " << eagle
                    << " block " << i);
      if (expect && released_first(i)) {
        CHECK(eagle);
        CHECK(!got.contains(i));
        ++eagle_missed;
        continue;
      }
      CHECK(got.contains(i) == expect);
      ++checked;
      (expect ? kept : dropped) += 1;
      eagle_kept += eagle && expect;
    }
    if (!window_only) CHECK(cached_blocks(m, 1, 0).size() == full);  // full attention stays dense
  }
  INFO("blocks checked " << checked << ", kept " << kept << ", dropped " << dropped << ", EAGLE kept " << eagle_kept
                          << ", EAGLE missed " << eagle_missed);
  CHECK(kept > 800);
  CHECK(dropped > 500);
  CHECK(eagle_kept > 150);
  CHECK(eagle_missed * 10 < eagle_kept);
}

TEST_CASE("retention options and configurations: typed errors naming the value, nothing changed",
          "[window_retention][errors]") {
  Manager m(fa_swa(0));
  const auto p = pagedkv_test::toks(1, 40);
  const std::size_t free_before = m.stats().blocks_free;
  pagedkv::AdmitOptions o;
  o.prompt_retention_tokens = 0;
  auto msg = pagedkv_test::expect_error([&] { (void)m.try_admit(1, p, nullptr, o); },
                                        pagedkv::Errc::kInvalidArgument);
  CHECK(msg.find("prompt_retention_tokens = 0") != std::string::npos);
  o.prompt_retention_tokens = 41;
  msg = pagedkv_test::expect_error([&] { (void)m.try_admit(1, p, nullptr, o); }, pagedkv::Errc::kInvalidArgument);
  CHECK(msg.find("prompt_retention_tokens = 41") != std::string::npos);
  o.prompt_retention_tokens = std::nullopt;
  o.shared_prefix_boundary = 41;
  msg = pagedkv_test::expect_error([&] { (void)m.try_admit(1, p, nullptr, o); }, pagedkv::Errc::kInvalidArgument);
  CHECK(msg.find("shared_prefix_boundary = 41") != std::string::npos);
  CHECK(m.num_sequences() == 0);
  CHECK(m.stats().blocks_free == free_before);
  o.shared_prefix_boundary = 40;  // the edge is accepted
  CHECK(m.try_admit(1, p, nullptr, o).admitted());

  auto c = fa_swa(24);  // not a multiple of the block size
  msg = pagedkv_test::expect_error([&] { Manager bad(c); }, pagedkv::Errc::kInvalidArgument);
  CHECK(msg.find("window_retention_interval = 24") != std::string::npos);
  c = fa_swa(32);
  c.window_retention_alignment = 24;
  msg = pagedkv_test::expect_error([&] { Manager bad(c); }, pagedkv::Errc::kInvalidArgument);
  CHECK(msg.find("window_retention_alignment = 24") != std::string::npos);
  c.window_retention_alignment = 64;  // 32 is not a multiple of the alignment
  msg = pagedkv_test::expect_error([&] { Manager bad(c); }, pagedkv::Errc::kInvalidArgument);
  CHECK(msg.find("window_retention_interval = 32") != std::string::npos);
}

TEST_CASE("a window group releases its out-of-window blocks last first: the cached ones are evicted in that order",
          "[window_retention][release]") {
  // vLLM's SlidingWindowManager.remove_skipped_blocks frees them from the highest index down, and its block pool
  // appends freed cached blocks to the eviction queue in that order. A 24-token prompt, window 4, block 4: blocks
  // 0-4 leave the window at the build and stay cached; a second admission that needs them evicts block 4 first.
  pagedkv::CacheConfig c;
  c.num_blocks = 14;  // the null block, 6 + 1 held by sequence 1, its 5 cached window blocks, 1 free
  c.block_size = 4;
  c.enable_events = true;
  c.groups.resize(2);
  c.groups[1] = {AttentionKind::kSlidingWindow, 4, 1};
  Manager m(c);
  REQUIRE(m.try_admit(1, pagedkv_test::toks(100, 24), nullptr, {}).admitted());
  step(m, 1);
  const auto hashes = m.sequence(1).hashes;
  std::vector<pagedkv::KVEvent> ev;
  m.drain_events(ev);
  ev.clear();
  REQUIRE(m.try_admit(2, pagedkv_test::toks(500, 12), nullptr, {}).admitted());  // 6 blocks: 1 free + 5 evicted
  m.drain_events(ev);
  std::vector<std::size_t> order;
  for (const auto& e : ev) {
    if (e.type != pagedkv::KVEventType::kBlockRemoved || e.group != 1) continue;
    for (std::size_t i = 0; i < hashes.size(); ++i) {
      if (hashes[i] == e.hash) order.push_back(i);
    }
  }
  CHECK(order == std::vector<std::size_t>{4, 3, 2, 1, 0});
}
