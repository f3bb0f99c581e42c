// pagedkv/cuda/common.cuh: device-side building blocks shared by every kernel family: element types and their
// float conversions, 16-byte vector loads/stores, cp.async, the launch helper (cudaLaunchKernelEx), page-table
// access, the local-attention window, and the split-KV chunk rule.
//
// Device code only (include from .cu files compiled by nvcc). Kernels live in the versioned inline namespace
// `pagedkv::cuda::v0_1` so that two shared objects which both link pagedkv::cuda do not clash (CUB convention).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

#include <pagedkv/cuda/fp8_e4m3.hpp>
#include <pagedkv/kernel_params.hpp>

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// The element types the kernels are compiled for: float, __half, __nv_bfloat16 (DType kFloat32/kFloat16/kBFloat16).
template <class T>
concept KernelElement = std::same_as<T, float> || std::same_as<T, __half> || std::same_as<T, __nv_bfloat16>;

/// The head dims the kernels are compiled for.
template <int HD>
concept KernelHeadDim = HD == 64 || HD == 128 || HD == 256;

/// DType tag of an element type.
template <KernelElement T>
inline constexpr DType kDTypeOf = std::same_as<T, float> ? DType::kFloat32
                                  : std::same_as<T, __half> ? DType::kFloat16
                                                            : DType::kBFloat16;

__host__ __device__ constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }

// ---- scalar conversions ----
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <KernelElement T>
__device__ __forceinline__ T from_float(float x) {
  if constexpr (std::same_as<T, float>) {
    return x;
  } else if constexpr (std::same_as<T, __half>) {
    return __float2half_rn(x);
  } else {
    return __float2bfloat16_rn(x);
  }
}

/// Elements of T in one 16-byte vector.
template <KernelElement T>
inline constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

/// Converts one 16-byte vector holding kVecElems<T> elements to floats.
template <KernelElement T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
  if constexpr (std::same_as<T, float>) {
    out[0] = __uint_as_float(raw.x);
    out[1] = __uint_as_float(raw.y);
    out[2] = __uint_as_float(raw.z);
    out[3] = __uint_as_float(raw.w);
  } else {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::same_as<T, __half>) {
        __half2 h2;
        static_assert(sizeof(h2) == sizeof(unsigned));
        __builtin_memcpy(&h2, &words[i], sizeof(h2));
        const float2 f = __half22float2(h2);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
      } else {
        // bf16 -> float is a 16-bit shift: exact and cheaper than the intrinsic round trip.
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
      }
    }
  }
}

/// Converts kVecElems<T> floats to one 16-byte vector (round to nearest even).
template <KernelElement T>
__device__ __forceinline__ uint4 pack16(const float* in) {
  if constexpr (std::same_as<T, float>) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                      __float_as_uint(in[3]));
  } else {
    unsigned words[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (std::same_as<T, __half>) {
        const __half2 h2 = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
        __builtin_memcpy(&words[i], &h2, sizeof(unsigned));
      } else {
        const __nv_bfloat162 b2 = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
        __builtin_memcpy(&words[i], &b2, sizeof(unsigned));
      }
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
  }
}

/// A K/V storage type of the attention kernels: the element type T itself (a kSame pool) or Fp8E4M3 (an fp8 pool,
/// dequantized on load).
template <class KV, class T>
concept KVStorageOf = std::same_as<KV, T> || std::same_as<KV, Fp8E4M3>;

/// Decodes `n` (4 or 8) packed e4m3 codes (little-endian in `lo`, then `hi`) to floats: exact, scale not applied.
/// sm_89+: two codes per cvt.rn.f16x2.e4m3x2 (through cuda_fp8.h; every e4m3 value, NaN included, is exact in
/// fp16), then fp16 -> fp32; the first H100 run measured the bit-by-bit decode (e4m3_to_float per element) making an
/// fp8 decode 2.2x slower than bf16. Older targets keep the bit-by-bit decode.
template <int N>
__device__ __forceinline__ void unpack_e4m3(unsigned lo, unsigned hi, float* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#pragma unroll
  for (int i = 0; i < N; i += 2) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(((i < 4 ? lo : hi) >> (8 * (i % 4))) & 0xffffu);
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
    out[i] = f.x;
    out[i + 1] = f.y;
  }
#else
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = e4m3_to_float(((i < 4 ? lo : hi) >> (8 * (i % 4))) & 0xffu);
#endif
}

/// Loads the K/V storage of kVecElems<T> elements at `p` as floats: a 16-byte vector of T for a kSame pool, or
/// kVecElems<T> e4m3 bytes (8 for fp16/bf16, 4 for fp32) for an fp8 pool. `kGlobal`: through the read-only path
/// (global memory), else a plain (shared-memory) load. Precondition: p aligned to the bytes read.
template <KernelElement T, class KV, bool kGlobal>
__device__ __forceinline__ void load_kv_vec(const void* p, float* out) {
  if constexpr (std::same_as<KV, T>) {
    unpack16<T>(kGlobal ? __ldg(static_cast<const uint4*>(p)) : *static_cast<const uint4*>(p), out);
  } else if constexpr (kVecElems<T> == 8) {
    const uint2 r = kGlobal ? __ldg(static_cast<const uint2*>(p)) : *static_cast<const uint2*>(p);
    unpack_e4m3<8>(r.x, r.y, out);
  } else {
    const unsigned r = kGlobal ? __ldg(static_cast<const unsigned*>(p)) : *static_cast<const unsigned*>(p);
    unpack_e4m3<4>(r, 0u, out);
  }
}

/// 16-byte global load through the read-only path. Precondition: p is 16-byte aligned.
__device__ __forceinline__ uint4 ldg16(const void* p) { return __ldg(static_cast<const uint4*>(p)); }

// ---- cp.async (sm_80+): 16-byte global -> shared copies that bypass L1 and the register file ----
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---- launching ----

/// Launches `kernel<<<grid, block, smem_bytes, stream>>>(args...)` through cudaLaunchKernelEx and maps *this
/// launch's* return value to a Status (kSuccess or kCudaError), without synchronizing.
///
/// Why not `<<<...>>>` + cudaPeekAtLastError (the CUB convention this replaced): the triple-chevron launch reports
/// only through the per-thread last-error slot, and that slot also holds any earlier, unrelated non-sticky error
/// nobody consumed (a failed cudaMalloc elsewhere in the process, say), so a correct launch would be reported as
/// failed; and consuming the slot with cudaGetLastError would hide the other code's error from it. The return value
/// of cudaLaunchKernelEx belongs to this launch only: configuration errors (grid, block, shared memory, missing
/// kernel image). Like every runtime call it also returns a sticky error of an earlier asynchronous fault, which
/// leaves the context unusable for any launch, so kCudaError is right then too. Faults inside the kernel are
/// asynchronous and surface at the next synchronizing call, as with any launch.
template <class... KernelArgs, class... Args>
Status launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, std::size_t smem_bytes,
                     cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cfg.attrs = nullptr;
  cfg.numAttrs = 0;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
  if (e == cudaSuccess) return Status::kSuccess;
  return pagedkv::detail::fail(Status::kCudaError, "cudaLaunchKernelEx", ": %s (%s)", cudaGetErrorName(e),
                               cudaGetErrorString(e));
}

// ---- page tables (docs/contract.md section 3) ----

/// Tokens cached for sequence b: CSR (num_pages - 1) * block_size + last_page_len (0 pages -> 0), padded seq_lens[b].
__device__ __forceinline__ std::int32_t seq_kv_len(const PageTable& pt, std::int32_t b, std::int32_t block_size) {
  if (pt.format == PageTableFormat::kCsr) {
    const std::int32_t n = pt.indptr[b + 1] - pt.indptr[b];
    return n <= 0 ? 0 : (n - 1) * block_size + pt.last_page_len[b];
  }
  return pt.seq_lens[b];
}

/// Physical block id of the page-th page of sequence b.
__device__ __forceinline__ std::int32_t page_block(const PageTable& pt, std::int32_t b, std::int32_t page) {
  if (pt.format == PageTableFormat::kCsr) return __ldg(pt.indices + pt.indptr[b] + page);
  return __ldg(pt.block_tables + static_cast<std::int64_t>(b) * pt.max_blocks_per_seq + page);
}

/// Stages the K and V rows of tokens [tok0, tok0 + n) of sequence b (n <= kRows) into the shared-memory tiles ks / vs
/// ([kRows][HD] of KV each) with 16-byte cp.async chunks, and commits one group. k_head / v_head: the pool's K / V
/// base already offset to the kv head (bytes). kSwizzle (the tensor-core kernels): chunk c of row r lands at chunk
/// c ^ (r & 7), so that 8 consecutive rows read at one logical chunk hit 8 different bank groups (MMA fragments,
/// ldmatrix), and rows [n, kRows) are zero-filled (an MMA multiplies whole 16-token blocks: probability 0 times a stale
/// NaN would be NaN).
template <class KV, int HD, int kRows, int kThreads, bool kSwizzle>
__device__ __forceinline__ void load_kv_rows(const PageTable& pages, std::int32_t b, std::int32_t block_size,
                                             std::int64_t stride_page, std::int64_t stride_token, const char* k_head,
                                             const char* v_head, std::int32_t tok0, std::int32_t n, KV* ks, KV* vs) {
  constexpr int kChunksPerRow = HD * static_cast<int>(sizeof(KV)) / 16;
  constexpr int kChunkElems = 16 / static_cast<int>(sizeof(KV));
#pragma unroll
  for (int it = 0; it < ceil_div(kRows * kChunksPerRow, kThreads); ++it) {
    const int i = it * kThreads + static_cast<int>(threadIdx.x);
    const int r = i / kChunksPerRow;
    const int c = i % kChunksPerRow;
    const int cs = kSwizzle ? (c ^ (r & 7)) : c;
    if (r < n) {
      const std::int32_t tok = tok0 + r;
      const std::int32_t page = tok / block_size;
      const std::int32_t in_page = tok - page * block_size;
      const std::int64_t blk = page_block(pages, b, page);
      const std::int64_t byte_off = (blk * stride_page + in_page * stride_token) * std::int64_t{sizeof(KV)} + c * 16;
      cp_async16(ks + r * HD + cs * kChunkElems, k_head + byte_off);
      cp_async16(vs + r * HD + cs * kChunkElems, v_head + byte_off);
    } else if (kSwizzle && r < kRows) {
      *reinterpret_cast<uint4*>(ks + r * HD + cs * kChunkElems) = make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(vs + r * HD + cs * kChunkElems) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
  cp_async_commit();
}

// ---- tensor-core fragments (sm_80+ mma.sync; the decode and prefill tensor-core kernels) ----

/// D = A B + D, m16n8k16, A row-major (4 x 32-bit: 2 elements each), B col-major (2 x 32-bit), fp32 accumulators.
template <KernelElement T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (std::same_as<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the tensor-core path needs sm_80+ (CMAKE_CUDA_ARCHITECTURES defaults to 90)
#endif
}

/// Four 8x8 16-bit matrices from shared memory, transposed (ldmatrix .x4 .trans); lane l gives the address of row
/// (l % 8) of matrix (l / 8).
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* smem_row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
#else
  __trap();
#endif
}

/// Two floats as one 32-bit register of two T (the first in the low half), round to nearest.
template <KernelElement T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned u;
  if constexpr (std::same_as<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    __builtin_memcpy(&u, &v, sizeof u);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    __builtin_memcpy(&u, &v, sizeof u);
  }
  return u;
}

// ---- the warp-level attention steps the tensor-core decode and prefill share (one 16-row warp tile; lane = 4 g + t
// holds rows g and g + 8 of every fragment; the FlashAttention-2 online softmax in base 2) ----

/// Rows r0 / r8 (T, head_dim HD, 4-byte aligned) as the A operand of HD / 16 k-steps: qa[kk] = {(r0, 16kk+2t),
/// (r8, 16kk+2t), (r0, 16kk+8+2t), (r8, 16kk+8+2t)}; a row whose has* is false reads nothing and gives zeros.
template <int HD>
__device__ __forceinline__ void load_a_fragments(unsigned (&qa)[HD / 16][4], const unsigned* q0, const unsigned* q8,
                                                 bool has0, bool has8, int t) {
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    qa[kk][0] = has0 ? __ldg(q0 + kk * 8 + t) : 0u;
    qa[kk][1] = has8 ? __ldg(q8 + kk * 8 + t) : 0u;
    qa[kk][2] = has0 ? __ldg(q0 + kk * 8 + 4 + t) : 0u;
    qa[kk][3] = has8 ? __ldg(q8 + kk * 8 + 4 + t) : 0u;
  }
}

/// s = Q K^T for 8 keys (an n-tile) in HD / 16 MMAs. krow: this lane's key row (key g of the n-tile) in a stage
/// swizzled as load_kv_rows<..., true> writes it, whose row index is g mod 8; B fragment (k = dims 2t, 2t+1 [+8]).
template <KernelElement T, int HD>
__device__ __forceinline__ void mma_qk_tile(float (&s)[4], const unsigned (&qa)[HD / 16][4], const T* krow, int g,
                                            int t) {
  s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    const unsigned b0 = *reinterpret_cast<const unsigned*>(krow + (((2 * kk) ^ g) * 8) + 2 * t);
    const unsigned b1 = *reinterpret_cast<const unsigned*>(krow + (((2 * kk + 1) ^ g) * 8) + 2 * t);
    mma_16816<T>(s, qa[kk], b0, b1);
  }
}

/// Max / sum of x over the 4 lanes (t = 0..3) that hold one fragment row.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/// Online-softmax rescale of rows g / g + 8 (FlashAttention-2): mx0 / mx8 are this lane's maxima over the running
/// max and the new masked scores (base 2); they are reduced over the row's 4 lanes, and l (this lane's part of the
/// denominator) and o are scaled by exp2(m - mx), m = mx. kMaybeEmpty: a row may still have seen no visible key
/// (mx = -inf), then alpha = 1 (never exp2(-inf - -inf)); without it every row must have a finite max.
template <int HD, bool kMaybeEmpty>
__device__ __forceinline__ void online_rescale(float (&o)[HD / 8][4], float& m0, float& m8, float& l0, float& l8,
                                               float mx0, float mx8) {
  mx0 = quad_max(mx0);
  mx8 = quad_max(mx8);
  const float alpha0 = kMaybeEmpty && mx0 == -INFINITY ? 1.f : exp2f(m0 - mx0);
  const float alpha8 = kMaybeEmpty && mx8 == -INFINITY ? 1.f : exp2f(m8 - mx8);
  m0 = mx0;
  m8 = mx8;
  l0 *= alpha0;
  l8 *= alpha8;
#pragma unroll
  for (int nd = 0; nd < HD / 8; ++nd) {
    o[nd][0] *= alpha0;
    o[nd][1] *= alpha0;
    o[nd][2] *= alpha8;
    o[nd][3] *= alpha8;
  }
}

/// P = exp2(s - m) of one 16-key block (the n-tiles s0, s1: keys 0-7 / 8-15), added to l0 / l8 and returned as the A
/// operand of the P V MMA (k = the 16 keys; the S fragments' layout, rounded to T as FlashAttention-2).
/// kMaybeEmpty: a row with m = -inf (no visible key yet) gets p = 0.
template <KernelElement T, bool kMaybeEmpty>
__device__ __forceinline__ void softmax_p_fragments(unsigned (&pa)[4], const float (&s0)[4], const float (&s1)[4],
                                                    float m0, float m8, float& l0, float& l8) {
  float p[2][4];
#pragma unroll
  for (int jj = 0; jj < 2; ++jj) {
    const float(&s)[4] = jj == 0 ? s0 : s1;
    p[jj][0] = kMaybeEmpty && m0 == -INFINITY ? 0.f : exp2f(s[0] - m0);
    p[jj][1] = kMaybeEmpty && m0 == -INFINITY ? 0.f : exp2f(s[1] - m0);
    p[jj][2] = kMaybeEmpty && m8 == -INFINITY ? 0.f : exp2f(s[2] - m8);
    p[jj][3] = kMaybeEmpty && m8 == -INFINITY ? 0.f : exp2f(s[3] - m8);
    l0 += p[jj][0] + p[jj][1];
    l8 += p[jj][2] + p[jj][3];
  }
  pa[0] = pack2<T>(p[0][0], p[0][1]);
  pa[1] = pack2<T>(p[0][2], p[0][3]);
  pa[2] = pack2<T>(p[1][0], p[1][1]);
  pa[3] = pack2<T>(p[1][2], p[1][3]);
}

/// o += P V for one 16-key block in HD / 8 MMAs: V fragments for dims [16 dn, 16 dn + 16) from one ldmatrix .x4
/// .trans (matrices: keys 0-7 / 8-15 of the block x dims 0-7 / 8-15 of the pair). vrow: this lane's V row, key
/// (lane % 8) + 8 ((lane / 8) & 1) of the block, in a swizzled stage whose row index is lane % 8 mod 8.
template <KernelElement T, int HD>
__device__ __forceinline__ void mma_pv_block(float (&o)[HD / 8][4], const unsigned (&pa)[4], const T* vrow, int lane) {
#pragma unroll
  for (int dn = 0; dn < HD / 16; ++dn) {
    unsigned vb[4];
    ldmatrix_x4_trans(vb, vrow + (((2 * dn + lane / 16) ^ (lane % 8)) * 8));
    mma_16816<T>(o[2 * dn], pa, vb[0], vb[1]);
    mma_16816<T>(o[2 * dn + 1], pa, vb[2], vb[3]);
  }
}

/// First key position visible to the query at position `pos` under a local-attention window (AttentionWindow in
/// kernel_params.hpp, device copy of AttentionWindow::first_visible): max(0, pos - window + 1 when window > 0,
/// floor(pos / chunk) * chunk when chunk > 0). window = sliding_window_tokens, chunk = attention_chunk_tokens; 0 = off.
__host__ __device__ constexpr std::int32_t first_visible_token(std::int32_t pos, std::int32_t window,
                                                               std::int32_t chunk) {
  std::int32_t lo = 0;
  if (window > 0 && pos - window + 1 > lo) lo = pos - window + 1;
  if (chunk > 0 && pos - pos % chunk > lo) lo = pos - pos % chunk;
  return lo;
}

/// The split-KV chunk (tokens) used for a sequence of kv_len tokens. With a requested chunk > 0 it is that chunk,
/// unless the workspace's max_num_chunks would not cover kv_len, in which case it grows to
/// ceil(kv_len / max_num_chunks) so no token is ever dropped. With 0 ("implementation's choice") it is
/// ceil(kv_len / max_num_chunks) rounded up to a multiple of 16. Chunk c covers [c * chunk, min((c + 1) * chunk,
/// kv_len)). Shared by the split kernel and the merge kernel, so both agree.
__host__ __device__ constexpr std::int32_t effective_chunk(std::int32_t kv_len, std::int32_t requested,
                                                           std::int32_t max_num_chunks) {
  const auto min_chunk = static_cast<std::int32_t>(ceil_div(kv_len, max_num_chunks < 1 ? 1 : max_num_chunks));
  std::int32_t c = requested > 0 ? requested : static_cast<std::int32_t>(ceil_div(min_chunk, 16) * 16);
  if (c < min_chunk) c = min_chunk;
  return c < 1 ? 1 : c;
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
