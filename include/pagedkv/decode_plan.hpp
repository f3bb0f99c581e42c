// pagedkv/decode_plan.hpp: the length-aware decode work plan, shared by the CUDA decode launcher and the CPU
// reference (the "plan" half of FlashInfer's plan/run; the split of Flash-Decoding, Dao et al. 2023).
//
// Plain host C++ (no CUDA header): the CPU reference, the CUDA launcher and an engine's scheduler thread all include
// it. The plan turns a decode batch (one query token per sequence) into a *work list*:
//
//   lane      = (request b, kv head, query-head tile): the query heads of one GQA group (or of a tile of it) that
//               read the same K/V; it has kv_len_b tokens. A batch has batch * num_kv_heads * num_head_tiles lanes.
//   work item = (request, kv head, head tile, token range [kv_begin, kv_end)): one CTA on the GPU, one task on the
//               CPU reference. A lane is either one item covering all its tokens (the item writes o and lse), or
//               cut into n_b >= 2 items (a *split* request), each writing a partial (o, lse) row to the workspace.
//   merge     = one entry per split request: its partial rows [partial_begin, partial_begin + num_partials) are
//               merged by log-sum-exp into o and lse (FlashInfer merge_states).
//
// Both executors (pagedkv::cuda::decode(params, work_list) and pagedkv::reference::decode(params, work_list)) run
// exactly the items and merges of the list, so every CPU test of the reference also tests the plan: coverage of
// every (request, head, token) exactly once, and the merge.
//
// CUDA graphs: plan_decode writes into caller-owned, fixed-capacity buffers and pads them (items and merges past the
// plan's count have valid == 0), so the launch shape (item capacity, merge capacity, partial-row capacity) is fixed:
// a graph captured once replays every later plan after the host copies the new buffers to the same device
// addresses. Nothing here allocates except validate_decode_work_list (a debugging / reference-side check).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include <pagedkv/kernel_params.hpp>

namespace pagedkv {

/// One unit of decode work: the query heads of one head tile of kv head `kv_head`, for request `request`, over
/// its tokens [kv_begin, kv_end). 32 bytes, 16-byte aligned (two 16-byte loads on the GPU). Memory space: wherever
/// the executor reads it (host for the reference, device for CUDA).
struct alignas(16) DecodeWorkItem {
  std::int32_t request = -1;      ///< Sequence index b in [0, batch); -1 on a padding item.
  std::int32_t kv_head = 0;       ///< KV head in [0, num_kv_heads).
  std::int32_t head_tile = 0;     ///< Tile of that kv head's query heads, in [0, num_head_tiles).
  std::int32_t valid = 0;         ///< 1: a real item; 0: padding (executors skip it). The "valid mask".
  std::int32_t kv_begin = 0;      ///< First token of the range (tokens of the sequence, not of a page).
  std::int32_t kv_end = 0;        ///< One past the last token; kv_begin == kv_end only for an empty sequence.
  std::int32_t partial_row = -1;  ///< -1: the item covers its whole lane and writes o / lse. Else the workspace row
                                  ///< (in [0, partial_row_capacity)) that receives this range's normalized partial.
  std::int32_t reserved = 0;      ///< Zero.
};
static_assert(sizeof(DecodeWorkItem) == 32, "DecodeWorkItem: the kernel loads it as two 16-byte vectors");

/// Merge of one split request: o[request, h] and lse[request, h] for every query head h from the partial rows
/// [partial_begin, partial_begin + num_partials) (in row order; Flash-Decoding / FlashInfer merge_states).
struct alignas(16) DecodeMergeItem {
  std::int32_t request = -1;     ///< Sequence index; -1 on padding.
  std::int32_t partial_begin = 0;
  std::int32_t num_partials = 0; ///< >= 2 for a real entry.
  std::int32_t valid = 0;        ///< 1: real; 0: padding.
};
static_assert(sizeof(DecodeMergeItem) == 16, "DecodeMergeItem: one 16-byte load");

/// Query-head tiles per kv head when a work item handles at most `heads_per_tile` of a group of `group_size`
/// query heads: ceil(group_size / heads_per_tile). heads_per_tile <= 0 means the whole group (1 tile).
[[nodiscard]] constexpr std::int32_t decode_num_head_tiles(std::int32_t group_size, std::int32_t heads_per_tile) noexcept {
  if (heads_per_tile <= 0 || heads_per_tile >= group_size) return 1;
  return (group_size + heads_per_tile - 1) / heads_per_tile;
}

/// Bytes of workspace a work list with `partial_row_capacity` partial rows needs: float32 partial o
/// `[partial_row_capacity, num_qo_heads, head_dim]` followed by float32 partial lse `[partial_row_capacity,
/// num_qo_heads]` (the layout of decode_workspace_bytes with batch = rows and one chunk).
[[nodiscard]] constexpr std::size_t decode_plan_workspace_bytes(std::int32_t partial_row_capacity,
                                                                std::int32_t num_qo_heads,
                                                                std::int32_t head_dim) noexcept {
  return decode_workspace_bytes(partial_row_capacity, 1, num_qo_heads, head_dim);
}

/// Inputs of plan_decode besides the lengths: the batch's heads and the machine, as plain numbers so the plan is
/// computable (and testable) without a GPU. pagedkv::cuda::decode_plan_config fills the device-dependent fields
/// from the CUDA device and the decode kernel's occupancy.
struct DecodePlanConfig {
  std::int32_t num_qo_heads = 0;   ///< Query heads; a multiple of num_kv_heads.
  std::int32_t num_kv_heads = 0;   ///< KV heads (lanes per request = num_kv_heads * num_head_tiles).
  std::int32_t head_dim = 0;       ///< Only sizes the workspace (DecodePlanInfo::workspace_bytes).
  std::int32_t heads_per_tile = 0; ///< Query heads per work item, in [1, group]; 0 = the whole group. The CUDA kernel
                                   ///< needs <= its row slots (pagedkv::cuda::decode_heads_per_tile).
  std::int32_t num_sms = 0;        ///< Multiprocessors of the device (>= 1).
  std::int32_t ctas_per_sm = 1;    ///< Decode CTAs resident per SM (occupancy, >= 1). Slots S = num_sms * ctas_per_sm.
  std::int32_t min_chunk_tokens = 256;     ///< Lower bound on the chunk target T (>= 1); the items of a split
                                           ///< request have floor(len / ceil(len / T)) >= T / 2 tokens or more.
  std::int32_t item_overhead_tokens = 128; ///< Cost model: fixed cost of one item (CTA start, q load, partial
                                           ///< write and merge read) in token-equivalents of K/V streaming (>= 0).
  std::int32_t max_waves = 8;      ///< Candidate granularities k = 1..max_waves (0: never split; at most 64).
  /// The layer's local attention (DecodeParams::window of the launch this plan is for): the plan covers only each
  /// request's visible keys [window.first_visible(kv_len - 1), kv_len) and balances those, so pages wholly outside the
  /// window get no work item at all. Default off (every token). Last member: aggregate initialization that stops
  /// earlier keeps working.
  AttentionWindow window;
};

/// Caller-owned output buffers of plan_decode (host memory; copy them to the device for CUDA). Their sizes are the
/// capacities the launch is shaped by: keep them fixed to replay a CUDA graph.
struct DecodePlanBuffers {
  std::span<DecodeWorkItem> items;        ///< [item_capacity]; >= batch * num_kv_heads * num_head_tiles.
  std::span<DecodeMergeItem> merges;      ///< [merge_capacity]; >= batch (one potential merge per request).
  std::int32_t partial_row_capacity = 0;  ///< Workspace rows available for partials (>= 0; 0 = never split).
};

/// What an executor needs to run a plan: the two lists (in the executor's memory space) and the fixed shape.
/// The GPU launches item_capacity attention CTAs and merge_capacity * num_qo_heads merge warps; padding entries
/// (valid == 0) exit at once.
struct DecodeWorkList {
  const DecodeWorkItem* items = nullptr;    ///< [item_capacity]
  std::int32_t item_capacity = 0;
  const DecodeMergeItem* merges = nullptr;  ///< [merge_capacity]
  std::int32_t merge_capacity = 0;
  std::int32_t heads_per_tile = 0;          ///< As planned (resolved: in [1, group]).
  std::int32_t partial_row_capacity = 0;    ///< Workspace rows (see decode_plan_workspace_bytes).

  /// The same list at other addresses, e.g. the device copies of the host buffers plan_decode filled.
  [[nodiscard]] constexpr DecodeWorkList relocated(const DecodeWorkItem* new_items,
                                                   const DecodeMergeItem* new_merges) const noexcept {
    DecodeWorkList w = *this;
    w.items = new_items;
    w.merges = new_merges;
    return w;
  }
};

/// What plan_decode decided (for logs, tests and benchmarks).
struct DecodePlanInfo {
  std::int32_t num_items = 0;             ///< Valid items (the rest of the buffer is padding).
  std::int32_t num_merges = 0;            ///< Split requests (valid merge entries).
  std::int32_t num_partial_rows = 0;      ///< Partial rows used (<= partial_row_capacity).
  std::int32_t num_lanes = 0;             ///< batch * num_kv_heads * num_head_tiles (non-empty or not).
  std::int32_t num_head_tiles = 0;
  std::int32_t heads_per_tile = 0;
  std::int32_t max_chunks_per_request = 0;
  std::int32_t chunk_target_tokens = 0;   ///< T: no item of a split request is longer; 0 when nothing is split.
  std::int32_t waves_candidate = 0;       ///< k of the chosen candidate (0 = no split).
  std::int32_t max_item_tokens = 0;       ///< Longest item.
  std::int32_t nonempty_items = 0;        ///< Items with at least one token.
  std::int64_t total_tokens = 0;          ///< Visible tokens over all lanes (each token once per lane; with a window,
                                          ///< only [first visible, kv_len) of each request counts).
  double mean_item_tokens = 0.0;          ///< total_tokens / nonempty_items (0 if none).
  std::int64_t estimated_cost = 0;        ///< Cost model value of the chosen candidate (token-equivalents).
  std::int32_t estimated_waves = 0;       ///< Waves of S slots the cost model expects.
  std::size_t workspace_bytes = 0;        ///< decode_plan_workspace_bytes(partial_row_capacity, ...): what the launch needs.
  DecodeWorkList work_list;               ///< The host buffers as a work list (host pointers).
};

/// Buffer sizes with which plan_decode succeeds for *every* batch of at most max_batch requests (any lengths):
/// items = lanes + max_waves * S, merges = max_batch, partial rows = max_batch + ceil(max_waves * S / lanes per
/// request), with S = num_sms * ctas_per_sm (see plan_decode for why these bound every candidate). Zero sizes when
/// cfg is invalid (see plan_decode's errors) or max_batch < 0. Pure function.
struct DecodePlanCapacity {
  std::int32_t items = 0;
  std::int32_t merges = 0;
  std::int32_t partial_rows = 0;
  std::size_t workspace_bytes = 0;  ///< decode_plan_workspace_bytes(partial_rows, num_qo_heads, head_dim).
};

namespace detail {

/// Checks a DecodePlanConfig; kSuccess or kInvalidValue.
[[nodiscard]] constexpr Status validate_plan_config(const DecodePlanConfig& c) noexcept {
  if (c.num_qo_heads <= 0 || c.num_kv_heads <= 0 || c.num_qo_heads % c.num_kv_heads != 0) return Status::kInvalidValue;
  if (c.head_dim <= 0) return Status::kInvalidValue;
  const std::int32_t group = c.num_qo_heads / c.num_kv_heads;
  if (c.heads_per_tile < 0 || c.heads_per_tile > group) return Status::kInvalidValue;
  if (c.num_sms < 1 || c.ctas_per_sm < 1 || c.min_chunk_tokens < 1 || c.item_overhead_tokens < 0) {
    return Status::kInvalidValue;
  }
  if (c.max_waves < 0 || c.max_waves > 64) return Status::kInvalidValue;
  if (std::int64_t{c.num_sms} * c.ctas_per_sm > (std::int64_t{1} << 24)) return Status::kInvalidValue;
  if (!c.window.valid()) return Status::kInvalidValue;
  return Status::kSuccess;
}

[[nodiscard]] constexpr std::int64_t div_up(std::int64_t a, std::int64_t b) noexcept { return (a + b - 1) / b; }

/// First visible token of a decode query over a sequence of len tokens (the query sits at len - 1): the start of
/// the range a plan must cover. 0 for an empty sequence or no window.
[[nodiscard]] constexpr std::int64_t decode_visible_begin(std::int64_t len, const AttentionWindow& w) noexcept {
  return w.first_needed_token(len, 1);
}

/// Items of a lane of `len` tokens at chunk target `t` (t <= 0: no split): 0 for an empty lane (it still gets one
/// padding-writing item, counted separately), else ceil(len / t).
[[nodiscard]] constexpr std::int64_t lane_items(std::int64_t len, std::int64_t t) noexcept {
  if (len <= 0) return 0;
  if (t <= 0) return 1;
  return div_up(len, t);
}

/// Token range of chunk j of n of a lane of len tokens: sizes floor(len / n) or ceil(len / n), the longer first.
[[nodiscard]] constexpr std::pair<std::int64_t, std::int64_t> chunk_range(std::int64_t len, std::int64_t n,
                                                                          std::int64_t j) noexcept {
  const std::int64_t base = len / n;
  const std::int64_t rem = len % n;
  const std::int64_t begin = j * base + std::min(j, rem);
  return {begin, begin + base + (j < rem ? 1 : 0)};
}

/// One candidate granularity, evaluated without touching the output.
struct PlanCandidate {
  std::int64_t target = 0;        // T (0 = no split)
  std::int64_t items = 0;         // items of non-empty lanes
  std::int64_t partial_rows = 0;  // sum of n_b over split requests
  std::int64_t max_item = 0;
  std::int64_t cost = std::numeric_limits<std::int64_t>::max();
  std::int64_t waves = 0;
  bool feasible = false;
};

}  // namespace detail

/// See DecodePlanCapacity.
[[nodiscard]] constexpr DecodePlanCapacity decode_plan_capacity(std::int32_t max_batch,
                                                                const DecodePlanConfig& cfg) noexcept {
  DecodePlanCapacity cap;
  if (max_batch < 0 || detail::validate_plan_config(cfg) != Status::kSuccess) return cap;
  const std::int32_t group = cfg.num_qo_heads / cfg.num_kv_heads;
  const std::int64_t per_req = std::int64_t{cfg.num_kv_heads} * decode_num_head_tiles(group, cfg.heads_per_tile);
  const std::int64_t slots = std::int64_t{cfg.num_sms} * cfg.ctas_per_sm;
  const std::int64_t items = std::int64_t{max_batch} * per_req + std::int64_t{cfg.max_waves} * slots;
  const std::int64_t rows = cfg.max_waves == 0 ? 0 : max_batch + detail::div_up(cfg.max_waves * slots, per_req);
  constexpr std::int64_t kMax = std::numeric_limits<std::int32_t>::max();
  if (items > kMax || rows > kMax) return cap;
  cap.items = static_cast<std::int32_t>(items);
  cap.merges = max_batch;
  cap.partial_rows = static_cast<std::int32_t>(rows);
  cap.workspace_bytes = decode_plan_workspace_bytes(cap.partial_rows, cfg.num_qo_heads, cfg.head_dim);
  return cap;
}

/// Plans a decode batch: cuts each request's KV into token ranges so that the work items are balanced by tokens and
/// fill the device, and writes the work list (items, merges) into the caller's fixed-capacity buffers.
///
/// Parameters:
///  - kv_lens_tokens: host `[batch]` int32, each sequence's KV length in tokens (>= 0; 0 = a padding sequence, which
///    gets o = 0 and lse = -inf). These are the lengths the launch will see (seq_lens of the same step's metadata).
///  - cfg: heads, machine and the layer's local-attention window (DecodePlanConfig). out: caller buffers (host
///    memory), every entry overwritten; the entries past the plan's counts are padding (valid = 0, request = -1).
///  - info: optional, receives what was decided (DecodePlanInfo), including the host work list.
///
/// Windows (cfg.window, AttentionWindow: sliding window and/or chunked-local attention). Request b's query sits at
/// position kv_len_b - 1 and sees only [first_b, kv_len_b) with first_b = cfg.window.first_visible(kv_len_b - 1), so
/// its lanes have kv_len_b - first_b tokens ("visible tokens") and every item range lies inside [first_b, kv_len_b):
/// no item covers a token outside the window, and pages wholly before first_b (which the manager may have replaced
/// by the null block 0) belong to no item. Everything below counts visible tokens (W, T, balance, the LPT order).
/// Plan with the same window the launch uses (DecodeParams::window): a plan for a narrower window than the
/// launch's leaves keys uncovered (the reference rejects it; CUDA computes a wrong o); a plan without the window
/// is correct but wastes work (its items before the window are masked: they write o = 0, lse = -inf partials
/// that the merge weighs 0).
///
/// Algorithm (host, O(batch * max_waves + batch log batch + item_capacity), no allocation). Lanes are (request, kv
/// head, head tile); W = total visible tokens over lanes; S = num_sms * ctas_per_sm slots. Candidates: "no split" (one
/// item per lane) and, for k = 1..max_waves, chunk target T_k = max(min_chunk_tokens, ceil(W / (k * S))), each lane of
/// len tokens cut into n = ceil(len / T_k) items of floor or ceil(len / n) tokens (so no item exceeds T_k and the items
/// of a lane differ by at most one token). Each candidate is priced by a wave model of the GPU's CTA scheduler: with h
/// = item_overhead_tokens, N items and the longest item m, the work in "longest-item equivalents" is E = ceil((W + N h)
/// / (m + h)), and cost = ceil(E / S) * (m + h). The cheapest feasible candidate wins (ties: fewer items); feasible =
/// its items (plus one per empty lane) fit the item buffer and its partial rows fit partial_row_capacity. Items are
/// emitted longest-first (LPT order, so the GPU's in-order CTA dispatch starts the long work first), then request,
/// chunk, kv head, head tile; partial rows are assigned in the same order. Why these bounds hold: N_k <= W / T_k +
/// lanes <= k * S + lanes (see decode_plan_capacity).
///
/// Guarantees (tested in tests/unit/test_decode_plan.cpp): every (request, query head, visible token) is covered by
/// exactly one valid item, and no item covers a token that is not visible; a lane is either one item with partial_row
/// -1 or n >= 2 items with distinct partial rows, the same n and the same rows for every lane of the request, and one
/// merge entry naming exactly those rows; every item has <= T tokens; and when every non-empty lane is longer than 10 *
/// T, max item < 1.1 * mean item.
///
/// Returns kSuccess, or kInvalidValue (nothing written) when: cfg is invalid (num_qo_heads or num_kv_heads <= 0 or
/// not divisible, head_dim <= 0, heads_per_tile outside [0, group], num_sms or ctas_per_sm or min_chunk_tokens < 1,
/// item_overhead_tokens < 0, max_waves outside [0, 64], more than 2^24 slots, a negative window limit); a length
/// is negative; the batch or a buffer size exceeds int32; items.size() < lanes; merges.size() < batch;
/// partial_row_capacity < 0.
/// Thread safety: reads kv_lens_tokens and cfg, writes only out and info. Sources: FlashInfer's plan/run split and
/// its split-KV scheduler (chunk search bounded by the SMs' CTA slots); Flash-Decoding (Dao et al., 2023) for
/// split-KV + log-sum-exp merge; LPT list scheduling (Graham, 1969) for the emission order.
[[nodiscard]] inline Status plan_decode(std::span<const std::int32_t> kv_lens_tokens, const DecodePlanConfig& cfg,
                                        DecodePlanBuffers out, DecodePlanInfo* info = nullptr) noexcept {
  using detail::div_up;
  if (detail::validate_plan_config(cfg) != Status::kSuccess) return Status::kInvalidValue;
  constexpr std::size_t kMax32 = static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max());
  if (kv_lens_tokens.size() > kMax32 || out.items.size() > kMax32 || out.merges.size() > kMax32) {
    return Status::kInvalidValue;
  }
  if (out.partial_row_capacity < 0) return Status::kInvalidValue;
  const auto batch = static_cast<std::int32_t>(kv_lens_tokens.size());
  const std::int32_t group = cfg.num_qo_heads / cfg.num_kv_heads;
  const std::int32_t tiles = decode_num_head_tiles(group, cfg.heads_per_tile);
  const std::int32_t hpt = (group + tiles - 1) / tiles;  // balanced tiles: heads_per_tile as executed
  const std::int64_t per_req = std::int64_t{cfg.num_kv_heads} * tiles;
  const std::int64_t lanes = std::int64_t{batch} * per_req;
  if (static_cast<std::int64_t>(out.items.size()) < lanes) return Status::kInvalidValue;
  if (out.merges.size() < static_cast<std::size_t>(batch)) return Status::kInvalidValue;
  // A request's lane length is its number of *visible* tokens [first visible, kv_len) (all of them without a window).
  const auto visible_len = [&](std::int64_t len) { return len - detail::decode_visible_begin(len, cfg.window); };
  std::int64_t total = 0;        // W (visible tokens over all lanes)
  std::int64_t empty_reqs = 0;
  std::int64_t max_len = 0;
  for (const std::int32_t len : kv_lens_tokens) {
    if (len < 0) return Status::kInvalidValue;
    total += visible_len(len) * per_req;
    empty_reqs += len == 0 ? 1 : 0;
    max_len = std::max<std::int64_t>(max_len, visible_len(len));
  }
  const std::int64_t slots = std::int64_t{cfg.num_sms} * cfg.ctas_per_sm;
  const std::int64_t h = cfg.item_overhead_tokens;
  const auto capacity = static_cast<std::int64_t>(out.items.size());

  // ---- choose the granularity ----
  const auto evaluate = [&](std::int64_t target) {
    detail::PlanCandidate c;
    c.target = target;
    for (const std::int32_t kv_len : kv_lens_tokens) {
      const std::int64_t len = visible_len(kv_len);
      const std::int64_t n = detail::lane_items(len, target);
      c.items += n * per_req;
      if (n >= 2) c.partial_rows += n;
      if (n >= 1) c.max_item = std::max(c.max_item, div_up(len, n));
    }
    c.feasible = c.items + empty_reqs * per_req <= capacity && c.partial_rows <= out.partial_row_capacity;
    if (c.items == 0) {
      c.cost = 0;
      c.waves = 0;
    } else {
      const std::int64_t unit = c.max_item + h;
      const std::int64_t equiv = div_up(total + c.items * h, unit);
      c.waves = div_up(equiv, slots);
      c.cost = c.waves * unit;
    }
    return c;
  };
  detail::PlanCandidate best = evaluate(0);  // no split: always feasible (lanes <= capacity)
  std::int32_t best_k = 0;
  std::int64_t prev_target = -1;
  for (std::int32_t k = 1; k <= cfg.max_waves && total > 0; ++k) {
    const std::int64_t target = std::max<std::int64_t>(cfg.min_chunk_tokens, div_up(total, k * slots));
    if (target == prev_target) break;  // clamped at min_chunk_tokens: larger k gives the same candidate
    prev_target = target;
    if (target >= max_len) continue;   // nothing would be split
    const detail::PlanCandidate c = evaluate(target);
    if (c.feasible && (c.cost < best.cost || (c.cost == best.cost && c.items < best.items))) {
      best = c;
      best_k = k;
    }
  }

  // ---- emit: requests longest-item first (LPT), using the merge buffer as scratch for the order ----
  // merges[i].request = request, merges[i].partial_begin = its longest item (sort key); read back before rewrite.
  for (std::int32_t b = 0; b < batch; ++b) {
    const std::int64_t len = visible_len(kv_lens_tokens[static_cast<std::size_t>(b)]);
    const std::int64_t n = detail::lane_items(len, best.target);
    const std::int64_t longest = n == 0 ? 0 : div_up(len, n);
    out.merges[static_cast<std::size_t>(b)] = DecodeMergeItem{b, static_cast<std::int32_t>(longest), 0, 0};
  }
  std::sort(out.merges.begin(), out.merges.begin() + batch, [](const DecodeMergeItem& x, const DecodeMergeItem& y) {
    return x.partial_begin != y.partial_begin ? x.partial_begin > y.partial_begin : x.request < y.request;
  });
  std::size_t next_item = 0;
  std::int32_t next_row = 0;
  std::int32_t num_merges = 0;
  std::int32_t max_chunks = 0;
  std::int32_t nonempty = 0;
  for (std::int32_t i = 0; i < batch; ++i) {
    const std::int32_t b = out.merges[static_cast<std::size_t>(i)].request;  // read before merges[num_merges] is written
    const std::int64_t kv_len = kv_lens_tokens[static_cast<std::size_t>(b)];
    const std::int64_t first = detail::decode_visible_begin(kv_len, cfg.window);  // the lane is [first, kv_len)
    const std::int64_t len = kv_len - first;
    const std::int64_t n = detail::lane_items(len, best.target);
    const std::int32_t row0 = next_row;
    for (std::int64_t j = 0; j < std::max<std::int64_t>(n, 1); ++j) {
      auto [begin, end] = n == 0 ? std::pair<std::int64_t, std::int64_t>{0, 0} : detail::chunk_range(len, n, j);
      begin += first;
      end += first;
      for (std::int32_t kvh = 0; kvh < cfg.num_kv_heads; ++kvh) {
        for (std::int32_t t = 0; t < tiles; ++t) {
          DecodeWorkItem& it = out.items[next_item++];
          it = DecodeWorkItem{b, kvh, t, 1, static_cast<std::int32_t>(begin), static_cast<std::int32_t>(end),
                              n >= 2 ? static_cast<std::int32_t>(row0 + j) : -1, 0};
          nonempty += end > begin ? 1 : 0;
        }
      }
    }
    max_chunks = std::max(max_chunks, static_cast<std::int32_t>(n));
    if (n >= 2) {
      next_row += static_cast<std::int32_t>(n);
      out.merges[static_cast<std::size_t>(num_merges++)] = DecodeMergeItem{b, row0, static_cast<std::int32_t>(n), 1};
    }
  }
  const std::size_t num_items = next_item;
  for (std::size_t i = num_items; i < out.items.size(); ++i) out.items[i] = DecodeWorkItem{};
  for (std::size_t i = static_cast<std::size_t>(num_merges); i < out.merges.size(); ++i) out.merges[i] = DecodeMergeItem{};

  if (info != nullptr) {
    DecodePlanInfo r;
    r.num_items = static_cast<std::int32_t>(num_items);
    r.num_merges = num_merges;
    r.num_partial_rows = next_row;
    r.num_lanes = static_cast<std::int32_t>(lanes);
    r.num_head_tiles = tiles;
    r.heads_per_tile = hpt;
    r.max_chunks_per_request = max_chunks;
    r.chunk_target_tokens = best.partial_rows > 0 ? static_cast<std::int32_t>(best.target) : 0;
    r.waves_candidate = best.partial_rows > 0 ? best_k : 0;
    r.max_item_tokens = static_cast<std::int32_t>(best.max_item);
    r.nonempty_items = nonempty;
    r.total_tokens = total;
    r.mean_item_tokens = nonempty > 0 ? static_cast<double>(total) / nonempty : 0.0;
    r.estimated_cost = best.cost;
    r.estimated_waves = static_cast<std::int32_t>(best.waves);
    r.workspace_bytes = decode_plan_workspace_bytes(out.partial_row_capacity, cfg.num_qo_heads, cfg.head_dim);
    r.work_list = DecodeWorkList{out.items.data(), static_cast<std::int32_t>(out.items.size()), out.merges.data(),
                                 static_cast<std::int32_t>(out.merges.size()), hpt, out.partial_row_capacity};
    *info = r;
  }
  return Status::kSuccess;
}

/// The work list of buffers filled by plan_decode with `cfg` (host pointers). Same as DecodePlanInfo::work_list.
[[nodiscard]] constexpr DecodeWorkList decode_work_list(const DecodePlanBuffers& out, const DecodePlanConfig& cfg) noexcept {
  const std::int32_t group = cfg.num_kv_heads > 0 ? cfg.num_qo_heads / cfg.num_kv_heads : 0;
  const std::int32_t tiles = decode_num_head_tiles(group, cfg.heads_per_tile);
  return DecodeWorkList{out.items.data(), static_cast<std::int32_t>(out.items.size()), out.merges.data(),
                        static_cast<std::int32_t>(out.merges.size()), (group + tiles - 1) / tiles,
                        out.partial_row_capacity};
}

/// A plan with the uniform chunk rule of DecodeParams::kv_chunk_size_tokens (the pre-plan split-KV convention):
/// sequence b's chunk c covers [c * chunk, min((c + 1) * chunk, kv_len_b)); a sequence with >= 2 chunks is split
/// and its chunk c goes to partial row b * max_num_chunks + c (the documented workspace layout of
/// decode_workspace_bytes); a sequence with one chunk, or any sequence when chunk_tokens == 0, is one item.
/// One head tile of the whole group (run it with DecodeWorkList::heads_per_tile = group). Buffers: items >= batch *
/// num_kv_heads * max(1, max_num_chunks), merges >= batch, partial_row_capacity >= batch * max_num_chunks when
/// chunk_tokens > 0. Returns kInvalidValue (nothing written) for a negative
/// length or chunk, num_kv_heads < 1, a sequence needing more than max_num_chunks chunks, or too small buffers.
/// Used by the CPU reference to run the legacy split through the same executor. No allocation. The chunks do not
/// depend on a window: under DecodeParams::window the executors clamp each range to the visible keys, so a chunk
/// wholly before the window is a *masked* item (it reads nothing and writes the partial o = 0, lse = -inf, which the
/// merge weighs 0), exactly what the CUDA chunk rule does (validate_decode_work_list accepts such lists).
[[nodiscard]] inline Status plan_decode_uniform_chunks(std::span<const std::int32_t> kv_lens_tokens,
                                                       std::int32_t num_kv_heads, std::int32_t chunk_tokens,
                                                       std::int32_t max_num_chunks, DecodePlanBuffers out) noexcept {
  if (num_kv_heads < 1 || chunk_tokens < 0 || max_num_chunks < 0) return Status::kInvalidValue;
  const auto batch = static_cast<std::int64_t>(kv_lens_tokens.size());
  const std::int64_t need_items = batch * num_kv_heads * std::max<std::int64_t>(1, max_num_chunks);
  if (static_cast<std::int64_t>(out.items.size()) < need_items) return Status::kInvalidValue;
  if (static_cast<std::int64_t>(out.merges.size()) < batch) return Status::kInvalidValue;
  for (const std::int32_t len : kv_lens_tokens) {
    if (len < 0) return Status::kInvalidValue;
    if (chunk_tokens > 0 && detail::lane_items(len, chunk_tokens) > max_num_chunks) return Status::kInvalidValue;
  }
  if (chunk_tokens > 0 && static_cast<std::int64_t>(out.partial_row_capacity) < batch * max_num_chunks) {
    return Status::kInvalidValue;
  }
  std::size_t next = 0;
  std::size_t merges = 0;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t len = kv_lens_tokens[static_cast<std::size_t>(b)];
    const std::int64_t n = chunk_tokens > 0 ? detail::lane_items(len, chunk_tokens) : (len > 0 ? 1 : 0);
    for (std::int64_t c = 0; c < std::max<std::int64_t>(n, 1); ++c) {
      const std::int64_t begin = n >= 2 ? c * chunk_tokens : 0;
      const std::int64_t end = n >= 2 ? std::min(begin + chunk_tokens, len) : len;
      const std::int64_t row = n >= 2 ? b * max_num_chunks + c : -1;
      for (std::int32_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        out.items[next++] = DecodeWorkItem{static_cast<std::int32_t>(b), kvh, 0, 1, static_cast<std::int32_t>(begin),
                                           static_cast<std::int32_t>(end), static_cast<std::int32_t>(row), 0};
      }
    }
    if (n >= 2) {
      out.merges[merges++] = DecodeMergeItem{static_cast<std::int32_t>(b), static_cast<std::int32_t>(b * max_num_chunks),
                                             static_cast<std::int32_t>(n), 1};
    }
  }
  for (std::size_t i = next; i < out.items.size(); ++i) out.items[i] = DecodeWorkItem{};
  for (std::size_t i = merges; i < out.merges.size(); ++i) out.merges[i] = DecodeMergeItem{};
  return Status::kSuccess;
}

/// Checks that a work list (host memory) is a correct plan for a batch with KV lengths `kv_lens_tokens` and the
/// given heads: what plan_decode guarantees, for any producer. kInvalidValue when: a capacity is negative or its
/// pointer null while positive; heads_per_tile is outside [1, group]; a valid item names a request, kv head or head
/// tile out of range, has kv_begin > kv_end or kv_end > kv_len, an empty range on a non-empty sequence (or a
/// non-empty one on an empty sequence), or a partial row outside [-1, partial_row_capacity); the items of a lane
/// do not tile [0, kv_len) exactly once; a lane with one item uses a partial row, or a lane with several items does
/// not use distinct rows; the lanes of one request do not use the same set of rows; two requests share a row; a
/// split request has no valid merge entry, or more than one, or one whose rows are not exactly its rows; a merge
/// entry names a request that is not split; the window is invalid (a negative limit). Padding entries (valid == 0)
/// are ignored. kSuccess otherwise.
/// Windows: with `window` (the launch's DecodeParams::window), "tile [0, kv_len)" becomes "tile [s, kv_len) for
/// some s <= first visible token" (first = window.first_visible(kv_len - 1)): the items must cover every visible
/// token exactly once and may also cover earlier tokens (masked items, which executors clamp to nothing: the chunk
/// rule emits them). plan_decode's lists start exactly at the first visible token.
/// Allocates O(batch * lanes + items) host memory (std::bad_alloc terminates: noexcept). Thread safety: reads only.
[[nodiscard]] inline Status validate_decode_work_list(std::span<const std::int32_t> kv_lens_tokens,
                                                      std::int32_t num_qo_heads, std::int32_t num_kv_heads,
                                                      const DecodeWorkList& wl,
                                                      const AttentionWindow& window = {}) noexcept {
  if (num_qo_heads <= 0 || num_kv_heads <= 0 || num_qo_heads % num_kv_heads != 0) return Status::kInvalidValue;
  if (!window.valid()) return Status::kInvalidValue;
  if (wl.item_capacity < 0 || wl.merge_capacity < 0 || wl.partial_row_capacity < 0) return Status::kInvalidValue;
  if ((wl.item_capacity > 0 && wl.items == nullptr) || (wl.merge_capacity > 0 && wl.merges == nullptr)) {
    return Status::kInvalidValue;
  }
  const std::int32_t group = num_qo_heads / num_kv_heads;
  if (wl.heads_per_tile < 1 || wl.heads_per_tile > group) return Status::kInvalidValue;
  const std::int32_t tiles = decode_num_head_tiles(group, wl.heads_per_tile);
  const auto batch = static_cast<std::int64_t>(kv_lens_tokens.size());
  const std::int64_t per_req = std::int64_t{num_kv_heads} * tiles;

  struct Piece {
    std::int64_t lane;
    std::int32_t begin, end, row;
  };
  std::vector<Piece> pieces;
  pieces.reserve(static_cast<std::size_t>(wl.item_capacity));
  for (std::int32_t i = 0; i < wl.item_capacity; ++i) {
    const DecodeWorkItem& it = wl.items[i];
    if (it.valid == 0) continue;
    if (it.request < 0 || it.request >= batch || it.kv_head < 0 || it.kv_head >= num_kv_heads || it.head_tile < 0 ||
        it.head_tile >= tiles) {
      return Status::kInvalidValue;
    }
    const std::int32_t len = kv_lens_tokens[static_cast<std::size_t>(it.request)];
    if (it.kv_begin < 0 || it.kv_begin > it.kv_end || it.kv_end > len) return Status::kInvalidValue;
    if ((len > 0) != (it.kv_end > it.kv_begin)) return Status::kInvalidValue;
    if (it.partial_row < -1 || it.partial_row >= wl.partial_row_capacity) return Status::kInvalidValue;
    pieces.push_back({it.request * per_req + std::int64_t{it.kv_head} * tiles + it.head_tile, it.kv_begin, it.kv_end,
                      it.partial_row});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) {
    return a.lane != b.lane ? a.lane < b.lane : a.begin < b.begin;
  });
  // Per request: the sorted row set of its first lane (every lane must match), kept as [first, count) into `rows`.
  std::vector<std::int32_t> rows;
  std::vector<std::int64_t> req_rows_begin(static_cast<std::size_t>(batch), -1), req_rows_count(static_cast<std::size_t>(batch), 0);
  std::vector<std::int32_t> lane_rows;
  std::size_t p = 0;
  for (std::int64_t lane = 0; lane < batch * per_req; ++lane) {
    const auto b = static_cast<std::size_t>(lane / per_req);
    const std::int32_t len = kv_lens_tokens[b];
    const std::int64_t first = detail::decode_visible_begin(len, window);
    std::int32_t pos = 0;
    lane_rows.clear();
    std::size_t n = 0;
    while (p < pieces.size() && pieces[p].lane == lane) {
      if (n == 0 && pieces[p].begin <= first) pos = pieces[p].begin;  // may start early (masked items), never late
      if (pieces[p].begin != pos) return Status::kInvalidValue;  // gap, overlap, or a late start
      pos = pieces[p].end;
      lane_rows.push_back(pieces[p].row);
      ++p;
      ++n;
    }
    if (n == 0 || pos != len) return Status::kInvalidValue;  // lane not covered (an empty lane needs its one item)
    if (n == 1) {
      if (lane_rows[0] != -1) return Status::kInvalidValue;
    } else {
      std::sort(lane_rows.begin(), lane_rows.end());
      if (lane_rows[0] < 0 || std::adjacent_find(lane_rows.begin(), lane_rows.end()) != lane_rows.end()) {
        return Status::kInvalidValue;
      }
    }
    if (lane % per_req == 0) {
      req_rows_begin[b] = static_cast<std::int64_t>(rows.size());
      req_rows_count[b] = n == 1 ? 0 : static_cast<std::int64_t>(n);
      if (n > 1) rows.insert(rows.end(), lane_rows.begin(), lane_rows.end());
    } else {
      const std::int64_t cnt = n == 1 ? 0 : static_cast<std::int64_t>(n);
      if (cnt != req_rows_count[b]) return Status::kInvalidValue;
      if (cnt > 0 && !std::equal(lane_rows.begin(), lane_rows.end(), rows.begin() + req_rows_begin[b])) {
        return Status::kInvalidValue;
      }
    }
  }
  // No row shared by two requests.
  {
    std::vector<std::int32_t> all = rows;
    std::sort(all.begin(), all.end());
    if (std::adjacent_find(all.begin(), all.end()) != all.end()) return Status::kInvalidValue;
  }
  // Merges: exactly one per split request, naming exactly its rows (contiguous range).
  std::vector<std::uint8_t> merged(static_cast<std::size_t>(batch), 0);
  for (std::int32_t i = 0; i < wl.merge_capacity; ++i) {
    const DecodeMergeItem& m = wl.merges[i];
    if (m.valid == 0) continue;
    if (m.request < 0 || m.request >= batch) return Status::kInvalidValue;
    const auto b = static_cast<std::size_t>(m.request);
    if (merged[b] != 0 || req_rows_count[b] < 2 || m.num_partials != req_rows_count[b]) return Status::kInvalidValue;
    for (std::int64_t r = 0; r < req_rows_count[b]; ++r) {
      if (rows[static_cast<std::size_t>(req_rows_begin[b] + r)] != m.partial_begin + r) return Status::kInvalidValue;
    }
    merged[b] = 1;
  }
  for (std::int64_t b = 0; b < batch; ++b) {
    if (req_rows_count[static_cast<std::size_t>(b)] >= 2 && merged[static_cast<std::size_t>(b)] == 0) {
      return Status::kInvalidValue;
    }
  }
  return Status::kSuccess;
}

}  // namespace pagedkv
