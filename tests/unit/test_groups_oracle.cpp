// Differential test of the merged KVCacheManager (issue 17) against the hybrid manager from before the merge
// (tests/unit/oracle/old_hybrid_manager.hpp, f655591's HybridKVCacheManager): the same random operation sequences
// run on both, over random KV-cache group mixes (1 to 4 groups of full attention, sliding window W and chunked-local
// C with W, C in {1, 3, bs, 2bs + 1, 1000}; block sizes 1, 4, 16; pools small enough that admissions and growth hit
// kNoCapacity / kNeverFits and cached blocks are evicted). Every result (all fields), every exception code, every
// build's output buffers (every span, padding included) and sizes, and after every operation the whole observable
// state (every sequence's tokens, cursors and per-group block tables, null blocks and pending slots; the pending
// copies; every block's refcount, hashed and cached state, group and registration in each group's index; the LRU
// order; held / peak blocks per group; CacheStats; drained KVEvents, field by field) must be equal.
//
// Operations: admission (prompts sharing prefixes, extra keys, max_cached_tokens, num_reserved_tokens, duplicate
// ids, empty and over-long prompts, re-admission of preempted ids) with query_admit and lookup first; query_append,
// append and try_reserve (incl. refused ones); fork (settled and unsettled parents, duplicate children); free and
// preempt (incl. unknown ids); rewind (incl. refused rewinds behind a released block, and past the length); builds of
// random batches with random num_scheduled_tokens (incl. idle rows, repeated and unknown ids, too-small and skipped
// buffers); reset_prefix_cache; take_prefix_cache_stats; reset_peaks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <pagedkv/kv_cache_groups.hpp>

#include "oracle/old_hybrid_manager.hpp"
#include "test_support.hpp"

namespace {

using pagedkv::AdmitOptions;
using pagedkv::AdmitResult;
using pagedkv::AttentionKind;
using pagedkv::BatchMetadataBuffers;
using pagedkv::BatchMetadataSizes;
using pagedkv::BlockHash;
using pagedkv::CacheConfig;
using pagedkv::CacheStats;
using pagedkv::CapacityQuery;
using pagedkv::Errc;
using pagedkv::KVCacheGroupSpec;
using pagedkv::KVEvent;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using OldMgr = pagedkv_test::old::OldHybridKVCacheManager<pagedkv::Xxh3Hasher>;
using NewMgr = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;
using Toks = std::vector<TokenId>;

/// Runs f; the code of the pagedkv::Error it throws, nullopt when it returns.
template <class F>
std::optional<Errc> code_of(F&& f) {
  try {
    f();
  } catch (const pagedkv::Error& e) {
    return e.code();
  }
  return std::nullopt;
}
std::string code_str(const std::optional<Errc>& c) { return c ? pagedkv::to_string(*c) : "ok"; }

/// Everything observable about a manager (old or new: the same queries), for an exact comparison.
struct SeqSnap {
  Toks tokens;
  std::size_t num_tokens = 0, num_built = 0;
  std::vector<std::vector<std::uint32_t>> tables;       // [G]
  std::vector<std::size_t> nulls;                       // [G]
  std::vector<std::vector<std::int64_t>> pending;       // [G]
  friend bool operator==(const SeqSnap&, const SeqSnap&) = default;
};
struct Snap {
  std::map<SeqId, SeqSnap> seqs;
  std::vector<std::tuple<std::uint32_t, std::uint32_t, std::uint32_t>> copies;
  std::vector<std::tuple<std::uint32_t, bool, bool, std::uint32_t>> blocks;  // refcount, hashed, cached, group
  std::vector<std::uint32_t> lru;
  std::vector<std::size_t> held, peak_held, index_size;
  std::vector<std::tuple<std::size_t, std::uint32_t, BlockHash>> registered;  // (group, block, hash)
  std::size_t peak_used = 0;
  std::vector<double> stats;
};

std::vector<double> stats_fields(const CacheStats& s) {
  return {static_cast<double>(s.num_usable_blocks), static_cast<double>(s.blocks_used),
          static_cast<double>(s.blocks_cached), static_cast<double>(s.blocks_free), s.usage,
          static_cast<double>(s.prefix_query_requests), static_cast<double>(s.prefix_hit_requests),
          static_cast<double>(s.prefix_query_tokens), static_cast<double>(s.prefix_hit_tokens),
          static_cast<double>(s.readmitted_requests), static_cast<double>(s.readmitted_query_tokens),
          static_cast<double>(s.readmitted_hit_tokens), static_cast<double>(s.evictions),
          static_cast<double>(s.cow_copies), static_cast<double>(s.dedup_blocks), static_cast<double>(s.preemptions),
          static_cast<double>(s.block_ops), static_cast<double>(s.host_num_usable_blocks),
          static_cast<double>(s.host_blocks_used), static_cast<double>(s.host_blocks_cached),
          static_cast<double>(s.host_blocks_free), static_cast<double>(s.host_hit_tokens),
          static_cast<double>(s.host_evictions), static_cast<double>(s.offloads),
          static_cast<double>(s.offloads_dropped), static_cast<double>(s.offloads_below_priority),
          static_cast<double>(s.onboards), static_cast<double>(s.swap_outs), static_cast<double>(s.swap_ins),
          static_cast<double>(s.transfers_in_flight), static_cast<double>(s.transfers_queued),
          static_cast<double>(s.events_lost)};
}

template <class M>
Snap snap(const M& m) {
  Snap s;
  const std::size_t G = m.num_groups();
  m.for_each_sequence([&](SeqId id, std::size_t n) {
    SeqSnap q;
    const auto t = m.token_ids(id);
    q.tokens.assign(t.begin(), t.end());
    q.num_tokens = n;
    q.num_built = m.num_built(id);
    for (std::size_t g = 0; g < G; ++g) {
      const auto b = m.block_ids(id, g);
      q.tables.emplace_back(b.begin(), b.end());
      q.nulls.push_back(m.num_null_blocks(id, g));
      q.pending.push_back(m.pending_slots(id, g));
    }
    s.seqs[id] = std::move(q);
  });
  for (const auto& c : m.pending_copies()) s.copies.emplace_back(c.src, c.dst, c.group);
  const auto& a = m.allocator();
  for (std::uint32_t b = 1; b < a.num_blocks(); ++b) {
    s.blocks.emplace_back(a.refcount(b), a.is_hashed(b), a.is_cached(b), G > 1 ? m.group_of(b) : 0U);
    for (std::size_t g = 0; g < G; ++g) {
      if (const auto h = m.prefix_index(g).hash_of(b)) s.registered.emplace_back(g, b, *h);
    }
  }
  s.lru = a.eviction_policy().order();
  for (std::size_t g = 0; g < G; ++g) {
    s.held.push_back(m.held_blocks(g));
    s.peak_held.push_back(m.peak_held_blocks(g));
    s.index_size.push_back(m.prefix_index(g).size());
  }
  s.peak_used = m.peak_used_blocks();
  s.stats = stats_fields(m.stats());
  return s;
}

/// The names of the parts of two snapshots that differ (empty: equal). `simple`: one full-attention group, where
/// the merged manager samples its peaks at the end of each call that takes blocks (documented on
/// peak_held_blocks), not at every allocation as the old one did: its peak may be lower than the old one's (a block
/// taken and released within one call, as a build's deduplication does), never below what is used now.
std::string snap_diff(const Snap& o, const Snap& n, bool simple) {
  std::ostringstream out;
  if (o.seqs.size() != n.seqs.size()) out << "live sequences " << o.seqs.size() << " vs " << n.seqs.size() << "; ";
  for (const auto& [id, q] : o.seqs) {
    const auto it = n.seqs.find(id);
    if (it == n.seqs.end()) {
      out << "sequence " << id << " missing in new; ";
      continue;
    }
    const SeqSnap& r = it->second;
    if (q.tokens != r.tokens) out << "seq " << id << " tokens; ";
    if (q.num_tokens != r.num_tokens) out << "seq " << id << " tokens " << q.num_tokens << "/" << r.num_tokens << "; ";
    if (q.num_built != r.num_built) out << "seq " << id << " num_built " << q.num_built << "/" << r.num_built << "; ";
    for (std::size_t g = 0; g < q.tables.size(); ++g) {
      if (q.tables[g] != r.tables[g]) out << "seq " << id << " group " << g << " block table; ";
      if (q.nulls[g] != r.nulls[g]) {
        out << "seq " << id << " group " << g << " null blocks " << q.nulls[g] << " vs " << r.nulls[g] << "; ";
      }
      if (q.pending[g] != r.pending[g]) out << "seq " << id << " group " << g << " pending slots; ";
    }
  }
  if (o.copies != n.copies) out << "pending copies; ";
  for (std::size_t b = 0; b < o.blocks.size(); ++b) {
    if (o.blocks[b] != n.blocks[b]) {
      const auto& [rc0, h0, c0, g0] = o.blocks[b];
      const auto& [rc1, h1, c1, g1] = n.blocks[b];
      out << "block " << b + 1 << " (refcount, hashed, cached, group) " << rc0 << h0 << c0 << g0 << " vs " << rc1 << h1
          << c1 << g1 << "; ";
    }
  }
  if (o.registered != n.registered) out << "prefix index registrations; ";
  if (o.lru != n.lru) out << "LRU order; ";
  if (o.held != n.held) out << "held blocks per group; ";
  if (simple) {
    const std::size_t used_now = static_cast<std::size_t>(n.stats[1]);
    const bool ok = n.peak_used <= o.peak_used && n.peak_used >= used_now &&
                    n.peak_held == std::vector<std::size_t>{n.peak_used};
    if (!ok) {
      out << "simple peaks: new " << n.peak_used << " old " << o.peak_used << " used " << used_now << "; ";
    }
  } else if (o.peak_held != n.peak_held) {
    out << "peak held blocks per group; ";
  }
  if (o.index_size != n.index_size) out << "index sizes; ";
  if (!simple && o.peak_used != n.peak_used) out << "peak used blocks " << o.peak_used << " vs " << n.peak_used << "; ";
  for (std::size_t i = 0; i < o.stats.size(); ++i) {
    if (o.stats[i] != n.stats[i]) out << "CacheStats field " << i << ": " << o.stats[i] << " vs " << n.stats[i] << "; ";
  }
  return out.str();
}

std::string event_diff(const std::vector<KVEvent>& a, const std::vector<KVEvent>& b) {
  std::ostringstream out;
  if (a.size() != b.size()) out << "event count " << a.size() << " vs " << b.size() << "; ";
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    const KVEvent& x = a[i];
    const KVEvent& y = b[i];
    bool mm = x.multimodal_items.size() == y.multimodal_items.size();
    for (std::size_t j = 0; mm && j < x.multimodal_items.size(); ++j) {
      mm = x.multimodal_items[j].item_hash == y.multimodal_items[j].item_hash &&
           x.multimodal_items[j].offset_tokens == y.multimodal_items[j].offset_tokens &&
           x.multimodal_items[j].length_tokens == y.multimodal_items[j].length_tokens;
    }
    if (!(x.seq_no == y.seq_no && x.type == y.type && x.hash == y.hash && x.parent_hash == y.parent_hash &&
          x.token_ids == y.token_ids && x.block_size == y.block_size && x.block_start == y.block_start &&
          x.adapter_id == y.adapter_id && mm && x.salt == y.salt && x.medium == y.medium && x.group == y.group)) {
      out << "event " << i << " (seq_no " << x.seq_no << " vs " << y.seq_no << ", type " << int(x.type) << " vs "
          << int(y.type) << ", group " << x.group << " vs " << y.group << "); ";
    }
  }
  return out.str();
}

/// One build's buffers for every group, every output on unless switched off; -7 everywhere (padding is checked).
struct BufSet {
  std::vector<std::vector<std::int32_t>> indptr, indices, last_page_len, seq_lens, qo_indptr, copies, block_tables;
  std::vector<std::vector<std::int64_t>> slots;
  std::vector<BatchMetadataBuffers> views;
  friend bool operator==(const BufSet& a, const BufSet& b) {
    return a.indptr == b.indptr && a.indices == b.indices && a.last_page_len == b.last_page_len &&
           a.seq_lens == b.seq_lens && a.qo_indptr == b.qo_indptr && a.copies == b.copies &&
           a.block_tables == b.block_tables && a.slots == b.slots;
  }
};
/// Sizes per group (0 = that output skipped).
struct BufShape {
  std::size_t indptr, indices, last_page_len, seq_lens, qo_indptr, copies, block_tables, slots;
  std::int32_t max_blocks_per_seq;
};
BufSet make_bufs(const std::vector<BufShape>& shapes) {
  BufSet s;
  const std::size_t G = shapes.size();
  for (auto* v : {&s.indptr, &s.indices, &s.last_page_len, &s.seq_lens, &s.qo_indptr, &s.copies, &s.block_tables}) {
    v->resize(G);
  }
  s.slots.resize(G);
  s.views.resize(G);
  for (std::size_t g = 0; g < G; ++g) {
    const BufShape& sh = shapes[g];
    s.indptr[g].assign(sh.indptr, -7);
    s.indices[g].assign(sh.indices, -7);
    s.last_page_len[g].assign(sh.last_page_len, -7);
    s.seq_lens[g].assign(sh.seq_lens, -7);
    s.qo_indptr[g].assign(sh.qo_indptr, -7);
    s.copies[g].assign(sh.copies, -7);
    s.block_tables[g].assign(sh.block_tables, -7);
    s.slots[g].assign(sh.slots, -7);
  }
  for (std::size_t g = 0; g < G; ++g) {  // views after every vector has its final address
    BatchMetadataBuffers& v = s.views[g];
    v.indptr = s.indptr[g];
    v.indices = s.indices[g];
    v.last_page_len = s.last_page_len[g];
    v.seq_lens = s.seq_lens[g];
    v.qo_indptr = s.qo_indptr[g];
    v.copies = s.copies[g];
    v.block_tables = s.block_tables[g];
    v.max_blocks_per_seq = shapes[g].max_blocks_per_seq;
    v.slot_mapping = s.slots[g];
  }
  return s;
}

bool same_admit(const AdmitResult& a, const AdmitResult& b) {
  return a.status == b.status && a.num_cached_tokens == b.num_cached_tokens &&
         a.num_host_cached_tokens == b.num_host_cached_tokens && a.num_new_blocks == b.num_new_blocks &&
         a.num_missing_blocks == b.num_missing_blocks;
}
bool same_query(const CapacityQuery& a, const CapacityQuery& b) {
  return a.status == b.status && a.num_blocks == b.num_blocks && a.num_missing_blocks == b.num_missing_blocks &&
         a.num_cached_tokens == b.num_cached_tokens;
}
std::string str(const CapacityQuery& q) {
  std::ostringstream o;
  o << "{status " << int(q.status) << ", blocks " << q.num_blocks << ", missing " << q.num_missing_blocks
    << ", cached " << q.num_cached_tokens << "}";
  return o.str();
}
std::string str(const AdmitResult& r) {
  std::ostringstream o;
  o << "{status " << int(r.status) << ", cached " << r.num_cached_tokens << ", host " << r.num_host_cached_tokens
    << ", new " << r.num_new_blocks << ", missing " << r.num_missing_blocks << "}";
  return o.str();
}

class DiffHarness {
 public:
  DiffHarness(const CacheConfig& c, std::uint64_t seed, std::size_t prefix_max)
      : o_(c), n_(c), rng_(seed), bs_(c.block_size), prefix_max_(prefix_max) {
    for (int i = 0; i < 4; ++i) {
      Toks p;
      const std::size_t len = 1 + rng_() % prefix_max_;
      for (std::size_t j = 0; j < len; ++j) p.push_back(static_cast<TokenId>(rng_() % 3 == 0 ? 7 : rng_() % 1000));
      prefixes_.push_back(std::move(p));
    }
  }

  void run(std::size_t ops) {
    for (std::size_t op = 0; op < ops; ++op) {
      step_ = op;
      const int k = static_cast<int>(rng_() % 100);
      if (live_.size() > 14 && k < 50) {
        free_one(false);
      } else if (k < 17) {
        admit();
      } else if (k < 20) {
        query_only();
      } else if (k < 38) {
        append();
      } else if (k < 45) {
        reserve();
      } else if (k < 51) {
        fork();
      } else if (k < 57) {
        free_one(false);
      } else if (k < 61) {
        free_one(true);
      } else if (k < 68) {
        rewind();
      } else if (k < 96) {
        build();
      } else if (k < 97) {
        reset();
      } else {
        misc();
      }
      compare();
    }
    // Drain: everything freed, both pools empty.
    while (!live_.empty()) free_one(false);
    compare();
    REQUIRE(n_.stats().blocks_used == 0);
  }

  std::size_t admitted = 0, hits = 0, no_capacity = 0, never_fits = 0, errors = 0, builds = 0, build_errors = 0,
              copies = 0, dedups = 0, refused_rewinds = 0, evictions = 0, events = 0, forks = 0, switched_slots = 0,
              simple_never_fits = 0;

 private:
  template <class R>
  void same_outcome(const char* what, std::optional<Errc> eo, std::optional<Errc> en, const R& ro, const R& rn,
                    bool equal, std::string (*show)(const R&) = nullptr) {
    INFO(what << " at op " << step_ << ": old " << code_str(eo) << " new " << code_str(en));
    REQUIRE(eo == en);
    if (eo) {
      ++errors;
      return;
    }
    if (!equal && show != nullptr) FAIL(what << " at op " << step_ << ": old " << show(ro) << " new " << show(rn));
    REQUIRE(equal);
  }

  bool simple() const { return n_.num_groups() == 1 && !n_.window(0).enabled(); }
  SeqId pick_live() {
    return live_[rng_() % live_.size()];
  }
  SeqId pick_id() {  // mostly live, else unknown
    if (live_.empty() || rng_() % 12 == 0) return 900000 + rng_() % 5;
    return pick_live();
  }
  void drop_live(SeqId id) { live_.erase(std::find(live_.begin(), live_.end(), id)); }

  Toks random_prompt() {
    if (rng_() % 40 == 0) return {};  // refused: empty
    Toks p = prefixes_[rng_() % prefixes_.size()];
    p.resize(rng_() % (p.size() + 1));
    const std::size_t extra = rng_() % (2 * bs_ + 4);
    for (std::size_t i = 0; i < extra; ++i) p.push_back(static_cast<TokenId>(rng_() % 3 == 0 ? 7 : rng_() % 1000));
    if (p.empty()) p.push_back(5);
    return p;
  }
  std::optional<RequestKeys> random_keys(std::size_t prompt_len) {
    const int k = static_cast<int>(rng_() % 20);
    if (k >= 4) return std::nullopt;
    RequestKeys r;
    if (k == 0) r.salt = rng_() % 2 ? "a" : "b";
    if (k == 1) r.adapter_id = 1 + rng_() % 2;
    if (k >= 2) {
      pagedkv::MultimodalItem it;
      it.item_hash.bytes[0] = static_cast<std::uint8_t>(rng_() % 2);
      it.offset_tokens = rng_() % (prompt_len + 1);
      it.length_tokens = k == 2 ? 1 + rng_() % 3 : 0;  // k == 3: empty item (refused)
      r.multimodal.push_back(it);
    }
    return r;
  }
  AdmitOptions random_opts(std::size_t len) {
    AdmitOptions o;
    if (rng_() % 4 == 0) o.max_cached_tokens = rng_() % (len + 3);
    if (rng_() % 3 == 0) o.num_reserved_tokens = rng_() % (len + 2);
    return o;
  }

  void admit() {
    const Toks p = random_prompt();
    const auto keys = random_keys(p.size());
    const RequestKeys* kp = keys ? &*keys : nullptr;
    const AdmitOptions o = random_opts(p.size());
    query(p, kp, o);
    SeqId id = next_id_++;
    const int k = static_cast<int>(rng_() % 20);
    if (k == 0 && !live_.empty()) id = pick_live();               // duplicate
    if (k == 1 && !preempted_.empty()) {                          // re-admission of a preempted id
      const SeqId pid = preempted_[rng_() % preempted_.size()];
      if (std::find(live_.begin(), live_.end(), pid) == live_.end()) id = pid;
    }
    AdmitResult ro, rn;
    const auto eo = code_of([&] { ro = o_.try_admit(id, p, kp, o); });
    const auto en = code_of([&] { rn = n_.try_admit(id, p, kp, o); });
    same_outcome("try_admit", eo, en, ro, rn, same_admit(ro, rn), &str);
    if (eo) return;
    if (ro.admitted()) {
      live_.push_back(id);
      ++admitted;
      hits += ro.num_cached_tokens > 0 ? 1 : 0;
    } else if (ro.status == pagedkv::AdmitStatus::kNoCapacity) {
      ++no_capacity;
    } else {
      ++never_fits;
    }
  }
  void query(const Toks& p, const RequestKeys* kp, const AdmitOptions& o) {
    CapacityQuery qo, qn;
    const auto eo = code_of([&] { qo = o_.query_admit(p, kp, o); });
    const auto en = code_of([&] { qn = n_.query_admit(p, kp, o); });
    // One full-attention group: the merged manager answers a prompt longer than the pool from its single-group
    // fast path (as KVCacheManager did before the merge): num_blocks = every block of the prompt, num_cached_tokens
    // 0, where the old hybrid manager counted the blocks of the reserved chunk and the hit. Status and missing
    // blocks agree; those two informational fields of a kNeverFits answer are left out of the comparison there.
    const bool simple_never = simple() && qo.status == pagedkv::CapacityStatus::kNeverFits &&
                              qn.status == pagedkv::CapacityStatus::kNeverFits;
    same_outcome("query_admit", eo, en, qo, qn,
                 simple_never ? qo.num_missing_blocks == qn.num_missing_blocks : same_query(qo, qn), &str);
    simple_never_fits += simple_never ? 1 : 0;
    std::size_t lo = 0, ln = 0;
    const auto cap = rng_() % 3 == 0 ? std::optional<std::size_t>(rng_() % (p.size() + 3)) : std::nullopt;
    const auto e2o = code_of([&] { lo = o_.lookup(p, kp, cap); });
    const auto e2n = code_of([&] { ln = n_.lookup(p, kp, cap); });
    INFO("lookup " << lo << " vs " << ln);
    same_outcome("lookup", e2o, e2n, lo, ln, lo == ln);
  }
  void query_only() {
    const Toks p = random_prompt();
    const auto keys = random_keys(p.size());
    query(p, keys ? &*keys : nullptr, random_opts(p.size()));
  }

  template <class RO, class RN>
  void same_growth(const char* what, std::optional<Errc> eo, std::optional<Errc> en, const RO& ro, const RN& rn) {
    INFO(what << " at op " << step_ << ": old " << code_str(eo) << " new " << code_str(en));
    REQUIRE(eo == en);
    if (eo) {
      ++errors;
      return;
    }
    INFO("status " << int(ro.status) << "/" << int(rn.status) << " new blocks " << ro.num_new_blocks << "/"
                   << rn.num_new_blocks << " missing " << ro.num_missing_blocks << "/" << rn.num_missing_blocks);
    REQUIRE(ro.status == rn.status);
    REQUIRE(ro.num_new_blocks == rn.num_new_blocks);
    REQUIRE(ro.num_missing_blocks == rn.num_missing_blocks);
    if (ro.status == pagedkv::AppendStatus::kNoCapacity) ++no_capacity;
    if (ro.status == pagedkv::AppendStatus::kNeverFits) ++never_fits;
  }
  void query_append(SeqId id, std::size_t n) {
    CapacityQuery qo, qn;
    const auto eo = code_of([&] { qo = o_.query_append(id, n); });
    const auto en = code_of([&] { qn = n_.query_append(id, n); });
    same_outcome("query_append", eo, en, qo, qn, same_query(qo, qn), &str);
  }
  void append() {
    const SeqId id = pick_id();
    const std::size_t n = rng_() % 7;
    Toks t;
    for (std::size_t i = 0; i < n; ++i) t.push_back(static_cast<TokenId>(rng_() % 3 == 0 ? 7 : rng_() % 1000));
    query_append(id, n);
    pagedkv_test::old::GrowthResult ro;
    pagedkv::AppendResult<std::uint32_t> rn;
    const auto eo = code_of([&] { ro = o_.try_append(id, t); });
    const auto en = code_of([&] { rn = n_.try_append(id, t); });
    same_growth("try_append", eo, en, ro, rn);
  }
  void reserve() {
    const SeqId id = pick_id();
    std::size_t un = 0;
    if (n_.contains(id)) un = n_.sequence(id).num_unslotted();
    const std::size_t n = rng_() % 8 == 0 ? un + 1 : (un == 0 ? 0 : 1 + rng_() % un);
    query_append(id, n);
    pagedkv_test::old::GrowthResult ro;
    pagedkv::AppendResult<std::uint32_t> rn;
    const auto eo = code_of([&] { ro = o_.try_reserve(id, n); });
    const auto en = code_of([&] { rn = n_.try_reserve(id, n); });
    same_growth("try_reserve", eo, en, ro, rn);
  }
  void fork() {
    const SeqId parent = pick_id();
    SeqId child = next_id_++;
    const int k = static_cast<int>(rng_() % 20);
    if (k == 0 && !live_.empty()) child = pick_live();
    if (k == 1) child = parent;
    const auto eo = code_of([&] { o_.fork(parent, child); });
    const auto en = code_of([&] { n_.fork(parent, child); });
    INFO("fork at op " << step_ << ": old " << code_str(eo) << " new " << code_str(en));
    REQUIRE(eo == en);
    if (eo) {
      ++errors;
      return;
    }
    live_.push_back(child);
    ++forks;
  }
  void free_one(bool preempt) {
    const SeqId id = live_.empty() ? 900001 : pick_id();
    const auto eo = code_of([&] { preempt ? o_.preempt(id) : o_.free(id); });
    const auto en = code_of([&] { preempt ? n_.preempt(id) : n_.free(id); });
    INFO((preempt ? "preempt" : "free") << " at op " << step_ << ": old " << code_str(eo) << " new " << code_str(en));
    REQUIRE(eo == en);
    if (eo) {
      ++errors;
      return;
    }
    drop_live(id);
    if (preempt) preempted_.push_back(id);
  }
  void rewind() {
    const SeqId id = pick_id();
    std::size_t len = 0;
    if (n_.contains(id)) len = n_.token_ids(id).size();
    const std::size_t n = rng_() % 4 == 0 ? rng_() % (len + 3) : rng_() % (std::min<std::size_t>(len, 2 * bs_) + 1);
    const auto eo = code_of([&] { o_.rewind(id, n); });
    const auto en = code_of([&] { n_.rewind(id, n); });
    INFO("rewind(" << id << ", " << n << ") at op " << step_ << ": old " << code_str(eo) << " new " << code_str(en));
    REQUIRE(eo == en);
    if (eo) {
      ++errors;
      if (*eo == Errc::kLimitExceeded && n <= len) ++refused_rewinds;
    }
  }

  void build() {
    const std::size_t G = n_.num_groups();
    std::vector<SeqId> batch;
    std::vector<std::uint32_t> sched;
    const bool explicit_sched = rng_() % 2 == 0;
    // At most one fault per build (each refused with its own code; which of two faults is named first is not part
    // of the contract, and the managers check in different orders: see the report of the oracle test).
    const int fault = rng_() % 4 == 0 ? static_cast<int>(rng_() % 14) : -1;
    for (SeqId id : live_) {
      if (rng_() % 10 < 3) continue;
      const std::size_t pending = n_.num_tokens(id) - n_.num_built(id);
      if (pending == 0) continue;
      batch.push_back(id);
      if (explicit_sched) sched.push_back(static_cast<std::uint32_t>(rng_() % 3 == 0 ? 1 + rng_() % pending : pending));
    }
    if (fault == 0) {  // an idle row (refused)
      for (SeqId id : live_) {
        if (n_.num_tokens(id) != n_.num_built(id) || std::find(batch.begin(), batch.end(), id) != batch.end()) continue;
        batch.push_back(id);
        if (explicit_sched) sched.push_back(0);
        break;
      }
    }
    if (fault == 1 && explicit_sched && !batch.empty()) {  // more than pending (refused)
      const std::size_t r = rng_() % batch.size();
      sched[r] = static_cast<std::uint32_t>(n_.num_tokens(batch[r]) - n_.num_built(batch[r]) + 1);
    }
    if (fault == 2 && !batch.empty()) {  // a repeated id (refused)
      batch.push_back(batch[rng_() % batch.size()]);
      if (explicit_sched) sched.push_back(1);
    }
    if (fault == 3) {  // an unknown id (refused)
      batch.insert(batch.begin() + static_cast<std::ptrdiff_t>(rng_() % (batch.size() + 1)), 900003);
      if (explicit_sched) sched.push_back(1);
    }
    if (fault == 4 && explicit_sched) sched.push_back(1);  // wrong size (refused)
    // Exact sizes, then some slack, a skipped output or (fault) a too-small one.
    const std::size_t B = batch.size();
    std::size_t tokens = 0, indices = 0, max_blocks = 0;
    for (std::size_t b = 0; b < B; ++b) {
      if (!n_.contains(batch[b])) continue;
      const std::size_t q = explicit_sched ? (b < sched.size() ? sched[b] : 0)
                                           : n_.num_tokens(batch[b]) - n_.num_built(batch[b]);
      tokens += q;
      const std::size_t blocks = (n_.num_built(batch[b]) + q + bs_ - 1) / bs_;
      indices += blocks;
      max_blocks = std::max(max_blocks, blocks);
    }
    const std::size_t bad_group = rng_() % G;
    std::vector<BufShape> shapes;
    for (std::size_t g = 0; g < G; ++g) {
      const std::size_t slack = rng_() % 4 == 0 ? 1 + rng_() % 3 : 0;
      const std::size_t rows = std::max<std::size_t>(1, max_blocks + (rng_() % 3 == 0 ? 1 : 0));
      const auto mbps = static_cast<std::int32_t>(rows);
      BufShape s{B + 1 + slack, indices + slack, B + slack, B + slack, B + 1 + slack,
                 2 * n_.pending_copies().size() + 2 * slack, B * static_cast<std::size_t>(mbps) + slack,
                 tokens + slack, mbps};
      switch (rng_() % 10) {  // skipped outputs
        case 0: s.indptr = 0; s.indices = 0; break;  // no CSR page table
        case 1: s.block_tables = 0; break;           // no padded block tables
        case 2: s.last_page_len = 0; s.seq_lens = 0; break;
        case 3: s.qo_indptr = 0; break;
        default: break;
      }
      if (g == bad_group) {
        switch (fault) {
          case 5: if (tokens > 0) s.slots = tokens - 1; break;  // too small (refused)
          case 6: s.slots = 0; break;                           // dropped writes (refused unless no tokens)
          case 7:  // a sequence longer than max_blocks_per_seq (refused)
            if (max_blocks > 1) {
              s.max_blocks_per_seq = static_cast<std::int32_t>(max_blocks - 1);
              s.block_tables = B * (max_blocks - 1);
            }
            break;
          case 8: s.copies = 0; break;                          // refused when the group has copies
          case 9: if (B > 0) s.indptr = B; break;               // too small (refused)
          case 10: if (indices > 0) { s.indices = 0; s.indptr = B + 1; } break;  // indptr without indices (refused)
          case 11: if (indices > 1) s.indices = indices - 1; break;  // too small (refused)
          case 12: if (B > 0) s.block_tables = B * static_cast<std::size_t>(s.max_blocks_per_seq) - 1; break;
          case 13: if (B > 0) s.seq_lens = B - (B > 1 ? 1 : 0); break;  // too small when B > 1
          default: break;
        }
      }
      shapes.push_back(s);
    }
    BufSet bo = make_bufs(shapes);
    BufSet bn = make_bufs(shapes);
    std::vector<BatchMetadataSizes> so, sn;
    const auto eo = code_of([&] { so = o_.build_batch_metadata(batch, bo.views, sched); });
    const auto en = code_of([&] { sn = n_.build_batch_metadata(batch, bn.views, sched); });
    INFO("build at op " << step_ << " of " << B << " rows: old " << code_str(eo) << " new " << code_str(en));
    REQUIRE(eo == en);
    REQUIRE(bo == bn);  // also on failure: nothing written
    if (eo) {
      ++build_errors;
      return;
    }
    ++builds;
    REQUIRE(so.size() == sn.size());
    for (std::size_t g = 0; g < G; ++g) {
      const BatchMetadataSizes& x = so[g];
      const BatchMetadataSizes& y = sn[g];
      INFO("group " << g);
      REQUIRE(std::tie(x.batch_size, x.num_indices, x.num_new_tokens, x.num_copies, x.num_swap_out, x.num_swap_in,
                       x.transfer_token) == std::tie(y.batch_size, y.num_indices, y.num_new_tokens, y.num_copies,
                                                     y.num_swap_out, y.num_swap_in, y.transfer_token));
      copies += x.num_copies;
      for (std::size_t t = 0; t < x.num_new_tokens && !bo.slots[g].empty(); ++t) switched_slots += bo.slots[g][t] < 0;
    }
  }

  void reset() {
    const bool a = o_.reset_prefix_cache();
    const bool b = n_.reset_prefix_cache();
    INFO("reset_prefix_cache at op " << step_);
    REQUIRE(a == b);
  }
  void misc() {
    if (rng_() % 2 == 0) {
      const auto a = o_.take_prefix_cache_stats();
      const auto b = n_.take_prefix_cache_stats();
      REQUIRE(std::tie(a.reset, a.requests, a.queries, a.hits, a.preempted_requests, a.preempted_queries,
                       a.preempted_hits) == std::tie(b.reset, b.requests, b.queries, b.hits, b.preempted_requests,
                                                     b.preempted_queries, b.preempted_hits));
    } else {
      o_.reset_peaks();
      n_.reset_peaks();
    }
  }

  void compare() {
    const std::string d = snap_diff(snap(o_), snap(n_), simple());
    INFO("state after op " << step_ << ": " << d);
    REQUIRE(d.empty());
    std::vector<KVEvent> eo, en;
    o_.drain_events(eo);
    n_.drain_events(en);
    const std::string ed = event_diff(eo, en);
    INFO("events after op " << step_ << ": " << ed);
    REQUIRE(ed.empty());
    events += eo.size();
    evictions = n_.stats().evictions;
    dedups = n_.stats().dedup_blocks;
  }

  OldMgr o_;
  NewMgr n_;
  std::mt19937_64 rng_;
  std::uint32_t bs_;
  std::size_t prefix_max_;
  std::vector<Toks> prefixes_;
  std::vector<SeqId> live_;
  std::vector<SeqId> preempted_;
  SeqId next_id_ = 1;
  std::size_t step_ = 0;
};

KVCacheGroupSpec random_group(std::mt19937_64& rng, std::uint32_t bs) {
  const std::uint32_t windows[] = {1, 3, bs, 2 * bs + 1, 1000};
  const int k = static_cast<int>(rng() % 100);
  const std::uint32_t layers = 1 + static_cast<std::uint32_t>(rng() % 3);
  if (k < 40) return {AttentionKind::kFull, 0, layers};
  const std::uint32_t w = windows[rng() % 5];
  return {k < 75 ? AttentionKind::kSlidingWindow : AttentionKind::kChunkedLocal, w, layers};
}

}  // namespace

TEST_CASE("KVCacheManager with groups equals the pre-merge HybridKVCacheManager on random operations",
          "[kv_cache_groups][groups_oracle]") {
  std::mt19937_64 cfg_rng(20261126);
  std::size_t total_ops = 0, admitted = 0, hits = 0, no_capacity = 0, never_fits = 0, builds = 0, build_errors = 0,
              copies = 0, dedups = 0, refused_rewinds = 0, evictions = 0, events = 0, errors = 0, windowed = 0,
              single_full = 0, switched_slots = 0;
  const std::uint32_t block_sizes[] = {1, 4, 16};
  for (int run = 0; run < 36; ++run) {
    const std::uint32_t bs = block_sizes[run % 3];
    CacheConfig c;
    c.block_size = bs;
    const std::size_t G = 1 + cfg_rng() % 4;
    for (std::size_t g = 0; g < G; ++g) c.groups.push_back(random_group(cfg_rng, bs));
    const std::size_t prefix_max = bs == 1 ? 14 : 5 * bs + 8;
    const std::size_t unit = (prefix_max / 2 + bs + 2) / bs + 1;  // blocks of a typical prompt per group
    c.num_blocks = 2 + G * unit * (1 + cfg_rng() % 5);
    c.enable_prefix_caching = cfg_rng() % 10 != 0;
    c.enable_events = cfg_rng() % 5 != 0;
    c.hash_seed = cfg_rng();
    c.page_size_bytes = cfg_rng() % 2 == 0 ? 0 : 256;
    if (cfg_rng() % 4 == 0) c.max_tokens_per_seq = prefix_max + 2 * bs;
    bool any_window = false;
    for (const auto& g : c.groups) any_window = any_window || g.kind != AttentionKind::kFull;
    windowed += any_window ? 1 : 0;
    single_full += (G == 1 && !any_window) ? 1 : 0;
    std::ostringstream name;
    name << "run " << run << ": bs " << bs << ", " << c.num_blocks << " blocks, groups";
    for (const auto& g : c.groups) name << " " << pagedkv::to_string(g.kind) << ":" << g.window_tokens;
    name << (c.enable_prefix_caching ? "" : ", no prefix caching") << ", max_tokens " << c.max_tokens_per_seq;
    CAPTURE(name.str());
    DiffHarness h(c, 1000 + static_cast<std::uint64_t>(run), prefix_max);
    h.run(1500);
    total_ops += 1500;
    admitted += h.admitted;
    hits += h.hits;
    no_capacity += h.no_capacity;
    never_fits += h.never_fits;
    builds += h.builds;
    build_errors += h.build_errors;
    copies += h.copies;
    dedups += h.dedups;
    refused_rewinds += h.refused_rewinds;
    evictions += h.evictions;
    events += h.events;
    errors += h.errors;
    switched_slots += h.switched_slots;
  }
  INFO("ops " << total_ops << " admitted " << admitted << " hits " << hits << " no_capacity " << no_capacity
              << " never_fits " << never_fits << " builds " << builds << " build errors " << build_errors
              << " copies " << copies << " dedups " << dedups << " refused rewinds " << refused_rewinds
              << " evictions " << evictions << " events " << events << " errors " << errors << " windowed runs "
              << windowed << " single-full runs " << single_full << " switched slots " << switched_slots);
  // The operation mix reaches what it is meant to compare (else the comparison proves little).
  CHECK(admitted > 2000);
  CHECK(hits > 300);
  CHECK(no_capacity > 200);
  CHECK(never_fits > 10);
  CHECK(builds > 5000);
  CHECK(build_errors > 100);
  CHECK(copies > 200);
  CHECK(dedups > 20);
  CHECK(refused_rewinds > 20);
  CHECK(evictions > 500);
  CHECK(events > 2000);
  CHECK(errors > 1000);
  CHECK(windowed > 15);
  CHECK(single_full > 0);
  CHECK(switched_slots > 20);
}
