// pagedkv/reference/prefill.hpp: CPU reference of causal prefill attention over paged KV with ragged queries
// (FlashInfer's BatchPrefillWithPagedKVCache convention: qo_indptr + a page table; the new tokens' K/V are
// already in the pages, written by write_kv).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/common.hpp>

namespace pagedkv::reference {

/// Checks a prefill launch without running it (reads qo_indptr and the page table, host memory). kInvalidValue
/// when: the pool or the page table is invalid (see `detail::validate_pool`, `detail::validate_page_table`);
/// num_qo_heads <= 0 or num_qo_heads % num_kv_heads != 0; sm_scale is not finite; total_q_tokens < 0;
/// qo_indptr is null with batch > 0; qo_indptr[0] != 0, qo_indptr decreases, or qo_indptr[batch] !=
/// total_q_tokens (batch 0: total_q_tokens != 0); q or o is null with total_q_tokens > 0; some sequence has
/// more queries than KV tokens (q_len_b > kv_len_b); p.window has a negative limit. Page-table entries of pages
/// wholly before the first key the sequence's earliest query sees (p.window.first_needed_token(kv_len_b, q_len_b))
/// are never read and not checked (the null block 0 of a sliding-window group, or anything). kUnsupported when the
/// dtype is not one of the three enumerators. Thread safety: reads only.
[[nodiscard]] inline Status validate(const PrefillParams& p) noexcept {
  using detail::fail;
  constexpr Status kBad = Status::kInvalidValue;
  if (const Status s = detail::validate_pool(p.kv); s != Status::kSuccess) return s;
  if (const Status s = detail::validate_window(p.window); s != Status::kSuccess) return s;
  // The first key read for sequence b; 0 (check everything) while qo_indptr is unusable (rejected below anyway).
  const auto first_read = [&](std::int32_t b, std::int64_t len) -> std::int64_t {
    if (!p.window.enabled() || p.qo_indptr == nullptr) return 0;
    const std::int64_t q_len = std::int64_t{p.qo_indptr[b + 1]} - p.qo_indptr[b];
    return q_len < 0 ? 0 : p.window.first_needed_token(len, q_len);
  };
  if (const Status s = detail::validate_page_table(p.pages, p.kv, first_read); s != Status::kSuccess) return s;
  if (const Status s = detail::validate_heads(p.num_qo_heads, p.kv.num_kv_heads); s != Status::kSuccess) return s;
  if (const Status s = detail::validate_sm_scale(p.sm_scale); s != Status::kSuccess) return s;
  if (p.total_q_tokens < 0) return fail(kBad, "total_q_tokens", " = %d: must be >= 0", p.total_q_tokens);
  const std::int32_t batch = p.pages.batch_size;
  if (batch == 0) {
    if (p.total_q_tokens != 0) {
      return fail(kBad, "total_q_tokens", " = %d: must be 0 with batch 0", p.total_q_tokens);
    }
    return Status::kSuccess;
  }
  if (p.qo_indptr == nullptr) return fail(kBad, "qo_indptr", " = null with batch %d > 0", batch);
  if (p.qo_indptr[0] != 0) {
    return fail(kBad, "qo_indptr", "[0] = %d: must be 0 (q row r belongs to the b with qo_indptr[b] <= r)",
                p.qo_indptr[0]);
  }
  for (std::int32_t b = 0; b < batch; ++b) {
    if (p.qo_indptr[b + 1] < p.qo_indptr[b]) {
      return fail(kBad, "qo_indptr", "[%d] = %d: decreases (qo_indptr[%d] = %d)", b + 1, p.qo_indptr[b + 1], b,
                  p.qo_indptr[b]);
    }
    const std::int64_t q_len = p.qo_indptr[b + 1] - p.qo_indptr[b];
    const std::int64_t kv_len = detail::seq_pages(p.pages, p.kv.block_size, b).kv_len;
    if (q_len > kv_len) {
      return fail(kBad, "qo_indptr", "[%d..%d]: sequence %d has q_len %lld > kv_len %lld (the queries' K/V must be in "
                  "the pages: q_len_b <= kv_len_b)", b, b + 1, b, static_cast<long long>(q_len),
                  static_cast<long long>(kv_len));
    }
  }
  if (p.qo_indptr[batch] != p.total_q_tokens) {
    return fail(kBad, "total_q_tokens", " = %d: differs from qo_indptr[%d] = %d", p.total_q_tokens, batch,
                p.qo_indptr[batch]);
  }
  if (p.total_q_tokens > 0 && p.q == nullptr) return fail(kBad, "q", " = null with %d query rows", p.total_q_tokens);
  if (p.total_q_tokens > 0 && p.o == nullptr) return fail(kBad, "o", " = null with %d query rows", p.total_q_tokens);
  return Status::kSuccess;
}

namespace detail {

/// Prefill for one (query row r, qo head h), using the calling thread's scratch.
template <ElementType T, KVStorageType KV = T>
void prefill_one(const PrefillParams& p, std::int32_t r, std::int32_t h, AttnScratch& sc) noexcept {
  const std::int32_t dim = p.kv.head_dim;
  const std::int32_t hq = p.num_qo_heads;
  const std::int32_t batch = p.pages.batch_size;
  // The sequence holding row r: the last b with qo_indptr[b] <= r (skips empty sequences).
  const auto b = static_cast<std::int32_t>(std::upper_bound(p.qo_indptr, p.qo_indptr + batch + 1, r) - p.qo_indptr - 1);
  const SeqPages seq = seq_pages(p.pages, p.kv.block_size, b);
  const std::int64_t q_len = p.qo_indptr[b + 1] - p.qo_indptr[b];
  const std::int64_t pos = seq.kv_len - q_len + (r - p.qo_indptr[b]);  // this query's position, >= 0
  const std::int64_t row = std::int64_t{r} * hq + h;
  float* qf = sc.q();
  float* acc = sc.acc();
  for (std::int32_t i = 0; i < dim; ++i) qf[i] = load_as_float<T>(p.q, row * dim + i);
  std::fill(acc, acc + dim, 0.f);
  OnlineSoftmax st;
  attend_range<T, KV>(p.kv, seq, h / (hq / p.kv.num_kv_heads), p.sm_scale, p.window.first_visible(pos), pos + 1, st,
                      sc);
  const float inv = 1.f / st.d;
  for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, acc[i] * inv);
  if (p.lse != nullptr) p.lse[row] = st.lse();
}

}  // namespace detail

/// Causal prefill attention over paged KV, CPU reference. Sequence b has q_len_b = qo_indptr[b + 1] -
/// qo_indptr[b] new query tokens and kv_len_b KV tokens in its pages (cached prefix + the new tokens); its i-th
/// query (row r = qo_indptr[b] + i) sits at position pos = kv_len_b - q_len_b + i and attends to tokens [f, pos]:
///   o[r, h, :] = softmax_t(sm_scale * <q[r, h, :], K_b[t, g(h), :]>) @ V_b[:, g(h), :],  t in [f, pos],
///   lse[r, h]  = log(sum_{f <= t <= pos} exp(sm_scale * <q[r, h, :], K_b[t, g(h), :]>))   (natural log),
/// with g(h) = h / (num_qo_heads / num_kv_heads) (GQA) and f = p.window.first_visible(pos): 0 by default, the
/// sliding window and / or chunked-local chunk otherwise (AttentionWindow, kernel_params.hpp). Each query has its
/// own f, so the queries of one step may span several chunks or window positions; keys before the earliest query's
/// f are never read (their pages may be the null block 0).
/// Parameters (host memory, same struct as the CUDA launcher):
///  - p.qo_indptr: `[batch + 1]` int32, qo_indptr[0] == 0, non-decreasing, qo_indptr[batch] == p.total_q_tokens;
///  - p.q: `[total_q_tokens, num_qo_heads, head_dim]` contiguous, pool dtype; p.o: same, every row written;
///    p.lse: optional `[total_q_tokens, num_qo_heads]` float32;
///  - p.kv, p.pages: the pool and a CSR or padded page table (batch = pages.batch_size);
///  - num_threads: worker threads over (query row x qo head); 0 = default_num_threads(); bit-identical results
///    for every thread count.
/// Numerics: as `decode` (float32 conversion, float32 online softmax, one rounding of o at the end).
/// Preconditions (not checked): outputs do not overlap inputs; the listed tokens hold finite values.
/// Returns kInvalidValue / kUnsupported per `validate(const PrefillParams&)` (or num_threads < 0) before anything
/// is written, else kSuccess. Never throws (an allocation failure of the per-thread scratch terminates).
/// Thread safety: writes o and lse only. Complexity: O(sum_b q_len_b * kv_len_b * num_qo_heads * head_dim).
/// Source: FlashInfer's paged prefill (qo_indptr + paged KV, causal mask aligned to the end of the sequence);
/// the online softmax of FlashAttention.
[[nodiscard]] inline Status prefill(const PrefillParams& p, int num_threads = 0) noexcept {
  const int nt = detail::resolve_num_threads(num_threads);
  if (nt < 0) return detail::fail(Status::kInvalidValue, "num_threads", " = %d: must be >= 0", num_threads);
  if (const Status s = validate(p); s != Status::kSuccess) return s;
  if (p.pages.batch_size == 0) return Status::kSuccess;
  const std::int64_t items = std::int64_t{p.total_q_tokens} * p.num_qo_heads;
  detail::dispatch_pool(p.kv, [&]<class T, class KV>(std::type_identity<T>, std::type_identity<KV>) {
    detail::parallel_for(items, nt, p.kv.head_dim, [&](std::int64_t item, detail::AttnScratch& s) noexcept {
      detail::prefill_one<T, KV>(p, static_cast<std::int32_t>(item / p.num_qo_heads),
                             static_cast<std::int32_t>(item % p.num_qo_heads), s);
    });
  });
  return Status::kSuccess;
}

}  // namespace pagedkv::reference
