// Helpers shared by the host-core unit tests.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>

namespace pagedkv_test {

/// Runs f, checks it throws pagedkv::Error with `code`, and returns the message (empty, and a failure, if not).
template <class F>
std::string expect_error(F&& f, pagedkv::Errc code) {
  try {
    f();
  } catch (const pagedkv::Error& e) {
    CHECK(e.code() == code);
    return e.message();
  }
  FAIL("expected pagedkv::Error(" << pagedkv::to_string(code) << ")");
  return {};
}

/// n consecutive token ids starting at `first`.
inline std::vector<pagedkv::TokenId> toks(pagedkv::TokenId first, std::size_t n) {
  std::vector<pagedkv::TokenId> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = first + static_cast<pagedkv::TokenId>(i);
  return t;
}

}  // namespace pagedkv_test
