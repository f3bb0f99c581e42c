// The transfer interface (pagedkv/transfer.hpp) on its in-process implementation (pagedkv/transfer_inproc.hpp):
// argument checks that name the bad field and leave nothing submitted, metadata round trips and refusals, and
// randomized runs of every fault (drop, delay, duplicate, reorder, failed blocks, killed peers, invalidation)
// against a shadow copy of every pool: each request ends in exactly one terminal status that never changes, the
// bytes equal the shadow after every tick, notifications arrive at most once unless the plan duplicates them and
// never for a failed request, a killed peer fails its in-flight requests, and a seed reproduces its run.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <pagedkv/transfer_inproc.hpp>

namespace {

namespace tx = pagedkv::transfer;
using pagedkv::Errc;

// A host pool of `num_blocks` blocks in two regions (K-like and V-like, different sizes) with guard bytes between
// blocks (stride > block_bytes), so a copy of the wrong length or at the wrong offset shows.
struct HostPool {
  std::vector<std::byte> mem;
  tx::PoolDesc desc;
  HostPool(std::uint32_t num_blocks, std::size_t k_bytes, std::size_t v_bytes) {
    const std::size_t k_stride = k_bytes + 8, v_stride = v_bytes + 8;
    mem.resize(num_blocks * (k_stride + v_stride));
    const auto base = reinterpret_cast<std::uintptr_t>(mem.data());
    desc.num_blocks = num_blocks;
    desc.regions = {{base, k_bytes, k_stride}, {base + num_blocks * k_stride, v_bytes, v_stride}};
  }
};

tx::FaultPlan latency_plan(std::uint64_t seed, std::uint32_t latency_ticks) {
  tx::FaultPlan plan;
  plan.seed = seed;
  plan.min_latency_ticks = latency_ticks;
  return plan;
}

// A fabric with a producer ("prefill") and a consumer ("decode") of equal pools, each loading the other; the
// producer's pool is filled with `fill`, the consumer's with zeros.
struct PrefillDecode {
  tx::InProcFabric fab;
  tx::InProcAgent& p;
  tx::InProcAgent& d;
  HostPool pp, pd;
  PrefillDecode(tx::FaultPlan plan, std::uint32_t blocks, std::size_t k_bytes, std::size_t v_bytes, std::byte fill)
      : fab(std::move(plan)), p(fab.make_agent("prefill")), d(fab.make_agent("decode")),
        pp(blocks, k_bytes, v_bytes), pd(blocks, k_bytes, v_bytes) {
    std::fill(pp.mem.begin(), pp.mem.end(), fill);
    p.register_pool(pp.desc);
    d.register_pool(pd.desc);
    d.load_remote(p.export_metadata());
    p.load_remote(d.export_metadata());
  }
};

template <class Fn>
void require_errc(Errc code, Fn&& fn) {
  try {
    fn();
  } catch (const pagedkv::Error& e) {
    CHECK(e.code() == code);
    return;
  }
  FAIL("expected pagedkv::Error");
}

TEST_CASE("transfer: pools and submits are validated, naming the field, with nothing registered or submitted",
          "[transfer][inproc][errors]") {
  tx::InProcFabric fab;
  tx::InProcAgent& a = fab.make_agent("prefill");
  tx::InProcAgent& b = fab.make_agent("decode");
  HostPool pa(8, 64, 32), pb(8, 64, 32), pc(8, 48, 32);
  tx::PoolDesc bad = pa.desc;
  bad.num_blocks = 0;
  require_errc(Errc::kInvalidArgument, [&] { a.register_pool(bad); });
  bad = pa.desc;
  bad.regions[1].stride_bytes = 16;
  require_errc(Errc::kInvalidArgument, [&] { a.register_pool(bad); });
  bad = pa.desc;
  bad.regions[1].base_addr = bad.regions[0].base_addr + 8;  // overlaps region 0
  require_errc(Errc::kInvalidArgument, [&] { a.register_pool(bad); });
  bad = pa.desc;
  bad.kind = tx::MemoryKind::kVram;
  require_errc(Errc::kInvalidArgument, [&] { a.register_pool(bad); });
  CHECK(a.pools().empty());
  REQUIRE(a.register_pool(pa.desc) == 0);
  REQUIRE(b.register_pool(pb.desc) == 0);
  REQUIRE(b.register_pool(pc.desc) == 1);

  const std::vector<tx::BlockId> ids{1, 2}, one{1}, oob{1, 8};
  tx::TransferDesc d{tx::TransferOp::kRead, 0, ids, "prefill", 0, ids, ""};
  require_errc(Errc::kInvalidArgument, [&] { b.submit(d); });  // prefill not loaded yet
  CHECK(b.load_remote(a.export_metadata()) == "prefill");
  require_errc(Errc::kInvalidArgument, [&] { b.load_remote(b.export_metadata()); });  // itself
  d.remote_blocks = one;
  require_errc(Errc::kInvalidArgument, [&] { b.submit(d); });  // length mismatch
  d.remote_blocks = oob;
  require_errc(Errc::kBlockOutOfRange, [&] { b.submit(d); });
  d.remote_blocks = ids;
  d.local_pool = 1;  // region 0 holds 48-byte blocks, the remote's 64
  try {
    b.submit(d);
    FAIL("expected a block_bytes mismatch");
  } catch (const pagedkv::Error& e) {
    CHECK(std::string(e.what()).find("regions[0].block_bytes: local 48, remote 64") != std::string::npos);
  }
  d.local_pool = 2;
  require_errc(Errc::kInvalidArgument, [&] { b.submit(d); });
  CHECK(b.num_requests() == 0);
  CHECK(fab.counters().submitted == 0);

  d.local_pool = 0;
  const tx::RequestId id = b.submit(d);
  CHECK(b.poll(id).status == tx::TransferStatus::kInProgress);
  require_errc(Errc::kInvalidArgument, [&] { b.release(id); });  // in progress
  require_errc(Errc::kInvalidArgument, [&] { b.poll(id + 1); });
  fab.tick();
  CHECK(b.poll(id).status == tx::TransferStatus::kDone);
  b.release(id);
  require_errc(Errc::kInvalidArgument, [&] { b.poll(id); });
  CHECK_FALSE(b.invalidate_remote("nobody"));
  CHECK(fab.counters().unknown_invalidations == 1);
}

TEST_CASE("transfer: metadata round-trips and garbage is refused", "[transfer][metadata]") {
  tx::detail::AgentMetadata md;
  md.impl = "nixl";
  md.name = "agent-7";
  md.pools.push_back({{{0x1000, 64, 128}, {0x100000, 32, 32}}, 16, tx::MemoryKind::kDram, 0});
  md.transport = {std::byte{1}, std::byte{2}, std::byte{3}};
  const std::vector<std::byte> bytes = md.encode();
  const tx::detail::AgentMetadata back = tx::detail::AgentMetadata::decode(bytes);
  CHECK(back.impl == "nixl");
  CHECK(back.name == "agent-7");
  REQUIRE(back.pools.size() == 1);
  CHECK(back.pools[0].num_blocks == 16);
  CHECK(back.pools[0].regions[1].base_addr == 0x100000);
  CHECK(back.pools[0].regions[0].stride_bytes == 128);
  CHECK(back.transport == md.transport);
  for (std::size_t cut = 0; cut < bytes.size(); ++cut)
    require_errc(Errc::kInvalidArgument,
                 [&] { (void)tx::detail::AgentMetadata::decode(std::span(bytes.data(), cut)); });
  std::vector<std::byte> flipped = bytes;
  flipped[0] ^= std::byte{1};
  require_errc(Errc::kInvalidArgument, [&] { (void)tx::detail::AgentMetadata::decode(flipped); });

  tx::InProcFabric fab;
  tx::InProcAgent& a = fab.make_agent("a");
  require_errc(Errc::kInvalidArgument, [&] { a.load_remote(bytes); });  // a nixl agent's metadata
  md.impl = "inproc";
  require_errc(Errc::kInvalidArgument, [&] { a.load_remote(md.encode()); });  // no such agent in this fabric
}

TEST_CASE("transfer: one READ of a block-table scatter moves every region of every block, then notifies",
          "[transfer][inproc]") {
  PrefillDecode pair(latency_plan(1, 3), 32, 96, 40, std::byte{0});
  auto& [fab, p, d, pp, pd] = pair;
  std::mt19937_64 rng(7);
  for (std::byte& x : pp.mem) x = static_cast<std::byte>(rng());
  std::fill(pd.mem.begin(), pd.mem.end(), std::byte{0xEE});
  const std::vector<tx::BlockId> remote{5, 17, 3, 30, 11}, local{2, 9, 31, 0, 20};
  const tx::RequestId id = d.submit({tx::TransferOp::kRead, 0, local, "prefill", 0, remote, "read-done:req-1"});
  fab.tick(2);
  CHECK(d.poll(id).status == tx::TransferStatus::kInProgress);
  CHECK(pd.mem[0] == std::byte{0xEE});
  fab.tick();
  REQUIRE(d.poll(id).status == tx::TransferStatus::kDone);
  for (std::size_t i = 0; i < local.size(); ++i)
    for (std::size_t r = 0; r < 2; ++r) {
      const tx::PoolRegion &src = pp.desc.regions[r], &dst = pd.desc.regions[r];
      const auto* s = reinterpret_cast<const std::byte*>(src.base_addr + remote[i] * src.stride_bytes);
      const auto* t = reinterpret_cast<const std::byte*>(dst.base_addr + local[i] * dst.stride_bytes);
      CHECK(std::equal(s, s + src.block_bytes, t));
      CHECK(t[src.block_bytes] == std::byte{0xEE});  // the guard after the block is untouched
    }
  CHECK(fab.counters().blocks_moved == 5);
  CHECK(fab.counters().bytes_moved == 5 * (96 + 40));
  CHECK(p.take_notifications().empty());  // the notification follows the data by its own latency
  fab.drain();
  const std::vector<tx::Notification> n = p.take_notifications();
  REQUIRE(n.size() == 1);
  CHECK(n[0].from_agent == "decode");
  CHECK(n[0].message == "read-done:req-1");
  CHECK(p.take_notifications().empty());
}

// ---- randomized fault runs against a shadow copy ----

struct RunResult {
  std::vector<std::byte> memory;  // every agent's pool, concatenated
  std::vector<std::tuple<std::string, tx::RequestId, int, int, std::uint64_t>> log;
  tx::FabricCounters counters;
};

RunResult random_run(std::uint64_t seed, bool verify) {
  std::mt19937_64 rng(seed);
  auto pick = [&](std::uint64_t n) { return static_cast<std::uint64_t>(rng() % n); };
  tx::FaultPlan plan;
  plan.seed = seed * 7919 + 1;
  plan.min_latency_ticks = static_cast<std::uint32_t>(pick(3));
  plan.max_extra_delay_ticks = static_cast<std::uint32_t>(pick(6));
  plan.shuffle_same_tick = pick(2) == 1;
  plan.p_drop_request = pick(3) == 0 ? 0.1 : 0.0;
  plan.timeout_ticks = 4 + static_cast<std::uint32_t>(pick(8));
  plan.p_fail_block = pick(3) == 0 ? 0.05 : 0.0;
  plan.p_drop_notification = pick(3) == 0 ? 0.2 : 0.0;
  plan.p_duplicate_notification = pick(3) == 0 ? 0.3 : 0.0;
  constexpr std::uint32_t kBlocks = 24;
  const std::vector<std::string> names{"p0", "p1", "d0"};
  if (pick(2) == 1) plan.fail_blocks.push_back({names[pick(3)], 0, static_cast<tx::BlockId>(pick(kBlocks))});
  tx::InProcFabric fab(plan);

  std::vector<tx::InProcAgent*> agents;
  std::vector<std::unique_ptr<HostPool>> pools;
  std::vector<std::vector<std::byte>> shadow;
  for (const std::string& n : names) {
    agents.push_back(&fab.make_agent(n));
    pools.push_back(std::make_unique<HostPool>(kBlocks, 24 + 8 * pick(4), 16));
    for (std::byte& x : pools.back()->mem) x = static_cast<std::byte>(rng());
    shadow.push_back(pools.back()->mem);
    agents.back()->register_pool(pools.back()->desc);
  }
  // Every pair with equal layouts knows each other (region sizes differ between some pairs: those never talk).
  auto compatible = [&](std::size_t i, std::size_t j) {
    return pools[i]->desc.regions[0].block_bytes == pools[j]->desc.regions[0].block_bytes;
  };
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 3; ++j)
      if (i != j) agents[i]->load_remote(agents[j]->export_metadata());

  struct Pending {
    std::size_t init, peer;
    tx::TransferOp op;
    std::vector<tx::BlockId> local, remote;
    std::string note;
  };
  std::map<std::pair<std::size_t, tx::RequestId>, Pending> pending;
  std::map<std::pair<std::size_t, tx::RequestId>, tx::RequestState> ended;
  std::set<std::pair<std::size_t, tx::BlockId>> busy;  // (agent, block) pinned by a request in flight
  std::map<std::string, int> sent_notes;               // message -> times it was legitimately sent
  std::map<std::string, std::size_t> note_to;          // message -> recipient agent
  std::map<std::string, int> received;
  std::set<std::size_t> dead;
  int note_seq = 0;

  auto offset = [&](std::size_t a, std::size_t r, tx::BlockId b) {
    const tx::PoolRegion& reg = pools[a]->desc.regions[r];
    return reg.base_addr - reinterpret_cast<std::uintptr_t>(pools[a]->mem.data()) + b * reg.stride_bytes;
  };
  auto apply_shadow = [&](const Pending& p, const std::vector<std::size_t>& failed) {
    for (std::size_t i = 0; i < p.local.size(); ++i) {
      if (std::find(failed.begin(), failed.end(), i) != failed.end()) continue;
      const bool read = p.op == tx::TransferOp::kRead;
      const std::size_t dst_a = read ? p.init : p.peer, src_a = read ? p.peer : p.init;
      const tx::BlockId dst_b = read ? p.local[i] : p.remote[i], src_b = read ? p.remote[i] : p.local[i];
      for (std::size_t r = 0; r < 2; ++r) {
        const std::size_t n = pools[dst_a]->desc.regions[r].block_bytes;
        std::copy_n(shadow[src_a].begin() + static_cast<std::ptrdiff_t>(offset(src_a, r, src_b)), n,
                    shadow[dst_a].begin() + static_cast<std::ptrdiff_t>(offset(dst_a, r, dst_b)));
      }
    }
  };
  auto unpin = [&](const Pending& p) {
    for (tx::BlockId b : p.local) busy.erase({p.init, b});
    for (tx::BlockId b : p.remote) busy.erase({p.peer, b});
  };
  // Poll every pending request: a terminal state is reached once and then never changes.
  auto poll_all = [&] {
    for (auto it = pending.begin(); it != pending.end();) {
      const tx::RequestState st = agents[it->first.first]->poll(it->first.second);
      if (st.status == tx::TransferStatus::kInProgress) {
        ++it;
        continue;
      }
      if (verify) {
        CHECK((st.status == tx::TransferStatus::kDone) == (st.reason == tx::FailReason::kNone));
      }
      std::vector<std::size_t> failed;
      if (st.reason == tx::FailReason::kBlocksFailed) {
        failed = agents[it->first.first]->failed_blocks(it->first.second);
        if (verify) CHECK_FALSE(failed.empty());
      }
      if (st.status == tx::TransferStatus::kDone || st.reason == tx::FailReason::kBlocksFailed)
        apply_shadow(it->second, failed);
      if (st.status == tx::TransferStatus::kDone && !it->second.note.empty()) ++sent_notes[it->second.note];
      unpin(it->second);
      ended[it->first] = st;
      it = pending.erase(it);
    }
    for (auto& [key, st] : ended)  // a terminal state never changes
      if (verify && pick(4) == 0) {
        const tx::RequestState again = agents[key.first]->poll(key.second);
        CHECK(again.status == st.status);
        CHECK(again.reason == st.reason);
      }
  };
  auto collect_notes = [&] {
    for (std::size_t a = 0; a < 3; ++a)
      for (const tx::Notification& n : agents[a]->take_notifications()) {
        ++received[n.message];
        if (verify) {
          CHECK(note_to.at(n.message) == a);
          CHECK(dead.count(a) == 0);
        }
      }
  };
  auto check_memory = [&] {
    if (!verify) return;
    for (std::size_t a = 0; a < 3; ++a)
      if (pools[a]->mem != shadow[a]) {
        FAIL("agent " << a << " memory differs from the shadow copy (seed " << seed << ")");
      }
  };

  const int steps = 300;
  for (int step = 0; step < steps; ++step) {
    const std::uint64_t op = pick(100);
    if (op < 45) {  // submit a READ or WRITE of a random block list between two compatible live-or-dead agents
      const std::size_t i = pick(3), j = pick(3);
      if (i == j || !compatible(i, j)) continue;
      std::vector<tx::BlockId> freel, freer;
      for (tx::BlockId b = 0; b < kBlocks; ++b) {
        if (!busy.count({i, b})) freel.push_back(b);
        if (!busy.count({j, b})) freer.push_back(b);
      }
      const std::size_t n = std::min<std::size_t>({1 + pick(8), freel.size(), freer.size()});
      if (n == 0) continue;
      std::shuffle(freel.begin(), freel.end(), rng);
      std::shuffle(freer.begin(), freer.end(), rng);
      Pending p{i, j, pick(2) ? tx::TransferOp::kRead : tx::TransferOp::kWrite,
                std::vector<tx::BlockId>(freel.begin(), freel.begin() + static_cast<std::ptrdiff_t>(n)),
                std::vector<tx::BlockId>(freer.begin(), freer.begin() + static_cast<std::ptrdiff_t>(n)), ""};
      if (pick(2)) {
        p.note = "xfer-" + std::to_string(note_seq++);
        note_to[p.note] = j;
      }
      const tx::RequestId id =
          agents[i]->submit({p.op, 0, p.local, names[j], 0, p.remote, p.note});
      for (tx::BlockId b : p.local) busy.insert({i, b});
      for (tx::BlockId b : p.remote) busy.insert({j, b});
      if (verify && (dead.count(i) || dead.count(j))) {
        CHECK(agents[i]->poll(id).reason == tx::FailReason::kPeerDead);  // fails at submit
      }
      pending.emplace(std::make_pair(i, id), std::move(p));
    } else if (op < 80) {  // time passes
      fab.tick(1 + static_cast<std::uint32_t>(pick(3)));
    } else if (op < 88) {  // an idle block gets new contents (the engine computed it), mirrored in the shadow
      const std::size_t a = pick(3);
      const auto b = static_cast<tx::BlockId>(pick(kBlocks));
      if (busy.count({a, b}) || dead.count(a)) continue;
      for (std::size_t r = 0; r < 2; ++r)
        for (std::size_t k = 0; k < pools[a]->desc.regions[r].block_bytes; ++k) {
          const auto v = static_cast<std::byte>(rng());
          pools[a]->mem[offset(a, r, b) + k] = v;
          shadow[a][offset(a, r, b) + k] = v;
        }
    } else if (op < 94) {  // a standalone notification
      const std::size_t i = pick(3), j = pick(3);
      if (i == j) continue;
      const std::string msg = "note-" + std::to_string(note_seq++);
      note_to[msg] = j;
      const bool ok = agents[i]->notify(names[j], msg);
      if (verify) CHECK(ok == (dead.count(i) == 0 && dead.count(j) == 0));
      if (ok) ++sent_notes[msg];
    } else if (op < 97) {  // invalidate a peer, then load it again: its in-flight requests end kPeerInvalidated
      const std::size_t i = pick(3), j = pick(3);
      if (i == j) continue;
      std::vector<tx::RequestId> inflight;
      for (auto& [key, p] : pending)
        if (key.first == i && p.peer == j) inflight.push_back(key.second);
      REQUIRE(agents[i]->invalidate_remote(names[j]));
      if (verify)
        for (tx::RequestId id : inflight) {
          const tx::RequestState st = agents[i]->poll(id);
          CHECK(st.status == tx::TransferStatus::kFailed);
          CHECK(st.reason == tx::FailReason::kPeerInvalidated);
        }
      agents[i]->load_remote(agents[j]->export_metadata());
    } else if (dead.empty() && step > 2 * steps / 3 && pick(2) == 0) {  // kill a peer: its in-flight requests fail
      const std::size_t k = pick(3);
      fab.kill(names[k]);
      dead.insert(k);
      if (verify)
        for (auto& [key, p] : pending)
          if (key.first == k || p.peer == k) {
            const tx::RequestState st = agents[key.first]->poll(key.second);
            CHECK(st.status == tx::TransferStatus::kFailed);
            CHECK(st.reason == tx::FailReason::kPeerDead);
          }
    }
    poll_all();
    collect_notes();
    check_memory();
    // Release some ended requests (never those in progress: the interface refuses that).
    for (auto it = ended.begin(); it != ended.end();) {
      if (pick(3) == 0) {
        agents[it->first.first]->release(it->first.second);
        it = ended.erase(it);
      } else {
        ++it;
      }
    }
  }
  fab.drain();
  poll_all();
  collect_notes();
  check_memory();

  if (verify) {
    CHECK(pending.empty());
    const tx::FabricCounters& c = fab.counters();
    // Every request ended exactly once: the log names each (agent, id) once, and the counters add up.
    std::set<std::pair<std::string, tx::RequestId>> seen;
    for (const tx::CompletionRecord& r : fab.completions()) CHECK(seen.insert({r.agent, r.id}).second);
    CHECK(seen.size() == c.submitted);
    CHECK(c.done + c.failed_backend + c.failed_blocks + c.failed_peer_dead + c.failed_invalidated +
              c.failed_timed_out == c.submitted);
    // Notifications: every one handed to the fabric is delivered, dropped, duplicated or addressed to the dead.
    CHECK(c.notifications_delivered + c.notifications_dropped + c.notifications_to_dead ==
          c.notifications_sent + c.notifications_duplicated);
    for (const auto& [msg, n] : received) {
      INFO(msg);
      CHECK(sent_notes.count(msg) == 1);  // never for a failed request, never invented
      CHECK(n <= (plan.p_duplicate_notification > 0 ? 2 : 1));
    }
    if (plan.p_drop_notification == 0 && dead.empty())
      for (const auto& [msg, n] : sent_notes) CHECK(received.count(msg) == 1);
    CHECK(fab.quiescent());
  }
  RunResult out;
  for (auto& p : pools) out.memory.insert(out.memory.end(), p->mem.begin(), p->mem.end());
  for (const tx::CompletionRecord& r : fab.completions())
    out.log.emplace_back(r.agent, r.id, static_cast<int>(r.state.status), static_cast<int>(r.state.reason), r.tick);
  out.counters = fab.counters();
  return out;
}

TEST_CASE("transfer: randomized fault plans keep every pool equal to its shadow copy and every request ends once",
          "[transfer][inproc][faults]") {
  tx::FabricCounters sum;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    INFO("seed " << seed);
    const tx::FabricCounters c = random_run(seed, true).counters;
    sum.done += c.done;
    sum.failed_blocks += c.failed_blocks;
    sum.failed_peer_dead += c.failed_peer_dead;
    sum.failed_invalidated += c.failed_invalidated;
    sum.failed_timed_out += c.failed_timed_out;
    sum.notifications_dropped += c.notifications_dropped;
    sum.notifications_duplicated += c.notifications_duplicated;
    sum.notifications_to_dead += c.notifications_to_dead;
  }
  // Every fault actually happened somewhere in these runs (otherwise the checks above could not fail on it).
  CHECK(sum.done > 1000);
  CHECK(sum.failed_blocks > 0);
  CHECK(sum.failed_peer_dead > 0);
  CHECK(sum.failed_invalidated > 0);
  CHECK(sum.failed_timed_out > 0);
  CHECK(sum.notifications_dropped > 0);
  CHECK(sum.notifications_duplicated > 0);
  CHECK(sum.notifications_to_dead > 0);
  UNSCOPED_INFO("done " << sum.done << ", failed: blocks " << sum.failed_blocks << ", peer dead "
                        << sum.failed_peer_dead << ", invalidated " << sum.failed_invalidated << ", timed out "
                        << sum.failed_timed_out);
}

TEST_CASE("transfer: a fault plan's seed reproduces its run exactly", "[transfer][inproc][faults]") {
  for (std::uint64_t seed : {3u, 11u, 42u}) {
    const RunResult a = random_run(seed, false), b = random_run(seed, false);
    CHECK(a.memory == b.memory);
    CHECK(a.log == b.log);
    const RunResult c = random_run(seed + 100, false);
    CHECK(a.log != c.log);
  }
}

TEST_CASE("transfer: chosen blocks fail, the others arrive, and the request reports which", "[transfer][inproc]") {
  tx::FaultPlan plan;
  plan.fail_blocks = {{"prefill", 0, 4}};
  PrefillDecode pair(plan, 8, 32, 16, std::byte{0x11});
  auto& [fab, p, d, pp, pd] = pair;
  const std::vector<tx::BlockId> remote{3, 4, 5}, local{0, 1, 2};
  const tx::RequestId id = d.submit({tx::TransferOp::kRead, 0, local, "prefill", 0, remote, "done"});
  fab.drain();
  const tx::RequestState st = d.poll(id);
  CHECK(st.status == tx::TransferStatus::kFailed);
  CHECK(st.reason == tx::FailReason::kBlocksFailed);
  CHECK(d.failed_blocks(id) == std::vector<std::size_t>{1});
  const auto* k = reinterpret_cast<const std::byte*>(pd.desc.regions[0].base_addr);
  const std::size_t stride = pd.desc.regions[0].stride_bytes;
  CHECK(k[0] == std::byte{0x11});
  CHECK(k[stride] == std::byte{0});  // block 1 (from remote 4) failed: untouched
  CHECK(k[2 * stride] == std::byte{0x11});
  CHECK(p.take_notifications().empty());  // no notification for a failed request
}

TEST_CASE("transfer: killing the prefill peer mid-transfer fails the decode side's read and nothing is copied",
          "[transfer][inproc][faults]") {
  PrefillDecode pair(latency_plan(5, 10), 4, 16, 16, std::byte{0x5A});
  auto& [fab, p, d, pp, pd] = pair;
  const std::vector<tx::BlockId> ids{0, 1, 2, 3};
  const tx::RequestId id = d.submit({tx::TransferOp::kRead, 0, ids, "prefill", 0, ids, "done"});
  fab.tick(5);
  fab.kill("prefill");
  CHECK(d.poll(id).reason == tx::FailReason::kPeerDead);
  fab.drain();
  CHECK(std::all_of(pd.mem.begin(), pd.mem.end(), [](std::byte b) { return b == std::byte{0}; }));
  CHECK_FALSE(d.notify("prefill", "heartbeat"));
  const tx::RequestId later = d.submit({tx::TransferOp::kRead, 0, ids, "prefill", 0, ids, ""});
  CHECK(d.poll(later).reason == tx::FailReason::kPeerDead);
  CHECK(fab.counters().failed_peer_dead == 2);
}

}  // namespace

namespace {

TEST_CASE("transfer: reloading a peer (a restart) ends its requests in flight, later ones run against the new pools",
          "[transfer][inproc]") {
  PrefillDecode pair(latency_plan(9, 4), 4, 16, 16, std::byte{0x21});
  auto& [fab, p, d, pp, pd] = pair;
  const std::vector<tx::BlockId> ids{0, 1};
  const tx::RequestId old_id = d.submit({tx::TransferOp::kRead, 0, ids, "prefill", 0, ids, ""});
  fab.tick();
  d.load_remote(p.export_metadata());
  CHECK(d.poll(old_id).reason == tx::FailReason::kPeerInvalidated);
  const tx::RequestId new_id = d.submit({tx::TransferOp::kRead, 0, ids, "prefill", 0, ids, ""});
  fab.drain();
  CHECK(d.poll(new_id).status == tx::TransferStatus::kDone);
  CHECK(pd.mem[0] == std::byte{0x21});
  CHECK(fab.counters().failed_invalidated == 1);
  CHECK(fab.counters().done == 1);
}

}  // namespace
