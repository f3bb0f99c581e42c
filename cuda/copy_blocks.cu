// cuda/copy_blocks.cu: copy_blocks launcher and the explicit instantiations of its kernel (4 access widths).
#include <pagedkv/cuda/copy_blocks.cuh>
#include <pagedkv/cuda/launch.hpp>

#include "validate.cuh"

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {
template __global__ void copy_blocks_kernel<16>(const CopyBlocksArgs);
template __global__ void copy_blocks_kernel<8>(const CopyBlocksArgs);
template __global__ void copy_blocks_kernel<4>(const CopyBlocksArgs);
template __global__ void copy_blocks_kernel<2>(const CopyBlocksArgs);
}  // namespace detail
}  // namespace v0_1

Status copy_blocks(const CopyBlocksParams& p, Stream stream) noexcept {
  using namespace detail;
  if (const Status s = reference::detail::validate_copy_blocks_shape(p); s != Status::kSuccess) return s;
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    if (const Status s = validate_pool(p.layers[l]); s != Status::kSuccess) {
      pagedkv::detail::prefix_detail("layers", l);
      return s;
    }
  }
  if (p.num_layers > 0) {
    if (const Status s = check_supported(p.layers[0].dtype, p.layers[0].head_dim); s != Status::kSuccess) return s;
  }
  if (p.num_layers == 0 || p.capacity == 0) return Status::kSuccess;

  const KVPoolView& g = p.layers[0];
  const auto es = static_cast<std::int64_t>(g.storage_size_bytes());  // fp8 pools: bytes are moved
  CopyBlocksArgs a{};
  a.block_mapping = p.block_mapping;
  a.num_blocks = g.num_blocks;
  a.block_size = g.block_size;
  a.num_kv_heads = g.num_kv_heads;
  a.row_bytes = static_cast<std::int32_t>(g.head_dim * es);
  a.page_bytes = g.stride_page * es;
  a.token_bytes = g.stride_token * es;
  a.head_bytes = g.stride_head * es;
  a.dense = block_is_dense(g);
  int w = 16;
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    const int lw = widest_access({p.layers[l].k, p.layers[l].v},
                                 {a.page_bytes, a.token_bytes, a.head_bytes, a.row_bytes});
    w = lw < w ? lw : w;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  for (std::int32_t l0 = 0; l0 < p.num_layers; l0 += kMaxCopyLayers) {
    const std::int32_t n = (p.num_layers - l0) < kMaxCopyLayers ? p.num_layers - l0 : kMaxCopyLayers;
    for (std::int32_t i = 0; i < n; ++i) {
      a.layers[i] = {static_cast<char*>(p.layers[l0 + i].k), static_cast<char*>(p.layers[l0 + i].v)};
    }
    const dim3 grid(static_cast<unsigned>(p.capacity), static_cast<unsigned>(n));
    Status st = Status::kSuccess;
    switch (w) {
      case 16: st = launch_kernel(copy_blocks_kernel<16>, grid, dim3(256), 0, s, a); break;
      case 8: st = launch_kernel(copy_blocks_kernel<8>, grid, dim3(256), 0, s, a); break;
      case 4: st = launch_kernel(copy_blocks_kernel<4>, grid, dim3(256), 0, s, a); break;
      default: st = launch_kernel(copy_blocks_kernel<2>, grid, dim3(256), 0, s, a); break;
    }
    if (st != Status::kSuccess) return st;
  }
  return Status::kSuccess;
}

}  // namespace pagedkv::cuda
