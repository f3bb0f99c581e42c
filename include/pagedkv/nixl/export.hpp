// pagedkv/nixl/export.hpp: the export macro of the optional nixl component (libpagedkv_nixl).
#pragma once

#include <pagedkv/config.hpp>

/// Marks the classes compiled into libpagedkv_nixl (src/nixl/). The component is built with hidden visibility like
/// the core library, so only these are exported from a shared build.
#if defined(PAGEDKV_NIXL_STATIC_DEFINE)
#define PAGEDKV_NIXL_API
#else
#define PAGEDKV_NIXL_API __attribute__((visibility("default")))
#endif
