// ZmqPublisher on the wire, seen through raw ZeroMQ sockets as vLLM's clients see it: the 3-frame messages, the
// ROUTER replay protocol ([identity, "", start] -> [identity, "", seq, payload]..., end marker), the bounded replay
// buffer, the snapshot extension, and the errors. Loopback only; every port is chosen by the system.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <pagedkv/events_zmq/publisher.hpp>
#include <pagedkv/events_zmq/subscriber.hpp>

namespace {

namespace ev = pagedkv::events;
using std::chrono::milliseconds;

std::vector<std::uint8_t> be64(std::uint64_t v) {
  std::vector<std::uint8_t> b(8);
  for (int i = 7; i >= 0; --i) {
    b[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(v & 0xff);
    v >>= 8;
  }
  return b;
}

std::uint64_t from_be64(const zmq::message_t& m) {
  REQUIRE(m.size() == 8);
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<const std::uint8_t*>(m.data())[i];
  return v;
}

std::vector<std::byte> bytes_of(const zmq::message_t& m) {
  const auto* p = static_cast<const std::byte*>(m.data());
  return {p, p + m.size()};
}

/// A batch with `n` removals (its payload grows with n), numbered `seq`.
pagedkv::KVEventBatch batch_of(std::uint64_t seq, int n = 1) {
  pagedkv::KVEventBatch b;
  b.seq_no = seq;
  b.ts = 100.0 + static_cast<double>(seq);
  for (int i = 0; i < n; ++i) {
    pagedkv::KVEvent e;
    e.type = pagedkv::KVEventType::kBlockRemoved;
    e.hash.bytes[0] = static_cast<std::uint8_t>(seq);
    e.hash.bytes[15] = static_cast<std::uint8_t>(i);
    b.events.push_back(e);
  }
  return b;
}

/// A DEALER client of the replay socket, sending vLLM's request ["", body] and collecting ["", seq, payload]
/// replies until the end marker, while `pub` (same thread) serves. Bounded: 2 s.
struct ReplayClient {
  zmq::socket_t s;
  ReplayClient(zmq::context_t& ctx, const std::string& ep) : s(ctx, zmq::socket_type::dealer) {
    s.set(zmq::sockopt::linger, 0);
    s.connect(ep);
  }
  void send(const std::vector<std::uint8_t>& body) {
    s.send(zmq::message_t(), zmq::send_flags::sndmore);
    s.send(zmq::buffer(body), zmq::send_flags::none);
  }
  /// (seq, payload) pairs received before the end marker; nullopt if no end marker came within the bound.
  std::optional<std::vector<std::pair<std::uint64_t, std::vector<std::byte>>>> collect(ev::ZmqPublisher& pub) {
    std::vector<std::pair<std::uint64_t, std::vector<std::byte>>> got;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (std::chrono::steady_clock::now() < deadline) {
      pub.service_requests(milliseconds(1));
      std::vector<zmq::message_t> f;
      if (!zmq::recv_multipart(s, std::back_inserter(f), zmq::recv_flags::dontwait)) continue;
      REQUIRE(f.size() == 3);
      CHECK(f[0].size() == 0);  // the empty delimiter
      const std::uint64_t seq = from_be64(f[1]);
      if (seq == ev::kEndOfReplaySeq) {
        CHECK(f[2].size() == 0);  // end marker: [-1, ""]
        return got;
      }
      got.emplace_back(seq, bytes_of(f[2]));
    }
    return std::nullopt;
  }
};

std::vector<std::uint64_t> seqs(const std::vector<std::pair<std::uint64_t, std::vector<std::byte>>>& v) {
  std::vector<std::uint64_t> out;
  for (const auto& [s, p] : v) out.push_back(s);
  return out;
}

}  // namespace

TEST_CASE("each batch is one message [topic, 8-byte big-endian number, msgpack payload]",
          "[events_zmq][publisher][frames]") {
  ev::PublisherOptions o;
  o.topic = "kv-events";
  ev::ZmqPublisher pub(o);
  REQUIRE(pub.endpoint().rfind("tcp://127.0.0.1:", 0) == 0);
  zmq::context_t ctx(1);
  zmq::socket_t sub(ctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::linger, 0);
  sub.set(zmq::sockopt::subscribe, "kv-events");
  sub.connect(pub.endpoint());
  // A subscription takes a moment to reach the publisher (ZeroMQ's slow joiner): publish until one arrives.
  std::optional<std::vector<zmq::message_t>> frames;
  std::uint64_t seq = 0x0102030405ULL;
  for (int i = 0; i < 400 && !frames; ++i) {
    pub.publish(batch_of(++seq));
    zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
    if (zmq::poll(&item, 1, milliseconds(10)) > 0) {
      std::vector<zmq::message_t> f;
      REQUIRE(zmq::recv_multipart(sub, std::back_inserter(f)));
      frames = std::move(f);
    }
  }
  REQUIRE(frames);
  REQUIRE(frames->size() == 3);
  CHECK((*frames)[0].to_string() == "kv-events");
  const std::uint64_t got = from_be64((*frames)[1]);
  CHECK(got > 0x0102030405ULL);
  CHECK(got <= seq);
  CHECK(bytes_of((*frames)[2]) == ev::encode_batch(batch_of(got)));
  CHECK(pub.last_seq() == std::optional<std::uint64_t>(seq));
}

TEST_CASE("replay: buffered batches from the start number, then the end marker - the buffer is bounded",
          "[events_zmq][publisher][replay]") {
  ev::PublisherOptions o;
  o.replay_endpoint = "tcp://127.0.0.1:*";
  o.replay_buffer_batches = 5;
  ev::ZmqPublisher pub(o);
  REQUIRE(!pub.replay_endpoint().empty());
  REQUIRE(pub.replay_endpoint() != pub.endpoint());
  for (std::uint64_t s = 1; s <= 8; ++s) pub.publish(batch_of(s));
  zmq::context_t ctx(1);
  ReplayClient c(ctx, pub.replay_endpoint());

  c.send(be64(4));
  auto r = c.collect(pub);
  REQUIRE(r);
  CHECK(seqs(*r) == std::vector<std::uint64_t>{4, 5, 6, 7, 8});
  CHECK((*r)[0].second == ev::encode_batch(batch_of(4)));  // byte-identical to what was published

  c.send(be64(1));  // older than the buffer reaches: what is left
  r = c.collect(pub);
  REQUIRE(r);
  CHECK(seqs(*r) == std::vector<std::uint64_t>{4, 5, 6, 7, 8});

  c.send(be64(9));  // nothing yet: the end marker alone
  r = c.collect(pub);
  REQUIRE(r);
  CHECK(r->empty());
  CHECK(pub.stats().replay_requests == 3);

  // A REQ client (vLLM's kv_events_subscriber example) gets the same framing; with nothing to replay the end
  // marker is its one reply.
  zmq::socket_t req(ctx, zmq::socket_type::req);
  req.set(zmq::sockopt::linger, 0);
  req.connect(pub.replay_endpoint());
  const auto body = be64(100);
  req.send(zmq::buffer(body), zmq::send_flags::none);
  std::vector<zmq::message_t> f;
  for (int i = 0; i < 200 && f.empty(); ++i) {
    pub.service_requests(milliseconds(5));
    (void)zmq::recv_multipart(req, std::back_inserter(f), zmq::recv_flags::dontwait);
  }
  REQUIRE(f.size() == 2);
  CHECK(from_be64(f[0]) == ev::kEndOfReplaySeq);
  CHECK(f[1].size() == 0);
}

TEST_CASE("replay buffer bounded by bytes: the oldest batches go first", "[events_zmq][publisher][replay]") {
  ev::PublisherOptions o;
  o.replay_endpoint = "tcp://127.0.0.1:*";
  const std::size_t one = ev::encode_batch(batch_of(1, 20)).size();
  o.replay_buffer_bytes = 3 * one + one / 2;  // room for three batches of this size
  ev::ZmqPublisher pub(o);
  for (std::uint64_t s = 1; s <= 10; ++s) CHECK(pub.publish(batch_of(s, 20)) == one);
  zmq::context_t ctx(1);
  ReplayClient c(ctx, pub.replay_endpoint());
  c.send(be64(0));
  const auto r = c.collect(pub);
  REQUIRE(r);
  CHECK(seqs(*r) == std::vector<std::uint64_t>{8, 9, 10});
}

TEST_CASE("snapshot requests: the snapshot numbered with its last batch, then later batches - none without a source",
          "[events_zmq][publisher][snapshot]") {
  ev::PublisherOptions o;
  o.replay_endpoint = "tcp://127.0.0.1:*";
  ev::ZmqPublisher pub(o);
  for (std::uint64_t s = 1; s <= 4; ++s) pub.publish(batch_of(s));
  zmq::context_t ctx(1);
  ReplayClient c(ctx, pub.replay_endpoint());
  const std::vector<std::uint8_t> body(ev::kSnapshotRequest.begin(), ev::kSnapshotRequest.end());

  c.send(body);  // no source: end marker only (what a vLLM publisher answers, too)
  auto r = c.collect(pub);
  REQUIRE(r);
  CHECK(r->empty());

  pagedkv::KVEventSnapshot snap;
  snap.seq_no = 2;  // the snapshot covers batches 1 and 2; 3 and 4 follow it
  pagedkv::KVEvent e;
  e.type = pagedkv::KVEventType::kBlockStored;
  e.block_size = 2;
  e.token_ids = {1, 2};
  snap.stored = {e};
  int calls = 0;
  pub.set_snapshot_source([&] {
    ++calls;
    return snap;
  });
  c.send(body);
  r = c.collect(pub);
  REQUIRE(r);
  CHECK(calls == 1);
  CHECK(seqs(*r) == std::vector<std::uint64_t>{2, 3, 4});
  CHECK((*r)[0].second == ev::encode_snapshot(snap, 104.0));  // stamped with the last batch's time
  CHECK(pub.stats().snapshot_requests == 1);
}

TEST_CASE("requests without the empty delimiter are ignored - a subscriber's timed-out request does not leak into "
          "the next one", "[events_zmq][publisher][replay]") {
  ev::PublisherOptions o;
  o.replay_endpoint = "tcp://127.0.0.1:*";
  ev::ZmqPublisher pub(o);
  for (std::uint64_t s = 1; s <= 3; ++s) pub.publish(batch_of(s));
  zmq::context_t ctx(1);
  zmq::socket_t d(ctx, zmq::socket_type::dealer);
  d.set(zmq::sockopt::linger, 0);
  d.connect(pub.replay_endpoint());
  const auto body = be64(1);
  d.send(zmq::buffer(body), zmq::send_flags::none);  // [body] alone: the ROUTER sees [identity, body]
  for (int i = 0; i < 100 && pub.stats().bad_requests == 0; ++i) pub.service_requests(milliseconds(5));
  CHECK(pub.stats().bad_requests == 1);
  std::vector<zmq::message_t> f;
  CHECK_FALSE(zmq::recv_multipart(d, std::back_inserter(f), zmq::recv_flags::dontwait));

  ev::ZmqSubscriber sub({pub.endpoint(), pub.replay_endpoint(), "", 1000});
  // Nobody serves the publisher during this request: it times out.
  const ev::ReplayReply late = sub.request_replay(1, milliseconds(30));
  CHECK_FALSE(late.complete);
  CHECK(sub.stats().timeouts == 1);
  pub.service_requests(milliseconds(20));  // answers the stale request to a socket that no longer exists
  const ev::ReplayReply r = sub.request_replay(2, milliseconds(2000), 1000, [&] { pub.service_requests(); });
  REQUIRE(r.complete);
  REQUIRE(r.batches.size() == 2);  // 2 and 3 only: nothing of the stale answer (1, 2, 3)
  CHECK(r.batches[0].seq == 2);
  CHECK(r.batches[1].seq == 3);
}

TEST_CASE("topics filter by prefix", "[events_zmq][publisher][subscriber]") {
  ev::PublisherOptions o;
  o.topic = "kv-events";
  ev::ZmqPublisher pub(o);
  ev::ZmqSubscriber mine({pub.endpoint(), "", "kv", 1000});
  ev::ZmqSubscriber other({pub.endpoint(), "", "other", 1000});
  std::optional<ev::RawBatch> got;
  std::uint64_t seq = 0;
  for (int i = 0; i < 400 && !got; ++i) {
    pub.publish(batch_of(++seq));
    got = mine.receive(milliseconds(10));
  }
  REQUIRE(got);
  CHECK(ev::decode_batch(got->payload).events.size() == 1);
  for (int i = 0; i < 5; ++i) pub.publish(batch_of(++seq));
  CHECK_FALSE(other.receive(milliseconds(100)));
  CHECK(other.stats().messages == 0);
}

TEST_CASE("publisher errors name the value and change nothing", "[events_zmq][publisher][errors]") {
  ev::ZmqPublisher pub(ev::PublisherOptions{});
  pub.publish(batch_of(5));
  try {
    pub.publish(batch_of(5));
    FAIL("published a repeated number");
  } catch (const pagedkv::Error& e) {
    CHECK(e.code() == pagedkv::Errc::kInvalidArgument);
    CHECK_THAT(e.message(), Catch::Contains("batch 5 is not above the last one published (5)"));
  }
  CHECK(pub.last_seq() == std::optional<std::uint64_t>(5));
  CHECK(pub.stats().batches == 1);

  ev::PublisherOptions same;
  same.endpoint = pub.endpoint();  // already bound by `pub`
  CHECK_THROWS_WITH(ev::ZmqPublisher(same), Catch::Contains("cannot bind the PUB endpoint '" + pub.endpoint() + "'"));
  ev::PublisherOptions malformed;
  malformed.endpoint = "tcp://no-port";
  CHECK_THROWS_WITH(ev::ZmqPublisher(malformed), Catch::Contains("'tcp://no-port'"));
  ev::PublisherOptions no_buffer;
  no_buffer.replay_endpoint = "tcp://127.0.0.1:*";
  no_buffer.replay_buffer_batches = 0;
  CHECK_THROWS_WITH(ev::ZmqPublisher(no_buffer), Catch::Contains("replay_buffer_batches"));
  CHECK_THROWS_WITH(ev::ZmqSubscriber({"nonsense://x", "", "", 1000}), Catch::Contains("'nonsense://x'"));

  pub.shutdown();
  pub.shutdown();  // idempotent
  CHECK_THROWS_WITH(pub.publish(batch_of(6)), Catch::Contains("shut down"));
}
