// pagedkv/cuda/dispatch.cuh: the one place where a runtime (dtype, head_dim) becomes compile-time template
// arguments, and the X-macro listing the compiled set for explicit instantiation in cuda/*.cu.
//
// Supported set: dtype {fp32, fp16, bf16} x head_dim {64, 128, 256} (9 combinations per templated family; see
// pagedkv::cuda::is_supported in launch.hpp). Anything else is Status::kUnsupported. Adding an axis multiplies
// every family's instantiations: count before adding (docs/style.md, "Templates").
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include <pagedkv/cuda/common.cuh>

/// Calls X(T, HD) for each compiled (element type, head_dim). Used for explicit instantiation.
#define PAGEDKV_CUDA_FOR_EACH_DTYPE_HEAD_DIM(X) \
  X(float, 64)                                  \
  X(float, 128)                                 \
  X(float, 256)                                 \
  X(__half, 64)                                 \
  X(__half, 128)                                \
  X(__half, 256)                                \
  X(__nv_bfloat16, 64)                          \
  X(__nv_bfloat16, 128)                         \
  X(__nv_bfloat16, 256)

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

template <KernelElement T, class F>
Status dispatch_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return std::forward<F>(f).template operator()<T, 64>();
    case 128: return std::forward<F>(f).template operator()<T, 128>();
    case 256: return std::forward<F>(f).template operator()<T, 256>();
    default: return Status::kUnsupported;
  }
}

/// Runs `f.template operator()<T, HD>()` for the element type of `dt` and `head_dim`, or returns
/// Status::kUnsupported when (dt, head_dim) is outside {fp32, fp16, bf16} x {64, 128, 256}.
template <class F>
Status dispatch_dtype_head_dim(DType dt, int head_dim, F&& f) {
  switch (dt) {
    case DType::kFloat32: return dispatch_head_dim<float>(head_dim, std::forward<F>(f));
    case DType::kFloat16: return dispatch_head_dim<__half>(head_dim, std::forward<F>(f));
    case DType::kBFloat16: return dispatch_head_dim<__nv_bfloat16>(head_dim, std::forward<F>(f));
  }
  return Status::kUnsupported;
}

/// True when p is aligned to `bytes`.
inline bool is_aligned(const void* p, std::size_t bytes) {
  return (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
