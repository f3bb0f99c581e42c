// Tests of HybridKVCacheManager (include/pagedkv/kv_cache_groups.hpp): KV-cache groups (full, sliding window,
// chunked-local) in one pool (issue 13, section 1).
//
//  - [config]        every invalid configuration value is a typed error naming it;
//  - [window]        the release rule at window edges inside and across blocks, against a brute-force rule computed
//                    from the definition of the window (which positions any future query can see);
//  - [footprint]     a sliding-window group's blocks stay within ceil((W - 1 + chunk) / bs) + 1 while long sequences
//                    grow (and reach it), chunked-local within the analogous bound, full groups hold everything;
//  - [prefix]        the hit fixed point against a brute-force oracle (random bitmaps and random caches built by the
//                    manager itself), hits past the window, leading null blocks of a hit;
//  - [registration]  which blocks are registered (never for W = 1, never the last block of a chunk) and events name
//                    their group;
//  - [strong]        failed calls (no capacity, never fits, misuse) leave a full state snapshot unchanged;
//  - [lookahead]     rejected lookahead drafts never leave the next query's window released (a fixed bug);
//  - [model]         randomized operations against a shadow model, with a shadow pool that executes each build's
//                    copies and slot mappings: every built position of every group reads back its own content;
//                    [model_full] adds lookahead (drafts reserved, built, a random prefix accepted), prepared
//                    prompts and a host tier (write-back offload, host hits onboarded at admission, swap preemption
//                    and try_resume, complete_transfers in random order) with a shadow host pool executing each
//                    build's swap_out / swap_in lists: every registered block (device index of each group, host
//                    index) holds the content of the token prefix its hash names, every swapped sequence's host
//                    blocks hold its positions; [retention] runs the same under PriorityLruEviction with retention
//                    configs: every block a free leaves cached has the priority its config gives its position;
//  - [model_coarse]  the same harness with full groups of coarse pages (KVCacheGroupSpec::block_size 2-4x the
//                    pool's) beside full, sliding-window and chunked-local groups: the shadow pool stores per slot
//                    (page * page size + offset), a registered coarse page keyed at match block j holds its
//                    prefix's positions from its page's start to the end of block j, no table slots a position
//                    under a key that names other ids, hits equal an oracle of coarse hits (every full page keyed
//                    at its last match block, the hit's last page at the hit's), explain_admit's coarse runs and
//                    kLimitedByGroup agree with it, the events replay to each group's index; [retention] runs it
//                    under PriorityLruEviction (a page's priority is its first position's); plus the regression
//                    test of a coarse page re-keyed by one holder and written in place by another ([cow]);
//  - [e2e]           CPU reference decode with an AttentionWindow over the sliding-window group's page table (null
//                    entries before the window) equals the float64 result over the full-attention group's table.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/kv_cache_groups.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)
#include "support/seed_count.hpp"
#include <pagedkv/reference/decode.hpp>
#include <pagedkv/reference/write_kv.hpp>

#include "test_support.hpp"

namespace {

using pagedkv::AdmitStatus;
using pagedkv::AppendStatus;
using pagedkv::AttentionKind;
using pagedkv::AttentionWindow;
using pagedkv::BatchMetadataBuffers;
using pagedkv::BatchMetadataSizes;
using pagedkv::BlockHash;
using pagedkv::Errc;
using pagedkv::HybridCacheConfig;
using pagedkv::KVCacheGroupSpec;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::expect_error;
using Mgr = pagedkv::HybridKVCacheManager<pagedkv::Xxh3Hasher>;
using Toks = std::vector<TokenId>;

KVCacheGroupSpec full(std::uint32_t layers = 1) { return {AttentionKind::kFull, 0, layers}; }
KVCacheGroupSpec swa(std::uint32_t w, std::uint32_t layers = 1) { return {AttentionKind::kSlidingWindow, w, layers}; }
KVCacheGroupSpec chunked(std::uint32_t c, std::uint32_t layers = 1) { return {AttentionKind::kChunkedLocal, c, layers}; }
/// A full-attention group with pages of `page` tokens (a multiple of the pool's block size: coarse pages).
KVCacheGroupSpec full_pages(std::uint32_t page) {
  KVCacheGroupSpec s = full();
  s.block_size = page;
  return s;
}

HybridCacheConfig make_config(std::size_t num_blocks, std::uint32_t bs, std::vector<KVCacheGroupSpec> groups,
                              bool events = false) {
  HybridCacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = bs;
  c.groups = std::move(groups);
  c.enable_events = events;
  return c;
}

// Brute force, from the definition: can a query at q see key t?
bool visible(const KVCacheGroupSpec& g, std::size_t q, std::size_t t) {
  if (t > q) return false;
  if (g.kind == AttentionKind::kSlidingWindow) return q - t < g.window_tokens;
  if (g.kind == AttentionKind::kChunkedLocal) return t / g.window_tokens == q / g.window_tokens;
  return true;
}
// Brute force: the first logical block some query at a position >= next_query can still see (queries up to
// next_query + horizon are tried; the first visible key is non-decreasing, so a horizon of 0 suffices, but the brute
// force does not assume it).
std::size_t brute_first_kept_block(const KVCacheGroupSpec& g, std::size_t next_query, std::uint32_t bs) {
  std::size_t first = std::numeric_limits<std::size_t>::max();
  for (std::size_t q = next_query; q < next_query + 3 * bs + 2 * (g.window_tokens + 1); ++q) {
    for (std::size_t t = 0; t <= q; ++t) {
      if (visible(g, q, t)) {
        first = std::min(first, t);
        break;
      }
    }
  }
  return first / bs;
}

/// Per-group buffers sized for `m`'s live sequences (a build of every pending token), every output on.
struct GroupBuffers {
  std::vector<std::vector<std::int32_t>> indptr, indices, last_page_len, seq_lens, qo_indptr, copies, block_tables;
  std::vector<std::vector<std::int64_t>> slots;
  std::vector<std::int32_t> swap_out, swap_in;  // group 0's (the host tier's swap lists)
  std::vector<BatchMetadataBuffers> views;
  GroupBuffers(std::size_t groups, std::size_t batch, std::size_t max_blocks, std::size_t tokens, std::size_t copies_n,
               std::size_t swaps = 0) {
    indptr.resize(groups);
    indices.resize(groups);
    last_page_len.resize(groups);
    seq_lens.resize(groups);
    qo_indptr.resize(groups);
    copies.resize(groups);
    block_tables.resize(groups);
    slots.resize(groups);
    views.resize(groups);
    for (std::size_t g = 0; g < groups; ++g) {
      indptr[g].assign(batch + 1, -7);
      indices[g].assign(std::max<std::size_t>(1, batch * max_blocks), -7);
      last_page_len[g].assign(std::max<std::size_t>(1, batch), -7);
      seq_lens[g].assign(std::max<std::size_t>(1, batch), -7);
      qo_indptr[g].assign(batch + 1, -7);
      copies[g].assign(2 * std::max<std::size_t>(1, copies_n), -7);
      block_tables[g].assign(std::max<std::size_t>(1, batch * max_blocks), -7);
      slots[g].assign(std::max<std::size_t>(1, tokens), -7);
      BatchMetadataBuffers& v = views[g];
      v.indptr = indptr[g];
      v.indices = indices[g];
      v.last_page_len = last_page_len[g];
      v.seq_lens = seq_lens[g];
      v.qo_indptr = qo_indptr[g];
      v.copies = copies[g];
      v.block_tables = block_tables[g];
      v.max_blocks_per_seq = static_cast<std::int32_t>(std::max<std::size_t>(1, max_blocks));
      v.slot_mapping = slots[g];
    }
    swap_out.assign(2 * std::max<std::size_t>(1, swaps), -7);
    swap_in.assign(2 * std::max<std::size_t>(1, swaps), -7);
    views[0].swap_out = swap_out;
    views[0].swap_in = swap_in;
  }
  GroupBuffers(GroupBuffers&&) = default;  // the views point into the vectors' heap storage: a move keeps them
};

/// Build `requested` (each sequence all its pending tokens, or `sched`) with buffers large enough. Without `sched`,
/// like an engine's scheduler, the sequences with nothing to compute are left out (a build refuses them).
template <class M>
std::pair<std::vector<BatchMetadataSizes>, GroupBuffers> build(M& m, const std::vector<SeqId>& requested,
                                                               std::vector<std::uint32_t> sched = {}) {
  std::vector<SeqId> batch;
  for (SeqId id : requested) {
    if (!sched.empty() || !m.contains(id) || m.num_tokens(id) > m.num_built(id)) batch.push_back(id);
  }
  std::size_t tokens = 0, max_blocks = 1;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const SeqId id = batch[b];
    tokens += sched.empty() ? m.num_tokens(id) - m.num_built(id) : sched[b];
    max_blocks = std::max(max_blocks, (m.num_tokens(id) + m.block_size() - 1) / m.block_size());
  }
  GroupBuffers buf(m.num_groups(), batch.size(), max_blocks, tokens, m.pending_copies().size(),
                   m.transfers().queued().size());
  auto sizes = m.build_batch_metadata(batch, buf.views, sched);
  return {std::move(sizes), std::move(buf)};
}

/// Everything observable about a manager, for strong-guarantee checks.
struct Snapshot {
  std::map<SeqId, std::tuple<std::vector<TokenId>, std::size_t, std::size_t, std::vector<std::vector<std::uint32_t>>>> seqs;
  std::vector<std::tuple<std::uint32_t, bool, bool>> blocks;
  std::vector<std::uint32_t> lru;
  std::vector<std::size_t> held, index_sizes;
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>> copies;
  std::vector<std::uint64_t> stats;
  std::vector<std::tuple<std::uint32_t, bool, bool>> host_blocks;  // refcount, cached, ready
  std::vector<std::tuple<std::uint32_t, std::uint32_t, int>> transfers;  // queued: device, host, kind
  std::size_t num_swapped = 0, in_flight = 0;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};
template <class M>
Snapshot snapshot(const M& m) {
  Snapshot s;
  m.for_each_sequence([&](SeqId id, std::size_t) {
    std::vector<std::vector<std::uint32_t>> tables;
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      const auto b = m.block_ids(id, g);
      tables.emplace_back(b.begin(), b.end());
    }
    const auto t = m.token_ids(id);
    s.seqs[id] = {std::vector<TokenId>(t.begin(), t.end()), m.num_tokens(id), m.num_built(id), tables};
  });
  const auto& a = m.allocator();
  for (std::uint32_t b = 1; b < a.num_blocks(); ++b) s.blocks.emplace_back(a.refcount(b), a.is_hashed(b), a.is_cached(b));
  s.lru = a.eviction_policy().order();
  for (std::size_t g = 0; g < m.num_groups(); ++g) {
    s.held.push_back(m.held_blocks(g));
    s.index_sizes.push_back(m.prefix_index(g).size());
  }
  for (const auto& c : m.pending_copies()) s.copies.emplace_back(c.src, c.dst, c.group);
  const auto st = m.stats();
  s.stats = {st.blocks_used, st.blocks_cached, st.blocks_free, st.prefix_query_requests, st.prefix_hit_tokens,
             st.evictions, st.cow_copies, st.preemptions, st.block_ops, st.host_blocks_used, st.host_blocks_cached,
             st.offloads, st.onboards, st.swap_outs, st.swap_ins, st.host_evictions, st.host_hit_tokens};
  if (const auto* host = m.host_tier()) {
    for (std::uint32_t b = 1; b < host->allocator().num_blocks(); ++b) {
      s.host_blocks.emplace_back(host->allocator().refcount(b), host->allocator().is_cached(b), host->is_ready(b));
    }
  }
  for (const auto& t : m.transfers().queued()) s.transfers.emplace_back(t.device, t.host, static_cast<int>(t.kind));
  s.num_swapped = m.num_swapped();
  s.in_flight = m.transfers().in_flight().size();
  return s;
}

/// Chain hashes of the full blocks of `tokens` under `m`'s root.
template <class M>
std::vector<BlockHash> chain(const M& m, const Toks& tokens) {
  std::vector<BlockHash> h;
  m.prefix_index(0).hash_full_blocks(tokens, m.block_size(), nullptr, h);
  return h;
}

/// The brute-force hit oracle: the largest k <= cap / bs such that every group g holds every block of
/// [lo_g(k), k) in its index, lo_g from the definition of visibility (the first key the query at k * bs sees).
std::size_t oracle_hit_blocks(const Mgr& m, const Toks& prompt) {
  const std::uint32_t bs = m.block_size();
  const auto h = chain(m, prompt);
  const std::size_t cap = std::min(h.size(), (prompt.size() - 1) / bs);
  for (std::size_t k = cap; k > 0; --k) {
    bool ok = true;
    for (std::size_t g = 0; g < m.num_groups() && ok; ++g) {
      const KVCacheGroupSpec& spec = m.config().groups[g];
      std::size_t first = k * bs;
      for (std::size_t t = 0; t < k * bs; ++t) {
        if (visible(spec, k * bs, t)) {
          first = t;
          break;
        }
      }
      for (std::size_t i = first / bs; i < k && ok; ++i) ok = m.prefix_index(g).find(h[i]).has_value();
    }
    if (ok) return k;
  }
  return 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------------

TEST_CASE("HybridKVCacheManager: invalid configurations are typed errors naming the value",
          "[kv_cache_groups][config]") {
  const auto bad = [](HybridCacheConfig c, Errc code, const std::string& needle) {
    const std::string msg = expect_error([&] { Mgr m(c); }, code);
    CAPTURE(msg, needle);
    CHECK(msg.find(needle) != std::string::npos);
  };
  bad(make_config(1, 4, {full()}), Errc::kInvalidArgument, "num_blocks = 1");
  bad(make_config(16, 0, {full()}), Errc::kInvalidArgument, "block_size = 0");
  bad(make_config(16, std::uint32_t{1} << 31, {full()}), Errc::kInvalidArgument, "kMaxBlockSize = 65536");
  {  // No group at all is the plain pool: one full-attention group (CacheConfig and HybridCacheConfig are one type).
    Mgr plain(make_config(16, 4, {}));
    CHECK(plain.num_groups() == 1);
    CHECK_FALSE(plain.window(0).enabled());
    CHECK(plain.config().groups.size() == 1);
    CHECK(plain.config().groups[0].kind == AttentionKind::kFull);
  }
  bad(make_config(16, 4, std::vector<KVCacheGroupSpec>(65, full())), Errc::kInvalidArgument, "65 groups");
  bad(make_config(16, 4, {full(), {AttentionKind::kFull, 8, 1}}), Errc::kInvalidArgument,
      "groups[1] (full).window_tokens = 8");
  bad(make_config(16, 4, {swa(0)}), Errc::kInvalidArgument, "groups[0] (sliding_window).window_tokens = 0");
  bad(make_config(16, 4, {full(), chunked(0)}), Errc::kInvalidArgument, "groups[1] (chunked_local).window_tokens = 0");
  bad(make_config(16, 4, {swa(0x80000000U)}), Errc::kInvalidArgument, "window_tokens = 2147483648");
  bad(make_config(16, 4, {full(), swa(8, 0)}), Errc::kInvalidArgument, "groups[1] (sliding_window).num_layers = 0");
  bad(make_config(16, 4, {{static_cast<AttentionKind>(7), 0, 1}}), Errc::kInvalidArgument, "unknown attention kind 7");
  {
    auto c = make_config(16, 4, {full()});
    c.max_tokens_per_seq = std::size_t{1} << 31;
    bad(c, Errc::kLimitExceeded, "max_tokens_per_seq");
  }
  {
    auto c = make_config(16, 4, {full(2), swa(8, 3)});
    c.page_size_bytes = std::numeric_limits<std::size_t>::max() / 2;
    bad(c, Errc::kInvalidArgument, "overflows");
  }
  // A valid one: bytes per block = page x the largest group's layers.
  auto c = make_config(16, 4, {full(2), swa(8, 3)});
  c.page_size_bytes = 1000;
  Mgr m(c);
  CHECK(m.bytes_per_block() == 3000);
  CHECK(m.window(1).sliding_window_tokens == 8);
  CHECK_FALSE(m.window(0).enabled());
  CHECK(*m.window_block_bound(1, 1) == 3);  // ceil((8 - 1 + 1) / 4) + 1
  CHECK_FALSE(m.window_block_bound(0, 1).has_value());
  expect_error([&] { (void)m.held_blocks(2); }, Errc::kInvalidArgument);
}

TEST_CASE("HybridKVCacheManager: window helpers match the definition", "[kv_cache_groups][window]") {
  for (std::uint32_t bs : {1U, 3U, 4U, 8U}) {
    for (std::uint32_t w : {1U, 2U, 3U, 4U, 5U, 7U, 8U, 9U, 16U, 17U}) {
      for (const KVCacheGroupSpec& spec : {swa(w), chunked(w)}) {
        const AttentionWindow win = spec.window();
        for (std::size_t q = 0; q < 60; ++q) {
          CAPTURE(bs, w, static_cast<int>(spec.kind), q);
          REQUIRE(pagedkv::detail::first_kept_block(win, q, bs) == brute_first_kept_block(spec, q, bs));
          // block_can_serve_hit(i): some hit length k > i needs block i (needs = blocks the query at k * bs sees).
          const std::size_t i = q;
          bool needed = false;
          for (std::size_t k = i + 1; k < i + 3 + 2 * w / bs + 2 && !needed; ++k) {
            for (std::size_t t = i * bs; t < (i + 1) * bs && !needed; ++t) needed = visible(spec, k * bs, t) && t < k * bs;
          }
          REQUIRE(pagedkv::detail::block_can_serve_hit(win, i, bs) == needed);
        }
      }
    }
  }
}

TEST_CASE("HybridKVCacheManager: out-of-window blocks are released at each build, edges inside and across blocks",
          "[kv_cache_groups][window]") {
  const std::uint32_t bs = 4;
  for (const KVCacheGroupSpec& spec : {swa(1), swa(2), swa(3), swa(4), swa(5), swa(8), swa(9), swa(13), chunked(1),
                                       chunked(3), chunked(4), chunked(6), chunked(8), chunked(9)}) {
    for (std::size_t chunk : {std::size_t{1}, std::size_t{3}, std::size_t{5}}) {
      CAPTURE(static_cast<int>(spec.kind), spec.window_tokens, chunk);
      Mgr m(make_config(64, bs, {full(), spec}));
      std::mt19937 rng(spec.window_tokens * 31 + chunk);
      Toks prompt = pagedkv_test::toks(1000, 1 + rng() % 6);
      REQUIRE(m.try_admit(1, prompt).admitted());
      (void)build(m, {1});
      for (int step = 0; step < 40; ++step) {
        const std::size_t built = m.num_built(1);
        const std::size_t kept = brute_first_kept_block(spec, built, bs);
        const auto tbl = m.block_ids(1, 1);
        CAPTURE(step, built, kept);
        REQUIRE(m.num_null_blocks(1, 1) == kept);
        for (std::size_t i = 0; i < tbl.size(); ++i) REQUIRE((tbl[i] == 0) == (i < kept));
        REQUIRE(m.num_null_blocks(1, 0) == 0);  // the full group keeps everything
        for (std::uint32_t b : m.block_ids(1, 0)) REQUIRE(b != 0);
        // Never more than the window needs: held = blocks from the first kept one to the last.
        REQUIRE(m.held_blocks(1) == tbl.size() - kept);
        REQUIRE(m.try_append(1, pagedkv_test::toks(static_cast<TokenId>(step * 10), chunk)).ok());
        // Appending releases nothing (only a build moves the window).
        REQUIRE(m.num_null_blocks(1, 1) == kept);
        (void)build(m, {1});
      }
      m.free(1);
      REQUIRE(m.stats().blocks_used == 0);
      REQUIRE(m.held_blocks(0) == 0);
      REQUIRE(m.held_blocks(1) == 0);
    }
  }
}

TEST_CASE("HybridKVCacheManager: a chunked prefill releases as it goes - the build's page table still has the window",
          "[kv_cache_groups][window]") {
  const std::uint32_t bs = 4;
  Mgr m(make_config(64, bs, {full(), swa(6)}));
  const Toks prompt = pagedkv_test::toks(1, 40);
  pagedkv::AdmitOptions o;
  o.num_reserved_tokens = 8;
  REQUIRE(m.try_admit(7, prompt, nullptr, o).admitted());
  CHECK(m.num_tokens(7) == 8);
  expect_error([&] { (void)m.try_append(7, pagedkv_test::toks(5, 1)); }, Errc::kInvalidArgument);
  std::size_t done = 0;
  while (done < 40) {
    const std::size_t q = std::min<std::size_t>(8, 40 - done);
    if (m.num_tokens(7) < done + q) REQUIRE(m.try_reserve(7, done + q - m.num_tokens(7)).ok());
    auto [sizes, buf] = build(m, {7}, {static_cast<std::uint32_t>(q)});
    // The page table of this step: entries before first_needed_token(seq_len, q_len) may be null, none after.
    const std::size_t seq_len = done + q;
    const std::size_t first_needed = static_cast<std::size_t>(m.window(1).first_needed_token(
        static_cast<std::int64_t>(seq_len), static_cast<std::int64_t>(q)));
    REQUIRE(sizes[1].num_indices == (seq_len + bs - 1) / bs);
    for (std::size_t i = first_needed / bs; i < sizes[1].num_indices; ++i) REQUIRE(buf.indices[1][i] != 0);
    REQUIRE(buf.seq_lens[1][0] == static_cast<std::int32_t>(seq_len));
    REQUIRE(buf.seq_lens[0][0] == static_cast<std::int32_t>(seq_len));
    REQUIRE(buf.qo_indptr[1][1] == static_cast<std::int32_t>(q));
    for (std::size_t j = 0; j < q; ++j) {  // slots of the window group: its own blocks
      const std::size_t p = done + j;
      REQUIRE(buf.slots[1][j] == static_cast<std::int64_t>(buf.indices[1][p / bs]) * bs + static_cast<std::int64_t>(p % bs));
      REQUIRE(buf.slots[0][j] == static_cast<std::int64_t>(buf.indices[0][p / bs]) * bs + static_cast<std::int64_t>(p % bs));
    }
    done += q;
    // Bound for a step of 8 tokens: ceil((6 - 1 + 8) / 4) + 1 = 5 blocks.
    REQUIRE(m.held_blocks(1) <= *m.window_block_bound(1, 8));
  }
  CHECK(m.num_null_blocks(7, 1) == static_cast<std::size_t>(m.window(1).first_visible(40)) / bs);
}

TEST_CASE("HybridKVCacheManager: footprint bound while long sequences grow", "[kv_cache_groups][footprint]") {
  const std::uint32_t bs = 16;
  for (std::size_t chunk : {std::size_t{1}, std::size_t{7}, std::size_t{64}}) {
    Mgr m(make_config(24000, bs, {full(), swa(100), chunked(64), swa(1)}));
    const int n_seqs = 4;
    std::vector<std::size_t> max_per_seq(4, 0);
    for (int s = 0; s < n_seqs; ++s) {
      pagedkv::AdmitOptions o;
      o.num_reserved_tokens = 0;  // the prompt is reserved chunk by chunk below
      REQUIRE(m.try_admit(static_cast<SeqId>(s), pagedkv_test::toks(s * 100000, 500 + 37 * s), nullptr, o).admitted());
    }
    std::vector<std::size_t> peak(4, 0);
    for (int step = 0; step < 300; ++step) {
      std::vector<SeqId> batch;
      std::vector<std::uint32_t> sched;
      for (int s = 0; s < n_seqs; ++s) {
        const SeqId id = static_cast<SeqId>(s);
        const std::size_t c = chunk;  // exactly `chunk` per step, so the bound is reached
        const std::size_t unslotted = m.token_ids(id).size() - m.num_tokens(id);
        if (unslotted > 0) {
          REQUIRE(m.try_reserve(id, std::min(c, unslotted)).ok());
        } else {
          REQUIRE(m.try_append(id, pagedkv_test::toks(step * 1000 + s, c)).ok());
        }
        batch.push_back(id);
        sched.push_back(static_cast<std::uint32_t>(m.num_tokens(id) - m.num_built(id)));
      }
      // Before the build each sequence holds at most the bound (W - 1 + chunk tokens, plus the partial head block).
      for (std::size_t g = 1; g < 4; ++g) {
        const std::size_t per_seq = *m.window_block_bound(g, chunk);
        std::size_t held = 0;
        for (int s = 0; s < n_seqs; ++s) {
          const auto t = m.block_ids(static_cast<SeqId>(s), g);
          const std::size_t nonnull = static_cast<std::size_t>(std::count_if(t.begin(), t.end(), [](auto b) { return b != 0; }));
          REQUIRE(nonnull <= per_seq);
          max_per_seq[g] = std::max(max_per_seq[g], nonnull);
          held += nonnull;
        }
        REQUIRE(m.held_blocks(g) == held);  // no sharing here: held = sum over sequences
        peak[g] = std::max(peak[g], held);
      }
      (void)build(m, batch, sched);
    }
    const std::size_t len0 = m.num_tokens(0);
    CHECK(m.held_blocks(0) >= (len0 + bs - 1) / bs);  // the full group keeps everything
    // The bound is reached (so the check above can fail): some sequence hit it at some step.
    // The bound is reached where the window's start cycles through every offset in a block (chunk coprime to the
    // block size): W - 1 + chunk positions touch at most ceil((W - 2 + chunk) / bs) + 1 blocks, which is the
    // documented bound except when W - 1 + chunk = 1 mod bs (then it is one less).
    if (chunk != 64) {
      CHECK(max_per_seq[1] == (100 - 2 + chunk + bs - 1) / bs + 1);
      CHECK(max_per_seq[3] == (chunk + bs - 2) / bs + 1);
    }
    CHECK(m.peak_held_blocks(1) >= peak[1]);
    CHECK(m.held_blocks(3) <= static_cast<std::size_t>(n_seqs) * *m.window_block_bound(3, chunk));
  }
}

TEST_CASE("HybridKVCacheManager: the hit fixed point equals the brute-force maximum on random bitmaps",
          "[kv_cache_groups][prefix]") {
  std::mt19937_64 rng(42);
  for (int trial = 0; trial < 3000; ++trial) {
    const std::uint32_t bs = 1 + static_cast<std::uint32_t>(rng() % 8);
    const std::size_t G = 1 + rng() % 4;
    std::vector<AttentionWindow> w(G);
    for (auto& x : w) {
      switch (rng() % 4) {
        case 0: break;
        case 1: x.sliding_window_tokens = static_cast<std::int32_t>(1 + rng() % 40); break;
        case 2: x.attention_chunk_tokens = static_cast<std::int32_t>(1 + rng() % 40); break;
        default:
          x.sliding_window_tokens = static_cast<std::int32_t>(1 + rng() % 40);
          x.attention_chunk_tokens = static_cast<std::int32_t>(1 + rng() % 40);
      }
    }
    const std::size_t n = rng() % 30;
    const double density = 0.5 + 0.5 * static_cast<double>(rng() % 100) / 100.0;
    std::vector<std::vector<bool>> cached(G, std::vector<bool>(n));
    for (auto& row : cached) {
      for (std::size_t i = 0; i < n; ++i) row[i] = static_cast<double>(rng() % 1000) < density * 1000.0;
    }
    std::size_t calls = 0;
    const std::size_t got = pagedkv::detail::fixed_point_hit_blocks(w, bs, n, [&](std::size_t g, std::size_t i) {
      ++calls;
      return static_cast<bool>(cached[g][i]);
    });
    std::size_t want = 0;
    for (std::size_t k = n; k > 0 && want == 0; --k) {
      bool ok = true;
      for (std::size_t g = 0; g < G && ok; ++g) {
        std::size_t first = k * bs;
        for (std::size_t t = 0; t < k * bs; ++t) {
          if (t >= static_cast<std::size_t>(w[g].first_visible(static_cast<std::int64_t>(k * bs)))) {
            first = t;
            break;
          }
        }
        for (std::size_t i = first / bs; i < k && ok; ++i) ok = cached[g][i];
      }
      if (ok) want = k;
    }
    CAPTURE(trial, bs, G, n);
    REQUIRE(got == want);
    REQUIRE(calls <= G * n);
  }
}

TEST_CASE("HybridKVCacheManager: admission hits equal the oracle on random caches - window groups take only the window",
          "[kv_cache_groups][prefix]") {
  const std::uint32_t bs = 4;
  std::mt19937_64 rng(7);
  Mgr m(make_config(120, bs, {full(), swa(6), chunked(12), swa(11)}));
  std::vector<Toks> prefixes;
  for (int i = 0; i < 5; ++i) prefixes.push_back(pagedkv_test::toks(i * 10000, 8 + rng() % 40));
  std::size_t hits = 0, partial = 0;
  SeqId next = 1;
  std::vector<SeqId> live;
  for (int op = 0; op < 600; ++op) {
    Toks p = prefixes[rng() % prefixes.size()];
    p.resize(std::min(p.size(), 1 + rng() % (p.size() + 4)));
    const std::size_t suffix = 1 + rng() % 12;
    for (std::size_t j = 0; j < suffix; ++j) p.push_back(static_cast<TokenId>(rng() % 3 == 0 ? 7 : rng() % 100000));
    const std::size_t want = oracle_hit_blocks(m, p) * bs;
    REQUIRE(m.lookup(p) == want);
    const auto q = m.query_admit(p);
    REQUIRE(q.num_cached_tokens == want);
    const Snapshot before = snapshot(m);
    const SeqId id = next++;
    const auto r = m.try_admit(id, p);
    REQUIRE(static_cast<int>(r.status) == static_cast<int>(q.status));
    if (!r.admitted()) {
      REQUIRE(snapshot(m) == before);
      while (!live.empty() && m.query_admit(p).status == pagedkv::CapacityStatus::kNoCapacity) {
        m.free(live.front());
        live.erase(live.begin());
      }
      continue;
    }
    REQUIRE(r.num_cached_tokens == want);
    hits += want > 0;
    // Leading nulls of each windowed group: exactly the blocks the first computed query cannot see.
    const std::size_t k = want / bs;
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      const std::size_t lo = pagedkv::detail::first_kept_block(m.window(g), k * bs, bs);
      REQUIRE(m.num_null_blocks(id, g) == lo);
      const auto t = m.block_ids(id, g);
      const auto h = chain(m, p);
      for (std::size_t i = 0; i < k; ++i) {
        if (i < lo) {
          REQUIRE(t[i] == 0);
        } else {
          REQUIRE(m.prefix_index(g).hash_of(t[i]) == std::optional<BlockHash>(h[i]));  // the cached block itself
          REQUIRE(m.group_of(t[i]) == g);
        }
      }
      if (lo > 0 && lo < k) ++partial;
    }
    (void)build(m, {id});
    live.push_back(id);
    if (live.size() > 4 || rng() % 3 == 0) {
      const std::size_t v = rng() % live.size();
      m.free(live[v]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(v));
    }
  }
  CHECK(hits > 100);
  CHECK(partial > 20);
  CHECK(m.stats().evictions > 0);
}

TEST_CASE("HybridKVCacheManager: prefix hits past the window do not fall to zero", "[kv_cache_groups][prefix]") {
  const std::uint32_t bs = 16;
  Mgr m(make_config(2000, bs, {full(), swa(128), swa(128)}));
  const Toks conv = pagedkv_test::toks(5, 3000);  // ~23 windows
  REQUIRE(m.try_admit(1, conv).admitted());
  (void)build(m, {1});
  for (int i = 0; i < 20; ++i) {
    REQUIRE(m.try_append(1, pagedkv_test::toks(100000 + i, 1)).ok());
    (void)build(m, {1});
  }
  m.free(1);
  // The next turn of the conversation: the whole history plus a new message.
  Toks turn = conv;
  for (int i = 0; i < 20; ++i) turn.push_back(100000 + i);
  for (int i = 0; i < 50; ++i) turn.push_back(200000 + i);
  const auto r = m.try_admit(2, turn);
  REQUIRE(r.admitted());
  CHECK(r.num_cached_tokens == (conv.size() + 20) / bs * bs);  // every full block the first turn wrote
  // The window groups took only the blocks the first computed query sees: at most ceil(127 / 16) + 1 hit blocks.
  const std::size_t k = r.num_cached_tokens / bs;
  for (std::size_t g = 1; g < 3; ++g) {
    const auto t = m.block_ids(2, g);
    const auto nonnull_hits = static_cast<std::size_t>(std::count_if(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(k),
                                                                     [](auto b) { return b != 0; }));
    CHECK(nonnull_hits <= 9);
    CHECK(nonnull_hits >= 8);
  }
  // Evict the out-of-window SWA blocks' neighbours: a cache without the window's blocks gives a shorter hit, never a
  // wrong one (the oracle agrees).
  m.free(2);
  CHECK(m.lookup(turn) == oracle_hit_blocks(m, turn) * bs);
}

TEST_CASE("HybridKVCacheManager: registration skips blocks that can never serve a hit - events name the group",
          "[kv_cache_groups][registration]") {
  const std::uint32_t bs = 4;
  Mgr m(make_config(200, bs, {full(), swa(1), chunked(8), swa(5)}, /*events=*/true));
  const Toks p = pagedkv_test::toks(3, 41);  // 10 full blocks
  REQUIRE(m.try_admit(1, p).admitted());
  (void)build(m, {1});
  CHECK(m.prefix_index(0).size() == 10);
  CHECK(m.prefix_index(1).size() == 0);  // W = 1: a query sees only itself
  CHECK(m.prefix_index(2).size() == 5);  // chunked C = 8 = 2 blocks: the last block of each chunk never serves
  CHECK(m.prefix_index(3).size() == 10);
  std::vector<pagedkv::KVEvent> ev;
  m.drain_events(ev);
  std::map<std::uint32_t, std::size_t> per_group;
  for (const auto& e : ev) {
    REQUIRE(e.type == pagedkv::KVEventType::kBlockStored);
    ++per_group[e.group];
    REQUIRE(pagedkv::rehash_stored_event<pagedkv::Xxh3Hasher>(e, 0) == e.hash);
    if (e.group == 2) REQUIRE((e.block_start / bs) % 2 == 0);
  }
  CHECK(per_group[0] == 10);
  CHECK(per_group.count(1) == 0);
  CHECK(per_group[2] == 5);
  CHECK(per_group[3] == 10);
  // The chunked group can still serve hits: at chunk starts it needs nothing, inside a chunk its own blocks.
  m.free(1);
  Toks again = p;
  again.push_back(99);
  CHECK(m.lookup(again) == 40);
  // Evictions name their group too: fill the pool with other content.
  for (SeqId s = 10; s < 30; ++s) {
    if (!m.try_admit(s, pagedkv_test::toks(static_cast<TokenId>(s * 1000), 20)).admitted()) break;
    (void)build(m, {s});
    m.free(s);
  }
  ev.clear();
  m.drain_events(ev);
  bool removed_chunked = false;
  for (const auto& e : ev) removed_chunked |= e.type == pagedkv::KVEventType::kBlockRemoved && e.group == 2;
  CHECK(removed_chunked);
  CHECK(m.reset_prefix_cache());
  for (std::size_t g = 0; g < 4; ++g) CHECK(m.prefix_index(g).size() == 0);
}

TEST_CASE("HybridKVCacheManager: the groups share one prefix index - keys mixed per group, views per group",
          "[kv_cache_groups][index]") {
  const std::uint32_t bs = 4;
  // group_block_key: group 0 is the hash itself; other groups' keys differ from it and from each other, and mixing
  // twice gives the hash back.
  const BlockHash h0 = pagedkv::Xxh3Hasher::hash(std::span<const std::byte>());
  CHECK(pagedkv::group_block_key(h0, 0) == h0);
  CHECK_FALSE(pagedkv::group_block_key(h0, 1) == h0);
  CHECK_FALSE(pagedkv::group_block_key(h0, 1) == pagedkv::group_block_key(h0, 2));
  for (std::size_t g = 0; g < 8; ++g) CHECK(pagedkv::group_block_key(pagedkv::group_block_key(h0, g), g) == h0);

  Mgr m(make_config(200, bs, {full(), swa(5), full()}));
  Mgr one(make_config(200, bs, {}));
  // One table for the pool, whatever the number of groups.
  CHECK(m.prefix_index().memory_bytes() == one.prefix_index().memory_bytes());
  const Toks p = pagedkv_test::toks(7, 41);  // 10 full blocks, cached by all three groups
  REQUIRE(m.try_admit(1, p).admitted());
  (void)build(m, {1});
  std::vector<BlockHash> h;
  m.prefix_index(0).hash_full_blocks(p, bs, nullptr, h);
  REQUIRE(h.size() == 10);
  std::size_t total = 0;
  for (std::size_t g = 0; g < 3; ++g) {
    const auto t = m.block_ids(1, g);
    total += m.prefix_index(g).size();
    CHECK(m.prefix_index(g).group() == g);
    for (std::size_t i = 0; i < h.size(); ++i) {
      if (t[i] == 0) continue;  // released by the window group
      // Found under the group's own hash, and in the shared index under the mixed key.
      CHECK(m.prefix_index(g).find(h[i]) == std::optional<std::uint32_t>(t[i]));
      CHECK(m.prefix_index().find(pagedkv::group_block_key(h[i], g)) == std::optional<std::uint32_t>(t[i]));
      CHECK(m.prefix_index(g).hash_of(t[i]) == std::optional<BlockHash>(h[i]));
      for (std::size_t o = 0; o < 3; ++o) {
        if (o != g) CHECK_FALSE(m.prefix_index(o).hash_of(t[i]).has_value());  // another group's block
      }
    }
  }
  CHECK(m.prefix_index(0).size() == 10);
  CHECK(m.prefix_index(2).size() == 10);
  CHECK(m.prefix_index().size() == total);
  // Eviction and reset keep the per-group counts equal to the shared table's.
  m.free(1);
  for (SeqId s = 10; s < 40; ++s) {
    if (!m.try_admit(s, pagedkv_test::toks(static_cast<TokenId>(s * 1000), 30)).admitted()) break;
    (void)build(m, {s});
    m.free(s);
  }
  CHECK(m.stats().evictions > 0);
  CHECK(m.prefix_index(0).size() + m.prefix_index(1).size() + m.prefix_index(2).size() == m.prefix_index().size());
  CHECK(m.reset_prefix_cache());
  CHECK(m.prefix_index().size() == 0);
  for (std::size_t g = 0; g < 3; ++g) CHECK(m.prefix_index(g).size() == 0);
}

TEST_CASE("HybridKVCacheManager: fork shares every group's blocks - copy-on-write per group", "[kv_cache_groups][cow]") {
  const std::uint32_t bs = 4;
  Mgr m(make_config(64, bs, {full(), swa(5)}));
  REQUIRE(m.try_admit(1, pagedkv_test::toks(1, 14)).admitted());
  expect_error([&] { m.fork(1, 2); }, Errc::kInvalidArgument);  // not built yet
  (void)build(m, {1});
  const Snapshot before = snapshot(m);
  m.fork(1, 2);
  for (std::size_t g = 0; g < 2; ++g) {
    const auto a = m.block_ids(1, g), b = m.block_ids(2, g);
    REQUIRE(std::vector<std::uint32_t>(a.begin(), a.end()) == std::vector<std::uint32_t>(b.begin(), b.end()));
    for (auto id : a) {
      if (id != 0) CHECK(m.allocator().refcount(id) == 2);
    }
  }
  CHECK(m.stats().blocks_used == before.stats[0]);
  REQUIRE(m.try_append(2, pagedkv_test::toks(500, 1)).ok());  // partial tail shared in both groups: 2 copies
  REQUIRE(m.pending_copies().size() == 2);
  CHECK(m.pending_copies()[0].group == 0);
  CHECK(m.pending_copies()[1].group == 1);
  auto [sizes, buf] = build(m, {1, 2});
  CHECK(sizes[0].num_copies == 1);
  CHECK(sizes[1].num_copies == 1);
  CHECK(buf.copies[1][0] == static_cast<std::int32_t>(m.block_ids(1, 1).back()));
  CHECK(buf.copies[1][1] == static_cast<std::int32_t>(m.block_ids(2, 1).back()));
  m.free(1);
  m.free(2);
  CHECK(m.stats().blocks_used == 0);
}

TEST_CASE("HybridKVCacheManager: failed calls change nothing", "[kv_cache_groups][strong]") {
  const std::uint32_t bs = 4;
  Mgr m(make_config(20, bs, {full(), swa(5)}));
  REQUIRE(m.try_admit(1, pagedkv_test::toks(1, 17)).admitted());  // 5 + 5 blocks of 19 usable
  (void)build(m, {1});                                            // the window group releases 2
  const auto same = [&](const Snapshot& s) { REQUIRE(snapshot(m) == s); };
  Snapshot s0 = snapshot(m);
  // Never fits: 20 blocks per group (the full group alone needs 20 of the 19 usable).
  auto r = m.try_admit(2, pagedkv_test::toks(50, 80));
  CHECK(r.status == AdmitStatus::kNeverFits);
  CHECK(r.num_missing_blocks == 40 - 19);
  same(s0);
  // No capacity now: 7 blocks per group, 12 available (5 + 2 held).
  r = m.try_admit(2, pagedkv_test::toks(50, 28));
  CHECK(r.status == AdmitStatus::kNoCapacity);
  same(s0);
  // Misuse.
  expect_error([&] { (void)m.try_admit(1, pagedkv_test::toks(1, 3)); }, Errc::kDuplicateSequence);
  // An empty prompt is a sequence with no token and no block in any group: freed, nothing but the counters (an
  // admission counted) has changed.
  REQUIRE(m.try_admit(3, Toks{}).admitted());
  for (std::size_t g = 0; g < m.num_groups(); ++g) CHECK(m.block_ids(3, g).empty());
  m.free(3);
  Snapshot after_empty = snapshot(m);
  CHECK(after_empty.stats != s0.stats);
  after_empty.stats = s0.stats;
  CHECK(after_empty == s0);
  s0 = snapshot(m);
  {  // Retention priorities work with groups since the managers merged (they used to be refused): an invalid config
     // is refused by admission and by the capacity query, naming the call, and nothing changes.
    pagedkv::AdmitOptions o;
    auto bad_retention = std::make_shared<pagedkv::RetentionConfig>();
    bad_retention->decode_priority = 101;  // above kMaxRetentionPriority
    o.retention = bad_retention;
    CHECK_THAT(expect_error([&] { (void)m.try_admit(3, pagedkv_test::toks(900, 8), nullptr, o); },
                            Errc::kInvalidArgument),
               Catch::Contains("try_admit"));
    CHECK_THAT(expect_error([&] { (void)m.query_admit(pagedkv_test::toks(900, 8), nullptr, o); },
                            Errc::kInvalidArgument),
               Catch::Contains("query_admit"));
    same(s0);
  }
  expect_error([&] { (void)m.try_append(9, pagedkv_test::toks(1, 1)); }, Errc::kUnknownSequence);
  expect_error([&] { (void)m.try_reserve(1, 1); }, Errc::kInvalidArgument);
  expect_error([&] { m.free(9); }, Errc::kUnknownSequence);
  expect_error([&] { m.fork(1, 1); }, Errc::kDuplicateSequence);
  expect_error([&] { m.rewind(1, 18); }, Errc::kLimitExceeded);
  // Rewind into a released block of the window group: refused, naming the group.
  const std::string msg = expect_error([&] { m.rewind(1, 12); }, Errc::kLimitExceeded);
  CHECK(msg.find("group 1") != std::string::npos);
  same(s0);
  // Build misuse.
  std::vector<SeqId> twice{1, 1};
  expect_error([&] { (void)build(m, twice, {1, 1}); }, Errc::kInvalidArgument);  // named before the tokens
  {
    GroupBuffers buf(2, 1, 8, 8, 1);
    std::vector<SeqId> nine{9};
    expect_error([&] { (void)m.build_batch_metadata(nine, buf.views); }, Errc::kUnknownSequence);
  }
  {
    GroupBuffers buf(1, 1, 8, 8, 1);
    std::vector<SeqId> one{1};
    expect_error([&] { (void)m.build_batch_metadata(one, buf.views); }, Errc::kBadShape);  // 1 buffer set, 2 groups
  }
  REQUIRE(m.try_append(1, pagedkv_test::toks(100, 2)).ok());
  s0 = snapshot(m);
  {
    GroupBuffers buf(2, 1, 8, 8, 1);
    buf.views[1].slot_mapping = {};  // the window group's writes would be lost
    std::vector<SeqId> one{1};
    expect_error([&] { (void)m.build_batch_metadata(one, buf.views); }, Errc::kBadShape);
    buf.views[1].slot_mapping = std::span<std::int64_t>(buf.slots[1].data(), 1);  // too small
    expect_error([&] { (void)m.build_batch_metadata(one, buf.views); }, Errc::kBadShape);
    std::vector<std::uint32_t> too_many{3};
    GroupBuffers ok(2, 1, 8, 8, 1);
    expect_error([&] { (void)m.build_batch_metadata(one, ok.views, too_many); }, Errc::kInvalidArgument);
    ok.views[0].max_blocks_per_seq = 2;
    expect_error([&] { (void)m.build_batch_metadata(one, ok.views); }, Errc::kBadShape);
  }
  same(s0);
  // Growth with no capacity: fill the pool with a second sequence, then ask for more than is left.
  REQUIRE(m.try_admit(2, pagedkv_test::toks(5000, 20)).admitted());
  const Snapshot s1 = snapshot(m);
  const auto q = m.query_append(1, 16);
  const auto a = m.try_append(1, pagedkv_test::toks(7000, 16));
  CHECK(a.status == AppendStatus::kNoCapacity);
  CHECK(q.status == pagedkv::CapacityStatus::kNoCapacity);
  CHECK(a.num_missing_blocks == q.num_missing_blocks);
  same(s1);
  const auto never = m.try_append(1, pagedkv_test::toks(7000, 60));
  CHECK(never.status == AppendStatus::kNeverFits);
  same(s1);
}

TEST_CASE("HybridKVCacheManager: rejected lookahead never leaves the next query's window released",
          "[kv_cache_groups][lookahead]") {
  // bs 4, a sliding window of 3: the query at p sees (p - 3, p]. 8 tokens built, 4 lookahead slots built (the
  // verification step). If the release rule counted the drafts, blocks 0 and 1 would be released (first_visible(12)
  // = 10); every draft rejected, the next query at 8 sees positions 6 and 7, in block 1.
  const std::uint32_t bs = 4;
  Mgr m(make_config(40, bs, {full(), swa(3)}));
  REQUIRE(m.try_admit(1, pagedkv_test::toks(1, 8)).admitted());
  (void)build(m, {1});
  CHECK(m.num_null_blocks(1, 1) == 1);  // first_visible(8) = 6: block 0 released
  REQUIRE(m.try_reserve_lookahead(1, 4).ok());
  (void)build(m, {1});
  CHECK(m.num_null_blocks(1, 1) == 1);  // the drafts are not known tokens: nothing more released
  m.commit_lookahead(1, {});            // every draft rejected
  REQUIRE(m.try_append(1, pagedkv_test::toks(50, 1)).ok());
  auto [sizes, buf] = build(m, {1});
  REQUIRE(sizes[1].num_indices == 3);
  CHECK(buf.indices[1][0] == 0);
  CHECK(buf.indices[1][1] != 0);  // positions 6, 7: read by the query at 8
  CHECK(buf.indices[1][2] != 0);
  // Accepted drafts are known tokens: the next build releases by them.
  REQUIRE(m.try_reserve_lookahead(1, 4).ok());
  (void)build(m, {1});
  m.commit_lookahead(1, pagedkv_test::toks(60, 4));  // 13 known tokens, all built
  REQUIRE(m.try_append(1, pagedkv_test::toks(70, 1)).ok());
  (void)build(m, {1});
  CHECK(m.num_null_blocks(1, 1) == 3);  // first_visible(14) = 12
}

// ---------------------------------------------------------------------------------------------------------------------
// Model-based randomized test.

namespace {

struct ModelSeq {
  Toks tokens;                        // known token ids
  Toks drafts;                        // outstanding lookahead: the draft ids the verification step writes
  std::size_t slotted = 0;
  std::size_t built = 0;
  std::vector<std::size_t> released;  // [G]
  std::shared_ptr<const pagedkv::RetentionConfig> retention;
  std::size_t prompt_len = 0;
  /// Ids of every slotted position's content: known tokens, then the drafts.
  [[nodiscard]] Toks ids() const {
    Toks t = tokens;
    t.insert(t.end(), drafts.begin(), drafts.end());
    return t;
  }
};

std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// The host tier's key of group g's block with hash h, as docs/groups.md and KVCacheManager describe it (h for
/// group 0; else both halves XORed with splitmix64 of g + 1): written out here so the hit oracle can look up
/// host-tier blocks by their key.
BlockHash host_key(const BlockHash& h, std::size_t g) {
  if (g == 0) return h;
  std::uint64_t z = 0x9E3779B97F4A7C15ULL * (static_cast<std::uint64_t>(g) + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  BlockHash k = h;
  for (std::size_t i = 0; i < 16; ++i) k.bytes[i] ^= static_cast<std::uint8_t>(z >> (8 * (i % 8)));
  return k;
}

/// What the harness exercises besides the base operations (admit, reserve, append, fork, free, preempt, rewind,
/// builds with random chunks).
struct HarnessOptions {
  std::size_t host_blocks = 0;  ///< Host tier (write-back offload, host hits onboarded, swap + resume); 0 = none.
  bool lookahead = false;       ///< try_reserve_lookahead, builds of the drafts, commit_lookahead of a prefix.
  bool prepared = false;        ///< Half the admissions through prepare_prompt.
  bool retention = false;       ///< Admissions with a RetentionConfig (M must evict by PriorityLruEviction).
};

template <class M>
class GroupsHarness {
 public:
  GroupsHarness(std::uint32_t bs, std::size_t num_blocks, std::vector<KVCacheGroupSpec> groups, std::uint64_t seed,
                HarnessOptions opt = {})
      : m_(config(num_blocks, bs, groups, opt)),
        bs_(bs),
        stride_(max_page(bs, groups)),
        opt_(opt),
        rng_(seed),
        shadow_(num_blocks * stride_, kUnwritten),
        host_shadow_(opt.host_blocks * bs, kUnwritten) {
    for (int i = 0; i < 4; ++i) {
      prefixes_.push_back(pagedkv_test::toks(static_cast<TokenId>(i * 100000 + 1), 4 + rng_() % (40 + 4 * bs)));
    }
  }

  void run(std::size_t ops) {
    for (std::size_t op = 0; op < ops; ++op) {
      const int kind = static_cast<int>(rng_() % 100);
      if (kind < 15) {
        admit();
      } else if (kind < 21) {
        reserve();
      } else if (kind < 36) {
        append();
      } else if (kind < 41) {
        fork();
      } else if (kind < 46) {
        free_one(false);
      } else if (kind < 49) {
        free_one(true);
      } else if (kind < 54) {
        rewind();
      } else if (kind < 56) {
        misuse();
      } else if (kind < 62 && opt_.lookahead) {
        reserve_lookahead();
      } else if (kind < 68 && opt_.lookahead) {
        commit_lookahead();
      } else if (kind < 73 && opt_.host_blocks > 0) {
        swap_out();
      } else if (kind < 79 && opt_.host_blocks > 0) {
        resume();
      } else if (kind < 86 && opt_.host_blocks > 0) {
        complete();
      } else {
        build_all();
      }
      check();
    }
    // Drain: build, complete every copy, free everything: nothing leaks, in either tier.
    build_all();
    while (!in_flight_.empty()) complete();
    check();
    while (!swapped_.empty()) {
      m_.free(swapped_.begin()->first);
      swapped_.erase(swapped_.begin());
    }
    while (!seqs_.empty()) free_seq(seqs_.begin()->first, false);
    check();
    REQUIRE(m_.stats().blocks_used == 0);
    for (std::size_t g = 0; g < m_.num_groups(); ++g) REQUIRE(m_.held_blocks(g) == 0);
    if (opt_.host_blocks > 0) REQUIRE(m_.stats().host_blocks_used == 0);
  }

  std::size_t builds = 0, admitted = 0, hits = 0, no_capacity = 0, content_checks = 0, copies = 0, rewinds_refused = 0,
              releases = 0, dedups = 0, kept_copies = 0, lookaheads = 0, drafts_accepted = 0, drafts_rejected = 0,
              prepared = 0, swaps = 0, swaps_refused = 0, resumes = 0, transfer_pending = 0, swap_ins = 0,
              swap_outs = 0, onboarded_tokens = 0, completions = 0, host_content_checks = 0,
              registered_content_checks = 0, retention_checks = 0, retention_admits = 0;
  // Coarse-page groups: admissions whose hit ends inside a coarse page, copies handed out in coarse groups,
  // registered coarse pages checked, explain_admit checks (of which kLimitedByGroup by a coarse group), device
  // events checked against the indexes, BlockRemoved events of coarse groups (re-keys, evictions, rewinds below a
  // key), forks, rewinds that dropped a coarse page's key.
  std::size_t partial_hits = 0, coarse_copies = 0, coarse_registered_checks = 0, explain_checks = 0,
              explain_limited = 0, event_checks = 0, rekeys = 0, forks = 0, coarse_unkeys = 0;

 private:
  static constexpr std::uint64_t kUnwritten = 0xdeadbeefULL;

  static HybridCacheConfig config(std::size_t num_blocks, std::uint32_t bs, std::vector<KVCacheGroupSpec> groups,
                                  const HarnessOptions& opt) {
    HybridCacheConfig c = make_config(num_blocks, bs, std::move(groups), true);
    c.num_host_blocks = opt.host_blocks;
    c.offload = pagedkv::OffloadPolicy::kWriteBack;
    return c;
  }
  std::size_t G() const { return m_.num_groups(); }
  std::size_t first_kept(std::size_t g, std::size_t pos) const {
    return pagedkv::detail::first_kept_block(m_.window(g), pos, bs_);
  }
  static std::uint32_t max_page(std::uint32_t bs, const std::vector<KVCacheGroupSpec>& groups) {
    std::uint32_t s = bs;
    for (const KVCacheGroupSpec& g : groups) s = std::max(s, g.block_size);
    return s;
  }
  // Group g's tokens per page (its block table, page table and slot mapping), and match blocks per page.
  std::size_t page(std::size_t g) const { return m_.block_size(g); }
  std::size_t factor(std::size_t g) const { return page(g) / bs_; }
  bool coarse(std::size_t g) const { return factor(g) > 1; }
  bool any_coarse() const {
    for (std::size_t g = 0; g < G(); ++g) {
      if (coarse(g)) return true;
    }
    return false;
  }
  // The shadow pool's index of group g's slot (page * page(g) + offset, as the slot mapping writes it): a block is
  // stride_ shadow slots whatever group holds it.
  std::size_t shadow_index(std::size_t g, std::size_t slot) const {
    return slot / page(g) * stride_ + slot % page(g);
  }
  // The shadow pool's index of position p in group g's page `blk`.
  std::size_t shadow_of(std::size_t g, std::uint32_t blk, std::size_t p) const {
    return std::size_t{blk} * stride_ + p % page(g);
  }
  // Content of position p of a sequence with ids `t` in group g: a hash of (g, t[0..p]); fps(g, t)[p], computed
  // for every position at once.
  static std::vector<std::uint64_t> fps(std::size_t g, const Toks& t) {
    std::vector<std::uint64_t> out(t.size());
    std::uint64_t h = mix(0x1234 + g);
    for (std::size_t i = 0; i < t.size(); ++i) {
      h = mix(h ^ static_cast<std::uint64_t>(static_cast<std::uint32_t>(t[i])));
      out[i] = h;
    }
    return out;
  }
  SeqId pick() {
    auto it = seqs_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng_() % seqs_.size()));
    return it->first;
  }
  Toks random_tokens(std::size_t n) {
    Toks t;
    for (std::size_t i = 0; i < n; ++i) t.push_back(static_cast<TokenId>(rng_() % 4 == 0 ? 3 : rng_() % 50000));
    return t;
  }
  // Remember the token prefix of every full block of `t` under each group's host key, so that the content of any
  // registered block (device index of group g, or host tier) can be recomputed from the model.
  void learn(const Toks& t) {
    const auto h = chain(m_, t);
    for (std::size_t i = 0; i < h.size(); ++i) {
      for (std::size_t g = 0; g < G(); ++g) {
        prefix_of_.try_emplace(host_key(h[i], g), t.begin(), t.begin() + static_cast<std::ptrdiff_t>((i + 1) * bs_));
      }
    }
  }

  // Whether the host tier holds group g's block with hash h, ready (its copy completed): a hit there is onboarded.
  bool on_host(const BlockHash& h, std::size_t g) const {
    return m_.host_tier() != nullptr && m_.host_tier()->find_ready(host_key(h, g)).has_value();
  }
  // Whether a hit of k match blocks needs group g's entry keyed by the hash of match block i (i < k): a windowed
  // group the blocks of [lo_g(k), k), lo_g from the definition of visibility (the first key the query at k * bs
  // sees); a coarse group (pages of f match blocks) each page of the hit keyed where its content the hit takes
  // ends: block i when a page ends there ((i + 1) % f == 0) or the hit does (i + 1 == k).
  bool hit_needs(std::size_t g, std::size_t k, std::size_t i) const {
    if (coarse(g)) return (i + 1) % factor(g) == 0 || i + 1 == k;
    const KVCacheGroupSpec& spec = m_.config().groups[g];
    std::size_t lo = k;
    for (std::size_t t = 0; t < k * bs_; ++t) {
      if (visible(spec, k * bs_, t)) {
        lo = t / bs_;
        break;
      }
    }
    return i >= lo;
  }
  // Whether group g alone can serve a hit of k match blocks of a prompt with chain hashes h (device, or ready on the
  // host).
  bool servable(std::size_t g, std::size_t k, const std::vector<BlockHash>& h) const {
    for (std::size_t i = 0; i < k; ++i) {
      if (hit_needs(g, k, i) && !m_.prefix_index(g).find(h[i]) && !on_host(h[i], g)) return false;
    }
    return true;
  }
  // The brute-force hit oracle over both tiers: the largest k <= (len - 1) / bs that every group can serve; also the
  // logical blocks of the hit that some group takes from the host tier (onboarded).
  std::pair<std::size_t, std::size_t> oracle_hit(const Toks& prompt) const {
    const auto h = chain(m_, prompt);
    const std::size_t cap = std::min(h.size(), (prompt.size() - 1) / bs_);
    for (std::size_t k = cap; k > 0; --k) {
      bool ok = true;
      for (std::size_t g = 0; g < G() && ok; ++g) ok = servable(g, k, h);
      if (!ok) continue;
      std::size_t host_blocks = 0;
      for (std::size_t i = 0; i < k; ++i) {
        bool any = false;
        for (std::size_t g = 0; g < G(); ++g) any = any || (hit_needs(g, k, i) && !m_.prefix_index(g).find(h[i]));
        host_blocks += any ? 1 : 0;
      }
      return {k, host_blocks};
    }
    return {0, 0};
  }
  // explain_admit of `prompt` against the oracle (h: its chain hashes, k: the oracle's hit): the hit, each coarse
  // group's run (its own longest servable hit over the prompt's full blocks, uncapped), and a hit that only coarse
  // groups stop at k + 1 while the cap allows more is kLimitedByGroup naming the first of them.
  void check_explain(const Toks& prompt, std::size_t k) {
    const auto h = chain(m_, prompt);
    const pagedkv::AdmitExplanation x = m_.explain_admit(prompt);
    REQUIRE(x.hit_tokens == k * bs_);
    for (std::size_t g = 0; g < G(); ++g) {
      if (!coarse(g)) continue;
      std::size_t run = h.size();
      while (run > 0 && !servable(g, run, h)) --run;
      CAPTURE(g, run);
      REQUIRE(x.group_cached_run_tokens[g] == run * bs_);
    }
    const std::size_t walk = std::min(h.size(), (prompt.size() - 1) / bs_);
    if (k >= walk) return;
    std::vector<std::size_t> lacking;
    for (std::size_t g = 0; g < G(); ++g) {
      if (!servable(g, k + 1, h)) lacking.push_back(g);
    }
    REQUIRE_FALSE(lacking.empty());  // else the oracle would have taken k + 1
    const bool only_coarse = std::all_of(lacking.begin(), lacking.end(), [&](std::size_t g) { return coarse(g); });
    if (only_coarse) {
      CAPTURE(k, lacking.front());
      REQUIRE(x.cause == pagedkv::MissCause::kLimitedByGroup);
      REQUIRE(x.limiting_group == lacking.front());
      REQUIRE(x.first_miss_block == k);
      ++explain_limited;
    }
    ++explain_checks;
  }

  std::shared_ptr<const pagedkv::RetentionConfig> random_retention(std::size_t len) {
    auto r = std::make_shared<pagedkv::RetentionConfig>();
    const std::size_t mid = rng_() % (len + 1);
    if (mid > 0) r->ranges.push_back({0, mid, static_cast<std::uint8_t>(rng_() % 101), std::nullopt});
    const auto prio = static_cast<std::uint8_t>(rng_() % 101);
    if (rng_() % 2 == 0) r->ranges.push_back({mid, std::nullopt, prio, std::nullopt});
    r->decode_priority = static_cast<std::uint8_t>(rng_() % 101);
    return r;
  }

  void admit() {
    Toks p = prefixes_[rng_() % prefixes_.size()];
    if (any_coarse() && !seqs_.empty() && rng_() % 2 == 0) {
      // A request continuing a live sequence's built tokens (a next turn, a branch): its hit ends in pages that
      // sequence holds, often inside one (a partial entry it registered).
      const ModelSeq& s = seqs_.at(pick());
      p.assign(s.tokens.begin(), s.tokens.begin() + static_cast<std::ptrdiff_t>(std::min(s.built, s.tokens.size())));
    }
    p.resize(std::min(p.size(), static_cast<std::size_t>(rng_() % (p.size() + 3))));
    const Toks tail = random_tokens(1 + rng_() % 24);
    p.insert(p.end(), tail.begin(), tail.end());
    const auto [want_blocks, want_host_blocks] = oracle_hit(p);
    const std::size_t want = want_blocks * bs_;
    if (any_coarse()) check_explain(p, want_blocks);
    pagedkv::AdmitOptions o;
    if (rng_() % 3 == 0) o.num_reserved_tokens = rng_() % (p.size() + 1);
    if (any_coarse() && rng_() % 3 == 0) o.num_reserved_tokens = 0;  // a hit's partial page held, not appended to
    if (opt_.retention && rng_() % 2 == 0) o.retention = random_retention(p.size());
    const bool use_prepared = opt_.prepared && rng_() % 2 == 0;
    std::optional<pagedkv::PreparedPrompt> pp;
    if (use_prepared) pp = m_.prepare_prompt(p);
    const auto q = use_prepared ? m_.query_admit(*pp, o) : m_.query_admit(p, nullptr, o);
    const Snapshot before = snapshot(m_);
    const SeqId id = next_id_++;
    const auto r = use_prepared ? m_.try_admit(id, *pp, o) : m_.try_admit(id, p, nullptr, o);
    REQUIRE(static_cast<int>(r.status) == static_cast<int>(q.status));
    REQUIRE(q.num_cached_tokens == want);
    if (!r.admitted()) {
      ++no_capacity;
      REQUIRE(snapshot(m_) == before);
      return;
    }
    ++admitted;
    for (std::size_t g = 0; g < G(); ++g) {
      if (coarse(g) && want % page(g) != 0) {
        ++partial_hits;
        break;
      }
    }
    prepared += use_prepared ? 1 : 0;
    retention_admits += o.retention ? 1 : 0;
    hits += want > 0;
    REQUIRE(r.num_cached_tokens == want);
    REQUIRE(r.num_host_cached_tokens == want_host_blocks * bs_);
    onboarded_tokens += r.num_host_cached_tokens;
    REQUIRE(r.num_new_blocks == q.num_blocks);
    ModelSeq s;
    s.tokens = p;
    s.built = want;
    s.slotted = want + std::min(o.num_reserved_tokens.value_or(p.size()), p.size() - want);
    for (std::size_t g = 0; g < G(); ++g) s.released.push_back(first_kept(g, want));
    s.retention = o.retention;
    s.prompt_len = p.size();
    seqs_[id] = s;
    learn(p);
  }

  void reserve() {
    if (seqs_.empty()) return;
    const SeqId id = pick();
    ModelSeq& s = seqs_[id];
    if (!s.drafts.empty() || s.tokens.size() == s.slotted) return;
    grow(id, s, 1 + rng_() % (s.tokens.size() - s.slotted), false);
  }

  void append() {
    if (seqs_.empty()) return;
    const SeqId id = pick();
    ModelSeq& s = seqs_[id];
    if (!s.drafts.empty()) {  // outstanding lookahead: refused, nothing changes
      const Snapshot before = snapshot(m_);
      expect_error([&] { (void)m_.try_append(id, pagedkv_test::toks(1, 1)); }, Errc::kInvalidArgument);
      REQUIRE(snapshot(m_) == before);
      return;
    }
    if (s.slotted < s.tokens.size()) return;
    grow(id, s, 1 + rng_() % 6, true);
  }

  void grow(SeqId id, ModelSeq& s, std::size_t n, bool append) {
    const auto q = m_.query_append(id, n);
    const Snapshot before = snapshot(m_);
    const Toks t = random_tokens(n);
    const auto r = append ? m_.try_append(id, t) : m_.try_reserve(id, n);
    REQUIRE(static_cast<int>(r.status) == static_cast<int>(q.status));
    if (!r.ok()) {
      ++no_capacity;
      REQUIRE(r.num_missing_blocks == q.num_missing_blocks);
      REQUIRE(snapshot(m_) == before);
      return;
    }
    REQUIRE(r.num_new_blocks == q.num_blocks);
    if (append) s.tokens.insert(s.tokens.end(), t.begin(), t.end());
    s.slotted += n;
    if (append) learn(s.tokens);
  }

  // Speculative decoding: k lookahead slots for draft tokens (the model picks their ids now: the verification step
  // writes their K/V), all or nothing.
  void reserve_lookahead() {
    if (seqs_.empty()) return;
    const SeqId id = pick();
    ModelSeq& s = seqs_[id];
    const Snapshot before = snapshot(m_);
    if (!s.drafts.empty() || s.slotted < s.tokens.size()) {
      expect_error([&] { (void)m_.try_reserve_lookahead(id, 1); }, Errc::kInvalidArgument);
      REQUIRE(snapshot(m_) == before);
      return;
    }
    const std::size_t k = 1 + rng_() % 4;
    const auto q = m_.query_append(id, k);
    const auto r = m_.try_reserve_lookahead(id, k);
    REQUIRE(static_cast<int>(r.status) == static_cast<int>(q.status));
    if (!r.ok()) {
      ++no_capacity;
      REQUIRE(snapshot(m_) == before);
      return;
    }
    REQUIRE(r.num_new_blocks == q.num_blocks);
    ++lookaheads;
    s.drafts = random_tokens(k);
    s.slotted += k;
  }
  // Verification: a random prefix of the drafts is accepted (their ids are the drafts'), the rest rewound.
  void commit_lookahead() {
    if (seqs_.empty()) return;
    const SeqId id = pick();
    ModelSeq& s = seqs_[id];
    if (s.drafts.empty()) {
      if (rng_() % 4 == 0) {
        const Snapshot before = snapshot(m_);
        expect_error([&] { m_.commit_lookahead(id, pagedkv_test::toks(1, 1)); }, Errc::kInvalidArgument);
        REQUIRE(snapshot(m_) == before);
      }
      return;
    }
    const std::size_t a = rng_() % (s.drafts.size() + 1);
    m_.commit_lookahead(id, std::span<const TokenId>(s.drafts).first(a));
    drafts_accepted += a;
    drafts_rejected += s.drafts.size() - a;
    s.tokens.insert(s.tokens.end(), s.drafts.begin(), s.drafts.begin() + static_cast<std::ptrdiff_t>(a));
    s.slotted -= s.drafts.size() - a;
    s.built = std::min(s.built, s.slotted);
    s.drafts.clear();
    learn(s.tokens);
  }

  void fork() {
    if (seqs_.empty()) return;
    const SeqId id = pick();
    const ModelSeq& s = seqs_[id];
    const SeqId child = next_id_++;
    if (!settled(id)) {
      const Snapshot before = snapshot(m_);
      expect_error([&] { m_.fork(id, child); }, Errc::kInvalidArgument);
      REQUIRE(snapshot(m_) == before);
      return;
    }
    m_.fork(id, child);
    seqs_[child] = s;
    ++forks;
  }
  // Fork and swap need a settled sequence: no unbuilt slot, no unslotted prompt token, no lookahead, no copy into
  // its tables pending (copy-on-write, or a host -> device fill not completed).
  bool settled(SeqId id) const {
    const ModelSeq& s = seqs_.at(id);
    return s.built == s.slotted && s.slotted == s.tokens.size() && s.drafts.empty() && !has_pending_copy_into(id) &&
           !has_filling_block(id);
  }
  bool has_pending_copy_into(SeqId id) const {
    for (const auto& c : m_.pending_copies()) {
      const auto t = m_.block_ids(id, c.group);
      if (std::find(t.begin(), t.end(), c.dst) != t.end()) return true;
    }
    return false;
  }
  bool has_filling_block(SeqId id) const {
    std::set<std::uint32_t> fills;  // issued (from the builds' swap_in lists) or queued for the next build
    for (const auto& [dst, token] : filling_) fills.insert(dst);
    for (const auto& t : m_.transfers().queued()) {
      if (!pagedkv::is_device_to_host(t.kind)) fills.insert(t.device);
    }
    for (std::size_t g = 0; g < G(); ++g) {
      for (auto b : m_.block_ids(id, g)) {
        if (b != 0 && fills.contains(b)) return true;
      }
    }
    return false;
  }

  void free_one(bool preempt) {
    if (!swapped_.empty() && rng_() % 4 == 0) {  // a swapped sequence: its host blocks are released
      const SeqId id = swapped_.begin()->first;
      m_.free(id);
      swapped_.erase(id);
      REQUIRE_FALSE(m_.is_swapped(id));
      return;
    }
    if (seqs_.empty()) return;
    free_seq(pick(), preempt);
  }
  // Free (or preempt by recompute) `id`; under retention, every block this release leaves cached carries the
  // priority its RetentionConfig (or the default) gives its logical block.
  void free_seq(SeqId id, bool preempt) {
    std::vector<std::tuple<std::uint32_t, std::size_t, std::size_t>> blocks;  // (block, logical index, page size)
    for (std::size_t g = 0; g < G(); ++g) {
      const auto t = m_.block_ids(id, g);
      for (std::size_t i = 0; i < t.size(); ++i) {
        if (t[i] != 0) blocks.emplace_back(t[i], i, page(g));
      }
    }
    if (preempt) {
      m_.preempt(id);
    } else {
      m_.free(id);
    }
    const ModelSeq s = seqs_[id];
    seqs_.erase(id);
    if constexpr (requires { m_.allocator().eviction_policy().priority(std::uint32_t{1}); }) {
      const auto& a = m_.allocator();
      for (const auto& [b, i, pg] : blocks) {
        if (a.refcount(b) != 0 || !a.is_cached(b)) continue;
        const std::uint8_t want = s.retention
                                      ? pagedkv::block_retention(*s.retention, i * pg, pg, s.prompt_len).priority
                                      : pagedkv::kDefaultRetentionPriority;
        CAPTURE(b, i, s.prompt_len);
        REQUIRE(a.eviction_policy().priority(b) == want);
        ++retention_checks;
      }
    }
  }

  void rewind() {
    if (seqs_.empty()) return;
    const SeqId id = pick();
    ModelSeq& s = seqs_[id];
    const std::size_t len = s.tokens.size() + s.drafts.size();
    const std::size_t n = rng_() % (std::min<std::size_t>(len, 8) + 1);
    // Lookahead goes first, then known tokens.
    const std::size_t drop_la = std::min(n, s.drafts.size());
    const std::size_t new_known = s.tokens.size() - (n - drop_la);
    const std::size_t new_la = s.drafts.size() - drop_la;
    const std::size_t new_slotted = std::min(s.slotted, new_known + new_la);
    const std::size_t new_built = std::min(s.built, new_slotted);
    bool ok = true;
    for (std::size_t g = 0; g < G(); ++g) ok = ok && s.released[g] <= first_kept(g, new_built);
    if (!ok) {
      ++rewinds_refused;
      const Snapshot before = snapshot(m_);
      expect_error([&] { m_.rewind(id, n); }, Errc::kLimitExceeded);
      REQUIRE(snapshot(m_) == before);
      return;
    }
    std::vector<std::uint32_t> keyed_last(G(), 0);  // coarse groups: the last page, when keyed
    for (std::size_t g = 0; g < G(); ++g) {
      const auto t = m_.block_ids(id, g);
      if (coarse(g) && !t.empty() && m_.prefix_index(g).hash_of(t.back())) keyed_last[g] = t.back();
    }
    m_.rewind(id, n);
    for (std::size_t g = 0; g < G(); ++g) {
      const auto t = m_.block_ids(id, g);
      if (keyed_last[g] != 0 && !t.empty() && t.back() == keyed_last[g] && !m_.prefix_index(g).hash_of(t.back())) {
        ++coarse_unkeys;
      }
    }
    s.tokens.resize(new_known);
    s.drafts.resize(new_la);
    s.slotted = new_slotted;
    s.built = new_built;
  }

  // Preemption by swapping: every group's non-null blocks go to the host tier (copied by the next build's
  // swap_out, or shared with a host block of the same hash); refused (false, nothing changes) when the host tier is
  // full.
  void swap_out() {
    if (seqs_.empty()) return;
    SeqId id = pick();
    if (rng_() % 5 != 0) {  // mostly a settled one (swapping an unsettled one is refused)
      std::vector<SeqId> ok;
      for (const auto& [sid, s] : seqs_) {
        if (settled(sid)) ok.push_back(sid);
      }
      if (!ok.empty()) id = ok[rng_() % ok.size()];
    }
    const Snapshot before = snapshot(m_);
    if (!settled(id)) {
      expect_error([&] { (void)m_.preempt(id, pagedkv::PreemptMode::kSwap); }, Errc::kInvalidArgument);
      REQUIRE(snapshot(m_) == before);
      return;
    }
    if (!m_.preempt(id, pagedkv::PreemptMode::kSwap)) {
      ++swaps_refused;
      REQUIRE(snapshot(m_) == before);
      return;
    }
    ++swaps;
    const ModelSeq& s = seqs_[id];
    REQUIRE(m_.is_swapped(id));
    REQUIRE_FALSE(m_.contains(id));
    const auto hb = m_.swapped_host_blocks(id);
    const std::size_t nb = (s.slotted + bs_ - 1) / bs_;
    REQUIRE(hb.size() == G() * nb);
    for (std::size_t g = 0; g < G(); ++g) {
      for (std::size_t i = 0; i < nb; ++i) REQUIRE((hb[g * nb + i] == 0) == (i < s.released[g]));
    }
    swapped_[id] = s;
    seqs_.erase(id);
  }
  void resume() {
    if (swapped_.empty()) return;
    auto it = swapped_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng_() % swapped_.size()));
    const SeqId id = it->first;
    const Snapshot before = snapshot(m_);
    const auto r = m_.try_resume(id);
    if (r.status == AdmitStatus::kTransferPending) {  // a host block's swap-out or offload not completed yet
      ++transfer_pending;
      REQUIRE((!in_flight_.empty() || !m_.transfers().queued().empty()));
      REQUIRE(snapshot(m_) == before);
      return;
    }
    if (!r.admitted()) {
      ++no_capacity;
      REQUIRE(snapshot(m_) == before);
      return;
    }
    ++resumes;
    const ModelSeq& s = it->second;
    REQUIRE(r.num_cached_tokens == s.slotted);
    REQUIRE(r.num_host_cached_tokens <= r.num_cached_tokens);
    REQUIRE(m_.num_tokens(id) == s.slotted);
    REQUIRE(m_.num_built(id) == s.slotted);
    seqs_[id] = s;
    swapped_.erase(it);
  }
  // The copies of one issued build have completed (any order); a token never issued or completed twice is refused.
  void complete() {
    if (in_flight_.empty()) {
      const Snapshot before = snapshot(m_);
      expect_error([&] { m_.complete_transfers(987654321); }, Errc::kInvalidArgument);
      REQUIRE(snapshot(m_) == before);
      return;
    }
    const std::size_t i = rng_() % in_flight_.size();
    const std::uint64_t token = in_flight_[i];
    m_.complete_transfers(token);
    ++completions;
    in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
    std::erase_if(filling_, [&](const auto& e) { return e.second == token; });
    if (rng_() % 8 == 0) expect_error([&] { m_.complete_transfers(token); }, Errc::kInvalidArgument);
  }

  void misuse() {
    const Snapshot before = snapshot(m_);
    switch (rng_() % 4) {
      case 0: expect_error([&] { m_.free(999999); }, Errc::kUnknownSequence); break;
      case 1:
        if (!seqs_.empty()) {
          const SeqId id = pick();
          expect_error([&] { (void)m_.try_admit(id, pagedkv_test::toks(1, 3)); }, Errc::kDuplicateSequence);
        }
        break;
      case 2:
        if (!seqs_.empty()) {
          const SeqId id = pick();
          const std::size_t len = seqs_[id].tokens.size() + seqs_[id].drafts.size();
          expect_error([&] { m_.rewind(id, len + 1); }, Errc::kLimitExceeded);
        }
        break;
      default:
        if (!seqs_.empty()) {
          const SeqId id = pick();
          std::vector<SeqId> twice{id, id};
          expect_error([&] { (void)build(m_, twice, {1, 1}); }, Errc::kInvalidArgument);
        }
    }
    REQUIRE(snapshot(m_) == before);
  }

  void build_all() {
    std::vector<SeqId> batch;
    std::vector<std::uint32_t> sched;
    for (auto& [id, s] : seqs_) {
      const std::size_t pending = s.slotted - s.built;
      if (pending == 0) continue;  // a build refuses a row with nothing to compute
      if (rng_() % 5 == 0) continue;  // left out (prefill and decode built apart): its copies stay pending
      batch.push_back(id);
      // (with coarse pages, chunks half the time: partial entries re-keyed as pages fill, pages shared meanwhile)
      const bool whole = any_coarse() ? rng_() % 2 != 0 : rng_() % 4 != 0;
      sched.push_back(static_cast<std::uint32_t>(whole ? pending : 1 + rng_() % pending));
    }
    // The copies this build must hand out, per the rule: into a batch sequence's table or an idle sequence's, or
    // reading a block the build writes; the others stay pending, in order.
    std::set<std::pair<std::uint32_t, std::uint32_t>> claimed, written;  // (group, block)
    for (const auto& [id, s] : seqs_) {
      const bool in_batch = std::find(batch.begin(), batch.end(), id) != batch.end();
      if (!in_batch && s.slotted != s.built) continue;
      for (std::size_t g = 0; g < G(); ++g) {
        for (auto b : m_.block_ids(id, g)) claimed.insert({static_cast<std::uint32_t>(g), b});
      }
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const ModelSeq& s = seqs_[batch[b]];
      for (std::size_t g = 0; g < G(); ++g) {
        const auto t = m_.block_ids(batch[b], g);
        for (std::size_t p = s.built; p < s.built + sched[b]; ++p) {
          written.insert({static_cast<std::uint32_t>(g), t[p / page(g)]});
        }
      }
    }
    std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>> kept;
    for (const auto& c : m_.pending_copies()) {
      if (!claimed.contains({c.group, c.dst}) && !written.contains({c.group, c.src})) kept.emplace_back(c.src, c.dst, c.group);
    }
    const std::uint64_t dedup_before = m_.stats().dedup_blocks;
    auto [sizes, buf] = build(m_, batch, sched);
    for (const auto& sz : sizes) copies += sz.num_copies;
    {
      std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>> now;
      for (const auto& c : m_.pending_copies()) now.emplace_back(c.src, c.dst, c.group);
      REQUIRE(now == kept);
      kept_copies += kept.size();
    }
    dedups += m_.stats().dedup_blocks - dedup_before;
    ++builds;
    // Execute the step on the shadow pools in the contract's order: swap_out, swap_in, then per group its copies,
    // then its slot mapping. The swap lists are group 0's; every other group's are empty.
    for (std::size_t g = 1; g < G(); ++g) REQUIRE((sizes[g].num_swap_out == 0 && sizes[g].num_swap_in == 0));
    if (sizes[0].transfer_token != 0) {
      for (std::size_t g = 0; g < G(); ++g) REQUIRE(sizes[g].transfer_token == sizes[0].transfer_token);
      in_flight_.push_back(sizes[0].transfer_token);
    } else {
      REQUIRE((sizes[0].num_swap_out == 0 && sizes[0].num_swap_in == 0));
    }
    for (std::size_t c = 0; c < sizes[0].num_swap_out; ++c) {
      const auto dev = static_cast<std::size_t>(buf.swap_out[2 * c]);
      const auto host = static_cast<std::size_t>(buf.swap_out[2 * c + 1]);
      std::copy_n(shadow_.begin() + static_cast<std::ptrdiff_t>(dev * stride_), bs_,
                  host_shadow_.begin() + static_cast<std::ptrdiff_t>(host * bs_));
      ++swap_outs;
    }
    for (std::size_t c = 0; c < sizes[0].num_swap_in; ++c) {
      const auto host = static_cast<std::size_t>(buf.swap_in[2 * c]);
      const auto dev = static_cast<std::uint32_t>(buf.swap_in[2 * c + 1]);
      std::copy_n(host_shadow_.begin() + static_cast<std::ptrdiff_t>(host * bs_), bs_,
                  shadow_.begin() + static_cast<std::ptrdiff_t>(std::size_t{dev} * stride_));
      filling_.emplace_back(dev, sizes[0].transfer_token);
      ++swap_ins;
    }
    for (std::size_t g = 0; g < G(); ++g) {
      std::set<std::int32_t> srcs, dsts;
      for (std::size_t c = 0; c < sizes[g].num_copies; ++c) {
        srcs.insert(buf.copies[g][2 * c]);
        dsts.insert(buf.copies[g][2 * c + 1]);
      }
      for (auto d : dsts) REQUIRE_FALSE(srcs.contains(d));
      for (std::size_t c = 0; c < sizes[g].num_copies; ++c) {  // a whole block (every group's page of it)
        const auto src = static_cast<std::size_t>(buf.copies[g][2 * c]);
        const auto dst = static_cast<std::size_t>(buf.copies[g][2 * c + 1]);
        std::copy_n(shadow_.begin() + static_cast<std::ptrdiff_t>(src * stride_), stride_,
                    shadow_.begin() + static_cast<std::ptrdiff_t>(dst * stride_));
      }
      if (coarse(g)) coarse_copies += sizes[g].num_copies;
    }
    for (std::size_t g = 0; g < G(); ++g) {
      std::size_t tok = 0;
      for (std::size_t b = 0; b < batch.size(); ++b) {
        const ModelSeq& s = seqs_[batch[b]];
        const auto fp = fps(g, s.ids());
        REQUIRE(buf.qo_indptr[g][b] == static_cast<std::int32_t>(tok));
        REQUIRE(buf.seq_lens[g][b] == static_cast<std::int32_t>(s.built + sched[b]));
        const auto tbl = m_.block_ids(batch[b], g);
        for (std::size_t j = 0; j < sched[b]; ++j) {
          const std::int64_t slot = buf.slots[g][tok + j];
          if (slot < 0) {  // deduplicated: the registered block holds the same content (never a coarse page)
            if (coarse(g)) FAIL("group " << g << " slot -1 at position " << s.built + j);
            continue;
          }
          if (coarse(g)) {  // the coarse page table's slot: page * page(g) + offset
            const std::size_t p = s.built + j;
            const auto want = static_cast<std::int64_t>(std::size_t{tbl[p / page(g)]} * page(g) + p % page(g));
            if (slot != want) FAIL("group " << g << " position " << p << " slot " << slot << " != " << want);
          }
          shadow_[shadow_index(g, static_cast<std::size_t>(slot))] = fp[s.built + j];
        }
        // The step's page table: every page from first_needed_token on is a real block (no query: none read);
        // ceil(len / page(g)) pages, the last holding the rest; a coarse group's pages are its table's.
        const std::size_t len = sched[b] == 0 ? 0 : s.built + sched[b];
        const std::size_t pages = (len + page(g) - 1) / page(g);
        const auto row = static_cast<std::size_t>(buf.indptr[g][b]);
        REQUIRE(static_cast<std::size_t>(buf.indptr[g][b + 1]) - row == pages);
        REQUIRE(static_cast<std::size_t>(buf.last_page_len[g][b]) == (pages == 0 ? 0 : len - (pages - 1) * page(g)));
        const auto first = static_cast<std::size_t>(
            m_.window(g).first_needed_token(static_cast<std::int64_t>(len), static_cast<std::int64_t>(sched[b])));
        for (std::size_t i = first / page(g); i * page(g) < len; ++i) {
          CAPTURE(batch[b], g, i, first, len);
          REQUIRE(buf.indices[g][row + i] != 0);
          if (coarse(g)) REQUIRE(buf.indices[g][row + i] == static_cast<std::int32_t>(tbl[i]));
        }
        tok += sched[b];
      }
    }
    for (std::size_t b = 0; b < batch.size(); ++b) {
      ModelSeq& s = seqs_[batch[b]];
      s.built += sched[b];
      for (std::size_t g = 0; g < G(); ++g) {
        const std::size_t kept_from = first_kept(g, std::min(s.built, s.tokens.size()));  // drafts may be rejected
        if (kept_from > s.released[g]) ++releases;
        s.released[g] = std::max(s.released[g], kept_from);
      }
    }
    check_content();
  }

  // Every built position of every live sequence, in a real block of every group, reads back its own fingerprint;
  // every block registered in a group's device index, and every keyed host block, holds the content of the token
  // prefix its hash names; every swapped sequence's host blocks hold its positions.
  void check_content() {
    // A block whose copy-on-write is still pending (its sequence was not in this batch) is filled by the copy that
    // its own batch's build issues, before any kernel of that step reads it: until then its content is the source's.
    std::map<std::pair<std::size_t, std::uint32_t>, std::uint32_t> copy_src;  // (group, dst) -> src
    for (const auto& c : m_.pending_copies()) copy_src[{c.group, c.dst}] = c.src;
    for (const auto& [id, s] : seqs_) {
      for (std::size_t g = 0; g < G(); ++g) {
        const auto fp = fps(g, s.ids());
        const auto t = m_.block_ids(id, g);
        for (std::size_t p = s.released[g] * bs_; p < s.built; ++p) {
          std::uint32_t blk = t[p / page(g)];
          for (auto it = copy_src.find({g, blk}); it != copy_src.end(); it = copy_src.find({g, blk})) blk = it->second;
          if (shadow_[shadow_of(g, blk, p)] != fp[p]) {  // (no REQUIRE per position: Catch's bookkeeping would dominate)
            FAIL("content of sequence " << id << " group " << g << " position " << p << " in block "
                                        << t[p / page(g)] << " (read from " << blk << ")");
          }
          ++content_checks;
        }
      }
    }
    // A block registered under the hash of match block j of a prefix holds that prefix's positions from the start
    // of its page to the end of block j: a fine block [j * bs, (j + 1) * bs), a coarse page c = j / f the positions
    // [c * page, (j + 1) * bs) at offsets [0, (j + 1) * bs - c * page) (a full page, or a partial entry).
    const auto check_block = [&](const std::vector<std::uint64_t>& pool, std::size_t blk, std::size_t g,
                                 const BlockHash& key) {
      const auto it = prefix_of_.find(key);
      REQUIRE(it != prefix_of_.end());  // every registered hash is one the model has seen
      const Toks& prefix = it->second;
      const bool on_device = &pool == &shadow_;
      const std::size_t pg = on_device ? page(g) : bs_;
      const std::size_t base = (prefix.size() - 1) / pg * pg;
      const std::size_t stride = on_device ? stride_ : bs_;
      const auto fp = fps(g, prefix);
      for (std::size_t p = base; p < prefix.size(); ++p) {
        if (pool[blk * stride + p - base] != fp[p]) {
          FAIL("content of registered block " << blk << " (" << (on_device ? "device" : "host") << ", group " << g
                                              << ", page of " << pg << " tokens, key of the " << prefix.size()
                                              << "-token prefix) at position " << p);
        }
      }
    };
    for (std::size_t g = 0; g < G(); ++g) {
      for (std::uint32_t b = 1; b < m_.allocator().num_blocks(); ++b) {
        if (const auto h = m_.prefix_index(g).hash_of(b)) {
          check_block(shadow_, b, g, host_key(*h, g));
          ++registered_content_checks;
          coarse_registered_checks += coarse(g) ? 1 : 0;
        }
      }
    }
    if (const auto* host = m_.host_tier()) {
      // Every keyed host block's copy was issued by now (builds issue every queued copy): its content is there.
      for (std::uint32_t hb = 1; hb < host->allocator().num_blocks(); ++hb) {
        const auto key = host->index().hash_of(hb);
        if (!key) continue;
        REQUIRE(prefix_of_.contains(*key));  // every host key is one the model has seen
        // The content fingerprints the group: recover it from the stored prefix's hash (key = host_key(h, g)).
        const Toks& prefix = prefix_of_.at(*key);
        const auto h = chain(m_, prefix);
        std::size_t grp = G();
        for (std::size_t gg = 0; gg < G(); ++gg) {
          if (host_key(h.back(), gg) == *key) grp = gg;
        }
        REQUIRE(grp < G());
        check_block(host_shadow_, hb, grp, *key);
        ++host_content_checks;
      }
      for (const auto& [id, s] : swapped_) {
        const auto hb = m_.swapped_host_blocks(id);
        const std::size_t nb = hb.size() / G();
        for (std::size_t g = 0; g < G(); ++g) {
          const auto fp = fps(g, s.ids());
          for (std::size_t i = 0; i < nb; ++i) {
            if (hb[g * nb + i] == 0) continue;
            for (std::size_t p = i * bs_; p < std::min(s.slotted, (i + 1) * bs_); ++p) {
              if (host_shadow_[std::size_t{hb[g * nb + i]} * bs_ + p % bs_] != fp[p]) {
                FAIL("host content of swapped sequence " << id << " group " << g << " position " << p);
              }
              ++host_content_checks;
            }
          }
        }
      }
    }
  }

  // The device events since the last check replayed into a router's view (per group: hashes stored, not removed):
  // every BlockStored names a block the model has seen (its bs token ids, parent, start, the pool's block size),
  // a BlockRemoved a stored one, and the view equals each group's index (a coarse re-key: BlockRemoved of the old
  // key, then BlockStored of the new).
  void check_events() {
    std::vector<pagedkv::KVEvent> events;
    m_.drain_events(events);
    if (stored_.size() < G()) stored_.resize(G());
    for (const pagedkv::KVEvent& e : events) {
      if (e.medium != pagedkv::Medium::kGpu) continue;
      REQUIRE(e.group < G());
      auto& view = stored_[e.group];
      if (e.type == pagedkv::KVEventType::kAllCleared) {
        for (auto& v : stored_) v.clear();
      } else if (e.type == pagedkv::KVEventType::kBlockRemoved) {
        if (view.erase(e.hash) != 1) FAIL("BlockRemoved of a hash not stored, group " << e.group);
        if (coarse(e.group)) ++rekeys;  // (a re-key, an eviction or a rewind below the key of a coarse page)
      } else {
        const auto it = prefix_of_.find(host_key(e.hash, e.group));
        REQUIRE(it != prefix_of_.end());
        const Toks& t = it->second;
        REQUIRE(e.block_size == bs_);
        REQUIRE(e.block_start == t.size() - bs_);
        REQUIRE(Toks(t.end() - static_cast<std::ptrdiff_t>(bs_), t.end()) == e.token_ids);
        const auto h = chain(m_, t);
        REQUIRE(e.parent_hash.has_value() == (h.size() > 1));
        if (e.parent_hash) REQUIRE(*e.parent_hash == h[h.size() - 2]);
        if (!view.insert(e.hash).second) FAIL("BlockStored twice of a hash in group " << e.group);
      }
      ++event_checks;
    }
    for (std::size_t g = 0; g < G(); ++g) {
      REQUIRE(stored_[g].size() == m_.prefix_index(g).size());
      for (const BlockHash& h : stored_[g]) {
        if (!m_.prefix_index(g).find(h)) FAIL("group " << g << ": a stored hash the index lacks");
      }
    }
  }

  void check() {
    check_events();
    const auto& a = m_.allocator();
    std::map<std::uint32_t, std::uint32_t> holders;
    REQUIRE(m_.num_sequences() == seqs_.size());
    REQUIRE(m_.num_swapped() == swapped_.size());
    for (const auto& [id, s] : seqs_) {
      REQUIRE(m_.num_tokens(id) == s.slotted);
      REQUIRE(m_.num_built(id) == s.built);
      REQUIRE(m_.sequence(id).num_lookahead == s.drafts.size());
      const auto t = m_.token_ids(id);
      REQUIRE(Toks(t.begin(), t.end()) == s.tokens);
      const auto h = chain(m_, s.tokens);
      for (std::size_t g = 0; g < G(); ++g) {
        const auto tbl = m_.block_ids(id, g);
        REQUIRE(tbl.size() == (s.slotted + page(g) - 1) / page(g));
        REQUIRE(m_.num_null_blocks(id, g) == s.released[g]);
        for (std::size_t i = 0; i < tbl.size(); ++i) {
          if ((tbl[i] == 0) != (i < s.released[g])) FAIL("seq " << id << " group " << g << " null entry " << i);
          if (tbl[i] == 0) continue;
          ++holders[tbl[i]];
          if (m_.group_of(tbl[i]) != g) FAIL("block " << tbl[i] << " of group " << g << " tagged otherwise");
          if (const auto reg = m_.prefix_index(g).hash_of(tbl[i])) {
            if (coarse(g)) {
              // Keyed by the hash of a match block inside this page: of this sequence's chain, or (a page shared
              // with a sequence that went on) of a prefix that agrees with this sequence's slotted positions up to
              // the key: a slot under the key that this sequence would write with other ids is a write into
              // registered content (check_content checks the content itself).
              const auto it = prefix_of_.find(host_key(*reg, g));
              REQUIRE(it != prefix_of_.end());
              const Toks& t = it->second;
              if ((t.size() - 1) / page(g) != i) {
                FAIL("seq " << id << " group " << g << " page " << i << " keyed by the " << t.size()
                            << "-token prefix");
              }
              const Toks ids = s.ids();
              const std::size_t n = std::min(t.size(), s.slotted);
              const auto diff = std::mismatch(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(n), ids.begin());
              if (diff.first != t.begin() + static_cast<std::ptrdiff_t>(n)) {
                FAIL("seq " << id << " group " << g << " page " << i << " (block " << tbl[i] << ") is keyed by the "
                            << t.size() << "-token prefix, which differs from the sequence's slotted ids at position "
                            << (diff.first - t.begin()) << " (the sequence has " << s.slotted << " slotted, "
                            << s.built << " built): its writes would change registered content");
              }
            } else if (i < h.size() && !(*reg == h[i])) {
              // Registered under the chain hash of this sequence's own tokens (a block left partial by a rewind
              // keeps its registration: its content is still that of the longer sequence).
              FAIL("seq " << id << " group " << g << " block " << i << " hash");
            }
          }
        }
      }
    }
    for (const auto& c : m_.pending_copies()) {
      ++holders[c.src];
      REQUIRE(m_.group_of(c.src) == c.group);
      REQUIRE(m_.group_of(c.dst) == c.group);
    }
    for (const auto& [dst, token] : filling_) ++holders[dst];  // a fill in flight pins its destination
    for (const auto& t : m_.transfers().queued()) {
      if (!pagedkv::is_device_to_host(t.kind)) ++holders[t.device];  // a queued fill too
    }
    std::vector<std::size_t> held(G(), 0);
    std::size_t used = 0, cached = 0, free = 0;
    for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
      const auto it = holders.find(b);
      const std::uint32_t want = it == holders.end() ? 0 : it->second;
      if (a.refcount(b) != want) FAIL("block " << b << " refcount " << a.refcount(b) << ", holders " << want);
      if (want > 0) {
        ++used;
        ++held[m_.group_of(b)];
      } else if (a.is_cached(b)) {
        ++cached;
      } else {
        ++free;
      }
      // Hashed <=> registered, in exactly the group the block belongs to.
      std::size_t regs = 0;
      for (std::size_t g = 0; g < G(); ++g) regs += m_.prefix_index(g).hash_of(b).has_value() ? 1 : 0;
      if (regs != (a.is_hashed(b) ? 1U : 0U)) {
        FAIL("block " << b << " in " << regs << " indexes, hashed " << a.is_hashed(b));
      }
      if (a.is_hashed(b) && !m_.prefix_index(m_.group_of(b)).hash_of(b)) {
        FAIL("block " << b << " not in its group's index");
      }
    }
    const auto st = m_.stats();
    REQUIRE(st.blocks_used == used);
    REQUIRE(st.blocks_cached == cached);
    REQUIRE(st.blocks_free == free);
    for (std::size_t g = 0; g < G(); ++g) REQUIRE(m_.held_blocks(g) == held[g]);
    if (const auto* host = m_.host_tier()) {
      // Host blocks are held by swapped sequences (each entry once) and by copies queued or in flight.
      std::map<std::uint32_t, std::uint32_t> host_holders;
      for (const auto& [id, s] : swapped_) {
        for (auto hb : m_.swapped_host_blocks(id)) {
          if (hb != 0) ++host_holders[hb];
        }
      }
      for (const auto& t : m_.transfers().queued()) ++host_holders[t.host];
      for (const auto& t : m_.transfers().in_flight()) ++host_holders[t.host];
      for (std::uint32_t hb = 1; hb < host->allocator().num_blocks(); ++hb) {
        const auto it = host_holders.find(hb);
        const std::uint32_t want = it == host_holders.end() ? 0U : it->second;
        if (host->allocator().refcount(hb) != want) FAIL("host block " << hb << " refcount, holders " << want);
      }
      REQUIRE(st.transfers_in_flight == m_.transfers().in_flight().size());
    }
  }

  M m_;
  std::uint32_t bs_;
  std::uint32_t stride_;  // shadow slots per block: the largest page of any group (a block is one page in every group)
  HarnessOptions opt_;
  std::mt19937_64 rng_;
  std::vector<std::uint64_t> shadow_;       // [num_blocks x bs] device pool content
  std::vector<std::uint64_t> host_shadow_;  // [num_host_blocks x bs] host tier content
  std::vector<Toks> prefixes_;
  std::map<SeqId, ModelSeq> seqs_;
  std::map<SeqId, ModelSeq> swapped_;
  std::vector<std::uint64_t> in_flight_;                       // transfer tokens issued, not completed
  std::vector<std::pair<std::uint32_t, std::uint64_t>> filling_;  // (device block, token) of issued fills
  std::unordered_map<BlockHash, Toks, pagedkv::BlockHashHasher> prefix_of_;  // host key -> token prefix
  std::vector<std::unordered_set<BlockHash, pagedkv::BlockHashHasher>> stored_;  // [G] the events' device view
  SeqId next_id_ = 1;
};

using LruHarness = GroupsHarness<Mgr>;
using PrioMgr =
    pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, pagedkv::PriorityLruEviction<std::uint32_t>>;

}  // namespace

TEST_CASE("HybridKVCacheManager: randomized operations against a shadow model and a shadow pool",
          "[kv_cache_groups][model]") {
  struct Cfg {
    const char* name;
    std::uint32_t bs;
    std::size_t blocks;
    std::vector<KVCacheGroupSpec> groups;
  };
  const std::vector<Cfg> cfgs = {
      {"bs1 full+swa3", 1, 160, {full(), swa(3)}},
      {"bs4 full+swa6+chunk8", 4, 90, {full(), swa(6), chunked(8)}},
      {"bs4 swa1+swa5+chunk6", 4, 70, {swa(1), swa(5), chunked(6)}},
      {"bs16 full+swa20+swa40", 16, 60, {full(), swa(20), swa(40)}},
      {"bs4 full only", 4, 50, {full(), full()}},
  };
  std::size_t total_kept = 0;  // copies of sequences left out of a build, kept pending for their own
  for (const Cfg& c : cfgs) {
    for (std::uint64_t seed : {1ULL, 2ULL, 3ULL}) {
      CAPTURE(c.name, seed);
      LruHarness h(c.bs, c.blocks, c.groups, seed * 1000 + c.bs);
      h.run(1500);
      INFO("builds " << h.builds << " admitted " << h.admitted << " hits " << h.hits << " no_capacity "
                     << h.no_capacity << " content " << h.content_checks << " copies " << h.copies << " releases "
                     << h.releases << " rewinds_refused " << h.rewinds_refused << " dedups " << h.dedups
                     << " kept copies " << h.kept_copies);
      CHECK(h.builds > 100);
      CHECK(h.admitted > 30);
      CHECK(h.hits > 3);
      CHECK(h.no_capacity > 0);
      CHECK(h.content_checks > 1000);
      if (c.bs > 1) CHECK(h.copies > 0);  // (no partial block at block size 1)
      total_kept += h.kept_copies;
      if (c.groups[1].kind != AttentionKind::kFull) CHECK(h.releases > 20);
    }
  }
  CHECK(total_kept > 10);
}

TEST_CASE("HybridKVCacheManager: randomized groups with lookahead, prepared prompts, host tier and retention",
          "[kv_cache_groups][model][model_full]") {
  struct Cfg {
    const char* name;
    std::uint32_t bs;
    std::size_t blocks, host_blocks;
    std::vector<KVCacheGroupSpec> groups;
  };
  const std::vector<Cfg> cfgs = {
      {"bs1 full+swa3", 1, 160, 120, {full(), swa(3)}},
      {"bs4 full+swa6+chunk8", 4, 90, 60, {full(), swa(6), chunked(8)}},
      {"bs4 swa1+swa5+chunk6", 4, 70, 40, {swa(1), swa(5), chunked(6)}},
      {"bs16 full+swa20+swa40", 16, 60, 30, {full(), swa(20), swa(40)}},
      {"bs4 full+full", 4, 50, 20, {full(), full()}},
      {"bs4 full", 4, 40, 30, {full()}},
  };
  std::size_t lookaheads = 0, accepted = 0, rejected = 0, prepared = 0, swaps = 0, swaps_refused = 0, resumes = 0,
              pending = 0, swap_ins = 0, onboarded = 0, completions = 0;
  for (const Cfg& c : cfgs) {
    for (std::uint64_t seed : {11ULL, 12ULL}) {
      CAPTURE(c.name, seed);
      HarnessOptions o;
      o.host_blocks = c.host_blocks;
      o.lookahead = true;
      o.prepared = true;
      GroupsHarness<Mgr> h(c.bs, c.blocks, c.groups, seed * 1000 + c.bs, o);
      h.run(1500);
      INFO("builds " << h.builds << " admitted " << h.admitted << " hits " << h.hits << " content "
                     << h.content_checks << " lookaheads " << h.lookaheads << " accepted " << h.drafts_accepted
                     << " rejected " << h.drafts_rejected << " prepared " << h.prepared << " swaps " << h.swaps
                     << " refused " << h.swaps_refused << " resumes " << h.resumes << " pending "
                     << h.transfer_pending << " swap_outs " << h.swap_outs << " swap_ins " << h.swap_ins
                     << " onboarded tokens " << h.onboarded_tokens << " completions " << h.completions
                     << " host content " << h.host_content_checks << " registered content "
                     << h.registered_content_checks << " releases " << h.releases);
      CHECK(h.builds > 100);
      CHECK(h.content_checks > 1000);
      CHECK(h.swap_outs > 10);
      CHECK(h.host_content_checks > 100);
      CHECK(h.registered_content_checks > 100);
      lookaheads += h.lookaheads;
      accepted += h.drafts_accepted;
      rejected += h.drafts_rejected;
      prepared += h.prepared;
      swaps += h.swaps;
      swaps_refused += h.swaps_refused;
      resumes += h.resumes;
      pending += h.transfer_pending;
      swap_ins += h.swap_ins;
      onboarded += h.onboarded_tokens;
      completions += h.completions;
    }
  }
  INFO("lookaheads " << lookaheads << " accepted " << accepted << " rejected " << rejected << " prepared " << prepared
                     << " swaps " << swaps << " refused " << swaps_refused << " resumes " << resumes << " pending "
                     << pending << " swap_ins " << swap_ins << " onboarded tokens " << onboarded << " completions "
                     << completions);
  CHECK(lookaheads > 300);
  CHECK(accepted > 200);
  CHECK(rejected > 200);
  CHECK(prepared > 300);
  CHECK(swaps > 100);
  CHECK(swaps_refused > 0);
  CHECK(resumes > 50);
  CHECK(pending > 0);
  CHECK(swap_ins > 100);
  CHECK(onboarded > 0);
  CHECK(completions > 500);
}

TEST_CASE("HybridKVCacheManager: randomized groups under PriorityLruEviction - retention priorities of cached blocks",
          "[kv_cache_groups][model][retention]") {
  for (std::uint64_t seed : {21ULL, 22ULL, 23ULL}) {
    CAPTURE(seed);
    HarnessOptions o;
    o.host_blocks = 40;
    o.lookahead = true;
    o.retention = true;
    GroupsHarness<PrioMgr> h(4, 80, {full(), swa(6), chunked(8)}, seed, o);
    h.run(1500);
    INFO("admitted " << h.admitted << " with retention " << h.retention_admits << " priority checks "
                     << h.retention_checks << " content " << h.content_checks);
    CHECK(h.retention_admits > 30);
    CHECK(h.retention_checks > 100);
    CHECK(h.content_checks > 1000);
  }
}

TEST_CASE("HybridKVCacheManager: a coarse page re-keyed by one holder is not written in place by another",
          "[kv_cache_groups][model_coarse][cow]") {
  // Found by the coarse model test below (bs4 full+full16+chunk8, seed 60 of a longer run): a hit without a
  // reservation holds a partial page another sequence is still filling; that sequence re-keys the page past the
  // hit, then leaves it (free here; a copy-on-write of its own next append does the same); the hit's sequence, now
  // the sole holder, appended in place into positions the new key names.
  Mgr m(make_config(64, 4, {full(), full_pages(8)}));
  const Toks x = pagedkv_test::toks(100, 16);
  Toks n(x.begin(), x.begin() + 12);
  for (TokenId t : {7, 8, 9}) n.push_back(t);
  pagedkv::AdmitOptions all;
  all.num_reserved_tokens = 16;
  REQUIRE(m.try_admit(1, x, nullptr, all).admitted());
  (void)build(m, {1}, {12});  // group 1: page 0 keyed at block 1, page 1 a partial entry at block 2; 12..15 slotted
  pagedkv::AdmitOptions none;
  none.num_reserved_tokens = 0;
  REQUIRE(m.try_admit(2, n, nullptr, none).num_cached_tokens == 12);
  const std::uint32_t shared = m.block_ids(2, 1)[1];
  REQUIRE(shared == m.block_ids(1, 1)[1]);
  (void)build(m, {1}, {4});  // sequence 1 fills page 1: keyed at block 3, its tokens 12..15 at offsets 4..7
  const auto h = chain(m, x);
  m.free(1);
  REQUIRE(m.try_reserve(2, 3).ok());  // sequence 2's positions 12..14: offsets 4..6 of its page 1
  if (m.block_ids(2, 1)[1] == shared) {
    CHECK_FALSE(m.prefix_index(1).hash_of(shared) == h[3]);  // written in place: the key must not name them
  }
  (void)build(m, {2}, {3});
  Toks z = x;
  z.push_back(1);
  const auto r = m.try_admit(3, z);  // x's 16 tokens hit page 1 only where it holds x's positions 12..15
  REQUIRE(r.admitted());
  if (r.num_cached_tokens == 16) CHECK(m.block_ids(3, 1)[1] != m.block_ids(2, 1)[1]);
}

TEST_CASE("HybridKVCacheManager: randomized coarse-page groups against a shadow model and a shadow pool",
          "[kv_cache_groups][model][model_coarse]") {
  // Full groups with pages of 2-4 match blocks beside full, sliding-window and chunked-local groups at the pool's
  // block size: partial-page hits (half the admissions continue a live sequence's built tokens, a third hold the
  // hit without a reservation), forks and the copy-on-write of a shared partial page, chunked prefill (partial
  // entries re-keyed as pages fill, pages shared meanwhile), decode appends, rewinds below a partial page's key,
  // preemption, lookahead; every build's copies and slot mappings run on the shadow pool, every registered page
  // holds the prefix its key names, no table slots a position under a key that names other ids, the events replay
  // to each group's index, explain_admit agrees with the oracle.
  struct Cfg {
    const char* name;
    std::uint32_t bs;
    std::size_t blocks;
    std::vector<KVCacheGroupSpec> groups;
  };
  const std::vector<Cfg> cfgs = {
      {"bs4 full+full8+swa6", 4, 100, {full(), full_pages(8), swa(6)}},
      {"bs4 full+full16+chunk8", 4, 100, {full(), full_pages(16), chunked(8)}},
      {"bs2 full+full4+full8", 2, 140, {full(), full_pages(4), full_pages(8)}},
      {"bs1 full+full2+swa3", 1, 200, {full(), full_pages(2), swa(3)}},
      {"bs16 full+full64+swa20", 16, 60, {full(), full_pages(64), swa(20)}},
  };
  std::size_t hits = 0, partial_hits = 0, coarse_copies = 0, explain_limited = 0, rekeys = 0, unkeys = 0, forks = 0,
              lookaheads = 0, kept = 0;
  // 12 seeds per configuration (seeds 31..42), a fraction of them under PAGEDKV_TEST_SEED_DIVISOR (CI): the same
  // checks on every run, the totals' thresholds below scaled by the fraction run.
  const std::uint64_t seeds = pagedkv_test::seed_count(12);
  const double frac = static_cast<double>(seeds) / 12.0;
  for (const Cfg& c : cfgs) {
    for (std::uint64_t seed = 31; seed < 31 + seeds; ++seed) {
      CAPTURE(c.name, seed);
      HarnessOptions o;
      o.lookahead = seed % 2 == 1;  // half the runs with lookahead drafts and prepared prompts
      o.prepared = seed % 2 == 1;
      LruHarness h(c.bs, c.blocks, c.groups, seed * 1000 + c.bs, o);
      h.run(1500);
      INFO("builds " << h.builds << " admitted " << h.admitted << " hits " << h.hits << " partial-page hits "
                     << h.partial_hits << " no_capacity " << h.no_capacity << " content " << h.content_checks
                     << " registered content " << h.registered_content_checks << " (coarse "
                     << h.coarse_registered_checks << ") copies " << h.copies << " (coarse " << h.coarse_copies
                     << ") kept copies " << h.kept_copies << " explain " << h.explain_checks
                     << " (limited by a coarse group " << h.explain_limited << ") events " << h.event_checks
                     << " coarse removals " << h.rekeys << " rewinds unkeying " << h.coarse_unkeys << " forks "
                     << h.forks << " lookaheads " << h.lookaheads << " releases " << h.releases);
      CHECK(h.builds > 100);
      CHECK(h.admitted > 30);
      CHECK(h.content_checks > 1000);
      CHECK(h.coarse_registered_checks > 100);
      CHECK(h.explain_checks > 30);
      CHECK(h.event_checks > 50);
      hits += h.hits;
      partial_hits += h.partial_hits;
      coarse_copies += h.coarse_copies;
      explain_limited += h.explain_limited;
      rekeys += h.rekeys;
      unkeys += h.coarse_unkeys;
      forks += h.forks;
      lookaheads += h.lookaheads;
      kept += h.kept_copies;
    }
  }
  INFO("hits " << hits << " partial-page hits " << partial_hits << " coarse copies " << coarse_copies
               << " limited by a coarse group " << explain_limited << " coarse removals " << rekeys
               << " rewinds unkeying " << unkeys << " forks " << forks << " lookaheads " << lookaheads
               << " kept copies " << kept);
  CAPTURE(seeds);
  CHECK(hits > 500 * frac);
  CHECK(partial_hits > 300 * frac);
  CHECK(coarse_copies > 300 * frac);
  CHECK(explain_limited > 100 * frac);
  CHECK(rekeys > 1000 * frac);
  CHECK(unkeys > 50 * frac);
  CHECK(forks > 300 * frac);
  CHECK(lookaheads > 300 * frac);
  CHECK(kept > 50 * frac);
}

TEST_CASE("HybridKVCacheManager: randomized coarse-page groups under PriorityLruEviction - retention per page",
          "[kv_cache_groups][model][model_coarse][retention]") {
  for (std::uint64_t seed : {41ULL, 42ULL}) {
    CAPTURE(seed);
    HarnessOptions o;
    o.lookahead = true;
    o.retention = true;
    GroupsHarness<PrioMgr> h(4, 100, {full(), full_pages(8), swa(6)}, seed, o);
    h.run(1500);
    INFO("admitted " << h.admitted << " with retention " << h.retention_admits << " priority checks "
                     << h.retention_checks << " content " << h.content_checks);
    CHECK(h.retention_admits > 30);
    CHECK(h.retention_checks > 100);
    CHECK(h.content_checks > 1000);
  }
}

// ---------------------------------------------------------------------------------------------------------------------
// End to end: the CPU reference decode over the sliding-window group's page table equals float64 over the full group.

TEST_CASE("HybridKVCacheManager: windowed decode over the SWA group's table equals float64 over the full table",
          "[kv_cache_groups][e2e]") {
  namespace ref = pagedkv::reference;
  const std::uint32_t bs = 4;
  const int H = 2, D = 8, HQ = 4;
  for (const KVCacheGroupSpec& spec : {swa(1), swa(5), swa(8), swa(11), chunked(8), chunked(6)}) {
    CAPTURE(static_cast<int>(spec.kind), spec.window_tokens);
    const std::size_t num_blocks = 120;
    Mgr m(make_config(num_blocks, bs, {full(), spec}));
    // One float32 NHD pool shared by both groups (their blocks are disjoint); NaN where nothing was written.
    std::vector<float> pool(num_blocks * 2 * bs * H * D, std::numeric_limits<float>::quiet_NaN());
    const auto view = pagedkv::KVPoolView::nhd(pool.data(), pagedkv::DType::kFloat32, static_cast<std::int32_t>(num_blocks),
                                               static_cast<std::int32_t>(bs), H, D);
    std::mt19937 rng(spec.window_tokens);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    // K/V of (sequence, position): deterministic, the same in both groups (the same layer's data).
    const auto kv_of = [](SeqId s, std::size_t p, int h, int d, int which) {
      const std::uint64_t x = mix((s << 40) ^ (p << 16) ^ (static_cast<std::uint64_t>(h) << 8) ^
                                  (static_cast<std::uint64_t>(d) << 2) ^ static_cast<std::uint64_t>(which));
      return static_cast<float>(static_cast<double>(x >> 40) / static_cast<double>(1ULL << 24)) * 2.f - 1.f;
    };
    const std::vector<SeqId> ids{1, 2, 3};
    for (SeqId s : ids) REQUIRE(m.try_admit(s, pagedkv_test::toks(static_cast<TokenId>(s * 100), 3 + s * 5)).admitted());
    double worst = 0.0;
    int checked = 0;
    for (int step = 0; step < 30; ++step) {
      std::vector<std::size_t> first_pos;
      for (SeqId s : ids) first_pos.push_back(m.num_built(s));
      auto [sizes, buf] = build(m, ids);
      // write_kv per group with its own slot mapping.
      for (std::size_t g = 0; g < 2; ++g) {
        const std::size_t n = sizes[g].num_new_tokens;
        std::vector<float> k(n * H * D), v(n * H * D);
        std::size_t row = 0;
        for (std::size_t b = 0; b < ids.size(); ++b) {
          for (std::size_t p = first_pos[b]; p < m.num_built(ids[b]); ++p, ++row) {
            for (int h = 0; h < H; ++h) {
              for (int d = 0; d < D; ++d) {
                k[(row * H + h) * D + d] = kv_of(ids[b], p, h, d, 0);
                v[(row * H + h) * D + d] = kv_of(ids[b], p, h, d, 1);
              }
            }
          }
        }
        pagedkv::WriteKVParams w;
        w.key = k.data();
        w.value = v.data();
        w.slot_mapping = buf.slots[g].data();
        w.num_tokens = static_cast<std::int32_t>(n);
        w.kv = view;
        REQUIRE(ref::write_kv(w) == pagedkv::Status::kSuccess);
      }
      // Decode every sequence's last token in the window group, through its table (null before the window).
      const int B = static_cast<int>(ids.size());
      std::vector<float> q(static_cast<std::size_t>(B * HQ * D)), o(q.size(), std::numeric_limits<float>::quiet_NaN());
      for (auto& x : q) x = u(rng);
      pagedkv::DecodeParams p;
      p.q = q.data();
      p.o = o.data();
      p.kv = view;
      p.pages = pagedkv::PageTable::csr(B, buf.indptr[1].data(), buf.indices[1].data(), buf.last_page_len[1].data());
      p.num_qo_heads = HQ;
      p.sm_scale = 1.0f / std::sqrt(static_cast<float>(D));
      p.window = m.window(1);
      REQUIRE(ref::decode(p) == pagedkv::Status::kSuccess);
      // float64 over the full group's table: keys [first_visible(len - 1), len) gathered through it.
      for (int b = 0; b < B; ++b) {
        const std::size_t len = static_cast<std::size_t>(buf.seq_lens[0][static_cast<std::size_t>(b)]);
        const auto lo = static_cast<std::size_t>(m.window(1).first_visible(static_cast<std::int64_t>(len - 1)));
        const std::int32_t* pages = buf.indices[0].data() + buf.indptr[0][static_cast<std::size_t>(b)];
        for (int hq = 0; hq < HQ; ++hq) {
          const int h = hq / (HQ / H);
          const float* qv = q.data() + (b * HQ + hq) * D;
          std::vector<double> logits;
          double mx = -1e300;
          for (std::size_t t = lo; t < len; ++t) {
            const float* kp = pool.data() + view.offset(pages[t / bs], static_cast<std::int64_t>(t % bs), h);
            double dot = 0;
            for (int d = 0; d < D; ++d) dot += static_cast<double>(qv[d]) * kp[d];
            logits.push_back(dot * p.sm_scale);
            mx = std::max(mx, logits.back());
          }
          std::vector<double> out(D, 0.0);
          double den = 0;
          for (std::size_t t = lo; t < len; ++t) {
            const double e = std::exp(logits[t - lo] - mx);
            den += e;
            const float* vp = static_cast<const float*>(view.v) + view.offset(pages[t / bs], static_cast<std::int64_t>(t % bs), h);
            for (int d = 0; d < D; ++d) out[static_cast<std::size_t>(d)] += e * vp[d];
          }
          for (int d = 0; d < D; ++d) {
            const double want = out[static_cast<std::size_t>(d)] / den;
            const double got = o[static_cast<std::size_t>((b * HQ + hq) * D + d)];
            REQUIRE(std::isfinite(got));
            worst = std::max(worst, std::abs(got - want) / std::max(1.0, std::abs(want)));
          }
          ++checked;
        }
        // The window group really has null pages here once the sequence is past its window.
        if (step > 0 && lo >= bs) REQUIRE(buf.indices[1][static_cast<std::size_t>(buf.indptr[1][static_cast<std::size_t>(b)])] == 0);
      }
      for (SeqId s : ids) REQUIRE(m.try_append(s, pagedkv_test::toks(static_cast<TokenId>(step), 1)).ok());
    }
    CHECK(checked == 30 * 3 * HQ);
    CHECK(worst < 1e-5);
  }
}
