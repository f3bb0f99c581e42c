// tests/fuzz/manager_ops.hpp: the operations of the manager fuzzer and the byte layout of their arguments, shared
// by the driver (fuzz_manager.cpp, which decodes them) and the seed writer (make_seeds.cpp, which encodes them).
//
// Input = config, then ops until the input (or kMaxOps) runs out:
//   config   u8 flags     bit 0-1: prefix caching off when both set; bit 2: events off; bits 3-4 == 3: the
//                         Sha256Hasher / uint16 block id manager (else Xxh3Hasher / uint32); bit 5: a
//                         max_tokens_per_seq follows
//            u8 block     block size kBlockSizes[b % 8]; 0xFF: block size 0 (invalid)
//            u8 pool      num_blocks = b % 66 (0 and 1 invalid); with the int32 limits in the manager, 0xFE asks
//                         for 2^31 + 1 blocks and (with bit 5) 0xFD for max_tokens_per_seq 2^31 (both invalid)
//            [u16 limit]  max_tokens_per_seq = v % 2048 (0 = none)
//            u8 seed      hash_seed
//                         bit 6: the retention manager (Xxh3Hasher / uint32, PriorityLruEviction on the device,
//                         SlruEviction on the host), whose admissions carry one more argument, `retention`, after
//                         all the others
//   op       u8           Op (modulo kCount), then its arguments:
//   seq id   u8           b % 16: 0..11 are ids 0..11; 12..15 are 2^64-1, 2^63, 2^32-1, 2^32
//   prompt   u8 k         k >> 6 == 0: base k & 3 (200 fixed tokens), u8 prefix length, (k >> 2 & 7) tokens (u8 each)
//                         k >> 6 == 1: u8 live-sequence index, u8 drop (% 8), (k >> 2 & 7) tokens
//                         k >> 6 == 2: (k & 63) tokens (u8 each: < 200 -> b % 4; 250.. extreme ids)
//                         k >> 6 == 3: u16 length (% (4 * pool tokens + 64)), a repeating pattern
//   keys     u8 k         k % 8: 0-3 none; 4 a salt; 5 adapter 7; 6 one valid image; 7 custom: u8 adapter (% 3),
//                         u8 salt length (% 4) + that many u8 chars, u8 items (% 4) + per item u8 id (% 3),
//                         u8 offset (< 240: % (prompt + 3); else 2^64-1 - (b - 240)), u8 length (< 240: % 24;
//                         else 2^64-1 - (b - 240)); with >= 2 items a u8 whose bit 0 clear sorts them
//   retention u8 k        (retention manager only) k % 8: 0-2 none; 3 [0, prompt) at 80 + decode priority 10; 4 one
//                         range [0, (k >> 3) % 40 + 1) at 90 with a (k >> 3) + 1 us duration; 5-7 custom: u8 n (% 4)
//                         ranges, each u8 begin, u8 length (0xFF: to the end), u8 priority (> 100 invalid),
//                         u8 duration (0 none, 255 zero: invalid, else b us); u8 decode priority, u8 decode
//                         duration; begins are cumulative (sorted) when bit 3 of k is clear, raw otherwise
//   cap      u8           < 192: none; 255: SIZE_MAX; else (b - 192) % (prompt + 2)
//   reserve  u8           >= 224: none (the whole prompt); else b % (prompt + 2) uncached tokens get slots now
//   append n u8           < 160: b % 9; < 224: (b - 160) % 40 + 1; < 248: (b - 223) blocks; else more than the pool
//   tokens   u8 mode      mode % 4: 0 positional continuation; 1 one u8 per token (first 48); 2 constant mode >> 2;
//                         3 u8 live-sequence index: that sequence's tokens at the same positions
//   rewind n u8           < 128: b % (block_size + 1); < 254: (b - 128) % (len + 1); 254: len; 255: len + 1
//   build    u8 mode      mode % 8: 4-5 a subset (u8 bit masks, one per 8 live sequences); 6 all + one more id
//                         (u8 position, u8 seq id); 7 all + a duplicate (u8 index); else all. bit 3 reverses,
//                         bit 4 rotates (u8). Then u8 omit (bit i leaves buffer i empty: indptr, indices,
//                         last_page_len, block_tables, seq_lens, qo_indptr, slot_mapping, copies), u8 pad (% 4
//                         extra entries), u8 fault (>= 200: (b - 200) % 12 picks a buffer one entry short (0-7),
//                         a block-table row one short (8), max_blocks_per_seq 0 (9) or negative (10), no copies
//                         buffer (11))
#pragma once

#include <cstdint>

namespace pagedkv_fuzz {

/// The operations, one per manager call an engine makes (plus model-level steps). Append new ones before kCount.
enum class Op : std::uint8_t {
  kAdmit = 0,  // u8 seq, prompt, keys, cap: try_admit
  kAppend,     // u8 seq, u8 n, tokens: try_append
  kFork,       // u8 parent, u8 child: fork
  kFree,       // u8 seq: free
  kPreempt,    // u8 seq: preempt
  kRewind,     // u8 seq, u8 n: rewind
  kLookup,     // prompt, keys, cap: lookup
  kBuild,      // build: build_batch_metadata with any batch and buffer shapes
  kStep,       // (none): build_batch_metadata over every live sequence with pending slots, exact buffers (an engine step)
  kReset,      // (none): reset_prefix_cache
  kQuery,      // u8 seq: contains / num_tokens / token_ids / block_ids / pending_slots
  kMove,       // (none): move-construct the manager; the new one must carry on exactly
  kDrainAll,   // (none): free everything, build an empty batch, check that no block leaked
  kAdmitChunked,      // u8 seq, prompt, keys, cap, reserve: try_admit with AdmitOptions::num_reserved_tokens
  kReserve,           // u8 seq, u8 n (< 128: % (unslotted + 2); else (b - 128) % 40): try_reserve
  kReserveLookahead,  // u8 seq, u8 k (< 240: % 9; else more than the pool), tokens (the drafts): try_reserve_lookahead
  kCommitLookahead,   // u8 seq, u8 accepted (% (lookahead + 2)): commit_lookahead with the accepted drafts
  kQueryAdmit,        // prompt, keys, cap, reserve: query_admit
  kQueryAppend,       // u8 seq, u8 n (append n): query_append
  kBuildScheduled,    // u8 per live sequence (scheduled: < 200 % (pending + 1); <= 250 all; else more than pending),
                      // u8 (>= 250: a num_scheduled_tokens span of the wrong size): an engine step computing chunks
  kTakeEventBatch,    // (none): the step's events as a numbered batch (take_event_batch), then event_snapshot
  kTakePrefixStats,   // (none): take_prefix_cache_stats against the model's interval
  kAdmitPrepared,     // u8 seq, prompt, keys, cap, reserve, u8 tamper (>= 250: as if prepared elsewhere):
                      // prepare_prompt, query_admit(prepared), try_admit(prepared)
  kExpireRetention,   // u8 (< 224: the clock advances by b * b microseconds; else it goes back by (b - 223) us):
                      // expire_retention(now) (a no-op for managers without a RetentionEvictionPolicy)
  // External KV (issue 33): sequences 1000..1003 admitted with an external fill (not reachable by `seq id`
  // bytes: while they wait, the other ops never name them; completed, they join the live sequences), and leases and
  // save pins on live sequences. Ids of fills and holds: u8 pick b % (next id + 1): 0 and the next id are unknown.
  kExtAdmit,      // u8 slot (1000 + b % 4), u8 base (& 3), u8 len (2 + b % 120), u8 external tokens (b % (len + 3)),
                  // u8 headroom (>= 240: (b - 240) blocks): try_admit_external
  kExtComplete,   // u8 pick, u8 mode (% 4: 0 all valid, 1 k valid, 2 failed set, 3 kFail with k valid), u8 k
                  // (% (blocks + 2): blocks + 1 is invalid), mode 2: u8 count (% 3) + u8 each (% (blocks + 1)):
                  // complete_external_fill (late, duplicate, unknown ids included)
  kExtAbort,      // u8 slot (1000 + b % 4), u8 mode (% 4: abort_sequence quiescent, not quiescent, free, preempt)
  kExtLease,      // u8 live-sequence index, u8 deadline (0 none, else now + b s): finish_with_lease
  kExtPinSave,    // u8 live-sequence index, u8 deadline: pin_for_save
  kExtSignal,     // u8 pick, u8 mode (% 3: release_lease, end_save, extend_lease), mode 2: u8 deadline
  kExtReap,       // u8 (< 224: the external clock advances b s; else goes back (b - 223) s): reap_external
  kExtStale,      // u8 (< 250: a (block, generation) pair handed out earlier, pick b; else a made-up one):
                  // is_current_block
  kExtClaim,      // u8 pick (< 192: a live hold, else an id as kExtSignal's), u8 entries (% 9), u8 fault (% 3:
                  // none, one stale generation, one block not in the hold), u8 position: check_claim of the hold's
                  // blocks
  kEvictBlock,    // u8 (< 250: block 1 + b % usable; 250: 0; else num_blocks + b - 251, out of range):
                  // evict_cached_block (vLLM's evict_blocks after a failed load)
  kCount
};

inline constexpr std::uint32_t kBlockSizes[8] = {1, 2, 3, 4, 8, 16, 5, 32};

}  // namespace pagedkv_fuzz
