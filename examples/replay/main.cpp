// examples/replay/main.cpp: pagedkv-replay, replays real LLM-serving traces through pagedkv::KVCacheManager.
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <pagedkv/error.hpp>

#include "modes.hpp"
#include "report.hpp"
#include "trace.hpp"

namespace {

enum class Mode { kPrefix, kServe, kFork };

constexpr const char* kDefaultTrace = "data/traces/mooncake-fast25/synthetic_trace.jsonl";

/// The default trace: relative to the current directory, else relative to this source file's repository (this
/// file is examples/replay/main.cpp, so the repository root is three levels up from __FILE__).
std::filesystem::path default_trace_path() {
  const std::filesystem::path here(kDefaultTrace);
  if (std::filesystem::exists(here)) return here;
  const std::filesystem::path source_root = std::filesystem::path(__FILE__).parent_path().parent_path().parent_path();
  const std::filesystem::path baked = source_root / kDefaultTrace;
  return std::filesystem::exists(baked) ? baked : here;
}

constexpr const char* kFooter = R"(Trace formats (detected from the content):
  Mooncake JSONL  {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [512-token prefix-block ids]}
                  Token j of block h is splitmix64(h * 512 + j) & 0x7fffffff, so equal ids share KV blocks.
  Azure CSV       TIMESTAMP,ContextTokens,GeneratedTokens ("YYYY-MM-DD HH:MM:SS.fffffff"); prompts get tokens
                  unique to each request (no prefix sharing).

Modes:
  prefix  Requests one at a time in file order, prompt only: admit (prefix lookup + allocation), build the
          prefill step's metadata (registers the prompt's full blocks in the prefix index), then free.
          One row per --capacity-tokens value: hit_ratio = cached prompt tokens / prompt tokens (Mooncake
          FAST'25 Fig. 9), rejected (prompt larger than the pool), evictions.
  serve   Continuous batching in simulated time: arrivals by timestamp, one decode token per running sequence
          per --step-ms step, FIFO admission (whole prompt prefilled in its step) within the pool and
          --max-num-seqs, recompute preemption of the newest sequence when a block is missing (re-admitted with
          prompt + tokens generated so far), batch metadata built every step. Reports time-averaged
          kv_utilization (filled slots / slots of held blocks), peak running, preemptions, hit_ratio, and the same
          for a contiguous baseline reserving --max-model-len slots per sequence (vLLM SOSP'23 Fig. 2).
  fork    Parallel sampling: each request admitted, forked into --n branches after its prompt, each branch
          decoding its own tokens for output_length steps, then freed; one request at a time. Reports peak and
          time-averaged blocks held with sharing vs. --n x each branch's blocks (vLLM SOSP'23 sec. 6.3).

Every mode reports manager_seconds (steady_clock time inside library calls only), block_ops and
ns_per_block_op; serve also ns_per_seq_step (library time per running sequence per step), admit_seconds
(try_admit alone) and decode_ns_per_seq_step (try_append + build_batch_metadata per sequence per step).

Examples:
  pagedkv-replay --mode prefix --capacity-tokens 1e6,3e6,1e7,5e7
  pagedkv-replay data/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv --mode serve --json
  pagedkv-replay --mode fork --n 4 --limit 500
)";

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "pagedkv-replay: replay an LLM-serving trace through pagedkv's KVCacheManager and report prefix-cache hit\n"
      "ratios, KV memory utilization, sharing savings and the library's own cost."};
  app.footer(kFooter);

  std::string trace_arg;
  std::string mode_name = "prefix";
  std::string hash_name = "sha256";
  replay::Options opt;
  opt.progress = isatty(STDERR_FILENO) != 0;
  std::size_t limit = 0;
  bool json = false;

  app.add_option("trace", trace_arg,
                 std::string("Trace file (Mooncake .jsonl or Azure .csv). Default: ") + kDefaultTrace +
                     " under the current directory, else under the source tree this binary was built from");
  app.add_option("--mode", mode_name, "What to replay: prefix, serve or fork (see Modes below)")
      ->check(CLI::IsMember({"prefix", "serve", "fork"}))
      ->capture_default_str();
  app.add_option("--capacity-tokens", opt.capacity_tokens,
                 "KV pool capacity in tokens; pool = floor(capacity / block size) blocks + the null block. prefix: a "
                 "comma-separated list, one row each (default 1e6,3e6,1e7,5e7); serve, fork: one value "
                 "(default 1e6)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--block-size", opt.block_size, "Tokens per KV block")
      ->check(CLI::Range(1U, 1U << 16))
      ->capture_default_str();
  app.add_option("--hash", hash_name, "Block-hash policy: sha256 (SHA-256, cryptographic) or xxh3 (XXH3-128, fast)")
      ->check(CLI::IsMember({"sha256", "xxh3"}))
      ->capture_default_str();
  app.add_option("--step-ms", opt.step_ms, "serve: simulated milliseconds per engine step")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--max-num-seqs", opt.max_num_seqs, "serve: most sequences running at once")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_option("--max-model-len", opt.max_model_len,
                 "serve: longest request in tokens (prompt + output); the contiguous baseline reserves this many "
                 "slots per sequence and longer requests are rejected. Default: the trace's longest request")
      ->check(CLI::PositiveNumber);
  app.add_option("--n", opt.num_branches, "fork: parallel samples (branches) per request")
      ->check(CLI::Range(std::size_t{1}, std::size_t{256}))
      ->capture_default_str();
  app.add_option("--limit", limit, "Replay only the first N requests (0 = all)")->capture_default_str();
  app.add_flag("--json", json, "Print one JSON object per configuration per line instead of a table");
  app.add_flag("--progress,!--no-progress", opt.progress,
               "Show a progress line on stderr for runs longer than a second (default: when stderr is a terminal)");
  app.add_flag("--check", opt.check,
               "Cross-check the derived block and slot counts against the block tables every step (slow)");

  CLI11_PARSE(app, argc, argv);

  const Mode mode = mode_name == "serve" ? Mode::kServe : mode_name == "fork" ? Mode::kFork : Mode::kPrefix;
  opt.hash = hash_name == "xxh3" ? replay::HashKind::kXxh3 : replay::HashKind::kSha256;
  try {
    if (opt.capacity_tokens.empty()) {
      opt.capacity_tokens = mode == Mode::kPrefix ? std::vector<double>{1e6, 3e6, 1e7, 5e7} : std::vector<double>{1e6};
    }
    if (mode != Mode::kPrefix && opt.capacity_tokens.size() != 1) {
      throw CLI::ValidationError("--capacity-tokens", "serve and fork modes take a single capacity");
    }
    const std::filesystem::path path = trace_arg.empty() ? default_trace_path() : std::filesystem::path(trace_arg);
    const replay::Trace trace = replay::load_trace(path, limit);

    std::vector<replay::Row> rows;
    switch (mode) {
      case Mode::kPrefix: rows = replay::run_prefix(trace, opt); break;
      case Mode::kServe: rows.push_back(replay::run_serve(trace, opt)); break;
      case Mode::kFork: rows.push_back(replay::run_fork(trace, opt)); break;
    }
    if (json) {
      replay::print_json_lines(std::cout, rows);
    } else {
      std::cout << "# " << trace.path.string() << " (" << replay::to_string(trace.format) << ", "
                << trace.requests.size() << " requests)\n";
      replay::print_table(std::cout, rows);
    }
    return 0;
  } catch (const CLI::Error& e) {
    return app.exit(e);
  } catch (const replay::TraceError& e) {
    std::fprintf(stderr, "pagedkv-replay: error: %s\n", e.what());
  } catch (const pagedkv::Error& e) {
    std::fprintf(stderr, "pagedkv-replay: library error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pagedkv-replay: error: %s\n", e.what());
  }
  return 1;
}
