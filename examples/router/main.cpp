// examples/router/main.cpp: pagedkv-router, a KV-cache-aware router over N engine processes on one machine
// (issue 11 sec. 3). Each engine is a pagedkv::KVCacheManager publishing its KV events in vLLM's ZeroMQ format;
// the router keeps the fleet's block index from those events alone and routes the Mooncake conversation trace.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "fleet.hpp"

namespace {

namespace ev = pagedkv::events;
constexpr const char* kDefaultTrace = "data/traces/mooncake-fast25/conversation_trace.jsonl";

/// The default trace: relative to the current directory, else to this source file's repository
/// (examples/router/main.cpp: the root is three levels up from __FILE__).
std::filesystem::path default_trace_path() {
  const std::filesystem::path here(kDefaultTrace);
  if (std::filesystem::exists(here)) return here;
  const auto root = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
  return std::filesystem::exists(root / kDefaultTrace) ? root / kDefaultTrace : here;
}

/// This binary's path, for spawning engines (/proc/self/exe resolved once, before any fork).
std::string self_exe() {
  std::error_code ec;
  const auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw std::runtime_error("cannot resolve /proc/self/exe: " + ec.message());
  return p.string();
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

constexpr const char* kFooter = R"(What it runs (per N in --instances, per policy in --policies):
  N engine processes (1 for `ideal`, with N x the capacity), each a KVCacheManager<Sha256Hasher> replaying the
  requests it is sent with the prefix-cache semantics of `pagedkv-replay --mode prefix` (admit, build the
  prefill step, free; the LRU prefix cache carries over) and publishing its KV events on 127.0.0.1 in vLLM's
  ZeroMQ format (pagedkv::events::ZmqPublisher, with replay). The router follows every stream
  (EventStreamFollower: replay / snapshot after a gap), keeps Dynamo's sequence hash -> instance mask, recomputed
  from the events' token ids as Dynamo's KV router does (pagedkv/block_identity.hpp), hashes each prompt's blocks
  the same way and routes in trace order, in lockstep (the engine answers, the router takes
  in its events, then routes the next request), so the index is exact and its prediction of every hit is checked
  against the engine's answer (mismatches must be 0).

Policies:
  kv-aware      longest cached prefix among instances whose load (prefill tokens routed in the last
                --load-window-s of simulated time) is at most (1 + --load-slack) x the mean plus this request;
                ties by load. Without the bound every request of the Mooncake trace (all share a 512-token head)
                would follow the first instance that cached it.
  kv-unbounded  longest cached prefix among all instances; ties by load.
  round-robin   request i to instance i mod N.
  ideal         one engine with N x the capacity: what perfect placement could reach.

Exit status 0 when every run shut down cleanly with no mismatch, no resynchronization failure, no dropped store
(a parent the index did not know) and no unknown removal; 1 otherwise; 2 for bad arguments.

Example:
  pagedkv-router --instances 2,4,8 --capacity-tokens 1e6
  pagedkv-router --instances 2 --limit 300 --capacity-tokens 2e5    # the CI smoke
)";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("pagedkv-router: a KV-cache-aware router over N pagedkv engine processes (KV events over ZeroMQ)");
  app.footer(kFooter);
  std::string trace_arg;
  std::string instances_arg = "2,4,8";
  std::string policies_arg = "kv-aware,round-robin,ideal";
  double capacity = 1e6;
  std::uint32_t block_size = 16;
  std::size_t limit = 0;
  double slack = 0.25, window = 60, timeout = 60;
  std::string layout_arg = "array", hashes_arg = "uint64";
  bool json = false, progress = false;
  app.add_option("trace", trace_arg, "Mooncake JSONL trace (default: the conversation trace)");
  app.add_option("--instances", instances_arg, "Comma-separated fleet sizes N (1..64)")->capture_default_str();
  app.add_option("--capacity-tokens", capacity, "KV pool capacity per instance, tokens")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--policies", policies_arg, "Comma-separated: kv-aware, kv-unbounded, round-robin, ideal")
      ->capture_default_str();
  app.add_option("--block-size", block_size, "Tokens per block")->capture_default_str()->check(CLI::Range(1, 1 << 16));
  app.add_option("--limit", limit, "Route only the first N requests (0 = all)")->capture_default_str();
  app.add_option("--load-slack", slack, "kv-aware: load bound slack")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--load-window-s", window, "kv-aware: load window, simulated seconds")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--layout", layout_arg, "Event layout on the wire: array (vLLM <= 0.23) or map (vLLM >= 0.24)")
      ->capture_default_str()->check(CLI::IsMember({"array", "map"}));
  app.add_option("--hashes", hashes_arg, "Block hashes on the wire: uint64 or bytes16")
      ->capture_default_str()->check(CLI::IsMember({"uint64", "bytes16"}));
  app.add_option("--timeout-s", timeout, "Bound of every wait (engine start, answers, events, shutdown)")
      ->capture_default_str()->check(CLI::Range(1.0, 3600.0));
  app.add_flag("--json", json, "One JSON object per run per line");
  app.add_flag("--progress", progress, "Progress on stderr");

  // The engine role (spawned by the router itself).
  bool engine = false;
  router::EngineArgs ea;
  auto* eg = app.add_option_group("engine (internal: how the router starts its engine processes)");
  eg->add_flag("--engine", engine, "Run as an engine process");
  eg->add_option("--control", ea.control, "The router's control endpoint");
  eg->add_option("--instance", ea.instance, "Engine index");
  eg->add_option("--hash-seed", ea.hash_seed, "Block-hash chain seed");
  eg->add_option("--max-prompt-tokens", ea.max_prompt_tokens, "Longest prompt");
  eg->add_option("--idle-timeout-s", ea.idle_timeout_s, "Exit after this long without a router message");
  CLI11_PARSE(app, argc, argv);

  const auto layout = layout_arg == "map" ? ev::EventLayout::kMap : ev::EventLayout::kArray;
  const auto hashes = hashes_arg == "bytes16" ? ev::HashFormat::kBytes16 : ev::HashFormat::kUint64;
  if (engine) {
    ea.capacity_tokens = capacity;
    ea.block_size = block_size;
    ea.layout = layout;
    ea.hashes = hashes;
    try {
      return router::run_engine(ea);
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "engine %u: %s\n", ea.instance, ex.what());
      return 5;
    }
  }

  std::vector<std::size_t> fleet_sizes;
  std::vector<router::Policy> policies;
  try {
    for (const std::string& s : split(instances_arg)) {
      const long v = std::stol(s);
      if (v < 1 || v > 64) throw std::invalid_argument("fleet size " + s + " is not in 1..64");
      fleet_sizes.push_back(static_cast<std::size_t>(v));
    }
    for (const std::string& s : split(policies_arg)) {
      if (s == "kv-aware") {
        policies.push_back(router::Policy::kCacheAware);
      } else if (s == "kv-unbounded") {
        policies.push_back(router::Policy::kCacheAwareUnbounded);
      } else if (s == "round-robin") {
        policies.push_back(router::Policy::kRoundRobin);
      } else if (s == "ideal") {
        policies.push_back(router::Policy::kIdeal);
      } else {
        throw std::invalid_argument("unknown policy '" + s + "' (kv-aware, kv-unbounded, round-robin, ideal)");
      }
    }
    if (fleet_sizes.empty() || policies.empty()) throw std::invalid_argument("--instances and --policies need a value");
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "pagedkv-router: %s\n", ex.what());
    return 2;
  }

  int rc = 0;
  try {
    const std::filesystem::path path = trace_arg.empty() ? default_trace_path() : std::filesystem::path(trace_arg);
    const replay::Trace trace = replay::load_trace(path, limit);
    router::FleetConfig cfg;
    cfg.capacity_tokens = capacity;
    cfg.block_size = block_size;
    cfg.load_slack = slack;
    cfg.load_window_s = window;
    cfg.layout = layout;
    cfg.hashes = hashes;
    cfg.timeout_s = timeout;
    cfg.exe = self_exe();
    cfg.progress = progress;
    if (!json) {
      std::printf("trace %s: %zu requests; %.3g tokens per instance, block size %u, events %s / %s\n",
                  path.filename().c_str(), trace.requests.size(), capacity, block_size, layout_arg.c_str(),
                  hashes_arg.c_str());
      std::printf("%3s %-12s %10s %9s %6s %8s %9s %9s %9s %9s %9s %9s %8s %7s\n", "N", "policy", "pool_tok",
                  "hit_ratio", "mism", "balance", "hash_us", "match_us", "event_us", "router_us", "idx_keys",
                  "idx_MiB", "wire_MB", "wall_s");
    }
    for (const std::size_t n : fleet_sizes) {
      for (const router::Policy p : policies) {
        cfg.instances = n;
        cfg.policy = p;
        const router::FleetResult r = router::run_fleet(trace, cfg);
        const bool ok = r.clean_shutdown && r.mismatches == 0 && r.resync_failures == 0 && r.unknown_removals == 0 &&
                        r.dropped_stores == 0;
        if (!ok) rc = 1;
        if (json) {
          nlohmann::json j;
          j["trace"] = path.filename().string();
          j["instances"] = n;
          j["policy"] = router::to_string(p);
          j["engines"] = r.instances;
          j["pool_tokens"] = r.pool_tokens;
          j["requests"] = r.requests;
          j["rejected"] = r.rejected;
          j["prompt_tokens"] = r.prompt_tokens;
          j["cached_tokens"] = r.cached_tokens;
          j["hit_ratio"] = r.hit_ratio();
          j["mismatches"] = r.mismatches;
          j["max_over_mean_prompt_tokens"] = r.max_over_mean_prompt_tokens;
          j["router_hash_us_per_request"] = r.hash_us;
          j["router_match_us_per_request"] = r.match_us;
          j["router_events_us_per_request"] = r.events_us;
          j["router_us_per_request"] = r.hash_us + r.match_us + r.events_us;
          j["index_entries_peak"] = r.index_entries_peak;
          j["index_bytes_peak"] = r.index_bytes_peak;
          j["event_batches"] = r.event_batches;
          j["event_bytes"] = r.event_bytes;
          j["stored_blocks"] = r.stored_blocks;
          j["removed_blocks"] = r.removed_blocks;
          j["replays"] = r.replays;
          j["snapshots"] = r.snapshots;
          j["resync_failures"] = r.resync_failures;
          j["unknown_removals"] = r.unknown_removals;
          j["dropped_stores"] = r.dropped_stores;
          j["engine_manager_seconds"] = r.engine_manager_seconds;
          j["wall_seconds"] = r.wall_seconds;
          j["clean_shutdown"] = r.clean_shutdown;
          std::cout << j.dump() << std::endl;
        } else {
          std::printf("%3zu %-12s %10.3g %9.4f %6llu %8.2f %9.1f %9.1f %9.1f %9.1f %9zu %9.1f %8.0f %7.1f%s\n", n,
                      router::to_string(p), r.pool_tokens, r.hit_ratio(),
                      static_cast<unsigned long long>(r.mismatches), r.max_over_mean_prompt_tokens, r.hash_us,
                      r.match_us, r.events_us, r.hash_us + r.match_us + r.events_us, r.index_entries_peak,
                      static_cast<double>(r.index_bytes_peak) / (1 << 20), static_cast<double>(r.event_bytes) / 1e6,
                      r.wall_seconds, ok ? "" : "  <- FAILED (see stderr / --json)");
          std::fflush(stdout);
        }
      }
    }
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "pagedkv-router: %s\n", ex.what());
    return 1;
  }
  return rc;
}
