// bench_allocator.cpp: BlockAllocator block operations (allocate, release, evict, acquire) against pool size and the
// number of cached blocks. docs/contract.md sec. 5 target: tens of ns per block operation, flat in pool size (1e3 .. 1e6
// blocks) and in the number of cached blocks; the figure is <= 20 ns for allocate + release of one block.
//
// Every benchmark reports, besides Google Benchmark's time per iteration:
//   items_per_second  blocks per second (SetItemsProcessed; one block per iteration here),
//   ns_per_item       CPU ns per block (the console prints it with a stray "s" suffix; the number is ns).
// Inputs (release orders, hit picks) are random with fixed seeds, so runs are comparable.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include <pagedkv/block_allocator.hpp>

namespace {

using Id = std::uint32_t;
using Allocator = pagedkv::BlockAllocator<Id>;

constexpr std::uint64_t kSeed = 0x5eed'a110'c470'0001ULL;

/// items_per_second and ns_per_item for `items_per_iter` items per iteration; `item` names the unit (label).
void report_per_item(benchmark::State& state, double items_per_iter, const char* item) {
  state.SetItemsProcessed(static_cast<std::int64_t>(static_cast<double>(state.iterations()) * items_per_iter));
  state.counters["ns_per_item"] = benchmark::Counter(
      items_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate | benchmark::Counter::kInvert);
  state.SetLabel(item);
}

/// All usable block ids [1, num_blocks) in a seeded random order.
std::vector<Id> shuffled_ids(std::size_t num_blocks, std::uint64_t seed) {
  std::vector<Id> ids(num_blocks - 1);
  std::iota(ids.begin(), ids.end(), Id{1});
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

/// Takes every usable block of `a`, then releases them in a seeded random order. With `hashed`, each block is
/// marked as carrying a hash first, so the pool ends full of cached blocks in a random LRU order (the worst case for
/// the LRU list's locality); otherwise every block ends on the free stack, in a random order.
void fill_and_release(Allocator& a, bool hashed, std::uint64_t seed) {
  std::vector<Id> all(a.num_usable_blocks());
  if (!a.try_allocate(all)) std::abort();
  if (hashed) {
    for (Id b : all) a.set_hashed(b, true);
  }
  for (Id b : shuffled_ids(a.num_blocks(), seed)) a.release(b);
}

// ---------------------------------------------------------------------------------------------------------------
// BM_AllocateRelease/<pool_blocks>: one try_allocate_one + one release per iteration, in a pool of pool_blocks
// blocks of which half are held. Every block has been used once (so allocations come from the free stack, the
// steady state of a pool used without prefix caching), and the block released each iteration is the one allocated
// pool_blocks/2 iterations earlier (FIFO), so the refcounts touched sweep the whole held half of the pool: the
// working set grows with the pool (4 + 1 bytes per block) and this measures it honestly.
void BM_AllocateRelease(benchmark::State& state) {
  const auto pool_blocks = static_cast<std::size_t>(state.range(0));
  Allocator a(pool_blocks);
  fill_and_release(a, /*hashed=*/false, kSeed);
  std::vector<Id> held(a.num_usable_blocks() / 2);  // FIFO ring of held blocks
  if (!a.try_allocate(held)) std::abort();
  const auto noop = [](Id) {};
  std::size_t i = 0;
  for (auto _ : state) {
    const auto b = a.try_allocate_one(noop);
    benchmark::DoNotOptimize(b);
    a.release(held[i]);
    held[i] = *b;
    if (++i == held.size()) i = 0;
  }
  report_per_item(state, 1.0, "item=block (allocate + release)");
}
BENCHMARK(BM_AllocateRelease)->ArgName("pool_blocks")->Arg(1'000)->Arg(10'000)->Arg(100'000)->Arg(1'000'000);

// BM_AllocateReleaseHot/<pool_blocks>: allocate + release of the same block (LIFO free stack): the instruction cost
// of the pair with everything in L1, as a floor for BM_AllocateRelease.
void BM_AllocateReleaseHot(benchmark::State& state) {
  const auto pool_blocks = static_cast<std::size_t>(state.range(0));
  Allocator a(pool_blocks);
  fill_and_release(a, /*hashed=*/false, kSeed);
  const auto noop = [](Id) {};
  for (auto _ : state) {
    const auto b = a.try_allocate_one(noop);
    benchmark::DoNotOptimize(b);
    a.release(*b);
  }
  report_per_item(state, 1.0, "item=block (allocate + release, same block)");
}
BENCHMARK(BM_AllocateReleaseHot)->ArgName("pool_blocks")->Arg(1'000)->Arg(1'000'000);

// BM_AllocateEvict/<cached_blocks>/<lru_order>: the pool holds exactly cached_blocks usable blocks, all cached
// (hashed, refcount 0), so every allocation evicts the least recently released block (calling on_evict, as the
// manager does to drop the hash). Each iteration: try_allocate_one (evicting) + set_hashed + release (the block
// re-enters the LRU list as most recent). lru_order 0: the blocks were released in a random order, so the victim
// chain is a dependent load at a random address per eviction (worst case for the intrusive list's locality);
// lru_order 1: released in id order (blocks of a sequence are allocated and freed together, so real LRU orders are
// mostly runs of neighbouring ids).
void BM_AllocateEvict(benchmark::State& state) {
  const auto cached_blocks = static_cast<std::size_t>(state.range(0));
  const bool sequential = state.range(1) != 0;
  Allocator a(cached_blocks + 1);
  if (sequential) {
    std::vector<Id> all(a.num_usable_blocks());
    if (!a.try_allocate(all)) std::abort();
    for (Id b : all) a.set_hashed(b, true);
    for (Id b : all) a.release(b);
  } else {
    fill_and_release(a, /*hashed=*/true, kSeed ^ 1);
  }
  std::uint64_t evicted = 0;
  const auto on_evict = [&evicted](Id b) { evicted += b; };
  for (auto _ : state) {
    const auto b = a.try_allocate_one(on_evict);
    a.set_hashed(*b, true);
    a.release(*b);
  }
  benchmark::DoNotOptimize(evicted);
  if (a.num_evictions() < static_cast<std::uint64_t>(state.iterations())) state.SkipWithError("did not evict");
  report_per_item(state, 1.0, "item=block (evicting allocate + set_hashed + release)");
}
BENCHMARK(BM_AllocateEvict)
    ->ArgNames({"cached_blocks", "lru_order"})
    ->ArgsProduct({{1'000, 10'000, 100'000, 1'000'000}, {0, 1}});

// BM_AcquireRelease/<cached_blocks>/<picked_blocks>: the allocator's side of a prefix hit. The pool is full of
// cached blocks in a random LRU order; each iteration acquires a cached block (it leaves the LRU list) and
// releases it (it re-enters as most recent). Picks come from a seeded table of 64 Ki random draws among
// picked_blocks blocks spread over the pool (0 = all of them): 256 models a hot shared prefix set that stays in
// cache, 0 a cold one whose refcounts and LRU links are spread over the whole pool.
void BM_AcquireRelease(benchmark::State& state) {
  const auto cached_blocks = static_cast<std::size_t>(state.range(0));
  const std::size_t picked = state.range(1) == 0 ? cached_blocks
                                                 : std::min(cached_blocks, static_cast<std::size_t>(state.range(1)));
  Allocator a(cached_blocks + 1);
  fill_and_release(a, /*hashed=*/true, kSeed ^ 2);
  const std::vector<Id> candidates = shuffled_ids(cached_blocks + 1, kSeed ^ 4);  // first `picked` are eligible
  std::vector<Id> picks(std::size_t{1} << 16);
  std::mt19937_64 rng(kSeed ^ 3);
  std::uniform_int_distribution<std::size_t> dist(0, picked - 1);
  for (Id& p : picks) p = candidates[dist(rng)];
  const std::size_t mask = picks.size() - 1;
  std::size_t i = 0;
  for (auto _ : state) {
    const Id b = picks[i++ & mask];
    a.acquire(b);
    a.release(b);
  }
  benchmark::DoNotOptimize(a.num_block_ops());
  if (a.num_cached_blocks() != cached_blocks) state.SkipWithError("cached set changed");
  report_per_item(state, 1.0, "item=block (acquire cached + release)");
}
BENCHMARK(BM_AcquireRelease)
    ->ArgNames({"cached_blocks", "picked_blocks"})
    ->ArgsProduct({{1'000, 10'000, 100'000, 1'000'000}, {256, 0}});

}  // namespace
