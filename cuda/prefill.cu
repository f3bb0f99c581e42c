// cuda/prefill.cu: prefill attention launcher and the explicit instantiations of the prefill family (9 kernels).
#include <cmath>

#include <pagedkv/cuda/dispatch.cuh>
#include <pagedkv/cuda/launch.hpp>
#include <pagedkv/cuda/prefill.cuh>

#include "validate.cuh"

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

#define PAGEDKV_INSTANTIATE_PREFILL(T, HD)                                           \
  template Status launch_prefill<T, HD>(const PrefillArgs&, std::int32_t, cudaStream_t); \
  template Status launch_prefill<T, HD, Fp8E4M3>(const PrefillArgs&, std::int32_t, cudaStream_t);
PAGEDKV_CUDA_FOR_EACH_DTYPE_HEAD_DIM(PAGEDKV_INSTANTIATE_PREFILL)
#undef PAGEDKV_INSTANTIATE_PREFILL

}  // namespace detail
}  // namespace v0_1

Status prefill(const PrefillParams& p, Stream stream) noexcept {
  using namespace detail;
  constexpr Status kBad = Status::kInvalidValue;
  if (const Status s = validate_attention(p.q, p.o, p.kv, p.pages, p.num_qo_heads, p.sm_scale, p.window,
                                          p.total_q_tokens);
      s != Status::kSuccess) {
    return s;
  }
  if (p.total_q_tokens < 0) return fail(kBad, "total_q_tokens", " = %d: must be >= 0", p.total_q_tokens);
  if (p.pages.batch_size == 0 && p.total_q_tokens != 0) {
    return fail(kBad, "total_q_tokens", " = %d: must be 0 with batch 0", p.total_q_tokens);
  }
  if (p.total_q_tokens > 0 && p.qo_indptr == nullptr) {
    return fail(kBad, "qo_indptr", " = null with total_q_tokens %d > 0", p.total_q_tokens);
  }
  if (p.num_qo_heads > 65535) return fail(kBad, "num_qo_heads", " = %d: exceeds grid.y 65535", p.num_qo_heads);
  if (p.total_q_tokens == 0 || p.pages.batch_size == 0) return Status::kSuccess;

  return dispatch_dtype_head_dim(p.kv.dtype, p.kv.head_dim, [&]<class T, int HD>() -> Status {
    PrefillArgs a{};
    a.q = p.q;
    a.o = p.o;
    a.lse = p.lse;
    a.qo_indptr = p.qo_indptr;
    a.k = p.kv.k;
    a.v = p.kv.v;
    a.pages = p.pages;
    a.stride_page = p.kv.stride_page;
    a.stride_token = p.kv.stride_token;
    a.stride_head = p.kv.stride_head;
    a.block_size = p.kv.block_size;
    a.num_qo_heads = p.num_qo_heads;
    a.group_size = p.num_qo_heads / p.kv.num_kv_heads;
    const bool fp8 = p.kv.kv_dtype == KVDType::kFp8E4M3;
    a.scale_log2 = p.sm_scale * 1.4426950408889634f * (fp8 ? p.kv.k_scale : 1.f);
    a.v_scale = fp8 ? p.kv.v_scale : 1.f;
    a.window_tokens = p.window.sliding_window_tokens;
    a.chunk_tokens = p.window.attention_chunk_tokens;
    a.total_q_tokens = p.total_q_tokens;
    if (fp8) return launch_prefill<T, HD, Fp8E4M3>(a, p.total_q_tokens, static_cast<cudaStream_t>(stream));
    return launch_prefill<T, HD>(a, p.total_q_tokens, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace pagedkv::cuda
