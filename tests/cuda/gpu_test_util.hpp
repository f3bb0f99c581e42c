// tests/cuda/gpu_test_util.hpp: helpers for the GPU tests: RAII device/pinned buffers, host dtype conversion,
// paged pools in the four standard layouts (unused slots NaN), random batches with CSR and padded page tables,
// and error metrics. Test-only code.
#pragma once

#include <catch2/catch.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <pagedkv/cuda/launch.hpp>
#include <pagedkv/kernel_params.hpp>

namespace pkt {

using pagedkv::DType;
using pagedkv::KVPoolView;
using pagedkv::PageTable;
using pagedkv::PageTableFormat;
using pagedkv::Status;

#define PKT_CUDA(expr) REQUIRE((expr) == cudaSuccess)

inline const char* dtype_name(DType dt) {
  return dt == DType::kFloat32 ? "fp32" : dt == DType::kFloat16 ? "fp16" : "bf16";
}

/// Device allocation (cudaMalloc), freed on scope exit.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(std::size_t bytes) : bytes_(bytes) { PKT_CUDA(cudaMalloc(&p_, std::max<std::size_t>(bytes, 16))); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DevBuf() {
    if (p_ != nullptr) (void)cudaFree(p_);
  }
  void* get() const { return p_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  std::size_t bytes() const { return bytes_; }
  void upload(const void* h, std::size_t n) { PKT_CUDA(cudaMemcpy(p_, h, n, cudaMemcpyHostToDevice)); }
  void download(void* h, std::size_t n) const { PKT_CUDA(cudaMemcpy(h, p_, n, cudaMemcpyDeviceToHost)); }
  template <class T>
  static DevBuf from(const std::vector<T>& v) {
    DevBuf b(v.size() * sizeof(T));
    if (!v.empty()) b.upload(v.data(), v.size() * sizeof(T));
    return b;
  }
  void poison() { PKT_CUDA(cudaMemset(p_, 0xff, bytes_)); }  // 0xff.. is NaN in fp32, fp16 and bf16

 private:
  void* p_ = nullptr;
  std::size_t bytes_ = 0;
};

// ---- host dtype conversion (CUDA's host-side conversions, round to nearest even) ----
inline float load_elem(const void* base, std::int64_t idx, DType dt) {
  const auto* b = static_cast<const unsigned char*>(base);
  if (dt == DType::kFloat32) {
    float f;
    std::memcpy(&f, b + idx * 4, 4);
    return f;
  }
  if (dt == DType::kFloat16) {
    __half h;
    std::memcpy(&h, b + idx * 2, 2);
    return __half2float(h);
  }
  __nv_bfloat16 h;
  std::memcpy(&h, b + idx * 2, 2);
  return __bfloat162float(h);
}
inline void store_elem(void* base, std::int64_t idx, DType dt, float f) {
  auto* b = static_cast<unsigned char*>(base);
  if (dt == DType::kFloat32) {
    std::memcpy(b + idx * 4, &f, 4);
  } else if (dt == DType::kFloat16) {
    const __half h = __float2half_rn(f);
    std::memcpy(b + idx * 2, &h, 2);
  } else {
    const __nv_bfloat16 h = __float2bfloat16_rn(f);
    std::memcpy(b + idx * 2, &h, 2);
  }
}
inline float round_to(DType dt, float f) {
  unsigned char tmp[4];
  store_elem(tmp, 0, dt, f);
  return load_elem(tmp, 0, dt);
}

/// The run's seed: PAGEDKV_GPU_SEED when set (scripts/gpu-check.sh sets it; set it to replay a run), else drawn
/// from std::random_device once per process. gpu_main.cpp prints it before any test runs.
std::uint64_t run_seed();

/// splitmix64 (Steele et al., OOPSLA'14) of (case seed, run seed): every case keeps its own stream, and every run
/// draws fresh inputs.
inline std::uint64_t mix_seed(std::uint64_t case_seed) {
  std::uint64_t z = case_seed + 0x9e3779b97f4a7c15ull * (run_seed() + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// Random values in [-1, 1) rounded to dt (never zeros). Seeded by mix_seed(case seed): fresh on every run.
struct Rng {
  std::mt19937_64 gen;
  explicit Rng(std::uint64_t seed) : gen(mix_seed(seed)) {}
  float uniform() { return std::uniform_real_distribution<float>(-1.f, 1.f)(gen); }
  int range(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }  // inclusive
};

/// Host tensor of `n` elements of dtype dt, random, with its device copy.
struct Tensor {
  DType dt;
  std::int64_t n;
  std::vector<unsigned char> host;
  DevBuf dev;
  Tensor(DType d, std::int64_t count) : dt(d), n(count), host(static_cast<std::size_t>(count) * pagedkv::dtype_size_bytes(d)),
                                        dev(host.size()) {}
  void randomize(Rng& r) {
    for (std::int64_t i = 0; i < n; ++i) store_elem(host.data(), i, dt, r.uniform());
    dev.upload(host.data(), host.size());
  }
  float at(std::int64_t i) const { return load_elem(host.data(), i, dt); }
  void fetch() { dev.download(host.data(), host.size()); }
};

/// kPaddedNhd: interleaved NHD with 8 elements of padding after each head row (not dense: exercises strides).
enum class Layout { kNhd, kHnd, kSeparateNhd, kSeparateHnd, kPaddedNhd };
inline constexpr int kRowPad = 8;
inline const char* layout_name(Layout l) {
  switch (l) {
    case Layout::kNhd: return "NHD";
    case Layout::kHnd: return "HND";
    case Layout::kSeparateNhd: return "sepNHD";
    case Layout::kSeparateHnd: return "sepHND";
    case Layout::kPaddedNhd: return "paddedNHD";
  }
  return "?";
}

/// A paged pool mirrored on host and device, every element NaN until written.
struct Pool {
  DType dt;
  int num_blocks, block_size, heads, head_dim;
  Layout layout;
  std::size_t k_bytes, v_bytes;  // v_bytes == 0 for the interleaved layouts
  std::vector<unsigned char> hk, hv;
  DevBuf dk, dv;

  Pool(DType d, int nb, int bs, int h, int hd, Layout l)
      : dt(d), num_blocks(nb), block_size(bs), heads(h), head_dim(hd), layout(l) {
    const int row = l == Layout::kPaddedNhd ? hd + kRowPad : hd;
    const std::size_t page = static_cast<std::size_t>(bs) * h * row * pagedkv::dtype_size_bytes(d);
    const bool inter = l == Layout::kNhd || l == Layout::kHnd || l == Layout::kPaddedNhd;
    k_bytes = static_cast<std::size_t>(nb) * page * (inter ? 2 : 1);
    v_bytes = inter ? 0 : static_cast<std::size_t>(nb) * page;
    hk.assign(k_bytes, 0xff);
    hv.assign(v_bytes, 0xff);
    dk = DevBuf(k_bytes);
    if (v_bytes > 0) dv = DevBuf(v_bytes);
  }
  KVPoolView view_on(void* k, void* v) const {
    switch (layout) {
      case Layout::kNhd: return KVPoolView::nhd(k, dt, num_blocks, block_size, heads, head_dim);
      case Layout::kHnd: return KVPoolView::hnd(k, dt, num_blocks, block_size, heads, head_dim);
      case Layout::kSeparateNhd: return KVPoolView::separate_nhd(k, v, dt, num_blocks, block_size, heads, head_dim);
      case Layout::kSeparateHnd: return KVPoolView::separate_hnd(k, v, dt, num_blocks, block_size, heads, head_dim);
      case Layout::kPaddedNhd: {
        const std::int64_t row = head_dim + kRowPad;
        const std::int64_t page = std::int64_t{block_size} * heads * row;
        KVPoolView p{k, nullptr, dt, num_blocks, block_size, heads, head_dim, 2 * page, heads * row, row};
        p.v = static_cast<char*>(k) + page * static_cast<std::int64_t>(pagedkv::dtype_size_bytes(dt));
        return p;
      }
    }
    return {};
  }
  KVPoolView host_view() { return view_on(hk.data(), hv.empty() ? nullptr : hv.data()); }
  KVPoolView dev_view() const { return view_on(dk.get(), dv.get()); }
  void upload() {
    dk.upload(hk.data(), k_bytes);
    if (v_bytes > 0) dv.upload(hv.data(), v_bytes);
  }
  void download() {
    dk.download(hk.data(), k_bytes);
    if (v_bytes > 0) dv.download(hv.data(), v_bytes);
  }
  /// Random values in every slot of every block (K and V), then upload.
  void fill_random(Rng& r) {
    const KVPoolView v = host_view();
    for (int b = 0; b < num_blocks; ++b)
      for (int t = 0; t < block_size; ++t)
        for (int h = 0; h < heads; ++h)
          for (int d = 0; d < head_dim; ++d) {
            store_elem(v.k, v.offset(b, t, h) + d, dt, r.uniform());
            store_elem(v.v, v.offset(b, t, h) + d, dt, r.uniform());
          }
    upload();
  }
  bool same_bytes(const Pool& o) const { return hk == o.hk && hv == o.hv; }
  float k_at(int block, int tok, int head, int d) {
    const KVPoolView v = host_view();
    return load_elem(v.k, v.offset(block, tok, head) + d, dt);
  }
  float v_at(int block, int tok, int head, int d) {
    const KVPoolView v = host_view();
    return load_elem(v.v, v.offset(block, tok, head) + d, dt);
  }
};

/// A batch of sequences with distinct random blocks, both page-table forms, on host and device.
struct Batch {
  std::vector<int> kv_lens;
  std::vector<std::vector<int>> pages;
  std::vector<std::int32_t> indptr, indices, last_page_len, block_tables, seq_lens;
  int max_blocks = 0;
  DevBuf d_indptr, d_indices, d_last, d_tables, d_lens;

  Batch(Rng& r, Pool& pool, const std::vector<int>& lens) : kv_lens(lens) {
    const int bs = pool.block_size;
    std::vector<int> ids(static_cast<std::size_t>(pool.num_blocks - 1));
    std::iota(ids.begin(), ids.end(), 1);  // block 0 is the null block
    std::shuffle(ids.begin(), ids.end(), r.gen);
    std::size_t next = 0;
    indptr.push_back(0);
    for (int len : lens) {
      const int np = (len + bs - 1) / bs;
      std::vector<int> pg;
      for (int i = 0; i < np; ++i) {
        REQUIRE(next < ids.size());
        pg.push_back(ids[next++]);
      }
      max_blocks = std::max(max_blocks, np);
      indices.insert(indices.end(), pg.begin(), pg.end());
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last_page_len.push_back(np == 0 ? 1 : len - (np - 1) * bs);
      seq_lens.push_back(len);
      pages.push_back(std::move(pg));
    }
    max_blocks = std::max(max_blocks, 1);
    block_tables.assign(lens.size() * static_cast<std::size_t>(max_blocks), 0);
    for (std::size_t b = 0; b < lens.size(); ++b) {
      for (std::size_t i = 0; i < pages[b].size(); ++i) block_tables[b * max_blocks + i] = pages[b][i];
    }
    if (indices.empty()) indices.push_back(0);
    d_indptr = DevBuf::from(indptr);
    d_indices = DevBuf::from(indices);
    d_last = DevBuf::from(last_page_len);
    d_tables = DevBuf::from(block_tables);
    d_lens = DevBuf::from(seq_lens);
    // Random K/V for every listed token; everything else in the pool stays NaN.
    const KVPoolView hv = pool.host_view();
    for (std::size_t b = 0; b < lens.size(); ++b) {
      for (int t = 0; t < lens[b]; ++t) {
        for (int h = 0; h < pool.heads; ++h) {
          const std::int64_t off = hv.offset(pages[b][t / bs], t % bs, h);
          for (int d = 0; d < pool.head_dim; ++d) {
            store_elem(hv.k, off + d, pool.dt, r.uniform());
            store_elem(hv.v, off + d, pool.dt, r.uniform());
          }
        }
      }
    }
    pool.upload();
  }
  int batch() const { return static_cast<int>(kv_lens.size()); }
  PageTable host_table(PageTableFormat f) const {
    return f == PageTableFormat::kCsr
               ? PageTable::csr(batch(), indptr.data(), indices.data(), last_page_len.data())
               : PageTable::padded(batch(), block_tables.data(), max_blocks, seq_lens.data());
  }
  PageTable dev_table(PageTableFormat f) const {
    return f == PageTableFormat::kCsr
               ? PageTable::csr(batch(), d_indptr.as<std::int32_t>(), d_indices.as<std::int32_t>(),
                                d_last.as<std::int32_t>())
               : PageTable::padded(batch(), d_tables.as<std::int32_t>(), max_blocks, d_lens.as<std::int32_t>());
  }
};

/// Max over rows of (max |got - ref| / max |ref|) for rows of `dim` values; NaN/inf in got gives +inf.
inline double row_rel_error(const std::vector<float>& got, const std::vector<double>& ref, std::int64_t dim) {
  double worst = 0.0;
  for (std::size_t r0 = 0; r0 < ref.size(); r0 += static_cast<std::size_t>(dim)) {
    double err = 0.0;
    double mag = 0.0;
    for (std::int64_t d = 0; d < dim; ++d) {
      const double g = got[r0 + d];
      if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
      err = std::max(err, std::abs(g - ref[r0 + d]));
      mag = std::max(mag, std::abs(ref[r0 + d]));
    }
    const double rel = mag > 0 ? err / mag : (err == 0 ? 0.0 : std::numeric_limits<double>::infinity());
    worst = std::max(worst, rel);
  }
  return worst;
}

/// Tolerance on o (docs/contract.md section 4): 1e-5 fp32, 1e-2 fp16/bf16.
/// Row-relative error bound of an attention output vs the float64 oracle. bf16 / fp16: 1e-2 (the output's own
/// rounding plus bf16 probabilities). fp32: 1e-5 for logits of order 1; with q drawn from [-q_scale, q_scale) the
/// logits grow with q_scale (about +-100 at 64, head_dim 128) and so does the absolute error of each exponent's
/// argument (a few fp32 roundings of |logit| * 2^-24), hence 1e-5 * max(1, q_scale / 16). Measured on an H100
/// (2026-11-27): prefill fp32 head_dim 128 at q_scale 64 gave 1.32e-5 vs the oracle, 2.26e-5 vs the CPU reference.
inline double o_tolerance(DType dt, float q_scale = 1.f) {
  return dt == DType::kFloat32 ? 1e-5 * std::max(1.0, static_cast<double>(q_scale) / 16.0) : 1e-2;
}

/// Checks lse against the oracle: -inf exactly where expected, else |err| <= 1e-4 * max(1, |ref|).
inline bool lse_ok(const std::vector<float>& got, const std::vector<double>& ref, std::string* why) {
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i])) {
      if (!(std::isinf(got[i]) && got[i] < 0)) {
        *why = "lse[" + std::to_string(i) + "] = " + std::to_string(got[i]) + ", want -inf";
        return false;
      }
      continue;
    }
    if (!(std::abs(got[i] - ref[i]) <= 1e-4 * std::max(1.0, std::abs(ref[i])))) {
      *why = "lse[" + std::to_string(i) + "] = " + std::to_string(got[i]) + ", want " + std::to_string(ref[i]);
      return false;
    }
  }
  return true;
}

/// Runs f(i) for i in [0, n) on up to hardware_concurrency threads (the float64 oracles: host time per case).
template <class F>
void parallel_for(std::int64_t n, F&& f) {
  const std::int64_t threads = std::clamp<std::int64_t>(std::thread::hardware_concurrency(), 1, 16);
  if (n < 8 || threads == 1) {
    for (std::int64_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::vector<std::thread> pool;
  const std::int64_t per = (n + threads - 1) / threads;
  for (std::int64_t t = 0; t < threads && t * per < n; ++t) {
    pool.emplace_back([&f, t, per, n] {
      for (std::int64_t i = t * per; i < std::min(n, (t + 1) * per); ++i) f(i);
    });
  }
  for (auto& th : pool) th.join();
}

inline std::vector<float> to_floats(const Tensor& t) {
  std::vector<float> out(static_cast<std::size_t>(t.n));
  for (std::int64_t i = 0; i < t.n; ++i) out[static_cast<std::size_t>(i)] = t.at(i);
  return out;
}

}  // namespace pkt
