// tests/fuzz/manager_groups_ops.hpp: the operations of the KV-cache-group fuzzer (fuzz_manager_groups.cpp) and the
// byte layout of its input, shared by the target (which decodes it) and the seed writer (make_seeds.cpp).
//
// Input = config, then ops until the input (or 160 ops) runs out; every byte past the end reads as 0:
//   config  u8 flags   bits 0-1: block size {1, 4, 16, 4}; bits 2-3 both set: prefix caching off; bits 4-5 % 3:
//                      offload policy (0 none, 1 write-back, 2 write-through); bit 6: events on; bit 7: no host tier
//           u8 pool    num_blocks = 2 + b % 48
//           u8 host    num_host_blocks = 2 + b % 40 (unless bit 7); b >= 128: SlruEviction in both tiers, else LRU
//           u8 seed    hash_seed
//           u8 groups  b % 5 groups (0: the default one full-attention group), each: u8 kind (% 3: full, sliding
//                      window, chunked local; (k >> 2) % 4 + 1 layers), u8 window (< 200: 1 + w % (3 * block_size
//                      + 5) tokens; else block_size * (1 + (w - 200) % 4)); a full group ignores it, except that a
//                      full group after the first with no host tier (flags bit 7) and w >= 224 has coarse pages
//                      (KVCacheGroupSpec::block_size) of 2 (w even) or 4 (w odd) blocks
//   op      u8         GOp (modulo kCount), then its arguments:
//   id      u8         b % 8 (an admission's id); `pick` u8: b < 224: the (b % n)-th model sequence (live or
//                      swapped, id order), else id b % 8
//   prompt  u8 k       k < 192: base k & 3 (160 fixed tokens), u8 length (1 + b % min(160, 4 * bs + 40)),
//                      (k >> 2) & 3 extra tokens (u8 % 4 each); k < 224: u8 sequence index, u8 drop (% 6): that
//                      sequence's tokens less the last `drop`; k < 254: 1 + (k - 224) % 24 raw tokens (u8 % 3);
//                      else u16 length (1 + v % (2 * pool tokens + 8)), a pattern
//   keys    u8         % 8: 0-4 none, 5 salt, 6 adapter 7, 7 adapter 7 + another salt
//   tokens  u8 mode    mode % 4: 0 positional, 1 constant mode >> 2, 2 base (mode >> 2) & 3 continued, 3 one u8
//                      per token (% 3, first 24)
#pragma once

#include <cstdint>

namespace pagedkv_fuzz {

/// Operations of the group fuzzer. Append new ones before kCount (the seed corpus encodes these numbers).
enum class GOp : std::uint8_t {
  kAdmit = 0,       // u8 id, prompt, keys, u8 cap (>= 192: (b - 192) % (len + 2), 255: len), u8 reserve (< 160:
                    // b % (len + 2) tokens reserved now): query_admit, lookup, try_admit
  kAdmitPrepared,   // as kAdmit, through prepare_prompt and query_admit(prepared)
  kAppend,          // pick, u8 n (< 200: b % 6; else (b - 199) % 24 + 1; 255: more than the pool), tokens:
                    // query_append, try_append
  kReserve,         // pick, u8 n (< 240: b % (unslotted + 2); else unslotted): query_append, try_reserve
  kLookahead,       // pick, u8 k (as kAppend's n), tokens (the drafts): query_append, try_reserve_lookahead
  kCommit,          // pick, u8 a (% (lookahead + 2)): commit_lookahead with the first a drafts (more: invalid)
  kFork,            // pick parent, u8 child id
  kFree,            // pick
  kPreempt,         // pick: preempt (recompute)
  kSwap,            // pick: preempt(kSwap)
  kResume,          // pick: try_resume
  kComplete,        // u8: complete_transfers of the (b % (n + 1))-th token in flight; n: a bad token
  kRewind,          // pick, u8 n (< 128: b % (bs + 1); < 250: (b - 128) % (len + 1); else len + b - 249)
  kStep,            // (none): build every live sequence with pending slots, all of them
  kBuildScheduled,  // u8 per live sequence with pending slots (< 160: 1 + b % pending; < 240: all; else not in
                    // the batch), u8 shape (bit 0 reverses, bits 1-2 pad the buffers, bit 3 no block_tables)
  kLookup,          // prompt, keys, u8 cap (>= 128: (b - 128) % (len + 2)): lookup and query_admit agree
  kReset,           // (none): reset_prefix_cache
  kDrainEvents,     // (none): drain_events
  kDrain,           // u8 order: free everything, build, complete every transfer; nothing may stay held
  kCount
};

}  // namespace pagedkv_fuzz
