// pagedkv/cuda/write_kv.cuh: scatter new K/V rows into their pages by slot mapping (vLLM `reshape_and_cache`,
// FlashInfer `append_paged_kv_cache`).
//
// The op moves bytes, so one kernel serves every dtype: it is templated on the access width W (16, 8, 4 or 2 bytes)
// that the pointers and strides allow, not on (dtype, head_dim). CTA = one token; its threads walk the token's
// num_kv_heads * (row_bytes / W) vectors of K and of V (one load + one store each, coalesced along head_dim).
#pragma once

#include <pagedkv/cuda/common.cuh>
#include <pagedkv/cuda/fp8_e4m3.hpp>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// Unsigned word of W bytes.
template <int W>
struct Word;
template <>
struct Word<16> {
  using type = uint4;
};
template <>
struct Word<8> {
  using type = uint2;
};
template <>
struct Word<4> {
  using type = unsigned;
};
template <>
struct Word<2> {
  using type = unsigned short;
};

/// Kernel arguments of write_kv, all strides in bytes.
struct WriteKVArgs {
  const char* key;
  const char* value;
  std::int64_t src_token_bytes;  // row stride of key/value
  const std::int64_t* slot_mapping;
  char* k_pool;
  char* v_pool;
  std::int64_t page_bytes, token_bytes, head_bytes;
  std::int64_t num_slots;        // num_blocks * block_size
  std::int32_t block_size;
  std::int32_t num_kv_heads;
  std::int32_t row_bytes;        // head_dim * element size
};

/// grid = num_tokens, block = 128.
template <int W>
__global__ void __launch_bounds__(128) write_kv_kernel(const WriteKVArgs a) {
  using V = typename Word<W>::type;
  const std::int64_t token = blockIdx.x;
  const std::int64_t slot = a.slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (or an out-of-range slot: precondition violated)
  const std::int64_t block = slot / a.block_size;
  const std::int64_t in_block = slot - block * a.block_size;
  const std::int64_t dst_base = block * a.page_bytes + in_block * a.token_bytes;
  const std::int64_t src_base = token * a.src_token_bytes;
  const int vecs_per_row = a.row_bytes / W;
  const int n = a.num_kv_heads * vecs_per_row;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += blockDim.x) {
    const int h = i / vecs_per_row;
    const int c = i - h * vecs_per_row;
    const std::int64_t src = src_base + std::int64_t{h} * a.row_bytes + std::int64_t{c} * W;
    const std::int64_t dst = dst_base + h * a.head_bytes + std::int64_t{c} * W;
    const V kx = *reinterpret_cast<const V*>(a.key + src);
    const V vx = *reinterpret_cast<const V*>(a.value + src);
    *reinterpret_cast<V*>(a.k_pool + dst) = kx;
    *reinterpret_cast<V*>(a.v_pool + dst) = vx;
  }
}

/// Kernel arguments of write_kv into an fp8 e4m3 pool: the source strides in elements of T, the pool's in bytes.
struct WriteKVFp8Args {
  const void* key;
  const void* value;
  std::int64_t src_token_elems;  // row stride of key/value (elements of T)
  const std::int64_t* slot_mapping;
  unsigned char* k_pool;
  unsigned char* v_pool;
  std::int64_t page_bytes, token_bytes, head_bytes;
  std::int64_t num_slots;
  std::int32_t block_size;
  std::int32_t num_kv_heads;
  std::int32_t head_dim;
  float k_scale;
  float v_scale;
};

/// write_kv into an fp8 pool: grid = num_tokens, block = 128. Each element x (type T, read exactly as float) is
/// stored as float_to_e4m3(x / k_scale) (V: v_scale): one IEEE float division (nvcc's default -prec-div=true) then
/// round-to-nearest-even with saturation, exactly the reference's arithmetic, so the bytes match it bit for bit.
/// One byte per thread-iteration: the store of a warp is 32 contiguous bytes of a row (memory-bound op).
template <KernelElement T>
__global__ void __launch_bounds__(128) write_kv_fp8_kernel(const WriteKVFp8Args a) {
  const std::int64_t token = blockIdx.x;
  const std::int64_t slot = a.slot_mapping[token];
  if (slot < 0 || slot >= a.num_slots) return;  // padding (or an out-of-range slot: precondition violated)
  const std::int64_t block = slot / a.block_size;
  const std::int64_t in_block = slot - block * a.block_size;
  const std::int64_t dst_base = block * a.page_bytes + in_block * a.token_bytes;
  const T* key = static_cast<const T*>(a.key) + token * a.src_token_elems;
  const T* value = static_cast<const T*>(a.value) + token * a.src_token_elems;
  const int n = a.num_kv_heads * a.head_dim;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += blockDim.x) {
    const int h = i / a.head_dim;
    const int d = i - h * a.head_dim;
    const std::int64_t dst = dst_base + h * a.head_bytes + d;
    a.k_pool[dst] = float_to_e4m3(to_float(key[i]) / a.k_scale);
    a.v_pool[dst] = float_to_e4m3(to_float(value[i]) / a.v_scale);
  }
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
