// pagedkv/cuda/decode.cuh: paged decode attention (one query token per sequence) with GQA packing and split-KV.
//
// Sources: PagedAttention (Kwon et al., SOSP'23) for the page indirection; FlashInfer's batch decode for the
// thread layout (lanes along head_dim with 16-byte vectors, K/V tiles staged in shared memory by cp.async and
// shared by all query heads of a group) and its plan/run split; Flash-Decoding (Dao et al., 2023) for split-KV +
// log-sum-exp merge; FlashInfer's tensor-core decode ("use_tensor_cores" for GQA) and FlashAttention-2 for the
// tensor-core kernel (decode_mma_kernel, below: the group's query heads as the MMA's rows).
//
// Two attention kernels share the work resolution, tile staging and phase merge (device functions below):
// decode_kernel (CUDA cores; described next) and decode_mma_kernel (mma.sync; fp16 / bf16, head_dim 64 / 128, tiles
// of >= 2 query heads, same-type or fp8 pool). launch_decode picks one per launch; the grid is the same.
//
// CTA = one unit of work (sequence b, kv head, head tile, token range). Where the unit comes from:
//   - work-list mode (DecodeArgs::items != null): CTA i runs work item i of a plan (pagedkv/decode_plan.hpp); the
//     grid is the list's fixed capacity and padding items exit at once. The plan decides every range, the merge
//     list names the split requests. This is what the CPU reference executes too.
//   - grid mode (legacy DecodeParams chunk rule): grid (batch, kv heads * head tiles, chunks), range from
//     effective_chunk.
//   Either way the range is clamped to the keys the query sees (DecodeParams::window: sliding window / chunked-local,
//   [first_visible_token(kv_len - 1), kv_len)), so pages wholly before the window, which may be the null block 0,
//   are never dereferenced; a range with nothing visible writes the masked partial (o = 0, lse = -inf).
// Layout inside a CTA:
//   lanes_per_row = head_dim / ept lanes hold one row (ept = elements per thread, 16-byte vectors interleaved
//   so shared-memory reads are conflict-free); the CTA has kSlots = threads / lanes_per_row row slots.
//   Slot s works for query head (s % heads_per_tile) of the tile and token phase (s / heads_per_tile); phases
//   split the range's tokens round-robin. Each slot runs an fp32 online softmax (base-2 exponent, q prescaled by
//   sm_scale * log2(e)); at the end the phases of a head are merged through shared memory.
//   K and V tiles of kTileTokens tokens are double-buffered in shared memory; the page id is read per row.
#pragma once

#include <cmath>

#include <pagedkv/cuda/common.cuh>
#include <pagedkv/decode_plan.hpp>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// Compile-time geometry of the decode kernel for (T, HD) and the K/V storage type KV (T, or Fp8E4M3: the same
/// lane layout over kVec-element groups, each group kVec bytes in shared memory instead of 16; tiles keep T's token
/// count, so an fp8 stage uses 1/2 (fp16/bf16) or 1/4 (fp32) of the shared memory).
template <KernelElement T, int HD, class KV = T>
  requires KernelHeadDim<HD> && KVStorageOf<KV, T>
struct DecodeTraits {
  static constexpr int kVec = kVecElems<T>;                           // elements per 16-byte vector
  static constexpr int kEpt = (HD / 32 > kVec) ? HD / 32 : kVec;      // elements per thread (multiple of kVec)
  static constexpr int kVecsPerThread = kEpt / kVec;
  static constexpr int kLanesPerRow = HD / kEpt;                      // 8, 16 or 32
  static constexpr int kThreads = (8 * kLanesPerRow > 128) ? 8 * kLanesPerRow : 128;
  static constexpr int kSlots = kThreads / kLanesPerRow;              // >= 8
  static constexpr int kRowBytes = HD * static_cast<int>(sizeof(T));
  static constexpr int kKVRowBytes = HD * static_cast<int>(sizeof(KV));  // stored bytes of one K (or V) row
  static constexpr int kChunksPerRow = kKVRowBytes / 16;              // 16-byte cp.async chunks per stored row
  static constexpr int kChunkElems = 16 / static_cast<int>(sizeof(KV));
  static constexpr int kTileTokens = (8192 / kRowBytes) < 8 ? 8 : 8192 / kRowBytes;  // 8 KiB of K (T) per stage
  static constexpr int kStages = 2;
  static constexpr int kStageElems = kTileTokens * HD;                // one of K or V, one stage
  static constexpr int kKVSmemBytes = kStages * 2 * kStageElems * static_cast<int>(sizeof(KV));
  static constexpr int kRedStride = HD + 2;                           // per slot: o[HD], m, d
  static constexpr int kRedSmemBytes = kSlots * kRedStride * static_cast<int>(sizeof(float));
  static constexpr int kSmemBytes = kKVSmemBytes > kRedSmemBytes ? kKVSmemBytes : kRedSmemBytes;
  static_assert(kLanesPerRow <= 32 && (kLanesPerRow & (kLanesPerRow - 1)) == 0,
                "DecodeTraits: a row must map to a power-of-two group of lanes within one warp");
  static_assert(kSmemBytes <= 48 * 1024, "DecodeTraits: static shared memory must stay under 48 KiB");
};

/// Kernel arguments derived on the host from DecodeParams (element strides, the head tiling, the work source).
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
  std::int32_t num_kv_heads;
  std::int32_t group_size;      // num_qo_heads / num_kv_heads
  std::int32_t heads_per_tile;  // query heads one CTA computes
  std::int32_t num_head_tiles;  // ceil(group_size / heads_per_tile)
  std::int32_t phases;          // kSlots / heads_per_tile
  float scale_log2;             // sm_scale * log2(e) (fp8 pool: times k_scale, folded into q)
  float v_scale;                // 1, or an fp8 pool's v_scale (applied to each output / partial row)
  // Local attention (DecodeParams::window): the query at kv_len - 1 sees [first_visible_token(kv_len - 1, ...), kv_len).
  std::int32_t window_tokens;   // AttentionWindow::sliding_window_tokens (0 = off)
  std::int32_t chunk_tokens;    // AttentionWindow::attention_chunk_tokens (0 = off)
  // Work-list mode (items != null): CTA i runs items[i]; the merge kernel runs merges[0, merge_capacity).
  const DecodeWorkItem* items;
  const DecodeMergeItem* merges;
  std::int32_t merge_capacity;
  std::int64_t partial_row_capacity;  // workspace rows in work-list mode (items and merges naming more are skipped)
  // Grid mode: split iff `split`; chunk c of sequence b writes partial row b * max_num_chunks + c.
  bool split;
  std::int32_t chunk_request;   // DecodeParams::kv_chunk_size_tokens
  std::int32_t max_num_chunks;
  float* ws_o;                  // [partial rows, num_qo_heads, HD] (grid mode: rows = batch * max_num_chunks)
  float* ws_lse;                // [partial rows, num_qo_heads]
};

/// One CTA's unit of work, resolved from the work list (or the chunk rule) and clamped to the visible keys.
struct DecodeWork {
  std::int32_t b, kv_head, head_tile, chunk_begin, chunk_end;
  std::int64_t partial_row;  // -1: write o and lse
  std::int32_t head0;        // first query head of the tile
  std::int32_t tile_heads;   // query heads of the tile (<= heads_per_tile)
};

/// Resolves this CTA's work (both kernels of the family). Returns false when the CTA has nothing to do at all (a
/// padding item, a malformed one, a chunk the sequence does not have, an empty head tile); an empty token range
/// returns true with chunk_begin >= chunk_end (the caller writes the masked result, decode_write_empty).
__device__ __forceinline__ bool decode_work(const DecodeArgs& a, DecodeWork& w) {
  const std::int32_t bs = a.block_size;
  if (a.items != nullptr) {
    const DecodeWorkItem it = a.items[blockIdx.x];
    if (it.valid == 0 || it.request < 0 || it.request >= a.pages.batch_size || it.kv_head < 0 ||
        it.kv_head >= a.num_kv_heads || it.head_tile < 0 || it.head_tile >= a.num_head_tiles) {
      return false;  // padding (or a malformed item: precondition violated, skipped)
    }
    if (it.partial_row >= a.partial_row_capacity) return false;  // a row past the workspace: precondition violated
    w.b = it.request;
    w.kv_head = it.kv_head;
    w.head_tile = it.head_tile;
    w.partial_row = it.partial_row < 0 ? -1 : it.partial_row;
    // Never read past the sequence the page table describes, nor before the window, whatever the plan says.
    const std::int32_t kv_len = seq_kv_len(a.pages, w.b, bs);
    const std::int32_t first = kv_len > 0 ? first_visible_token(kv_len - 1, a.window_tokens, a.chunk_tokens) : 0;
    w.chunk_begin = max(it.kv_begin, first);
    w.chunk_end = min(it.kv_end, kv_len);
  } else {
    w.b = static_cast<std::int32_t>(blockIdx.x);
    w.kv_head = static_cast<std::int32_t>(blockIdx.y) / a.num_head_tiles;
    w.head_tile = static_cast<std::int32_t>(blockIdx.y) % a.num_head_tiles;
    const std::int32_t kv_len = seq_kv_len(a.pages, w.b, bs);
    const std::int32_t first = kv_len > 0 ? first_visible_token(kv_len - 1, a.window_tokens, a.chunk_tokens) : 0;
    w.chunk_begin = first;
    w.chunk_end = kv_len;
    w.partial_row = -1;
    if (a.split) {
      const std::int32_t chunk_idx = static_cast<std::int32_t>(blockIdx.z);
      const std::int32_t chunk = effective_chunk(kv_len, a.chunk_request, a.max_num_chunks);
      w.chunk_begin = static_cast<std::int32_t>(min(static_cast<std::int64_t>(chunk_idx) * chunk,
                                                    static_cast<std::int64_t>(kv_len)));
      w.chunk_end = static_cast<std::int32_t>(min(static_cast<std::int64_t>(w.chunk_begin) + chunk,
                                                  static_cast<std::int64_t>(kv_len)));
      if (w.chunk_begin >= w.chunk_end) return false;  // this chunk does not exist for this sequence (merge skips it)
      w.partial_row = static_cast<std::int64_t>(w.b) * a.max_num_chunks + chunk_idx;
      // A chunk wholly before the window is masked: it reads nothing and writes o = 0, lse = -inf (below), which the
      // merge weighs 0. The chunk straddling the window start reads only its visible part.
      w.chunk_begin = max(w.chunk_begin, first);
    }
  }
  w.head0 = w.kv_head * a.group_size + w.head_tile * a.heads_per_tile;
  w.tile_heads = min(a.heads_per_tile, a.group_size - w.head_tile * a.heads_per_tile);
  return w.tile_heads > 0;  // balanced head tiling can leave the last tile empty for very large groups
}

/// An empty range: a padding sequence (o = 0, lse = -inf), a chunk wholly before the window (masked), or a plan
/// item whose range the page table or the window does not have (precondition violated): its partial row gets
/// o = 0, lse = -inf, which the merge weighs 0. Nothing is read, so null pages before the window are never touched.
template <KernelElement T, int HD, int kThreads>
__device__ __forceinline__ void decode_write_empty(const DecodeArgs& a, const DecodeWork& w) {
  for (int i = threadIdx.x; i < w.tile_heads * HD; i += kThreads) {
    const std::int64_t h = w.head0 + i / HD;
    if (w.partial_row >= 0) {
      const std::int64_t r = w.partial_row * a.num_qo_heads + h;
      a.ws_o[r * HD + i % HD] = 0.f;
      if (i % HD == 0) a.ws_lse[r] = -INFINITY;
    } else {
      static_cast<T*>(a.o)[(static_cast<std::int64_t>(w.b) * a.num_qo_heads + h) * HD + i % HD] = from_float<T>(0.f);
      if (a.lse != nullptr && i % HD == 0) a.lse[static_cast<std::int64_t>(w.b) * a.num_qo_heads + h] = -INFINITY;
    }
  }
}

/// Stages the K and V rows of tile `tile` of this CTA's range (tokens [w.chunk_begin + tile * kTileTokens, ...),
/// clamped to chunk_end) into ks / vs: load_kv_rows.
template <class KV, int HD, int kTileTokens, int kThreads, bool kSwizzle>
__device__ __forceinline__ void decode_load_tile(const DecodeArgs& a, const DecodeWork& w, const char* k_head,
                                                 const char* v_head, int tile, KV* ks, KV* vs) {
  const std::int32_t tok0 = w.chunk_begin + tile * kTileTokens;
  load_kv_rows<KV, HD, kTileTokens, kThreads, kSwizzle>(a.pages, w.b, a.block_size, a.stride_page, a.stride_token,
                                                        k_head, v_head, tok0, min(kTileTokens, w.chunk_end - tok0),
                                                        ks, vs);
}

/// Merges the per-phase softmax states of each head of the tile and stores the result. red: [phases x
/// heads_per_tile] rows of kRedStride = HD + 2 floats (unnormalized o[HD], m (base 2), d), row (ph * heads_per_tile +
/// hl); a phase that saw no token has m = -inf, d = 0, o = 0. Writes o / lse, or the normalized partial and its lse.
template <KernelElement T, int HD, int kThreads>
__device__ __forceinline__ void decode_merge_store(const DecodeArgs& a, const DecodeWork& w, const float* red,
                                                   int phases) {
  constexpr int kRedStride = HD + 2;
  for (int i = static_cast<int>(threadIdx.x); i < w.tile_heads * HD; i += kThreads) {
    const int hl = i / HD;
    const int dim = i % HD;
    float mx = -INFINITY;
    for (int ph = 0; ph < phases; ++ph) mx = fmaxf(mx, red[(ph * a.heads_per_tile + hl) * kRedStride + HD]);
    float den = 0.f;
    float num = 0.f;
    for (int ph = 0; ph < phases; ++ph) {
      const float* row = red + (ph * a.heads_per_tile + hl) * kRedStride;
      const float wgt = row[HD] == -INFINITY ? 0.f : exp2f(row[HD] - mx);
      den = fmaf(row[HD + 1], wgt, den);
      num = fmaf(row[dim], wgt, num);
    }
    // den > 0: the chunk has >= 1 token, so some phase saw it.
    const float out = num / den * a.v_scale;  // v_scale: 1 unless fp8 (x * 1 is exact)
    const float lse_nat = (mx + log2f(den)) * 0.69314718055994530942f;
    const std::int64_t h = w.head0 + hl;
    if (w.partial_row >= 0) {
      const std::int64_t r = w.partial_row * a.num_qo_heads + h;
      a.ws_o[r * HD + dim] = out;
      if (dim == 0) a.ws_lse[r] = lse_nat;
    } else {
      const std::int64_t r = static_cast<std::int64_t>(w.b) * a.num_qo_heads + h;
      static_cast<T*>(a.o)[r * HD + dim] = from_float<T>(out);
      if (dim == 0 && a.lse != nullptr) a.lse[r] = lse_nat;
    }
  }
}

/// Decode kernel (CUDA cores). Work-list mode: grid = item capacity; grid mode: grid = (batch, num_kv_heads *
/// num_head_tiles, split ? max_num_chunks : 1). block = kThreads. KV = T reads the pool as T; KV = Fp8E4M3 reads e4m3
/// bytes and dequantizes them in registers (k_scale folded into the prescaled q, v_scale applied to the output).
template <KernelElement T, int HD, class KV = T>
__global__ void __launch_bounds__(DecodeTraits<T, HD, KV>::kThreads, 1)
    decode_kernel(const DecodeArgs a) {
  using Tr = DecodeTraits<T, HD, KV>;
  __shared__ __align__(16) unsigned char smem_raw[Tr::kSmemBytes];
  KV* const smem_kv = reinterpret_cast<KV*>(smem_raw);

  DecodeWork w;
  if (!decode_work(a, w)) return;
  const std::int32_t b = w.b, chunk_begin = w.chunk_begin, chunk_end = w.chunk_end;
  const std::int32_t head0 = w.head0, tile_heads = w.tile_heads;
  if (chunk_begin >= chunk_end) {
    decode_write_empty<T, HD, Tr::kThreads>(a, w);
    return;
  }
  const std::int32_t num_tokens = chunk_end - chunk_begin;
  const std::int32_t num_tiles = static_cast<std::int32_t>(ceil_div(num_tokens, Tr::kTileTokens));

  const char* const k_head = static_cast<const char*>(a.k) + w.kv_head * a.stride_head * std::int64_t{sizeof(KV)};
  const char* const v_head = static_cast<const char*>(a.v) + w.kv_head * a.stride_head * std::int64_t{sizeof(KV)};
  auto load_tile = [&](int tile, int stage) {
    KV* const ks = smem_kv + stage * 2 * Tr::kStageElems;
    decode_load_tile<KV, HD, Tr::kTileTokens, Tr::kThreads, false>(a, w, k_head, v_head, tile, ks, ks + Tr::kStageElems);
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
      const KV* const ks = smem_kv + (tile % Tr::kStages) * 2 * Tr::kStageElems;
      const KV* const vs = ks + Tr::kStageElems;
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
              load_kv_vec<T, KV, false>(ks + t * HD + (j * Tr::kLanesPerRow + lane_in_row) * Tr::kVec,
                                        kf + j * Tr::kVec);
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
              load_kv_vec<T, KV, false>(vs + t * HD + (j * Tr::kLanesPerRow + lane_in_row) * Tr::kVec,
                                        vf + j * Tr::kVec);
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

  decode_merge_store<T, HD, Tr::kThreads>(a, w, red, a.phases);
}

// ---- tensor-core decode for GQA (query heads of a tile as the MMA's rows) ----------------------------------------

/// Geometry of the tensor-core decode kernel (fp16 / bf16, head_dim 64 or 128, KV = T or fp8 e4m3): 2 warps; each
/// takes 16 of a stage's 32 tokens. S = Q K^T and O += P V run as mma.sync m16n8k16 (fp32 accumulate) with the
/// tile's query heads as the 16 rows (rows past tile_heads are zero), so each K/V element staged in shared memory
/// feeds every head of the group through one fragment load, instead of one load, one conversion and one shuffle
/// reduction per head. An fp8 pool is staged as bytes (half the copy) and converted once per stage into a T tile
/// (exact: every e4m3 value is a bf16 and an fp16 value), which the MMAs read as for a T pool.
template <KernelElement T, int HD, class KV = T>
struct DecodeMmaTraits {
  static constexpr bool kFp8 = !std::same_as<KV, T>;
  static constexpr int kWarps = 2;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kTileTokens = 16 * kWarps;
  static constexpr int kStages = 2;
  static constexpr int kStageElems = kTileTokens * HD;  // one of K or V, one stage
  static constexpr int kStagedBytes = kStages * 2 * kStageElems * static_cast<int>(sizeof(KV));
  static constexpr int kKVSmemBytes = kStagedBytes + (kFp8 ? 2 * kStageElems * static_cast<int>(sizeof(T)) : 0);
  static constexpr int kRedStride = HD + 2;
  static constexpr int kRedSmemBytes = kWarps * 16 * kRedStride * static_cast<int>(sizeof(float));
  static constexpr int kSmemBytes = kKVSmemBytes > kRedSmemBytes ? kKVSmemBytes : kRedSmemBytes;
  static_assert(HD == 64 || HD == 128, "DecodeMmaTraits: head_dim 64 or 128 (the fp32 output fragment is HD / 2 registers)");
  static_assert(kSmemBytes <= 48 * 1024, "DecodeMmaTraits: static shared memory must stay under 48 KiB");
};

/// Whether decode uses the tensor-core kernel: fp16 / bf16 query, an fp16 / bf16 (same type) or fp8 e4m3 pool,
/// head_dim 64 or 128, and at least two query heads per tile (one head would leave 15 of the MMA's 16 rows idle; the CUDA-core kernel reads K/V at the
/// copy bandwidth there).
template <KernelElement T, int HD, class KV>
inline constexpr bool kDecodeUsesMma = !std::same_as<T, float> && (HD == 64 || HD == 128);
inline constexpr bool decode_mma_tile(std::int32_t heads_per_tile) { return heads_per_tile >= 2; }

/// Tensor-core decode kernel (kDecodeUsesMma). Same grid, work resolution, windows, partial rows and output as
/// decode_kernel; block = DecodeMmaTraits::kThreads. Per warp and 16-token block: S (16 heads x 16 tokens) =
/// Q K^T in 2 x HD/16 MMAs from swizzled shared memory, scaled to base 2 and masked past the range, an online softmax
/// per row (each row's 4 lanes reduce with 2 shuffles), then O (16 x HD) += P V in HD/8 MMAs with P rounded to T (as
/// FlashAttention-2) and V fragments from ldmatrix .trans. The two warps' states merge through shared memory. An fp8
/// pool: the stage is converted to T in shared memory first (k_scale is in scale_log2, v_scale applied at the store).
template <KernelElement T, int HD, class KV = T>
__global__ void __launch_bounds__(DecodeMmaTraits<T, HD, KV>::kThreads, 6) decode_mma_kernel(const DecodeArgs a) {
  using Tr = DecodeMmaTraits<T, HD, KV>;
  __shared__ __align__(16) unsigned char smem_raw[Tr::kSmemBytes];
  KV* const smem_kv = reinterpret_cast<KV*>(smem_raw);
  T* const smem_conv = reinterpret_cast<T*>(smem_raw + Tr::kStagedBytes);  // fp8: the stage converted to T (K, V)

  DecodeWork w;
  if (!decode_work(a, w)) return;
  if (w.chunk_begin >= w.chunk_end) {
    decode_write_empty<T, HD, Tr::kThreads>(a, w);
    return;
  }
  const std::int32_t num_tokens = w.chunk_end - w.chunk_begin;
  const std::int32_t num_tiles = static_cast<std::int32_t>(ceil_div(num_tokens, Tr::kTileTokens));
  const char* const k_head = static_cast<const char*>(a.k) + w.kv_head * a.stride_head * std::int64_t{sizeof(KV)};
  const char* const v_head = static_cast<const char*>(a.v) + w.kv_head * a.stride_head * std::int64_t{sizeof(KV)};
  auto load_tile = [&](int tile, int stage) {  // T: swizzled and zero-filled here; fp8: by the conversion below
    KV* const ks = smem_kv + stage * 2 * Tr::kStageElems;
    decode_load_tile<KV, HD, Tr::kTileTokens, Tr::kThreads, !Tr::kFp8>(a, w, k_head, v_head, tile, ks,
                                                                        ks + Tr::kStageElems);
  };

  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4;  // fragment row (head g and g + 8) / column (token or dim g)
  const int t = lane % 4;  // fragment column pair 2t, 2t + 1

  // Q as the A operand of HD/16 k-steps: qa[kk] = {(g, 16kk+2t), (g+8, 16kk+2t), (g, 16kk+8+2t), (g+8, 16kk+8+2t)}.
  unsigned qa[HD / 16][4];
  {
    const unsigned* const q0 = reinterpret_cast<const unsigned*>(
        static_cast<const T*>(a.q) + (static_cast<std::int64_t>(w.b) * a.num_qo_heads + w.head0 + g) * HD);
    const unsigned* const q8 = reinterpret_cast<const unsigned*>(
        static_cast<const T*>(a.q) + (static_cast<std::int64_t>(w.b) * a.num_qo_heads + w.head0 + g + 8) * HD);
    load_a_fragments<HD>(qa, q0, q8, g < w.tile_heads, g + 8 < w.tile_heads, t);
  }
  float o[HD / 8][4];
#pragma unroll
  for (int nd = 0; nd < HD / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
  float m0 = -INFINITY, m8 = -INFINITY;  // running max (base 2) of rows g, g + 8
  float d0 = 0.f, d8 = 0.f;              // this lane's part of the running denominators

  load_tile(0, 0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    if (tile + 1 < num_tiles) {
      load_tile(tile + 1, (tile + 1) % Tr::kStages);
    } else {
      cp_async_commit();  // empty group keeps the wait count uniform
    }
    cp_async_wait<1>();
    __syncthreads();

    const int n = min(Tr::kTileTokens, num_tokens - tile * Tr::kTileTokens);  // valid tokens of the stage
    const T* ks;
    if constexpr (Tr::kFp8) {
      // e4m3 stage -> T tile: each 16-byte chunk (16 codes) of row r becomes T chunks 2c and 2c + 1, swizzled by
      // r & 7 like a T stage; rows past the range become zeros.
      const KV* const staged = smem_kv + (tile % Tr::kStages) * 2 * Tr::kStageElems;
      constexpr int kChunks = HD / 16;  // 16-byte fp8 chunks per row
      for (int i = static_cast<int>(threadIdx.x); i < 2 * Tr::kTileTokens * kChunks; i += Tr::kThreads) {
        const int kv = i / (Tr::kTileTokens * kChunks);  // 0: K, 1: V
        const int r = (i / kChunks) % Tr::kTileTokens;
        const int c = i % kChunks;
        T* const dst = smem_conv + kv * Tr::kStageElems + r * HD;
        uint4 lo = make_uint4(0u, 0u, 0u, 0u), hi = lo;
        if (r < n) {
          const uint4 raw = *reinterpret_cast<const uint4*>(staged + kv * Tr::kStageElems + r * HD + c * 16);
          float f[8];
          unpack_e4m3<8>(raw.x, raw.y, f);
          lo = pack16<T>(f);
          unpack_e4m3<8>(raw.z, raw.w, f);
          hi = pack16<T>(f);
        }
        *reinterpret_cast<uint4*>(dst + (((2 * c) ^ (r & 7)) * 8)) = lo;
        *reinterpret_cast<uint4*>(dst + (((2 * c + 1) ^ (r & 7)) * 8)) = hi;
      }
      __syncthreads();
      ks = smem_conv;
    } else {
      ks = smem_kv + (tile % Tr::kStages) * 2 * Tr::kStageElems;
    }
    const int tok0 = warp * 16;  // this warp's first token
    if (tok0 < n) {              // warp-uniform
      const T* const vs = ks + Tr::kStageElems;
      // S = Q K^T: n-tile j covers tokens tok0 + 8j + [0, 8); B fragment (k = dims 2t, 2t+1 [+8], n = token g).
      float s[2][4];
#pragma unroll
      for (int j = 0; j < 2; ++j) mma_qk_tile<T, HD>(s[j], qa, ks + (tok0 + 8 * j + g) * HD, g, t);  // row & 7 == g
      // Scale to base 2, mask tokens past the range, online softmax per row.
      float mx0 = m0, mx8 = m8;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const bool valid = tok0 + 8 * j + 2 * t + c < n;
          s[j][c] = valid ? s[j][c] * a.scale_log2 : -INFINITY;
          s[j][2 + c] = valid ? s[j][2 + c] * a.scale_log2 : -INFINITY;
          mx0 = fmaxf(mx0, s[j][c]);
          mx8 = fmaxf(mx8, s[j][2 + c]);
        }
      }
      // mx is finite: token tok0 is valid, so every row has a finite score (rows past tile_heads score 0);
      // exp2(-inf) = 0 rescales nothing on the first block.
      online_rescale<HD, false>(o, m0, m8, d0, d8, mx0, mx8);
      unsigned pa[4];  // P as the A operand (k = the warp's 16 tokens)
      softmax_p_fragments<T, false>(pa, s[0], s[1], m0, m8, d0, d8);
      // O += P V; lane l addresses token (l % 8) + 8 ((l / 8) & 1) of the warp's 16, whose row & 7 == l % 8.
      mma_pv_block<T, HD>(o, pa, vs + (tok0 + (lane % 8) + 8 * ((lane / 8) & 1)) * HD, lane);
    }
    __syncthreads();  // the stage just read is refilled by the next iteration's prefetch
  }
  cp_async_wait<0>();

  // ---- each warp's state (unnormalized o, m, d per head) into shared memory, then merge the two warps ----
  d0 = quad_sum(d0);
  d8 = quad_sum(d8);
  float* const red = reinterpret_cast<float*>(smem_raw);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int hl = g + 8 * half;
    if (hl < w.tile_heads) {
      float* const row = red + (warp * a.heads_per_tile + hl) * Tr::kRedStride;
#pragma unroll
      for (int nd = 0; nd < HD / 8; ++nd) {
        row[nd * 8 + 2 * t] = o[nd][2 * half];
        row[nd * 8 + 2 * t + 1] = o[nd][2 * half + 1];
      }
      if (t == 0) {
        row[HD] = half == 0 ? m0 : m8;  // -inf, d = 0, o = 0 for a warp that saw no token
        row[HD + 1] = half == 0 ? d0 : d8;
      }
    }
  }
  __syncthreads();
  decode_merge_store<T, HD, Tr::kThreads>(a, w, red, Tr::kWarps);
}

/// Merge kernel (Flash-Decoding): o[b, h] = sum_c exp(lse_c - lse) * o_c, lse = log sum_c exp(lse_c), over the
/// partial rows of request b in row order. A masked partial (a chunk wholly outside the window: o_c = 0, lse_c =
/// -inf) gets weight exp(-inf) = 0; if every partial is masked, o = 0 and lse = -inf. One warp per (merge entry, h)
/// in work-list mode (grid = ceil(merge_capacity * num_qo_heads / 4)), per (b, h) in grid mode (grid =
/// ceil(batch * num_qo_heads / 4)); block = 128.
template <KernelElement T, int HD>
__global__ void __launch_bounds__(128) decode_merge_kernel(const DecodeArgs a) {
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * 4 + threadIdx.x / 32;
  const std::int32_t batch = a.pages.batch_size;
  const int lane = static_cast<int>(threadIdx.x % 32);
  constexpr int kVec = kVecElems<T>;
  std::int32_t b, h, nc;
  std::int64_t first_row;  // partial row of chunk 0
  if (a.merges != nullptr) {
    if (row >= static_cast<std::int64_t>(a.merge_capacity) * a.num_qo_heads) return;
    const DecodeMergeItem m = a.merges[row / a.num_qo_heads];
    if (m.valid == 0 || m.request < 0 || m.request >= batch) return;  // padding
    if (m.partial_begin < 0 || m.num_partials < 0 ||
        std::int64_t{m.partial_begin} + m.num_partials > a.partial_row_capacity) {
      return;  // rows past the workspace: precondition violated
    }
    b = m.request;
    h = static_cast<std::int32_t>(row % a.num_qo_heads);
    nc = m.num_partials;
    first_row = m.partial_begin;
  } else {
    if (row >= static_cast<std::int64_t>(batch) * a.num_qo_heads) return;
    b = static_cast<std::int32_t>(row / a.num_qo_heads);
    h = static_cast<std::int32_t>(row % a.num_qo_heads);
    const std::int32_t kv_len = seq_kv_len(a.pages, b, a.block_size);
    nc = kv_len <= 0 ? 0 : static_cast<std::int32_t>(ceil_div(kv_len, effective_chunk(kv_len, a.chunk_request, a.max_num_chunks)));
    first_row = static_cast<std::int64_t>(b) * a.max_num_chunks;
  }
  const std::int64_t orow = static_cast<std::int64_t>(b) * a.num_qo_heads + h;
  T* const out = static_cast<T*>(a.o) + orow * HD;
  float mx = -INFINITY;
  for (int c = 0; c < nc; ++c) mx = fmaxf(mx, a.ws_lse[(first_row + c) * a.num_qo_heads + h]);
  if (mx == -INFINITY) {  // padding sequence (or only empty partials): o = 0, lse = -inf
    float zeros[kVec] = {};
    for (int v = lane; v < HD / kVec; v += 32) *reinterpret_cast<uint4*>(out + v * kVec) = pack16<T>(zeros);
    if (lane == 0 && a.lse != nullptr) a.lse[orow] = -INFINITY;
    return;
  }
  float sum = 0.f;
  for (int c = 0; c < nc; ++c) sum += expf(a.ws_lse[(first_row + c) * a.num_qo_heads + h] - mx);
  const float lse = mx + logf(sum);
  for (int v = lane; v < HD / kVec; v += 32) {
    float accv[kVec] = {};
    for (int c = 0; c < nc; ++c) {
      const std::int64_t r = (first_row + c) * a.num_qo_heads + h;
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
  if (lane == 0 && a.lse != nullptr) a.lse[orow] = lse;
}

/// Host: launches the decode kernel and, when anything can be split, the merge kernel, for (T, HD). Arguments
/// validated by the caller. Work-list mode: item_capacity attention CTAs and, if merge_capacity > 0 and the list
/// has partial rows (has_partials), ceil(merge_capacity * num_qo_heads / 4) merge CTAs; grid mode as before.
template <KernelElement T, int HD, class KV = T>
Status launch_decode(const DecodeArgs& a, std::int32_t item_capacity, bool has_partials, cudaStream_t stream) {
  using Tr = DecodeTraits<T, HD, KV>;
  const std::int32_t batch = a.pages.batch_size;
  // The attention kernel for this tiling: tensor cores for a GQA tile of fp16 / bf16 (decode_mma_kernel), else the
  // CUDA-core kernel. Same grid either way; only the block size differs.
  auto launch_attention = [&](dim3 grid) -> Status {
    if constexpr (kDecodeUsesMma<T, HD, KV>) {
      if (decode_mma_tile(a.heads_per_tile)) {
        return launch_kernel(decode_mma_kernel<T, HD, KV>, grid, dim3(DecodeMmaTraits<T, HD, KV>::kThreads), 0, stream,
                             a);
      }
    }
    return launch_kernel(decode_kernel<T, HD, KV>, grid, dim3(Tr::kThreads), 0, stream, a);
  };
  if (a.items != nullptr) {
    if (item_capacity > 0) {
      const Status s = launch_attention(dim3(static_cast<unsigned>(item_capacity)));
      if (s != Status::kSuccess) return s;
    }
    if (a.merges != nullptr && a.merge_capacity > 0 && has_partials) {
      const std::int64_t rows = static_cast<std::int64_t>(a.merge_capacity) * a.num_qo_heads;
      return launch_kernel(decode_merge_kernel<T, HD>, dim3(static_cast<unsigned>(ceil_div(rows, 4))), dim3(128), 0,
                           stream, a);
    }
    return Status::kSuccess;
  }
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>(a.num_kv_heads * a.num_head_tiles),
                  a.split ? static_cast<unsigned>(a.max_num_chunks) : 1u);
  if (const Status s = launch_attention(grid); s != Status::kSuccess) {
    return s;
  }
  if (a.split) {
    const std::int64_t rows = static_cast<std::int64_t>(batch) * a.num_qo_heads;
    return launch_kernel(decode_merge_kernel<T, HD>, dim3(static_cast<unsigned>(ceil_div(rows, 4))), dim3(128), 0,
                         stream, a);
  }
  return Status::kSuccess;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
