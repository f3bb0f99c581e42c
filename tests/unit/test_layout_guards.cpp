// Guards of the manager split (issue 32; docs/design.md "The manager in parts"): moving the manager's code into
// parts must not grow the per-sequence state every admission allocates and every build walks. The sizes are
// pinned for the platform the project ships on (x86-64 / AArch64 Linux, libstdc++: 8-byte size_t, 24-byte
// std::vector, 16-byte std::shared_ptr); elsewhere the test only checks that they are what the members add up to.
#include <catch2/catch.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include <pagedkv/sequence_state.hpp>

namespace {

constexpr bool kPinnedAbi = sizeof(std::size_t) == 8 && sizeof(std::vector<int>) == 24 &&
                            sizeof(std::shared_ptr<int>) == 16 && sizeof(pagedkv::BlockTable<std::uint32_t>) == 40;

}  // namespace

static_assert(!kPinnedAbi || sizeof(pagedkv::SequenceState<std::uint32_t>) == 192,
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
    CHECK(sizeof(pagedkv::SequenceState<std::uint32_t>) == 192);
    CHECK(sizeof(pagedkv::GroupTableState<std::uint32_t>) == 104);
  }
  // Group 0 lives inline (its table is a member, not an element of other_groups): a one-group sequence allocates
  // no group vector.
  const pagedkv::SequenceState<std::uint32_t> one(16);
  CHECK(one.other_groups.capacity() == 0);
  CHECK(one.num_groups() == 1);
}
