// pagedkv/detail/external_kv.hpp: the state machine of external KV (fills in flight and the blocks they hold,
// producer leases, save pins, orphan holds, per-block generations, the external clock, signal counters). A part of
// its own: the KVCacheManager holds one and forwards to it; it knows nothing of the manager (references are taken
// and dropped through the caller's `acquire(b)` / `release(b)`, a sequence's blocks are read through the caller's
// `blocks_of(g)`), so it is tested alone over a BlockAllocator. The pure pieces of a hand-off (layout fingerprints,
// block identities, descriptor checks, import plans) are detail/external_kv_handoff.hpp.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pagedkv/config.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/external_kv.hpp>
#include <pagedkv/stats.hpp>

namespace pagedkv::detail {

/// What holds external references on a block besides block tables (each takes one reference per block, so the
/// allocator can never evict or reuse the block while it lives).
enum class HoldKind : std::uint8_t {
  kLease = 0,    ///< Producer: a finished sequence's blocks kept until the consumer has read them.
  kSavePin = 1,  ///< A save to a store reads the blocks: no preemption or eviction hands them to another sequence.
  kOrphan = 2,   ///< A fill whose sequence was aborted while its transfer may still write: kept until the late
                 ///< signal or the deadline (never reused meanwhile: vLLM #46283 held forever, or worse, reused).
};

/// The state of external KV for one pool of `num_blocks` blocks.
///
/// Block states it adds to the allocator's (docs/design.md "External KV"): *filling* (held by a fill: in a block
/// table, never registered, so never matchable), *held* (a lease or a save pin: registered or not, read-only for
/// the transfer) and *orphaned* (a fill's blocks after a non-quiescent abort: in no table, unregistered, never
/// reused until the late signal or the deadline). Each is one reference per (holder, block).
///
/// Generations: `generation(b)` changes every time the last external reference on b ends, hence before any reuse of
/// b (a reuse needs refcount 0): a (block, generation) pair a descriptor or a ticket carries is current only while
/// an external hold keeps the block (`is_current`), so a stale reference is refused, never served (vLLM #52234).
/// The per-block arrays (8 bytes per block) are allocated at the first hold: a manager without external KV pays
/// nothing.
///
/// Signals for fills and holds that ended are counted (late: ended by abort or expiry; duplicate: ended by their own
/// signal; unknown: never issued), never thrown. Ids are never reused (one 64-bit counter for fills and holds).
/// Thread safety: none (the scheduler thread). Cost: O(log live) per fill or hold call plus O(blocks); reap O(holds).
template <BlockIdType Id = std::uint32_t>
class ExternalKvState {
 public:
  /// A fill in flight.
  struct Fill {
    SeqId seq = 0;
    std::size_t num_groups = 0;
    std::size_t first_block = 0;
    std::size_t first_token = 0;
    std::size_t end_token = 0;
    std::vector<Id> blocks;  ///< [num_groups x n] group-major
    /// Blocks per group.
    [[nodiscard]] std::size_t blocks_per_group() const noexcept { return num_groups == 0 ? 0 : blocks.size() / num_groups; }
    /// The positions computed once its first `num_valid` blocks (per group) hold K/V: end_token when all do, else
    /// first_token + num_valid blocks of `block_size` tokens (first_token is a local hit: whole blocks).
    [[nodiscard]] std::size_t computed_end(std::size_t num_valid, std::size_t block_size) const noexcept {
      return num_valid >= blocks_per_group() ? end_token : first_token + num_valid * block_size;
    }
  };
  /// A lease, save pin or orphan hold.
  struct Hold {
    HoldKind kind = HoldKind::kLease;
    SeqId seq = 0;                             ///< The sequence the blocks came from.
    std::vector<Id> blocks;                    ///< One reference each.
    std::optional<ExternalTimePoint> deadline;  ///< reap ends it at or after this; nullopt: only its signal does.
    std::uint64_t fill_id = 0;                 ///< kOrphan: the fill it came from.
  };
  /// The outcome of a fill signal: `fill` is the live fill taken (kApplied; its references already dropped).
  struct FillSignal {
    ExternalSignal status = ExternalSignal::kUnknown;
    std::optional<Fill> fill;
  };

  /// Ended ids remembered to tell late from duplicate signals; older ones count as late.
  static constexpr std::size_t kEndedMemory = 4096;

  explicit ExternalKvState(std::size_t num_blocks) : num_blocks_(num_blocks) {}

  /// No fill and no hold: the guard of every hook on the one-engine paths.
  [[nodiscard]] bool empty() const noexcept { return fills_.empty() && holds_.empty(); }
  /// Fills in flight.
  [[nodiscard]] std::size_t num_fills() const noexcept { return fills_.size(); }
  /// Leases, save pins and orphan holds.
  [[nodiscard]] std::size_t num_holds() const noexcept { return holds_.size(); }
  /// The fill `seq` waits for, or 0.
  [[nodiscard]] std::uint64_t fill_of(SeqId seq) const {
    if (by_seq_.empty()) return 0;
    const auto it = by_seq_.find(seq);
    return it == by_seq_.end() ? 0 : it->second;
  }
  /// The live fill `id`, or null.
  [[nodiscard]] const Fill* fill(std::uint64_t id) const {
    const auto it = fills_.find(id);
    return it == fills_.end() ? nullptr : &it->second;
  }
  /// The live hold `id`, or null.
  [[nodiscard]] const Hold* hold(std::uint64_t id) const {
    const auto it = holds_.find(id);
    return it == holds_.end() ? nullptr : &it->second;
  }
  /// External references on block b (fills + holds).
  [[nodiscard]] std::uint32_t references(Id b) const noexcept { return refs_.empty() ? 0 : refs_[b]; }
  /// Block b's generation now (see the class comment).
  [[nodiscard]] std::uint32_t generation(Id b) const noexcept { return gen_.empty() ? 0 : gen_[b]; }
  /// Whether (b, gen) names a block an external hold keeps now, at that generation. Counts a refusal as stale.
  [[nodiscard]] bool is_current(Id b, std::uint32_t gen) {
    const bool ok = b != Id{0} && b < num_blocks_ && references(b) != 0 && generation(b) == gen;
    if (!ok) ++c_.stale_generations;
    return ok;
  }

  /// A consumer's claim on lease or save pin `hold_id`: entry i names (blocks[i], generations[i]). kOk when every
  /// block is one of the hold's at its current generation (a null entry, block 0 with generation 0, names nothing
  /// to read: a window group's block outside the consumer's window; skipped); otherwise the first failing entry and
  /// why (an orphan hold is no hold a consumer may read: kUnknownHold). A stale entry is counted
  /// (stale_generations). Throws kInvalidArgument when the two spans differ in length. O(hold blocks x log +
  /// entries x log); allocates.
  [[nodiscard]] ClaimCheck check_claim(std::uint64_t hold_id, std::span<const Id> blocks,
                                       std::span<const std::uint32_t> generations) {
    if (blocks.size() != generations.size()) {
      detail::raise(Errc::kInvalidArgument, "check_claim: " + std::to_string(blocks.size()) + " blocks but " +
                                                std::to_string(generations.size()) + " generations");
    }
    const auto it = holds_.find(hold_id);
    if (it == holds_.end() || it->second.kind == HoldKind::kOrphan) return {ClaimStatus::kUnknownHold, 0, 0};
    std::vector<Id> mine(it->second.blocks);
    std::sort(mine.begin(), mine.end());
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (blocks[i] == Id{0} && generations[i] == 0) continue;  // nothing to read (plan_import's null entries)
      if (!std::binary_search(mine.begin(), mine.end(), blocks[i])) return {ClaimStatus::kNotInHold, i, 0};
      if (generation(blocks[i]) != generations[i]) {
        ++c_.stale_generations;
        return {ClaimStatus::kStaleGeneration, i, generation(blocks[i])};
      }
    }
    return {ClaimStatus::kOk, blocks.size(), 0};
  }

  /// Start fill `seq` over `blocks` ([num_groups x n] group-major, every one held by the caller's table), taking one
  /// reference each through `acquire(b)`; a null entry (block 0: a window group's block outside the window of the
  /// first query, never transferred) takes none. Returns the fill id. Throws kDuplicateSequence when `seq` already
  /// waits for a fill, kInvalidArgument for an out-of-range block or a shape not a multiple of num_groups; an
  /// exception of `acquire` is rethrown after the references taken are dropped through `release`: nothing changes.
  template <class Acquire, class Release>
  std::uint64_t begin_fill(SeqId seq, std::size_t num_groups, std::size_t first_block, std::size_t first_token,
                           std::size_t end_token, std::span<const Id> blocks, Acquire&& acquire, Release&& release) {
    if (by_seq_.contains(seq)) {
      detail::raise(Errc::kDuplicateSequence, "begin_fill: sequence " + std::to_string(seq) +
                                                  " already waits for fill " + std::to_string(by_seq_.at(seq)));
    }
    if (num_groups == 0 || blocks.size() % num_groups != 0 || end_token < first_token) {
      detail::raise(Errc::kInvalidArgument, "begin_fill: " + std::to_string(blocks.size()) + " blocks over " +
                                                std::to_string(num_groups) + " groups, tokens [" +
                                                std::to_string(first_token) + ", " + std::to_string(end_token) + ")");
    }
    check_blocks(blocks, "begin_fill", /*allow_null=*/true);
    const std::uint64_t id = next_id_;
    Fill f{seq, num_groups, first_block, first_token, end_token, std::vector<Id>(blocks.begin(), blocks.end())};
    by_seq_.reserve(by_seq_.size() + 1);
    auto [it, inserted] = fills_.emplace(id, std::move(f));
    try {
      take_refs(blocks, acquire, release);
    } catch (...) {
      fills_.erase(it);
      throw;
    }
    by_seq_.emplace(seq, id);  // reserved: cannot throw
    ++next_id_;
    ++c_.fills_started;
    c_.fill_blocks += blocks.size() - static_cast<std::size_t>(std::count(blocks.begin(), blocks.end(), Id{0}));
    return id;
  }

  /// The completion or failure signal of fill `id`. A live fill is taken out (its references dropped through
  /// `release`, before the caller registers or frees its blocks) and returned with kApplied; an orphaned fill's hold
  /// ends now (kLate); a fill that ended is kLate (aborted, expired) or kDuplicate (completed); an id never issued is
  /// kUnknown. Never throws for a bad id.
  template <class Release>
  FillSignal take_fill(std::uint64_t id, Release&& release) {
    FillSignal out;
    if (const auto it = fills_.find(id); it != fills_.end()) {
      for (Id b : it->second.blocks) drop_ref(b, release);
      by_seq_.erase(it->second.seq);
      out.fill = std::move(it->second);
      fills_.erase(it);
      remember_end(id, End::kSignalled);
      out.status = ExternalSignal::kApplied;
      return out;
    }
    if (const auto o = orphan_of_fill_.find(id); o != orphan_of_fill_.end()) {
      end_hold(o->second, release, End::kSignalled);
      ++c_.orphans_released;
      ++c_.late_signals;
      out.status = ExternalSignal::kLate;
      return out;
    }
    out.status = classify_ended(id);
    return out;
  }

  /// The sequence of fill `seq` is freed, aborted or preempted while its fill is in flight. `quiescent`: the
  /// transfer can no longer write (the caller knows it stopped): the references go at once. Otherwise they become an
  /// orphan hold (ended by the late signal, or by reap at `orphan_deadline`; nullopt: only the signal). Returns the
  /// fill id (0: `seq` had no fill; nothing changes). Allocates the orphan hold (may throw std::bad_alloc before any
  /// change).
  template <class Release>
  std::uint64_t abort_fill(SeqId seq, bool quiescent, std::optional<ExternalTimePoint> orphan_deadline,
                           Release&& release) {
    const std::uint64_t id = fill_of(seq);
    if (id == 0) return 0;
    const auto it = fills_.find(id);
    if (!quiescent) {
      orphan_of_fill_.reserve(orphan_of_fill_.size() + 1);
      Hold h{HoldKind::kOrphan, seq, std::move(it->second.blocks), orphan_deadline, id};
      const std::uint64_t hid = next_id_++;
      holds_.emplace(hid, std::move(h));  // references move from the fill to the hold
      orphan_of_fill_.emplace(id, hid);
      ++c_.orphan_holds;
    } else {
      for (Id b : it->second.blocks) drop_ref(b, release);
      remember_end(id, End::kAborted);
    }
    fills_.erase(it);
    by_seq_.erase(seq);
    ++c_.fills_aborted;
    return id;
  }

  /// Hold `blocks` (each held or cached by the caller's pool; duplicates allowed: one reference each) as a lease or
  /// save pin of `seq`, until `release_hold`, or reap at `deadline` (nullopt: only release). Returns the hold id.
  /// Throws kInvalidArgument (kind kOrphan, a null or out-of-range block); `acquire`'s exceptions after undoing.
  template <class Acquire, class Release>
  std::uint64_t add_hold(HoldKind kind, SeqId seq, std::span<const Id> blocks,
                         std::optional<ExternalTimePoint> deadline, Acquire&& acquire, Release&& release) {
    if (kind == HoldKind::kOrphan) {
      detail::raise(Errc::kInvalidArgument, "add_hold: orphan holds come from abort_fill only");
    }
    check_blocks(blocks, "add_hold");
    const std::uint64_t id = next_id_;
    auto [it, inserted] =
        holds_.emplace(id, Hold{kind, seq, std::vector<Id>(blocks.begin(), blocks.end()), deadline, 0});
    try {
      take_refs(blocks, acquire, release);
    } catch (...) {
      holds_.erase(it);
      throw;
    }
    ++next_id_;
    if (kind == HoldKind::kLease) {
      ++c_.leases_started;
    } else {
      ++c_.save_pins_started;
    }
    return id;
  }

  /// End lease or save pin `id` (the consumer's read-done, or the save's completion or failure): its references
  /// drop through `release`. Late, duplicate and unknown ids (and orphan holds, which end by their fill's signal)
  /// are counted and change nothing.
  template <class Release>
  ExternalSignal release_hold(std::uint64_t id, Release&& release) {
    const auto it = holds_.find(id);
    if (it == holds_.end()) return classify_ended(id);
    if (it->second.kind == HoldKind::kOrphan) {
      ++c_.unknown_signals;
      return ExternalSignal::kUnknown;
    }
    if (it->second.kind == HoldKind::kLease) {
      ++c_.leases_released;
    } else {
      ++c_.save_pins_ended;
    }
    end_hold(id, release, End::kSignalled);
    return ExternalSignal::kApplied;
  }

  /// Heartbeat of lease (or pin) `id`: its deadline becomes `deadline` (nullopt: none). Signals for holds that
  /// ended are counted and change nothing.
  ExternalSignal extend(std::uint64_t id, std::optional<ExternalTimePoint> deadline) {
    const auto it = holds_.find(id);
    if (it == holds_.end()) return classify_ended(id);
    if (it->second.kind == HoldKind::kOrphan) {
      ++c_.unknown_signals;
      return ExternalSignal::kUnknown;
    }
    it->second.deadline = deadline;
    ++c_.leases_extended;
    return ExternalSignal::kApplied;
  }

  /// End every hold whose deadline is at or before `now` (expired leases, forgotten save pins, orphan holds whose
  /// late signal never came), in id order; returns how many. O(holds).
  template <class Release>
  std::size_t reap(ExternalTimePoint now, Release&& release) {
    std::size_t n = 0;
    for (auto it = holds_.begin(); it != holds_.end();) {
      const auto next = std::next(it);
      if (it->second.deadline && *it->second.deadline <= now) {
        switch (it->second.kind) {
          case HoldKind::kLease: ++c_.leases_expired; break;
          case HoldKind::kSavePin: ++c_.save_pins_ended; break;
          case HoldKind::kOrphan: ++c_.orphans_expired; break;
        }
        end_hold(it->first, release, End::kExpired);
        ++n;
      }
      it = next;
    }
    return n;
  }

  /// Start the fill of admitted `seq`'s positions [first_token, first_token + num_tokens) (first_token: its local
  /// hit, whole blocks of `block_size`): every group's blocks of those positions, read from `blocks_of(g)` (the
  /// group's block table, a span of Id), are held as begin_fill holds them, but for the logical blocks before
  /// `first_sent(g)` (a window group's blocks outside the window of the query at the fill's end: null in the
  /// ticket, never transferred, left in the table for a recompute). Returns the ticket (blocks and their
  /// generations, 0 for a null entry). Throws as begin_fill; nothing changes then.
  template <class BlocksOf, class FirstSent, class Acquire, class Release>
  FillTicket<Id> open_fill(SeqId seq, std::size_t num_groups, std::size_t block_size, std::size_t first_token,
                           std::size_t num_tokens, BlocksOf&& blocks_of, FirstSent&& first_sent, Acquire&& acquire,
                           Release&& release) {
    FillTicket<Id> t;
    t.seq = seq;
    t.num_groups = num_groups;
    t.first_block = first_token / block_size;
    t.first_token = first_token;
    t.end_token = first_token + num_tokens;
    const std::size_t nb = (t.end_token + block_size - 1) / block_size - t.first_block;
    t.blocks.reserve(nb * num_groups);
    t.generations.reserve(nb * num_groups);
    for (std::size_t g = 0; g < num_groups; ++g) {
      const std::span<const Id> blocks = std::span<const Id>(blocks_of(g)).subspan(t.first_block, nb);
      const std::size_t sent = std::clamp(first_sent(g), t.first_block, t.first_block + nb) - t.first_block;
      t.blocks.insert(t.blocks.end(), sent, Id{0});
      t.blocks.insert(t.blocks.end(), blocks.begin() + static_cast<std::ptrdiff_t>(sent), blocks.end());
    }
    t.fill_id = begin_fill(seq, num_groups, t.first_block, t.first_token, t.end_token, std::span<const Id>(t.blocks),
                           acquire, release);
    for (Id b : t.blocks) t.generations.push_back(generation(b));  // reserved: cannot throw
    return t;
  }

  /// Blocks per group of fill `id` when it is live (0 otherwise: its signal is only counted). Throws
  /// kInvalidArgument when `num_valid` exceeds them (live fill only; nothing changes).
  [[nodiscard]] std::size_t check_valid_blocks(std::uint64_t id, std::size_t num_valid) const {
    const Fill* f = fill(id);
    const std::size_t nb = f ? f->blocks_per_group() : 0;
    if (f && num_valid > nb) {
      detail::raise(Errc::kInvalidArgument, "complete_external_fill: fill " + std::to_string(id) + " has " +
                                                std::to_string(nb) + " blocks per group, not " +
                                                std::to_string(num_valid) + " valid ones");
    }
    return nb;
  }
  /// The valid blocks of fill `id` given its failed block indices (from its first_block, any order): those before
  /// the first failed one. Throws kInvalidArgument for an index beyond a live fill's blocks.
  [[nodiscard]] std::size_t valid_prefix(std::uint64_t id, std::span<const std::size_t> failed_blocks) const {
    const Fill* f = fill(id);
    const std::size_t nb = f ? f->blocks_per_group() : 0;
    std::size_t valid = nb;
    for (std::size_t i : failed_blocks) {
      if (f && i >= nb) {
        detail::raise(Errc::kInvalidArgument, "complete_external_fill: failed block " + std::to_string(i) +
                                                  " outside fill " + std::to_string(id) + "'s " + std::to_string(nb) +
                                                  " blocks");
      }
      valid = std::min(valid, i);
    }
    return valid;
  }

  /// Producer: lease `seq`'s blocks of positions [0, num_tokens) (every group's `[ceil(num_tokens / block_size)]`
  /// logical blocks, each read as `block_at(g, i)`: the block to hand off, or 0 when the consumer needs none there,
  /// e.g. a window group's block outside the window) until release_hold or reap at `deadline`, and describe them:
  /// blocks (0 kept as 0), their generations (0 for a null entry), the given `identities` and `layout`. Throws as
  /// add_hold; nothing changes then.
  template <class BlockAt, class Acquire, class Release>
  HandoffDescriptor<Id> open_lease(SeqId seq, std::size_t num_tokens, std::size_t num_groups, std::size_t block_size,
                                   BlockAt&& block_at, std::vector<BlockIdentity> identities,
                                   const KvLayoutFingerprint& layout, std::optional<ExternalTimePoint> deadline,
                                   Acquire&& acquire, Release&& release) {
    HandoffDescriptor<Id> d;
    d.num_tokens = num_tokens;
    d.num_groups = num_groups;
    d.layout = layout;
    d.identities = std::move(identities);
    const std::size_t nb = (num_tokens + block_size - 1) / block_size;
    d.blocks.reserve(nb * num_groups);
    std::vector<Id> held;
    held.reserve(nb * num_groups);
    for (std::size_t g = 0; g < num_groups; ++g) {
      for (std::size_t i = 0; i < nb; ++i) {
        d.blocks.push_back(block_at(g, i));
        if (d.blocks.back() != Id{0}) held.push_back(d.blocks.back());
      }
    }
    d.generations.reserve(d.blocks.size());
    d.hold_id = add_hold(HoldKind::kLease, seq, std::span<const Id>(held), deadline, acquire, release);
    for (Id b : d.blocks) d.generations.push_back(b == Id{0} ? 0 : generation(b));  // reserved: cannot throw
    return d;
  }
  /// Pin the first `num_blocks` blocks of every group of `seq` (from `blocks_of(g)`; null entries skipped) for a
  /// save, until release_hold or reap at `deadline`. Returns the pin id. Throws as add_hold.
  template <class BlocksOf, class Acquire, class Release>
  std::uint64_t pin_for_save(SeqId seq, std::size_t num_groups, std::size_t num_blocks, BlocksOf&& blocks_of,
                             std::optional<ExternalTimePoint> deadline, Acquire&& acquire, Release&& release) {
    std::vector<Id> blocks;
    for (std::size_t g = 0; g < num_groups; ++g) {
      const std::span<const Id> table(blocks_of(g));
      for (Id b : table.first(std::min(num_blocks, table.size()))) {
        if (b != Id{0}) blocks.push_back(b);
      }
    }
    return add_hold(HoldKind::kSavePin, seq, std::span<const Id>(blocks), deadline, acquire, release);
  }

  /// The external clock: reap at `now` (as reap) and remember the latest `now` for the orphan deadlines of later
  /// aborts.
  template <class Release>
  std::size_t tick(ExternalTimePoint now, Release&& release) {
    now_ = clock_set_ ? std::max(now_, now) : now;
    clock_set_ = true;
    return reap(now, release);
  }
  /// How long an orphan hold waits for its late signal after the last tick (default 480 s, vLLM's
  /// VLLM_NIXL_ABORT_REQUEST_TIMEOUT). Before the first tick an orphan hold has no deadline.
  void set_orphan_timeout(ExternalClock::duration d) noexcept { orphan_timeout_ = d; }
  /// The deadline an orphan hold made now gets: the last tick + the orphan timeout (nullopt before any tick).
  [[nodiscard]] std::optional<ExternalTimePoint> orphan_deadline() const noexcept {
    return clock_set_ ? std::optional(now_ + orphan_timeout_) : std::nullopt;
  }
  /// abort_fill with the clock's orphan deadline.
  template <class Release>
  std::uint64_t abort_fill(SeqId seq, bool quiescent, Release&& release) {
    return abort_fill(seq, quiescent, orphan_deadline(), release);
  }
  /// Throws kInvalidArgument unless `seq` is `settled` (all slots built, no lookahead, no copy in flight) and waits
  /// for no fill: a hand-off (`what`) exports only computed blocks.
  void check_settled(SeqId seq, bool settled, const char* what) const {
    if (!settled || fill_of(seq) != 0) {
      detail::raise(Errc::kInvalidArgument, std::string(what) + ": sequence " + std::to_string(seq) +
                                                " is not settled (unbuilt slots, lookahead, a copy or a fill in "
                                                "flight): hand off after the step that computed it");
    }
  }
  /// Throws kInvalidArgument naming the first sequence of `batch` that waits for a fill (`what`: the refused call).
  [[gnu::cold, gnu::noinline]] void refuse_waiting(std::span<const SeqId> batch, const char* what) const {
    for (SeqId id : batch) {
      if (const std::uint64_t f = fill_of(id); f != 0) {
        detail::raise(Errc::kInvalidArgument, std::string(what) + ": sequence " + std::to_string(id) +
                                                  " waits for external KV (fill " + std::to_string(f) +
                                                  "): complete_external_fill or abort_sequence it first");
      }
    }
  }

  /// Count an admitted import's blocks (transferred vs skipped thanks to the local hit; all groups).
  void count_import(std::size_t transferred, std::size_t skipped) noexcept {
    c_.blocks_transferred += transferred;
    c_.blocks_skipped += skipped;
  }
  /// Count a fill's outcome: `valid` blocks kept; `partial` some failed; `failed` the sequence failed.
  void count_completion(std::size_t valid, bool partial, bool failed) noexcept {
    c_.fill_blocks_valid += valid;
    if (failed) {
      ++c_.fills_failed;
    } else if (partial) {
      ++c_.fills_partial;
    } else {
      ++c_.fills_completed;
    }
  }
  /// The counters, with the state now.
  [[nodiscard]] ExternalKvCounters counters() const noexcept {
    ExternalKvCounters c = c_;
    c.fills_in_flight = fills_.size();
    c.holds_active = holds_.size();
    c.blocks_held = blocks_held_;
    return c;
  }
  /// Visit every live hold as f(id, const Hold&) in id order.
  template <class F>
  void for_each_hold(F&& f) const {
    for (const auto& [id, h] : holds_) f(id, h);
  }

 private:
  enum class End : std::uint8_t { kSignalled, kAborted, kExpired };

  void check_blocks(std::span<const Id> blocks, const char* what, bool allow_null = false) const {
    for (Id b : blocks) {
      if ((b == Id{0} && !allow_null) || b >= num_blocks_) {
        detail::raise(Errc::kInvalidArgument, std::string(what) + ": block " + std::to_string(b) + " outside [1, " +
                                                  std::to_string(num_blocks_) + ")");
      }
    }
  }
  template <class Acquire, class Release>
  void take_refs(std::span<const Id> blocks, Acquire& acquire, Release& release) {
    if (refs_.empty()) {
      refs_.assign(num_blocks_, 0);
      gen_.assign(num_blocks_, 0);
    }
    std::size_t done = 0;
    try {
      for (; done < blocks.size(); ++done) {
        if (blocks[done] == Id{0}) continue;  // a fill's null entry: no reference
        acquire(blocks[done]);
        if (refs_[blocks[done]]++ == 0) ++blocks_held_;
      }
    } catch (...) {
      while (done > 0) drop_ref(blocks[--done], release);
      throw;
    }
  }
  template <class Release>
  void drop_ref(Id b, Release& release) {
    if (b == Id{0}) return;  // a fill's null entry: no reference
    if (--refs_[b] == 0) {
      ++gen_[b];
      --blocks_held_;
    }
    release(b);
  }
  template <class Release>
  void end_hold(std::uint64_t id, Release& release, End why) {
    const auto it = holds_.find(id);
    // Release in reverse: the last block of a sequence goes first, as a free does.
    for (auto b = it->second.blocks.rbegin(); b != it->second.blocks.rend(); ++b) drop_ref(*b, release);
    if (it->second.kind == HoldKind::kOrphan) {
      orphan_of_fill_.erase(it->second.fill_id);
      remember_end(it->second.fill_id, End::kAborted);
    }
    holds_.erase(it);
    remember_end(id, why);
  }
  void remember_end(std::uint64_t id, End why) {
    if (!ended_.insert_or_assign(id, why).second) return;
    if (ended_order_.size() < kEndedMemory) {
      ended_order_.push_back(id);
      return;
    }
    ended_.erase(ended_order_[ended_head_]);  // the oldest remembered id
    ended_order_[ended_head_] = id;
    ended_head_ = (ended_head_ + 1) % kEndedMemory;
  }
  ExternalSignal classify_ended(std::uint64_t id) {
    if (id == 0 || id >= next_id_) {
      ++c_.unknown_signals;
      return ExternalSignal::kUnknown;
    }
    const auto it = ended_.find(id);
    if (it != ended_.end() && it->second == End::kSignalled) {
      ++c_.duplicate_signals;
      return ExternalSignal::kDuplicate;
    }
    ++c_.late_signals;  // aborted, expired, or ended so long ago that it is forgotten
    return ExternalSignal::kLate;
  }

  std::size_t num_blocks_;
  std::uint64_t next_id_ = 1;
  std::map<std::uint64_t, Fill> fills_;                       // live fills by id
  std::unordered_map<SeqId, std::uint64_t> by_seq_;           // waiting sequence -> its fill
  std::map<std::uint64_t, Hold> holds_;                       // leases, save pins, orphan holds by id
  std::unordered_map<std::uint64_t, std::uint64_t> orphan_of_fill_;  // aborted fill id -> its orphan hold
  std::unordered_map<std::uint64_t, End> ended_;              // recently ended ids (kEndedMemory)
  std::vector<std::uint64_t> ended_order_;                    // ring of ended_'s ids, oldest at ended_head_
  std::size_t ended_head_ = 0;
  std::vector<std::uint32_t> refs_;                           // [num_blocks] external references (lazy)
  std::vector<std::uint32_t> gen_;                            // [num_blocks] generations (lazy)
  std::size_t blocks_held_ = 0;
  ExternalTimePoint now_{};                                   // the external clock (tick)
  bool clock_set_ = false;                                    // tick was called (orphan deadlines need it)
  ExternalClock::duration orphan_timeout_ = std::chrono::seconds(480);
  ExternalKvCounters c_;
};

}  // namespace pagedkv::detail
