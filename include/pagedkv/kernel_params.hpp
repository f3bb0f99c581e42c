// pagedkv/kernel_params.hpp: the params structs shared by the CUDA kernels (cuda/, include/pagedkv/cuda/) and the
// CPU reference (include/pagedkv/reference/). Plain C++: no CUDA headers, so host-only code can include it.
//
// Conventions (docs/contract.md sections 3 and 4):
//  - Every tensor is described by a base pointer plus strides in *elements*; offsets are computed in 64 bits.
//    For a KV pool the element is the *storage* element (`KVPoolView::storage_size_bytes()`): 1 byte for an fp8
//    pool, the element dtype's size otherwise.
//  - Page tables come in two forms, both as the manager's batch-metadata builder emits them (int32):
//      CSR (FlashInfer):   indptr [batch + 1], indices [indptr[batch]], last_page_len [batch] in [1, block_size]
//      padded (vLLM/FA):   block_tables [batch, max_blocks_per_seq] (null-block padded), seq_lens [batch]
//    A sequence with no pages (CSR: indptr[b + 1] == indptr[b]; padded: seq_lens[b] == 0) is padding: its output
//    rows are written as 0 and its lse as -inf.
//  - slot = block_id * block_size + offset_in_block (int64); a negative slot means "skip" (padding).
//  - Copy lists are int32 pairs [capacity, 2] (src block, dst block); a pair with src < 0 is padding and skipped.
//  - Launchers never throw: they return `[[nodiscard]] Status` (CUTLASS/CUB convention) so they can sit behind
//    a C boundary.
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include <pagedkv/config.hpp>

namespace pagedkv {

/// Result of a kernel launcher or a reference op. `kSuccess` is 0.
enum class Status : int {
  kSuccess = 0,
  kInvalidValue = 1,  ///< A shape, stride, pointer or count is inconsistent (validated before anything runs).
  kUnsupported = 2,   ///< A dtype / head_dim combination outside the compiled set {fp16, bf16, fp32} x {64, 128, 256},
                      ///< or a dtype / KV storage dtype value that is not an enumerator.
  kCudaError = 3,     ///< A CUDA runtime call or this launch failed (the launcher checks the launch's own return
                      ///< value, never the thread's sticky last-error slot; see docs/kernels.md).
  kNoDevice = 4,      ///< No CUDA device is present.
  kWrongMemorySpace = 5,  ///< A pointer is not in the memory space the op needs: swap_blocks' host side is pageable
                          ///< (not page-locked), or its device side is not device memory. Nothing was queued.
};

/// Name of a status, e.g. "unsupported". Never null.
[[nodiscard]] constexpr const char* to_string(Status s) noexcept {
  switch (s) {
    case Status::kSuccess: return "success";
    case Status::kInvalidValue: return "invalid_value";
    case Status::kUnsupported: return "unsupported";
    case Status::kCudaError: return "cuda_error";
    case Status::kNoDevice: return "no_device";
    case Status::kWrongMemorySpace: return "wrong_memory_space";
  }
  return "unknown_status";
}

/// Which check a failing launcher or reference op refused, on this thread (docs/kernels.md, "Error details").
/// Every CPU reference op and every CUDA launcher that returns a Status other than kSuccess records, just before it
/// returns, the failed check here: `field` names the parameter (a static string such as "kv.block_size",
/// "pages.indptr", "sm_scale"), `message` says the field (with its index where it has one), the bad value and the
/// rule, e.g. "kv.block_size = 0: must be in [1, 65536]" or "pages.indptr[3] = 5: decreases (pages.indptr[2] = 7)".
/// A successful call writes nothing (no cost on the success path), so, like errno, the detail is meaningful only
/// right after a call returned a failure; kCudaError and kNoDevice name the CUDA call and its cudaError_t.
struct StatusDetail {
  Status status = Status::kSuccess;  ///< The status the failing call returned.
  const char* field = "";            ///< The parameter that failed (static storage, never null).
  char message[256] = {};            ///< "<field>[index] = <value>: <rule>" (NUL-terminated, truncated to fit).
};

namespace detail {
#if defined(__GNUC__) || defined(__clang__)
#define PAGEDKV_SHARED_TLS [[gnu::visibility("default")]]
#else
#define PAGEDKV_SHARED_TLS
#endif
/// The per-thread detail. Default visibility, so the header-only reference, libpagedkv_cuda (built with hidden
/// visibility) and the program share one instance per thread (ELF unifies the vague-linkage definitions).
PAGEDKV_SHARED_TLS inline thread_local StatusDetail tls_status_detail{};

/// Records a failed check (status `s`, parameter `field`, then a printf-style "= value: rule" tail appended to the
/// field name) in this thread's StatusDetail and returns `s`. Cold and out of line: only failures pay for it.
#if defined(__GNUC__) || defined(__clang__)
[[gnu::cold, gnu::noinline, gnu::format(printf, 3, 4)]]
#endif
inline Status fail(Status s, const char* field, const char* fmt, ...) noexcept {
  StatusDetail& d = tls_status_detail;
  d.status = s;
  d.field = field;
  const int n = std::snprintf(d.message, sizeof(d.message), "%s", field);
  if (n >= 0 && static_cast<std::size_t>(n) < sizeof(d.message)) {
    va_list ap;
    va_start(ap, fmt);
    (void)std::vsnprintf(d.message + n, sizeof(d.message) - static_cast<std::size_t>(n), fmt, ap);
    va_end(ap);
  }
  return s;
}

/// Prefixes this thread's StatusDetail message with "<what>[index]." (e.g. "layers[3].") to say which element of
/// an array of views failed; the end of the message is truncated if it no longer fits. Cold, out of line.
#if defined(__GNUC__) || defined(__clang__)
[[gnu::cold, gnu::noinline]]
#endif
inline void prefix_detail(const char* what, int index) noexcept {
  StatusDetail& d = tls_status_detail;
  char prefix[64];
  const int n = std::snprintf(prefix, sizeof(prefix), "%s[%d].", what, index);
  if (n <= 0 || static_cast<std::size_t>(n) >= sizeof(prefix)) return;
  const std::size_t len = std::strlen(d.message);
  const std::size_t keep = len + static_cast<std::size_t>(n) < sizeof(d.message) ? len : sizeof(d.message) - 1 - static_cast<std::size_t>(n);
  std::memmove(d.message + n, d.message, keep);
  std::memcpy(d.message, prefix, static_cast<std::size_t>(n));
  d.message[static_cast<std::size_t>(n) + keep] = '\0';
}
}  // namespace detail

/// This thread's detail of the last failing launcher / reference op (see StatusDetail). Never throws.
[[nodiscard]] inline const StatusDetail& last_status_detail() noexcept { return detail::tls_status_detail; }

// The largest KVPoolView::block_size any op accepts is pagedkv::kMaxBlockSize (config.hpp, 65536: the managers
// refuse larger block sizes too); larger values are kInvalidValue (reference and CUDA). Why a bound: the CUDA
// kernels compute token positions and in-block offsets in int32 (a sequence's kv_len = (pages - 1) * block_size +
// last_page_len, `token / block_size`, `page * block_size`); a block size near 2^31 would wrap those negative after
// one page. 2^16 keeps every in-block quantity far from the int32 limit.

/// Element type of q, k, v, o. Storage: fp32 = float, fp16 = IEEE binary16, bf16 = bfloat16 (both 2 bytes).
enum class DType : std::uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

/// Bytes per element of `dt`.
[[nodiscard]] constexpr std::size_t dtype_size_bytes(DType dt) noexcept { return dt == DType::kFloat32 ? 4 : 2; }

/// Storage dtype of a KV pool (docs/contract.md sec. 4, the KV-dtype axis).
///  - kSame: K/V are stored in the element dtype `KVPoolView::dtype` (the dtype of q, o and write_kv's inputs).
///  - kFp8E4M3: K/V are stored as OCP FP8 E4M3FN (1 byte: sign, 4 exponent bits with bias 7, 3 mantissa bits; max
///    finite 448, no infinities, NaN = S.1111.111), with per-tensor scales: write_kv stores e4m3(x / k_scale) for K
///    (v_scale for V) and the attention ops load e4m3_to_float(stored) * scale. q, o and write_kv's key/value stay
///    in `dtype`. Implemented by the CPU reference and the CUDA launchers (the latter compiled, not yet run on a GPU).
enum class KVDType : std::uint8_t { kSame = 0, kFp8E4M3 = 1 };

/// Bytes per stored K/V element of a pool with storage dtype `kv_dt` and element dtype `dt`.
[[nodiscard]] constexpr std::size_t kv_storage_size_bytes(KVDType kv_dt, DType dt) noexcept {
  return kv_dt == KVDType::kFp8E4M3 ? 1 : dtype_size_bytes(dt);
}

/// One layer's paged K/V pool: K and V pages reached through two base pointers and shared strides (elements).
/// Element (block b, token t in block, kv head h, dim d) of K is at k[b*stride_page + t*stride_token +
/// h*stride_head + d] (head_dim is contiguous), likewise for V. Strides and offsets count *storage* elements:
/// bytes = elements * storage_size_bytes() (1 for an fp8 pool, dtype_size_bytes(dtype) otherwise).
/// Memory space: device for the CUDA kernels, host for the reference (pinned host for the host side of
/// swap_blocks). The KV storage fields come last, so aggregate initialization that stops after stride_head keeps
/// working and gives a kSame pool; the factories take them as optional trailing arguments.
struct KVPoolView {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::kFloat16;
  std::int32_t num_blocks = 0;    ///< Blocks in the pool, including the null block 0.
  std::int32_t block_size = 0;    ///< Tokens per block, in [1, kMaxBlockSize] (kInvalidValue otherwise).
  std::int32_t num_kv_heads = 0;
  std::int32_t head_dim = 0;
  std::int64_t stride_page = 0;   ///< Elements between consecutive blocks.
  std::int64_t stride_token = 0;  ///< Elements between consecutive tokens of one block.
  std::int64_t stride_head = 0;   ///< Elements between consecutive kv heads.
  KVDType kv_dtype = KVDType::kSame;  ///< Storage dtype of K/V (see KVDType).
  float k_scale = 1.f;            ///< fp8 only: K is stored as x / k_scale and loaded as stored * k_scale. Finite, > 0.
  float v_scale = 1.f;            ///< fp8 only: likewise for V. Ignored (not validated) for a kSame pool.

  /// Bytes per stored K/V element (1 for fp8, dtype_size_bytes(dtype) otherwise).
  [[nodiscard]] constexpr std::size_t storage_size_bytes() const noexcept {
    return kv_storage_size_bytes(kv_dtype, dtype);
  }
  /// This view with fp8 e4m3 storage and the given scales. Strides and pointers are kept as they are: use the
  /// factories' trailing arguments for an interleaved pool (V's offset depends on the storage size).
  [[nodiscard]] constexpr KVPoolView with_fp8_e4m3(float kscale, float vscale) const noexcept {
    KVPoolView p = *this;
    p.kv_dtype = KVDType::kFp8E4M3;
    p.k_scale = kscale;
    p.v_scale = vscale;
    return p;
  }

  /// Element offset of (block, token_in_block, head, 0), in 64 bits.
  [[nodiscard]] constexpr std::int64_t offset(std::int64_t block, std::int64_t token, std::int64_t head) const noexcept {
    return block * stride_page + token * stride_token + head * stride_head;
  }

  /// NHD interleaved pool `[num_blocks, 2, block_size, num_kv_heads, head_dim]` at `kv` (vLLM/FlashInfer NHD).
  [[nodiscard]] static constexpr KVPoolView nhd(void* kv, DType dt, std::int32_t num_blocks, std::int32_t block_size,
                                                std::int32_t num_kv_heads, std::int32_t head_dim,
                                                KVDType kv_dt = KVDType::kSame, float k_scale = 1.f,
                                                float v_scale = 1.f) noexcept {
    const std::int64_t page = std::int64_t{block_size} * num_kv_heads * head_dim;
    KVPoolView p{kv, nullptr, dt, num_blocks, block_size, num_kv_heads, head_dim, 2 * page,
                 std::int64_t{num_kv_heads} * head_dim, head_dim, kv_dt, k_scale, v_scale};
    p.v = static_cast<char*>(kv) + page * static_cast<std::int64_t>(kv_storage_size_bytes(kv_dt, dt));
    return p;
  }
  /// HND interleaved pool `[num_blocks, 2, num_kv_heads, block_size, head_dim]` at `kv` (FlashInfer HND).
  [[nodiscard]] static constexpr KVPoolView hnd(void* kv, DType dt, std::int32_t num_blocks, std::int32_t block_size,
                                                std::int32_t num_kv_heads, std::int32_t head_dim,
                                                KVDType kv_dt = KVDType::kSame, float k_scale = 1.f,
                                                float v_scale = 1.f) noexcept {
    const std::int64_t page = std::int64_t{block_size} * num_kv_heads * head_dim;
    KVPoolView p{kv, nullptr, dt, num_blocks, block_size, num_kv_heads, head_dim, 2 * page, head_dim,
                 std::int64_t{block_size} * head_dim, kv_dt, k_scale, v_scale};
    p.v = static_cast<char*>(kv) + page * static_cast<std::int64_t>(kv_storage_size_bytes(kv_dt, dt));
    return p;
  }
  /// Separate K and V tensors, each `[num_blocks, block_size, num_kv_heads, head_dim]` (NHD).
  [[nodiscard]] static constexpr KVPoolView separate_nhd(void* k, void* v, DType dt, std::int32_t num_blocks,
                                                         std::int32_t block_size, std::int32_t num_kv_heads,
                                                         std::int32_t head_dim, KVDType kv_dt = KVDType::kSame,
                                                         float k_scale = 1.f, float v_scale = 1.f) noexcept {
    return KVPoolView{k, v, dt, num_blocks, block_size, num_kv_heads, head_dim,
                      std::int64_t{block_size} * num_kv_heads * head_dim, std::int64_t{num_kv_heads} * head_dim,
                      head_dim, kv_dt, k_scale, v_scale};
  }
  /// Separate K and V tensors, each `[num_blocks, num_kv_heads, block_size, head_dim]` (HND).
  [[nodiscard]] static constexpr KVPoolView separate_hnd(void* k, void* v, DType dt, std::int32_t num_blocks,
                                                         std::int32_t block_size, std::int32_t num_kv_heads,
                                                         std::int32_t head_dim, KVDType kv_dt = KVDType::kSame,
                                                         float k_scale = 1.f, float v_scale = 1.f) noexcept {
    return KVPoolView{k, v, dt, num_blocks, block_size, num_kv_heads, head_dim,
                      std::int64_t{block_size} * num_kv_heads * head_dim, head_dim,
                      std::int64_t{block_size} * head_dim, kv_dt, k_scale, v_scale};
  }
};

/// Which page-table convention a `PageTable` carries.
enum class PageTableFormat : std::uint8_t { kCsr = 0, kPadded = 1 };

/// A batch's page table, in either convention (pointers in the kernel's memory space, all int32).
struct PageTable {
  PageTableFormat format = PageTableFormat::kCsr;
  std::int32_t batch_size = 0;
  // CSR: indptr [batch + 1], indices [indptr[batch]], last_page_len [batch] in [1, block_size].
  const std::int32_t* indptr = nullptr;
  const std::int32_t* indices = nullptr;
  const std::int32_t* last_page_len = nullptr;
  // Padded: block_tables [batch, max_blocks_per_seq] row-major, seq_lens [batch] (tokens).
  const std::int32_t* block_tables = nullptr;
  const std::int32_t* seq_lens = nullptr;
  std::int32_t max_blocks_per_seq = 0;

  /// CSR page table (FlashInfer convention).
  [[nodiscard]] static constexpr PageTable csr(std::int32_t batch, const std::int32_t* indptr,
                                               const std::int32_t* indices,
                                               const std::int32_t* last_page_len) noexcept {
    PageTable t;
    t.format = PageTableFormat::kCsr;
    t.batch_size = batch;
    t.indptr = indptr;
    t.indices = indices;
    t.last_page_len = last_page_len;
    return t;
  }
  /// Padded block table + seq_lens (vLLM / FlashAttention convention).
  [[nodiscard]] static constexpr PageTable padded(std::int32_t batch, const std::int32_t* block_tables,
                                                  std::int32_t max_blocks_per_seq,
                                                  const std::int32_t* seq_lens) noexcept {
    PageTable t;
    t.format = PageTableFormat::kPadded;
    t.batch_size = batch;
    t.block_tables = block_tables;
    t.max_blocks_per_seq = max_blocks_per_seq;
    t.seq_lens = seq_lens;
    return t;
  }
};

/// Local-attention mask of one attention layer (a KV-cache group's policy, docs/contract.md sec. 6): which earlier
/// keys a query may see besides causality. Both limits default to 0 = off, so a value-initialized struct (what
/// every params struct holds unless told otherwise) is plain causal attention, exactly the behaviour before these
/// fields existed.
///
/// Semantics. A query at position p (0-based token index within its own sequence) sees the keys at positions t with
///     first_visible(p) <= t <= p,
///     first_visible(p) = max(0,  p - sliding_window_tokens + 1  [when sliding_window_tokens > 0],
///                                floor(p / attention_chunk_tokens) * attention_chunk_tokens  [when > 0]).
///  - sliding_window_tokens = W >= 1 (sliding-window attention: Mistral, Gemma 2/3, gpt-oss): the last W positions,
///    the query's own included: p - W < t <= p, W keys once p >= W - 1. W counts the *visible keys*, like the
///    `sliding_window` of those models' configs as vLLM applies it (it runs FlashAttention with window_size =
///    (W - 1, 0)). FlashInfer's `window_left` counts the keys *left of* the query instead: window_left = W - 1
///    (and window_left = -1 is "off", where here off is 0). W = 1: each query sees only itself.
///  - attention_chunk_tokens = C >= 1 (chunked-local attention, Llama 4's `attention_chunk_size`): positions are cut
///    into chunks [kC, (k + 1)C); a query sees the keys of its own chunk up to itself. Not to be confused with the
///    split-KV chunk DecodeParams::kv_chunk_size_tokens, which only divides the work and never changes the result.
///  - both set: the intersection, which is again one range ending at p.
/// The visible keys are one contiguous range, so the pages wholly before first_visible(p) of the earliest query of a
/// sequence in a launch are never read, by the CPU reference or the CUDA kernels: the page table may hold anything
/// there (the manager writes the null block 0 for blocks a sliding-window group released). Values < 0 are invalid
/// (kInvalidValue from every op that takes them).
struct AttentionWindow {
  std::int32_t sliding_window_tokens = 0;   ///< W: keys visible to a query, itself included; 0 = no sliding window.
  std::int32_t attention_chunk_tokens = 0;  ///< C: chunked-local attention chunk; 0 = no chunking.

  /// True when some key can be masked (W > 0 or C > 0).
  [[nodiscard]] constexpr bool enabled() const noexcept {
    return sliding_window_tokens > 0 || attention_chunk_tokens > 0;
  }
  /// True when both limits are >= 0.
  [[nodiscard]] constexpr bool valid() const noexcept {
    return sliding_window_tokens >= 0 && attention_chunk_tokens >= 0;
  }
  /// first_visible(pos) as defined above (0 when nothing is masked; pos itself when W == 1). Precondition: pos >= 0,
  /// valid(). Pure function.
  [[nodiscard]] constexpr std::int64_t first_visible(std::int64_t pos) const noexcept {
    std::int64_t lo = 0;
    if (sliding_window_tokens > 0 && pos - sliding_window_tokens + 1 > lo) lo = pos - sliding_window_tokens + 1;
    if (attention_chunk_tokens > 0) {
      const std::int64_t chunk_start = pos - pos % attention_chunk_tokens;
      if (chunk_start > lo) lo = chunk_start;
    }
    return lo;
  }
  /// The first key position read for a sequence of kv_len_tokens keys whose last num_queries positions are queries
  /// (decode: num_queries = 1; prefill: q_len): first_visible(kv_len_tokens - num_queries), the earliest query's
  /// first visible key (first_visible is non-decreasing in the position). 0 for an empty sequence or no queries.
  /// Every page wholly before this position (page index < first_needed_token / block_size) is never read: those
  /// page-table entries may be the null block 0. num_queries > kv_len_tokens counts as kv_len_tokens. Precondition:
  /// valid(). Pure function.
  [[nodiscard]] constexpr std::int64_t first_needed_token(std::int64_t kv_len_tokens,
                                                          std::int64_t num_queries) const noexcept {
    if (kv_len_tokens <= 0 || num_queries <= 0) return 0;
    return first_visible(kv_len_tokens - (num_queries < kv_len_tokens ? num_queries : kv_len_tokens));
  }
};

/// write_kv: scatter new K/V rows into pages by slot mapping (vLLM `reshape_and_cache`).
/// key, value: `[num_tokens, num_kv_heads, head_dim]`, row stride `stride_token_elems` (0 = num_kv_heads*head_dim),
/// in the pool's element dtype (`kv.dtype`; an fp8 pool quantizes them on write). slot_mapping: `[num_tokens]` int64; slot < 0 is skipped.
struct WriteKVParams {
  const void* key = nullptr;
  const void* value = nullptr;
  std::int64_t stride_token_elems = 0;
  const std::int64_t* slot_mapping = nullptr;
  std::int32_t num_tokens = 0;
  KVPoolView kv;
};

/// Decode attention: one query token per sequence against its cached tokens (all of them, or those in `window`).
/// q: `[batch, num_qo_heads, head_dim]` contiguous; o: same shape and dtype; lse (optional, may be null):
/// `[batch, num_qo_heads]` float32, natural log of the softmax denominator (after scaling).
/// GQA: query head h reads kv head h / (num_qo_heads / num_kv_heads); num_qo_heads % num_kv_heads == 0.
/// Split-KV (Flash-Decoding): when kv_chunk_size_tokens > 0, each sequence's tokens are cut into chunks of that
/// many tokens, each chunk computed separately and merged by log-sum-exp; 0 lets the implementation choose (the
/// reference then uses no split). Partials go into caller-provided `workspace` (see `decode_workspace_bytes`).
struct DecodeParams {
  const void* q = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  KVPoolView kv;
  PageTable pages;
  std::int32_t num_qo_heads = 0;
  /// Softmax scale applied to q.k, finite and > 0; usually 1 / sqrt(head_dim). No default: 0 (the value-initialized
  /// state), a negative or a non-finite scale is kInvalidValue (reference and CUDA), so a forgotten scale fails
  /// instead of returning unscaled attention.
  float sm_scale = 0.f;
  std::int32_t kv_chunk_size_tokens = 0; ///< Split-KV chunk, tokens; 0 = implementation's choice.
  std::int32_t max_num_chunks = 0;       ///< Upper bound on chunks per sequence the workspace was sized for.
  void* workspace = nullptr;             ///< Scratch in the kernel's memory space, >= decode_workspace_bytes().
  std::size_t workspace_bytes = 0;
  /// Local attention (sliding window / chunked-local): the query of sequence b sits at position kv_len_b - 1 and sees
  /// keys [window.first_visible(kv_len_b - 1), kv_len_b). Default: off (all kv_len_b keys). Last member, so aggregate
  /// initialization that stops earlier keeps working.
  AttentionWindow window;
};

/// Bytes of split-KV scratch a decode launch needs: float32 partial o `[batch, max_num_chunks, num_qo_heads,
/// head_dim]` plus float32 partial lse `[batch, max_num_chunks, num_qo_heads]`.
[[nodiscard]] constexpr std::size_t decode_workspace_bytes(std::int32_t batch, std::int32_t max_num_chunks,
                                                           std::int32_t num_qo_heads, std::int32_t head_dim) noexcept {
  const auto rows = static_cast<std::size_t>(batch) * static_cast<std::size_t>(max_num_chunks) *
                    static_cast<std::size_t>(num_qo_heads);
  return rows * (static_cast<std::size_t>(head_dim) + 1) * sizeof(float);
}

/// Prefill attention over paged KV: ragged queries appended after each sequence's cached prefix.
/// qo_indptr: `[batch + 1]` int32 (same memory space as q); q: `[qo_indptr[batch], num_qo_heads, head_dim]`; o like
/// q; lse optional `[qo_indptr[batch], num_qo_heads]` float32. The page table describes each sequence's full KV
/// (prefix + the new tokens, already written by write_kv), kv_len_b tokens; the i-th query of sequence b sits at
/// position kv_len_b - q_len_b + i and attends to positions <= its own (causal), i.e. q_len_b <= kv_len_b, and, with a
/// window, to positions >= window.first_visible(its position) only.
struct PrefillParams {
  const void* q = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  const std::int32_t* qo_indptr = nullptr;
  std::int32_t total_q_tokens = 0;  ///< qo_indptr[batch], known on the host.
  KVPoolView kv;
  PageTable pages;
  std::int32_t num_qo_heads = 0;
  /// Softmax scale, finite and > 0 (usually 1 / sqrt(head_dim)); 0, negative or non-finite is kInvalidValue, as for
  /// DecodeParams::sm_scale.
  float sm_scale = 0.f;
  /// Local attention: the query at position pos sees keys [window.first_visible(pos), pos]. Default: off (causal
  /// only). Last member (aggregate initialization that stops earlier keeps working).
  AttentionWindow window;
};

/// copy_blocks: whole-block copies (K and V, every given layer) for copy-on-write.
/// layers: `[num_layers]` pool views (host array of views; all layers share shape, dtype and strides);
/// block_mapping: `[capacity, 2]` int32 (src, dst) pairs in the kernel's memory space; pairs with src < 0 skipped.
/// Precondition: no dst appears twice and no dst is also a src (the manager guarantees it).
struct CopyBlocksParams {
  const KVPoolView* layers = nullptr;
  std::int32_t num_layers = 0;
  const std::int32_t* block_mapping = nullptr;
  std::int32_t capacity = 0;
};

/// Direction of a swap.
enum class SwapDirection : std::uint8_t { kDeviceToHost = 0, kHostToDevice = 1 };

/// swap_blocks: batched block moves between a device pool and a pinned-host pool of the same shape (preemption by
/// swapping, vLLM V0). For kDeviceToHost, src = device pool, dst = host pool; the reverse for kHostToDevice.
/// block_mapping: `[num_pairs, 2]` int32 (src block in src pool, dst block in dst pool), host memory.
struct SwapBlocksParams {
  const KVPoolView* src_layers = nullptr;
  const KVPoolView* dst_layers = nullptr;
  std::int32_t num_layers = 0;
  const std::int32_t* block_mapping = nullptr;
  std::int32_t num_pairs = 0;
  SwapDirection direction = SwapDirection::kDeviceToHost;
};

}  // namespace pagedkv
