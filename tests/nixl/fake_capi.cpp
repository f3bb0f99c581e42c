// A fake libnixl_capi.so for the loader's refusals (tests/nixl/CMakeLists.txt): built twice, as NIXL's stub library
// (every symbol pagedkv binds, nixl_capi_is_stub() true: the loader must refuse it) and, with
// PAGEDKV_FAKE_CAPI_PARTIAL, as a library missing symbols (the loader must name them). Nothing here is NIXL's code:
// each entry point only returns an error.
#include <cstdbool>

#define PAGEDKV_FAKE(name) \
  extern "C" __attribute__((visibility("default"))) int nixl_capi_##name() { return -2; }

extern "C" __attribute__((visibility("default"))) bool nixl_capi_is_stub() { return true; }
PAGEDKV_FAKE(create_configured_agent)
PAGEDKV_FAKE(destroy_agent)
#ifndef PAGEDKV_FAKE_CAPI_PARTIAL
PAGEDKV_FAKE(get_local_md)
PAGEDKV_FAKE(load_remote_md)
PAGEDKV_FAKE(invalidate_remote_md)
PAGEDKV_FAKE(get_plugin_params)
PAGEDKV_FAKE(destroy_mem_list)
PAGEDKV_FAKE(destroy_params)
PAGEDKV_FAKE(params_add)
PAGEDKV_FAKE(create_backend)
PAGEDKV_FAKE(destroy_backend)
PAGEDKV_FAKE(create_opt_args)
PAGEDKV_FAKE(destroy_opt_args)
PAGEDKV_FAKE(opt_args_add_backend)
PAGEDKV_FAKE(opt_args_set_notif_msg)
PAGEDKV_FAKE(opt_args_set_has_notif)
PAGEDKV_FAKE(create_reg_dlist)
PAGEDKV_FAKE(destroy_reg_dlist)
PAGEDKV_FAKE(reg_dlist_add_desc)
PAGEDKV_FAKE(register_mem)
PAGEDKV_FAKE(deregister_mem)
PAGEDKV_FAKE(create_xfer_dlist)
PAGEDKV_FAKE(destroy_xfer_dlist)
PAGEDKV_FAKE(xfer_dlist_add_desc)
PAGEDKV_FAKE(prep_xfer_dlist)
PAGEDKV_FAKE(release_xfer_dlist_handle)
PAGEDKV_FAKE(make_xfer_req)
PAGEDKV_FAKE(create_xfer_req)
PAGEDKV_FAKE(post_xfer_req)
PAGEDKV_FAKE(get_xfer_status)
PAGEDKV_FAKE(release_xfer_req)
PAGEDKV_FAKE(destroy_xfer_req)
PAGEDKV_FAKE(gen_notif)
PAGEDKV_FAKE(create_notif_map)
PAGEDKV_FAKE(destroy_notif_map)
PAGEDKV_FAKE(get_notifs)
PAGEDKV_FAKE(notif_map_size)
PAGEDKV_FAKE(notif_map_get_agent_at)
PAGEDKV_FAKE(notif_map_get_notifs_size)
PAGEDKV_FAKE(notif_map_get_notif)
PAGEDKV_FAKE(notif_map_clear)
#endif
