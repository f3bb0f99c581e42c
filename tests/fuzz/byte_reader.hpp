// tests/fuzz/byte_reader.hpp: the fuzz input as a stream of small decisions, and its inverse for writing seeds.
//
// Every value is read from the front of the input, one byte per decision (two for a u16), so a seed file is a
// readable sequence of ops and their arguments (tests/fuzz/make_seeds.cpp writes them with ByteWriter) and a
// mutation of one byte changes one decision. An exhausted input reads as zeros: every byte string is a valid input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace pagedkv_fuzz {

/// Reads decisions from the fuzz input, front to back. Past the end every read returns 0.
class ByteReader {
 public:
  explicit ByteReader(std::span<const std::uint8_t> data) noexcept : data_(data) {}

  /// True once every byte has been read.
  [[nodiscard]] bool empty() const noexcept { return pos_ >= data_.size(); }
  /// Bytes read so far.
  [[nodiscard]] std::size_t consumed() const noexcept { return pos_; }

  [[nodiscard]] std::uint8_t u8() noexcept { return pos_ < data_.size() ? data_[pos_++] : 0; }
  [[nodiscard]] std::uint16_t u16() noexcept {
    const std::uint16_t lo = u8();
    return static_cast<std::uint16_t>(lo | (std::uint16_t{u8()} << 8));
  }
  [[nodiscard]] bool flag() noexcept { return (u8() & 1U) != 0; }
  /// A value in [0, n) from one byte (n in [1, 256]).
  [[nodiscard]] std::size_t below(std::size_t n) noexcept {
    const std::size_t b = u8();
    return n <= 1 ? 0 : b % n;
  }

 private:
  std::span<const std::uint8_t> data_;
  std::size_t pos_ = 0;
};

/// Writes decisions in the layout ByteReader reads (for the seed corpus).
class ByteWriter {
 public:
  ByteWriter& u8(std::uint8_t v) {
    bytes_.push_back(v);
    return *this;
  }
  ByteWriter& u16(std::uint16_t v) {
    bytes_.push_back(static_cast<std::uint8_t>(v & 0xFF));
    bytes_.push_back(static_cast<std::uint8_t>(v >> 8));
    return *this;
  }
  [[nodiscard]] const std::vector<std::uint8_t>& bytes() const noexcept { return bytes_; }

 private:
  std::vector<std::uint8_t> bytes_;
};

}  // namespace pagedkv_fuzz
