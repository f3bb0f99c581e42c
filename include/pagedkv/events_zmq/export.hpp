// pagedkv/events_zmq/export.hpp: the export macro of the optional events_zmq component (libpagedkv_events_zmq).
#pragma once

#include <pagedkv/config.hpp>

/// Marks the functions and classes compiled into libpagedkv_events_zmq (src/events_zmq/). The component is built
/// with hidden visibility like the core library, so only these are exported from a shared build.
#if defined(PAGEDKV_EVENTS_ZMQ_STATIC_DEFINE)
#define PAGEDKV_EVENTS_ZMQ_API
#elif defined(_WIN32)
#if defined(PAGEDKV_EVENTS_ZMQ_BUILDING_LIBRARY)
#define PAGEDKV_EVENTS_ZMQ_API __declspec(dllexport)
#else
#define PAGEDKV_EVENTS_ZMQ_API __declspec(dllimport)
#endif
#else
#define PAGEDKV_EVENTS_ZMQ_API __attribute__((visibility("default")))
#endif
