// make_kv_pool_view / check_kv_pool_view (issue 22): the kernels' pool view made from the manager's configuration,
// and the check that refuses a view whose block size or block count disagrees with the manager's. The trap it
// closes: a manager with block size 16 and a view with block size 8 wrote K/V into the wrong block and returned
// success; here the manager's own slot mapping goes through the reference write_kv and every token is read back
// through the block table.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/kv_cache_groups.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)
#include <pagedkv/kv_pool_view.hpp>
#include <pagedkv/reference/write_kv.hpp>

namespace {

using pagedkv::DType;
using pagedkv::Errc;
using pagedkv::KVLayout;
using pagedkv::KVPoolShape;
using pagedkv::KVPoolView;
using pagedkv_test::expect_error;
using pagedkv_test::toks;

}  // namespace

TEST_CASE("make_kv_pool_view takes the block size and count from the manager's config", "[kv_pool_view]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 37;
  c.block_size = 12;  // not a power of two
  const KVPoolShape shape{DType::kFloat32, 3, 8};
  std::vector<float> pool(pagedkv::kv_pool_bytes(c, shape) / sizeof(float));
  CHECK(pool.size() == 37u * 2 * 12 * 3 * 8);
  const KVPoolView v = pagedkv::make_kv_pool_view(c, KVLayout::kNhd, pool.data(), nullptr, shape);
  const KVPoolView want = KVPoolView::nhd(pool.data(), DType::kFloat32, 37, 12, 3, 8);
  CHECK(v.num_blocks == want.num_blocks);
  CHECK(v.block_size == want.block_size);
  CHECK(v.stride_page == want.stride_page);
  CHECK(v.stride_token == want.stride_token);
  CHECK(v.stride_head == want.stride_head);
  CHECK(v.v == want.v);
  pagedkv::check_kv_pool_view(c, v);  // consistent: no throw

  std::vector<float> k(pool.size() / 2), vv(pool.size() / 2);
  const KVPoolView s = pagedkv::make_kv_pool_view(c, KVLayout::kSeparateHnd, k.data(), vv.data(), shape);
  CHECK(s.stride_head == 12 * 8);
  CHECK(s.v == vv.data());
  // The hybrid manager's configuration works the same way.
  pagedkv::HybridCacheConfig h;
  h.num_blocks = 37;
  h.block_size = 12;
  CHECK(pagedkv::make_kv_pool_view(h, KVLayout::kHnd, pool.data(), nullptr, shape).block_size == 12);
}

TEST_CASE("check_kv_pool_view refuses a view the manager's slots do not address", "[kv_pool_view][errors]") {
  pagedkv::CacheConfig c;
  c.num_blocks = 64;
  c.block_size = 16;
  std::vector<std::uint16_t> pool(64 * 2 * 16 * 2 * 4);
  const KVPoolView wrong_bs = KVPoolView::nhd(pool.data(), DType::kBFloat16, 64, 8, 2, 4);
  CHECK_THAT(expect_error([&] { pagedkv::check_kv_pool_view(c, wrong_bs); }, Errc::kInvalidArgument),
             Catch::Contains("block_size = 8") && Catch::Contains("block_size = 16") &&
                 Catch::Contains("wrong block"));
  const KVPoolView too_few = KVPoolView::nhd(pool.data(), DType::kBFloat16, 63, 16, 2, 4);
  CHECK_THAT(expect_error([&] { pagedkv::check_kv_pool_view(c, too_few); }, Errc::kInvalidArgument),
             Catch::Contains("num_blocks = 63") && Catch::Contains("up to 63"));
  const KVPoolView more = KVPoolView::nhd(pool.data(), DType::kBFloat16, 64, 16, 2, 4);
  pagedkv::check_kv_pool_view(c, more);

  const KVPoolShape shape{DType::kBFloat16, 2, 4};
  CHECK_THAT(expect_error([&] { (void)pagedkv::make_kv_pool_view(c, KVLayout::kNhd, nullptr, nullptr, shape); },
                          Errc::kInvalidArgument),
             Catch::Contains("k is null"));
  CHECK_THAT(expect_error([&] { (void)pagedkv::make_kv_pool_view(c, KVLayout::kNhd, pool.data(), pool.data(), shape); },
                          Errc::kInvalidArgument),
             Catch::Contains("interleaved"));
  CHECK_THAT(expect_error([&] { (void)pagedkv::make_kv_pool_view(c, KVLayout::kSeparateNhd, pool.data(), nullptr, shape); },
                          Errc::kInvalidArgument),
             Catch::Contains("v is null"));
  CHECK_THAT(expect_error([&] { (void)pagedkv::make_kv_pool_view(c, KVLayout::kNhd, pool.data(), nullptr,
                                                                   KVPoolShape{DType::kBFloat16, 0, 4}); },
                          Errc::kInvalidArgument),
             Catch::Contains("num_kv_heads = 0"));
  pagedkv::CacheConfig huge = c;
  huge.block_size = pagedkv::kMaxBlockSize + 1;
  CHECK_THAT(expect_error([&] { (void)pagedkv::make_kv_pool_view(huge, KVLayout::kNhd, pool.data(), nullptr, shape); },
                          Errc::kInvalidArgument),
             Catch::Contains("block_size = 65537"));
  huge = c;
  huge.num_blocks = std::size_t{1} << 40;
  CHECK_THAT(expect_error([&] { (void)pagedkv::kv_pool_bytes(huge, KVPoolShape{DType::kFloat32, 1 << 20, 1 << 10}); },
                          Errc::kLimitExceeded),
             Catch::Contains("overflows"));
}

TEST_CASE("the manager's slot mapping through a view made from its config lands every token in its block",
          "[kv_pool_view][write_kv]") {
  // Random prompts, shared prefixes (hits) and decode steps; after every build the reference write_kv writes each
  // new token's K (its position + 1000 * sequence) through the view, then every token of every sequence is read
  // back through its block table. A view with another block size fails this read-back (checked at the end).
  const std::uint32_t bs = GENERATE(1U, 5U, 16U);
  pagedkv::CacheConfig c;
  c.num_blocks = 256;
  c.block_size = bs;
  pagedkv::KVCacheManager<pagedkv::Xxh3Hasher> m(c);
  const KVPoolShape shape{DType::kFloat32, 1, 2};
  std::vector<float> pool(pagedkv::kv_pool_bytes(c, shape) / sizeof(float), std::numeric_limits<float>::quiet_NaN());
  const KVPoolView view = pagedkv::make_kv_pool_view(c, KVLayout::kNhd, pool.data(), nullptr, shape);
  pagedkv::check_kv_pool_view(c, view);
  std::map<pagedkv::SeqId, std::vector<float>> want;  // per sequence: the value written at each position
  const auto step = [&](const std::vector<pagedkv::SeqId>& batch) {
    std::vector<std::int64_t> slots(512);
    std::vector<std::int32_t> copies(64), qo(batch.size() + 1);
    pagedkv::BatchMetadataBuffers buf;
    buf.slot_mapping = slots;
    buf.copies = copies;
    buf.qo_indptr = qo;
    std::vector<std::size_t> first;
    for (auto id : batch) first.push_back(m.sequence(id).num_built);
    const auto sz = m.build_batch_metadata(batch, buf);
    std::vector<float> key(2 * sz.num_new_tokens), value(2 * sz.num_new_tokens);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      for (auto t = qo[b]; t < qo[b + 1]; ++t) {
        const float x = static_cast<float>(first[b] + static_cast<std::size_t>(t - qo[b])) +
                        1000.f * static_cast<float>(batch[b]);
        key[2 * static_cast<std::size_t>(t)] = key[2 * static_cast<std::size_t>(t) + 1] = x;
        value[2 * static_cast<std::size_t>(t)] = value[2 * static_cast<std::size_t>(t) + 1] = x;
      }
    }
    pagedkv::WriteKVParams w;
    w.key = key.data();
    w.value = value.data();
    w.stride_token_elems = 2;
    w.slot_mapping = slots.data();
    w.num_tokens = static_cast<std::int32_t>(sz.num_new_tokens);
    w.kv = view;
    REQUIRE(pagedkv::reference::write_kv(w) == pagedkv::Status::kSuccess);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      auto& v = want.at(batch[b]);
      while (v.size() < m.sequence(batch[b]).num_built) {
        v.push_back(static_cast<float>(v.size()) + 1000.f * static_cast<float>(batch[b]));
      }
    }
  };
  // Sequences 1..6 with distinct prompts (no hits: each position holds its own sequence's value).
  for (pagedkv::SeqId id = 1; id <= 6; ++id) {
    REQUIRE(m.try_admit(id, toks(static_cast<pagedkv::TokenId>(id * 100), 3 + 4 * id)).admitted());
    want[id];
  }
  step({1, 2, 3, 4, 5, 6});
  for (int s = 0; s < 7; ++s) {
    for (pagedkv::SeqId id = 1; id <= 6; ++id) REQUIRE(m.try_append(id, toks(7, 1)).ok());
    step({1, 2, 3, 4, 5, 6});
  }
  std::size_t read = 0;
  const auto read_back = [&](const KVPoolView& v) {
    bool all = true;
    for (const auto& [id, vals] : want) {
      const auto blocks = m.block_ids(id);
      for (std::size_t p = 0; p < vals.size(); ++p) {
        const float got = static_cast<const float*>(v.k)[v.offset(blocks[p / bs], static_cast<std::int64_t>(p % bs), 0)];
        all = all && got == vals[p];
        ++read;
      }
    }
    return all;
  };
  CHECK(read_back(view));
  CHECK(read > 100);
  if (bs > 1) {  // the same pool read through a view with another block size: wrong blocks
    const KVPoolView other = KVPoolView::nhd(pool.data(), DType::kFloat32, 256, static_cast<std::int32_t>(bs - 1), 1, 2);
    CHECK_FALSE(read_back(other));
    CHECK_THROWS_AS(pagedkv::check_kv_pool_view(c, other), pagedkv::Error);
  }
}
