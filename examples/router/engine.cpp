// examples/router/engine.cpp: an engine instance: one KVCacheManager serving the router's requests, publishing its
// KV events (vLLM format) and answering replay / snapshot requests between requests.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include <zmq.hpp>
#include <zmq_addon.hpp>

#include <pagedkv/events_zmq/publisher.hpp>
#include <pagedkv/kv_cache_manager.hpp>

#include "fleet.hpp"
#include "protocol.hpp"

namespace router {

int run_engine(const EngineArgs& a) {
  using Clock = std::chrono::steady_clock;
  const pid_t parent = getppid();
  const double usable = std::floor(a.capacity_tokens / a.block_size);
  if (!(usable >= 1) || usable > 2e9) {
    std::fprintf(stderr, "engine %u: capacity %.0f tokens gives %.0f blocks of %u (1..2e9 supported)\n", a.instance,
                 a.capacity_tokens, usable, a.block_size);
    return 2;
  }
  pagedkv::CacheConfig config;
  config.num_blocks = static_cast<std::size_t>(usable) + 1;  // + the null block
  config.block_size = a.block_size;
  config.hash_seed = a.hash_seed;
  config.max_tokens_per_seq = a.max_prompt_tokens;
  config.enable_events = true;
  pagedkv::KVCacheManager<pagedkv::Sha256Hasher> manager(config);

  pagedkv::events::PublisherOptions po;
  po.endpoint = "tcp://127.0.0.1:*";
  po.replay_endpoint = "tcp://127.0.0.1:*";
  // llm-d's topic form, kv@<pod-id>@<model> (events_zmq/topic.hpp): the router subscribes by the prefix "kv@".
  po.pod_id = engine_id(a.instance);
  po.model_name = kModelName;
  po.linger_ms = 1000;
  po.encoding.layout = a.layout;
  po.encoding.hash_format = a.hashes;
  pagedkv::events::ZmqPublisher pub(po);
  pub.set_snapshot_source([&] { return manager.event_snapshot(); });

  zmq::context_t ctx(1);
  zmq::socket_t control(ctx, zmq::socket_type::dealer);
  control.set(zmq::sockopt::linger, 1000);
  control.set(zmq::sockopt::routing_id, "engine-" + std::to_string(a.instance));
  control.connect(a.control);
  {
    const Hello h{a.instance};
    std::vector<zmq::message_t> hello;
    hello.push_back(kind(Msg::kHello));
    hello.push_back(frame(h));
    hello.emplace_back(pub.endpoint());
    hello.emplace_back(pub.replay_endpoint());
    zmq::send_multipart(control, hello);
  }

  std::vector<pagedkv::TokenId> prompt;
  std::vector<std::int64_t> slots;
  double manager_seconds = 0;
  auto last_message = Clock::now();
  const auto idle_limit = std::chrono::duration<double>(a.idle_timeout_s);
  int rc = 3;  // until a quit arrives: the router went away
  for (;;) {
    zmq::pollitem_t items[2] = {{control.handle(), 0, ZMQ_POLLIN, 0},
                                {pub.native_replay_socket(), 0, ZMQ_POLLIN, 0}};
    zmq::poll(items, 2, std::chrono::milliseconds(100));
    if ((items[1].revents & ZMQ_POLLIN) != 0) pub.service_requests();
    if ((items[0].revents & ZMQ_POLLIN) == 0) {
      if (Clock::now() - last_message > idle_limit || getppid() != parent) {
        std::fprintf(stderr, "engine %u: the router is gone (silent for %.0f s or exited); exiting\n", a.instance,
                     std::chrono::duration<double>(Clock::now() - last_message).count());
        break;
      }
      continue;
    }
    last_message = Clock::now();
    std::vector<zmq::message_t> msg;
    if (!zmq::recv_multipart(control, std::back_inserter(msg), zmq::recv_flags::dontwait) || msg.empty()) continue;
    const char k = kind_of(msg[0]);
    if (k == static_cast<char>(Msg::kQuit)) {
      const pagedkv::events::PublisherStats& s = pub.stats();
      Bye bye{s.batches, s.bytes, s.replay_requests, s.snapshot_requests, manager.stats().evictions, manager_seconds};
      std::vector<zmq::message_t> out;
      out.push_back(kind(Msg::kBye));
      out.push_back(frame(bye));
      zmq::send_multipart(control, out);
      rc = 0;
      break;
    }
    if (k != static_cast<char>(Msg::kRequest) || msg.size() != 3) {
      std::fprintf(stderr, "engine %u: unexpected control message (kind %d, %zu frames); exiting\n", a.instance, k,
                   msg.size());
      rc = 4;
      break;
    }
    const Request req = unframe<Request>(msg[1], "request");
    if (msg[2].size() != std::size_t{req.num_tokens} * sizeof(pagedkv::TokenId)) {
      std::fprintf(stderr, "engine %u: request %llu carries %zu token bytes for %u tokens\n", a.instance,
                   static_cast<unsigned long long>(req.id), msg[2].size(), req.num_tokens);
      rc = 4;
      break;
    }
    prompt.resize(req.num_tokens);
    std::memcpy(prompt.data(), msg[2].data(), msg[2].size());

    Done done;
    done.id = req.id;
    const auto t0 = Clock::now();
    const pagedkv::AdmitResult r = manager.try_admit(req.id, prompt);
    if (r.admitted()) {
      // The prefill step: building its metadata registers the prompt's full blocks (and records their events).
      slots.resize(prompt.size() - r.num_cached_tokens);
      pagedkv::BatchMetadataBuffers buf;
      buf.slot_mapping = slots;
      const pagedkv::SeqId id = req.id;
      (void)manager.build_batch_metadata({&id, 1}, buf);
      manager.free(req.id);
      done.admitted = 1;
      done.cached_tokens = r.num_cached_tokens;
    }
    const auto batch = manager.take_event_batch(req.arrival_s);
    const auto t1 = Clock::now();
    done.manager_ns = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count());
    manager_seconds += std::chrono::duration<double>(t1 - t0).count();
    if (batch) pub.publish(*batch);
    done.last_seq = pub.last_seq().value_or(0);
    std::vector<zmq::message_t> out;
    out.push_back(kind(Msg::kDone));
    out.push_back(frame(done));
    zmq::send_multipart(control, out);
  }
  control.close();
  pub.shutdown();
  return rc;
}

}  // namespace router
