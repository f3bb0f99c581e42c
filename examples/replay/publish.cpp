// examples/replay/publish.cpp: EventPublishing over pagedkv::events::ZmqPublisher (when pagedkv-replay is built
// with the events_zmq component; otherwise --publish-events is refused with the reason).
#include "publish.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <utility>

#include <map>

#if PAGEDKV_REPLAY_WITH_EVENTS_ZMQ
#include <pagedkv/error.hpp>
#include <pagedkv/events_zmq/group_specs.hpp>
#include <pagedkv/events_zmq/publisher.hpp>
#endif

#include "trace.hpp"  // OptionError

namespace replay {

PublishFlags& publish_flags() noexcept {
  static PublishFlags flags;
  return flags;
}

void EventPublishing::add_fields(Row& row, const std::vector<std::string>& group_kinds) const {
  row.add("event_batches", batches_);
  std::map<std::string, GroupCounts> per_kind;  // summed over the groups of a kind
  std::vector<std::string> order;               // kinds in group order
  for (std::size_t g = 0; g < blocks_.size() && g < group_kinds.size(); ++g) {
    auto [it, fresh] = per_kind.try_emplace(group_kinds[g]);
    if (fresh) order.push_back(group_kinds[g]);
    it->second.stored += blocks_[g].stored;
    it->second.removed += blocks_[g].removed;
    it->second.published = blocks_[g].published;
  }
  for (const std::string& k : order) {
    const GroupCounts& c = per_kind[k];
    row.add("events_stored_" + k, c.stored)
        .add("events_removed_" + k, c.removed)
        .add("events_published_" + k, c.published ? "yes" : "no");
  }
}

#if PAGEDKV_REPLAY_WITH_EVENTS_ZMQ

struct EventPublishing::Impl {
  pagedkv::events::ZmqPublisher pub;
  explicit Impl(pagedkv::events::PublisherOptions o) : pub(std::move(o)) {}
};

EventPublishing::EventPublishing(const std::string& endpoint, int wait_ms,
                                 const std::vector<pagedkv::KVCacheGroupSpec>& groups) {
  if (endpoint.empty()) return;
  const PublishFlags& f = publish_flags();
  pagedkv::events::PublisherOptions o;
  if (!groups.empty()) {  // vLLM's kv_cache_spec_kind per group; main-attention groups only (main_groups_only)
    pagedkv::CacheConfig c;
    c.groups = groups;
    o.encoding.group_specs = pagedkv::events::group_specs(c);
  }
  blocks_.resize(std::max<std::size_t>(groups.size(), 1));
  for (std::size_t g = 0; g < groups.size(); ++g) {
    blocks_[g].published = pagedkv::events::is_main_attention(o.encoding.group_specs[g].kind);
  }
  o.endpoint = endpoint;
  o.mode = f.connect ? pagedkv::events::SocketMode::kConnect : pagedkv::events::SocketMode::kBind;
  o.replay_endpoint = "tcp://127.0.0.1:*";
  o.model_name = f.model_name;
  o.pod_id = f.pod_id;
  o.topic = !f.topic.empty() || !f.model_name.empty() ? f.topic : std::string("kv-events");
  o.linger_ms = 2000;
  try {
    impl_ = std::make_unique<Impl>(std::move(o));
  } catch (const pagedkv::Error& e) {
    throw OptionError("--publish-events: " + e.message());
  }
  std::fprintf(stderr, "pagedkv-replay: publishing KV events on %s (%s, topic %s, replay %s)\n",
               impl_->pub.endpoint().c_str(), f.connect ? "connected" : "bound", impl_->pub.topic().c_str(),
               impl_->pub.replay_endpoint().c_str());
  // Let subscribers connect (ZeroMQ drops what a PUB socket sends before a subscription arrives), answering any
  // replay requests meanwhile.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms);
  while (std::chrono::steady_clock::now() < until) impl_->pub.service_requests(std::chrono::milliseconds(10));
}

EventPublishing::~EventPublishing() = default;

void EventPublishing::set_snapshot_source(std::function<pagedkv::KVEventSnapshot()> source) {
  impl_->pub.set_snapshot_source(std::move(source));
}

void EventPublishing::publish(const pagedkv::KVEventBatch& batch) {
  for (const pagedkv::KVEvent& e : batch.events) {
    if (e.group >= blocks_.size()) continue;
    if (e.type == pagedkv::KVEventType::kBlockStored) ++blocks_[e.group].stored;
    if (e.type == pagedkv::KVEventType::kBlockRemoved) ++blocks_[e.group].removed;
  }
  ++batches_;
  impl_->pub.publish(batch);
}

void EventPublishing::finish() {
  if (!enabled()) return;
  impl_->pub.service_requests(std::chrono::milliseconds(0));
  const auto& s = impl_->pub.stats();
  const auto last = impl_->pub.last_seq();
  // The end of the stream, announced before the linger so a subscriber knows which batch is the last one.
  std::fprintf(stderr, "pagedkv-replay: last event batch %llu\n",
               static_cast<unsigned long long>(last.value_or(0)));
  std::fflush(stderr);
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(publish_flags().linger_ms);
  const std::uint64_t snapshots_before = s.snapshot_requests;
  while (s.snapshot_requests == snapshots_before && std::chrono::steady_clock::now() < until) {
    impl_->pub.service_requests(std::chrono::milliseconds(10));
  }
  std::fprintf(stderr, "pagedkv-replay: published %llu event batches (%.1f MB), answered %llu replay and %llu "
               "snapshot requests\n", static_cast<unsigned long long>(s.batches), static_cast<double>(s.bytes) / 1e6,
               static_cast<unsigned long long>(s.replay_requests), static_cast<unsigned long long>(s.snapshot_requests));
  impl_->pub.shutdown();
  impl_.reset();
}

#else  // built without the events_zmq component

struct EventPublishing::Impl {};

EventPublishing::EventPublishing(const std::string& endpoint, int /*wait_ms*/,
                                 const std::vector<pagedkv::KVCacheGroupSpec>& /*groups*/) {
  if (!endpoint.empty()) {
    throw OptionError("--publish-events " + endpoint + ": this pagedkv-replay was built without the "
                                "events_zmq component (install libzmq3-dev cppzmq-dev libmsgpack-cxx-dev and "
                                "rebuild)");
  }
}
EventPublishing::~EventPublishing() = default;
void EventPublishing::set_snapshot_source(std::function<pagedkv::KVEventSnapshot()>) {}
void EventPublishing::publish(const pagedkv::KVEventBatch&) {}
void EventPublishing::finish() {}

#endif

}  // namespace replay
