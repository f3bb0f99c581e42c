// pagedkv/hash.hpp: block hashes for prefix caching, and the two hash policies (SHA-256, XXH3-128).
#pragma once

#include <array>
#include <compare>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>

#include <pagedkv/config.hpp>

namespace pagedkv {

/// A 128-bit block hash (or chain seed). For SHA-256 it is the first 16 bytes of the digest; for XXH3-128 the
/// whole digest. 128 bits keep the per-block host metadata within 32 bytes while leaving accidental collisions at
/// ~2^-64 per pair (birthday bound 2^64 blocks); see docs/design.md "Block hashes".
struct BlockHash {
  std::array<std::uint8_t, 16> bytes{};

  /// Equality as two 64-bit compares (a defaulted operator compiles to a memcmp call per hash-map probe).
  friend bool operator==(const BlockHash& a, const BlockHash& b) noexcept {
    std::uint64_t x[2];
    std::uint64_t y[2];
    std::memcpy(x, a.bytes.data(), 16);
    std::memcpy(y, b.bytes.data(), 16);
    return ((x[0] ^ y[0]) | (x[1] ^ y[1])) == 0;
  }
  friend constexpr auto operator<=>(const BlockHash& a, const BlockHash& b) noexcept { return a.bytes <=> b.bytes; }

  /// The first 8 bytes, little-endian: a well-mixed 64-bit value for hash tables.
  [[nodiscard]] std::uint64_t low64() const noexcept {
    std::uint64_t v;
    std::memcpy(&v, bytes.data(), sizeof v);
    return v;
  }
  /// Lower-case hex, 32 characters (the form events and logs print).
  [[nodiscard]] std::string hex() const;
};

/// std::hash-compatible functor over BlockHash (uses the already uniform low 64 bits).
struct BlockHashHasher {
  [[nodiscard]] std::size_t operator()(const BlockHash& h) const noexcept { return static_cast<std::size_t>(h.low64()); }
};

/// Requirements on a block-hash policy: a stateless type with a static `hash` over a byte string returning a
/// BlockHash, a `kName`, and a `kCryptographic` flag. The bytes hashed are the canonical block encoding of
/// `detail::encode_block` (docs/design.md), so equal policies give equal hashes across processes.
template <class H>
concept BlockHasher = requires(std::span<const std::byte> bytes) {
  { H::hash(bytes) } -> std::same_as<BlockHash>;
  { H::kName } -> std::convertible_to<const char*>;
  { H::kCryptographic } -> std::convertible_to<bool>;
};

/// SHA-256 (OpenSSL libcrypto), truncated to 128 bits. The default: reproducible across processes and languages,
/// and infeasible to collide on purpose, so tenants cannot poison each other's cache (vLLM's default since
/// v0.8.3 for the same reason). About 70-90 ns per 16-token block on x86 with SHA extensions.
struct Sha256Hasher {
  static constexpr const char* kName = "sha256";
  static constexpr bool kCryptographic = true;
  /// Hash `bytes`. Thread-safe; never allocates.
  [[nodiscard]] PAGEDKV_API static BlockHash hash(std::span<const std::byte> bytes) noexcept;
};

/// XXH3-128 (libxxhash). Several times faster than SHA-256 but not collision resistant against an adversary:
/// for single-tenant deployments only.
struct Xxh3Hasher {
  static constexpr const char* kName = "xxh3_128";
  static constexpr bool kCryptographic = false;
  /// Hash `bytes`. Thread-safe; never allocates.
  [[nodiscard]] PAGEDKV_API static BlockHash hash(std::span<const std::byte> bytes) noexcept;
};

static_assert(BlockHasher<Sha256Hasher>);
static_assert(BlockHasher<Xxh3Hasher>);

}  // namespace pagedkv
