// tests/cuda/test_memory_ops.cpp: write_kv, copy_blocks and swap_blocks against the CPU reference, bit for bit,
// over dtypes, head dims, block sizes and layouts (dense and padded strides, interleaved and separate K/V);
// swap_blocks' memory-space check (pageable memory refused); a launch check that ignores an earlier unrelated error;
// plus launcher validation tests that need no device ("[host]").
#include "gpu_test_util.hpp"

#include <cstdio>
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
  for (DType dt : {DType::kFloat16, DType::kFloat32, DType::kBFloat16}) {
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

TEST_CASE("swap_blocks refuses pageable host memory and non-device memory, queueing nothing", "[swap_blocks]") {
  Rng r(4242);
  const int nb = 6, bs = 16, heads = 2, hd = 64;
  for (DType dt : {DType::kBFloat16, DType::kFloat32}) {
    Pool dev(dt, nb, bs, heads, hd, Layout::kNhd);
    dev.fill_random(r);
    Pool host(dt, nb, bs, heads, hd, Layout::kNhd);  // its host mirror is plain (pageable) std::vector memory
    host.fill_random(r);
    const std::vector<unsigned char> host_before = host.hk;
    const pagedkv::KVPoolView dview = dev.dev_view();
    const pagedkv::KVPoolView pageable = host.host_view();
    const std::vector<std::int32_t> mapping{1, 2, 3, 4};
    SwapBlocksParams p;
    p.num_layers = 1;
    p.block_mapping = mapping.data();
    p.num_pairs = 2;
    // Device -> pageable host: refused, the host pool untouched.
    p.direction = SwapDirection::kDeviceToHost;
    p.src_layers = &dview;
    p.dst_layers = &pageable;
    CHECK(pagedkv::cuda::swap_blocks(p) == Status::kWrongMemorySpace);
    PKT_CUDA(cudaDeviceSynchronize());
    CHECK(host.hk == host_before);
    // Pageable host -> device: refused, the device pool untouched.
    p.direction = SwapDirection::kHostToDevice;
    p.src_layers = &pageable;
    p.dst_layers = &dview;
    CHECK(pagedkv::cuda::swap_blocks(p) == Status::kWrongMemorySpace);
    std::vector<unsigned char> gk(dev.k_bytes);
    PKT_CUDA(cudaMemcpy(gk.data(), dev.dk.get(), gk.size(), cudaMemcpyDeviceToHost));
    CHECK(gk == dev.hk);
    // Both sides on the device (the "host" side is device memory): refused too.
    p.direction = SwapDirection::kDeviceToHost;
    p.src_layers = &dview;
    p.dst_layers = &dview;
    CHECK(pagedkv::cuda::swap_blocks(p) == Status::kWrongMemorySpace);
    // The same host pool once registered (page-locked) is accepted and copies.
    PKT_CUDA(cudaHostRegister(host.hk.data(), host.hk.size(), cudaHostRegisterDefault));
    p.dst_layers = &pageable;
    CHECK(pagedkv::cuda::swap_blocks(p) == Status::kSuccess);
    PKT_CUDA(cudaDeviceSynchronize());
    PKT_CUDA(cudaHostUnregister(host.hk.data()));
    // Host block 2 now holds device block 1, host block 4 device block 3 (whole pages: K and V interleaved).
    const std::size_t page_bytes = static_cast<std::size_t>(dview.stride_page) * pagedkv::dtype_size_bytes(dt);
    CHECK(std::memcmp(host.hk.data() + 2 * page_bytes, dev.hk.data() + 1 * page_bytes, page_bytes) == 0);
    CHECK(std::memcmp(host.hk.data() + 4 * page_bytes, dev.hk.data() + 3 * page_bytes, page_bytes) == 0);
    CHECK(std::memcmp(host.hk.data(), host_before.data(), page_bytes) == 0);  // block 0 untouched
  }
}

TEST_CASE("a launcher reports its own launch, not an earlier unrelated error", "[launch]") {
  // Leave a non-sticky error in the thread's last-error slot (a failed allocation), as some other code might.
  void* never = nullptr;
  REQUIRE(cudaMalloc(&never, std::size_t{1} << 62) != cudaSuccess);
  REQUIRE(cudaPeekAtLastError() != cudaSuccess);  // the unrelated error is pending
  Rng r(77);
  Pool gpu(DType::kBFloat16, 4, 16, 2, 128, Layout::kNhd);
  gpu.upload();
  Pool cpu(DType::kBFloat16, 4, 16, 2, 128, Layout::kNhd);
  Tensor key(DType::kBFloat16, 3 * 2 * 128), value(DType::kBFloat16, 3 * 2 * 128);
  key.randomize(r);
  value.randomize(r);
  const std::vector<std::int64_t> slots{16, 17, 40};
  DevBuf d_slots = DevBuf::from(slots);
  WriteKVParams p;
  p.key = key.dev.get();
  p.value = value.dev.get();
  p.slot_mapping = d_slots.as<std::int64_t>();
  p.num_tokens = 3;
  p.kv = gpu.dev_view();
  CHECK(pagedkv::cuda::write_kv(p) == Status::kSuccess);  // cudaPeekAtLastError would have said kCudaError
  (void)cudaGetLastError();                               // clear the test's own error
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
    x.window.sliding_window_tokens = -1;  // a negative sliding window
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.window.attention_chunk_tokens = -8;  // a negative attention chunk
    CHECK(pagedkv::cuda::decode(x) == Status::kInvalidValue);
    x = d;
    x.pages.batch_size = 0;  // nothing to do: no launch
    CHECK(pagedkv::cuda::decode(x) == Status::kSuccess);
    x.window = pagedkv::AttentionWindow{4096, 8192};  // a valid window changes nothing in the checks
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
    p.window.attention_chunk_tokens = -1;  // a negative attention chunk
    CHECK(pagedkv::cuda::prefill(p) == Status::kInvalidValue);
    p.window = pagedkv::AttentionWindow{-2, 0};  // a negative sliding window
    CHECK(pagedkv::cuda::prefill(p) == Status::kInvalidValue);
    p.window = pagedkv::AttentionWindow{512, 0};
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

TEST_CASE("decode work-list launcher validates the list's host-side shape", "[host][validation][plan]") {
  using pagedkv::DecodeParams;
  const auto* i32 = static_cast<const std::int32_t*>(fake(0x20000));
  DecodeParams d;
  d.q = fake();
  d.o = fake();
  d.kv = KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 128);
  d.pages = PageTable::csr(4, i32, i32, i32);
  d.num_qo_heads = 32;
  d.sm_scale = 0.088f;
  d.workspace = fake(0x80000);
  d.workspace_bytes = pagedkv::decode_plan_workspace_bytes(16, 32, 128);
  pagedkv::DecodeWorkList wl;
  wl.items = static_cast<const pagedkv::DecodeWorkItem*>(fake(0x90000));
  wl.item_capacity = 64;
  wl.merges = static_cast<const pagedkv::DecodeMergeItem*>(fake(0xa0000));
  wl.merge_capacity = 4;
  wl.heads_per_tile = 4;
  wl.partial_row_capacity = 16;
  pagedkv::DecodeWorkList x = wl;
  DecodeParams y = d;
  SECTION("heads_per_tile 0") { x.heads_per_tile = 0; }
  SECTION("heads_per_tile above the group") { x.heads_per_tile = 5; }
  SECTION("null items") { x.items = nullptr; }
  SECTION("misaligned items") { x.items = static_cast<const pagedkv::DecodeWorkItem*>(fake(0x90008)); }
  SECTION("misaligned merges") { x.merges = static_cast<const pagedkv::DecodeMergeItem*>(fake(0xa0004)); }
  SECTION("negative capacity") { x.merge_capacity = -1; }
  SECTION("workspace too small for the rows") { y.workspace_bytes -= 4; }
  SECTION("no workspace") { y.workspace = nullptr; }
  SECTION("q misaligned") { y.q = fake(0x10004); }
  SECTION("negative sliding window") { y.window.sliding_window_tokens = -16; }
  CHECK(pagedkv::cuda::decode(y, x) == Status::kInvalidValue);
}

TEST_CASE("decode work-list launcher: heads per item beyond the kernel's row slots, unsupported shapes",
          "[host][validation][plan]") {
  using pagedkv::DecodeParams;
  const auto* i32 = static_cast<const std::int32_t*>(fake(0x20000));
  DecodeParams d;
  d.q = fake();
  d.o = fake();
  d.kv = KVPoolView::nhd(fake(0x40000), DType::kFloat32, 64, 16, 1, 128);
  d.pages = PageTable::csr(4, i32, i32, i32);
  d.num_qo_heads = 24;  // group 24 > 8 row slots at fp32 x 128
  d.sm_scale = 0.088f;
  pagedkv::DecodeWorkList wl;
  wl.items = static_cast<const pagedkv::DecodeWorkItem*>(fake(0x90000));
  wl.item_capacity = 8;
  wl.heads_per_tile = 12;
  CHECK(pagedkv::cuda::decode(d, wl) == Status::kInvalidValue);
  d.kv.head_dim = 96;
  wl.heads_per_tile = 8;
  CHECK(pagedkv::cuda::decode(d, wl) == Status::kUnsupported);
  d.kv.head_dim = 128;
  d.pages.batch_size = 0;  // valid, nothing to do
  CHECK(pagedkv::cuda::decode(d, wl) == Status::kSuccess);
}

TEST_CASE("decode_row_slots and decode_heads_per_tile mirror the kernel's tiling", "[host][plan]") {
  using pagedkv::cuda::decode_heads_per_tile;
  using pagedkv::cuda::decode_row_slots;
  CHECK(decode_row_slots(DType::kBFloat16, 64) == 16);
  CHECK(decode_row_slots(DType::kFloat16, 128) == 8);
  CHECK(decode_row_slots(DType::kFloat32, 64) == 8);
  CHECK(decode_row_slots(DType::kBFloat16, 96) == 0);
  CHECK(decode_heads_per_tile(DType::kBFloat16, 128, 4) == 4);
  CHECK(decode_heads_per_tile(DType::kBFloat16, 128, 8) == 8);
  CHECK(decode_heads_per_tile(DType::kBFloat16, 128, 12) == 6);   // two tiles of 6
  CHECK(decode_heads_per_tile(DType::kBFloat16, 64, 12) == 12);   // 16 slots: one tile
  CHECK(decode_heads_per_tile(DType::kFloat32, 256, 24) == 8);
  CHECK(decode_heads_per_tile(DType::kFloat32, 256, 17) == 6);    // three tiles of 6, 6, 5
  CHECK(decode_heads_per_tile(DType::kFloat32, 96, 4) == 0);
  CHECK(pagedkv::cuda::is_supported(DType::kFloat16, 256));
  CHECK_FALSE(pagedkv::cuda::is_supported(DType::kFloat16, 192));
}

TEST_CASE("decode_plan_config and device_sm_count agree on whether there is a device", "[host][plan]") {
  pagedkv::DecodePlanConfig cfg;
  CHECK(pagedkv::cuda::decode_plan_config(0, DType::kBFloat16, 128, 32, 8, nullptr) == Status::kInvalidValue);
  CHECK(pagedkv::cuda::decode_plan_config(0, DType::kBFloat16, 128, 30, 8, &cfg) == Status::kInvalidValue);
  CHECK(pagedkv::cuda::decode_plan_config(0, DType::kBFloat16, 96, 32, 8, &cfg) == Status::kUnsupported);
  std::int32_t sms = 0;
  const Status dev = pagedkv::cuda::device_sm_count(0, &sms);
  const Status s = pagedkv::cuda::decode_plan_config(0, DType::kBFloat16, 128, 32, 8, &cfg);
  if (dev == Status::kNoDevice) {
    CHECK(s == Status::kNoDevice);
    CHECK(cfg.num_sms == 0);  // untouched
  } else {
    REQUIRE(dev == Status::kSuccess);
    REQUIRE(s == Status::kSuccess);
    CHECK(cfg.num_sms == sms);
    CHECK(cfg.ctas_per_sm >= 1);
    CHECK(cfg.heads_per_tile == 4);
    std::printf("decode_plan_config: %d SMs x %d CTAs/SM for the bf16 x d128 decode kernel\n", cfg.num_sms,
                cfg.ctas_per_sm);
  }
}

TEST_CASE("swap_blocks checks memory spaces only after the shapes (no device: kNoDevice)", "[host][validation]") {
  const KVPoolView v = KVPoolView::nhd(fake(0x40000), DType::kBFloat16, 64, 16, 8, 128);
  const std::int32_t map[2] = {1, 2};
  SwapBlocksParams s;
  s.src_layers = &v;
  s.dst_layers = &v;
  s.num_layers = 1;
  s.block_mapping = map;
  s.num_pairs = 1;
  std::int32_t sms = 0;
  const Status dev = pagedkv::cuda::device_sm_count(0, &sms);
  // Fake addresses are neither page-locked host nor device memory: with a device that is kWrongMemorySpace,
  // without one the query fails with kNoDevice. Either way nothing is queued.
  CHECK(pagedkv::cuda::swap_blocks(s) == (dev == Status::kNoDevice ? Status::kNoDevice : Status::kWrongMemorySpace));
}
