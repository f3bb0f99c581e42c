// benchmarks/cuda/bench_kernels.cu: kernel timings of pagedkv::cuda against the device's measured copy bandwidth.
//
// Standalone (CUDA events; no Google Benchmark). First measures device-to-device copy bandwidth (cudaMemcpyAsync
// of a 1 GiB buffer; bytes read + bytes written), then for each kernel configuration the median time over
// `--iters` launches and the achieved bandwidth (bytes that must move: K/V read once + q read + o written, or
// read + write for the copy kernels) as a fraction of the copy bandwidth. Pools exceed L2, block ids are shuffled,
// data random. Prints a table; writes JSON with --json PATH.
//
// Usage: bench_kernels [--json PATH] [--iters N]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
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
#include <pagedkv/kernel_params.hpp>

namespace {

using pagedkv::DType;
using pagedkv::Status;

#define BENCH_CUDA(expr)                                                                           \
  do {                                                                                             \
    const cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                       \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

#define BENCH_OK(expr)                                                                                   \
  do {                                                                                                   \
    const Status s_ = (expr);                                                                            \
    if (s_ != Status::kSuccess) {                                                                        \
      std::fprintf(stderr, "pagedkv error %s at %s:%d: %s\n", pagedkv::to_string(s_), __FILE__, __LINE__, #expr); \
      std::exit(2);                                                                                      \
    }                                                                                                    \
  } while (0)

__global__ void fill_random_bf16(__nv_bfloat16* p, std::size_t n, std::uint32_t seed) {
  for (std::size_t i = blockIdx.x * std::size_t{blockDim.x} + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    std::uint32_t x = static_cast<std::uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 15;
    x *= 2246822519u;
    x ^= x >> 13;
    p[i] = __float2bfloat16(static_cast<float>(x & 0xffff) / 32768.f - 1.f);
  }
}

struct Buf {
  void* p = nullptr;
  explicit Buf(std::size_t bytes) { BENCH_CUDA(cudaMalloc(&p, bytes)); }
  ~Buf() { (void)cudaFree(p); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
};

void fill(void* p, std::size_t elems, std::uint32_t seed) {
  fill_random_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), elems, seed);
  BENCH_CUDA(cudaGetLastError());
}

/// Median time (ms) of `iters` runs of f, each bracketed by events, after 3 warm-up runs.
template <class F>
double median_ms(int iters, F&& f) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) f();
  BENCH_CUDA(cudaDeviceSynchronize());
  std::vector<double> t;
  for (int i = 0; i < iters; ++i) {
    BENCH_CUDA(cudaEventRecord(a));
    f();
    BENCH_CUDA(cudaEventRecord(b));
    BENCH_CUDA(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  BENCH_CUDA(cudaEventDestroy(a));
  BENCH_CUDA(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Result {
  std::string name;
  double ms, bytes, gbps, frac;
};

struct DecodeShape {
  std::string name;
  int batch, kv_len, qo_heads, kv_heads, head_dim, block_size;
  bool plan_split;  // use decode_plan (split-KV when the batch is small)
};

Result bench_decode(const DecodeShape& s, int sms, double copy_gbps, int iters) {
  const std::int64_t pages_per_seq = (s.kv_len + s.block_size - 1) / s.block_size;
  const std::int64_t num_blocks = s.batch * pages_per_seq + 1;
  const std::int64_t page_elems = std::int64_t{s.block_size} * s.kv_heads * s.head_dim;
  Buf pool(static_cast<std::size_t>(num_blocks * 2 * page_elems * 2));
  fill(pool.p, static_cast<std::size_t>(num_blocks * 2 * page_elems), 7);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks - 1));
  std::iota(ids.begin(), ids.end(), 1);
  std::shuffle(ids.begin(), ids.end(), std::mt19937(1));
  std::vector<std::int32_t> indptr(s.batch + 1), last(s.batch);
  for (int b = 0; b <= s.batch; ++b) indptr[b] = static_cast<std::int32_t>(b * pages_per_seq);
  for (int b = 0; b < s.batch; ++b) last[b] = static_cast<std::int32_t>(s.kv_len - (pages_per_seq - 1) * s.block_size);
  Buf d_indptr(indptr.size() * 4), d_ids(ids.size() * 4), d_last(last.size() * 4);
  BENCH_CUDA(cudaMemcpy(d_indptr.p, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_ids.p, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(d_last.p, last.data(), last.size() * 4, cudaMemcpyHostToDevice));
  const std::size_t q_elems = static_cast<std::size_t>(s.batch) * s.qo_heads * s.head_dim;
  Buf q(q_elems * 2), o(q_elems * 2), lse(static_cast<std::size_t>(s.batch) * s.qo_heads * 4);
  fill(q.p, q_elems, 3);

  pagedkv::DecodeParams p;
  p.q = q.p;
  p.o = o.p;
  p.lse = static_cast<float*>(lse.p);
  p.kv = pagedkv::KVPoolView::nhd(pool.p, DType::kBFloat16, static_cast<std::int32_t>(num_blocks), s.block_size,
                                  s.kv_heads, s.head_dim);
  p.pages = pagedkv::PageTable::csr(s.batch, static_cast<std::int32_t*>(d_indptr.p),
                                    static_cast<std::int32_t*>(d_ids.p), static_cast<std::int32_t*>(d_last.p));
  p.num_qo_heads = s.qo_heads;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(s.head_dim));
  const auto plan = pagedkv::cuda::decode_plan(s.batch, s.kv_len, s.qo_heads, s.kv_heads, s.head_dim,
                                               DType::kBFloat16, sms);
  Buf ws(std::max<std::size_t>(plan.workspace_bytes, 16));
  if (s.plan_split) {
    p.kv_chunk_size_tokens = plan.kv_chunk_size_tokens;
    p.max_num_chunks = plan.max_num_chunks;
    p.workspace = ws.p;
    p.workspace_bytes = plan.workspace_bytes;
  }
  const double ms = median_ms(iters, [&] { BENCH_OK(pagedkv::cuda::decode(p)); });
  const double bytes = 2.0 * s.batch * s.kv_len * s.kv_heads * s.head_dim * 2 + 2.0 * q_elems * 2;
  const double gbps = bytes / (ms * 1e-3) / 1e9;
  std::string name = s.name;
  if (s.plan_split && plan.max_num_chunks > 1) {
    name += " [split " + std::to_string(plan.max_num_chunks) + "x" + std::to_string(plan.kv_chunk_size_tokens) + "]";
  }
  return {name, ms, bytes, gbps, gbps / copy_gbps};
}

}  // namespace

int main(int argc, char** argv) {
  const char* json_path = nullptr;
  int iters = 30;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) json_path = argv[++i];
    else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) iters = std::atoi(argv[++i]);
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("bench_kernels: no CUDA device\n");
    return 77;
  }
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::int32_t sms = 0;
  BENCH_OK(pagedkv::cuda::device_sm_count(0, &sms));

  // Device-to-device copy bandwidth: 1 GiB, counting read + write.
  const std::size_t copy_bytes = std::size_t{1} << 30;
  double copy_gbps = 0;
  {
    Buf a(copy_bytes), b(copy_bytes);
    fill(a.p, copy_bytes / 2, 1);
    const double ms = median_ms(iters, [&] { BENCH_CUDA(cudaMemcpyAsync(b.p, a.p, copy_bytes, cudaMemcpyDeviceToDevice)); });
    copy_gbps = 2.0 * copy_bytes / (ms * 1e-3) / 1e9;
  }

  std::vector<Result> results;
  const std::vector<DecodeShape> shapes = {
      {"decode b64 kv4096 qo32/kv8 d128 bf16 bs16", 64, 4096, 32, 8, 128, 16, true},
      {"decode b64 kv4096 qo32/kv8 d128 bf16 bs8", 64, 4096, 32, 8, 128, 8, true},
      {"decode b64 kv4096 qo32/kv8 d128 bf16 bs32", 64, 4096, 32, 8, 128, 32, true},
      {"decode b64 kv4096 qo32/kv8 d128 bf16 bs64", 64, 4096, 32, 8, 128, 64, true},
      {"decode b64 kv4096 qo8/kv8 (group 1) d128 bf16 bs16", 64, 4096, 8, 8, 128, 16, true},
      {"decode b64 kv4096 qo64/kv8 (group 8) d128 bf16 bs16", 64, 4096, 64, 8, 128, 16, true},
      {"decode b1 kv32768 qo32/kv8 d128 bf16 bs16 no-split", 1, 32768, 32, 8, 128, 16, false},
      {"decode b1 kv32768 qo32/kv8 d128 bf16 bs16 planned", 1, 32768, 32, 8, 128, 16, true},
  };
  for (const auto& s : shapes) results.push_back(bench_decode(s, sms, copy_gbps, iters));

  // write_kv: 65536 tokens x 8 heads x 128 bf16 into a shuffled set of slots (read + write of K and V).
  {
    const int tokens = 65536, heads = 8, hd = 128, bs = 16;
    const std::int64_t num_blocks = tokens / bs + 1;
    const std::int64_t page_elems = std::int64_t{bs} * heads * hd;
    Buf pool(static_cast<std::size_t>(num_blocks * 2 * page_elems * 2));
    Buf key(static_cast<std::size_t>(tokens) * heads * hd * 2), value(static_cast<std::size_t>(tokens) * heads * hd * 2);
    fill(key.p, static_cast<std::size_t>(tokens) * heads * hd, 5);
    fill(value.p, static_cast<std::size_t>(tokens) * heads * hd, 6);
    std::vector<std::int64_t> slots(tokens);
    std::iota(slots.begin(), slots.end(), std::int64_t{bs});
    std::shuffle(slots.begin(), slots.end(), std::mt19937(2));
    Buf d_slots(slots.size() * 8);
    BENCH_CUDA(cudaMemcpy(d_slots.p, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice));
    pagedkv::WriteKVParams w;
    w.key = key.p;
    w.value = value.p;
    w.slot_mapping = static_cast<std::int64_t*>(d_slots.p);
    w.num_tokens = tokens;
    w.kv = pagedkv::KVPoolView::nhd(pool.p, DType::kBFloat16, static_cast<std::int32_t>(num_blocks), bs, heads, hd);
    const double ms = median_ms(iters, [&] { BENCH_OK(pagedkv::cuda::write_kv(w)); });
    const double bytes = 2.0 * 2.0 * tokens * heads * hd * 2 + tokens * 8.0;
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    results.push_back({"write_kv 65536 tok x 8 heads x 128 bf16 bs16", ms, bytes, gbps, gbps / copy_gbps});
  }
  // copy_blocks: 4096 (src, dst) pairs of 64 KiB blocks (K + V), one layer; and 8 layers x 512 pairs.
  for (int layers : {1, 8}) {
    const int pairs = 4096 / layers, heads = 8, hd = 128, bs = 16;
    const std::int64_t num_blocks = 2 * pairs + 1;
    const std::int64_t page_elems = std::int64_t{bs} * heads * hd;
    std::vector<Buf*> pools;
    std::vector<pagedkv::KVPoolView> views;
    for (int l = 0; l < layers; ++l) {
      pools.push_back(new Buf(static_cast<std::size_t>(num_blocks * 2 * page_elems * 2)));
      fill(pools.back()->p, static_cast<std::size_t>(num_blocks * 2 * page_elems), 9 + l);
      views.push_back(pagedkv::KVPoolView::nhd(pools.back()->p, DType::kBFloat16, static_cast<std::int32_t>(num_blocks),
                                               bs, heads, hd));
    }
    std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks - 1));
    std::iota(ids.begin(), ids.end(), 1);
    std::shuffle(ids.begin(), ids.end(), std::mt19937(3));
    std::vector<std::int32_t> mapping(2 * static_cast<std::size_t>(pairs));
    for (int i = 0; i < pairs; ++i) {
      mapping[2 * i] = ids[i];
      mapping[2 * i + 1] = ids[pairs + i];
    }
    Buf d_map(mapping.size() * 4);
    BENCH_CUDA(cudaMemcpy(d_map.p, mapping.data(), mapping.size() * 4, cudaMemcpyHostToDevice));
    pagedkv::CopyBlocksParams c{views.data(), layers, static_cast<std::int32_t*>(d_map.p), pairs};
    const double ms = median_ms(iters, [&] { BENCH_OK(pagedkv::cuda::copy_blocks(c)); });
    const double bytes = 2.0 * 2.0 * layers * pairs * page_elems * 2;
    const double gbps = bytes / (ms * 1e-3) / 1e9;
    results.push_back({"copy_blocks " + std::to_string(layers) + " layer(s) x " + std::to_string(pairs) +
                           " pairs, 64 KiB blocks",
                       ms, bytes, gbps, gbps / copy_gbps});
    for (Buf* b : pools) delete b;
  }

  int driver = 0, runtime = 0;
  BENCH_CUDA(cudaDriverGetVersion(&driver));
  BENCH_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("device: %s (%d SMs), driver %d, runtime %d\n", prop.name, sms, driver, runtime);
  std::printf("device-to-device copy bandwidth (read + write): %.1f GB/s\n\n", copy_gbps);
  std::printf("%-62s %10s %10s %9s\n", "kernel", "median ms", "GB/s", "of copy");
  for (const auto& r : results) std::printf("%-62s %10.4f %10.1f %8.1f%%\n", r.name.c_str(), r.ms, r.gbps, 100 * r.frac);

  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) {
      std::perror(json_path);
      return 2;
    }
    std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"sm_count\": %d,\n  \"driver_version\": %d,\n  \"runtime_version\": %d,\n",
                 prop.name, sms, driver, runtime);
    std::fprintf(f, "  \"iters\": %d,\n  \"copy_bandwidth_gbps\": %.3f,\n  \"results\": [\n", iters, copy_gbps);
    for (std::size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      std::fprintf(f, "    {\"name\": \"%s\", \"median_ms\": %.6f, \"bytes\": %.0f, \"gbps\": %.3f, \"fraction_of_copy\": %.4f}%s\n",
                   r.name.c_str(), r.ms, r.bytes, r.gbps, r.frac, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}
