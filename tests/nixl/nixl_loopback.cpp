// Two-process loopback test of pagedkv::nixl (issue 34): a producer process ("prefill") and a consumer process
// ("decode"), each with one NIXL agent and a DRAM pool of N blocks; they exchange metadata over pipes; the consumer
// pulls a block-table scatter (N/2 .. N remote blocks into other local block ids) with ONE READ through prepared
// descriptor lists, verifies every byte and that the blocks it did not read are untouched, and the producer checks
// the read-done notification. A second pool laid out per layer (K and V regions with gaps) takes one READ and one
// WRITE back, each verified on the receiving side. Then both time the same bytes moved by pagedkv's submit (a new request per hand-off,
// as an engine does) and by one raw NIXL request created once and re-posted, alternately, and print the medians.
// The timing is reported, never asserted (speed targets live in benchmarks).
//
// Settings (set here unless already set, and by CTest): UCX_MODULES=^ib (with Debian's libucx0 / rdma providers
// installed every NIXL process segfaults at exit otherwise), UCX_NET_DEVICES=lo (stay on loopback); NIXL's
// progress thread stays off (NixlOptions default), so no core spins.
// Exit status: 0 pass, 1 fail (including "NIXL not installed": the message names the install command).
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <pagedkv/nixl/nixl_transfer.hpp>

#include "nixl_capi.hpp"

namespace tx = pagedkv::transfer;
namespace capi = pagedkv::nixl::capi;

namespace {

struct Args {
  std::uint32_t blocks = 64;
  std::size_t block_bytes = 64 * 1024;
  int iters = 30;
};

bool write_all(int fd, const void* p, std::size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}
bool read_all(int fd, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}
bool send_blob(int fd, const std::vector<std::byte>& b) {
  const std::uint64_t n = b.size();
  return write_all(fd, &n, sizeof n) && write_all(fd, b.data(), b.size());
}
std::vector<std::byte> recv_blob(int fd) {
  std::uint64_t n = 0;
  if (!read_all(fd, &n, sizeof n) || n > (1u << 30)) return {};
  std::vector<std::byte> b(n);
  if (!read_all(fd, b.data(), n)) return {};
  return b;
}

// The producer's byte at (block, offset): a function of both, so a block landing at the wrong place shows.
std::byte pattern(std::uint32_t block, std::size_t off) {
  std::uint64_t x = (std::uint64_t{block} << 32) ^ (off / 8) ^ 0x9e3779b97f4a7c15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return static_cast<std::byte>((x >> (8 * (off % 8))) & 0xff);
}

// A second pool laid out per layer as vLLM registers K and V: two regions (K, V) of 4 KiB blocks with 1 KiB gaps
// between blocks, so a descriptor index off by one region or block, or a copy past a block, shows.
constexpr std::uint32_t kKvBlocks = 16;
constexpr std::size_t kKvBlockBytes = 4096, kKvStride = 5120;
struct KvPool {
  std::vector<std::byte> mem;
  tx::PoolDesc desc;
  explicit KvPool(std::byte fill) : mem(2 * kKvBlocks * kKvStride, fill) {
    const auto base = reinterpret_cast<std::uintptr_t>(mem.data());
    desc = {{{base, kKvBlockBytes, kKvStride}, {base + kKvBlocks * kKvStride, kKvBlockBytes, kKvStride}},
            kKvBlocks, tx::MemoryKind::kDram, 0};
  }
  std::byte* block(std::size_t region, tx::BlockId b) {
    return mem.data() + region * kKvBlocks * kKvStride + b * kKvStride;
  }
};
// Contents of K/V block `b` of the producer (salt 1000) or of what the consumer writes into the producer's block b
// (salt 5000), per region.
std::byte kv_pattern(std::uint32_t salt, std::size_t region, tx::BlockId b, std::size_t off) {
  return pattern(salt + static_cast<std::uint32_t>(100 * region) + b, off);
}
const std::vector<tx::BlockId> kKvReadRemote{3, 7, 11, 15, 0}, kKvReadLocal{10, 2, 5, 1, 8};
const std::vector<tx::BlockId> kKvWriteLocal{4, 6}, kKvWriteRemote{9, 12};

int producer(const Args& a, int rd, int wr) {
  try {
    tx::NixlAgent agent("prefill");
    std::vector<std::byte> pool(a.blocks * a.block_bytes);
    for (std::uint32_t b = 0; b < a.blocks; ++b)
      for (std::size_t o = 0; o < a.block_bytes; ++o) pool[b * a.block_bytes + o] = pattern(b, o);
    agent.register_pool({{{reinterpret_cast<std::uintptr_t>(pool.data()), a.block_bytes, a.block_bytes}},
                         a.blocks, tx::MemoryKind::kDram, 0});
    KvPool kv(std::byte{0x77});
    for (std::size_t r = 0; r < 2; ++r)
      for (tx::BlockId b = 0; b < kKvBlocks; ++b)
        for (std::size_t o = 0; o < kKvBlockBytes; ++o) kv.block(r, b)[o] = kv_pattern(1000, r, b, o);
    agent.register_pool(kv.desc);
    if (!send_blob(wr, agent.export_metadata())) return 1;
    const std::vector<std::byte> peer = recv_blob(rd);
    if (peer.empty()) return 1;
    agent.load_remote(peer);
    // Serve (drive progress and read notifications) until the consumer says goodbye.
    bool got_read_done = false, got_write_done = false, got_bye = false;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
    while (std::chrono::steady_clock::now() < deadline) {
      for (const tx::Notification& n : agent.take_notifications()) {
        if (n.message == "read-done:hand-off-0") {
          if (n.from_agent != "decode") {
            std::fprintf(stderr, "producer: read-done from '%s', expected 'decode'\n", n.from_agent.c_str());
            return 1;
          }
          if (got_read_done) {
            std::fprintf(stderr, "producer: read-done delivered twice\n");
            return 1;
          }
          got_read_done = true;
        } else if (n.message == "write-done:kv") {
          // The consumer's WRITE landed in K and V of the target blocks; nothing else changed (gaps included).
          got_write_done = true;
          std::size_t bad = 0;
          for (std::size_t r = 0; r < 2; ++r)
            for (tx::BlockId b = 0; b < kKvBlocks; ++b) {
              const bool target = std::count(kKvWriteRemote.begin(), kKvWriteRemote.end(), b) != 0;
              for (std::size_t o = 0; o < kKvStride; ++o) {
                const std::byte want = o >= kKvBlockBytes ? std::byte{0x77}
                                       : target           ? kv_pattern(5000, r, b, o)
                                                          : kv_pattern(1000, r, b, o);
                if (kv.block(r, b)[o] != want) ++bad;
              }
            }
          if (bad != 0) {
            std::fprintf(stderr, "producer: %zu K/V bytes differ after the consumer's WRITE\n", bad);
            return 1;
          }
        } else if (n.message == "bye") {
          got_bye = true;
        }
      }
      if (got_bye && got_read_done && got_write_done) return 0;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    std::fprintf(stderr, "producer: timed out (read-done %d, write-done %d, bye %d)\n", got_read_done,
                 got_write_done, got_bye);
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "producer: %s\n", e.what());
    return 1;
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int consumer(const Args& a, int rd, int wr) {
  tx::NixlAgent agent("decode");
  const tx::NixlLibraryInfo lib = tx::nixl_library();
  std::printf("nixl: %s (NIXL %s)\n", lib.path.c_str(), lib.version.c_str());
  std::vector<std::byte> pool(a.blocks * a.block_bytes, std::byte{0xEE});
  const auto base = reinterpret_cast<std::uintptr_t>(pool.data());
  agent.register_pool({{{base, a.block_bytes, a.block_bytes}}, a.blocks, tx::MemoryKind::kDram, 0});
  KvPool kv(std::byte{0xEE});
  agent.register_pool(kv.desc);
  const std::vector<std::byte> peer = recv_blob(rd);
  if (peer.empty()) {
    std::fprintf(stderr, "consumer: no metadata from the producer\n");
    return 1;
  }
  if (!send_blob(wr, agent.export_metadata())) return 1;
  const std::string name = agent.load_remote(peer);
  if (name != "prefill" || agent.remote_pools(name).size() != 2) {
    std::fprintf(stderr, "consumer: loaded '%s' with %zu pools\n", name.c_str(), agent.remote_pools(name).size());
    return 1;
  }

  // A block-table scatter: remote blocks in a shuffled order into shuffled local block ids; 7/8 of the blocks.
  std::mt19937 rng(12345);
  std::vector<tx::BlockId> remote(a.blocks), local(a.blocks);
  std::iota(remote.begin(), remote.end(), 0);
  std::iota(local.begin(), local.end(), 0);
  std::shuffle(remote.begin(), remote.end(), rng);
  std::shuffle(local.begin(), local.end(), rng);
  const std::size_t n = a.blocks - a.blocks / 8;
  remote.resize(n);
  local.resize(n);

  auto wait = [&](tx::RequestId id) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    tx::RequestState st;
    while ((st = agent.poll(id)).status == tx::TransferStatus::kInProgress &&
           std::chrono::steady_clock::now() < deadline) {
    }
    return st;
  };
  const tx::RequestId id =
      agent.submit({tx::TransferOp::kRead, 0, local, "prefill", 0, remote, "read-done:hand-off-0"});
  const tx::RequestState st = wait(id);
  if (st.status != tx::TransferStatus::kDone) {
    std::fprintf(stderr, "consumer: READ ended %s / %s (%s)\n", tx::to_string(st.status), tx::to_string(st.reason),
                 agent.last_error().c_str());
    return 1;
  }
  agent.release(id);
  std::vector<bool> written(a.blocks, false);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < n; ++i) {
    written[local[i]] = true;
    for (std::size_t o = 0; o < a.block_bytes; ++o)
      if (pool[local[i] * a.block_bytes + o] != pattern(remote[i], o)) ++bad;
  }
  for (std::uint32_t b = 0; b < a.blocks; ++b)
    if (!written[b])
      for (std::size_t o = 0; o < a.block_bytes; ++o)
        if (pool[b * a.block_bytes + o] != std::byte{0xEE}) ++bad;
  if (bad != 0) {
    std::fprintf(stderr, "consumer: %zu bytes differ after the READ\n", bad);
    return 1;
  }
  std::printf("nixl: one READ of %zu scattered blocks x %zu bytes: every byte verified, unread blocks untouched\n",
              n, a.block_bytes);

  // The per-layer K/V pool: one READ of 5 blocks (both regions), then one WRITE of 2 blocks back to the producer.
  const tx::RequestId kr = agent.submit({tx::TransferOp::kRead, 1, kKvReadLocal, "prefill", 1, kKvReadRemote, ""});
  if (const tx::RequestState ks = wait(kr); ks.status != tx::TransferStatus::kDone) {
    std::fprintf(stderr, "consumer: K/V READ ended %s (%s)\n", tx::to_string(ks.reason), agent.last_error().c_str());
    return 1;
  }
  agent.release(kr);
  for (std::size_t r = 0; r < 2; ++r)
    for (tx::BlockId b = 0; b < kKvBlocks; ++b) {
      const auto it = std::find(kKvReadLocal.begin(), kKvReadLocal.end(), b);
      for (std::size_t o = 0; o < kKvStride; ++o) {
        const std::byte want = (it == kKvReadLocal.end() || o >= kKvBlockBytes)
                                   ? std::byte{0xEE}
                                   : kv_pattern(1000, r, kKvReadRemote[it - kKvReadLocal.begin()], o);
        if (kv.block(r, b)[o] != want) ++bad;
      }
    }
  if (bad != 0) {
    std::fprintf(stderr, "consumer: %zu K/V bytes differ after the K/V READ\n", bad);
    return 1;
  }
  for (std::size_t i = 0; i < kKvWriteLocal.size(); ++i)
    for (std::size_t r = 0; r < 2; ++r)
      for (std::size_t o = 0; o < kKvBlockBytes; ++o)
        kv.block(r, kKvWriteLocal[i])[o] = kv_pattern(5000, r, kKvWriteRemote[i], o);
  const tx::RequestId kw =
      agent.submit({tx::TransferOp::kWrite, 1, kKvWriteLocal, "prefill", 1, kKvWriteRemote, "write-done:kv"});
  if (const tx::RequestState ks = wait(kw); ks.status != tx::TransferStatus::kDone) {
    std::fprintf(stderr, "consumer: K/V WRITE ended %s (%s)\n", tx::to_string(ks.reason), agent.last_error().c_str());
    return 1;
  }
  agent.release(kw);
  std::printf("nixl: K/V pool (2 regions, gaps between blocks): one READ of 5 blocks verified; one WRITE of 2 "
              "blocks sent (the producer verifies it)\n");

  // Timing: pagedkv submit (new request per hand-off) vs a raw NIXL request of the same descriptors, re-posted.
  const capi::Api& api = capi::load().api;
  auto ag = static_cast<capi::Agent>(agent.native_agent());
  auto args = static_cast<capi::OptArgs>(agent.native_backend_args());
  const tx::PoolDesc& rp = agent.remote_pools("prefill")[0];
  capi::XferDlist ld = nullptr, rd_list = nullptr;
  api.create_xfer_dlist(capi::kDram, &ld);
  api.create_xfer_dlist(capi::kDram, &rd_list);
  for (std::size_t i = 0; i < n; ++i) {
    api.xfer_dlist_add_desc(ld, base + local[i] * a.block_bytes, a.block_bytes, 0);
    api.xfer_dlist_add_desc(rd_list, rp.regions[0].base_addr + remote[i] * a.block_bytes, a.block_bytes, 0);
  }
  capi::XferReq raw = nullptr;
  if (int s = api.create_xfer_req(ag, capi::kRead, ld, rd_list, "prefill", &raw, args); s != capi::kSuccess) {
    std::fprintf(stderr, "consumer: raw create_xfer_req: %s\n", capi::status_name(s).c_str());
    return 1;
  }
  const double bytes = static_cast<double>(n * a.block_bytes);
  std::vector<double> ours, rawv;
  for (int it = 0; it < a.iters; ++it) {
    for (int which = 0; which < 2; ++which) {
      const bool mine = (it + which) % 2 == 0;
      const auto t0 = std::chrono::steady_clock::now();
      if (mine) {
        const tx::RequestId r = agent.submit({tx::TransferOp::kRead, 0, local, "prefill", 0, remote, ""});
        if (wait(r).status != tx::TransferStatus::kDone) {
          std::fprintf(stderr, "consumer: timed READ failed (%s)\n", agent.last_error().c_str());
          return 1;
        }
        agent.release(r);
      } else {
        int s = api.post_xfer_req(ag, raw, args);
        while (s == capi::kInProgress) s = api.get_xfer_status(ag, raw);
        if (s != capi::kSuccess) {
          std::fprintf(stderr, "consumer: raw READ: %s\n", capi::status_name(s).c_str());
          return 1;
        }
      }
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (mine ? ours : rawv).push_back(bytes / sec / 1e9);
    }
  }
  api.release_xfer_req(ag, raw);
  api.destroy_xfer_req(raw);
  api.destroy_xfer_dlist(ld);
  api.destroy_xfer_dlist(rd_list);
  const double mo = median(ours), mr = median(rawv);
  std::printf("nixl: %zu blocks x %zu KiB per READ, %d READs each, alternated: pagedkv %.2f GB/s, raw NIXL %.2f GB/s "
              "(medians), ratio %.3f\n",
              n, a.block_bytes / 1024, a.iters, mo, mr, mo / mr);
  if (!agent.notify("prefill", "bye")) {
    std::fprintf(stderr, "consumer: notify failed (%s)\n", agent.last_error().c_str());
    return 1;
  }
  // Keep progressing until the producer has the goodbye (no progress thread: our polls move the bytes).
  for (int i = 0; i < 2000; ++i) {
    (void)agent.take_notifications();
    std::this_thread::sleep_for(std::chrono::microseconds(100));
    int status = 0;
    if (::waitpid(-1, &status, WNOHANG) > 0) return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 2;
  }
  return 3;  // the producer did not finish
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long v = std::strtol(argv[i + 1], nullptr, 10);
    if (k == "--blocks" && v > 1) a.blocks = static_cast<std::uint32_t>(v);
    else if (k == "--block-kib" && v > 0) a.block_bytes = static_cast<std::size_t>(v) * 1024;
    else if (k == "--iters" && v > 0) a.iters = static_cast<int>(v);
    else {
      std::fprintf(stderr, "usage: %s [--blocks N] [--block-kib K] [--iters I]\n", argv[0]);
      return 1;
    }
  }
  ::setenv("UCX_MODULES", "^ib", 0);
  ::setenv("UCX_NET_DEVICES", "lo", 0);
  // Load (and check) NIXL before forking only in a throwaway child, so both real processes start clean and a
  // missing or wrong library fails here with one clear message.
  if (pid_t probe = ::fork(); probe == 0) {
    try {
      (void)tx::nixl_library();
      ::_exit(0);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "nixl_loopback: FAIL: %s\n", e.what());
      ::_exit(1);
    }
  } else {
    int status = 0;
    ::waitpid(probe, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
  }
  int c2p[2], p2c[2];
  if (::pipe(c2p) != 0 || ::pipe(p2c) != 0) return 1;
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(c2p[0]);
    ::close(p2c[1]);
    ::_exit(producer(a, p2c[0], c2p[1]));
  }
  ::close(c2p[1]);
  ::close(p2c[0]);
  int rc = 1;
  try {
    rc = consumer(a, c2p[0], p2c[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: %s\n", e.what());
  }
  if (rc != 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, nullptr, 0);
  }
  std::printf("nixl_loopback: %s\n", rc == 0 ? "PASS" : "FAIL");
  return rc == 0 ? 0 : 1;
}
