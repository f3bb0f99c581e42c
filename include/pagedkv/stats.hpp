// pagedkv/stats.hpp: the cache manager's counters: lifetime totals (CacheStats) and per-interval prefix-cache
// statistics named as vLLM's metrics (PrefixCacheStats), so dashboards map one to one.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace pagedkv {

/// Lifetime counters of external KV (external_kv.hpp: fills by another engine or a store, leases, save pins), plus
/// the state now. CacheStats::external.
struct ExternalKvCounters {
  std::uint64_t fills_started = 0;       ///< Admissions with external tokens.
  std::uint64_t fills_completed = 0;     ///< Fills completed with every block valid.
  std::uint64_t fills_partial = 0;       ///< Fills completed with some blocks failed (policy applied).
  std::uint64_t fills_failed = 0;        ///< Sequences failed: by kFail, or a recompute the pool had no blocks for.
  std::uint64_t fills_aborted = 0;       ///< Fills whose sequence was freed / aborted / preempted while in flight.
  std::uint64_t fill_blocks = 0;         ///< Blocks (all groups) of the fills started.
  std::uint64_t fill_blocks_valid = 0;   ///< Of which completed valid and kept.
  std::uint64_t orphan_holds = 0;        ///< Aborts while the transfer was not quiescent (blocks kept aside).
  std::uint64_t orphans_released = 0;    ///< Orphan holds ended by the late completion or failure signal.
  std::uint64_t orphans_expired = 0;     ///< Orphan holds ended by their deadline (reap).
  std::uint64_t leases_started = 0;      ///< Producer holds (finish with a lease).
  std::uint64_t leases_released = 0;     ///< Ended by the consumer's read-done.
  std::uint64_t leases_extended = 0;     ///< Heartbeats that moved a deadline.
  std::uint64_t leases_expired = 0;      ///< Ended by reap.
  std::uint64_t save_pins_started = 0;   ///< Saves to a store that pinned blocks.
  std::uint64_t save_pins_ended = 0;     ///< Saves completed or failed (pins released).
  std::uint64_t late_signals = 0;        ///< Signals for a fill or hold that ended by abort or expiry.
  std::uint64_t duplicate_signals = 0;   ///< Second signals for a fill or hold that ended by its signal.
  std::uint64_t unknown_signals = 0;     ///< Signals naming an id never issued.
  std::uint64_t stale_generations = 0;   ///< Block references refused for a generation that is not current.
  std::uint64_t blocks_transferred = 0;  ///< Admitted imports (with a plan): blocks to transfer (all groups).
  std::uint64_t blocks_skipped = 0;      ///< Admitted imports: blocks not transferred thanks to the local prefix hit.
  std::size_t fills_in_flight = 0;       ///< Now: fills not yet completed.
  std::size_t holds_active = 0;          ///< Now: leases, save pins and orphan holds.
  std::size_t blocks_held = 0;           ///< Now: distinct blocks with at least one external reference.
};

/// Lifetime counters of a KVCacheManager (vLLM's KVCacheManager usage + prefix-cache counters). Block counts
/// exclude the null block; `usage` = blocks_used / usable blocks (vLLM's kv_cache_usage). Prefix counters are
/// updated on successful admission only, so retries after "no capacity now" do not inflate them. `prefix_*`
/// count every admission; `readmitted_*` count the subset that re-admits a preempted sequence id.
/// Number of MissCause values (manager_results.hpp): the size of CacheStats::admissions_by_miss_cause.
inline constexpr std::size_t kNumMissCauses = 8;

struct CacheStats {
  std::size_t num_usable_blocks = 0;
  std::size_t blocks_used = 0;    ///< refcount > 0
  std::size_t blocks_cached = 0;  ///< refcount 0, hashed (evictable)
  std::size_t blocks_free = 0;    ///< refcount 0, unhashed
  double usage = 0.0;
  std::uint64_t prefix_query_requests = 0;
  std::uint64_t prefix_hit_requests = 0;  ///< admissions with at least one cached block
  std::uint64_t prefix_query_tokens = 0;  ///< prompt tokens admitted
  std::uint64_t prefix_hit_tokens = 0;    ///< of which found in the cache
  std::uint64_t readmitted_requests = 0;      ///< admissions of a sequence id preempted before (recompute)
  std::uint64_t readmitted_query_tokens = 0;  ///< their prompt tokens
  std::uint64_t readmitted_hit_tokens = 0;    ///< of which found in the cache
  std::uint64_t evictions = 0;  ///< cached device blocks whose hash was dropped so the allocator could reuse them
                                ///< (capacity evictions; evict_cached_block's removals are not counted)
  std::uint64_t cow_copies = 0;
  std::uint64_t dedup_blocks = 0;  ///< newly full blocks switched to an identical cached block
  std::uint64_t preemptions = 0;
  std::uint64_t block_ops = 0;     ///< allocations + acquires + releases, one per block
  // Host tier (all 0 without one). Transfers count queued copies (one block each).
  std::size_t host_num_usable_blocks = 0;
  std::size_t host_blocks_used = 0;    ///< held: by swapped sequences or by copies in flight
  std::size_t host_blocks_cached = 0;  ///< ready (or registered) and unheld: evictable
  std::size_t host_blocks_free = 0;
  std::uint64_t host_hit_tokens = 0;   ///< of prefix_hit_tokens, served by the host tier (onboarded)
  std::uint64_t host_evictions = 0;
  std::uint64_t offloads = 0;          ///< device -> host copies of cached blocks (write-back / write-through)
  std::uint64_t offloads_dropped = 0;  ///< offloads skipped because every host block was held
  std::uint64_t offloads_below_priority = 0;  ///< write-back offloads skipped: priority < min_offload_priority
  std::uint64_t onboards = 0;          ///< host -> device copies for host-tier hits
  std::uint64_t swap_outs = 0;         ///< device -> host copies of swapped-out sequences
  std::uint64_t swap_ins = 0;          ///< host -> device copies of resumed sequences
  std::size_t transfers_in_flight = 0; ///< copies issued by a build and not yet completed
  std::size_t transfers_queued = 0;    ///< copies waiting for the next build
  std::uint64_t events_lost = 0;       ///< stored events of host copies dropped for lack of memory (never else)
  /// Host-tier BlockStored events held back: the copy completed after its parent left every tier, so no router
  /// could place the block (it is reported if onboarded; its eviction reports nothing).
  std::uint64_t events_held_back = 0;
  /// Admissions by the cause that ended their prefix hit, indexed by MissCause (manager_results.hpp), counted when
  /// CacheConfig::count_miss_causes is on (all 0 otherwise). Each admitted request counts once; refused attempts
  /// (kNoCapacity retries) do not. kKeyMismatch is never counted here (telling it apart needs a keyless rehash of
  /// the prompt, which explain_admit does on demand): such a request counts as kNotCached or kEvicted.
  std::array<std::uint64_t, kNumMissCauses> admissions_by_miss_cause{};
  /// External KV (fills, leases, save pins, signals, import plans; all 0 without external KV).
  ExternalKvCounters external{};
};

/// Prefix-cache statistics of one interval (since the previous `take_prefix_cache_stats()`), with vLLM's field
/// names and meaning (vllm/v1/metrics/stats.py PrefixCacheStats; preempted requests counted apart since vLLM
/// #25780): `queries` and `hits` are prompt *tokens*; a re-admission after preemption goes to the `preempted_*`
/// fields only, so recomputing a preempted request does not inflate the hit rate of new traffic.
struct PrefixCacheStats {
  bool reset = false;                   ///< reset_prefix_cache() succeeded in the interval.
  std::uint64_t requests = 0;           ///< New requests admitted.
  std::uint64_t queries = 0;            ///< Their prompt tokens.
  std::uint64_t hits = 0;               ///< Of which found in the prefix cache.
  std::uint64_t preempted_requests = 0; ///< Previously preempted requests re-admitted.
  std::uint64_t preempted_queries = 0;  ///< Their prompt tokens.
  std::uint64_t preempted_hits = 0;     ///< Of which found in the prefix cache.

  /// hits / queries of new requests, or 0 when nothing was queried.
  [[nodiscard]] double hit_rate() const noexcept {
    return queries == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(queries);
  }
  /// preempted_hits / preempted_queries, or 0 when no preempted request was re-admitted.
  [[nodiscard]] double preempted_hit_rate() const noexcept {
    return preempted_queries == 0 ? 0.0 : static_cast<double>(preempted_hits) / static_cast<double>(preempted_queries);
  }
  /// Record one admission of `num_tokens` prompt tokens of which `num_hits` were cached.
  void record(std::uint64_t num_tokens, std::uint64_t num_hits, bool preempted) noexcept {
    if (preempted) {
      ++preempted_requests;
      preempted_queries += num_tokens;
      preempted_hits += num_hits;
    } else {
      ++requests;
      queries += num_tokens;
      hits += num_hits;
    }
  }
};

}  // namespace pagedkv
