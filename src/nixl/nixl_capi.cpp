// src/nixl/nixl_capi.cpp: finds, checks and dlopens NIXL's C API library (see nixl_capi.hpp).
#include "nixl_capi.hpp"

#include <dlfcn.h>

#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include <pagedkv/error.hpp>

namespace pagedkv::nixl::capi {

static_assert(sizeof(AgentConfig) == 40 && offsetof(AgentConfig, listen_port) == 4 &&
                  offsetof(AgentConfig, thread_sync) == 8 && offsetof(AgentConfig, pthr_delay_us) == 16 &&
                  offsetof(AgentConfig, lthr_delay_us) == 24 && offsetof(AgentConfig, capture_telemetry) == 32,
              "AgentConfig must match nixl_capi_agent_config_t of NIXL 1.5.1 (x86-64 / aarch64 LP64 layout)");

std::string status_name(int status) {
  const char* n = "unknown";
  switch (status) {
    case kSuccess: n = "NIXL_CAPI_SUCCESS"; break;
    case kInProgress: n = "NIXL_CAPI_IN_PROG"; break;
    case kErrInvalidParam: n = "NIXL_CAPI_ERROR_INVALID_PARAM"; break;
    case kErrBackend: n = "NIXL_CAPI_ERROR_BACKEND"; break;
    case kErrInvalidState: n = "NIXL_CAPI_ERROR_INVALID_STATE"; break;
    case kErrException: n = "NIXL_CAPI_ERROR_EXCEPTION"; break;
    case kErrNoTelemetry: n = "NIXL_CAPI_ERROR_NO_TELEMETRY"; break;
    case kErrNotFound: n = "NIXL_CAPI_ERROR_NOT_FOUND"; break;
    default: break;
  }
  return std::string(n) + " (" + std::to_string(status) + ")";
}

namespace {

constexpr const char* kInstall = "pip install --no-deps nixl-cu12==1.5.1 (or scripts/install-deps.sh)";

[[noreturn]] void refuse(const std::string& why) {
  pagedkv::detail::raise(Errc::kInvalidArgument, "pagedkv::nixl: " + why);
}

// Runs `python -c ...` and returns its stdout (empty on any failure).
std::string ask_python(const std::string& python) {
  // Prints "<version>\n<path of libnixl_capi.so>" for the first of nixl-cu12 / nixl that is installed, without
  // importing the package (its __init__ would load NIXL's Python bindings).
  const std::string script =
      "import importlib.metadata as m, sys\n"
      "for d in ('nixl-cu12', 'nixl-cu13', 'nixl'):\n"
      "    try: dist = m.distribution(d)\n"
      "    except m.PackageNotFoundError: continue\n"
      "    for f in dist.files or []:\n"
      "        if str(f).endswith('libnixl_capi.so'):\n"
      "            print(dist.version); print(dist.locate_file(f)); sys.exit(0)\n";
  std::string cmd = "'" + python + "' -c \"" ;
  for (char c : script) {
    if (c == '"' || c == '\\' || c == '$' || c == '`') cmd += '\\';
    cmd += c;
  }
  cmd += "\" 2>/dev/null";
  std::string out;
  if (FILE* p = ::popen(cmd.c_str(), "r")) {
    std::array<char, 512> buf{};
    while (std::fgets(buf.data(), static_cast<int>(buf.size()), p) != nullptr) out += buf.data();
    ::pclose(p);
  }
  return out;
}

// The version in a wheel's METADATA next to `lib` (<site-packages>/.nixl_cu12.mesonpy.libs/libnixl_capi.so ->
// <site-packages>/nixl_cu12-<v>.dist-info/METADATA).
std::optional<std::string> wheel_version_near(const std::filesystem::path& lib) {
  std::error_code ec;
  const std::filesystem::path site = lib.parent_path().parent_path();
  for (const auto& e : std::filesystem::directory_iterator(site, ec)) {
    const std::string n = e.path().filename().string();
    if (!(n.starts_with("nixl_cu12-") || n.starts_with("nixl_cu13-") || n.starts_with("nixl-")) ||
        !n.ends_with(".dist-info"))
      continue;
    std::ifstream in(e.path() / "METADATA");
    std::string line;
    while (std::getline(in, line))
      if (line.starts_with("Version: ")) return line.substr(9);
  }
  return std::nullopt;
}

template <class Fn>
void bind(void* handle, Fn& fn, const char* symbol, std::string& missing) {
  void* p = ::dlsym(handle, symbol);
  if (p == nullptr) {
    missing += missing.empty() ? "" : ", ";
    missing += symbol;
    return;
  }
  fn = reinterpret_cast<Fn>(p);
}

Library load_once() {
  Library lib;
  std::optional<std::string> version;
  if (const char* env = std::getenv("PAGEDKV_NIXL_LIB"); env != nullptr && *env != '\0') {
    lib.path = env;
    if (!std::filesystem::exists(lib.path)) refuse("PAGEDKV_NIXL_LIB=" + lib.path + " does not exist");
    version = wheel_version_near(lib.path);
    if (!version) {
      if (const char* v = std::getenv("PAGEDKV_NIXL_VERSION")) version = v;
    }
    if (!version)
      refuse("cannot tell the NIXL version of PAGEDKV_NIXL_LIB=" + lib.path +
             " (no nixl wheel METADATA beside it); set PAGEDKV_NIXL_VERSION to vouch for a build of " +
             kPinnedVersion);
  } else {
    const char* py = std::getenv("PAGEDKV_PYTHON");
    const std::string python = (py != nullptr && *py != '\0') ? py : "python3";
    const std::string out = ask_python(python);
    const std::size_t nl = out.find('\n');
    if (nl == std::string::npos)
      refuse("NIXL is not installed for " + python + " (no nixl-cu12 / nixl package with libnixl_capi.so); " +
             "install it: " + kInstall + ", or set PAGEDKV_NIXL_LIB to libnixl_capi.so");
    version = out.substr(0, nl);
    lib.path = out.substr(nl + 1);
    while (!lib.path.empty() && (lib.path.back() == '\n' || lib.path.back() == '\r')) lib.path.pop_back();
  }
  lib.version = *version;
  if (lib.version != kPinnedVersion)
    refuse("NIXL " + lib.version + " at " + lib.path + ": pagedkv declares the C API of NIXL " + kPinnedVersion +
           " (the C API is not ABI-stable between releases); install it: " + kInstall);

  void* h = ::dlopen(lib.path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) refuse(std::string("dlopen(") + lib.path + ") failed: " + ::dlerror());
  Api& a = lib.api;
  std::string missing;
#define PAGEDKV_NIXL_BIND(name) bind(h, a.name, "nixl_capi_" #name, missing)
  PAGEDKV_NIXL_BIND(create_configured_agent);
  PAGEDKV_NIXL_BIND(destroy_agent);
  PAGEDKV_NIXL_BIND(get_local_md);
  PAGEDKV_NIXL_BIND(load_remote_md);
  PAGEDKV_NIXL_BIND(invalidate_remote_md);
  PAGEDKV_NIXL_BIND(get_plugin_params);
  PAGEDKV_NIXL_BIND(destroy_mem_list);
  PAGEDKV_NIXL_BIND(destroy_params);
  PAGEDKV_NIXL_BIND(params_add);
  PAGEDKV_NIXL_BIND(create_backend);
  PAGEDKV_NIXL_BIND(destroy_backend);
  PAGEDKV_NIXL_BIND(create_opt_args);
  PAGEDKV_NIXL_BIND(destroy_opt_args);
  PAGEDKV_NIXL_BIND(opt_args_add_backend);
  PAGEDKV_NIXL_BIND(opt_args_set_notif_msg);
  PAGEDKV_NIXL_BIND(opt_args_set_has_notif);
  PAGEDKV_NIXL_BIND(create_reg_dlist);
  PAGEDKV_NIXL_BIND(destroy_reg_dlist);
  PAGEDKV_NIXL_BIND(reg_dlist_add_desc);
  PAGEDKV_NIXL_BIND(register_mem);
  PAGEDKV_NIXL_BIND(deregister_mem);
  PAGEDKV_NIXL_BIND(create_xfer_dlist);
  PAGEDKV_NIXL_BIND(destroy_xfer_dlist);
  PAGEDKV_NIXL_BIND(xfer_dlist_add_desc);
  PAGEDKV_NIXL_BIND(prep_xfer_dlist);
  PAGEDKV_NIXL_BIND(release_xfer_dlist_handle);
  PAGEDKV_NIXL_BIND(make_xfer_req);
  PAGEDKV_NIXL_BIND(create_xfer_req);
  PAGEDKV_NIXL_BIND(post_xfer_req);
  PAGEDKV_NIXL_BIND(get_xfer_status);
  PAGEDKV_NIXL_BIND(release_xfer_req);
  PAGEDKV_NIXL_BIND(destroy_xfer_req);
  PAGEDKV_NIXL_BIND(gen_notif);
  PAGEDKV_NIXL_BIND(create_notif_map);
  PAGEDKV_NIXL_BIND(destroy_notif_map);
  PAGEDKV_NIXL_BIND(get_notifs);
  PAGEDKV_NIXL_BIND(notif_map_size);
  PAGEDKV_NIXL_BIND(notif_map_get_agent_at);
  PAGEDKV_NIXL_BIND(notif_map_get_notifs_size);
  PAGEDKV_NIXL_BIND(notif_map_get_notif);
  PAGEDKV_NIXL_BIND(notif_map_clear);
  PAGEDKV_NIXL_BIND(is_stub);
#undef PAGEDKV_NIXL_BIND
  if (!missing.empty()) {
    ::dlclose(h);
    refuse(lib.path + " (NIXL " + lib.version + ") lacks " + missing);
  }
  if (a.is_stub()) {
    ::dlclose(h);
    refuse(lib.path + " is NIXL's stub C API library (nixl_capi_is_stub() is true: built without the NIXL core); "
                      "install the real one: " + kInstall);
  }
  // Kept loaded for the life of the process: agents may outlive any one owner, and NIXL's plugins register
  // process-wide state.
  return lib;
}

}  // namespace

const Library& load() {
  static std::once_flag once;
  static std::optional<Library> lib;
  static std::string error;
  std::call_once(once, [] {
    try {
      lib = load_once();
    } catch (const pagedkv::Error& e) {
      error = e.message();
    }
  });
  if (!lib) pagedkv::detail::raise(Errc::kInvalidArgument, error);
  return *lib;
}

}  // namespace pagedkv::nixl::capi
