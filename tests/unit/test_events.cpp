// KV events a consumer can trust (issue 11 sec. 1): every stored event recomputes to its hash from the event
// alone; per-step batches numbered without gaps; a snapshot at batch n plus the batches after n equals the cache;
// block hashes are reproducible across processes (a second process prints them) and pinned by golden values.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/event_log.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)
#include <pagedkv/prefix_hash_index.hpp>

#ifndef PAGEDKV_HASH_PRINT_EXE
#error "PAGEDKV_HASH_PRINT_EXE (path of tests/unit/hash_print) must be defined by the build"
#endif

namespace {

using pagedkv::BlockHash;
using pagedkv::KVEvent;
using pagedkv::KVEventType;
using pagedkv::Medium;
using pagedkv::MultimodalItem;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::build_step;
using pagedkv_test::toks;
using Toks = std::vector<TokenId>;

BlockHash tag(std::uint8_t t) {
  BlockHash h;
  for (std::size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = static_cast<std::uint8_t>(t + 13 * i);
  return h;
}

// A consumer of the stream: the set of (hash, medium) it believes cached.
struct Consumer {
  std::set<std::pair<BlockHash, Medium>> cached;
  std::uint64_t last_batch = 0;
  void apply(const KVEvent& e) {
    switch (e.type) {
      case KVEventType::kBlockStored: cached.insert({e.hash, e.medium}); break;
      case KVEventType::kBlockRemoved: cached.erase({e.hash, e.medium}); break;
      case KVEventType::kAllCleared:
        std::erase_if(cached, [&](const auto& p) { return p.second == e.medium; });
        break;
    }
  }
};

template <class M>
std::set<std::pair<BlockHash, Medium>> cache_of(const M& m) {
  std::set<std::pair<BlockHash, Medium>> out;
  for (std::uint32_t b = 1; b < m.allocator().num_blocks(); ++b) {
    if (const auto h = m.prefix_index().hash_of(b)) out.insert({*h, Medium::kGpu});
  }
  return out;
}

}  // namespace

TEMPLATE_TEST_CASE("every stored event recomputes to its hash from the event alone - snapshots are consistent",
                   "[events][rehash][snapshot]", pagedkv::Sha256Hasher, pagedkv::Xxh3Hasher) {
  using Mgr = pagedkv::KVCacheManager<TestType>;
  const std::uint32_t bs = GENERATE(1U, 4U, 16U);
  constexpr std::uint64_t kSeed = 0xfeedULL;
  pagedkv::CacheConfig c;
  c.num_blocks = 160 / bs + 24;  // small: evictions happen
  c.block_size = bs;
  c.hash_seed = kSeed;
  c.enable_events = true;
  Mgr m(c);
  std::mt19937_64 rng(77 + bs);
  std::vector<RequestKeys> keys(5);
  keys[1].salt = "tenant-a";
  keys[2].adapter_id = 42;
  keys[3].multimodal = {MultimodalItem{tag(1), 1, 3}, MultimodalItem{tag(2), 5, 9}};
  keys[4].salt = "tenant-b";
  keys[4].adapter_id = 7;
  keys[4].multimodal = {MultimodalItem{tag(3), 0, 20}};
  const Toks base = toks(0, 64);
  std::vector<SeqId> live;
  SeqId next = 1;
  Consumer full;     // sees every batch from the start
  Consumer late;     // joins later from a snapshot
  bool late_joined = false;
  std::size_t stored = 0, removed = 0, rehashed = 0, with_keys = 0, batches = 0;
  double ts = 1.7e9;
  for (int step = 0; step < 300; ++step) {
    // A few calls per step: admissions (shared prefixes, keys), decode appends, lookahead commits, frees.
    for (int k = 0; k < 3; ++k) {
      const auto r = rng() % 10;
      if (r < 4 || live.empty()) {
        Toks p(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(20 + rng() % 44));
        const RequestKeys& kk = keys[rng() % keys.size()];
        if (m.try_admit(next, p, &kk).admitted()) live.push_back(next);
        ++next;
      } else if (r < 7) {
        const SeqId id = live[rng() % live.size()];
        if (m.sequence(id).num_pending() == 0 && m.sequence(id).num_lookahead == 0) {
          (void)m.try_append(id, Toks{static_cast<TokenId>(rng() % 3)});
        }
      } else if (r < 8) {
        const SeqId id = live[rng() % live.size()];
        const auto& q = m.sequence(id);
        if (q.num_lookahead == 0 && q.num_pending() == 0 && m.try_reserve_lookahead(id, 3).ok()) {
          build_step(m, live);
          m.commit_lookahead(id, Toks{1, 2});
        }
      } else {
        const std::size_t i = rng() % live.size();
        m.free(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
    }
    build_step(m, live);
    if (step == 120 && !live.empty()) {  // an operator resets the cache once everything drained
      for (SeqId id : live) m.free(id);
      live.clear();
      REQUIRE(m.reset_prefix_cache());
    }
    ts += 0.025;
    auto batch = m.take_event_batch(ts);
    if (!batch) continue;
    ++batches;
    CHECK(batch->seq_no == full.last_batch + 1);  // consecutive: no gaps, no empty batches
    CHECK(batch->ts == ts);
    full.last_batch = batch->seq_no;
    for (const KVEvent& e : batch->events) {
      full.apply(e);
      if (late_joined) late.apply(e);
      if (e.type == KVEventType::kBlockStored) {
        ++stored;
        CHECK(e.block_size == bs);
        CHECK(e.token_ids.size() == bs);
        CHECK(pagedkv::rehash_stored_event<TestType>(e, kSeed) == e.hash);
        if (!e.parent_hash) {  // a first block: its parent is the seed's root, so the seed is part of the chain
          CHECK(pagedkv::rehash_stored_event<TestType>(e, kSeed + 1) != e.hash);
        }
        ++rehashed;
        if (e.adapter_id != 0 || !e.salt.empty() || !e.multimodal_items.empty()) ++with_keys;
      } else if (e.type == KVEventType::kBlockRemoved) {
        ++removed;
      }
    }
    // The stream reproduces the cache exactly.
    REQUIRE(full.cached == cache_of(m));
    if (step == 60) {  // a consumer joins late: snapshot at batch n, then the batches after n
      const auto snap = m.event_snapshot();
      CHECK(snap.seq_no == batch->seq_no);
      for (const KVEvent& e : snap.stored) {
        CHECK(e.type == KVEventType::kBlockStored);
        CHECK(pagedkv::rehash_stored_event<TestType>(e, kSeed) == e.hash);
        late.apply(e);
      }
      late_joined = true;
    }
    if (late_joined) REQUIRE(late.cached == full.cached);
  }
  INFO("block size " << bs << ": " << batches << " batches, " << stored << " stored (" << with_keys
                     << " with keys), " << removed << " removed");
  CHECK(stored > 50);
  CHECK(removed > 20);
  CHECK(with_keys > 20);
  CHECK(rehashed == stored);
  CHECK(m.take_event_batch(ts).has_value() == false);
}

TEST_CASE("block hashes are reproducible across processes and pinned by golden values", "[events][determinism]") {
  // The same blocks hashed in this process and by a second process (tests/unit/hash_print), with the same seeds.
  std::string out;
  {
    FILE* f = ::popen(PAGEDKV_HASH_PRINT_EXE, "r");
    REQUIRE(f != nullptr);
    char buf[256];
    while (std::fgets(buf, sizeof buf, f) != nullptr) out += buf;
    REQUIRE(::pclose(f) == 0);
  }
  std::string here;
  const Toks block = toks(100, 16);
  RequestKeys k;
  k.salt = "tenant";
  k.adapter_id = 3;
  k.multimodal = {MultimodalItem{tag(9), 4, 8}};
  for (std::uint64_t seed : {0ULL, 1ULL, 0x5eedULL}) {
    const auto root_s = pagedkv::PrefixHashIndex<pagedkv::Sha256Hasher>::root_for_seed(seed);
    const auto root_x = pagedkv::PrefixHashIndex<pagedkv::Xxh3Hasher>::root_for_seed(seed);
    here += pagedkv::PrefixHashIndex<pagedkv::Sha256Hasher>::hash_block(root_s, block, 0, nullptr).hex() + " ";
    here += pagedkv::PrefixHashIndex<pagedkv::Sha256Hasher>::hash_block(root_s, block, 0, &k).hex() + " ";
    here += pagedkv::PrefixHashIndex<pagedkv::Xxh3Hasher>::hash_block(root_x, block, 0, nullptr).hex() + " ";
    here += pagedkv::PrefixHashIndex<pagedkv::Xxh3Hasher>::hash_block(root_x, block, 0, &k).hex() + "\n";
  }
  CHECK(out == here);
  // Golden values (little-endian encoding of docs/design.md "Block hashes"): any machine, any build, any process
  // must print these; a change here breaks every published hash and every router's index.
  CHECK(here.substr(0, here.find('\n')) ==
        "c3a98a7b587a8a79a02cb35732a65da4 da6b027e5f16a47655b381dfc68de9bc "   // SHA-256: no keys, keys
        "d19f42b100c30d2292cc78f3a68367f1 4d0dbff47306c9b037e66620c9a25bd0");  // XXH3-128: no keys, keys
}
