// Uses the installed events_zmq component: a manager admits and builds one prompt (registering 6 full blocks), its
// event batch is published on a loopback port, a subscriber follows the stream and recomputes every stored block's
// hash from the wire. Exits non-zero on any mismatch; every wait is bounded.
#include <chrono>
#include <cstdio>
#include <vector>

#include <pagedkv/events_zmq/publisher.hpp>
#include <pagedkv/events_zmq/subscriber.hpp>
#include <pagedkv/events_zmq/wire.hpp>
#include <pagedkv/pagedkv.hpp>

int main() {
  namespace ev = pagedkv::events;
  pagedkv::KVCacheManager<> cache(pagedkv::CacheConfig{.num_blocks = 64, .block_size = 16, .hash_seed = 7,
                                                       .enable_events = true});
  ev::ZmqPublisher pub({.endpoint = "tcp://127.0.0.1:*", .replay_endpoint = "tcp://127.0.0.1:*",
                        .topic = "kv-events", .encoding = {.hash_format = ev::HashFormat::kBytes16}});
  pub.set_snapshot_source([&] { return cache.event_snapshot(); });
  ev::ZmqSubscriber sub({pub.endpoint(), pub.replay_endpoint(), "kv-events"});
  std::size_t stored = 0, rehashed = 0;
  ev::FollowerOptions fo;
  fo.start_synced_at_zero = true;
  fo.idle = [&] { pub.service_requests(); };
  ev::EventStreamFollower follower(sub, fo, [&](std::uint64_t, const ev::WireBatch& b, bool) {
    for (const ev::WireEvent& w : b.events) {
      if (const auto* s = std::get_if<ev::WireBlockStored>(&w)) {
        for (std::size_t i = 0; i < s->block_hashes.size(); ++i) {
          ++stored;
          rehashed += ev::rehash_wire_block<pagedkv::Sha256Hasher>(*s, i, 7) == *s->block_hashes[i].full ? 1 : 0;
        }
      }
    }
  });

  std::vector<pagedkv::TokenId> prompt(100);
  for (int i = 0; i < 100; ++i) prompt[i] = 1000 + 7 * i;
  std::vector<std::int64_t> slots(100);
  pagedkv::BatchMetadataBuffers buf;
  buf.slot_mapping = slots;
  const bool admitted = cache.try_admit(1, prompt).admitted();
  const pagedkv::SeqId id = 1;
  (void)cache.build_batch_metadata({&id, 1}, buf);
  const auto batch = cache.take_event_batch(1.0);
  if (batch) pub.publish(*batch);
  const bool reached = batch && follower.catch_up(batch->seq_no, std::chrono::milliseconds(5000));
  const bool ok = admitted && reached && stored == 6 && rehashed == 6;
  std::printf("pagedkv events_zmq consumer: batch %llu over %s, %zu stored blocks, %zu recomputed: %s\n",
              batch ? static_cast<unsigned long long>(batch->seq_no) : 0ULL, pub.endpoint().c_str(), stored, rehashed,
              ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
