// pagedkv/config.hpp: version, language level, export macro and the library's basic scalar types.
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>

static_assert(__cplusplus >= 202002L, "pagedkv needs C++20 (pass -std=c++20; for nvcc pass it explicitly)");

#define PAGEDKV_VERSION_MAJOR 0
#define PAGEDKV_VERSION_MINOR 1
#define PAGEDKV_VERSION_PATCH 0

/// Marks the few functions compiled into libpagedkv (src/). The library is built with hidden
/// visibility, so only these are exported from a shared build.
#if defined(PAGEDKV_STATIC_DEFINE)
#define PAGEDKV_API
#elif defined(_WIN32)
#if defined(PAGEDKV_BUILDING_LIBRARY)
#define PAGEDKV_API __declspec(dllexport)
#else
#define PAGEDKV_API __declspec(dllimport)
#endif
#else
#define PAGEDKV_API __attribute__((visibility("default")))
#endif

namespace pagedkv {

/// A token id as the tokenizer emits it (vLLM and SGLang use 32-bit ids).
using TokenId = std::int32_t;

/// A sequence (request) id chosen by the engine. Any value is valid; ids are unique among live sequences.
using SeqId = std::uint64_t;

/// Default block size in tokens (PagedAttention, Kwon et al. SOSP'23 sec. 4.1; vLLM's default).
inline constexpr std::uint32_t kDefaultBlockSize = 16;

/// Largest block size in tokens a pool may be configured with (2^16): both managers refuse a larger
/// `block_size` (kInvalidArgument), and so does the kernel contract's KVPoolView (kInvalidValue), so a block size
/// can never wrap the int32 `block_size` of a pool view, nor overflow int32 in-block arithmetic
/// (`block_size * num_kv_heads` rows of a page). Far above what engines use: vLLM's largest are its hybrid-model
/// page-size alignments (hundreds to a few thousand tokens) and DeepSeek-V4's LCM scheduler block of 4096.
inline constexpr std::uint32_t kMaxBlockSize = std::uint32_t{1} << 16;

/// Requirements on a physical block id type: an unsigned integer. Block id 0 is the null block.
/// `std::uint32_t` (the default) addresses 4 billion blocks, which is 64 Gi tokens at block size 16.
template <class T>
concept BlockIdType = std::unsigned_integral<T> && !std::same_as<T, bool> && sizeof(T) >= 2;

/// The reserved null block: never handed out, never hashed; the padding target of fixed-shape block tables.
template <BlockIdType Id>
inline constexpr Id kNullBlock = Id{0};

}  // namespace pagedkv
