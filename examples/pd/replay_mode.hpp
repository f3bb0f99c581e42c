// examples/pd/replay_mode.hpp: pagedkv-pd --role replay (replay.cpp): a trace through a prefill and a decode
// manager with the in-process transport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pd {

/// Options of the replay mode.
struct ReplayOptions {
  std::string trace;                       ///< Mooncake JSONL (or Azure CSV: no shared prefixes) trace path.
  std::size_t limit = 2000;                ///< First N requests (0 = all).
  std::size_t num_blocks = 65536;          ///< Blocks per manager's pool (16 tokens each).
  std::uint64_t kv_bytes_per_token = 131072;  ///< Model KV bytes per token (all layers, K and V).
  double prefill_tokens_per_s = 10000.0;   ///< TTFT proxy: prefill throughput.
  double link_gbps = 25.0;                 ///< TTFT proxy: link bandwidth between the engines, GB/s.
};

/// Runs the replay and prints its report; returns 0 when both managers end with zero blocks used and every moved
/// block landed where its identity says. Throws replay::TraceError for a bad trace, std::runtime_error when a pool
/// cannot hold a request.
int run_replay(const ReplayOptions& o);

}  // namespace pd
