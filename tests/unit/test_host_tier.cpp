// The host-memory tier (issue 10): write-back and write-through offload, host-tier prefix hits onboarded by swap_in,
// swap preemption and resume, copies pinned until complete_transfers, events with their medium; each checked through
// a shadow of both pools that executes the step's lists in the documented order (swap_out, swap_in, copies,
// write_kv), so every test also proves the K/V a sequence reads is the K/V of its own tokens.
#include <catch2/catch.hpp>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

namespace {

using pagedkv::AdmitStatus;
using pagedkv::CacheConfig;
using pagedkv::Errc;
using pagedkv::KVEvent;
using pagedkv::KVEventType;
using pagedkv::Medium;
using pagedkv::OffloadPolicy;
using pagedkv::PreemptMode;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::expect_error;
using pagedkv_test::toks;
using Mgr = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;
using Toks = std::vector<TokenId>;
using I32 = std::vector<std::int32_t>;

CacheConfig cfg(std::size_t device_blocks, std::size_t host_blocks, OffloadPolicy policy) {
  CacheConfig c;
  c.num_blocks = device_blocks;
  c.block_size = 4;
  c.num_host_blocks = host_blocks;
  c.offload = policy;
  c.enable_events = true;
  return c;
}

// Both pools as one value per slot (the "K/V" of a token is a fingerprint of its prefix), and the engine's step.
struct Engine {
  Mgr& m;
  std::vector<std::uint64_t> dev, host;
  std::map<SeqId, Toks> tokens;  // every live sequence's tokens (known)
  explicit Engine(Mgr& mgr)
      : m(mgr), dev(mgr.config().num_blocks * 4, 0), host(mgr.config().num_host_blocks * 4, 0) {}

  static std::uint64_t fp(const Toks& t, std::size_t p) {
    std::uint64_t h = 0x5eed;
    for (std::size_t i = 0; i <= p; ++i) h = (h ^ static_cast<std::uint64_t>(t[i])) * 0x100000001b3ULL + i;
    return h;
  }
  // Build the step for the sequences of `requested` with something to compute (all pending) and execute it:
  // swap_out, swap_in, copies, write_kv.
  pagedkv::BatchMetadataSizes step(const std::vector<SeqId>& requested) {
    std::vector<SeqId> batch;
    for (SeqId id : requested) {
      if (m.sequence(id).num_pending() > 0) batch.push_back(id);
    }
    std::size_t n = 0;
    for (SeqId id : batch) n += m.sequence(id).num_pending();
    const auto st = m.stats();
    I32 out(2 * (st.transfers_queued + 16), -9), in(2 * (st.transfers_queued + 16), -9),
        copies(2 * (m.pending_copies().size() + 1), -9);
    std::vector<std::int64_t> slots(n + 1, -9);
    std::vector<std::int32_t> qo(batch.size() + 1);
    pagedkv::BatchMetadataBuffers buf;
    buf.slot_mapping = slots;
    buf.copies = copies;
    buf.swap_out = out;
    buf.swap_in = in;
    buf.qo_indptr = qo;
    std::vector<std::size_t> first;
    for (SeqId id : batch) first.push_back(m.sequence(id).num_built);
    const auto sz = m.build_batch_metadata(batch, buf);
    for (std::size_t i = 0; i < sz.num_swap_out; ++i) {
      for (int k = 0; k < 4; ++k) host[out[2 * i + 1] * 4 + k] = dev[out[2 * i] * 4 + k];
    }
    for (std::size_t i = 0; i < sz.num_swap_in; ++i) {
      for (int k = 0; k < 4; ++k) dev[in[2 * i + 1] * 4 + k] = host[in[2 * i] * 4 + k];
    }
    for (std::size_t i = 0; i < sz.num_copies; ++i) {
      for (int k = 0; k < 4; ++k) dev[copies[2 * i + 1] * 4 + k] = dev[copies[2 * i] * 4 + k];
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      for (std::int32_t r = qo[b]; r < qo[b + 1]; ++r) {
        if (slots[static_cast<std::size_t>(r)] >= 0) {
          dev[static_cast<std::size_t>(slots[static_cast<std::size_t>(r)])] =
              fp(tokens.at(batch[b]), first[b] + static_cast<std::size_t>(r - qo[b]));
        }
      }
    }
    return sz;
  }
  // Every built position of every live sequence reads its own K/V.
  bool reads_own() const {
    bool ok = true;
    for (const auto& [id, t] : tokens) {
      if (!m.contains(id)) continue;
      const auto ids = m.block_ids(id);
      for (std::size_t p = 0; p < m.sequence(id).num_built; ++p) {
        if (dev[ids[p / 4] * 4 + p % 4] != fp(t, p)) {
          UNSCOPED_INFO("sequence " << id << " position " << p << " block " << ids[p / 4]);
          ok = false;
        }
      }
    }
    return ok;
  }
  void admit(SeqId id, const Toks& t) {
    const auto r = m.try_admit(id, t);
    REQUIRE(r.admitted());
    tokens[id] = t;
  }
};

std::vector<KVEvent> drain(Mgr& m) {
  std::vector<KVEvent> ev;
  m.drain_events(ev);
  return ev;
}

}  // namespace

TEST_CASE("write-back: evicted blocks go to the host tier and come back as host-tier hits", "[host_tier]") {
  Mgr m(cfg(5, 17, OffloadPolicy::kWriteBack));  // 4 device blocks, 16 host blocks
  Engine e(m);
  const Toks a = toks(0, 13);  // 3 full blocks + 1
  e.admit(1, a);
  e.step({1});
  CHECK(e.reads_own());
  m.free(1);  // cached: 3 (a's full blocks); the partial block is free
  drain(m);
  e.admit(2, toks(100, 13));  // 4 blocks: evicts a's 3 cached blocks -> 3 offloads queued
  CHECK(m.stats().offloads == 3);
  CHECK(m.stats().transfers_queued == 3);
  CHECK(m.lookup(a) == 0);  // not ready yet: queued copies serve nobody
  const auto sz = e.step({2});
  CHECK(sz.num_swap_out == 3);
  CHECK(sz.num_swap_in == 0);
  CHECK(sz.transfer_token == 1);
  CHECK(m.stats().transfers_in_flight == 3);
  CHECK(m.stats().host_blocks_used == 3);  // pinned by their copies
  CHECK(m.lookup(a) == 0);
  auto ev = drain(m);
  m.complete_transfers(sz.transfer_token);
  ev = drain(m);
  std::size_t cpu_stored = 0;
  for (const KVEvent& x : ev) cpu_stored += x.type == KVEventType::kBlockStored && x.medium == Medium::kCpu;
  CHECK(cpu_stored == 3);
  for (const KVEvent& x : ev) CHECK(pagedkv::rehash_stored_event<pagedkv::Xxh3Hasher>(x, 0) == x.hash);
  CHECK(m.stats().host_blocks_cached == 3);
  CHECK(m.lookup(a) == 12);  // served by the host tier now
  CHECK_THAT(expect_error([&] { m.complete_transfers(sz.transfer_token); }, Errc::kInvalidArgument),
             Catch::Contains("token 1 names no copies in flight"));

  // A request with a's prompt: its 3 full blocks are host-tier hits, onboarded into device blocks.
  m.free(2);
  const auto r = m.try_admit(3, a);
  e.tokens[3] = a;
  REQUIRE(r.admitted());
  CHECK(r.num_cached_tokens == 12);
  CHECK(r.num_host_cached_tokens == 12);
  CHECK(m.stats().host_hit_tokens == 12);
  CHECK(m.sequence(3).num_built == 12);
  CHECK_THAT(expect_error([&] { m.fork(3, 4); }, Errc::kInvalidArgument), Catch::Contains("unbuilt"));
  const auto s2 = e.step({3});
  CHECK(s2.num_swap_in == 3);
  CHECK(e.reads_own());  // the onboarded blocks hold a's K/V, copied through the host tier
  CHECK_FALSE(m.allocator().is_hashed(m.block_ids(3)[0]));  // registered only once the copy completed
  m.complete_transfers(s2.transfer_token);
  CHECK(m.allocator().is_hashed(m.block_ids(3)[0]));
  CHECK(m.stats().host_blocks_used == 0);
  ev = drain(m);
  std::size_t gpu_stored = 0;
  for (const KVEvent& x : ev) gpu_stored += x.type == KVEventType::kBlockStored && x.medium == Medium::kGpu;
  CHECK(gpu_stored == 3);  // the 3 onboarded blocks, registered when their copies completed
  m.fork(3, 4);            // settled now
}

TEST_CASE("write-through: registered blocks are copied by the next build", "[host_tier]") {
  Mgr m(cfg(16, 17, OffloadPolicy::kWriteThrough));
  Engine e(m);
  e.admit(1, toks(0, 9));
  auto s1 = e.step({1});
  CHECK(s1.num_swap_out == 0);  // written by this very step: copied by the next build
  REQUIRE(m.try_append(1, Toks{9, 10, 11}).ok());
  e.tokens[1] = toks(0, 12);
  auto s2 = e.step({1});
  CHECK(s2.num_swap_out == 2);  // the 2 blocks registered by the previous build
  m.complete_transfers(s2.transfer_token);
  auto s3 = e.step({1});
  CHECK(s3.num_swap_out == 1);  // block 3, registered by s2
  CHECK(m.stats().offloads == 3);
  m.complete_transfers(s3.transfer_token);
  CHECK(m.host_tier()->allocator().num_cached_blocks() == 3);
  // Eviction of a block already on the host copies nothing more.
  m.free(1);
  e.admit(2, toks(500, 60));  // 15 blocks: evicts the 3 cached ones
  CHECK(m.stats().offloads == 3);
}

TEST_CASE("swap preemption: out to the host tier, back by try_resume, K/V intact", "[host_tier][swap]") {
  Mgr m(cfg(9, 17, OffloadPolicy::kNone));  // 8 device blocks
  Engine e(m);
  e.admit(1, toks(0, 10));
  e.step({1});
  REQUIRE(m.try_append(1, Toks{10}).ok());  // unbuilt: not settled
  e.tokens[1] = toks(0, 11);
  CHECK_THAT(expect_error([&] { m.preempt(1, PreemptMode::kSwap); }, Errc::kInvalidArgument),
             Catch::Contains("not settled"));
  e.step({1});
  const auto before = m.stats();
  REQUIRE(m.preempt(1, PreemptMode::kSwap));
  CHECK_FALSE(m.contains(1));
  CHECK(m.is_swapped(1));
  CHECK(m.stats().preemptions == before.preemptions + 1);
  CHECK(m.stats().swap_outs == 3);
  CHECK(m.stats().blocks_used == 0);  // device blocks released at once (the swap_out runs first in the step)
  CHECK_THAT(expect_error([&] { m.try_admit(1, Toks{1}); }, Errc::kDuplicateSequence), Catch::Contains("1"));
  // Another sequence takes every device block in the same step; the swap_out still reads the old contents first.
  e.admit(2, toks(300, 32));
  CHECK(m.try_resume(1).status == AdmitStatus::kTransferPending);
  const auto s = e.step({2});
  CHECK(s.num_swap_out == 3);
  CHECK(m.try_resume(1).status == AdmitStatus::kTransferPending);  // issued, not completed
  m.complete_transfers(s.transfer_token);
  auto r = m.try_resume(1);
  CHECK(r.status == AdmitStatus::kNoCapacity);
  CHECK(r.num_missing_blocks == 3);  // sequence 2 holds every device block (its admission evicted 1's cached ones)
  m.free(2);
  r = m.try_resume(1);
  REQUIRE(r.admitted());
  CHECK(r.num_cached_tokens == 11);
  CHECK(m.num_tokens(1) == 11);
  CHECK(m.sequence(1).num_pending() == 0);
  const auto s2 = e.step({1});
  CHECK(e.reads_own());
  m.complete_transfers(s2.transfer_token);
  REQUIRE(m.try_append(1, Toks{11}).ok());  // and it goes on decoding
  e.tokens[1] = toks(0, 12);
  e.step({1});
  CHECK(e.reads_own());
  CHECK(m.stats().host_blocks_used == 0);
  m.free(1);
  CHECK(m.stats().blocks_used == 0);
}

TEST_CASE("a resumed sequence appends into its swapped-in last block in place (no copy-on-write)",
          "[host_tier][swap]") {
  Mgr m(cfg(9, 17, OffloadPolicy::kNone));
  Engine e(m);
  e.admit(1, toks(0, 10));  // blocks of 4: the last one partial (2 tokens)
  e.step({1});
  REQUIRE(m.preempt(1, PreemptMode::kSwap));
  const auto s = e.step({});
  m.complete_transfers(s.transfer_token);
  REQUIRE(m.try_resume(1).admitted());
  // The swap_in into the partial last block is queued (its fill holds a reference): the block is not shared.
  const auto a = m.try_append(1, Toks{10});
  REQUIRE(a.ok());
  CHECK_FALSE(a.copy.has_value());
  CHECK(m.pending_copies().empty());
  e.tokens[1] = toks(0, 11);
  const auto s2 = e.step({1});  // swap_in, then write_kv into the same block
  CHECK(s2.num_swap_in == 1);  // the full blocks were still cached on the device: only the partial one comes back
  CHECK(e.reads_own());
  m.complete_transfers(s2.transfer_token);
  m.free(1);
  CHECK(m.stats().blocks_used == 0);
  CHECK(m.stats().host_blocks_used == 0);
}

TEST_CASE("try_resume counts host-cached tokens, not blocks times block size", "[host_tier][swap]") {
  // The first-hour report's case: device pool 6 (5 usable), host 17, block size 4, an 11-token sequence swapped
  // out, its block 1 evicted on the device while block 0 stays cached. Resume copies blocks 1 (4 tokens) and 2 (the
  // partial tail, 3 tokens) back: 7 host tokens + 4 device tokens = the sequence's 11 (was reported as 8 + 4 = 12).
  Mgr m(cfg(6, 17, OffloadPolicy::kNone));
  Engine e(m);
  e.admit(1, toks(0, 11));
  e.step({1});
  REQUIRE(m.preempt(1, PreemptMode::kSwap));
  const auto s = e.step({});
  m.complete_transfers(s.transfer_token);
  REQUIRE(m.allocator().num_cached_blocks() == 2);  // blocks 0 and 1, released tail first: 1 is older in the LRU
  e.admit(2, toks(500, 13));  // 4 blocks: the 3 free ones + 1 eviction (block 1 of sequence 1)
  CHECK(m.stats().evictions == 1);
  e.step({2});
  m.free(2);
  const auto r = m.try_resume(1);
  REQUIRE(r.admitted());
  CHECK(r.num_cached_tokens == 11);
  CHECK(r.num_host_cached_tokens == 7);
  CHECK(r.num_new_blocks == 2);
  CHECK(r.num_host_cached_tokens <= r.num_cached_tokens);
  const auto s2 = e.step({});
  CHECK(s2.num_swap_in == 2);
  m.complete_transfers(s2.transfer_token);
  REQUIRE(m.try_append(1, Toks{11}).ok());
  e.tokens[1] = toks(0, 12);
  e.step({1});
  CHECK(e.reads_own());
}

TEST_CASE("host tier misuse and limits", "[host_tier][errors]") {
  Mgr plain(cfg(9, 0, OffloadPolicy::kWriteBack));
  REQUIRE(plain.try_admit(1, toks(0, 4)).admitted());
  pagedkv_test::build_step(plain, {1});
  CHECK_THAT(expect_error([&] { plain.preempt(1, PreemptMode::kSwap); }, Errc::kInvalidArgument),
             Catch::Contains("needs a host tier"));
  CHECK(plain.contains(1));
  CHECK_THAT(expect_error([] { Mgr x(cfg(9, 1, OffloadPolicy::kWriteBack)); }, Errc::kInvalidArgument),
             Catch::Contains("num_host_blocks = 1"));
  CHECK_THAT(expect_error([&] { plain.try_resume(1); }, Errc::kUnknownSequence), Catch::Contains("not swapped"));

  // Swap lists cannot be dropped by a build.
  Mgr m(cfg(5, 3, OffloadPolicy::kWriteBack));  // 4 device, 2 host blocks
  Engine e(m);
  e.admit(1, toks(0, 13));
  e.step({1});
  m.free(1);
  e.admit(2, toks(100, 13));  // evicts 3 cached: only 2 host blocks -> 2 offloads, 1 dropped
  CHECK(m.stats().offloads == 2);
  CHECK(m.stats().offloads_dropped == 1);
  std::vector<std::int64_t> slots(16);
  pagedkv::BatchMetadataBuffers no_swaps;
  no_swaps.slot_mapping = slots;
  CHECK_THAT(expect_error([&] { m.build_batch_metadata(std::vector<SeqId>{2}, no_swaps); }, Errc::kBadShape),
             Catch::Contains("swap_out is empty but 2 device -> host copies are queued"));
  const auto s = e.step({2});
  CHECK(s.num_swap_out == 2);
  // Pinned host blocks are not evictable: a swap needing more host blocks than are unpinned is refused.
  CHECK_FALSE(m.preempt(2, PreemptMode::kSwap));
  CHECK(m.contains(2));
  CHECK_FALSE(m.reset_prefix_cache());  // copies in flight
  m.complete_transfers(s.transfer_token);
  m.free(2);
  CHECK(m.reset_prefix_cache());
  CHECK(m.stats().host_blocks_cached == 0);
}

TEST_CASE("events of both tiers reproduce the cache: device index and the ready host blocks", "[host_tier][events]") {
  Mgr m(cfg(7, 9, OffloadPolicy::kWriteBack));
  Engine e(m);
  std::set<std::pair<pagedkv::BlockHash, Medium>> seen;
  std::uint64_t last_batch = 0;
  double ts = 0;
  SeqId next = 1;
  std::vector<std::uint64_t> tokens_to_complete;
  for (int round = 0; round < 60; ++round) {
    const SeqId id = next++;
    const Toks p = toks(static_cast<TokenId>(100 * (round % 7)), 9 + static_cast<std::size_t>(round % 3) * 4);
    const auto r = m.try_admit(id, p);
    if (r.admitted()) e.tokens[id] = p;
    std::vector<SeqId> batch;
    for (const auto& [sid, t] : e.tokens) if (m.contains(sid)) batch.push_back(sid);
    const auto sz = e.step(batch);
    REQUIRE(e.reads_own());
    if (sz.transfer_token != 0) tokens_to_complete.push_back(sz.transfer_token);
    if (round % 2 == 1 && !tokens_to_complete.empty()) {  // acknowledge late, newest first
      m.complete_transfers(tokens_to_complete.back());
      tokens_to_complete.pop_back();
    }
    for (SeqId sid : batch) {
      if (sid % 2 == 0 || round % 3 == 0) {
        m.free(sid);
        e.tokens.erase(sid);
      }
    }
    const auto b = m.take_event_batch(ts += 1);
    if (!b) continue;
    REQUIRE(b->seq_no == last_batch + 1);
    last_batch = b->seq_no;
    for (const KVEvent& x : b->events) {
      if (x.type == KVEventType::kBlockStored) {
        seen.insert({x.hash, x.medium});
        CHECK(pagedkv::rehash_stored_event<pagedkv::Xxh3Hasher>(x, 0) == x.hash);
      } else if (x.type == KVEventType::kBlockRemoved) {
        seen.erase({x.hash, x.medium});
      } else {
        std::erase_if(seen, [&](const auto& p) { return p.second == x.medium; });
      }
    }
    // The cache: every registered device block, every ready registered host block.
    std::set<std::pair<pagedkv::BlockHash, Medium>> cache;
    for (std::uint32_t blk = 1; blk < m.allocator().num_blocks(); ++blk) {
      if (const auto h = m.prefix_index().hash_of(blk)) cache.insert({*h, Medium::kGpu});
    }
    const auto* host = m.host_tier();
    for (std::uint32_t blk = 1; blk < host->allocator().num_blocks(); ++blk) {
      if (const auto h = host->index().hash_of(blk); h && host->is_ready(blk) && !m.host_event_held_back(blk)) {
        cache.insert({*h, Medium::kCpu});  // (a held-back copy, whose parent was cached nowhere, is not reported)
      }
    }
    REQUIRE(seen == cache);
  }
  CHECK(m.stats().offloads > 10);
  CHECK(m.stats().onboards > 3);
}
