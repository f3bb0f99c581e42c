// pagedkv/kv_pool_view.hpp: the kernels' view of a KV pool made from the manager's configuration, so the block
// size and block count the manager hands out ids for are the ones the kernels address (a mismatch wrote K/V into
// the wrong block and returned success).
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>

#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/kernel_params.hpp>

namespace pagedkv {

/// Memory layout of one layer's K/V pool (the KVPoolView factories): interleaved K and V pages
/// `[num_blocks, 2, ...]`, or separate K and V tensors; NHD (`[block_size, num_kv_heads, head_dim]` per page, vLLM,
/// FlashInfer's default) or HND (`[num_kv_heads, block_size, head_dim]`, FlashInfer HND).
enum class KVLayout : std::uint8_t { kNhd = 0, kHnd = 1, kSeparateNhd = 2, kSeparateHnd = 3 };

/// What a pool view needs besides the manager's configuration: element and storage dtype, heads, head size.
struct KVPoolShape {
  DType dtype = DType::kBFloat16;     ///< Element dtype of q / k / v / o.
  std::int32_t num_kv_heads = 0;      ///< KV heads of one layer (> 0).
  std::int32_t head_dim = 0;          ///< Elements per head (> 0).
  KVDType kv_dtype = KVDType::kSame;  ///< Storage dtype (kFp8E4M3: 1 byte per element, scaled by k_scale/v_scale).
  float k_scale = 1.f;                ///< fp8 only.
  float v_scale = 1.f;                ///< fp8 only.
};

/// A manager configuration a pool view is made from: `CacheConfig` or `HybridCacheConfig` (any type with
/// `num_blocks` in blocks, the null block included, and `block_size` in tokens).
template <class C>
concept PoolConfig = requires(const C& c) {
  { c.num_blocks } -> std::convertible_to<std::size_t>;
  { c.block_size } -> std::convertible_to<std::uint32_t>;
};

/// Bytes of one layer's K + V pool for `config` and `shape`: num_blocks * 2 * block_size * num_kv_heads * head_dim
/// * storage bytes per element. Throws kInvalidArgument (non-positive heads / head size) or kLimitExceeded (the
/// product overflows size_t).
template <PoolConfig C>
[[nodiscard]] std::size_t kv_pool_bytes(const C& config, const KVPoolShape& shape) {
  if (shape.num_kv_heads <= 0 || shape.head_dim <= 0) {
    detail::raise(Errc::kInvalidArgument, "kv_pool_bytes: num_kv_heads = " + std::to_string(shape.num_kv_heads) +
                                              ", head_dim = " + std::to_string(shape.head_dim) + ": both must be > 0");
  }
  const std::size_t factors[] = {static_cast<std::size_t>(config.num_blocks), 2,
                                 static_cast<std::size_t>(config.block_size),
                                 static_cast<std::size_t>(shape.num_kv_heads),
                                 static_cast<std::size_t>(shape.head_dim),
                                 kv_storage_size_bytes(shape.kv_dtype, shape.dtype)};
  std::size_t bytes = 1;
  for (std::size_t f : factors) {
    if (f != 0 && bytes > static_cast<std::size_t>(-1) / f) {
      detail::raise(Errc::kLimitExceeded, "kv_pool_bytes: the pool of " + std::to_string(config.num_blocks) +
                                              " blocks overflows size_t");
    }
    bytes *= f;
  }
  return bytes;
}

/// The kernels' view of one layer's pool for a manager configured by `config`: `num_blocks` and `block_size`
/// taken from the configuration, so the slot mapping and block ids the manager writes address this pool.
/// `k` is the pool (interleaved layouts, `v` must be null) or the K tensor (separate layouts, `v` the V tensor);
/// memory space as the kernel needs it (device for CUDA, host for the reference). Throws kInvalidArgument (a null
/// pointer, `v` given for an interleaved layout or missing for a separate one, non-positive heads / head size, a
/// block size outside [1, kMaxBlockSize]) or kLimitExceeded (num_blocks beyond int32), naming the value.
template <PoolConfig C>
[[nodiscard]] KVPoolView make_kv_pool_view(const C& config, KVLayout layout, void* k, void* v,
                                           const KVPoolShape& shape) {
  const bool separate = layout == KVLayout::kSeparateNhd || layout == KVLayout::kSeparateHnd;
  if (k == nullptr || (separate && v == nullptr)) {
    detail::raise(Errc::kInvalidArgument, std::string("make_kv_pool_view: ") +
                                              (k == nullptr ? "k" : "v") + " is null");
  }
  if (!separate && v != nullptr) {
    detail::raise(Errc::kInvalidArgument, "make_kv_pool_view: v is given for an interleaved layout (V lies after K "
                                          "in each page: pass v = nullptr)");
  }
  if (shape.num_kv_heads <= 0 || shape.head_dim <= 0) {
    detail::raise(Errc::kInvalidArgument, "make_kv_pool_view: num_kv_heads = " + std::to_string(shape.num_kv_heads) +
                                              ", head_dim = " + std::to_string(shape.head_dim) + ": both must be > 0");
  }
  if (config.block_size == 0 || config.block_size > kMaxBlockSize) {
    detail::raise(Errc::kInvalidArgument, "make_kv_pool_view: block_size = " + std::to_string(config.block_size) +
                                              ": must be in [1, kMaxBlockSize = " + std::to_string(kMaxBlockSize) +
                                              "]");
  }
  if (config.num_blocks > static_cast<std::size_t>(INT32_MAX)) {
    detail::raise(Errc::kLimitExceeded, "make_kv_pool_view: num_blocks = " + std::to_string(config.num_blocks) +
                                            " exceeds the int32 block count of a pool view");
  }
  const auto nb = static_cast<std::int32_t>(config.num_blocks);
  const auto bs = static_cast<std::int32_t>(config.block_size);
  switch (layout) {
    case KVLayout::kNhd:
      return KVPoolView::nhd(k, shape.dtype, nb, bs, shape.num_kv_heads, shape.head_dim, shape.kv_dtype,
                             shape.k_scale, shape.v_scale);
    case KVLayout::kHnd:
      return KVPoolView::hnd(k, shape.dtype, nb, bs, shape.num_kv_heads, shape.head_dim, shape.kv_dtype,
                             shape.k_scale, shape.v_scale);
    case KVLayout::kSeparateNhd:
      return KVPoolView::separate_nhd(k, v, shape.dtype, nb, bs, shape.num_kv_heads, shape.head_dim, shape.kv_dtype,
                                      shape.k_scale, shape.v_scale);
    case KVLayout::kSeparateHnd:
      return KVPoolView::separate_hnd(k, v, shape.dtype, nb, bs, shape.num_kv_heads, shape.head_dim, shape.kv_dtype,
                                      shape.k_scale, shape.v_scale);
  }
  detail::raise(Errc::kInvalidArgument,
                "make_kv_pool_view: layout = " + std::to_string(static_cast<int>(layout)) + " is not a KVLayout");
}

/// Checks that a pool view made elsewhere addresses the pool of a manager configured by `config`: the same block
/// size (else the manager's slot = block * block_size + offset lands in another block of the view) and at least the
/// manager's blocks (else its largest block ids fall outside the view). Throws kInvalidArgument naming both values;
/// returns normally when the pair is consistent. Call it once where the engine sets up its pools.
template <PoolConfig C>
void check_kv_pool_view(const C& config, const KVPoolView& view) {
  if (view.block_size <= 0 || static_cast<std::uint32_t>(view.block_size) != config.block_size) {
    detail::raise(Errc::kInvalidArgument,
                  "check_kv_pool_view: the pool view's block_size = " + std::to_string(view.block_size) +
                      " but the manager's block_size = " + std::to_string(config.block_size) +
                      ": slots would land in the wrong block (make the view with make_kv_pool_view)");
  }
  if (view.num_blocks < 0 || static_cast<std::size_t>(view.num_blocks) < config.num_blocks) {
    detail::raise(Errc::kInvalidArgument,
                  "check_kv_pool_view: the pool view has num_blocks = " + std::to_string(view.num_blocks) +
                      " but the manager hands out block ids up to " + std::to_string(config.num_blocks - 1));
  }
}

}  // namespace pagedkv
