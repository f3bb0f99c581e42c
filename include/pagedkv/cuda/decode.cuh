// pagedkv/cuda/decode.cuh: paged decode attention (one query token per sequence) with GQA packing and split-KV.
//
// Sources: PagedAttention (Kwon et al., SOSP'23) for the page indirection; FlashInfer's batch decode for the
// thread layout (lanes along head_dim with 16-byte vectors, K/V tiles staged in shared memory by cp.async and
// shared by all query heads of a group) and its plan/run split; Flash-Decoding (Dao et al., 2023) for split-KV +
// log-sum-exp merge.
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

/// Decode kernel. Work-list mode: grid = item capacity; grid mode: grid = (batch, num_kv_heads * num_head_tiles,
/// split ? max_num_chunks : 1). block = kThreads. KV = T reads the pool as T; KV = Fp8E4M3 reads e4m3 bytes and
/// dequantizes them in registers (k_scale folded into the prescaled q, v_scale applied to the output).
template <KernelElement T, int HD, class KV = T>
__global__ void __launch_bounds__(DecodeTraits<T, HD, KV>::kThreads, 1)
    decode_kernel(const DecodeArgs a) {
  using Tr = DecodeTraits<T, HD, KV>;
  __shared__ __align__(16) unsigned char smem_raw[Tr::kSmemBytes];
  KV* const smem_kv = reinterpret_cast<KV*>(smem_raw);
  const std::int32_t bs = a.block_size;

  // ---- which work: (b, kv head, head tile, [chunk_begin, chunk_end), partial row or -1) ----
  std::int32_t b, kv_head, head_tile, chunk_begin, chunk_end;
  std::int64_t partial_row;  // -1: write o and lse
  if (a.items != nullptr) {
    const DecodeWorkItem it = a.items[blockIdx.x];
    if (it.valid == 0 || it.request < 0 || it.request >= a.pages.batch_size || it.kv_head < 0 ||
        it.kv_head >= a.num_kv_heads || it.head_tile < 0 || it.head_tile >= a.num_head_tiles) {
      return;  // padding (or a malformed item: precondition violated, skipped)
    }
    if (it.partial_row >= a.partial_row_capacity) return;  // a row past the workspace: precondition violated
    b = it.request;
    kv_head = it.kv_head;
    head_tile = it.head_tile;
    partial_row = it.partial_row < 0 ? -1 : it.partial_row;
    // Never read past the sequence the page table describes, nor before the window, whatever the plan says.
    const std::int32_t kv_len = seq_kv_len(a.pages, b, bs);
    const std::int32_t first = kv_len > 0 ? first_visible_token(kv_len - 1, a.window_tokens, a.chunk_tokens) : 0;
    chunk_begin = max(it.kv_begin, first);
    chunk_end = min(it.kv_end, kv_len);
  } else {
    b = static_cast<std::int32_t>(blockIdx.x);
    kv_head = static_cast<std::int32_t>(blockIdx.y) / a.num_head_tiles;
    head_tile = static_cast<std::int32_t>(blockIdx.y) % a.num_head_tiles;
    const std::int32_t kv_len = seq_kv_len(a.pages, b, bs);
    const std::int32_t first = kv_len > 0 ? first_visible_token(kv_len - 1, a.window_tokens, a.chunk_tokens) : 0;
    chunk_begin = first;
    chunk_end = kv_len;
    partial_row = -1;
    if (a.split) {
      const std::int32_t chunk_idx = static_cast<std::int32_t>(blockIdx.z);
      const std::int32_t chunk = effective_chunk(kv_len, a.chunk_request, a.max_num_chunks);
      chunk_begin = static_cast<std::int32_t>(min(static_cast<std::int64_t>(chunk_idx) * chunk,
                                                  static_cast<std::int64_t>(kv_len)));
      chunk_end = static_cast<std::int32_t>(min(static_cast<std::int64_t>(chunk_begin) + chunk,
                                                static_cast<std::int64_t>(kv_len)));
      if (chunk_begin >= chunk_end) return;  // this chunk does not exist for this sequence (merge skips it)
      partial_row = static_cast<std::int64_t>(b) * a.max_num_chunks + chunk_idx;
      // A chunk wholly before the window is masked: it reads nothing and writes o = 0, lse = -inf (below), which the
      // merge weighs 0. The chunk straddling the window start reads only its visible part.
      chunk_begin = max(chunk_begin, first);
    }
  }
  const std::int32_t head0 = kv_head * a.group_size + head_tile * a.heads_per_tile;  // first qo head of the tile
  const std::int32_t tile_heads = min(a.heads_per_tile, a.group_size - head_tile * a.heads_per_tile);
  if (tile_heads <= 0) return;  // balanced head tiling can leave the last tile empty for very large groups

  if (chunk_begin >= chunk_end) {
    // An empty range: a padding sequence (o = 0, lse = -inf), a chunk wholly before the window (masked), or a plan
    // item whose range the page table or the window does not have (precondition violated): its partial row gets
    // o = 0, lse = -inf, which the merge weighs 0. Nothing is read, so null pages before the window are never touched.
    for (int i = threadIdx.x; i < tile_heads * HD; i += Tr::kThreads) {
      const std::int64_t h = head0 + i / HD;
      if (partial_row >= 0) {
        const std::int64_t r = partial_row * a.num_qo_heads + h;
        a.ws_o[r * HD + i % HD] = 0.f;
        if (i % HD == 0) a.ws_lse[r] = -INFINITY;
      } else {
        static_cast<T*>(a.o)[(static_cast<std::int64_t>(b) * a.num_qo_heads + h) * HD + i % HD] = from_float<T>(0.f);
        if (a.lse != nullptr && i % HD == 0) a.lse[static_cast<std::int64_t>(b) * a.num_qo_heads + h] = -INFINITY;
      }
    }
    return;
  }
  const std::int32_t num_tokens = chunk_end - chunk_begin;
  const std::int32_t num_tiles = static_cast<std::int32_t>(ceil_div(num_tokens, Tr::kTileTokens));

  const char* const k_head = static_cast<const char*>(a.k) + kv_head * a.stride_head * std::int64_t{sizeof(KV)};
  const char* const v_head = static_cast<const char*>(a.v) + kv_head * a.stride_head * std::int64_t{sizeof(KV)};

  // Stage tile `tile` (tokens [chunk_begin + tile * kTileTokens, ...)) into shared-memory stage `stage`.
  auto load_tile = [&](int tile, int stage) {
    KV* const ks = smem_kv + stage * 2 * Tr::kStageElems;
    KV* const vs = ks + Tr::kStageElems;
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
            (blk * a.stride_page + in_page * a.stride_token) * std::int64_t{sizeof(KV)} + c * 16;
        cp_async16(ks + r * HD + c * Tr::kChunkElems, k_head + byte_off);
        cp_async16(vs + r * HD + c * Tr::kChunkElems, v_head + byte_off);
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
    const float out = num / den * a.v_scale;  // v_scale: 1 unless fp8 (x * 1 is exact)
    const float lse_nat = (mx + log2f(den)) * 0.69314718055994530942f;
    const std::int64_t h = head0 + hl;
    if (partial_row >= 0) {
      const std::int64_t r = partial_row * a.num_qo_heads + h;
      a.ws_o[r * HD + dim] = out;
      if (dim == 0) a.ws_lse[r] = lse_nat;
    } else {
      const std::int64_t r = static_cast<std::int64_t>(b) * a.num_qo_heads + h;
      static_cast<T*>(a.o)[r * HD + dim] = from_float<T>(out);
      if (dim == 0 && a.lse != nullptr) a.lse[r] = lse_nat;
    }
  }
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
  if (a.items != nullptr) {
    if (item_capacity > 0) {
      const Status s = launch_kernel(decode_kernel<T, HD, KV>, dim3(static_cast<unsigned>(item_capacity)),
                                     dim3(Tr::kThreads), 0, stream, a);
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
  if (const Status s = launch_kernel(decode_kernel<T, HD, KV>, grid, dim3(Tr::kThreads), 0, stream, a);
      s != Status::kSuccess) {
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
