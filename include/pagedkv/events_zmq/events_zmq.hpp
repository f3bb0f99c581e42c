// pagedkv/events_zmq/events_zmq.hpp: the whole events_zmq component in one include: KV events on the wire in
// vLLM's format (docs/events-wire.md). Link pagedkv::events_zmq.
#pragma once

#include <pagedkv/events_zmq/export.hpp>
#include <pagedkv/events_zmq/publisher.hpp>
#include <pagedkv/events_zmq/subscriber.hpp>
#include <pagedkv/events_zmq/wire.hpp>
