// Tests of pagedkv/reference/dtype.hpp: float <-> binary16 / bfloat16 conversions (round to nearest, ties to even),
// checked exhaustively over every 16-bit pattern and at every midpoint between adjacent 16-bit values.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include <pagedkv/reference/dtype.hpp>

namespace {

namespace ref = pagedkv::reference;
using pagedkv::DType;

// Compile-time spot checks (the conversions are constexpr).
static_assert(ref::float_to_half_bits(1.0f) == 0x3c00);
static_assert(ref::float_to_half_bits(-2.0f) == 0xc000);
static_assert(ref::float_to_half_bits(65504.0f) == 0x7bff);
static_assert(ref::float_to_half_bits(65520.0f) == 0x7c00);  // tie between 65504 and 2^16 goes to even (inf)
static_assert(ref::float_to_half_bits(0x1p-24f) == 0x0001);  // smallest subnormal
static_assert(ref::float_to_half_bits(0x1p-25f) == 0x0000);  // tie to even: 0
static_assert(ref::half_bits_to_float(0x3555) == 0x1.554p-2f);
static_assert(ref::float_to_bf16_bits(1.0f) == 0x3f80);
static_assert(ref::bf16_bits_to_float(0xc040) == -3.0f);
static_assert(ref::kDTypeOf<ref::Half> == DType::kFloat16);

bool is_nan_half(std::uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }
bool is_nan_bf16(std::uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }

}  // namespace

// The exhaustive loops count failures and report the first, rather than making one Catch assertion per value.

TEST_CASE("reference::dtype binary16 round trip is exact for all 65536 patterns", "[reference][dtype]") {
  int failures = 0;
  std::uint32_t first = 0;
  for (std::uint32_t h = 0; h <= 0xffffu; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float f = ref::half_bits_to_float(bits);
    const bool ok = is_nan_half(bits) ? std::isnan(f) && is_nan_half(ref::float_to_half_bits(f))
                                      : ref::float_to_half_bits(f) == bits;
    if (!ok && failures++ == 0) first = h;
  }
  INFO("first failing half bits " << first);
  CHECK(failures == 0);
}

TEST_CASE("reference::dtype float -> binary16 rounds to nearest, ties to even", "[reference][dtype]") {
  // Every pair of adjacent finite magnitudes a < b (including subnormals, and 65504 -> inf at the top): their
  // midpoint is exact in float and must go to the even pattern; one float ulp either side goes to the nearer one.
  int failures = 0;
  std::uint32_t first = 0;
  for (std::uint32_t lo = 0; lo < 0x7c00u; ++lo) {
    for (const std::uint32_t sign : {0u, 0x8000u}) {
      const auto a = static_cast<std::uint16_t>(lo | sign);
      const auto b = static_cast<std::uint16_t>((lo + 1) | sign);
      const float fa = ref::half_bits_to_float(a);
      const float fb = lo + 1 == 0x7c00u ? (sign != 0 ? -65536.0f : 65536.0f) : ref::half_bits_to_float(b);
      const float mid = (fa + fb) / 2;  // exact: at most 12 significant bits
      const bool ok = ref::float_to_half_bits(mid) == ((lo & 1u) == 0 ? a : b) &&
                      ref::float_to_half_bits(std::nextafter(mid, fa)) == a &&
                      ref::float_to_half_bits(std::nextafter(mid, fb)) == b;
      if (!ok && failures++ == 0) first = lo | sign;
    }
  }
  INFO("first failing half bits " << first);
  CHECK(failures == 0);
  CHECK(ref::float_to_half_bits(std::numeric_limits<float>::infinity()) == 0x7c00);
  CHECK(ref::float_to_half_bits(-std::numeric_limits<float>::infinity()) == 0xfc00);
  CHECK(ref::float_to_half_bits(1e30f) == 0x7c00);
  CHECK(ref::float_to_half_bits(-0.0f) == 0x8000);
  CHECK(ref::float_to_half_bits(1e-30f) == 0x0000);
  CHECK(is_nan_half(ref::float_to_half_bits(std::numeric_limits<float>::quiet_NaN())));
  CHECK(is_nan_half(ref::float_to_half_bits(std::bit_cast<float>(0x7f800001u))));  // NaN payload in low bits only
}

#if defined(__FLT16_MANT_DIG__)
TEST_CASE("reference::dtype float -> binary16 agrees with the compiler's _Float16", "[reference][dtype]") {
  // Random float bit patterns (all exponents), plus every float in [2^-26, 2^17) at a stride that visits all
  // rounding situations of binary16 (subnormal, normal, overflow).
  std::mt19937 rng(12345);
  int failures = 0;
  std::uint32_t first = 0;
  const auto check = [&](std::uint32_t x) {
    const float f = std::bit_cast<float>(x);
    if (std::isnan(f)) return;
    if (ref::float_to_half_bits(f) != std::bit_cast<std::uint16_t>(static_cast<_Float16>(f)) && failures++ == 0)
      first = x;
  };
  for (int i = 0; i < 100000; ++i) check(static_cast<std::uint32_t>(rng()));
  for (std::uint32_t x = 0x32800000u; x < 0x48000000u; x += 0x1001u) check(x);
  INFO("first failing float bits " << first);
  CHECK(failures == 0);
}
#endif

TEST_CASE("reference::dtype bfloat16 round trip and rounding", "[reference][dtype]") {
  int failures = 0;
  std::uint32_t first = 0;
  for (std::uint32_t v = 0; v <= 0xffffu; ++v) {
    const auto bits = static_cast<std::uint16_t>(v);
    const float f = ref::bf16_bits_to_float(bits);
    bool ok = true;
    if (is_nan_bf16(bits)) {
      ok = is_nan_bf16(ref::float_to_bf16_bits(f));
    } else {
      ok = ref::float_to_bf16_bits(f) == bits;
      // Midpoint to the next magnitude (exact in float): ties to even; one ulp either side to the nearer one.
      if ((v & 0x7fffu) < 0x7f80u) {
        const float fb = std::bit_cast<float>((v + 1) << 16);  // next magnitude (inf after the largest finite)
        const float mid = std::bit_cast<float>((v << 16) | 0x8000u);
        const auto next = static_cast<std::uint16_t>(v + 1);
        ok = ok && ref::float_to_bf16_bits(mid) == ((v & 1u) == 0 ? bits : next) &&
             ref::float_to_bf16_bits(std::nextafter(mid, f)) == bits &&
             ref::float_to_bf16_bits(std::nextafter(mid, fb)) == next;
      }
    }
    if (!ok && failures++ == 0) first = v;
  }
  INFO("first failing bf16 bits " << first);
  CHECK(failures == 0);
  CHECK(is_nan_bf16(ref::float_to_bf16_bits(std::bit_cast<float>(0x7f800001u))));
  CHECK(ref::float_to_bf16_bits(std::numeric_limits<float>::infinity()) == 0x7f80);
}

TEST_CASE("reference::dtype load/store over DType", "[reference][dtype]") {
  const DType dt = GENERATE(DType::kFloat32, DType::kFloat16, DType::kBFloat16);
  std::vector<std::uint32_t> buf(8, 0xdeadbeefu);
  ref::store(buf.data(), dt, 3, 1.5f);
  ref::store(buf.data(), dt, 4, -0.1f);
  CHECK(ref::load(buf.data(), dt, 3) == 1.5f);
  const float back = ref::load(buf.data(), dt, 4);
  const float want = dt == DType::kFloat32   ? -0.1f
                     : dt == DType::kFloat16 ? ref::to_float(ref::to_half(-0.1f))
                                             : ref::to_float(ref::to_bf16(-0.1f));
  CHECK(back == want);
  // Neighbours untouched: bytes before element 3 and from element 5 on keep the fill pattern.
  const auto es = static_cast<std::int64_t>(pagedkv::dtype_size_bytes(dt));
  const std::uint32_t pattern = 0xdeadbeefu;
  const auto* bytes = reinterpret_cast<const unsigned char*>(buf.data());
  const auto* pat = reinterpret_cast<const unsigned char*>(&pattern);
  for (std::int64_t i = 0; i < 32; ++i) {
    if (i >= 3 * es && i < 5 * es) continue;
    CHECK(bytes[i] == pat[i % 4]);
  }
}
