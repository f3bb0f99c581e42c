// pagedkv/transfer_inproc.hpp: an in-process implementation of the transfer interface (pagedkv/transfer.hpp) with
// deterministic fault injection (drop, delay, duplicate, reorder, fail chosen blocks, kill a peer), for the
// model-based tests and fuzzers of prefill/decode disaggregation. Agents of one fabric live in one process and
// move bytes with memcpy; time is a tick counter the test advances, so every run is a function of the seed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pagedkv/error.hpp>
#include <pagedkv/transfer.hpp>

namespace pagedkv::transfer {

/// One block that always fails when a request moves it: agent `agent`'s block `block` of pool `pool` (as the
/// source or the destination).
struct FaultBlock {
  std::string agent;
  PoolId pool = 0;
  BlockId block = 0;
};

/// The faults an InProcFabric injects. Probabilities are in [0, 1]; every draw comes from one generator seeded
/// with `seed`, in the order the fabric makes them, so a run is reproducible from (seed, the calls made).
struct FaultPlan {
  std::uint64_t seed = 0;
  /// A request completes `min_latency_ticks + U[0, max_extra_delay_ticks]` ticks after its submit (delay); so
  /// does a notification after its send. Different delays reorder completions and notifications.
  std::uint32_t min_latency_ticks = 1;
  std::uint32_t max_extra_delay_ticks = 0;
  /// Events due in the same tick happen in a shuffled order instead of submission order (reorder).
  bool shuffle_same_tick = false;
  double p_drop_request = 0.0;            ///< The request is lost: it ends kFailed / kTimedOut after timeout_ticks.
  std::uint32_t timeout_ticks = 32;       ///< Ticks after submit at which a lost request times out.
  double p_fail_block = 0.0;              ///< Each block of a request fails on its own: kFailed / kBlocksFailed.
  std::vector<FaultBlock> fail_blocks;    ///< Blocks that always fail (fail chosen blocks).
  double p_drop_notification = 0.0;       ///< A notification is lost (drop).
  double p_duplicate_notification = 0.0;  ///< A notification is delivered twice (duplicate), each with its delay.
};

/// What a fabric counted. Every submitted request is counted exactly once in done + failed_* when it ends.
struct FabricCounters {
  std::uint64_t submitted = 0;
  std::uint64_t done = 0;
  std::uint64_t failed_backend = 0, failed_blocks = 0, failed_peer_dead = 0, failed_invalidated = 0,
                failed_timed_out = 0;
  std::uint64_t blocks_moved = 0;           ///< Blocks whose bytes were copied (done requests and partial failures).
  std::uint64_t bytes_moved = 0;
  std::uint64_t notifications_sent = 0;     ///< Notifications handed to the fabric (transfers' and standalone).
  std::uint64_t notifications_delivered = 0;
  std::uint64_t notifications_dropped = 0;  ///< Lost by the plan.
  std::uint64_t notifications_duplicated = 0;
  std::uint64_t notifications_to_dead = 0;  ///< Addressed to a killed agent (never delivered).
  std::uint64_t unknown_invalidations = 0;  ///< invalidate_remote of a peer that was not loaded.
};

/// A request's end as the fabric logged it (for tests: every request id appears exactly once).
struct CompletionRecord {
  std::string agent;  ///< The initiator.
  RequestId id = 0;
  RequestState state;
  std::uint64_t tick = 0;
};

class InProcFabric;

/// An agent of an InProcFabric. Created by InProcFabric::make_agent; lives as long as its fabric. Supports DRAM
/// pools only (it copies with memcpy). See TransferAgent for the contract of each call.
class InProcAgent final : public TransferAgent {
 public:
  [[nodiscard]] const std::string& name() const noexcept override { return name_; }

  PoolId register_pool(const PoolDesc& pool) override {
    validate_pool(pool);
    if (pool.kind != MemoryKind::kDram)
      pagedkv::detail::raise(Errc::kInvalidArgument, "transfer pool: the in-process transport supports kDram only");
    pools_.push_back(pool);
    return static_cast<PoolId>(pools_.size() - 1);
  }

  [[nodiscard]] std::span<const PoolDesc> pools() const noexcept override { return pools_; }

  [[nodiscard]] std::vector<std::byte> export_metadata() const override {
    detail::AgentMetadata md;
    md.impl = "inproc";
    md.name = name_;
    md.pools = pools_;
    return md.encode();
  }

  std::string load_remote(std::span<const std::byte> metadata) override;

  bool invalidate_remote(std::string_view agent) override;

  [[nodiscard]] std::span<const PoolDesc> remote_pools(std::string_view agent) const override {
    auto it = remotes_.find(agent);
    if (it == remotes_.end()) return {};
    return it->second;
  }

  RequestId submit(const TransferDesc& desc) override;

  RequestState poll(RequestId id) override { return find(id, "poll").state; }

  void release(RequestId id) override {
    const Entry& e = find(id, "release");
    if (e.state.status == TransferStatus::kInProgress)
      pagedkv::detail::raise(Errc::kInvalidArgument,
                             "transfer release: request " + std::to_string(id) + " is still in progress");
    requests_.erase(id);
  }

  bool notify(std::string_view agent, std::string_view message) override;

  std::vector<Notification> take_notifications() override { return std::exchange(inbox_, {}); }

  /// Indices into the request's block lists that failed (fault injection), in increasing order; empty unless the
  /// request ended kBlocksFailed. Throws like poll.
  [[nodiscard]] const std::vector<std::size_t>& failed_blocks(RequestId id) const {
    auto it = requests_.find(id);
    if (it == requests_.end())
      pagedkv::detail::raise(Errc::kInvalidArgument, "transfer failed_blocks: request " + std::to_string(id) +
                                                         " unknown or already released");
    return it->second.failed;
  }
  /// Requests submitted and not yet released.
  [[nodiscard]] std::size_t num_requests() const noexcept { return requests_.size(); }
  /// False once the fabric killed this agent.
  [[nodiscard]] bool alive() const noexcept { return alive_; }

 private:
  friend class InProcFabric;
  struct Entry {
    RequestState state;
    std::vector<std::size_t> failed;
    std::string peer;
  };
  InProcAgent(InProcFabric& fabric, std::string name) : fabric_(&fabric), name_(std::move(name)) {}

  Entry& find(RequestId id, const char* what) {
    auto it = requests_.find(id);
    if (it == requests_.end())
      pagedkv::detail::raise(Errc::kInvalidArgument, std::string("transfer ") + what + ": request " +
                                                         std::to_string(id) + " unknown or already released");
    return it->second;
  }

  InProcFabric* fabric_;
  std::string name_;
  bool alive_ = true;
  std::vector<PoolDesc> pools_;
  std::map<std::string, std::vector<PoolDesc>, std::less<>> remotes_;
  std::map<RequestId, Entry> requests_;
  RequestId next_id_ = 1;
  std::vector<Notification> inbox_;
};

/// The in-process network: owns its agents, holds the requests and notifications in flight, and injects the
/// faults of its FaultPlan. Nothing moves until `tick`: a request submitted at tick t is done (bytes copied,
/// notification sent) at tick t + latency. Thread safety: none (one thread drives the fabric and all its agents).
class InProcFabric {
 public:
  /// Throws kInvalidArgument for a probability outside [0, 1].
  explicit InProcFabric(FaultPlan plan = {}) : plan_(std::move(plan)), rng_(plan_.seed) {
    for (double p : {plan_.p_drop_request, plan_.p_fail_block, plan_.p_drop_notification,
                     plan_.p_duplicate_notification})
      if (!(p >= 0.0 && p <= 1.0))
        pagedkv::detail::raise(Errc::kInvalidArgument, "fault plan: probability " + std::to_string(p) +
                                                           " outside [0, 1]");
  }
  InProcFabric(const InProcFabric&) = delete;
  InProcFabric& operator=(const InProcFabric&) = delete;

  /// A new agent named `name`. Throws kInvalidArgument when the name is empty or taken.
  InProcAgent& make_agent(std::string name) {
    if (name.empty() || agents_.count(name))
      pagedkv::detail::raise(Errc::kInvalidArgument, "inproc fabric: agent name '" + name + "' empty or taken");
    auto a = std::unique_ptr<InProcAgent>(new InProcAgent(*this, name));
    InProcAgent& ref = *a;
    agents_.emplace(std::move(name), std::move(a));
    return ref;
  }

  /// Kill an agent (a crashed process): every request in flight that it initiated or targets ends kFailed /
  /// kPeerDead now, notifications to it are never delivered, and later requests involving it fail at submit.
  /// Its memory is never touched again. Throws kInvalidArgument for an unknown name.
  void kill(std::string_view agent) {
    InProcAgent& a = agent_named(agent, "kill");
    a.alive_ = false;
    for (std::size_t i = 0; i < flights_.size();) {
      Flight& f = flights_[i];
      if (f.initiator == &a || f.target == &a) {
        finish(f, {TransferStatus::kFailed, FailReason::kPeerDead});
        flights_.erase(flights_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
  }

  /// Advance time by `n` ticks; at each tick the requests and notifications due complete (in submission order,
  /// or shuffled with shuffle_same_tick).
  void tick(std::uint32_t n = 1) {
    for (std::uint32_t k = 0; k < n; ++k) {
      ++now_;
      std::vector<std::size_t> due;
      for (std::size_t i = 0; i < flights_.size(); ++i)
        if (flights_[i].due <= now_) due.push_back(i);
      if (plan_.shuffle_same_tick) std::shuffle(due.begin(), due.end(), rng_);
      for (std::size_t i : due) complete(flights_[i]);
      std::erase_if(flights_, [this](const Flight& f) { return f.due <= now_; });
      std::vector<std::size_t> ndue;
      for (std::size_t i = 0; i < notes_.size(); ++i)
        if (notes_[i].due <= now_) ndue.push_back(i);
      if (plan_.shuffle_same_tick) std::shuffle(ndue.begin(), ndue.end(), rng_);
      for (std::size_t i : ndue) {
        Note& n2 = notes_[i];
        InProcAgent* to = find_agent(n2.to);
        if (to == nullptr || !to->alive_) {
          ++counters_.notifications_to_dead;
        } else {
          to->inbox_.push_back({n2.from, n2.message});
          ++counters_.notifications_delivered;
        }
      }
      std::erase_if(notes_, [this](const Note& n2) { return n2.due <= now_; });
    }
  }

  /// Tick until nothing is in flight (requests and notifications); returns the ticks advanced. Bounded: requests
  /// end by their timeout and notifications by their delay.
  std::uint64_t drain() {
    const std::uint64_t start = now_;
    while (!quiescent()) tick();
    return now_ - start;
  }

  /// True when no request and no notification is in flight.
  [[nodiscard]] bool quiescent() const noexcept { return flights_.empty() && notes_.empty(); }
  [[nodiscard]] std::uint64_t now() const noexcept { return now_; }
  [[nodiscard]] const FabricCounters& counters() const noexcept { return counters_; }
  [[nodiscard]] std::span<const CompletionRecord> completions() const noexcept { return log_; }
  [[nodiscard]] const FaultPlan& plan() const noexcept { return plan_; }

 private:
  friend class InProcAgent;
  struct Copy {
    std::byte* dst;
    const std::byte* src;
    std::size_t bytes;
    std::size_t block_index;  // index into the request's block lists
  };
  struct Flight {
    InProcAgent* initiator;
    InProcAgent* target;
    RequestId id;
    std::vector<Copy> copies;
    std::vector<std::size_t> failed;  // block indices that fail
    bool lost;
    std::uint64_t due;
    std::string notification;
    bool has_notification;
  };
  struct Note {
    std::string from, to, message;
    std::uint64_t due;
  };

  double draw() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return p > 0.0 && draw() < p; }
  std::uint64_t latency() {
    std::uint64_t extra = 0;
    if (plan_.max_extra_delay_ticks > 0) extra = rng_() % (std::uint64_t{plan_.max_extra_delay_ticks} + 1);
    return plan_.min_latency_ticks + extra;
  }

  InProcAgent* find_agent(std::string_view name) {
    auto it = agents_.find(name);
    return it == agents_.end() ? nullptr : it->second.get();
  }
  InProcAgent& agent_named(std::string_view name, const char* what) {
    InProcAgent* a = find_agent(name);
    if (a == nullptr)
      pagedkv::detail::raise(Errc::kInvalidArgument, std::string("inproc fabric ") + what + ": no agent named '" +
                                                         std::string(name) + "'");
    return *a;
  }

  void finish(const Flight& f, RequestState st) {
    auto it = f.initiator->requests_.find(f.id);
    // The entry exists: a request cannot be released while in progress.
    it->second.state = st;
    if (st.reason == FailReason::kBlocksFailed) it->second.failed = f.failed;
    log_.push_back({f.initiator->name_, f.id, st, now_});
    switch (st.reason) {
      case FailReason::kNone: ++counters_.done; break;
      case FailReason::kBackend: ++counters_.failed_backend; break;
      case FailReason::kBlocksFailed: ++counters_.failed_blocks; break;
      case FailReason::kPeerDead: ++counters_.failed_peer_dead; break;
      case FailReason::kPeerInvalidated: ++counters_.failed_invalidated; break;
      case FailReason::kTimedOut: ++counters_.failed_timed_out; break;
    }
  }

  void complete(Flight& f) {
    if (f.lost) {
      finish(f, {TransferStatus::kFailed, FailReason::kTimedOut});
      return;
    }
    std::size_t fi = 0;
    std::size_t last_block = static_cast<std::size_t>(-1);
    for (const Copy& c : f.copies) {
      while (fi < f.failed.size() && f.failed[fi] < c.block_index) ++fi;
      if (fi < f.failed.size() && f.failed[fi] == c.block_index) continue;
      std::memmove(c.dst, c.src, c.bytes);
      counters_.bytes_moved += c.bytes;
      if (c.block_index != last_block) {
        ++counters_.blocks_moved;
        last_block = c.block_index;
      }
    }
    if (!f.failed.empty()) {
      finish(f, {TransferStatus::kFailed, FailReason::kBlocksFailed});
      return;
    }
    finish(f, {TransferStatus::kDone, FailReason::kNone});
    if (f.has_notification) send_note(f.initiator->name_, f.target->name_, std::move(f.notification));
  }

  void send_note(const std::string& from, const std::string& to, std::string message) {
    ++counters_.notifications_sent;
    if (chance(plan_.p_drop_notification)) {
      ++counters_.notifications_dropped;
      return;
    }
    if (chance(plan_.p_duplicate_notification)) {
      ++counters_.notifications_duplicated;
      notes_.push_back({from, to, message, now_ + latency()});
    }
    notes_.push_back({from, to, std::move(message), now_ + latency()});
  }

  bool is_fault_block(const std::string& agent, PoolId pool, BlockId block) const {
    for (const FaultBlock& b : plan_.fail_blocks)
      if (b.pool == pool && b.block == block && b.agent == agent) return true;
    return false;
  }

  FaultPlan plan_;
  std::mt19937_64 rng_;
  std::uint64_t now_ = 0;
  std::map<std::string, std::unique_ptr<InProcAgent>, std::less<>> agents_;
  std::vector<Flight> flights_;
  std::vector<Note> notes_;
  FabricCounters counters_;
  std::vector<CompletionRecord> log_;
};

inline std::string InProcAgent::load_remote(std::span<const std::byte> metadata) {
  detail::AgentMetadata md = detail::AgentMetadata::decode(metadata);
  if (md.impl != "inproc")
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer load_remote: metadata of a '" + md.impl +
                                                       "' agent, this is the in-process transport");
  if (md.name == name_)
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer load_remote: '" + md.name + "' is this agent itself");
  fabric_->agent_named(md.name, "load_remote");  // must be an agent of this fabric
  if (remotes_.count(md.name)) invalidate_remote(md.name);  // a restarted peer: its old requests end now
  remotes_.emplace(md.name, std::move(md.pools));
  return md.name;
}

inline bool InProcAgent::invalidate_remote(std::string_view agent) {
  auto it = remotes_.find(agent);
  if (it == remotes_.end()) {
    ++fabric_->counters_.unknown_invalidations;
    return false;
  }
  auto& flights = fabric_->flights_;
  for (std::size_t i = 0; i < flights.size();) {
    if (flights[i].initiator == this && flights[i].target->name_ == agent) {
      fabric_->finish(flights[i], {TransferStatus::kFailed, FailReason::kPeerInvalidated});
      flights.erase(flights.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      ++i;
    }
  }
  remotes_.erase(it);
  return true;
}

inline RequestId InProcAgent::submit(const TransferDesc& desc) {
  auto rit = remotes_.find(desc.remote_agent);
  if (rit == remotes_.end())
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer submit: remote agent '" +
                                                       std::string(desc.remote_agent) + "' is not loaded");
  detail::validate_transfer(desc, pools_, rit->second);
  InProcFabric& fab = *fabric_;
  InProcAgent& target = fab.agent_named(desc.remote_agent, "submit");
  const RequestId id = next_id_++;
  requests_.emplace(id, Entry{{}, {}, std::string(desc.remote_agent)});
  ++fab.counters_.submitted;
  InProcFabric::Flight f{this, &target, id, {}, {}, false, 0, std::string(desc.notification),
                         !desc.notification.empty()};
  if (!alive_ || !target.alive_) {
    fab.finish(f, {TransferStatus::kFailed, FailReason::kPeerDead});
    return id;
  }
  const PoolDesc& lp = pools_[desc.local_pool];
  const PoolDesc& rp = rit->second[desc.remote_pool];
  const bool read = desc.op == TransferOp::kRead;
  f.copies.reserve(lp.regions.size() * desc.local_blocks.size());
  for (std::size_t i = 0; i < desc.local_blocks.size(); ++i) {
    const BlockId lb = desc.local_blocks[i], rb = desc.remote_blocks[i];
    if (fab.is_fault_block(name_, desc.local_pool, lb) || fab.is_fault_block(target.name_, desc.remote_pool, rb) ||
        fab.chance(fab.plan_.p_fail_block))
      f.failed.push_back(i);
    for (std::size_t r = 0; r < lp.regions.size(); ++r) {
      auto* l = reinterpret_cast<std::byte*>(lp.regions[r].base_addr + lb * lp.regions[r].stride_bytes);
      auto* m = reinterpret_cast<std::byte*>(rp.regions[r].base_addr + rb * rp.regions[r].stride_bytes);
      f.copies.push_back({read ? l : m, read ? m : l, lp.regions[r].block_bytes, i});
    }
  }
  // Copies are block-major (block i in every region); the order does not change the bytes as long as the lists
  // name distinct blocks (aliasing destinations are a caller bug with any transport).
  f.lost = fab.chance(fab.plan_.p_drop_request);
  f.due = fab.now_ + (f.lost ? std::max<std::uint64_t>(fab.plan_.timeout_ticks, 1) : fab.latency());
  fab.flights_.push_back(std::move(f));
  return id;
}

inline bool InProcAgent::notify(std::string_view agent, std::string_view message) {
  if (!remotes_.count(agent))
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer notify: remote agent '" + std::string(agent) +
                                                       "' is not loaded");
  InProcAgent& target = fabric_->agent_named(agent, "notify");
  if (!alive_ || !target.alive_) return false;
  fabric_->send_note(name_, target.name_, std::string(message));
  return true;
}

}  // namespace pagedkv::transfer
