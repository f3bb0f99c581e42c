// Tests of pagedkv/detail/external_kv.hpp (the external-KV state machine, alone over a BlockAllocator) and of the
// public types of pagedkv/external_kv.hpp: a randomized model-based test of fills, completions with partial
// failures, aborts quiescent or not (orphan holds), leases (release, extend, expire), save pins, late / duplicate /
// unknown / reordered signals and generations, checked after every operation against a plain model (refcounts,
// external references, generations, signal outcomes); directed tests of each rule.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/block_allocator.hpp>
#include <pagedkv/detail/external_kv.hpp>
#include <pagedkv/external_kv.hpp>

namespace {

using pagedkv::ExternalSignal;
using pagedkv::ExternalTimePoint;
using pagedkv::SeqId;
using pagedkv::detail::ExternalKvState;
using pagedkv::detail::HoldKind;
using pagedkv_test::expect_error;
using Alloc = pagedkv::BlockAllocator<std::uint32_t>;
using State = ExternalKvState<std::uint32_t>;
using std::chrono::seconds;

ExternalTimePoint at(long s) { return ExternalTimePoint{} + seconds(s); }

// A pool, the state over it, and the acquire / release the manager would pass.
struct Fixture {
  explicit Fixture(std::size_t n) : alloc(n), ext(n) {}
  Alloc alloc;
  State ext;
  auto acq() {
    return [this](std::uint32_t b) { alloc.acquire(b); };
  }
  auto rel() {
    return [this](std::uint32_t b) { alloc.release(b); };
  }
  std::vector<std::uint32_t> take(std::size_t n) {
    std::vector<std::uint32_t> v(n);
    REQUIRE(alloc.try_allocate(std::span<std::uint32_t>(v)));
    return v;
  }
  void free_table(const std::vector<std::uint32_t>& t) {
    for (auto it = t.rbegin(); it != t.rend(); ++it) alloc.release(*it);
  }
};

TEST_CASE("fill: blocks carry a reference until the signal - late, duplicate and unknown signals are counted",
          "[external_kv]") {
  Fixture f(16);
  const auto table = f.take(4);
  const std::uint64_t id = f.ext.begin_fill(7, 1, 1, 16, 64, std::span(table).subspan(1), f.acq(), f.rel());
  CHECK(f.ext.fill_of(7) == id);
  for (std::size_t i = 1; i < 4; ++i) CHECK(f.alloc.refcount(table[i]) == 2);
  CHECK(f.alloc.refcount(table[0]) == 1);
  CHECK(f.ext.counters().blocks_held == 3);
  const std::uint32_t g1 = f.ext.generation(table[1]);
  CHECK(f.ext.is_current(table[1], g1));

  const auto s = f.ext.take_fill(id, f.rel());
  CHECK(s.status == ExternalSignal::kApplied);
  REQUIRE(s.fill);
  CHECK(s.fill->blocks == std::vector<std::uint32_t>(table.begin() + 1, table.end()));
  for (std::size_t i = 1; i < 4; ++i) CHECK(f.alloc.refcount(table[i]) == 1);
  CHECK_FALSE(f.ext.is_current(table[1], g1));  // the hold ended: the generation moved on
  CHECK(f.ext.fill_of(7) == 0);

  CHECK(f.ext.take_fill(id, f.rel()).status == ExternalSignal::kDuplicate);
  CHECK(f.ext.take_fill(999, f.rel()).status == ExternalSignal::kUnknown);
  CHECK(f.ext.take_fill(0, f.rel()).status == ExternalSignal::kUnknown);
  const auto c = f.ext.counters();
  CHECK(c.duplicate_signals == 1);
  CHECK(c.unknown_signals == 2);
  CHECK(c.stale_generations == 1);
  CHECK(f.ext.empty());
}

TEST_CASE("abort: quiescent releases at once - otherwise an orphan hold until the late signal or the deadline",
          "[external_kv]") {
  Fixture f(16);
  auto t1 = f.take(2);
  auto t2 = f.take(2);
  const auto id1 = f.ext.begin_fill(1, 1, 0, 0, 32, t1, f.acq(), f.rel());
  const auto id2 = f.ext.begin_fill(2, 1, 0, 0, 32, t2, f.acq(), f.rel());
  // Quiescent abort of seq 1: table and fill references both go; the blocks are free again.
  f.free_table(t1);
  CHECK(f.ext.abort_fill(1, true, std::nullopt, f.rel()) == id1);
  CHECK(f.alloc.num_used_blocks() == 2);
  CHECK(f.ext.take_fill(id1, f.rel()).status == ExternalSignal::kLate);
  // Non-quiescent abort of seq 2: the blocks stay referenced (never reused) until the late signal.
  f.free_table(t2);
  CHECK(f.ext.abort_fill(2, false, at(10), f.rel()) == id2);
  CHECK(f.alloc.num_used_blocks() == 2);
  CHECK(f.ext.num_holds() == 1);
  std::vector<std::uint32_t> all(f.alloc.num_available_blocks());
  REQUIRE(f.alloc.try_allocate(std::span<std::uint32_t>(all)));
  for (auto b : all) CHECK((b != t2[0] && b != t2[1]));
  f.free_table(all);
  CHECK(f.ext.take_fill(id2, f.rel()).status == ExternalSignal::kLate);
  CHECK(f.alloc.num_used_blocks() == 0);
  CHECK(f.ext.take_fill(id2, f.rel()).status == ExternalSignal::kLate);
  const auto c = f.ext.counters();
  CHECK(c.fills_aborted == 2);
  CHECK(c.orphan_holds == 1);
  CHECK(c.orphans_released == 1);
  CHECK(c.late_signals == 3);
  CHECK(f.ext.empty());

  // The deadline: vLLM #46283 (an aborted request's blocks held forever) cannot happen.
  auto t3 = f.take(3);
  const auto id3 = f.ext.begin_fill(3, 1, 0, 0, 48, t3, f.acq(), f.rel());
  f.free_table(t3);
  f.ext.abort_fill(3, false, at(5), f.rel());
  CHECK(f.ext.reap(at(4), f.rel()) == 0);
  CHECK(f.alloc.num_used_blocks() == 3);
  CHECK(f.ext.reap(at(5), f.rel()) == 1);
  CHECK(f.alloc.num_used_blocks() == 0);
  CHECK(f.ext.counters().orphans_expired == 1);
  CHECK(f.ext.take_fill(id3, f.rel()).status == ExternalSignal::kLate);
}

TEST_CASE("leases and save pins: release, extend, expire - the blocks are never reused while held",
          "[external_kv]") {
  Fixture f(8);
  auto t = f.take(3);
  const auto lease = f.ext.add_hold(HoldKind::kLease, 5, t, at(10), f.acq(), f.rel());
  const auto pin = f.ext.add_hold(HoldKind::kSavePin, 5, std::span(t).first(1), std::nullopt, f.acq(), f.rel());
  f.free_table(t);  // the producer's sequence finished
  CHECK(f.alloc.refcount(t[0]) == 2);
  CHECK(f.alloc.refcount(t[2]) == 1);
  CHECK(f.ext.extend(lease, at(20)) == ExternalSignal::kApplied);
  CHECK(f.ext.reap(at(15), f.rel()) == 0);
  CHECK(f.ext.reap(at(20), f.rel()) == 1);  // the lease expired; the pin (no deadline) holds t[0]
  CHECK(f.alloc.refcount(t[0]) == 1);
  CHECK(f.alloc.refcount(t[2]) == 0);
  CHECK(f.ext.release_hold(lease, f.rel()) == ExternalSignal::kLate);
  CHECK(f.ext.extend(lease, at(30)) == ExternalSignal::kLate);
  CHECK(f.ext.release_hold(pin, f.rel()) == ExternalSignal::kApplied);
  CHECK(f.ext.release_hold(pin, f.rel()) == ExternalSignal::kDuplicate);
  CHECK(f.ext.release_hold(12345, f.rel()) == ExternalSignal::kUnknown);
  CHECK(f.alloc.num_used_blocks() == 0);
  const auto c = f.ext.counters();
  CHECK(c.leases_started == 1);
  CHECK(c.leases_extended == 1);
  CHECK(c.leases_expired == 1);
  CHECK(c.save_pins_started == 1);
  CHECK(c.save_pins_ended == 1);
  CHECK(c.late_signals == 2);
  CHECK(c.duplicate_signals == 1);
  CHECK(c.unknown_signals == 1);
}

TEST_CASE("misuse is an error naming the value and changes nothing", "[external_kv]") {
  Fixture f(8);
  auto t = f.take(2);
  f.ext.begin_fill(1, 1, 0, 0, 32, t, f.acq(), f.rel());
  CHECK(expect_error([&] { f.ext.begin_fill(1, 1, 0, 0, 32, t, f.acq(), f.rel()); },
                     pagedkv::Errc::kDuplicateSequence)
            .find("sequence 1") != std::string::npos);
  const std::vector<std::uint32_t> bad{t[0], 9};
  CHECK(expect_error([&] { f.ext.begin_fill(2, 1, 0, 0, 32, bad, f.acq(), f.rel()); },
                     pagedkv::Errc::kInvalidArgument)
            .find("block 9") != std::string::npos);
  CHECK(expect_error([&] { f.ext.begin_fill(2, 2, 0, 0, 32, std::span(bad).first(1), f.acq(), f.rel()); },
                     pagedkv::Errc::kInvalidArgument)
            .find("2 groups") != std::string::npos);
  // acquire of a free block throws inside the allocator: the references taken before it are dropped.
  auto free_block = f.take(1);
  f.alloc.release(free_block[0]);
  const std::vector<std::uint32_t> half{t[0], free_block[0]};
  expect_error([&] { f.ext.add_hold(HoldKind::kLease, 2, half, std::nullopt, f.acq(), f.rel()); },
               pagedkv::Errc::kInvalidArgument);
  CHECK(f.alloc.refcount(t[0]) == 2);  // table + fill only
  CHECK(f.ext.num_holds() == 0);
  CHECK(f.ext.num_fills() == 1);
}

TEST_CASE("signals for ids ended long ago count as late, recent ones as duplicate", "[external_kv]") {
  Fixture f(4);
  const auto t = f.take(1);
  std::vector<std::uint64_t> ids;
  for (std::size_t i = 0; i < State::kEndedMemory + 10; ++i) {
    ids.push_back(f.ext.add_hold(HoldKind::kLease, 1, t, std::nullopt, f.acq(), f.rel()));
    REQUIRE(f.ext.release_hold(ids.back(), f.rel()) == ExternalSignal::kApplied);
  }
  CHECK(f.ext.release_hold(ids.front(), f.rel()) == ExternalSignal::kLate);  // forgotten
  CHECK(f.ext.release_hold(ids.back(), f.rel()) == ExternalSignal::kDuplicate);
  CHECK(f.ext.release_hold(ids[10], f.rel()) == ExternalSignal::kDuplicate);  // the oldest still remembered
  CHECK(f.ext.release_hold(ids[9], f.rel()) == ExternalSignal::kLate);
  CHECK(f.alloc.refcount(t[0]) == 1);
}

TEST_CASE("layout fingerprints: the first mismatching field is named", "[external_kv]") {
  pagedkv::KvLayoutFingerprint a;
  a.block_size = 16;
  a.page_layout = "nhd";
  a.dtype = "bf16";
  a.num_kv_heads = 8;
  a.head_dim = 128;
  a.groups.resize(2);
  a.groups[1].kind = pagedkv::AttentionKind::kSlidingWindow;
  a.groups[1].window_tokens = 4096;
  pagedkv::KvLayoutFingerprint b = a;
  CHECK_FALSE(pagedkv::first_mismatch(a, b));
  b.groups[1].window_tokens = 1024;
  CHECK(*pagedkv::first_mismatch(a, b) == "groups[1].window_tokens: 4096 vs 1024");
  b.block_size = 32;  // an earlier field wins
  CHECK(*pagedkv::first_mismatch(a, b) == "block_size: 16 vs 32");
  CHECK(expect_error([&] { pagedkv::check_same_layout(a, b); }, pagedkv::Errc::kInvalidArgument)
            .find("block_size: 16 vs 32") != std::string::npos);
  b = a;
  b.hash_algorithm = pagedkv::BlockIdentityConvention::kVllmSha256Cbor;
  CHECK(*pagedkv::first_mismatch(a, b) == "hash_algorithm: pagedkv vs vllm_sha256_cbor");
  b = a;
  b.dtype = "fp8_e4m3";
  CHECK(*pagedkv::first_mismatch(a, b) == "dtype: bf16 vs fp8_e4m3");
}

TEST_CASE("importable tokens: the last prompt token is recomputed, the local hit is not transferred",
          "[external_kv]") {
  CHECK(pagedkv::importable_tokens(64, 64, 0) == 63);
  CHECK(pagedkv::importable_tokens(64, 65, 0) == 64);
  CHECK(pagedkv::importable_tokens(64, 65, 32) == 32);
  CHECK(pagedkv::importable_tokens(40, 100, 48) == 0);
  CHECK(pagedkv::importable_tokens(10, 0, 0) == 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Model-based: random operations against a plain model.

struct ModelHold {
  HoldKind kind;
  std::vector<std::uint32_t> blocks;
  std::optional<long> deadline;
  std::uint64_t fill_id = 0;
};

TEST_CASE("model-based: fills, completions, aborts, leases, pins, signals in any order", "[external_kv][model]") {
  for (std::uint32_t seed = 1; seed <= 40; ++seed) {
    CAPTURE(seed);
    std::mt19937_64 rng(seed);
    auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
    const std::size_t num_blocks = 8 + pick(40);
    Fixture f(num_blocks);
    std::map<SeqId, std::vector<std::uint32_t>> seqs;  // live sequences' tables
    std::map<std::uint64_t, std::pair<SeqId, std::vector<std::uint32_t>>> fills;
    std::map<std::uint64_t, ModelHold> holds;
    std::map<std::uint64_t, bool> ended;  // id -> ended by its own signal (else aborted / expired)
    std::vector<std::uint32_t> ext_refs(num_blocks, 0), gen(num_blocks, 0);
    std::vector<std::pair<std::uint32_t, std::uint32_t>> seen;  // (block, generation) references handed out
    std::uint64_t issued = 0;
    SeqId next_seq = 1;
    long now = 0;
    std::uint64_t late = 0, dup = 0, unknown = 0;

    auto ext_take = [&](const std::vector<std::uint32_t>& bs) {
      for (auto b : bs) {
        ++ext_refs[b];
        seen.emplace_back(b, gen[b]);
      }
    };
    auto ext_drop = [&](const std::vector<std::uint32_t>& bs) {
      for (auto b : bs) {
        if (--ext_refs[b] == 0) ++gen[b];
      }
    };
    auto end_hold = [&](std::uint64_t id, bool signalled) {
      ext_drop(holds[id].blocks);
      if (holds[id].kind == HoldKind::kOrphan) ended[holds[id].fill_id] = false;
      holds.erase(id);
      ended[id] = signalled;
    };
    auto expect_ended = [&](std::uint64_t id) {
      if (id == 0 || id > issued) {
        ++unknown;
        return ExternalSignal::kUnknown;
      }
      if (ended.contains(id) && ended[id]) {
        ++dup;
        return ExternalSignal::kDuplicate;
      }
      ++late;
      return ExternalSignal::kLate;
    };
    auto random_id = [&]() -> std::uint64_t {
      const std::size_t k = pick(10);
      if (k == 0) return issued + 1 + pick(5);  // never issued
      if (k == 1) return 0;
      return issued == 0 ? 1 : 1 + pick(issued);
    };

    for (int step = 0; step < 400; ++step) {
      const std::size_t op = pick(9);
      if (op == 0 || seqs.empty()) {  // admit a sequence, maybe with an external fill over a suffix of its blocks
        const std::size_t n = 1 + pick(4);
        if (f.alloc.num_available_blocks() < n) continue;
        const SeqId s = next_seq++;
        seqs[s] = f.take(n);
        if (pick(3) != 0) {
          const std::size_t first = pick(n);
          std::vector<std::uint32_t> bs(seqs[s].begin() + static_cast<long>(first), seqs[s].end());
          const auto id = f.ext.begin_fill(s, 1, first, first * 16, n * 16, bs, f.acq(), f.rel());
          REQUIRE(id == ++issued);
          fills[id] = {s, bs};
          ext_take(bs);
        }
      } else if (op == 1) {  // a fill signal: complete with a partial failure, or fail, for any id
        const std::uint64_t id = fills.empty() || pick(3) == 0 ? random_id()
                                                              : std::next(fills.begin(), pick(fills.size()))->first;
        ExternalSignal want;
        if (fills.contains(id)) {
          want = ExternalSignal::kApplied;
        } else {
          std::uint64_t orphan = 0;
          for (auto& [hid, h] : holds) {
            if (h.kind == HoldKind::kOrphan && h.fill_id == id) orphan = hid;
          }
          if (orphan != 0) {
            ++late;
            want = ExternalSignal::kLate;
            end_hold(orphan, true);
            ended[id] = false;
          } else {
            want = expect_ended(id);
          }
        }
        const auto got = f.ext.take_fill(id, f.rel());
        REQUIRE(got.status == want);
        if (want == ExternalSignal::kApplied) {
          REQUIRE(got.fill);
          REQUIRE(got.fill->blocks == fills[id].second);
          ext_drop(fills[id].second);
          const SeqId s = fills[id].first;
          const std::size_t valid = pick(fills[id].second.size() + 1);
          const bool fail_policy = pick(2) == 0;
          f.ext.count_completion(valid, valid < fills[id].second.size(), fail_policy && valid < fills[id].second.size());
          if (fail_policy && valid < fills[id].second.size()) {  // kFail: the sequence goes with its blocks
            f.free_table(seqs[s]);
            seqs.erase(s);
          }
          fills.erase(id);
          ended[id] = true;
        }
      } else if (op == 2) {  // free / abort a sequence at any state
        const SeqId s = std::next(seqs.begin(), pick(seqs.size()))->first;
        const bool quiescent = pick(2) == 0;
        std::uint64_t fid = 0;
        for (auto& [id, fl] : fills) {
          if (fl.first == s) fid = id;
        }
        f.free_table(seqs[s]);
        const std::optional<long> dl = pick(3) == 0 ? std::nullopt : std::optional<long>(now + 1 + long(pick(20)));
        const auto got = f.ext.abort_fill(s, quiescent, dl ? std::optional(at(*dl)) : std::nullopt, f.rel());
        REQUIRE(got == fid);
        if (fid != 0) {
          if (quiescent) {
            ext_drop(fills[fid].second);
            ended[fid] = false;
          } else {
            holds[++issued] = {HoldKind::kOrphan, fills[fid].second, dl, fid};
          }
          fills.erase(fid);
        }
        seqs.erase(s);
      } else if (op == 3) {  // finish with a lease, or pin for a save, a sequence that waits for nothing
        const SeqId s = std::next(seqs.begin(), pick(seqs.size()))->first;
        if (f.ext.fill_of(s) != 0) continue;
        const HoldKind kind = pick(2) == 0 ? HoldKind::kLease : HoldKind::kSavePin;
        const std::optional<long> dl = pick(4) == 0 ? std::nullopt : std::optional<long>(now + 1 + long(pick(20)));
        const auto id =
            f.ext.add_hold(kind, s, seqs[s], dl ? std::optional(at(*dl)) : std::nullopt, f.acq(), f.rel());
        REQUIRE(id == ++issued);
        holds[id] = {kind, seqs[s], dl, 0};
        ext_take(seqs[s]);
        if (kind == HoldKind::kLease || pick(2) == 0) {  // a lease ends the sequence; a save may outlive a preemption
          f.free_table(seqs[s]);
          seqs.erase(s);
        }
      } else if (op == 4) {  // release a hold (read-done, save done), any id
        const std::uint64_t id = holds.empty() || pick(3) == 0 ? random_id()
                                                              : std::next(holds.begin(), pick(holds.size()))->first;
        ExternalSignal want;
        if (holds.contains(id)) {
          if (holds[id].kind == HoldKind::kOrphan) {
            ++unknown;
            want = ExternalSignal::kUnknown;
          } else {
            want = ExternalSignal::kApplied;
            end_hold(id, true);
          }
        } else if (fills.contains(id)) {
          want = expect_ended(id);  // a fill id is no hold: counted as late (issued, not a live hold)
        } else {
          want = expect_ended(id);
        }
        REQUIRE(f.ext.release_hold(id, f.rel()) == want);
      } else if (op == 5) {  // heartbeat
        const std::uint64_t id = holds.empty() || pick(3) == 0 ? random_id()
                                                              : std::next(holds.begin(), pick(holds.size()))->first;
        const long dl = now + 1 + long(pick(20));
        ExternalSignal want;
        if (holds.contains(id) && holds[id].kind != HoldKind::kOrphan) {
          want = ExternalSignal::kApplied;
          holds[id].deadline = dl;
        } else if (holds.contains(id)) {
          ++unknown;
          want = ExternalSignal::kUnknown;
        } else {
          want = expect_ended(id);
        }
        REQUIRE(f.ext.extend(id, at(dl)) == want);
      } else if (op == 6) {  // time passes
        now += long(pick(8));
        std::size_t want = 0;
        for (auto it = holds.begin(); it != holds.end();) {
          const auto next = std::next(it);
          if (it->second.deadline && *it->second.deadline <= now) {
            end_hold(it->first, false);
            ++want;
          }
          it = next;
        }
        REQUIRE(f.ext.reap(at(now), f.rel()) == want);
      } else if (op == 7) {  // pressure: allocate everything available; never a block with external references
        std::vector<std::uint32_t> all(f.alloc.num_available_blocks());
        REQUIRE(f.alloc.try_allocate(std::span<std::uint32_t>(all)));
        for (auto b : all) REQUIRE(ext_refs[b] == 0);
        f.free_table(all);
      } else {  // a transfer checks a reference it holds
        if (seen.empty()) continue;
        const auto [b, g] = seen[pick(seen.size())];
        REQUIRE(f.ext.is_current(b, g) == (ext_refs[b] > 0 && gen[b] == g));
      }

      // Invariants: refcount = tables + external references; the state's view agrees with the model.
      std::vector<std::uint32_t> want_ref(num_blocks, 0);
      for (auto& [s, t] : seqs) {
        for (auto b : t) ++want_ref[b];
      }
      std::size_t held = 0;
      for (std::uint32_t b = 1; b < num_blocks; ++b) {
        REQUIRE(f.alloc.refcount(b) == want_ref[b] + ext_refs[b]);
        REQUIRE(f.ext.references(b) == ext_refs[b]);
        REQUIRE(f.ext.generation(b) == gen[b]);
        held += ext_refs[b] != 0;
      }
      const auto c = f.ext.counters();
      REQUIRE(c.blocks_held == held);
      REQUIRE(c.fills_in_flight == fills.size());
      REQUIRE(c.holds_active == holds.size());
      REQUIRE(c.late_signals == late);
      REQUIRE(c.duplicate_signals == dup);
      REQUIRE(c.unknown_signals == unknown);
    }

    // Quiescence: free everything, end every hold; nothing leaked, every refcount back to 0.
    for (auto& [s, t] : seqs) {
      f.free_table(t);
      f.ext.abort_fill(s, true, std::nullopt, f.rel());
    }
    for (auto& [id, h] : holds) {
      if (h.kind == HoldKind::kOrphan) {
        CHECK(f.ext.take_fill(h.fill_id, f.rel()).status == ExternalSignal::kLate);
      } else {
        CHECK(f.ext.release_hold(id, f.rel()) == ExternalSignal::kApplied);
      }
    }
    CHECK(f.ext.empty());
    CHECK(f.alloc.num_used_blocks() == 0);
    CHECK(f.ext.counters().blocks_held == 0);
    for (std::uint32_t b = 1; b < num_blocks; ++b) CHECK(f.ext.references(b) == 0);
  }
}

}  // namespace
