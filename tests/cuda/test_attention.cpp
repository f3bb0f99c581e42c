// tests/cuda/test_attention.cpp: decode and prefill kernels against a float64 oracle and the CPU reference
// (pagedkv::reference), over dtypes x head dims x GQA group sizes x block sizes (powers of two, 12/24/48, 128/256)
// x page-table forms x split-KV x layouts, with every unused pool slot NaN and outputs poisoned before each run;
// every case is launched twice and must repeat bit for bit; large-magnitude logits near fp32's exp range. Decode runs both entry points:
// the chunk rule (decode(p)) and work lists from plan_decode (decode(p, work_list)), the latter compared with the
// reference executing the very same list.
#include "gpu_test_util.hpp"

#include <pagedkv/reference/attention_check.hpp>
#include <pagedkv/reference/decode.hpp>
#include <pagedkv/reference/prefill.hpp>

namespace {

using namespace pkt;
using pagedkv::DecodeParams;
using pagedkv::PrefillParams;

struct Ref {
  std::vector<double> o, lse;
};

/// float64 attention of one query row against tokens [0, n) of sequence b (kv head kvh).
void attend(const KVPoolView& v, const Batch& bt, int b, int kvh, const float* q, int n, double scale, double* o,
            double* lse) {
  const int hd = v.head_dim;
  for (int d = 0; d < hd; ++d) o[d] = 0.0;
  if (n <= 0) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  std::vector<double> s(static_cast<std::size_t>(n));
  double m = -std::numeric_limits<double>::infinity();
  for (int t = 0; t < n; ++t) {
    const std::int64_t off = v.offset(bt.pages[b][t / v.block_size], t % v.block_size, kvh);
    double acc = 0.0;
    for (int d = 0; d < hd; ++d) acc += static_cast<double>(q[d]) * load_elem(v.k, off + d, v.dtype);
    s[t] = acc * scale;
    m = std::max(m, s[t]);
  }
  double den = 0.0;
  for (int t = 0; t < n; ++t) {
    const double w = std::exp(s[t] - m);
    den += w;
    const std::int64_t off = v.offset(bt.pages[b][t / v.block_size], t % v.block_size, kvh);
    for (int d = 0; d < hd; ++d) o[d] += w * load_elem(v.v, off + d, v.dtype);
  }
  for (int d = 0; d < hd; ++d) o[d] /= den;
  *lse = m + std::log(den);
}

/// Multiplies every element of t by f (rounded to its dtype) and uploads it again.
void scale_tensor(Tensor& t, float f) {
  if (f == 1.f) return;
  for (std::int64_t i = 0; i < t.n; ++i) store_elem(t.host.data(), i, t.dt, t.at(i) * f);
  t.dev.upload(t.host.data(), t.host.size());
}

/// Bytes of a device buffer.
std::vector<unsigned char> bytes_of(const DevBuf& b, std::size_t n) {
  std::vector<unsigned char> h(n);
  b.download(h.data(), n);
  return h;
}

struct DecodeCase {
  DType dt;
  int head_dim, group, block_size;
  PageTableFormat fmt;
  bool split;
  Layout layout;
  std::vector<int> lens;
  int kv_heads = 2;
  int chunk = 0;  // split: tokens per chunk (0 = implementation's choice)
  std::uint64_t seed = 1;
  // Work-list mode (plan_decode + cuda::decode(p, work_list)); `split` is then ignored. num_sms / ctas_per_sm: the
  // "device" the plan is made for (small values cut short sequences); 0 = the real device (decode_plan_config).
  bool plan = false;
  int plan_sms = 0;
  int plan_ctas_per_sm = 0;
  int plan_min_chunk = 256;
  int plan_heads_per_tile = 0;  // 0 = cuda::decode_heads_per_tile
  float q_scale = 1.f;          // q drawn from [-q_scale, q_scale): large values put the logits near fp32's exp range
  // The one-wrong-token check (pagedkv/reference/attention_check.hpp): probe = the first query head of every group
  // has q = 0 (uniform attention; every row is then also held to attention_row_ok); plant = an error planted in the
  // launch's page table (CSR only), which the probe rows of sequence 0 must reject.
  bool probe = false;
  enum class Plant { kNone, kWrongPage, kLastTokenMissing } plant = Plant::kNone;
};

std::string describe(const DecodeCase& c) {
  const std::string mode = c.plan ? " plan sms=" + std::to_string(c.plan_sms) + "x" + std::to_string(c.plan_ctas_per_sm) +
                                        " min_chunk=" + std::to_string(c.plan_min_chunk) +
                                        " hpt=" + std::to_string(c.plan_heads_per_tile)
                                  : (c.split ? " split chunk=" + std::to_string(c.chunk) : " nosplit");
  return std::string(dtype_name(c.dt)) + " hd=" + std::to_string(c.head_dim) + " group=" + std::to_string(c.group) +
         " bs=" + std::to_string(c.block_size) + (c.fmt == PageTableFormat::kCsr ? " csr" : " padded") + mode + " " +
         layout_name(c.layout);
}

/// A plan for `lens` copied to the device: host buffers (for the reference), device copies (for the kernel).
struct DevicePlan {
  std::vector<pagedkv::DecodeWorkItem> items;
  std::vector<pagedkv::DecodeMergeItem> merges;
  pagedkv::DecodePlanInfo info;
  DevBuf d_items, d_merges;
  pagedkv::DecodeWorkList host_list() const { return info.work_list; }
  pagedkv::DecodeWorkList device_list() const {
    return info.work_list.relocated(d_items.as<pagedkv::DecodeWorkItem>(), d_merges.as<pagedkv::DecodeMergeItem>());
  }
};

DevicePlan make_device_plan(const std::vector<int>& lens, const pagedkv::DecodePlanConfig& cfg) {
  DevicePlan dp;
  const std::vector<std::int32_t> l32(lens.begin(), lens.end());
  const auto cap = pagedkv::decode_plan_capacity(static_cast<std::int32_t>(lens.size()), cfg);
  REQUIRE(cap.items > 0);
  dp.items.resize(static_cast<std::size_t>(cap.items));
  dp.merges.resize(static_cast<std::size_t>(std::max(cap.merges, 1)));
  REQUIRE(pagedkv::plan_decode(l32, cfg, {dp.items, dp.merges, cap.partial_rows}, &dp.info) == Status::kSuccess);
  REQUIRE(pagedkv::validate_decode_work_list(l32, cfg.num_qo_heads, cfg.num_kv_heads, dp.info.work_list) ==
          Status::kSuccess);
  dp.d_items = DevBuf::from(dp.items);
  dp.d_merges = DevBuf::from(dp.merges);
  return dp;
}

/// The plan configuration for a case: the real device's, or the case's small "device".
pagedkv::DecodePlanConfig plan_config(const DecodeCase& c, int hq) {
  pagedkv::DecodePlanConfig cfg;
  REQUIRE(pagedkv::cuda::decode_plan_config(0, c.dt, c.head_dim, hq, c.kv_heads, &cfg) == Status::kSuccess);
  if (c.plan_sms > 0) cfg.num_sms = c.plan_sms;
  if (c.plan_ctas_per_sm > 0) cfg.ctas_per_sm = c.plan_ctas_per_sm;
  if (c.plan_heads_per_tile > 0) cfg.heads_per_tile = std::min(c.plan_heads_per_tile, cfg.heads_per_tile);
  cfg.min_chunk_tokens = c.plan_min_chunk;
  return cfg;
}

void run_decode(const DecodeCase& c) {
  INFO(describe(c));
  Rng r(c.seed);
  const int hq = c.kv_heads * c.group;
  const int batch = static_cast<int>(c.lens.size());
  int need = 1;
  for (int len : c.lens) need += (len + c.block_size - 1) / c.block_size;
  Pool pool(c.dt, need + 3, c.block_size, c.kv_heads, c.head_dim, c.layout);
  Batch bt(r, pool, c.lens);
  Tensor q(c.dt, std::int64_t{batch} * hq * c.head_dim);
  q.randomize(r);
  scale_tensor(q, c.q_scale);
  if (c.probe) {
    for (std::int64_t row = 0; row < std::int64_t{batch} * hq; ++row) {
      if ((row % hq) % c.group != 0) continue;
      for (int d = 0; d < c.head_dim; ++d) store_elem(q.host.data(), row * c.head_dim + d, c.dt, 0.f);
    }
    q.dev.upload(q.host.data(), q.host.size());
  }
  Tensor o(c.dt, q.n);
  o.dev.poison();
  DevBuf lse(static_cast<std::size_t>(batch) * hq * sizeof(float));
  lse.poison();

  DecodeParams p;
  p.q = q.dev.get();
  p.o = o.dev.get();
  p.lse = lse.as<float>();
  p.kv = pool.dev_view();
  p.pages = bt.dev_table(c.fmt);
  p.num_qo_heads = hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  // A planted error: the launch reads a page table that differs from the batch's in one entry of sequence 0.
  std::vector<std::int32_t> bad_indices = bt.indices, bad_last = bt.last_page_len;
  std::vector<int> launch_lens = c.lens;
  DevBuf d_bad_indices, d_bad_last;
  if (c.plant != DecodeCase::Plant::kNone) {
    REQUIRE(c.fmt == PageTableFormat::kCsr);
    REQUIRE(batch >= 2);
    REQUIRE(c.lens[0] >= 2 * c.block_size);
    REQUIRE(c.lens[1] >= c.lens[0]);
    if (c.plant == DecodeCase::Plant::kWrongPage) {
      const int j = static_cast<int>(bt.pages[0].size()) / 2;  // a middle page of sequence 0 -> sequence 1's page j
      bad_indices[static_cast<std::size_t>(bt.indptr[0] + j)] = bt.pages[1][static_cast<std::size_t>(j)];
    } else {
      REQUIRE(c.lens[0] % c.block_size != 1);  // the last page keeps >= 1 token
      bad_last[0] -= 1;
      launch_lens[0] -= 1;
    }
    d_bad_indices = DevBuf::from(bad_indices);
    d_bad_last = DevBuf::from(bad_last);
    p.pages = PageTable::csr(batch, bt.d_indptr.as<std::int32_t>(), d_bad_indices.as<std::int32_t>(),
                             d_bad_last.as<std::int32_t>());
  }
  DevBuf ws;
  DevicePlan dplan;
  if (c.plan) {
    dplan = make_device_plan(launch_lens, plan_config(c, hq));
    INFO("plan: " << dplan.info.num_items << " items, " << dplan.info.num_merges << " merges, T = "
                  << dplan.info.chunk_target_tokens);
    p.workspace_bytes = std::max<std::size_t>(dplan.info.workspace_bytes, 16);
    ws = DevBuf(p.workspace_bytes);
    ws.poison();
    p.workspace = ws.get();
    REQUIRE(pagedkv::cuda::decode(p, dplan.device_list()) == Status::kSuccess);
  } else if (c.split) {
    const int max_len = *std::max_element(c.lens.begin(), c.lens.end());
    const int chunk = c.chunk > 0 ? c.chunk : 16;
    p.kv_chunk_size_tokens = c.chunk;
    p.max_num_chunks = std::max(2, (max_len + chunk - 1) / chunk);
    p.workspace_bytes = pagedkv::decode_workspace_bytes(batch, p.max_num_chunks, hq, c.head_dim);
    ws = DevBuf(p.workspace_bytes);
    ws.poison();
    p.workspace = ws.get();
  }
  if (!c.plan) REQUIRE(pagedkv::cuda::decode(p) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  o.fetch();
  std::vector<float> got_lse(static_cast<std::size_t>(batch) * hq);
  lse.download(got_lse.data(), got_lse.size() * sizeof(float));
  {
    // The same launch again on the same inputs, outputs poisoned: o and lse must repeat bit for bit (a result
    // that moves between identical launches is a race).
    o.dev.poison();
    lse.poison();
    PKT_CUDA(cudaDeviceSynchronize());
    REQUIRE((c.plan ? pagedkv::cuda::decode(p, dplan.device_list()) : pagedkv::cuda::decode(p)) == Status::kSuccess);
    PKT_CUDA(cudaDeviceSynchronize());
    const bool same_o = bytes_of(o.dev, o.host.size()) == o.host;
    std::vector<float> lse2(got_lse.size());
    lse.download(lse2.data(), lse2.size() * sizeof(float));
    const bool same_lse = std::memcmp(lse2.data(), got_lse.data(), lse2.size() * sizeof(float)) == 0;
    INFO("second identical launch: o " << (same_o ? "same" : "DIFFERENT") << ", lse " << (same_lse ? "same" : "DIFFERENT"));
    CHECK((same_o && same_lse));
  }
  const std::vector<float> got = to_floats(o);

  // float64 oracle.
  const KVPoolView hv = pool.host_view();
  const std::vector<float> qf = to_floats(q);
  Ref ref{std::vector<double>(got.size()), std::vector<double>(got_lse.size())};
  parallel_for(std::int64_t{batch} * hq, [&](std::int64_t row) {
    const int b = static_cast<int>(row / hq), h = static_cast<int>(row % hq);
    attend(hv, bt, b, h / c.group, qf.data() + row * c.head_dim, c.lens[b], p.sm_scale,
           ref.o.data() + row * c.head_dim, &ref.lse[row]);
  });
  if (c.probe || c.plant != DecodeCase::Plant::kNone) {
    // Every row against the bound of attention_check.hpp (P rounded to T in the tensor-core kernel: the model's
    // p_roundoff is T's unit roundoff for fp16 / bf16, whichever kernel ran; fp32 for fp32).
    const pagedkv::reference::AttentionPrecision prec{
        c.dt, c.dt == DType::kFloat32 ? 0x1p-24 : pagedkv::reference::unit_roundoff(c.dt)};
    std::vector<int> bad_rows(static_cast<std::size_t>(batch) * hq, 0);
    std::vector<std::string> whys(bad_rows.size());
    parallel_for(std::int64_t{batch} * hq, [&](std::int64_t row) {
      const int b = static_cast<int>(row / hq), h = static_cast<int>(row % hq);
      const int n = c.lens[b], hd = c.head_dim;
      std::vector<double> kd(static_cast<std::size_t>(n) * hd), vd(kd.size()), qd(static_cast<std::size_t>(hd));
      for (int t = 0; t < n; ++t) {
        const std::int64_t off = hv.offset(bt.pages[b][t / hv.block_size], t % hv.block_size, h / c.group);
        for (int d = 0; d < hd; ++d) {
          kd[static_cast<std::size_t>(t) * hd + d] = load_elem(hv.k, off + d, hv.dtype);
          vd[static_cast<std::size_t>(t) * hd + d] = load_elem(hv.v, off + d, hv.dtype);
        }
      }
      for (int d = 0; d < hd; ++d) qd[static_cast<std::size_t>(d)] = qf[static_cast<std::size_t>(row * hd + d)];
      const auto orow = pagedkv::reference::attention_oracle_row(qd.data(), kd.data(), vd.data(), n, hd, p.sm_scale);
      bad_rows[static_cast<std::size_t>(row)] =
          pagedkv::reference::attention_row_ok(got.data() + row * hd, got_lse[static_cast<std::size_t>(row)], true,
                                               orow, prec, hd, &whys[static_cast<std::size_t>(row)])
              ? 0
              : 1;
    });
    if (c.plant != DecodeCase::Plant::kNone) {
      // The probe rows of sequence 0 (head 0 of each group) must reject the planted error.
      int rejected = 0;
      for (int h = 0; h < hq; h += c.group) rejected += bad_rows[static_cast<std::size_t>(h)];
      INFO("probe rows of sequence 0 that rejected the planted error: " << rejected << " of " << hq / c.group
                                                                        << "; first: " << whys[0]);
      CHECK(rejected == hq / c.group);
      return;  // the output is wrong on purpose: the checks below do not apply
    }
    for (std::size_t row = 0; row < bad_rows.size(); ++row) {
      if (bad_rows[row] == 0) continue;
      INFO("row " << row << " (sequence " << row / static_cast<std::size_t>(hq) << ", head "
                  << row % static_cast<std::size_t>(hq) << "): " << whys[row]);
      CHECK(bad_rows[row] == 0);
      break;
    }
  }
  const double err = row_rel_error(got, ref.o, c.head_dim);
  INFO("max row-relative error vs float64 oracle: " << err);
  CHECK(err <= o_tolerance(c.dt, c.q_scale));
  std::string why;
  const bool lse_good = lse_ok(got_lse, ref.lse, &why);
  INFO(why);
  CHECK(lse_good);

  // CPU reference with the same parameters (host memory), when it accepts them.
  Tensor ro(c.dt, q.n);
  std::vector<float> ref_lse(got_lse.size());
  std::vector<unsigned char> hws(p.workspace_bytes);
  DecodeParams hp = p;
  hp.q = q.host.data();
  hp.o = ro.host.data();
  hp.lse = ref_lse.data();
  hp.kv = pool.host_view();
  hp.pages = bt.host_table(c.fmt);
  hp.workspace = hws.empty() ? nullptr : hws.data();
  if (c.split && c.chunk == 0) hp.kv_chunk_size_tokens = 0;  // implementation's choice: reference does not split
  const Status ref_status = c.plan ? pagedkv::reference::decode(hp, dplan.host_list()) : pagedkv::reference::decode(hp);
  if (c.plan) CHECK(ref_status == Status::kSuccess);  // the same work list, item for item
  if (ref_status == Status::kSuccess) {
    std::vector<double> rod(got.size());
    for (std::size_t i = 0; i < rod.size(); ++i) rod[i] = ro.at(static_cast<std::int64_t>(i));
    const double rerr = row_rel_error(got, rod, c.head_dim);
    INFO("max row-relative error vs pagedkv::reference::decode: " << rerr);
    CHECK(rerr <= 2 * o_tolerance(c.dt, c.q_scale));
  }
}

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr int kHeadDims[] = {64, 128, 256};
constexpr Layout kLayouts[] = {Layout::kNhd, Layout::kHnd, Layout::kSeparateNhd, Layout::kSeparateHnd,
                               Layout::kPaddedNhd};

}  // namespace

TEST_CASE("decode matches the float64 oracle over the full grid", "[decode]") {
  std::uint64_t seed = 100;
  int layout_i = 0;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      for (int group : {1, 4, 8}) {
        for (int bs : {1, 8, 16, 32, 64}) {
          for (auto fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
            for (bool split : {false, true}) {
              Rng lr(seed);
              DecodeCase c{dt, hd, group, bs, fmt, split, kLayouts[layout_i++ % 5],
                           {lr.range(50, 300), 0, lr.range(1, 3 * bs + 5), lr.range(1, 40)}};
              c.chunk = split ? (seed % 3 == 0 ? 0 : lr.range(16, 96)) : 0;
              c.seed = seed++;
              run_decode(c);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("decode handles any GQA group size, including several head tiles", "[decode]") {
  std::uint64_t seed = 5000;
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    for (int hd : kHeadDims) {
      for (int group : {2, 3, 6, 12, 16, 24}) {
        for (bool split : {false, true}) {
          DecodeCase c{dt, hd, group, 16, PageTableFormat::kCsr, split, Layout::kNhd, {130, 7, 0, 64}};
          c.kv_heads = 1 + static_cast<int>(seed % 3);
          c.chunk = split ? 32 : 0;
          c.seed = seed++;
          run_decode(c);
        }
      }
    }
  }
}

TEST_CASE("decode of a batch padded with empty sequences writes o = 0 and lse = -inf", "[decode]") {
  for (bool split : {false, true}) {
    DecodeCase c{DType::kFloat16, 128, 4, 16, PageTableFormat::kPadded, split, Layout::kHnd, {0, 0, 0}};
    c.chunk = split ? 64 : 0;
    run_decode(c);
  }
}

TEST_CASE("decode executes length-aware plans over the grid (small devices force splits)", "[decode][plan]") {
  std::uint64_t seed = 7000;
  int layout_i = 0;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      for (int group : {1, 4, 8, 12}) {
        for (int bs : {1, 16, 64}) {
          for (auto fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
            Rng lr(seed);
            DecodeCase c{dt, hd, group, bs, fmt, false, kLayouts[layout_i++ % 5],
                         {lr.range(50, 700), 0, lr.range(1, 3 * bs + 5), lr.range(1, 40), lr.range(300, 900)}};
            c.plan = true;
            c.plan_sms = lr.range(1, 12);
            c.plan_ctas_per_sm = lr.range(1, 4);
            c.plan_min_chunk = lr.range(1, 64);
            c.plan_heads_per_tile = lr.range(0, group);
            c.seed = seed++;
            run_decode(c);
          }
        }
      }
    }
  }
}

// [long]: the two largest decode cases, registered as their own CTest test (cuda.decode_long) so `ctest -j` runs them
// beside the grids. The ragged batch is 63 x 4k + 1 x 32k (the benchmark's ragged row; 0.29 M tokens): the earlier
// 255 x 4k + 1 x 32k (1.08 M tokens) spent about 50 s of host time in its random fill, float64 oracle and CPU
// reference; this one's oracle runs on every core (parallel_for).
TEST_CASE("decode with the real device's plan: batch 1 x 32k, and a ragged batch of 64 with one 32k sequence",
          "[decode][plan][long]") {
  SECTION("batch 1 x 32768, 8 kv heads, group 4") {
    DecodeCase c{DType::kBFloat16, 128, 4, 16, PageTableFormat::kCsr, false, Layout::kNhd, {32768}};
    c.kv_heads = 8;
    c.plan = true;
    run_decode(c);
  }
  SECTION("63 x 4096 + 1 x 32768, 2 kv heads, group 4") {
    std::vector<int> lens(63, 4096);
    lens.insert(lens.begin() + 25, 32768);
    DecodeCase c{DType::kBFloat16, 128, 4, 16, PageTableFormat::kPadded, false, Layout::kNhd, lens};
    c.kv_heads = 2;
    c.plan = true;
    run_decode(c);
  }
}

// The one-wrong-token check on the device kernels (pagedkv/reference/attention_check.hpp; its CPU proof is
// tests/unit/test_reference_one_token.cpp): every row within the per-element bound, and a planted wrong page or
// missing last token of a 32k-token sequence rejected by the uniform probe (q = 0) rows. Tensor-core decode (group
// 4, fp16 / bf16, head_dim 64 / 128) and the CUDA-core kernel (fp32; bf16 at head_dim 256), real device plans; the
// planted errors on bf16 x 128 and fp16 x 64.
TEST_CASE("decode: the one-wrong-token check passes correct output and rejects a planted wrong page or missing token",
          "[decode][plan][long]") {
  for (const auto& [dt, hd] : {std::pair{DType::kBFloat16, 128}, std::pair{DType::kFloat16, 64},
                               std::pair{DType::kBFloat16, 64}, std::pair{DType::kFloat16, 128},
                               std::pair{DType::kFloat32, 128}, std::pair{DType::kBFloat16, 256}}) {
    for (const auto plant : {DecodeCase::Plant::kNone, DecodeCase::Plant::kWrongPage,
                             DecodeCase::Plant::kLastTokenMissing}) {
      // Planted errors on the two tensor-core cases only (host time: each run is a 64k-token float64 oracle).
      const bool tc_case = (dt == DType::kBFloat16 && hd == 128) || (dt == DType::kFloat16 && hd == 64);
      if (plant != DecodeCase::Plant::kNone && !tc_case) continue;
      DecodeCase c{dt, hd, 4, 16, PageTableFormat::kCsr, false, Layout::kNhd, {32768 - 5, 32768}};
      c.kv_heads = 2;
      c.plan = true;
      c.probe = true;
      c.plant = plant;
      c.seed = 36;
      INFO("plant " << static_cast<int>(plant));
      run_decode(c);
    }
  }
}

// Batch above 64 (the benchmark's b256 rows, timed but never checked before): 256 ragged sequences with the real
// device's plan, tensor-core (bf16 x 128, fp16 x 64, group 4) and CUDA-core (fp32, group 8) decode.
TEST_CASE("decode with the real device's plan at batch 256", "[decode][plan]") {
  std::uint64_t seed = 256000;
  for (const auto& [dt, hd, group] : {std::tuple{DType::kBFloat16, 128, 4}, std::tuple{DType::kFloat16, 64, 4},
                                      std::tuple{DType::kFloat32, 128, 8}}) {
    Rng lr(seed);
    std::vector<int> lens(256);
    for (int& len : lens) len = lr.range(1, 600);
    lens[7] = 0;
    lens[100] = 2048;
    DecodeCase c{dt, hd, group, 16, PageTableFormat::kCsr, false, Layout::kNhd, lens};
    c.plan = true;
    c.seed = seed++;
    run_decode(c);
  }
}

TEST_CASE("decode chunk rule: batch 1 x 32k with an explicit split stays exact", "[decode]") {
  DecodeCase c{DType::kBFloat16, 128, 4, 16, PageTableFormat::kCsr, true, Layout::kNhd, {32768}};
  c.kv_heads = 8;
  c.chunk = 1024;
  run_decode(c);
}

// ---------------------------------------------------------------------------------------------------------------
// prefill

namespace {

struct PrefillCase {
  DType dt;
  int head_dim, group, block_size;
  PageTableFormat fmt;
  Layout layout;
  std::vector<std::pair<int, int>> q_kv;  // (q_len, kv_len) per sequence, q_len <= kv_len
  int kv_heads = 2;
  std::uint64_t seed = 1;
  float q_scale = 1.f;  // as DecodeCase::q_scale
};

void run_prefill(const PrefillCase& c) {
  INFO(std::string(dtype_name(c.dt)) << " hd=" << c.head_dim << " group=" << c.group << " bs=" << c.block_size
                                     << (c.fmt == PageTableFormat::kCsr ? " csr " : " padded ")
                                     << layout_name(c.layout));
  Rng r(c.seed);
  const int hq = c.kv_heads * c.group;
  std::vector<int> lens;
  std::vector<std::int32_t> qo_indptr{0};
  int need = 1;
  for (auto [ql, kl] : c.q_kv) {
    lens.push_back(kl);
    qo_indptr.push_back(qo_indptr.back() + ql);
    need += (kl + c.block_size - 1) / c.block_size;
  }
  const int total_q = qo_indptr.back();
  const int batch = static_cast<int>(lens.size());
  Pool pool(c.dt, need + 3, c.block_size, c.kv_heads, c.head_dim, c.layout);
  Batch bt(r, pool, lens);
  Tensor q(c.dt, std::int64_t{total_q} * hq * c.head_dim);
  q.randomize(r);
  scale_tensor(q, c.q_scale);
  Tensor o(c.dt, q.n);
  o.dev.poison();
  DevBuf lse(static_cast<std::size_t>(total_q) * hq * sizeof(float));
  lse.poison();
  DevBuf d_qo = DevBuf::from(qo_indptr);

  PrefillParams p;
  p.q = q.dev.get();
  p.o = o.dev.get();
  p.lse = lse.as<float>();
  p.qo_indptr = d_qo.as<std::int32_t>();
  p.total_q_tokens = total_q;
  p.kv = pool.dev_view();
  p.pages = bt.dev_table(c.fmt);
  p.num_qo_heads = hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(c.head_dim));
  REQUIRE(pagedkv::cuda::prefill(p) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  o.fetch();
  std::vector<float> got_lse(static_cast<std::size_t>(total_q) * hq);
  lse.download(got_lse.data(), got_lse.size() * sizeof(float));
  {
    // Run twice on the same inputs: bit-for-bit equal outputs, or the kernel races.
    o.dev.poison();
    lse.poison();
    PKT_CUDA(cudaDeviceSynchronize());
    REQUIRE(pagedkv::cuda::prefill(p) == Status::kSuccess);
    PKT_CUDA(cudaDeviceSynchronize());
    const bool same_o = bytes_of(o.dev, o.host.size()) == o.host;
    std::vector<float> lse2(got_lse.size());
    lse.download(lse2.data(), lse2.size() * sizeof(float));
    const bool same_lse = std::memcmp(lse2.data(), got_lse.data(), lse2.size() * sizeof(float)) == 0;
    INFO("second identical launch: o " << (same_o ? "same" : "DIFFERENT") << ", lse " << (same_lse ? "same" : "DIFFERENT"));
    CHECK((same_o && same_lse));
  }
  const std::vector<float> got = to_floats(o);

  const KVPoolView hv = pool.host_view();
  const std::vector<float> qf = to_floats(q);
  Ref ref{std::vector<double>(got.size()), std::vector<double>(got_lse.size())};
  parallel_for(batch, [&](std::int64_t b) {
    const int ql = qo_indptr[b + 1] - qo_indptr[b];
    for (int i = 0; i < ql; ++i) {
      const int visible = lens[b] - ql + i + 1;  // causal: positions <= kv_len - q_len + i
      for (int h = 0; h < hq; ++h) {
        const std::int64_t row = std::int64_t{qo_indptr[b] + i} * hq + h;
        attend(hv, bt, static_cast<int>(b), h / c.group, qf.data() + row * c.head_dim, visible, p.sm_scale,
               ref.o.data() + row * c.head_dim, &ref.lse[row]);
      }
    }
  });
  const double err = row_rel_error(got, ref.o, c.head_dim);
  INFO("max row-relative error vs float64 oracle: " << err);
  CHECK(err <= o_tolerance(c.dt, c.q_scale));
  std::string why;
  const bool lse_good = lse_ok(got_lse, ref.lse, &why);
  INFO(why);
  CHECK(lse_good);

  Tensor ro(c.dt, q.n);
  PrefillParams hp = p;
  hp.q = q.host.data();
  hp.o = ro.host.data();
  hp.lse = nullptr;
  hp.qo_indptr = qo_indptr.data();
  hp.kv = pool.host_view();
  hp.pages = bt.host_table(c.fmt);
  if (pagedkv::reference::prefill(hp) == Status::kSuccess) {
    std::vector<double> rod(got.size());
    for (std::size_t i = 0; i < rod.size(); ++i) rod[i] = ro.at(static_cast<std::int64_t>(i));
    const double rerr = row_rel_error(got, rod, c.head_dim);
    INFO("max row-relative error vs pagedkv::reference::prefill: " << rerr);
    CHECK(rerr <= 2 * o_tolerance(c.dt, c.q_scale));
  }
}

}  // namespace

TEST_CASE("prefill matches the float64 oracle (causal, ragged, cached prefix)", "[prefill]") {
  std::uint64_t seed = 9000;
  int layout_i = 0;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      for (int group : {1, 4}) {
        for (int bs : {1, 16, 64}) {
          for (auto fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
            Rng lr(seed);
            const int full = lr.range(1, 70);
            const int kv_long = lr.range(80, 200);
            PrefillCase c{dt, hd, group, bs, fmt, kLayouts[layout_i++ % 5],
                          {{full, full}, {1, lr.range(1, 100)}, {0, lr.range(0, 20)}, {lr.range(33, 80), kv_long}}};
            c.seed = seed++;
            run_prefill(c);
          }
        }
      }
    }
  }
}

TEST_CASE("prefill with GQA group 8 and a long prompt", "[prefill]") {
  PrefillCase c{DType::kBFloat16, 128, 8, 16, PageTableFormat::kCsr, Layout::kNhd, {{300, 700}, {129, 129}}};
  c.kv_heads = 1;
  run_prefill(c);
}

TEST_CASE("prefill with GQA group 8 for every dtype and head dim", "[prefill]") {
  std::uint64_t seed = 9500;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      PrefillCase c{dt, hd, 8, 16, PageTableFormat::kPadded, Layout::kSeparateHnd, {{70, 150}, {33, 33}, {1, 90}}};
      c.kv_heads = 2;
      c.seed = seed++;
      run_prefill(c);
    }
  }
}

// Block sizes that are not powers of two (12, 24, 48) and above 64 (128, 256): the kernels divide by the block size
// (no shift or mask), so every one must work. Decode through the chunk rule and a work list, prefill over a cached
// prefix, both page-table forms.
TEST_CASE("decode and prefill with block sizes that are not powers of two, and above 64 (up to 2048)",
          "[decode][prefill][block_size]") {
  std::uint64_t seed = 12000;
  int li = 0;
  // 512-2048: the coarse pages of KV-cache groups (docs/groups.md) reach the kernels at these block sizes.
  for (int bs : {12, 24, 48, 128, 256, 512, 1024, 2048}) {
    for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
      Rng lr(seed);
      const std::vector<int> lens{lr.range(1, bs - 1), bs, lr.range(3 * bs + 1, 5 * bs), 0, lr.range(200, 700)};
      DecodeCase chunked{dt, 128, 4, bs, PageTableFormat::kCsr, true, kLayouts[li++ % 5], lens};
      chunked.chunk = 40;  // not a multiple of any block size here: chunks end inside pages
      chunked.seed = seed++;
      run_decode(chunked);
      DecodeCase planned{dt, 64, 8, bs, PageTableFormat::kPadded, false, kLayouts[li++ % 5], lens};
      planned.plan = true;
      planned.plan_sms = 3;
      planned.plan_ctas_per_sm = 2;
      planned.plan_min_chunk = 7;
      planned.seed = seed++;
      run_decode(planned);
      PrefillCase pre{dt, 128, 4, bs, li % 2 ? PageTableFormat::kCsr : PageTableFormat::kPadded, kLayouts[li++ % 5],
                      {{lr.range(1, 70), 300}, {bs + 1, bs + 1}, {1, lr.range(1, 2 * bs)}}};
      pre.seed = seed++;
      run_prefill(pre);
    }
  }
}

// Scores near the top of fp32's exp range: q drawn from [-64, 64) makes sm_scale * q.k reach about +-100 (std ~21 at
// head_dim 128), so a kernel that exponentiates before subtracting the running max overflows to inf / NaN, and one
// that rescales carelessly loses the winning token. The float64 oracle subtracts the max.
TEST_CASE("decode and prefill with large-magnitude logits", "[decode][prefill][logits]") {
  std::uint64_t seed = 13000;
  for (DType dt : kDTypes) {
    for (int hd : {64, 128}) {
      DecodeCase split{dt, hd, 4, 16, PageTableFormat::kCsr, true, Layout::kNhd, {900, 17, 1, 300}};
      split.chunk = 64;
      split.q_scale = 64.f;
      split.seed = seed++;
      run_decode(split);
      DecodeCase planned{dt, hd, 4, 16, PageTableFormat::kCsr, false, Layout::kHnd, {900, 17, 1, 300}};
      planned.plan = true;
      planned.plan_sms = 2;
      planned.plan_ctas_per_sm = 2;
      planned.plan_min_chunk = 16;
      planned.q_scale = 64.f;
      planned.seed = seed++;
      run_decode(planned);
      PrefillCase pre{dt, hd, 2, 16, PageTableFormat::kCsr, Layout::kNhd, {{100, 400}, {40, 40}}};
      pre.q_scale = 64.f;
      pre.seed = seed++;
      run_prefill(pre);
    }
  }
}

TEST_CASE("decode and prefill on a reduced grid, for compute-sanitizer", "[sanitize]") {
  // Every (dtype, head_dim) once: a plan with splits, the chunk rule with splits, and a causal prefill over a
  // cached prefix; small enough to run under memcheck / racecheck / synccheck / initcheck (scripts/gpu-check.sh).
  std::uint64_t seed = 424242;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      DecodeCase plan{dt, hd, 4, 16, PageTableFormat::kCsr, false, Layout::kNhd, {70, 0, 33, 5}};
      plan.plan = true;
      plan.plan_sms = 2;
      plan.plan_ctas_per_sm = 2;
      plan.plan_min_chunk = 8;
      plan.seed = seed++;
      run_decode(plan);
      DecodeCase chunked{dt, hd, 2, 8, PageTableFormat::kPadded, true, Layout::kHnd, {41, 0, 17}};
      chunked.chunk = 16;
      chunked.seed = seed++;
      run_decode(chunked);
      PrefillCase pre{dt, hd, 2, 16, PageTableFormat::kCsr, Layout::kNhd, {{5, 40}, {0, 9}, {33, 33}}};
      pre.seed = seed++;
      run_prefill(pre);
    }
  }
}
