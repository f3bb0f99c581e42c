// src/nixl/nixl_transfer.cpp: NixlAgent, the transfer interface over NIXL's C API (pagedkv/nixl/nixl_transfer.hpp).
#include <pagedkv/nixl/nixl_transfer.hpp>

#include <cstdlib>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <pagedkv/error.hpp>

#include "nixl_capi.hpp"

namespace pagedkv::transfer {

namespace capi = pagedkv::nixl::capi;

NixlLibraryInfo nixl_library() {
  const capi::Library& lib = capi::load();
  return {lib.path, lib.version};
}

namespace {

[[noreturn]] void refused(const std::string& call, int status) {
  pagedkv::detail::raise(Errc::kInvalidArgument, "pagedkv::nixl: " + call + " failed: " + capi::status_name(status));
}

}  // namespace

struct NixlAgent::Impl {
  const capi::Api* api = nullptr;
  std::string name;
  capi::Agent agent = nullptr;
  capi::Backend backend = nullptr;
  capi::OptArgs backend_args = nullptr;  // {backend}: passed to every call that takes opt_args

  struct LocalPool {
    capi::RegDlist reg = nullptr;
    capi::XferDlistHandle prepped = nullptr;
  };
  std::vector<PoolDesc> pools;
  std::vector<LocalPool> local;

  struct Remote {
    std::vector<PoolDesc> pools;
    std::vector<capi::XferDlistHandle> prepped;
  };
  std::map<std::string, Remote, std::less<>> remotes;

  struct Request {
    capi::XferReq req = nullptr;  // null once released to NIXL (terminal)
    std::string peer;
    RequestState state;
  };
  std::map<RequestId, Request> requests;
  RequestId next_id = 1;
  std::vector<int> local_idx, remote_idx;  // scratch for submit
  std::string last_error;

  // A descriptor list with one descriptor per (region, block), region-major: index r * num_blocks + b.
  capi::XferDlist block_dlist(const PoolDesc& p) const {
    capi::XferDlist dl = nullptr;
    const int mem = p.kind == MemoryKind::kVram ? capi::kVram : capi::kDram;
    if (int s = api->create_xfer_dlist(mem, &dl); s != capi::kSuccess) refused("create_xfer_dlist", s);
    for (const PoolRegion& r : p.regions)
      for (std::uint32_t b = 0; b < p.num_blocks; ++b)
        if (int s = api->xfer_dlist_add_desc(dl, r.base_addr + std::uintptr_t{b} * r.stride_bytes, r.block_bytes,
                                             p.device_id);
            s != capi::kSuccess) {
          api->destroy_xfer_dlist(dl);
          refused("xfer_dlist_add_desc", s);
        }
    return dl;
  }

  capi::XferDlistHandle prep(const char* agent_name, const PoolDesc& p) {
    capi::XferDlist dl = block_dlist(p);
    capi::XferDlistHandle h = nullptr;
    const int s = api->prep_xfer_dlist(agent, agent_name, dl, &h, backend_args);
    api->destroy_xfer_dlist(dl);
    if (s != capi::kSuccess) refused(std::string("prep_xfer_dlist('") + agent_name + "')", s);
    return h;
  }

  void drop_remote(Remote& r) {
    for (capi::XferDlistHandle h : r.prepped) api->release_xfer_dlist_handle(agent, h);
    r.prepped.clear();
  }

  // Hands a request back to NIXL (cancels it when still posted) and frees its handle.
  void free_req(Request& r) {
    if (r.req == nullptr) return;
    if (api->release_xfer_req(agent, r.req) == capi::kSuccess) api->destroy_xfer_req(r.req);
    r.req = nullptr;
  }

  Request& find(RequestId id, const char* what) {
    auto it = requests.find(id);
    if (it == requests.end())
      pagedkv::detail::raise(Errc::kInvalidArgument, std::string("transfer ") + what + ": request " +
                                                         std::to_string(id) + " unknown or already released");
    return it->second;
  }

  void fail(Request& r, FailReason why, const std::string& detail) {
    r.state = {TransferStatus::kFailed, why};
    last_error = detail;
  }
};

NixlAgent::NixlAgent(std::string name, NixlOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.api = &capi::load().api;
  m.name = std::move(name);
  if (m.name.empty()) pagedkv::detail::raise(Errc::kInvalidArgument, "pagedkv::nixl: empty agent name");
  const capi::Api& api = *m.api;
  capi::AgentConfig cfg{};
  cfg.enable_prog_thread = options.progress_thread;
  cfg.enable_listen_thread = false;  // metadata travels out of band (export_metadata / load_remote)
  cfg.listen_port = 0;
  cfg.thread_sync = 0;
  cfg.num_workers = 1;
  cfg.pthr_delay_us = options.progress_thread ? options.progress_thread_delay_us : 0;
  cfg.lthr_delay_us = 100000;
  cfg.capture_telemetry = false;
  if (int s = api.create_configured_agent(m.name.c_str(), &cfg, &m.agent); s != capi::kSuccess)
    refused("create_configured_agent('" + m.name + "')", s);
  // From here on the destructor of impl_ does not run (the constructor may still throw): clean up by hand.
  auto undo = [&] {
    if (m.backend_args) api.destroy_opt_args(m.backend_args);
    if (m.backend) api.destroy_backend(m.backend);
    api.destroy_agent(m.agent);
  };
  capi::MemList mems = nullptr;
  capi::Params params = nullptr;
  int s = api.get_plugin_params(m.agent, options.backend.c_str(), &mems, &params);
  if (s != capi::kSuccess) {
    undo();
    refused("get_plugin_params('" + options.backend + "') (is the plugin present?)", s);
  }
  for (const auto& [k, v] : options.backend_params) api.params_add(params, k.c_str(), v.c_str());
  s = api.create_backend(m.agent, options.backend.c_str(), params, &m.backend);
  api.destroy_mem_list(mems);
  api.destroy_params(params);
  if (s != capi::kSuccess) {
    m.backend = nullptr;
    undo();
    refused("create_backend('" + options.backend + "')", s);
  }
  if ((s = api.create_opt_args(&m.backend_args)) != capi::kSuccess ||
      (s = api.opt_args_add_backend(m.backend_args, m.backend)) != capi::kSuccess) {
    undo();
    refused("create_opt_args", s);
  }
}

NixlAgent::~NixlAgent() {
  Impl& m = *impl_;
  const capi::Api& api = *m.api;
  for (auto& [id, r] : m.requests) m.free_req(r);
  for (auto& [n, r] : m.remotes) {
    m.drop_remote(r);
    api.invalidate_remote_md(m.agent, n.c_str());
  }
  for (Impl::LocalPool& p : m.local) {
    api.release_xfer_dlist_handle(m.agent, p.prepped);
    api.deregister_mem(m.agent, p.reg, m.backend_args);
    api.destroy_reg_dlist(p.reg);
  }
  api.destroy_opt_args(m.backend_args);
  api.destroy_backend(m.backend);
  api.destroy_agent(m.agent);
}

const std::string& NixlAgent::name() const noexcept { return impl_->name; }
std::span<const PoolDesc> NixlAgent::pools() const noexcept { return impl_->pools; }
const std::string& NixlAgent::last_error() const noexcept { return impl_->last_error; }
void* NixlAgent::native_agent() const noexcept { return impl_->agent; }
void* NixlAgent::native_backend_args() const noexcept { return impl_->backend_args; }

PoolId NixlAgent::register_pool(const PoolDesc& pool) {
  validate_pool(pool);
  Impl& m = *impl_;
  const capi::Api& api = *m.api;
  Impl::LocalPool lp;
  const int mem = pool.kind == MemoryKind::kVram ? capi::kVram : capi::kDram;
  if (int s = api.create_reg_dlist(mem, &lp.reg); s != capi::kSuccess) refused("create_reg_dlist", s);
  for (const PoolRegion& r : pool.regions) {
    const std::size_t span = r.stride_bytes * (pool.num_blocks - 1) + r.block_bytes;
    if (int s = api.reg_dlist_add_desc(lp.reg, r.base_addr, span, pool.device_id, nullptr, 0); s != capi::kSuccess) {
      api.destroy_reg_dlist(lp.reg);
      refused("reg_dlist_add_desc", s);
    }
  }
  if (int s = api.register_mem(m.agent, lp.reg, m.backend_args); s != capi::kSuccess) {
    api.destroy_reg_dlist(lp.reg);
    refused("register_mem", s);
  }
  try {
    lp.prepped = m.prep("", pool);  // NIXL_INIT_AGENT ("") names the local side
    m.pools.push_back(pool);
    m.local.push_back(lp);
  } catch (...) {
    if (lp.prepped) api.release_xfer_dlist_handle(m.agent, lp.prepped);
    api.deregister_mem(m.agent, lp.reg, m.backend_args);
    api.destroy_reg_dlist(lp.reg);
    throw;
  }
  return static_cast<PoolId>(m.pools.size() - 1);
}

std::vector<std::byte> NixlAgent::export_metadata() const {
  const Impl& m = *impl_;
  void* data = nullptr;
  std::size_t len = 0;
  if (int s = m.api->get_local_md(m.agent, &data, &len); s != capi::kSuccess) refused("get_local_md", s);
  detail::AgentMetadata md;
  md.impl = "nixl";
  md.name = m.name;
  md.pools = m.pools;
  md.transport.assign(static_cast<const std::byte*>(data), static_cast<const std::byte*>(data) + len);
  std::free(data);
  return md.encode();
}

std::string NixlAgent::load_remote(std::span<const std::byte> metadata) {
  Impl& m = *impl_;
  const capi::Api& api = *m.api;
  detail::AgentMetadata md = detail::AgentMetadata::decode(metadata);
  if (md.impl != "nixl")
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer load_remote: metadata of a '" + md.impl +
                                                       "' agent, this is the NIXL transport");
  if (md.name == m.name)
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer load_remote: '" + md.name + "' is this agent itself");
  if (md.transport.empty())
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer load_remote: '" + md.name + "' has no NIXL metadata");
  if (auto it = m.remotes.find(md.name); it != m.remotes.end()) invalidate_remote(md.name);  // a restarted peer
  char* loaded = nullptr;
  if (int s = api.load_remote_md(m.agent, md.transport.data(), md.transport.size(), &loaded); s != capi::kSuccess)
    refused("load_remote_md('" + md.name + "')", s);
  const std::string nixl_name = loaded != nullptr ? loaded : "";
  std::free(loaded);
  if (nixl_name != md.name) {
    api.invalidate_remote_md(m.agent, nixl_name.c_str());
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer load_remote: NIXL metadata names agent '" + nixl_name +
                                                       "', pagedkv's header '" + md.name + "'");
  }
  Impl::Remote r;
  try {
    for (const PoolDesc& p : md.pools) r.prepped.push_back(m.prep(md.name.c_str(), p));
  } catch (...) {
    m.drop_remote(r);
    api.invalidate_remote_md(m.agent, md.name.c_str());
    throw;
  }
  r.pools = std::move(md.pools);
  m.remotes.insert_or_assign(md.name, std::move(r));
  return md.name;
}

bool NixlAgent::invalidate_remote(std::string_view agent) {
  Impl& m = *impl_;
  auto it = m.remotes.find(agent);
  if (it == m.remotes.end()) return false;
  for (auto& [id, r] : m.requests)
    if (r.peer == agent && r.state.status == TransferStatus::kInProgress) {
      m.free_req(r);
      m.fail(r, FailReason::kPeerInvalidated, "invalidate_remote('" + std::string(agent) + "')");
    }
  m.drop_remote(it->second);
  m.api->invalidate_remote_md(m.agent, it->first.c_str());
  m.remotes.erase(it);
  return true;
}

std::span<const PoolDesc> NixlAgent::remote_pools(std::string_view agent) const {
  auto it = impl_->remotes.find(agent);
  if (it == impl_->remotes.end()) return {};
  return it->second.pools;
}

RequestId NixlAgent::submit(const TransferDesc& desc) {
  Impl& m = *impl_;
  const capi::Api& api = *m.api;
  auto rit = m.remotes.find(desc.remote_agent);
  if (rit == m.remotes.end())
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer submit: remote agent '" +
                                                       std::string(desc.remote_agent) + "' is not loaded");
  detail::validate_transfer(desc, m.pools, rit->second.pools);
  const PoolDesc& lp = m.pools[desc.local_pool];
  const PoolDesc& rp = rit->second.pools[desc.remote_pool];
  const std::size_t n = desc.local_blocks.size();
  m.local_idx.clear();
  m.remote_idx.clear();
  for (std::size_t r = 0; r < lp.regions.size(); ++r)
    for (std::size_t i = 0; i < n; ++i) {
      m.local_idx.push_back(static_cast<int>(r * lp.num_blocks + desc.local_blocks[i]));
      m.remote_idx.push_back(static_cast<int>(r * rp.num_blocks + desc.remote_blocks[i]));
    }
  const RequestId id = m.next_id++;
  Impl::Request& req = m.requests[id];
  req.peer = std::string(desc.remote_agent);
  capi::OptArgs args = m.backend_args;
  capi::OptArgs notif_args = nullptr;
  if (!desc.notification.empty()) {
    int s = api.create_opt_args(&notif_args);
    if (s == capi::kSuccess) s = api.opt_args_add_backend(notif_args, m.backend);
    if (s == capi::kSuccess) s = api.opt_args_set_notif_msg(notif_args, desc.notification.data(),
                                                            desc.notification.size());
    if (s == capi::kSuccess) s = api.opt_args_set_has_notif(notif_args, true);
    if (s != capi::kSuccess) {
      api.destroy_opt_args(notif_args);
      m.fail(req, FailReason::kBackend, "opt_args for the notification: " + capi::status_name(s));
      return id;
    }
    args = notif_args;
  }
  const int op = desc.op == TransferOp::kRead ? capi::kRead : capi::kWrite;
  int s = api.make_xfer_req(m.agent, op, m.local[desc.local_pool].prepped, m.local_idx.data(), m.local_idx.size(),
                            rit->second.prepped[desc.remote_pool], m.remote_idx.data(), m.remote_idx.size(),
                            &req.req, args);
  if (s != capi::kSuccess) {
    req.req = nullptr;
    m.fail(req, FailReason::kBackend, "makeXferReq: " + capi::status_name(s));
  } else {
    s = api.post_xfer_req(m.agent, req.req, args);
    if (s == capi::kSuccess) {
      req.state = {TransferStatus::kDone, FailReason::kNone};
    } else if (s != capi::kInProgress) {
      m.free_req(req);
      m.fail(req, FailReason::kBackend, "postXferReq: " + capi::status_name(s));
    }
  }
  if (notif_args) api.destroy_opt_args(notif_args);
  return id;
}

RequestState NixlAgent::poll(RequestId id) {
  Impl& m = *impl_;
  Impl::Request& r = m.find(id, "poll");
  if (r.state.status != TransferStatus::kInProgress) return r.state;
  const int s = m.api->get_xfer_status(m.agent, r.req);
  if (s == capi::kSuccess) {
    r.state = {TransferStatus::kDone, FailReason::kNone};
  } else if (s != capi::kInProgress) {
    m.free_req(r);
    m.fail(r, FailReason::kBackend, "getXferStatus: " + capi::status_name(s));
  }
  return r.state;
}

void NixlAgent::release(RequestId id) {
  Impl& m = *impl_;
  Impl::Request& r = m.find(id, "release");
  if (r.state.status == TransferStatus::kInProgress)
    pagedkv::detail::raise(Errc::kInvalidArgument,
                           "transfer release: request " + std::to_string(id) + " is still in progress");
  m.free_req(r);
  m.requests.erase(id);
}

bool NixlAgent::notify(std::string_view agent, std::string_view message) {
  Impl& m = *impl_;
  auto it = m.remotes.find(agent);
  if (it == m.remotes.end())
    pagedkv::detail::raise(Errc::kInvalidArgument, "transfer notify: remote agent '" + std::string(agent) +
                                                       "' is not loaded");
  const int s = m.api->gen_notif(m.agent, it->first.c_str(), message.data(), message.size(), m.backend_args);
  if (s != capi::kSuccess) {
    m.last_error = "genNotif: " + capi::status_name(s);
    return false;
  }
  return true;
}

std::vector<Notification> NixlAgent::take_notifications() {
  Impl& m = *impl_;
  const capi::Api& api = *m.api;
  std::vector<Notification> out;
  capi::NotifMap map = nullptr;
  if (int s = api.create_notif_map(&map); s != capi::kSuccess) refused("create_notif_map", s);
  if (int s = api.get_notifs(m.agent, map, m.backend_args); s != capi::kSuccess) {
    api.destroy_notif_map(map);
    m.last_error = "getNotifs: " + capi::status_name(s);
    return out;
  }
  std::size_t agents = 0;
  api.notif_map_size(map, &agents);
  for (std::size_t a = 0; a < agents; ++a) {
    const char* from = nullptr;
    if (api.notif_map_get_agent_at(map, a, &from) != capi::kSuccess || from == nullptr) continue;
    std::size_t count = 0;
    api.notif_map_get_notifs_size(map, from, &count);
    for (std::size_t i = 0; i < count; ++i) {
      const void* data = nullptr;
      std::size_t len = 0;
      if (api.notif_map_get_notif(map, from, i, &data, &len) != capi::kSuccess) continue;
      out.push_back({from, std::string(static_cast<const char*>(data), len)});
    }
  }
  api.destroy_notif_map(map);
  return out;
}

}  // namespace pagedkv::transfer
