// pagedkv/events_zmq/subscriber.hpp: the consuming side of a vLLM-format KV event stream (a router's): a ZeroMQ
// subscriber with the replay and snapshot requests, and a follower that applies batches in sequence order and
// resynchronizes after a gap.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <pagedkv/events_zmq/export.hpp>
#include <pagedkv/events_zmq/topic.hpp>
#include <pagedkv/events_zmq/wire.hpp>

namespace pagedkv::events {

/// Configuration of a ZmqSubscriber.
struct SubscriberOptions {
  std::string endpoint;         ///< The publisher's PUB endpoint (connected), e.g. "tcp://127.0.0.1:5557"; with
                                ///< `mode = kBind`, the endpoint engines connect to ("tcp://127.0.0.1:*": a free port).
  std::string replay_endpoint;  ///< Its replay (ROUTER) endpoint; empty = no replay or snapshot requests.
  std::string topic;            ///< Subscription prefix ("" = every topic).
  int receive_hwm = 100000;     ///< ZeroMQ receive high-water mark, in messages.
  /// kBind: llm-d's centralized mode (the router's SUB binds `endpoint`, engines' publishers connect with
  /// SocketMode::kConnect; their messages interleave, so use RawBatch::topic, not an EventStreamFollower).
  SocketMode mode = SocketMode::kConnect;
};

/// One message as received: the sequence number, the msgpack payload (decode it with decode_batch) and the topic.
struct RawBatch {
  std::uint64_t seq = 0;
  std::vector<std::byte> payload;
  std::string topic;  ///< The topic frame (tells engines apart on a bound, centralized socket; see parse_llmd_topic).
};

/// The answer to a replay or snapshot request.
struct ReplayReply {
  std::vector<RawBatch> batches;  ///< In the order received (ascending sequence numbers from a publisher).
  bool complete = false;          ///< The end marker arrived (false: timed out or hit the batch limit).
};

/// Counters of a ZmqSubscriber.
struct SubscriberStats {
  std::uint64_t messages = 0;        ///< Live messages received.
  std::uint64_t bytes = 0;           ///< Live payload bytes received.
  std::uint64_t malformed = 0;       ///< Live messages that were not [topic, 8-byte seq, payload] (skipped).
  std::uint64_t replay_requests = 0;
  std::uint64_t snapshot_requests = 0;
  std::uint64_t timeouts = 0;        ///< Requests that ended without the end marker.
};

/// A SUB socket on a publisher's stream plus a DEALER socket for its replay endpoint (vLLM's kv_events_subscriber
/// uses REQ; DEALER takes the many-part answer a REQ socket cannot). Every call is bounded by its timeout.
/// Thread safety: none; one thread uses a subscriber. Errors: pagedkv::Error kInvalidArgument for a malformed
/// endpoint (connecting to an absent publisher is not an error: ZeroMQ reconnects in the background).
/// Resources: its own ZeroMQ context (one I/O thread, joined on destruction). Move: movable, not copyable; a
/// moved-from subscriber may only be destroyed or assigned to.
class PAGEDKV_EVENTS_ZMQ_API ZmqSubscriber {
 public:
  explicit ZmqSubscriber(SubscriberOptions options);
  ~ZmqSubscriber();
  ZmqSubscriber(const ZmqSubscriber&) = delete;
  ZmqSubscriber& operator=(const ZmqSubscriber&) = delete;
  ZmqSubscriber(ZmqSubscriber&&) noexcept;
  ZmqSubscriber& operator=(ZmqSubscriber&&) noexcept;

  /// The next live message, waiting up to `timeout`; nullopt when none arrived. Malformed messages are counted
  /// and skipped (within the same wait).
  [[nodiscard]] std::optional<RawBatch> receive(std::chrono::milliseconds timeout);

  /// Ask the replay socket for every buffered batch numbered `from_seq` or more; collect the answer until the end
  /// marker, `timeout` or `max_batches`. `idle` (optional) is called whenever nothing arrived for a few ms, so a
  /// single-threaded program can serve its own publisher meanwhile. A request that did not complete resets the
  /// replay socket, so late answers never mix into the next request. Without a replay endpoint: empty, incomplete.
  [[nodiscard]] ReplayReply request_replay(std::uint64_t from_seq, std::chrono::milliseconds timeout,
                                           std::size_t max_batches = 1000000,
                                           const std::function<void()>& idle = {});

  /// Ask for a snapshot ("pagedkv.snapshot"): the first batch of a complete reply is the snapshot (numbered with
  /// the last batch it covers), the rest are the buffered batches after it. A publisher without snapshots (vLLM)
  /// answers with the end marker only: complete and empty. Bounds and `idle` as request_replay.
  [[nodiscard]] ReplayReply request_snapshot(std::chrono::milliseconds timeout, std::size_t max_batches = 1000000,
                                             const std::function<void()>& idle = {});

  /// The SUB endpoint: the one connected to, or in bind mode the bound one (port resolved), e.g.
  /// "tcp://127.0.0.1:40123".
  [[nodiscard]] const std::string& endpoint() const noexcept;

  /// Whether a replay endpoint was configured.
  [[nodiscard]] bool has_replay() const noexcept;

  [[nodiscard]] const SubscriberStats& stats() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Options of an EventStreamFollower.
struct FollowerOptions {
  /// The stream is known to start from an empty cache at number 0 (the consumer watched the engine start, as
  /// examples/router does): batch 1 needs no snapshot. Otherwise the first message triggers a snapshot request.
  bool start_synced_at_zero = false;
  std::chrono::milliseconds reply_timeout{2000};  ///< Bound of each replay / snapshot request.
  /// catch_up: this long without any live message while the awaited number is missing means it was lost, and a
  /// replay is requested. Shorter finds losses sooner; a late message is then a harmless duplicate.
  std::chrono::milliseconds quiet{50};
  std::size_t max_replay_batches = 1000000;       ///< Bound of the batches one reply may carry.
  std::function<void()> idle;                     ///< Passed to the requests (see request_replay).
  /// Fault injection for tests: a live message whose number this returns true for is dropped unseen.
  std::function<bool(std::uint64_t seq)> drop_live;
};

/// Counters of an EventStreamFollower.
struct FollowerStats {
  std::uint64_t applied = 0;           ///< Batches handed to the callback (snapshots included).
  std::uint64_t applied_live = 0;      ///< ... of which received live.
  std::uint64_t applied_replayed = 0;  ///< ... of which came from replay replies.
  std::uint64_t snapshots = 0;         ///< Snapshots applied.
  std::uint64_t gaps = 0;              ///< Times a number was missing (a live message skipped ahead, or catch_up starved).
  std::uint64_t duplicates = 0;        ///< Messages at or below the last applied number (ignored).
  std::uint64_t dropped_on_purpose = 0;  ///< drop_live hits.
  std::uint64_t decode_errors = 0;     ///< Payloads decode_batch rejected (the follower then resynchronizes).
  std::uint64_t resync_failures = 0;   ///< Resynchronizations that could not restore an unbroken sequence.
};

/// Applies a publisher's batches to a consumer in sequence order, exactly once each, recovering from gaps: replay
/// from the last applied number + 1, and when the replay buffer no longer reaches back that far (or the follower
/// has no state yet), the snapshot then the batches after it. This is what a KV-aware router needs per engine.
/// The callback receives (seq, decoded batch, from_snapshot); a snapshot batch starts with AllBlocksCleared, so
/// applying it to any previous state yields the snapshot state. Every call is bounded by its timeout.
/// Thread safety: none (uses its ZmqSubscriber, which must outlive it, from one thread).
class PAGEDKV_EVENTS_ZMQ_API EventStreamFollower {
 public:
  using Apply = std::function<void(std::uint64_t seq, const WireBatch& batch, bool from_snapshot)>;

  EventStreamFollower(ZmqSubscriber& subscriber, FollowerOptions options, Apply apply);

  /// Receive live messages for up to `timeout` (after the first, only those already queued), at most
  /// `max_messages`, applying them and resynchronizing after gaps. Returns the batches applied.
  std::size_t poll(std::chrono::milliseconds timeout, std::size_t max_messages = 1024);

  /// Apply batches until batch `seq` has been applied, within `timeout`: live messages first; when the stream goes
  /// quiet below `seq` (the message was lost), replay. Returns whether `seq` was reached.
  bool catch_up(std::uint64_t seq, std::chrono::milliseconds timeout);

  /// Resynchronize now (replay from the last number + 1, else snapshot). Returns whether the sequence is unbroken.
  bool resync();

  /// The number of the last batch applied; nullopt while the follower has no state.
  [[nodiscard]] std::optional<std::uint64_t> last_seq() const noexcept;

  [[nodiscard]] const FollowerStats& stats() const noexcept { return stats_; }

 private:
  bool apply_raw(const RawBatch& b, bool from_snapshot);
  bool apply_in_order(const std::vector<RawBatch>& batches, std::size_t first);
  bool resync_with(const RawBatch* pending);
  void handle_live(const RawBatch& b);

  ZmqSubscriber* sub_;
  FollowerOptions options_;
  Apply apply_;
  bool synced_ = false;
  std::uint64_t last_ = 0;
  FollowerStats stats_;
};

}  // namespace pagedkv::events
