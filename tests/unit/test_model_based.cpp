// Randomized model-based test of the host core (KVCacheManager over BlockAllocator, BlockTable, PrefixHashIndex).
//
// Random operations -- admit (prompts drawn from a few shared prefixes, so prefix hits and deduplication happen),
// append 1..20 tokens, fork, free, preempt, rewind, lookup, build_batch_metadata, reset_prefix_cache, and misuse
// (unknown and duplicate ids, rewind too far, append past the limit, bad batches) -- run on small pools so that
// "no capacity" and eviction are frequent. After EVERY operation the manager is compared with a plain model
// (sequence -> token list, fingerprints, chain hashes, pending-slot count) and these invariants are checked:
//  - num_tokens, token_ids, block count = ceil(len / block_size), no null block in any table;
//  - refcount(b) = number of live tables holding b + number of pending copies reading b;
//  - every usable block is exactly one of free / cached / held, and the counts match stats();
//  - hashed <=> registered in the index; a registered full block of a live sequence is registered under the chain
//    hash of the sequence's own tokens (and keys); after a build, every full block the step writes is registered,
//    switched to the registered duplicate (its slots -1 in the slot mapping), or a shared unregistered duplicate;
//  - pending slots point at the sequence's own positions;
//  - expected outcomes are predicted exactly (admission: hits, no capacity, never fits; append: copy, capacity),
//    failed operations and every misuse leave a full state snapshot unchanged, with the documented error code;
//  - release order (tail first, through pending copies) is reproduced in the LRU order;
//  - events: seq_no +1 each, index size and eviction counter agree with stored/removed events;
//  - periodically, and at the end, after freeing everything and building an empty batch: no block leaked.
// In "engine discipline" runs (every build covers all live sequences; a sequence is forked only after its slots
// have been built), a shadow KV pool executes each built step as the kernels would (the copy list, then the slot
// mapping) and checks that every position of every live sequence reads the K/V of its own token prefix (a
// fingerprint), i.e. prefix hits, deduplication, copy-on-write, and freeing or preempting sequences whose step
// never ran never serve wrong content.
//
// Seeds are fixed and printed. Six configurations per hasher (block sizes 1, 4, 16; free-form / engine discipline)
// plus one without prefix caching.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
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
};

struct Counters {
  std::uint64_t admitted = 0, admit_hits = 0, no_capacity = 0, never_fits = 0, appends = 0, append_no_capacity = 0,
                append_never_fits = 0, fork_refused = 0,
                cow = 0, forks = 0, frees = 0, preempts = 0, rewinds = 0, lookups = 0, builds = 0, resets_ok = 0,
                resets_refused = 0, misuse = 0, leak_checks = 0, content_checks = 0, dedups = 0;
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
  }

  Counters run() {
    last_stats_ = m_.stats();
    for (step_ = 0; step_ < o_.ops; ++step_) {
      const auto r = rng_() % 1000;
      if (r < 200) {
        op_admit();
      } else if (r < 450) {
        op_append();
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
      } else {
        op_misuse();
      }
      check_all();
      if (step_ % 2500 == 2499) drain_all_and_check_no_leak();
    }
    drain_all_and_check_no_leak();
    return c_;
  }

 private:
  static constexpr std::uint64_t kHashSeed = 0x5eed;

  struct MSeq {
    Toks tokens;
    int keys = 0;
    std::vector<BlockHash> hashes;  // chain hashes of the full blocks
    std::vector<std::uint64_t> fp;  // fingerprint of the K/V at each position (depends on the prefix and keys)
    std::size_t pending = 0;        // slots appended since the last build that covered the sequence
    bool clean = true;              // nothing appended or admitted since the last build that covered it
  };

  static pagedkv::CacheConfig make_config(const Options& o) {
    pagedkv::CacheConfig c;
    c.num_blocks = o.num_blocks;
    c.block_size = o.block_size;
    c.enable_prefix_caching = o.prefix_caching;
    c.hash_seed = kHashSeed;
    c.max_tokens_per_seq = o.max_tokens_per_seq;
    c.enable_events = true;
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
    throw std::runtime_error(std::string(head) + cond + (detail.empty() ? "" : " -- " + detail));
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

  // Appends `add` to the model sequence: tokens, fingerprints, chain hashes of newly full blocks.
  void extend(MSeq& s, std::span<const TokenId> add) const {
    const RequestKeys& keys = keys_[static_cast<std::size_t>(s.keys)];
    for (TokenId t : add) {
      const std::size_t p = s.tokens.size();
      std::uint64_t f = p == 0 ? fp_seed(s.keys) : s.fp[p - 1];
      f = mix64(f ^ (static_cast<std::uint64_t>(static_cast<std::uint32_t>(t)) * 0x100000001b3ULL));
      for (const auto& mm : keys.multimodal) {
        if (p >= mm.offset_tokens && p < mm.offset_tokens + mm.length_tokens) f = mix64(f ^ mm.item_hash.low64());
      }
      s.tokens.push_back(t);
      s.fp.push_back(f);
    }
    if (o_.prefix_caching) ref_.hash_full_blocks(s.tokens, bs_, keys_ptr(s.keys), s.hashes);
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

  // Whether `id` may be forked: no unbuilt slot and no pending copy into its table.
  bool settled(SeqId id) const {
    if (model_.at(id).pending != 0) return false;
    const auto blocks = m_.block_ids(id);
    for (const auto& c : m_.pending_copies()) {
      if (std::find(blocks.begin(), blocks.end(), c.dst) != blocks.end()) return false;
    }
    return true;
  }

  // Pending copies reading block b (each holds a reference; they do not count as holders for copy-on-write).
  std::uint32_t pins(std::uint32_t b) const {
    std::uint32_t n = 0;
    for (const auto& c : m_.pending_copies()) n += c.src == b ? 1U : 0U;
    return n;
  }

  SeqId pick_live(bool need_clean) {
    std::vector<SeqId> ids;
    for (const auto& [id, s] : model_) {
      if (!need_clean || s.clean) ids.push_back(id);
    }
    if (ids.empty()) return 0;
    return ids[rng_() % ids.size()];
  }
  bool live_exists(bool need_clean) {
    for (const auto& [id, s] : model_) {
      if (!need_clean || s.clean) return true;
    }
    return false;
  }
  SeqId unknown_id() {
    if (!dead_ids_.empty() && rng_() % 2 == 0) return dead_ids_[rng_() % dead_ids_.size()];
    return next_id_ + 1000 + rng_() % 1000;
  }

  Toks gen_prompt() {
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
    const SeqId id = next_id_++;
    const Toks prompt = gen_prompt();
    const int k = rng_() % 4 == 0 ? static_cast<int>(1 + rng_() % 6) : 0;
    std::optional<std::size_t> cap;
    if (rng_() % 7 == 0) cap = rng_() % (prompt.size() + 2);
    op_ = "admit " + std::to_string(id) + " len " + std::to_string(prompt.size()) + " keys " + std::to_string(k) +
          (cap ? " cap " + std::to_string(*cap) : "");

    if (!keys_valid(k, prompt.size())) {  // a multimodal item outside the prompt: a typed error, nothing changes
      return expect_misuse([&] { m_.try_admit(id, prompt, keys_ptr(k), cap); }, Errc::kInvalidArgument,
                           "multimodal item");
    }
    // Predict the outcome exactly.
    MSeq s;
    s.keys = k;
    extend(s, prompt);
    const std::size_t eff_cap = std::min(cap.value_or(prompt.size() - 1), prompt.size());
    Ids hit_blocks;
    std::size_t evictable_hits = 0;
    for (std::size_t i = 0; i < std::min(s.hashes.size(), eff_cap / bs_); ++i) {
      const auto b = m_.prefix_index().find(s.hashes[i]);
      if (!b) break;
      hit_blocks.push_back(*b);
      if (m_.allocator().is_cached(*b)) ++evictable_hits;
    }
    const std::size_t total = blocks_for(prompt.size());
    const std::size_t hits = hit_blocks.size();
    AdmitStatus want = AdmitStatus::kAdmitted;
    if (total > usable_) {
      want = AdmitStatus::kNeverFits;
    } else if (total - hits > m_.allocator().num_available_blocks() - evictable_hits) {
      want = AdmitStatus::kNoCapacity;
    }
    // lookup is pure and agrees with the admission's walk.
    MB_CHECK(m_.lookup(prompt, keys_ptr(k), cap) == hits * bs_);

    const CacheStats st = m_.stats();
    const Snapshot before = want == AdmitStatus::kAdmitted ? Snapshot{} : snapshot();
    const auto r = m_.try_admit(id, prompt, keys_ptr(k), cap);
    MB_CHECK_MSG(r.status == want, "status " + std::to_string(static_cast<int>(r.status)) + " want " +
                                       std::to_string(static_cast<int>(want)));
    if (want != AdmitStatus::kAdmitted) {
      MB_CHECK(r.num_cached_tokens == 0 && r.num_new_blocks == 0);
      MB_CHECK(snapshot() == before);
      MB_CHECK(!m_.contains(id));
      (want == AdmitStatus::kNeverFits ? c_.never_fits : c_.no_capacity)++;
      return;
    }
    ++c_.admitted;
    if (hits > 0) ++c_.admit_hits;
    MB_CHECK(r.num_cached_tokens == hits * bs_);
    MB_CHECK(r.num_new_blocks == total - hits);
    const auto ids = m_.block_ids(id);
    MB_CHECK(ids.size() == total);
    MB_CHECK(std::equal(hit_blocks.begin(), hit_blocks.end(), ids.begin()));
    const CacheStats now = m_.stats();
    MB_CHECK(now.prefix_query_requests == st.prefix_query_requests + 1);
    MB_CHECK(now.prefix_query_tokens == st.prefix_query_tokens + prompt.size());
    MB_CHECK(now.prefix_hit_tokens == st.prefix_hit_tokens + hits * bs_);
    MB_CHECK(now.prefix_hit_requests == st.prefix_hit_requests + (hits > 0 ? 1 : 0));
    s.pending = prompt.size() - hits * bs_;
    s.clean = false;
    model_.emplace(id, std::move(s));
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

    const auto& a = m_.allocator();
    const auto blocks = m_.block_ids(id);
    const std::size_t nb = blocks.size();
    const bool cow =
        len % bs_ != 0 && (a.refcount(blocks.back()) - pins(blocks.back()) > 1 || a.is_hashed(blocks.back()));
    const std::uint32_t old_last = nb > 0 ? blocks.back() : 0;
    const std::size_t need = blocks_for(len + n) - nb + (cow ? 1 : 0);
    // Never fits: alone in the pool it would still hold more blocks than there are (a copy forced by a hash stays).
    const std::size_t held_after = blocks_for(len + n) + (cow && a.is_hashed(blocks.back()) ? 1 : 0);
    const bool never = held_after > usable_;
    const bool fits = !never && need <= a.num_available_blocks();
    const CacheStats st = m_.stats();
    const Snapshot before = fits ? Snapshot{} : snapshot();

    const auto r = m_.try_append(id, add);
    ++c_.appends;
    if (!fits) {
      (never ? c_.append_never_fits : c_.append_no_capacity)++;
      MB_CHECK(r.status == (never ? AppendStatus::kNeverFits : AppendStatus::kNoCapacity));
      MB_CHECK(r.num_missing_blocks == (never ? held_after - usable_ : need - a.num_available_blocks()));
      MB_CHECK(r.slots.empty() && !r.copy);
      MB_CHECK(snapshot() == before);
      return;
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
    extend(s, add);
    s.pending += n;
    s.clean = false;
  }

  void op_fork() {
    const bool clean = o_.engine_discipline;
    if (!live_exists(clean) || model_.size() >= 20) return op_build();
    const SeqId parent = pick_live(clean);
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
    c.pending = 0;
    model_.emplace(child, std::move(c));
  }

  void op_free(bool preempt) {
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
  }

  void op_rewind() {
    if (model_.empty()) return op_build();
    const SeqId id = pick_live(false);
    MSeq& s = model_.at(id);
    const std::size_t len = s.tokens.size();
    const std::size_t n = rng_() % 2 == 0 ? rng_() % (std::min<std::size_t>(len, bs_) + 1) : rng_() % (len + 1);
    op_ = "rewind " + std::to_string(id) + " by " + std::to_string(n) + " of " + std::to_string(len);
    const Ids blocks(m_.block_ids(id).begin(), m_.block_ids(id).end());
    const std::size_t keep = blocks_for(len - n);
    const Ids want_lru = expected_lru_after_release(Ids(blocks.begin() + static_cast<std::ptrdiff_t>(keep), blocks.end()));
    m_.rewind(id, n);
    ++c_.rewinds;
    MB_CHECK(m_.allocator().eviction_policy().order() == want_lru);
    MB_CHECK(Ids(m_.block_ids(id).begin(), m_.block_ids(id).end()) ==
             Ids(blocks.begin(), blocks.begin() + static_cast<std::ptrdiff_t>(keep)));
    truncate(s, len - n);
    s.pending -= std::min(n, s.pending);
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
      while (walk < s.hashes.size() && m_.prefix_index().find(s.hashes[walk])) ++walk;
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
    std::vector<SeqId> batch;
    for (const auto& [id, s] : model_) {
      if (o_.engine_discipline || rng_() % 4 != 0) batch.push_back(id);
    }
    std::shuffle(batch.begin(), batch.end(), rng_);
    op_ = "build " + std::to_string(batch.size());
    ++c_.builds;

    // The state before the build.
    struct Row {
      Ids blocks;
      std::size_t len;
      Slots pending;
    };
    std::vector<Row> rows;
    std::size_t total_blocks = 0, total_slots = 0, max_row = 1;
    for (SeqId id : batch) {
      Row row{Ids(m_.block_ids(id).begin(), m_.block_ids(id).end()), m_.num_tokens(id),
              m_.pending_slots(id)};
      total_blocks += row.blocks.size();
      total_slots += row.pending.size();
      max_row = std::max(max_row, row.blocks.size());
      rows.push_back(std::move(row));
    }
    std::vector<std::pair<std::uint32_t, std::uint32_t>> pre_copies;
    for (const auto& c : m_.pending_copies()) pre_copies.emplace_back(c.src, c.dst);
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

    const auto sz = m_.build_batch_metadata(batch, buf);
    MB_CHECK(sz.batch_size == B);
    MB_CHECK(sz.num_indices == total_blocks);
    MB_CHECK(sz.num_new_tokens == total_slots);

    // Registration and deduplication of the blocks this step writes.
    std::set<std::uint32_t> switched_out;
    std::size_t blk = 0, tok = 0;
    for (std::size_t b = 0; b < B; ++b) {
      const Row& row = rows[b];
      const MSeq& s = model_.at(batch[b]);
      const Ids post(m_.block_ids(batch[b]).begin(), m_.block_ids(batch[b]).end());
      MB_CHECK(post.size() == row.blocks.size());
      const std::size_t first = row.len - row.pending.size();
      std::set<std::size_t> written_blocks;
      for (std::size_t k = 0; k < row.pending.size(); ++k) written_blocks.insert((first + k) / bs_);
      for (std::size_t i = 0; i < post.size(); ++i) {
        const bool full = i < row.len / bs_;
        if (post[i] != row.blocks[i]) {  // switched to the registered duplicate
          MB_CHECK(o_.prefix_caching && full && written_blocks.contains(i));
          MB_CHECK(holders[row.blocks[i]] == 1);
          MB_CHECK(m_.prefix_index().hash_of(post[i]) == std::optional<BlockHash>(s.hashes[i]));
          switched_out.insert(row.blocks[i]);
          continue;
        }
        if (!o_.prefix_caching || !full || !written_blocks.contains(i)) continue;
        const auto h = m_.prefix_index().hash_of(post[i]);
        if (h) {
          MB_CHECK(*h == s.hashes[i]);
        } else {  // a shared duplicate stays unregistered
          const auto reg = m_.prefix_index().find(s.hashes[i]);
          MB_CHECK_MSG(reg.has_value() && *reg != post[i] && holders[post[i]] > 1,
                       "sequence " + std::to_string(batch[b]) + " block " + std::to_string(i) + " not registered");
        }
      }
      // Outputs, against the tables after registration.
      MB_CHECK(indptr[b] == static_cast<std::int32_t>(blk));
      MB_CHECK(qo[b] == static_cast<std::int32_t>(tok));
      const std::uint32_t last = row.len == 0 ? 0 : static_cast<std::uint32_t>(row.len - (post.size() - 1) * bs_);
      MB_CHECK(lpl[b] == static_cast<std::int32_t>(last));
      MB_CHECK(seq_lens[b] == static_cast<std::int32_t>(row.len));
      for (std::size_t i = 0; i < row_len; ++i) {
        MB_CHECK(tables[b * row_len + i] == (i < post.size() ? static_cast<std::int32_t>(post[i]) : 0));
      }
      for (std::size_t i = 0; i < post.size(); ++i) MB_CHECK(indices[blk + i] == static_cast<std::int32_t>(post[i]));
      for (std::size_t k = 0; k < row.pending.size(); ++k) {
        const std::size_t p = first + k;
        const std::int64_t want = post[p / bs_] != row.blocks[p / bs_] ? -1 : row.pending[k];
        MB_CHECK(slots[tok + k] == want);
      }
      blk += post.size();
      tok += row.pending.size();
    }
    MB_CHECK(m_.stats().dedup_blocks == st.dedup_blocks + switched_out.size());
    c_.dedups += switched_out.size();
    // Copies: the pending ones, in order, less those whose destination was switched out (dropped with it).
    MB_CHECK(sz.num_copies <= pre_copies.size());
    std::size_t j = 0;
    for (const auto& [src, dst] : pre_copies) {
      if (j < sz.num_copies && cp[2 * j] == static_cast<std::int32_t>(src) &&
          cp[2 * j + 1] == static_cast<std::int32_t>(dst)) {
        ++j;
      } else {
        MB_CHECK_MSG(switched_out.contains(dst), "copy " + std::to_string(src) + " -> " + std::to_string(dst) +
                                                    " missing from the copy list");
      }
    }
    MB_CHECK(j == sz.num_copies);
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
    MB_CHECK(m_.pending_copies().empty());
    for (SeqId id : batch) {
      MB_CHECK(m_.pending_slots(id).empty());
      model_.at(id).pending = 0;
      model_.at(id).clean = true;
    }

    if (o_.engine_discipline) {
      // What the kernels do with this step: copy_blocks over the copy list, then write_kv over the slot mapping.
      std::set<std::uint32_t> srcs, dsts;
      for (std::size_t i = 0; i < sz.num_copies; ++i) {
        srcs.insert(static_cast<std::uint32_t>(cp[2 * i]));
        dsts.insert(static_cast<std::uint32_t>(cp[2 * i + 1]));
      }
      for (auto b : srcs) MB_CHECK_MSG(!dsts.contains(b), "block both read and written by one copy_blocks launch");
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
        const std::size_t first = s.tokens.size() - n;
        for (std::size_t k = 0; k < n; ++k) {
          const std::int64_t sl = slots[static_cast<std::size_t>(qo[b]) + k];
          if (sl < 0) continue;
          const std::size_t p = first + k;
          MB_CHECK(sl == static_cast<std::int64_t>(ids[p / bs_]) * bs_ + static_cast<std::int64_t>(p % bs_));
          MB_CHECK_MSG(written.insert(sl).second, "two tokens of one step write the same slot");
          kv_[static_cast<std::size_t>(sl)] = s.fp[p];
        }
      }
      for (const auto& [id, s] : model_) {
        const auto ids = m_.block_ids(id);
        for (std::size_t p = 0; p < s.tokens.size(); ++p) {
          const std::size_t slot = ids[p / bs_] * bs_ + p % bs_;
          ++c_.checks;
          if (kv_[slot] != s.fp[p]) {
            fail(__LINE__, "shadow K/V mismatch", "sequence " + std::to_string(id) + " position " +
                                                      std::to_string(p) + " block " + std::to_string(ids[p / bs_]));
          }
        }
      }
      ++c_.content_checks;
    }
  }

  void op_reset() {
    if (rng_() % 3 == 0) drain_all_and_check_no_leak();
    op_ = "reset_prefix_cache";
    const bool want = m_.stats().blocks_used == 0;
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
    for (auto& [id, s] : model_) s.hashes.clear();  // all live sequences are empty
    expect_cleared_ = true;
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
      return expect_misuse([&] { m_.try_admit(bad, Toks{}); }, Errc::kInvalidArgument, "sequence " + bad_s);
    }
    const SeqId live = pick_live(false);
    const std::string live_s = std::to_string(live);
    const std::size_t len = model_.at(live).tokens.size();
    switch (kind) {
      case 7:
        return expect_misuse([&] { m_.try_admit(live, Toks{1, 2, 3}); }, Errc::kDuplicateSequence,
                             "sequence " + live_s);
      case 8: {
        const SeqId parent = pick_live(false);
        return expect_misuse([&] { m_.fork(parent, live); }, Errc::kDuplicateSequence, "sequence " + live_s);
      }
      case 9:
        return expect_misuse([&] { m_.rewind(live, len + 1 + rng_() % 5); }, Errc::kLimitExceeded,
                             "sequence " + live_s);
      case 10: {
        const Toks add(o_.max_tokens_per_seq - len + 1 + rng_() % 3, 1);
        return expect_misuse([&] { m_.try_append(live, add); }, Errc::kLimitExceeded, "sequence " + live_s);
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
        if (model_.at(live).pending > 0) {  // a build cannot drop the writes it would register
          return expect_misuse(
              [&] { m_.build_batch_metadata(std::vector<SeqId>{live}, pagedkv::BatchMetadataBuffers{}); },
              Errc::kBadShape, "slot_mapping is empty");
        }
        if (!m_.pending_copies().empty()) {  // nor the copies it would hand out
          return expect_misuse(
              [&] { m_.build_batch_metadata(std::vector<SeqId>{}, pagedkv::BatchMetadataBuffers{}); },
              Errc::kBadShape, "copies is empty");
        }
        if (len > 0) {  // a multimodal item past the prompt, or wrapping past 2^64
          RequestKeys k;
          k.multimodal.push_back({hash_of_u64(0xC), rng_() % 2 == 0 ? len : ~std::uint64_t{0} - 1, 3});
          return expect_misuse([&] { m_.try_admit(next_id_ + 9000, model_.at(live).tokens, &k); },
                               Errc::kInvalidArgument, "multimodal item 0");
        }
        [[fallthrough]];
      default: {
        const std::size_t pend = model_.at(live).pending;
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

  // Free every sequence, hand out the pending copies, and check that no block leaked.
  void drain_all_and_check_no_leak() {
    op_ = "drain all";
    while (!model_.empty()) {
      const SeqId id = model_.begin()->first;
      m_.free(id);
      model_.erase(id);
      dead_ids_.push_back(id);
    }
    const auto sz = m_.build_batch_metadata(std::vector<SeqId>{}, pagedkv::BatchMetadataBuffers{});
    MB_CHECK(sz.batch_size == 0);
    const CacheStats s = m_.stats();
    MB_CHECK(s.blocks_used == 0);
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
      MB_CHECK(m_.num_tokens(id) == len);
      const auto toks = m_.token_ids(id);
      MB_CHECK(toks.size() == len && (len == 0 || std::memcmp(toks.data(), s.tokens.data(), len * sizeof(TokenId)) == 0));
      const auto blocks = m_.block_ids(id);
      MB_CHECK(blocks.size() == blocks_for(len));
      for (std::uint32_t b : blocks) {
        MB_CHECK(b != 0 && b < a.num_blocks());
        ++rc[b];
      }
      if (o_.prefix_caching) {
        MB_CHECK(s.hashes.size() == len / bs_);
        for (std::size_t i = 0; i < len / bs_; ++i) {  // content addressing: a registered block holds its hash
          const auto h = idx.hash_of(blocks[i]);
          MB_CHECK_MSG(!h || *h == s.hashes[i], "sequence " + std::to_string(id) + " block " + std::to_string(i) +
                                                    " registered under another hash");
        }
      }
      // Pending slots: exactly the sequence's own positions (-1 appears only in the built slot mapping).
      const auto pend = m_.pending_slots(id);
      MB_CHECK(pend.size() == s.pending);
      MB_CHECK(s.pending <= len);
      const std::size_t first = len - pend.size();
      for (std::size_t k = 0; k < pend.size(); ++k) {
        const std::size_t p = first + k;
        const std::int64_t sl = pend[k];
        const std::uint32_t own = blocks[p / bs_];
        MB_CHECK_MSG(sl == static_cast<std::int64_t>(own) * bs_ + static_cast<std::int64_t>(p % bs_),
                     "sequence " + std::to_string(id) + " position " + std::to_string(p) + " slot " + std::to_string(sl));
      }
    }
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
    std::size_t stored = 0, removed = 0;
    bool cleared = false;
    for (const auto& e : ev) {
      MB_CHECK(e.seq_no == last_seq_no_ + 1);
      last_seq_no_ = e.seq_no;
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
    last_index_size_ = idx.size();
    last_stats_ = st;
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
  SeqId next_id_ = 1;
  std::vector<std::uint64_t> kv_;  // shadow K/V pool: one fingerprint per slot
  std::size_t step_ = 0;
  std::string op_;
  Counters c_;
  std::uint64_t last_seq_no_ = 0;
  std::size_t last_index_size_ = 0;
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
      ", content checks %" PRIu64 ", %" PRIu64 " comparisons\n",
      c.admitted, c.admit_hits, c.no_capacity, c.never_fits, c.appends, c.append_no_capacity, c.append_never_fits,
      c.cow, c.forks, c.fork_refused,
      c.frees, c.preempts, c.rewinds, c.lookups, c.builds, c.dedups, c.resets_ok, c.resets_refused, c.misuse, c.leak_checks,
      c.content_checks, c.checks);
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
