// tests/events_zmq/replay_events_check.cpp: issue 21's "done when" for whole replay modes. Runs pagedkv-replay as a
// child process publishing its KV events (--publish-events tcp://127.0.0.1:*, llm-d's topic), follows the stream
// (gaps repaired through the replay socket) into this project's llm-d and Dynamo rule models (router_models.hpp),
// and once the replay announces its last batch, asks it for a snapshot of its final cached set
// (--publish-linger-ms keeps it answering). Checks, each printed with its numbers:
//  - every batch 1..last applied in order, no decode error, no resynchronization failure;
//  - no BlockStored dropped by either model (an unknown parent), every removal names an indexed block, and both
//    models stored the same number of blocks;
//  - each model's final (block, tier) set equals the engine's snapshot;
//  - for every request of the slice, its prompt and its prompt + generated tokens: each model's cached-block count
//    (request keys computed from the tokens alone, as a router does) equals the engine's, the longest chain of the
//    query's blocks in the snapshot (same parent, same tokens);
//  - the replay exits with status 0.
// Usage: pagedkv_replay_events_check LABEL PAGEDKV_REPLAY TRACE LIMIT [REPLAY FLAGS...]
// (the check adds the trace, --limit, --no-progress and the publishing flags). Exit status 0 when every check
// holds, 1 otherwise, 2 on bad usage. Every wait is bounded; no timing is asserted.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <pagedkv/events_zmq/subscriber.hpp>
#include <pagedkv/events_zmq/topic.hpp>
#include <pagedkv/events_zmq/wire.hpp>

#include "router_models.hpp"
#include "trace.hpp"

extern char** environ;

namespace {

using namespace router_models;  // NOLINT: the rule models
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

constexpr const char* kModel = "acme/replay-7b";
constexpr const char* kPod = "replay-0";

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

/// The child's stderr, read without blocking, one complete line at a time (echoed to ours, prefixed).
struct ChildLines {
  int fd = -1;
  std::string partial;
  std::vector<std::string> lines;
  bool eof = false;
  void pump(int wait_ms) {
    if (eof) return;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, wait_ms) <= 0) return;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) {
      eof = true;
      return;
    }
    partial.append(buf, static_cast<std::size_t>(n));
    for (std::size_t nl; (nl = partial.find('\n')) != std::string::npos;) {
      lines.push_back(partial.substr(0, nl));
      std::fprintf(stderr, "  [replay] %s\n", lines.back().c_str());
      partial.erase(0, nl + 1);
    }
  }
  /// The text after `marker` on the first line that has it.
  [[nodiscard]] std::optional<std::string> after(const std::string& marker) const {
    for (const std::string& l : lines) {
      if (const auto at = l.find(marker); at != std::string::npos) return l.substr(at + marker.size());
    }
    return std::nullopt;
  }
};

/// The engine's final cached set from its snapshot: wire key -> (parent key, tokens, tiers).
struct Cached {
  std::optional<std::uint64_t> parent;
  std::vector<TokenId> tokens;
  std::uint64_t tiers = 0;
};

/// The engine's cached-block count of `tokens`: its longest chain of full blocks in the snapshot, block i's parent
/// being block i-1 and its tokens the query's (the replay's blocks carry no extra keys).
std::size_t engine_prefix(const std::map<std::pair<std::uint64_t, std::vector<TokenId>>, std::uint64_t>& trie,
                          const std::vector<TokenId>& tokens, std::uint32_t bs) {
  std::size_t n = 0;
  std::uint64_t parent = 0;  // 0 with n == 0: the root (a wire key of 0 is not special: the root is keyed by n)
  for (std::size_t b = 0; b + bs <= tokens.size(); b += bs, ++n) {
    const std::vector<TokenId> block(tokens.begin() + static_cast<std::ptrdiff_t>(b),
                                     tokens.begin() + static_cast<std::ptrdiff_t>(b + bs));
    const auto it = trie.find({n == 0 ? ~std::uint64_t{0} : parent, block});
    if (it == trie.end()) break;
    parent = it->second;
  }
  return n;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s LABEL PAGEDKV_REPLAY TRACE LIMIT [REPLAY FLAGS...]\n", argv[0]);
    return 2;
  }
  const std::string label = argv[1];
  const std::string limit = argv[4];
  const replay::Trace trace = replay::load_trace(argv[3], std::stoul(limit));
  std::vector<std::string> args = {argv[2], argv[3], "--limit", limit, "--no-progress",
                                   "--publish-events", "tcp://127.0.0.1:*", "--publish-wait-ms", "300",
                                   "--publish-linger-ms", "120000", "--model-name", kModel, "--pod-id", kPod};
  for (int i = 5; i < argc; ++i) args.emplace_back(argv[i]);
  std::string cmd;
  for (const std::string& a : args) cmd += (cmd.empty() ? "" : " ") + a;
  std::printf("== %s: %s\n", label.c_str(), cmd.c_str());
  std::fflush(stdout);

  int pipe_fd[2];
  if (::pipe(pipe_fd) != 0) return 1;
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, pipe_fd[1], 2);
  posix_spawn_file_actions_addclose(&fa, pipe_fd[0]);
  posix_spawn_file_actions_addclose(&fa, pipe_fd[1]);
  std::vector<char*> cargv;
  for (std::string& a : args) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  pid_t child = 0;
  if (const int rc = posix_spawn(&child, cargv[0], &fa, nullptr, cargv.data(), environ); rc != 0) {
    std::fprintf(stderr, "cannot start %s: %s\n", cargv[0], std::strerror(rc));
    return 1;
  }
  posix_spawn_file_actions_destroy(&fa);
  ::close(pipe_fd[1]);
  ChildLines out;
  out.fd = pipe_fd[0];
  const auto reap = [&](bool kill_first) {
    if (kill_first) ::kill(child, SIGTERM);
    int status = 0;
    const auto until = Clock::now() + milliseconds(30000);
    while (::waitpid(child, &status, WNOHANG) == 0) {
      if (Clock::now() > until) {
        ::kill(child, SIGKILL);
        ::waitpid(child, &status, 0);
        return -1;
      }
      out.pump(20);
    }
    while (!out.eof) out.pump(20);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };

  // "publishing KV events on tcp://127.0.0.1:PORT (bound, topic T, replay tcp://127.0.0.1:PORT)"
  std::optional<std::string> announced;
  for (auto until = Clock::now() + milliseconds(60000); !announced && !out.eof && Clock::now() < until;) {
    out.pump(50);
    announced = out.after("publishing KV events on ");
  }
  if (!announced) {
    std::printf("FAIL the replay announced no endpoint (exit status %d)\n", reap(true));
    return 1;
  }
  const std::string endpoint = announced->substr(0, announced->find(' '));
  const auto rp = announced->find("replay ");
  const std::string replay_endpoint = announced->substr(rp + 7, announced->find(')', rp) - rp - 7);
  const auto tp = announced->find("topic ");
  const std::string topic = announced->substr(tp + 6, announced->find(',', tp) - tp - 6);
  const auto parts = pagedkv::events::parse_llmd_topic(topic);
  check(parts && parts->model_name == kModel && parts->pod_id == kPod, "llm-d topic " + topic);

  Llmd llmd;
  llmd.model = parts ? parts->model_name : kModel;
  Dynamo dynamo;
  std::uint32_t block_size = 0;
  std::uint64_t gpu_stores = 0, cpu_stores = 0, cleared = 0;
  ev::ZmqSubscriber sub({endpoint, replay_endpoint, topic, 100000});
  ev::FollowerOptions fo;
  fo.start_synced_at_zero = true;  // the replay's first batch is 1, from an empty cache
  fo.quiet = milliseconds(50);
  fo.idle = [&out] { out.pump(0); };
  ev::EventStreamFollower follower(sub, fo, [&](std::uint64_t, const ev::WireBatch& b, bool) {
    for (const ev::WireEvent& w : b.events) {
      if (const auto* s = std::get_if<ev::WireBlockStored>(&w)) {
        block_size = s->block_size;
        (medium_bit(s->medium) == 2 ? cpu_stores : gpu_stores) += s->block_hashes.size();
      }
      cleared += std::holds_alternative<ev::WireAllBlocksCleared>(w) ? 1 : 0;
    }
    llmd.apply(b);
    dynamo.apply(b);
  });

  // Follow until the replay names its last batch, then catch up to it (replay requests fill any gap).
  std::optional<std::string> last_line;
  for (auto until = Clock::now() + milliseconds(240000); !last_line && !out.eof && Clock::now() < until;) {
    follower.poll(milliseconds(20));
    out.pump(0);
    last_line = out.after("last event batch ");
  }
  if (!last_line) {
    std::printf("FAIL the replay never announced its last batch (exit status %d)\n", reap(true));
    return 1;
  }
  const std::uint64_t last = std::stoull(*last_line);
  check(last > 0 && follower.catch_up(last, milliseconds(20000)),
        "followed batches 1.." + std::to_string(last) + " (applied " + std::to_string(follower.stats().applied) +
            ", " + std::to_string(follower.stats().applied_replayed) + " by replay, gaps " +
            std::to_string(follower.stats().gaps) + ")");
  check(follower.stats().decode_errors == 0 && follower.stats().resync_failures == 0 && follower.stats().snapshots == 0,
        "no decode error, no failed resynchronization, no snapshot needed");

  // The engine's final cached set.
  const ev::ReplayReply snap = sub.request_snapshot(milliseconds(10000), 1000000, [&out] { out.pump(0); });
  std::map<std::uint64_t, Cached> truth;
  Llmd snap_llmd;
  snap_llmd.model = llmd.model;
  Dynamo snap_dynamo;
  std::uint64_t snap_parent_later = 0, snap_parent_absent = 0;
  std::string first_snapshot_orphan;
  if (snap.complete && !snap.batches.empty()) {
    check(snap.batches.front().seq == last, "snapshot covers batch " + std::to_string(snap.batches.front().seq));
    const ev::WireBatch b = ev::decode_batch(snap.batches.front().payload);
    for (const ev::WireEvent& w : b.events) {
      const auto* s = std::get_if<ev::WireBlockStored>(&w);
      if (s == nullptr) continue;
      std::optional<std::uint64_t> parent;
      if (s->parent_block_hash) parent = s->parent_block_hash->key;
      for (std::size_t i = 0; i < s->block_hashes.size(); ++i) {
        Cached& c = truth[s->block_hashes[i].key];
        c.parent = parent;
        const auto t = s->block_tokens(i);
        c.tokens.assign(t.begin(), t.end());
        c.tiers |= medium_bit(s->medium);
        parent = s->block_hashes[i].key;
      }
    }
    snap_llmd.apply(b);
    snap_dynamo.apply(b);
    // Why a fresh model would drop a snapshot event: its parent comes later in the snapshot, or is in no tier.
    std::map<std::uint64_t, bool> seen;
    for (const ev::WireEvent& w : b.events) {
      const auto* s = std::get_if<ev::WireBlockStored>(&w);
      if (s == nullptr) continue;
      if (s->parent_block_hash && seen.count(s->parent_block_hash->key) == 0) {
        ++(truth.count(s->parent_block_hash->key) != 0 ? snap_parent_later : snap_parent_absent);
        if (first_snapshot_orphan.empty()) {
          first_snapshot_orphan = std::string(" (first: a ") + (s->medium ? *s->medium : "GPU") + " BlockStored of " +
                                  std::to_string(s->block_hashes.size()) + " blocks whose parent is " +
                                  (truth.count(s->parent_block_hash->key) != 0 ? "listed later, tiers " +
                                       std::to_string(truth[s->parent_block_hash->key].tiers) : "in no tier") + ")";
        }
      }
      for (const ev::WireHash& h : s->block_hashes) seen[h.key] = true;
    }
  } else {
    check(false, "snapshot answered (complete " + std::to_string(snap.complete) + ")");
  }
  const int rc = reap(false);
  check(rc == 0, "pagedkv-replay exit status " + std::to_string(rc));

  std::map<std::uint64_t, std::uint64_t> truth_tiers;
  std::size_t truth_gpu = 0, truth_cpu = 0, unreachable = 0;
  std::map<std::pair<std::uint64_t, std::vector<TokenId>>, std::uint64_t> trie;
  for (const auto& [k, c] : truth) {
    truth_tiers[k] = c.tiers;
    truth_gpu += (c.tiers & 1) != 0 ? 1 : 0;
    truth_cpu += (c.tiers & 2) != 0 ? 1 : 0;
    trie[{c.parent.value_or(~std::uint64_t{0}), c.tokens}] = k;
    for (std::optional<std::uint64_t> p = c.parent; p; p = truth.at(*p).parent) {
      if (truth.count(*p) == 0) {
        ++unreachable;
        break;
      }
    }
  }
  std::printf("events: %llu BlockStored (%llu GPU + %llu CPU blocks), %llu removed blocks, %llu AllBlocksCleared; "
              "final cache %zu blocks (%zu GPU, %zu CPU, %zu unreachable)\n",
              static_cast<unsigned long long>(llmd.stored_events), static_cast<unsigned long long>(gpu_stores),
              static_cast<unsigned long long>(cpu_stores), static_cast<unsigned long long>(llmd.removed_blocks),
              static_cast<unsigned long long>(cleared), truth.size(), truth_gpu, truth_cpu, unreachable);
  for (const auto& [name, r] : {std::pair<const char*, const RouterModel*>{"llm-d", &llmd}, {"Dynamo", &dynamo}}) {
    const std::string n = name;
    check(r->dropped_events == 0 && r->unsupported == 0,
          n + " dropped " + std::to_string(r->dropped_events) + " of " + std::to_string(r->stored_events) +
              " BlockStored events (unsupported keys " + std::to_string(r->unsupported) + ")");
    check(r->bad_removals == 0, n + " removals of unindexed blocks: " + std::to_string(r->bad_removals));
    check(model_blocks(*r) == truth_tiers, n + " index (" + std::to_string(r->by_engine_key.size()) +
                                               " blocks) equals the engine's final cached set (" +
                                               std::to_string(truth_tiers.size()) + " blocks, with tiers)");
  }
  check(llmd.stored_blocks == dynamo.stored_blocks && llmd.stored_blocks == gpu_stores + cpu_stores,
        "both models indexed every stored block: " + std::to_string(llmd.stored_blocks));
  // pagedkv's snapshot (an extension: vLLM's replay socket has none, so llm-d and Dynamo never ask for it) as the
  // follower applies it after a gap it cannot replay: reported, not asserted (see docs/events-wire.md).
  std::printf("note snapshot alone, applied to fresh models: llm-d drops %llu, Dynamo drops %llu BlockStored events "
              "(parent listed later in the snapshot: %llu, parent in no tier: %llu)%s; their indexes %s the final "
              "cached set\n",
              static_cast<unsigned long long>(snap_llmd.dropped_events),
              static_cast<unsigned long long>(snap_dynamo.dropped_events),
              static_cast<unsigned long long>(snap_parent_later), static_cast<unsigned long long>(snap_parent_absent),
              first_snapshot_orphan.c_str(),
              model_blocks(snap_llmd) == truth_tiers && model_blocks(snap_dynamo) == truth_tiers ? "equal" : "differ from");

  // Every request of the slice, as a router would be asked: its prompt, and its prompt + generated tokens.
  const LoraNames no_lora = [](std::uint64_t) { return std::string(); };
  std::uint64_t queries = 0, nonzero = 0, llmd_agree = 0, dynamo_agree = 0, cached_blocks = 0;
  std::vector<TokenId> prompt;
  std::string first_disagreement;
  if (block_size != 0) {
    for (std::size_t i = 0; i < trace.requests.size(); ++i) {
      replay::synthesize_prompt(trace, i, prompt);
      std::vector<TokenId> full = prompt;
      for (std::size_t s = 0; s < trace.requests[i].output_tokens; ++s) full.push_back(replay::generated_token(i, 0, s));
      for (const std::vector<TokenId>* q : {&prompt, &full}) {
        const std::size_t t = engine_prefix(trie, *q, block_size);
        const std::size_t l = llmd.count_prefix(llmd.request_keys(*q, {}, block_size, no_lora));
        const std::size_t d = dynamo.count_prefix(Dynamo::request_keys(*q, {}, block_size, no_lora));
        ++queries;
        nonzero += t > 0 ? 1 : 0;
        cached_blocks += t;
        llmd_agree += l == t ? 1 : 0;
        dynamo_agree += d == t ? 1 : 0;
        if ((l != t || d != t) && first_disagreement.empty()) {
          first_disagreement = " (first: request " + std::to_string(i) + (q == &full ? " with output" : " prompt") +
                               ": engine " + std::to_string(t) + ", llm-d " + std::to_string(l) + ", Dynamo " +
                               std::to_string(d) + ")";
        }
      }
    }
  }
  check(queries > 0 && llmd_agree == queries && dynamo_agree == queries,
        "queries " + std::to_string(queries) + " (" + std::to_string(nonzero) + " with a cached prefix, " +
            std::to_string(cached_blocks) + " cached blocks): llm-d agrees " + std::to_string(llmd_agree) +
            ", Dynamo agrees " + std::to_string(dynamo_agree) + first_disagreement);
  check(nonzero > 0, "some query has a cached prefix (the check can see a hit)");
  std::printf("== %s: %s\n", label.c_str(), failures == 0 ? "passed" : "FAILED");
  return failures == 0 ? 0 : 1;
}
