// Tests of recurrent groups with their states in their tables (KVCacheGroupSpec::state_in_table; vLLM's Mamba
// mamba_cache_mode 'align', docs/vllm-mamba-align.md; detail/group_state_table.hpp):
//
//  - [config]  bad configurations are typed errors naming the value;
//  - [vllm]    the worked example of docs/vllm-mamba-align.md section 7 (vLLM's own Scheduler and MambaManager,
//              traced): which logical blocks are real after each step, what is registered, the hits 0 / 32;
//  - [toy]     a toy recurrence (an affine scan over the tokens) plays the SSM kernel on a shadow pool: each build's
//              copies run, then per row the state is read from state_in, the step's tokens scanned and the state
//              written to state_out. After every operation the block holding each sequence's state at its built
//              positions holds the scan of those tokens, every registered block holds the scan of the prefix its hash
//              names, refcounts are the tables' entries plus pending copy sources, and every admission's hit is the
//              brute-force maximum (full attention's blocks [0, k), the state group's block k - 1). Random prompts
//              over shared prefixes, unaligned chunks, decode, forks, preemption, a pool small enough to evict;
//              dense and sparse retention (interval 0, with replay boundaries and junctions), prefill checkpoints
//              at alignment 0 / 1 / 2 (24 configurations);
//  - [strong]  refused calls (lookahead and its commit, marks, swap, rewind, a partial build) are typed errors;
//              nothing changes.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include <pagedkv/kv_cache_manager.hpp>

#include "../fuzz/recurrent_model.hpp"
#include "test_support.hpp"

namespace {

using pagedkv::AdmitOptions;
using pagedkv::AdmitStatus;
using pagedkv::AppendStatus;
using pagedkv::AttentionKind;
using pagedkv::BlockHash;
using pagedkv::CacheConfig;
using pagedkv::Errc;
using pagedkv::KVCacheGroupSpec;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_recurrent::Manager;
using pagedkv_recurrent::scan;
using pagedkv_recurrent::scan_step;
using pagedkv_test::expect_error;

KVCacheGroupSpec table_group(std::uint32_t bs) {
  KVCacheGroupSpec s{AttentionKind::kRecurrent, bs, 1};
  s.state_in_table = true;
  return s;
}

CacheConfig config(std::size_t num_blocks, std::uint32_t bs, std::optional<std::size_t> retention = std::nullopt,
                   std::uint32_t checkpoint_align = 0) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.block_size = bs;
  c.enable_prefix_caching = true;
  c.groups = {{AttentionKind::kFull, 0, 1}, table_group(bs)};
  c.groups[1].prefill_checkpoint_alignment = checkpoint_align;
  c.window_retention_interval = retention;
  return c;
}

// The engine: a shadow pool of states, the builds run as a kernel would, the checks of the file's header.
struct Engine {
  explicit Engine(const CacheConfig& c, std::uint64_t seed) : m(c), mem(c.num_blocks, 0), poison(seed) {
    pagedkv::BatchMetadataLimits lim;
    lim.max_batch = 64;
    lim.max_tokens_per_step = 8192;
    lim.max_blocks_per_seq = 1024;
    lim.max_copies = 256;
    for (std::size_t g = 0; g < m.num_groups(); ++g) store.emplace_back(lim);
    for (auto& x : mem) x = pagedkv_recurrent::splitmix(poison);
  }

  Manager m;
  std::vector<pagedkv::BatchMetadataStorage> store;
  std::vector<std::uint64_t> mem;  // [num_blocks] the state a block holds
  std::uint64_t poison;
  std::unordered_map<BlockHash, std::uint64_t, pagedkv::BlockHashHasher> expect;  // chain hash -> its prefix's scan
  std::size_t builds = 0, checkpoints = 0;

  [[nodiscard]] std::size_t col(std::size_t n) const { return (n + m.block_size() - 1) / m.block_size() - 1; }

  // Build `batch` (every pending slot) and run the step: copies, then per row state_in -> scan -> state_out.
  void build(const std::vector<SeqId>& batch) {
    std::vector<pagedkv::BatchMetadataBuffers> bufs;
    for (auto& st : store) bufs.push_back(st.buffers());
    std::vector<std::pair<std::int32_t, std::int32_t>> want;  // per row: the state's block before and after the step
    for (SeqId s : batch) {
      const auto& q = m.sequence(s);
      const auto t = q.table_of(1).blocks();
      want.emplace_back(q.num_built == 0 ? -1 : static_cast<std::int32_t>(t[col(q.num_built)]),
                        static_cast<std::int32_t>(t[col(q.num_slotted())]));
    }
    const auto sizes = m.build_batch_metadata(batch, bufs);
    ++builds;
    const std::size_t g = 1;
    for (std::size_t j = 0; j < sizes[g].num_copies; ++j) {
      mem[static_cast<std::size_t>(store[g].copies[2 * j + 1])] = mem[static_cast<std::size_t>(store[g].copies[2 * j])];
    }
    const pagedkv::BatchMetadataStorage& st = store[g];
    REQUIRE(sizes[g].num_checkpoints == static_cast<std::size_t>(st.checkpoint_indptr[batch.size()]));
    checkpoints += sizes[g].num_checkpoints;
    std::vector<std::pair<std::int32_t, std::uint64_t>> writes;  // a step's reads come before its writes
    for (std::size_t r = 0; r < batch.size(); ++r) {
      const auto tokens = m.token_ids(batch[r]);
      const auto seq_len = static_cast<std::size_t>(st.seq_lens[r]);
      const std::size_t first = seq_len - static_cast<std::size_t>(st.qo_indptr[r + 1] - st.qo_indptr[r]);
      REQUIRE((st.state_in[r] == -1) == (first == 0));
      REQUIRE(st.state_in[r] == want[r].first);
      REQUIRE(st.state_out[r] == want[r].second);
      REQUIRE(st.state_out[r] > 0);
      std::uint64_t s = first == 0 ? 0 : mem[static_cast<std::size_t>(st.state_in[r])];
      std::int32_t c = st.checkpoint_indptr[r];
      for (std::size_t p = first; p < seq_len; ++p) {
        s = scan_step(s, tokens[p], p);
        if (c < st.checkpoint_indptr[r + 1] && static_cast<std::size_t>(st.checkpoint_positions[c]) == p + 1) {
          REQUIRE((p + 1) % m.block_size() == 0);  // a checkpoint at a block boundary inside the step, in its block
          REQUIRE((first == 0 || col(p + 1) > col(first)));
          writes.emplace_back(st.checkpoint_blocks[c], s);
          ++c;
        }
      }
      REQUIRE(c == st.checkpoint_indptr[r + 1]);  // every entry inside the step, in position order
      writes.emplace_back(st.state_out[r], s);
    }
    for (const auto& [b, v] : writes) mem[static_cast<std::size_t>(b)] = v;
    for (SeqId s : batch) {
      const auto& q = m.sequence(s);
      for (std::size_t i = 0; i < q.hashes.size(); ++i) expect[q.hashes[i]] = scan(q.tokens, (i + 1) * m.block_size());
    }
  }

  // The largest k <= cap every group serves: full attention blocks [0, k), the state group block k - 1.
  [[nodiscard]] std::size_t oracle_hit(const std::vector<BlockHash>& hashes, std::size_t cap) const {
    for (std::size_t k = cap; k > 0; --k) {
      bool ok = m.prefix_index(1).find(hashes[k - 1]).has_value();
      for (std::size_t i = 0; i < k && ok; ++i) ok = m.prefix_index(0).find(hashes[i]).has_value();
      if (ok) return k;
    }
    return 0;
  }

  // Which logical blocks of sequence s's state-group table are real (not the null block).
  [[nodiscard]] std::vector<bool> row(SeqId s) const {
    std::vector<bool> real;
    for (auto x : m.sequence(s).table_of(1).blocks()) real.push_back(x != 0);
    return real;
  }

  void check() {
    const std::size_t N = m.config().num_blocks;
    std::vector<std::uint32_t> refs(N, 0);
    std::unordered_map<std::uint32_t, std::uint32_t> filled_by;  // a pending copy's destination -> its source
    for (const auto& c : m.pending_copies()) {
      ++refs[c.src];
      filled_by[c.dst] = c.src;
    }
    const auto content = [&](std::uint32_t b) {
      const auto f = filled_by.find(b);
      return f != filled_by.end() ? mem[f->second] : mem[b];
    };
    m.for_each_sequence([&](SeqId s, std::size_t) {
      const auto& q = m.sequence(s);
      for (std::size_t g = 0; g < m.num_groups(); ++g) {
        for (auto b : q.table_of(g).blocks()) refs[b] += b != 0 ? 1 : 0;
      }
      const std::size_t built = std::min(q.num_built, q.num_known());
      const auto table = q.table_of(1).blocks();
      REQUIRE(table.size() == (q.num_slotted() + m.block_size() - 1) / m.block_size());
      if (built != 0) {
        INFO("sequence " << s << " built " << built);
        const auto b = table[col(built)];
        REQUIRE(b != 0);
        REQUIRE(content(b) == scan(q.tokens, built));
      }
    });
    for (std::size_t b = 1; b < N; ++b) {
      const auto id = static_cast<std::uint32_t>(b);
      INFO("block " << b);
      REQUIRE(m.allocator().refcount(id) == refs[b]);
      if (m.group_of(id) == 1) {
        if (const auto h = m.prefix_index(1).hash_of(id)) {
          const auto it = expect.find(*h);
          REQUIRE(it != expect.end());
          REQUIRE(content(id) == it->second);
        }
      }
      if (refs[b] == 0 && !m.allocator().is_hashed(id)) mem[b] = pagedkv_recurrent::splitmix(poison);
    }
  }
};

// The prompts of docs/vllm-mamba-align.md's traced examples: A (50 tokens), B (A's first 32 + 8 others), C (A's
// first 32 + 20 others).
struct Prompts {
  std::vector<TokenId> a, b, cc;
  Prompts() : a(50), b(40), cc(52) {
    for (std::size_t i = 0; i < 50; ++i) a[i] = static_cast<TokenId>(1000 + i);
    for (std::size_t i = 0; i < 40; ++i) b[i] = i < 32 ? a[i] : static_cast<TokenId>(2000 + i);
    for (std::size_t i = 0; i < 52; ++i) cc[i] = i < 32 ? a[i] : static_cast<TokenId>(3000 + i);
  }
};

}  // namespace

TEST_CASE("State-in-table groups: invalid configurations are typed errors naming the value", "[state_table][config]") {
  const auto bad = [](std::vector<KVCacheGroupSpec> g, const char* needle) {
    CacheConfig c;
    c.num_blocks = 64;
    c.block_size = 4;
    c.groups = std::move(g);
    const std::string msg = expect_error([&] { Manager m(c); }, Errc::kInvalidArgument);
    INFO(msg);
    CHECK(msg.find(needle) != std::string::npos);
  };
  KVCacheGroupSpec full_flagged{AttentionKind::kFull, 0, 1};
  full_flagged.state_in_table = true;
  bad({{AttentionKind::kFull, 0, 1}, full_flagged}, ".state_in_table = true: only a recurrent group has a state");
  KVCacheGroupSpec coarse = table_group(8);
  bad({{AttentionKind::kFull, 0, 1}, coarse}, "window_tokens = 8: must be the block size 4");
  KVCacheGroupSpec with_last = table_group(4);
  with_last.last_checkpoint = true;
  bad({{AttentionKind::kFull, 0, 1}, with_last}, "last_checkpoint = true");
  KVCacheGroupSpec plain{AttentionKind::kRecurrent, 4, 1};
  plain.prefill_checkpoint_alignment = 1;
  bad({{AttentionKind::kFull, 0, 1}, plain}, "prefill_checkpoint_alignment = 1: only with state_in_table");
}

TEST_CASE("State-in-table groups: vLLM's worked example (docs/vllm-mamba-align.md section 7)", "[state_table][vllm]") {
  // Full attention 16 + Mamba 'align' 16, vLLM's release at the next allocation (release_skipped_blocks).
  CacheConfig c = config(40, 16);
  c.release_at_build = false;
  Engine e(c, 7);
  Manager& m = e.m;
  const Prompts p;
  const auto& [a, b, cc] = p;
  const auto row = [&](SeqId s) { return e.row(s); };
  using R = std::vector<bool>;
  // A1: the scheduler cuts the prompt at 48 = floor16(49): one block, at logical block 2, registered @48.
  AdmitOptions o;
  o.num_reserved_tokens = 48;
  REQUIRE(m.try_admit(1, a, nullptr, o).num_cached_tokens == 0);
  CHECK(row(1) == R{false, false, true});
  e.build({1});
  e.check();
  const auto a48 = m.sequence(1).table_of(1).blocks()[2];
  CHECK(m.prefix_index(1).hash_of(a48).has_value());
  // A2: 2 tokens (48 -> 50) take logical block 3; the state at 48 stays until the next allocation reads it.
  REQUIRE(m.try_reserve(1, 2).status == AppendStatus::kOk);
  CHECK(row(1) == R{false, false, true, true});
  e.build({1});
  e.check();
  // A3: decode 50 -> 51. release_skipped_blocks frees block 2 (registered: it stays cached).
  CHECK(m.release_skipped_blocks(1) == 3);
  CHECK(row(1) == R{false, false, false, true});
  REQUIRE(m.try_append(1, std::vector<TokenId>{7}).status == AppendStatus::kOk);
  e.build({1});
  e.check();
  CHECK(m.allocator().refcount(a48) == 0);
  CHECK(m.prefix_index(1).hash_of(a48).has_value());
  m.free(1);
  e.check();
  // B (A's first 32 tokens + 8): full attention holds 32, the state group nothing at 16 or 32: hit 0. The
  // scheduler cuts B at the junction 32, so its state there is registered.
  CHECK(m.lookup(b) == 0);
  o.num_reserved_tokens = 32;
  REQUIRE(m.try_admit(2, b, nullptr, o).num_cached_tokens == 0);
  CHECK(row(2) == R{false, true});
  e.build({2});
  REQUIRE(m.try_reserve(2, 8).status == AppendStatus::kOk);
  CHECK(row(2) == R{false, true, true});
  e.build({2});
  e.check();
  // C (A's first 32 tokens + 20) hits 32 on B's state; its first chunk (to 48) reads it, the next copies on.
  CHECK(m.lookup(cc) == 32);
  o.num_reserved_tokens = 16;
  REQUIRE(m.try_admit(3, cc, nullptr, o).num_cached_tokens == 32);
  CHECK(row(3) == R{false, true, true});
  e.build({3});
  e.check();
  REQUIRE(m.try_reserve(3, 4).status == AppendStatus::kOk);
  CHECK(m.release_skipped_blocks(3) == 1);  // the hit's block (still B's, and cached)
  CHECK(row(3) == R{false, false, true, true});
  e.build({3});
  e.check();
  // A resend of A hits 48 (its state there), not 50: states exist where steps ended on a block boundary.
  CHECK(m.lookup(a) == 48);
}

TEST_CASE("State-in-table groups: prefill checkpoint blocks (docs/vllm-mamba-align.md section 5)",
          "[state_table][vllm]") {
  // Full attention 16 + Mamba 'align' 16 with one prefill checkpoint block (vLLM's Mamba-2 layers: alignment 1).
  CacheConfig c = config(40, 16, std::nullopt, 1);
  c.release_at_build = false;
  Engine e(c, 9);
  Manager& m = e.m;
  const Prompts p;
  const auto& [a, b, cc] = p;
  const auto row = [&](SeqId s) { return e.row(s); };
  using R = std::vector<bool>;
  const auto hashed = [&](SeqId s, std::size_t i) {
    return m.prefix_index(1).hash_of(m.sequence(s).table_of(1).blocks()[i]).has_value();
  };
  // A runs as one 50-token chunk: the state at 48 in logical block 2 (a checkpoint entry), the running state in 3.
  REQUIRE(m.try_admit(1, a).admitted());
  CHECK(row(1) == R{false, false, true, true});
  e.build({1});
  e.check();
  CHECK(e.checkpoints == 1);
  CHECK(hashed(1, 2));
  CHECK_FALSE(hashed(1, 3));
  CHECK(m.lookup(a) == 48);
  m.free(1);
  // B's first chunk (0 -> 32, cut at the junction) keeps 16 (a checkpoint) and 32 (its end); dense retention
  // registers both.
  AdmitOptions o;
  o.num_reserved_tokens = 32;
  REQUIRE(m.try_admit(2, b, nullptr, o).num_cached_tokens == 0);
  CHECK(row(2) == R{true, true});
  e.build({2});
  e.check();
  CHECK((hashed(2, 0) && hashed(2, 1)));
  // C (52 tokens) hits 32 and runs the rest as one 20-token chunk: the hit's block, a checkpoint at 48, the running
  // state at 52.
  REQUIRE(m.try_admit(3, cc).num_cached_tokens == 32);
  CHECK(row(3) == R{false, true, true, true});
  e.build({3});
  e.check();
  CHECK(e.checkpoints == 3);
  // A short step (less than a block past its start) keeps none: a decode step.
  REQUIRE(m.try_append(3, std::vector<TokenId>{5}).status == AppendStatus::kOk);
  e.build({3});
  CHECK(e.checkpoints == 3);
}

TEST_CASE("State-in-table groups: a toy recurrence through hits, unaligned chunks, decode, forks, preemption",
          "[state_table][toy]") {
  // 24 configurations x 800 operations (the ASan/UBSan stage runs them at -O0: about ten times -O1's time).
  const std::uint64_t seed = GENERATE(1, 2);
  const bool small = GENERATE(false, true);
  const bool sparse = GENERATE(false, true);
  const std::uint32_t checkpoint_align = GENERATE(0u, 1u, 2u);
  const std::uint32_t bs = 4;
  CacheConfig c = config(small ? 70 : 600, bs, sparse ? std::optional<std::size_t>(0) : std::nullopt, checkpoint_align);
  c.release_at_build = seed % 2 == 1;
  Engine e(c, seed);
  Manager& m = e.m;
  std::mt19937_64 rng(seed * 7919 + (small ? 1 : 0) + (sparse ? 2 : 0) + 4 * checkpoint_align);
  const auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % std::max<std::size_t>(n, 1)); };
  std::vector<std::vector<TokenId>> bases(5);
  for (auto& b : bases) {
    b.resize(40 + pick(40));
    for (auto& t : b) t = static_cast<TokenId>(pick(50));
  }
  std::map<SeqId, std::vector<TokenId>> prompts;  // each live sequence's whole prompt
  SeqId next = 1;
  std::size_t admits = 0, hits = 0, forks = 0, refusals = 0, preemptions = 0;
  for (std::size_t step = 0; step < 800; ++step) {
    const std::size_t op = pick(100);
    std::vector<SeqId> live;
    m.for_each_sequence([&](SeqId s, std::size_t) { live.push_back(s); });
    if (op < 22 || live.empty()) {  // admit a prompt sharing a prefix
      std::vector<TokenId> p(bases[pick(bases.size())]);
      p.resize(8 + pick(p.size() - 8));
      for (std::size_t k = pick(12); k > 0; --k) p.push_back(static_cast<TokenId>(pick(50)));
      AdmitOptions o;
      o.num_reserved_tokens = pick(2) == 0 ? bs * (1 + pick(p.size() / bs)) : 1 + pick(p.size());  // often aligned
      if (sparse && pick(2) == 0) o.shared_prefix_boundary = pick(p.size());
      const auto prep = m.prepare_prompt(p);
      const std::size_t want = e.oracle_hit(prep.hashes, (p.size() - 1) / bs);
      const auto r = m.try_admit(next, prep, o);
      if (r.status == AdmitStatus::kAdmitted) {
        INFO("admission of " << p.size() << " tokens");
        CHECK(r.num_cached_tokens == want * bs);
        prompts[next++] = p;
        ++admits;
        hits += r.num_cached_tokens != 0 ? 1 : 0;
      } else {
        ++refusals;
      }
    } else if (op < 60) {  // grow each of a few sequences by a prompt chunk or a decode token, then build them
      std::vector<SeqId> batch;
      for (SeqId s : live) {
        if (pick(2) == 0) continue;
        const auto& q = m.sequence(s);
        if (q.num_pending() == 0) {
          const std::size_t unslotted = q.num_unslotted();
          if (unslotted != 0) {
            const std::size_t to_boundary = bs - q.num_slotted() % bs;  // chunks often end on a block boundary
            const std::size_t n = pick(2) == 0 ? std::min(unslotted, to_boundary + bs * pick(4)) : 1 + pick(unslotted);
            if (m.try_reserve(s, n).status != AppendStatus::kOk) continue;
          } else {
            if (m.try_append(s, std::vector<TokenId>{static_cast<TokenId>(pick(50))}).status != AppendStatus::kOk) {
              continue;
            }
          }
        }
        batch.push_back(s);
      }
      if (!batch.empty()) e.build(batch);
    } else if (op < 70) {  // fork a settled sequence
      const SeqId p = live[pick(live.size())];
      const auto& q = m.sequence(p);
      if (q.num_pending() == 0 && q.num_unslotted() == 0 && m.pending_copies().empty()) {
        m.fork(p, next);
        prompts[next++] = prompts[p];
        ++forks;
      }
    } else if (op < 80) {
      const SeqId s = live[pick(live.size())];
      if (m.sequence(s).num_pending() == 0 && m.release_skipped_blocks(s) > 0) {
      }
    } else if (op < 90) {
      const SeqId s = live[pick(live.size())];
      m.preempt(s);
      prompts.erase(s);
      ++preemptions;
    } else {
      const SeqId s = live[pick(live.size())];
      if (m.sequence(s).num_pending() == 0) {
        m.free(s);
        prompts.erase(s);
      }
    }
    e.check();
  }
  INFO("admits " << admits << " hits " << hits << " forks " << forks << " builds " << e.builds << " refusals "
                 << refusals);
  CHECK(admits > 70);
  CHECK(hits > (small && sparse ? 3 : 15));
  CHECK(forks > 5);
  if (small) CHECK(refusals > 0);
  if (checkpoint_align != 0) CHECK(e.checkpoints > 5);  // prefill checkpoints were written (and checked)
}

TEST_CASE("State-in-table groups: refused calls are typed errors and change nothing", "[state_table][strong]") {
  CacheConfig c = config(64, 4);
  c.num_host_blocks = 16;
  Engine e(c, 3);
  Manager& m = e.m;
  std::vector<TokenId> p(10);
  for (std::size_t i = 0; i < p.size(); ++i) p[i] = static_cast<TokenId>(i + 1);
  REQUIRE(m.try_admit(1, p).admitted());
  e.build({1});
  e.check();
  const auto before = m.sequence(1).table_of(1).blocks();
  const std::vector<std::uint32_t> table(before.begin(), before.end());
  const std::size_t free_before = m.allocator().num_available_blocks();
  const auto refused = [&](auto&& call, const char* needle) {
    const std::string msg = expect_error(call, Errc::kInvalidArgument);
    INFO(msg);
    CHECK(msg.find(needle) != std::string::npos);
    CHECK(msg.find("state_in_table") != std::string::npos);
    const auto now = m.sequence(1).table_of(1).blocks();
    CHECK(std::vector<std::uint32_t>(now.begin(), now.end()) == table);
    CHECK(m.allocator().num_available_blocks() == free_before);
  };
  refused([&] { (void)m.try_reserve_lookahead(1, 2); }, "try_reserve_lookahead");
  refused([&] { (void)m.mark_checkpoint(1, 8); }, "mark_checkpoint");
  refused([&] { (void)m.preempt(1, pagedkv::PreemptMode::kSwap); }, "preempt (swap)");
  refused([&] { m.rewind(1, 1); }, "rewind");
  refused([&] { m.rewind(1, 0); }, "rewind");  // even a rewind of nothing (it would null the running state)
  refused([&] { m.commit_lookahead(1, std::vector<TokenId>{}); }, "commit_lookahead");
  // A build must compute a growth whole (its state goes to the block where the growth ends).
  REQUIRE(m.try_append(1, std::vector<TokenId>{5, 6, 7}).status == AppendStatus::kOk);
  std::vector<pagedkv::BatchMetadataBuffers> bufs;
  for (auto& st : e.store) bufs.push_back(st.buffers());
  const std::vector<SeqId> batch{1};
  const std::vector<std::uint32_t> two{2};
  const std::string msg = expect_error([&] { (void)m.build_batch_metadata(batch, bufs, two); }, Errc::kInvalidArgument);
  CHECK(msg.find("builds each growth whole") != std::string::npos);
  e.build({1});
  e.check();
}
