// pagedkv/reference/common.hpp: what the CPU reference ops share: validation of a KV pool view and of a page
// table, a per-sequence view of the page table, the thread-count knob, a small fork-join `parallel_for`, the
// one-place runtime -> compile-time dtype dispatch, and the float32 online-softmax accumulator.
//
// Everything here works on host memory. Nothing here throws (validation reports a `Status`); only `parallel_for`
// allocates (its threads and one `AttnScratch` per thread).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <thread>
#include <type_traits>
#include <vector>

#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/dtype.hpp>

namespace pagedkv::reference {

/// The default worker-thread count of the multi-threaded reference ops: min(std::thread::hardware_concurrency(),
/// 8), at least 1. Thread safety: callable from any thread.
[[nodiscard]] inline int default_num_threads() noexcept {
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw, 1u, 8u));
}

namespace detail {

/// a * b + c in 64 bits; false on overflow (the result is then unspecified). Operands must be >= 0.
[[nodiscard]] inline bool mul_add_ok(std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t* out) noexcept {
  std::int64_t p = 0;
  if (__builtin_mul_overflow(a, b, &p)) return false;
  return !__builtin_add_overflow(p, c, out);
}

/// Elements spanned by one page of `kv` (from element (0, 0, 0, 0) to the last element of the page, inclusive),
/// or -1 when the strides are inconsistent: negative, or two (token, head, dim) coordinates of a page would share
/// an element. A dimension of extent 1 may have any non-negative stride. Precondition: block_size, num_kv_heads
/// and head_dim are positive.
[[nodiscard]] inline std::int64_t page_span_elems(const KVPoolView& kv) noexcept {
  if (kv.stride_page < 0 || kv.stride_token < 0 || kv.stride_head < 0) return -1;
  struct Dim {
    std::int64_t stride;
    std::int64_t extent;
  };
  Dim dims[2] = {{kv.stride_token, kv.block_size}, {kv.stride_head, kv.num_kv_heads}};
  if (dims[0].stride > dims[1].stride) std::swap(dims[0], dims[1]);
  std::int64_t span = kv.head_dim;  // head_dim is contiguous
  for (const Dim& d : dims) {
    if (d.extent == 1) continue;
    if (d.stride < span) return -1;  // this dim's rows would overlap the inner rows
    if (!mul_add_ok(d.stride, d.extent - 1, span, &span)) return -1;
  }
  return span;
}

/// Records the failed check in this thread's StatusDetail and returns `st` (see pagedkv::detail::fail).
using pagedkv::detail::fail;

/// Checks a softmax scale: finite and > 0 (kInvalidValue naming `sm_scale` otherwise). 0 is the value-initialized
/// state of DecodeParams / PrefillParams: accepting it would return unscaled attention with success.
[[nodiscard]] inline Status validate_sm_scale(float sm_scale) noexcept {
  if (!(std::isfinite(sm_scale) && sm_scale > 0.f)) {
    return fail(Status::kInvalidValue, "sm_scale", " = %g: must be finite and > 0 (usually 1 / sqrt(head_dim))",
                static_cast<double>(sm_scale));
  }
  return Status::kSuccess;
}

/// Validates a pool view: dtype (kUnsupported if not one of the three enumerators), kv_dtype (kUnsupported if not
/// a KVDType enumerator; for kFp8E4M3, k_scale and v_scale finite and > 0, else kInvalidValue; strides and extents
/// are then in 1-byte storage elements), non-null and distinct k/v, positive num_blocks/num_kv_heads/head_dim,
/// block_size in [1, kMaxBlockSize], strides that keep the elements of a page distinct and pages apart
/// (stride_page >= page span when num_blocks > 1), 64-bit byte offsets that do not overflow, and K pages that do
/// not overlap V pages (checked for the common same-stride interleaving; V at any offset that lands inside a K page
/// is rejected). Returns kSuccess, kInvalidValue or kUnsupported, with a StatusDetail naming `kv.<field>` on
/// failure. Shared by the CPU reference and the CUDA launchers (cuda/validate.cuh): one rule set for both.
[[nodiscard]] inline Status validate_pool(const KVPoolView& kv) noexcept {
  if (!is_valid_dtype(kv.dtype)) {
    return fail(Status::kUnsupported, "kv.dtype", " = %d: not a DType enumerator (fp32, fp16, bf16)",
                static_cast<int>(kv.dtype));
  }
  if (!is_valid_kv_dtype(kv.kv_dtype)) {
    return fail(Status::kUnsupported, "kv.kv_dtype", " = %d: not a KVDType enumerator (kSame, kFp8E4M3)",
                static_cast<int>(kv.kv_dtype));
  }
  if (kv.kv_dtype == KVDType::kFp8E4M3) {
    const auto good = [](float x) { return std::isfinite(x) && x > 0.f; };
    if (!good(kv.k_scale)) {
      return fail(Status::kInvalidValue, "kv.k_scale", " = %g: an fp8 pool's scale must be finite and > 0",
                  static_cast<double>(kv.k_scale));
    }
    if (!good(kv.v_scale)) {
      return fail(Status::kInvalidValue, "kv.v_scale", " = %g: an fp8 pool's scale must be finite and > 0",
                  static_cast<double>(kv.v_scale));
    }
  }
  if (kv.k == nullptr) return fail(Status::kInvalidValue, "kv.k", " = null: the K pool pointer is required");
  if (kv.v == nullptr) return fail(Status::kInvalidValue, "kv.v", " = null: the V pool pointer is required");
  if (kv.k == kv.v) return fail(Status::kInvalidValue, "kv.v", " = %p: equals kv.k (K and V must differ)", kv.v);
  if (kv.num_blocks <= 0) return fail(Status::kInvalidValue, "kv.num_blocks", " = %d: must be > 0", kv.num_blocks);
  if (kv.block_size <= 0 || kv.block_size > static_cast<std::int32_t>(kMaxBlockSize)) {
    return fail(Status::kInvalidValue, "kv.block_size", " = %d: must be in [1, %d] (kMaxBlockSize)", kv.block_size,
                static_cast<int>(kMaxBlockSize));
  }
  if (kv.num_kv_heads <= 0) {
    return fail(Status::kInvalidValue, "kv.num_kv_heads", " = %d: must be > 0", kv.num_kv_heads);
  }
  if (kv.head_dim <= 0) return fail(Status::kInvalidValue, "kv.head_dim", " = %d: must be > 0", kv.head_dim);
  if (kv.stride_page < 0 || kv.stride_token < 0 || kv.stride_head < 0) {
    const char* f = kv.stride_page < 0 ? "kv.stride_page" : kv.stride_token < 0 ? "kv.stride_token" : "kv.stride_head";
    const std::int64_t v = kv.stride_page < 0 ? kv.stride_page : kv.stride_token < 0 ? kv.stride_token : kv.stride_head;
    return fail(Status::kInvalidValue, f, " = %lld: strides must be >= 0", static_cast<long long>(v));
  }
  const std::int64_t span = page_span_elems(kv);
  if (span < 0) {
    return fail(Status::kInvalidValue, "kv.stride_token",
                " = %lld (kv.stride_head = %lld): two (token, head, dim) elements of a page would share an element",
                static_cast<long long>(kv.stride_token), static_cast<long long>(kv.stride_head));
  }
  if (kv.num_blocks > 1 && kv.stride_page < span) {
    return fail(Status::kInvalidValue, "kv.stride_page", " = %lld: less than one page's span (%lld elements)",
                static_cast<long long>(kv.stride_page), static_cast<long long>(span));
  }
  const auto es = static_cast<std::int64_t>(kv.storage_size_bytes());
  std::int64_t extent = 0;  // elements from the first to one past the last element of the pool (one of K or V)
  std::int64_t extent_bytes = 0;
  if (!mul_add_ok(kv.stride_page, kv.num_blocks - 1, span, &extent) || !mul_add_ok(extent, es, 0, &extent_bytes)) {
    return fail(Status::kInvalidValue, "kv.stride_page", " = %lld: the pool's byte extent (x num_blocks %d) overflows int64",
                static_cast<long long>(kv.stride_page), kv.num_blocks);
  }
  // K/V overlap: compare addresses as integers (the two may be unrelated allocations).
  const auto kb = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(kv.k));
  const auto vb = static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(kv.v));
  const std::int64_t delta = vb - kb;
  const std::int64_t adelta = delta < 0 ? -delta : delta;
  if (adelta < extent_bytes) {
    const std::int64_t span_bytes = span * es;
    bool overlap = false;
    if (kv.num_blocks == 1) {
      overlap = adelta < span_bytes;
    } else {
      const std::int64_t page_bytes = kv.stride_page * es;
      const std::int64_t r = ((delta % page_bytes) + page_bytes) % page_bytes;
      overlap = r < span_bytes || page_bytes - r < span_bytes;
    }
    if (overlap) {
      return fail(Status::kInvalidValue, "kv.v", " = kv.k %+lld bytes: V pages overlap K pages (page span %lld bytes)",
                  static_cast<long long>(delta), static_cast<long long>(span_bytes));
    }
  }
  return Status::kSuccess;
}

/// True when blocks of the two views hold the same elements: same dtype, kv_dtype, block_size, num_kv_heads and
/// head_dim, and for fp8 pools the same k_scale and v_scale (so moving the bytes keeps the dequantized values;
/// strides, num_blocks and pointers may differ).
[[nodiscard]] inline bool same_block_shape(const KVPoolView& a, const KVPoolView& b) noexcept {
  if (a.kv_dtype != b.kv_dtype) return false;
  if (a.kv_dtype == KVDType::kFp8E4M3 && (a.k_scale != b.k_scale || a.v_scale != b.v_scale)) return false;
  return a.dtype == b.dtype && a.block_size == b.block_size && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim;
}

/// True when the two views have the same block shape, strides and num_blocks (the layers of one model).
[[nodiscard]] inline bool same_geometry(const KVPoolView& a, const KVPoolView& b) noexcept {
  return same_block_shape(a, b) && a.num_blocks == b.num_blocks && a.stride_page == b.stride_page &&
         a.stride_token == b.stride_token && a.stride_head == b.stride_head;
}

/// Validates a page table against the pool it indexes, reading it (host memory). Rules:
///  - batch_size >= 0 (0: nothing else is read, pointers may be null); format is kCsr or kPadded.
///  - CSR: indptr and last_page_len non-null; indptr[0] >= 0 and non-decreasing; indices non-null when any page
///    exists; last_page_len[b] in [1, block_size] for every non-empty sequence (it is not read for an empty one);
///    every index that will be read in [0, num_blocks).
///  - Padded: seq_lens non-null; max_blocks_per_seq >= 0; block_tables non-null when max_blocks_per_seq > 0;
///    seq_lens[b] in [0, max_blocks_per_seq * block_size]; the used entries of row b that will be read in
///    [0, num_blocks) (padding entries beyond the ceil(seq_lens[b] / block_size) used ones are not read).
///  - "Will be read": the entries of pages [first_read(b, kv_len_b) / block_size, ceil(kv_len_b / block_size)),
///    first_read being the first token position the op reads for sequence b (0 without a window). Entries of pages
///    wholly before it (the null block 0 of a sliding-window group, or anything else) are never read and not checked.
/// Returns kSuccess or kInvalidValue (with a StatusDetail naming `pages.<field>`, the index and the value).
/// Precondition: `validate_pool(kv) == kSuccess`; first_read(b, len) in [0, len].
template <class FirstRead>
[[nodiscard]] Status validate_page_table(const PageTable& t, const KVPoolView& kv, FirstRead&& first_read) noexcept {
  constexpr Status kBad = Status::kInvalidValue;
  if (t.batch_size < 0) return fail(kBad, "pages.batch_size", " = %d: must be >= 0", t.batch_size);
  if (t.format != PageTableFormat::kCsr && t.format != PageTableFormat::kPadded) {
    return fail(kBad, "pages.format", " = %d: not a PageTableFormat enumerator", static_cast<int>(t.format));
  }
  if (t.batch_size == 0) return Status::kSuccess;
  const auto out_of_range = [&](const char* field, std::int64_t i, std::int32_t id) {
    return fail(kBad, field, "[%lld] = %d: block id out of [0, kv.num_blocks = %d)", static_cast<long long>(i), id,
                kv.num_blocks);
  };
  if (t.format == PageTableFormat::kCsr) {
    if (t.indptr == nullptr) return fail(kBad, "pages.indptr", " = null with batch_size %d > 0", t.batch_size);
    if (t.last_page_len == nullptr) {
      return fail(kBad, "pages.last_page_len", " = null with batch_size %d > 0", t.batch_size);
    }
    if (t.indptr[0] < 0) return fail(kBad, "pages.indptr", "[0] = %d: must be >= 0", t.indptr[0]);
    for (std::int32_t b = 0; b < t.batch_size; ++b) {
      if (t.indptr[b + 1] < t.indptr[b]) {
        return fail(kBad, "pages.indptr", "[%d] = %d: decreases (pages.indptr[%d] = %d)", b + 1, t.indptr[b + 1], b,
                    t.indptr[b]);
      }
    }
    if (t.indptr[t.batch_size] > t.indptr[0] && t.indices == nullptr) {
      return fail(kBad, "pages.indices", " = null with %d pages listed", t.indptr[t.batch_size] - t.indptr[0]);
    }
    for (std::int32_t b = 0; b < t.batch_size; ++b) {
      if (t.indptr[b + 1] == t.indptr[b]) continue;
      if (t.last_page_len[b] < 1 || t.last_page_len[b] > kv.block_size) {
        return fail(kBad, "pages.last_page_len", "[%d] = %d: must be in [1, kv.block_size = %d]", b,
                    t.last_page_len[b], kv.block_size);
      }
      const std::int64_t len = std::int64_t{t.indptr[b + 1] - t.indptr[b] - 1} * kv.block_size + t.last_page_len[b];
      const std::int64_t skip = first_read(b, len) / kv.block_size;
      for (std::int64_t i = t.indptr[b] + skip; i < t.indptr[b + 1]; ++i) {
        if (t.indices[i] < 0 || t.indices[i] >= kv.num_blocks) return out_of_range("pages.indices", i, t.indices[i]);
      }
    }
    return Status::kSuccess;
  }
  if (t.seq_lens == nullptr) return fail(kBad, "pages.seq_lens", " = null with batch_size %d > 0", t.batch_size);
  if (t.max_blocks_per_seq < 0) {
    return fail(kBad, "pages.max_blocks_per_seq", " = %d: must be >= 0", t.max_blocks_per_seq);
  }
  if (t.max_blocks_per_seq > 0 && t.block_tables == nullptr) {
    return fail(kBad, "pages.block_tables", " = null with max_blocks_per_seq %d > 0", t.max_blocks_per_seq);
  }
  const std::int64_t max_len = std::int64_t{t.max_blocks_per_seq} * kv.block_size;
  for (std::int32_t b = 0; b < t.batch_size; ++b) {
    const std::int64_t len = t.seq_lens[b];
    if (len < 0 || len > max_len) {
      return fail(kBad, "pages.seq_lens", "[%d] = %lld: must be in [0, max_blocks_per_seq * block_size = %lld]", b,
                  static_cast<long long>(len), static_cast<long long>(max_len));
    }
    const std::int64_t pages = (len + kv.block_size - 1) / kv.block_size;
    const std::int32_t* row = t.block_tables + std::int64_t{b} * t.max_blocks_per_seq;
    for (std::int64_t i = len > 0 ? first_read(b, len) / kv.block_size : 0; i < pages; ++i) {
      if (row[i] < 0 || row[i] >= kv.num_blocks) {
        return out_of_range("pages.block_tables", std::int64_t{b} * t.max_blocks_per_seq + i, row[i]);
      }
    }
  }
  return Status::kSuccess;
}

/// validate_page_table for an op that reads every token of every sequence (no window): every used entry checked.
[[nodiscard]] inline Status validate_page_table(const PageTable& t, const KVPoolView& kv) noexcept {
  return validate_page_table(t, kv, [](std::int32_t, std::int64_t) { return std::int64_t{0}; });
}

/// Checks a local-attention window: both limits >= 0 (kInvalidValue naming `window.<field>` otherwise).
[[nodiscard]] inline Status validate_window(const AttentionWindow& w) noexcept {
  if (w.sliding_window_tokens < 0) {
    return fail(Status::kInvalidValue, "window.sliding_window_tokens", " = %d: must be >= 0 (0 = off)",
                w.sliding_window_tokens);
  }
  if (w.attention_chunk_tokens < 0) {
    return fail(Status::kInvalidValue, "window.attention_chunk_tokens", " = %d: must be >= 0 (0 = off)",
                w.attention_chunk_tokens);
  }
  return Status::kSuccess;
}

/// Checks the GQA head counts: num_qo_heads > 0 and a multiple of num_kv_heads (> 0, checked by validate_pool).
[[nodiscard]] inline Status validate_heads(std::int32_t num_qo_heads, std::int32_t num_kv_heads) noexcept {
  if (num_qo_heads <= 0 || num_qo_heads % num_kv_heads != 0) {
    return fail(Status::kInvalidValue, "num_qo_heads", " = %d: must be a positive multiple of kv.num_kv_heads = %d",
                num_qo_heads, num_kv_heads);
  }
  return Status::kSuccess;
}

/// Checks a scratch buffer: non-null, aligned to `align` bytes, at least `need` bytes (kInvalidValue naming
/// `workspace` or `workspace_bytes` otherwise). The reference needs 4-byte (float) alignment, the CUDA launchers 16.
[[nodiscard]] inline Status validate_workspace(const void* ws, std::size_t bytes, std::size_t need,
                                               std::size_t align = alignof(float)) noexcept {
  if (ws == nullptr) return fail(Status::kInvalidValue, "workspace", " = null: %zu bytes needed", need);
  if (reinterpret_cast<std::uintptr_t>(ws) % align != 0) {
    return fail(Status::kInvalidValue, "workspace", " = %p: must be %zu-byte aligned", ws, align);
  }
  if (bytes < need) {
    return fail(Status::kInvalidValue, "workspace_bytes", " = %zu: %zu bytes needed", bytes, need);
  }
  return Status::kSuccess;
}

/// The host-side checks of a write_kv launch that read no tensor data (shared by the reference and the CUDA
/// launcher): num_tokens >= 0, stride_token_elems == 0 or >= num_kv_heads * head_dim, and non-null key, value and
/// slot_mapping when num_tokens > 0. Precondition: validate_pool(p.kv) passed.
[[nodiscard]] inline Status validate_write_kv_shape(const WriteKVParams& p) noexcept {
  constexpr Status kBad = Status::kInvalidValue;
  if (p.num_tokens < 0) return fail(kBad, "num_tokens", " = %d: must be >= 0", p.num_tokens);
  const std::int64_t row = std::int64_t{p.kv.num_kv_heads} * p.kv.head_dim;
  if (p.stride_token_elems < 0 || (p.stride_token_elems != 0 && p.stride_token_elems < row)) {
    return fail(kBad, "stride_token_elems", " = %lld: must be 0 (dense) or >= num_kv_heads * head_dim = %lld",
                static_cast<long long>(p.stride_token_elems), static_cast<long long>(row));
  }
  if (p.num_tokens == 0) return Status::kSuccess;
  if (p.key == nullptr) return fail(kBad, "key", " = null with num_tokens %d > 0", p.num_tokens);
  if (p.value == nullptr) return fail(kBad, "value", " = null with num_tokens %d > 0", p.num_tokens);
  if (p.slot_mapping == nullptr) return fail(kBad, "slot_mapping", " = null with num_tokens %d > 0", p.num_tokens);
  return Status::kSuccess;
}

/// The host-side checks of a copy_blocks launch that read no copy list (shared by the reference and the CUDA
/// launcher): num_layers >= 0, capacity >= 0; with num_layers > 0: layers non-null, every layer valid
/// (validate_pool) and of layer 0's geometry (same_geometry), block_mapping non-null when capacity > 0.
[[nodiscard]] inline Status validate_copy_blocks_shape(const CopyBlocksParams& p) noexcept {
  constexpr Status kBad = Status::kInvalidValue;
  if (p.num_layers < 0) return fail(kBad, "num_layers", " = %d: must be >= 0", p.num_layers);
  if (p.capacity < 0) return fail(kBad, "capacity", " = %d: must be >= 0", p.capacity);
  if (p.num_layers == 0) return Status::kSuccess;
  if (p.layers == nullptr) return fail(kBad, "layers", " = null with num_layers %d > 0", p.num_layers);
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    if (const Status s = validate_pool(p.layers[l]); s != Status::kSuccess) {
      pagedkv::detail::prefix_detail("layers", l);  // "layers[l].kv.<field> = ..."
      return s;
    }
    if (!same_geometry(p.layers[l], p.layers[0])) {
      return fail(kBad, "layers", "[%d]: dtype, kv_dtype (fp8 scales), num_blocks, block_size, heads, head_dim or "
                  "strides differ from layers[0] (all layers share one geometry)", l);
    }
  }
  if (p.capacity > 0 && p.block_mapping == nullptr) {
    return fail(kBad, "block_mapping", " = null with capacity %d > 0", p.capacity);
  }
  return Status::kSuccess;
}

/// The host-side checks of a swap_blocks launch that read no block mapping (shared by the reference and the CUDA
/// launcher): num_layers >= 0, num_pairs >= 0, direction an enumerator; with num_layers > 0: src_layers and
/// dst_layers non-null, every view valid, src_layers[l] and dst_layers[l] of the same block shape
/// (same_block_shape; num_blocks and strides may differ); block_mapping non-null when num_pairs > 0.
[[nodiscard]] inline Status validate_swap_blocks_shape(const SwapBlocksParams& p) noexcept {
  constexpr Status kBad = Status::kInvalidValue;
  if (p.num_layers < 0) return fail(kBad, "num_layers", " = %d: must be >= 0", p.num_layers);
  if (p.num_pairs < 0) return fail(kBad, "num_pairs", " = %d: must be >= 0", p.num_pairs);
  if (p.direction != SwapDirection::kDeviceToHost && p.direction != SwapDirection::kHostToDevice) {
    return fail(kBad, "direction", " = %d: not a SwapDirection enumerator", static_cast<int>(p.direction));
  }
  if (p.num_layers == 0) return Status::kSuccess;
  if (p.src_layers == nullptr) return fail(kBad, "src_layers", " = null with num_layers %d > 0", p.num_layers);
  if (p.dst_layers == nullptr) return fail(kBad, "dst_layers", " = null with num_layers %d > 0", p.num_layers);
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    for (int side = 0; side < 2; ++side) {
      if (const Status s = validate_pool(side == 0 ? p.src_layers[l] : p.dst_layers[l]); s != Status::kSuccess) {
        pagedkv::detail::prefix_detail(side == 0 ? "src_layers" : "dst_layers", l);
        return s;
      }
    }
    if (!same_block_shape(p.src_layers[l], p.dst_layers[l])) {
      return fail(kBad, "dst_layers", "[%d]: dtype, kv_dtype (fp8 scales), block_size, num_kv_heads or head_dim "
                  "differ from src_layers[%d]", l, l);
    }
  }
  if (p.num_pairs > 0 && p.block_mapping == nullptr) {
    return fail(kBad, "block_mapping", " = null with num_pairs %d > 0", p.num_pairs);
  }
  return Status::kSuccess;
}

/// One sequence's pages: `block_ids[i]` holds its tokens [i * block_size, (i + 1) * block_size).
struct SeqPages {
  const std::int32_t* block_ids = nullptr;  ///< [ceil(kv_len / block_size)] block ids (host memory).
  std::int64_t kv_len = 0;                  ///< Tokens in the sequence (its KV length).
};

/// The pages of sequence b of a validated page table (both conventions give a contiguous run of block ids).
[[nodiscard]] inline SeqPages seq_pages(const PageTable& t, std::int32_t block_size, std::int32_t b) noexcept {
  if (t.format == PageTableFormat::kCsr) {
    const std::int32_t n = t.indptr[b + 1] - t.indptr[b];
    if (n == 0) return {};
    return {t.indices + t.indptr[b], std::int64_t{n - 1} * block_size + t.last_page_len[b]};
  }
  return {t.block_tables + std::int64_t{b} * t.max_blocks_per_seq, t.seq_lens[b]};
}

/// Resolves the thread-count knob: 0 -> default_num_threads(); negative -> -1 (invalid).
[[nodiscard]] inline int resolve_num_threads(int num_threads) noexcept {
  if (num_threads < 0) return -1;
  return num_threads == 0 ? default_num_threads() : num_threads;
}

/// Per-thread scratch of the attention ops for one head_dim: q, the accumulator, one K row and one V row as
/// float32 (`q`, `acc`, `krow`, `vrow`, head_dim each) and a raw 16-bit row (`raw16`, head_dim).
struct AttnScratch {
  explicit AttnScratch(std::int32_t head_dim)
      : f(4 * static_cast<std::size_t>(head_dim), 0.f), raw16(static_cast<std::size_t>(head_dim), 0), dim(head_dim) {}
  std::vector<float> f;
  std::vector<std::uint16_t> raw16;
  std::int32_t dim;
  [[nodiscard]] float* q() noexcept { return f.data(); }
  [[nodiscard]] float* acc() noexcept { return f.data() + dim; }
  [[nodiscard]] float* krow() noexcept { return f.data() + 2 * static_cast<std::ptrdiff_t>(dim); }
  [[nodiscard]] float* vrow() noexcept { return f.data() + 3 * static_cast<std::ptrdiff_t>(dim); }
};

/// Runs fn(item, scratch) for every item in [0, num_items) on up to `num_threads` threads (the caller's thread
/// included), handing out items dynamically. Each thread owns one `AttnScratch(head_dim)` (not cleared between
/// items). Items must be independent: each writes only its own outputs. If a thread cannot be started, the
/// remaining threads (at least the caller's) do the work. Blocks until all items are done. The result never
/// depends on the thread count, only the timing does.
template <class Fn>
void parallel_for(std::int64_t num_items, int num_threads, std::int32_t head_dim, Fn&& fn) noexcept {
  if (num_items <= 0) return;
  const auto nt = static_cast<int>(std::min<std::int64_t>(std::max(num_threads, 1), num_items));
  std::atomic<std::int64_t> next{0};
  auto worker = [&]() noexcept {
    AttnScratch scratch(head_dim);  // std::bad_alloc here terminates (documented)
    for (;;) {
      const std::int64_t i = next.fetch_add(1, std::memory_order_relaxed);
      if (i >= num_items) break;
      fn(i, scratch);
    }
  };
  std::vector<std::thread> threads;
  if (nt > 1) {
    try {
      threads.reserve(static_cast<std::size_t>(nt - 1));
      for (int i = 1; i < nt; ++i) threads.emplace_back(worker);
    } catch (...) {
      // Fewer threads than asked (resource limit): the ones started, plus this one, finish the work.
    }
  }
  worker();
  for (std::thread& th : threads) th.join();
}

/// Calls fn(std::type_identity<T>{}) with T the element type of `dt` (float, Half or BFloat16): the one place
/// where the runtime dtype becomes a compile-time type. Precondition: is_valid_dtype(dt).
template <class Fn>
decltype(auto) dispatch_dtype(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::kFloat16: return fn(std::type_identity<Half>{});
    case DType::kBFloat16: return fn(std::type_identity<BFloat16>{});
    case DType::kFloat32: break;
  }
  return fn(std::type_identity<float>{});
}

/// Calls fn(std::type_identity<T>{}, std::type_identity<KV>{}) with T the element type of `kv.dtype` and KV the
/// storage type of the pool: T for a kSame pool, Fp8E4M3 for an fp8 pool. Precondition: validate_pool(kv) passed.
template <class Fn>
decltype(auto) dispatch_pool(const KVPoolView& kv, Fn&& fn) {
  return dispatch_dtype(kv.dtype, [&]<class T>(std::type_identity<T> t) -> decltype(auto) {
    if (kv.kv_dtype == KVDType::kFp8E4M3) return fn(t, std::type_identity<Fp8E4M3>{});
    return fn(t, std::type_identity<T>{});
  });
}

/// A K/V storage type: an element type, or Fp8E4M3 (fp8 pools).
template <class KV>
concept KVStorageType = ElementType<KV> || std::same_as<KV, Fp8E4M3>;

/// Float32 online-softmax state for one (query row, head) over a run of keys (Milakov & Gimelshein 2018; the
/// FlashAttention / FlashInfer accumulator): running max `m` of the scaled scores, running denominator `d` =
/// sum exp(s - m), and an unnormalised accumulator acc[head_dim] = sum exp(s - m) * v kept by the caller.
struct OnlineSoftmax {
  float m = -std::numeric_limits<float>::infinity();
  float d = 0.f;
  /// True when no key has been added.
  [[nodiscard]] bool empty() const noexcept { return d == 0.f; }
  /// Natural-log sum of exp of the scaled scores seen so far (-inf when empty).
  [[nodiscard]] float lse() const noexcept { return empty() ? m : m + std::log(d); }
};

/// Converts `n` contiguous elements of type T starting at element `offset` of `base` (host memory) to float32
/// in `out[n]`; `raw16[n]` is scratch for the 16-bit types. Exact (every 16-bit value is a float).
template <ElementType T>
void load_row(const void* base, std::int64_t offset, std::int32_t n, float* out, std::uint16_t* raw16) noexcept {
  const char* src = static_cast<const char*>(base) + offset * static_cast<std::int64_t>(sizeof(T));
  const auto count = static_cast<std::size_t>(n);
  if constexpr (std::same_as<T, float>) {
    std::memcpy(out, src, count * sizeof(float));
  } else {
    std::memcpy(raw16, src, count * sizeof(std::uint16_t));
    for (std::size_t i = 0; i < count; ++i) {
      if constexpr (std::same_as<T, Half>) {
        out[i] = half_bits_to_float(raw16[i]);
      } else {
        out[i] = bf16_bits_to_float(raw16[i]);
      }
    }
  }
}

/// Loads `n` contiguous stored K/V elements of type KV at element `offset` of `base` as float32 into `out[n]`.
/// For an element type: exact conversion (`load_row<KV>`, `scale` unused). For Fp8E4M3: dequantization,
/// out[i] = e4m3_to_float(stored[i]) * scale, one float32 multiply (rounded once; exact unless it under/overflows).
/// `raw16[n]` is scratch (its first n bytes hold the fp8 codes).
template <KVStorageType KV>
void load_kv_row(const void* base, std::int64_t offset, std::int32_t n, float scale, float* out,
                 std::uint16_t* raw16) noexcept {
  if constexpr (std::same_as<KV, Fp8E4M3>) {
    auto* codes = reinterpret_cast<unsigned char*>(raw16);  // char aliasing: fine
    std::memcpy(codes, static_cast<const char*>(base) + offset, static_cast<std::size_t>(n));
    for (std::int32_t i = 0; i < n; ++i) out[i] = kFp8E4M3ToFloat[codes[i]] * scale;
  } else {
    (void)scale;
    load_row<KV>(base, offset, n, out, raw16);
  }
}

/// Adds keys [t_begin, t_end) of a sequence (pages `seq`, kv head `kv_head`) to the online softmax of the query
/// in `sc.q()` (float32, already loaded), accumulating in float32 into `sc.acc()` (caller-zeroed before the first
/// call). Scores are dot(q, k) * sm_scale, accumulated in float32 in order of the head dimension. Only tokens
/// < seq.kv_len are ever read. KV is the pool's storage type (T, or Fp8E4M3: dequantized on load with
/// kv.k_scale / kv.v_scale, see load_kv_row).
template <ElementType T, KVStorageType KV = T>
void attend_range(const KVPoolView& kv, const SeqPages& seq, std::int32_t kv_head, float sm_scale, std::int64_t t_begin,
                  std::int64_t t_end, OnlineSoftmax& st, AttnScratch& sc) noexcept {
  const std::int32_t dim = kv.head_dim;
  const float* q = sc.q();
  float* acc = sc.acc();
  float* krow = sc.krow();
  float* vrow = sc.vrow();
  for (std::int64_t t = t_begin; t < t_end; ++t) {
    const std::int64_t block = seq.block_ids[t / kv.block_size];
    const std::int64_t off = kv.offset(block, t % kv.block_size, kv_head);
    load_kv_row<KV>(kv.k, off, dim, kv.k_scale, krow, sc.raw16.data());
    float s = 0.f;
    for (std::int32_t i = 0; i < dim; ++i) s += q[i] * krow[i];
    s *= sm_scale;
    const float m_new = std::max(st.m, s);
    // exp(-inf - finite) = 0 rescales an empty accumulator; guard the (-inf) - (-inf) case of a -inf score.
    const float scale = st.m == m_new ? 1.f : std::exp(st.m - m_new);
    const float p = s == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(s - m_new);
    st.d = st.d * scale + p;
    st.m = m_new;
    load_kv_row<KV>(kv.v, off, dim, kv.v_scale, vrow, sc.raw16.data());
    for (std::int32_t i = 0; i < dim; ++i) acc[i] = acc[i] * scale + p * vrow[i];
  }
}

}  // namespace detail
}  // namespace pagedkv::reference
