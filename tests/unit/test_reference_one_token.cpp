// The one-wrong-token check (pagedkv/reference/attention_check.hpp) proven on the CPU reference: at lengths up to
// 32k keys, for fp32 / fp16 / bf16 outputs, reference::decode's correct output passes the check and an output
// computed with one planted error is rejected:
//  - a token missing (the sequence one token short; a middle token dropped),
//  - a token duplicated (one token's K/V twice, the sequence one token longer),
//  - a wrong page (one page-table entry pointing at another sequence's block, the token count unchanged),
//  - a wrong token (one token's K/V replaced by another sequence's token at the same position).
// Each run has one kv head and two qo heads: head 0 the uniform probe (q = 0: every logit 0, every p exactly 1),
// head 1 a random query. The probe must reject every planted error (lse for a missing or duplicated token, which the
// file comment of attention_check.hpp proves for n <= 2^18; o for the others); the random head must pass when the
// output is correct (no false failures from the bound) and is not required to see the error. The CUDA tests
// (tests/cuda) use the same check and the same probe on the device kernels.
//
// Seeds: fresh per run (printed on failure); PAGEDKV_TEST_SEED=<n> pins them.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <pagedkv/kernel_params.hpp>
#include <pagedkv/reference/attention_check.hpp>
#include <pagedkv/reference/decode.hpp>
#include <pagedkv/reference/dtype.hpp>

namespace {

using pagedkv::DType;
using pagedkv::DecodeParams;
using pagedkv::KVPoolView;
using pagedkv::PageTable;
using pagedkv::Status;
namespace ref = pagedkv::reference;

std::uint64_t one_token_seed() {
  if (const char* env = std::getenv("PAGEDKV_TEST_SEED"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 10);
  }
  static std::random_device rd;
  return (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
}

/// Rounds f to dt (what storing it in a dt pool keeps).
float round_to(DType dt, float f) {
  if (dt == DType::kFloat16) return ref::half_bits_to_float(ref::float_to_half_bits(f));
  if (dt == DType::kBFloat16) return ref::bf16_bits_to_float(ref::float_to_bf16_bits(f));
  return f;
}

void store(std::vector<unsigned char>& buf, std::int64_t idx, DType dt, float f) {
  if (dt == DType::kFloat32) {
    std::memcpy(buf.data() + idx * 4, &f, 4);
    return;
  }
  const std::uint16_t h = dt == DType::kFloat16 ? ref::float_to_half_bits(f) : ref::float_to_bf16_bits(f);
  std::memcpy(buf.data() + idx * 2, &h, 2);
}

float load(const std::vector<unsigned char>& buf, std::int64_t idx, DType dt) {
  if (dt == DType::kFloat32) {
    float f;
    std::memcpy(&f, buf.data() + idx * 4, 4);
    return f;
  }
  std::uint16_t h;
  std::memcpy(&h, buf.data() + idx * 2, 2);
  return dt == DType::kFloat16 ? ref::half_bits_to_float(h) : ref::bf16_bits_to_float(h);
}

/// A token's K and V rows, as stored (rounded to the pool dtype).
struct Token {
  std::vector<float> k, v;
};

constexpr int kBlock = 16;
constexpr int kDim = 64;

/// reference::decode of one sequence (one kv head, qo heads {probe, random}) whose tokens are `toks`, laid out
/// in a pool of shuffled blocks; `page_override` (page index, token list) makes that page-table entry point at a
/// block holding other tokens (a wrong page). Returns o [2, kDim] as float and lse [2].
struct DecodeOut {
  std::vector<float> o;
  std::vector<float> lse;
};

DecodeOut run_reference(DType dt, const std::vector<Token>& toks, const std::vector<float>& q2, std::mt19937_64& rng,
                        int wrong_page = -1, const std::vector<Token>* other = nullptr) {
  const int n = static_cast<int>(toks.size());
  const int pages = (n + kBlock - 1) / kBlock;
  const int num_blocks = 2 * pages + 2;  // the sequence's pages, the other sequence's, block 0 (null) and a spare
  std::vector<std::int32_t> ids(static_cast<std::size_t>(num_blocks - 1));
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i + 1);
  std::shuffle(ids.begin(), ids.end(), rng);
  const std::size_t elem = pagedkv::dtype_size_bytes(dt);
  const KVPoolView shape = KVPoolView::nhd(nullptr, dt, num_blocks, kBlock, 1, kDim);
  std::vector<unsigned char> pool(static_cast<std::size_t>(num_blocks) * 2 * kBlock * kDim * elem, 0xff);  // NaN
  const KVPoolView kv = KVPoolView::nhd(pool.data(), dt, num_blocks, kBlock, 1, kDim);
  const std::int64_t v_base =
      (static_cast<const char*>(kv.v) - static_cast<const char*>(kv.k)) / static_cast<std::int64_t>(elem);
  const auto put = [&](const std::vector<Token>& ts, std::size_t first_id) {
    for (std::size_t t = 0; t < ts.size(); ++t) {
      const std::int32_t block = ids[first_id + t / kBlock];
      const std::int64_t off = shape.offset(block, static_cast<std::int32_t>(t % kBlock), 0);
      for (int d = 0; d < kDim; ++d) {
        store(pool, off + d, dt, ts[t].k[static_cast<std::size_t>(d)]);
        store(pool, v_base + off + d, dt, ts[t].v[static_cast<std::size_t>(d)]);
      }
    }
  };
  put(toks, 0);
  std::vector<std::int32_t> indices(ids.begin(), ids.begin() + pages);
  if (wrong_page >= 0) {
    put(*other, static_cast<std::size_t>(pages));  // the other sequence's pages
    indices[static_cast<std::size_t>(wrong_page)] = ids[static_cast<std::size_t>(pages + wrong_page)];
  }
  const std::vector<std::int32_t> indptr = {0, pages};
  const std::vector<std::int32_t> last = {n - (pages - 1) * kBlock};
  std::vector<unsigned char> q(2 * kDim * elem), o(2 * kDim * elem, 0xff);
  for (int i = 0; i < 2 * kDim; ++i) store(q, i, dt, q2[static_cast<std::size_t>(i)]);
  std::vector<float> lse(2, std::nanf(""));
  DecodeParams p;
  p.q = q.data();
  p.o = o.data();
  p.lse = lse.data();
  p.kv = kv;
  p.pages = PageTable::csr(1, indptr.data(), indices.data(), last.data());
  p.num_qo_heads = 2;
  p.sm_scale = 1.0f / std::sqrt(static_cast<float>(kDim));
  // Split-KV with the chunk rule on long rows (chunk 4096: the merge is part of what is checked).
  std::vector<float> ws;
  if (n > 4096) {
    p.kv_chunk_size_tokens = 4096;
    p.max_num_chunks = (n + 4095) / 4096;
    ws.resize(pagedkv::decode_workspace_bytes(1, p.max_num_chunks, 2, kDim) / sizeof(float));
    p.workspace = ws.data();
    p.workspace_bytes = ws.size() * sizeof(float);
  }
  REQUIRE(ref::decode(p, 1) == Status::kSuccess);
  DecodeOut out{std::vector<float>(2 * kDim), lse};
  for (int i = 0; i < 2 * kDim; ++i) out.o[static_cast<std::size_t>(i)] = load(o, i, dt);
  return out;
}

Token random_token(DType dt, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  Token t{std::vector<float>(kDim), std::vector<float>(kDim)};
  for (int d = 0; d < kDim; ++d) {
    t.k[static_cast<std::size_t>(d)] = round_to(dt, u(rng));
    t.v[static_cast<std::size_t>(d)] = round_to(dt, u(rng));
  }
  return t;
}

/// The float64 oracle rows (probe, random head) of the correct sequence `toks`.
std::vector<ref::AttentionOracleRow> oracle(const std::vector<Token>& toks, const std::vector<float>& q2) {
  const auto n = static_cast<std::int64_t>(toks.size());
  std::vector<double> k(static_cast<std::size_t>(n) * kDim), v(k.size());
  for (std::size_t t = 0; t < toks.size(); ++t) {
    for (int d = 0; d < kDim; ++d) {
      k[t * kDim + static_cast<std::size_t>(d)] = toks[t].k[static_cast<std::size_t>(d)];
      v[t * kDim + static_cast<std::size_t>(d)] = toks[t].v[static_cast<std::size_t>(d)];
    }
  }
  std::vector<ref::AttentionOracleRow> rows;
  for (int h = 0; h < 2; ++h) {
    std::vector<double> q(q2.begin() + h * kDim, q2.begin() + (h + 1) * kDim);
    rows.push_back(ref::attention_oracle_row(q.data(), k.data(), v.data(), n, kDim,
                                             static_cast<double>(1.0f / std::sqrt(static_cast<float>(kDim)))));
  }
  return rows;
}

bool row_ok(const DecodeOut& out, int h, const ref::AttentionOracleRow& row, DType dt, std::string* why) {
  const ref::AttentionPrecision prec{dt, 0x1p-24};  // the reference keeps P in float32
  return ref::attention_row_ok(out.o.data() + h * kDim, out.lse[static_cast<std::size_t>(h)], true, row, prec, kDim,
                               why);
}

void one_token_case(DType dt, int n) {
  const std::uint64_t seed = one_token_seed();
  const char* dtype = dt == DType::kFloat32 ? "fp32" : dt == DType::kFloat16 ? "fp16" : "bf16";
  CAPTURE(seed, dtype, n);
  std::mt19937_64 rng(seed);
  std::vector<Token> toks, other;
  for (int t = 0; t < n; ++t) toks.push_back(random_token(dt, rng));
  for (int t = 0; t < n; ++t) other.push_back(random_token(dt, rng));
  std::vector<float> q2(2 * kDim, 0.f);  // head 0: the probe (q = 0)
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int d = 0; d < kDim; ++d) q2[static_cast<std::size_t>(kDim + d)] = round_to(dt, u(rng));
  const std::vector<ref::AttentionOracleRow> want = oracle(toks, q2);
  REQUIRE(want[0].uniform);

  std::string why;
  {
    const DecodeOut good = run_reference(dt, toks, q2, rng);
    for (int h = 0; h < 2; ++h) {
      INFO("correct output, head " << h);
      const bool ok = row_ok(good, h, want[static_cast<std::size_t>(h)], dt, &why);
      INFO(why);
      CHECK(ok);
    }
  }
  const ref::AttentionRowBound probe_bound = ref::attention_row_bound(want[0], {dt, 0x1p-24}, kDim);
  // by_lse: a missing or duplicated token, which the probe's lse alone must reject (the guarantee, n <= 2^16);
  // the others change o only.
  const auto rejected = [&](const char* what, const DecodeOut& bad, bool by_lse) {
    INFO(what << ": the probe must reject it");
    const bool ok = row_ok(bad, 0, want[0], dt, &why);
    CHECK_FALSE(ok);
    if (by_lse) {
      const double lse_err = std::abs(static_cast<double>(bad.lse[0]) - want[0].lse);
      INFO("probe lse error " << lse_err << ", bound " << probe_bound.lse);
      CHECK(lse_err > probe_bound.lse);
    }
  };
  const int mid = n / 2;
  if (n >= 2) {
    std::vector<Token> last_missing(toks.begin(), toks.end() - 1);
    rejected("last token missing", run_reference(dt, last_missing, q2, rng), true);
    std::vector<Token> mid_missing = toks;
    mid_missing.erase(mid_missing.begin() + mid);
    rejected("middle token missing", run_reference(dt, mid_missing, q2, rng), true);
  }
  std::vector<Token> dup = toks;
  dup.insert(dup.begin() + mid, toks[static_cast<std::size_t>(mid)]);
  rejected("token duplicated", run_reference(dt, dup, q2, rng), true);
  std::vector<Token> wrong = toks;
  wrong[static_cast<std::size_t>(mid)] = other[static_cast<std::size_t>(mid)];
  rejected("wrong token (another sequence's, same position)", run_reference(dt, wrong, q2, rng), false);
  rejected("wrong page (page table entry -> another sequence's block)",
           run_reference(dt, toks, q2, rng, mid / kBlock, &other), false);
}

}  // namespace

TEST_CASE("attention_row_ok rejects one wrong token at lengths up to 32k (CPU reference, uniform probe)",
          "[reference][one_token]") {
  for (const DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (const int n : {1, 2, 17, 255, 1000, 4097, 32768}) one_token_case(dt, n);
  }
}

TEST_CASE("attention_row_bound: the uniform probe's lse bound stays below one token's move up to kProbeMaxKeys",
          "[reference][one_token]") {
  // The file comment's inequality, evaluated: for every n in [1, 2^16], the lse bound of a uniform row is below
  // log((n + 1) / n), the smallest move of one missing or duplicated token (log(n / (n - 1)) is larger).
  for (std::int64_t n = 1; n <= ref::kProbeMaxKeys; n = n < 64 ? n + 1 : n + n / 16) {
    ref::AttentionOracleRow row;
    row.n = n;
    row.uniform = true;
    row.lse = std::log(static_cast<double>(n));
    const ref::AttentionRowBound b = ref::attention_row_bound(row, {DType::kBFloat16, 0x1p-8}, 128);
    INFO("n = " << n << ", bound " << b.lse);
    CHECK(b.lse < std::log1p(1.0 / static_cast<double>(n)));
  }
  ref::AttentionOracleRow row;
  row.n = ref::kProbeMaxKeys;
  row.uniform = true;
  row.lse = std::log(static_cast<double>(row.n));
  CHECK(ref::attention_row_bound(row, {DType::kBFloat16, 0x1p-8}, 128).lse <
        std::log1p(1.0 / static_cast<double>(ref::kProbeMaxKeys)));
}
