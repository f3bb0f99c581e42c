// tests/fuzz/manager_model.hpp: the shadow model the manager fuzzer (fuzz_manager.cpp) checks KVCacheManager
// against. It is independent of the op decoding, so a new manager operation only needs a driver case that
// predicts its outcome with the helpers here and tells the model what changed.
//
// What the model keeps:
//  - per live sequence: known token ids, lookahead drafts (ids the host does not know yet), extra keys, a K/V
//    fingerprint per position (a function of the token prefix and the keys covering it), the chain hashes of its
//    known full blocks, and its cursors: positions written (built), positions with slots (slotted);
//  - a shadow K/V pool, one fingerprint per slot, that a build updates exactly as the kernels would: every copy
//    of the copy list (all sources read before any destination is written: copy_blocks runs its copies in
//    parallel), then every slot of the slot mapping. Blocks that become free or are evicted are poisoned;
//  - sequence ids preempted and not re-admitted, the interval's prefix-cache statistics, event batches taken.
// What it checks (check_all after every operation, check_build_and_run_kernels after every build):
//  - per sequence: slotted length, token ids, block count, no null or out-of-range block, pending slots = own
//    positions, the manager's cursors (built / slotted / known / lookahead / settled);
//  - refcount(b) = tables holding b + pending copies reading b; every usable block exactly one of free / cached /
//    held, matching stats(); hashed <=> registered; a registered block carries its sequence's chain hash, and
//    every block whose writes are issued and whose ids are known is registered; the LRU holds the cached blocks;
//  - pending copies: src != dst, no block both a source and a destination, each destination held by a table;
//  - a build's outputs against the state before it (page table over the positions written by the end of the
//    step, padded table, seq_lens, qo_indptr, slot mapping with -1 exactly for deduplicated blocks, copy list,
//    padding), registration / deduplication of the blocks it completes, no write into a block another table
//    holds or that was registered before, no slot written twice;
//  - content, after every operation: every written position of every live sequence reads, through its block
//    table (and through a pending copy into it), the fingerprint of its own prefix;
//  - events: seq_no +1 each, numbered batches, stored events carry the block's tokens, position, parent, adapter,
//    salt and overlapping multimodal items and rehash to their hash, index size and eviction counter agree with
//    stored / removed events, the event snapshot lists exactly the registered hashes;
//  - snapshots for the strong guarantee: a failed call (error, no capacity, never fits) changes nothing.
// A violation prints the API calls of the input so far (a reproducer) and aborts.
#pragma once

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pagedkv/error.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/kv_cache_manager.hpp>

namespace pagedkv_fuzz {

using pagedkv::BlockHash;
using pagedkv::CacheStats;
using pagedkv::Errc;
using pagedkv::KVEvent;
using pagedkv::KVEventType;
using pagedkv::MultimodalItem;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Toks = std::vector<TokenId>;
using Slots = std::vector<std::int64_t>;
using Blocks = std::vector<std::uint64_t>;

/// SplitMix64's finalizer (the model's fingerprint mixer).
inline std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// ---- multimodal items, computed without overflow (the model's definition of what an item covers) -------------
/// Whether item `m` covers position `p`: offset <= p < offset + length, for any offset and length.
inline bool item_covers(const MultimodalItem& m, std::uint64_t p) {
  return p >= m.offset_tokens && p - m.offset_tokens < m.length_tokens;
}
/// Whether item `m` covers some position of the non-empty range [start, end).
inline bool item_overlaps(const MultimodalItem& m, std::uint64_t start, std::uint64_t end) {
  return m.length_tokens > 0 && m.offset_tokens < end &&
         (m.offset_tokens >= start || start - m.offset_tokens < m.length_tokens);
}
/// Whether `keys` are valid for a prompt of `len` tokens (request_keys.hpp): every item non-empty, inside the
/// prompt (offset + length <= len, without overflow), items sorted by offset.
inline bool keys_valid(const RequestKeys* keys, std::size_t len) {
  if (keys == nullptr) return true;
  std::uint64_t prev = 0;
  for (const MultimodalItem& m : keys->multimodal) {
    if (m.length_tokens == 0 || m.offset_tokens > len || m.length_tokens > len - m.offset_tokens) return false;
    if (m.offset_tokens < prev) return false;
    prev = m.offset_tokens;
  }
  return true;
}

// ---- failure reporting --------------------------------------------------------------------------------------------
/// The API calls of the current input, in order, printed with every failure (the reproducer).
class CallLog {
 public:
  void clear() { lines_.clear(); }
  void add(std::string line) {
    if (verbose()) std::fprintf(stderr, "  %s\n", line.c_str());
    lines_.push_back(std::move(line));
  }
  /// Amend the last line (the outcome of the call it names).
  void result(const std::string& r) {
    if (!lines_.empty()) lines_.back() += "  -> " + r;
    if (verbose()) std::fprintf(stderr, "    -> %s\n", r.c_str());
  }
  [[nodiscard]] const std::vector<std::string>& lines() const noexcept { return lines_; }
  /// PAGEDKV_FUZZ_VERBOSE=1: print each call as it is made.
  static bool verbose() {
    static const bool v = [] {
      const char* e = std::getenv("PAGEDKV_FUZZ_VERBOSE");
      return e != nullptr && e[0] == '1';
    }();
    return v;
  }

 private:
  std::vector<std::string> lines_;
};

[[noreturn]] inline void report_failure(const CallLog& log, const std::string& what) {
  std::fprintf(stderr, "\n==== pagedkv fuzz: invariant violated: %s\n==== API calls of this input (%zu):\n",
               what.c_str(), log.lines().size());
  for (const std::string& l : log.lines()) std::fprintf(stderr, "  %s\n", l.c_str());
  std::fflush(stderr);
  std::abort();
}

/// Compact text of a token list for the call log.
inline std::string toks_text(std::span<const TokenId> t) {
  std::string s = "[";
  const std::size_t n = t.size();
  const auto put = [&](std::size_t i) { s += std::to_string(t[i]) + (i + 1 < n ? "," : ""); };
  if (n <= 40) {
    for (std::size_t i = 0; i < n; ++i) put(i);
  } else {
    for (std::size_t i = 0; i < 16; ++i) put(i);
    std::uint64_t h = 0;
    for (TokenId x : t) h = mix64(h ^ static_cast<std::uint32_t>(x));
    char mid[96];
    std::snprintf(mid, sizeof mid, " ...(%zu tokens, fingerprint %016" PRIx64 ")... ", n, h);
    s += mid;
    for (std::size_t i = n - 8; i < n; ++i) put(i);
  }
  return s + "]";
}

inline std::string keys_text(const RequestKeys* k) {
  if (k == nullptr) return "no keys";
  std::string s = "keys{adapter " + std::to_string(k->adapter_id) + ", salt \"" + k->salt + "\"";
  for (const MultimodalItem& m : k->multimodal) {
    s += ", item " + std::to_string(m.item_hash.low64() & 0xFFFF) + "@" + std::to_string(m.offset_tokens) + "+" +
         std::to_string(m.length_tokens);
  }
  return s + "}";
}

inline std::string errc_text(Errc c) { return pagedkv::to_string(c); }

// ---- the model ----------------------------------------------------------------------------------------------------
template <class Mgr>
class ManagerModel {
 public:
  using Id = typename Mgr::block_id_type;
  using Policy = typename Mgr::allocator_type::eviction_policy_type;
  /// LruEviction: the exact eviction order after a release is predictable (expected_lru_after_release).
  static constexpr bool kExactLru = std::is_same_v<Policy, pagedkv::LruEviction<Id>>;
  /// A retention-priority policy (PriorityLruEviction): admissions carry retention configs, priorities are checked.
  static constexpr bool kHasRetention = pagedkv::RetentionEvictionPolicy<Policy, Id>;
  using Hasher = typename Mgr::hasher_type;
  static constexpr std::uint64_t kPoison = 0xDEADDEADDEADDEADULL;

  /// A live sequence as the model sees it. Positions: [0, built) written (or cache hits), [built, slotted) slots
  /// reserved, writes pending, [slotted, known) prompt tokens without slots (chunked admission); or, with
  /// lookahead, the last `lookahead` slotted positions hold draft tokens the host does not know yet.
  struct MSeq {
    Toks tokens;                              // known token ids, [known]
    Toks drafts;                              // lookahead drafts (the verification step's ids), [lookahead]
    std::shared_ptr<const RequestKeys> keys;  // null = none
    std::vector<std::uint64_t> fp;            // K/V fingerprint of each position, [known + lookahead]
    std::vector<BlockHash> hashes;            // chain hashes of the known full blocks (prefix caching on)
    std::size_t slotted = 0;                  // positions with slots
    std::size_t built = 0;                    // positions whose writes a build issued (or that hit the cache)
    std::shared_ptr<const pagedkv::RetentionConfig> retention;  // AdmitOptions::retention (forks inherit it)
    std::size_t prompt_len = 0;               // prompt tokens at admission (retention: later blocks are decode)
    [[nodiscard]] std::size_t known() const noexcept { return tokens.size(); }
    [[nodiscard]] std::size_t lookahead() const noexcept { return drafts.size(); }
    [[nodiscard]] std::size_t pending() const noexcept { return slotted - built; }
    [[nodiscard]] std::size_t unslotted() const noexcept {
      return drafts.empty() ? known() - std::min(known(), slotted) : 0;
    }
  };

  /// The state a build starts from, for checking what it did.
  struct BuildPre {
    struct Row {
      SeqId id;
      Blocks blocks;       // the table before the build
      std::size_t first;   // built positions before the build
      Slots pending;       // slots of the pending positions before the build
      std::size_t q_len;   // positions this build schedules (a prefix of the pending ones)
    };
    std::vector<Row> rows;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> copies;
    std::vector<bool> selected;          // [copies] handed out by this build (build_copy_selection)
    std::vector<std::uint32_t> holders;  // table holders per block
    std::vector<bool> hashed;            // hashed before the build
    CacheStats stats;
  };

  /// Outputs of a build, as the driver allocated them (an empty vector = the span was left empty).
  struct BuildOut {
    std::vector<std::int32_t> indptr, indices, last_page_len, block_tables, seq_lens, qo_indptr, copies;
    std::vector<std::int64_t> slot_mapping;
    std::int64_t max_blocks_per_seq = 0;
    std::int32_t sentinel = -7;
  };

  struct Snapshot {
    std::vector<std::uint64_t> stats;
    std::map<SeqId, std::tuple<Blocks, std::size_t, Toks, Slots, std::size_t, std::size_t>> seqs;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> copies;
    std::vector<std::tuple<std::uint32_t, bool, bool, std::optional<BlockHash>>> blocks;
    Blocks lru;
    std::size_t index_size = 0;
    // Retention (a RetentionEvictionPolicy only): per block its priority and expiry (ns), and the manager's clock.
    std::vector<std::pair<std::uint8_t, std::optional<std::int64_t>>> retention;
    std::int64_t retention_now = 0;
    friend bool operator==(const Snapshot&, const Snapshot&) = default;
  };

  ManagerModel(const pagedkv::CacheConfig& c, std::size_t max_tokens_per_seq, CallLog& log)
      : bs_(c.block_size),
        num_blocks_(c.num_blocks),
        usable_(c.num_blocks - 1),
        prefix_caching_(c.enable_prefix_caching),
        events_(c.enable_events),
        max_tokens_(max_tokens_per_seq),
        seed_(c.hash_seed),
        ref_(2, c.hash_seed),
        kv_(c.num_blocks * c.block_size, kPoison),
        state_(c.num_blocks, BlockState::kFree),
        log_(log) {}

  // ---- accessors for the driver ---------------------------------------------------------------------------------
  [[nodiscard]] std::uint32_t block_size() const noexcept { return bs_; }
  [[nodiscard]] std::size_t usable() const noexcept { return usable_; }
  [[nodiscard]] std::size_t max_tokens() const noexcept { return max_tokens_; }
  [[nodiscard]] bool prefix_caching() const noexcept { return prefix_caching_; }
  [[nodiscard]] const std::map<SeqId, MSeq>& seqs() const noexcept { return seqs_; }
  [[nodiscard]] bool live(SeqId id) const { return seqs_.contains(id); }

  /// Which pending copies a build of `batch` (`q_lens`: positions scheduled per row, empty = all pending) hands out,
  /// `[pending copies]`, by the rule of build_batch_metadata: a copy into the table of a sequence of the batch or of
  /// a sequence with nothing pending, or one whose source a scheduled position of the batch lies in. Unknown and
  /// repeated ids are skipped (such a build is refused anyway).
  [[nodiscard]] std::vector<bool> build_copy_selection(const Mgr& m, std::span<const SeqId> batch,
                                                       std::span<const std::uint32_t> q_lens) const {
    std::set<std::uint64_t> claimed, written;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      if (!live(batch[b])) continue;
      const MSeq& s = seqs_.at(batch[b]);
      const auto bl = m.block_ids(batch[b]);
      claimed.insert(bl.begin(), bl.end());
      const std::size_t q = q_lens.empty() || b >= q_lens.size() ? s.pending() : std::min<std::size_t>(q_lens[b], s.pending());
      for (std::size_t p = s.built; p < s.built + q; ++p) written.insert(bl[p / bs_]);
    }
    for (const auto& [id, s] : seqs_) {
      if (s.pending() != 0) continue;
      const auto bl = m.block_ids(id);
      claimed.insert(bl.begin(), bl.end());
    }
    std::vector<bool> out;
    for (const auto& c : m.pending_copies()) out.push_back(claimed.contains(c.dst) || written.contains(c.src));
    return out;
  }
  [[nodiscard]] const MSeq& seq(SeqId id) const { return seqs_.at(id); }
  [[nodiscard]] std::size_t blocks_for(std::size_t len) const noexcept { return (len + bs_ - 1) / bs_; }
  CallLog& log() noexcept { return log_; }

  [[noreturn]] void fail(const std::string& what) const { report_failure(log_, what); }
  void check(bool ok, const char* cond, int line, const std::string& detail = {}) const {
    if (!ok) fail(std::string(cond) + " (manager_model.hpp:" + std::to_string(line) + ")" + (detail.empty() ? "" : ": " + detail));
  }
#define PKV_MODEL_CHECK(cond, ...) check((cond), #cond, __LINE__ __VA_OPT__(, ) __VA_ARGS__)

  // ---- sequence content -------------------------------------------------------------------------------------------
  /// A new model sequence with `tokens` and `keys` (cursors set by the caller).
  MSeq make_seq(std::span<const TokenId> tokens, std::shared_ptr<const RequestKeys> keys) const {
    MSeq s;
    s.keys = std::move(keys);
    extend(s, tokens);
    return s;
  }

  /// Chain hashes of the full blocks of `tokens` with `keys` (the model's own computation, through a separate
  /// index: same code as the manager's, but none of its state).
  std::vector<BlockHash> chain_hashes(std::span<const TokenId> tokens, const RequestKeys* keys) const {
    std::vector<BlockHash> h;
    if (prefix_caching_) ref_.hash_full_blocks(tokens, bs_, keys, h);
    return h;
  }

  /// Append known tokens `add` to `s` (no lookahead outstanding): ids, fingerprints, chain hashes.
  void extend(MSeq& s, std::span<const TokenId> add) const {
    PKV_MODEL_CHECK(s.drafts.empty(), "model: extend with lookahead outstanding");
    for (TokenId t : add) {
      s.fp.push_back(next_fp(s, s.fp.size(), t));
      s.tokens.push_back(t);
    }
    if (prefix_caching_) ref_.hash_full_blocks(s.tokens, bs_, s.keys.get(), s.hashes);
  }

  /// Lookahead drafts after the known tokens: fingerprints only (the host does not know their ids).
  void add_drafts(MSeq& s, std::span<const TokenId> drafts) const {
    for (TokenId t : drafts) {
      s.fp.push_back(next_fp(s, s.fp.size(), t));
      s.drafts.push_back(t);
    }
  }

  /// commit_lookahead: the first `accepted` drafts become known tokens, the rest are dropped.
  void commit_drafts(MSeq& s, std::size_t accepted) const {
    s.tokens.insert(s.tokens.end(), s.drafts.begin(), s.drafts.begin() + static_cast<std::ptrdiff_t>(accepted));
    s.drafts.clear();
    s.fp.resize(s.tokens.size());
    if (prefix_caching_) ref_.hash_full_blocks(s.tokens, bs_, s.keys.get(), s.hashes);
  }

  /// rewind(n): lookahead drafts go first, then known tokens; slots and built positions follow.
  void rewind(MSeq& s, std::size_t n) const {
    const std::size_t drop_lookahead = std::min(n, s.lookahead());
    s.drafts.resize(s.lookahead() - drop_lookahead);
    const std::size_t len = s.known() - (n - drop_lookahead);
    s.tokens.resize(len);
    s.fp.resize(len + s.lookahead());
    s.hashes.resize(std::min(s.hashes.size(), len / bs_));
    s.slotted = std::min(s.slotted, len + s.lookahead());
    s.built = std::min(s.built, s.slotted);
  }

  // ---- external KV (the driver's external ops, issue 33) ------------------------------------------------------------
  /// References the model's tables do not hold: per block, the external references (fills, leases, save pins,
  /// orphan holds) plus the tables of sequences waiting for a fill; empty = none. check_all adds them.
  std::vector<std::uint32_t> ext_refs;
  /// Sequences waiting for a fill (live in the manager, not in seqs()).
  std::size_t ext_sequences = 0;
  /// Blocks of fills in flight and of orphan holds: never registered (no hit may land on an unfilled block).
  Blocks ext_unfilled;
  /// Blocks whose hash evict_cached_block dropped while something still held them (vLLM's evict_blocks after a
  /// failed load): they stay in their tables, written and known but never registered again, until their last
  /// release frees them (check_all then forgets them).
  std::set<std::uint64_t> unkeyed;
  /// Registered blocks evict_cached_block dropped since the last check: their BlockRemoved events are no capacity
  /// eviction (CacheStats::evictions does not count them).
  std::uint64_t removed_by_id = 0;
  /// The transfer stub: positions [from, to) of model sequence `id` are written into its blocks by the fill.
  void write_external(const Mgr& m, SeqId id, std::size_t from, std::size_t to) {
    const MSeq& s = seqs_.at(id);
    const auto ids = m.block_ids(id);
    for (std::size_t p = from; p < to; ++p) kv_[static_cast<std::size_t>(ids[p / bs_]) * bs_ + p % bs_] = s.fp[p];
  }

  void add_seq(SeqId id, MSeq s) { seqs_.insert_or_assign(id, std::move(s)); }
  MSeq& mutable_seq(SeqId id) { return seqs_.at(id); }
  void erase_seq(SeqId id) { seqs_.erase(id); }

  /// Pending copies reading block b (each holds a reference; not a table holder for copy-on-write).
  static std::uint32_t pins(const Mgr& m, std::uint64_t b) {
    std::uint32_t n = 0;
    for (const auto& c : m.pending_copies()) n += c.src == b ? 1U : 0U;
    return n;
  }

  /// Whether `id` is settled: every known token slotted and built, no lookahead, no pending copy into its table.
  bool settled(const Mgr& m, SeqId id) const {
    const MSeq& s = seqs_.at(id);
    if (s.pending() != 0 || s.unslotted() != 0 || s.lookahead() != 0) return false;
    const auto blocks = m.block_ids(id);
    for (const auto& c : m.pending_copies()) {
      if (std::find(blocks.begin(), blocks.end(), c.dst) != blocks.end()) return false;
    }
    return true;
  }

  /// The LRU order expected after releasing `blocks` through the manager, last block first: a block that drops to
  /// refcount 0 enters the LRU if hashed; a released destination of a pending copy drops that copy, which
  /// releases its source the same way.
  Blocks expected_lru_after_release(const Mgr& m, const Blocks& blocks) const {
    const auto& a = m.allocator();
    const auto order = a.eviction_policy().order();
    Blocks lru(order.begin(), order.end());
    std::vector<std::uint32_t> rc(num_blocks_, 0);
    for (std::size_t b = 1; b < num_blocks_; ++b) rc[b] = a.refcount(static_cast<Id>(b));
    std::vector<std::pair<std::uint64_t, std::uint64_t>> copies;
    for (const auto& c : m.pending_copies()) copies.emplace_back(c.src, c.dst);
    std::function<void(std::uint64_t)> release = [&](std::uint64_t b) {
      --rc[b];
      if (rc[b] != 0) return;
      if (a.is_hashed(static_cast<Id>(b))) lru.push_back(b);
      for (std::size_t i = 0; i < copies.size(); ++i) {
        if (copies[i].second == b) {
          const std::uint64_t src = copies[i].first;
          copies.erase(copies.begin() + static_cast<std::ptrdiff_t>(i));
          release(src);
          return;
        }
      }
    };
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) release(*it);
    return lru;
  }

  // ---- events, interval statistics, preempted ids -------------------------------------------------------------------
  /// The next check_all takes the events as a numbered batch instead of draining them.
  void take_event_batch_next() { take_batch_next_ = true; }
  /// The prefix-cache statistics the manager should report for the current interval (recorded by the driver).
  pagedkv::PrefixCacheStats& interval() noexcept { return interval_; }
  /// Sequence ids preempted and not admitted since (their next admission is a re-admission).
  std::set<SeqId>& preempted_ids() noexcept { return preempted_; }

  // ---- snapshots --------------------------------------------------------------------------------------------------
  Snapshot snapshot(const Mgr& m) const {
    Snapshot s;
    const CacheStats st = m.stats();
    s.stats = {st.num_usable_blocks,       st.blocks_used,           st.blocks_cached,       st.blocks_free,
               st.prefix_query_requests,   st.prefix_hit_requests,   st.prefix_query_tokens, st.prefix_hit_tokens,
               st.readmitted_requests,     st.readmitted_query_tokens, st.readmitted_hit_tokens,
               st.evictions,               st.cow_copies,            st.dedup_blocks,        st.preemptions,
               st.block_ops};
    m.for_each_sequence([&](SeqId id, auto blocks, std::size_t n) {
      const auto t = m.token_ids(id);
      const auto p = m.pending_slots(id);
      const auto& q = m.sequence(id);
      s.seqs[id] = {Blocks(blocks.begin(), blocks.end()), n, Toks(t.begin(), t.end()), Slots(p.begin(), p.end()),
                    q.num_lookahead, q.num_built};
    });
    for (const auto& c : m.pending_copies()) s.copies.emplace_back(c.src, c.dst);
    const auto& a = m.allocator();
    for (std::size_t b = 1; b < a.num_blocks(); ++b) {
      const Id id = static_cast<Id>(b);
      s.blocks.emplace_back(a.refcount(id), a.is_hashed(id), a.is_cached(id), m.prefix_index().hash_of(id));
    }
    const auto lru = a.eviction_policy().order();
    s.lru.assign(lru.begin(), lru.end());
    s.index_size = m.prefix_index().size();
    if constexpr (kHasRetention) {
      for (std::size_t b = 1; b < a.num_blocks(); ++b) {
        const Id id = static_cast<Id>(b);
        const auto at = a.eviction_policy().expires_at(id);
        s.retention.emplace_back(a.eviction_policy().priority(id),
                                 at ? std::optional<std::int64_t>(at->time_since_epoch().count()) : std::nullopt);
      }
    }
    s.retention_now = m.retention_now().time_since_epoch().count();
    return s;
  }

  /// Check that a failed call left everything as `before` and recorded no event.
  void expect_unchanged(Mgr& m, const Snapshot& before, const std::string& what) {
    if (!(snapshot(m) == before)) fail("strong guarantee broken: " + what + " changed the manager's state");
    std::vector<KVEvent> ev;
    m.drain_events(ev);
    PKV_MODEL_CHECK(ev.empty(), what + " recorded " + std::to_string(ev.size()) + " events");
  }

  // ---- invariants after every operation ---------------------------------------------------------------------------
  /// `expect_cleared`: the operation was a successful reset_prefix_cache.
  void check_all(Mgr& m, bool expect_cleared = false) {
    const auto& a = m.allocator();
    const auto& idx = m.prefix_index();
    PKV_MODEL_CHECK(m.num_sequences() == seqs_.size() + ext_sequences);
    PKV_MODEL_CHECK(a.num_blocks() == num_blocks_);
    std::vector<std::uint32_t> rc(num_blocks_, 0), holders(num_blocks_, 0);
    std::set<std::uint64_t> srcs, dsts;
    for (const auto& c : m.pending_copies()) {
      PKV_MODEL_CHECK(c.src != c.dst && c.src != 0 && c.dst != 0 && c.src < num_blocks_ && c.dst < num_blocks_);
      ++rc[c.src];
      srcs.insert(c.src);
      PKV_MODEL_CHECK(dsts.insert(c.dst).second, "two pending copies into block " + std::to_string(c.dst));
    }
    for (std::uint64_t b : srcs) {
      PKV_MODEL_CHECK(!dsts.contains(b), "block " + std::to_string(b) +
                                             " is both the source and the destination of pending copies (the next "
                                             "build's copy list)");
    }
    for (const auto& [id, s] : seqs_) {
      PKV_MODEL_CHECK(m.contains(id), "sequence " + std::to_string(id));
      const std::string sid = "sequence " + std::to_string(id);
      PKV_MODEL_CHECK(m.num_tokens(id) == s.slotted,
                      sid + " has " + std::to_string(m.num_tokens(id)) + " slotted tokens, model " + std::to_string(s.slotted));
      const auto toks = m.token_ids(id);
      PKV_MODEL_CHECK(toks.size() == s.known() && std::equal(toks.begin(), toks.end(), s.tokens.begin()),
                      "token ids of " + sid);
      const auto blocks = m.block_ids(id);
      PKV_MODEL_CHECK(blocks.size() == blocks_for(s.slotted), sid);
      for (const auto b : blocks) {
        PKV_MODEL_CHECK(b != 0 && b < num_blocks_, sid + " holds block " + std::to_string(b));
        ++rc[b];
        ++holders[b];
      }
      if (prefix_caching_) {
        PKV_MODEL_CHECK(s.hashes.size() == s.known() / bs_);
        // Content addressing: a registered block holds its sequence's chain hash, and a block whose writes are
        // issued and whose ids are known is registered (by the build or commit_lookahead that completed it).
        const std::size_t registrable = std::min(s.built, s.known()) / bs_;
        for (std::size_t i = 0; i < blocks.size(); ++i) {
          const auto h = idx.hash_of(blocks[i]);
          if (i < registrable && !(unkeyed.contains(blocks[i]) && !h)) {
            PKV_MODEL_CHECK(h == std::optional<BlockHash>(s.hashes[i]),
                            sid + " block " + std::to_string(i) + " (block " + std::to_string(blocks[i]) +
                                ") is written and known but " + (h ? "registered under another hash" : "not registered"));
          } else if (h && (i + 1) * bs_ <= s.known()) {
            PKV_MODEL_CHECK(*h == s.hashes[i], sid + " block " + std::to_string(i) + " is registered under another hash");
          }  // (a registered block left partial by a rewind stays registered: it is copied before any write)
        }
      }
      // The manager's own cursors (sequence_state.hpp).
      const auto& q = m.sequence(id);
      PKV_MODEL_CHECK(q.num_slotted() == s.slotted && q.num_known() == s.known() && q.num_lookahead == s.lookahead() &&
                          q.num_built == s.built,
                      "cursors of " + sid + ": built " + std::to_string(q.num_built) + "/" + std::to_string(s.built) +
                          ", slotted " + std::to_string(q.num_slotted()) + "/" + std::to_string(s.slotted) +
                          ", known " + std::to_string(q.num_known()) + "/" + std::to_string(s.known()) +
                          ", lookahead " + std::to_string(q.num_lookahead) + "/" + std::to_string(s.lookahead()) +
                          " (manager/model)");
      PKV_MODEL_CHECK(q.settled() == settled(m, id), "settled() of " + sid);
      PKV_MODEL_CHECK(q.num_unslotted() == s.unslotted(), "num_unslotted() of " + sid);
      const auto pend = m.pending_slots(id);
      PKV_MODEL_CHECK(pend.size() == s.pending(), sid + " has " + std::to_string(pend.size()) +
                                                      " pending slots, model " + std::to_string(s.pending()));
      for (std::size_t k = 0; k < pend.size(); ++k) {
        const std::size_t p = s.built + k;
        const std::int64_t want = static_cast<std::int64_t>(blocks[p / bs_]) * bs_ + static_cast<std::int64_t>(p % bs_);
        PKV_MODEL_CHECK(pend[k] == want, sid + " position " + std::to_string(p) + " pending slot " +
                                             std::to_string(pend[k]) + ", own slot " + std::to_string(want));
      }
    }
    for (std::uint64_t b : dsts) {
      PKV_MODEL_CHECK(holders[b] >= 1, "pending copy into block " + std::to_string(b) + " that no table holds");
    }
    for (std::size_t b = 0; b < ext_refs.size(); ++b) rc[b] += ext_refs[b];
    for (const auto b : ext_unfilled) {
      PKV_MODEL_CHECK(!a.is_hashed(static_cast<Id>(b)), "block " + std::to_string(b) +
                                                            " of an external fill in flight or an orphan hold is "
                                                            "registered: a hit could land on an unfilled block");
    }
    // Refcounts and the three-state partition.
    std::size_t free = 0, cached = 0, held = 0, hashed = 0;
    std::vector<BlockState> now(num_blocks_, BlockState::kFree);
    for (std::size_t b = 1; b < num_blocks_; ++b) {
      const Id id = static_cast<Id>(b);
      PKV_MODEL_CHECK(a.refcount(id) == rc[b], "block " + std::to_string(b) + " refcount " +
                                                   std::to_string(a.refcount(id)) + ", expected " + std::to_string(rc[b]));
      const bool is_hashed = a.is_hashed(id);
      PKV_MODEL_CHECK(is_hashed == idx.hash_of(id).has_value(), "block " + std::to_string(b));
      if (is_hashed) {
        ++hashed;
        PKV_MODEL_CHECK(idx.find(*idx.hash_of(id)) == std::optional<Id>(id), "block " + std::to_string(b));
      }
      if (rc[b] > 0) {
        ++held;
        PKV_MODEL_CHECK(!a.is_cached(id));
        now[b] = BlockState::kHeld;
      } else if (a.is_cached(id)) {
        ++cached;
        PKV_MODEL_CHECK(is_hashed);
        now[b] = BlockState::kCached;
      } else {
        ++free;
        PKV_MODEL_CHECK(!is_hashed);
      }
    }
    const CacheStats st = m.stats();
    PKV_MODEL_CHECK(st.blocks_free == free);
    PKV_MODEL_CHECK(st.blocks_cached == cached);
    PKV_MODEL_CHECK(st.blocks_used == held);
    PKV_MODEL_CHECK(free + cached + held == usable_);
    PKV_MODEL_CHECK(st.num_usable_blocks == usable_);
    PKV_MODEL_CHECK(idx.size() == hashed);
    PKV_MODEL_CHECK(a.eviction_policy().order().size() == cached);
    if (!prefix_caching_) PKV_MODEL_CHECK(hashed == 0);
    // Shadow K/V: a block that became free, or was evicted and reused, holds nothing anyone may read.
    for (std::size_t b = 1; b < num_blocks_; ++b) {
      const bool evicted = state_[b] == BlockState::kCached && now[b] == BlockState::kHeld && !a.is_hashed(static_cast<Id>(b));
      if (now[b] == BlockState::kFree || evicted) poison(b);
    }
    std::erase_if(unkeyed, [&](std::uint64_t b) { return now[b] != BlockState::kHeld; });  // freed: a new block
    state_ = std::move(now);
    check_content(m);
    check_events(m, st, expect_cleared);
    PKV_MODEL_CHECK(st.block_ops >= last_stats_.block_ops);
    last_stats_ = st;
  }

  // ---- builds ---------------------------------------------------------------------------------------------------
  /// `q_lens`: the positions each sequence of `batch` is scheduled (empty: all pending ones).
  BuildPre capture_build_pre(const Mgr& m, std::span<const SeqId> batch, std::span<const std::uint32_t> q_lens) const {
    BuildPre pre;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const SeqId id = batch[b];
      const auto bl = m.block_ids(id);
      const auto p = m.pending_slots(id);
      const MSeq& s = seqs_.at(id);
      pre.rows.push_back({id, Blocks(bl.begin(), bl.end()), s.built, Slots(p.begin(), p.end()),
                          q_lens.empty() ? s.pending() : q_lens[b]});
    }
    for (const auto& c : m.pending_copies()) pre.copies.emplace_back(c.src, c.dst);
    pre.selected = build_copy_selection(m, batch, q_lens);
    pre.holders.assign(num_blocks_, 0);
    m.for_each_sequence([&](SeqId, auto blocks, std::size_t) {
      for (auto b : blocks) ++pre.holders[b];
    });
    pre.hashed.assign(num_blocks_, false);
    for (std::size_t b = 1; b < num_blocks_; ++b) pre.hashed[b] = m.allocator().is_hashed(static_cast<Id>(b));
    pre.stats = m.stats();
    return pre;
  }

  /// After a successful build of `batch` (distinct live sequences, as captured in `pre`) into `out`: check its
  /// outputs and effects, run the kernels on the shadow pool, and check every live sequence's built content.
  void check_build_and_run_kernels(Mgr& m, const BuildPre& pre, const BuildOut& out,
                                   const pagedkv::BatchMetadataSizes& sz) {
    const std::size_t B = pre.rows.size();
    std::size_t total_blocks = 0, total_slots = 0;
    for (const auto& r : pre.rows) {
      total_blocks += blocks_for(r.first + r.q_len);
      total_slots += r.q_len;
    }
    PKV_MODEL_CHECK(sz.batch_size == B);
    PKV_MODEL_CHECK(sz.num_indices == total_blocks);
    PKV_MODEL_CHECK(sz.num_new_tokens == total_slots);

    std::set<std::uint64_t> switched_out;
    std::size_t blk = 0, tok = 0;
    for (std::size_t b = 0; b < B; ++b) {
      const auto& row = pre.rows[b];
      const MSeq& s = seqs_.at(row.id);
      const auto post_span = m.block_ids(row.id);
      const Blocks post(post_span.begin(), post_span.end());
      PKV_MODEL_CHECK(post.size() == row.blocks.size());
      const std::size_t first = row.first;
      const std::size_t seq_len = first + row.q_len;  // written up to the end of this step
      const std::size_t nblocks = blocks_for(seq_len);
      std::set<std::size_t> written;
      for (std::size_t k = 0; k < row.q_len; ++k) written.insert((first + k) / bs_);
      for (std::size_t i = 0; i < post.size(); ++i) {
        const bool full = (i + 1) * bs_ <= std::min(seq_len, s.known());  // registrable after this build
        if (post[i] != row.blocks[i]) {  // switched to the registered duplicate
          PKV_MODEL_CHECK(prefix_caching_ && full && written.contains(i),
                          "sequence " + std::to_string(row.id) + " block " + std::to_string(i) + " replaced");
          PKV_MODEL_CHECK(pre.holders[row.blocks[i]] == 1);
          PKV_MODEL_CHECK(m.prefix_index().hash_of(static_cast<Id>(post[i])) == std::optional<BlockHash>(s.hashes[i]));
          switched_out.insert(row.blocks[i]);
          continue;
        }
        if (!prefix_caching_ || !full || !written.contains(i)) continue;
        const auto h = m.prefix_index().hash_of(static_cast<Id>(post[i]));
        if (h) {
          PKV_MODEL_CHECK(*h == s.hashes[i]);
        } else {  // a shared duplicate stays unregistered
          const auto reg = m.prefix_index().find(s.hashes[i]);
          PKV_MODEL_CHECK(reg.has_value() && *reg != post[i] && pre.holders[post[i]] > 1,
                          "sequence " + std::to_string(row.id) + " block " + std::to_string(i) +
                              " written by this build but not registered");
        }
      }
      // Outputs, compared in 64 bits (a truncated int32 must not pass).
      if (!out.indptr.empty()) PKV_MODEL_CHECK(std::int64_t{out.indptr[b]} == static_cast<std::int64_t>(blk));
      if (!out.qo_indptr.empty()) PKV_MODEL_CHECK(std::int64_t{out.qo_indptr[b]} == static_cast<std::int64_t>(tok));
      const std::uint64_t last = seq_len == 0 ? 0 : seq_len - (nblocks - 1) * bs_;
      if (!out.last_page_len.empty()) PKV_MODEL_CHECK(std::int64_t{out.last_page_len[b]} == static_cast<std::int64_t>(last));
      if (!out.seq_lens.empty()) PKV_MODEL_CHECK(std::int64_t{out.seq_lens[b]} == static_cast<std::int64_t>(seq_len));
      if (!out.block_tables.empty()) {
        const auto row_len = static_cast<std::size_t>(out.max_blocks_per_seq);
        for (std::size_t i = 0; i < row_len; ++i) {
          const std::int64_t want = i < nblocks ? static_cast<std::int64_t>(post[i]) : 0;
          PKV_MODEL_CHECK(std::int64_t{out.block_tables[b * row_len + i]} == want, "block_tables row " + std::to_string(b));
        }
      }
      if (!out.indices.empty() && !out.indptr.empty()) {  // the CSR indices are written with their indptr
        for (std::size_t i = 0; i < nblocks; ++i) {
          PKV_MODEL_CHECK(std::int64_t{out.indices[blk + i]} == static_cast<std::int64_t>(post[i]));
        }
      }
      if (!out.slot_mapping.empty()) {
        for (std::size_t k = 0; k < row.q_len; ++k) {
          const std::size_t p = first + k;
          const std::int64_t want = post[p / bs_] != row.blocks[p / bs_] ? -1 : row.pending[k];
          PKV_MODEL_CHECK(out.slot_mapping[tok + k] == want, "slot_mapping of sequence " + std::to_string(row.id) +
                                                                 " position " + std::to_string(p) + " is " +
                                                                 std::to_string(out.slot_mapping[tok + k]) +
                                                                 ", expected " + std::to_string(want));
        }
      }
      blk += nblocks;
      tok += row.q_len;
    }
    PKV_MODEL_CHECK(m.stats().dedup_blocks == pre.stats.dedup_blocks + switched_out.size());
    // Copies: this build's (build_copy_selection) in order, less those whose destination deduplication released
    // (dropped with it); the others stay pending, in order.
    PKV_MODEL_CHECK(sz.num_copies <= pre.copies.size());
    std::vector<std::pair<std::uint64_t, std::uint64_t>> issued, kept;
    for (std::size_t j = 0; j < pre.copies.size(); ++j) {
      const auto& c = pre.copies[j];
      if (!pre.selected[j]) {
        kept.push_back(c);
        continue;
      }
      if (switched_out.contains(c.second)) continue;
      issued.push_back(c);
    }
    PKV_MODEL_CHECK(sz.num_copies == issued.size(), "build issued " + std::to_string(sz.num_copies) + " copies, expected " +
                                                        std::to_string(issued.size()));
    if (!out.copies.empty()) {
      for (std::size_t j = 0; j < issued.size(); ++j) {
        PKV_MODEL_CHECK(std::int64_t{out.copies[2 * j]} == static_cast<std::int64_t>(issued[j].first) &&
                            std::int64_t{out.copies[2 * j + 1]} == static_cast<std::int64_t>(issued[j].second),
                        "copy " + std::to_string(j));
      }
      for (std::size_t i = 2 * issued.size(); i < out.copies.size(); ++i) PKV_MODEL_CHECK(out.copies[i] == -1);
    }
    // Padding.
    for (std::size_t b = B; b < out.indptr.size(); ++b) PKV_MODEL_CHECK(std::int64_t{out.indptr[b]} == static_cast<std::int64_t>(blk));
    for (std::size_t b = B; b < out.qo_indptr.size(); ++b) PKV_MODEL_CHECK(std::int64_t{out.qo_indptr[b]} == static_cast<std::int64_t>(tok));
    for (std::size_t b = B; b < out.last_page_len.size(); ++b) PKV_MODEL_CHECK(out.last_page_len[b] == 0);
    for (std::size_t b = B; b < out.seq_lens.size(); ++b) PKV_MODEL_CHECK(out.seq_lens[b] == 0);
    for (std::size_t i = B * static_cast<std::size_t>(std::max<std::int64_t>(out.max_blocks_per_seq, 0));
         i < out.block_tables.size(); ++i) {
      PKV_MODEL_CHECK(out.block_tables[i] == out.sentinel, "block_tables beyond the batch must stay untouched");
    }
    for (std::size_t i = tok; i < out.slot_mapping.size(); ++i) PKV_MODEL_CHECK(out.slot_mapping[i] == -1);
    {
      std::vector<std::pair<std::uint64_t, std::uint64_t>> now;
      for (const auto& c : m.pending_copies()) now.emplace_back(c.src, c.dst);
      PKV_MODEL_CHECK(now == kept, "the copies of sequences outside the build must stay pending");
    }
    for (const auto& row : pre.rows) {
      MSeq& s = seqs_.at(row.id);
      s.built += row.q_len;
      PKV_MODEL_CHECK(m.pending_slots(row.id).size() == s.pending(), "pending slots left after the build");
    }

    // The step's kernels on the shadow pool. No block may be both read and written by the copy launch.
    std::set<std::uint64_t> srcs, dsts;
    for (const auto& [src, dst] : issued) {
      srcs.insert(src);
      dsts.insert(dst);
    }
    for (std::uint64_t b : srcs) {
      PKV_MODEL_CHECK(!dsts.contains(b), "block " + std::to_string(b) + " is both a source and a destination in one "
                                                                          "build's copy list");
    }
    // The kernels see only what the build wrote: no copies buffer, no copies; no slot mapping, no writes.
    if (out.copies.empty()) issued.clear();
    std::vector<std::vector<std::uint64_t>> read(issued.size());
    for (std::size_t j = 0; j < issued.size(); ++j) {
      read[j].assign(kv_.begin() + static_cast<std::ptrdiff_t>(issued[j].first * bs_),
                     kv_.begin() + static_cast<std::ptrdiff_t>((issued[j].first + 1) * bs_));
    }
    for (std::size_t j = 0; j < issued.size(); ++j) {
      std::copy(read[j].begin(), read[j].end(), kv_.begin() + static_cast<std::ptrdiff_t>(issued[j].second * bs_));
    }
    // write_kv over the slot mapping (checked equal to the model's expectation above). A block written by this
    // build was held by one table when the build started (a deduplicated sequence may share it after) and was not
    // registered yet (registered blocks are immutable).
    std::set<std::int64_t> written_slots;
    std::size_t at = 0;
    for (std::size_t b = 0; b < B && !out.slot_mapping.empty(); ++b) {
      const auto& row = pre.rows[b];
      const MSeq& s = seqs_.at(row.id);
      const std::size_t first = row.first;
      for (std::size_t k = 0; k < row.q_len; ++k, ++at) {
        const std::int64_t sl = out.slot_mapping[at];
        if (sl < 0) continue;  // deduplicated
        const std::size_t p = first + k;
        const auto blk_id = static_cast<std::uint64_t>(sl) / bs_;
        PKV_MODEL_CHECK(pre.holders[blk_id] == 1, "K/V write into block " + std::to_string(blk_id) + " held by " +
                                                      std::to_string(pre.holders[blk_id]) + " tables");
        PKV_MODEL_CHECK(!pre.hashed[blk_id], "K/V write into block " + std::to_string(blk_id) +
                                                 ", registered before this build (immutable)");
        PKV_MODEL_CHECK(written_slots.insert(sl).second, "two tokens of one build write slot " + std::to_string(sl));
        kv_[static_cast<std::size_t>(sl)] = s.fp[p];
      }
    }
    check_content(m);
  }

  /// Every position of every live sequence whose writes have been issued reads back its own fingerprint. A
  /// position in the destination of a pending copy reads the copy's source: the next build's copy_blocks brings
  /// exactly that content, and nothing writes either block before it (so this holds after every operation).
  void check_content(const Mgr& m) const {
    std::unordered_map<std::uint64_t, std::uint64_t> copy_src;  // dst -> src
    for (const auto& c : m.pending_copies()) copy_src[c.dst] = c.src;
    for (const auto& [id, s] : seqs_) {
      const auto ids = m.block_ids(id);
      for (std::size_t p = 0; p < s.built; ++p) {
        std::uint64_t blk = ids[p / bs_];
        const auto it = copy_src.find(blk);
        if (it != copy_src.end()) blk = it->second;
        const std::size_t slot = static_cast<std::size_t>(blk) * bs_ + p % bs_;
        if (kv_[slot] != s.fp[p]) {
          fail("shadow K/V mismatch: sequence " + std::to_string(id) + " position " + std::to_string(p) + " reads block " +
               std::to_string(ids[p / bs_]) + (blk != ids[p / bs_] ? " (pending copy of block " + std::to_string(blk) + ")" : "") +
               " slot " + std::to_string(slot) +
               (kv_[slot] == kPoison ? " that no kernel wrote" : " holding another prefix's K/V"));
        }
      }
    }
  }

 private:
  enum class BlockState : std::uint8_t { kFree, kCached, kHeld };

  // Fingerprint of position p holding token t after s's position p - 1 (its prefix, its keys).
  std::uint64_t next_fp(const MSeq& s, std::size_t p, TokenId t) const {
    const RequestKeys* keys = s.keys.get();
    std::uint64_t f = p == 0 ? fp_seed(keys) : s.fp[p - 1];
    f = mix64(f ^ (std::uint64_t{static_cast<std::uint32_t>(t)} * 0x100000001b3ULL));
    if (keys != nullptr) {
      for (const MultimodalItem& m : keys->multimodal) {
        if (item_covers(m, p)) f = mix64(f ^ m.item_hash.low64() ^ 0x5bd1e995ULL);
      }
    }
    return f;
  }

  static std::uint64_t fp_seed(const RequestKeys* keys) {
    if (keys == nullptr) return mix64(0x1234);
    std::uint64_t s = mix64(keys->adapter_id + 0x1234);
    for (char ch : keys->salt) s = mix64(s ^ static_cast<unsigned char>(ch));
    return s;
  }

  void poison(std::size_t b) {
    std::fill(kv_.begin() + static_cast<std::ptrdiff_t>(b * bs_), kv_.begin() + static_cast<std::ptrdiff_t>((b + 1) * bs_), kPoison);
  }

  void check_events(Mgr& m, const CacheStats& st, bool expect_cleared) {
    std::vector<KVEvent> ev;
    if (take_batch_next_) {  // the step's events as a numbered batch (vLLM's KVEventBatch)
      take_batch_next_ = false;
      const double ts = 1000.0 + static_cast<double>(batches_taken_);
      auto batch = m.take_event_batch(ts);
      if (batch) {
        PKV_MODEL_CHECK(!batch->events.empty(), "an empty event batch (nullopt expected)");
        PKV_MODEL_CHECK(batch->seq_no == batches_taken_ + 1 && batch->ts == ts,
                        "event batch number " + std::to_string(batch->seq_no) + " after " + std::to_string(batches_taken_));
        ++batches_taken_;
        ev = std::move(batch->events);
      }
    } else {
      m.drain_events(ev);
    }
    if (!events_) PKV_MODEL_CHECK(ev.empty(), "events recorded with enable_events off");
    const auto& idx = m.prefix_index();
    std::size_t stored = 0, removed = 0;
    bool cleared = false;
    std::unordered_map<std::uint64_t, std::vector<std::pair<SeqId, std::size_t>>> where;  // low64(hash) -> (seq, i)
    if (!ev.empty()) {
      for (const auto& [id, s] : seqs_) {
        for (std::size_t i = 0; i < s.hashes.size(); ++i) where[s.hashes[i].low64()].emplace_back(id, i);
      }
    }
    for (const KVEvent& e : ev) {
      PKV_MODEL_CHECK(e.seq_no == last_seq_no_ + 1, "event seq_no " + std::to_string(e.seq_no) + " after " +
                                                        std::to_string(last_seq_no_));
      last_seq_no_ = e.seq_no;
      if (e.type == KVEventType::kBlockStored) {
        ++stored;
        PKV_MODEL_CHECK(idx.find(e.hash).has_value(), "stored event for a hash that is not registered");
        PKV_MODEL_CHECK(e.token_ids.size() == bs_);
        bool found = false;
        for (const auto& [id, i] : where[e.hash.low64()]) {
          const MSeq& s = seqs_.at(id);
          if (!(s.hashes[i] == e.hash)) continue;
          found = true;
          PKV_MODEL_CHECK(std::equal(e.token_ids.begin(), e.token_ids.end(), s.tokens.begin() + static_cast<std::ptrdiff_t>(i * bs_)),
                          "stored event token ids");
          PKV_MODEL_CHECK(e.parent_hash == (i == 0 ? std::nullopt : std::optional<BlockHash>(s.hashes[i - 1])),
                          "stored event parent hash");
          PKV_MODEL_CHECK(e.adapter_id == (s.keys ? s.keys->adapter_id : 0), "stored event adapter id");
          PKV_MODEL_CHECK(e.block_size == bs_ && e.block_start == i * bs_, "stored event block size / start");
          // The salt is on every block's event (routers read it from an event's first block); only block 0 hashes it.
          PKV_MODEL_CHECK(e.salt == (s.keys ? s.keys->salt : std::string()), "stored event salt");
          PKV_MODEL_CHECK(e.medium == pagedkv::Medium::kGpu && e.group == 0, "stored event medium / group");
          // Every extra key of the block is in its event: the multimodal items overlapping it, as given.
          std::vector<MultimodalItem> items;
          if (s.keys) {
            for (const MultimodalItem& it : s.keys->multimodal) {
              if (item_overlaps(it, i * bs_, (i + 1) * bs_)) items.push_back(it);
            }
          }
          bool same = e.multimodal_items.size() == items.size();
          for (std::size_t k = 0; same && k < items.size(); ++k) {
            same = e.multimodal_items[k].item_hash == items[k].item_hash &&
                   e.multimodal_items[k].offset_tokens == items[k].offset_tokens &&
                   e.multimodal_items[k].length_tokens == items[k].length_tokens;
          }
          PKV_MODEL_CHECK(same, "stored event of block " + std::to_string(i) + " of sequence " + std::to_string(id) +
                                    " lists " + std::to_string(e.multimodal_items.size()) +
                                    " multimodal items, the block overlaps " + std::to_string(items.size()));
          // A router can recompute the hash from the event alone.
          PKV_MODEL_CHECK(pagedkv::rehash_stored_event<Hasher>(e, seed_) == e.hash, "rehash_stored_event(e) != e.hash");
          break;
        }
        PKV_MODEL_CHECK(found, "stored event for a hash no live sequence has");
      } else if (e.type == KVEventType::kBlockRemoved) {
        ++removed;
        PKV_MODEL_CHECK(!idx.find(e.hash).has_value(), "removed event for a hash still registered");
      } else {
        cleared = true;
        PKV_MODEL_CHECK(stored == 0, "a block stored before a reset in one operation");
      }
    }
    if (events_) PKV_MODEL_CHECK(cleared == expect_cleared);
    if (cleared) {
      PKV_MODEL_CHECK(idx.size() == 0);
    } else if (events_) {
      PKV_MODEL_CHECK(idx.size() + removed == last_index_size_ + stored,
                      "index size " + std::to_string(idx.size()) + " + removed " + std::to_string(removed) +
                          " != previous " + std::to_string(last_index_size_) + " + stored " + std::to_string(stored));
    }
    if (events_) {
      PKV_MODEL_CHECK(st.evictions + removed_by_id == last_stats_.evictions + removed,
                      "evictions counter (+ evict_cached_block's removals) vs removed events");
      // The snapshot a late consumer starts from: exactly the registered hashes, at the last batch taken.
      const pagedkv::KVEventSnapshot snap = m.event_snapshot();
      PKV_MODEL_CHECK(snap.seq_no == batches_taken_, "event snapshot at batch " + std::to_string(snap.seq_no) +
                                                         ", " + std::to_string(batches_taken_) + " taken");
      std::vector<BlockHash> in_snapshot, registered;
      for (const KVEvent& e : snap.stored) in_snapshot.push_back(e.hash);
      for (std::size_t b = 1; b < num_blocks_; ++b) {
        if (const auto h = idx.hash_of(static_cast<Id>(b))) registered.push_back(*h);
      }
      std::sort(in_snapshot.begin(), in_snapshot.end());
      std::sort(registered.begin(), registered.end());
      PKV_MODEL_CHECK(in_snapshot == registered, "the event snapshot lists " + std::to_string(in_snapshot.size()) +
                                                     " stored blocks, " + std::to_string(registered.size()) +
                                                     " are registered");
    }
    last_index_size_ = idx.size();
    removed_by_id = 0;
  }

  std::uint32_t bs_;
  std::size_t num_blocks_;
  std::size_t usable_;
  bool prefix_caching_;
  bool events_;
  std::size_t max_tokens_;
  std::uint64_t seed_;
  mutable pagedkv::PrefixHashIndex<Hasher, Id> ref_;
  std::map<SeqId, MSeq> seqs_;
  std::vector<std::uint64_t> kv_;  // [num_blocks * block_size] fingerprints
  std::vector<BlockState> state_;  // per block, after the previous operation
  CallLog& log_;
  std::uint64_t last_seq_no_ = 0;
  std::size_t last_index_size_ = 0;
  CacheStats last_stats_;
  bool take_batch_next_ = false;
  std::uint64_t batches_taken_ = 0;
  pagedkv::PrefixCacheStats interval_;
  std::set<SeqId> preempted_;
};

#undef PKV_MODEL_CHECK

}  // namespace pagedkv_fuzz
