// The fp8 e4m3 conversions the CUDA kernels run (pagedkv/cuda/fp8_e4m3.hpp, __host__ __device__, compiled here by
// the host compiler) against the CPU reference's (reference/dtype.hpp), bit for bit:
//  - decode: all 256 codes (NaN codes compared as NaN with the same sign bit);
//  - encode: every float of both signs in every binade where the result is not a constant ([2^-11, 2^9): below,
//    everything rounds to +-0; above, everything saturates), i.e. 2 x 20 x 2^23 = 335,544,320 floats, plus every
//    binade outside that range sampled with a stride, infinities, NaNs (quiet, signalling, both signs), and the
//    ties and boundaries named by hand.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include <pagedkv/cuda/fp8_e4m3.hpp>
#include <pagedkv/reference/dtype.hpp>

namespace {
namespace dev = pagedkv::cuda::detail;
namespace ref = pagedkv::reference;

std::uint32_t bits(float f) { return std::bit_cast<std::uint32_t>(f); }
}  // namespace

TEST_CASE("device e4m3 decode equals the reference on all 256 codes", "[fp8][cuda_conversion]") {
  for (std::uint32_t c = 0; c < 256; ++c) {
    const float d = dev::e4m3_to_float(c);
    const float r = ref::fp8_e4m3_bits_to_float(static_cast<std::uint8_t>(c));
    INFO("code " << c);
    if (std::isnan(r)) {
      CHECK(std::isnan(d));
      CHECK(std::signbit(d) == std::signbit(r));
    } else {
      CHECK(bits(d) == bits(r));
    }
  }
  CHECK(dev::e4m3_to_float(0x7e) == 448.f);
  CHECK(dev::e4m3_to_float(0x01) == 0x1p-9f);
  CHECK(dev::e4m3_to_float(0x08) == 0x1p-6f);
  CHECK(bits(dev::e4m3_to_float(0x80)) == bits(-0.f));
}

TEST_CASE("device e4m3 encode equals the reference on every float where the result varies",
          "[fp8][cuda_conversion]") {
  std::uint64_t mismatches = 0;
  std::uint32_t first_bad = 0;
  const auto check = [&](std::uint32_t u) {
    const float f = std::bit_cast<float>(u);
    if (dev::float_to_e4m3(f) != ref::float_to_fp8_e4m3_bits(f)) {
      if (mismatches++ == 0) first_bad = u;
    }
  };
  // Exhaustive: biased exponents 116..135 cover [2^-11, 2^9), both signs.
  for (std::uint32_t sign = 0; sign < 2; ++sign) {
    const std::uint32_t lo = (116u << 23) | (sign << 31);
    const std::uint32_t hi = (136u << 23) | (sign << 31);
    for (std::uint32_t u = lo; u != hi; ++u) check(u);
  }
  // Strided over every other bit pattern (zeros, tiny values, huge values, inf, NaN payloads).
  for (std::uint64_t u = 0; u <= 0xffffffffu; u += 9973) check(static_cast<std::uint32_t>(u));
  INFO("first mismatch at float bits 0x" << std::hex << first_bad);
  CHECK(mismatches == 0);

  // Named values: ties to even at both ends of the subnormal range and between normals, the saturation boundary.
  const float named[] = {0.f,           -0.f,           0x1p-10f,       0x1.000002p-10f, 0x1.8p-9f,   0x1.4p-8f,
                         0x1p-6f,       0x1.fp-7f,      0x1.08p0f,      0x1.18p0f,       0x1.3p0f,   448.f,
                         447.99997f,    464.f,          480.f,          1e30f,           -448.f,      -1e-30f,
                         std::numeric_limits<float>::infinity(),        -std::numeric_limits<float>::infinity(),
                         std::numeric_limits<float>::quiet_NaN(),       -std::numeric_limits<float>::quiet_NaN(),
                         std::numeric_limits<float>::signaling_NaN(),   std::numeric_limits<float>::denorm_min(),
                         std::numeric_limits<float>::max(),             std::numeric_limits<float>::lowest()};
  for (float f : named) {
    INFO("f bits 0x" << std::hex << bits(f));
    CHECK(static_cast<int>(dev::float_to_e4m3(f)) == static_cast<int>(ref::float_to_fp8_e4m3_bits(f)));
  }
  CHECK(dev::float_to_e4m3(0x1.8p-9f) == 0x02);   // 1.5 * 2^-9 ties to even m = 2
  CHECK(dev::float_to_e4m3(0x1.08p0f) == 0x38);   // 1 + 1/32: tie between 1 and 1.125 goes to even (1.0)
  CHECK(dev::float_to_e4m3(0x1.3p0f) == 0x3a);    // 1 + 3/16: tie between 1.125 and 1.25 goes to even 1.25
  CHECK(dev::float_to_e4m3(1e30f) == 0x7e);        // saturates, never NaN
  CHECK(dev::float_to_e4m3(-std::numeric_limits<float>::infinity()) == 0xfe);
  CHECK(dev::float_to_e4m3(-std::numeric_limits<float>::quiet_NaN()) == 0xff);
}
