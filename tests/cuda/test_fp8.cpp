// tests/cuda/test_fp8.cpp: fp8 e4m3 KV pools (KVDType::kFp8E4M3) on the GPU, and the launchers' error details.
//  - [fp8][write_kv]: the quantized bytes equal the CPU reference's bit for bit (dtypes x head dims x block sizes,
//    NHD and HND, inputs spanning saturation (|x / scale| > 448), subnormals and ties; the pool is pre-filled with
//    the NaN code 0xff so a byte the kernel wrongly skips or writes shows).
//  - [fp8][copy_blocks], [fp8][swap_blocks]: fp8 pools move byte for byte as the reference moves them.
//  - [fp8][decode], [fp8][prefill]: outputs within 1e-2 relative error (per row, of the row's max |o|) of a
//    float64 oracle on the dequantized K/V (e4m3 code x scale), outputs poisoned (NaN) before each run, unused slots
//    NaN codes; decode through the chunk rule (with and without split) and a plan_decode work list.
//  - [fp8][sanitize]: one small case per fp8 kernel for compute-sanitizer.
//  - [host][detail]: every launcher's StatusDetail names the failed field and value (no device needed).
#include "gpu_test_util.hpp"

#include <functional>

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/reference/copy_blocks.hpp>
#include <pagedkv/reference/decode.hpp>
#include <pagedkv/reference/prefill.hpp>
#include <pagedkv/reference/swap_blocks.hpp>
#include <pagedkv/reference/write_kv.hpp>

namespace {

using namespace pkt;
using pagedkv::CopyBlocksParams;
using pagedkv::DecodeParams;
using pagedkv::KVDType;
using pagedkv::PrefillParams;
using pagedkv::SwapBlocksParams;
using pagedkv::WriteKVParams;
namespace ref = pagedkv::reference;

constexpr DType kFp8DTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

/// An interleaved fp8 pool `[nb, 2, bs, heads, hd]` (NHD) or `[nb, 2, heads, bs, hd]` (HND) of 1-byte codes, host
/// copy and device copy.
struct Fp8Pool {
  int nb, bs, heads, hd;
  bool hnd;
  float k_scale, v_scale;
  std::vector<unsigned char> host;
  DevBuf dev;
  Fp8Pool(int nb_, int bs_, int heads_, int hd_, bool hnd_, float ks, float vs)
      : nb(nb_), bs(bs_), heads(heads_), hd(hd_), hnd(hnd_), k_scale(ks), v_scale(vs),
        host(static_cast<std::size_t>(nb_) * 2 * bs_ * heads_ * hd_, 0xff), dev(host.size()) {}
  KVPoolView view(void* base) const {
    return hnd ? KVPoolView::hnd(base, DType::kFloat16, nb, bs, heads, hd, KVDType::kFp8E4M3, k_scale, v_scale)
               : KVPoolView::nhd(base, DType::kFloat16, nb, bs, heads, hd, KVDType::kFp8E4M3, k_scale, v_scale);
  }
  KVPoolView host_view(DType dt) {
    KVPoolView v = view(host.data());
    v.dtype = dt;
    return v;
  }
  KVPoolView dev_view(DType dt) const {
    KVPoolView v = view(dev.get());
    v.dtype = dt;
    return v;
  }
  void upload() { dev.upload(host.data(), host.size()); }
  std::vector<unsigned char> download() const {
    std::vector<unsigned char> out(host.size());
    dev.download(out.data(), out.size());
    return out;
  }
  /// Random non-NaN codes everywhere.
  void randomize(Rng& r) {
    for (auto& b : host) {
      int c = r.range(0, 255);
      if ((c & 0x7f) == 0x7f) c ^= 0x01;
      b = static_cast<unsigned char>(c);
    }
  }
};

/// Values for write_kv inputs: mostly in [-2, 2) x scale, some beyond the e4m3 range (saturate), some tiny.
float fp8_input(Rng& r, float scale) {
  const int kind = r.range(0, 9);
  if (kind == 0) return r.uniform() * 1000.f * scale;  // |x / scale| up to 1000: saturates past 448
  if (kind == 1) return r.uniform() * 0x1p-8f * scale;  // subnormal e4m3 range
  return r.uniform() * 2.f * scale;
}

/// float64 attention of q (one row) over keys [lo, hi) of a sequence whose token t lives at (block ids[t / bs],
/// t % bs), head kvh, on the dequantized fp8 pool `view` (host).
void oracle(const KVPoolView& view, const std::vector<std::int32_t>& ids, int kvh, const float* q, int lo, int hi,
            double scale, double* o, double* lse) {
  const int hd = view.head_dim;
  const auto* k = static_cast<const unsigned char*>(view.k);
  const auto* v = static_cast<const unsigned char*>(view.v);
  for (int d = 0; d < hd; ++d) o[d] = 0.0;
  if (hi <= lo) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  std::vector<double> s(static_cast<std::size_t>(hi - lo));
  double m = -std::numeric_limits<double>::infinity();
  for (int t = lo; t < hi; ++t) {
    const std::int64_t off = view.offset(ids[static_cast<std::size_t>(t / view.block_size)], t % view.block_size, kvh);
    double acc = 0.0;
    for (int d = 0; d < hd; ++d) {
      acc += static_cast<double>(q[d]) * ref::fp8_e4m3_bits_to_float(k[off + d]) * static_cast<double>(view.k_scale);
    }
    s[static_cast<std::size_t>(t - lo)] = acc * scale;
    m = std::max(m, s[static_cast<std::size_t>(t - lo)]);
  }
  double den = 0.0;
  for (int t = lo; t < hi; ++t) {
    const double w = std::exp(s[static_cast<std::size_t>(t - lo)] - m);
    den += w;
    const std::int64_t off = view.offset(ids[static_cast<std::size_t>(t / view.block_size)], t % view.block_size, kvh);
    for (int d = 0; d < hd; ++d) {
      o[d] += w * ref::fp8_e4m3_bits_to_float(v[off + d]) * static_cast<double>(view.v_scale);
    }
  }
  for (int d = 0; d < hd; ++d) o[d] /= den;
  *lse = m + std::log(den);
}

/// A CSR page table over blocks 1..nb-1 (block 0 is the null block), sequence lengths `lens`.
struct Pages {
  std::vector<std::int32_t> indptr{0}, indices, last;
  std::vector<std::vector<std::int32_t>> ids;  // per sequence
  Pages(const std::vector<int>& lens, int bs, int nb, Rng& r) {
    std::vector<std::int32_t> free;
    for (int b = 1; b < nb; ++b) free.push_back(b);
    std::shuffle(free.begin(), free.end(), r.gen);
    std::size_t next = 0;
    for (int len : lens) {
      const int pages = (len + bs - 1) / bs;
      ids.emplace_back();
      for (int i = 0; i < pages; ++i) {
        REQUIRE(next < free.size());
        indices.push_back(free[next]);
        ids.back().push_back(free[next++]);
      }
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(len == 0 ? 1 : len - (pages - 1) * bs);
    }
  }
};

/// Runs one fp8 decode (chunk rule with max_num_chunks `chunks`, or a plan when `plan`) and one prefill on the GPU
/// and checks them against the float64 oracle. Returns nothing; CHECKs inside.
void check_attention(DType dt, int hd, int bs, int group, bool hnd, int chunks, bool plan, std::uint64_t seed,
                     bool small, bool long_seqs = false) {
  INFO(dtype_name(dt) << " hd=" << hd << " bs=" << bs << " group=" << group << (hnd ? " HND" : " NHD")
                      << " chunks=" << chunks << (plan ? " plan" : " chunk-rule"));
  Rng r(seed);
  const int kv_heads = 2;
  const int hq = kv_heads * group;
  const std::vector<int> lens = small       ? std::vector<int>{5, 17}
                                : long_seqs ? std::vector<int>{1, 40, 0, 129, 700, 1500, 4100}
                                            : std::vector<int>{1, 40, 0, 129, 77};
  const int batch = static_cast<int>(lens.size());
  int total_pages = 0;
  for (int len : lens) total_pages += (len + bs - 1) / bs;
  const int nb = total_pages + 3;
  Fp8Pool pool(nb, bs, kv_heads, hd, hnd, 0.05f, 0.125f);
  pool.randomize(r);
  // Unused slots of each sequence's last page and the unused blocks hold the NaN code: never read.
  Pages pg(lens, bs, nb, r);
  for (int b = 0; b < batch; ++b) {
    const int len = lens[static_cast<std::size_t>(b)];
    for (int t = len; t < static_cast<int>(pg.ids[static_cast<std::size_t>(b)].size()) * bs; ++t) {
      const KVPoolView hv = pool.host_view(dt);
      for (int h = 0; h < kv_heads; ++h) {
        const std::int64_t off = hv.offset(pg.ids[static_cast<std::size_t>(b)][static_cast<std::size_t>(t / bs)], t % bs, h);
        for (int d = 0; d < hd; ++d) {
          pool.host[static_cast<std::size_t>(off + d)] = 0x7f;
          static_cast<unsigned char*>(hv.v)[off + d] = 0xff;
        }
      }
    }
  }
  pool.upload();
  const KVPoolView hv = pool.host_view(dt);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  DevBuf d_indptr = DevBuf::from(pg.indptr), d_indices = DevBuf::from(pg.indices), d_last = DevBuf::from(pg.last);
  const PageTable dpt = PageTable::csr(batch, d_indptr.as<std::int32_t>(), d_indices.as<std::int32_t>(),
                                       d_last.as<std::int32_t>());

  // ---- decode ----
  {
    Tensor q(dt, std::int64_t{batch} * hq * hd);
    q.randomize(r);
    Tensor o(dt, std::int64_t{batch} * hq * hd);
    o.dev.poison();
    DevBuf lse(sizeof(float) * batch * hq);
    lse.poison();
    DecodeParams p;
    p.q = q.dev.get();
    p.o = o.dev.get();
    p.lse = lse.as<float>();
    p.kv = pool.dev_view(dt);
    p.pages = dpt;
    p.num_qo_heads = hq;
    p.sm_scale = static_cast<float>(scale);
    DevBuf ws;
    DevBuf d_items, d_merges;
    if (plan) {
      pagedkv::DecodePlanConfig cfg;
      REQUIRE(pagedkv::cuda::decode_plan_config(0, dt, hd, hq, kv_heads, &cfg) == Status::kSuccess);
      cfg.num_sms = 2;  // a tiny device forces splits on the longer sequences
      cfg.min_chunk_tokens = 16;
      std::vector<std::int32_t> lens32(lens.begin(), lens.end());
      const pagedkv::DecodePlanCapacity cap = pagedkv::decode_plan_capacity(batch, cfg);
      std::vector<pagedkv::DecodeWorkItem> items(static_cast<std::size_t>(cap.items));
      std::vector<pagedkv::DecodeMergeItem> merges(static_cast<std::size_t>(std::max(cap.merges, 1)));
      pagedkv::DecodePlanInfo info;
      REQUIRE(pagedkv::plan_decode(lens32, cfg, {items, merges, cap.partial_rows}, &info) == Status::kSuccess);
      d_items = DevBuf::from(items);
      d_merges = DevBuf::from(merges);
      ws = DevBuf(std::max<std::size_t>(pagedkv::decode_plan_workspace_bytes(cap.partial_rows, hq, hd), 16));
      p.workspace = ws.get();
      p.workspace_bytes = ws.bytes();
      const pagedkv::DecodeWorkList wl = info.work_list.relocated(d_items.as<pagedkv::DecodeWorkItem>(),
                                                                  d_merges.as<pagedkv::DecodeMergeItem>());
      REQUIRE(pagedkv::cuda::decode(p, wl) == Status::kSuccess);
    } else {
      p.max_num_chunks = chunks;
      if (chunks >= 2) {
        ws = DevBuf(pagedkv::decode_workspace_bytes(batch, chunks, hq, hd));
        p.workspace = ws.get();
        p.workspace_bytes = ws.bytes();
      }
      REQUIRE(pagedkv::cuda::decode(p) == Status::kSuccess);
    }
    PKT_CUDA(cudaDeviceSynchronize());
    o.fetch();
    std::vector<float> got_lse(static_cast<std::size_t>(batch) * hq);
    lse.download(got_lse.data(), got_lse.size() * sizeof(float));
    std::vector<double> want(static_cast<std::size_t>(batch) * hq * hd), want_lse(static_cast<std::size_t>(batch) * hq);
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < hq; ++h) {
        const std::size_t row = static_cast<std::size_t>(b) * hq + h;
        std::vector<float> qf(static_cast<std::size_t>(hd));
        for (int d = 0; d < hd; ++d) qf[static_cast<std::size_t>(d)] = q.at(static_cast<std::int64_t>(row) * hd + d);
        oracle(hv, pg.ids[static_cast<std::size_t>(b)], h / group, qf.data(), 0, lens[static_cast<std::size_t>(b)],
               scale, want.data() + row * hd, &want_lse[row]);
      }
    }
    const double err = row_rel_error(to_floats(o), want, hd);
    INFO("decode max row rel err " << err);
    CHECK(err <= 1e-2);
    std::string why;
    CHECK(lse_ok(got_lse, want_lse, &why));
    INFO(why);
  }

  // ---- prefill: the last q_len_b tokens of each sequence are queries ----
  {
    std::vector<std::int32_t> qo{0};
    for (int len : lens) qo.push_back(qo.back() + std::min(len, small ? 3 : 33));
    const int total = qo.back();
    Tensor q(dt, std::int64_t{total} * hq * hd);
    q.randomize(r);
    Tensor o(dt, std::int64_t{total} * hq * hd);
    o.dev.poison();
    DevBuf d_qo = DevBuf::from(qo);
    PrefillParams p;
    p.q = q.dev.get();
    p.o = o.dev.get();
    p.qo_indptr = d_qo.as<std::int32_t>();
    p.total_q_tokens = total;
    p.kv = pool.dev_view(dt);
    p.pages = dpt;
    p.num_qo_heads = hq;
    p.sm_scale = static_cast<float>(scale);
    REQUIRE(pagedkv::cuda::prefill(p) == Status::kSuccess);
    PKT_CUDA(cudaDeviceSynchronize());
    o.fetch();
    std::vector<double> want(static_cast<std::size_t>(total) * hq * hd);
    double lse_unused = 0;
    for (int b = 0; b < batch; ++b) {
      const int len = lens[static_cast<std::size_t>(b)];
      const int ql = qo[static_cast<std::size_t>(b) + 1] - qo[static_cast<std::size_t>(b)];
      for (int i = 0; i < ql; ++i) {
        for (int h = 0; h < hq; ++h) {
          const std::size_t row = static_cast<std::size_t>(qo[static_cast<std::size_t>(b)] + i) * hq + h;
          std::vector<float> qf(static_cast<std::size_t>(hd));
          for (int d = 0; d < hd; ++d) qf[static_cast<std::size_t>(d)] = q.at(static_cast<std::int64_t>(row) * hd + d);
          oracle(hv, pg.ids[static_cast<std::size_t>(b)], h / group, qf.data(), 0, len - ql + i + 1, scale,
                 want.data() + row * hd, &lse_unused);
        }
      }
    }
    const double err = row_rel_error(to_floats(o), want, hd);
    INFO("prefill max row rel err " << err);
    CHECK(err <= 1e-2);
  }
}

/// write_kv into an fp8 pool on the GPU and in the reference from the same inputs; every pool byte compared.
void check_write_kv(DType dt, int hd, int bs, bool hnd, int n, std::uint64_t seed) {
  INFO(dtype_name(dt) << " hd=" << hd << " bs=" << bs << (hnd ? " HND" : " NHD") << " n=" << n);
  Rng r(seed);
  const int heads = 2;
  const int nb = (n + bs - 1) / bs + 2;
  Fp8Pool gpu(nb, bs, heads, hd, hnd, 0.02f, 0.3f);
  gpu.upload();  // all 0xff (NaN codes)
  Fp8Pool cpu(nb, bs, heads, hd, hnd, 0.02f, 0.3f);
  const std::int64_t row = std::int64_t{heads} * hd;
  Tensor key(dt, n * row), value(dt, n * row);
  for (std::int64_t i = 0; i < n * row; ++i) {
    store_elem(key.host.data(), i, dt, fp8_input(r, gpu.k_scale));
    store_elem(value.host.data(), i, dt, fp8_input(r, gpu.v_scale));
  }
  key.dev.upload(key.host.data(), key.host.size());
  value.dev.upload(value.host.data(), value.host.size());
  std::vector<std::int64_t> slots(static_cast<std::size_t>(n));
  std::vector<std::int64_t> all(static_cast<std::size_t>(nb - 1) * bs);
  std::iota(all.begin(), all.end(), std::int64_t{bs});
  std::shuffle(all.begin(), all.end(), r.gen);
  for (int i = 0; i < n; ++i) slots[static_cast<std::size_t>(i)] = i % 5 == 2 ? -1 : all[static_cast<std::size_t>(i)];
  DevBuf d_slots = DevBuf::from(slots);
  WriteKVParams p;
  p.key = key.dev.get();
  p.value = value.dev.get();
  p.slot_mapping = d_slots.as<std::int64_t>();
  p.num_tokens = n;
  p.kv = gpu.dev_view(dt);
  REQUIRE(pagedkv::cuda::write_kv(p) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  WriteKVParams hp = p;
  hp.key = key.host.data();
  hp.value = value.host.data();
  hp.slot_mapping = slots.data();
  hp.kv = cpu.host_view(dt);
  REQUIRE(ref::write_kv(hp) == Status::kSuccess);
  const std::vector<unsigned char> got = gpu.download();
  std::size_t diffs = 0, first = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != cpu.host[i] && diffs++ == 0) first = i;
  }
  INFO("bytes differing: " << diffs << ", first at " << first);
  CHECK(diffs == 0);
}

}  // namespace

TEST_CASE("fp8 write_kv quantizes bit for bit like the reference (saturation, subnormals, ties)", "[fp8][write_kv]") {
  std::uint64_t seed = 500;
  for (DType dt : kFp8DTypes) {
    for (int hd : {64, 128, 256}) {
      for (int bs : {1, 16, 32}) {
        check_write_kv(dt, hd, bs, (seed & 1) != 0, 70, seed);
        ++seed;
      }
    }
  }
}

TEST_CASE("fp8 copy_blocks and swap_blocks move fp8 pools byte for byte", "[fp8][copy_blocks][swap_blocks]") {
  Rng r(900);
  for (int hd : {64, 256}) {
    for (bool hnd : {false, true}) {
      INFO("hd=" << hd << (hnd ? " HND" : " NHD"));
      Fp8Pool a(12, 16, 2, hd, hnd, 0.5f, 0.25f);
      a.randomize(r);
      a.upload();
      std::vector<std::int32_t> map{1, 7, -1, -1, 3, 8, 4, 9};
      DevBuf d_map = DevBuf::from(map);
      const KVPoolView layer = a.dev_view(DType::kBFloat16);
      CopyBlocksParams c{&layer, 1, d_map.as<std::int32_t>(), 4};
      REQUIRE(pagedkv::cuda::copy_blocks(c) == Status::kSuccess);
      PKT_CUDA(cudaDeviceSynchronize());
      const KVPoolView hlayer = a.host_view(DType::kBFloat16);
      CopyBlocksParams hc{&hlayer, 1, map.data(), 4};
      REQUIRE(ref::copy_blocks(hc) == Status::kSuccess);
      CHECK(a.download() == a.host);

      // swap device -> pinned host and back
      void* pinned = nullptr;
      PKT_CUDA(cudaHostAlloc(&pinned, a.host.size(), cudaHostAllocDefault));
      std::memset(pinned, 0xff, a.host.size());
      std::vector<unsigned char> cpu_dst(a.host.size(), 0xff);
      const KVPoolView dst = a.view(pinned);
      KVPoolView dst_bf = dst;
      dst_bf.dtype = DType::kBFloat16;
      const std::vector<std::int32_t> pairs{2, 5, 3, 6, -1, 0, 9, 1};
      SwapBlocksParams s;
      s.src_layers = &layer;
      s.dst_layers = &dst_bf;
      s.num_layers = 1;
      s.block_mapping = pairs.data();
      s.num_pairs = 4;
      REQUIRE(pagedkv::cuda::swap_blocks(s) == Status::kSuccess);
      PKT_CUDA(cudaDeviceSynchronize());
      KVPoolView cdst = a.view(cpu_dst.data());
      cdst.dtype = DType::kBFloat16;
      SwapBlocksParams hs = s;
      hs.src_layers = &hlayer;
      hs.dst_layers = &cdst;
      REQUIRE(ref::swap_blocks(hs) == Status::kSuccess);
      CHECK(std::memcmp(pinned, cpu_dst.data(), cpu_dst.size()) == 0);
      (void)cudaFreeHost(pinned);
    }
  }
}

TEST_CASE("fp8 decode and prefill match float64 on the dequantized K/V within 1e-2", "[fp8][decode][prefill]") {
  std::uint64_t seed = 1000;
  for (DType dt : kFp8DTypes) {
    for (int hd : {64, 128, 256}) {
      for (int group : {1, 4}) {
        const int bs = hd == 128 ? 16 : 8;
        check_attention(dt, hd, bs, group, (seed & 1) != 0, 1, false, seed, false);
        ++seed;
        check_attention(dt, hd, bs, group, (seed & 1) != 0, 4, false, seed, false);
        ++seed;
        check_attention(dt, hd, bs, group, (seed & 1) != 0, 0, true, seed, false);
        ++seed;
      }
    }
  }
}

// Above 129 tokens (the grid above stops there): 700 / 1500 / 4100-token sequences, chunk rule and the real plan,
// tensor-core (fp16 / bf16 x 64 / 128) and CUDA-core (fp32, head_dim 256) decode over fp8 pools.
TEST_CASE("fp8 decode and prefill above 129 tokens", "[fp8][decode][prefill]") {
  std::uint64_t seed = 1300;
  for (DType dt : kFp8DTypes) {
    for (int hd : {64, 128, 256}) {
      const int bs = hd == 64 ? 32 : 16;
      check_attention(dt, hd, bs, 4, (seed & 1) != 0, 4, false, seed, false, true);
      ++seed;
      check_attention(dt, hd, bs, 4, (seed & 1) != 0, 0, true, seed, false, true);
      ++seed;
    }
  }
}

TEST_CASE("fp8 kernels on a reduced grid, for compute-sanitizer", "[fp8][sanitize]") {
  // One small case per fp8 kernel: write_kv_fp8, decode (+ merge, split), decode via a plan, prefill, copy_blocks.
  check_write_kv(DType::kFloat16, 64, 16, false, 9, 7);
  check_attention(DType::kBFloat16, 64, 16, 2, true, 2, false, 8, true);
  check_attention(DType::kFloat32, 128, 8, 1, false, 0, true, 9, true);
  Rng r(10);
  Fp8Pool a(4, 8, 1, 64, false, 1.f, 1.f);
  a.randomize(r);
  a.upload();
  const std::vector<std::int32_t> map{1, 2};
  DevBuf d_map = DevBuf::from(map);
  const KVPoolView layer = a.dev_view(DType::kFloat16);
  REQUIRE(pagedkv::cuda::copy_blocks(CopyBlocksParams{&layer, 1, d_map.as<std::int32_t>(), 1}) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
}

// ---- host-only: launcher validation of fp8 pools and the error details (no device needed) ----

namespace {
void* fake(std::uintptr_t a = 0x10000) { return reinterpret_cast<void*>(a); }  // never dereferenced

/// Runs `call`, checks the status, the detail's field and that the message holds `value`.
template <class F>
void expect_detail(F&& call, Status want, const char* field, const char* value) {
  const Status s = call();
  const pagedkv::StatusDetail& d = pagedkv::last_status_detail();
  INFO("detail: " << d.message);
  CHECK(std::string(pagedkv::to_string(s)) == pagedkv::to_string(want));
  CHECK(d.status == want);
  CHECK(std::string(d.field) == field);
  CHECK(std::string(d.message).find(value) != std::string::npos);
}
}  // namespace

TEST_CASE("CUDA launchers accept fp8 pools and validate their scales", "[host][validation][fp8]") {
  const auto* i32 = static_cast<const std::int32_t*>(fake(0x20000));
  KVPoolView fp8 = KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 128, KVDType::kFp8E4M3, 0.01f, 0.02f);
  DecodeParams d;
  d.q = fake();
  d.o = fake();
  d.kv = fp8;
  d.pages = PageTable::csr(0, i32, i32, i32);  // batch 0: validated, nothing launched
  d.num_qo_heads = 32;
  d.sm_scale = 0.088f;
  CHECK(pagedkv::cuda::decode(d) == Status::kSuccess);
  PrefillParams p;
  p.q = d.q;
  p.o = d.o;
  p.kv = fp8;
  p.pages = d.pages;
  p.num_qo_heads = 32;
  p.sm_scale = 0.088f;
  CHECK(pagedkv::cuda::prefill(p) == Status::kSuccess);
  WriteKVParams w;
  w.kv = fp8;
  CHECK(pagedkv::cuda::write_kv(w) == Status::kSuccess);
  CopyBlocksParams c{&fp8, 1, i32, 0};
  CHECK(pagedkv::cuda::copy_blocks(c) == Status::kSuccess);
  DecodeParams bad = d;
  bad.kv.v_scale = std::numeric_limits<float>::infinity();
  expect_detail([&] { return pagedkv::cuda::decode(bad); }, Status::kInvalidValue, "kv.v_scale", "inf");
  w.kv.k_scale = -1.f;
  expect_detail([&] { return pagedkv::cuda::write_kv(w); }, Status::kInvalidValue, "kv.k_scale", "-1");
}

TEST_CASE("CUDA launchers name the failed check, the field and the bad value", "[host][validation][detail]") {
  const auto* i32 = static_cast<const std::int32_t*>(fake(0x20000));
  DecodeParams d;
  d.q = fake();
  d.o = fake();
  d.kv = KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 128);
  d.pages = PageTable::csr(4, i32, i32, i32);
  d.num_qo_heads = 32;
  d.sm_scale = 0.088f;
  struct Case {
    const char* what;
    std::function<void(DecodeParams&)> mutate;
    Status want;
    const char* field;
    const char* value;
  };
  const std::vector<Case> decode_cases = {
      {"sm_scale 0", [](DecodeParams& x) { x.sm_scale = 0.f; }, Status::kInvalidValue, "sm_scale", "= 0"},
      {"sm_scale negative", [](DecodeParams& x) { x.sm_scale = -2.f; }, Status::kInvalidValue, "sm_scale", "-2"},
      {"sm_scale NaN", [](DecodeParams& x) { x.sm_scale = std::numeric_limits<float>::quiet_NaN(); },
       Status::kInvalidValue, "sm_scale", "nan"},
      {"block_size 2^31 - 1", [](DecodeParams& x) { x.kv.block_size = std::numeric_limits<std::int32_t>::max(); },
       Status::kInvalidValue, "kv.block_size", "2147483647"},
      {"block_size 0", [](DecodeParams& x) { x.kv.block_size = 0; }, Status::kInvalidValue, "kv.block_size", "= 0"},
      {"null k", [](DecodeParams& x) { x.kv.k = nullptr; }, Status::kInvalidValue, "kv.k", "null"},
      {"overlapping strides", [](DecodeParams& x) { x.kv.stride_head = 100; }, Status::kInvalidValue,
       "kv.stride_token", "stride_head = 100"},
      {"heads", [](DecodeParams& x) { x.num_qo_heads = 30; }, Status::kInvalidValue, "num_qo_heads", "= 30"},
      {"window", [](DecodeParams& x) { x.window.attention_chunk_tokens = -8; }, Status::kInvalidValue,
       "window.attention_chunk_tokens", "-8"},
      {"null indptr", [](DecodeParams& x) { x.pages.indptr = nullptr; }, Status::kInvalidValue, "pages.indptr",
       "null"},
      {"null q", [](DecodeParams& x) { x.q = nullptr; }, Status::kInvalidValue, "q", "null"},
      {"misaligned o", [](DecodeParams& x) { x.o = fake(0x10008); }, Status::kInvalidValue, "o", "16-byte"},
      {"head_dim 96", [](DecodeParams& x) { x.kv = KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 96); },
       Status::kUnsupported, "kv.head_dim", "= 96"},
      {"dtype 7", [](DecodeParams& x) { x.kv.dtype = static_cast<DType>(7); }, Status::kUnsupported, "kv.dtype",
       "= 7"},
      {"chunks 70000", [](DecodeParams& x) { x.max_num_chunks = 70000; }, Status::kInvalidValue, "max_num_chunks",
       "70000"},
      {"split without workspace", [](DecodeParams& x) { x.max_num_chunks = 8; }, Status::kInvalidValue, "workspace",
       "null"},
      {"workspace too small",
       [](DecodeParams& x) {
         x.max_num_chunks = 8;
         x.workspace = fake(0x80000);
         x.workspace_bytes = 100;
       },
       Status::kInvalidValue, "workspace_bytes", "= 100"},
  };
  for (const Case& c : decode_cases) {
    INFO(c.what);
    DecodeParams x = d;
    c.mutate(x);
    expect_detail([&] { return pagedkv::cuda::decode(x); }, c.want, c.field, c.value);
  }
  SECTION("work list") {
    pagedkv::DecodeWorkList wl;
    wl.items = static_cast<const pagedkv::DecodeWorkItem*>(fake(0x90008));  // misaligned
    wl.item_capacity = 4;
    wl.heads_per_tile = 4;
    expect_detail([&] { return pagedkv::cuda::decode(d, wl); }, Status::kInvalidValue, "work_list.items", "16-byte");
    wl.items = static_cast<const pagedkv::DecodeWorkItem*>(fake(0x90000));
    wl.heads_per_tile = 9;
    expect_detail([&] { return pagedkv::cuda::decode(d, wl); }, Status::kInvalidValue, "work_list.heads_per_tile",
                  "= 9");
  }
  SECTION("prefill") {
    PrefillParams p;
    p.q = d.q;
    p.o = d.o;
    p.kv = d.kv;
    p.pages = d.pages;
    p.num_qo_heads = 32;
    p.sm_scale = 0.f;
    p.total_q_tokens = 10;
    p.qo_indptr = i32;
    expect_detail([&] { return pagedkv::cuda::prefill(p); }, Status::kInvalidValue, "sm_scale", "= 0");
    p.sm_scale = 0.1f;
    p.qo_indptr = nullptr;
    expect_detail([&] { return pagedkv::cuda::prefill(p); }, Status::kInvalidValue, "qo_indptr", "null");
    p.qo_indptr = i32;
    p.total_q_tokens = -3;
    expect_detail([&] { return pagedkv::cuda::prefill(p); }, Status::kInvalidValue, "total_q_tokens", "-3");
    p.total_q_tokens = 10;
    p.num_qo_heads = 8 * 9000;
    expect_detail([&] { return pagedkv::cuda::prefill(p); }, Status::kInvalidValue, "num_qo_heads", "72000");
  }
  SECTION("write_kv, copy_blocks, swap_blocks") {
    WriteKVParams w;
    w.kv = d.kv;
    w.num_tokens = 3;
    expect_detail([&] { return pagedkv::cuda::write_kv(w); }, Status::kInvalidValue, "key", "null");
    w.num_tokens = -1;
    expect_detail([&] { return pagedkv::cuda::write_kv(w); }, Status::kInvalidValue, "num_tokens", "-1");
    w.num_tokens = 0;
    w.stride_token_elems = 5;
    expect_detail([&] { return pagedkv::cuda::write_kv(w); }, Status::kInvalidValue, "stride_token_elems", "= 5");
    w.stride_token_elems = 0;
    w.kv.block_size = 1 << 20;
    expect_detail([&] { return pagedkv::cuda::write_kv(w); }, Status::kInvalidValue, "kv.block_size", "1048576");

    KVPoolView layers[2] = {d.kv, d.kv};
    layers[1].stride_page += 64;
    CopyBlocksParams c{layers, 2, i32, 4};
    expect_detail([&] { return pagedkv::cuda::copy_blocks(c); }, Status::kInvalidValue, "layers", "[1]");
    layers[1] = d.kv;
    layers[1].num_kv_heads = 0;
    expect_detail([&] { return pagedkv::cuda::copy_blocks(c); }, Status::kInvalidValue, "kv.num_kv_heads",
                  "layers[1].kv.num_kv_heads = 0");

    const std::int32_t bad_map[4] = {1, 2, 70, 1};  // src 70 >= num_blocks 64
    SwapBlocksParams s;
    s.src_layers = layers;
    s.dst_layers = layers;
    s.num_layers = 1;
    s.block_mapping = bad_map;
    s.num_pairs = 2;
    expect_detail([&] { return pagedkv::cuda::swap_blocks(s); }, Status::kInvalidValue, "block_mapping",
                  "[1].src = 70");
    s.num_pairs = -1;
    expect_detail([&] { return pagedkv::cuda::swap_blocks(s); }, Status::kInvalidValue, "num_pairs", "-1");
  }
}
