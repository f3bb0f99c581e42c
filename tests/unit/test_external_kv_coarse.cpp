// Tests of external KV with coarse pages (issue 33 item 5; docs/groups.md "Coarse pages"): a pool whose groups have
// pages of different sizes (a full-attention group at the match block size, one or two groups with pages of f match
// blocks, sometimes a sliding-window group) hands a prompt over from a producer to a consumer. A coarse group's pages
// move whole, each at its first match block's entry, so a fill starts on a page boundary of every group: the
// consumer's local hit is lowered to one (vLLM aligns hits to its groups' common block size the same way). Each
// engine keeps a shadow of its pool (the K/V of position p of token t is t * 100003 + p + 1, written through each
// build's slot mapping, page x B_g + pos % B_g); the transfer copies the producer's pages into the consumer's.
// Checked: the plan starts on a page boundary and moves each page once; every block or page the consumer's tables
// hold reads back the K/V of its positions (after the fill, after the rest of the prompt, and for a later hit on
// what the completion registered); partial fills; nothing held on either side at the end.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

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
using Mgr = pagedkv::KVCacheManager<>;

using pagedkv_test::kv;
using Engine = pagedkv_test::ShadowEngine;

void build_to(Engine& e, SeqId seq, const std::vector<TokenId>& prompt, std::size_t end, std::mt19937& rng) {
  e.build_to(seq, prompt, end, rng);
}

/// Every block or page of `seq`'s tables reads back the K/V of its positions below `upto`.
void check_content(Engine& e, SeqId seq, const std::vector<TokenId>& prompt, std::size_t upto) {
  for (std::size_t g = 0; g < e.m.num_groups(); ++g) {
    const std::size_t B = e.m.block_size(g);
    const auto t = e.m.block_ids(seq, g);
    for (std::size_t j = 0; j < t.size(); ++j) {
      if (t[j] == 0) continue;  // released by a window
      for (std::size_t p = j * B; p < std::min(upto, (j + 1) * B); ++p) {
        CAPTURE(g, j, p);
        REQUIRE(e.page(t[j], g)[p - j * B] == kv(prompt[p], p));
      }
    }
  }
}

pagedkv::CacheConfig coarse(std::mt19937& rng, std::uint32_t bs) {
  pagedkv::CacheConfig c;
  c.num_blocks = 600;
  c.block_size = bs;
  c.groups.resize(2);
  c.groups[1].block_size = bs * static_cast<std::uint32_t>(2 + rng() % 3);
  const unsigned extra = rng() % 3;  // none, a second coarse group, a sliding window
  if (extra == 1) {
    c.groups.push_back({});
    c.groups.back().block_size = bs * static_cast<std::uint32_t>(2 + rng() % 2);
  } else if (extra == 2) {
    c.groups.push_back({AttentionKind::kSlidingWindow, static_cast<std::uint32_t>(1 + rng() % (3 * bs)), 1});
  }
  return c;
}

}  // namespace

TEST_CASE("P/D hand-off with coarse pages: whole pages move from a page boundary - every position reads back",
          "[external_kv][manager][coarse]") {
  std::size_t cases = 0, lowered = 0, partial = 0, empty = 0;
  for (std::uint32_t seed = 1; seed <= 80; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    const std::uint32_t bs = 2 + rng() % 3;
    const pagedkv::CacheConfig c = coarse(rng, bs);
    const std::size_t G = c.groups.size();
    bool windowed = false;
    std::size_t P = bs;  // the page boundary every fill starts on
    for (const auto& s : c.groups) {
      windowed = windowed || s.kind == AttentionKind::kSlidingWindow;
      P = std::lcm(P, std::size_t{s.block_size != 0 ? s.block_size : bs});
    }
    Engine prod(c), cons(c);
    const auto fp = [](const Mgr& m) { return m.layout_fingerprint("nhd", "bf16", 8, 128); };

    const std::size_t L = 2 + rng() % (12 * bs);
    std::vector<TokenId> prompt(L);
    for (auto& t : prompt) t = static_cast<TokenId>(rng() % 1000000);
    // The consumer computed a prompt sharing a prefix of the hand-off's: a local hit, often inside a page.
    const std::size_t shared = rng() % 3 == 0 ? 0 : rng() % (L + 1);
    std::vector<TokenId> other(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(shared));
    for (std::size_t i = 0; i < 1 + rng() % (2 * bs); ++i) other.push_back(static_cast<TokenId>(2000000 + i));
    REQUIRE(cons.m.try_admit(100, other).admitted());
    build_to(cons, 100, other, other.size(), rng);
    cons.m.free(100);

    REQUIRE(prod.m.try_admit(1, prompt).admitted());
    build_to(prod, 1, prompt, L, rng);
    const auto desc = prod.m.finish_with_lease(1, fp(prod.m), std::nullopt);
    const std::size_t nb = (L + bs - 1) / bs;
    REQUIRE(desc.blocks.size() == G * nb);
    for (std::size_t g = 0; g < G; ++g) {
      if (prod.m.block_size(g) == bs) continue;
      const std::size_t f = prod.m.block_size(g) / bs;
      for (std::size_t i = 0; i < nb; ++i) {
        CAPTURE(g, i);
        const std::uint32_t b = desc.blocks[g * nb + i];
        CHECK((b != 0) == (i % f == 0));  // a page at its first match block, once
        if (b == 0) continue;
        for (std::size_t p = i * bs; p < std::min(L, i * bs + f * bs); ++p) {
          CHECK(prod.page(b, g)[p - i * bs] == kv(prompt[p], p));
        }
      }
    }

    const std::size_t local = cons.m.lookup(prompt);
    const auto plan = cons.m.plan_import(desc, fp(cons.m), prompt);
    if (plan.num_blocks == 0) {
      CHECK(plan.first_token == local);  // nothing to import: the admission takes its whole hit
    } else {
      CHECK(plan.first_token % P == 0);
      CHECK(plan.first_token <= local);
      CHECK(cons.m.lookup(prompt, nullptr, plan.first_token) == plan.first_token);
      if (!windowed) CHECK(plan.first_token == local / P * P);  // full and coarse hits are monotone
    }
    lowered += plan.first_token < local ? 1 : 0;
    for (std::size_t g = 0; g < G && plan.num_blocks != 0; ++g) {
      const std::size_t f = cons.m.block_size(g) / bs;
      for (std::size_t k = 0; k < plan.num_blocks; ++k) {
        const bool page_start = (plan.first_block + k) % f == 0;
        if (f > 1) CHECK((plan.remote_blocks[g * plan.num_blocks + k] != 0) == page_start);
      }
    }
    auto r = cons.m.try_admit_external(7, prompt, plan);
    REQUIRE(r.admit.admitted());
    CHECK(r.admit.num_cached_tokens == plan.first_token);
    ++cases;
    std::size_t end = plan.first_token;
    if (r.ticket.fill_id == 0) {
      ++empty;
    } else {
      const std::size_t n = plan.num_blocks;
      REQUIRE(r.ticket.blocks.size() == plan.remote_blocks.size());
      for (std::size_t g = 0; g < G; ++g) {
        for (std::size_t k = 0; k < n; ++k) {
          const std::uint32_t mine = r.ticket.blocks[g * n + k];
          CHECK((mine == 0) == (plan.remote_blocks[g * n + k] == 0));
          if (mine != 0) cons.page(mine, g).assign(cons.m.block_size(g), -99);  // poisoned: only the copy writes
        }
      }
      const std::size_t valid = rng() % 3 != 0 ? n : rng() % n;
      for (std::size_t g = 0; g < G; ++g) {
        for (std::size_t k = 0; k < valid; ++k) {
          const std::uint32_t theirs = plan.remote_blocks[g * n + k];
          if (theirs != 0) cons.page(r.ticket.blocks[g * n + k], g) = prod.page(theirs, g);
        }
      }
      const auto done = cons.m.complete_external_fill(r.ticket.fill_id, valid, ExternalFailurePolicy::kRecompute);
      REQUIRE(done.signal == ExternalSignal::kApplied);
      end = done.num_computed_tokens;
      if (valid == n) {
        CHECK(end == plan.end_token);
      } else {
        ++partial;
        CHECK(end == plan.first_token + done.num_valid_blocks * bs);
      }
    }
    check_content(cons, 7, prompt, end);
    build_to(cons, 7, prompt, L, rng);
    check_content(cons, 7, prompt, L);
    cons.m.free(7);
    // What the completion and the builds registered serves a hit with the right K/V.
    REQUIRE(cons.m.try_admit(8, prompt).admitted());
    check_content(cons, 8, prompt, cons.m.num_built(8));
    cons.m.free(8);

    CHECK(prod.m.release_lease(desc.hold_id) == ExternalSignal::kApplied);
    for (Engine* e : {&prod, &cons}) {
      CHECK(e->m.stats().blocks_used == 0);
      CHECK(e->m.stats().external.holds_active == 0);
    }
  }
  CHECK(cases == 80);
  CHECK(lowered > 0);
  CHECK(partial > 0);
  WARN("cases " << cases << ", hit lowered to a page boundary " << lowered << ", partial fills " << partial
                << ", nothing imported " << empty);
}

TEST_CASE("coarse fills: the vLLM-style admission starts at the page boundary, save pins keep pages",
          "[external_kv][manager][coarse]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 64;
  c.block_size = 4;
  c.groups.resize(2);
  c.groups[1].block_size = 16;  // pages of 4 match blocks
  Engine e(c);
  std::vector<TokenId> prompt(40);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<TokenId>(9 + i);
  // A cached prefix of 24 tokens (6 match blocks: one and a half pages).
  const std::vector<TokenId> pre(prompt.begin(), prompt.begin() + 25);
  std::mt19937 rng(5);
  REQUIRE(e.m.try_admit(1, pre).admitted());
  build_to(e, 1, pre, 25, rng);
  e.m.free(1);
  REQUIRE(e.m.lookup(prompt) == 24);
  const auto x = e.m.explain_admit_external(prompt, 12);
  CHECK(x.first_external_token == 16);
  CHECK(x.external_tokens == 20);  // [16, 36): the full hit's 24 tokens plus the 12 offered, from the page boundary
  CHECK(x.computed_tokens() == 36);
  // vLLM's num_external_computed_tokens = 12 after the 24-token hit: the fill writes [16, 36), pages whole.
  auto r = e.m.try_admit_external(2, prompt, 12);
  CHECK(r.admit.num_cached_tokens == 16);
  REQUIRE(r.ticket.fill_id != 0);
  CHECK(r.ticket.first_token == 16);
  CHECK(r.ticket.end_token == 36);
  CHECK(r.ticket.first_block == 4);
  REQUIRE(r.ticket.num_blocks() == 5);
  const auto pages = r.ticket.group_blocks(1);
  CHECK(pages[0] == e.m.block_ids(2, 1)[1]);  // page 1 at match block 4, page 2 at match block 8
  CHECK(pages[4] == e.m.block_ids(2, 1)[2]);
  CHECK(std::count(pages.begin(), pages.end(), 0U) == 3);
  CHECK(e.m.try_admit_external(3, prompt, 0).ticket.fill_id == 0);  // nothing offered: a plain admission
  CHECK(e.m.num_built(3) == 24);
  e.m.free(3);
  e.m.abort_sequence(2, true);
  // A save pin pins the pages holding the built full match blocks.
  REQUIRE(e.m.try_admit(4, prompt).admitted());
  build_to(e, 4, prompt, 40, rng);
  const auto pin = e.m.pin_for_save(4);
  e.m.free(4);
  CHECK(e.m.stats().external.blocks_held == 10 + 3);  // 10 match blocks, 3 pages (40 tokens = 2.5 pages)
  CHECK(e.m.end_save(pin) == ExternalSignal::kApplied);
  CHECK(e.m.stats().blocks_used == 0);
}
