// pagedkv/reference/decode.hpp: CPU reference of paged decode attention (one query token per sequence), with the
// same split-KV partitioning and log-sum-exp merge as the CUDA kernel (Flash-Decoding; FlashInfer's
// BatchDecodeWithPagedKVCache + merge_states).
//
// Split-KV, precisely (the CUDA kernel partitions the same way, so partials are comparable chunk by chunk):
//   chunk = kv_chunk_size_tokens (> 0), num_chunks_b = ceil(kv_len_b / chunk) (0 for an empty sequence);
//   chunk c of sequence b covers its tokens [c * chunk, min((c + 1) * chunk, kv_len_b)), never empty;
//   per (b, c, qo head h) the chunk's softmax-normalised output and lse go to the workspace:
//     partial_o   [batch, max_num_chunks, num_qo_heads, head_dim] float32, at the workspace start,
//     partial_lse [batch, max_num_chunks, num_qo_heads]           float32, right after partial_o;
//   slots c >= num_chunks_b are neither written nor read. The merge over c = 0 .. num_chunks_b - 1 (in order) is
//     M = max_c lse_c,  w_c = exp(lse_c - M),  o = sum_c w_c * o_c / sum_c w_c,  lse = M + log(sum_c w_c).
// Where the CUDA launcher differs: with kv_chunk_size_tokens == 0 it may split with a chunk of its own choosing
// (the reference does not split); and a sequence that needs more than max_num_chunks chunks is rejected here
// (kInvalidValue) while the CUDA launcher grows its chunk to ceil(kv_len / max_num_chunks). Whenever the
// reference accepts a launch with kv_chunk_size_tokens > 0, the two partitions are identical.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

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
/// head_dim). kUnsupported when the dtype is not one of the three enumerators (the reference supports every
/// head_dim and every dtype; the CUDA launcher restricts head_dim to {64, 128, 256}). Thread safety: reads only.
[[nodiscard]] inline Status validate(const DecodeParams& p) noexcept {
  if (const Status s = detail::validate_pool(p.kv); s != Status::kSuccess) return s;
  if (detail::validate_page_table(p.pages, p.kv) != Status::kSuccess) return Status::kInvalidValue;
  if (p.num_qo_heads <= 0 || p.num_qo_heads % p.kv.num_kv_heads != 0) return Status::kInvalidValue;
  if (!std::isfinite(p.sm_scale)) return Status::kInvalidValue;
  const std::int32_t batch = p.pages.batch_size;
  if (batch > 0 && (p.q == nullptr || p.o == nullptr)) return Status::kInvalidValue;
  if (p.kv_chunk_size_tokens < 0) return Status::kInvalidValue;
  if (p.kv_chunk_size_tokens > 0) {
    if (p.max_num_chunks < 0) return Status::kInvalidValue;
    for (std::int32_t b = 0; b < batch; ++b) {
      const detail::SeqPages seq = detail::seq_pages(p.pages, p.kv.block_size, b);
      if (num_kv_chunks(seq.kv_len, p.kv_chunk_size_tokens) > p.max_num_chunks) return Status::kInvalidValue;
    }
    const std::size_t need = decode_workspace_bytes(batch, p.max_num_chunks, p.num_qo_heads, p.kv.head_dim);
    if (need > 0) {
      if (p.workspace == nullptr || p.workspace_bytes < need) return Status::kInvalidValue;
      if (reinterpret_cast<std::uintptr_t>(p.workspace) % alignof(float) != 0) return Status::kInvalidValue;
    }
  }
  return Status::kSuccess;
}

namespace detail {

/// Decode for one (sequence b, qo head h), using the calling thread's scratch.
template <ElementType T, KVStorageType KV = T>
void decode_one(const DecodeParams& p, std::int32_t b, std::int32_t h, AttnScratch& sc) noexcept {
  const std::int32_t dim = p.kv.head_dim;
  const std::int32_t hq = p.num_qo_heads;
  const std::int32_t kv_head = h / (hq / p.kv.num_kv_heads);
  const std::int64_t row = std::int64_t{b} * hq + h;  // q/o row; lse index
  float* qf = sc.q();
  float* acc = sc.acc();
  const SeqPages seq = seq_pages(p.pages, p.kv.block_size, b);
  if (seq.kv_len == 0) {  // padding sequence: o = 0, lse = -inf
    for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, 0.f);
    if (p.lse != nullptr) p.lse[row] = -std::numeric_limits<float>::infinity();
    return;
  }
  for (std::int32_t i = 0; i < dim; ++i) qf[i] = load_as_float<T>(p.q, row * dim + i);

  if (p.kv_chunk_size_tokens == 0) {  // no split: one pass over all tokens
    std::fill(acc, acc + dim, 0.f);
    OnlineSoftmax st;
    attend_range<T, KV>(p.kv, seq, kv_head, p.sm_scale, 0, seq.kv_len, st, sc);
    const float inv = 1.f / st.d;
    for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, acc[i] * inv);
    if (p.lse != nullptr) p.lse[row] = st.lse();
    return;
  }

  // Split-KV: partials into the workspace, then the log-sum-exp merge (see the top of this header).
  const std::int64_t chunk = p.kv_chunk_size_tokens;
  const std::int64_t nc = num_kv_chunks(seq.kv_len, chunk);
  auto* ws_o = static_cast<float*>(p.workspace);  // [batch, max_num_chunks, num_qo_heads, head_dim]
  float* ws_lse = ws_o + std::int64_t{p.pages.batch_size} * p.max_num_chunks * hq * dim;  // [batch, chunks, hq]
  const auto ws_row = [&](std::int64_t c) { return (std::int64_t{b} * p.max_num_chunks + c) * hq + h; };
  for (std::int64_t c = 0; c < nc; ++c) {
    std::fill(acc, acc + dim, 0.f);
    OnlineSoftmax st;
    attend_range<T, KV>(p.kv, seq, kv_head, p.sm_scale, c * chunk, std::min((c + 1) * chunk, seq.kv_len), st, sc);
    const float inv = 1.f / st.d;
    float* po = ws_o + ws_row(c) * dim;
    for (std::int32_t i = 0; i < dim; ++i) po[i] = acc[i] * inv;
    ws_lse[ws_row(c)] = st.lse();
  }
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t c = 0; c < nc; ++c) m = std::max(m, ws_lse[ws_row(c)]);
  std::fill(acc, acc + dim, 0.f);
  float sum_w = 0.f;
  for (std::int64_t c = 0; c < nc; ++c) {
    const float w = std::exp(ws_lse[ws_row(c)] - m);
    sum_w += w;
    const float* po = ws_o + ws_row(c) * dim;
    for (std::int32_t i = 0; i < dim; ++i) acc[i] += w * po[i];
  }
  const float inv = 1.f / sum_w;
  for (std::int32_t i = 0; i < dim; ++i) store_from_float<T>(p.o, row * dim + i, acc[i] * inv);
  if (p.lse != nullptr) p.lse[row] = m + std::log(sum_w);
}

}  // namespace detail

/// Paged decode attention, CPU reference: for every sequence b and query head h,
///   o[b, h, :] = softmax_t(sm_scale * <q[b, h, :], K_b[t, g(h), :]>) @ V_b[:, g(h), :],   t in [0, kv_len_b),
///   lse[b, h]  = log(sum_t exp(sm_scale * <q[b, h, :], K_b[t, g(h), :]>))                 (natural log),
/// with g(h) = h / (num_qo_heads / num_kv_heads) (GQA / MQA by integer division of heads; group size 1 = MHA) and
/// K_b / V_b the tokens of sequence b gathered through its pages.
/// Parameters (host memory, same struct as the CUDA launcher):
///  - p.q: `[batch, num_qo_heads, head_dim]` contiguous, pool dtype; p.o: same shape/dtype, written;
///  - p.lse: optional (null = not written) `[batch, num_qo_heads]` float32;
///  - p.kv: the pool (any dtype, any head_dim, any strides); p.pages: CSR or padded page table, batch = its
///    batch_size. An empty sequence (no pages / seq_len 0) gets o = 0 and lse = -inf.
///  - p.kv_chunk_size_tokens: 0 = no split (workspace unused, may be null); > 0 = split-KV exactly as documented
///    at the top of this header, partials in p.workspace (p.workspace_bytes >= decode_workspace_bytes(batch,
///    max_num_chunks, num_qo_heads, head_dim)), which is overwritten.
///  - num_threads: worker threads for the (batch x num_qo_heads) loop; 0 = default_num_threads(); results are
///    bit-identical for every thread count.
/// Numerics: q, K and V are converted to float32 (an fp8 pool: e4m3 -> float, times k_scale / v_scale, float32); dot products, the online softmax (running max, per chunk) and
/// the V accumulation are float32; o is rounded to its dtype (nearest even) once at the end.
/// Preconditions (not checked): o and lse do not overlap q, the pool, the page table or the workspace; the page
/// table's listed tokens hold finite values (NaN in a slot past a sequence's length is fine: it is never read).
/// Returns kInvalidValue / kUnsupported per `validate(const DecodeParams&)` (or num_threads < 0) before anything
/// is written, else kSuccess. Never throws (an allocation failure of the per-thread scratch,
/// 4 * head_dim floats + head_dim uint16, terminates). Thread safety: writes o, lse and the workspace only. Complexity:
/// O(sum_b kv_len_b * num_qo_heads * head_dim). Sources: PagedAttention (Kwon et al., SOSP'23) for the paged gather;
/// Flash-Decoding (Dao et al., 2023) and FlashInfer's merge_states for split-KV and the lse merge.
[[nodiscard]] inline Status decode(const DecodeParams& p, int num_threads = 0) noexcept {
  const int nt = detail::resolve_num_threads(num_threads);
  if (nt < 0) return Status::kInvalidValue;
  if (const Status s = validate(p); s != Status::kSuccess) return s;
  const std::int64_t items = std::int64_t{p.pages.batch_size} * p.num_qo_heads;
  detail::dispatch_pool(p.kv, [&]<class T, class KV>(std::type_identity<T>, std::type_identity<KV>) {
    detail::parallel_for(items, nt, p.kv.head_dim, [&](std::int64_t item, detail::AttnScratch& s) noexcept {
      detail::decode_one<T, KV>(p, static_cast<std::int32_t>(item / p.num_qo_heads),
                            static_cast<std::int32_t>(item % p.num_qo_heads), s);
    });
  });
  return Status::kSuccess;
}

}  // namespace pagedkv::reference
