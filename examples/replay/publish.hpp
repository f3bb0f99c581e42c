// examples/replay/publish.hpp: `--publish-events`: the replay's KV events on a ZeroMQ endpoint in vLLM's format
// (pagedkv::events::ZmqPublisher), so any vLLM-format subscriber (vLLM's kv_events_subscriber example, Dynamo's
// KV router, llm-d) can watch a real trace's cache evolve.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/kv_cache_manager.hpp>

#include "report.hpp"

namespace replay {

/// How `--publish-events` publishes, beyond its endpoint: the flags --model-name, --pod-id, --topic and
/// --publish-connect (main.cpp binds them here; kFlagRules refuses them without --publish-events).
struct PublishFlags {
  /// The model name routers know the engine by; with it (and no --topic) the topic is llm-d's
  /// "kv@<pod_id>@<model_name>" (pagedkv/events_zmq/topic.hpp). No '@'.
  std::string model_name;
  /// The pod (instance) id of llm-d's topic; empty = the host name. No '@'.
  std::string pod_id;
  /// An explicit topic (wins over the llm-d form); empty with no model name = "kv-events".
  std::string topic;
  /// Connect the PUB socket to the --publish-events endpoint (a router's bound SUB: llm-d's centralized mode)
  /// instead of binding it. The replay socket still binds a free loopback port.
  bool connect = false;
  /// --publish-linger-ms: after the last batch, keep answering replay and snapshot requests for up to this long,
  /// ending early once a snapshot request has been answered, so a subscriber can compare its index with the
  /// engine's final cached set (tests/events_zmq/replay_events_check.cpp). 0 = close at once.
  int linger_ms = 0;
};

/// The process's publish flags (one replay per process; main.cpp fills them while parsing, EventPublishing reads
/// them when it is constructed).
PublishFlags& publish_flags() noexcept;

/// The replay's event publisher: disabled (every call a no-op) without an endpoint. One manager is published per
/// run (prefix mode: the first --capacity-tokens pool), one batch per engine step, stamped with the step's
/// simulated time in seconds. Topic from publish_flags() ("kv-events" by default, llm-d's kv@<pod>@<model> with
/// --model-name); the PUB socket binds, or connects with --publish-connect; a replay (ROUTER) socket with snapshots
/// is bound on a free loopback port and announced on stderr with the endpoint. Recording events adds to the manager's library time.
/// A pool with KV-cache groups (`groups` non-empty, --model-layers) publishes its events with vLLM's
/// kv_cache_spec_kind per group, and only those of its full-attention groups (EncodeOptions::main_groups_only:
/// Dynamo indexes only those, and llm-d's index has no group, so a sliding-window group's removal of a block the
/// full group still holds would erase it there); every group's stored and removed blocks are counted.
/// Thread safety: none (the replay's thread).
class EventPublishing {
 public:
  /// Binds `endpoint` (e.g. tcp://127.0.0.1:5557) unless it is empty, then waits `wait_ms` so subscribers can
  /// connect before the first batch. `groups`: the published manager's KV-cache groups (CacheConfig::groups;
  /// empty = one full-attention group). Throws OptionError (trace.hpp) naming the endpoint when it cannot be bound,
  /// or when this pagedkv-replay was built without the events_zmq component.
  EventPublishing(const std::string& endpoint, int wait_ms, const std::vector<pagedkv::KVCacheGroupSpec>& groups = {});
  ~EventPublishing();
  EventPublishing(const EventPublishing&) = delete;
  EventPublishing& operator=(const EventPublishing&) = delete;

  [[nodiscard]] bool enabled() const noexcept { return impl_ != nullptr; }
  /// Whether this object published (an endpoint was given), before and after finish().
  [[nodiscard]] bool enabled_at_start() const noexcept { return !blocks_.empty(); }

  /// Append the published counts to `row`: event_batches, and per group kind (`group_kinds[g]` labels group g)
  /// the blocks stored and removed (both tiers; events_stored_<kind>, events_removed_<kind>, summed over the
  /// groups of that kind) and whether that kind's events were published (events_published_<kind>: yes / no).
  void add_fields(Row& row, const std::vector<std::string>& group_kinds) const;

  /// Turns event recording on in the published manager's configuration.
  void configure(pagedkv::CacheConfig& config) const noexcept {
    if (enabled()) config.enable_events = true;
  }

  /// Serves snapshot requests from `manager`'s event snapshot (it must outlive this object's use).
  template <class Manager>
  void attach(const Manager& manager) {
    if (enabled()) set_snapshot_source([&manager] { return manager.event_snapshot(); });
  }

  /// After an engine step of `manager`: publish its batch, if anything happened, stamped `ts_s`.
  template <class Manager>
  void step(Manager& manager, double ts_s) {
    if (!enabled()) return;
    if (auto batch = manager.take_event_batch(ts_s)) publish(*batch);
  }

  /// Serve pending requests (for up to publish_flags().linger_ms, see there), print what was published and the
  /// last batch's number on stderr, close (bounded: the linger plus the publisher's socket linger).
  void finish();

 private:
  void set_snapshot_source(std::function<pagedkv::KVEventSnapshot()> source);
  void publish(const pagedkv::KVEventBatch& batch);

  struct Impl;
  std::unique_ptr<Impl> impl_;
  struct GroupCounts {
    std::uint64_t stored = 0, removed = 0;  // blocks, both tiers
    bool published = true;                  // a main-attention group (written on the wire)
  };
  std::vector<GroupCounts> blocks_;  // per group; empty = not publishing
  std::uint64_t batches_ = 0;
};

}  // namespace replay
