// pagedkv/events_zmq/publisher.hpp: publishes KV event batches over ZeroMQ exactly as vLLM's ZmqEventPublisher
// does (PUB socket, multipart [topic, 8-byte big-endian sequence number, msgpack payload]; ROUTER replay socket),
// so KV-aware routers that consume vLLM's stream (NVIDIA Dynamo's KV router, llm-d) consume pagedkv's unchanged.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pagedkv/event_log.hpp>
#include <pagedkv/events.hpp>
#include <pagedkv/events_zmq/export.hpp>
#include <pagedkv/events_zmq/topic.hpp>
#include <pagedkv/events_zmq/wire.hpp>

namespace pagedkv::events {

/// The replay request that asks for a snapshot instead of a sequence number (a pagedkv extension; 16 bytes, so a
/// vLLM publisher, which reads any request body as a big-endian start number, answers it with its end marker only).
inline constexpr std::string_view kSnapshotRequest = "pagedkv.snapshot";

/// The end-of-replay marker's sequence frame: -1 as 8 big-endian bytes (vLLM's END_SEQ), sent with an empty payload.
inline constexpr std::uint64_t kEndOfReplaySeq = ~std::uint64_t{0};

/// Configuration of a ZmqPublisher. Defaults follow vLLM's KVEventsConfig where it has one.
struct PublisherOptions {
  /// PUB endpoint. Bound by default: "tcp://127.0.0.1:*" binds a free port and `ZmqPublisher::endpoint()` returns
  /// the bound one; vLLM's default is tcp://*:5557. With `mode = kConnect`, the router's SUB endpoint to connect to
  /// (no '*'), e.g. "tcp://router:5557".
  std::string endpoint = "tcp://127.0.0.1:*";
  /// Bind (default) or connect the PUB endpoint. vLLM binds when its endpoint contains '*' and connects otherwise;
  /// pagedkv makes it explicit. The replay socket is always bound (replay needs a stable address).
  SocketMode mode = SocketMode::kBind;
  /// ROUTER endpoint for replay and snapshot requests, bound; empty = no replay socket. vLLM: replay_endpoint
  /// (commonly port 5558).
  std::string replay_endpoint;
  /// First frame of every message (vLLM's `topic`); subscribers filter by prefix. When empty and `model_name` is
  /// set, the publisher uses llm-d's form "kv@<pod_id>@<model_name>" (events_zmq/topic.hpp), which llm-d's
  /// subscribers require (they subscribe to "kv@" and read the pod and model from the topic). Empty with no model
  /// name: "" (vLLM's default; matches every subscription except llm-d's).
  std::string topic;
  /// The engine's model name (as the router knows it, e.g. "Qwen/Qwen3-32B"), for the default topic. No '@'.
  std::string model_name;
  /// The pod (instance) id for the default topic; empty = this host's name (gethostname), or the endpoint when the
  /// host has none. No '@'.
  std::string pod_id;
  /// Batches kept for replay (vLLM's buffer_steps, default 10000), and a byte bound on them (oldest dropped first).
  std::size_t replay_buffer_batches = 10000;
  std::size_t replay_buffer_bytes = std::size_t{256} << 20;
  /// ZeroMQ send high-water mark of the PUB socket, in messages per subscriber (vLLM's hwm, default 100000): a
  /// subscriber that falls this far behind loses messages (it notices the gap and replays); publishing never blocks.
  int send_hwm = 100000;
  /// How long closing waits to flush queued messages, in ms (bounded; 0 = drop them).
  int linger_ms = 250;
  /// Payload encoding (layout, hash format, data-parallel rank).
  EncodeOptions encoding;
};

/// Counters of a ZmqPublisher.
struct PublisherStats {
  std::uint64_t batches = 0;            ///< Batches published.
  std::uint64_t bytes = 0;              ///< Payload bytes published.
  std::uint64_t replay_requests = 0;    ///< Sequence-number replay requests answered.
  std::uint64_t snapshot_requests = 0;  ///< Snapshot requests answered.
  std::uint64_t replayed_batches = 0;   ///< Batches re-sent by replies (snapshots included).
  std::uint64_t bad_requests = 0;       ///< Requests that were not [identity, "", body] (ignored).
};

/// Publishes KV event batches on a ZeroMQ PUB socket in vLLM's wire format and answers replay requests.
///
/// Wire (vllm/distributed/kv_events.py ZmqEventPublisher; docs/events-wire.md):
///  - each batch is one multipart message [topic, seq (8 bytes, big-endian), payload (encode_batch)], where seq is
///    the batch's own number (`KVEventBatch::seq_no`, 1, 2, 3, ... from the manager; vLLM numbers from 0);
///  - the replay socket (ROUTER) takes [identity, "", start (8 bytes, big-endian)] (a REQ or DEALER client) and
///    answers [identity, "", seq, payload] for every buffered batch with seq >= start, then the end marker
///    [identity, "", ff ff ff ff ff ff ff ff, ""];
///  - extension: the body "pagedkv.snapshot" is answered with the snapshot (encode_snapshot: AllBlocksCleared, then
///    a BlockStored per cached block) numbered with the last batch it includes, then every buffered batch after
///    it, then the end marker. Without a snapshot source only the end marker is sent.
///
/// No background thread of its own: `publish` sends and then answers pending requests, and `service_requests`
/// answers them between steps (libzmq's I/O thread, owned by the publisher's context, is joined at shutdown).
/// Call it from the engine's scheduler thread, once per step, after `take_event_batch`.
/// Thread safety: none; one thread uses a publisher. Memory: the replay buffer (bounded by both limits).
/// Errors: pagedkv::Error kInvalidArgument for a bad endpoint (naming it and ZeroMQ's reason) or option, a batch
/// number not above the last one, or an unencodable batch (see encode_batch); the publisher is unchanged then.
/// Move: movable, not copyable; a moved-from publisher may only be destroyed or assigned to.
class PAGEDKV_EVENTS_ZMQ_API ZmqPublisher {
 public:
  /// Binds (or connects) the sockets. Throws pagedkv::Error kInvalidArgument naming the endpoint when binding or
  /// connecting fails (address in use, malformed; connecting to an absent peer is not an error, ZeroMQ retries in
  /// the background) or an option is out of range (replay_buffer_batches == 0 with a replay endpoint, hwm < 0, a
  /// pod id or model name containing '@').
  explicit ZmqPublisher(PublisherOptions options);
  ~ZmqPublisher();
  ZmqPublisher(const ZmqPublisher&) = delete;
  ZmqPublisher& operator=(const ZmqPublisher&) = delete;
  ZmqPublisher(ZmqPublisher&&) noexcept;
  ZmqPublisher& operator=(ZmqPublisher&&) noexcept;

  /// The bound PUB endpoint (the port resolved when the option asked for "*"), e.g. "tcp://127.0.0.1:40123"; in
  /// connect mode the endpoint connected to.
  [[nodiscard]] const std::string& endpoint() const noexcept;
  /// The topic every message carries (the option, or the llm-d default built from pod id and model name).
  [[nodiscard]] const std::string& topic() const noexcept;
  /// The bound replay endpoint, or "" without a replay socket.
  [[nodiscard]] const std::string& replay_endpoint() const noexcept;

  /// Publish `batch` as message number `batch.seq_no` (which must exceed every number published before), keep it
  /// for replay, then answer pending replay requests. Returns the payload size in bytes. Never blocks on slow
  /// subscribers (PUB drops past the high-water mark). Throws kInvalidArgument for a number not above the last or
  /// an unencodable batch, before sending anything; after shutdown().
  std::size_t publish(const KVEventBatch& batch);

  /// Publish an already encoded payload as message number `seq` (same rules as `publish`).
  std::size_t publish_payload(std::uint64_t seq, std::vector<std::byte> payload);

  /// The snapshot source for "pagedkv.snapshot" requests, typically `[&] { return manager.event_snapshot(); }`.
  /// It is called on this publisher's thread, inside publish / service_requests, so it may read the manager.
  void set_snapshot_source(std::function<KVEventSnapshot()> source);

  /// Answer replay and snapshot requests, waiting up to `wait` for the first one (0: only those already queued).
  /// Answers at most 64 requests per call. Returns how many were answered.
  std::size_t service_requests(std::chrono::milliseconds wait = std::chrono::milliseconds(0));

  /// The replay socket's libzmq handle (`void*` for zmq_poll), for engines that wait on their own sockets and this
  /// one together; readable means a request is waiting (then call service_requests). nullptr without a replay
  /// socket. Never read from or write to it directly.
  [[nodiscard]] void* native_replay_socket() const noexcept;

  /// The number of the last batch published (nullopt before the first).
  [[nodiscard]] std::optional<std::uint64_t> last_seq() const noexcept;

  /// Counters.
  [[nodiscard]] const PublisherStats& stats() const noexcept;

  /// Close the sockets (waiting at most linger_ms to flush) and the context. Idempotent; the destructor calls it.
  void shutdown() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedkv::events
