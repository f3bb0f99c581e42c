// examples/router/protocol.hpp: the control channel between the router and its engine processes (ZeroMQ ROUTER
// on the router, DEALER with routing id "engine-<i>" in each engine, on 127.0.0.1). The KV events themselves go
// over each engine's pagedkv::events::ZmqPublisher, in vLLM's format; this channel only carries requests.
//
// Every message is [kind (1 byte), header (a trivially copyable struct, host byte order: both ends run on one
// machine), optional payload frames].
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <zmq.hpp>

namespace router {

/// The model name every engine reports in its event topic, kv@<pod-id>@<model> (llm-d's form).
inline constexpr const char* kModelName = "pagedkv/router-example";

/// An engine's id: its control socket's routing id and the pod id in its event topic.
inline std::string engine_id(std::size_t i) { return "engine-" + std::to_string(i); }

/// First frame of a control message.
enum class Msg : char {
  kHello = 'H',    ///< engine -> router: [H, Hello, pub endpoint, replay endpoint], once after binding.
  kRequest = 'R',  ///< router -> engine: [R, Request, token ids (int32 x num_tokens)].
  kDone = 'D',     ///< engine -> router: [D, Done] after the request's step was published.
  kQuit = 'Q',     ///< router -> engine: [Q]; the engine answers Bye, shuts its publisher down and exits.
  kBye = 'B',      ///< engine -> router: [B, Bye].
};

struct Hello {
  std::uint32_t instance = 0;
};

struct Request {
  std::uint64_t id = 0;         ///< Trace index (the engine's sequence id).
  double arrival_s = 0.0;       ///< Simulated arrival time (the batch timestamp).
  std::uint32_t num_tokens = 0; ///< Prompt length; the token frame holds num_tokens int32.
};

struct Done {
  std::uint64_t id = 0;
  std::uint64_t cached_tokens = 0;  ///< Prompt tokens the engine's prefix cache served (0 if not admitted).
  std::uint64_t last_seq = 0;       ///< Number of the last event batch published (0: none yet).
  std::uint64_t manager_ns = 0;     ///< Time inside the manager for this request (admit + build + free).
  std::uint8_t admitted = 0;        ///< 0: the prompt needs more blocks than the whole pool.
};

struct Bye {
  std::uint64_t batches = 0;          ///< Event batches published.
  std::uint64_t bytes = 0;            ///< Payload bytes published.
  std::uint64_t replay_requests = 0;  ///< Replay requests answered.
  std::uint64_t snapshot_requests = 0;
  std::uint64_t evictions = 0;
  double manager_seconds = 0.0;
};

/// A struct as one frame.
template <class T>
zmq::message_t frame(const T& v) {
  static_assert(std::is_trivially_copyable_v<T>, "control headers are sent as raw bytes");
  return zmq::message_t(&v, sizeof v);
}

/// A frame as a struct. Throws std::runtime_error naming `what` when the size is wrong.
template <class T>
T unframe(const zmq::message_t& m, const char* what) {
  static_assert(std::is_trivially_copyable_v<T>, "control headers are sent as raw bytes");
  if (m.size() != sizeof(T)) {
    throw std::runtime_error(std::string("control message ") + what + ": frame of " + std::to_string(m.size()) +
                             " bytes, expected " + std::to_string(sizeof(T)));
  }
  T v;
  std::memcpy(&v, m.data(), sizeof v);
  return v;
}

/// The kind byte of a message's first frame (0 when it is not one byte).
inline char kind_of(const zmq::message_t& m) { return m.size() == 1 ? *static_cast<const char*>(m.data()) : 0; }

inline zmq::message_t kind(Msg k) {
  const char c = static_cast<char>(k);
  return zmq::message_t(&c, 1);
}

}  // namespace router
