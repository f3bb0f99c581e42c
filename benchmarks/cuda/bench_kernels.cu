// benchmarks/cuda/bench_kernels.cu: kernel timings of pagedkv::cuda against the device's bandwidth, measured and spec.
//
// Standalone (CUDA events; no Google Benchmark, which the GPU machine does not have). In one run:
//  1. device-to-device copy bandwidth: cudaMemcpyAsync of a 1 GiB buffer, bytes read + bytes written;
//  2. the spec bandwidth from the device attributes: 2 * memory clock * bus width / 8 (DDR), or --spec-gbps;
//  3. every row: `--reps` repetitions of N back-to-back launches between one pair of events (N chosen so one
//     repetition lasts >= 2 ms, at least 1), median over repetitions of time / N; or, for "graph" rows, one CUDA
//     graph holding N launches per event pair. Achieved bandwidth = bytes that must move (K/V of every token once per
//     kv head + q + o for decode; read + write for the copy kernels) / time, reported as a fraction of the measured
//     copy bandwidth and of the spec bandwidth.
// Decode rows use the length-aware plan (plan_decode with decode_plan_config), computed once on the host per row;
// "unsplit" rows use a plan with max_waves = 0 (one item per lane), "chunk rule" rows the pre-plan entry point.
// "window" / "chunk" rows decode with a sliding window / chunked-local attention (AttentionWindow): the pages before
// each sequence's window are the null block 0 (no pool memory) and the bytes counted are the visible tokens'.
// Pools are larger than L2, block ids shuffled, data random. Rows that do not fit in 85% of free memory are
// reported as skipped. Prints a table; writes JSON with --json PATH.
//
// fp8 rows decode an fp8 e4m3 pool (KVPoolView kv_dtype kFp8E4M3, scales 1): while the CUDA launchers return
// kUnsupported for it, the row is recorded as "unsupported", never as a number. The prefill row (batch 8, 2048
// cached + 512 new tokens, causal, bf16, qo 32 / kv 8, d128) reports TFLOP/s (4 * head_dim flops per visible
// (query, key) pair and query head) besides bytes. Inputs are random from --seed (fresh per run; the seed is in
// the JSON). Setup (fills, uploads) is finished (cudaDeviceSynchronize) before any timed launch on the benchmark's
// non-blocking stream. The JSON has every repetition of every row, not only the median.
//
// Usage: bench_kernels [--json PATH] [--reps N] [--spec-gbps X] [--quick] [--seed N] [--only SUBSTRING]
//   --only: only the rows whose name contains SUBSTRING (the copy bandwidth is always measured).
//   --quick: the rows the GPU issue asks for (decode grid b 1/64/256 x 4k/32k x heads 32/32, 32/8, 64/8; ragged vs
//   uniform; block sizes 8-64; fp8 vs bf16 at 4k and 32k; prefill; write_kv; copy_blocks; the copy bandwidth),
//   5 repetitions; without it also the unsplit / chunk-rule / graph / window rows and the 256-sequence ragged batch.
// Every decode row checks three sampled output rows (first / middle / last sequence and qo head) of its last timed
// launch against float64 (pagedkv/reference/attention_check.hpp) before its time is reported: a row that fails is
// recorded as "wrong_output" with the failed check, never as a number, and the run exits 1.
// Exit: 0 ran, 1 a sampled output was wrong, 2 a CUDA or pagedkv error, 77 no CUDA device.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <pagedkv/cuda/launch.hpp>
#include <pagedkv/decode_plan.hpp>
#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/attention_check.hpp>
#include <pagedkv/reference/dtype.hpp>

namespace {

using pagedkv::DType;
using pagedkv::Status;

#define BENCH_CUDA(expr)                                                                                         \
  do {                                                                                                           \
    const cudaError_t e_ = (expr);                                                                               \
    if (e_ != cudaSuccess) {                                                                                     \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                                              \
    }                                                                                                            \
  } while (0)

#define BENCH_OK(expr)                                                                                            \
  do {                                                                                                            \
    const Status s_ = (expr);                                                                                     \
    if (s_ != Status::kSuccess) {                                                                                 \
      std::fprintf(stderr, "pagedkv error %s at %s:%d: %s\n", pagedkv::to_string(s_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                                               \
    }                                                                                                             \
  } while (0)

/// Random fp8 e4m3 bytes with the exponent's top bit clear (|x| < 2, never NaN: e4m3fn NaN is S.1111.111).
__global__ void fill_random_fp8(unsigned char* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = static_cast<unsigned char>(x & 0xb7u);
  }
}

__global__ void fill_random_bf16(__nv_bfloat16* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n;
       i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16(static_cast<float>(x & 0xffff) / 32768.f - 1.f);
  }
}

struct Buf {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit Buf(std::size_t n) : bytes(n) { BENCH_CUDA(cudaMalloc(&p, std::max<std::size_t>(n, 16))); }
  ~Buf() { (void)cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  template <class T>
  T* as() const {
    return static_cast<T*>(p);
  }
  template <class T>
  static Buf* of(const std::vector<T>& v) {
    auto* b = new Buf(v.size() * sizeof(T));
    if (!v.empty()) BENCH_CUDA(cudaMemcpy(b->p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return b;
  }
};

int g_reps = 7;
cudaStream_t g_stream = nullptr;
std::uint64_t g_seed = 1;

/// A 32-bit seed for one buffer: the run's seed mixed with a per-buffer tag.
std::uint32_t seed_of(std::uint32_t tag) {
  std::uint64_t z = g_seed * 0x9e3779b97f4a7c15ull + tag;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<std::uint32_t>(z ^ (z >> 31));
}

/// Random bf16 values in [-1, 1) (every setup runs on g_stream; time_launches synchronizes the device first).
void fill(void* p, std::size_t elems, std::uint32_t tag) {
  fill_random_bf16<<<1024, 256, 0, g_stream>>>(static_cast<__nv_bfloat16*>(p), elems, seed_of(tag));
  BENCH_CUDA(cudaGetLastError());
}
void fill_fp8(void* p, std::size_t bytes, std::uint32_t tag) {
  fill_random_fp8<<<1024, 256, 0, g_stream>>>(static_cast<unsigned char*>(p), bytes, seed_of(tag));
  BENCH_CUDA(cudaGetLastError());
}

struct Timing {
  double ms = 0;  // median per launch
  int per_event = 1;
  std::vector<double> reps_ms;  // every repetition, per launch
};

/// Median time (ms) per launch of f(stream): `g_reps` repetitions of N launches between one event pair (graph:
/// one graph of N launches), after a warm-up; N chosen so a repetition lasts >= 2 ms.
template <class F>
Timing time_launches(F&& f, bool graph) {
  // Setup may have used the legacy default stream (cudaMemcpy from pageable memory can return before its DMA
  // lands) or g_stream: finish all of it before the first launch on the non-blocking g_stream.
  BENCH_CUDA(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  f(g_stream);
  f(g_stream);
  BENCH_CUDA(cudaStreamSynchronize(g_stream));
  // Estimate one launch.
  BENCH_CUDA(cudaEventRecord(a, g_stream));
  f(g_stream);
  BENCH_CUDA(cudaEventRecord(b, g_stream));
  BENCH_CUDA(cudaEventSynchronize(b));
  float one = 0;
  BENCH_CUDA(cudaEventElapsedTime(&one, a, b));
  const int n = std::clamp(static_cast<int>(std::ceil(2.0 / std::max(one, 1e-3f))), 1, 1000);
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaGraph_t g = nullptr;
    BENCH_CUDA(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n; ++i) f(g_stream);
    BENCH_CUDA(cudaStreamEndCapture(g_stream, &g));
    BENCH_CUDA(cudaGraphInstantiate(&exec, g, 0));
    BENCH_CUDA(cudaGraphDestroy(g));
    BENCH_CUDA(cudaGraphLaunch(exec, g_stream));  // warm-up
  }
  std::vector<double> t;
  for (int r = 0; r < g_reps; ++r) {
    BENCH_CUDA(cudaEventRecord(a, g_stream));
    if (graph) {
      BENCH_CUDA(cudaGraphLaunch(exec, g_stream));
    } else {
      for (int i = 0; i < n; ++i) f(g_stream);
    }
    BENCH_CUDA(cudaEventRecord(b, g_stream));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / n);
  }
  if (exec != nullptr) BENCH_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  std::vector<double> all = t;
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], n, std::move(all)};
}

struct Result {
  std::string name;
  std::string mode;  // stream | graph
  double ms = 0, bytes = 0, gbps = 0, frac_copy = 0, frac_spec = 0;
  double flops = 0;  // > 0: also report TFLOP/s (prefill)
  int per_event = 0;
  std::vector<double> reps_ms;
  std::string plan;         // plan summary (decode rows)
  std::string skipped;      // non-empty: not run, why
  std::string unsupported;  // non-empty: the launcher returned kUnsupported (no number)
  std::string wrong;        // non-empty: a sampled output row failed its float64 check (no number; exit 1)
};

/// Checks sampled rows of a decode output against float64 before the row's time is reported: rows (sequence,
/// qo head) = first, middle and last, each recomputed on the host from the device's q, page table and pool
/// (downloaded page by page: only the row's kv head is used) and held to pagedkv::reference::attention_row_ok
/// (bf16 output, P rounded to bf16: the tensor-core kernels' precision). Returns "" or the first failure.
std::string check_decode_sample(const pagedkv::DecodeParams& p, const std::vector<int>& lens,
                                const std::vector<std::int32_t>& indptr, const std::vector<std::int32_t>& ids,
                                bool fp8) {
  BENCH_CUDA(cudaDeviceSynchronize());
  const int batch = static_cast<int>(lens.size()), hq = p.num_qo_heads, hd = p.kv.head_dim;
  const int group = hq / p.kv.num_kv_heads, bs = p.kv.block_size;
  const std::int64_t page = std::int64_t{bs} * p.kv.num_kv_heads * hd;  // elements of K (or V) of one block
  const std::size_t elem = fp8 ? 1 : 2;
  const auto value = [&](const std::vector<unsigned char>& raw, std::int64_t i) -> double {
    if (fp8) return pagedkv::reference::fp8_e4m3_bits_to_float(raw[static_cast<std::size_t>(i)]);
    std::uint16_t b;
    std::memcpy(&b, raw.data() + i * 2, 2);
    return pagedkv::reference::bf16_bits_to_float(b);
  };
  const std::pair<int, int> rows[] = {{0, 0}, {batch / 2, hq / 2}, {batch - 1, hq - 1}};
  for (const auto& [b, h] : rows) {
    const int len = lens[static_cast<std::size_t>(b)];
    const auto first = static_cast<int>(p.window.first_needed_token(len, 1));
    const int n = len - first;
    std::vector<std::uint16_t> qraw(static_cast<std::size_t>(hd)), oraw(static_cast<std::size_t>(hd));
    const std::size_t row = static_cast<std::size_t>(b) * hq + h;
    BENCH_CUDA(cudaMemcpy(qraw.data(), static_cast<const std::uint16_t*>(p.q) + row * hd, hd * 2, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(oraw.data(), static_cast<const std::uint16_t*>(p.o) + row * hd, hd * 2, cudaMemcpyDeviceToHost));
    float lse = 0;
    BENCH_CUDA(cudaMemcpy(&lse, p.lse + row, 4, cudaMemcpyDeviceToHost));
    std::vector<double> q(static_cast<std::size_t>(hd)), k(static_cast<std::size_t>(n) * hd), v(k.size());
    std::vector<float> o(static_cast<std::size_t>(hd));
    for (int d = 0; d < hd; ++d) {
      q[static_cast<std::size_t>(d)] = pagedkv::reference::bf16_bits_to_float(qraw[static_cast<std::size_t>(d)]);
      o[static_cast<std::size_t>(d)] = pagedkv::reference::bf16_bits_to_float(oraw[static_cast<std::size_t>(d)]);
    }
    std::vector<unsigned char> kv(static_cast<std::size_t>(2 * page) * elem);
    int cur_page = -1;
    for (int t = first; t < len; ++t) {
      if (t / bs != cur_page) {
        cur_page = t / bs;
        const std::int64_t block = ids[static_cast<std::size_t>(indptr[static_cast<std::size_t>(b)] + cur_page)];
        BENCH_CUDA(cudaMemcpy(kv.data(), static_cast<const unsigned char*>(p.kv.k) + block * 2 * page * elem,
                              kv.size(), cudaMemcpyDeviceToHost));
      }
      const std::int64_t off = (std::int64_t{t % bs} * p.kv.num_kv_heads + h / group) * hd;  // NHD, K then V
      for (int d = 0; d < hd; ++d) {
        k[static_cast<std::size_t>(t - first) * hd + d] = value(kv, off + d);
        v[static_cast<std::size_t>(t - first) * hd + d] = value(kv, page + off + d);
      }
    }
    const auto want = pagedkv::reference::attention_oracle_row(q.data(), k.data(), v.data(), n, hd, p.sm_scale);
    std::string why;
    if (!pagedkv::reference::attention_row_ok(o.data(), lse, true, want, {DType::kBFloat16, 0x1p-8}, hd, &why)) {
      return "sequence " + std::to_string(b) + ", qo head " + std::to_string(h) + ": " + why;
    }
  }
  return "";
}

double g_copy_gbps = 0, g_spec_gbps = 0;
std::vector<double> g_copy_reps_ms;  // every repetition of the device-to-device copy

Result finish(std::string name, const Timing& t, double bytes, bool graph) {
  Result r;
  r.name = std::move(name);
  r.mode = graph ? "graph" : "stream";
  r.ms = t.ms;
  r.per_event = t.per_event;
  r.reps_ms = t.reps_ms;
  r.bytes = bytes;
  r.gbps = bytes / (t.ms * 1e-3) / 1e9;
  r.frac_copy = r.gbps / g_copy_gbps;
  r.frac_spec = g_spec_gbps > 0 ? r.gbps / g_spec_gbps : 0;
  return r;
}

enum class Split { kPlan, kUnsplit, kChunkRule };

struct DecodeShape {
  std::string name;
  std::vector<int> lens;  // per sequence
  int qo_heads, kv_heads, head_dim, block_size;
  Split split = Split::kPlan;
  bool graph = false;
  pagedkv::AttentionWindow window{};  // local attention: only the visible pages exist in the pool (the rest -> block 0)
  bool fp8 = false;                   // fp8 e4m3 KV (1 byte per element, scales 1)
};

Result bench_decode(const DecodeShape& s) {
  const int batch = static_cast<int>(s.lens.size());
  // With a window, pages wholly before a sequence's first visible token are the null block 0 (as a sliding-window
  // KV-cache group's table has them) and need no pool memory; only the visible tokens move.
  std::int64_t total_pages = 0;
  std::int64_t total_tokens = 0;
  const auto first_page = [&](int len) { return static_cast<int>(s.window.first_needed_token(len, 1) / s.block_size); };
  for (int len : s.lens) {
    total_pages += (len + s.block_size - 1) / s.block_size - first_page(len);
    total_tokens += len - s.window.first_needed_token(len, 1);
  }
  const std::int64_t num_blocks = total_pages + 1;
  const std::int64_t page_elems = std::int64_t{s.block_size} * s.kv_heads * s.head_dim;
  const double kv_elem_bytes = s.fp8 ? 1.0 : 2.0;
  const double pool_bytes = static_cast<double>(num_blocks) * 2 * page_elems * kv_elem_bytes;
  std::size_t free_b = 0, total_b = 0;
  BENCH_CUDA(cudaMemGetInfo(&free_b, &total_b));
  if (pool_bytes > 0.85 * static_cast<double>(free_b)) {
    Result r;
    r.name = s.name;
    char why[96];
    std::snprintf(why, sizeof why, "needs %.1f GiB, %.1f GiB free", pool_bytes / (1 << 30), free_b / double(1 << 30));
    r.skipped = why;
    return r;
  }
  Buf pool(static_cast<std::size_t>(pool_bytes));
  if (s.fp8) {
    fill_fp8(pool.p, static_cast<std::size_t>(pool_bytes), 7);
  } else {
    fill(pool.p, static_cast<std::size_t>(num_blocks * 2 * page_elems), 7);
  }
  std::vector<std::int32_t> fresh(static_cast<std::size_t>(num_blocks - 1));
  std::iota(fresh.begin(), fresh.end(), 1);
  std::shuffle(fresh.begin(), fresh.end(), std::mt19937(seed_of(1)));
  std::vector<std::int32_t> ids, indptr{0}, last;
  std::size_t next_id = 0;
  for (int len : s.lens) {
    const int pages = (len + s.block_size - 1) / s.block_size;
    for (int i = 0; i < pages; ++i) ids.push_back(i < first_page(len) ? 0 : fresh[next_id++]);
    indptr.push_back(indptr.back() + pages);
    last.push_back(pages == 0 ? 0 : len - (pages - 1) * s.block_size);
  }
  if (ids.empty()) ids.push_back(0);
  Buf* d_indptr = Buf::of(indptr);
  Buf* d_ids = Buf::of(ids);
  Buf* d_last = Buf::of(last);
  const std::size_t q_elems = static_cast<std::size_t>(batch) * s.qo_heads * s.head_dim;
  Buf q(q_elems * 2), o(q_elems * 2), lse(static_cast<std::size_t>(batch) * s.qo_heads * 4);
  fill(q.p, q_elems, 3);

  pagedkv::DecodeParams p;
  p.q = q.p;
  p.o = o.p;
  p.lse = lse.as<float>();
  // fp8: the factory places V after K's bytes (page elements x 1 byte), scales 1.
  p.kv = pagedkv::KVPoolView::nhd(pool.p, DType::kBFloat16, static_cast<std::int32_t>(num_blocks), s.block_size,
                                  s.kv_heads, s.head_dim,
                                  s.fp8 ? pagedkv::KVDType::kFp8E4M3 : pagedkv::KVDType::kSame, 1.f, 1.f);
  p.pages = pagedkv::PageTable::csr(batch, d_indptr->as<std::int32_t>(), d_ids->as<std::int32_t>(),
                                    d_last->as<std::int32_t>());
  p.num_qo_heads = s.qo_heads;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
  p.window = s.window;

  // The plan (host), copied to the device once.
  pagedkv::DecodePlanConfig cfg;
  BENCH_OK(pagedkv::cuda::decode_plan_config(0, DType::kBFloat16, s.head_dim, s.qo_heads, s.kv_heads, &cfg));
  if (s.split == Split::kUnsplit) cfg.max_waves = 0;
  cfg.window = s.window;
  const pagedkv::DecodePlanCapacity cap = pagedkv::decode_plan_capacity(batch, cfg);
  std::vector<pagedkv::DecodeWorkItem> items(static_cast<std::size_t>(cap.items));
  std::vector<pagedkv::DecodeMergeItem> merges(static_cast<std::size_t>(std::max(cap.merges, 1)));
  pagedkv::DecodePlanInfo info;
  const std::vector<std::int32_t> lens32(s.lens.begin(), s.lens.end());
  const auto t0 = std::chrono::steady_clock::now();
  BENCH_OK(pagedkv::plan_decode(lens32, cfg, {items, merges, cap.partial_rows}, &info));
  const double plan_us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  Buf* d_items = Buf::of(items);
  Buf* d_merges = Buf::of(merges);
  Buf ws(std::max<std::size_t>(cap.workspace_bytes, 16));
  p.workspace = ws.p;
  p.workspace_bytes = ws.bytes;
  const pagedkv::DecodeWorkList wl =
      info.work_list.relocated(d_items->as<pagedkv::DecodeWorkItem>(), d_merges->as<pagedkv::DecodeMergeItem>());

  char plan[200];
  Timing t;
  if (s.split == Split::kChunkRule) {
    // The pre-plan entry point with the chunk the plan would use for the longest sequence (or no split).
    const int max_len = *std::max_element(s.lens.begin(), s.lens.end());
    const int chunk = info.chunk_target_tokens > 0 ? info.chunk_target_tokens : max_len;
    const int chunks = (max_len + chunk - 1) / chunk;
    Buf ws2(pagedkv::decode_workspace_bytes(batch, std::max(chunks, 1), s.qo_heads, s.head_dim));
    pagedkv::DecodeParams pc = p;
    pc.kv_chunk_size_tokens = chunks >= 2 ? chunk : 0;
    pc.max_num_chunks = chunks >= 2 ? chunks : 0;
    pc.workspace = ws2.p;
    pc.workspace_bytes = ws2.bytes;
    std::snprintf(plan, sizeof plan, "chunk rule: %d chunks of %d tokens, grid %d x %d x %d", chunks, chunk, batch,
                  s.kv_heads, std::max(chunks, 1));
    t = time_launches([&](cudaStream_t st) { BENCH_OK(pagedkv::cuda::decode(pc, st)); }, s.graph);
  } else {
    std::snprintf(plan, sizeof plan,
                  "%d items (max %d, mean %.0f tokens), %d split requests, T %d, %d SMs x %d CTAs, plan %.0f us",
                  info.num_items, info.max_item_tokens, info.mean_item_tokens, info.num_merges,
                  info.chunk_target_tokens, cfg.num_sms, cfg.ctas_per_sm, plan_us);
    BENCH_CUDA(cudaDeviceSynchronize());
    const Status first = pagedkv::cuda::decode(p, wl, g_stream);
    if (first == Status::kUnsupported) {
      Result r;
      r.name = s.name;
      r.unsupported = "pagedkv::cuda::decode returned kUnsupported";
      delete d_indptr;
      delete d_ids;
      delete d_last;
      delete d_items;
      delete d_merges;
      return r;
    }
    BENCH_OK(first);
    t = time_launches([&](cudaStream_t st) { BENCH_OK(pagedkv::cuda::decode(p, wl, st)); }, s.graph);
  }
  const double bytes =
      2.0 * static_cast<double>(total_tokens) * s.kv_heads * s.head_dim * kv_elem_bytes + 2.0 * q_elems * 2;
  Result r = finish(s.name, t, bytes, s.graph);
  r.plan = plan;
  // The last timed launch's output, sampled, against float64: a wrong kernel reports no time.
  if (std::string wrong = check_decode_sample(p, s.lens, indptr, ids, s.fp8); !wrong.empty()) {
    Result w;
    w.name = s.name;
    w.wrong = "sampled output failed its float64 check: " + wrong;
    r = w;
  }
  delete d_indptr;
  delete d_ids;
  delete d_last;
  delete d_items;
  delete d_merges;
  return r;
}

/// Prefill over a paged prefix: `batch` sequences of `cached` tokens in the pool plus `fresh` new ones (also in the
/// pool, as write_kv would have put them), causal, bf16. Bytes: K/V of every token once per kv head + q + o; flops:
/// 4 * head_dim per visible (query, key) pair per query head.
Result bench_prefill(const std::string& name, int batch, int cached, int fresh, int hq, int hkv, int hd, int bs) {
  const int kv_len = cached + fresh;
  const int pages = (kv_len + bs - 1) / bs;
  const std::int64_t num_blocks = std::int64_t{batch} * pages + 1;
  const std::int64_t page_elems = std::int64_t{bs} * hkv * hd;
  Buf pool(static_cast<std::size_t>(num_blocks * 2 * page_elems * 2));
  fill(pool.p, static_cast<std::size_t>(num_blocks * 2 * page_elems), 21);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks - 1));
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(seed_of(22)));
  std::vector<std::int32_t> indptr{0}, last, qo{0};
  for (int b = 0; b < batch; ++b) {
    indptr.push_back(indptr.back() + pages);
    last.push_back(kv_len - (pages - 1) * bs);
    qo.push_back(qo.back() + fresh);
  }
  Buf* d_indptr = Buf::of(indptr);
  Buf* d_ids = Buf::of(ids);
  Buf* d_last = Buf::of(last);
  Buf* d_qo = Buf::of(qo);
  const std::size_t q_elems = static_cast<std::size_t>(batch) * fresh * hq * hd;
  Buf q(q_elems * 2), o(q_elems * 2), lse(static_cast<std::size_t>(batch) * fresh * hq * 4);
  fill(q.p, q_elems, 23);
  pagedkv::PrefillParams p;
  p.q = q.p;
  p.o = o.p;
  p.lse = lse.as<float>();
  p.qo_indptr = d_qo->as<std::int32_t>();
  p.total_q_tokens = batch * fresh;
  p.kv = pagedkv::KVPoolView::nhd(pool.p, DType::kBFloat16, static_cast<std::int32_t>(num_blocks), bs, hkv, hd);
  p.pages = pagedkv::PageTable::csr(batch, d_indptr->as<std::int32_t>(), d_ids->as<std::int32_t>(),
                                    d_last->as<std::int32_t>());
  p.num_qo_heads = hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(hd));
  const Timing t = time_launches([&](cudaStream_t st) { BENCH_OK(pagedkv::cuda::prefill(p, st)); }, false);
  const double pairs = static_cast<double>(fresh) * cached + static_cast<double>(fresh) * (fresh + 1) / 2;
  const double bytes = 2.0 * batch * kv_len * hkv * hd * 2 + 2.0 * q_elems * 2;
  Result r = finish(name, t, bytes, false);
  r.flops = 4.0 * hd * hq * pairs * batch;
  r.plan = "TFLOP/s " + std::to_string(r.flops / (t.ms * 1e-3) / 1e12);
  delete d_indptr;
  delete d_ids;
  delete d_last;
  delete d_qo;
  return r;
}

std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o.push_back('\\');
    o.push_back(c);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  double spec_override = 0;
  bool quick = false;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json_path = argv[++i];
    } else if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      g_reps = std::max(1, std::atoi(argv[++i]));
    } else if (std::strcmp(argv[i], "--spec-gbps") == 0 && i + 1 < argc) {
      spec_override = std::atof(argv[++i]);
    } else if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--seed") == 0 && i + 1 < argc) {
      g_seed = std::strtoull(argv[++i], nullptr, 10);
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc) {
      only = argv[++i];
    } else {
      std::fprintf(stderr,
                   "usage: bench_kernels [--json PATH] [--reps N] [--spec-gbps X] [--quick] [--seed N] [--only SUBSTRING]\n");
      return 2;
    }
  }
  int n = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    std::printf("bench_kernels: no CUDA device (%s)\n", e != cudaSuccess ? cudaGetErrorString(e) : "device count 0");
    return 77;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::int32_t sms = 0;
  BENCH_OK(pagedkv::cuda::device_sm_count(0, &sms));
  int mem_clock_khz = 0, bus_bits = 0, sm_clock_khz = 0, l2_bytes = 0;
  BENCH_CUDA(cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, 0));
  BENCH_CUDA(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, 0));
  BENCH_CUDA(cudaDeviceGetAttribute(&sm_clock_khz, cudaDevAttrClockRate, 0));
  BENCH_CUDA(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, 0));
  g_spec_gbps = spec_override > 0 ? spec_override : 2.0 * mem_clock_khz * 1e3 * bus_bits / 8 / 1e9;
  BENCH_CUDA(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
  if (quick && g_reps == 7) g_reps = 5;

  // Device-to-device copy bandwidth: 1 GiB, counting read + write.
  {
    const std::size_t copy_bytes = std::size_t{1} << 30;
    Buf a(copy_bytes), b(copy_bytes);
    fill(a.p, copy_bytes / 2, 1);
    const Timing t = time_launches(
        [&](cudaStream_t st) { BENCH_CUDA(cudaMemcpyAsync(b.p, a.p, copy_bytes, cudaMemcpyDeviceToDevice, st)); },
        false);
    g_copy_gbps = 2.0 * copy_bytes / (t.ms * 1e-3) / 1e9;
    g_copy_reps_ms = t.reps_ms;
  }

  std::vector<Result> results;
  const auto uniform = [](int batch, int len) { return std::vector<int>(static_cast<std::size_t>(batch), len); };
  std::vector<int> ragged(63, 4096);
  ragged.push_back(32768);
  // The rows the GPU issue asks for (--quick runs exactly these).
  std::vector<DecodeShape> shapes;
  for (int batch : {1, 64, 256}) {
    for (int len : {4096, 32768}) {
      for (auto [hq, hkv] : {std::pair{32, 32}, std::pair{32, 8}, std::pair{64, 8}}) {
        shapes.push_back({"decode b" + std::to_string(batch) + " kv" + std::to_string(len) + " qo" +
                              std::to_string(hq) + "/kv" + std::to_string(hkv) + " d128 bs16",
                          uniform(batch, len), hq, hkv, 128, 16});
      }
    }
  }
  // Ragged (63 x 4k + 1 x 32k) vs the uniform batch of the same total tokens (64 x 4544).
  shapes.push_back({"decode ragged 63x4096+1x32768 qo32/kv8 d128 bs16", ragged, 32, 8, 128, 16});
  shapes.push_back({"decode b64 kv4544 qo32/kv8 d128 bs16 (ragged's total)", uniform(64, 4544), 32, 8, 128, 16});
  // Block sizes 8-64 (bs16 is in the grid above).
  for (int bs : {8, 32, 64}) {
    shapes.push_back({"decode b64 kv4096 qo32/kv8 d128 bs" + std::to_string(bs), uniform(64, 4096), 32, 8, 128, bs});
  }
  // fp8 e4m3 KV vs bf16 (the bf16 rows of the same shapes are in the grid above).
  for (auto [batch, len] : {std::pair{64, 4096}, std::pair{1, 32768}, std::pair{64, 32768}}) {
    DecodeShape f{"decode fp8 b" + std::to_string(batch) + " kv" + std::to_string(len) + " qo32/kv8 d128 bs16",
                  uniform(batch, len), 32, 8, 128, 16};
    f.fp8 = true;
    shapes.push_back(f);
  }
  if (!quick) {
    shapes.push_back({"decode b64 kv4096 qo32/kv8 d128 bs16 unsplit", uniform(64, 4096), 32, 8, 128, 16, Split::kUnsplit});
    // Every row's name is unique (scripts/bench-compare.py keys rows by name and refuses duplicates): the graph
    // row of the contract shape says so in its name, not only in its mode.
    shapes.push_back({"decode b64 kv4096 qo32/kv8 d128 bs16 graph", uniform(64, 4096), 32, 8, 128, 16, Split::kPlan, true});
    shapes.push_back({"decode ragged 63x4096+1x32768 qo32/kv8 d128 bs16 unsplit", ragged, 32, 8, 128, 16, Split::kUnsplit});
    shapes.push_back({"decode b1 kv32768 qo32/kv8 d128 bs16 chunk rule", uniform(1, 32768), 32, 8, 128, 16,
                      Split::kChunkRule});
    // Local attention (issue 13): a sliding-window layer of 4096 over 32k-token sequences moves the bytes of
    // "b64 kv4096"; Llama 4's chunked-local 8192 those of 8192 tokens. Pages before the window are block 0.
    shapes.push_back({"decode b64 kv32768 window4096 qo32/kv8 d128 bs16", uniform(64, 32768), 32, 8, 128, 16,
                      Split::kPlan, false, {4096, 0}});
    shapes.push_back({"decode b64 kv32768 chunk8192 qo32/kv8 d128 bs16", uniform(64, 32768), 32, 8, 128, 16,
                      Split::kPlan, false, {0, 8192}});
    std::vector<int> ragged256(255, 4096);
    ragged256.push_back(32768);
    shapes.push_back({"decode ragged 255x4096+1x32768 qo32/kv8 d128 bs16", ragged256, 32, 8, 128, 16});
    shapes.push_back({"decode ragged 255x4096+1x32768 qo32/kv8 d128 bs16 unsplit", ragged256, 32, 8, 128, 16,
                      Split::kUnsplit});
  }
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (shapes[i].name == shapes[j].name) {
        std::fprintf(stderr, "bench_kernels: rows %zu and %zu are both named \"%s\" (row names must be unique)\n", j,
                     i, shapes[i].name.c_str());
        return 2;
      }
    }
  }
  const auto want = [&](const std::string& name) { return only.empty() || name.find(only) != std::string::npos; };
  for (const auto& s : shapes) {
    if (!want(s.name)) continue;
    results.push_back(bench_decode(s));
    std::fflush(stdout);
  }
  if (const std::string name = "prefill b8 cached2048+new512 causal qo32/kv8 d128 bs16"; want(name)) {
    results.push_back(bench_prefill(name, 8, 2048, 512, 32, 8, 128, 16));
  }

  // write_kv: 65536 tokens x 8 heads x 128 bf16 into a shuffled set of slots (read + write of K and V).
  if (want("write_kv 65536 tok x 8 heads x 128 bf16 bs16")) {
    const int tokens = 65536, heads = 8, hd = 128, bs = 16;
    const std::int64_t num_blocks = tokens / bs + 1;
    const std::int64_t page_elems = std::int64_t{bs} * heads * hd;
    Buf pool(static_cast<std::size_t>(num_blocks * 2 * page_elems * 2));
    Buf key(static_cast<std::size_t>(tokens) * heads * hd * 2), value(static_cast<std::size_t>(tokens) * heads * hd * 2);
    fill(key.p, static_cast<std::size_t>(tokens) * heads * hd, 5);
    fill(value.p, static_cast<std::size_t>(tokens) * heads * hd, 6);
    std::vector<std::int64_t> slots(tokens);
    std::iota(slots.begin(), slots.end(), std::int64_t{bs});
    std::shuffle(slots.begin(), slots.end(), std::mt19937(seed_of(2)));
    Buf* d_slots = Buf::of(slots);
    pagedkv::WriteKVParams w;
    w.key = key.p;
    w.value = value.p;
    w.slot_mapping = d_slots->as<std::int64_t>();
    w.num_tokens = tokens;
    w.kv = pagedkv::KVPoolView::nhd(pool.p, DType::kBFloat16, static_cast<std::int32_t>(num_blocks), bs, heads, hd);
    const Timing t = time_launches([&](cudaStream_t st) { BENCH_OK(pagedkv::cuda::write_kv(w, st)); }, false);
    const double bytes = 2.0 * 2.0 * tokens * heads * hd * 2 + tokens * 8.0;
    results.push_back(finish("write_kv 65536 tok x 8 heads x 128 bf16 bs16", t, bytes, false));
    delete d_slots;
  }
  // copy_blocks: 4096 (src, dst) pairs of 64 KiB blocks (K + V), one layer; and 8 layers x 512 pairs.
  for (int layers : {1, 8}) {
    const int pairs = 4096 / layers, heads = 8, hd = 128, bs = 16;
    if (!want("copy_blocks " + std::to_string(layers) + " layer(s)")) continue;
    const std::int64_t num_blocks = 2 * pairs + 1;
    const std::int64_t page_elems = std::int64_t{bs} * heads * hd;
    std::vector<Buf*> pools;
    std::vector<pagedkv::KVPoolView> views;
    for (int l = 0; l < layers; ++l) {
      pools.push_back(new Buf(static_cast<std::size_t>(num_blocks * 2 * page_elems * 2)));
      fill(pools.back()->p, static_cast<std::size_t>(num_blocks * 2 * page_elems), 9 + l);
      views.push_back(pagedkv::KVPoolView::nhd(pools.back()->p, DType::kBFloat16,
                                               static_cast<std::int32_t>(num_blocks), bs, heads, hd));
    }
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks - 1));
    std::iota(ids.begin(), ids.end(), 1);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(seed_of(3)));
    std::vector<std::int32_t> mapping(2 * static_cast<std::size_t>(pairs));
    for (int i = 0; i < pairs; ++i) {
      mapping[2 * i] = ids[i];
      mapping[2 * i + 1] = ids[pairs + i];
    }
    Buf* d_map = Buf::of(mapping);
    const pagedkv::CopyBlocksParams c{views.data(), layers, d_map->as<std::int32_t>(), pairs};
    const Timing t = time_launches([&](cudaStream_t st) { BENCH_OK(pagedkv::cuda::copy_blocks(c, st)); }, false);
    const double bytes = 2.0 * 2.0 * layers * pairs * page_elems * 2;
    results.push_back(finish("copy_blocks " + std::to_string(layers) + " layer(s) x " + std::to_string(pairs) +
                                 " pairs, 64 KiB blocks",
                             t, bytes, false));
    for (Buf* b : pools) delete b;
    delete d_map;
  }

  int driver = 0, runtime = 0;
  BENCH_CUDA(cudaDriverGetVersion(&driver));
  BENCH_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("device: %s (%d SMs, sm_%d%d), driver %d, runtime %d, memory clock %d MHz x %d bits, L2 %d MiB\n",
              prop.name, sms, prop.major, prop.minor, driver, runtime, mem_clock_khz / 1000, bus_bits,
              l2_bytes >> 20);
  std::printf("bandwidth: device-to-device copy (read + write) %.1f GB/s measured; spec %.1f GB/s%s\n", g_copy_gbps,
              g_spec_gbps, spec_override > 0 ? " (--spec-gbps)" : " (2 x memory clock x bus width)");
  std::printf("timing: median of %d repetitions of N launches per event pair (graph: one graph of N launches)\n\n",
              g_reps);
  std::printf("%-60s %6s %5s %10s %9s %7s %7s  %s\n", "kernel", "mode", "N", "median us", "GB/s", "% copy", "% spec",
              "plan");
  for (const auto& r : results) {
    if (!r.skipped.empty()) {
      std::printf("%-60s skipped: %s\n", r.name.c_str(), r.skipped.c_str());
      continue;
    }
    if (!r.unsupported.empty()) {
      std::printf("%-60s unsupported: %s\n", r.name.c_str(), r.unsupported.c_str());
      continue;
    }
    if (!r.wrong.empty()) {
      std::printf("%-60s WRONG OUTPUT: %s\n", r.name.c_str(), r.wrong.c_str());
      continue;
    }
    std::printf("%-60s %6s %5d %10.1f %9.1f %6.1f%% %6.1f%%  %s\n", r.name.c_str(), r.mode.c_str(), r.per_event,
                r.ms * 1e3, r.gbps, 100 * r.frac_copy, 100 * r.frac_spec, r.plan.c_str());
  }

  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) {
      std::perror(json_path);
      return 2;
    }
    std::fprintf(f,
                 "{\n  \"device\": \"%s\",\n  \"sm_count\": %d,\n  \"compute_capability\": \"%d.%d\",\n"
                 "  \"driver_version\": %d,\n  \"runtime_version\": %d,\n  \"memory_clock_mhz\": %d,\n"
                 "  \"memory_bus_bits\": %d,\n  \"sm_clock_mhz\": %d,\n  \"l2_bytes\": %d,\n",
                 json_escape(prop.name).c_str(), sms, prop.major, prop.minor, driver, runtime, mem_clock_khz / 1000,
                 bus_bits, sm_clock_khz / 1000, l2_bytes);
    std::fprintf(f, "  \"seed\": %llu,\n  \"quick\": %s,\n", static_cast<unsigned long long>(g_seed),
                 quick ? "true" : "false");
    std::fprintf(f, "  \"reps\": %d,\n  \"copy_bandwidth_gbps\": %.3f,\n  \"spec_bandwidth_gbps\": %.3f,\n", g_reps,
                 g_copy_gbps, g_spec_gbps);
    std::fprintf(f, "  \"copy_reps_us\": [");
    for (std::size_t k = 0; k < g_copy_reps_ms.size(); ++k) {
      std::fprintf(f, "%s%.3f", k ? ", " : "", g_copy_reps_ms[k] * 1e3);
    }
    std::fprintf(f, "],\n");
    std::fprintf(f, "  \"results\": [\n");
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      if (!r.skipped.empty()) {
        std::fprintf(f, "    {\"name\": \"%s\", \"skipped\": \"%s\"}", json_escape(r.name).c_str(),
                     json_escape(r.skipped).c_str());
      } else if (!r.unsupported.empty()) {
        std::fprintf(f, "    {\"name\": \"%s\", \"unsupported\": \"%s\"}", json_escape(r.name).c_str(),
                     json_escape(r.unsupported).c_str());
      } else if (!r.wrong.empty()) {
        std::fprintf(f, "    {\"name\": \"%s\", \"wrong_output\": \"%s\"}", json_escape(r.name).c_str(),
                     json_escape(r.wrong).c_str());
      } else {
        std::string reps;
        for (std::size_t k = 0; k < r.reps_ms.size(); ++k) {
          char buf[32];
          std::snprintf(buf, sizeof buf, "%s%.3f", k ? ", " : "", r.reps_ms[k] * 1e3);
          reps += buf;
        }
        std::fprintf(f,
                     "    {\"name\": \"%s\", \"mode\": \"%s\", \"launches_per_event_pair\": %d, \"median_us\": %.3f, "
                     "\"bytes\": %.0f, \"gbps\": %.3f, \"fraction_of_copy\": %.4f, \"fraction_of_spec\": %.4f, "
                     "\"tflops\": %.4f, \"reps_us\": [%s], \"plan\": \"%s\"}",
                     json_escape(r.name).c_str(), r.mode.c_str(), r.per_event, r.ms * 1e3, r.bytes, r.gbps,
                     r.frac_copy, r.frac_spec, r.flops > 0 ? r.flops / (r.ms * 1e-3) / 1e12 : 0.0, reps.c_str(),
                     json_escape(r.plan).c_str());
      }
      std::fprintf(f, "%s\n", i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  BENCH_CUDA(cudaStreamDestroy(g_stream));
  for (const auto& r : results) {
    if (!r.wrong.empty()) {
      std::fprintf(stderr, "bench_kernels: %s: wrong output (%s)\n", r.name.c_str(), r.wrong.c_str());
      return 1;
    }
  }
  return 0;
}
