// Tests of external KV with recurrent-state groups (issue 33 item 5: "a recurrent group its working state and last
// checkpoint"): a hybrid model (a full-attention group, one or two recurrent groups, sometimes a sliding-window
// group) hands a prompt over from a producer to a consumer. Each engine runs its builds as kernels would: the K/V of
// position p of token t (t * 100003 + p + 1) written through the attention groups' slot mapping, and a toy
// recurrence (tests/fuzz/recurrent_model.hpp's scan) read from state_in, written at every listed checkpoint and
// into state_out. The transfer copies the producer's blocks (pages and states) into the consumer's. Two producer
// protocols: vLLM's N-1 prefill (vllm#37310: the producer computes all but the last prompt token and hands over its
// working state, from which the consumer computes the last one) and a full prefill (the consumer resumes from a
// checkpoint before its last token, or computes the prompt). Checked: the plan ends where every recurrent group
// has a described state, the descriptor's states are the scans of their prefixes, the consumer's working state
// after its last prompt token is the scan of the whole prompt, every checkpoint it registered serves a later hit
// with the right state, the attention tables equal those of a reference engine that computed the prompt itself,
// and nothing is held on either side at the end.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "../fuzz/recurrent_model.hpp"
#include "support/shadow_engine.hpp"
#include "test_support.hpp"
#include <pagedkv/external_kv.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using pagedkv::AttentionKind;
using pagedkv::ExternalFailurePolicy;
using pagedkv::ExternalSignal;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_recurrent::scan;
using Mgr = pagedkv::KVCacheManager<>;

using pagedkv_test::kv;
using Engine = pagedkv_test::ShadowEngine;
constexpr std::uint64_t kPoison = pagedkv_test::kPoisonState;

void build(Engine& e, SeqId seq, const std::vector<TokenId>& prompt, std::size_t n) { e.build(seq, prompt, n); }
void build_to(Engine& e, SeqId seq, const std::vector<TokenId>& prompt, std::size_t end, std::mt19937& rng) {
  e.build_to(seq, prompt, end, rng);
}

/// The attention groups' tables of `a`'s seq and `b`'s seq equal (null entries, K/V below `end`); the recurrent
/// groups' tables hold their checkpoint blocks at the same entries.
void check_same_tables(Engine& a, SeqId sa, Engine& b, SeqId sb, std::size_t end) {
  const std::size_t bs = a.m.block_size();
  for (std::size_t g = 0; g < a.m.num_groups(); ++g) {
    CAPTURE(g);
    const auto ta = a.m.block_ids(sa, g);
    const auto tb = b.m.block_ids(sb, g);
    REQUIRE(ta.size() == tb.size());
    for (std::size_t i = 0; i < ta.size(); ++i) {
      CAPTURE(i);
      REQUIRE((ta[i] == 0) == (tb[i] == 0));
      if (ta[i] == 0 || a.m.is_recurrent(g)) continue;
      for (std::size_t p = i * bs; p < std::min(end, (i + 1) * bs); ++p) {
        CHECK(a.page(ta[i])[p - i * bs] == b.page(tb[i])[p - i * bs]);
      }
    }
  }
}

pagedkv::CacheConfig hybrid(std::mt19937& rng, std::uint32_t bs) {
  pagedkv::CacheConfig c;
  c.num_blocks = 600;
  c.block_size = bs;
  c.groups.resize(2);
  c.groups[1].kind = AttentionKind::kRecurrent;
  c.groups[1].window_tokens = bs * static_cast<std::uint32_t>(1 + rng() % 3);
  c.groups[1].last_checkpoint = rng() % 2 == 0;
  const unsigned extra = rng() % 3;  // none, a second recurrent group, a sliding window
  if (extra == 1) {
    const auto interval = bs * static_cast<std::uint32_t>(1 + rng() % 4);
    c.groups.push_back({AttentionKind::kRecurrent, interval, 1, 0, rng() % 2 == 0});
  } else if (extra == 2) {
    c.groups.push_back({AttentionKind::kSlidingWindow, static_cast<std::uint32_t>(1 + rng() % (3 * bs)), 1});
  }
  return c;
}

}  // namespace

TEST_CASE("P/D hand-off with recurrent groups: the consumer resumes from the handed-off state",
          "[external_kv][manager][recurrent]") {
  std::size_t cases = 0, working = 0, checkpoint = 0, nothing = 0, into_checkpoint = 0, partial = 0;
  for (std::uint32_t seed = 1; seed <= 80; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    const std::uint32_t bs = 2 + rng() % 3;
    const pagedkv::CacheConfig c = hybrid(rng, bs);
    const std::size_t G = c.groups.size();
    Engine prod(c), cons(c), ref(c);
    const auto fp = [](const Mgr& m) { return m.layout_fingerprint("nhd", "bf16", 8, 128); };
    const bool n_minus_1 = rng() % 2 == 0;  // vLLM's N-1 prefill (vllm#37310), else a full prefill
    CAPTURE(n_minus_1);

    const std::size_t L = 2 + rng() % (10 * bs);
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

    // Producer: compute its prompt (all of it, or all but the last token), finish with a lease.
    const std::size_t N = n_minus_1 ? L - 1 : L;
    const std::vector<TokenId> produced(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(N));
    REQUIRE(prod.m.try_admit(1, produced).admitted());
    build_to(prod, 1, produced, N, rng);
    const auto desc = prod.m.finish_with_lease(1, fp(prod.m), std::nullopt);
    const std::size_t nb = (N + bs - 1) / bs;
    REQUIRE(desc.blocks.size() == G * nb);
    for (std::size_t g = 0; g < G; ++g) {
      if (!prod.m.is_recurrent(g)) continue;
      for (std::size_t i = 0; i < nb; ++i) {
        CAPTURE(g, i);
        const std::uint32_t b = desc.blocks[g * nb + i];
        // The working state is always described; a checkpoint of the interval too (a large pool: none evicted).
        const std::size_t pos = std::min((i + 1) * bs, N);
        if (pos == N || (pos % c.groups[g].window_tokens == 0)) CHECK(b != 0);
        if (b == 0) continue;
        CHECK(prod.state(b) == scan(prompt, pos));  // the state after the tokens up to the end of block i
        CHECK(prod.m.is_current_block(b, desc.generations[g * nb + i]));
      }
    }

    // Consumer: plan, admit, transfer the planned (non-null) pairs, complete.
    const auto plan = cons.m.plan_import(desc, fp(cons.m), prompt);
    const std::size_t hit = cons.m.lookup(prompt);
    CHECK(plan.first_token == hit);
    CHECK(plan.end_token <= std::min(N, L - 1));
    if (plan.end_token > hit) {
      // It ends where every recurrent group's state is described; with N-1, at the producer's working state.
      if (n_minus_1) CHECK(plan.end_token == N);
      for (std::size_t g = 0; g < G; ++g) {
        if (!cons.m.is_recurrent(g)) continue;
        const std::size_t n = plan.num_blocks;
        for (std::size_t k = 0; k + 1 < n; ++k) CHECK(plan.remote_blocks[g * n + k] == 0);  // one state moves
        const std::uint32_t b = plan.remote_blocks[g * n + n - 1];
        REQUIRE(b != 0);
        CHECK(prod.state(b) == scan(prompt, plan.end_token));
      }
      (plan.end_token == N ? working : checkpoint) += 1;
    } else {
      ++nothing;
    }
    auto r = cons.m.try_admit_external(7, prompt, plan);
    REQUIRE(r.admit.admitted());
    REQUIRE(ref.m.try_admit(7, prompt).admitted());
    REQUIRE(ref.m.num_built(7) == hit);
    ++cases;
    std::size_t end = hit;
    if (r.ticket.fill_id != 0) {
      const std::size_t n = plan.num_blocks;
      REQUIRE(r.ticket.blocks.size() == plan.remote_blocks.size());
      for (std::size_t g = 0; g < G; ++g) {
        for (std::size_t k = 0; k < n; ++k) {
          CAPTURE(g, k);
          const std::uint32_t mine = r.ticket.blocks[g * n + k];
          const std::uint32_t theirs = plan.remote_blocks[g * n + k];
          CHECK((mine == 0) == (theirs == 0));
          if (mine == 0) continue;
          // Poison every destination: only the transfer and builds may write.
          cons.page(mine).assign(bs, -99);
          cons.states[mine] = kPoison;
          REQUIRE(prod.m.is_current_block(theirs, plan.remote_generations[g * n + k]));
        }
        if (cons.m.is_recurrent(g)) {
          const std::uint32_t last = r.ticket.blocks[g * n + n - 1];
          const bool in_table = cons.m.block_ids(7, g)[plan.first_block + n - 1] == last;
          CHECK((in_table || last == cons.m.state_block(7, g)));  // a checkpoint block there, or the working state
          into_checkpoint += in_table ? 1 : 0;
        }
      }
      // All blocks valid (most cases) or a failed tail: with a recurrent group, the fill is then recomputed.
      const std::size_t valid = rng() % 4 != 0 ? n : rng() % n;
      for (std::size_t g = 0; g < G; ++g) {
        for (std::size_t k = 0; k < valid; ++k) {
          const std::uint32_t theirs = plan.remote_blocks[g * n + k];
          if (theirs == 0) continue;
          const std::uint32_t mine = r.ticket.blocks[g * n + k];
          if (cons.m.is_recurrent(g)) {
            cons.states[mine] = prod.state(theirs);
          } else {
            cons.page(mine) = prod.page(theirs);
          }
        }
      }
      const auto done = cons.m.complete_external_fill(r.ticket.fill_id, valid, ExternalFailurePolicy::kRecompute);
      REQUIRE(done.signal == ExternalSignal::kApplied);
      end = done.num_computed_tokens;
      if (valid == n) {
        CHECK(end == plan.end_token);
      } else {
        ++partial;
        CHECK(done.num_valid_blocks == 0);
        CHECK(end == hit);
      }
      CHECK(cons.m.num_built(7) == end);
    }
    // The reference computes [hit, end) itself; then both compute the rest: the last prompt token's state is the
    // scan of the whole prompt on both, and the attention tables agree.
    build_to(ref, 7, prompt, end, rng);
    build_to(cons, 7, prompt, L - 1, rng);
    build_to(ref, 7, prompt, L - 1, rng);
    build(cons, 7, prompt, 1);
    build(ref, 7, prompt, 1);
    check_same_tables(cons, 7, ref, 7, L);
    for (std::size_t g = 0; g < G; ++g) {
      if (!cons.m.is_recurrent(g)) continue;
      CAPTURE(g);
      CHECK(cons.state(cons.m.state_block(7, g)) == scan(prompt, L));
      CHECK(ref.state(ref.m.state_block(7, g)) == scan(prompt, L));
    }
    cons.m.free(7);
    ref.m.free(7);
    // Every checkpoint the consumer registered holds its prefix's state: a hit at each prefix resumes from it.
    for (std::size_t k = 1; k * bs < L; ++k) {
      const std::vector<TokenId> pre(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(k * bs + 1));
      REQUIRE(cons.m.try_admit(50, pre).admitted());
      build_to(cons, 50, pre, pre.size(), rng);
      for (std::size_t g = 0; g < G; ++g) {
        if (cons.m.is_recurrent(g)) CHECK(cons.state(cons.m.state_block(50, g)) == scan(pre, pre.size()));
      }
      cons.m.free(50);
    }

    // Refcounts balance: after the frees and the read-done, nothing is held on either side.
    CHECK(prod.m.release_lease(desc.hold_id) == ExternalSignal::kApplied);
    for (Engine* e : {&prod, &cons, &ref}) {
      CHECK(e->m.stats().blocks_used == 0);
      CHECK(e->m.stats().external.holds_active == 0);
      CHECK(e->m.stats().external.fills_in_flight == 0);
    }
  }
  CHECK(cases == 80);
  CHECK(working > 0);
  CHECK(checkpoint > 0);
  CHECK(into_checkpoint > 0);
  CHECK(partial > 0);
  WARN("cases " << cases << ", from the working state " << working << ", from a checkpoint " << checkpoint
                << " (into a table checkpoint block " << into_checkpoint << "), nothing imported " << nothing
                << ", partial fills recomputed " << partial);
}

TEST_CASE("recurrent fills: aborts and late signals leave nothing held, a save pin is refused",
          "[external_kv][manager]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 64;
  c.block_size = 4;
  c.groups = {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1, 0, true}};
  Engine e(c);
  std::vector<TokenId> prompt(22);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(7 + i);
  for (const bool quiescent : {true, false}) {
    CAPTURE(quiescent);
    // 21 external tokens: the state after 21 tokens goes into the working state (21 is not a block boundary).
    auto r = e.m.try_admit_external(1, prompt, 21);
    REQUIRE(r.ticket.fill_id != 0);
    REQUIRE(r.ticket.num_blocks() == 6);
    const auto row = r.ticket.group_blocks(1);
    CHECK(std::count(row.begin(), row.end(), 0U) == 5);
    CHECK(row[5] == e.m.state_block(1, 1));
    // Held: 6 attention blocks, the working state, the last checkpoint, checkpoints at 8 and 16 (and 24 is past
    // the prompt); the fill holds 7 of them (6 + the working state).
    CHECK(e.m.stats().blocks_used == 10);
    e.m.abort_sequence(1, quiescent);
    CHECK(e.m.stats().blocks_used == (quiescent ? 0U : 7U));  // an orphan hold keeps the fill's blocks only
    if (!quiescent) {
      CHECK(e.m.complete_external_fill(r.ticket.fill_id, 6).signal == ExternalSignal::kLate);
      CHECK(e.m.stats().blocks_used == 0);
    }
  }
  // 16 external tokens end at a checkpoint of the interval: the state goes into the table's checkpoint block, which
  // the completion registers (a later prompt hits it) and the next build reads.
  auto r = e.m.try_admit_external(2, prompt, 16);
  REQUIRE(r.ticket.num_blocks() == 4);
  const std::uint32_t ck = r.ticket.group_blocks(1)[3];
  CHECK(ck == e.m.block_ids(2, 1)[3]);
  CHECK(ck != e.m.state_block(2, 1));
  for (std::size_t k = 0; k < 4; ++k) {
    if (r.ticket.group_blocks(0)[k] != 0) e.page(r.ticket.group_blocks(0)[k]).assign(4, 0);
  }
  e.states[ck] = scan(prompt, 16);
  const auto done = e.m.complete_external_fill(r.ticket.fill_id, 4);
  CHECK(done.num_computed_tokens == 16);
  CHECK(e.m.block_ids(2, 1)[1] == 0);  // the checkpoint at 8 was never written: freed, not registered
  CHECK(e.m.prefix_index(1).size() == 1);  // the one at 16
  build(e, 2, prompt, 6);
  CHECK(e.state(e.m.state_block(2, 1)) == scan(prompt, 22));
  // A save pin of a sequence with a recurrent group is refused, naming the reason; nothing changes.
  const auto used = e.m.stats().blocks_used;
  const std::string msg = pagedkv_test::expect_error([&] { (void)e.m.pin_for_save(2); },
                                                     pagedkv::Errc::kInvalidArgument);
  CHECK(msg.find("group 1 is recurrent: a save pin cannot keep a working state") != std::string::npos);
  CHECK(e.m.stats().blocks_used == used);
  CHECK(e.m.stats().external.holds_active == 0);
  e.m.free(2);
  CHECK(e.m.stats().blocks_used == 0);
}
