// tests/unit/support/shadow_engine.hpp: an engine for the tests that compare two engines' KV by content (external
// KV: tests/unit/test_external_kv_{windows,recurrent,coarse}.cpp). It pairs a manager with a shadow of its pool, as a
// model runner's kernels would fill it: the "K/V" of position p of token t is kv(t, p), written through each build's
// slot mapping into the page of the group's size; a recurrent group's state is the toy recurrence of
// tests/fuzz/recurrent_model.hpp (scan_step), read from the build's state_in and written to its checkpoints and
// state_out; a build's copies run first. A transfer between engines copies shadow pages or states.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "../../fuzz/recurrent_model.hpp"
#include <pagedkv/batch_metadata.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace pagedkv_test {

/// The K/V a kernel writes for token t at position p (never -1, the shadow's "never written").
inline std::int64_t kv(pagedkv::TokenId t, std::size_t p) {
  return static_cast<std::int64_t>(t) * 100003 + static_cast<std::int64_t>(p) + 1;
}

/// A recurrent state block never written.
inline constexpr std::uint64_t kPoisonState = 0xBADC0FFEE0DDF00DULL;

/// One engine: a manager, one metadata storage per group (a batch of one sequence, up to 256 tokens a step), and
/// the shadow of its pool: attention pages (block -> its group's page of values, -1 never written) and recurrent
/// states (block -> state, kPoisonState never written).
struct ShadowEngine {
  pagedkv::KVCacheManager<> m;
  std::vector<pagedkv::BatchMetadataStorage> store;
  std::map<std::uint32_t, std::vector<std::int64_t>> pages;
  std::map<std::uint32_t, std::uint64_t> states;

  explicit ShadowEngine(const pagedkv::CacheConfig& c) : m(c) {
    pagedkv::BatchMetadataLimits lim;
    lim.max_batch = 1;
    lim.max_tokens_per_step = 256;
    lim.max_blocks_per_seq = 1024;
    lim.max_copies = 16;
    for (std::size_t g = 0; g < m.num_groups(); ++g) store.emplace_back(lim);
  }
  /// Block b's page as group g lays it out (m.block_size(g) values; a block of another size is reset, unwritten).
  std::vector<std::int64_t>& page(std::uint32_t b, std::size_t g = 0) {
    auto& v = pages[b];
    if (v.size() != m.block_size(g)) v.assign(m.block_size(g), -1);
    return v;
  }
  /// Block b's recurrent state (kPoisonState: never written).
  [[nodiscard]] std::uint64_t state(std::uint32_t b) const {
    const auto it = states.find(b);
    return it == states.end() ? kPoisonState : it->second;
  }

  /// Build `n` tokens of `seq` (whose tokens are `prompt`) and run the step on the shadow: the build's copies, the
  /// K/V of every attention group through its slot mapping (every position gets a slot, or -1 for a block the
  /// registration switched to an identical registered one), each recurrent group's recurrence from state_in with
  /// its checkpoints and state_out. Returns the build's sizes; the metadata stays in `store`.
  std::vector<pagedkv::BatchMetadataSizes> build(pagedkv::SeqId seq, const std::vector<pagedkv::TokenId>& prompt,
                                                 std::size_t n) {
    std::vector<pagedkv::BatchMetadataBuffers> bufs;
    for (auto& st : store) {
      std::fill(st.slot_mapping.begin(), st.slot_mapping.end(), -7);
      bufs.push_back(st.buffers());
    }
    const std::size_t first = m.num_built(seq);
    const std::vector<pagedkv::SeqId> batch{seq};
    const std::vector<std::uint32_t> sched{static_cast<std::uint32_t>(n)};
    const auto sizes = m.build_batch_metadata(batch, bufs, sched);
    const std::size_t G = m.num_groups();
    for (std::size_t g = 0; g < G; ++g) {  // copy-on-writes first
      const auto& st = store[g];
      for (std::size_t j = 0; j < sizes[g].num_copies; ++j) {
        const auto src = static_cast<std::uint32_t>(st.copies[2 * j]);
        const auto dst = static_cast<std::uint32_t>(st.copies[2 * j + 1]);
        if (m.is_recurrent(g)) {
          states[dst] = state(src);
        } else {
          page(dst, g) = page(src, g);
        }
      }
    }
    for (std::size_t g = 0; g < G; ++g) {
      const auto& st = store[g];
      if (!m.is_recurrent(g)) {
        const auto B = static_cast<std::int64_t>(m.block_size(g));
        for (std::size_t k = 0; k < n; ++k) {
          const std::int64_t slot = st.slot_mapping[k];
          REQUIRE(slot != -7);
          if (slot < 0) continue;  // switched to a registered duplicate: its content is there already
          page(static_cast<std::uint32_t>(slot / B), g)[static_cast<std::size_t>(slot % B)] =
              kv(prompt[first + k], first + k);
        }
        continue;
      }
      REQUIRE((st.state_in[0] != -1 || first == 0));
      std::uint64_t s = st.state_in[0] == -1 ? 0 : state(static_cast<std::uint32_t>(st.state_in[0]));
      std::vector<std::pair<std::uint32_t, std::uint64_t>> writes;  // a step's reads come before its writes
      std::int32_t c = st.checkpoint_indptr[0];
      for (std::size_t p = first; p < first + n; ++p) {
        s = pagedkv_recurrent::scan_step(s, prompt[p], p);
        while (c < st.checkpoint_indptr[1] && static_cast<std::size_t>(st.checkpoint_positions[c]) == p + 1) {
          writes.emplace_back(static_cast<std::uint32_t>(st.checkpoint_blocks[c]), s);
          ++c;
        }
      }
      REQUIRE(c == st.checkpoint_indptr[1]);
      REQUIRE(st.state_out[0] == static_cast<std::int32_t>(m.state_block(seq, g)));
      writes.emplace_back(static_cast<std::uint32_t>(st.state_out[0]), s);
      for (const auto& [b, v] : writes) states[b] = v;
    }
    return sizes;
  }

  /// Build `seq` up to `end` positions in random chunks of 1 to 9 tokens.
  void build_to(pagedkv::SeqId seq, const std::vector<pagedkv::TokenId>& prompt, std::size_t end,
                std::mt19937& rng) {
    while (m.num_built(seq) < end) {
      const std::size_t left = end - m.num_built(seq);
      build(seq, prompt, std::min<std::size_t>(left, 1 + rng() % 9));
    }
  }
};

}  // namespace pagedkv_test
