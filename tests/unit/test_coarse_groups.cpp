// Tests of coarse-page groups (issue 20, section 2; docs/groups.md "Coarse pages"): a full-attention group whose
// pages hold KVCacheGroupSpec::block_size = f x the pool's block size, next to groups at the pool's block size (the
// match unit of hashes and hits).
//
//  - [config]    a coarse page on group 0, on a window, not a multiple, or with a host tier is a typed error;
//  - [table]     the coarse group's block table, page table (last_page_len) and slot mapping count in its pages, and
//                every built position reads back its own token through them (a shadow pool executing the build's
//                slot mappings and copies);
//  - [prefix]    hits per match block: a prompt shorter than a page hits (a partial entry), a hit that ends inside a
//                page takes a cached page in place and copies a page another sequence holds (copy-on-write), full
//                pages are keyed by their last match block, the page being filled is re-keyed as it fills;
//  - [explain]   a hit the coarse group limits is reported as kLimitedByGroup with its group and runs;
//  - [rewind]    a rewind below a partial page's key drops the key; [fork] a fork's shared partial page is copied
//                by the first append; [events] a re-key is BlockRemoved then BlockStored, naming the group.
#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <vector>

#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

#include "test_support.hpp"

namespace {

using pagedkv::AdmitStatus;
using pagedkv::AttentionKind;
using pagedkv::BatchMetadataBuffers;
using pagedkv::BatchMetadataSizes;
using pagedkv::CacheConfig;
using pagedkv::Errc;
using pagedkv::KVCacheGroupSpec;
using pagedkv::KVEvent;
using pagedkv::KVEventType;
using pagedkv::MissCause;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::expect_error;
using pagedkv_test::toks;

using Manager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;

constexpr std::uint32_t kBs = 4;  // the match unit

// Groups: 0 full at the match unit, 1 full with pages of `coarse` tokens, 2 (optional) a sliding window of 8.
CacheConfig coarse_config(std::uint32_t coarse = 16, bool window = false, std::size_t num_blocks = 64) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = kBs;
  c.enable_prefix_caching = true;
  c.enable_events = true;
  c.groups.push_back(KVCacheGroupSpec{});
  KVCacheGroupSpec g;
  g.block_size = coarse;
  c.groups.push_back(g);
  if (window) c.groups.push_back(KVCacheGroupSpec{AttentionKind::kSlidingWindow, 8});
  return c;
}

// An engine over a shadow pool: each group's slots hold the token id written there; a build writes every scheduled
// position's token through the group's slot mapping after executing the group's copies (whole pages).
struct Engine {
  explicit Engine(const CacheConfig& c) : m(c), pool(m.num_groups()) {}

  void build(std::initializer_list<SeqId> ids) {
    const std::size_t G = m.num_groups();
    std::vector<SeqId> batch(ids);
    std::size_t n = 0, blocks = 0;
    for (SeqId s : batch) {
      n += m.pending_slots(s).size();
      blocks += m.num_tokens(s) / kBs + 1;
    }
    std::vector<std::vector<std::int64_t>> slots(G, std::vector<std::int64_t>(n, -2));
    std::vector<std::vector<std::int32_t>> copies(G, std::vector<std::int32_t>(2 * m.pending_copies().size() + 2));
    std::vector<std::vector<std::int32_t>> indptr(G, std::vector<std::int32_t>(batch.size() + 1)),
        indices(G, std::vector<std::int32_t>(blocks)), last(G, std::vector<std::int32_t>(batch.size()));
    std::vector<BatchMetadataBuffers> bufs(G);
    for (std::size_t g = 0; g < G; ++g) {
      bufs[g].slot_mapping = slots[g];
      bufs[g].copies = copies[g];
      bufs[g].indptr = indptr[g];
      bufs[g].indices = indices[g];
      bufs[g].last_page_len = last[g];
    }
    // Token ids of the scheduled positions, read before the build moves the cursors.
    std::vector<TokenId> written;
    for (SeqId s : batch) {
      const auto t = m.token_ids(s);
      for (std::size_t p = m.num_built(s); p < m.num_tokens(s); ++p) written.push_back(t[p]);
    }
    sizes = m.build_batch_metadata(batch, bufs);
    for (std::size_t g = 0; g < G; ++g) {
      const std::int64_t page = m.block_size(g);
      for (std::size_t i = 0; i < sizes[g].num_copies; ++i) {  // copies first, as the step runs them
        const std::int64_t src = copies[g][2 * i], dst = copies[g][2 * i + 1];
        for (std::int64_t o = 0; o < page; ++o) {
          const auto it = pool[g].find(src * page + o);
          if (it != pool[g].end()) pool[g][dst * page + o] = it->second;
          else pool[g].erase(dst * page + o);
        }
      }
      for (std::size_t i = 0; i < n; ++i) {
        if (slots[g][i] >= 0) pool[g][slots[g][i]] = written[i];
      }
    }
    last_indptr = indptr;
    last_indices = indices;
    last_page = last;
  }

  // Every built position of `s` reads back its own token in every group (through block_ids and the group's pages).
  void check_readback(SeqId s) const {
    const auto t = m.token_ids(s);
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      if (m.window(g).enabled()) continue;  // released leading blocks: not read
      const auto ids = m.block_ids(s, g);
      const std::size_t page = m.block_size(g);
      REQUIRE(ids.size() == (m.num_tokens(s) + page - 1) / page);
      for (std::size_t p = 0; p < m.num_built(s); ++p) {
        const std::int64_t slot = static_cast<std::int64_t>(ids[p / page]) * static_cast<std::int64_t>(page) +
                                  static_cast<std::int64_t>(p % page);
        const auto it = pool[g].find(slot);
        INFO("group " << g << " position " << p);
        REQUIRE(it != pool[g].end());
        CHECK(it->second == t[p]);
      }
    }
  }

  Manager m;
  std::vector<std::map<std::int64_t, TokenId>> pool;
  std::vector<BatchMetadataSizes> sizes;
  std::vector<std::vector<std::int32_t>> last_indptr, last_indices, last_page;
};

std::vector<KVEvent> drain(Manager& m) {
  std::vector<KVEvent> ev;
  m.drain_events(ev);
  return ev;
}

}  // namespace

TEST_CASE("Coarse groups: invalid coarse pages are typed errors naming the value", "[coarse][config]") {
  CacheConfig c = coarse_config(16);
  c.groups[0].block_size = 16;
  CHECK(expect_error([&] { Manager m(c); }, Errc::kInvalidArgument).find("group 0") != std::string::npos);
  c = coarse_config(10);
  CHECK(expect_error([&] { Manager m(c); }, Errc::kInvalidArgument).find("block_size = 10") != std::string::npos);
  c = coarse_config(16, true);
  c.groups[2].block_size = 16;
  CHECK(expect_error([&] { Manager m(c); }, Errc::kInvalidArgument).find("sliding_window") != std::string::npos);
  c = coarse_config(16);
  c.num_host_blocks = 8;
  CHECK(expect_error([&] { Manager m(c); }, Errc::kInvalidArgument).find("host tier") != std::string::npos);
  c = coarse_config(4);  // equal to the pool's block size: a plain group
  Manager ok(c);
  CHECK(ok.block_size(1) == 4);
  CHECK(Manager(coarse_config(16)).block_size(1) == 16);
}

TEST_CASE("Coarse groups: tables, page tables and slots count in pages - every position reads back", "[coarse][table]") {
  Engine e(coarse_config(16, true));
  const auto p = toks(100, 37);
  REQUIRE(e.m.try_admit(1, p).status == AdmitStatus::kAdmitted);
  CHECK(e.m.block_ids(1, 0).size() == 10);
  CHECK(e.m.block_ids(1, 1).size() == 3);
  e.build({1});
  CHECK(e.sizes[1].num_indices == 3);
  CHECK(e.last_indptr[1][1] == 3);
  CHECK(e.last_page[1][0] == 5);   // 37 - 32
  CHECK(e.last_page[0][0] == 1);   // 37 - 36
  for (std::size_t i = 0; i < 3; ++i) CHECK(e.last_indices[1][i] == static_cast<std::int32_t>(e.m.block_ids(1, 1)[i]));
  e.check_readback(1);
  // Decode across the page boundary: one new page at position 48.
  for (TokenId t = 0; t < 14; ++t) {
    REQUIRE(e.m.try_append(1, std::vector<TokenId>{t}).status == pagedkv::AppendStatus::kOk);
    e.build({1});
  }
  CHECK(e.m.block_ids(1, 1).size() == 4);  // 51 tokens
  e.check_readback(1);
}

TEST_CASE("Coarse groups: hits per match block - partial pages, in place when cached, copied when held",
          "[coarse][prefix]") {
  Engine e(coarse_config(16));
  const auto a = toks(1, 20);  // 5 match blocks: page 0 full (key: block 3), page 1 partial (key: block 4)
  REQUIRE(e.m.try_admit(1, a).status == AdmitStatus::kAdmitted);
  e.build({1});
  const auto pages_a = std::vector<std::uint32_t>(e.m.block_ids(1, 1).begin(), e.m.block_ids(1, 1).end());
  const auto& h = e.m.sequence(1).hashes;
  REQUIRE(h.size() == 5);
  CHECK(e.m.prefix_index(1).hash_of(pages_a[0]) == h[3]);
  CHECK(e.m.prefix_index(1).hash_of(pages_a[1]) == h[4]);

  auto b = a;
  for (TokenId t = 0; t < 10; ++t) b.push_back(900 + t);

  SECTION("a page another sequence holds is copied before the new sequence appends") {
    const auto r = e.m.try_admit(2, b);
    REQUIRE(r.status == AdmitStatus::kAdmitted);
    CHECK(r.num_cached_tokens == 20);  // 5 match blocks: not rounded down to the page (16)
    CHECK(e.m.block_ids(2, 1)[0] == pages_a[0]);
    CHECK(e.m.block_ids(2, 1)[1] != pages_a[1]);
    REQUIRE(e.m.pending_copies().size() == 1);
    CHECK(e.m.pending_copies()[0].src == pages_a[1]);
    CHECK(e.m.pending_copies()[0].dst == e.m.block_ids(2, 1)[1]);
    CHECK(e.m.pending_copies()[0].group == 1);
    e.build({2});
    e.check_readback(2);
    // The owner keeps appending into its page in place (its key stays true: it names content before the append).
    REQUIRE(e.m.try_append(1, std::vector<TokenId>{7, 8, 9, 10}).status == pagedkv::AppendStatus::kOk);
    CHECK(e.m.block_ids(1, 1)[1] == pages_a[1]);
    CHECK(e.m.pending_copies().empty());
    e.build({1});
    e.check_readback(1);
    e.check_readback(2);
    CHECK(e.m.prefix_index(1).hash_of(pages_a[1]) == e.m.sequence(1).hashes[5]);  // re-keyed as it filled
  }
  SECTION("a cached page is taken and appended in place") {
    e.m.free(1);
    const auto r = e.m.try_admit(2, b);
    REQUIRE(r.status == AdmitStatus::kAdmitted);
    CHECK(r.num_cached_tokens == 20);
    CHECK(e.m.block_ids(2, 1)[1] == pages_a[1]);
    CHECK(e.m.pending_copies().empty());
    e.build({2});
    e.check_readback(2);
    CHECK(e.m.prefix_index(1).hash_of(pages_a[1]) == e.m.sequence(2).hashes[6]);  // 28 built: block 6 ends there
  }
  SECTION("a prompt shorter than a page hits its match blocks") {
    e.m.free(1);
    const auto short_prompt = toks(1, 13);  // the first 12 tokens of `a` + 1
    CHECK(e.m.lookup(short_prompt) == 0);  // no key at block 2: page 0 (full) is keyed at block 3 only
    const auto r = e.m.try_admit(3, toks(1, 17));  // blocks 0..3 = page 0 full
    CHECK(r.num_cached_tokens == 16);
  }
}

TEST_CASE("Coarse groups: a short prompt is registered and hit at its last match block", "[coarse][prefix]") {
  Engine e(coarse_config(64));
  const auto a = toks(50, 10);  // 2 match blocks, far less than a 64-token page
  REQUIRE(e.m.try_admit(1, a).status == AdmitStatus::kAdmitted);
  e.build({1});
  e.m.free(1);
  auto b = a;
  b.push_back(1);
  b.push_back(2);
  const auto r = e.m.try_admit(2, b);
  REQUIRE(r.status == AdmitStatus::kAdmitted);
  CHECK(r.num_cached_tokens == 8);  // at the page size (LCM) rule: 0
  e.build({2});
  e.check_readback(2);
}

TEST_CASE("Coarse groups: a hit the coarse group limits is explained", "[coarse][explain]") {
  Engine e(coarse_config(16));
  REQUIRE(e.m.try_admit(1, toks(1, 24)).status == AdmitStatus::kAdmitted);  // page 1 keyed at block 5
  e.build({1});
  auto c = toks(1, 20);  // shares blocks 0..4, then differs
  for (TokenId t = 0; t < 8; ++t) c.push_back(500 + t);
  const auto x = e.m.explain_admit(c);
  CHECK(x.hit_tokens == 16);
  CHECK(x.cause == MissCause::kLimitedByGroup);
  CHECK(x.limiting_group == 1);
  REQUIRE(x.group_cached_run_tokens.size() == 2);
  CHECK(x.group_cached_run_tokens[0] == 20);
  CHECK(x.group_cached_run_tokens[1] == 16);
  CHECK(e.m.lookup(c) == 16);
  CHECK(e.m.try_admit(2, c).num_cached_tokens == 16);
  e.build({2});
  e.check_readback(2);
}

TEST_CASE("Coarse groups: a rewind below a partial page's key drops the key", "[coarse][rewind]") {
  Engine e(coarse_config(16));
  REQUIRE(e.m.try_admit(1, toks(1, 24)).status == AdmitStatus::kAdmitted);
  e.build({1});
  const std::uint32_t page = e.m.block_ids(1, 1)[1];
  REQUIRE(e.m.prefix_index(1).hash_of(page) == e.m.sequence(1).hashes[5]);
  (void)drain(e.m);
  e.m.rewind(1, 6);  // 18 tokens: 4 match blocks; the page holds 2 tokens, its key named 8
  CHECK_FALSE(e.m.prefix_index(1).hash_of(page).has_value());
  const auto ev = drain(e.m);
  REQUIRE(ev.size() == 1);  // group 0's released block 5 stays cached (no event); its block 4 stays registered
  CHECK(ev[0].type == KVEventType::kBlockRemoved);
  CHECK(ev[0].group == 1);
  REQUIRE(e.m.try_append(1, std::vector<TokenId>{70, 71, 72, 73, 74, 75}).status == pagedkv::AppendStatus::kOk);
  CHECK(e.m.block_ids(1, 1)[1] == page);  // written in place
  e.build({1});
  e.check_readback(1);
  CHECK(e.m.prefix_index(1).hash_of(page) == e.m.sequence(1).hashes[5]);
}

TEST_CASE("Coarse groups: fork shares the partial page - the first append copies it", "[coarse][fork]") {
  Engine e(coarse_config(16));
  REQUIRE(e.m.try_admit(1, toks(1, 22)).status == AdmitStatus::kAdmitted);
  e.build({1});
  e.m.fork(1, 2);
  const std::uint32_t page = e.m.block_ids(1, 1)[1];
  CHECK(e.m.block_ids(2, 1)[1] == page);
  REQUIRE(e.m.try_append(2, std::vector<TokenId>{300}).status == pagedkv::AppendStatus::kOk);
  bool copied = false;
  for (const auto& cp : e.m.pending_copies()) copied = copied || (cp.group == 1 && cp.src == page);
  CHECK(copied);
  REQUIRE(e.m.try_append(1, std::vector<TokenId>{400}).status == pagedkv::AppendStatus::kOk);
  e.build({1, 2});
  e.check_readback(1);
  e.check_readback(2);
}

TEST_CASE("Coarse groups: a re-key is BlockRemoved then BlockStored naming the group", "[coarse][events]") {
  Engine e(coarse_config(16));
  REQUIRE(e.m.try_admit(1, toks(1, 20)).status == AdmitStatus::kAdmitted);
  e.build({1});
  auto ev = drain(e.m);
  std::size_t stored1 = 0;
  for (const KVEvent& x : ev) stored1 += x.type == KVEventType::kBlockStored && x.group == 1 ? 1 : 0;
  CHECK(stored1 == 2);  // page 0 at block 3, page 1 at block 4
  REQUIRE(e.m.try_append(1, std::vector<TokenId>{5, 6, 7, 8}).status == pagedkv::AppendStatus::kOk);
  e.build({1});
  ev = drain(e.m);
  std::vector<KVEvent> g1;
  for (const KVEvent& x : ev) {
    if (x.group == 1) g1.push_back(x);
  }
  REQUIRE(g1.size() == 2);
  CHECK(g1[0].type == KVEventType::kBlockRemoved);
  CHECK(g1[0].hash == e.m.sequence(1).hashes[4]);
  CHECK(g1[1].type == KVEventType::kBlockStored);
  CHECK(g1[1].hash == e.m.sequence(1).hashes[5]);
  REQUIRE(g1[1].parent_hash.has_value());
  CHECK(*g1[1].parent_hash == e.m.sequence(1).hashes[4]);
  CHECK(g1[1].block_start == 20);
}
