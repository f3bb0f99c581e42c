// src/events_zmq/zmq_util.hpp: small helpers shared by the publisher and the subscriber (private to the component).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include <zmq.hpp>

#include <pagedkv/error.hpp>

namespace pagedkv::events::zmq_detail {

/// `v` as 8 big-endian bytes (vLLM: seq.to_bytes(8, "big")).
inline std::array<std::uint8_t, 8> be64(std::uint64_t v) noexcept {
  std::array<std::uint8_t, 8> b{};
  for (int i = 7; i >= 0; --i) {
    b[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v);
    v >>= 8;
  }
  return b;
}

/// 8 big-endian bytes as an integer (vLLM: int.from_bytes(b, "big")). Precondition: at least 8 bytes at `p`.
inline std::uint64_t from_be64(const void* p) noexcept {
  const auto* b = static_cast<const std::uint8_t*>(p);
  std::uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v = (v << 8) | b[i];
  return v;
}

/// Raise kInvalidArgument for a ZeroMQ failure on `endpoint`.
[[noreturn]] inline void raise_zmq(const std::string& what, const std::string& endpoint, const zmq::error_t& e) {
  pagedkv::detail::raise(Errc::kInvalidArgument,
                         what + " '" + endpoint + "': " + e.what() + " (zmq errno " + std::to_string(e.num()) + ")");
}

}  // namespace pagedkv::events::zmq_detail
