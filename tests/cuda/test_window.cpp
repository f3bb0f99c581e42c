// tests/cuda/test_window.cpp: decode and prefill with local attention (AttentionWindow: sliding window W and / or
// chunked-local attention C) against a float64 oracle over the visible keys and against the CPU reference, with
// every page wholly before the window replaced by the null block 0 in the page table (what the manager writes for
// a sliding-window KV-cache group). Block 0 and every unused slot of the pool are NaN, so a kernel that reads a
// page outside the window, or a key the mask should hide, fails. Outputs and workspaces are poisoned before each run.
//
// Grid (tag [window], CTest cuda.window):
//  - decode: 3 dtypes x 3 head dims x 6 window cases (edges inside a block and on a block boundary, W = 1, W above
//    every length, C a multiple and not a multiple of the block size, W and C together) x block size {1, 16} x
//    {CSR, padded}, each run in 4 modes: no split (chunk rule off), chunk rule split (chunks wholly before the window
//    are masked partials that the merge weighs 0), a window-aware plan on a small stand-in device (forces splits),
//    and a plan made without the window (its items before the window are masked by the kernel's clamp);
//  - prefill: 3 dtypes x 3 head dims x 6 window cases x block size {1, 16} x {CSR, padded}, ragged steps whose
//    queries cross window positions and chunk boundaries, with cached prefixes;
//  - [window][sanitize]: one small decode (plan + chunk rule) and prefill per (dtype, head_dim) for
//    compute-sanitizer (scripts/gpu-check.sh runs "[sanitize]").
// The oracle's window comes from the definition (brute force), not from pagedkv::AttentionWindow.
#include "gpu_test_util.hpp"

#include <array>

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/reference/decode.hpp>
#include <pagedkv/reference/prefill.hpp>

namespace {

using namespace pkt;
using pagedkv::AttentionWindow;
using pagedkv::DecodeParams;
using pagedkv::PrefillParams;

/// First key the query at `pos` sees, from the definition (brute force): the smallest t with every u in [t, pos]
/// satisfying pos - u < W (W > 0) and u / C == pos / C (C > 0).
int oracle_first_visible(int pos, const AttentionWindow& w) {
  const auto visible = [&](int u) {
    return (w.sliding_window_tokens <= 0 || pos - u < w.sliding_window_tokens) &&
           (w.attention_chunk_tokens <= 0 || u / w.attention_chunk_tokens == pos / w.attention_chunk_tokens);
  };
  int t = pos;
  while (t > 0 && visible(t - 1)) --t;
  return t;
}

/// float64 attention of one query row (dim floats) against keys [lo, hi) of sequence b, kv head kvh.
void attend_range(const KVPoolView& v, const std::vector<int>& pages, int kvh, const float* q, int lo, int hi,
                  double scale, double* o, double* lse) {
  const int hd = v.head_dim;
  for (int d = 0; d < hd; ++d) o[d] = 0.0;
  if (hi <= lo) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  std::vector<double> s(static_cast<std::size_t>(hi - lo));
  double m = -std::numeric_limits<double>::infinity();
  for (int t = lo; t < hi; ++t) {
    const std::int64_t off = v.offset(pages[static_cast<std::size_t>(t / v.block_size)], t % v.block_size, kvh);
    double acc = 0.0;
    for (int d = 0; d < hd; ++d) acc += static_cast<double>(q[d]) * load_elem(v.k, off + d, v.dtype);
    s[static_cast<std::size_t>(t - lo)] = acc * scale;
    m = std::max(m, s[static_cast<std::size_t>(t - lo)]);
  }
  double den = 0.0;
  for (int t = lo; t < hi; ++t) {
    const double w = std::exp(s[static_cast<std::size_t>(t - lo)] - m);
    den += w;
    const std::int64_t off = v.offset(pages[static_cast<std::size_t>(t / v.block_size)], t % v.block_size, kvh);
    for (int d = 0; d < hd; ++d) o[d] += w * load_elem(v.v, off + d, v.dtype);
  }
  for (int d = 0; d < hd; ++d) o[d] /= den;
  *lse = m + std::log(den);
}

/// Replaces, in both page tables of `bt` (host and device), every page wholly before first[b] by the null block 0.
/// The original pages stay in bt.pages (the oracle reads through them). Returns the number of entries replaced.
int null_pages_before(Batch& bt, const std::vector<int>& first, int block_size) {
  int n = 0;
  for (int b = 0; b < bt.batch(); ++b) {
    for (int i = 0; i < first[static_cast<std::size_t>(b)] / block_size; ++i) {
      bt.indices[static_cast<std::size_t>(bt.indptr[static_cast<std::size_t>(b)] + i)] = 0;
      bt.block_tables[static_cast<std::size_t>(b) * bt.max_blocks + static_cast<std::size_t>(i)] = 0;
      ++n;
    }
  }
  bt.d_indices.upload(bt.indices.data(), bt.indices.size() * sizeof(std::int32_t));
  bt.d_tables.upload(bt.block_tables.data(), bt.block_tables.size() * sizeof(std::int32_t));
  return n;
}

/// The window cases at block size bs.
struct WindowCase {
  const char* name;
  AttentionWindow w;
};
std::vector<WindowCase> window_cases(int bs) {
  return {{"W inside a block", {bs == 1 ? 3 : 2 * bs + bs / 2 + 1, 0}},
          {"W = 2 blocks", {2 * bs, 0}},
          {"W = 1", {1, 0}},
          {"W above every length", {100000, 0}},
          {"C = 3 blocks", {0, 3 * bs}},
          {"C not a block multiple, with W", {bs + 3, bs == 1 ? 5 : 2 * bs + 3}}};
}

/// Decode lengths around the window edges (0, 1, W - 1, W, W + 1, W + k bs, W + k bs + r, C, C + 1, 2C + r, long).
std::vector<int> decode_lengths(Rng& r, int bs, const AttentionWindow& w, int max_len = 700) {
  std::vector<int> lens = {0, 1, r.range(150, 400)};
  const auto add = [&](long v) {
    if (v >= 1 && v <= max_len) lens.push_back(static_cast<int>(v));
  };
  const int W = w.sliding_window_tokens, C = w.attention_chunk_tokens;
  if (W > 0) {
    add(W - 1);
    add(W);
    add(W + 1);
    add(W + bs * r.range(1, 3));
    if (bs > 1) add(W + bs * r.range(1, 3) + r.range(1, bs - 1));
  }
  if (C > 0) {
    add(C);
    add(C + 1);
    add(2 * C + r.range(2, std::max(2, C)));
  }
  std::shuffle(lens.begin(), lens.end(), r.gen);
  return lens;
}

enum class DecodeMode { kNoSplit, kChunkRule, kPlan, kPlanWithoutWindow };
const char* mode_name(DecodeMode m) {
  switch (m) {
    case DecodeMode::kNoSplit: return "no split";
    case DecodeMode::kChunkRule: return "chunk rule";
    case DecodeMode::kPlan: return "plan with the window";
    case DecodeMode::kPlanWithoutWindow: return "plan without the window";
  }
  return "?";
}

struct WindowDecodeCase {
  DType dt;
  int head_dim, group, block_size;
  PageTableFormat fmt;
  Layout layout;
  WindowCase wc;
  DecodeMode mode;
  std::uint64_t seed;
  int kv_heads = 2;
  int max_len = 700;  // longest sequence decode_lengths may add (windows above 700 tokens need longer ones)
};

void run_window_decode(const WindowDecodeCase& c) {
  INFO(dtype_name(c.dt) << " hd=" << c.head_dim << " group=" << c.group << " bs=" << c.block_size
                        << (c.fmt == PageTableFormat::kCsr ? " csr " : " padded ") << layout_name(c.layout) << " "
                        << c.wc.name << " (W " << c.wc.w.sliding_window_tokens << ", C "
                        << c.wc.w.attention_chunk_tokens << ") " << mode_name(c.mode) << " seed " << c.seed);
  Rng r(c.seed);
  const int hq = c.kv_heads * c.group;
  const std::vector<int> lens = decode_lengths(r, c.block_size, c.wc.w, c.max_len);
  INFO("lengths " << Catch::Detail::stringify(lens));
  const int batch = static_cast<int>(lens.size());
  int need = 1;
  for (int len : lens) need += (len + c.block_size - 1) / c.block_size;
  Pool pool(c.dt, need + 3, c.block_size, c.kv_heads, c.head_dim, c.layout);
  Batch bt(r, pool, lens);
  std::vector<int> first(lens.size());
  for (std::size_t b = 0; b < lens.size(); ++b) first[b] = lens[b] == 0 ? 0 : oracle_first_visible(lens[b] - 1, c.wc.w);
  null_pages_before(bt, first, c.block_size);
  Tensor q(c.dt, std::int64_t{batch} * hq * c.head_dim);
  q.randomize(r);
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
  p.window = c.wc.w;
  DevBuf ws, d_items, d_merges;
  std::vector<pagedkv::DecodeWorkItem> items;
  std::vector<pagedkv::DecodeMergeItem> merges;
  pagedkv::DecodePlanInfo info;
  const bool plan = c.mode == DecodeMode::kPlan || c.mode == DecodeMode::kPlanWithoutWindow;
  if (plan) {
    pagedkv::DecodePlanConfig cfg;
    REQUIRE(pagedkv::cuda::decode_plan_config(0, c.dt, c.head_dim, hq, c.kv_heads, &cfg) == Status::kSuccess);
    cfg.num_sms = r.range(1, 8);  // a small stand-in device, so these short windows are really cut
    cfg.ctas_per_sm = r.range(1, 4);
    cfg.min_chunk_tokens = r.range(1, 32);
    if (c.mode == DecodeMode::kPlan) cfg.window = c.wc.w;
    const std::vector<std::int32_t> l32(lens.begin(), lens.end());
    const auto cap = pagedkv::decode_plan_capacity(batch, cfg);
    items.resize(static_cast<std::size_t>(cap.items));
    merges.resize(static_cast<std::size_t>(std::max(cap.merges, 1)));
    REQUIRE(pagedkv::plan_decode(l32, cfg, {items, merges, cap.partial_rows}, &info) == Status::kSuccess);
    REQUIRE(pagedkv::validate_decode_work_list(l32, hq, c.kv_heads, info.work_list, c.wc.w) == Status::kSuccess);
    INFO("plan: " << info.num_items << " items, " << info.num_merges << " merges");
    d_items = DevBuf::from(items);
    d_merges = DevBuf::from(merges);
    p.workspace_bytes = std::max<std::size_t>(info.workspace_bytes, 16);
    ws = DevBuf(p.workspace_bytes);
    ws.poison();
    p.workspace = ws.get();
    REQUIRE(pagedkv::cuda::decode(p, info.work_list.relocated(d_items.as<pagedkv::DecodeWorkItem>(),
                                                              d_merges.as<pagedkv::DecodeMergeItem>())) ==
            Status::kSuccess);
  } else {
    if (c.mode == DecodeMode::kChunkRule) {
      const int max_len = *std::max_element(lens.begin(), lens.end());
      p.kv_chunk_size_tokens = r.range(8, 48);
      p.max_num_chunks = std::max(2, (max_len + p.kv_chunk_size_tokens - 1) / p.kv_chunk_size_tokens);
      p.workspace_bytes = pagedkv::decode_workspace_bytes(batch, p.max_num_chunks, hq, c.head_dim);
      ws = DevBuf(p.workspace_bytes);
      ws.poison();
      p.workspace = ws.get();
    }
    REQUIRE(pagedkv::cuda::decode(p) == Status::kSuccess);
  }
  PKT_CUDA(cudaDeviceSynchronize());
  o.fetch();
  std::vector<float> got_lse(static_cast<std::size_t>(batch) * hq);
  lse.download(got_lse.data(), got_lse.size() * sizeof(float));
  const std::vector<float> got = to_floats(o);

  const KVPoolView hv = pool.host_view();
  const std::vector<float> qf = to_floats(q);
  std::vector<double> ref_o(got.size()), ref_lse(got_lse.size());
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hq; ++h) {
      const std::int64_t row = std::int64_t{b} * hq + h;
      attend_range(hv, bt.pages[static_cast<std::size_t>(b)], h / c.group, qf.data() + row * c.head_dim,
                   first[static_cast<std::size_t>(b)], lens[static_cast<std::size_t>(b)], p.sm_scale,
                   ref_o.data() + row * c.head_dim, &ref_lse[static_cast<std::size_t>(row)]);
    }
  }
  const double err = row_rel_error(got, ref_o, c.head_dim);
  INFO("max row-relative error vs float64 oracle: " << err);
  CHECK(err <= o_tolerance(c.dt));
  std::string why;
  const bool lse_good = lse_ok(got_lse, ref_lse, &why);
  INFO(why);
  CHECK(lse_good);

  // The CPU reference with the same parameters, page tables (null pages included) and work list.
  Tensor ro(c.dt, q.n);
  std::vector<float> rlse(got_lse.size());
  std::vector<unsigned char> hws(p.workspace_bytes);
  DecodeParams hp = p;
  hp.q = q.host.data();
  hp.o = ro.host.data();
  hp.lse = rlse.data();
  hp.kv = pool.host_view();
  hp.pages = bt.host_table(c.fmt);
  hp.workspace = hws.empty() ? nullptr : hws.data();
  const Status rs = plan ? pagedkv::reference::decode(hp, info.work_list) : pagedkv::reference::decode(hp);
  REQUIRE(rs == Status::kSuccess);
  std::vector<double> rod(got.size());
  for (std::size_t i = 0; i < rod.size(); ++i) rod[i] = ro.at(static_cast<std::int64_t>(i));
  const double rerr = row_rel_error(got, rod, c.head_dim);
  INFO("max row-relative error vs pagedkv::reference::decode: " << rerr);
  CHECK(rerr <= 2 * o_tolerance(c.dt));
}

struct WindowPrefillCase {
  DType dt;
  int head_dim, group, block_size;
  PageTableFormat fmt;
  Layout layout;
  WindowCase wc;
  std::uint64_t seed;
  int kv_heads = 2;
};

void run_window_prefill(const WindowPrefillCase& c) {
  INFO(dtype_name(c.dt) << " hd=" << c.head_dim << " group=" << c.group << " bs=" << c.block_size
                        << (c.fmt == PageTableFormat::kCsr ? " csr " : " padded ") << layout_name(c.layout) << " "
                        << c.wc.name << " (W " << c.wc.w.sliding_window_tokens << ", C "
                        << c.wc.w.attention_chunk_tokens << ") seed " << c.seed);
  Rng r(c.seed);
  const int hq = c.kv_heads * c.group;
  const int W = c.wc.w.sliding_window_tokens, C = c.wc.w.attention_chunk_tokens;
  // (q_len, kv_len): a whole prompt crossing several windows / chunks (and 32-query tiles), a cached prefix with
  // many queries, one query, no query, padding.
  int whole = r.range(40, 120);
  if (C > 0) whole = std::max(whole, 2 * C + r.range(1, 40));
  if (W > 0 && W < 1000) whole = std::max(whole, W + r.range(1, 40));
  whole = std::min(whole, 400);
  const int kv_b = r.range(80, 300);
  const std::vector<std::pair<int, int>> q_kv = {
      {whole, whole}, {r.range(33, 80), kv_b}, {1, r.range(20, 200)}, {0, r.range(1, 40)}, {0, 0}};
  std::vector<int> lens;
  std::vector<std::int32_t> qo_indptr{0};
  int need = 1;
  for (auto [ql, kl] : q_kv) {
    lens.push_back(kl);
    qo_indptr.push_back(qo_indptr.back() + ql);
    need += (kl + c.block_size - 1) / c.block_size;
  }
  const int total_q = qo_indptr.back();
  const int batch = static_cast<int>(lens.size());
  Pool pool(c.dt, need + 3, c.block_size, c.kv_heads, c.head_dim, c.layout);
  Batch bt(r, pool, lens);
  std::vector<int> first(lens.size());
  for (std::size_t b = 0; b < lens.size(); ++b) {
    const int ql = qo_indptr[b + 1] - qo_indptr[b];
    first[b] = ql == 0 ? 0 : oracle_first_visible(lens[b] - ql, c.wc.w);
  }
  null_pages_before(bt, first, c.block_size);
  Tensor q(c.dt, std::int64_t{total_q} * hq * c.head_dim);
  q.randomize(r);
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
  p.window = c.wc.w;
  REQUIRE(pagedkv::cuda::prefill(p) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  o.fetch();
  std::vector<float> got_lse(static_cast<std::size_t>(total_q) * hq);
  lse.download(got_lse.data(), got_lse.size() * sizeof(float));
  const std::vector<float> got = to_floats(o);

  const KVPoolView hv = pool.host_view();
  const std::vector<float> qf = to_floats(q);
  std::vector<double> ref_o(got.size()), ref_lse(got_lse.size());
  for (int b = 0; b < batch; ++b) {
    const int ql = qo_indptr[static_cast<std::size_t>(b) + 1] - qo_indptr[static_cast<std::size_t>(b)];
    for (int i = 0; i < ql; ++i) {
      const int pos = lens[static_cast<std::size_t>(b)] - ql + i;
      for (int h = 0; h < hq; ++h) {
        const std::int64_t row = std::int64_t{qo_indptr[static_cast<std::size_t>(b)] + i} * hq + h;
        attend_range(hv, bt.pages[static_cast<std::size_t>(b)], h / c.group, qf.data() + row * c.head_dim,
                     oracle_first_visible(pos, c.wc.w), pos + 1, p.sm_scale, ref_o.data() + row * c.head_dim,
                     &ref_lse[static_cast<std::size_t>(row)]);
      }
    }
  }
  const double err = row_rel_error(got, ref_o, c.head_dim);
  INFO("max row-relative error vs float64 oracle: " << err);
  CHECK(err <= o_tolerance(c.dt));
  std::string why;
  const bool lse_good = lse_ok(got_lse, ref_lse, &why);
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
  REQUIRE(pagedkv::reference::prefill(hp) == Status::kSuccess);
  std::vector<double> rod(got.size());
  for (std::size_t i = 0; i < rod.size(); ++i) rod[i] = ro.at(static_cast<std::int64_t>(i));
  const double rerr = row_rel_error(got, rod, c.head_dim);
  INFO("max row-relative error vs pagedkv::reference::prefill: " << rerr);
  CHECK(rerr <= 2 * o_tolerance(c.dt));
}

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr int kHeadDims[] = {64, 128, 256};
constexpr Layout kLayouts[] = {Layout::kNhd, Layout::kHnd, Layout::kSeparateNhd, Layout::kSeparateHnd,
                               Layout::kPaddedNhd};
constexpr DecodeMode kModes[] = {DecodeMode::kNoSplit, DecodeMode::kChunkRule, DecodeMode::kPlan,
                                 DecodeMode::kPlanWithoutWindow};

}  // namespace

TEST_CASE("decode with sliding windows and chunked-local attention: null pages never read, float64 oracle",
          "[window]") {
  std::uint64_t seed = 20000;
  int i = 0;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      for (int bs : {1, 16}) {
        for (const WindowCase& wc : window_cases(bs)) {
          for (auto fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
            const int group = std::array<int, 3>{1, 4, 8}[static_cast<std::size_t>(i % 3)];
            for (DecodeMode mode : kModes) {
              run_window_decode({dt, hd, group, bs, fmt, kLayouts[i % 5], wc, mode, seed++});
            }
            ++i;
          }
        }
      }
    }
  }
}

// Windows above 700 tokens (the grid above stays under 700): sliding windows of 1000 and 4096 tokens,
// chunked-local 8192, and both, on sequences up to 2C + r tokens, tensor-core (fp16 / bf16 x 128, group 4) and
// CUDA-core (fp32) decode, every decode mode.
TEST_CASE("decode with windows above 700 tokens: null pages never read, float64 oracle", "[window]") {
  std::uint64_t seed = 21000;
  int i = 0;
  const WindowCase long_cases[] = {{"W = 1000", {1000, 0}},
                                   {"W = 4096", {4096, 0}},
                                   {"C = 8192", {0, 8192}},
                                   {"W = 1500 with C = 4096", {1500, 4096}}};
  for (DType dt : kDTypes) {
    for (const WindowCase& wc : long_cases) {
      for (DecodeMode mode : kModes) {
        WindowDecodeCase c{dt, 128, 4, 16, i % 2 ? PageTableFormat::kCsr : PageTableFormat::kPadded, kLayouts[i % 5],
                           wc, mode, seed++};
        c.max_len = 20000;
        run_window_decode(c);
        ++i;
      }
    }
  }
}

TEST_CASE("prefill with sliding windows and chunked-local attention: null pages never read, float64 oracle",
          "[window]") {
  std::uint64_t seed = 30000;
  int i = 0;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      for (int bs : {1, 16}) {
        for (const WindowCase& wc : window_cases(bs)) {
          for (auto fmt : {PageTableFormat::kCsr, PageTableFormat::kPadded}) {
            run_window_prefill({dt, hd, i % 2 == 0 ? 1 : 4, bs, fmt, kLayouts[i % 5], wc, seed++});
            ++i;
          }
        }
      }
    }
  }
}

TEST_CASE("decode and prefill with windows on a reduced grid, for compute-sanitizer", "[window][sanitize]") {
  std::uint64_t seed = 777000;
  for (DType dt : kDTypes) {
    for (int hd : kHeadDims) {
      const WindowCase wc{"W and C", {21, 40}};
      for (DecodeMode mode : {DecodeMode::kChunkRule, DecodeMode::kPlan}) {
        run_window_decode({dt, hd, 4, 16, PageTableFormat::kCsr, Layout::kNhd, wc, mode, seed++});
      }
      run_window_prefill({dt, hd, 2, 16, PageTableFormat::kPadded, Layout::kHnd, wc, seed++});
    }
  }
}
