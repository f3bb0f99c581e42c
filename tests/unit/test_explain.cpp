// Tests of KVCacheManager::explain_admit (issue 20, "hits that explain themselves"): why an admission's prefix hit
// ends where it does, directed cases for every cause, and a randomized consistency check over group mixes (full,
// sliding window, chunked-local) with a host tier: the explanation's hit equals lookup() and admission, and its
// cause is true of the cache (the named block is missing in the named group; a cap or a window really stopped it).
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include <pagedkv/kv_cache_manager.hpp>

#include "test_support.hpp"

namespace {

using pagedkv::AttentionKind;
using pagedkv::CacheConfig;
using pagedkv::KVCacheGroupSpec;
using pagedkv::MissCause;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::toks;
using Mgr = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;
using Toks = std::vector<TokenId>;

// Build every group's metadata of `batch` into throwaway buffers (every pending position).
void build(Mgr& m, std::vector<SeqId> batch) {
  const std::size_t G = m.num_groups();
  std::vector<std::vector<std::int64_t>> slots(G, std::vector<std::int64_t>(4096));
  std::vector<std::vector<std::int32_t>> copies(G, std::vector<std::int32_t>(512)), out(G, std::vector<std::int32_t>(512)),
      in(G, std::vector<std::int32_t>(512));
  std::vector<pagedkv::BatchMetadataBuffers> bufs(G);
  for (std::size_t g = 0; g < G; ++g) {
    bufs[g].slot_mapping = slots[g];
    bufs[g].copies = copies[g];
    bufs[g].swap_out = out[g];
    bufs[g].swap_in = in[g];
  }
  const auto sz = m.build_batch_metadata(batch, bufs);
  if (sz[0].transfer_token != 0) m.complete_transfers(sz[0].transfer_token);
}

CacheConfig config(std::size_t blocks, std::uint32_t bs, std::vector<KVCacheGroupSpec> groups = {}) {
  CacheConfig c;
  c.num_blocks = blocks;
  c.block_size = bs;
  c.groups = std::move(groups);
  return c;
}

}  // namespace

TEST_CASE("explain_admit: every cause of a one-group pool, named with its block", "[explain]") {
  Mgr m(config(64, 4));
  const Toks a = toks(100, 13);  // 3 full blocks + 1 token
  REQUIRE(m.try_admit(1, a).admitted());
  build(m, {1});
  m.free(1);

  auto x = m.explain_admit(a);  // every full block served: the 13th token is computed anyway
  CHECK(x.cause == MissCause::kNone);
  CHECK(x.hit_tokens == 12);
  CHECK(x.hit_tokens == m.lookup(a));
  CHECK(x.group_cached_run_tokens == std::vector<std::size_t>{12});

  x = m.explain_admit(std::span<const TokenId>(a).first(12));  // the one-token rule: 11 tokens may hit, 2 blocks
  CHECK(x.cause == MissCause::kCapped);
  CHECK(x.hit_tokens == 8);
  CHECK(x.cap_tokens == 11);
  pagedkv::AdmitOptions o;
  o.max_cached_tokens = 4;
  x = m.explain_admit(a, nullptr, o);
  CHECK(x.cause == MissCause::kCapped);
  CHECK(x.hit_tokens == 4);

  Toks b = a;
  b[5] = 7;  // block 1 differs
  x = m.explain_admit(b);
  CHECK(x.cause == MissCause::kNotCached);
  CHECK(x.first_miss_block == 1);
  CHECK(x.hit_tokens == 4);

  RequestKeys salted;
  salted.salt = "tenant-b";
  x = m.explain_admit(a, &salted);  // the same tokens were cached without a salt
  CHECK(x.cause == MissCause::kKeyMismatch);
  CHECK(x.first_miss_block == 0);
  CHECK(x.hit_tokens == 0);
  CHECK(m.explain_admit(toks(900, 13), &salted).cause == MissCause::kNotCached);  // nothing to mismatch with

  CHECK(m.explain_admit(toks(1, 3)).cause == MissCause::kShortPrompt);
  CacheConfig off = config(64, 4);
  off.enable_prefix_caching = false;
  Mgr m_off(off);
  CHECK(m_off.explain_admit(a).cause == MissCause::kPrefixCachingOff);
  pagedkv_test::expect_error([&] { (void)m.explain_admit(Toks{}); }, pagedkv::Errc::kInvalidArgument);
}

TEST_CASE("explain_admit: a window group that lost its blocks limits the hit, and the explanation names it",
          "[explain][groups]") {
  const std::uint32_t bs = 4;
  // Full + a 12-token window; a prompt of 6 full blocks. After eviction of the window group's released blocks (they
  // enter the eviction order at the build, before the free), a longer hit is limited by the window group.
  Mgr m(config(40, bs, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kSlidingWindow, 12, 1}}));
  const Toks p = toks(10, 25);
  REQUIRE(m.try_admit(1, p).admitted());
  build(m, {1});  // the window group releases blocks 0..2 (cached, first in the eviction order)
  m.free(1);
  Toks q(p.begin(), p.begin() + 16);  // p's first 4 blocks, then a new block: a hit of 4 needs window blocks 1..3
  for (TokenId t = 0; t < 5; ++t) q.push_back(9000 + t);
  REQUIRE(m.explain_admit(q).hit_tokens == 16);
  // Fill the pool: free blocks first, then the oldest cached ones (the window group's released blocks).
  for (SeqId next = 100; m.explain_admit(q).hit_tokens == 16; ++next) {
    REQUIRE(next < 140);
    REQUIRE(m.try_admit(next, toks(static_cast<TokenId>(5000 + 100 * next), 3)).admitted());
  }
  const auto x = m.explain_admit(q);
  CHECK(x.hit_tokens == m.lookup(q));
  CHECK(x.hit_tokens < 16);
  CHECK(x.group_cached_run_tokens[0] == 16);  // the full group still has every shared block
  CHECK(x.cause == MissCause::kLimitedByGroup);
  CHECK(x.limiting_group == 1);
  CHECK_FALSE(m.prefix_index(1).find(m.prepare_prompt(q).hashes[x.first_miss_block]).has_value());
}

TEST_CASE("explain_admit: randomized group mixes with a host tier - the explanation is true of the cache",
          "[explain][groups][random]") {
  const std::vector<std::vector<KVCacheGroupSpec>> mixes = {
      {},
      {{AttentionKind::kFull, 0, 1}, {AttentionKind::kSlidingWindow, 6, 1}},
      {{AttentionKind::kFull, 0, 1}, {AttentionKind::kChunkedLocal, 8, 1}, {AttentionKind::kSlidingWindow, 3, 1}},
      {{AttentionKind::kSlidingWindow, 9, 1}}};
  std::size_t counts[7] = {};
  for (std::size_t mix = 0; mix < mixes.size(); ++mix) {
    for (std::uint32_t seed = 0; seed < 3; ++seed) {
      std::mt19937 rng(seed * 31 + static_cast<std::uint32_t>(mix));
      CacheConfig c = config(48, 4, mixes[mix]);
      c.num_host_blocks = 32;
      Mgr m(c);
      const auto prompt = [&] {
        Toks t(4 + rng() % 40);
        const TokenId base = static_cast<TokenId>(rng() % 3);  // few roots: shared prefixes
        for (std::size_t i = 0; i < t.size(); ++i) t[i] = base * 1000 + static_cast<TokenId>(i < 12 ? i : rng() % 4);
        return t;
      };
      std::vector<SeqId> live;
      for (SeqId s = 1; s < 300; ++s) {
        const Toks p = prompt();
        RequestKeys k;
        if (rng() % 5 == 0) k.salt = "s";
        const auto x = m.explain_admit(p, &k);
        ++counts[static_cast<int>(x.cause)];
        const std::size_t bs = 4, full = p.size() / bs;
        REQUIRE(x.hit_tokens == m.lookup(p, &k));
        REQUIRE(x.host_hit_tokens <= x.hit_tokens);
        const auto hashes = m.prepare_prompt(p, &k).hashes;
        switch (x.cause) {
          case MissCause::kNone: REQUIRE(x.hit_tokens == full * bs); break;
          case MissCause::kCapped: REQUIRE(x.hit_tokens == x.cap_tokens / bs * bs); break;
          case MissCause::kNotCached:
          case MissCause::kKeyMismatch:
          case MissCause::kLimitedByGroup:
            REQUIRE(x.first_miss_block * bs <= x.hit_tokens);
            REQUIRE(x.first_miss_block < full);
            REQUIRE_FALSE(m.prefix_index(x.limiting_group).find(hashes[x.first_miss_block]).has_value());
            if (x.cause == MissCause::kKeyMismatch) REQUIRE(!k.empty());
            if (x.cause == MissCause::kLimitedByGroup) {
              REQUIRE(m.window(x.limiting_group).enabled());
              for (std::size_t g = 0; g < m.num_groups(); ++g) {
                if (!m.window(g).enabled()) REQUIRE(x.group_cached_run_tokens[g] > x.hit_tokens);
              }
            }
            break;
          default: FAIL("unexpected cause " << pagedkv::to_string(x.cause));
        }
        const auto r = m.try_admit(s, p, &k);
        if (r.admitted()) {
          REQUIRE(r.num_cached_tokens == x.hit_tokens);
          REQUIRE(r.num_host_cached_tokens == x.host_hit_tokens);
          build(m, {s});
          live.push_back(s);
        }
        while (live.size() > 3 || (!r.admitted() && !live.empty())) {
          m.free(live.front());
          live.erase(live.begin());
        }
      }
    }
  }
  WARN("explain_admit causes: none " << counts[0] << ", capped " << counts[3] << ", not cached " << counts[4]
                                     << ", key mismatch " << counts[5] << ", limited by group " << counts[6]);
  CHECK(counts[0] + counts[3] > 0);
  CHECK(counts[4] > 0);
  CHECK(counts[5] > 0);
}
