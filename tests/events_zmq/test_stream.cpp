// Issue 11 sec. 2: a subscriber decodes the stream that 1e4 random manager operations publish over loopback and
// rebuilds the exact set of cached block hashes, recomputing every stored block's hash from the wire (from the
// event alone with 16-byte hashes; along the chain with 64-bit ones). Messages are dropped on purpose: single
// losses are repaired through the replay socket, long blackouts (longer than the replay buffer) through the
// snapshot; a second subscriber joins mid-run from the snapshot. Single-threaded: the subscriber's `idle` hook
// lets the publisher answer requests while the subscriber waits, and every wait is bounded.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "test_support.hpp"
#include <pagedkv/events_zmq/publisher.hpp>
#include <pagedkv/events_zmq/subscriber.hpp>
#include <pagedkv/events_zmq/wire.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

namespace {

namespace ev = pagedkv::events;
using pagedkv::BlockHash;
using pagedkv::MultimodalItem;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using pagedkv_test::build_step;
using Hasher = pagedkv::Sha256Hasher;
using Manager = pagedkv::KVCacheManager<Hasher>;
using std::chrono::milliseconds;
constexpr std::uint64_t kSeed = 0xc0ffee;

BlockHash tag(std::uint8_t t) {
  BlockHash h;
  for (std::size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = static_cast<std::uint8_t>(t * 7 + 13 * i);
  return h;
}

/// What a consumer believes cached, built from the wire alone: wire key -> the full hash it recomputed.
struct View {
  explicit View(ev::HashFormat f) : format(f) {}
  ev::HashFormat format;
  std::map<std::uint64_t, BlockHash> cached;
  std::uint64_t rehashed = 0;
  std::uint64_t batches = 0;

  void apply(const ev::WireBatch& b) {
    ++batches;
    for (const ev::WireEvent& w : b.events) {
      if (std::holds_alternative<ev::WireAllBlocksCleared>(w)) {
        cached.clear();
      } else if (const auto* r = std::get_if<ev::WireBlockRemoved>(&w)) {
        for (const ev::WireHash& h : r->block_hashes) {
          CHECK(r->medium == std::optional<std::string>("GPU"));
          REQUIRE(cached.erase(h.key) == 1);  // the stream never removes what it did not store
        }
      } else {
        const auto& s = std::get<ev::WireBlockStored>(w);
        for (std::size_t i = 0; i < s.block_hashes.size(); ++i) {
          const BlockHash* parent = nullptr;
          if (format == ev::HashFormat::kUint64 && (i > 0 || s.parent_block_hash)) {
            // 64-bit keys: the parent's full hash is the one recomputed when the parent was stored.
            const std::uint64_t pk = i > 0 ? s.block_hashes[i - 1].key : s.parent_block_hash->key;
            const auto it = cached.find(pk);
            REQUIRE(it != cached.end());
            parent = &it->second;
          }
          const BlockHash full = ev::rehash_wire_block<Hasher>(s, i, kSeed, parent);
          REQUIRE(ev::wire_key(full) == s.block_hashes[i].key);
          if (format == ev::HashFormat::kBytes16) REQUIRE(full == *s.block_hashes[i].full);  // event alone
          cached[s.block_hashes[i].key] = full;
          ++rehashed;
        }
      }
    }
  }
};

std::map<std::uint64_t, BlockHash> cache_of(const Manager& m) {
  std::map<std::uint64_t, BlockHash> out;
  for (std::uint32_t b = 1; b < m.allocator().num_blocks(); ++b) {
    if (const auto h = m.prefix_index().hash_of(b)) out[ev::wire_key(*h)] = *h;
  }
  return out;
}

}  // namespace

TEST_CASE("a subscriber rebuilds the cache from 1e4 random manager operations over loopback, losing messages and "
          "resynchronizing through replay and snapshot", "[events_zmq][stream]") {
  const auto [layout, format] = GENERATE(table<ev::EventLayout, ev::HashFormat>(
      {{ev::EventLayout::kArray, ev::HashFormat::kUint64}, {ev::EventLayout::kMap, ev::HashFormat::kBytes16}}));
  INFO("layout " << ev::to_string(layout) << ", hashes " << ev::to_string(format));
  pagedkv::CacheConfig c;
  c.num_blocks = 40;  // small: evictions all the time
  c.block_size = 4;
  c.hash_seed = kSeed;
  c.enable_events = true;
  Manager m(c);

  ev::PublisherOptions po;
  po.endpoint = "tcp://127.0.0.1:*";
  po.replay_endpoint = "tcp://127.0.0.1:*";
  po.topic = "kv-events";
  po.replay_buffer_batches = 16;
  po.encoding.layout = layout;
  po.encoding.hash_format = format;
  ev::ZmqPublisher pub(po);
  pub.set_snapshot_source([&] { return m.event_snapshot(); });

  // Losses: about one live message in eight, and blackouts of 30 batches (longer than the 16-batch replay
  // buffer) during which the subscriber does not look, so only the snapshot can bring it back.
  std::set<std::uint64_t> blackout;
  const auto dropped = [&](std::uint64_t seq) {
    return blackout.count(seq) != 0 || ((seq * 0x9E3779B97F4A7C15ULL) >> 61) == 0;
  };
  ev::ZmqSubscriber sub({pub.endpoint(), pub.replay_endpoint(), "kv-events", 100000});
  View view(format);
  ev::FollowerOptions fo;
  fo.start_synced_at_zero = true;  // we watched the manager start empty
  fo.quiet = milliseconds(2);
  fo.idle = [&] { pub.service_requests(); };
  fo.drop_live = dropped;
  ev::EventStreamFollower follower(sub, fo, [&](std::uint64_t, const ev::WireBatch& b, bool) { view.apply(b); });

  std::unique_ptr<ev::ZmqSubscriber> late_sub;  // joins mid-run, from the snapshot
  std::unique_ptr<ev::EventStreamFollower> late;
  View late_view(format);

  std::mt19937_64 rng(4242 + static_cast<unsigned>(layout) * 10 + static_cast<unsigned>(format));
  std::vector<RequestKeys> keys(6);
  keys[1].salt = "tenant-a";
  keys[2].adapter_id = 42;
  keys[3].multimodal = {MultimodalItem{tag(1), 2, 5}, MultimodalItem{tag(2), 9, 6}};
  keys[4].salt = "tenant-b";
  keys[4].adapter_id = 7;
  keys[4].multimodal = {MultimodalItem{tag(3), 0, 20}};
  keys[5].multimodal = {MultimodalItem{tag(4), 3, 1}};
  std::vector<SeqId> live;
  SeqId next = 1;
  double ts = 1.7e9;
  std::uint64_t published = 0, checks = 0, blackouts = 0, resets = 0;
  int ops = 0;
  int since_build = 0;
  int until_check = 1;
  std::uint64_t blackout_end = 0;

  const auto check_now = [&] {
    REQUIRE(follower.catch_up(published, milliseconds(5000)));
    const auto expected = cache_of(m);
    REQUIRE(view.cached == expected);
    if (late) {
      REQUIRE(late->catch_up(published, milliseconds(5000)));
      REQUIRE(late_view.cached == expected);
    }
    ++checks;
  };

  while (ops < 10000) {
    const auto r = rng() % 20;
    if (r < 8 || live.empty()) {
      std::vector<TokenId> p = pagedkv_test::toks(0, 20 + rng() % 40);
      for (std::size_t i = 12; i < p.size(); ++i) p[i] = static_cast<TokenId>(rng() % 3);  // shared heads
      if (m.try_admit(next, p, &keys[rng() % keys.size()]).admitted()) live.push_back(next);
      ++next;
    } else if (r < 13) {
      const SeqId id = live[rng() % live.size()];
      if (m.sequence(id).num_pending() == 0 && m.sequence(id).num_lookahead == 0) {
        (void)m.try_append(id, std::vector<TokenId>{static_cast<TokenId>(rng() % 3)});
      }
    } else if (r < 14) {
      const SeqId id = live[rng() % live.size()];
      const auto& q = m.sequence(id);
      if (q.num_lookahead == 0 && q.num_pending() == 0 && m.try_reserve_lookahead(id, 3).ok()) {
        build_step(m, live);
        m.commit_lookahead(id, std::vector<TokenId>{1, 2});
        ++ops;
      }
    } else if (r < 19 || rng() % 40 != 0) {
      const std::size_t i = rng() % live.size();
      m.free(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    } else {  // an operator resets the cache once everything is drained
      for (const SeqId id : live) m.free(id);
      live.clear();
      REQUIRE(m.reset_prefix_cache());
      ++resets;
    }
    ++ops;
    if (++since_build < 1 + static_cast<int>(rng() % 3)) continue;
    since_build = 0;
    build_step(m, live);
    ++ops;
    ts += 0.025;
    const auto batch = m.take_event_batch(ts);
    if (!batch) continue;
    pub.publish(*batch);
    published = batch->seq_no;
    if (published % 400 == 200) {  // a blackout: the next 30 batches are lost and nobody looks
      for (std::uint64_t s = published + 1; s <= published + 30; ++s) blackout.insert(s);
      blackout_end = published + 30;
      ++blackouts;
    }
    if (published <= blackout_end) continue;
    if (--until_check > 0) {
      follower.poll(milliseconds(0));  // take what has arrived; gaps seen here are repaired by replay
      continue;
    }
    until_check = 1 + static_cast<int>(rng() % 4);
    check_now();
    if (!late && ops > 5000) {
      late_sub = std::make_unique<ev::ZmqSubscriber>(
          ev::SubscriberOptions{pub.endpoint(), pub.replay_endpoint(), "kv-events", 100000});
      ev::FollowerOptions lo;
      lo.quiet = milliseconds(2);
      lo.idle = [&] { pub.service_requests(); };
      late = std::make_unique<ev::EventStreamFollower>(
          *late_sub, lo, [&](std::uint64_t, const ev::WireBatch& b, bool) { late_view.apply(b); });
      REQUIRE(late->resync());  // no state yet: the snapshot, then what follows it
      REQUIRE(late->last_seq() == std::optional<std::uint64_t>(published));
      REQUIRE(late_view.cached == cache_of(m));
    }
  }
  check_now();

  const ev::FollowerStats& s = follower.stats();
  INFO(published << " batches, " << checks << " checks, " << view.rehashed << " blocks rehashed; follower: applied "
                 << s.applied << " (live " << s.applied_live << ", replayed " << s.applied_replayed << ", snapshots "
                 << s.snapshots << "), dropped " << s.dropped_on_purpose << ", gaps " << s.gaps << ", duplicates "
                 << s.duplicates << "; resets " << resets);
  CHECK(published > 1500);
  CHECK(view.rehashed > 2000);
  CHECK(s.dropped_on_purpose > 200);
  CHECK(s.applied_replayed > 100);      // single losses came back through the replay socket
  CHECK(s.snapshots >= blackouts);      // every blackout outlived the replay buffer: snapshot
  CHECK(blackouts >= 3);
  CHECK(s.resync_failures == 0);
  CHECK(s.decode_errors == 0);
  CHECK(resets > 0);
  REQUIRE(late != nullptr);
  CHECK(late->stats().snapshots >= 1);
  CHECK(late->stats().resync_failures == 0);
  CHECK(pub.stats().snapshot_requests >= blackouts + 1);
}
