// Tests of recurrent-state groups (AttentionKind::kRecurrent; issue 20 sec. 1; docs/groups.md "Recurrent-state
// groups"): a working state per sequence updated in place by every build, checkpoints every `interval` tokens
// content-addressed by the chain hash of the blocks before them, prefix hits that resume from the latest checkpoint.
//
//  - [config]  bad configurations are typed errors naming the value;
//  - [toy]     a toy recurrence (an affine scan over the tokens) plays the SSM kernel: a shadow pool executes each
//              build's copies, reads state_in, scans the step's tokens, writes each checkpoint and state_out; after
//              every operation every built sequence's working state equals the scan computed contiguously over its
//              tokens, and every registered checkpoint holds the scan of the prefix its hash names. Through
//              admission (whole and chunked), hits, fork, growth, partial builds, rewind of unbuilt positions,
//              preemption by recompute and re-admission, eviction under a small pool. Free blocks are poisoned
//              after every operation; refcounts and per-group held counts are recounted from the tables;
//  - [prefix]  the hit is the brute-force maximum over the groups (full run, window blocks, the checkpoint at the
//              end of the hit) and always a multiple of the interval;
//  - [strong]  refused calls (swap preemption, lookahead, rewinding built positions, a build without the state
//              outputs, a pool too small) are typed errors or results and change nothing.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <pagedkv/kv_cache_manager.hpp>

#include "test_support.hpp"

namespace {

using pagedkv::AttentionKind;
using pagedkv::BatchMetadataBuffers;
using pagedkv::BatchMetadataLimits;
using pagedkv::BatchMetadataStorage;
using pagedkv::BlockHash;
using pagedkv::CacheConfig;
using pagedkv::Errc;
using pagedkv::KVCacheGroupSpec;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::expect_error;

using Manager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;

// One step of the toy recurrence: an affine map of the state, driven by the token and its position.
std::uint64_t scan_step(std::uint64_t s, TokenId t, std::size_t pos) {
  return s * 6364136223846793005ULL + ((static_cast<std::uint64_t>(t) + 1) * 0x9E3779B97F4A7C15ULL ^ pos) +
         1442695040888963407ULL;
}
std::uint64_t scan(std::span<const TokenId> tokens, std::size_t n) {
  std::uint64_t s = 0;
  for (std::size_t p = 0; p < n; ++p) s = scan_step(s, tokens[p], p);
  return s;
}

CacheConfig config(std::size_t num_blocks, std::uint32_t bs, std::vector<KVCacheGroupSpec> groups) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = bs;
  c.groups = std::move(groups);
  return c;
}

// The engine side of a pool with recurrent groups: one BatchMetadataStorage per group, a shadow of every block's
// state (what the SSM kernel would keep there), and the expected scan of every block-hash prefix seen.
struct Engine {
  Manager m;
  std::mt19937_64 rng;
  std::vector<BatchMetadataStorage> store;
  std::vector<std::uint64_t> mem;                       // [num_blocks] the state a block holds
  // The chain hash of blocks [0, i] -> the scan of their (i + 1) * bs tokens.
  std::unordered_map<BlockHash, std::uint64_t, pagedkv::BlockHashHasher> expect;

  Engine(const CacheConfig& c, std::uint64_t seed) : m(c), rng(seed), mem(c.num_blocks, 0) {
    BatchMetadataLimits lim;
    lim.max_batch = 64;
    lim.max_tokens_per_step = 8192;
    lim.max_blocks_per_seq = 2048;
    lim.max_copies = 256;
    for (std::size_t g = 0; g < m.num_groups(); ++g) store.emplace_back(lim);
    for (auto& x : mem) x = rng();
  }

  void remember_prefixes(SeqId s) {
    const auto& q = m.sequence(s);
    const std::size_t bs = m.block_size();
    for (std::size_t i = 0; i < q.hashes.size(); ++i) expect[q.hashes[i]] = scan(q.tokens, (i + 1) * bs);
  }

  // Build `batch` with `sched` tokens each and run the step as the kernels would: copies first, then each row's
  // scan from state_in, writing its checkpoints and state_out.
  void build(const std::vector<SeqId>& batch, const std::vector<std::uint32_t>& sched) {
    std::vector<BatchMetadataBuffers> bufs;
    for (auto& st : store) bufs.push_back(st.buffers());
    const auto sizes = m.build_batch_metadata(batch, bufs, sched);
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      for (std::size_t j = 0; j < sizes[g].num_copies; ++j) {
        if (m.is_recurrent(g)) mem[store[g].copies[2 * j + 1]] = mem[store[g].copies[2 * j]];
      }
    }
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      if (!m.is_recurrent(g)) continue;
      const BatchMetadataStorage& st = store[g];
      REQUIRE(sizes[g].num_checkpoints == static_cast<std::size_t>(st.checkpoint_indptr[batch.size()]));
      std::vector<std::pair<std::int32_t, std::uint64_t>> writes;  // all reads of the step before its writes
      for (std::size_t r = 0; r < batch.size(); ++r) {
        const auto tokens = m.token_ids(batch[r]);
        const std::size_t seq_len = static_cast<std::size_t>(st.seq_lens[r]);
        const std::size_t first = seq_len - static_cast<std::size_t>(st.qo_indptr[r + 1] - st.qo_indptr[r]);
        REQUIRE(first == seq_len - sched[r]);
        std::uint64_t s = st.state_in[r] == -1 ? 0 : mem[static_cast<std::size_t>(st.state_in[r])];
        if (st.state_in[r] == -1) REQUIRE(first == 0);
        std::int32_t c = st.checkpoint_indptr[r];
        for (std::size_t p = first; p < seq_len; ++p) {
          s = scan_step(s, tokens[p], p);
          if (c < st.checkpoint_indptr[r + 1] && static_cast<std::size_t>(st.checkpoint_positions[c]) == p + 1) {
            // A checkpoint of the interval, or the last checkpoint at the step's last block boundary.
            const auto& spec = m.config().groups[g];
            const auto& og = m.sequence(batch[r]).other_groups[g - 1];
            const bool last = spec.last_checkpoint && p + 1 == seq_len / m.block_size() * m.block_size() &&
                              static_cast<std::uint32_t>(st.checkpoint_blocks[c]) == og.last_block &&
                              og.last_pos == p + 1;
            REQUIRE(((p + 1) % spec.window_tokens == 0 || last));
            writes.emplace_back(st.checkpoint_blocks[c], s);
            ++c;
          }
        }
        REQUIRE(c == st.checkpoint_indptr[r + 1]);  // every checkpoint lies inside the step, in position order
        REQUIRE(st.state_out[r] == static_cast<std::int32_t>(m.state_block(batch[r], g)));
        writes.emplace_back(st.state_out[r], s);
      }
      for (std::size_t r = batch.size(); r < st.state_in.size(); ++r) REQUIRE(st.state_in[r] == -1);
      for (const auto& [b, v] : writes) mem[static_cast<std::size_t>(b)] = v;
    }
    for (SeqId s : batch) remember_prefixes(s);
  }

  // Every invariant the manager promises, recounted from its public state.
  void check() {
    const std::size_t N = m.config().num_blocks;
    const std::size_t G = m.num_groups();
    std::vector<std::uint32_t> refs(N, 0);
    std::vector<std::size_t> held(G, 0);
    m.for_each_sequence([&](SeqId s, std::size_t) {
      const auto& q = m.sequence(s);
      for (std::size_t g = 0; g < G; ++g) {
        for (auto b : q.table_of(g).blocks()) refs[b] += b != 0 ? 1 : 0;
        if (m.is_recurrent(g)) {
          const auto st = q.other_groups[g - 1].state;
          REQUIRE(st != 0);
          ++refs[st];
          const auto last = q.other_groups[g - 1].last_block;
          REQUIRE((last != 0) == m.config().groups[g].last_checkpoint);
          if (last != 0) {
            ++refs[last];
            const std::size_t lp = q.other_groups[g - 1].last_pos;
            REQUIRE(lp <= q.num_built);
            if (lp > 0) REQUIRE(mem[last] == scan(q.tokens, lp));  // the state at its last block boundary
          }
          if (q.other_groups[g - 1].state_valid) {
            // The working state is the contiguous scan of the built tokens (the property the kernels rely on); a
            // state copied after a fork is filled by a pending copy that the next build hands out: its source.
            INFO("sequence " << s << " group " << g << " built " << q.num_built);
            auto from = st;
            for (const auto& c : m.pending_copies()) from = c.dst == st ? c.src : from;
            REQUIRE(mem[from] == scan(q.tokens, q.num_built));
          } else {
            REQUIRE(q.num_built % m.block_size() == 0);
            if (q.num_built > 0) {  // the hit's checkpoint: what the first build will read
              const auto ck = q.table_of(g).blocks()[q.num_built / m.block_size() - 1];
              REQUIRE(ck != 0);
              REQUIRE(mem[ck] == scan(q.tokens, q.num_built));
            }
          }
          // Only checkpoints not written yet are held in the table (written ones went to the cache).
          const auto blocks = q.table_of(g).blocks();
          for (std::size_t i = 0; i < blocks.size(); ++i) {
            if (blocks[i] == 0) continue;
            const bool hit_entry = !q.other_groups[g - 1].state_valid && (i + 1) * m.block_size() == q.num_built;
            REQUIRE((((i + 1) * m.block_size()) % m.config().groups[g].window_tokens == 0 || hit_entry));
            REQUIRE((i + 1) * m.block_size() >= q.num_built);
          }
        }
      }
    });
    for (const auto& c : m.pending_copies()) ++refs[c.src];
    for (std::size_t b = 1; b < N; ++b) {
      INFO("block " << b);
      REQUIRE(m.allocator().refcount(static_cast<std::uint32_t>(b)) == refs[b]);
      if (refs[b] > 0) ++held[m.group_of(static_cast<std::uint32_t>(b))];
    }
    for (std::size_t g = 0; g < G; ++g) REQUIRE(m.held_blocks(g) == held[g]);
    // Every registered checkpoint holds the scan of the prefix its hash names.
    for (std::size_t g = 0; g < G; ++g) {
      if (!m.is_recurrent(g)) continue;
      for (std::size_t b = 1; b < N; ++b) {
        if (m.group_of(static_cast<std::uint32_t>(b)) != g) continue;
        const auto h = m.prefix_index(g).hash_of(static_cast<std::uint32_t>(b));
        if (!h) continue;
        const auto it = expect.find(*h);
        REQUIRE(it != expect.end());
        REQUIRE(mem[b] == it->second);
      }
    }
    // Poison the free blocks: a state read from a block nobody wrote fails the checks above.
    for (std::size_t b = 1; b < N; ++b) {
      if (m.allocator().refcount(static_cast<std::uint32_t>(b)) == 0 &&
          !m.allocator().is_hashed(static_cast<std::uint32_t>(b))) {
        mem[b] = rng();
      }
    }
  }
};

// The largest k (blocks) <= cap_blocks that every group serves, from the definition: a full group needs blocks
// [0, k), a sliding window of W the blocks meeting [k * bs - W + 1, k * bs), a recurrent group block k - 1.
std::size_t oracle_hit(const Manager& m, const std::vector<BlockHash>& hashes, std::size_t cap_blocks) {
  const std::size_t bs = m.block_size();
  for (std::size_t k = cap_blocks; k > 0; --k) {
    bool ok = true;
    for (std::size_t g = 0; g < m.num_groups() && ok; ++g) {
      const auto& spec = m.config().groups[g];
      std::size_t lo = 0;
      if (spec.kind == AttentionKind::kSlidingWindow) {
        lo = k * bs + 1 > spec.window_tokens ? (k * bs + 1 - spec.window_tokens) / bs : 0;
      } else if (spec.recurrent()) {
        lo = k - 1;
      }
      for (std::size_t i = lo; i < k && ok; ++i) ok = m.prefix_index(g).find(hashes[i]).has_value();
    }
    if (ok) return k;
  }
  return 0;
}

void run_model(const CacheConfig& c, std::uint64_t seed, int steps) {
  Engine e(c, seed);
  Manager& m = e.m;
  std::mt19937_64& rng = e.rng;
  const std::size_t bs = c.block_size;
  // A few documents: prompts share their prefixes (conversation turns, shared system prompts).
  std::vector<std::vector<TokenId>> docs(4);
  for (auto& d : docs) {
    d.resize(40 + rng() % 120);
    for (auto& t : d) t = static_cast<TokenId>(rng() % 50);
  }
  SeqId next = 1;
  std::vector<SeqId> live;
  std::map<SeqId, std::vector<TokenId>> preempted;  // preempted by recompute: its tokens, to re-admit
  std::size_t hits = 0, admits = 0, forks = 0, builds = 0, checkpoints_hit = 0, rewinds = 0, refusals = 0;
  const auto pick = [&](auto& v) -> SeqId { return v[rng() % v.size()]; };
  const auto erase_live = [&](SeqId s) { live.erase(std::find(live.begin(), live.end(), s)); };
  const auto admit = [&](SeqId id, std::vector<TokenId> prompt) {
    pagedkv::AdmitOptions opts;
    if (rng() % 3 == 0) opts.num_reserved_tokens = rng() % prompt.size();
    const auto prep = m.prepare_prompt(prompt);
    const std::size_t cap_blocks = (prompt.size() - 1) / bs;
    const std::size_t want = oracle_hit(m, prep.hashes, cap_blocks);
    const auto r = m.try_admit(id, prep, opts);
    if (r.status != pagedkv::AdmitStatus::kAdmitted) return false;
    ++admits;
    live.push_back(id);
    REQUIRE(r.num_cached_tokens == want * bs);  // the brute-force maximum, all groups together
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      if (m.is_recurrent(g) && !c.groups[g].last_checkpoint) {
        REQUIRE(r.num_cached_tokens % c.groups[g].window_tokens == 0);
      }
    }
    if (r.num_cached_tokens > 0) {
      ++hits;
      checkpoints_hit += 1;
    }
    return true;
  };
  for (int step = 0; step < steps; ++step) {
    const int op = static_cast<int>(rng() % 100);
    if (op < 22 || live.empty()) {  // admit: a document prefix + a random tail, or a preempted request again
      if (!preempted.empty() && rng() % 2 == 0) {
        const auto it = preempted.begin();
        if (admit(it->first, it->second)) preempted.erase(it);
      } else {
        const auto& d = docs[rng() % docs.size()];
        std::vector<TokenId> p(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(1 + rng() % d.size()));
        for (std::size_t i = rng() % 20; i > 0; --i) p.push_back(static_cast<TokenId>(rng() % 50));
        admit(next++, p);
      }
    } else if (op < 45) {  // grow: reserve prompt tokens, or append 1-20 tokens
      const SeqId s = pick(live);
      const auto& q = m.sequence(s);
      if (q.num_unslotted() > 0) {
        (void)m.try_reserve(s, 1 + rng() % q.num_unslotted());
      } else {
        std::vector<TokenId> t(1 + (rng() % 4 == 0 ? rng() % 20 : 0));
        for (auto& x : t) x = static_cast<TokenId>(rng() % 50);
        (void)m.try_append(s, t);
      }
    } else if (op < 75) {  // build a random subset with random partial schedules
      std::vector<SeqId> batch;
      std::vector<std::uint32_t> sched;
      for (SeqId s : live) {
        const std::size_t pend = m.sequence(s).num_pending();
        if (pend == 0 || rng() % 3 == 0) continue;
        batch.push_back(s);
        sched.push_back(static_cast<std::uint32_t>(rng() % 2 == 0 ? pend : 1 + rng() % pend));
      }
      if (!batch.empty()) {
        e.build(batch, sched);
        ++builds;
      }
    } else if (op < 82) {  // fork a settled sequence
      const SeqId s = pick(live);
      if (m.sequence(s).settled() && m.sequence(s).num_pending_copies == 0) {
        m.fork(s, next);
        live.push_back(next++);
        ++forks;
      }
    } else if (op < 88) {  // free
      const SeqId s = pick(live);
      m.free(s);
      erase_live(s);
    } else if (op < 93) {  // preempt by recompute, re-admitted later with its tokens
      const SeqId s = pick(live);
      const auto t = m.sequence(s).tokens;
      m.preempt(s);
      erase_live(s);
      if (!t.empty()) preempted[s] = std::vector<TokenId>(t.begin(), t.end());
    } else {  // rewind: unbuilt positions succeed, built ones are refused and change nothing
      const SeqId s = pick(live);
      const auto& q = m.sequence(s);
      if (q.num_unslotted() != 0 || q.num_known() == 0) continue;
      const std::size_t unbuilt = q.num_known() - std::min(q.num_known(), q.num_built);
      if (unbuilt > 0 && rng() % 2 == 0) {
        m.rewind(s, 1 + rng() % unbuilt);
        ++rewinds;
      } else if (q.num_built > 0 && q.num_built <= q.num_known()) {
        const std::size_t before = q.num_known();
        expect_error([&] { m.rewind(s, unbuilt + 1); }, Errc::kLimitExceeded);
        REQUIRE(m.sequence(s).num_known() == before);
        ++refusals;
      }
    }
    e.check();
  }
  INFO("admits " << admits << " hits " << hits << " forks " << forks << " builds " << builds << " rewinds "
                 << rewinds << " refusals " << refusals);
  CHECK(admits > 20);
  CHECK(hits > 5);  // hits from checkpoints did happen (the state checks above saw them)
  CHECK(forks > 3);
  CHECK(builds > 50);
}

}  // namespace

TEST_CASE("Recurrent groups: invalid configurations are typed errors naming the value", "[recurrent][config]") {
  const auto bad = [](std::vector<KVCacheGroupSpec> g, const char* needle) {
    const std::string msg = expect_error([&] { Manager m(config(64, 4, g)); }, Errc::kInvalidArgument);
    INFO(msg);
    CHECK(msg.find(needle) != std::string::npos);
  };
  bad({{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 0, 1}}, "window_tokens = 0");
  bad({{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 6, 1}}, "multiple of the block size 4");
  bad({{AttentionKind::kRecurrent, 8, 1}, {AttentionKind::kFull, 0, 1}}, "group 0 must be an attention group");
  bad({{AttentionKind::kFull, 0, 1, 1024}, {AttentionKind::kRecurrent, 8, 1}}, "only a recurrent group has a state");
  // Byte accounting: a block holds one state per layer slot when the state is larger than a page.
  CacheConfig c = config(64, 4, {{AttentionKind::kFull, 0, 2}, {AttentionKind::kRecurrent, 8, 6, 5000}});
  c.page_size_bytes = 1000;
  Manager m(c);
  CHECK(m.bytes_per_block() == 5000 * 6);
  CHECK(m.is_recurrent(1));
  CHECK_FALSE(m.is_recurrent(0));
  CHECK_FALSE(m.window_block_bound(1, 16).has_value());
}

TEST_CASE("Recurrent groups: a toy recurrence through hits, fork, partial builds, rewind and preemption",
          "[recurrent][toy]") {
  const std::uint64_t seed = GENERATE(1, 2, 3);
  SECTION("full + recurrent every 8, block size 4, a roomy pool") {
    run_model(config(400, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1}}), seed, 1500);
  }
  SECTION("full + sliding window 6 + two recurrent groups (every 4 and 12), a small pool that evicts") {
    run_model(config(120, 4,
                     {{AttentionKind::kFull, 0, 1},
                      {AttentionKind::kSlidingWindow, 6, 1},
                      {AttentionKind::kRecurrent, 4, 1},
                      {AttentionKind::kRecurrent, 12, 1}}),
              seed, 1500);
  }
  SECTION("full + recurrent every 16 keeping the last checkpoint, and one without") {
    run_model(config(200, 4,
                     {{AttentionKind::kFull, 0, 1},
                      {AttentionKind::kRecurrent, 16, 1, 0, true},
                      {AttentionKind::kRecurrent, 8, 1}}),
              seed, 1500);
  }
}

TEST_CASE("Recurrent groups: a hit resumes from the latest checkpoint inside the shared prefix",
          "[recurrent][prefix]") {
  Engine e(config(200, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1}}), 7);
  Manager& m = e.m;
  const auto a = pagedkv_test::toks(100, 30);
  REQUIRE(m.try_admit(1, a).status == pagedkv::AdmitStatus::kAdmitted);
  e.build({1}, {30});
  e.check();
  // Checkpoints at 8, 16, 24 were written and registered; the full group has blocks 0..6 (28 tokens).
  for (const std::size_t p : {8, 16, 24}) {
    CHECK(m.prefix_index(1).find(m.sequence(1).hashes[p / 4 - 1]).has_value());
  }
  CHECK_FALSE(m.prefix_index(1).find(m.sequence(1).hashes[4]).has_value());  // 20 is not a checkpoint
  // A prompt sharing 22 tokens resumes at 16 (the latest checkpoint at or before the shared blocks).
  auto b = pagedkv_test::toks(100, 22);
  for (int i = 0; i < 9; ++i) b.push_back(7);
  const auto r = m.try_admit(2, b);
  REQUIRE(r.status == pagedkv::AdmitStatus::kAdmitted);
  CHECK(r.num_cached_tokens == 16);
  const auto why = m.explain_admit(b);
  CHECK(why.hit_tokens == 16);
  CHECK(why.cause == pagedkv::MissCause::kLimitedByGroup);  // the full group holds block 4, the checkpoint not
  CHECK(why.limiting_group == 1);
  CHECK(why.first_miss_block == 4);
  e.build({2}, {15});
  e.check();
  // The same prompt again hits 24 now: the second request wrote the checkpoint at 24 of its own tokens.
  CHECK(m.try_admit(3, b).num_cached_tokens == 24);
  e.check();
}

TEST_CASE("Recurrent groups: the last checkpoint makes a conversation's next turn hit its whole previous prompt",
          "[recurrent][prefix]") {
  Engine e(config(200, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 64, 1, 0, true}}), 5);
  Manager& m = e.m;
  auto turn = pagedkv_test::toks(300, 30);
  REQUIRE(m.try_admit(1, turn).status == pagedkv::AdmitStatus::kAdmitted);
  e.build({1}, {30});
  REQUIRE(m.try_append(1, pagedkv_test::toks(900, 9)).status == pagedkv::AppendStatus::kOk);  // the answer
  e.build({1}, {9});
  CHECK(m.sequence(1).other_groups[0].last_pos == 36);  // 39 tokens: the last block boundary is 36
  const auto tokens = m.sequence(1).tokens;
  m.free(1);  // registers the state after 36 tokens
  e.check();
  std::vector<TokenId> next(tokens.begin(), tokens.end());
  for (int i = 0; i < 8; ++i) next.push_back(5);
  const auto r = m.try_admit(2, next);
  CHECK(r.num_cached_tokens == 36);  // without the last checkpoint: 0 (no multiple of 64 inside)
  e.check();
  e.build({2}, {static_cast<std::uint32_t>(next.size() - 36)});
  e.check();
  m.free(2);
  // Without it, the same conversation hits nothing.
  Engine f(config(200, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 64, 1}}), 5);
  REQUIRE(f.m.try_admit(1, tokens).status == pagedkv::AdmitStatus::kAdmitted);
  f.build({1}, {static_cast<std::uint32_t>(tokens.size())});
  f.m.free(1);
  CHECK(f.m.try_admit(2, next).num_cached_tokens == 0);
}

TEST_CASE("Recurrent groups: refused calls are typed errors and change nothing", "[recurrent][strong]") {
  CacheConfig c = config(64, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 8, 1}});
  c.num_host_blocks = 16;
  Engine e(c, 11);
  Manager& m = e.m;
  REQUIRE(m.try_admit(1, pagedkv_test::toks(1, 10)).status == pagedkv::AdmitStatus::kAdmitted);
  e.build({1}, {10});
  e.check();
  const auto snapshot = [&] {
    const auto& q = m.sequence(1);
    const auto t = q.table.blocks();
    return std::tuple(q.num_built, q.num_known(), std::vector<std::uint32_t>(t.begin(), t.end()),
                      q.other_groups[0].state, m.allocator().num_free_blocks(), m.num_sequences());
  };
  const auto before = snapshot();
  expect_error([&] { (void)m.preempt(1, pagedkv::PreemptMode::kSwap); }, Errc::kInvalidArgument);
  expect_error([&] { (void)m.try_reserve_lookahead(1, 2); }, Errc::kInvalidArgument);
  expect_error([&] { m.rewind(1, 1); }, Errc::kLimitExceeded);
  CHECK(snapshot() == before);
  // A build whose recurrent group's buffers lack the state outputs.
  REQUIRE(m.try_append(1, pagedkv_test::toks(50, 1)).status == pagedkv::AppendStatus::kOk);
  std::vector<BatchMetadataBuffers> bufs;
  for (auto& st : e.store) bufs.push_back(st.buffers());
  bufs[1].state_out = {};
  const std::vector<SeqId> batch{1};
  const std::string msg = expect_error([&] { (void)m.build_batch_metadata(batch, bufs); }, Errc::kBadShape);
  CHECK(msg.find("state_out") != std::string::npos);
  CHECK(m.sequence(1).num_built == 10);
  e.build({1}, {1});
  e.check();
  // A pool with one usable block cannot hold a sequence's K/V block and its state: never fits, nothing held.
  Manager tiny(config(2, 4, {{AttentionKind::kFull, 0, 1}, {AttentionKind::kRecurrent, 4, 1}}));
  CHECK(tiny.try_admit(1, pagedkv_test::toks(1, 3)).status == pagedkv::AdmitStatus::kNeverFits);
  CHECK(tiny.num_sequences() == 0);
  CHECK(tiny.allocator().num_free_blocks() == 1);
}
