// pagedkv/cuda/launch.hpp: host entry points of the pagedkv::cuda kernels (link pagedkv::cuda).
//
// Plain C++: including this header needs no CUDA header. A stream is passed as `CUstream_st*`, which is exactly
// what `cudaStream_t` is (nullptr = the legacy default stream).
//
// Every launcher follows "validate -> launch -> check" (CUTLASS/CUB): it validates shapes, pointers and alignment
// on the host and returns Status::kInvalidValue before anything runs; it dispatches (dtype, head_dim) in one place
// and returns Status::kUnsupported outside {fp32, fp16, bf16} x {64, 128, 256}, and for any pool whose
// KVPoolView::kv_dtype is not KVDType::kSame (fp8 KV on CUDA: not yet implemented; CPU reference only); it checks the launch with
// cudaPeekAtLastError (-> Status::kCudaError, the error stays for cudaGetLastError). Launchers never synchronize
// the host, never allocate and never throw, so a sequence of them can be captured into a CUDA graph and replayed
// (swap_blocks: see its note). Thread safety: launchers keep no state; concurrent calls on different streams are
// safe. Values that live in device memory (page tables, slot mappings, copy lists) cannot be checked on the host:
// out-of-range entries there are preconditions, and the kernels skip what they can detect (documented per op).
#pragma once

#include <cstddef>
#include <cstdint>

#include <pagedkv/kernel_params.hpp>

struct CUstream_st;  // cudaStream_t is CUstream_st*

#if defined(_WIN32)
#define PAGEDKV_CUDA_API
#else
/// Marks the launchers exported from libpagedkv_cuda (built with hidden visibility).
#define PAGEDKV_CUDA_API __attribute__((visibility("default")))
#endif

namespace pagedkv::cuda {

/// A CUDA stream handle; identical to cudaStream_t. nullptr is the legacy default stream.
using Stream = CUstream_st*;

/// The element types the kernels are compiled for.
inline constexpr DType kSupportedDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
/// The head dims the kernels are compiled for.
inline constexpr std::int32_t kSupportedHeadDims[] = {64, 128, 256};

/// True when (dtype, head_dim) is in the compiled set {fp32, fp16, bf16} x {64, 128, 256}; every launcher returns
/// Status::kUnsupported otherwise. Pure function.
[[nodiscard]] constexpr bool is_supported(DType dtype, std::int32_t head_dim) noexcept {
  bool dt_ok = false;
  for (DType d : kSupportedDTypes) dt_ok = dt_ok || d == dtype;
  bool hd_ok = false;
  for (std::int32_t h : kSupportedHeadDims) hd_ok = hd_ok || h == head_dim;
  return dt_ok && hd_ok;
}

/// Writes new K/V rows into their pages by slot mapping (vLLM `reshape_and_cache`).
/// - p.key, p.value: device, `[num_tokens, num_kv_heads, head_dim]`, row stride p.stride_token_elems (0 = dense),
///   dtype p.kv.dtype. p.slot_mapping: device int64 `[num_tokens]`, slot = block * block_size + offset; a slot < 0
///   is skipped, and so is a slot >= num_blocks * block_size (precondition violation, detected on the device).
/// - p.kv: the destination pool (device), any strides (NHD / HND / separate K and V).
/// Accesses are 16 bytes wide when every pointer and stride allows it, narrower otherwise (never wrong, only
/// slower). Returns kInvalidValue for null pointers or non-positive shapes, kUnsupported outside the compiled set,
/// kCudaError if the launch fails. num_tokens == 0 launches nothing.
[[nodiscard]] PAGEDKV_CUDA_API Status write_kv(const WriteKVParams& p, Stream stream = nullptr) noexcept;

/// How decode() should split each sequence's KV (Flash-Decoding, Dao et al. 2023), chosen by decode_plan().
struct DecodePlan {
  std::int32_t kv_chunk_size_tokens = 0;  ///< Goes into DecodeParams::kv_chunk_size_tokens (0 with no split).
  std::int32_t max_num_chunks = 0;        ///< Goes into DecodeParams::max_num_chunks (0 = no split).
  std::size_t workspace_bytes = 0;        ///< Device scratch decode() needs; 0 with no split.
  std::int64_t num_ctas = 0;              ///< CTAs of the attention kernel at max_kv_len (for information).
};

/// Plans split-KV for a decode batch (the host "plan" step of FlashInfer's plan/run; call once per shape, e.g.
/// before capturing a graph). Splits only when the batch alone would not fill the GPU: it targets about two CTAs
/// per SM, so batch 1 x 32k tokens x 8 kv heads on 132 SMs gets 32 chunks of 1024 tokens, while batch 64 x 8 kv
/// heads is not split. The chunk is a multiple of 256 tokens and at least 256.
/// - batch_size: sequences; max_kv_len_tokens: the longest sequence this plan must serve (tokens, >= 0);
///   num_qo_heads, num_kv_heads, head_dim, dtype as in DecodeParams; sm_count: multiprocessors of the device
///   (see device_sm_count). Pure host function, no CUDA call. Invalid or unsupported shapes give a no-split plan.
[[nodiscard]] PAGEDKV_CUDA_API DecodePlan decode_plan(std::int32_t batch_size, std::int32_t max_kv_len_tokens,
                                                      std::int32_t num_qo_heads, std::int32_t num_kv_heads,
                                                      std::int32_t head_dim, DType dtype,
                                                      std::int32_t sm_count) noexcept;

/// Multiprocessor count of CUDA device `device` into *sm_count (cudaDeviceGetAttribute; no synchronization).
/// Returns kNoDevice when no device is present, kInvalidValue for a null out pointer, kCudaError otherwise.
[[nodiscard]] PAGEDKV_CUDA_API Status device_sm_count(int device, std::int32_t* sm_count) noexcept;

/// Decode attention over paged KV: one query token per sequence (PagedAttention, Kwon et al. SOSP'23; FlashInfer
/// batch decode; Flash-Decoding split-KV).
/// - p.q: device `[batch, num_qo_heads, head_dim]` contiguous, dtype p.kv.dtype; p.o: device, same shape;
///   p.lse: device float32 `[batch, num_qo_heads]` or null (natural log of the softmax denominator of
///   sm_scale * q.k). A sequence with no tokens gets o = 0 and lse = -inf.
/// - p.kv: device pool; p.pages: device CSR or padded page table (int32).
/// - GQA: query head h reads kv head h / (num_qo_heads / num_kv_heads); all query heads of one kv head are computed
///   by one CTA, so each K/V byte is read once (group sizes above 8, or above 16 at fp16/bf16 x 64, take
///   ceil(group / 8) passes).
/// - Split-KV: used when p.max_num_chunks >= 2. Chunk c of sequence b covers tokens [c * chunk, min((c + 1) *
///   chunk, kv_len_b)) with chunk = p.kv_chunk_size_tokens, or, if that is 0, ceil(kv_len_b / max_num_chunks)
///   rounded up to 16; if a sequence would need more than max_num_chunks chunks, its chunk grows to
///   ceil(kv_len_b / max_num_chunks) (never a dropped token). Partials (float32) go to p.workspace (device, >=
///   decode_workspace_bytes(batch, max_num_chunks, num_qo_heads, head_dim), 16-byte aligned) and a second kernel
///   merges them by log-sum-exp. Use decode_plan() to choose.
/// Preconditions checked (kInvalidValue): non-null q, o, kv.k, kv.v and page-table pointers of the chosen format;
/// positive block_size, num_kv_heads, num_blocks, num_qo_heads with num_qo_heads % num_kv_heads == 0; q, o, k, v
/// and workspace 16-byte aligned and kv strides multiples of 16 bytes; kv_chunk_size_tokens >= 0; max_num_chunks
/// in [0, 65535] (and >= 1 when kv_chunk_size_tokens > 0); workspace large enough when splitting.
/// Preconditions not checked (device data): page ids in [0, num_blocks), last_page_len in [1, block_size],
/// seq_lens[b] <= max_blocks_per_seq * block_size. Only tokens < kv_len_b are ever read, so unused slots of a page
/// may hold anything (NaN included).
[[nodiscard]] PAGEDKV_CUDA_API Status decode(const DecodeParams& p, Stream stream = nullptr) noexcept;

/// Causal prefill attention over paged KV with ragged queries (FlashInfer batch prefill with paged KV).
/// - p.q: device `[total_q_tokens, num_qo_heads, head_dim]` contiguous; p.o: same; p.lse: device float32
///   `[total_q_tokens, num_qo_heads]` or null. p.qo_indptr: device int32 `[batch + 1]`, qo_indptr[0] == 0 and
///   qo_indptr[batch] == p.total_q_tokens (both preconditions on device data).
/// - Query i of sequence b sits at position kv_len_b - q_len_b + i and attends to KV positions <= its own.
///   Precondition q_len_b <= kv_len_b; a query row with no visible key gets o = 0, lse = -inf.
/// - One CTA per (32-query tile of a sequence, qo head), KV in 32-token tiles through shared memory, fp32
///   CUDA-core math and online softmax (correctness first; no tensor cores yet).
/// Checks as decode() (kInvalidValue / kUnsupported / kCudaError); qo_indptr must be non-null when
/// total_q_tokens > 0. total_q_tokens == 0 or batch == 0 launches nothing.
[[nodiscard]] PAGEDKV_CUDA_API Status prefill(const PrefillParams& p, Stream stream = nullptr) noexcept;

/// Copies whole blocks (K and V, every layer) for copy-on-write (vLLM `copy_blocks`).
/// - p.layers: host array of p.num_layers device pool views sharing dtype, shape and strides (kInvalidValue
///   otherwise); p.block_mapping: device int32 `[capacity, 2]` (src, dst), read by the kernel (graph safe); pairs
///   with src < 0 are skipped, and so are pairs with a block id >= num_blocks or dst < 0 (device-side check).
/// - One launch per 64 layers (all layers in one launch for models up to 64 layers); 16-byte accesses when
///   pointers and strides allow. Precondition: no dst twice, no dst that is also a src.
[[nodiscard]] PAGEDKV_CUDA_API Status copy_blocks(const CopyBlocksParams& p, Stream stream = nullptr) noexcept;

/// Moves blocks between a device pool and a pinned-host pool of the same shape (vLLM V0 swap_blocks).
/// - p.src_layers / p.dst_layers: host arrays of p.num_layers pool views; the device side in device memory, the
///   host side in page-locked host memory (cudaHostAlloc / cudaHostRegister; pageable memory makes the copies
///   synchronous). Both sides share dtype, block_size, num_kv_heads and head_dim; strides may differ.
/// - p.block_mapping: host int32 `[num_pairs, 2]` (src block, dst block); pairs with src < 0 are skipped; ids are
///   checked against num_blocks on the host (kInvalidValue before any copy is queued).
/// Implementation: batched cudaMemcpyAsync (the copy engines, no SM time). When a block's K (or K and V together)
/// is one dense byte range on both sides, one copy per (layer, pair) or per run of consecutive blocks; otherwise
/// one 2D copy per (layer, pair, K/V, token). Asynchronous with respect to the host; graph capturable when the
/// host side is pinned.
[[nodiscard]] PAGEDKV_CUDA_API Status swap_blocks(const SwapBlocksParams& p, Stream stream = nullptr) noexcept;

}  // namespace pagedkv::cuda
