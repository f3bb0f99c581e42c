// How many random seeds a long randomized test runs. The developer's default is the test's own count; the CI
// command (scripts/test.sh, under ASan + UBSan) sets PAGEDKV_TEST_SEED_DIVISOR to run a fraction of them: fewer
// random cases, the same assertions on each, and totals checked against thresholds scaled by the same fraction
// (issue: the CI command under 40 minutes). Test-only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace pagedkv_test {

/// The number of seeds to run out of `full` (>= 1): `full` unless the environment variable
/// PAGEDKV_TEST_SEED_DIVISOR is a positive integer d, then ceil(full / d), at least `min_seeds` (clamped to
/// `full`). Throws std::invalid_argument naming the value when the variable is set but not a positive integer.
inline std::uint64_t seed_count(std::uint64_t full, std::uint64_t min_seeds = 2) {
  const char* env = std::getenv("PAGEDKV_TEST_SEED_DIVISOR");
  if (env == nullptr || *env == '\0') return full;
  char* end = nullptr;
  const std::uint64_t d = std::strtoull(env, &end, 10);
  if (end == env || *end != '\0' || d == 0) {
    throw std::invalid_argument(std::string("PAGEDKV_TEST_SEED_DIVISOR='") + env +
                                "': expected a positive integer (the fraction 1/d of each randomized test's seeds)");
  }
  return std::min(full, std::max(min_seeds, (full + d - 1) / d));
}

}  // namespace pagedkv_test
