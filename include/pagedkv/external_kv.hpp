// pagedkv/external_kv.hpp: the public types of external KV, blocks filled by another engine or a store and blocks
// handed to one (prefill/decode disaggregation, KV stores): fill tickets, hand-off descriptors, layout fingerprints,
// import plans, the failure policy and the counters. The state machine is detail/external_kv.hpp; the
// KVCacheManager orchestrates it (docs/design.md "External KV").
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/block_identity.hpp>  // Sha256Digest
#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/group_policy.hpp>    // KVCacheGroupSpec, AttentionKind
#include <pagedkv/manager_results.hpp>  // AdmitResult, AdmitExplanation
#include <pagedkv/stats.hpp>           // ExternalKvCounters

namespace pagedkv {

/// The clock of leases, orphan holds and save pins (deadlines, heartbeats, `reap(now)`): the engine's steady clock,
/// or simulated time in replays and tests.
using ExternalClock = std::chrono::steady_clock;
using ExternalTimePoint = ExternalClock::time_point;

/// What happens to a sequence whose external fill failed for some blocks (vLLM's `kv_load_failure_policy`).
enum class ExternalFailurePolicy : std::uint8_t {
  kRecompute = 0,  ///< Keep the sequence: the valid prefix is registered and counted computed; the positions from
                   ///< the first failed block on stay pending (their blocks stay in its table), the scheduler
                   ///< computes them like any prompt chunk.
  kFail = 1,       ///< The sequence is reported failed and freed, with every block of its fill.
};

/// How the identities of a hand-off descriptor are computed, so that both sides agree on what a block holds.
enum class BlockIdentityConvention : std::uint8_t {
  kPagedkv = 0,         ///< pagedkv's chain hash (BlockHash, 16 bytes, zero-padded to 32) under the pool's hasher
                        ///< and hash_seed: both sides must run pagedkv with the same hasher and seed.
  kVllmSha256Cbor = 1,  ///< vLLM's sha256_cbor block hash (block_identity.hpp: vllm_request_block_hashes), 32 bytes.
};

/// "pagedkv" or "vllm_sha256_cbor".
[[nodiscard]] constexpr const char* to_string(BlockIdentityConvention c) noexcept {
  return c == BlockIdentityConvention::kVllmSha256Cbor ? "vllm_sha256_cbor" : "pagedkv";
}

/// One block's identity in a hand-off: the digest of its content chain (BlockIdentityConvention says which).
using BlockIdentity = identity::Sha256Digest;

/// Everything two engines must agree on before one reads the other's blocks: a hand-off between engines whose
/// fingerprints differ would move bytes that the reader misinterprets. Compared once, at hand-shake
/// (`first_mismatch`, `check_same_layout`), never found per request (vLLM #42895: a block-size mismatch found by
/// each request's transfer). Plain values so that it can be sent over any wire.
struct KvLayoutFingerprint {
  std::uint32_t block_size = 0;        ///< Tokens per block (the match unit).
  std::string page_layout;             ///< The pool's page layout, e.g. "nhd", "hnd" (KVLayout).
  std::string dtype;                   ///< Storage dtype of K/V, e.g. "bf16", "fp8_e4m3".
  std::uint32_t num_kv_heads = 0;      ///< KV heads per layer (GQA), on this rank.
  std::uint32_t head_dim = 0;          ///< Elements per head.
  std::vector<KVCacheGroupSpec> groups;  ///< The KV-cache groups, in index order (kind, window, layers, state
                                         ///< bytes, last_checkpoint, page block size).
  BlockIdentityConvention hash_algorithm = BlockIdentityConvention::kPagedkv;  ///< How identities are computed.
  std::uint64_t hash_seed = 0;         ///< kPagedkv: CacheConfig::hash_seed; kVllmSha256Cbor: 0 (the seed is in
  std::string hash_seed_text;          ///< this text: vLLM's NONE_HASH seed, e.g. "vllm-none-hash").
};

/// The first field where `a` and `b` differ, as "field: a_value vs b_value" (e.g. "block_size: 16 vs 32",
/// "groups[1].window_tokens: 4096 vs 0"), or nullopt when they are the same layout. Fields are compared in
/// declaration order. Pure; allocates the message.
[[nodiscard]] inline std::optional<std::string> first_mismatch(const KvLayoutFingerprint& a,
                                                               const KvLayoutFingerprint& b) {
  auto num = [](std::uint64_t v) { return std::to_string(v); };
  auto differ = [](const std::string& f, const std::string& x, const std::string& y) {
    return std::optional<std::string>(f + ": " + x + " vs " + y);
  };
  if (a.block_size != b.block_size) return differ("block_size", num(a.block_size), num(b.block_size));
  if (a.page_layout != b.page_layout) return differ("page_layout", a.page_layout, b.page_layout);
  if (a.dtype != b.dtype) return differ("dtype", a.dtype, b.dtype);
  if (a.num_kv_heads != b.num_kv_heads) return differ("num_kv_heads", num(a.num_kv_heads), num(b.num_kv_heads));
  if (a.head_dim != b.head_dim) return differ("head_dim", num(a.head_dim), num(b.head_dim));
  if (a.groups.size() != b.groups.size()) return differ("groups.size", num(a.groups.size()), num(b.groups.size()));
  for (std::size_t g = 0; g < a.groups.size(); ++g) {
    const KVCacheGroupSpec& x = a.groups[g];
    const KVCacheGroupSpec& y = b.groups[g];
    const std::string f = "groups[" + std::to_string(g) + "].";
    if (x.kind != y.kind) return differ(f + "kind", to_string(x.kind), to_string(y.kind));
    if (x.window_tokens != y.window_tokens) return differ(f + "window_tokens", num(x.window_tokens), num(y.window_tokens));
    if (x.num_layers != y.num_layers) return differ(f + "num_layers", num(x.num_layers), num(y.num_layers));
    if (x.state_bytes != y.state_bytes) return differ(f + "state_bytes", num(x.state_bytes), num(y.state_bytes));
    if (x.last_checkpoint != y.last_checkpoint) {
      return differ(f + "last_checkpoint", num(x.last_checkpoint), num(y.last_checkpoint));
    }
    if (x.block_size != y.block_size) return differ(f + "block_size", num(x.block_size), num(y.block_size));
  }
  if (a.hash_algorithm != b.hash_algorithm) {
    return differ("hash_algorithm", to_string(a.hash_algorithm), to_string(b.hash_algorithm));
  }
  if (a.hash_seed != b.hash_seed) return differ("hash_seed", num(a.hash_seed), num(b.hash_seed));
  if (a.hash_seed_text != b.hash_seed_text) return differ("hash_seed_text", a.hash_seed_text, b.hash_seed_text);
  return std::nullopt;
}

/// Throws kInvalidArgument "<what>: layout fingerprints differ at <field>: <ours> vs <theirs>" unless `ours` and
/// `theirs` describe the same layout (first_mismatch). The hand-shake check: call it once per peer.
inline void check_same_layout(const KvLayoutFingerprint& ours, const KvLayoutFingerprint& theirs,
                              const char* what = "external KV hand-shake") {
  if (auto m = first_mismatch(ours, theirs)) {
    detail::raise(Errc::kInvalidArgument, std::string(what) + ": layout fingerprints differ at " + *m +
                                              " (ours vs theirs)");
  }
}

/// An admission's external fill: the blocks a transfer must write before the sequence can run (vLLM: the blocks of
/// `allocate_slots(..., num_external_computed_tokens, delay_cache_blocks=True)`; TensorRT-LLM: a request in
/// kDISAGG_GENERATION_TRANS_IN_PROGRESS). The blocks are held by the fill: not matchable, not registered, not
/// evictable, no events, until `complete_external_fill` / `abort_sequence`.
template <BlockIdType Id = std::uint32_t>
struct FillTicket {
  std::uint64_t fill_id = 0;     ///< Names the fill in complete / fail signals; never reused (0 = none).
  SeqId seq = 0;                 ///< The sequence waiting for it.
  std::size_t num_groups = 0;    ///< KV-cache groups.
  std::size_t first_block = 0;   ///< Logical index of the first filled block (= local hit tokens / block_size).
  std::size_t first_token = 0;   ///< Token range the fill writes: [first_token, end_token).
  std::size_t end_token = 0;
  /// `[num_groups x num_blocks()]` group-major: the pool blocks to write, logical blocks first_block ...; 0 (the
  /// null block, not held by the fill, never written) for a window group's blocks outside the window of the query
  /// at end_token.
  std::vector<Id> blocks;
  /// Generation of each block of `blocks` (same shape): a transfer that writes with a stale one is refused.
  std::vector<std::uint32_t> generations;
  /// Blocks per group.
  [[nodiscard]] std::size_t num_blocks() const noexcept { return num_groups == 0 ? 0 : blocks.size() / num_groups; }
  /// Group g's blocks (`[num_blocks()]`). Precondition: g < num_groups.
  [[nodiscard]] std::span<const Id> group_blocks(std::size_t g) const noexcept {
    return std::span<const Id>(blocks).subspan(g * num_blocks(), num_blocks());
  }
};

/// What a producer exports so that a consumer can read a sequence's blocks (vLLM NixlConnector's
/// `kv_transfer_params`: remote_block_ids, remote_engine_id, remote_host, remote_port; here without the transport
/// part, which the transfer engine adds). Valid while the hold it names lives (a lease: released by the consumer's
/// read-done, extended by heartbeats, or expired by the producer's reap).
template <BlockIdType Id = std::uint32_t>
struct HandoffDescriptor {
  std::uint64_t hold_id = 0;      ///< The producer's lease on the blocks (0 = none: the blocks may go at any time).
  std::size_t num_tokens = 0;     ///< Tokens whose K/V the blocks hold (positions [0, num_tokens)).
  std::size_t num_groups = 0;     ///< KV-cache groups.
  /// `[num_groups x ceil(num_tokens / block_size)]` group-major: the producer's pool blocks; 0 (generation 0, not
  /// leased) for a window group's blocks outside the window of the query at num_tokens - 1, or one no longer cached.
  std::vector<Id> blocks;
  /// Generation of each block (same shape): the producer refuses a read whose generation is not the block's now.
  std::vector<std::uint32_t> generations;
  /// `[num_tokens / block_size]`: the full blocks' identities under `layout.hash_algorithm`.
  std::vector<BlockIdentity> identities;
  /// `[num_tokens % block_size]`: the token ids of the last, partial block (no identity convention hashes a partial
  /// block): a consumer imports that block only for the same tokens (a descriptor of another prompt is refused).
  std::vector<TokenId> tail_tokens;
  KvLayoutFingerprint layout;     ///< The producer's layout (compared by the consumer at hand-shake).
  /// Blocks per group.
  [[nodiscard]] std::size_t num_blocks() const noexcept { return num_groups == 0 ? 0 : blocks.size() / num_groups; }
};

/// The part of a hand-off a consumer must transfer: only the blocks it lacks (its own prefix hit is not transferred
/// again), each pairing a producer block with the consumer's block at the same logical index.
template <BlockIdType Id = std::uint32_t>
struct ImportPlan {
  std::size_t first_block = 0;     ///< Logical index of the first block to transfer (= skipped_blocks).
  std::size_t num_blocks = 0;      ///< Blocks to transfer per group.
  std::size_t first_token = 0;     ///< Tokens the transfer provides: [first_token, end_token).
  std::size_t end_token = 0;
  std::size_t skipped_blocks = 0;  ///< Leading blocks served by the consumer's own prefix hit.
  std::size_t num_groups = 0;
  std::vector<Id> remote_blocks;   ///< `[num_groups x num_blocks]` the producer's blocks (source of the READ); 0 for
                                   ///< a window group's block outside the window at end_token: skip the pair.
  std::vector<std::uint32_t> remote_generations;  ///< Same shape: their generations.
  /// The destination is the fill ticket of the admission that takes these tokens (try_admit_external with
  /// end_token - first_token external tokens): its blocks pair one to one with remote_blocks when its first_block
  /// equals this plan's (the local hit did not change in between).
};

/// The external tokens an import may provide: `[local_hit_tokens, end)`, end = min(producer tokens, prompt_len - 1)
/// (the consumer recomputes the last prompt token for its logits), 0 when the hit covers it. Pure.
[[nodiscard]] constexpr std::size_t importable_tokens(std::size_t producer_tokens, std::size_t prompt_len,
                                                      std::size_t local_hit_tokens) noexcept {
  const std::size_t end = std::min(producer_tokens, prompt_len == 0 ? 0 : prompt_len - 1);
  return end > local_hit_tokens ? end - local_hit_tokens : 0;
}

/// Result of `KVCacheManager::try_admit_external`: the admission (as try_admit's) and, when it took external
/// tokens, the fill's ticket (fill_id 0: the admission is a plain one, nothing to transfer).
template <BlockIdType Id = std::uint32_t>
struct ExternalAdmitResult {
  AdmitResult admit;
  FillTicket<Id> ticket;
};

/// Result of `KVCacheManager::explain_admit_external`: an admission's prefix hit explained with its external part
/// (tokens; the local part as explain_admit says it). The external tokens start where the local hit ends (with a
/// coarse group, at the page boundary before it: first_external_token): an
/// engine that sees `external_tokens` > 0 knows the admission would take a fill and how many blocks it moves.
struct ExternalAdmitExplanation {
  AdmitExplanation local;              ///< explain_admit's answer: the local hit (device and host) and why it ends.
  std::size_t external_tokens = 0;     ///< Tokens the external source provides: positions
                                       ///< [first_external_token, first_external_token + external_tokens).
  std::size_t clamped_tokens = 0;      ///< External tokens offered but not taken: under the local hit, or the last
                                       ///< prompt token (always computed here, for its logits).
  std::size_t first_external_block = 0;  ///< = first_external_token / block_size: the first block a fill writes.
  std::size_t external_blocks = 0;     ///< Blocks per group of a fill's ticket (0 when external_tokens is 0; a
                                       ///< window group's entries outside the window are null, not held).
  std::size_t skipped_blocks = 0;      ///< Blocks per group not transferred thanks to the local hit (= first block).
  std::size_t first_external_token = 0;  ///< Where the external tokens start: the local hit, lowered to a page
                                         ///< boundary of every group when a coarse group's pages move whole.
  /// Positions computed before the first step: first_external_token + external tokens.
  [[nodiscard]] std::size_t computed_tokens() const noexcept { return first_external_token + external_tokens; }
};

/// What a fill signal did (complete / fail / release / extend). Only kApplied changed anything but counters.
enum class ExternalSignal : std::uint8_t {
  kApplied = 0,    ///< The fill or hold was live; the signal took effect.
  kLate = 1,       ///< The fill was aborted (its orphan hold ends now, or ended) or the hold expired: counted.
  kDuplicate = 2,  ///< The fill or hold ended by an earlier signal: counted, nothing changes.
  kUnknown = 3,    ///< No fill or hold with that id was ever issued: counted, nothing changes.
};

/// "applied", "late", "duplicate", "unknown".
[[nodiscard]] constexpr const char* to_string(ExternalSignal s) noexcept {
  switch (s) {
    case ExternalSignal::kLate: return "late";
    case ExternalSignal::kDuplicate: return "duplicate";
    case ExternalSignal::kUnknown: return "unknown";
    case ExternalSignal::kApplied: break;
  }
  return "applied";
}

/// Why a consumer's claim on a producer hold is refused (`KVCacheManager::check_claim`).
enum class ClaimStatus : std::uint8_t {
  kOk = 0,               ///< Every entry names a block of the hold at its current generation.
  kUnknownHold = 1,      ///< No live lease or save pin has that id (never issued, released, expired, or an
                         ///< orphan hold, which no consumer may read): nothing of the claim may be served.
  kNotInHold = 2,        ///< The entry's block is not one of the hold's blocks.
  kStaleGeneration = 3,  ///< The entry's block is in the hold but its generation is not the block's now (a reference
                         ///< from an earlier hold of a reused block: vLLM #52234).
};

/// "ok", "unknown_hold", "not_in_hold", "stale_generation".
[[nodiscard]] constexpr const char* to_string(ClaimStatus s) noexcept {
  switch (s) {
    case ClaimStatus::kUnknownHold: return "unknown_hold";
    case ClaimStatus::kNotInHold: return "not_in_hold";
    case ClaimStatus::kStaleGeneration: return "stale_generation";
    case ClaimStatus::kOk: break;
  }
  return "ok";
}

/// Result of `KVCacheManager::check_claim`: the producer's answer to a consumer's claim (hold id + entries of
/// (block id, generation)), naming the first entry that fails and why, so the producer can refuse a read with a
/// precise reason instead of one pass/fail per block (is_current_block).
struct ClaimCheck {
  ClaimStatus status = ClaimStatus::kOk;
  std::size_t entry = 0;                   ///< The first failing entry's index (0 for kUnknownHold; the number of
                                           ///< entries when kOk).
  std::uint32_t current_generation = 0;    ///< kStaleGeneration: the block's generation now.
  [[nodiscard]] bool ok() const noexcept { return status == ClaimStatus::kOk; }
};

/// Result of `KVCacheManager::complete_external_fill`.
struct ExternalCompletion {
  ExternalSignal signal = ExternalSignal::kUnknown;  ///< kApplied: the fill was live; else counted, nothing changed
                                                     ///< (kLate also ends an orphan hold).
  SeqId seq = 0;                       ///< kApplied: the sequence of the fill.
  bool sequence_failed = false;        ///< kApplied: the policy was kFail and a block failed: the sequence is freed.
  std::size_t num_valid_blocks = 0;    ///< kApplied: leading blocks (per group) kept as computed.
  std::size_t num_computed_tokens = 0; ///< kApplied, not failed: the sequence's computed (built) positions now.
};

}  // namespace pagedkv
