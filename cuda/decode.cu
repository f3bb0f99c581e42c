// cuda/decode.cu: decode attention launcher, split-KV planning, and the explicit instantiations of the decode
// kernel family (9 decode kernels + 9 merge kernels).
#include <cmath>

#include <pagedkv/cuda/decode.cuh>
#include <pagedkv/cuda/dispatch.cuh>
#include <pagedkv/cuda/launch.hpp>

#include "validate.cuh"

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

#define PAGEDKV_INSTANTIATE_DECODE(T, HD) \
  template Status launch_decode<T, HD>(const DecodeArgs&, std::int32_t, cudaStream_t);
PAGEDKV_CUDA_FOR_EACH_DTYPE_HEAD_DIM(PAGEDKV_INSTANTIATE_DECODE)
#undef PAGEDKV_INSTANTIATE_DECODE

/// Row slots of the decode CTA for (dtype, head_dim), without instantiating anything (used by decode_plan).
constexpr std::int32_t decode_slots(DType dt, std::int32_t head_dim) {
  return (dt != DType::kFloat32 && head_dim == 64) ? 16 : 8;
}
static_assert(DecodeTraits<__half, 64>::kSlots == 16 && DecodeTraits<__nv_bfloat16, 64>::kSlots == 16 &&
                  DecodeTraits<__half, 128>::kSlots == 8 && DecodeTraits<__half, 256>::kSlots == 8 &&
                  DecodeTraits<float, 64>::kSlots == 8 && DecodeTraits<float, 128>::kSlots == 8 &&
                  DecodeTraits<float, 256>::kSlots == 8,
              "decode_slots() must mirror DecodeTraits<T, HD>::kSlots");

struct HeadTiling {
  std::int32_t num_head_tiles, heads_per_tile, phases;
};
constexpr HeadTiling head_tiling(std::int32_t group_size, std::int32_t slots) {
  const auto tiles = static_cast<std::int32_t>(ceil_div(group_size, slots));
  const auto per_tile = static_cast<std::int32_t>(ceil_div(group_size, tiles));
  return {tiles, per_tile, slots / per_tile};
}

}  // namespace detail
}  // namespace v0_1

DecodePlan decode_plan(std::int32_t batch_size, std::int32_t max_kv_len_tokens, std::int32_t num_qo_heads,
                       std::int32_t num_kv_heads, std::int32_t head_dim, DType dtype, std::int32_t sm_count) noexcept {
  DecodePlan plan;
  if (batch_size <= 0 || max_kv_len_tokens < 0 || num_kv_heads <= 0 || num_qo_heads <= 0 ||
      num_qo_heads % num_kv_heads != 0 || !is_supported(dtype, head_dim)) {
    return plan;
  }
  const auto tiling = detail::head_tiling(num_qo_heads / num_kv_heads, detail::decode_slots(dtype, head_dim));
  const std::int64_t base = std::int64_t{batch_size} * num_kv_heads * tiling.num_head_tiles;
  plan.num_ctas = base;
  constexpr std::int64_t kChunkQuantum = 256;
  const std::int64_t target = 2 * std::int64_t{sm_count};
  if (sm_count <= 0 || base >= target || max_kv_len_tokens <= kChunkQuantum) return plan;
  const std::int64_t want = detail::ceil_div(target, base);
  std::int64_t chunk = detail::ceil_div(detail::ceil_div(max_kv_len_tokens, want), kChunkQuantum) * kChunkQuantum;
  const std::int64_t chunks = detail::ceil_div(max_kv_len_tokens, chunk);
  if (chunks <= 1) return plan;
  if (chunks > 65535) chunk = detail::ceil_div(max_kv_len_tokens, 65535);
  plan.kv_chunk_size_tokens = static_cast<std::int32_t>(chunk);
  plan.max_num_chunks = static_cast<std::int32_t>(detail::ceil_div(max_kv_len_tokens, chunk));
  plan.workspace_bytes = decode_workspace_bytes(batch_size, plan.max_num_chunks, num_qo_heads, head_dim);
  plan.num_ctas = base * plan.max_num_chunks;
  return plan;
}

Status device_sm_count(int device, std::int32_t* sm_count) noexcept {
  if (sm_count == nullptr) return Status::kInvalidValue;
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return Status::kNoDevice;
  }
  int v = 0;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return Status::kCudaError;
  *sm_count = v;
  return Status::kSuccess;
}

Status decode(const DecodeParams& p, Stream stream) noexcept {
  using namespace detail;
  if (const Status s = validate_attention(p.q, p.o, p.kv, p.pages, p.num_qo_heads); s != Status::kSuccess) return s;
  if (!std::isfinite(p.sm_scale)) return Status::kInvalidValue;
  if (p.kv_chunk_size_tokens < 0 || p.max_num_chunks < 0 || p.max_num_chunks > 65535) return Status::kInvalidValue;
  if (p.kv_chunk_size_tokens > 0 && p.max_num_chunks < 1) return Status::kInvalidValue;
  const bool split = p.max_num_chunks >= 2;
  if (split) {
    if (p.workspace == nullptr || !is_aligned(p.workspace, 16)) return Status::kInvalidValue;
    if (p.workspace_bytes <
        decode_workspace_bytes(p.pages.batch_size, p.max_num_chunks, p.num_qo_heads, p.kv.head_dim)) {
      return Status::kInvalidValue;
    }
  }
  if (!is_supported(p.kv.dtype, p.kv.head_dim)) return Status::kUnsupported;
  if (p.pages.batch_size == 0) return Status::kSuccess;
  if (std::int64_t{p.kv.num_kv_heads} * detail::ceil_div(p.num_qo_heads / p.kv.num_kv_heads, 8) > 65535) {
    return Status::kInvalidValue;  // grid.y limit
  }

  return dispatch_dtype_head_dim(p.kv.dtype, p.kv.head_dim, [&]<class T, int HD>() -> Status {
    using Tr = DecodeTraits<T, HD>;
    const std::int32_t group = p.num_qo_heads / p.kv.num_kv_heads;
    const HeadTiling tiling = head_tiling(group, Tr::kSlots);
    DecodeArgs a{};
    a.q = p.q;
    a.o = p.o;
    a.lse = p.lse;
    a.k = p.kv.k;
    a.v = p.kv.v;
    a.pages = p.pages;
    a.stride_page = p.kv.stride_page;
    a.stride_token = p.kv.stride_token;
    a.stride_head = p.kv.stride_head;
    a.block_size = p.kv.block_size;
    a.num_qo_heads = p.num_qo_heads;
    a.group_size = group;
    a.heads_per_tile = tiling.heads_per_tile;
    a.num_head_tiles = tiling.num_head_tiles;
    a.phases = tiling.phases;
    a.scale_log2 = p.sm_scale * 1.4426950408889634f;
    a.split = split;
    a.chunk_request = p.kv_chunk_size_tokens;
    a.max_num_chunks = split ? p.max_num_chunks : 1;
    if (split) {
      a.ws_o = static_cast<float*>(p.workspace);
      a.ws_lse = a.ws_o + static_cast<std::int64_t>(p.pages.batch_size) * p.max_num_chunks * p.num_qo_heads *
                              p.kv.head_dim;
    }
    return launch_decode<T, HD>(a, p.kv.num_kv_heads, static_cast<cudaStream_t>(stream));
  });
}

}  // namespace pagedkv::cuda
