// pagedkv/reference/copy_blocks.hpp: CPU reference of copy_blocks, the whole-block K/V copies that implement
// copy-on-write after a fork (vLLM's `copy_blocks`; the pairs come from the manager's copy list).
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/common.hpp>

namespace pagedkv::reference {

namespace detail {

/// Copies every K and V element (token, head, dim) of block `src_block` of `src` to block `dst_block` of `dst`,
/// row by row (head_dim contiguous elements at a time); bytes between rows (padding of a strided layout) are not
/// touched; the two views may have different strides (e.g. an NHD pool and an HND one). Preconditions: both views
/// valid with the same block shape (`same_block_shape`), both block ids in range, the two blocks do not overlap.
inline void copy_block(const KVPoolView& src, std::int64_t src_block, const KVPoolView& dst,
                       std::int64_t dst_block) noexcept {
  const auto es = static_cast<std::int64_t>(src.storage_size_bytes());  // 1 for fp8 pools: bytes are moved
  const auto row_bytes = static_cast<std::size_t>(src.head_dim * es);
  for (std::int32_t t = 0; t < src.block_size; ++t) {
    for (std::int32_t h = 0; h < src.num_kv_heads; ++h) {
      const std::int64_t s = src.offset(src_block, t, h) * es;
      const std::int64_t d = dst.offset(dst_block, t, h) * es;
      std::memcpy(static_cast<char*>(dst.k) + d, static_cast<const char*>(src.k) + s, row_bytes);
      std::memcpy(static_cast<char*>(dst.v) + d, static_cast<const char*>(src.v) + s, row_bytes);
    }
  }
}

/// Validates a list of (src, dst) block pairs: pairs with src < 0 are padding and ignored; otherwise src in
/// [0, src_num_blocks), dst in [0, dst_num_blocks), and no dst appears twice. With `dst_may_be_src == false`
/// (copies within one pool) no dst may also be the src of any pair. Returns kSuccess or kInvalidValue.
[[nodiscard]] inline Status validate_block_pairs(const std::int32_t* pairs, std::int32_t count,
                                                 std::int32_t src_num_blocks, std::int32_t dst_num_blocks,
                                                 bool dst_may_be_src) noexcept {
  constexpr Status kBad = Status::kInvalidValue;
  std::vector<std::uint8_t> is_dst(static_cast<std::size_t>(dst_num_blocks), 0);
  for (std::int32_t i = 0; i < count; ++i) {
    const std::int32_t s = pairs[2 * i];
    const std::int32_t d = pairs[2 * i + 1];
    if (s < 0) continue;
    if (s >= src_num_blocks) {
      return fail(kBad, "block_mapping", "[%d].src = %d: out of [0, %d) (src num_blocks)", i, s, src_num_blocks);
    }
    if (d < 0 || d >= dst_num_blocks) {
      return fail(kBad, "block_mapping", "[%d].dst = %d: out of [0, %d) (dst num_blocks)", i, d, dst_num_blocks);
    }
    if (is_dst[static_cast<std::size_t>(d)] != 0) {
      return fail(kBad, "block_mapping", "[%d].dst = %d: appears twice as a destination", i, d);
    }
    is_dst[static_cast<std::size_t>(d)] = 1;
  }
  if (!dst_may_be_src) {
    for (std::int32_t i = 0; i < count; ++i) {
      const std::int32_t s = pairs[2 * i];
      if (s >= 0 && is_dst[static_cast<std::size_t>(s)] != 0) {
        return fail(kBad, "block_mapping", "[%d].src = %d: is also a destination (copy order would matter)", i, s);
      }
    }
  }
  return Status::kSuccess;
}

}  // namespace detail

/// Checks a copy_blocks launch without running it (reads the mapping, host memory). kInvalidValue when:
/// num_layers < 0 or capacity < 0; layers is null with num_layers > 0; block_mapping is null with num_layers > 0
/// and capacity > 0; a layer's view is invalid (see `detail::validate_pool`) or differs from layer 0 in dtype,
/// num_blocks, block_size, num_kv_heads, head_dim or strides; a non-padding pair (src >= 0) has src or dst out of
/// [0, num_blocks); a dst appears twice; a dst is also some pair's src. kUnsupported for a dtype that is not an
/// enumerator. The last two rules are the manager's guarantee; the CUDA launcher cannot check them (the mapping
/// is in device memory) and the reference does, so tests catch a bad copy list. Thread safety: reads only.
[[nodiscard]] inline Status validate(const CopyBlocksParams& p) noexcept {
  if (const Status s = detail::validate_copy_blocks_shape(p); s != Status::kSuccess) return s;
  if (p.num_layers == 0 || p.capacity == 0) return Status::kSuccess;
  return detail::validate_block_pairs(p.block_mapping, p.capacity, p.layers[0].num_blocks, p.layers[0].num_blocks,
                                      /*dst_may_be_src=*/false);
}

/// Copies whole blocks within each layer's pool: for every layer l and every pair i with src = block_mapping[2i]
/// >= 0, dst = block_mapping[2i + 1], K and V of block dst become copies of block src (every (token, head, dim)
/// element, bit for bit). Pairs with src < 0 are padding (a fixed-capacity list, graph-replay friendly) and
/// skipped. Nothing else in the pools is written (not even padding bytes of a strided layout).
/// Parameters (host memory here): p.layers `[num_layers]` views sharing shape, dtype and strides;
/// p.block_mapping `[capacity, 2]` int32 (src, dst).
/// Returns kInvalidValue / kUnsupported per `validate(const CopyBlocksParams&)` before anything is written, else
/// kSuccess. Never throws (the num_blocks-byte validation scratch failing to allocate terminates).
/// Thread safety: writes the dst blocks only. Complexity: O(num_layers * pairs * block elements + num_blocks).
/// Source: vLLM's cache_ops copy_blocks (copy-on-write of a shared partial block, PagedAttention sec. 4.4).
[[nodiscard]] inline Status copy_blocks(const CopyBlocksParams& p) noexcept {
  if (const Status s = validate(p); s != Status::kSuccess) return s;
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    for (std::int32_t i = 0; i < p.capacity; ++i) {
      const std::int32_t src = p.block_mapping[2 * i];
      if (src < 0) continue;
      detail::copy_block(p.layers[l], src, p.layers[l], p.block_mapping[2 * i + 1]);
    }
  }
  return Status::kSuccess;
}

}  // namespace pagedkv::reference
