// pagedkv/cuda/prefill.cuh: causal prefill attention over paged KV with ragged queries.
//
// Source: FlashInfer's batch prefill with paged KV (ragged qo_indptr, query i of sequence b at position
// kv_len_b - q_len_b + i) and FlashAttention(-2)'s tiling with online softmax. Two kernels: prefill_mma_kernel
// (tensor cores, mma.sync m16n8k16, for fp16 / bf16 at head_dim 64 / 128 with a same-type pool; below) and
// prefill_kernel (fp32 CUDA-core math on tiles in shared memory: fp32, head_dim 256, fp8 pools).
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

/// Which (sequence, query tile of kTileQ rows) this CTA (blockIdx.x) computes: warp 0 scans ceil(q_len_b / kTileQ)
/// over the batch (cub::WarpScan), then the CTA synchronizes. Returns {sequence, tile}; sequence -1: past the last
/// tile (grid.x is an upper bound). Call from every thread of the CTA.
template <int kTileQ>
__device__ __forceinline__ int2 prefill_tile_of_block(const PrefillArgs& a) {
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
      if (b < batch) cnt = static_cast<int>(ceil_div(a.qo_indptr[b + 1] - a.qo_indptr[b], kTileQ));
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
  return make_int2(s_seq, s_tile);
}

/// The query tile a prefill CTA computes and the keys it may see.
struct PrefillTile {
  std::int32_t b;         // sequence
  std::int32_t q_begin;   // its first row in q / o
  std::int32_t tile_q0;   // the tile's first query within the sequence
  std::int32_t rows;      // query rows of the tile (> 0)
  std::int32_t pos0;      // position of the tile's first query: kv_len - q_len + tile_q0
  std::int32_t kv_begin;  // first key any row of the tile sees
  std::int32_t kv_end;    // one past the last
};

/// Resolves this CTA's tile (prefill_tile_of_block) and its key range; false when there is nothing to compute
/// (uniform across the CTA).
/// - Rows are clamped to [0, total_q_tokens): a qo_indptr that breaks its preconditions (device data the host cannot
///   check: qo_indptr[0] != 0, qo_indptr[batch] != total_q_tokens) never makes a CTA touch q / o rows outside the
///   tensors; those rows are simply not computed.
/// - With q_len > kv_len (a precondition the reference checks and the launcher cannot: both lengths are device data)
///   pos0 is negative for the leading queries: every key is masked for them (key >= 0 > qpos), so they get o = 0,
///   lse = -inf, and kv_begin >= 0, kv_end <= kv_len keep every K/V load inside the sequence's pages.
/// - kv_begin is the window / chunk start of the tile's first query (first_visible_token is non-decreasing in the
///   position, so that query's is the smallest): keys before it are visible to no row, and their pages (maybe the
///   null block 0) are never read.
template <int kTileQ>
__device__ __forceinline__ bool prefill_tile(const PrefillArgs& a, PrefillTile& t) {
  const int2 found = prefill_tile_of_block<kTileQ>(a);
  t.b = found.x;
  if (t.b < 0) return false;  // grid.x is an upper bound on the number of tiles
  t.q_begin = a.qo_indptr[t.b];
  const std::int32_t q_len = a.qo_indptr[t.b + 1] - t.q_begin;
  const std::int32_t kv_len = seq_kv_len(a.pages, t.b, a.block_size);
  t.tile_q0 = found.y * kTileQ;
  if (t.q_begin < 0) return false;
  t.rows = max(0, min(min(kTileQ, q_len - t.tile_q0), a.total_q_tokens - (t.q_begin + t.tile_q0)));
  if (t.rows <= 0) return false;
  t.pos0 = kv_len - q_len + t.tile_q0;
  t.kv_begin = first_visible_token(t.pos0, a.window_tokens, a.chunk_tokens);
  t.kv_end = min(kv_len, t.pos0 + t.rows);
  return true;
}

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

  PrefillTile pt;
  if (!prefill_tile<Tr::kTileQ>(a, pt)) return;  // uniform across the CTA
  const std::int32_t b = pt.b, q_begin = pt.q_begin, tile_q0 = pt.tile_q0, rows = pt.rows, pos0 = pt.pos0;
  const std::int32_t kv_begin = pt.kv_begin, kv_end = pt.kv_end;
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.y);
  const std::int32_t kv_head = h / a.group_size;

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
  // ... and >= qlo (the window / chunk start of this row's query; PrefillTile::kv_begin explains the range).
  const std::int32_t qlo = r < rows ? first_visible_token(qpos, a.window_tokens, a.chunk_tokens) : 0;

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

// ---- tensor-core prefill (FlashAttention-2's tiling on mma.sync) ----------------------------------------------------

/// Geometry of the tensor-core prefill kernel (fp16 / bf16 query and pool, head_dim 64 or 128): CTA = (64-query tile
/// of one sequence, one qo head), 4 warps of 16 query rows each (the MMA's rows); K/V tiles of 64 keys staged by
/// cp.async into swizzled shared memory, two stages (dynamic shared memory: 64 KiB at head_dim 128).
template <KernelElement T, int HD>
struct PrefillMmaTraits {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTileQ = 16 * kWarps;
  static constexpr int kTileK = 64;
  static constexpr int kStages = 2;
  static constexpr int kStageElems = kTileK * HD;  // one of K or V, one stage
  static constexpr std::size_t kSmemBytes = std::size_t{kStages} * 2 * kStageElems * sizeof(T);
  static_assert(HD == 64 || HD == 128, "PrefillMmaTraits: head_dim 64 or 128 (the fp32 output fragment is HD / 2 registers)");
};

/// Whether prefill uses the tensor-core kernel: fp16 / bf16 query and a pool of the same type, head_dim 64 or 128.
template <KernelElement T, int HD, class KV>
inline constexpr bool kPrefillUsesMma = !std::same_as<T, float> && std::same_as<KV, T> && (HD == 64 || HD == 128);

/// Tensor-core prefill kernel (kPrefillUsesMma): same grid rule (tiles of PrefillMmaTraits::kTileQ), masks (causal,
/// sliding window, chunked-local), outputs and edge cases as prefill_kernel. Per warp and 64-key tile: S (16 queries
/// x 64 keys) = Q K^T in 8 x HD/16 MMAs, masked and scaled to base 2, an online softmax per row (4 lanes per row, 2
/// shuffles), then O (16 x HD) += P V in 4 x HD/8 MMAs with P rounded to T; a warp whose queries see none of the
/// tile's keys skips it. o = O / l (0 and lse = -inf for a row that sees no key).
template <KernelElement T, int HD>
__global__ void __launch_bounds__(PrefillMmaTraits<T, HD>::kThreads) prefill_mma_kernel(const PrefillArgs a) {
  using Tr = PrefillMmaTraits<T, HD>;
  extern __shared__ __align__(16) unsigned char prefill_mma_smem[];
  T* const smem_kv = reinterpret_cast<T*>(prefill_mma_smem);

  PrefillTile pt;
  if (!prefill_tile<Tr::kTileQ>(a, pt)) return;  // uniform across the CTA
  const std::int32_t h = static_cast<std::int32_t>(blockIdx.y);
  const std::int32_t kv_head = h / a.group_size;
  const char* const k_head = static_cast<const char*>(a.k) + kv_head * a.stride_head * std::int64_t{sizeof(T)};
  const char* const v_head = static_cast<const char*>(a.v) + kv_head * a.stride_head * std::int64_t{sizeof(T)};
  auto load_tile = [&](std::int32_t kv0, int stage) {
    T* const ks = smem_kv + stage * 2 * Tr::kStageElems;
    load_kv_rows<T, HD, Tr::kTileK, Tr::kThreads, true>(a.pages, pt.b, a.block_size, a.stride_page, a.stride_token,
                                                         k_head, v_head, kv0, min(Tr::kTileK, pt.kv_end - kv0), ks,
                                                         ks + Tr::kStageElems);
  };

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  // This lane's rows: r0 = 16 warp + g and r8 = r0 + 8 of the tile; qpos -1 (nothing visible) past the tile's rows.
  const int r0 = 16 * warp + g, r8 = r0 + 8;
  const std::int32_t qpos0 = r0 < pt.rows ? pt.pos0 + r0 : -1;
  const std::int32_t qpos8 = r8 < pt.rows ? pt.pos0 + r8 : -1;
  const std::int32_t qlo0 = r0 < pt.rows ? first_visible_token(qpos0, a.window_tokens, a.chunk_tokens) : 0;
  const std::int32_t qlo8 = r8 < pt.rows ? first_visible_token(qpos8, a.window_tokens, a.chunk_tokens) : 0;
  // The warp's visible key range: [qlo of its first row, qpos of its last row] (both non-decreasing in the row).
  const int warp_last = min(16 * warp + 15, pt.rows - 1);
  const std::int32_t warp_hi = 16 * warp < pt.rows ? pt.pos0 + warp_last : -1;
  const std::int32_t warp_lo =
      16 * warp < pt.rows ? first_visible_token(pt.pos0 + 16 * warp, a.window_tokens, a.chunk_tokens) : 0;

  unsigned qa[HD / 16][4];
  {
    const auto qrow = [&](int r) {
      return reinterpret_cast<const unsigned*>(
          static_cast<const T*>(a.q) +
          (static_cast<std::int64_t>(pt.q_begin + pt.tile_q0 + r) * a.num_qo_heads + h) * HD);
    };
    const bool has0 = r0 < pt.rows, has8 = r8 < pt.rows;
    load_a_fragments<HD>(qa, qrow(has0 ? r0 : 0), qrow(has8 ? r8 : 0), has0, has8, t);
  }
  float o[HD / 8][4];
#pragma unroll
  for (int nd = 0; nd < HD / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
  float m0 = -INFINITY, m8 = -INFINITY;  // running max (base 2) of rows r0, r8
  float l0 = 0.f, l8 = 0.f;              // this lane's part of their denominators

  const std::int32_t num_tiles = pt.kv_end > pt.kv_begin ? (pt.kv_end - pt.kv_begin + Tr::kTileK - 1) / Tr::kTileK : 0;
  if (num_tiles > 0) load_tile(pt.kv_begin, 0);
  for (std::int32_t it = 0; it < num_tiles; ++it) {
    const std::int32_t kv0 = pt.kv_begin + it * Tr::kTileK;
    if (it + 1 < num_tiles) {
      load_tile(kv0 + Tr::kTileK, (it + 1) % Tr::kStages);
    } else {
      cp_async_commit();  // empty group keeps the wait count uniform
    }
    cp_async_wait<1>();
    __syncthreads();

    const std::int32_t kv_last = min(kv0 + Tr::kTileK, pt.kv_end) - 1;
    if (warp_hi >= kv0 && warp_lo <= kv_last) {  // warp-uniform: some row of the warp sees some key of the tile
      const T* const ks = smem_kv + (it % Tr::kStages) * 2 * Tr::kStageElems;
      const T* const vs = ks + Tr::kStageElems;
      float s[Tr::kTileK / 8][4];
#pragma unroll
      for (int j = 0; j < Tr::kTileK / 8; ++j) {
        mma_qk_tile<T, HD>(s[j], qa, ks + (8 * j + g) * HD, g, t);  // row & 7 == g
      }
      float mx0 = m0, mx8 = m8;
#pragma unroll
      for (int j = 0; j < Tr::kTileK / 8; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const std::int32_t key = kv0 + 8 * j + 2 * t + c;  // <= kv_last is implied by key <= qpos (< kv_end)
          s[j][c] = key <= qpos0 && key >= qlo0 ? s[j][c] * a.scale_log2 : -INFINITY;
          s[j][2 + c] = key <= qpos8 && key >= qlo8 ? s[j][2 + c] * a.scale_log2 : -INFINITY;
          mx0 = fmaxf(mx0, s[j][c]);
          mx8 = fmaxf(mx8, s[j][2 + c]);
        }
      }
      // A row that has seen no visible key yet keeps m = -inf: alpha 1, p 0 (never exp2(-inf - -inf)).
      online_rescale<HD, true>(o, m0, m8, l0, l8, mx0, mx8);
      const int vrow = (lane % 8) + 8 * ((lane / 8) & 1);  // ldmatrix row of this lane within a 16-key block
#pragma unroll
      for (int kb = 0; kb < Tr::kTileK / 16; ++kb) {
        unsigned pa[4];
        softmax_p_fragments<T, true>(pa, s[2 * kb], s[2 * kb + 1], m0, m8, l0, l8);
        mma_pv_block<T, HD>(o, pa, vs + (16 * kb + vrow) * HD, lane);  // (16 kb + vrow) & 7 == lane % 8
      }
    }
    __syncthreads();  // the stage just read is refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();

  l0 = quad_sum(l0);
  l8 = quad_sum(l8);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = half == 0 ? r0 : r8;
    if (r >= pt.rows) continue;
    const float l = half == 0 ? l0 : l8;
    const float m = half == 0 ? m0 : m8;
    const std::int64_t row = static_cast<std::int64_t>(pt.q_begin + pt.tile_q0 + r) * a.num_qo_heads + h;
    const float inv = l > 0.f ? a.v_scale / l : 0.f;
    unsigned* const out = reinterpret_cast<unsigned*>(static_cast<T*>(a.o) + row * HD);
#pragma unroll
    for (int nd = 0; nd < HD / 8; ++nd) {
      out[nd * 4 + t] = pack2<T>(o[nd][2 * half] * inv, o[nd][2 * half + 1] * inv);
    }
    if (t == 0 && a.lse != nullptr) a.lse[row] = l > 0.f ? (m + log2f(l)) * 0.69314718055994530942f : -INFINITY;
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

/// Host: launches kernel over grid (ceil(total_q_tokens / tile_q) + batch, num_qo_heads), block `threads`, `smem`
/// bytes of dynamic shared memory (raised once per device through smem_set). kInvalidValue when the tile count
/// exceeds grid.x.
template <class Kernel>
Status launch_prefill_kernel(Kernel* kernel, int tile_q, int threads, std::size_t smem,
                             std::atomic<std::uint64_t>& smem_set, const PrefillArgs& a, std::int32_t total_q_tokens,
                             cudaStream_t stream) {
  const std::int64_t tiles = ceil_div(total_q_tokens, tile_q) + a.pages.batch_size;
  if (tiles > 0x7fffffff) {
    return pagedkv::detail::fail(Status::kInvalidValue, "total_q_tokens", " = %d: %lld query tiles exceed grid.x",
                                 total_q_tokens, static_cast<long long>(tiles));
  }
  if (const Status s = ensure_max_dynamic_smem(kernel, smem, smem_set); s != Status::kSuccess) return s;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.num_qo_heads));
  return launch_kernel(kernel, grid, dim3(static_cast<unsigned>(threads)), smem, stream, a);
}

/// Host: launches the prefill kernel for (T, HD, KV): prefill_mma_kernel where kPrefillUsesMma (tensor cores: fp16 /
/// bf16, head_dim 64 / 128, same-type pool), else prefill_kernel; only the kernel launched is instantiated.
/// Arguments validated by the caller; total_q_tokens > 0, batch > 0.
template <KernelElement T, int HD, class KV = T>
Status launch_prefill(const PrefillArgs& a, std::int32_t total_q_tokens, cudaStream_t stream) {
  static std::atomic<std::uint64_t> smem_set{0};  // one per instantiation: devices whose attribute is set
  if constexpr (kPrefillUsesMma<T, HD, KV>) {
    using Tm = PrefillMmaTraits<T, HD>;
    return launch_prefill_kernel(prefill_mma_kernel<T, HD>, Tm::kTileQ, Tm::kThreads, Tm::kSmemBytes, smem_set, a,
                                 total_q_tokens, stream);
  } else {
    using Tr = PrefillTraits<T, HD>;
    return launch_prefill_kernel(prefill_kernel<T, HD, KV>, Tr::kTileQ, Tr::kThreads, Tr::kSmemBytes, smem_set, a,
                                 total_q_tokens, stream);
  }
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
