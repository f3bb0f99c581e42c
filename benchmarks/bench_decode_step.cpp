// bench_decode_step.cpp: one scheduler decode step on the host: append one token to every running sequence
// (KVCacheManager::try_append: slot reservation, a new block every block_size steps, hashing + registering each
// block as it fills) and build the step's batch metadata (CSR page table, padded block table for 8192-token
// sequences, seq_lens, qo_indptr, slot mapping, copy list) into preallocated fixed-capacity buffers.
// Target (docs/contract.md sec. 5, issue): <= 1 us per sequence per step (256 us for batch 256), linear in the batch,
// flat in pool size and in the number of cached blocks.
//
// Sequence lengths are bounded by a reset every kResetSteps (256) steps, outside the timer (one PauseTiming /
// ResumeTiming pair per 256 steps, a negligible overhead): every sequence is freed and re-admitted with its original
// prompt (whose full blocks hit the cache), and forks are re-created. A rewind-based reset would be cheaper but
// unrepresentative: it leaves each sequence's token vector with spare capacity, whereas in a server every decoding
// sequence was admitted (or forked) recently and grows from an exactly sized vector; the reset keeps that state.
// Lengths stay in [initial, initial + 256]. The decode tokens are fresh, so each filled block gets a new hash;
// freed blocks stay cached, so pools fill with cached blocks and later allocations evict, as in a long-running
// server.
//
// Counters: items_per_second = sequences per second; ns_per_item = CPU ns per sequence per step (the console prints
// it with a stray "s" suffix; the number is ns); time per iteration = one step (us).
// Token ids pseudo-random in [1, 128000) (seeded xorshift64, so no block repeats); initial lengths uniform in [1000, 4000]; sequence ids random 64-bit.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <stdexcept>
#include <vector>

#include <benchmark/benchmark.h>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using Id = std::uint32_t;
using pagedkv::SeqId;
using pagedkv::TokenId;

constexpr std::uint64_t kSeed = 0x5eed'dec0'de00'0003ULL;
constexpr std::uint32_t kBlockSize = 16;
constexpr std::size_t kMaxSeqTokens = 8192;
constexpr std::int32_t kMaxBlocksPerSeq = static_cast<std::int32_t>(kMaxSeqTokens / kBlockSize);  // 512
constexpr std::size_t kMinLenTokens = 1000;
constexpr std::size_t kMaxLenTokens = 4000;
constexpr std::size_t kResetSteps = 256;  // steps between resets: lengths stay <= 4000 + 256 tokens
constexpr TokenId kVocab = 128'000;

/// Fixed-capacity host buffers for one batch shape, as an engine would capture a CUDA graph for batch `B`.
struct MetadataBuffers {
  std::vector<std::int32_t> indptr, indices, last_page_len, block_tables, seq_lens, qo_indptr, copies;
  std::vector<std::int64_t> slot_mapping;
  pagedkv::BatchMetadataBuffers view;

  MetadataBuffers(std::size_t batch, std::size_t max_new_tokens, std::size_t max_copies)
      : indptr(batch + 1),                                  // [batch + 1]
        indices(batch * kMaxBlocksPerSeq),                  // [batch * max_blocks_per_seq]
        last_page_len(batch),                               // [batch]
        block_tables(batch * kMaxBlocksPerSeq),             // [batch, max_blocks_per_seq]
        seq_lens(batch),                                    // [batch]
        qo_indptr(batch + 1),                               // [batch + 1]
        copies(2 * max_copies),                             // [max_copies, 2]
        slot_mapping(max_new_tokens) {                      // [max_new_tokens]
    view.indptr = indptr;
    view.indices = indices;
    view.last_page_len = last_page_len;
    view.block_tables = block_tables;
    view.max_blocks_per_seq = kMaxBlocksPerSeq;
    view.seq_lens = seq_lens;
    view.qo_indptr = qo_indptr;
    view.slot_mapping = slot_mapping;
    view.copies = copies;
  }
};

/// A manager running a batch of `groups * width` sequences: `groups` prompts, each forked into `width - 1` more
/// sequences (width 1: no forks), plus `cached_blocks` cached blocks left by earlier requests.
template <class Hasher>
struct DecodeState {
  using Manager = pagedkv::KVCacheManager<Hasher, Id>;

  std::mt19937_64 rng;
  std::size_t width;
  std::vector<SeqId> leaders;                // [groups]
  std::vector<SeqId> ids;                    // [groups * width] the batch, in order; ids[g * width] = leaders[g]
  std::vector<std::vector<TokenId>> prompts; // [groups] each leader's prompt
  std::uint64_t token_state;                 // xorshift64 state of the token stream (never repeats in a run)
  std::unique_ptr<Manager> m;
  MetadataBuffers prefill;                   // buffers for the (untimed) prefill builds

  /// `pool_blocks` 0 = size the pool exactly: the batch's peak (no sharing assumed) + cached_blocks + 2 * batch.
  DecodeState(std::size_t groups, std::size_t width_, std::size_t pool_blocks, std::size_t cached_blocks,
              std::uint64_t seed)
      : rng(seed), width(width_), token_state(seed | 1),
        prefill(groups * width_, groups * kMaxLenTokens, groups * width_) {
    std::uniform_int_distribution<std::size_t> len(kMinLenTokens, kMaxLenTokens);
    std::size_t peak_blocks = 0;
    for (std::size_t g = 0; g < groups; ++g) {
      prompts.push_back(draw(len(rng)));
      peak_blocks += width * ((prompts.back().size() + kResetSteps + kBlockSize - 1) / kBlockSize);
      for (std::size_t j = 0; j < width; ++j) ids.push_back(rng());
      leaders.push_back(ids[g * width]);
    }
    pagedkv::CacheConfig cfg;
    cfg.num_blocks = pool_blocks != 0 ? pool_blocks : 1 + peak_blocks + cached_blocks + 2 * ids.size();
    cfg.block_size = kBlockSize;
    cfg.hash_seed = seed;
    cfg.max_tokens_per_seq = kMaxSeqTokens;
    m = std::make_unique<Manager>(cfg);

    // Earlier requests: prompts of up to 500 full blocks + 1 token (within max_tokens_per_seq), admitted, prefill
    // metadata built (which registers their full blocks) and freed -> cached_blocks cached blocks.
    MetadataBuffers one(1, kMaxSeqTokens, 1);
    for (std::size_t left = cached_blocks, dummy = 1; left > 0; ++dummy) {
      const std::size_t nb = std::min<std::size_t>(left, 500);
      const std::vector<TokenId> prompt = draw(nb * kBlockSize + 1);
      const SeqId id = dummy;
      if (!m->try_admit(id, prompt).admitted()) throw std::runtime_error("cache prefill did not fit");
      m->build_batch_metadata({&id, 1}, one.view);
      m->free(id);
      left -= nb;
    }
    if (m->stats().blocks_cached < cached_blocks) throw std::runtime_error("cache prefill left too few cached blocks");
    admit_all();
  }

  /// The next token of the stream, in [1, kVocab).
  TokenId next_token() noexcept {
    token_state ^= token_state << 13;
    token_state ^= token_state >> 7;
    token_state ^= token_state << 17;
    return static_cast<TokenId>(1 + token_state % static_cast<std::uint64_t>(kVocab - 1));
  }
  std::vector<TokenId> draw(std::size_t n) {
    std::vector<TokenId> t(n);
    for (TokenId& x : t) x = next_token();
    return t;
  }

  /// Admit every leader with its prompt, build the prefill metadata (flushing the prompt slots), then fork each
  /// leader into its group (after the build, as engines do).
  void admit_all() {
    for (std::size_t g = 0; g < leaders.size(); ++g) {
      if (!m->try_admit(leaders[g], prompts[g]).admitted()) throw std::runtime_error("batch admission did not fit");
    }
    m->build_batch_metadata(leaders, prefill.view);
    for (std::size_t g = 0; g < leaders.size(); ++g) {
      for (std::size_t j = 1; j < width; ++j) m->fork(leaders[g], ids[g * width + j]);
    }
  }

  /// Free the whole batch and admit it again (prompts hit the cache): lengths back to the prompts'.
  void reset() {
    for (SeqId id : ids) m->free(id);
    admit_all();
  }

  /// One decode step: one token per sequence, then the metadata build. Returns false if an append failed.
  /// Not inlined, so a profiler (callgrind --toggle-collect) can isolate it.
  [[gnu::noinline]] bool step(const pagedkv::BatchMetadataBuffers& buf) {
    for (SeqId id : ids) {
      const TokenId token = next_token();
      const auto r = m->try_append(id, std::span<const TokenId>(&token, 1));
      if (!r.ok()) return false;
    }
    const pagedkv::BatchMetadataSizes sz = m->build_batch_metadata(ids, buf);
    benchmark::DoNotOptimize(sz);
    benchmark::ClobberMemory();
    return true;
  }
};

void report(benchmark::State& state, std::size_t batch, const pagedkv::CacheStats& before,
            const pagedkv::CacheStats& after) {
  const double iters = static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(batch));
  state.counters["ns_per_item"] = benchmark::Counter(
      static_cast<double>(batch) * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["cached_blocks"] = static_cast<double>(after.blocks_cached);
  state.counters["evictions_per_step"] = static_cast<double>(after.evictions - before.evictions) / iters;
  state.counters["cow_copies_per_step"] = static_cast<double>(after.cow_copies - before.cow_copies) / iters;
}

/// The timed loop: `per_step(s)` (forks, for the churn variant) + one step; a paused reset every kResetSteps.
template <class Hasher, class PerStep>
void run_steps(benchmark::State& state, DecodeState<Hasher>& s, PerStep&& per_step) {
  const std::size_t batch = s.ids.size();
  MetadataBuffers step_buf(batch, /*max_new_tokens=*/batch, /*max_copies=*/batch);
  const pagedkv::CacheStats before = s.m->stats();
  std::size_t steps = 0;
  for (auto _ : state) {
    per_step(s);
    if (!s.step(step_buf.view)) {
      state.SkipWithError("an append found no capacity");
      return;
    }
    if (++steps == kResetSteps) {
      state.PauseTiming();
      s.reset();
      steps = 0;
      state.ResumeTiming();
    }
  }
  report(state, batch, before, s.m->stats());
}

// BM_DecodeStep/<batch>/<pool_blocks>: SHA-256 (the default hasher). The pool beyond the batch is never used at
// the start; allocations take never-used blocks, then (smaller pools) evict blocks that earlier steps cached.
void BM_DecodeStep(benchmark::State& state) {
  DecodeState<pagedkv::Sha256Hasher> s(static_cast<std::size_t>(state.range(0)), 1,
                                       static_cast<std::size_t>(state.range(1)), 0,
                                       kSeed ^ static_cast<std::uint64_t>(state.range(0) * 1'000'003 + state.range(1)));
  run_steps(state, s, [](auto&) {});
  state.SetLabel("item=sequence (append 1 token + metadata build)");
}
BENCHMARK(BM_DecodeStep)
    ->ArgNames({"batch", "pool_blocks"})
    ->Args({64, 1 << 15})
    ->Args({64, 1 << 17})
    ->Args({64, 1 << 20})
    ->Args({256, 1 << 17})
    ->Args({256, 1 << 18})
    ->Args({256, 1 << 20})
    ->Unit(benchmark::kMicrosecond);

// BM_DecodeStepXxh3/<batch>/<pool_blocks>: the same with XXH3-128 block hashes.
void BM_DecodeStepXxh3(benchmark::State& state) {
  DecodeState<pagedkv::Xxh3Hasher> s(static_cast<std::size_t>(state.range(0)), 1,
                                     static_cast<std::size_t>(state.range(1)), 0, kSeed ^ 0x3);
  run_steps(state, s, [](auto&) {});
  state.SetLabel("item=sequence (append 1 token + metadata build)");
}
BENCHMARK(BM_DecodeStepXxh3)->ArgNames({"batch", "pool_blocks"})->Args({256, 1 << 17})->Unit(benchmark::kMicrosecond);

// BM_DecodeStepCached/<batch>/<cached_blocks>: the pool is sized to the batch's peak + cached_blocks + 2 * batch
// blocks of slack and pre-filled with cached_blocks cached blocks (earlier requests' prompts), so once the slack is
// used, new blocks evict the least recently used cached block (dropping its hash from the index).
void BM_DecodeStepCached(benchmark::State& state) {
  DecodeState<pagedkv::Sha256Hasher> s(static_cast<std::size_t>(state.range(0)), 1, 0,
                                       static_cast<std::size_t>(state.range(1)),
                                       kSeed ^ 0xcac4e ^ static_cast<std::uint64_t>(state.range(1)));
  run_steps(state, s, [](auto&) {});
  state.SetLabel("item=sequence (append 1 token + metadata build)");
}
BENCHMARK(BM_DecodeStepCached)
    ->ArgNames({"batch", "cached_blocks"})
    ->Args({256, 0})
    ->Args({256, 10'000})
    ->Args({256, 100'000})
    ->Args({256, 1'000'000})
    ->Unit(benchmark::kMicrosecond);

// BM_DecodeStepFork/<batch>/<forks_per_step>: beam-search-like churn. The batch is groups of 4 sequences (one
// prompt forked 3 times). Before each step, `forks_per_step` groups (round robin) replace one member by a fork of
// another (free + fork, timed), so the fork's shared partial last block is copied by the first sharer to append
// (copy-on-write; the copies appear in the metadata's copy list, counted by cow_copies_per_step). Then the usual
// step: one token per sequence + metadata build. SHA-256.
void BM_DecodeStepFork(benchmark::State& state) {
  constexpr std::size_t kWidth = 4;
  const auto batch = static_cast<std::size_t>(state.range(0));
  const auto forks_per_step = static_cast<std::size_t>(state.range(1));
  const std::size_t groups = batch / kWidth;
  DecodeState<pagedkv::Sha256Hasher> s(groups, kWidth, 1 << 17, 0, kSeed ^ 0xf0f0 ^ forks_per_step);
  std::size_t next_group = 0;
  std::size_t round = 0;
  run_steps(state, s, [&](auto& st) {
    for (std::size_t f = 0; f < forks_per_step; ++f) {
      const std::size_t victim = next_group * kWidth + round % kWidth;
      const std::size_t survivor = next_group * kWidth + (round + 1) % kWidth;
      st.m->free(st.ids[victim]);
      st.m->fork(st.ids[survivor], st.ids[victim]);
      if (++next_group == groups) {
        next_group = 0;
        ++round;
      }
    }
  });
  state.counters["forks_per_step"] = static_cast<double>(forks_per_step);
  state.SetLabel("item=sequence (forks + append 1 token + metadata build)");
}
BENCHMARK(BM_DecodeStepFork)
    ->ArgNames({"batch", "forks_per_step"})
    ->Args({256, 4})
    ->Args({256, 16})
    ->Args({256, 64})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
