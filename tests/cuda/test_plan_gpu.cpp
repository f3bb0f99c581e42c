// tests/cuda/test_plan_gpu.cpp: GPU tests of the plan/run split and of 64-bit addressing.
//  - [graph]: one decode (work-list mode) captured into a CUDA graph at fixed capacities, then replayed for 20
//    steps whose lengths, page tables, batch membership (padding sequences) and plans all change; every replay is
//    compared with the CPU reference executing the same host work list, and with a float64 oracle.
//  - [offsets64]: a bf16 pool of 2^24 + 2^20 + 17 blocks (4.3 GiB, more than 2^31 elements) with every sequence in
//    blocks above 2^24: write_kv, decode (work list and chunk rule) and copy_blocks on those blocks.
#include "gpu_test_util.hpp"

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/reference/decode.hpp>

namespace {

using namespace pkt;
using pagedkv::DecodeMergeItem;
using pagedkv::DecodeParams;
using pagedkv::DecodeWorkItem;

/// float64 attention of q (head_dim floats) over n tokens whose K/V rows are given by two callbacks.
template <class KRow, class VRow>
void oracle(const float* q, int n, int dim, double scale, KRow&& k, VRow&& v, double* o, double* lse) {
  for (int d = 0; d < dim; ++d) o[d] = 0.0;
  if (n == 0) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  std::vector<double> s(static_cast<std::size_t>(n));
  double m = -std::numeric_limits<double>::infinity();
  for (int t = 0; t < n; ++t) {
    double acc = 0;
    for (int d = 0; d < dim; ++d) acc += static_cast<double>(q[d]) * k(t, d);
    s[static_cast<std::size_t>(t)] = acc * scale;
    m = std::max(m, s[static_cast<std::size_t>(t)]);
  }
  double den = 0;
  for (int t = 0; t < n; ++t) {
    const double w = std::exp(s[static_cast<std::size_t>(t)] - m);
    den += w;
    for (int d = 0; d < dim; ++d) o[d] += w * v(t, d);
  }
  for (int d = 0; d < dim; ++d) o[d] /= den;
  *lse = m + std::log(den);
}

}  // namespace

TEST_CASE("a captured decode graph replays changing plans, lengths and page tables", "[graph]") {
  const DType dt = DType::kBFloat16;
  // group 8 at head_dim 128 fills the tensor-core decode's 8-head tile (issue 36: graphs had run group 4 only).
  const int group = GENERATE(4, 8);
  CAPTURE(group);
  const int hd = 128, hkv = 2, hq = hkv * group, bs = 16;
  const int cap_batch = 8, max_blocks = 64;  // up to 1024 tokens per sequence
  const int num_blocks = 1 + cap_batch * max_blocks;
  Rng r(31337);
  Pool pool(dt, num_blocks, bs, hkv, hd, Layout::kNhd);

  pagedkv::DecodePlanConfig cfg;
  REQUIRE(pagedkv::cuda::decode_plan_config(0, dt, hd, hq, hkv, &cfg) == Status::kSuccess);
  const pagedkv::DecodePlanCapacity cap = pagedkv::decode_plan_capacity(cap_batch, cfg);
  std::vector<DecodeWorkItem> items(static_cast<std::size_t>(cap.items));
  std::vector<DecodeMergeItem> merges(static_cast<std::size_t>(cap.merges));

  // Fixed device buffers (the graph's addresses).
  DevBuf d_items(items.size() * sizeof(DecodeWorkItem)), d_merges(merges.size() * sizeof(DecodeMergeItem));
  DevBuf d_indptr((cap_batch + 1) * 4), d_indices(cap_batch * max_blocks * 4), d_last(cap_batch * 4);
  Tensor q(dt, std::int64_t{cap_batch} * hq * hd);
  Tensor o(dt, q.n);
  DevBuf lse(static_cast<std::size_t>(cap_batch) * hq * sizeof(float));
  DevBuf ws(std::max<std::size_t>(cap.workspace_bytes, 16));

  DecodeParams p;
  p.q = q.dev.get();
  p.o = o.dev.get();
  p.lse = lse.as<float>();
  p.kv = pool.dev_view();
  p.pages = PageTable::csr(cap_batch, d_indptr.as<std::int32_t>(), d_indices.as<std::int32_t>(),
                           d_last.as<std::int32_t>());
  p.num_qo_heads = hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(hd));
  p.workspace = ws.get();
  p.workspace_bytes = ws.bytes();

  cudaStream_t stream = nullptr;
  PKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t exec = nullptr;
  int splits_seen = 0;
  for (int step = 0; step < 20; ++step) {
    INFO("step " << step);
    // This step's batch: random lengths, some sequences absent (padding), fresh random K/V and pages.
    std::vector<std::int32_t> lens(cap_batch);
    for (auto& l : lens) l = r.range(0, 5) == 0 ? 0 : r.range(1, max_blocks * bs);
    std::vector<int> ids(static_cast<std::size_t>(num_blocks - 1));
    std::iota(ids.begin(), ids.end(), 1);
    std::shuffle(ids.begin(), ids.end(), r.gen);
    std::vector<std::int32_t> indptr{0}, indices, last;
    std::size_t next = 0;
    std::fill(pool.hk.begin(), pool.hk.end(), 0xff);  // NaN everywhere a sequence does not write
    const KVPoolView hv = pool.host_view();
    for (int b = 0; b < cap_batch; ++b) {
      const int pages = (lens[b] + bs - 1) / bs;
      for (int i = 0; i < pages; ++i) indices.push_back(ids[next++]);
      indptr.push_back(static_cast<std::int32_t>(indices.size()));
      last.push_back(pages == 0 ? 0 : lens[b] - (pages - 1) * bs);
      for (int t = 0; t < lens[b]; ++t) {
        for (int h = 0; h < hkv; ++h) {
          const std::int64_t off = hv.offset(indices[static_cast<std::size_t>(indptr[b]) + t / bs], t % bs, h);
          for (int d = 0; d < hd; ++d) {
            store_elem(hv.k, off + d, dt, r.uniform());
            store_elem(hv.v, off + d, dt, r.uniform());
          }
        }
      }
    }
    if (indices.empty()) indices.push_back(0);
    pool.upload();
    q.randomize(r);
    pagedkv::DecodePlanInfo info;
    REQUIRE(pagedkv::plan_decode(lens, cfg, {items, merges, cap.partial_rows}, &info) == Status::kSuccess);
    splits_seen += info.num_merges > 0 ? 1 : 0;
    d_items.upload(items.data(), d_items.bytes());
    d_merges.upload(merges.data(), d_merges.bytes());
    d_indptr.upload(indptr.data(), indptr.size() * 4);
    d_indices.upload(indices.data(), indices.size() * 4);
    d_last.upload(last.data(), last.size() * 4);
    o.dev.poison();
    lse.poison();
    const pagedkv::DecodeWorkList dev_list =
        info.work_list.relocated(d_items.as<DecodeWorkItem>(), d_merges.as<DecodeMergeItem>());
    if (step == 0) {  // capture once, at the fixed capacities
      cudaGraph_t graph = nullptr;
      PKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      const Status s = pagedkv::cuda::decode(p, dev_list, stream);
      PKT_CUDA(cudaStreamEndCapture(stream, &graph));
      REQUIRE(s == Status::kSuccess);
      PKT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      PKT_CUDA(cudaGraphDestroy(graph));
    }
    // The uploads (cudaMemcpy from pageable memory may return before the DMA lands) and the poison (cudaMemset,
    // asynchronous) ran on the legacy default stream, which a non-blocking stream is not ordered after: wait for
    // them, or the replay could read stale plans / K/V and the poison could land after the kernel's writes.
    PKT_CUDA(cudaDeviceSynchronize());
    PKT_CUDA(cudaGraphLaunch(exec, stream));
    PKT_CUDA(cudaStreamSynchronize(stream));
    o.fetch();
    std::vector<float> got_lse(static_cast<std::size_t>(cap_batch) * hq);
    lse.download(got_lse.data(), got_lse.size() * sizeof(float));
    const std::vector<float> got = to_floats(o);

    // CPU reference on the same host list, and the float64 oracle.
    Tensor ro(dt, q.n);
    std::vector<float> ref_lse(got_lse.size());
    std::vector<unsigned char> hws(ws.bytes());
    DecodeParams hp = p;
    hp.q = q.host.data();
    hp.o = ro.host.data();
    hp.lse = ref_lse.data();
    hp.kv = pool.host_view();
    hp.pages = PageTable::csr(cap_batch, indptr.data(), indices.data(), last.data());
    hp.workspace = hws.data();
    REQUIRE(pagedkv::reference::decode(hp, info.work_list) == Status::kSuccess);
    std::vector<double> rod(got.size()), oracle_o(got.size()), oracle_lse(got_lse.size());
    for (std::size_t i = 0; i < rod.size(); ++i) rod[i] = ro.at(static_cast<std::int64_t>(i));
    const std::vector<float> qf = to_floats(q);
    for (int b = 0; b < cap_batch; ++b) {
      for (int h = 0; h < hq; ++h) {
        const std::int64_t row = std::int64_t{b} * hq + h;
        const auto at = [&](const void* base, int t, int d) {
          return load_elem(base, hv.offset(indices[static_cast<std::size_t>(indptr[b]) + t / bs], t % bs, h / group) + d, dt);
        };
        oracle(qf.data() + row * hd, lens[b], hd, p.sm_scale, [&](int t, int d) { return at(hv.k, t, d); },
               [&](int t, int d) { return at(hv.v, t, d); }, oracle_o.data() + row * hd, &oracle_lse[row]);
      }
    }
    CHECK(row_rel_error(got, rod, hd) <= 2 * o_tolerance(dt));
    CHECK(row_rel_error(got, oracle_o, hd) <= o_tolerance(dt));
    std::string why;
    const bool lse_good = lse_ok(got_lse, oracle_lse, &why);
    INFO(why);
    CHECK(lse_good);
  }
  CHECK(splits_seen >= 5);
  PKT_CUDA(cudaGraphExecDestroy(exec));
  PKT_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("kernels address a pool over 4 GiB with block ids above 2^24", "[offsets64]") {
  const DType dt = DType::kBFloat16;
  const int hd = 64, bs = 1, hkv = 1, group = 2, hq = hkv * group;
  const std::int64_t num_blocks = (std::int64_t{1} << 24) + (std::int64_t{1} << 20) + 17;
  const std::int64_t page_bytes = 2 * bs * hkv * hd * 2;  // interleaved K and V, bf16
  std::size_t free_b = 0, total_b = 0;
  PKT_CUDA(cudaMemGetInfo(&free_b, &total_b));
  REQUIRE(static_cast<double>(free_b) > 1.2 * static_cast<double>(num_blocks * page_bytes));
  DevBuf pool(static_cast<std::size_t>(num_blocks * page_bytes));
  pool.poison();  // NaN everywhere
  const KVPoolView kv = KVPoolView::nhd(pool.get(), dt, static_cast<std::int32_t>(num_blocks), bs, hkv, hd);
  REQUIRE(static_cast<double>(num_blocks) * kv.stride_page > 2147483648.0);

  Rng r(64);
  const std::vector<int> lens{37, 50, 9};
  std::vector<std::int32_t> indptr{0}, indices, last;
  for (int len : lens) {
    for (int t = 0; t < len; ++t) {
      std::int32_t id = 0;
      do {
        id = static_cast<std::int32_t>((std::int64_t{1} << 24) + 1 + r.range(0, (1 << 20) + 10));
      } while (std::find(indices.begin(), indices.end(), id) != indices.end());
      indices.push_back(id);
    }
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(1);
  }
  const int total = static_cast<int>(indices.size());
  // write_kv: token i of the concatenated batch goes to slot indices[i] (block size 1).
  Tensor key(dt, std::int64_t{total} * hkv * hd), value(dt, std::int64_t{total} * hkv * hd);
  key.randomize(r);
  value.randomize(r);
  std::vector<std::int64_t> slots(indices.begin(), indices.end());
  DevBuf d_slots = DevBuf::from(slots);
  pagedkv::WriteKVParams w;
  w.key = key.dev.get();
  w.value = value.dev.get();
  w.slot_mapping = d_slots.as<std::int64_t>();
  w.num_tokens = total;
  w.kv = kv;
  REQUIRE(pagedkv::cuda::write_kv(w) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  // The bytes landed at the 64-bit offsets.
  int wrong = 0;
  for (int i = 0; i < total; ++i) {
    std::vector<unsigned char> page(static_cast<std::size_t>(page_bytes));
    PKT_CUDA(cudaMemcpy(page.data(), static_cast<char*>(pool.get()) + indices[static_cast<std::size_t>(i)] * page_bytes,
                        page.size(), cudaMemcpyDeviceToHost));
    wrong += std::memcmp(page.data(), key.host.data() + static_cast<std::size_t>(i) * hd * 2, hd * 2) != 0 ? 1 : 0;
    wrong += std::memcmp(page.data() + hd * 2, value.host.data() + static_cast<std::size_t>(i) * hd * 2, hd * 2) != 0 ? 1 : 0;
  }
  CHECK(wrong == 0);

  // decode: the oracle reads the rows from the write_kv inputs, not from the pool.
  const int batch = static_cast<int>(lens.size());
  Tensor q(dt, std::int64_t{batch} * hq * hd);
  q.randomize(r);
  const std::vector<float> qf = to_floats(q);
  std::vector<double> o_ref(static_cast<std::size_t>(batch) * hq * hd), lse_ref(static_cast<std::size_t>(batch) * hq);
  const float scale = 0.125f;
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hq; ++h) {
      const std::int64_t row = std::int64_t{b} * hq + h;
      const int first = indptr[static_cast<std::size_t>(b)];
      oracle(qf.data() + row * hd, lens[static_cast<std::size_t>(b)], hd, scale,
             [&](int t, int d) { return key.at(std::int64_t{first + t} * hd + d); },
             [&](int t, int d) { return value.at(std::int64_t{first + t} * hd + d); }, o_ref.data() + row * hd,
             &lse_ref[static_cast<std::size_t>(row)]);
    }
  }
  DevBuf d_indptr = DevBuf::from(indptr), d_indices = DevBuf::from(indices), d_last = DevBuf::from(last);
  DecodeParams p;
  p.q = q.dev.get();
  p.kv = kv;
  p.pages = PageTable::csr(batch, d_indptr.as<std::int32_t>(), d_indices.as<std::int32_t>(), d_last.as<std::int32_t>());
  p.num_qo_heads = hq;
  p.sm_scale = scale;
  // The work list's partial rows scale with the device's CTA capacity (3.3 MB on an H100): size the workspace
  // from the plan's capacity, never from a guess (the first H100 run found 1 MiB too small, refused by the REQUIRE).
  pagedkv::DecodePlanConfig cfg;
  REQUIRE(pagedkv::cuda::decode_plan_config(0, dt, hd, hq, hkv, &cfg) == Status::kSuccess);
  cfg.min_chunk_tokens = 4;
  const auto cap = pagedkv::decode_plan_capacity(batch, cfg);
  for (const bool planned : {false, true}) {
    INFO((planned ? "work list" : "chunk rule"));
    Tensor o(dt, q.n);
    o.dev.poison();
    DevBuf lse(static_cast<std::size_t>(batch) * hq * sizeof(float));
    DevBuf ws(std::max<std::size_t>(std::size_t{1} << 20, static_cast<std::size_t>(cap.workspace_bytes)));
    p.o = o.dev.get();
    p.lse = lse.as<float>();
    p.workspace = ws.get();
    p.workspace_bytes = ws.bytes();
    std::vector<DecodeWorkItem> items;
    std::vector<DecodeMergeItem> merges;
    DevBuf d_items, d_merges;
    if (planned) {
      REQUIRE(cap.workspace_bytes <= ws.bytes());
      items.resize(static_cast<std::size_t>(cap.items));
      merges.resize(static_cast<std::size_t>(cap.merges));
      pagedkv::DecodePlanInfo info;
      const std::vector<std::int32_t> l32(lens.begin(), lens.end());
      REQUIRE(pagedkv::plan_decode(l32, cfg, {items, merges, cap.partial_rows}, &info) == Status::kSuccess);
      CHECK(info.num_merges >= 1);
      d_items = DevBuf::from(items);
      d_merges = DevBuf::from(merges);
      REQUIRE(pagedkv::cuda::decode(p, info.work_list.relocated(d_items.as<DecodeWorkItem>(),
                                                                d_merges.as<DecodeMergeItem>())) == Status::kSuccess);
    } else {
      p.kv_chunk_size_tokens = 16;
      p.max_num_chunks = 4;
      REQUIRE(pagedkv::cuda::decode(p) == Status::kSuccess);
    }
    PKT_CUDA(cudaDeviceSynchronize());
    o.fetch();
    std::vector<float> got_lse(lse_ref.size());
    lse.download(got_lse.data(), got_lse.size() * sizeof(float));
    CHECK(row_rel_error(to_floats(o), o_ref, hd) <= o_tolerance(dt));
    std::string why;
    const bool lse_good = lse_ok(got_lse, lse_ref, &why);
    INFO(why);
    CHECK(lse_good);
  }

  // copy_blocks from a block above 2^24 to the last block of the pool.
  const std::vector<std::int32_t> mapping{indices[0], static_cast<std::int32_t>(num_blocks - 1)};
  DevBuf d_map = DevBuf::from(mapping);
  const pagedkv::CopyBlocksParams c{&kv, 1, d_map.as<std::int32_t>(), 1};
  REQUIRE(pagedkv::cuda::copy_blocks(c) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  std::vector<unsigned char> a(static_cast<std::size_t>(page_bytes)), b(a.size());
  PKT_CUDA(cudaMemcpy(a.data(), static_cast<char*>(pool.get()) + std::int64_t{indices[0]} * page_bytes, a.size(),
                      cudaMemcpyDeviceToHost));
  PKT_CUDA(cudaMemcpy(b.data(), static_cast<char*>(pool.get()) + (num_blocks - 1) * page_bytes, b.size(),
                      cudaMemcpyDeviceToHost));
  CHECK(a == b);
}
