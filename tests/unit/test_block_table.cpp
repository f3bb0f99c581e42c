// Tests of pagedkv/block_table.hpp: slot arithmetic, all-or-nothing append, fork (shares, allocates nothing),
// copy-on-write of a shared or hashed partial block (one copy; the table's source reference passes to the copy),
// rewind (tail blocks released last first; a shared or hashed block is never written afterwards), release order.
#include <catch2/catch.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/block_table.hpp>
#include <pagedkv/error.hpp>

namespace {

using pagedkv::BlockCopy;
using pagedkv::Errc;
using Alloc = pagedkv::BlockAllocator<std::uint32_t>;
using Table = pagedkv::BlockTable<std::uint32_t>;
using Copy = std::optional<BlockCopy<std::uint32_t>>;
using Slots = std::vector<std::int64_t>;
using Ids = std::vector<std::uint32_t>;

using pagedkv_test::expect_error;

const auto kNoEvict = [](std::uint32_t) { FAIL("unexpected eviction"); };

Ids ids(const Table& t) { return Ids(t.blocks().begin(), t.blocks().end()); }

// Appends n tokens, requiring success; returns the new slots and the copy.
std::pair<Slots, Copy> append(Table& t, std::size_t n, Alloc& a) {
  Slots slots;
  Copy copy;
  REQUIRE(t.try_append(n, a, kNoEvict, &slots, copy));
  return {slots, copy};
}

Slots range_slots(std::int64_t first, std::int64_t n) {
  Slots s;
  for (std::int64_t i = 0; i < n; ++i) s.push_back(first + i);
  return s;
}

}  // namespace

TEST_CASE("BlockTable: block_size 0 is rejected", "[block_table][errors]") {
  CHECK_THAT(expect_error([] { Table t(0); }, Errc::kInvalidArgument), Catch::Contains("block_size = 0"));
}

TEST_CASE("BlockTable: slots are block * block_size + offset", "[block_table][slots]") {
  Alloc a(20);
  SECTION("block size 4") {
    Table t(4);
    CHECK(t.block_size() == 4);
    CHECK(t.num_tokens() == 0);
    CHECK(t.num_blocks() == 0);
    CHECK(t.last_block_len() == 0);
    auto [s1, c1] = append(t, 6, a);
    CHECK_FALSE(c1.has_value());
    CHECK(ids(t) == Ids{1, 2});
    CHECK(s1 == Slots{4, 5, 6, 7, 8, 9});
    CHECK(t.num_tokens() == 6);
    CHECK(t.last_block_len() == 2);
    auto [s2, c2] = append(t, 3, a);
    CHECK_FALSE(c2.has_value());
    CHECK(ids(t) == Ids{1, 2, 3});
    CHECK(s2 == Slots{10, 11, 12});
    CHECK(t.last_block_len() == 1);
    auto [s3, c3] = append(t, 3, a);
    CHECK(s3 == Slots{13, 14, 15});
    CHECK(t.last_block_len() == 4);  // full last block: block_size, not 0
    CHECK(ids(t) == Ids{1, 2, 3});
    for (std::size_t p = 0; p < 12; ++p) {
      CHECK(t.slot(p) == static_cast<std::int64_t>(t.blocks()[p / 4]) * 4 + static_cast<std::int64_t>(p % 4));
    }
  }
  SECTION("block size 1: one block per token") {
    Table t(1);
    auto [s, c] = append(t, 3, a);
    CHECK(ids(t) == Ids{1, 2, 3});
    CHECK(s == Slots{1, 2, 3});
    CHECK(t.last_block_len() == 1);
  }
  SECTION("block size 16") {
    Table t(16);
    auto [s, c] = append(t, 17, a);
    CHECK(ids(t) == Ids{1, 2});
    Slots want = range_slots(16, 16);
    want.push_back(32);
    CHECK(s == want);
  }
  SECTION("slots go to the end of slots_out, after what it held") {
    Table t(4);
    Slots out{-7};
    Copy copy;
    REQUIRE(t.try_append(2, a, kNoEvict, &out, copy));
    CHECK(out == Slots{-7, 4, 5});
  }
  SECTION("appending zero tokens is a no-op that succeeds") {
    Table t(4);
    Slots out;
    Copy copy = BlockCopy<std::uint32_t>{1, 2};
    REQUIRE(t.try_append(0, a, kNoEvict, &out, copy));
    CHECK_FALSE(copy.has_value());  // reset
    CHECK(out.empty());
    CHECK(t.num_blocks() == 0);
    CHECK(a.num_used_blocks() == 0);
  }
}

TEST_CASE("BlockTable: blocks_needed_to_append counts new blocks plus a copy", "[block_table][slots]") {
  Alloc a(20);
  Table t(4);
  CHECK(t.blocks_needed_to_append(0, a) == 0);
  CHECK(t.blocks_needed_to_append(1, a) == 1);
  CHECK(t.blocks_needed_to_append(4, a) == 1);
  CHECK(t.blocks_needed_to_append(5, a) == 2);
  append(t, 5, a);
  CHECK(t.blocks_needed_to_append(3, a) == 0);
  CHECK(t.blocks_needed_to_append(4, a) == 1);
  Table child = t.fork(a);
  CHECK(t.last_block_needs_copy(a));
  CHECK(t.blocks_needed_to_append(3, a) == 1);  // the copy
  CHECK(t.blocks_needed_to_append(4, a) == 2);
  CHECK(t.blocks_needed_to_append(0, a) == 0);
  child.release_all(a);
  CHECK_FALSE(t.last_block_needs_copy(a));
}

TEST_CASE("BlockTable: append is all or nothing", "[block_table][atomic]") {
  Alloc a(4);  // 3 usable
  Table t(4);
  append(t, 6, a);  // blocks 1, 2
  const auto free_before = a.num_free_blocks();
  Slots out{42};
  Copy copy;
  CHECK_FALSE(t.try_append(7, a, kNoEvict, &out, copy));  // needs 2 new blocks, 1 available
  CHECK(out == Slots{42});
  CHECK_FALSE(copy.has_value());
  CHECK(t.num_tokens() == 6);
  CHECK(ids(t) == Ids{1, 2});
  CHECK(a.num_free_blocks() == free_before);
  CHECK(a.refcount(3) == 0);
  // 6 fits exactly (2 in block 2, 4 in block 3).
  CHECK(t.try_append(6, a, kNoEvict, &out, copy));
  CHECK(out == Slots{42, 10, 11, 12, 13, 14, 15});

  SECTION("a copy-on-write that does not fit fails as a whole") {
    Alloc b(4);
    Table p(4);
    append(p, 3, b);  // block 1
    Table c = p.fork(b);
    Table other(4);
    append(other, 8, b);  // blocks 2, 3: the pool is full
    Slots s;
    Copy cp;
    CHECK_FALSE(p.try_append(1, b, kNoEvict, &s, cp));  // would write into shared block 1: needs a copy block
    CHECK(s.empty());
    CHECK_FALSE(cp.has_value());
    CHECK(b.refcount(1) == 2);
    CHECK(p.num_tokens() == 3);
    other.release_all(b);
    CHECK(p.try_append(1, b, kNoEvict, &s, cp));
    CHECK(cp.has_value());
  }
}

TEST_CASE("BlockTable: fork shares every block and allocates nothing", "[block_table][fork]") {
  Alloc a(10);
  Table parent(4);
  append(parent, 10, a);  // 1, 2, 3
  const auto free_before = a.num_free_blocks();
  const auto ops_before = a.num_block_ops();
  Table child = parent.fork(a);
  CHECK(ids(child) == ids(parent));
  CHECK(child.num_tokens() == 10);
  CHECK(child.block_size() == 4);
  CHECK(a.num_free_blocks() == free_before);
  CHECK(a.num_block_ops() == ops_before + 3);  // three acquires, no allocation
  for (std::uint32_t b : {1u, 2u, 3u}) CHECK(a.refcount(b) == 2);
  Table grandchild = child.fork(a);
  for (std::uint32_t b : {1u, 2u, 3u}) CHECK(a.refcount(b) == 3);
  grandchild.release_all(a);
  child.release_all(a);
  for (std::uint32_t b : {1u, 2u, 3u}) CHECK(a.refcount(b) == 1);
  CHECK(a.num_free_blocks() == free_before);
}

TEST_CASE("BlockTable: copy-on-write of a shared partial block", "[block_table][cow]") {
  Alloc a(10);
  Table parent(4);
  append(parent, 6, a);  // 1 (full), 2 (2 tokens)
  Table child = parent.fork(a);
  REQUIRE(a.refcount(2) == 2);

  SECTION("the parent appends first: one copy, then the child writes in place") {
    auto [s, copy] = append(parent, 1, a);
    REQUIRE(copy.has_value());
    CHECK(*copy == BlockCopy<std::uint32_t>{2, 3});
    CHECK(ids(parent) == Ids{1, 3});
    CHECK(s == Slots{3 * 4 + 2});
    CHECK(a.refcount(3) == 1);
    // The parent's reference on 2 passed to the copy: 2 is still held twice (child + pending copy).
    CHECK(a.refcount(2) == 2);
    CHECK(a.refcount(1) == 2);  // full blocks stay shared
    a.release(copy->src);        // the copy has been issued
    CHECK(a.refcount(2) == 1);
    auto [s2, copy2] = append(child, 2, a);
    CHECK_FALSE(copy2.has_value());  // sole holder, unhashed: written in place
    CHECK(ids(child) == Ids{1, 2});
    CHECK(s2 == Slots{2 * 4 + 2, 2 * 4 + 3});
  }
  SECTION("the child appends first: the same, mirrored") {
    auto [s, copy] = append(child, 3, a);
    REQUIRE(copy.has_value());
    CHECK(*copy == BlockCopy<std::uint32_t>{2, 3});
    CHECK(ids(child) == Ids{1, 3, 4});  // copy destination first, then the new block
    CHECK(s == Slots{14, 15, 16});
    CHECK(ids(parent) == Ids{1, 2});
    a.release(copy->src);
    auto [s2, copy2] = append(parent, 1, a);
    CHECK_FALSE(copy2.has_value());
    CHECK(s2 == Slots{10});
  }
  SECTION("while the copy still holds the source, the other side copies too") {
    auto [s, copy] = append(parent, 1, a);
    REQUIRE(copy.has_value());
    auto [s2, copy2] = append(child, 1, a);  // 2 is held by child + pending copy: not writable
    REQUIRE(copy2.has_value());
    CHECK(*copy2 == BlockCopy<std::uint32_t>{2, 4});
    CHECK(a.refcount(2) == 2);  // two pending copies
  }
  SECTION("a full shared last block is never copied: the append opens a new block") {
    Table p(4);
    append(p, 4, a);  // block 3
    Table c = p.fork(a);
    CHECK_FALSE(p.last_block_needs_copy(a));
    auto [s, copy] = append(p, 1, a);
    CHECK_FALSE(copy.has_value());
    CHECK(ids(p) == Ids{3, 4});
    CHECK(a.refcount(3) == 2);
  }
}

TEST_CASE("BlockTable: appending to an unshared block never copies", "[block_table][cow]") {
  Alloc a(30);
  Table t(4);
  for (int i = 0; i < 20; ++i) {
    auto [s, copy] = append(t, 1, a);
    CHECK_FALSE(copy.has_value());
  }
  CHECK(ids(t) == Ids{1, 2, 3, 4, 5});
  CHECK(a.num_used_blocks() == 5);
}

TEST_CASE("BlockTable: a hashed partial block (after a rewind) is copied on the next append", "[block_table][cow]") {
  Alloc a(10);
  Table t(4);
  append(t, 8, a);  // 1, 2
  a.set_hashed(1, true);
  a.set_hashed(2, true);
  t.rewind(2, a);  // block 2 keeps 2 tokens, still hashed
  CHECK(ids(t) == Ids{1, 2});
  CHECK(t.last_block_len() == 2);
  CHECK(t.last_block_needs_copy(a));
  auto [s, copy] = append(t, 1, a);
  REQUIRE(copy.has_value());
  CHECK(*copy == BlockCopy<std::uint32_t>{2, 3});
  CHECK(s == Slots{14});
  CHECK(ids(t) == Ids{1, 3});
  CHECK(a.refcount(2) == 1);  // held by the copy only
  a.release(2);
  CHECK(a.is_cached(2));  // intact, still cached
}

TEST_CASE("BlockTable: rewind", "[block_table][rewind]") {
  Alloc a(7);  // 6 usable
  Table t(4);
  append(t, 14, a);  // 1, 2, 3, 4 (2 tokens)
  Table filler(4);
  append(filler, 8, a);  // 5, 6: no never-used block left, so the free stack order is visible
  SECTION("blocks left empty are released last first") {
    t.rewind(7, a);  // 7 tokens left: blocks 1, 2
    CHECK(t.num_tokens() == 7);
    CHECK(ids(t) == Ids{1, 2});
    CHECK(t.last_block_len() == 3);
    CHECK(a.refcount(3) == 0);
    CHECK(a.refcount(4) == 0);
    // Released 4 then 3 onto the free stack: reused 3 first.
    CHECK(a.try_allocate_one(kNoEvict) == std::optional<std::uint32_t>(3));
    CHECK(a.try_allocate_one(kNoEvict) == std::optional<std::uint32_t>(4));
  }
  SECTION("hashed blocks released by a rewind enter the LRU list tail first") {
    for (std::uint32_t b : {1u, 2u, 3u}) a.set_hashed(b, true);
    t.rewind(10, a);  // releases 4 (free), 3 and 2 (cached)
    CHECK(a.eviction_policy().order() == Ids{3, 2});
    CHECK(ids(t) == Ids{1});
  }
  SECTION("rewind within the last block releases nothing and the block stays writable") {
    t.rewind(1, a);
    CHECK(ids(t) == Ids{1, 2, 3, 4});
    auto [s, copy] = append(t, 2, a);
    CHECK_FALSE(copy.has_value());
    CHECK(s == Slots{4 * 4 + 1, 4 * 4 + 2});
  }
  SECTION("rewind to a block boundary, and to empty") {
    t.rewind(6, a);
    CHECK(ids(t) == Ids{1, 2});
    CHECK(t.last_block_len() == 4);
    CHECK_FALSE(t.last_block_needs_copy(a));
    t.rewind(8, a);
    CHECK(t.num_tokens() == 0);
    CHECK(t.num_blocks() == 0);
    CHECK(t.last_block_len() == 0);
    CHECK(a.num_used_blocks() == 2);  // the filler
  }
  SECTION("rewind past the start throws and changes nothing") {
    const auto used = a.num_used_blocks();
    const std::string msg = expect_error([&] { t.rewind(15, a); }, Errc::kLimitExceeded);
    CHECK_THAT(msg, Catch::Contains("15") && Catch::Contains("14"));
    CHECK(t.num_tokens() == 14);
    CHECK(ids(t) == Ids{1, 2, 3, 4});
    CHECK(a.num_used_blocks() == used);
  }
  SECTION("rewind into a shared block never lets it be written: the next append copies") {
    filler.release_all(a);
    Table c = t.fork(a);
    t.rewind(3, a);  // 11 tokens: block 3 partial (3 tokens), shared with c
    CHECK(a.refcount(4) == 1);  // only c holds 4 now
    CHECK(a.refcount(3) == 2);
    auto [s, copy] = append(t, 1, a);
    REQUIRE(copy.has_value());
    CHECK(copy->src == 3);
    CHECK(ids(t)[2] == copy->dst);
    CHECK(s == Slots{static_cast<std::int64_t>(copy->dst) * 4 + 3});
    CHECK(ids(c) == Ids{1, 2, 3, 4});
  }
}

TEST_CASE("BlockTable: release_all releases tail first and empties the table", "[block_table][release]") {
  Alloc a(8);
  Table t(2);
  append(t, 7, a);  // 1, 2, 3, 4
  for (std::uint32_t b = 1; b <= 4; ++b) a.set_hashed(b, true);
  t.release_all(a);
  CHECK(a.eviction_policy().order() == Ids{4, 3, 2, 1});
  CHECK(t.num_tokens() == 0);
  CHECK(t.num_blocks() == 0);
  t.release_all(a);  // idempotent on an empty table
  CHECK(a.num_used_blocks() == 0);
}

TEST_CASE("BlockTable: append_full_block and replace_block", "[block_table]") {
  Alloc a(8);
  Table t(4);
  std::vector<std::uint32_t> got(1);
  REQUIRE(a.try_allocate(std::span<std::uint32_t>(got)));
  t.append_full_block(got[0]);
  CHECK(t.num_tokens() == 4);
  CHECK(ids(t) == Ids{1});
  append(t, 1, a);
  CHECK_THAT(expect_error([&] { t.append_full_block(5); }, Errc::kInvalidArgument),
             Catch::Contains("5 tokens") && Catch::Contains("block_size 4"));
  CHECK(ids(t) == Ids{1, 2});
  CHECK(t.num_tokens() == 5);
  CHECK(t.replace_block(1, 7) == 2);
  CHECK(ids(t) == Ids{1, 7});
  CHECK_THAT(expect_error([&] { t.replace_block(2, 3); }, Errc::kInvalidArgument), Catch::Contains("logical block 2"));
  CHECK(ids(t) == Ids{1, 7});
}
