// Tests of pagedkv/block_allocator.hpp and pagedkv/eviction.hpp: allocation order (never used -> released unhashed
// LIFO -> LRU eviction), all-or-nothing multi-block allocation, refcounts, block states and their counts, misuse
// errors with the strong guarantee, and a user-supplied EvictionPolicy.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using pagedkv::BlockAllocator;
using pagedkv::Errc;
using pagedkv::LruEviction;
using Alloc = BlockAllocator<std::uint32_t>;

// Runs `f`, requires it to throw pagedkv::Error with `code`, and returns the message.
using pagedkv_test::expect_error;

std::uint32_t take(Alloc& a) {
  const auto b = a.try_allocate_one([](std::uint32_t) { FAIL("unexpected eviction"); });
  REQUIRE(b.has_value());
  return *b;
}

// Everything observable about an allocator, for before/after comparisons.
struct AllocState {
  std::vector<std::uint32_t> refcounts;
  std::vector<bool> hashed;
  std::vector<bool> cached;
  std::vector<std::uint32_t> lru;
  std::size_t free = 0, cached_n = 0, used = 0, available = 0;
  std::uint64_t evictions = 0, ops = 0;
  friend bool operator==(const AllocState&, const AllocState&) = default;
};

AllocState state_of(const Alloc& a) {
  AllocState s;
  for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
    s.refcounts.push_back(a.refcount(b));
    s.hashed.push_back(a.is_hashed(b));
    s.cached.push_back(a.is_cached(b));
  }
  s.lru = a.eviction_policy().order();
  s.free = a.num_free_blocks();
  s.cached_n = a.num_cached_blocks();
  s.used = a.num_used_blocks();
  s.available = a.num_available_blocks();
  s.evictions = a.num_evictions();
  s.ops = a.num_block_ops();
  return s;
}

// Checks the three-state partition: every usable block is exactly one of free / cached / held, and the counts match.
void check_partition(const Alloc& a) {
  std::size_t free = 0, cached = 0, held = 0;
  for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
    if (a.refcount(b) > 0) {
      ++held;
      CHECK_FALSE(a.is_cached(b));
    } else if (a.is_cached(b)) {
      ++cached;
      CHECK(a.is_hashed(b));
    } else {
      ++free;
      CHECK_FALSE(a.is_hashed(b));
    }
  }
  CHECK(free == a.num_free_blocks());
  CHECK(cached == a.num_cached_blocks());
  CHECK(held == a.num_used_blocks());
  CHECK(free + cached + held == a.num_usable_blocks());
  CHECK(a.num_available_blocks() == free + cached);
}

// A most-recently-released-first policy: the opposite victim choice to LRU, so its effect is visible.
// (O(n) erase is fine for a test.) Satisfies pagedkv::EvictionPolicy.
class MruEviction {
 public:
  explicit MruEviction(std::size_t num_blocks) : in_(num_blocks, false) {}
  void insert(std::uint32_t b) {
    stack_.push_back(b);
    in_[b] = true;
  }
  void erase(std::uint32_t b) {
    stack_.erase(std::find(stack_.begin(), stack_.end(), b));
    in_[b] = false;
  }
  std::optional<std::uint32_t> pop_victim() {
    if (stack_.empty()) return std::nullopt;
    const std::uint32_t b = stack_.back();
    stack_.pop_back();
    in_[b] = false;
    return b;
  }
  [[nodiscard]] std::size_t size() const { return stack_.size(); }
  [[nodiscard]] bool contains(std::uint32_t b) const { return b < in_.size() && in_[b]; }
  void clear() {
    for (auto b : stack_) in_[b] = false;
    stack_.clear();
  }

 private:
  std::vector<std::uint32_t> stack_;
  std::vector<bool> in_;
};
static_assert(pagedkv::EvictionPolicy<MruEviction, std::uint32_t>);

// Not a policy: no pop_victim.
struct NotAPolicy {
  explicit NotAPolicy(std::size_t) {}
  void insert(std::uint32_t) {}
  void erase(std::uint32_t) {}
  [[nodiscard]] std::size_t size() const { return 0; }
  [[nodiscard]] bool contains(std::uint32_t) const { return false; }
  void clear() {}
};
static_assert(!pagedkv::EvictionPolicy<NotAPolicy, std::uint32_t>);
static_assert(!pagedkv::BlockIdType<bool>);
static_assert(!pagedkv::BlockIdType<std::int32_t>);
static_assert(!pagedkv::BlockIdType<std::uint8_t>);
static_assert(pagedkv::BlockIdType<std::uint16_t>);

}  // namespace

TEST_CASE("BlockAllocator: construction and pool size", "[block_allocator]") {
  SECTION("num_blocks < 2 is rejected, naming the value") {
    CHECK_THAT(expect_error([] { Alloc a(0); }, Errc::kInvalidArgument), Catch::Contains("num_blocks = 0"));
    CHECK_THAT(expect_error([] { Alloc a(1); }, Errc::kInvalidArgument), Catch::Contains("num_blocks = 1"));
  }
  SECTION("a pool that does not fit the id type is rejected") {
    CHECK_THAT(expect_error([] { BlockAllocator<std::uint16_t> a(65536); }, Errc::kInvalidArgument),
               Catch::Contains("65536"));
    BlockAllocator<std::uint16_t> ok(65535);  // ids 1..65534; 65535 is the eviction list's "absent" mark
    CHECK(ok.num_usable_blocks() == 65534);
  }
  SECTION("the smallest pool has one usable block") {
    Alloc a(2);
    CHECK(a.num_blocks() == 2);
    CHECK(a.num_usable_blocks() == 1);
    CHECK(a.num_free_blocks() == 1);
    CHECK(take(a) == 1);
    CHECK_FALSE(a.try_allocate_one([](std::uint32_t) {}).has_value());
  }
  SECTION("a fresh pool: everything free, nothing cached or used, no ops") {
    Alloc a(10);
    CHECK(a.num_usable_blocks() == 9);
    CHECK(a.num_free_blocks() == 9);
    CHECK(a.num_cached_blocks() == 0);
    CHECK(a.num_used_blocks() == 0);
    CHECK(a.num_available_blocks() == 9);
    CHECK(a.num_evictions() == 0);
    CHECK(a.num_block_ops() == 0);
    for (std::uint32_t b = 1; b < 10; ++b) {
      CHECK(a.refcount(b) == 0);
      CHECK_FALSE(a.is_hashed(b));
      CHECK_FALSE(a.is_cached(b));
    }
    check_partition(a);
  }
}

TEST_CASE("BlockAllocator: never-used blocks come first, in increasing id order, never block 0",
          "[block_allocator][order]") {
  Alloc a(8);
  std::vector<std::uint32_t> got;
  for (int i = 0; i < 7; ++i) got.push_back(take(a));
  CHECK(got == std::vector<std::uint32_t>{1, 2, 3, 4, 5, 6, 7});
  CHECK_FALSE(a.try_allocate_one([](std::uint32_t) {}).has_value());
  CHECK(a.num_used_blocks() == 7);
  CHECK(a.num_free_blocks() == 0);
  for (std::uint32_t b = 1; b < 8; ++b) CHECK(a.refcount(b) == 1);

  SECTION("a multi-block allocation takes consecutive ids too") {
    Alloc c(6);
    std::vector<std::uint32_t> out(3, 99);
    REQUIRE(c.try_allocate(std::span<std::uint32_t>(out)));
    CHECK(out == std::vector<std::uint32_t>{1, 2, 3});
    std::vector<std::uint32_t> out2(2, 99);
    REQUIRE(c.try_allocate(std::span<std::uint32_t>(out2)));
    CHECK(out2 == std::vector<std::uint32_t>{4, 5});
  }
}

TEST_CASE("BlockAllocator: released unhashed blocks are reused most recently released first, after never-used ones",
          "[block_allocator][order][lifo]") {
  Alloc a(8);  // 7 usable
  for (int i = 0; i < 6; ++i) take(a);  // 1..6
  a.release(2);
  a.release(5);
  a.release(3);
  CHECK(a.num_free_blocks() == 4);  // 7 (never used) + 2, 5, 3
  CHECK(a.num_cached_blocks() == 0);
  CHECK(a.refcount(2) == 0);
  check_partition(a);
  // Never-used 7 first, then the free stack top-down: 3, 5, 2.
  CHECK(take(a) == 7);
  CHECK(take(a) == 3);
  CHECK(take(a) == 5);
  a.release(6);  // pushed while 2 is still on the stack: 6 comes before 2
  CHECK(take(a) == 6);
  CHECK(take(a) == 2);
  CHECK_FALSE(a.try_allocate_one([](std::uint32_t) {}).has_value());
}

TEST_CASE("BlockAllocator: eviction takes the least recently released cached block, after every free block",
          "[block_allocator][lru][evict]") {
  Alloc a(6);  // 5 usable
  for (int i = 0; i < 5; ++i) take(a);
  for (std::uint32_t b = 1; b <= 4; ++b) a.set_hashed(b, true);
  CHECK(a.is_hashed(1));
  CHECK_FALSE(a.is_cached(1));  // held, not cached
  // Release hashed blocks in the order 3, 1, 4, 2: they become cached in that LRU order.
  a.release(3);
  a.release(1);
  a.release(4);
  a.release(2);
  CHECK(a.eviction_policy().order() == std::vector<std::uint32_t>{3, 1, 4, 2});
  CHECK(a.eviction_policy().peek_victim() == 3);
  CHECK(a.num_cached_blocks() == 4);
  CHECK(a.num_free_blocks() == 0);
  CHECK(a.num_used_blocks() == 1);
  CHECK(a.is_cached(3));
  CHECK(a.is_hashed(3));
  check_partition(a);

  // An unhashed released block is reused before any cached block is evicted.
  a.release(5);
  CHECK(a.num_free_blocks() == 1);
  std::vector<std::uint32_t> evicted;
  auto on_evict = [&](std::uint32_t b) { evicted.push_back(b); };
  CHECK(a.try_allocate_one(on_evict) == std::optional<std::uint32_t>(5));
  CHECK(evicted.empty());
  CHECK(a.num_evictions() == 0);

  // Now the victims, least recently released first; on_evict sees each, and the hash mark is gone.
  CHECK(a.try_allocate_one(on_evict) == std::optional<std::uint32_t>(3));
  CHECK(evicted == std::vector<std::uint32_t>{3});
  CHECK(a.num_evictions() == 1);
  CHECK_FALSE(a.is_hashed(3));
  CHECK(a.refcount(3) == 1);
  CHECK(a.eviction_policy().order() == std::vector<std::uint32_t>{1, 4, 2});

  std::vector<std::uint32_t> two(2);
  REQUIRE(a.try_allocate(std::span<std::uint32_t>(two), on_evict));
  CHECK(two == std::vector<std::uint32_t>{1, 4});
  CHECK(evicted == std::vector<std::uint32_t>{3, 1, 4});
  CHECK(a.num_evictions() == 3);
  CHECK(a.eviction_policy().order() == std::vector<std::uint32_t>{2});
  check_partition(a);
}

TEST_CASE("BlockAllocator: exact ids after a mix of releases (never used, LIFO free, LRU cached)",
          "[block_allocator][order]") {
  Alloc a(9);  // 8 usable
  std::vector<std::uint32_t> first(5);
  REQUIRE(a.try_allocate(std::span<std::uint32_t>(first)));  // 1..5
  a.set_hashed(2, true);
  a.set_hashed(4, true);
  a.release(4);  // cached
  a.release(1);  // free
  a.release(2);  // cached (after 4)
  a.release(3);  // free (after 1)
  std::vector<std::uint32_t> evicted;
  std::vector<std::uint32_t> out(7);
  REQUIRE(a.try_allocate(std::span<std::uint32_t>(out), [&](std::uint32_t b) { evicted.push_back(b); }));
  // 6, 7, 8 never used; then free stack 3, 1; then LRU victims 4, 2.
  CHECK(out == std::vector<std::uint32_t>{6, 7, 8, 3, 1, 4, 2});
  CHECK(evicted == std::vector<std::uint32_t>{4, 2});
  CHECK(a.num_available_blocks() == 0);
}

TEST_CASE("BlockAllocator: multi-block allocation is all or nothing", "[block_allocator][atomic]") {
  Alloc a(6);  // 5 usable
  for (int i = 0; i < 3; ++i) take(a);
  a.set_hashed(1, true);
  a.release(1);  // cached
  REQUIRE(a.num_available_blocks() == 3);  // 4, 5 never used + cached 1
  const AllocState before = state_of(a);
  std::vector<std::uint32_t> out(4, 77);
  bool evict_called = false;
  CHECK_FALSE(a.try_allocate(std::span<std::uint32_t>(out), [&](std::uint32_t) { evict_called = true; }));
  CHECK_FALSE(evict_called);
  CHECK(out == std::vector<std::uint32_t>(4, 77));  // the output is not touched either
  CHECK(state_of(a) == before);

  // Exactly the available number succeeds.
  std::vector<std::uint32_t> three(3);
  CHECK(a.try_allocate(std::span<std::uint32_t>(three), [](std::uint32_t) {}));
  CHECK(three == std::vector<std::uint32_t>{4, 5, 1});

  // An empty request always succeeds and changes nothing.
  const AllocState full = state_of(a);
  std::vector<std::uint32_t> none;
  CHECK(a.try_allocate(std::span<std::uint32_t>(none)));
  CHECK(state_of(a) == full);
}

TEST_CASE("BlockAllocator: acquire and release refcounts", "[block_allocator][refcount]") {
  Alloc a(5);
  const auto b = take(a);
  CHECK(a.refcount(b) == 1);
  a.acquire(b);
  a.acquire(b);
  CHECK(a.refcount(b) == 3);
  CHECK(a.num_used_blocks() == 1);
  a.release(b);
  a.release(b);
  CHECK(a.refcount(b) == 1);
  CHECK(a.num_used_blocks() == 1);
  a.release(b);
  CHECK(a.refcount(b) == 0);
  CHECK(a.num_used_blocks() == 0);
  CHECK(a.num_free_blocks() == 4);

  SECTION("acquiring a cached block takes it out of the evictable set") {
    const auto c = take(a);  // 2 (never used first)
    CHECK(c == 2);
    a.set_hashed(c, true);
    a.release(c);
    CHECK(a.is_cached(c));
    CHECK(a.num_cached_blocks() == 1);
    a.acquire(c);
    CHECK_FALSE(a.is_cached(c));
    CHECK(a.is_hashed(c));
    CHECK(a.refcount(c) == 1);
    CHECK(a.num_cached_blocks() == 0);
    CHECK(a.eviction_policy().order().empty());
    check_partition(a);
    // Released again: it goes to the LRU tail (most recently released).
    const auto d = take(a);
    a.set_hashed(d, true);
    a.release(d);
    a.release(c);
    CHECK(a.eviction_policy().order() == std::vector<std::uint32_t>{d, c});
  }
  SECTION("set_hashed(false) makes a held block free on release") {
    const auto c = take(a);
    a.set_hashed(c, true);
    a.set_hashed(c, false);
    a.release(c);
    CHECK_FALSE(a.is_cached(c));
    CHECK(a.num_cached_blocks() == 0);
  }
}

TEST_CASE("BlockAllocator: block ops are counted one per block", "[block_allocator][stats]") {
  Alloc a(6);
  std::vector<std::uint32_t> out(3);
  REQUIRE(a.try_allocate(std::span<std::uint32_t>(out)));
  CHECK(a.num_block_ops() == 3);
  a.acquire(1);
  CHECK(a.num_block_ops() == 4);
  a.release(1);
  a.release(1);
  CHECK(a.num_block_ops() == 6);
  std::vector<std::uint32_t> too_many(9);
  CHECK_FALSE(a.try_allocate(std::span<std::uint32_t>(too_many)));
  CHECK(a.num_block_ops() == 6);
}

TEST_CASE("BlockAllocator: misuse throws and changes nothing", "[block_allocator][errors]") {
  Alloc a(5);  // blocks 1..4
  take(a);
  take(a);
  a.set_hashed(2, true);
  a.release(2);  // 2 cached, 1 held, 3 and 4 never used
  const AllocState before = state_of(a);

  SECTION("double free") {
    a.release(1);
    const AllocState after_one = state_of(a);
    CHECK_THAT(expect_error([&] { a.release(1); }, Errc::kDoubleFree), Catch::Contains("block 1"));
    CHECK(state_of(a) == after_one);
    // Releasing a cached block (refcount 0) is a double free too, and it stays cached.
    CHECK_THAT(expect_error([&] { a.release(2); }, Errc::kDoubleFree), Catch::Contains("block 2"));
    CHECK(a.is_cached(2));
    // So is releasing a never-used block.
    CHECK_THAT(expect_error([&] { a.release(4); }, Errc::kDoubleFree), Catch::Contains("block 4"));
    CHECK(state_of(a) == after_one);
  }
  SECTION("out of range ids, and the null block") {
    for (std::uint32_t bad : {0u, 5u, 1000u}) {
      const std::string id = "block id " + std::to_string(bad);
      CHECK_THAT(expect_error([&] { a.release(bad); }, Errc::kBlockOutOfRange), Catch::Contains(id));
      CHECK_THAT(expect_error([&] { a.acquire(bad); }, Errc::kBlockOutOfRange), Catch::Contains(id));
      CHECK_THAT(expect_error([&] { (void)a.refcount(bad); }, Errc::kBlockOutOfRange), Catch::Contains(id));
      CHECK_THAT(expect_error([&] { (void)a.is_hashed(bad); }, Errc::kBlockOutOfRange), Catch::Contains(id));
      CHECK_THAT(expect_error([&] { (void)a.is_cached(bad); }, Errc::kBlockOutOfRange), Catch::Contains(id));
      CHECK_THAT(expect_error([&] { a.set_hashed(bad, true); }, Errc::kBlockOutOfRange), Catch::Contains(id));
    }
    CHECK(state_of(a) == before);
  }
  SECTION("acquire of a free block") {
    CHECK_THAT(expect_error([&] { a.acquire(3); }, Errc::kInvalidArgument), Catch::Contains("block 3"));
    a.release(1);  // 1 becomes free (released unhashed)
    const AllocState s = state_of(a);
    CHECK_THAT(expect_error([&] { a.acquire(1); }, Errc::kInvalidArgument), Catch::Contains("block 1"));
    CHECK(state_of(a) == s);
  }
  SECTION("set_hashed of a block that is not held") {
    CHECK_THAT(expect_error([&] { a.set_hashed(3, true); }, Errc::kInvalidArgument), Catch::Contains("block 3"));
    CHECK_THAT(expect_error([&] { a.set_hashed(2, false); }, Errc::kInvalidArgument), Catch::Contains("block 2"));
    CHECK(state_of(a) == before);
  }
}

TEST_CASE("BlockAllocator: clear_hashes frees cached blocks and unmarks held ones", "[block_allocator][reset]") {
  Alloc a(7);  // 6 usable
  for (int i = 0; i < 6; ++i) take(a);
  for (std::uint32_t b : {1u, 2u, 3u, 5u, 6u}) a.set_hashed(b, true);
  a.release(3);
  a.release(1);
  a.release(6);  // LRU: 3, 1, 6; held hashed: 2, 5; held unhashed: 4
  std::vector<std::uint32_t> dropped;
  a.clear_hashes([&](std::uint32_t b) { dropped.push_back(b); });
  // Cached blocks in LRU order, then held hashed blocks in id order.
  CHECK(dropped == std::vector<std::uint32_t>{3, 1, 6, 2, 5});
  CHECK(a.num_cached_blocks() == 0);
  CHECK(a.num_free_blocks() == 3);
  for (std::uint32_t b = 1; b <= 6; ++b) CHECK_FALSE(a.is_hashed(b));
  check_partition(a);
  // The former cached blocks are on the free stack, pushed in LRU order: reused 6, 1, 3.
  CHECK(take(a) == 6);
  CHECK(take(a) == 1);
  CHECK(take(a) == 3);
  // Held blocks that lost their mark become free, not cached, on release.
  a.release(2);
  CHECK_FALSE(a.is_cached(2));
  CHECK(a.num_free_blocks() == 1);
}

TEST_CASE("BlockAllocator: counts stay consistent through a random walk", "[block_allocator][stats]") {
  Alloc a(17);
  std::vector<std::uint32_t> held;
  std::uint64_t rng = 12345;
  auto next = [&] {
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<std::uint32_t>(rng >> 33);
  };
  std::vector<std::uint32_t> expect_evicted;
  for (int step = 0; step < 2000; ++step) {
    const auto op = next() % 4;
    if (op <= 1) {
      const std::uint32_t victim_if_any = a.num_free_blocks() == 0 ? a.eviction_policy().peek_victim() : 0;
      std::vector<std::uint32_t> evicted;
      const auto b = a.try_allocate_one([&](std::uint32_t v) { evicted.push_back(v); });
      if (b) {
        held.push_back(*b);
        if (victim_if_any != 0) {
          CHECK(evicted == std::vector<std::uint32_t>{victim_if_any});
          CHECK(*b == victim_if_any);
        } else {
          CHECK(evicted.empty());
        }
        if (next() % 2 == 0) a.set_hashed(*b, true);
      } else {
        CHECK(a.num_available_blocks() == 0);
      }
    } else if (op == 2 && !held.empty()) {
      const std::size_t i = next() % held.size();
      a.release(held[i]);
      held.erase(held.begin() + static_cast<std::ptrdiff_t>(i));
    } else if (!held.empty()) {
      const auto b = held[next() % held.size()];
      a.acquire(b);
      held.push_back(b);
    }
    for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
      const auto n = static_cast<std::uint32_t>(std::count(held.begin(), held.end(), b));
      REQUIRE(a.refcount(b) == n);
    }
    check_partition(a);
  }
}

TEST_CASE("LruEviction: O(1) list operations and order", "[eviction][lru]") {
  LruEviction<std::uint32_t> lru(8);
  CHECK(lru.size() == 0);
  CHECK_FALSE(lru.pop_victim().has_value());
  CHECK(lru.peek_victim() == 0);
  CHECK_FALSE(lru.contains(0));
  lru.insert(5);
  lru.insert(2);
  lru.insert(7);
  lru.insert(1);
  CHECK(lru.size() == 4);
  CHECK(lru.order() == std::vector<std::uint32_t>{5, 2, 7, 1});
  CHECK(lru.contains(7));
  CHECK_FALSE(lru.contains(3));
  CHECK_FALSE(lru.contains(0));
  CHECK_FALSE(lru.contains(100));  // out of range is simply "not contained"
  lru.erase(7);   // middle
  lru.erase(5);   // head
  lru.erase(1);   // tail
  CHECK(lru.order() == std::vector<std::uint32_t>{2});
  lru.insert(5);
  CHECK(lru.peek_victim() == 2);
  CHECK(lru.pop_victim() == std::optional<std::uint32_t>(2));
  CHECK(lru.pop_victim() == std::optional<std::uint32_t>(5));
  CHECK_FALSE(lru.pop_victim().has_value());
  lru.insert(3);
  lru.insert(4);
  lru.clear();
  CHECK(lru.size() == 0);
  CHECK_FALSE(lru.contains(3));
  CHECK(lru.order().empty());
  lru.insert(4);  // reusable after clear
  CHECK(lru.order() == std::vector<std::uint32_t>{4});
}

TEST_CASE("BlockAllocator: a custom EvictionPolicy (MRU) decides the victim", "[block_allocator][eviction][custom]") {
  BlockAllocator<std::uint32_t, MruEviction> a(5);
  std::vector<std::uint32_t> out(4);
  REQUIRE(a.try_allocate(std::span<std::uint32_t>(out)));
  for (std::uint32_t b = 1; b <= 4; ++b) a.set_hashed(b, true);
  a.release(2);
  a.release(4);
  a.release(1);
  CHECK(a.num_cached_blocks() == 3);
  CHECK(a.is_cached(4));
  std::vector<std::uint32_t> evicted;
  auto on_evict = [&](std::uint32_t b) { evicted.push_back(b); };
  CHECK(a.try_allocate_one(on_evict) == std::optional<std::uint32_t>(1));  // most recently released
  a.acquire(4);  // a hit takes 4 out of the policy
  CHECK(a.try_allocate_one(on_evict) == std::optional<std::uint32_t>(2));
  CHECK(evicted == std::vector<std::uint32_t>{1, 2});
  CHECK(a.num_evictions() == 2);
  CHECK_FALSE(a.try_allocate_one(on_evict).has_value());

  SECTION("and the manager accepts it too") {
    pagedkv::CacheConfig cfg;
    cfg.num_blocks = 4;  // 3 usable
    cfg.block_size = 2;
    pagedkv::KVCacheManager<pagedkv::Sha256Hasher, std::uint32_t, MruEviction> m(cfg);
    const std::vector<pagedkv::TokenId> p1{1, 2, 3}, p2{4, 5, 6}, p3{7, 8, 9};
    REQUIRE(m.try_admit(1, p1).admitted());  // blocks 1, 2
    pagedkv_test::build_step(m, {1});  // registers block 1
    REQUIRE(m.try_admit(2, p2).admitted() == false);  // needs 2, only 1 left
    m.free(1);  // 2 free, 1 cached
    REQUIRE(m.try_admit(2, p2).admitted());  // never-used 3, free 2
    CHECK(std::vector<std::uint32_t>(m.block_ids(2).begin(), m.block_ids(2).end()) ==
          std::vector<std::uint32_t>{3, 2});
    pagedkv_test::build_step(m, {2});  // registers block 3
    m.free(2);  // 2 free, 3 cached (after 1)
    REQUIRE(m.try_admit(3, p3).admitted());  // free 2, then the MRU victim 3
    CHECK(std::vector<std::uint32_t>(m.block_ids(3).begin(), m.block_ids(3).end()) ==
          std::vector<std::uint32_t>{2, 3});
    CHECK(m.stats().evictions == 1);
    CHECK(m.lookup(std::vector<pagedkv::TokenId>{1, 2, 0}) == 2);  // block 1 survived (it was older)
  }
}

TEST_CASE("BlockAllocator: 16-bit block ids", "[block_allocator][id_type]") {
  BlockAllocator<std::uint16_t> a(4);
  std::vector<std::uint16_t> out(3);
  REQUIRE(a.try_allocate(std::span<std::uint16_t>(out)));
  CHECK(out == std::vector<std::uint16_t>{1, 2, 3});
  a.set_hashed(2, true);
  a.release(2);
  a.release(3);
  CHECK(a.eviction_policy().order() == std::vector<std::uint16_t>{2});
  CHECK(a.try_allocate_one([](std::uint16_t) {}) == std::optional<std::uint16_t>(3));
  CHECK(a.try_allocate_one([](std::uint16_t) {}) == std::optional<std::uint16_t>(2));
}
