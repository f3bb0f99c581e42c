// examples/decode_loop/model.cpp: shape helpers, deterministic K/V content, the float64 oracle.
#include "model.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include <pagedkv/reference/dtype.hpp>

namespace decode_loop {

const char* layout_name(Layout l) noexcept {
  switch (l) {
    case Layout::kNhd: return "nhd";
    case Layout::kHnd: return "hnd";
    case Layout::kSeparateNhd: return "sep-nhd";
    case Layout::kSeparateHnd: return "sep-hnd";
  }
  return "?";
}

const char* dtype_name(pagedkv::DType dt) noexcept {
  switch (dt) {
    case pagedkv::DType::kFloat32: return "fp32";
    case pagedkv::DType::kFloat16: return "fp16";
    case pagedkv::DType::kBFloat16: return "bf16";
  }
  return "?";
}

std::size_t Shape::k_buffer_bytes() const noexcept {
  const bool interleaved = layout == Layout::kNhd || layout == Layout::kHnd;
  return static_cast<std::size_t>(num_blocks) * static_cast<std::size_t>(page_elems()) * elem_bytes() *
         (interleaved ? 2 : 1);
}

std::size_t Shape::v_buffer_bytes() const noexcept {
  const bool interleaved = layout == Layout::kNhd || layout == Layout::kHnd;
  return interleaved ? 0 : static_cast<std::size_t>(num_blocks) * static_cast<std::size_t>(page_elems()) * elem_bytes();
}

pagedkv::KVPoolView Shape::view(void* k, void* v) const noexcept {
  using pagedkv::KVPoolView;
  switch (layout) {
    case Layout::kNhd: return KVPoolView::nhd(k, dtype, num_blocks, block_size, num_kv_heads, head_dim);
    case Layout::kHnd: return KVPoolView::hnd(k, dtype, num_blocks, block_size, num_kv_heads, head_dim);
    case Layout::kSeparateNhd:
      return KVPoolView::separate_nhd(k, v, dtype, num_blocks, block_size, num_kv_heads, head_dim);
    case Layout::kSeparateHnd:
      return KVPoolView::separate_hnd(k, v, dtype, num_blocks, block_size, num_kv_heads, head_dim);
  }
  return {};
}

float Shape::sm_scale() const noexcept { return 1.f / std::sqrt(static_cast<float>(head_dim)); }

float round_to(pagedkv::DType dt, float x) noexcept {
  unsigned char tmp[4];
  pagedkv::reference::store(tmp, dt, 0, x);
  return pagedkv::reference::load(tmp, dt, 0);
}

void kv_rows(const Shape& s, std::uint64_t pos_hash, int layer, bool is_value, float* out) noexcept {
  const std::uint64_t stream =
      splitmix64(pos_hash ^ splitmix64(0xa0761d6478bd642full * static_cast<std::uint64_t>(2 * layer + (is_value ? 2 : 1))));
  const std::int64_t n = s.kv_row_elems();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint64_t r = splitmix64(stream + static_cast<std::uint64_t>(i));
    // 24 random bits k -> (k + 0.5) / 2^23 - 1 in (-1, 1): an odd multiple of 2^-24 (exact in fp32), so never 0,
    // and at least 2^-24 in magnitude, which fp16 (smallest subnormal 2^-24) and bf16 keep non-zero too.
    const auto x = static_cast<float>((static_cast<double>(r >> 40) + 0.5) / 8388608.0 - 1.0);
    out[i] = round_to(s.dtype, x);
  }
}

void store_row(pagedkv::DType dt, void* dst, std::int64_t offset, const float* src, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) pagedkv::reference::store(dst, dt, offset + i, src[i]);
}

void SeqKV::build(const Shape& s, std::span<const std::uint64_t> pos_hashes, int layer) {
  const std::int64_t row = s.kv_row_elems();
  k.resize(pos_hashes.size() * static_cast<std::size_t>(row));
  v.resize(k.size());
  std::vector<float> tmp(static_cast<std::size_t>(row));
  for (std::size_t t = 0; t < pos_hashes.size(); ++t) {
    kv_rows(s, pos_hashes[t], layer, false, tmp.data());
    std::copy(tmp.begin(), tmp.end(), k.begin() + static_cast<std::ptrdiff_t>(t * row));
    kv_rows(s, pos_hashes[t], layer, true, tmp.data());
    std::copy(tmp.begin(), tmp.end(), v.begin() + static_cast<std::ptrdiff_t>(t * row));
  }
}

void attend_f64(const Shape& s, const SeqKV& kv, int kv_head, const double* q, std::int64_t n, double scale,
                double* o, double* lse) {
  const int hd = s.head_dim;
  const std::int64_t row = s.kv_row_elems();
  std::fill(o, o + hd, 0.0);
  if (n <= 0) {
    *lse = -std::numeric_limits<double>::infinity();
    return;
  }
  std::vector<double> sc(static_cast<std::size_t>(n));
  double m = -std::numeric_limits<double>::infinity();
  for (std::int64_t t = 0; t < n; ++t) {
    const double* kr = kv.k.data() + t * row + std::int64_t{kv_head} * hd;
    double dot = 0.0;
    for (int d = 0; d < hd; ++d) dot += q[d] * kr[d];
    sc[static_cast<std::size_t>(t)] = dot * scale;
    m = std::max(m, sc[static_cast<std::size_t>(t)]);
  }
  double den = 0.0;
  for (std::int64_t t = 0; t < n; ++t) {
    const double w = std::exp(sc[static_cast<std::size_t>(t)] - m);
    den += w;
    const double* vr = kv.v.data() + t * row + std::int64_t{kv_head} * hd;
    for (int d = 0; d < hd; ++d) o[d] += w * vr[d];
  }
  for (int d = 0; d < hd; ++d) o[d] /= den;
  *lse = m + std::log(den);
}

double row_rel_error(const float* got, const double* ref, int head_dim) noexcept {
  double err = 0.0;
  double mag = 0.0;
  for (int d = 0; d < head_dim; ++d) {
    const double g = got[d];
    if (!std::isfinite(g)) return std::numeric_limits<double>::infinity();
    err = std::max(err, std::abs(g - ref[d]));
    mag = std::max(mag, std::abs(ref[d]));
  }
  if (mag > 0.0) return err / mag;
  return err == 0.0 ? 0.0 : std::numeric_limits<double>::infinity();
}

}  // namespace decode_loop
