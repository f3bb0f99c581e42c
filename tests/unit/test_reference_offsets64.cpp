// 64-bit offsets in the CPU reference: one fp8 (e4m3) KV pool of 2^24 + 2^20 + 17 blocks (block size 4, one kv head,
// head_dim 16: 128 one-byte elements per interleaved K+V page), i.e. 2,281,703,552 elements, more than 2^31, in
// 2.1 GiB of lazily zeroed host memory. Every sequence lives in blocks with ids above 2^24, so every element offset
// exceeds 2^31 and every slot exceeds 2^26: a 32-bit product anywhere (block * stride_page, slot arithmetic) reads
// or writes the wrong bytes. Checked: write_kv stores e4m3(x / scale) at the right bytes and nowhere else nearby;
// decode (no split, uniform chunks, and a length-aware plan) matches a float64 oracle computed with this file's own
// 64-bit address arithmetic; copy_blocks and swap_blocks move high blocks byte for byte. Unused slots of the last
// page of each sequence hold e4m3 NaN (0x7f), so reading past a sequence's length fails.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/reference/all.hpp>

namespace {

namespace ref = pagedkv::reference;
using pagedkv::DType;
using pagedkv::KVDType;
using pagedkv::KVPoolView;
using pagedkv::Status;

constexpr std::int64_t kBlockSize = 4, kHeads = 1, kDim = 16;
constexpr std::int64_t kPage = kBlockSize * kHeads * kDim;        // elements of K (or V) per block
constexpr std::int64_t kStridePage = 2 * kPage;                    // interleaved K, V
constexpr std::int64_t kNumBlocks = (std::int64_t{1} << 24) + (std::int64_t{1} << 20) + 17;
constexpr float kKScale = 0.05f, kVScale = 0.02f;
constexpr std::uint8_t kFp8Nan = 0x7f;

static_assert(kNumBlocks * kStridePage > (std::int64_t{1} << 31), "the pool must exceed 2^31 elements");

struct FreeDeleter {
  void operator()(void* p) const noexcept { std::free(p); }
};

/// calloc'ed bytes: pages the test never touches are never materialized.
std::unique_ptr<std::uint8_t, FreeDeleter> huge_zeroed(std::size_t bytes) {
  return std::unique_ptr<std::uint8_t, FreeDeleter>(static_cast<std::uint8_t*>(std::calloc(bytes, 1)));
}

/// Byte offset of (K or V, block, token, head, dim), computed here in 64 bits, independently of KVPoolView.
std::int64_t byte_at(int kv, std::int64_t block, std::int64_t t, std::int64_t h, std::int64_t d) {
  return block * kStridePage + kv * kPage + t * (kHeads * kDim) + h * kDim + d;
}

}  // namespace

TEST_CASE("reference ops address a pool of more than 2^31 elements with block ids above 2^24",
          "[reference][offsets64][fp8]") {
  const auto bytes = static_cast<std::size_t>(kNumBlocks * kStridePage);
  const auto pool = huge_zeroed(bytes);
  REQUIRE(pool != nullptr);
  std::uint8_t* base = pool.get();
  const KVPoolView kv = KVPoolView::nhd(base, DType::kBFloat16, static_cast<std::int32_t>(kNumBlocks),
                                        static_cast<std::int32_t>(kBlockSize), kHeads, kDim, KVDType::kFp8E4M3,
                                        kKScale, kVScale);
  REQUIRE(kv.stride_page == kStridePage);
  REQUIRE(static_cast<std::uint8_t*>(kv.v) - base == kPage);

  std::mt19937_64 rng(2024);
  // Three sequences of 37, 50 and 9 tokens in distinct blocks above 2^24, one of them the very last block.
  const std::vector<std::int32_t> lens = {37, 50, 9};
  std::vector<std::int32_t> indptr{0}, indices, last;
  std::vector<std::int32_t> used;
  for (const std::int32_t len : lens) {
    const std::int32_t pages = (len + 3) / 4;
    for (std::int32_t i = 0; i < pages; ++i) {
      std::int32_t id = 0;
      do {
        id = static_cast<std::int32_t>(std::uniform_int_distribution<std::int64_t>((std::int64_t{1} << 24) + 1, kNumBlocks - 2)(rng));
      } while (std::find(used.begin(), used.end(), id) != used.end());
      used.push_back(id);
      indices.push_back(id);
    }
    indptr.push_back(static_cast<std::int32_t>(indices.size()));
    last.push_back(len - (pages - 1) * 4);
  }
  indices.back() = static_cast<std::int32_t>(kNumBlocks - 1);  // the last page of the last sequence: the last block
  used.back() = indices.back();
  for (const std::int32_t id : used) {  // every used page starts all-NaN; its neighbours stay zero
    std::memset(base + id * kStridePage, kFp8Nan, static_cast<std::size_t>(kStridePage));
  }
  for (const std::int32_t id : used) REQUIRE(std::int64_t{id} * kStridePage > (std::int64_t{1} << 31));

  // ---- write_kv: every token's K/V row into its slot (slot = block * 4 + offset > 2^26) ----
  const auto total = static_cast<std::int32_t>(std::accumulate(lens.begin(), lens.end(), 0));
  std::vector<std::uint16_t> key(static_cast<std::size_t>(total * kDim)), value(key.size());
  std::vector<float> keyf(key.size()), valuef(key.size());
  std::uniform_real_distribution<float> u(0.05f, 1.f);
  for (std::size_t i = 0; i < key.size(); ++i) {
    const float a = (rng() & 1) != 0 ? u(rng) : -u(rng);
    const float b = (rng() & 1) != 0 ? u(rng) : -u(rng);
    ref::store(key.data(), DType::kBFloat16, static_cast<std::int64_t>(i), a);
    ref::store(value.data(), DType::kBFloat16, static_cast<std::int64_t>(i), b);
    keyf[i] = ref::load(key.data(), DType::kBFloat16, static_cast<std::int64_t>(i));
    valuef[i] = ref::load(value.data(), DType::kBFloat16, static_cast<std::int64_t>(i));
  }
  std::vector<std::int64_t> slots;
  for (std::size_t b = 0; b < lens.size(); ++b) {
    for (std::int32_t t = 0; t < lens[b]; ++t) {
      slots.push_back(std::int64_t{indices[static_cast<std::size_t>(indptr[b] + t / 4)]} * kBlockSize + t % 4);
    }
  }
  pagedkv::WriteKVParams w;
  w.key = key.data();
  w.value = value.data();
  w.slot_mapping = slots.data();
  w.num_tokens = total;
  w.kv = kv;
  REQUIRE(ref::write_kv(w) == Status::kSuccess);
  int wrong_bytes = 0;
  for (std::int32_t i = 0; i < total; ++i) {
    const std::int64_t blk = slots[static_cast<std::size_t>(i)] / 4, t = slots[static_cast<std::size_t>(i)] % 4;
    for (std::int64_t d = 0; d < kDim; ++d) {
      const auto idx = static_cast<std::size_t>(i * kDim + d);
      wrong_bytes += base[byte_at(0, blk, t, 0, d)] != ref::float_to_fp8_e4m3_bits(keyf[idx] / kKScale) ? 1 : 0;
      wrong_bytes += base[byte_at(1, blk, t, 0, d)] != ref::float_to_fp8_e4m3_bits(valuef[idx] / kVScale) ? 1 : 0;
    }
  }
  CHECK(wrong_bytes == 0);
  // Nothing written outside the used pages: their neighbours are still zero.
  int dirty_neighbours = 0;
  for (const std::int32_t id : used) {
    for (const std::int64_t nb : {std::int64_t{id} - 1, std::int64_t{id} + 1}) {
      if (nb >= kNumBlocks || std::find(used.begin(), used.end(), nb) != used.end()) continue;
      for (std::int64_t e = 0; e < kStridePage; ++e) dirty_neighbours += base[nb * kStridePage + e] != 0 ? 1 : 0;
    }
  }
  CHECK(dirty_neighbours == 0);
  // Low blocks (where a wrapped 32-bit offset would land) untouched.
  CHECK(std::all_of(base, base + 4096, [](std::uint8_t x) { return x == 0; }));

  // ---- decode: float64 oracle over the dequantized bytes ----
  const int hq = 2, batch = static_cast<int>(lens.size());
  std::vector<std::uint16_t> q(static_cast<std::size_t>(batch * hq * kDim));
  for (std::size_t i = 0; i < q.size(); ++i) ref::store(q.data(), DType::kBFloat16, static_cast<std::int64_t>(i), (rng() & 1) != 0 ? u(rng) : -u(rng));
  const float scale = 0.25f;
  std::vector<double> o_ref(q.size()), lse_ref(static_cast<std::size_t>(batch * hq));
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hq; ++h) {
      const int row = b * hq + h;
      std::vector<double> s(static_cast<std::size_t>(lens[static_cast<std::size_t>(b)]));
      double m = -std::numeric_limits<double>::infinity();
      for (int t = 0; t < lens[static_cast<std::size_t>(b)]; ++t) {
        const std::int64_t blk = indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(b)] + t / 4)];
        double acc = 0;
        for (int d = 0; d < kDim; ++d) {
          acc += ref::load(q.data(), DType::kBFloat16, row * kDim + d) *
                 static_cast<double>(ref::fp8_e4m3_bits_to_float(base[byte_at(0, blk, t % 4, 0, d)]) * kKScale);
        }
        s[static_cast<std::size_t>(t)] = acc * scale;
        m = std::max(m, s[static_cast<std::size_t>(t)]);
      }
      double den = 0;
      for (int t = 0; t < lens[static_cast<std::size_t>(b)]; ++t) {
        const std::int64_t blk = indices[static_cast<std::size_t>(indptr[static_cast<std::size_t>(b)] + t / 4)];
        const double p = std::exp(s[static_cast<std::size_t>(t)] - m);
        den += p;
        for (int d = 0; d < kDim; ++d) {
          o_ref[static_cast<std::size_t>(row * kDim + d)] +=
              p * static_cast<double>(ref::fp8_e4m3_bits_to_float(base[byte_at(1, blk, t % 4, 0, d)]) * kVScale);
        }
      }
      for (int d = 0; d < kDim; ++d) o_ref[static_cast<std::size_t>(row * kDim + d)] /= den;
      lse_ref[static_cast<std::size_t>(row)] = m + std::log(den);
    }
  }
  double max_ref = 0;
  for (const double x : o_ref) max_ref = std::max(max_ref, std::abs(x));
  REQUIRE(max_ref > 0);

  pagedkv::DecodeParams p;
  p.q = q.data();
  p.kv = kv;
  p.pages = pagedkv::PageTable::csr(batch, indptr.data(), indices.data(), last.data());
  p.num_qo_heads = hq;
  p.sm_scale = scale;
  const auto check_outputs = [&](const std::vector<std::uint16_t>& o, const std::vector<float>& lse) {
    double err = 0, lse_err = 0;
    for (std::size_t i = 0; i < o.size(); ++i) {
      const double g = ref::load(o.data(), DType::kBFloat16, static_cast<std::int64_t>(i));
      err = std::max(err, std::isfinite(g) ? std::abs(g - o_ref[i]) : std::numeric_limits<double>::infinity());
    }
    for (std::size_t i = 0; i < lse.size(); ++i) {
      lse_err = std::max<double>(lse_err, std::isfinite(lse[i]) ? std::abs(lse[i] - lse_ref[i]) / std::max(1.0, std::abs(lse_ref[i]))
                                                                : std::numeric_limits<double>::infinity());
    }
    CHECK(err / max_ref <= 1e-2);
    CHECK(lse_err <= 1e-5);
  };
  SECTION("no split") {
    std::vector<std::uint16_t> o(q.size(), 0x7fc0);
    std::vector<float> lse(lse_ref.size(), std::numeric_limits<float>::quiet_NaN());
    p.o = o.data();
    p.lse = lse.data();
    REQUIRE(ref::decode(p) == Status::kSuccess);
    check_outputs(o, lse);
  }
  SECTION("uniform chunks of 6 tokens") {
    std::vector<std::uint16_t> o(q.size(), 0x7fc0);
    std::vector<float> lse(lse_ref.size(), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> ws(pagedkv::decode_workspace_bytes(batch, 9, hq, kDim) / 4);
    p.o = o.data();
    p.lse = lse.data();
    p.kv_chunk_size_tokens = 6;
    p.max_num_chunks = 9;
    p.workspace = ws.data();
    p.workspace_bytes = ws.size() * 4;
    REQUIRE(ref::decode(p) == Status::kSuccess);
    check_outputs(o, lse);
  }
  SECTION("a length-aware plan") {
    pagedkv::DecodePlanConfig cfg;
    cfg.num_qo_heads = hq;
    cfg.num_kv_heads = kHeads;
    cfg.head_dim = kDim;
    cfg.num_sms = 4;
    cfg.ctas_per_sm = 2;
    cfg.min_chunk_tokens = 5;
    cfg.item_overhead_tokens = 0;
    const auto cap = pagedkv::decode_plan_capacity(batch, cfg);
    std::vector<pagedkv::DecodeWorkItem> items(static_cast<std::size_t>(cap.items));
    std::vector<pagedkv::DecodeMergeItem> merges(static_cast<std::size_t>(cap.merges));
    pagedkv::DecodePlanInfo info;
    REQUIRE(pagedkv::plan_decode(lens, cfg, {items, merges, cap.partial_rows}, &info) == Status::kSuccess);
    REQUIRE(info.num_merges >= 1);
    std::vector<std::uint16_t> o(q.size(), 0x7fc0);
    std::vector<float> lse(lse_ref.size(), std::numeric_limits<float>::quiet_NaN());
    std::vector<float> ws(cap.workspace_bytes / 4 + 1);
    p.o = o.data();
    p.lse = lse.data();
    p.workspace = ws.data();
    p.workspace_bytes = ws.size() * 4;
    REQUIRE(ref::decode(p, info.work_list) == Status::kSuccess);
    check_outputs(o, lse);
  }
  SECTION("copy_blocks and swap_blocks move high blocks byte for byte") {
    // Copy the first sequence's first page onto a free block just below the end of the pool.
    const std::int32_t src = indices[0];
    const auto dst = static_cast<std::int32_t>(kNumBlocks - 3);
    REQUIRE(std::find(used.begin(), used.end(), dst) == used.end());
    const std::vector<std::int32_t> mapping = {src, dst, -1, -1};
    const pagedkv::CopyBlocksParams cp{&kv, 1, mapping.data(), 2};
    REQUIRE(ref::copy_blocks(cp) == Status::kSuccess);
    CHECK(std::memcmp(base + std::int64_t{dst} * kStridePage, base + std::int64_t{src} * kStridePage,
                      static_cast<std::size_t>(kStridePage)) == 0);
    // Swap it out to a 4-block pool (same strides), then back in to another high block.
    std::vector<std::uint8_t> small(static_cast<std::size_t>(4 * kStridePage), 0);
    const KVPoolView host = KVPoolView::nhd(small.data(), DType::kBFloat16, 4, static_cast<std::int32_t>(kBlockSize),
                                            kHeads, kDim, KVDType::kFp8E4M3, kKScale, kVScale);
    const std::vector<std::int32_t> out_map = {dst, 2};
    const pagedkv::SwapBlocksParams out{&kv, &host, 1, out_map.data(), 1, pagedkv::SwapDirection::kDeviceToHost};
    REQUIRE(ref::swap_blocks(out) == Status::kSuccess);
    CHECK(std::memcmp(small.data() + 2 * kStridePage, base + std::int64_t{src} * kStridePage,
                      static_cast<std::size_t>(kStridePage)) == 0);
    const auto back = static_cast<std::int32_t>(kNumBlocks - 5);
    REQUIRE(std::find(used.begin(), used.end(), back) == used.end());
    const std::vector<std::int32_t> in_map = {2, back};
    const pagedkv::SwapBlocksParams in{&host, &kv, 1, in_map.data(), 1, pagedkv::SwapDirection::kHostToDevice};
    REQUIRE(ref::swap_blocks(in) == Status::kSuccess);
    CHECK(std::memcmp(base + std::int64_t{back} * kStridePage, base + std::int64_t{src} * kStridePage,
                      static_cast<std::size_t>(kStridePage)) == 0);
  }
}
