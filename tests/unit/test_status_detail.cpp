// Tests of the error details of the CPU reference ops (pagedkv::last_status_detail(), kernel_params.hpp): for every
// op, a table of bad launches, one per precondition category, each checked for the status, the field the detail
// names, and the bad value in its message; nothing is written by a refused call. Also the issue-22 fixes: a zero,
// negative or non-finite sm_scale and a block size above kMaxBlockSize are refused (both were accepted before).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/all.hpp>

namespace {

using pagedkv::CopyBlocksParams;
using pagedkv::DecodeParams;
using pagedkv::DType;
using pagedkv::KVDType;
using pagedkv::KVPoolView;
using pagedkv::PageTable;
using pagedkv::PrefillParams;
using pagedkv::Status;
using pagedkv::SwapBlocksParams;
using pagedkv::WriteKVParams;
namespace ref = pagedkv::reference;

constexpr std::int32_t kBlocks = 6;
constexpr std::int32_t kBs = 4;
constexpr std::int32_t kHeads = 2;
constexpr std::int32_t kDim = 8;
constexpr std::int32_t kQoHeads = 4;

/// A small fp32 NHD pool and a 2-sequence CSR page table (5 and 7 tokens), filled with finite values.
struct Fixture {
  std::vector<float> pool = std::vector<float>(std::size_t{kBlocks} * 2 * kBs * kHeads * kDim, 0.25f);
  std::vector<std::int32_t> indptr{0, 2, 4};
  std::vector<std::int32_t> indices{1, 2, 3, 4};
  std::vector<std::int32_t> last{1, 3};
  std::vector<std::int32_t> qo_indptr{0, 2, 5};
  std::vector<float> q = std::vector<float>(std::size_t{5} * kQoHeads * kDim, 0.5f);
  std::vector<float> o = std::vector<float>(std::size_t{5} * kQoHeads * kDim, 42.f);
  std::vector<float> ws = std::vector<float>(4096, 42.f);
  std::vector<std::int64_t> slots{0, 5, -1, 23};
  std::vector<float> kv_rows = std::vector<float>(std::size_t{4} * kHeads * kDim, 1.f);
  std::vector<std::int32_t> pairs{1, 5, 2, 0};

  KVPoolView view() { return KVPoolView::nhd(pool.data(), DType::kFloat32, kBlocks, kBs, kHeads, kDim); }
  DecodeParams decode() {
    DecodeParams p;
    p.q = q.data();
    p.o = o.data();
    p.kv = view();
    p.pages = PageTable::csr(2, indptr.data(), indices.data(), last.data());
    p.num_qo_heads = kQoHeads;
    p.sm_scale = 1.f / std::sqrt(float{kDim});
    return p;
  }
  PrefillParams prefill() {
    PrefillParams p;
    p.q = q.data();
    p.o = o.data();
    p.qo_indptr = qo_indptr.data();
    p.total_q_tokens = 5;
    p.kv = view();
    p.pages = PageTable::csr(2, indptr.data(), indices.data(), last.data());
    p.num_qo_heads = kQoHeads;
    p.sm_scale = 1.f / std::sqrt(float{kDim});
    return p;
  }
};

/// One bad launch: how to break a valid params struct, and what the detail must say.
template <class P>
struct BadCase {
  const char* what;
  std::function<void(P&, Fixture&)> mutate;
  Status want;
  const char* field;  // StatusDetail::field
  const char* value;  // a substring of StatusDetail::message (the bad value, formatted)
};

template <class P, class Run>
void check_table(const std::vector<BadCase<P>>& table, P (Fixture::*make)(), Run&& run) {
  for (const BadCase<P>& c : table) {
    Fixture f;
    P p = (f.*make)();
    REQUIRE(run(p) == Status::kSuccess);  // the base launch is valid
    Fixture g;  // fresh buffers: the refused call must write nothing
    P x = (g.*make)();
    c.mutate(x, g);
    const std::vector<float> o_before = g.o;
    const std::vector<float> pool_before = g.pool;
    INFO("case: " << c.what);
    const Status s = run(x);
    CHECK(std::string(pagedkv::to_string(s)) == pagedkv::to_string(c.want));
    const pagedkv::StatusDetail& d = pagedkv::last_status_detail();
    INFO("detail: " << d.message);
    CHECK(d.status == c.want);
    CHECK(std::string(d.field) == c.field);
    CHECK(std::string(d.message).find(c.field) != std::string::npos);
    CHECK(std::string(d.message).find(c.value) != std::string::npos);
    CHECK(g.o == o_before);
    CHECK(g.pool == pool_before);
  }
}

}  // namespace

TEST_CASE("StatusDetail: reference::decode names the failed check, the field and the bad value",
          "[reference][validation][detail]") {
  using P = DecodeParams;
  const std::vector<BadCase<P>> table = {
      {"sm_scale 0 (the default)", [](P& p, Fixture&) { p.sm_scale = 0.f; }, Status::kInvalidValue, "sm_scale", "= 0"},
      {"negative sm_scale", [](P& p, Fixture&) { p.sm_scale = -0.5f; }, Status::kInvalidValue, "sm_scale", "-0.5"},
      {"NaN sm_scale", [](P& p, Fixture&) { p.sm_scale = std::numeric_limits<float>::quiet_NaN(); },
       Status::kInvalidValue, "sm_scale", "nan"},
      {"infinite sm_scale", [](P& p, Fixture&) { p.sm_scale = std::numeric_limits<float>::infinity(); },
       Status::kInvalidValue, "sm_scale", "inf"},
      {"block_size 2^31 - 1", [](P& p, Fixture&) { p.kv.block_size = std::numeric_limits<std::int32_t>::max(); },
       Status::kInvalidValue, "kv.block_size", "2147483647"},
      {"block_size kMaxBlockSize + 1", [](P& p, Fixture&) { p.kv.block_size = static_cast<std::int32_t>(pagedkv::kMaxBlockSize) + 1; },
       Status::kInvalidValue, "kv.block_size", "65537"},
      {"block_size 0", [](P& p, Fixture&) { p.kv.block_size = 0; }, Status::kInvalidValue, "kv.block_size", "= 0"},
      {"dtype not an enumerator", [](P& p, Fixture&) { p.kv.dtype = static_cast<DType>(9); }, Status::kUnsupported,
       "kv.dtype", "= 9"},
      {"fp8 k_scale 0", [](P& p, Fixture&) { p.kv = p.kv.with_fp8_e4m3(0.f, 1.f); }, Status::kInvalidValue,
       "kv.k_scale", "= 0"},
      {"null k", [](P& p, Fixture&) { p.kv.k = nullptr; }, Status::kInvalidValue, "kv.k", "null"},
      {"negative stride", [](P& p, Fixture&) { p.kv.stride_token = -3; }, Status::kInvalidValue, "kv.stride_token",
       "-3"},
      {"page stride below the page span", [](P& p, Fixture&) { p.kv.stride_page = 7; }, Status::kInvalidValue,
       "kv.stride_page", "= 7"},
      {"heads not a multiple", [](P& p, Fixture&) { p.num_qo_heads = 3; }, Status::kInvalidValue, "num_qo_heads",
       "= 3"},
      {"negative window", [](P& p, Fixture&) { p.window.sliding_window_tokens = -2; }, Status::kInvalidValue,
       "window.sliding_window_tokens", "-2"},
      {"indptr decreasing",
       [](P& p, Fixture& f) {
         f.indptr = {0, 3, 2};
         p.pages.indptr = f.indptr.data();
       },
       Status::kInvalidValue, "pages.indptr", "[2] = 2"},
      {"block id out of range",
       [](P& p, Fixture& f) {
         f.indices[3] = kBlocks;
         p.pages.indices = f.indices.data();
       },
       Status::kInvalidValue, "pages.indices", "[3] = 6"},
      {"last_page_len above block_size",
       [](P& p, Fixture& f) {
         f.last[1] = kBs + 1;
         p.pages.last_page_len = f.last.data();
       },
       Status::kInvalidValue, "pages.last_page_len", "[1] = 5"},
      {"null q", [](P& p, Fixture&) { p.q = nullptr; }, Status::kInvalidValue, "q", "null"},
      {"negative split chunk", [](P& p, Fixture&) { p.kv_chunk_size_tokens = -1; }, Status::kInvalidValue,
       "kv_chunk_size_tokens", "-1"},
      {"too few chunks",
       [](P& p, Fixture&) {
         p.kv_chunk_size_tokens = 2;
         p.max_num_chunks = 3;
       },
       Status::kInvalidValue, "max_num_chunks", "= 3"},
      {"workspace too small",
       [](P& p, Fixture& f) {
         p.kv_chunk_size_tokens = 4;
         p.max_num_chunks = 2;
         p.workspace = f.ws.data();
         p.workspace_bytes = 12;
       },
       Status::kInvalidValue, "workspace_bytes", "= 12"},
  };
  check_table(table, &Fixture::decode, [](const P& p) { return ref::decode(p, 1); });
  SECTION("the thread count") {
    Fixture f;
    CHECK(ref::decode(f.decode(), -2) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message) == "num_threads = -2: must be >= 0");
  }
}

TEST_CASE("StatusDetail: reference::prefill names the failed check - qo_indptr[0] must be 0",
          "[reference][validation][detail]") {
  using P = PrefillParams;
  const std::vector<BadCase<P>> table = {
      {"sm_scale 0 (the default)", [](P& p, Fixture&) { p.sm_scale = 0.f; }, Status::kInvalidValue, "sm_scale", "= 0"},
      {"negative sm_scale", [](P& p, Fixture&) { p.sm_scale = -1.f; }, Status::kInvalidValue, "sm_scale", "-1"},
      {"block_size 2^31 - 1", [](P& p, Fixture&) { p.kv.block_size = std::numeric_limits<std::int32_t>::max(); },
       Status::kInvalidValue, "kv.block_size", "2147483647"},
      {"qo_indptr[0] > 0 (documented as refused)",
       [](P& p, Fixture& f) {
         f.qo_indptr = {1, 2, 5};
         p.qo_indptr = f.qo_indptr.data();
       },
       Status::kInvalidValue, "qo_indptr", "[0] = 1"},
      {"qo_indptr decreasing",
       [](P& p, Fixture& f) {
         f.qo_indptr = {0, 3, 2};
         p.qo_indptr = f.qo_indptr.data();
         p.total_q_tokens = 2;
       },
       Status::kInvalidValue, "qo_indptr", "[2] = 2"},
      {"more queries than keys",
       [](P& p, Fixture& f) {
         f.qo_indptr = {0, 6, 6};  // sequence 0 has 5 tokens
         p.qo_indptr = f.qo_indptr.data();
         p.total_q_tokens = 6;
       },
       Status::kInvalidValue, "qo_indptr", "q_len 6 > kv_len 5"},
      {"total_q_tokens disagrees", [](P& p, Fixture&) { p.total_q_tokens = 4; }, Status::kInvalidValue,
       "total_q_tokens", "= 4"},
      {"negative total_q_tokens", [](P& p, Fixture&) { p.total_q_tokens = -1; }, Status::kInvalidValue,
       "total_q_tokens", "-1"},
      {"null qo_indptr", [](P& p, Fixture&) { p.qo_indptr = nullptr; }, Status::kInvalidValue, "qo_indptr", "null"},
      {"null o", [](P& p, Fixture&) { p.o = nullptr; }, Status::kInvalidValue, "o", "null"},
      {"negative chunk", [](P& p, Fixture&) { p.window.attention_chunk_tokens = -8; }, Status::kInvalidValue,
       "window.attention_chunk_tokens", "-8"},
      {"padded seq_len beyond the row",
       [](P& p, Fixture& f) {
         f.indices = {1, 2, 3, 4};
         f.last = {5, 7};  // reused as seq_lens; 2 blocks per row hold at most 8 tokens
         f.last[1] = 9;
         p.pages = PageTable::padded(2, f.indices.data(), 2, f.last.data());
       },
       Status::kInvalidValue, "pages.seq_lens", "[1] = 9"},
  };
  check_table(table, &Fixture::prefill, [](const P& p) { return ref::prefill(p, 1); });
}

TEST_CASE("StatusDetail: reference::write_kv, copy_blocks and swap_blocks name the failed check",
          "[reference][validation][detail]") {
  SECTION("write_kv") {
    using P = WriteKVParams;
    const auto make = [](Fixture& f) {
      P w;
      w.key = f.kv_rows.data();
      w.value = f.kv_rows.data();
      w.slot_mapping = f.slots.data();
      w.num_tokens = 4;
      w.kv = f.view();
      return w;
    };
    struct Case {
      const char* what;
      std::function<void(P&)> mutate;
      Status want;
      const char* field;
      const char* value;
    };
    const std::vector<Case> table = {
        {"null slot mapping", [](P& w) { w.slot_mapping = nullptr; }, Status::kInvalidValue, "slot_mapping", "null"},
        {"negative count", [](P& w) { w.num_tokens = -1; }, Status::kInvalidValue, "num_tokens", "-1"},
        {"row stride overlaps", [](P& w) { w.stride_token_elems = 3; }, Status::kInvalidValue, "stride_token_elems",
         "= 3"},
        {"null key", [](P& w) { w.key = nullptr; }, Status::kInvalidValue, "key", "null"},
        {"block size huge", [](P& w) { w.kv.block_size = 1 << 30; }, Status::kInvalidValue, "kv.block_size",
         "1073741824"},
        {"unknown kv dtype", [](P& w) { w.kv.kv_dtype = static_cast<KVDType>(5); }, Status::kUnsupported,
         "kv.kv_dtype", "= 5"},
    };
    for (const Case& c : table) {
      Fixture f;
      REQUIRE(ref::write_kv(make(f)) == Status::kSuccess);
      Fixture g;
      P w = make(g);
      c.mutate(w);
      const auto before = g.pool;
      INFO(c.what);
      CHECK(ref::write_kv(w) == c.want);
      const pagedkv::StatusDetail& d = pagedkv::last_status_detail();
      INFO(d.message);
      CHECK(std::string(d.field) == c.field);
      CHECK(std::string(d.message).find(c.value) != std::string::npos);
      CHECK(g.pool == before);
    }
    Fixture g;
    P w = make(g);
    g.slots[3] = kBlocks * kBs;  // one past the last slot
    CHECK(ref::write_kv(w) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("slot_mapping[3] = 24", 0) == 0);
  }
  SECTION("copy_blocks") {
    Fixture f;
    KVPoolView layers[2] = {f.view(), f.view()};
    CopyBlocksParams c{layers, 2, f.pairs.data(), 2};
    REQUIRE(ref::copy_blocks(c) == Status::kSuccess);
    f.pairs = {1, 5, 2, 5};  // dst 5 twice
    CHECK(ref::copy_blocks(c) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("block_mapping[1].dst = 5: appears twice", 0) == 0);
    f.pairs = {1, 5, 5, 0};  // 5 is a dst and a src
    CHECK(ref::copy_blocks(c) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("block_mapping[1].src = 5", 0) == 0);
    f.pairs = {1, 9, 2, 0};
    CHECK(ref::copy_blocks(c) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("block_mapping[0].dst = 9", 0) == 0);
    f.pairs = {1, 5, 2, 0};
    layers[1].block_size = 0;
    CHECK(ref::copy_blocks(c) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("layers[1].kv.block_size = 0", 0) == 0);
    CHECK(std::string(pagedkv::last_status_detail().field) == "kv.block_size");
    layers[1] = f.view();
    layers[1].stride_page += 16;
    CHECK(ref::copy_blocks(c) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("layers[1]:", 0) == 0);
    c.capacity = -1;
    CHECK(ref::copy_blocks(c) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message) == "capacity = -1: must be >= 0");
  }
  SECTION("swap_blocks") {
    Fixture f;
    Fixture host;
    const KVPoolView src = f.view();
    KVPoolView dst = host.view();
    SwapBlocksParams s;
    s.src_layers = &src;
    s.dst_layers = &dst;
    s.num_layers = 1;
    s.block_mapping = f.pairs.data();
    s.num_pairs = 2;
    REQUIRE(ref::swap_blocks(s) == Status::kSuccess);
    f.pairs = {7, 1, 2, 0};
    CHECK(ref::swap_blocks(s) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("block_mapping[0].src = 7", 0) == 0);
    f.pairs = {1, 5, 2, 0};
    dst.head_dim = 4;
    CHECK(ref::swap_blocks(s) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().message).rfind("dst_layers[0]", 0) == 0);
    dst = host.view();
    s.direction = static_cast<pagedkv::SwapDirection>(3);
    CHECK(ref::swap_blocks(s) == Status::kInvalidValue);
    CHECK(std::string(pagedkv::last_status_detail().field) == "direction");
  }
}

TEST_CASE("StatusDetail: a success writes nothing (errno semantics), and each thread has its own",
          "[reference][validation][detail]") {
  Fixture f;
  DecodeParams bad = f.decode();
  bad.sm_scale = 0.f;
  REQUIRE(ref::decode(bad, 1) == Status::kInvalidValue);
  REQUIRE(ref::decode(f.decode(), 1) == Status::kSuccess);
  CHECK(std::string(pagedkv::last_status_detail().field) == "sm_scale");  // untouched by the success
  std::string other;
  std::thread t([&] {
    other = pagedkv::last_status_detail().message;  // a fresh thread: empty
    Fixture g;
    DecodeParams p = g.decode();
    p.num_qo_heads = 5;
    (void)ref::decode(p, 1);
    other += "|" + std::string(pagedkv::last_status_detail().field);
  });
  t.join();
  CHECK(other == "|num_qo_heads");
  CHECK(std::string(pagedkv::last_status_detail().field) == "sm_scale");
}
