// bench_groups.cpp: the one-manager checks of issue 17 (KVCacheManager runs KV-cache groups; an empty group list is
// one full-attention group with the plain pool's fast paths):
//   - admission + prefill build of the Azure LLM inference traces (data/traces/azure-llm-2023, Patel et al.,
//     "Splitwise", ISCA '24) through one full-attention group and through a hybrid model's groups
//     (full:12,swa4096:24 = one full group and two sliding-window groups of 12 layers, as pagedkv-replay
//     --model-layers splits it): CPU ns per prompt block and per pool block, target mixed <= 1.3x one group;
//     config 2 is a coarse-page pair (full:12 at 16 tokens + full:12 with 64-token pages, DeepSeek-V4's shape;
//     issue 20 sec. 2), the same counters;
//   - heap allocations per admission, per kNoCapacity admission retried, per build and per append after warm-up
//     (a counting global operator new): target 0 for the allocation-free calls.
//
// Counters (all per operation, after warm-up):
//   ns_per_prompt_block  CPU ns of admission + build per token block of the prompt (ceil(prompt_len / 16))
//   ns_per_pool_block    CPU ns of admission + build per pool block the admission took (over all groups)
//   allocs_per_admit, allocs_per_build, allocs_per_free, allocs_per_retry, allocs_per_append: operator new calls
//   index_bytes_per_pool_block (BM_AzureAdmitBuild, groups builds only): every group's prefix index, bytes per block
//
// This file also compiles against the manager before issue 17 (no CacheConfig::groups): then only the one-group
// benchmarks exist, so old and new builds can be compared on them.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <new>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>

#if __has_include(<pagedkv/group_policy.hpp>)
#define PAGEDKV_BENCH_GROUPS 1
#else
#define PAGEDKV_BENCH_GROUPS 0
#endif

#ifndef PAGEDKV_BENCH_TRACE_DIR
#define PAGEDKV_BENCH_TRACE_DIR "data/traces/azure-llm-2023"
#endif

// ---------------------------------------------------------------------------------------------------------------
// Counting allocator: every operator new form counts one call (single-threaded benchmark, relaxed is enough).
namespace {
std::uint64_t g_allocs = 0;
void* counted_alloc(std::size_t n) {
  ++g_allocs;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* counted_aligned_alloc(std::size_t n, std::align_val_t al) {
  ++g_allocs;
  const std::size_t a = static_cast<std::size_t>(al);
  if (void* p = std::aligned_alloc(a, (std::max<std::size_t>(n, 1) + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
}  // namespace

void* operator new(std::size_t n) { return counted_alloc(n); }
void* operator new[](std::size_t n) { return counted_alloc(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  ++g_allocs;
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  ++g_allocs;
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new(std::size_t n, std::align_val_t a) { return counted_aligned_alloc(n, a); }
void* operator new[](std::size_t n, std::align_val_t a) { return counted_aligned_alloc(n, a); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }

namespace {

using Id = std::uint32_t;
using pagedkv::SeqId;
using pagedkv::TokenId;

constexpr std::uint32_t kBlockSize = 16;
constexpr TokenId kVocab = 128'000;
constexpr double kCapacityTokens = 1e6;  // per group, as pagedkv-replay --capacity-tokens 1e6
constexpr std::size_t kPoolTokens = std::size_t{1} << 20;  // the random token pool prompts are cut from

enum Config : int { kOneGroup = 0, kMixed = 1, kCoarse = 2 };
enum TraceName : int { kCode = 0, kConv = 1 };

const char* config_name(int c) {
  return c == kOneGroup ? "one group (groups empty)"
         : c == kMixed  ? "full:12,swa4096:24 (3 groups)"
                        : "full:12 + full:12 with 64-token pages (2 groups)";
}
/// Groups of a config.
std::size_t num_groups_of(int c) { return c == kOneGroup ? 1 : c == kMixed ? 3 : 2; }

/// ContextTokens of every request of an Azure trace (CSV: TIMESTAMP,ContextTokens,GeneratedTokens).
std::vector<std::uint32_t> load_azure(int trace) {
  const std::string path = std::string(PAGEDKV_BENCH_TRACE_DIR) +
                           (trace == kCode ? "/AzureLLMInferenceTrace_code.csv" : "/AzureLLMInferenceTrace_conv.csv");
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::string line;
  std::getline(in, line);  // header
  std::vector<std::uint32_t> lens;
  while (std::getline(in, line)) {
    const std::size_t a = line.find(',');
    if (a == std::string::npos) continue;
    lens.push_back(static_cast<std::uint32_t>(std::stoul(line.substr(a + 1))));
  }
  if (lens.empty()) throw std::runtime_error(path + ": no requests");
  return lens;
}

/// The manager's config: one full group of `capacity` tokens, or the hybrid's three groups of `capacity` tokens
/// each plus the null block (pagedkv-replay's hybrid make_config).
pagedkv::CacheConfig make_config(int config, std::size_t blocks_per_group, std::size_t max_len) {
  pagedkv::CacheConfig c;
  c.block_size = kBlockSize;
  c.max_tokens_per_seq = max_len;
  c.num_blocks = blocks_per_group;
#if PAGEDKV_BENCH_GROUPS
  if (config == kMixed) {
    pagedkv::KVCacheGroupSpec full, swa;
    full.kind = pagedkv::AttentionKind::kFull;
    full.num_layers = 12;
    swa.kind = pagedkv::AttentionKind::kSlidingWindow;
    swa.window_tokens = 4096;
    swa.num_layers = 12;
    c.groups = {full, swa, swa};
    c.num_blocks = blocks_per_group * 3 + 1;
  }
  if (config == kCoarse) {  // a compressed group whose pages hold 4 match blocks (docs/groups.md "Coarse pages")
    pagedkv::KVCacheGroupSpec full, coarse;
    full.num_layers = 12;
    coarse.num_layers = 12;
    coarse.block_size = 4 * kBlockSize;
    c.groups = {full, coarse};
    c.num_blocks = blocks_per_group + blocks_per_group / 4 + 1;
  }
#else
  if (config != kOneGroup) throw std::logic_error("no KV-cache groups in this build");
#endif
  return c;
}

/// Per-group host buffers for a prefill build of one sequence of up to `max_len` tokens (CSR page table + slots).
struct Buffers {
  std::size_t groups;
  std::vector<std::int32_t> indptr, indices, last_page_len, seq_lens, qo_indptr, copies;
  std::vector<std::int64_t> slots;
  std::vector<pagedkv::BatchMetadataBuffers> views;
  std::vector<pagedkv::BatchMetadataSizes> sizes;
  std::size_t max_blocks, max_tokens, max_batch;
  Buffers(std::size_t g, std::size_t batch, std::size_t tokens_per_seq, std::size_t new_tokens)
      : groups(g),
        indptr(g * (batch + 1)),
        indices(g * batch * ((tokens_per_seq + kBlockSize - 1) / kBlockSize)),
        last_page_len(g * batch),
        seq_lens(g * batch),
        qo_indptr(g * (batch + 1)),
        copies(g * 2 * batch),
        slots(g * new_tokens),
        views(g),
        sizes(g),
        max_blocks(batch * ((tokens_per_seq + kBlockSize - 1) / kBlockSize)),
        max_tokens(new_tokens),
        max_batch(batch) {
    for (std::size_t i = 0; i < g; ++i) {
      pagedkv::BatchMetadataBuffers& v = views[i];
      v.indptr = std::span(indptr).subspan(i * (batch + 1), batch + 1);
      v.indices = std::span(indices).subspan(i * max_blocks, max_blocks);
      v.last_page_len = std::span(last_page_len).subspan(i * batch, batch);
      v.seq_lens = std::span(seq_lens).subspan(i * batch, batch);
      v.qo_indptr = std::span(qo_indptr).subspan(i * (batch + 1), batch + 1);
      v.copies = std::span(copies).subspan(i * 2 * batch, 2 * batch);
      v.slot_mapping = std::span(slots).subspan(i * new_tokens, new_tokens);
    }
  }
};

/// Build the metadata of `batch` (every group; the non-allocating overload with several groups).
template <class Manager>
void build(Manager& m, std::span<const SeqId> batch, Buffers& b) {
  if (b.groups == 1) {
    b.sizes[0] = m.build_batch_metadata(batch, b.views[0]);
  } else {
#if PAGEDKV_BENCH_GROUPS
    m.build_batch_metadata(batch, std::span<const pagedkv::BatchMetadataBuffers>(b.views), {},
                           std::span<pagedkv::BatchMetadataSizes>(b.sizes));
#endif
  }
  benchmark::DoNotOptimize(b.sizes.data());
}

/// Random tokens in [1, kVocab) that prompts are cut from (a window at a per-request offset; the first token is
/// unique per admission, so through the hash chain no prompt block ever hits: the Azure traces carry no prefix
/// information, and pagedkv-replay synthesizes unique prompts for them too).
std::vector<TokenId> token_pool(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<TokenId> dist(1, kVocab - 1);
  std::vector<TokenId> t(kPoolTokens);
  for (TokenId& x : t) x = dist(rng);
  return t;
}

// ---------------------------------------------------------------------------------------------------------------
// BM_AzureAdmitBuild<Hasher>/<config>/<trace>: the trace's prompts in file order, cycling, each admitted and its
// prefill metadata built (batch of one, as pagedkv-replay's prefix modes do); timed: admission + build of 16
// requests, then (paused) their free and the cutting of the next 16 prompts. Pool: 1e6 tokens per group, so it fills with cached blocks and every later
// admission evicts (LRU). Warm-up: one whole pass over the trace before the timed loop (the pool is full and every
// scratch vector has seen the longest prompt).
template <class Hasher>
void BM_AzureAdmitBuild(benchmark::State& state) {
  const int config = static_cast<int>(state.range(0));
  const int trace = static_cast<int>(state.range(1));
  const std::vector<std::uint32_t> lens = load_azure(trace);
  const std::size_t max_len = *std::max_element(lens.begin(), lens.end());
  const std::size_t blocks_per_group = static_cast<std::size_t>(kCapacityTokens / kBlockSize);
  pagedkv::KVCacheManager<Hasher, Id> m(make_config(config, blocks_per_group, max_len));
  const std::size_t G = num_groups_of(config);
  const std::vector<TokenId> pool = token_pool(0x5eed'a2c0'0000'0017ULL);
  Buffers buf(G, 1, max_len, max_len);
  constexpr std::size_t kChunk = 16;
  std::vector<std::vector<TokenId>> prompts(kChunk);  // the next kChunk prompts, cut before the timed part
  for (auto& p : prompts) p.reserve(max_len);
  std::vector<SeqId> live;
  live.reserve(kChunk);
  std::size_t next = 0;
  SeqId next_seq = 1;
  std::uint32_t unique = 1;
  std::uint64_t prompt_blocks = 0, pool_blocks = 0, admits = 0;
  std::uint64_t allocs_admit = 0, allocs_build = 0, allocs_free = 0;
  bool counting = false;
  // Cut the next kChunk requests' prompts (outside the timed part): a window of the token pool at a per-request
  // offset, its first token unique.
  const auto cut = [&] {
    for (std::vector<TokenId>& prompt : prompts) {
      const std::size_t len = lens[next];
      const std::size_t off = (next * 0x9e3779b97f4a7c15ULL >> 20) % (kPoolTokens - len);
      prompt.assign(pool.begin() + static_cast<std::ptrdiff_t>(off),
                    pool.begin() + static_cast<std::ptrdiff_t>(off + len));
      prompt[0] = unique++;
      if (++next == lens.size()) next = 0;
    }
  };
  // Admit prompts[i] and build its prefill metadata.
  const auto one = [&](std::size_t i) -> bool {
    const std::vector<TokenId>& prompt = prompts[i];
    const std::size_t len = prompt.size();
    const SeqId id = next_seq++;
    const std::uint64_t a0 = g_allocs;
    const pagedkv::AdmitResult r = m.try_admit(id, prompt);
    const std::uint64_t a1 = g_allocs;
    if (!r.admitted()) return false;
    build(m, std::span<const SeqId>(&id, 1), buf);
    const std::uint64_t a2 = g_allocs;
    live.push_back(id);
    if (counting) {
      allocs_admit += a1 - a0;
      allocs_build += a2 - a1;
      prompt_blocks += (len + kBlockSize - 1) / kBlockSize;
      pool_blocks += r.num_new_blocks;
      ++admits;
    }
    return true;
  };
  const auto free_live = [&] {
    const std::uint64_t a0 = g_allocs;
    for (SeqId id : live) m.free(id);
    live.clear();
    if (counting) allocs_free += g_allocs - a0;
  };
  for (std::size_t done = 0; done < lens.size(); done += kChunk) {  // warm-up: one pass over the trace
    cut();
    for (std::size_t i = 0; i < kChunk; ++i) {
      if (!one(i)) {
        state.SkipWithError("warm-up admission failed");
        return;
      }
    }
    free_live();
  }
  cut();
  counting = true;
  const std::uint64_t evictions_before = m.stats().evictions;
  for (auto _ : state) {
    for (std::size_t i = 0; i < kChunk; ++i) {
      if (!one(i)) {
        state.SkipWithError("admission failed");
        return;
      }
    }
    state.PauseTiming();
    free_live();
    cut();
    state.ResumeTiming();
  }
  const double n = static_cast<double>(std::max<std::uint64_t>(admits, 1));
  state.counters["ns_per_prompt_block"] = benchmark::Counter(
      static_cast<double>(prompt_blocks) * 1e-9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["ns_per_pool_block"] = benchmark::Counter(
      static_cast<double>(pool_blocks) * 1e-9, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.counters["pool_blocks_per_prompt_block"] =
      static_cast<double>(pool_blocks) / static_cast<double>(std::max<std::uint64_t>(prompt_blocks, 1));
  state.counters["allocs_per_admit"] = static_cast<double>(allocs_admit) / n;
  state.counters["allocs_per_build"] = static_cast<double>(allocs_build) / n;
  state.counters["allocs_per_free"] = static_cast<double>(allocs_free) / n;
  state.counters["evictions_per_request"] = static_cast<double>(m.stats().evictions - evictions_before) / n;
#if PAGEDKV_BENCH_GROUPS
  // Host bytes of the prefix index (one, shared by the groups) per pool block.
  state.counters["index_bytes_per_pool_block"] =
      static_cast<double>(m.prefix_index().memory_bytes()) / static_cast<double>(m.allocator().num_blocks());
#endif
  state.SetItemsProcessed(static_cast<std::int64_t>(admits));
  state.SetLabel(std::string(config_name(config)) + (trace == kCode ? ", Azure code" : ", Azure conv") +
                 "; item=request (admit + prefill build)");
}

// ---------------------------------------------------------------------------------------------------------------
// BM_AdmitRetry<Hasher>/<config>/<prepared>: an admission refused with kNoCapacity and retried, as a scheduler does
// every step while the pool is full: the pool (4096 blocks per group) is held by running sequences (admitted and
// built, never freed), one of which holds the first half of the waiting 2048-token prompt (a shared prefix: the
// retry hits 64 blocks and lacks blocks for the other 64). Each iteration retries it with try_admit(span) or
// (prepared = 1) try_admit(PreparedPrompt), which hashes nothing. Counters: allocs_per_retry.
template <class Hasher>
void BM_AdmitRetry(benchmark::State& state) {
  const int config = static_cast<int>(state.range(0));
  const bool prepared = state.range(1) != 0;
  constexpr std::size_t kPromptTokens = 2048;
  pagedkv::KVCacheManager<Hasher, Id> m(make_config(config, 4096, 8192));
  const std::size_t G = num_groups_of(config);
  const std::vector<TokenId> pool = token_pool(0x5eed'0000'0e71'0017ULL);
  Buffers buf(G, 1, 8192, 8192);
  // The waiting prompt: its first half is held by a running sequence (admitted, built).
  std::vector<TokenId> prompt(pool.begin(), pool.begin() + kPromptTokens);
  SeqId seq = 1;
  {
    const std::span<const TokenId> head(prompt.data(), kPromptTokens / 2 + 1);
    if (!m.try_admit(seq, head).admitted()) {
      state.SkipWithError("setup admission failed");
      return;
    }
    build(m, std::span<const SeqId>(&seq, 1), buf);
    ++seq;
  }
  // Running sequences take every other block: 1024-token prompts of fresh tokens, then 16-token ones.
  for (const std::size_t n : {std::size_t{1024}, std::size_t{16}}) {
    for (std::size_t off = kPromptTokens;; off += n) {
      const std::size_t at = off % (kPoolTokens - n);
      std::vector<TokenId> p(pool.begin() + static_cast<std::ptrdiff_t>(at),
                             pool.begin() + static_cast<std::ptrdiff_t>(at + n));
      p[0] = static_cast<TokenId>(seq);
      if (!m.try_admit(seq, p).admitted()) break;
      build(m, std::span<const SeqId>(&seq, 1), buf);
      ++seq;
    }
  }
  const pagedkv::PreparedPrompt pp = m.prepare_prompt(prompt);
  const SeqId waiting = seq;
  const auto retry = [&] { return prepared ? m.try_admit(waiting, pp) : m.try_admit(waiting, prompt); };
  for (int i = 0; i < 16; ++i) {
    if (retry().status != pagedkv::AdmitStatus::kNoCapacity) {
      state.SkipWithError("the retried admission is not kNoCapacity");
      return;
    }
  }
  const std::uint64_t a0 = g_allocs;
  for (auto _ : state) {
    const pagedkv::AdmitResult r = retry();
    benchmark::DoNotOptimize(r);
  }
  const double iters = static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
  state.counters["allocs_per_retry"] = static_cast<double>(g_allocs - a0) / iters;
  state.SetLabel(std::string(config_name(config)) + (prepared ? ", PreparedPrompt" : ", span") +
                 "; item=kNoCapacity retry of a 2048-token prompt");
}

// ---------------------------------------------------------------------------------------------------------------
// BM_DecodeBuild<Hasher>/<config>: decode steps of 64 sequences (prompts 1000-4000 tokens): try_append of one token
// each, then the step's build (one group: the BatchMetadataBuffers overload; several: the sizes_out overload).
// Every 256 steps (paused) the batch is freed and re-admitted. Counters: allocs_per_build (the build call),
// allocs_per_append (try_append calls, per sequence), ns per sequence per step (CPU), and the wall-clock split of
// a step into its appends and its build (append_wall_ns_per_seq, build_wall_ns_per_seq).
template <class Hasher>
void BM_DecodeBuild(benchmark::State& state) {
  const int config = static_cast<int>(state.range(0));
  constexpr std::size_t kBatch = 64, kReset = 256;
  std::mt19937_64 rng(0x5eed'dec0'0000'0017ULL);
  std::uniform_int_distribution<std::size_t> len(1000, 4000);
  std::vector<std::vector<TokenId>> prompts;
  std::vector<SeqId> ids;
  std::size_t peak = 0;
  const std::vector<TokenId> pool = token_pool(0x5eed'dec1'0000'0017ULL);
  for (std::size_t i = 0; i < kBatch; ++i) {
    const std::size_t n = len(rng), off = rng() % (kPoolTokens - n);
    prompts.emplace_back(pool.begin() + static_cast<std::ptrdiff_t>(off),
                         pool.begin() + static_cast<std::ptrdiff_t>(off + n));
    ids.push_back(rng());
    peak += (n + kReset + kBlockSize - 1) / kBlockSize;
  }
  pagedkv::KVCacheManager<Hasher, Id> m(make_config(config, peak + 4 * kBatch, 8192));
  const std::size_t G = num_groups_of(config);
  Buffers prefill(G, kBatch, 8192, kBatch * 4000);
  Buffers step(G, kBatch, 8192, kBatch);
  std::uint64_t token_state = 0x9e3779b97f4a7c15ULL;
  const auto next_token = [&] {
    token_state ^= token_state << 13;
    token_state ^= token_state >> 7;
    token_state ^= token_state << 17;
    return static_cast<TokenId>(1 + token_state % static_cast<std::uint64_t>(kVocab - 1));
  };
  const auto admit_all = [&] {
    for (std::size_t i = 0; i < kBatch; ++i) {
      if (!m.try_admit(ids[i], prompts[i]).admitted()) throw std::runtime_error("batch admission did not fit");
    }
    build(m, ids, prefill);
  };
  admit_all();
  std::uint64_t allocs_build = 0, allocs_append = 0, steps = 0, counted = 0;
  std::chrono::steady_clock::duration append_time{}, build_time{};
  const auto one_step = [&](bool count) -> bool {
    const std::uint64_t a0 = g_allocs;
    const auto t0 = std::chrono::steady_clock::now();
    for (SeqId id : ids) {
      const TokenId t = next_token();
      if (!m.try_append(id, std::span<const TokenId>(&t, 1)).ok()) return false;
    }
    const std::uint64_t a1 = g_allocs;
    const auto t1 = std::chrono::steady_clock::now();
    build(m, ids, step);
    const auto t2 = std::chrono::steady_clock::now();
    if (count) {
      allocs_append += a1 - a0;
      allocs_build += g_allocs - a1;
      append_time += t1 - t0;
      build_time += t2 - t1;
      ++counted;
    }
    return true;
  };
  const auto reset = [&] {
    for (SeqId id : ids) m.free(id);
    admit_all();
    steps = 0;
  };
  for (std::size_t i = 0; i < 2 * kReset; ++i) {  // warm-up: two reset cycles
    if (!one_step(false)) {
      state.SkipWithError("warm-up append found no capacity");
      return;
    }
    if (++steps == kReset) reset();
  }
  for (auto _ : state) {
    if (!one_step(true)) {
      state.SkipWithError("an append found no capacity");
      return;
    }
    if (++steps == kReset) {
      state.PauseTiming();
      reset();
      state.ResumeTiming();
    }
  }
  const double n = static_cast<double>(std::max<std::uint64_t>(counted, 1));
  state.counters["allocs_per_build"] = static_cast<double>(allocs_build) / n;
  state.counters["allocs_per_append"] = static_cast<double>(allocs_append) / (n * kBatch);
  // The step's two halves, wall-clock (steady_clock) ns per sequence: which half a difference between builds is in.
  state.counters["append_wall_ns_per_seq"] =
      static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(append_time).count()) / (n * kBatch);
  state.counters["build_wall_ns_per_seq"] =
      static_cast<double>(std::chrono::duration_cast<std::chrono::nanoseconds>(build_time).count()) / (n * kBatch);
  state.counters["ns_per_item"] = benchmark::Counter(
      static_cast<double>(kBatch) * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kBatch));
  state.SetLabel(std::string(config_name(config)) + "; item=sequence (append 1 token + step build)");
}

#if PAGEDKV_BENCH_GROUPS
#define PAGEDKV_BENCH_CONFIGS {kOneGroup, kMixed, kCoarse}
#else
#define PAGEDKV_BENCH_CONFIGS {kOneGroup}
#endif

void azure_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"config", "trace"});
  for (int c : PAGEDKV_BENCH_CONFIGS) {
    for (int t : {kCode, kConv}) b->Args({c, t});
  }
  b->Unit(benchmark::kMicrosecond);
}
void retry_args(benchmark::internal::Benchmark* b) {
  b->ArgNames({"config", "prepared"});
  for (int c : PAGEDKV_BENCH_CONFIGS) {
    for (int p : {0, 1}) b->Args({c, p});
  }
}
void decode_args(benchmark::internal::Benchmark* b) {
  b->ArgName("config");
  for (int c : PAGEDKV_BENCH_CONFIGS) b->Arg(c);
  b->Unit(benchmark::kMicrosecond);
}

BENCHMARK_TEMPLATE(BM_AzureAdmitBuild, pagedkv::Sha256Hasher)->Apply(azure_args);
BENCHMARK_TEMPLATE(BM_AzureAdmitBuild, pagedkv::Xxh3Hasher)->Apply(azure_args);
BENCHMARK_TEMPLATE(BM_AdmitRetry, pagedkv::Sha256Hasher)->Apply(retry_args);
BENCHMARK_TEMPLATE(BM_DecodeBuild, pagedkv::Sha256Hasher)->Apply(decode_args);

}  // namespace
