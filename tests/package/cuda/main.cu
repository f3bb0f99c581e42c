// tests/package/cuda/main.cu: uses the installed pagedkv::cuda from a CUDA translation unit. Plans a decode batch on
// the host (pagedkv/decode_plan.hpp), runs the same work list on the CPU reference and, when a GPU is present,
// write_kv + decode on the GPU, and compares the two. Exit: 0 equal within tolerance, 1 mismatch or error,
// 77 no CUDA device (after the host part ran and every launcher linked).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include <pagedkv/cuda/common.cuh>  // the installed device templates compile in a consumer TU
#include <pagedkv/cuda/launch.hpp>
#include <pagedkv/decode_plan.hpp>
#include <pagedkv/pagedkv.hpp>  // the whole host API compiles in a consumer's CUDA TU (C++20 from pagedkv::cuda)
#include <pagedkv/reference/all.hpp>

namespace {

// A consumer kernel using the installed device helpers (bf16 <-> float round trip).
__global__ void round_trip(const float* in, float* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = pagedkv::cuda::detail::to_float(pagedkv::cuda::detail::from_float<__nv_bfloat16>(in[i]));
}

}  // namespace

int main() {
  using pagedkv::DType;
  using pagedkv::Status;
  const int bs = 16, hkv = 2, group = 4, hq = hkv * group, hd = 64;
  const std::vector<std::int32_t> lens = {300, 0, 45};
  std::vector<std::int32_t> indptr{0}, indices, last;
  int next_block = 1;
  for (const std::int32_t len : lens) {
    const int pages = (len + bs - 1) / bs;
    for (int i = 0; i < pages; ++i) indices.push_back(next_block++);
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(pages == 0 ? 0 : len - (pages - 1) * bs);
  }
  const int num_blocks = next_block;
  const std::size_t pool_elems = static_cast<std::size_t>(num_blocks) * 2 * bs * hkv * hd;
  // The manager that would hand out these block ids; the kernels' views below are checked against its config.
  pagedkv::CacheConfig manager_config;
  manager_config.num_blocks = static_cast<std::size_t>(num_blocks);
  manager_config.block_size = bs;
  const pagedkv::KVCacheManager<> cache(manager_config);

  // K/V rows for every token (slot order), q: deterministic, non-zero, fp32.
  int tokens = 0;
  for (const std::int32_t len : lens) tokens += len;
  std::vector<float> key(static_cast<std::size_t>(tokens) * hkv * hd), value(key.size()), q(lens.size() * hq * hd);
  std::vector<std::int64_t> slots;
  for (std::size_t b = 0; b < lens.size(); ++b) {
    for (int t = 0; t < lens[b]; ++t) slots.push_back(std::int64_t{indices[indptr[b] + t / bs]} * bs + t % bs);
  }
  for (std::size_t i = 0; i < key.size(); ++i) {
    key[i] = std::sin(0.37f * static_cast<float>(i) + 0.5f);
    value[i] = std::cos(0.23f * static_cast<float>(i) + 0.25f);
  }
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.91f * static_cast<float>(i) + 1.f);

  // The plan: the CUDA kernel's head tiling on a small stand-in device, so the 300-token sequence is split.
  pagedkv::DecodePlanConfig cfg;
  cfg.num_qo_heads = hq;
  cfg.num_kv_heads = hkv;
  cfg.head_dim = hd;
  cfg.heads_per_tile = pagedkv::cuda::decode_heads_per_tile(DType::kFloat32, hd, group);
  cfg.num_sms = 4;
  cfg.ctas_per_sm = 2;
  cfg.min_chunk_tokens = 32;
  const auto cap = pagedkv::decode_plan_capacity(static_cast<std::int32_t>(lens.size()), cfg);
  std::vector<pagedkv::DecodeWorkItem> items(cap.items);
  std::vector<pagedkv::DecodeMergeItem> merges(cap.merges);
  pagedkv::DecodePlanInfo info;
  if (pagedkv::plan_decode(lens, cfg, {items, merges, cap.partial_rows}, &info) != Status::kSuccess) return 1;

  // CPU reference executing the plan.
  std::vector<float> pool(pool_elems, std::nanf("")), o_ref(q.size()), lse_ref(lens.size() * hq);
  std::vector<float> ws(cap.workspace_bytes / sizeof(float) + 1);
  pagedkv::WriteKVParams w;
  w.key = key.data();
  w.value = value.data();
  w.slot_mapping = slots.data();
  w.num_tokens = tokens;
  w.kv = pagedkv::make_kv_pool_view(cache.config(), pagedkv::KVLayout::kNhd, pool.data(), nullptr,
                                     {.dtype = DType::kFloat32, .num_kv_heads = hkv, .head_dim = hd});
  pagedkv::DecodeParams p;
  p.q = q.data();
  p.o = o_ref.data();
  p.lse = lse_ref.data();
  p.kv = w.kv;
  p.pages = pagedkv::PageTable::csr(static_cast<std::int32_t>(lens.size()), indptr.data(), indices.data(), last.data());
  p.num_qo_heads = hq;
  p.sm_scale = 0.125f;
  p.workspace = ws.data();
  p.workspace_bytes = ws.size() * sizeof(float);
  if (pagedkv::reference::write_kv(w) != Status::kSuccess || pagedkv::reference::decode(p, info.work_list) != Status::kSuccess) {
    std::printf("pagedkv cuda consumer: reference failed\n");
    return 1;
  }

  std::int32_t sms = 0;
  const Status dev = pagedkv::cuda::device_sm_count(0, &sms);
  if (dev == Status::kNoDevice) {
    // Linked against every launcher used below; validation still runs without a device.
    pagedkv::DecodeParams bad = p;
    bad.num_qo_heads = 7;
    const bool validates = pagedkv::cuda::decode(bad, info.work_list) == Status::kInvalidValue;
    std::printf("pagedkv %d.%d.%d cuda consumer: plan %d items / %d split, reference ok, launcher validation %s; "
                "no CUDA device: GPU part not run\n",
                PAGEDKV_VERSION_MAJOR, PAGEDKV_VERSION_MINOR, PAGEDKV_VERSION_PATCH, info.num_items, info.num_merges,
                validates ? "ok" : "WRONG");
    return validates ? 77 : 1;
  }
  if (dev != Status::kSuccess) return 1;

  // GPU: the same write_kv + the same work list.
  float *d_pool = nullptr, *d_key = nullptr, *d_value = nullptr, *d_q = nullptr, *d_o = nullptr, *d_lse = nullptr,
        *d_ws = nullptr, *d_in = nullptr, *d_out = nullptr;
  std::int64_t* d_slots = nullptr;
  std::int32_t *d_indptr = nullptr, *d_indices = nullptr, *d_last = nullptr;
  pagedkv::DecodeWorkItem* d_items = nullptr;
  pagedkv::DecodeMergeItem* d_merges = nullptr;
  bool ok = cudaMalloc(&d_pool, pool_elems * 4) == cudaSuccess && cudaMemset(d_pool, 0xff, pool_elems * 4) == cudaSuccess &&
            cudaMalloc(&d_key, key.size() * 4) == cudaSuccess && cudaMalloc(&d_value, key.size() * 4) == cudaSuccess &&
            cudaMalloc(&d_q, q.size() * 4) == cudaSuccess && cudaMalloc(&d_o, q.size() * 4) == cudaSuccess &&
            cudaMalloc(&d_lse, lse_ref.size() * 4) == cudaSuccess && cudaMalloc(&d_ws, ws.size() * 4) == cudaSuccess &&
            cudaMalloc(&d_slots, slots.size() * 8) == cudaSuccess && cudaMalloc(&d_indptr, indptr.size() * 4) == cudaSuccess &&
            cudaMalloc(&d_indices, indices.size() * 4) == cudaSuccess && cudaMalloc(&d_last, last.size() * 4) == cudaSuccess &&
            cudaMalloc(&d_items, items.size() * sizeof(items[0])) == cudaSuccess &&
            cudaMalloc(&d_merges, merges.size() * sizeof(merges[0])) == cudaSuccess &&
            cudaMalloc(&d_in, 256 * 4) == cudaSuccess && cudaMalloc(&d_out, 256 * 4) == cudaSuccess;
  ok = ok && cudaMemcpy(d_key, key.data(), key.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_value, value.data(), key.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_q, q.data(), q.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_slots, slots.data(), slots.size() * 8, cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_indptr, indptr.data(), indptr.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_indices, indices.data(), indices.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_last, last.data(), last.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_items, items.data(), items.size() * sizeof(items[0]), cudaMemcpyHostToDevice) == cudaSuccess &&
       cudaMemcpy(d_merges, merges.data(), merges.size() * sizeof(merges[0]), cudaMemcpyHostToDevice) == cudaSuccess;
  if (!ok) {
    std::printf("pagedkv cuda consumer: CUDA allocation or copy failed\n");
    return 1;
  }
  pagedkv::WriteKVParams dw = w;
  dw.key = d_key;
  dw.value = d_value;
  dw.slot_mapping = d_slots;
  dw.kv = pagedkv::KVPoolView::nhd(d_pool, DType::kFloat32, num_blocks, bs, hkv, hd);
  pagedkv::check_kv_pool_view(cache.config(), dw.kv);  // a view made by hand: checked against the manager's
  pagedkv::DecodeParams dp = p;
  dp.q = d_q;
  dp.o = d_o;
  dp.lse = d_lse;
  dp.kv = dw.kv;
  dp.pages = pagedkv::PageTable::csr(static_cast<std::int32_t>(lens.size()), d_indptr, d_indices, d_last);
  dp.workspace = d_ws;
  dp.workspace_bytes = ws.size() * sizeof(float);
  const Status s1 = pagedkv::cuda::write_kv(dw);
  const Status s2 = pagedkv::cuda::decode(dp, info.work_list.relocated(d_items, d_merges));
  round_trip<<<1, 256>>>(d_in, d_out, 0);
  std::vector<float> o(q.size()), lse(lse_ref.size());
  ok = s1 == Status::kSuccess && s2 == Status::kSuccess && cudaDeviceSynchronize() == cudaSuccess &&
       cudaMemcpy(o.data(), d_o, o.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess &&
       cudaMemcpy(lse.data(), d_lse, lse.size() * 4, cudaMemcpyDeviceToHost) == cudaSuccess;
  double err = 0, mag = 0;
  for (std::size_t i = 0; i < o.size(); ++i) {
    err = std::fmax(err, std::isfinite(o[i]) ? std::fabs(o[i] - o_ref[i]) : 1e30);
    mag = std::fmax(mag, std::fabs(o_ref[i]));
  }
  for (std::size_t i = 0; i < lse.size(); ++i) {
    const bool both_inf = std::isinf(lse[i]) && std::isinf(lse_ref[i]) && lse[i] < 0 && lse_ref[i] < 0;
    if (!both_inf && !(std::fabs(lse[i] - lse_ref[i]) <= 1e-4 * std::fmax(1.0, std::fabs(lse_ref[i])))) ok = false;
  }
  ok = ok && err <= 1e-5 * mag;
  std::printf("pagedkv cuda consumer on %d SMs: write_kv %s, decode %s, max |o - reference| / max |reference| %.3g: %s\n",
              sms, pagedkv::to_string(s1), pagedkv::to_string(s2), mag > 0 ? err / mag : err, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
