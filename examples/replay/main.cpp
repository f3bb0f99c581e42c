// examples/replay/main.cpp: pagedkv-replay, replays real LLM-serving traces through pagedkv::KVCacheManager.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <memory>
#include <string_view>

#include <CLI/CLI.hpp>

#include <pagedkv/error.hpp>

#include "publish.hpp"  // PublishFlags: --model-name, --pod-id, --topic, --publish-connect
#include "hybrid_mode.hpp"
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
          per --step-ms step (plus --spec-tokens drafts, each accepted with --spec-accept), FIFO admission
          within the pool and --max-num-seqs, prompts prefilled in chunks under --max-num-batched-tokens per
          step, recompute preemption of the newest sequence when a block is missing (re-admitted with
          prompt + tokens generated so far), batch metadata built every step. Reports time-averaged
          kv_utilization (filled slots / slots of held blocks), peak running, preemptions, hit_ratio, and the same
          for a contiguous baseline reserving --max-model-len slots per sequence (vLLM SOSP'23 Fig. 2).
  fork    Parallel sampling: each request admitted, forked into --n branches after its prompt, each branch
          decoding its own tokens for output_length steps, then freed; one request at a time. Reports peak and
          time-averaged blocks held with sharing vs. --n x each branch's blocks (vLLM SOSP'23 sec. 6.3).

Host tier (--host-capacity-tokens N): prefix replays each capacity without and with the tier side by side
(tier_time_ratio); serve runs one pool with it (--preempt swap). Blocks the GPU pool evicts are offloaded
(--offload), GPU misses found in the tier are onboarded; the build's copies are acknowledged after it. Reports
gpu_hit_ratio / host_hit_ratio, copies and their GB (--kv-bytes-per-token).

Hybrid models (--model-layers, e.g. full:12,swa4096:24): the layers as KV-cache groups on one pool, replayed
against the same layers all full attention on the same pool, one row each (docs/groups.md). serve runs the serve
scheduler above with its flags (--host-capacity-tokens and --preempt swap, --spec-tokens, --eviction and
retention priorities, --publish-events: the hybrid row's pool, its full-attention groups' events), each prefill
chunk reserved just before its step unless --reserve prompt; prefix takes --host-capacity-tokens (the rows with
the tier), --eviction, retention priorities and --publish-events. Mamba layers and coarse pages (full@P) replay in prefix mode on LRU pools.

Every mode reports manager_seconds (steady_clock time inside library calls only), block_ops and
ns_per_block_op; serve also ns_per_seq_step (library time per running sequence per step), admit_seconds
(try_admit alone) and decode_ns_per_seq_step (try_append + build_batch_metadata per sequence per step).

Exit status:
  0  the replay ran (or --help)
  2  bad command line: an unknown flag, a bad value, conflicting flags, or a flag that does not apply to this run
     (see "Flags that apply to some runs only" above: refused, never silently ignored)
  3  bad trace file: cannot be opened or read, a directory, a line over 4 MiB, or malformed content (file:line)
  4  the replay would need more host memory than this machine has (checked before anything large is allocated)
  1  the replay failed while running (a library error or a failed self-check: a bug; please report it)

Examples:
  pagedkv-replay --mode prefix --capacity-tokens 1e6,3e6,1e7,5e7
  pagedkv-replay data/traces/azure-llm-2023/AzureLLMInferenceTrace_conv.csv --mode serve --json
  pagedkv-replay --mode fork --n 4 --limit 500
)";

/// Exit status of pagedkv-replay (listed in --help). CLI11's own codes (105 ValidationError, 109 ExtrasError, ...)
/// are all mapped to kExitUsage.
enum ExitStatus : int {
  kExitOk = 0,
  kExitFailed = 1,     ///< The replay failed while running: a library error or a failed self-check (a bug).
  kExitUsage = 2,      ///< Bad command line: unknown flag, bad value, conflict, or a flag that does not apply.
  kExitBadTrace = 3,   ///< The trace file cannot be read or is malformed (replay::TraceError).
  kExitTooLarge = 4,   ///< More host memory than the machine has (replay::MemoryError).
};

/// What decides whether a flag applies: the mode, whether --model-layers selects the hybrid replay, the host tier,
/// speculation and event publishing.
struct RunShape {
  Mode mode = Mode::kPrefix;
  bool hybrid = false;
  bool host_tier = false;
  bool speculation = false;
  bool publishing = false;
  bool recurrent = false;  ///< --model-layers has mamba layers
};

/// The mode as --mode spells it.
const char* mode_name_of(Mode mode) {
  return mode == Mode::kServe ? "serve" : mode == Mode::kFork ? "fork" : "prefix";
}

/// A flag that only some runs use, where it applies, and what about this run rules it out ("" = it applies). Every
/// flag given on the command line that does not apply is refused, naming the flag and the reason, rather than
/// silently ignored. Flags not listed apply to every run (trace, --mode, --capacity-tokens, --block-size, --hash,
/// --limit, --json, --no-progress); the cross-flag rules checked before this table (--preempt swap, --host-eviction
/// with --hash, retention priorities, fork, --model-layers) are listed under it in --help.
struct FlagRule {
  const char* flag;
  const char* applies_to;
  std::string (*rules_out)(const RunShape&);
};

/// Why `r` is not of mode `wanted` ("this is --mode fork"), or "" if it is.
std::string unless_mode(const RunShape& r, Mode wanted) {
  return r.mode == wanted ? std::string() : std::string("this is --mode ") + mode_name_of(r.mode);
}

/// Why `r` has no host tier, or "".
std::string needs_host_tier(const RunShape& r) {
  return r.host_tier ? "" : "there is no host tier (--host-capacity-tokens is 0 or not given)";
}

constexpr FlagRule kFlagRules[] = {
    {"--step-ms", "--mode serve", [](const RunShape& r) { return unless_mode(r, Mode::kServe); }},
    {"--max-num-seqs", "--mode serve", [](const RunShape& r) { return unless_mode(r, Mode::kServe); }},
    {"--max-num-batched-tokens", "--mode serve", [](const RunShape& r) { return unless_mode(r, Mode::kServe); }},
    {"--max-model-len", "--mode serve", [](const RunShape& r) { return unless_mode(r, Mode::kServe); }},
    {"--spec-tokens", "--mode serve", [](const RunShape& r) { return unless_mode(r, Mode::kServe); }},
    {"--spec-accept", "--mode serve with --spec-tokens > 0",
     [](const RunShape& r) {
       const std::string s = unless_mode(r, Mode::kServe);
       return !s.empty() || r.speculation ? s : std::string("--spec-tokens is 0 (no speculation)");
     }},
    {"--preempt", "--mode serve", [](const RunShape& r) { return unless_mode(r, Mode::kServe); }},
    {"--reserve", "--mode serve", [](const RunShape& r) { return unless_mode(r, Mode::kServe); }},
    {"--decode-priority", "--mode serve (blocks of generated tokens)",
     [](const RunShape& r) {
       return r.mode == Mode::kServe ? std::string()
                                     : unless_mode(r, Mode::kServe) + ", whose sequences generate no tokens";
     }},
    {"--n", "--mode fork", [](const RunShape& r) { return unless_mode(r, Mode::kFork); }},
    {"--offload", "runs with a host tier (--host-capacity-tokens > 0)", needs_host_tier},
    {"--host-eviction", "runs with a host tier (--host-capacity-tokens > 0)", needs_host_tier},
    {"--kv-bytes-per-token", "runs with a host tier (the bytes copied between tiers)",
     needs_host_tier},
    {"--publish-wait-ms", "runs with --publish-events",
     [](const RunShape& r) { return r.publishing ? std::string() : std::string("--publish-events is not given"); }},
    {"--model-name", "runs with --publish-events",
     [](const RunShape& r) { return r.publishing ? std::string() : std::string("--publish-events is not given"); }},
    {"--pod-id", "runs with --publish-events",
     [](const RunShape& r) { return r.publishing ? std::string() : std::string("--publish-events is not given"); }},
    {"--topic", "runs with --publish-events",
     [](const RunShape& r) { return r.publishing ? std::string() : std::string("--publish-events is not given"); }},
    {"--publish-connect", "runs with --publish-events",
     [](const RunShape& r) { return r.publishing ? std::string() : std::string("--publish-events is not given"); }},
    {"--publish-linger-ms", "runs with --publish-events",
     [](const RunShape& r) { return r.publishing ? std::string() : std::string("--publish-events is not given"); }},
    {"--state-bytes", "--model-layers with mamba layers",
     [](const RunShape& r) { return r.recurrent ? std::string() : std::string("--model-layers has no mamba layers"); }},
    {"--layer-kv-bytes", "--model-layers with mamba layers",
     [](const RunShape& r) { return r.recurrent ? std::string() : std::string("--model-layers has no mamba layers"); }},
    {"--checkpoint-intervals", "--model-layers with mamba layers",
     [](const RunShape& r) { return r.recurrent ? std::string() : std::string("--model-layers has no mamba layers"); }},
    {"--check", "runs without --model-layers",
     [](const RunShape& r) {
       return r.hybrid ? std::string("the hybrid replay (--model-layers) has no block-count cross-check") : "";
     }},
    {"--progress", "runs without --model-layers",
     [](const RunShape& r) {
       return r.hybrid ? std::string("the hybrid replay (--model-layers) draws no progress line") : "";
     }},
};

/// "Flags that apply to some runs only" for --help, from kFlagRules and the cross-flag rules main() checks first.
std::string flag_rules_help() {
  std::string text = "Flags that apply to some runs only (given anywhere else they are refused, exit status 2):\n";
  for (const FlagRule& rule : kFlagRules) {
    char line[160];
    std::snprintf(line, sizeof line, "  %-24s %s\n", rule.flag, rule.applies_to);
    text += line;
  }
  text +=
      "  --capacity-tokens        one value in serve and fork modes (a list in prefix mode)\n"
      "  --host-capacity-tokens   > 0: prefix or serve mode (--model-layers: no mamba, no full@P)\n"
      "  --preempt swap           with a host tier\n"
      "  --eviction               other than lru: prefix or serve mode (--model-layers: no mamba, no full@P)\n"
      "  --head-priority          with --eviction priority (as --decode-priority)\n"
      "  --host-eviction          other than --eviction's: with --hash sha256; --model-layers: serve mode\n"
      "  --publish-events         runs without mamba layers or coarse pages (full@P) in --model-layers\n"
      "  --model-layers           --mode serve or prefix; mamba layers or coarse pages (full@P): prefix mode,\n"
      "                           LRU, no host tier, no published events\n\n";
  return text;
}

/// Print a command-line error as CLI11 does and return the exit status: 0 for --help, kExitUsage otherwise.
int usage_exit(const CLI::App& app, const CLI::Error& e) {
  return app.exit(e) == 0 ? kExitOk : kExitUsage;
}

// ---- argument validation: every number is checked as typed, and every size against the machine, before anything
// large is allocated.

/// A number that is finite and > 0 ("nan", "inf", "-3" and "0" are refused, naming the value).
CLI::Validator positive_finite() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return "\"" + s + "\" is not a number";
        if (!std::isfinite(v) || !(v > 0)) return s + " must be a finite number > 0";
        return {};
      },
      "NUMBER > 0");
}

/// A number that is finite and >= 0 ("nan", "inf" and "-3" are refused, naming the value).
CLI::Validator nonnegative_finite() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return "\"" + s + "\" is not a number";
        if (!std::isfinite(v) || !(v >= 0)) return s + " must be a finite number >= 0";
        return {};
      },
      "NUMBER >= 0");
}

/// A whole number >= 0 written with digits only: "-1" is refused (CLI11 would read it as SIZE_MAX).
CLI::Validator whole_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        std::uint64_t v = 0;
        const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size()) {
          return s + " is not a whole number >= 0" + (ec == std::errc::result_out_of_range ? " below 2^64" : "");
        }
        return {};
      },
      "UINT");
}

/// A probability: a finite number in [0, 1] ("nan", "1.5" and "-0.1" are refused, naming the value).
CLI::Validator probability() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return "\"" + s + "\" is not a number";
        if (!(v >= 0.0 && v <= 1.0)) return s + " must be a probability in [0, 1]";
        return {};
      },
      "PROBABILITY");
}

std::string format_number(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

/// Usable blocks of a pool of `capacity` tokens (as replay::usable_blocks_for computes them), or 0 if that does not
/// fit 32-bit block ids.
std::uint64_t pool_blocks(double capacity, std::uint32_t block_size) {
  const double blocks = std::floor(capacity / block_size);
  return blocks >= static_cast<double>(std::numeric_limits<std::uint32_t>::max()) ? 0 : static_cast<std::uint64_t>(blocks);
}

/// The replay's host memory before the trace is read: the pools (and serve's pool-sized slot mapping). Returns it.
std::uint64_t check_pool_memory(const replay::Options& opt, Mode mode, std::uint64_t available) {
  std::uint64_t needed = 0;
  std::string what = "--capacity-tokens";
  for (const double capacity : opt.capacity_tokens) {
    const std::uint64_t blocks = pool_blocks(capacity, opt.block_size);
    if (blocks == 0) continue;  // usable_blocks_for explains it (no block, or more than 2^32 - 1)
    needed += blocks * replay::kHostBytesPerBlock;
    if (mode == Mode::kServe) needed += blocks * opt.block_size * sizeof(std::int64_t);
    what += " " + format_number(capacity) + " (" + std::to_string(blocks) + " blocks of " +
            std::to_string(opt.block_size) + " tokens)";
  }
  if (opt.host_capacity_tokens > 0) {  // one host tier per capacity (prefix) or one (serve), and serve's swap lists
    const std::uint64_t host = pool_blocks(opt.host_capacity_tokens, opt.block_size);
    if (host != 0) {
      if (mode == Mode::kPrefix) needed *= 2;  // each capacity's pool twice: without and with the tier
      const std::uint64_t tiers = mode == Mode::kPrefix ? opt.capacity_tokens.size() : 1;
      needed += tiers * host * replay::kHostBytesPerBlock;
      what += ", --host-capacity-tokens " + format_number(opt.host_capacity_tokens) + " (" + std::to_string(host) +
              " blocks" + (tiers > 1 ? " x " + std::to_string(tiers) + " capacities" : std::string()) + ")";
      if (mode == Mode::kServe) needed += pool_blocks(opt.capacity_tokens.front(), opt.block_size) * 4 * sizeof(std::int32_t);
    }
  }
  replay::check_host_memory(needed, available, what,
                            "use a smaller --capacity-tokens or --host-capacity-tokens, or a larger --block-size");
  return needed;
}

/// a * b, saturating at 2^64 - 1.
std::uint64_t saturating_mul(std::uint64_t a, std::uint64_t b) {
  return b != 0 && a > std::numeric_limits<std::uint64_t>::max() / b ? std::numeric_limits<std::uint64_t>::max() : a * b;
}

/// The replay's host memory for the trace's requests (synthesized prompts, token copies, metadata buffers sized by
/// the longest request) on top of `pool_bytes`, and the numbers that depend on the trace.
void check_trace_sizes(const replay::Trace& trace, const replay::Options& opt, Mode mode, std::uint64_t pool_bytes,
                       std::uint64_t available) {
  const replay::LongestRequest longest = replay::longest_request(trace);
  const std::uint64_t usable = pool_blocks(opt.capacity_tokens.front(), opt.block_size);
  const std::uint64_t per_token = replay::kHostBytesPerRequestToken;
  std::uint64_t needed = 0;
  switch (mode) {
    case Mode::kPrefix: {  // every prompt is synthesized, and the metadata buffers fit the longest one
      std::uint64_t max_input = 0;
      for (const replay::Request& r : trace.requests) max_input = std::max<std::uint64_t>(max_input, r.input_tokens);
      needed = saturating_mul(max_input, per_token);
      break;
    }
    case Mode::kServe: {  // requests longer than max_model_len or the pool are rejected before synthesis; the
                          // indices buffer holds max_num_seqs rows of up to max_model_len tokens
      const std::uint64_t max_len = opt.max_model_len != 0 ? opt.max_model_len : longest.tokens;
      needed = saturating_mul(std::min({longest.tokens, max_len, usable * opt.block_size}), per_token) +
               saturating_mul(saturating_mul(opt.max_num_seqs, std::min(usable, (max_len + opt.block_size - 1) / opt.block_size)),
                              sizeof(std::int32_t));
      break;
    }
    case Mode::kFork:  // the metadata buffers fit the longest request in every branch
      needed = saturating_mul(saturating_mul(longest.tokens, opt.num_branches), per_token);
      break;
  }
  replay::check_host_memory(
      needed > std::numeric_limits<std::uint64_t>::max() - pool_bytes ? needed : needed + pool_bytes, available,
      "the pool with request " + std::to_string(longest.index) + " of " + trace.path.string() + " (" +
          std::to_string(longest.tokens) + " prompt + output tokens" +
          (mode == Mode::kFork ? ", " + std::to_string(opt.num_branches) + " branches" : "") +
          (mode == Mode::kServe ? ", --max-num-seqs " + std::to_string(opt.max_num_seqs) : "") + ")",
      "replay fewer requests with --limit, remove the request from the trace, or use a smaller pool");
  if (mode == Mode::kServe) {
    // The seq_lens of the batch metadata are int32: no sequence may grow past 2^31 - 1 tokens.
    constexpr std::uint64_t kMaxSeqTokens = std::numeric_limits<std::int32_t>::max();
    if (opt.max_model_len == 0 && longest.tokens > kMaxSeqTokens) {
      throw CLI::ValidationError("--max-model-len", "the default, the trace's longest request (request " +
                                                        std::to_string(longest.index) + ", " +
                                                        std::to_string(longest.tokens) +
                                                        " tokens), exceeds 2^31 - 1 tokens; pass a smaller one");
    }
    // Simulated time: the last arrival's step number must stay exact in a double and fit 64 bits.
    const double last_ms = trace.requests.back().arrival_ms;
    if (last_ms / opt.step_ms >= 9007199254740992.0) {  // 2^53
      throw CLI::ValidationError("--step-ms", format_number(opt.step_ms) + " makes the last arrival (" +
                                                  format_number(last_ms) + " ms) step " +
                                                  format_number(last_ms / opt.step_ms) + ", beyond 2^53 steps");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "pagedkv-replay: replay an LLM-serving trace through pagedkv's KVCacheManager and report prefix-cache hit\n"
      "ratios, KV memory utilization, sharing savings and the library's own cost."};
  app.footer(flag_rules_help() + kFooter);

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
      ->check(positive_finite());
  app.add_option("--block-size", opt.block_size, "Tokens per KV block")
      ->check(CLI::Range(1U, 1U << 16))
      ->capture_default_str();
  app.add_option("--hash", hash_name, "Block-hash policy: sha256 (SHA-256, cryptographic) or xxh3 (XXH3-128, fast)")
      ->check(CLI::IsMember({"sha256", "xxh3"}))
      ->capture_default_str();
  app.add_option("--step-ms", opt.step_ms, "serve: simulated milliseconds per engine step")
      ->check(positive_finite())
      ->capture_default_str();
  app.add_option("--max-num-seqs", opt.max_num_seqs, "serve: most sequences running at once")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 20))
      ->capture_default_str();
  app.add_option("--max-model-len", opt.max_model_len,
                 "serve: longest request in tokens (prompt + output); the contiguous baseline reserves this many "
                 "slots per sequence and longer requests are rejected. Default: the trace's longest request")
      ->check(whole_number())
      ->check(CLI::Range(std::size_t{1}, std::size_t{std::numeric_limits<std::int32_t>::max()}));
  app.add_option("--max-num-batched-tokens", opt.max_num_batched_tokens,
                 "serve: token budget per engine step (chunked prefill: a prompt is computed in chunks of what is "
                 "left of it after the running sequences' decodes); 0 = no budget (whole prompts in one step)")
      ->check(whole_number())
      ->check(CLI::Range(std::size_t{0}, std::size_t{std::numeric_limits<std::int32_t>::max()}))
      ->capture_default_str();
  app.add_option("--spec-tokens", opt.spec_tokens,
                 "serve: speculative decoding, draft tokens per decode step (lookahead slots reserved for them; the "
                 "rejected ones are rewound); 0 = off")
      ->check(whole_number())
      ->check(CLI::Range(std::size_t{0}, std::size_t{64}))
      ->capture_default_str();
  app.add_option("--spec-accept", opt.spec_accept,
                 "serve, with --spec-tokens: probability that each draft is accepted, drafts verified in order until "
                 "the first rejection")
      ->check(probability())
      ->capture_default_str();
  std::string offload_name = "write-back", eviction_name = "lru", host_eviction_name, preempt_name = "recompute";
  app.add_option("--host-capacity-tokens", opt.host_capacity_tokens,
                 "Host-memory tier size in tokens (e.g. 5e7); 0 = no host tier. prefix: each capacity is replayed "
                 "twice side by side, without and with the tier (tier_time_ratio: the library time it costs); "
                 "serve: one pool with the tier")
      ->check(nonnegative_finite())
      ->capture_default_str();
  app.add_option("--offload", offload_name,
                 "With a host tier: none (the tier only takes swapped-out sequences), write-back (copy a cached "
                 "block to the tier when the GPU pool evicts it) or write-through (copy every block once registered)")
      ->check(CLI::IsMember({"none", "write-back", "write-through"}))
      ->capture_default_str();
  app.add_option("--eviction", eviction_name,
                 "Eviction policy of the GPU pool (and of the host tier unless --host-eviction): lru, slru (segmented LRU: "
                 "one hit buys protection) or priority (TensorRT-LLM retention priorities, LRU per level)")
      ->check(CLI::IsMember({"lru", "slru", "priority"}))
      ->capture_default_str();
  app.add_option("--host-eviction", host_eviction_name,
                 "Eviction policy of the host tier: lru, slru or priority. Default: --eviction's (a different one "
                 "needs --hash sha256)")
      ->check(CLI::IsMember({"lru", "slru", "priority"}));
  int decode_priority = -1;
  std::string head_priority;
  app.add_option("--decode-priority", decode_priority,
                 "With --eviction priority: retention priority (0..100, default 35) of blocks holding only generated "
                 "tokens (TensorRT-LLM's decode_retention_priority), e.g. 10 so prompt blocks outlive them")
      ->check(CLI::Range(0, 100));
  app.add_option("--head-priority", head_priority,
                 "With --eviction priority: TOKENS:PRIORITY, retention priority of the blocks of each prompt's first "
                 "TOKENS tokens (a token range of TensorRT-LLM's KvCacheRetentionConfig), e.g. 2048:80 so shared "
                 "heads (system prompts) outlive the rest");
  app.add_option("--kv-bytes-per-token", opt.kv_bytes_per_token,
                 "KV bytes per token over all layers, for the bytes copied between tiers (default: Llama-3.1-8B in "
                 "bf16, 32 layers x 2 x 8 KV heads x 128 x 2 bytes)")
      ->check(whole_number())
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 32))
      ->capture_default_str();
  std::string reserve_name;
  app.add_option("--reserve", reserve_name,
                 "serve: when a prompt's slots are reserved: prompt (all of them at admission, the default without "
                 "--model-layers) or chunk (each prefill chunk just before its step, as vLLM V1 allocates; the "
                 "default with --model-layers, where a sliding-window group then holds its window and a chunk)")
      ->check(CLI::IsMember({"prompt", "chunk"}));
  app.add_option("--preempt", preempt_name,
                 "serve: how a running sequence is preempted when a block is missing: recompute (free it; "
                 "re-admitted later, its KV recomputed) or swap (copy its blocks to the host tier and resume it by "
                 "copying them back; needs --host-capacity-tokens; a sequence still prefilling, or one the host "
                 "tier has no room for, is preempted by recompute)")
      ->check(CLI::IsMember({"recompute", "swap"}))
      ->capture_default_str();
  app.add_option("--n", opt.num_branches, "fork: parallel samples (branches) per request")
      ->check(CLI::Range(std::size_t{1}, std::size_t{256}))
      ->capture_default_str();
  app.add_option("--limit", limit, "Replay only the first N requests (0 = all)")
      ->check(whole_number())
      ->capture_default_str();
  app.add_flag("--json", json, "Print one JSON object per configuration per line instead of a table");
  app.add_flag("--progress,!--no-progress", opt.progress,
               "Show a progress line on stderr for runs longer than a second (default: when stderr is a terminal)");
  app.add_flag("--miss-causes", opt.miss_causes,
               "prefix: count why each admission's prefix hit ended (CacheConfig::count_miss_causes, with an eviction "
               "history of 4x the pool's blocks) and report the shares as miss_* fields");
  app.add_flag("--check", opt.check,
               "Cross-check the derived block and slot counts against the block tables every step (slow)");
  app.add_option("--publish-events", opt.publish_events,
                 "Publish the replay's KV events as it runs on this ZeroMQ endpoint, in vLLM's format (topic "
                 "kv-events unless --topic / --model-name, replay socket on a free port, both printed on stderr; "
                 "bound unless --publish-connect; prefix mode: the first "
                 "capacity's pool), e.g. tcp://127.0.0.1:5557 (docs/events-wire.md)");
  std::string model_layers;
  app.add_option("--model-layers", model_layers,
                 "serve / prefix: a hybrid model's layers as KV-cache groups, e.g. \"full:12,swa4096:24\" (kinds "
                 "full, swa<W>, chunk<C>): replays the manager with those groups against the same layers all full attention "
                 "on the same pool, one row each; with mamba layers (e.g. \"full:12,mamba:36\", prefix mode): all "
                 "attention vs vLLM's align mode vs checkpoints every --checkpoint-intervals; with coarse pages "
                 "(full@P, e.g. \"full:12,full@64:12\", prefix mode): also every group at the common multiple of "
                 "the page sizes, vLLM's rule (docs/groups.md)");
  replay::HybridOptions recurrent_opt;
  std::string checkpoint_intervals;
  app.add_option("--state-bytes", recurrent_opt.state_bytes,
                 "With mamba layers: one recurrent layer's state in bytes (default: Qwen3-Next's gated delta net, "
                 "32 heads x 128 x 128 x bf16)")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 34))
      ->capture_default_str();
  app.add_option("--layer-kv-bytes", recurrent_opt.layer_kv_bytes,
                 "With mamba layers: K + V bytes of one token in one attention layer (default: Qwen3-Next, 2 KV heads "
                 "x 256 x 2 x bf16)")
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 24))
      ->capture_default_str();
  app.add_option("--checkpoint-intervals", checkpoint_intervals,
                 "With mamba layers: comma-separated checkpoint intervals in tokens, one pair of rows each (rounded up "
                 "to the unified block size); default 512,1024,2048");
  app.add_option("--publish-wait-ms", opt.publish_wait_ms,
                 "With --publish-events: wait this long after binding, so subscribers can connect first")
      ->check(CLI::Range(0, 600000))
      ->capture_default_str();
  app.add_option("--publish-linger-ms", replay::publish_flags().linger_ms,
                 "With --publish-events: after the last batch, answer replay and snapshot requests for up to this "
                 "long (until the first snapshot request), so a subscriber can compare its index with the final cache")
      ->check(CLI::Range(0, 600000))
      ->capture_default_str();
  const auto no_at = CLI::Validator(
      [](std::string& v) { return v.find('@') == std::string::npos ? std::string() : "\"" + v + "\" contains '@'"; },
      "TEXT without '@'");
  app.add_option("--model-name", replay::publish_flags().model_name,
                 "With --publish-events: the model name routers know; the topic becomes llm-d's "
                 "kv@<pod-id>@<model-name> (unless --topic is given)")
      ->check(no_at);
  app.add_option("--pod-id", replay::publish_flags().pod_id,
                 "With --publish-events: the pod id of llm-d's topic (default: the host name)")
      ->check(no_at);
  app.add_option("--topic", replay::publish_flags().topic,
                 "With --publish-events: the topic frame of every message (default kv-events, or llm-d's form with "
                 "--model-name)");
  app.add_flag("--publish-connect", replay::publish_flags().connect,
               "With --publish-events: connect the PUB socket to that endpoint (a router that binds one SUB socket "
               "for its fleet: llm-d's centralized mode) instead of binding it");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return usage_exit(app, e);
  }

  const Mode mode = mode_name == "serve" ? Mode::kServe : mode_name == "fork" ? Mode::kFork : Mode::kPrefix;
  opt.hash = hash_name == "xxh3" ? replay::HashKind::kXxh3 : replay::HashKind::kSha256;
  const auto eviction_kind = [](const std::string& name) {
    return name == "slru" ? replay::EvictionKind::kSlru
                          : name == "priority" ? replay::EvictionKind::kPriority : replay::EvictionKind::kLru;
  };
  opt.eviction = eviction_kind(eviction_name);
  opt.host_eviction = host_eviction_name.empty() ? opt.eviction : eviction_kind(host_eviction_name);
  opt.offload = offload_name == "none"         ? pagedkv::OffloadPolicy::kNone
                : offload_name == "write-through" ? pagedkv::OffloadPolicy::kWriteThrough
                                                  : pagedkv::OffloadPolicy::kWriteBack;
  opt.preempt = preempt_name == "swap" ? pagedkv::PreemptMode::kSwap : pagedkv::PreemptMode::kRecompute;
  opt.reserve = reserve_name == "chunk" || (reserve_name.empty() && !model_layers.empty()) ? replay::ReserveKind::kChunk
                                                                                          : replay::ReserveKind::kPrompt;
  try {
    if (opt.host_eviction != opt.eviction && opt.hash != replay::HashKind::kSha256) {
      throw CLI::ValidationError("--host-eviction", host_eviction_name + " differs from --eviction " + eviction_name +
                                                        ": the replay builds a different host-tier policy with "
                                                        "--hash sha256 only");
    }
    if ((decode_priority >= 0 || !head_priority.empty()) && opt.eviction != replay::EvictionKind::kPriority) {
      throw CLI::ValidationError(decode_priority >= 0 ? "--decode-priority" : "--head-priority",
                                 "retention priorities need --eviction priority (other policies ignore them)");
    }
    if (decode_priority >= 0 || !head_priority.empty()) {
      auto config = std::make_shared<pagedkv::RetentionConfig>();
      std::string label;
      if (!head_priority.empty()) {
        const auto colon = head_priority.find(':');
        std::uint64_t tokens = 0, priority = 0;
        const auto parse = [](std::string_view v, std::uint64_t& out) {
          const auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
          return !v.empty() && ec == std::errc{} && ptr == v.data() + v.size();
        };
        if (colon == std::string::npos || !parse(std::string_view(head_priority).substr(0, colon), tokens) ||
            !parse(std::string_view(head_priority).substr(colon + 1), priority) || tokens == 0 ||
            priority > pagedkv::kMaxRetentionPriority) {
          throw CLI::ValidationError("--head-priority", "\"" + head_priority +
                                                            "\" is not TOKENS:PRIORITY with TOKENS >= 1 and PRIORITY "
                                                            "in [0, 100]");
        }
        config->ranges.push_back({0, static_cast<std::size_t>(tokens), static_cast<std::uint8_t>(priority), std::nullopt});
        label = "head:" + head_priority;
      }
      if (decode_priority >= 0) {
        config->decode_priority = static_cast<std::uint8_t>(decode_priority);
        label += std::string(label.empty() ? "" : ",") + "decode:" + std::to_string(decode_priority);
      }
      pagedkv::validate_retention(*config, "retention");
      opt.retention = std::move(config);
      opt.retention_label = label;
    }
    if (opt.preempt == pagedkv::PreemptMode::kSwap && mode != Mode::kServe) {
      throw CLI::ValidationError("--preempt", "swap applies to serve mode only");
    }
    if (opt.preempt == pagedkv::PreemptMode::kSwap && !(opt.host_capacity_tokens > 0)) {
      throw CLI::ValidationError("--preempt", "swap needs a host tier: pass --host-capacity-tokens");
    }
    if (mode == Mode::kFork && (opt.host_capacity_tokens > 0 || opt.eviction != replay::EvictionKind::kLru)) {
      throw CLI::ValidationError("--mode", "fork replays an LRU pool without a host tier (no --host-capacity-tokens, "
                                           "--eviction lru)");
    }
    if (opt.host_capacity_tokens > 0) (void)replay::usable_blocks_for(opt.host_capacity_tokens, opt.block_size,
                                                                      "--host-capacity-tokens");
    if (opt.capacity_tokens.empty()) {
      opt.capacity_tokens = mode == Mode::kPrefix ? std::vector<double>{1e6, 3e6, 1e7, 5e7} : std::vector<double>{1e6};
    }
    if (mode != Mode::kPrefix && opt.capacity_tokens.size() != 1) {
      throw CLI::ValidationError("--capacity-tokens", "serve and fork modes take a single capacity");
    }
    std::size_t num_groups = 0;
    bool recurrent = false;
    if (!model_layers.empty()) {
      if (mode == Mode::kFork) throw CLI::ValidationError("--model-layers", "takes --mode serve or prefix");
      bool coarse = false;
      try {
        const replay::ModelLayers parsed = replay::parse_model_layers(model_layers);
        num_groups = parsed.groups.size();
        recurrent = std::any_of(parsed.groups.begin(), parsed.groups.end(), [](const auto& g) { return g.recurrent(); });
        coarse = std::any_of(parsed.groups.begin(), parsed.groups.end(), [](const auto& g) { return g.block_size != 0; });
      } catch (const std::invalid_argument& e) {
        throw CLI::ValidationError("--model-layers", e.what());
      }
      if (recurrent && mode != Mode::kPrefix) {
        throw CLI::ValidationError("--model-layers", "with mamba layers replays --mode prefix (hit ratios)");
      }
      if (coarse && mode != Mode::kPrefix) {
        throw CLI::ValidationError("--model-layers", "with coarse pages (full@P) replays --mode prefix (hit ratios)");
      }
      if ((recurrent || coarse) && (opt.eviction != replay::EvictionKind::kLru || !opt.publish_events.empty())) {
        throw CLI::ValidationError("--model-layers", std::string("with ") + (recurrent ? "mamba layers" : "coarse pages") +
                                                         " compares pools side by side on LRU without published "
                                                         "events (--eviction lru, no --publish-events)");
      }
      if (coarse && opt.host_capacity_tokens > 0) {  // the manager's own refusal (cache_config.hpp), said early
        throw CLI::ValidationError("--model-layers", "a group with coarse pages does not yet work with the host tier "
                                                     "(--host-capacity-tokens; the manager refuses it, issue 20)");
      }
      if (recurrent && opt.host_capacity_tokens > 0) {
        throw CLI::ValidationError("--host-capacity-tokens", "with mamba layers the replay compares checkpoint "
                                                             "policies on pools without a host tier");
      }
      if (mode == Mode::kPrefix && opt.host_eviction != opt.eviction) {
        throw CLI::ValidationError("--host-eviction", "the hybrid prefix replay's host tier takes --eviction's "
                                                      "policy (a different one: --mode serve)");
      }
    }
    // Every capacity must hold a block and fit 32-bit block ids (the hybrid pool: one block per group per
    // block_size tokens, below 2^31 blocks), checked here rather than when the replay builds its pool.
    for (const double c : opt.capacity_tokens) {
      const std::size_t blocks = replay::usable_blocks_for(c, opt.block_size);
      if (num_groups > 1 && static_cast<double>(blocks) * static_cast<double>(num_groups) >= 2147483647.0) {
        throw CLI::ValidationError("--capacity-tokens", format_number(c) + " gives " + std::to_string(blocks) +
                                                            " blocks per group x " + std::to_string(num_groups) +
                                                            " groups, more than 2^31 - 1 blocks");
      }
    }
    // A flag this run does not use is refused, never ignored (kFlagRules).
    const RunShape shape{mode, !model_layers.empty(), opt.host_capacity_tokens > 0, opt.spec_tokens > 0,
                         !opt.publish_events.empty(), recurrent};
    for (const FlagRule& rule : kFlagRules) {
      if (app.count(rule.flag) == 0) continue;
      if (std::string_view(rule.flag) == "--progress" && !opt.progress) continue;  // --no-progress always applies
      const std::string why = rule.rules_out(shape);
      if (!why.empty()) {
        throw CLI::ValidationError(rule.flag, std::string("applies only to ") + rule.applies_to + ", but " + why +
                                                  " (refused rather than ignored)");
      }
    }
    const std::uint64_t available = replay::host_memory_available_bytes();
    // A hybrid run's pool has one block per group per block_size tokens of capacity, and one prefix index per group
    // (two managers, one at a time): counted as num_groups^2 single-group pools, an upper bound.
    replay::Options sized = opt;
    if (num_groups > 1) {
      for (double& c : sized.capacity_tokens) c *= static_cast<double>(num_groups * num_groups);
      sized.host_capacity_tokens *= static_cast<double>(num_groups * num_groups);
    }
    const std::uint64_t pool_bytes = check_pool_memory(sized, mode, available);
    const std::filesystem::path path = trace_arg.empty() ? default_trace_path() : std::filesystem::path(trace_arg);
    const replay::Trace trace = replay::load_trace(path, limit);
    check_trace_sizes(trace, opt, mode, pool_bytes, available);
    if (!model_layers.empty()) {
      replay::HybridOptions h;
      h.model_layers = model_layers;
      h.block_size = opt.block_size;
      h.xxh3 = opt.hash == replay::HashKind::kXxh3;
      h.mode = mode == Mode::kServe ? "serve" : "prefix";
      h.base = opt;
      h.base.progress = false;  // (--progress is refused with --model-layers)
      h.json = json;
      h.state_bytes = recurrent_opt.state_bytes;
      h.layer_kv_bytes = recurrent_opt.layer_kv_bytes;
      if (!checkpoint_intervals.empty()) {
        h.checkpoint_intervals.clear();
        std::size_t pos = 0;
        while (pos <= checkpoint_intervals.size()) {
          const std::size_t end = std::min(checkpoint_intervals.find(',', pos), checkpoint_intervals.size());
          const std::string item = checkpoint_intervals.substr(pos, end - pos);
          if (item.empty() || item.size() > 9 || item.find_first_not_of("0123456789") != std::string::npos ||
              std::stoul(item) == 0) {
            throw CLI::ValidationError("--checkpoint-intervals", "item \"" + item + "\" is not a positive number "
                                                                 "of tokens below 10^9");
          }
          h.checkpoint_intervals.push_back(static_cast<std::uint32_t>(std::stoul(item)));
          pos = end + 1;
        }
      }
      for (const double c : opt.capacity_tokens) {
        h.capacity_tokens = c;
        replay::run_hybrid_serve(trace, h, std::cout);
      }
      return kExitOk;
    }

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
    return kExitOk;
  } catch (const CLI::Error& e) {
    return usage_exit(app, e);
  } catch (const replay::OptionError& e) {  // a value found unusable after parsing (it names the flag)
    return usage_exit(app, CLI::ValidationError(e.what()));
  } catch (const replay::TraceError& e) {
    std::fprintf(stderr, "pagedkv-replay: bad trace: %s\n", e.what());
    return kExitBadTrace;
  } catch (const replay::MemoryError& e) {
    std::fprintf(stderr, "pagedkv-replay: too large for this machine: %s\n", e.what());
    return kExitTooLarge;
  } catch (const pagedkv::Error& e) {
    std::fprintf(stderr, "pagedkv-replay: library error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pagedkv-replay: error: %s\n", e.what());
  }
  return kExitFailed;
}
