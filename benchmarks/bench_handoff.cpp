// bench_handoff.cpp: the cache managers' part of one prefill/decode hand-off (issue 34 item 4), without the bytes
// (those are NIXL's: examples/pd reports its GB/s next to raw NIXL). Per iteration, a producer manager computes a
// fresh prompt (admission + one build: setup, not timed), then the timed part:
//   export   producer finish_with_lease (descriptor with generations and identities, the lease)
//   plan     consumer plan_import (fingerprints, shape, identities of the blocks to move)
//   fill     consumer try_admit_external (the admission and its fill ticket)
//   complete consumer complete_external_fill (registers the filled blocks) + producer release_lease (read-done)
// then the consumer frees the sequence (not timed). Manual time: only the four steps are measured.
//
// Counters: ns_per_block (the four steps, per block of the hand-off), and each step alone per block
// (export_ns_per_block, plan_ns_per_block, fill_ns_per_block, complete_ns_per_block).
// Argument: prompt length in blocks of 16 tokens (the last block partial by 5 tokens).
#include <chrono>
#include <cstdint>
#include <vector>

#include <benchmark/benchmark.h>

#include <pagedkv/external_kv.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using Mgr = pagedkv::KVCacheManager<>;
using Clock = std::chrono::steady_clock;

pagedkv::CacheConfig config() {
  pagedkv::CacheConfig c;
  c.num_blocks = 4096;
  c.block_size = 16;
  return c;
}

void BM_HandoffManagerPart(benchmark::State& state) {
  const std::size_t blocks = static_cast<std::size_t>(state.range(0));
  const std::size_t len = blocks * 16 - 5;
  Mgr prod(config()), cons(config());
  const auto fp = prod.layout_fingerprint("nhd", "bf16", 8, 128);
  std::vector<pagedkv::TokenId> prompt(len);
  std::vector<std::int64_t> slots(len);
  std::vector<std::int32_t> copies(16, -1);
  double t_export = 0, t_plan = 0, t_fill = 0, t_complete = 0;
  std::uint64_t iter = 0;
  for (auto _ : state) {
    ++iter;
    for (std::size_t i = 0; i < len; ++i) prompt[i] = static_cast<pagedkv::TokenId>((iter * 7919 + i * 31) % 100000);
    const pagedkv::SeqId seq = iter;
    if (!prod.try_admit(seq, prompt).admitted()) state.SkipWithError("producer admission failed");
    pagedkv::BatchMetadataBuffers b;
    b.slot_mapping = slots;
    b.copies = copies;
    const pagedkv::SeqId batch[1] = {seq};
    prod.build_batch_metadata(batch, b);

    const auto t0 = Clock::now();
    const auto desc = prod.finish_with_lease(seq, fp, std::nullopt);
    const auto t1 = Clock::now();
    const auto plan = cons.plan_import(desc, fp, prompt);
    const auto t2 = Clock::now();
    const auto r = cons.try_admit_external(seq, prompt, plan.end_token - plan.first_token);
    const auto t3 = Clock::now();
    const auto c = cons.complete_external_fill(r.ticket.fill_id, r.ticket.num_blocks());
    const auto s = prod.release_lease(desc.hold_id);
    const auto t4 = Clock::now();
    benchmark::DoNotOptimize(c);
    benchmark::DoNotOptimize(s);
    if (c.signal != pagedkv::ExternalSignal::kApplied || s != pagedkv::ExternalSignal::kApplied) {
      state.SkipWithError("a hand-off signal was not applied");
    }
    cons.free(seq);
    using D = std::chrono::duration<double>;
    t_export += D(t1 - t0).count();
    t_plan += D(t2 - t1).count();
    t_fill += D(t3 - t2).count();
    t_complete += D(t4 - t3).count();
    state.SetIterationTime(D(t4 - t0).count());
  }
  const double per = 1e9 / static_cast<double>(state.iterations()) / static_cast<double>(blocks);
  state.counters["ns_per_block"] = (t_export + t_plan + t_fill + t_complete) * per;
  state.counters["export_ns_per_block"] = t_export * per;
  state.counters["plan_ns_per_block"] = t_plan * per;
  state.counters["fill_ns_per_block"] = t_fill * per;
  state.counters["complete_ns_per_block"] = t_complete * per;
}
BENCHMARK(BM_HandoffManagerPart)->Arg(4)->Arg(16)->Arg(64)->Arg(256)->UseManualTime();

}  // namespace
