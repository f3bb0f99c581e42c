// examples/replay/hybrid_mode.hpp: hybrid models (KV-cache groups with sliding-window / chunked-local attention in
// one pool, pagedkv::HybridKVCacheManager) replayed on the bundled traces (issue 13, section 3).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iosfwd>
#include <string>
#include <string_view>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/kv_cache_groups.hpp>

#include "modes.hpp"
#include "trace.hpp"

namespace replay {

/// A model's layers as KV-cache groups, parsed from a `--model-layers` spec.
struct ModelLayers {
  std::vector<pagedkv::KVCacheGroupSpec> groups;  ///< In spec order, each kind split into groups of `layers_per_group`.
  std::uint32_t layers_per_group = 0;             ///< gcd of the layer counts (vLLM's equal-size groups, no padding).
  std::uint32_t num_layers = 0;                   ///< Total layers.
};

/// Parse a layer spec: comma-separated `kind:layers` items, kind one of `full`, `swa<W>` (sliding window of W tokens,
/// the query included), `chunk<C>` (chunked-local attention, chunk of C tokens), `mamba` (recurrent state: Mamba-2,
/// gated delta net; listed after the attention groups, its checkpoint interval set by the replay); e.g. "full:12,swa4096:24" (the
/// issue's example), "full:6,swa1024:30" (Gemma 3's 5:1), "full:18,swa128:18" (gpt-oss). Items of the same kind and
/// window are merged. Every kind is split into groups of gcd(all layer counts) layers, as vLLM's hybrid allocator
/// splits layer types into groups of equal size so that one page size serves all: "full:12,swa4096:24" gives one
/// full group and two sliding-window groups of 12 layers. Throws std::invalid_argument naming the bad item.
[[nodiscard]] ModelLayers parse_model_layers(std::string_view spec);

/// The same model with every layer full attention (the baseline: same groups, same pool).
[[nodiscard]] ModelLayers all_full(const ModelLayers& model);

/// Options of the hybrid replay (the main program maps its flags onto these).
struct HybridOptions {
  std::string model_layers = "full:12,swa4096:24";
  /// Pool size, as the tokens an all-full-attention model of these layers holds: the pool has
  /// floor(capacity / block_size) x (number of groups) blocks + the null block, the same for both managers.
  double capacity_tokens = 1e6;
  std::uint32_t block_size = pagedkv::kDefaultBlockSize;
  bool xxh3 = false;                          ///< Xxh3Hasher instead of Sha256Hasher.
  /// "serve": continuous batching (as --mode serve); "prefix": one request at a time, hit ratio (as --mode prefix).
  std::string mode = "serve";
  bool json = false;                          ///< JSON lines instead of a table.
  // A model with mamba (recurrent) layers (prefix mode; docs/groups.md "Measured: recurrent groups"):
  std::size_t state_bytes = std::size_t{1} << 20;  ///< One recurrent layer's state (Qwen3-Next's GDN: 1 MiB bf16).
  std::size_t layer_kv_bytes = 2048;  ///< K + V bytes of one token in one attention layer (Qwen3-Next: 2 KiB).
  std::vector<std::uint32_t> checkpoint_intervals = {512, 1024, 2048};  ///< Tokens; rounded up to the block size.
  /// The one-group replay's options this replay shares (main.cpp's): serve mode runs the serve scheduler with them
  /// (run_serve_groups: host tier, --preempt, --spec-tokens, --eviction, retention, --reserve, --max-model-len,
  /// --publish-events); prefix mode takes the eviction policies, retention and --publish-events (the hybrid row's
  /// pool). Its capacity and groups are set per run.
  Options base;
};

/// Replay `trace` through a HybridKVCacheManager for the model of `opt.model_layers` and through the all-full model
/// on the same pool, and print one row per manager to `out`.
///
/// serve (the --mode serve scheduler, run_serve_groups, with opt.base's flags: FIFO admission, chunked prefill under
/// the token budget with each chunk reserved just before its step unless opt.base.reserve says otherwise, decode
/// tokens with optional speculation, recompute or swap preemption of the newest sequence when a reservation finds
/// no block, an optional host tier, any eviction policy, published events of the hybrid row's pool):
/// kv_utilization (time-averaged fraction of the slots of held blocks that hold a token), peak and time-averaged
/// blocks per group, blocks per held token, memory_saved = 1 - blocks per held token / the all-full figure,
/// preemptions, peak running, steps, simulated seconds, hit ratio, library seconds; with a host tier, speculation
/// or events their columns (run_serve_groups).
/// prefix (as --mode prefix at one capacity, with opt.base's eviction policies, retention and published events:
/// admit, build the prefill step, free, request after request): hit ratio,
/// and the hit ratio over the prompts longer than the smallest window (must not fall to zero past the window),
/// evictions, library seconds.
/// With mamba layers (prefix mode only): on pools of the same bytes (the all-attention model's KV for
/// capacity_tokens tokens), one row for all attention (block size as given), one for vLLM's align mode (the
/// attention block grown until a page holds a state, vLLM's page-size unification; one checkpoint per request, at
/// its last block boundary), and per interval of checkpoint_intervals a row with checkpoints every interval and one
/// with them plus the last checkpoint: hit ratio, the peak bytes of cached checkpoints, evictions, and the miss
/// causes of the admissions.
/// Returns 0. Throws std::invalid_argument for a bad spec or capacity.
int run_hybrid_serve(const Trace& trace, const HybridOptions& opt, std::ostream& out);

}  // namespace replay
