// examples/replay/trace.hpp: request traces (Mooncake JSONL, Azure LLM CSV) and the synthetic token ids that
// stand in for their (unpublished) text.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <vector>

#include <pagedkv/config.hpp>

namespace replay {

/// Tokens per `hash_ids` entry in the Mooncake traces (Qin et al., FAST '25, Appendix A).
inline constexpr std::size_t kMooncakeBlockTokens = 512;

/// The file formats `load_trace` recognises (from the file's content, not its name).
enum class TraceFormat {
  kMooncakeJsonl,  ///< One JSON object per line: timestamp (ms), input_length, output_length, hash_ids.
  kAzureCsv,       ///< CSV with header TIMESTAMP,ContextTokens,GeneratedTokens (Splitwise, ISCA '24).
};

/// Human-readable name of a format ("mooncake-jsonl", "azure-csv").
[[nodiscard]] const char* to_string(TraceFormat format) noexcept;

/// One request of a trace.
struct Request {
  double arrival_ms = 0.0;               ///< Arrival time, ms after the trace's first request.
  std::uint32_t input_tokens = 0;        ///< Prompt length (>= 1).
  std::uint32_t output_tokens = 0;       ///< Tokens to generate.
  std::vector<std::uint64_t> hash_ids;   ///< Mooncake only: one prefix-hash id per 512-token prompt block.
};

/// A whole trace, in arrival order.
struct Trace {
  std::filesystem::path path;
  TraceFormat format = TraceFormat::kMooncakeJsonl;
  std::vector<Request> requests;
  /// max(input_tokens + output_tokens) over the requests (the default max model length).
  [[nodiscard]] std::size_t max_total_tokens() const noexcept;
  /// Sum of input_tokens over the requests.
  [[nodiscard]] std::uint64_t total_input_tokens() const noexcept;
};

/// A malformed or unreadable trace file. `what()` names the file and, where it applies, the 1-based line.
/// pagedkv-replay exits with status 3 on it.
class TraceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A command-line value the replay cannot use, found after parsing (a capacity holding no block, an endpoint that
/// cannot be bound). `what()` starts with the flag. pagedkv-replay exits with status 2 on it, as on any bad option.
class OptionError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

/// A replay that would need more host memory than the machine has (check_host_memory). pagedkv-replay exits with
/// status 4 on it, found before the pools are allocated (the trace's requests: right after the trace is read).
class MemoryError : public std::length_error {
 public:
  using std::length_error::length_error;
};

/// The longest line a trace may have, in bytes (4 MiB). Reading stops there, so an input without line breaks
/// (/dev/zero, a binary file) is refused after reading 4 MiB, in bounded memory, instead of growing one line
/// until memory runs out. The bundled traces' longest line is 2.7 KB; 4 MiB holds a Mooncake line of over 200,000
/// hash_ids (a prompt of 100M+ tokens), and the 1 MiB fields of tests/fuzz/replay_input_tests.cpp.
inline constexpr std::size_t kMaxTraceLineBytes = std::size_t{4} << 20;

/// Read the trace at `path`, detecting its format from the first non-empty line (a JSON object: Mooncake; a CSV
/// header with TIMESTAMP, ContextTokens and GeneratedTokens: Azure). Keeps at most `limit` requests (0 = all).
/// Arrival times are relative to the first request and must never decrease; every prompt has at least one token;
/// a Mooncake line has exactly the hash_ids that cover its prompt, ceil(input_length / 512). Too few cannot be
/// replayed; too many are refused too, not ignored: the format gives one id per 512-token block of the prompt (the
/// bundled traces carry exactly that many on every line), so an extra id means the line's input_length and hash_ids disagree (a
/// truncated prompt, or ids hashed over blocks of another size than 512 tokens, which would make the replay's
/// synthesized prompts share the wrong prefixes), and replaying it would report hit ratios of a different trace.
/// Throws TraceError ("<file>:<line>: <what is wrong>", or "<file>: <what>" before the first line) on a directory
/// ("is a directory"), an unopenable or unreadable file, a line longer than kMaxTraceLineBytes, or malformed content.
[[nodiscard]] Trace load_trace(const std::filesystem::path& path, std::size_t limit = 0);

/// `load_trace` over an open stream: `name` is the file name used in messages and stored in Trace::path.
/// Throws TraceError as load_trace does (the fuzz target tests/fuzz/fuzz_trace.cpp calls this).
[[nodiscard]] Trace parse_trace(std::istream& in, const std::filesystem::path& name, std::size_t limit = 0);

// ---------------------------------------------------------------------------------------------------------------
// What a replay needs from the machine, checked before anything large is allocated.

/// Host bytes the cache manager keeps per pool block: allocator, prefix index and its hash map. An upper bound of
/// the 97 B per block measured for a manager of 1e6 blocks (docs/design.md, "Host metadata per block").
inline constexpr std::uint64_t kHostBytesPerBlock = 128;

/// Host bytes per token of a request the replay holds: its synthesized prompt (4), the manager's copy of its token
/// ids (4), its pending slots (8), the slot-mapping buffer (8), and per block its id, block-table and hash entries
/// (at most 8 per token at block size 4). An upper bound; the modes hold at most a few requests' worth at once
/// besides the pool.
inline constexpr std::uint64_t kHostBytesPerRequestToken = 32;

/// The host memory this process can count on, in bytes: the smallest of the memory available now
/// (/proc/meminfo MemAvailable, else physical memory), the address-space and data-segment limits (RLIMIT_AS,
/// RLIMIT_DATA) and the cgroup v2 memory limit less its current usage. Never 0 (falls back to physical memory).
[[nodiscard]] std::uint64_t host_memory_available_bytes();

/// Throws MemoryError (a std::length_error) naming `what`, both sizes and the remedy when `needed_bytes` >
/// `available_bytes`:
/// "<what> needs about N GiB of host memory, but only M GiB are available (<hint>)".
void check_host_memory(std::uint64_t needed_bytes, std::uint64_t available_bytes, const std::string& what,
                       const std::string& hint);

/// The longest request of `trace` (prompt + output tokens) and its index, for messages.
struct LongestRequest {
  std::size_t index = 0;
  std::uint64_t tokens = 0;
};
[[nodiscard]] LongestRequest longest_request(const Trace& trace) noexcept;

/// SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014): one step
/// of the generator from state `z`, i.e. the standard finalizer applied to z + golden gamma.
[[nodiscard]] constexpr std::uint64_t splitmix64(std::uint64_t z) noexcept {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// Token j (0 <= j < 512) of Mooncake block `hash_id`: splitmix64(hash_id * 512 + j) & 0x7fffffff. Because the
/// trace's ids are prefix hashes (equal id = equal prefix), equal ids give equal token runs, and the library's
/// chained block hashes then see exactly the trace's sharing, at any block size.
[[nodiscard]] constexpr pagedkv::TokenId mooncake_token(std::uint64_t hash_id, std::size_t j) noexcept {
  return static_cast<pagedkv::TokenId>(splitmix64(hash_id * kMooncakeBlockTokens + j) & 0x7fffffffULL);
}

/// The prompt token ids of request `index` of `trace`, written to `out` (resized to input_tokens).
/// Mooncake: the concatenation of its blocks' tokens (mooncake_token), truncated to input_length.
/// Azure (no prefix information): tokens unique to the request, splitmix64 of (request << 32 | position) in a
/// separate input domain (bit 63 set), so they never repeat across requests nor reproduce a Mooncake token run.
void synthesize_prompt(const Trace& trace, std::size_t index, std::vector<pagedkv::TokenId>& out);

/// The token a sequence generates at decode step `step` (0-based) of request `index`, branch `branch` (parallel
/// sampling; 0 for a single sequence): splitmix64 in a third input domain (bit 62 set), so generated tokens
/// are distinct per (request, branch, step) and never equal prompt tokens' runs. Deterministic, so a request
/// re-admitted after preemption regenerates the same tokens (and can hit its own cached blocks).
/// Preconditions: index < 2^30, branch < 256, step < 2^24.
[[nodiscard]] constexpr pagedkv::TokenId generated_token(std::size_t index, std::size_t branch,
                                                         std::size_t step) noexcept {
  const std::uint64_t key = (std::uint64_t{1} << 62) | (static_cast<std::uint64_t>(index) << 32) |
                            (static_cast<std::uint64_t>(branch) << 24) | static_cast<std::uint64_t>(step);
  return static_cast<pagedkv::TokenId>(splitmix64(key) & 0x7fffffffULL);
}

}  // namespace replay
