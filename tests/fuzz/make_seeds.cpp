// tests/fuzz/make_seeds.cpp: writes the manager fuzzer's seed corpus (tests/fuzz/corpus/manager/*.bin), one file
// per scenario below, in the layout of manager_ops.hpp. Each seed is a short, readable engine story; the fuzzer
// mutates from there. Usage: make_seeds <output directory>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "byte_reader.hpp"
#include "manager_ops.hpp"

#include "seed_writer.hpp"

namespace {

using pagedkv_fuzz::ByteWriter;
using pagedkv_fuzz::Op;

// Config flags (manager_ops.hpp).
constexpr std::uint8_t kCachingOff = 0x03, kEventsOff = 0x04, kSmallIds = 0x18, kLimit = 0x20, kRetention = 0x40;
// Retention selectors (the retention manager's admissions end with one): none, [0, prompt) at 80 with decode 10,
// a one-range config with a duration (kRetOneRange | len << 3: [0, len % 40 + 1) at 90 for len + 1 us), custom
// ranges (kRetCustom, kRetCustomRaw: begins not made cumulative).
constexpr std::uint8_t kRetNone = 0, kRetSystemPrompt = 3, kRetOneRange = 4, kRetCustom = 5, kRetCustomRaw = 13;
// Block-size selectors: kBlockSizes = {1, 2, 3, 4, 8, 16, 5, 32}.
constexpr std::uint8_t kBs1 = 0, kBs2 = 1, kBs3 = 2, kBs4 = 3, kBs8 = 4, kBs16 = 5, kBs5 = 6, kBs32 = 7;
// Keys selectors.
constexpr std::uint8_t kNoKeys = 0, kSalt = 4, kAdapter = 5, kImage = 6, kCustom = 7;
constexpr std::uint8_t kNoCap = 0;
// Append-token modes.
constexpr std::uint8_t kContinue = 0, kConstant = 2;

class Seed {
 public:
  Seed(std::uint8_t flags, std::uint8_t block, std::uint8_t pool, std::uint16_t limit = 0) {
    w_.u8(flags).u8(block).u8(pool);
    if (flags & kLimit) w_.u16(limit);
    w_.u8(7);  // hash seed
  }
  Seed& op(Op o) {
    w_.u8(static_cast<std::uint8_t>(o));
    return *this;
  }
  /// try_admit(id, base[0:len] + extra, keys, cap)
  Seed& admit(std::uint8_t id, std::uint8_t base, std::uint8_t len, std::initializer_list<std::uint8_t> extra = {},
              std::uint8_t keys = kNoKeys, std::uint8_t cap = kNoCap) {
    op(Op::kAdmit).w_.u8(id).u8(static_cast<std::uint8_t>((extra.size() << 2) | base)).u8(len);
    for (std::uint8_t t : extra) w_.u8(t);
    w_.u8(keys).u8(cap);
    return *this;
  }
  /// try_admit(id, <raw bytes>) with custom keys given as bytes (after the kCustom selector).
  Seed& admit_raw(std::uint8_t id, std::initializer_list<std::uint8_t> tokens, std::initializer_list<std::uint8_t> keys,
                  std::uint8_t cap = kNoCap) {
    op(Op::kAdmit).w_.u8(id).u8(static_cast<std::uint8_t>(0x80 | tokens.size()));
    for (std::uint8_t t : tokens) w_.u8(t);
    for (std::uint8_t k : keys) w_.u8(k);
    w_.u8(cap);
    return *this;
  }
  /// try_admit(id, <length> tokens of a repeating pattern)
  Seed& admit_long(std::uint8_t id, std::uint16_t length) {
    op(Op::kAdmit).w_.u8(id).u8(0xC1).u16(length).u8(kNoKeys).u8(kNoCap);
    return *this;
  }
  Seed& append(std::uint8_t id, std::uint8_t n, std::uint8_t mode = kContinue) {
    op(Op::kAppend).w_.u8(id).u8(n).u8(mode);
    return *this;
  }
  Seed& fork(std::uint8_t parent, std::uint8_t child) {
    op(Op::kFork).w_.u8(parent).u8(child);
    return *this;
  }
  Seed& free(std::uint8_t id) {
    op(Op::kFree).w_.u8(id);
    return *this;
  }
  Seed& preempt(std::uint8_t id) {
    op(Op::kPreempt).w_.u8(id);
    return *this;
  }
  Seed& rewind(std::uint8_t id, std::uint8_t b) {
    op(Op::kRewind).w_.u8(id).u8(b);
    return *this;
  }
  Seed& lookup(std::uint8_t base, std::uint8_t len, std::uint8_t keys = kNoKeys, std::uint8_t cap = kNoCap) {
    op(Op::kLookup).w_.u8(base).u8(len).u8(keys).u8(cap);
    return *this;
  }
  Seed& step() { return op(Op::kStep); }
  /// build_batch_metadata(all live, buffers with `omit` / `pad` / `fault` as in manager_ops.hpp)
  Seed& build(std::uint8_t mode, std::initializer_list<std::uint8_t> mode_args, std::uint8_t omit, std::uint8_t pad,
              std::uint8_t fault) {
    op(Op::kBuild).w_.u8(mode);
    for (std::uint8_t a : mode_args) w_.u8(a);
    w_.u8(omit).u8(pad).u8(fault);
    return *this;
  }
  /// try_admit(id, base[0:len], {num_reserved_tokens: reserve byte (>= 224: all)})
  Seed& admit_chunked(std::uint8_t id, std::uint8_t base, std::uint8_t len, std::uint8_t reserve,
                      std::uint8_t keys = kNoKeys, std::uint8_t cap = kNoCap) {
    op(Op::kAdmitChunked).w_.u8(id).u8(base).u8(len).u8(keys).u8(cap).u8(reserve);
    return *this;
  }
  /// p = prepare_prompt(base[0:len]); query_admit(p); try_admit(id, p) (tamper >= 250: p from another manager)
  Seed& admit_prepared(std::uint8_t id, std::uint8_t base, std::uint8_t len, std::uint8_t tamper = 0) {
    op(Op::kAdmitPrepared).w_.u8(id).u8(base).u8(len).u8(kNoKeys).u8(kNoCap).u8(0xFF).u8(tamper);
    return *this;
  }
  Seed& reserve(std::uint8_t id, std::uint8_t n) {
    op(Op::kReserve).w_.u8(id).u8(n);
    return *this;
  }
  Seed& lookahead(std::uint8_t id, std::uint8_t k, std::uint8_t mode = kContinue) {
    op(Op::kReserveLookahead).w_.u8(id).u8(k).u8(mode);
    return *this;
  }
  Seed& commit(std::uint8_t id, std::uint8_t accepted) {
    op(Op::kCommitLookahead).w_.u8(id).u8(accepted);
    return *this;
  }
  Seed& query_admit(std::uint8_t base, std::uint8_t len, std::uint8_t reserve = 0xFF) {
    op(Op::kQueryAdmit).w_.u8(base).u8(len).u8(kNoKeys).u8(kNoCap).u8(reserve);
    return *this;
  }
  Seed& query_append(std::uint8_t id, std::uint8_t n) {
    op(Op::kQueryAppend).w_.u8(id).u8(n);
    return *this;
  }
  /// build_batch_metadata(all live, exact buffers, num_scheduled_tokens from one byte per live sequence)
  Seed& step_scheduled(std::initializer_list<std::uint8_t> per_seq, std::uint8_t fault = 0) {
    op(Op::kBuildScheduled);
    for (std::uint8_t q : per_seq) w_.u8(q);
    w_.u8(fault);
    return *this;
  }
  Seed& take_events() { return op(Op::kTakeEventBatch); }
  Seed& take_stats() { return op(Op::kTakePrefixStats); }
  Seed& reset() { return op(Op::kReset); }
  Seed& query(std::uint8_t id) {
    op(Op::kQuery).w_.u8(id);
    return *this;
  }
  Seed& move() { return op(Op::kMove); }
  /// Raw argument bytes (the retention argument that ends an admission on the retention manager).
  Seed& raw(std::initializer_list<std::uint8_t> bytes) {
    for (std::uint8_t b : bytes) w_.u8(b);
    return *this;
  }
  /// expire_retention: the clock advances by b * b us (b < 224) or goes back by b - 223 us.
  Seed& expire(std::uint8_t b) {
    op(Op::kExpireRetention).w_.u8(b);
    return *this;
  }
  Seed& drain() { return op(Op::kDrainAll); }
  // External KV (manager_ops.hpp): slot s is sequence 1000 + s; len byte b gives 2 + b % 120 tokens.
  Seed& ext_admit(std::uint8_t slot, std::uint8_t base, std::uint8_t len, std::uint8_t ext, std::uint8_t headroom = 0) {
    op(Op::kExtAdmit).w_.u8(slot).u8(base).u8(len).u8(ext).u8(headroom);
    return *this;
  }
  /// complete_external_fill(id, mode: 0 all valid, 1 k valid, 3 kFail with k valid)
  Seed& ext_complete(std::uint8_t id, std::uint8_t mode, std::uint8_t k = 0) {
    op(Op::kExtComplete).w_.u8(id).u8(mode).u8(k);
    return *this;
  }
  /// complete_external_fill(id, failed block indices)
  Seed& ext_complete_failed(std::uint8_t id, std::initializer_list<std::uint8_t> failed) {
    op(Op::kExtComplete).w_.u8(id).u8(2).u8(0).u8(static_cast<std::uint8_t>(failed.size()));
    for (std::uint8_t f : failed) w_.u8(f);
    return *this;
  }
  /// mode: 0 abort quiescent, 1 abort not quiescent, 2 free, 3 preempt
  Seed& ext_abort(std::uint8_t slot, std::uint8_t mode) {
    op(Op::kExtAbort).w_.u8(slot).u8(mode);
    return *this;
  }
  Seed& ext_lease(std::uint8_t live_index, std::uint8_t deadline) {
    op(Op::kExtLease).w_.u8(live_index).u8(deadline);
    return *this;
  }
  Seed& ext_pin(std::uint8_t live_index, std::uint8_t deadline) {
    op(Op::kExtPinSave).w_.u8(live_index).u8(deadline);
    return *this;
  }
  /// mode: 0 release_lease, 1 end_save, 2 extend_lease (to now + deadline s)
  Seed& ext_signal(std::uint8_t id, std::uint8_t mode, std::uint8_t deadline = 0) {
    op(Op::kExtSignal).w_.u8(id).u8(mode);
    if (mode == 2) w_.u8(deadline);
    return *this;
  }
  Seed& ext_reap(std::uint8_t b) {
    op(Op::kExtReap).w_.u8(b);
    return *this;
  }
  /// evict_cached_block(1 + b % usable) (b < 250; 250: block 0; above: out of range)
  Seed& evict(std::uint8_t b) {
    op(Op::kEvictBlock).w_.u8(b);
    return *this;
  }
  Seed& ext_stale(std::uint8_t b) {
    op(Op::kExtStale).w_.u8(b);
    return *this;
  }
  [[nodiscard]] const std::vector<std::uint8_t>& bytes() const { return w_.bytes(); }

 private:
  ByteWriter w_;
};

std::vector<std::pair<std::string, Seed>> seeds() {
  std::vector<std::pair<std::string, Seed>> s;
  const auto add = [&](const char* name, Seed seed) { s.emplace_back(name, std::move(seed)); };

  add("decode_loop", Seed(0, kBs4, 32).admit(1, 0, 10).step().append(1, 1).step().append(1, 1).step().append(1, 5).step().free(1));
  add("prefix_hit_after_free", Seed(0, kBs4, 32).admit(1, 0, 40).step().free(1).admit(2, 0, 45).step().lookup(0, 60).free(2));
  add("same_step_duplicates_dedup", Seed(0, kBs4, 32).admit(1, 1, 21).admit(2, 1, 21).step().admit(3, 1, 30).step().drain());
  add("fork_copy_on_write", Seed(0, kBs4, 32).admit(1, 2, 10).step().fork(1, 2).append(1, 1).append(2, 1).step().append(2, 3).step());
  add("beam_prune_before_build", Seed(0, kBs4, 32).admit(1, 2, 10).step().fork(1, 2).fork(1, 3).append(2, 1).append(3, 1).free(1).append(2, 1).step());
  // Issue 12's manager defects, fixed in f30acb2; found again if they come back.
  // 1: admit A, build, fork A->S, append A (copy), rewind A 1, fork A->C (rejected now), append C, build.
  add("issue12_copy_chain_in_one_build", Seed(0, kBs4, 32).admit(1, 0, 6).step().fork(1, 2).append(1, 1).rewind(1, 1).fork(1, 3).append(3, 1).step());
  // 2: items wrapping past 2^64 (rejected now) with different images at the same place.
  add("issue12_item_wraps_past_2p64",
      Seed(0, kBs4, 32)
          .admit_raw(1, {1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3}, {kCustom, 0, 0, 1, 0, 5, 240})
          .step()
          .admit_raw(2, {1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 0}, {kCustom, 0, 0, 1, 1, 5, 240})
          .step());
  // 3: an append larger than the whole pool (kNeverFits now).
  add("issue12_append_never_fits", Seed(0, kBs4, 8).admit(1, 0, 5).step().append(1, 250).append(1, 1).step());
  // 5: fork with unbuilt slots; a build dropping its slot mapping or its copies (all rejected now).
  add("issue12_fork_with_unbuilt_slots", Seed(0, kBs4, 32).admit(1, 0, 9).fork(1, 2).step());
  add("issue12_build_without_slot_mapping", Seed(0, kBs4, 32).admit(1, 0, 9).build(0, {}, 0x40, 0, 0).step());
  add("issue12_build_without_copies", Seed(0, kBs4, 32).admit(1, 0, 9).step().fork(1, 2).append(2, 1).build(0, {}, 0x80, 0, 0).step());
  add("eviction_small_pool", Seed(0, kBs4, 6).admit(1, 0, 12).step().free(1).admit(2, 1, 12).step().free(2).admit(3, 0, 12).step().admit(4, 2, 12).step());
  add("no_capacity_then_preempt", Seed(0, kBs4, 8).admit(1, 0, 12).admit(2, 1, 12).step().append(1, 5).preempt(2).append(1, 5).step());
  add("rewind_into_cached_block", Seed(0, kBs4, 32).admit(1, 0, 16).step().rewind(1, 2).append(1, 3, kConstant).step().rewind(1, 7).append(1, 1).step());
  add("speculative_rewind_pending", Seed(0, kBs2, 32).admit(1, 0, 5).step().append(1, 4).rewind(1, 131).append(1, 2).step());
  add("misuse_unknown_and_duplicate",
      Seed(0, kBs4, 16).append(3, 1).free(3).preempt(12).rewind(13, 0).fork(14, 1).query(15).admit(1, 0, 4).admit(1, 0, 4).fork(1, 1).rewind(1, 255).step());
  add("per_sequence_limit", Seed(kLimit, kBs4, 32, 20).admit(1, 0, 18).step().append(1, 5).admit_long(2, 30).append(1, 2).step());
  add("never_fits_prompt", Seed(0, kBs8, 5).admit_long(1, 40).admit_long(2, 33).admit_long(3, 32).step());
  // evict_cached_block (vLLM's evict_blocks after a failed load): a block held by two tables leaves the index and
  // stays in both, unmatchable, until freed; then a cached block becomes free; ids 0 and past the pool throw.
  add("evict_held_then_cached_block",
      Seed(0, kBs4, 16).admit(1, 0, 12).step().fork(1, 2).evict(0).append(1, 1).step().free(1).free(2).admit(3, 0, 12)
          .step().evict(1).evict(1).evict(250).evict(255).lookup(0, 12).drain());
  add("empty_prompt", Seed(0, kBs4, 8).admit_raw(1, {}, {kNoKeys}).step());
  add("build_faults",
      Seed(0, kBs4, 32).admit(1, 0, 9).step().fork(1, 2).build(0, {}, 0, 1, 200).build(0, {}, 0, 0, 201).build(0, {}, 0, 0, 206).build(0, {}, 0, 0, 208).build(0, {}, 0, 0, 209).build(0, {}, 0, 0, 210).build(6, {0, 9}, 0, 0, 0).build(7, {0}, 0, 0, 0).step());
  add("build_subset_and_padding", Seed(0, kBs4, 32).admit(1, 0, 9).admit(2, 1, 5).build(4, {1}, 0, 3, 0).append(1, 2).build(13, {2}, 0x25, 2, 0).step());
  add("reset_prefix_cache", Seed(0, kBs4, 16).admit(1, 0, 12).step().reset().free(1).reset().admit(2, 0, 12).step());
  add("salts_and_adapters", Seed(0, kBs4, 32).admit(1, 0, 12, {}, kSalt).step().admit(2, 0, 12, {}, kSalt | 8).admit(3, 0, 12, {}, kAdapter).admit(4, 0, 12).step());
  add("images_same_place",
      Seed(0, kBs4, 32).admit(1, 0, 12, {}, kImage).step().admit(2, 0, 12, {}, kImage | 0x60).admit(3, 0, 12, {}, kImage).step());
  add("invalid_items",
      Seed(0, kBs4, 32).admit_raw(1, {1, 2, 3, 1, 2}, {kCustom, 1, 1, 0, 2, 0, 2, 3, 1, 0, 30, 1}).admit_raw(2, {1, 2, 3}, {kCustom, 0, 0, 1, 0, 4, 0}).step());
  add("cap_full_hit", Seed(0, kBs4, 32).admit(1, 0, 16).step().free(1).admit(2, 0, 16, {}, kNoKeys, 255).step().admit(3, 0, 16, {}, kNoKeys, 192).step());
  add("block_size_1", Seed(0, kBs1, 40).admit(1, 0, 10).step().fork(1, 2).append(2, 3).append(1, 3).step().rewind(2, 4).step());
  add("block_size_3_odd", Seed(0, kBs3, 24).admit(1, 3, 10).step().fork(1, 2).append(1, 2).append(2, 2).step().free(1).step());
  add("block_size_32", Seed(0, kBs32, 10).admit(1, 0, 100).step().append(1, 40).step().fork(1, 2).append(2, 1).step());
  add("block_size_5_siblings", Seed(0, kBs5, 30).admit(1, 0, 7).step().fork(1, 2).append(1, 8, 3).append(2, 8, 3).step());
  add("caching_off", Seed(kCachingOff, kBs4, 16).admit(1, 0, 12).step().free(1).admit(2, 0, 12).step().fork(2, 3).append(3, 1).step());
  add("sha256_uint16_ids", Seed(kSmallIds, kBs16, 64).admit(1, 0, 100).step().free(1).admit(2, 0, 120).step().lookup(0, 150));
  add("events_off", Seed(kEventsOff, kBs4, 16).admit(1, 0, 12).step().free(1).admit(2, 1, 40).step());
  add("move_manager", Seed(0, kBs4, 16).admit(1, 0, 9).step().fork(1, 2).move().append(2, 1).step().move().drain());
  add("invalid_config_block_size_0", Seed(0, 0xFF, 16));
  add("invalid_config_one_block", Seed(0, kBs4, 1));
  add("int32_limits_config", Seed(kLimit, kBs4, 0xFD, 5));
  // Chunked prefill: admit reserving 5 tokens, build chunks of 3, reserve the rest chunk by chunk.
  add("chunked_prefill",
      Seed(0, kBs4, 32).admit_chunked(1, 0, 30, 5).step_scheduled({3}).step().reserve(1, 8).step_scheduled({5}).reserve(1, 200)
          .reserve(1, 130).step().append(1, 1).step());
  add("chunked_prefill_misuse",
      Seed(0, kBs4, 32).admit_chunked(1, 0, 30, 4).append(1, 1).lookahead(1, 2).fork(1, 2).reserve(1, 60).step_scheduled({255})
          .step_scheduled({1}, 250).step());
  add("chunked_prefill_hits", Seed(0, kBs4, 32).admit(1, 0, 40).step().admit_chunked(2, 0, 44, 0).step().reserve(2, 4).step());
  // Speculative decoding: 3 drafts, verification step, 1 accepted; then all rejected; rewind through lookahead.
  add("lookahead_accept_reject",
      Seed(0, kBs4, 32).admit(1, 0, 7).step().lookahead(1, 3).step().commit(1, 1).append(1, 1).lookahead(1, 4).step()
          .commit(1, 0).lookahead(1, 2).rewind(1, 3).step());
  add("lookahead_fills_blocks",
      Seed(0, kBs2, 32).admit(1, 0, 3).step().lookahead(1, 5).step_scheduled({2}).commit(1, 5).step().lookahead(1, 8).commit(1, 9)
          .admit(2, 0, 3).step().lookahead(2, 5, 3).step().commit(2, 5).step());
  add("prepared_prompts",
      Seed(0, kBs4, 10).admit(1, 0, 20).step().admit_prepared(2, 0, 30).admit_prepared(3, 0, 12).free(1).admit_prepared(3, 0, 12)
          .admit_prepared(4, 1, 9, 250).admit_prepared(4, 1, 9, 251).admit_prepared(4, 1, 9).step());
  add("capacity_queries",
      Seed(0, kBs4, 8).admit(1, 0, 12).step().query_admit(0, 12).query_admit(1, 30).query_admit(2, 12, 4).query_append(1, 9)
          .query_append(1, 250).query_append(5, 1));
  add("events_batches_and_stats",
      Seed(0, kBs4, 12).admit(1, 0, 16).step().take_events().preempt(1).admit(1, 0, 16).step().take_events().take_stats()
          .admit(2, 1, 30).take_events().take_events().free(1).free(2).reset().take_events().take_stats());
  // Retention priorities (the PriorityLruEviction manager): the low-priority blocks go first; expiry; bad configs.
  add("retention_low_priority_evicted_first",
      Seed(kRetention, kBs4, 6).admit(1, 0, 8).raw({kRetSystemPrompt}).step().free(1).admit(2, 1, 8).raw({kRetNone})
          .step().free(2).admit(3, 2, 12).raw({kRetNone}).step().lookup(0, 8).lookup(1, 8).free(3).admit(4, 0, 9)
          .raw({kRetNone}).step().drain());
  add("retention_expiry_clock",
      Seed(kRetention, kBs4, 6).admit(1, 0, 8).raw({kRetOneRange | (2 << 3)}).step().append(1, 5).step().free(1)
          .expire(1).expire(230).expire(2).expire(3).admit(2, 1, 16).raw({kRetNone}).step().lookup(0, 8).drain());
  add("retention_invalid_configs",
      Seed(kRetention, kBs4, 16)
          .admit(1, 0, 12).raw({kRetCustom, 2, 0, 4, 50, 0, 0, 4, 60, 10, 10, 0})   // valid: [0,4) 50, [4,8) 60 10us
          .admit(2, 0, 12).raw({kRetCustom, 1, 0, 4, 200, 0, 10, 0})               // priority 200
          .admit(2, 0, 12).raw({kRetCustomRaw, 2, 5, 4, 50, 0, 1, 4, 60, 0, 10, 0})  // unsorted, overlapping
          .admit(2, 0, 12).raw({kRetCustom, 1, 2, 0, 50, 0, 10, 0})                // empty range
          .admit(2, 0, 12).raw({kRetCustom, 1, 0, 4, 50, 255, 10, 0})              // zero duration
          .admit(2, 0, 12).raw({kRetCustom, 2, 0, 0xFF, 50, 0, 0, 4, 60, 0, 10, 0})  // an open range, then another
          .admit(2, 0, 12).raw({kRetCustom, 0, 250, 0})                            // decode priority 250
          .admit(2, 0, 12).raw({kRetCustom, 0, 10, 255})                           // zero decode duration
          .step().free(1).expire(4).admit(2, 0, 12).raw({kRetNone}).step().drain());
  add("retention_fork_rewind_preempt",
      Seed(kRetention, kBs4, 12).admit(1, 0, 9).raw({kRetSystemPrompt}).step().append(1, 4).step().fork(1, 2)
          .append(2, 1).rewind(1, 4).step().preempt(2).expire(5).admit(2, 0, 14).raw({kRetOneRange | (7 << 3)}).step()
          .move().free(1).expire(200).admit(3, 1, 30).raw({kRetNone}).step().drain());
  add("expire_retention_without_priorities", Seed(0, kBs4, 8).admit(1, 0, 8).step().free(1).expire(9).expire(240).step());
  // External KV (issue 33). Ids: fills and holds share one counter from 1.
  add("ext_pd_handoff_and_hit",  // lease (1) on a computed prompt, a fill (2) of the same prefix, completion, release
      Seed(0, kBs4, 32).admit(1, 0, 18).step().ext_lease(0, 100).ext_admit(0, 0, 18, 20).ext_complete(2, 0).step()
          .ext_stale(0).ext_signal(1, 0).ext_stale(0).ext_signal(1, 0).ext_admit(1, 0, 30, 40).ext_complete(3, 1, 2)
          .step().drain());
  add("ext_abort_orphan_late_duplicate_unknown",  // vllm#46283 / #46304: abort while filling, late, duplicate, unknown
      Seed(0, kBs4, 12).ext_reap(1).ext_admit(0, 1, 20, 30).ext_abort(0, 1).ext_admit(1, 1, 20, 30).ext_complete(1, 0)
          .ext_complete(1, 0).ext_complete(3, 0).ext_complete(3, 0).ext_complete(9, 0).ext_admit(2, 2, 30, 30)
          .ext_abort(2, 2).ext_reap(200).ext_reap(200).ext_reap(200).ext_complete(4, 0).drain());
  add("ext_partial_failures",  // recompute keeps the valid prefix, kFail frees; an index past the fill is refused
      Seed(0, kBs4, 32).ext_admit(0, 0, 30, 30).ext_complete_failed(1, {3, 5}).step().ext_admit(1, 1, 30, 30)
          .ext_complete(2, 3, 2).ext_admit(2, 2, 25, 25).ext_complete_failed(3, {40}).ext_complete(3, 1, 99)
          .ext_abort(2, 0).step().drain());
  add("ext_save_pin_and_preempt",  // TensorRT-LLM#12542 / LMCache#5248: pinned blocks survive preemption and pressure
      Seed(0, kBs4, 10).admit(1, 0, 16).step().ext_pin(0, 0).preempt(1).admit(2, 1, 16).admit(3, 2, 16).step()
          .ext_signal(1, 1).ext_signal(1, 1).admit(3, 2, 16).step().drain());
  add("ext_lease_expiry_and_heartbeat",  // leases extended, expired by reap; stale generations after reuse
      Seed(0, kBs4, 8).admit(1, 0, 8).step().admit(2, 1, 8).step().ext_lease(0, 5).ext_lease(0, 5).ext_signal(2, 2, 50)
          .ext_reap(10).ext_stale(0).ext_stale(1).admit(3, 2, 20).step().ext_reap(100).ext_stale(0).ext_stale(1)
          .ext_signal(1, 0).ext_signal(2, 0).drain());
  add("ext_headroom_and_clamp",
      Seed(0, kBs4, 8).ext_admit(0, 0, 9, 100, 245).ext_admit(0, 0, 9, 100).ext_admit(1, 0, 0, 5).ext_admit(0, 0, 3, 5)
          .ext_complete(1, 0).step().ext_abort(0, 3).ext_abort(1, 0).drain());
  add("ext_small_ids_caching_off",
      Seed(kSmallIds | kCachingOff, kBs2, 20).admit(1, 0, 6).step().ext_lease(0, 0).ext_pin(0, 0).ext_admit(0, 0, 10, 10)
          .ext_complete(1, 0).ext_pin(0, 0).step().ext_lease(0, 0).drain());
  add("ext_retention_manager",
      Seed(kRetention, kBs4, 12).admit(1, 0, 12).raw({kRetSystemPrompt}).step().ext_lease(0, 20).ext_admit(0, 0, 14, 14)
          .ext_complete(2, 0).step().ext_reap(30).ext_admit(1, 1, 14, 14).ext_abort(1, 1).ext_reap(230).drain());
  return s;
}

}  // namespace

int main(int argc, char** argv) { return pagedkv_fuzz::write_seeds(argc, argv, seeds()); }
