// pagedkv/reference/decode.hpp: CPU reference of paged decode attention (one query token per sequence), with the
// same split-KV partitioning and log-sum-exp merge as the CUDA kernel (Flash-Decoding; FlashInfer's
// BatchDecodeWithPagedKVCache + merge_states).
//
// Two ways to say how the work is split, one executor:
//  - decode(p, work_list): a work list from plan_decode (pagedkv/decode_plan.hpp), the length-aware plan the CUDA
//    launcher executes too. Partials go to the workspace rows the items name (`decode_plan_workspace_bytes`).
//  - decode(p): the uniform chunk rule of DecodeParams (kv_chunk_size_tokens), converted to a work list by
//    plan_decode_uniform_chunks and run by the same executor:
//      chunk = kv_chunk_size_tokens (> 0), num_chunks_b = ceil(kv_len_b / chunk) (0 for an empty sequence);
//      chunk c of sequence b covers its tokens [c * chunk, min((c + 1) * chunk, kv_len_b)), never empty;
//      for a sequence with >= 2 chunks, per (b, c, qo head h) the chunk's softmax-normalised output and lse go to
//        partial_o   [batch, max_num_chunks, num_qo_heads, head_dim] float32, at the workspace start,
//        partial_lse [batch, max_num_chunks, num_qo_heads]           float32, right after partial_o;
//      slots c >= num_chunks_b, and every slot of a sequence with one chunk (computed directly, bit-identical to
//      merging its single partial), are neither written nor read.
// With a window (DecodeParams::window) the chunks stay where they are and each is clamped to the visible keys: a chunk
// wholly before the window is masked (nothing read; partial o = 0, lse = -inf, weight 0 in the merge).
// The merge over a request's partials (in row / chunk order) is
//     M = max_c lse_c,  w_c = exp(lse_c - M),  o = sum_c w_c * o_c / sum_c w_c,  lse = M + log(sum_c w_c).
// Where the CUDA launcher's decode(p) differs: with kv_chunk_size_tokens == 0 it may split with a chunk of its own
// choosing (the reference does not split); and a sequence that needs more than max_num_chunks chunks is rejected
// here (kInvalidValue) while the CUDA launcher grows its chunk to ceil(kv_len / max_num_chunks). Whenever the
// reference accepts a launch with kv_chunk_size_tokens > 0, the two partitions are identical; with a work list they
// are identical by construction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/common.hpp>

namespace pagedkv::reference {

/// Number of split-KV chunks a sequence of `kv_len_tokens` tokens needs at `chunk_tokens` tokens per chunk:
/// ceil(kv_len_tokens / chunk_tokens); 0 for an empty sequence; 1 when chunk_tokens <= 0 (no split) and the
/// sequence is non-empty. Pure function.
[[nodiscard]] constexpr std::int64_t num_kv_chunks(std::int64_t kv_len_tokens, std::int64_t chunk_tokens) noexcept {
  if (kv_len_tokens <= 0) return 0;
  if (chunk_tokens <= 0) return 1;
  return (kv_len_tokens + chunk_tokens - 1) / chunk_tokens;
}

/// Checks a decode launch without running it (reads the page table, host memory). kInvalidValue when: the pool
/// is invalid (see `detail::validate_pool`) or the page table is (see `detail::validate_page_table`);
/// num_qo_heads <= 0 or num_qo_heads % num_kv_heads != 0; q or o is null with batch > 0; sm_scale is not
/// finite; kv_chunk_size_tokens < 0; or, when kv_chunk_size_tokens > 0: max_num_chunks < 0, some sequence needs
/// more than max_num_chunks chunks, or (when decode_workspace_bytes(...) > 0) workspace is null, not 4-byte
/// aligned, or workspace_bytes is smaller than decode_workspace_bytes(batch, max_num_chunks, num_qo_heads,
/// head_dim); p.window has a negative limit. Page-table entries of pages wholly before a sequence's first visible
/// token (p.window.first_needed_token(kv_len_b, 1)) are never read and not checked: they may be the null block 0
/// or anything else. kUnsupported when the dtype is not one of the three enumerators (the reference supports every
/// head_dim and every dtype; the CUDA launcher restricts head_dim to {64, 128, 256}). Thread safety: reads only.
[[nodiscard]] inline Status validate(const DecodeParams& p) noexcept {
  using detail::fail;
  constexpr Status kBad = Status::kInvalidValue;
  if (const Status s = detail::validate_pool(p.kv); s != Status::kSuccess) return s;
  if (const Status s = detail::validate_window(p.window); s != Status::kSuccess) return s;
  const auto first_read = [&](std::int32_t, std::int64_t len) { return p.window.first_needed_token(len, 1); };
  if (const Status s = detail::validate_page_table(p.pages, p.kv, first_read); s != Status::kSuccess) return s;
  if (const Status s = detail::validate_heads(p.num_qo_heads, p.kv.num_kv_heads); s != Status::kSuccess) return s;
  if (const Status s = detail::validate_sm_scale(p.sm_scale); s != Status::kSuccess) return s;
  const std::int32_t batch = p.pages.batch_size;
  if (batch > 0 && p.q == nullptr) return fail(kBad, "q", " = null with batch %d > 0", batch);
  if (batch > 0 && p.o == nullptr) return fail(kBad, "o", " = null with batch %d > 0", batch);
  if (p.kv_chunk_size_tokens < 0) {
    return fail(kBad, "kv_chunk_size_tokens", " = %d: must be >= 0 (0 = no split)", p.kv_chunk_size_tokens);
  }
  if (p.kv_chunk_size_tokens > 0) {
    if (p.max_num_chunks < 0) return fail(kBad, "max_num_chunks", " = %d: must be >= 0", p.max_num_chunks);
    for (std::int32_t b = 0; b < batch; ++b) {
      const detail::SeqPages seq = detail::seq_pages(p.pages, p.kv.block_size, b);
      const std::int64_t need = num_kv_chunks(seq.kv_len, p.kv_chunk_size_tokens);
      if (need > p.max_num_chunks) {
        return fail(kBad, "max_num_chunks",
                    " = %d: sequence %d (%lld tokens) needs %lld chunks of kv_chunk_size_tokens = %d", p.max_num_chunks,
                    b, static_cast<long long>(seq.kv_len), static_cast<long long>(need), p.kv_chunk_size_tokens);
      }
    }
    const std::size_t need = decode_workspace_bytes(batch, p.max_num_chunks, p.num_qo_heads, p.kv.head_dim);
    if (need > 0) {
      if (const Status s = detail::validate_workspace(p.workspace, p.workspace_bytes, need); s != Status::kSuccess) {
        return s;
      }
    }
  }
  return Status::kSuccess;
}

/// Checks a decode launch that executes a work list (see pagedkv/decode_plan.hpp) without running it; reads the
/// page table and the work list (host memory). kInvalidValue when: the pool, page table, heads, sm_scale or q/o
/// fail the checks of validate(const DecodeParams&) (kv_chunk_size_tokens and max_num_chunks are ignored);
/// validate_decode_work_list rejects the list for the page table's lengths and p.window (so a list must cover every
/// visible token exactly once; it may start before the window, never after); or wl.partial_row_capacity > 0 and the
/// workspace is null, not 4-byte aligned, or smaller than decode_plan_workspace_bytes(wl.partial_row_capacity,
/// num_qo_heads, head_dim). kUnsupported as validate(const DecodeParams&). Allocates (the list check); thread
/// safety: reads only.
[[nodiscard]] inline Status validate(const DecodeParams& p, const DecodeWorkList& wl) noexcept {
  DecodeParams base = p;
  base.kv_chunk_size_tokens = 0;
  base.max_num_chunks = 0;
  if (const Status s = validate(base); s != Status::kSuccess) return s;
  const std::int32_t batch = p.pages.batch_size;
  std::vector<std::int32_t> lens(static_cast<std::size_t>(batch));
  for (std::int32_t b = 0; b < batch; ++b) {
    lens[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(detail::seq_pages(p.pages, p.kv.block_size, b).kv_len);
  }
  if (const Status s = validate_decode_work_list(lens, p.num_qo_heads, p.kv.num_kv_heads, wl, p.window);
      s != Status::kSuccess) {
    return detail::fail(Status::kInvalidValue, "work_list",
                        ": validate_decode_work_list refused it (%s) for this page table's lengths (item_capacity %d, "
                        "merge_capacity %d, heads_per_tile %d, partial_row_capacity %d): it must cover every visible "
                        "(request, head, token) exactly once",
                        to_string(s), wl.item_capacity, wl.merge_capacity, wl.heads_per_tile,
                        static_cast<int>(wl.partial_row_capacity));
  }
  if (wl.partial_row_capacity > 0) {
    const std::size_t need = decode_plan_workspace_bytes(wl.partial_row_capacity, p.num_qo_heads, p.kv.head_dim);
    if (const Status s = detail::validate_workspace(p.workspace, p.workspace_bytes, need); s != Status::kSuccess) {
      return s;
    }
  }
  return Status::kSuccess;
}

namespace detail {

/// Executes a validated work list: phase 1, every (valid item, query head of its tile) in parallel, each attending
/// to its token range clamped to the visible keys [p.window.first_visible(kv_len - 1), kv_len) and writing o / lse
/// (partial_row == -1; an empty sequence gets o = 0, lse = -inf) or its normalized partial (o_c, lse_c) to the
/// workspace row; an item whose clamped range is empty (a chunk wholly before the window: a masked item) reads
/// nothing and writes o_c = 0, lse_c = -inf. Phase 2, every (valid merge entry, query head) in parallel, merging the
/// rows in row order: M = max_c lse_c, w_c = exp(lse_c - M) (0 for a masked partial), o = sum_c w_c o_c / sum_c
/// w_c, lse = M + log(sum_c w_c); o = 0, lse = -inf if every partial is masked. Each unit writes only its own
/// outputs, so the result does not depend on the thread count.
template <ElementType T, KVStorageType KV = T>
void run_work_list(const DecodeParams& p, const DecodeWorkList& wl, int num_threads) noexcept {
  const std::int32_t dim = p.kv.head_dim;
  const std::int32_t hq = p.num_qo_heads;
  const std::int32_t group = hq / p.kv.num_kv_heads;
  const std::int32_t hpt = wl.heads_per_tile;
  auto* ws_o = static_cast<float*>(p.workspace);  // [partial_row_capacity, num_qo_heads, head_dim]
  float* ws_lse = ws_o == nullptr ? nullptr : ws_o + std::int64_t{wl.partial_row_capacity} * hq * dim;
  const std::int64_t units = std::int64_t{wl.item_capacity} * hpt;
  parallel_for(units, num_threads, dim, [&](std::int64_t u, AttnScratch& sc) noexcept {
    const DecodeWorkItem& it = wl.items[u / hpt];
    if (it.valid == 0) return;
    const auto hl = static_cast<std::int32_t>(u % hpt);
    if (it.head_tile * hpt + hl >= group) return;  // the last tile may hold fewer heads
    const std::int32_t h = it.kv_head * group + it.head_tile * hpt + hl;
    const std::int64_t row = std::int64_t{it.request} * hq + h;  // q/o row; lse index
    const SeqPages seq = seq_pages(p.pages, p.kv.block_size, it.request);
    if (seq.kv_len == 0) {  // padding sequence: o = 0, lse = -inf
      for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, 0.f);
      if (p.lse != nullptr) p.lse[row] = -std::numeric_limits<float>::infinity();
      return;
    }
    float* qf = sc.q();
    float* acc = sc.acc();
    for (std::int32_t i = 0; i < dim; ++i) qf[i] = load_as_float<T>(p.q, row * dim + i);
    std::fill(acc, acc + dim, 0.f);
    OnlineSoftmax st;
    // The visible keys of the query at position kv_len - 1; nothing before `first` is read (null pages live there).
    const std::int64_t first = p.window.first_needed_token(seq.kv_len, 1);
    attend_range<T, KV>(p.kv, seq, it.kv_head, p.sm_scale, std::max<std::int64_t>(it.kv_begin, first), it.kv_end, st,
                        sc);
    const float inv = st.empty() ? 0.f : 1.f / st.d;  // a masked item: o = 0, lse = -inf
    if (it.partial_row < 0) {
      for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, acc[i] * inv);
      if (p.lse != nullptr) p.lse[row] = st.lse();
    } else {
      const std::int64_t prow = std::int64_t{it.partial_row} * hq + h;
      for (std::int32_t i = 0; i < dim; ++i) ws_o[prow * dim + i] = acc[i] * inv;
      ws_lse[prow] = st.lse();
    }
  });
  const std::int64_t merge_units = std::int64_t{wl.merge_capacity} * hq;
  parallel_for(merge_units, num_threads, dim, [&](std::int64_t u, AttnScratch& sc) noexcept {
    const DecodeMergeItem& mg = wl.merges[u / hq];
    if (mg.valid == 0) return;
    const auto h = static_cast<std::int32_t>(u % hq);
    const std::int64_t row = std::int64_t{mg.request} * hq + h;
    const auto prow = [&](std::int64_t c) { return (std::int64_t{mg.partial_begin} + c) * hq + h; };
    float m = -std::numeric_limits<float>::infinity();
    for (std::int64_t c = 0; c < mg.num_partials; ++c) m = std::max(m, ws_lse[prow(c)]);
    if (m == -std::numeric_limits<float>::infinity()) {  // every partial masked (not produced by a valid list)
      for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, 0.f);
      if (p.lse != nullptr) p.lse[row] = m;
      return;
    }
    float* acc = sc.acc();
    std::fill(acc, acc + dim, 0.f);
    float sum_w = 0.f;
    for (std::int64_t c = 0; c < mg.num_partials; ++c) {
      const float w = std::exp(ws_lse[prow(c)] - m);
      sum_w += w;
      const float* po = ws_o + prow(c) * dim;
      for (std::int32_t i = 0; i < dim; ++i) acc[i] += w * po[i];
    }
    const float inv = 1.f / sum_w;
    for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, acc[i] * inv);
    if (p.lse != nullptr) p.lse[row] = m + std::log(sum_w);
  });
}

}  // namespace detail

/// Paged decode attention, CPU reference: for every sequence b and query head h,
///   o[b, h, :] = softmax_t(sm_scale * <q[b, h, :], K_b[t, g(h), :]>) @ V_b[:, g(h), :],   t in [f_b, kv_len_b),
///   lse[b, h]  = log(sum_t exp(sm_scale * <q[b, h, :], K_b[t, g(h), :]>))                 (natural log),
/// with g(h) = h / (num_qo_heads / num_kv_heads) (GQA / MQA by integer division of heads; group size 1 = MHA),
/// K_b / V_b the tokens of sequence b gathered through its pages, and f_b the first key the query (at position
/// kv_len_b - 1) sees: 0 by default, p.window.first_visible(kv_len_b - 1) with a sliding window and / or
/// chunked-local attention (AttentionWindow, kernel_params.hpp). Tokens before f_b are never read: their pages may be
/// the null block 0 (or any id) in the page table.
/// Parameters (host memory, same struct as the CUDA launcher):
///  - p.q: `[batch, num_qo_heads, head_dim]` contiguous, pool dtype; p.o: same shape/dtype, written;
///  - p.lse: optional (null = not written) `[batch, num_qo_heads]` float32;
///  - p.kv: the pool (any dtype, any head_dim, any strides); p.pages: CSR or padded page table, batch = its
///    batch_size. An empty sequence (no pages / seq_len 0) gets o = 0 and lse = -inf.
///  - p.kv_chunk_size_tokens: 0 = no split (workspace unused, may be null); > 0 = split-KV exactly as documented
///    at the top of this header, partials in p.workspace (p.workspace_bytes >= decode_workspace_bytes(batch,
///    max_num_chunks, num_qo_heads, head_dim)), which is overwritten.
///  - num_threads: worker threads; 0 = default_num_threads(); results are bit-identical for every thread count.
/// Execution: the chunk rule is turned into a work list (plan_decode_uniform_chunks: one item per (sequence, kv
/// head, chunk), partial row b * max_num_chunks + c) and run by the same executor as decode(p, work_list), so the
/// split / merge path of every reference test is the path plan_decode's lists take.
/// Numerics: q, K and V are converted to float32 (an fp8 pool: e4m3 -> float, times k_scale / v_scale, float32);
/// dot products, the online softmax (running max, per chunk) and the V accumulation are float32; o is rounded to
/// its dtype (nearest even) once at the end.
/// Preconditions (not checked): o and lse do not overlap q, the pool, the page table or the workspace; the page
/// table's listed tokens hold finite values (NaN in a slot past a sequence's length is fine: it is never read).
/// Returns kInvalidValue / kUnsupported per `validate(const DecodeParams&)` (or num_threads < 0) before anything
/// is written, else kSuccess. Never throws (an allocation failure of the work list, batch * num_kv_heads *
/// max(1, max_num_chunks) items, or of the per-thread scratch, 4 * head_dim floats + head_dim uint16, terminates).
/// Thread safety: writes o, lse and the workspace only. Complexity: O(sum_b kv_len_b * num_qo_heads * head_dim).
/// Sources: PagedAttention (Kwon et al., SOSP'23) for the paged gather; Flash-Decoding (Dao et al., 2023) and
/// FlashInfer's merge_states for split-KV and the lse merge.
[[nodiscard]] inline Status decode(const DecodeParams& p, int num_threads = 0) noexcept {
  const int nt = detail::resolve_num_threads(num_threads);
  if (nt < 0) return detail::fail(Status::kInvalidValue, "num_threads", " = %d: must be >= 0", num_threads);
  if (const Status s = validate(p); s != Status::kSuccess) return s;
  const std::int32_t batch = p.pages.batch_size;
  const std::int32_t chunks = p.kv_chunk_size_tokens > 0 ? p.max_num_chunks : 0;
  std::vector<std::int32_t> lens(static_cast<std::size_t>(batch));
  for (std::int32_t b = 0; b < batch; ++b) {
    lens[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(detail::seq_pages(p.pages, p.kv.block_size, b).kv_len);
  }
  std::vector<DecodeWorkItem> items(static_cast<std::size_t>(batch) * static_cast<std::size_t>(p.kv.num_kv_heads) *
                                    static_cast<std::size_t>(std::max(chunks, 1)));
  std::vector<DecodeMergeItem> merges(static_cast<std::size_t>(batch));
  const DecodePlanBuffers buf{items, merges, p.kv_chunk_size_tokens > 0 ? batch * chunks : 0};
  if (plan_decode_uniform_chunks(lens, p.kv.num_kv_heads, p.kv_chunk_size_tokens, chunks, buf) != Status::kSuccess) {
    return Status::kInvalidValue;  // unreachable after validate(p)
  }
  const DecodeWorkList wl{items.data(), static_cast<std::int32_t>(items.size()), merges.data(), batch,
                          p.num_qo_heads / p.kv.num_kv_heads, buf.partial_row_capacity};
  detail::dispatch_pool(p.kv, [&]<class T, class KV>(std::type_identity<T>, std::type_identity<KV>) {
    detail::run_work_list<T, KV>(p, wl, nt);
  });
  return Status::kSuccess;
}

/// Paged decode attention executing a work list (pagedkv/decode_plan.hpp), CPU reference: the same math, inputs
/// and outputs as decode(p), but the work split is the list's: each valid item attends its (request, kv head,
/// head tile) to its token range, writing o / lse or a partial row; each valid merge entry merges its rows (see
/// detail::run_work_list). This is what pagedkv::cuda::decode(p, work_list) does on the GPU, item for item.
///  - wl: host memory; its items / merges as plan_decode (or any producer) wrote them. p.kv_chunk_size_tokens and
///    p.max_num_chunks are ignored. p.workspace: >= decode_plan_workspace_bytes(wl.partial_row_capacity,
///    num_qo_heads, head_dim) bytes (host), overwritten at the rows the items name.
/// Returns kInvalidValue / kUnsupported per validate(p, wl) (every item and merge is checked against the page
/// table's lengths: exact coverage, rows, merges) before anything is written, else kSuccess. Thread safety,
/// numerics, preconditions: as decode(p). Allocates during validation (std::bad_alloc terminates).
[[nodiscard]] inline Status decode(const DecodeParams& p, const DecodeWorkList& wl, int num_threads = 0) noexcept {
  const int nt = detail::resolve_num_threads(num_threads);
  if (nt < 0) return detail::fail(Status::kInvalidValue, "num_threads", " = %d: must be >= 0", num_threads);
  if (const Status s = validate(p, wl); s != Status::kSuccess) return s;
  detail::dispatch_pool(p.kv, [&]<class T, class KV>(std::type_identity<T>, std::type_identity<KV>) {
    detail::run_work_list<T, KV>(p, wl, nt);
  });
  return Status::kSuccess;
}

}  // namespace pagedkv::reference
