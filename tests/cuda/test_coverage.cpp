// tests/cuda/test_coverage.cpp: what a GPU run must cover beyond the per-kernel grids (issue 18, section 3).
//  - [step_graph]: a whole decode step (copy_blocks -> write_kv -> plan-driven decode with its merge) captured in one
//    CUDA graph at fixed capacities and replayed for 50 steps driven by the real pagedkv::KVCacheManager (admissions,
//    forks with copy-on-write, appends, frees: the page tables, lengths and batch membership change every step);
//    every replay matches the CPU reference bit for bit in the pool and within tolerance in o / lse. And a captured
//    prefill step (write_kv -> prefill) replayed over changing ragged splits, prefixes and page tables.
//  - [offsets64]: prefill over a pool larger than 4 GiB with every block id above 2^24.
//  - [write_kv][widths], [copy_blocks][widths]: every access width the dispatcher can pick (16/8/4/2 bytes, from the
//    alignment of the pointers: cuda/validate.cuh widest_access), each launched twice (bit-for-bit repeat).
//  - [sanitize]: write_kv, copy_blocks and swap_blocks on small shapes, for compute-sanitizer (with decode and
//    prefill's "[sanitize]" cases in test_attention.cpp and test_window.cpp: every kernel).
#include "gpu_test_util.hpp"

#include <memory>

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/reference/copy_blocks.hpp>
#include <pagedkv/reference/decode.hpp>
#include <pagedkv/reference/prefill.hpp>
#include <pagedkv/reference/swap_blocks.hpp>
#include <pagedkv/reference/write_kv.hpp>

namespace {

using namespace pkt;
using pagedkv::CopyBlocksParams;
using pagedkv::DecodeMergeItem;
using pagedkv::DecodeParams;
using pagedkv::DecodeWorkItem;
using pagedkv::PrefillParams;
using pagedkv::WriteKVParams;

/// FNV-1a based test hasher: the standalone GPU build has no OpenSSL / xxHash, and these tests run with prefix
/// caching off (the manager only needs a BlockHasher type).
struct TestHasher {
  static constexpr const char* kName = "fnv1a-test";
  static constexpr bool kCryptographic = false;
  static pagedkv::BlockHash hash(std::span<const std::byte> bytes) noexcept {
    std::uint64_t h1 = 1469598103934665603ull, h2 = 1099511628211ull * 31;
    for (std::byte b : bytes) {
      h1 = (h1 ^ static_cast<std::uint64_t>(b)) * 1099511628211ull;
      h2 = (h2 ^ static_cast<std::uint64_t>(b)) * 0x100000001b3ull + 7;
    }
    pagedkv::BlockHash out;
    std::memcpy(out.bytes.data(), &h1, 8);
    std::memcpy(out.bytes.data() + 8, &h2, 8);
    return out;
  }
};
using Manager = pagedkv::KVCacheManager<TestHasher>;

std::vector<unsigned char> dev_bytes(const void* p, std::size_t n) {
  std::vector<unsigned char> h(n);
  PKT_CUDA(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost));
  return h;
}

/// Random K or V rows for `n` tokens in dtype dt, host and device.
void random_rows(Rng& r, Tensor& t) { t.randomize(r); }

}  // namespace

TEST_CASE("a whole decode step in one CUDA graph replays 50 manager-driven steps", "[step_graph]") {
  const DType dt = DType::kBFloat16;
  const int hd = 128, hkv = 2, group = 4, hq = hkv * group, bs = 16;
  const int cap = 8, max_blocks_per_seq = 24, max_len = max_blocks_per_seq * bs;  // 384 tokens per sequence
  const int num_blocks = 1 + 160, max_copies = cap;
  Rng r(180301);
  Pool pool(dt, num_blocks, bs, hkv, hd, Layout::kNhd);  // hk: the reference's pool; dk: the graph's
  pool.upload();                                          // both all NaN

  pagedkv::CacheConfig cc;
  cc.num_blocks = num_blocks;
  cc.block_size = bs;
  cc.enable_prefix_caching = false;
  cc.max_tokens_per_seq = max_len;
  Manager mgr(cc);

  // Fixed host metadata buffers and their fixed device copies (the graph's addresses).
  std::vector<std::int32_t> indptr(cap + 1), indices(static_cast<std::size_t>(cap) * max_blocks_per_seq), last(cap),
      lens(cap), qo(cap + 1), copies(2 * max_copies);
  std::vector<std::int64_t> slots(cap);
  pagedkv::BatchMetadataBuffers md;
  md.indptr = indptr;
  md.indices = indices;
  md.last_page_len = last;
  md.seq_lens = lens;
  md.qo_indptr = qo;
  md.slot_mapping = slots;
  md.copies = copies;
  DevBuf d_indptr(indptr.size() * 4), d_indices(indices.size() * 4), d_last(last.size() * 4),
      d_copies(copies.size() * 4), d_slots(slots.size() * 8);

  pagedkv::DecodePlanConfig cfg;
  REQUIRE(pagedkv::cuda::decode_plan_config(0, dt, hd, hq, hkv, &cfg) == Status::kSuccess);
  cfg.min_chunk_tokens = 32;  // short sequences split too: the merge runs in most steps
  const pagedkv::DecodePlanCapacity pcap = pagedkv::decode_plan_capacity(cap, cfg);
  std::vector<DecodeWorkItem> items(static_cast<std::size_t>(pcap.items));
  std::vector<DecodeMergeItem> merges(static_cast<std::size_t>(std::max(pcap.merges, 1)));
  DevBuf d_items(items.size() * sizeof(DecodeWorkItem)), d_merges(merges.size() * sizeof(DecodeMergeItem));
  DevBuf ws(std::max<std::size_t>(pcap.workspace_bytes, 16));

  Tensor key(dt, std::int64_t{cap} * hkv * hd), value(dt, key.n), q(dt, std::int64_t{cap} * hq * hd), o(dt, q.n);
  DevBuf lse(static_cast<std::size_t>(cap) * hq * sizeof(float));
  const KVPoolView dview = pool.dev_view();

  DecodeParams p;
  p.q = q.dev.get();
  p.o = o.dev.get();
  p.lse = lse.as<float>();
  p.kv = dview;
  p.pages = PageTable::csr(cap, d_indptr.as<std::int32_t>(), d_indices.as<std::int32_t>(), d_last.as<std::int32_t>());
  p.num_qo_heads = hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(hd));
  p.workspace = ws.get();
  p.workspace_bytes = ws.bytes();
  WriteKVParams w;
  w.key = key.dev.get();
  w.value = value.dev.get();
  w.slot_mapping = d_slots.as<std::int64_t>();
  w.num_tokens = cap;
  w.kv = dview;
  const CopyBlocksParams cp{&dview, 1, d_copies.as<std::int32_t>(), max_copies};

  cudaStream_t stream = nullptr;
  PKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t exec = nullptr;
  std::vector<pagedkv::SeqId> live;
  pagedkv::SeqId next_id = 1;
  int forks = 0, copies_seen = 0, merges_seen = 0, frees = 0, admits = 0;

  for (int step = 0; step < 50; ++step) {
    INFO("step " << step << ", live " << live.size());
    // ---- membership: finish, fork, admit (prompts written outside the graph, like a prefill step) ----
    for (std::size_t i = 0; i < live.size();) {
      const std::size_t len = mgr.sequence(live[i]).num_slotted();
      if (len + 1 >= static_cast<std::size_t>(max_len) || r.range(0, 9) == 0) {
        mgr.free(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        ++frees;
      } else {
        ++i;
      }
    }
    if (!live.empty() && live.size() < static_cast<std::size_t>(cap) && r.range(0, 3) == 0) {
      const pagedkv::SeqId parent = live[static_cast<std::size_t>(r.range(0, static_cast<int>(live.size()) - 1))];
      mgr.fork(parent, next_id);
      live.push_back(next_id++);
      ++forks;
    }
    std::vector<pagedkv::SeqId> admitted;
    while (live.size() < static_cast<std::size_t>(cap) && (live.empty() || r.range(0, 2) == 0)) {
      std::vector<pagedkv::TokenId> prompt(static_cast<std::size_t>(r.range(1, 200)));
      for (auto& t : prompt) t = r.range(1, 30000);
      if (!mgr.try_admit(next_id, prompt).admitted()) break;
      live.push_back(next_id);
      admitted.push_back(next_id++);
      ++admits;
    }
    if (!admitted.empty()) {
      std::vector<std::int32_t> aqo(admitted.size() + 1), acopies(2 * max_copies);
      std::vector<std::int64_t> aslots(admitted.size() * static_cast<std::size_t>(max_len));
      pagedkv::BatchMetadataBuffers amd;
      amd.qo_indptr = aqo;
      amd.slot_mapping = aslots;
      amd.copies = acopies;
      const pagedkv::BatchMetadataSizes asz = mgr.build_batch_metadata(admitted, amd);
      REQUIRE(asz.num_copies == 0);
      const int n = static_cast<int>(asz.num_new_tokens);
      Tensor pk(dt, std::int64_t{n} * hkv * hd), pv(dt, pk.n);
      random_rows(r, pk);
      random_rows(r, pv);
      DevBuf d_aslots = DevBuf::from(aslots);
      WriteKVParams pw = w;
      pw.key = pk.dev.get();
      pw.value = pv.dev.get();
      pw.slot_mapping = d_aslots.as<std::int64_t>();
      pw.num_tokens = n;
      PKT_CUDA(cudaDeviceSynchronize());
      REQUIRE(pagedkv::cuda::write_kv(pw, stream) == Status::kSuccess);
      PKT_CUDA(cudaStreamSynchronize(stream));
      WriteKVParams hw = pw;
      hw.key = pk.host.data();
      hw.value = pv.host.data();
      hw.slot_mapping = aslots.data();
      hw.kv = pool.host_view();
      REQUIRE(pagedkv::reference::write_kv(hw) == Status::kSuccess);
    }
    // ---- one decode token per live sequence (a sequence the pool cannot grow finishes instead) ----
    for (std::size_t i = 0; i < live.size();) {
      const pagedkv::TokenId t = r.range(1, 30000);
      if (mgr.try_append(live[i], std::span<const pagedkv::TokenId>(&t, 1)).ok()) {
        ++i;
      } else {
        mgr.free(live[i]);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        ++frees;
      }
    }
    const pagedkv::BatchMetadataSizes sz = mgr.build_batch_metadata(live, md);
    REQUIRE(sz.batch_size == live.size());
    REQUIRE(sz.num_new_tokens == live.size());
    copies_seen += static_cast<int>(sz.num_copies);
    pagedkv::DecodePlanInfo info;
    REQUIRE(pagedkv::plan_decode(lens, cfg, {items, merges, pcap.partial_rows}, &info) == Status::kSuccess);
    merges_seen += info.num_merges > 0 ? 1 : 0;
    key.randomize(r);
    value.randomize(r);
    q.randomize(r);
    d_indptr.upload(indptr.data(), d_indptr.bytes());
    d_indices.upload(indices.data(), d_indices.bytes());
    d_last.upload(last.data(), d_last.bytes());
    d_copies.upload(copies.data(), d_copies.bytes());
    d_slots.upload(slots.data(), d_slots.bytes());
    d_items.upload(items.data(), d_items.bytes());
    d_merges.upload(merges.data(), d_merges.bytes());
    o.dev.poison();
    lse.poison();
    PKT_CUDA(cudaDeviceSynchronize());  // the uploads and poison (legacy stream) before the non-blocking stream
    if (step == 0) {
      const pagedkv::DecodeWorkList dev_list =
          info.work_list.relocated(d_items.as<DecodeWorkItem>(), d_merges.as<DecodeMergeItem>());
      cudaGraph_t graph = nullptr;
      PKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      const Status s1 = pagedkv::cuda::copy_blocks(cp, stream);
      const Status s2 = pagedkv::cuda::write_kv(w, stream);
      const Status s3 = pagedkv::cuda::decode(p, dev_list, stream);
      PKT_CUDA(cudaStreamEndCapture(stream, &graph));
      REQUIRE(s1 == Status::kSuccess);
      REQUIRE(s2 == Status::kSuccess);
      REQUIRE(s3 == Status::kSuccess);
      PKT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      PKT_CUDA(cudaGraphDestroy(graph));
    }
    PKT_CUDA(cudaGraphLaunch(exec, stream));
    PKT_CUDA(cudaStreamSynchronize(stream));
    o.fetch();
    std::vector<float> got_lse(static_cast<std::size_t>(cap) * hq);
    lse.download(got_lse.data(), got_lse.size() * sizeof(float));

    // ---- the same step on the CPU reference, on the host pool ----
    const KVPoolView hv = pool.host_view();
    const CopyBlocksParams hcp{&hv, 1, copies.data(), max_copies};
    REQUIRE(pagedkv::reference::copy_blocks(hcp) == Status::kSuccess);
    WriteKVParams hw = w;
    hw.key = key.host.data();
    hw.value = value.host.data();
    hw.slot_mapping = slots.data();
    hw.kv = hv;
    REQUIRE(pagedkv::reference::write_kv(hw) == Status::kSuccess);
    Tensor ro(dt, q.n);
    std::vector<float> ref_lse(got_lse.size());
    std::vector<unsigned char> hws(ws.bytes());
    DecodeParams hp = p;
    hp.q = q.host.data();
    hp.o = ro.host.data();
    hp.lse = ref_lse.data();
    hp.kv = hv;
    hp.pages = PageTable::csr(cap, indptr.data(), indices.data(), last.data());
    hp.workspace = hws.data();
    REQUIRE(pagedkv::reference::decode(hp, info.work_list) == Status::kSuccess);

    CHECK(dev_bytes(pool.dk.get(), pool.k_bytes) == pool.hk);  // copies and writes landed exactly
    std::vector<double> rod(static_cast<std::size_t>(q.n));
    for (std::size_t i = 0; i < rod.size(); ++i) rod[i] = ro.at(static_cast<std::int64_t>(i));
    const double err = row_rel_error(to_floats(o), rod, hd);
    INFO("row-relative error vs the reference: " << err << "; " << sz.num_copies << " copies, " << info.num_merges
                                                 << " merges");
    CHECK(err <= 2 * o_tolerance(dt));
    std::vector<double> ref_lse_d(ref_lse.begin(), ref_lse.end());
    std::string why;
    const bool lse_good = lse_ok(got_lse, ref_lse_d, &why);
    INFO(why);
    CHECK(lse_good);
  }
  INFO(admits << " admits, " << forks << " forks, " << frees << " frees, " << copies_seen << " copies, "
              << merges_seen << " steps with merges");
  CHECK(copies_seen >= 1);   // copy_blocks moved data inside the graph at least once
  CHECK(merges_seen >= 10);  // the merge ran in many replays
  CHECK(frees >= 5);
  PKT_CUDA(cudaGraphExecDestroy(exec));
  PKT_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("a captured prefill step (write_kv -> prefill) replays changing splits, prefixes and page tables",
          "[step_graph]") {
  const DType dt = DType::kBFloat16;
  const int hd = 128, hkv = 2, group = 4, hq = hkv * group, bs = 16;
  const int batch = 4, total_q = 192, max_prefix = 300;
  const int max_blocks = (max_prefix + total_q + bs - 1) / bs;
  const int num_blocks = 1 + batch * max_blocks;
  Rng r(180302);
  Pool pool(dt, num_blocks, bs, hkv, hd, Layout::kNhd);
  pool.upload();

  std::vector<std::int32_t> qo(batch + 1), indptr(batch + 1), indices(static_cast<std::size_t>(batch) * max_blocks),
      last(batch);
  std::vector<std::int64_t> slots(total_q);
  DevBuf d_qo(qo.size() * 4), d_indptr(indptr.size() * 4), d_indices(indices.size() * 4), d_last(last.size() * 4),
      d_slots(slots.size() * 8);
  Tensor key(dt, std::int64_t{total_q} * hkv * hd), value(dt, key.n), q(dt, std::int64_t{total_q} * hq * hd), o(dt, q.n);
  DevBuf lse(static_cast<std::size_t>(total_q) * hq * sizeof(float));
  const KVPoolView dview = pool.dev_view();
  PrefillParams p;
  p.q = q.dev.get();
  p.o = o.dev.get();
  p.lse = lse.as<float>();
  p.qo_indptr = d_qo.as<std::int32_t>();
  p.total_q_tokens = total_q;
  p.kv = dview;
  p.pages = PageTable::csr(batch, d_indptr.as<std::int32_t>(), d_indices.as<std::int32_t>(), d_last.as<std::int32_t>());
  p.num_qo_heads = hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(hd));
  WriteKVParams w;
  w.key = key.dev.get();
  w.value = value.dev.get();
  w.slot_mapping = d_slots.as<std::int64_t>();
  w.num_tokens = total_q;
  w.kv = dview;

  cudaStream_t stream = nullptr;
  PKT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraphExec_t exec = nullptr;
  for (int step = 0; step < 8; ++step) {
    INFO("replay " << step);
    // A random split of total_q new tokens (zeros allowed), random cached prefixes, fresh random pages.
    std::vector<int> cut{0, total_q};
    for (int i = 0; i < batch - 1; ++i) cut.push_back(r.range(0, total_q));
    std::sort(cut.begin(), cut.end());
    std::vector<int> ids(static_cast<std::size_t>(num_blocks - 1));
    std::iota(ids.begin(), ids.end(), 1);
    std::shuffle(ids.begin(), ids.end(), r.gen);
    std::fill(pool.hk.begin(), pool.hk.end(), 0xff);
    const KVPoolView hv = pool.host_view();
    std::size_t next = 0;
    std::vector<int> kv_lens(batch);
    indptr[0] = qo[0] = 0;
    for (int b = 0; b < batch; ++b) {
      const int ql = cut[static_cast<std::size_t>(b) + 1] - cut[static_cast<std::size_t>(b)];
      const int prefix = ql == 0 ? r.range(0, 40) : r.range(0, max_prefix);
      kv_lens[b] = prefix + ql;
      qo[b + 1] = qo[b] + ql;
      const int pages = (kv_lens[b] + bs - 1) / bs;
      for (int i = 0; i < pages; ++i) indices[static_cast<std::size_t>(indptr[b] + i)] = ids[next++];
      indptr[b + 1] = indptr[b] + pages;
      last[b] = pages == 0 ? 0 : kv_lens[b] - (pages - 1) * bs;
      for (int t = 0; t < kv_lens[b]; ++t) {
        const std::int64_t slot = std::int64_t{indices[static_cast<std::size_t>(indptr[b] + t / bs)]} * bs + t % bs;
        if (t >= prefix) {
          slots[static_cast<std::size_t>(qo[b] + t - prefix)] = slot;  // written by the graph's write_kv
          continue;
        }
        for (int h = 0; h < hkv; ++h) {  // the cached prefix: already in the pool
          const std::int64_t off = hv.offset(static_cast<std::int32_t>(slot / bs), static_cast<std::int32_t>(slot % bs), h);
          for (int d = 0; d < hd; ++d) {
            store_elem(hv.k, off + d, dt, r.uniform());
            store_elem(hv.v, off + d, dt, r.uniform());
          }
        }
      }
    }
    pool.upload();
    key.randomize(r);
    value.randomize(r);
    q.randomize(r);
    d_qo.upload(qo.data(), d_qo.bytes());
    d_indptr.upload(indptr.data(), d_indptr.bytes());
    d_indices.upload(indices.data(), d_indices.bytes());
    d_last.upload(last.data(), d_last.bytes());
    d_slots.upload(slots.data(), d_slots.bytes());
    o.dev.poison();
    lse.poison();
    PKT_CUDA(cudaDeviceSynchronize());
    if (step == 0) {
      cudaGraph_t graph = nullptr;
      PKT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      const Status s1 = pagedkv::cuda::write_kv(w, stream);
      const Status s2 = pagedkv::cuda::prefill(p, stream);
      PKT_CUDA(cudaStreamEndCapture(stream, &graph));
      REQUIRE(s1 == Status::kSuccess);
      REQUIRE(s2 == Status::kSuccess);
      PKT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      PKT_CUDA(cudaGraphDestroy(graph));
    }
    PKT_CUDA(cudaGraphLaunch(exec, stream));
    PKT_CUDA(cudaStreamSynchronize(stream));
    o.fetch();
    std::vector<float> got_lse(static_cast<std::size_t>(total_q) * hq);
    lse.download(got_lse.data(), got_lse.size() * sizeof(float));

    WriteKVParams hw = w;
    hw.key = key.host.data();
    hw.value = value.host.data();
    hw.slot_mapping = slots.data();
    hw.kv = hv;
    REQUIRE(pagedkv::reference::write_kv(hw) == Status::kSuccess);
    CHECK(dev_bytes(pool.dk.get(), pool.k_bytes) == pool.hk);
    Tensor ro(dt, q.n);
    std::vector<float> ref_lse(got_lse.size());
    PrefillParams hp = p;
    hp.q = q.host.data();
    hp.o = ro.host.data();
    hp.lse = ref_lse.data();
    hp.qo_indptr = qo.data();
    hp.kv = hv;
    hp.pages = PageTable::csr(batch, indptr.data(), indices.data(), last.data());
    REQUIRE(pagedkv::reference::prefill(hp) == Status::kSuccess);
    std::vector<double> rod(static_cast<std::size_t>(q.n));
    for (std::size_t i = 0; i < rod.size(); ++i) rod[i] = ro.at(static_cast<std::int64_t>(i));
    const double err = row_rel_error(to_floats(o), rod, hd);
    INFO("row-relative error vs the reference: " << err);
    CHECK(err <= 2 * o_tolerance(dt));
    std::vector<double> ref_lse_d(ref_lse.begin(), ref_lse.end());
    std::string why;
    const bool lse_good = lse_ok(got_lse, ref_lse_d, &why);
    INFO(why);
    CHECK(lse_good);
  }
  PKT_CUDA(cudaGraphExecDestroy(exec));
  PKT_CUDA(cudaStreamDestroy(stream));
}

TEST_CASE("prefill addresses a pool over 4 GiB with block ids above 2^24", "[offsets64]") {
  const DType dt = DType::kBFloat16;
  const int hd = 64, bs = 1, hkv = 1, group = 4, hq = hkv * group;
  const std::int64_t num_blocks = (std::int64_t{1} << 24) + (std::int64_t{1} << 20) + 17;
  const std::int64_t page_bytes = 2 * bs * hkv * hd * 2;  // interleaved K and V, bf16
  std::size_t free_b = 0, total_b = 0;
  PKT_CUDA(cudaMemGetInfo(&free_b, &total_b));
  REQUIRE(static_cast<double>(free_b) > 1.2 * static_cast<double>(num_blocks * page_bytes));
  DevBuf pool(static_cast<std::size_t>(num_blocks * page_bytes));
  pool.poison();
  const KVPoolView kv = KVPoolView::nhd(pool.get(), dt, static_cast<std::int32_t>(num_blocks), bs, hkv, hd);
  REQUIRE(static_cast<double>(num_blocks) * kv.stride_page > 2147483648.0);

  Rng r(6464);
  const std::vector<std::pair<int, int>> q_kv{{20, 45}, {33, 33}, {1, 70}};
  std::vector<std::int32_t> indptr{0}, indices, last, qo{0};
  for (auto [ql, kl] : q_kv) {
    for (int t = 0; t < kl; ++t) {
      std::int32_t id = 0;
      do {
        id = static_cast<std::int32_t>((std::int64_t{1} << 24) + 1 + r.range(0, (1 << 20) + 10));
      } while (std::find(indices.begin(), indices.end(), id) != indices.end());
      indices.push_back(id);
    }
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(1);
    qo.push_back(qo.back() + ql);
  }
  const int total = static_cast<int>(indices.size()), total_q = qo.back(), batch = static_cast<int>(q_kv.size());
  Tensor key(dt, std::int64_t{total} * hkv * hd), value(dt, key.n);
  key.randomize(r);
  value.randomize(r);
  std::vector<std::int64_t> slots(indices.begin(), indices.end());
  DevBuf d_slots = DevBuf::from(slots);
  WriteKVParams w;
  w.key = key.dev.get();
  w.value = value.dev.get();
  w.slot_mapping = d_slots.as<std::int64_t>();
  w.num_tokens = total;
  w.kv = kv;
  REQUIRE(pagedkv::cuda::write_kv(w) == Status::kSuccess);

  Tensor q(dt, std::int64_t{total_q} * hq * hd), o(dt, q.n);
  q.randomize(r);
  o.dev.poison();
  DevBuf lse(static_cast<std::size_t>(total_q) * hq * sizeof(float));
  lse.poison();
  DevBuf d_indptr = DevBuf::from(indptr), d_indices = DevBuf::from(indices), d_last = DevBuf::from(last),
         d_qo = DevBuf::from(qo);
  PrefillParams p;
  p.q = q.dev.get();
  p.o = o.dev.get();
  p.lse = lse.as<float>();
  p.qo_indptr = d_qo.as<std::int32_t>();
  p.total_q_tokens = total_q;
  p.kv = kv;
  p.pages = PageTable::csr(batch, d_indptr.as<std::int32_t>(), d_indices.as<std::int32_t>(), d_last.as<std::int32_t>());
  p.num_qo_heads = hq;
  p.sm_scale = 1.f / std::sqrt(static_cast<float>(hd));
  PKT_CUDA(cudaDeviceSynchronize());
  REQUIRE(pagedkv::cuda::prefill(p) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  o.fetch();
  std::vector<float> got_lse(static_cast<std::size_t>(total_q) * hq);
  lse.download(got_lse.data(), got_lse.size() * sizeof(float));

  // float64 oracle from the write_kv inputs (token t of sequence b is row indptr[b] + t), causal.
  const std::vector<float> qf = to_floats(q);
  std::vector<double> o_ref(static_cast<std::size_t>(q.n)), lse_ref(got_lse.size());
  for (int b = 0; b < batch; ++b) {
    const int ql = qo[b + 1] - qo[b], kl = indptr[b + 1] - indptr[b];
    for (int i = 0; i < ql; ++i) {
      const int visible = kl - ql + i + 1;
      for (int h = 0; h < hq; ++h) {
        const std::int64_t row = std::int64_t{qo[b] + i} * hq + h;
        std::vector<double> s(static_cast<std::size_t>(visible));
        double m = -std::numeric_limits<double>::infinity();
        for (int t = 0; t < visible; ++t) {
          double acc = 0;
          for (int d = 0; d < hd; ++d) acc += double{qf[row * hd + d]} * key.at(std::int64_t{indptr[b] + t} * hd + d);
          s[static_cast<std::size_t>(t)] = acc * p.sm_scale;
          m = std::max(m, s[static_cast<std::size_t>(t)]);
        }
        double den = 0;
        for (int t = 0; t < visible; ++t) {
          const double e = std::exp(s[static_cast<std::size_t>(t)] - m);
          den += e;
          for (int d = 0; d < hd; ++d) o_ref[row * hd + d] += e * value.at(std::int64_t{indptr[b] + t} * hd + d);
        }
        for (int d = 0; d < hd; ++d) o_ref[row * hd + d] /= den;
        lse_ref[static_cast<std::size_t>(row)] = m + std::log(den);
      }
    }
  }
  CHECK(row_rel_error(to_floats(o), o_ref, hd) <= o_tolerance(dt));
  std::string why;
  const bool lse_good = lse_ok(got_lse, lse_ref, &why);
  INFO(why);
  CHECK(lse_good);
}

namespace {

/// write_kv into a pool whose K base is `pool_off` bytes past a 256-byte boundary, from key/value `src_off` bytes
/// past one: widest_access (cuda/validate.cuh) picks 16 bytes for (0, 0), 8 for an offset of 8, 4 for 4, 2 for 2.
/// Launched twice (poisoned pool between): bit-for-bit equal to each other and to the reference.
void write_kv_at_width(DType dt, int hd, int bs, int src_off, int pool_off, std::uint64_t seed) {
  INFO(dtype_name(dt) << " hd=" << hd << " bs=" << bs << " source offset " << src_off << " B, pool offset "
                      << pool_off << " B");
  Rng r(seed);
  const int heads = 2, nb = 9, n = 37;
  Pool cpu(dt, nb, bs, heads, hd, Layout::kNhd);  // host mirror; its view's strides are the device's
  DevBuf dpool(cpu.k_bytes + 256);
  char* const base = static_cast<char*>(dpool.get()) + pool_off;
  const std::size_t es = pagedkv::dtype_size_bytes(dt);
  const std::int64_t row = std::int64_t{heads} * hd;
  Tensor key(dt, n * row + 64), value(dt, n * row + 64);  // room for the offset
  key.randomize(r);
  value.randomize(r);
  std::vector<std::int64_t> all(static_cast<std::size_t>(nb - 1) * bs);
  std::iota(all.begin(), all.end(), std::int64_t{bs});
  std::shuffle(all.begin(), all.end(), r.gen);
  std::vector<std::int64_t> slots(n);
  for (int i = 0; i < n; ++i) slots[static_cast<std::size_t>(i)] = i % 5 == 2 || static_cast<std::size_t>(i) >= all.size() ? -1 : all[static_cast<std::size_t>(i)];
  DevBuf d_slots = DevBuf::from(slots);
  WriteKVParams p;
  p.key = static_cast<const char*>(key.dev.get()) + src_off;
  p.value = static_cast<const char*>(value.dev.get()) + src_off;
  p.slot_mapping = d_slots.as<std::int64_t>();
  p.num_tokens = n;
  p.kv = cpu.view_on(base, nullptr);
  std::vector<unsigned char> first;
  for (int rep = 0; rep < 2; ++rep) {
    PKT_CUDA(cudaMemcpy(base, cpu.hk.data(), cpu.k_bytes, cudaMemcpyHostToDevice));  // all NaN
    REQUIRE(pagedkv::cuda::write_kv(p) == Status::kSuccess);
    PKT_CUDA(cudaDeviceSynchronize());
    std::vector<unsigned char> got = dev_bytes(base, cpu.k_bytes);
    if (rep == 0) {
      first = std::move(got);
    } else {
      CHECK(got == first);
    }
  }
  WriteKVParams hp = p;
  hp.key = key.host.data() + src_off;
  hp.value = value.host.data() + src_off;
  hp.slot_mapping = slots.data();
  hp.kv = cpu.host_view();
  REQUIRE(pagedkv::reference::write_kv(hp) == Status::kSuccess);
  CHECK(first == cpu.hk);
  (void)es;
}

/// copy_blocks over `layers` pools whose K bases sit `off` bytes past a 256-byte boundary (16 / 8 / 4 / 2-byte
/// accesses as for write_kv), launched twice from the same starting pools: bit-for-bit equal and equal to the reference.
void copy_blocks_at_width(DType dt, int hd, int bs, int off, int layers, std::uint64_t seed) {
  INFO(dtype_name(dt) << " hd=" << hd << " bs=" << bs << " pool offset " << off << " B, layers " << layers);
  Rng r(seed);
  const int nb = 10;
  std::vector<Pool> cpu;
  std::vector<DevBuf> dev;
  cpu.reserve(static_cast<std::size_t>(layers));
  std::vector<pagedkv::KVPoolView> dviews, hviews;
  for (int l = 0; l < layers; ++l) {
    cpu.emplace_back(dt, nb, bs, 2, hd, Layout::kNhd);
    const KVPoolView hv = cpu.back().host_view();
    for (int b = 0; b < nb; ++b)
      for (int t = 0; t < bs; ++t)
        for (int h = 0; h < 2; ++h)
          for (int d = 0; d < hd; ++d) {
            store_elem(hv.k, hv.offset(b, t, h) + d, dt, r.uniform());
            store_elem(hv.v, hv.offset(b, t, h) + d, dt, r.uniform());
          }
    dev.emplace_back(cpu.back().k_bytes + 256);
  }
  for (int l = 0; l < layers; ++l) {
    dviews.push_back(cpu[static_cast<std::size_t>(l)].view_on(static_cast<char*>(dev[static_cast<std::size_t>(l)].get()) + off, nullptr));
  }
  const std::vector<std::int32_t> mapping{1, 5, -1, 9, 2, 6, 3, 7, 4, 8, -1, -1};
  DevBuf d_map = DevBuf::from(mapping);
  const CopyBlocksParams p{dviews.data(), layers, d_map.as<std::int32_t>(), 6};
  std::vector<std::vector<unsigned char>> first(static_cast<std::size_t>(layers));
  for (int rep = 0; rep < 2; ++rep) {
    for (int l = 0; l < layers; ++l) {
      PKT_CUDA(cudaMemcpy(dviews[static_cast<std::size_t>(l)].k, cpu[static_cast<std::size_t>(l)].hk.data(),
                          cpu[static_cast<std::size_t>(l)].k_bytes, cudaMemcpyHostToDevice));
    }
    REQUIRE(pagedkv::cuda::copy_blocks(p) == Status::kSuccess);
    PKT_CUDA(cudaDeviceSynchronize());
    for (int l = 0; l < layers; ++l) {
      std::vector<unsigned char> got = dev_bytes(dviews[static_cast<std::size_t>(l)].k, cpu[static_cast<std::size_t>(l)].k_bytes);
      if (rep == 0) {
        first[static_cast<std::size_t>(l)] = std::move(got);
      } else {
        CHECK(got == first[static_cast<std::size_t>(l)]);
      }
    }
  }
  for (int l = 0; l < layers; ++l) hviews.push_back(cpu[static_cast<std::size_t>(l)].host_view());
  const CopyBlocksParams hp{hviews.data(), layers, mapping.data(), 6};
  REQUIRE(pagedkv::reference::copy_blocks(hp) == Status::kSuccess);
  for (int l = 0; l < layers; ++l) CHECK(first[static_cast<std::size_t>(l)] == cpu[static_cast<std::size_t>(l)].hk);
}

}  // namespace

TEST_CASE("write_kv at every access width (16, 8, 4, 2 bytes), twice, bit for bit", "[write_kv][widths]") {
  std::uint64_t seed = 18400;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (int hd : {64, 128, 256}) {
      for (int bs : {16, 12, 128}) {
        for (int off : {0, 8, 4, 2}) {
          if (off == 2 && dt == DType::kFloat32) continue;  // 4-byte elements cannot sit 2 bytes off
          write_kv_at_width(dt, hd, bs, off, 0, seed++);    // source pointers decide the width
          write_kv_at_width(dt, hd, bs, 0, off, seed++);    // pool pointer decides it
        }
      }
    }
  }
}

TEST_CASE("copy_blocks at every access width (16, 8, 4, 2 bytes), twice, bit for bit", "[copy_blocks][widths]") {
  std::uint64_t seed = 18500;
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (int hd : {64, 256}) {
      for (int bs : {16, 24, 256}) {
        for (int off : {0, 8, 4, 2}) {
          if (off == 2 && dt == DType::kFloat32) continue;
          copy_blocks_at_width(dt, hd, bs, off, off == 0 ? 3 : 1, seed++);
        }
      }
    }
  }
}

TEST_CASE("write_kv, copy_blocks and swap_blocks on small shapes, for compute-sanitizer", "[sanitize]") {
  std::uint64_t seed = 18600;
  for (int off : {0, 8, 4, 2}) {
    write_kv_at_width(DType::kBFloat16, 128, 16, off, 0, seed++);
    copy_blocks_at_width(DType::kBFloat16, 128, 12, off, 2, seed++);
  }
  // swap_blocks: device -> pinned host -> device, bf16, then the bytes back.
  Rng r(seed);
  Pool dev(DType::kBFloat16, 6, 16, 2, 64, Layout::kNhd);
  dev.fill_random(r);
  void* pinned = nullptr;
  PKT_CUDA(cudaHostAlloc(&pinned, dev.k_bytes, 0));
  std::memset(pinned, 0xff, dev.k_bytes);
  const KVPoolView dv = dev.dev_view(), pv = dev.view_on(pinned, nullptr);
  const std::vector<std::int32_t> out_map{1, 3, 2, 4}, in_map{3, 5, 4, 1};
  pagedkv::SwapBlocksParams s{&dv, &pv, 1, out_map.data(), 2, pagedkv::SwapDirection::kDeviceToHost};
  REQUIRE(pagedkv::cuda::swap_blocks(s) == Status::kSuccess);
  pagedkv::SwapBlocksParams back{&pv, &dv, 1, in_map.data(), 2, pagedkv::SwapDirection::kHostToDevice};
  REQUIRE(pagedkv::cuda::swap_blocks(back) == Status::kSuccess);
  PKT_CUDA(cudaDeviceSynchronize());
  const KVPoolView hv = dev.host_view();
  std::vector<unsigned char> host_pool(dev.k_bytes, 0xff);
  const KVPoolView hp = dev.view_on(host_pool.data(), nullptr);
  pagedkv::SwapBlocksParams rs{&hv, &hp, 1, out_map.data(), 2, pagedkv::SwapDirection::kDeviceToHost};
  REQUIRE(pagedkv::reference::swap_blocks(rs) == Status::kSuccess);
  pagedkv::SwapBlocksParams rb{&hp, &hv, 1, in_map.data(), 2, pagedkv::SwapDirection::kHostToDevice};
  REQUIRE(pagedkv::reference::swap_blocks(rb) == Status::kSuccess);
  CHECK(dev_bytes(dev.dk.get(), dev.k_bytes) == dev.hk);
  CHECK(std::memcmp(pinned, host_pool.data(), dev.k_bytes) == 0);
  (void)cudaFreeHost(pinned);
}
