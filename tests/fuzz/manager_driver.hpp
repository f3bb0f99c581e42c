// tests/fuzz/manager_driver.hpp: the manager fuzzer's driver: decodes operations from the input (layout in
// manager_ops.hpp), predicts each call's outcome from the shadow model (manager_model.hpp), calls the manager, checks,
// and updates the model. Instantiated once per manager type, each in its own translation unit
// (fuzz_manager_*.cpp), so the heavily instrumented build compiles them in parallel.
//
// Adding an operation: a new Op enumerator in manager_ops.hpp, a case in Driver::step that decodes its arguments,
// predicts its outcome from the model (error codes, status, effects), calls the manager, checks, and updates the
// model. The model's check_all runs after every op.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include <pagedkv/eviction_priority.hpp>
#include <pagedkv/eviction_slru.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/retention.hpp>

#include "byte_reader.hpp"
#include "manager_model.hpp"
#include "manager_ops.hpp"

namespace pagedkv_fuzz {
namespace driver_detail {

inline constexpr std::size_t kMaxOps = 192;

inline SeqId seq_id(std::uint8_t b) {
  constexpr SeqId kOdd[4] = {std::numeric_limits<SeqId>::max(), SeqId{1} << 63, 0xFFFFFFFFULL, SeqId{1} << 32};
  b %= 16;
  return b < 12 ? SeqId{b} : kOdd[b - 12];
}

// Four fixed 200-token prompts: prompts are drawn as their prefixes, so prefix hits are frequent.
inline const std::vector<Toks>& bases() {
  static const std::vector<Toks> b = [] {
    std::vector<Toks> v(4, Toks(200));
    for (std::size_t i = 0; i < 4; ++i) {
      for (std::size_t j = 0; j < 200; ++j) v[i][j] = static_cast<TokenId>(mix64(i * 1000 + j) % 1000);
    }
    return v;
  }();
  return b;
}

// Mostly a 4-token alphabet (equal blocks, deduplication), sometimes extreme ids.
inline TokenId token_from_byte(std::uint8_t b) {
  if (b < 200) return static_cast<TokenId>(b % 4);
  switch (b) {
    case 250: return -1;
    case 251: return std::numeric_limits<TokenId>::min();
    case 252: return std::numeric_limits<TokenId>::max();
    case 253: return std::numeric_limits<TokenId>::max() - 1;
    case 254: return TokenId{1} << 30;
    case 255: return -2;
    default: return static_cast<TokenId>(b);
  }
}

// A multimodal item's content hash. It covers its length, so equal hashes mean equal lengths (as for a real
// image, whose embedding count follows from its pixels).
inline BlockHash item_hash(std::uint64_t id, std::uint64_t length) {
  BlockHash h;
  const std::uint64_t a = mix64(id * 0x9E37 + length), b = mix64(a ^ 0xABCDEF);
  for (int i = 0; i < 8; ++i) {
    h.bytes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(a >> (8 * i));
    h.bytes[static_cast<std::size_t>(i + 8)] = static_cast<std::uint8_t>(b >> (8 * i));
  }
  return h;
}

inline std::string opt_text(const std::optional<std::size_t>& v) { return v ? std::to_string(*v) : "nullopt"; }

inline std::string allowed_text(const std::set<Errc>& s) {
  std::string t;
  for (Errc c : s) t += (t.empty() ? "" : "|") + errc_text(c);
  return t.empty() ? "none" : t;
}

// =================================================================================================================
template <class Mgr>
class Driver {
 public:
  using Model = ManagerModel<Mgr>;
  using Id = typename Mgr::block_id_type;

  Driver(std::unique_ptr<Mgr> m, const pagedkv::CacheConfig& c, CallLog& log)
      : m_(std::move(m)), model_(c, m_->max_tokens_per_seq(), log), log_(log) {}

  void run(ByteReader& r) {
    for (std::size_t i = 0; i < kMaxOps && !r.empty(); ++i) {
      step(static_cast<Op>(r.u8() % static_cast<std::uint8_t>(Op::kCount)), r);
    }
    drain_all();
  }

 private:
  Mgr& m() { return *m_; }
  const Model& model() const { return model_; }
  [[noreturn]] void fail(const std::string& what) const { model_.fail(what); }
  void expect(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }

  void step(Op op, ByteReader& r) {
    switch (op) {
      case Op::kAdmit: op_admit(r, Admission::kPlain); break;
      case Op::kAppend: op_append(r); break;
      case Op::kFork: op_fork(r); break;
      case Op::kFree: op_free(r, false); break;
      case Op::kPreempt: op_free(r, true); break;
      case Op::kRewind: op_rewind(r); break;
      case Op::kLookup: op_lookup(r); break;
      case Op::kBuild: op_build(r, BuildKind::kAny); break;
      case Op::kStep: op_build(r, BuildKind::kStep); break;
      case Op::kReset: op_reset(); break;
      case Op::kQuery: op_query(r); break;
      case Op::kMove: op_move(); break;
      case Op::kDrainAll: drain_all(); break;
      case Op::kAdmitChunked: op_admit(r, Admission::kChunked); break;
      case Op::kAdmitPrepared: op_admit(r, Admission::kPrepared); break;
      case Op::kReserve: op_reserve(r); break;
      case Op::kReserveLookahead: op_reserve_lookahead(r); break;
      case Op::kCommitLookahead: op_commit_lookahead(r); break;
      case Op::kQueryAdmit: op_query_admit(r); break;
      case Op::kQueryAppend: op_query_append(r); break;
      case Op::kBuildScheduled: op_build(r, BuildKind::kScheduled); break;
      case Op::kTakeEventBatch: op_take_event_batch(); break;
      case Op::kTakePrefixStats: op_take_prefix_stats(); break;
      case Op::kExpireRetention: op_expire_retention(r); break;
      case Op::kExtAdmit: op_ext_admit(r); break;
      case Op::kExtComplete: op_ext_complete(r); break;
      case Op::kExtAbort: op_ext_abort(r); break;
      case Op::kExtLease: op_ext_lease(r, false); break;
      case Op::kExtPinSave: op_ext_lease(r, true); break;
      case Op::kExtSignal: op_ext_signal(r); break;
      case Op::kExtReap: op_ext_reap(r); break;
      case Op::kExtStale: op_ext_stale(r); break;
      case Op::kExtClaim: op_ext_claim(r); break;
      case Op::kEvictBlock: op_evict_block(r); break;
      case Op::kCount: break;
    }
  }

  // ---- calling with an expected set of error codes ------------------------------------------------------------
  /// Runs `f`. Returns true when it returned normally; when it threw pagedkv::Error, checks that the code is in
  /// `allowed`, that the message names `needle` (when given), and that nothing changed, then returns false.
  template <class F>
  bool call(const std::set<Errc>& allowed, const std::string& needle, F&& f) {
    // A snapshot only when an error is expected (an unexpected one is a finding whatever the state).
    std::optional<typename Model::Snapshot> before;
    if (!allowed.empty()) before.emplace(model_.snapshot(m()));
    try {
      f();
      return true;
    } catch (const pagedkv::Error& e) {
      log_.result(std::string("throws ") + errc_text(e.code()) + ": " + e.message());
      expect(allowed.contains(e.code()), std::string("unexpected error ") + errc_text(e.code()) + " (" + e.message() +
                                             "), allowed: " + allowed_text(allowed));
      expect(!e.message().empty(), "empty error message");
      if (!needle.empty() && allowed.size() == 1) {
        expect(e.message().find(needle) != std::string::npos,
               "error message \"" + e.message() + "\" does not name \"" + needle + "\"");
      }
      if (before) model_.expect_unchanged(m(), *before, "a call that threw " + std::string(errc_text(e.code())));
      return false;
    }
  }

  // ---- argument decoding ----------------------------------------------------------------------------------------
  const typename Model::MSeq* nth_live(std::uint8_t b, SeqId* id = nullptr) const {
    const auto& s = model_.seqs();
    if (s.empty()) return nullptr;
    auto it = s.begin();
    std::advance(it, b % s.size());
    if (id) *id = it->first;
    return &it->second;
  }

  /// A prompt: a prefix of a shared base (+ a few tokens), a live sequence's tokens (re-admission), raw tokens
  /// (extreme ids), or a long repeating prompt around the pool's capacity and the per-sequence limit.
  Toks decode_prompt(ByteReader& r) const {
    const std::uint8_t k = r.u8();
    Toks p;
    switch (k >> 6) {
      case 0: {
        const Toks& base = bases()[k & 3];
        p.assign(base.begin(), base.begin() + std::min<std::ptrdiff_t>(r.u8(), static_cast<std::ptrdiff_t>(base.size())));
        for (std::size_t i = 0, extra = (k >> 2) & 7; i < extra; ++i) p.push_back(token_from_byte(r.u8()));
        break;
      }
      case 1: {
        const auto* s = nth_live(r.u8());
        const std::size_t drop = r.u8() % 8;
        if (s != nullptr) p.assign(s->tokens.begin(), s->tokens.end() - static_cast<std::ptrdiff_t>(std::min(drop, s->tokens.size())));
        for (std::size_t i = 0, extra = (k >> 2) & 7; i < extra; ++i) p.push_back(token_from_byte(r.u8()));
        break;
      }
      case 2:
        for (std::size_t i = 0, n = k & 63; i < n; ++i) p.push_back(token_from_byte(r.u8()));
        break;
      default: {
        const std::size_t span = 4 * model_.usable() * model_.block_size() + 64;
        const std::size_t n = std::min<std::size_t>(r.u16() % span, 1U << 15);
        p.resize(n);
        for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<TokenId>((i * (k & 7)) % 5);
        break;
      }
    }
    return p;
  }

  /// Extra keys: none, a salt, an adapter, a valid image, or custom keys with any adapter, salt and items
  /// (empty, outside the prompt, unsorted, or wrapping past 2^64).
  std::shared_ptr<RequestKeys> decode_keys(ByteReader& r, std::size_t len) const {
    const std::uint8_t k = r.u8();
    auto keys = std::make_shared<RequestKeys>();
    switch (k % 8) {
      case 4: keys->salt = (k & 8) ? "tenant-A" : "tenant-B"; return keys;
      case 5: keys->adapter_id = 7; return keys;
      case 6: {
        if (len == 0) return keys;
        const std::uint64_t off = (k >> 3) % len;
        const std::uint64_t length = 1 + (len - off - 1) % 5;
        keys->multimodal.push_back({item_hash(k >> 6, length), off, length});
        return keys;
      }
      case 7: {
        keys->adapter_id = r.u8() % 3;
        for (std::size_t i = 0, n = r.u8() % 4; i < n; ++i) keys->salt.push_back(static_cast<char>('a' + r.u8() % 2));
        const std::size_t items = r.u8() % 4;
        for (std::size_t i = 0; i < items; ++i) {
          const std::uint64_t id = r.u8() % 3;
          const std::uint8_t o = r.u8(), l = r.u8();
          const std::uint64_t off = o < 240 ? o % (len + 3) : UINT64_MAX - (o - 240);
          const std::uint64_t length = l < 240 ? l % 24 : UINT64_MAX - (l - 240);
          keys->multimodal.push_back({item_hash(id, length), off, length});
        }
        if (items > 1 && (r.u8() & 1) == 0) {
          std::stable_sort(keys->multimodal.begin(), keys->multimodal.end(),
                           [](const MultimodalItem& a, const MultimodalItem& b) { return a.offset_tokens < b.offset_tokens; });
        }
        return keys;
      }
      default: return nullptr;
    }
  }

  std::optional<std::size_t> decode_cap(ByteReader& r, std::size_t len) const {
    const std::uint8_t c = r.u8();
    if (c < 192) return std::nullopt;
    if (c == 255) return std::numeric_limits<std::size_t>::max();
    return (c - 192) % (len + 2);
  }

  // ---- retention ------------------------------------------------------------------------------------------------
  static std::optional<std::chrono::nanoseconds> decode_duration(std::uint8_t d) {
    if (d == 0) return std::nullopt;
    if (d == 255) return std::chrono::nanoseconds(0);  // invalid
    return std::chrono::microseconds(d);
  }
  static std::uint8_t decode_priority(std::uint8_t p) { return p < 200 ? static_cast<std::uint8_t>(p % 101) : p; }

  /// AdmitOptions::retention (retention manager only): none, a system-prompt config, one range with a duration,
  /// or custom ranges (any priority, duration, begin, length; sorted or not).
  std::shared_ptr<const pagedkv::RetentionConfig> decode_retention(ByteReader& r, std::size_t len) const {
    const std::uint8_t k = r.u8();
    auto c = std::make_shared<pagedkv::RetentionConfig>();
    switch (k % 8) {
      case 0: case 1: case 2: return nullptr;
      case 3:
        c->ranges.push_back({0, std::nullopt, 80, std::nullopt});
        c->decode_priority = 10;
        return c;
      case 4:
        c->ranges.push_back({0, std::size_t{(k >> 3) % 40U + 1U}, 90, std::chrono::microseconds((k >> 3) + 1)});
        return c;
      default: {
        const bool sorted = (k & 8) == 0;
        std::size_t pos = 0;
        for (std::size_t i = 0, n = r.u8() % 4; i < n; ++i) {
          const std::uint8_t b = r.u8(), l = r.u8(), p = r.u8(), d = r.u8();
          pagedkv::TokenRangeRetention t;
          t.begin = sorted ? pos + b % 8 : b % (len + 2);
          if (l != 0xFF) t.end = t.begin + l % 24;
          t.priority = decode_priority(p);
          t.duration = decode_duration(d);
          pos = t.end.value_or(t.begin);
          c->ranges.push_back(t);
        }
        c->decode_priority = decode_priority(r.u8());
        c->decode_duration = decode_duration(r.u8());
        return c;
      }
    }
  }

  /// Whether `c` is a valid RetentionConfig (written from the header's contract, not from validate_retention).
  static bool retention_valid(const pagedkv::RetentionConfig& c) {
    auto dur_ok = [](const std::optional<std::chrono::nanoseconds>& d) { return !d || d->count() > 0; };
    if (c.decode_priority > pagedkv::kMaxRetentionPriority || !dur_ok(c.decode_duration)) return false;
    for (std::size_t i = 0; i < c.ranges.size(); ++i) {
      const auto& t = c.ranges[i];
      if (t.priority > pagedkv::kMaxRetentionPriority || !dur_ok(t.duration)) return false;
      if (t.end && *t.end <= t.begin) return false;
      if (i + 1 < c.ranges.size() && (!t.end || *t.end > c.ranges[i + 1].begin)) return false;
    }
    return true;
  }

  static std::string retention_text(const pagedkv::RetentionConfig* c) {
    if (c == nullptr) return "none";
    auto dur = [](const std::optional<std::chrono::nanoseconds>& d) {
      return d ? std::to_string(d->count()) + "ns" : std::string("-");
    };
    std::string t = "{";
    for (const auto& x : c->ranges) {
      t += "[" + std::to_string(x.begin) + "," + (x.end ? std::to_string(*x.end) : std::string("end")) + ") p" +
           std::to_string(x.priority) + " " + dur(x.duration) + "; ";
    }
    return t + "decode p" + std::to_string(c->decode_priority) + " " + dur(c->decode_duration) + "}";
  }

  /// The retention block `i` of model sequence `s` takes on release, from a per-range scan; `exact` is false when
  /// ranges of equal top priority but different durations tie (the expiry is then not checked).
  struct ExpectedRetention {
    std::uint8_t priority = pagedkv::kDefaultRetentionPriority;
    std::optional<std::chrono::nanoseconds> duration;
    bool exact = true;
  };
  ExpectedRetention expected_retention(const typename Model::MSeq& s, std::size_t i) const {
    ExpectedRetention e;
    if (!s.retention) return e;
    const std::size_t bs = model_.block_size(), begin = i * bs;
    if (begin >= s.prompt_len) return {s.retention->decode_priority, s.retention->decode_duration, true};
    const std::size_t end = std::min(begin + bs, s.prompt_len);
    int best = -1;
    for (const auto& t : s.retention->ranges) {
      const std::size_t t_end = t.end.value_or(s.prompt_len);
      if (!(t.begin < end && t_end > begin)) continue;
      if (t.priority > best) {
        best = t.priority, e.priority = t.priority, e.duration = t.duration, e.exact = true;
      } else if (t.priority == best && t.duration != e.duration) {
        e.exact = false;
      }
    }
    return e;
  }

  /// After `id`'s blocks [first, end) of `blocks` were released (free, preempt, rewind): every one still hashed has
  /// the priority (and expiry) the sequence's retention config assigns to its position.
  void check_released_retention(const typename Model::MSeq& s, const Blocks& blocks, std::size_t first) {
    if constexpr (Model::kHasRetention) {
      const auto& pol = m().allocator().eviction_policy();
      const auto now = m().retention_now();
      for (std::size_t i = first; i < blocks.size(); ++i) {
        const Id b = static_cast<Id>(blocks[i]);
        if (!m().allocator().is_hashed(b)) continue;
        const ExpectedRetention e = expected_retention(s, i);
        const std::string what = "block " + std::to_string(blocks[i]) + " (logical " + std::to_string(i) + ")";
        expect(pol.priority(b) == e.priority, what + " has retention priority " + std::to_string(pol.priority(b)) +
                                                  " after its release, expected " + std::to_string(e.priority));
        if (!e.exact) continue;
        std::optional<pagedkv::RetentionTimePoint> want;
        if (e.priority != pagedkv::kDefaultRetentionPriority && e.duration) want = now + *e.duration;
        expect(pol.expires_at(b) == want, what + ": retention expiry after its release");
      }
    } else {
      (void)s, (void)blocks, (void)first;
    }
  }

  /// Release checks: LruEviction's exact order (tail first, through pending copies); for other policies the set of
  /// cached blocks the model predicts, and the priorities the released blocks took.
  void check_after_release(const Blocks& want_lru, const std::string& what) {
    const auto lru = m().allocator().eviction_policy().order();
    Blocks got(lru.begin(), lru.end());
    if constexpr (Model::kExactLru) {
      expect(got == want_lru, "LRU order after " + what + " (tail first, through pending copies)");
    } else {
      Blocks want = want_lru;
      std::sort(got.begin(), got.end());
      std::sort(want.begin(), want.end());
      expect(got == want, "the set of cached blocks after " + what);
      for (const auto b : want) expect(m().allocator().is_cached(static_cast<Id>(b)), "is_cached after " + what);
      expect(m().allocator().num_cached_blocks() == want.size(), "num_cached_blocks after " + what);
    }
  }

  /// expire_retention(now) on the simulated clock: forward by b^2 us, or back (which must change nothing).
  void op_expire_retention(ByteReader& r) {
    const std::uint8_t b = r.u8();
    if (b < 224) {
      clock_ += std::chrono::microseconds(static_cast<std::int64_t>(b) * b);
    } else {
      clock_ -= std::chrono::microseconds(b - 223);
    }
    const pagedkv::RetentionTimePoint now(clock_);
    log_.add("m.expire_retention(" + std::to_string(clock_.count()) + "ns)");
    const auto before = model_.snapshot(m());
    const auto old_now = m().retention_now();
    const auto eff = std::max(old_now, now);
    std::size_t want = 0;
    if constexpr (Model::kHasRetention) {
      const auto& pol = m().allocator().eviction_policy();
      for (const auto blk : pol.order()) {
        const auto at = pol.expires_at(blk);
        if (at && *at <= eff) ++want;
      }
    }
    const std::size_t n = m().expire_retention(now);
    log_.result(std::to_string(n) + " expired");
    expect(m().retention_now() == eff, "retention_now() after expire_retention");
    expect(n == want, "expire_retention moved " + std::to_string(n) + " blocks, expected " + std::to_string(want));
    // Every priority whose expiry is at or before the clock falls back to the default (held blocks too: when next
    // cached); nothing else changes, and the cached blocks stay the same set (in the same order if none moved).
    auto want_snap = before;
    want_snap.retention_now = eff.time_since_epoch().count();
    for (auto& [prio, at] : want_snap.retention) {
      if (at && *at <= want_snap.retention_now) prio = pagedkv::kDefaultRetentionPriority, at.reset();
    }
    auto after = model_.snapshot(m());
    if (n != 0) {
      auto set_of = [](Blocks v) { std::sort(v.begin(), v.end()); return v; };
      expect(set_of(after.lru) == set_of(before.lru), "expire_retention changed the set of cached blocks");
      after.lru = want_snap.lru;
    }
    expect(after == want_snap, "expire_retention changed more than the expired priorities (or the clock)");
    model_.check_all(m());
  }

  // ---- admission ------------------------------------------------------------------------------------------------
  /// What an admission of `prompt` would do now, as the model predicts it (valid input only).
  struct AdmitPrediction {
    typename Model::MSeq seq;           // the model sequence it would create (cursors set)
    std::vector<std::uint64_t> hits;    // hit blocks
    pagedkv::CapacityStatus status = pagedkv::CapacityStatus::kFits;
    std::size_t num_blocks = 0;         // blocks taken (kNeverFits: the prompt's blocks)
    std::size_t missing = 0;
  };

  AdmitPrediction predict_admit(std::span<const TokenId> prompt, const std::shared_ptr<RequestKeys>& keys,
                                std::optional<std::size_t> cap, std::optional<std::size_t> reserve) {
    const std::size_t bs = model_.block_size();
    AdmitPrediction p;
    const std::size_t total = model_.blocks_for(prompt.size());
    if (total > model_.usable()) {
      p.status = pagedkv::CapacityStatus::kNeverFits;
      p.num_blocks = total;
      p.missing = total - model_.usable();
      return p;
    }
    p.seq = model_.make_seq(prompt, keys);
    const std::size_t eff_cap = std::min(cap.value_or(prompt.size() - 1), prompt.size());
    std::size_t evictable_hits = 0;
    for (std::size_t i = 0; i < std::min(p.seq.hashes.size(), eff_cap / bs); ++i) {
      const auto b = m().prefix_index().find(p.seq.hashes[i]);
      if (!b) break;
      p.hits.push_back(*b);
      if (m().allocator().is_cached(*b)) ++evictable_hits;
    }
    const std::size_t cached = p.hits.size() * bs;
    const std::size_t reserved = std::min(reserve.value_or(prompt.size()), prompt.size() - cached);
    p.num_blocks = model_.blocks_for(cached + reserved) - p.hits.size();
    const std::size_t avail = m().allocator().num_available_blocks() - evictable_hits;
    if (p.num_blocks > avail) {
      p.status = pagedkv::CapacityStatus::kNoCapacity;
      p.missing = p.num_blocks - avail;
    }
    p.seq.built = cached;
    p.seq.slotted = cached + reserved;
    return p;
  }

  /// The error codes an admission (or query_admit, `id` unset) of `prompt` may raise.
  std::set<Errc> admit_errors(std::optional<SeqId> id, std::span<const TokenId> prompt, const RequestKeys* keys,
                              std::string& needle) const {
    std::set<Errc> errs;
    if (id && model_.live(*id)) errs.insert(Errc::kDuplicateSequence), needle = std::to_string(*id);
    if (prompt.size() > model_.max_tokens()) errs.insert(Errc::kLimitExceeded), needle = std::to_string(prompt.size());
    if (!keys_valid(keys, prompt.size())) errs.insert(Errc::kInvalidArgument);
    return errs;
  }

  std::optional<std::size_t> decode_reserve(ByteReader& r, std::size_t len) const {
    const std::uint8_t b = r.u8();
    if (b >= 224) return std::nullopt;
    return b % (len + 2);
  }

  enum class Admission { kPlain, kChunked, kPrepared };

  /// try_admit. kChunked: with num_reserved_tokens; kPrepared: of a prepare_prompt result (checked with
  /// query_admit first), possibly tampered with as if prepared by another manager.
  void op_admit(ByteReader& r, Admission how) {
    const SeqId id = seq_id(r.u8());
    const Toks prompt = decode_prompt(r);
    const std::shared_ptr<RequestKeys> keys_owned = decode_keys(r, prompt.size());
    const RequestKeys* keys = keys_owned.get();
    const auto cap = decode_cap(r, prompt.size());
    const auto reserve = how != Admission::kPlain ? decode_reserve(r, prompt.size()) : std::nullopt;
    const std::uint8_t tamper = how == Admission::kPrepared ? r.u8() : 0;
    std::shared_ptr<const pagedkv::RetentionConfig> retention;
    if constexpr (Model::kHasRetention) retention = decode_retention(r, prompt.size());
    std::string needle;
    std::set<Errc> errs = admit_errors(id, prompt, keys, needle);
    std::optional<pagedkv::PreparedPrompt> prepared;
    if (how == Admission::kPrepared) {
      log_.add("p = m.prepare_prompt(" + toks_text(prompt) + ", " + keys_text(keys) + ")");
      std::string n2;
      std::set<Errc> prep_errs = admit_errors(std::nullopt, prompt, keys, n2);
      if (!call(prep_errs, n2, [&] { prepared.emplace(m().prepare_prompt(prompt, keys)); })) return;
      if (!prep_errs.empty()) fail("prepare_prompt succeeded, expected " + allowed_text(prep_errs));
      expect(std::equal(prepared->tokens.begin(), prepared->tokens.end(), prompt.begin(), prompt.end()) &&
                 prepared->hashes == model_.chain_hashes(prompt, keys),
             "prepare_prompt's tokens or block hashes");
      if (tamper >= 250) {  // as if prepared by a manager with another seed, hasher or block size
        if (tamper & 1) {
          prepared->root.bytes[0] ^= 1;
        } else if (!prepared->hashes.empty()) {
          prepared->hashes.pop_back();
        } else {
          prepared->hashes.push_back(prepared->root);
        }
        const bool caught = (tamper & 1) || model_.prefix_caching();
        if (caught) errs.insert(Errc::kInvalidArgument);
        log_.add(std::string("(p tampered: ") + ((tamper & 1) ? "another chain root" : "another number of block hashes") + ")");
      }
    }
    // Retention is checked after the prompt, the keys and the prepared prompt's origin: their message first.
    if (retention && !retention_valid(*retention)) {
      if (errs.empty()) needle = "retention";
      errs.insert(Errc::kInvalidArgument);
    }
    log_.add("m.try_admit(" + std::to_string(id) + ", " + (prepared ? std::string("p") : toks_text(prompt) + ", " + keys_text(keys)) +
             ", {max_cached_tokens " + opt_text(cap) + ", num_reserved_tokens " + opt_text(reserve) +
             (Model::kHasRetention ? ", retention " + retention_text(retention.get()) : std::string()) + "})");
    const std::size_t bs = model_.block_size();
    AdmitPrediction want;
    std::set<Errc> input_errs = errs;  // what query_admit would raise (no id)
    input_errs.erase(Errc::kDuplicateSequence);
    if (input_errs.empty()) {
      want = predict_admit(prompt, keys_owned, cap, reserve);
      // lookup is pure and agrees with the admission's walk.
      const std::size_t looked = m().lookup(prompt, keys, cap);
      expect(want.status == pagedkv::CapacityStatus::kNeverFits || looked == want.hits.size() * bs,
             "lookup says " + std::to_string(looked) + " cached tokens, the admission walk " +
                 std::to_string(want.hits.size() * bs));
    }
    const CacheStats st = m().stats();
    std::optional<typename Model::Snapshot> before;
    if (errs.empty() && want.status != pagedkv::CapacityStatus::kFits) before.emplace(model_.snapshot(m()));
    pagedkv::AdmitResult res;
    pagedkv::AdmitOptions opts;
    opts.max_cached_tokens = cap;
    opts.num_reserved_tokens = reserve;
    if (prepared && !errs.contains(Errc::kInvalidArgument)) {  // query_admit of the prepared prompt agrees
      pagedkv::CapacityQuery q;
      const std::set<Errc>& qerrs = input_errs;
      if (call(qerrs, "", [&] { q = m().query_admit(*prepared, opts); })) {  // (opts without the retention)
        expect(qerrs.empty(), "query_admit(prepared) succeeded, expected " + allowed_text(qerrs));
        expect(q.status == want.status && q.num_blocks == want.num_blocks && q.num_missing_blocks == want.missing,
               "query_admit(prepared) disagrees with the prediction");
      }
    }
    opts.retention = retention;
    if (!call(errs, needle, [&] {
          res = prepared ? m().try_admit(id, *prepared, opts) : m().try_admit(id, prompt, keys, opts);
        })) {
      return;
    }
    if (!errs.empty()) fail("try_admit succeeded, expected " + allowed_text(errs));
    log_.result("status " + std::to_string(static_cast<int>(res.status)) + ", cached " +
                std::to_string(res.num_cached_tokens) + ", new blocks " + std::to_string(res.num_new_blocks));
    expect(static_cast<int>(res.status) == static_cast<int>(want.status),
           "try_admit status " + std::to_string(static_cast<int>(res.status)) + ", expected " +
               std::to_string(static_cast<int>(want.status)));
    expect(res.num_missing_blocks == want.missing, "num_missing_blocks " + std::to_string(res.num_missing_blocks) +
                                                       ", expected " + std::to_string(want.missing));
    if (want.status != pagedkv::CapacityStatus::kFits) {
      expect(res.num_cached_tokens == 0 && res.num_new_blocks == 0, "a failed admission reports blocks");
      model_.expect_unchanged(m(), *before, "an admission answered no capacity / never fits");
      return;
    }
    const std::size_t hits = want.hits.size();
    expect(res.num_cached_tokens == hits * bs, "num_cached_tokens");
    expect(res.num_new_blocks == want.num_blocks, "num_new_blocks " + std::to_string(res.num_new_blocks) +
                                                      ", expected " + std::to_string(want.num_blocks));
    const auto ids = m().block_ids(id);
    expect(ids.size() == model_.blocks_for(want.seq.slotted) && std::equal(want.hits.begin(), want.hits.end(), ids.begin()),
           "the admitted table does not start with the hit blocks");
    // Counters: every admission in prefix_*, a re-admission of a preempted id also in readmitted_*.
    const bool readmission = model_.preempted_ids().erase(id) != 0;
    const CacheStats now = m().stats();
    expect(now.prefix_query_requests == st.prefix_query_requests + 1 &&
               now.prefix_query_tokens == st.prefix_query_tokens + prompt.size() &&
               now.prefix_hit_tokens == st.prefix_hit_tokens + hits * bs &&
               now.prefix_hit_requests == st.prefix_hit_requests + (hits > 0 ? 1 : 0),
           "prefix counters after an admission");
    const std::size_t re = readmission ? 1 : 0;
    expect(now.readmitted_requests == st.readmitted_requests + re &&
               now.readmitted_query_tokens == st.readmitted_query_tokens + re * prompt.size() &&
               now.readmitted_hit_tokens == st.readmitted_hit_tokens + re * hits * bs,
           std::string("readmitted counters after ") + (readmission ? "a re-admission" : "a new admission"));
    pagedkv::PrefixCacheStats& in = model_.interval();
    if (readmission) {
      ++in.preempted_requests, in.preempted_queries += prompt.size(), in.preempted_hits += hits * bs;
    } else {
      ++in.requests, in.queries += prompt.size(), in.hits += hits * bs;
    }
    want.seq.retention = retention;
    want.seq.prompt_len = prompt.size();
    expect(m().sequence(id).retention == retention && m().sequence(id).num_prompt_tokens == prompt.size(),
           "the admitted sequence's retention config or prompt length");
    model_.add_seq(id, std::move(want.seq));
    model_.check_all(m());
  }

  // ---- growth: append, reserve, lookahead -------------------------------------------------------------------------
  std::size_t decode_append_len(ByteReader& r) const {
    const std::uint8_t b = r.u8();
    const std::size_t bs = model_.block_size();
    if (b < 160) return b % 9;
    if (b < 224) return (b - 160) % 40 + 1;
    if (b < 248) return (b - 223) * bs;
    return model_.usable() * bs + (b - 248) * bs + 1;
  }

  Toks decode_tokens(ByteReader& r, std::size_t pos, std::size_t n) const {
    const std::uint8_t mode = r.u8();
    Toks t(n);
    switch (mode % 4) {
      case 0:  // a deterministic continuation of the position: equal sequences grow equal blocks (deduplication)
        for (std::size_t i = 0; i < n; ++i) t[i] = static_cast<TokenId>(((pos + i) * 7 + 3) % 5);
        break;
      case 1:  // from the input
        for (std::size_t i = 0; i < n; ++i) t[i] = i < 48 ? token_from_byte(r.u8()) : static_cast<TokenId>(i % 3);
        break;
      case 2:
        std::fill(t.begin(), t.end(), static_cast<TokenId>(mode >> 2));
        break;
      default: {  // another live sequence's tokens at these positions (siblings that fill equal blocks)
        const auto* o = nth_live(r.u8());
        for (std::size_t i = 0; i < n; ++i) {
          t[i] = o != nullptr && pos + i < o->tokens.size() ? o->tokens[pos + i] : static_cast<TokenId>(((pos + i) * 7 + 3) % 5);
        }
        break;
      }
    }
    return t;
  }

  /// What growing live sequence `id` by n > 0 slots takes now (query_growth's rules, from the model's side).
  struct Growth {
    bool cow = false;
    std::size_t held = 0;      // blocks the table holds now
    std::size_t needed = 0;    // new blocks + the copy
    std::size_t missing = 0;
    pagedkv::CapacityStatus status = pagedkv::CapacityStatus::kFits;
    std::uint64_t old_last = 0;
  };
  Growth predict_growth(SeqId id, std::size_t n) {
    Growth g;
    if (n == 0) return g;
    const auto& a = m().allocator();
    const auto blocks = m().block_ids(id);
    const std::size_t slotted = model_.seq(id).slotted;
    const std::size_t bs = model_.block_size();
    g.held = blocks.size();
    g.old_last = g.held > 0 ? blocks.back() : 0;
    g.cow = slotted % bs != 0 && (a.refcount(blocks.back()) - Model::pins(m(), blocks.back()) > 1 || a.is_hashed(blocks.back()));
    const std::size_t new_blocks = model_.blocks_for(slotted + n) - g.held;
    g.needed = new_blocks + (g.cow ? 1 : 0);
    // Never fits: even with every other sequence gone (a copy forced by sharing vanishes with the sharers, one
    // forced by a hash does not).
    const std::size_t held_after = g.held + new_blocks + (g.cow && a.is_hashed(blocks.back()) ? 1 : 0);
    if (held_after > model_.usable()) {
      g.status = pagedkv::CapacityStatus::kNeverFits;
      g.missing = held_after - model_.usable();
    } else if (g.needed > a.num_available_blocks()) {
      g.status = pagedkv::CapacityStatus::kNoCapacity;
      g.missing = g.needed - a.num_available_blocks();
    }
    return g;
  }

  enum class Growing { kAppend, kReserve, kLookahead };

  /// try_append / try_reserve / try_reserve_lookahead of `n` positions (`add`: the appended ids, or the drafts).
  void grow(Growing kind, SeqId id, std::size_t n, const Toks& add) {
    const bool is_live = model_.live(id);
    std::set<Errc> errs;
    std::string needle = std::to_string(id);
    if (!is_live) errs.insert(Errc::kUnknownSequence);
    if (is_live) {
      const auto& s = model_.seq(id);
      if (kind == Growing::kReserve) {
        if (n > s.unslotted()) errs.insert(Errc::kInvalidArgument);
      } else {
        if (s.unslotted() != 0 || s.lookahead() != 0) errs.insert(Errc::kInvalidArgument);
        if (s.known() + n > model_.max_tokens()) errs.insert(Errc::kLimitExceeded);
      }
    }
    Growth g;
    if (errs.empty()) g = predict_growth(id, n);
    const CacheStats st = m().stats();
    std::optional<typename Model::Snapshot> before;
    if (errs.empty() && (g.status != pagedkv::CapacityStatus::kFits || n == 0)) before.emplace(model_.snapshot(m()));
    std::optional<pagedkv::AppendResult<Id>> res;
    const bool ok = call(errs, needle, [&] {
      switch (kind) {
        case Growing::kAppend: res.emplace(m().try_append(id, add)); break;
        case Growing::kReserve: res.emplace(m().try_reserve(id, n)); break;
        case Growing::kLookahead: res.emplace(m().try_reserve_lookahead(id, n)); break;
      }
    });
    if (!ok) return;
    if (!errs.empty()) fail("the call succeeded, expected " + allowed_text(errs));
    log_.result("status " + std::to_string(static_cast<int>(res->status)) +
                (res->copy ? ", copy " + std::to_string(res->copy->src) + "->" + std::to_string(res->copy->dst) : ""));
    expect(static_cast<int>(res->status) == static_cast<int>(g.status),
           "status " + std::to_string(static_cast<int>(res->status)) + ", expected " + std::to_string(static_cast<int>(g.status)));
    expect(res->num_missing_blocks == g.missing, "num_missing_blocks " + std::to_string(res->num_missing_blocks) +
                                                     ", expected " + std::to_string(g.missing));
    if (res->status != pagedkv::AppendStatus::kOk || n == 0) {
      expect(res->slots.empty() && !res->copy, "a failed or empty growth reports slots or a copy");
      model_.expect_unchanged(m(), *before, n == 0 ? "an empty growth" : "a growth answered no capacity / never fits");
      return;
    }
    expect(res->slots.size() == n, std::to_string(res->slots.size()) + " slots for " + std::to_string(n) + " positions");
    const Slots got(res->slots.begin(), res->slots.end());
    const CacheStats now = m().stats();
    expect(now.cow_copies == st.cow_copies + (g.cow ? 1 : 0), "cow_copies counter");
    expect(now.dedup_blocks == st.dedup_blocks, "deduplication outside a build or commit");
    expect(now.blocks_cached + now.blocks_free + g.needed == st.blocks_cached + st.blocks_free, "blocks taken by a growth");
    const auto after = m().block_ids(id);
    if (g.cow) {
      expect(res->copy.has_value() && res->copy->src == g.old_last && after[g.held - 1] == res->copy->dst,
             "copy-on-write of the shared / hashed partial last block");
      expect(!m().pending_copies().empty() && m().pending_copies().back() == *res->copy, "the copy is pending");
    } else {
      expect(!res->copy, "a growth copied a block it may write in place");
    }
    auto& s = model_.mutable_seq(id);
    const std::size_t bs = model_.block_size();
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t p = s.slotted + j;
      const std::int64_t want = static_cast<std::int64_t>(after[p / bs]) * bs + static_cast<std::int64_t>(p % bs);
      expect(got[j] == want, "slot of position " + std::to_string(p));
    }
    if (kind == Growing::kAppend) model_.extend(s, add);
    if (kind == Growing::kLookahead) model_.add_drafts(s, add);
    s.slotted += n;
    model_.check_all(m());
  }

  void op_append(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::size_t n = decode_append_len(r);
    const Toks add = decode_tokens(r, model_.live(id) ? model_.seq(id).known() : 0, n);
    log_.add("m.try_append(" + std::to_string(id) + ", " + toks_text(add) + ")");
    grow(Growing::kAppend, id, n, add);
  }

  void op_reserve(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::uint8_t b = r.u8();
    const std::size_t unslotted = model_.live(id) ? model_.seq(id).unslotted() : 0;
    const std::size_t n = b < 128 ? b % (unslotted + 2) : (b - 128) % 40;
    log_.add("m.try_reserve(" + std::to_string(id) + ", " + std::to_string(n) + ")");
    grow(Growing::kReserve, id, n, {});
  }

  void op_reserve_lookahead(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::uint8_t b = r.u8();
    const std::size_t k = b < 240 ? b % 9 : model_.usable() * model_.block_size() + (b - 240);
    const std::size_t pos = model_.live(id) ? model_.seq(id).known() : 0;
    const Toks drafts = decode_tokens(r, pos, std::min<std::size_t>(k, 1U << 16));
    log_.add("m.try_reserve_lookahead(" + std::to_string(id) + ", " + std::to_string(k) + ")  [drafts the GPU proposes: " +
             toks_text(drafts) + "]");
    grow(Growing::kLookahead, id, k, drafts);
  }

  void op_commit_lookahead(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::uint8_t b = r.u8();
    const bool is_live = model_.live(id);
    const std::size_t la = is_live ? model_.seq(id).lookahead() : 0;
    const std::size_t a = b % (la + 2);  // la + 1: more than the lookahead (misuse)
    // The engine commits the drafts the verification accepted (their K/V is what the step wrote).
    Toks accepted;
    if (is_live) {
      const auto& d = model_.seq(id).drafts;
      accepted.assign(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(std::min(a, d.size())));
    }
    accepted.resize(a, 0);
    log_.add("m.commit_lookahead(" + std::to_string(id) + ", " + toks_text(accepted) + ")");
    std::set<Errc> errs;
    if (!is_live) errs.insert(Errc::kUnknownSequence);
    if (is_live && a > la) errs.insert(Errc::kInvalidArgument);
    Blocks blocks;
    if (errs.empty()) {
      const auto bl = m().block_ids(id);
      blocks.assign(bl.begin(), bl.end());
    }
    const CacheStats st = m().stats();
    if (!call(errs, std::to_string(id), [&] { m().commit_lookahead(id, accepted); })) return;
    if (!errs.empty()) fail("commit_lookahead succeeded, expected " + allowed_text(errs));
    log_.result("ok");
    auto& s = model_.mutable_seq(id);
    const std::size_t rejected = la - a;
    model_.commit_drafts(s, a);
    s.slotted -= rejected;
    s.built = std::min(s.built, s.slotted);
    // The kept blocks are the leading ones, except blocks switched to an identical registered one.
    const auto after = m().block_ids(id);
    expect(after.size() == model_.blocks_for(s.slotted), "commit_lookahead kept " + std::to_string(after.size()) + " blocks");
    std::size_t switched = 0;
    for (std::size_t i = 0; i < after.size(); ++i) switched += after[i] != blocks[i] ? 1 : 0;
    expect(m().stats().dedup_blocks == st.dedup_blocks + switched, "dedup_blocks after commit_lookahead");
    model_.check_all(m());
  }

  // ---- fork / free / rewind ------------------------------------------------------------------------------------
  void op_fork(ByteReader& r) {
    const SeqId parent = seq_id(r.u8());
    const SeqId child = seq_id(r.u8());
    log_.add("m.fork(" + std::to_string(parent) + ", " + std::to_string(child) + ")");
    std::set<Errc> errs;
    std::string needle;
    if (model_.live(child)) errs.insert(Errc::kDuplicateSequence), needle = std::to_string(child);
    if (!model_.live(parent)) errs.insert(Errc::kUnknownSequence), needle = std::to_string(parent);
    // A parent that is not settled (unbuilt slots, prompt tokens without slots, lookahead, a pending copy into its
    // table): its child would read K/V no build has written, or chain copies in one build.
    if (errs.empty() && !model_.settled(m(), parent)) errs.insert(Errc::kInvalidArgument), needle = std::to_string(parent);
    const CacheStats st = m().stats();
    if (!call(errs, needle, [&] { m().fork(parent, child); })) return;
    if (!errs.empty()) fail("fork succeeded, expected " + allowed_text(errs));
    log_.result("ok");
    const auto pb = m().block_ids(parent);
    const auto cb = m().block_ids(child);
    expect(std::equal(pb.begin(), pb.end(), cb.begin(), cb.end()), "the child's table is not the parent's");
    expect(m().stats().blocks_free == st.blocks_free && m().stats().blocks_cached == st.blocks_cached,
           "fork allocated or evicted");
    model_.add_seq(child, model_.seq(parent));
    model_.check_all(m());
  }

  void op_free(ByteReader& r, bool preempt) {
    const SeqId id = seq_id(r.u8());
    log_.add(std::string(preempt ? "m.preempt(" : "m.free(") + std::to_string(id) + ")");
    std::set<Errc> errs;
    if (!model_.live(id)) errs.insert(Errc::kUnknownSequence);
    Blocks blocks, want_lru;
    if (errs.empty()) {
      const auto b = m().block_ids(id);
      blocks.assign(b.begin(), b.end());
      want_lru = model_.expected_lru_after_release(m(), blocks);
    }
    const auto pre = m().stats().preemptions;
    if (!call(errs, std::to_string(id), [&] { preempt ? m().preempt(id) : m().free(id); })) return;
    if (!errs.empty()) fail("free / preempt of a sequence that is not live succeeded");
    log_.result("ok");
    expect(m().stats().preemptions == pre + (preempt ? 1 : 0), "preemptions counter");
    check_after_release(want_lru, preempt ? "preempt" : "free");
    check_released_retention(model_.seq(id), blocks, 0);
    if (preempt) model_.preempted_ids().insert(id);
    model_.erase_seq(id);
    model_.check_all(m());
  }

  void op_rewind(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::uint8_t b = r.u8();
    const bool is_live = model_.live(id);
    const std::size_t len = is_live ? model_.seq(id).known() + model_.seq(id).lookahead() : 0;
    std::size_t n;
    if (b < 128) {
      n = b % (model_.block_size() + 1);
    } else if (b < 254) {
      n = (b - 128) % (len + 1);
    } else {
      n = b == 254 ? len : len + 1 + (b & 1);
    }
    log_.add("m.rewind(" + std::to_string(id) + ", " + std::to_string(n) + ")");
    std::set<Errc> errs;
    std::string needle = std::to_string(id);
    if (!is_live) errs.insert(Errc::kUnknownSequence);
    if (is_live && n > len) errs.insert(Errc::kLimitExceeded);
    Blocks blocks, want_lru;
    typename Model::MSeq after_model;
    if (errs.empty()) {
      const auto bl = m().block_ids(id);
      blocks.assign(bl.begin(), bl.end());
      after_model = model_.seq(id);
      model_.rewind(after_model, n);
      const std::size_t keep = model_.blocks_for(after_model.slotted);
      want_lru = model_.expected_lru_after_release(m(), Blocks(blocks.begin() + static_cast<std::ptrdiff_t>(keep), blocks.end()));
    }
    if (!call(errs, needle, [&] { m().rewind(id, n); })) return;
    if (!errs.empty()) fail("rewind succeeded, expected " + allowed_text(errs));
    log_.result("ok");
    check_after_release(want_lru, "rewind");
    const std::size_t keep = model_.blocks_for(after_model.slotted);
    check_released_retention(after_model, blocks, keep);
    const auto after = m().block_ids(id);
    expect(after.size() == keep && std::equal(after.begin(), after.end(), blocks.begin()),
           "rewind kept other blocks than the leading ones");
    model_.add_seq(id, std::move(after_model));
    model_.check_all(m());
  }

  // ---- pure queries ---------------------------------------------------------------------------------------------
  void op_lookup(ByteReader& r) {
    const Toks prompt = decode_prompt(r);
    const std::shared_ptr<RequestKeys> keys_owned = decode_keys(r, prompt.size());
    const RequestKeys* keys = keys_owned.get();
    const auto cap = decode_cap(r, prompt.size());
    log_.add("m.lookup(" + toks_text(prompt) + ", " + keys_text(keys) + ", cap " + opt_text(cap) + ")");
    std::set<Errc> errs;
    if (!keys_valid(keys, prompt.size())) errs.insert(Errc::kInvalidArgument);
    std::size_t want = 0;
    if (model_.prefix_caching() && !prompt.empty()) {
      const auto h = model_.chain_hashes(prompt, keys);
      const std::size_t eff_cap = std::min(cap.value_or(prompt.size() - 1), prompt.size());
      std::size_t i = 0;
      while (i < std::min(h.size(), eff_cap / model_.block_size()) && m().prefix_index().find(h[i])) ++i;
      want = i * model_.block_size();
    }
    const auto before = model_.snapshot(m());
    std::size_t got = 0;
    if (!call(errs, "", [&] { got = m().lookup(prompt, keys, cap); })) return;
    if (!errs.empty()) fail("lookup succeeded, expected " + allowed_text(errs));
    log_.result(std::to_string(got));
    expect(got == want, "lookup says " + std::to_string(got) + " cached tokens, the model " + std::to_string(want));
    model_.expect_unchanged(m(), before, "lookup (pure)");
  }

  void op_query(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    log_.add("queries of sequence " + std::to_string(id));
    const bool is_live = model_.live(id);
    expect(m().contains(id) == is_live, "contains");
    const std::set<Errc> errs = is_live ? std::set<Errc>{} : std::set<Errc>{Errc::kUnknownSequence};
    const std::string needle = std::to_string(id);
    std::size_t n = 0;
    const bool a = call(errs, needle, [&] { n = m().num_tokens(id); });
    const bool b = call(errs, needle, [&] { (void)m().token_ids(id); });
    const bool c = call(errs, needle, [&] { (void)m().block_ids(id); });
    const bool d = call(errs, needle, [&] { (void)m().pending_slots(id); });
    expect(a == is_live && b == is_live && c == is_live && d == is_live, "queries of a sequence that is not live succeeded");
    if (is_live) expect(n == model_.seq(id).slotted, "num_tokens");
  }

  /// query_admit: what try_admit would answer now, and nothing changes.
  void op_query_admit(ByteReader& r) {
    const Toks prompt = decode_prompt(r);
    const std::shared_ptr<RequestKeys> keys_owned = decode_keys(r, prompt.size());
    const RequestKeys* keys = keys_owned.get();
    const auto cap = decode_cap(r, prompt.size());
    const auto reserve = decode_reserve(r, prompt.size());
    log_.add("m.query_admit(" + toks_text(prompt) + ", " + keys_text(keys) + ", {max_cached_tokens " + opt_text(cap) +
             ", num_reserved_tokens " + opt_text(reserve) + "})");
    std::string needle;
    const std::set<Errc> errs = admit_errors(std::nullopt, prompt, keys, needle);
    AdmitPrediction want;
    if (errs.empty()) want = predict_admit(prompt, keys_owned, cap, reserve);
    const auto before = model_.snapshot(m());
    pagedkv::CapacityQuery q;
    pagedkv::AdmitOptions opts;
    opts.max_cached_tokens = cap;
    opts.num_reserved_tokens = reserve;
    if (!call(errs, needle, [&] { q = m().query_admit(prompt, keys, opts); })) return;
    if (!errs.empty()) fail("query_admit succeeded, expected " + allowed_text(errs));
    log_.result("status " + std::to_string(static_cast<int>(q.status)) + ", blocks " + std::to_string(q.num_blocks) +
                ", missing " + std::to_string(q.num_missing_blocks) + ", cached " + std::to_string(q.num_cached_tokens));
    const std::size_t cached = want.status == pagedkv::CapacityStatus::kNeverFits ? 0 : want.hits.size() * model_.block_size();
    expect(q.status == want.status && q.num_blocks == want.num_blocks && q.num_missing_blocks == want.missing &&
               q.num_cached_tokens == cached,
           "query_admit answered status " + std::to_string(static_cast<int>(q.status)) + " blocks " +
               std::to_string(q.num_blocks) + " missing " + std::to_string(q.num_missing_blocks) + " cached " +
               std::to_string(q.num_cached_tokens) + "; the model: " + std::to_string(static_cast<int>(want.status)) +
               " / " + std::to_string(want.num_blocks) + " / " + std::to_string(want.missing) + " / " + std::to_string(cached));
    model_.expect_unchanged(m(), before, "query_admit (pure)");
  }

  /// query_append: what growing a sequence by n slots would take now, and nothing changes.
  void op_query_append(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::size_t n = decode_append_len(r);
    log_.add("m.query_append(" + std::to_string(id) + ", " + std::to_string(n) + ")");
    std::set<Errc> errs;
    if (!model_.live(id)) errs.insert(Errc::kUnknownSequence);
    Growth g;
    if (errs.empty()) g = predict_growth(id, n);
    const auto before = model_.snapshot(m());
    pagedkv::CapacityQuery q;
    if (!call(errs, std::to_string(id), [&] { q = m().query_append(id, n); })) return;
    if (!errs.empty()) fail("query_append succeeded, expected " + allowed_text(errs));
    log_.result("status " + std::to_string(static_cast<int>(q.status)) + ", blocks " + std::to_string(q.num_blocks) +
                ", missing " + std::to_string(q.num_missing_blocks));
    expect(q.status == g.status && q.num_blocks == g.needed && q.num_missing_blocks == g.missing && q.num_cached_tokens == 0,
           "query_append answered status " + std::to_string(static_cast<int>(q.status)) + " blocks " +
               std::to_string(q.num_blocks) + " missing " + std::to_string(q.num_missing_blocks) + "; the model: " +
               std::to_string(static_cast<int>(g.status)) + " / " + std::to_string(g.needed) + " / " +
               std::to_string(g.missing));
    model_.expect_unchanged(m(), before, "query_append (pure)");
  }

  /// take_event_batch: the events since the last take as the next numbered batch (checked by check_all).
  void op_take_event_batch() {
    log_.add("m.take_event_batch(ts)");
    model_.take_event_batch_next();
    model_.check_all(m());
  }

  /// take_prefix_cache_stats: the interval's admissions (new and re-admitted apart), then a new interval.
  void op_take_prefix_stats() {
    log_.add("m.take_prefix_cache_stats()");
    const pagedkv::PrefixCacheStats got = m().take_prefix_cache_stats();
    pagedkv::PrefixCacheStats& want = model_.interval();
    expect(got.reset == want.reset && got.requests == want.requests && got.queries == want.queries &&
               got.hits == want.hits && got.preempted_requests == want.preempted_requests &&
               got.preempted_queries == want.preempted_queries && got.preempted_hits == want.preempted_hits,
           "take_prefix_cache_stats: requests " + std::to_string(got.requests) + "/" + std::to_string(want.requests) +
               ", queries " + std::to_string(got.queries) + "/" + std::to_string(want.queries) + ", hits " +
               std::to_string(got.hits) + "/" + std::to_string(want.hits) + ", preempted requests " +
               std::to_string(got.preempted_requests) + "/" + std::to_string(want.preempted_requests) + ", reset " +
               std::to_string(got.reset) + "/" + std::to_string(want.reset) + " (manager/model)");
    want = {};
    const pagedkv::PrefixCacheStats again = m().take_prefix_cache_stats();
    expect(!again.reset && again.requests == 0 && again.preempted_requests == 0, "a second take is not empty");
  }

  // ---- builds -----------------------------------------------------------------------------------------------------
  enum class BuildKind { kAny, kStep, kScheduled };

  /// build_batch_metadata. kAny: any batch and buffer shapes; kStep: every live sequence with something to compute,
  /// exact buffers (an engine step); kScheduled: an engine step computing only part of each sequence's pending positions
  /// (num_scheduled_tokens: prefill chunks, decode + lookahead).
  void op_build(ByteReader& r, BuildKind kind) {
    std::vector<SeqId> live;
    for (const auto& [id, s] : model_.seqs()) live.push_back(id);
    std::vector<SeqId> batch;
    std::vector<std::uint32_t> q_lens;  // empty: every pending position
    bool q_lens_wrong_size = false;
    bool q_len_too_long = false;
    std::uint8_t omit = 0, pad = 0, fault = 0;
    // An engine step schedules the live sequences with something to compute (a row with nothing is refused).
    std::vector<SeqId> busy;
    for (SeqId id : live) {
      if (model_.seq(id).pending() > 0) busy.push_back(id);
    }
    if (kind == BuildKind::kStep) {
      batch = busy;
    } else if (kind == BuildKind::kScheduled) {
      batch = busy;
      for (SeqId id : batch) {
        const std::size_t pending = model_.seq(id).pending();
        const std::uint8_t q = r.u8();
        // Mostly 1..pending; 0 (refused) and too many now and then.
        const std::size_t n = q < 200 ? 1 + q % pending : q <= 248 ? pending : q <= 250 ? 0 : pending + 1 + (q & 1);
        q_lens.push_back(static_cast<std::uint32_t>(n));
      }
      if (r.u8() >= 250) {  // a num_scheduled_tokens span not of the batch's size
        if (!q_lens.empty() && (q_lens.size() > 1 || r.u8() & 1)) {
          q_lens.pop_back();
        } else {
          q_lens.push_back(0);
        }
        q_lens_wrong_size = !q_lens.empty();  // an empty span means "all pending"
      }
      for (std::size_t b = 0; b < std::min(q_lens.size(), batch.size()); ++b) {
        q_len_too_long |= q_lens[b] > model_.seq(batch[b]).pending();
      }
    } else {
      const std::uint8_t mode = r.u8();
      switch (mode % 8) {
        case 4:
        case 5: {  // a subset
          std::uint8_t mask = 0;
          for (std::size_t i = 0; i < live.size(); ++i) {
            if (i % 8 == 0) mask = r.u8();
            if ((mask >> (i % 8)) & 1U) batch.push_back(live[i]);
          }
          break;
        }
        case 6:  // every live sequence and one more id (not live, or a duplicate)
          batch = live;
          batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(r.u8() % (batch.size() + 1)), seq_id(r.u8()));
          break;
        case 7:  // a duplicate
          batch = live;
          if (!live.empty()) batch.push_back(live[r.u8() % live.size()]);
          break;
        default:
          batch = (mode & 32) != 0 ? live : busy;  // every live sequence (refused if one has nothing to compute)
          break;
      }
      if (mode & 8) std::reverse(batch.begin(), batch.end());
      if ((mode & 16) && !batch.empty()) std::rotate(batch.begin(), batch.begin() + static_cast<std::ptrdiff_t>(r.u8() % batch.size()), batch.end());
      omit = r.u8();
      pad = r.u8() % 4;
      fault = r.u8();
    }

    // Expected errors (any of them may be reported: the validation order is not part of the contract).
    std::set<Errc> errs;
    std::set<SeqId> seen;
    std::size_t total_blocks = 0, total_slots = 0, max_row = 0;
    if (q_lens_wrong_size) errs.insert(Errc::kBadShape);
    if (q_len_too_long) errs.insert(Errc::kInvalidArgument);
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const SeqId id = batch[b];
      if (!model_.live(id)) {
        errs.insert(Errc::kUnknownSequence);
        continue;
      }
      if (!seen.insert(id).second) errs.insert(Errc::kInvalidArgument);
      const auto& s = model_.seq(id);
      const std::size_t q_len = q_lens.empty() || b >= q_lens.size() ? s.pending() : std::min<std::size_t>(q_lens[b], s.pending());
      if ((q_lens.empty() || b < q_lens.size()) && (q_lens.empty() ? s.pending() : q_lens[b]) == 0) {
        errs.insert(Errc::kInvalidArgument);  // a row with nothing to compute
      }
      const std::size_t rows = model_.blocks_for(s.built + q_len);  // the page table covers what is written by then
      total_blocks += rows;
      total_slots += q_len;
      max_row = std::max(max_row, rows);
    }
    const std::size_t B = batch.size();
    std::size_t num_copies = 0;  // the copies this build hands out
    for (bool sel : model_.build_copy_selection(m(), batch, q_lens)) num_copies += sel ? 1 : 0;
    typename Model::BuildOut out;
    // Buffer sizes: exact + pad, or empty (omit bit), or one short (fault).
    const std::size_t want[8] = {B + 1, total_blocks, B, 0, B, B + 1, total_slots, 2 * num_copies};
    std::size_t have[8];
    for (int i = 0; i < 8; ++i) {
      have[i] = ((omit >> i) & 1U) ? 0 : want[i] + (i == 7 ? 2 * pad : pad);
    }
    std::int64_t row_len = static_cast<std::int64_t>(std::max<std::size_t>(max_row, 1) + (pad & 1));
    have[3] = ((omit >> 3) & 1U) ? 0 : (B + pad) * static_cast<std::size_t>(row_len);
    if (fault >= 200) {
      const int f = (fault - 200) % 12;
      if (f < 8 && f != 3 && have[f] != 0 && want[f] > 0) have[f] = want[f] - 1;
      if (f == 3 && have[3] != 0 && B > 0) have[3] = B * static_cast<std::size_t>(row_len) - 1;
      if (f == 8 && max_row > 0) row_len = static_cast<std::int64_t>(max_row) - 1;
      if (f == 9) row_len = 0;
      if (f == 10) row_len = -static_cast<std::int64_t>(1 + (fault & 3));
      if (f == 11) have[7] = 0;
      if (f >= 8 && f <= 10 && have[3] == 0) have[3] = 1;  // a set block table with a bad row length
    }
    for (int i = 0; i < 8; ++i) {
      if (i == 3) continue;
      if (have[i] != 0 && have[i] < want[i]) errs.insert(Errc::kBadShape);
    }
    if (have[3] != 0) {
      if (row_len <= 0) {
        errs.insert(Errc::kBadShape);
      } else {
        if (max_row > static_cast<std::size_t>(row_len)) errs.insert(Errc::kBadShape);
        if (have[3] < B * static_cast<std::size_t>(row_len)) errs.insert(Errc::kBadShape);
      }
    }
    if (total_blocks > 0 && have[1] == 0 && have[0] != 0) errs.insert(Errc::kBadShape);
    // Empty spans skip an output, except the two a build cannot drop: the new tokens' slots and the pending copies.
    if ((total_slots > 0 && have[6] == 0) || (num_copies > 0 && have[7] == 0)) errs.insert(Errc::kBadShape);

    out.indptr.assign(have[0], out.sentinel);
    out.indices.assign(have[1], out.sentinel);
    out.last_page_len.assign(have[2], out.sentinel);
    out.block_tables.assign(have[3], out.sentinel);
    out.seq_lens.assign(have[4], out.sentinel);
    out.qo_indptr.assign(have[5], out.sentinel);
    out.slot_mapping.assign(have[6], out.sentinel);
    out.copies.assign(have[7], out.sentinel);
    out.max_blocks_per_seq = row_len;
    pagedkv::BatchMetadataBuffers buf;
    buf.indptr = out.indptr;
    buf.indices = out.indices;
    buf.last_page_len = out.last_page_len;
    buf.block_tables = out.block_tables;
    buf.max_blocks_per_seq = static_cast<std::int32_t>(row_len);
    buf.seq_lens = out.seq_lens;
    buf.qo_indptr = out.qo_indptr;
    buf.slot_mapping = out.slot_mapping;
    buf.copies = out.copies;

    std::string text = "m.build_batch_metadata({";
    for (std::size_t i = 0; i < B; ++i) text += (i ? "," : "") + std::to_string(batch[i]);
    text += "}, sizes indptr " + std::to_string(have[0]) + " indices " + std::to_string(have[1]) + " last_page_len " +
            std::to_string(have[2]) + " block_tables " + std::to_string(have[3]) + " (row " + std::to_string(row_len) +
            ") seq_lens " + std::to_string(have[4]) + " qo_indptr " + std::to_string(have[5]) + " slot_mapping " +
            std::to_string(have[6]) + " copies " + std::to_string(have[7]);
    if (kind == BuildKind::kScheduled) {
      text += ", num_scheduled_tokens {";
      for (std::size_t i = 0; i < q_lens.size(); ++i) text += (i ? "," : "") + std::to_string(q_lens[i]);
      text += "}";
    }
    log_.add(text + ")");

    const auto pre = errs.empty() ? model_.capture_build_pre(m(), batch, q_lens) : typename Model::BuildPre{};
    pagedkv::BatchMetadataSizes sz;
    if (!call(errs, "", [&] { sz = m().build_batch_metadata(batch, buf, q_lens); })) return;
    if (!errs.empty()) fail("build_batch_metadata succeeded, expected " + allowed_text(errs));
    log_.result("ok: " + std::to_string(sz.num_copies) + " copies, " + std::to_string(sz.num_new_tokens) + " new tokens");
    model_.check_build_and_run_kernels(m(), pre, out, sz);
    model_.check_all(m());
  }

  // ---- maintenance ----------------------------------------------------------------------------------------------
  void op_reset() {
    log_.add("m.reset_prefix_cache()");
    const bool want = m().stats().blocks_used == 0;
    const auto before = model_.snapshot(m());
    const bool ok = m().reset_prefix_cache();
    log_.result(ok ? "true" : "false");
    expect(ok == want, "reset_prefix_cache answered " + std::to_string(ok) + " with " +
                           std::to_string(m().stats().blocks_used) + " blocks used");
    if (!ok) {
      model_.expect_unchanged(m(), before, "a refused reset_prefix_cache");
      return;
    }
    expect(m().prefix_index().size() == 0 && m().stats().blocks_cached == 0 &&
               m().stats().blocks_free == model_.usable(),
           "reset_prefix_cache left cached blocks");
    for (const auto& [id, s] : model_.seqs()) expect(s.slotted == 0, "a live sequence with slots and no block");
    model_.interval().reset = true;
    model_.check_all(m(), /*expect_cleared=*/m().config().enable_events);
  }

  void op_move() {
    if constexpr (std::is_move_constructible_v<Mgr>) {
      log_.add("m = KVCacheManager(std::move(m))");
      auto moved = std::make_unique<Mgr>(std::move(*m_));
      m_ = std::move(moved);
      model_.check_all(m());
    }
  }

  void drain_all() {
    x_quiesce();
    std::vector<SeqId> ids;
    for (const auto& [id, s] : model_.seqs()) ids.push_back(id);
    for (SeqId id : ids) {
      log_.add("m.free(" + std::to_string(id) + ")");
      m().free(id);
      model_.erase_seq(id);
    }
    model_.ext_refs.clear(), model_.ext_unfilled.clear(), model_.ext_sequences = 0;
    log_.add("m.build_batch_metadata({}, {})");
    const auto sz = m().build_batch_metadata(std::vector<SeqId>{}, pagedkv::BatchMetadataBuffers{});
    expect(sz.batch_size == 0 && sz.num_copies == 0, "an empty build after freeing everything");
    const CacheStats s = m().stats();
    expect(s.blocks_used == 0 && s.blocks_free + s.blocks_cached == model_.usable() && m().pending_copies().empty() &&
               m().num_sequences() == 0,
           "blocks leaked after freeing every sequence (" + std::to_string(s.blocks_used) + " still used)");
    for (std::size_t b = 1; b <= model_.usable(); ++b) {
      expect(m().allocator().refcount(static_cast<Id>(b)) == 0, "block " + std::to_string(b) + " still referenced");
    }
    model_.check_all(m());
  }

  // ---- external KV (issue 33) -------------------------------------------------------------------------------------
  // A mirror of the external-KV rules written from the API's contract (detail/external_kv.hpp's doc comments): ids
  // from one counter, references and generations per block, signals classified as applied / late / duplicate /
  // unknown, deadlines on the driver's clock. The model counts the references (ext_refs) so that check_all's
  // refcount balance covers them, and never sees a fill's blocks registered (ext_unfilled).
  enum class XKind : std::uint8_t { kLease, kSavePin, kOrphan };
  struct XFill {
    SeqId seq = 0;
    Blocks blocks, table;  // the fill's blocks; the waiting sequence's whole table
    std::size_t first_token = 0, end_token = 0;
    Toks prompt;
  };
  struct XHold {
    XKind kind = XKind::kLease;
    Blocks blocks;
    std::optional<std::int64_t> deadline;
    std::uint64_t fill_id = 0;
  };
  static constexpr SeqId kExtFirstSeq = 1000;
  static constexpr std::int64_t kOrphanTimeout = 480;  // the manager's default (s)

  std::uint64_t x_fill_of(SeqId seq) const {
    for (const auto& [id, f] : x_fills_) {
      if (f.seq == seq) return id;
    }
    return 0;
  }
  void x_take(const Blocks& blocks) {
    x_refs_.resize(model_.usable() + 1, 0), x_gen_.resize(model_.usable() + 1, 0);
    for (auto b : blocks) ++x_refs_[b];
  }
  void x_drop(const Blocks& blocks) {
    for (auto b : blocks) {
      if (--x_refs_[b] == 0) ++x_gen_[b];
    }
  }
  void x_issue(const Blocks& blocks, const std::vector<std::uint32_t>& gens, const std::string& what) {
    expect(gens.size() == blocks.size(), what + ": one generation per block");
    for (std::size_t i = 0; i < blocks.size() && i < gens.size(); ++i) {
      expect(gens[i] == x_gen_[blocks[i]], what + ": block " + std::to_string(blocks[i]) + " generation " +
                                               std::to_string(gens[i]) + ", expected " + std::to_string(x_gen_[blocks[i]]));
      if (x_issued_.size() < 4096) x_issued_.emplace_back(blocks[i], gens[i]);
    }
  }
  /// Tell the model what external KV holds, then check everything.
  void x_sync_and_check() {
    model_.ext_refs.assign(model_.usable() + 1, 0);
    model_.ext_unfilled.clear();
    for (std::size_t b = 0; b < x_refs_.size(); ++b) model_.ext_refs[b] = x_refs_[b];
    for (const auto& [id, f] : x_fills_) {
      for (auto b : f.table) ++model_.ext_refs[b];
      model_.ext_unfilled.insert(model_.ext_unfilled.end(), f.blocks.begin(), f.blocks.end());
    }
    for (const auto& [id, h] : x_holds_) {
      if (h.kind == XKind::kOrphan) model_.ext_unfilled.insert(model_.ext_unfilled.end(), h.blocks.begin(), h.blocks.end());
    }
    model_.ext_sequences = x_fills_.size();
    const auto c = m().stats().external;
    std::size_t held = 0;
    for (auto r : x_refs_) held += r != 0 ? 1 : 0;
    expect(c.fills_in_flight == x_fills_.size() && c.holds_active == x_holds_.size() && c.blocks_held == held,
           "external counters: fills " + std::to_string(c.fills_in_flight) + "/" + std::to_string(x_fills_.size()) +
               ", holds " + std::to_string(c.holds_active) + "/" + std::to_string(x_holds_.size()) + ", blocks held " +
               std::to_string(c.blocks_held) + "/" + std::to_string(held) + " (manager/mirror)");
    expect(c.late_signals == x_late_ && c.duplicate_signals == x_dup_ && c.unknown_signals == x_unknown_ &&
               c.stale_generations == x_stale_,
           "external signal counters: late " + std::to_string(c.late_signals) + "/" + std::to_string(x_late_) +
               ", duplicate " + std::to_string(c.duplicate_signals) + "/" + std::to_string(x_dup_) + ", unknown " +
               std::to_string(c.unknown_signals) + "/" + std::to_string(x_unknown_) + ", stale " +
               std::to_string(c.stale_generations) + "/" + std::to_string(x_stale_) + " (manager/mirror)");
    model_.check_all(m());
  }
  /// The signal classification of an id that names no live fill (take_fill) or hold (release / extend).
  pagedkv::ExternalSignal x_classify_ended(std::uint64_t id) {
    if (id == 0 || id >= x_next_) return ++x_unknown_, pagedkv::ExternalSignal::kUnknown;
    const auto it = x_ended_.find(id);
    if (it != x_ended_.end() && it->second) return ++x_dup_, pagedkv::ExternalSignal::kDuplicate;
    return ++x_late_, pagedkv::ExternalSignal::kLate;
  }
  void x_end_hold(std::uint64_t id, bool signalled) {
    XHold& h = x_holds_.at(id);
    x_drop(h.blocks);
    if (h.kind == XKind::kOrphan) x_ended_[h.fill_id] = false;
    x_holds_.erase(id);
    x_ended_[id] = signalled;
  }
  std::uint64_t x_pick(std::uint8_t b) const { return b % (x_next_ + 1); }
  std::optional<std::int64_t> x_deadline(std::uint8_t b) const {
    return b == 0 ? std::nullopt : std::optional<std::int64_t>(x_now_ + b);
  }
  static pagedkv::ExternalTimePoint x_at(std::int64_t s) { return pagedkv::ExternalTimePoint{} + std::chrono::seconds(s); }
  static std::optional<pagedkv::ExternalTimePoint> x_at(std::optional<std::int64_t> s) {
    return s ? std::optional(x_at(*s)) : std::nullopt;
  }

  void op_ext_admit(ByteReader& r) {
    const SeqId id = kExtFirstSeq + r.u8() % 4;
    const Toks& base = bases()[r.u8() & 3];
    const std::size_t len = 2 + r.u8() % 120;
    const Toks prompt(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(len));
    const std::size_t offered = r.u8() % (len + 3);
    const std::uint8_t hb = r.u8();
    const std::size_t headroom = hb >= 240 ? hb - 240U : 0;
    log_.add("m.try_admit_external(" + std::to_string(id) + ", " + toks_text(prompt) + ", " + std::to_string(offered) +
             ", headroom " + std::to_string(headroom) + ")");
    std::string needle;
    std::set<Errc> errs = admit_errors(id, prompt, nullptr, needle);
    if (x_fill_of(id) != 0) errs.insert(Errc::kDuplicateSequence), needle = std::to_string(id);
    AdmitPrediction want;
    if (!errs.contains(Errc::kLimitExceeded)) want = predict_admit(prompt, nullptr, std::nullopt, std::nullopt);
    const std::size_t bs = model_.block_size();
    const std::size_t hit = want.hits.size() * bs;
    const std::size_t n_ext = want.status == pagedkv::CapacityStatus::kFits ? pagedkv::importable_tokens(hit + offered, len, hit) : 0;
    // The headroom check counts every hit block as if cached (conservative).
    const std::size_t avail = m().allocator().num_available_blocks();
    const std::size_t need = want.num_blocks + want.hits.size() + headroom;
    const bool headroom_refused = errs.empty() && headroom != 0 && want.status == pagedkv::CapacityStatus::kFits && avail < need;
    const auto before = model_.snapshot(m());
    const CacheStats st = m().stats();
    pagedkv::ExternalAdmitResult<Id> res;
    if (!call(errs, needle, [&] { res = m().try_admit_external(id, prompt, offered, nullptr, {}, headroom); })) return;
    if (!errs.empty()) fail("try_admit_external succeeded, expected " + allowed_text(errs));
    log_.result("status " + std::to_string(static_cast<int>(res.admit.status)) + ", cached " +
                std::to_string(res.admit.num_cached_tokens) + ", fill " + std::to_string(res.ticket.fill_id));
    if (headroom_refused) {
      expect(res.admit.status == pagedkv::AdmitStatus::kNoCapacity && res.admit.num_missing_blocks == need - avail &&
                 res.ticket.fill_id == 0,
             "try_admit_external kept less than the headroom free");
      model_.expect_unchanged(m(), before, "an external admission refused for its headroom");
      return x_sync_and_check();
    }
    expect(static_cast<int>(res.admit.status) == static_cast<int>(want.status), "try_admit_external status");
    if (want.status != pagedkv::CapacityStatus::kFits) {
      expect(res.ticket.fill_id == 0, "a ticket for a refused admission");
      model_.expect_unchanged(m(), before, "an external admission answered no capacity / never fits");
      return x_sync_and_check();
    }
    expect(res.admit.num_cached_tokens == hit, "try_admit_external's local hit");
    const bool readmission = model_.preempted_ids().erase(id) != 0;
    pagedkv::PrefixCacheStats& in = model_.interval();
    if (readmission) {
      ++in.preempted_requests, in.preempted_queries += len, in.preempted_hits += hit;
    } else {
      ++in.requests, in.queries += len, in.hits += hit;
    }
    expect(m().stats().prefix_query_requests == st.prefix_query_requests + 1, "prefix counters after an external admission");
    if (n_ext == 0) {  // a plain admission
      expect(res.ticket.fill_id == 0 && res.ticket.blocks.empty(), "a ticket with nothing external");
      want.seq.prompt_len = len;
      model_.add_seq(id, std::move(want.seq));
      return x_sync_and_check();
    }
    const auto table = m().block_ids(id);
    const std::size_t first = hit / bs, nb = (hit + n_ext + bs - 1) / bs - first;
    expect(res.ticket.fill_id == x_next_ && res.ticket.seq == id && res.ticket.first_token == hit &&
               res.ticket.end_token == hit + n_ext && res.ticket.first_block == first && res.ticket.num_groups == 1 &&
               res.ticket.blocks.size() == nb && table.size() == model_.blocks_for(len) &&
               std::equal(res.ticket.blocks.begin(), res.ticket.blocks.end(), table.begin() + static_cast<std::ptrdiff_t>(first)),
           "the fill ticket (id " + std::to_string(res.ticket.fill_id) + ", expected " + std::to_string(x_next_) +
               "; tokens [" + std::to_string(res.ticket.first_token) + ", " + std::to_string(res.ticket.end_token) +
               "), expected [" + std::to_string(hit) + ", " + std::to_string(hit + n_ext) + "))");
    expect(m().external_fill_of(id) == x_next_, "external_fill_of after the admission");
    XFill f{id, Blocks(res.ticket.blocks.begin(), res.ticket.blocks.end()), Blocks(table.begin(), table.end()), hit,
            hit + n_ext, prompt};
    x_take(f.blocks);
    x_issue(f.blocks, res.ticket.generations, "the fill ticket");
    x_fills_.emplace(x_next_++, std::move(f));
    x_sync_and_check();
  }

  void op_ext_complete(ByteReader& r) {
    const std::uint64_t fid = x_pick(r.u8());
    const std::uint8_t mode = r.u8() % 4;
    const std::uint8_t kb = r.u8();
    const auto it = x_fills_.find(fid);
    const std::size_t bs = model_.block_size();
    const std::size_t nb = it != x_fills_.end() ? it->second.blocks.size() : 0;
    std::vector<std::size_t> failed;
    std::size_t valid = kb % (nb + 2);
    bool bad = it != x_fills_.end() && valid > nb;
    if (mode == 0) valid = nb, bad = false;
    if (mode == 2) {
      valid = nb, bad = false;
      for (std::size_t i = 0, c = r.u8() % 3; i < c; ++i) {
        failed.push_back(r.u8() % (nb + 1));
        if (it != x_fills_.end() && failed.back() >= nb) bad = true;
        valid = std::min(valid, failed.back());
      }
    }
    const auto policy = mode == 3 ? pagedkv::ExternalFailurePolicy::kFail : pagedkv::ExternalFailurePolicy::kRecompute;
    log_.add("m.complete_external_fill(" + std::to_string(fid) + ", " +
             (mode == 2 ? std::to_string(failed.size()) + " failed" : std::to_string(valid) + " valid") +
             (mode == 3 ? ", kFail)" : ")"));
    std::set<Errc> errs;
    if (bad) errs.insert(Errc::kInvalidArgument);
    Blocks want_lru;
    const bool fails = it != x_fills_.end() && !bad && valid < nb && mode == 3;
    if (fails) want_lru = model_.expected_lru_after_release(m(), it->second.table);
    pagedkv::ExternalCompletion out;
    if (!call(errs, "complete_external_fill", [&] {
          out = mode == 2 ? m().complete_external_fill(fid, std::span<const std::size_t>(failed), policy)
                          : m().complete_external_fill(fid, valid, policy);
        })) {
      return x_sync_and_check();
    }
    if (bad) fail("complete_external_fill succeeded with blocks beyond the fill");
    log_.result(pagedkv::to_string(out.signal));
    if (it == x_fills_.end()) {  // late (an orphan's hold ends now), duplicate or unknown
      pagedkv::ExternalSignal want = pagedkv::ExternalSignal::kUnknown;
      std::optional<std::uint64_t> orphan;
      for (const auto& [hid, h] : x_holds_) {
        if (h.kind == XKind::kOrphan && h.fill_id == fid) orphan = hid;
      }
      if (orphan) {
        x_end_hold(*orphan, true);
        ++x_late_;
        want = pagedkv::ExternalSignal::kLate;
      } else {
        want = x_classify_ended(fid);
      }
      expect(out.signal == want, std::string("complete_external_fill of a fill not live answered ") +
                                     pagedkv::to_string(out.signal) + ", expected " + pagedkv::to_string(want));
      return x_sync_and_check();
    }
    XFill f = std::move(it->second);
    x_fills_.erase(it);
    x_drop(f.blocks);
    x_ended_[fid] = true;
    expect(out.signal == pagedkv::ExternalSignal::kApplied && out.seq == f.seq && out.num_valid_blocks == valid &&
               out.sequence_failed == fails,
           "complete_external_fill of a live fill");
    if (fails) {
      check_after_release(want_lru, "a failed fill");
      return x_sync_and_check();
    }
    // The sequence joins the live ones: its hit and its valid fill blocks are computed, the rest pending.
    auto s = model_.make_seq(f.prompt, nullptr);
    s.slotted = f.prompt.size();
    s.built = valid == nb ? f.end_token : f.first_token + valid * bs;
    s.prompt_len = f.prompt.size();
    expect(out.num_computed_tokens == s.built, "num_computed_tokens " + std::to_string(out.num_computed_tokens) +
                                                   ", expected " + std::to_string(s.built));
    model_.add_seq(f.seq, std::move(s));
    model_.write_external(m(), f.seq, f.first_token, model_.seq(f.seq).built);
    x_sync_and_check();
  }

  void op_ext_abort(ByteReader& r) {
    const SeqId id = kExtFirstSeq + r.u8() % 4;
    const std::uint8_t mode = r.u8() % 4;
    static const char* const kNames[4] = {"abort_sequence(quiescent)", "abort_sequence", "free", "preempt"};
    log_.add(std::string("m.") + kNames[mode] + "(" + std::to_string(id) + ")");
    const std::uint64_t fid = x_fill_of(id);
    std::set<Errc> errs;
    if (fid == 0 && !model_.live(id)) errs.insert(Errc::kUnknownSequence);
    Blocks table, want_lru;
    if (fid != 0) table = x_fills_.at(fid).table;
    if (model_.live(id)) {
      const auto b = m().block_ids(id);
      table.assign(b.begin(), b.end());
    }
    if (errs.empty()) want_lru = model_.expected_lru_after_release(m(), table);
    if (!call(errs, std::to_string(id), [&] {
          if (mode < 2) {
            m().abort_sequence(id, mode == 0);
          } else if (mode == 2) {
            m().free(id);
          } else {
            m().preempt(id);
          }
        })) {
      return x_sync_and_check();
    }
    if (!errs.empty()) fail("an abort of a sequence that is not live succeeded");
    log_.result("ok");
    check_after_release(want_lru, kNames[mode]);
    if (mode == 3) model_.preempted_ids().insert(id);
    if (fid == 0) {
      model_.erase_seq(id);
      return x_sync_and_check();
    }
    XFill f = std::move(x_fills_.at(fid));
    x_fills_.erase(fid);
    if (mode == 0) {
      x_drop(f.blocks);
      x_ended_[fid] = false;
    } else {  // the references move to an orphan hold (its id is the next one)
      x_holds_.emplace(x_next_++, XHold{XKind::kOrphan, f.blocks,
                                        x_clock_ ? std::optional<std::int64_t>(x_now_ + kOrphanTimeout) : std::nullopt, fid});
    }
    expect(m().external_fill_of(id) == 0, "external_fill_of after an abort");
    x_sync_and_check();
  }

  void op_ext_lease(ByteReader& r, bool save) {
    SeqId id = 0;
    const auto* s = nth_live(r.u8(), &id);
    const auto deadline = x_deadline(r.u8());
    if (s == nullptr) return;
    log_.add(std::string(save ? "m.pin_for_save(" : "m.finish_with_lease(") + std::to_string(id) + ", " +
             (deadline ? std::to_string(*deadline) + "s" : std::string("none")) + ")");
    const auto tb = m().block_ids(id);
    const Blocks table(tb.begin(), tb.end());
    const std::size_t bs = model_.block_size();
    if (save) {
      Blocks pinned(table.begin(), table.begin() + static_cast<std::ptrdiff_t>(std::min(s->built, s->slotted) / bs));
      const std::uint64_t pin = m().pin_for_save(id, x_at(deadline));
      log_.result("pin " + std::to_string(pin));
      expect(pin == x_next_, "pin_for_save's id " + std::to_string(pin) + ", expected " + std::to_string(x_next_));
      x_take(pinned);
      x_holds_.emplace(x_next_++, XHold{XKind::kSavePin, std::move(pinned), deadline, 0});
      return x_sync_and_check();
    }
    std::set<Errc> errs;
    if (!model_.settled(m(), id) || (!model_.prefix_caching() && s->known() >= bs)) errs.insert(Errc::kInvalidArgument);
    pagedkv::HandoffDescriptor<Id> d;
    const auto layout = m().layout_fingerprint("nhd", "bf16", 8, 128);
    if (!call(errs, "finish_with_lease", [&] { d = m().finish_with_lease(id, layout, x_at(deadline)); })) {
      return x_sync_and_check();
    }
    if (!errs.empty()) fail("finish_with_lease succeeded, expected " + allowed_text(errs));
    log_.result("lease " + std::to_string(d.hold_id));
    expect(d.hold_id == x_next_ && d.num_tokens == s->known() && d.num_groups == 1 &&
               std::equal(d.blocks.begin(), d.blocks.end(), table.begin(), table.end()) &&
               d.identities.size() == s->known() / bs,
           "the hand-off descriptor");
    for (std::size_t i = 0; i < d.identities.size(); ++i) {
      expect(std::equal(s->hashes[i].bytes.begin(), s->hashes[i].bytes.end(), d.identities[i].begin()),
             "identity " + std::to_string(i) + " of the descriptor is not the block's hash");
    }
    x_take(table);
    x_issue(table, d.generations, "the hand-off descriptor");
    x_holds_.emplace(x_next_++, XHold{XKind::kLease, table, deadline, 0});
    // Every block stays referenced by the lease: the cached set does not change.
    check_after_release(model_.expected_lru_after_release(m(), {}), "finish_with_lease");
    model_.erase_seq(id);
    x_sync_and_check();
  }

  void op_ext_signal(ByteReader& r) {
    const std::uint64_t id = x_pick(r.u8());
    const std::uint8_t mode = r.u8() % 3;
    const auto deadline = mode == 2 ? x_deadline(r.u8()) : std::nullopt;
    static const char* const kNames[3] = {"release_lease", "end_save", "extend_lease"};
    log_.add(std::string("m.") + kNames[mode] + "(" + std::to_string(id) + ")");
    pagedkv::ExternalSignal want;
    Blocks want_lru;
    const auto it = x_holds_.find(id);
    if (it == x_holds_.end()) {
      want = x_classify_ended(id);
    } else if (it->second.kind == XKind::kOrphan) {
      ++x_unknown_;
      want = pagedkv::ExternalSignal::kUnknown;
    } else {
      want = pagedkv::ExternalSignal::kApplied;
      if (mode < 2) want_lru = model_.expected_lru_after_release(m(), it->second.blocks);
    }
    const auto got = mode == 0 ? m().release_lease(id) : mode == 1 ? m().end_save(id) : m().extend_lease(id, x_at(deadline));
    log_.result(pagedkv::to_string(got));
    expect(got == want, std::string(kNames[mode]) + " answered " + pagedkv::to_string(got) + ", expected " +
                            pagedkv::to_string(want));
    if (want == pagedkv::ExternalSignal::kApplied && mode == 2) it->second.deadline = deadline;
    if (want == pagedkv::ExternalSignal::kApplied && mode < 2) {
      x_end_hold(id, true);
      check_after_release(want_lru, kNames[mode]);
    }
    x_sync_and_check();
  }

  void op_ext_reap(ByteReader& r) {
    const std::uint8_t b = r.u8();
    const std::int64_t now = b < 224 ? x_now_ + b : x_now_ - (b - 223);
    log_.add("m.reap_external(" + std::to_string(now) + "s)");
    std::vector<std::uint64_t> ends;
    for (const auto& [id, h] : x_holds_) {
      if (h.deadline && *h.deadline <= now) ends.push_back(id);
    }
    const std::size_t n = m().reap_external(x_at(now));
    log_.result(std::to_string(n) + " ended");
    expect(n == ends.size(), "reap_external ended " + std::to_string(n) + " holds, expected " + std::to_string(ends.size()));
    for (auto id : ends) x_end_hold(id, false);
    x_now_ = x_clock_ ? std::max(x_now_, now) : now;
    x_clock_ = true;
    x_sync_and_check();
  }

  /// evict_cached_block: a registered block leaves the index at once (answer: whether it was registered); cached,
  /// it becomes free; held (a table, a pending copy, an external hold), it stays there, never matchable again, until
  /// its last release. An id outside [1, num_blocks) throws kBlockOutOfRange and changes nothing.
  void op_evict_block(ByteReader& r) {
    const std::uint8_t v = r.u8();
    const std::uint64_t nb = model_.usable() + 1;
    const std::uint64_t b = v < 250 ? 1 + v % model_.usable() : v == 250 ? 0 : nb + (v - 251);
    if (b > std::numeric_limits<Id>::max()) return;
    const Id id = static_cast<Id>(b);
    log_.add("m.evict_cached_block(" + std::to_string(b) + ")");
    if (b == 0 || b >= nb) {
      const bool returned = call({Errc::kBlockOutOfRange}, "block " + std::to_string(b), [&] {
        (void)m().evict_cached_block(id);
      });
      expect(!returned, "evict_cached_block(" + std::to_string(b) + ") of " + std::to_string(nb) +
                            " blocks returned instead of throwing kBlockOutOfRange");
      return;
    }
    const auto& a = m().allocator();
    const bool hashed = a.is_hashed(id);
    const bool held = a.refcount(id) != 0;
    const std::size_t index_size = m().prefix_index().size();
    const bool got = m().evict_cached_block(id);
    log_.result(got ? "true" : "false");
    expect(got == hashed, "evict_cached_block(" + std::to_string(b) + ") answered " + std::to_string(got) +
                              " for a block " + (hashed ? "registered" : "not registered"));
    expect(!a.is_hashed(id) && !m().prefix_index().hash_of(id) &&
               m().prefix_index().size() == index_size - (hashed ? 1 : 0),
           "block " + std::to_string(b) + " is still registered after evict_cached_block");
    expect(held == (a.refcount(id) != 0), "evict_cached_block changed block " + std::to_string(b) + "'s holders");
    if (hashed && held) model_.unkeyed.insert(b);
    if (hashed) ++model_.removed_by_id;
    x_sync_and_check();
  }

  void op_ext_stale(ByteReader& r) {
    const std::uint8_t b = r.u8();
    std::uint64_t blk;
    std::uint32_t gen;
    if (b < 250 && !x_issued_.empty()) {
      std::tie(blk, gen) = x_issued_[b % x_issued_.size()];
    } else {
      blk = b % (model_.usable() + 2), gen = b & 1;
    }
    if (blk > std::numeric_limits<Id>::max()) return;
    const bool want = blk != 0 && blk <= model_.usable() && blk < x_refs_.size() && x_refs_[blk] != 0 && x_gen_[blk] == gen;
    if (!want) ++x_stale_;
    log_.add("m.is_current_block(" + std::to_string(blk) + ", " + std::to_string(gen) + ")");
    const bool got = m().is_current_block(static_cast<Id>(blk), gen);
    log_.result(got ? "true" : "false");
    expect(got == want, "is_current_block(" + std::to_string(blk) + ", " + std::to_string(gen) + ") answered " +
                            std::to_string(got) + ": a stale reference must be refused, a held one served");
    x_sync_and_check();
  }

  /// check_claim of `entries` of a hold's blocks (or an ended / unknown id), with at most one fault; the expected
  /// answer is computed from the mirror, entry by entry (first block not in a live lease or pin, first stale one).
  void op_ext_claim(ByteReader& r) {
    const std::uint8_t pick = r.u8();  // < 192 with holds live: the (pick % holds)-th live hold; else any id
    std::uint64_t id = x_pick(pick);
    if (pick < 192 && !x_holds_.empty()) id = std::next(x_holds_.begin(), pick % x_holds_.size())->first;
    const std::size_t entries = r.u8() % 9;
    const std::uint8_t fault = r.u8() % 3;
    const std::uint8_t pos = r.u8();
    const auto it = x_holds_.find(id);
    std::vector<Id> blocks;
    std::vector<std::uint32_t> gens;
    if (it != x_holds_.end() && !it->second.blocks.empty()) {
      const Blocks& hb = it->second.blocks;
      for (std::size_t i = 0; i < entries; ++i) {
        const std::uint64_t b = hb[(pos + 7 * i) % hb.size()];
        blocks.push_back(static_cast<Id>(b));
        gens.push_back(x_gen_[b]);
      }
      if (!blocks.empty() && fault == 1) ++gens[pos % blocks.size()];
      if (!blocks.empty() && fault == 2) {
        for (std::uint64_t b = 1; b <= model_.usable(); ++b) {
          if (std::find(hb.begin(), hb.end(), b) == hb.end()) {
            blocks[pos % blocks.size()] = static_cast<Id>(b);
            break;
          }
        }
      }
    } else if (model_.usable() != 0) {
      for (std::size_t i = 0; i < entries; ++i) {
        blocks.push_back(static_cast<Id>(1 + (pos + i) % model_.usable()));
        gens.push_back(0);
      }
    }
    pagedkv::ClaimCheck want{pagedkv::ClaimStatus::kOk, blocks.size(), 0};
    if (it == x_holds_.end() || it->second.kind == XKind::kOrphan) {
      want = {pagedkv::ClaimStatus::kUnknownHold, 0, 0};
    } else {
      const Blocks& hb = it->second.blocks;
      for (std::size_t i = 0; i < blocks.size(); ++i) {
        if (std::find(hb.begin(), hb.end(), std::uint64_t{blocks[i]}) == hb.end()) {
          want = {pagedkv::ClaimStatus::kNotInHold, i, 0};
          break;
        }
        if (x_gen_[blocks[i]] != gens[i]) {
          want = {pagedkv::ClaimStatus::kStaleGeneration, i, x_gen_[blocks[i]]};
          ++x_stale_;
          break;
        }
      }
    }
    log_.add("m.check_claim(" + std::to_string(id) + ", " + std::to_string(blocks.size()) + " entries, fault " +
             std::to_string(fault) + ")");
    const pagedkv::ClaimCheck got = m().check_claim(id, blocks, gens);
    log_.result(std::string(pagedkv::to_string(got.status)) + " at " + std::to_string(got.entry));
    expect(got.status == want.status && got.entry == want.entry && got.current_generation == want.current_generation,
           std::string("check_claim answered ") + pagedkv::to_string(got.status) + " at entry " +
               std::to_string(got.entry) + ", expected " + pagedkv::to_string(want.status) + " at entry " +
               std::to_string(want.entry));
    x_sync_and_check();
  }

  /// Quiescence: every fill aborted (quiescent), every lease and save pin released, every orphan's late signal
  /// delivered. Afterwards nothing external holds a block (the drain's leak check covers it).
  void x_quiesce() {
    while (!x_fills_.empty()) {
      const SeqId seq = x_fills_.begin()->second.seq;
      const std::uint8_t args[2] = {static_cast<std::uint8_t>(seq - kExtFirstSeq), 0};
      ByteReader rr(std::span<const std::uint8_t>(args, 2));
      op_ext_abort(rr);
    }
    while (!x_holds_.empty()) {
      const auto& [id, h] = *x_holds_.begin();
      log_.add(h.kind == XKind::kOrphan ? "m.complete_external_fill(" + std::to_string(h.fill_id) + ", 0) (late)"
                                        : "m.release_lease(" + std::to_string(id) + ")");
      const auto got = h.kind == XKind::kOrphan ? m().complete_external_fill(h.fill_id, std::size_t{0}).signal
                                                : m().release_lease(id);
      if (h.kind == XKind::kOrphan) ++x_late_;
      expect(got == (h.kind == XKind::kOrphan ? pagedkv::ExternalSignal::kLate : pagedkv::ExternalSignal::kApplied),
             "the signal that ends a hold at quiescence");
      x_end_hold(id, true);
    }
    const auto c = m().stats().external;
    expect(c.fills_in_flight == 0 && c.holds_active == 0 && c.blocks_held == 0,
           "external KV holds blocks at quiescence");
  }

  std::map<std::uint64_t, XFill> x_fills_;    // live fills by id
  std::map<std::uint64_t, XHold> x_holds_;    // live leases, save pins, orphan holds by id
  std::map<std::uint64_t, bool> x_ended_;     // ended ids: true = by their own signal
  std::uint64_t x_next_ = 1;                  // the next fill or hold id
  std::vector<std::uint32_t> x_refs_, x_gen_;  // per block: external references, generation
  std::vector<std::pair<std::uint64_t, std::uint32_t>> x_issued_;  // (block, generation) pairs handed out
  std::int64_t x_now_ = 0;                    // the external clock (s)
  bool x_clock_ = false;                      // reap_external was called
  std::uint64_t x_late_ = 0, x_dup_ = 0, x_unknown_ = 0, x_stale_ = 0;

  std::unique_ptr<Mgr> m_;
  Model model_;
  CallLog& log_;
  std::chrono::nanoseconds clock_{0};  // the simulated retention clock (kExpireRetention)
};

// =================================================================================================================
template <class Mgr>
void run_with(const pagedkv::CacheConfig& c, bool expect_invalid, ByteReader& r, CallLog& log) {
  log.add("KVCacheManager<" + std::string(Mgr::hasher_type::kName) + ", uint" +
          std::to_string(8 * sizeof(typename Mgr::block_id_type)) +
          (ManagerModel<Mgr>::kHasRetention ? ", PriorityLruEviction, SlruEviction" : "") + ">({num_blocks " + std::to_string(c.num_blocks) +
          ", block_size " + std::to_string(c.block_size) + ", prefix caching " + std::to_string(c.enable_prefix_caching) +
          ", max_tokens_per_seq " + std::to_string(c.max_tokens_per_seq) + ", events " +
          std::to_string(c.enable_events) + "})");
  std::unique_ptr<Mgr> m;
  try {
    m = std::make_unique<Mgr>(c);
  } catch (const pagedkv::Error& e) {
    log.result(std::string("throws ") + errc_text(e.code()) + ": " + e.message());
    if (!expect_invalid) report_failure(log, "a valid configuration was refused");
    if (e.code() != Errc::kInvalidArgument && e.code() != Errc::kLimitExceeded) {
      report_failure(log, "an invalid configuration raised " + errc_text(e.code()));
    }
    return;
  }
  if (expect_invalid) report_failure(log, "an invalid configuration was accepted");
  Driver<Mgr> d(std::move(m), c, log);
  d.run(r);
}

}  // namespace driver_detail

/// Runs one input's operations on a manager of type Mgr built from `c` (`expect_invalid`: the configuration must be
/// refused). Instantiated in fuzz_manager_xxh3.cpp, fuzz_manager_sha256.cpp and fuzz_manager_retention.cpp.
template <class Mgr>
void run_manager_ops(const pagedkv::CacheConfig& c, bool expect_invalid, ByteReader& r, CallLog& log) {
  driver_detail::run_with<Mgr>(c, expect_invalid, r, log);
}

using XxhManager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t>;
using ShaSmallIdManager = pagedkv::KVCacheManager<pagedkv::Sha256Hasher, std::uint16_t>;
using RetentionManager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t, pagedkv::PriorityLruEviction<std::uint32_t>,
                                                 pagedkv::SlruEviction<std::uint32_t>>;
extern template void run_manager_ops<XxhManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);
extern template void run_manager_ops<ShaSmallIdManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);
extern template void run_manager_ops<RetentionManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);

}  // namespace pagedkv_fuzz
