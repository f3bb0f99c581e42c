// bench_prefix_cache.cpp: the prefix-cache hit path. Block hashing (canonical encoding + SHA-256 or XXH3-128), hash
// + index find of one full block against index size, KVCacheManager::lookup of a whole cached prompt, and the
// prefix-mode replay's unit of work (admit a half-cached prompt, then free it).
// Issue targets: a cache hit (hash + lookup) of one 16-token block <= 150 ns with SHA-256, <= 30 ns with XXH3,
// flat in the number of registered blocks (1e3 .. 1e6).
//
// Counters: items_per_second (blocks, hits or requests: the label names the item), ns_per_item (CPU ns per item;
// the console prints it with a stray "s" suffix, the number is ns), bytes_per_second for hashing (bytes actually
// hashed: the canonical block encoding, docs/design.md "Block hashes").
// Token ids are random in [1, 128000) with fixed seeds (never all zero).
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include <benchmark/benchmark.h>

#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/prefix_hash_index.hpp>

namespace {

using Id = std::uint32_t;
using pagedkv::BlockHash;
using pagedkv::Sha256Hasher;
using pagedkv::TokenId;
using pagedkv::Xxh3Hasher;

constexpr std::uint64_t kSeed = 0x5eed'cac0'0000'0002ULL;
constexpr std::uint64_t kHashSeed = 42;  // the pool's chain seed
constexpr std::uint32_t kBlockSize = 16;
constexpr TokenId kVocab = 128'000;

void report_per_item(benchmark::State& state, double items_per_iter, const char* item) {
  state.SetItemsProcessed(static_cast<std::int64_t>(static_cast<double>(state.iterations()) * items_per_iter));
  state.counters["ns_per_item"] = benchmark::Counter(
      items_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(item);
}

std::vector<TokenId> random_tokens(std::size_t n, std::mt19937_64& rng) {
  std::uniform_int_distribution<TokenId> dist(1, kVocab - 1);
  std::vector<TokenId> t(n);
  for (TokenId& x : t) x = dist(rng);
  return t;
}

BlockHash random_hash(std::mt19937_64& rng) {
  BlockHash h;
  for (auto& byte : h.bytes) byte = static_cast<std::uint8_t>(rng());
  return h;
}

/// Host buffers for the prefill step of one sequence, CSR page table only (as pagedkv-replay's prefix mode builds
/// it): `indices` and `slot_mapping` are cut to the step's live extents. Building this metadata is what registers a
/// prompt's full blocks in the prefix index (the library registers a block when the metadata that writes it is
/// built), so every admission below is followed by a build before its sequence is freed.
struct PrefillBuffers {
  std::vector<std::int32_t> indptr, indices, last_page_len, seq_lens, qo_indptr, copies;
  std::vector<std::int64_t> slot_mapping;
  explicit PrefillBuffers(std::size_t max_prompt_tokens)
      : indptr(2),                                                 // [batch + 1], batch 1
        indices((max_prompt_tokens + kBlockSize - 1) / kBlockSize),  // [prompt blocks]
        last_page_len(1),                                          // [batch]
        seq_lens(1),                                               // [batch]
        qo_indptr(2),                                              // [batch + 1]
        copies(2),                                                 // [1, 2]
        slot_mapping(max_prompt_tokens) {}                         // [uncached prompt tokens]
  /// Views for a prompt of `prompt_tokens` tokens of which `cached_tokens` hit the cache.
  pagedkv::BatchMetadataBuffers view(std::size_t prompt_tokens, std::size_t cached_tokens) {
    pagedkv::BatchMetadataBuffers v;
    v.indptr = indptr;
    v.indices = std::span<std::int32_t>(indices).first((prompt_tokens + kBlockSize - 1) / kBlockSize);
    v.last_page_len = last_page_len;
    v.seq_lens = seq_lens;
    v.qo_indptr = qo_indptr;
    v.slot_mapping = std::span<std::int64_t>(slot_mapping).first(prompt_tokens - cached_tokens);
    v.copies = copies;
    return v;
  }
};

/// Bytes of the canonical encoding of one block without extra keys (prefix_hash_index.hpp encode_block):
/// parent[16] | u32 n | i32 tokens[n] | u64 adapter | u32 num_items | u32 salt_len.
constexpr std::size_t encoded_bytes(std::size_t block_tokens) { return 16 + 4 + 4 * block_tokens + 8 + 4 + 4; }

// ---------------------------------------------------------------------------------------------------------------
// BM_HashBlock<Hasher>/<block_size>: PrefixHashIndex::hash_block of one full block (encode + hash), chained: each
// block's parent is the previous result, as when a prompt is hashed. Blocks cycle through 256 random token blocks.
template <class Hasher>
void BM_HashBlock(benchmark::State& state) {
  const auto block_size = static_cast<std::size_t>(state.range(0));
  constexpr std::size_t kBlocks = 256;
  std::mt19937_64 rng(kSeed ^ block_size);
  const std::vector<TokenId> tokens = random_tokens(kBlocks * block_size, rng);
  const pagedkv::PrefixHashIndex<Hasher, Id> index(2, kHashSeed);
  BlockHash parent = index.root();
  std::size_t k = 0;
  for (auto _ : state) {
    parent = index.hash_block(parent, std::span<const TokenId>(tokens).subspan(k * block_size, block_size),
                              (k + 1) * block_size, nullptr);
    k = (k + 1) % kBlocks;
  }
  benchmark::DoNotOptimize(parent);
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(encoded_bytes(block_size)));
  report_per_item(state, 1.0, "item=block");
}
BENCHMARK_TEMPLATE(BM_HashBlock, Sha256Hasher)->ArgName("block_size")->Arg(16)->Arg(32)->Arg(64)->Arg(128);
BENCHMARK_TEMPLATE(BM_HashBlock, Xxh3Hasher)->ArgName("block_size")->Arg(16)->Arg(32)->Arg(64)->Arg(128);

// BM_CacheHit<Hasher>/<registered_blocks>/<queried_blocks>: one prefix-cache hit of a 16-token block =
// hash_block (encode + hash) + PrefixHashIndex::find, with `registered_blocks` blocks registered. The queried
// blocks are min(registered, queried_blocks) real blocks (random tokens, random parent hashes, random positions);
// the other registered entries are random hashes. All are inserted in a random order, so the queried entries are
// spread through the map's memory; queries visit them in a random order. Every query must hit.
// queried_blocks 256: a hot set of shared prefixes (stays in cache: measures the algorithm's flatness);
// 16384: a working set of ~3 MB of map memory (bucket + nodes), beyond L2: measures the memory hierarchy too.
template <class Hasher>
void BM_CacheHit(benchmark::State& state) {
  const auto registered = static_cast<std::size_t>(state.range(0));
  const std::size_t num_queries = std::min<std::size_t>(registered, static_cast<std::size_t>(state.range(1)));
  std::mt19937_64 rng(kSeed ^ registered);
  pagedkv::PrefixHashIndex<Hasher, Id> index(registered + 1, kHashSeed);

  struct Query {
    BlockHash parent;
    std::uint64_t block_start;
  };
  std::vector<Query> queries(num_queries);
  const std::vector<TokenId> tokens = random_tokens(num_queries * kBlockSize, rng);
  std::vector<BlockHash> hashes(registered);
  for (std::size_t q = 0; q < num_queries; ++q) {
    queries[q] = {random_hash(rng), kBlockSize * (1 + rng() % 512)};
    hashes[q] = index.hash_block(queries[q].parent,
                                 std::span<const TokenId>(tokens).subspan(q * kBlockSize, kBlockSize),
                                 queries[q].block_start, nullptr);
  }
  for (std::size_t r = num_queries; r < registered; ++r) hashes[r] = random_hash(rng);
  std::vector<std::size_t> insert_order(registered);
  std::iota(insert_order.begin(), insert_order.end(), std::size_t{0});
  std::shuffle(insert_order.begin(), insert_order.end(), rng);
  for (std::size_t j = 0; j < registered; ++j) {
    index.insert(hashes[insert_order[j]], static_cast<Id>(j + 1));
  }
  std::vector<std::uint32_t> visit(num_queries);
  std::iota(visit.begin(), visit.end(), std::uint32_t{0});
  std::shuffle(visit.begin(), visit.end(), rng);

  std::size_t i = 0;
  std::uint64_t hits = 0;
  for (auto _ : state) {
    const std::uint32_t q = visit[i];
    const BlockHash h = index.hash_block(
        queries[q].parent, std::span<const TokenId>(tokens).subspan(std::size_t{q} * kBlockSize, kBlockSize),
        queries[q].block_start, nullptr);
    const std::optional<Id> b = index.find(h);
    benchmark::DoNotOptimize(b);
    hits += b.has_value();
    if (++i == num_queries) i = 0;
  }
  if (hits != static_cast<std::uint64_t>(state.iterations())) state.SkipWithError("a query missed");
  report_per_item(state, 1.0, "item=hit (16-token block: hash + find)");
}
BENCHMARK_TEMPLATE(BM_CacheHit, Sha256Hasher)
    ->ArgNames({"registered_blocks", "queried_blocks"})
    ->ArgsProduct({{1'000, 10'000, 100'000, 1'000'000}, {256, 16'384}});
BENCHMARK_TEMPLATE(BM_CacheHit, Xxh3Hasher)
    ->ArgNames({"registered_blocks", "queried_blocks"})
    ->ArgsProduct({{1'000, 10'000, 100'000, 1'000'000}, {256, 16'384}});

// BM_IndexFind/<registered_blocks>/<queried_blocks>: PrefixHashIndex::find alone (hash already known), same layout
// as BM_CacheHit: separates the map's cost from the hash's.
void BM_IndexFind(benchmark::State& state) {
  const auto registered = static_cast<std::size_t>(state.range(0));
  const std::size_t num_queries = std::min<std::size_t>(registered, static_cast<std::size_t>(state.range(1)));
  std::mt19937_64 rng(kSeed ^ registered ^ 7);
  pagedkv::PrefixHashIndex<Xxh3Hasher, Id> index(registered + 1, kHashSeed);
  std::vector<BlockHash> hashes(registered);
  for (BlockHash& h : hashes) h = random_hash(rng);
  std::vector<std::size_t> insert_order(registered);
  std::iota(insert_order.begin(), insert_order.end(), std::size_t{0});
  std::shuffle(insert_order.begin(), insert_order.end(), rng);
  for (std::size_t j = 0; j < registered; ++j) index.insert(hashes[insert_order[j]], static_cast<Id>(j + 1));
  std::vector<BlockHash> queries(hashes.begin(), hashes.begin() + static_cast<std::ptrdiff_t>(num_queries));
  std::shuffle(queries.begin(), queries.end(), rng);
  std::size_t i = 0;
  std::uint64_t hits = 0;
  for (auto _ : state) {
    const std::optional<Id> b = index.find(queries[i]);
    benchmark::DoNotOptimize(b);
    hits += b.has_value();
    if (++i == num_queries) i = 0;
  }
  if (hits != static_cast<std::uint64_t>(state.iterations())) state.SkipWithError("a query missed");
  report_per_item(state, 1.0, "item=find (hash known)");
}
BENCHMARK(BM_IndexFind)
    ->ArgNames({"registered_blocks", "queried_blocks"})
    ->ArgsProduct({{1'000, 10'000, 100'000, 1'000'000}, {256, 16'384}});

// BM_Lookup<Hasher>/<prompt_blocks>: KVCacheManager::lookup of a prompt of prompt_blocks * 16 + 1 tokens whose
// prompt_blocks full blocks are all cached (admitted, prefill metadata built, freed at setup): the chain walk hashes
// and finds every block. 16 distinct prompts, visited round robin.
template <class Hasher>
void BM_Lookup(benchmark::State& state) {
  const auto prompt_blocks = static_cast<std::size_t>(state.range(0));
  constexpr std::size_t kPrompts = 16;
  const std::size_t prompt_tokens = prompt_blocks * kBlockSize + 1;
  pagedkv::CacheConfig cfg;
  cfg.num_blocks = kPrompts * (prompt_blocks + 1) + 1;
  cfg.block_size = kBlockSize;
  cfg.hash_seed = kHashSeed;
  pagedkv::KVCacheManager<Hasher, Id> m(cfg);
  std::mt19937_64 rng(kSeed ^ prompt_blocks ^ 11);
  std::vector<std::vector<TokenId>> prompts;
  PrefillBuffers buffers(prompt_tokens);
  for (pagedkv::SeqId p = 0; p < kPrompts; ++p) {
    prompts.push_back(random_tokens(prompt_tokens, rng));
    const pagedkv::AdmitResult r = m.try_admit(p, prompts.back());
    if (!r.admitted()) {
      state.SkipWithError("setup admission failed");
      return;
    }
    (void)m.build_batch_metadata({&p, 1}, buffers.view(prompt_tokens, r.num_cached_tokens));
    m.free(p);
  }
  std::size_t k = 0;
  std::uint64_t cached_tokens = 0;
  for (auto _ : state) {
    const std::size_t n = m.lookup(prompts[k]);
    benchmark::DoNotOptimize(n);
    cached_tokens += n;
    if (++k == kPrompts) k = 0;
  }
  if (cached_tokens != static_cast<std::uint64_t>(state.iterations()) * prompt_blocks * kBlockSize) {
    state.SkipWithError("lookup did not hit every block");
  }
  report_per_item(state, static_cast<double>(prompt_blocks), "item=hit block (KVCacheManager::lookup)");
}
BENCHMARK_TEMPLATE(BM_Lookup, Sha256Hasher)->ArgName("prompt_blocks")->Arg(1)->Arg(8)->Arg(64)->Arg(512);
BENCHMARK_TEMPLATE(BM_Lookup, Xxh3Hasher)->ArgName("prompt_blocks")->Arg(1)->Arg(8)->Arg(64)->Arg(512);

// BM_AdmitFree<Hasher>/<prompt_tokens>: the prefix-mode replay's unit of work (pagedkv-replay --mode prefix): admit,
// build the prefill step's metadata (CSR page table + slot mapping; this registers the new full blocks), free.
// Each iteration's prompt of prompt_tokens tokens = one of 64 cached shared prefixes (prompt_tokens / 2 tokens) + a
// fresh suffix (its first token is unique per iteration, so through the chain every suffix block misses). The pool (64 Ki
// blocks) fills with the freed suffix blocks and then evicts them (LRU), as in a long replay; the shared prefixes
// stay hot. Admission hashes every full block, hits half, allocates the rest and registers them; free releases
// all blocks tail first.
// `miss_causes`: 0 = plain; 1 = CacheConfig::count_miss_causes; 2 = that and an eviction history of the pool's size
// (BM_AdmitFreeMissCauses: what the miss-cause counters cost an admission).
template <class Hasher>
void admit_free(benchmark::State& state, int miss_causes, bool report_shares) {
  const auto prompt_tokens = static_cast<std::size_t>(state.range(0));
  const std::size_t prefix_tokens = prompt_tokens / 2;  // a multiple of the block size (args are multiples of 32)
  constexpr std::size_t kPrefixes = 64;
  pagedkv::CacheConfig cfg;
  cfg.num_blocks = std::size_t{1} << 16;
  cfg.block_size = kBlockSize;
  cfg.hash_seed = kHashSeed;
  cfg.count_miss_causes = miss_causes >= 1;
  cfg.eviction_history = miss_causes >= 2 ? cfg.num_blocks : 0;
  pagedkv::KVCacheManager<Hasher, Id> m(cfg);
  std::mt19937_64 rng(kSeed ^ prompt_tokens ^ 13);
  std::vector<std::vector<TokenId>> prompts;  // prefix + suffix template
  PrefillBuffers buffers(prompt_tokens);
  pagedkv::SeqId next_seq = 1;
  for (std::size_t p = 0; p < kPrefixes; ++p, ++next_seq) {
    prompts.push_back(random_tokens(prompt_tokens, rng));
    // Cache the prefix: admit prefix + 1 token (so every prefix block is full), build (registers), free.
    const std::span<const TokenId> head(prompts.back().data(), prefix_tokens + 1);
    const pagedkv::AdmitResult r = m.try_admit(next_seq, head);
    if (!r.admitted()) {
      state.SkipWithError("setup admission failed");
      return;
    }
    (void)m.build_batch_metadata({&next_seq, 1}, buffers.view(head.size(), r.num_cached_tokens));
    m.free(next_seq);
  }
  auto unique = static_cast<std::uint32_t>(rng() % 1'000'000'000);
  std::size_t k = 0;
  std::uint64_t cached_tokens = 0;
  for (auto _ : state) {
    std::vector<TokenId>& prompt = prompts[k];
    prompt[prefix_tokens] = static_cast<TokenId>(1 + unique++ % 2'000'000'000u);  // fresh suffix chain
    const pagedkv::AdmitResult r = m.try_admit(next_seq, prompt);
    cached_tokens += r.num_cached_tokens;
    const pagedkv::BatchMetadataSizes sz =
        m.build_batch_metadata({&next_seq, 1}, buffers.view(prompt_tokens, r.num_cached_tokens));
    benchmark::DoNotOptimize(sz);
    m.free(next_seq++);
    if (++k == kPrefixes) k = 0;
  }
  if (cached_tokens != static_cast<std::uint64_t>(state.iterations()) * prefix_tokens) {
    state.SkipWithError("admission did not hit exactly the shared prefix");
  }
  const double blocks = static_cast<double>(prompt_tokens / kBlockSize);
  state.counters["ns_per_prompt_block"] = benchmark::Counter(
      blocks * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.counters["evictions_per_request"] =
      static_cast<double>(m.stats().evictions) / static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
  // (0 with the counters off: every row of a family has the same counters, as --benchmark_format=csv needs)
  if (report_shares) {
    const auto& c = m.stats().admissions_by_miss_cause;
    const auto at = [&](pagedkv::MissCause x) { return static_cast<double>(c[static_cast<std::size_t>(x)]); };
    const double n = static_cast<double>(m.stats().prefix_query_requests);
    state.counters["share_not_cached"] = at(pagedkv::MissCause::kNotCached) / n;  // the fresh suffixes
    state.counters["share_evicted"] = at(pagedkv::MissCause::kEvicted) / n;
  }
  report_per_item(state, 1.0, "item=request (admit half-cached prompt + prefill build + free)");
}
template <class Hasher>
void BM_AdmitFree(benchmark::State& state) {
  admit_free<Hasher>(state, 0, false);
}
BENCHMARK_TEMPLATE(BM_AdmitFree, Sha256Hasher)->ArgName("prompt_tokens")->Arg(512)->Arg(2048)->Arg(8192);
BENCHMARK_TEMPLATE(BM_AdmitFree, Xxh3Hasher)->ArgName("prompt_tokens")->Arg(512)->Arg(2048)->Arg(8192);
// BM_AdmitFreeMissCauses<Hasher>/prompt_tokens/miss_causes: BM_AdmitFree with the miss-cause counters off (0), on
// (1), on with an eviction history of 65,536 evictions (2), in one process (docs/benchmarks.md "Miss causes").
template <class Hasher>
void BM_AdmitFreeMissCauses(benchmark::State& state) {
  admit_free<Hasher>(state, static_cast<int>(state.range(1)), true);
}
BENCHMARK_TEMPLATE(BM_AdmitFreeMissCauses, Xxh3Hasher)
    ->ArgNames({"prompt_tokens", "miss_causes"})
    ->ArgsProduct({{512, 2048}, {0, 1, 2}});
BENCHMARK_TEMPLATE(BM_AdmitFreeMissCauses, Sha256Hasher)
    ->ArgNames({"prompt_tokens", "miss_causes"})
    ->ArgsProduct({{2048}, {0, 1, 2}});

// Resident host memory of a manager (docs/contract.md sec. 5: <= 32 bytes per block). One iteration constructs a
// KVCacheManager of pool_blocks blocks and fills its whole pool with cached blocks (admit a 1024-token prompt,
// build, free, until every block was used), then reads the process's resident set: counters rss_bytes_per_block
// (the growth of the RSS over the manager's life, /proc/self/statm) and index_bytes_per_block (what the prefix
// index reports). Timing is irrelevant here.
long resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return -1;
  long size = 0, resident = 0;
  const int n = std::fscanf(f, "%ld %ld", &size, &resident);
  std::fclose(f);
  return n == 2 ? resident * sysconf(_SC_PAGESIZE) : -1;
}
void BM_HostMemoryPerBlock(benchmark::State& state) {
  const auto pool_blocks = static_cast<std::size_t>(state.range(0));
  double rss_per_block = 0, index_per_block = 0;
  for (auto _ : state) {
    const long before = resident_bytes();
    {
      pagedkv::CacheConfig cfg;
      cfg.num_blocks = pool_blocks;
      cfg.block_size = kBlockSize;
      pagedkv::KVCacheManager<Xxh3Hasher, Id> m(cfg);
      std::mt19937_64 rng(kSeed);
      PrefillBuffers buffers(1024);
      pagedkv::SeqId seq = 1;
      for (std::size_t used = 0; used < pool_blocks; used += 1024 / kBlockSize, ++seq) {
        const std::vector<TokenId> prompt = random_tokens(1024, rng);
        const pagedkv::AdmitResult r = m.try_admit(seq, prompt);
        (void)m.build_batch_metadata({&seq, 1}, buffers.view(prompt.size(), r.num_cached_tokens));
        m.free(seq);
      }
      const long after = resident_bytes();
      rss_per_block = static_cast<double>(after - before) / static_cast<double>(pool_blocks);
      index_per_block = static_cast<double>(m.prefix_index().memory_bytes()) / static_cast<double>(pool_blocks);
      benchmark::DoNotOptimize(m.stats());
    }
  }
  state.counters["rss_bytes_per_block"] = rss_per_block;
  state.counters["index_bytes_per_block"] = index_per_block;
  state.SetLabel("item=manager of pool_blocks blocks, whole pool cached");
}
BENCHMARK(BM_HostMemoryPerBlock)->ArgName("pool_blocks")->Arg(1 << 14)->Arg(1 << 17)->Arg(1000000)->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace
