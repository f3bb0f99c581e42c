// Tests of pagedkv/eviction_slru.hpp (SlruEviction), pagedkv/eviction_priority.hpp (PriorityLruEviction) and the
// optional policy extensions of pagedkv/eviction.hpp (forget_block, set_block_priority, expire_priorities).
//
//  - Each policy against a plain reference model (std::list / std::map) under long random sequences of insert,
//    erase (hit), forget (hash dropped), pop_victim, clear and, for the priority policy, set_priority and expire:
//    the exact victim order (the whole order() after every step), sizes, membership and per-block state.
//  - The same harnesses with deliberately wrong models (a mutation each) must report a divergence, so the
//    comparisons can fail.
//  - BlockAllocator<uint32_t, Policy> driven by random operations, checked against a model of the allocator (the
//    never-used counter, the free stack, refcounts, hash marks) plus the policy model: the states partition, the
//    counts, and every evicted block.
//  - Hand-checked edge cases: all blocks in protected, protected fraction 0 (exactly LRU) and 1, demotion order,
//    priorities 0 and 100, an expiry exactly at now, where expired blocks land, clear, misuse errors with the state
//    unchanged; and the KVCacheManager accepting both policies.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <list>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/eviction.hpp>
#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace {

using Id = std::uint32_t;
using pagedkv::Errc;
using pagedkv::kDefaultRetentionPriority;
using pagedkv::LruEviction;
using pagedkv::PriorityLruEviction;
using pagedkv::RetentionTimePoint;
using pagedkv::SlruEviction;
using pagedkv_test::expect_error;
using Prio = PriorityLruEviction<Id>;
using Slru = SlruEviction<Id>;
using Rep = RetentionTimePoint::rep;

static_assert(pagedkv::EvictionPolicy<Slru, Id>);
static_assert(pagedkv::EvictionPolicy<Prio, Id>);
static_assert(pagedkv::EvictionPolicy<SlruEviction<std::uint16_t>, std::uint16_t>);
static_assert(pagedkv::EvictionPolicy<PriorityLruEviction<std::uint64_t>, std::uint64_t>);
static_assert(pagedkv::ForgettingEvictionPolicy<Slru, Id>);
static_assert(!pagedkv::RetentionEvictionPolicy<Slru, Id>);
static_assert(pagedkv::RetentionEvictionPolicy<Prio, Id>);
static_assert(!pagedkv::ForgettingEvictionPolicy<LruEviction<Id>, Id>);  // LRU keeps its old API
static_assert(std::is_constructible_v<Slru, std::size_t>);               // the concept's pool-size constructor

RetentionTimePoint at_ms(std::int64_t ms) { return RetentionTimePoint(std::chrono::milliseconds(ms)); }
Rep rep_of(RetentionTimePoint t) { return t.time_since_epoch().count(); }

std::string show(const std::vector<Id>& v) {
  std::ostringstream os;
  os << '[';
  for (std::size_t i = 0; i < v.size(); ++i) os << (i ? " " : "") << v[i];
  os << ']';
  return os.str();
}
std::string show(std::optional<Id> v) { return v ? std::to_string(*v) : std::string("none"); }

// ---------------------------------------------------------------------------------------------------------------
// Reference models: the specification written as plainly as possible. Each has "mutations" (deliberate bugs) used
// to show that the harnesses catch a wrong policy.

// SLRU as specified: probation and protected lists (front = LRU); `hit` = blocks outside the set whose last exit was
// a hit (their next insert goes to protected).
struct SlruModel {
  std::size_t cap = 0;
  std::list<Id> prob, prot;
  std::set<Id> hit;
  // Mutations.
  bool mut_demote_to_lru_end = false;  // demoted blocks enter probation at its LRU end
  bool mut_ignore_hits = false;        // plain LRU
  bool mut_victim_protected_first = false;
  std::size_t mut_cap_plus = 0;        // protected holds one block too many

  explicit SlruModel(std::size_t num_blocks, double fraction = Slru::kDefaultProtectedFraction)
      : cap(static_cast<std::size_t>(std::floor(fraction * static_cast<double>(num_blocks - 1)))) {}

  static bool in(const std::list<Id>& l, Id b) { return std::find(l.begin(), l.end(), b) != l.end(); }
  bool contains(Id b) const { return in(prob, b) || in(prot, b); }
  std::size_t size() const { return prob.size() + prot.size(); }
  void insert(Id b) {
    if (!mut_ignore_hits && hit.count(b) != 0) {
      prot.push_back(b);
      if (prot.size() > cap + mut_cap_plus) {
        const Id d = prot.front();
        prot.pop_front();
        if (mut_demote_to_lru_end) {
          prob.push_front(d);
        } else {
          prob.push_back(d);
        }
      }
    } else {
      prob.push_back(b);
    }
    hit.erase(b);
  }
  void unlink(Id b) {
    prob.remove(b);
    prot.remove(b);
  }
  void erase(Id b) {
    unlink(b);
    hit.insert(b);
  }
  void forget(Id b) {
    unlink(b);
    hit.erase(b);
  }
  std::optional<Id> pop() {
    std::list<Id>* first = mut_victim_protected_first ? &prot : &prob;
    std::list<Id>* second = mut_victim_protected_first ? &prob : &prot;
    for (std::list<Id>* l : {first, second}) {
      if (!l->empty()) {
        const Id b = l->front();
        l->pop_front();
        hit.erase(b);
        return b;
      }
    }
    return std::nullopt;
  }
  void clear() {
    prob.clear();
    prot.clear();
    hit.clear();
  }
  std::vector<Id> order() const {
    std::vector<Id> out(prob.begin(), prob.end());
    out.insert(out.end(), prot.begin(), prot.end());
    return out;
  }
};

// Retention-priority LRU as specified: a list per level (front = LRU), a per-block assignment (absent = default),
// a release stamp per cached block, the recorded now.
struct PrioModel {
  struct Assign {
    int level = kDefaultRetentionPriority;
    std::optional<Rep> exp;  // nullopt: never
  };
  std::map<int, std::list<Id>> levels;
  std::map<Id, Assign> assign;
  std::map<Id, std::uint64_t> stamp;  // cached blocks only
  std::set<Id> cached;
  Rep now = std::numeric_limits<Rep>::min();
  std::uint64_t next_stamp = 0;
  // Mutations.
  bool mut_land_at_lru_end = false;    // expired blocks enter the default level at its LRU end
  bool mut_order_by_expiry = false;    // expired blocks ordered by expiry time instead of release order
  bool mut_strict_expiry = false;      // an expiry exactly at now has not expired
  bool mut_hit_resets_priority = false;

  explicit PrioModel(std::size_t /*num_blocks*/) {}

  bool lapsed(const Assign& a) const { return a.exp && (mut_strict_expiry ? *a.exp < now : *a.exp <= now); }
  Assign get(Id b) const {
    const auto it = assign.find(b);
    return it == assign.end() ? Assign{} : it->second;
  }
  bool contains(Id b) const { return cached.count(b) != 0; }
  std::size_t size() const { return cached.size(); }
  void set_priority(Id b, int p, std::optional<RetentionTimePoint> at) {
    Assign a;
    a.level = p;
    if (p != kDefaultRetentionPriority && at && *at != RetentionTimePoint::max()) a.exp = rep_of(*at);
    assign[b] = a;
  }
  void insert(Id b) {
    Assign a = get(b);
    if (lapsed(a)) a = Assign{};
    assign[b] = a;
    levels[a.level].push_back(b);
    stamp[b] = next_stamp++;
    cached.insert(b);
  }
  void unlink(Id b) {
    levels[get(b).level].remove(b);
    stamp.erase(b);
    cached.erase(b);
  }
  void erase(Id b) {
    unlink(b);
    if (mut_hit_resets_priority) assign.erase(b);
  }
  void forget(Id b) {
    if (contains(b)) unlink(b);
    assign.erase(b);
  }
  std::optional<Id> pop() {
    for (auto& [level, l] : levels) {
      if (!l.empty()) {
        const Id b = l.front();
        unlink(b);
        assign.erase(b);
        return b;
      }
    }
    return std::nullopt;
  }
  std::size_t expire(RetentionTimePoint t) {
    now = std::max(now, rep_of(t));
    std::vector<Id> moved;
    for (Id b : cached) {
      if (lapsed(get(b))) moved.push_back(b);
    }
    std::sort(moved.begin(), moved.end(), [&](Id x, Id y) {
      if (mut_order_by_expiry && *get(x).exp != *get(y).exp) return *get(x).exp < *get(y).exp;
      return stamp.at(x) < stamp.at(y);
    });
    std::list<Id>& def = levels[kDefaultRetentionPriority];
    const auto where = mut_land_at_lru_end ? def.begin() : def.end();
    for (Id b : moved) {
      levels[get(b).level].remove(b);
      assign[b] = Assign{};
      def.insert(where, b);
    }
    return moved.size();
  }
  int priority(Id b) const {
    const Assign a = get(b);
    return lapsed(a) ? kDefaultRetentionPriority : a.level;
  }
  std::optional<Rep> expires(Id b) const {
    const Assign a = get(b);
    return lapsed(a) ? std::nullopt : a.exp;
  }
  void clear() {
    levels.clear();
    assign.clear();
    stamp.clear();
    cached.clear();
  }
  std::vector<Id> order() const {
    std::vector<Id> out;
    for (const auto& [level, l] : levels) out.insert(out.end(), l.begin(), l.end());
    return out;
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Policy vs model under random operations. Each harness returns the first divergence ("step N: what"), or nullopt.

using Divergence = std::optional<std::string>;

template <class Rng>
std::size_t pick(Rng& rng, std::size_t n) {
  return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng);
}

template <class Policy, class Model>
Divergence compare_state(const Policy& p, const Model& m, std::size_t num_blocks, std::size_t step) {
  const auto fail = [&](const std::string& what) { return Divergence("step " + std::to_string(step) + ": " + what); };
  if (p.size() != m.size()) return fail("size " + std::to_string(p.size()) + " vs model " + std::to_string(m.size()));
  const std::vector<Id> po = p.order(), mo = m.order();
  if (po != mo) return fail("order " + show(po) + " vs model " + show(mo));
  const Id expect_peek = mo.empty() ? Id{0} : mo.front();
  if (p.peek_victim() != expect_peek) return fail("peek_victim " + std::to_string(p.peek_victim()));
  for (Id b = 0; b < num_blocks + 2; ++b) {
    const bool mc = b != 0 && b < num_blocks && m.contains(b);
    if (p.contains(b) != mc) return fail("contains(" + std::to_string(b) + ")");
  }
  return std::nullopt;
}

// Random insert / erase (hit) / forget / pop / clear on an SLRU of `num_blocks` blocks.
Divergence run_slru(SlruModel model, std::size_t num_blocks, double fraction, std::uint64_t seed, std::size_t steps) {
  Slru p(num_blocks, fraction);
  std::mt19937_64 rng(seed);
  std::vector<Id> in_set, out_of_set;
  for (std::size_t step = 0; step < steps; ++step) {
    in_set.clear();
    out_of_set.clear();
    for (Id b = 1; b < num_blocks; ++b) (model.contains(b) ? in_set : out_of_set).push_back(b);
    const auto fail = [&](const std::string& what) {
      return Divergence("step " + std::to_string(step) + ": " + what);
    };
    const std::size_t op = pick(rng, 1000);
    if (op < 380 && !out_of_set.empty()) {  // release: insert
      const Id b = out_of_set[pick(rng, out_of_set.size())];
      p.insert(b);
      model.insert(b);
    } else if (op < 640 && !in_set.empty()) {  // hit: erase
      const Id b = in_set[pick(rng, in_set.size())];
      p.erase(b);
      model.erase(b);
      if (!p.is_marked_hit(b)) return fail("hit block " + std::to_string(b) + " not marked");
    } else if (op < 700) {  // hash dropped: forget, cached or not
      const Id b = static_cast<Id>(1 + pick(rng, num_blocks - 1));
      p.forget(b);
      model.forget(b);
    } else if (op < 998) {  // eviction
      const auto v = p.pop_victim();
      const auto mv = model.pop();
      if (v != mv) return fail("victim " + show(v) + " vs model " + show(mv));
    } else {
      p.clear();
      model.clear();
    }
    if (auto d = compare_state(p, model, num_blocks, step)) return d;
    if (p.protected_size() != model.prot.size()) return fail("protected size");
    if (p.protected_size() > p.protected_capacity()) return fail("protected over capacity");
    for (Id b = 1; b < num_blocks; ++b) {
      if (!model.contains(b) && p.is_marked_hit(b) != (model.hit.count(b) != 0)) {
        return fail("hit mark of " + std::to_string(b));
      }
    }
  }
  return std::nullopt;
}

// Random set_priority / insert / erase (hit) / forget / pop / expire / clear on a priority LRU, plus misuse.
Divergence run_prio(PrioModel model, std::size_t num_blocks, std::uint64_t seed, std::size_t steps) {
  Prio p(num_blocks);
  std::mt19937_64 rng(seed);
  std::int64_t t_ms = 1000;
  std::vector<Id> in_set, out_of_set;
  const auto random_priority = [&]() -> std::uint8_t {
    switch (pick(rng, 6)) {
      case 0: return 0;
      case 1: return 100;
      case 2: return kDefaultRetentionPriority;
      default: return static_cast<std::uint8_t>(pick(rng, 101));
    }
  };
  const auto random_expiry = [&]() -> std::optional<RetentionTimePoint> {
    const std::size_t k = pick(rng, 10);
    if (k < 3) return std::nullopt;
    if (k == 3) return RetentionTimePoint::max();
    if (k == 4) return at_ms(t_ms);  // exactly now
    return at_ms(t_ms + static_cast<std::int64_t>(pick(rng, 60)) - 5);
  };
  for (std::size_t step = 0; step < steps; ++step) {
    in_set.clear();
    out_of_set.clear();
    for (Id b = 1; b < num_blocks; ++b) (model.contains(b) ? in_set : out_of_set).push_back(b);
    const auto fail = [&](const std::string& what) {
      return Divergence("step " + std::to_string(step) + ": " + what);
    };
    const std::size_t op = pick(rng, 1000);
    if (op < 200 && !out_of_set.empty()) {  // assign a priority to a block that is not cached
      const Id b = out_of_set[pick(rng, out_of_set.size())];
      const std::uint8_t prio = random_priority();
      const auto at = random_expiry();
      p.set_priority(b, prio, at);
      model.set_priority(b, prio, at);
    } else if (op < 480 && !out_of_set.empty()) {  // release: insert
      const Id b = out_of_set[pick(rng, out_of_set.size())];
      p.insert(b);
      model.insert(b);
    } else if (op < 620 && !in_set.empty()) {  // hit: erase
      const Id b = in_set[pick(rng, in_set.size())];
      p.erase(b);
      model.erase(b);
    } else if (op < 660) {  // hash dropped: forget
      const Id b = static_cast<Id>(1 + pick(rng, num_blocks - 1));
      p.forget(b);
      model.forget(b);
    } else if (op < 820) {  // eviction
      const auto v = p.pop_victim();
      const auto mv = model.pop();
      if (v != mv) return fail("victim " + show(v) + " vs model " + show(mv));
    } else if (op < 960) {  // time passes: small steps (sometimes a stale now), or a jump expiring many at once
      t_ms += pick(rng, 8) == 0 ? static_cast<std::int64_t>(20 + pick(rng, 60))
                                : static_cast<std::int64_t>(pick(rng, 12)) - 2;
      const std::size_t n = p.expire(at_ms(t_ms));
      const std::size_t mn = model.expire(at_ms(t_ms));
      if (n != mn) return fail("expire moved " + std::to_string(n) + " vs model " + std::to_string(mn));
    } else if (op < 980) {  // misuse: nothing may change
      const std::vector<Id> before = p.order();
      bool threw = false;
      try {
        if (!in_set.empty() && pick(rng, 2) == 0) {
          p.set_priority(in_set[pick(rng, in_set.size())], 50, std::nullopt);  // cached
        } else {
          p.set_priority(static_cast<Id>(1 + pick(rng, num_blocks - 1)), static_cast<std::uint8_t>(101 + pick(rng, 155)),
                         std::nullopt);
        }
      } catch (const pagedkv::Error& e) {
        threw = e.code() == Errc::kInvalidArgument;
      }
      if (!threw) return fail("misuse not rejected with kInvalidArgument");
      if (p.order() != before) return fail("misuse changed the order");
    } else if (op < 998) {
      // nothing: a step that only re-checks
    } else {
      p.clear();
      model.clear();
    }
    if (auto d = compare_state(p, model, num_blocks, step)) return d;
    for (Id b = 1; b < num_blocks; ++b) {
      if (p.priority(b) != model.priority(b)) {
        return fail("priority(" + std::to_string(b) + ") " + std::to_string(p.priority(b)) + " vs model " +
                    std::to_string(model.priority(b)));
      }
      const auto e = p.expires_at(b);
      const auto me = model.expires(b);
      if (e.has_value() != me.has_value() || (e && rep_of(*e) != *me)) return fail("expires_at(" + std::to_string(b) + ")");
    }
    for (int l = 0; l <= 100; ++l) {
      const auto it = model.levels.find(l);
      const std::size_t ms = it == model.levels.end() ? 0 : it->second.size();
      if (p.size_at(static_cast<std::uint8_t>(l)) != ms) return fail("size_at(" + std::to_string(l) + ")");
    }
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("SlruEviction matches the reference model under random operations", "[eviction][slru][model]") {
  struct Config {
    std::size_t num_blocks;
    double fraction;
  };
  // Small pools make segments overflow and empty often; fractions cover 0 (LRU), the default, and 1 (no demotion).
  for (const Config c : {Config{17, 0.8}, Config{9, 0.5}, Config{40, 0.8}, Config{12, 0.0}, Config{12, 1.0},
                         Config{65, 0.25}}) {
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      INFO("num_blocks " << c.num_blocks << " fraction " << c.fraction << " seed " << seed);
      const Divergence d = run_slru(SlruModel(c.num_blocks, c.fraction), c.num_blocks, c.fraction, seed, 6000);
      INFO((d ? *d : std::string()));
      CHECK_FALSE(d.has_value());
    }
  }
}

TEST_CASE("SlruEviction: the random harness catches deliberately wrong models", "[eviction][slru][model][mutation]") {
  const auto caught = [](auto mutate) {
    SlruModel m(17, 0.5);
    mutate(m);
    return run_slru(m, 17, 0.5, 7, 6000).has_value();
  };
  CHECK(caught([](SlruModel& m) { m.mut_demote_to_lru_end = true; }));
  CHECK(caught([](SlruModel& m) { m.mut_ignore_hits = true; }));
  CHECK(caught([](SlruModel& m) { m.mut_victim_protected_first = true; }));
  CHECK(caught([](SlruModel& m) { m.mut_cap_plus = 1; }));
  CHECK_FALSE(caught([](SlruModel&) {}));  // and the unmutated model agrees on the same run
}

TEST_CASE("PriorityLruEviction matches the reference model under random operations", "[eviction][priority][model]") {
  for (const std::size_t n : {std::size_t{9}, std::size_t{33}, std::size_t{80}}) {
    for (std::uint64_t seed = 1; seed <= 5; ++seed) {
      INFO("num_blocks " << n << " seed " << seed);
      const Divergence d = run_prio(PrioModel(n), n, seed, 6000);
      INFO((d ? *d : std::string()));
      CHECK_FALSE(d.has_value());
    }
  }
}

TEST_CASE("PriorityLruEviction: the random harness catches deliberately wrong models",
          "[eviction][priority][model][mutation]") {
  const auto caught = [](auto mutate) {
    PrioModel m(33);
    mutate(m);
    return run_prio(m, 33, 11, 6000).has_value();
  };
  CHECK(caught([](PrioModel& m) { m.mut_land_at_lru_end = true; }));
  CHECK(caught([](PrioModel& m) { m.mut_order_by_expiry = true; }));
  CHECK(caught([](PrioModel& m) { m.mut_strict_expiry = true; }));
  CHECK(caught([](PrioModel& m) { m.mut_hit_resets_priority = true; }));
  CHECK_FALSE(caught([](PrioModel&) {}));
}

// ---------------------------------------------------------------------------------------------------------------
// The allocator driving each policy.

namespace {

template <class Policy, class Model>
Divergence run_allocator(Model model, std::size_t num_blocks, std::uint64_t seed, std::size_t steps) {
  constexpr bool kPriorities = pagedkv::RetentionEvictionPolicy<Policy, Id>;
  pagedkv::BlockAllocator<Id, Policy> a(num_blocks);
  std::mt19937_64 rng(seed);
  std::vector<std::uint32_t> ref(num_blocks, 0);
  std::vector<bool> hashed(num_blocks, false);
  std::vector<Id> free_stack;  // back = top
  std::size_t next_never = 1;
  std::int64_t t_ms = 0;
  std::vector<Id> held, cached;
  for (std::size_t step = 0; step < steps; ++step) {
    const auto fail = [&](const std::string& what) {
      return Divergence("step " + std::to_string(step) + ": " + what);
    };
    held.clear();
    cached.clear();
    for (Id b = 1; b < num_blocks; ++b) {
      if (ref[b] > 0) held.push_back(b);
      if (model.contains(b)) cached.push_back(b);
    }
    const std::size_t op = pick(rng, 1000);
    if (op < 300) {  // allocate one block
      std::optional<Id> expect;
      bool expect_eviction = false;
      if (next_never < num_blocks) {
        expect = static_cast<Id>(next_never++);
      } else if (!free_stack.empty()) {
        expect = free_stack.back();
        free_stack.pop_back();
      } else {
        expect = model.pop();
        expect_eviction = expect.has_value();
      }
      std::vector<Id> evicted;
      const auto got = a.try_allocate_one([&](Id b) { evicted.push_back(b); });
      if (got != expect) return fail("allocated " + show(got) + " vs model " + show(expect));
      if (evicted != (expect_eviction ? std::vector<Id>{*expect} : std::vector<Id>{})) {
        return fail("on_evict " + show(evicted));
      }
      if (got) {
        ref[*got] = 1;
        hashed[*got] = false;
      }
    } else if (op < 450 && (!held.empty() || !cached.empty())) {  // acquire: fork (held) or prefix hit (cached)
      const bool hit = !cached.empty() && (held.empty() || pick(rng, 2) == 0);
      const Id b = hit ? cached[pick(rng, cached.size())] : held[pick(rng, held.size())];
      a.acquire(b);
      if (hit) model.erase(b);
      ++ref[b];
    } else if (op < 750 && !held.empty()) {  // release (the manager assigns priorities just before)
      const Id b = held[pick(rng, held.size())];
      if constexpr (kPriorities) {
        if (pick(rng, 2) == 0) {
          const auto prio = static_cast<std::uint8_t>(pick(rng, 101));
          const std::optional<RetentionTimePoint> at =
              pick(rng, 3) == 0 ? std::nullopt : std::optional(at_ms(t_ms + static_cast<std::int64_t>(pick(rng, 30))));
          a.set_retention_priority(b, prio, at);
          model.set_priority(b, prio, at);
        }
      }
      a.release(b);
      if (--ref[b] == 0) {
        if (hashed[b]) {
          model.insert(b);
        } else {
          free_stack.push_back(b);
          // Released unhashed: the allocator makes the policy forget what was assigned while it was held.
          if constexpr (pagedkv::ForgettingEvictionPolicy<Policy, Id>) model.forget(b);
        }
      }
    } else if (op < 880 && !held.empty()) {  // registration, or (rarely) the hash dropped while held
      const Id b = held[pick(rng, held.size())];
      const bool drop = hashed[b] && pick(rng, 4) == 0;
      a.set_hashed(b, !drop);
      hashed[b] = !drop;
      if (drop) model.forget(b);  // set_hashed(b, false) makes the policy forget b's history
    } else if (op < 960) {  // time passes
      t_ms += static_cast<std::int64_t>(pick(rng, 8));
      const std::size_t moved = a.expire_retention(at_ms(t_ms));
      if constexpr (kPriorities) {
        if (moved != model.expire(at_ms(t_ms))) return fail("expire count");
      } else if (moved != 0) {
        return fail("expire_priorities on a policy without priorities");
      }
    } else if (op < 965) {  // reset of the prefix cache
      std::vector<Id> dropped;
      a.clear_hashes([&](Id b) {
        dropped.push_back(b);  // the allocator forgot held blocks' history before this call
      });
      std::vector<Id> expect;
      while (auto v = model.pop()) {
        expect.push_back(*v);
        free_stack.push_back(*v);
      }
      for (Id b = 1; b < num_blocks; ++b) {
        if (ref[b] > 0 && hashed[b]) {
          expect.push_back(b);
          hashed[b] = false;
          model.forget(b);
        }
      }
      if (dropped != expect) return fail("clear_hashes dropped " + show(dropped) + " vs model " + show(expect));
    }
    // Invariants: the three states partition the pool, every count agrees, and the policy's order is the model's.
    std::size_t n_free = 0, n_cached = 0, n_held = 0;
    for (Id b = 1; b < num_blocks; ++b) {
      if (a.refcount(b) != ref[b]) return fail("refcount(" + std::to_string(b) + ")");
      if (a.is_hashed(b) != (ref[b] > 0 ? hashed[b] : model.contains(b))) return fail("is_hashed");
      if (a.is_cached(b) != model.contains(b)) return fail("is_cached(" + std::to_string(b) + ")");
      const int states = int(ref[b] > 0) + int(a.is_cached(b)) + int(ref[b] == 0 && !a.is_cached(b));
      if (states != 1) return fail("block " + std::to_string(b) + " in " + std::to_string(states) + " states");
      n_held += ref[b] > 0;
      n_cached += a.is_cached(b);
      n_free += ref[b] == 0 && !a.is_cached(b);
    }
    if (n_free != a.num_free_blocks() || n_free != (num_blocks - next_never) + free_stack.size()) {
      return fail("free count");
    }
    if (n_cached != a.num_cached_blocks() || n_held != a.num_used_blocks()) return fail("cached / used count");
    if (a.num_available_blocks() != n_free + n_cached) return fail("available count");
    if (a.eviction_policy().order() != model.order()) {
      return fail("policy order " + show(a.eviction_policy().order()) + " vs model " + show(model.order()));
    }
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("BlockAllocator drives SlruEviction: states, counts and victims match the model",
          "[eviction][slru][block_allocator]") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    INFO("seed " << seed);
    const Divergence d = run_allocator<Slru>(SlruModel(24), 24, seed, 8000);
    INFO((d ? *d : std::string()));
    CHECK_FALSE(d.has_value());
  }
  SlruModel wrong(24);
  wrong.mut_ignore_hits = true;
  CHECK(run_allocator<Slru>(wrong, 24, 3, 8000).has_value());  // the harness can fail
}

TEST_CASE("BlockAllocator drives PriorityLruEviction: states, counts and victims match the model",
          "[eviction][priority][block_allocator]") {
  for (std::uint64_t seed = 1; seed <= 6; ++seed) {
    INFO("seed " << seed);
    const Divergence d = run_allocator<Prio>(PrioModel(24), 24, seed, 8000);
    INFO((d ? *d : std::string()));
    CHECK_FALSE(d.has_value());
  }
  PrioModel wrong(24);
  wrong.mut_land_at_lru_end = true;
  CHECK(run_allocator<Prio>(wrong, 24, 3, 8000).has_value());
}

TEST_CASE("Extension helpers fall back for a policy without the extension (LRU)", "[eviction][lru][extension]") {
  LruEviction<Id> lru(6);
  lru.insert(3);
  lru.insert(5);
  pagedkv::forget_block(lru, Id{3});  // cached: erased
  pagedkv::forget_block(lru, Id{4});  // not cached: nothing
  CHECK(lru.order() == std::vector<Id>{5});
  pagedkv::set_block_priority(lru, Id{4}, 100, std::nullopt);  // no priorities: nothing
  CHECK(pagedkv::expire_priorities(lru, at_ms(5)) == 0);
  CHECK(lru.order() == std::vector<Id>{5});
}

// ---------------------------------------------------------------------------------------------------------------
// SLRU edge cases, hand-checked.

TEST_CASE("SlruEviction: first-time blocks are on probation, hit blocks protected, probation evicted first",
          "[eviction][slru]") {
  Slru p(11);  // 10 usable, protected holds 8
  CHECK(p.protected_capacity() == 8);
  for (Id b : {1, 2, 3, 4}) p.insert(b);
  p.erase(2);  // hit
  CHECK(p.is_marked_hit(2));
  p.insert(2);  // released again: protected
  CHECK(p.is_protected(2));
  CHECK_FALSE(p.is_marked_hit(2));
  p.insert(5);
  CHECK(p.probation_order() == std::vector<Id>{1, 3, 4, 5});
  CHECK(p.protected_order() == std::vector<Id>{2});
  CHECK(p.order() == std::vector<Id>{1, 3, 4, 5, 2});
  // 2 was released before 5, so LRU would evict it before 5; SLRU evicts every probation block first.
  std::vector<Id> victims;
  while (auto v = p.pop_victim()) victims.push_back(*v);
  CHECK(victims == std::vector<Id>{1, 3, 4, 5, 2});
  CHECK(p.size() == 0);
  // The victim's hit mark is gone: its next content starts on probation.
  p.insert(2);
  CHECK_FALSE(p.is_protected(2));
}

TEST_CASE("SlruEviction: protected overflow demotes its LRU block to probation's MRU end", "[eviction][slru]") {
  Slru p(6, 0.4);  // 5 usable: protected holds floor(0.4 * 5) = 2
  REQUIRE(p.protected_capacity() == 2);
  for (Id b : {1, 2, 3, 4, 5}) p.insert(b);
  for (Id b : {1, 2, 3}) p.erase(b);  // three hits
  p.insert(1);
  p.insert(2);
  CHECK(p.protected_order() == std::vector<Id>{1, 2});
  p.insert(3);  // protected overflows: 1 demoted behind 4, 5
  CHECK(p.protected_order() == std::vector<Id>{2, 3});
  CHECK(p.probation_order() == std::vector<Id>{4, 5, 1});
  // A demoted block hit again goes back to protected (and demotes the next LRU).
  p.erase(1);
  p.insert(1);
  CHECK(p.protected_order() == std::vector<Id>{3, 1});
  CHECK(p.probation_order() == std::vector<Id>{4, 5, 2});
}

TEST_CASE("SlruEviction: all blocks protected (fraction 1), and fraction 0 is exactly LRU", "[eviction][slru]") {
  SECTION("fraction 1: nothing is demoted; victims come from protected's LRU end once probation is empty") {
    Slru p(5, 1.0);
    CHECK(p.protected_capacity() == 4);
    for (Id b : {4, 3, 2, 1}) p.insert(b);
    for (Id b : {3, 1, 4, 2}) p.erase(b);
    for (Id b : {3, 1, 4, 2}) p.insert(b);
    CHECK(p.probation_size() == 0);
    CHECK(p.protected_order() == std::vector<Id>{3, 1, 4, 2});
    CHECK(p.pop_victim() == std::optional<Id>(3));
    CHECK(p.pop_victim() == std::optional<Id>(1));
    p.insert(3);  // fresh content: probation, evicted before the protected ones
    CHECK(p.pop_victim() == std::optional<Id>(3));
    CHECK(p.pop_victim() == std::optional<Id>(4));
    CHECK(p.pop_victim() == std::optional<Id>(2));
    CHECK_FALSE(p.pop_victim().has_value());
  }
  SECTION("fraction 0: the same order as LruEviction under random hits and evictions") {
    constexpr std::size_t kN = 30;
    Slru s(kN, 0.0);
    LruEviction<Id> lru(kN);
    std::mt19937_64 rng(99);
    for (int step = 0; step < 20000; ++step) {
      const Id b = static_cast<Id>(1 + pick(rng, kN - 1));
      const std::size_t op = pick(rng, 3);
      if (op == 0 && !lru.contains(b)) {
        s.insert(b);
        lru.insert(b);
      } else if (op == 1 && lru.contains(b)) {
        s.erase(b);
        lru.erase(b);
      } else if (op == 2) {
        REQUIRE(s.pop_victim() == lru.pop_victim());
      }
      REQUIRE(s.order() == lru.order());
      REQUIRE(s.protected_size() == 0);
    }
  }
}

TEST_CASE("SlruEviction: forget is not a hit - it clears the mark of a held block", "[eviction][slru]") {
  Slru p(8);
  for (Id b : {1, 2, 3}) p.insert(b);
  p.forget(2);  // cached, hash dropped
  CHECK_FALSE(p.contains(2));
  CHECK_FALSE(p.is_marked_hit(2));
  p.insert(2);  // new content
  CHECK_FALSE(p.is_protected(2));
  p.erase(3);  // hit: held and marked
  p.forget(3);  // its hash dropped while held
  p.insert(3);
  CHECK_FALSE(p.is_protected(3));
  p.forget(7);  // never cached: nothing
  CHECK(p.order() == std::vector<Id>{1, 2, 3});
}

TEST_CASE("SlruEviction: clear empties both segments and every hit mark", "[eviction][slru]") {
  Slru p(8, 0.5);
  for (Id b : {1, 2, 3, 4}) p.insert(b);
  for (Id b : {1, 2}) p.erase(b);
  p.insert(1);  // protected; 2 held and marked
  p.clear();
  CHECK(p.size() == 0);
  CHECK(p.protected_size() == 0);
  CHECK(p.order().empty());
  CHECK_FALSE(p.contains(1));
  CHECK_FALSE(p.is_marked_hit(2));
  CHECK_FALSE(p.pop_victim().has_value());
  p.insert(2);
  p.insert(1);
  CHECK(p.probation_order() == std::vector<Id>{2, 1});  // reusable after clear, marks gone
}

TEST_CASE("SlruEviction: a protected fraction outside [0, 1] is kInvalidArgument", "[eviction][slru][errors]") {
  for (double bad : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    CHECK_THAT(expect_error([&] { Slru p(10, bad); }, Errc::kInvalidArgument),
               Catch::Contains("protected_fraction"));
  }
  CHECK(Slru(101).protected_capacity() == 80);  // constructible from the pool size alone: 80%
  CHECK(Slru(2).protected_capacity() == 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Priority LRU edge cases, hand-checked.

TEST_CASE("PriorityLruEviction: lowest level first, LRU within a level - priorities 0 and 100",
          "[eviction][priority]") {
  Prio p(10);
  p.set_priority(1, 100, std::nullopt);
  p.set_priority(2, 0, std::nullopt);
  p.set_priority(4, 100, std::nullopt);
  p.set_priority(5, 0, std::nullopt);
  for (Id b : {1, 2, 3, 4, 5, 6}) p.insert(b);  // 3 and 6: default 35
  CHECK(p.size_at(0) == 2);
  CHECK(p.size_at(35) == 2);
  CHECK(p.size_at(100) == 2);
  CHECK(p.size_at(200) == 0);
  CHECK(p.order() == std::vector<Id>{2, 5, 3, 6, 1, 4});
  CHECK(p.priority(1) == 100);
  CHECK(p.priority(2) == 0);
  CHECK(p.priority(3) == kDefaultRetentionPriority);
  // A hit keeps the priority for the next release; eviction resets it.
  p.erase(2);
  p.insert(2);
  CHECK(p.order() == std::vector<Id>{5, 2, 3, 6, 1, 4});
  std::vector<Id> victims;
  while (auto v = p.pop_victim()) victims.push_back(*v);
  CHECK(victims == std::vector<Id>{5, 2, 3, 6, 1, 4});
  for (Id b = 1; b < 7; ++b) CHECK(p.priority(b) == kDefaultRetentionPriority);
}

TEST_CASE("PriorityLruEviction: an expiry exactly at now has expired - expired blocks land at the default level's MRU "
          "end in release order",
          "[eviction][priority][expiry]") {
  Prio p(12);
  p.insert(1);  // default
  p.insert(2);  // default
  p.set_priority(3, 80, at_ms(10));
  p.set_priority(4, 90, at_ms(5));
  p.set_priority(5, 10, at_ms(10));  // a low priority expires upwards
  p.set_priority(6, 70, at_ms(11));
  p.set_priority(7, 60, std::nullopt);  // never expires
  for (Id b : {3, 4, 5, 6, 7}) p.insert(b);
  p.insert(8);  // default, released after all of them
  CHECK(p.num_expiring() == 4);
  CHECK(p.order() == std::vector<Id>{5, 1, 2, 8, 7, 6, 3, 4});
  CHECK(p.expire(at_ms(4)) == 0);
  CHECK(p.expires_at(4) == std::optional(at_ms(5)));
  CHECK(p.expire(at_ms(10)) == 3);  // 4 (at 5), 3 and 5 (exactly at 10); 6 (at 11) stays
  // 3, 4, 5 were released in that order; they follow every block already at the default level (even 8).
  CHECK(p.order() == std::vector<Id>{1, 2, 8, 3, 4, 5, 7, 6});
  for (Id b : {3, 4, 5}) {
    CHECK(p.priority(b) == kDefaultRetentionPriority);
    CHECK_FALSE(p.expires_at(b).has_value());
  }
  CHECK(p.priority(6) == 70);
  CHECK(p.expire(at_ms(9)) == 0);  // an earlier now expires nothing new (and is not recorded)
  CHECK(p.now() == at_ms(10));
  CHECK(p.expire(at_ms(11)) == 1);
  CHECK(p.order() == std::vector<Id>{1, 2, 8, 3, 4, 5, 6, 7});
  CHECK(p.num_expiring() == 0);
}

TEST_CASE("PriorityLruEviction: a priority that lapses while the block is held applies the default at its release",
          "[eviction][priority][expiry]") {
  Prio p(6);
  p.set_priority(1, 90, at_ms(5));
  p.insert(1);
  p.erase(1);  // hit: held
  CHECK(p.expire(at_ms(5)) == 0);  // not cached: nothing moved
  CHECK(p.priority(1) == kDefaultRetentionPriority);
  p.insert(2);
  p.insert(1);  // its priority lapsed: default level, after 2
  CHECK(p.order() == std::vector<Id>{2, 1});
  CHECK(p.num_expiring() == 0);

  // Assigned with an expiry already past: the default at once.
  p.set_priority(3, 100, at_ms(1));
  p.insert(3);
  CHECK(p.order() == std::vector<Id>{2, 1, 3});

  // The default priority carries no expiry; time_point::max() is never; expire(max) moves nothing that never expires.
  p.set_priority(4, kDefaultRetentionPriority, at_ms(6));
  CHECK_FALSE(p.expires_at(4).has_value());
  p.set_priority(5, 100, RetentionTimePoint::max());
  p.insert(5);
  CHECK_FALSE(p.expires_at(5).has_value());
  CHECK(p.num_expiring() == 0);
  CHECK(p.expire(RetentionTimePoint::max()) == 0);
  CHECK(p.priority(5) == 100);
  CHECK(p.order() == std::vector<Id>{2, 1, 3, 5});
}

TEST_CASE("PriorityLruEviction: forget resets the priority - clear resets everything", "[eviction][priority]") {
  Prio p(8);
  p.set_priority(1, 90, at_ms(50));
  p.set_priority(2, 5, std::nullopt);
  p.insert(1);
  p.insert(2);
  p.forget(1);  // cached, hash dropped
  CHECK_FALSE(p.contains(1));
  CHECK(p.priority(1) == kDefaultRetentionPriority);
  CHECK(p.num_expiring() == 0);
  p.set_priority(3, 70, std::nullopt);
  p.forget(3);  // held: the assignment is gone
  p.insert(3);
  CHECK(p.priority(3) == kDefaultRetentionPriority);

  p.set_priority(4, 99, at_ms(20));  // held block with an assignment
  p.set_priority(5, 99, at_ms(20));
  p.insert(5);
  p.expire(at_ms(3));
  p.clear();
  CHECK(p.size() == 0);
  CHECK(p.order().empty());
  CHECK(p.num_expiring() == 0);
  CHECK_FALSE(p.pop_victim().has_value());
  CHECK(p.priority(4) == kDefaultRetentionPriority);
  CHECK(p.now() == at_ms(3));  // time is not reset
  p.insert(5);
  p.insert(4);
  CHECK(p.order() == std::vector<Id>{5, 4});
}

TEST_CASE("PriorityLruEviction: misuse throws and changes nothing", "[eviction][priority][errors]") {
  Prio p(6);
  p.set_priority(1, 80, at_ms(9));
  p.insert(1);
  p.set_priority(2, 20, std::nullopt);
  const std::vector<Id> before = p.order();
  CHECK_THAT(expect_error([&] { p.set_priority(2, 101, std::nullopt); }, Errc::kInvalidArgument),
             Catch::Contains("priority 101") && Catch::Contains("[0, 100]"));
  CHECK_THAT(expect_error([&] { p.set_priority(2, 255, at_ms(3)); }, Errc::kInvalidArgument),
             Catch::Contains("priority 255"));
  CHECK_THAT(expect_error([&] { p.set_priority(1, 10, std::nullopt); }, Errc::kInvalidArgument),
             Catch::Contains("block 1 is cached"));
  for (Id bad : {0u, 6u, 1000u}) {
    CHECK_THAT(expect_error([&] { p.set_priority(bad, 50, std::nullopt); }, Errc::kBlockOutOfRange),
               Catch::Contains("block id " + std::to_string(bad)));
    CHECK_THAT(expect_error([&] { (void)p.priority(bad); }, Errc::kBlockOutOfRange),
               Catch::Contains("block id " + std::to_string(bad)));
    CHECK_THAT(expect_error([&] { (void)p.expires_at(bad); }, Errc::kBlockOutOfRange),
               Catch::Contains("block id " + std::to_string(bad)));
  }
  CHECK(p.order() == before);
  CHECK(p.priority(1) == 80);
  CHECK(p.expires_at(1) == std::optional(at_ms(9)));
  CHECK(p.priority(2) == 20);
  CHECK(p.num_expiring() == 1);
}

// ---------------------------------------------------------------------------------------------------------------
// The manager accepts both policies unchanged.

namespace {

// Admits `prompt` as `seq`, builds the step (registers its full blocks) and frees it.
template <class Mgr>
void run_request(Mgr& m, pagedkv::SeqId seq, const std::vector<pagedkv::TokenId>& prompt) {
  REQUIRE(m.try_admit(seq, prompt).admitted());
  const std::vector<pagedkv::SeqId> batch{seq};
  pagedkv_test::build_step(m, batch);
  m.free(seq);
}

// A shared prefix reused once, then a scan of one-off prompts; returns whether the shared prefix is still cached.
template <class Evict>
bool shared_prefix_survives_scan() {
  pagedkv::CacheConfig cfg;
  cfg.num_blocks = 9;  // 8 usable
  cfg.block_size = 2;
  pagedkv::KVCacheManager<pagedkv::Sha256Hasher, Id, Evict> m(cfg);
  const std::vector<pagedkv::TokenId> shared{1, 2, 3, 4, 5};  // 2 full blocks + 1 partial
  run_request(m, 1, shared);
  run_request(m, 2, shared);  // hits both full blocks
  for (pagedkv::SeqId s = 3; s < 9; ++s) {  // one-off prompts: 2 full blocks + 1 partial each
    const auto t = static_cast<pagedkv::TokenId>(100 * s);
    run_request(m, s, {t, t + 1, t + 2, t + 3, t + 4});
  }
  return m.lookup(shared) == 4;
}

}  // namespace

TEST_CASE("KVCacheManager accepts SlruEviction and PriorityLruEviction", "[eviction][kv_cache_manager]") {
  // Under LRU the scan flushes the shared prefix; under SLRU the prefix (hit once) is protected and survives.
  CHECK_FALSE(shared_prefix_survives_scan<LruEviction<Id>>());
  CHECK(shared_prefix_survives_scan<Slru>());
  // With every priority at the default, PriorityLruEviction is LRU.
  CHECK_FALSE(shared_prefix_survives_scan<Prio>());
}

TEST_CASE("Both policies work with 16-bit ids at the largest pool the allocator accepts", "[eviction][id_type]") {
  using Id16 = std::uint16_t;
  constexpr std::size_t kN = 65535;  // ids 1 .. 65534; 65535 is the lists' "unlinked" mark
  const auto exercise = [](auto& a, auto&& before_release) {
    std::vector<Id16> all(a.num_usable_blocks());
    REQUIRE(a.try_allocate(std::span<Id16>(all)));
    for (Id16 b : all) a.set_hashed(b, true);
    before_release(a);
    for (Id16 b : all) a.release(b);  // cached in id order
    CHECK(a.num_cached_blocks() == kN - 1);
    a.acquire(Id16{1});  // hit
    a.release(Id16{1});  // SLRU: protected; priority LRU: most recent
    std::vector<Id16> evicted;
    Id16 got = 0;
    for (int i = 0; i < 3; ++i) got = *a.try_allocate_one([&](Id16 b) { evicted.push_back(b); });
    CHECK(got == 4);
    CHECK(evicted == std::vector<Id16>{2, 3, 4});
    CHECK(a.is_cached(Id16{65534}));
    CHECK(a.is_cached(Id16{1}));
  };
  pagedkv::BlockAllocator<Id16, SlruEviction<Id16>> slru(kN);
  exercise(slru, [](auto&) {});
  CHECK(slru.eviction_policy().is_protected(1));
  pagedkv::BlockAllocator<Id16, PriorityLruEviction<Id16>> prio(kN);
  exercise(prio, [](auto& a) { a.set_retention_priority(Id16{65534}, 100, at_ms(5)); });  // held: for its release
  CHECK(prio.eviction_policy().priority(65534) == 100);
  CHECK(prio.eviction_policy().num_expiring() == 1);
  CHECK(prio.expire_retention(at_ms(5)) == 1);
  CHECK(prio.eviction_policy().order().back() == 65534);
}
