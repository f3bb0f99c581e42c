// examples/replay/prefix_mode.cpp: `--mode prefix`, the prefix-cache hit ratio against capacity (Mooncake Fig. 9).
#include <algorithm>
#include <memory>
#include <vector>

#include "modes.hpp"
#include "publish.hpp"

namespace replay {
namespace {

template <class Hasher>
std::vector<Row> run_prefix_with(const Trace& trace, const Options& opt) {
  using Manager = pagedkv::KVCacheManager<Hasher>;
  // One manager per capacity, fed the same prompts: each prompt is synthesized once.
  struct Pool {
    double capacity_tokens;
    std::size_t usable_blocks;
    std::unique_ptr<Manager> manager;
    LibraryTimer timer;
    std::uint64_t rejected = 0;
  };
  std::size_t max_prompt_tokens = 0;
  for (const Request& r : trace.requests) max_prompt_tokens = std::max<std::size_t>(max_prompt_tokens, r.input_tokens);
  std::vector<Pool> pools;
  EventPublishing events(opt.publish_events, opt.publish_wait_ms);  // publishes the first pool's events
  for (const double capacity : opt.capacity_tokens) {
    pagedkv::CacheConfig config;
    config.block_size = opt.block_size;
    const std::size_t usable = usable_blocks_for(capacity, opt.block_size);
    config.num_blocks = usable + 1;  // + the null block
    // Left at 0, the per-sequence limit defaults to the pool's size and a prompt larger than the pool throws
    // kLimitExceeded instead of returning kNeverFits; allow every prompt of the trace so it gets the answer.
    config.max_tokens_per_seq = max_prompt_tokens;
    if (pools.empty()) events.configure(config);
    pools.push_back({capacity, usable, std::make_unique<Manager>(config), {}, 0});
  }

  events.attach(*pools.front().manager);
  // The prefill step's metadata: building it is what registers the prompt's full blocks in the prefix index
  // (the library registers a block when the metadata that writes its K/V is built).
  const std::size_t bs = opt.block_size;
  MetadataBuffers buffers(1, (max_prompt_tokens + bs - 1) / bs, max_prompt_tokens, 1);

  Progress progress("prefix " + trace_name(trace), trace.requests.size(), opt.progress);
  std::vector<pagedkv::TokenId> prompt;
  for (std::size_t i = 0; i < trace.requests.size(); ++i) {
    synthesize_prompt(trace, i, prompt);
    const pagedkv::SeqId seq = i;
    for (Pool& pool : pools) {
      Manager& m = *pool.manager;
      const auto result = pool.timer.measure([&] {
        const pagedkv::AdmitResult r = m.try_admit(seq, prompt);
        if (r.admitted()) {
          const auto view = buffers.view((prompt.size() + bs - 1) / bs, prompt.size() - r.num_cached_tokens);
          (void)m.build_batch_metadata({&seq, 1}, view);
          m.free(seq);
        }
        return r;
      });
      // Alone in the pool, a request can only fail by needing more blocks than the pool has.
      if (!result.admitted()) ++pool.rejected;
    }
    events.step(*pools.front().manager, trace.requests[i].arrival_ms / 1000.0);
    progress.update(i + 1);
  }
  events.finish();

  std::vector<Row> rows;
  for (const Pool& pool : pools) {
    const pagedkv::CacheStats s = pool.manager->stats();
    Row row;
    row.add("trace", trace_name(trace))
        .add("mode", "prefix")
        .add("hash", to_string(opt.hash))
        .add("block_size", opt.block_size)
        .add("capacity_tokens", static_cast<std::int64_t>(pool.capacity_tokens))
        .add("pool_blocks", pool.usable_blocks)
        .add("requests", trace.requests.size())
        .add("rejected", pool.rejected)
        .add("prompt_tokens", s.prefix_query_tokens)
        .add("cached_tokens", s.prefix_hit_tokens)
        .add("hit_ratio", hit_ratio(s), 4)
        .add("evictions", s.evictions);
    add_cost_fields(row, pool.timer.seconds(), s.block_ops);
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace

std::vector<Row> run_prefix(const Trace& trace, const Options& opt) {
  return with_hasher(opt.hash, [&]<class H>(std::type_identity<H>) { return run_prefix_with<H>(trace, opt); });
}

}  // namespace replay
