// pagedkv/cuda/decode.cuh: paged decode attention (one query token per sequence) with GQA packing and split-KV.
//
// Sources: PagedAttention (Kwon et al., SOSP'23) for the page indirection; FlashInfer's batch decode for the
// thread layout (lanes along head_dim with 16-byte vectors, K/V tiles staged in shared memory by cp.async and
// shared by all query heads of a group); Flash-Decoding (Dao et al., 2023) for split-KV + log-sum-exp merge.
//
// CTA = (sequence b, kv head, head tile, chunk). Layout inside a CTA:
//   lanes_per_row = head_dim / ept lanes hold one row (ept = elements per thread, 16-byte vectors interleaved
//   so shared-memory reads are conflict-free); the CTA has kSlots = threads / lanes_per_row row slots.
//   Slot s works for query head (s % heads_per_tile) of the tile and token phase (s / heads_per_tile); phases
//   split the chunk's tokens round-robin. Each slot runs an fp32 online softmax (base-2 exponent, q prescaled by
//   sm_scale * log2(e)); at the end the phases of a head are merged through shared memory.
//   K and V tiles of kTileTokens tokens are double-buffered in shared memory; the page id is read per row.
#pragma once

#include <cmath>

#include <pagedkv/cuda/common.cuh>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// Compile-time geometry of the decode kernel for (T, HD).
template <KernelElement T, int HD>
  requires KernelHeadDim<HD>
struct DecodeTraits {
  static constexpr int kVec = kVecElems<T>;                           // elements per 16-byte vector
  static constexpr int kEpt = (HD / 32 > kVec) ? HD / 32 : kVec;      // elements per thread (multiple of kVec)
  static constexpr int kVecsPerThread = kEpt / kVec;
  static constexpr int kLanesPerRow = HD / kEpt;                      // 8, 16 or 32
  static constexpr int kThreads = (8 * kLanesPerRow > 128) ? 8 * kLanesPerRow : 128;
  static constexpr int kSlots = kThreads / kLanesPerRow;              // >= 8
  static constexpr int kRowBytes = HD * static_cast<int>(sizeof(T));
  static constexpr int kChunksPerRow = kRowBytes / 16;                // 16-byte chunks per row
  static constexpr int kTileTokens = (8192 / kRowBytes) < 8 ? 8 : 8192 / kRowBytes;  // 8 KiB of K per stage
  static constexpr int kStages = 2;
  static constexpr int kStageElems = kTileTokens * HD;                // one of K or V, one stage
  static constexpr int kKVSmemBytes = kStages * 2 * kStageElems * static_cast<int>(sizeof(T));
  static constexpr int kRedStride = HD + 2;                           // per slot: o[HD], m, d
  static constexpr int kRedSmemBytes = kSlots * kRedStride * static_cast<int>(sizeof(float));
  static constexpr int kSmemBytes = kKVSmemBytes > kRedSmemBytes ? kKVSmemBytes : kRedSmemBytes;
  static_assert(kLanesPerRow <= 32 && (kLanesPerRow & (kLanesPerRow - 1)) == 0,
                "DecodeTraits: a row must map to a power-of-two group of lanes within one warp");
  static_assert(kSmemBytes <= 48 * 1024, "DecodeTraits: static shared memory must stay under 48 KiB");
};

/// Kernel arguments derived on the host from DecodeParams (element strides, the head tiling, the split).
struct DecodeArgs {
  const void* q;
  void* o;
  float* lse;
  const void* k;            // kv.k, already offset by nothing (head offset added in the kernel)
  const void* v;
  PageTable pages;
  std::int64_t stride_page, stride_token, stride_head;  // elements
  std::int32_t block_size;
  std::int32_t num_qo_heads;
  std::int32_t group_size;      // num_qo_heads / num_kv_heads
  std::int32_t heads_per_tile;  // query heads one CTA computes
  std::int32_t num_head_tiles;  // ceil(group_size / heads_per_tile)
  std::int32_t phases;          // kSlots / heads_per_tile
  float scale_log2;             // sm_scale * log2(e)
  bool split;
  std::int32_t chunk_request;   // DecodeParams::kv_chunk_size_tokens
  std::int32_t max_num_chunks;
  float* ws_o;                  // [batch, max_num_chunks, num_qo_heads, HD]
  float* ws_lse;                // [batch, max_num_chunks, num_qo_heads]
};

/// Decode kernel. grid = (batch, num_kv_heads * num_head_tiles, split ? max_num_chunks : 1), block = kThreads.
template <KernelElement T, int HD>
__global__ void __launch_bounds__(DecodeTraits<T, HD>::kThreads, 1)
    decode_kernel(const DecodeArgs a) {
  using Tr = DecodeTraits<T, HD>;
  __shared__ __align__(16) unsigned char smem_raw[Tr::kSmemBytes];
  T* const smem_kv = reinterpret_cast<T*>(smem_raw);

  const std::int32_t b = static_cast<std::int32_t>(blockIdx.x);
  const std::int32_t kv_head = static_cast<std::int32_t>(blockIdx.y) / a.num_head_tiles;
  const std::int32_t head_tile = static_cast<std::int32_t>(blockIdx.y) % a.num_head_tiles;
  const std::int32_t chunk_idx = static_cast<std::int32_t>(blockIdx.z);
  const std::int32_t bs = a.block_size;

  const std::int32_t kv_len = seq_kv_len(a.pages, b, bs);
  const std::int32_t head0 = kv_head * a.group_size + head_tile * a.heads_per_tile;  // first qo head of the tile
  const std::int32_t tile_heads = min(a.heads_per_tile, a.group_size - head_tile * a.heads_per_tile);
  if (tile_heads <= 0) return;  // balanced head tiling can leave the last tile empty for very large groups

  std::int32_t chunk_begin = 0;
  std::int32_t chunk_end = kv_len;
  if (a.split) {
    const std::int32_t chunk = effective_chunk(kv_len, a.chunk_request, a.max_num_chunks);
    chunk_begin = static_cast<std::int32_t>(min(static_cast<std::int64_t>(chunk_idx) * chunk,
                                                static_cast<std::int64_t>(kv_len)));
    chunk_end = static_cast<std::int32_t>(min(static_cast<std::int64_t>(chunk_begin) + chunk,
                                              static_cast<std::int64_t>(kv_len)));
    if (chunk_begin >= chunk_end) return;  // this chunk does not exist for this sequence (merge skips it)
  } else if (kv_len <= 0) {
    // Padding sequence: o = 0, lse = -inf.
    for (int i = threadIdx.x; i < tile_heads * HD; i += Tr::kThreads) {
      const std::int64_t h = head0 + i / HD;
      static_cast<T*>(a.o)[(static_cast<std::int64_t>(b) * a.num_qo_heads + h) * HD + i % HD] = from_float<T>(0.f);
      if (a.lse != nullptr && i % HD == 0) a.lse[static_cast<std::int64_t>(b) * a.num_qo_heads + h] = -INFINITY;
    }
    return;
  }
  const std::int32_t num_tokens = chunk_end - chunk_begin;
  const std::int32_t num_tiles = static_cast<std::int32_t>(ceil_div(num_tokens, Tr::kTileTokens));

  const char* const k_head = static_cast<const char*>(a.k) + kv_head * a.stride_head * std::int64_t{sizeof(T)};
  const char* const v_head = static_cast<const char*>(a.v) + kv_head * a.stride_head * std::int64_t{sizeof(T)};

  // Stage tile `tile` (tokens [chunk_begin + tile * kTileTokens, ...)) into shared-memory stage `stage`.
  auto load_tile = [&](int tile, int stage) {
    T* const ks = smem_kv + stage * 2 * Tr::kStageElems;
    T* const vs = ks + Tr::kStageElems;
    const std::int32_t tok0 = chunk_begin + tile * Tr::kTileTokens;
    const std::int32_t n = min(Tr::kTileTokens, chunk_end - tok0);
#pragma unroll
    for (int it = 0; it < ceil_div(Tr::kTileTokens * Tr::kChunksPerRow, Tr::kThreads); ++it) {
      const int i = it * Tr::kThreads + static_cast<int>(threadIdx.x);
      const int r = i / Tr::kChunksPerRow;
      const int c = i % Tr::kChunksPerRow;
      if (r < n) {
        const std::int32_t tok = tok0 + r;
        const std::int32_t page = tok / bs;
        const std::int32_t in_page = tok - page * bs;
        const std::int64_t blk = page_block(a.pages, b, page);
        const std::int64_t byte_off =
            (blk * a.stride_page + in_page * a.stride_token) * std::int64_t{sizeof(T)} + c * 16;
        cp_async16(ks + r * HD + c * Tr::kVec, k_head + byte_off);
        cp_async16(vs + r * HD + c * Tr::kVec, v_head + byte_off);
      }
    }
    cp_async_commit();
  };

  // ---- per-slot setup ----
  const int lane_in_row = static_cast<int>(threadIdx.x) % Tr::kLanesPerRow;
  const int slot = static_cast<int>(threadIdx.x) / Tr::kLanesPerRow;
  const int head_local = slot % a.heads_per_tile;
  const int phase = slot / a.heads_per_tile;
  const bool active = phase < a.phases && head_local < tile_heads;
  const unsigned lane = threadIdx.x % 32;
  const unsigned row_mask =
      Tr::kLanesPerRow == 32 ? 0xffffffffu : (((1u << Tr::kLanesPerRow) - 1u) << (lane & ~(Tr::kLanesPerRow - 1u)));

  // q slice (prescaled, base-2 domain). Vector j of this lane holds elements [(j * lanes + lane_in_row) * kVec, +kVec).
  float q[Tr::kEpt];
  float acc[Tr::kEpt];
  float m = -INFINITY;
  float d = 0.f;
#pragma unroll
  for (int e = 0; e < Tr::kEpt; ++e) acc[e] = 0.f;
  if (active) {
    const T* qrow = static_cast<const T*>(a.q) + (static_cast<std::int64_t>(b) * a.num_qo_heads + head0 + head_local) * HD;
#pragma unroll
    for (int j = 0; j < Tr::kVecsPerThread; ++j) {
      unpack16<T>(ldg16(qrow + (j * Tr::kLanesPerRow + lane_in_row) * Tr::kVec), q + j * Tr::kVec);
    }
#pragma unroll
    for (int e = 0; e < Tr::kEpt; ++e) q[e] *= a.scale_log2;
  }

  load_tile(0, 0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      load_tile(tile + 1, (tile + 1) % Tr::kStages);
    } else {
      cp_async_commit();  // empty group keeps the wait count uniform
    }
    cp_async_wait<1>();
    __syncthreads();

    if (active) {
      const T* const ks = smem_kv + (tile % Tr::kStages) * 2 * Tr::kStageElems;
      const T* const vs = ks + Tr::kStageElems;
      const int n = min(Tr::kTileTokens, num_tokens - tile * Tr::kTileTokens);
      // kUnroll tokens per step: independent dot products and shuffles in flight, one rescale per step.
      constexpr int kUnroll = 4;
      for (int t0 = phase; t0 < n; t0 += kUnroll * a.phases) {
        float s[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int t = t0 + u * a.phases;
          s[u] = -INFINITY;
          if (t < n) {  // uniform across the row's lanes
            float kf[Tr::kEpt];
#pragma unroll
            for (int j = 0; j < Tr::kVecsPerThread; ++j) {
              const uint4 raw =
                  *reinterpret_cast<const uint4*>(ks + t * HD + (j * Tr::kLanesPerRow + lane_in_row) * Tr::kVec);
              unpack16<T>(raw, kf + j * Tr::kVec);
            }
            float dot = 0.f;
#pragma unroll
            for (int e = 0; e < Tr::kEpt; ++e) dot = fmaf(q[e], kf[e], dot);
            s[u] = dot;
          }
        }
#pragma unroll
        for (int off = Tr::kLanesPerRow / 2; off > 0; off >>= 1) {
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) s[u] += __shfl_xor_sync(row_mask, s[u], off);  // -inf stays -inf
        }
        float m_new = m;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) m_new = fmaxf(m_new, s[u]);
        const float alpha = exp2f(m - m_new);  // m == -inf on the first step -> 0 (m_new is finite: t0 < n)
        d *= alpha;
#pragma unroll
        for (int e = 0; e < Tr::kEpt; ++e) acc[e] *= alpha;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int t = t0 + u * a.phases;
          if (t < n) {
            const float p = exp2f(s[u] - m_new);
            d += p;
            float vf[Tr::kEpt];
#pragma unroll
            for (int j = 0; j < Tr::kVecsPerThread; ++j) {
              const uint4 raw =
                  *reinterpret_cast<const uint4*>(vs + t * HD + (j * Tr::kLanesPerRow + lane_in_row) * Tr::kVec);
              unpack16<T>(raw, vf + j * Tr::kVec);
            }
#pragma unroll
            for (int e = 0; e < Tr::kEpt; ++e) acc[e] = fmaf(p, vf[e], acc[e]);
          }
        }
        m = m_new;
      }
    }
    __syncthreads();  // the stage just read is refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();

  // ---- merge the phases of each head through shared memory (reuses the K/V buffers) ----
  float* const red = reinterpret_cast<float*>(smem_raw);
  if (active) {
    float* const row = red + slot * Tr::kRedStride;
#pragma unroll
    for (int j = 0; j < Tr::kVecsPerThread; ++j) {
#pragma unroll
      for (int e = 0; e < Tr::kVec; ++e) row[(j * Tr::kLanesPerRow + lane_in_row) * Tr::kVec + e] = acc[j * Tr::kVec + e];
    }
    if (lane_in_row == 0) {
      row[HD] = m;
      row[HD + 1] = d;
    }
  }
  __syncthreads();

  for (int i = static_cast<int>(threadIdx.x); i < tile_heads * HD; i += Tr::kThreads) {
    const int hl = i / HD;
    const int dim = i % HD;
    float mx = -INFINITY;
    for (int ph = 0; ph < a.phases; ++ph) mx = fmaxf(mx, red[(ph * a.heads_per_tile + hl) * Tr::kRedStride + HD]);
    float den = 0.f;
    float num = 0.f;
    for (int ph = 0; ph < a.phases; ++ph) {
      const float* row = red + (ph * a.heads_per_tile + hl) * Tr::kRedStride;
      const float w = row[HD] == -INFINITY ? 0.f : exp2f(row[HD] - mx);
      den = fmaf(row[HD + 1], w, den);
      num = fmaf(row[dim], w, num);
    }
    // den > 0: the chunk has >= 1 token, so some phase saw it.
    const float out = num / den;
    const float lse_nat = (mx + log2f(den)) * 0.69314718055994530942f;
    const std::int64_t h = head0 + hl;
    if (a.split) {
      const std::int64_t r = (static_cast<std::int64_t>(b) * a.max_num_chunks + chunk_idx) * a.num_qo_heads + h;
      a.ws_o[r * HD + dim] = out;
      if (dim == 0) a.ws_lse[r] = lse_nat;
    } else {
      const std::int64_t r = static_cast<std::int64_t>(b) * a.num_qo_heads + h;
      static_cast<T*>(a.o)[r * HD + dim] = from_float<T>(out);
      if (dim == 0 && a.lse != nullptr) a.lse[r] = lse_nat;
    }
  }
}

/// Merge kernel (Flash-Decoding): o[b, h] = sum_c exp(lse_c - lse) * o_c, lse = log sum_c exp(lse_c).
/// One warp per (b, h); grid = ceil(batch * num_qo_heads / 4), block = 128.
template <KernelElement T, int HD>
__global__ void __launch_bounds__(128) decode_merge_kernel(const DecodeArgs a) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  const std::int32_t batch = a.pages.batch_size;
  if (row >= static_cast<std::int64_t>(batch) * a.num_qo_heads) return;
  const auto b = static_cast<std::int32_t>(row / a.num_qo_heads);
  const auto h = static_cast<std::int32_t>(row % a.num_qo_heads);
  const int lane = static_cast<int>(threadIdx.x % 32);
  T* const out = static_cast<T*>(a.o) + row * HD;

  const std::int32_t kv_len = seq_kv_len(a.pages, b, a.block_size);
  constexpr int kVec = kVecElems<T>;
  if (kv_len <= 0) {
    float zeros[kVec] = {};
    for (int v = lane; v < HD / kVec; v += 32) *reinterpret_cast<uint4*>(out + v * kVec) = pack16<T>(zeros);
    if (lane == 0 && a.lse != nullptr) a.lse[row] = -INFINITY;
    return;
  }
  const std::int32_t chunk = effective_chunk(kv_len, a.chunk_request, a.max_num_chunks);
  const auto nc = static_cast<std::int32_t>(ceil_div(kv_len, chunk));
  const std::int64_t base = static_cast<std::int64_t>(b) * a.max_num_chunks;  // chunk rows of sequence b
  float mx = -INFINITY;
  for (int c = 0; c < nc; ++c) mx = fmaxf(mx, a.ws_lse[(base + c) * a.num_qo_heads + h]);
  float sum = 0.f;
  for (int c = 0; c < nc; ++c) sum += expf(a.ws_lse[(base + c) * a.num_qo_heads + h] - mx);
  const float lse = mx + logf(sum);
  for (int v = lane; v < HD / kVec; v += 32) {
    float accv[kVec] = {};
    for (int c = 0; c < nc; ++c) {
      const std::int64_t r = (base + c) * a.num_qo_heads + h;
      const float w = expf(a.ws_lse[r] - lse);
      const float4* src = reinterpret_cast<const float4*>(a.ws_o + r * HD + v * kVec);
#pragma unroll
      for (int q4 = 0; q4 < kVec / 4; ++q4) {
        const float4 x = src[q4];
        accv[4 * q4 + 0] = fmaf(w, x.x, accv[4 * q4 + 0]);
        accv[4 * q4 + 1] = fmaf(w, x.y, accv[4 * q4 + 1]);
        accv[4 * q4 + 2] = fmaf(w, x.z, accv[4 * q4 + 2]);
        accv[4 * q4 + 3] = fmaf(w, x.w, accv[4 * q4 + 3]);
      }
    }
    *reinterpret_cast<uint4*>(out + v * kVec) = pack16<T>(accv);
  }
  if (lane == 0 && a.lse != nullptr) a.lse[row] = lse;
}

/// Host: launches the decode (and, when splitting, the merge) kernel for (T, HD). Arguments validated by the caller.
template <KernelElement T, int HD>
Status launch_decode(const DecodeArgs& a, std::int32_t num_kv_heads, cudaStream_t stream) {
  using Tr = DecodeTraits<T, HD>;
  const std::int32_t batch = a.pages.batch_size;
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(num_kv_heads * a.num_head_tiles),
                  a.split ? static_cast<unsigned>(a.max_num_chunks) : 1u);
  decode_kernel<T, HD><<<grid, Tr::kThreads, 0, stream>>>(a);
  if (cudaPeekAtLastError() != cudaSuccess) return Status::kCudaError;
  if (a.split) {
    const std::int64_t rows = static_cast<std::int64_t>(batch) * a.num_qo_heads;
    decode_merge_kernel<T, HD><<<static_cast<unsigned>(ceil_div(rows, 4)), 128, 0, stream>>>(a);
    if (cudaPeekAtLastError() != cudaSuccess) return Status::kCudaError;
  }
  return Status::kSuccess;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
