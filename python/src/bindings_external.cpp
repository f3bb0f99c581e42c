// python/src/bindings_external.cpp: the external-KV part of pagedkv._pagedkv (issue 33; C++: external_kv.hpp and
// KVCacheManager's "External KV" calls; docs/python.md "External KV"). Blocks filled by another engine or a store
// (prefill/decode disaggregation, KV stores: vLLM's KV connectors), and blocks handed to one:
//  - admission with external tokens (try_admit_external: a FillTicket names the blocks a transfer must write),
//    completion with a per-block outcome (complete_external_fill), aborts that cannot corrupt (abort_sequence);
//  - producer holds: finish_with_lease / release_lease / extend_lease, save pins (pin_for_save / end_save), the
//    external clock (reap_external, set_orphan_timeout);
//  - hand-off descriptors, layout fingerprints and import plans (layout_fingerprint, plan_import,
//    is_current_block), and the counters (external_counters).
// Conventions as bindings.cpp's: calls that do work release the GIL and take the manager's mutex; results are
// copied out under it. Block ids and generations are flat lists, group-major ([num_groups x blocks per group]),
// as in C++. Times are float seconds on the clock the engine passes to reap_external (time.monotonic(), which is
// std::chrono::steady_clock on Linux, or simulated time): the manager only compares them.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <pagedkv/external_kv.hpp>

#include "bindings_common.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedkv::python {
namespace {

using Tokens = ArrayIn<std::int32_t>;
using Ticket = FillTicket<Id>;
using Descriptor = HandoffDescriptor<Id>;
using Plan = ImportPlan<Id>;

// Float seconds <-> the external clock's time points (the manager compares them only).
ExternalTimePoint to_time(double seconds) {
  return ExternalTimePoint(std::chrono::duration_cast<ExternalClock::duration>(std::chrono::duration<double>(seconds)));
}
std::optional<ExternalTimePoint> to_time(std::optional<double> seconds) {
  if (!seconds) return std::nullopt;
  return to_time(*seconds);
}

nb::bytes identity_bytes(const BlockIdentity& d) {
  return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
}

std::vector<nb::bytes> identities_to_py(const std::vector<BlockIdentity>& ids) {
  std::vector<nb::bytes> out;
  out.reserve(ids.size());
  for (const BlockIdentity& d : ids) out.push_back(identity_bytes(d));
  return out;
}

std::vector<BlockIdentity> identities_from_py(const std::vector<nb::bytes>& ids) {
  std::vector<BlockIdentity> out(ids.size());
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (ids[i].size() != out[i].size()) {
      detail::raise(Errc::kInvalidArgument, "HandoffDescriptor.identities[" + std::to_string(i) + "]: " +
                                                std::to_string(ids[i].size()) + " bytes, expected " +
                                                std::to_string(out[i].size()));
    }
    std::memcpy(out[i].data(), ids[i].c_str(), out[i].size());
  }
  return out;
}

template <class T>
std::vector<T> group_slice(const std::vector<T>& flat, std::size_t num_groups, std::size_t g, const char* what) {
  if (g >= num_groups) {
    detail::raise(Errc::kInvalidArgument, std::string(what) + ": group " + std::to_string(g) +
                                              " >= num_groups = " + std::to_string(num_groups));
  }
  const std::size_t n = flat.size() / num_groups;
  return std::vector<T>(flat.begin() + static_cast<std::ptrdiff_t>(g * n),
                        flat.begin() + static_cast<std::ptrdiff_t>((g + 1) * n));
}

void bind_types(nb::module_& m) {
  nb::enum_<ExternalFailurePolicy>(m, "ExternalFailurePolicy",
                                   "What a fill with failed blocks does to its sequence (vLLM's "
                                   "kv_load_failure_policy; external_kv.hpp).")
      .value("RECOMPUTE", ExternalFailurePolicy::kRecompute,
             "Keep the sequence: the valid prefix counts as computed, the positions from the first failed block on "
             "stay pending in their blocks (the scheduler computes them).")
      .value("FAIL", ExternalFailurePolicy::kFail, "The sequence is reported failed and freed with its fill.");
  nb::enum_<BlockIdentityConvention>(m, "BlockIdentityConvention",
                                     "How a hand-off's block identities are computed (both sides must agree).")
      .value("PAGEDKV", BlockIdentityConvention::kPagedkv,
             "pagedkv's chain hash (16 bytes, zero-padded to 32) under the pool's hasher and hash_seed.")
      .value("VLLM_SHA256_CBOR", BlockIdentityConvention::kVllmSha256Cbor,
             "vLLM's sha256_cbor block hash (32 bytes), seeded by vLLM's NONE_HASH seed text.");
  nb::enum_<ExternalSignal>(m, "ExternalSignal", nb::is_arithmetic(),
                            "What a fill or hold signal did. Only APPLIED changed anything but counters.")
      .value("APPLIED", ExternalSignal::kApplied, "The fill or hold was live; the signal took effect.")
      .value("LATE", ExternalSignal::kLate,
             "The fill was aborted (an orphan hold ends now, or ended) or the hold expired: counted.")
      .value("DUPLICATE", ExternalSignal::kDuplicate, "Ended by an earlier signal: counted, nothing changes.")
      .value("UNKNOWN", ExternalSignal::kUnknown, "No fill or hold with that id was issued: counted.");

  nb::class_<KvLayoutFingerprint>(m, "KvLayoutFingerprint",
                                  "What two engines must agree on before one reads the other's blocks "
                                  "(external_kv.hpp): compared once per peer, at hand-shake (first_mismatch), never "
                                  "per request (vLLM #42895). Make one with KVCacheManager.layout_fingerprint.")
      .def(nb::init<>())
      .def_rw("block_size", &KvLayoutFingerprint::block_size, "Tokens per block.")
      .def_rw("page_layout", &KvLayoutFingerprint::page_layout, "The pool's page layout, e.g. \"nhd\".")
      .def_rw("dtype", &KvLayoutFingerprint::dtype, "Storage dtype of K/V, e.g. \"bf16\".")
      .def_rw("num_kv_heads", &KvLayoutFingerprint::num_kv_heads, "KV heads per layer on this rank.")
      .def_rw("head_dim", &KvLayoutFingerprint::head_dim, "Elements per head.")
      .def_rw("groups", &KvLayoutFingerprint::groups, "The KV-cache groups (KVCacheGroupSpec), in index order.")
      .def_rw("hash_algorithm", &KvLayoutFingerprint::hash_algorithm, "How identities are computed.")
      .def_rw("hash_seed", &KvLayoutFingerprint::hash_seed, "PAGEDKV: CacheConfig.hash_seed; else 0.")
      .def_rw("hash_seed_text", &KvLayoutFingerprint::hash_seed_text, "VLLM_SHA256_CBOR: vLLM's NONE_HASH seed.")
      .def(
          "first_mismatch",
          [](const KvLayoutFingerprint& a, const KvLayoutFingerprint& b) { return first_mismatch(a, b); },
          "other"_a,
          "The first field where this and `other` differ, as \"field: ours vs theirs\" (e.g. \"block_size: 16 vs "
          "32\"), or None when they describe the same layout. Pure.")
      .def(
          "check_same_layout",
          [](const KvLayoutFingerprint& a, const KvLayoutFingerprint& b) { check_same_layout(a, b); }, "theirs"_a,
          "The hand-shake check: raises InvalidArgumentError naming the first differing field unless `theirs` "
          "describes this layout.");

  nb::class_<Ticket>(m, "FillTicket",
                     "An admission's external fill: the blocks a transfer must write before the sequence runs "
                     "(vLLM: allocate_slots(..., num_external_computed_tokens, delay_cache_blocks=True)). Held by "
                     "the fill: not matchable, registered, evictable or reported until complete_external_fill / "
                     "abort_sequence.")
      .def_ro("fill_id", &Ticket::fill_id, "Names the fill in complete signals; never reused (0: no fill).")
      .def_ro("seq", &Ticket::seq, "The sequence waiting for it.")
      .def_ro("num_groups", &Ticket::num_groups, "KV-cache groups.")
      .def_ro("first_block", &Ticket::first_block, "Logical index of the first filled block (local hit / block_size).")
      .def_ro("first_token", &Ticket::first_token, "The fill writes positions [first_token, end_token).")
      .def_ro("end_token", &Ticket::end_token)
      .def_ro("blocks", &Ticket::blocks, "[num_groups x num_blocks] group-major: the pool blocks to write.")
      .def_ro("generations", &Ticket::generations, "Same shape: each block's generation (is_current_block).")
      .def_prop_ro("num_blocks", &Ticket::num_blocks, "Blocks per group.")
      .def(
          "group_blocks",
          [](const Ticket& t, std::size_t g) {
            return group_slice(t.blocks, t.num_groups, g, "FillTicket.group_blocks");
          },
          "g"_a, "Group g's blocks (num_blocks of them). Raises InvalidArgumentError for g >= num_groups.");

  nb::class_<ExternalAdmitResult<Id>>(m, "ExternalAdmitResult",
                                      "Result of try_admit_external: the admission (as try_admit's) and its fill.")
      .def_ro("admit", &ExternalAdmitResult<Id>::admit, "The AdmitResult; only ADMITTED changed state.")
      .def_prop_ro(
          "ticket",
          [](const ExternalAdmitResult<Id>& r) -> std::optional<Ticket> {
            if (r.ticket.fill_id == 0) return std::nullopt;
            return r.ticket;
          },
          "The FillTicket, or None when nothing is to be transferred (not admitted, or no external token left after "
          "the local hit and the clamp to prompt length - 1).");

  nb::class_<ExternalCompletion>(m, "ExternalCompletion", "Result of complete_external_fill.")
      .def_ro("signal", &ExternalCompletion::signal, "APPLIED: the fill was live; else counted, nothing changed.")
      .def_ro("seq", &ExternalCompletion::seq, "APPLIED: the fill's sequence.")
      .def_ro("sequence_failed", &ExternalCompletion::sequence_failed,
              "APPLIED: the policy was FAIL and a block failed: the sequence is freed.")
      .def_ro("num_valid_blocks", &ExternalCompletion::num_valid_blocks, "APPLIED: leading blocks kept as computed.")
      .def_ro("num_computed_tokens", &ExternalCompletion::num_computed_tokens,
              "APPLIED, not failed: the sequence's computed (built) positions now.");

  nb::class_<Descriptor>(m, "HandoffDescriptor",
                         "What a producer exports so that a consumer can read a finished sequence's blocks (vLLM "
                         "NixlConnector's kv_transfer_params without the transport part). Valid while its lease "
                         "lives. Constructible, so that a consumer can rebuild one received over a wire; plan_import "
                         "checks its shape against num_tokens (never trusted: vLLM #50558).")
      .def(nb::init<>())
      .def_rw("hold_id", &Descriptor::hold_id, "The producer's lease (0: none).")
      .def_rw("num_tokens", &Descriptor::num_tokens, "Tokens whose K/V the blocks hold: [0, num_tokens).")
      .def_rw("num_groups", &Descriptor::num_groups, "KV-cache groups.")
      .def_rw("blocks", &Descriptor::blocks, "[num_groups x ceil(num_tokens / block_size)] group-major.")
      .def_rw("generations", &Descriptor::generations, "Same shape: each block's generation at export.")
      .def_prop_rw(
          "identities", [](const Descriptor& d) { return identities_to_py(d.identities); },
          [](Descriptor& d, const std::vector<nb::bytes>& v) { d.identities = identities_from_py(v); },
          "[num_tokens // block_size] 32-byte identities of the full blocks under layout.hash_algorithm. Setting "
          "raises InvalidArgumentError for an entry that is not 32 bytes.")
      .def_rw("tail_tokens", &Descriptor::tail_tokens,
              "[num_tokens % block_size] token ids of the last, partial block (no identity convention hashes a "
              "partial block): plan_import refuses a prompt whose tokens there differ.")
      .def_rw("layout", &Descriptor::layout, "The producer's KvLayoutFingerprint.")
      .def_prop_ro("num_blocks", &Descriptor::num_blocks, "Blocks per group.");

  nb::class_<Plan>(m, "ImportPlan",
                   "What a consumer transfers of a hand-off: only the blocks it lacks (its own prefix hit is not "
                   "transferred again). The destination is the FillTicket of try_admit_external with end_token - "
                   "first_token external tokens (its blocks pair one to one with remote_blocks when its first_block "
                   "equals this plan's).")
      .def_ro("first_block", &Plan::first_block, "Logical index of the first block to transfer.")
      .def_ro("num_blocks", &Plan::num_blocks, "Blocks to transfer per group.")
      .def_ro("first_token", &Plan::first_token, "Tokens the transfer provides: [first_token, end_token).")
      .def_ro("end_token", &Plan::end_token)
      .def_ro("skipped_blocks", &Plan::skipped_blocks, "Leading blocks served by the consumer's own prefix hit.")
      .def_ro("num_groups", &Plan::num_groups)
      .def_ro("remote_blocks", &Plan::remote_blocks, "[num_groups x num_blocks] the producer's blocks to read.")
      .def_ro("remote_generations", &Plan::remote_generations, "Same shape: their generations.");

  nb::class_<ExternalKvCounters>(m, "ExternalKvCounters",
                                 "Lifetime counters of external KV (stats.hpp), and the fills and holds now.")
      .def_ro("fills_started", &ExternalKvCounters::fills_started, "Admissions with external tokens.")
      .def_ro("fills_completed", &ExternalKvCounters::fills_completed, "Completed with every block valid.")
      .def_ro("fills_partial", &ExternalKvCounters::fills_partial, "Completed with some blocks failed.")
      .def_ro("fills_failed", &ExternalKvCounters::fills_failed,
              "Sequences failed: by the FAIL policy, or a recompute the pool had no blocks for.")
      .def_ro("fills_aborted", &ExternalKvCounters::fills_aborted, "Fills whose sequence ended while in flight.")
      .def_ro("fill_blocks", &ExternalKvCounters::fill_blocks, "Blocks (all groups) of the fills started.")
      .def_ro("fill_blocks_valid", &ExternalKvCounters::fill_blocks_valid, "Of which completed valid and kept.")
      .def_ro("orphan_holds", &ExternalKvCounters::orphan_holds, "Aborts while the transfer was not quiescent.")
      .def_ro("orphans_released", &ExternalKvCounters::orphans_released, "Orphan holds ended by the late signal.")
      .def_ro("orphans_expired", &ExternalKvCounters::orphans_expired, "Orphan holds ended by their deadline.")
      .def_ro("leases_started", &ExternalKvCounters::leases_started)
      .def_ro("leases_released", &ExternalKvCounters::leases_released)
      .def_ro("leases_extended", &ExternalKvCounters::leases_extended)
      .def_ro("leases_expired", &ExternalKvCounters::leases_expired)
      .def_ro("save_pins_started", &ExternalKvCounters::save_pins_started)
      .def_ro("save_pins_ended", &ExternalKvCounters::save_pins_ended)
      .def_ro("late_signals", &ExternalKvCounters::late_signals)
      .def_ro("duplicate_signals", &ExternalKvCounters::duplicate_signals)
      .def_ro("unknown_signals", &ExternalKvCounters::unknown_signals)
      .def_ro("stale_generations", &ExternalKvCounters::stale_generations,
              "Block references refused by is_current_block.")
      .def_ro("blocks_transferred", &ExternalKvCounters::blocks_transferred, "Admitted imports: blocks to transfer.")
      .def_ro("blocks_skipped", &ExternalKvCounters::blocks_skipped,
              "Admitted imports: blocks served by the local hit.")
      .def_ro("fills_in_flight", &ExternalKvCounters::fills_in_flight, "Now: fills not yet completed.")
      .def_ro("holds_active", &ExternalKvCounters::holds_active, "Now: leases, save pins and orphan holds.")
      .def_ro("blocks_held", &ExternalKvCounters::blocks_held, "Now: distinct blocks with an external reference.");

  nb::enum_<ClaimStatus>(m, "ClaimStatus", nb::is_arithmetic(),
                         "Why a consumer's claim on a producer hold is refused (check_claim).")
      .value("OK", ClaimStatus::kOk, "Every entry names a block of the hold at its current generation.")
      .value("UNKNOWN_HOLD", ClaimStatus::kUnknownHold,
             "No live lease or save pin has that id (never issued, released, expired, or an orphan hold).")
      .value("NOT_IN_HOLD", ClaimStatus::kNotInHold, "The entry's block is not one of the hold's blocks.")
      .value("STALE_GENERATION", ClaimStatus::kStaleGeneration,
             "The entry's block is in the hold at another generation (a reference from an earlier hold).");
  nb::class_<ClaimCheck>(m, "ClaimCheck", "Result of check_claim: the first failing entry and why.")
      .def_ro("status", &ClaimCheck::status, "OK, or why the claim is refused.")
      .def_ro("entry", &ClaimCheck::entry,
              "The first failing entry's index (0 for UNKNOWN_HOLD; the number of entries when OK).")
      .def_ro("current_generation", &ClaimCheck::current_generation,
              "STALE_GENERATION: the block's generation now.")
      .def_prop_ro("ok", &ClaimCheck::ok, "Whether the claim holds.")
      .def("__repr__", [](const ClaimCheck& c) {
        return std::string("ClaimCheck(status=") + to_string(c.status) + ", entry=" + std::to_string(c.entry) +
               ", current_generation=" + std::to_string(c.current_generation) + ")";
      });

  nb::class_<ExternalAdmitExplanation>(m, "ExternalAdmitExplanation",
                                       "KVCacheManager.explain_admit_external: an admission's prefix hit explained "
                                       "with its external part (how many tokens a fill would provide, from where).")
      .def_ro("local", &ExternalAdmitExplanation::local, "explain_admit's answer: the local hit and why it ends.")
      .def_ro("external_tokens", &ExternalAdmitExplanation::external_tokens,
              "Tokens the external source provides: positions [first_external_token, first_external_token + "
              "external_tokens).")
      .def_ro("clamped_tokens", &ExternalAdmitExplanation::clamped_tokens,
              "External tokens offered but not taken: under the local hit, or the last prompt token (computed here).")
      .def_ro("first_external_token", &ExternalAdmitExplanation::first_external_token,
              "Where the external tokens start: the local hit (lowered to a page boundary with coarse pages).")
      .def_ro("first_external_block", &ExternalAdmitExplanation::first_external_block,
              "first_external_token / block_size: the first block a fill writes.")
      .def_ro("external_blocks", &ExternalAdmitExplanation::external_blocks,
              "Blocks per group of the fill's ticket (a window group's entries outside the window are null).")
      .def_ro("skipped_blocks", &ExternalAdmitExplanation::skipped_blocks,
              "Blocks per group not transferred thanks to the local hit.")
      .def_prop_ro("computed_tokens", &ExternalAdmitExplanation::computed_tokens,
                   "Positions computed before the first step: first_external_token + external_tokens.");

  m.def("importable_tokens", &importable_tokens, "producer_tokens"_a, "prompt_len"_a, "local_hit_tokens"_a,
        "The external tokens an import may provide after a local hit: min(producer_tokens, prompt_len - 1) - "
        "local_hit_tokens, at least 0 (the last prompt token is computed here, for its logits). Pure.");
}

void bind_methods(nb::class_<Manager>& cls) {
  cls.def(
         "try_admit_external",
         [](Manager& s, SeqId seq, const Tokens& prompt, std::size_t num_external_tokens, const RequestKeys* keys,
            std::optional<std::size_t> max_cached_tokens, std::optional<std::size_t> num_reserved_tokens,
            std::size_t headroom_blocks, std::optional<std::size_t> prompt_retention_tokens,
            std::size_t shared_prefix_boundary) {
           const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens, nullptr,
                                                prompt_retention_tokens, shared_prefix_boundary);
           return s.work([&](auto& mm) {
             return mm.try_admit_external(seq, prompt.span(), num_external_tokens, keys, o, headroom_blocks);
           });
         },
         "seq"_a, "prompt"_a, "num_external_tokens"_a, "keys"_a = nb::none(), nb::kw_only(),
         "max_cached_tokens"_a = nb::none(), "num_reserved_tokens"_a = nb::none(), "headroom_blocks"_a = 0,
         "prompt_retention_tokens"_a = nb::none(), "shared_prefix_boundary"_a = 0,
         "Admit `seq` as try_admit does (the sparse window retention's boundaries too), taking "
         "`num_external_tokens` more prompt tokens (after the local prefix hit) from an external source (vLLM's num_external_computed_tokens), clamped so the last prompt token is "
         "computed here. All groups, all or nothing; NO_CAPACITY / NEVER_FITS change nothing. `headroom_blocks`: "
         "also NO_CAPACITY unless that many blocks stay available (room for fills in flight). The ticket's blocks "
         "are held by the fill until complete_external_fill / abort_sequence; a build refuses the sequence meanwhile. "
         "A window group's blocks wholly outside the window of the fill's end are not taken (null, as vLLM pads an "
         "external load's skipped blocks); a recurrent group's row ends in the block that receives the state; a "
         "coarse group's pages move whole from a page boundary. Raises as try_admit.")
      .def(
          "try_admit_external",
          [](Manager& s, SeqId seq, const PreparedPrompt& prompt, std::size_t num_external_tokens,
             std::optional<std::size_t> max_cached_tokens, std::optional<std::size_t> num_reserved_tokens,
             std::size_t headroom_blocks, std::optional<std::size_t> prompt_retention_tokens,
             std::size_t shared_prefix_boundary) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens, nullptr,
                                                 prompt_retention_tokens, shared_prefix_boundary);
            return s.work(
                [&](auto& mm) { return mm.try_admit_external(seq, prompt, num_external_tokens, o, headroom_blocks); });
          },
          "seq"_a, "prompt"_a, "num_external_tokens"_a, nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "num_reserved_tokens"_a = nb::none(), "headroom_blocks"_a = 0, "prompt_retention_tokens"_a = nb::none(),
          "shared_prefix_boundary"_a = 0,
          "try_admit_external of a prompt hashed beforehand by prepare_prompt (its keys included): the admission "
          "(its coarse-page hit and headroom check too) hashes nothing, so a KV connector's admission retried while "
          "the pool is full hashes each prompt once per request. Also raises InvalidArgumentError for a prompt "
          "prepared by a manager with another hasher, seed or block size.")
      .def(
          "query_admit_external",
          [](Manager& s, const Tokens& prompt, std::size_t num_external_tokens, const RequestKeys* keys,
             std::optional<std::size_t> max_cached_tokens, std::optional<std::size_t> num_reserved_tokens) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens);
            return s.work([&](auto& mm) { return mm.query_admit_external(prompt.span(), num_external_tokens, keys, o); });
          },
          "prompt"_a, "num_external_tokens"_a, "keys"_a = nb::none(), nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "num_reserved_tokens"_a = nb::none(),
          "What try_admit_external (without headroom) would take now, as query_admit says of try_admit: a window "
          "group's blocks the fill leaves out are not counted (pure). Raises as query_admit.")
      .def(
          "query_admit_external",
          [](Manager& s, const PreparedPrompt& prompt, std::size_t num_external_tokens,
             std::optional<std::size_t> max_cached_tokens, std::optional<std::size_t> num_reserved_tokens) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens);
            return s.work([&](auto& mm) { return mm.query_admit_external(prompt, num_external_tokens, o); });
          },
          "prompt"_a, "num_external_tokens"_a, nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "num_reserved_tokens"_a = nb::none(),
          "query_admit_external of a prompt hashed by prepare_prompt (pure; no hashing).")
      .def(
          "explain_admit_external",
          [](Manager& s, const Tokens& prompt, std::size_t num_external_tokens, const RequestKeys* keys,
             std::optional<std::size_t> max_cached_tokens) {
            const AdmitOptions o = admit_options(max_cached_tokens, std::nullopt);
            return s.work(
                [&](auto& mm) { return mm.explain_admit_external(prompt.span(), num_external_tokens, keys, o); });
          },
          "prompt"_a, "num_external_tokens"_a, "keys"_a = nb::none(), nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "explain_admit with the external part named: of `num_external_tokens` offered after the local hit, how "
          "many try_admit_external would take, from which token and block, how many blocks per group the fill "
          "would hold and skip: an ExternalAdmitExplanation (pure). Raises as explain_admit.")
      .def(
          "try_admit_external",
          [](Manager& s, SeqId seq, const Tokens& prompt, const Plan& plan, const RequestKeys* keys,
             std::optional<std::size_t> max_cached_tokens, std::optional<std::size_t> num_reserved_tokens,
             std::size_t headroom_blocks) {
            const AdmitOptions o = admit_options(max_cached_tokens, num_reserved_tokens);
            return s.work([&](auto& mm) {
              return mm.try_admit_external(seq, prompt.span(), plan, keys, o, headroom_blocks);
            });
          },
          "seq"_a, "prompt"_a, "plan"_a, "keys"_a = nb::none(), nb::kw_only(), "max_cached_tokens"_a = nb::none(),
          "num_reserved_tokens"_a = nb::none(), "headroom_blocks"_a = 0,
          "Consumer: try_admit_external of the tokens import `plan` (plan_import's, for this prompt and keys) "
          "provides; the ticket pairs one to one with plan.remote_blocks. Counts the import's blocks (transferred, "
          "skipped) when admitted, never at plan time. Raises InvalidArgumentError, nothing changed, when the local "
          "prefix hit changed since the plan (plan again) or the plan does not fit this pool or prompt.")
      .def(
          "complete_external_fill",
          [](Manager& s, std::uint64_t fill_id, std::optional<std::size_t> num_valid_blocks,
             std::optional<std::vector<std::size_t>> failed_blocks, ExternalFailurePolicy policy) {
            if (num_valid_blocks && failed_blocks) {
              detail::raise(Errc::kInvalidArgument,
                            "complete_external_fill: give num_valid_blocks or failed_blocks, not both");
            }
            const std::vector<std::size_t> failed = failed_blocks.value_or(std::vector<std::size_t>{});
            return s.work([&](auto& mm) {
              if (num_valid_blocks) return mm.complete_external_fill(fill_id, *num_valid_blocks, policy);
              return mm.complete_external_fill(fill_id, std::span<const std::size_t>(failed), policy);
            });
          },
          "fill_id"_a, "num_valid_blocks"_a = nb::none(), nb::kw_only(), "failed_blocks"_a = nb::none(),
          "policy"_a = ExternalFailurePolicy::kRecompute,
          "The fill is done (vLLM's finished_recving with invalid_block_ids): its first `num_valid_blocks` blocks "
          "per group hold the external K/V, or the blocks before the first of `failed_blocks` (indices from the "
          "ticket's first_block, any order); neither: every block is valid. The valid prefix counts as computed and "
          "its full blocks are registered now (deduplicated, BlockStored events); with failed blocks `policy` "
          "applies. A signal for a fill that is not live is counted (LATE, DUPLICATE, UNKNOWN), never raised. "
          "Raises InvalidArgumentError (both arguments; a count or index beyond a live fill's blocks): then nothing "
          "changes.")
      .def(
          "abort_sequence",
          [](Manager& s, SeqId seq, bool transfer_quiescent) {
            s.work([&](auto& mm) { mm.abort_sequence(seq, transfer_quiescent); });
          },
          "seq"_a, "transfer_quiescent"_a,
          "Abort `seq` (live or swapped) as free does. `transfer_quiescent`: no transfer can still write its fill's "
          "blocks, so they return at once; otherwise they become an orphan hold (in no table, never reused) until "
          "the fill's late signal or reap_external past the orphan timeout. Raises UnknownSequenceError.")
      .def(
          "external_fill_of",
          [](Manager& s, SeqId seq) { return s.peek([&](auto& mm) { return mm.external_fill_of(seq); }); },
          "seq"_a, "The fill id `seq` waits for (0: none).")
      .def(
          "layout_fingerprint",
          [](Manager& s, std::string page_layout, std::string dtype, std::uint32_t num_kv_heads, std::uint32_t head_dim,
             BlockIdentityConvention convention, std::optional<std::string> vllm_seed) {
            return s.peek([&](auto& mm) {
              if (vllm_seed) {
                return mm.layout_fingerprint(page_layout, dtype, num_kv_heads, head_dim, convention, *vllm_seed);
              }
              return mm.layout_fingerprint(page_layout, dtype, num_kv_heads, head_dim, convention);
            });
          },
          "page_layout"_a, "dtype"_a, "num_kv_heads"_a, "head_dim"_a, nb::kw_only(),
          "convention"_a = BlockIdentityConvention::kPagedkv, "vllm_seed"_a = nb::none(),
          "This pool's KvLayoutFingerprint for a hand-shake: block size, groups, hash algorithm and seed from the "
          "configuration; page layout, dtype, KV heads and head_dim from the caller. `vllm_seed`: vLLM's NONE_HASH "
          "seed text (VLLM_SHA256_CBOR only; default \"vllm-none-hash\"). Pure.")
      .def(
          "finish_with_lease",
          [](Manager& s, SeqId seq, const KvLayoutFingerprint& layout, std::optional<double> lease_deadline) {
            const auto deadline = to_time(lease_deadline);
            return s.work([&](auto& mm) { return mm.finish_with_lease(seq, layout, deadline); });
          },
          "seq"_a, "layout"_a, "lease_deadline"_a = nb::none(),
          "Producer: finish settled sequence `seq`, keeping its blocks (registered, hit-able, read-only, never "
          "evicted or reused) under a lease until release_lease (vLLM's finished_sending) or reap_external past "
          "`lease_deadline` (seconds on the reap clock; None: only the release ends it). Returns the "
          "HandoffDescriptor. Raises UnknownSequenceError; InvalidArgumentError (layout differs from this pool's, "
          "named; the sequence is not settled or waits for a fill) before anything changes.")
      .def(
          "release_lease",
          [](Manager& s, std::uint64_t hold_id) { return s.work([&](auto& mm) { return mm.release_lease(hold_id); }); },
          "hold_id"_a, "The consumer read lease `hold_id`'s blocks: it ends (APPLIED), or the signal is counted.")
      .def(
          "extend_lease",
          [](Manager& s, std::uint64_t hold_id, std::optional<double> deadline) {
            const auto d = to_time(deadline);
            return s.work([&](auto& mm) { return mm.extend_lease(hold_id, d); });
          },
          "hold_id"_a, "deadline"_a,
          "Heartbeat: lease (or save pin) `hold_id` now ends at `deadline` (seconds; None: only by its release). "
          "Counted when it has ended.")
      .def(
          "pin_for_save",
          [](Manager& s, SeqId seq, std::optional<double> deadline) {
            const auto d = to_time(deadline);
            return s.work([&](auto& mm) { return mm.pin_for_save(seq, d); });
          },
          "seq"_a, "deadline"_a = nb::none(),
          "Pin the built full blocks of live `seq` for a save to a store (LMCache, vLLM's offloading connector): "
          "until end_save, no preemption, free or eviction hands them to another sequence. Returns the pin id. "
          "Raises UnknownSequenceError.")
      .def(
          "end_save",
          [](Manager& s, std::uint64_t pin_id) { return s.work([&](auto& mm) { return mm.end_save(pin_id); }); },
          "pin_id"_a, "The save of pin `pin_id` completed or failed: its blocks are released. Counted when ended.")
      .def(
          "is_current_block",
          [](Manager& s, std::uint32_t block, std::uint32_t generation) {
            return s.work([&](auto& mm) { return mm.is_current_block(block, generation); });
          },
          "block"_a, "generation"_a,
          "Whether (block, generation) is a reference an external hold keeps now; a stale one is counted "
          "(stale_generations) and must be refused by the transfer.")
      .def(
          "check_claim",
          [](Manager& s, std::uint64_t hold_id, const std::vector<std::uint32_t>& blocks,
             const std::vector<std::uint32_t>& generations) {
            return s.work([&](auto& mm) { return mm.check_claim(hold_id, blocks, generations); });
          },
          "hold_id"_a, "blocks"_a, "generations"_a,
          "Producer: check a consumer's claim in one call (lease or save pin `hold_id`, entries (blocks[i], "
          "generations[i]), any subset, any order; a null entry, block 0 with generation 0, is skipped: an import "
          "plan's window entries): a ClaimCheck, OK or the first failing entry and why "
          "(UNKNOWN_HOLD, NOT_IN_HOLD, STALE_GENERATION: counted in stale_generations). Raises "
          "InvalidArgumentError when the lists differ in length.")
      .def(
          "evict_cached_block",
          [](Manager& s, std::uint32_t block) {
            return s.work([&](auto& mm) { return mm.evict_cached_block(block); });
          },
          "block"_a,
          "Evict `block`'s hash now (vLLM's evict_blocks after a failed load): it leaves the prefix index "
          "(BlockRemoved event); a cached block becomes free, a block still in a table or a hold stays there, never "
          "matchable again. Returns whether it was registered. Raises BlockOutOfRangeError.")
      .def(
          "reap_external",
          [](Manager& s, double now) {
            const auto t = to_time(now);
            return s.work([&](auto& mm) { return mm.reap_external(t); });
          },
          "now"_a,
          "External clock tick (seconds): ends every lease, save pin and orphan hold whose deadline is at or before "
          "`now`; returns how many ended. Call it every step.")
      .def(
          "set_orphan_timeout",
          [](Manager& s, double seconds) {
            if (!(seconds >= 0.0)) {
              detail::raise(Errc::kInvalidArgument,
                            "set_orphan_timeout: seconds = " + std::to_string(seconds) + ": expected >= 0");
            }
            const auto d = std::chrono::duration_cast<ExternalClock::duration>(std::chrono::duration<double>(seconds));
            s.work([&](auto& mm) { mm.set_orphan_timeout(d); });
          },
          "seconds"_a,
          "How long an orphan hold waits for its late signal after the last reap_external's `now` (default 480 s, "
          "vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT). Raises InvalidArgumentError for a negative value.")
      .def(
          "plan_import",
          [](Manager& s, const Descriptor& desc, const KvLayoutFingerprint& ours, const Tokens& prompt,
             const RequestKeys* keys) {
            return s.work([&](auto& mm) { return mm.plan_import(desc, ours, prompt.span(), keys); });
          },
          "desc"_a, "ours"_a, "prompt"_a, "keys"_a = nb::none(),
          "Consumer: what to transfer of hand-off `desc` for `prompt`: the fingerprints first (a mismatch raises "
          "InvalidArgumentError naming the field), then the descriptor's shape from its token count, then the "
          "identities against this prompt's. Only the blocks after this pool's own prefix hit are planned, up to "
          "importable_tokens. Counts nothing: try_admit_external with the plan counts the blocks transferred "
          "and skipped when admitted.")
      .def(
          "external_counters",
          [](Manager& s) { return s.work([](auto& mm) { return mm.stats().external; }); },
          "The ExternalKvCounters (lifetime counts, fills and holds now).")
      .def(
          "block_refcount",
          [](Manager& s, std::uint32_t block) {
            return s.peek([&](auto& mm) {
              if (block >= mm.allocator().num_blocks()) {
                detail::raise(Errc::kBlockOutOfRange, "block_refcount: block " + std::to_string(block) +
                                                          " >= num_blocks = " +
                                                          std::to_string(mm.allocator().num_blocks()));
              }
              return mm.allocator().refcount(block);
            });
          },
          "block"_a,
          "References on device block `block` now (block tables, fills, holds; 0: free or cached). For vLLM's "
          "KVCacheBlock.ref_cnt in pagedkv.vllm's connector surface. Raises BlockOutOfRangeError.");
}

}  // namespace

void bind_external_kv(nb::module_& m, nb::class_<Manager>& cls) {
  bind_types(m);
  bind_methods(cls);
}

}  // namespace pagedkv::python
