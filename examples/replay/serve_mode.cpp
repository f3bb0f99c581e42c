// examples/replay/serve_mode.cpp: `--mode serve`, continuous batching in simulated time over a paged pool, with a
// contiguous max-length-reservation baseline on the same arrivals (vLLM paper, Fig. 2).
//
// One engine step (every --step-ms of simulated time), in the order of vLLM V1's scheduler, under a token budget of
// --max-num-batched-tokens per step (chunked prefill; 0 = no budget, whole prompts in one step):
//  1. arrivals up to the step's start join the waiting queue (FIFO);
//  2. running sequences, oldest first, take tokens from the budget: a prefilling sequence its next prompt chunk
//     (its slots were reserved at admission), a decoding one its sampled token (try_append) plus, with
//     --spec-tokens k, k lookahead slots for draft tokens (try_reserve_lookahead). When the pool has no block
//     for a decode, the most recently admitted running sequence is preempted (recompute) and put back at the
//     front of the waiting queue, until it fits (possibly preempting the decoding sequence itself);
//  3. admission, unless step 2 preempted (as vLLM V1 does, so a victim is not re-admitted in the step that evicted
//     it): waiting requests are admitted in order while the pool, --max-num-seqs and the budget allow; admission
//     reserves the whole prompt (vLLM's gate) and schedules its first chunk; the first that does not fit stops. A
//     waiting prompt is hashed once (prepare_prompt) and only walked again on each retry;
//  4. build_batch_metadata for the scheduled sequences, with their per-sequence token counts;
//  5. the drafts are verified: each is accepted with probability --spec-accept until the first rejection
//     (commit_lookahead keeps the accepted ones and rewinds the rest); utilization is sampled; sequences that have
//     generated output_length tokens are freed.
// A preempted request is re-admitted with its prompt plus the tokens it had generated (vLLM V1's recompute: the
// KV of all of them is recomputed, and their full blocks are usually still in the prefix cache); it then
// generates only its remaining tokens.
// With a host tier (--host-capacity-tokens) the build of step 4 also carries the step's copies (swap_out: offloads
// of evicted cached blocks under --offload, swapped-out sequences; swap_in: onboarding of host-tier prefix hits,
// resumed sequences), and the replay acknowledges them right after the build (complete_transfers), as an engine does
// once the step ran. With --preempt swap a decoding victim is swapped out instead (preempt(seq, kSwap)) and, at the
// front of the waiting queue, resumed by try_resume when admission reaches it (no recomputation; it decodes from
// the next step on); a victim still prefilling, or one the host tier has no room for, is preempted by recompute.
// With --reserve chunk, admission reserves only the first chunk and each later chunk is reserved just before its
// step (try_reserve; a refusal preempts the newest sequence, as a decode's does).
// The same scheduler replays a pool with KV-cache groups (--model-layers, run_serve_groups): one page table per
// group in every build (the swap lists in group 0's buffers), the blocks held counted per group.
#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <random>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "modes.hpp"
#include "publish.hpp"

namespace replay {
namespace {

/// Time-averaged KV utilization and peak concurrency of one scheduler.
struct Occupancy {
  double utilization_sum = 0.0;   // over busy steps
  std::uint64_t busy_steps = 0;   // steps with at least one running sequence
  std::uint64_t seq_steps = 0;    // sum over busy steps of running sequences
  std::size_t peak_running = 0;
  double last_busy_end_ms = 0.0;  // end of the last busy step: when the scheduler finished its work

  void sample(double utilization, std::size_t running, double step_end_ms) {
    utilization_sum += utilization;
    ++busy_steps;
    seq_steps += running;
    peak_running = std::max(peak_running, running);
    last_busy_end_ms = step_end_ms;
  }
  [[nodiscard]] double mean_utilization() const {
    return busy_steps == 0 ? 0.0 : utilization_sum / static_cast<double>(busy_steps);
  }
};

/// The paged scheduler: a KVCacheManager pool (one group, or the groups of opt.groups), FIFO admission, chunked
/// prefill under a token budget, optional speculative decoding with lookahead slots, recompute or swap preemption.
template <class Manager>
class PagedScheduler {
 public:
  /// `usable_blocks`: blocks per group (the pool has that many per group + the null block).
  PagedScheduler(const Trace& trace, const Options& opt, std::size_t usable_blocks, std::size_t max_model_len)
      : trace_(trace),
        opt_(opt),
        usable_blocks_(usable_blocks),
        max_model_len_(max_model_len),
        num_groups_(std::max<std::size_t>(opt.groups.size(), 1)),
        budget_(opt.max_num_batched_tokens != 0 ? opt.max_num_batched_tokens : std::numeric_limits<std::size_t>::max()),
        manager_(config(opt, usable_blocks, max_model_len)),
        views_(num_groups_),
        sizes_(num_groups_),
        sum_held_(num_groups_, 0.0),
        swapped_blocks_(num_groups_, 0),
        rng_(0x5bec) {
    buffers_.reserve(num_groups_);
    for (std::size_t g = 0; g < num_groups_; ++g) {
      buffers_.emplace_back(opt.max_num_seqs, opt.max_num_seqs * std::min(usable_blocks, blocks(max_model_len)),
                            usable_blocks * opt.block_size + opt.max_num_seqs, opt.max_num_seqs,
                            // swaps of one build (group 0's lists): every device block at most once each way, +
                            // write-through's offloads of the blocks the previous build registered (<= its indices)
                            g == 0 && opt.host_capacity_tokens > 0
                                ? num_groups_ * (usable_blocks + opt.max_num_seqs *
                                                                     std::min(usable_blocks, blocks(max_model_len)))
                                : 0);
    }
    admit_options_.retention = opt.retention;  // applied when a sequence releases its blocks
  }

  /// A request arrives. One that can never run (longer than max_model_len, or than the pool) is rejected.
  void enqueue(std::size_t request) {
    const Request& r = trace_.requests[request];
    const std::size_t total = std::size_t{r.input_tokens} + r.output_tokens;
    if (total > max_model_len_ || blocks(total) > usable_blocks_) {
      ++rejected_;
      return;
    }
    waiting_.push_back({request});
  }

  /// Whether nothing is waiting or running.
  [[nodiscard]] bool idle() const noexcept { return waiting_.empty() && running_.empty(); }
  /// Requests finished or rejected so far.
  [[nodiscard]] std::size_t done() const noexcept { return finished_ + rejected_; }

  /// The paged manager (for --publish-events).
  [[nodiscard]] auto& manager() noexcept { return manager_; }
  [[nodiscard]] const auto& manager() const noexcept { return manager_; }

  /// Run one engine step ending at simulated time `step_end_ms`.
  void step(double step_end_ms) {
    left_ = budget_;
    batch_.clear();
    sched_.clear();
    if (!schedule_running()) admit();
    if (running_.empty()) {
      // Every running sequence was swapped out: the step still issues their copies (an empty batch).
      if (manager_.transfers().queued().empty()) return;
      build_metadata();
      return;
    }
    build_metadata();
    verify_drafts();
    sample(step_end_ms);
    free_finished();
  }

  /// Append this scheduler's columns to `row` (one group: run_serve's row).
  void add_fields(Row& row) const {
    const pagedkv::CacheStats s = manager_.stats();
    row.add("eviction", to_string(opt_.eviction)).add("retention", opt_.retention_label);
    if (opt_.host_capacity_tokens > 0) add_host_config_fields(row, s);
    if (opt_.reserve != ReserveKind::kPrompt) row.add("reserve", to_string(opt_.reserve));
    row.add("preempt", to_string(opt_.preempt))
        .add("rejected", rejected_)
        .add("steps", occupancy_.busy_steps)
        .add("sim_seconds", occupancy_.last_busy_end_ms / 1000.0, 1)
        .add("kv_utilization", occupancy_.mean_utilization(), 4)
        .add("peak_running", occupancy_.peak_running)
        .add("preemptions", s.preemptions);
    add_preemption_fields(row, s);
    row.add("hit_ratio", hit_ratio(s), 4).add("evictions", s.evictions);
    if (opt_.host_capacity_tokens > 0) add_tier_fields(row, s, opt_);
    row
        .add("max_num_batched_tokens", opt_.max_num_batched_tokens)
        .add("prefill_chunks_per_prompt",
             prefills_ == 0 ? 0.0 : static_cast<double>(prefill_chunks_) / static_cast<double>(prefills_), 3)
        .add("max_prefill_chunks", max_chunks_)
        .add("spec_tokens", opt_.spec_tokens);
    if (opt_.spec_tokens > 0) add_spec_fields(row);
  }

  /// Append the columns of a pool with groups to `row` (run_serve_groups: the hybrid replay's row; the columns of
  /// the host tier, swaps and speculation only when they are on, so a run without them reads as before).
  /// `group_kinds`: a column label per group.
  void add_group_fields(Row& row, const std::vector<std::string>& group_kinds) const {
    const pagedkv::CacheStats s = manager_.stats();
    const double steps = static_cast<double>(std::max<std::uint64_t>(occupancy_.busy_steps, 1));
    const bool host = opt_.host_capacity_tokens > 0;
    if (opt_.eviction != EvictionKind::kLru || host) {
      row.add("eviction", to_string(opt_.eviction)).add("retention", opt_.retention_label);
    }
    if (host) add_host_config_fields(row, s);
    if (opt_.reserve != ReserveKind::kChunk) row.add("reserve", to_string(opt_.reserve));
    row.add("rejected", rejected_)
        .add("steps", occupancy_.busy_steps)
        .add("sim_seconds", static_cast<double>(occupancy_.busy_steps) * opt_.step_ms / 1000.0, 1)
        .add("kv_utilization", occupancy_.utilization_sum / steps, 4)
        .add("mean_running", static_cast<double>(occupancy_.seq_steps) / steps, 1)
        .add("peak_running", occupancy_.peak_running)
        .add("preemptions", s.preemptions);
    if (host) row.add("preempt", to_string(opt_.preempt));
    if (host) add_preemption_fields(row, s);
    row.add("hit_ratio", hit_ratio(s), 4);
    if (host) {
      row.add("evictions", s.evictions);
      Options per_block = opt_;  // a block holds one group's layers: 1 / groups of --kv-bytes-per-token per token
      per_block.kv_bytes_per_token = opt_.kv_bytes_per_token / num_groups_;
      add_tier_fields(row, s, per_block);
    }
    if (opt_.spec_tokens > 0) add_spec_fields(row);
    row.add("peak_blocks", manager_.peak_used_blocks())
        .add("mean_blocks", sum_used_ / steps, 0)
        .add("blocks_per_token", blocks_per_token(), 5);
    std::map<std::string, std::pair<std::size_t, double>> per_kind;  // peak and mean blocks of a group, per kind
    std::map<std::string, std::uint64_t> swapped;                      // blocks swapped out, all groups of a kind
    for (std::size_t g = 0; g < group_kinds.size() && g < num_groups_; ++g) {
      auto& k = per_kind[group_kinds[g]];
      k.first = std::max(k.first, manager_.peak_held_blocks(g));
      k.second = std::max(k.second, sum_held_[g] / steps);
      swapped[group_kinds[g]] += swapped_blocks_[g];
    }
    for (const auto& [label, v] : per_kind) {
      row.add("peak_blocks_" + label, v.first).add("mean_blocks_" + label, v.second, 0);
    }
    if (opt_.preempt == pagedkv::PreemptMode::kSwap && num_groups_ > 1) {
      for (const auto& [label, n] : swapped) row.add("swapped_blocks_" + label, n);
    }
  }
  /// Time-averaged blocks used per token held by a running sequence (0 before any step).
  [[nodiscard]] double blocks_per_token() const noexcept { return sum_tokens_ == 0 ? 0.0 : sum_used_ / sum_tokens_; }
  /// Library time: all calls; admissions (try_admit); the step path (appends, lookahead, build, commits).
  [[nodiscard]] double manager_seconds() const noexcept {
    return admit_timer_.seconds() + decode_timer_.seconds() + release_timer_.seconds();
  }
  [[nodiscard]] double admit_seconds() const noexcept { return admit_timer_.seconds(); }
  [[nodiscard]] double decode_seconds() const noexcept { return decode_timer_.seconds(); }
  [[nodiscard]] std::uint64_t block_ops() const noexcept { return manager_.stats().block_ops; }
  [[nodiscard]] std::uint64_t seq_steps() const noexcept { return occupancy_.seq_steps; }
  [[nodiscard]] std::uint64_t scheduled_tokens() const noexcept { return scheduled_tokens_; }

 private:
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();

  struct Seq {
    std::size_t request = 0;      // trace index, also the sequence id
    std::uint32_t generated = 0;  // tokens generated so far (kept across preemption)
    std::size_t tokens = 0;       // positions holding slots (running only)
    std::size_t prompt = 0;       // prompt of this admission (input + tokens generated before a preemption)
    std::size_t computed = 0;     // positions whose K/V a built step computed (or cache hits)
    std::size_t drafts = 0;       // lookahead slots reserved this step
    std::uint32_t chunks = 0;     // steps with prompt tokens scheduled, this admission
    std::uint64_t failed_at = kNever;  // releases_ when its admission last failed (waiting only)
    bool swapped = false;              // waiting: preempted by swap, resumed by try_resume (not re-admitted)
    std::shared_ptr<pagedkv::PreparedPrompt> prepared;  // waiting: its prompt, hashed once for the retries
    [[nodiscard]] bool prefilling() const { return computed < prompt; }
  };

  void add_host_config_fields(Row& row, const pagedkv::CacheStats& s) const {
    row.add("host_capacity_tokens", static_cast<std::int64_t>(opt_.host_capacity_tokens))
        .add("host_pool_blocks", s.host_num_usable_blocks)
        .add("host_eviction", to_string(opt_.host_eviction))
        .add("offload", to_string(opt_.offload));
  }

  void add_preemption_fields(Row& row, const pagedkv::CacheStats& s) const {
    row.add("swap_preemptions", swap_preemptions_)
        .add("recompute_preemptions", s.preemptions - swap_preemptions_)
        .add("resumes", resumes_)
        // Tokens the re-admissions after recompute preemption had to compute again (their prompt + generated
        // tokens not found in the prefix cache, either tier).
        .add("recomputed_tokens", s.readmitted_query_tokens - s.readmitted_hit_tokens);
  }

  void add_spec_fields(Row& row) const {
    row.add("spec_accept", opt_.spec_accept, 2)
        .add("drafts", drafts_)
        .add("drafts_accepted", accepted_)
        .add("wasted_slot_steps", drafts_ - accepted_)
        .add("tokens_per_decode_step", decode_steps_ == 0 ? 0.0
                                                          : static_cast<double>(decode_tokens_) /
                                                                static_cast<double>(decode_steps_), 3);
  }

  static pagedkv::CacheConfig config(const Options& opt, std::size_t usable_blocks, std::size_t max_model_len) {
    pagedkv::CacheConfig c;
    const std::size_t groups = std::max<std::size_t>(opt.groups.size(), 1);
    c.num_blocks = usable_blocks * groups + 1;  // + the null block
    c.block_size = opt.block_size;
    c.groups = opt.groups;
    c.max_tokens_per_seq = max_model_len;
    c.enable_events = !opt.publish_events.empty();  // --publish-events (publish.hpp)
    if (opt.host_capacity_tokens > 0) {
      // As the device pool: the tokens the all-full model holds, i.e. that many blocks per group.
      c.num_host_blocks =
          usable_blocks_for(opt.host_capacity_tokens, opt.block_size, "--host-capacity-tokens") * groups + 1;
      c.offload = opt.offload;
    }
    return c;
  }

  [[nodiscard]] std::size_t blocks(std::size_t tokens) const noexcept {
    return (tokens + opt_.block_size - 1) / opt_.block_size;
  }

  void schedule(std::size_t k, std::size_t n) {
    batch_.push_back(running_[k].request);
    sched_.push_back(static_cast<std::uint32_t>(n));
    left_ -= n;
    scheduled_tokens_ += n;
  }

  // The next prompt chunk of running_[k] (its slots exist since admission), as much as the budget allows.
  void schedule_prompt_chunk(std::size_t k) {
    Seq& s = running_[k];
    const std::size_t n = std::min(s.prompt - s.computed, left_);
    schedule(k, n);
    s.computed += n;
    ++s.chunks;
    if (!s.prefilling()) {  // the prompt is computed: count its chunks
      prefill_chunks_ += s.chunks;
      ++prefills_;
      max_chunks_ = std::max<std::size_t>(max_chunks_, s.chunks);
    }
  }

  // Step 2: the running sequences take their tokens. Returns whether a sequence was preempted.
  bool schedule_running() {
    bool preempted = false;
    for (std::size_t k = 0; k < running_.size() && left_ > 0;) {
      Seq& s = running_[k];
      if (s.prefilling()) {
        if (opt_.reserve == ReserveKind::kChunk) {  // this chunk's slots, reserved now
          const std::size_t n = std::min(s.prompt - s.computed, left_);
          decode_timer_.start();
          const bool ok = manager_.try_reserve(s.request, n).ok();
          decode_timer_.stop();
          if (!ok) {  // preempt the newest (possibly this one) and retry
            preempt_newest();
            preempted = true;
            continue;
          }
          s.tokens += n;
        }
        schedule_prompt_chunk(k++);
        continue;
      }
      // Decode: the sampled token, plus draft slots (as many as the budget and the output length allow).
      const Request& r = trace_.requests[s.request];
      const std::size_t remaining = r.output_tokens - s.generated;  // >= 1 while running
      const std::size_t k_spec = std::min({opt_.spec_tokens, left_ - 1, remaining - 1});
      decode_timer_.start();
      const bool fits = manager_.query_append(s.request, 1 + k_spec).fits();
      decode_timer_.stop();
      if (!fits) {  // preempt the newest (possibly this one) and retry
        preempt_newest();
        preempted = true;
        continue;
      }
      const pagedkv::TokenId t = generated_token(s.request, 0, s.generated);
      decode_timer_.start();
      const bool ok = manager_.try_append(s.request, {&t, 1}).ok() &&
                      (k_spec == 0 || manager_.try_reserve_lookahead(s.request, k_spec).ok());
      decode_timer_.stop();
      if (!ok) throw std::logic_error("serve: an append that the capacity query accepted failed");
      ++s.generated;
      s.tokens += 1 + k_spec;
      s.computed += 1 + k_spec;
      s.drafts = k_spec;
      ++decode_steps_;
      ++decode_tokens_;
      schedule(k, 1 + k_spec);
      ++k;
    }
    return preempted;
  }

  // --preempt swap: a decoding sequence is settled here (built by the previous step, its copies acknowledged, no
  // lookahead, and this step has not appended to it yet: it is the newest, at or after the one being scheduled), so
  // it can be swapped; one still prefilling has unbuilt prompt slots and is preempted by recompute, as is one the
  // host tier has no room for (preempt returns false).
  void preempt_newest() {
    Seq victim = running_.back();
    running_.pop_back();
    bool swapped = false;
    if (opt_.preempt == pagedkv::PreemptMode::kSwap && !victim.prefilling()) {
      swapped = release_timer_.measure([&] { return manager_.preempt(victim.request, pagedkv::PreemptMode::kSwap); });
    }
    if (swapped) {
      ++swap_preemptions_;
      if (num_groups_ > 1) {  // its host blocks per group ([groups x blocks], 0 = a null entry of a window)
        const auto hb = manager_.swapped_host_blocks(victim.request);
        const std::size_t nb = hb.size() / num_groups_;
        for (std::size_t i = 0; i < hb.size(); ++i) swapped_blocks_[i / nb] += hb[i] != 0 ? 1 : 0;
      }
      victim.swapped = true;  // keeps its positions: resumed as it was
    } else {
      release_timer_.measure([&] { manager_.preempt(victim.request); });
      victim.tokens = victim.computed = victim.prompt = victim.drafts = victim.chunks = 0;
    }
    victim.failed_at = kNever;
    waiting_.push_front(victim);
    ++releases_;
  }

  // Step 3: admissions, each with its first prompt chunk.
  void admit() {
    while (!waiting_.empty() && running_.size() < opt_.max_num_seqs && left_ > 0) {
      Seq& head = waiting_.front();
      // Nothing was released since this request last failed: blocks only went down, so it would fail again
      // (and re-hashing its prompt every step would dominate the library time; an engine caches the verdict).
      // Not with --reserve chunk: the first chunk follows the step's budget, and a build releases the blocks that
      // leave a sliding window, so a refused admission may fit the next step without a release.
      if (opt_.reserve == ReserveKind::kPrompt && head.failed_at == releases_) break;
      if (head.swapped) {  // resume: its blocks come back by swap_in (this step's build issues the copies)
        const auto r = admit_timer_.measure([&] { return manager_.try_resume(head.request); });
        if (!r.admitted()) {
          if (r.status == pagedkv::AdmitStatus::kTransferPending) break;  // not here: copies are acknowledged per step
          if (r.status == pagedkv::AdmitStatus::kNeverFits || running_.empty()) {
            throw std::logic_error("serve: swapped request " + std::to_string(head.request) +
                                   " cannot be resumed into an idle pool");
          }
          head.failed_at = releases_;
          break;
        }
        head.swapped = false;
        ++resumes_;
        running_.push_back(head);  // decodes from the next step on
        waiting_.pop_front();
        continue;
      }
      if (!head.prepared) {  // hashed once per admission attempt series, not once per retry
        synthesize_prompt(trace_, head.request, prompt_);
        for (std::uint32_t g = 0; g < head.generated; ++g) prompt_.push_back(generated_token(head.request, 0, g));
        head.prepared = std::make_shared<pagedkv::PreparedPrompt>(
            admit_timer_.measure([&] { return manager_.prepare_prompt(prompt_); }));
      }
      // --reserve chunk: the first chunk only (the budget left; the manager clamps it to the uncached tokens).
      if (opt_.reserve == ReserveKind::kChunk) admit_options_.num_reserved_tokens = left_;
      const auto r = admit_timer_.measure([&] { return manager_.try_admit(head.request, *head.prepared, admit_options_); });
      if (!r.admitted()) {
        if (r.status == pagedkv::AdmitStatus::kNeverFits || running_.empty()) {
          throw std::logic_error("serve: request " + std::to_string(head.request) +
                                 " cannot be admitted into an idle pool although it passed the arrival check");
        }
        head.failed_at = releases_;
        break;
      }
      head.tokens = head.prompt = head.prepared->tokens.size();
      head.computed = r.num_cached_tokens;
      if (opt_.reserve == ReserveKind::kChunk) head.tokens = head.computed + std::min(left_, head.prompt - head.computed);
      head.prepared.reset();
      ++admissions_;
      running_.push_back(head);
      waiting_.pop_front();
      schedule_prompt_chunk(running_.size() - 1);
    }
  }

  void build_metadata() {
    std::size_t num_indices = 0;
    std::size_t num_new_tokens = 0;
    for (std::size_t b = 0; b < batch_.size(); ++b) {
      num_indices += blocks(manager_.num_built(batch_[b]) + sched_[b]);  // every group: one entry per logical block
      num_new_tokens += sched_[b];
    }
    const auto [swap_out, swap_in] = swap_extents(manager_, opt_, num_groups_ * last_indices_);
    for (std::size_t g = 0; g < num_groups_; ++g) {  // the swap lists are group 0's
      views_[g] = buffers_[g].view(num_indices, num_new_tokens, g == 0 ? swap_out : 0, g == 0 ? swap_in : 0);
    }
    last_indices_ = num_indices;
    decode_timer_.measure([&] {
      manager_.build_batch_metadata(batch_, views_, sched_, sizes_);
      // The engine runs the step (swap_out, swap_in, then the kernels) and acknowledges its copies.
      if (sizes_[0].transfer_token != 0) manager_.complete_transfers(sizes_[0].transfer_token);
    });
  }

  // Step 5: speculative verification. Each draft is accepted with probability spec_accept until the first
  // rejection; the accepted drafts are the request's next tokens (so a re-admission recomputes the same ones).
  void verify_drafts() {
    for (Seq& s : running_) {
      if (s.drafts == 0) continue;
      std::size_t a = 0;
      while (a < s.drafts && unit_(rng_) < opt_.spec_accept) ++a;
      accepted_tokens_.clear();
      for (std::size_t i = 0; i < a; ++i) accepted_tokens_.push_back(generated_token(s.request, 0, s.generated + i));
      decode_timer_.measure([&] { manager_.commit_lookahead(s.request, accepted_tokens_); });
      drafts_ += s.drafts;
      accepted_ += a;
      decode_tokens_ += a;
      s.generated += static_cast<std::uint32_t>(a);
      s.tokens -= s.drafts - a;
      s.computed -= s.drafts - a;
      s.drafts = 0;
    }
  }

  // Slots of held blocks = blocks_used * block_size (a shared block counted once). Without fork, only full blocks
  // are shared, so the empty slots are exactly the unfilled tail of each running sequence's last block. Slots
  // reserved for prompt tokens not yet computed count as holding their token (they are assigned to it).
  // With groups, every group's last block of a sequence has the same empty tail.
  void sample(double step_end_ms) {
    const std::size_t bs = opt_.block_size;
    std::size_t empty_slots = 0, tokens = 0;
    for (const Seq& s : running_) {
      empty_slots += (bs - s.tokens % bs) % bs;
      tokens += s.computed;
    }
    empty_slots *= num_groups_;
    const std::size_t used = manager_.stats().blocks_used;
    const std::size_t slots = used * bs;
    if (opt_.check) check_slots(slots, empty_slots);
    occupancy_.sample(slots == 0 ? 1.0 : 1.0 - static_cast<double>(empty_slots) / static_cast<double>(slots),
                      running_.size(), step_end_ms);
    sum_used_ += static_cast<double>(used);
    sum_tokens_ += static_cast<double>(tokens);
    for (std::size_t g = 0; g < num_groups_; ++g) sum_held_[g] += static_cast<double>(manager_.held_blocks(g));
  }

  // --check: recount held blocks and their filled slots from the block tables, each distinct block once.
  void check_slots(std::size_t slots, std::size_t empty_slots) const {
    const std::size_t bs = opt_.block_size;
    std::unordered_map<std::uint32_t, std::size_t> filled;  // block -> tokens in it
    manager_.for_each_sequence([&](pagedkv::SeqId, std::span<const std::uint32_t> ids, std::size_t tokens) {
      for (std::size_t i = 0; i < ids.size(); ++i) {
        auto& f = filled[ids[i]];
        f = std::max(f, std::min(bs, tokens - i * bs));
      }
    });
    std::size_t tokens = 0;
    for (const auto& [block, f] : filled) tokens += f;
    if (filled.size() * bs != slots || tokens != slots - empty_slots) {
      throw std::logic_error("serve --check: " + std::to_string(filled.size()) + " distinct blocks holding " +
                             std::to_string(tokens) + " tokens, but blocks_used * block_size = " +
                             std::to_string(slots) + " and " + std::to_string(empty_slots) + " empty slots");
    }
  }

  void free_finished() {
    done_ids_.clear();
    const auto finished = [&](const Seq& s) {
      return !s.prefilling() && s.generated >= trace_.requests[s.request].output_tokens;
    };
    for (const Seq& s : running_) {
      if (finished(s)) done_ids_.push_back(s.request);
    }
    if (done_ids_.empty()) return;
    release_timer_.start();
    for (const pagedkv::SeqId id : done_ids_) manager_.free(id);
    release_timer_.stop();
    std::erase_if(running_, finished);
    finished_ += done_ids_.size();
    ++releases_;
  }

  const Trace& trace_;
  const Options& opt_;
  std::size_t usable_blocks_;  // per group
  std::size_t max_model_len_;
  std::size_t num_groups_;
  std::size_t budget_;  // tokens per step
  Manager manager_;
  std::vector<MetadataBuffers> buffers_;               // one per group (the swap lists in group 0's)
  std::vector<pagedkv::BatchMetadataBuffers> views_;   // this step's, per group
  std::vector<pagedkv::BatchMetadataSizes> sizes_;     // the build's, per group
  LibraryTimer admit_timer_;    // try_admit
  LibraryTimer decode_timer_;   // query_append, try_append, try_reserve_lookahead, build_batch_metadata, commits
  LibraryTimer release_timer_;  // free, preempt
  Occupancy occupancy_;
  std::deque<Seq> waiting_;
  std::vector<Seq> running_;  // in admission order (the back is the most recently admitted)
  std::uint64_t releases_ = 0;  // free / preempt events so far
  std::size_t rejected_ = 0;
  std::size_t finished_ = 0;
  std::size_t left_ = 0;        // budget left in this step
  std::uint64_t scheduled_tokens_ = 0;
  std::uint64_t admissions_ = 0, prefills_ = 0, prefill_chunks_ = 0;
  std::size_t max_chunks_ = 0;
  std::uint64_t drafts_ = 0, accepted_ = 0, decode_steps_ = 0, decode_tokens_ = 0;
  std::uint64_t swap_preemptions_ = 0, resumes_ = 0;
  std::size_t last_indices_ = 0;
  double sum_used_ = 0.0, sum_tokens_ = 0.0;  // over busy steps: blocks used, tokens of running sequences
  std::vector<double> sum_held_;              // over busy steps: blocks held per group
  std::vector<std::uint64_t> swapped_blocks_; // device blocks swapped out per group (with several groups)
  pagedkv::AdmitOptions admit_options_;  // block ids of the previous build (bounds write-through's offloads)
  std::mt19937_64 rng_;
  std::uniform_real_distribution<double> unit_{0.0, 1.0};
  // Scratch, reused every step.
  std::vector<pagedkv::TokenId> prompt_;
  std::vector<pagedkv::TokenId> accepted_tokens_;
  std::vector<pagedkv::SeqId> batch_;
  std::vector<std::uint32_t> sched_;
  std::vector<pagedkv::SeqId> done_ids_;
};

/// The contiguous baseline (Orca-style, vLLM paper Fig. 2): every sequence reserves max_model_len slots, so
/// floor(capacity / max_model_len) sequences (at most max_num_seqs) run at once; utilization = tokens held /
/// slots reserved by the running sequences. No preemption is ever needed.
class ContiguousScheduler {
 public:
  ContiguousScheduler(const Trace& trace, std::size_t capacity_tokens, std::size_t max_model_len,
                      std::size_t max_num_seqs)
      : trace_(trace),
        max_model_len_(max_model_len),
        max_running_(std::min(max_num_seqs, capacity_tokens / max_model_len)) {}

  void enqueue(std::size_t request) {
    const Request& r = trace_.requests[request];
    if (max_running_ == 0 || std::size_t{r.input_tokens} + r.output_tokens > max_model_len_) return;
    waiting_.push_back(request);
  }
  [[nodiscard]] bool idle() const noexcept { return waiting_.empty() && running_.empty(); }

  void step(double step_end_ms) {
    for (Seq& s : running_) {
      ++s.tokens;
      ++s.generated;
    }
    while (!waiting_.empty() && running_.size() < max_running_) {
      running_.push_back({waiting_.front(), trace_.requests[waiting_.front()].input_tokens, 0});
      waiting_.pop_front();
    }
    if (running_.empty()) return;
    std::size_t tokens = 0;
    for (const Seq& s : running_) tokens += s.tokens;
    occupancy_.sample(static_cast<double>(tokens) / static_cast<double>(running_.size() * max_model_len_),
                      running_.size(), step_end_ms);
    std::erase_if(running_, [&](const Seq& s) { return s.generated >= trace_.requests[s.request].output_tokens; });
  }

  void add_fields(Row& row) const {
    row.add("contig_max_seqs", max_running_)
        .add("contig_kv_utilization", occupancy_.mean_utilization(), 4)
        .add("contig_peak_running", occupancy_.peak_running)
        .add("contig_sim_seconds", occupancy_.last_busy_end_ms / 1000.0, 1);
  }

 private:
  struct Seq {
    std::size_t request;
    std::size_t tokens;
    std::uint32_t generated;
  };
  const Trace& trace_;
  std::size_t max_model_len_;
  std::size_t max_running_;
  Occupancy occupancy_;
  std::deque<std::size_t> waiting_;
  std::vector<Seq> running_;
};

template <class Manager>
Row run_serve_with(const Trace& trace, const Options& opt) {
  const double capacity = opt.capacity_tokens.front();
  const std::size_t usable = usable_blocks_for(capacity, opt.block_size);
  const std::size_t max_model_len = opt.max_model_len != 0 ? opt.max_model_len : trace.max_total_tokens();
  PagedScheduler<Manager> paged(trace, opt, usable, max_model_len);
  ContiguousScheduler contig(trace, static_cast<std::size_t>(capacity), max_model_len, opt.max_num_seqs);
  EventPublishing events(opt.publish_events, opt.publish_wait_ms);
  events.attach(paged.manager());

  Progress progress("serve " + trace_name(trace), trace.requests.size(), opt.progress);
  const auto& requests = trace.requests;
  std::size_t next = 0;   // next request to arrive
  std::uint64_t step = 0; // the current step spans [step, step + 1) * step_ms
  while (next < requests.size() || !paged.idle() || !contig.idle()) {
    if (paged.idle() && contig.idle()) {  // skip idle time: jump to the step of the next arrival
      step = std::max(step, static_cast<std::uint64_t>(std::ceil(requests[next].arrival_ms / opt.step_ms)));
    }
    const double start_ms = static_cast<double>(step) * opt.step_ms;
    for (; next < requests.size() && requests[next].arrival_ms <= start_ms; ++next) {
      paged.enqueue(next);
      contig.enqueue(next);
    }
    ++step;
    paged.step(static_cast<double>(step) * opt.step_ms);
    events.step(paged.manager(), static_cast<double>(step) * opt.step_ms / 1000.0);
    contig.step(static_cast<double>(step) * opt.step_ms);
    progress.update(paged.done());
  }
  progress.finish();
  events.finish();

  Row row;
  row.add("trace", trace_name(trace))
      .add("mode", "serve")
      .add("hash", to_string(opt.hash))
      .add("block_size", opt.block_size)
      .add("capacity_tokens", static_cast<std::int64_t>(capacity))
      .add("pool_blocks", usable)
      .add("max_num_seqs", opt.max_num_seqs)
      .add("max_model_len", max_model_len)
      .add("step_ms", opt.step_ms, 1)
      .add("requests", requests.size());
  paged.add_fields(row);
  contig.add_fields(row);
  add_cost_fields(row, paged.manager_seconds(), paged.block_ops());
  const auto per_seq_step = [&](double seconds) {
    return paged.seq_steps() == 0 ? 0.0 : seconds * 1e9 / static_cast<double>(paged.seq_steps());
  };
  row.add("ns_per_scheduled_token", paged.scheduled_tokens() == 0 ? 0.0
                                                                 : paged.manager_seconds() * 1e9 /
                                                                       static_cast<double>(paged.scheduled_tokens()),
          1)
      .add("ns_per_seq_step", per_seq_step(paged.manager_seconds()), 1)
      .add("admit_seconds", paged.admit_seconds(), 3)
      .add("decode_ns_per_seq_step", per_seq_step(paged.decode_seconds()), 1);
  return row;
}

/// run_serve_groups for one manager type: the paged scheduler alone (no contiguous baseline), published when
/// `labels.publish`.
template <class Manager>
Row run_serve_groups_with(const Trace& trace, const Options& all, const GroupRunLabels& labels) {
  Options opt = all;  // (the scheduler keeps a reference: it lives as long as this copy)
  if (!labels.publish) opt.publish_events.clear();  // records no events that nobody takes
  const double capacity = opt.capacity_tokens.front();
  const std::size_t per_group = usable_blocks_for(capacity, opt.block_size);
  const std::size_t max_model_len = opt.max_model_len != 0 ? opt.max_model_len : trace.max_total_tokens();
  PagedScheduler<Manager> paged(trace, opt, per_group, max_model_len);
  EventPublishing events(labels.publish ? opt.publish_events : std::string(), opt.publish_wait_ms, opt.groups);
  events.attach(paged.manager());
  const auto& requests = trace.requests;
  std::size_t next = 0;
  std::uint64_t step = 0;
  while (next < requests.size() || !paged.idle()) {
    if (paged.idle()) step = std::max(step, static_cast<std::uint64_t>(std::ceil(requests[next].arrival_ms / opt.step_ms)));
    const double start_ms = static_cast<double>(step) * opt.step_ms;
    for (; next < requests.size() && requests[next].arrival_ms <= start_ms; ++next) paged.enqueue(next);
    ++step;
    paged.step(static_cast<double>(step) * opt.step_ms);
    events.step(paged.manager(), static_cast<double>(step) * opt.step_ms / 1000.0);
  }
  events.finish();

  const std::size_t groups = std::max<std::size_t>(opt.groups.size(), 1);
  Row row;
  row.add("trace", trace_name(trace))
      .add("mode", "hybrid-serve")
      .add("manager", labels.manager)
      .add("groups", labels.groups)
      .add("block_size", opt.block_size)
      .add("capacity_tokens", static_cast<std::int64_t>(capacity))
      .add("pool_blocks", per_group * groups)
      .add("requests", requests.size());
  paged.add_group_fields(row, labels.group_kinds);
  if (events.enabled_at_start()) events.add_fields(row, labels.group_kinds);
  row.add("manager_seconds", paged.manager_seconds(), 3);
  return row;
}

}  // namespace

Row run_serve(const Trace& trace, const Options& opt) {
  return with_manager(opt, [&]<class M>(std::type_identity<M>) { return run_serve_with<M>(trace, opt); });
}

Row run_serve_groups(const Trace& trace, const Options& opt, const GroupRunLabels& labels) {
  return with_manager(opt, [&]<class M>(std::type_identity<M>) { return run_serve_groups_with<M>(trace, opt, labels); });
}

}  // namespace replay
