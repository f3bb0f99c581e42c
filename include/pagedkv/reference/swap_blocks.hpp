// pagedkv/reference/swap_blocks.hpp: CPU reference of swap_blocks, the batched block moves between a device pool
// and a pinned-host pool (vLLM V0 preemption by swapping). Here both pools are host memory, so a swap is a
// block copy from the src pool to the dst pool with the same semantics as the CUDA launcher.
#pragma once

#include <algorithm>
#include <cstdint>

#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/common.hpp>
#include <pagedkv/reference/copy_blocks.hpp>

namespace pagedkv::reference {

/// Checks a swap_blocks launch without running it (reads the mapping, host memory). kInvalidValue when:
/// num_layers < 0 or num_pairs < 0; direction is not an enumerator; src_layers or dst_layers is null with
/// num_layers > 0; block_mapping is null with num_layers > 0 and num_pairs > 0; a view is invalid (see
/// `detail::validate_pool`); for some layer l, src_layers[l] and dst_layers[l] differ in dtype, kv_dtype (fp8: k_scale
/// or v_scale), block_size, num_kv_heads or head_dim (num_blocks may differ: the host pool is usually smaller or larger; strides may
/// differ too, a block is copied element by element, as the CUDA launcher allows); a
/// non-padding pair (src >= 0) has src out of [0, src num_blocks) or dst out of [0, dst num_blocks) for some
/// layer; a dst appears twice. kUnsupported for a dtype that is not an enumerator. Thread safety: reads only.
[[nodiscard]] inline Status validate(const SwapBlocksParams& p) noexcept {
  if (const Status s = detail::validate_swap_blocks_shape(p); s != Status::kSuccess) return s;
  if (p.num_layers == 0 || p.num_pairs == 0) return Status::kSuccess;
  std::int32_t min_src_blocks = p.src_layers[0].num_blocks;
  std::int32_t min_dst_blocks = p.dst_layers[0].num_blocks;
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    min_src_blocks = std::min(min_src_blocks, p.src_layers[l].num_blocks);
    min_dst_blocks = std::min(min_dst_blocks, p.dst_layers[l].num_blocks);
  }
  return detail::validate_block_pairs(p.block_mapping, p.num_pairs, min_src_blocks, min_dst_blocks,
                                      /*dst_may_be_src=*/true);
}

/// Moves blocks between two pools of the same block shape, every layer: for each layer l and pair i with
/// src = block_mapping[2i] >= 0 and dst = block_mapping[2i + 1], K and V of block dst of dst_layers[l] become
/// copies of block src of src_layers[l] (bit for bit). The src pool is never written. `direction` only says which
/// side is the device for the CUDA launcher (kDeviceToHost: src = device pool, dst = pinned host pool); the data
/// movement is src -> dst either way. Pairs with src < 0 are skipped (padding), as in copy_blocks.
/// Parameters (all host memory here): p.src_layers, p.dst_layers `[num_layers]` views; p.block_mapping
/// `[num_pairs, 2]` int32 (src block in the src pool, dst block in the dst pool).
/// Precondition (not checked): the src and dst pools do not overlap.
/// Returns kInvalidValue / kUnsupported per `validate(const SwapBlocksParams&)` before anything is written, else
/// kSuccess. Never throws. Thread safety: writes the dst blocks only. Complexity: O(num_layers * pairs * block
/// elements + dst num_blocks). Source: vLLM's swap_blocks (PagedAttention sec. 4.5, swapping).
[[nodiscard]] inline Status swap_blocks(const SwapBlocksParams& p) noexcept {
  if (const Status s = validate(p); s != Status::kSuccess) return s;
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    for (std::int32_t i = 0; i < p.num_pairs; ++i) {
      const std::int32_t src = p.block_mapping[2 * i];
      if (src < 0) continue;
      detail::copy_block(p.src_layers[l], src, p.dst_layers[l], p.block_mapping[2 * i + 1]);
    }
  }
  return Status::kSuccess;
}

}  // namespace pagedkv::reference
