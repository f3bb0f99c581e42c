// cuda/swap_blocks.cu: swap_blocks launcher. No kernel: batched cudaMemcpyAsync on the copy engines.
//
// Why copies and not a zero-copy kernel: the copy engines move device <-> pinned host at PCIe/NVLink-C2C speed
// without taking SMs from attention running concurrently, and they need no mapped-memory flag on the host pool.
// The cost is per-call overhead, kept low by merging: when a block's K is one dense byte range on both sides,
// K and V adjacent (interleaved NHD/HND pools) are copied as one range, and runs of consecutive (src, dst) blocks
// with a dense page stride become one copy.
#include <initializer_list>

#include <pagedkv/cuda/launch.hpp>

#include "validate.cuh"

namespace pagedkv::cuda {
namespace {

struct Side {
  char* k;
  char* v;
  std::int64_t page_bytes, token_bytes, head_bytes;
  bool dense;
};

/// Where a pointer lives, per cudaPointerGetAttributes: kSuccess when it is in `want` (host: page-locked host
/// memory; device: device or managed memory), kWrongMemorySpace when not, kNoDevice / kCudaError when the query
/// itself fails. cudaPointerGetAttributes returns cudaSuccess with type cudaMemoryTypeUnregistered for pageable
/// host memory (CUDA >= 11).
enum class Space { kHost, kDevice };
Status check_space(const void* ptr, Space want) {
  cudaPointerAttributes attr{};
  const cudaError_t e = cudaPointerGetAttributes(&attr, ptr);
  if (e != cudaSuccess) return detail::cuda_fail("cudaPointerGetAttributes", e);
  const bool ok = want == Space::kHost ? attr.type == cudaMemoryTypeHost
                                       : (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged);
  if (ok) return Status::kSuccess;
  return detail::fail(Status::kWrongMemorySpace, want == Space::kHost ? "host side" : "device side",
                      " pointer %p: cudaPointerGetAttributes type %d, need %s", ptr, static_cast<int>(attr.type),
                      want == Space::kHost ? "page-locked host memory (cudaHostAlloc / cudaHostRegister)"
                                           : "device or managed memory");
}

Side make_side(const KVPoolView& kv) {
  const auto es = static_cast<std::int64_t>(kv.storage_size_bytes());
  return {static_cast<char*>(kv.k), static_cast<char*>(kv.v), kv.stride_page * es, kv.stride_token * es,
          kv.stride_head * es, detail::block_is_dense(kv)};
}

}  // namespace

Status swap_blocks(const SwapBlocksParams& p, Stream stream) noexcept {
  using namespace detail;
  if (const Status s = reference::detail::validate_swap_blocks_shape(p); s != Status::kSuccess) return s;
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    const KVPoolView& s = p.src_layers[l];
    const KVPoolView& d = p.dst_layers[l];
    for (int side = 0; side < 2; ++side) {
      if (const Status st = validate_pool(side == 0 ? s : d); st != Status::kSuccess) {
        pagedkv::detail::prefix_detail(side == 0 ? "src_layers" : "dst_layers", l);
        return st;
      }
    }
    if (const Status st = check_supported(s.dtype, s.head_dim); st != Status::kSuccess) return st;
    for (std::int32_t i = 0; i < p.num_pairs; ++i) {
      const std::int32_t src = p.block_mapping[2 * i];
      const std::int32_t dst = p.block_mapping[2 * i + 1];
      if (src < 0) continue;
      if (src >= s.num_blocks) {
        return fail(Status::kInvalidValue, "block_mapping", "[%d].src = %d: out of [0, src_layers[%d].num_blocks = %d)",
                    i, src, l, s.num_blocks);
      }
      if (dst < 0 || dst >= d.num_blocks) {
        return fail(Status::kInvalidValue, "block_mapping", "[%d].dst = %d: out of [0, dst_layers[%d].num_blocks = %d)",
                    i, dst, l, d.num_blocks);
      }
    }
  }
  if (p.num_layers == 0 || p.num_pairs == 0) return Status::kSuccess;
  // Pageable host memory would turn every cudaMemcpyAsync below into a synchronous copy (and break stream capture):
  // refuse it before anything is queued.
  const Space src_space = p.direction == SwapDirection::kDeviceToHost ? Space::kDevice : Space::kHost;
  const Space dst_space = p.direction == SwapDirection::kDeviceToHost ? Space::kHost : Space::kDevice;
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    for (const void* ptr : {p.src_layers[l].k, p.src_layers[l].v}) {
      if (const Status s = check_space(ptr, src_space); s != Status::kSuccess) return s;
    }
    for (const void* ptr : {p.dst_layers[l].k, p.dst_layers[l].v}) {
      if (const Status s = check_space(ptr, dst_space); s != Status::kSuccess) return s;
    }
  }

  const auto kind = p.direction == SwapDirection::kDeviceToHost ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  const auto st = static_cast<cudaStream_t>(stream);
  for (std::int32_t l = 0; l < p.num_layers; ++l) {
    const KVPoolView& skv = p.src_layers[l];
    const Side s = make_side(skv);
    const Side d = make_side(p.dst_layers[l]);
    const auto es = static_cast<std::int64_t>(skv.storage_size_bytes());
    const std::int64_t row_bytes = skv.head_dim * es;
    const std::int64_t block_bytes = std::int64_t{skv.block_size} * skv.num_kv_heads * row_bytes;

    if (s.dense && d.dense) {
      // K and V of a block form one range when V starts right after K on both sides.
      const bool kv_joined = (s.v - s.k) == block_bytes && (d.v - d.k) == block_bytes;
      const std::int64_t unit = kv_joined ? 2 * block_bytes : block_bytes;
      const bool runs_ok = s.page_bytes == unit && d.page_bytes == unit;
      std::int32_t i = 0;
      while (i < p.num_pairs) {
        const std::int32_t src = p.block_mapping[2 * i];
        const std::int32_t dst = p.block_mapping[2 * i + 1];
        ++i;
        if (src < 0) continue;
        std::int64_t run = 1;
        while (runs_ok && i < p.num_pairs && p.block_mapping[2 * i] == src + run &&
               p.block_mapping[2 * i + 1] == dst + run) {
          ++run;
          ++i;
        }
        const std::int64_t so = src * s.page_bytes;
        const std::int64_t dof = dst * d.page_bytes;
        const std::int64_t bytes = (run - 1) * unit + unit;
        if (const cudaError_t e = cudaMemcpyAsync(d.k + dof, s.k + so, static_cast<std::size_t>(bytes), kind, st);
            e != cudaSuccess) {
          return cuda_fail("cudaMemcpyAsync", e);
        }
        if (!kv_joined) {
          if (const cudaError_t e = cudaMemcpyAsync(d.v + dof, s.v + so, static_cast<std::size_t>(bytes), kind, st);
              e != cudaSuccess) {
            return cuda_fail("cudaMemcpyAsync", e);
          }
        }
      }
      continue;
    }
    // General strides: one 2D copy (num_kv_heads rows of head_dim elements) per (pair, K/V, token).
    const bool pitch_ok = skv.num_kv_heads == 1 || (s.head_bytes >= row_bytes && d.head_bytes >= row_bytes);
    for (std::int32_t i = 0; i < p.num_pairs; ++i) {
      const std::int32_t src = p.block_mapping[2 * i];
      const std::int32_t dst = p.block_mapping[2 * i + 1];
      if (src < 0) continue;
      for (int kv = 0; kv < 2; ++kv) {
        const char* sb = (kv == 0 ? s.k : s.v) + src * s.page_bytes;
        char* db = (kv == 0 ? d.k : d.v) + dst * d.page_bytes;
        for (std::int32_t t = 0; t < skv.block_size; ++t) {
          const char* sr = sb + t * s.token_bytes;
          char* dr = db + t * d.token_bytes;
          if (pitch_ok) {
            const auto sp = static_cast<std::size_t>(skv.num_kv_heads == 1 ? row_bytes : s.head_bytes);
            const auto dp = static_cast<std::size_t>(skv.num_kv_heads == 1 ? row_bytes : d.head_bytes);
            if (const cudaError_t e = cudaMemcpy2DAsync(dr, dp, sr, sp, static_cast<std::size_t>(row_bytes),
                                                        static_cast<std::size_t>(skv.num_kv_heads), kind, st);
                e != cudaSuccess) {
              return cuda_fail("cudaMemcpy2DAsync", e);
            }
          } else {
            for (std::int32_t h = 0; h < skv.num_kv_heads; ++h) {
              if (const cudaError_t e = cudaMemcpyAsync(dr + h * d.head_bytes, sr + h * s.head_bytes,
                                                        static_cast<std::size_t>(row_bytes), kind, st);
                  e != cudaSuccess) {
                return cuda_fail("cudaMemcpyAsync", e);
              }
            }
          }
        }
      }
    }
  }
  return Status::kSuccess;
}

}  // namespace pagedkv::cuda
