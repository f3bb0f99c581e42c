// Helpers shared by the host-core unit tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include <pagedkv/batch_metadata.hpp>
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

/// What one test build wrote: the sizes, the slot mapping and the copy pairs (the parts tests look at most).
struct BuiltStep {
  pagedkv::BatchMetadataSizes sizes;
  std::vector<std::int64_t> slots;
  std::vector<std::int32_t> copies;
};

/// Builds the metadata of `batch` on `m` with exactly sized slot-mapping and copy buffers (a build cannot drop
/// either), every other output skipped. Stands for "the engine ran this step": like an engine's scheduler, it
/// leaves out the live sequences with nothing to compute (a build refuses them); unknown ids are passed on (and
/// refused by the build).
template <class Mgr>
BuiltStep build_step(Mgr& m, std::span<const pagedkv::SeqId> batch) {
  std::size_t n = 0;
  std::vector<pagedkv::SeqId> scheduled;
  for (pagedkv::SeqId id : batch) {
    if (!m.contains(id)) {
      scheduled.push_back(id);
      continue;
    }
    const std::size_t p = m.pending_slots(id).size();
    n += p;
    if (p > 0) scheduled.push_back(id);
  }
  BuiltStep out;
  out.slots.assign(n, -2);
  out.copies.assign(2 * m.pending_copies().size(), -2);
  pagedkv::BatchMetadataBuffers buf;
  buf.slot_mapping = out.slots;
  buf.copies = out.copies;
  out.sizes = m.build_batch_metadata(scheduled, buf);
  return out;
}
template <class Mgr>
BuiltStep build_step(Mgr& m, std::initializer_list<pagedkv::SeqId> batch) {
  return build_step(m, std::span<const pagedkv::SeqId>(batch.begin(), batch.size()));
}

/// One step computing every pending position of `seq` on `m`, a pool of any number of groups: each group's slot
/// mapping and copies (exactly sized), every other output skipped.
template <class Mgr>
void step_groups(Mgr& m, pagedkv::SeqId seq) {
  const std::size_t G = m.num_groups();
  std::vector<std::vector<std::int64_t>> slots(G, std::vector<std::int64_t>(m.pending_slots(seq).size(), -2));
  std::vector<std::vector<std::int32_t>> copies(G, std::vector<std::int32_t>(2 * m.pending_copies().size() + 2, -2));
  std::vector<pagedkv::BatchMetadataBuffers> buf(G);
  for (std::size_t g = 0; g < G; ++g) {
    buf[g].slot_mapping = slots[g];
    buf[g].copies = copies[g];
  }
  const pagedkv::SeqId batch[] = {seq};
  (void)m.build_batch_metadata(batch, buf);
}

}  // namespace pagedkv_test
