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

#include <pagedkv/kv_cache_manager.hpp>

#include "byte_reader.hpp"
#include "manager_model.hpp"
#include "manager_ops.hpp"

// TODO(chunked admission): try_admit takes its cap in AdmitOptions once chunked admission lands; until then this
// fallback is found only when pagedkv does not declare AdmitOptions (a using-directive is searched after the
// namespace's own members), and call_try_admit passes the cap directly. Remove both once AdmitOptions is committed.
namespace pagedkv_fuzz_fallback {
struct AdmitOptions {
  std::optional<std::size_t> max_cached_tokens;
};
}  // namespace pagedkv_fuzz_fallback
namespace pagedkv {
using namespace pagedkv_fuzz_fallback;
}

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

// The manager's call signatures as they evolve: try_admit / lookup take the cap directly, or in AdmitOptions.
template <class Mgr>
pagedkv::AdmitResult call_try_admit(Mgr& m, SeqId id, std::span<const TokenId> prompt, const RequestKeys* keys,
                                    std::optional<std::size_t> cap) {
  if constexpr (requires { m.try_admit(id, prompt, keys, cap); }) {
    return m.try_admit(id, prompt, keys, cap);
  } else {
    pagedkv::AdmitOptions opts{};
    opts.max_cached_tokens = cap;
    return m.try_admit(id, prompt, keys, opts);
  }
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
      case Op::kAdmit: op_admit(r); break;
      case Op::kAppend: op_append(r); break;
      case Op::kFork: op_fork(r); break;
      case Op::kFree: op_free(r, false); break;
      case Op::kPreempt: op_free(r, true); break;
      case Op::kRewind: op_rewind(r); break;
      case Op::kLookup: op_lookup(r); break;
      case Op::kBuild: op_build(r, false); break;
      case Op::kStep: op_build(r, true); break;
      case Op::kReset: op_reset(); break;
      case Op::kQuery: op_query(r); break;
      case Op::kMove: op_move(); break;
      case Op::kDrainAll: drain_all(); break;
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

  // ---- admission ------------------------------------------------------------------------------------------------
  void op_admit(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const Toks prompt = decode_prompt(r);
    const std::shared_ptr<RequestKeys> keys_owned = decode_keys(r, prompt.size());
    const RequestKeys* keys = keys_owned.get();
    const auto cap = decode_cap(r, prompt.size());
    log_.add("m.try_admit(" + std::to_string(id) + ", " + toks_text(prompt) + ", " + keys_text(keys) + ", cap " +
             opt_text(cap) + ")");
    std::set<Errc> errs;
    std::string needle;
    if (model_.live(id)) errs.insert(Errc::kDuplicateSequence), needle = std::to_string(id);
    if (prompt.empty()) errs.insert(Errc::kInvalidArgument);
    if (prompt.size() > m().max_tokens_per_seq()) errs.insert(Errc::kLimitExceeded), needle = std::to_string(prompt.size());
    if (!keys_valid(keys, prompt.size())) errs.insert(Errc::kInvalidArgument);

    // Predict the outcome exactly.
    const std::size_t bs = model_.block_size();
    typename Model::MSeq s;
    std::vector<std::uint64_t> hit_blocks;
    pagedkv::AdmitStatus want = pagedkv::AdmitStatus::kAdmitted;
    std::size_t missing = 0;
    if (errs.empty()) {
      s = model_.make_seq(prompt, keys_owned);
      const std::size_t eff_cap = std::min(cap.value_or(prompt.size() - 1), prompt.size());
      std::size_t evictable_hits = 0;
      for (std::size_t i = 0; i < std::min(s.hashes.size(), eff_cap / bs); ++i) {
        const auto b = m().prefix_index().find(s.hashes[i]);
        if (!b) break;
        hit_blocks.push_back(*b);
        if (m().allocator().is_cached(*b)) ++evictable_hits;
      }
      const std::size_t total = model_.blocks_for(prompt.size());
      const std::size_t avail = m().allocator().num_available_blocks() - evictable_hits;
      if (total > model_.usable()) {
        want = pagedkv::AdmitStatus::kNeverFits;
        missing = total - model_.usable();
      } else if (total - hit_blocks.size() > avail) {
        want = pagedkv::AdmitStatus::kNoCapacity;
        missing = total - hit_blocks.size() - avail;
      }
      // lookup is pure and agrees with the admission's walk.
      const std::size_t looked = m().lookup(prompt, keys, cap);
      expect(looked == hit_blocks.size() * bs, "lookup says " + std::to_string(looked) + " cached tokens, the admission walk " +
                                                   std::to_string(hit_blocks.size() * bs));
    }
    const CacheStats st = m().stats();
    std::optional<typename Model::Snapshot> before;
    if (errs.empty() && want != pagedkv::AdmitStatus::kAdmitted) before.emplace(model_.snapshot(m()));
    pagedkv::AdmitResult res;
    if (!call(errs, needle, [&] { res = call_try_admit(m(), id, prompt, keys, cap); })) return;
    if (!errs.empty()) fail("try_admit succeeded, expected " + allowed_text(errs));
    log_.result("status " + std::to_string(static_cast<int>(res.status)) + ", cached " +
                std::to_string(res.num_cached_tokens) + ", new blocks " + std::to_string(res.num_new_blocks));
    expect(res.status == want, "try_admit status " + std::to_string(static_cast<int>(res.status)) + ", expected " +
                                   std::to_string(static_cast<int>(want)));
    expect(res.num_missing_blocks == missing, "num_missing_blocks " + std::to_string(res.num_missing_blocks) +
                                                  ", expected " + std::to_string(missing));
    if (want != pagedkv::AdmitStatus::kAdmitted) {
      expect(res.num_cached_tokens == 0 && res.num_new_blocks == 0, "a failed admission reports blocks");
      model_.expect_unchanged(m(), *before, "an admission answered no capacity / never fits");
      return;
    }
    const std::size_t hits = hit_blocks.size();
    expect(res.num_cached_tokens == hits * bs, "num_cached_tokens");
    expect(res.num_new_blocks == model_.blocks_for(prompt.size()) - hits, "num_new_blocks");
    const auto ids = m().block_ids(id);
    expect(ids.size() == model_.blocks_for(prompt.size()) && std::equal(hit_blocks.begin(), hit_blocks.end(), ids.begin()),
           "the admitted table does not start with the hit blocks");
    const CacheStats now = m().stats();
    expect(now.prefix_query_requests == st.prefix_query_requests + 1 &&
               now.prefix_query_tokens == st.prefix_query_tokens + prompt.size() &&
               now.prefix_hit_tokens == st.prefix_hit_tokens + hits * bs &&
               now.prefix_hit_requests == st.prefix_hit_requests + (hits > 0 ? 1 : 0),
           "prefix counters after an admission");
    s.pending = prompt.size() - hits * bs;
    model_.add_seq(id, std::move(s));
    model_.check_all(m());
  }

  // ---- append ---------------------------------------------------------------------------------------------------
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

  void op_append(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::size_t n = decode_append_len(r);
    const bool is_live = model_.live(id);
    const std::size_t len = is_live ? model_.seq(id).tokens.size() : 0;
    const Toks add = decode_tokens(r, len, n);
    log_.add("m.try_append(" + std::to_string(id) + ", " + toks_text(add) + ")");
    std::set<Errc> errs;
    std::string needle = std::to_string(id);
    if (!is_live) errs.insert(Errc::kUnknownSequence);
    if (is_live && len + n > m().max_tokens_per_seq()) errs.insert(Errc::kLimitExceeded);
    const std::size_t bs = model_.block_size();
    const auto& a = m().allocator();
    bool cow = false, never = false, fits = true;
    std::size_t nb = 0, need = 0, missing = 0;
    std::uint64_t old_last = 0;
    if (errs.empty()) {
      const auto blocks = m().block_ids(id);
      nb = blocks.size();
      old_last = nb > 0 ? blocks.back() : 0;
      cow = n > 0 && len % bs != 0 &&
            (a.refcount(blocks.back()) - Model::pins(m(), blocks.back()) > 1 || a.is_hashed(blocks.back()));
      const bool hashed_partial = cow && a.is_hashed(blocks.back());
      const std::size_t new_blocks = model_.blocks_for(len + n) - nb;
      need = new_blocks + (cow ? 1 : 0);
      const std::size_t held_after = nb + new_blocks + (hashed_partial ? 1 : 0);
      never = n > 0 && held_after > model_.usable();
      fits = need <= a.num_available_blocks();
      missing = never ? held_after - model_.usable() : fits ? 0 : need - a.num_available_blocks();
    }
    const CacheStats st = m().stats();
    std::optional<typename Model::Snapshot> before;
    if (errs.empty() && (never || !fits || n == 0)) before.emplace(model_.snapshot(m()));
    std::optional<pagedkv::AppendResult<Id>> res;
    if (!call(errs, needle, [&] { res.emplace(m().try_append(id, add)); })) return;
    if (!errs.empty()) fail("try_append succeeded, expected " + allowed_text(errs));
    log_.result("status " + std::to_string(static_cast<int>(res->status)) + (res->copy ? ", copy " + std::to_string(res->copy->src) + "->" + std::to_string(res->copy->dst) : ""));
    if (never) {
      expect(res->status == pagedkv::AppendStatus::kNeverFits, "try_append status " +
                                                                   std::to_string(static_cast<int>(res->status)) +
                                                                   ", expected kNeverFits (the pool can never hold it)");
    } else if (!fits) {
      expect(res->status == pagedkv::AppendStatus::kNoCapacity, "try_append status " +
                                                                    std::to_string(static_cast<int>(res->status)) +
                                                                    ", expected kNoCapacity");
    } else {
      expect(res->status == pagedkv::AppendStatus::kOk, "try_append status " + std::to_string(static_cast<int>(res->status)) +
                                                            ", expected kOk");
    }
    expect(res->num_missing_blocks == missing, "num_missing_blocks " + std::to_string(res->num_missing_blocks) +
                                                   ", expected " + std::to_string(missing));
    if (res->status != pagedkv::AppendStatus::kOk || n == 0) {
      expect(res->slots.empty() && !res->copy, "a failed or empty append reports slots or a copy");
      expect(before.has_value(), "try_append status " + std::to_string(static_cast<int>(res->status)) + " unexpected");
      model_.expect_unchanged(m(), *before, n == 0 ? "an empty append" : "an append answered no capacity / never fits");
      return;
    }
    expect(res->slots.size() == n, "append returned " + std::to_string(res->slots.size()) + " slots for " + std::to_string(n) + " tokens");
    const Slots got(res->slots.begin(), res->slots.end());
    const CacheStats now = m().stats();
    expect(now.cow_copies == st.cow_copies + (cow ? 1 : 0), "cow_copies counter");
    expect(now.dedup_blocks == st.dedup_blocks, "deduplication outside a build");
    expect(now.blocks_cached + now.blocks_free + need == st.blocks_cached + st.blocks_free, "blocks taken by an append");
    const auto after = m().block_ids(id);
    if (cow) {
      expect(res->copy.has_value() && res->copy->src == old_last && after[nb - 1] == res->copy->dst,
             "copy-on-write of the shared / hashed partial last block");
      expect(!m().pending_copies().empty() && m().pending_copies().back() == *res->copy, "the copy is pending");
    } else {
      expect(!res->copy, "an append copied a block it may write in place");
    }
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t p = len + j;
      const std::int64_t want = static_cast<std::int64_t>(after[p / bs]) * bs + static_cast<std::int64_t>(p % bs);
      expect(got[j] == want, "append slot of position " + std::to_string(p));
    }
    auto& s = model_.mutable_seq(id);
    model_.extend(s, add);
    s.pending += n;
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
    // A parent with unbuilt slots or a pending copy into its table is not settled: its child would read K/V no
    // build has written, or chain copies in one build.
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
    auto c = model_.seq(parent);
    c.pending = 0;
    model_.add_seq(child, std::move(c));
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
    const auto lru = m().allocator().eviction_policy().order();
    expect(Blocks(lru.begin(), lru.end()) == want_lru, "LRU order after release (tail first, through pending copies)");
    model_.erase_seq(id);
    model_.check_all(m());
  }

  void op_rewind(ByteReader& r) {
    const SeqId id = seq_id(r.u8());
    const std::uint8_t b = r.u8();
    const bool is_live = model_.live(id);
    const std::size_t len = is_live ? model_.seq(id).tokens.size() : 0;
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
    std::size_t keep = 0;
    if (errs.empty()) {
      const auto bl = m().block_ids(id);
      blocks.assign(bl.begin(), bl.end());
      keep = model_.blocks_for(len - n);
      want_lru = model_.expected_lru_after_release(m(), Blocks(blocks.begin() + static_cast<std::ptrdiff_t>(keep), blocks.end()));
    }
    if (!call(errs, needle, [&] { m().rewind(id, n); })) return;
    if (!errs.empty()) fail("rewind succeeded, expected " + allowed_text(errs));
    log_.result("ok");
    const auto lru = m().allocator().eviction_policy().order();
    expect(Blocks(lru.begin(), lru.end()) == want_lru, "LRU order after rewind");
    const auto after = m().block_ids(id);
    expect(std::equal(after.begin(), after.end(), blocks.begin(), blocks.begin() + static_cast<std::ptrdiff_t>(keep)) &&
               after.size() == keep,
           "rewind kept other blocks than the leading ones");
    auto& s = model_.mutable_seq(id);
    model_.truncate(s, len - n);
    s.pending -= std::min(n, s.pending);
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
    if (is_live) expect(n == model_.seq(id).tokens.size(), "num_tokens");
  }

  // ---- builds -----------------------------------------------------------------------------------------------------
  void op_build(ByteReader& r, bool engine_step) {
    std::vector<SeqId> live;
    for (const auto& [id, s] : model_.seqs()) live.push_back(id);
    std::vector<SeqId> batch;
    std::uint8_t omit = 0, pad = 0, fault = 0;
    if (engine_step) {
      batch = live;
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
          batch = live;
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
    for (SeqId id : batch) {
      if (!model_.live(id)) {
        errs.insert(Errc::kUnknownSequence);
        continue;
      }
      if (!seen.insert(id).second) errs.insert(Errc::kInvalidArgument);
      total_blocks += model_.blocks_for(model_.seq(id).tokens.size());
      total_slots += model_.seq(id).pending;
      max_row = std::max(max_row, model_.blocks_for(model_.seq(id).tokens.size()));
    }
    const std::size_t B = batch.size();
    const std::size_t num_copies = m().pending_copies().size();
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
            std::to_string(have[6]) + " copies " + std::to_string(have[7]) + ")";
    log_.add(text);

    const auto pre = errs.empty() ? model_.capture_build_pre(m(), batch) : typename Model::BuildPre{};
    pagedkv::BatchMetadataSizes sz;
    if (!call(errs, "", [&] { sz = m().build_batch_metadata(batch, buf); })) return;
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
    for (const auto& [id, s] : model_.seqs()) expect(s.tokens.empty(), "a live sequence with tokens and no block");
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
    std::vector<SeqId> ids;
    for (const auto& [id, s] : model_.seqs()) ids.push_back(id);
    for (SeqId id : ids) {
      log_.add("m.free(" + std::to_string(id) + ")");
      m().free(id);
      model_.erase_seq(id);
    }
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

  std::unique_ptr<Mgr> m_;
  Model model_;
  CallLog& log_;
};

// =================================================================================================================
template <class Mgr>
void run_with(const pagedkv::CacheConfig& c, bool expect_invalid, ByteReader& r, CallLog& log) {
  log.add("KVCacheManager<" + std::string(Mgr::hasher_type::kName) + ", uint" +
          std::to_string(8 * sizeof(typename Mgr::block_id_type)) + ">({num_blocks " + std::to_string(c.num_blocks) +
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
/// refused). Instantiated in fuzz_manager_xxh3.cpp and fuzz_manager_sha256.cpp.
template <class Mgr>
void run_manager_ops(const pagedkv::CacheConfig& c, bool expect_invalid, ByteReader& r, CallLog& log) {
  driver_detail::run_with<Mgr>(c, expect_invalid, r, log);
}

using XxhManager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher, std::uint32_t>;
using ShaSmallIdManager = pagedkv::KVCacheManager<pagedkv::Sha256Hasher, std::uint16_t>;
extern template void run_manager_ops<XxhManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);
extern template void run_manager_ops<ShaSmallIdManager>(const pagedkv::CacheConfig&, bool, ByteReader&, CallLog&);

}  // namespace pagedkv_fuzz
