// tests/fuzz/make_group_seeds.cpp: writes the KV-cache-group fuzzer's seed corpus
// (tests/fuzz/corpus/manager_groups/*.bin), one file per scenario below, in the layout of manager_groups_ops.hpp:
// short engine stories over mixed groups, the host tier and lookahead that the fuzzer mutates from.
// Usage: make_group_seeds <output directory>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "byte_reader.hpp"
#include "manager_groups_ops.hpp"

#include "seed_writer.hpp"

namespace {

using pagedkv_fuzz::ByteWriter;
using pagedkv_fuzz::GOp;

// Config flags: block size selectors, offload policies, events, no host tier.
constexpr std::uint8_t kBs1 = 0, kBs4 = 1, kBs16 = 2;
constexpr std::uint8_t kWriteBack = 0x10, kWriteThrough = 0x20, kEvents = 0x40, kNoHost = 0x80, kCachingOff = 0x0C;
constexpr std::uint8_t kSlru = 0x80;  // in the host byte
// Group kinds (the window byte: < 200 tokens 1 + w % (3 * bs + 5); >= 200 whole blocks).
constexpr std::uint8_t kFull = 0, kSliding = 1, kChunked = 2;
constexpr std::uint8_t kBlocks1 = 200, kBlocks2 = 201;
// A full group's window byte, after group 0 and without a host tier: coarse pages of 2 or 4 blocks.
constexpr std::uint8_t kPages2 = 224, kPages4 = 225;
constexpr std::uint8_t kNoReserve = 200;

/// An id as a `pick` argument (>= 224: the id itself).
constexpr std::uint8_t id(std::uint8_t i) { return static_cast<std::uint8_t>(224 + i); }

class GSeed {
 public:
  GSeed(std::uint8_t flags, std::uint8_t pool, std::uint8_t host, std::initializer_list<std::pair<std::uint8_t, std::uint8_t>> groups) {
    w_.u8(flags).u8(pool).u8(host).u8(3).u8(static_cast<std::uint8_t>(groups.size()));
    for (const auto& [k, win] : groups) w_.u8(k).u8(win);
  }
  GSeed& op(GOp o) {
    w_.u8(static_cast<std::uint8_t>(o));
    return *this;
  }
  GSeed& raw(std::initializer_list<std::uint8_t> b) {
    for (std::uint8_t x : b) w_.u8(x);
    return *this;
  }
  /// try_admit(sid, base[0:1 + len % ...], keys, cap, reserve)
  GSeed& admit(std::uint8_t sid, std::uint8_t base, std::uint8_t len, std::uint8_t keys = 0, std::uint8_t cap = 0,
               std::uint8_t reserve = kNoReserve, bool prepared = false) {
    return op(prepared ? GOp::kAdmitPrepared : GOp::kAdmit).raw({sid, base, len, keys, cap, reserve});
  }
  GSeed& append(std::uint8_t sid, std::uint8_t n, std::uint8_t mode = 0) { return op(GOp::kAppend).raw({id(sid), n, mode}); }
  GSeed& reserve(std::uint8_t sid, std::uint8_t n) { return op(GOp::kReserve).raw({id(sid), n}); }
  GSeed& lookahead(std::uint8_t sid, std::uint8_t k, std::uint8_t mode = 0) {
    return op(GOp::kLookahead).raw({id(sid), k, mode});
  }
  GSeed& commit(std::uint8_t sid, std::uint8_t a) { return op(GOp::kCommit).raw({id(sid), a}); }
  GSeed& fork(std::uint8_t p, std::uint8_t c) { return op(GOp::kFork).raw({id(p), c}); }
  GSeed& free(std::uint8_t sid) { return op(GOp::kFree).raw({id(sid)}); }
  GSeed& preempt(std::uint8_t sid) { return op(GOp::kPreempt).raw({id(sid)}); }
  GSeed& swap(std::uint8_t sid) { return op(GOp::kSwap).raw({id(sid)}); }
  GSeed& resume(std::uint8_t sid) { return op(GOp::kResume).raw({id(sid)}); }
  /// complete_transfers of the (b % (n + 1))-th token in flight (n: a bad token).
  GSeed& complete(std::uint8_t b = 0) { return op(GOp::kComplete).raw({b}); }
  GSeed& rewind(std::uint8_t sid, std::uint8_t b) { return op(GOp::kRewind).raw({id(sid), b}); }
  GSeed& step() { return op(GOp::kStep); }
  /// A build scheduling per busy sequence (id order) `q` (< 160: 1 + q % pending; < 240 all; else skipped).
  GSeed& sched(std::initializer_list<std::uint8_t> q, std::uint8_t shape = 0) {
    op(GOp::kBuildScheduled).raw(q);
    return raw({shape});
  }
  GSeed& lookup(std::uint8_t base, std::uint8_t len, std::uint8_t keys = 0, std::uint8_t cap = 0) {
    return op(GOp::kLookup).raw({base, len, keys, cap});
  }
  GSeed& reset() { return op(GOp::kReset); }
  GSeed& drain(std::uint8_t order = 0) { return op(GOp::kDrain).raw({order}); }
  [[nodiscard]] const std::vector<std::uint8_t>& bytes() const noexcept { return w_.bytes(); }

 private:
  ByteWriter w_;
};

std::vector<std::pair<std::string, GSeed>> seeds() {
  std::vector<std::pair<std::string, GSeed>> s;
  auto add = [&](const char* name, GSeed g) { s.emplace_back(name, std::move(g)); };
  // Regression: a sliding window of 4 (block size 1) released the blocks of the drafts' windows after a build
  // computed 3 lookahead drafts; rejecting them left the next query's window on null pages.
  add("lookahead_reject_window",
      GSeed(kBs1, 30, 10, {{kSliding, 3}}).admit(0, 0, 4).step().lookahead(0, 3).step().commit(0, 0).append(0, 1).step()
          .lookahead(0, 4).step().commit(0, 2).append(0, 1).step().drain());
  add("lookahead_mixed_groups",
      GSeed(kBs4, 40, 20, {{kFull, 0}, {kSliding, 6}, {kChunked, kBlocks2}}).admit(0, 0, 20).admit(1, 0, 22).step()
          .lookahead(0, 5).lookahead(1, 3).step().commit(0, 3).commit(1, 1).append(0, 1).append(1, 1).step()
          .lookahead(0, 2).rewind(0, 1).step().commit(0, 0).step().append(0, 2).step().drain(1));
  add("swap_resume_windowed",
      GSeed(kBs4 | kWriteBack, 30, 30, {{kFull, 0}, {kSliding, 9}}).admit(0, 0, 30).admit(1, 1, 17).step().append(0, 3)
          .append(1, 2).step().swap(0).step().complete().resume(0).step().complete().append(0, 1).step().swap(1)
          .resume(1).step().resume(1).complete().resume(1).step().complete().drain());
  add("resume_before_complete_and_bad_tokens",
      GSeed(kBs4, 24, 16, {{kSliding, 5}, {kFull, 0}}).admit(0, 2, 15).step().swap(0).resume(0).complete(0).step()
          .complete(1).resume(0).complete(0).complete(0).resume(0).step().complete(3).step().drain());
  add("host_hits_write_back",
      GSeed(kBs4 | kWriteBack | kEvents, 20, 40, {{kFull, 0}, {kSliding, 7}}).admit(0, 0, 24).step().free(0)
          .admit(1, 1, 24).step().free(1).complete().admit(2, 0, 26).step().complete().admit(3, 1, 25).step()
          .complete().lookup(0, 24).drain());
  add("write_through_and_reset",
      GSeed(kBs4 | kWriteThrough, 20, 30, {{kChunked, 7}, {kFull, 0}}).admit(0, 0, 18).step().append(0, 4).step()
          .step().reset().complete().complete().free(0).step().reset().complete().reset().admit(1, 0, 18).step()
          .drain());
  add("chunked_local_prefix_hits",
      GSeed(kBs4, 40, 0, {{kFull, 0}, {kChunked, kBlocks2}, {kSliding, 2}}).admit(0, 0, 33).step().free(0)
          .admit(1, 0, 35).step().lookup(0, 40).admit(2, 0, 33, 0, 255).step().admit(3, 0, 33, 5).step().drain());
  add("prepared_prompts",
      GSeed(kBs4 | kWriteBack, 20, 20, {{kFull, 0}, {kSliding, 3}}).admit(0, 0, 20, 0, 0, kNoReserve, true).step()
          .free(0).admit(1, 2, 30, 6, 0, kNoReserve, true).admit(1, 2, 30, 6, 0, kNoReserve, true).step().free(1)
          .admit(2, 0, 20, 0, 0, kNoReserve, true).step().complete().drain());
  add("chunked_prefill_scheduled",
      GSeed(kBs4, 30, 20, {{kSliding, 6}, {kFull, 0}, {kChunked, 10}}).admit(0, 0, 40, 0, 0, 8).admit(1, 1, 30, 0, 0, 5)
          .sched({3, 2}).reserve(0, 240).reserve(1, 7).sched({200, 1}, 1).sched({0, 230}, 2).step().append(0, 1)
          .append(1, 1).sched({250, 0}, 8).step().drain());
  add("fork_copy_on_write",
      GSeed(kBs4, 30, 20, {{kFull, 0}, {kSliding, 6}}).admit(0, 0, 10).step().fork(0, 1).fork(0, 2).append(0, 1)
          .append(1, 1, 1).append(2, 3).step().fork(1, 3).append(3, 2).append(1, 2).step().rewind(1, 2).append(1, 1)
          .step().drain());
  add("rewind_floor",
      GSeed(kBs1, 40, 0, {{kSliding, 2}, {kFull, 0}}).admit(0, 0, 12).step().append(0, 1).step().rewind(0, 128 + 6)
          .rewind(0, 1).rewind(0, 250).append(0, 2).step().drain());
  add("four_groups_bs16",
      GSeed(kBs16 | kWriteBack, 30, 30, {{kFull, 0}, {kSliding, 20}, {kChunked, kBlocks1}, {kSliding, 3}})
          .admit(0, 0, 40).admit(1, 1, 20).step().append(0, 5).append(1, 5).step().swap(1).admit(2, 0, 42).step()
          .complete().resume(1).step().complete().fork(0, 3).append(3, 3).step().drain(2));
  add("no_host_swap_refused",
      GSeed(kBs4 | kNoHost, 12, 0, {{kFull, 0}, {kSliding, 5}}).admit(0, 0, 10).swap(0).step().swap(0).resume(0)
          .preempt(0).admit(0, 0, 10).step().drain());
  add("slru_small_pools",
      GSeed(kBs4 | kWriteBack, 8, kSlru | 6, {{kSliding, 4}, {kFull, 0}}).admit(0, 0, 8).step().free(0).admit(1, 1, 8)
          .step().free(1).admit(0, 0, 8).step().admit(2, 2, 8).step().swap(0).swap(2).step().complete().resume(2)
          .resume(0).step().complete().drain());
  add("caching_off",
      GSeed(kBs4 | kCachingOff, 20, 10, {{kSliding, 5}, {kFull, 0}}).admit(0, 0, 10).step().append(0, 3).step()
          .swap(0).step().complete().resume(0).step().complete().drain());
  // Coarse pages (KVCacheGroupSpec::block_size): partial-page hits of live and freed sequences, chunked prefill
  // re-keying partial entries, fork and the copy-on-write of a shared partial page, rewind below a key, lookahead.
  add("coarse_partial_hits",
      GSeed(kBs4 | kNoHost | kEvents, 40, 0, {{kFull, 0}, {kFull, kPages2}, {kSliding, 6}})
          .admit(0, 0, 21, 0, 0, 9).step().reserve(0, 240).sched({5}).admit(1, 0, 13, 0, 0, 0).step().admit(2, 0, 17)
          .step().reserve(1, 240).step().free(0).admit(3, 0, 23).step().append(3, 3).step().lookup(0, 22).drain());
  add("coarse_fork_rewind_lookahead",
      GSeed(kBs4 | kNoHost, 48, 0, {{kFull, 0}, {kFull, kPages4}, {kChunked, kBlocks2}})
          .admit(0, 1, 25).step().fork(0, 1).append(1, 3, 1).append(0, 2).step().rewind(0, 128 + 5).append(0, 1, 1)
          .step().lookahead(1, 5).step().commit(1, 2).append(1, 1).step().preempt(0).admit(0, 1, 25).step()
          .rewind(1, 3).append(1, 4, 2).step().drain(1));
  add("coarse_bs1_and_bs16",
      GSeed(kBs1 | kNoHost, 40, 0, {{kFull, 0}, {kFull, kPages4}, {kSliding, 3}, {kFull, kPages2}})
          .admit(0, 0, 12).sched({6}).admit(1, 0, 8, 0, 0, 0).step().reserve(1, 240).append(0, 3).step().free(0)
          .admit(2, 0, 13).step().drain());
  // Regression: a hit without a reservation held a partial page another sequence was still filling; that sequence
  // re-keyed the page past the hit and left it; the first, now its sole holder, appended in place under the key.
  add("coarse_rekey_shared_page",
      GSeed(kBs4 | kNoHost, 40, 0, {{kFull, 0}, {kFull, kPages2}})
          .admit(0, 0, 15, 0, 0, 16).sched({11}).op(GOp::kAdmit).raw({1, 12, 11, 3, 3, 3, 0, 0, 0}).sched({239})
          .free(0).reserve(1, 240).step().admit(2, 0, 16).step().drain());
  add("no_capacity_then_preempt",
      GSeed(kBs4, 8, 6, {{kFull, 0}, {kSliding, 5}}).admit(0, 0, 12).admit(1, 1, 12).step().append(0, 5).preempt(0)
          .append(1, 5).step().admit(2, 3, 255).swap(1).admit(2, 3, 20).step().complete().resume(1).drain());
  return s;
}

}  // namespace

int main(int argc, char** argv) { return pagedkv_fuzz::write_seeds(argc, argv, seeds()); }
