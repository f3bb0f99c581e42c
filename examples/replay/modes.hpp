// examples/replay/modes.hpp: the three replay modes (prefix, serve, fork) and their shared options.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/retention.hpp>

#include "report.hpp"
#include "trace.hpp"

namespace replay {

/// The block-hash policy of the manager (its `Hasher` template parameter).
enum class HashKind { kSha256, kXxh3 };

/// The eviction policy of the manager (its `Evict` template parameter): LRU, segmented LRU, retention-priority LRU.
enum class EvictionKind { kLru, kSlru, kPriority };

/// When serve mode reserves a prompt's slots (--reserve).
enum class ReserveKind {
  kPrompt,  ///< The whole prompt at admission (the admission gate: a prompt that does not fit waits).
  kChunk,   ///< Each prefill chunk just before its step (vLLM V1's allocate_slots per step): a sliding-window
            ///< group then holds its window and one chunk of a long prompt, never the whole prompt at once.
};

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
  bool miss_causes = false;           ///< prefix: count every admission's miss cause (an eviction history of 4x
                                      ///< the pool's blocks), reported as miss_* fields.
  std::string publish_events;         ///< Publish KV events on this ZeroMQ endpoint (publish.hpp); "" = off.
  int publish_wait_ms = 0;            ///< Wait this long after binding it, for subscribers to connect.
  // Host tier and eviction (issue 10).
  double host_capacity_tokens = 0.0;  ///< Host tier size in tokens; 0 = no host tier.
  pagedkv::OffloadPolicy offload = pagedkv::OffloadPolicy::kWriteBack;  ///< With a host tier.
  EvictionKind eviction = EvictionKind::kLru;       ///< Device pool's policy.
  EvictionKind host_eviction = EvictionKind::kLru;  ///< Host tier's policy (--host-eviction; default --eviction's).
  std::uint64_t kv_bytes_per_token = 131072;        ///< KV bytes per token over all layers (Llama-3.1-8B bf16).
  pagedkv::PreemptMode preempt = pagedkv::PreemptMode::kRecompute;  ///< serve: how a sequence is preempted.
  /// --eviction priority: the retention config every admission carries (--decode-priority, --head-priority);
  /// null = every block at the default priority.
  std::shared_ptr<const pagedkv::RetentionConfig> retention;
  std::string retention_label = "-";  ///< How the command line set it, for the `retention` column.
  ReserveKind reserve = ReserveKind::kPrompt;  ///< serve: when a prompt's slots are reserved (--reserve).
  /// serve: the pool's KV-cache groups (--model-layers; hybrid_mode.hpp's parse_model_layers); empty = one
  /// full-attention group. Each group gets usable_blocks_for(capacity) blocks of the pool.
  std::vector<pagedkv::KVCacheGroupSpec> groups;
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

/// How a serve run of a pool with KV-cache groups (the hybrid replay) names itself in its row.
struct GroupRunLabels {
  std::string manager;                  ///< The `manager` column: "hybrid" or "all-full".
  std::string groups;                   ///< The `groups` column, e.g. "full,swa4096,swa4096 x12".
  std::vector<std::string> group_kinds; ///< Per group: its kind's column label ("full", "swa4096", "chunk8192").
  bool publish = false;                 ///< This run publishes --publish-events (one run per process does).
};

/// The serve replay of a pool with the KV-cache groups `opt.groups` (--model-layers; run_hybrid_serve calls it
/// for the model and for its all-full-attention baseline): the scheduler of run_serve (same admission, chunked
/// prefill, speculation, recompute or swap preemption, host tier, eviction policies, published events), with one
/// page table per group and usable_blocks_for(capacity) blocks per group, without the contiguous baseline. One
/// row, mode "hybrid-serve": kv_utilization, mean and peak running, preemptions, hit ratio, peak and mean blocks
/// held (all groups, and per group kind: the largest group of that kind), blocks per held token; with a host tier
/// the tier's columns (add_tier_fields) and the swaps; with --spec-tokens the drafts; with --publish-events
/// (`labels.publish`) the blocks stored and removed per group kind and how many of them were published; library
/// seconds. Throws as run_serve.
[[nodiscard]] Row run_serve_groups(const Trace& trace, const Options& opt, const GroupRunLabels& labels);

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

/// Name of an eviction policy as the command line spells it.
[[nodiscard]] const char* to_string(EvictionKind eviction) noexcept;
/// Name of a reservation policy as the command line spells it.
[[nodiscard]] const char* to_string(ReserveKind reserve) noexcept;
/// Name of an offload policy as the command line spells it.
[[nodiscard]] const char* to_string(pagedkv::OffloadPolicy offload) noexcept;
/// Name of a preemption mode as the command line spells it.
[[nodiscard]] const char* to_string(pagedkv::PreemptMode preempt) noexcept;

/// The policy type of an EvictionKind, as `f(std::type_identity<Policy>{})`.
template <class F>
decltype(auto) with_policy(EvictionKind kind, F&& f) {
  switch (kind) {
    case EvictionKind::kSlru: return f(std::type_identity<pagedkv::SlruEviction<std::uint32_t>>{});
    case EvictionKind::kPriority: return f(std::type_identity<pagedkv::PriorityLruEviction<std::uint32_t>>{});
    case EvictionKind::kLru: break;
  }
  return f(std::type_identity<pagedkv::LruEviction<std::uint32_t>>{});
}

/// Call `f(std::type_identity<Manager>{})` with the manager type selected by `opt.hash`, `opt.eviction` and
/// `opt.host_eviction`: `KVCacheManager<Hasher, std::uint32_t, Evict, HostEvict>`. Every pair of policies is
/// instantiated with SHA-256 (9 types), only equal policies with XXH3 (3 types; main.cpp refuses the others), to
/// bound the build time.
template <class F>
decltype(auto) with_manager(const Options& opt, F&& f) {
  return with_hasher(opt.hash, [&]<class H>(std::type_identity<H>) -> decltype(auto) {
    return with_policy(opt.eviction, [&]<class E>(std::type_identity<E>) -> decltype(auto) {
      if constexpr (std::is_same_v<H, pagedkv::Sha256Hasher>) {
        return with_policy(opt.host_eviction, [&]<class HE>(std::type_identity<HE>) -> decltype(auto) {
          return f(std::type_identity<pagedkv::KVCacheManager<H, std::uint32_t, E, HE>>{});
        });
      } else {
        return f(std::type_identity<pagedkv::KVCacheManager<H, std::uint32_t, E, E>>{});
      }
    });
  });
}

/// Usable blocks of a pool of `capacity_tokens` tokens: floor(capacity / block_size). Throws OptionError
/// (naming `flag`) if that is 0 or does not fit 32-bit block ids.
[[nodiscard]] std::size_t usable_blocks_for(double capacity_tokens, std::uint32_t block_size,
                                            const char* flag = "--capacity-tokens");

/// The stem of the trace's file name (e.g. "synthetic_trace"), for the `trace` column.
[[nodiscard]] std::string trace_name(const Trace& trace);

/// Append the cost columns every mode reports: manager_seconds, block_ops, ns_per_block_op.
void add_cost_fields(Row& row, double manager_seconds, std::uint64_t block_ops);

/// Append the host-tier columns of a manager's lifetime stats: hit ratio by tier (gpu_hit_ratio: hits served by
/// device blocks, host_hit_ratio: hits onboarded from the host tier; they sum to hit_ratio), the device tier's share
/// of the hits, the copies and their bytes at `opt.kv_bytes_per_token` (onboarded, offloaded, swapped out / in),
/// offloads dropped (host tier full of held blocks) and host evictions.
void add_tier_fields(Row& row, const pagedkv::CacheStats& stats, const Options& opt);

/// Fixed-capacity host buffers for `build_batch_metadata`, allocated once per run (CSR page table, seq_lens,
/// qo_indptr, slot_mapping, copy list; no padded block table). Engines copy these to fixed device buffers.
class MetadataBuffers {
 public:
  /// Capacities: `max_batch` sequences, `max_indices` block ids over the batch, `max_new_tokens` slots,
  /// `max_copies` copy-on-write pairs, `max_swaps` pairs in each of the swap_out / swap_in lists (0: no host tier).
  MetadataBuffers(std::size_t max_batch, std::size_t max_indices, std::size_t max_new_tokens, std::size_t max_copies,
                  std::size_t max_swaps = 0);

  /// Views for one step. The per-sequence arrays and the copy list span their full capacity (the fixed shape a
  /// captured CUDA graph reads; the library pads them); `indices` and `slot_mapping` are cut to this step's
  /// extents, `num_indices` and `num_new_tokens`, as an engine copies only the live prefix of those (padding them
  /// to their pool-sized capacity every step would cost O(pool), not O(batch)).
  /// The swap lists are cut likewise to `num_swap_out` / `num_swap_in` pairs (what the build may write: see
  /// `swap_extents`). Throws std::logic_error if an extent exceeds its capacity.
  [[nodiscard]] pagedkv::BatchMetadataBuffers view(std::size_t num_indices, std::size_t num_new_tokens,
                                                   std::size_t num_swap_out = 0, std::size_t num_swap_in = 0);

 private:
  std::vector<std::int32_t> indptr_, indices_, last_page_len_, seq_lens_, qo_indptr_, copies_, swap_out_, swap_in_;
  std::vector<std::int64_t> slot_mapping_;
};

/// Cached-token fraction of a manager's admissions: prefix_hit_tokens / prefix_query_tokens (0 when none).
[[nodiscard]] double hit_ratio(const pagedkv::CacheStats& stats) noexcept;

/// Pairs the next build of `m` may write into swap_out and swap_in: the queued device -> host copies plus, with
/// write-through, `registered_bound` (an upper bound on the blocks the previous build registered, which this build
/// offloads), and the queued host -> device copies.
template <class Manager>
[[nodiscard]] std::pair<std::size_t, std::size_t> swap_extents(const Manager& m, const Options& opt,
                                                               std::size_t registered_bound) {
  if (m.host_tier() == nullptr) return {0, 0};
  const auto& t = m.transfers();
  const std::size_t wt = opt.offload == pagedkv::OffloadPolicy::kWriteThrough ? registered_bound : 0;
  return {t.num_queued(true) + wt, t.num_queued(false)};
}

}  // namespace replay
