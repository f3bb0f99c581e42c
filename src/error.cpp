#include <cstdio>
#include <cstdlib>
#include <utility>

#include <pagedkv/error.hpp>

namespace pagedkv {

const char* to_string(Errc code) noexcept {
  switch (code) {
    case Errc::kInvalidArgument: return "invalid_argument";
    case Errc::kUnknownSequence: return "unknown_sequence";
    case Errc::kDuplicateSequence: return "duplicate_sequence";
    case Errc::kDoubleFree: return "double_free";
    case Errc::kLimitExceeded: return "limit_exceeded";
    case Errc::kBlockOutOfRange: return "block_out_of_range";
    case Errc::kBadShape: return "bad_shape";
  }
  return "unknown_error";
}

Error::Error(Errc code, std::string message)
    : code_(code),
      message_(std::move(message)),
      what_(std::string("pagedkv: ") + to_string(code) + ": " + message_) {}

namespace detail {
void raise(Errc code, std::string message) {
#if defined(__cpp_exceptions) || defined(__EXCEPTIONS)
  throw Error(code, std::move(message));
#else
  std::fprintf(stderr, "pagedkv: %s: %s\n", to_string(code), message.c_str());
  std::abort();
#endif
}
}  // namespace detail

}  // namespace pagedkv
