// Guards of the manager split (issue 32; docs/design.md "The manager in parts"): moving the manager's code into
// parts must not grow the per-sequence state every admission allocates and every build walks. The sizes are
// pinned for the platform the project ships on (x86-64 / AArch64 Linux, libstdc++: 8-byte size_t, 24-byte
// std::vector, 16-byte std::shared_ptr); elsewhere the test only checks that they are what the members add up to.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <pagedkv/detail/hit_search.hpp>
#include <pagedkv/group_policy.hpp>
#include <pagedkv/hash.hpp>
#include <pagedkv/host_tier.hpp>
#include <pagedkv/prefix_hash_index.hpp>
#include <pagedkv/sequence_state.hpp>

namespace {

constexpr bool kPinnedAbi = sizeof(std::size_t) == 8 && sizeof(std::vector<int>) == 24 &&
                            sizeof(std::shared_ptr<int>) == 16 && sizeof(pagedkv::BlockTable<std::uint32_t>) == 40;

}  // namespace

static_assert(!kPinnedAbi || sizeof(pagedkv::SequenceState<std::uint32_t>) == 208,
              "SequenceState grew (or shrank): the manager split must not change the per-sequence state; if the "
              "change is deliberate, update this pin and say why in docs/design.md");
static_assert(!kPinnedAbi || sizeof(pagedkv::GroupTableState<std::uint32_t>) == 104,
              "GroupTableState changed size: see the SequenceState pin above");

TEST_CASE("the per-sequence state keeps its size through the manager split", "[guards]") {
  // The pins above, at run time too (so a platform without them still reports what it has).
  INFO("sizeof(SequenceState<uint32_t>) = " << sizeof(pagedkv::SequenceState<std::uint32_t>)
                                            << ", sizeof(GroupTableState<uint32_t>) = "
                                            << sizeof(pagedkv::GroupTableState<std::uint32_t>));
  if (kPinnedAbi) {
    CHECK(sizeof(pagedkv::SequenceState<std::uint32_t>) == 208);
    CHECK(sizeof(pagedkv::GroupTableState<std::uint32_t>) == 104);
  }
  // Group 0 lives inline (its table is a member, not an element of other_groups): a one-group sequence allocates
  // no group vector.
  const pagedkv::SequenceState<std::uint32_t> one(16);
  CHECK(one.other_groups.capacity() == 0);
  CHECK(one.num_groups() == 1);
}

// The hit search is a part below the facade (detail/hit_search.hpp): it runs on a probe, an index and a host tier
// alone, with no manager. These pin what it finds against the definitions (the fixed point's brute force, the
// hashes of hash_full_blocks), so a move that changes the search fails here before it fails in the manager.
TEST_CASE("the fixed point over groups runs on a probe alone", "[guards][hit_search]") {
  using namespace pagedkv;
  // Full attention and a 32-token sliding window at 16-token blocks; 8 blocks walked.
  const std::vector<KVCacheGroupSpec> specs{{AttentionKind::kFull, 0}, {AttentionKind::kSlidingWindow, 32}};
  const GroupLayout layout(specs, 16);
  // tier[g][i]: 1 device, 2 host, 0 neither. Group 0 holds blocks 0..6 (block 2 on the host); group 1 blocks 3..5
  // (block 5 on the host). Device block of (g, i): 100 g + i + 1.
  const std::uint8_t tier[2][8] = {{1, 1, 2, 1, 1, 1, 1, 0}, {0, 0, 0, 1, 1, 2, 0, 0}};
  std::size_t probes[2][8] = {};
  const auto probe = [&](std::size_t g, std::size_t i) {
    ++probes[g][i];
    return detail::CachedAt<std::uint32_t>{tier[g][i], tier[g][i] != 0 ? static_cast<std::uint32_t>(100 * g + i + 1) : 0U};
  };
  const auto evictable = [](std::uint32_t b) { return b % 2 == 0; };
  detail::HitScratch<std::uint32_t> sc;
  const detail::HitCounts c = detail::groups_hit(layout, 8, probe, evictable, sc);
  // The brute-force maximum: every group holds every block of its window's [first kept, k).
  std::size_t brute = 0;
  for (std::size_t k = 0; k <= 8; ++k) {
    bool ok = true;
    for (std::size_t g = 0; g < 2; ++g) {
      for (std::size_t i = detail::first_kept_block(layout.windows[g], k * 16, 16); i < k; ++i) ok = ok && tier[g][i] != 0;
    }
    if (ok) brute = k;
  }
  CHECK(brute == 6);  // at 7 the window (block 5 from query 112 on) needs block 6 of group 1
  REQUIRE(c.k == brute);
  CHECK(c.held == 6 + 2);         // group 0: blocks 0..5; group 1: its window's blocks 4, 5
  CHECK(c.host == 2);             // (0, 2) and (1, 5)
  CHECK(c.host_blocks == 2);      // blocks 2 and 5
  CHECK(c.evictable == 3);        // device blocks 2, 4, 6 of group 0 (even ids)
  const std::vector<std::uint32_t> hits{1, 2, 3, 4, 5, 6, 0, 0, 0, 0, 105, 106};
  CHECK(sc.hits == hits);
  const std::vector<bool> on_host{false, false, true, false, false, false, false, false, false, false, false, true};
  CHECK(sc.on_host == on_host);
  for (std::size_t g = 0; g < 2; ++g) {
    for (std::size_t i = 0; i < 8; ++i) CHECK(probes[g][i] <= 1);  // each (group, block) probed once at most
  }
}

TEST_CASE("the one-group walk hashes the prompt and stops at the first miss in both tiers", "[guards][hit_search]") {
  using namespace pagedkv;
  using Index = PrefixHashIndex<Xxh3Hasher, std::uint32_t>;
  using Host = HostTier<Xxh3Hasher, std::uint32_t>;
  Index index(64, 7);
  Host host(16, 7);
  std::vector<TokenId> prompt(22);
  for (std::size_t t = 0; t < prompt.size(); ++t) prompt[t] = static_cast<TokenId>(1000 + 37 * t);
  std::vector<BlockHash> expected;
  index.hash_full_blocks(prompt, 4, nullptr, expected);
  REQUIRE(expected.size() == 5);
  for (std::uint32_t i = 0; i < 3; ++i) (void)index.insert(expected[i], i + 1);  // device: blocks 0..2
  const auto hb = host.allocate(&expected[3], [](std::uint32_t, const BlockHash&) {});  // host: block 3
  REQUIRE(hb);
  host.mark_ready(*hb);
  const auto evictable = [](std::uint32_t b) { return b == 2; };
  detail::HitScratch<std::uint32_t> sc;
  std::vector<BlockHash> hashes;
  detail::HitCounts c = detail::one_group_hit(index, &host, prompt, 4, 5, 5, nullptr, hashes, false, evictable, sc);
  CHECK(hashes == expected);  // every full block hashed, past the miss
  CHECK(c.k == 4);
  CHECK(c.host == 1);
  CHECK(c.evictable == 1);
  CHECK(sc.hits == std::vector<std::uint32_t>{1, 2, 3, *hb});
  CHECK(sc.on_host == std::vector<bool>{false, false, false, true});
  // Ready hashes, the walk capped at 2 blocks; then without the host tier.
  sc.hits.clear();
  sc.on_host.clear();
  c = detail::one_group_hit(index, &host, prompt, 4, 5, 2, nullptr, hashes, true, evictable, sc);
  CHECK(c.k == 2);
  CHECK(hashes == expected);
  sc.hits.clear();
  sc.on_host.clear();
  c = detail::one_group_hit(index, static_cast<const Host*>(nullptr), prompt, 4, 5, 5, nullptr, hashes, true,
                            evictable, sc);
  CHECK(c.k == 3);
  CHECK(c.host == 0);
}
