// src/events_zmq/publisher.cpp: ZmqPublisher (PUB + ROUTER replay, bounded replay buffer, no thread of its own).
#include <pagedkv/events_zmq/publisher.hpp>

#include <unistd.h>

#include <deque>
#include <string_view>
#include <utility>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "zmq_util.hpp"

namespace pagedkv::events {

using zmq_detail::be64;
using zmq_detail::from_be64;

namespace {

// The pod id of the default topic: the host name (as a Kubernetes pod sees its own name), else the endpoint with
// '@' (impossible in a host name, possible in no ZeroMQ endpoint either) replaced.
std::string default_pod_id(const std::string& endpoint) {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0 && host[0] != '\0') return std::string(host);
  std::string id = endpoint;
  for (char& c : id) {
    if (c == '@') c = '_';
  }
  return id;
}

}  // namespace

struct ZmqPublisher::Impl {
  PublisherOptions opt;
  zmq::context_t ctx{1};
  zmq::socket_t pub;
  zmq::socket_t replay;  // invalid without a replay endpoint
  std::string endpoint;
  std::string replay_ep;
  struct Entry {
    std::uint64_t seq;
    std::vector<std::byte> payload;
  };
  std::deque<Entry> buffer;
  std::size_t buffer_bytes = 0;
  std::optional<std::uint64_t> last;
  double last_ts = 0.0;  // the snapshot reply's timestamp: the last batch's
  std::function<KVEventSnapshot()> snapshot_source;
  PublisherStats stats;
  bool closed = false;

  explicit Impl(PublisherOptions o) : opt(std::move(o)) {
    if (opt.send_hwm < 0) {
      pagedkv::detail::raise(Errc::kInvalidArgument, "ZmqPublisher: send_hwm " + std::to_string(opt.send_hwm) +
                                                          " is negative (0 = unlimited)");
    }
    if (!opt.replay_endpoint.empty() && (opt.replay_buffer_batches == 0 || opt.replay_buffer_bytes == 0)) {
      pagedkv::detail::raise(Errc::kInvalidArgument,
                             "ZmqPublisher: a replay endpoint needs replay_buffer_batches and replay_buffer_bytes "
                             "> 0 (got " + std::to_string(opt.replay_buffer_batches) + " and " +
                                 std::to_string(opt.replay_buffer_bytes) + ")");
    }
    if (opt.linger_ms < 0) {
      pagedkv::detail::raise(Errc::kInvalidArgument, "ZmqPublisher: linger_ms " + std::to_string(opt.linger_ms) +
                                                          " is negative (it must bound the shutdown)");
    }
    if (opt.topic.empty() && !opt.model_name.empty()) {
      // llm-d's form; checked before any socket exists, so a bad name leaves nothing behind.
      opt.topic = llmd_topic(opt.pod_id.empty() ? default_pod_id(opt.endpoint) : opt.pod_id, opt.model_name);
    }
    pub = zmq::socket_t(ctx, zmq::socket_type::pub);
    pub.set(zmq::sockopt::sndhwm, opt.send_hwm);
    pub.set(zmq::sockopt::linger, opt.linger_ms);
    const bool connect = opt.mode == SocketMode::kConnect;
    try {
      if (connect) {
        pub.connect(opt.endpoint);
      } else {
        pub.bind(opt.endpoint);
      }
    } catch (const zmq::error_t& e) {
      close_all();
      zmq_detail::raise_zmq(connect ? "ZmqPublisher: cannot connect the PUB socket to"
                                    : "ZmqPublisher: cannot bind the PUB endpoint",
                            opt.endpoint, e);
    }
    endpoint = connect ? opt.endpoint : pub.get(zmq::sockopt::last_endpoint);
    if (!opt.replay_endpoint.empty()) {
      replay = zmq::socket_t(ctx, zmq::socket_type::router);
      replay.set(zmq::sockopt::linger, opt.linger_ms);
      // A reply is at most the whole buffer plus a snapshot and the end marker: never drop part of one.
      replay.set(zmq::sockopt::sndhwm, static_cast<int>(std::min<std::size_t>(opt.replay_buffer_batches + 16, 1u << 30)));
      try {
        replay.bind(opt.replay_endpoint);
      } catch (const zmq::error_t& e) {
        close_all();
        zmq_detail::raise_zmq("ZmqPublisher: cannot bind the replay endpoint", opt.replay_endpoint, e);
      }
      replay_ep = replay.get(zmq::sockopt::last_endpoint);
    }
  }

  void close_all() noexcept {
    if (closed) return;
    closed = true;
    try {
      if (replay) replay.close();
      if (pub) pub.close();
      ctx.close();  // joins libzmq's I/O thread after at most linger_ms of flushing
    } catch (...) {
    }
  }

  void remember(std::uint64_t seq, std::vector<std::byte> payload) {
    if (!replay) return;
    buffer_bytes += payload.size();
    buffer.push_back({seq, std::move(payload)});
    while (!buffer.empty() && (buffer.size() > opt.replay_buffer_batches || buffer_bytes > opt.replay_buffer_bytes)) {
      buffer_bytes -= buffer.front().payload.size();
      buffer.pop_front();
    }
  }

  // [identity, "", seq, payload] to one replay client; never blocks (a vanished client's replies are dropped).
  void reply(const zmq::message_t& identity, std::uint64_t seq, std::span<const std::byte> payload) {
    const auto s = be64(seq);
    zmq::message_t id(identity.data(), identity.size());
    (void)replay.send(id, zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    (void)replay.send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    (void)replay.send(zmq::buffer(s.data(), s.size()), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    (void)replay.send(zmq::buffer(payload.data(), payload.size()), zmq::send_flags::dontwait);
  }

  void answer(const zmq::message_t& identity, const zmq::message_t& body) {
    const std::string_view text(static_cast<const char*>(body.data()), body.size());
    if (body.size() == 8) {  // vLLM's replay request: the first number wanted
      ++stats.replay_requests;
      const std::uint64_t from = from_be64(body.data());
      for (const Entry& e : buffer) {
        if (e.seq >= from) {
          reply(identity, e.seq, e.payload);
          ++stats.replayed_batches;
        }
      }
    } else if (text == kSnapshotRequest && snapshot_source) {
      ++stats.snapshot_requests;
      const KVEventSnapshot snap = snapshot_source();
      const std::vector<std::byte> payload = encode_snapshot(snap, last_ts, opt.encoding);
      reply(identity, snap.seq_no, payload);
      ++stats.replayed_batches;
      for (const Entry& e : buffer) {
        if (e.seq > snap.seq_no) {
          reply(identity, e.seq, e.payload);
          ++stats.replayed_batches;
        }
      }
    }
    reply(identity, kEndOfReplaySeq, {});  // end marker: [-1 (8 bytes), ""]
  }

  std::size_t service(std::chrono::milliseconds wait) {
    if (closed || !replay) return 0;
    std::size_t answered = 0;
    for (int round = 0; round < 64; ++round) {
      zmq::pollitem_t item{replay.handle(), 0, ZMQ_POLLIN, 0};
      const int ready = zmq::poll(&item, 1, round == 0 ? wait : std::chrono::milliseconds(0));
      if (ready <= 0 || (item.revents & ZMQ_POLLIN) == 0) break;
      std::vector<zmq::message_t> frames;
      const auto n = zmq::recv_multipart(replay, std::back_inserter(frames), zmq::recv_flags::dontwait);
      if (!n) break;
      // [identity, "", body] from a REQ client or a DEALER that sends the empty delimiter (vLLM's format).
      if (frames.size() != 3 || frames[1].size() != 0) {
        ++stats.bad_requests;
        continue;
      }
      answer(frames[0], frames[2]);
      ++answered;
    }
    return answered;
  }
};

ZmqPublisher::ZmqPublisher(PublisherOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
ZmqPublisher::~ZmqPublisher() { shutdown(); }
ZmqPublisher::ZmqPublisher(ZmqPublisher&&) noexcept = default;
ZmqPublisher& ZmqPublisher::operator=(ZmqPublisher&&) noexcept = default;

const std::string& ZmqPublisher::endpoint() const noexcept { return impl_->endpoint; }
const std::string& ZmqPublisher::replay_endpoint() const noexcept { return impl_->replay_ep; }
const std::string& ZmqPublisher::topic() const noexcept { return impl_->opt.topic; }

std::size_t ZmqPublisher::publish(const KVEventBatch& batch) {
  Impl& m = *impl_;
  if (m.closed) pagedkv::detail::raise(Errc::kInvalidArgument, "ZmqPublisher::publish: the publisher is shut down");
  if (m.last && batch.seq_no <= *m.last) {
    pagedkv::detail::raise(Errc::kInvalidArgument, "ZmqPublisher::publish: batch " + std::to_string(batch.seq_no) +
                                                        " is not above the last one published (" +
                                                        std::to_string(*m.last) + ")");
  }
  std::vector<std::byte> payload = encode_batch(batch, m.opt.encoding);
  m.last_ts = batch.ts;
  return publish_payload(batch.seq_no, std::move(payload));
}

std::size_t ZmqPublisher::publish_payload(std::uint64_t seq, std::vector<std::byte> payload) {
  Impl& m = *impl_;
  if (m.closed) {
    pagedkv::detail::raise(Errc::kInvalidArgument, "ZmqPublisher::publish_payload: the publisher is shut down");
  }
  if (m.last && seq <= *m.last) {
    pagedkv::detail::raise(Errc::kInvalidArgument, "ZmqPublisher::publish_payload: batch " + std::to_string(seq) +
                                                        " is not above the last one published (" +
                                                        std::to_string(*m.last) + ")");
  }
  if (seq == kEndOfReplaySeq) {
    pagedkv::detail::raise(Errc::kInvalidArgument,
                           "ZmqPublisher::publish_payload: batch number 2^64 - 1 is the replay end marker");
  }
  const auto s = be64(seq);
  const std::size_t size = payload.size();
  // PUB never blocks: past the high-water mark a slow subscriber misses the message (and replays it later).
  (void)m.pub.send(zmq::buffer(m.opt.topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
  (void)m.pub.send(zmq::buffer(s.data(), s.size()), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
  (void)m.pub.send(zmq::buffer(payload.data(), payload.size()), zmq::send_flags::dontwait);
  m.last = seq;
  ++m.stats.batches;
  m.stats.bytes += size;
  m.remember(seq, std::move(payload));
  m.service(std::chrono::milliseconds(0));
  return size;
}

void ZmqPublisher::set_snapshot_source(std::function<KVEventSnapshot()> source) {
  impl_->snapshot_source = std::move(source);
}

std::size_t ZmqPublisher::service_requests(std::chrono::milliseconds wait) { return impl_->service(wait); }

void* ZmqPublisher::native_replay_socket() const noexcept {
  return impl_->replay && !impl_->closed ? impl_->replay.handle() : nullptr;
}

std::optional<std::uint64_t> ZmqPublisher::last_seq() const noexcept { return impl_->last; }

const PublisherStats& ZmqPublisher::stats() const noexcept { return impl_->stats; }

void ZmqPublisher::shutdown() noexcept {
  if (impl_) impl_->close_all();
}

}  // namespace pagedkv::events
