// bench_eviction.cpp: the eviction policies alone (pagedkv/eviction.hpp, eviction_slru.hpp, eviction_priority.hpp):
// cost per block of the calls the allocator makes, against pool size (1e3 .. 1e6 blocks), for
//   Lru           LruEviction<uint32_t> (the default)
//   Slru          SlruEviction<uint32_t>, protected fraction 0.8
//   Prio          PriorityLruEviction<uint32_t>, priorities drawn from {0, 20, 35 x 5, 60, 100}, no expiry; the
//                 set_priority the manager calls before each release is part of the measured op
//   PrioExpiring  the same, every priority != 35 with an expiry 1-2 h out (indexed min-heap work on insert / erase)
//
// Every benchmark starts from a pool full of cached blocks (the state in which the policy matters), inserted in a
// seeded random order (the intrusive lists' worst locality); for Slru a random half of them was hit once first, so
// the protected segment is full and probation holds the rest.
//
// Timing: each iteration runs a batch of operations, timed with the thread's CPU clock (CLOCK_THREAD_CPUTIME_ID:
// on a shared machine wall time also counts other processes) around the measured calls only; untimed set-up work
// of the batch (e.g. re-inserting the blocks an erase batch took out) is excluded. Reported: the manual time per
// iteration and
//   ns_per_op   CPU ns per operation (per block) of the measured calls, averaged over all batches; the console
//               prints it as a plain number.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <numeric>
#include <optional>
#include <random>
#include <type_traits>
#include <vector>

#include <benchmark/benchmark.h>

#include <pagedkv/eviction.hpp>
#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>

namespace {

using Id = std::uint32_t;
constexpr std::uint64_t kSeed = 0x5eed'e71c'7000'0001ULL;
constexpr std::size_t kBatch = 1024;  // operations per timed batch (fewer in pools smaller than 2 batches)

/// Thread CPU time in ns.
std::int64_t cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

/// All usable block ids [1, num_blocks) in a seeded random order.
std::vector<Id> shuffled_ids(std::size_t num_blocks, std::uint64_t seed) {
  std::vector<Id> ids(num_blocks - 1);
  std::iota(ids.begin(), ids.end(), Id{1});
  std::mt19937_64 rng(seed);
  std::shuffle(ids.begin(), ids.end(), rng);
  return ids;
}

pagedkv::RetentionTimePoint at_ms(std::int64_t ms) { return pagedkv::RetentionTimePoint(std::chrono::milliseconds(ms)); }

// ---- the policies under test, with what the cache manager does around insert ------------------------------------
// assign(p, b, i): what the manager calls before the release that caches b (nothing for Lru / Slru; set_priority for
// the priority policies, i indexing a precomputed random table).

struct Lru {
  using Policy = pagedkv::LruEviction<Id>;
  static void assign(Policy&, Id, std::size_t) {}
};
struct Slru {
  using Policy = pagedkv::SlruEviction<Id>;
  static void assign(Policy&, Id, std::size_t) {}
};
/// What the manager would pass to set_priority: a seeded table of 4096 (level, expiry) pairs, levels drawn from
/// {0, 20, 35 x 5, 60, 100} (mostly the default), expiries 1 h .. 2 h out (never reached here).
struct Assignments {
  std::vector<std::uint8_t> level;
  std::vector<pagedkv::RetentionTimePoint> expiry;
  Assignments() : level(4096), expiry(4096) {
    constexpr std::uint8_t kLevels[] = {0, 20, 35, 35, 35, 35, 35, 60, 100};
    std::mt19937_64 rng(kSeed ^ 11);
    for (std::size_t i = 0; i < level.size(); ++i) {
      level[i] = kLevels[rng() % std::size(kLevels)];
      expiry[i] = at_ms(3'600'000 + static_cast<std::int64_t>(rng() % 3'600'000));
    }
  }
};
const Assignments kAssignments;

template <bool kExpiring>
struct PrioT {
  using Policy = pagedkv::PriorityLruEviction<Id>;
  static void assign(Policy& p, Id b, std::size_t i) {
    i &= 4095;
    p.set_priority(b, kAssignments.level[i],
                   kExpiring ? std::optional(kAssignments.expiry[i]) : std::optional<pagedkv::RetentionTimePoint>());
  }
};
using Prio = PrioT<false>;
using PrioExpiring = PrioT<true>;

/// A policy of `pool_blocks` blocks with every usable block cached, in a seeded random order (Slru: a random half
/// hit once, so protected is full).
template <class T>
typename T::Policy make_full(std::size_t pool_blocks) {
  typename T::Policy p(pool_blocks);
  const std::vector<Id> ids = shuffled_ids(pool_blocks, kSeed);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    T::assign(p, ids[i], i);
    p.insert(ids[i]);
  }
  if constexpr (std::is_same_v<T, Slru>) {
    const std::vector<Id> hits = shuffled_ids(pool_blocks, kSeed ^ 7);
    for (std::size_t i = 0; i < hits.size() / 2; ++i) {
      p.erase(hits[i]);
      p.insert(hits[i]);
    }
  }
  if (p.size() != pool_blocks - 1) std::abort();
  return p;
}

void report(benchmark::State& state, std::int64_t total_ns, std::size_t total_ops, const char* label) {
  state.counters["ns_per_op"] = benchmark::Counter(static_cast<double>(total_ns) / static_cast<double>(total_ops));
  state.SetItemsProcessed(static_cast<std::int64_t>(total_ops));
  state.SetLabel(label);
}

// ---------------------------------------------------------------------------------------------------------------
// BM_InsertPop<T>/<pool_blocks>: the eviction path. One op = pop_victim + (assign) + insert of the victim as most
// recently released (the allocator evicts a block, which is filled, registered and released again).
template <class T>
void BM_InsertPop(benchmark::State& state) {
  const auto pool_blocks = static_cast<std::size_t>(state.range(0));
  auto p = make_full<T>(pool_blocks);
  std::size_t i = 0, total_ops = 0;
  std::int64_t total_ns = 0;
  for (auto _ : state) {
    const std::int64_t t0 = cpu_ns();
    for (std::size_t k = 0; k < kBatch; ++k) {
      const Id v = *p.pop_victim();
      T::assign(p, v, ++i);
      p.insert(v);
    }
    const std::int64_t dt = cpu_ns() - t0;
    total_ns += dt;
    total_ops += kBatch;
    state.SetIterationTime(static_cast<double>(dt) * 1e-9);
  }
  benchmark::DoNotOptimize(p.peek_victim());
  report(state, total_ns, total_ops, "op=pop_victim + insert (one block)");
}

// BM_EraseHit<T>/<pool_blocks>: the prefix-hit path, erase only. One op = erase of a cached block (acquired by a
// hit). Each batch erases min(1024, pool/2) blocks drawn from a seeded random permutation (timed), then re-inserts
// them (untimed; Slru: into protected, demoting).
template <class T>
void BM_EraseHit(benchmark::State& state) {
  const auto pool_blocks = static_cast<std::size_t>(state.range(0));
  auto p = make_full<T>(pool_blocks);
  const std::vector<Id> picks = shuffled_ids(pool_blocks, kSeed ^ 3);
  const std::size_t batch = std::min(kBatch, picks.size() / 2);
  std::size_t pos = 0, total_ops = 0;
  std::int64_t total_ns = 0;
  for (auto _ : state) {
    if (pos + batch > picks.size()) pos = 0;
    const std::int64_t t0 = cpu_ns();
    for (std::size_t k = 0; k < batch; ++k) p.erase(picks[pos + k]);
    const std::int64_t dt = cpu_ns() - t0;
    for (std::size_t k = 0; k < batch; ++k) p.insert(picks[pos + k]);
    pos += batch;
    total_ns += dt;
    total_ops += batch;
    state.SetIterationTime(static_cast<double>(dt) * 1e-9);
  }
  benchmark::DoNotOptimize(p.peek_victim());
  report(state, total_ns, total_ops, "op=erase (hit) of one cached block");
}

// BM_HitRelease<T>/<pool_blocks>: a hit and the later release of the same block. One op = erase + (assign) + insert
// (Slru: the insert goes to protected and demotes protected's LRU block).
template <class T>
void BM_HitRelease(benchmark::State& state) {
  const auto pool_blocks = static_cast<std::size_t>(state.range(0));
  auto p = make_full<T>(pool_blocks);
  const std::vector<Id> picks = shuffled_ids(pool_blocks, kSeed ^ 5);
  const std::size_t batch = std::min(kBatch, picks.size());
  std::size_t pos = 0, i = 0, total_ops = 0;
  std::int64_t total_ns = 0;
  for (auto _ : state) {
    if (pos + batch > picks.size()) pos = 0;
    const std::int64_t t0 = cpu_ns();
    for (std::size_t k = 0; k < batch; ++k) {
      const Id b = picks[pos + k];
      p.erase(b);
      T::assign(p, b, ++i);
      p.insert(b);
    }
    const std::int64_t dt = cpu_ns() - t0;
    pos += batch;
    total_ns += dt;
    total_ops += batch;
    state.SetIterationTime(static_cast<double>(dt) * 1e-9);
  }
  benchmark::DoNotOptimize(p.peek_victim());
  report(state, total_ns, total_ops, "op=erase (hit) + insert of one block");
}

// BM_PriorityExpire/<pool_blocks>: PriorityLruEviction::expire. Every block cached at priority 60 with a distinct
// expiry (block ids in random order get expiries 1, 2, ... ms); each batch advances now by min(1024, pool/2) ms, so
// expire moves that many blocks to the default level (timed; one op = one moved block), then re-prioritizes them
// one pool-length of ms later (untimed: erase, set_priority, insert).
void BM_PriorityExpire(benchmark::State& state) {
  const auto pool_blocks = static_cast<std::size_t>(state.range(0));
  pagedkv::PriorityLruEviction<Id> p(pool_blocks);
  const std::vector<Id> ids = shuffled_ids(pool_blocks, kSeed ^ 9);
  const auto n = static_cast<std::int64_t>(ids.size());
  for (std::int64_t j = 0; j < n; ++j) {
    p.set_priority(ids[static_cast<std::size_t>(j)], 60, at_ms(j + 1));
    p.insert(ids[static_cast<std::size_t>(j)]);
  }
  const auto batch = static_cast<std::int64_t>(std::min<std::size_t>(kBatch, ids.size() / 2));
  std::int64_t now = 0;  // blocks with expiry <= now have been moved and re-prioritized at expiry + n
  std::size_t total_ops = 0;
  std::int64_t total_ns = 0;
  for (auto _ : state) {
    const std::int64_t t0 = cpu_ns();
    const std::size_t moved = p.expire(at_ms(now + batch));
    const std::int64_t dt = cpu_ns() - t0;
    if (moved != static_cast<std::size_t>(batch)) {
      state.SkipWithError("expire moved an unexpected number of blocks");
      break;
    }
    for (std::int64_t e = now + 1; e <= now + batch; ++e) {  // block with expiry e (mod n): next cycle
      const Id b = ids[static_cast<std::size_t>((e - 1) % n)];
      p.erase(b);
      p.set_priority(b, 60, at_ms(e + n));
      p.insert(b);
    }
    now += batch;
    total_ns += dt;
    total_ops += moved;
    state.SetIterationTime(static_cast<double>(dt) * 1e-9);
  }
  report(state, total_ns, total_ops == 0 ? 1 : total_ops, "op=one block moved by expire(now)");
}

/// Pool sizes 1e3 .. 1e6 blocks, manual (thread CPU) time.
void pool_sizes(benchmark::internal::Benchmark* b) {
  b->ArgName("pool_blocks")->Arg(1'000)->Arg(10'000)->Arg(100'000)->Arg(1'000'000)->UseManualTime();
}

BENCHMARK_TEMPLATE(BM_InsertPop, Lru)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_InsertPop, Slru)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_InsertPop, Prio)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_InsertPop, PrioExpiring)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_EraseHit, Lru)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_EraseHit, Slru)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_EraseHit, Prio)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_EraseHit, PrioExpiring)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_HitRelease, Lru)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_HitRelease, Slru)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_HitRelease, Prio)->Apply(pool_sizes);
BENCHMARK_TEMPLATE(BM_HitRelease, PrioExpiring)->Apply(pool_sizes);
BENCHMARK(BM_PriorityExpire)->Apply(pool_sizes);

}  // namespace
