// tests/fuzz/recurrent_model.hpp: the engine side of a pool with recurrent-state groups, for the unit test
// (tests/unit/test_recurrent_groups.cpp, random operations) and the fuzz target (fuzz_manager_recurrent.cpp,
// operations decoded from the input). A toy recurrence (an affine scan over the tokens and their positions) plays
// the SSM kernel: a shadow pool holds the state each block would hold; a build runs the step as an engine does
// (every copy, then per row: read state_in, scan the step's tokens, write each listed checkpoint, write state_out).
// Speculative decoding: the engine keeps the draft tokens of each sequence's lookahead slots (the host manager does
// not know them), the step scans them, and commit_lookahead accepts a prefix of them.
// After every operation `check` asserts, from the manager's public state:
//  - every built sequence's working state (or the pending copy that fills it) is the scan of its built known
//    tokens; before its first build, the hit's checkpoint (table entry num_built / bs - 1) is; each built draft
//    state is the scan of the known tokens and the drafts up to it;
//  - its last checkpoint holds the scan up to its position; its table holds only unwritten checkpoints;
//  - every registered checkpoint holds the scan of the prefix its hash names;
//  - refcounts = table entries + working states + last checkpoints + pending copy sources; held_blocks(g) = the
//    distinct referenced blocks of group g;
// and poisons every free block. Every admission's hit must equal a brute-force maximum over the groups.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <pagedkv/kv_cache_manager.hpp>

namespace pagedkv_recurrent {

using pagedkv::AttentionKind;
using pagedkv::BlockHash;
using pagedkv::SeqId;
using pagedkv::TokenId;
using Manager = pagedkv::KVCacheManager<pagedkv::Xxh3Hasher>;

/// One step of the toy recurrence: an affine map of the state, driven by the token and its position.
inline std::uint64_t scan_step(std::uint64_t s, TokenId t, std::size_t pos) {
  return s * 6364136223846793005ULL + ((static_cast<std::uint64_t>(t) + 1) * 0x9E3779B97F4A7C15ULL ^ pos) +
         1442695040888963407ULL;
}
/// The state after the first n tokens, computed contiguously.
inline std::uint64_t scan(std::span<const TokenId> tokens, std::size_t n) {
  std::uint64_t s = 0;
  for (std::size_t p = 0; p < n; ++p) s = scan_step(s, tokens[p], p);
  return s;
}

inline std::uint64_t splitmix(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// What a run did (so a test can check that it exercised hits, forks, ...).
struct Counts {
  std::size_t admits = 0, hits = 0, forks = 0, builds = 0, rewinds = 0, refusals = 0, preemptions = 0, marks = 0,
              swaps = 0, resumes = 0, lookaheads = 0, accepted = 0;
};

/// The engine and its checks. `Fail` is called with a message when a check fails and must not return.
template <class Fail>
class Engine {
 public:
  Engine(const pagedkv::CacheConfig& c, std::uint64_t seed, Fail fail)
      : m(c), fail_(std::move(fail)), poison_(seed), mem_(c.num_blocks, 0), hmem_(c.num_host_blocks, 0) {
    pagedkv::BatchMetadataLimits lim;
    lim.max_batch = 64;
    lim.max_tokens_per_step = 8192;
    lim.max_blocks_per_seq = 2048;
    lim.max_copies = 256;
    lim.max_swaps = c.num_host_blocks != 0 ? 256 : 0;
    for (std::size_t g = 0; g < m.num_groups(); ++g) store.emplace_back(lim);
    for (auto& x : mem_) x = splitmix(poison_);
  }

  Manager m;
  std::vector<pagedkv::BatchMetadataStorage> store;

  void require(bool ok, const std::string& what) {
    if (!ok) fail_(what);
  }

  /// Build `batch` with `sched` tokens each and run the step as the kernels would. Returns the sizes.
  std::vector<pagedkv::BatchMetadataSizes> build(const std::vector<SeqId>& batch,
                                                 const std::vector<std::uint32_t>& sched) {
    std::vector<pagedkv::BatchMetadataBuffers> bufs;
    for (auto& st : store) bufs.push_back(st.buffers());
    const auto sizes = m.build_batch_metadata(batch, bufs, sched);
    // The step in stream order: swap_out, swap_in, copies, then the kernels; the swaps complete with the step.
    for (std::size_t j = 0; j < sizes[0].num_swap_out; ++j) {
      hmem_[static_cast<std::size_t>(store[0].swap_out[2 * j + 1])] = mem_[static_cast<std::size_t>(store[0].swap_out[2 * j])];
    }
    for (std::size_t j = 0; j < sizes[0].num_swap_in; ++j) {
      mem_[static_cast<std::size_t>(store[0].swap_in[2 * j + 1])] = hmem_[static_cast<std::size_t>(store[0].swap_in[2 * j])];
    }
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      for (std::size_t j = 0; j < sizes[g].num_copies && m.is_recurrent(g); ++j) {
        mem_[static_cast<std::size_t>(store[g].copies[2 * j + 1])] = mem_[static_cast<std::size_t>(store[g].copies[2 * j])];
      }
    }
    const std::size_t bs = m.block_size();
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      if (!m.is_recurrent(g)) continue;
      const pagedkv::BatchMetadataStorage& st = store[g];
      const auto& spec = m.config().groups[g];
      require(sizes[g].num_checkpoints == static_cast<std::size_t>(st.checkpoint_indptr[batch.size()]),
              "num_checkpoints == checkpoint_indptr[batch]");
      std::vector<std::pair<std::int32_t, std::uint64_t>> writes;  // a step's reads come before its writes
      for (std::size_t r = 0; r < batch.size(); ++r) {
        const std::vector<TokenId> tokens = tokens_with_drafts(batch[r]);
        const std::size_t base = m.sequence(batch[r]).num_known();
        const auto& og = m.sequence(batch[r]).other_groups[g - 1];
        const std::size_t seq_len = static_cast<std::size_t>(st.seq_lens[r]);
        const std::size_t first = seq_len - static_cast<std::size_t>(st.qo_indptr[r + 1] - st.qo_indptr[r]);
        require(first == seq_len - sched[r], "the row computes its scheduled tokens");
        require(st.state_in[r] != -1 || first == 0, "a zero initial state only at position 0");
        std::uint64_t s = st.state_in[r] == -1 ? 0 : mem_[static_cast<std::size_t>(st.state_in[r])];
        std::int32_t c = st.checkpoint_indptr[r];
        for (std::size_t p = first; p < seq_len; ++p) {
          s = scan_step(s, tokens[p], p);
          while (c < st.checkpoint_indptr[r + 1] && static_cast<std::size_t>(st.checkpoint_positions[c]) == p + 1) {
            const auto blk = static_cast<std::uint32_t>(st.checkpoint_blocks[c]);
            const bool last = spec.last_checkpoint && p + 1 == std::min(seq_len, base) / bs * bs &&
                              blk == og.last_block && og.last_pos == p + 1;
            const bool working = p + 1 == base && seq_len > base && blk == og.state;
            const bool draft = p + 1 > base && blk == og.drafts[p - base];
            require(((p + 1) % bs == 0 && (p + 1) % spec.window_tokens == 0) || last || working || draft ||
                        marks_.contains({batch[r], p + 1}),
                    "a checkpoint of the interval, a marked one, the last one at the step's last known boundary, the "
                    "working state at the last known token or a draft state");
            writes.emplace_back(st.checkpoint_blocks[c], s);
            ++c;
          }
        }
        require(c == st.checkpoint_indptr[r + 1], "every checkpoint inside the step, in position order");
        if (seq_len <= base) {
          require(st.state_out[r] == static_cast<std::int32_t>(m.state_block(batch[r], g)), "state_out is the state");
          writes.emplace_back(st.state_out[r], s);
        } else {
          require(st.state_out[r] == -1, "no state_out for a row computing lookahead positions");
        }
      }
      for (std::size_t r = batch.size(); r < st.state_in.size(); ++r) require(st.state_in[r] == -1, "state_in padding");
      for (const auto& [b, v] : writes) mem_[static_cast<std::size_t>(b)] = v;
    }
    for (SeqId s : batch) remember_prefixes(s);
    if (sizes[0].transfer_token != 0) m.complete_transfers(sizes[0].transfer_token);
    return sizes;
  }

  /// Every invariant, recounted from the manager's public state; then poison the free blocks.
  void check() {
    const std::size_t N = m.config().num_blocks;
    const std::size_t G = m.num_groups();
    const std::size_t bs = m.block_size();
    std::vector<std::uint32_t> refs(N, 0);
    std::vector<std::size_t> held(G, 0);
    // Host -> device copies queued for the next build: each holds its destination, whose content is its source's.
    std::unordered_map<std::uint32_t, std::uint32_t> filling;
    std::vector<bool> swapping_out(N, false);
    for (const auto& t : m.transfers().queued()) {
      if (pagedkv::is_device_to_host(t.kind)) {
        swapping_out[t.device] = true;
      } else {
        filling[t.device] = t.host;
        ++refs[t.device];
      }
    }
    const auto content = [&](std::uint32_t b) {
      const auto f = filling.find(b);
      return f != filling.end() ? hmem_[f->second] : mem_[b];
    };
    m.for_each_sequence([&](SeqId s, std::size_t) {
      const auto& q = m.sequence(s);
      for (std::size_t g = 0; g < G; ++g) {
        for (auto b : q.table_of(g).blocks()) refs[b] += b != 0 ? 1 : 0;
        if (!m.is_recurrent(g)) continue;
        const auto& og = q.other_groups[g - 1];
        const std::string who = "sequence " + std::to_string(s) + " group " + std::to_string(g) + " built " +
                                std::to_string(q.num_built);
        require(og.state != 0, who + ": holds a working state");
        ++refs[og.state];
        const std::size_t committed = std::min(q.num_built, q.num_known());
        require(og.drafts.size() == q.num_lookahead, who + ": a draft state per lookahead slot");
        for (std::size_t j = 0; j < og.drafts.size(); ++j) {
          ++refs[og.drafts[j]];
          if (q.num_known() + j + 1 <= q.num_built) {
            require(content(og.drafts[j]) == scan(tokens_with_drafts(s), q.num_known() + j + 1),
                    who + ": a built draft state is the scan of the known tokens and the drafts up to it");
          }
        }
        require((og.last_block != 0) == (m.config().groups[g].last_checkpoint && m.config().enable_prefix_caching),
                who + ": a last checkpoint exactly when configured");
        if (og.last_block != 0) {
          ++refs[og.last_block];
          require(og.last_pos <= committed, who + ": last checkpoint within the built known positions");
          if (og.last_pos > 0) require(content(og.last_block) == scan(q.tokens, og.last_pos), who + ": last checkpoint");
        }
        if (og.state_valid) {
          auto from = og.state;  // a state copied after a fork is filled by a pending copy: its source
          for (const auto& c : m.pending_copies()) from = c.dst == og.state ? c.src : from;
          require(content(from) == scan(q.tokens, committed), who + ": the working state is the scan of the tokens");
        } else {
          require(committed % bs == 0, who + ": before the first build, at a block boundary");
          if (committed > 0) {
            const auto ck = q.table_of(g).blocks()[committed / bs - 1];
            require(ck != 0 && content(ck) == scan(q.tokens, committed),
                    who + ": the hit's checkpoint (known " + std::to_string(q.num_known()) + ", lookahead " +
                        std::to_string(q.num_lookahead) + ", block " + std::to_string(ck) + ")");
          }
        }
        const auto blocks = q.table_of(g).blocks();
        for (std::size_t i = 0; i < blocks.size(); ++i) {
          if (blocks[i] == 0) continue;
          const bool hit_entry = !og.state_valid && (i + 1) * bs == committed;
          require(((i + 1) * bs) % m.config().groups[g].window_tokens == 0 || hit_entry ||
                      marks_.contains({s, (i + 1) * bs}),
                  who + ": a table entry is a checkpoint of the interval, a marked one or the hit's");
          require((i + 1) * bs >= committed, who + ": written checkpoints left the table");
        }
      }
    });
    for (const auto& c : m.pending_copies()) ++refs[c.src];
    for (std::size_t b = 1; b < N; ++b) {
      const auto id = static_cast<std::uint32_t>(b);
      require(m.allocator().refcount(id) == refs[b], "block " + std::to_string(b) + ": refcount = its holders");
      if (refs[b] > 0) ++held[m.group_of(id)];
    }
    for (std::size_t g = 0; g < G; ++g) require(m.held_blocks(g) == held[g], "held_blocks(g) = its referenced blocks");
    for (std::size_t g = 0; g < G; ++g) {
      if (!m.is_recurrent(g)) continue;
      for (std::size_t b = 1; b < N; ++b) {
        const auto id = static_cast<std::uint32_t>(b);
        if (m.group_of(id) != g) continue;
        const auto h = m.prefix_index(g).hash_of(id);
        if (!h) continue;
        const auto it = expect_.find(*h);
        require(it != expect_.end() && content(id) == it->second,
                "registered checkpoint " + std::to_string(b) + " holds the scan of its prefix");
      }
    }
    for (std::size_t b = 1; b < N; ++b) {
      const auto id = static_cast<std::uint32_t>(b);
      // (A free block a queued swap-out still reads keeps its content until the next step's swap_out.)
      if (m.allocator().refcount(id) == 0 && !m.allocator().is_hashed(id) && !swapping_out[b]) mem_[b] = splitmix(poison_);
    }
  }

  /// mark_checkpoint(seq, pos), remembered on success (what the checks allow besides the interval).
  pagedkv::AppendStatus mark(SeqId seq, std::size_t pos) {
    const pagedkv::AppendStatus st = m.mark_checkpoint(seq, pos);
    if (st == pagedkv::AppendStatus::kOk) {
      marks_.insert({seq, pos});
      ever_marked_ = true;
    }
    return st;
  }
  /// try_reserve_lookahead(seq, drafts.size()), remembering the draft tokens (the GPU's, unknown to the manager).
  pagedkv::AppendStatus lookahead(SeqId seq, std::vector<TokenId> drafts) {
    const auto r = m.try_reserve_lookahead(seq, drafts.size());
    if (r.status == pagedkv::AppendStatus::kOk) drafts_[seq] = std::move(drafts);
    return r.status;
  }
  /// commit_lookahead(seq, the first `a` drafts): the verification accepted them.
  void commit(SeqId seq, std::size_t a) {
    std::vector<TokenId>& d = drafts_[seq];
    const std::vector<TokenId> accepted(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(a));
    m.commit_lookahead(seq, accepted);
    drafts_.erase(seq);
    remember_prefixes(seq);  // checkpoints of accepted positions are registered now
  }
  /// rewind(seq, n): lookahead slots go first (their drafts with them).
  void rewind(SeqId seq, std::size_t n) {
    m.rewind(seq, n);
    const auto it = drafts_.find(seq);
    if (it != drafts_.end()) it->second.resize(m.sequence(seq).num_lookahead);
  }
  /// The known tokens of `seq` followed by the drafts of its lookahead slots.
  std::vector<TokenId> tokens_with_drafts(SeqId seq) const {
    const auto t = m.token_ids(seq);
    std::vector<TokenId> all(t.begin(), t.end());
    const auto it = drafts_.find(seq);
    if (it != drafts_.end()) all.insert(all.end(), it->second.begin(), it->second.end());
    return all;
  }
  /// Whether a mark ever succeeded (then hits may end at marked positions too).
  [[nodiscard]] bool ever_marked() const noexcept { return ever_marked_; }
  /// `seq` left (freed or preempted): its marks and drafts go (its id may come back).
  void forget_marks(SeqId seq) {
    std::erase_if(marks_, [&](const auto& k) { return k.first == seq; });
    drafts_.erase(seq);
  }

  /// The largest k (blocks) <= cap_blocks every group serves, from the definitions: a full group needs blocks
  /// [0, k), a sliding window of W the blocks meeting [k * bs - W + 1, k * bs), a recurrent group block k - 1; a
  /// block serves when the device index or the host tier (ready) holds it.
  std::size_t oracle_hit(const std::vector<BlockHash>& hashes, std::size_t cap_blocks) const {
    const std::size_t bs = m.block_size();
    if (!m.config().enable_prefix_caching) return 0;
    for (std::size_t k = cap_blocks; k > 0; --k) {
      bool ok = true;
      for (std::size_t g = 0; g < m.num_groups() && ok; ++g) {
        const auto& spec = m.config().groups[g];
        std::size_t lo = 0;
        if (spec.kind == AttentionKind::kSlidingWindow) {
          lo = k * bs + 1 > spec.window_tokens ? (k * bs + 1 - spec.window_tokens) / bs : 0;
        } else if (spec.recurrent()) {
          lo = k - 1;
        }
        for (std::size_t i = lo; i < k && ok; ++i) {  // cached on the device, or ready in the host tier
          ok = m.prefix_index(g).find(hashes[i]).has_value() ||
               (m.host_tier() != nullptr && m.host_tier()->find_ready(pagedkv::group_block_key(hashes[i], g)));
        }
      }
      if (ok) return k;
    }
    return 0;
  }

 private:
  void remember_prefixes(SeqId s) {
    const auto& q = m.sequence(s);
    const std::size_t bs = m.block_size();
    for (std::size_t i = 0; i < q.hashes.size(); ++i) expect_[q.hashes[i]] = scan(q.tokens, (i + 1) * bs);
  }

  Fail fail_;
  std::set<std::pair<SeqId, std::size_t>> marks_;  // (sequence, position) marked by mark()
  std::map<SeqId, std::vector<TokenId>> drafts_;     // the draft tokens of each sequence's lookahead slots
  bool ever_marked_ = false;
  std::uint64_t poison_;
  std::vector<std::uint64_t> mem_;                                                  // [num_blocks] a block's state
  std::vector<std::uint64_t> hmem_;                                                 // [num_host_blocks] likewise
  std::unordered_map<BlockHash, std::uint64_t, pagedkv::BlockHashHasher> expect_;  // chain hash -> its prefix's scan
};

/// Random operations on `e`, `steps` of them or until `next` says stop: `next(n)` returns a value in [0, n) (a
/// random number, or the input's next bytes). Admission (document prefixes plus a tail, or a preempted request
/// again), growth (reserve or append), builds of random subsets with partial schedules, fork, free, preemption by
/// recompute, rewind (unbuilt positions; built ones must be refused and change nothing), marked checkpoints (bad
/// positions must be refused and change nothing). `e.check()` after each.
template <class Fail, class Next, class Done>
Counts run_ops(Engine<Fail>& e, std::size_t steps, Next&& next, Done&& done) {
  Manager& m = e.m;
  const std::size_t bs = m.block_size();
  Counts n;
  std::vector<std::vector<TokenId>> docs(4);
  for (auto& d : docs) {
    d.resize(40 + next(120));
    for (auto& t : d) t = static_cast<TokenId>(next(50));
  }
  SeqId next_id = 1;
  std::vector<SeqId> live;
  std::map<SeqId, std::vector<TokenId>> preempted;
  std::vector<SeqId> swapped;
  const auto pick = [&]() -> SeqId { return live[next(live.size())]; };
  const auto erase_live = [&](SeqId s) { live.erase(std::find(live.begin(), live.end(), s)); };
  const auto admit = [&](SeqId id, const std::vector<TokenId>& prompt) {
    pagedkv::AdmitOptions opts;
    if (next(3) == 0) opts.num_reserved_tokens = next(prompt.size());
    const auto prep = m.prepare_prompt(prompt);
    const std::size_t want = prompt.empty() ? 0 : e.oracle_hit(prep.hashes, (prompt.size() - 1) / bs);
    const auto r = m.try_admit(id, prep, opts);
    if (r.status != pagedkv::AdmitStatus::kAdmitted) return false;
    ++n.admits;
    live.push_back(id);
    e.require(r.num_cached_tokens == want * bs, "the hit is the brute-force maximum over the groups");
    for (std::size_t g = 0; g < m.num_groups(); ++g) {
      const auto& spec = m.config().groups[g];
      if (spec.recurrent() && !spec.last_checkpoint && !e.ever_marked()) {
        e.require(r.num_cached_tokens % spec.window_tokens == 0, "a hit at a checkpoint of the interval");
      }
    }
    n.hits += r.num_cached_tokens > 0 ? 1 : 0;
    return true;
  };
  for (std::size_t step = 0; step < steps && !done(); ++step) {
    const std::size_t op = next(100);
    if (op < 22 || live.empty()) {
      if (!swapped.empty() && next(3) == 0) {  // resume a swapped sequence
        const std::size_t k = next(swapped.size());
        const auto r = m.try_resume(swapped[k]);
        if (r.status == pagedkv::AdmitStatus::kAdmitted) {
          live.push_back(swapped[k]);
          swapped.erase(swapped.begin() + static_cast<std::ptrdiff_t>(k));
          ++n.resumes;
        }
      } else if (!preempted.empty() && next(2) == 0) {
        const auto it = preempted.begin();
        if (admit(it->first, it->second)) preempted.erase(it);
      } else {
        const auto& d = docs[next(docs.size())];
        // (one prompt in 16 is empty: a sequence with no token yet, which appends or drafts its first)
        std::vector<TokenId> p;
        if (next(16) != 0) {
          p.assign(d.begin(), d.begin() + static_cast<std::ptrdiff_t>(1 + next(d.size())));
          for (std::size_t i = next(20); i > 0; --i) p.push_back(static_cast<TokenId>(next(50)));
        }
        admit(next_id++, p);
      }
    } else if (op < 45) {
      const SeqId s = pick();
      const auto& q = m.sequence(s);
      if (q.num_lookahead > 0) {  // the verification accepted a prefix of the drafts
        const std::size_t a = next(q.num_lookahead + 1);
        e.commit(s, a);
        n.accepted += a;
      } else if (q.num_unslotted() > 0) {
        (void)m.try_reserve(s, 1 + next(q.num_unslotted()));
      } else if (next(4) == 0) {  // speculative decoding: k draft tokens proposed on the GPU
        std::vector<TokenId> d(1 + next(5));
        for (auto& x : d) x = static_cast<TokenId>(next(50));
        n.lookaheads += e.lookahead(s, d) == pagedkv::AppendStatus::kOk ? 1 : 0;
      } else {
        std::vector<TokenId> t(1 + (next(4) == 0 ? next(20) : 0));
        for (auto& x : t) x = static_cast<TokenId>(next(50));
        (void)m.try_append(s, t);
      }
    } else if (op < 75) {
      std::vector<SeqId> batch;
      std::vector<std::uint32_t> sched;
      for (SeqId s : live) {
        const std::size_t pend = m.sequence(s).num_pending();
        if (pend == 0 || next(3) == 0) continue;
        batch.push_back(s);
        sched.push_back(static_cast<std::uint32_t>(next(2) == 0 ? pend : 1 + next(pend)));
      }
      if (!batch.empty()) {
        e.build(batch, sched);
        ++n.builds;
      }
    } else if (op < 82) {
      const SeqId s = pick();
      if (m.sequence(s).settled() && m.transfers().queued().empty()) {  // (no host copy filling a block of it)
        m.fork(s, next_id);
        live.push_back(next_id++);
        ++n.forks;
      }
    } else if (op < 88) {
      if (!swapped.empty() && next(4) == 0) {
        m.free(swapped.back());
        swapped.pop_back();
      } else {
        const SeqId s = pick();
        m.free(s);
        erase_live(s);
        e.forget_marks(s);
      }
    } else if (op < 93) {
      const SeqId s = pick();
      // Swap it out (settled, and no host -> device copy still filling a block of its: none queued at all).
      if (m.host_tier() != nullptr && m.sequence(s).settled() && m.transfers().queued().empty() && next(2) == 0) {
        if (m.preempt(s, pagedkv::PreemptMode::kSwap)) {
          erase_live(s);
          e.forget_marks(s);
          swapped.push_back(s);
          ++n.swaps;
        }
      } else {
        const auto& t = m.sequence(s).tokens;
        std::vector<TokenId> tokens(t.begin(), t.end());
        m.preempt(s);
        erase_live(s);
        e.forget_marks(s);
        ++n.preemptions;
        if (!tokens.empty()) preempted[s] = std::move(tokens);
      }
    } else if (op >= 97) {  // mark a checkpoint: a block boundary with a slot and no state yet, or a bad position
      SeqId s = pick();
      for (SeqId t : live) s = m.sequence(t).num_pending() >= bs && next(2) == 0 ? t : s;
      const auto& q = m.sequence(s);
      const std::size_t lo = q.num_built / bs + 1, hi = std::min(q.num_slotted(), q.num_known()) / bs;  // (lo..hi) x bs
      const std::size_t kind = next(4);
      const bool caching = m.config().enable_prefix_caching;  // no checkpoints without it: every mark is refused
      if (kind > 0 && lo <= hi && caching) {
        n.marks += e.mark(s, (lo + next(hi - lo + 1)) * bs) == pagedkv::AppendStatus::kOk ? 1 : 0;
      } else {
        const std::size_t bad = kind == 0 ? q.num_built / bs * bs : kind == 1 ? (hi + 1) * bs : lo * bs + 1;
        std::vector<std::vector<std::uint32_t>> before;
        for (std::size_t g = 0; g < m.num_groups(); ++g) {
          const auto b = m.block_ids(s, g);
          before.emplace_back(b.begin(), b.end());
        }
        const std::size_t free_before = m.allocator().num_free_blocks();
        bool refused = false;
        try {
          (void)e.mark(s, bad);
        } catch (const pagedkv::Error& err) {
          refused = err.code() == pagedkv::Errc::kInvalidArgument || err.code() == pagedkv::Errc::kLimitExceeded;
        }
        const bool valid = caching && bad % bs == 0 && bad > q.num_built && bad <= std::min(q.num_slotted(), q.num_known());
        if (!valid) {
          e.require(refused, "a mark at a bad position is refused");
          for (std::size_t g = 0; g < m.num_groups(); ++g) {
            const auto b = m.block_ids(s, g);
            e.require(std::vector<std::uint32_t>(b.begin(), b.end()) == before[g], "a refused mark changes nothing");
          }
          e.require(m.allocator().num_free_blocks() == free_before, "a refused mark takes no block");
          ++n.refusals;
        }
      }
    } else {
      const SeqId s = pick();
      const auto& q = m.sequence(s);
      if (q.num_unslotted() != 0 || q.num_known() == 0) continue;
      const std::size_t unbuilt = q.num_known() - std::min(q.num_known(), q.num_built);
      const std::size_t la = q.num_lookahead;  // lookahead slots go first, built or not
      if (unbuilt + la > 0 && next(2) == 0) {
        e.rewind(s, 1 + next(unbuilt + la));
        ++n.rewinds;
      } else if (std::min(q.num_built, q.num_known()) > 0) {
        const std::size_t before = q.num_known(), slotted = q.num_slotted();
        bool refused = false;
        try {
          e.rewind(s, la + unbuilt + 1);
        } catch (const pagedkv::Error& err) {
          refused = err.code() == pagedkv::Errc::kLimitExceeded;
        }
        e.require(refused && m.sequence(s).num_known() == before && m.sequence(s).num_slotted() == slotted &&
                      m.sequence(s).num_lookahead == la,
                  "rewinding a built known position is refused, unchanged");
        ++n.refusals;
      }
    }
    e.check();
  }
  return n;
}

}  // namespace pagedkv_recurrent
