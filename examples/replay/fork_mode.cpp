// examples/replay/fork_mode.cpp: `--mode fork`, parallel sampling (vLLM paper sec. 6.3): memory held with block
// sharing against N independent copies.
//
// Per request, one at a time: admit the prompt (prefill step; its metadata is built), fork it into N branches,
// then for output_length decode steps every branch appends its own token and the batch metadata of the N
// branches is built (issuing the copy-on-write of the shared partial last block); finally all branches are
// freed. After the prefill step and after every decode step we sample
//   shared   = blocks referenced by the N branches, each distinct block once (CacheStats::blocks_used);
//   unshared = N x blocks of one branch (what N separately admitted copies would hold).
#include <algorithm>
#include <limits>
#include <stdexcept>
#include <unordered_set>
#include <vector>

#include "modes.hpp"
#include "publish.hpp"

namespace replay {
namespace {

/// Peak and time-averaged block counts over sampled steps.
struct BlockSeries {
  std::uint64_t samples = 0;
  double shared_sum = 0.0, unshared_sum = 0.0;
  std::size_t shared_peak = 0, unshared_peak = 0;

  void sample(std::size_t shared, std::size_t unshared) {
    ++samples;
    shared_sum += static_cast<double>(shared);
    unshared_sum += static_cast<double>(unshared);
    shared_peak = std::max(shared_peak, shared);
    unshared_peak = std::max(unshared_peak, unshared);
  }
  [[nodiscard]] double shared_mean() const { return samples == 0 ? 0.0 : shared_sum / static_cast<double>(samples); }
  [[nodiscard]] double unshared_mean() const {
    return samples == 0 ? 0.0 : unshared_sum / static_cast<double>(samples);
  }
};

double saving(double shared, double unshared) { return unshared == 0.0 ? 0.0 : 1.0 - shared / unshared; }

template <class Hasher>
Row run_fork_with(const Trace& trace, const Options& opt) {
  const std::size_t n = opt.num_branches;
  const std::size_t bs = opt.block_size;
  const double capacity = opt.capacity_tokens.front();
  const std::size_t usable = usable_blocks_for(capacity, opt.block_size);
  const auto blocks = [&](std::size_t tokens) { return (tokens + bs - 1) / bs; };

  pagedkv::CacheConfig config;
  config.num_blocks = usable + 1;  // + the null block
  config.block_size = opt.block_size;
  EventPublishing events(opt.publish_events, opt.publish_wait_ms);
  events.configure(config);
  pagedkv::KVCacheManager<Hasher> m(config);
  events.attach(m);

  std::size_t max_input = 0, max_blocks_per_seq = 0;
  for (const Request& r : trace.requests) {
    max_input = std::max<std::size_t>(max_input, r.input_tokens);
    max_blocks_per_seq = std::max(max_blocks_per_seq, blocks(std::size_t{r.input_tokens} + r.output_tokens));
  }
  MetadataBuffers buffers(n, n * max_blocks_per_seq, std::max(max_input, n), n);

  LibraryTimer timer;
  BlockSeries series;
  std::size_t rejected = 0;
  std::vector<pagedkv::TokenId> prompt;
  std::vector<pagedkv::TokenId> step_tokens(n);
  std::vector<pagedkv::SeqId> branches(n);
  Progress progress("fork " + trace_name(trace), trace.requests.size(), opt.progress);

  const auto sample = [&](std::size_t branch_tokens) {
    const std::size_t shared = m.stats().blocks_used;
    if (opt.check) {
      std::unordered_set<std::uint32_t> distinct;
      m.for_each_sequence([&](pagedkv::SeqId, std::span<const std::uint32_t> ids, std::size_t) {
        distinct.insert(ids.begin(), ids.end());
      });
      if (distinct.size() != shared) {
        throw std::logic_error("fork --check: " + std::to_string(distinct.size()) +
                               " distinct blocks in the tables, blocks_used = " + std::to_string(shared));
      }
    }
    series.sample(shared, n * blocks(branch_tokens));
  };

  for (std::size_t i = 0; i < trace.requests.size(); ++i) {
    const Request& r = trace.requests[i];
    // Worst case: the prompt's blocks, plus per branch its blocks past the shared full prompt blocks.
    const std::size_t full_prompt_blocks = r.input_tokens / bs;
    const std::size_t worst = blocks(r.input_tokens) +
                              n * (blocks(std::size_t{r.input_tokens} + r.output_tokens) - full_prompt_blocks);
    if (worst > usable) {
      ++rejected;
      progress.update(i + 1);
      continue;
    }
    for (std::size_t b = 0; b < n; ++b) branches[b] = (static_cast<pagedkv::SeqId>(i) << 8) | b;
    synthesize_prompt(trace, i, prompt);

    // Prefill step: admit, build its metadata, fork (after the build, as the manager requires).
    const auto view_prefill = buffers.view(blocks(r.input_tokens), r.input_tokens);
    const pagedkv::AdmitResult admitted = timer.measure([&] {
      const pagedkv::AdmitResult a = m.try_admit(branches[0], prompt);
      if (!a.admitted()) return a;
      (void)m.build_batch_metadata({branches.data(), 1}, view_prefill);
      for (std::size_t b = 1; b < n; ++b) m.fork(branches[0], branches[b]);
      return a;
    });
    if (!admitted.admitted()) {
      throw std::logic_error("fork: request " + std::to_string(i) + " not admitted into a pool with no live sequence");
    }
    sample(r.input_tokens);
    events.step(m, r.arrival_ms / 1000.0);

    for (std::uint32_t step = 0; step < r.output_tokens; ++step) {
      for (std::size_t b = 0; b < n; ++b) step_tokens[b] = generated_token(i, b, step);
      const std::size_t branch_tokens = std::size_t{r.input_tokens} + step + 1;
      const auto view = buffers.view(n * blocks(branch_tokens), n);
      const bool ok = timer.measure([&] {
        for (std::size_t b = 0; b < n; ++b) {
          if (!m.try_append(branches[b], {&step_tokens[b], 1}).ok()) return false;
        }
        (void)m.build_batch_metadata(branches, view);
        return true;
      });
      if (!ok) throw std::logic_error("fork: request " + std::to_string(i) + " ran out of blocks despite the check");
      sample(branch_tokens);
      events.step(m, r.arrival_ms / 1000.0);
    }
    timer.measure([&] {
      for (const pagedkv::SeqId id : branches) m.free(id);
    });
    progress.update(i + 1);
  }
  progress.finish();
  events.finish();

  const pagedkv::CacheStats s = m.stats();
  const std::size_t admitted = trace.requests.size() - rejected;
  Row row;
  row.add("trace", trace_name(trace))
      .add("mode", "fork")
      .add("hash", to_string(opt.hash))
      .add("block_size", opt.block_size)
      .add("capacity_tokens", static_cast<std::int64_t>(capacity))
      .add("n", n)
      .add("requests", trace.requests.size())
      .add("rejected", rejected)
      .add("steps", series.samples)
      .add("peak_blocks_shared", series.shared_peak)
      .add("peak_blocks_unshared", series.unshared_peak)
      .add("peak_saving", saving(static_cast<double>(series.shared_peak), static_cast<double>(series.unshared_peak)), 4)
      .add("avg_blocks_shared", series.shared_mean(), 1)
      .add("avg_blocks_unshared", series.unshared_mean(), 1)
      .add("saving", saving(series.shared_mean(), series.unshared_mean()), 4)
      .add("cow_copies", s.cow_copies)
      .add("cow_per_request", admitted == 0 ? 0.0 : static_cast<double>(s.cow_copies) / static_cast<double>(admitted), 2)
      .add("hit_ratio", hit_ratio(s), 4);
  add_cost_fields(row, timer.seconds(), s.block_ops);
  return row;
}

}  // namespace

Row run_fork(const Trace& trace, const Options& opt) {
  return with_hasher(opt.hash, [&]<class H>(std::type_identity<H>) { return run_fork_with<H>(trace, opt); });
}

}  // namespace replay
