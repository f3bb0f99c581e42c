// pagedkv/error.hpp: the one exception type raised on misuse, with stable error codes.
#pragma once

#include <exception>
#include <string>
#include <string_view>

#include <pagedkv/config.hpp>

namespace pagedkv {

/// Stable error codes carried by `pagedkv::Error`. Values never change meaning between releases.
/// Expected outcomes (no capacity, never fits, prefix miss, nothing evictable) are *not* errors: they are
/// returned as values.
enum class Errc : int {
  kInvalidArgument = 1,   ///< A parameter is out of its documented domain (e.g. block_size == 0).
  kUnknownSequence = 2,   ///< A sequence id that is not live (never admitted, or already freed).
  kDuplicateSequence = 3, ///< Admitting or forking into a sequence id that is already live.
  kDoubleFree = 4,        ///< Releasing a block whose refcount is already zero.
  kLimitExceeded = 5,     ///< A per-sequence limit (max tokens per sequence, rewind past the start) is exceeded.
  kBlockOutOfRange = 6,   ///< A block id >= num_blocks, or the null block where a real block is needed.
  kBadShape = 7,          ///< A caller buffer is too small or a shape/stride is inconsistent.
};

/// Name of an error code, e.g. "unknown_sequence". Never null.
[[nodiscard]] PAGEDKV_API const char* to_string(Errc code) noexcept;

/// The exception thrown on misuse of a pagedkv API. Every throwing call leaves the object it was called on
/// exactly as it was before the call (strong guarantee). `what()` is "pagedkv: <code>: <message>" and names
/// the offending value(s).
class PAGEDKV_API Error : public std::exception {
 public:
  Error(Errc code, std::string message);
  /// The stable code.
  [[nodiscard]] Errc code() const noexcept { return code_; }
  /// The message without the "pagedkv: <code>: " prefix.
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  [[nodiscard]] const char* what() const noexcept override { return what_.c_str(); }

 private:
  Errc code_;
  std::string message_;
  std::string what_;
};

namespace detail {
/// The single funnel through which the library raises errors. With exceptions disabled
/// (-fno-exceptions) it prints the same text to stderr and aborts.
[[noreturn]] PAGEDKV_API void raise(Errc code, std::string message);
}  // namespace detail

}  // namespace pagedkv
