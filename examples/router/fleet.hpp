// examples/router/fleet.hpp: the router example's two roles. An engine process owns one KVCacheManager, serves the
// requests the router sends it (prefix-cache semantics of `pagedkv-replay --mode prefix`: admit, build the
// prefill step, free) and publishes its KV events over ZeroMQ in vLLM's format. The router process spawns N
// engines, follows their event streams, keeps the fleet's block index from the events alone, and routes the
// trace's requests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <pagedkv/events_zmq/wire.hpp>

#include "trace.hpp"  // examples/replay: trace loading and prompt synthesis

namespace router {

/// Arguments of an engine process (spawned by the router with --engine; see main.cpp).
struct EngineArgs {
  std::string control;             ///< The router's control endpoint (tcp://127.0.0.1:PORT).
  std::uint32_t instance = 0;      ///< This engine's index; its control routing id is "engine-<instance>".
  double capacity_tokens = 0;      ///< Pool capacity: floor(capacity / block_size) usable blocks.
  std::uint32_t block_size = 16;
  std::uint64_t hash_seed = 0;     ///< Shared by the fleet and the router, so block hashes agree.
  std::size_t max_prompt_tokens = 0;  ///< The longest prompt it will be sent (the manager's per-sequence limit).
  pagedkv::events::EventLayout layout = pagedkv::events::EventLayout::kArray;
  pagedkv::events::HashFormat hashes = pagedkv::events::HashFormat::kUint64;
  double idle_timeout_s = 120;     ///< Exit when the router sends nothing for this long (it died).
};

/// Runs an engine until the router says quit, the router dies or it stays silent for idle_timeout_s. Returns the
/// process exit code (0 after a quit).
int run_engine(const EngineArgs& args);

/// How the router places requests.
enum class Policy {
  kCacheAware,           ///< Longest cached prefix among instances whose recent load is within the bound; ties by load.
  kCacheAwareUnbounded,  ///< Longest cached prefix among all instances; ties by load.
  kRoundRobin,           ///< Request i to instance i mod N.
  kIdeal,                ///< One instance of N x the capacity (the bound for any placement).
};
[[nodiscard]] const char* to_string(Policy p) noexcept;

/// One fleet run.
struct FleetConfig {
  std::size_t instances = 2;
  double capacity_tokens = 1e6;    ///< Per instance (the ideal gets instances x this in one pool).
  Policy policy = Policy::kCacheAware;
  std::uint32_t block_size = 16;
  std::uint64_t hash_seed = 0x9a6edc0ffeeULL;
  double load_slack = 0.25;        ///< kCacheAware: eligible while load <= (1 + slack) x mean load + this request.
  double load_window_s = 60;       ///< Load = prefill tokens (prompt - predicted hit) routed in this window.
  pagedkv::events::EventLayout layout = pagedkv::events::EventLayout::kArray;
  pagedkv::events::HashFormat hashes = pagedkv::events::HashFormat::kUint64;
  double timeout_s = 60;           ///< Bound of every wait (engine start, reply, events, shutdown).
  std::string exe;                 ///< The binary to run engines with (this one).
  bool progress = false;
};

/// What one fleet run measured.
struct FleetResult {
  std::size_t instances = 0;       ///< Engine processes (1 for kIdeal).
  double pool_tokens = 0;          ///< Capacity of each engine's pool.
  std::uint64_t requests = 0;
  std::uint64_t rejected = 0;      ///< Prompts larger than a pool.
  std::uint64_t prompt_tokens = 0;  ///< Of admitted requests.
  std::uint64_t cached_tokens = 0;  ///< As the engines reported them.
  std::uint64_t predicted_tokens = 0;  ///< As the router's index predicted them for the chosen instance.
  std::uint64_t mismatches = 0;    ///< Requests whose prediction differed from the engine's answer.
  double max_over_mean_prompt_tokens = 0;  ///< Balance: the busiest instance's prompt tokens / the mean.
  // Router cost (thread CPU time of the router, per request): hashing the prompt's blocks, matching the index and
  // deciding, and taking in the events (receive, decode, index update).
  double hash_us = 0, match_us = 0, events_us = 0;
  std::size_t index_entries_peak = 0;
  std::size_t index_bytes_peak = 0;
  std::uint64_t event_batches = 0;
  std::uint64_t event_bytes = 0;
  std::uint64_t stored_blocks = 0, removed_blocks = 0;
  std::uint64_t replays = 0, snapshots = 0, resync_failures = 0, unknown_removals = 0;
  std::uint64_t dropped_stores = 0;  ///< BlockStored events whose parent the index did not know (Dynamo drops them).
  double engine_manager_seconds = 0;  ///< Sum over engines.
  double wall_seconds = 0;
  bool clean_shutdown = false;     ///< Every engine said bye and exited 0 within the bound.
  [[nodiscard]] double hit_ratio() const noexcept {
    return prompt_tokens == 0 ? 0.0 : static_cast<double>(cached_tokens) / static_cast<double>(prompt_tokens);
  }
};

/// Spawns the engines, routes every request of `trace` by `config.policy`, shuts the fleet down. Throws
/// std::runtime_error naming what failed (an engine that does not start or answer in time, a stream that cannot
/// be resynchronized); engines are killed and reaped before it returns or throws.
[[nodiscard]] FleetResult run_fleet(const replay::Trace& trace, const FleetConfig& config);

}  // namespace router
