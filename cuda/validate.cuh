// cuda/validate.cuh (private to pagedkv::cuda): host-side checks shared by the launchers. Each returns
// Status::kSuccess or Status::kInvalidValue; nothing here touches the device.
#pragma once

#include <cstdint>
#include <initializer_list>

#include <pagedkv/cuda/dispatch.cuh>
#include <pagedkv/kernel_params.hpp>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

inline bool valid_dtype(DType dt) {
  return dt == DType::kFloat32 || dt == DType::kFloat16 || dt == DType::kBFloat16;
}

/// Shape and stride checks of one pool view (no alignment). Strides must be non-negative. A pool whose storage
/// dtype is not kSame (fp8 KV on CUDA: not yet implemented; CPU reference only) gives kUnsupported once the
/// shape checks pass (a malformed view stays kInvalidValue).
inline Status validate_pool(const KVPoolView& kv) {
  if (kv.k == nullptr || kv.v == nullptr) return Status::kInvalidValue;
  if (kv.num_blocks <= 0 || kv.block_size <= 0 || kv.num_kv_heads <= 0 || kv.head_dim <= 0) {
    return Status::kInvalidValue;
  }
  if (kv.stride_page < 0 || kv.stride_token < 0 || kv.stride_head < 0) return Status::kInvalidValue;
  // A block's slots must be addressable in int32 slot arithmetic downstream (slot = block * block_size + off).
  if (static_cast<std::int64_t>(kv.num_blocks) * kv.block_size > (std::int64_t{1} << 62)) return Status::kInvalidValue;
  if (kv.kv_dtype != KVDType::kSame) return Status::kUnsupported;  // fp8 KV: CPU reference only for now
  return Status::kSuccess;
}

/// True when the pool's pointers and strides allow `bytes`-wide accesses along head_dim.
inline bool pool_aligned(const KVPoolView& kv, std::size_t bytes) {
  const auto es = static_cast<std::int64_t>(dtype_size_bytes(kv.dtype));
  const auto b = static_cast<std::int64_t>(bytes);
  return is_aligned(kv.k, bytes) && is_aligned(kv.v, bytes) && (kv.stride_page * es) % b == 0 &&
         (kv.stride_token * es) % b == 0 && (kv.stride_head * es) % b == 0 && (kv.head_dim * es) % b == 0;
}

/// Page-table pointer checks for a batch of `pt.batch_size` sequences.
inline Status validate_pages(const PageTable& pt) {
  if (pt.batch_size < 0) return Status::kInvalidValue;
  if (pt.batch_size == 0) return Status::kSuccess;
  if (pt.format == PageTableFormat::kCsr) {
    if (pt.indptr == nullptr || pt.indices == nullptr || pt.last_page_len == nullptr) return Status::kInvalidValue;
  } else if (pt.format == PageTableFormat::kPadded) {
    if (pt.seq_lens == nullptr || pt.max_blocks_per_seq < 0) return Status::kInvalidValue;
    if (pt.max_blocks_per_seq > 0 && pt.block_tables == nullptr) return Status::kInvalidValue;
  } else {
    return Status::kInvalidValue;
  }
  return Status::kSuccess;
}

/// Checks shared by decode and prefill: pool, page table, heads, alignment of q/o/k/v (16 bytes).
inline Status validate_attention(const void* q, const void* o, const KVPoolView& kv, const PageTable& pt,
                                 std::int32_t num_qo_heads) {
  if (pt.batch_size > 0 && (q == nullptr || o == nullptr)) return Status::kInvalidValue;
  if (const Status s = validate_pool(kv); s != Status::kSuccess) return s;
  if (const Status s = validate_pages(pt); s != Status::kSuccess) return s;
  if (num_qo_heads <= 0 || num_qo_heads % kv.num_kv_heads != 0) return Status::kInvalidValue;
  if (!valid_dtype(kv.dtype)) return Status::kUnsupported;
  if (!pool_aligned(kv, 16) || !is_aligned(q, 16) || !is_aligned(o, 16)) return Status::kInvalidValue;
  return Status::kSuccess;
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

/// Same dtype, shape and strides (the copy/swap ops treat all layers alike).
inline bool same_geometry(const KVPoolView& a, const KVPoolView& b) {
  return a.dtype == b.dtype && a.num_blocks == b.num_blocks && a.block_size == b.block_size &&
         a.num_kv_heads == b.num_kv_heads && a.head_dim == b.head_dim && a.stride_page == b.stride_page &&
         a.stride_token == b.stride_token && a.stride_head == b.stride_head;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
