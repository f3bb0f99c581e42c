// examples/replay/modes.hpp: the three replay modes (prefix, serve, fork) and their shared options.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>

#include "report.hpp"
#include "trace.hpp"

namespace replay {

/// The block-hash policy of the manager (its `Hasher` template parameter).
enum class HashKind { kSha256, kXxh3 };

/// Command-line options shared by the modes (see main.cpp for their documentation and defaults).
struct Options {
  std::vector<double> capacity_tokens;  ///< KV pool capacities in tokens (prefix: one row each; others: one).
  std::uint32_t block_size = pagedkv::kDefaultBlockSize;
  HashKind hash = HashKind::kSha256;
  double step_ms = 25.0;              ///< serve: simulated time per engine step.
  std::size_t max_num_seqs = 256;     ///< serve: most sequences running at once.
  std::size_t max_model_len = 0;      ///< serve: longest request (prompt + output); 0 = the trace's longest.
  std::size_t max_num_batched_tokens = 8192;  ///< serve: token budget per step (chunked prefill); 0 = none.
  std::size_t spec_tokens = 0;        ///< serve: draft tokens per decode step (lookahead slots); 0 = no speculation.
  double spec_accept = 0.7;           ///< serve: probability that each draft is accepted (until the first rejection).
  std::size_t num_branches = 4;       ///< fork: parallel samples per request.
  bool progress = false;              ///< Show a progress line on stderr.
  bool check = false;                 ///< Cross-check derived block counts by brute force every step (slow).
  std::string publish_events;         ///< Publish KV events on this ZeroMQ endpoint (publish.hpp); "" = off.
  int publish_wait_ms = 0;            ///< Wait this long after binding it, for subscribers to connect.
};

/// Prefix-cache replay (Mooncake FAST '25, Fig. 9): requests one at a time in file order, prompt only; each is
/// admitted (lookup + allocation), its prefill step's metadata is built (which registers its full blocks in the
/// prefix index) and it is freed at once, so only the LRU prefix cache carries over. One row per
/// capacity in `opt.capacity_tokens`: hit_ratio = cached prompt tokens / prompt tokens of admitted requests
/// (requests needing more blocks than the pool are counted in `rejected` and left out), evictions, library time.
/// Pool: floor(capacity / block_size) usable blocks plus the null block.
[[nodiscard]] std::vector<Row> run_prefix(const Trace& trace, const Options& opt);

/// Continuous-batching replay in simulated time (vLLM V1-style scheduler: chunked prefill under a token budget,
/// optional speculative decoding with lookahead slots, recompute preemption), with a contiguous
/// max-length-reservation baseline simulated alongside on the same arrivals (Kwon et al., SOSP '23, Fig. 2).
/// Pool: opt.capacity_tokens.front() tokens. One row: kv_utilization, peak running, preemptions, hit_ratio (over
/// every admission, re-admissions after preemption included), prefill chunks per prompt, with speculation the
/// drafts, accepted drafts, wasted slot-steps (rejected drafts) and tokens per decode step; the baseline's figures
/// (prefixed contig_), simulated time, and library time: manager_seconds (all calls), ns_per_scheduled_token,
/// ns_per_seq_step (all calls per running sequence per step), admit_seconds (try_admit, i.e. prompt hashing and
/// allocation) and decode_ns_per_seq_step (the step path: appends, lookahead, build, commits, per running
/// sequence per step).
[[nodiscard]] Row run_serve(const Trace& trace, const Options& opt);

/// Parallel-sampling replay (Kwon et al., SOSP '23, sec. 6.3): each request is admitted, forked into
/// opt.num_branches branches after its prompt, every branch decodes its own tokens for output_length steps, then
/// all are freed; one request at a time. One row: peak and time-averaged blocks held with sharing (distinct
/// referenced blocks) against without (num_branches x each branch's own blocks), the saving, COW copies.
[[nodiscard]] Row run_fork(const Trace& trace, const Options& opt);

// ---------------------------------------------------------------------------------------------------------------
// Helpers shared by the mode implementations.

/// Name of a hash policy as the command line spells it.
[[nodiscard]] const char* to_string(HashKind hash) noexcept;

/// Call `f(std::type_identity<Hasher>{})` with the hasher type selected by `hash`: the one runtime -> compile-time
/// dispatch point (both policies are instantiated for every mode).
template <class F>
decltype(auto) with_hasher(HashKind hash, F&& f) {
  switch (hash) {
    case HashKind::kXxh3: return f(std::type_identity<pagedkv::Xxh3Hasher>{});
    case HashKind::kSha256: break;
  }
  return f(std::type_identity<pagedkv::Sha256Hasher>{});
}

/// Usable blocks of a pool of `capacity_tokens` tokens: floor(capacity / block_size). Throws std::invalid_argument
/// if that is 0 or does not fit 32-bit block ids.
[[nodiscard]] std::size_t usable_blocks_for(double capacity_tokens, std::uint32_t block_size);

/// The stem of the trace's file name (e.g. "synthetic_trace"), for the `trace` column.
[[nodiscard]] std::string trace_name(const Trace& trace);

/// Append the cost columns every mode reports: manager_seconds, block_ops, ns_per_block_op.
void add_cost_fields(Row& row, double manager_seconds, std::uint64_t block_ops);

/// Fixed-capacity host buffers for `build_batch_metadata`, allocated once per run (CSR page table, seq_lens,
/// qo_indptr, slot_mapping, copy list; no padded block table). Engines copy these to fixed device buffers.
class MetadataBuffers {
 public:
  /// Capacities: `max_batch` sequences, `max_indices` block ids over the batch, `max_new_tokens` slots,
  /// `max_copies` copy-on-write pairs.
  MetadataBuffers(std::size_t max_batch, std::size_t max_indices, std::size_t max_new_tokens, std::size_t max_copies);

  /// Views for one step. The per-sequence arrays and the copy list span their full capacity (the fixed shape a
  /// captured CUDA graph reads; the library pads them); `indices` and `slot_mapping` are cut to this step's
  /// extents, `num_indices` and `num_new_tokens`, as an engine copies only the live prefix of those (padding them
  /// to their pool-sized capacity every step would cost O(pool), not O(batch)).
  /// Throws std::logic_error if an extent exceeds its capacity.
  [[nodiscard]] pagedkv::BatchMetadataBuffers view(std::size_t num_indices, std::size_t num_new_tokens);

 private:
  std::vector<std::int32_t> indptr_, indices_, last_page_len_, seq_lens_, qo_indptr_, copies_;
  std::vector<std::int64_t> slot_mapping_;
};

/// Cached-token fraction of a manager's admissions: prefix_hit_tokens / prefix_query_tokens (0 when none).
[[nodiscard]] double hit_ratio(const pagedkv::CacheStats& stats) noexcept;

}  // namespace replay
