// tests/cuda/test_memory_ops.cpp: write_kv, copy_blocks and swap_blocks against the CPU reference, bit for bit,
// over dtypes, head dims, block sizes and layouts (dense and padded strides, interleaved and separate K/V); plus
// launcher validation tests that need no device ("[host]").
#include "gpu_test_util.hpp"

#include <memory>

#include <pagedkv/reference/copy_blocks.hpp>
#include <pagedkv/reference/swap_blocks.hpp>
#include <pagedkv/reference/write_kv.hpp>

namespace {

using namespace pkt;
using pagedkv::CopyBlocksParams;
using pagedkv::SwapBlocksParams;
using pagedkv::SwapDirection;
using pagedkv::WriteKVParams;

constexpr DType kDTypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};
constexpr Layout kLayouts[] = {Layout::kNhd, Layout::kHnd, Layout::kSeparateNhd, Layout::kSeparateHnd,
                               Layout::kPaddedNhd};

/// Pinned host buffer (cudaHostAlloc), freed on scope exit.
struct PinnedBuf {
  void* p = nullptr;
  explicit PinnedBuf(std::size_t bytes) { PKT_CUDA(cudaHostAlloc(&p, std::max<std::size_t>(bytes, 16), 0)); }
  PinnedBuf(const PinnedBuf&) = delete;
  PinnedBuf& operator=(const PinnedBuf&) = delete;
  ~PinnedBuf() { (void)cudaFreeHost(p); }
};

}  // namespace

TEST_CASE("write_kv matches the reference bit for bit", "[write_kv]") {
  std::uint64_t seed = 1;
  int li = 0;
  for (DType dt : kDTypes) {
    for (int hd : {64, 128, 256}) {
      for (int bs : {1, 8, 16, 32, 64}) {
        for (int pad : {0, 1}) {  // pad = 1: source rows one element apart from dense (narrow accesses)
          const Layout layout = kLayouts[li++ % 5];
          INFO(dtype_name(dt) << " hd=" << hd << " bs=" << bs << " pad=" << pad << " " << layout_name(layout));
          Rng r(seed++);
          const int heads = 2;
          const int nb = 12;
          Pool gpu(dt, nb, bs, heads, hd, layout);
          gpu.upload();  // all NaN
          Pool cpu(dt, nb, bs, heads, hd, layout);
          const int n = 40;
          const std::int64_t stride = std::int64_t{heads} * hd + pad;
          Tensor key(dt, n * stride), value(dt, n * stride);
          key.randomize(r);
          value.randomize(r);
          std::vector<std::int64_t> all(static_cast<std::size_t>(nb - 1) * bs);
          std::iota(all.begin(), all.end(), std::int64_t{bs});  // slots of blocks 1..nb-1
          std::shuffle(all.begin(), all.end(), r.gen);
          std::vector<std::int64_t> slots(n);
          for (int i = 0; i < n; ++i) slots[i] = (i % 7 == 3) ? -1 : all[i % all.size()];
          if (static_cast<std::size_t>(n) > all.size()) {
            for (int i = static_cast<int>(all.size()); i < n; ++i) slots[i] = -1;  // keep slots distinct
          }
          DevBuf d_slots = DevBuf::from(slots);
          WriteKVParams p;
          p.key = key.dev.get();
          p.value = value.dev.get();
          p.stride_token_elems = pad == 0 ? 0 : stride;
          p.slot_mapping = d_slots.as<std::int64_t>();
          p.num_tokens = n;
          p.kv = gpu.dev_view();
          REQUIRE(pagedkv::cuda::write_kv(p) == Status::kSuccess);
          PKT_CUDA(cudaDeviceSynchronize());
          gpu.download();
          WriteKVParams hp = p;
          hp.key = key.host.data();
          hp.value = value.host.data();
          hp.slot_mapping = slots.data();
          hp.kv = cpu.host_view();
          REQUIRE(pagedkv::reference::write_kv(hp) == Status::kSuccess);
          CHECK(gpu.same_bytes(cpu));
        }
      }
    }
  }
}

TEST_CASE("copy_blocks matches the reference bit for bit, every layer in one launch", "[copy_blocks]") {
  std::uint64_t seed = 77;
  int li = 0;
  for (DType dt : kDTypes) {
    for (int hd : {64, 128, 256}) {
      for (int bs : {1, 16, 64}) {
        for (int layers : {1, 3, 67}) {  // 67 > 64: two launches
          if (layers == 67 && hd != 128) continue;
          const Layout layout = kLayouts[li++ % 5];
          INFO(dtype_name(dt) << " hd=" << hd << " bs=" << bs << " layers=" << layers << " " << layout_name(layout));
          Rng r(seed++);
          const int nb = 10;
          std::vector<Pool> gpu, cpu;
          gpu.reserve(static_cast<std::size_t>(layers));
          cpu.reserve(static_cast<std::size_t>(layers));
          std::vector<pagedkv::KVPoolView> dviews, hviews;
          for (int l = 0; l < layers; ++l) {
            gpu.emplace_back(dt, nb, bs, 2, hd, layout);
            gpu.back().fill_random(r);
            cpu.emplace_back(dt, nb, bs, 2, hd, layout);
            cpu.back().hk = gpu.back().hk;
            cpu.back().hv = gpu.back().hv;
          }
          for (int l = 0; l < layers; ++l) {
            dviews.push_back(gpu[l].dev_view());
            hviews.push_back(cpu[l].host_view());
          }
          // (src, dst): 1->5, -1 padding, 2->6, 3->7, 1->8 (a src copied twice), padding at the end.
          const std::vector<std::int32_t> mapping{1, 5, -1, 9, 2, 6, 3, 7, 1, 8, -1, -1};
          DevBuf d_map = DevBuf::from(mapping);
          CopyBlocksParams p{dviews.data(), layers, d_map.as<std::int32_t>(), 6};
          REQUIRE(pagedkv::cuda::copy_blocks(p) == Status::kSuccess);
          PKT_CUDA(cudaDeviceSynchronize());
          CopyBlocksParams hp{hviews.data(), layers, mapping.data(), 6};
          REQUIRE(pagedkv::reference::copy_blocks(hp) == Status::kSuccess);
          bool same = true;
          for (int l = 0; l < layers; ++l) {
            gpu[l].download();
            same = same && gpu[l].same_bytes(cpu[l]);
          }
          CHECK(same);
        }
      }
    }
  }
}

TEST_CASE("swap_blocks moves blocks device <-> pinned host like the reference", "[swap_blocks]") {
  std::uint64_t seed = 333;
  for (DType dt : {DType::kFloat16, DType::kFloat32}) {
    for (Layout layout : kLayouts) {
      for (auto dir : {SwapDirection::kDeviceToHost, SwapDirection::kHostToDevice}) {
        INFO(dtype_name(dt) << " " << layout_name(layout)
                            << (dir == SwapDirection::kDeviceToHost ? " d2h" : " h2d"));
        Rng r(seed++);
        const int nb = 12, bs = 16, heads = 2, hd = 128, layers = 2;
        std::vector<Pool> dev;  // device pools with host mirrors (the reference's view of them)
        std::vector<std::unique_ptr<PinnedBuf>> pin_k, pin_v;
        std::vector<pagedkv::KVPoolView> dviews, pviews, hdviews, hpviews;
        dev.reserve(layers);
        for (int l = 0; l < layers; ++l) {
          dev.emplace_back(dt, nb, bs, heads, hd, layout);
          dev.back().fill_random(r);
        }
        // Host pools: same layout, random contents, pinned.
        std::vector<Pool> host;  // host mirror (its device buffers unused)
        host.reserve(layers);
        for (int l = 0; l < layers; ++l) {
          host.emplace_back(dt, nb, bs, heads, hd, layout);
          host.back().fill_random(r);
          pin_k.push_back(std::make_unique<PinnedBuf>(host[l].k_bytes));
          pin_v.push_back(std::make_unique<PinnedBuf>(host[l].v_bytes));
          std::memcpy(pin_k.back()->p, host[l].hk.data(), host[l].k_bytes);
          if (host[l].v_bytes > 0) std::memcpy(pin_v.back()->p, host[l].hv.data(), host[l].v_bytes);
          dviews.push_back(dev[l].dev_view());
          pviews.push_back(host[l].view_on(pin_k.back()->p, host[l].v_bytes > 0 ? pin_v.back()->p : nullptr));
        }
        // Consecutive runs (3->4, 4->5, 5->6) and scattered pairs, with padding.
        const std::vector<std::int32_t> mapping{3, 4, 4, 5, 5, 6, -1, 0, 9, 1, 1, 11};
        const int pairs = 6;
        SwapBlocksParams p;
        p.num_layers = layers;
        p.block_mapping = mapping.data();
        p.num_pairs = pairs;
        p.direction = dir;
        p.src_layers = dir == SwapDirection::kDeviceToHost ? dviews.data() : pviews.data();
        p.dst_layers = dir == SwapDirection::kDeviceToHost ? pviews.data() : dviews.data();
        REQUIRE(pagedkv::cuda::swap_blocks(p) == Status::kSuccess);
        PKT_CUDA(cudaDeviceSynchronize());

        // Reference on host mirrors.
        for (int l = 0; l < layers; ++l) {
          hdviews.push_back(dev[l].host_view());
          hpviews.push_back(host[l].host_view());
        }
        SwapBlocksParams hp = p;
        hp.src_layers = dir == SwapDirection::kDeviceToHost ? hdviews.data() : hpviews.data();
        hp.dst_layers = dir == SwapDirection::kDeviceToHost ? hpviews.data() : hdviews.data();
        REQUIRE(pagedkv::reference::swap_blocks(hp) == Status::kSuccess);
        bool same = true;
        for (int l = 0; l < layers; ++l) {
          if (dir == SwapDirection::kDeviceToHost) {
            same = same && std::memcmp(pin_k[l]->p, host[l].hk.data(), host[l].k_bytes) == 0;
            if (host[l].v_bytes > 0) same = same && std::memcmp(pin_v[l]->p, host[l].hv.data(), host[l].v_bytes) == 0;
          } else {
            std::vector<unsigned char> gk(dev[l].k_bytes), gv(dev[l].v_bytes);
            PKT_CUDA(cudaMemcpy(gk.data(), dev[l].dk.get(), gk.size(), cudaMemcpyDeviceToHost));
            if (!gv.empty()) PKT_CUDA(cudaMemcpy(gv.data(), dev[l].dv.get(), gv.size(), cudaMemcpyDeviceToHost));
            same = same && gk == dev[l].hk && gv == dev[l].hv;
          }
        }
        CHECK(same);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Launcher validation: no device needed (nothing is launched), so these run in CI without a GPU.

namespace {
void* fake(std::uintptr_t a = 0x10000) { return reinterpret_cast<void*>(a); }  // never dereferenced
}  // namespace

TEST_CASE("launchers validate before launching and name unsupported combinations", "[host][validation]") {
  using pagedkv::DecodeParams;
  using pagedkv::PrefillParams;
  const auto* i32 = static_cast<const std::int32_t*>(fake(0x20000));
  DecodeParams d;
  d.q = fake();
  d.o = fake();
  d.kv = KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 128);
  d.pages = PageTable::csr(4, i32, i32, i32);
  d.num_qo_heads = 32;
  d.sm_scale = 0.088f;

  SECTION("decode") {
    DecodeParams x = d;
    x.num_qo_heads = 30;  // not a multiple of 8 kv heads
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.q = nullptr;
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.q = fake(0x10008);  // not 16-byte aligned
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.kv = KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 96);  // head_dim 96 is not compiled
    CHECK(pagedkv::cuda::decode(x) == Status::kUnsupported);
    x = d;
    x.kv.dtype = static_cast<DType>(7);
    CHECK(pagedkv::cuda::decode(x) == Status::kUnsupported);
    x = d;
    x.max_num_chunks = 8;  // split without workspace
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x.workspace = fake(0x80000);
    x.workspace_bytes = pagedkv::decode_workspace_bytes(4, 8, 32, 128) - 4;
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.kv_chunk_size_tokens = 64;  // a chunk with max_num_chunks == 0
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.sm_scale = std::numeric_limits<float>::quiet_NaN();
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.pages.batch_size = 0;  // nothing to do: no launch
    CHECK(pagedkv::cuda::decode(x) == Status::kSuccess);
  }
  SECTION("prefill") {
    PrefillParams p;
    p.q = d.q;
    p.o = d.o;
    p.kv = d.kv;
    p.pages = d.pages;
    p.num_qo_heads = 32;
    p.sm_scale = 0.088f;
    p.total_q_tokens = 10;
    CHECK(pagedkv::cuda::prefill(p) == Status::kInvalidValue);  // qo_indptr null
    p.qo_indptr = i32;
    p.kv.head_dim = 80;
    CHECK(pagedkv::cuda::prefill(p) == Status::kUnsupported);
    p.kv.head_dim = 128;
    p.total_q_tokens = 0;
    CHECK(pagedkv::cuda::prefill(p) == Status::kSuccess);
  }
  SECTION("write_kv, copy_blocks, swap_blocks") {
    WriteKVParams w;
    w.kv = d.kv;
    w.num_tokens = 3;
    CHECK(pagedkv::cuda::write_kv(w) == Status::kInvalidValue);  // null key/value/slots
    w.num_tokens = 0;
    CHECK(pagedkv::cuda::write_kv(w) == Status::kSuccess);
    w.kv.head_dim = 32;
    CHECK(pagedkv::cuda::write_kv(w) == Status::kUnsupported);

    KVPoolView layers[2] = {d.kv, d.kv};
    layers[1].stride_head += 8;  // layers must share strides
    CopyBlocksParams c{layers, 2, i32, 4};
    CHECK(pagedkv::cuda::copy_blocks(c) == Status::kInvalidValue);
    layers[1] = d.kv;
    c.capacity = 0;
    CHECK(pagedkv::cuda::copy_blocks(c) == Status::kSuccess);

    const std::int32_t bad_map[2] = {70, 1};  // src 70 >= num_blocks 64
    SwapBlocksParams s;
    s.src_layers = layers;
    s.dst_layers = layers;
    s.num_layers = 1;
    s.block_mapping = bad_map;
    s.num_pairs = 1;
    CHECK(pagedkv::cuda::swap_blocks(s) == Status::kInvalidValue);
  }
}

TEST_CASE("decode_plan splits only when the batch cannot fill the GPU", "[host][decode_plan]") {
  const auto one = pagedkv::cuda::decode_plan(1, 32768, 32, 8, 128, DType::kBFloat16, 132);
  CHECK(one.kv_chunk_size_tokens == 1024);
  CHECK(one.max_num_chunks == 32);
  CHECK(one.num_ctas == 256);
  CHECK(one.workspace_bytes == pagedkv::decode_workspace_bytes(1, 32, 32, 128));
  const auto big = pagedkv::cuda::decode_plan(64, 4096, 32, 8, 128, DType::kBFloat16, 132);
  CHECK(big.max_num_chunks == 0);
  CHECK(big.workspace_bytes == 0);
  CHECK(big.num_ctas == 512);
  const auto bad = pagedkv::cuda::decode_plan(1, 32768, 32, 8, 96, DType::kBFloat16, 132);
  CHECK(bad.max_num_chunks == 0);
  CHECK(pagedkv::cuda::is_supported(DType::kFloat16, 256));
  CHECK_FALSE(pagedkv::cuda::is_supported(DType::kFloat16, 192));
}

TEST_CASE("launchers reject an fp8 KV pool with kUnsupported (CPU reference only)", "[host][validation][fp8]") {
  using pagedkv::DecodeParams;
  using pagedkv::KVDType;
  using pagedkv::PrefillParams;
  const auto* i32 = static_cast<const std::int32_t*>(fake(0x20000));
  const auto* i64 = static_cast<const std::int64_t*>(fake(0x30000));
  const KVPoolView fp8 =
      KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 128, KVDType::kFp8E4M3, 0.01f, 0.02f);
  CHECK(fp8.storage_size_bytes() == 1);
  CHECK(static_cast<char*>(fp8.v) - static_cast<char*>(fp8.k) == 16 * 8 * 128);  // V after 1-byte K page

  DecodeParams d;
  d.q = fake();
  d.o = fake();
  d.kv = fp8;
  d.pages = PageTable::csr(4, i32, i32, i32);
  d.num_qo_heads = 32;
  d.sm_scale = 0.088f;
  CHECK(pagedkv::cuda::decode(d) == Status::kUnsupported);

  PrefillParams p;
  p.q = d.q;
  p.o = d.o;
  p.kv = fp8;
  p.pages = d.pages;
  p.num_qo_heads = 32;
  p.sm_scale = 0.088f;
  p.qo_indptr = i32;
  p.total_q_tokens = 10;
  CHECK(pagedkv::cuda::prefill(p) == Status::kUnsupported);

  WriteKVParams w;
  w.kv = fp8;
  w.key = fake();
  w.value = fake(0x50000);
  w.slot_mapping = i64;
  w.num_tokens = 3;
  CHECK(pagedkv::cuda::write_kv(w) == Status::kUnsupported);

  KVPoolView layers[2] = {fp8, fp8};
  CopyBlocksParams c{layers, 2, i32, 4};
  CHECK(pagedkv::cuda::copy_blocks(c) == Status::kUnsupported);

  const std::int32_t map[2] = {1, 2};
  SwapBlocksParams s;
  s.src_layers = layers;
  s.dst_layers = layers;
  s.num_layers = 1;
  s.block_mapping = map;
  s.num_pairs = 1;
  CHECK(pagedkv::cuda::swap_blocks(s) == Status::kUnsupported);

  // A malformed fp8 view is still kInvalidValue (shape checks come first).
  w.kv.block_size = 0;
  CHECK(pagedkv::cuda::write_kv(w) == Status::kInvalidValue);
}
