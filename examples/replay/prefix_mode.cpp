// examples/replay/prefix_mode.cpp: `--mode prefix`, the prefix-cache hit ratio against capacity (Mooncake Fig. 9).
#include <algorithm>
#include <memory>
#include <vector>

#include "modes.hpp"
#include "publish.hpp"

namespace replay {
namespace {

template <class Manager>
std::vector<Row> run_prefix_with(const Trace& trace, const Options& opt) {
  // One manager per capacity (and, with a host tier, a second one per capacity with the tier beside the
  // single-tier one, fed the same prompts in the same run, so the tier's cost is measured side by side): each
  // prompt is synthesized once.
  struct Pool {
    double capacity_tokens;
    std::size_t usable_blocks;
    std::size_t host_blocks;  // usable host blocks; 0 = no host tier
    std::unique_ptr<Manager> manager;
    LibraryTimer timer;
    std::uint64_t rejected = 0;
    std::size_t last_full_blocks = 0;  // full blocks of the last admitted prompt (bounds write-through offloads)
  };
  std::size_t max_prompt_tokens = 0;
  for (const Request& r : trace.requests) max_prompt_tokens = std::max<std::size_t>(max_prompt_tokens, r.input_tokens);
  const std::size_t host_blocks =
      opt.host_capacity_tokens > 0 ? usable_blocks_for(opt.host_capacity_tokens, opt.block_size, "--host-capacity-tokens")
                                   : 0;
  std::vector<Pool> pools;
  EventPublishing events(opt.publish_events, opt.publish_wait_ms);  // publishes the first pool's events
  for (const double capacity : opt.capacity_tokens) {
    for (const std::size_t host : host_blocks != 0 ? std::vector<std::size_t>{0, host_blocks} : std::vector<std::size_t>{0}) {
      pagedkv::CacheConfig config;
      config.block_size = opt.block_size;
      const std::size_t usable = usable_blocks_for(capacity, opt.block_size);
      config.num_blocks = usable + 1;  // + the null block
      // Left at 0, the per-sequence limit defaults to the pool's size and a prompt larger than the pool throws
      // kLimitExceeded instead of returning kNeverFits; allow every prompt of the trace so it gets the answer.
      config.max_tokens_per_seq = max_prompt_tokens;
      config.num_host_blocks = host == 0 ? 0 : host + 1;  // + the host tier's null block
      config.offload = opt.offload;
      config.count_miss_causes = opt.miss_causes;
      config.eviction_history = opt.miss_causes ? 4 * usable : 0;  // remembers about four pool turnovers
      if (pools.empty()) events.configure(config);
      pools.push_back({capacity, usable, host, std::make_unique<Manager>(config), {}, 0, 0});
    }
  }

  events.attach(*pools.front().manager);
  // The prefill step's metadata: building it is what registers the prompt's full blocks in the prefix index
  // (the library registers a block when the metadata that writes its K/V is built). With a host tier the build
  // also issues the step's copies (offloads of the blocks the admission evicted, onboarding of host-tier hits),
  // which the replay acknowledges at once, as an engine does after the step (complete_transfers).
  const std::size_t bs = opt.block_size;
  const std::size_t max_blocks = (max_prompt_tokens + bs - 1) / bs;
  // Swaps of one build: offloads <= one per allocation (+ write-through: the previous prompt's full blocks), onboards
  // <= the prompt's blocks.
  MetadataBuffers buffers(1, max_blocks, max_prompt_tokens, 1, host_blocks != 0 ? 2 * max_blocks : 0);

  Progress progress("prefix " + trace_name(trace), trace.requests.size(), opt.progress);
  std::vector<pagedkv::TokenId> prompt;
  pagedkv::AdmitOptions admit_options;
  admit_options.retention = opt.retention;  // applied when the request frees its blocks
  for (std::size_t i = 0; i < trace.requests.size(); ++i) {
    synthesize_prompt(trace, i, prompt);
    const pagedkv::SeqId seq = i;
    for (Pool& pool : pools) {
      Manager& m = *pool.manager;
      const auto result = pool.timer.measure([&] {
        const pagedkv::AdmitResult r = m.try_admit(seq, prompt, nullptr, admit_options);
        if (r.admitted()) {
          const auto [swap_out, swap_in] = swap_extents(m, opt, pool.last_full_blocks);
          const auto view =
              buffers.view((prompt.size() + bs - 1) / bs, prompt.size() - r.num_cached_tokens, swap_out, swap_in);
          const pagedkv::BatchMetadataSizes sz = m.build_batch_metadata({&seq, 1}, view);
          if (sz.transfer_token != 0) m.complete_transfers(sz.transfer_token);
          m.free(seq);
        }
        return r;
      });
      // Alone in the pool, a request can only fail by needing more blocks than the pool has.
      if (!result.admitted()) {
        ++pool.rejected;
      } else {
        pool.last_full_blocks = prompt.size() / bs;
      }
    }
    events.step(*pools.front().manager, trace.requests[i].arrival_ms / 1000.0);
    progress.update(i + 1);
  }
  events.finish();

  std::vector<Row> rows;
  double single_tier_seconds = 0.0;  // of the same capacity, for tier_time_ratio
  for (const Pool& pool : pools) {
    const pagedkv::CacheStats s = pool.manager->stats();
    Row row;
    row.add("trace", trace_name(trace))
        .add("mode", "prefix")
        .add("hash", to_string(opt.hash))
        .add("eviction", to_string(opt.eviction))
        .add("retention", opt.retention_label)
        .add("block_size", opt.block_size)
        .add("capacity_tokens", static_cast<std::int64_t>(pool.capacity_tokens))
        .add("pool_blocks", pool.usable_blocks);
    if (host_blocks != 0) {
      row.add("host_capacity_tokens", pool.host_blocks == 0 ? std::int64_t{0}
                                                            : static_cast<std::int64_t>(opt.host_capacity_tokens))
          .add("host_pool_blocks", pool.host_blocks)
          .add("host_eviction", pool.host_blocks == 0 ? "-" : to_string(opt.host_eviction))
          .add("offload", pool.host_blocks == 0 ? "-" : to_string(opt.offload));
    }
    row.add("requests", trace.requests.size())
        .add("rejected", pool.rejected)
        .add("prompt_tokens", s.prefix_query_tokens)
        .add("cached_tokens", s.prefix_hit_tokens)
        .add("hit_ratio", hit_ratio(s), 4);
    if (host_blocks != 0) add_tier_fields(row, s, opt);
    row.add("evictions", s.evictions);
    if (opt.miss_causes) {  // share of admitted requests per cause (docs/design.md: the counters)
      const double n = static_cast<double>(std::max<std::uint64_t>(s.prefix_query_requests, 1));
      for (std::size_t c = 0; c < pagedkv::kNumMissCauses; ++c) {
        const auto cause = static_cast<pagedkv::MissCause>(c);
        if (cause == pagedkv::MissCause::kKeyMismatch) continue;  // never counted (no extra keys here either)
        const double share = static_cast<double>(s.admissions_by_miss_cause[c]) / n;
        row.add(std::string("miss_") + pagedkv::to_string(cause), share, 4);
      }
    }
    add_cost_fields(row, pool.timer.seconds(), s.block_ops);
    if (host_blocks != 0) {
      // Library time per prompt block (the same work in both pools, unlike block_ops, which counts device-pool
      // operations only), and the tiered pool's library time over the single-tier pool's of the same capacity.
      const double prompt_blocks = static_cast<double>(s.prefix_query_tokens) / static_cast<double>(bs);
      row.add("ns_per_prompt_block", prompt_blocks == 0 ? 0.0 : pool.timer.seconds() * 1e9 / prompt_blocks, 1);
      if (pool.host_blocks == 0) {
        single_tier_seconds = pool.timer.seconds();
        row.add("tier_time_ratio", 1.0, 3);
      } else {
        row.add("tier_time_ratio", single_tier_seconds == 0 ? 0.0 : pool.timer.seconds() / single_tier_seconds, 3);
      }
    }
    rows.push_back(std::move(row));
  }
  return rows;
}

}  // namespace

std::vector<Row> run_prefix(const Trace& trace, const Options& opt) {
  return with_manager(opt, [&]<class M>(std::type_identity<M>) { return run_prefix_with<M>(trace, opt); });
}

}  // namespace replay
