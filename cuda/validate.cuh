// cuda/validate.cuh (private to pagedkv::cuda): host-side checks shared by the launchers. Each returns a Status and,
// on failure, records which check failed in the thread's StatusDetail (pagedkv::last_status_detail()); nothing here
// touches the device. The checks that read no tensor data are the CPU reference's own functions
// (reference/common.hpp): one rule set and one message per rule for both implementations.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <pagedkv/cuda/dispatch.cuh>
#include <pagedkv/cuda/launch.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/common.hpp>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

using pagedkv::detail::fail;
using reference::detail::same_block_shape;
using reference::detail::same_geometry;

/// Pool checks: the CPU reference's rule set (reference::detail::validate_pool: enumerators (kUnsupported otherwise),
/// fp8 scales finite and > 0, pointers, extents, block_size <= kMaxBlockSize, strides that keep a page's elements
/// distinct, no 64-bit overflow, K/V pages apart). Both storage dtypes (kSame, kFp8E4M3) are compiled.
inline Status validate_pool(const KVPoolView& kv) { return reference::detail::validate_pool(kv); }

/// kUnsupported naming kv.dtype or kv.head_dim when (dtype, head_dim) is outside the compiled set.
inline Status check_supported(DType dt, std::int32_t head_dim) {
  if (is_supported(dt, head_dim)) return Status::kSuccess;
  if (!reference::is_valid_dtype(dt)) {
    return fail(Status::kUnsupported, "kv.dtype", " = %d: not compiled (fp32, fp16, bf16)", static_cast<int>(dt));
  }
  return fail(Status::kUnsupported, "kv.head_dim", " = %d: not compiled (64, 128, 256)", head_dim);
}

/// True when the pool's pointers and strides allow `bytes`-wide accesses along head_dim.
inline bool pool_aligned(const KVPoolView& kv, std::size_t bytes) {
  const auto es = static_cast<std::int64_t>(kv.storage_size_bytes());
  const auto b = static_cast<std::int64_t>(bytes);
  return is_aligned(kv.k, bytes) && is_aligned(kv.v, bytes) && (kv.stride_page * es) % b == 0 &&
         (kv.stride_token * es) % b == 0 && (kv.stride_head * es) % b == 0 && (kv.head_dim * es) % b == 0;
}

/// Page-table pointer checks for a batch of `pt.batch_size` sequences (the contents are device data: not read).
inline Status validate_pages(const PageTable& pt) {
  constexpr Status kBad = Status::kInvalidValue;
  if (pt.batch_size < 0) return fail(kBad, "pages.batch_size", " = %d: must be >= 0", pt.batch_size);
  if (pt.batch_size == 0) return Status::kSuccess;
  if (pt.format == PageTableFormat::kCsr) {
    if (pt.indptr == nullptr) return fail(kBad, "pages.indptr", " = null with batch_size %d > 0", pt.batch_size);
    if (pt.indices == nullptr) return fail(kBad, "pages.indices", " = null with batch_size %d > 0", pt.batch_size);
    if (pt.last_page_len == nullptr) {
      return fail(kBad, "pages.last_page_len", " = null with batch_size %d > 0", pt.batch_size);
    }
  } else if (pt.format == PageTableFormat::kPadded) {
    if (pt.seq_lens == nullptr) return fail(kBad, "pages.seq_lens", " = null with batch_size %d > 0", pt.batch_size);
    if (pt.max_blocks_per_seq < 0) {
      return fail(kBad, "pages.max_blocks_per_seq", " = %d: must be >= 0", pt.max_blocks_per_seq);
    }
    if (pt.max_blocks_per_seq > 0 && pt.block_tables == nullptr) {
      return fail(kBad, "pages.block_tables", " = null with max_blocks_per_seq %d > 0", pt.max_blocks_per_seq);
    }
  } else {
    return fail(kBad, "pages.format", " = %d: not a PageTableFormat enumerator", static_cast<int>(pt.format));
  }
  return Status::kSuccess;
}

/// Checks shared by decode and prefill: pool, page table, heads, sm_scale, window, supported (dtype, head_dim),
/// alignment of q/o/k/v (16 bytes) and of the pool strides. `rows` = query rows (decode: batch; prefill:
/// total_q_tokens): q and o must be non-null when rows > 0.
inline Status validate_attention(const void* q, const void* o, const KVPoolView& kv, const PageTable& pt,
                                 std::int32_t num_qo_heads, float sm_scale, const AttentionWindow& window,
                                 std::int64_t rows) {
  constexpr Status kBad = Status::kInvalidValue;
  if (const Status s = validate_pool(kv); s != Status::kSuccess) return s;
  if (const Status s = validate_pages(pt); s != Status::kSuccess) return s;
  if (const Status s = reference::detail::validate_heads(num_qo_heads, kv.num_kv_heads); s != Status::kSuccess) {
    return s;
  }
  if (const Status s = reference::detail::validate_sm_scale(sm_scale); s != Status::kSuccess) return s;
  if (const Status s = reference::detail::validate_window(window); s != Status::kSuccess) return s;
  if (rows > 0 && q == nullptr) return fail(kBad, "q", " = null with %lld query rows", static_cast<long long>(rows));
  if (rows > 0 && o == nullptr) return fail(kBad, "o", " = null with %lld query rows", static_cast<long long>(rows));
  if (const Status s = check_supported(kv.dtype, kv.head_dim); s != Status::kSuccess) return s;
  if (!is_aligned(q, 16)) return fail(kBad, "q", " = %p: must be 16-byte aligned", q);
  if (!is_aligned(o, 16)) return fail(kBad, "o", " = %p: must be 16-byte aligned", o);
  if (!pool_aligned(kv, 16)) {
    return fail(kBad, "kv.k", " = %p (kv.v = %p, strides page %lld, token %lld, head %lld elements): the pool pointers "
                "and byte strides must be multiples of 16 bytes", kv.k, kv.v, static_cast<long long>(kv.stride_page),
                static_cast<long long>(kv.stride_token), static_cast<long long>(kv.stride_head));
  }
  return Status::kSuccess;
}

/// kCudaError (or kNoDevice) naming the CUDA call that failed and its error.
inline Status cuda_fail(const char* call, cudaError_t e) {
  const Status s = (e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver) ? Status::kNoDevice
                                                                                 : Status::kCudaError;
  return fail(s, call, ": %s (%s)", cudaGetErrorName(e), cudaGetErrorString(e));
}

/// Widest access (16, 8, 4 or 2 bytes) that every pointer and byte stride allows.
inline int widest_access(std::initializer_list<const void*> ptrs, std::initializer_list<std::int64_t> byte_strides) {
  for (int w : {16, 8, 4}) {
    bool ok = true;
    for (const void* p : ptrs) ok = ok && is_aligned(p, static_cast<std::size_t>(w));
    for (std::int64_t s : byte_strides) ok = ok && (s % w == 0);
    if (ok) return w;
  }
  return 2;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// True when every block's K (and V) region is the dense byte range [0, block_size * num_kv_heads * head_dim)
/// from the block's start: NHD and HND pools, interleaved or separate. Extents of 1 may have any stride.
inline bool block_is_dense(const KVPoolView& kv) {
  struct Dim {
    std::int64_t stride, extent;
  };
  Dim d[2] = {{kv.stride_token, kv.block_size}, {kv.stride_head, kv.num_kv_heads}};
  if (d[0].stride > d[1].stride) {
    const Dim t = d[0];
    d[0] = d[1];
    d[1] = t;
  }
  std::int64_t span = kv.head_dim;
  for (const Dim& x : d) {
    if (x.extent == 1) continue;
    if (x.stride != span) return false;
    span *= x.extent;
  }
  return true;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
