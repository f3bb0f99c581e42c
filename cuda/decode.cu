// cuda/decode.cu: the decode attention launchers (work-list and chunk-rule entry points), decode_plan_config, and
// the explicit instantiations of the decode kernel family (CUDA-core decode kernels for every (dtype, head_dim) and
// KV storage, tensor-core GQA kernels for fp16 / bf16 at head_dim 64 / 128, merge kernels).
#include <cmath>

#include <pagedkv/cuda/decode.cuh>
#include <pagedkv/cuda/dispatch.cuh>
#include <pagedkv/cuda/launch.hpp>

#include "validate.cuh"

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

#define PAGEDKV_INSTANTIATE_DECODE(T, HD)                                                   \
  template Status launch_decode<T, HD>(const DecodeArgs&, std::int32_t, bool, cudaStream_t); \
  template Status launch_decode<T, HD, Fp8E4M3>(const DecodeArgs&, std::int32_t, bool, cudaStream_t);
PAGEDKV_CUDA_FOR_EACH_DTYPE_HEAD_DIM(PAGEDKV_INSTANTIATE_DECODE)
#undef PAGEDKV_INSTANTIATE_DECODE

static_assert(DecodeTraits<__half, 64>::kSlots == decode_row_slots(DType::kFloat16, 64) &&
                  DecodeTraits<__nv_bfloat16, 64>::kSlots == decode_row_slots(DType::kBFloat16, 64) &&
                  DecodeTraits<__half, 128>::kSlots == decode_row_slots(DType::kFloat16, 128) &&
                  DecodeTraits<__half, 256>::kSlots == decode_row_slots(DType::kFloat16, 256) &&
                  DecodeTraits<__nv_bfloat16, 128>::kSlots == decode_row_slots(DType::kBFloat16, 128) &&
                  DecodeTraits<float, 64>::kSlots == decode_row_slots(DType::kFloat32, 64) &&
                  DecodeTraits<float, 128>::kSlots == decode_row_slots(DType::kFloat32, 128) &&
                  DecodeTraits<float, 256>::kSlots == decode_row_slots(DType::kFloat32, 256),
              "decode_row_slots() (launch.hpp) must mirror DecodeTraits<T, HD>::kSlots");

/// The fields of DecodeArgs shared by both modes.
inline DecodeArgs base_args(const DecodeParams& p, std::int32_t heads_per_tile, std::int32_t slots) {
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
  a.num_kv_heads = p.kv.num_kv_heads;
  a.group_size = p.num_qo_heads / p.kv.num_kv_heads;
  a.heads_per_tile = heads_per_tile;
  a.num_head_tiles = decode_num_head_tiles(a.group_size, heads_per_tile);
  a.phases = slots / heads_per_tile;
  const bool fp8 = p.kv.kv_dtype == KVDType::kFp8E4M3;
  a.scale_log2 = p.sm_scale * 1.4426950408889634f * (fp8 ? p.kv.k_scale : 1.f);
  a.v_scale = fp8 ? p.kv.v_scale : 1.f;
  a.window_tokens = p.window.sliding_window_tokens;
  a.chunk_tokens = p.window.attention_chunk_tokens;
  return a;
}

/// Checks shared by both decode entry points (before anything is launched).
inline Status validate_decode_common(const DecodeParams& p) {
  return validate_attention(p.q, p.o, p.kv, p.pages, p.num_qo_heads, p.sm_scale, p.window, p.pages.batch_size);
}

}  // namespace detail
}  // namespace v0_1

Status device_sm_count(int device, std::int32_t* sm_count) noexcept {
  using detail::fail;
  if (sm_count == nullptr) return fail(Status::kInvalidValue, "sm_count", " = null");
  int n = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();
    return fail(Status::kNoDevice, "cudaGetDeviceCount", ": %s, %d devices", cudaGetErrorName(e), n);
  }
  if (device < 0 || device >= n) {
    return fail(Status::kInvalidValue, "device", " = %d: out of [0, %d) (cudaGetDeviceCount)", device, n);
  }
  int v = 0;
  if (const cudaError_t e = cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, device); e != cudaSuccess) {
    return detail::cuda_fail("cudaDeviceGetAttribute", e);
  }
  *sm_count = v;
  return Status::kSuccess;
}

Status decode_plan_config(int device, DType dtype, std::int32_t head_dim, std::int32_t num_qo_heads,
                          std::int32_t num_kv_heads, DecodePlanConfig* cfg) noexcept {
  using namespace detail;
  if (cfg == nullptr) return fail(Status::kInvalidValue, "cfg", " = null");
  if (num_kv_heads <= 0) return fail(Status::kInvalidValue, "num_kv_heads", " = %d: must be > 0", num_kv_heads);
  if (const Status s = reference::detail::validate_heads(num_qo_heads, num_kv_heads); s != Status::kSuccess) return s;
  if (const Status s = check_supported(dtype, head_dim); s != Status::kSuccess) return s;
  std::int32_t sms = 0;
  if (const Status s = device_sm_count(device, &sms); s != Status::kSuccess) return s;
  int current = -1;
  if (const cudaError_t e = cudaGetDevice(&current); e != cudaSuccess) return cuda_fail("cudaGetDevice", e);
  if (current != device) {  // occupancy is a property of the current device
    return fail(Status::kInvalidValue, "device", " = %d: not the calling thread's current device (%d)", device, current);
  }
  int ctas = 0;
  const std::int32_t hpt = decode_heads_per_tile(dtype, head_dim, num_qo_heads / num_kv_heads);
  const Status s = dispatch_dtype_head_dim(dtype, head_dim, [&]<class T, int HD>() -> Status {
    // The kernel launch_decode picks for this tiling (a same-type pool).
    cudaError_t e = cudaSuccess;
    bool mma = false;
    if constexpr (kDecodeUsesMma<T, HD, T>) {
      mma = decode_mma_tile(hpt);
      if (mma) {
        e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, decode_mma_kernel<T, HD>,
                                                          DecodeMmaTraits<T, HD>::kThreads, 0);
      }
    }
    if (!mma) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, decode_kernel<T, HD>, DecodeTraits<T, HD>::kThreads, 0);
    }
    return e == cudaSuccess ? Status::kSuccess : cuda_fail("cudaOccupancyMaxActiveBlocksPerMultiprocessor", e);
  });
  if (s != Status::kSuccess) return s;
  cfg->num_qo_heads = num_qo_heads;
  cfg->num_kv_heads = num_kv_heads;
  cfg->head_dim = head_dim;
  cfg->heads_per_tile = hpt;
  cfg->num_sms = sms;
  cfg->ctas_per_sm = ctas < 1 ? 1 : ctas;
  return Status::kSuccess;
}

Status decode(const DecodeParams& p, Stream stream) noexcept {
  using namespace detail;
  if (const Status s = validate_decode_common(p); s != Status::kSuccess) return s;
  if (p.kv_chunk_size_tokens < 0) {
    return fail(Status::kInvalidValue, "kv_chunk_size_tokens", " = %d: must be >= 0", p.kv_chunk_size_tokens);
  }
  if (p.max_num_chunks < 0 || p.max_num_chunks > 65535) {
    return fail(Status::kInvalidValue, "max_num_chunks", " = %d: must be in [0, 65535] (grid.z)", p.max_num_chunks);
  }
  if (p.kv_chunk_size_tokens > 0 && p.max_num_chunks < 1) {
    return fail(Status::kInvalidValue, "max_num_chunks", " = %d: must be >= 1 with kv_chunk_size_tokens = %d",
                p.max_num_chunks, p.kv_chunk_size_tokens);
  }
  const bool split = p.max_num_chunks >= 2;
  if (split) {
    const std::size_t need =
        decode_workspace_bytes(p.pages.batch_size, p.max_num_chunks, p.num_qo_heads, p.kv.head_dim);
    if (const Status s = reference::detail::validate_workspace(p.workspace, p.workspace_bytes, need, 16);
        s != Status::kSuccess) {
      return s;
    }
  }
  if (p.pages.batch_size == 0) return Status::kSuccess;
  const std::int32_t group = p.num_qo_heads / p.kv.num_kv_heads;
  const std::int32_t hpt = decode_heads_per_tile(p.kv.dtype, p.kv.head_dim, group);
  if (const std::int64_t y = std::int64_t{p.kv.num_kv_heads} * decode_num_head_tiles(group, hpt); y > 65535) {
    return fail(Status::kInvalidValue, "kv.num_kv_heads", " = %d: x %d head tiles = %lld CTAs exceeds grid.y 65535",
                p.kv.num_kv_heads, decode_num_head_tiles(group, hpt), static_cast<long long>(y));
  }

  return dispatch_dtype_head_dim(p.kv.dtype, p.kv.head_dim, [&]<class T, int HD>() -> Status {
    DecodeArgs a = base_args(p, hpt, DecodeTraits<T, HD>::kSlots);
    a.split = split;
    a.chunk_request = p.kv_chunk_size_tokens;
    a.max_num_chunks = split ? p.max_num_chunks : 1;
    if (split) {
      a.ws_o = static_cast<float*>(p.workspace);
      a.ws_lse = a.ws_o + static_cast<std::int64_t>(p.pages.batch_size) * p.max_num_chunks * p.num_qo_heads *
                              p.kv.head_dim;
    }
    if (p.kv.kv_dtype == KVDType::kFp8E4M3) {
      return launch_decode<T, HD, Fp8E4M3>(a, 0, split, static_cast<cudaStream_t>(stream));
    }
    return launch_decode<T, HD>(a, 0, split, static_cast<cudaStream_t>(stream));
  });
}

Status decode(const DecodeParams& p, const DecodeWorkList& wl, Stream stream) noexcept {
  using namespace detail;
  if (const Status s = validate_decode_common(p); s != Status::kSuccess) return s;
  constexpr Status kBad = Status::kInvalidValue;
  if (wl.item_capacity < 0) return fail(kBad, "work_list.item_capacity", " = %d: must be >= 0", wl.item_capacity);
  if (wl.merge_capacity < 0) return fail(kBad, "work_list.merge_capacity", " = %d: must be >= 0", wl.merge_capacity);
  if (wl.partial_row_capacity < 0) {
    return fail(kBad, "work_list.partial_row_capacity", " = %lld: must be >= 0",
                static_cast<long long>(wl.partial_row_capacity));
  }
  if (wl.item_capacity > 0 && (wl.items == nullptr || !is_aligned(wl.items, 16))) {
    return fail(kBad, "work_list.items", " = %p: must be non-null and 16-byte aligned (item_capacity %d)",
                static_cast<const void*>(wl.items), wl.item_capacity);
  }
  if (wl.merge_capacity > 0 && (wl.merges == nullptr || !is_aligned(wl.merges, 16))) {
    return fail(kBad, "work_list.merges", " = %p: must be non-null and 16-byte aligned (merge_capacity %d)",
                static_cast<const void*>(wl.merges), wl.merge_capacity);
  }
  const std::int32_t group = p.num_qo_heads / p.kv.num_kv_heads;
  const std::int32_t slots = decode_row_slots(p.kv.dtype, p.kv.head_dim);
  if (wl.heads_per_tile < 1 || wl.heads_per_tile > group || wl.heads_per_tile > slots) {
    return fail(kBad, "work_list.heads_per_tile", " = %d: must be in [1, min(group %d, decode_row_slots %d)]",
                wl.heads_per_tile, group, slots);
  }
  if (wl.partial_row_capacity > 0) {
    const std::size_t need = decode_plan_workspace_bytes(wl.partial_row_capacity, p.num_qo_heads, p.kv.head_dim);
    if (const Status s = reference::detail::validate_workspace(p.workspace, p.workspace_bytes, need, 16);
        s != Status::kSuccess) {
      return s;
    }
  }
  if (p.pages.batch_size == 0) return Status::kSuccess;

  return dispatch_dtype_head_dim(p.kv.dtype, p.kv.head_dim, [&]<class T, int HD>() -> Status {
    DecodeArgs a = base_args(p, wl.heads_per_tile, DecodeTraits<T, HD>::kSlots);
    a.items = wl.items;
    a.merges = wl.merges;
    a.merge_capacity = wl.merge_capacity;
    a.partial_row_capacity = wl.partial_row_capacity;
    if (wl.partial_row_capacity > 0) {
      a.ws_o = static_cast<float*>(p.workspace);
      a.ws_lse = a.ws_o + static_cast<std::int64_t>(wl.partial_row_capacity) * p.num_qo_heads * p.kv.head_dim;
    }
    const auto s = static_cast<cudaStream_t>(stream);
    if (p.kv.kv_dtype == KVDType::kFp8E4M3) {
      return launch_decode<T, HD, Fp8E4M3>(a, wl.item_capacity, wl.partial_row_capacity > 0, s);
    }
    return launch_decode<T, HD>(a, wl.item_capacity, wl.partial_row_capacity > 0, s);
  });
}

}  // namespace pagedkv::cuda
