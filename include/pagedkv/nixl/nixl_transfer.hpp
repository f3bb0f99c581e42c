// pagedkv/nixl/nixl_transfer.hpp: the transfer interface (pagedkv/transfer.hpp) over NVIDIA NIXL, the transfer
// library vLLM's NixlConnector, Dynamo, SGLang and TensorRT-LLM use. Link pagedkv::nixl. NIXL itself is not a
// build dependency: its C API (libnixl_capi.so of the PyPI wheel nixl-cu12 == 1.5.1) is found and dlopened when
// the first agent is created (settings and refusals: docs/disaggregation.md).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <pagedkv/nixl/export.hpp>
#include <pagedkv/transfer.hpp>

namespace pagedkv::transfer {

/// How a NixlAgent sets up NIXL.
struct NixlOptions {
  /// The NIXL backend plugin ("UCX": UCX picks shared memory, TCP or RDMA; set UCX_NET_DEVICES / UCX_TLS in the
  /// environment to choose).
  std::string backend = "UCX";
  /// Backend parameters added to (or replacing) the plugin's defaults, e.g. {"num_workers", "2"}.
  std::vector<std::pair<std::string, std::string>> backend_params;
  /// NIXL's progress thread. Off by default: `poll` and `take_notifications` drive progress, and no core spins.
  /// When on, it wakes every `progress_thread_delay_us` (NIXL's pthrDelay; 0 would spin a core per agent).
  bool progress_thread = false;
  std::uint64_t progress_thread_delay_us = 1000;
};

/// Where the NIXL library was loaded from and which release it is.
struct NixlLibraryInfo {
  std::string path;
  std::string version;
};

/// Loads NIXL's C API (once per process) and describes it. Throws pagedkv::Error kInvalidArgument naming the
/// reason and the install command: not installed, a release other than 1.5.1, a missing symbol, the stub library.
[[nodiscard]] PAGEDKV_NIXL_API NixlLibraryInfo nixl_library();

/// A TransferAgent on one NIXL agent with one backend. Each registered pool is one NIXL registration (one
/// descriptor per region) and one prepared descriptor list (one descriptor per (region, block), region-major);
/// each loaded peer's pools are prepared the same way at `load_remote`; `submit` is one makeXferReq over block
/// indices + postXferReq: one request per hand-off, as vLLM's NixlConnector does. Thread safety: none.
class PAGEDKV_NIXL_API NixlAgent final : public TransferAgent {
 public:
  /// Creates NIXL agent `name` and its backend. Throws pagedkv::Error (kInvalidArgument) when NIXL cannot be
  /// loaded (nixl_library) or refuses the agent or backend (the C API status is in the message).
  explicit NixlAgent(std::string name, NixlOptions options = {});
  ~NixlAgent() override;
  NixlAgent(const NixlAgent&) = delete;
  NixlAgent& operator=(const NixlAgent&) = delete;

  [[nodiscard]] const std::string& name() const noexcept override;
  PoolId register_pool(const PoolDesc& pool) override;
  [[nodiscard]] std::span<const PoolDesc> pools() const noexcept override;
  [[nodiscard]] std::vector<std::byte> export_metadata() const override;
  std::string load_remote(std::span<const std::byte> metadata) override;
  bool invalidate_remote(std::string_view agent) override;
  [[nodiscard]] std::span<const PoolDesc> remote_pools(std::string_view agent) const override;
  RequestId submit(const TransferDesc& desc) override;
  RequestState poll(RequestId id) override;
  void release(RequestId id) override;
  bool notify(std::string_view agent, std::string_view message) override;
  std::vector<Notification> take_notifications() override;

  /// The NIXL status behind the last failed request or refused call ("" when none), e.g.
  /// "postXferReq: NIXL_CAPI_ERROR_BACKEND (-2)".
  [[nodiscard]] const std::string& last_error() const noexcept;

  /// The underlying NIXL C API handles (nixl_capi_agent_t, and an opt_args naming this agent's backend), for
  /// callers that measure or extend NIXL directly (tests/nixl compares against raw NIXL requests). Valid while
  /// this agent lives; do not destroy them.
  [[nodiscard]] void* native_agent() const noexcept;
  [[nodiscard]] void* native_backend_args() const noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedkv::transfer
