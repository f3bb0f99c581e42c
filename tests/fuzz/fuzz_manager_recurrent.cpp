// tests/fuzz/fuzz_manager_recurrent.cpp: libFuzzer target driving KVCacheManager with recurrent-state groups (issue
// 20): a full-attention group, optionally a sliding-window group, and one or two recurrent groups with checkpoint
// intervals and the last checkpoint decoded from the input, optionally a host tier, then operations decoded from it
// (admission of document prefixes, whole or chunked; growth; builds with partial schedules; fork; free; preemption
// by recompute and re-admission, or by swapping and resume; marked checkpoints; rewind of unbuilt positions, and of
// built ones, which must be refused). The engine of
// recurrent_model.hpp runs every build with a toy recurrence over a shadow pool and checks after every operation
// that every working state, hit checkpoint, last checkpoint and registered checkpoint holds the scan of its
// tokens, that refcounts and per-group held counts equal their holders, and that every hit is the brute-force
// maximum over the groups. Any input decodes to a run (an exhausted input reads as zeros): the seeds
// (tests/fuzz/corpus/manager_recurrent) are random bytes. docs/fuzzing.md.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>

#include "byte_reader.hpp"
#include "recurrent_model.hpp"

namespace {

using pagedkv::AttentionKind;

pagedkv::CacheConfig decode_config(pagedkv_fuzz::ByteReader& r) {
  const std::uint8_t f = r.u8();
  constexpr std::uint32_t kBs[4] = {1, 2, 4, 8};
  pagedkv::CacheConfig c;
  c.block_size = kBs[f & 3];
  c.enable_prefix_caching = (f & 12) != 12;
  c.num_blocks = 8 + r.u8() % 160;
  c.hash_seed = r.u8();
  if ((f & 64) != 0) c.num_host_blocks = 2 + r.u8() % 100;  // a host tier: swap preemption, resume, write-back
  c.groups.push_back({AttentionKind::kFull, 0, 1});
  if ((f & 16) != 0) {
    c.groups.push_back({AttentionKind::kSlidingWindow, 1 + static_cast<std::uint32_t>(r.u8() % (3 * c.block_size + 5)), 1});
  }
  const std::size_t recurrent = 1 + ((f >> 5) & 1);
  for (std::size_t i = 0; i < recurrent; ++i) {
    const std::uint8_t k = r.u8();
    c.groups.push_back({AttentionKind::kRecurrent, c.block_size * (1 + k % 4), 1, 0, (k & 4) != 0});
  }
  return c;
}

std::string config_text(const pagedkv::CacheConfig& c) {
  std::string t = "num_blocks " + std::to_string(c.num_blocks) + ", block_size " + std::to_string(c.block_size) +
                  ", prefix caching " + std::to_string(c.enable_prefix_caching) + ", host blocks " +
                  std::to_string(c.num_host_blocks) + ", groups {";
  for (const auto& g : c.groups) {
    t += std::string(pagedkv::to_string(g.kind)) + " " + std::to_string(g.window_tokens) +
         (g.last_checkpoint ? " +last" : "") + "; ";
  }
  return t + "}";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  pagedkv_fuzz::ByteReader r(std::span<const std::uint8_t>(data, size));
  const pagedkv::CacheConfig c = decode_config(r);
  const std::string text = config_text(c);
  const auto fail = [&text](const std::string& what) {
    std::fprintf(stderr, "\n==== pagedkv fuzz (recurrent): invariant violated: %s\n==== config: %s\n", what.c_str(),
                 text.c_str());
    std::fflush(stderr);
    std::abort();
  };
  pagedkv_recurrent::Engine<decltype(fail)> e(c, size, fail);
  (void)pagedkv_recurrent::run_ops(
      e, 400, [&](std::size_t n) { return n == 0 ? std::size_t{0} : static_cast<std::size_t>(r.u16() % n); },
      [&] { return r.empty(); });
  return 0;
}
