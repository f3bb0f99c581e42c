// pagedkv/reference/dtype.hpp: host conversions between float32 and the two 16-bit element types (IEEE binary16
// and bfloat16) and the fp8 KV storage type (OCP FP8 E4M3FN), plus untyped load/store helpers over the `DType` enum. No external library, no hardware
// intrinsics: the conversions are bit manipulations, constexpr, and bit-exact with what CUDA's __float2half_rn /
// __float2bfloat16_rn produce for finite inputs and infinities (round to nearest, ties to even).
#pragma once

#include <array>
#include <bit>
#include <concepts>
#include <cstdint>
#include <cstring>

#include <pagedkv/kernel_params.hpp>

namespace pagedkv::reference {

/// An IEEE 754 binary16 value held as its bit pattern (1 sign, 5 exponent, 10 mantissa bits), the storage of
/// `DType::kFloat16`. A trivially copyable 2-byte type with the layout of CUDA's `__half`, so a host buffer of
/// `Half` can be copied to or from a device `__half` buffer byte for byte. No arithmetic: convert to float.
struct Half {
  std::uint16_t bits = 0;
  friend constexpr bool operator==(Half, Half) noexcept = default;  ///< Bitwise equality (+0 != -0, NaN == NaN).
};

/// A bfloat16 value held as its bit pattern (the upper 16 bits of a float32: 1 sign, 8 exponent, 7 mantissa
/// bits), the storage of `DType::kBFloat16`. Layout-compatible with CUDA's `__nv_bfloat16`. No arithmetic.
struct BFloat16 {
  std::uint16_t bits = 0;
  friend constexpr bool operator==(BFloat16, BFloat16) noexcept = default;  ///< Bitwise equality.
};

static_assert(sizeof(Half) == 2 && sizeof(BFloat16) == 2, "Half and BFloat16 must be 2-byte storage types");

/// Converts a float to the nearest binary16, ties to even. Overflow (|f| >= 65520) gives +-inf; values below the
/// smallest subnormal's half (2^-25) give +-0 (2^-25 itself ties to 0); subnormals are produced exactly as
/// IEEE 754 specifies. NaN stays NaN (quieted; the top mantissa bits of the payload are kept).
/// Thread safety: pure function.
[[nodiscard]] constexpr std::uint16_t float_to_half_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) {  // inf or NaN
    if (ax == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x03ffu));
  }
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520: rounds to inf
  if (ax >= 0x38800000u) {                                                   // normal binary16 range, >= 2^-14
    const std::uint32_t exp16 = (ax >> 23) - 127u + 15u;
    const std::uint32_t mant = ax & 0x007fffffu;
    std::uint32_t h = (exp16 << 10) | (mant >> 13);
    const std::uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u) != 0)) ++h;  // a carry into the exponent is correct
    return static_cast<std::uint16_t>(sign | h);
  }
  if (ax <= 0x33000000u) return sign;  // <= 2^-25: rounds to zero (the tie at 2^-25 goes to even, 0)
  // Subnormal result: value = mant * 2^(e - 23) with the implicit bit; result m = value / 2^-24.
  const std::uint32_t mant = (ax & 0x007fffffu) | 0x00800000u;
  const int e = static_cast<int>(ax >> 23) - 127;  // in [-25, -15]
  const int shift = -(e + 1);                      // in [14, 24]
  std::uint32_t m = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (m & 1u) != 0)) ++m;  // m == 0x400 is the smallest normal: correct
  return static_cast<std::uint16_t>(sign | m);
}

/// Converts a binary16 bit pattern to float (exact: every binary16 value is a float). Pure function.
[[nodiscard]] constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x03ffu;
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 0x1p-24f;  // subnormal or zero, exact
    return sign != 0 ? -mag : mag;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));  // inf / NaN
  return std::bit_cast<float>(sign | ((exp - 15u + 127u) << 23) | (mant << 13));
}

/// Converts a float to the nearest bfloat16, ties to even (overflow past the largest finite bfloat16 rounds to
/// +-inf as IEEE specifies). NaN stays NaN (quieted). Pure function.
[[nodiscard]] constexpr std::uint16_t float_to_bf16_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  const std::uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<std::uint16_t>((x + rounding) >> 16);
}

/// Converts a bfloat16 bit pattern to float (exact). Pure function.
[[nodiscard]] constexpr float bf16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// float -> Half, round to nearest even. Pure function.
[[nodiscard]] constexpr Half to_half(float f) noexcept { return Half{float_to_half_bits(f)}; }
/// float -> BFloat16, round to nearest even. Pure function.
[[nodiscard]] constexpr BFloat16 to_bf16(float f) noexcept { return BFloat16{float_to_bf16_bits(f)}; }
/// Half -> float (exact). Pure function.
[[nodiscard]] constexpr float to_float(Half h) noexcept { return half_bits_to_float(h.bits); }
/// BFloat16 -> float (exact). Pure function.
[[nodiscard]] constexpr float to_float(BFloat16 b) noexcept { return bf16_bits_to_float(b.bits); }
/// float -> float (identity), so templates over the element type can call `to_float` uniformly.
[[nodiscard]] constexpr float to_float(float f) noexcept { return f; }

/// An OCP FP8 E4M3FN value held as its bit pattern (1 sign, 4 exponent bits with bias 7, 3 mantissa bits), the
/// storage of `KVDType::kFp8E4M3`. Layout-compatible with CUDA's `__nv_fp8_e4m3`. Finite range +-448, subnormals
/// down to 2^-9, no infinities, NaN = S.1111.111 (0x7f / 0xff). No arithmetic: convert to float.
struct Fp8E4M3 {
  std::uint8_t bits = 0;
  friend constexpr bool operator==(Fp8E4M3, Fp8E4M3) noexcept = default;  ///< Bitwise equality.
};
static_assert(sizeof(Fp8E4M3) == 1, "Fp8E4M3 must be a 1-byte storage type");

/// The largest finite e4m3 value, 448 = 1.75 * 2^8 (bits 0x7e).
inline constexpr float kFp8E4M3Max = 448.f;

/// Converts a float to e4m3, round to nearest, ties to even, *saturating*: every finite |f| >= 448 and +-inf give
/// +-448 (0x7e / 0xfe) -- the behaviour of CUDA's __nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3), chosen so
/// that an outlier never becomes NaN in the cache. NaN gives NaN (0x7f, sign kept). Values <= 2^-10 (half the
/// smallest subnormal) round to +-0 (2^-10 itself ties to even, 0); subnormals (multiples of 2^-9 below 2^-6) are
/// produced exactly. Pure function.
[[nodiscard]] constexpr std::uint8_t float_to_fp8_e4m3_bits(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint8_t>((x >> 24) & 0x80u);
  const std::uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<std::uint8_t>(sign | 0x7fu);  // NaN
  if (ax >= 0x43e00000u) return static_cast<std::uint8_t>(sign | 0x7eu);  // >= 448 or inf: saturate
  if (ax >= 0x3c800000u) {                                                // normal e4m3 range, >= 2^-6
    const std::uint32_t exp8 = (ax >> 23) - 127u + 7u;                    // in [1, 15]
    const std::uint32_t mant = ax & 0x007fffffu;
    std::uint32_t r = (exp8 << 3) | (mant >> 20);
    const std::uint32_t rem = mant & 0x000fffffu;
    if (rem > 0x00080000u || (rem == 0x00080000u && (r & 1u) != 0)) ++r;  // carry into the exponent is correct;
    return static_cast<std::uint8_t>(sign | r);                           // r <= 0x7e since |f| < 448 here
  }
  if (ax <= 0x3a800000u) return sign;  // <= 2^-10: rounds to zero (the tie at 2^-10 goes to even, 0)
  // Subnormal result: m = round(|f| / 2^-9) with |f| = mant24 * 2^(e - 23), e in [-10, -7].
  const std::uint32_t mant = (ax & 0x007fffffu) | 0x00800000u;
  const int e = static_cast<int>(ax >> 23) - 127;
  const int shift = 14 - e;  // in [21, 24]
  std::uint32_t m = mant >> shift;
  const std::uint32_t rem = mant & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1);
  if (rem > halfway || (rem == halfway && (m & 1u) != 0)) ++m;  // m == 8 is the smallest normal: correct
  return static_cast<std::uint8_t>(sign | m);
}

/// Converts an e4m3 bit pattern to float (exact: every e4m3 value is a float). 0x7f / 0xff give NaN. Pure.
[[nodiscard]] constexpr float fp8_e4m3_bits_to_float(std::uint8_t b) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t exp = (b >> 3) & 0x0fu;
  const std::uint32_t mant = b & 0x07u;
  if (exp == 15 && mant == 7) return std::bit_cast<float>(sign | 0x7fc00000u);
  if (exp == 0) {
    const float mag = static_cast<float>(mant) * 0x1p-9f;  // subnormal or zero, exact
    return sign != 0 ? -mag : mag;
  }
  return std::bit_cast<float>(sign | ((exp - 7u + 127u) << 23) | (mant << 20));
}

namespace detail {
[[nodiscard]] constexpr std::array<float, 256> make_fp8_e4m3_table() noexcept {
  std::array<float, 256> t{};
  for (unsigned i = 0; i < 256; ++i) t[i] = fp8_e4m3_bits_to_float(static_cast<std::uint8_t>(i));
  return t;
}
/// fp8_e4m3_bits_to_float for every code (the reference's load path).
inline constexpr std::array<float, 256> kFp8E4M3ToFloat = make_fp8_e4m3_table();
}  // namespace detail

/// float -> Fp8E4M3 (round to nearest even, saturating; see float_to_fp8_e4m3_bits). Pure function.
[[nodiscard]] constexpr Fp8E4M3 to_fp8_e4m3(float f) noexcept { return Fp8E4M3{float_to_fp8_e4m3_bits(f)}; }
/// Fp8E4M3 -> float (exact). Pure function.
[[nodiscard]] constexpr float to_float(Fp8E4M3 v) noexcept { return fp8_e4m3_bits_to_float(v.bits); }

/// True when `kv_dt` is one of the KVDType enumerators. Pure function.
[[nodiscard]] constexpr bool is_valid_kv_dtype(KVDType kv_dt) noexcept {
  return kv_dt == KVDType::kSame || kv_dt == KVDType::kFp8E4M3;
}

/// True for the three element types the reference kernels understand (float, Half, BFloat16).
template <class T>
concept ElementType = std::same_as<T, float> || std::same_as<T, Half> || std::same_as<T, BFloat16>;

/// float -> element type T (round to nearest even for the 16-bit types). Pure function.
template <ElementType T>
[[nodiscard]] constexpr T from_float(float f) noexcept {
  if constexpr (std::same_as<T, float>) {
    return f;
  } else if constexpr (std::same_as<T, Half>) {
    return to_half(f);
  } else {
    return to_bf16(f);
  }
}

/// The `DType` tag of element type T.
template <ElementType T>
inline constexpr DType kDTypeOf = std::same_as<T, float>  ? DType::kFloat32
                                  : std::same_as<T, Half> ? DType::kFloat16
                                                          : DType::kBFloat16;

/// True when `dt` is one of the enumerators {kFloat32, kFloat16, kBFloat16} (a value cast from a bad integer
/// is not). Pure function.
[[nodiscard]] constexpr bool is_valid_dtype(DType dt) noexcept {
  return dt == DType::kFloat32 || dt == DType::kFloat16 || dt == DType::kBFloat16;
}

/// Reads element `index` of type T from `base` (host memory) and returns it as float. Goes through memcpy, so
/// the buffer may have any declared type (no strict-aliasing issue) and needs no particular alignment.
/// Precondition: `base + index * sizeof(T)` is readable.
template <ElementType T>
[[nodiscard]] inline float load_as_float(const void* base, std::int64_t index) noexcept {
  T v;
  std::memcpy(&v, static_cast<const char*>(base) + index * static_cast<std::int64_t>(sizeof(T)), sizeof(T));
  return to_float(v);
}

/// Writes `value` converted to T (round to nearest even) as element `index` of `base` (host memory), via memcpy.
/// Precondition: `base + index * sizeof(T)` is writable.
template <ElementType T>
inline void store_from_float(void* base, std::int64_t index, float value) noexcept {
  const T v = from_float<T>(value);
  std::memcpy(static_cast<char*>(base) + index * static_cast<std::int64_t>(sizeof(T)), &v, sizeof(T));
}

/// Reads element `index` (in elements of `dt`, 64-bit) of the host buffer `base` and returns it as float.
/// Precondition: `is_valid_dtype(dt)` (otherwise returns NaN) and the element is readable. Pure read, thread safe.
/// Convenience for tests and tools; the reference kernels dispatch on the dtype once and use `load_as_float<T>`.
[[nodiscard]] inline float load(const void* base, DType dt, std::int64_t index) noexcept {
  switch (dt) {
    case DType::kFloat32: return load_as_float<float>(base, index);
    case DType::kFloat16: return load_as_float<Half>(base, index);
    case DType::kBFloat16: return load_as_float<BFloat16>(base, index);
  }
  return std::bit_cast<float>(0x7fc00000u);
}

/// Stores `value` as element `index` of the host buffer `base` in dtype `dt` (round to nearest even).
/// Precondition: `is_valid_dtype(dt)` (otherwise nothing is written) and the element is writable.
inline void store(void* base, DType dt, std::int64_t index, float value) noexcept {
  switch (dt) {
    case DType::kFloat32: store_from_float<float>(base, index, value); return;
    case DType::kFloat16: store_from_float<Half>(base, index, value); return;
    case DType::kBFloat16: store_from_float<BFloat16>(base, index, value); return;
  }
}

}  // namespace pagedkv::reference
