// src/events_zmq/subscriber.cpp: ZmqSubscriber (SUB + DEALER replay client) and EventStreamFollower (in-order
// application with gap recovery: replay, then snapshot).
#include <pagedkv/events_zmq/subscriber.hpp>

#include <algorithm>
#include <utility>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <pagedkv/events_zmq/publisher.hpp>

#include "zmq_util.hpp"

namespace pagedkv::events {

using zmq_detail::be64;
using zmq_detail::from_be64;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

namespace {

milliseconds remaining(Clock::time_point deadline) {
  const auto now = Clock::now();
  if (now >= deadline) return milliseconds(0);
  return std::chrono::ceil<milliseconds>(deadline - now);
}

}  // namespace

struct ZmqSubscriber::Impl {
  SubscriberOptions opt;
  zmq::context_t ctx{1};
  zmq::socket_t sub;
  zmq::socket_t dealer;  // created on demand, reset after an incomplete reply
  SubscriberStats stats;
  std::string endpoint;

  explicit Impl(SubscriberOptions o) : opt(std::move(o)) {
    sub = zmq::socket_t(ctx, zmq::socket_type::sub);
    sub.set(zmq::sockopt::rcvhwm, opt.receive_hwm);
    sub.set(zmq::sockopt::linger, 0);
    sub.set(zmq::sockopt::subscribe, opt.topic);
    const bool bind = opt.mode == SocketMode::kBind;
    try {
      if (bind) {
        sub.bind(opt.endpoint);
      } else {
        sub.connect(opt.endpoint);
      }
    } catch (const zmq::error_t& e) {
      zmq_detail::raise_zmq(bind ? "ZmqSubscriber: cannot bind the SUB endpoint"
                                 : "ZmqSubscriber: cannot connect to the PUB endpoint",
                            opt.endpoint, e);
    }
    endpoint = bind ? sub.get(zmq::sockopt::last_endpoint) : opt.endpoint;
    if (!opt.replay_endpoint.empty()) open_dealer();
  }

  void open_dealer() {
    dealer = zmq::socket_t(ctx, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.set(zmq::sockopt::rcvhwm, 0);  // a reply may be the whole replay buffer
    try {
      dealer.connect(opt.replay_endpoint);
    } catch (const zmq::error_t& e) {
      dealer.close();
      zmq_detail::raise_zmq("ZmqSubscriber: cannot connect to the replay endpoint", opt.replay_endpoint, e);
    }
  }

  std::optional<RawBatch> receive(milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
      const int ready = zmq::poll(&item, 1, remaining(deadline));
      if (ready > 0 && (item.revents & ZMQ_POLLIN) != 0) {
        std::vector<zmq::message_t> frames;
        if (zmq::recv_multipart(sub, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
          if (frames.size() == 3 && frames[1].size() == 8) {
            RawBatch b;
            b.topic.assign(static_cast<const char*>(frames[0].data()), frames[0].size());
            b.seq = from_be64(frames[1].data());
            const auto* p = static_cast<const std::byte*>(frames[2].data());
            b.payload.assign(p, p + frames[2].size());
            ++stats.messages;
            stats.bytes += b.payload.size();
            return b;
          }
          ++stats.malformed;
        }
      }
      if (Clock::now() >= deadline) return std::nullopt;
    }
  }

  ReplayReply request(std::string_view body, milliseconds timeout, std::size_t max_batches,
                      const std::function<void()>& idle) {
    ReplayReply r;
    if (opt.replay_endpoint.empty()) return r;
    if (!dealer) open_dealer();
    const auto deadline = Clock::now() + timeout;
    // ["", body]: the empty delimiter a REQ socket would add, so the ROUTER sees [identity, "", body].
    // Never block: a request that cannot be queued (the socket's queue is full) is an incomplete reply.
    const bool sent = dealer.send(zmq::message_t(), zmq::send_flags::sndmore | zmq::send_flags::dontwait) &&
                      dealer.send(zmq::buffer(body.data(), body.size()), zmq::send_flags::dontwait);
    while (sent && r.batches.size() < max_batches) {
      const milliseconds left = remaining(deadline);
      if (left.count() == 0) break;
      zmq::pollitem_t item{dealer.handle(), 0, ZMQ_POLLIN, 0};
      const int ready = zmq::poll(&item, 1, std::min(left, milliseconds(2)));
      if (ready <= 0 || (item.revents & ZMQ_POLLIN) == 0) {
        if (idle) idle();
        continue;
      }
      std::vector<zmq::message_t> frames;
      if (!zmq::recv_multipart(dealer, std::back_inserter(frames), zmq::recv_flags::dontwait)) continue;
      if (frames.size() != 3 || frames[0].size() != 0 || frames[1].size() != 8) continue;  // not a reply
      const std::uint64_t seq = from_be64(frames[1].data());
      if (seq == kEndOfReplaySeq) {
        r.complete = true;
        break;
      }
      RawBatch b;
      b.seq = seq;
      const auto* p = static_cast<const std::byte*>(frames[2].data());
      b.payload.assign(p, p + frames[2].size());
      r.batches.push_back(std::move(b));
    }
    if (!r.complete) {
      ++stats.timeouts;
      dealer.close();  // late answers to this request must not mix into the next one
    }
    return r;
  }
};

ZmqSubscriber::ZmqSubscriber(SubscriberOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
ZmqSubscriber::~ZmqSubscriber() = default;
ZmqSubscriber::ZmqSubscriber(ZmqSubscriber&&) noexcept = default;
ZmqSubscriber& ZmqSubscriber::operator=(ZmqSubscriber&&) noexcept = default;

std::optional<RawBatch> ZmqSubscriber::receive(milliseconds timeout) { return impl_->receive(timeout); }

ReplayReply ZmqSubscriber::request_replay(std::uint64_t from_seq, milliseconds timeout, std::size_t max_batches,
                                          const std::function<void()>& idle) {
  ++impl_->stats.replay_requests;
  const auto s = be64(from_seq);
  return impl_->request(std::string_view(reinterpret_cast<const char*>(s.data()), s.size()), timeout, max_batches,
                        idle);
}

ReplayReply ZmqSubscriber::request_snapshot(milliseconds timeout, std::size_t max_batches,
                                            const std::function<void()>& idle) {
  ++impl_->stats.snapshot_requests;
  return impl_->request(kSnapshotRequest, timeout, max_batches, idle);
}

const std::string& ZmqSubscriber::endpoint() const noexcept { return impl_->endpoint; }
bool ZmqSubscriber::has_replay() const noexcept { return !impl_->opt.replay_endpoint.empty(); }

const SubscriberStats& ZmqSubscriber::stats() const noexcept { return impl_->stats; }

// -----------------------------------------------------------------------------------------------------------------
// EventStreamFollower

EventStreamFollower::EventStreamFollower(ZmqSubscriber& subscriber, FollowerOptions options, Apply apply)
    : sub_(&subscriber), options_(std::move(options)), apply_(std::move(apply)) {
  if (!apply_) pagedkv::detail::raise(Errc::kInvalidArgument, "EventStreamFollower: the apply callback is empty");
  if (options_.start_synced_at_zero) {
    synced_ = true;
    last_ = 0;
  }
}

std::optional<std::uint64_t> EventStreamFollower::last_seq() const noexcept {
  if (!synced_) return std::nullopt;
  return last_;
}

bool EventStreamFollower::apply_raw(const RawBatch& b, bool from_snapshot) {
  WireBatch w;
  try {
    w = decode_batch(b.payload);
  } catch (const pagedkv::Error&) {
    ++stats_.decode_errors;
    synced_ = false;  // the batch is lost to us: only a snapshot can restore the state
    return false;
  }
  apply_(b.seq, w, from_snapshot);
  synced_ = true;
  last_ = b.seq;
  ++stats_.applied;
  if (from_snapshot) ++stats_.snapshots;
  return true;
}

bool EventStreamFollower::apply_in_order(const std::vector<RawBatch>& batches, std::size_t first) {
  for (std::size_t i = first; i < batches.size(); ++i) {
    const RawBatch& b = batches[i];
    if (!synced_) return false;
    if (b.seq <= last_) {
      ++stats_.duplicates;
      continue;
    }
    if (b.seq != last_ + 1) return false;  // a hole in the reply (the buffer did not reach back far enough)
    if (!apply_raw(b, false)) return false;
    ++stats_.applied_replayed;
  }
  return true;
}

bool EventStreamFollower::resync_with(const RawBatch* pending) {
  const auto pending_reached = [&] { return synced_ && pending->seq <= last_ + 1; };
  bool ok = false;
  if (sub_->has_replay()) {
    if (synced_) {
      const ReplayReply r =
          sub_->request_replay(last_ + 1, options_.reply_timeout, options_.max_replay_batches, options_.idle);
      const bool contiguous = apply_in_order(r.batches, 0);
      ok = pending != nullptr ? pending_reached() : (r.complete && contiguous);
    }
    if (!ok) {
      const ReplayReply s = sub_->request_snapshot(options_.reply_timeout, options_.max_replay_batches, options_.idle);
      if (!s.batches.empty()) {
        if (apply_raw(s.batches.front(), true)) {
          const bool contiguous = apply_in_order(s.batches, 1);
          ok = pending != nullptr ? pending_reached() : (s.complete && contiguous);
        }
      } else if (s.complete) {
        // A publisher without snapshots (vLLM): restart from the oldest batch its buffer still holds. What
        // happened before that is lost to this consumer, so this counts as a failed resynchronization.
        const ReplayReply r =
            sub_->request_replay(0, options_.reply_timeout, options_.max_replay_batches, options_.idle);
        if (!r.batches.empty()) {
          synced_ = true;
          last_ = r.batches.front().seq - 1;
          (void)apply_in_order(r.batches, 0);
        }
      }
    }
  }
  if (pending != nullptr) {
    if (synced_ && pending->seq == last_ + 1) {
      if (apply_raw(*pending, false)) ++stats_.applied_live;
    } else if (synced_ && pending->seq <= last_) {
      ++stats_.duplicates;
    } else {
      ok = false;
      if (!sub_->has_replay()) {  // nothing can fill the hole: go on from this message
        synced_ = true;
        last_ = pending->seq - 1;
        if (apply_raw(*pending, false)) ++stats_.applied_live;
      }
    }
  }
  if (!ok) ++stats_.resync_failures;
  return ok;
}

void EventStreamFollower::handle_live(const RawBatch& b) {
  if (options_.drop_live && options_.drop_live(b.seq)) {
    ++stats_.dropped_on_purpose;
    return;
  }
  if (synced_) {
    if (b.seq <= last_) {
      ++stats_.duplicates;
      return;
    }
    if (b.seq == last_ + 1) {
      if (apply_raw(b, false)) ++stats_.applied_live;
      return;
    }
    ++stats_.gaps;
  }
  (void)resync_with(&b);
}

std::size_t EventStreamFollower::poll(milliseconds timeout, std::size_t max_messages) {
  const std::uint64_t before = stats_.applied;
  for (std::size_t i = 0; i < max_messages; ++i) {
    const std::optional<RawBatch> m = sub_->receive(i == 0 ? timeout : milliseconds(0));
    if (!m) break;
    handle_live(*m);
  }
  return static_cast<std::size_t>(stats_.applied - before);
}

bool EventStreamFollower::catch_up(std::uint64_t seq, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto last_activity = Clock::now();
  for (;;) {
    if (synced_ && last_ >= seq) return true;
    const milliseconds left = remaining(deadline);
    if (left.count() == 0) return false;
    if (const std::optional<RawBatch> m = sub_->receive(std::min({left, milliseconds(10), std::max(options_.quiet, milliseconds(1))}))) {
      handle_live(*m);
      last_activity = Clock::now();
      continue;
    }
    if (Clock::now() - last_activity >= options_.quiet) {
      ++stats_.gaps;
      (void)resync_with(nullptr);
      last_activity = Clock::now();
    }
  }
}

bool EventStreamFollower::resync() { return resync_with(nullptr); }

}  // namespace pagedkv::events
