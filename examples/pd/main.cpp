// examples/pd/main.cpp: pagedkv-pd, prefill/decode disaggregation over NIXL on 127.0.0.1 (issue 34,
// docs/disaggregation.md).
//
// --role prefill: an engine (engine.hpp) that listens on 127.0.0.1 for one decode engine, shakes hands (its layout
//   fingerprint and NIXL agent metadata), then for each request computes the prompt's blocks, keeps them under a
//   lease (KVCacheManager::finish_with_lease) and answers with the hand-off descriptor; it checks each claim's
//   (block, generation) pairs (check_claim) before the decode engine READs, releases the lease on the READ's
//   notification (read-done) and expires leases whose notification never comes (reap_external).
// --role decode: connects, checks the fingerprint (a mismatch is refused at hand-shake, naming the field), and for
//   each request: plan_import (only the blocks it lacks: its own prefix hit is not moved again),
//   try_admit_external, a claim, ONE NIXL READ of every (layer, block) descriptor of the hand-off, then
//   complete_external_fill and decoding. Up to --inflight (default 4) hand-offs' READs stay posted at once, each
//   completed in the order it ends. Every request's outputs are compared bit for bit with one engine doing both
//   (the code of --role both, run in this process). Before each hand-off's READ, --reps rounds time the same READ
//   through pagedkv and through raw NIXL (the same C API call sequence without pagedkv), alternated.
// --role both: one engine doing prefill and decode (the reference), printing a digest of the outputs.
// --window W: a hybrid model (the odd layers sliding-window layers of W tokens, KV-cache group 1): a hand-off moves
//   only the window group's blocks inside the window of the decode engine's first query; the rest are null pairs,
//   left out of the READ and of the claim's checks (check_claim skips them).
// --role replay: a trace (Mooncake's conversation trace) through a prefill and a decode manager with the
//   in-process transport: bytes moved with and without the decode side's prefix hits, TTFT proxies, leaks
//   (replay.cpp).
// --fault: kill (SIGKILL the prefill process once a READ is posted), drop-notify (a READ without its read-done:
//   the producer's lease expires), stale (the producer ends the lease and reuses the blocks before the claim: the
//   claim is refused by generation), layout (one hand-shake per fingerprint field, that field changed on the decode
//   side: block_size, page_layout, dtype, num_kv_heads, head_dim, groups, hash_algorithm, hash_seed; each refused
//   naming the field, then the true layout accepted), layout-engine (a decode engine with another block size:
//   refused at hand-shake).
// The last line: pd: PASS|FAIL requests=N identical=N bytes_moved=B leaked_blocks=P/D ...
#include <signal.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include <pagedkv/nixl/nixl_transfer.hpp>

#include "engine.hpp"
#include "nixl_capi.hpp"
#include "replay_mode.hpp"
#include "wire.hpp"

namespace pd {
namespace {

namespace tx = pagedkv::transfer;
namespace capi = pagedkv::nixl::capi;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string role = "both";
  std::uint16_t port = 0;
  std::string port_file;
  int requests = 12;
  int decode_tokens = 8;
  std::uint64_t seed = 7;
  int block_size = 16;
  int num_blocks = 257;
  int window = 0;  // > 0: a hybrid model, the odd layers sliding-window layers of this many tokens (EngineShape)
  int lease_ms = 2000;
  int reps = 10;
  int inflight = 4;
  std::string fault = "none";
  int fault_request = 3;
  std::string on_failure = "recompute";
  ReplayOptions replay;
};

// The requests: conversations over 3 system prompts (64, 48 and 0 tokens) + a user part of 20..140 tokens, so
// the decode engine hits its own prefix cache for the system prompts it imported before.
std::vector<std::vector<TokenId>> make_requests(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::vector<std::vector<TokenId>> sys(3);
  const int sys_len[3] = {64, 48, 0};
  for (int s = 0; s < 3; ++s)
    for (int i = 0; i < sys_len[s]; ++i) sys[s].push_back(static_cast<TokenId>(rng() % 32000));
  std::vector<std::vector<TokenId>> out;
  for (int r = 0; r < o.requests; ++r) {
    std::vector<TokenId> p = sys[static_cast<std::size_t>(r % 3)];
    const int n = 20 + static_cast<int>(rng() % 121);
    for (int i = 0; i < n; ++i) p.push_back(static_cast<TokenId>(rng() % 32000));
    out.push_back(std::move(p));
  }
  return out;
}

EngineShape shape_of(const Options& o) {
  EngineShape s;
  s.block_size = o.block_size;
  s.num_blocks = o.num_blocks;
  s.window = o.window;
  return s;
}

// One engine doing both: admit, compute the prompt, decode; the reference outputs of every request.
std::vector<std::vector<float>> run_both(const Options& o, const std::vector<std::vector<TokenId>>& reqs,
                                         std::size_t* leaked) {
  Engine e(shape_of(o));
  std::vector<std::vector<float>> out;
  for (std::size_t r = 0; r < reqs.size(); ++r) {
    const SeqId seq = r + 1;
    if (!e.manager().try_admit(seq, reqs[r]).admitted()) throw std::runtime_error("both: admission failed");
    out.push_back(e.run_to_end(seq, reqs[r], o.decode_tokens));
  }
  *leaked = e.blocks_used();
  return out;
}

std::uint64_t digest(const std::vector<float>& v) {
  std::uint64_t h = 0;
  for (float f : v) {
    std::uint32_t b = 0;
    std::memcpy(&b, &f, 4);
    h = decode_loop::splitmix64(h ^ b);
  }
  return h;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill role

int run_prefill(const Options& o) {
  const auto reqs = make_requests(o);
  Engine e(shape_of(o));
  auto& m = e.manager();
  tx::NixlAgent agent("prefill");
  agent.register_pool(e.pool_desc());
  std::uint16_t port = 0;
  const int lfd = Channel::listen_loopback(o.port, &port);
  if (!o.port_file.empty()) {
    std::ofstream(o.port_file + ".tmp") << port << "\n";
    std::rename((o.port_file + ".tmp").c_str(), o.port_file.c_str());
  }
  std::printf("prefill: listening on 127.0.0.1:%u (pid %d)\n", port, static_cast<int>(::getpid()));
  std::fflush(stdout);
  // The hand-shake: hello (engine id, host, port, pid, fingerprint, NIXL metadata); the decode engine answers with
  // its NIXL metadata, or refuses (naming the field that differs) and says whether another hand-shake follows.
  std::optional<Channel> chan;
  for (;;) {
    chan.reset();
    chan.emplace(Channel::accept_one(lfd, 30000));
    Writer w;
    w.str("prefill");
    w.str("127.0.0.1");
    w.u64(port);
    w.u64(static_cast<std::uint64_t>(::getpid()));
    put_fingerprint(w, e.fingerprint());
    w.bytes(agent.export_metadata());
    chan->send(Msg::kHello, w.out);
    std::optional<std::pair<Msg, std::vector<std::byte>>> msg;
    while (!(msg = chan->recv(30000))) {
    }
    Reader r{msg->second};
    if (msg->first == Msg::kHelloBack) {
      agent.load_remote(r.bytes());
      break;
    }
    if (msg->first != Msg::kRefuse) throw std::runtime_error("prefill: unexpected message during the hand-shake");
    std::printf("prefill: the decode engine refused the hand-shake: %s\n", r.str().c_str());
    if (r.u64() == 0) {
      ::close(lfd);
      std::printf("prefill: leaked_blocks=%zu\n", e.blocks_used());
      return e.blocks_used() == 0 ? 0 : 1;
    }
  }
  ::close(lfd);
  Channel& ch = *chan;
  std::uint64_t stale_refused = 0, claims = 0, late_notifications = 0;
  int last_request = -1;  // the request of the last kPrefill (the decode side claims it before the next kPrefill)
  bool bye = false;
  Clock::time_point bye_deadline{};
  for (;;) {
    for (const tx::Notification& n : agent.take_notifications()) {
      if (n.message.rfind("read-done:", 0) == 0) {
        const auto s = m.release_lease(std::stoull(n.message.substr(10)));
        if (s != pagedkv::ExternalSignal::kApplied) ++late_notifications;
      }
    }
    m.reap_external(Clock::now());
    if (bye && (m.stats().external.holds_active == 0 || Clock::now() > bye_deadline)) break;
    std::optional<std::pair<Msg, std::vector<std::byte>>> msg;
    try {
      msg = ch.recv(0);  // no NIXL progress thread: this loop serves the consumer's READs, so it polls often
    } catch (const std::exception& ex) {
      std::fprintf(stderr, "prefill: %s\n", ex.what());
      return 1;
    }
    if (!msg) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      continue;
    }
    Reader r{msg->second};
    switch (msg->first) {
      case Msg::kPrefill: {
        const std::uint64_t id = r.u64();
        last_request = static_cast<int>(id);
        const SeqId seq = id + 1;
        const auto& prompt = reqs.at(id);
        if (!m.try_admit(seq, prompt).admitted()) throw std::runtime_error("prefill: admission failed");
        (void)e.compute_pending(seq, prompt);
        const auto lease_end = Clock::now() + std::chrono::milliseconds(o.lease_ms);
        WireDescriptor d{m.finish_with_lease(seq, e.fingerprint(), lease_end), "prefill", "127.0.0.1", port};
        if (o.fault == "stale" && static_cast<int>(id) == o.fault_request) {
          // The lease ends early (as if it had expired) and the blocks are reused by other sequences before the
          // descriptor reaches the consumer: its claim must be refused by generation.
          m.release_lease(d.desc.hold_id);
          std::vector<SeqId> fill;
          std::size_t reused = 0;
          for (SeqId s = 1000000;; ++s) {
            std::vector<TokenId> t(static_cast<std::size_t>(o.block_size) * 4);
            for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<TokenId>(s * 131 + i);
            if (!m.try_admit(s, t).admitted()) break;
            fill.push_back(s);
            for (auto b : m.block_ids(s))
              reused += static_cast<std::size_t>(std::count(d.desc.blocks.begin(), d.desc.blocks.end(), b));
          }
          for (SeqId s : fill) m.free(s);
          std::printf("prefill: fault stale: lease %llu ended, %zu of its %zu blocks reused before the descriptor "
                      "was sent\n", static_cast<unsigned long long>(d.desc.hold_id), reused, d.desc.blocks.size());
        }
        Writer w;
        put_descriptor(w, d);
        ch.send(Msg::kDescriptor, w.out);
        break;
      }
      case Msg::kClaim: {
        ++claims;
        const std::uint64_t hold = r.u64();
        const std::uint64_t n = r.u64();
        std::vector<std::uint32_t> blocks(n), gens(n);
        for (std::uint64_t i = 0; i < n; ++i) {
          blocks[i] = static_cast<std::uint32_t>(r.u64());
          gens[i] = static_cast<std::uint32_t>(r.u64());
        }
        // The whole claim in one call: every entry a block of this hold at its current generation.
        const pagedkv::ClaimCheck cc = m.check_claim(hold, blocks, gens);
        std::string stale;
        if (!cc.ok()) {
          static constexpr const char* kWhy[] = {"ok", "unknown hold (lease ended, expired or never issued)",
                                                 "block not in the hold", "stale generation"};
          stale = std::string(kWhy[static_cast<int>(cc.status)]) + " at entry " + std::to_string(cc.entry) +
                  " of lease " + std::to_string(hold);
          if (cc.entry < n) {
            stale += ": block " + std::to_string(blocks[cc.entry]) + " generation " + std::to_string(gens[cc.entry]);
          }
          if (cc.status == pagedkv::ClaimStatus::kStaleGeneration) {
            stale += " (now " + std::to_string(cc.current_generation) + ")";
          }
          if (cc.status == pagedkv::ClaimStatus::kUnknownHold) {  // an ended lease: are its blocks reused?
            for (std::uint64_t i = 0; i < n; ++i) {
              if (!m.is_current_block(blocks[i], gens[i])) {
                stale += "; block " + std::to_string(blocks[i]) + " generation " + std::to_string(gens[i]) +
                         " is no longer current (reused)";
                break;
              }
            }
          }
        }
        if (!stale.empty()) {
          ++stale_refused;
          Writer w;
          w.str(stale);
          ch.send(Msg::kClaimStale, w.out);
        } else {
          m.extend_lease(hold, Clock::now() + std::chrono::milliseconds(o.lease_ms));  // the claim is a heartbeat
          ch.send(Msg::kClaimOk);
          if (o.fault == "kill" && last_request == o.fault_request) {
            // Stop serving (no NIXL progress here) so the READ is still in flight when the decode engine kills this
            // process: the kill lands mid-transfer, not after it.
            std::this_thread::sleep_for(std::chrono::seconds(60));
          }
        }
        break;
      }
      case Msg::kRelease:
        m.release_lease(r.u64());
        break;
      case Msg::kBye:
        bye = true;
        bye_deadline = Clock::now() + std::chrono::milliseconds(o.lease_ms + 3000);
        break;
      default:
        std::fprintf(stderr, "prefill: unexpected message %u\n", static_cast<unsigned>(msg->first));
        return 1;
    }
  }
  const auto x = m.stats().external;
  Writer w;
  w.u64(e.blocks_used());
  w.u64(x.leases_started);
  w.u64(x.leases_released);
  w.u64(x.leases_expired);
  w.u64(stale_refused);
  w.u64(claims);
  w.u64(late_notifications);
  ch.send(Msg::kStats, w.out);
  std::printf("prefill: leaked_blocks=%zu leases=%llu released=%llu expired=%llu stale_refused=%llu\n",
              e.blocks_used(), static_cast<unsigned long long>(x.leases_started),
              static_cast<unsigned long long>(x.leases_released), static_cast<unsigned long long>(x.leases_expired),
              static_cast<unsigned long long>(stale_refused));
  // Keep progressing a moment so the last notifications and messages drain, then leave.
  for (int i = 0; i < 50; ++i) {
    (void)agent.take_notifications();
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return e.blocks_used() == 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------------------------------------------
// Decode role

// --fault layout: the fingerprint fields a hand-shake must refuse, in first_mismatch's order.
constexpr const char* kLayoutFields[] = {"block_size", "page_layout", "dtype",          "num_kv_heads",
                                         "head_dim",   "groups",      "hash_algorithm", "hash_seed"};

// `fp` with one field changed (as an engine with another block size, page layout, dtype, GQA, head size, KV-cache
// groups or hash configuration would present it).
pagedkv::KvLayoutFingerprint with_field_changed(pagedkv::KvLayoutFingerprint fp, const std::string& field) {
  if (field == "block_size") fp.block_size *= 2;
  else if (field == "page_layout") fp.page_layout = fp.page_layout == "nhd" ? "hnd" : "nhd";
  else if (field == "dtype") fp.dtype = fp.dtype == "bf16" ? "fp32" : "bf16";
  else if (field == "num_kv_heads") fp.num_kv_heads *= 2;
  else if (field == "head_dim") fp.head_dim /= 2;
  else if (field == "groups") fp.groups.push_back(fp.groups.empty() ? pagedkv::KVCacheGroupSpec{} : fp.groups.back());
  else if (field == "hash_algorithm") fp.hash_algorithm = pagedkv::BlockIdentityConvention::kVllmSha256Cbor;
  else if (field == "hash_seed") fp.hash_seed += 1;
  else throw std::invalid_argument("with_field_changed: unknown field '" + field + "'");
  return fp;
}

struct DecodeReport {
  int requests = 0, identical = 0, completed = 0, failed = 0, handoffs = 0, recomputed = 0, local = 0;
  std::uint64_t outputs_digest = 0;  // over every request's outputs, as --role both prints it
  std::uint64_t bytes_moved = 0, blocks_moved = 0, blocks_skipped = 0;
  std::uint64_t blocks_left_out = 0;  // null pairs of the tickets (a window group's blocks outside the window)
  std::vector<double> ours_gbps, raw_gbps, repost_made_gbps, repost_created_gbps, pair_ratio;  // per timed round
  std::string refused;
  bool prefill_killed = false;
  std::size_t max_inflight = 0;  // the most hand-off READs posted at once
  std::size_t layout_fields_refused = 0;  // --fault layout: hand-shakes refused naming the changed field
  std::string layout_refusals;             // their fields
  long long prefill_leaked = -1;
  std::uint64_t leases = 0, released = 0, expired = 0, stale_refused = 0;
};

// The raw NIXL baseline: the C API call sequence NixlAgent uses for a hand-off, without pagedkv. Descriptor lists
// of every (region, block) of both pools are prepared once (prep_xfer_dlist, as register_pool / load_remote do);
// each READ is a fresh request from them (make_xfer_req over the blocks' indices), posted, polled to the end, then
// released and destroyed. What pagedkv's submit / poll / release add on top is only its own bookkeeping (checking
// the descriptor, the request map, the index scratch vectors).
class RawNixl {
 public:
  RawNixl(tx::NixlAgent& agent, const tx::PoolDesc& local, const tx::PoolDesc& remote, const std::string& peer)
      : api_(capi::load().api),
        agent_(static_cast<capi::Agent>(agent.native_agent())),
        args_(static_cast<capi::OptArgs>(agent.native_backend_args())),
        local_nb_(local.num_blocks),
        remote_nb_(remote.num_blocks) {
    local_ = prep("", local);
    remote_ = prep(peer.c_str(), remote);
  }
  ~RawNixl() {
    if (local_) api_.release_xfer_dlist_handle(agent_, local_);
    if (remote_) api_.release_xfer_dlist_handle(agent_, remote_);
  }
  RawNixl(const RawNixl&) = delete;
  RawNixl& operator=(const RawNixl&) = delete;

  // One READ of (lb[i] <- rb[i]) in every region: a fresh request, posted, polled, released. False on failure.
  bool read(std::span<const tx::BlockId> lb, std::span<const tx::BlockId> rb, std::size_t regions) {
    capi::XferReq req = make_once(lb, rb, regions);
    if (req == nullptr) return false;
    int s = api_.post_xfer_req(agent_, req, args_);
    while (s == capi::kInProgress) s = api_.get_xfer_status(agent_, req);
    if (api_.release_xfer_req(agent_, req) == capi::kSuccess) api_.destroy_xfer_req(req);
    return s == capi::kSuccess;
  }

  // A request for (lb[i] <- rb[i]) in every region from the prepared lists (nullptr on failure). Also the old
  // baselines, kept for the comparison in docs/benchmarks.md: ONE request made once (here, or `create_once` from
  // plain descriptor lists) and re-posted for every READ.
  capi::XferReq make_once(std::span<const tx::BlockId> lb, std::span<const tx::BlockId> rb, std::size_t regions) {
    li_.clear();
    ri_.clear();
    for (std::size_t r = 0; r < regions; ++r)
      for (std::size_t i = 0; i < lb.size(); ++i) {
        li_.push_back(static_cast<int>(r * local_nb_ + lb[i]));
        ri_.push_back(static_cast<int>(r * remote_nb_ + rb[i]));
      }
    capi::XferReq req = nullptr;
    if (api_.make_xfer_req(agent_, capi::kRead, local_, li_.data(), li_.size(), remote_, ri_.data(), ri_.size(), &req,
                           args_) != capi::kSuccess)
      return nullptr;
    return req;
  }
  capi::XferReq create_once(const tx::PoolDesc& local, const tx::PoolDesc& remote, std::span<const tx::BlockId> lb,
                            std::span<const tx::BlockId> rb, const char* peer) {
    capi::XferDlist ld = nullptr, rd = nullptr;
    api_.create_xfer_dlist(capi::kDram, &ld);
    api_.create_xfer_dlist(capi::kDram, &rd);
    for (std::size_t reg = 0; reg < local.regions.size(); ++reg)
      for (std::size_t i = 0; i < lb.size(); ++i) {
        const auto& l = local.regions[reg];
        const auto& r = remote.regions[reg];
        api_.xfer_dlist_add_desc(ld, l.base_addr + lb[i] * l.stride_bytes, l.block_bytes, 0);
        api_.xfer_dlist_add_desc(rd, r.base_addr + rb[i] * r.stride_bytes, r.block_bytes, 0);
      }
    capi::XferReq req = nullptr;
    if (api_.create_xfer_req(agent_, capi::kRead, ld, rd, peer, &req, args_) != capi::kSuccess) req = nullptr;
    api_.destroy_xfer_dlist(ld);
    api_.destroy_xfer_dlist(rd);
    return req;
  }
  bool repost(capi::XferReq req) {
    if (req == nullptr) return false;
    int s = api_.post_xfer_req(agent_, req, args_);
    while (s == capi::kInProgress) s = api_.get_xfer_status(agent_, req);
    return s == capi::kSuccess;
  }
  void drop(capi::XferReq req) {
    if (req != nullptr && api_.release_xfer_req(agent_, req) == capi::kSuccess) api_.destroy_xfer_req(req);
  }

 private:
  capi::XferDlistHandle prep(const char* name, const tx::PoolDesc& p) {
    capi::XferDlist dl = nullptr;
    if (api_.create_xfer_dlist(capi::kDram, &dl) != capi::kSuccess) throw std::runtime_error("raw: create_xfer_dlist");
    for (const auto& r : p.regions)
      for (std::uint32_t b = 0; b < p.num_blocks; ++b)
        api_.xfer_dlist_add_desc(dl, r.base_addr + std::uintptr_t{b} * r.stride_bytes, r.block_bytes, 0);
    capi::XferDlistHandle h = nullptr;
    const int s = api_.prep_xfer_dlist(agent_, name, dl, &h, args_);
    api_.destroy_xfer_dlist(dl);
    if (s != capi::kSuccess) throw std::runtime_error("raw: prep_xfer_dlist");
    return h;
  }

  const capi::Api& api_;
  capi::Agent agent_;
  capi::OptArgs args_;
  std::size_t local_nb_, remote_nb_;
  capi::XferDlistHandle local_ = nullptr, remote_ = nullptr;
  std::vector<int> li_, ri_;
};

// Times `reps` rounds of READs of the same blocks, each round one READ of each of four paths in a rotating order:
// pagedkv's submit / poll / release, raw NIXL (RawNixl::read: the same call sequence, a fresh request per READ),
// and the old baselines, one request re-posted (made from the prepared lists; created from plain lists). The
// ratio is the median over rounds of pagedkv's GB/s over raw's in the same round. Returns false on a failed READ.
// The (local, remote) block pairs one READ moves. A pair with the null block 0 on either side holds nothing to move:
// a window group's blocks outside the consumer's first window are null in the descriptor, the plan and the ticket
// (docs/disaggregation.md). Precondition: local.size() == remote.size() (the ticket pairs with the plan).
struct BlockPairs {
  std::vector<tx::BlockId> local, remote;
};
BlockPairs non_null_pairs(std::span<const tx::BlockId> local, std::span<const tx::BlockId> remote) {
  if (local.size() != remote.size()) {
    throw std::runtime_error("decode: " + std::to_string(local.size()) + " local blocks for " +
                             std::to_string(remote.size()) + " remote blocks");
  }
  BlockPairs p;
  for (std::size_t k = 0; k < local.size(); ++k) {
    if (local[k] == 0 || remote[k] == 0) continue;
    p.local.push_back(local[k]);
    p.remote.push_back(remote[k]);
  }
  return p;
}

bool time_reads(tx::NixlAgent& agent, RawNixl& raw, const tx::PoolDesc& local, const tx::PoolDesc& remote,
                std::span<const tx::BlockId> lb, std::span<const tx::BlockId> rb, const std::string& peer, int reps,
                DecodeReport& rep) {
  if (reps <= 0) return true;
  const std::size_t regions = local.regions.size();
  const double bytes = static_cast<double>(lb.size() * local.bytes_per_block());
  capi::XferReq made = raw.make_once(lb, rb, regions);
  capi::XferReq created = raw.create_once(local, remote, lb, rb, peer.c_str());
  bool ok = made != nullptr && created != nullptr;
  ok = ok && raw.read(lb, rb, regions);  // one untimed READ first: the first READ of new blocks is the slow one
  ok = ok && raw.repost(made) && raw.repost(created);  // and each re-posted request's first post
  for (int it = 0; ok && it < reps; ++it) {
    double gbps[4] = {};
    for (int k = 0; ok && k < 4; ++k) {
      const int which = (it + k) % 4;
      const auto t0 = Clock::now();
      if (which == 0) {
        const tx::RequestId id = agent.submit({tx::TransferOp::kRead, 0, lb, peer, 0, rb, ""});
        tx::RequestState st;
        while ((st = agent.poll(id)).status == tx::TransferStatus::kInProgress) {
        }
        agent.release(id);
        ok = st.status == tx::TransferStatus::kDone;
      } else if (which == 1) {
        ok = raw.read(lb, rb, regions);
      } else {
        ok = raw.repost(which == 2 ? made : created);
      }
      gbps[which] = bytes / std::chrono::duration<double>(Clock::now() - t0).count() / 1e9;
    }
    if (!ok) break;
    rep.ours_gbps.push_back(gbps[0]);
    rep.raw_gbps.push_back(gbps[1]);
    rep.repost_made_gbps.push_back(gbps[2]);
    rep.repost_created_gbps.push_back(gbps[3]);
    rep.pair_ratio.push_back(gbps[0] / gbps[1]);
  }
  raw.drop(made);
  raw.drop(created);
  return ok;
}

// Waits for a message of type `want` while driving NIXL progress; throws when the peer closed.
std::vector<std::byte> expect(Channel& ch, tx::NixlAgent& agent, Msg want, Msg alt, Msg* got, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    (void)agent.take_notifications();
    if (auto m = ch.recv(1)) {
      if (m->first != want && m->first != alt) {
        throw std::runtime_error("unexpected message " + std::to_string(static_cast<unsigned>(m->first)));
      }
      if (got) *got = m->first;
      return std::move(m->second);
    }
  }
  throw std::runtime_error("no answer from the prefill engine in " + std::to_string(timeout_ms) + " ms");
}

int run_decode(const Options& o) {
  const auto reqs = make_requests(o);
  std::size_t ref_leaked = 0;
  const auto reference = run_both(o, reqs, &ref_leaked);
  const bool fail_policy = o.on_failure == "fail";
  Engine e(shape_of(o));
  auto& m = e.manager();
  tx::NixlAgent agent("decode");
  agent.register_pool(e.pool_desc());
  DecodeReport rep;
  if (o.fault == "layout") {
    // One refused hand-shake per fingerprint field, each on its own connection to the same prefill process: this
    // engine presents its fingerprint with that one field changed, and must refuse naming the field. The prefill
    // process accepts again after each refusal; the last hand-shake (below) presents the true fingerprint.
    for (const char* field : kLayoutFields) {
      Channel c = Channel::connect_loopback(o.port, 30000);
      Msg t{};
      const auto hello = expect(c, agent, Msg::kHello, Msg::kHello, &t, 30000);
      Reader r{hello};
      for (int k = 0; k < 2; ++k) (void)r.str();
      for (int k = 0; k < 2; ++k) (void)r.u64();
      const pagedkv::KvLayoutFingerprint theirs = get_fingerprint(r);
      const pagedkv::KvLayoutFingerprint ours = with_field_changed(e.fingerprint(), field);
      const auto mm = pagedkv::first_mismatch(ours, theirs);
      const std::string what = mm ? *mm : std::string("(no difference found)");
      std::printf("decode: hand-shake with %s changed: refused: layout fingerprints differ at %s\n", field,
                  what.c_str());
      if (mm && mm->rfind(field, 0) == 0) ++rep.layout_fields_refused;
      rep.layout_refusals += (rep.layout_refusals.empty() ? "" : ",") + std::string(field);
      Writer w;
      w.str("layout fingerprints differ at " + what + " (decode vs prefill)");
      w.u64(1);  // another hand-shake follows
      c.send(Msg::kRefuse, w.out);
    }
  }
  Channel ch = Channel::connect_loopback(o.port, 30000);
  pid_t prefill_pid = 0;
  bool alive = true;
  std::string peer;
  {
    Msg t{};
    const auto hello = expect(ch, agent, Msg::kHello, Msg::kHello, &t, 30000);
    Reader r{hello};
    const std::string engine_id = r.str();
    (void)r.str();
    (void)r.u64();
    prefill_pid = static_cast<pid_t>(r.u64());
    const pagedkv::KvLayoutFingerprint theirs = get_fingerprint(r);
    const std::vector<std::byte> md = r.bytes();
    // The hand-shake: the layouts must match before any request (vLLM #42895 found a block-size mismatch per
    // request). Ours vs theirs; the message names the first field that differs.
    if (auto mm = pagedkv::first_mismatch(e.fingerprint(), theirs)) {
      rep.refused = *mm;
      Writer w;
      w.str("layout fingerprints differ at " + *mm + " (decode vs prefill)");
      w.u64(0);  // no other hand-shake follows
      ch.send(Msg::kRefuse, w.out);
      std::printf("decode: hand-shake refused: layout fingerprints differ at %s (decode vs prefill)\n", mm->c_str());
    } else {
      peer = agent.load_remote(md);
      Writer w;
      w.bytes(agent.export_metadata());
      ch.send(Msg::kHelloBack, w.out);
      std::printf("decode: hand-shake with '%s' (pid %d): layouts match; NIXL %s\n", engine_id.c_str(),
                  static_cast<int>(prefill_pid), tx::nixl_library().version.c_str());
    }
  }
  const std::size_t bpb = e.pool_desc().bytes_per_block();
  std::optional<RawNixl> raw;  // the raw NIXL baseline's own prepared descriptor lists (once, as pagedkv's)
  if (rep.refused.empty() && o.reps > 0) raw.emplace(agent, e.pool_desc(), agent.remote_pools(peer)[0], peer);
  // Up to --inflight hand-offs' READs stay posted at once: the decode engine posts a hand-off's READ and goes on
  // with the next request (its prefill, descriptor, import plan, claim); when --inflight READs are posted, it
  // completes every one that has ended (complete_external_fill, then decoding), in whatever order they ended, as a
  // scheduler step would. A READ still in progress 5 s after it was posted means the peer is gone: the peer is
  // invalidated and every READ posted to it ends failed.
  struct InFlight {
    std::size_t i = 0;
    tx::RequestId id = 0;
    std::uint64_t fill_id = 0;
    std::size_t num_blocks = 0, pool_blocks = 0;
    Clock::time_point deadline{};
  };
  std::vector<InFlight> inflight;
  std::vector<std::vector<float>> outputs(reqs.size());
  std::vector<char> failed(reqs.size(), 0), ran(reqs.size(), 0);
  std::size_t max_inflight = 0;
  auto decode_here = [&](std::size_t i) {
    const SeqId seq = i + 1;
    if (!m.contains(seq) && !m.try_admit(seq, reqs[i]).admitted()) throw std::runtime_error("decode: admission");
    outputs[i] = e.run_to_end(seq, reqs[i], o.decode_tokens);
    ran[i] = 1;
  };
  auto finish = [&](const InFlight& f, const tx::RequestState& st) {
    agent.release(f.id);
    if (st.status == tx::TransferStatus::kDone) {
      rep.bytes_moved += f.pool_blocks * bpb;
      rep.blocks_moved += f.pool_blocks;
      m.complete_external_fill(f.fill_id, f.num_blocks);
    } else {
      std::printf("decode: request %zu: READ failed (%s: %s); fill failed, policy %s\n", f.i,
                  tx::to_string(st.reason), agent.last_error().c_str(), o.on_failure.c_str());
      const auto c2 = m.complete_external_fill(
          f.fill_id, std::size_t{0},
          fail_policy ? pagedkv::ExternalFailurePolicy::kFail : pagedkv::ExternalFailurePolicy::kRecompute);
      if (c2.sequence_failed) {
        failed[f.i] = 1;
        ++rep.failed;
        return;
      }
      ++rep.recomputed;
    }
    decode_here(f.i);
  };
  // Once `limit` READs are posted: completes every one that has ended (in the order they ended), waiting for the
  // first to end if none has, until fewer than `limit` stay posted.
  auto drain = [&](std::size_t limit) {
    while (!inflight.empty() && inflight.size() >= limit) {
      for (std::size_t k = 0; k < inflight.size();) {
        const tx::RequestState st = agent.poll(inflight[k].id);
        if (st.status == tx::TransferStatus::kInProgress) {
          ++k;
          continue;
        }
        const InFlight f = inflight[k];
        inflight.erase(inflight.begin() + static_cast<std::ptrdiff_t>(k));
        finish(f, st);
      }
      if (!inflight.empty() && Clock::now() > inflight.front().deadline) {
        agent.invalidate_remote(peer);  // the peer is gone: its requests end kFailed / peer_invalidated
      }
    }
  };
  for (std::size_t i = 0; rep.refused.empty() && i < reqs.size(); ++i) {
    const SeqId seq = i + 1;
    const auto& prompt = reqs[i];
    const bool faulty = static_cast<int>(i) == o.fault_request;
    ++rep.requests;
    if (!alive) {
      decode_here(i);  // the prefill engine is gone: compute here
      ++rep.local;
      continue;
    }
    // kPrefill's payload: the request id (both engines generate the same prompts from --seed).
    Writer p;
    p.u64(i);
    ch.send(Msg::kPrefill, p.out);
    Msg t{};
    const auto body = expect(ch, agent, Msg::kDescriptor, Msg::kDescriptor, &t, 60000);
    Reader r{body};
    const WireDescriptor wd = get_descriptor(r);
    const auto plan = m.plan_import(wd.desc, e.fingerprint(), prompt);
    rep.blocks_skipped += plan.skipped_blocks;
    if (plan.num_blocks == 0) {
      Writer rl;
      rl.u64(wd.desc.hold_id);
      ch.send(Msg::kRelease, rl.out);
      decode_here(i);
      continue;
    }
    // The plan overload: the ticket pairs with the plan (or it throws, nothing changed, when the local hit moved).
    const auto adm = m.try_admit_external(seq, prompt, plan);
    if (!adm.admit.admitted()) throw std::runtime_error("decode: no capacity for request " + std::to_string(i));
    const auto& tk = adm.ticket;
    Writer c;
    c.u64(wd.desc.hold_id);
    c.u64(plan.remote_blocks.size());
    for (std::size_t k = 0; k < plan.remote_blocks.size(); ++k) {
      c.u64(plan.remote_blocks[k]);
      c.u64(plan.remote_generations[k]);
    }
    ch.send(Msg::kClaim, c.out);
    Msg ans{};
    const auto cb = expect(ch, agent, Msg::kClaimOk, Msg::kClaimStale, &ans, 30000);
    if (ans == Msg::kClaimStale) {
      Reader cr{cb};
      std::printf("decode: request %zu: claim refused: %s; recomputing it here\n", i, cr.str().c_str());
      m.abort_sequence(seq, /*transfer_quiescent=*/true);  // no READ was posted
      if (!m.try_admit(seq, prompt).admitted()) throw std::runtime_error("decode: readmission failed");
      ++rep.recomputed;
      decode_here(i);
      continue;
    }
    const BlockPairs pairs = non_null_pairs(tk.blocks, plan.remote_blocks);
    rep.blocks_left_out += tk.blocks.size() - pairs.local.size();
    if (!faulty || o.fault == "none")
      if (!time_reads(agent, *raw, e.pool_desc(), agent.remote_pools(peer)[0], pairs.local, pairs.remote, peer,
                      o.reps, rep))
        throw std::runtime_error("decode: a timed READ failed: " + agent.last_error());
    const std::string note = faulty && o.fault == "drop-notify" ? "" : "read-done:" + std::to_string(wd.desc.hold_id);
    ++rep.handoffs;
    inflight.push_back({i, agent.submit({tx::TransferOp::kRead, 0, pairs.local, peer, 0, pairs.remote, note}),
                        tk.fill_id, tk.num_blocks(), pairs.local.size(), Clock::now() + std::chrono::seconds(5)});
    max_inflight = std::max(max_inflight, inflight.size());
    if (faulty && o.fault == "kill") {
      ::kill(prefill_pid, SIGKILL);
      rep.prefill_killed = true;
      alive = false;
      std::printf("decode: request %zu: READ posted (%zu in flight), prefill (pid %d) killed with SIGKILL\n", i,
                  inflight.size(), static_cast<int>(prefill_pid));
    }
    drain(static_cast<std::size_t>(o.inflight));
  }
  drain(1);
  rep.max_inflight = max_inflight;
  for (std::size_t i = 0; i < static_cast<std::size_t>(rep.requests); ++i) {
    rep.outputs_digest = decode_loop::splitmix64(rep.outputs_digest ^ digest(outputs[i]));
    if (failed[i]) continue;
    ++rep.completed;
    if (ran[i] && outputs[i] == reference[i]) ++rep.identical;  // NaN never equals: poisoned outputs never match
    else
      std::printf("decode: request %zu: outputs differ from one engine doing both\n", i);
  }
  if (alive) {
    ch.send(Msg::kBye);
    if (rep.refused.empty()) {
      Msg t{};
      const auto st = expect(ch, agent, Msg::kStats, Msg::kStats, &t, o.lease_ms + 10000);
      Reader r{st};
      rep.prefill_leaked = static_cast<long long>(r.u64());
      rep.leases = r.u64();
      rep.released = r.u64();
      rep.expired = r.u64();
      rep.stale_refused = r.u64();
    } else {
      rep.prefill_leaked = 0;  // nothing was admitted there (it prints its own count)
    }
  }
  const std::size_t decode_leaked = e.blocks_used();
  raw.reset();
  const double ours = median(rep.ours_gbps), raw_gbps = median(rep.raw_gbps);
  bool pass = decode_leaked == 0 && ref_leaked == 0 && rep.identical == rep.completed;
  if (!rep.prefill_killed) pass = pass && rep.prefill_leaked == 0;
  if (o.fault == "none") pass = pass && rep.completed == rep.requests && rep.refused.empty() && rep.recomputed == 0;
  if (o.fault == "none")  // the window was used: --inflight READs posted at once (fewer hand-offs: all of them)
    pass = pass && rep.max_inflight == std::min(static_cast<std::size_t>(o.inflight),
                                                static_cast<std::size_t>(rep.handoffs));
  if (o.fault == "layout-engine") pass = pass && rep.refused.rfind("block_size", 0) == 0;
  if (o.fault == "layout")  // every field refused, named; then the true layout accepted and every request served
    pass = pass && rep.layout_fields_refused == std::size(kLayoutFields) && rep.refused.empty() &&
           rep.completed == rep.requests;
  if (o.fault == "stale") pass = pass && rep.stale_refused == 1 && rep.recomputed == 1;
  // Every lease ended, by its read-done or its deadline: the dropped one can only have expired. A lease whose
  // read-done came later than --lease-ms (a loaded machine) expires too; its late read-done is counted, never a crash.
  if (o.fault == "drop-notify")
    pass = pass && rep.expired >= 1 && rep.released + rep.expired == static_cast<std::uint64_t>(rep.handoffs);
  if (o.fault == "kill") pass = pass && rep.prefill_killed && (rep.recomputed + rep.failed) >= 1;
  if (o.fault == "layout")
    std::printf("decode: layout hand-shakes refused naming the changed field: %zu of %zu (%s)\n",
                rep.layout_fields_refused, std::size(kLayoutFields), rep.layout_refusals.c_str());
  const std::string pl = rep.prefill_killed ? "killed" : std::to_string(rep.prefill_leaked);
  std::printf("pd: %s requests=%d identical=%d bytes_moved=%llu leaked_blocks=%s/%zu fault=%s handoffs=%d "
              "blocks_moved=%llu blocks_skipped=%llu blocks_left_out=%llu recomputed=%d failed=%d local=%d leases=%llu released=%llu "
              "expired=%llu stale_refused=%llu gbps=%.2f raw_gbps=%.2f ratio=%.3f rounds=%zu repost_made_gbps=%.2f "
              "repost_created_gbps=%.2f max_inflight=%zu outputs_digest=%016llx%s%s\n",
              pass ? "PASS" : "FAIL", rep.requests, rep.identical, static_cast<unsigned long long>(rep.bytes_moved),
              pl.c_str(), decode_leaked, o.fault.c_str(), rep.handoffs,
              static_cast<unsigned long long>(rep.blocks_moved), static_cast<unsigned long long>(rep.blocks_skipped),
              static_cast<unsigned long long>(rep.blocks_left_out), rep.recomputed, rep.failed, rep.local, static_cast<unsigned long long>(rep.leases),
              static_cast<unsigned long long>(rep.released), static_cast<unsigned long long>(rep.expired),
              static_cast<unsigned long long>(rep.stale_refused), ours, raw_gbps, median(rep.pair_ratio),
              rep.pair_ratio.size(), median(rep.repost_made_gbps), median(rep.repost_created_gbps), rep.max_inflight,
              static_cast<unsigned long long>(rep.outputs_digest),
              rep.refused.empty() ? "" : " refused_at=", rep.refused.c_str());
  return pass ? 0 : 1;
}

int run(const Options& o) {
  if (o.role == "both") {
    std::size_t leaked = 0;
    const auto reqs = make_requests(o);
    const auto out = run_both(o, reqs, &leaked);
    std::uint64_t h = 0;
    for (const auto& v : out) h = decode_loop::splitmix64(h ^ digest(v));
    std::printf("pd: %s requests=%zu outputs_digest=%016llx leaked_blocks=%zu\n", leaked == 0 ? "PASS" : "FAIL",
                out.size(), static_cast<unsigned long long>(h), leaked);
    return leaked == 0 ? 0 : 1;
  }
  if (o.role == "replay") return run_replay(o.replay);
  ::setenv("UCX_MODULES", "^ib", 0);
  ::setenv("UCX_NET_DEVICES", "lo", 0);
  if (o.role == "prefill") return run_prefill(o);
  return run_decode(o);
}

}  // namespace
}  // namespace pd

int main(int argc, char** argv) {
  pd::Options o;
  CLI::App app{"pagedkv-pd: prefill/decode disaggregation over NIXL on 127.0.0.1 (docs/disaggregation.md)"};
  app.add_option("--role", o.role,
                 "prefill | decode | both (one engine doing both: the reference) | replay (a trace, in process)")
      ->check(CLI::IsMember({"prefill", "decode", "both", "replay"}));
  app.add_option("--trace", o.replay.trace, "replay: the trace (Mooncake JSONL)");
  app.add_option("--limit", o.replay.limit, "replay: first N requests (0 = all)");
  app.add_option("--replay-blocks", o.replay.num_blocks, "replay: blocks per pool")->check(CLI::Range(1024, 1 << 24));
  app.add_option("--kv-bytes-per-token", o.replay.kv_bytes_per_token, "replay: model KV bytes per token")
      ->check(CLI::Range(1, 1 << 30));
  app.add_option("--prefill-tokens-per-s", o.replay.prefill_tokens_per_s, "replay: TTFT proxy's prefill rate")
      ->check(CLI::PositiveNumber);
  app.add_option("--link-gbps", o.replay.link_gbps, "replay: TTFT proxy's link rate, GB/s")->check(CLI::PositiveNumber);
  app.add_option("--port", o.port, "Control channel port on 127.0.0.1 (prefill: 0 = any free port)");
  app.add_option("--port-file", o.port_file, "prefill: write the bound port here");
  app.add_option("--requests", o.requests, "Requests")->check(CLI::Range(1, 10000));
  app.add_option("--decode-tokens", o.decode_tokens, "Tokens decoded per request")->check(CLI::Range(0, 1000));
  app.add_option("--seed", o.seed, "Seed of the prompts");
  app.add_option("--block-size", o.block_size, "Tokens per block")->check(CLI::Range(1, 256));
  app.add_option("--num-blocks", o.num_blocks, "Blocks per pool (null block included)")->check(CLI::Range(64, 100000));
  app.add_option("--window", o.window,
                 "A hybrid model: the odd layers are sliding-window layers of this many tokens, KV-cache group 1 "
                 "(0: every layer full attention)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--lease-ms", o.lease_ms, "Producer lease per hand-off (extended by each claim)")
      ->check(CLI::Range(10, 600000));
  app.add_option("--reps", o.reps, "Timed READ rounds per hand-off (pagedkv, raw NIXL and two re-posted baselines, rotated)")
      ->check(CLI::Range(0, 1000));
  app.add_option("--inflight", o.inflight, "decode: hand-off READs posted at once (each completed as it ends)")
      ->check(CLI::Range(1, 64));
  app.add_option("--fault", o.fault,
                 "none | kill | drop-notify | stale | layout (each fingerprint field changed in turn: one refused "
                 "hand-shake each, then the true one) | layout-engine (run decode with another --block-size)")
      ->check(CLI::IsMember({"none", "kill", "drop-notify", "stale", "layout", "layout-engine"}));
  app.add_option("--fault-request", o.fault_request, "The request the fault hits")->check(CLI::Range(0, 10000));
  app.add_option("--on-failure", o.on_failure, "A failed fill: recompute here, or fail the request")
      ->check(CLI::IsMember({"recompute", "fail"}));
  CLI11_PARSE(app, argc, argv);
  try {
    return pd::run(o);
  } catch (const std::exception& e) {
    std::printf("pd: FAIL %s: %s\n", o.role.c_str(), e.what());
    return 1;
  }
}
