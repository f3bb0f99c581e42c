// CacheConfig::release_at_build = false (docs/groups.md "The release rule"): windowed and recurrent groups keep the
// blocks a build computed past until release_skipped_blocks(seq), vLLM's timing (its worker reads the block table
// from get_blocks after allocate_slots, and vLLM frees skipped blocks at the request's next allocation). Two
// managers run the same random steps, one releasing at each build, the other releasing each sequence just before
// its next growth: every build's metadata is identical (no allocation happens between the two release points, so
// even the block ids agree), the tables agree after each release, and between a build and the release the
// deferred manager's tables still hold every block that build's page tables listed.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using pagedkv::AttentionKind;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Mgr = pagedkv::KVCacheManager<>;

struct Run {
  Mgr m;
  std::vector<pagedkv::BatchMetadataStorage> store;
  explicit Run(const pagedkv::CacheConfig& c) : m(c) {
    pagedkv::BatchMetadataLimits lim;
    lim.max_batch = 8;
    lim.max_tokens_per_step = 512;
    lim.max_blocks_per_seq = 256;
    lim.max_copies = 64;
    for (std::size_t g = 0; g < m.num_groups(); ++g) store.emplace_back(lim);
  }
  std::vector<pagedkv::BatchMetadataSizes> build(const std::vector<SeqId>& batch,
                                                 const std::vector<std::uint32_t>& sched) {
    std::vector<pagedkv::BatchMetadataBuffers> bufs;
    for (auto& st : store) bufs.push_back(st.buffers());
    return m.build_batch_metadata(batch, bufs, sched);
  }
};

}  // namespace

TEST_CASE("release_at_build = false: builds keep skipped blocks until release_skipped_blocks - same metadata",
          "[kv_cache_groups][release]") {
  for (std::uint32_t seed = 1; seed <= 12; ++seed) {
    CAPTURE(seed);
    std::mt19937 rng(seed);
    pagedkv::CacheConfig c;
    c.num_blocks = 400;
    c.block_size = 4;
    c.groups = {{AttentionKind::kFull, 0, 1},
                {seed % 2 ? AttentionKind::kSlidingWindow : AttentionKind::kChunkedLocal, 3 + seed % 7, 1}};
    if (seed % 3 == 0) c.groups.push_back({AttentionKind::kRecurrent, 8, 1, 0, seed % 2 == 0});
    Run now(c);
    c.release_at_build = false;
    Run later(c);
    std::vector<SeqId> live;
    std::size_t released = 0, held_for_kernels = 0;
    for (std::size_t step = 0; step < 60; ++step) {
      // Admit a new sequence now and then; every live one grows by a random chunk (a prefill chunk or a decode).
      if (live.size() < 4 && rng() % 3 == 0) {
        const SeqId id = static_cast<SeqId>(step + 1);
        std::vector<TokenId> prompt(2 + rng() % 40);
        for (auto& t : prompt) t = static_cast<TokenId>(rng() % 50);  // shared prefixes: hits
        REQUIRE(now.m.try_admit(id, prompt).admitted());
        REQUIRE(later.m.try_admit(id, prompt).admitted());
        live.push_back(id);
      }
      std::vector<SeqId> batch;
      std::vector<std::uint32_t> sched;
      for (SeqId s : live) {
        // vLLM's order: the skipped blocks go before the request grows for this step.
        released += later.m.release_skipped_blocks(s);
        for (std::size_t g = 0; g < now.m.num_groups(); ++g) {
          REQUIRE(std::ranges::equal(now.m.block_ids(s, g), later.m.block_ids(s, g)));
        }
        if (now.m.num_built(s) == now.m.num_tokens(s)) {
          const TokenId t = static_cast<TokenId>(rng() % 50);
          REQUIRE(now.m.try_append(s, std::vector<TokenId>{t}).status == pagedkv::AppendStatus::kOk);
          REQUIRE(later.m.try_append(s, std::vector<TokenId>{t}).status == pagedkv::AppendStatus::kOk);
        }
        batch.push_back(s);
        const std::size_t left = now.m.num_tokens(s) - now.m.num_built(s);
        sched.push_back(static_cast<std::uint32_t>(std::min<std::size_t>(left, 1 + rng() % 12)));
      }
      if (batch.empty()) continue;
      const auto a = now.build(batch, sched);
      const auto b = later.build(batch, sched);
      for (std::size_t g = 0; g < now.m.num_groups(); ++g) {
        CAPTURE(g);
        const auto& x = now.store[g];
        const auto& y = later.store[g];
        REQUIRE(a[g].num_indices == b[g].num_indices);
        CHECK(std::equal(x.indptr.begin(), x.indptr.begin() + static_cast<std::ptrdiff_t>(batch.size() + 1),
                         y.indptr.begin()));
        CHECK(std::equal(x.indices.begin(), x.indices.begin() + static_cast<std::ptrdiff_t>(a[g].num_indices),
                         y.indices.begin()));
        CHECK(x.slot_mapping == y.slot_mapping);
        CHECK(x.state_in == y.state_in);
        CHECK(x.checkpoint_blocks == y.checkpoint_blocks);
        // Every page this build listed is still in the deferred manager's table (the kernels read them).
        for (std::size_t r = 0; r < batch.size(); ++r) {
          const auto t = later.m.block_ids(batch[r], g);
          for (std::int32_t j = y.indptr[r]; j < y.indptr[r + 1]; ++j) {
            const auto p = static_cast<std::uint32_t>(y.indices[static_cast<std::size_t>(j)]);
            if (p == 0) continue;
            CHECK(std::find(t.begin(), t.end(), p) != t.end());
            const auto u = now.m.block_ids(batch[r], g);
            held_for_kernels += std::find(u.begin(), u.end(), p) == u.end() ? 1 : 0;
          }
        }
      }
      // A finished sequence leaves both the same way.
      if (rng() % 5 == 0) {
        const SeqId s = live[rng() % live.size()];
        now.m.free(s);
        later.m.free(s);
        live.erase(std::find(live.begin(), live.end(), s));
      }
    }
    CHECK(released > 0);
    CHECK(held_for_kernels > 0);  // pages the releasing manager had already dropped from its table
    for (SeqId s : live) {
      now.m.free(s);
      later.m.free(s);
    }
    CHECK(now.m.stats().blocks_used == 0);
    CHECK(later.m.stats().blocks_used == 0);
  }
}

TEST_CASE("release_skipped_blocks: unknown sequences are refused, full attention has nothing to release",
          "[kv_cache_groups][release]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 32;
  c.block_size = 4;
  Mgr m(c);
  CHECK(pagedkv_test::expect_error([&] { (void)m.release_skipped_blocks(9); }, pagedkv::Errc::kUnknownSequence)
            .find("release_skipped_blocks") != std::string::npos);
  REQUIRE(m.try_admit(1, std::vector<TokenId>(13, 7)).admitted());
  CHECK(m.release_skipped_blocks(1) == 0);
}
