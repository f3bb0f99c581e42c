// src/nixl/nixl_capi.hpp (private to pagedkv::nixl): the part of NIXL's C API (libnixl_capi.so) pagedkv calls,
// declared by hand for the pinned release (nixl-cu12 == 1.5.1 on PyPI, which ships the library and no headers),
// and the loader that finds, checks and dlopens it at run time.
//
// The declarations follow NIXL's published C API (src/bindings/rust/wrapper.h of ai-dynamo/nixl; the C wrapper
// around nixlAgent that nixl-sys binds) as checked against the 1.5.1 wheel: its 104 exported nixl_capi_* symbols
// are that header's set plus opt_args_{get,set}_custom_param, and nixl_capi_create_configured_agent of the wheel
// reads the config struct at the offsets below (listen_port as a 32-bit int at offset 4, thread_sync at 8,
// pthr_delay_us at 16, lthr_delay_us at 24, capture_telemetry at 32: objdump of the 1.5.1 library).
// Ownership (1.5.1): buffers returned through out-pointers (local metadata, a loaded agent's name) come from
// malloc / strdup and are released with free(); notification bytes live as long as their notification map.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pagedkv::nixl::capi {

/// nixl_capi_status_t: 0 success, 1 in progress, negative errors.
enum Status : int {
  kSuccess = 0,
  kInProgress = 1,
  kErrInvalidParam = -1,
  kErrBackend = -2,
  kErrInvalidState = -3,
  kErrException = -4,
  kErrNoTelemetry = -5,
  kErrNotFound = -6,
};

/// Name of a C API status, e.g. "NIXL_CAPI_ERROR_BACKEND (-2)".
std::string status_name(int status);

enum MemType : int { kDram = 0, kVram = 1 };
enum XferOp : int { kRead = 0, kWrite = 1 };

/// nixl_capi_agent_config_t of NIXL 1.5.1 (40 bytes; layout checked by static_asserts in nixl_capi.cpp).
struct AgentConfig {
  bool enable_prog_thread;
  bool enable_listen_thread;
  int listen_port;
  int thread_sync;  // nixl_capi_thread_sync_t: 0 none, 1 strict, 2 rw
  unsigned int num_workers;
  std::uint64_t pthr_delay_us;
  std::uint64_t lthr_delay_us;
  bool capture_telemetry;
};

// Opaque handles.
struct Agent_;
struct Params_;
struct MemList_;
struct Backend_;
struct OptArgs_;
struct XferDlist_;
struct XferDlistHandle_;
struct RegDlist_;
struct XferReq_;
struct NotifMap_;
using Agent = Agent_*;
using Params = Params_*;
using MemList = MemList_*;
using Backend = Backend_*;
using OptArgs = OptArgs_*;
using XferDlist = XferDlist_*;
using XferDlistHandle = XferDlistHandle_*;
using RegDlist = RegDlist_*;
using XferReq = XferReq_*;
using NotifMap = NotifMap_*;

/// The functions pagedkv calls, resolved with dlsym. Each member is named after its nixl_capi_ symbol.
struct Api {
  int (*create_configured_agent)(const char* name, const AgentConfig* cfg, Agent* agent);
  int (*destroy_agent)(Agent agent);
  int (*get_local_md)(Agent agent, void** data, std::size_t* len);
  int (*load_remote_md)(Agent agent, const void* data, std::size_t len, char** agent_name);
  int (*invalidate_remote_md)(Agent agent, const char* remote_agent);
  int (*get_plugin_params)(Agent agent, const char* plugin, MemList* mems, Params* params);
  int (*destroy_mem_list)(MemList list);
  int (*destroy_params)(Params params);
  int (*params_add)(Params params, const char* key, const char* value);
  int (*create_backend)(Agent agent, const char* plugin, Params params, Backend* backend);
  int (*destroy_backend)(Backend backend);
  int (*create_opt_args)(OptArgs* args);
  int (*destroy_opt_args)(OptArgs args);
  int (*opt_args_add_backend)(OptArgs args, Backend backend);
  int (*opt_args_set_notif_msg)(OptArgs args, const void* data, std::size_t len);
  int (*opt_args_set_has_notif)(OptArgs args, bool has_notif);
  int (*create_reg_dlist)(int mem_type, RegDlist* dlist);
  int (*destroy_reg_dlist)(RegDlist dlist);
  int (*reg_dlist_add_desc)(RegDlist dlist, std::uintptr_t addr, std::size_t len, std::uint64_t dev_id,
                            const void* metadata, std::size_t metadata_len);
  int (*register_mem)(Agent agent, RegDlist dlist, OptArgs opt_args);
  int (*deregister_mem)(Agent agent, RegDlist dlist, OptArgs opt_args);
  int (*create_xfer_dlist)(int mem_type, XferDlist* dlist);
  int (*destroy_xfer_dlist)(XferDlist dlist);
  int (*xfer_dlist_add_desc)(XferDlist dlist, std::uintptr_t addr, std::size_t len, std::uint64_t dev_id);
  int (*prep_xfer_dlist)(Agent agent, const char* agent_name, XferDlist descs, XferDlistHandle* handle,
                         OptArgs opt_args);
  int (*release_xfer_dlist_handle)(Agent agent, XferDlistHandle handle);
  int (*make_xfer_req)(Agent agent, int op, XferDlistHandle local, const int* local_indices, std::size_t n_local,
                       XferDlistHandle remote, const int* remote_indices, std::size_t n_remote, XferReq* req,
                       OptArgs opt_args);
  int (*create_xfer_req)(Agent agent, int op, XferDlist local, XferDlist remote, const char* remote_agent,
                         XferReq* req, OptArgs opt_args);
  int (*post_xfer_req)(Agent agent, XferReq req, OptArgs opt_args);
  int (*get_xfer_status)(Agent agent, XferReq req);
  int (*release_xfer_req)(Agent agent, XferReq req);
  int (*destroy_xfer_req)(XferReq req);
  int (*gen_notif)(Agent agent, const char* remote_agent, const void* data, std::size_t len, OptArgs opt_args);
  int (*create_notif_map)(NotifMap* map);
  int (*destroy_notif_map)(NotifMap map);
  int (*get_notifs)(Agent agent, NotifMap map, OptArgs opt_args);
  int (*notif_map_size)(NotifMap map, std::size_t* size);
  int (*notif_map_get_agent_at)(NotifMap map, std::size_t index, const char** agent_name);
  int (*notif_map_get_notifs_size)(NotifMap map, const char* agent_name, std::size_t* size);
  int (*notif_map_get_notif)(NotifMap map, const char* agent_name, std::size_t index, const void** data,
                             std::size_t* len);
  int (*notif_map_clear)(NotifMap map);
  bool (*is_stub)();
};

/// What the loader found.
struct Library {
  Api api{};
  std::string path;     ///< The libnixl_capi.so loaded.
  std::string version;  ///< The NIXL release (e.g. "1.5.1").
};

/// The release whose C API these declarations match.
inline constexpr const char* kPinnedVersion = "1.5.1";

/// Finds, checks and loads libnixl_capi.so once per process (later calls return the same library or rethrow the
/// same error). The path: $PAGEDKV_NIXL_LIB when set, else the installed wheel as python3 ($PAGEDKV_PYTHON, else
/// `python3`) reports it (importlib.metadata of nixl-cu12, or nixl). The version: the wheel's metadata; for a
/// library named by $PAGEDKV_NIXL_LIB outside a wheel, $PAGEDKV_NIXL_VERSION must vouch for it. Refuses (throws
/// pagedkv::Error kInvalidArgument with the reason and the install command): no library found, a version other
/// than kPinnedVersion, a missing symbol (named), NIXL's stub library (nixl_capi_is_stub() true).
const Library& load();

}  // namespace pagedkv::nixl::capi
