// examples/pd/wire.hpp: the P/D example's control channel: small framed messages over a TCP socket on 127.0.0.1
// (the side channel vLLM's NixlConnector runs over ZMQ at remote_host:remote_port). Only control messages travel
// here (hand-shake, hand-off descriptors, claims, statistics); KV bytes move only through NIXL.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <pagedkv/external_kv.hpp>

namespace pd {

/// Message types (u32 on the wire).
enum class Msg : std::uint32_t {
  kHello = 1,       ///< prefill -> decode: engine id, host, port, pid, layout fingerprint, NIXL agent metadata.
  kHelloBack = 2,   ///< decode -> prefill: NIXL agent metadata (the hand-shake passed).
  kRefuse = 3,      ///< decode -> prefill: the hand-shake failed; payload: the reason, 1 if another hand-shake
                    ///< follows on a new connection (0: none).
  kPrefill = 4,     ///< decode -> prefill: request id (both sides generate the prompts from the seed).
  kDescriptor = 5,  ///< prefill -> decode: the hand-off descriptor (kv_transfer_params).
  kClaim = 6,       ///< decode -> prefill: hold id + the (block, generation) pairs it is about to READ.
  kClaimOk = 7,     ///< prefill -> decode: every pair is current; the lease was extended.
  kClaimStale = 8,  ///< prefill -> decode: a pair is stale (refused by generation); payload: which.
  kRelease = 9,     ///< decode -> prefill: end a lease without a READ (decode's own prefix hit covered it).
  kBye = 10,        ///< decode -> prefill: no more requests; report and exit once every lease ended.
  kStats = 11,      ///< prefill -> decode: the producer's counters (blocks used, leases...).
};

/// Appends little-endian fields to a byte buffer.
struct Writer {
  std::vector<std::byte> out;
  void u64(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
  }
  void str(std::string_view s) {
    u64(s.size());
    for (char c : s) out.push_back(static_cast<std::byte>(c));
  }
  void bytes(std::span<const std::byte> b) {
    u64(b.size());
    out.insert(out.end(), b.begin(), b.end());
  }
};

/// Reads what a Writer wrote; throws std::runtime_error on truncation.
struct Reader {
  std::span<const std::byte> in;
  std::size_t at = 0;
  std::uint64_t u64();
  std::string str();
  std::vector<std::byte> bytes();
};

void put_fingerprint(Writer& w, const pagedkv::KvLayoutFingerprint& fp);
pagedkv::KvLayoutFingerprint get_fingerprint(Reader& r);

/// The hand-off descriptor with the transfer part vLLM's kv_transfer_params carries beside remote_block_ids:
/// remote_engine_id (the producer's NIXL agent name), remote_host, remote_port (its control channel).
struct WireDescriptor {
  pagedkv::HandoffDescriptor<> desc;
  std::string remote_engine_id;
  std::string remote_host;
  std::uint64_t remote_port = 0;
};
void put_descriptor(Writer& w, const WireDescriptor& d);
WireDescriptor get_descriptor(Reader& r);

/// A connected TCP socket carrying framed messages (u32 type, u64 length, payload).
class Channel {
 public:
  Channel() = default;
  explicit Channel(int fd) : fd_(fd) {}
  ~Channel();
  Channel(Channel&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Channel& operator=(Channel&&) = delete;
  /// Listens on 127.0.0.1:port (0: any free port); returns the listening fd and writes the port.
  static int listen_loopback(std::uint16_t port, std::uint16_t* bound);
  /// Accepts one connection on `listen_fd` (blocking up to timeout_ms); throws on timeout.
  static Channel accept_one(int listen_fd, int timeout_ms);
  /// Connects to 127.0.0.1:port, retrying up to timeout_ms; throws on failure.
  static Channel connect_loopback(std::uint16_t port, int timeout_ms);
  /// Sends one message; false when the peer is gone.
  bool send(Msg type, std::span<const std::byte> payload = {});
  /// Waits up to timeout_ms for one message. nullopt on timeout; throws std::runtime_error when the peer closed.
  std::optional<std::pair<Msg, std::vector<std::byte>>> recv(int timeout_ms);
  [[nodiscard]] int fd() const noexcept { return fd_; }

 private:
  int fd_ = -1;
  std::vector<std::byte> buf_;  // bytes received but not yet framed
};

}  // namespace pd
