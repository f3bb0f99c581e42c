// pagedkv/cuda/prefill.cuh: causal prefill attention over paged KV with ragged queries.
//
// Source: FlashInfer's batch prefill with paged KV (ragged qo_indptr, query i of sequence b at position
// kv_len_b - q_len_b + i) and FlashAttention's tiling with online softmax. Correctness first: fp32 CUDA-core math
// on tiles in shared memory (no tensor cores yet).
//
// CTA = (32-query tile of one sequence, one qo head); 128 threads. Thread t owns query row t / 4 of the tile and
// a quarter of its scores (keys sub + 4j of a 32-key tile, sub = t % 4) and of its output dims (float4 groups
// sub + 4k). The four threads of a row sit in one warp: row max/sum by two xor-shuffles, P exchanged through a
// warp-private shared-memory row. The tile of grid.x is found by a warp scan (cub::WarpScan) over the per-sequence
// tile counts ceil(q_len_b / 32).
#pragma once

#include <atomic>
#include <cmath>

#include <cub/warp/warp_scan.cuh>

#include <pagedkv/cuda/common.cuh>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// Compile-time geometry of the prefill kernel.
template <KernelElement T, int HD>
  requires KernelHeadDim<HD>
struct PrefillTraits {
  static constexpr int kThreads = 128;
  static constexpr int kTileQ = 32;   // query rows per CTA
  static constexpr int kTileK = 32;   // keys per KV tile
  static constexpr int kVec = kVecElems<T>;
  static constexpr int kRowStride = HD + 4;  // floats; +16 bytes keeps float4 rows on distinct banks
  static constexpr int kPStride = kTileK + 1;
  static constexpr int kDimGroups = HD / 16;  // float4 groups per thread along head_dim
  static constexpr std::size_t kSmemBytes =
      sizeof(float) * (static_cast<std::size_t>(kTileQ + 2 * kTileK) * kRowStride + kTileQ * kPStride);
  static_assert(kThreads == kTileQ * 4 && kTileK == 32, "PrefillTraits: the thread layout assumes 4 threads/row");
};

/// Kernel arguments derived on the host from PrefillParams.
struct PrefillArgs {
  const void* q;
  void* o;
  float* lse;
  const std::int32_t* qo_indptr;
  const void* k;
  const void* v;
  PageTable pages;
  std::int64_t stride_page, stride_token, stride_head;  // elements
  std::int32_t block_size;
  std::int32_t num_qo_heads;
  std::int32_t group_size;
  float scale_log2;            // sm_scale * log2(e) (fp8 pool: times k_scale, folded into q)
  float v_scale;               // 1, or an fp8 pool's v_scale (applied to the output)
  std::int32_t window_tokens;  // PrefillParams::window.sliding_window_tokens (0 = off)
  std::int32_t chunk_tokens;   // PrefillParams::window.attention_chunk_tokens (0 = off)
  std::int32_t total_q_tokens; // rows of q / o: no CTA reads or writes a row at or past it, whatever qo_indptr says
};

/// grid = (ceil(total_q / 32) + batch, num_qo_heads), block = 128, dynamic smem = PrefillTraits::kSmemBytes.
/// KV = T reads the pool as T; KV = Fp8E4M3 reads kVec e4m3 bytes per vector and dequantizes them (exact) into the
/// fp32 shared tiles (k_scale folded into the prescaled q, v_scale applied to the output).
template <KernelElement T, int HD, class KV = T>
  requires KVStorageOf<KV, T>
__global__ void __launch_bounds__(PrefillTraits<T, HD>::kThreads) prefill_kernel(const PrefillArgs a) {
  using Tr = PrefillTraits<T, HD>;
  extern __shared__ __align__(16) float smem_f[];
  float* const qs = smem_f;                          // [kTileQ][kRowStride]
  float* const ks = qs + Tr::kTileQ * Tr::kRowStride; // [kTileK][kRowStride]
  float* const vs = ks + Tr::kTileK * Tr::kRowStride; // [kTileK][kRowStride]
  float* const ps = vs + Tr::kTileK * Tr::kRowStride; // [kTileQ][kPStride]

  // ---- which (sequence, query tile) is blockIdx.x: warp 0 scans ceil(q_len_b / kTileQ) over the batch ----
  __shared__ int s_seq;
  __shared__ int s_tile;
  if (threadIdx.x < 32) {
    using WarpScan = cub::WarpScan<int>;
    __shared__ typename WarpScan::TempStorage scan_storage;
    const int lane = static_cast<int>(threadIdx.x);
    const int target = static_cast<int>(blockIdx.x);
    const int batch = a.pages.batch_size;
    int running = 0;
    int found_seq = -1;
    int found_tile = 0;
    for (int base = 0; base < batch; base += 32) {
      const int b = base + lane;
      int cnt = 0;
      if (b < batch) cnt = static_cast<int>(ceil_div(a.qo_indptr[b + 1] - a.qo_indptr[b], Tr::kTileQ));
      if (cnt < 0) cnt = 0;
      int incl = 0;
      int total = 0;
      WarpScan(scan_storage).InclusiveSum(cnt, incl, total);
      __syncwarp();
      const int excl = running + incl - cnt;
      const unsigned hit = __ballot_sync(0xffffffffu, cnt > 0 && excl <= target && target < excl + cnt);
      if (hit != 0u) {
        const int l = __ffs(static_cast<int>(hit)) - 1;
        found_seq = base + l;
        found_tile = target - __shfl_sync(0xffffffffu, excl, l);
        break;
      }
      running += total;
    }
    if (lane == 0) {
      s_seq = found_seq;
      s_tile = found_tile;
    }
  }
  __syncthreads();
  const int b = s_seq;
  if (b < 0) return;  // grid.x is an upper bound on the number of tiles

  const std::int32_t q_begin = a.qo_indptr[b];
  const std::int32_t q_len = a.qo_indptr[b + 1] - q_begin;
  const std::int32_t kv_len = seq_kv_len(a.pages, b, a.block_size);
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.y);
  const std::int32_t kv_head = h / a.group_size;
  const std::int32_t tile_q0 = s_tile * Tr::kTileQ;
  // Rows of this tile, clamped to [0, total_q_tokens): a qo_indptr that breaks its preconditions (device data the
  // host cannot check: qo_indptr[0] != 0, qo_indptr[batch] != total_q_tokens) never makes a CTA touch q / o rows
  // outside the tensors; those rows are simply not computed.
  if (q_begin < 0) return;
  const std::int32_t rows = max(0, min(min(Tr::kTileQ, q_len - tile_q0), a.total_q_tokens - (q_begin + tile_q0)));
  if (rows <= 0) return;  // uniform across the CTA
  // Position of the tile's first query. With q_len > kv_len (a precondition the reference checks and the launcher
  // cannot: both lengths are device data) pos0 is negative for the leading queries: every key is masked for them
  // (key >= 0 > qpos), so they get o = 0, lse = -inf, and kv_begin >= 0, kv_end <= kv_len keep every K/V load inside
  // the sequence's pages: never an out-of-bounds read.
  const std::int32_t pos0 = kv_len - q_len + tile_q0;

  // ---- Q tile (prescaled by sm_scale * log2 e), zero rows past the sequence ----
  constexpr int kVecsPerRow = HD / Tr::kVec;
  for (int i = static_cast<int>(threadIdx.x); i < Tr::kTileQ * kVecsPerRow; i += Tr::kThreads) {
    const int r = i / kVecsPerRow;
    const int c = i % kVecsPerRow;
    float f[Tr::kVec] = {};
    if (r < rows) {
      const T* src = static_cast<const T*>(a.q) +
                     (static_cast<std::int64_t>(q_begin + tile_q0 + r) * a.num_qo_heads + h) * HD + c * Tr::kVec;
      unpack16<T>(ldg16(src), f);
    }
#pragma unroll
    for (int e = 0; e < Tr::kVec; e += 4) {
      *reinterpret_cast<float4*>(qs + r * Tr::kRowStride + c * Tr::kVec + e) =
          make_float4(f[e] * a.scale_log2, f[e + 1] * a.scale_log2, f[e + 2] * a.scale_log2, f[e + 3] * a.scale_log2);
    }
  }

  const int r = static_cast<int>(threadIdx.x) / 4;
  const int sub = static_cast<int>(threadIdx.x) % 4;
  const std::int32_t qpos = r < rows ? pos0 + r : -1;  // keys at positions <= qpos are visible
  // ... and >= qlo (the window / chunk start of this row's query; first_visible_token is non-decreasing in the
  // position, so the tile's first query has the smallest). KV tiles start at the tile's smallest qlo: keys before it
  // are visible to no row, and their pages (maybe the null block 0) are never read.
  const std::int32_t qlo = r < rows ? first_visible_token(qpos, a.window_tokens, a.chunk_tokens) : 0;
  const std::int32_t kv_begin = rows > 0 ? first_visible_token(pos0, a.window_tokens, a.chunk_tokens) : 0;
  const std::int32_t kv_end = min(kv_len, pos0 + rows);  // one past the last visible key of the tile

  const char* const k_head = static_cast<const char*>(a.k) + kv_head * a.stride_head * std::int64_t{sizeof(KV)};
  const char* const v_head = static_cast<const char*>(a.v) + kv_head * a.stride_head * std::int64_t{sizeof(KV)};

  float acc[Tr::kDimGroups][4];
#pragma unroll
  for (int k = 0; k < Tr::kDimGroups; ++k) acc[k][0] = acc[k][1] = acc[k][2] = acc[k][3] = 0.f;
  float m = -INFINITY;
  float l = 0.f;

  for (std::int32_t kv0 = kv_begin; kv0 < kv_end; kv0 += Tr::kTileK) {
    __syncthreads();  // previous tile fully read (and, first time, the Q tile stored)
    for (int i = static_cast<int>(threadIdx.x); i < Tr::kTileK * kVecsPerRow; i += Tr::kThreads) {
      const int rr = i / kVecsPerRow;
      const int c = i % kVecsPerRow;
      const std::int32_t tok = kv0 + rr;
      float kf[Tr::kVec] = {};
      float vf[Tr::kVec] = {};
      if (tok < kv_end) {  // keys past kv_end are never visible: zero, never NaN from unused slots (tok >= kv_begin)
        const std::int32_t page = tok / a.block_size;
        const std::int32_t in_page = tok - page * a.block_size;
        const std::int64_t blk = page_block(a.pages, b, page);
        const std::int64_t off = (blk * a.stride_page + in_page * a.stride_token) * std::int64_t{sizeof(KV)} +
                                 c * Tr::kVec * std::int64_t{sizeof(KV)};
        load_kv_vec<T, KV, true>(k_head + off, kf);
        load_kv_vec<T, KV, true>(v_head + off, vf);
      }
#pragma unroll
      for (int e = 0; e < Tr::kVec; e += 4) {
        *reinterpret_cast<float4*>(ks + rr * Tr::kRowStride + c * Tr::kVec + e) =
            make_float4(kf[e], kf[e + 1], kf[e + 2], kf[e + 3]);
        *reinterpret_cast<float4*>(vs + rr * Tr::kRowStride + c * Tr::kVec + e) =
            make_float4(vf[e], vf[e + 1], vf[e + 2], vf[e + 3]);
      }
    }
    __syncthreads();

    // S = Q K^T for this thread's 8 keys (sub + 4j).
    float s[8] = {};
    const float* qrow = qs + r * Tr::kRowStride;
#pragma unroll 4
    for (int d = 0; d < HD; d += 4) {
      const float4 q4 = *reinterpret_cast<const float4*>(qrow + d);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float4 k4 = *reinterpret_cast<const float4*>(ks + (sub + 4 * j) * Tr::kRowStride + d);
        s[j] = fmaf(q4.x, k4.x, fmaf(q4.y, k4.y, fmaf(q4.z, k4.z, fmaf(q4.w, k4.w, s[j]))));
      }
    }
    float tile_max = -INFINITY;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const std::int32_t key = kv0 + sub + 4 * j;
      if (key > qpos || key < qlo) s[j] = -INFINITY;  // causal + window mask (rows past the sequence: qpos = -1)
      tile_max = fmaxf(tile_max, s[j]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max);
    const bool none = m_new == -INFINITY;  // nothing visible yet for this row
    const float alpha = none ? 1.f : exp2f(m - m_new);
    float row_sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p = none ? 0.f : exp2f(s[j] - m_new);  // exp2(-inf) = 0 for masked keys
      ps[r * Tr::kPStride + sub + 4 * j] = p;
      row_sum += p;
    }
    row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 1);
    row_sum += __shfl_xor_sync(0xffffffffu, row_sum, 2);
    l = fmaf(l, alpha, row_sum);
    m = m_new;
    __syncwarp();

#pragma unroll
    for (int k = 0; k < Tr::kDimGroups; ++k) {
      acc[k][0] *= alpha;
      acc[k][1] *= alpha;
      acc[k][2] *= alpha;
      acc[k][3] *= alpha;
    }
    const int kv_n = min(Tr::kTileK, kv_end - kv0);
    for (int c = 0; c < kv_n; ++c) {
      const float p = ps[r * Tr::kPStride + c];
#pragma unroll
      for (int k = 0; k < Tr::kDimGroups; ++k) {
        const float4 v4 = *reinterpret_cast<const float4*>(vs + c * Tr::kRowStride + sub * 4 + 16 * k);
        acc[k][0] = fmaf(p, v4.x, acc[k][0]);
        acc[k][1] = fmaf(p, v4.y, acc[k][1]);
        acc[k][2] = fmaf(p, v4.z, acc[k][2]);
        acc[k][3] = fmaf(p, v4.w, acc[k][3]);
      }
    }
    __syncwarp();
  }

  if (r < rows) {
    const std::int64_t row = static_cast<std::int64_t>(q_begin + tile_q0 + r) * a.num_qo_heads + h;
    const float inv = l > 0.f ? a.v_scale / l : 0.f;  // v_scale: 1 unless fp8
    T* out = static_cast<T*>(a.o) + row * HD;
#pragma unroll
    for (int k = 0; k < Tr::kDimGroups; ++k) {
      const int d = sub * 4 + 16 * k;
      out[d + 0] = from_float<T>(acc[k][0] * inv);
      out[d + 1] = from_float<T>(acc[k][1] * inv);
      out[d + 2] = from_float<T>(acc[k][2] * inv);
      out[d + 3] = from_float<T>(acc[k][3] * inv);
    }
    if (sub == 0 && a.lse != nullptr) {
      a.lse[row] = l > 0.f ? (m + log2f(l)) * 0.69314718055994530942f : -INFINITY;
    }
  }
}

/// Sets `kernel`'s cudaFuncAttributeMaxDynamicSharedMemorySize to `smem_bytes` once per (kernel, device) for the
/// process: a kernel that needs more than the default 48 KiB of dynamic shared memory must opt in before its first
/// launch on each device (the attribute belongs to the device's context). `done` is the kernel's per-device bitmask
/// (devices 0..63; a device >= 64 sets the attribute on every launch, still correct). Thread-safe: two threads
/// racing on the first launch both set the same value (idempotent), then the bit is set with a relaxed fetch_or;
/// later launches read one atomic and make no CUDA call besides cudaGetDevice, so a launch inside stream capture
/// issues no API call beyond the kernel node itself (warm each kernel up once before capturing to keep even the
/// first call out of the capture; cudaFuncSetAttribute is not a stream operation, so it does not join the graph).
/// After cudaDeviceReset the attribute is lost but the bit stays: a program that resets a device must not relaunch.
template <class Kernel>
Status ensure_max_dynamic_smem(Kernel* kernel, std::size_t smem_bytes, std::atomic<std::uint64_t>& done) {
  int dev = 0;
  if (const cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) {
    return pagedkv::detail::fail(Status::kCudaError, "cudaGetDevice", ": %s (%s)", cudaGetErrorName(e),
                                 cudaGetErrorString(e));
  }
  const std::uint64_t bit = dev < 64 ? std::uint64_t{1} << dev : 0;
  if (bit != 0 && (done.load(std::memory_order_relaxed) & bit) != 0) return Status::kSuccess;
  if (const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(smem_bytes));
      e != cudaSuccess) {
    return pagedkv::detail::fail(Status::kCudaError, "cudaFuncSetAttribute", ": %s (%s), %zu bytes of dynamic smem",
                                 cudaGetErrorName(e), cudaGetErrorString(e), smem_bytes);
  }
  if (bit != 0) done.fetch_or(bit, std::memory_order_relaxed);
  return Status::kSuccess;
}

/// Host: launches prefill_kernel<T, HD, KV>. Arguments validated by the caller; total_q_tokens > 0, batch > 0.
template <KernelElement T, int HD, class KV = T>
Status launch_prefill(const PrefillArgs& a, std::int32_t total_q_tokens, cudaStream_t stream) {
  using Tr = PrefillTraits<T, HD>;
  const std::int64_t tiles = ceil_div(total_q_tokens, Tr::kTileQ) + a.pages.batch_size;
  if (tiles > 0x7fffffff) {
    return pagedkv::detail::fail(Status::kInvalidValue, "total_q_tokens", " = %d: %lld query tiles exceed grid.x",
                                 total_q_tokens, static_cast<long long>(tiles));
  }
  static std::atomic<std::uint64_t> smem_set{0};  // one per instantiation: devices whose attribute is set
  if (const Status s = ensure_max_dynamic_smem(prefill_kernel<T, HD, KV>, Tr::kSmemBytes, smem_set);
      s != Status::kSuccess) {
    return s;
  }
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.num_qo_heads));
  return launch_kernel(prefill_kernel<T, HD, KV>, grid, dim3(Tr::kThreads), Tr::kSmemBytes, stream, a);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
