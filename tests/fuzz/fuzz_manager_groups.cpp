// tests/fuzz/fuzz_manager_groups.cpp: libFuzzer target driving KVCacheManager with KV-cache groups (full, sliding-
// window and chunked-local, decoded from the input; full groups after group 0 with coarse pages of 2 or 4 match
// blocks when there is no host tier) together with the host tier (swap preemption, try_resume, complete_transfers in
// any order, write-back and write-through offload, host hits), lookahead slots and prepared prompts. Unlike fuzz_manager (which predicts every outcome of the one-group manager from a shadow model), this
// target checks invariants after every operation, plus a K/V content model:
//  - refcounts: every device block's refcount = references from the block tables of every group of every live
//    sequence + pending copy-on-write sources + pins of queued or in-flight host -> device copies; every host
//    block's = swapped sequences' references + queued or in-flight transfers touching it;
//  - held_blocks(g) = distinct referenced blocks whose group_of is g, summing to stats().blocks_used;
//  - prefix indexes: a registered block of prefix_index(g) belongs to group g, is hashed, is found under its hash,
//    and is registered in no other group; hashed <=> registered; the host index likewise; a table's registered
//    block carries the sequence's own chain hash (an independent PrefixHashIndex::hash_block chain); a coarse
//    page (KVCacheGroupSpec::block_size) is keyed by the hash of a match block inside it, and the prefix that hash
//    names agrees with the ids of every position the table slots under the key; every registered block holds the
//    content of the prefix its hash names (a coarse page from its start to the end of the keyed match block);
//  - hits (no host tier, prefix caching on, unless kNeverFits): query_admit's cached tokens are the brute-force
//    maximum over lengths every group serves (a windowed group the blocks its first query sees, a coarse group each
//    page of the hit keyed where the hit's content in it ends);
//  - block tables: null entries only lead a windowed group's table, exactly num_null_blocks(seq, g) of them; a
//    windowed group holds no block wholly before first_kept_block(num_built) and every block from there on (what
//    the next query sees); cursors and token ids agree with the driver's model of each sequence;
//  - builds: indptr / indices / block_tables / seq_lens / qo_indptr / last_page_len against the tables (in each
//    group's page size), slot mapping inside the row's own block of the group or -1, no slot written twice, no
//    write into a block that another table holds (a coarse page a hit took partial: before where that table ends)
//    or that was registered before the build (a coarse page: under its key), the transfer token and swap lists
//    against the transfer queue;
//  - content: a shadow device pool (a block is as many slots as the largest page of any group) and a shadow host
//    pool of fingerprints, one per slot. A build runs the step as an engine does (swap_out, swap_in, copy_blocks,
//    then write_kv of every group's slot mapping), a write storing the fingerprint of (the sequence's token prefix
//    up to the position, its adapter, the group). After every operation every built position of every live
//    sequence in a non-null block reads back its own fingerprint
//    (through a pending copy into the block, or a queued fill from the host), and so does every position of a
//    swapped sequence in its host blocks; after every build every position a query of the step can see reads back
//    its own fingerprint through the page table the build wrote;
//  - failed calls (an error thrown, kNoCapacity, kNeverFits, kTransferPending, a refused swap or reset) change
//    nothing (a snapshot of tables, refcounts, indexes, eviction orders, copies, transfers and counters);
//  - capacity queries agree with the calls they predict (query_admit / lookup with try_admit, query_append with
//    try_append / try_reserve / try_reserve_lookahead);
//  - at the end (and at kDrain): freeing everything, building once and completing every transfer (in an order the
//    input picks) leaves every device block free or cached, every host block unheld, no transfer and no copy.
//
// Input layout: a configuration (see decode_config), then one op byte (Op modulo kCount) and its arguments per
// operation; an exhausted input reads as zeros. make_seeds.cpp writes the seeds (tests/fuzz/corpus/manager_groups).
// PAGEDKV_FUZZ_VERBOSE=1 prints every call. docs/fuzzing.md.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/kv_cache_manager.hpp>

#include "byte_reader.hpp"
#include "manager_groups_ops.hpp"
#include "manager_model.hpp"  // CallLog, report_failure, mix64, toks_text

namespace pagedkv_fuzz {
namespace groups_detail {

using pagedkv::AdmitStatus;
using pagedkv::AppendStatus;
using pagedkv::AttentionKind;
using pagedkv::AttentionWindow;
using pagedkv::CapacityStatus;
using pagedkv::TransferKind;

inline constexpr std::size_t kMaxOps = 160;
inline constexpr std::uint64_t kPoison = 0xDEADBEEFDEADBEEFULL;

// Four fixed 160-token prompts over a 3-token alphabet: prompts are prefixes of them, so hits are frequent.
inline const std::vector<Toks>& bases() {
  static const std::vector<Toks> b = [] {
    std::vector<Toks> v(4, Toks(160));
    for (std::size_t i = 0; i < 4; ++i) {
      for (std::size_t j = 0; j < 160; ++j) v[i][j] = static_cast<TokenId>(i < 2 ? mix64(i * 1000 + j) % 3 : (j * (i + 1)) % 5);
    }
    return v;
  }();
  return b;
}

template <class Mgr>
class GroupsDriver {
 public:
  using Id = typename Mgr::block_id_type;

  GroupsDriver(const pagedkv::CacheConfig& c, CallLog& log)
      : m_(std::make_unique<Mgr>(c)),
        log_(log),
        bs_(c.block_size),
        nb_(c.num_blocks),
        nh_(c.num_host_blocks),
        G_(m_->num_groups()),
        caching_(c.enable_prefix_caching),
        root_(pagedkv::PrefixHashIndex<typename Mgr::hasher_type, Id>::root_for_seed(c.hash_seed)),
        stride_(max_page(c)),
        kv_(c.num_blocks * stride_, kPoison),
        hkv_(c.num_host_blocks * c.block_size, kPoison) {
    for (std::size_t g = 0; g < G_; ++g) {
      windows_.push_back(m_->window(g));
      hit_windows_.push_back(g < c.groups.size() ? c.groups[g].hit_window() : AttentionWindow{});
      page_.push_back(m_->block_size(g));
    }
  }

  void run(ByteReader& r) {
    check_all("construction");
    for (std::size_t i = 0; i < kMaxOps && !r.empty(); ++i) {
      const auto op = static_cast<GOp>(r.u8() % static_cast<std::uint8_t>(GOp::kCount));
      step(op, r);
      check_all(op_name(op));
    }
    drain(r);
  }

 private:
  // ---- the model of one sequence ----------------------------------------------------------------------------------
  struct MSeq {
    Toks tokens;                          // known token ids
    Toks drafts;                          // lookahead drafts (positions after tokens)
    std::shared_ptr<RequestKeys> keys;    // null = none
    bool swapped = false;
  };

  Mgr& m() { return *m_; }
  [[noreturn]] void fail(const std::string& what) const { report_failure(log_, what); }
  void expect(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }
  static std::string S(std::uint64_t v) { return std::to_string(v); }

  std::size_t blocks_for(std::size_t tokens) const { return (tokens + bs_ - 1) / bs_; }
  /// Group g's pages of `tokens` positions (its block table, page table row).
  std::size_t pages_for(std::size_t g, std::size_t tokens) const { return (tokens + page_[g] - 1) / page_[g]; }
  bool coarse(std::size_t g) const { return page_[g] != bs_; }
  static std::size_t max_page(const pagedkv::CacheConfig& c) {
    std::size_t s = c.block_size;
    for (const auto& g : c.groups) s = std::max<std::size_t>(s, g.block_size);
    return s;
  }
  /// The shadow pool's slot of position p in group g's page `blk`.
  std::size_t kv_at(std::size_t g, std::size_t blk, std::size_t p) const { return blk * stride_ + p % page_[g]; }
  /// Remember the prefix (token ids, keys) every full block hash of `s` names.
  void learn(const MSeq& s, const std::vector<BlockHash>& hs) {
    for (std::size_t i = 0; i < hs.size(); ++i) {
      if (known_.contains(hs[i])) continue;
      known_.emplace(hs[i], MSeq{Toks(s.tokens.begin(), s.tokens.begin() + static_cast<std::ptrdiff_t>((i + 1) * bs_)),
                                 {}, s.keys, false});
    }
  }
  /// Whether a hit of k match blocks of a prompt with chain hashes `hs` can be served by group g from the device
  /// index: a windowed group's blocks [first_kept_block(k * bs), k), a coarse group's page ends and the hit's end.
  bool servable(std::size_t g, std::size_t k, const std::vector<BlockHash>& hs) {
    const std::size_t f = page_[g] / bs_;
    const std::size_t lo = pagedkv::detail::first_kept_block(hit_windows_[g], k * bs_, bs_);
    for (std::size_t i = lo; i < k; ++i) {
      if (f > 1 && (i + 1) % f != 0 && i + 1 != k) continue;
      if (!m().prefix_index(g).find(hs[i])) return false;
    }
    return true;
  }

  /// Fingerprints of every position of `s` (tokens, then drafts) before the group mix: a chain over the token ids
  /// and the adapter (the salt isolates hashes, not K/V content).
  std::vector<std::uint64_t> chain(const MSeq& s) const {
    std::vector<std::uint64_t> out;
    out.reserve(s.tokens.size() + s.drafts.size());
    std::uint64_t h = mix64(0x1234 + (s.keys ? s.keys->adapter_id : 0));
    auto add = [&](TokenId t) {
      h = mix64(h ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(t)) * 0x100000001B3ULL));
      out.push_back(h);
    };
    for (TokenId t : s.tokens) add(t);
    for (TokenId t : s.drafts) add(t);
    return out;
  }
  static std::uint64_t fp(const std::vector<std::uint64_t>& ch, std::size_t p, std::size_t g) {
    return mix64(ch[p] + 0x51ED27ULL * (g + 1));
  }
  /// The chain hashes of the known full blocks of `s` (independent of the manager's own).
  std::vector<BlockHash> ref_hashes(const MSeq& s) const {
    std::vector<BlockHash> out;
    using Ix = pagedkv::PrefixHashIndex<typename Mgr::hasher_type, Id>;
    for (std::size_t i = 0; i < s.tokens.size() / bs_; ++i) {
      out.push_back(Ix::hash_block(i == 0 ? root_ : out.back(), std::span<const TokenId>(s.tokens).subspan(i * bs_, bs_),
                                   i * bs_, s.keys.get()));
    }
    return out;
  }

  // ---- snapshots (failed calls change nothing) ---------------------------------------------------------------------
  struct Snapshot {
    std::map<SeqId, std::tuple<std::vector<std::vector<std::uint64_t>>, std::vector<std::size_t>, std::size_t,
                               std::size_t, Toks, std::size_t>>
        seqs;  // per group blocks, per group nulls, built, slotted, tokens, lookahead
    std::map<SeqId, std::vector<std::uint64_t>> swapped;
    std::vector<std::tuple<std::uint32_t, bool, std::uint32_t, std::vector<std::optional<BlockHash>>>> blocks;
    std::vector<std::tuple<std::uint32_t, bool, bool, std::optional<BlockHash>>> host_blocks;
    std::vector<std::uint64_t> lru, host_lru;
    std::vector<std::tuple<std::uint64_t, std::uint64_t, std::uint32_t>> copies;
    std::vector<std::tuple<std::uint64_t, std::uint64_t, int, std::uint64_t, std::uint32_t>> queued, in_flight;
    std::vector<std::uint64_t> stats;
    std::vector<std::size_t> held, peak;
    friend bool operator==(const Snapshot&, const Snapshot&) = default;
  };

  Snapshot snapshot() {
    Snapshot s;
    for (const auto& [id, ms] : seqs_) {
      if (ms.swapped) {
        const auto hb = m().swapped_host_blocks(id);
        s.swapped[id] = std::vector<std::uint64_t>(hb.begin(), hb.end());
        continue;
      }
      std::vector<std::vector<std::uint64_t>> tabs;
      std::vector<std::size_t> nulls;
      for (std::size_t g = 0; g < G_; ++g) {
        const auto b = m().block_ids(id, g);
        tabs.emplace_back(b.begin(), b.end());
        nulls.push_back(m().num_null_blocks(id, g));
      }
      const auto t = m().token_ids(id);
      s.seqs[id] = {tabs, nulls, m().num_built(id), m().num_tokens(id), Toks(t.begin(), t.end()),
                    m().sequence(id).num_lookahead};
    }
    const auto& a = m().allocator();
    for (std::size_t b = 1; b < nb_; ++b) {
      std::vector<std::optional<BlockHash>> h;
      for (std::size_t g = 0; g < G_; ++g) h.push_back(m().prefix_index(g).hash_of(static_cast<Id>(b)));
      s.blocks.emplace_back(a.refcount(static_cast<Id>(b)), a.is_hashed(static_cast<Id>(b)),
                            m().group_of(static_cast<Id>(b)), std::move(h));
    }
    for (Id b : a.eviction_policy().order()) s.lru.push_back(b);
    if (const auto* h = m().host_tier()) {
      for (std::size_t b = 1; b < nh_; ++b) {
        const Id hb = static_cast<Id>(b);
        s.host_blocks.emplace_back(h->allocator().refcount(hb), h->allocator().is_hashed(hb), h->is_ready(hb),
                                   h->index().hash_of(hb));
      }
      for (Id b : h->allocator().eviction_policy().order()) s.host_lru.push_back(b);
    }
    for (const auto& c : m().pending_copies()) s.copies.emplace_back(c.src, c.dst, c.group);
    for (const auto& t : m().transfers().queued()) {
      s.queued.emplace_back(t.device, t.host, static_cast<int>(t.kind), t.token, t.group);
    }
    for (const auto& t : m().transfers().in_flight()) {
      s.in_flight.emplace_back(t.device, t.host, static_cast<int>(t.kind), t.token, t.group);
    }
    const pagedkv::CacheStats st = m().stats();
    s.stats = {st.blocks_used, st.blocks_cached, st.blocks_free, st.prefix_query_requests, st.prefix_hit_requests,
               st.prefix_query_tokens, st.prefix_hit_tokens, st.readmitted_requests, st.evictions, st.cow_copies,
               st.dedup_blocks, st.preemptions, st.block_ops, st.host_blocks_used, st.host_blocks_cached,
               st.host_blocks_free, st.host_hit_tokens, st.host_evictions, st.offloads, st.offloads_dropped,
               st.onboards, st.swap_outs, st.swap_ins, st.transfers_in_flight, st.transfers_queued,
               m().num_sequences(), m().num_swapped()};
    for (std::size_t g = 0; g < G_; ++g) {
      s.held.push_back(m().held_blocks(g));
      s.peak.push_back(m().peak_held_blocks(g));
    }
    s.peak.push_back(m().peak_used_blocks());
    return s;
  }

  void expect_unchanged(const Snapshot& before, const std::string& what) {
    const Snapshot after = snapshot();
    if (after == before) return;
    std::string diff;
    if (after.seqs != before.seqs) diff += " sequences";
    if (after.swapped != before.swapped) diff += " swapped";
    if (after.blocks != before.blocks) diff += " device-blocks";
    if (after.host_blocks != before.host_blocks) diff += " host-blocks";
    if (after.lru != before.lru) diff += " eviction-order";
    if (after.host_lru != before.host_lru) diff += " host-eviction-order";
    if (after.copies != before.copies) diff += " pending-copies";
    if (after.queued != before.queued) diff += " queued-transfers";
    if (after.in_flight != before.in_flight) diff += " in-flight-transfers";
    if (after.stats != before.stats) diff += " stats";
    if (after.held != before.held || after.peak != before.peak) diff += " held/peak";
    fail(what + " changed state:" + diff);
  }

  /// Runs `f`; on pagedkv::Error checks that nothing changed and returns false. `must_succeed`: an error is a
  /// finding (the call was valid).
  template <class F>
  bool attempt(const Snapshot& before, bool must_succeed, F&& f) {
    try {
      f();
      return true;
    } catch (const pagedkv::Error& e) {
      log_.result(std::string("throws ") + errc_text(e.code()) + ": " + e.message());
      if (must_succeed) fail("a valid call threw " + errc_text(e.code()) + ": " + e.message());
      expect(!e.message().empty(), "an error without a message");
      expect_unchanged(before, "a call that threw " + errc_text(e.code()));
      return false;
    }
  }

  // ---- decoding -----------------------------------------------------------------------------------------------------
  static SeqId seq_id(std::uint8_t b) { return SeqId{b % 8U}; }
  const MSeq* model(SeqId id) const {
    const auto it = seqs_.find(id);
    return it == seqs_.end() ? nullptr : &it->second;
  }
  bool live(SeqId id) const {
    const MSeq* s = model(id);
    return s != nullptr && !s->swapped;
  }
  /// An id: mostly a live or swapped one (index byte), sometimes any id.
  SeqId pick_id(ByteReader& r) const {
    const std::uint8_t b = r.u8();
    if (b >= 224 || seqs_.empty()) return seq_id(b);
    auto it = seqs_.begin();
    std::advance(it, b % seqs_.size());
    return it->first;
  }

  Toks decode_prompt(ByteReader& r) const {
    const std::uint8_t k = r.u8();
    Toks p;
    if (k < 192) {
      const Toks& base = bases()[k & 3];
      const std::size_t len = 1 + r.u8() % (std::min<std::size_t>(base.size(), 4 * bs_ + 40));
      p.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(len));
      for (std::size_t i = 0, extra = (k >> 2) & 3; i < extra; ++i) p.push_back(static_cast<TokenId>(r.u8() % 4));
    } else if (k < 224) {  // a live or swapped sequence's tokens, less a few (re-admission, shared prefixes)
      const std::uint8_t w = r.u8(), drop = r.u8() % 6;
      if (!seqs_.empty()) {
        auto it = seqs_.begin();
        std::advance(it, w % seqs_.size());
        const Toks& t = it->second.tokens;
        p.assign(t.begin(), t.end() - static_cast<std::ptrdiff_t>(std::min<std::size_t>(drop, t.size())));
      }
      if (p.empty()) p.push_back(1);
    } else if (k < 254) {  // raw tokens (none: an empty prompt, a sequence with no token yet)
      for (std::size_t i = 0, n = (k - 224) % 24; i < n; ++i) p.push_back(static_cast<TokenId>(r.u8() % 3));
    } else {  // long: around the pool's capacity
      const std::size_t n = 1 + r.u16() % (2 * (nb_ - 1) * bs_ + 8);
      p.resize(n);
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<TokenId>((i * (k & 1 ? 3 : 1)) % 4);
    }
    return p;
  }

  std::shared_ptr<RequestKeys> decode_keys(ByteReader& r) const {
    const std::uint8_t k = r.u8() % 8;
    if (k < 5) return nullptr;
    auto keys = std::make_shared<RequestKeys>();
    if (k == 5) keys->salt = "tenant-a";
    if (k == 6) keys->adapter_id = 7;
    if (k == 7) keys->adapter_id = 7, keys->salt = "tenant-b";
    return keys;
  }

  Toks decode_tokens(ByteReader& r, const MSeq& s, std::size_t n) const {
    const std::uint8_t mode = r.u8();
    Toks t(n);
    const std::size_t pos = s.tokens.size();
    for (std::size_t i = 0; i < n; ++i) {
      switch (mode % 4) {
        case 0: t[i] = static_cast<TokenId>(((pos + i) * 7 + 3) % 5); break;  // equal sequences grow equal blocks
        case 1: t[i] = static_cast<TokenId>(mode >> 2); break;
        case 2: {  // the base prompt's continuation (siblings hit each other's blocks)
          const Toks& b = bases()[(mode >> 2) & 3];
          t[i] = pos + i < b.size() ? b[pos + i] : static_cast<TokenId>(i % 3);
          break;
        }
        default: t[i] = static_cast<TokenId>(i < 24 ? r.u8() % 3 : 0); break;
      }
    }
    return t;
  }

  std::string ops_text(const pagedkv::AdmitOptions& o) const {
    auto opt = [](const std::optional<std::size_t>& v) { return v ? S(*v) : std::string("-"); };
    return "{cap " + opt(o.max_cached_tokens) + ", reserve " + opt(o.num_reserved_tokens) + "}";
  }
  static std::string keys_text(const RequestKeys* k) {
    if (k == nullptr) return "no keys";
    return "{adapter " + S(k->adapter_id) + ", salt '" + k->salt + "'}";
  }

  // ---- operations ---------------------------------------------------------------------------------------------------
  void step(GOp op, ByteReader& r) {
    switch (op) {
      case GOp::kAdmit: op_admit(r, false); break;
      case GOp::kAdmitPrepared: op_admit(r, true); break;
      case GOp::kAppend: op_grow(r, Growth::kAppend); break;
      case GOp::kReserve: op_grow(r, Growth::kReserve); break;
      case GOp::kLookahead: op_grow(r, Growth::kLookahead); break;
      case GOp::kCommit: op_commit(r); break;
      case GOp::kFork: op_fork(r); break;
      case GOp::kFree: op_free(r); break;
      case GOp::kPreempt: op_preempt(r, false); break;
      case GOp::kSwap: op_preempt(r, true); break;
      case GOp::kResume: op_resume(r); break;
      case GOp::kComplete: op_complete(r); break;
      case GOp::kRewind: op_rewind(r); break;
      case GOp::kStep: op_build(r, false); break;
      case GOp::kBuildScheduled: op_build(r, true); break;
      case GOp::kLookup: op_lookup(r); break;
      case GOp::kReset: op_reset(); break;
      case GOp::kDrainEvents: {
        std::vector<pagedkv::KVEvent> ev;
        m().drain_events(ev);
        break;
      }
      case GOp::kDrain: drain(r); break;
      case GOp::kCount: break;
    }
  }

  static const char* op_name(GOp op) {
    static const char* names[] = {"admit",  "admit prepared", "append",  "reserve",      "lookahead",
                                  "commit", "fork",           "free",    "preempt",      "swap",
                                  "resume", "complete",       "rewind",  "step",         "build scheduled",
                                  "lookup", "reset",          "drain events", "drain"};
    return names[static_cast<int>(op)];
  }

  void op_admit(ByteReader& r, bool prepared) {
    const SeqId id = seq_id(r.u8());
    const Toks prompt = decode_prompt(r);
    const auto keys = decode_keys(r);
    pagedkv::AdmitOptions o;
    const std::uint8_t c = r.u8(), v = r.u8();
    if (c >= 192) o.max_cached_tokens = c == 255 ? prompt.size() : (c - 192) % (prompt.size() + 2);
    if (v < 160) o.num_reserved_tokens = v % (prompt.size() + 2);
    const bool dup = model(id) != nullptr;
    log_.add(std::string(prepared ? "p = m.prepare_prompt(" : "m.try_admit(") + S(id) + ", " + toks_text(prompt) + ", " +
             keys_text(keys.get()) + ", " + ops_text(o) + ")");
    const Snapshot before = snapshot();
    std::optional<pagedkv::PreparedPrompt> p;
    pagedkv::CapacityQuery q;
    std::size_t looked = 0;
    if (prepared) {
      attempt(before, true, [&] { p.emplace(m().prepare_prompt(prompt, keys.get())); });
      attempt(before, true, [&] { q = m().query_admit(*p, o); });
    } else {
      attempt(before, true, [&] { q = m().query_admit(prompt, keys.get(), o); });
    }
    attempt(before, true, [&] { looked = m().lookup(prompt, keys.get(), o.max_cached_tokens); });
    expect_unchanged(before, "query_admit / lookup / prepare_prompt (pure)");
    if (caching_ && nh_ == 0 && q.status != CapacityStatus::kNeverFits) {  // the hit: the brute-force maximum
      const MSeq ps{prompt, {}, keys, false};
      const auto hs = ref_hashes(ps);
      const std::size_t cap = std::min(o.max_cached_tokens.value_or(prompt.size() - 1), prompt.size());
      std::size_t k = std::min(hs.size(), cap / bs_);
      for (; k > 0; --k) {
        bool all = true;
        for (std::size_t g = 0; g < G_ && all; ++g) all = servable(g, k, hs);
        if (all) break;
      }
      expect(q.num_cached_tokens == k * bs_, "query_admit hits " + S(q.num_cached_tokens) + " tokens, the oracle " +
                                                 S(k * bs_));
    }
    pagedkv::AdmitResult res;
    if (!attempt(before, !dup, [&] { res = p ? m().try_admit(id, *p, o) : m().try_admit(id, prompt, keys.get(), o); })) {
      return;
    }
    expect(!dup, "try_admit of a live or swapped id succeeded");
    log_.result("status " + S(static_cast<int>(res.status)) + ", cached " + S(res.num_cached_tokens) + " (host " +
                S(res.num_host_cached_tokens) + "), new blocks " + S(res.num_new_blocks) + ", missing " +
                S(res.num_missing_blocks));
    expect(static_cast<int>(res.status) == static_cast<int>(q.status),
           "try_admit status " + S(static_cast<int>(res.status)) + ", query_admit said " + S(static_cast<int>(q.status)));
    if (!res.admitted()) {
      expect(res.num_missing_blocks == q.num_missing_blocks, "num_missing_blocks differs from query_admit's");
      expect_unchanged(before, "an admission answered no capacity / never fits");
      return;
    }
    expect(res.num_new_blocks == q.num_blocks && res.num_cached_tokens == q.num_cached_tokens,
           "try_admit took " + S(res.num_new_blocks) + " blocks / " + S(res.num_cached_tokens) +
               " cached tokens, query_admit said " + S(q.num_blocks) + " / " + S(q.num_cached_tokens));
    expect(looked == res.num_cached_tokens, "lookup said " + S(looked) + " cached tokens, the admission " +
                                                S(res.num_cached_tokens));
    const std::size_t cached = res.num_cached_tokens;
    expect(cached % bs_ == 0 && cached <= prompt.size() && res.num_host_cached_tokens <= cached,
           "admitted cached token counts");
    expect(cached <= std::min(o.max_cached_tokens.value_or(prompt.size() - 1), prompt.size()),
           "more cached tokens than the cap");
    const std::size_t reserved = std::min(o.num_reserved_tokens.value_or(prompt.size()), prompt.size() - cached);
    expect(m().num_built(id) == cached && m().num_tokens(id) == cached + reserved,
           "an admitted sequence's cursors: built " + S(m().num_built(id)) + ", slotted " + S(m().num_tokens(id)));
    seqs_[id] = MSeq{prompt, {}, keys, false};
  }

  enum class Growth { kAppend, kReserve, kLookahead };

  void op_grow(ByteReader& r, Growth how) {
    const SeqId id = pick_id(r);
    const std::uint8_t nb = r.u8();
    const MSeq* s = model(id);
    std::size_t n = nb < 200 ? nb % 6 : (nb - 199) % 24 + 1;
    if (nb == 255) n = nb_ * bs_ + 1;
    if (how == Growth::kReserve && live(id)) {
      const std::size_t uns = m().sequence(id).num_unslotted();
      n = nb < 240 ? nb % (uns + 2) : uns;
    }
    Toks toks;
    if (how != Growth::kReserve && s != nullptr && n <= 4096) toks = decode_tokens(r, *s, n);
    const char* name = how == Growth::kAppend ? "try_append" : how == Growth::kReserve ? "try_reserve" : "try_reserve_lookahead";
    log_.add(std::string("m.") + name + "(" + S(id) + ", " + (how == Growth::kReserve ? S(n) : toks_text(toks)) + ")");
    const Snapshot before = snapshot();
    pagedkv::CapacityQuery q;
    if (!attempt(before, false, [&] { q = m().query_append(id, n); })) {
      expect(!live(id), "query_append threw for a live sequence");
    }
    expect_unchanged(before, "query_append (pure)");
    pagedkv::AppendResult<Id> res;
    bool must = false;
    if (live(id)) {
      const auto& st = m().sequence(id);
      if (how == Growth::kReserve) {
        must = n <= st.num_unslotted();
      } else {
        must = st.num_unslotted() == 0 && st.num_lookahead == 0 && st.num_known() + n <= m().max_tokens_per_seq();
      }
    }
    if (!attempt(before, must, [&] {
          if (how == Growth::kAppend) res = m().try_append(id, toks);
          if (how == Growth::kReserve) res = m().try_reserve(id, n);
          if (how == Growth::kLookahead) res = m().try_reserve_lookahead(id, n);
        })) {
      return;
    }
    expect(live(id), std::string(name) + " of a sequence that is not live succeeded");
    log_.result("status " + S(static_cast<int>(res.status)) + ", new blocks " + S(res.num_new_blocks) +
                (res.copy ? ", copy " + S(res.copy->src) + "->" + S(res.copy->dst) : std::string()));
    if (n > 0) {
      expect(static_cast<int>(res.status) == static_cast<int>(q.status),
             std::string(name) + " status " + S(static_cast<int>(res.status)) + ", query_append said " +
                 S(static_cast<int>(q.status)));
    }
    if (!res.ok()) {
      expect(res.num_missing_blocks == q.num_missing_blocks, "num_missing_blocks differs from query_append's");
      expect_unchanged(before, std::string(name) + " answered no capacity / never fits");
      return;
    }
    if (n > 0) expect(res.num_new_blocks == q.num_blocks, "num_new_blocks differs from query_append's");
    expect(res.slots.size() == n || how == Growth::kReserve || n == 0, "slots returned");
    MSeq& ms = seqs_.at(id);
    if (how == Growth::kAppend) ms.tokens.insert(ms.tokens.end(), toks.begin(), toks.end());
    if (how == Growth::kLookahead) ms.drafts = toks;
  }

  void op_commit(ByteReader& r) {
    const SeqId id = pick_id(r);
    const std::uint8_t a = r.u8();
    const MSeq* s = model(id);
    const std::size_t k = s != nullptr ? s->drafts.size() : 0;
    Toks acc;
    const std::size_t na = a % (k + 2);
    for (std::size_t i = 0; i < na; ++i) acc.push_back(i < k ? s->drafts[i] : 1);
    log_.add("m.commit_lookahead(" + S(id) + ", " + toks_text(acc) + ")");
    const Snapshot before = snapshot();
    if (!attempt(before, live(id) && na <= k, [&] { m().commit_lookahead(id, acc); })) return;
    expect(live(id) && na <= k, "commit_lookahead succeeded on a bad call");
    MSeq& ms = seqs_.at(id);
    ms.tokens.insert(ms.tokens.end(), acc.begin(), acc.end());
    ms.drafts.clear();
  }

  bool settled(SeqId id) {
    const auto& st = m().sequence(id);
    return st.settled();
  }

  void op_fork(ByteReader& r) {
    const SeqId parent = pick_id(r), child = seq_id(r.u8());
    log_.add("m.fork(" + S(parent) + ", " + S(child) + ")");
    const Snapshot before = snapshot();
    if (!attempt(before, false, [&] { m().fork(parent, child); })) return;
    expect(live(parent) && model(child) == nullptr && settled(parent), "fork succeeded on a bad call");
    seqs_[child] = seqs_.at(parent);
  }

  void op_free(ByteReader& r) {
    const SeqId id = pick_id(r);
    log_.add("m.free(" + S(id) + ")");
    const Snapshot before = snapshot();
    if (!attempt(before, model(id) != nullptr, [&] { m().free(id); })) return;
    seqs_.erase(id);
  }

  void op_preempt(ByteReader& r, bool swap) {
    const SeqId id = pick_id(r);
    log_.add(std::string("m.preempt(") + S(id) + (swap ? ", kSwap)" : ")"));
    const Snapshot before = snapshot();
    bool ok = true;
    if (!attempt(before, !swap && live(id), [&] {
          if (swap) {
            ok = m().preempt(id, pagedkv::PreemptMode::kSwap);
          } else {
            m().preempt(id);
          }
        })) {
      return;
    }
    log_.result(ok ? "true" : "false");
    expect(live(id), "preempt of a sequence that is not live succeeded");
    if (!ok) {
      expect_unchanged(before, "a refused swap");
      return;
    }
    if (swap) {
      expect(m().is_swapped(id) && !m().contains(id), "a swapped sequence is live or not swapped");
      const auto hb = m().swapped_host_blocks(id);
      const auto& tabs = std::get<0>(before.seqs.at(id));
      expect(hb.size() == G_ * tabs[0].size(), "swapped_host_blocks has " + S(hb.size()) + " entries, expected groups x blocks");
      for (std::size_t g = 0; g < G_; ++g) {
        for (std::size_t i = 0; i < tabs[g].size(); ++i) {
          expect((tabs[g][i] == 0) == (hb[g * tabs[g].size() + i] == 0),
                 "swapped_host_blocks: null entries differ from the device table (group " + S(g) + ", block " + S(i) + ")");
        }
      }
      seqs_.at(id).swapped = true;
    } else {
      seqs_.erase(id);
    }
  }

  void op_resume(ByteReader& r) {
    const SeqId id = pick_id(r);
    log_.add("m.try_resume(" + S(id) + ")");
    const Snapshot before = snapshot();
    const MSeq* s = model(id);
    const bool swapped = s != nullptr && s->swapped;
    pagedkv::AdmitResult res;
    if (!attempt(before, swapped, [&] { res = m().try_resume(id); })) return;
    expect(swapped, "try_resume of a sequence that is not swapped succeeded");
    log_.result("status " + S(static_cast<int>(res.status)) + ", tokens " + S(res.num_cached_tokens) + " (host " +
                S(res.num_host_cached_tokens) + "), new blocks " + S(res.num_new_blocks));
    if (!res.admitted()) {
      expect_unchanged(before, "a resume answered no capacity / never fits / transfer pending");
      return;
    }
    MSeq& ms = seqs_.at(id);
    ms.swapped = false;
    const std::size_t len = ms.tokens.size();
    expect(m().num_tokens(id) == len && m().num_built(id) == len && res.num_cached_tokens == len &&
               res.num_host_cached_tokens <= len,
           "a resumed sequence's cursors");
  }

  void op_complete(ByteReader& r) {
    const std::uint8_t b = r.u8();
    std::uint64_t token;
    bool valid = true;
    if (!tokens_.empty() && b % (tokens_.size() + 1) < tokens_.size()) {
      token = tokens_[b % (tokens_.size() + 1)];
    } else {
      valid = false;
      token = (b & 1) ? 0 : m().transfers().last_token() + 1 + (b >> 4);
      if ((b & 2) && !done_tokens_.empty()) token = done_tokens_[b % done_tokens_.size()];
    }
    complete(token, valid);
  }

  void complete(std::uint64_t token, bool valid) {
    log_.add("m.complete_transfers(" + S(token) + ")");
    const Snapshot before = snapshot();
    if (!attempt(before, valid, [&] { m().complete_transfers(token); })) return;
    expect(valid, "complete_transfers of a token not in flight succeeded");
    std::erase(tokens_, token);
    done_tokens_.push_back(token);
    for (const auto& t : m().transfers().in_flight()) expect(t.token != token, "a completed token is still in flight");
    // The filled host blocks are ready now.
    for (const auto& t : before.in_flight) {
      if (std::get<3>(t) != token) continue;
      if (pagedkv::is_device_to_host(static_cast<TransferKind>(std::get<2>(t)))) {
        expect(m().host_tier()->is_ready(static_cast<Id>(std::get<1>(t))), "a host block filled by a completed copy is not ready");
      }
    }
  }

  void op_rewind(ByteReader& r) {
    const SeqId id = pick_id(r);
    const std::uint8_t b = r.u8();
    std::size_t len = 0;
    if (live(id)) len = m().sequence(id).num_known() + m().sequence(id).num_lookahead;
    const std::size_t n = b < 128 ? b % (bs_ + 1) : b < 250 ? (b - 128) % (len + 1) : len + (b - 249);
    log_.add("m.rewind(" + S(id) + ", " + S(n) + ")");
    const Snapshot before = snapshot();
    if (!attempt(before, false, [&] { m().rewind(id, n); })) return;
    expect(live(id) && n <= len, "rewind succeeded on a bad call");
    MSeq& ms = seqs_.at(id);
    const std::size_t dl = std::min(n, ms.drafts.size());
    ms.drafts.resize(ms.drafts.size() - dl);
    ms.tokens.resize(ms.tokens.size() - (n - dl));
  }

  void op_lookup(ByteReader& r) {
    const Toks prompt = decode_prompt(r);
    const auto keys = decode_keys(r);
    const std::uint8_t c = r.u8();
    std::optional<std::size_t> cap;
    if (c >= 128) cap = (c - 128) % (prompt.size() + 2);
    log_.add("m.lookup(" + toks_text(prompt) + ", " + keys_text(keys.get()) + ") / query_admit");
    const Snapshot before = snapshot();
    std::size_t looked = 0;
    pagedkv::CapacityQuery q;
    pagedkv::AdmitOptions o;
    o.max_cached_tokens = cap;
    attempt(before, true, [&] { looked = m().lookup(prompt, keys.get(), cap); });
    attempt(before, true, [&] { q = m().query_admit(prompt, keys.get(), o); });
    log_.result(S(looked) + " cached; query status " + S(static_cast<int>(q.status)));
    expect_unchanged(before, "lookup / query_admit (pure)");
    if (q.status != CapacityStatus::kNeverFits) {
      expect(looked == q.num_cached_tokens, "lookup says " + S(looked) + ", query_admit " + S(q.num_cached_tokens));
    }
  }

  void op_reset() {
    log_.add("m.reset_prefix_cache()");
    const Snapshot before = snapshot();
    const bool ok = m().reset_prefix_cache();
    log_.result(ok ? "true" : "false");
    if (!ok) {
      expect_unchanged(before, "a refused reset_prefix_cache");
      return;
    }
    for (std::size_t g = 0; g < G_; ++g) expect(m().prefix_index(g).size() == 0, "reset left registered blocks");
    if (const auto* h = m().host_tier()) expect(h->index().size() == 0, "reset left registered host blocks");
  }

  // ---- builds -------------------------------------------------------------------------------------------------------
  struct GroupBuf {
    std::vector<std::int32_t> indptr, indices, last_page_len, block_tables, seq_lens, qo_indptr, copies, swap_out, swap_in;
    std::vector<std::int64_t> slot_mapping;
    std::int32_t row = 0;
  };

  void op_build(ByteReader& r, bool scheduled) {
    std::vector<SeqId> batch;
    std::vector<std::uint32_t> qlens;
    for (const auto& [id, s] : seqs_) {
      if (s.swapped) continue;
      const std::size_t pending = m().sequence(id).num_pending();
      if (pending == 0) continue;
      if (scheduled) {
        const std::uint8_t q = r.u8();
        if (q >= 240) continue;  // not scheduled this step
        qlens.push_back(static_cast<std::uint32_t>(q < 160 ? 1 + q % pending : pending));
      }
      batch.push_back(id);
    }
    const std::uint8_t shape = scheduled ? r.u8() : 0;
    if (shape & 1) {
      std::reverse(batch.begin(), batch.end());
      std::reverse(qlens.begin(), qlens.end());
    }
    build(batch, qlens, shape);
  }

  void build(const std::vector<SeqId>& batch, const std::vector<std::uint32_t>& qlens, std::uint8_t shape) {
    const std::size_t B = batch.size();
    std::string text = "m.build_batch_metadata({";
    for (std::size_t i = 0; i < B; ++i) text += (i ? "," : "") + S(batch[i]) + (qlens.empty() ? "" : ":" + S(qlens[i]));
    log_.add(text + "})");
    // Pre-build state of the batch: first position, q_len, tables.
    std::vector<std::size_t> first(B), qlen(B);
    std::vector<std::size_t> total_blocks(G_, 0), max_row(G_, 1);  // per group: its pages
    std::size_t total_tokens = 0;
    for (std::size_t b = 0; b < B; ++b) {
      first[b] = m().num_built(batch[b]);
      qlen[b] = qlens.empty() ? m().sequence(batch[b]).num_pending() : qlens[b];
      for (std::size_t g = 0; g < G_; ++g) {
        const std::size_t rows = pages_for(g, first[b] + qlen[b]);
        total_blocks[g] += rows;
        max_row[g] = std::max(max_row[g], rows);
      }
      total_tokens += qlen[b];
    }
    // Table holders and hash marks before the build (a write may go only into a block one table holds, unhashed).
    // A coarse page that a hit took partial may be held by tables ending inside it, while the table that filled it
    // still writes its pending positions after theirs: a write may go into a page other tables hold only past
    // where they end (held_to: per block, the slotted lengths of its holders).
    std::vector<std::uint32_t> holders(nb_, 0);
    std::vector<std::vector<std::pair<SeqId, std::size_t>>> held_to(nb_);
    std::vector<bool> hashed_before(nb_, false);
    std::vector<std::size_t> key_end(nb_, 0);  // a registered coarse page: the end of the prefix its key names
    for (const auto& [id, s] : seqs_) {
      if (s.swapped) continue;
      for (std::size_t g = 0; g < G_; ++g) {
        for (Id b : m().block_ids(id, g)) {
          holders[b] += b != 0 ? 1 : 0;
          if (b != 0 && coarse(g)) held_to[b].emplace_back(id, m().num_tokens(id));
        }
      }
    }
    for (std::size_t b = 1; b < nb_; ++b) {
      hashed_before[b] = m().allocator().is_hashed(static_cast<Id>(b));
      const std::size_t g = G_ == 1 ? 0 : m().group_of(static_cast<Id>(b));
      if (!hashed_before[b] || !coarse(g)) continue;
      const auto key = m().prefix_index(g).hash_of(static_cast<Id>(b));
      const auto it = key ? known_.find(*key) : known_.end();
      key_end[b] = it != known_.end() ? it->second.tokens.size() : ~std::size_t{0};
    }
    std::size_t queued_out = 0, queued_in = 0;
    for (const auto& t : m().transfers().queued()) ++(pagedkv::is_device_to_host(t.kind) ? queued_out : queued_in);
    const std::size_t pad = (shape >> 1) & 3;
    std::vector<GroupBuf> bufs(G_);
    std::vector<pagedkv::BatchMetadataBuffers> views(G_);
    constexpr std::int32_t kS = 0x7A7A7A7A;
    for (std::size_t g = 0; g < G_; ++g) {
      GroupBuf& gb = bufs[g];
      gb.indptr.assign(B + 1 + pad, kS);
      gb.indices.assign(total_blocks[g] + pad, kS);
      gb.last_page_len.assign(B + pad, kS);
      gb.row = static_cast<std::int32_t>(max_row[g] + (pad & 1));
      if (!(shape & 8)) gb.block_tables.assign((B + pad) * static_cast<std::size_t>(gb.row), kS);
      gb.seq_lens.assign(B + pad, kS);
      gb.qo_indptr.assign(B + 1 + pad, kS);
      gb.slot_mapping.assign(total_tokens + pad, kS);
      gb.copies.assign(2 * (m().pending_copies().size() + pad), kS);
      if (g == 0 && m().host_tier() != nullptr) {
        gb.swap_out.assign(2 * (queued_out + nb_ + pad), kS);
        gb.swap_in.assign(2 * (queued_in + pad) + 2, kS);
      }
      views[g] = {gb.indptr, gb.indices, gb.last_page_len, gb.block_tables, gb.row, gb.seq_lens, gb.qo_indptr,
                  gb.slot_mapping, gb.copies, gb.swap_out, gb.swap_in, {}, {}, {}, {}, {}};
    }
    const Snapshot before = snapshot();
    std::vector<pagedkv::BatchMetadataSizes> sz;
    attempt(before, true, [&] { sz = m().build_batch_metadata(batch, views, qlens); });
    expect(sz.size() == G_, "build returned " + S(sz.size()) + " sizes for " + S(G_) + " groups");
    log_.result("swap_out " + S(sz[0].num_swap_out) + ", swap_in " + S(sz[0].num_swap_in) + ", token " +
                S(sz[0].transfer_token));

    // The transfers of this build: every one queued before, plus write-through offloads, under its token.
    const std::uint64_t token = sz[0].transfer_token;
    expect(m().transfers().queued().empty(), "transfers still queued after a build");
    std::size_t n_out = 0, n_in = 0;
    for (const auto& t : m().transfers().in_flight()) {
      if (token == 0 || t.token != token) continue;
      ++(pagedkv::is_device_to_host(t.kind) ? n_out : n_in);
    }
    expect(n_out == sz[0].num_swap_out && n_in == sz[0].num_swap_in && n_in == queued_in && n_out >= queued_out,
           "swap lists: " + S(sz[0].num_swap_out) + " out / " + S(sz[0].num_swap_in) + " in written, " + S(n_out) +
               " / " + S(n_in) + " in flight under the token, " + S(queued_out) + " / " + S(queued_in) + " queued before");
    expect((token != 0) == (n_out + n_in > 0), "a transfer token without transfers, or transfers without a token");
    if (token != 0) {
      expect(std::find(tokens_.begin(), tokens_.end(), token) == tokens_.end(), "a transfer token handed out twice");
      tokens_.push_back(token);
    }
    for (std::size_t g = 0; g < G_; ++g) {
      expect(sz[g].batch_size == B && sz[g].transfer_token == token, "sizes of group " + S(g));
      expect(sz[g].num_indices == total_blocks[g] && sz[g].num_new_tokens == total_tokens,
             "num_indices / num_new_tokens of group " + S(g));
    }

    // The step on the shadow pools: swap_out, swap_in, copy_blocks (every read before any write), write_kv.
    if (m().host_tier() != nullptr) {
      const GroupBuf& g0 = bufs[0];
      for (std::size_t i = 0; i < sz[0].num_swap_out; ++i) {
        const auto d = static_cast<std::size_t>(g0.swap_out[2 * i]), h = static_cast<std::size_t>(g0.swap_out[2 * i + 1]);
        expect(d > 0 && d < nb_ && h > 0 && h < nh_, "a swap_out pair out of range");
        std::copy_n(kv_.begin() + static_cast<std::ptrdiff_t>(d * stride_), bs_, hkv_.begin() + static_cast<std::ptrdiff_t>(h * bs_));
      }
      for (std::size_t i = 0; i < sz[0].num_swap_in; ++i) {
        const auto h = static_cast<std::size_t>(g0.swap_in[2 * i]), d = static_cast<std::size_t>(g0.swap_in[2 * i + 1]);
        expect(d > 0 && d < nb_ && h > 0 && h < nh_, "a swap_in pair out of range");
        std::copy_n(hkv_.begin() + static_cast<std::ptrdiff_t>(h * bs_), bs_, kv_.begin() + static_cast<std::ptrdiff_t>(d * stride_));
      }
      for (std::size_t i = 2 * sz[0].num_swap_out; i < g0.swap_out.size(); ++i) expect(g0.swap_out[i] == -1, "swap_out padding");
      for (std::size_t i = 2 * sz[0].num_swap_in; i < g0.swap_in.size(); ++i) expect(g0.swap_in[i] == -1, "swap_in padding");
    }
    std::vector<std::pair<std::size_t, std::vector<std::uint64_t>>> reads;
    std::set<std::size_t> srcs, dsts;
    for (std::size_t g = 0; g < G_; ++g) {
      const GroupBuf& gb = bufs[g];
      for (std::size_t c = 0; c < sz[g].num_copies; ++c) {
        const auto s = static_cast<std::size_t>(gb.copies[2 * c]), d = static_cast<std::size_t>(gb.copies[2 * c + 1]);
        expect(s > 0 && s < nb_ && d > 0 && d < nb_ && s != d, "a copy pair out of range");
        expect(G_ == 1 || (m().group_of(static_cast<Id>(d)) == g && m().group_of(static_cast<Id>(s)) == g),
               "copy " + S(s) + "->" + S(d) + " in group " + S(g) + "'s list is not that group's");
        srcs.insert(s);
        expect(dsts.insert(d).second, "two copies into block " + S(d));
        reads.emplace_back(d, std::vector<std::uint64_t>(kv_.begin() + static_cast<std::ptrdiff_t>(s * stride_),
                                                         kv_.begin() + static_cast<std::ptrdiff_t>((s + 1) * stride_)));
      }
      for (std::size_t i = 2 * sz[g].num_copies; i < gb.copies.size(); ++i) expect(gb.copies[i] == -1, "copies padding");
    }
    for (std::size_t d : dsts) expect(!srcs.contains(d), "block " + S(d) + " is both a copy source and destination");
    for (auto& [d, v] : reads) std::copy(v.begin(), v.end(), kv_.begin() + static_cast<std::ptrdiff_t>(d * stride_));

    std::set<std::size_t> written;  // shadow slots (slot numbers repeat across groups of other page sizes)
    for (std::size_t b = 0; b < B; ++b) {
      const SeqId id = batch[b];
      const MSeq& ms = seqs_.at(id);
      const auto ch = chain(ms);
      const std::size_t seq_len = first[b] + qlen[b];
      expect(m().num_built(id) == seq_len, "num_built after the build of " + S(id));
      for (std::size_t g = 0; g < G_; ++g) {
        const GroupBuf& gb = bufs[g];
        const std::size_t rows = pages_for(g, seq_len), pg = page_[g];
        const std::string who = "build row " + S(b) + " (sequence " + S(id) + ") group " + S(g);
        const auto tab = m().block_ids(id, g);
        expect(gb.seq_lens[b] == static_cast<std::int32_t>(seq_len), who + ": seq_lens");
        expect(gb.indptr[b + 1] - gb.indptr[b] == static_cast<std::int32_t>(rows), who + ": indptr");
        expect(gb.qo_indptr[b + 1] - gb.qo_indptr[b] == static_cast<std::int32_t>(qlen[b]), who + ": qo_indptr");
        expect(gb.last_page_len[b] == static_cast<std::int32_t>(seq_len - (rows - 1) * pg), who + ": last_page_len");
        const std::int32_t* row = gb.indices.data() + gb.indptr[b];
        for (std::size_t i = 0; i < rows; ++i) {
          if (!gb.block_tables.empty()) {
            expect(gb.block_tables[b * static_cast<std::size_t>(gb.row) + i] == row[i], who + ": block_tables differs from indices");
          }
          expect(row[i] >= 0 && static_cast<std::size_t>(row[i]) < nb_, who + ": page table entry out of range");
          if (tab[i] != 0) {
            expect(static_cast<Id>(row[i]) == tab[i], who + ": page table entry " + S(i) + " = " + S(row[i]) +
                                                          ", the table holds " + S(tab[i]));
          }
          if (row[i] != 0) {
            expect(G_ == 1 || m().group_of(static_cast<Id>(row[i])) == g, who + ": page table entry of another group");
          }
        }
        if (!gb.block_tables.empty()) {
          for (std::size_t i = rows; i < static_cast<std::size_t>(gb.row); ++i) {
            expect(gb.block_tables[b * static_cast<std::size_t>(gb.row) + i] == 0, who + ": block_tables padding");
          }
        }
        // The slot mapping: own row block, right offset, or -1; write the fingerprints.
        for (std::size_t k = 0; k < qlen[b]; ++k) {
          const std::size_t p = first[b] + k;
          const std::int64_t sl = gb.slot_mapping[static_cast<std::size_t>(gb.qo_indptr[b]) + k];
          if (sl == -1) continue;
          const auto blk = static_cast<std::size_t>(sl) / pg;
          expect(blk == static_cast<std::size_t>(row[p / pg]) && static_cast<std::size_t>(sl) % pg == p % pg && blk != 0,
                 who + ": slot " + S(static_cast<std::uint64_t>(sl)) + " of position " + S(p) + " is not in its page-table block " +
                     S(row[p / pg]));
          // A coarse page registered before the build may be appended to after the content its key names.
          const bool under_key = hashed_before[blk] && (!coarse(g) || p < key_end[blk]);
          bool shared = holders[blk] != 1;
          if (shared && coarse(g)) {  // only tables ending at or before p besides the writer
            shared = false;
            for (const auto& [other, end] : held_to[blk]) shared = shared || (other != id && end > p);
          }
          expect(!shared && !under_key,
                 who + ": writes position " + S(p) + " into block " + S(blk) + " held by " + S(holders[blk]) +
                     " tables" +
                     (under_key ? ", registered before the build" +
                                      (coarse(g) ? " under a key naming " + S(key_end[blk]) + " tokens" : std::string())
                                : std::string()));
          expect(written.insert(kv_at(g, blk, p)).second,
                 "two tokens of one build write slot " + S(static_cast<std::uint64_t>(sl)) + " of group " + S(g));
          kv_[kv_at(g, blk, p)] = fp(ch, p, g);
        }
      }
    }
    for (std::size_t g = 0; g < G_; ++g) {
      const GroupBuf& gb = bufs[g];
      for (std::size_t i = total_tokens; i < gb.slot_mapping.size(); ++i) expect(gb.slot_mapping[i] == -1, "slot_mapping padding");
      for (std::size_t i = B + 1; i < gb.indptr.size(); ++i) {
        expect(gb.indptr[i] == static_cast<std::int32_t>(total_blocks[g]) &&
                   gb.qo_indptr[i] == static_cast<std::int32_t>(total_tokens),
               "indptr / qo_indptr padding");
      }
    }
    // The release rule: a windowed group of a sequence of the batch holds no block wholly before the window of its
    // committed built positions (built lookahead positions may still be rejected).
    for (SeqId id : batch) {
      const std::size_t committed = std::min(m().num_built(id), seqs_.at(id).tokens.size());
      for (std::size_t g = 0; g < G_; ++g) {
        const std::size_t lo = pagedkv::detail::first_kept_block(windows_[g], committed, bs_);
        const std::size_t n = m().block_ids(id, g).size(), nulls = m().num_null_blocks(id, g);
        expect(nulls >= std::min(lo, n), "sequence " + S(id) + " group " + S(g) + " holds a block wholly before " +
                                             "first_kept_block(" + S(committed) + ") = " + S(lo) + " after a build (" +
                                             S(nulls) + " null)");
      }
    }
    // What the step's queries see, through the page table just written: their own fingerprints.
    for (std::size_t b = 0; b < B; ++b) {
      const SeqId id = batch[b];
      const auto ch = chain(seqs_.at(id));
      const std::size_t seq_len = first[b] + qlen[b];
      for (std::size_t g = 0; g < G_; ++g) {
        const GroupBuf& gb = bufs[g];
        const std::int32_t* row = gb.indices.data() + gb.indptr[b];
        const auto lo = static_cast<std::size_t>(windows_[g].first_visible(static_cast<std::int64_t>(first[b])));
        for (std::size_t p = lo; p < seq_len; ++p) {
          const auto blk = static_cast<std::size_t>(row[p / page_[g]]);
          expect(blk != 0, "build row " + S(b) + " (sequence " + S(id) + ") group " + S(g) + ": position " + S(p) +
                               " is visible to the step's queries but its page is the null block");
          const std::uint64_t got = kv_[kv_at(g, blk, p)];
          expect(got == fp(ch, p, g), "build row " + S(b) + " (sequence " + S(id) + ") group " + S(g) + ": position " +
                                          S(p) + " reads block " + S(blk) + (got == kPoison ? ", never written" : ", another prefix's K/V"));
        }
      }
    }
  }

  // ---- drain --------------------------------------------------------------------------------------------------------
  /// Free every sequence (live and swapped), build an empty batch (issuing what is queued), complete every transfer
  /// in an order the input picks: nothing may stay held in either tier.
  void drain(ByteReader& r) {
    std::vector<SeqId> ids;
    for (const auto& [id, s] : seqs_) ids.push_back(id);
    for (SeqId id : ids) {
      log_.add("m.free(" + S(id) + ")");
      m().free(id);
      seqs_.erase(id);
    }
    build({}, {}, 0);
    const std::uint8_t order = r.u8();
    while (!tokens_.empty()) {
      complete(tokens_[order % tokens_.size()], true);
      check_all("drain");
    }
    check_all("drain");
    const pagedkv::CacheStats s = m().stats();
    expect(s.blocks_used == 0 && s.blocks_free + s.blocks_cached == nb_ - 1 && m().pending_copies().empty() &&
               m().num_sequences() == 0 && m().num_swapped() == 0 && s.transfers_in_flight == 0 && s.transfers_queued == 0,
           "after freeing everything and completing every transfer: " + S(s.blocks_used) + " device blocks used, " +
               S(s.transfers_in_flight) + " transfers in flight");
    for (std::size_t g = 0; g < G_; ++g) expect(m().held_blocks(g) == 0, "group " + S(g) + " still holds blocks");
    if (const auto* h = m().host_tier()) {
      expect(h->allocator().num_used_blocks() == 0, "host blocks still held after the drain: " + S(h->allocator().num_used_blocks()));
    }
  }

  // ---- invariants ---------------------------------------------------------------------------------------------------
  void check_all(const char* after) {
    const std::string ctx = std::string(" (after ") + after + ")";
    const auto& a = m().allocator();
    // Live / swapped sets.
    std::size_t n_live = 0, n_swapped = 0;
    for (const auto& [id, s] : seqs_) {
      if (s.swapped) {
        ++n_swapped;
        expect(m().is_swapped(id) && !m().contains(id), "sequence " + S(id) + " should be swapped" + ctx);
      } else {
        ++n_live;
        expect(m().contains(id) && !m().is_swapped(id), "sequence " + S(id) + " should be live" + ctx);
      }
    }
    expect(m().num_sequences() == n_live && m().num_swapped() == n_swapped, "sequence counts" + ctx);

    // Refcounts: tables + copy sources + host -> device fill pins.
    std::vector<std::uint32_t> ref(nb_, 0), href(nh_, 0);
    std::vector<std::size_t> fill_src(nb_, 0);  // queued fill into device block b: host block + 1
    for (const auto& [id, s] : seqs_) {
      if (s.swapped) {
        for (Id hb : m().swapped_host_blocks(id)) {
          if (hb != 0) ++href[hb];
        }
        continue;
      }
      for (std::size_t g = 0; g < G_; ++g) {
        for (Id b : m().block_ids(id, g)) ref[b] += b != 0 ? 1 : 0;
      }
    }
    ref[0] = 0;
    for (const auto& c : m().pending_copies()) ++ref[c.src];
    auto count_transfer = [&](const pagedkv::Transfer<Id>& t, bool queued) {
      expect(t.device > 0 && t.device < nb_ && t.host > 0 && t.host < nh_, "a transfer out of range" + ctx);
      ++href[t.host];
      if (!pagedkv::is_device_to_host(t.kind)) {
        ++ref[t.device];
        if (queued) fill_src[t.device] = t.host + 1;
      }
    };
    for (const auto& t : m().transfers().queued()) count_transfer(t, true);
    for (const auto& t : m().transfers().in_flight()) count_transfer(t, false);
    std::vector<std::size_t> held(G_, 0);
    std::size_t used = 0;
    for (std::size_t b = 1; b < nb_; ++b) {
      const Id bid = static_cast<Id>(b);
      const std::uint32_t rc = a.refcount(bid);
      expect(rc == ref[b], "block " + S(b) + " has refcount " + S(rc) + ", tables + copy sources + fill pins = " + S(ref[b]) + ctx);
      if (rc > 0) ++held[m().group_of(bid)], ++used;
    }
    for (std::size_t g = 0; g < G_; ++g) {
      expect(m().held_blocks(g) == held[g], "held_blocks(" + S(g) + ") = " + S(m().held_blocks(g)) + ", counted " + S(held[g]) + ctx);
    }
    expect(m().stats().blocks_used == used, "blocks_used" + ctx);
    if (const auto* h = m().host_tier()) {
      for (std::size_t b = 1; b < nh_; ++b) {
        const Id hb = static_cast<Id>(b);
        expect(h->allocator().refcount(hb) == href[b], "host block " + S(b) + " has refcount " +
                                                           S(h->allocator().refcount(hb)) + ", swapped tables + transfers = " +
                                                           S(href[b]) + ctx);
        const auto hh = h->index().hash_of(hb);
        expect(hh.has_value() == h->allocator().is_hashed(hb), "host block " + S(b) + ": hashed <=> registered" + ctx);
        if (hh) expect(h->index().find(*hh) == std::optional<Id>(hb), "host block " + S(b) + " not found under its hash" + ctx);
      }
    }
    // Prefix indexes: registered in exactly the block's group, hashed, found under the hash.
    std::size_t hashed = 0, registered = 0;
    for (std::size_t g = 0; g < G_; ++g) registered += m().prefix_index(g).size();
    for (std::size_t b = 1; b < nb_; ++b) {
      const Id bid = static_cast<Id>(b);
      std::size_t in = 0;
      for (std::size_t g = 0; g < G_; ++g) {
        const auto hh = m().prefix_index(g).hash_of(bid);
        if (!hh) continue;
        ++in;
        expect(m().group_of(bid) == g, "block " + S(b) + " is registered in group " + S(g) + " but belongs to group " +
                                           S(m().group_of(bid)) + ctx);
        expect(m().prefix_index(g).find(*hh) == std::optional<Id>(bid), "block " + S(b) + " not found under its hash" + ctx);
      }
      expect(in <= 1, "block " + S(b) + " registered in " + S(in) + " groups" + ctx);
      expect((in == 1) == a.is_hashed(bid), "block " + S(b) + ": hashed <=> registered" + ctx);
      hashed += a.is_hashed(bid) ? 1 : 0;
    }
    expect(hashed == registered, "index sizes against hashed blocks" + ctx);
    {
      std::set<std::uint64_t> cached;
      for (std::size_t b = 1; b < nb_; ++b) {
        if (a.is_cached(static_cast<Id>(b))) cached.insert(b);
      }
      const auto order = a.eviction_policy().order();
      expect(order.size() == cached.size() && std::all_of(order.begin(), order.end(), [&](Id b) { return cached.contains(b); }),
             "the eviction order is not the set of cached blocks" + ctx);
    }
    // Pending copies.
    std::set<std::uint64_t> csrc, cdst;
    for (const auto& c : m().pending_copies()) {
      expect(c.src != c.dst && c.src != 0 && c.dst != 0 && c.group < G_, "a pending copy" + ctx);
      expect(G_ == 1 || (m().group_of(c.src) == c.group && m().group_of(c.dst) == c.group), "a pending copy across groups" + ctx);
      expect(cdst.insert(c.dst).second, "two pending copies into one block" + ctx);
      csrc.insert(c.src);
    }
    for (auto d : cdst) expect(!csrc.contains(d), "block " + S(d) + " is both a pending copy's source and destination" + ctx);
    std::map<std::uint64_t, std::uint64_t> copy_of;
    for (const auto& c : m().pending_copies()) copy_of[c.dst] = c.src;
    // In-flight tokens.
    for (const auto& t : m().transfers().in_flight()) {
      expect(std::find(tokens_.begin(), tokens_.end(), t.token) != tokens_.end(), "a transfer in flight under a token never handed out" + ctx);
    }

    // Per sequence: tables, nulls, window rule, registered hashes, content.
    for (const auto& [id, s] : seqs_) {
      const auto ch = chain(s);
      if (s.swapped) {  // the host copies hold every position (a queued swap_out still reads the device block)
        const auto hbs = m().swapped_host_blocks(id);
        const std::size_t nbk = hbs.size() / G_;
        expect(hbs.size() == G_ * blocks_for(s.tokens.size()) && s.drafts.empty(), "swapped sequence " + S(id) + "'s host blocks" + ctx);
        std::map<std::uint64_t, std::uint64_t> out_src;
        for (const auto& t : m().transfers().queued()) {
          if (pagedkv::is_device_to_host(t.kind)) out_src[t.host] = t.device;
        }
        for (std::size_t g = 0; g < G_; ++g) {
          for (std::size_t i = 0; i < nbk; ++i) {
            const Id hb = hbs[g * nbk + i];
            if (hb == 0) continue;
            for (std::size_t p = i * bs_; p < std::min(s.tokens.size(), (i + 1) * bs_); ++p) {
              const auto it = out_src.find(hb);
              const std::uint64_t got = it != out_src.end() ? kv_[it->second * stride_ + p % bs_] : hkv_[hb * bs_ + p % bs_];
              expect(got == fp(ch, p, g), "swapped sequence " + S(id) + " group " + S(g) + " position " + S(p) +
                                              " in host block " + S(hb) + (got == kPoison ? ": never written" : ": another prefix's K/V") + ctx);
            }
          }
        }
        continue;
      }
      const auto& st = m().sequence(id);
      const std::size_t built = m().num_built(id), slotted = m().num_tokens(id);
      const auto toks = m().token_ids(id);
      expect(std::equal(toks.begin(), toks.end(), s.tokens.begin(), s.tokens.end()), "sequence " + S(id) + "'s token ids" + ctx);
      expect(st.num_lookahead == s.drafts.size(), "sequence " + S(id) + "'s lookahead" + ctx);
      expect(built <= slotted && slotted <= s.tokens.size() + s.drafts.size(), "sequence " + S(id) + "'s cursors" + ctx);
      expect(s.drafts.empty() || slotted == s.tokens.size() + s.drafts.size(), "lookahead without every token slotted" + ctx);
      const auto ref_h = caching_ ? ref_hashes(s) : std::vector<BlockHash>{};
      learn(s, ref_h);
      for (std::size_t g = 0; g < G_; ++g) {
        const auto tab = m().block_ids(id, g);
        const std::size_t nulls = m().num_null_blocks(id, g), pg = page_[g];
        const std::string who = "sequence " + S(id) + " group " + S(g);
        expect(tab.size() == pages_for(g, slotted), who + ": " + S(tab.size()) + " blocks for " + S(slotted) + " slots" + ctx);
        expect(windows_[g].enabled() || nulls == 0, who + ": a full-attention group with null blocks" + ctx);
        for (std::size_t i = 0; i < tab.size(); ++i) {
          expect((tab[i] == 0) == (i < nulls), who + ": block " + S(i) + " is " + S(tab[i]) + " with " + S(nulls) +
                                                   " leading null blocks" + ctx);
          if (tab[i] != 0) expect(G_ == 1 || m().group_of(tab[i]) == g, who + ": holds block " + S(tab[i]) + " of group " + S(m().group_of(tab[i])) + ctx);
        }
        // Every block the next query (at num_built) sees is held (the release rule's other side is checked after
        // each build).
        const std::size_t lo = pagedkv::detail::first_kept_block(windows_[g], built, bs_);
        expect(nulls <= lo,
               who + ": " + S(nulls) + " null blocks, but the next query (position " + S(built) + ") needs block " + S(lo) +
                   " on" + ctx);
        for (std::size_t i = 0; i < tab.size(); ++i) {
          if (tab[i] == 0) continue;
          const auto hh = m().prefix_index(g).hash_of(tab[i]);
          if (hh && coarse(g)) {
            // Keyed by a match block inside the page (this chain's, or the longer chain of a sequence it shares the
            // page with), naming the ids (and adapter) of every position this table slots under the key.
            const auto it = known_.find(*hh);
            expect(it != known_.end(), who + ": page " + S(i) + " (" + S(tab[i]) + ") is registered under a hash no sequence had" + ctx);
            const MSeq& k = it->second;
            expect((k.tokens.size() - 1) / pg == i, who + ": page " + S(i) + " (" + S(tab[i]) + ") is keyed by the " +
                                                        S(k.tokens.size()) + "-token prefix, outside the page" + ctx);
            const std::size_t n = std::min(k.tokens.size(), slotted);
            std::size_t p = i * pg;
            const MSeq& ms = s;  // (a structured binding: not capturable by clang 14)
            const auto id_at = [&ms](std::size_t q) {
              return q < ms.tokens.size() ? ms.tokens[q] : ms.drafts[q - ms.tokens.size()];
            };
            while (p < n && k.tokens[p] == id_at(p)) ++p;
            const bool same_adapter = (k.keys ? k.keys->adapter_id : 0) == (s.keys ? s.keys->adapter_id : 0);
            expect(p == n && (n <= i * pg || same_adapter),
                   who + ": page " + S(i) + " (" + S(tab[i]) + ") is keyed by the " + S(k.tokens.size()) +
                       "-token prefix, but the table slots position " + S(p) + " (of " + S(slotted) +
                       ") with other ids: its writes change registered content" + ctx);
          } else if (hh && i < ref_h.size()) {
            expect(*hh == ref_h[i], who + ": block " + S(i) + " (" + S(tab[i]) + ") is registered under another chain's hash" + ctx);
          }
          // Content of the built positions of the block (through a pending copy into it, or a queued fill).
          std::uint64_t src = tab[i];
          if (const auto c = copy_of.find(src); c != copy_of.end()) src = c->second;
          for (std::size_t p = i * pg; p < std::min(built, (i + 1) * pg); ++p) {
            const std::uint64_t got = fill_src[src] != 0 ? hkv_[(fill_src[src] - 1) * bs_ + p % bs_] : kv_[kv_at(g, src, p)];
            expect(got == fp(ch, p, g), who + ": built position " + S(p) + " in block " + S(tab[i]) +
                                            (src != tab[i] ? " (via copy from " + S(src) + ")" : "") +
                                            (got == kPoison ? " was never written" : " holds another prefix's K/V") + ctx);
          }
        }
      }
    }
    // Every registered device block holds the prefix its hash names: a block of the match unit its last bs
    // positions, a coarse page the positions from its start to the prefix's end (through a queued fill).
    for (std::size_t b = 1; b < nb_; ++b) {
      const Id bid = static_cast<Id>(b);
      const std::size_t g = G_ == 1 ? 0 : m().group_of(bid);
      const auto hh = m().prefix_index(g).hash_of(bid);
      if (!hh) continue;
      const auto it = known_.find(*hh);
      expect(it != known_.end(), "block " + S(b) + " (group " + S(g) + ") is registered under a hash no sequence had" + ctx);
      const auto ch = chain(it->second);
      const std::size_t end = it->second.tokens.size(), start = (end - 1) / page_[g] * page_[g];
      for (std::size_t p = start; p < end; ++p) {
        const std::uint64_t got = fill_src[b] != 0 ? hkv_[(fill_src[b] - 1) * bs_ + p % bs_] : kv_[kv_at(g, b, p)];
        expect(got == fp(ch, p, g), "registered block " + S(b) + " (group " + S(g) + ", " + S(end) + "-token prefix) " +
                                        "position " + S(p) + (got == kPoison ? " was never written" : " holds another prefix's K/V") + ctx);
      }
    }
  }

  std::unique_ptr<Mgr> m_;
  CallLog& log_;
  std::uint32_t bs_;
  std::size_t nb_, nh_, G_;
  bool caching_;
  BlockHash root_;
  std::size_t stride_;                       // shadow slots per device block: the largest page of any group
  std::vector<AttentionWindow> windows_;
  std::vector<AttentionWindow> hit_windows_;  // the hit rule's (KVCacheGroupSpec::hit_window)
  std::vector<std::size_t> page_;            // [G] tokens per page (m.block_size(g))
  std::vector<std::uint64_t> kv_, hkv_;
  std::unordered_map<BlockHash, MSeq, pagedkv::BlockHashHasher> known_;  // hash -> the prefix it names
  std::map<SeqId, MSeq> seqs_;
  std::vector<std::uint64_t> tokens_;       // transfer tokens in flight
  std::vector<std::uint64_t> done_tokens_;  // completed ones
};

/// The configuration (see manager_groups_ops.hpp).
inline pagedkv::CacheConfig decode_config(ByteReader& r, std::uint8_t& kind) {
  pagedkv::CacheConfig c;
  const std::uint8_t f = r.u8();
  constexpr std::uint32_t kBs[4] = {1, 4, 16, 4};
  c.block_size = kBs[f & 3];
  c.enable_prefix_caching = (f & 4) == 0 || (f & 8) == 0;
  c.offload = static_cast<pagedkv::OffloadPolicy>(((f >> 4) & 3) % 3);
  c.enable_events = (f & 64) != 0;
  const bool host = (f & 128) == 0;
  c.num_blocks = 2 + r.u8() % 48;
  const std::uint8_t h = r.u8();
  c.num_host_blocks = host ? 2 + h % 40 : 0;
  kind = h >> 7;  // the eviction policy: 0 LRU, 1 SLRU (device and host)
  c.hash_seed = r.u8();
  const std::size_t groups = r.u8() % 5;  // 0 = the default one full group
  for (std::size_t g = 0; g < groups; ++g) {
    pagedkv::KVCacheGroupSpec s;
    const std::uint8_t k = r.u8(), w = r.u8();
    s.kind = static_cast<AttentionKind>(k % 3);
    if (s.kind != AttentionKind::kFull) {
      // Mostly small windows in tokens; >= 200: whole blocks (chunks ending on block boundaries).
      s.window_tokens = w < 200 ? 1 + w % (3 * c.block_size + 5) : c.block_size * (1 + (w - 200) % 4);
    }
    s.num_layers = 1 + (k >> 2) % 4;
    // A full group after group 0 without a host tier: a window byte >= 224 (full groups ignore it otherwise) gives
    // it coarse pages of 2 (even) or 4 (odd) match blocks.
    if (s.kind == AttentionKind::kFull && g > 0 && c.num_host_blocks == 0 && w >= 224) {
      s.block_size = c.block_size * ((w & 1) != 0 ? 4 : 2);
    }
    c.groups.push_back(s);
  }
  return c;
}

inline std::string config_text(const pagedkv::CacheConfig& c, std::uint8_t kind) {
  std::string t = "KVCacheManager<Xxh3Hasher, uint32, " + std::string(kind ? "SlruEviction" : "LruEviction") +
                  ">({num_blocks " + std::to_string(c.num_blocks) + ", block_size " + std::to_string(c.block_size) +
                  ", prefix caching " + std::to_string(c.enable_prefix_caching) + ", events " +
                  std::to_string(c.enable_events) + ", num_host_blocks " + std::to_string(c.num_host_blocks) +
                  ", offload " + std::to_string(static_cast<int>(c.offload)) + ", groups {";
  for (const auto& g : c.groups) {
    t += std::string(pagedkv::to_string(g.kind)) + " " + std::to_string(g.window_tokens) +
         (g.block_size != 0 ? " pages of " + std::to_string(g.block_size) : std::string()) + "; ";
  }
  return t + "}})";
}

}  // namespace groups_detail

using GroupsLruManager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t>;
using GroupsSlruManager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, pagedkv::SlruEviction<std::uint32_t>,
                                                  pagedkv::SlruEviction<std::uint32_t>>;

void run_manager_groups_input(std::span<const std::uint8_t> data) {
  static CallLog log;
  log.clear();
  ByteReader r(data);
  std::uint8_t kind = 0;
  const pagedkv::CacheConfig c = groups_detail::decode_config(r, kind);
  log.add(groups_detail::config_text(c, kind));
  if (kind == 0) {
    groups_detail::GroupsDriver<GroupsLruManager> d(c, log);
    d.run(r);
  } else {
    groups_detail::GroupsDriver<GroupsSlruManager> d(c, log);
    d.run(r);
  }
}

}  // namespace pagedkv_fuzz

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  pagedkv_fuzz::run_manager_groups_input({data, size});
  return 0;
}
