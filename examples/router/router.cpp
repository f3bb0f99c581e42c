// examples/router/router.cpp: one fleet run: spawn the engines, follow their KV event streams into a FleetIndex,
// route the trace's requests, shut everything down within bounds.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <pagedkv/events_zmq/subscriber.hpp>
#include <pagedkv/events_zmq/wire.hpp>
#include <pagedkv/block_identity.hpp>

#include "fleet.hpp"
#include "fleet_index.hpp"
#include "protocol.hpp"

namespace router {

const char* to_string(Policy p) noexcept {
  switch (p) {
    case Policy::kCacheAware: return "kv-aware";
    case Policy::kCacheAwareUnbounded: return "kv-unbounded";
    case Policy::kRoundRobin: return "round-robin";
    case Policy::kIdeal: return "ideal";
  }
  return "?";
}

namespace {

namespace ev = pagedkv::events;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

milliseconds ms_of(double seconds) { return milliseconds(static_cast<std::int64_t>(seconds * 1000)); }

/// The engine processes of one run (fork + exec of this binary). Every path reaps them: `reap` waits a bounded
/// time for clean exits; the destructor kills (SIGKILL) and reaps whatever is left.
class Children {
 public:
  Children() = default;
  Children(const Children&) = delete;
  Children& operator=(const Children&) = delete;
  ~Children() {
    for (const pid_t pid : live_) {
      ::kill(pid, SIGKILL);
      int status = 0;
      (void)::waitpid(pid, &status, 0);  // SIGKILL cannot be caught: returns promptly
    }
  }

  void spawn(const std::string& exe, const std::vector<std::string>& args) {
    std::vector<std::string> all{exe};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;  // built before fork: the child only calls async-signal-safe functions
    for (std::string& s : all) argv.push_back(s.data());
    argv.push_back(nullptr);
    const pid_t parent = ::getpid();
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed while starting an engine");
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the engine dies with the router, whatever happens to it
      if (::getppid() != parent) ::_exit(127);
      ::execv(exe.c_str(), argv.data());
      ::_exit(127);
    }
    live_.push_back(pid);
  }

  /// Wait up to `timeout_s` for every child to exit; true when all exited with status 0.
  bool reap(double timeout_s) {
    const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
    bool all_ok = true;
    while (!live_.empty() && Clock::now() < deadline) {
      for (auto it = live_.begin(); it != live_.end();) {
        int status = 0;
        const pid_t r = ::waitpid(*it, &status, WNOHANG);
        if (r == *it) {
          all_ok = all_ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
          it = live_.erase(it);
        } else {
          ++it;
        }
      }
      if (!live_.empty()) std::this_thread::sleep_for(milliseconds(5));
    }
    return all_ok && live_.empty();
  }

 private:
  std::vector<pid_t> live_;
};

/// Prefill tokens routed to an instance within a sliding window of simulated time.
class RecentLoad {
 public:
  explicit RecentLoad(double window_s) : window_s_(window_s) {}
  void add(double t, double tokens) {
    items_.emplace_back(t, tokens);
    sum_ += tokens;
  }
  double at(double now) {
    while (!items_.empty() && items_.front().first < now - window_s_) {
      sum_ -= items_.front().second;
      items_.pop_front();
    }
    return sum_;
  }

 private:
  double window_s_;
  double sum_ = 0;
  std::deque<std::pair<double, double>> items_;
};

}  // namespace

FleetResult run_fleet(const replay::Trace& trace, const FleetConfig& cfg) {
  const auto wall0 = Clock::now();
  const std::size_t n = cfg.policy == Policy::kIdeal ? 1 : cfg.instances;
  const double pool_tokens = cfg.policy == Policy::kIdeal ? cfg.capacity_tokens * static_cast<double>(cfg.instances)
                                                          : cfg.capacity_tokens;
  if (n == 0 || n > 64) throw std::runtime_error("--instances must be in 1..64, got " + std::to_string(n));
  const std::uint32_t bs = cfg.block_size;
  std::size_t max_prompt = 1;
  for (const replay::Request& r : trace.requests) max_prompt = std::max<std::size_t>(max_prompt, r.input_tokens);
  const milliseconds timeout = ms_of(cfg.timeout_s);

  FleetResult res;
  res.instances = n;
  res.pool_tokens = pool_tokens;

  zmq::context_t ctx(1);
  zmq::socket_t control(ctx, zmq::socket_type::router);
  control.set(zmq::sockopt::linger, 0);
  control.set(zmq::sockopt::router_mandatory, 1);  // sending to an engine that is not connected is an error
  control.bind("tcp://127.0.0.1:*");
  const std::string control_ep = control.get(zmq::sockopt::last_endpoint);

  Children children;
  for (std::size_t i = 0; i < n; ++i) {
    children.spawn(cfg.exe, {"--engine", "--control", control_ep, "--instance", std::to_string(i),
                             "--capacity-tokens", std::to_string(pool_tokens), "--block-size", std::to_string(bs),
                             "--hash-seed", std::to_string(cfg.hash_seed), "--max-prompt-tokens",
                             std::to_string(max_prompt), "--layout", ev::to_string(cfg.layout), "--hashes",
                             ev::to_string(cfg.hashes), "--idle-timeout-s", std::to_string(2 * cfg.timeout_s)});
  }

  // Receive one control message within `deadline`; returns its frames (identity first) or throws naming `what`.
  const auto receive = [&](Clock::time_point deadline, const std::string& what) {
    for (;;) {
      const auto now = Clock::now();
      if (now >= deadline) throw std::runtime_error("router: timed out waiting for " + what);
      zmq::pollitem_t item{control.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::min(milliseconds(100), std::chrono::ceil<milliseconds>(deadline - now)));
      if ((item.revents & ZMQ_POLLIN) == 0) continue;
      std::vector<zmq::message_t> msg;
      if (zmq::recv_multipart(control, std::back_inserter(msg), zmq::recv_flags::dontwait) && msg.size() >= 2) {
        return msg;
      }
    }
  };

  // Hello from every engine: where its event stream and replay socket are.
  std::vector<std::string> pub_ep(n), replay_ep(n);
  {
    const auto deadline = Clock::now() + timeout;
    std::size_t seen = 0;
    while (seen < n) {
      const auto msg = receive(deadline, std::to_string(n - seen) + " engine(s) to start");
      if (kind_of(msg[1]) != static_cast<char>(Msg::kHello) || msg.size() != 5) continue;
      const Hello h = unframe<Hello>(msg[2], "hello");
      if (h.instance >= n || msg[0].to_string() != engine_id(h.instance) || !pub_ep[h.instance].empty()) continue;
      pub_ep[h.instance] = msg[3].to_string();
      replay_ep[h.instance] = msg[4].to_string();
      ++seen;
    }
  }

  // Follow every engine's stream; the index learns the fleet's caches from the events alone.
  FleetIndex index(n);
  DynamoKeys dynamo(n);  // the index is keyed by Dynamo's sequence hashes, recomputed from the events' tokens
  std::vector<std::unique_ptr<ev::ZmqSubscriber>> subs;
  std::vector<std::unique_ptr<ev::EventStreamFollower>> followers;
  for (std::size_t i = 0; i < n; ++i) {
    subs.push_back(std::make_unique<ev::ZmqSubscriber>(ev::SubscriberOptions{pub_ep[i], replay_ep[i], std::string(ev::kLlmdTopicPrefix), 1000000}));
    ev::FollowerOptions fo;
    fo.start_synced_at_zero = true;  // we started the engine: its stream starts empty at 0
    fo.reply_timeout = timeout;
    followers.push_back(std::make_unique<ev::EventStreamFollower>(
        *subs.back(), fo, [&res, &index, &dynamo, i](std::uint64_t, const ev::WireBatch& b, bool) {
          ++res.event_batches;
          std::vector<std::uint64_t> keys;
          for (const ev::WireEvent& w : b.events) {
            if (std::holds_alternative<ev::WireAllBlocksCleared>(w)) {
              index.cleared(i);
              dynamo.cleared(i);
            } else if (const auto* s = std::get_if<ev::WireBlockStored>(&w)) {
              if (s->medium && *s->medium != "GPU") continue;  // the device tier is what prefill can reuse
              if (!dynamo.stored(i, *s, keys)) {
                ++res.dropped_stores;  // parent unknown: Dynamo drops such an event
                continue;
              }
              for (const std::uint64_t k : keys) index.stored(i, k);
              res.stored_blocks += s->block_hashes.size();
            } else if (const auto* r = std::get_if<ev::WireBlockRemoved>(&w)) {
              if (r->medium && *r->medium != "GPU") continue;
              for (const ev::WireHash& h : r->block_hashes) {
                const auto k = dynamo.removed(i, h.key);
                res.unknown_removals += k && index.removed(i, *k) ? 0 : 1;
              }
              res.removed_blocks += r->block_hashes.size();
            }
          }
          index.note_peak();
        }));
  }

  std::vector<RecentLoad> load(n, RecentLoad(cfg.load_window_s));
  std::vector<double> loads(n);
  std::vector<std::uint64_t> prompt_tokens_of(n, 0);
  std::vector<std::size_t> prefix(n);
  std::vector<std::uint64_t> keys;
  std::vector<pagedkv::TokenId> prompt;
  double hash_s = 0, match_s = 0, events_s = 0;
  std::vector<std::uint32_t> tokens;
  const std::size_t total = trace.requests.size();
  for (std::size_t r = 0; r < total; ++r) {
    replay::synthesize_prompt(trace, r, prompt);
    const double arrival_s = trace.requests[r].arrival_ms / 1000.0;

    // The prompt's Dynamo sequence hashes (the keys the index learned from the events; base model, no salt), up
    // to the admission cap: at least one token is computed, so at most floor((len - 1) / block_size) blocks hit.
    const double c0 = thread_cpu_seconds();
    const std::size_t nblocks = prompt.empty() ? 0 : (prompt.size() - 1) / bs;
    tokens.assign(prompt.begin(), prompt.begin() + static_cast<std::ptrdiff_t>(nblocks * bs));
    keys = pagedkv::identity::dynamo_request_hashes(tokens, bs, pagedkv::identity::kDynamoXxh3Seed).sequence_hashes;
    const double c1 = thread_cpu_seconds();
    index.match(keys, prefix);
    std::size_t e = 0;
    switch (cfg.policy) {
      case Policy::kIdeal: e = 0; break;
      case Policy::kRoundRobin: e = r % n; break;
      case Policy::kCacheAware:
      case Policy::kCacheAwareUnbounded: {
        double mean = 0;
        for (std::size_t i = 0; i < n; ++i) mean += loads[i] = load[i].at(arrival_s);
        mean /= static_cast<double>(n);
        const double bound = (1 + cfg.load_slack) * mean + static_cast<double>(prompt.size());
        std::size_t best = n;
        for (std::size_t i = 0; i < n; ++i) {
          if (cfg.policy == Policy::kCacheAware && loads[i] > bound) continue;
          if (best == n || prefix[i] > prefix[best] || (prefix[i] == prefix[best] && loads[i] < loads[best])) best = i;
        }
        e = best;  // the least loaded instance is always within the bound
        break;
      }
    }
    const double c2 = thread_cpu_seconds();

    Request req;
    req.id = r;
    req.arrival_s = arrival_s;
    req.num_tokens = static_cast<std::uint32_t>(prompt.size());
    std::vector<zmq::message_t> out;
    out.emplace_back(engine_id(e));
    out.push_back(kind(Msg::kRequest));
    out.push_back(frame(req));
    out.emplace_back(prompt.data(), prompt.size() * sizeof(pagedkv::TokenId));
    zmq::send_multipart(control, out);
    const auto msg = receive(Clock::now() + timeout, engine_id(e) + "'s answer to request " + std::to_string(r));
    if (msg.size() != 3 || msg[0].to_string() != engine_id(e) || kind_of(msg[1]) != static_cast<char>(Msg::kDone)) {
      throw std::runtime_error("router: unexpected control message while waiting for " + engine_id(e));
    }
    const Done done = unframe<Done>(msg[2], "done");

    // Take in the engine's events of this step before routing the next request (lockstep: the index is exact).
    const double c3 = thread_cpu_seconds();
    if (!followers[e]->catch_up(done.last_seq, timeout)) {
      throw std::runtime_error("router: " + engine_id(e) + "'s event stream did not reach batch " +
                               std::to_string(done.last_seq) + " within the timeout");
    }
    const double c4 = thread_cpu_seconds();
    hash_s += c1 - c0;
    match_s += c2 - c1;
    events_s += c4 - c3;

    ++res.requests;
    const std::uint64_t predicted = std::uint64_t{prefix[e]} * bs;
    if (done.admitted != 0) {
      res.prompt_tokens += prompt.size();
      res.cached_tokens += done.cached_tokens;
      res.predicted_tokens += predicted;
      prompt_tokens_of[e] += prompt.size();
      if (predicted != done.cached_tokens) ++res.mismatches;
    } else {
      ++res.rejected;
    }
    load[e].add(arrival_s, static_cast<double>(prompt.size() - std::min<std::uint64_t>(predicted, prompt.size())));
    if (cfg.progress && (r + 1) % 500 == 0) {
      std::fprintf(stderr, "\r%s N=%zu: %zu/%zu requests", to_string(cfg.policy), cfg.instances, r + 1, total);
    }
  }
  if (cfg.progress) std::fprintf(stderr, "\n");

  // Shutdown: quit every engine, collect its bye, reap the processes; all bounded.
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<zmq::message_t> out;
    out.emplace_back(engine_id(i));
    out.push_back(kind(Msg::kQuit));
    zmq::send_multipart(control, out);
  }
  std::size_t byes = 0;
  try {
    const auto deadline = Clock::now() + timeout;
    while (byes < n) {
      const auto msg = receive(deadline, "the engines' goodbyes");
      if (msg.size() != 3 || kind_of(msg[1]) != static_cast<char>(Msg::kBye)) continue;
      const Bye b = unframe<Bye>(msg[2], "bye");
      res.engine_manager_seconds += b.manager_seconds;
      res.replays += b.replay_requests;
      res.snapshots += b.snapshot_requests;
      ++byes;
    }
  } catch (const std::runtime_error& ex) {
    std::fprintf(stderr, "%s\n", ex.what());
  }
  const bool exited = children.reap(cfg.timeout_s);
  res.clean_shutdown = byes == n && exited;

  for (std::size_t i = 0; i < n; ++i) {
    res.event_bytes += subs[i]->stats().bytes;
    res.resync_failures += followers[i]->stats().resync_failures;
  }
  double mean_tokens = 0, max_tokens = 0;
  for (const std::uint64_t t : prompt_tokens_of) {
    mean_tokens += static_cast<double>(t);
    max_tokens = std::max(max_tokens, static_cast<double>(t));
  }
  mean_tokens /= static_cast<double>(n);
  res.max_over_mean_prompt_tokens = mean_tokens > 0 ? max_tokens / mean_tokens : 0;
  const double per = res.requests == 0 ? 0 : 1e6 / static_cast<double>(res.requests);
  res.hash_us = hash_s * per;
  res.match_us = match_s * per;
  res.events_us = events_s * per;
  res.index_entries_peak = index.peak_entries();
  res.index_bytes_peak = index.peak_bytes();
  res.wall_seconds = std::chrono::duration<double>(Clock::now() - wall0).count();
  return res;
}

}  // namespace router
