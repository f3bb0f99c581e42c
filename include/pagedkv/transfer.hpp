// pagedkv/transfer.hpp: the engine-side transfer interface that moves KV blocks between engines (prefill/decode
// disaggregation, KV stores): register a pool's memory, exchange agent metadata, READ / WRITE block lists as one
// request per hand-off, poll each request, notifications, peer invalidation.
//
// Modeled on TensorRT-LLM's BaseTransferAgent (cpp/include/tensorrt_llm/executor/transferAgent.h: registerMemory,
// loadRemoteAgent / getLocalAgentDesc, submitTransferRequests -> TransferStatus, notifySyncMessage /
// getNotifiedSyncMessages, invalidateRemoteAgent) and on NIXL's agent API (registerMem, getLocalMD / loadRemoteMD,
// prepXferDlist + makeXferReq with block indices, getXferStatus, genNotif / getNotifs, invalidateRemoteMD), which
// vLLM's NixlConnector drives the same way: one descriptor per (region, block), one request per hand-off.
// Implementations: pagedkv/transfer_inproc.hpp (in-process, with fault injection, for tests and fuzzers) and the
// optional component pagedkv::nixl (pagedkv/nixl/nixl_transfer.hpp: NIXL's C API, loaded at run time).
// This header moves bytes for block lists; it knows nothing of the cache manager's sequences or hand-off
// descriptors, which name the blocks to move.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <pagedkv/error.hpp>

namespace pagedkv::transfer {

/// A physical block id inside a registered pool (the block ids of pagedkv's block tables).
using BlockId = std::uint32_t;
/// Index of a registered pool in its agent (0, 1, ... in registration order; also its index in the agent's
/// metadata, so a remote peer names the pool by the same number).
using PoolId = std::uint32_t;
/// A transfer request's id, unique per agent, never 0 and never reused.
using RequestId = std::uint64_t;

/// Where a pool's memory lives. NIXL's DRAM_SEG / VRAM_SEG.
enum class MemoryKind : std::uint8_t {
  kDram = 0,  ///< Host memory.
  kVram = 1,  ///< Device memory (device_id = CUDA device ordinal). Not exercised yet: see docs/disaggregation.md.
};

/// One region of a pool: block b of the region occupies [base_addr + b * stride_bytes, + block_bytes). A KV cache
/// laid out per layer (vLLM: one K and one V tensor per layer, `[num_blocks, block_size, num_kv_heads, head_dim]`)
/// registers one region per tensor; a layer-interleaved pool registers one region.
struct PoolRegion {
  std::uintptr_t base_addr = 0;  ///< Address of block 0 of this region (host or device, as the pool's kind).
  std::size_t block_bytes = 0;   ///< Bytes of one block in this region (> 0).
  std::size_t stride_bytes = 0;  ///< Distance between blocks b and b+1 in bytes (>= block_bytes).
};

/// A pool as registered: `num_blocks` blocks, each present in every region. A transfer of block b moves b's bytes
/// in every region (one descriptor per (region, block), region-major, as vLLM's NixlConnector builds them).
struct PoolDesc {
  std::vector<PoolRegion> regions;       ///< At least one; regions of a pool never overlap.
  std::uint32_t num_blocks = 0;          ///< Blocks per region (> 0); block ids are 0 .. num_blocks-1.
  MemoryKind kind = MemoryKind::kDram;   ///< Memory space of every region.
  std::uint64_t device_id = 0;           ///< Device ordinal for kVram (0 for kDram).

  /// Bytes one block occupies over all regions (the bytes a transfer moves per block).
  [[nodiscard]] std::size_t bytes_per_block() const noexcept {
    std::size_t n = 0;
    for (const PoolRegion& r : regions) n += r.block_bytes;
    return n;
  }
};

/// Throws kInvalidArgument naming the first field of `pool` that is out of its domain (no regions, num_blocks 0,
/// block_bytes 0, stride < block_bytes, null base, a region whose end overflows, overlapping regions).
inline void validate_pool(const PoolDesc& pool) {
  auto bad = [](std::string msg) { detail::raise(Errc::kInvalidArgument, "transfer pool: " + std::move(msg)); };
  if (pool.regions.empty()) bad("regions is empty (a pool needs at least one region)");
  if (pool.num_blocks == 0) bad("num_blocks == 0");
  struct Span { std::uintptr_t lo, hi; };
  std::vector<Span> spans;
  for (std::size_t i = 0; i < pool.regions.size(); ++i) {
    const PoolRegion& r = pool.regions[i];
    const std::string at = "regions[" + std::to_string(i) + "]";
    if (r.base_addr == 0) bad(at + ".base_addr is null");
    if (r.block_bytes == 0) bad(at + ".block_bytes == 0");
    if (r.stride_bytes < r.block_bytes)
      bad(at + ".stride_bytes " + std::to_string(r.stride_bytes) + " < block_bytes " + std::to_string(r.block_bytes));
    std::uintptr_t span = 0, end = 0;
    if (__builtin_mul_overflow(std::uintptr_t{r.stride_bytes}, std::uintptr_t{pool.num_blocks - 1}, &span) ||
        __builtin_add_overflow(span, std::uintptr_t{r.block_bytes}, &span) ||
        __builtin_add_overflow(r.base_addr, span, &end))
      bad(at + " end (base_addr + stride_bytes * (num_blocks - 1) + block_bytes) overflows the address space");
    spans.push_back({r.base_addr, end});
  }
  for (std::size_t i = 0; i < spans.size(); ++i)
    for (std::size_t j = i + 1; j < spans.size(); ++j)
      if (spans[i].lo < spans[j].hi && spans[j].lo < spans[i].hi)
        bad("regions[" + std::to_string(i) + "] and regions[" + std::to_string(j) + "] overlap");
}

/// READ pulls remote blocks into local ones (the decode side of P/D pulls the prefill side's KV, as vLLM's
/// NixlConnector does); WRITE pushes local blocks into remote ones (TensorRT-LLM's and SGLang's prefill side
/// pushes). NIXL's NIXL_READ / NIXL_WRITE.
enum class TransferOp : std::uint8_t { kRead = 0, kWrite = 1 };

/// One transfer request: `local_blocks[i]` of local pool `local_pool` <-> `remote_blocks[i]` of the remote
/// agent's pool `remote_pool`, in every region of the pools. Submitted as ONE request (never one per block).
/// The spans are read during `submit` only. Preconditions (checked by submit, kInvalidArgument / kBlockOutOfRange):
/// equal non-empty lengths, ids < the pools' num_blocks, the remote agent loaded, the two pools with the same
/// number of regions and equal block_bytes region by region, and the same memory kind.
struct TransferDesc {
  TransferOp op = TransferOp::kRead;
  PoolId local_pool = 0;
  std::span<const BlockId> local_blocks;
  std::string_view remote_agent;            ///< Name from `load_remote`.
  PoolId remote_pool = 0;
  std::span<const BlockId> remote_blocks;
  /// When non-empty, delivered to the remote agent's notifications once the request is done (NIXL's notif_msg
  /// on a transfer: sent after the data; vLLM's NixlConnector tells the producer "read done" this way). Never
  /// delivered for a failed request.
  std::string_view notification;
};

/// A request's state. Exactly one terminal state (kDone or kFailed) is ever reached, and it never changes after.
enum class TransferStatus : std::uint8_t {
  kInProgress = 0,  ///< Submitted, not finished.
  kDone = 1,        ///< Every byte of every block is at its destination.
  kFailed = 2,      ///< Ended without moving every block; the destination blocks' bytes are unspecified.
};

/// Why a request failed (kNone while in progress or done).
enum class FailReason : std::uint8_t {
  kNone = 0,
  kBackend = 1,          ///< The transport reported an error (NIXL: the status code is in the message).
  kBlocksFailed = 2,     ///< Some blocks could not be moved (fault injection: chosen blocks; see failed_blocks).
  kPeerDead = 3,         ///< The peer died or was unreachable (killed process; NIXL: remote disconnect).
  kPeerInvalidated = 4,  ///< The peer's metadata was invalidated locally while the request was in flight.
  kTimedOut = 5,         ///< No completion before the transport's deadline (a lost request).
};

/// Name of a status, e.g. "in_progress". Never null.
[[nodiscard]] constexpr const char* to_string(TransferStatus s) noexcept {
  switch (s) {
    case TransferStatus::kInProgress: return "in_progress";
    case TransferStatus::kDone: return "done";
    case TransferStatus::kFailed: return "failed";
  }
  return "?";
}
/// Name of a failure reason, e.g. "peer_dead". Never null.
[[nodiscard]] constexpr const char* to_string(FailReason r) noexcept {
  switch (r) {
    case FailReason::kNone: return "none";
    case FailReason::kBackend: return "backend";
    case FailReason::kBlocksFailed: return "blocks_failed";
    case FailReason::kPeerDead: return "peer_dead";
    case FailReason::kPeerInvalidated: return "peer_invalidated";
    case FailReason::kTimedOut: return "timed_out";
  }
  return "?";
}

/// What `poll` reports about one request.
struct RequestState {
  TransferStatus status = TransferStatus::kInProgress;
  FailReason reason = FailReason::kNone;
};

/// A notification received from a peer: a transfer's notification or a standalone `notify`.
struct Notification {
  std::string from_agent;  ///< The sender's name.
  std::string message;     ///< The bytes it sent.
};

/// The engine-side transfer agent: one per engine process (or per pool owner). Thread safety: none; one thread
/// drives an agent (submit, poll, notifications), as vLLM's NixlConnector worker does.
class TransferAgent {
 public:
  virtual ~TransferAgent() = default;

  /// This agent's name (unique among the agents that exchange metadata).
  [[nodiscard]] virtual const std::string& name() const noexcept = 0;

  /// Register a pool's memory for transfers; returns its PoolId (registration order). The memory must stay valid
  /// until the agent is destroyed. Throws kInvalidArgument (validate_pool) with nothing registered. Metadata
  /// exported before a registration does not contain the new pool: export again (NIXL's rule).
  virtual PoolId register_pool(const PoolDesc& pool) = 0;

  /// The pools registered so far, in PoolId order.
  [[nodiscard]] virtual std::span<const PoolDesc> pools() const noexcept = 0;

  /// This agent's metadata (its name, its pools' layouts and the transport's connection info) to hand to a peer's
  /// `load_remote` out of band (a side channel: vLLM's NixlConnector uses a ZMQ handshake). Opaque bytes.
  [[nodiscard]] virtual std::vector<std::byte> export_metadata() const = 0;

  /// Load a peer's metadata; returns its name. Loading a peer that is already loaded first invalidates it (its
  /// requests in flight end kFailed / kPeerInvalidated), then loads the new metadata (a restarted peer).
  /// Throws kInvalidArgument when the bytes are not metadata of this implementation, or name this agent itself.
  virtual std::string load_remote(std::span<const std::byte> metadata) = 0;

  /// Forget a peer (TensorRT-LLM invalidateRemoteAgent, NIXL invalidateRemoteMD): its in-flight requests end
  /// kFailed / kPeerInvalidated, later submits to it throw until it is loaded again. Unknown names are ignored
  /// and counted (returns false).
  virtual bool invalidate_remote(std::string_view agent) = 0;

  /// The pools a loaded peer declared, or an empty span when the peer is not loaded.
  [[nodiscard]] virtual std::span<const PoolDesc> remote_pools(std::string_view agent) const = 0;

  /// Submit one READ or WRITE of a block list (TransferDesc); returns its id. Misuse (see TransferDesc) throws
  /// with nothing submitted; a transport failure is not an exception: the request ends kFailed.
  virtual RequestId submit(const TransferDesc& desc) = 0;

  /// The state of a request. Drives the transport's progress where it needs it (NIXL without a progress thread).
  /// Throws kInvalidArgument for an id never returned by submit or already released.
  virtual RequestState poll(RequestId id) = 0;

  /// Release a request in a terminal state (frees its transport handle). Throws kInvalidArgument for an unknown
  /// id or a request still in progress (NIXL cannot drop a posted request without waiting for it).
  virtual void release(RequestId id) = 0;

  /// Send a standalone notification to a loaded peer (NIXL genNotif). Returns false when the peer is known dead;
  /// throws kInvalidArgument when it is not loaded.
  virtual bool notify(std::string_view agent, std::string_view message) = 0;

  /// The notifications received since the last call, in arrival order (moves them out).
  virtual std::vector<Notification> take_notifications() = 0;
};

namespace detail {

/// Validates a TransferDesc against the local and remote pools (the common part of every implementation's
/// submit). Throws kInvalidArgument / kBlockOutOfRange naming the field.
inline void validate_transfer(const TransferDesc& d, std::span<const PoolDesc> local,
                              std::span<const PoolDesc> remote) {
  auto bad = [](Errc c, std::string msg) { pagedkv::detail::raise(c, "transfer submit: " + std::move(msg)); };
  if (d.local_pool >= local.size())
    bad(Errc::kInvalidArgument, "local_pool " + std::to_string(d.local_pool) + " >= registered pools " +
                                    std::to_string(local.size()));
  if (d.remote_pool >= remote.size())
    bad(Errc::kInvalidArgument, "remote_pool " + std::to_string(d.remote_pool) + " >= pools of '" +
                                    std::string(d.remote_agent) + "' (" + std::to_string(remote.size()) + ")");
  if (d.local_blocks.empty()) bad(Errc::kInvalidArgument, "local_blocks is empty");
  if (d.local_blocks.size() != d.remote_blocks.size())
    bad(Errc::kInvalidArgument, "local_blocks has " + std::to_string(d.local_blocks.size()) +
                                    " ids, remote_blocks " + std::to_string(d.remote_blocks.size()));
  const PoolDesc& lp = local[d.local_pool];
  const PoolDesc& rp = remote[d.remote_pool];
  if (lp.regions.size() != rp.regions.size())
    bad(Errc::kInvalidArgument, "local pool has " + std::to_string(lp.regions.size()) + " regions, remote pool " +
                                    std::to_string(rp.regions.size()));
  for (std::size_t r = 0; r < lp.regions.size(); ++r)
    if (lp.regions[r].block_bytes != rp.regions[r].block_bytes)
      bad(Errc::kInvalidArgument, "regions[" + std::to_string(r) + "].block_bytes: local " +
                                      std::to_string(lp.regions[r].block_bytes) + ", remote " +
                                      std::to_string(rp.regions[r].block_bytes));
  if (lp.kind != rp.kind) bad(Errc::kInvalidArgument, "memory kinds differ between the local and remote pool");
  for (std::size_t i = 0; i < d.local_blocks.size(); ++i) {
    if (d.local_blocks[i] >= lp.num_blocks)
      bad(Errc::kBlockOutOfRange, "local_blocks[" + std::to_string(i) + "] = " + std::to_string(d.local_blocks[i]) +
                                      " >= num_blocks " + std::to_string(lp.num_blocks));
    if (d.remote_blocks[i] >= rp.num_blocks)
      bad(Errc::kBlockOutOfRange, "remote_blocks[" + std::to_string(i) + "] = " +
                                      std::to_string(d.remote_blocks[i]) + " >= num_blocks " +
                                      std::to_string(rp.num_blocks));
  }
}

/// The metadata header both implementations write: magic "PKVX", format version, the implementation's tag, the
/// agent name and its pools' layouts, then the transport's own bytes (NIXL's getLocalMD blob; empty in process).
/// Little-endian fixed-width fields.
struct AgentMetadata {
  static constexpr std::uint32_t kMagic = 0x58564b50;  // "PKVX"
  static constexpr std::uint32_t kFormat = 1;
  std::string impl;                     ///< "inproc" or "nixl": a peer of the other kind is refused.
  std::string name;
  std::vector<PoolDesc> pools;
  std::vector<std::byte> transport;     ///< The transport's own metadata.

  [[nodiscard]] std::vector<std::byte> encode() const {
    std::vector<std::byte> out;
    auto put = [&out](std::uint64_t v, int n) {
      for (int i = 0; i < n; ++i) out.push_back(static_cast<std::byte>((v >> (8 * i)) & 0xff));
    };
    auto put_str = [&](std::string_view s) {
      put(s.size(), 4);
      for (char c : s) out.push_back(static_cast<std::byte>(c));
    };
    put(kMagic, 4);
    put(kFormat, 4);
    put_str(impl);
    put_str(name);
    put(pools.size(), 4);
    for (const PoolDesc& p : pools) {
      put(p.num_blocks, 4);
      put(static_cast<std::uint8_t>(p.kind), 1);
      put(p.device_id, 8);
      put(p.regions.size(), 4);
      for (const PoolRegion& r : p.regions) {
        put(r.base_addr, 8);
        put(r.block_bytes, 8);
        put(r.stride_bytes, 8);
      }
    }
    put(transport.size(), 8);
    out.insert(out.end(), transport.begin(), transport.end());
    return out;
  }

  /// Decodes `bytes`; throws kInvalidArgument naming what is wrong (magic, format, truncation, a pool that fails
  /// validate_pool's field checks).
  [[nodiscard]] static AgentMetadata decode(std::span<const std::byte> bytes) {
    std::size_t at = 0;
    auto fail = [](const std::string& what) {
      pagedkv::detail::raise(Errc::kInvalidArgument, "transfer metadata: " + what);
    };
    auto get = [&](int n) -> std::uint64_t {
      if (bytes.size() - at < static_cast<std::size_t>(n))
        fail("truncated at byte " + std::to_string(at) + " of " + std::to_string(bytes.size()));
      std::uint64_t v = 0;
      for (int i = 0; i < n; ++i) v |= std::uint64_t(std::to_integer<std::uint8_t>(bytes[at + i])) << (8 * i);
      at += static_cast<std::size_t>(n);
      return v;
    };
    auto get_str = [&]() {
      const std::uint64_t n = get(4);
      if (bytes.size() - at < n) fail("string of " + std::to_string(n) + " bytes runs past the end");
      std::string s(reinterpret_cast<const char*>(bytes.data() + at), static_cast<std::size_t>(n));
      at += static_cast<std::size_t>(n);
      return s;
    };
    AgentMetadata md;
    if (get(4) != kMagic) fail("bad magic (not pagedkv transfer metadata)");
    if (const std::uint64_t f = get(4); f != kFormat)
      fail("format " + std::to_string(f) + ", this build reads " + std::to_string(kFormat));
    md.impl = get_str();
    md.name = get_str();
    if (md.name.empty()) fail("empty agent name");
    const std::uint64_t np = get(4);
    if (np > bytes.size()) fail("pool count " + std::to_string(np) + " exceeds the metadata size");
    for (std::uint64_t i = 0; i < np; ++i) {
      PoolDesc p;
      p.num_blocks = static_cast<std::uint32_t>(get(4));
      const std::uint64_t kind = get(1);
      if (kind > 1) fail("pools[" + std::to_string(i) + "].kind " + std::to_string(kind) + " unknown");
      p.kind = static_cast<MemoryKind>(kind);
      p.device_id = get(8);
      const std::uint64_t nr = get(4);
      if (nr > bytes.size()) fail("region count " + std::to_string(nr) + " exceeds the metadata size");
      for (std::uint64_t r = 0; r < nr; ++r) {
        PoolRegion reg;
        reg.base_addr = static_cast<std::uintptr_t>(get(8));
        reg.block_bytes = static_cast<std::size_t>(get(8));
        reg.stride_bytes = static_cast<std::size_t>(get(8));
        p.regions.push_back(reg);
      }
      validate_pool(p);
      md.pools.push_back(std::move(p));
    }
    const std::uint64_t nt = get(8);
    if (bytes.size() - at != nt)
      fail("transport part is " + std::to_string(bytes.size() - at) + " bytes, header says " + std::to_string(nt));
    md.transport.assign(bytes.begin() + static_cast<std::ptrdiff_t>(at), bytes.end());
    return md;
  }
};

}  // namespace detail
}  // namespace pagedkv::transfer
