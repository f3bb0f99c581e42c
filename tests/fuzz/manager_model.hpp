// tests/fuzz/manager_model.hpp: the shadow model the manager fuzzer (fuzz_manager.cpp) checks KVCacheManager
// against. It is independent of the op decoding, so a new manager operation only needs a driver case that
// predicts its outcome with the helpers here and tells the model what changed.
//
// What the model keeps:
//  - per live sequence: token ids, extra keys, a K/V fingerprint per position (a function of the token prefix
//    and the keys covering it), the chain hashes of its full blocks, and how many trailing positions are pending
//    (slots reserved, writes not yet issued by a build);
//  - a shadow K/V pool, one fingerprint per slot, that a build updates exactly as the kernels would: every copy
//    of the copy list (all sources read before any destination is written: copy_blocks runs its copies in
//    parallel), then every slot of the slot mapping. Blocks that become free or are evicted are poisoned.
// What it checks (check_all after every operation, check_build_and_run_kernels after every build):
//  - per sequence: length, token ids, block count, no null or out-of-range block, pending slots = own positions;
//  - refcount(b) = tables holding b + pending copies reading b; every usable block exactly one of free / cached /
//    held, matching stats(); hashed <=> registered; a registered block of a sequence carries that sequence's
//    chain hash; the LRU holds exactly the cached blocks;
//  - pending copies: src != dst, no block both a source and a destination, each destination held by a table;
//  - a build's outputs against the state before it (page table, padded table, seq_lens, qo_indptr, slot mapping
//    with -1 exactly for deduplicated blocks, the copy list), registration / deduplication of the blocks it
//    writes, no write into a block that another table holds or that was already registered, no slot written
//    twice, and then the content: every built position of every live sequence reads, through its block table,
//    the fingerprint of its own prefix;
//  - events: seq_no +1 each, stored events carry the block's tokens, parent, adapter and overlapping multimodal
//    items, index size and eviction counter agree with stored / removed events;
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
  using Hasher = typename Mgr::hasher_type;
  static constexpr std::uint64_t kPoison = 0xDEADDEADDEADDEADULL;

  struct MSeq {
    Toks tokens;
    std::shared_ptr<const RequestKeys> keys;  // null = none
    std::vector<std::uint64_t> fp;            // fingerprint of the K/V at each position
    std::vector<BlockHash> hashes;            // chain hashes of the full blocks (prefix caching on)
    std::size_t pending = 0;                  // trailing positions whose writes no build has issued yet
  };

  /// The state a build starts from, for checking what it did.
  struct BuildPre {
    struct Row {
      SeqId id;
      Blocks blocks;
      std::size_t len;
      Slots pending;
    };
    std::vector<Row> rows;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> copies;
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
    std::tuple<std::size_t, std::size_t, std::size_t, std::size_t, std::uint64_t, std::uint64_t, std::uint64_t,
               std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t, std::uint64_t>
        stats;
    std::map<SeqId, std::tuple<Blocks, std::size_t, Toks, Slots>> seqs;
    std::vector<std::pair<std::uint64_t, std::uint64_t>> copies;
    std::vector<std::tuple<std::uint32_t, bool, bool, std::optional<BlockHash>>> blocks;
    Blocks lru;
    std::size_t index_size = 0;
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
  [[nodiscard]] const MSeq& seq(SeqId id) const { return seqs_.at(id); }
  [[nodiscard]] std::size_t blocks_for(std::size_t len) const noexcept { return (len + bs_ - 1) / bs_; }
  CallLog& log() noexcept { return log_; }

  [[noreturn]] void fail(const std::string& what) const { report_failure(log_, what); }
  void check(bool ok, const char* cond, int line, const std::string& detail = {}) const {
    if (!ok) fail(std::string(cond) + " (manager_model.hpp:" + std::to_string(line) + ")" + (detail.empty() ? "" : ": " + detail));
  }
#define PKV_MODEL_CHECK(cond, ...) check((cond), #cond, __LINE__ __VA_OPT__(, ) __VA_ARGS__)

  // ---- sequence content -------------------------------------------------------------------------------------------
  /// A new model sequence with `tokens` and `keys` (all pending).
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

  /// Append `add` to `s`: tokens, fingerprints, chain hashes of the newly full blocks.
  void extend(MSeq& s, std::span<const TokenId> add) const {
    const RequestKeys* keys = s.keys.get();
    for (TokenId t : add) {
      const std::size_t p = s.tokens.size();
      std::uint64_t f = p == 0 ? fp_seed(keys) : s.fp[p - 1];
      f = mix64(f ^ (std::uint64_t{static_cast<std::uint32_t>(t)} * 0x100000001b3ULL));
      if (keys != nullptr) {
        for (const MultimodalItem& m : keys->multimodal) {
          if (item_covers(m, p)) f = mix64(f ^ m.item_hash.low64() ^ 0x5bd1e995ULL);
        }
      }
      s.tokens.push_back(t);
      s.fp.push_back(f);
    }
    if (prefix_caching_) ref_.hash_full_blocks(s.tokens, bs_, keys, s.hashes);
  }

  void truncate(MSeq& s, std::size_t len) const {
    s.tokens.resize(len);
    s.fp.resize(len);
    s.hashes.resize(std::min(s.hashes.size(), len / bs_));
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

  /// Whether `id` is settled: no pending position, no pending copy into its table.
  bool settled(const Mgr& m, SeqId id) const {
    if (seqs_.at(id).pending != 0) return false;
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

  // ---- snapshots --------------------------------------------------------------------------------------------------
  Snapshot snapshot(const Mgr& m) const {
    Snapshot s;
    const CacheStats st = m.stats();
    s.stats = {st.num_usable_blocks,     st.blocks_used,          st.blocks_cached,       st.blocks_free,
               st.prefix_query_requests, st.prefix_hit_requests,  st.prefix_query_tokens, st.prefix_hit_tokens,
               st.evictions,             st.cow_copies,           st.dedup_blocks,        st.preemptions,
               st.block_ops};
    m.for_each_sequence([&](SeqId id, auto blocks, std::size_t n) {
      const auto t = m.token_ids(id);
      const auto p = m.pending_slots(id);
      s.seqs[id] = {Blocks(blocks.begin(), blocks.end()), n, Toks(t.begin(), t.end()), Slots(p.begin(), p.end())};
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
    PKV_MODEL_CHECK(m.num_sequences() == seqs_.size());
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
      const std::size_t len = s.tokens.size();
      PKV_MODEL_CHECK(m.num_tokens(id) == len, "sequence " + std::to_string(id) + " has " +
                                                   std::to_string(m.num_tokens(id)) + " tokens, model " +
                                                   std::to_string(len));
      const auto toks = m.token_ids(id);
      PKV_MODEL_CHECK(toks.size() == len && std::equal(toks.begin(), toks.end(), s.tokens.begin()),
                      "token ids of sequence " + std::to_string(id));
      const auto blocks = m.block_ids(id);
      PKV_MODEL_CHECK(blocks.size() == blocks_for(len), "sequence " + std::to_string(id));
      for (const auto b : blocks) {
        PKV_MODEL_CHECK(b != 0 && b < num_blocks_, "sequence " + std::to_string(id) + " holds block " + std::to_string(b));
        ++rc[b];
        ++holders[b];
      }
      if (prefix_caching_) {
        PKV_MODEL_CHECK(s.hashes.size() == len / bs_);
        for (std::size_t i = 0; i < len / bs_; ++i) {
          const auto h = idx.hash_of(blocks[i]);
          PKV_MODEL_CHECK(!h || *h == s.hashes[i], "sequence " + std::to_string(id) + " block " + std::to_string(i) +
                                                       " is registered under another hash");
        }
      }
      // The manager's own cursors (sequence_state.hpp) agree: no chunked or lookahead positions in these ops.
      const auto& q = m.sequence(id);
      PKV_MODEL_CHECK(q.num_slotted() == len && q.num_known() == len && q.num_lookahead == 0 &&
                          q.num_built == len - s.pending,
                      "cursors of sequence " + std::to_string(id) + ": built " + std::to_string(q.num_built) +
                          ", slotted " + std::to_string(q.num_slotted()) + ", known " + std::to_string(q.num_known()));
      PKV_MODEL_CHECK(q.settled() == settled(m, id), "settled() of sequence " + std::to_string(id));
      const auto pend = m.pending_slots(id);
      PKV_MODEL_CHECK(pend.size() == s.pending, "sequence " + std::to_string(id) + " has " +
                                                    std::to_string(pend.size()) + " pending slots, model " +
                                                    std::to_string(s.pending));
      PKV_MODEL_CHECK(s.pending <= len);
      const std::size_t first = len - s.pending;
      for (std::size_t k = 0; k < pend.size(); ++k) {
        const std::size_t p = first + k;
        const std::int64_t want = static_cast<std::int64_t>(blocks[p / bs_]) * bs_ + static_cast<std::int64_t>(p % bs_);
        PKV_MODEL_CHECK(pend[k] == want, "sequence " + std::to_string(id) + " position " + std::to_string(p) +
                                             " pending slot " + std::to_string(pend[k]) + ", own slot " +
                                             std::to_string(want));
      }
    }
    for (std::uint64_t b : dsts) {
      PKV_MODEL_CHECK(holders[b] >= 1, "pending copy into block " + std::to_string(b) + " that no table holds");
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
    state_ = std::move(now);
    check_events(m, st, expect_cleared);
    PKV_MODEL_CHECK(st.block_ops >= last_stats_.block_ops);
    last_stats_ = st;
  }

  // ---- builds ---------------------------------------------------------------------------------------------------
  BuildPre capture_build_pre(const Mgr& m, std::span<const SeqId> batch) const {
    BuildPre pre;
    for (SeqId id : batch) {
      if (!m.contains(id)) continue;
      const auto b = m.block_ids(id);
      const auto p = m.pending_slots(id);
      pre.rows.push_back({id, Blocks(b.begin(), b.end()), m.num_tokens(id), Slots(p.begin(), p.end())});
    }
    for (const auto& c : m.pending_copies()) pre.copies.emplace_back(c.src, c.dst);
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
      total_blocks += r.blocks.size();
      total_slots += r.pending.size();
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
      const std::size_t first = row.len - row.pending.size();
      std::set<std::size_t> written;
      for (std::size_t k = 0; k < row.pending.size(); ++k) written.insert((first + k) / bs_);
      for (std::size_t i = 0; i < post.size(); ++i) {
        const bool full = i < row.len / bs_;
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
      const std::uint64_t last = row.len == 0 ? 0 : row.len - (post.size() - 1) * bs_;
      if (!out.last_page_len.empty()) PKV_MODEL_CHECK(std::int64_t{out.last_page_len[b]} == static_cast<std::int64_t>(last));
      if (!out.seq_lens.empty()) PKV_MODEL_CHECK(std::int64_t{out.seq_lens[b]} == static_cast<std::int64_t>(row.len));
      if (!out.block_tables.empty()) {
        const auto row_len = static_cast<std::size_t>(out.max_blocks_per_seq);
        for (std::size_t i = 0; i < row_len; ++i) {
          const std::int64_t want = i < post.size() ? static_cast<std::int64_t>(post[i]) : 0;
          PKV_MODEL_CHECK(std::int64_t{out.block_tables[b * row_len + i]} == want, "block_tables row " + std::to_string(b));
        }
      }
      if (!out.indices.empty() && !out.indptr.empty()) {  // the CSR indices are written with their indptr
        for (std::size_t i = 0; i < post.size(); ++i) {
          PKV_MODEL_CHECK(std::int64_t{out.indices[blk + i]} == static_cast<std::int64_t>(post[i]));
        }
      }
      if (!out.slot_mapping.empty()) {
        for (std::size_t k = 0; k < row.pending.size(); ++k) {
          const std::size_t p = first + k;
          const std::int64_t want = post[p / bs_] != row.blocks[p / bs_] ? -1 : row.pending[k];
          PKV_MODEL_CHECK(out.slot_mapping[tok + k] == want, "slot_mapping of sequence " + std::to_string(row.id) +
                                                                 " position " + std::to_string(p) + " is " +
                                                                 std::to_string(out.slot_mapping[tok + k]) +
                                                                 ", expected " + std::to_string(want));
        }
      }
      blk += post.size();
      tok += row.pending.size();
    }
    PKV_MODEL_CHECK(m.stats().dedup_blocks == pre.stats.dedup_blocks + switched_out.size());
    // Copies: the pending ones in order, less those whose destination deduplication released (dropped with it).
    PKV_MODEL_CHECK(sz.num_copies <= pre.copies.size());
    std::vector<std::pair<std::uint64_t, std::uint64_t>> issued;
    for (const auto& c : pre.copies) {
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
    PKV_MODEL_CHECK(m.pending_copies().empty());
    for (const auto& row : pre.rows) {
      PKV_MODEL_CHECK(m.pending_slots(row.id).empty());
      seqs_.at(row.id).pending = 0;
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
      const std::size_t first = row.len - row.pending.size();
      for (std::size_t k = 0; k < row.pending.size(); ++k, ++at) {
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

  /// Every position of every live sequence whose writes have been issued reads back its own fingerprint.
  void check_content(const Mgr& m) const {
    for (const auto& [id, s] : seqs_) {
      const auto ids = m.block_ids(id);
      const std::size_t built = s.tokens.size() - s.pending;
      for (std::size_t p = 0; p < built; ++p) {
        const std::size_t slot = static_cast<std::size_t>(ids[p / bs_]) * bs_ + p % bs_;
        if (kv_[slot] != s.fp[p]) {
          fail("shadow K/V mismatch: sequence " + std::to_string(id) + " position " + std::to_string(p) + " reads block " +
               std::to_string(ids[p / bs_]) + " slot " + std::to_string(slot) +
               (kv_[slot] == kPoison ? " that no kernel wrote" : " holding another prefix's K/V"));
        }
      }
    }
  }

 private:
  enum class BlockState : std::uint8_t { kFree, kCached, kHeld };

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
    m.drain_events(ev);
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
          PKV_MODEL_CHECK(e.salt == (i == 0 && s.keys ? s.keys->salt : std::string()), "stored event salt");
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
      PKV_MODEL_CHECK(st.evictions == last_stats_.evictions + removed, "evictions counter vs removed events");
    }
    last_index_size_ = idx.size();
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
};

#undef PKV_MODEL_CHECK

}  // namespace pagedkv_fuzz
