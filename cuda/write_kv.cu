// cuda/write_kv.cu: write_kv launcher and the explicit instantiations of its kernel (4 access widths).
#include <pagedkv/cuda/launch.hpp>
#include <pagedkv/cuda/write_kv.cuh>

#include "validate.cuh"

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {
template __global__ void write_kv_kernel<16>(const WriteKVArgs);
template __global__ void write_kv_kernel<8>(const WriteKVArgs);
template __global__ void write_kv_kernel<4>(const WriteKVArgs);
template __global__ void write_kv_kernel<2>(const WriteKVArgs);
template __global__ void write_kv_fp8_kernel<float>(const WriteKVFp8Args);
template __global__ void write_kv_fp8_kernel<__half>(const WriteKVFp8Args);
template __global__ void write_kv_fp8_kernel<__nv_bfloat16>(const WriteKVFp8Args);
}  // namespace detail
}  // namespace v0_1

Status write_kv(const WriteKVParams& p, Stream stream) noexcept {
  using namespace detail;
  if (const Status s = validate_pool(p.kv); s != Status::kSuccess) return s;
  if (const Status s = reference::detail::validate_write_kv_shape(p); s != Status::kSuccess) return s;
  if (const Status s = check_supported(p.kv.dtype, p.kv.head_dim); s != Status::kSuccess) return s;
  const std::int64_t row_elems = std::int64_t{p.kv.num_kv_heads} * p.kv.head_dim;
  const std::int64_t src_stride = p.stride_token_elems == 0 ? row_elems : p.stride_token_elems;
  if (p.num_tokens == 0) return Status::kSuccess;
  const auto s = static_cast<cudaStream_t>(stream);
  const dim3 grid(static_cast<unsigned>(p.num_tokens));

  if (p.kv.kv_dtype == KVDType::kFp8E4M3) {  // quantize on write (1-byte storage elements: strides are bytes)
    WriteKVFp8Args f{};
    f.key = p.key;
    f.value = p.value;
    f.src_token_elems = src_stride;
    f.slot_mapping = p.slot_mapping;
    f.k_pool = static_cast<unsigned char*>(p.kv.k);
    f.v_pool = static_cast<unsigned char*>(p.kv.v);
    f.page_bytes = p.kv.stride_page;
    f.token_bytes = p.kv.stride_token;
    f.head_bytes = p.kv.stride_head;
    f.num_slots = std::int64_t{p.kv.num_blocks} * p.kv.block_size;
    f.block_size = p.kv.block_size;
    f.num_kv_heads = p.kv.num_kv_heads;
    f.head_dim = p.kv.head_dim;
    f.k_scale = p.kv.k_scale;
    f.v_scale = p.kv.v_scale;
    switch (p.kv.dtype) {
      case DType::kFloat32: return launch_kernel(write_kv_fp8_kernel<float>, grid, dim3(128), 0, s, f);
      case DType::kFloat16: return launch_kernel(write_kv_fp8_kernel<__half>, grid, dim3(128), 0, s, f);
      case DType::kBFloat16: return launch_kernel(write_kv_fp8_kernel<__nv_bfloat16>, grid, dim3(128), 0, s, f);
    }
    return Status::kUnsupported;  // unreachable: check_supported passed
  }

  const auto es = static_cast<std::int64_t>(dtype_size_bytes(p.kv.dtype));
  WriteKVArgs a{};
  a.key = static_cast<const char*>(p.key);
  a.value = static_cast<const char*>(p.value);
  a.src_token_bytes = src_stride * es;
  a.slot_mapping = p.slot_mapping;
  a.k_pool = static_cast<char*>(p.kv.k);
  a.v_pool = static_cast<char*>(p.kv.v);
  a.page_bytes = p.kv.stride_page * es;
  a.token_bytes = p.kv.stride_token * es;
  a.head_bytes = p.kv.stride_head * es;
  a.num_slots = std::int64_t{p.kv.num_blocks} * p.kv.block_size;
  a.block_size = p.kv.block_size;
  a.num_kv_heads = p.kv.num_kv_heads;
  a.row_bytes = static_cast<std::int32_t>(p.kv.head_dim * es);
  const int w = widest_access({p.key, p.value, p.kv.k, p.kv.v},
                              {a.src_token_bytes, a.page_bytes, a.token_bytes, a.head_bytes, a.row_bytes});
  switch (w) {
    case 16: return launch_kernel(write_kv_kernel<16>, grid, dim3(128), 0, s, a);
    case 8: return launch_kernel(write_kv_kernel<8>, grid, dim3(128), 0, s, a);
    case 4: return launch_kernel(write_kv_kernel<4>, grid, dim3(128), 0, s, a);
    default: return launch_kernel(write_kv_kernel<2>, grid, dim3(128), 0, s, a);
  }
}

}  // namespace pagedkv::cuda
