// Issue 21 sec. 3: a fleet of 4 pagedkv engines (each its own KVCacheManager with a host tier, and its own
// ZmqPublisher on 127.0.0.1) serves a bundled, seeded trace with salted tenants, LoRA adapters and images. One
// subscriber per engine follows its stream (gaps repaired through replay) and feeds two router models written from
// the routers' published rules (not their code): llm-d's and Dynamo's, in router_models.hpp (shared with the
// replay check, replay_events_check.cpp).
// Checks: every batch applied in order, no event dropped by either model, each model's per-engine block set equal
// to the engine's own cached (block, tier) set, and for a sample of prompts each model's cached-block count
// equal to the engine's truth (KVCacheManager::lookup). Bounded: a fixed number of steps, every wait bounded.
#include <catch2/catch.hpp>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <pagedkv/block_identity.hpp>
#include <pagedkv/events_zmq/group_specs.hpp>
#include <pagedkv/events_zmq/publisher.hpp>
#include <pagedkv/events_zmq/subscriber.hpp>
#include <pagedkv/events_zmq/topic.hpp>
#include <pagedkv/events_zmq/wire.hpp>
#include <pagedkv/kv_cache_manager.hpp>
#include "support/manager_instances.hpp"  // KVCacheManager<> and <Xxh3Hasher> are compiled once (CI build time)

#include "router_models.hpp"

namespace {

using namespace router_models;  // NOLINT: the rule models, shared with replay_events_check.cpp
namespace ev = pagedkv::events;
namespace id = pagedkv::identity;
using pagedkv::BlockHash;
using pagedkv::MultimodalItem;
using pagedkv::RequestKeys;
using pagedkv::SeqId;
using pagedkv::TokenId;
using std::chrono::milliseconds;
using Manager = pagedkv::KVCacheManager<>;

constexpr int kEngines = 4;
constexpr std::uint32_t kBlockSize = 4;
constexpr const char* kModel = "acme/fleet-7b";

std::string lora_name(std::uint64_t adapter) { return adapter == 1 ? "sql-lora" : "chat-lora"; }

BlockHash item(std::uint8_t t) {
  BlockHash h;
  for (std::size_t i = 0; i < h.bytes.size(); ++i) h.bytes[i] = static_cast<std::uint8_t>(t * 31 + 7 * i + 1);
  return h;
}

/// A request of the bundled trace: prompt tokens and keys.
struct Request {
  std::vector<TokenId> prompt;
  RequestKeys keys;
};

/// The bundled trace: 12 conversation templates (shared heads), each owned by a key class (plain, two salted
/// tenants, two LoRA adapters, images, LoRA + salt + image), requests = template head + a random tail. Salted
/// tenants use their own templates: llm-d ignores salts, so a shared head would merge tenants there by design
/// (docs/events-wire.md section 9); the Dynamo check below queries salted prompts under other salts as well.
Request make_request(std::mt19937_64& rng) {
  const unsigned t = static_cast<unsigned>(rng() % 12);
  Request r;
  const std::size_t head = 8 + 4 * (t % 4);
  for (std::size_t i = 0; i < head; ++i) r.prompt.push_back(static_cast<TokenId>(1000 * (t + 1) + i));
  const std::size_t tail = rng() % 14;
  for (std::size_t i = 0; i < tail; ++i) r.prompt.push_back(static_cast<TokenId>(rng() % 4));
  switch (t % 6) {
    case 1: r.keys.salt = t < 6 ? "tenant-a" : "tenant-b"; break;
    case 2: r.keys.adapter_id = 1; break;
    case 3: r.keys.adapter_id = 2; break;
    case 4: r.keys.multimodal = {MultimodalItem{item(static_cast<std::uint8_t>(t)), 2, 5}}; break;
    case 5:
      r.keys.adapter_id = 1;
      r.keys.salt = "tenant-c";
      r.keys.multimodal = {MultimodalItem{item(static_cast<std::uint8_t>(t)), 5, 6},
                           MultimodalItem{item(static_cast<std::uint8_t>(t + 100)), 9, 2}};
      break;
    default: break;
  }
  return r;
}

struct Engine {
  std::unique_ptr<Manager> m;
  std::unique_ptr<ev::ZmqPublisher> pub;
  std::unique_ptr<ev::ZmqSubscriber> sub;
  std::unique_ptr<ev::EventStreamFollower> follower;
  Llmd llmd;
  Dynamo dynamo;
  std::vector<SeqId> live;
  std::uint64_t published = 0;
};

/// One engine step's metadata build (as test_support's build_step, plus room for the host tier's swap pairs).
pagedkv::BatchMetadataSizes build(Manager& m, const std::vector<SeqId>& live) {
  std::vector<SeqId> scheduled;
  std::size_t n = 0;
  for (const SeqId s : live) {
    const std::size_t p = m.pending_slots(s).size();
    n += p;
    if (p > 0) scheduled.push_back(s);
  }
  std::vector<std::int64_t> slots(n, -2);
  std::vector<std::int32_t> copies(2 * m.pending_copies().size(), -2);
  std::vector<std::int32_t> swap_out(2 * 128, -2), swap_in(2 * 128, -2);
  pagedkv::BatchMetadataBuffers buf;
  buf.slot_mapping = slots;
  buf.copies = copies;
  buf.swap_out = swap_out;
  buf.swap_in = swap_in;
  return m.build_batch_metadata(scheduled, buf);
}

/// The engine's own cached set that a prefix match can reach: wire key -> tiers, for every cached (block, tier)
/// of its snapshot whose whole parent chain is cached in some tier. A block whose parent is cached nowhere (a
/// write-back copy that reached the host tier after its parent left every tier) is unreachable: neither the
/// engine's lookup nor a router can ever match it, and both routers drop its BlockStored (unknown parent).
/// `orphans` receives the number of unreachable cached (block, tier) entries.
std::map<std::uint64_t, std::uint64_t> engine_blocks(const Manager& m, std::uint64_t* orphans,
                                                     std::map<std::uint64_t, std::uint64_t>* all_out) {
  std::map<BlockHash, std::pair<std::optional<BlockHash>, std::uint64_t>> all;
  for (const pagedkv::KVEvent& e : m.event_snapshot().stored) {
    auto& a = all[e.hash];
    a.first = e.parent_hash;
    a.second |= e.medium == pagedkv::Medium::kCpu ? 2 : 1;
  }
  std::map<std::uint64_t, std::uint64_t> out;
  for (const auto& [h, a] : all) {
    bool reachable = true;
    for (std::optional<BlockHash> p = a.first; p; p = all.at(*p).first) {
      if (all.count(*p) == 0) {
        reachable = false;
        break;
      }
    }
    if (all_out != nullptr) (*all_out)[ev::wire_key(h)] = a.second;
    if (reachable) {
      out[ev::wire_key(h)] = a.second;
    } else if (orphans != nullptr) {
      *orphans += std::popcount(a.second);
    }
  }
  return out;
}


}  // namespace

TEST_CASE("fleet: 4 engines publish on loopback - llm-d and Dynamo rule sets index every block and agree with each "
          "engine's lookup", "[events_zmq][fleet]") {
  std::vector<Engine> fleet(kEngines);
  ev::EncodeOptions enc;  // the defaults under test: array layout, u64 hashes, Dynamo salt form, 64-hex ids
  enc.lora_name = [](std::uint64_t a) -> std::optional<std::string> { return lora_name(a); };
  for (int i = 0; i < kEngines; ++i) {
    Engine& e = fleet[static_cast<std::size_t>(i)];
    pagedkv::CacheConfig c;
    c.num_blocks = 48;  // small: evictions, and write-back offloads to the host tier, all the time
    c.block_size = kBlockSize;
    c.num_host_blocks = 24;
    c.hash_seed = 77;
    c.enable_events = true;
    e.m = std::make_unique<Manager>(c);
    ev::PublisherOptions po;
    po.endpoint = "tcp://127.0.0.1:*";
    po.replay_endpoint = "tcp://127.0.0.1:*";
    po.model_name = kModel;
    po.pod_id = "pod-" + std::to_string(i);
    po.encoding = enc;
    e.pub = std::make_unique<ev::ZmqPublisher>(po);
    Manager* m = e.m.get();
    e.pub->set_snapshot_source([m] { return m->event_snapshot(); });
    const auto topic = ev::parse_llmd_topic(e.pub->topic());
    REQUIRE(topic);
    CHECK(topic->pod_id == po.pod_id);
    e.llmd.model = topic->model_name;
    e.sub = std::make_unique<ev::ZmqSubscriber>(
        ev::SubscriberOptions{e.pub->endpoint(), e.pub->replay_endpoint(), "kv@", 100000});
    ev::FollowerOptions fo;
    fo.start_synced_at_zero = true;
    fo.quiet = milliseconds(2);
    ev::ZmqPublisher* pub = e.pub.get();
    fo.idle = [pub] { pub->service_requests(); };
    Engine* ep = &e;
    e.follower = std::make_unique<ev::EventStreamFollower>(*e.sub, fo, [ep](std::uint64_t, const ev::WireBatch& b, bool) {
      ep->llmd.apply(b);
      ep->dynamo.apply(b);
    });
  }
  REQUIRE(fleet[0].llmd.model == kModel);

  std::mt19937_64 rng(2121);
  SeqId next = 1;
  double ts = 1.75e9;
  std::uint64_t prompts = 0, llmd_agree = 0, dynamo_agree = 0, nonzero = 0, cross_salt = 0, cross_salt_agree = 0;
  std::uint64_t cpu_blocks_seen = 0, transfers = 0, max_orphans = 0;
  std::map<int, std::uint64_t> agree_by_class;

  const auto check_fleet = [&] {
    for (Engine& e : fleet) {
      REQUIRE(e.follower->catch_up(e.published, milliseconds(5000)));
      std::uint64_t orphans = 0;
      std::map<std::uint64_t, std::uint64_t> held;
      const auto truth = engine_blocks(*e.m, &orphans, &held);
      max_orphans = std::max(max_orphans, orphans);
      for (const auto& [k, t] : truth) cpu_blocks_seen += (t & 2) != 0 ? 1 : 0;
      INFO("llm-d: " << e.llmd.by_engine_key.size() << " blocks, " << e.llmd.dropped_events << " drops; Dynamo: "
                     << e.dynamo.by_engine_key.size() << " blocks, " << e.dynamo.dropped_events
                     << " drops (bad removals " << e.llmd.bad_removals << ", orphan CPU stores " << e.llmd.orphan_cpu << "); engine: " << truth.size() << " blocks; last " << e.published);
      // Every reachable block is indexed with its tiers, and nothing is indexed that the engine does not hold
      // (a block whose parent left later stays indexed, unreachable, as the engine keeps it).
      for (const RouterModel* r : {static_cast<const RouterModel*>(&e.llmd), static_cast<const RouterModel*>(&e.dynamo)}) {
        const auto got = model_blocks(*r);
        for (const auto& [k, t] : truth) {
          const auto it = got.find(k);
          REQUIRE(it != got.end());
          REQUIRE(it->second == t);
        }
        for (const auto& [k, t] : got) {
          const auto it = held.find(k);
          REQUIRE(it != held.end());
          REQUIRE(it->second == t);
        }
      }
    }
    // A sample of prompts asked of every engine: each model's count equals the engine's truth.
    for (int q = 0; q < 6; ++q) {
      const Request r = make_request(rng);
      const auto lk = fleet[0].llmd.request_keys(r.prompt, r.keys, kBlockSize, lora_name);
      const auto dk = Dynamo::request_keys(r.prompt, r.keys, kBlockSize, lora_name);
      for (Engine& e : fleet) {
        const std::size_t truth = e.m->lookup(r.prompt, &r.keys, r.prompt.size()) / kBlockSize;
        const std::size_t l = e.llmd.count_prefix(lk);
        const std::size_t d = e.dynamo.count_prefix(dk);
        ++prompts;
        nonzero += truth > 0 ? 1 : 0;
        llmd_agree += l == truth ? 1 : 0;
        dynamo_agree += d == truth ? 1 : 0;
        CHECK(l == truth);
        INFO("keys: adapter " << r.keys.adapter_id << ", salt '" << r.keys.salt << "', items "
                              << r.keys.multimodal.size() << ", prompt " << r.prompt.size() << " tokens");
        CHECK(d == truth);
        if (!r.keys.salt.empty()) {  // the same tokens under another tenant's salt: nothing to reuse
          RequestKeys other = r.keys;
          other.salt = "tenant-z";
          const std::size_t t2 = e.m->lookup(r.prompt, &other, r.prompt.size()) / kBlockSize;
          const std::size_t d2 = e.dynamo.count_prefix(Dynamo::request_keys(r.prompt, other, kBlockSize, lora_name));
          ++cross_salt;
          cross_salt_agree += d2 == t2 ? 1 : 0;
          CHECK(t2 == 0);
          CHECK(d2 == t2);
        }
      }
    }
  };

  for (int step = 0; step < 400; ++step) {
    for (Engine& e : fleet) {
      Manager& m = *e.m;
      for (int a = 0; a < 2; ++a) {
        const Request r = make_request(rng);
        if (m.try_admit(next, r.prompt, &r.keys).admitted()) {
          e.live.push_back(next);
        }
        ++next;
      }
      for (const SeqId s : e.live) {
        if (rng() % 2 == 0 && m.sequence(s).num_pending() == 0) {
          (void)m.try_append(s, std::vector<TokenId>{static_cast<TokenId>(rng() % 4)});
        }
      }
      const pagedkv::BatchMetadataSizes built = build(m, e.live);
      if (built.transfer_token != 0) {  // the copies "ran": the host blocks become hit-able (medium CPU)
        m.complete_transfers(built.transfer_token);
        ++transfers;
      }
      while (e.live.size() > 3) {
        const std::size_t i = rng() % e.live.size();
        m.free(e.live[i]);
        e.live.erase(e.live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      ts += 0.01;
      if (const auto batch = m.take_event_batch(ts)) {
        e.pub->publish(*batch);
        e.published = batch->seq_no;
      }
      e.follower->poll(milliseconds(0));
    }
    if (step % 25 == 24) check_fleet();
  }
  check_fleet();

  std::uint64_t events = 0, blocks = 0, removed = 0, llmd_drops = 0, dynamo_drops = 0, batches = 0, replayed = 0;
  std::uint64_t orphan_drops = 0, bad_removals = 0, held_back = 0;
  for (Engine& e : fleet) {
    held_back += e.m->stats().events_held_back;
    const ev::FollowerStats& s = e.follower->stats();
    CHECK(s.decode_errors == 0);
    CHECK(s.resync_failures == 0);
    CHECK(e.follower->last_seq() == std::optional<std::uint64_t>(e.published));
    batches += s.applied;
    replayed += s.applied_replayed;
    events += e.llmd.stored_events;
    blocks += e.llmd.stored_blocks;
    removed += e.llmd.removed_blocks;
    llmd_drops += e.llmd.dropped_events;
    dynamo_drops += e.dynamo.dropped_events + e.dynamo.unsupported;
    CHECK(e.llmd.stored_blocks == e.dynamo.stored_blocks);
    orphan_drops += e.llmd.orphan_cpu;
    bad_removals += e.llmd.bad_removals;
  }
  WARN("fleet: " << kEngines << " engines, " << batches << " batches applied (" << replayed << " by replay), "
                 << events << " BlockStored events, " << blocks << " blocks stored, " << removed << " removed, "
                 << transfers << " host-tier transfer completions, " << cpu_blocks_seen
                 << " CPU-tier block observations; host-tier stores held back by the engines (parent cached nowhere) "
                 << held_back << "; dropped BlockStored events: llm-d " << llmd_drops << ", Dynamo "
                 << dynamo_drops << " (of unreachable blocks: " << orphan_drops
                 << " host-tier copies whose parent was cached nowhere, the rest their descendants; at most "
                 << max_orphans << " unreachable entries cached at a check; " << bad_removals
                 << " removals of them, no-ops)"
                 << "; prompts " << prompts << " (" << nonzero << " with a cached prefix): llm-d agrees " << llmd_agree
                 << ", Dynamo agrees " << dynamo_agree << "; cross-salt queries " << cross_salt << ", Dynamo agrees "
                 << cross_salt_agree);
  // Every reachable block is indexed (the set checks above), and no event is dropped: a host-tier copy whose parent
  // is cached nowhere is held back by the engine instead of published for routers to drop (issue 21).
  CHECK(llmd_drops == 0);
  CHECK(dynamo_drops == 0);
  CHECK(orphan_drops == 0);
  CHECK(blocks > 1000);
  CHECK(cpu_blocks_seen > 0);
  CHECK(nonzero > prompts / 4);
  CHECK(cross_salt > 0);
}

TEST_CASE("fleet: a hybrid engine (full + sliding-window groups) publishes its full-attention group only - both rule "
          "sets index it and agree with the group's cached prefix", "[events_zmq][fleet]") {
  using Hybrid = pagedkv::HybridKVCacheManager<>;
  pagedkv::HybridCacheConfig c;
  c.num_blocks = 96;
  c.block_size = kBlockSize;
  c.groups = {pagedkv::KVCacheGroupSpec{pagedkv::AttentionKind::kFull, 0, 1},
              pagedkv::KVCacheGroupSpec{pagedkv::AttentionKind::kSlidingWindow, 8, 1}};
  c.hash_seed = 5;
  c.enable_events = true;
  Hybrid m(c);
  ev::PublisherOptions po;
  po.replay_endpoint = "tcp://127.0.0.1:*";
  po.model_name = kModel;
  po.pod_id = "hybrid-0";
  po.encoding.lora_name = [](std::uint64_t a) -> std::optional<std::string> { return lora_name(a); };
  po.encoding.group_specs = ev::group_specs(c);
  REQUIRE(po.encoding.group_specs.size() == 2);
  CHECK(po.encoding.group_specs[1] == ev::GroupSpec{"sliding_window", 8});
  ev::ZmqPublisher pub(po);
  pub.set_snapshot_source([&m] { return m.event_snapshot(); });
  ev::ZmqSubscriber sub({pub.endpoint(), pub.replay_endpoint(), "kv@", 100000});
  Llmd llmd;
  llmd.model = kModel;
  Dynamo dynamo;
  std::uint64_t non_main = 0, specs_seen = 0;
  ev::FollowerOptions fo;
  fo.start_synced_at_zero = true;
  fo.quiet = milliseconds(2);
  fo.idle = [&pub] { pub.service_requests(); };
  ev::EventStreamFollower follower(sub, fo, [&](std::uint64_t, const ev::WireBatch& b, bool) {
    for (const ev::WireEvent& w : b.events) {
      if (const auto* s = std::get_if<ev::WireBlockStored>(&w)) {
        // Dynamo's filter: only main-attention kinds are indexed; none other may reach the wire by default.
        ++specs_seen;
        if (!s->kv_cache_spec_kind || !ev::is_main_attention(*s->kv_cache_spec_kind)) ++non_main;
        CHECK(s->group_idx == std::optional<std::int64_t>(0));
      }
    }
    llmd.apply(b);
    dynamo.apply(b);
  });

  // The full-attention group's cached hashes (from the engine's snapshot) and its prefix of a prompt.
  const auto group0 = [&m] {
    std::map<std::uint64_t, std::uint64_t> out;
    for (const pagedkv::KVEvent& e : m.event_snapshot().stored) {
      if (e.group == 0) out[ev::wire_key(e.hash)] |= 1;
    }
    return out;
  };
  const auto group0_prefix = [&](const Request& r, const std::map<std::uint64_t, std::uint64_t>& held) {
    BlockHash parent = pagedkv::PrefixHashIndex<pagedkv::Sha256Hasher>::root_for_seed(c.hash_seed);
    std::size_t n = 0;
    for (std::size_t b = 0; b + kBlockSize <= r.prompt.size(); b += kBlockSize, ++n) {
      parent = pagedkv::PrefixHashIndex<pagedkv::Sha256Hasher>::hash_block(
          parent, std::span<const TokenId>(r.prompt).subspan(b, kBlockSize), b, &r.keys);
      if (held.count(ev::wire_key(parent)) == 0) break;
    }
    return n;
  };

  std::mt19937_64 rng(77);
  std::vector<SeqId> live;
  SeqId next = 1;
  std::uint64_t published = 0, prompts = 0, agree = 0, above_engine = 0;
  for (int step = 0; step < 300; ++step) {
    const Request r = make_request(rng);
    if (m.try_admit(next, r.prompt, &r.keys).admitted()) live.push_back(next);
    ++next;
    for (const SeqId s : live) {
      if (rng() % 2 == 0 && m.num_tokens(s) == m.num_built(s)) {
        (void)m.try_append(s, std::vector<TokenId>{static_cast<TokenId>(rng() % 4)});
      }
    }
    std::vector<SeqId> batch;
    std::size_t tokens = 0;
    for (const SeqId s : live) {
      if (m.num_tokens(s) > m.num_built(s)) {
        batch.push_back(s);
        tokens += m.num_tokens(s) - m.num_built(s);
      }
    }
    std::vector<std::vector<std::int64_t>> slots(2, std::vector<std::int64_t>(std::max<std::size_t>(1, tokens), -2));
    std::vector<std::vector<std::int32_t>> copies(
        2, std::vector<std::int32_t>(2 * std::max<std::size_t>(1, m.pending_copies().size()), -2));
    std::vector<pagedkv::BatchMetadataBuffers> bufs(2);
    for (std::size_t g = 0; g < 2; ++g) {
      bufs[g].slot_mapping = slots[g];
      bufs[g].copies = copies[g];
    }
    if (!batch.empty()) (void)m.build_batch_metadata(batch, bufs);
    while (live.size() > 3) {
      const std::size_t i = rng() % live.size();
      m.free(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
    }
    if (const auto b = m.take_event_batch(1.8e9 + step)) {
      pub.publish(*b);
      published = b->seq_no;
    }
    follower.poll(milliseconds(0));
    if (step % 30 == 29) {
      REQUIRE(follower.catch_up(published, milliseconds(5000)));
      const auto held = group0();
      REQUIRE(model_blocks(llmd) == held);
      REQUIRE(model_blocks(dynamo) == held);
      for (int q = 0; q < 5; ++q) {
        const Request p = make_request(rng);
        const std::size_t full = group0_prefix(p, held);
        const std::size_t truth = m.lookup(p.prompt, &p.keys, p.prompt.size()) / kBlockSize;
        const std::size_t l = llmd.count_prefix(llmd.request_keys(p.prompt, p.keys, kBlockSize, lora_name));
        const std::size_t d = dynamo.count_prefix(Dynamo::request_keys(p.prompt, p.keys, kBlockSize, lora_name));
        ++prompts;
        agree += l == full && d == full ? 1 : 0;
        above_engine += full > truth ? 1 : 0;
        CHECK(l == full);
        CHECK(d == full);
        CHECK(full >= truth);  // the engine's hit also needs the sliding-window group's blocks
      }
    }
  }
  WARN("hybrid engine: " << published << " batches, " << specs_seen << " BlockStored events (all group 0, "
                         << non_main << " of a non-main kind), " << llmd.stored_blocks << " blocks; drops llm-d "
                         << llmd.dropped_events << ", Dynamo " << dynamo.dropped_events << "; prompts " << prompts
                         << ": both agree with the full-attention group's prefix " << agree << ", which exceeds "
                         << "the engine's hybrid hit in " << above_engine);
  CHECK(non_main == 0);
  CHECK(llmd.dropped_events == 0);
  CHECK(dynamo.dropped_events == 0);
  CHECK(llmd.stored_blocks > 200);
}
