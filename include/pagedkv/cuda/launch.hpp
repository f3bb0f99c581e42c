// pagedkv/cuda/launch.hpp: host entry points of the pagedkv::cuda kernels (link pagedkv::cuda).
//
// Plain C++: including this header needs no CUDA header. A stream is passed as `CUstream_st*`, which is exactly
// what `cudaStream_t` is (nullptr = the legacy default stream).
//
// Every launcher follows "validate -> launch -> check" (CUTLASS/CUB): it validates shapes, pointers and alignment
// on the host and returns Status::kInvalidValue before anything runs; it dispatches (dtype, head_dim) in one place
// and returns Status::kUnsupported outside {fp32, fp16, bf16} x {64, 128, 256}. Both KV storage dtypes are compiled:
// kSame and kFp8E4M3 (write_kv quantizes with the reference's exact rounding, decode / prefill dequantize on load,
// copy_blocks / swap_blocks move the bytes; per-tensor k_scale / v_scale); it launches
// through cudaLaunchKernelEx and returns Status::kCudaError when *that launch* fails (its own return value: an
// earlier, unrelated error left in the thread's last-error slot is neither reported nor consumed; see
// docs/kernels.md). Launchers never synchronize the host, never allocate and never throw, so a sequence of them can
// be captured into a CUDA graph and replayed (swap_blocks: see its note). On any failure a launcher records which
// check failed (field, bad value, rule; or the CUDA call and its error) in the calling thread's StatusDetail,
// read with pagedkv::last_status_detail() (kernel_params.hpp); a success records nothing. The pool, head, scale,
// window and workspace rules are the CPU reference's own functions, so both refuse the same inputs with the same
// message. Thread safety: launchers keep no state beyond that thread-local detail and prefill's once-per-device
// shared-memory attribute (an atomic); concurrent calls on different streams are safe. Values that live in device memory (page tables, slot mappings,
// copy lists, decode work lists) cannot be checked on the host: out-of-range entries there are preconditions, and
// the kernels skip what they can detect (documented per op).
//
// Status: no launcher has run on a GPU yet (docs/kernels.md, "Status"); they are verified through the CPU
// reference, which executes the same decode work lists, and compiled for sm_90.
#pragma once

#include <cstddef>
#include <cstdint>

#include <pagedkv/decode_plan.hpp>
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
/// slower). An fp8 pool (KVDType::kFp8E4M3) stores float_to_e4m3(x / k_scale) (V: v_scale): one IEEE float division
/// then round-to-nearest-even with saturation to +-448 and NaN kept, bit-identical to reference::write_kv. Returns kInvalidValue for null pointers or non-positive shapes, kUnsupported outside the compiled set,
/// kCudaError if the launch fails. num_tokens == 0 launches nothing.
[[nodiscard]] PAGEDKV_CUDA_API Status write_kv(const WriteKVParams& p, Stream stream = nullptr) noexcept;

/// Row slots of the decode CTA for (dtype, head_dim): the most query heads one decode work item can hold (16 for
/// fp16/bf16 x 64, 8 otherwise; mirrors DecodeTraits<T, HD>::kSlots, checked by a static_assert in cuda/decode.cu).
/// 0 outside the compiled set. Pure function.
[[nodiscard]] constexpr std::int32_t decode_row_slots(DType dtype, std::int32_t head_dim) noexcept {
  if (!is_supported(dtype, head_dim)) return 0;
  return (dtype != DType::kFloat32 && head_dim == 64) ? 16 : 8;
}

/// Query heads per work item the CUDA decode kernel uses for a GQA group of `group_size` heads: the group cut into
/// the fewest tiles of at most decode_row_slots heads, balanced (ceil(group / ceil(group / slots))); e.g. group 4
/// -> 4 (one tile), group 12 at 8 slots -> 6 (two tiles). Put it in DecodePlanConfig::heads_per_tile. 0 for an
/// unsupported (dtype, head_dim) or group_size < 1. Pure function.
[[nodiscard]] constexpr std::int32_t decode_heads_per_tile(DType dtype, std::int32_t head_dim,
                                                           std::int32_t group_size) noexcept {
  const std::int32_t slots = decode_row_slots(dtype, head_dim);
  if (slots == 0 || group_size < 1) return 0;
  const std::int32_t tiles = (group_size + slots - 1) / slots;
  return (group_size + tiles - 1) / tiles;
}

/// Fills the device-dependent fields of a decode plan configuration (pagedkv/decode_plan.hpp) for the decode
/// kernel of (dtype, head_dim): num_qo_heads, num_kv_heads, head_dim, heads_per_tile (decode_heads_per_tile),
/// num_sms (cudaDevAttrMultiProcessorCount of `device`) and ctas_per_sm (cudaOccupancyMaxActiveBlocksPerMultiprocessor
/// of that kernel at its block size, at least 1). The cost knobs (min_chunk_tokens, item_overhead_tokens,
/// max_waves) and the window (set it per KV-cache group: DecodePlanConfig::window) are left as they are. Call once per shape, before planning or capturing (not a stream operation; no
/// synchronization). `device` must be the calling thread's current device (the occupancy API reads the current
/// one). Returns kNoDevice (no CUDA device), kInvalidValue (null cfg, bad heads, device not current or out of
/// range), kUnsupported (dtype, head_dim outside the compiled set), kCudaError (a CUDA query failed); *cfg is
/// written only on kSuccess. Thread safety: writes *cfg only.
[[nodiscard]] PAGEDKV_CUDA_API Status decode_plan_config(int device, DType dtype, std::int32_t head_dim,
                                                         std::int32_t num_qo_heads, std::int32_t num_kv_heads,
                                                         DecodePlanConfig* cfg) noexcept;

/// Multiprocessor count of CUDA device `device` into *sm_count (cudaDeviceGetAttribute; no synchronization).
/// Returns kNoDevice when no device is present, kInvalidValue for a null out pointer or a device index out of
/// range, kCudaError otherwise.
[[nodiscard]] PAGEDKV_CUDA_API Status device_sm_count(int device, std::int32_t* sm_count) noexcept;

/// Decode attention over paged KV executing a work list (PagedAttention, Kwon et al. SOSP'23; FlashInfer batch
/// decode with its plan/run split; Flash-Decoding split-KV). The preferred entry point: plan with plan_decode
/// (pagedkv/decode_plan.hpp) on the host, copy the item and merge buffers to the device, launch.
/// - p.q: device `[batch, num_qo_heads, head_dim]` contiguous, dtype p.kv.dtype; p.o: device, same shape;
///   p.lse: device float32 `[batch, num_qo_heads]` or null (natural log of the softmax denominator of
///   sm_scale * q.k). p.kv: device pool; p.pages: device CSR or padded page table (int32), batch = its batch_size.
///   p.kv_chunk_size_tokens / p.max_num_chunks are ignored.
/// - wl: items `[item_capacity]` and merges `[merge_capacity]` in *device* memory, 16-byte aligned, as plan_decode
///   wrote them (DecodePlanInfo::work_list relocated to the device copies); heads_per_tile in [1, min(group,
///   decode_row_slots)] (plan with decode_heads_per_tile, or fewer heads per item); p.workspace: device, 16-byte
///   aligned, >= decode_plan_workspace_bytes(wl.partial_row_capacity, num_qo_heads, head_dim) when
///   partial_row_capacity > 0 (float32 partial o then partial lse, rows as the items name them).
/// - Launches item_capacity attention CTAs (one per item; padding items, valid == 0, exit at once) and, when
///   merge_capacity > 0 and partial_row_capacity > 0, ceil(merge_capacity * num_qo_heads / 4) merge CTAs of 4
///   warps, on `stream`, in that order. The launch shape depends only on the capacities, so a captured graph
///   replays any later plan written to the same device buffers.
/// - Item i computes the query heads of tile head_tile of kv head kv_head (GQA: query head h reads kv head h /
///   (num_qo_heads / num_kv_heads); each K/V byte of the range is read once per tile) over its token range clamped
///   to the visible keys [p.window.first_visible(kv_len_b - 1), kv_len_b) (plan with the same DecodePlanConfig::window
///   and no item lies outside them; pages wholly before the window are never read, so they may be the null block 0;
///   an item with nothing visible writes the masked partial o = 0, lse = -inf, which the merge weighs 0), and
///   writes o / lse (partial_row == -1; an empty sequence gets o = 0, lse = -inf) or its normalized partial (o, lse)
///   to workspace row partial_row; merge entry m combines its rows by log-sum-exp into o / lse.
/// Preconditions checked (kInvalidValue): as decode(p) for q, o, kv, pages, heads, sm_scale, window; capacities >= 0;
/// non-null, 16-byte aligned items / merges when their capacity > 0; heads_per_tile in range; workspace as above.
/// Preconditions not checked (device data): the list is a correct plan for this batch's lengths (what
/// validate_decode_work_list checks on the host; the CPU reference checks it on every call). The kernel skips items
/// and merges naming a request, kv head or head tile out of range, and clamps each range to the sequence length
/// the page table gives, so it never reads past a sequence; a list that does not cover every (request, head,
/// token) exactly once gives wrong o, never an out-of-bounds access (items and merges naming workspace rows at or
/// past partial_row_capacity are skipped too).
/// Unsupported (kUnsupported): dtype / head_dim outside the compiled set. kCudaError: a launch failed.
/// fp8 pools (KVDType::kFp8E4M3): K/V bytes are e4m3 codes, dequantized exactly in registers; k_scale is folded
/// into the prescaled q and v_scale multiplies each output (or partial) row once, so the result equals the reference's
/// to float32 rounding (not bit for bit: the reference multiplies each element by its scale).
[[nodiscard]] PAGEDKV_CUDA_API Status decode(const DecodeParams& p, const DecodeWorkList& wl,
                                            Stream stream = nullptr) noexcept;

/// Decode attention over paged KV with the uniform chunk rule of DecodeParams (no work list; the pre-plan entry
/// point, kept for callers that split by a fixed chunk).
/// - p.q, p.o, p.lse, p.kv, p.pages: as decode(p, wl). A sequence with no tokens gets o = 0 and lse = -inf.
/// - p.window: the query at kv_len_b - 1 sees [p.window.first_visible(kv_len_b - 1), kv_len_b) (AttentionWindow);
///   the chunks below stay where they are and are clamped to that range: a chunk wholly before it is masked (reads
///   nothing, writes o = 0, lse = -inf, weight 0 in the merge). Pages before the window are never read.
/// - GQA: query head h reads kv head h / (num_qo_heads / num_kv_heads); all query heads of one kv head are computed
///   by one CTA, so each K/V byte is read once (group sizes above 8, or above 16 at fp16/bf16 x 64, take
///   ceil(group / 8) passes).
/// - Split-KV: used when p.max_num_chunks >= 2. Chunk c of sequence b covers tokens [c * chunk, min((c + 1) *
///   chunk, kv_len_b)) with chunk = p.kv_chunk_size_tokens, or, if that is 0, ceil(kv_len_b / max_num_chunks)
///   rounded up to 16; if a sequence would need more than max_num_chunks chunks, its chunk grows to
///   ceil(kv_len_b / max_num_chunks) (never a dropped token). Partials (float32) go to p.workspace (device, >=
///   decode_workspace_bytes(batch, max_num_chunks, num_qo_heads, head_dim), 16-byte aligned) and a second kernel
///   merges them by log-sum-exp. The grid is (batch, kv heads x head tiles, max_num_chunks): the split does not
///   look at the actual lengths; decode(p, wl) with plan_decode does.
/// Preconditions checked (kInvalidValue): non-null q, o, kv.k, kv.v and page-table pointers of the chosen format;
/// the pool rules of the CPU reference (block_size in [1, kMaxBlockSize], strides, K/V apart, ...); sm_scale finite
/// and > 0; positive num_kv_heads, num_blocks, num_qo_heads with num_qo_heads % num_kv_heads == 0; q, o, k, v
/// and workspace 16-byte aligned and kv strides multiples of 16 bytes; kv_chunk_size_tokens >= 0; max_num_chunks
/// in [0, 65535] (and >= 1 when kv_chunk_size_tokens > 0); workspace large enough when splitting; window limits >= 0.
/// Preconditions not checked (device data): page ids in [0, num_blocks), last_page_len in [1, block_size],
/// seq_lens[b] <= max_blocks_per_seq * block_size. Only tokens < kv_len_b are ever read, so unused slots of a page
/// may hold anything (NaN included).
[[nodiscard]] PAGEDKV_CUDA_API Status decode(const DecodeParams& p, Stream stream = nullptr) noexcept;

/// Causal prefill attention over paged KV with ragged queries (FlashInfer batch prefill with paged KV).
/// - p.q: device `[total_q_tokens, num_qo_heads, head_dim]` contiguous; p.o: same; p.lse: device float32
///   `[total_q_tokens, num_qo_heads]` or null. p.qo_indptr: device int32 `[batch + 1]`, qo_indptr[0] == 0 and
///   qo_indptr[batch] == p.total_q_tokens (both preconditions on device data).
/// - Query i of sequence b sits at position kv_len_b - q_len_b + i and attends to KV positions <= its own and, with
///   p.window (sliding window / chunked-local, AttentionWindow), >= p.window.first_visible(its position).
///   Precondition q_len_b <= kv_len_b; a query row with no visible key gets o = 0, lse = -inf. A CTA loads KV from its
///   first query's first visible key on: pages wholly before p.window.first_needed_token(kv_len_b, q_len_b) are
///   never read (they may be the null block 0).
/// - One CTA per (32-query tile of a sequence, qo head), KV in 32-token tiles through shared memory, fp32
///   CUDA-core math and online softmax (correctness first; no tensor cores yet).
/// Checks as decode() (kInvalidValue / kUnsupported / kCudaError; a negative p.window limit is kInvalidValue; sm_scale
/// finite and > 0); qo_indptr must be non-null when total_q_tokens > 0; total_q_tokens must be 0 when batch is 0.
/// total_q_tokens == 0 or batch == 0 launches nothing. Device-data preconditions the launcher cannot check:
/// qo_indptr[0] == 0, non-decreasing, qo_indptr[batch] == total_q_tokens, q_len_b <= kv_len_b. Broken, they give
/// wrong rows, never an out-of-bounds access: no CTA touches a q / o row outside [0, total_q_tokens), and the leading
/// queries of a sequence with q_len_b > kv_len_b see no key (o = 0, lse = -inf). The CPU reference checks all four.
/// The kernel's dynamic shared memory attribute is set on the first launch per (dtype, head_dim, device) only.
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
///   host side in page-locked host memory (cudaHostAlloc / cudaHostRegister). Both sides share dtype, block_size,
///   num_kv_heads and head_dim; strides may differ.
/// - p.block_mapping: host int32 `[num_pairs, 2]` (src block, dst block); pairs with src < 0 are skipped; ids are
///   checked against num_blocks on the host (kInvalidValue before any copy is queued).
/// - Memory spaces are checked with cudaPointerGetAttributes on every layer's k and v base pointers before any copy
///   is queued: a host side that is not page-locked (cudaMemoryTypeUnregistered: pageable memory, where
///   cudaMemcpyAsync would silently become a synchronous copy, which also breaks stream capture) or a device side
///   that is not device (or managed) memory gives Status::kWrongMemorySpace. Only the base pointers are checked: a
///   pool partly registered with cudaHostRegister is a precondition. No device: kNoDevice.
/// Implementation: batched cudaMemcpyAsync (the copy engines, no SM time). When a block's K (or K and V together)
/// is one dense byte range on both sides, one copy per (layer, pair) or per run of consecutive blocks; otherwise
/// one 2D copy per (layer, pair, K/V, token). Asynchronous with respect to the host. Graph capture: the mapping is
/// read on the host at call time, so a captured swap replays the same pairs; whether cudaPointerGetAttributes is
/// accepted during a global-mode capture is unverified (no GPU yet): check the pools before capturing if needed.
[[nodiscard]] PAGEDKV_CUDA_API Status swap_blocks(const SwapBlocksParams& p, Stream stream = nullptr) noexcept;

}  // namespace pagedkv::cuda
