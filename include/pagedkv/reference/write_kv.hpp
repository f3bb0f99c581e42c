// pagedkv/reference/write_kv.hpp: CPU reference of write_kv, the scatter of new K/V rows into pages by slot
// mapping (vLLM's `reshape_and_cache`).
#pragma once

#include <cstdint>
#include <cstring>

#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/common.hpp>

namespace pagedkv::reference {

/// Checks a write_kv launch without running it: the pool (see `detail::validate_pool`: dtype, pointers, sizes,
/// strides), num_tokens >= 0, stride_token_elems == 0 or >= num_kv_heads * head_dim, and, when num_tokens > 0,
/// non-null key, value and slot_mapping and every slot < num_blocks * block_size (negative slots are padding).
/// Reads slot_mapping (host memory). Returns kSuccess, kInvalidValue, or kUnsupported (dtype not an enumerator).
/// Thread safety: reads only.
[[nodiscard]] inline Status validate(const WriteKVParams& p) noexcept {
  using detail::fail;
  constexpr Status kBad = Status::kInvalidValue;
  if (const Status s = detail::validate_pool(p.kv); s != Status::kSuccess) return s;
  if (const Status s = detail::validate_write_kv_shape(p); s != Status::kSuccess) return s;
  if (p.num_tokens == 0) return Status::kSuccess;
  const std::int64_t num_slots = std::int64_t{p.kv.num_blocks} * p.kv.block_size;
  for (std::int32_t t = 0; t < p.num_tokens; ++t) {
    if (p.slot_mapping[t] >= num_slots) {
      return fail(kBad, "slot_mapping", "[%d] = %lld: must be < num_blocks * block_size = %lld (or < 0: padding)", t,
                  static_cast<long long>(p.slot_mapping[t]), static_cast<long long>(num_slots));
    }
  }
  return Status::kSuccess;
}

namespace detail {

/// write_kv into an fp8 pool, inputs of element type T (see write_kv). Precondition: validate(p) passed.
template <ElementType T>
void write_kv_fp8(const WriteKVParams& p) noexcept {
  const std::int64_t in_stride =
      p.stride_token_elems != 0 ? p.stride_token_elems : std::int64_t{p.kv.num_kv_heads} * p.kv.head_dim;
  auto* k = static_cast<unsigned char*>(p.kv.k);
  auto* v = static_cast<unsigned char*>(p.kv.v);
  for (std::int32_t t = 0; t < p.num_tokens; ++t) {
    const std::int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    const std::int64_t block = slot / p.kv.block_size;
    const std::int64_t off = slot % p.kv.block_size;
    for (std::int32_t h = 0; h < p.kv.num_kv_heads; ++h) {
      const std::int64_t src = t * in_stride + std::int64_t{h} * p.kv.head_dim;  // elements of T
      const std::int64_t dst = p.kv.offset(block, off, h);                       // bytes (1-byte elements)
      for (std::int32_t d = 0; d < p.kv.head_dim; ++d) {
        k[dst + d] = float_to_fp8_e4m3_bits(load_as_float<T>(p.key, src + d) / p.kv.k_scale);
        v[dst + d] = float_to_fp8_e4m3_bits(load_as_float<T>(p.value, src + d) / p.kv.v_scale);
      }
    }
  }
}

}  // namespace detail

/// Scatters new K/V rows into their slots: for every token t with slot = slot_mapping[t] >= 0, block =
/// slot / block_size, offset = slot % block_size, and every kv head h:
///   K[block, offset, h, :] = key[t, h, :],  V[block, offset, h, :] = value[t, h, :].
/// Parameters (all host memory here; device memory for the CUDA launcher of the same params):
///  - p.key, p.value: `[num_tokens, num_kv_heads, head_dim]` in the pool's dtype, token rows
///    `stride_token_elems` elements apart (0 = num_kv_heads * head_dim, i.e. contiguous), heads contiguous.
///  - p.slot_mapping: `[num_tokens]` int64; slot = block_id * block_size + offset; a negative slot is padding: that
///    token is skipped and nothing is written for it.
///  - p.kv: the pool (any strides, see `KVPoolView`).
/// Values are copied bit for bit (no conversion) into a kSame pool. Into an fp8 pool (kv.kv_dtype ==
/// kFp8E4M3) each element x (read in kv.dtype, exactly as float32) is quantized: K stores
/// float_to_fp8_e4m3_bits(x / kv.k_scale), V likewise with kv.v_scale (one float32 division, then round to
/// nearest even with saturation to +-448). Preconditions (not checked): no two tokens share a slot (the
/// reference then keeps the last one; the GPU order is unspecified); key/value do not overlap the pool.
/// Returns kInvalidValue / kUnsupported per `validate(const WriteKVParams&)` before anything is written (a slot
/// >= num_blocks * block_size anywhere writes nothing), else kSuccess. Never throws.
/// Thread safety: writes the pool's listed slots; no concurrent writer or reader of those slots.
/// Complexity: O(num_tokens * num_kv_heads * head_dim), single-threaded (memory-bound).
[[nodiscard]] inline Status write_kv(const WriteKVParams& p) noexcept {
  if (const Status s = validate(p); s != Status::kSuccess) return s;
  if (p.kv.kv_dtype == KVDType::kFp8E4M3) {
    detail::dispatch_dtype(p.kv.dtype, [&]<class T>(std::type_identity<T>) { detail::write_kv_fp8<T>(p); });
    return Status::kSuccess;
  }
  const auto es = static_cast<std::int64_t>(dtype_size_bytes(p.kv.dtype));
  const std::int64_t in_stride =
      p.stride_token_elems != 0 ? p.stride_token_elems : std::int64_t{p.kv.num_kv_heads} * p.kv.head_dim;
  const auto row_bytes = static_cast<std::size_t>(p.kv.head_dim * es);
  const auto* key = static_cast<const char*>(p.key);
  const auto* value = static_cast<const char*>(p.value);
  auto* k = static_cast<char*>(p.kv.k);
  auto* v = static_cast<char*>(p.kv.v);
  for (std::int32_t t = 0; t < p.num_tokens; ++t) {
    const std::int64_t slot = p.slot_mapping[t];
    if (slot < 0) continue;
    const std::int64_t block = slot / p.kv.block_size;
    const std::int64_t off = slot % p.kv.block_size;
    for (std::int32_t h = 0; h < p.kv.num_kv_heads; ++h) {
      const std::int64_t src = (t * in_stride + std::int64_t{h} * p.kv.head_dim) * es;
      const std::int64_t dst = p.kv.offset(block, off, h) * es;
      std::memcpy(k + dst, key + src, row_bytes);
      std::memcpy(v + dst, value + src, row_bytes);
    }
  }
  return Status::kSuccess;
}

}  // namespace pagedkv::reference
