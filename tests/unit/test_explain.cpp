// Tests of KVCacheManager::explain_admit (issue 20, "hits that explain themselves"): why an admission's prefix hit
// ends where it does, directed cases for every cause, and a randomized consistency check over group mixes (full,
// sliding window, chunked-local) with a host tier: the explanation's hit equals lookup() and admission, and its
// cause is true of the cache (the named block is missing in the named group; a cap or a window really stopped it).
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

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
  CHECK(m.explain_admit(Toks{}).cause == MissCause::kShortPrompt);  // an empty prompt: no full block either
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
  std::size_t counts[pagedkv::kNumMissCauses] = {};
  for (std::size_t mix = 0; mix < mixes.size(); ++mix) {
    for (std::uint32_t seed = 0; seed < 3; ++seed) {
      std::mt19937 rng(seed * 31 + static_cast<std::uint32_t>(mix));
      CacheConfig c = config(48, 4, mixes[mix]);
      c.num_host_blocks = 32;
      c.eviction_history = 24;  // shorter than the run: some evicted blocks are forgotten again
      c.count_miss_causes = true;
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
        if (rng() % 5 == 0) k.salt.assign(1, 's');
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
          case MissCause::kEvicted:
            REQUIRE(x.first_miss_block * bs <= x.hit_tokens);
            REQUIRE(x.first_miss_block < full);
            REQUIRE_FALSE(m.prefix_index(x.limiting_group).find(hashes[x.first_miss_block]).has_value());
            if (x.cause == MissCause::kKeyMismatch) REQUIRE(!k.empty());
            REQUIRE(x.eviction.has_value() == (x.cause == MissCause::kEvicted));
            if (x.eviction) {  // in no tier now, and named with the group that misses it
              REQUIRE(x.eviction->group == x.limiting_group);
              REQUIRE_FALSE(m.host_tier()
                                ->find_ready(pagedkv::group_block_key(hashes[x.first_miss_block], x.limiting_group))
                                .has_value());
            }
            if (x.cause == MissCause::kLimitedByGroup) {
              REQUIRE(m.window(x.limiting_group).enabled());
              for (std::size_t g = 0; g < m.num_groups(); ++g) {
                if (!m.window(g).enabled()) REQUIRE(x.group_cached_run_tokens[g] > x.hit_tokens);
              }
            }
            break;
          default: FAIL("unexpected cause " << pagedkv::to_string(x.cause));
        }
        const auto before = m.stats().admissions_by_miss_cause;
        const auto r = m.try_admit(s, p, &k);
        const auto after = m.stats().admissions_by_miss_cause;
        std::uint64_t counted = 0;
        for (std::size_t i = 0; i < after.size(); ++i) counted += after[i] - before[i];
        REQUIRE(counted == (r.admitted() ? 1U : 0U));  // refused attempts are not counted
        if (r.admitted()) {  // the counter takes explain's cause (a key mismatch counts as not cached)
          const MissCause expect = x.cause == MissCause::kKeyMismatch ? MissCause::kNotCached : x.cause;
          REQUIRE(after[static_cast<std::size_t>(expect)] == before[static_cast<std::size_t>(expect)] + 1);
        }
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
                                     << ", key mismatch " << counts[5] << ", limited by group " << counts[6]
                                     << ", evicted " << counts[7]);
  CHECK(counts[0] + counts[3] > 0);
  CHECK(counts[4] > 0);
  CHECK(counts[5] > 0);
  CHECK(counts[7] > 0);
}

TEST_CASE("explain_admit: evicted or never stored, from which tier and how long ago, and counters per cause",
          "[explain][history]") {
  const std::uint32_t bs = 4;
  CacheConfig c = config(9, bs);  // 8 usable blocks
  c.eviction_history = 64;
  c.count_miss_causes = true;
  Mgr m(c);
  const auto by = [&](MissCause cause) { return m.stats().admissions_by_miss_cause[static_cast<std::size_t>(cause)]; };
  const Toks a = toks(100, 9);  // 2 full blocks + 1 token
  REQUIRE(m.try_admit(1, a).admitted());  // nothing cached yet: block 0 was never stored
  CHECK(by(MissCause::kNotCached) == 1);
  build(m, {1});
  m.free(1);
  CHECK(m.explain_admit(a).cause == MissCause::kNone);
  CHECK(m.explain_admit(toks(555, 9)).cause == MissCause::kNotCached);  // never stored
  // Evict a (the oldest cached blocks): three more prompts of 3 full blocks each, admitted, built and freed.
  for (SeqId s = 10; s < 13; ++s) {
    REQUIRE(m.try_admit(s, toks(static_cast<TokenId>(1000 * s), 12)).admitted());
    build(m, {s});
    m.free(s);
  }
  REQUIRE(m.stats().evictions > 0);
  const auto x = m.explain_admit(a);
  REQUIRE(x.cause == MissCause::kEvicted);
  CHECK(x.hit_tokens == m.lookup(a));
  REQUIRE(x.eviction.has_value());
  CHECK(x.eviction->tier == pagedkv::EvictedTier::kDevice);
  CHECK(x.eviction->group == 0);
  CHECK(x.evictions_since < m.stats().evictions);
  CHECK(x.first_miss_block * bs == x.hit_tokens);
  CHECK(std::string(pagedkv::to_string(x.cause)) == "evicted");
  const std::uint64_t evicted_before = by(MissCause::kEvicted);
  REQUIRE(m.try_admit(2, a).admitted());
  CHECK(by(MissCause::kEvicted) == evicted_before + 1);
  // Without a history the same miss is "not cached", and nothing is counted without count_miss_causes.
  Mgr plain(config(9, bs));
  REQUIRE(plain.try_admit(1, a).admitted());
  build(plain, {1});
  plain.free(1);
  for (SeqId s = 10; s < 13; ++s) {
    REQUIRE(plain.try_admit(s, toks(static_cast<TokenId>(1000 * s), 12)).admitted());
    build(plain, {s});
    plain.free(s);
  }
  CHECK(plain.explain_admit(a).cause == MissCause::kNotCached);
  for (const auto n : plain.stats().admissions_by_miss_cause) CHECK(n == 0);
  // A reset forgets the history: the content is no longer meant to be served.
  m.free(2);
  REQUIRE(m.reset_prefix_cache());
  CHECK(m.explain_admit(toks(1000 * 10, 12)).cause == MissCause::kNotCached);
  // Bad configuration: a typed error naming the value.
  CacheConfig huge = config(9, bs);
  huge.eviction_history = (std::size_t{1} << 30) + 1;
  const std::string msg = pagedkv_test::expect_error([&] { Mgr bad(huge); }, pagedkv::Errc::kLimitExceeded);
  CHECK(msg.find("eviction_history = 1073741825") != std::string::npos);
}

TEST_CASE("explain_admit: a block evicted from the host tier is named with its tier", "[explain][history][host]") {
  const std::uint32_t bs = 4;
  CacheConfig c = config(9, bs);
  c.num_host_blocks = 3;  // 2 usable host blocks: offloads evict each other
  c.eviction_history = 64;
  Mgr m(c);
  const Toks a = toks(100, 9);
  REQUIRE(m.try_admit(1, a).admitted());
  build(m, {1});
  m.free(1);
  // Push a out of the device (write-back offload to the host), then push its host copies out with later offloads.
  for (SeqId s = 10; s < 40 && m.stats().host_evictions < 6; ++s) {
    REQUIRE(m.try_admit(s, toks(static_cast<TokenId>(1000 * s), 12)).admitted());
    build(m, {s});
    m.free(s);
    build(m, {});  // the offloads queued by the evictions above run here
  }
  REQUIRE(m.stats().host_evictions >= 6);
  const auto x = m.explain_admit(a);
  REQUIRE(x.cause == MissCause::kEvicted);
  REQUIRE(x.eviction.has_value());
  CHECK(x.eviction->tier == pagedkv::EvictedTier::kHost);  // the latest eviction of its key: from the host tier
  CHECK(x.evictions_since < m.stats().host_evictions);
}

TEST_CASE("EvictionHistory: never a wrong record, always the latest eviction, older ones while their slot holds",
          "[explain][history]") {
  using pagedkv::BlockHash;
  using pagedkv::EvictedTier;
  const auto key = [](std::uint32_t i) {
    BlockHash k;
    for (std::size_t b = 0; b < 16; ++b) k.bytes[b] = static_cast<std::uint8_t>((i * 2654435761U) >> (8 * (b % 4)));
    k.bytes[15] = static_cast<std::uint8_t>(i);
    k.bytes[14] = static_cast<std::uint8_t>(i >> 8);
    return k;
  };
  pagedkv::EvictionHistory off(0);
  off.record(key(1), EvictedTier::kDevice, 0);
  CHECK_FALSE(off.enabled());
  CHECK_FALSE(off.find(key(1)).has_value());
  for (const std::size_t cap : {1U, 7U, 64U, 4096U}) {
    pagedkv::EvictionHistory h(cap);
    std::mt19937 rng(static_cast<std::uint32_t>(cap));
    const std::uint32_t keys = 200;
    std::vector<std::optional<pagedkv::EvictionRecord>> latest(keys);  // the model: every key's latest eviction
    std::uint64_t counts[2] = {};
    std::size_t found = 0, probes = 0;
    for (int step = 0; step < 20000; ++step) {
      const std::uint32_t k = static_cast<std::uint32_t>(rng() % keys);
      const auto t = rng() % 3 == 0 ? EvictedTier::kHost : EvictedTier::kDevice;
      const auto g = static_cast<std::uint32_t>(rng() % 4);
      h.record(key(k), t, g);
      latest[k] = pagedkv::EvictionRecord{t, g, counts[static_cast<int>(t)]++};
      const auto just = h.find(key(k));  // the latest eviction is always there
      REQUIRE(just.has_value());
      REQUIRE(just->eviction_number == latest[k]->eviction_number);
      const auto probe = static_cast<std::uint32_t>(rng() % (keys + 50));  // 50 keys never evicted
      const auto got = h.find(key(probe));
      if (probe >= keys || !latest[probe]) {
        REQUIRE_FALSE(got.has_value());
        continue;
      }
      ++probes;
      if (!got) continue;  // overwritten by a later eviction in its slot
      ++found;
      REQUIRE(got->tier == latest[probe]->tier);  // never an older or another key's record
      REQUIRE(got->group == latest[probe]->group);
      REQUIRE(got->eviction_number == latest[probe]->eviction_number);
    }
    if (cap >= 4096) CHECK(found * 10 >= probes * 9);  // 200 keys in 4096 slots: few collisions
    CHECK(h.evictions(EvictedTier::kHost) == counts[1]);
    h.clear();
    CHECK(h.evictions(EvictedTier::kDevice) == 0);
    for (std::uint32_t k = 0; k < keys; ++k) REQUIRE_FALSE(h.find(key(k)).has_value());
  }
}
