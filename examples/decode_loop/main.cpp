// examples/decode_loop/main.cpp: decode_loop, an inference runtime in miniature, checked against float64 every step.
//
// What it does (docs/contract.md sec. 1, the scheduler's step):
//  1. A KVCacheManager admits a batch of requests whose prompts share prefixes (two groups, each with its own
//     system prompt). Step 0 admits and prefills the first request of each group; its metadata build registers
//     their full blocks, so the requests admitted at step 1 hit the prefix cache for their group's system prompt
//     (and the last one, a block-aligned retry of the first request's prompt, for all but its last block, which is
//     deduplicated into the first request's block when it fills: its slots there are -1).
//  2. Steps 0 and 1 prefill; steps 2..S+1 decode one token per sequence. Some sequences are forked (parallel
//     sampling) before the first decode step and halfway, so shared partial blocks are copied on write.
//  3. Every step builds the batch metadata into fixed-capacity buffers (padded to capacity, CUDA-graph style),
//     then per layer runs copy_blocks -> write_kv -> attention (prefill: CSR + qo_indptr; decode: CSR and padded
//     tables on alternating steps; the work split from the length-aware plan (plan_decode, executed by both
//     backends), or the chunk rule on every 3rd / 5th step) on the chosen backend.
//  4. Every output row of every layer is compared with attention computed in float64 over the sequence's own
//     history of K/V (a fork inherits its parent's), and padding rows must be exactly o = 0, lse = -inf.
// Exit status: 0 PASS, 1 FAIL (an error above tolerance, a NaN, or a kernel/manager error), 2 could not run
// (bad options, no CUDA support in this build, or no CUDA device).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <exception>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include <pagedkv/decode_plan.hpp>
#include <pagedkv/error.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include <pagedkv/reference/dtype.hpp>

#include "backend.hpp"
#include "model.hpp"

namespace decode_loop {
namespace {

using pagedkv::DType;
using pagedkv::PageTableFormat;
using pagedkv::SeqId;
using pagedkv::TokenId;

struct Options {
  int block_size = 16;
  int batch = 8;
  int forks = 2;
  int steps = 16;
  int layers = 2;
  int head_dim = 128;
  int system_prompt_tokens = 40;
  std::uint64_t seed = 1;
  DType dtype = DType::kFloat32;
  Layout layout = Layout::kNhd;
  std::string device = "cpu";
  bool verbose = false;
  int gpu_blocks = 0;   ///< Usable device blocks; 0 = enough for every sequence (no preemption).
  int host_blocks = 0;  ///< Usable host tier blocks; 0 = no host tier.
  pagedkv::OffloadPolicy offload = pagedkv::OffloadPolicy::kWriteBack;
};

/// One live sequence as the runtime sees it: its id and the prefix hash of every position (its K/V identity).
struct Seq {
  SeqId id = 0;
  std::vector<std::uint64_t> pos_hash;  // [num_tokens]
  int target = std::numeric_limits<int>::max();  // host tier mode: decode tokens after which it finishes
  int generated = 0;
  bool swapped = false;  // preempted by swap, waiting for try_resume
  int resumed_at = -1;   // the step that resumed it (its swap_in is in flight until that step ran)
  int decoded_at = -1;   // the last step that appended a token to it
  bool done = false;     // finished and freed
  void append(TokenId t) { pos_hash.push_back(extend_prefix_hash(pos_hash.empty() ? kEmptyPrefixHash : pos_hash.back(), t)); }
};

/// Worst errors of one step (all layers).
struct StepCheck {
  double max_rel_err = 0.0;  // output rows, normwise relative (model.hpp)
  double max_lse_err = 0.0;  // |lse - ref| / max(1, |ref|)
  std::string first_failure;
};

/// What the decode attention of a step uses: page-table form and split-KV setting.
struct DecodeMode {
  PageTableFormat format = PageTableFormat::kCsr;
  int chunk = 0;       // kv_chunk_size_tokens
  int max_chunks = 0;  // max_num_chunks (0 = no split)
  bool plan = false;   // the length-aware plan (plan_decode); chunk / max_chunks unused
  int plan_items = 0, plan_split = 0;
  [[nodiscard]] std::string describe() const {
    std::string s = format == PageTableFormat::kCsr ? "csr   " : "padded";
    char buf[40];
    if (plan) {
      std::snprintf(buf, sizeof buf, " plan %3di/%2ds  ", plan_items, plan_split);
      return s + buf;
    }
    if (max_chunks == 0) return s + " no-split       ";
    if (chunk > 0) {
      std::snprintf(buf, sizeof buf, " split %3dt x%-3d", chunk, max_chunks);
    } else {
      std::snprintf(buf, sizeof buf, " split auto x%-3d", max_chunks);
    }
    return s + buf;
  }
};

constexpr double kLseTolerance = 1e-4;

double o_tolerance(DType dt) { return dt == DType::kFloat32 ? 1e-5 : 1e-2; }

class Runtime {
 public:
  Runtime(const Options& opt, std::unique_ptr<Backend> backend, const Shape& shape, const Capacity& cap,
          std::vector<std::vector<TokenId>> prompts)
      : opt_(opt),
        shape_(shape),
        cap_(cap),
        backend_(std::move(backend)),
        prompts_(std::move(prompts)),
        mgr_(config(opt, shape)),
        md_(cap),
        rng_(opt.seed * 0x9e3779b97f4a7c15ull + 17),
        q_(static_cast<std::size_t>(cap.max_q_rows * shape.q_row_elems()) * shape.elem_bytes()),
        o_(q_.size()),
        lse_(static_cast<std::size_t>(cap.max_q_rows * shape.num_qo_heads)),
        key_(static_cast<std::size_t>(cap.max_new_tokens * shape.kv_row_elems()) * shape.elem_bytes()),
        value_(key_.size()) {}

  static pagedkv::CacheConfig config(const Options& opt, const Shape& shape) {
    pagedkv::CacheConfig c{static_cast<std::size_t>(shape.num_blocks), static_cast<std::uint32_t>(shape.block_size)};
    if (opt.host_blocks > 0) {
      c.num_host_blocks = static_cast<std::size_t>(opt.host_blocks) + 1;  // + the host tier's null block
      c.offload = opt.offload;
    }
    return c;
  }
  [[nodiscard]] bool tiered() const noexcept { return opt_.host_blocks > 0; }

  /// Runs the two prefill steps and every decode step; true when every check passed.
  bool run() {
    // Wave 1: the first request of each group; wave 2, after wave 1's metadata build registered its blocks: the rest.
    const std::size_t leaders = std::min<std::size_t>(2, prompts_.size());
    bool pass = prefill_step(0, 0, leaders);
    if (leaders < prompts_.size()) pass = prefill_step(1, leaders, prompts_.size()) && pass;
    const int first = 2;  // the first decode step
    const int first_forks = (opt_.forks + 1) / 2;
    const int fork_step_2 = opt_.steps >= 2 ? first + opt_.steps / 2 : first;
    int forked = 0;
    for (int step = first; step < first + opt_.steps; ++step) {
      // Parallel sampling: fork some sequences (after the previous step's build, as the manager requires).
      const int want = step == fork_step_2 ? opt_.forks : (step == first ? first_forks : forked);
      if (tiered()) pass = resume_swapped(step) && pass;
      while (forked < want) {
        std::size_t pi = static_cast<std::size_t>((forked * 3) % seqs_.size());
        // A parent must be settled: running, and not resumed this step (its swap_in has not run yet).
        const auto forkable = [&](const Seq& p) { return !p.swapped && !p.done && p.resumed_at != step; };
        for (std::size_t n = 0; n < seqs_.size() && !forkable(seqs_[pi]); ++n) pi = (pi + 1) % seqs_.size();
        if (!forkable(seqs_[pi])) break;  // nobody to fork this step
        const Seq& parent = seqs_[pi];
        Seq child = parent;  // the child's K/V history is its parent's
        child.target = std::numeric_limits<int>::max();
        child.id = 1000 + static_cast<SeqId>(forked);
        mgr_.fork(parent.id, child.id);
        if (opt_.verbose) std::printf("  fork %llu -> %llu at %zu tokens\n", static_cast<unsigned long long>(parent.id),
                                      static_cast<unsigned long long>(child.id), child.pos_hash.size());
        seqs_.push_back(std::move(child));
        ++forked;
      }
      pass = decode_step(step) && pass;
      if (tiered()) finish_done(step);
    }
    return finish() && pass;
  }

 private:
  // ---- steps 0 and 1: admission of requests [begin, end) + prefill -------------------------------------------------
  bool prefill_step(int step, std::size_t begin, std::size_t end) {
    std::size_t prompt_tokens = 0;
    std::size_t cached_tokens = 0;
    int hit_requests = 0;
    const auto before = mgr_.stats();
    for (std::size_t i = begin; i < end; ++i) {
      const auto r = mgr_.try_admit(static_cast<SeqId>(i), prompts_[i]);
      if (!r.admitted()) {
        std::printf("admission of sequence %zu failed (%s)\n", i,
                    r.status == pagedkv::AdmitStatus::kNoCapacity ? "no capacity" : "never fits");
        return false;
      }
      Seq s;
      s.id = static_cast<SeqId>(i);
      for (TokenId t : prompts_[i]) s.append(t);
      // Host tier mode: request i finishes after steps * (i + 1) / batch decode tokens, so sequences leave at
      // different times and free device blocks that swapped sequences resume into.
      if (tiered()) s.target = std::max(1, opt_.steps * static_cast<int>(i + 1) / static_cast<int>(prompts_.size()));
      seqs_.push_back(std::move(s));
      prompt_tokens += prompts_[i].size();
      cached_tokens += r.num_cached_tokens;
      hit_requests += r.num_cached_tokens > 0 ? 1 : 0;
      if (opt_.verbose) {
        std::printf("  admit seq %zu: %zu prompt tokens, %zu cached, %zu new blocks\n", i, prompts_[i].size(),
                    r.num_cached_tokens, r.num_new_blocks);
      }
    }
    std::printf("step %3d admits %zu sequence(s): %zu prompt tokens, %zu served from the prefix cache (%d "
                "request(s) hit)\n",
                step, end - begin, prompt_tokens, cached_tokens, hit_requests);
    const bool pass = run_step(step, /*prefill=*/true, DecodeMode{});
    const auto after = mgr_.stats();
    if (after.dedup_blocks > before.dedup_blocks) {
      std::printf("         its build deduplicated %llu full block(s) into cached ones (their slots are -1)\n",
                  static_cast<unsigned long long>(after.dedup_blocks - before.dedup_blocks));
    }
    return pass;
  }

  // ---- steps 2..S+1: one sampled token per sequence ---------------------------------------------------------------
  bool decode_step(int step) {
    std::uniform_int_distribution<TokenId> tok(1, 49999);
    std::vector<TokenId> sampled;
    for (std::size_t k = 0; k < seqs_.size(); ++k) {
      Seq& s = seqs_[k];
      if (s.swapped || s.done) continue;
      TokenId t = tok(rng_);  // each sequence samples its own token, distinct from the others' this step
      while (std::find(sampled.begin(), sampled.end(), t) != sampled.end()) t = tok(rng_);
      sampled.push_back(t);
      bool appended = false;
      while (!(appended = mgr_.try_append(s.id, std::span<const TokenId>(&t, 1)).ok())) {
        if (!tiered()) {
          std::printf("step %d: append to sequence %llu found no capacity (pool too small?)\n", step,
                      static_cast<unsigned long long>(s.id));
          return false;
        }
        // Preempt by swap the newest running sequence that can be swapped: at or after s (it has not appended this
        // step) and not resumed this step (its swap_in is still to run). If there is none, s waits a step.
        std::size_t v = seqs_.size();
        for (std::size_t i = seqs_.size(); i-- > k;) {
          if (!seqs_[i].swapped && !seqs_[i].done && seqs_[i].resumed_at != step) {
            v = i;
            break;
          }
        }
        if (v == seqs_.size()) {
          ++waits_;
          if (opt_.verbose) std::printf("  sequence %llu waits a step\n", static_cast<unsigned long long>(s.id));
          break;
        }
        if (!mgr_.preempt(seqs_[v].id, pagedkv::PreemptMode::kSwap)) {
          std::printf("step %d: the host tier has no room to swap sequence %llu out (--host-blocks too small?)\n",
                      step, static_cast<unsigned long long>(seqs_[v].id));
          return false;
        }
        seqs_[v].swapped = true;
        swap_queue_.push_back(v);
        ++swap_preemptions_;
        if (opt_.verbose) {
          std::printf("  swap out %llu at %zu tokens\n", static_cast<unsigned long long>(seqs_[v].id),
                      seqs_[v].pos_hash.size());
        }
        if (v == k) break;  // it was s itself: it does not decode this step
      }
      if (!appended) continue;  // swapped out, or waits a step
      s.append(t);
      ++s.generated;
      s.decoded_at = step;
    }
    DecodeMode mode;
    mode.format = step % 2 == 1 ? PageTableFormat::kCsr : PageTableFormat::kPadded;
    mode.plan = step % 3 != 0 && step % 5 != 0;  // the length-aware plan, executed item for item by the backend
    if (step % 3 == 0) {  // explicit split-KV chunk: odd sizes that cut through blocks
      const int max_len = max_seq_len();
      mode.chunk = std::uniform_int_distribution<int>(7, 40)(rng_);
      mode.max_chunks = std::max(2, (max_len + mode.chunk - 1) / mode.chunk);
    } else if (step % 5 == 0) {  // "implementation's choice" (CUDA: ceil(len / 3) rounded up to 16; reference: no split)
      mode.chunk = 0;
      mode.max_chunks = 3;
    }
    return run_step(step, /*prefill=*/false, mode);
  }

  // Host tier mode: resume swapped sequences, first swapped first, while the device pool has room (they decode in
  // this very step; the build issues their swap_in, which runs before the step's kernels).
  bool resume_swapped(int step) {
    while (!swap_queue_.empty()) {
      Seq& s = seqs_[swap_queue_.front()];
      const pagedkv::AdmitResult r = mgr_.try_resume(s.id);
      if (r.status == pagedkv::AdmitStatus::kNeverFits) {
        std::printf("sequence %llu can never be resumed\n", static_cast<unsigned long long>(s.id));
        return false;
      }
      if (!r.admitted()) break;  // no room yet (or a copy not acknowledged: never here, each step acknowledges)
      s.swapped = false;
      s.resumed_at = step;
      ++resumes_;
      resumed_copied_tokens_ += r.num_host_cached_tokens;
      if (opt_.verbose) {
        std::printf("  resume %llu: %zu tokens, %zu copied back from the host tier\n",
                    static_cast<unsigned long long>(s.id), r.num_cached_tokens, r.num_host_cached_tokens);
      }
      swap_queue_.pop_front();
    }
    return true;
  }

  // Host tier mode: free the sequences that generated their target after this step.
  void finish_done(int step) {
    for (Seq& s : seqs_) {
      if (s.done || s.swapped || s.generated < s.target) continue;
      mgr_.free(s.id);
      s.done = true;
      if (opt_.verbose) std::printf("  step %d: sequence %llu finished\n", step, static_cast<unsigned long long>(s.id));
    }
  }

  [[nodiscard]] int max_seq_len() const {
    std::size_t m = 0;
    for (const Seq& s : seqs_) m = std::max(m, s.pos_hash.size());
    return static_cast<int>(m);
  }

  // ---- one step: metadata -> per layer (copies -> write -> attention) -> float64 check ----------------------------
  bool run_step(int step, bool prefill, DecodeMode mode) {
    std::vector<SeqId> batch;
    batch.reserve(seqs_.size());
    batch_idx_.clear();
    for (std::size_t i = 0; i < seqs_.size(); ++i) {
      if (seqs_[i].swapped || seqs_[i].done) continue;
      if (!prefill && seqs_[i].decoded_at != step) continue;  // waited this step: no token to compute
      if (prefill && mgr_.sequence(seqs_[i].id).num_pending() == 0) continue;  // prefilled by an earlier step
      batch.push_back(seqs_[i].id);
      batch_idx_.push_back(i);
    }
    pagedkv::BatchMetadataSizes sz;
    try {
      sz = mgr_.build_batch_metadata(batch, md_.buffers());
    } catch (const pagedkv::Error& e) {
      std::printf("step %d: build_batch_metadata: %s\n", step, e.what());
      return false;
    }
    const int b_count = static_cast<int>(sz.batch_size);
    const int new_tokens = static_cast<int>(sz.num_new_tokens);
    int skipped = 0;
    for (int i = 0; i < new_tokens; ++i) skipped += md_.slot_mapping[static_cast<std::size_t>(i)] < 0 ? 1 : 0;

    // Cross-check the manager's view of each sequence against ours.
    for (int b = 0; b < b_count; ++b) {
      const Seq& s = seqs_[batch_idx_[static_cast<std::size_t>(b)]];
      const int q_len = md_.qo_indptr[static_cast<std::size_t>(b) + 1] - md_.qo_indptr[static_cast<std::size_t>(b)];
      if (md_.seq_lens[static_cast<std::size_t>(b)] != static_cast<int>(s.pos_hash.size()) ||
          q_len > static_cast<int>(s.pos_hash.size()) || (!prefill && q_len != 1)) {
        std::printf("step %d: metadata disagrees with the runtime for sequence %llu (seq_len %d vs %zu, q_len %d)\n",
                    step, static_cast<unsigned long long>(s.id), md_.seq_lens[static_cast<std::size_t>(b)],
                    s.pos_hash.size(), q_len);
        return false;
      }
    }
    // The decode plan, from this step's lengths over the whole capacity (padding sequences have length 0), into
    // the fixed plan buffers that set_metadata hands to the backend with the rest of the metadata.
    pagedkv::DecodePlanInfo plan_info;
    if (!prefill && mode.plan) {
      const std::span<const std::int32_t> lens(md_.seq_lens.data(), static_cast<std::size_t>(cap_.max_batch));
      if (const pagedkv::Status s = pagedkv::plan_decode(lens, cap_.plan, md_.plan_buffers(), &plan_info);
          s != pagedkv::Status::kSuccess) {
        std::printf("step %d: plan_decode: %s\n", step, pagedkv::to_string(s));
        return false;
      }
      mode.plan_items = plan_info.nonempty_items;
      mode.plan_split = plan_info.num_merges;
    }
    if (const BackendResult r = backend_->set_metadata(md_); !r.ok()) {
      std::printf("step %d: %s\n", step, r.what.c_str());
      return false;
    }
    // The host tier's copies run first: swap_out (offloads, swapped-out sequences), then swap_in (resumed
    // sequences, onboarded prefix hits), then the layers.
    if (sz.num_swap_out + sz.num_swap_in > 0) {
      if (const BackendResult r = backend_->run_swaps(static_cast<int>(sz.num_swap_out), static_cast<int>(sz.num_swap_in));
          !r.ok()) {
        std::printf("step %d: %s\n", step, r.what.c_str());
        return false;
      }
    }

    // Query rows: prefill rows are the new tokens (qo_indptr); decode rows are one per batch slot, capacity-padded.
    const int q_rows = prefill ? md_.qo_indptr[static_cast<std::size_t>(cap_.max_batch)] : cap_.max_batch;
    StepCheck check;
    for (int layer = 0; layer < shape_.num_layers; ++layer) {
      fill_new_kv(b_count, layer);
      const std::vector<double> qd = fill_q(q_rows);
      std::fill(o_.begin(), o_.end(), std::byte{0xff});  // poison: every row must be written
      std::fill(lse_.begin(), lse_.end(), std::numeric_limits<float>::quiet_NaN());
      LayerWork w;
      w.layer = layer;
      w.prefill = prefill;
      w.format = prefill ? PageTableFormat::kCsr : mode.format;
      w.total_q_rows = q_rows;
      w.num_new_tokens = new_tokens;
      w.kv_chunk_size_tokens = prefill || mode.plan ? 0 : mode.chunk;
      w.max_num_chunks = prefill || mode.plan ? 0 : mode.max_chunks;
      w.use_plan = !prefill && mode.plan;
      w.plan = plan_info.work_list;
      w.q = q_.data();
      w.key = key_.data();
      w.value = value_.data();
      w.o = o_.data();
      w.lse = lse_.data();
      if (const BackendResult r = backend_->run_layer(w); !r.ok()) {
        std::printf("step %d layer %d: %s\n", step, layer, r.what.c_str());
        check.first_failure = r.what;
        check.max_rel_err = std::numeric_limits<double>::infinity();
        break;
      }
      verify_layer(layer, prefill, b_count, q_rows, qd, check);
    }

    const bool pass = check.first_failure.empty() && check.max_rel_err <= o_tolerance(shape_.dtype) &&
                      check.max_lse_err <= kLseTolerance;
    std::printf("step %3d %-7s batch %3d  new %4d (slot -1: %2d)  copies %2zu  %s  max_rel_err %.3e  lse_err %.2e  %s\n",
                step, prefill ? "prefill" : "decode", b_count, new_tokens, skipped, sz.num_copies,
                prefill ? "csr    qo_indptr      " : mode.describe().c_str(), check.max_rel_err, check.max_lse_err,
                pass ? "PASS" : "FAIL");
    if (!pass && !check.first_failure.empty()) std::printf("         first failure: %s\n", check.first_failure.c_str());
    if (tiered() && sz.num_swap_out + sz.num_swap_in > 0) {
      std::printf("         swaps: %zu out (device -> host), %zu in (host -> device); running %d, swapped %zu\n",
                  sz.num_swap_out, sz.num_swap_in, b_count, swap_queue_.size());
    }
    total_copies_ += sz.num_copies;
    total_swap_out_ += sz.num_swap_out;
    total_swap_in_ += sz.num_swap_in;
    // The step ran: acknowledge its copies (the blocks they read or filled were pinned until now).
    if (sz.transfer_token != 0) mgr_.complete_transfers(sz.transfer_token);
    return pass;
  }

  /// K/V rows of the step's new tokens (rows in slot-mapping order, i.e. qo_indptr order) for `layer`.
  void fill_new_kv(int b_count, int layer) {
    std::vector<float> row(static_cast<std::size_t>(shape_.kv_row_elems()));
    for (int b = 0; b < b_count; ++b) {
      const Seq& s = seqs_[batch_idx_[static_cast<std::size_t>(b)]];
      const int q0 = md_.qo_indptr[static_cast<std::size_t>(b)];
      const int q_len = md_.qo_indptr[static_cast<std::size_t>(b) + 1] - q0;
      const auto first_pos = static_cast<std::int64_t>(s.pos_hash.size()) - q_len;
      for (int i = 0; i < q_len; ++i) {
        const std::uint64_t h = s.pos_hash[static_cast<std::size_t>(first_pos + i)];
        kv_rows(shape_, h, layer, false, row.data());
        store_row(shape_.dtype, key_.data(), std::int64_t{q0 + i} * shape_.kv_row_elems(), row.data(), shape_.kv_row_elems());
        kv_rows(shape_, h, layer, true, row.data());
        store_row(shape_.dtype, value_.data(), std::int64_t{q0 + i} * shape_.kv_row_elems(), row.data(),
                  shape_.kv_row_elems());
      }
    }
  }

  /// Random q rows (rounded to dtype) into the q buffer; returns them as doubles.
  std::vector<double> fill_q(int rows) {
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const std::int64_t n = std::int64_t{rows} * shape_.q_row_elems();
    std::vector<double> qd(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      float x = 0.f;
      while (x == 0.f) x = round_to(shape_.dtype, u(rng_));  // never zero
      pagedkv::reference::store(q_.data(), shape_.dtype, i, x);
      qd[static_cast<std::size_t>(i)] = x;
    }
    return qd;
  }

  /// Compares every output row of one layer with the float64 oracle.
  void verify_layer(int layer, bool prefill, int b_count, int q_rows, const std::vector<double>& qd, StepCheck& c) {
    const int hq = shape_.num_qo_heads;
    const int hd = shape_.head_dim;
    const int group = hq / shape_.num_kv_heads;
    const double scale = shape_.sm_scale();
    std::vector<float> got(static_cast<std::size_t>(hd));
    std::vector<double> ref(static_cast<std::size_t>(hd));
    const auto note = [&](const std::string& what) {
      if (c.first_failure.empty()) c.first_failure = what;
    };
    const auto check_row = [&](std::int64_t row, int h, const SeqKV* kv, std::int64_t visible, SeqId id) {
      const std::int64_t r = row * hq + h;
      for (int d = 0; d < hd; ++d) {
        got[static_cast<std::size_t>(d)] = pagedkv::reference::load(o_.data(), shape_.dtype, r * hd + d);
      }
      const float lse = lse_[static_cast<std::size_t>(r)];
      if (kv == nullptr) {  // padding row: exactly o = 0, lse = -inf
        bool zero = true;
        for (float g : got) zero = zero && g == 0.f;
        if (!zero || !(std::isinf(lse) && lse < 0)) {
          c.max_rel_err = std::numeric_limits<double>::infinity();
          note("layer " + std::to_string(layer) + " padding row " + std::to_string(row) + " head " +
               std::to_string(h) + ": want o = 0, lse = -inf (lse " + std::to_string(lse) + ")");
        }
        return;
      }
      double ref_lse = 0.0;
      attend_f64(shape_, *kv, h / group, qd.data() + r * hd, visible, scale, ref.data(), &ref_lse);
      const double err = row_rel_error(got.data(), ref.data(), hd);
      const double lerr = std::isfinite(lse) ? std::abs(lse - ref_lse) / std::max(1.0, std::abs(ref_lse))
                                             : std::numeric_limits<double>::infinity();
      if (!(err <= o_tolerance(shape_.dtype)) || !(lerr <= kLseTolerance)) {
        char buf[200];
        std::snprintf(buf, sizeof buf, "layer %d seq %llu row %lld head %d (%lld visible tokens): rel err %.3e, lse %.6f vs %.6f",
                      layer, static_cast<unsigned long long>(id), static_cast<long long>(row), h,
                      static_cast<long long>(visible), err, static_cast<double>(lse), ref_lse);
        note(buf);
      }
      c.max_rel_err = std::max(c.max_rel_err, std::isnan(err) ? std::numeric_limits<double>::infinity() : err);
      c.max_lse_err = std::max(c.max_lse_err, std::isnan(lerr) ? std::numeric_limits<double>::infinity() : lerr);
    };

    SeqKV kv;
    for (int b = 0; b < b_count; ++b) {
      const Seq& s = seqs_[batch_idx_[static_cast<std::size_t>(b)]];
      kv.build(shape_, s.pos_hash, layer);
      const auto len = static_cast<std::int64_t>(s.pos_hash.size());
      const int q0 = prefill ? md_.qo_indptr[static_cast<std::size_t>(b)] : b;
      const int q_len = prefill ? md_.qo_indptr[static_cast<std::size_t>(b) + 1] - q0 : 1;
      for (int i = 0; i < q_len; ++i) {
        const std::int64_t pos = len - q_len + i;  // causal: sees positions [0, pos]
        for (int h = 0; h < hq; ++h) check_row(q0 + i, h, &kv, pos + 1, s.id);
      }
    }
    if (!prefill) {
      for (int row = b_count; row < q_rows; ++row) {
        for (int h = 0; h < hq; ++h) check_row(row, h, nullptr, 0, 0);
      }
    }
  }

  // ---- teardown: free everything, every block must come back --------------------------------------------------------
  bool finish() {
    const auto before = mgr_.stats();
    for (const Seq& s : seqs_) {
      if (!s.done) mgr_.free(s.id);  // swapped ones too
    }
    const auto after = mgr_.stats();
    if (tiered()) {
      std::printf("host tier: %d swap preemptions, %d sequence-steps waited, %d resumes (%zu tokens copied back, the rest still cached on the "
                  "device), %zu blocks swapped out and %zu in by swap_blocks; offloads %llu, onboards %llu; host "
                  "blocks used after freeing all: %zu of %zu\n",
                  swap_preemptions_, waits_, resumes_, resumed_copied_tokens_, total_swap_out_, total_swap_in_,
                  static_cast<unsigned long long>(after.offloads), static_cast<unsigned long long>(after.onboards),
                  after.host_blocks_used, after.host_num_usable_blocks);
      if (after.host_blocks_used != 0 || after.transfers_in_flight != 0) {
        std::printf("host tier leaked %zu block(s) (%zu copies in flight)\n", after.host_blocks_used,
                    after.transfers_in_flight);
        return false;
      }
    }
    std::printf("manager: %llu prefix-hit tokens, %llu deduplicated blocks, %llu COW copies (%zu issued), "
                "blocks used at the end %zu of %zu; after freeing all: %zu used, %zu cached\n",
                static_cast<unsigned long long>(after.prefix_hit_tokens),
                static_cast<unsigned long long>(after.dedup_blocks), static_cast<unsigned long long>(after.cow_copies),
                total_copies_, before.blocks_used, before.num_usable_blocks, after.blocks_used, after.blocks_cached);
    if (after.blocks_used != 0) {
      std::printf("manager leaked %zu block(s)\n", after.blocks_used);
      return false;
    }
    return true;
  }

  Options opt_;
  Shape shape_;
  Capacity cap_;
  std::unique_ptr<Backend> backend_;
  std::vector<std::vector<TokenId>> prompts_;
  pagedkv::KVCacheManager<> mgr_;
  Metadata md_;
  std::mt19937_64 rng_;
  std::vector<Seq> seqs_;  // batch order: the original requests, then forks in creation order
  std::vector<std::byte> q_, o_;
  std::vector<float> lse_;
  std::vector<std::byte> key_, value_;
  std::size_t total_copies_ = 0;
  std::vector<std::size_t> batch_idx_;  // this step's batch: indices into seqs_ (running sequences, in order)
  std::deque<std::size_t> swap_queue_;  // swapped sequences, first swapped first
  int swap_preemptions_ = 0, resumes_ = 0, waits_ = 0;
  std::size_t resumed_copied_tokens_ = 0, total_swap_out_ = 0, total_swap_in_ = 0;
};

/// Prompts: two groups, each opening with its own system prompt; request i belongs to group i % 2 and adds its own
/// suffix. With batch >= 3 the last request is a retry of a block-aligned piece of request 0's prompt, so its last
/// full block is registered already (deduplicated: slot -1) and the rest are prefix hits.
std::vector<std::vector<TokenId>> make_prompts(const Options& opt) {
  std::mt19937_64 rng(opt.seed);
  std::uniform_int_distribution<TokenId> tok(1, 49999);
  std::vector<TokenId> system[2];
  for (auto& sp : system) {
    for (int i = 0; i < opt.system_prompt_tokens; ++i) sp.push_back(tok(rng));
  }
  std::vector<std::vector<TokenId>> prompts;
  for (int i = 0; i < opt.batch; ++i) {
    std::vector<TokenId> p = system[i % 2];
    const int suffix = i == 0 ? std::uniform_int_distribution<int>(30, 60)(rng) : std::uniform_int_distribution<int>(4, 48)(rng);
    for (int j = 0; j < suffix; ++j) p.push_back(tok(rng));
    prompts.push_back(std::move(p));
  }
  if (opt.batch >= 3) {
    const std::size_t len0 = prompts[0].size();
    const std::size_t bs = static_cast<std::size_t>(opt.block_size);
    const std::size_t aligned = len0 / bs * bs;
    prompts.back().assign(prompts[0].begin(), prompts[0].begin() + static_cast<std::ptrdiff_t>(aligned > 0 ? aligned : len0));
  }
  return prompts;
}

int run_main(int argc, char** argv) {
  Options opt;
  std::string dtype_arg = "fp32";
  std::string layout_arg = "nhd";
  CLI::App app{
      "decode_loop: an inference runtime in miniature. A KVCacheManager admits requests with shared prefixes, forks\n"
      "some, prefills, then decodes; every step builds the batch metadata into fixed buffers and runs, per layer,\n"
      "copy_blocks -> write_kv -> paged attention, and every output is checked against float64 attention."};
  app.add_option("--block-size", opt.block_size, "Tokens per KV block")->check(CLI::Range(1, 1024));
  app.add_option("--batch", opt.batch, "Requests admitted at step 0")->check(CLI::Range(1, 512));
  app.add_option("--forks", opt.forks, "Sequences forked (parallel sampling): half before step 1, half mid-way")
      ->check(CLI::Range(0, 512));
  app.add_option("--steps", opt.steps, "Decode steps after the two prefill steps")->check(CLI::Range(0, 4096));
  app.add_option("--layers", opt.layers, "Layers (one KV pool each)")->check(CLI::Range(1, 64));
  app.add_option("--head-dim", opt.head_dim, "Head dim")->check(CLI::IsMember({64, 128}));
  app.add_option("--system-prompt", opt.system_prompt_tokens, "Tokens of each group's shared system prompt")
      ->check(CLI::Range(0, 4096));
  app.add_option("--seed", opt.seed, "Seed of prompts, sampled tokens and q");
  app.add_option("--dtype", dtype_arg, "Element type of q, k, v, o")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--layout", layout_arg, "KV pool layout")->check(CLI::IsMember({"nhd", "hnd", "sep-nhd", "sep-hnd"}));
  app.add_option("--device", opt.device, "Backend: cpu (pagedkv::reference) or cuda (pagedkv::cuda)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("-v,--verbose", opt.verbose, "Print admissions and forks (and swaps, resumes, finishes)");
  std::string offload_arg = "write-back";
  app.add_option("--gpu-blocks", opt.gpu_blocks,
                 "Usable device pool blocks (default: enough for every sequence). With --host-blocks, a small pool "
                 "makes appends preempt the newest sequence by swap")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--host-blocks", opt.host_blocks,
                 "Host tier blocks (0 = none): swap preemption and resume through swap_blocks (CPU reference); "
                 "request i then finishes after steps * (i + 1) / batch tokens so swapped sequences can resume")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--offload", offload_arg, "With --host-blocks: none, write-back or write-through")
      ->check(CLI::IsMember({"none", "write-back", "write-through"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  opt.offload = offload_arg == "none"            ? pagedkv::OffloadPolicy::kNone
                : offload_arg == "write-through" ? pagedkv::OffloadPolicy::kWriteThrough
                                                 : pagedkv::OffloadPolicy::kWriteBack;
  if (opt.host_blocks > 0 && opt.device != "cpu") {
    std::fprintf(stderr, "decode_loop: --host-blocks runs on --device cpu only (the CUDA backend has no host tier "
                         "pool yet)\n");
    return 2;
  }
  if (opt.gpu_blocks > 0 && opt.host_blocks == 0) {
    std::fprintf(stderr, "decode_loop: --gpu-blocks %d without --host-blocks: a pool smaller than the default needs "
                         "the host tier to preempt into\n", opt.gpu_blocks);
    return 2;
  }
  opt.dtype = dtype_arg == "bf16" ? DType::kBFloat16 : dtype_arg == "fp16" ? DType::kFloat16 : DType::kFloat32;
  opt.layout = layout_arg == "hnd"       ? Layout::kHnd
               : layout_arg == "sep-nhd" ? Layout::kSeparateNhd
               : layout_arg == "sep-hnd" ? Layout::kSeparateHnd
                                         : Layout::kNhd;

  const auto prompts = make_prompts(opt);

  // Capacities, fixed before the first step (no sharing assumed: an upper bound).
  Shape shape;
  shape.dtype = opt.dtype;
  shape.num_layers = opt.layers;
  shape.head_dim = opt.head_dim;
  shape.block_size = opt.block_size;
  shape.layout = opt.layout;
  std::size_t max_prompt = 0;
  std::size_t sum_prompt = 0;
  for (const auto& p : prompts) {
    max_prompt = std::max(max_prompt, p.size());
    sum_prompt += p.size();
  }
  const auto max_len = static_cast<int>(max_prompt) + opt.steps;
  Capacity cap;
  cap.max_batch = opt.batch + opt.forks;
  cap.max_blocks_per_seq = (max_len + opt.block_size - 1) / opt.block_size;
  cap.max_indices = cap.max_batch * cap.max_blocks_per_seq;
  cap.max_new_tokens = std::max(static_cast<int>(sum_prompt), cap.max_batch);
  cap.max_q_rows = std::max(cap.max_new_tokens, cap.max_batch);
  cap.max_copies = cap.max_batch;
  cap.max_num_chunks = std::max(3, (max_len + 6) / 7);  // the smallest explicit chunk is 7 tokens
  // Every sequence's blocks, one copy-on-write block each, and the sources pending copies hold: an upper bound.
  const long long blocks = 1LL + static_cast<long long>(cap.max_batch) * (cap.max_blocks_per_seq + 2);
  if (blocks > std::numeric_limits<std::int32_t>::max() / opt.block_size) {
    std::fprintf(stderr, "decode_loop: pool of %lld blocks is too large\n", blocks);
    return 2;
  }
  shape.num_blocks = static_cast<int>(blocks);
  if (opt.gpu_blocks > 0) {
    if (opt.gpu_blocks < cap.max_blocks_per_seq + 1) {
      std::fprintf(stderr, "decode_loop: --gpu-blocks %d cannot hold one sequence of %d blocks (+ one copy-on-write)\n",
                   opt.gpu_blocks, cap.max_blocks_per_seq);
      return 2;
    }
    shape.num_blocks = opt.gpu_blocks + 1;  // + the null block
  }
  if (opt.host_blocks > 0) {
    cap.num_host_blocks = opt.host_blocks + 1;
    // Per build: each device block at most once each way, plus write-through offloads of the blocks registered by
    // the previous build (<= its indices).
    cap.max_swaps = shape.num_blocks + cap.max_indices;
  }

  // The decode plan's device description, and buffers that fit every plan of a batch of max_batch sequences.
  if (opt.device == "cuda") {
    std::string error;
    if (!cuda_plan_config(shape, &cap.plan, &error)) {
      std::fprintf(stderr, "decode_loop: --device cuda: %s\n", error.c_str());
      return 2;
    }
  } else {
    cap.plan = cpu_plan_config(shape);
  }
  cap.plan_cap = pagedkv::decode_plan_capacity(cap.max_batch, cap.plan);

  std::unique_ptr<Backend> backend;
  if (opt.device == "cuda") {
    std::string error;
    backend = make_cuda_backend(shape, cap, &error);
    if (!backend) {
      std::fprintf(stderr, "decode_loop: --device cuda: %s\n", error.c_str());
      return 2;
    }
  } else {
    backend = make_cpu_backend(shape, cap);
  }

  std::printf("decode_loop: %s, %s %s, %d layers, %d qo / %d kv heads x %d, block size %d, %d blocks, batch %d + %d "
              "forks, %d decode steps, seed %llu\n",
              backend->name().c_str(), dtype_name(shape.dtype), layout_name(shape.layout), shape.num_layers,
              shape.num_qo_heads, shape.num_kv_heads, shape.head_dim, shape.block_size, shape.num_blocks, opt.batch,
              opt.forks, opt.steps, static_cast<unsigned long long>(opt.seed));
  std::printf("tolerance: max rel err %.0e (row-normwise vs float64), lse %.0e; unused pool slots are NaN\n",
              o_tolerance(shape.dtype), kLseTolerance);

  Runtime rt(opt, std::move(backend), shape, cap, prompts);
  bool pass = false;
  try {
    pass = rt.run();
  } catch (const pagedkv::Error& e) {
    std::printf("pagedkv error: %s\n", e.what());
    pass = false;
  }
  std::printf("decode_loop: %s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace
}  // namespace decode_loop

int main(int argc, char** argv) {
  try {
    return decode_loop::run_main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decode_loop: %s\n", e.what());
    std::printf("decode_loop: FAIL\n");
    return 1;
  }
}
