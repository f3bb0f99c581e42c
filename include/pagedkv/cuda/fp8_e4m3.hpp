// pagedkv/cuda/fp8_e4m3.hpp: OCP FP8 E4M3FN <-> float conversions the CUDA kernels use, as __host__ __device__
// functions that also compile as plain C++ (g++), so the host unit tests check them against the CPU reference's
// conversions (reference/dtype.hpp) bit for bit: every one of the 256 codes for decoding, and for encoding every
// float of each binade where the result is not constant, plus ties, boundaries, infinities and NaNs
// (tests/unit/test_fp8_device_conversion.cpp).
//
// Why not cuda_fp8.h (__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)): its device path is the hardware
// cvt.rn.satfinite.e4m3x2.f32 on sm_89+ and a software path elsewhere (host, older devices); nothing here can run
// the hardware instruction to prove it bit-identical to the reference, while these integer routines are proved on
// the host and run unchanged on the device. write_kv is memory-bound: a few integer ops per element cost nothing.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define PAGEDKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PAGEDKV_HOST_DEVICE inline
#endif

namespace pagedkv::cuda {
inline namespace v0_1 {
namespace detail {

/// The fp8 e4m3 storage element of a KV pool (KVDType::kFp8E4M3): one byte holding the code. A tag type for the
/// kernels' KV template parameter (layout-compatible with reference::Fp8E4M3 and CUDA's __nv_fp8_e4m3).
struct Fp8E4M3 {
  std::uint8_t bits;
};
static_assert(sizeof(Fp8E4M3) == 1, "Fp8E4M3 must be one byte");

/// float bits, on host and device.
PAGEDKV_HOST_DEVICE std::uint32_t fp8_float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

/// float from bits, on host and device.
PAGEDKV_HOST_DEVICE float fp8_bits_float(std::uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

/// float -> e4m3 bits, round to nearest, ties to even, saturating to +-448 (finite overflow and +-inf), NaN -> 0x7f
/// with the sign kept: bit-identical to reference::float_to_fp8_e4m3_bits (the contract, KVDType::kFp8E4M3).
/// Method: for |f| >= 2^-6 (normal e4m3) round the 23-bit mantissa to 3 bits by adding half an ulp minus one plus
/// the kept lsb (round-half-even on the integer), letting a carry bump the exponent; below 2^-6 the result is a
/// subnormal m * 2^-9, m = round_half_even(|f| * 2^9), computed on the 24-bit significand shifted right.
PAGEDKV_HOST_DEVICE std::uint8_t float_to_e4m3(float f) {
  const std::uint32_t x = fp8_float_bits(f);
  const std::uint32_t sign = (x >> 24) & 0x80u;
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);   // NaN
  if (ax >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // >= 448 (incl. inf): saturate
  if (ax >= 0x3c800000u) {                                                // >= 2^-6: normal result
    // Rebias the exponent from 127 to 7 (subtract 120 << 23), then round the low 20 bits away, ties to even.
    const std::uint32_t v = ax - (120u << 23);
    const std::uint32_t lsb = (v >> 20) & 1u;
    const std::uint32_t r = (v + 0x7ffffu + lsb) >> 20;  // < 0x7f: |f| < 448 rounds to at most 448 = 0x7e
    return static_cast<std::uint8_t>(sign | r);
  }
  if (ax <= 0x3a800000u) return static_cast<std::uint8_t>(sign);  // <= 2^-10: rounds to 0 (2^-10 ties to even 0)
  const std::uint32_t e = ax >> 23;                               // biased exponent, 117..120
  const std::uint32_t sig = (ax & 0x007fffffu) | 0x00800000u;     // |f| = sig * 2^(e - 150)
  const std::uint32_t shift = 141u - e;                           // |f| * 2^9 = sig >> shift (+ fraction)
  const std::uint32_t q = sig >> shift;
  const std::uint32_t rem = sig & ((1u << shift) - 1u);
  const std::uint32_t half = 1u << (shift - 1u);
  const std::uint32_t m = q + ((rem > half || (rem == half && (q & 1u) != 0)) ? 1u : 0u);  // 8 = smallest normal
  return static_cast<std::uint8_t>(sign | m);
}

/// e4m3 bits -> float (exact): the 7 magnitude bits placed at float bit 20 give a float whose value is the e4m3
/// value times 2^-120 (normals and subnormals alike: a zero exponent field makes both formats subnormal), so one
/// exact multiply by 2^120 restores it. 0x7f / 0xff are NaN. Bit-identical to reference::fp8_e4m3_bits_to_float
/// (checked on all 256 codes); subnormal float intermediates need no flush-to-zero (nvcc's default, -ftz=false).
PAGEDKV_HOST_DEVICE float e4m3_to_float(std::uint32_t b) {
  const std::uint32_t mag = b & 0x7fu;
  const std::uint32_t sign = (b & 0x80u) << 24;
  if (mag == 0x7fu) return fp8_bits_float(sign | 0x7fc00000u);
  const float v = fp8_bits_float(mag << 20) * 0x1p120f;
  return fp8_bits_float(fp8_float_bits(v) | sign);
}

}  // namespace detail
}  // namespace v0_1
}  // namespace pagedkv::cuda
