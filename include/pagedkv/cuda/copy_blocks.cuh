// pagedkv/cuda/copy_blocks.cuh: whole-block copies for copy-on-write (vLLM `copy_blocks`), every layer in one
// launch (up to kMaxCopyLayers per launch), the (src, dst) list read from device memory so a CUDA graph can replay it.
//
// Like write_kv it moves bytes: templated on the access width W only. CTA = (pair, layer). When a block's K
// region is one dense byte range (NHD and HND pools, interleaved or separate) it is copied flat; otherwise row by
// row ((token, head) rows of head_dim elements) through the strides.
#pragma once

#include <pagedkv/cuda/write_kv.cuh>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// Layers handled by one copy_blocks launch (their pointers travel in the kernel parameters: 64 x 16 bytes).
inline constexpr int kMaxCopyLayers = 64;

struct CopyLayerPtrs {
  char* k;
  char* v;
};

/// Kernel arguments of copy_blocks, strides in bytes.
struct CopyBlocksArgs {
  CopyLayerPtrs layers[kMaxCopyLayers];
  const std::int32_t* block_mapping;  // [capacity, 2]
  std::int32_t num_blocks;
  std::int32_t block_size;
  std::int32_t num_kv_heads;
  std::int32_t row_bytes;
  std::int64_t page_bytes, token_bytes, head_bytes;
  bool dense;                 // a block's K (and V) is the byte range [0, block_size * num_kv_heads * row_bytes)
};

/// grid = (capacity, layers in this launch), block = 256.
template <int W>
__global__ void __launch_bounds__(256) copy_blocks_kernel(const CopyBlocksArgs a) {
  using V = typename Word<W>::type;
  const std::int32_t src = a.block_mapping[2 * static_cast<std::int64_t>(blockIdx.x)];
  const std::int32_t dst = a.block_mapping[2 * static_cast<std::int64_t>(blockIdx.x) + 1];
  if (src < 0 || dst < 0 || src >= a.num_blocks || dst >= a.num_blocks) return;
  const CopyLayerPtrs lp = a.layers[blockIdx.y];
  const std::int64_t src_off = std::int64_t{src} * a.page_bytes;
  const std::int64_t dst_off = std::int64_t{dst} * a.page_bytes;
  const int vecs_per_row = a.row_bytes / W;
  const std::int64_t n = std::int64_t{a.block_size} * a.num_kv_heads * vecs_per_row;
  for (std::int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    std::int64_t off = i * W;
    if (!a.dense) {
      const std::int64_t row = i / vecs_per_row;
      const std::int64_t c = i - row * vecs_per_row;
      const std::int64_t tok = row / a.num_kv_heads;
      const std::int64_t h = row - tok * a.num_kv_heads;
      off = tok * a.token_bytes + h * a.head_bytes + c * W;
    }
    const V kx = *reinterpret_cast<const V*>(lp.k + src_off + off);
    const V vx = *reinterpret_cast<const V*>(lp.v + src_off + off);
    *reinterpret_cast<V*>(lp.k + dst_off + off) = kx;
    *reinterpret_cast<V*>(lp.v + dst_off + off) = vx;
  }
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
