// Tests of external KV with windowed KV-cache groups (issue 33 item 5): a hybrid model (a full-attention group and
// sliding-window or chunked-local groups) hands a prompt over from a producer to a consumer. Each engine keeps a
// shadow of its pool (the "K/V" of position p of token t is t * 100003 + p + 1, written through each build's slot
// mapping; the transfer copies the producer's shadow blocks into the consumer's). After the hand-off the consumer's
// block tables (null entries included) and the next build's metadata equal those of a reference engine that
// computed the prompt itself, page by page by content; window blocks outside the consumer's first window are never
// in the transfer list; refcounts balance at the end (nothing leaked on either side).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "support/shadow_engine.hpp"
#include "test_support.hpp"
#include <pagedkv/external_kv.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using pagedkv::AttentionKind;
using pagedkv::ExternalFailurePolicy;
using pagedkv::ExternalSignal;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Mgr = pagedkv::KVCacheManager<>;

using pagedkv_test::kv;
using Engine = pagedkv_test::ShadowEngine;

/// What a build wrote for one sequence, per group.
struct Step {
  std::vector<std::vector<std::int32_t>> indptr, indices, last_page_len, seq_lens, qo_indptr;
};

/// Build `n` tokens of `seq` (of `prompt`) on `e` (ShadowEngine::build: K/V into the shadow through every group's
/// slot mapping) and return its metadata.
Step build(Engine& e, SeqId seq, const std::vector<TokenId>& prompt, std::size_t n) {
  e.build(seq, prompt, n);
  Step s;
  for (const auto& st : e.store) {
    s.indptr.emplace_back(st.indptr.begin(), st.indptr.begin() + 2);
    s.indices.emplace_back(st.indices.begin(), st.indices.begin() + st.indptr[1]);
    s.last_page_len.emplace_back(st.last_page_len.begin(), st.last_page_len.begin() + 1);
    s.seq_lens.emplace_back(st.seq_lens.begin(), st.seq_lens.begin() + 1);
    s.qo_indptr.emplace_back(st.qo_indptr.begin(), st.qo_indptr.begin() + 2);
  }
  return s;
}

void build_to(Engine& e, SeqId seq, const std::vector<TokenId>& prompt, std::size_t end, std::mt19937& rng) {
  e.build_to(seq, prompt, end, rng);
}

/// Block b's K/V at logical block i, positions below `end`, as the engine's shadow holds them.
std::vector<std::int64_t> content(Engine& e, std::uint32_t b, std::size_t i, std::size_t end) {
  std::vector<std::int64_t> out;
  const std::size_t bs = e.m.block_size();
  for (std::size_t p = i * bs; p < std::min(end, (i + 1) * bs); ++p) out.push_back(e.page(b)[p - i * bs]);
  return out;
}

/// Tables of `a`'s seq and `b`'s seq equal: same null entries, same K/V (positions below `end`) in the others.
void check_same_tables(Engine& a, SeqId sa, Engine& b, SeqId sb, std::size_t end) {
  for (std::size_t g = 0; g < a.m.num_groups(); ++g) {
    CAPTURE(g);
    const auto ta = a.m.block_ids(sa, g);
    const auto tb = b.m.block_ids(sb, g);
    REQUIRE(ta.size() == tb.size());
    CHECK(a.m.num_null_blocks(sa, g) == b.m.num_null_blocks(sb, g));
    for (std::size_t i = 0; i < ta.size(); ++i) {
      CAPTURE(i);
      REQUIRE((ta[i] == 0) == (tb[i] == 0));
      if (ta[i] != 0) CHECK(content(a, ta[i], i, end) == content(b, tb[i], i, end));
    }
  }
}

/// The two builds' metadata equal: sizes and lengths as numbers, pages by content (positions below `end`).
void check_same_step(Engine& a, const Step& x, Engine& b, const Step& y, std::size_t end) {
  for (std::size_t g = 0; g < x.indptr.size(); ++g) {
    CAPTURE(g);
    CHECK(x.indptr[g] == y.indptr[g]);
    CHECK(x.seq_lens[g] == y.seq_lens[g]);
    CHECK(x.qo_indptr[g] == y.qo_indptr[g]);
    CHECK(x.last_page_len[g] == y.last_page_len[g]);
    for (std::int32_t j = 0; j < x.indptr[g][1]; ++j) {
      const auto pa = static_cast<std::uint32_t>(x.indices[g][static_cast<std::size_t>(j)]);
      const auto pb = static_cast<std::uint32_t>(y.indices[g][static_cast<std::size_t>(j)]);
      REQUIRE((pa == 0) == (pb == 0));
      const auto i = static_cast<std::size_t>(j);
      if (pa != 0) CHECK(content(a, pa, i, end) == content(b, pb, i, end));
    }
  }
}

pagedkv::CacheConfig hybrid(std::mt19937& rng, std::uint32_t bs) {
  pagedkv::CacheConfig c;
  c.num_blocks = 512;
  c.block_size = bs;
  c.groups.resize(2 + rng() % 2);
  for (std::size_t g = 1; g < c.groups.size(); ++g) {
    c.groups[g].kind = rng() % 3 == 0 ? AttentionKind::kChunkedLocal : AttentionKind::kSlidingWindow;
    c.groups[g].window_tokens = static_cast<std::uint32_t>(1 + rng() % (4 * bs + 3));
  }
  return c;
}

}  // namespace

TEST_CASE("P/D hand-off with window groups: only in-window blocks move - the consumer equals local compute",
          "[external_kv][manager][kv_cache_groups]") {
  std::size_t cases = 0, taken_back = 0, partial_kept = 0, partial_recomputed = 0, empty_plans = 0, holed_plans = 0;
  for (std::uint32_t seed = 1; seed <= 60; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    const std::uint32_t bs = 2 + rng() % 3;
    const pagedkv::CacheConfig c = hybrid(rng, bs);
    const std::size_t G = c.groups.size();
    Engine prod(c), cons(c), ref(c);
    const auto fp = [](const Mgr& m) { return m.layout_fingerprint("nhd", "bf16", 8, 128); };

    const std::size_t L = 2 + rng() % (8 * bs);
    std::vector<TokenId> prompt(L);
    for (auto& t : prompt) t = static_cast<TokenId>(rng() % 1000000);
    // The consumer (and the reference) computed a prompt sharing a prefix of the hand-off's: a local hit.
    const std::size_t shared = rng() % 2 == 0 ? 0 : rng() % (L + 1);
    std::vector<TokenId> other(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(shared));
    for (std::size_t i = 0; i < 1 + rng() % (2 * bs); ++i) other.push_back(static_cast<TokenId>(2000000 + i));
    for (Engine* e : {&cons, &ref}) {
      REQUIRE(e->m.try_admit(100, other).admitted());
      std::mt19937 r2(seed);
      build_to(*e, 100, other, other.size(), r2);
      e->m.free(100);
    }

    // Producer: compute the prompt, finish with a lease.
    REQUIRE(prod.m.try_admit(1, prompt).admitted());
    build_to(prod, 1, prompt, L, rng);
    std::vector<std::size_t> nulls_before(G);
    for (std::size_t g = 0; g < G; ++g) nulls_before[g] = prod.m.num_null_blocks(1, g);
    const auto desc = prod.m.finish_with_lease(1, fp(prod.m), std::nullopt);
    const std::size_t nb = (L + bs - 1) / bs;
    REQUIRE(desc.blocks.size() == G * nb);
    for (std::size_t g = 0; g < G; ++g) {
      const std::size_t first = pagedkv::detail::first_kept_block(prod.m.window(g), L - 1, bs);
      if (first < nulls_before[g]) ++taken_back;  // the last build's window released them: back from the cache
      for (std::size_t i = 0; i < nb; ++i) {
        CAPTURE(g, i);
        const std::uint32_t b = desc.blocks[g * nb + i];
        // Inside the window every block is there (a large pool: nothing evicted), but one the last build's window
        // released that could never serve a hit (so it was never cached: W = 1, a chunk's last block).
        if (i < first) CHECK(b == 0);
        if (b == 0) {
          CHECK((i < first || !pagedkv::detail::block_can_serve_hit(prod.m.window(g), i, bs)));
          continue;
        }
        CHECK(prod.m.allocator().refcount(b) == 1);  // the lease's reference only (the sequence is freed)
        CHECK(prod.m.is_current_block(b, desc.generations[g * nb + i]));
        for (std::size_t p = i * bs; p < std::min(L, (i + 1) * bs); ++p) {
          CHECK(prod.page(b)[p - i * bs] == kv(prompt[p], p));
        }
      }
    }

    // Consumer: plan, admit, transfer only the planned (non-null) pairs, complete.
    const auto plan = cons.m.plan_import(desc, fp(cons.m), prompt);
    CHECK(plan.first_token == cons.m.lookup(prompt));
    // A descriptor missing a block inside a window group's window (the producer's copy was evicted) plans nothing.
    if (plan.num_blocks != 0) {
      const std::size_t g = 1 + rng() % (G - 1);
      const std::size_t i = std::max(plan.first_block,
                                     pagedkv::detail::first_kept_block(cons.m.window(g), plan.end_token, bs)) +
                            rng() % 2;
      if (i < (plan.end_token + bs - 1) / bs) {
        auto holed = desc;
        holed.blocks[g * nb + i] = 0;
        const auto empty = cons.m.plan_import(holed, fp(cons.m), prompt);
        CHECK(empty.num_blocks == 0);
        CHECK(empty.end_token == plan.first_token);
        CHECK(empty.remote_blocks.empty());
        ++holed_plans;
      }
    }
    // The producer accepts a claim of the whole plan: its null entries (block 0, generation 0) name nothing to read.
    const auto claim = prod.m.check_claim(desc.hold_id, plan.remote_blocks, plan.remote_generations);
    CHECK(claim.status == pagedkv::ClaimStatus::kOk);
    const auto null_at = std::find(plan.remote_blocks.begin(), plan.remote_blocks.end(), 0U);
    if (null_at != plan.remote_blocks.end()) {  // but not a null block with a generation
      auto gens = plan.remote_generations;
      const auto i = static_cast<std::size_t>(null_at - plan.remote_blocks.begin());
      gens[i] = 1;
      const auto bad = prod.m.check_claim(desc.hold_id, plan.remote_blocks, gens);
      CHECK(bad.status == pagedkv::ClaimStatus::kNotInHold);
      CHECK(bad.entry == i);
    }
    const auto moved_before = cons.m.stats().external.blocks_transferred;
    auto r = cons.m.try_admit_external(7, prompt, plan);
    REQUIRE(r.admit.admitted());
    // Counted as transferred: only the plan's non-null pairs.
    CHECK(cons.m.stats().external.blocks_transferred - moved_before ==
          static_cast<std::size_t>(std::count_if(plan.remote_blocks.begin(), plan.remote_blocks.end(),
                                                 [](std::uint32_t b) { return b != 0; })));
    REQUIRE(ref.m.try_admit(7, prompt).admitted());
    REQUIRE(ref.m.num_built(7) == plan.first_token);
    ++cases;
    std::size_t end = plan.first_token;
    if (r.ticket.fill_id == 0) {
      ++empty_plans;
      CHECK(plan.num_blocks == 0);
    } else {
      REQUIRE(r.ticket.blocks.size() == plan.remote_blocks.size());
      const std::size_t n = plan.num_blocks;
      for (std::size_t g = 0; g < G; ++g) {
        const std::size_t sent = pagedkv::detail::first_kept_block(cons.m.window(g), plan.end_token, bs);
        for (std::size_t k = 0; k < n; ++k) {
          const std::size_t i = plan.first_block + k;
          CAPTURE(g, i);
          const std::uint32_t mine = r.ticket.blocks[g * n + k];
          const std::uint32_t theirs = plan.remote_blocks[g * n + k];
          // Out-of-window blocks never appear in the transfer list, on either side.
          CHECK((theirs == 0) == (i < sent));
          CHECK((mine == 0) == (theirs == 0));
          // A block the fill leaves out is not even taken (null in the table, as vLLM pads an external load's
          // skipped blocks); poison every other destination: only copies and builds may write.
          CHECK((cons.m.block_ids(7, g)[i] == 0) == (theirs == 0));
          if (theirs == 0) continue;
          cons.page(cons.m.block_ids(7, g)[i]).assign(bs, -99);
          CHECK(cons.m.allocator().refcount(mine) == 2);  // table + fill
          REQUIRE(prod.m.is_current_block(theirs, plan.remote_generations[g * n + k]));
        }
      }
      // A random number of valid blocks: all (most cases) or a failed tail, recomputed.
      const std::size_t valid = rng() % 3 != 0 ? n : rng() % n;
      for (std::size_t g = 0; g < G; ++g) {
        for (std::size_t k = 0; k < valid; ++k) {
          const std::uint32_t theirs = plan.remote_blocks[g * n + k];
          if (theirs != 0) cons.page(r.ticket.blocks[g * n + k]) = prod.page(theirs);
        }
      }
      const auto done = cons.m.complete_external_fill(r.ticket.fill_id, valid, ExternalFailurePolicy::kRecompute);
      REQUIRE(done.signal == ExternalSignal::kApplied);
      CHECK_FALSE(done.sequence_failed);
      end = done.num_computed_tokens;
      if (valid == n) {
        CHECK(end == plan.end_token);
      } else if (done.num_valid_blocks == valid) {
        ++partial_kept;
        CHECK(end == plan.first_token + valid * bs);
      } else {
        ++partial_recomputed;
        CHECK(done.num_valid_blocks == 0);
        CHECK(end == plan.first_token);
      }
      CHECK(cons.m.num_built(7) == end);
      // Every block a later build writes is there: a recompute took back the blocks the admission left out.
      for (std::size_t g = 0; g < G; ++g) {
        const auto t = cons.m.block_ids(7, g);
        for (std::size_t i = end / bs; i < t.size(); ++i) CHECK(t[i] != 0);
      }
      // The next query's window holds only transferred (or hit) blocks: the rest are null now.
      for (std::size_t g = 0; g < G; ++g) {
        CHECK(cons.m.num_null_blocks(7, g) >= pagedkv::detail::first_kept_block(cons.m.window(g), end, bs));
      }
    }
    // The reference computes [hit, end) itself; both tables then agree, null entries and K/V.
    build_to(ref, 7, prompt, end, rng);
    check_same_tables(cons, 7, ref, 7, end);
    // Both compute the rest of the prompt but its last token, then the last token: the builds' metadata agree.
    build_to(cons, 7, prompt, L - 1, rng);
    build_to(ref, 7, prompt, L - 1, rng);
    check_same_tables(cons, 7, ref, 7, L - 1);
    const Step a = build(cons, 7, prompt, 1);
    const Step b = build(ref, 7, prompt, 1);
    check_same_step(cons, a, ref, b, L);
    check_same_tables(cons, 7, ref, 7, L);

    // Refcounts balance: after the frees and the read-done, nothing is held on either side.
    cons.m.free(7);
    ref.m.free(7);
    CHECK(prod.m.release_lease(desc.hold_id) == ExternalSignal::kApplied);
    for (Engine* e : {&prod, &cons, &ref}) {
      CHECK(e->m.stats().blocks_used == 0);
      CHECK(e->m.stats().external.holds_active == 0);
      CHECK(e->m.stats().external.fills_in_flight == 0);
    }
  }
  // Every path ran: blocks taken back from the cache, partial fills kept and recomputed, hits that left nothing.
  CHECK(cases == 60);
  CHECK(taken_back > 0);
  CHECK(partial_kept > 0);
  CHECK(partial_recomputed > 0);
  CHECK(holed_plans > 0);
  WARN("cases " << cases << ", taken back " << taken_back << ", partial kept " << partial_kept << ", recomputed "
                << partial_recomputed << ", empty plans " << empty_plans << ", holed plans " << holed_plans);
}

TEST_CASE("window-group fills: aborts, late signals and save pins leave nothing held", "[external_kv][manager]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 64;
  c.block_size = 4;
  c.groups.resize(2);
  c.groups[1].kind = AttentionKind::kSlidingWindow;
  c.groups[1].window_tokens = 5;  // the query at 23 sees [19, 23]: blocks 4 and 5 of the window group
  Engine e(c);
  std::vector<TokenId> prompt(24);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(7 + i);
  for (const bool quiescent : {true, false}) {
    CAPTURE(quiescent);
    auto r = e.m.try_admit_external(1, prompt, 23);
    REQUIRE(r.ticket.fill_id != 0);
    REQUIRE(r.ticket.num_blocks() == 6);
    const auto w = r.ticket.group_blocks(1);
    CHECK(std::count(w.begin(), w.end(), 0U) == 4);  // blocks 0..3: outside the window at 23, not in the fill
    CHECK(e.m.stats().external.fill_blocks == (quiescent ? 8U : 16U));
    // ... and not taken (vLLM's count: 6 full-attention blocks, 2 window blocks).
    CHECK(e.m.stats().blocks_used == 8);
    for (std::size_t i = 0; i < 6; ++i) {
      const std::uint32_t b = e.m.block_ids(1, 1)[i];
      CHECK((i < 4 ? b == 0 : e.m.allocator().refcount(b) == 2));
    }
    e.m.abort_sequence(1, quiescent);
    CHECK(e.m.stats().blocks_used == (quiescent ? 0U : 8U));  // an orphan hold keeps the fill's 6 + 2 blocks only
    if (!quiescent) {
      CHECK(e.m.complete_external_fill(r.ticket.fill_id, 6).signal == ExternalSignal::kLate);
      CHECK(e.m.stats().blocks_used == 0);
    }
  }
  // A save pin of a window group's sequence pins the blocks its table holds (null entries skipped).
  REQUIRE(e.m.try_admit(2, prompt).admitted());
  std::mt19937 rng(3);
  build_to(e, 2, prompt, 24, rng);
  const std::size_t held = e.m.stats().blocks_used;
  const auto pin = e.m.pin_for_save(2);
  e.m.free(2);
  CHECK(held == 7);  // 6 full-attention blocks, 1 window block (the query at 24 sees [20, 24])
  CHECK(e.m.stats().blocks_used == held);  // all pinned past the free
  CHECK(e.m.stats().external.blocks_held == held);
  CHECK(e.m.end_save(pin) == ExternalSignal::kApplied);
  CHECK(e.m.stats().blocks_used == 0);
}

TEST_CASE("window-group fills: a recompute takes back the blocks the admission left out, or fails the sequence",
          "[external_kv][manager]") {
  // The query at 23 sees [19, 23]: the window group takes blocks 4 and 5 only (8 blocks in all, not 12). Two valid
  // blocks of six leave the next query at 8 seeing block 1, never transferred: the fill is recomputed from 0, which
  // writes every window block, so the four left out are taken then.
  std::vector<TokenId> prompt(24);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(7 + i);
  for (const std::uint32_t num_blocks : {64U, 11U}) {  // 11: 10 usable, 2 left after the admission
    CAPTURE(num_blocks);
    pagedkv::CacheConfig c;
    c.num_blocks = num_blocks;
    c.block_size = 4;
    c.groups.resize(2);
    c.groups[1].kind = AttentionKind::kSlidingWindow;
    c.groups[1].window_tokens = 5;
    Engine e(c);
    // Taking the skipped blocks too (12) would not fit the small pool; query_admit_external counts what it takes.
    const auto q = e.m.query_admit_external(prompt, 23);
    CHECK(q.status == pagedkv::CapacityStatus::kFits);
    CHECK(q.num_blocks == 8);
    CHECK(e.m.query_admit(prompt).num_blocks == 12);
    CHECK(e.m.query_admit(prompt).status ==  // a local prefill holds the whole window group first: 12 > 10 usable
          (num_blocks == 64 ? pagedkv::CapacityStatus::kFits : pagedkv::CapacityStatus::kNeverFits));
    const auto r = e.m.try_admit_external(1, prompt, 23);
    REQUIRE(r.admit.admitted());
    REQUIRE(r.ticket.fill_id != 0);
    CHECK(e.m.stats().blocks_used == 8);
    // The positions of the window blocks left out have no slot (no kernel writes them); the rest do.
    const auto pending = e.m.pending_slots(1, 1);
    REQUIRE(pending.size() == 24);
    for (std::size_t p = 0; p < 24; ++p) CHECK((pending[p] == -1) == (p < 16));
    const auto done = e.m.complete_external_fill(r.ticket.fill_id, 2, ExternalFailurePolicy::kRecompute);
    REQUIRE(done.signal == ExternalSignal::kApplied);
    CHECK(done.num_valid_blocks == 0);
    if (num_blocks == 64) {
      CHECK_FALSE(done.sequence_failed);
      CHECK(done.num_computed_tokens == 0);
      CHECK(e.m.num_null_blocks(1, 1) == 0);
      CHECK(e.m.stats().blocks_used == 12);
      std::mt19937 rng(5);
      build_to(e, 1, prompt, 24, rng);  // the recompute writes into the blocks taken back
      CHECK(e.m.num_null_blocks(1, 1) == 5);
      e.m.free(1);
    } else {  // 2 available, 4 needed: the sequence fails rather than compute into null blocks
      CHECK(done.sequence_failed);
      CHECK(e.m.stats().external.fills_failed == 1);
    }
    CHECK(e.m.stats().blocks_used == 0);
    CHECK(e.m.stats().external.fills_in_flight == 0);
  }
}
