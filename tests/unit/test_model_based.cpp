// Randomized model-based test of the host core (KVCacheManager over BlockAllocator, BlockTable, PrefixHashIndex).
//
// Random operations -- admit (prompts drawn from a few shared prefixes, so prefix hits and deduplication happen;
// sometimes chunked: only the first chunk reserved), reserve the next prompt chunk, append 1..20 tokens, reserve
// lookahead slots for draft tokens and commit a random accepted prefix of them, fork, free, preempt, rewind,
// lookup, build_batch_metadata (each sequence scheduled all or a random part of its pending positions),
// reset_prefix_cache, and misuse (unknown and duplicate ids, rewind too far, append past the limit or before the
// prompt is reserved, fork of an unsettled parent, bad batches) -- run on small pools so that "no capacity" and
// eviction are frequent. After EVERY operation the manager is compared with a plain model (sequence -> known
// token list, drafts, fingerprints, chain hashes, slotted and built cursors) and these invariants are checked:
//  - num_tokens, token_ids, block count = ceil(len / block_size), no null block in any table;
//  - refcount(b) = number of live tables holding b + number of pending copies reading b;
//  - every usable block is exactly one of free / cached / held, and the counts match stats();
//  - hashed <=> registered in the index; a registered full block of a live sequence is registered under the chain
//    hash of the sequence's own tokens (and keys); after a build (or a lookahead commit), every full block whose
//    writes are issued and whose ids are known is registered, or switched to the registered duplicate (its slots
//    -1 in the slot mapping); a block holding a lookahead position never is;
//  - pending slots point at the sequence's own positions [built, slotted);
//  - no block is both a source and a destination of one build's copy list;
//  - expected outcomes are predicted exactly (admission: hits, no capacity, never fits; append: copy, capacity),
//    failed operations and every misuse leave a full state snapshot unchanged, with the documented error code;
//  - release order (tail first, through pending copies) is reproduced in the LRU order;
//  - events: seq_no +1 each, index size and eviction counter agree with stored/removed events;
//  - periodically, and at the end, after freeing everything and building an empty batch: no block leaked.
// In "engine discipline" runs (every build covers all live sequences; a sequence is forked only when settled), a
// shadow KV pool executes each built step as the kernels would (the copy list, then the slot mapping) and checks
// that every built position of every live sequence reads the K/V of its own token prefix (a fingerprint; draft
// positions the fingerprint of the draft), i.e. prefix hits, deduplication, copy-on-write, chunked prefill,
// lookahead commits, and freeing or preempting sequences whose step never ran never serve wrong content.
//
// Seeds are fixed and printed. Six configurations per hasher (block sizes 1, 4, 16; free-form / engine discipline)
// plus one without prefix caching.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <pagedkv/error.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

namespace {

using pagedkv::AdmitStatus;
using pagedkv::AppendStatus;
using pagedkv::BlockHash;
using pagedkv::CacheStats;
using pagedkv::Errc;
using pagedkv::KVEvent;
using pagedkv::KVEventType;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Toks = std::vector<TokenId>;
using Ids = std::vector<std::uint32_t>;
using Slots = std::vector<std::int64_t>;

std::uint64_t mix64(std::uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

auto stats_tuple(const CacheStats& s) {
  return std::make_tuple(s.num_usable_blocks, s.blocks_used, s.blocks_cached, s.blocks_free, s.usage,
                         s.prefix_query_requests, s.prefix_hit_requests, s.prefix_query_tokens, s.prefix_hit_tokens,
                         s.evictions, s.cow_copies, s.dedup_blocks, s.preemptions, s.block_ops);
}

struct Snapshot {
  decltype(stats_tuple(CacheStats{})) stats;
  std::map<SeqId, std::tuple<Ids, std::size_t, Toks, Slots>> seqs;
  std::vector<std::pair<std::uint32_t, std::uint32_t>> copies;
  std::vector<std::tuple<std::uint32_t, bool, bool, std::optional<BlockHash>>> blocks;
  Ids lru;
  std::size_t index_size = 0;
  friend bool operator==(const Snapshot&, const Snapshot&) = default;
};

struct Options {
  const char* name;
  std::uint32_t block_size;
  std::size_t num_blocks;
  std::size_t max_tokens_per_seq;
  bool engine_discipline;  // shadow-KV content checks; see the file comment
  bool prefix_caching;
  std::uint64_t seed;
  std::size_t ops;
  std::size_t host_blocks = 0;  // host tier (0 = none): offload, onboarding, swap preemption, late acknowledgements
  pagedkv::OffloadPolicy offload = pagedkv::OffloadPolicy::kWriteBack;
};

struct Counters {
  std::uint64_t admitted = 0, admit_hits = 0, no_capacity = 0, never_fits = 0, appends = 0, append_no_capacity = 0,
                append_never_fits = 0, fork_refused = 0, chunked_admits = 0, reserves = 0, lookaheads = 0,
                commits = 0, accepted_drafts = 0, rejected_drafts = 0, partial_builds = 0, host_hits = 0,
                swaps = 0, swap_refused = 0, resumes = 0, resume_pending = 0, acks = 0, swapped_content_checks = 0,
                cow = 0, forks = 0, frees = 0, preempts = 0, rewinds = 0, lookups = 0, builds = 0, resets_ok = 0,
                resets_refused = 0, misuse = 0, leak_checks = 0, content_checks = 0, dedups = 0,
                batch_copies = 0, kept_copies = 0;
  std::uint64_t checks = 0;  // individual invariant comparisons
};

template <class Hasher>
class Harness {
 public:
  using Mgr = pagedkv::KVCacheManager<Hasher>;

  explicit Harness(const Options& o)
      : o_(o), bs_(o.block_size), rng_(o.seed), m_(make_config(o)), ref_(2, kHashSeed) {
    usable_ = o.num_blocks - 1;
    const std::size_t base_len = std::max<std::size_t>(6 * bs_, 24);
    for (int i = 0; i < 4; ++i) {
      Toks b(base_len);
      for (auto& t : b) t = static_cast<TokenId>(rng_() % 1000);
      bases_.push_back(b);
    }
    // Extra keys: none, two salts, an adapter, two images at the same place, an image in the second block.
    keys_.resize(7);
    keys_[1].salt = "tenant-A";
    keys_[2].salt = "tenant-B";
    keys_[3].adapter_id = 7;
    keys_[4].multimodal.push_back({hash_of_u64(0xA), 2, 3});
    keys_[5].multimodal.push_back({hash_of_u64(0xB), 2, 3});
    keys_[6].multimodal.push_back({hash_of_u64(0xA), bs_ + 1, 2});
    kv_.assign(o.num_blocks * bs_, 0);
    hkv_.assign(o.host_blocks * bs_, 0);
  }

  Counters run() {
    last_stats_ = m_.stats();
    for (step_ = 0; step_ < o_.ops; ++step_) {
      const auto r = rng_() % 1000;
      if (r < 170) {
        op_admit();
      } else if (r < 360) {
        op_append();
      } else if (r < 400) {
        op_reserve();
      } else if (r < 430) {
        op_lookahead();
      } else if (r < 450) {
        op_commit();
      } else if (r < 520) {
        op_fork();
      } else if (r < 600) {
        op_free(false);
      } else if (r < 640) {
        op_free(true);
      } else if (r < 700) {
        op_rewind();
      } else if (r < 740) {
        op_lookup();
      } else if (r < 870) {
        op_build();
      } else if (r < 880) {
        op_reset();
      } else if (o_.host_blocks != 0 && r < 920) {
        op_ack();
      } else if (o_.host_blocks != 0 && r < 935) {
        op_swap();
      } else if (o_.host_blocks != 0 && r < 955) {
        op_resume();
      } else {
        op_misuse();
      }
      check_all();
      recent_ops_.push_back(std::to_string(step_) + ": " + op_);
      if (recent_ops_.size() > 25) recent_ops_.pop_front();
      if (step_ % 2500 == 2499) drain_all_and_check_no_leak();
    }
    drain_all_and_check_no_leak();
    return c_;
  }

 private:
  static constexpr std::uint64_t kHashSeed = 0x5eed;

  struct MSeq {
    Toks tokens;                    // known token ids
    int keys = 0;
    std::vector<BlockHash> hashes;  // chain hashes of the full blocks of `tokens`
    std::vector<std::uint64_t> fp;  // fingerprint of the K/V at each known position (prefix and keys)
    Toks drafts;                    // lookahead: draft ids the manager does not know, after `tokens`
    std::vector<std::uint64_t> dfp; // their fingerprints
    std::size_t slotted = 0;        // positions with slots
    std::size_t built = 0;          // positions whose writes a build issued (or cache hits)
    [[nodiscard]] std::size_t pending() const { return slotted - built; }
    [[nodiscard]] std::size_t unslotted() const { return drafts.empty() ? tokens.size() - std::min(tokens.size(), slotted) : 0; }
    [[nodiscard]] std::size_t length() const { return tokens.size() + drafts.size(); }
  };

  static pagedkv::CacheConfig make_config(const Options& o) {
    pagedkv::CacheConfig c;
    c.num_blocks = o.num_blocks;
    c.block_size = o.block_size;
    c.enable_prefix_caching = o.prefix_caching;
    c.hash_seed = kHashSeed;
    c.max_tokens_per_seq = o.max_tokens_per_seq;
    c.enable_events = true;
    c.num_host_blocks = o.host_blocks;
    c.offload = o.offload;
    return c;
  }

  static BlockHash hash_of_u64(std::uint64_t v) {
    BlockHash h;
    for (int i = 0; i < 16; ++i) h.bytes[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(mix64(v + static_cast<std::uint64_t>(i / 8)) >> (8 * (i % 8)));
    return h;
  }

  // ---- failure reporting -------------------------------------------------------------------------------------
  [[noreturn]] void fail(int line, const char* cond, const std::string& detail = {}) const {
    char head[256];
    std::snprintf(head, sizeof head, "model-based [%s, %s, seed %#" PRIx64 "] step %zu (%s): line %d: ", o_.name,
                  Hasher::kName, o_.seed, step_, op_.c_str(), line);
    std::string recent;
    for (const auto& r : recent_ops_) recent += "\n    " + r;
    throw std::runtime_error(std::string(head) + cond + (detail.empty() ? "" : " -- " + detail) +
                             "\n  recent operations (oldest first):" + recent);
  }
#define MB_CHECK(cond)                   \
  do {                                   \
    ++c_.checks;                         \
    if (!(cond)) fail(__LINE__, #cond);  \
  } while (0)
#define MB_CHECK_MSG(cond, msg)               \
  do {                                        \
    ++c_.checks;                              \
    if (!(cond)) fail(__LINE__, #cond, msg);  \
  } while (0)

  // ---- model helpers -----------------------------------------------------------------------------------------
  const RequestKeys* keys_ptr(int k) const { return k == 0 ? nullptr : &keys_[static_cast<std::size_t>(k)]; }

  std::uint64_t fp_seed(int k) const {
    const RequestKeys& keys = keys_[static_cast<std::size_t>(k)];
    std::uint64_t s = mix64(keys.adapter_id + 0x1234);
    for (char ch : keys.salt) s = mix64(s ^ static_cast<unsigned char>(ch));
    return s;
  }

  // Fingerprint of token `t` at position `p` after the fingerprint `prev` (the K/V depends on the whole prefix).
  std::uint64_t next_fp(const MSeq& s, std::uint64_t prev, std::size_t p, TokenId t) const {
    const RequestKeys& keys = keys_[static_cast<std::size_t>(s.keys)];
    std::uint64_t f = p == 0 ? fp_seed(s.keys) : prev;
    f = mix64(f ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(t)) * 0x100000001b3ULL));
    for (const auto& mm : keys.multimodal) {
      if (p >= mm.offset_tokens && p < mm.offset_tokens + mm.length_tokens) f = mix64(f ^ mm.item_hash.low64());
    }
    return f;
  }

  // Appends `add` to the model sequence's known tokens: fingerprints, chain hashes of newly full blocks.
  void extend(MSeq& s, std::span<const TokenId> add) const {
    for (TokenId t : add) {
      const std::size_t p = s.tokens.size();
      s.fp.push_back(next_fp(s, p == 0 ? 0 : s.fp[p - 1], p, t));
      s.tokens.push_back(t);
    }
    if (o_.prefix_caching) {
      const std::size_t before = s.hashes.size();
      ref_.hash_full_blocks(s.tokens, bs_, keys_ptr(s.keys), s.hashes);
      for (std::size_t i = before; i < s.hashes.size(); ++i) {  // the K/V every block with this hash must hold
        content_of_[s.hashes[i]].assign(s.fp.begin() + static_cast<std::ptrdiff_t>(i * bs_),
                                        s.fp.begin() + static_cast<std::ptrdiff_t>((i + 1) * bs_));
      }
    }
  }

  // The fingerprint the K/V at position p holds once written: known token, or draft.
  std::uint64_t fp_at(const MSeq& s, std::size_t p) const {
    return p < s.tokens.size() ? s.fp[p] : s.dfp[p - s.tokens.size()];
  }

  void truncate(MSeq& s, std::size_t len) const {
    s.tokens.resize(len);
    s.fp.resize(len);
    s.hashes.resize(std::min(s.hashes.size(), len / bs_));
  }

  std::size_t blocks_for(std::size_t len) const { return (len + bs_ - 1) / bs_; }

  // Whether keys `k` are valid for a prompt of `len` tokens (every multimodal item inside it).
  bool keys_valid(int k, std::size_t len) const {
    for (const auto& mm : keys_[static_cast<std::size_t>(k)].multimodal) {
      if (mm.offset_tokens + mm.length_tokens > len) return false;
    }
    return true;
  }

  // Whether `id` may be forked or swapped: every known token slotted and built, no lookahead, no pending copy into
  // its table, no host -> device copy filling one of its blocks.
  bool settled(SeqId id) const {
    if (!settled_state(id)) return false;
    for (std::uint32_t b : m_.block_ids(id)) {
      if (fill_pins(b) != 0) return false;
    }
    return true;
  }
  // SequenceState::settled: the same without the host -> device copies.
  bool settled_state(SeqId id) const {
    const MSeq& s = model_.at(id);
    if (s.pending() != 0 || s.slotted != s.tokens.size() || !s.drafts.empty()) return false;
    const auto blocks = m_.block_ids(id);
    for (const auto& c : m_.pending_copies()) {
      if (std::find(blocks.begin(), blocks.end(), c.dst) != blocks.end()) return false;
    }
    return true;
  }

  // Host -> device copies (queued or in flight) filling device block b: each holds one reference on it.
  std::uint32_t fill_pins(std::uint32_t b) const {
    std::uint32_t n = 0;
    for (const auto& t : m_.transfers().queued()) n += !pagedkv::is_device_to_host(t.kind) && t.device == b;
    for (const auto& t : m_.transfers().in_flight()) n += !pagedkv::is_device_to_host(t.kind) && t.device == b;
    return n;
  }

  // Of those, the fills that register nothing when they complete (no hash): not holders for copy-on-write.
  std::uint32_t unkeyed_fill_pins(std::uint32_t b) const {
    std::uint32_t n = 0;
    for (const auto& t : m_.transfers().queued()) n += !pagedkv::is_device_to_host(t.kind) && t.device == b && !t.hashed;
    for (const auto& t : m_.transfers().in_flight()) {
      n += !pagedkv::is_device_to_host(t.kind) && t.device == b && !t.hashed;
    }
    return n;
  }

  // Pending copies reading block b (each holds a reference; they do not count as holders for copy-on-write).
  std::uint32_t pins(std::uint32_t b) const {
    std::uint32_t n = 0;
    for (const auto& c : m_.pending_copies()) n += c.src == b ? 1U : 0U;
    return n;
  }

  SeqId pick_live(bool need_settled) {
    std::vector<SeqId> ids;
    for (const auto& [id, s] : model_) {
      if (!need_settled || settled(id)) ids.push_back(id);
    }
    if (ids.empty()) return 0;
    return ids[rng_() % ids.size()];
  }
  bool live_exists(bool need_settled) {
    for (const auto& [id, s] : model_) {
      if (!need_settled || settled(id)) return true;
    }
    return false;
  }
  // A live sequence satisfying `pred`, or 0 (ids start at 1).
  template <class P>
  SeqId pick_where(P&& pred) {
    std::vector<SeqId> ids;
    for (const auto& [id, s] : model_) {
      if (pred(s)) ids.push_back(id);
    }
    return ids.empty() ? 0 : ids[rng_() % ids.size()];
  }
  SeqId unknown_id() {
    if (!dead_ids_.empty() && rng_() % 2 == 0) return dead_ids_[rng_() % dead_ids_.size()];
    return next_id_ + 1000 + rng_() % 1000;
  }

  Toks gen_prompt() {
    if (rng_() % 25 == 0) return {};  // an empty prompt: a sequence with no token yet (appends, lookahead)
    if (rng_() % 50 == 0) {  // a huge prompt: never fits where the limit allows it, else the largest legal one
      const std::size_t n = std::min(o_.max_tokens_per_seq, usable_ * bs_ + 1 + rng_() % bs_);
      Toks p(n);
      for (auto& t : p) t = static_cast<TokenId>(rng_() % 4);
      return p;
    }
    Toks p;
    if (!model_.empty() && rng_() % 5 == 0) {  // a live sequence's tokens (a prefix of them), e.g. a re-admission
      const auto& s = model_.at(pick_live(false));
      p.assign(s.tokens.begin(), s.tokens.begin() + static_cast<std::ptrdiff_t>(rng_() % (s.tokens.size() + 1)));
    } else {
      const Toks& base = bases_[rng_() % bases_.size()];
      p.assign(base.begin(), base.begin() + static_cast<std::ptrdiff_t>(rng_() % (base.size() + 1)));
    }
    const std::size_t extra = rng_() % (2 * bs_ + 1);
    for (std::size_t i = 0; i < extra; ++i) p.push_back(static_cast<TokenId>(rng_() % 4));
    if (p.empty()) p.push_back(static_cast<TokenId>(rng_() % 4));
    if (p.size() > o_.max_tokens_per_seq) p.resize(o_.max_tokens_per_seq);
    return p;
  }

  // Decode tokens: a deterministic continuation of the position (so equal sequences grow equal blocks and
  // deduplicate), or a small alphabet.
  Toks gen_decode(std::size_t from_pos, std::size_t n) {
    Toks t(n);
    const bool continuation = rng_() % 2 == 0;
    for (std::size_t i = 0; i < n; ++i) {
      t[i] = continuation ? static_cast<TokenId>(((from_pos + i) * 7 + 3) % 5) : static_cast<TokenId>(rng_() % 4);
    }
    return t;
  }

  // ---- snapshots ---------------------------------------------------------------------------------------------
  Snapshot snapshot() const {
    Snapshot s;
    s.stats = stats_tuple(m_.stats());
    m_.for_each_sequence([&](SeqId id, std::span<const std::uint32_t> blocks, std::size_t n) {
      const auto t = m_.token_ids(id);
      const auto p = m_.pending_slots(id);
      s.seqs[id] = {Ids(blocks.begin(), blocks.end()), n, Toks(t.begin(), t.end()), Slots(p.begin(), p.end())};
    });
    for (const auto& c : m_.pending_copies()) s.copies.emplace_back(c.src, c.dst);
    const auto& a = m_.allocator();
    for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
      s.blocks.emplace_back(a.refcount(b), a.is_hashed(b), a.is_cached(b), m_.prefix_index().hash_of(b));
    }
    s.lru = a.eviction_policy().order();
    s.index_size = m_.prefix_index().size();
    return s;
  }

  // Runs `f`, which must throw pagedkv::Error(code) and change nothing.
  template <class F>
  void expect_misuse(F&& f, Errc code, const std::string& needle) {
    ++c_.misuse;
    const Snapshot before = snapshot();
    try {
      f();
    } catch (const pagedkv::Error& e) {
      MB_CHECK_MSG(e.code() == code, std::string("got ") + pagedkv::to_string(e.code()) + ": " + e.message());
      MB_CHECK_MSG(e.message().find(needle) != std::string::npos, "message '" + e.message() + "' lacks '" + needle + "'");
      MB_CHECK(snapshot() == before);
      return;
    }
    fail(__LINE__, "expected pagedkv::Error", pagedkv::to_string(code));
  }

  // Expected LRU order after releasing `blocks` (tail first) through the manager: a block that drops to refcount 0
  // enters the LRU list if hashed; a released block that is the destination of a pending copy drops that copy and
  // releases its source the same way.
  Ids expected_lru_after_release(const std::vector<std::uint32_t>& blocks) const {
    const auto& a = m_.allocator();
    Ids lru = a.eviction_policy().order();
    std::vector<std::uint32_t> rc(a.num_blocks());
    for (std::uint32_t b = 1; b < a.num_blocks(); ++b) rc[b] = a.refcount(b);
    std::vector<std::pair<std::uint32_t, std::uint32_t>> copies;
    for (const auto& c : m_.pending_copies()) copies.emplace_back(c.src, c.dst);
    std::function<void(std::uint32_t)> release = [&](std::uint32_t b) {
      --rc[b];
      if (rc[b] != 0) return;
      if (a.is_hashed(b)) lru.push_back(b);
      for (std::size_t i = 0; i < copies.size(); ++i) {
        if (copies[i].second == b) {
          const auto src = copies[i].first;
          copies.erase(copies.begin() + static_cast<std::ptrdiff_t>(i));
          release(src);
          return;
        }
      }
    };
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) release(*it);
    return lru;
  }

  // ---- operations ----------------------------------------------------------------------------------------------
  void op_admit() {
    if (model_.size() >= 20) return op_build();
    // Sometimes re-admit a preempted sequence id (recompute), which the statistics count apart.
    SeqId id = next_id_;
    bool readmission = false;
    if (!preempted_ids_.empty() && rng_() % 3 == 0) {
      const std::size_t i = rng_() % preempted_ids_.size();
      id = preempted_ids_[i];
      preempted_ids_.erase(preempted_ids_.begin() + static_cast<std::ptrdiff_t>(i));
      readmission = true;
    } else {
      ++next_id_;
    }
    const Toks prompt = gen_prompt();
    const int k = rng_() % 4 == 0 ? static_cast<int>(1 + rng_() % 6) : 0;
    pagedkv::AdmitOptions opts;
    if (rng_() % 7 == 0) opts.max_cached_tokens = rng_() % (prompt.size() + 2);
    if (rng_() % 4 == 0) opts.num_reserved_tokens = rng_() % (prompt.size() + 1);  // chunked admission
    const auto& cap = opts.max_cached_tokens;
    op_ = "admit " + std::to_string(id) + " len " + std::to_string(prompt.size()) + " keys " + std::to_string(k) +
          (cap ? " cap " + std::to_string(*cap) : "") +
          (opts.num_reserved_tokens ? " chunk " + std::to_string(*opts.num_reserved_tokens) : "") +
          (readmission ? " (re-admission)" : "");

    const auto put_back = [&] {  // a failed re-admission stays preempted
      if (readmission) preempted_ids_.push_back(id);
    };
    if (!keys_valid(k, prompt.size())) {  // a multimodal item outside the prompt: a typed error, nothing changes
      put_back();
      return expect_misuse([&] { m_.try_admit(id, prompt, keys_ptr(k), opts); }, Errc::kInvalidArgument,
                           "multimodal item");
    }
    // Predict the outcome exactly.
    MSeq s;
    s.keys = k;
    extend(s, prompt);
    const std::size_t eff_cap = std::min(cap.value_or(prompt.size() - 1), prompt.size());
    Ids hit_blocks;  // device hits; 0 where the host tier serves the block
    std::size_t evictable_hits = 0, host_hits = 0;
    for (std::size_t i = 0; i < std::min(s.hashes.size(), eff_cap / bs_); ++i) {
      const auto b = m_.prefix_index().find(s.hashes[i]);
      if (b) {
        hit_blocks.push_back(*b);
        if (m_.allocator().is_cached(*b)) ++evictable_hits;
        continue;
      }
      if (m_.host_tier() != nullptr && m_.host_tier()->find_ready(s.hashes[i])) {
        hit_blocks.push_back(0);
        ++host_hits;
        continue;
      }
      break;
    }
    const std::size_t total = blocks_for(prompt.size());
    const std::size_t hits = hit_blocks.size();
    const std::size_t cached = hits * bs_;
    const std::size_t reserved = std::min(opts.num_reserved_tokens.value_or(prompt.size()), prompt.size() - cached);
    const std::size_t new_blocks = blocks_for(cached + reserved) - hits + host_hits;
    AdmitStatus want = AdmitStatus::kAdmitted;
    std::size_t missing = 0;
    if (total > usable_) {
      want = AdmitStatus::kNeverFits;
      missing = total - usable_;
    } else if (new_blocks > m_.allocator().num_available_blocks() - evictable_hits) {
      want = AdmitStatus::kNoCapacity;
      missing = new_blocks - (m_.allocator().num_available_blocks() - evictable_hits);
    }
    // lookup and the capacity query are pure and agree with the admission's walk.
    MB_CHECK(m_.lookup(prompt, keys_ptr(k), cap) == cached);
    const pagedkv::CapacityQuery q = m_.query_admit(prompt, keys_ptr(k), opts);
    MB_CHECK(static_cast<int>(q.status) == static_cast<int>(want));
    MB_CHECK(q.num_missing_blocks == missing);
    if (want != AdmitStatus::kNeverFits) MB_CHECK(q.num_blocks == new_blocks && q.num_cached_tokens == cached);

    const CacheStats st = m_.stats();
    const Snapshot before = want == AdmitStatus::kAdmitted ? Snapshot{} : snapshot();
    // A third of the admissions go through a prepared (hashed once) prompt: same outcome, same state.
    const bool prepared = rng_() % 3 == 0;
    std::optional<pagedkv::PreparedPrompt> pp;
    if (prepared) {
      pp = m_.prepare_prompt(prompt, keys_ptr(k));
      MB_CHECK(pp->hashes == s.hashes);
      const pagedkv::CapacityQuery q2 = m_.query_admit(*pp, opts);
      MB_CHECK(q2.status == q.status && q2.num_missing_blocks == q.num_missing_blocks);
    }
    const auto r = prepared ? m_.try_admit(id, *pp, opts) : m_.try_admit(id, prompt, keys_ptr(k), opts);
    MB_CHECK_MSG(r.status == want, "status " + std::to_string(static_cast<int>(r.status)) + " want " +
                                       std::to_string(static_cast<int>(want)));
    if (want != AdmitStatus::kAdmitted) {
      MB_CHECK(r.num_cached_tokens == 0 && r.num_new_blocks == 0 && r.num_missing_blocks == missing);
      MB_CHECK(snapshot() == before);
      MB_CHECK(!m_.contains(id));
      (want == AdmitStatus::kNeverFits ? c_.never_fits : c_.no_capacity)++;
      put_back();
      return;
    }
    ++c_.admitted;
    if (hits > 0) ++c_.admit_hits;
    if (reserved < prompt.size() - cached) ++c_.chunked_admits;
    MB_CHECK(r.num_cached_tokens == cached);
    MB_CHECK(r.num_host_cached_tokens == host_hits * bs_);
    MB_CHECK(r.num_new_blocks == new_blocks);
    c_.host_hits += host_hits;
    const auto ids = m_.block_ids(id);
    MB_CHECK(ids.size() == hits + new_blocks - host_hits);
    for (std::size_t i = 0; i < hits; ++i) {
      if (hit_blocks[i] != 0) {
        MB_CHECK(ids[i] == hit_blocks[i]);
      } else {
        MB_CHECK(fill_pins(ids[i]) == 1);  // a fresh device block being filled by an onboarding copy
      }
    }
    const CacheStats now = m_.stats();
    MB_CHECK(now.prefix_query_requests == st.prefix_query_requests + 1);
    MB_CHECK(now.prefix_query_tokens == st.prefix_query_tokens + prompt.size());
    MB_CHECK(now.prefix_hit_tokens == st.prefix_hit_tokens + cached);
    MB_CHECK(now.prefix_hit_requests == st.prefix_hit_requests + (hits > 0 ? 1 : 0));
    MB_CHECK(now.readmitted_requests == st.readmitted_requests + (readmission ? 1 : 0));
    MB_CHECK(now.readmitted_query_tokens == st.readmitted_query_tokens + (readmission ? prompt.size() : 0));
    MB_CHECK(now.readmitted_hit_tokens == st.readmitted_hit_tokens + (readmission ? cached : 0));
    interval_.record(prompt.size(), cached, readmission);
    s.slotted = cached + reserved;
    s.built = cached;
    if (readmission) std::erase(dead_ids_, id);
    model_.emplace(id, std::move(s));
  }

  // Reserve the next chunk of a chunked admission's prompt.
  void op_reserve() {
    const SeqId id = pick_where([](const MSeq& s) { return s.unslotted() > 0; });
    if (id == 0) return op_admit();
    MSeq& s = model_.at(id);
    const std::size_t n = rng_() % 8 == 0 ? s.unslotted() + 1 : 1 + rng_() % s.unslotted();
    op_ = "reserve " + std::to_string(id) + " +" + std::to_string(n) + " of " + std::to_string(s.unslotted());
    if (n > s.unslotted()) {
      return expect_misuse([&] { m_.try_reserve(id, n); }, Errc::kInvalidArgument, "prompt tokens without slots");
    }
    grow(id, s, n, [&] { return m_.try_reserve(id, n); });
    ++c_.reserves;
  }

  // Reserve lookahead slots for k draft tokens (ids unknown to the manager).
  void op_lookahead() {
    const SeqId id = pick_where([](const MSeq& s) { return s.unslotted() == 0 && s.drafts.empty(); });
    if (id == 0) return op_commit();
    MSeq& s = model_.at(id);
    const std::size_t k = std::min<std::size_t>(1 + rng_() % 5, o_.max_tokens_per_seq - s.tokens.size());
    if (k == 0) return op_rewind();
    op_ = "lookahead " + std::to_string(id) + " +" + std::to_string(k) + " at " + std::to_string(s.tokens.size());
    if (grow(id, s, k, [&] { return m_.try_reserve_lookahead(id, k); })) {
      const Toks d = gen_decode(s.tokens.size(), k);
      for (TokenId t : d) {
        const std::size_t p = s.tokens.size() + s.drafts.size();
        const std::uint64_t prev = p == 0 ? 0 : fp_at(s, p - 1);
        s.dfp.push_back(next_fp(s, prev, p, t));
        s.drafts.push_back(t);
      }
      MB_CHECK(m_.sequence(id).num_lookahead == k);
      ++c_.lookaheads;
    }
  }

  // Commit a random accepted prefix of a sequence's drafts; the rest is rewound.
  void op_commit() {
    const SeqId id = pick_where([](const MSeq& s) { return !s.drafts.empty(); });
    if (id == 0) return op_build();
    MSeq& s = model_.at(id);
    const std::size_t k = s.drafts.size();
    if (rng_() % 10 == 0) {
      op_ = "commit " + std::to_string(id) + " too many";
      return expect_misuse([&] { m_.commit_lookahead(id, Toks(k + 1, 1)); }, Errc::kInvalidArgument,
                           "lookahead slots");
    }
    const std::size_t a = rng_() % (k + 1);
    op_ = "commit " + std::to_string(id) + " " + std::to_string(a) + " of " + std::to_string(k);
    const Toks accepted(s.drafts.begin(), s.drafts.begin() + static_cast<std::ptrdiff_t>(a));
    const Ids blocks(m_.block_ids(id).begin(), m_.block_ids(id).end());
    const std::size_t keep = blocks_for(s.tokens.size() + a);
    // Registration at commit can only switch blocks whose writes were built; release order as a rewind.
    const Ids want_lru = expected_lru_after_release(Ids(blocks.begin() + static_cast<std::ptrdiff_t>(keep), blocks.end()));
    const CacheStats st = m_.stats();
    m_.commit_lookahead(id, accepted);
    ++c_.commits;
    c_.accepted_drafts += a;
    c_.rejected_drafts += k - a;
    extend(s, accepted);
    s.drafts.clear();
    s.dfp.clear();
    s.slotted = s.tokens.size();
    s.built = std::min(s.built, s.slotted);
    MB_CHECK(m_.num_tokens(id) == s.slotted);
    if (m_.stats().dedup_blocks == st.dedup_blocks) {  // (a switch releases one more block: LRU differs)
      MB_CHECK(m_.allocator().eviction_policy().order() == want_lru);
    }
    check_registered(id, s);
  }

  // Every full block of `s` whose writes are built and whose ids are known is registered (under its own hash) or
  // has been switched to the registered duplicate.
  void check_registered(SeqId id, const MSeq& s) {
    if (!o_.prefix_caching) return;
    const auto blocks = m_.block_ids(id);
    const std::size_t reg = std::min(s.built, s.tokens.size()) / bs_;
    for (std::size_t i = 0; i < reg; ++i) {
      const auto h = m_.prefix_index().hash_of(blocks[i]);
      if (h) {
        MB_CHECK_MSG(*h == s.hashes[i], "sequence " + std::to_string(id) + " block " + std::to_string(i) +
                                            " registered under another hash");
        continue;
      }
      // Unregistered only while a host -> device copy fills it (registered when the copy completes), or as a
      // duplicate: its hash was registered to another block before that copy completed (that one may be gone).
      MB_CHECK_MSG(fill_pins(blocks[i]) != 0 || filled_.contains(blocks[i]) ||
                       m_.prefix_index().find(s.hashes[i]).has_value(),
                   "sequence " + std::to_string(id) + " block " + std::to_string(i) + " not registered");
    }
    if (!s.drafts.empty()) {  // a block holding a lookahead position (id unknown) is never hashed
      for (std::size_t i = s.tokens.size() / bs_; i < blocks.size(); ++i) {
        MB_CHECK_MSG(!m_.allocator().is_hashed(blocks[i]), "a block holding lookahead positions is hashed");
      }
    }
  }

  // Grow `s` by n slots through `call` (append, reserve or lookahead), predicting capacity, copy-on-write and
  // slots. Returns whether it succeeded.
  template <class Call>
  bool grow(SeqId id, MSeq& s, std::size_t n, Call&& call) {
    const auto& a = m_.allocator();
    const auto blocks = m_.block_ids(id);
    const std::size_t nb = blocks.size();
    const std::size_t len = s.slotted;
    const bool cow =
        len % bs_ != 0 &&
        (a.refcount(blocks.back()) - pins(blocks.back()) - unkeyed_fill_pins(blocks.back()) > 1 ||
         a.is_hashed(blocks.back()));
    const std::uint32_t old_last = nb > 0 ? blocks.back() : 0;
    const std::size_t need = blocks_for(len + n) - nb + (cow ? 1 : 0);
    // Never fits: alone in the pool it would still hold more blocks than there are (a copy forced by a hash stays).
    const std::size_t held_after = blocks_for(len + n) + (cow && a.is_hashed(blocks.back()) ? 1 : 0);
    const bool never = held_after > usable_;
    const bool fits = !never && need <= a.num_available_blocks();
    const std::size_t missing = never ? held_after - usable_ : fits ? 0 : need - a.num_available_blocks();
    const pagedkv::CapacityQuery q = m_.query_append(id, n);
    MB_CHECK(q.num_blocks == need && q.num_missing_blocks == missing);
    MB_CHECK(q.status == (never ? pagedkv::CapacityStatus::kNeverFits
                                : fits ? pagedkv::CapacityStatus::kFits : pagedkv::CapacityStatus::kNoCapacity));
    const CacheStats st = m_.stats();
    const Snapshot before = fits ? Snapshot{} : snapshot();

    const auto r = call();
    if (!fits) {
      (never ? c_.append_never_fits : c_.append_no_capacity)++;
      MB_CHECK(r.status == (never ? AppendStatus::kNeverFits : AppendStatus::kNoCapacity));
      MB_CHECK(r.num_missing_blocks == missing);
      MB_CHECK(r.slots.empty() && !r.copy);
      MB_CHECK(snapshot() == before);
      return false;
    }
    MB_CHECK(r.status == AppendStatus::kOk);
    MB_CHECK(r.slots.size() == n);
    const Slots got(r.slots.begin(), r.slots.end());
    const CacheStats now = m_.stats();
    MB_CHECK(now.cow_copies == st.cow_copies + (cow ? 1 : 0));
    MB_CHECK(now.dedup_blocks == st.dedup_blocks);  // deduplication happens at the build
    MB_CHECK(now.blocks_cached + now.blocks_free + need == st.blocks_cached + st.blocks_free);
    if (cow) {
      ++c_.cow;
      MB_CHECK(r.copy.has_value());
      MB_CHECK(r.copy->src == old_last);
      MB_CHECK(m_.block_ids(id)[nb - 1] == r.copy->dst);
      MB_CHECK(!m_.pending_copies().empty() && m_.pending_copies().back() == *r.copy);
    } else {
      MB_CHECK(!r.copy);
    }
    const auto after = m_.block_ids(id);
    for (std::size_t j = 0; j < n; ++j) {
      const std::size_t p = len + j;
      const std::int64_t want = static_cast<std::int64_t>(after[p / bs_]) * bs_ + static_cast<std::int64_t>(p % bs_);
      MB_CHECK(got[j] == want);
    }
    s.slotted += n;
    return true;
  }

  void op_append() {
    if (model_.empty()) return op_admit();
    const SeqId id = pick_live(false);
    MSeq& s = model_.at(id);
    const std::size_t len = s.tokens.size();
    std::size_t n = 1 + rng_() % 20;
    if (len + n > o_.max_tokens_per_seq) n = o_.max_tokens_per_seq - len;
    if (n == 0) return op_rewind();
    const Toks add = gen_decode(len, n);
    op_ = "append " + std::to_string(id) + " +" + std::to_string(n) + " to " + std::to_string(len);
    if (s.unslotted() > 0) {  // the prompt must be reserved first
      return expect_misuse([&] { m_.try_append(id, add); }, Errc::kInvalidArgument, "prompt tokens without slots");
    }
    if (!s.drafts.empty()) {  // the lookahead must be committed first
      return expect_misuse([&] { m_.try_append(id, add); }, Errc::kInvalidArgument, "uncommitted lookahead");
    }
    ++c_.appends;
    if (grow(id, s, n, [&] { return m_.try_append(id, add); })) extend(s, add);
  }

  void op_fork() {
    const bool need_settled = o_.engine_discipline;
    if (!live_exists(need_settled) || model_.size() >= 20) return op_build();
    const SeqId parent = pick_live(need_settled);
    const SeqId child = next_id_++;
    op_ = "fork " + std::to_string(parent) + " -> " + std::to_string(child);
    if (!settled(parent)) {  // unbuilt slots or a pending copy into its table: refused, nothing changes
      ++c_.fork_refused;
      return expect_misuse([&] { m_.fork(parent, child); }, Errc::kInvalidArgument,
                           "parent sequence " + std::to_string(parent) + " has unbuilt state");
    }
    const auto free_before = m_.stats().blocks_free;
    const auto cached_before = m_.stats().blocks_cached;
    const Ids pb(m_.block_ids(parent).begin(), m_.block_ids(parent).end());
    m_.fork(parent, child);
    ++c_.forks;
    MB_CHECK(Ids(m_.block_ids(child).begin(), m_.block_ids(child).end()) == pb);
    MB_CHECK(m_.stats().blocks_free == free_before);  // nothing allocated
    MB_CHECK(m_.stats().blocks_cached == cached_before);
    MB_CHECK(m_.pending_slots(child).empty());
    MSeq c = model_.at(parent);
    model_.emplace(child, std::move(c));
  }

  void op_free(bool preempt) {
    if (!swapped_.empty() && !preempt && rng_() % 4 == 0) {  // a swapped sequence aborted
      const SeqId id = swapped_.begin()->first;
      op_ = "free swapped " + std::to_string(id);
      m_.free(id);
      MB_CHECK(!m_.is_swapped(id));
      swapped_.erase(id);
      dead_ids_.push_back(id);
      return;
    }
    if (model_.empty()) return op_build();
    const SeqId id = pick_live(false);  // also a sequence whose step has not run (since d17439f, safe)
    op_ = std::string(preempt ? "preempt " : "free ") + std::to_string(id);
    const Ids blocks(m_.block_ids(id).begin(), m_.block_ids(id).end());
    const Ids want_lru = expected_lru_after_release(blocks);
    const auto pre = m_.stats().preemptions;
    if (preempt) {
      m_.preempt(id);
      ++c_.preempts;
    } else {
      m_.free(id);
      ++c_.frees;
    }
    MB_CHECK(m_.stats().preemptions == pre + (preempt ? 1 : 0));
    MB_CHECK(m_.allocator().eviction_policy().order() == want_lru);  // tail first
    MB_CHECK(!m_.contains(id));
    model_.erase(id);
    dead_ids_.push_back(id);
    if (preempt) preempted_ids_.push_back(id);
  }

  void op_rewind() {
    if (model_.empty()) return op_build();
    const SeqId id = pick_live(false);
    MSeq& s = model_.at(id);
    const std::size_t len = s.length();  // known tokens + drafts
    const std::size_t n = rng_() % 2 == 0 ? rng_() % (std::min<std::size_t>(len, bs_) + 1) : rng_() % (len + 1);
    op_ = "rewind " + std::to_string(id) + " by " + std::to_string(n) + " of " + std::to_string(len);
    const Ids blocks(m_.block_ids(id).begin(), m_.block_ids(id).end());
    const std::size_t keep = blocks_for(std::min(s.slotted, len - n));
    const Ids want_lru = expected_lru_after_release(Ids(blocks.begin() + static_cast<std::ptrdiff_t>(keep), blocks.end()));
    m_.rewind(id, n);
    ++c_.rewinds;
    MB_CHECK(m_.allocator().eviction_policy().order() == want_lru);
    MB_CHECK(Ids(m_.block_ids(id).begin(), m_.block_ids(id).end()) ==
             Ids(blocks.begin(), blocks.begin() + static_cast<std::ptrdiff_t>(keep)));
    const std::size_t drop_drafts = std::min(n, s.drafts.size());
    s.drafts.resize(s.drafts.size() - drop_drafts);
    s.dfp.resize(s.drafts.size());
    truncate(s, s.tokens.size() - (n - drop_drafts));
    s.slotted = std::min(s.slotted, len - n);
    s.built = std::min(s.built, s.slotted);
    MB_CHECK(m_.sequence(id).num_lookahead == s.drafts.size());
  }

  void op_lookup() {
    ++c_.lookups;
    const Snapshot before = snapshot();
    if (!model_.empty() && rng_() % 2 == 0) {
      const SeqId id = pick_live(false);
      const MSeq& s = model_.at(id);
      op_ = "lookup own tokens of " + std::to_string(id);
      const std::size_t len = s.tokens.size();
      if (len == 0 || !keys_valid(s.keys, len)) {  // rewound below one of its multimodal items (or to nothing)
        if (len != 0) {
          expect_misuse([&] { (void)m_.lookup(s.tokens, keys_ptr(s.keys)); }, Errc::kInvalidArgument,
                        "multimodal item");
        }
        return;
      }
      // The walk over the sequence's own chain hashes, up to the first one not registered.
      std::size_t walk = 0;
      while (walk < s.hashes.size() && (m_.prefix_index().find(s.hashes[walk]) ||
                                         (m_.host_tier() != nullptr && m_.host_tier()->find_ready(s.hashes[walk])))) {
        ++walk;
      }
      MB_CHECK(m_.lookup(s.tokens, keys_ptr(s.keys), len) == walk * bs_);
      const std::size_t capped = len == 0 ? 0 : std::min(walk * bs_, ((len - 1) / bs_) * bs_);
      MB_CHECK(m_.lookup(s.tokens, keys_ptr(s.keys)) == capped);
      MB_CHECK(m_.lookup(s.tokens, keys_ptr(s.keys), 0) == 0);
    } else {
      const Toks p = gen_prompt();
      op_ = "lookup len " + std::to_string(p.size());
      (void)m_.lookup(p);
      (void)m_.lookup(p, &keys_[3], p.size());
    }
    MB_CHECK(snapshot() == before);
  }

  void op_build() {
    // The batch: sequences with something to compute (a build refuses the others), some left out (an engine that
    // builds its prefill and decode batches apart, or a token budget): their copies stay pending unless this
    // build writes a copy's source.
    std::vector<SeqId> batch;
    for (const auto& [id, s] : model_) {
      if (s.pending() > 0 && rng_() % 4 != 0) batch.push_back(id);
    }
    std::shuffle(batch.begin(), batch.end(), rng_);
    // Per sequence: all its pending positions, or (chunked prefill, partial scheduling) a random prefix of them.
    std::vector<std::uint32_t> sched;
    bool partial = false;
    for (SeqId id : batch) {
      const std::size_t pend = model_.at(id).pending();
      const std::size_t q = rng_() % 3 == 0 ? 1 + rng_() % pend : pend;
      partial = partial || q < pend;
      sched.push_back(static_cast<std::uint32_t>(q));
    }
    const bool use_sched = partial || rng_() % 2 == 0;  // empty = "all pending", the default
    op_ = "build " + std::to_string(batch.size()) + (partial ? " partial" : "");
    ++c_.builds;
    if (partial) ++c_.partial_builds;

    // The state before the build.
    struct Row {
      Ids blocks;
      std::size_t first;  // built positions before
      std::size_t q_len;  // scheduled now
      Slots pending;      // slots of the scheduled positions as the tables hold them
    };
    std::vector<Row> rows;
    std::size_t total_blocks = 0, total_slots = 0, max_row = 1;
    for (std::size_t b = 0; b < batch.size(); ++b) {
      const SeqId id = batch[b];
      const MSeq& s = model_.at(id);
      Row row{Ids(m_.block_ids(id).begin(), m_.block_ids(id).end()), s.built, sched[b], m_.pending_slots(id)};
      MB_CHECK(row.pending.size() == s.pending());
      row.pending.resize(row.q_len);
      const std::size_t nb = blocks_for(s.built + row.q_len);
      total_blocks += nb;
      total_slots += row.q_len;
      max_row = std::max(max_row, nb);
      rows.push_back(std::move(row));
    }
    std::vector<std::pair<std::uint32_t, std::uint32_t>> pre_copies;
    for (const auto& c : m_.pending_copies()) pre_copies.emplace_back(c.src, c.dst);
    std::map<SeqId, Ids> idle_tables;  // sequences with nothing pending: a build hands out their copies
    for (const auto& [id, q] : model_) {
      if (q.pending() == 0) idle_tables[id] = Ids(m_.block_ids(id).begin(), m_.block_ids(id).end());
    }
    std::vector<std::uint32_t> holders(m_.allocator().num_blocks(), 0);  // table holders before the build
    m_.for_each_sequence([&](SeqId, std::span<const std::uint32_t> blocks, std::size_t) {
      for (auto blk_id : blocks) ++holders[blk_id];
    });
    const CacheStats st = m_.stats();

    const std::size_t pad = rng_() % 3;
    const std::size_t B = batch.size();
    std::vector<std::int32_t> indptr(B + 1 + pad, -7), indices(total_blocks + pad, -7), lpl(B + pad, -7),
        seq_lens(B + pad, -7), qo(B + 1 + pad, -7), cp(2 * (pre_copies.size() + pad), -7);
    const std::size_t row_len = max_row + rng_() % 2;
    std::vector<std::int32_t> tables((B + pad) * row_len, -7);
    Slots slots(total_slots + pad, -7);
    // Swap lists: room for every queued copy plus write-through offloads (at most one per registered block).
    const std::size_t swap_cap = m_.transfers().queued().size() + m_.allocator().num_blocks() + pad;
    std::vector<std::int32_t> swap_out(2 * swap_cap, -7), swap_in(2 * swap_cap, -7);
    pagedkv::BatchMetadataBuffers buf;
    buf.indptr = indptr;
    buf.indices = indices;
    buf.last_page_len = lpl;
    buf.block_tables = tables;
    buf.max_blocks_per_seq = static_cast<std::int32_t>(row_len);
    buf.seq_lens = seq_lens;
    buf.qo_indptr = qo;
    buf.slot_mapping = slots;
    buf.copies = cp;
    if (o_.host_blocks != 0) {
      buf.swap_out = swap_out;
      buf.swap_in = swap_in;
    }

    const auto sz = use_sched ? m_.build_batch_metadata(batch, buf, sched) : m_.build_batch_metadata(batch, buf);
    MB_CHECK(sz.batch_size == B);
    MB_CHECK(sz.num_indices == total_blocks);
    MB_CHECK(sz.num_new_tokens == total_slots);

    // Registration and deduplication of the blocks this step writes.
    std::set<std::uint32_t> switched_out;
    std::size_t blk = 0, tok = 0;
    for (std::size_t b = 0; b < B; ++b) {
      const Row& row = rows[b];
      MSeq& s = model_.at(batch[b]);
      const Ids post(m_.block_ids(batch[b]).begin(), m_.block_ids(batch[b]).end());
      MB_CHECK(post.size() == row.blocks.size());
      const std::size_t seq_len = row.first + row.q_len;
      for (std::size_t i = 0; i < post.size(); ++i) {
        if (post[i] != row.blocks[i]) {  // switched to the registered duplicate
          MB_CHECK(o_.prefix_caching && (i + 1) * bs_ <= std::min(seq_len, s.tokens.size()));
          MB_CHECK((i + 1) * bs_ > row.first);  // its last write is issued by this build
          MB_CHECK(holders[row.blocks[i]] == 1);
          MB_CHECK(m_.prefix_index().hash_of(post[i]) == std::optional<BlockHash>(s.hashes[i]));
          switched_out.insert(row.blocks[i]);
        }
      }
      s.built = seq_len;
      check_registered(batch[b], s);
      // Outputs, against the tables after registration.
      const std::size_t nb = blocks_for(seq_len);
      MB_CHECK(indptr[b] == static_cast<std::int32_t>(blk));
      MB_CHECK(qo[b] == static_cast<std::int32_t>(tok));
      const std::size_t last = seq_len == 0 ? 0 : seq_len - (nb - 1) * bs_;
      MB_CHECK(lpl[b] == static_cast<std::int32_t>(last));
      MB_CHECK(seq_lens[b] == static_cast<std::int32_t>(seq_len));
      for (std::size_t i = 0; i < row_len; ++i) {
        MB_CHECK(tables[b * row_len + i] == (i < nb ? static_cast<std::int32_t>(post[i]) : 0));
      }
      for (std::size_t i = 0; i < nb; ++i) MB_CHECK(indices[blk + i] == static_cast<std::int32_t>(post[i]));
      for (std::size_t k = 0; k < row.q_len; ++k) {
        const std::size_t p = row.first + k;
        const std::int64_t want = post[p / bs_] != row.blocks[p / bs_] ? -1 : row.pending[k];
        MB_CHECK(slots[tok + k] == want);
      }
      blk += nb;
      tok += row.q_len;
    }
    MB_CHECK(m_.stats().dedup_blocks == st.dedup_blocks + switched_out.size());
    c_.dedups += switched_out.size();
    // Copies: those of this build (into a batch sequence's table, or reading a block this build writes), in
    // order, less those whose destination was switched out (dropped with it); the others stay pending, in order.
    MB_CHECK(sz.num_copies <= pre_copies.size());
    std::set<std::uint32_t> batch_blocks, written_blocks;
    for (const Row& row : rows) {
      batch_blocks.insert(row.blocks.begin(), row.blocks.end());
      for (std::size_t p = row.first; p < row.first + row.q_len; ++p) written_blocks.insert(row.blocks[p / bs_]);
    }
    for (const auto& [id, q] : idle_tables) batch_blocks.insert(q.begin(), q.end());  // nothing pending: claimed too
    std::size_t j = 0;
    std::vector<std::pair<std::uint32_t, std::uint32_t>> kept_copies;
    for (const auto& [src, dst] : pre_copies) {
      if (!batch_blocks.contains(dst) && !written_blocks.contains(src)) {
        kept_copies.emplace_back(src, dst);
        continue;
      }
      ++c_.batch_copies;
      if (j < sz.num_copies && cp[2 * j] == static_cast<std::int32_t>(src) &&
          cp[2 * j + 1] == static_cast<std::int32_t>(dst)) {
        ++j;
      } else {
        MB_CHECK_MSG(switched_out.contains(dst), "copy " + std::to_string(src) + " -> " + std::to_string(dst) +
                                                    " missing from the copy list");
      }
    }
    MB_CHECK(j == sz.num_copies);
    {
      std::vector<std::pair<std::uint32_t, std::uint32_t>> now;
      for (const auto& c : m_.pending_copies()) now.emplace_back(c.src, c.dst);
      MB_CHECK_MSG(now == kept_copies, "the copies of sequences outside the batch must stay pending");
      c_.kept_copies += kept_copies.size();
    }
    {  // No block is both read and written by one copy_blocks launch (issue 12, defect 1).
      std::set<std::int32_t> srcs;
      for (std::size_t i = 0; i < sz.num_copies; ++i) srcs.insert(cp[2 * i]);
      for (std::size_t i = 0; i < sz.num_copies; ++i) {
        MB_CHECK_MSG(!srcs.contains(cp[2 * i + 1]), "block " + std::to_string(cp[2 * i + 1]) +
                                                        " is both a source and a destination of one copy list");
      }
    }
    for (std::size_t b = B; b < B + 1 + pad; ++b) {
      MB_CHECK(indptr[b] == static_cast<std::int32_t>(blk));
      MB_CHECK(qo[b] == static_cast<std::int32_t>(tok));
    }
    for (std::size_t b = B; b < B + pad; ++b) {
      MB_CHECK(lpl[b] == 0 && seq_lens[b] == 0);
      for (std::size_t i = 0; i < row_len; ++i) MB_CHECK(tables[b * row_len + i] == -7);  // untouched
    }
    for (std::size_t i = tok; i < slots.size(); ++i) MB_CHECK(slots[i] == -1);
    for (std::size_t i = 2 * sz.num_copies; i < cp.size(); ++i) MB_CHECK(cp[i] == -1);
    for (SeqId id : batch) MB_CHECK(m_.pending_slots(id).size() == model_.at(id).pending());

    // Swap lists: well formed (distinct destinations, padding), and a token exactly when something was issued.
    if (o_.host_blocks != 0) {
      MB_CHECK((sz.transfer_token != 0) == (sz.num_swap_out + sz.num_swap_in != 0));
      std::set<std::int32_t> out_dst, in_dst;
      for (std::size_t i = 0; i < sz.num_swap_out; ++i) {
        MB_CHECK(swap_out[2 * i] > 0 && swap_out[2 * i + 1] > 0);
        MB_CHECK_MSG(out_dst.insert(swap_out[2 * i + 1]).second, "a host block filled twice by one swap_out list");
      }
      for (std::size_t i = 0; i < sz.num_swap_in; ++i) {
        MB_CHECK(swap_in[2 * i] > 0 && swap_in[2 * i + 1] > 0);
        MB_CHECK_MSG(in_dst.insert(swap_in[2 * i + 1]).second, "a device block filled twice by one swap_in list");
        MB_CHECK(fill_pins(static_cast<std::uint32_t>(swap_in[2 * i + 1])) == 1);
      }
      for (std::size_t i = 2 * sz.num_swap_out; i < swap_out.size(); ++i) MB_CHECK(swap_out[i] == -1);
      for (std::size_t i = 2 * sz.num_swap_in; i < swap_in.size(); ++i) MB_CHECK(swap_in[i] == -1);
      if (sz.transfer_token != 0) in_flight_tokens_.push_back(sz.transfer_token);
      execute_swaps(sz, swap_out, swap_in);  // the engine's order: swaps, then copy_blocks and write_kv below
      for (std::size_t i = 0; i < sz.num_swap_in; ++i) filled_.insert(static_cast<std::uint32_t>(swap_in[2 * i + 1]));
    }

    if (o_.engine_discipline) {
      // What the kernels do with this step: copy_blocks over the copy list, then write_kv over the slot mapping.
      for (std::size_t i = 0; i < sz.num_copies; ++i) {
        const auto src = static_cast<std::size_t>(cp[2 * i]), dst = static_cast<std::size_t>(cp[2 * i + 1]);
        std::copy(kv_.begin() + static_cast<std::ptrdiff_t>(src * bs_),
                  kv_.begin() + static_cast<std::ptrdiff_t>((src + 1) * bs_),
                  kv_.begin() + static_cast<std::ptrdiff_t>(dst * bs_));
      }
      std::set<std::int64_t> written;
      for (std::size_t b = 0; b < B; ++b) {
        const MSeq& s = model_.at(batch[b]);
        const auto ids = m_.block_ids(batch[b]);
        const std::size_t n = static_cast<std::size_t>(qo[b + 1] - qo[b]);
        const std::size_t first = rows[b].first;
        for (std::size_t k = 0; k < n; ++k) {
          const std::int64_t sl = slots[static_cast<std::size_t>(qo[b]) + k];
          if (sl < 0) continue;
          const std::size_t p = first + k;
          MB_CHECK(sl == static_cast<std::int64_t>(ids[p / bs_]) * bs_ + static_cast<std::int64_t>(p % bs_));
          MB_CHECK_MSG(written.insert(sl).second, "two tokens of one step write the same slot");
          kv_[static_cast<std::size_t>(sl)] = fp_at(s, p);
        }
      }
      check_content();
    }
  }

  // The swap lists of a build on the shadow pools: swap_out, then swap_in.
  void execute_swaps(const pagedkv::BatchMetadataSizes& sz, const std::vector<std::int32_t>& swap_out,
                     const std::vector<std::int32_t>& swap_in) {
    const auto n = static_cast<std::ptrdiff_t>(bs_);
    for (std::size_t i = 0; i < sz.num_swap_out; ++i) {
      const auto d = static_cast<std::ptrdiff_t>(swap_out[2 * i]), h = static_cast<std::ptrdiff_t>(swap_out[2 * i + 1]);
      std::copy(kv_.begin() + d * n, kv_.begin() + (d + 1) * n, hkv_.begin() + h * n);
    }
    for (std::size_t i = 0; i < sz.num_swap_in; ++i) {
      const auto h = static_cast<std::ptrdiff_t>(swap_in[2 * i]), d = static_cast<std::ptrdiff_t>(swap_in[2 * i + 1]);
      std::copy(hkv_.begin() + h * n, hkv_.begin() + (h + 1) * n, kv_.begin() + d * n);
    }
  }

  // Every built position of every live sequence reads, through its block table, the K/V of its own prefix.
  void check_content() {
    // A block whose host -> device copy is still queued is filled by the next build's swap_in, before that step's
    // kernels read it: not yet here. Likewise the destination of a copy-on-write not yet handed out (checks between builds: after an ack).
    std::set<std::uint32_t> unfilled;
    for (const auto& t : m_.transfers().queued()) {
      if (!pagedkv::is_device_to_host(t.kind)) unfilled.insert(t.device);
    }
    // The destination of a copy-on-write not handed out yet (its sequence was in no build since) is filled by the
    // copy its own batch's build issues, before that step's kernels read it: until then its built positions must
    // still be intact in the copy's source (a build that writes the source hands the copy out first).
    std::map<std::uint32_t, std::uint32_t> copy_src;
    for (const auto& c : m_.pending_copies()) copy_src[c.dst] = c.src;
    for (const auto& [id, s] : model_) {
      const auto ids = m_.block_ids(id);
      for (std::size_t p = 0; p < s.built; ++p) {
        std::uint32_t blk = ids[p / bs_];
        for (auto it = copy_src.find(blk); it != copy_src.end(); it = copy_src.find(blk)) blk = it->second;
        if (unfilled.contains(blk)) continue;
        const std::size_t slot = blk * bs_ + p % bs_;
        ++c_.checks;
        if (kv_[slot] != fp_at(s, p)) {
          fail(__LINE__, "shadow K/V mismatch", "sequence " + std::to_string(id) + " position " +
                                                    std::to_string(p) + " block " + std::to_string(blk));
        }
      }
    }
    // Every registered block holds the K/V of its hash: device blocks (unless filled later this step), and host
    // blocks once ready (content addressing is what makes a hit, in either tier, correct).
    for (std::uint32_t b = 1; b < m_.allocator().num_blocks(); ++b) {
      const auto h = m_.prefix_index().hash_of(b);
      if (!h || unfilled.contains(b)) continue;
      const auto it = content_of_.find(*h);
      MB_CHECK(it != content_of_.end());
      ++c_.checks;
      if (!std::equal(it->second.begin(), it->second.end(), kv_.begin() + static_cast<std::ptrdiff_t>(b * bs_))) {
        fail(__LINE__, "registered device block holds other K/V", "block " + std::to_string(b));
      }
    }
    if (const auto* host = m_.host_tier()) {
      for (std::uint32_t hb = 1; hb < host->allocator().num_blocks(); ++hb) {
        const auto h = host->index().hash_of(hb);
        if (!h || !host->is_ready(hb)) continue;
        const auto it = content_of_.find(*h);
        MB_CHECK(it != content_of_.end());
        ++c_.checks;
        if (!std::equal(it->second.begin(), it->second.end(), hkv_.begin() + static_cast<std::ptrdiff_t>(hb * bs_))) {
          fail(__LINE__, "ready host block holds other K/V", "host block " + std::to_string(hb));
        }
      }
    }
    // A swapped sequence whose host blocks are all filled holds its K/V there.
    for (const auto& [id, s] : swapped_) {
      const auto hbs = m_.swapped_host_blocks(id);
      if (!std::all_of(hbs.begin(), hbs.end(), [&](std::uint32_t hb) { return m_.host_tier()->is_ready(hb); })) continue;
      for (std::size_t p = 0; p < s.tokens.size(); ++p) {
        ++c_.checks;
        if (hkv_[hbs[p / bs_] * bs_ + p % bs_] != s.fp[p]) {
          fail(__LINE__, "shadow host K/V mismatch", "swapped sequence " + std::to_string(id) + " position " +
                                                         std::to_string(p) + " host block " +
                                                         std::to_string(hbs[p / bs_]));
        }
      }
      ++c_.swapped_content_checks;
    }
    ++c_.content_checks;
  }

  // Acknowledge the copies of a random in-flight build (late, in any order), or misuse an unknown token.
  void op_ack() {
    if (in_flight_tokens_.empty() || rng_() % 20 == 0) {
      const std::uint64_t bad = m_.transfers().last_token() + 1 + rng_() % 5;
      op_ = "ack unknown token " + std::to_string(bad);
      return expect_misuse([&] { m_.complete_transfers(bad); }, Errc::kInvalidArgument, "names no copies in flight");
    }
    const std::size_t i = rng_() % in_flight_tokens_.size();
    const std::uint64_t token = in_flight_tokens_[i];
    in_flight_tokens_.erase(in_flight_tokens_.begin() + static_cast<std::ptrdiff_t>(i));
    op_ = "ack " + std::to_string(token);
    std::size_t fills = 0;
    for (const auto& t : m_.transfers().in_flight()) fills += t.token == token;
    MB_CHECK(fills > 0);
    m_.complete_transfers(token);
    for (const auto& t : m_.transfers().in_flight()) MB_CHECK(t.token != token);
    ++c_.acks;
    if (o_.engine_discipline) check_content();
  }

  // Preempt a running sequence by swapping it to the host tier.
  void op_swap() {
    if (model_.empty()) return op_admit();
    const SeqId id = pick_live(false);
    op_ = "swap " + std::to_string(id);
    if (!settled(id)) {
      return expect_misuse([&] { m_.preempt(id, pagedkv::PreemptMode::kSwap); }, Errc::kInvalidArgument,
                           "not settled");
    }
    // Predict: host blocks to fill (the hash is not there yet) against the unpinned host blocks.
    const auto* host = m_.host_tier();
    const Ids blocks(m_.block_ids(id).begin(), m_.block_ids(id).end());
    std::size_t to_fill = 0, shared_cached = 0;
    for (std::uint32_t b : blocks) {
      const auto h = m_.prefix_index().hash_of(b);
      const auto hb = h ? host->find(*h) : std::nullopt;
      if (!hb) {
        ++to_fill;
      } else if (host->allocator().is_cached(*hb)) {
        ++shared_cached;
      }
    }
    const bool fits = to_fill <= host->allocator().num_available_blocks() - shared_cached;
    const Snapshot before = fits ? Snapshot{} : snapshot();
    const Ids want_lru = expected_lru_after_release(blocks);
    const CacheStats st = m_.stats();
    const bool ok = m_.preempt(id, pagedkv::PreemptMode::kSwap);
    MB_CHECK(ok == fits);
    if (!ok) {
      ++c_.swap_refused;
      MB_CHECK(snapshot() == before);
      return;
    }
    ++c_.swaps;
    MB_CHECK(!m_.contains(id) && m_.is_swapped(id));
    MB_CHECK(m_.stats().swap_outs == st.swap_outs + to_fill);
    MB_CHECK(m_.stats().preemptions == st.preemptions + 1);
    MB_CHECK(m_.allocator().eviction_policy().order() == want_lru);
    MB_CHECK(m_.swapped_host_blocks(id).size() == blocks.size());
    swapped_.emplace(id, std::move(model_.at(id)));
    model_.erase(id);
  }

  // Resume a swapped sequence.
  void op_resume() {
    if (swapped_.empty()) return op_swap();
    auto it = swapped_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng_() % swapped_.size()));
    const SeqId id = it->first;
    op_ = "resume " + std::to_string(id);
    const auto* host = m_.host_tier();
    const Ids hbs(m_.swapped_host_blocks(id).begin(), m_.swapped_host_blocks(id).end());
    bool pending = false;
    std::size_t to_fill = 0, evictable = 0, host_tokens = 0;
    const std::size_t len = it->second.tokens.size();
    for (std::size_t i = 0; i < hbs.size(); ++i) {
      const std::uint32_t hb = hbs[i];
      if (!host->is_ready(hb)) pending = true;
      const auto h = host->index().hash_of(hb);
      const auto b = h ? m_.prefix_index().find(*h) : std::nullopt;
      if (!b) {
        ++to_fill;
        host_tokens += std::min<std::size_t>(bs_, len - i * bs_);  // a partial last block counts its tokens
      } else if (m_.allocator().is_cached(*b)) {
        ++evictable;
      }
    }
    AdmitStatus want = AdmitStatus::kAdmitted;
    if (hbs.size() > usable_) {
      want = AdmitStatus::kNeverFits;
    } else if (pending) {
      want = AdmitStatus::kTransferPending;
    } else if (to_fill > m_.allocator().num_available_blocks() - evictable) {
      want = AdmitStatus::kNoCapacity;
    }
    const Snapshot before = want == AdmitStatus::kAdmitted ? Snapshot{} : snapshot();
    const auto r = m_.try_resume(id);
    MB_CHECK_MSG(r.status == want, "status " + std::to_string(static_cast<int>(r.status)) + " want " +
                                       std::to_string(static_cast<int>(want)));
    if (want != AdmitStatus::kAdmitted) {
      if (want == AdmitStatus::kTransferPending) ++c_.resume_pending;
      MB_CHECK(snapshot() == before);
      MB_CHECK(m_.is_swapped(id));
      return;
    }
    ++c_.resumes;
    MSeq s = std::move(it->second);
    swapped_.erase(it);
    MB_CHECK(m_.contains(id) && !m_.is_swapped(id));
    MB_CHECK(r.num_cached_tokens == s.tokens.size());
    MB_CHECK_MSG(r.num_host_cached_tokens == host_tokens, "host tokens " + std::to_string(r.num_host_cached_tokens) +
                                                              " want " + std::to_string(host_tokens));
    MB_CHECK(r.num_host_cached_tokens <= r.num_cached_tokens);
    MB_CHECK(m_.num_tokens(id) == s.tokens.size());
    MB_CHECK(m_.sequence(id).num_built == s.tokens.size());
    s.slotted = s.built = s.tokens.size();
    model_.emplace(id, std::move(s));
  }

  void op_reset() {
    if (rng_() % 3 == 0) drain_all_and_check_no_leak();
    op_ = "reset_prefix_cache";
    const CacheStats rs = m_.stats();
    const bool want = rs.blocks_used == 0 && rs.host_blocks_used == 0 && rs.transfers_queued == 0;
    const Snapshot before = want ? Snapshot{} : snapshot();
    const bool ok = m_.reset_prefix_cache();
    MB_CHECK(ok == want);
    if (!ok) {
      ++c_.resets_refused;
      MB_CHECK(snapshot() == before);
      return;
    }
    ++c_.resets_ok;
    MB_CHECK(m_.prefix_index().size() == 0);
    MB_CHECK(m_.stats().blocks_cached == 0);
    MB_CHECK(m_.stats().blocks_free == usable_);
    expect_cleared_ = true;
    interval_.reset = true;
    check_interval_stats();
  }

  void op_misuse() {
    const auto kind = rng_() % 14;
    const SeqId bad = unknown_id();
    const std::string bad_s = std::to_string(bad);
    op_ = "misuse " + std::to_string(kind);
    switch (kind) {
      case 0:
        return expect_misuse([&] { m_.try_append(bad, Toks{1}); }, Errc::kUnknownSequence, "sequence " + bad_s);
      case 1:
        return expect_misuse([&] { m_.fork(bad, next_id_ + 5000); }, Errc::kUnknownSequence, "sequence " + bad_s);
      case 2:
        return expect_misuse([&] { m_.free(bad); }, Errc::kUnknownSequence, "sequence " + bad_s);
      case 3:
        return expect_misuse([&] { m_.preempt(bad); }, Errc::kUnknownSequence, "sequence " + bad_s);
      case 4:
        return expect_misuse([&] { m_.rewind(bad, 0); }, Errc::kUnknownSequence, "sequence " + bad_s);
      case 5:
        return expect_misuse([&] { (void)m_.token_ids(bad); }, Errc::kUnknownSequence, "sequence " + bad_s);
      case 6: {
        std::vector<SeqId> batch;
        for (const auto& [id, s] : model_) batch.push_back(id);
        batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(rng_() % (batch.size() + 1)), bad);
        return expect_misuse([&] { m_.build_batch_metadata(batch, pagedkv::BatchMetadataBuffers{}); },
                             Errc::kUnknownSequence, "sequence " + bad_s);
      }
      default:
        break;
    }
    if (model_.empty()) {
      return expect_misuse([&] { m_.try_admit(bad, Toks(o_.max_tokens_per_seq + 1)); }, Errc::kLimitExceeded,
                           "sequence " + bad_s);
    }
    const SeqId live = pick_live(false);
    const std::string live_s = std::to_string(live);
    const std::size_t len = model_.at(live).tokens.size();
    const std::size_t length = model_.at(live).length();
    switch (kind) {
      case 7:
        return expect_misuse([&] { m_.try_admit(live, Toks{1, 2, 3}); }, Errc::kDuplicateSequence,
                             "sequence " + live_s);
      case 8: {
        const SeqId parent = pick_live(false);
        return expect_misuse([&] { m_.fork(parent, live); }, Errc::kDuplicateSequence, "sequence " + live_s);
      }
      case 9:
        return expect_misuse([&] { m_.rewind(live, length + 1 + rng_() % 5); }, Errc::kLimitExceeded,
                             "sequence " + live_s);
      case 10: {
        const MSeq& s = model_.at(live);
        const Toks add(o_.max_tokens_per_seq - len + 1 + rng_() % 3, 1);
        if (s.unslotted() == 0 && s.drafts.empty()) {
          return expect_misuse([&] { m_.try_append(live, add); }, Errc::kLimitExceeded, "sequence " + live_s);
        }
        // Lookahead past the limit is checked the same way; with work outstanding the call is refused first.
        return expect_misuse([&] { m_.try_reserve_lookahead(live, add.size()); }, Errc::kInvalidArgument,
                             "sequence " + live_s);
      }
      case 11: {
        std::vector<SeqId> batch{live};
        for (const auto& [id, s] : model_) {
          if (rng_() % 2 == 0 && id != live) batch.push_back(id);
        }
        batch.push_back(live);
        std::shuffle(batch.begin(), batch.end(), rng_);
        return expect_misuse([&] { m_.build_batch_metadata(batch, pagedkv::BatchMetadataBuffers{}); },
                             Errc::kInvalidArgument, "sequence " + live_s + " appears twice");
      }
      case 12:
        if (model_.at(live).pending() > 0) {  // a build cannot drop the writes it would register
          return expect_misuse(
              [&] { m_.build_batch_metadata(std::vector<SeqId>{live}, pagedkv::BatchMetadataBuffers{}); },
              Errc::kBadShape, "slot_mapping is empty");
        }
        if (rng_() % 2 == 0) {  // nor a row with nothing to compute
          const std::vector<std::uint32_t> zero{0};
          const bool explicit_zero = rng_() % 2 == 0;
          return expect_misuse(
              [&] {
                if (!explicit_zero) {
                  m_.build_batch_metadata(std::vector<SeqId>{live}, pagedkv::BatchMetadataBuffers{});
                } else {
                  m_.build_batch_metadata(std::vector<SeqId>{live}, pagedkv::BatchMetadataBuffers{}, zero);
                }
              },
              Errc::kInvalidArgument, "sequence " + live_s + " has no tokens to compute");
        }
        if (!m_.pending_copies().empty()) {  // nor the copies it would hand out (those of its own batch)
          const std::uint32_t dst = m_.pending_copies().front().dst;
          for (const auto& [id, q] : model_) {
            const auto blocks = m_.block_ids(id);
            if (q.pending() == 0 || std::find(blocks.begin(), blocks.end(), dst) == blocks.end()) continue;
            Slots sl(q.pending());
            pagedkv::BatchMetadataBuffers only_slots;
            only_slots.slot_mapping = sl;
            return expect_misuse([&] { m_.build_batch_metadata(std::vector<SeqId>{id}, only_slots); },
                                 Errc::kBadShape, "copies is empty");
          }
        }
        if (len > 0) {  // a multimodal item past the prompt, or wrapping past 2^64
          RequestKeys k;
          k.multimodal.push_back({hash_of_u64(0xC), rng_() % 2 == 0 ? len : ~std::uint64_t{0} - 1, 3});
          return expect_misuse([&] { m_.try_admit(next_id_ + 9000, model_.at(live).tokens, &k); },
                               Errc::kInvalidArgument, "multimodal item 0");
        }
        [[fallthrough]];
      default: {
        const std::size_t pend = model_.at(live).pending();
        if (pend >= 2) {  // a slot mapping one entry short (an empty span would mean "skip")
          Slots small(pend - 1);
          pagedkv::BatchMetadataBuffers buf;
          buf.slot_mapping = small;
          return expect_misuse([&] { m_.build_batch_metadata(std::vector<SeqId>{live}, buf); }, Errc::kBadShape,
                               "slot_mapping holds " + std::to_string(pend - 1) + " entries");
        }
        if (m_.block_ids(live).size() >= 2) {  // a padded block table one column short
          std::vector<std::int32_t> row(m_.block_ids(live).size() - 1);
          pagedkv::BatchMetadataBuffers buf;
          buf.block_tables = row;
          buf.max_blocks_per_seq = static_cast<std::int32_t>(row.size());
          return expect_misuse([&] { m_.build_batch_metadata(std::vector<SeqId>{live}, buf); }, Errc::kBadShape,
                               "sequence " + live_s + " has");
        }
        return expect_misuse([&] { m_.try_admit(next_id_ + 7000, Toks(o_.max_tokens_per_seq + 1, 0)); },
                             Errc::kLimitExceeded, std::to_string(o_.max_tokens_per_seq + 1) + " tokens");
      }
    }
  }

  // The interval statistics equal the model's record since the last take (vLLM's PrefixCacheStats semantics).
  void check_interval_stats() {
    const pagedkv::PrefixCacheStats got = m_.take_prefix_cache_stats();
    MB_CHECK(got.reset == interval_.reset);
    MB_CHECK(got.requests == interval_.requests && got.queries == interval_.queries && got.hits == interval_.hits);
    MB_CHECK(got.preempted_requests == interval_.preempted_requests);
    MB_CHECK(got.preempted_queries == interval_.preempted_queries && got.preempted_hits == interval_.preempted_hits);
    interval_ = {};
    const pagedkv::PrefixCacheStats again = m_.take_prefix_cache_stats();
    MB_CHECK(again.requests == 0 && again.queries == 0 && !again.reset);
  }

  // Free every sequence, hand out the pending copies, and check that no block leaked.
  void drain_all_and_check_no_leak() {
    check_interval_stats();
    op_ = "drain all";
    while (!model_.empty()) {
      const SeqId id = model_.begin()->first;
      m_.free(id);
      model_.erase(id);
      dead_ids_.push_back(id);
    }
    while (!swapped_.empty()) {
      const SeqId id = swapped_.begin()->first;
      m_.free(id);
      MB_CHECK(!m_.is_swapped(id));
      swapped_.erase(id);
      dead_ids_.push_back(id);
    }
    preempted_ids_.clear();  // (the manager still remembers them as preempted: never re-admitted here)
    // Issue what is queued, then acknowledge everything in flight.
    std::vector<std::int32_t> so(2 * (m_.transfers().queued().size() + m_.allocator().num_blocks())), si(so.size());
    pagedkv::BatchMetadataBuffers eb;
    eb.swap_out = so;
    eb.swap_in = si;
    const auto sz = m_.build_batch_metadata(std::vector<SeqId>{}, eb);
    MB_CHECK(sz.batch_size == 0);
    execute_swaps(sz, so, si);
    if (sz.transfer_token != 0) in_flight_tokens_.push_back(sz.transfer_token);
    for (std::uint64_t t : in_flight_tokens_) m_.complete_transfers(t);
    in_flight_tokens_.clear();
    MB_CHECK(m_.transfers().in_flight().empty() && m_.transfers().queued().empty());
    const CacheStats s = m_.stats();
    MB_CHECK(s.blocks_used == 0);
    MB_CHECK(s.host_blocks_used == 0);
    MB_CHECK(s.blocks_free + s.blocks_cached == usable_);
    MB_CHECK(m_.pending_copies().empty());
    MB_CHECK(m_.num_sequences() == 0);
    for (std::uint32_t b = 1; b <= usable_; ++b) MB_CHECK(m_.allocator().refcount(b) == 0);
    ++c_.leak_checks;
    check_all();
  }

  // ---- invariants after every step -------------------------------------------------------------------------
  void check_all() {
    const auto& a = m_.allocator();
    const auto& idx = m_.prefix_index();
    MB_CHECK(m_.num_sequences() == model_.size());
    std::vector<std::uint32_t> rc(a.num_blocks(), 0);
    std::vector<std::pair<std::uint32_t, std::uint32_t>> copies;
    for (const auto& c : m_.pending_copies()) {
      copies.emplace_back(c.src, c.dst);
      MB_CHECK(c.src != c.dst && c.src != 0 && c.dst != 0);
      ++rc[c.src];
    }
    for (const auto& [id, s] : model_) {
      MB_CHECK(m_.contains(id));
      const std::size_t len = s.tokens.size();
      MB_CHECK(m_.num_tokens(id) == s.slotted);
      const auto& st = m_.sequence(id);
      MB_CHECK(st.num_built == s.built && st.num_lookahead == s.drafts.size() && st.num_known() == len);
      MB_CHECK(st.settled() == settled_state(id));
      const auto toks = m_.token_ids(id);
      MB_CHECK(toks.size() == len && (len == 0 || std::memcmp(toks.data(), s.tokens.data(), len * sizeof(TokenId)) == 0));
      const auto blocks = m_.block_ids(id);
      MB_CHECK(blocks.size() == blocks_for(s.slotted));
      for (std::uint32_t b : blocks) {
        MB_CHECK(b != 0 && b < a.num_blocks());
        ++rc[b];
      }
      if (o_.prefix_caching) {
        MB_CHECK(s.hashes.size() == len / bs_);
        for (std::size_t i = 0; i < std::min(len, s.slotted) / bs_; ++i) {  // a registered block holds its hash
          const auto h = idx.hash_of(blocks[i]);
          MB_CHECK_MSG(!h || *h == s.hashes[i], "sequence " + std::to_string(id) + " block " + std::to_string(i) +
                                                    " registered under another hash");
        }
      }
      // Pending slots: exactly the sequence's own positions (-1 appears only in the built slot mapping).
      const auto pend = m_.pending_slots(id);
      MB_CHECK(pend.size() == s.pending());
      MB_CHECK(s.built <= s.slotted && s.slotted <= s.length());
      const std::size_t first = s.built;
      for (std::size_t k = 0; k < pend.size(); ++k) {
        const std::size_t p = first + k;
        const std::int64_t sl = pend[k];
        const std::uint32_t own = blocks[p / bs_];
        MB_CHECK_MSG(sl == static_cast<std::int64_t>(own) * bs_ + static_cast<std::int64_t>(p % bs_),
                     "sequence " + std::to_string(id) + " position " + std::to_string(p) + " slot " + std::to_string(sl));
      }
    }
    // Host -> device copies hold their destination.
    for (const auto& t : m_.transfers().queued()) if (!pagedkv::is_device_to_host(t.kind)) ++rc[t.device];
    for (const auto& t : m_.transfers().in_flight()) if (!pagedkv::is_device_to_host(t.kind)) ++rc[t.device];
    MB_CHECK(m_.num_swapped() == swapped_.size());
    if (const auto* host = m_.host_tier()) check_host(*host);
    // Refcounts and the three-state partition.
    std::size_t free = 0, cached = 0, held = 0, hashed = 0;
    for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
      MB_CHECK_MSG(a.refcount(b) == rc[b], "block " + std::to_string(b) + " refcount " +
                                               std::to_string(a.refcount(b)) + " expected " + std::to_string(rc[b]));
      const bool is_hashed = a.is_hashed(b);
      MB_CHECK(is_hashed == idx.hash_of(b).has_value());
      if (is_hashed) {
        ++hashed;
        MB_CHECK(idx.find(*idx.hash_of(b)) == std::optional<std::uint32_t>(b));
      }
      if (rc[b] == 0) filled_.erase(b);
      if (rc[b] > 0) {
        ++held;
        MB_CHECK(!a.is_cached(b));
      } else if (a.is_cached(b)) {
        ++cached;
        MB_CHECK(is_hashed);
      } else {
        ++free;
        MB_CHECK(!is_hashed);
      }
    }
    const CacheStats st = m_.stats();
    MB_CHECK(st.blocks_free == free);
    MB_CHECK(st.blocks_cached == cached);
    MB_CHECK(st.blocks_used == held);
    MB_CHECK(free + cached + held == usable_);
    MB_CHECK(st.num_usable_blocks == usable_);
    MB_CHECK(idx.size() == hashed);
    MB_CHECK(a.eviction_policy().order().size() == cached);
    if (!o_.prefix_caching) MB_CHECK(hashed == 0);

    // Events since the last step.
    std::vector<KVEvent> ev;
    m_.drain_events(ev);
    std::size_t stored = 0, removed = 0, host_stored = 0, host_removed = 0;
    bool cleared = false;
    for (const auto& e : ev) {
      MB_CHECK(e.seq_no == last_seq_no_ + 1);
      last_seq_no_ = e.seq_no;
      if (e.medium == pagedkv::Medium::kCpu) {  // host tier: counted against its ready registered blocks below
        if (e.type == KVEventType::kBlockStored) {
          ++host_stored;
          MB_CHECK(pagedkv::rehash_stored_event<Hasher>(e, kHashSeed) == e.hash);
        } else if (e.type == KVEventType::kBlockRemoved) {
          ++host_removed;
        }
        continue;
      }
      if (e.type == KVEventType::kBlockStored) {
        ++stored;
        MB_CHECK(e.token_ids.size() == bs_);
        MB_CHECK(idx.find(e.hash).has_value());
      } else if (e.type == KVEventType::kBlockRemoved) {
        ++removed;
      } else {
        cleared = true;
        MB_CHECK(stored == 0);  // nothing registers after a reset within one step
      }
    }
    MB_CHECK(cleared == expect_cleared_);
    expect_cleared_ = false;
    if (cleared) {
      MB_CHECK(idx.size() == 0);
    } else {
      MB_CHECK(idx.size() + removed == last_index_size_ + stored);
    }
    MB_CHECK(st.evictions == last_stats_.evictions + removed);
    MB_CHECK(st.block_ops >= last_stats_.block_ops);
    if (const auto* host = m_.host_tier()) {
      std::size_t ready = 0;
      for (std::uint32_t hb = 1; hb < host->allocator().num_blocks(); ++hb) {
        // Reported: a held-back copy (its parent was cached nowhere when it completed) has no event either way.
        ready += host->index().hash_of(hb).has_value() && host->is_ready(hb) && !m_.host_event_held_back(hb);
      }
      if (!cleared) MB_CHECK(ready + host_removed == last_host_ready_ + host_stored);
      MB_CHECK(st.host_evictions >= last_stats_.host_evictions + host_removed);  // + evictions of held-back copies
      MB_CHECK(st.host_evictions - last_stats_.host_evictions - host_removed <=
               st.events_held_back);
      last_host_ready_ = ready;
    }
    last_index_size_ = idx.size();
    last_stats_ = st;
  }

  // Host tier: refcount = swapped sequences holding the block + copies (queued or in flight) reading or filling it;
  // hashed <=> registered; a ready registered block is found under its hash.
  void check_host(const typename Mgr::host_tier_type& host) {
    const auto& ha = host.allocator();
    std::vector<std::uint32_t> hrc(ha.num_blocks(), 0);
    for (const auto& [id, s] : swapped_) {
      const auto hbs = m_.swapped_host_blocks(id);
      MB_CHECK(hbs.size() == blocks_for(s.tokens.size()));
      for (std::uint32_t hb : hbs) ++hrc[hb];
    }
    for (const auto& t : m_.transfers().queued()) ++hrc[t.host];
    for (const auto& t : m_.transfers().in_flight()) ++hrc[t.host];
    std::size_t held = 0, cached = 0;
    for (std::uint32_t hb = 1; hb < ha.num_blocks(); ++hb) {
      MB_CHECK_MSG(ha.refcount(hb) == hrc[hb], "host block " + std::to_string(hb) + " refcount " +
                                                  std::to_string(ha.refcount(hb)) + " expected " +
                                                  std::to_string(hrc[hb]));
      const auto h = host.index().hash_of(hb);
      MB_CHECK(ha.is_hashed(hb) == h.has_value());
      if (h) MB_CHECK(host.index().find(*h) == std::optional<std::uint32_t>(hb));
      if (ha.is_cached(hb)) {
        ++cached;
        MB_CHECK(h.has_value() && host.is_ready(hb));  // only filled registered blocks are evictable
      }
      held += hrc[hb] > 0;
    }
    const CacheStats st = m_.stats();
    MB_CHECK(st.host_blocks_used == held);
    MB_CHECK(st.host_blocks_cached == cached);
    MB_CHECK(st.host_blocks_used + st.host_blocks_cached + st.host_blocks_free == o_.host_blocks - 1);
  }

#undef MB_CHECK
#undef MB_CHECK_MSG

  Options o_;
  std::uint32_t bs_;
  std::size_t usable_ = 0;
  std::mt19937_64 rng_;
  Mgr m_;
  mutable pagedkv::PrefixHashIndex<Hasher> ref_;  // the same chain, computed independently of the manager's state
  std::vector<Toks> bases_;
  std::vector<RequestKeys> keys_;
  std::map<SeqId, MSeq> model_;
  std::vector<SeqId> dead_ids_;
  std::vector<SeqId> preempted_ids_;      // preempted and not re-admitted (candidates for re-admission)
  pagedkv::PrefixCacheStats interval_;   // the model of take_prefix_cache_stats()
  SeqId next_id_ = 1;
  std::vector<std::uint64_t> kv_;  // shadow K/V pool: one fingerprint per slot
  std::vector<std::uint64_t> hkv_;  // shadow host pool
  std::map<SeqId, MSeq> swapped_;   // sequences preempted by swapping
  std::set<std::uint32_t> filled_;  // device blocks filled by a swap_in since they were last unreferenced
  mutable std::map<BlockHash, std::vector<std::uint64_t>> content_of_;  // hash -> the K/V of its block
  std::vector<std::uint64_t> in_flight_tokens_;  // transfer tokens issued and not acknowledged
  std::size_t step_ = 0;
  std::string op_;
  Counters c_;
  std::uint64_t last_seq_no_ = 0;
  std::size_t last_index_size_ = 0;
  std::size_t last_host_ready_ = 0;
  std::deque<std::string> recent_ops_;  // the last operations, printed with a failure
  bool expect_cleared_ = false;
  CacheStats last_stats_;
};

constexpr std::size_t kOpsPerConfig = 17000;  // 6 configurations per hasher: ~100k operations each

template <class Hasher>
Counters run_config(const Options& o) {
  std::printf("[model-based] %s %s: block_size %u, %zu blocks, max_tokens_per_seq %zu, seed %#" PRIx64
              ", %zu ops\n",
              Hasher::kName, o.name, o.block_size, o.num_blocks, o.max_tokens_per_seq, o.seed, o.ops);
  Harness<Hasher> h(o);
  const Counters c = h.run();
  std::printf(
      "  admitted %" PRIu64 " (with hits %" PRIu64 "), no capacity %" PRIu64 ", never fits %" PRIu64
      ", appends %" PRIu64 " (no capacity %" PRIu64 ", never fits %" PRIu64 ", copy-on-write %" PRIu64
      "), forks %" PRIu64 " (refused %" PRIu64 ")"
      ", frees %" PRIu64 ", preempts %" PRIu64 ", rewinds %" PRIu64 ", lookups %" PRIu64 ", builds %" PRIu64
      ", deduplicated %" PRIu64 ", resets %" PRIu64 "/%" PRIu64 " refused, misuse %" PRIu64 ", leak checks %" PRIu64
      ", content checks %" PRIu64 ", chunked admissions %" PRIu64 ", reserves %" PRIu64 ", partial builds %" PRIu64
      ", lookaheads %" PRIu64 ", commits %" PRIu64 " (drafts accepted %" PRIu64 ", rejected %" PRIu64
      "), %" PRIu64 " comparisons\n",
      c.admitted, c.admit_hits, c.no_capacity, c.never_fits, c.appends, c.append_no_capacity, c.append_never_fits,
      c.cow, c.forks, c.fork_refused,
      c.frees, c.preempts, c.rewinds, c.lookups, c.builds, c.dedups, c.resets_ok, c.resets_refused, c.misuse, c.leak_checks,
      c.content_checks, c.chunked_admits, c.reserves, c.partial_builds, c.lookaheads, c.commits, c.accepted_drafts,
      c.rejected_drafts, c.checks);
  if (o.host_blocks != 0) {
    std::printf("  host tier: %zu blocks, host-tier hit blocks %" PRIu64 ", swaps %" PRIu64 " (refused %" PRIu64
                "), resumes %" PRIu64 " (copy pending %" PRIu64 "), acknowledgements %" PRIu64
                ", swapped content checks %" PRIu64 "\n",
                o.host_blocks, c.host_hits, c.swaps, c.swap_refused, c.resumes, c.resume_pending, c.acks,
                c.swapped_content_checks);
  }
  std::fflush(stdout);
  return c;
}

template <class Hasher>
void run_all(bool engine_discipline, std::uint64_t seed_base) {
  struct Shape {
    const char* name;
    std::uint32_t bs;
    std::size_t blocks;
    std::size_t max_tokens;
  };
  // Limits: block size 1 and 16 allow prompts longer than the pool (never fits); block size 4 has a per-sequence
  // limit well below the pool, so "append past the limit" is the common misuse.
  const Shape shapes[] = {{"bs1", 1, 128, 160}, {"bs4", 4, 64, 100}, {"bs16", 16, 64, 64 * 16 + 32}};
  std::uint64_t seed = seed_base;
  Counters total;
  for (const Shape& s : shapes) {
    const Options o{engine_discipline ? "engine discipline" : "free-form", s.bs, s.blocks, s.max_tokens,
                    engine_discipline, true, seed++, kOpsPerConfig};
    INFO("hasher " << Hasher::kName << ", block size " << s.bs << ", seed " << o.seed);
    const Counters c = run_config<Hasher>(o);
    // The run must have exercised what it claims to (a vacuous random test is a defect).
    CHECK(c.admitted > 100);
    CHECK(c.admit_hits > 20);
    CHECK(c.no_capacity > 20);
    CHECK(c.append_no_capacity > 10);
    if (s.bs > 1) CHECK(c.cow > 10);  // block size 1 has no partial blocks
    if (s.bs > 1) CHECK(c.kept_copies > 5);  // copies of sequences outside a build stayed pending
    CHECK(c.forks > 50);
    CHECK(c.preempts > 20);
    CHECK(c.rewinds > 50);
    CHECK(c.builds > 200);
    CHECK(c.resets_ok > 5);
    CHECK(c.resets_refused > 20);
    CHECK(c.misuse > 300);
    if (s.bs != 4) CHECK(c.never_fits > 0);
    CHECK(c.dedups > 10);
    if (engine_discipline) CHECK(c.content_checks > 200);
    CHECK(c.chunked_admits > 50);
    CHECK(c.reserves > 50);
    CHECK(c.partial_builds > 50);
    CHECK(c.lookaheads > 50);
    CHECK(c.commits > 50);
    CHECK(c.accepted_drafts > 50);
    CHECK(c.rejected_drafts > 50);
    total.checks += c.checks;
  }
  CHECK(total.checks > 1000000);
}

}  // namespace

TEMPLATE_TEST_CASE("model-based: random operations against a reference model (free-form)",
                   "[model_based][kv_cache_manager]", pagedkv::Sha256Hasher, pagedkv::Xxh3Hasher) {
  run_all<TestType>(false, std::is_same_v<TestType, pagedkv::Sha256Hasher> ? 0x1000 : 0x2000);
}

TEMPLATE_TEST_CASE("model-based: engine discipline with a shadow K/V pool",
                   "[model_based][kv_cache_manager][content]", pagedkv::Sha256Hasher, pagedkv::Xxh3Hasher) {
  run_all<TestType>(true, std::is_same_v<TestType, pagedkv::Sha256Hasher> ? 0x3000 : 0x4000);
}

TEST_CASE("model-based: prefix caching off", "[model_based][kv_cache_manager]") {
  const Options o{"prefix caching off", 4, 64, 100, false, false, 0x5000, kOpsPerConfig};
  const Counters c = run_config<pagedkv::Sha256Hasher>(o);
  CHECK(c.admitted > 100);
  CHECK(c.admit_hits == 0);
  CHECK(c.no_capacity > 20);
  CHECK(c.cow > 10);
}

TEMPLATE_TEST_CASE("model-based: a host tier (offload, onboarding, swap preemption, late acknowledgements)",
                   "[model_based][kv_cache_manager][host_tier]", pagedkv::Sha256Hasher, pagedkv::Xxh3Hasher) {
  const std::uint64_t base = std::is_same_v<TestType, pagedkv::Sha256Hasher> ? 0x6000 : 0x7000;
  struct Shape {
    const char* name;
    std::uint32_t bs;
    std::size_t blocks, max_tokens, host_blocks;
    bool engine;
    pagedkv::OffloadPolicy offload;
  };
  const Shape shapes[] = {{"bs4 write-back, engine", 4, 64, 100, 129, true, pagedkv::OffloadPolicy::kWriteBack},
                          {"bs16 write-through, engine", 16, 64, 64 * 16 + 32, 97, true,
                           pagedkv::OffloadPolicy::kWriteThrough},
                          {"bs1 write-back, free-form", 1, 128, 160, 200, false, pagedkv::OffloadPolicy::kWriteBack},
                          {"bs4 swap only, free-form", 4, 64, 100, 40, false, pagedkv::OffloadPolicy::kNone}};
  std::uint64_t seed = base;
  for (const Shape& sh : shapes) {
    Options o{sh.name, sh.bs, sh.blocks, sh.max_tokens, sh.engine, true, seed++, kOpsPerConfig};
    o.host_blocks = sh.host_blocks;
    o.offload = sh.offload;
    INFO("hasher " << TestType::kName << ", " << sh.name << ", seed " << o.seed);
    const Counters c = run_config<TestType>(o);
    CHECK(c.swaps > 20);
    CHECK(c.resumes > (sh.bs == 16 ? 1U : 3U));  // bs16: sequences of up to 66 blocks in a 63-block pool rarely fit back
    CHECK(c.resume_pending > 0);
    CHECK(c.acks > 100);
    if (sh.offload != pagedkv::OffloadPolicy::kNone) CHECK(c.host_hits > 20);
    if (sh.engine) {
      CHECK(c.content_checks > 200);
      CHECK(c.swapped_content_checks > 20);
    }
  }
}
