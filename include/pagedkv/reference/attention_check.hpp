// pagedkv/reference/attention_check.hpp: a check of one attention output row (o and lse of one query row and qo
// head) against float64, with a per-element bound derived from the row's length, the output dtype and the precision
// the kernel rounds its probabilities to; and the "uniform probe" under which one wrong token is always rejected.
//
// Why (issue 36): a row-relative bound of 1e-2 on a bf16 output passes one missing or duplicated token at 32k keys
// (the token moves o by about |v_t - o| / n = 3e-5 against a row maximum of about 8e-3: 4e-3 relative), and an lse
// bound of 1e-4 * |lse| (1e-3 at 32k) passes the 1 / n = 3e-5 that one token moves lse by. The bound here is per
// element and comes from an error model, not from one constant:
//
//   |o_got_i - o_i| <= u_out * |o_i|                              the output's one rounding to its dtype
//                    + kSigmas * p_roundoff / sqrt(3) * R_i        P rounded before P V (tensor cores: to T); 0 when
//                                                                  every logit of the row is equal (p = 1 exactly)
//                    + (8 * u32 + 2 * e_s) * A_i                   exp, division, split-merge roundings; logit error
//                    + kSigmas * u32 * (sqrt(n) * |o_i| + A_i)     fp32 accumulation of sum_t p_t v_t
//   |lse_got - lse| <= 16 * u32 * max(1, |lse|) + 2 * e_s         log, max-add and split-merge roundings; logit error
//                    + (uniform ? 0 : kSigmas * u32 * sqrt(n))     fp32 accumulation of sum_t p_t
//
// with u32 = 2^-24, u_out the unit roundoff of o's dtype (2^-24 / 2^-11 / 2^-8 for fp32 / fp16 / bf16),
// w_t = softmax weights, A_i = sum_t w_t |v_ti|, R_i = sqrt(sum_t w_t^2 v_ti^2) (the scale of independent
// per-weight roundings: their sum has standard deviation p_roundoff / sqrt(3) * R_i), and
// e_s = 4 * sqrt(head_dim) * u32 * L, L = max_t sm_scale * sum_i |q_i k_ti| (the rounding scale of a logit). The
// statistical terms (kSigmas = 6 standard deviations) model roundings as independent, as they are on random inputs;
// the others are worst-case bounds. Inputs are the kernel's own rounded inputs (q, K, V as stored), so input
// rounding is not error.
//
// The uniform probe. A row whose query is 0 has every logit exactly 0 in any precision: p_t = exp(0) = 1 exactly,
// sum_t p_t = n exactly in fp32 for n < 2^24, so lse = log(n) up to the log's rounding and the bound on lse is
// 16 * u32 * max(1, log n). One token missing or duplicated moves lse by log(n / (n - 1)) > 1 / n or
// log((n + 1) / n) > 1 / (n + 1), which exceeds that bound for every n <= kProbeMaxKeys (2^16 = 65536 keys:
// log(1 + 2^-16) = 1.5e-5 > 16 * 2^-24 * log(2^16) = 1.06e-5; 16 u32 leaves a GPU's split merge of ~100 partials
// with approximate exp2 / log2 room: the CPU reference's 8-chunk merge measured 4.5e-7 at 32k). A wrong page (a page's tokens replaced by another
// page's, the count unchanged) leaves lse alone and moves o by sum over the page of (v' - v) / n, about 16x one
// token's move at block size 16 and random V, against a bound that has no P term for the probe: at 32k keys, bf16,
// about 1e-4 against 2^-8 * |o_i| + 5e-7 (|o_i| ~ 3e-3). A token replaced by a wrong token moves o by
// (v' - v) / n and not lse: the output check sees it at every element where |v'_i - v_i| / n exceeds the bound,
// which on random V at 32k is most elements but is not a guarantee (the output is rounded to 8 bits). Random rows
// (q != 0) keep a bound that is tight for their P precision but cannot separate one token at long lengths when P
// is rounded to bf16 (the P term is ~4e-5 at 32k against a token's 3e-5): there the probe is the signal.
// docs/kernels.md ("Checks that see one wrong token") has the derivation; tests/unit/test_reference_one_token.cpp
// proves it on the CPU reference (planted drops, duplicates, wrong pages and wrong tokens up to 32k keys).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <pagedkv/kernel_params.hpp>

namespace pagedkv::reference {

/// Unit roundoff (largest relative error of one round-to-nearest) of a dtype: fp32 2^-24, fp16 2^-11, bf16 2^-8.
[[nodiscard]] constexpr double unit_roundoff(DType dt) noexcept {
  return dt == DType::kFloat16 ? 0x1p-11 : dt == DType::kBFloat16 ? 0x1p-8 : 0x1p-24;
}

/// Longest row (keys) for which the uniform probe's lse check rejects one missing or duplicated token.
inline constexpr std::int64_t kProbeMaxKeys = std::int64_t{1} << 16;

/// Standard deviations allowed by the bound's statistical terms.
inline constexpr double kSigmas = 6.0;

/// The float64 oracle of one attention row and the magnitudes its error bound scales with.
struct AttentionOracleRow {
  std::vector<double> o;       ///< [head_dim] sum_t w_t v_t (0 when n == 0)
  std::vector<double> abs_wv;  ///< [head_dim] A_i = sum_t w_t |v_ti|
  std::vector<double> rms_wv;  ///< [head_dim] R_i = sqrt(sum_t w_t^2 v_ti^2)
  double lse = -std::numeric_limits<double>::infinity();  ///< log sum_t exp(s_t); -inf when n == 0
  double logit_scale = 0;  ///< L = max_t sm_scale * sum_i |q_i k_ti|
  std::int64_t n = 0;      ///< keys attended
  bool uniform = false;    ///< every logit equal (a zero query): every p_t = 1 exactly, no P rounding
};

/// Float64 attention of one query row `q[head_dim]` over `n` keys: `k` and `v` are [n, head_dim] row-major
/// (gathered from the pages by the caller, as the kernel should have read them), logits s_t = sm_scale * q . k_t.
/// n == 0 gives o = 0 and lse = -inf. Pure function.
[[nodiscard]] inline AttentionOracleRow attention_oracle_row(const double* q, const double* k, const double* v,
                                                            std::int64_t n, int head_dim, double sm_scale) {
  const auto dim = static_cast<std::size_t>(head_dim);
  AttentionOracleRow r;
  r.o.assign(dim, 0.0);
  r.abs_wv.assign(dim, 0.0);
  r.rms_wv.assign(dim, 0.0);
  r.n = n;
  if (n <= 0) return r;
  std::vector<double> s(static_cast<std::size_t>(n));
  double m = -std::numeric_limits<double>::infinity();
  bool uniform = true;
  for (std::int64_t t = 0; t < n; ++t) {
    const double* kt = k + static_cast<std::size_t>(t) * dim;
    double acc = 0, mag = 0;
    for (std::size_t i = 0; i < dim; ++i) {
      acc += q[i] * kt[i];
      mag += std::abs(q[i] * kt[i]);
    }
    s[static_cast<std::size_t>(t)] = acc * sm_scale;
    r.logit_scale = std::max(r.logit_scale, mag * std::abs(sm_scale));
    if (t > 0 && s[static_cast<std::size_t>(t)] != s[0]) uniform = false;
    m = std::max(m, s[static_cast<std::size_t>(t)]);
  }
  double denom = 0;
  for (std::int64_t t = 0; t < n; ++t) denom += std::exp(s[static_cast<std::size_t>(t)] - m);
  for (std::int64_t t = 0; t < n; ++t) {
    const double w = std::exp(s[static_cast<std::size_t>(t)] - m) / denom;
    const double* vt = v + static_cast<std::size_t>(t) * dim;
    for (std::size_t i = 0; i < dim; ++i) {
      r.o[i] += w * vt[i];
      r.abs_wv[i] += w * std::abs(vt[i]);
      r.rms_wv[i] += w * w * vt[i] * vt[i];
    }
  }
  for (double& x : r.rms_wv) x = std::sqrt(x);
  r.lse = m + std::log(denom);
  r.uniform = uniform;
  return r;
}

/// The precision a kernel computes a row in: the output's dtype (o rounded once to it) and the unit roundoff of
/// the probabilities P where the kernel rounds them before P V (the tensor-core kernels: that of T, 2^-8 for bf16,
/// 2^-11 for fp16; fp32 everywhere else, including the CPU reference: 2^-24).
struct AttentionPrecision {
  DType out = DType::kFloat32;
  double p_roundoff = 0x1p-24;
};

/// The bound of the model above for one row: o[head_dim] per element, and lse.
struct AttentionRowBound {
  std::vector<double> o;
  double lse = 0;
};

/// The error bound (see the file comment) of `row` computed at precision `prec`. Pure function.
[[nodiscard]] inline AttentionRowBound attention_row_bound(const AttentionOracleRow& row, const AttentionPrecision& prec,
                                                           int head_dim) {
  constexpr double u32 = 0x1p-24;
  const double u_out = unit_roundoff(prec.out);
  const double e_s = 4.0 * std::sqrt(static_cast<double>(head_dim)) * u32 * row.logit_scale;
  const double sqrt_n = std::sqrt(static_cast<double>(std::max<std::int64_t>(row.n, 1)));
  const double p_term = row.uniform ? 0.0 : kSigmas * prec.p_roundoff / std::sqrt(3.0);
  AttentionRowBound b;
  b.o.resize(row.o.size());
  for (std::size_t i = 0; i < row.o.size(); ++i) {
    const double oi = std::abs(row.o[i]);
    b.o[i] = u_out * oi + p_term * row.rms_wv[i] + (8.0 * u32 + 2.0 * e_s) * row.abs_wv[i] +
             kSigmas * u32 * (sqrt_n * oi + row.abs_wv[i]);
  }
  b.lse = 16.0 * u32 * std::max(1.0, std::abs(row.lse)) + 2.0 * e_s + (row.uniform ? 0.0 : kSigmas * u32 * sqrt_n);
  return b;
}

/// Checks one row: every o_got[i] (head_dim values, as float) within the bound of attention_row_bound, and
/// lse_got within its bound (pass check_lse = false where the kernel wrote no lse). An empty row (n == 0) must
/// give o = 0 and lse = -inf; a NaN or inf anywhere else fails. On failure returns false and, when `why` is not
/// null, writes the first violation (element, value, reference, bound). Pure function.
[[nodiscard]] inline bool attention_row_ok(const float* o_got, float lse_got, bool check_lse,
                                           const AttentionOracleRow& row, const AttentionPrecision& prec, int head_dim,
                                           std::string* why) {
  const auto say = [&](const std::string& s) {
    if (why != nullptr) *why = s;
    return false;
  };
  const AttentionRowBound b = attention_row_bound(row, prec, head_dim);
  for (int i = 0; i < head_dim; ++i) {
    const double g = o_got[i];
    const double err = std::abs(g - row.o[static_cast<std::size_t>(i)]);
    if (!std::isfinite(g) || !(err <= b.o[static_cast<std::size_t>(i)])) {
      return say("o[" + std::to_string(i) + "] = " + std::to_string(g) + ", float64 " +
                 std::to_string(row.o[static_cast<std::size_t>(i)]) + ": error " + std::to_string(err) +
                 " > bound " + std::to_string(b.o[static_cast<std::size_t>(i)]) + " (n = " + std::to_string(row.n) +
                 (row.uniform ? ", uniform probe)" : ")"));
    }
  }
  if (check_lse) {
    if (row.n == 0) {
      if (!(std::isinf(lse_got) && lse_got < 0)) return say("lse = " + std::to_string(lse_got) + ", want -inf (n = 0)");
    } else if (!std::isfinite(lse_got) || !(std::abs(lse_got - row.lse) <= b.lse)) {
      return say("lse = " + std::to_string(lse_got) + ", float64 " + std::to_string(row.lse) + ": error " +
                 std::to_string(std::abs(lse_got - row.lse)) + " > bound " + std::to_string(b.lse) +
                 " (n = " + std::to_string(row.n) + (row.uniform ? ", uniform probe)" : ")"));
    }
  }
  return true;
}

}  // namespace pagedkv::reference
